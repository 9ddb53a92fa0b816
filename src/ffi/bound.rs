//! Handles bound to a model handle: prefix caches and resume handles.
//!
//! Each is built on a session (the model handle's default one, or a `tl_session`) and belongs
//! to the model handle that session was made from. It lives until `tl_*_free`, or until its
//! model handle is closed: `tl_close` retires it with the model, since it is of no use without
//! it and its memory counts as the model's. Either way its handle stays retired for good
//! (`TL_ERR_CLOSED`; the free functions are then no-ops). A call using it holds it alive, so a
//! free or close in another thread never pulls it from under a running call.

use std::ops::Deref;
use std::sync::{Arc, Weak};

use super::handles::{Kind, Lookup, Table};
use super::model::OpenModel;
use super::params::{loops_arg, prompt_arg};
use super::session::SessionSlot;
use super::target::Target;
use super::{
    boundary, boundary_void, non_null, tl_model, tl_session, tl_status, write_out, Failure,
    FfiResult,
};
use crate::{PrefixCache, ResumeHandle};

/// The KV entries of a prefix at one loop count, for generation after it on any session of its
/// model (`tl_generate_params.prefix_cache`). Opaque; created by `tl_prefix_cache_new`, freed
/// by `tl_prefix_cache_free` or with its model by `tl_close`. A handle is a value the library
/// looks up, not an address.
pub struct tl_prefix_cache {
    _opaque: [u8; 0],
}

/// A prompt run at one loop count, for `tl_resume_generate` at any loop count on any session
/// of its model. Opaque; created by `tl_resume_handle_new`, freed by `tl_resume_handle_free` or
/// with its model by `tl_close`. A handle is a value the library looks up, not an address.
pub struct tl_resume_handle {
    _opaque: [u8; 0],
}

static PREFIX_CACHES: Table<Held<PrefixCache>, tl_prefix_cache> = Table::new(Kind::PrefixCache);
static RESUME_HANDLES: Table<Held<ResumeHandle>, tl_resume_handle> = Table::new(Kind::ResumeHandle);

/// A handle bound to a model handle, as the model keeps track of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Bound {
    PrefixCache(usize),
    ResumeHandle(usize),
}

impl Bound {
    /// Remove the handle from its table: later lookups say closed.
    pub fn retire(self) {
        match self {
            Bound::PrefixCache(value) => PREFIX_CACHES.remove(std::ptr::without_provenance(value)),
            Bound::ResumeHandle(value) => {
                RESUME_HANDLES.remove(std::ptr::without_provenance(value))
            }
        }
    }
}

/// An object behind a bound handle, and the model handle it is bound to.
pub(crate) struct Held<T> {
    value: T,
    owner: Weak<OpenModel>,
}

impl<T> Deref for Held<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.value
    }
}

/// Register `value`, built on `slot`, in `table` and bind it to the slot's model handle;
/// `TL_ERR_CLOSED` (and `value` dropped) when that model handle was closed meanwhile.
fn register<T, C>(
    table: &'static Table<Held<T>, C>,
    bound: fn(usize) -> Bound,
    slot: &SessionSlot,
    func: &str,
    value: T,
) -> FfiResult<*mut C> {
    let closed = || match slot.kind() {
        Kind::Model => Kind::Model.closed(func),
        _ => Failure::new(
            tl_status::TL_ERR_CLOSED,
            "the session's model handle was closed; prefix caches and resume handles live only \
             as long as their model handle",
        ),
    };
    let owner = slot.owner().ok_or_else(closed)?;
    let handle = table.insert(Held {
        value,
        owner: Arc::downgrade(&owner),
    })?;
    if !owner.bind(bound(handle.addr())) {
        table.remove(handle);
        return Err(closed());
    }
    Ok(handle)
}

/// `tl_prefix_cache_free` and `tl_resume_handle_free`.
fn free<T, C>(table: &Table<Held<T>, C>, bound: fn(usize) -> Bound, handle: *const C) -> FfiResult {
    match table.lookup(handle) {
        Lookup::Null | Lookup::Closed => Ok(()),
        Lookup::Invalid(failure) => Err(failure),
        Lookup::Live(held) => {
            table.remove(handle);
            if let Some(owner) = held.owner.upgrade() {
                owner.unbind(bound(handle.addr()));
            }
            Ok(())
        }
    }
}

/// The prefix cache named by `tl_generate_params.prefix_cache` of a call to `func` (NULL: none).
pub(crate) fn prefix_cache_arg(
    cache: *const tl_prefix_cache,
    func: &str,
) -> FfiResult<Option<Arc<Held<PrefixCache>>>> {
    if cache.is_null() {
        return Ok(None);
    }
    PREFIX_CACHES.get(cache, func).map(Some)
}

/// The resume handle argument of a call to `func`.
pub(crate) fn resume_handle_arg(
    handle: *const tl_resume_handle,
    func: &str,
) -> FfiResult<Arc<Held<ResumeHandle>>> {
    RESUME_HANDLES.get(handle, func)
}

/// Build a prefix cache: run `tokens[0..n_tokens]` at `loops` (TL_LOOPS_DEFAULT = model
/// default) on the model's default session and keep its KV entries. On success `*out_cache`
/// receives the handle. Generation with it (`tl_generate_params.prefix_cache`) on any session
/// of this model, at the same loops, gives the same tokens as generating from the prefix
/// followed by the prompt; many sessions may use one cache at once. Its bytes count in
/// `tl_vram_usage_mb` until it is freed.
///
/// Failures: `TL_ERR_INVALID_ARGUMENT` (NULL, empty or bad tokens, loops out of range, a prefix
/// that leaves no room in max_seq_len, KV mode "age", whose entries move between tiers),
/// `TL_ERR_BUSY`, `TL_ERR_CANCELLED` (`tl_cancel`), `TL_ERR_CLOSED`, `TL_ERR_OUT_OF_MEMORY`.
///
/// Ownership: the caller owns the new handle and frees it with `tl_prefix_cache_free`;
/// `tl_close` of the model also releases it (the handle is then retired). Threads: any thread;
/// one call at a time per model.
///
/// # Safety
/// `tokens` valid for `n_tokens` reads; `out_cache` NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn tl_prefix_cache_new(
    model: *const tl_model,
    tokens: *const i32,
    n_tokens: usize,
    loops: i32,
    out_cache: *mut *mut tl_prefix_cache,
) -> tl_status {
    let target = Target::Model(model);
    let func = "tl_prefix_cache_new";
    // SAFETY: the caller's contract, forwarded.
    unsafe { prefix_cache_new(target, func, tokens, n_tokens, loops, out_cache) }
}

/// `tl_prefix_cache_new` on a session: the cache is built with this session's buffers and
/// belongs to the model handle the session was made from (`TL_ERR_CLOSED` once that is closed).
///
/// Ownership: as `tl_prefix_cache_new`. Threads: any thread; one call at a time per session.
///
/// # Safety
/// As `tl_prefix_cache_new`.
#[no_mangle]
pub unsafe extern "C" fn tl_session_prefix_cache_new(
    session: *const tl_session,
    tokens: *const i32,
    n_tokens: usize,
    loops: i32,
    out_cache: *mut *mut tl_prefix_cache,
) -> tl_status {
    let target = Target::Session(session);
    let func = "tl_session_prefix_cache_new";
    // SAFETY: the caller's contract, forwarded.
    unsafe { prefix_cache_new(target, func, tokens, n_tokens, loops, out_cache) }
}

/// # Safety
/// Pointer arguments as documented on `tl_prefix_cache_new`.
unsafe fn prefix_cache_new(
    target: Target,
    func: &'static str,
    tokens: *const i32,
    n_tokens: usize,
    loops: i32,
    out_cache: *mut *mut tl_prefix_cache,
) -> tl_status {
    boundary(func, || {
        let slot = target.slot(func)?;
        let cache = slot.run(func, |s| {
            non_null(out_cache, "out_cache")?;
            // SAFETY: the caller's contract, forwarded.
            let tokens = unsafe { prompt_arg(tokens, n_tokens) }?;
            Ok(s.build_prefix_cache(&tokens, loops_arg(loops)?)?)
        })?;
        let handle = register(&PREFIX_CACHES, Bound::PrefixCache, &slot, func, cache)?;
        // SAFETY: checked non-NULL; writable by the caller's contract.
        unsafe { write_out(out_cache, handle) };
        Ok(())
    })
}

/// Free a prefix cache: its handle is retired and its memory released once no call uses it
/// (a call running with it in another thread finishes normally). NULL, a freed cache and a
/// cache whose model was closed are accepted (no-op), so freeing twice is harmless; a value
/// that is not a prefix cache handle only sets the last error.
///
/// Ownership: takes back the handle from `tl_prefix_cache_new`; afterwards every use of it is
/// `TL_ERR_CLOSED` (handle values are never reused). Threads: any thread, any time.
#[no_mangle]
pub extern "C" fn tl_prefix_cache_free(cache: *mut tl_prefix_cache) {
    boundary_void("tl_prefix_cache_free", || {
        free(&PREFIX_CACHES, Bound::PrefixCache, cache)
    })
}

/// Device memory held by a prefix cache, in MB (10^6 bytes), written to `*out_mb` (it is part
/// of its model's `tl_vram_usage_mb`).
///
/// Ownership: none. Threads: any thread, concurrently with calls using the cache.
///
/// # Safety
/// `out_mb` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn tl_prefix_cache_memory_mb(
    cache: *const tl_prefix_cache,
    out_mb: *mut f64,
) -> tl_status {
    boundary("tl_prefix_cache_memory_mb", || {
        let cache = PREFIX_CACHES.get(cache, "tl_prefix_cache_memory_mb")?;
        non_null(out_mb, "out_mb")?;
        // SAFETY: non-NULL and writable by the caller's contract.
        unsafe { write_out(out_mb, cache.memory_bytes() as f64 / 1e6) };
        Ok(())
    })
}

/// Build a resume handle: run the prompt `tokens[0..n_tokens]` at `loops` (TL_LOOPS_DEFAULT =
/// model default) on the model's default session and keep what `tl_resume_generate` needs to
/// generate after it at any loop count (the pre blocks' KV entries and the residual streams
/// after every iteration). The prompt runs as one step, so with prefill_chunk > 0 it must fit
/// the chunk. On success `*out_handle` receives the handle; its bytes count in
/// `tl_vram_usage_mb` until it is freed.
///
/// Failures: as `tl_prefix_cache_new`; here the prompt must leave room in max_seq_len for at
/// least one generated token, and fit prefill_chunk when that is set.
///
/// Ownership: the caller owns the new handle and frees it with `tl_resume_handle_free`;
/// `tl_close` of the model also releases it (the handle is then retired). Threads: any thread;
/// one call at a time per model.
///
/// # Safety
/// `tokens` valid for `n_tokens` reads; `out_handle` NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn tl_resume_handle_new(
    model: *const tl_model,
    tokens: *const i32,
    n_tokens: usize,
    loops: i32,
    out_handle: *mut *mut tl_resume_handle,
) -> tl_status {
    let target = Target::Model(model);
    let func = "tl_resume_handle_new";
    // SAFETY: the caller's contract, forwarded.
    unsafe { resume_handle_new(target, func, tokens, n_tokens, loops, out_handle) }
}

/// `tl_resume_handle_new` on a session: the handle is built with this session's buffers and
/// belongs to the model handle the session was made from (`TL_ERR_CLOSED` once that is closed).
///
/// Ownership: as `tl_resume_handle_new`. Threads: any thread; one call at a time per session.
///
/// # Safety
/// As `tl_resume_handle_new`.
#[no_mangle]
pub unsafe extern "C" fn tl_session_resume_handle_new(
    session: *const tl_session,
    tokens: *const i32,
    n_tokens: usize,
    loops: i32,
    out_handle: *mut *mut tl_resume_handle,
) -> tl_status {
    let target = Target::Session(session);
    let func = "tl_session_resume_handle_new";
    // SAFETY: the caller's contract, forwarded.
    unsafe { resume_handle_new(target, func, tokens, n_tokens, loops, out_handle) }
}

/// # Safety
/// Pointer arguments as documented on `tl_resume_handle_new`.
unsafe fn resume_handle_new(
    target: Target,
    func: &'static str,
    tokens: *const i32,
    n_tokens: usize,
    loops: i32,
    out_handle: *mut *mut tl_resume_handle,
) -> tl_status {
    boundary(func, || {
        let slot = target.slot(func)?;
        let handle = slot.run(func, |s| {
            non_null(out_handle, "out_handle")?;
            // SAFETY: the caller's contract, forwarded.
            let tokens = unsafe { prompt_arg(tokens, n_tokens) }?;
            Ok(s.build_resume_handle(&tokens, loops_arg(loops)?)?)
        })?;
        let handle = register(&RESUME_HANDLES, Bound::ResumeHandle, &slot, func, handle)?;
        // SAFETY: checked non-NULL; writable by the caller's contract.
        unsafe { write_out(out_handle, handle) };
        Ok(())
    })
}

/// Free a resume handle; as `tl_prefix_cache_free` (NULL, freed and retired handles: no-op).
///
/// Ownership: takes back the handle from `tl_resume_handle_new`. Threads: any thread, any time.
#[no_mangle]
pub extern "C" fn tl_resume_handle_free(handle: *mut tl_resume_handle) {
    boundary_void("tl_resume_handle_free", || {
        free(&RESUME_HANDLES, Bound::ResumeHandle, handle)
    })
}

/// Device memory held by a resume handle, in MB (10^6 bytes), written to `*out_mb` (it is part
/// of its model's `tl_vram_usage_mb`).
///
/// Ownership: none. Threads: any thread, concurrently with calls using the handle.
///
/// # Safety
/// `out_mb` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn tl_resume_handle_memory_mb(
    handle: *const tl_resume_handle,
    out_mb: *mut f64,
) -> tl_status {
    boundary("tl_resume_handle_memory_mb", || {
        let handle = RESUME_HANDLES.get(handle, "tl_resume_handle_memory_mb")?;
        non_null(out_mb, "out_mb")?;
        // SAFETY: non-NULL and writable by the caller's contract.
        unsafe { write_out(out_mb, handle.memory_bytes() as f64 / 1e6) };
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use std::ffi::CString;

    use super::super::model::{bound_len, tl_close, tl_model_open};
    use super::super::params::{tl_model_default_params, tl_model_params};
    use super::*;
    use crate::model::synth::{preset, random_model};

    fn open_tiny() -> *mut tl_model {
        let path = std::env::temp_dir().join(format!(
            "tinyloop-bound-test-{}.tinyloop",
            std::process::id()
        ));
        random_model(&preset("tiny").unwrap(), 3, 4, 32)
            .unwrap()
            .write(&path)
            .unwrap();
        let mut params = std::mem::MaybeUninit::<tl_model_params>::uninit();
        // SAFETY: a valid out-pointer.
        unsafe { tl_model_default_params(params.as_mut_ptr()) };
        // SAFETY: initialized above.
        let mut params = unsafe { params.assume_init() };
        let device = CString::new("cpu").unwrap();
        params.device = device.as_ptr();
        params.log = false;
        params.max_seq_len = 64;
        let cpath = CString::new(path.to_str().unwrap()).unwrap();
        let mut model = std::ptr::null_mut();
        // SAFETY: valid strings, params and out-pointer.
        let status = unsafe { tl_model_open(cpath.as_ptr(), &params, &mut model) };
        std::fs::remove_file(&path).unwrap();
        assert_eq!(status, tl_status::TL_OK);
        model
    }

    /// A freed handle is forgotten by its model; closing the model drops the objects of the
    /// handles still bound to it (their memory is released, not just their handles retired).
    #[test]
    fn close_drops_the_bound_objects_and_free_unbinds() {
        let model = open_tiny();
        let tokens = [1, 2, 3, 4];
        let (mut cache, mut resume, mut freed) = (
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        );
        // SAFETY: a live model, valid tokens and out-pointers.
        unsafe {
            assert_eq!(
                tl_prefix_cache_new(model, tokens.as_ptr(), 4, -1, &mut cache),
                tl_status::TL_OK
            );
            assert_eq!(
                tl_resume_handle_new(model, tokens.as_ptr(), 4, -1, &mut resume),
                tl_status::TL_OK
            );
            assert_eq!(
                tl_prefix_cache_new(model, tokens.as_ptr(), 4, -1, &mut freed),
                tl_status::TL_OK
            );
        }
        assert_eq!(bound_len(model), 3);
        tl_prefix_cache_free(freed);
        assert_eq!(bound_len(model), 2, "a freed handle is unbound");
        let cache_object = Arc::downgrade(&PREFIX_CACHES.get(cache, "test").unwrap());
        let resume_object = Arc::downgrade(&RESUME_HANDLES.get(resume, "test").unwrap());
        assert_eq!(tl_close(model), tl_status::TL_OK);
        assert!(
            cache_object.upgrade().is_none(),
            "the prefix cache was dropped"
        );
        assert!(
            resume_object.upgrade().is_none(),
            "the resume handle was dropped"
        );
        assert!(matches!(PREFIX_CACHES.lookup(cache), Lookup::Closed));
        // Freeing what close retired is a no-op.
        tl_prefix_cache_free(cache);
        tl_resume_handle_free(resume);
    }
}
