//! cuBLAS, loaded at run time like the driver and NVRTC: one handle per backend (its stream, its
//! own workspace), used for the FP16 GEMMs of the opt-in FP16 body cache ([`super::fp16_body`]).

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::sys as cublas;

use super::driver::DevBuf;
use super::gpu::Gpu;
use super::kernels::{dlopen_global, library_dirs};
use crate::error::{Error, Result};

/// Workspace handed to cuBLAS (NVIDIA's recommendation for Hopper), so that it allocates nothing
/// behind our memory accounting and never during stream capture.
pub(super) const WORKSPACE_BYTES: usize = 32 << 20;

/// Make sure cuBLAS (`libcublas.so.13`) can be loaded, searching beyond the default library path
/// like NVRTC (`TINYLOOP_CUBLAS` names its folder).
pub(super) fn load() -> Result<()> {
    // SAFETY: only tries to dlopen the library by its usual names.
    if unsafe { cublas::is_culib_present() } {
        return Ok(());
    }
    for dir in library_dirs("TINYLOOP_CUBLAS") {
        let lib = dir.join("libcublas.so.13");
        if !lib.is_file() {
            continue;
        }
        // libcublas needs libcublasLt from the same folder; load it by path first.
        dlopen_global(&dir.join("libcublasLt.so.13"));
        dlopen_global(&lib);
        // SAFETY: as above.
        if unsafe { cublas::is_culib_present() } {
            return Ok(());
        }
    }
    Err(Error::Device(
        "the FP16 body cache needs cuBLAS (libcublas.so.13), which was not found; set \
         TINYLOOP_CUBLAS to its folder or turn the FP16 body off"
            .into(),
    ))
}

fn check(what: &str, status: cublas::cublasStatus_t) -> Result<()> {
    match status {
        cublas::cublasStatus_t::CUBLAS_STATUS_SUCCESS => Ok(()),
        e => Err(Error::Device(format!("cuBLAS {what}: {e:?}"))),
    }
}

/// A cuBLAS handle bound to one stream, with its workspace.
pub(super) struct Blas {
    handle: cublas::cublasHandle_t,
    workspace: DevBuf,
    gpu: Arc<Gpu>,
}

// SAFETY: the handle is used only by the backend that owns it, which one thread uses at a time
// (a session is used by one thread at a time); cuBLAS handles may move between threads.
unsafe impl Send for Blas {}
// SAFETY: as above; no method mutates shared state without the owning backend's exclusive use.
unsafe impl Sync for Blas {}

/// The element type of a GEMM's output.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Output {
    F32,
    F16,
}

impl Blas {
    /// A handle issuing work to `stream` of `gpu`'s context (cuBLAS must be loaded: [`load`]).
    pub(super) fn new(gpu: &Arc<Gpu>, stream: cudarc::driver::sys::CUstream) -> Result<Blas> {
        load()?;
        gpu.bind()?;
        let workspace = gpu.alloc(WORKSPACE_BYTES, "the cuBLAS workspace")?;
        let mut handle: cublas::cublasHandle_t = std::ptr::null_mut();
        // SAFETY: the library is loaded and the context current; `handle` is a valid out-pointer.
        check("cublasCreate", unsafe {
            cublas::cublasCreate_v2(&mut handle)
        })?;
        let blas = Blas {
            handle,
            workspace,
            gpu: gpu.clone(),
        };
        // SAFETY: a live handle; the stream and workspace outlive it (the backend owns all three
        // and drops the handle first, see Drop).
        unsafe {
            check(
                "cublasSetStream",
                cublas::cublasSetStream_v2(blas.handle, stream as cublas::cudaStream_t),
            )?;
            check(
                "cublasSetWorkspace",
                cublas::cublasSetWorkspace_v2(
                    blas.handle,
                    blas.workspace.ptr as *mut c_void,
                    blas.workspace.bytes,
                ),
            )?;
            // f32 output, so no reduction may happen in f16 either way; say so explicitly.
            check(
                "cublasSetMathMode",
                cublas::cublasSetMathMode(
                    blas.handle,
                    cublas::cublasMath_t::CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION,
                ),
            )?;
        }
        Ok(blas)
    }

    pub(super) fn workspace_bytes(&self) -> usize {
        self.workspace.bytes
    }

    /// `out[r][c] (+)= Σₖ x[r][k] · w[c][k]` for `rows` rows: x `[rows, k]` f16, w `[n, k]` f16
    /// (row-major), out `[rows, n]` of `out_type`; products of f16 values accumulated in f32,
    /// rounded once to the output's type.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gemm_f16(
        &self,
        x: u64,
        rows: usize,
        k: usize,
        w: u64,
        n: usize,
        (out, out_type): (u64, Output),
        accumulate: bool,
    ) -> Result<()> {
        let dim = |v: usize, what: &str| {
            i32::try_from(v).map_err(|_| Error::Device(format!("cuBLAS GEMM {what} {v} too large")))
        };
        let (m, nn, kk) = (dim(n, "N")?, dim(rows, "M")?, dim(k, "K")?);
        let (alpha, beta) = (1f32, if accumulate { 1f32 } else { 0f32 });
        // Column-major view: outᵀ [n, rows] = w [k, n]ᵀ · xᵀ [k, rows].
        // SAFETY: the pointers are live device buffers of the sizes above (the caller's
        // contract); alpha and beta are host f32 values (the handle's default pointer mode).
        let status = unsafe {
            cublas::cublasGemmEx(
                self.handle,
                cublas::cublasOperation_t::CUBLAS_OP_T,
                cublas::cublasOperation_t::CUBLAS_OP_N,
                m,
                nn,
                kk,
                &alpha as *const f32 as *const c_void,
                w as *const c_void,
                cublas::cudaDataType::CUDA_R_16F,
                kk,
                x as *const c_void,
                cublas::cudaDataType::CUDA_R_16F,
                kk,
                &beta as *const f32 as *const c_void,
                out as *mut c_void,
                match out_type {
                    Output::F32 => cublas::cudaDataType::CUDA_R_32F,
                    Output::F16 => cublas::cudaDataType::CUDA_R_16F,
                },
                m,
                cublas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        check("cublasGemmEx", status)
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // cuBLAS releases the handle in its context; without it the handle leaks, harmlessly.
        if self.gpu.bind().is_ok() {
            // SAFETY: a live handle, destroyed once; the workspace is freed after it.
            unsafe {
                cublas::cublasDestroy_v2(self.handle);
            }
        }
    }
}
