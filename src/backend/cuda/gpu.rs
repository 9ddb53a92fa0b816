//! A GPU as the process sees it: one context per GPU for the whole process (so that opening a
//! second model costs no context creation), its properties, the compiled kernels, pinned staging
//! buffers for weight uploads, and device allocations in its context.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use cudarc::driver::{result, sys, CudaContext, CudaEvent, CudaStream};
use rayon::prelude::*;

use super::driver::{device_error, driver_present, DevBuf};
use super::kernels::{self, KernelOptions, Kernels};
use crate::error::{Error, Result};

/// A GPU: its context, properties, and the compiled kernels.
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
    /// The process-wide handle of GPU `ordinal`, created (context, and kernels loaded as
    /// `kernel_options` say) on first use.
    pub fn get(ordinal: usize, kernel_options: &KernelOptions) -> Result<(Arc<Gpu>, KernelLoad)> {
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
        let (kernels, note) = kernels::load(&ctx, arch, kernel_options)?;
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

    /// `bytes` of uninitialized device memory; failure is `Error::OutOfMemory` naming the size.
    pub fn alloc(&self, bytes: usize, what: &str) -> Result<DevBuf> {
        DevBuf::alloc(&self.ctx, self.ordinal, bytes, what)
    }

    /// Like [`Gpu::alloc`], then zero-filled.
    pub fn zeroed(&self, bytes: usize, what: &str) -> Result<DevBuf> {
        DevBuf::zeroed(&self.ctx, self.ordinal, bytes, what)
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
