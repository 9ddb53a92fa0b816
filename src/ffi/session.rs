//! `tl_session`: one sequence's buffers and KV cache over a shared model, and the operations
//! shared by sessions and the model's default session.

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use super::handles::{Kind, Lookup, Table};
use super::params::tl_generate_params;
use super::{
    boundary, boundary_void, enter_cancelling, held_by_this_thread, tl_status, try_enter, Failure,
    FfiResult,
};
use crate::{CancelHandle, Session};

/// Called for each generated token with the `user_data` given to the call; return true to
/// continue, false to stop generation (the call then returns TL_OK).
pub type tl_token_callback =
    Option<unsafe extern "C" fn(token: i32, user_data: *mut c_void) -> bool>;

/// A session: runtime buffers and KV cache of one sequence over a model's shared weights.
/// Opaque; created by `tl_session_new`, freed by `tl_session_free`. Like `tl_model`, a handle
/// is a value the library looks up, not an address.
pub struct tl_session {
    _opaque: [u8; 0],
}

/// The live sessions behind `tl_session` handles.
static SESSIONS: Table<SessionSlot, tl_session> = Table::new(Kind::Session);

/// A session behind a C handle (a `tl_session`, or a model's default session). Calls are
/// serialized by a mutex taken without waiting; the cancel handle works without it; once
/// [`SessionSlot::release`] has started, every call is answered `TL_ERR_CLOSED` at once.
pub(crate) struct SessionSlot {
    /// `None` once released. Held for the whole of a generate / score call.
    session: Mutex<Option<Session>>,
    cancel: CancelHandle,
    released: AtomicBool,
    /// The handle kind whose calls run here (for messages).
    kind: Kind,
}

impl SessionSlot {
    pub fn new(session: Session, kind: Kind) -> SessionSlot {
        SessionSlot {
            cancel: session.cancel_handle(),
            session: Mutex::new(Some(session)),
            released: AtomicBool::new(false),
            kind,
        }
    }

    pub fn is_released(&self) -> bool {
        self.released.load(Ordering::Acquire)
    }

    fn what(&self) -> &'static str {
        match self.kind {
            Kind::Model => "the model's default session",
            Kind::Session => "the session",
        }
    }

    /// Run `f` (the body of `func`) on the session: `TL_ERR_BUSY` when another call is running
    /// on it, `TL_ERR_CLOSED` once release has started.
    pub fn run<R>(&self, func: &str, f: impl FnOnce(&mut Session) -> FfiResult<R>) -> FfiResult<R> {
        let closed = || self.kind.closed(func);
        if self.is_released() {
            return Err(closed());
        }
        let mut held = try_enter(&self.session, self.what()).map_err(|busy| {
            if self.is_released() {
                closed()
            } else {
                busy
            }
        })?;
        // Checked again under the mutex: release may have started while this call took it, and
        // no call may start once release has cancelled the running one.
        if self.is_released() {
            return Err(closed());
        }
        f(held.as_mut().ok_or_else(closed)?)
    }

    /// Request cancellation of the running call (a no-op when none is running).
    pub fn cancel(&self) {
        self.cancel.cancel();
    }

    /// Stop new calls, cancel and await the running one, and drop the session. Idempotent.
    /// `TL_ERR_BUSY`, with nothing done, from inside a callback of a call on this session.
    pub fn release(&self) -> FfiResult {
        if held_by_this_thread(&self.session) {
            return Err(Failure::new(
                tl_status::TL_ERR_BUSY,
                format!(
                    "{} cannot be closed from inside a callback of a call on it",
                    self.what()
                ),
            ));
        }
        self.released.store(true, Ordering::Release);
        *enter_cancelling(&self.session, &self.cancel) = None;
        Ok(())
    }
}

/// Register a new session and return its handle.
pub(crate) fn new_handle(session: Session) -> FfiResult<*mut tl_session> {
    SESSIONS.insert(SessionSlot::new(session, Kind::Session))
}

/// Run `f`, the body of `func`, on the session behind a handle.
fn with_session<R>(
    session: *const tl_session,
    func: &str,
    f: impl FnOnce(&mut Session) -> FfiResult<R>,
) -> FfiResult<R> {
    SESSIONS.get(session, func)?.run(func, f)
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

/// Free a session: new calls on it get `TL_ERR_CLOSED` at once, a call running on it from
/// another thread is cancelled and awaited, and its buffers and KV cache are released. When this
/// was the last user of a closed model's weights, they are released too. NULL and a session
/// that was already freed are accepted (no-op), so freeing twice is harmless. If called from
/// inside a stream callback of a call on the same session, nothing is freed and the last error
/// is set (`TL_ERR_BUSY`); a value that is not a session handle only sets the last error.
///
/// Ownership: takes back the handle from `tl_session_new`; afterwards every call on it returns
/// `TL_ERR_CLOSED` (handle values are never reused). Threads: any thread, also while another
/// thread is in a call on this session.
#[no_mangle]
pub extern "C" fn tl_session_free(session: *mut tl_session) {
    boundary_void("tl_session_free", || match SESSIONS.lookup(session) {
        Lookup::Null | Lookup::Closed => Ok(()),
        Lookup::Invalid(failure) => Err(failure),
        Lookup::Live(slot) => {
            slot.release()?;
            SESSIONS.remove(session);
            Ok(())
        }
    })
}

/// Request cancellation of the call running on `session`; it stops at the next token and
/// returns `TL_ERR_CANCELLED`. Calls that start later are not affected; score calls are not
/// interruptible. TL_OK when nothing is running or the session was freed.
///
/// Ownership: none. Threads: any thread, any time (including the session's own stream
/// callback).
#[no_mangle]
pub extern "C" fn tl_session_cancel(session: *const tl_session) -> tl_status {
    boundary("tl_session_cancel", || match SESSIONS.lookup(session) {
        Lookup::Null => Err(Failure::invalid("session is NULL")),
        Lookup::Invalid(failure) => Err(failure),
        Lookup::Closed => Ok(()),
        Lookup::Live(slot) => {
            slot.cancel();
            Ok(())
        }
    })
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
    boundary("tl_session_generate", || {
        with_session(session, "tl_session_generate", |s| {
            // SAFETY: caller's contract, forwarded.
            unsafe { ops::generate(s, tokens, n_tokens, params, out, cap, len) }
        })
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
    boundary("tl_session_generate_stream", || {
        with_session(session, "tl_session_generate_stream", |s| {
            // SAFETY: caller's contract, forwarded.
            unsafe { ops::generate_stream(s, tokens, n_tokens, params, callback, user_data) }
        })
    })
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
    boundary("tl_session_score_last", || {
        with_session(session, "tl_session_score_last", |s| {
            // SAFETY: caller's contract, forwarded.
            unsafe { ops::score_last(s, tokens, n_tokens, loops, out, cap, len) }
        })
    })
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
    boundary("tl_session_score", || {
        with_session(session, "tl_session_score", |s| {
            // SAFETY: caller's contract, forwarded.
            unsafe { ops::score(s, tokens, n_tokens, loops, out, cap, len) }
        })
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
        with_session(session, "tl_session_logprobs", |s| {
            // SAFETY: caller's contract, forwarded.
            unsafe { ops::logprobs(s, tokens, n_tokens, loops, out, cap, len) }
        })
    })
}
