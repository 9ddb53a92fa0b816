//! Exit criteria that need no exit gate, as Huginn's reference code defines them
//! (`generate_with_adaptive_compute` and its exit evaluators; docs/ABI.md "Adaptive exit").
//!
//! A call's rows iterate together. After each iteration a value is computed either from the
//! distribution at the call's last row (the post blocks, final norm and head run on the current
//! state: `entropy-diff`, `kl`, `minp-kl`, `argmax-stability`) or from the loop states of all its
//! rows (`latent-diff`, `cosine`), and compared with the threshold; the call stops at the first
//! iteration where the criterion fires, else after its last. Values are computed in f64 from the
//! f32 logits and states (docs/NUMERICS.md "Exit criteria").

use std::fmt;
use std::sync::atomic::AtomicBool;

use super::exit::{copy_skipped_kv, BEFORE_LOOP};
use super::sampling::argmax;
use crate::backend::{Backend, StepInput};
use crate::error::{Error, Result};
use crate::model::architecture::LoopState;
use crate::model::forward::{
    final_norm, logits, restore_rows, run, save_rows, stage, Buffers, Span,
};
use crate::model::weights::Weights;

/// A criterion of Huginn's reference code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Criterion {
    /// |H(p_k) − H(p_{k−1})| < T (nats), H(p_0) = 100.
    EntropyDiff,
    /// The mean over rows of ‖s_k − s_{k−1}‖ / ‖s_k‖ < T, s_0 the initial loop state.
    LatentDiff,
    /// 1 − the mean over rows of cos(s_k, s_{k−1}) < T.
    Cosine,
    /// KL(p_{k−1} ‖ p_k) < T, p_0 uniform over the vocabulary.
    Kl,
    /// [`Criterion::Kl`] between min-p filtered distributions.
    MinpKl,
    /// The argmax of p_k has stayed the same for N consecutive iterations (N ≥ T).
    ArgmaxStability,
}

/// Probabilities below this fraction of the largest are replaced by 1/V (`minp-kl`).
const MIN_P: f64 = 0.1;
/// The entropy "before" the first iteration (`entropy-diff`).
const FIRST_ENTROPY: f64 = 100.0;
/// Added to each probability inside the entropy's logarithm, as the reference does.
const ENTROPY_EPS: f64 = 1e-10;

impl Criterion {
    pub const ALL: [Criterion; 6] = [
        Criterion::EntropyDiff,
        Criterion::LatentDiff,
        Criterion::Cosine,
        Criterion::Kl,
        Criterion::MinpKl,
        Criterion::ArgmaxStability,
    ];

    /// The name in an exit rule string.
    pub fn name(self) -> &'static str {
        match self {
            Criterion::EntropyDiff => "entropy-diff",
            Criterion::LatentDiff => "latent-diff",
            Criterion::Cosine => "cosine",
            Criterion::Kl => "kl",
            Criterion::MinpKl => "minp-kl",
            Criterion::ArgmaxStability => "argmax-stability",
        }
    }

    /// The criterion a rule string names (`argmax` is short for `argmax-stability`).
    pub fn from_name(name: &str) -> Option<Criterion> {
        if name == "argmax" {
            return Some(Criterion::ArgmaxStability);
        }
        Criterion::ALL.into_iter().find(|c| c.name() == name)
    }

    /// The reference's threshold when none is given ("auto").
    pub fn default_threshold(self) -> f64 {
        match self {
            Criterion::EntropyDiff | Criterion::Cosine | Criterion::Kl => 1e-3,
            Criterion::LatentDiff => 0.03,
            Criterion::MinpKl => 1e-5,
            Criterion::ArgmaxStability => 5.0,
        }
    }

    /// A threshold for this criterion: a finite number ≥ 0, an integer for argmax-stability.
    pub fn check_threshold(self, t: f64) -> Result<()> {
        let integer = self != Criterion::ArgmaxStability || t.fract() == 0.0;
        if t.is_finite() && t >= 0.0 && integer && t <= u32::MAX as f64 {
            Ok(())
        } else {
            Err(Error::invalid(format!(
                "exit criterion {self}: threshold {t} must be {}",
                if self == Criterion::ArgmaxStability {
                    "an integer >= 0 (iterations)"
                } else {
                    "a finite number >= 0"
                }
            )))
        }
    }

    /// Whether the value comes from the last row's logits (else from the loop states).
    fn reads_logits(self) -> bool {
        !matches!(self, Criterion::LatentDiff | Criterion::Cosine)
    }
}

impl fmt::Display for Criterion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What a criterion remembers of the previous iteration.
enum Previous {
    Entropy(f64),
    LogProbs(Vec<f64>),
    States(Vec<f32>),
    Argmax { token: Option<u32>, stable: u32 },
}

/// A criterion through one call: the previous iteration's values, starting where the reference
/// starts them.
pub(crate) struct Evaluator {
    criterion: Criterion,
    threshold: f64,
    previous: Previous,
}

impl Evaluator {
    /// The state before iteration 1 for `vocab` logits, or (latent criteria) the call's initial
    /// loop states.
    pub fn new(criterion: Criterion, threshold: f64, vocab: usize, initial: Vec<f32>) -> Self {
        let previous = match criterion {
            Criterion::EntropyDiff => Previous::Entropy(FIRST_ENTROPY),
            Criterion::Kl | Criterion::MinpKl => {
                Previous::LogProbs(vec![-(vocab as f64).ln(); vocab])
            }
            Criterion::LatentDiff | Criterion::Cosine => Previous::States(initial),
            Criterion::ArgmaxStability => Previous::Argmax {
                token: None,
                stable: 0,
            },
        };
        Evaluator {
            criterion,
            threshold,
            previous,
        }
    }

    /// Take the last row's logits (logit criteria) or every row's state, `dim` wide (latent
    /// criteria), after an iteration; returns the criterion's value and whether it fires.
    pub fn observe(&mut self, values: &[f32], dim: usize) -> (f64, bool) {
        let value = match &mut self.previous {
            Previous::Entropy(previous) => {
                let entropy = entropy(&probabilities(values));
                let change = (entropy - *previous).abs();
                *previous = entropy;
                change
            }
            Previous::LogProbs(previous) => {
                let mut probs = probabilities(values);
                if self.criterion == Criterion::MinpKl {
                    min_p(&mut probs);
                }
                let log_probs: Vec<f64> = probs.iter().map(|p| p.ln()).collect();
                let kl = kl(previous, &log_probs);
                *previous = log_probs;
                kl
            }
            Previous::States(previous) => {
                let value = if self.criterion == Criterion::LatentDiff {
                    mean_relative_change(previous, values, dim)
                } else {
                    1.0 - mean_cosine(previous, values, dim)
                };
                previous.copy_from_slice(values);
                value
            }
            Previous::Argmax { token, stable } => {
                let now = argmax(values);
                *stable = if *token == Some(now) { *stable + 1 } else { 0 };
                *token = Some(now);
                return (*stable as f64, *stable as f64 >= self.threshold);
            }
        };
        // NaN (a zero state) never fires.
        (value, value < self.threshold)
    }
}

/// softmax of a row of logits, in f64.
fn probabilities(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let exps: Vec<f64> = logits.iter().map(|&l| (l as f64 - max).exp()).collect();
    let total: f64 = exps.iter().sum();
    exps.into_iter().map(|e| e / total).collect()
}

/// −Σ p ln(p + 1e-10).
fn entropy(probs: &[f64]) -> f64 {
    -probs
        .iter()
        .map(|p| p * (p + ENTROPY_EPS).ln())
        .sum::<f64>()
}

/// Replace the probabilities below `MIN_P` times the largest by 1/V, and renormalize.
fn min_p(probs: &mut [f64]) {
    let max = probs.iter().copied().fold(0.0, f64::max);
    let uniform = 1.0 / probs.len() as f64;
    for p in probs.iter_mut() {
        if *p < MIN_P * max {
            *p = uniform;
        }
    }
    let total: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= total);
}

/// KL(p ‖ q) = Σ p (ln p − ln q) from log-probabilities.
fn kl(log_p: &[f64], log_q: &[f64]) -> f64 {
    log_p
        .iter()
        .zip(log_q)
        .map(|(&lp, &lq)| lp.exp() * (lp - lq))
        .sum()
}

fn rows_of<'a>(
    a: &'a [f32],
    b: &'a [f32],
    dim: usize,
) -> impl Iterator<Item = (&'a [f32], &'a [f32])> {
    a.chunks_exact(dim).zip(b.chunks_exact(dim))
}

fn norm(x: &[f32]) -> f64 {
    x.iter().map(|&v| v as f64 * v as f64).sum::<f64>().sqrt()
}

/// The mean over rows of ‖now − before‖ / ‖now‖.
fn mean_relative_change(before: &[f32], now: &[f32], dim: usize) -> f64 {
    let rows = now.len() / dim;
    let total: f64 = rows_of(before, now, dim)
        .map(|(b, n)| {
            let diff = b
                .iter()
                .zip(n)
                .map(|(&b, &n)| (n as f64 - b as f64).powi(2))
                .sum::<f64>()
                .sqrt();
            diff / norm(n)
        })
        .sum();
    total / rows as f64
}

/// The mean over rows of now · before / (‖now‖ ‖before‖).
fn mean_cosine(before: &[f32], now: &[f32], dim: usize) -> f64 {
    let rows = now.len() / dim;
    let total: f64 = rows_of(before, now, dim)
        .map(|(b, n)| {
            let dot: f64 = b.iter().zip(n).map(|(&b, &n)| b as f64 * n as f64).sum();
            dot / norm(n) / norm(b)
        })
        .sum();
    total / rows as f64
}

/// Run one call (`input`, all its rows) through the network at up to `loops` iterations with
/// `criterion`, stopping after the iteration where it fires; the call's output state (after the
/// post blocks) is left in the residual stream, ready for the head. The positions skip the
/// iterations after the exit: with `skip` their slots get copies of the exit iteration's
/// entries, else the depth mask records where they stopped. `saved` holds `rows` states.
/// Returns the criterion's value after each iteration run: as many as the exit iteration.
#[allow(clippy::too_many_arguments)]
pub(crate) fn criterion_step<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    input: StepInput,
    loops: usize,
    (criterion, threshold): (Criterion, f64),
    skip: bool,
    saved: &mut B::Float,
    cancel: &AtomicBool,
) -> Result<Vec<f64>> {
    let (rows, start, d) = (input.tokens.len(), input.start_pos, w.config.dim);
    let vocab = w.config.vocab_size;
    stage(backend, w, buf, input, loops)?;
    run(backend, w, buf, rows, BEFORE_LOOP, Some(cancel))?;
    let initial = if criterion.reads_logits() {
        Vec::new()
    } else {
        initial_states(backend, w, buf, start, rows)?
    };
    let mut evaluator = Evaluator::new(criterion, threshold, vocab, initial);
    let mut values = Vec::with_capacity(loops);
    // Whether the residual stream already holds the exit state's post-block output.
    let mut post_done = false;
    for t in 1..=loops {
        run(backend, w, buf, rows, Span::iterations(t, t), Some(cancel))?;
        let (value, fires) = if criterion.reads_logits() {
            // The reference's predict_from_latents: the post blocks (writing their KV for
            // every row) and the head, from the current state, which is kept for the next
            // iteration.
            save_rows(backend, buf, 0, saved, 0, rows);
            run(backend, w, buf, rows, Span::post(), Some(cancel))?;
            final_norm(backend, w, buf, rows);
            logits(backend, w, buf, rows - 1, 1);
            let last = backend.read_float(&buf.logits, 0, vocab)?;
            let (value, fires) = evaluator.observe(&last, vocab);
            post_done = fires || t == loops;
            if !post_done {
                restore_rows(backend, buf, saved, 0, 0, rows);
            }
            (value, fires)
        } else {
            let states = backend.read_float(buf.residual(), 0, rows * d)?;
            evaluator.observe(&states, d)
        };
        values.push(value);
        if fires {
            break;
        }
    }
    let exit = values.len();
    if exit < loops {
        if skip {
            copy_skipped_kv(backend, buf, exit, loops, start, rows)?;
        } else {
            buf.stop_depths(backend, start, rows, exit as u32)?;
        }
    }
    if !post_done {
        run(backend, w, buf, rows, Span::post(), Some(cancel))?;
    }
    Ok(values)
}

/// The loop states the staged rows start iteration 1 from (the residual stream holds the pre
/// blocks' output): that output itself, or the drawn initial states.
fn initial_states<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &Buffers<B>,
    start: usize,
    rows: usize,
) -> Result<Vec<f32>> {
    let (arch, d) = (&w.config.architecture, w.config.dim);
    match arch.loop_state {
        LoopState::Carry => backend.read_float(buf.residual(), 0, rows * d),
        LoopState::Random => {
            let mut states = crate::alloc::zeroed::<f32>(rows * d, "initial loop states")?;
            buf.state_init.fill(arch, start, rows, d, &mut states);
            Ok(states)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generate::exit::{Exit, ExitPolicy};
    use crate::kv::{Application, KvCache, ALL_DEPTHS};
    use crate::model::layout::Stage;
    use crate::model::synth::{preset, random_model};
    use crate::shared::SessionState;
    use crate::{Device, GenerateParams, Model, ModelOptions, Session};

    fn run(criterion: Criterion, threshold: f64, steps: &[&[f32]], dim: usize) -> Vec<(f64, bool)> {
        let vocab = steps[0].len();
        let initial = vec![0.0; steps[0].len()];
        let mut e = Evaluator::new(criterion, threshold, vocab, initial);
        steps.iter().map(|s| e.observe(s, dim)).collect()
    }

    #[test]
    fn names_and_defaults_are_the_references() {
        for c in Criterion::ALL {
            assert_eq!(Criterion::from_name(c.name()), Some(c));
            c.check_threshold(c.default_threshold()).unwrap();
        }
        assert_eq!(
            Criterion::from_name("argmax"),
            Some(Criterion::ArgmaxStability)
        );
        assert_eq!(Criterion::from_name("gate"), None);
        assert!(Criterion::ArgmaxStability.check_threshold(2.5).is_err());
        assert!(Criterion::Kl.check_threshold(-1e-3).is_err());
        assert!(Criterion::Kl.check_threshold(f64::INFINITY).is_err());
    }

    #[test]
    fn logit_criteria_start_from_the_references_first_values() {
        // Uniform logits: entropy ln 4, and KL 0 from the uniform start.
        let uniform: &[f32] = &[0.0; 4];
        let (value, fires) = run(Criterion::EntropyDiff, 1e-3, &[uniform], 4)[0];
        assert!((value - (100.0 - 4f64.ln())).abs() < 1e-9 && !fires);
        let (value, fires) = run(Criterion::Kl, 1e-3, &[uniform], 4)[0];
        assert!(value.abs() < 1e-12 && fires);
        // KL(uniform ‖ p) for p = softmax(ln 1, ln 3) = (1/4, 3/4).
        let skewed: &[f32] = &[0.0, 3f32.ln()];
        let expect = 0.5 * ((0.5f64 / 0.25).ln() + (0.5f64 / 0.75).ln());
        let (value, _) = run(Criterion::Kl, 1e-3, &[skewed], 2)[0];
        assert!((value - expect).abs() < 1e-7, "{value} {expect}");
        // Entropy stops changing once the distribution does.
        let values = run(Criterion::EntropyDiff, 1e-3, &[skewed, skewed], 2);
        assert!(values[1].0.abs() < 1e-12 && values[1].1);
    }

    #[test]
    fn min_p_lifts_small_probabilities_to_uniform() {
        let mut probs = vec![0.9, 0.05, 0.05, 0.0];
        min_p(&mut probs);
        // 0.05 < 0.09: each small entry becomes 1/4, then all are renormalized.
        let total = 0.9 + 3.0 * 0.25;
        assert!((probs[0] - 0.9 / total).abs() < 1e-12);
        assert!(probs[1..].iter().all(|&p| (p - 0.25 / total).abs() < 1e-12));
    }

    #[test]
    fn argmax_stability_counts_unchanged_iterations() {
        let a: &[f32] = &[1.0, 0.0];
        let b: &[f32] = &[0.0, 1.0];
        let values: Vec<(f64, bool)> = run(Criterion::ArgmaxStability, 2.0, &[a, a, b, b, b], 2);
        let stable: Vec<f64> = values.iter().map(|v| v.0).collect();
        assert_eq!(stable, [0.0, 1.0, 0.0, 1.0, 2.0]);
        assert_eq!(values.iter().position(|v| v.1), Some(4));
    }

    const LOOPS: usize = 6;

    /// Generate with `argmax-stability:1` (calls stop once the argmax repeats) at 6 loops on a
    /// synthetic model with two loop blocks and a post block, and hand the session to `check`
    /// with the prompt length and each token's exit iteration.
    fn generated(policy: ExitPolicy, check: impl FnOnce(&mut Session, usize, &[u32])) {
        let path = std::env::temp_dir().join(format!(
            "tinyloop-criteria-test-{}-{policy}.tinyloop",
            std::process::id()
        ));
        random_model(&preset("tiny-gqa").unwrap(), 5, 4, 32)
            .unwrap()
            .write(&path)
            .unwrap();
        let options = ModelOptions {
            device: Some(Device::Cpu),
            max_seq_len: 64,
            log: false,
            ..ModelOptions::default()
        };
        let model = Model::open(&path, &options).unwrap();
        std::fs::remove_file(&path).unwrap();
        let mut session = model.new_session().unwrap();
        let prompt = [3, 1, 4, 1, 5, 9, 2];
        let params = GenerateParams {
            max_tokens: 12,
            loops: Some(LOOPS),
            exit: Some(Exit {
                rule: "argmax-stability:1".parse().unwrap(),
                policy,
            }),
            ..GenerateParams::default()
        };
        session.generate(&prompt, &params).unwrap();
        let steps = session.last_generate_stats().exit_steps;
        assert!(steps.iter().any(|&s| (s as usize) < LOOPS), "{steps:?}");
        check(&mut session, prompt.len(), &steps);
    }

    /// The KV cache of a CPU session.
    fn kv(session: &Session) -> &KvCache<Vec<u8>> {
        match &session.state {
            SessionState::Cpu(buf) => &buf.kv,
            SessionState::Cuda(_) => unreachable!("a CPU session"),
        }
    }

    /// Positions and exit iterations of the calls: the prompt's (all its positions), then each
    /// decode step's (the token before the last is the last one fed).
    fn calls(prompt: usize, steps: &[u32]) -> Vec<(std::ops::Range<usize>, usize)> {
        let mut out = vec![(0..prompt, steps[0] as usize)];
        for (j, &s) in steps.iter().enumerate().skip(1) {
            out.push((prompt + j - 1..prompt + j, s as usize));
        }
        out
    }

    #[test]
    fn skip_copies_the_exit_iterations_entries_into_the_skipped_slots() {
        generated(ExitPolicy::Skip, |session, prompt, steps| {
            let kv = kv(session);
            let layout = &kv.layout;
            assert!(kv.depths.mask().is_none(), "skip needs no depth mask");
            let slot = |block, iteration| {
                layout.slot(Application {
                    stage: Stage::Loop,
                    block,
                    iteration,
                })
            };
            let entry = |slot, t, tensor| {
                let at = layout.codes_at(0, tensor, slot, t);
                &kv.storage[at..at + layout.tiers[0].row_bytes]
            };
            for (positions, exit) in calls(prompt, steps) {
                for t in positions {
                    for block in 0..2 {
                        for i in exit + 1..=LOOPS {
                            for tensor in 0..2 {
                                let (copy, from) = (slot(block, i), slot(block, exit));
                                assert_eq!(entry(copy, t, tensor), entry(from, t, tensor));
                            }
                        }
                    }
                }
            }
        });
    }

    #[test]
    fn the_reference_policy_records_depths_until_a_new_sequence() {
        generated(ExitPolicy::Reference, |session, prompt, steps| {
            let depths = {
                let kv = kv(session);
                let mask = kv.depths.mask().expect("calls stopped early");
                let at = |t: usize| u32::from_le_bytes(mask[4 * t..4 * t + 4].try_into().unwrap());
                calls(prompt, steps)
                    .into_iter()
                    .flat_map(|(positions, exit)| positions.map(move |t| (t, exit)))
                    .map(|(t, exit)| (at(t), exit))
                    .collect::<Vec<_>>()
            };
            for (depth, exit) in depths {
                let expect = if exit < LOOPS {
                    exit as u32
                } else {
                    ALL_DEPTHS
                };
                assert_eq!(depth, expect);
            }
            // A plain call starts a new sequence: the mask is off, and it computes what a fresh
            // session computes.
            let params = GenerateParams {
                max_tokens: 8,
                loops: Some(LOOPS),
                ..GenerateParams::default()
            };
            let plain = session.generate(&[2, 7, 1, 8], &params).unwrap();
            assert!(kv(session).depths.mask().is_none());
            let fresh = session
                .model()
                .new_session()
                .unwrap()
                .generate(&[2, 7, 1, 8], &params);
            assert_eq!(plain, fresh.unwrap());
        });
    }

    #[test]
    fn latent_criteria_average_over_rows() {
        // Two rows of width 2 from a zero start: the change is 1 (and the cosine NaN) at first.
        let first: &[f32] = &[1.0, 0.0, 0.0, 2.0];
        let second: &[f32] = &[1.0, 0.0, 0.0, 1.0];
        let values = run(Criterion::LatentDiff, 0.03, &[first, second], 2);
        assert_eq!(values[0], (1.0, false));
        // Row 0 unchanged, row 1 from (0, 2) to (0, 1): ‖Δ‖ / ‖s‖ = 1.
        assert!((values[1].0 - 0.5).abs() < 1e-12);
        let values = run(Criterion::Cosine, 1e-3, &[first, second], 2);
        assert!(values[0].0.is_nan() && !values[0].1);
        assert!(values[1].0.abs() < 1e-12 && values[1].1);
    }
}
