//! `tl_session`: one sequence's buffers and KV cache over a shared model, and the slot that
//! serializes the calls on a session (a `tl_session`, or a model's default session).

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use super::handles::{Kind, Lookup, Table};
use super::model::OpenModel;
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
    /// The model handle the session was made from: the prefix caches and resume handles built
    /// on the session are bound to it.
    owner: Weak<OpenModel>,
}

impl SessionSlot {
    pub fn new(session: Session, kind: Kind, owner: Weak<OpenModel>) -> SessionSlot {
        SessionSlot {
            cancel: session.cancel_handle(),
            session: Mutex::new(Some(session)),
            released: AtomicBool::new(false),
            kind,
            owner,
        }
    }

    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// The model handle the session was made from, unless it is closed.
    pub fn owner(&self) -> Option<Arc<OpenModel>> {
        self.owner.upgrade()
    }

    pub fn is_released(&self) -> bool {
        self.released.load(Ordering::Acquire)
    }

    fn what(&self) -> &'static str {
        if self.kind == Kind::Model {
            "the model's default session"
        } else {
            "the session"
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

/// Register a new session made from the model handle `owner` and return its handle.
pub(crate) fn new_handle(session: Session, owner: Weak<OpenModel>) -> FfiResult<*mut tl_session> {
    SESSIONS.insert(SessionSlot::new(session, Kind::Session, owner))
}

/// The session behind a handle that `func` was called on.
pub(super) fn session(session: *const tl_session, func: &str) -> FfiResult<Arc<SessionSlot>> {
    SESSIONS.get(session, func)
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

/// Request cancellation of the call running on `session`; it stops as described at
/// `tl_cancel` and returns `TL_ERR_CANCELLED`. Calls that start later are not affected. TL_OK
/// when nothing is running or the session was freed.
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
