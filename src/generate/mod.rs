//! Generation and scoring over any backend: prefill (chunked when the prompt is longer than the
//! step buffers), the decode loop, per-position logits; self-speculative decoding
//! ([`speculative`]), the logit lens and trajectory ([`lens`]), prefix caches and resume handles
//! ([`handles`]).

pub mod criteria;
pub mod exit;
pub mod handles;
pub mod lens;
pub mod sampling;
pub mod speculative;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use crate::backend::{Backend, Choice, Chosen, StepInput};
use crate::ctx_tier::CtxTierStats;
use crate::error::{Error, Result};
use crate::model::forward::{
    choose, chosen, decode_step, final_norm, forward, logits, measure, step_rows, Buffers,
    CallRows, Decode, LOGIT_ROWS,
};
use crate::model::weights::Weights;
use crate::telemetry::beta_monitor::{BetaMonSummary, EntropyLog, Monitoring};
use sampling::{Rng, SamplingParams};

/// Everything a generation call needs besides the prompt.
#[derive(Clone, Debug)]
pub struct GenerateRequest {
    pub max_tokens: usize,
    pub loops: usize,
    pub sampling: SamplingParams,
    /// Generation ends after any of these tokens is produced; the stop token is not returned.
    pub stop_tokens: Vec<u32>,
    /// BETA-MON: measure the entropy of every returned token's distribution.
    pub(crate) monitor: Option<Monitoring>,
    /// The exit rule, resolved against the model.
    pub(crate) exit: Option<exit::ResolvedExit>,
}

/// What the last generation call of a session did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GenerateStats {
    /// Tokens returned.
    pub tokens: usize,
    /// From the call's start to the first token (prefill, or restoring a handle, plus one head).
    pub prefill_ms: f64,
    /// From the first token to the end.
    pub decode_ms: f64,
    /// Speculative calls: tokens drafted and accepted by the verify pass.
    pub drafted: usize,
    pub accepted: usize,
    /// Speculative calls: drafted positions where the draft's argmax equals the verify pass's.
    pub agreed: usize,
    /// What CTX-TIER observed, when the call had a tier policy.
    pub ctx_tier: Option<CtxTierStats>,
    /// Monitored calls: BETA-MON's summary.
    pub beta_mon: Option<BetaMonSummary>,
    /// Calls with an exit rule: the loop iteration (1-based) whose output gave each returned
    /// token (with a criterion, the iterations its call ran; the first token's call is the
    /// prompt's last step). Empty otherwise.
    pub exit_steps: Vec<u32>,
    /// Calls with a criterion: its value after each iteration of the call behind each returned
    /// token, beside `exit_steps` (NaN where it has none: cosine from a zero state). Empty
    /// otherwise.
    pub exit_values: Vec<Vec<f64>>,
}

impl GenerateStats {
    /// `accepted / drafted` (0 without drafts).
    pub fn acceptance_rate(&self) -> f64 {
        ratio(self.accepted, self.drafted)
    }

    /// `agreed / drafted`: the draft/verify argmax agreement (0 without drafts).
    pub fn agreement(&self) -> f64 {
        ratio(self.agreed, self.drafted)
    }

    /// The mean of [`GenerateStats::exit_steps`] (0 without an exit rule).
    pub fn mean_exit_steps(&self) -> f64 {
        let total: u64 = self.exit_steps.iter().map(|&s| u64::from(s)).sum();
        if self.exit_steps.is_empty() {
            0.0
        } else {
            total as f64 / self.exit_steps.len() as f64
        }
    }

    /// How many returned tokens exited after each iteration: `histogram[i]` counts exits after
    /// iteration i + 1, for `loops` iterations.
    pub fn exit_histogram(&self, loops: usize) -> Vec<usize> {
        let mut histogram = vec![0; loops];
        for &s in &self.exit_steps {
            if let Some(count) = histogram.get_mut(s as usize - 1) {
                *count += 1;
            }
        }
        histogram
    }
}

fn ratio(a: usize, b: usize) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// The tokens a generation call returns, and the rules that end it: `max_tokens`, a stop token,
/// the callback returning false, or cancellation.
pub(crate) struct Output<'a> {
    req: &'a GenerateRequest,
    cancel: &'a AtomicBool,
    on_token: &'a mut dyn FnMut(u32) -> bool,
    pub tokens: Vec<u32>,
    pub done: bool,
    start: Instant,
    pub stats: GenerateStats,
    entropy: Option<EntropyLog>,
}

impl<'a> Output<'a> {
    pub fn new(
        req: &'a GenerateRequest,
        cancel: &'a AtomicBool,
        on_token: &'a mut dyn FnMut(u32) -> bool,
    ) -> Output<'a> {
        Output {
            req,
            cancel,
            on_token,
            tokens: Vec::with_capacity(req.max_tokens),
            done: false,
            start: Instant::now(),
            stats: GenerateStats::default(),
            entropy: req.monitor.map(EntropyLog::new),
        }
    }

    /// Whether chosen tokens must come with their entropy (BETA-MON).
    pub fn measures(&self) -> bool {
        self.entropy.is_some()
    }

    /// [`Output::push`] of a token that came from loop iteration `exit` (an exit rule), after
    /// a criterion's `values` (none for the gate).
    pub fn push_exited(&mut self, next: Chosen, exit: usize, values: Vec<f64>) -> Result<bool> {
        let before = self.tokens.len();
        let more = self.push(next)?;
        if self.tokens.len() > before {
            self.stats.exit_steps.push(exit as u32);
            if !values.is_empty() {
                self.stats.exit_values.push(values);
            }
        }
        Ok(more)
    }

    /// [`Output::push`] of a token, from loop iteration `exit` when it came from one (the gate).
    pub fn push_from(&mut self, next: Chosen, exit: Option<usize>) -> Result<bool> {
        match exit {
            Some(exit) => self.push_exited(next, exit, Vec::new()),
            None => self.push(next),
        }
    }

    /// Take the next token; false once generation has ended (then later tokens are dropped).
    pub fn push(&mut self, next: Chosen) -> Result<bool> {
        let token = next.token;
        if self.done {
            return Ok(false);
        }
        if self.cancel.load(Ordering::Acquire) {
            return Err(Error::Cancelled);
        }
        if self.tokens.is_empty() {
            self.stats.prefill_ms = self.start.elapsed().as_secs_f64() * 1e3;
        }
        if self.req.stop_tokens.contains(&token) {
            self.done = true;
            return Ok(false);
        }
        if let Some(log) = &mut self.entropy {
            let bits = next.entropy_bits;
            debug_assert!(
                bits.is_some(),
                "a monitored call's token came without its entropy"
            );
            log.record(token, bits.unwrap_or(f32::NAN));
        }
        self.tokens.push(token);
        if !(self.on_token)(token) || self.tokens.len() == self.req.max_tokens {
            self.done = true;
        }
        Ok(!self.done)
    }

    /// Tokens still allowed.
    pub fn remaining(&self) -> usize {
        self.req.max_tokens - self.tokens.len()
    }

    /// The tokens and the call's statistics.
    pub fn finish(mut self) -> (Vec<u32>, GenerateStats) {
        let total = self.start.elapsed().as_secs_f64() * 1e3;
        self.stats.tokens = self.tokens.len();
        self.stats.decode_ms = (total - self.stats.prefill_ms).max(0.0);
        let (drafted, agreed) = (self.stats.drafted, self.stats.agreed);
        self.stats.beta_mon = self.entropy.map(|log| log.summary(drafted, agreed));
        (self.tokens, self.stats)
    }
}

/// Feed `tokens` from position `start` through the whole network in the steps [`step_rows`] cuts
/// (at most `buf.max_rows` rows, never across a tier change); the last step carries `choice`.
/// After each step, `after(buf, offset, rows)` sees it: its first token's offset in `tokens` and
/// its rows. Returns the rows of the last step.
#[allow(clippy::too_many_arguments)]
pub(crate) fn steps<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    tokens: &[u32],
    start: usize,
    loops: usize,
    choice: Choice,
    cancel: &AtomicBool,
    mut after: impl FnMut(&mut Buffers<B>, usize, usize) -> Result<()>,
) -> Result<usize> {
    let _call = CallRows::new(backend, tokens.len());
    let mut offset = 0;
    let mut rows = 0;
    while offset < tokens.len() {
        rows = step_rows(buf, start + offset, tokens.len() - offset);
        let last = offset + rows == tokens.len();
        let input = StepInput {
            tokens: &tokens[offset..offset + rows],
            start_pos: start + offset,
            choice: if last { choice } else { Choice::Greedy },
        };
        forward(backend, w, buf, input, loops, cancel)?;
        after(buf, offset, rows)?;
        offset += rows;
    }
    Ok(rows)
}

/// Feed `tokens` from position `start` through the whole network ([`steps`]); the last step
/// carries `choice`. Returns the row of the last token in the last step.
#[allow(clippy::too_many_arguments)]
pub(crate) fn prefill<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    tokens: &[u32],
    start: usize,
    loops: usize,
    choice: Choice,
    cancel: &AtomicBool,
) -> Result<usize> {
    let last_rows = steps(
        backend,
        w,
        buf,
        tokens,
        start,
        loops,
        choice,
        cancel,
        |_, _, _| Ok(()),
    )?;
    Ok(last_rows - 1)
}

/// How the next token is chosen: greedily, or by sampling with the generator's next draw.
pub(crate) fn next_choice(params: &SamplingParams, rng: &mut Rng) -> Choice {
    if params.is_greedy() {
        Choice::Greedy
    } else {
        Choice::Sample {
            params: *params,
            draw: rng.next_draw(),
        }
    }
}

/// Choose the first token from the final-normed row `row` of the last staged step (with its
/// entropy when `entropy`).
pub(crate) fn first_token<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    row: usize,
    entropy: bool,
) -> Result<Chosen> {
    final_norm(backend, w, buf, row + 1);
    logits(backend, w, buf, row, 1);
    choose(backend, w, buf);
    if entropy {
        measure(backend, w, buf, 1);
    }
    chosen(backend, buf, entropy)
}

/// Plain decoding: feed `next` at `pos`, take the chosen token, until the output ends.
pub(crate) fn decode<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    out: &mut Output,
    mut next: Chosen,
    mut pos: usize,
    rng: &mut Rng,
) -> Result<()> {
    let (sampling, entropy) = (out.req.sampling, out.measures());
    let step = Decode::plain(out.req.loops).measured(entropy);
    while out.push(next)? {
        let input = StepInput {
            tokens: &[next.token],
            start_pos: pos,
            choice: next_choice(&sampling, rng),
        };
        decode_step(backend, w, buf, input, step)?;
        pos += 1;
        next = chosen(backend, buf, entropy)?;
    }
    Ok(())
}

/// Logits as returned to a caller, who must never receive NaN or infinity: finite weights can
/// still overflow the f16 intermediates, and that is an error (docs/NUMERICS.md "What the calls
/// return").
pub(crate) fn finite(logits: Vec<f32>) -> Result<Vec<f32>> {
    check_finite(&logits)?;
    Ok(logits)
}

fn check_finite(logits: &[f32]) -> Result<()> {
    match logits.iter().find(|v| !v.is_finite()) {
        None => Ok(()),
        Some(v) => Err(Error::Format(format!(
            "the model's arithmetic overflowed: a logit is {v} (weights too large for f16 \
             activations)"
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
) -> Result<(Vec<u32>, GenerateStats)> {
    let mut rng = Rng::new(req.sampling.seed);
    let mut out = Output::new(req, cancel, on_token);
    let choice = next_choice(&req.sampling, &mut rng);
    if let Some(rule) = req.exit {
        exit::generate(backend, w, buf, prompt, 0, rule, &mut out, choice, &mut rng)?;
        return Ok(out.finish());
    }
    let last = prefill(backend, w, buf, prompt, 0, req.loops, choice, cancel)?;
    let first = first_token(backend, w, buf, last, out.measures())?;
    decode(backend, w, buf, &mut out, first, prompt.len(), &mut rng)?;
    Ok(out.finish())
}

/// Logits `[n, vocab]` for every position of `tokens` (`tokens.len() <= max_rows`; the steps are
/// cut only at tier changes).
pub fn score<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    tokens: &[u32],
    loops: usize,
    cancel: &AtomicBool,
) -> Result<Vec<f32>> {
    let vocab = w.config.vocab_size;
    let mut out: Vec<f32> =
        crate::alloc::zeroed(tokens.len() * vocab, "the logits of a score call")?;
    let greedy = Choice::Greedy;
    steps(
        backend,
        w,
        buf,
        tokens,
        0,
        loops,
        greedy,
        cancel,
        |buf, offset, rows| {
            // Each group of rows is copied straight to its place in the result.
            let step_out = &mut out[offset * vocab..(offset + rows) * vocab];
            for_logit_rows(backend, w, buf, rows, LogitsTo::Places(step_out), |_, _| {})
        },
    )?;
    Ok(out)
}

/// [`score`] with an exit rule: every position's logits are those of its exit iteration, which is
/// returned for every position too. `tokens[..prompt_len]` run as a generation call's prompt
/// does (in steps; with a criterion each step is a call); every later position as a generated
/// token would (a one-row step at the rule's policy), so the result is what generation computes
/// had it produced `tokens[prompt_len..]` itself.
#[allow(clippy::too_many_arguments)]
pub fn score_exit<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    tokens: &[u32],
    prompt_len: usize,
    loops: usize,
    rule: exit::ResolvedExit,
    cancel: &AtomicBool,
) -> Result<(Vec<f32>, Vec<u32>)> {
    let vocab = w.config.vocab_size;
    let mut out: Vec<f32> =
        crate::alloc::zeroed(tokens.len() * vocab, "the logits of a score call")?;
    let mut exit_steps = Vec::with_capacity(tokens.len());
    let greedy = Choice::Greedy;
    let (prompt, generated) = tokens.split_at(prompt_len);
    let mut each = |buf: &mut Buffers<B>, offset: usize, rows: usize, decided: &exit::Decided| {
        exit_steps.extend(decided.exits.iter().map(|&e| e as u32));
        let step_out = &mut out[offset * vocab..(offset + rows) * vocab];
        for_logit_rows(backend, w, buf, rows, LogitsTo::Places(step_out), |_, _| {})
    };
    exit::prompt_steps(
        backend, w, buf, prompt, 0, loops, rule, greedy, true, cancel, &mut each,
    )?;
    let mut saved = backend.alloc_float(w.config.dim)?;
    for (i, token) in generated.iter().enumerate() {
        let pos = prompt_len + i;
        let input = StepInput {
            tokens: std::slice::from_ref(token),
            start_pos: pos,
            choice: greedy,
        };
        let decided =
            exit::generated_step(backend, w, buf, input, loops, rule, &mut saved, cancel)?;
        each(buf, pos, 1, &decided)?;
    }
    Ok((out, exit_steps))
}

/// Logits `[vocab]` at the last position of `tokens`.
pub fn score_last<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    tokens: &[u32],
    loops: usize,
    cancel: &AtomicBool,
) -> Result<Vec<f32>> {
    let greedy = Choice::Greedy;
    let rows = steps(
        backend,
        w,
        buf,
        tokens,
        0,
        loops,
        greedy,
        cancel,
        |_, _, _| Ok(()),
    )?;
    final_norm(backend, w, buf, rows);
    logits(backend, w, buf, rows - 1, 1);
    finite(backend.read_float(&buf.logits, 0, w.config.vocab_size)?)
}

/// `log p(tokens[i + 1] | tokens[..=i])` for `i < n − 1`, running `tokens` in steps of at most
/// `buf.max_rows` rows (each step attends to the KV of the earlier ones).
pub fn logprobs_chunked<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    tokens: &[u32],
    loops: usize,
    cancel: &AtomicBool,
) -> Result<Vec<f32>> {
    let vocab = w.config.vocab_size;
    let mut out = Vec::with_capacity(tokens.len() - 1);
    let mut values: Vec<f32> = crate::alloc::zeroed(LOGIT_ROWS * vocab, "a group of logits")?;
    let greedy = Choice::Greedy;
    steps(
        backend,
        w,
        buf,
        tokens,
        0,
        loops,
        greedy,
        cancel,
        |buf, offset, rows| {
            for_logit_rows(
                backend,
                w,
                buf,
                rows,
                LogitsTo::Reused(&mut values),
                |row, logits| {
                    if let Some(&next) = tokens.get(offset + row + 1) {
                        out.push(logprob(logits, next));
                    }
                },
            )
        },
    )?;
    Ok(out)
}

/// Where [`for_logit_rows`] reads logits to.
enum LogitsTo<'a> {
    /// Every row to its own place: `rows × vocab` values.
    Places(&'a mut [f32]),
    /// Each group of rows into the same `LOGIT_ROWS × vocab` values.
    Reused(&'a mut [f32]),
}

/// The logits of the last step's `rows` rows, `LOGIT_ROWS` at a time, read to `into` and checked
/// finite; `each(row, logits)` sees every row.
fn for_logit_rows<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    rows: usize,
    into: LogitsTo,
    mut each: impl FnMut(usize, &[f32]),
) -> Result<()> {
    let vocab = w.config.vocab_size;
    final_norm(backend, w, buf, rows);
    let (values, places) = match into {
        LogitsTo::Places(v) => (v, true),
        LogitsTo::Reused(v) => (v, false),
    };
    for first in (0..rows).step_by(LOGIT_ROWS) {
        let n = LOGIT_ROWS.min(rows - first);
        logits(backend, w, buf, first, n);
        let at = if places { first * vocab } else { 0 };
        let group = &mut values[at..at + n * vocab];
        backend.read_float_into(&buf.logits, 0, group)?;
        check_finite(group)?;
        for (r, row) in group.chunks_exact(vocab).enumerate() {
            each(first + r, row);
        }
    }
    Ok(())
}

/// `log p(tokens[i + 1] | tokens[..=i])` for `i < n − 1`, each of `tokens[..n − 1]` fed as its
/// own one-row decode step from position 0, exactly as generation feeds the tokens it produces
/// (the decode path: on the GPU its GEMV, attention and captured-graph kernels). Checked for
/// cancellation before each step.
pub fn logprobs_decode<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    tokens: &[u32],
    loops: usize,
    cancel: &AtomicBool,
) -> Result<Vec<f32>> {
    let vocab = w.config.vocab_size;
    let mut out = Vec::with_capacity(tokens.len() - 1);
    let mut row: Vec<f32> = crate::alloc::zeroed(vocab, "a row of logits")?;
    for (pos, pair) in tokens.windows(2).enumerate() {
        if cancel.load(Ordering::Acquire) {
            return Err(Error::Cancelled);
        }
        let input = StepInput {
            tokens: &pair[..1],
            start_pos: pos,
            choice: Choice::Greedy,
        };
        decode_step(backend, w, buf, input, Decode::plain(loops))?;
        backend.read_float_into(&buf.logits, 0, &mut row)?;
        check_finite(&row)?;
        out.push(logprob(&row, pair[1]));
    }
    Ok(out)
}

/// `tokens` as one greedy step from position 0.
pub(crate) fn whole(tokens: &[u32]) -> StepInput<'_> {
    StepInput {
        tokens,
        start_pos: 0,
        choice: Choice::Greedy,
    }
}

/// `log softmax(row)[token]`, in f64.
fn logprob(row: &[f32], token: u32) -> f32 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = row
        .iter()
        .map(|&v| (v as f64 - max).exp())
        .sum::<f64>()
        .ln()
        + max;
    (row[token as usize] as f64 - lse) as f32
}
