//! Tensor names and shapes that a config implies (the naming contract of docs/FORMAT.md).

use super::architecture::LoopInput;
use super::config::{HeadKind, ModelConfig, NormKind};

/// Which stage of the network a block belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    Pre,
    Loop,
    Post,
}

impl Stage {
    pub fn prefix(self) -> &'static str {
        match self {
            Stage::Pre => "pre",
            Stage::Loop => "loop",
            Stage::Post => "post",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorRole {
    /// A linear weight `[out, in]`: f16, int4 or int2.
    Linear,
    /// A norm weight, a norm or projection bias: f16.
    Vector,
    /// The embedding table: f16.
    Table,
}

impl TensorRole {
    pub fn describe(self) -> &'static str {
        match self {
            TensorRole::Linear => "linear weight (f16, int4 or int2)",
            TensorRole::Vector => "norm weight or bias (f16)",
            TensorRole::Table => "embedding table (f16)",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<u64>,
    pub role: TensorRole,
}

impl TensorSpec {
    /// A linear that synth and convert quantize: the five of each block and the loop adapter's
    /// (the embedding, its projection, the exit gate and the head stay f16).
    pub fn is_quantizable(&self) -> bool {
        self.role == TensorRole::Linear && self.name.contains('.')
    }
}

/// The five quantized weights of a block, named as in the seed pages.
pub const BLOCK_LINEARS: [&str; 5] = ["attn_qkv", "attn_out", "mlp_gate", "mlp_up", "mlp_down"];

pub fn block_name(stage: Stage, index: usize) -> String {
    format!("{}.{index}", stage.prefix())
}

/// Every block of the model in file order: `(stage, index within stage)`.
pub fn blocks(config: &ModelConfig) -> Vec<(Stage, usize)> {
    let stage = |s: Stage, n: usize| (0..n).map(move |i| (s, i));
    stage(Stage::Pre, config.n_pre_blocks)
        .chain(stage(Stage::Loop, config.n_loop_blocks))
        .chain(stage(Stage::Post, config.n_post_blocks))
        .collect()
}

/// `[out, in]` of a block linear.
pub fn linear_shape(config: &ModelConfig, linear: &str) -> [usize; 2] {
    let (d, f) = (config.dim, config.ffn_dim);
    match linear {
        "attn_qkv" => [config.qkv_dim(), d],
        "attn_out" => [d, d],
        "mlp_gate" | "mlp_up" => [f, d],
        "mlp_down" => [d, f],
        other => unreachable!("unknown block linear {other}"),
    }
}

fn norm_specs(name: &str, config: &ModelConfig, out: &mut Vec<TensorSpec>) {
    let shape = vec![config.dim as u64];
    out.push(TensorSpec {
        name: name.to_string(),
        shape: shape.clone(),
        role: TensorRole::Vector,
    });
    if config.norm == NormKind::LayerNorm {
        out.push(TensorSpec {
            name: format!("{name}.bias"),
            shape,
            role: TensorRole::Vector,
        });
    }
}

/// The complete tensor table a valid file for `config` must contain.
pub fn expected_tensors(config: &ModelConfig) -> Vec<TensorSpec> {
    let mut out = Vec::new();
    let linear = |name: String, [n, k]: [usize; 2]| TensorSpec {
        name,
        shape: vec![n as u64, k as u64],
        role: TensorRole::Linear,
    };
    let r = config.embed_factor_dim;
    let embed_width = if r > 0 { r } else { config.dim };
    out.push(TensorSpec {
        name: "embed".into(),
        shape: vec![config.vocab_size as u64, embed_width as u64],
        role: TensorRole::Table,
    });
    if r > 0 {
        out.push(linear("embed_proj".into(), [config.dim, r]));
    }
    let arch = &config.architecture;
    let vector = |name: String, len: usize| TensorSpec {
        name,
        shape: vec![len as u64],
        role: TensorRole::Vector,
    };
    for (stage, index) in blocks(config) {
        let block = block_name(stage, index);
        for norm in block_norm_names(config) {
            norm_specs(&format!("{block}.{norm}"), config, &mut out);
        }
        for name in BLOCK_LINEARS {
            out.push(linear(
                format!("{block}.{name}"),
                linear_shape(config, name),
            ));
        }
        if arch.qkv_bias {
            out.push(vector(format!("{block}.attn_qkv.bias"), config.qkv_dim()));
        }
    }
    if arch.loop_input == LoopInput::Adapter {
        for name in ADAPTER_LINEARS {
            out.push(linear(name.into(), [config.dim, config.dim]));
        }
    }
    norm_specs("final_norm", config, &mut out);
    if arch.exit_gate {
        out.push(linear("exit_gate".into(), [1, config.dim]));
        out.push(vector("exit_gate.bias".into(), 1));
    }
    if config.head == HeadKind::Untied {
        out.push(linear("head".into(), [config.vocab_size, config.dim]));
    }
    out
}

/// The halves of the loop adapter `[D, 2D]` over `concat(state, e)`: `adapter.state · state +
/// adapter.input · e`. Stored and quantized like block linears.
pub const ADAPTER_LINEARS: [&str; 2] = ["adapter.state", "adapter.input"];

/// The norms of each block, in the order they apply: before and (sandwich layouts) after
/// attention, then the same around the MLP.
pub fn block_norm_names(config: &ModelConfig) -> &'static [&'static str] {
    if config.architecture.block_norms.has_out_norms() {
        &["attn_norm", "attn_out_norm", "mlp_norm", "mlp_out_norm"]
    } else {
        &["attn_norm", "mlp_norm"]
    }
}
