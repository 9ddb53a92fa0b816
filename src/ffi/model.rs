//! `tl_model`: a model plus its default session (the seed's simple surface).

use std::ffi::{c_char, c_void};
use std::sync::{Mutex, RwLock};

use super::params::{
    check_buffer, check_config_size, model_options, saturate, tl_config, tl_generate_params,
    tl_model_params, write_buffer,
};
use super::session::{ops, tl_token_callback};
use super::{
    boundary, boundary_void, c_str, enter_cancelling, non_null, tl_status, try_enter, write_out,
    Failure, FfiResult,
};
use crate::{CancelHandle, HeadKind, Model, NormKind, Session};

/// An open model: immutable weights on one device plus a default session. Opaque; created by
/// `tl_model_open`, closed by `tl_close`, freed by `tl_model_free`.
pub struct tl_model {
    /// The weights; `None` once closed. Read-locked briefly by calls that need only the model.
    model: RwLock<Option<Model>>,
    /// The default session; `None` once closed. Held for the whole of a generate / score call.
    default: Mutex<Option<Session>>,
    /// Cancels the call running on the default session; usable without the mutex.
    cancel: CancelHandle,
}

impl tl_model {
    /// A clone of the model (shares the weights), or `TL_ERR_CLOSED` naming `func`.
    fn model(&self, func: &str) -> FfiResult<Model> {
        let guard = self.model.read().unwrap_or_else(|p| p.into_inner());
        guard.clone().ok_or_else(|| Failure::closed(func))
    }

    /// Release the default session and the model's reference to the weights.
    fn close(&self) -> FfiResult {
        let mut session = enter_cancelling(&self.default, &self.cancel, "the model")?;
        *session = None;
        *self.model.write().unwrap_or_else(|p| p.into_inner()) = None;
        Ok(())
    }
}

/// Run `f` on the default session of `model` with the session mutex held (`TL_ERR_BUSY` when
/// another call holds it, `TL_ERR_CLOSED` after `tl_close`).
///
/// # Safety
/// `model` must be NULL or a live handle from `tl_model_open`.
unsafe fn with_default<R>(
    model: *const tl_model,
    func: &str,
    f: impl FnOnce(&mut Session) -> FfiResult<R>,
) -> FfiResult<R> {
    // SAFETY: NULL or a live handle by the caller's contract.
    let handle = unsafe { model.as_ref() }.ok_or_else(|| Failure::invalid("model is NULL"))?;
    let mut held = try_enter(&handle.default, "the model's default session")?;
    let session = held.as_mut().ok_or_else(|| Failure::closed(func))?;
    f(session)
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
/// Ownership: the caller owns the new handle and must release it with `tl_model_free` (after
/// `tl_close`, or not). `path` and `params` (including `params->device`) are only read during
/// the call. Threads: any thread.
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
        let handle = Box::new(tl_model {
            cancel: session.cancel_handle(),
            model: RwLock::new(Some(model)),
            default: Mutex::new(Some(session)),
        });
        // SAFETY: checked non-NULL; writable by the caller's contract.
        unsafe { write_out(out_model, Box::into_raw(handle)) };
        Ok(())
    })
}

/// Release the model's weights and its default session. A call running on the default session
/// from another thread is cancelled and awaited first. Sessions created with `tl_session_new`
/// keep the weights alive until they are freed, and keep working. Idempotent; NULL is accepted
/// (TL_OK). Afterwards every call on the handle except `tl_close` / `tl_model_free` /
/// `tl_cancel` fails with `TL_ERR_CLOSED`; the handle itself stays valid until `tl_model_free`.
///
/// Fails with `TL_ERR_BUSY` only when called from inside a stream callback of a call on the
/// same model (the call cannot be awaited from its own thread).
///
/// Ownership: does not free the handle. Threads: any thread, also while another thread is in
/// a call on this model.
///
/// # Safety
/// `model` must be NULL or a handle from `tl_model_open` not yet passed to `tl_model_free`.
#[no_mangle]
pub unsafe extern "C" fn tl_close(model: *mut tl_model) -> tl_status {
    boundary("tl_close", || {
        // SAFETY: NULL or live by the caller's contract.
        match unsafe { model.as_ref() } {
            None => Ok(()),
            Some(handle) => handle.close(),
        }
    })
}

/// Close (as `tl_close`) and free the handle. NULL is accepted. If called from inside a stream
/// callback of a call on the same model, nothing is freed and the last error is set.
///
/// Ownership: takes back the handle from `tl_model_open`; the pointer is invalid afterwards, so
/// calling this twice on the same pointer is a double free (like free()). Threads: any thread,
/// but no other thread may be using or about to use the handle.
///
/// # Safety
/// `model` must be NULL or a handle from `tl_model_open` not yet freed.
#[no_mangle]
pub unsafe extern "C" fn tl_model_free(model: *mut tl_model) {
    boundary_void("tl_model_free", || {
        if model.is_null() {
            return Ok(());
        }
        // SAFETY: live by the caller's contract.
        unsafe { &*model }.close()?;
        // SAFETY: from Box::into_raw in tl_model_open; no other thread uses it (contract).
        drop(unsafe { Box::from_raw(model) });
        Ok(())
    })
}

/// Request cancellation of the call running on the model's default session; it stops at the
/// next token and returns `TL_ERR_CANCELLED`. Calls that start later are not affected; score
/// calls are not interruptible. TL_OK when nothing is running or the model is closed.
///
/// Ownership: none. Threads: any thread, any time while the handle is live (typically another
/// thread than the one generating, or the stream callback itself).
///
/// # Safety
/// `model` must be NULL or a live handle from `tl_model_open`.
#[no_mangle]
pub unsafe extern "C" fn tl_cancel(model: *const tl_model) -> tl_status {
    boundary("tl_cancel", || {
        // SAFETY: NULL or live by the caller's contract.
        let handle = unsafe { model.as_ref() }.ok_or_else(|| Failure::invalid("model is NULL"))?;
        handle.cancel.cancel();
        Ok(())
    })
}

/// Write the model's static architecture and open options to `*config`. The caller sets
/// `config->struct_size = sizeof(tl_config)` first. Does not wait for running calls.
///
/// Ownership: the caller owns `*config`; its string fields point to static storage.
/// Threads: any thread, concurrently with other calls.
///
/// # Safety
/// `model` must be NULL or a live handle; `config` NULL or valid for reads and writes of
/// `tl_config`.
#[no_mangle]
pub unsafe extern "C" fn tl_model_config(
    model: *const tl_model,
    config: *mut tl_config,
) -> tl_status {
    boundary("tl_model_config", || {
        // SAFETY: NULL or live by the caller's contract.
        let handle = unsafe { model.as_ref() }.ok_or_else(|| Failure::invalid("model is NULL"))?;
        non_null(config, "config")?;
        // SAFETY: non-NULL and readable by the caller's contract.
        unsafe { check_config_size(config) }?;
        let m = handle.model("tl_model_config")?;
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
        // SAFETY: the caller's struct_size is at least ours, so its first
        // size_of::<tl_config>() bytes are writable.
        unsafe {
            write_out(
                config,
                tl_config {
                    struct_size: std::ptr::addr_of!((*config).struct_size).read(),
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
            )
        };
        Ok(())
    })
}

/// Device memory held by the model's weights and all of its live sessions (buffers and KV
/// caches), in MB (10^6 bytes), written to `*out_mb`. A point-in-time snapshot; does not wait
/// for running calls.
///
/// Ownership: none. Threads: any thread, concurrently with other calls.
///
/// # Safety
/// `model` must be NULL or a live handle; `out_mb` NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn tl_vram_usage_mb(model: *const tl_model, out_mb: *mut f64) -> tl_status {
    boundary("tl_vram_usage_mb", || {
        // SAFETY: NULL or live by the caller's contract.
        let handle = unsafe { model.as_ref() }.ok_or_else(|| Failure::invalid("model is NULL"))?;
        non_null(out_mb, "out_mb")?;
        let m = handle.model("tl_vram_usage_mb")?;
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
/// `model` must be NULL or a live handle; `out` valid for `cap` bytes; `len` for one write.
#[no_mangle]
pub unsafe extern "C" fn tl_model_device(
    model: *const tl_model,
    out: *mut c_char,
    cap: usize,
    len: *mut usize,
) -> tl_status {
    boundary("tl_model_device", || {
        // SAFETY: NULL or live by the caller's contract.
        let handle = unsafe { model.as_ref() }.ok_or_else(|| Failure::invalid("model is NULL"))?;
        let m = handle.model("tl_model_device")?;
        let mut bytes: Vec<c_char> = m
            .info()
            .device
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
    })
}

/// Generate up to `params->max_tokens` tokens after the prompt `tokens[0..n_tokens]` on the
/// model's default session (greedy by default; `params` NULL = defaults). On success the new
/// tokens (stop token excluded) are in `out[0..*len]`. `cap` must be >= max_tokens, else
/// `TL_ERR_BUFFER_TOO_SMALL` with `*len = max_tokens` before any work.
///
/// Failures: `TL_ERR_INVALID_ARGUMENT` (NULL, empty prompt, negative token or token >=
/// vocab_size, bad params, prompt + max_tokens > max_seq_len), `TL_ERR_BUSY` (another call on
/// this model is running), `TL_ERR_CANCELLED` (`tl_cancel`), `TL_ERR_CLOSED`.
///
/// Ownership: the caller owns all buffers; nothing is retained after the call.
/// Threads: any thread; one call at a time per model (use sessions for concurrency).
///
/// # Safety
/// `model` NULL or live; `tokens` valid for `n_tokens` reads; `params` NULL or from
/// `tl_generate_default_params`; `out` valid for `cap` writes; `len` for one write.
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
    boundary("tl_generate", || {
        // SAFETY: caller's contract, forwarded.
        unsafe {
            with_default(model, "tl_generate", |s| {
                ops::generate(s, tokens, n_tokens, params, out, cap, len)
            })
        }
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
    boundary("tl_generate_stream", || {
        // SAFETY: caller's contract, forwarded.
        unsafe {
            with_default(model, "tl_generate_stream", |s| {
                ops::generate_stream(s, tokens, n_tokens, params, callback, user_data)
            })
        }
    })
}

/// Logits `[vocab_size]` at the last position of `tokens[0..n_tokens]`, run at `loops`
/// iterations (TL_LOOPS_DEFAULT = model default), into `out[0..*len]`. `cap` must be >=
/// vocab_size, else `TL_ERR_BUFFER_TOO_SMALL` with `*len = vocab_size`. With prefill_chunk > 0,
/// n_tokens must be <= prefill_chunk.
///
/// Ownership: the caller owns all buffers. Threads: any thread; one call at a time per model.
///
/// # Safety
/// `model` NULL or live; `tokens` valid for `n_tokens` reads; `out` for `cap` writes; `len`
/// for one write.
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
    boundary("tl_score_last", || {
        // SAFETY: caller's contract, forwarded.
        unsafe {
            with_default(model, "tl_score_last", |s| {
                ops::score_last(s, tokens, n_tokens, loops, out, cap, len)
            })
        }
    })
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
    boundary("tl_score", || {
        // SAFETY: caller's contract, forwarded.
        unsafe {
            with_default(model, "tl_score", |s| {
                ops::score(s, tokens, n_tokens, loops, out, cap, len)
            })
        }
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
    boundary("tl_logprobs", || {
        // SAFETY: caller's contract, forwarded.
        unsafe {
            with_default(model, "tl_logprobs", |s| {
                ops::logprobs(s, tokens, n_tokens, loops, out, cap, len)
            })
        }
    })
}

/// Create a session (its own buffers and KV cache) over the model's weights; on success
/// `*out_session` receives it. Sessions are independent of each other and of the model's
/// default session, so N threads with N sessions run concurrently over one copy of the weights.
///
/// Ownership: the caller owns the session and frees it with `tl_session_free`; it keeps the
/// weights alive even after `tl_close` / `tl_model_free` of the model. Threads: any thread,
/// concurrently with other calls on the model.
///
/// # Safety
/// `model` NULL or live; `out_session` NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn tl_session_new(
    model: *const tl_model,
    out_session: *mut *mut super::tl_session,
) -> tl_status {
    boundary("tl_session_new", || {
        // SAFETY: NULL or live by the caller's contract.
        let handle = unsafe { model.as_ref() }.ok_or_else(|| Failure::invalid("model is NULL"))?;
        non_null(out_session, "out_session")?;
        let m = handle.model("tl_session_new")?;
        let session = super::session::new_handle(m.new_session()?);
        // SAFETY: non-NULL and writable by the caller's contract.
        unsafe { write_out(out_session, session) };
        Ok(())
    })
}
