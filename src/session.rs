//! A session: the runtime buffers and KV cache of one sequence over a shared [`Model`], and every
//! call that runs the network: generation (plain, self-speculative, after a prefix cache, resumed
//! at another depth) and scoring (logits, log-probabilities, the logit lens and trajectory).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::backend::Backend;
use crate::ctx_tier::{CtxTier, CtxTierStats};
use crate::error::{Error, Result};
use crate::format::DType;
use crate::generate::exit::{Exit, ExitPolicy};
use crate::generate::lens::{self, TrajectoryPoint};
use crate::generate::speculative::{self, Speculation};
use crate::generate::{self, handles, GenerateRequest, GenerateStats};
use crate::handle::{PrefixCache, ResumeHandle};
use crate::handle::{PrefixInner, ResumeInner};
use crate::model::architecture::LoopInput;
use crate::shared::{with_backend, with_handle, OnDevice, PerDevice, SessionState, Shared};
use crate::telemetry::beta_monitor;
use crate::{GenerateParams, KvMode, Model, ModelConfig};

/// Cancels the call in flight on one session; `Send + Sync`, usable from any thread.
#[derive(Clone, Debug)]
pub struct CancelHandle(Arc<AtomicBool>);

impl CancelHandle {
    /// Stop the session's running call (it returns [`Error::Cancelled`]): generation at the next
    /// token, prefill and scoring at the next block application. Has no effect on calls that
    /// start later.
    pub fn cancel(&self) {
        self.0.store(true, Ordering::Release);
    }
}

/// Runtime buffers and KV cache of one sequence over a shared [`Model`].
pub struct Session {
    pub(crate) shared: Arc<Shared>,
    pub(crate) state: SessionState,
    cancel: Arc<AtomicBool>,
    accounted_bytes: usize,
    stats: GenerateStats,
    tier_stats: Option<CtxTierStats>,
}

/// Where a generation call starts.
enum Start<'a> {
    Prompt,
    Prefix(&'a PrefixCache),
    Speculative(Speculation),
}

impl Session {
    pub(crate) fn new(shared: Arc<Shared>, state: SessionState) -> Session {
        let mut session = Session {
            shared,
            state,
            cancel: Arc::new(AtomicBool::new(false)),
            accounted_bytes: 0,
            stats: GenerateStats::default(),
            tier_stats: None,
        };
        session.account();
        session
    }

    pub fn config(&self) -> &ModelConfig {
        self.shared.config()
    }

    pub fn cancel_handle(&self) -> CancelHandle {
        CancelHandle(self.cancel.clone())
    }

    /// Generate tokens after `prompt`; returns only the new tokens.
    pub fn generate(&mut self, prompt: &[u32], params: &GenerateParams) -> Result<Vec<u32>> {
        self.generate_stream(prompt, params, &mut |_| true)
    }

    /// Like [`Session::generate`], calling `on_token` with each new token as soon as it exists;
    /// returning false from it ends generation (not an error).
    pub fn generate_stream(
        &mut self,
        prompt: &[u32],
        params: &GenerateParams,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<Vec<u32>> {
        self.run_generation(prompt, params, Start::Prompt, on_token)
    }

    /// [`Session::generate_stream`] after the prefix of `cache` (built by any session of this
    /// model at `params.loops`): the same tokens as generating from the prefix followed by
    /// `prompt`, without recomputing the prefix.
    pub fn generate_with_prefix(
        &mut self,
        cache: &PrefixCache,
        prompt: &[u32],
        params: &GenerateParams,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<Vec<u32>> {
        self.check_model(&cache.shared, "prefix cache")?;
        self.run_generation(prompt, params, Start::Prefix(cache), on_token)
    }

    /// Self-speculative generation: drafts `spec.draft_len` tokens at `spec.draft_loops` and
    /// verifies them at `params.loops` (the verify loops) in one step. Greedy output equals
    /// [`Session::generate`] at `params.loops`; sampled output is distributed as plain sampling
    /// there. With `spec.reuse` the verify step continues from the draft's KV and hidden state;
    /// without it, it recomputes everything (the baseline). Statistics in
    /// [`Session::last_generate_stats`].
    pub fn generate_speculative(
        &mut self,
        prompt: &[u32],
        params: &GenerateParams,
        spec: &Speculation,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<Vec<u32>> {
        self.run_generation(prompt, params, Start::Speculative(*spec), on_token)
    }

    /// The shared path of the generation calls: validation, then the call, then statistics.
    fn run_generation(
        &mut self,
        prompt: &[u32],
        params: &GenerateParams,
        start: Start,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<Vec<u32>> {
        self.start_call(self.generation_tier(params))?;
        let prefix = match start {
            Start::Prefix(cache) => cache.len(),
            _ => 0,
        };
        let req = self.shared.request(prompt, params, prefix)?;
        if let Start::Speculative(spec) = &start {
            spec.validate(req.loops)?;
        }
        if req.exit.is_some_and(|e| e.policy == ExitPolicy::Skip) {
            self.shared.kv_layout.check_entry_copies()?;
        }
        if let Some(exit) = &req.exit {
            match start {
                Start::Prompt => {}
                Start::Speculative(_) => {
                    speculative::gate_threshold(exit)?;
                }
                Start::Prefix(_) => handles::check_exit(exit)?,
            }
        }
        let cancel = self.cancel.clone();
        let result = match start {
            Start::Prompt => with_backend!(self, |b, w, buf| generate::generate(
                b, w, buf, prompt, &req, &cancel, on_token
            )),
            Start::Speculative(spec) => with_backend!(self, |b, w, buf| speculative::generate(
                b, w, buf, prompt, &req, &spec, &cancel, on_token
            )),
            Start::Prefix(cache) => {
                with_handle!(self, &cache.inner, |b, w, buf, c| handles::generate_after(
                    b, w, buf, c, prompt, &req, &cancel, on_token
                ))
            }
        };
        self.finish(result)
    }

    /// Build a prefix cache: run `prefix` at `loops` (default: the model's) and keep its KV
    /// entries for any session of this model ([`Session::generate_with_prefix`]). Its bytes count
    /// in the model's memory until it is dropped.
    pub fn build_prefix_cache(
        &mut self,
        prefix: &[u32],
        loops: Option<usize>,
    ) -> Result<PrefixCache> {
        self.start_call(None)?;
        let loops = self.shared.check_tokens(prefix, loops)?;
        self.check_room(prefix.len(), "a prefix", "a prompt")?;
        let cancel = self.cancel.clone();
        let inner: PrefixInner = with_backend!(self, |b, w, buf| handles::PrefixCache::build(
            b, w, buf, prefix, loops, &cancel
        )
        .map(Into::into))?;
        self.account();
        Ok(PrefixCache::new(
            self.shared.clone(),
            inner,
            prefix.to_vec(),
        ))
    }

    /// Build a resume handle: run `prompt` at `loops` (default: the model's) and keep what
    /// [`Session::resume_generate`] needs to generate after it at any loop count. The prompt runs
    /// as one step, so it must fit the step buffers (`prefill_chunk`, when set), and it must leave
    /// room in `max_seq_len` for at least one generated token.
    pub fn build_resume_handle(
        &mut self,
        prompt: &[u32],
        loops: Option<usize>,
    ) -> Result<ResumeHandle> {
        self.start_call(None)?;
        let loops = self.check_score(prompt, loops)?;
        self.check_room(prompt.len(), "a prompt", "a generated token")?;
        if self.config().architecture.loop_input != LoopInput::None {
            // A resume continues from a saved state at iteration k + 1, and the handle does not
            // keep the loop adapter's input that iteration needs.
            return Err(Error::invalid(
                "resume handles are not available for models with a loop adapter (Huginn)",
            ));
        }
        let cancel = self.cancel.clone();
        let inner: ResumeInner = with_backend!(self, |b, w, buf| handles::ResumeHandle::build(
            b, w, buf, prompt, loops, &cancel
        )
        .map(Into::into))?;
        self.account();
        Ok(ResumeHandle::new(self.shared.clone(), inner))
    }

    /// Generate after the prompt of `handle` at `params.loops`: the same tokens as
    /// [`Session::generate`] from that prompt at those loops, keeping the pre blocks and the
    /// loop iterations the handle already ran (up to the smaller of the two loop counts).
    pub fn resume_generate(
        &mut self,
        handle: &ResumeHandle,
        params: &GenerateParams,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<Vec<u32>> {
        self.start_call(self.generation_tier(params))?;
        self.check_model(&handle.shared, "resume handle")?;
        let req = self.shared.request(handle.prompt(), params, 0)?;
        if req.exit.is_some() {
            return Err(Error::invalid(
                "an exit rule applies to generate and stream calls from a prompt, not to resume \
                 handles",
            ));
        }
        let cancel = self.cancel.clone();
        let result = with_handle!(self, &handle.inner, |b, w, buf, h| handles::resume(
            b, w, buf, h, &req, &cancel, on_token
        ));
        self.finish(result)
    }

    /// What the last successful generation call did (tokens, times, speculation).
    pub fn last_generate_stats(&self) -> GenerateStats {
        self.stats.clone()
    }

    /// [`Session::score`] with an exit rule: each position's logits are those of its exit
    /// iteration, returned beside the logits. `tokens[..prompt_len]` run as a generation call's
    /// prompt does, every later position as a generated token does (its own step, at the rule's
    /// policy): the logits generation computes had it produced `tokens[prompt_len..]`. The gate
    /// decides per position; a criterion decides per call, so the prompt's positions get the
    /// iteration of the step they were in (one step unless `prefill_chunk` cuts the prompt).
    pub fn score_exit(
        &mut self,
        tokens: &[u32],
        prompt_len: usize,
        loops: Option<usize>,
        exit: Exit,
    ) -> Result<(Vec<f32>, Vec<u32>)> {
        self.start_call(None)?;
        let loops = self.shared.check_tokens(tokens, loops)?;
        if !(1..=tokens.len()).contains(&prompt_len) {
            return Err(Error::invalid(format!(
                "prompt_len {prompt_len} must be in 1..={} (the tokens scored)",
                tokens.len()
            )));
        }
        let rule = exit.resolve(self.config())?;
        if rule.policy == ExitPolicy::Skip {
            self.shared.kv_layout.check_entry_copies()?;
        }
        let cancel = self.cancel.clone();
        let result = with_backend!(self, |b, w, buf| generate::score_exit(
            b, w, buf, tokens, prompt_len, loops, rule, &cancel
        ));
        self.account();
        result
    }

    /// Logits `[n, vocab]` (row-major) for every position of `tokens`.
    pub fn score(&mut self, tokens: &[u32], loops: Option<usize>) -> Result<Vec<f32>> {
        self.start_call(None)?;
        let loops = self.check_score(tokens, loops)?;
        let cancel = self.cancel.clone();
        let result = with_backend!(self, |b, w, buf| generate::score(
            b, w, buf, tokens, loops, &cancel
        ));
        self.account();
        result
    }

    /// `log p(tokens[i + 1] | tokens[..=i])`, `n − 1` values. Needs at least two tokens.
    pub fn logprobs(&mut self, tokens: &[u32], loops: Option<usize>) -> Result<Vec<f32>> {
        if tokens.len() < 2 {
            return Err(Error::invalid("logprobs needs at least 2 tokens"));
        }
        self.start_call(None)?;
        let loops = self.check_score(tokens, loops)?;
        let cancel = self.cancel.clone();
        // One step (check_score), so these are the values `score`'s logits give, read out 16
        // rows at a time instead of materializing n × vocab logits on the host.
        let result = with_backend!(self, |b, w, buf| generate::logprobs_chunked(
            b, w, buf, tokens, loops, &cancel
        ));
        self.account();
        result
    }

    /// `log p(tokens[i + 1] | tokens[..=i])`, `n − 1` values, computed in steps of at most the
    /// step buffers' rows (`prefill_chunk` when set), so `tokens` may be longer than one step.
    /// With `ctx_tier`, the tier follows the positions (CTX-TIER): positions from the one whose
    /// `seq_len` reaches LONG run the INT2 loop body, attending to the KV the earlier positions
    /// computed at INT4. Its statistics are in [`Session::last_ctx_tier_stats`].
    pub fn logprobs_with(
        &mut self,
        tokens: &[u32],
        loops: Option<usize>,
        ctx_tier: Option<&CtxTier>,
    ) -> Result<Vec<f32>> {
        if tokens.len() < 2 {
            return Err(Error::invalid("logprobs needs at least 2 tokens"));
        }
        let loops = self.shared.check_tokens(tokens, loops)?;
        self.start_call(ctx_tier.cloned())?;
        let cancel = self.cancel.clone();
        let result = with_backend!(self, |b, w, buf| generate::logprobs_chunked(
            b, w, buf, tokens, loops, &cancel
        ));
        self.tier_stats = self.finish_tier();
        self.account();
        result
    }

    /// [`Session::logprobs`] computed through the decode path: each token but the last is fed as
    /// its own one-row decode step, exactly as generation feeds the tokens it produces, so the
    /// values are what a generation call computes (docs/NUMERICS.md "Scoring through the decode
    /// path"). Not limited by `prefill_chunk`; at most `max_seq_len` tokens.
    pub fn logprobs_decode(&mut self, tokens: &[u32], loops: Option<usize>) -> Result<Vec<f32>> {
        if tokens.len() < 2 {
            return Err(Error::invalid("logprobs needs at least 2 tokens"));
        }
        self.start_call(None)?;
        let loops = self.shared.check_tokens(tokens, loops)?;
        let cancel = self.cancel.clone();
        let result = with_backend!(self, |b, w, buf| generate::logprobs_decode(
            b, w, buf, tokens, loops, &cancel
        ));
        self.account();
        result
    }

    /// What CTX-TIER observed in the last call that had a tier policy (generation or
    /// [`Session::logprobs_with`]); `None` when the last call had none.
    pub fn last_ctx_tier_stats(&self) -> Option<CtxTierStats> {
        self.tier_stats
    }

    /// Logits `[vocab]` at the last position of `tokens`.
    pub fn score_last(&mut self, tokens: &[u32], loops: Option<usize>) -> Result<Vec<f32>> {
        self.start_call(None)?;
        let loops = self.check_score(tokens, loops)?;
        let cancel = self.cancel.clone();
        let result = with_backend!(self, |b, w, buf| generate::score_last(
            b, w, buf, tokens, loops, &cancel
        ));
        self.account();
        result
    }

    /// The logit lens: logits `[loops, vocab]` at the last position, read out after each loop
    /// iteration (through the post blocks, the final norm and the head). Row L equals
    /// [`Session::score_last`] at L loops, and the first L′ rows at L are the rows at L′.
    pub fn score_logit_lens(&mut self, tokens: &[u32], loops: Option<usize>) -> Result<Vec<f32>> {
        Ok(self.lens(tokens, loops)?.0)
    }

    /// The trajectory of the last position through the loop iterations (one point per
    /// iteration: hidden norm, relative change, KL to the previous iteration, entropy, argmax).
    pub fn score_trajectory(
        &mut self,
        tokens: &[u32],
        loops: Option<usize>,
    ) -> Result<Vec<TrajectoryPoint>> {
        let (logits, hidden) = self.lens(tokens, loops)?;
        Ok(lens::trajectory(&logits, &hidden, self.config().vocab_size))
    }

    fn lens(&mut self, tokens: &[u32], loops: Option<usize>) -> Result<(Vec<f32>, Vec<Vec<f32>>)> {
        self.start_call(None)?;
        let loops = self.check_score(tokens, loops)?;
        let cancel = self.cancel.clone();
        let result = with_backend!(self, |b, w, buf| lens::logit_lens(
            b, w, buf, tokens, loops, &cancel
        ));
        self.account();
        result
    }

    /// Bytes of device memory this session holds (buffers, step scratch and KV cache).
    pub fn memory_bytes(&self) -> usize {
        match &self.state {
            SessionState::Cpu(buf) => buf.bytes + buf.kv.bytes() + depth_bytes(&buf.kv),
            SessionState::Cuda(s) => {
                let b = &s.buffers;
                let kv = b.kv.bytes() + depth_bytes(&b.kv);
                b.bytes + kv + b.step().bytes() + s.backend.own_bytes()
            }
        }
    }

    /// Bytes of the KV cache as allocated now (its slots grow with the loop count used).
    pub fn kv_bytes(&self) -> usize {
        match &self.state {
            SessionState::Cpu(buf) => buf.kv.bytes(),
            SessionState::Cuda(s) => s.buffers.kv.bytes(),
        }
    }

    /// The KV cache mode of this session.
    pub fn kv_mode(&self) -> KvMode {
        self.shared.kv_layout.mode
    }

    /// The model this session runs.
    pub fn model(&self) -> Model {
        Model {
            shared: self.shared.clone(),
        }
    }

    /// Record a generation call's statistics and memory.
    fn finish(&mut self, result: Result<(Vec<u32>, GenerateStats)>) -> Result<Vec<u32>> {
        self.tier_stats = self.finish_tier();
        self.account();
        let (tokens, mut stats) = result?;
        stats.ctx_tier = self.tier_stats;
        if let Some(summary) = &stats.beta_mon {
            beta_monitor::report(summary, &self.shared.beta_env, self.shared.options.log);
        }
        self.stats = stats;
        Ok(tokens)
    }

    /// Start a call, before anything else: clear an earlier cancel (it only concerned the call in
    /// flight) and set the call's CTX-TIER policy (none: the call runs at the SHORT tier).
    fn start_call(&mut self, ctx_tier: Option<CtxTier>) -> Result<()> {
        self.cancel.store(false, Ordering::Release);
        if let Some(policy) = &ctx_tier {
            policy.validate()?;
            let dtype = match &self.shared.on_device {
                OnDevice::Cpu(l) => l.weights.body.loaded_dtype(),
                OnDevice::Cuda(l) => l.weights.body.loaded_dtype(),
            };
            if dtype != Some(DType::Int4) {
                let found = dtype.map_or("of mixed encodings", |d| d.name());
                return Err(Error::invalid(format!(
                    "ctx_tier re-packs an INT4 loop body to INT2; this model's loop body is {found}"
                )));
            }
        }
        let log = self.shared.options.log;
        with_backend!(self, |_b, _w, buf| buf.tier.begin(ctx_tier, log));
        Ok(())
    }

    fn finish_tier(&mut self) -> Option<CtxTierStats> {
        with_backend!(self, |_b, _w, buf| buf.tier.finish())
    }

    /// The policy of a generation call: its own, else the environment's.
    fn generation_tier(&self, params: &GenerateParams) -> Option<CtxTier> {
        params
            .ctx_tier
            .clone()
            .or_else(|| self.shared.env_ctx_tier.clone())
    }

    /// Keep the model-wide count of session bytes current.
    fn account(&mut self) {
        let now = self.memory_bytes();
        let counter = &self.shared.session_bytes;
        counter.fetch_add(now, Ordering::Relaxed);
        counter.fetch_sub(self.accounted_bytes, Ordering::Relaxed);
        self.accounted_bytes = now;
    }

    fn check_model(&self, owner: &Arc<Shared>, what: &str) -> Result<()> {
        if !Arc::ptr_eq(owner, &self.shared) {
            return Err(Error::invalid(format!(
                "the {what} belongs to another model"
            )));
        }
        Ok(())
    }

    /// Refuse `what` (a prefix, a prompt) of `len` tokens when it fills max_seq_len: a handle
    /// kept for later generation needs a position left for `next`.
    fn check_room(&self, len: usize, what: &str, next: &str) -> Result<()> {
        let max_seq = self.shared.options.max_seq_len;
        if len >= max_seq {
            return Err(Error::invalid(format!(
                "{what} of {len} tokens leaves no room for {next} in max_seq_len {max_seq}"
            )));
        }
        Ok(())
    }

    /// [`Shared::check_tokens`] for calls that run `tokens` as one step.
    fn check_score(&self, tokens: &[u32], loops: Option<usize>) -> Result<usize> {
        let loops = self.shared.check_tokens(tokens, loops)?;
        let chunk = self.shared.options.prefill_chunk;
        if chunk > 0 && tokens.len() > chunk {
            return Err(Error::invalid(format!(
                "score APIs need seq_len <= prefill_chunk ({} > {chunk}): shorten the input or \
                 open the model with prefill_chunk=0",
                tokens.len()
            )));
        }
        Ok(loops)
    }
}

/// Bytes of a KV cache's depth mask (none until a call stops positions early).
fn depth_bytes<S>(kv: &crate::kv::KvCache<S>) -> usize {
    kv.depths.bytes(kv.layout.capacity)
}

impl Drop for Session {
    fn drop(&mut self) {
        // A session leaving the SHORT tier may leave the loaded loop body unused (CTX-TIER). On
        // failure the body simply stays on the device.
        let _ = with_backend!(self, |b, w, buf| b
            .synchronize()
            .and_then(|_| w.body.release_unused(b, Some(&buf.body))));
        self.shared
            .session_bytes
            .fetch_sub(self.accounted_bytes, Ordering::Relaxed);
    }
}

/// The checks every call of a model makes, whichever session or engine runs it.
impl Shared {
    /// Validate a generation call after `prefix` cached tokens and resolve its request. Any
    /// `max_tokens` ≥ 1 is accepted: generation also stops when the sequence reaches
    /// `max_seq_len`, so the request asks for at most the tokens that fit.
    pub(crate) fn request(
        &self,
        prompt: &[u32],
        params: &GenerateParams,
        prefix: usize,
    ) -> Result<GenerateRequest> {
        let loops = self.check_tokens(prompt, params.loops)?;
        params.sampling.validate()?;
        if params.max_tokens == 0 {
            return Err(Error::invalid("max_tokens must be >= 1"));
        }
        let max_seq = self.options.max_seq_len;
        // Both terms are at most max_seq (a prefix cache is shorter, check_tokens bounds the
        // prompt), so the sum cannot overflow.
        let room = max_seq.saturating_sub(prefix + prompt.len());
        if room == 0 {
            let cached = if prefix > 0 {
                format!("a prefix of {prefix} tokens + ")
            } else {
                String::new()
            };
            return Err(Error::invalid(format!(
                "{cached}prompt of {} tokens leaves no room to generate in max_seq_len {max_seq}",
                prompt.len(),
            )));
        }
        for &t in &params.stop_tokens {
            self.check_token(t, "stop token")?;
        }
        Ok(GenerateRequest {
            max_tokens: params.max_tokens.min(room),
            loops,
            sampling: params.sampling,
            stop_tokens: params.stop_tokens.clone(),
            monitor: beta_monitor::resolve(params.beta_monitor, &self.beta_env, self.options.log)?,
            exit: params.exit.map(|e| e.resolve(self.config())).transpose()?,
        })
    }

    pub(crate) fn check_token(&self, token: u32, what: &str) -> Result<()> {
        let vocab = self.config().vocab_size;
        if token as usize >= vocab {
            return Err(Error::invalid(format!(
                "{what} {token} is out of range for vocab_size {vocab}"
            )));
        }
        Ok(())
    }

    /// Validate a token sequence and resolve the loop count.
    pub(crate) fn check_tokens(&self, tokens: &[u32], loops: Option<usize>) -> Result<usize> {
        if tokens.is_empty() {
            return Err(Error::invalid("empty token sequence"));
        }
        let max_seq = self.options.max_seq_len;
        if tokens.len() > max_seq {
            return Err(Error::invalid(format!(
                "{} tokens exceed max_seq_len {max_seq}",
                tokens.len()
            )));
        }
        for (i, &t) in tokens.iter().enumerate() {
            self.check_token(t, &format!("token {i}:"))?;
        }
        self.resolve_loops(loops)
    }

    /// The loop count of a call: `loops`, or the model's default; in 1..=max_loops.
    pub(crate) fn resolve_loops(&self, loops: Option<usize>) -> Result<usize> {
        let loops = loops.unwrap_or(self.config().default_loops);
        let max_loops = self.options.max_loops;
        if loops == 0 || loops > max_loops {
            return Err(Error::invalid(format!(
                "loops must be in 1..={max_loops}, got {loops}"
            )));
        }
        Ok(loops)
    }
}
