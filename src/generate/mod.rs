//! Generation and scoring over any backend: prefill (chunked when the prompt is longer than the
//! step buffers), the decode loop, and per-position logits.

pub mod sampling;

use std::sync::atomic::{AtomicBool, Ordering};

use crate::backend::{Backend, Choice, StepInput};
use crate::error::{Error, Result};
use crate::model::forward::{
    choose, chosen_token, decode_step, final_norm, forward, logits, Buffers, LOGIT_ROWS,
};
use crate::model::weights::Weights;
use sampling::{Rng, SamplingParams};

/// Everything a generation call needs besides the prompt.
#[derive(Clone, Debug)]
pub struct GenerateRequest {
    pub max_tokens: usize,
    pub loops: usize,
    pub sampling: SamplingParams,
    /// Generation ends after any of these tokens is produced; the stop token is not returned.
    pub stop_tokens: Vec<u32>,
}

/// Feed `tokens` from position 0 in steps of at most `buf.max_rows` rows; the last step carries
/// `choice`. Returns the row index of the last token within the final step.
fn prefill<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    tokens: &[u32],
    loops: usize,
    choice: Choice,
) -> Result<usize> {
    let chunks = tokens.len().div_ceil(buf.max_rows);
    let mut last_rows = 0;
    for (i, chunk) in tokens.chunks(buf.max_rows).enumerate() {
        let input = StepInput {
            tokens: chunk,
            start_pos: i * buf.max_rows,
            choice: if i + 1 == chunks {
                choice
            } else {
                Choice::Greedy
            },
        };
        forward(backend, w, buf, input, loops)?;
        last_rows = chunk.len();
    }
    Ok(last_rows - 1)
}

/// How the next token is chosen: greedily, or by sampling with the generator's next draw.
fn next_choice(params: &SamplingParams, rng: &mut Rng) -> Choice {
    if params.is_greedy() {
        Choice::Greedy
    } else {
        Choice::Sample {
            params: *params,
            draw: rng.next_draw(),
        }
    }
}

/// Logits of one row of the current step, on the host.
fn row_logits<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    rows: usize,
    row: usize,
) -> Result<Vec<f32>> {
    final_norm(backend, w, buf, rows);
    logits(backend, w, buf, row, 1);
    finite(backend.read_float(&buf.logits, 0, w.config.vocab_size)?)
}

/// Logits as returned to a caller, who must never receive NaN or infinity: finite weights can
/// still overflow the f16 intermediates (docs/FORMAT.md "Numerics"), and that is an error.
fn finite(logits: Vec<f32>) -> Result<Vec<f32>> {
    match logits.iter().position(|v| !v.is_finite()) {
        None => Ok(logits),
        Some(i) => Err(Error::Format(format!(
            "the model's arithmetic overflowed: a logit is {} (weights too large for f16 \
             activations)",
            logits[i]
        ))),
    }
}

/// Generate up to `req.max_tokens` tokens after `prompt`, calling `on_token` for each; generation
/// stops early when `on_token` returns false, a stop token appears, or `cancel` is set.
pub fn generate<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    prompt: &[u32],
    req: &GenerateRequest,
    cancel: &AtomicBool,
    on_token: &mut dyn FnMut(u32) -> bool,
) -> Result<Vec<u32>> {
    let mut rng = Rng::new(req.sampling.seed);
    let mut out = Vec::with_capacity(req.max_tokens);
    let choice = next_choice(&req.sampling, &mut rng);
    let last = prefill(backend, w, buf, prompt, req.loops, choice)?;
    final_norm(backend, w, buf, last + 1);
    logits(backend, w, buf, last, 1);
    choose(backend, w, buf);
    let mut next = chosen_token(backend, buf)?;
    let mut pos = prompt.len();
    loop {
        if cancel.load(Ordering::Acquire) {
            return Err(Error::Cancelled);
        }
        if req.stop_tokens.contains(&next) {
            break;
        }
        out.push(next);
        if !on_token(next) || out.len() == req.max_tokens {
            break;
        }
        let input = StepInput {
            tokens: &[next],
            start_pos: pos,
            choice: next_choice(&req.sampling, &mut rng),
        };
        decode_step(backend, w, buf, input, req.loops)?;
        pos += 1;
        next = chosen_token(backend, buf)?;
    }
    Ok(out)
}

/// Logits `[n, vocab]` for every position of `tokens` (single step: `tokens.len() <= max_rows`).
pub fn score<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    tokens: &[u32],
    loops: usize,
) -> Result<Vec<f32>> {
    let vocab = w.config.vocab_size;
    let n = tokens.len();
    forward(
        backend,
        w,
        buf,
        StepInput {
            tokens,
            start_pos: 0,
            choice: Choice::Greedy,
        },
        loops,
    )?;
    final_norm(backend, w, buf, n);
    let mut out = Vec::with_capacity(n * vocab);
    for first in (0..n).step_by(LOGIT_ROWS) {
        let rows = LOGIT_ROWS.min(n - first);
        logits(backend, w, buf, first, rows);
        out.extend(finite(backend.read_float(&buf.logits, 0, rows * vocab)?)?);
    }
    Ok(out)
}

/// Logits `[vocab]` at the last position of `tokens`.
pub fn score_last<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    tokens: &[u32],
    loops: usize,
) -> Result<Vec<f32>> {
    let n = tokens.len();
    forward(
        backend,
        w,
        buf,
        StepInput {
            tokens,
            start_pos: 0,
            choice: Choice::Greedy,
        },
        loops,
    )?;
    row_logits(backend, w, buf, n, n - 1)
}

/// `log p(tokens[i + 1] | tokens[..=i])` for `i < n − 1`, from f64 log-softmax of each row.
pub fn logprobs_from_logits(logits: &[f32], tokens: &[u32], vocab: usize) -> Vec<f32> {
    tokens
        .windows(2)
        .enumerate()
        .map(|(i, pair)| {
            let row = &logits[i * vocab..(i + 1) * vocab];
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let lse = row
                .iter()
                .map(|&v| (v as f64 - max).exp())
                .sum::<f64>()
                .ln()
                + max;
            (row[pair[1] as usize] as f64 - lse) as f32
        })
        .collect()
}
