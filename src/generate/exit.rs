//! Adaptive exit: after which loop iteration a token's output is read, decided by an exit rule,
//! and what happens to the iterations after it (`exit_policy`).
//!
//! Two kinds of rule:
//! * Ouro's exit gate decides per position. After iteration t the gate reads the (loop-normed)
//!   state: λ_t = σ(exit_gate · x_t + bias); the exit distribution is p_t = λ_t ∏_{s<t} (1 − λ_s),
//!   the last iteration taking the rest, and a position exits at the first iteration whose
//!   cumulative probability reaches the threshold (the last one when none does). Probabilities
//!   are evaluated in f32 in that order, as the model's reference code does; the gate's dot
//!   product is summed in f64 on the host from the f32 state.
//! * Huginn's criteria ([`criteria`]) decide per call: the rows of one step (the prompt, or one
//!   generated token) iterate together and stop together.
//!
//! Policies, for the gate:
//! * `reference`: every iteration runs and writes its KV for every position, exactly as the
//!   model's code does; the output is the exit iteration's.
//! * `skip`: a generated token stops iterating at its exit iteration, and the KV slots of the
//!   iterations it skipped receive copies of its exit iteration's entries (so later tokens attend
//!   to its deepest computed state at those depths). Prompt positions run every iteration.
//!
//! For a criterion every call stops at its exit iteration (the prompt's too), as Huginn's code
//! does. `reference`: the skipped slots stay empty, and later positions attending at those depths
//! leave the call's positions out (the KV cache's depth mask), as Huginn's cache does. `skip`:
//! the skipped slots get copies of the exit iteration's entries, as for the gate.

use std::fmt;
use std::str::FromStr;
use std::sync::atomic::AtomicBool;

use super::criteria::{criterion_step, Criterion};
use super::sampling::Rng;
use super::{first_token, next_choice, Output};
use crate::backend::{Backend, Choice, Chosen, StepInput};
use crate::error::{Error, Result};
use crate::kv::Application;
use crate::model::config::ModelConfig;
use crate::model::forward::{
    forward, restore_rows, run, save_rows, stage, step_rows, Buffers, CallRows, Span,
};
use crate::model::layout::Stage;
use crate::model::weights::Weights;

/// The exit rule of a call (`exit`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ExitRule {
    /// The exit gate with a cumulative-probability threshold; `None` takes the model's own
    /// (`architecture.exit_threshold`).
    Gate { threshold: Option<f64> },
    /// One of Huginn's criteria with a threshold; `None` takes the criterion's default (the
    /// reference's "auto").
    Criterion {
        criterion: Criterion,
        threshold: Option<f64>,
    },
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
                 probability), entropy-diff, latent-diff, cosine, kl or minp-kl, each alone or \
                 with :T (T >= 0), or argmax-stability (alias argmax), alone or with :N (N an \
                 integer >= 0)"
            ))
        };
        let (name, value) = match s.split_once(':') {
            Some((name, value)) => (name, Some(value.parse::<f64>().map_err(|_| bad())?)),
            None => (s, None),
        };
        if name == "gate" {
            if let Some(t) = value {
                check_threshold(t).map_err(|_| bad())?;
            }
            return Ok(ExitRule::Gate { threshold: value });
        }
        let criterion = Criterion::from_name(name).ok_or_else(bad)?;
        if let Some(t) = value {
            criterion.check_threshold(t).map_err(|_| bad())?;
        }
        Ok(ExitRule::Criterion {
            criterion,
            threshold: value,
        })
    }
}

impl fmt::Display for ExitRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (name, threshold) = match self {
            ExitRule::Gate { threshold } => ("gate", threshold),
            ExitRule::Criterion {
                criterion,
                threshold,
            } => (criterion.name(), threshold),
        };
        match threshold {
            None => f.write_str(name),
            Some(t) => write!(f, "{name}:{t}"),
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

/// What decides the exit, with its threshold resolved.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Decision {
    Gate(f64),
    Criterion(Criterion, f64),
}

/// An exit rule resolved against a model, and the policy.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ResolvedExit {
    pub decision: Decision,
    pub policy: ExitPolicy,
}

impl Exit {
    /// The rule for a model of `config`. The gate needs a model with one (`gate` alone takes its
    /// threshold); a criterion applies to any model.
    pub(crate) fn resolve(self, config: &ModelConfig) -> Result<ResolvedExit> {
        let decision = match self.rule {
            ExitRule::Gate { threshold } => {
                let arch = &config.architecture;
                if !arch.exit_gate {
                    return Err(Error::invalid(format!(
                        "exit rule {}: this model has no exit gate (the criteria entropy-diff, \
                         latent-diff, cosine, kl, minp-kl and argmax-stability need none)",
                        self.rule
                    )));
                }
                Decision::Gate(threshold.or(arch.exit_threshold).ok_or_else(|| {
                    Error::invalid(
                        "exit rule gate: the model names no default threshold; use gate:T",
                    )
                })?)
            }
            ExitRule::Criterion {
                criterion,
                threshold,
            } => Decision::Criterion(
                criterion,
                threshold.unwrap_or(criterion.default_threshold()),
            ),
        };
        Ok(ResolvedExit {
            decision,
            policy: self.policy,
        })
    }
}

/// The span of a step before its first loop iteration: the embedding and the pre blocks.
pub(super) const BEFORE_LOOP: Span = Span {
    start: true,
    first: 1,
    last: 0,
    post: false,
};

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
    threshold: f64,
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
    run(backend, w, buf, rows, BEFORE_LOOP, Some(cancel))?;
    let mut gates = GateRows::new(rows, threshold);
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

/// What an exit step decided: each row's exit iteration and, with a criterion, its value after
/// each iteration the step ran.
#[derive(Default)]
pub(crate) struct Decided {
    pub exits: Vec<usize>,
    pub values: Vec<f64>,
}

/// Run one step with the exit rule; `generated`: its row is a generated token (the gate's skip
/// policy applies to those only).
#[allow(clippy::too_many_arguments)]
fn exit_rows<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    input: StepInput,
    loops: usize,
    exit: ResolvedExit,
    generated: bool,
    saved: &mut B::Float,
    cancel: &AtomicBool,
) -> Result<Decided> {
    let skip = exit.policy == ExitPolicy::Skip;
    match exit.decision {
        Decision::Gate(threshold) => {
            let skip = skip && generated;
            Ok(Decided {
                exits: exit_step(
                    backend, w, buf, input, loops, threshold, skip, saved, cancel,
                )?,
                values: Vec::new(),
            })
        }
        Decision::Criterion(criterion, threshold) => {
            let rows = input.tokens.len();
            let rule = (criterion, threshold);
            let values = criterion_step(backend, w, buf, input, loops, rule, skip, saved, cancel)?;
            Ok(Decided {
                exits: vec![values.len(); rows],
                values,
            })
        }
    }
}

/// Feed `tokens` from position `start` (the positions before it are in the cache: a prefix) in
/// the steps [`step_rows`] cuts, the last one (carrying `choice`) with the exit rule at `loops`
/// iterations; `each(buf, offset, rows, decided)` sees every step (`offset` into `tokens`;
/// `decided` empty for the earlier steps, whose outputs nobody reads). With the gate,
/// the earlier steps run every iteration unless `every_step_exits`, and every step takes the
/// reference policy; with a criterion every step is a call that exits. Returns what the last
/// step decided.
#[allow(clippy::too_many_arguments)]
pub(crate) fn prompt_steps<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    tokens: &[u32],
    start: usize,
    loops: usize,
    exit: ResolvedExit,
    choice: Choice,
    every_step_exits: bool,
    cancel: &AtomicBool,
    mut each: impl FnMut(&mut Buffers<B>, usize, usize, &Decided) -> Result<()>,
) -> Result<Decided> {
    let mut saved = backend.alloc_float(buf.max_rows * w.config.dim)?;
    let every_step_exits = every_step_exits || matches!(exit.decision, Decision::Criterion(..));
    let _call = CallRows::new(backend, tokens.len());
    let mut offset = 0;
    let mut decided = Decided::default();
    while offset < tokens.len() {
        let rows = step_rows(buf, start + offset, tokens.len() - offset);
        let last = offset + rows == tokens.len();
        let input = StepInput {
            tokens: &tokens[offset..offset + rows],
            start_pos: start + offset,
            choice: if last { choice } else { Choice::Greedy },
        };
        decided = if last || every_step_exits {
            exit_rows(
                backend, w, buf, input, loops, exit, false, &mut saved, cancel,
            )?
        } else {
            forward(backend, w, buf, input, loops, cancel)?;
            Decided::default()
        };
        each(buf, offset, rows, &decided)?;
        offset += rows;
    }
    Ok(decided)
}

/// Generation with an exit rule: the prompt (after `start` positions already in the cache), then
/// one decode step per token, at the rule's policy; each token records its exit iteration.
#[allow(clippy::too_many_arguments)]
pub(crate) fn generate<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    prompt: &[u32],
    start: usize,
    exit: ResolvedExit,
    out: &mut Output,
    choice: Choice,
    rng: &mut Rng,
) -> Result<()> {
    let (loops, sampling, entropy) = (out.req.loops, out.req.sampling, out.measures());
    let cancel = out.cancel;
    let mut decided = prompt_steps(
        backend,
        w,
        buf,
        prompt,
        start,
        loops,
        exit,
        choice,
        false,
        cancel,
        |_, _, _, _| Ok(()),
    )?;
    // The token comes from the step's last row.
    let last_exit = |decided: &Decided| decided.exits[decided.exits.len() - 1];
    let mut next = first_token(backend, w, buf, decided.exits.len() - 1, entropy)?;
    let mut saved = backend.alloc_float(w.config.dim)?;
    let mut pos = start + prompt.len();
    while out.push_exited(next, last_exit(&decided), decided.values)? {
        let input = StepInput {
            tokens: &[next.token],
            start_pos: pos,
            choice: next_choice(&sampling, rng),
        };
        (next, decided) = token_step(
            backend, w, buf, input, loops, exit, entropy, &mut saved, cancel,
        )?;
        pos += 1;
    }
    Ok(())
}

/// A generated token's step with the exit rule at up to `loops` iterations: feed it (`input`,
/// one row) and choose the next token from its exit iteration's output. `saved` holds one state.
#[allow(clippy::too_many_arguments)]
pub(crate) fn token_step<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    input: StepInput,
    loops: usize,
    exit: ResolvedExit,
    entropy: bool,
    saved: &mut B::Float,
    cancel: &AtomicBool,
) -> Result<(Chosen, Decided)> {
    let decided = generated_step(backend, w, buf, input, loops, exit, saved, cancel)?;
    Ok((first_token(backend, w, buf, 0, entropy)?, decided))
}

/// Feed a generated token (`input`, one row) with the exit rule at up to `loops` iterations,
/// leaving its output state in the residual stream, ready for the head.
#[allow(clippy::too_many_arguments)]
pub(crate) fn generated_step<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    input: StepInput,
    loops: usize,
    exit: ResolvedExit,
    saved: &mut B::Float,
    cancel: &AtomicBool,
) -> Result<Decided> {
    exit_rows(backend, w, buf, input, loops, exit, true, saved, cancel)
}

/// The KV entries of positions `start..start + rows` at iteration `last_run`, copied into the
/// slots of iterations `last_run + 1..=loops` (exit policy skip).
pub(super) fn copy_skipped_kv<B: Backend>(
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
        for s in [
            "gate",
            "gate:0.5",
            "gate:0",
            "gate:1",
            "entropy-diff",
            "entropy-diff:0.02",
            "latent-diff:0.1",
            "cosine",
            "kl",
            "kl:0.005",
            "minp-kl:0.00001",
            "argmax-stability",
            "argmax-stability:2",
            "kl:0",
        ] {
            assert_eq!(s.parse::<ExitRule>().unwrap().to_string(), s);
        }
        // Other spellings of the same numbers, and the alias, print in one form.
        for (s, printed) in [
            ("kl:1e-3", "kl:0.001"),
            ("argmax", "argmax-stability"),
            ("argmax:3", "argmax-stability:3"),
            ("minp-kl:1e-5", "minp-kl:0.00001"),
        ] {
            let rule: ExitRule = s.parse().unwrap();
            assert_eq!(rule.to_string(), printed);
            assert_eq!(printed.parse::<ExitRule>().unwrap(), rule);
        }
        assert_eq!(
            "kl".parse::<ExitRule>().unwrap(),
            ExitRule::Criterion {
                criterion: Criterion::Kl,
                threshold: None
            }
        );
        for bad in [
            "",
            "gate:",
            "gate:1.5",
            "gate:-0.1",
            "gate:nan",
            "kl:1e-3x",
            "Gate",
            "kl:",
            "kl:-1e-3",
            "kl:inf",
            "cosine:nan",
            "entropy",
            "argmax:2.5",
            "argmax-stability:-1",
            "none",
            "kl:0.1:2",
        ] {
            let err = bad.parse::<ExitRule>().unwrap_err().to_string();
            for form in [
                "gate:T",
                "entropy-diff",
                "minp-kl",
                "argmax-stability",
                "argmax",
            ] {
                assert!(err.contains(form), "{bad}: {err}");
            }
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
