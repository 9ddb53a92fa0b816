//! The C ABI (docs/ABI.md). cbindgen turns this module into `include/tinyloop.h`.
//!
//! Conventions (after rustls-ffi and llama.h):
//! * every fallible function returns [`tl_status`]; the message of the last failure on the
//!   calling thread is available from [`tl_last_error_message`];
//! * outputs go through out-parameters and are written only on success; the one exception is a
//!   buffer that is too small, where the required length is written to `*len`;
//! * parameter structs carry `struct_size` and are filled by `tl_*_default_params`;
//! * every export runs inside a panic boundary ([`boundary`]); no unwinding crosses into C;
//! * NULL is checked everywhere; free / close functions accept NULL and are idempotent.
//!
//! Handles: a `tl_model` is a [`crate::Model`] plus its default [`crate::Session`]; a
//! `tl_session` is a further session over the same weights; a `tl_prefix_cache` or
//! `tl_resume_handle` is bound to the model handle it was built on. Handle values are ids
//! resolved through a table of live objects (`handles.rs`), so a closed or freed handle is
//! answered `TL_ERR_CLOSED` without touching freed memory. Each session sits in a `SessionSlot`
//! whose mutex is taken by `try_lock`, so a second concurrent call gets `TL_ERR_BUSY` at once.
//! Every operation on a session is written once, over a `Target` (`target.rs`) that its
//! `tl_*` entry point makes from a model handle and its `tl_session_*` entry point from a
//! session handle.

#![allow(non_camel_case_types)]
#![deny(unsafe_op_in_unsafe_fn)]

use std::cell::RefCell;
use std::ffi::{c_char, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Mutex, MutexGuard, TryLockError};

use crate::error::Error;

/// Version of the C ABI described by this header. A binding must check at load time that
/// `tl_abi_version()` equals the `TL_ABI_VERSION` it was built against.
pub const TL_ABI_VERSION: u32 = 1;

/// Value of a `loops` argument or field that selects the model's `default_loops`.
pub const TL_LOOPS_DEFAULT: i32 = -1;

/// The largest `tl_speculative_params.draft_len`.
pub const TL_MAX_DRAFT_LEN: u32 = 15;
const _: () = assert!(TL_MAX_DRAFT_LEN as usize == crate::MAX_DRAFT_LEN);

/// Result of every fallible function. `TL_OK` is 0; every other value is a failure whose
/// message `tl_last_error_message()` returns on the same thread.
///
/// Each `tinyloop::Error` variant maps to exactly one code (`Io` and `Write` both to
/// `TL_ERR_IO`); `TL_ERR_BUFFER_TOO_SMALL` and `TL_ERR_PANIC` exist only at the C boundary.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum tl_status {
    /// Success.
    TL_OK = 0,
    /// A NULL pointer, a value out of range, a malformed string, or a call that is not valid
    /// for this model (token >= vocab_size, loops out of range, prompt too long, ...).
    TL_ERR_INVALID_ARGUMENT = 1,
    /// A file could not be opened, read or written.
    TL_ERR_IO = 2,
    /// A model file is malformed; the message names the failure point.
    TL_ERR_FORMAT = 3,
    /// An allocation failed; the message names the requested size.
    TL_ERR_OUT_OF_MEMORY = 4,
    /// The compute device failed or is unusable (e.g. "cuda" without a GPU).
    TL_ERR_DEVICE = 5,
    /// The model handle was closed with `tl_close`; the message names the function called.
    TL_ERR_CLOSED = 6,
    /// Another call is running on the same session (or model handle); nothing was done.
    TL_ERR_BUSY = 7,
    /// The call was stopped by `tl_cancel` / `tl_session_cancel`; no output was written.
    TL_ERR_CANCELLED = 8,
    /// A bug: the library panicked. The message holds the panic text. The handle stays usable.
    TL_ERR_PANIC = 9,
    /// An output buffer's capacity is below what the call needs; the required number of
    /// elements was written to `*len` and nothing else was done.
    TL_ERR_BUFFER_TOO_SMALL = 10,
}

/// The status for a library error: one code per variant, and no wildcard, so a new variant
/// cannot compile without a mapping.
pub(crate) fn status_of(error: &Error) -> tl_status {
    match error {
        Error::InvalidArgument(_) => tl_status::TL_ERR_INVALID_ARGUMENT,
        Error::Io { .. } | Error::Write { .. } => tl_status::TL_ERR_IO,
        Error::Format(_) => tl_status::TL_ERR_FORMAT,
        Error::OutOfMemory { .. } => tl_status::TL_ERR_OUT_OF_MEMORY,
        Error::Device(_) => tl_status::TL_ERR_DEVICE,
        Error::Closed(_) => tl_status::TL_ERR_CLOSED,
        Error::Busy => tl_status::TL_ERR_BUSY,
        Error::Cancelled => tl_status::TL_ERR_CANCELLED,
    }
}

/// C callers share handles between threads, so the objects behind them must be `Send + Sync`;
/// this fails to compile if a backend's session state ever stops being `Send`.
#[allow(dead_code)]
fn assert_handles_are_thread_safe() {
    fn check<T: Send + Sync>() {}
    check::<model::OpenModel>();
    check::<session::SessionSlot>();
    check::<bound::Held<crate::PrefixCache>>();
    check::<bound::Held<crate::ResumeHandle>>();
}

/// A failure on its way to C: a status and a message (the function name is added later).
#[derive(Debug)]
pub(crate) struct Failure {
    pub status: tl_status,
    pub message: String,
}

impl Failure {
    pub fn new(status: tl_status, message: impl Into<String>) -> Failure {
        Failure {
            status,
            message: message.into(),
        }
    }

    pub fn invalid(message: impl Into<String>) -> Failure {
        Failure::new(tl_status::TL_ERR_INVALID_ARGUMENT, message)
    }
}

impl From<Error> for Failure {
    fn from(error: Error) -> Failure {
        Failure::new(status_of(&error), error.to_string())
    }
}

pub(crate) type FfiResult<T = ()> = Result<T, Failure>;

thread_local! {
    /// Message of the last failure on this thread.
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
    /// Addresses of the session mutexes this thread holds inside a call (to detect re-entry from
    /// a stream callback, which would otherwise deadlock in `tl_close`).
    static HELD: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}

fn set_last_error(func: &str, message: &str) {
    // Already prefixed when the message starts with "func:" or "func " (not with a longer name
    // such as "tl_generate_params" for func "tl_generate").
    let prefixed = message
        .strip_prefix(func)
        .is_some_and(|rest| rest.starts_with([':', ' ']));
    let text = if prefixed {
        message.to_string()
    } else {
        format!("{func}: {message}")
    };
    let c = CString::new(text.replace('\0', " ")).unwrap_or_default();
    // A thread being torn down has no storage left; the message is then dropped.
    let _ = LAST_ERROR.try_with(|slot| {
        if let Ok(mut slot) = slot.try_borrow_mut() {
            *slot = c;
        }
    });
}

fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic payload".to_string()
    }
}

/// Run the body of an exported function: catch panics, turn failures into a status, and record
/// the message for `tl_last_error_message`.
pub(crate) fn boundary(func: &'static str, body: impl FnOnce() -> FfiResult) -> tl_status {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => tl_status::TL_OK,
        Ok(Err(failure)) => {
            set_last_error(func, &failure.message);
            failure.status
        }
        Err(payload) => {
            set_last_error(func, &format!("panic: {}", panic_text(payload.as_ref())));
            tl_status::TL_ERR_PANIC
        }
    }
}

/// Like [`boundary`] for functions that return nothing (free functions): failures and panics
/// only set the last error message.
pub(crate) fn boundary_void(func: &'static str, body: impl FnOnce() -> FfiResult) {
    let _ = boundary(func, body);
}

/// A session mutex held by the current call; remembers that this thread holds it.
pub(crate) struct Held<'a, T> {
    guard: MutexGuard<'a, T>,
    key: usize,
}

impl<T> std::ops::Deref for Held<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.guard
    }
}

impl<T> std::ops::DerefMut for Held<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.guard
    }
}

impl<T> Drop for Held<'_, T> {
    fn drop(&mut self) {
        let key = self.key;
        let _ = HELD.try_with(|held| {
            let mut held = held.borrow_mut();
            if let Some(i) = held.iter().rposition(|&k| k == key) {
                held.remove(i);
            }
        });
    }
}

fn key_of<T>(mutex: &Mutex<T>) -> usize {
    mutex as *const Mutex<T> as usize
}

/// Whether the calling thread is inside a call that holds `mutex` (i.e. we are in a callback).
pub(crate) fn held_by_this_thread<T>(mutex: &Mutex<T>) -> bool {
    let key = key_of(mutex);
    HELD.try_with(|held| held.borrow().contains(&key))
        .unwrap_or(false)
}

fn mark_held<'a, T>(mutex: &'a Mutex<T>, guard: MutexGuard<'a, T>) -> Held<'a, T> {
    let key = key_of(mutex);
    let _ = HELD.try_with(|held| held.borrow_mut().push(key));
    Held { guard, key }
}

/// Take a session mutex without waiting: `TL_ERR_BUSY` when another call holds it. A mutex
/// poisoned by a caught panic is recovered: every call starts its sequence from scratch.
pub(crate) fn try_enter<'a, T>(mutex: &'a Mutex<T>, what: &str) -> FfiResult<Held<'a, T>> {
    let guard = match mutex.try_lock() {
        Ok(guard) => guard,
        Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
        Err(TryLockError::WouldBlock) => {
            return Err(Failure::new(
                tl_status::TL_ERR_BUSY,
                format!(
                    "{what} is busy: another call is running on it (use one session per \
                     thread: tl_session_new)"
                ),
            ))
        }
    };
    Ok(mark_held(mutex, guard))
}

/// Take a session mutex, cancelling the call that holds it and waiting for it to return. The
/// caller checks first that this thread does not hold it ([`held_by_this_thread`]).
pub(crate) fn enter_cancelling<'a, T>(
    mutex: &'a Mutex<T>,
    cancel: &crate::CancelHandle,
) -> Held<'a, T> {
    loop {
        // Cancel on every attempt: a call that was just starting resets the flag.
        cancel.cancel();
        match mutex.try_lock() {
            Ok(guard) => return mark_held(mutex, guard),
            Err(TryLockError::Poisoned(poisoned)) => {
                return mark_held(mutex, poisoned.into_inner())
            }
            Err(TryLockError::WouldBlock) => {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
    }
}

/// A C string argument as UTF-8; `what` names it in errors.
///
/// # Safety
/// `ptr` must be NULL or point to a NUL-terminated string.
pub(crate) unsafe fn c_str<'a>(ptr: *const c_char, what: &str) -> FfiResult<&'a str> {
    if ptr.is_null() {
        return Err(Failure::invalid(format!("{what} is NULL")));
    }
    // SAFETY: non-NULL and NUL-terminated by the caller's contract.
    let s = unsafe { CStr::from_ptr(ptr) };
    s.to_str()
        .map_err(|_| Failure::invalid(format!("{what} is not valid UTF-8")))
}

/// Write `value` to the out-parameter `out` (checked non-NULL before any work is done).
///
/// # Safety
/// `out` must be NULL or valid for a write of `T`.
pub(crate) unsafe fn write_out<T>(out: *mut T, value: T) {
    if !out.is_null() {
        // SAFETY: non-NULL and writable by the caller's contract.
        unsafe { out.write(value) };
    }
}

/// Fail when a required pointer argument is NULL.
pub(crate) fn non_null<T>(ptr: *const T, what: &str) -> FfiResult {
    if ptr.is_null() {
        Err(Failure::invalid(format!("{what} is NULL")))
    } else {
        Ok(())
    }
}

/// Version of the C ABI implemented by the loaded library; compare with `TL_ABI_VERSION`.
///
/// Ownership: none. Threads: any thread, any time.
#[no_mangle]
pub extern "C" fn tl_abi_version() -> u32 {
    TL_ABI_VERSION
}

/// The name of a status code, e.g. "TL_ERR_BUSY"; "TL_UNKNOWN_STATUS" for a value that is not a
/// `tl_status`.
///
/// Ownership: the string has static storage; never free it. Threads: any thread, any time.
#[no_mangle]
pub extern "C" fn tl_status_string(status: i32) -> *const c_char {
    let name: &'static CStr = match status {
        0 => c"TL_OK",
        1 => c"TL_ERR_INVALID_ARGUMENT",
        2 => c"TL_ERR_IO",
        3 => c"TL_ERR_FORMAT",
        4 => c"TL_ERR_OUT_OF_MEMORY",
        5 => c"TL_ERR_DEVICE",
        6 => c"TL_ERR_CLOSED",
        7 => c"TL_ERR_BUSY",
        8 => c"TL_ERR_CANCELLED",
        9 => c"TL_ERR_PANIC",
        10 => c"TL_ERR_BUFFER_TOO_SMALL",
        _ => c"TL_UNKNOWN_STATUS",
    };
    name.as_ptr()
}

/// The message of the last failed call on the calling thread ("" when none has failed yet).
/// Successful calls leave it unchanged.
///
/// Ownership: the string belongs to the library and stays valid until the next failing `tl_*`
/// call on the same thread; copy it to keep it. Never NULL. Threads: any thread; each thread
/// sees only its own failures.
#[no_mangle]
pub extern "C" fn tl_last_error_message() -> *const c_char {
    static EMPTY: &CStr = c"";
    catch_unwind(|| {
        LAST_ERROR
            .try_with(|slot| match slot.try_borrow() {
                // The CString's heap buffer does not move until the slot is overwritten.
                Ok(s) => s.as_ptr(),
                Err(_) => EMPTY.as_ptr(),
            })
            .unwrap_or(EMPTY.as_ptr())
    })
    .unwrap_or(EMPTY.as_ptr())
}

// Declared last so that the header lists the basics above before the handle functions.
mod handles;
mod params;
pub use params::*;
mod model;
pub use model::*;
mod session;
pub use session::*;
mod calls;
mod target;
pub use calls::*;
mod bound;
pub use bound::*;
mod looped;
pub use looped::*;
mod ctx_tier;
pub use ctx_tier::*;
mod text;
pub use text::*;
mod engine;
pub use engine::*;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_variant_has_its_own_status() {
        let io = || std::io::Error::other("x");
        let cases = [
            (
                Error::InvalidArgument("x".into()),
                tl_status::TL_ERR_INVALID_ARGUMENT,
            ),
            (
                Error::Io {
                    path: "p".into(),
                    source: io(),
                },
                tl_status::TL_ERR_IO,
            ),
            (
                Error::Write {
                    path: "p".into(),
                    source: io(),
                },
                tl_status::TL_ERR_IO,
            ),
            (Error::Format("x".into()), tl_status::TL_ERR_FORMAT),
            (
                Error::OutOfMemory {
                    bytes: 1,
                    what: "x".into(),
                },
                tl_status::TL_ERR_OUT_OF_MEMORY,
            ),
            (Error::Device("x".into()), tl_status::TL_ERR_DEVICE),
            (Error::Closed("f".into()), tl_status::TL_ERR_CLOSED),
            (Error::Busy, tl_status::TL_ERR_BUSY),
            (Error::Cancelled, tl_status::TL_ERR_CANCELLED),
        ];
        for (error, status) in cases {
            assert_eq!(status_of(&error), status, "{error}");
        }
    }

    fn message() -> String {
        // SAFETY: never NULL, NUL-terminated.
        unsafe { CStr::from_ptr(tl_last_error_message()) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn panics_become_tl_err_panic_with_the_message() {
        let status = boundary("tl_test", || panic!("boom {}", 42));
        assert_eq!(status, tl_status::TL_ERR_PANIC);
        assert_eq!(message(), "tl_test: panic: boom 42");
    }

    #[test]
    fn failures_are_prefixed_with_the_function_once() {
        let status = boundary("tl_f", || Err(Failure::invalid("bad \0 thing")));
        assert_eq!(status, tl_status::TL_ERR_INVALID_ARGUMENT);
        assert_eq!(message(), "tl_f: bad   thing");
        let status = boundary("tl_f", || Err(handles::Kind::Model.closed("tl_f")));
        assert_eq!(status, tl_status::TL_ERR_CLOSED);
        assert_eq!(
            message(),
            "tl_f called on a closed model; construct a new one"
        );
        assert_eq!(boundary("tl_f", || Ok(())), tl_status::TL_OK);
        assert!(
            message().starts_with("tl_f called"),
            "success keeps the message"
        );
        // A message naming a longer identifier that merely starts with the function's name.
        boundary("tl_f", || {
            Err(Failure::invalid("tl_f_params.struct_size is 0"))
        });
        assert_eq!(message(), "tl_f: tl_f_params.struct_size is 0");
    }

    #[test]
    fn a_poisoned_session_mutex_is_recovered() {
        let m = Mutex::new(1);
        let _ = catch_unwind(AssertUnwindSafe(|| {
            let _g = m.lock().unwrap();
            panic!("poison");
        }));
        assert!(m.is_poisoned());
        let held = try_enter(&m, "x").map_err(|f| f.message).unwrap();
        assert_eq!(*held, 1);
        assert!(held_by_this_thread(&m));
        drop(held);
        assert!(!held_by_this_thread(&m));
    }
}
