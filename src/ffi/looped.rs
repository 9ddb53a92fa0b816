//! The calls that exist because the model loops: the logit lens and trajectory,
//! self-speculative generation, resuming a prompt at another depth, and the statistics of the
//! last generation call. Each operation is one function over a [`Target`], with its two entry
//! points side by side.

use super::bound::{resume_handle_arg, tl_resume_handle};
use super::calls::{c_tokens, fill};
use super::params::{
    generate_params, loops_arg, prompt_arg, speculation, tl_generate_stats, tl_speculative_params,
    tl_trajectory_point, write_versioned,
};
use super::target::Target;
use super::{
    boundary, non_null, tl_generate_params, tl_model, tl_session, tl_status, Failure, FfiResult,
};
use crate::{GenerateParams, Session};

/// The logit lens: logits `[loops, vocab_size]` (row-major) at the last position of
/// `tokens[0..n_tokens]`, read out after each of the `loops` iterations (TL_LOOPS_DEFAULT: the
/// model's default_loops) through the post blocks, the final norm and the head, into
/// `out[0..*len]`. Row L (1-based) equals `tl_score_last` at L loops, and the first L' rows at
/// `loops` are the rows at L'. `cap` must be >= loops * vocab_size, else
/// `TL_ERR_BUFFER_TOO_SMALL` with that number in `*len`. With prefill_chunk > 0, n_tokens must
/// be <= prefill_chunk.
///
/// Ownership: the caller owns all buffers. Threads: any thread; one call at a time per model.
///
/// # Safety
/// `tokens` valid for `n_tokens` reads; `out` for `cap` writes; `len` for one write.
#[no_mangle]
pub unsafe extern "C" fn tl_score_logit_lens(
    model: *const tl_model,
    tokens: *const i32,
    n_tokens: usize,
    loops: i32,
    out: *mut f32,
    cap: usize,
    len: *mut usize,
) -> tl_status {
    let target = Target::Model(model);
    let func = "tl_score_logit_lens";
    // SAFETY: the caller's contract, forwarded.
    unsafe { score_logit_lens(target, func, tokens, n_tokens, loops, out, cap, len) }
}

/// `tl_score_logit_lens` on a session.
///
/// Ownership: the caller owns all buffers. Threads: any thread; one call at a time per session.
///
/// # Safety
/// As `tl_score_logit_lens`.
#[no_mangle]
pub unsafe extern "C" fn tl_session_score_logit_lens(
    session: *const tl_session,
    tokens: *const i32,
    n_tokens: usize,
    loops: i32,
    out: *mut f32,
    cap: usize,
    len: *mut usize,
) -> tl_status {
    let target = Target::Session(session);
    let func = "tl_session_score_logit_lens";
    // SAFETY: the caller's contract, forwarded.
    unsafe { score_logit_lens(target, func, tokens, n_tokens, loops, out, cap, len) }
}

/// # Safety
/// Pointer arguments as documented on `tl_score_logit_lens`.
#[allow(clippy::too_many_arguments)]
unsafe fn score_logit_lens(
    target: Target,
    func: &'static str,
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
            let loops = s.shared.resolve_loops(loops_arg(loops)?)?;
            // loops <= max_loops <= u32::MAX and vocab_size <= 2^24: no overflow.
            let required = loops * s.config().vocab_size;
            // SAFETY: as above.
            unsafe {
                fill(out, cap, len, required, || {
                    Ok(s.score_logit_lens(&tokens, Some(loops))?)
                })
            }
        })
    })
}

/// The trajectory of the last position of `tokens[0..n_tokens]` through the loop iterations:
/// one `tl_trajectory_point` per iteration (hidden norm, relative change, KL to the previous
/// iteration, entropy, argmax; docs/NUMERICS.md "Logit lens and trajectory") into
/// `out[0..*len]`, `loops` points (TL_LOOPS_DEFAULT: default_loops). `cap` must be >= loops,
/// else `TL_ERR_BUFFER_TOO_SMALL` with `*len = loops`. The first L' points at `loops` are the
/// points at L'.
///
/// Ownership: the caller owns all buffers. Threads: any thread; one call at a time per model.
///
/// # Safety
/// `tokens` valid for `n_tokens` reads; `out` for `cap` writes; `len` for one write.
#[no_mangle]
pub unsafe extern "C" fn tl_score_trajectory(
    model: *const tl_model,
    tokens: *const i32,
    n_tokens: usize,
    loops: i32,
    out: *mut tl_trajectory_point,
    cap: usize,
    len: *mut usize,
) -> tl_status {
    let target = Target::Model(model);
    let func = "tl_score_trajectory";
    // SAFETY: the caller's contract, forwarded.
    unsafe { score_trajectory(target, func, tokens, n_tokens, loops, out, cap, len) }
}

/// `tl_score_trajectory` on a session.
///
/// Ownership: the caller owns all buffers. Threads: any thread; one call at a time per session.
///
/// # Safety
/// As `tl_score_trajectory`.
#[no_mangle]
pub unsafe extern "C" fn tl_session_score_trajectory(
    session: *const tl_session,
    tokens: *const i32,
    n_tokens: usize,
    loops: i32,
    out: *mut tl_trajectory_point,
    cap: usize,
    len: *mut usize,
) -> tl_status {
    let target = Target::Session(session);
    let func = "tl_session_score_trajectory";
    // SAFETY: the caller's contract, forwarded.
    unsafe { score_trajectory(target, func, tokens, n_tokens, loops, out, cap, len) }
}

/// # Safety
/// Pointer arguments as documented on `tl_score_trajectory`.
#[allow(clippy::too_many_arguments)]
unsafe fn score_trajectory(
    target: Target,
    func: &'static str,
    tokens: *const i32,
    n_tokens: usize,
    loops: i32,
    out: *mut tl_trajectory_point,
    cap: usize,
    len: *mut usize,
) -> tl_status {
    boundary(func, || {
        target.run(func, |s| {
            // SAFETY: the caller's contract, forwarded.
            let tokens = unsafe { prompt_arg(tokens, n_tokens) }?;
            let loops = s.shared.resolve_loops(loops_arg(loops)?)?;
            // SAFETY: as above.
            unsafe {
                fill(out, cap, len, loops, || {
                    let points = s.score_trajectory(&tokens, Some(loops))?;
                    Ok(points.iter().map(tl_trajectory_point::from).collect())
                })
            }
        })
    })
}

/// Self-speculative generation: up to `params->max_tokens` tokens after the prompt, drafted
/// `spec->draft_len` at a time at `spec->draft_loops` iterations and verified in one pass at
/// `params->loops` (the verify loops; TL_LOOPS_DEFAULT: default_loops), into `out[0..*len]`.
/// Greedy output equals `tl_generate` at the verify loops; sampled output is distributed as
/// plain sampling there (draft tokens accepted with probability min(1, p/q), else resampled
/// from max(0, p - q)). With `spec->reuse` the verify pass continues from the draft's KV
/// entries and hidden state; without it, it recomputes every block application (the baseline).
/// `params` and `spec` NULL mean the defaults (and the default spec's draft_loops 0 is
/// rejected). Acceptance statistics: `tl_last_generate_stats`. `cap` must be >= max_tokens.
///
/// Failures: as `tl_generate`, and `TL_ERR_INVALID_ARGUMENT` for draft_loops outside
/// 1..verify_loops-1, draft_len outside 1..=TL_MAX_DRAFT_LEN, or a `params->prefix_cache`.
///
/// Ownership: the caller owns all buffers. Threads: any thread; one call at a time per model.
///
/// # Safety
/// As `tl_generate`; `spec` NULL or from `tl_speculative_default_params`.
#[no_mangle]
pub unsafe extern "C" fn tl_generate_speculative(
    model: *const tl_model,
    tokens: *const i32,
    n_tokens: usize,
    params: *const tl_generate_params,
    spec: *const tl_speculative_params,
    out: *mut i32,
    cap: usize,
    len: *mut usize,
) -> tl_status {
    let target = Target::Model(model);
    let func = "tl_generate_speculative";
    // SAFETY: the caller's contract, forwarded.
    unsafe { generate_speculative(target, func, tokens, n_tokens, params, spec, out, cap, len) }
}

/// `tl_generate_speculative` on a session.
///
/// Ownership: the caller owns all buffers. Threads: any thread; one call at a time per session.
///
/// # Safety
/// As `tl_generate_speculative`.
#[no_mangle]
pub unsafe extern "C" fn tl_session_generate_speculative(
    session: *const tl_session,
    tokens: *const i32,
    n_tokens: usize,
    params: *const tl_generate_params,
    spec: *const tl_speculative_params,
    out: *mut i32,
    cap: usize,
    len: *mut usize,
) -> tl_status {
    let target = Target::Session(session);
    let func = "tl_session_generate_speculative";
    // SAFETY: the caller's contract, forwarded.
    unsafe { generate_speculative(target, func, tokens, n_tokens, params, spec, out, cap, len) }
}

/// # Safety
/// Pointer arguments as documented on `tl_generate_speculative`.
#[allow(clippy::too_many_arguments)]
unsafe fn generate_speculative(
    target: Target,
    func: &'static str,
    tokens: *const i32,
    n_tokens: usize,
    params: *const tl_generate_params,
    spec: *const tl_speculative_params,
    out: *mut i32,
    cap: usize,
    len: *mut usize,
) -> tl_status {
    boundary(func, || {
        target.run(func, |s| {
            // SAFETY: the caller's contract, forwarded.
            let prompt = unsafe { prompt_arg(tokens, n_tokens) }?;
            // SAFETY: as above.
            let params = unsafe { params_without_prefix(params, func) }?;
            // SAFETY: as above.
            let spec = unsafe { speculation(spec) }?;
            // SAFETY: as above.
            unsafe {
                fill(out, cap, len, params.max_tokens, || {
                    let generated =
                        s.generate_speculative(&prompt, &params, &spec, &mut |_| true)?;
                    Ok(c_tokens(generated))
                })
            }
        })
    })
}

/// Generate after the prompt of a resume handle at `params->loops` (the new depth;
/// TL_LOOPS_DEFAULT: default_loops), into `out[0..*len]`: the same tokens as `tl_generate` from
/// that prompt at those loops, for loops above and below the handle's, keeping the pre blocks
/// and the iterations the handle already ran (up to the smaller loop count). The handle is
/// only read: it may be resumed any number of times, by any session of its model, also at once.
/// `cap` must be >= max_tokens.
///
/// Failures: as `tl_generate` (loops above max_loops included), and `TL_ERR_INVALID_ARGUMENT`
/// for NULL `handle`, a handle of another model or a `params->prefix_cache`; `TL_ERR_CLOSED`
/// for a freed handle or one whose model was closed.
///
/// Ownership: the caller owns all buffers; the handle stays the caller's. Threads: any thread;
/// one call at a time per model.
///
/// # Safety
/// As `tl_generate`.
#[no_mangle]
pub unsafe extern "C" fn tl_resume_generate(
    model: *const tl_model,
    handle: *const tl_resume_handle,
    params: *const tl_generate_params,
    out: *mut i32,
    cap: usize,
    len: *mut usize,
) -> tl_status {
    let target = Target::Model(model);
    // SAFETY: the caller's contract, forwarded.
    unsafe { resume_generate(target, "tl_resume_generate", handle, params, out, cap, len) }
}

/// `tl_resume_generate` on a session.
///
/// Ownership: the caller owns all buffers. Threads: any thread; one call at a time per session.
///
/// # Safety
/// As `tl_resume_generate`.
#[no_mangle]
pub unsafe extern "C" fn tl_session_resume_generate(
    session: *const tl_session,
    handle: *const tl_resume_handle,
    params: *const tl_generate_params,
    out: *mut i32,
    cap: usize,
    len: *mut usize,
) -> tl_status {
    let target = Target::Session(session);
    let func = "tl_session_resume_generate";
    // SAFETY: the caller's contract, forwarded.
    unsafe { resume_generate(target, func, handle, params, out, cap, len) }
}

/// # Safety
/// Pointer arguments as documented on `tl_resume_generate`.
unsafe fn resume_generate(
    target: Target,
    func: &'static str,
    handle: *const tl_resume_handle,
    params: *const tl_generate_params,
    out: *mut i32,
    cap: usize,
    len: *mut usize,
) -> tl_status {
    boundary(func, || {
        target.run(func, |s| {
            let handle = resume_handle_arg(handle, func)?;
            // SAFETY: the caller's contract, forwarded.
            let params = unsafe { params_without_prefix(params, func) }?;
            // SAFETY: as above.
            unsafe {
                fill(out, cap, len, params.max_tokens, || {
                    let generated = s.resume_generate(&handle, &params, &mut |_| true)?;
                    Ok(c_tokens(generated))
                })
            }
        })
    })
}

/// Generate params for a call that starts from something else than a prefix cache.
///
/// # Safety
/// As [`generate_params`].
pub(super) unsafe fn params_without_prefix(
    params: *const tl_generate_params,
    func: &str,
) -> FfiResult<GenerateParams> {
    // SAFETY: forwarded contract.
    let (params, prefix) = unsafe { generate_params(params) }?;
    if !prefix.is_null() {
        return Err(Failure::invalid(format!(
            "tl_generate_params.prefix_cache is set, but {func} does not take a prefix cache"
        )));
    }
    Ok(params)
}

/// What the last successful generation call on the model's default session did (any of the
/// generate, speculative and resume functions): tokens returned, prefill and decode times, and
/// for speculative calls the drafted and accepted tokens, the acceptance rate and the draft /
/// verify argmax agreement; for monitored calls the BETA-MON summary (`beta_mon` true). All zero
/// before the first one. The caller sets
/// `out->struct_size = sizeof(tl_generate_stats)` first.
///
/// Ownership: the caller owns `*out`. Threads: any thread; `TL_ERR_BUSY` while a call is
/// running on the model's default session.
///
/// # Safety
/// `out` must be NULL or valid for reads and writes of its `struct_size` bytes.
#[no_mangle]
pub unsafe extern "C" fn tl_last_generate_stats(
    model: *const tl_model,
    out: *mut tl_generate_stats,
) -> tl_status {
    // SAFETY: the caller's contract, forwarded.
    unsafe { last_generate_stats(Target::Model(model), "tl_last_generate_stats", out) }
}

/// `tl_last_generate_stats` of a session.
///
/// Ownership: the caller owns `*out`. Threads: any thread; `TL_ERR_BUSY` while a call is
/// running on the session.
///
/// # Safety
/// As `tl_last_generate_stats`.
#[no_mangle]
pub unsafe extern "C" fn tl_session_last_generate_stats(
    session: *const tl_session,
    out: *mut tl_generate_stats,
) -> tl_status {
    let target = Target::Session(session);
    // SAFETY: the caller's contract, forwarded.
    unsafe { last_generate_stats(target, "tl_session_last_generate_stats", out) }
}

/// # Safety
/// Pointer arguments as documented on `tl_last_generate_stats`.
unsafe fn last_generate_stats(
    target: Target,
    func: &'static str,
    out: *mut tl_generate_stats,
) -> tl_status {
    boundary(func, || {
        target.run(func, |s: &mut Session| {
            non_null(out, "out")?;
            let stats = tl_generate_stats::new(&s.last_generate_stats());
            // SAFETY: non-NULL; valid for its struct_size bytes by the caller's contract.
            unsafe {
                write_versioned(
                    out,
                    stats,
                    &tl_generate_stats::earlier_sizes(),
                    "tl_generate_stats",
                )
            }
        })
    })
}
