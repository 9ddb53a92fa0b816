//! The choices in which looped model families differ, as data (`config.architecture`,
//! docs/FORMAT.md version 2). The forward pass reads them; a converter maps a family's
//! checkpoint onto them. The default is TinyLoop's own layout, which version-1 files have.

use serde::{Deserialize, Serialize};

/// Where a block's norms sit around each of its two sublayers `f` (attention, then the MLP).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BlockNorms {
    /// `x = x + f(norm(x))`.
    #[default]
    Pre,
    /// `x = x + norm_out(f(norm(x)))` (Ouro).
    Sandwich,
    /// `x = norm_out(x + f(norm(x)))` (Huginn).
    SandwichResidual,
}

impl BlockNorms {
    /// Whether blocks carry the output norms `attn_out_norm` and `mlp_out_norm`.
    pub fn has_out_norms(self) -> bool {
        self != BlockNorms::Pre
    }
}

/// What enters each loop iteration besides the state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LoopInput {
    /// Nothing: the iteration transforms the state alone.
    #[default]
    None,
    /// `x = adapter · concat(x, e)` before the iteration's blocks, with `e` the output of the pre
    /// blocks; stored as its two halves `adapter.state · x + adapter.input · e` (Huginn).
    Adapter,
}

/// The state the first loop iteration starts from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LoopState {
    /// The output of the pre blocks (or the embedding).
    #[default]
    Carry,
    /// A fresh random state per position: normal with standard deviation `state_std`, truncated
    /// at ±3 standard deviations (Huginn). Needs a loop input to see the prompt at all.
    Random,
}

/// Where the `final_norm` weights normalize the state besides before the head.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LoopNorm {
    #[default]
    None,
    /// After every loop iteration; the normed state feeds the next iteration, the exit gate and
    /// the head (Ouro).
    EachIteration,
    /// Once after the last iteration, before the post blocks (Huginn).
    AfterLoop,
}

/// `config.architecture`. Every key is required when the object is present.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Architecture {
    pub block_norms: BlockNorms,
    /// Each block adds `attn_qkv.bias` to its QKV projection (before RoPE).
    pub qkv_bias: bool,
    /// The embedding is multiplied by this before the first block (the tied head is not).
    pub embed_scale: f64,
    pub loop_input: LoopInput,
    pub loop_state: LoopState,
    /// Standard deviation of a [`LoopState::Random`] initial state; 0 otherwise.
    pub state_std: f64,
    pub loop_norm: LoopNorm,
    /// Whether `final_norm` is applied before the head (false when the loop norm already did).
    pub head_norm: bool,
    /// An exit gate `exit_gate [1, D]` + `exit_gate.bias [1]` reads the state after every loop
    /// iteration: λ = σ(exit_gate · state + bias).
    pub exit_gate: bool,
    /// The exit threshold the model's own code applies by default (Ouro's rule), if any.
    pub exit_threshold: Option<f64>,
}

impl Default for Architecture {
    fn default() -> Self {
        Architecture {
            block_norms: BlockNorms::Pre,
            qkv_bias: false,
            embed_scale: 1.0,
            loop_input: LoopInput::None,
            loop_state: LoopState::Carry,
            state_std: 0.0,
            loop_norm: LoopNorm::None,
            head_norm: true,
            exit_gate: false,
            exit_threshold: None,
        }
    }
}

impl Architecture {
    /// TinyLoop's own layout: what a version-1 file describes.
    pub fn is_default(&self) -> bool {
        *self == Architecture::default()
    }

    /// Range checks and the relations between the choices (`n_post_blocks` of the config).
    pub fn validate(&self, n_post_blocks: usize) -> Result<(), String> {
        let finite_positive = |x: f64| x > 0.0 && x.is_finite() && (x as f32).is_finite();
        if !finite_positive(self.embed_scale) {
            return Err(format!(
                "embed_scale {:e} must be positive and finite as f32",
                self.embed_scale
            ));
        }
        match self.loop_state {
            LoopState::Carry if self.state_std != 0.0 => {
                return Err(format!(
                    "state_std {:e} given for a loop that carries its state (must be 0)",
                    self.state_std
                ))
            }
            LoopState::Random if !finite_positive(self.state_std) => {
                return Err(format!(
                    "state_std {:e} must be positive and finite as f32",
                    self.state_std
                ))
            }
            LoopState::Random if self.loop_input == LoopInput::None => {
                return Err(
                    "a random loop state needs a loop input (the loop would never see \
                            the prompt)"
                        .into(),
                )
            }
            _ => {}
        }
        if !self.head_norm && self.loop_norm != LoopNorm::EachIteration {
            return Err("head_norm may be false only when loop_norm is each_iteration".into());
        }
        if !self.head_norm && n_post_blocks > 0 {
            return Err(
                "head_norm false with post blocks would feed the head an unnormed state".into(),
            );
        }
        if let Some(t) = self.exit_threshold {
            if !self.exit_gate {
                return Err("exit_threshold given without an exit gate".into());
            }
            if !(0.0..=1.0).contains(&t) {
                return Err(format!("exit_threshold {t} must lie in [0, 1]"));
            }
        }
        Ok(())
    }
}
