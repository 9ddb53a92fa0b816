//! `tl_model`: a model plus its default session (the seed's simple surface).

use std::collections::BTreeSet;
use std::ffi::c_char;
use std::sync::{Arc, Mutex, RwLock};

use super::bound::Bound;
use super::handles::{Kind, Lookup, Table};
use super::params::{
    check_buffer, model_options, saturate, tl_config, tl_model_params, write_buffer,
    write_versioned,
};
use super::session::SessionSlot;
use super::{boundary, boundary_void, c_str, non_null, tl_status, write_out, Failure, FfiResult};
use crate::{HeadKind, Model, NormKind};

/// An open model: immutable weights on one device plus a default session. Opaque; created by
/// `tl_model_open`, closed (and freed) by `tl_close` or `tl_model_free`. A handle is a value
/// the library looks up, not an address: never dereference it.
pub struct tl_model {
    _opaque: [u8; 0],
}

/// The open models behind `tl_model` handles.
static MODELS: Table<OpenModel, tl_model> = Table::new(Kind::Model);

/// What a `tl_model` handle refers to.
pub(crate) struct OpenModel {
    /// The weights; `None` once closed. Read-locked briefly by calls that need only the model.
    model: RwLock<Option<Model>>,
    /// The default session, where the generate / score calls of the model handle run.
    default: Arc<SessionSlot>,
    /// The prefix caches and resume handles built on this model (through any of its sessions),
    /// retired when it closes; `None` once closed.
    bound: Mutex<Option<BTreeSet<Bound>>>,
}

impl OpenModel {
    /// A clone of the model (shares the weights), or `TL_ERR_CLOSED` naming `func` once
    /// closing has started.
    fn model(&self, func: &str) -> FfiResult<Model> {
        let closed = || Kind::Model.closed(func);
        if self.default.is_released() {
            return Err(closed());
        }
        let guard = self.model.read().unwrap_or_else(|p| p.into_inner());
        guard.clone().ok_or_else(closed)
    }

    /// Release the default session (new calls fail from here on; a running one is cancelled
    /// and awaited), the model's reference to the weights, and the handles bound to it.
    fn close(&self) -> FfiResult {
        self.default.release()?;
        *self.model.write().unwrap_or_else(|p| p.into_inner()) = None;
        let bound = self.bound.lock().unwrap_or_else(|p| p.into_inner()).take();
        bound.into_iter().flatten().for_each(Bound::retire);
        Ok(())
    }

    /// Bind a handle to this model, so that closing it retires the handle; false (nothing
    /// done) once the model is closed.
    pub fn bind(&self, handle: Bound) -> bool {
        let mut bound = self.bound.lock().unwrap_or_else(|p| p.into_inner());
        bound.as_mut().is_some_and(|set| set.insert(handle))
    }

    /// Forget a handle that was freed.
    pub fn unbind(&self, handle: Bound) {
        let mut bound = self.bound.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(set) = bound.as_mut() {
            set.remove(&handle);
        }
    }
}

/// The model behind a handle that `func` was called on (a clone that shares the weights).
pub(super) fn model_of(model: *const tl_model, func: &str) -> FfiResult<Model> {
    MODELS.get(model, func)?.model(func)
}

/// The default session of the model behind a handle that `func` was called on.
pub(super) fn default_session(model: *const tl_model, func: &str) -> FfiResult<Arc<SessionSlot>> {
    Ok(MODELS.get(model, func)?.default.clone())
}

/// `tl_close` and `tl_model_free`: close the model and retire its handle.
fn close_handle(model: *const tl_model) -> FfiResult {
    match MODELS.lookup(model) {
        Lookup::Null | Lookup::Closed => Ok(()),
        Lookup::Invalid(failure) => Err(failure),
        Lookup::Live(open) => {
            open.close()?;
            MODELS.remove(model);
            Ok(())
        }
    }
}

/// Open and validate a `.tinyloop` file and load its weights onto the chosen device; creates the
/// model's default session (buffers sized by `params`). `params` may be NULL for defaults.
/// On success `*out_model` receives the handle; on failure it is not written.
///
/// Failures: `TL_ERR_IO` (missing/unreadable file), `TL_ERR_FORMAT` (the message names the
/// failure point: bad magic, unsupported version, truncated, missing tensor, shape/dtype or
/// checksum mismatch), `TL_ERR_INVALID_ARGUMENT` (bad params or device name), `TL_ERR_DEVICE`,
/// `TL_ERR_OUT_OF_MEMORY`.
///
/// Ownership: the caller owns the new handle and releases it with `tl_close` (or
/// `tl_model_free`, the same without a status). `path` and `params` (including
/// `params->device`) are only read during the call. Threads: any thread.
///
/// # Safety
/// `path` must be NULL or a NUL-terminated string; `params` NULL or a `tl_model_params` from
/// `tl_model_default_params`; `out_model` NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn tl_model_open(
    path: *const c_char,
    params: *const tl_model_params,
    out_model: *mut *mut tl_model,
) -> tl_status {
    boundary("tl_model_open", || {
        non_null(out_model, "out_model")?;
        // SAFETY: caller's contract on `path` and `params`.
        let path = unsafe { c_str(path, "path") }?;
        // SAFETY: as above.
        let options = unsafe { model_options(params) }?;
        let model = Model::open(path, &options)?;
        let session = model.new_session()?;
        let handle = MODELS.insert_cyclic(|open| OpenModel {
            model: RwLock::new(Some(model)),
            default: Arc::new(SessionSlot::new(session, Kind::Model, open.clone())),
            bound: Mutex::new(Some(BTreeSet::new())),
        })?;
        // SAFETY: checked non-NULL; writable by the caller's contract.
        unsafe { write_out(out_model, handle) };
        Ok(())
    })
}

/// Close the model and release everything `tl_model_open` allocated: the weights (unless
/// sessions still use them), the default session and the handle; and the prefix caches and
/// resume handles built on the model, whose handles are retired (every later use is
/// `TL_ERR_CLOSED`, their free functions no-ops). From the moment it starts,
/// every new call on the handle fails with `TL_ERR_CLOSED` at once; a call already running on
/// the default session in another thread is cancelled and awaited (as by `tl_cancel`: it
/// returns `TL_ERR_CANCELLED`).
/// Sessions created with `tl_session_new` keep the weights alive until they are freed, and keep
/// working. Afterwards every call on the handle fails with `TL_ERR_CLOSED`, except `tl_close` /
/// `tl_model_free` (no-ops) and `tl_cancel` (TL_OK): handle values are never reused. NULL is
/// accepted (TL_OK); a value that is not a model handle is `TL_ERR_INVALID_ARGUMENT`.
///
/// Fails with `TL_ERR_BUSY`, closing nothing, only when called from inside a stream callback of
/// a call on the same model (the call cannot be awaited from its own thread).
///
/// Ownership: takes back the handle from `tl_model_open`. Threads: any thread, also while
/// other threads are in calls on this model or closing it.
#[no_mangle]
pub extern "C" fn tl_close(model: *mut tl_model) -> tl_status {
    boundary("tl_close", || close_handle(model))
}

/// `tl_close` without a status: failures only set the last error message. A no-op for NULL
/// and for a handle already closed, so calling it after `tl_close`, or twice, is harmless.
///
/// Ownership: as `tl_close`. Threads: as `tl_close`.
#[no_mangle]
pub extern "C" fn tl_model_free(model: *mut tl_model) {
    boundary_void("tl_model_free", || close_handle(model))
}

/// Request cancellation of the call running on the model's default session: a generation
/// stops at the next token, any other call (score, logit lens, building a prefix cache or
/// resume handle) at the next block application, and it returns `TL_ERR_CANCELLED` without
/// writing its outputs. Calls that start later are not affected. TL_OK when nothing is running
/// or the model is closed.
///
/// Ownership: none. Threads: any thread, any time (typically another thread than the one
/// generating, or the stream callback itself).
#[no_mangle]
pub extern "C" fn tl_cancel(model: *const tl_model) -> tl_status {
    boundary("tl_cancel", || match MODELS.lookup(model) {
        Lookup::Null => Err(Failure::invalid("model is NULL")),
        Lookup::Invalid(failure) => Err(failure),
        Lookup::Closed => Ok(()),
        Lookup::Live(open) => {
            open.default.cancel();
            Ok(())
        }
    })
}

/// Write the model's static architecture and open options to `*config`. The caller sets
/// `config->struct_size = sizeof(tl_config)` first. Does not wait for running calls.
///
/// Ownership: the caller owns `*config`; its string fields point to static storage.
/// Threads: any thread, concurrently with other calls.
///
/// # Safety
/// `config` must be NULL or valid for reads and writes of its `struct_size` bytes.
#[no_mangle]
pub unsafe extern "C" fn tl_model_config(
    model: *const tl_model,
    config: *mut tl_config,
) -> tl_status {
    boundary("tl_model_config", || {
        let m = model_of(model, "tl_model_config")?;
        non_null(config, "config")?;
        let c = m.config();
        let o = m.options();
        let norm: &'static std::ffi::CStr = match c.norm {
            NormKind::RmsNorm => c"rmsnorm",
            NormKind::LayerNorm => c"layernorm",
        };
        let head: &'static std::ffi::CStr = match c.head {
            HeadKind::Untied => c"untied",
            HeadKind::Tied => c"tied",
        };
        // SAFETY: non-NULL; valid for its struct_size bytes by the caller's contract.
        unsafe {
            write_versioned(
                config,
                tl_config {
                    struct_size: std::mem::size_of::<tl_config>(),
                    dim: saturate(c.dim),
                    n_heads: saturate(c.n_heads),
                    n_kv_heads: saturate(c.n_kv_heads),
                    ffn_dim: saturate(c.ffn_dim),
                    vocab_size: saturate(c.vocab_size),
                    embed_factor_dim: saturate(c.embed_factor_dim),
                    n_pre_blocks: saturate(c.n_pre_blocks),
                    n_loop_blocks: saturate(c.n_loop_blocks),
                    n_post_blocks: saturate(c.n_post_blocks),
                    default_loops: saturate(c.default_loops),
                    norm: norm.as_ptr(),
                    norm_eps: c.norm_eps,
                    rope_theta: c.rope_theta,
                    max_position: saturate(c.max_position),
                    head: head.as_ptr(),
                    max_seq_len: saturate(o.max_seq_len),
                    prefill_chunk: saturate(o.prefill_chunk),
                    max_loops: saturate(o.max_loops),
                },
                &[],
                "tl_config",
            )
        }
    })
}

/// Device memory held by the model's weights and all of its live sessions (buffers and KV
/// caches), in MB (10^6 bytes), written to `*out_mb`. A point-in-time snapshot; does not wait
/// for running calls.
///
/// Ownership: none. Threads: any thread, concurrently with other calls.
///
/// # Safety
/// `out_mb` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn tl_vram_usage_mb(model: *const tl_model, out_mb: *mut f64) -> tl_status {
    boundary("tl_vram_usage_mb", || {
        let m = model_of(model, "tl_vram_usage_mb")?;
        non_null(out_mb, "out_mb")?;
        // SAFETY: non-NULL and writable by the caller's contract.
        unsafe { write_out(out_mb, m.memory_bytes() as f64 / 1e6) };
        Ok(())
    })
}

/// The device the weights live on, in words (e.g. "cpu (16 threads)"), as a NUL-terminated
/// string in `out[0..cap]`. `*len` receives the string length plus one (the NUL); when `cap`
/// is smaller, the call fails with `TL_ERR_BUFFER_TOO_SMALL` (`out` may then be NULL).
///
/// Ownership: the caller owns `out`. Threads: any thread, concurrently with other calls.
///
/// # Safety
/// `out` must be valid for `cap` bytes; `len` for one write.
#[no_mangle]
pub unsafe extern "C" fn tl_model_device(
    model: *const tl_model,
    out: *mut c_char,
    cap: usize,
    len: *mut usize,
) -> tl_status {
    boundary("tl_model_device", || {
        let m = model_of(model, "tl_model_device")?;
        // SAFETY: caller's contract on out / cap / len.
        unsafe { write_string(&m.info().device, out, cap, len) }
    })
}

/// The KV cache mode of the model's sessions (e.g. "int8", or "age:64:128"), as chosen by
/// `tl_model_params.kv_mode` or the environment, as a NUL-terminated string in `out[0..cap]`;
/// `*len` and short buffers as in `tl_model_device`.
///
/// Ownership: the caller owns `out`. Threads: any thread, concurrently with other calls.
///
/// # Safety
/// `out` must be valid for `cap` bytes; `len` for one write.
#[no_mangle]
pub unsafe extern "C" fn tl_model_kv_mode(
    model: *const tl_model,
    out: *mut c_char,
    cap: usize,
    len: *mut usize,
) -> tl_status {
    boundary("tl_model_kv_mode", || {
        let m = model_of(model, "tl_model_kv_mode")?;
        // SAFETY: caller's contract on out / cap / len.
        unsafe { write_string(&m.kv_mode().to_string(), out, cap, len) }
    })
}

/// Write `text` (NUL bytes dropped) and a terminating NUL to a buffer `(out, cap, len)`.
///
/// # Safety
/// `out` must be valid for `cap` bytes; `len` for one write.
unsafe fn write_string(text: &str, out: *mut c_char, cap: usize, len: *mut usize) -> FfiResult {
    let mut bytes: Vec<c_char> = text
        .bytes()
        .filter(|&b| b != 0)
        .map(|b| b as c_char)
        .collect();
    bytes.push(0);
    // SAFETY: caller's contract on out / cap / len.
    unsafe {
        check_buffer(out, cap, len, bytes.len())?;
        write_buffer(out, &bytes, len);
    }
    Ok(())
}

/// Create a session (its own buffers and KV cache) over the model's weights; on success
/// `*out_session` receives it. Sessions are independent of each other and of the model's
/// default session, so N threads with N sessions run concurrently over one copy of the weights.
///
/// Ownership: the caller owns the session and frees it with `tl_session_free`; it keeps the
/// weights alive even after `tl_close` / `tl_model_free` of the model (but prefix caches and
/// resume handles can then no longer be built on it, or used). Threads: any thread,
/// concurrently with other calls on the model.
///
/// # Safety
/// `out_session` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn tl_session_new(
    model: *const tl_model,
    out_session: *mut *mut super::tl_session,
) -> tl_status {
    boundary("tl_session_new", || {
        let open = MODELS.get(model, "tl_session_new")?;
        let m = open.model("tl_session_new")?;
        non_null(out_session, "out_session")?;
        let session = super::session::new_handle(m.new_session()?, Arc::downgrade(&open))?;
        // SAFETY: non-NULL and writable by the caller's contract.
        unsafe { write_out(out_session, session) };
        Ok(())
    })
}

/// How many prefix caches and resume handles are bound to an open model.
#[cfg(test)]
pub(super) fn bound_len(model: *const tl_model) -> usize {
    let open = MODELS.get(model, "bound_len").unwrap();
    let bound = open.bound.lock().unwrap();
    bound.as_ref().map_or(0, |set| set.len())
}
