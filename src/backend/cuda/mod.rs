//! The CUDA backend: every op of the forward pass on the GPU.
//!
//! * cudarc with dynamic loading: the build needs no CUDA toolkit, and the same binary runs on a
//!   machine without a GPU (where [`CudaBackend::open`] fails cleanly and `auto` picks the CPU).
//! * Kernels (`cuda/*.cu`) are compiled by NVRTC for the device at first use and cached on disk
//!   ([`kernels`]). They include no CUDA header.
//! * One [`CudaBackend`] per session, each with its own stream; the model's weights are shared.
//!   Ops only enqueue work: nothing in a forward pass waits for the device. Launch failures are
//!   remembered and returned by the next call that returns a `Result`.
//! * A decode step is captured once per loop count as a CUDA graph and replayed
//!   ([`Backend::graph_begin`]): kernels read the token and position from the step block in
//!   device memory, which `set_step` fills before each replay.
//! * Numerics follow the contract in docs/FORMAT.md: f32 residual stream, f16 inputs of every
//!   linear layer, quantized weights applied as `scale · q + zero` with f32 accumulation. The
//!   tensor-core prefill GEMM multiplies the integer codes (exact in f16) and applies scale and
//!   zero in f32 per group, so no weight is rounded to f16 on any path but the opt-in FP16 body
//!   cache's (`fp16_body`: an FP16 copy of the block weights for cuBLAS prefill GEMMs).
//!
//! Modules, one job each: `driver` (driver calls, device memory, launches), `gpu` (the
//! process-wide context, properties and kernels), `kernels` (NVRTC and the kernel cache),
//! `linear` (weights, GEMV, GEMM), `attention` (KV cache and attention), `step` (the step block
//! and token choice), `graph` (decode graphs), `blas` (cuBLAS), `fp16_body` (the FP16 body
//! cache).

mod attention;
mod blas;
mod driver;
mod flash;
pub mod fp16_body;
mod gpu;
mod graph;
pub(crate) mod kernels;
mod linear;
mod step;
mod tuning;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{result, sys, CudaStream};
use half::f16;

use super::{Backend, HostLinear, NormLayer, OwnedLinear, PooledRows, Residual, StepInput};
use crate::env::Vars;
use crate::error::{Error, Result};
use crate::format::DType;
use crate::kv::{KvCache, KvSlot, TierBounds, TierMove};
use crate::model::architecture::BlockNorms;
use crate::model::config::{ModelConfig, NormKind};
use crate::model::weights::Weights;
use attention::{MAX_HEAD_DIM, MAX_SPLITS, SPLIT_ROWS};
use driver::{device_error, launch, Arg};
use gpu::{Gpu, KernelLoad};
use kernels::KernelOptions;
use tuning::Tuning;

pub use attention::CudaKv;
pub use driver::DevBuf;
pub use linear::{CudaLinear, CudaVector};
pub use step::CudaStep;

// Byte offsets in a backend's scratch buffer (zero-initialized; the tickets return to zero after
// every launch that uses them).
const SCRATCH_ENTROPY_TICKET: usize = 8;
/// A ticket per row of an argmax launch whose rows split across blocks (ARGMAX_BLOCKS / 2 words).
const SCRATCH_ARGMAX_TICKETS: usize = 512;
const SCRATCH_ARGMAX_VALUES: usize = SCRATCH_ARGMAX_TICKETS + 4 * ARGMAX_BLOCKS / 2;
const SCRATCH_ARGMAX_INDICES: usize = SCRATCH_ARGMAX_VALUES + 4 * ARGMAX_BLOCKS;
/// Three f32 partials (max, S, T) per block of the entropy kernel.
const SCRATCH_ENTROPY_PARTS: usize = SCRATCH_ARGMAX_INDICES + 4 * ARGMAX_BLOCKS;
const SCRATCH_TICKETS: usize = SCRATCH_ENTROPY_PARTS + 3 * 4 * ARGMAX_BLOCKS;
/// Most blocks of the argmax and entropy kernels (one candidate each in the scratch buffer):
/// enough that an engine's step of 256 rows gives each row's 50k logits eight blocks.
const ARGMAX_BLOCKS: usize = 2048;
/// Floats of per-segment sums a session's products may split into (4 MiB: 16 rows of an
/// 8192-wide product over K = 2048); a product that needs more takes an unsplit kernel. An
/// engine's backend holds enough for every block product of its largest step
/// (`kernels::split_parts_per_row`), up to 256 MiB.
const SESSION_GEMM_PARTS: usize = 1 << 20;
const ENGINE_GEMM_PARTS: usize = 1 << 26;

/// Whether the CUDA driver library is present and reports at least one device (cheap; creates no
/// context). Used by tests and the CLI to decide whether to run CUDA work.
pub fn available() -> std::result::Result<usize, String> {
    if !driver::driver_present() {
        return Err("the CUDA driver library (libcuda.so) was not found".into());
    }
    result::init().map_err(|e| format!("cuInit failed: {e}"))?;
    match result::device::get_count() {
        Ok(n) if n > 0 => Ok(n as usize),
        Ok(_) => Err("no CUDA device is visible".into()),
        Err(e) => Err(format!("cuDeviceGetCount failed: {e}")),
    }
}

/// The CUDA op set on one GPU, issuing work to one stream.
pub struct CudaBackend {
    gpu: Arc<Gpu>,
    /// The model has an FP16 body cache: sessions made from this backend get `blas`.
    fp16_body: bool,
    /// cuBLAS on `stream`, in sessions of a model with an FP16 body cache (dropped before the
    /// stream).
    blas: Option<Box<blas::Blas>>,
    stream: Arc<CudaStream>,
    /// Argmax slots and, for sessions, the attention tickets and split partials (SCRATCH_*).
    scratch: DevBuf,
    split_floats: usize,
    /// Heads and head dimension of the session's model (none for a model's own backend), which
    /// size the per-step scratch of multi-row attention.
    attention_heads: Option<(usize, usize)>,
    /// Byte offset of the attention split partials in `scratch`.
    partial_offset: usize,
    /// An engine's backend: rows of a step are computed alike whatever runs with them.
    invariant: Option<RowInvariant>,
    /// The rows of the call whose steps run now ([`Backend::set_call_rows`]; 0: none).
    call_rows: AtomicUsize,
    /// The first launch failure since the last call that returned a `Result`.
    error: Mutex<Option<String>>,
    tuning: Tuning,
    /// Launch kernels with programmatic dependent launch (sm_90+ and `tuning.pdl`;
    /// driver::launch).
    overlap: bool,
    load: KernelLoad,
}

/// How an engine's backend keeps each row's result independent of the other rows of its step, so
/// that a request's tokens never depend on the batch: products take the tensor-core GEMM at every
/// row count (its sums are ordered alike in every tiling; the GEMV's are not), without the FP16
/// body cache's cuBLAS (which picks algorithms by shape), and attention splits a row's positions
/// in slices of `span` (a row's splits then depend on its position only).
#[derive(Clone, Copy, Debug)]
struct RowInvariant {
    span: usize,
}

impl RowInvariant {
    /// Slices of at least 128 positions (one pass of the attention kernel's four warps), at most
    /// MAX_SPLITS of them for `max_positions`.
    fn for_positions(max_positions: usize) -> RowInvariant {
        let span = max_positions
            .div_ceil(MAX_SPLITS)
            .next_multiple_of(32)
            .max(128);
        RowInvariant { span }
    }
}

fn blocks_for(len: usize, threads: usize) -> u32 {
    len.div_ceil(threads).clamp(1, 4096) as u32
}

/// Byte offset in a backend's scratch of the per-segment sums of split products
/// (`kernels::SplitGemmPlan`): after the attention split partials.
fn gemm_parts_at(partial_offset: usize, split_floats: usize) -> usize {
    (partial_offset + split_floats * 4).div_ceil(256) * 256
}

impl CudaBackend {
    /// Open GPU `ordinal` (context and kernels are created once per process and shared), tuned
    /// by the CUDA variables of the process environment. A bad value of one of them is an
    /// invalid-argument error naming it, checked before the GPU is touched.
    pub fn open(ordinal: usize) -> Result<CudaBackend> {
        let tuning = Tuning::from_vars(Vars::process())?;
        let kernel_options = KernelOptions::from_vars(Vars::process())?;
        // cudarc panics when a driver symbol is missing (a driver older than the bindings).
        let opened = std::panic::catch_unwind(|| {
            let (gpu, load) = Gpu::get(ordinal, &kernel_options)?;
            CudaBackend::with_gpu(gpu, load, tuning, 0, 0, SESSION_GEMM_PARTS)
        });
        opened.unwrap_or_else(|panic| {
            let msg = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            Err(Error::Device(format!("CUDA initialization failed: {msg}")))
        })
    }

    fn with_gpu(
        gpu: Arc<Gpu>,
        load: KernelLoad,
        tuning: Tuning,
        split_floats: usize,
        tickets: usize,
        gemm_parts_floats: usize,
    ) -> Result<CudaBackend> {
        gpu.bind()?;
        let stream = gpu
            .ctx
            .new_stream()
            .map_err(|e| device_error("creating a stream", e))?;
        let partial_offset = (SCRATCH_TICKETS + tickets * 4).div_ceil(256) * 256;
        let bytes = gemm_parts_at(partial_offset, split_floats) + gemm_parts_floats * 4;
        let scratch = gpu.zeroed(bytes, "attention and product scratch")?;
        let overlap = gpu.arch.0 >= 9 && tuning.pdl;
        Ok(CudaBackend {
            gpu,
            fp16_body: false,
            blas: None,
            stream,
            scratch,
            split_floats,
            attention_heads: None,
            partial_offset,
            invariant: None,
            call_rows: AtomicUsize::new(0),
            error: Mutex::new(None),
            tuning,
            overlap,
            load,
        })
    }

    /// The rows whose kernels a step of `rows` rows takes: those of its whole call when that has
    /// more ([`Backend::set_call_rows`]).
    fn kernel_rows(&self, rows: usize) -> usize {
        rows.max(self.call_rows.load(Ordering::Relaxed))
    }

    /// The device address of the per-segment sums of split products, and how many floats fit.
    fn gemm_parts(&self) -> (u64, usize) {
        let at = gemm_parts_at(self.partial_offset, self.split_floats);
        (self.scratch.ptr + at as u64, (self.scratch.bytes - at) / 4)
    }

    /// A backend on the same GPU and kernels with its own stream and scratch (attention split
    /// partials and tickets, and the partial sums of split products).
    fn sibling(
        &self,
        split_floats: usize,
        tickets: usize,
        gemm_parts: usize,
    ) -> Result<CudaBackend> {
        let load = KernelLoad {
            note: String::new(),
            ms: 0.0,
        };
        let gpu = self.gpu.clone();
        CudaBackend::with_gpu(gpu, load, self.tuning, split_floats, tickets, gemm_parts)
    }

    /// A backend for one session of a model with `config`: same GPU and kernels, its own stream
    /// and attention scratch.
    pub fn session(&self, config: &ModelConfig) -> Result<CudaBackend> {
        let hd = config.head_dim();
        if hd > MAX_HEAD_DIM {
            return Err(Error::Device(format!(
                "head_dim {hd} exceeds the CUDA attention kernel's limit of {MAX_HEAD_DIM}"
            )));
        }
        let split_floats = SPLIT_ROWS * config.n_heads * MAX_SPLITS * (hd + 2);
        let tickets = SPLIT_ROWS * config.n_heads;
        let mut backend = self.sibling(split_floats, tickets, SESSION_GEMM_PARTS)?;
        backend.attention_heads = Some((config.n_heads, hd));
        if self.fp16_body {
            backend.blas = Some(Box::new(backend.new_blas()?));
            backend.fp16_body = true; // its re-packed and restored loop bodies get copies too
        }
        Ok(backend)
    }

    /// A backend for a continuous-batching engine over a model with `config`: its own stream,
    /// attention scratch for steps of up to `max_rows` rows of sequences of up to
    /// `max_positions` positions, and row-invariant kernels ([`RowInvariant`]).
    pub fn engine(
        &self,
        config: &ModelConfig,
        max_rows: usize,
        max_positions: usize,
    ) -> Result<CudaBackend> {
        let hd = config.head_dim();
        if hd > MAX_HEAD_DIM {
            return Err(Error::Device(format!(
                "head_dim {hd} exceeds the CUDA attention kernel's limit of {MAX_HEAD_DIM}"
            )));
        }
        let invariant = RowInvariant::for_positions(max_positions);
        let tickets = max_rows * config.n_heads;
        let split_floats = tickets * max_positions.div_ceil(invariant.span) * (hd + 2);
        let gemm_parts = (max_rows * kernels::split_parts_per_row(config)).min(ENGINE_GEMM_PARTS);
        let mut backend = self.sibling(split_floats, tickets, gemm_parts)?;
        backend.invariant = Some(invariant);
        Ok(backend)
    }

    /// How this open obtained the kernels, and how long it took.
    pub fn kernel_load(&self) -> (&str, f64) {
        (&self.load.note, self.load.ms)
    }

    /// Read `len` f16 values at `offset` of an f16 buffer, widened to f32 (tests, debugging).
    pub fn read_half(&self, x: &DevBuf, offset: usize, len: usize) -> Result<Vec<f32>> {
        assert!(
            (offset + len) * 2 <= x.bytes,
            "read past the end of a device buffer"
        );
        self.check()?;
        let mut raw = vec![0u16; len];
        self.gpu.bind()?;
        // SAFETY: the source range lies inside `x` (asserted); `raw` holds `len` values.
        unsafe {
            result::memcpy_dtoh_async(
                &mut raw,
                x.ptr + (offset * 2) as u64,
                self.stream.cu_stream(),
            )
        }
        .map_err(|e| device_error("copying to the host", e))?;
        self.sync()?;
        Ok(raw
            .into_iter()
            .map(|h| f16::from_bits(h).to_f32())
            .collect())
    }

    /// Copy `len` bytes at `offset` of `buf` to the host (waits for the device).
    fn download(&self, buf: &DevBuf, offset: usize, len: usize) -> Result<Vec<u8>> {
        assert!(
            offset + len <= buf.bytes,
            "download past the end of a device buffer"
        );
        self.check()?;
        let mut raw = vec![0u8; len];
        if len == 0 {
            return Ok(raw);
        }
        self.gpu.bind()?;
        // SAFETY: the source range lies inside `buf` (asserted); `raw` holds `len` bytes; the
        // copy is stream-ordered after the work that wrote `buf`, and we wait for it below.
        unsafe {
            result::memcpy_dtoh_async(&mut raw, buf.ptr + offset as u64, self.stream.cu_stream())
        }
        .map_err(|e| device_error("copying to the host", e))?;
        self.sync()?;
        Ok(raw)
    }

    /// Device memory held by this backend instance itself (scratch).
    pub fn own_bytes(&self) -> usize {
        self.scratch.bytes + self.blas.as_ref().map_or(0, |b| b.workspace_bytes())
    }

    pub fn l2_bytes(&self) -> usize {
        self.gpu.l2_bytes
    }

    /// After `Weights::load`: wait for the uploads and describe how the loop body (kept
    /// L2-resident, `prepare_block_weight`) fits the L2.
    pub fn finish_load(&self, weights: &Weights<CudaBackend>) -> Result<String> {
        self.sync()?;
        let body_bytes = weights.body.live_bytes();
        let l2 = self.gpu.l2_bytes;
        Ok(format!(
            "loop body {:.1} MB vs L2 {:.1} MB ({})",
            body_bytes as f64 / 1e6,
            l2 as f64 / 1e6,
            if body_bytes <= l2 {
                "fits: re-reads after the first iteration can hit L2"
            } else {
                "does not fit: every iteration streams from memory"
            }
        ))
    }

    /// Remember a failed launch of `what` (the first since the last check wins).
    pub(super) fn record(
        &self,
        what: &str,
        r: std::result::Result<(), cudarc::driver::DriverError>,
    ) {
        if let Err(e) = r {
            self.remember(format!("{what}: {e}"));
        }
    }

    fn remember(&self, message: String) {
        let mut slot = self.error.lock().unwrap_or_else(|p| p.into_inner());
        slot.get_or_insert(message);
    }

    /// Return (and clear) the first launch failure since the last check.
    pub(super) fn check(&self) -> Result<()> {
        let taken = self.error.lock().unwrap_or_else(|p| p.into_inner()).take();
        match taken {
            Some(msg) => Err(Error::Device(msg)),
            None => Ok(()),
        }
    }

    pub(super) fn sync(&self) -> Result<()> {
        self.gpu.bind()?;
        self.stream
            .synchronize()
            .map_err(|e| device_error("synchronizing the stream", e))?;
        self.check()
    }

    pub(super) fn run(
        &self,
        what: &str,
        f: sys::CUfunction,
        grid: (u32, u32, u32),
        block: u32,
        smem: usize,
        args: &[Arg],
    ) {
        let r = self.gpu.ctx.bind_to_thread().and_then(|_| {
            let stream = self.stream.cu_stream();
            launch(f, grid, block, smem as u32, stream, args, self.overlap)
        });
        self.record(what, r);
    }

    /// Copy `bytes` bytes between device addresses, in stream order.
    fn copy_device(&self, src: u64, dst: u64, bytes: usize, what: &str) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.gpu.bind()?;
        // SAFETY: the callers check that both ranges lie inside live allocations; the copy is
        // ordered on our stream after the work that wrote `src` and before later uses of `dst`.
        unsafe { result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }
            .map_err(|e| device_error(what, e))
    }

    /// Copy host bytes to `offset` of `buf`, in stream order. Through the pinned staging buffers
    /// unless `tuning.plain_upload` (one synchronous pageable copy per call).
    fn upload(&self, buf: &DevBuf, offset: usize, bytes: &[u8]) -> Result<()> {
        assert!(
            offset + bytes.len() <= buf.bytes,
            "upload past the end of a device buffer"
        );
        if self.tuning.plain_upload {
            self.sync()?;
            return buf.upload(offset, bytes);
        }
        self.gpu
            .upload_staged(buf.ptr + offset as u64, bytes, &self.stream)
    }

    /// Normalize `rows` rows of `x` into f16 `out`.
    pub(super) fn norm_rows(
        &self,
        norm: &NormLayer<CudaVector>,
        x: &DevBuf,
        rows: usize,
        out: &mut DevBuf,
    ) {
        let d = norm.weight.len;
        // Four values per thread in registers when d is a multiple of 4 (up to 8 per thread).
        let threads = if d.is_multiple_of(4) {
            (d / 4).div_ceil(32).clamp(1, 32) * 32
        } else {
            d.min(256).div_ceil(32) * 32
        };
        let [kind, eps, weight, bias, has_bias] = norm_kernel_args(norm);
        self.run(
            "norm_rows",
            self.gpu.kernels.norm_rows,
            (rows as u32, 1, 1),
            threads as u32,
            d * 4,
            &[
                Arg::P(x.ptr),
                Arg::usize(d),
                kind,
                eps,
                weight,
                bias,
                has_bias,
                Arg::P(out.ptr),
            ],
        );
    }
}

impl CudaBackend {
    /// `norm_state_rows` in `mode` (cuda/elementwise.cu) over `rows` rows from `x` into `out`
    /// (may be `x`), reading the rows at `delta` in modes 1 and 2, then normalized again by
    /// `then` when given.
    fn norm_state_rows(
        &self,
        norm: &NormLayer<CudaVector>,
        (x, out): (u64, u64),
        delta: u64,
        rows: usize,
        mode: i32,
        then: Option<&NormLayer<CudaVector>>,
    ) {
        let d = norm.weight.len;
        let [k1, e1, w1, b1, h1] = norm_kernel_args(norm);
        let none = [Arg::I(0), Arg::F(0.0), Arg::P(0), Arg::P(0), Arg::I(0)];
        let [k2, e2, w2, b2, h2] = then.map_or(none, norm_kernel_args);
        self.run(
            "norm_state_rows",
            self.gpu.kernels.norm_state_rows,
            (rows as u32, 1, 1),
            d.min(256).div_ceil(32) as u32 * 32,
            d * 4,
            &[
                Arg::P(x),
                Arg::P(out),
                Arg::P(delta),
                Arg::I(mode),
                Arg::usize(d),
                k1,
                e1,
                w1,
                b1,
                h1,
                k2,
                e2,
                w2,
                b2,
                h2,
            ],
        );
    }
}

/// A norm's kernel arguments: LayerNorm or not, eps, weight, bias (the weight when there is
/// none) and whether there is one.
fn norm_kernel_args(norm: &NormLayer<CudaVector>) -> [Arg; 5] {
    [
        Arg::I((norm.kind == NormKind::LayerNorm) as i32),
        Arg::F(norm.eps),
        Arg::P(norm.weight.buf.ptr),
        Arg::P(norm.bias.map_or(norm.weight.buf.ptr, |b| b.buf.ptr)),
        Arg::I(norm.bias.is_some() as i32),
    ]
}

/// The `norm_state_rows` mode (and GEMV residual mode) of a pending sublayer output.
fn residual_mode(layout: BlockNorms) -> i32 {
    match layout {
        BlockNorms::Pre => unreachable!("pre-norm blocks have no output norm"),
        BlockNorms::Sandwich => 1,
        BlockNorms::SandwichResidual => 2,
    }
}

impl Backend for CudaBackend {
    type Float = DevBuf;
    type Half = DevBuf;
    type Linear = CudaLinear;
    type Vector = CudaVector;
    type Step = CudaStep;
    type KvStorage = CudaKv;

    fn describe(&self) -> String {
        let g = &self.gpu;
        format!(
            "cuda:{} ({}, sm_{}{}, {} SMs, {:.0} MB L2)",
            g.ordinal,
            g.name,
            g.arch.0,
            g.arch.1,
            g.sms,
            g.l2_bytes as f64 / 1e6
        )
    }

    fn upload_linear(&self, w: &HostLinear) -> Result<CudaLinear> {
        self.upload_weight(w)
    }

    fn upload_vector(&self, values: &[f16]) -> Result<CudaVector> {
        let buf = self.gpu.alloc(values.len() * 2, "a norm parameter")?;
        let bytes = crate::model::quant::f16_to_bytes(values);
        self.upload(&buf, 0, &bytes)?;
        Ok(CudaVector {
            buf,
            len: values.len(),
        })
    }

    fn alloc_float(&self, len: usize) -> Result<DevBuf> {
        self.gpu.zeroed(len * 4, "f32 activations")
    }

    fn alloc_half(&self, len: usize) -> Result<DevBuf> {
        self.gpu.zeroed(len * 2, "f16 activations")
    }

    fn alloc_step(&self, max_rows: usize) -> Result<CudaStep> {
        self.new_step(max_rows)
    }

    fn alloc_kv(&self, bytes: usize) -> Result<CudaKv> {
        self.new_kv(bytes)
    }

    fn copy_kv(
        &self,
        from: &CudaKv,
        from_offset: usize,
        to: &mut CudaKv,
        to_offset: usize,
        bytes: usize,
    ) -> Result<()> {
        self.copy_kv_bytes(from, from_offset, to, to_offset, bytes)
    }

    fn kv_write(&self, storage: &mut CudaKv, offset: usize, bytes: &[u8]) -> Result<()> {
        self.write_kv_bytes(storage, offset, bytes)
    }

    fn copy_rows(
        &self,
        from: &DevBuf,
        from_row: usize,
        to: &mut DevBuf,
        to_row: usize,
        rows: usize,
        width: usize,
    ) {
        let bytes = rows * width * 4;
        assert!(
            (from_row * width * 4) + bytes <= from.bytes
                && (to_row * width * 4) + bytes <= to.bytes,
            "row copy past a buffer"
        );
        let src = from.ptr + (from_row * width * 4) as u64;
        let dst = to.ptr + (to_row * width * 4) as u64;
        if let Err(e) = self.copy_device(src, dst, bytes, "copying rows") {
            self.remember(e.to_string());
        }
    }

    fn linear_bytes(&self, w: &CudaLinear) -> usize {
        w.buf.bytes + w.fp16.get().map_or(0, |copy| copy.bytes)
    }

    fn linear_dtype(&self, w: &CudaLinear) -> DType {
        CudaBackend::dtype_of(w)
    }

    fn requantize_linear(&self, w: &CudaLinear, dtype: DType) -> Result<CudaLinear> {
        self.requantize_weight(w, dtype)
    }

    fn download_linear(&self, w: &CudaLinear) -> Result<OwnedLinear> {
        self.download_weight(w)
    }

    // The loop body is re-read at every iteration: plain loads keep it in L2, while every other
    // weight is streamed with evict-first loads.
    fn prepare_block_weight(&self, w: &CudaLinear, looped: bool) -> Result<()> {
        if looped {
            w.streamed.store(false, Ordering::Relaxed);
        }
        if self.fp16_body {
            self.attach_fp16_copy(w)?;
        }
        Ok(())
    }

    fn kv_bytes(&self, kv: &CudaKv) -> usize {
        kv.bytes()
    }

    fn set_call_rows(&self, rows: usize) -> usize {
        self.call_rows.swap(rows, Ordering::Relaxed)
    }

    fn set_step(&self, step: &mut CudaStep, input: StepInput, tiers: TierBounds) -> Result<()> {
        self.stage_step(step, input, tiers)
    }

    fn set_places(&self, step: &mut CudaStep, places: PooledRows) -> Result<u64> {
        self.stage_places(step, places)
    }

    fn embed(&self, table: &CudaLinear, step: &CudaStep, out: &mut DevBuf) {
        self.run(
            "embed_f32",
            self.gpu.kernels.embed_f32,
            (step.rows.max(1) as u32, table.cols.div_ceil(256) as u32, 1),
            256,
            0,
            &[
                Arg::P(table.ptr()),
                Arg::P(step.buf.ptr),
                Arg::usize(table.rows),
                Arg::usize(table.cols),
                Arg::P(out.ptr),
            ],
        );
    }

    fn embed_half(&self, table: &CudaLinear, step: &CudaStep, out: &mut DevBuf) {
        self.run(
            "embed_f16",
            self.gpu.kernels.embed_f16,
            (step.rows.max(1) as u32, table.cols.div_ceil(256) as u32, 1),
            256,
            0,
            &[
                Arg::P(table.ptr()),
                Arg::P(step.buf.ptr),
                Arg::usize(table.rows),
                Arg::usize(table.cols),
                Arg::P(out.ptr),
            ],
        );
    }

    fn norm(&self, norm: &NormLayer<CudaVector>, x: &DevBuf, rows: usize, out: &mut DevBuf) {
        self.norm_rows(norm, x, rows, out)
    }

    fn linear(
        &self,
        x: &DevBuf,
        first_row: usize,
        rows: usize,
        w: &CudaLinear,
        out: &mut DevBuf,
        accumulate: bool,
    ) {
        let x = x.ptr + (first_row * w.cols * 2) as u64;
        self.matmul(x, rows, w, out.ptr, accumulate);
    }

    fn norm_linear(
        &self,
        norm: &NormLayer<CudaVector>,
        x: &DevBuf,
        rows: usize,
        w: &CudaLinear,
        h: &mut DevBuf,
        out: &mut DevBuf,
    ) {
        self.norm_then_linear(norm, x, None, rows, w, h, out)
    }

    fn norm_mlp_gate_up(
        &self,
        norm: &NormLayer<CudaVector>,
        x: &DevBuf,
        rows: usize,
        gate: &CudaLinear,
        up: &CudaLinear,
        h: &mut DevBuf,
        scratch: (&mut DevBuf, &mut DevBuf),
        out: &mut DevBuf,
    ) {
        self.norm_then_gate_up(norm, x, None, rows, gate, up, h, scratch, out)
    }

    fn mlp_gate_up(
        &self,
        x: &DevBuf,
        rows: usize,
        gate: &CudaLinear,
        up: &CudaLinear,
        gate_buf: &mut DevBuf,
        up_buf: &mut DevBuf,
        out: &mut DevBuf,
    ) {
        self.gate_up(x, rows, gate, up, gate_buf, up_buf, out)
    }

    fn kv_store(
        &self,
        qkv: &mut DevBuf,
        h: &DevBuf,
        step: &CudaStep,
        rows: usize,
        rope: &DevBuf,
        kv: &mut KvCache<CudaKv>,
        at: KvSlot,
    ) {
        self.store_kv(qkv, h, step, rows, rope, kv, at)
    }

    fn attention(
        &self,
        qkv: &DevBuf,
        step: &CudaStep,
        rows: usize,
        kv: &mut KvCache<CudaKv>,
        at: KvSlot,
        qkv_weight: &CudaLinear,
        rope: &DevBuf,
        out: &mut DevBuf,
    ) {
        self.attend_kv(qkv, step, rows, kv, at, qkv_weight, rope, out)
    }

    fn rope_attention(
        &self,
        qkv: &mut DevBuf,
        h: &DevBuf,
        step: &CudaStep,
        rows: usize,
        rope: &DevBuf,
        kv: &mut KvCache<CudaKv>,
        at: KvSlot,
        qkv_weight: &CudaLinear,
        out: &mut DevBuf,
    ) {
        self.store_and_attend(qkv, h, step, rows, rope, kv, at, qkv_weight, out)
    }

    fn kv_move(&self, kv: &mut KvCache<CudaKv>, mv: &TierMove) {
        self.move_kv(kv, mv)
    }

    fn norm_state(&self, norm: &NormLayer<CudaVector>, x: &mut DevBuf, rows: usize) {
        // Mode 0 does not read delta.
        self.norm_state_rows(norm, (x.ptr, x.ptr), x.ptr, rows, 0, None);
    }

    fn residual_norm(&self, residual: &Residual<CudaVector, DevBuf>, rows: usize, x: &mut DevBuf) {
        let mode = residual_mode(residual.layout);
        self.norm_state_rows(
            &residual.norm,
            (x.ptr, x.ptr),
            residual.delta.ptr,
            rows,
            mode,
            None,
        );
    }

    fn residual_norm_state(
        &self,
        residual: &Residual<CudaVector, DevBuf>,
        norm: &NormLayer<CudaVector>,
        x: &mut DevBuf,
        rows: usize,
    ) {
        let mode = residual_mode(residual.layout);
        let delta = residual.delta.ptr;
        self.norm_state_rows(
            &residual.norm,
            (x.ptr, x.ptr),
            delta,
            rows,
            mode,
            Some(norm),
        );
    }

    fn residual_norm_into(
        &self,
        residual: &Residual<CudaVector, DevBuf>,
        x: &DevBuf,
        rows: usize,
        next: &mut DevBuf,
    ) {
        let mode = residual_mode(residual.layout);
        self.norm_state_rows(
            &residual.norm,
            (x.ptr, next.ptr),
            residual.delta.ptr,
            rows,
            mode,
            None,
        );
    }

    fn residual_norm_linear(
        &self,
        residual: &Residual<CudaVector, DevBuf>,
        x: &DevBuf,
        rows: usize,
        next: &mut DevBuf,
        norm: &NormLayer<CudaVector>,
        w: &CudaLinear,
        h: &mut DevBuf,
        out: &mut DevBuf,
    ) {
        self.norm_then_linear(norm, x, Some((residual, next)), rows, w, h, out)
    }

    fn residual_norm_mlp_gate_up(
        &self,
        residual: &Residual<CudaVector, DevBuf>,
        x: &DevBuf,
        rows: usize,
        next: &mut DevBuf,
        norm: &NormLayer<CudaVector>,
        gate: &CudaLinear,
        up: &CudaLinear,
        h: &mut DevBuf,
        scratch: (&mut DevBuf, &mut DevBuf),
        out: &mut DevBuf,
    ) {
        let input = Some((residual, next));
        self.norm_then_gate_up(norm, x, input, rows, gate, up, h, scratch, out)
    }

    fn add_bias(&self, x: &mut DevBuf, rows: usize, bias: &CudaVector) {
        let width = bias.len;
        self.run(
            "add_bias",
            self.gpu.kernels.add_bias,
            (rows as u32, blocks_for(width, 256), 1),
            256,
            0,
            &[Arg::P(x.ptr), Arg::usize(width), Arg::P(bias.buf.ptr)],
        );
    }

    fn kv_copy_within(
        &self,
        kv: &mut KvCache<CudaKv>,
        ranges: &[(usize, usize, usize)],
    ) -> Result<()> {
        self.copy_kv_ranges(&kv.storage, ranges)
    }

    fn scale(&self, x: &mut DevBuf, len: usize, factor: f32) {
        self.run(
            "scale_f32",
            self.gpu.kernels.scale_f32,
            (blocks_for(len, 256), 1, 1),
            256,
            0,
            &[Arg::P(x.ptr), Arg::usize(len), Arg::F(factor)],
        );
    }

    fn to_half(&self, x: &DevBuf, len: usize, out: &mut DevBuf) {
        self.run(
            "to_half",
            self.gpu.kernels.to_half,
            (blocks_for(len, 256), 1, 1),
            256,
            0,
            &[Arg::P(x.ptr), Arg::usize(len), Arg::P(out.ptr)],
        );
    }

    fn synchronize(&self) -> Result<()> {
        self.sync()
    }

    fn read_float_into(&self, x: &DevBuf, offset: usize, out: &mut [f32]) -> Result<()> {
        assert!(
            (offset + out.len()) * 4 <= x.bytes,
            "read past the end of a device buffer"
        );
        self.check()?;
        self.gpu.bind()?;
        // SAFETY: the source range lies inside `x` (asserted) and `out` holds as many values; the
        // copy is stream-ordered after the work that produced `x`, and we wait for it below.
        unsafe {
            result::memcpy_dtoh_async(out, x.ptr + (offset * 4) as u64, self.stream.cu_stream())
        }
        .map_err(|e| device_error("copying to the host", e))?;
        self.sync()
    }

    fn write_float(&self, x: &mut DevBuf, values: &[f32]) -> Result<()> {
        assert!(
            values.len() * 4 <= x.bytes,
            "write past the end of a device buffer"
        );
        self.gpu.bind()?;
        // SAFETY: the destination lies inside `x`; `values` stays borrowed until the sync below.
        unsafe { result::memcpy_htod_async(x.ptr, values, self.stream.cu_stream()) }
            .map_err(|e| device_error("copying to the device", e))?;
        self.sync()
    }

    fn graph_replay(&self, step: &mut CudaStep, key: u64) -> Result<bool> {
        self.replay(step, key)
    }

    fn graph_begin(&self, step: &mut CudaStep, _key: u64) -> Result<bool> {
        self.begin_capture(step)
    }

    fn graph_end(&self, step: &mut CudaStep, key: u64) -> Result<()> {
        self.end_capture(step, key)
    }

    fn graph_reset(&self, step: &mut CudaStep) {
        step.graphs.clear();
    }

    fn choose(&self, logits: &DevBuf, len: usize, step: &mut CudaStep) {
        self.choose_token(logits, len, step)
    }

    fn chosen_token(&self, step: &CudaStep) -> Result<u32> {
        self.read_chosen(step)
    }

    fn argmax_rows(&self, logits: &DevBuf, rows: usize, len: usize, step: &mut CudaStep) {
        self.choose_rows(logits, rows, len, step)
    }

    fn chosen_tokens(&self, step: &CudaStep, rows: usize) -> Result<Vec<u32>> {
        self.read_chosen_rows(step, rows)
    }

    fn entropy_rows(&self, logits: &DevBuf, rows: usize, len: usize, step: &mut CudaStep) {
        self.measure_rows(logits, rows, len, step)
    }

    fn chosen_measured(&self, step: &CudaStep) -> Result<(u32, f32)> {
        self.read_chosen_measured(step)
    }

    fn entropies(&self, step: &CudaStep, rows: usize) -> Result<Vec<f32>> {
        self.read_entropies(step, rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn available_never_panics() {
        let _ = available();
    }
}
