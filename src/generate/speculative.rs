//! Self-speculative decoding: the model drafts tokens at fewer loop iterations and verifies them
//! in one multi-row step at more.
//!
//! A round starts from the last token `t` at position `pos`. Draft steps feed `t, d1, …` at
//! `draft_loops` and choose `d1 … dk`; each saves its residual stream after iteration
//! `draft_loops`. Since the state after iteration i never depends on the total loop count, the
//! draft has already computed, exactly, the pre blocks and iterations `1..=draft_loops` of the
//! verify pass for those positions (their KV slots are keyed by iteration): the verify step
//! continues from the saved residual streams through the remaining iterations and the post blocks
//! for the `k + 1` rows `t, d1 … dk` at once. Rows whose draft is rejected are simply overwritten
//! by the next round (nothing reads past the current position).
//!
//! Acceptance: greedily, drafts are accepted while they equal the verify pass's argmax, then the
//! verify pass's token follows (a correction, or a bonus token after k acceptances), so the
//! output is the plain greedy output at `verify_loops`. When sampling, draft token d (drawn from
//! the draft distribution q) is accepted with probability min(1, p(d) / q(d)) under the verify
//! distribution p, else the token is drawn from max(0, p − q) normalized, and a full acceptance
//! draws a bonus from p: the standard rule, whose output is distributed as plain sampling at
//! `verify_loops` (p and q are the exact distributions of the sampler, `sampling::distribution`).
//!
//! Without `reuse` (the reference page's `generate_speculative_no_cache`) the verify step runs
//! the rows through the whole network instead, and draft steps save nothing.

use std::sync::atomic::AtomicBool;

use super::exit::{self, Decision, ExitPolicy, ResolvedExit};
use super::sampling::{self, Rng};
use super::{first_token, next_choice, prefill, GenerateRequest, GenerateStats, Output};
use crate::backend::{Backend, Choice, Chosen, StepInput};
use crate::error::{Error, Result};
use crate::model::forward::{
    argmax_rows, chosen, chosen_token, decode_step, entropies, final_norm, logits, measure,
    step_rows, verify_step, Buffers, Decode, HIDDEN_ROWS,
};
use crate::model::weights::Weights;

/// The most tokens one round drafts: the verify step's rows (`draft_len + 1`) fit the logits
/// and hidden-state buffers.
pub const MAX_DRAFT_LEN: usize = HIDDEN_ROWS - 1;

/// How a speculative call drafts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Speculation {
    /// Loop iterations of the draft steps (below the request's `loops`, which verify).
    pub draft_loops: usize,
    /// Tokens drafted per round, 1..=MAX_DRAFT_LEN.
    pub draft_len: usize,
    /// Verify from the draft's saved state (true), or recompute every block application.
    pub reuse: bool,
}

impl Speculation {
    pub fn validate(&self, verify_loops: usize) -> Result<()> {
        if self.draft_loops == 0 || self.draft_loops >= verify_loops {
            return Err(Error::invalid(format!(
                "draft_loops must be in 1..{verify_loops} (below verify_loops {verify_loops}), \
                 got {}",
                self.draft_loops
            )));
        }
        if self.draft_len == 0 || self.draft_len > MAX_DRAFT_LEN {
            return Err(Error::invalid(format!(
                "draft_len must be in 1..={MAX_DRAFT_LEN}, got {}",
                self.draft_len
            )));
        }
        Ok(())
    }
}

/// Generate as [`super::generate`] does at `req.loops`, drafting at `spec.draft_loops`. With an
/// exit rule (the gate at the reference policy, [`gate_threshold`]) each verify row is its token's
/// output at its exit iteration: the verify pass runs every iteration, reading the gate after each
/// (so it recomputes the drafted iterations rather than continuing from them), and the tokens are
/// those of plain generation with the rule.
#[allow(clippy::too_many_arguments)]
pub fn generate<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    prompt: &[u32],
    req: &GenerateRequest,
    spec: &Speculation,
    cancel: &AtomicBool,
    on_token: &mut dyn FnMut(u32) -> bool,
) -> Result<(Vec<u32>, GenerateStats)> {
    spec.validate(req.loops)?;
    let spec = &Speculation {
        reuse: spec.reuse && req.exit.is_none(),
        ..*spec
    };
    let mut rng = Rng::new(req.sampling.seed);
    let mut out = Output::new(req, cancel, on_token);
    let entropy = out.measures();
    let choice = next_choice(&req.sampling, &mut rng);
    let mut gate = match req.exit {
        Some(rule) => Some(Gate {
            rule,
            threshold: gate_threshold(&rule)?,
            saved: backend.alloc_float(HIDDEN_ROWS * w.config.dim)?,
        }),
        None => None,
    };
    let (mut next, mut next_exit) = match req.exit {
        None => {
            let last = prefill(backend, w, buf, prompt, 0, req.loops, choice, cancel)?;
            (first_token(backend, w, buf, last, entropy)?, None)
        }
        Some(rule) => {
            let ignore = |_: &mut Buffers<B>, _, _, _: &_| Ok(());
            let decided = exit::prompt_steps(
                backend, w, buf, prompt, 0, req.loops, rule, choice, false, cancel, ignore,
            )?;
            let last = decided.exits.len() - 1;
            let first = first_token(backend, w, buf, last, entropy)?;
            (first, Some(decided.exits[last]))
        }
    };
    let mut pos = prompt.len();
    let capacity = buf.kv.layout.capacity;
    while out.push_from(next, next_exit)? {
        // A round needs positions pos..=pos + k, and produces up to k + 1 tokens. Its rows must
        // not straddle a tier change (CTX-TIER or age), so that the verify step computes what
        // one-token steps would.
        let k = spec
            .draft_len
            .min(out.remaining() - 1)
            .min(capacity.saturating_sub(pos + 1));
        let k = step_rows(buf, pos, k + 1) - 1;
        if k == 0 {
            // Too close to an end or a tier change for a draft: one plain step.
            (next, next_exit) = plain_step(
                backend,
                w,
                buf,
                &out,
                next.token,
                pos,
                &mut rng,
                gate.as_mut(),
            )?;
            pos += 1;
            continue;
        }
        let round = round(
            backend,
            w,
            buf,
            req,
            spec,
            next.token,
            pos,
            k,
            entropy,
            &mut rng,
            gate.as_mut(),
            cancel,
        )?;
        let stats = &mut out.stats;
        stats.drafted += k;
        stats.accepted += round.accepted;
        stats.agreed += round.agreed;
        let exit_of = |j: usize| round.exits.as_ref().map(|exits| exits[j]);
        let (&last, accepted) = round.tokens.split_last().expect("a round yields a token");
        for (j, &t) in accepted.iter().enumerate() {
            if !out.push_from(t, exit_of(j))? {
                return Ok(out.finish());
            }
        }
        (next, next_exit) = (last, exit_of(accepted.len()));
        pos += round.tokens.len();
    }
    Ok(out.finish())
}

/// The exit rule of a speculative call: the gate, its threshold, and room for the exit states of
/// the verify rows.
struct Gate<F> {
    rule: ResolvedExit,
    threshold: f64,
    saved: F,
}

/// The threshold of the only exit rule speculation takes: the gate at the reference policy. A
/// criterion decides per call, and a verify step would be one call for several tokens; under
/// `skip` a verify row would attend to deeper states of earlier rows that had exited, where
/// plain generation copies their exit state.
pub fn gate_threshold(exit: &ResolvedExit) -> Result<f64> {
    match (exit.decision, exit.policy) {
        (Decision::Gate(threshold), ExitPolicy::Reference) => Ok(threshold),
        (Decision::Criterion(..), _) => Err(Error::invalid(
            "speculation takes the exit gate, not a criterion: a criterion decides per call, and \
             a verify step checks several tokens in one",
        )),
        (Decision::Gate(_), ExitPolicy::Skip) => Err(Error::invalid(
            "speculation takes exit_policy reference: under skip, a verify step's rows would \
             see the skipped iterations of the rows before them computed instead of copied",
        )),
    }
}

/// Feed `token` at `pos` in a plain decode step (with the exit gate, when the call has one) and
/// return the token chosen after it, with its exit.
#[allow(clippy::too_many_arguments)]
fn plain_step<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    out: &Output,
    token: u32,
    pos: usize,
    rng: &mut Rng,
    gate: Option<&mut Gate<B::Float>>,
) -> Result<(Chosen, Option<usize>)> {
    let input = StepInput {
        tokens: &[token],
        start_pos: pos,
        choice: next_choice(&out.req.sampling, rng),
    };
    let (loops, entropy) = (out.req.loops, out.measures());
    if let Some(gate) = gate {
        let (rule, saved, cancel) = (gate.rule, &mut gate.saved, out.cancel);
        let (next, decided) =
            exit::token_step(backend, w, buf, input, loops, rule, entropy, saved, cancel)?;
        return Ok((next, Some(decided.exits[0])));
    }
    decode_step(
        backend,
        w,
        buf,
        input,
        Decode::plain(loops).measured(entropy),
    )?;
    Ok((chosen(backend, buf, entropy)?, None))
}

/// What one round decided: the accepted drafts followed by the verify pass's token, each with the
/// entropy of its verify row when measured, and with an exit rule each verify row's exit.
struct Round {
    tokens: Vec<Chosen>,
    accepted: usize,
    agreed: usize,
    exits: Option<Vec<usize>>,
}

/// Draft `k` tokens after `t` (at `pos`) and verify them; with `entropy`, measure the verify
/// rows' entropies. With the exit gate, each verify row is its token's output at its exit.
#[allow(clippy::too_many_arguments)]
fn round<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    req: &GenerateRequest,
    spec: &Speculation,
    t: u32,
    pos: usize,
    k: usize,
    entropy: bool,
    rng: &mut Rng,
    gate: Option<&mut Gate<B::Float>>,
    cancel: &AtomicBool,
) -> Result<Round> {
    let vocab = w.config.vocab_size;
    let sampling = req.sampling;
    let mut inputs = vec![t];
    // Sampling keeps the draft's logits of every drafted position (the distribution q).
    let mut draft_logits = Vec::new();
    for j in 0..k {
        let input = StepInput {
            tokens: &inputs[j..=j],
            start_pos: pos + j,
            choice: next_choice(&sampling, rng),
        };
        let decode = Decode {
            loops: spec.draft_loops,
            hidden_row: spec.reuse.then_some(j),
            head: true,
            entropy: false,
        };
        decode_step(backend, w, buf, input, decode)?;
        if !sampling.is_greedy() {
            draft_logits.push(backend.read_float(&buf.logits, 0, vocab)?);
        }
        inputs.push(chosen_token(backend, buf)?);
    }
    if spec.reuse {
        // The last draft's state after draft_loops iterations: the verify step's last row.
        let input = StepInput {
            tokens: &inputs[k..=k],
            start_pos: pos + k,
            choice: Choice::Greedy,
        };
        let decode = Decode {
            loops: spec.draft_loops,
            hidden_row: Some(k),
            head: false,
            entropy: false,
        };
        decode_step(backend, w, buf, input, decode)?;
    }
    let verify = StepInput {
        tokens: &inputs,
        start_pos: pos,
        choice: Choice::Greedy,
    };
    let exits = match gate {
        Some(gate) => {
            let (threshold, saved) = (gate.threshold, &mut gate.saved);
            let exits = exit::exit_step(
                backend, w, buf, verify, req.loops, threshold, false, saved, cancel,
            )?;
            final_norm(backend, w, buf, k + 1);
            logits(backend, w, buf, 0, k + 1);
            Some(exits)
        }
        None => {
            let (draft_loops, loops) = (spec.draft_loops, req.loops);
            verify_step(backend, w, buf, verify, draft_loops, loops, spec.reuse)?;
            None
        }
    };
    let drafts = &inputs[1..];
    if entropy {
        measure(backend, w, buf, k + 1);
    }
    // The token taken from verify row j, with that row's entropy.
    let chosen_at = |bits: &[Option<f32>], j: usize, token: u32| Chosen {
        token,
        entropy_bits: bits[j],
    };
    if sampling.is_greedy() {
        let verified = argmax_rows(backend, w, buf, k + 1)?;
        let bits = verify_entropies(backend, buf, entropy, k + 1)?;
        let accepted = drafts
            .iter()
            .zip(&verified)
            .take_while(|(d, v)| d == v)
            .count();
        let agreed = drafts.iter().zip(&verified).filter(|(d, v)| d == v).count();
        let tokens = (0..=accepted)
            .map(|j| chosen_at(&bits, j, verified[j]))
            .collect();
        return Ok(Round {
            tokens,
            accepted,
            agreed,
            exits,
        });
    }
    let rows = backend.read_float(&buf.logits, 0, (k + 1) * vocab)?;
    let bits = verify_entropies(backend, buf, entropy, k + 1)?;
    let verified: Vec<&[f32]> = rows.chunks_exact(vocab).collect();
    let agreed = draft_logits
        .iter()
        .zip(&verified)
        .filter(|(q, p)| sampling::argmax(q) == sampling::argmax(p))
        .count();
    let mut tokens = Vec::with_capacity(k + 1);
    for (j, &d) in drafts.iter().enumerate() {
        let p = sampling::distribution(verified[j], &sampling);
        let q = sampling::distribution(&draft_logits[j], &sampling);
        let (pd, qd) = (p[d as usize], q[d as usize]);
        if qd > 0.0 && rng.next_f64() * qd < pd {
            tokens.push(chosen_at(&bits, j, d));
            continue;
        }
        let residual: Vec<f64> = p.iter().zip(&q).map(|(a, b)| (a - b).max(0.0)).collect();
        tokens.push(chosen_at(&bits, j, draw(&residual, rng)));
        return Ok(Round {
            accepted: j,
            agreed,
            tokens,
            exits,
        });
    }
    let bonus = draw(&sampling::distribution(verified[k], &sampling), rng);
    tokens.push(chosen_at(&bits, k, bonus));
    Ok(Round {
        accepted: k,
        agreed,
        tokens,
        exits,
    })
}

/// The entropies of verify rows `0..rows` when they were measured, else `None` for each.
fn verify_entropies<B: Backend>(
    backend: &B,
    buf: &Buffers<B>,
    entropy: bool,
    rows: usize,
) -> Result<Vec<Option<f32>>> {
    if !entropy {
        return Ok(vec![None; rows]);
    }
    Ok(entropies(backend, buf, rows)?
        .into_iter()
        .map(Some)
        .collect())
}

/// A token drawn from unnormalized non-negative `weights` (the argmax when they sum to 0).
fn draw(weights: &[f64], rng: &mut Rng) -> u32 {
    let total: f64 = weights.iter().sum();
    if total.is_nan() || total <= 0.0 {
        let best = weights
            .iter()
            .enumerate()
            .fold(0, |b, (i, &w)| if w > weights[b] { i } else { b });
        return best as u32;
    }
    let r = rng.next_f64() * total;
    let mut acc = 0.0;
    for (i, &w) in weights.iter().enumerate() {
        acc += w;
        if acc > r {
            return i as u32;
        }
    }
    // Rounding left r at the very top: the last token with weight.
    weights.iter().rposition(|&w| w > 0.0).unwrap_or(0) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The accept/resample rule, run many times on fixed p and q, gives p.
    #[test]
    fn speculative_sampling_gives_the_verify_distribution() {
        let p = [0.5, 0.2, 0.2, 0.1, 0.0];
        let q = [0.1, 0.4, 0.1, 0.1, 0.3];
        let mut rng = Rng::new(7);
        let n = 400_000;
        let mut counts = [0usize; 5];
        for _ in 0..n {
            let d = draw(&q, &mut rng) as usize;
            let token = if rng.next_f64() * q[d] < p[d] {
                d
            } else {
                let residual: Vec<f64> = p.iter().zip(&q).map(|(a, b)| (a - b).max(0.0)).collect();
                draw(&residual, &mut rng) as usize
            };
            counts[token] += 1;
        }
        // Each frequency is within 5 standard errors sqrt(p (1 - p) / n) of p.
        for (i, &c) in counts.iter().enumerate() {
            let f = c as f64 / n as f64;
            let se = (p[i] * (1.0 - p[i]) / n as f64).sqrt();
            assert!(
                (f - p[i]).abs() <= 5.0 * se + 1e-12,
                "token {i}: {f} vs {}",
                p[i]
            );
        }
    }

    #[test]
    fn bad_speculation_parameters_are_named() {
        let spec = |draft_loops, draft_len| Speculation {
            draft_loops,
            draft_len,
            reuse: true,
        };
        assert!(spec(2, 4).validate(8).is_ok());
        let err = spec(8, 4).validate(8).unwrap_err().to_string();
        assert!(err.contains("draft_loops"), "{err}");
        assert!(spec(0, 4).validate(8).is_err());
        let err = spec(2, 0).validate(8).unwrap_err().to_string();
        assert!(err.contains("draft_len must be in 1..=15"), "{err}");
        assert!(spec(2, MAX_DRAFT_LEN + 1).validate(8).is_err());
    }
}
