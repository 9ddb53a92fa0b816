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
//!   zero in f32 per group, so no weight is rounded to f16 on any path.

mod driver;
pub(crate) mod kernels;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{result, sys, CudaContext, CudaStream};
use half::f16;

use super::{AttentionShape, Backend, Choice, HostLinear, NormLayer, StepInput};
use crate::error::{Error, Result};
use crate::format::DType;
use crate::generate::sampling::inv_temperature;
use crate::model::config::{ModelConfig, NormKind};
use crate::model::weights::Weights;
use driver::{device_error, launch, Arg, Gpu, KernelLoad};

pub use driver::DevBuf;

/// Rows up to which decode attention splits positions across blocks (flash-decoding).
const SPLIT_ROWS: usize = 4;
/// Most position splits per (row, head).
const MAX_SPLITS: usize = 32;
/// Largest head dimension the attention kernel takes.
const MAX_HEAD_DIM: usize = 256;
/// Step block header in i32 words (cuda/common.cuh `STEP_*`): start position, rows, chosen token,
/// then the sampling parameters and draw; the token ids follow.
const STEP_HEADER: usize = 8;
const STEP_RESULT: usize = 2;
/// Threads of the single block of the sampling kernel (cuda/sample.cu).
const SAMPLE_THREADS: u32 = 1024;

// Byte offsets in a backend's scratch buffer (zero-initialized; the tickets return to zero after
// every launch that uses them).
const SCRATCH_ARGMAX_TICKET: usize = 4;
const SCRATCH_ARGMAX_VALUES: usize = 1024;
const SCRATCH_ARGMAX_INDICES: usize = 2048;
const SCRATCH_TICKETS: usize = 3072;
/// Most blocks of the argmax kernel (one candidate each in the scratch buffer).
const ARGMAX_BLOCKS: usize = 256;

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
    stream: Arc<CudaStream>,
    /// Argmax slots and, for sessions, the attention tickets and split partials (SCRATCH_*).
    scratch: DevBuf,
    split_floats: usize,
    /// Byte offset of the attention split partials in `scratch`.
    partial_offset: usize,
    /// The first launch failure since the last call that returned a `Result`.
    error: Mutex<Option<String>>,
    graphs: bool,
    /// Launch kernels with programmatic dependent launch (sm_90+; driver::launch).
    overlap: bool,
    load: KernelLoad,
}

/// A linear weight on the device: codes (or f16 values) at offset 0, then f16 scales and zeros
/// at `params_offset` (the file's layout, with the parameters moved to an aligned offset).
pub struct CudaLinear {
    buf: DevBuf,
    rows: usize,
    cols: usize,
    bits: u32,
    group: usize,
    params_offset: usize,
    /// The shape suits the fast kernels (K and the group size multiples of 32).
    fast: bool,
    /// Threads per output row in the GEMV kernels.
    tpr: u32,
    /// Loads are marked evict-first in L2 (everything but the loop body; see `finish_load`).
    streamed: AtomicBool,
}

impl CudaLinear {
    fn ptr(&self) -> u64 {
        self.buf.ptr
    }
    fn params(&self) -> u64 {
        self.buf.ptr + self.params_offset as u64
    }
    fn bits_index(&self) -> usize {
        kernels::BITS
            .iter()
            .position(|&b| b == self.bits)
            .expect("bits validated at upload")
    }
    fn group_arg(&self) -> usize {
        if self.bits == 16 {
            self.cols
        } else {
            self.group
        }
    }
    /// Dynamic shared memory of the GEMV kernel for `r` rows.
    fn gemv_smem(&self, r: usize) -> usize {
        if self.bits == 16 {
            r * (self.cols / 8) * 12 * 4
        } else {
            r * (self.cols / 32) * 36 * 4
        }
    }
}

/// An f16 parameter vector (norm weight or bias).
pub struct CudaVector {
    buf: DevBuf,
    len: usize,
}

/// The step block of one session: header (start position, rows, chosen token, sampling
/// parameters) and token ids in device memory, plus the decode graphs captured for it.
pub struct CudaStep {
    buf: DevBuf,
    max_rows: usize,
    rows: usize,
    choice: Choice,
    host: Vec<i32>,
    graphs: Vec<(u64, Graph)>,
    /// A capture was begun and not ended (only if a panic cut the ops short): the stream is still
    /// capturing and must be released before anything else runs on it.
    capturing: bool,
}

/// f16 K and V caches: `slots × capacity × kv_dim` each.
pub struct CudaKv {
    k: DevBuf,
    v: DevBuf,
    capacity: usize,
}

struct Graph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    ctx: Arc<CudaContext>,
}

// SAFETY: a graph is used only through the CudaStep that owns it, which a session uses from one
// thread at a time (`&mut` access); the driver allows using graph handles from any thread as long
// as calls on one graph are not concurrent.
unsafe impl Send for Graph {}

impl Drop for Graph {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: both handles were created by this Graph and are destroyed once.
            unsafe {
                let _ = result::graph::exec_destroy(self.exec);
                let _ = result::graph::destroy(self.graph);
            }
        }
    }
}

/// Whether the on/off switch `var` is unset or on.
fn switch_on(var: &str) -> bool {
    !matches!(
        std::env::var(var).as_deref(),
        Ok("0") | Ok("off") | Ok("false")
    )
}

fn blocks_for(len: usize, threads: usize) -> u32 {
    len.div_ceil(threads).clamp(1, 4096) as u32
}

impl CudaBackend {
    /// Open GPU `ordinal` (context and kernels are created once per process and shared).
    pub fn open(ordinal: usize) -> Result<CudaBackend> {
        // cudarc panics when a driver symbol is missing (a driver older than the bindings).
        let opened = std::panic::catch_unwind(|| {
            let (gpu, load) = Gpu::get(ordinal)?;
            CudaBackend::with_gpu(gpu, load, 0, 0)
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
        split_floats: usize,
        tickets: usize,
    ) -> Result<CudaBackend> {
        gpu.bind()?;
        let stream = gpu
            .ctx
            .new_stream()
            .map_err(|e| device_error("creating a stream", e))?;
        let partial_offset = (SCRATCH_TICKETS + tickets * 4).div_ceil(256) * 256;
        let bytes = partial_offset + split_floats * 4;
        let scratch = DevBuf::zeroed(&gpu, bytes, "attention scratch")?;
        let overlap = gpu.arch.0 >= 9 && switch_on("TINYLOOP_CUDA_PDL");
        Ok(CudaBackend {
            gpu,
            stream,
            scratch,
            split_floats,
            partial_offset,
            error: Mutex::new(None),
            graphs: switch_on("TINYLOOP_CUDA_GRAPHS"),
            overlap,
            load,
        })
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
        let load = KernelLoad {
            note: String::new(),
            ms: 0.0,
        };
        let tickets = SPLIT_ROWS * config.n_heads;
        CudaBackend::with_gpu(self.gpu.clone(), load, split_floats, tickets)
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

    /// Device memory held by this backend instance itself (scratch).
    pub fn own_bytes(&self) -> usize {
        self.scratch.bytes
    }

    pub fn l2_bytes(&self) -> usize {
        self.gpu.l2_bytes
    }

    /// After `Weights::load`: wait for the uploads, mark the loop body's weights as L2-resident
    /// (every other weight is streamed with evict-first loads), and describe the L2 fit.
    pub fn finish_load(&self, weights: &Weights<CudaBackend>) -> Result<String> {
        self.sync()?;
        let config = &weights.config;
        let body = &weights.blocks[config.n_pre_blocks..config.n_pre_blocks + config.n_loop_blocks];
        let mut body_bytes = 0usize;
        for block in body {
            for w in [
                &block.attn_qkv,
                &block.attn_out,
                &block.mlp_gate,
                &block.mlp_up,
                &block.mlp_down,
            ] {
                w.streamed.store(false, Ordering::Relaxed);
                body_bytes += w.buf.bytes;
            }
        }
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

    fn record(&self, what: &str, r: std::result::Result<(), cudarc::driver::DriverError>) {
        if let Err(e) = r {
            let mut slot = self.error.lock().unwrap_or_else(|p| p.into_inner());
            if slot.is_none() {
                *slot = Some(format!("{what}: {e}"));
            }
        }
    }

    /// Return (and clear) the first launch failure since the last check.
    fn check(&self) -> Result<()> {
        let taken = self.error.lock().unwrap_or_else(|p| p.into_inner()).take();
        match taken {
            Some(msg) => Err(Error::Device(msg)),
            None => Ok(()),
        }
    }

    fn sync(&self) -> Result<()> {
        self.gpu.bind()?;
        self.stream
            .synchronize()
            .map_err(|e| device_error("synchronizing the stream", e))?;
        self.check()
    }

    fn run(
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

    /// `out[r] (+)= x[r] · wᵀ` for `rows` rows at `x` (f16) into `out` (f32).
    fn matmul(&self, x: u64, rows: usize, w: &CudaLinear, out: u64, accumulate: bool) {
        let k = &self.gpu.kernels;
        let (n, kk) = (w.rows, w.cols);
        let stream = Arg::I(w.streamed.load(Ordering::Relaxed) as i32);
        let acc = Arg::I(accumulate as i32);
        if !w.fast {
            self.run(
                "linear_generic",
                k.linear_generic,
                (n.div_ceil(8) as u32, rows as u32, 1),
                256,
                0,
                &[
                    Arg::P(x),
                    Arg::usize(rows),
                    Arg::usize(kk),
                    Arg::P(w.ptr()),
                    Arg::P(w.params()),
                    Arg::I(w.bits as i32),
                    Arg::usize(n),
                    Arg::usize(w.group_arg()),
                    Arg::P(out),
                    acc,
                ],
            );
            return;
        }
        if let Some(ri) = self.gemv_rows(w, rows) {
            let r = kernels::GEMV_ROWS[ri];
            let rpb = 256 / w.tpr as usize;
            self.run(
                "gemv",
                k.gemv[w.bits_index()][ri],
                (n.div_ceil(rpb) as u32, 1, 1),
                256,
                w.gemv_smem(r),
                &[
                    Arg::P(x),
                    Arg::usize(rows),
                    Arg::usize(kk),
                    Arg::P(w.ptr()),
                    Arg::P(w.params()),
                    Arg::usize(n),
                    Arg::usize(w.group_arg()),
                    Arg::I(w.tpr as i32),
                    stream,
                    Arg::P(out),
                    acc,
                ],
            );
            return;
        }
        self.run(
            "gemm",
            k.gemm[w.bits_index()],
            (n.div_ceil(64) as u32, rows.div_ceil(64) as u32, 1),
            128,
            0,
            &[
                Arg::P(x),
                Arg::usize(rows),
                Arg::usize(kk),
                Arg::P(w.ptr()),
                Arg::P(w.params()),
                Arg::usize(n),
                Arg::usize(w.group_arg()),
                stream,
                Arg::P(out),
                acc,
            ],
        );
    }

    /// Enqueue the argmax of `len` values at `x` into the i32 at device address `result`.
    fn argmax_into(&self, x: u64, len: usize, result: u64) {
        let blocks = len.div_ceil(1024).clamp(1, ARGMAX_BLOCKS);
        let s = self.scratch.ptr;
        self.run(
            "argmax",
            self.gpu.kernels.argmax_f32,
            (blocks as u32, 1, 1),
            256,
            0,
            &[
                Arg::P(x),
                Arg::usize(len),
                Arg::P(s + SCRATCH_ARGMAX_VALUES as u64),
                Arg::P(s + SCRATCH_ARGMAX_INDICES as u64),
                Arg::P(s + SCRATCH_ARGMAX_TICKET as u64),
                Arg::P(result),
            ],
        );
    }

    /// Copy host bytes to `offset` of `buf`, in stream order. Through the pinned staging buffers
    /// unless `TINYLOOP_CUDA_UPLOAD=plain` (one synchronous pageable copy per call).
    fn upload(&self, buf: &DevBuf, offset: usize, bytes: &[u8]) -> Result<()> {
        assert!(
            offset + bytes.len() <= buf.bytes,
            "upload past the end of a device buffer"
        );
        if std::env::var("TINYLOOP_CUDA_UPLOAD").as_deref() == Ok("plain") {
            self.sync()?;
            return buf.upload(offset, bytes);
        }
        self.gpu
            .upload_staged(buf.ptr + offset as u64, bytes, &self.stream)
    }

    /// Attention over `slot`; with `rope`, also RoPE + KV write of the staged row (one row).
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        qkv: &DevBuf,
        step: &CudaStep,
        rows: usize,
        heads: AttentionShape,
        kv: &CudaKv,
        slot: usize,
        out: &mut DevBuf,
        rope: Option<&DevBuf>,
    ) {
        let k = &self.gpu.kernels;
        let hd = heads.head_dim;
        let Some(dj) = kernels::ATT_DJ.iter().position(|&dj| 32 * dj >= hd) else {
            self.record(
                "attention",
                Err(cudarc::driver::DriverError(
                    sys::CUresult::CUDA_ERROR_INVALID_VALUE,
                )),
            );
            return;
        };
        // Split positions across blocks when rows x heads alone would leave SMs idle. The split
        // count depends only on shapes, never on the position, so a captured graph stays valid.
        let per_rows = rows * heads.n_heads;
        let splits = if rows <= SPLIT_ROWS && self.split_floats > 0 {
            (2 * self.gpu.sms)
                .div_ceil(per_rows)
                .min(MAX_SPLITS)
                .min(kv.capacity.div_ceil(32))
                .max(1)
        } else {
            1
        };
        let scale = 1.0 / (hd as f32).sqrt();
        let partial = self.scratch.ptr + self.partial_offset as u64;
        let tickets = self.scratch.ptr + SCRATCH_TICKETS as u64;
        self.run(
            "attention",
            k.attention[dj],
            (heads.n_heads as u32, rows as u32, splits as u32),
            128,
            0,
            &[
                Arg::P(qkv.ptr),
                Arg::P(step.buf.ptr),
                Arg::usize(heads.n_heads),
                Arg::usize(heads.n_kv_heads),
                Arg::usize(hd),
                Arg::F(scale),
                Arg::P(kv.k.ptr),
                Arg::P(kv.v.ptr),
                Arg::usize(slot),
                Arg::usize(kv.capacity),
                Arg::usize(splits),
                Arg::P(out.ptr),
                Arg::P(partial),
                Arg::P(tickets),
                Arg::P(rope.map_or(0, |r| r.ptr)),
            ],
        );
    }

    /// Whether one row's norm can be fused into the GEMV of `w` (decode).
    fn fuses_norm(&self, norm: &NormLayer<CudaVector>, rows: usize, w: &CudaLinear) -> bool {
        rows == 1 && norm.weight.len == w.cols && self.gemv_rows(w, 1).is_some()
    }

    /// End a capture that a panic left open and drop what it captured, so that the stream runs
    /// work again; launch errors recorded meanwhile describe work that never ran.
    fn abandon_capture(&self, step: &mut CudaStep) {
        step.capturing = false;
        if self.gpu.bind().is_ok() {
            // SAFETY: ends the capture graph_begin started on our stream; the partial graph is
            // destroyed at once and never launched.
            if let Ok(graph) = unsafe { result::stream::end_capture(self.stream.cu_stream()) } {
                if !graph.is_null() {
                    // SAFETY: `graph` came from end_capture and is destroyed once.
                    let _ = unsafe { result::graph::destroy(graph) };
                }
            }
        }
        self.error.lock().unwrap_or_else(|p| p.into_inner()).take();
    }

    /// The GEMV row variant (index into GEMV_ROWS) for `rows` rows, if the GEMV path applies.
    fn gemv_rows(&self, w: &CudaLinear, rows: usize) -> Option<usize> {
        let ri = kernels::GEMV_ROWS.iter().position(|&r| r >= rows)?;
        let limit = self.gpu.smem_optin.saturating_sub(2048);
        (w.fast && w.gemv_smem(kernels::GEMV_ROWS[ri]) <= limit).then_some(ri)
    }
}

/// Threads per output row for a GEMV over `units` 16-byte units per row and `n` rows: up to 16
/// (measured on an H200 for tl-407m: 16 rows of 16 threads per block beat 8 rows of 32, 0.545 vs
/// 0.60 ms/token, by amortizing the staging of x over more rows), more while the grid would
/// leave SMs idle.
fn choose_tpr(n: usize, units: usize, sms: usize) -> u32 {
    // TINYLOOP_CUDA_GEMV_TPR overrides the starting width (a tuning knob: 1, 2, 4, ..., 32).
    let cap = std::env::var("TINYLOOP_CUDA_GEMV_TPR")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|v| v.is_power_of_two() && *v <= 32)
        .unwrap_or(16);
    let mut tpr = units.next_power_of_two().clamp(1, cap);
    while tpr < 256 && tpr * 2 <= units && n.div_ceil(256 / tpr) < sms {
        tpr *= 2;
    }
    tpr as u32
}

/// Whether gate and up can share one fused GEMV launch.
fn same_shape(gate: &CudaLinear, up: &CudaLinear) -> bool {
    gate.bits == up.bits
        && gate.group == up.group
        && gate.rows == up.rows
        && gate.cols == up.cols
        && gate.tpr == up.tpr
        && up.fast
}

/// The leading arguments of the normalizing GEMV kernels: the f32 row and the norm layer.
fn norm_args(norm: &NormLayer<CudaVector>, x: &DevBuf) -> [Arg; 6] {
    [
        Arg::P(x.ptr),
        Arg::usize(norm.weight.len),
        Arg::P(norm.weight.buf.ptr),
        Arg::P(norm.bias.map_or(0, |b| b.buf.ptr)),
        Arg::I((norm.kind == NormKind::LayerNorm) as i32),
        Arg::F(norm.eps),
    ]
}

impl Backend for CudaBackend {
    type Float = DevBuf;
    type Half = DevBuf;
    type Linear = CudaLinear;
    type Vector = CudaVector;
    type Step = CudaStep;
    type KvCache = CudaKv;

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
        let bits = w.dtype.bits();
        if !matches!(w.dtype, DType::F16 | DType::Int4 | DType::Int2) {
            return Err(Error::format(format!(
                "linear weights must be f16, int4 or int2, not {}",
                w.dtype.name()
            )));
        }
        let codes_len = w.rows * w.cols * bits as usize / 8;
        if w.bytes.len() < codes_len {
            return Err(Error::format(
                "linear weight shorter than its shape implies",
            ));
        }
        let params_len = w.bytes.len() - codes_len;
        let params_offset = codes_len.div_ceil(256) * 256;
        let buf = DevBuf::alloc(
            &self.gpu,
            params_offset + params_len,
            &format!("a {}x{} {} weight", w.rows, w.cols, w.dtype.name()),
        )?;
        self.upload(&buf, 0, &w.bytes[..codes_len])?;
        self.upload(&buf, params_offset, &w.bytes[codes_len..])?;
        let quantized = w.dtype.is_quantized();
        let fast = w.cols.is_multiple_of(32) && (!quantized || w.group_size.is_multiple_of(32));
        let units = if quantized { w.cols / 32 } else { w.cols / 8 };
        Ok(CudaLinear {
            buf,
            rows: w.rows,
            cols: w.cols,
            bits,
            group: w.group_size,
            params_offset,
            fast,
            tpr: choose_tpr(w.rows, units.max(1), self.gpu.sms),
            streamed: AtomicBool::new(true),
        })
    }

    fn upload_vector(&self, values: &[f16]) -> Result<CudaVector> {
        let buf = DevBuf::alloc(&self.gpu, values.len() * 2, "a norm parameter")?;
        let bytes = crate::model::quant::f16_to_bytes(values);
        self.upload(&buf, 0, &bytes)?;
        Ok(CudaVector {
            buf,
            len: values.len(),
        })
    }

    fn alloc_float(&self, len: usize) -> Result<DevBuf> {
        DevBuf::zeroed(&self.gpu, len * 4, "f32 activations")
    }

    fn alloc_half(&self, len: usize) -> Result<DevBuf> {
        DevBuf::zeroed(&self.gpu, len * 2, "f16 activations")
    }

    fn alloc_step(&self, max_rows: usize) -> Result<CudaStep> {
        Ok(CudaStep {
            buf: DevBuf::zeroed(&self.gpu, (STEP_HEADER + max_rows) * 4, "step inputs")?,
            max_rows,
            rows: 0,
            choice: Choice::Greedy,
            host: Vec::with_capacity(STEP_HEADER + max_rows),
            graphs: Vec::new(),
            capturing: false,
        })
    }

    fn alloc_kv(&self, slots: usize, capacity: usize, kv_dim: usize) -> Result<CudaKv> {
        let bytes = slots * capacity * kv_dim * 2;
        Ok(CudaKv {
            k: DevBuf::zeroed(&self.gpu, bytes, "K cache")?,
            v: DevBuf::zeroed(&self.gpu, bytes, "V cache")?,
            capacity,
        })
    }

    fn linear_bytes(&self, w: &CudaLinear) -> usize {
        w.buf.bytes
    }

    fn kv_bytes(&self, kv: &CudaKv) -> usize {
        kv.k.bytes + kv.v.bytes
    }

    fn set_step(&self, step: &mut CudaStep, input: StepInput) -> Result<()> {
        if step.capturing {
            self.abandon_capture(step);
        }
        self.check()?;
        let rows = input.tokens.len();
        if rows > step.max_rows {
            return Err(Error::invalid(format!(
                "step of {rows} rows exceeds the {} the buffers hold",
                step.max_rows
            )));
        }
        let start = i32::try_from(input.start_pos)
            .map_err(|_| Error::invalid("start position exceeds i32"))?;
        step.host.clear();
        step.host.extend_from_slice(&[start, rows as i32, 0]);
        step.host.extend_from_slice(&sampling_words(&input.choice));
        step.choice = input.choice;
        step.host.extend(input.tokens.iter().map(|&t| t as i32));
        step.rows = rows;
        self.gpu.bind()?;
        // SAFETY: the destination holds STEP_HEADER + max_rows i32 values and rows <= max_rows.
        // The source is pageable host memory, which the driver stages before returning, so
        // `step.host` may be reused at once; the copy is ordered before later work on the stream.
        unsafe { result::memcpy_htod_async(step.buf.ptr, &step.host, self.stream.cu_stream()) }
            .map_err(|e| device_error("staging the step", e))
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
        let d = norm.weight.len;
        // Four values per thread in registers when d is a multiple of 4 (up to 8 per thread).
        let threads = if d.is_multiple_of(4) {
            (d / 4).div_ceil(32).clamp(1, 32) * 32
        } else {
            d.min(256).div_ceil(32) * 32
        };
        self.run(
            "norm_rows",
            self.gpu.kernels.norm_rows,
            (rows as u32, 1, 1),
            threads as u32,
            d * 4,
            &[
                Arg::P(x.ptr),
                Arg::usize(d),
                Arg::I((norm.kind == NormKind::LayerNorm) as i32),
                Arg::F(norm.eps),
                Arg::P(norm.weight.buf.ptr),
                Arg::P(norm.bias.map_or(norm.weight.buf.ptr, |b| b.buf.ptr)),
                Arg::I(norm.bias.is_some() as i32),
                Arg::P(out.ptr),
            ],
        );
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
        if !self.fuses_norm(norm, rows, w) {
            self.norm(norm, x, rows, h);
            return self.matmul(h.ptr, rows, w, out.ptr, false);
        }
        let k = &self.gpu.kernels;
        let [a0, a1, a2, a3, a4, a5] = norm_args(norm, x);
        let args = [
            a0,
            a1,
            a2,
            a3,
            a4,
            a5,
            Arg::P(w.ptr()),
            Arg::P(w.params()),
            Arg::usize(w.rows),
            Arg::usize(w.group_arg()),
            Arg::I(w.tpr as i32),
            Arg::I(w.streamed.load(Ordering::Relaxed) as i32),
            Arg::P(out.ptr),
            Arg::I(0),
        ];
        let grid = (w.rows.div_ceil(256 / w.tpr as usize) as u32, 1, 1);
        let smem = w.gemv_smem(1);
        self.run(
            "gemv_norm",
            k.gemv_norm[w.bits_index()],
            grid,
            256,
            smem,
            &args,
        );
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
        if !(self.fuses_norm(norm, rows, gate) && same_shape(gate, up)) {
            self.norm(norm, x, rows, h);
            return self.mlp_gate_up(h, rows, gate, up, scratch.0, scratch.1, out);
        }
        let k = &self.gpu.kernels;
        let [a0, a1, a2, a3, a4, a5] = norm_args(norm, x);
        let args = [
            a0,
            a1,
            a2,
            a3,
            a4,
            a5,
            Arg::P(gate.ptr()),
            Arg::P(gate.params()),
            Arg::P(up.ptr()),
            Arg::P(up.params()),
            Arg::usize(gate.rows),
            Arg::usize(gate.group_arg()),
            Arg::I(gate.tpr as i32),
            Arg::I(gate.streamed.load(Ordering::Relaxed) as i32),
            Arg::P(out.ptr),
        ];
        let grid = (gate.rows.div_ceil(256 / gate.tpr as usize) as u32, 1, 1);
        let smem = gate.gemv_smem(1);
        let f = k.gemv_gateup_norm[gate.bits_index()];
        self.run("gemv_gateup_norm", f, grid, 256, smem, &args);
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
        match self.gemv_rows(gate, rows).filter(|_| same_shape(gate, up)) {
            Some(ri) => {
                let r = kernels::GEMV_ROWS[ri];
                let rpb = 256 / gate.tpr as usize;
                self.run(
                    "gemv_gateup",
                    self.gpu.kernels.gemv_gateup[gate.bits_index()][ri],
                    (gate.rows.div_ceil(rpb) as u32, 1, 1),
                    256,
                    gate.gemv_smem(r),
                    &[
                        Arg::P(x.ptr),
                        Arg::usize(rows),
                        Arg::usize(gate.cols),
                        Arg::P(gate.ptr()),
                        Arg::P(gate.params()),
                        Arg::P(up.ptr()),
                        Arg::P(up.params()),
                        Arg::usize(gate.rows),
                        Arg::usize(gate.group_arg()),
                        Arg::I(gate.tpr as i32),
                        Arg::I(gate.streamed.load(Ordering::Relaxed) as i32),
                        Arg::P(out.ptr),
                    ],
                );
            }
            None => {
                self.matmul(x.ptr, rows, gate, gate_buf.ptr, false);
                self.matmul(x.ptr, rows, up, up_buf.ptr, false);
                let len = rows * gate.rows;
                self.run(
                    "swiglu",
                    self.gpu.kernels.swiglu,
                    (blocks_for(len, 256), 1, 1),
                    256,
                    0,
                    &[
                        Arg::P(gate_buf.ptr),
                        Arg::P(up_buf.ptr),
                        Arg::usize(len),
                        Arg::P(out.ptr),
                    ],
                );
            }
        }
    }

    fn rope_store_kv(
        &self,
        qkv: &mut DevBuf,
        step: &CudaStep,
        rows: usize,
        heads: AttentionShape,
        rope: &DevBuf,
        kv: &mut CudaKv,
        slot: usize,
    ) {
        let work = (heads.n_heads + heads.n_kv_heads) * heads.head_dim / 2 + heads.kv_dim();
        self.run(
            "rope_kv",
            self.gpu.kernels.rope_kv,
            (rows as u32, work.div_ceil(256) as u32, 1),
            256,
            0,
            &[
                Arg::P(qkv.ptr),
                Arg::P(step.buf.ptr),
                Arg::usize(heads.n_heads),
                Arg::usize(heads.n_kv_heads),
                Arg::usize(heads.head_dim),
                Arg::P(rope.ptr),
                Arg::P(kv.k.ptr),
                Arg::P(kv.v.ptr),
                Arg::usize(slot),
                Arg::usize(kv.capacity),
            ],
        );
    }

    fn rope_attention(
        &self,
        qkv: &mut DevBuf,
        step: &CudaStep,
        rows: usize,
        heads: AttentionShape,
        rope: &DevBuf,
        kv: &mut CudaKv,
        slot: usize,
        out: &mut DevBuf,
    ) {
        // One row: the attention kernel rotates q and the new K itself and writes the cache.
        if rows == 1 {
            return self.attend(qkv, step, rows, heads, kv, slot, out, Some(rope));
        }
        self.rope_store_kv(qkv, step, rows, heads, rope, kv, slot);
        self.attention(qkv, step, rows, heads, kv, slot, out);
    }

    fn attention(
        &self,
        qkv: &DevBuf,
        step: &CudaStep,
        rows: usize,
        heads: AttentionShape,
        kv: &CudaKv,
        slot: usize,
        out: &mut DevBuf,
    ) {
        self.attend(qkv, step, rows, heads, kv, slot, out, None);
    }

    fn add(&self, acc: &mut DevBuf, x: &DevBuf, len: usize) {
        self.run(
            "add_f32",
            self.gpu.kernels.add_f32,
            (blocks_for(len, 256), 1, 1),
            256,
            0,
            &[Arg::P(acc.ptr), Arg::P(x.ptr), Arg::usize(len)],
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

    fn read_float(&self, x: &DevBuf, offset: usize, len: usize) -> Result<Vec<f32>> {
        assert!(
            (offset + len) * 4 <= x.bytes,
            "read past the end of a device buffer"
        );
        self.check()?;
        let mut out = vec![0f32; len];
        self.gpu.bind()?;
        // SAFETY: the source range lies inside `x` (asserted) and `out` holds `len` values; the
        // copy is stream-ordered after the work that produced `x`, and we wait for it below.
        unsafe {
            result::memcpy_dtoh_async(
                &mut out,
                x.ptr + (offset * 4) as u64,
                self.stream.cu_stream(),
            )
        }
        .map_err(|e| device_error("copying to the host", e))?;
        self.sync()?;
        Ok(out)
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
        let Some((_, graph)) = step.graphs.iter().find(|(k, _)| *k == key) else {
            return Ok(false);
        };
        self.gpu.bind()?;
        // SAFETY: `exec` is an instantiated graph of this context; launching it on our stream
        // orders it after the step staging copy.
        unsafe { result::graph::launch(graph.exec, self.stream.cu_stream()) }
            .map_err(|e| device_error("launching the decode graph", e))?;
        Ok(true)
    }

    fn graph_begin(&self, step: &mut CudaStep, _key: u64) -> Result<bool> {
        if !self.graphs {
            return Ok(false);
        }
        self.check()?;
        self.gpu.bind()?;
        // SAFETY: begins capture on our own stream; thread-local mode, so other sessions' threads
        // may keep allocating while we capture.
        unsafe {
            result::stream::begin_capture(
                self.stream.cu_stream(),
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        }
        .map_err(|e| device_error("beginning graph capture", e))?;
        step.capturing = true;
        Ok(true)
    }

    fn graph_end(&self, step: &mut CudaStep, key: u64) -> Result<()> {
        self.gpu.bind()?;
        // SAFETY: ends the capture begun by graph_begin on the same stream.
        let ended = unsafe { result::stream::end_capture(self.stream.cu_stream()) };
        step.capturing = false;
        let launch_error = self.check();
        let graph = ended.map_err(|e| device_error("ending graph capture", e))?;
        // SAFETY: instantiates the graph captured above; on failure the graph is destroyed here,
        // otherwise the Graph value owns both handles.
        let exec =
            match unsafe { result::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) } {
                Ok(exec) => exec,
                Err(e) => {
                    // SAFETY: `graph` came from end_capture and is destroyed once.
                    let _ = unsafe { result::graph::destroy(graph) };
                    return Err(device_error("instantiating the decode graph", e));
                }
            };
        let owned = Graph {
            graph,
            exec,
            ctx: self.gpu.ctx.clone(),
        };
        launch_error?;
        step.graphs.retain(|(k, _)| *k != key);
        step.graphs.push((key, owned));
        // Captured work did not run: launch it now.
        self.graph_replay(step, key).map(|_| ())
    }

    fn graph_reset(&self, step: &mut CudaStep) {
        step.graphs.clear();
    }

    fn choose(&self, logits: &DevBuf, len: usize, step: &mut CudaStep) {
        let result = step.buf.ptr + (STEP_RESULT * 4) as u64;
        match step.choice {
            Choice::Greedy => self.argmax_into(logits.ptr, len, result),
            Choice::Sample { .. } => self.run(
                "sample_token",
                self.gpu.kernels.sample_token,
                (1, 1, 1),
                SAMPLE_THREADS,
                0,
                &[Arg::P(logits.ptr), Arg::usize(len), Arg::P(step.buf.ptr)],
            ),
        }
    }

    fn chosen_token(&self, step: &CudaStep) -> Result<u32> {
        let mut out = [0i32; 1];
        self.gpu.bind()?;
        // SAFETY: reads the 4-byte result slot of the step block into `out`.
        unsafe {
            result::memcpy_dtoh_async(
                &mut out,
                step.buf.ptr + (STEP_RESULT * 4) as u64,
                self.stream.cu_stream(),
            )
        }
        .map_err(|e| device_error("copying to the host", e))?;
        self.sync()?;
        Ok(out[0] as u32)
    }
}

/// The sampling words of the step header (`STEP_TOP_K` .. `STEP_DRAW_HI`); zero when greedy.
fn sampling_words(choice: &Choice) -> [i32; 5] {
    match choice {
        Choice::Greedy => [0; 5],
        Choice::Sample { params, draw } => [
            params.top_k.min(i32::MAX as usize) as i32,
            inv_temperature(params).to_bits() as i32,
            params.top_p.to_bits() as i32,
            *draw as u32 as i32,
            (*draw >> 32) as u32 as i32,
        ],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tpr_fills_the_gpu_for_short_grids() {
        // tl-407m shapes on 132 SMs.
        assert_eq!(choose_tpr(6144, 64, 132), 16); // qkv: 384 blocks
        assert_eq!(choose_tpr(2048, 256, 132), 32); // down: 128 blocks at 16 → widened
        assert_eq!(choose_tpr(50304, 256, 132), 16); // head
        assert_eq!(choose_tpr(64, 2, 132), 2); // tiny: two units per row
        assert_eq!(choose_tpr(64, 64, 132), 64);
    }

    #[test]
    fn available_never_panics() {
        let _ = available();
    }
}
