//! Generation and scoring on a session: each operation is one function over a [`Target`], with
//! its two entry points side by side (`tl_*` on a model handle's default session,
//! `tl_session_*` on a session).

use std::ffi::c_void;

use super::bound::prefix_cache_arg;
use super::params::{
    check_buffer, generate_params, loops_arg, prompt_arg, score_exit_params, write_buffer,
};
use super::session::tl_token_callback;
use super::target::Target;
use super::{boundary, tl_generate_params, tl_model, tl_session, tl_status, Failure, FfiResult};
use crate::Session;

/// Check the output buffer `(out, cap, len)` against `required`, then run `produce` and copy
/// its result (at most `required` elements) to the buffer.
///
/// # Safety
/// `out` must be valid for `cap` writes and `len` NULL or valid for one write.
pub(crate) unsafe fn fill<T: Copy>(
    out: *mut T,
    cap: usize,
    len: *mut usize,
    required: usize,
    produce: impl FnOnce() -> FfiResult<Vec<T>>,
) -> FfiResult {
    // SAFETY: the caller's contract.
    unsafe { check_buffer(out, cap, len, required) }?;
    let data = produce()?;
    debug_assert!(data.len() <= required);
    // SAFETY: checked by check_buffer: cap >= required >= data.len().
    unsafe { write_buffer(out, &data, len) };
    Ok(())
}

/// Tokens as C returns them (ids are < vocab_size <= i32::MAX, checked at load).
pub(crate) fn c_tokens(tokens: Vec<u32>) -> Vec<i32> {
    tokens.into_iter().map(|t| t as i32).collect()
}

/// Generate up to `params->max_tokens` tokens after the prompt `tokens[0..n_tokens]` on the
/// model's default session (greedy by default; `params` NULL = defaults), after the prefix of
/// `params->prefix_cache` when it is set. Generation also stops when the sequence (prefix,
/// prompt and new tokens) reaches max_seq_len. On success the new tokens (stop token excluded)
/// are in `out[0..*len]`. `cap` must be >= max_tokens, else `TL_ERR_BUFFER_TOO_SMALL` with
/// `*len = max_tokens` before any work.
///
/// Failures: `TL_ERR_INVALID_ARGUMENT` (NULL, empty prompt, negative token or token >=
/// vocab_size, bad params, a prompt (+ the prefix) that leaves no room in max_seq_len, a prefix
/// cache of another model or built at other loops), `TL_ERR_BUSY` (another call on this model is
/// running), `TL_ERR_CANCELLED` (`tl_cancel`), `TL_ERR_CLOSED` (the model, or the prefix cache).
///
/// Ownership: the caller owns all buffers; nothing is retained after the call.
/// Threads: any thread; one call at a time per model (use sessions for concurrency).
///
/// # Safety
/// `tokens` valid for `n_tokens` reads; `params` NULL or from `tl_generate_default_params`;
/// `out` valid for `cap` writes; `len` for one write.
#[no_mangle]
pub unsafe extern "C" fn tl_generate(
    model: *const tl_model,
    tokens: *const i32,
    n_tokens: usize,
    params: *const tl_generate_params,
    out: *mut i32,
    cap: usize,
    len: *mut usize,
) -> tl_status {
    let target = Target::Model(model);
    // SAFETY: the caller's contract, forwarded.
    unsafe {
        generate(
            target,
            "tl_generate",
            tokens,
            n_tokens,
            params,
            out,
            cap,
            len,
        )
    }
}

/// `tl_generate` on a session: up to `params->max_tokens` new tokens after the prompt into
/// `out[0..*len]` (`cap` >= max_tokens, else `TL_ERR_BUFFER_TOO_SMALL` with `*len =
/// max_tokens`). `TL_ERR_BUSY` when another call on this session is running.
///
/// Ownership: the caller owns all buffers. Threads: any thread; one call at a time per session.
///
/// # Safety
/// Pointers other than `session` as `tl_generate`.
#[no_mangle]
pub unsafe extern "C" fn tl_session_generate(
    session: *const tl_session,
    tokens: *const i32,
    n_tokens: usize,
    params: *const tl_generate_params,
    out: *mut i32,
    cap: usize,
    len: *mut usize,
) -> tl_status {
    let target = Target::Session(session);
    // SAFETY: the caller's contract, forwarded.
    unsafe {
        generate(
            target,
            "tl_session_generate",
            tokens,
            n_tokens,
            params,
            out,
            cap,
            len,
        )
    }
}

/// # Safety
/// Pointer arguments as documented on `tl_generate`.
#[allow(clippy::too_many_arguments)]
unsafe fn generate(
    target: Target,
    func: &'static str,
    tokens: *const i32,
    n_tokens: usize,
    params: *const tl_generate_params,
    out: *mut i32,
    cap: usize,
    len: *mut usize,
) -> tl_status {
    boundary(func, || {
        target.run(func, |s| {
            // SAFETY: the caller's contract, forwarded.
            let prompt = unsafe { prompt_arg(tokens, n_tokens) }?;
            // SAFETY: as above.
            let (params, prefix) = unsafe { generate_params(params) }?;
            let prefix = prefix_cache_arg(prefix, func)?;
            // SAFETY: as above.
            unsafe {
                fill(out, cap, len, params.max_tokens, || {
                    let generated = match &prefix {
                        Some(cache) => {
                            s.generate_with_prefix(cache, &prompt, &params, &mut |_| true)
                        }
                        None => s.generate(&prompt, &params),
                    }?;
                    Ok(c_tokens(generated))
                })
            }
        })
    })
}

/// Like `tl_generate`, but calls `callback(token, user_data)` on the calling thread for each
/// new token as soon as it exists; returning false stops generation early (TL_OK). Tokens
/// already delivered stay delivered when the call later fails (e.g. `TL_ERR_CANCELLED`).
/// The callback may call `tl_cancel`; any other call on this model from inside it returns
/// `TL_ERR_BUSY`.
///
/// Ownership: `user_data` is passed through untouched. Threads: as `tl_generate`.
///
/// # Safety
/// As `tl_generate`; `callback` must be safe to call with `user_data` during the call.
#[no_mangle]
pub unsafe extern "C" fn tl_generate_stream(
    model: *const tl_model,
    tokens: *const i32,
    n_tokens: usize,
    params: *const tl_generate_params,
    callback: tl_token_callback,
    user_data: *mut c_void,
) -> tl_status {
    let target = Target::Model(model);
    let func = "tl_generate_stream";
    // SAFETY: the caller's contract, forwarded.
    unsafe { generate_stream(target, func, tokens, n_tokens, params, callback, user_data) }
}

/// `tl_generate_stream` on a session: `callback(token, user_data)` per new token on the calling
/// thread; false stops early (TL_OK). The callback may call `tl_session_cancel`; any other call
/// on this session from inside it returns `TL_ERR_BUSY`.
///
/// Ownership: `user_data` is passed through. Threads: any thread; one call at a time per
/// session.
///
/// # Safety
/// Arguments other than `session` as `tl_generate_stream`.
#[no_mangle]
pub unsafe extern "C" fn tl_session_generate_stream(
    session: *const tl_session,
    tokens: *const i32,
    n_tokens: usize,
    params: *const tl_generate_params,
    callback: tl_token_callback,
    user_data: *mut c_void,
) -> tl_status {
    let target = Target::Session(session);
    let func = "tl_session_generate_stream";
    // SAFETY: the caller's contract, forwarded.
    unsafe { generate_stream(target, func, tokens, n_tokens, params, callback, user_data) }
}

/// # Safety
/// Pointer arguments as documented on `tl_generate_stream`.
unsafe fn generate_stream(
    target: Target,
    func: &'static str,
    tokens: *const i32,
    n_tokens: usize,
    params: *const tl_generate_params,
    callback: tl_token_callback,
    user_data: *mut c_void,
) -> tl_status {
    boundary(func, || {
        target.run(func, |s| {
            // SAFETY: the caller's contract, forwarded.
            let prompt = unsafe { prompt_arg(tokens, n_tokens) }?;
            // SAFETY: as above.
            let (params, prefix) = unsafe { generate_params(params) }?;
            let prefix = prefix_cache_arg(prefix, func)?;
            let callback = callback.ok_or_else(|| Failure::invalid("callback is NULL"))?;
            let mut on_token = |t: u32| {
                // SAFETY: the caller guarantees the callback may be called with user_data.
                unsafe { callback(t as i32, user_data) }
            };
            match &prefix {
                Some(cache) => s.generate_with_prefix(cache, &prompt, &params, &mut on_token),
                None => s.generate_stream(&prompt, &params, &mut on_token),
            }?;
            Ok(())
        })
    })
}

/// Logits `[vocab_size]` at the last position of `tokens[0..n_tokens]`, run at `loops`
/// iterations (TL_LOOPS_DEFAULT = model default), into `out[0..*len]`. `cap` must be >=
/// vocab_size, else `TL_ERR_BUFFER_TOO_SMALL` with `*len = vocab_size`. With prefill_chunk > 0,
/// n_tokens must be <= prefill_chunk. Like every score call, it is stopped by `tl_cancel` or
/// `tl_close` from another thread at the next block application (`TL_ERR_CANCELLED`, `out` and
/// `*len` unwritten).
///
/// Ownership: the caller owns all buffers. Threads: any thread; one call at a time per model.
///
/// # Safety
/// `tokens` valid for `n_tokens` reads; `out` for `cap` writes; `len` for one write.
#[no_mangle]
pub unsafe extern "C" fn tl_score_last(
    model: *const tl_model,
    tokens: *const i32,
    n_tokens: usize,
    loops: i32,
    out: *mut f32,
    cap: usize,
    len: *mut usize,
) -> tl_status {
    let target = Target::Model(model);
    // SAFETY: the caller's contract, forwarded.
    unsafe {
        score(
            target,
            "tl_score_last",
            Rows::Last,
            tokens,
            n_tokens,
            loops,
            out,
            cap,
            len,
        )
    }
}

/// `tl_score_last` on a session: logits `[vocab_size]` at the last position into
/// `out[0..*len]`.
///
/// Ownership: the caller owns all buffers. Threads: any thread; one call at a time per session.
///
/// # Safety
/// Pointers other than `session` as `tl_score_last`.
#[no_mangle]
pub unsafe extern "C" fn tl_session_score_last(
    session: *const tl_session,
    tokens: *const i32,
    n_tokens: usize,
    loops: i32,
    out: *mut f32,
    cap: usize,
    len: *mut usize,
) -> tl_status {
    let target = Target::Session(session);
    let func = "tl_session_score_last";
    // SAFETY: the caller's contract, forwarded.
    unsafe {
        score(
            target,
            func,
            Rows::Last,
            tokens,
            n_tokens,
            loops,
            out,
            cap,
            len,
        )
    }
}

/// Logits `[n_tokens, vocab_size]` (row-major) for every position of `tokens`, on the model's
/// default session, into `out[0..*len]`; `cap` must be >= n_tokens * vocab_size, else
/// `TL_ERR_BUFFER_TOO_SMALL` with that number in `*len`.
///
/// Ownership: the caller owns all buffers. Threads: any thread; one call at a time per model.
///
/// # Safety
/// As `tl_score_last`.
#[no_mangle]
pub unsafe extern "C" fn tl_score(
    model: *const tl_model,
    tokens: *const i32,
    n_tokens: usize,
    loops: i32,
    out: *mut f32,
    cap: usize,
    len: *mut usize,
) -> tl_status {
    let target = Target::Model(model);
    // SAFETY: the caller's contract, forwarded.
    unsafe {
        score(
            target,
            "tl_score",
            Rows::All,
            tokens,
            n_tokens,
            loops,
            out,
            cap,
            len,
        )
    }
}

/// Logits `[n_tokens, vocab_size]` (row-major) for every position, into `out[0..*len]`; `cap`
/// must be >= n_tokens * vocab_size, else `TL_ERR_BUFFER_TOO_SMALL` with that number in `*len`.
///
/// Ownership: the caller owns all buffers. Threads: any thread; one call at a time per session.
///
/// # Safety
/// `tokens` valid for `n_tokens` reads; `out` for `cap` writes; `len` for one write.
#[no_mangle]
pub unsafe extern "C" fn tl_session_score(
    session: *const tl_session,
    tokens: *const i32,
    n_tokens: usize,
    loops: i32,
    out: *mut f32,
    cap: usize,
    len: *mut usize,
) -> tl_status {
    let target = Target::Session(session);
    let func = "tl_session_score";
    // SAFETY: the caller's contract, forwarded.
    unsafe {
        score(
            target,
            func,
            Rows::All,
            tokens,
            n_tokens,
            loops,
            out,
            cap,
            len,
        )
    }
}

/// `tl_score` under an exit rule (docs/ABI.md "Adaptive exit"), on the model's default session:
/// logits `[n_tokens, vocab_size]` (row-major) into `out[0..*len]`, each position's from its exit
/// iteration, and those iterations (1-based) into `exit_steps[0..n_tokens]` unless it is NULL.
/// `tokens[0..prompt_len]` run as a generation call's prompt does and every later position as a
/// generated token does (its own one-row step at the rule's policy), so the result is what
/// generation computes had it produced `tokens[prompt_len..]`. The gate decides per position; a
/// criterion per call, so the prompt's positions get the iteration of the step they ran in.
/// `params` gives `loops` and the rule (`exit_threshold` or `exit`, and `exit_policy`), which is
/// required; its sampling fields, `max_tokens`, stop tokens, `ctx_tier` and `beta_monitor`
/// fields are not read (a score call chooses no token and runs without a tier). `cap` must
/// be >= n_tokens * vocab_size, else `TL_ERR_BUFFER_TOO_SMALL` with that number in `*len`
/// before any work. Not limited by prefill_chunk (the prompt runs in its chunks, as
/// generation's).
///
/// Failures: `TL_ERR_INVALID_ARGUMENT` (NULL `model`, `tokens`, `params` or `len`; no tokens, a
/// negative token or one >= vocab_size, more than max_seq_len; `prompt_len` 0 or above
/// n_tokens; no exit rule, bad exit fields or loops, the gate on a model without an exit gate,
/// `exit_policy` "skip" in KV mode delta or age, `prefix_cache` set), `TL_ERR_BUFFER_TOO_SMALL`,
/// `TL_ERR_BUSY` (another call on this model is running), `TL_ERR_CANCELLED` (`tl_cancel`,
/// `tl_close`), `TL_ERR_CLOSED`. `out`, `*len` and `exit_steps` are written only on success.
///
/// Ownership: the caller owns all buffers. Threads: any thread; one call at a time per model.
///
/// # Safety
/// `tokens` valid for `n_tokens` reads; `params` NULL or from `tl_generate_default_params`;
/// `out` valid for `cap` writes; `len` for one write; `exit_steps` NULL or valid for `n_tokens`
/// writes.
#[no_mangle]
pub unsafe extern "C" fn tl_score_exit(
    model: *const tl_model,
    tokens: *const i32,
    n_tokens: usize,
    prompt_len: usize,
    params: *const tl_generate_params,
    out: *mut f32,
    cap: usize,
    len: *mut usize,
    exit_steps: *mut i32,
) -> tl_status {
    let target = Target::Model(model);
    // SAFETY: the caller's contract, forwarded.
    unsafe {
        score_exit(
            target,
            "tl_score_exit",
            tokens,
            n_tokens,
            prompt_len,
            params,
            out,
            cap,
            len,
            exit_steps,
        )
    }
}

/// `tl_score_exit` on a session: logits `[n_tokens, vocab_size]` under the exit rule of
/// `params` into `out[0..*len]`, each position's exit iteration into `exit_steps` unless it is
/// NULL. `TL_ERR_BUSY` when another call on this session is running.
///
/// Ownership: the caller owns all buffers. Threads: any thread; one call at a time per session.
///
/// # Safety
/// Pointers other than `session` as `tl_score_exit`.
#[no_mangle]
pub unsafe extern "C" fn tl_session_score_exit(
    session: *const tl_session,
    tokens: *const i32,
    n_tokens: usize,
    prompt_len: usize,
    params: *const tl_generate_params,
    out: *mut f32,
    cap: usize,
    len: *mut usize,
    exit_steps: *mut i32,
) -> tl_status {
    let target = Target::Session(session);
    let func = "tl_session_score_exit";
    // SAFETY: the caller's contract, forwarded.
    unsafe {
        score_exit(
            target, func, tokens, n_tokens, prompt_len, params, out, cap, len, exit_steps,
        )
    }
}

/// # Safety
/// Pointer arguments as documented on `tl_score_exit`.
#[allow(clippy::too_many_arguments)]
unsafe fn score_exit(
    target: Target,
    func: &'static str,
    tokens: *const i32,
    n_tokens: usize,
    prompt_len: usize,
    params: *const tl_generate_params,
    out: *mut f32,
    cap: usize,
    len: *mut usize,
    exit_steps: *mut i32,
) -> tl_status {
    boundary(func, || {
        target.run(func, |s| {
            // SAFETY: the caller's contract, forwarded.
            let tokens = unsafe { prompt_arg(tokens, n_tokens) }?;
            // SAFETY: as above.
            let (loops, exit) = unsafe { score_exit_params(params) }?;
            let required = Rows::All.required(s, tokens.len())?;
            let mut steps = Vec::new();
            // SAFETY: as above.
            unsafe {
                fill(out, cap, len, required, || {
                    let (logits, exits) = s.score_exit(&tokens, prompt_len, loops, exit)?;
                    steps = exits;
                    Ok(logits)
                })
            }?;
            if !exit_steps.is_null() {
                // One per token, each at most loops: the call's int32_t or default_loops <= 1024.
                let steps: Vec<i32> = steps.into_iter().map(|e| e as i32).collect();
                // SAFETY: valid for n_tokens = steps.len() writes by the caller's contract.
                unsafe { std::ptr::copy_nonoverlapping(steps.as_ptr(), exit_steps, steps.len()) };
            }
            Ok(())
        })
    })
}

/// `log p(tokens[i+1] | tokens[0..=i])` for i < n_tokens - 1 on the model's default session,
/// into `out[0..*len]` (n_tokens >= 2; `cap` >= n_tokens - 1, else `TL_ERR_BUFFER_TOO_SMALL`).
///
/// Ownership: the caller owns all buffers. Threads: any thread; one call at a time per model.
///
/// # Safety
/// As `tl_score_last`.
#[no_mangle]
pub unsafe extern "C" fn tl_logprobs(
    model: *const tl_model,
    tokens: *const i32,
    n_tokens: usize,
    loops: i32,
    out: *mut f32,
    cap: usize,
    len: *mut usize,
) -> tl_status {
    let target = Target::Model(model);
    let func = "tl_logprobs";
    // SAFETY: the caller's contract, forwarded.
    unsafe {
        score(
            target,
            func,
            Rows::Logprobs,
            tokens,
            n_tokens,
            loops,
            out,
            cap,
            len,
        )
    }
}

/// `log p(tokens[i+1] | tokens[0..=i])` for i < n_tokens - 1, into `out[0..*len]` (n_tokens
/// >= 2; `cap` >= n_tokens - 1, else `TL_ERR_BUFFER_TOO_SMALL`).
///
/// Ownership: the caller owns all buffers. Threads: any thread; one call at a time per session.
///
/// # Safety
/// As `tl_session_score`.
#[no_mangle]
pub unsafe extern "C" fn tl_session_logprobs(
    session: *const tl_session,
    tokens: *const i32,
    n_tokens: usize,
    loops: i32,
    out: *mut f32,
    cap: usize,
    len: *mut usize,
) -> tl_status {
    let target = Target::Session(session);
    let func = "tl_session_logprobs";
    // SAFETY: the caller's contract, forwarded.
    unsafe {
        score(
            target,
            func,
            Rows::Logprobs,
            tokens,
            n_tokens,
            loops,
            out,
            cap,
            len,
        )
    }
}

/// `tl_logprobs` computed through the decode path, on the model's default session: each token
/// but the last is fed as its own one-row decode step, exactly as generation feeds the tokens
/// it produces, so the values are those a generation call computes (docs/NUMERICS.md "Scoring
/// through the decode path"). n_tokens >= 2 and <= max_seq_len (not limited by
/// prefill_chunk); `cap` >= n_tokens - 1, else `TL_ERR_BUFFER_TOO_SMALL`.
///
/// Ownership: the caller owns all buffers. Threads: any thread; one call at a time per model.
///
/// # Safety
/// As `tl_score_last`.
#[no_mangle]
pub unsafe extern "C" fn tl_logprobs_decode(
    model: *const tl_model,
    tokens: *const i32,
    n_tokens: usize,
    loops: i32,
    out: *mut f32,
    cap: usize,
    len: *mut usize,
) -> tl_status {
    let target = Target::Model(model);
    let func = "tl_logprobs_decode";
    // SAFETY: the caller's contract, forwarded.
    unsafe {
        score(
            target,
            func,
            Rows::LogprobsDecode,
            tokens,
            n_tokens,
            loops,
            out,
            cap,
            len,
        )
    }
}

/// `tl_session_logprobs` computed through the decode path (as `tl_logprobs_decode`), into
/// `out[0..*len]` (n_tokens >= 2; `cap` >= n_tokens - 1, else `TL_ERR_BUFFER_TOO_SMALL`).
///
/// Ownership: the caller owns all buffers. Threads: any thread; one call at a time per session.
///
/// # Safety
/// As `tl_session_score`.
#[no_mangle]
pub unsafe extern "C" fn tl_session_logprobs_decode(
    session: *const tl_session,
    tokens: *const i32,
    n_tokens: usize,
    loops: i32,
    out: *mut f32,
    cap: usize,
    len: *mut usize,
) -> tl_status {
    let target = Target::Session(session);
    let func = "tl_session_logprobs_decode";
    // SAFETY: the caller's contract, forwarded.
    unsafe {
        score(
            target,
            func,
            Rows::LogprobsDecode,
            tokens,
            n_tokens,
            loops,
            out,
            cap,
            len,
        )
    }
}

/// What a score call returns.
#[derive(Clone, Copy)]
enum Rows {
    /// `tl_score_last`: the logits of the last position.
    Last,
    /// `tl_score`: the logits of every position.
    All,
    /// `tl_logprobs`: the log-probability of each next token.
    Logprobs,
    /// `tl_logprobs_decode`: the same, each token fed as a decode step.
    LogprobsDecode,
}

impl Rows {
    /// The output length for `n` tokens.
    fn required(self, s: &Session, n: usize) -> FfiResult<usize> {
        let vocab = s.config().vocab_size;
        match self {
            Rows::Last => Ok(vocab),
            Rows::All => n
                .checked_mul(vocab)
                .ok_or_else(|| Failure::invalid("n_tokens * vocab_size overflows")),
            Rows::Logprobs | Rows::LogprobsDecode if n < 2 => {
                Err(Failure::invalid("logprobs needs at least 2 tokens"))
            }
            Rows::Logprobs | Rows::LogprobsDecode => Ok(n - 1),
        }
    }
}

/// # Safety
/// Pointer arguments as documented on `tl_score_last`.
#[allow(clippy::too_many_arguments)]
unsafe fn score(
    target: Target,
    func: &'static str,
    rows: Rows,
    tokens: *const i32,
    n_tokens: usize,
    loops: i32,
    out: *mut f32,
    cap: usize,
    len: *mut usize,
) -> tl_status {
    boundary(func, || {
        target.run(func, |s| {
            // SAFETY: the caller's contract, forwarded.
            let tokens = unsafe { prompt_arg(tokens, n_tokens) }?;
            let loops = loops_arg(loops)?;
            let required = rows.required(s, tokens.len())?;
            // SAFETY: as above.
            unsafe {
                fill(out, cap, len, required, || {
                    Ok(match rows {
                        Rows::Last => s.score_last(&tokens, loops),
                        Rows::All => s.score(&tokens, loops),
                        Rows::Logprobs => s.logprobs(&tokens, loops),
                        Rows::LogprobsDecode => s.logprobs_decode(&tokens, loops),
                    }?)
                })
            }
        })
    })
}
