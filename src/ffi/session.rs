//! `tl_session`: one sequence's buffers and KV cache over a shared model, and the operations
//! shared by sessions and the model's default session.

use std::ffi::c_void;
use std::sync::Mutex;

use super::params::tl_generate_params;
use super::{boundary, boundary_void, enter_cancelling, tl_status, try_enter, Failure, FfiResult};
use crate::{CancelHandle, Session};

/// Called for each generated token with the `user_data` given to the call; return true to
/// continue, false to stop generation (the call then returns TL_OK).
pub type tl_token_callback =
    Option<unsafe extern "C" fn(token: i32, user_data: *mut c_void) -> bool>;

/// A session: runtime buffers and KV cache of one sequence over a model's shared weights.
/// Opaque; created by `tl_session_new`, freed by `tl_session_free`.
pub struct tl_session {
    session: Mutex<Session>,
    cancel: CancelHandle,
}

pub(crate) fn new_handle(session: Session) -> *mut tl_session {
    Box::into_raw(Box::new(tl_session {
        cancel: session.cancel_handle(),
        session: Mutex::new(session),
    }))
}

/// Run `f` on the session with its mutex held (`TL_ERR_BUSY` when another call holds it).
///
/// # Safety
/// `session` must be NULL or a live handle from `tl_session_new`.
unsafe fn with_session<R>(
    session: *const tl_session,
    f: impl FnOnce(&mut Session) -> FfiResult<R>,
) -> FfiResult<R> {
    // SAFETY: NULL or live by the caller's contract.
    let handle = unsafe { session.as_ref() }.ok_or_else(|| Failure::invalid("session is NULL"))?;
    let mut held = try_enter(&handle.session, "the session")?;
    f(&mut held)
}

/// The operations behind both the model-handle and the session-handle entry points.
pub(crate) mod ops {
    use std::ffi::c_void;

    use super::super::params::{
        check_buffer, generate_params, loops_arg, prompt_arg, tl_generate_params, write_buffer,
    };
    use super::super::{Failure, FfiResult};
    use super::tl_token_callback;
    use crate::Session;

    /// # Safety
    /// Pointer arguments as documented on `tl_generate`.
    pub(crate) unsafe fn generate(
        s: &mut Session,
        tokens: *const i32,
        n_tokens: usize,
        params: *const tl_generate_params,
        out: *mut i32,
        cap: usize,
        len: *mut usize,
    ) -> FfiResult {
        // SAFETY: forwarded contract.
        let prompt = unsafe { prompt_arg(tokens, n_tokens) }?;
        // SAFETY: forwarded contract.
        let params = unsafe { generate_params(params) }?;
        // SAFETY: forwarded contract.
        unsafe { check_buffer(out, cap, len, params.max_tokens) }?;
        let generated = s.generate(&prompt, &params)?;
        // Tokens are < vocab_size <= i32::MAX (checked at load), so the cast is exact.
        let generated: Vec<i32> = generated.into_iter().map(|t| t as i32).collect();
        // SAFETY: checked by check_buffer: cap >= max_tokens >= generated.len().
        unsafe { write_buffer(out, &generated, len) };
        Ok(())
    }

    /// # Safety
    /// Pointer arguments as documented on `tl_generate_stream`.
    pub(crate) unsafe fn generate_stream(
        s: &mut Session,
        tokens: *const i32,
        n_tokens: usize,
        params: *const tl_generate_params,
        callback: tl_token_callback,
        user_data: *mut c_void,
    ) -> FfiResult {
        // SAFETY: forwarded contract.
        let prompt = unsafe { prompt_arg(tokens, n_tokens) }?;
        // SAFETY: forwarded contract.
        let params = unsafe { generate_params(params) }?;
        let callback = callback.ok_or_else(|| Failure::invalid("callback is NULL"))?;
        let mut on_token = |t: u32| {
            // SAFETY: the caller guarantees the callback may be called with user_data.
            unsafe { callback(t as i32, user_data) }
        };
        s.generate_stream(&prompt, &params, &mut on_token)?;
        Ok(())
    }

    /// # Safety
    /// Pointer arguments as documented on `tl_score_last`.
    pub(crate) unsafe fn score_last(
        s: &mut Session,
        tokens: *const i32,
        n_tokens: usize,
        loops: i32,
        out: *mut f32,
        cap: usize,
        len: *mut usize,
    ) -> FfiResult {
        // SAFETY: forwarded contract.
        let tokens = unsafe { prompt_arg(tokens, n_tokens) }?;
        let loops = loops_arg(loops)?;
        let vocab = s.config().vocab_size;
        // SAFETY: forwarded contract.
        unsafe { check_buffer(out, cap, len, vocab) }?;
        let logits = s.score_last(&tokens, loops)?;
        // SAFETY: cap >= vocab == logits.len().
        unsafe { write_buffer(out, &logits, len) };
        Ok(())
    }

    /// # Safety
    /// Pointer arguments as documented on `tl_session_score`.
    pub(crate) unsafe fn score(
        s: &mut Session,
        tokens: *const i32,
        n_tokens: usize,
        loops: i32,
        out: *mut f32,
        cap: usize,
        len: *mut usize,
    ) -> FfiResult {
        // SAFETY: forwarded contract.
        let tokens = unsafe { prompt_arg(tokens, n_tokens) }?;
        let loops = loops_arg(loops)?;
        let required = tokens
            .len()
            .checked_mul(s.config().vocab_size)
            .ok_or_else(|| Failure::invalid("n_tokens * vocab_size overflows"))?;
        // SAFETY: forwarded contract.
        unsafe { check_buffer(out, cap, len, required) }?;
        let logits = s.score(&tokens, loops)?;
        // SAFETY: cap >= n * vocab == logits.len().
        unsafe { write_buffer(out, &logits, len) };
        Ok(())
    }

    /// # Safety
    /// Pointer arguments as documented on `tl_session_logprobs`.
    pub(crate) unsafe fn logprobs(
        s: &mut Session,
        tokens: *const i32,
        n_tokens: usize,
        loops: i32,
        out: *mut f32,
        cap: usize,
        len: *mut usize,
    ) -> FfiResult {
        // SAFETY: forwarded contract.
        let tokens = unsafe { prompt_arg(tokens, n_tokens) }?;
        let loops = loops_arg(loops)?;
        if tokens.len() < 2 {
            return Err(Failure::invalid("logprobs needs at least 2 tokens"));
        }
        // SAFETY: forwarded contract.
        unsafe { check_buffer(out, cap, len, tokens.len() - 1) }?;
        let lp = s.logprobs(&tokens, loops)?;
        // SAFETY: cap >= n - 1 == lp.len().
        unsafe { write_buffer(out, &lp, len) };
        Ok(())
    }
}

/// Free a session. A call running on it from another thread is cancelled and awaited first.
/// NULL is accepted. If called from inside a stream callback of a call on the same session,
/// nothing is freed and the last error is set.
///
/// Ownership: takes back the handle from `tl_session_new`; the pointer is invalid afterwards
/// (freeing it twice is a double free). When this was the last user of a closed model's
/// weights, they are released. Threads: any thread, but no other thread may start a call on
/// the session during or after this call.
///
/// # Safety
/// `session` must be NULL or a handle from `tl_session_new` not yet freed.
#[no_mangle]
pub unsafe extern "C" fn tl_session_free(session: *mut tl_session) {
    boundary_void("tl_session_free", || {
        if session.is_null() {
            return Ok(());
        }
        {
            // SAFETY: live by the caller's contract.
            let handle = unsafe { &*session };
            drop(enter_cancelling(
                &handle.session,
                &handle.cancel,
                "the session",
            )?);
        }
        // SAFETY: from Box::into_raw in new_handle; no other thread uses it (contract).
        drop(unsafe { Box::from_raw(session) });
        Ok(())
    })
}

/// Request cancellation of the call running on `session`; it stops at the next token and
/// returns `TL_ERR_CANCELLED`. Calls that start later are not affected; score calls are not
/// interruptible. TL_OK when nothing is running.
///
/// Ownership: none. Threads: any thread, any time while the handle is live (including the
/// session's own stream callback).
///
/// # Safety
/// `session` must be NULL or a live handle from `tl_session_new`.
#[no_mangle]
pub unsafe extern "C" fn tl_session_cancel(session: *const tl_session) -> tl_status {
    boundary("tl_session_cancel", || {
        // SAFETY: NULL or live by the caller's contract.
        let handle =
            unsafe { session.as_ref() }.ok_or_else(|| Failure::invalid("session is NULL"))?;
        handle.cancel.cancel();
        Ok(())
    })
}

/// `tl_generate` on a session: up to `params->max_tokens` new tokens after the prompt into
/// `out[0..*len]` (`cap` >= max_tokens, else `TL_ERR_BUFFER_TOO_SMALL` with `*len =
/// max_tokens`). `TL_ERR_BUSY` when another call on this session is running.
///
/// Ownership: the caller owns all buffers. Threads: any thread; one call at a time per session.
///
/// # Safety
/// `session` NULL or live; other pointers as `tl_generate`.
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
    boundary("tl_session_generate", || {
        // SAFETY: caller's contract, forwarded.
        unsafe {
            with_session(session, |s| {
                ops::generate(s, tokens, n_tokens, params, out, cap, len)
            })
        }
    })
}

/// `tl_generate_stream` on a session: `callback(token, user_data)` per new token on the calling
/// thread; false stops early (TL_OK). The callback may call `tl_session_cancel`; any other call
/// on this session from inside it returns `TL_ERR_BUSY`.
///
/// Ownership: `user_data` is passed through. Threads: any thread; one call at a time per
/// session.
///
/// # Safety
/// `session` NULL or live; other arguments as `tl_generate_stream`.
#[no_mangle]
pub unsafe extern "C" fn tl_session_generate_stream(
    session: *const tl_session,
    tokens: *const i32,
    n_tokens: usize,
    params: *const tl_generate_params,
    callback: tl_token_callback,
    user_data: *mut c_void,
) -> tl_status {
    boundary("tl_session_generate_stream", || {
        // SAFETY: caller's contract, forwarded.
        unsafe {
            with_session(session, |s| {
                ops::generate_stream(s, tokens, n_tokens, params, callback, user_data)
            })
        }
    })
}

/// `tl_score_last` on a session: logits `[vocab_size]` at the last position into
/// `out[0..*len]`.
///
/// Ownership: the caller owns all buffers. Threads: any thread; one call at a time per session.
///
/// # Safety
/// `session` NULL or live; other pointers as `tl_score_last`.
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
    boundary("tl_session_score_last", || {
        // SAFETY: caller's contract, forwarded.
        unsafe {
            with_session(session, |s| {
                ops::score_last(s, tokens, n_tokens, loops, out, cap, len)
            })
        }
    })
}

/// Logits `[n_tokens, vocab_size]` (row-major) for every position, into `out[0..*len]`; `cap`
/// must be >= n_tokens * vocab_size, else `TL_ERR_BUFFER_TOO_SMALL` with that number in `*len`.
///
/// Ownership: the caller owns all buffers. Threads: any thread; one call at a time per session.
///
/// # Safety
/// `session` NULL or live; `tokens` valid for `n_tokens` reads; `out` for `cap` writes; `len`
/// for one write.
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
    boundary("tl_session_score", || {
        // SAFETY: caller's contract, forwarded.
        unsafe {
            with_session(session, |s| {
                ops::score(s, tokens, n_tokens, loops, out, cap, len)
            })
        }
    })
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
    boundary("tl_session_logprobs", || {
        // SAFETY: caller's contract, forwarded.
        unsafe {
            with_session(session, |s| {
                ops::logprobs(s, tokens, n_tokens, loops, out, cap, len)
            })
        }
    })
}
