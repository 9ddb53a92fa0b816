//! Adaptive exit: after which loop iteration a position's output is read, decided per position by
//! an exit rule, and whether the iterations after it still run (`exit_policy`).
//!
//! The rule is Ouro's exit gate. After iteration t the gate reads the (loop-normed) state:
//! λ_t = σ(exit_gate · x_t + bias); the exit distribution is p_t = λ_t ∏_{s<t} (1 − λ_s), the
//! last iteration taking the rest, and a position exits at the first iteration whose cumulative
//! probability reaches the threshold (the last one when none does). Probabilities are evaluated
//! in f32 in that order, as the model's reference code does; the gate's dot product is summed in
//! f64 on the host from the f32 state.
//!
//! * `reference`: every iteration runs and writes its KV for every position, exactly as the
//!   model's code does; the output is the exit iteration's.
//! * `skip`: a generated token stops iterating at its exit iteration, and the KV slots of the
//!   iterations it skipped receive copies of its exit iteration's entries (so later tokens attend
//!   to its deepest computed state at those depths). Prompt positions run every iteration.

use std::fmt;
use std::str::FromStr;
use std::sync::atomic::AtomicBool;

use super::sampling::Rng;
use super::{first_token, next_choice, Output};
use crate::backend::{Backend, Choice, StepInput};
use crate::error::{Error, Result};
use crate::kv::Application;
use crate::model::config::ModelConfig;
use crate::model::forward::{
    forward, restore_rows, run, save_rows, stage, step_rows, Buffers, Span,
};
use crate::model::layout::Stage;
use crate::model::weights::Weights;

/// The exit rule of a call (`exit`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ExitRule {
    /// The exit gate with a cumulative-probability threshold; `None` takes the model's own
    /// (`architecture.exit_threshold`).
    Gate { threshold: Option<f64> },
}

/// What happens to the iterations after a position's exit (`exit_policy`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ExitPolicy {
    /// They run, as in the model's reference code; only the output is the exit iteration's.
    #[default]
    Reference,
    /// They are skipped (generated tokens); their KV slots get the exit iteration's entries.
    Skip,
}

/// An exit rule and its policy.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Exit {
    pub rule: ExitRule,
    pub policy: ExitPolicy,
}

impl FromStr for ExitRule {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let bad = || {
            Error::invalid(format!(
                "exit rule {s:?}: expected gate or gate:T (T in [0, 1], the cumulative exit \
                 probability)"
            ))
        };
        match s.split_once(':') {
            None if s == "gate" => Ok(ExitRule::Gate { threshold: None }),
            Some(("gate", t)) => {
                let t: f64 = t.parse().map_err(|_| bad())?;
                check_threshold(t).map_err(|_| bad())?;
                Ok(ExitRule::Gate { threshold: Some(t) })
            }
            _ => Err(bad()),
        }
    }
}

impl fmt::Display for ExitRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExitRule::Gate { threshold: None } => write!(f, "gate"),
            ExitRule::Gate { threshold: Some(t) } => write!(f, "gate:{t}"),
        }
    }
}

impl FromStr for ExitPolicy {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "reference" => Ok(ExitPolicy::Reference),
            "skip" => Ok(ExitPolicy::Skip),
            _ => Err(Error::invalid(format!(
                "exit_policy {s:?}: expected reference or skip"
            ))),
        }
    }
}

impl fmt::Display for ExitPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ExitPolicy::Reference => "reference",
            ExitPolicy::Skip => "skip",
        })
    }
}

/// An exit threshold (`exit_threshold`) lies in [0, 1].
pub fn check_threshold(t: f64) -> Result<()> {
    if (0.0..=1.0).contains(&t) {
        Ok(())
    } else {
        Err(Error::invalid(format!(
            "exit_threshold {t} must lie in [0, 1]"
        )))
    }
}

/// The gate rule's state for the rows of one step, iteration after iteration.
pub(crate) struct GateRows {
    threshold: f32,
    /// ∏ (1 − λ_s) over the iterations so far.
    remaining: Vec<f32>,
    cumulative: Vec<f32>,
    /// The exit iteration (1-based) of each row, once decided.
    pub exit_at: Vec<Option<usize>>,
}

impl GateRows {
    pub fn new(rows: usize, threshold: f64) -> GateRows {
        GateRows {
            // The reference compares its f32 cumulative sums with the threshold as f32.
            threshold: threshold as f32,
            remaining: vec![1.0; rows],
            cumulative: vec![0.0; rows],
            exit_at: vec![None; rows],
        }
    }

    /// Take the gate logits of iteration `t` (`last`: the call's last iteration); returns the
    /// rows that exit at `t`.
    pub fn observe(&mut self, t: usize, last: bool, gate_logits: &[f32]) -> Vec<usize> {
        let mut exiting = Vec::new();
        for (row, &g) in gate_logits.iter().enumerate() {
            let lambda = sigmoid(g);
            let p = if last {
                self.remaining[row]
            } else {
                lambda * self.remaining[row]
            };
            self.remaining[row] *= 1.0 - lambda;
            self.cumulative[row] += p;
            let reached = self.cumulative[row] >= self.threshold || last;
            if self.exit_at[row].is_none() && reached {
                self.exit_at[row] = Some(t);
                exiting.push(row);
            }
        }
        exiting
    }
}

/// σ(x) in f32, as `torch.sigmoid` evaluates it.
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// The gate's logit for each of `rows` states of width `dim`: `weight · x + bias`, summed in f64.
pub(crate) fn gate_logits(weight: &[f32], bias: f32, states: &[f32], dim: usize) -> Vec<f32> {
    states
        .chunks_exact(dim)
        .map(|x| {
            let dot: f64 = x
                .iter()
                .zip(weight)
                .map(|(&a, &b)| a as f64 * b as f64)
                .sum();
            (dot + bias as f64) as f32
        })
        .collect()
}

/// An exit rule resolved against a model: the gate's threshold, and the policy.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GateExit {
    pub threshold: f64,
    pub policy: ExitPolicy,
}

impl Exit {
    /// The rule for a model of `config`: it must have an exit gate; `gate` alone takes its
    /// threshold.
    pub(crate) fn resolve(self, config: &ModelConfig) -> Result<GateExit> {
        let ExitRule::Gate { threshold } = self.rule;
        let arch = &config.architecture;
        if !arch.exit_gate {
            return Err(Error::invalid(format!(
                "exit rule {}: this model has no exit gate",
                self.rule
            )));
        }
        let threshold = threshold.or(arch.exit_threshold).ok_or_else(|| {
            Error::invalid("exit rule gate: the model names no default threshold; use gate:T")
        })?;
        Ok(GateExit {
            threshold,
            policy: self.policy,
        })
    }
}

/// Run one step (`input`, all its rows) through the whole network at up to `loops` iterations
/// with the exit rule, leaving each row's output state (its exit iteration's, after the post
/// blocks) in the residual stream, ready for the head. `saved` holds `max_rows` states. With
/// `skip`, iterations stop once every row has exited and the skipped iterations' KV slots get
/// copies of the exit iteration's entries. Returns each row's exit iteration (1-based).
#[allow(clippy::too_many_arguments)]
pub(crate) fn exit_step<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    input: StepInput,
    loops: usize,
    exit: GateExit,
    skip: bool,
    saved: &mut B::Float,
    cancel: &AtomicBool,
) -> Result<Vec<usize>> {
    let gate = w
        .exit_gate
        .as_ref()
        .ok_or_else(|| Error::invalid("exit rule: this model has no exit gate"))?;
    let (rows, start, d) = (input.tokens.len(), input.start_pos, w.config.dim);
    stage(backend, w, buf, input, loops)?;
    let before_loop = Span {
        start: true,
        first: 1,
        last: 0,
        post: false,
    };
    run(backend, w, buf, rows, before_loop, Some(cancel))?;
    let mut gates = GateRows::new(rows, exit.threshold);
    let mut ran = loops;
    for t in 1..=loops {
        run(backend, w, buf, rows, Span::iterations(t, t), Some(cancel))?;
        let states = backend.read_float(buf.residual(), 0, rows * d)?;
        let logits = gate_logits(&gate.weight, gate.bias, &states, d);
        for row in gates.observe(t, t == loops, &logits) {
            save_rows(backend, buf, row, saved, row, 1);
        }
        if skip && t < loops && gates.exit_at.iter().all(Option::is_some) {
            copy_skipped_kv(backend, buf, t, loops, start, rows)?;
            ran = t;
            break;
        }
    }
    let exit_at: Vec<usize> = gates
        .exit_at
        .iter()
        .map(|e| e.expect("the last iteration decides every row"))
        .collect();
    for (row, &t) in exit_at.iter().enumerate() {
        if t < ran {
            restore_rows(backend, buf, saved, row, row, 1);
        }
    }
    run(backend, w, buf, rows, Span::post(), Some(cancel))?;
    Ok(exit_at)
}

/// Feed `tokens` from position 0 in the steps [`step_rows`] cuts, the last one (carrying
/// `choice`) with the exit rule at `loops` iterations and the reference policy; `each(buf,
/// offset, rows, exits)` sees every step (`exits` empty for the earlier ones, whose outputs
/// nobody reads). Returns the rows and the exit iterations of the last step.
#[allow(clippy::too_many_arguments)]
pub(crate) fn prompt_steps<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    tokens: &[u32],
    loops: usize,
    exit: GateExit,
    choice: Choice,
    every_step_exits: bool,
    cancel: &AtomicBool,
    mut each: impl FnMut(&mut Buffers<B>, usize, usize, &[usize]) -> Result<()>,
) -> Result<Vec<usize>> {
    let mut saved = backend.alloc_float(buf.max_rows * w.config.dim)?;
    let mut offset = 0;
    let mut exits = Vec::new();
    while offset < tokens.len() {
        let rows = step_rows(buf, offset, tokens.len() - offset);
        let last = offset + rows == tokens.len();
        let input = StepInput {
            tokens: &tokens[offset..offset + rows],
            start_pos: offset,
            choice: if last { choice } else { Choice::Greedy },
        };
        exits = if last || every_step_exits {
            exit_step(
                backend, w, buf, input, loops, exit, false, &mut saved, cancel,
            )?
        } else {
            forward(backend, w, buf, input, loops, cancel)?;
            Vec::new()
        };
        each(buf, offset, rows, &exits)?;
        offset += rows;
    }
    Ok(exits)
}

/// Generation with an exit rule: the prompt at the reference policy, then one decode step per
/// token at the rule's policy; each token records its exit iteration.
#[allow(clippy::too_many_arguments)]
pub(crate) fn generate<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    prompt: &[u32],
    exit: GateExit,
    out: &mut Output,
    choice: Choice,
    rng: &mut Rng,
) -> Result<()> {
    let (loops, sampling, entropy) = (out.req.loops, out.req.sampling, out.measures());
    let cancel = out.cancel;
    let exits = prompt_steps(
        backend,
        w,
        buf,
        prompt,
        loops,
        exit,
        choice,
        false,
        cancel,
        |_, _, _, _| Ok(()),
    )?;
    let last = exits.len() - 1;
    let mut next = first_token(backend, w, buf, last, entropy)?;
    let mut next_exit = exits[last];
    let mut saved = backend.alloc_float(w.config.dim)?;
    let skip = exit.policy == ExitPolicy::Skip;
    let mut pos = prompt.len();
    while out.push_exited(next, next_exit)? {
        let input = StepInput {
            tokens: &[next.token],
            start_pos: pos,
            choice: next_choice(&sampling, rng),
        };
        next_exit = exit_step(
            backend, w, buf, input, loops, exit, skip, &mut saved, cancel,
        )?[0];
        next = first_token(backend, w, buf, 0, entropy)?;
        pos += 1;
    }
    Ok(())
}

/// The KV entries of positions `start..start + rows` at iteration `last_run`, copied into the
/// slots of iterations `last_run + 1..=loops` (exit policy skip).
fn copy_skipped_kv<B: Backend>(
    backend: &B,
    buf: &mut Buffers<B>,
    last_run: usize,
    loops: usize,
    start: usize,
    rows: usize,
) -> Result<()> {
    let layout = &buf.kv.layout;
    let slot = |block, iteration| {
        layout.slot(Application {
            stage: Stage::Loop,
            block,
            iteration,
        })
    };
    let mut ranges = Vec::new();
    for iteration in last_run + 1..=loops {
        for block in 0..layout.loop_blocks() {
            let (from, to) = (slot(block, last_run), slot(block, iteration));
            ranges.extend(layout.entry_copies(from, to, start, rows)?);
        }
    }
    backend.kv_copy_within(&mut buf.kv, &ranges)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_and_policies_parse_and_print() {
        for s in ["gate", "gate:0.5", "gate:0", "gate:1"] {
            assert_eq!(s.parse::<ExitRule>().unwrap().to_string(), s);
        }
        for bad in [
            "",
            "gate:",
            "gate:1.5",
            "gate:-0.1",
            "gate:nan",
            "kl:1e-3x",
            "Gate",
        ] {
            assert!(bad.parse::<ExitRule>().is_err(), "{bad}");
        }
        for s in ["reference", "skip"] {
            assert_eq!(s.parse::<ExitPolicy>().unwrap().to_string(), s);
        }
        assert!("all".parse::<ExitPolicy>().is_err());
    }

    #[test]
    fn the_last_iteration_takes_the_rest() {
        // λ = 0.5 each time: p = 0.5, 0.25, 0.125, then the remaining 0.125.
        let mut rows = GateRows::new(2, 0.8);
        assert!(rows.observe(1, false, &[0.0, 30.0]) == vec![1]);
        assert!(rows.observe(2, false, &[0.0, 0.0]).is_empty());
        assert_eq!(rows.observe(3, false, &[0.0, 0.0]), vec![0]); // 0.875 ≥ 0.8
        assert!(rows.observe(4, true, &[0.0, 0.0]).is_empty());
        assert_eq!(rows.exit_at, vec![Some(3), Some(1)]);
        let mut never = GateRows::new(1, 1.0);
        for t in 1..4 {
            never.observe(t, false, &[-5.0]);
        }
        assert_eq!(never.observe(4, true, &[-5.0]), vec![0]);
    }
}
