//! Handles and defaults for tests that drive the C ABI from Rust.

use std::ffi::{CStr, CString};
use std::ptr;

use tinyloop::ffi::*;

/// A model handle that is closed on drop (a no-op when the test closed it already).
pub struct Handle(pub *mut tl_model);

// SAFETY: the C ABI documents tl_model as usable from any thread (calls serialize internally);
// the library looks handle values up and never dereferences them.
unsafe impl Send for Handle {}
// SAFETY: as above.
unsafe impl Sync for Handle {}

impl Drop for Handle {
    fn drop(&mut self) {
        tl_model_free(self.0);
    }
}

pub fn last_error() -> String {
    // SAFETY: tl_last_error_message never returns NULL and the string lives until the next
    // failing call on this thread.
    unsafe { CStr::from_ptr(tl_last_error_message()) }
        .to_string_lossy()
        .into_owned()
}

/// `tl_model_default_params`, checked.
pub fn model_params() -> tl_model_params {
    let mut params = std::mem::MaybeUninit::<tl_model_params>::uninit();
    // SAFETY: a valid out-pointer.
    assert_eq!(
        unsafe { tl_model_default_params(params.as_mut_ptr()) },
        tl_status::TL_OK
    );
    // SAFETY: initialized by the call above.
    unsafe { params.assume_init() }
}

pub fn open(path: &std::path::Path, max_seq_len: u32) -> Handle {
    let mut params = model_params();
    let device = CString::new("cpu").unwrap();
    params.device = device.as_ptr();
    params.max_seq_len = max_seq_len;
    params.log = false;
    let cpath = CString::new(path.to_str().unwrap()).unwrap();
    let mut model = ptr::null_mut();
    // SAFETY: valid strings, params and out-pointer.
    let status = unsafe { tl_model_open(cpath.as_ptr(), &params, &mut model) };
    assert_eq!(status, tl_status::TL_OK, "{}", last_error());
    Handle(model)
}

pub fn gen_params(max_tokens: u32) -> tl_generate_params {
    let mut p = std::mem::MaybeUninit::<tl_generate_params>::uninit();
    // SAFETY: a valid out-pointer.
    assert_eq!(
        unsafe { tl_generate_default_params(p.as_mut_ptr()) },
        tl_status::TL_OK
    );
    // SAFETY: initialized above.
    let mut p = unsafe { p.assume_init() };
    p.max_tokens = max_tokens;
    p
}
