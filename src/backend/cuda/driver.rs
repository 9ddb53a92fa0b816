//! A thin layer over the CUDA driver API, reached through cudarc's dynamically loaded bindings:
//! finding the libraries without panicking when they are absent, one context per GPU for the
//! whole process, device memory that reports allocation failure as [`Error::OutOfMemory`], and
//! kernel launches with no per-launch allocation.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use cudarc::driver::{result, sys, CudaContext, CudaEvent, CudaStream, DriverError};
use rayon::prelude::*;

use super::kernels::{self, Kernels};
use crate::error::{Error, Result};

pub(crate) fn device_error(what: &str, e: DriverError) -> Error {
    Error::Device(format!("{what}: {e}"))
}

/// Whether the CUDA driver library can be loaded (cudarc panics on first use when it cannot).
pub(crate) fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the driver library by its usual names; no symbol is called.
    unsafe { sys::is_culib_present() }
}

/// A GPU as the process sees it: its context (kept for the life of the process, so that opening
/// a second model costs no context creation), properties, and the compiled kernels.
pub(crate) struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub ordinal: usize,
    pub name: String,
    pub arch: (i32, i32),
    pub sms: usize,
    pub l2_bytes: usize,
    pub smem_optin: usize,
    pub kernels: Kernels,
    /// Pinned staging buffers for weight uploads, made at the first upload of the process.
    staging: Mutex<Option<Staging>>,
}

/// How the kernels of one `Gpu::get` call were obtained (for the load log and `ModelInfo`).
#[derive(Clone, Debug)]
pub(crate) struct KernelLoad {
    pub note: String,
    pub ms: f64,
}

static GPUS: OnceLock<Mutex<HashMap<usize, Arc<Gpu>>>> = OnceLock::new();

impl Gpu {
    /// The process-wide handle of GPU `ordinal`, created (context, kernels) on first use.
    pub fn get(ordinal: usize) -> Result<(Arc<Gpu>, KernelLoad)> {
        let mut gpus = GPUS
            .get_or_init(|| Mutex::new(HashMap::new()))
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(gpu) = gpus.get(&ordinal) {
            let load = KernelLoad {
                note: "already loaded in this process".into(),
                ms: 0.0,
            };
            return Ok((gpu.clone(), load));
        }
        if !driver_present() {
            return Err(Error::Device(
                "the CUDA driver library (libcuda.so) was not found".into(),
            ));
        }
        let init_start = Instant::now();
        result::init().map_err(|e| device_error("cuInit", e))?;
        let init_ms = init_start.elapsed().as_secs_f64() * 1e3;
        let count = result::device::get_count().map_err(|e| device_error("cuDeviceGetCount", e))?;
        if ordinal >= count.max(0) as usize {
            return Err(Error::Device(format!(
                "cuda:{ordinal} requested, but {count} CUDA device(s) are visible"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| device_error("creating the context", e))?;
        let attr = |a: sys::CUdevice_attribute| -> Result<usize> {
            ctx.attribute(a)
                .map(|v| v.max(0) as usize)
                .map_err(|e| device_error("cuDeviceGetAttribute", e))
        };
        use sys::CUdevice_attribute::*;
        let arch = ctx
            .compute_capability()
            .map_err(|e| device_error("compute capability", e))?;
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        if arch.0 < 8 {
            return Err(Error::Device(format!(
                "{name} has compute capability {}.{}; the CUDA backend needs 8.0 or newer",
                arch.0, arch.1
            )));
        }
        let context_ms = init_start.elapsed().as_secs_f64() * 1e3 - init_ms;
        let start = Instant::now();
        let (kernels, note) = kernels::load(&ctx, arch)?;
        let gpu = Arc::new(Gpu {
            ordinal,
            name,
            arch,
            sms: attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
            l2_bytes: attr(CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?,
            smem_optin: attr(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?,
            kernels,
            staging: Mutex::new(None),
            ctx,
        });
        gpu.kernels.allow_dynamic_smem(gpu.smem_optin)?;
        let load = KernelLoad {
            note: format!(
                "{note}; CUDA driver initialized in {init_ms:.0} ms, context created in {context_ms:.0} ms"
            ),
            ms: start.elapsed().as_secs_f64() * 1e3,
        };
        gpus.insert(ordinal, gpu.clone());
        Ok((gpu, load))
    }

    /// Copy `src` to device address `dst` through the pinned staging buffers, in order on `stream`
    /// (asynchronous: `src` may be dropped on return, the device copy completes later). Chunks
    /// are copied into pinned memory by several threads while the previous chunk's DMA runs.
    pub fn upload_staged(&self, dst: u64, src: &[u8], stream: &CudaStream) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        self.bind()?;
        let mut guard = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        if guard.is_none() {
            *guard = Some(Staging::new(&self.ctx)?);
        }
        let staging = guard.as_mut().expect("staging made above");
        let mut offset = 0usize;
        for chunk in src.chunks(STAGE_BYTES) {
            let i = staging.next;
            staging.next ^= 1;
            // Wait until the DMA that last read buffer i is done.
            staging.events[i]
                .synchronize()
                .map_err(|e| device_error("waiting for an upload", e))?;
            // SAFETY: buffer i holds STAGE_BYTES >= chunk.len() bytes of pinned memory that no
            // transfer reads any more (waited above); this is the only reference to it.
            let pinned = unsafe { std::slice::from_raw_parts_mut(staging.bufs[i], chunk.len()) };
            pinned
                .par_chunks_mut(1 << 20)
                .zip(chunk.par_chunks(1 << 20))
                .for_each(|(d, s)| d.copy_from_slice(s));
            // SAFETY: the destination range was allocated by the caller for `src.len()` bytes at
            // `dst`; the source is pinned memory kept alive (and unwritten) until the event below
            // has completed.
            unsafe { result::memcpy_htod_async(dst + offset as u64, &*pinned, stream.cu_stream()) }
                .map_err(|e| device_error("copying weights to the device", e))?;
            staging.events[i]
                .record(stream)
                .map_err(|e| device_error("recording an upload", e))?;
            offset += chunk.len();
        }
        Ok(())
    }

    /// Make this GPU's context current on the calling thread.
    pub fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| device_error("binding the context", e))
    }
}

/// Bytes per pinned staging buffer (two of them).
const STAGE_BYTES: usize = 16 << 20;

/// Two pinned host buffers and the events that say when their last transfer finished.
struct Staging {
    bufs: [*mut u8; 2],
    events: [CudaEvent; 2],
    next: usize,
}

// SAFETY: the raw pointers are pinned host allocations owned by this value, used only under the
// Gpu's staging mutex.
unsafe impl Send for Staging {}

impl Staging {
    fn new(ctx: &Arc<CudaContext>) -> Result<Staging> {
        let event = || {
            ctx.new_event(None)
                .map_err(|e| device_error("creating an event", e))
        };
        let events = [event()?, event()?];
        let mut bufs = [std::ptr::null_mut(); 2];
        for buf in bufs.iter_mut() {
            // SAFETY: plain pinned host allocation; freed in Drop.
            match unsafe { result::malloc_host(STAGE_BYTES, 0) } {
                Ok(p) => *buf = p as *mut u8,
                Err(e) => {
                    for b in bufs.iter().filter(|b| !b.is_null()) {
                        // SAFETY: allocated just above by cuMemHostAlloc.
                        let _ = unsafe { result::free_host(*b as *mut c_void) };
                    }
                    return Err(Error::OutOfMemory {
                        bytes: STAGE_BYTES,
                        what: format!("pinned upload staging ({e})"),
                    });
                }
            }
        }
        Ok(Staging {
            bufs,
            events,
            next: 0,
        })
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        for (buf, event) in self.bufs.iter().zip(&self.events) {
            let _ = event.synchronize();
            // SAFETY: allocated by cuMemHostAlloc in Staging::new, freed once, after its last
            // transfer completed.
            let _ = unsafe { result::free_host(*buf as *mut c_void) };
        }
    }
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
    /// `bytes` of uninitialized device memory; failure is `Error::OutOfMemory` naming the size.
    pub(crate) fn alloc(gpu: &Gpu, bytes: usize, what: &str) -> Result<DevBuf> {
        gpu.bind()?;
        // Round up so that 16-byte vector accesses at the end of a buffer stay inside it.
        let size = bytes.max(16).div_ceil(256) * 256;
        // SAFETY: plain cuMemAlloc with the context current; the pointer is owned by the DevBuf.
        match unsafe { result::malloc_sync(size) } {
            Ok(ptr) => Ok(DevBuf {
                ptr,
                bytes: size,
                ctx: gpu.ctx.clone(),
            }),
            Err(DriverError(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY)) => {
                let free = gpu.ctx.mem_get_info().map(|(free, _)| free).unwrap_or(0);
                Err(Error::OutOfMemory {
                    bytes: size,
                    what: format!("{what} on cuda:{} ({free} bytes free)", gpu.ordinal),
                })
            }
            Err(e) => Err(device_error(
                &format!("allocating {size} bytes for {what}"),
                e,
            )),
        }
    }

    /// Like [`DevBuf::alloc`], then zero-filled.
    pub(crate) fn zeroed(gpu: &Gpu, bytes: usize, what: &str) -> Result<DevBuf> {
        let buf = DevBuf::alloc(gpu, bytes, what)?;
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
    F(f32),
}

impl Arg {
    pub fn usize(v: usize) -> Arg {
        Arg::I(i32::try_from(v).expect("kernel argument exceeds i32"))
    }
}

pub(crate) const MAX_ARGS: usize = 16;

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
    for (slot, arg) in slots.iter_mut().zip(args) {
        *slot = match *arg {
            Arg::P(p) => p,
            Arg::I(v) => v as u32 as u64,
            Arg::F(v) => v.to_bits() as u64,
        };
    }
    let mut params = [std::ptr::null_mut::<c_void>(); MAX_ARGS];
    for (param, slot) in params.iter_mut().zip(slots.iter_mut()) {
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
