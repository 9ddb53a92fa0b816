//! The CTX-TIER policy of a generation call at the C ABI (`tl_generate_params.ctx_tier`).

use std::ffi::c_char;
use std::path::PathBuf;

use super::params::read_versioned;
use super::{c_str, tl_status, FfiResult};
use crate::CtxTier;

/// A CTX-TIER policy (the loop body runs at INT2 once the context is long). Fill with
/// `tl_ctx_tier_default_params`, then change fields; pass it as `tl_generate_params.ctx_tier`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct tl_ctx_tier_params {
    /// `sizeof(tl_ctx_tier_params)`; set by `tl_ctx_tier_default_params`. Smaller values are
    /// rejected; larger values are accepted and the extra bytes ignored.
    pub struct_size: usize,
    /// LONG -> SHORT when an observed sequence length is below this; >= 1. Default 512.
    pub short_t: u32,
    /// SHORT -> LONG when an observed sequence length reaches this; >= short_t. Default 2048.
    pub long_t: u32,
    /// Bits of the loop body at LONG: 2 (the only narrower encoding; others are rejected).
    pub long_bits: u32,
    /// Add every transition to the summary printed on stderr. Default false.
    pub verbose: bool,
    /// NUL-terminated UTF-8 path that receives the call's summary as JSON, or NULL (default).
    /// Only read during the call.
    pub file: *const c_char,
}

pub(crate) fn default_ctx_tier_params() -> tl_ctx_tier_params {
    let d = CtxTier::default();
    tl_ctx_tier_params {
        struct_size: std::mem::size_of::<tl_ctx_tier_params>(),
        short_t: super::params::saturate(d.short_t),
        long_t: super::params::saturate(d.long_t),
        long_bits: d.long_bits,
        verbose: d.verbose,
        file: std::ptr::null(),
    }
}

/// The policy `params` points to; `None` for NULL.
///
/// # Safety
/// `params` must be NULL or point to a `tl_ctx_tier_params` of at least its `struct_size`
/// bytes, whose `file` is NULL or a NUL-terminated string.
pub(crate) unsafe fn ctx_tier_arg(params: *const tl_ctx_tier_params) -> FfiResult<Option<CtxTier>> {
    if params.is_null() {
        return Ok(None);
    }
    // SAFETY: non-NULL; the caller's contract covers its struct_size bytes.
    let p =
        unsafe { read_versioned(params, default_ctx_tier_params(), &[], "tl_ctx_tier_params") }?;
    let file = if p.file.is_null() {
        None
    } else {
        // SAFETY: non-NULL and NUL-terminated by the caller's contract.
        Some(PathBuf::from(unsafe {
            c_str(p.file, "tl_ctx_tier_params.file")
        }?))
    };
    let tier = CtxTier {
        short_t: p.short_t as usize,
        long_t: p.long_t as usize,
        long_bits: p.long_bits,
        verbose: p.verbose,
        file,
    };
    tier.validate()?;
    Ok(Some(tier))
}

/// Fill `*params` with the defaults of this library version (including `struct_size`):
/// short_t 512, long_t 2048, long_bits 2, not verbose, no file.
///
/// Ownership: the caller owns `*params` and the path it may point to later.
/// Threads: any thread.
///
/// # Safety
/// `params` must be NULL or valid for a write of `tl_ctx_tier_params`.
#[no_mangle]
pub unsafe extern "C" fn tl_ctx_tier_default_params(params: *mut tl_ctx_tier_params) -> tl_status {
    super::boundary("tl_ctx_tier_default_params", || {
        super::non_null(params, "params")?;
        // SAFETY: non-NULL and writable by the caller's contract.
        unsafe { super::write_out(params, default_ctx_tier_params()) };
        Ok(())
    })
}
