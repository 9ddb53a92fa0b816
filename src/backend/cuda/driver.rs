//! A thin layer over the CUDA driver API, reached through cudarc's dynamically loaded bindings:
//! finding the driver library without panicking when it is absent, device memory that reports
//! allocation failure as [`Error::OutOfMemory`], and kernel launches with no per-launch
//! allocation. Nothing here knows about kernels or models (gpu.rs builds on it).

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext, DriverError};

use crate::error::{Error, Result};

pub(crate) fn device_error(what: &str, e: DriverError) -> Error {
    Error::Device(format!("{what}: {e}"))
}

/// Whether the CUDA driver library can be loaded (cudarc panics on first use when it cannot).
pub(crate) fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the driver library by its usual names; no symbol is called.
    unsafe { sys::is_culib_present() }
}

/// Device memory owned by one value; freed on drop.
pub struct DevBuf {
    pub(crate) ptr: u64,
    pub(crate) bytes: usize,
    ctx: Arc<CudaContext>,
}

impl std::fmt::Debug for DevBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DevBuf({:#x}, {} bytes)", self.ptr, self.bytes)
    }
}

impl DevBuf {
    /// `bytes` of uninitialized device memory in `ctx` (of GPU `ordinal`); failure is
    /// `Error::OutOfMemory` naming the size.
    pub(crate) fn alloc(
        ctx: &Arc<CudaContext>,
        ordinal: usize,
        bytes: usize,
        what: &str,
    ) -> Result<DevBuf> {
        ctx.bind_to_thread()
            .map_err(|e| device_error("binding the context", e))?;
        // Round up so that 16-byte vector accesses at the end of a buffer stay inside it.
        let size = bytes.max(16).div_ceil(256) * 256;
        // SAFETY: plain cuMemAlloc with the context current; the pointer is owned by the DevBuf.
        match unsafe { result::malloc_sync(size) } {
            Ok(ptr) => Ok(DevBuf {
                ptr,
                bytes: size,
                ctx: ctx.clone(),
            }),
            Err(DriverError(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY)) => {
                let free = ctx.mem_get_info().map(|(free, _)| free).unwrap_or(0);
                Err(Error::OutOfMemory {
                    bytes: size,
                    what: format!("{what} on cuda:{ordinal} ({free} bytes free)"),
                })
            }
            Err(e) => Err(device_error(
                &format!("allocating {size} bytes for {what}"),
                e,
            )),
        }
    }

    /// Like [`DevBuf::alloc`], then zero-filled.
    pub(crate) fn zeroed(
        ctx: &Arc<CudaContext>,
        ordinal: usize,
        bytes: usize,
        what: &str,
    ) -> Result<DevBuf> {
        let buf = DevBuf::alloc(ctx, ordinal, bytes, what)?;
        // SAFETY: the range lies inside the allocation just made.
        unsafe { result::memset_d8_sync(buf.ptr, 0, buf.bytes) }
            .map_err(|e| device_error("cuMemsetD8", e))?;
        wait_for_legacy_stream("cuMemsetD8")?;
        Ok(buf)
    }

    /// Synchronous copy of host bytes to `offset` of the buffer.
    pub(crate) fn upload<T>(&self, offset: usize, src: &[T]) -> Result<()> {
        let len = std::mem::size_of_val(src);
        assert!(
            offset + len <= self.bytes,
            "upload past the end of a device buffer"
        );
        if len == 0 {
            return Ok(());
        }
        // SAFETY: the destination range lies inside the allocation (checked above) and the
        // source slice is valid for `len` bytes for the duration of this synchronous copy.
        unsafe { result::memcpy_htod_sync(self.ptr + offset as u64, src) }
            .map_err(|e| device_error("copying to the device", e))?;
        wait_for_legacy_stream("copying to the device")
    }
}

/// Wait for work issued on the legacy default stream. `cuMemsetD8` and `cuMemcpyHtoD` from
/// pageable memory run there and may still be in flight when they return, while sessions use
/// non-blocking streams that do not wait for the legacy stream: without this, a kernel could read
/// a buffer before it is cleared or filled.
fn wait_for_legacy_stream(what: &str) -> Result<()> {
    // SAFETY: the null stream is the context's legacy default stream, always valid.
    unsafe { result::stream::synchronize(std::ptr::null_mut()) }.map_err(|e| device_error(what, e))
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from cuMemAlloc and is freed once. cuMemFree waits for work that
            // still uses it. An error here (a context already broken by an earlier fault) leaves
            // nothing to clean up.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

/// One kernel argument. Each is stored in an 8-byte slot; the driver reads as many bytes as the
/// parameter has (little-endian, so an i32 or f32 in the low bytes reads back correctly).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Arg {
    P(u64),
    I(i32),
    L(i64),
    F(f32),
    /// A by-value struct parameter: the address of its bytes, which must stay valid (and
    /// unchanged) until `launch` returns; the driver copies them then.
    S(*const c_void),
}

impl Arg {
    pub fn usize(v: usize) -> Arg {
        Arg::I(i32::try_from(v).expect("kernel argument exceeds i32"))
    }
}

pub(crate) const MAX_ARGS: usize = 20;

/// Launch `f` on `stream`. No allocation: arguments live in a stack array for the call.
///
/// With `overlap` (programmatic dependent launch, sm_90+), the kernel may be scheduled while its
/// predecessor on the stream is still running; every kernel in cuda/ calls
/// `wait_for_predecessor()` before it touches memory that earlier work writes, so only its launch
/// latency and its weight prefetch overlap the predecessor's tail.
pub(crate) fn launch(
    f: sys::CUfunction,
    grid: (u32, u32, u32),
    block: u32,
    smem: u32,
    stream: sys::CUstream,
    args: &[Arg],
    overlap: bool,
) -> std::result::Result<(), DriverError> {
    assert!(args.len() <= MAX_ARGS, "too many kernel arguments");
    let mut slots = [0u64; MAX_ARGS];
    let mut params = [std::ptr::null_mut::<c_void>(); MAX_ARGS];
    for ((param, slot), arg) in params.iter_mut().zip(slots.iter_mut()).zip(args) {
        *slot = match *arg {
            Arg::P(p) => p,
            Arg::I(v) => v as u32 as u64,
            Arg::L(v) => v as u64,
            Arg::F(v) => v.to_bits() as u64,
            Arg::S(bytes) => {
                *param = bytes as *mut c_void;
                continue;
            }
        };
        *param = slot as *mut u64 as *mut c_void;
    }
    // SAFETY (all-zero bit pattern): a plain C struct of integers and a union.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let config = sys::CUlaunchConfig {
        gridDimX: grid.0,
        gridDimY: grid.1,
        gridDimZ: grid.2,
        blockDimX: block,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: smem,
        hStream: stream,
        attrs: &mut attr,
        numAttrs: overlap as u32,
    };
    // SAFETY: `f` is a kernel of the loaded module whose parameter list matches `args` (each
    // call site passes the kernel's documented signature); every parameter pointer points into
    // `slots` and the attribute lives in `attr`, both of which outlive the call (the driver
    // copies the values before returning).
    unsafe { sys::cuLaunchKernelEx(&config, f, params.as_mut_ptr(), std::ptr::null_mut()).result() }
}
