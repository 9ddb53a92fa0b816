//! CUDA-vs-CPU parity. The CPU backend is the reference (docs/FORMAT.md "Numerics").
//!
//! * Ops one by one (linear at every bit width and row count, norms and norms fused into the
//!   decode GEMVs, RoPE + KV write, attention for prefill and decode, SwiGLU, embedding, argmax,
//!   sampling) on random inputs.
//! * Whole models: `tiny`, `small`, `tl-407m`, `tiny-gqa` (GQA, LayerNorm, k = 2, post block,
//!   factorized tied head) at INT4, INT2 and FP16, loops 1, 4 and 8: logits of `score` (prefill
//!   path) and of every decode step (the captured-graph path); greedy generation of 64 tokens
//!   identical on `tiny` and `small`; sampled decode steps choose exactly the token the host
//!   sampler picks from the GPU's own logits; the decode-path log-probabilities
//!   (`Session::logprobs_decode`) within twice the logits' bound (`logprobs_decode_parity`).
//!
//! Without a usable GPU each test writes "skipped: no CUDA device (why)" to stderr and returns;
//! with TINYLOOP_REQUIRE_CUDA=1 (set by the GPU bundle's run-tests.sh) absence is a failure.
//! Set TINYLOOP_PARITY_REPORT=FILE to append one line per measured case, and
//! TINYLOOP_PARITY_QUICK=1 for a reduced matrix (loops 1 and 4, short generations), as used
//! under compute-sanitizer.
//!
//! # Tolerances (relative L2 error ‖gpu − cpu‖₂ / ‖cpu‖₂)
//!
//! Both backends evaluate the same expression on the same f16-rounded inputs and round to f16 at
//! the same points. They differ only in the order of f32 additions (tree reductions, split-K,
//! tensor-core accumulation; the GPU also applies `scale · q + zero` per 32-wide group as
//! `scale · Σ q·x + zero · Σ x`, the same sum regrouped). So:
//!
//! * **f32 ops** (linear, before any f16 rounding): the reordering error of a K-term dot product
//!   is about √K · u · (Σ|wᵢxᵢ| / |Σ wᵢxᵢ|) with u = 2⁻²⁴; for random data the ratio is about √K,
//!   so K · u ≈ 3·10⁻⁵ at K = 512. Tolerance `OP_TOL` = 1·10⁻⁴.
//! * **f16-rounded ops** (norm, attention, SwiGLU): additionally, an f32 difference δ moves a value
//!   across an f16 rounding midpoint with probability ≈ δ / 2⁻¹¹, changing it by one f16 ulp
//!   (2⁻¹¹ relative); with δ ≈ 10⁻⁶ that is ≈ 0.2 % of the elements and ≈ 2·10⁻⁵ in L2.
//!   Same `OP_TOL`.
//! * **norm fused into a GEMV** (decode): two rounding stages. The two backends sum the norm's
//!   statistics in different orders, so now and then one normalized input rounds to the other
//!   neighbouring f16 value, and that one-ulp change reaches every output of the product; the
//!   SwiGLU output is then rounded again. This is the whole-model argument with one block
//!   application: `CHAIN_TOL = model_tol(1) = 2 · 2⁻¹¹`. Dropping the bias, mixing up the norm
//!   kinds or misreading a row gives errors of a few percent on these inputs, far above it.
//! * **whole models**: each block application consumes f16-rounded activations; a flipped
//!   rounding perturbs the residual stream by at most one f16 ulp of the activation it flips, so
//!   after A block applications plus the head the logits differ by at most about (A + 1) · 2⁻¹¹
//!   when every perturbation adds up (no cancellation). `model_tol(A) = (A + 1) · 2⁻¹¹`
//!   (≈ 2.0·10⁻³ for tiny at L = 1, 5.4·10⁻³ for tl-407m at L = 8). Measured on an H200:
//!   1.8·10⁻⁴ to 7·10⁻⁴, 4 to 13 times below (docs/PERF.md).
//! * **quantized KV modes** (`mode_tol`): the two backends quantize K, V or h with the same
//!   operations (kv::codec), so identical inputs give identical codes (asserted byte for byte by
//!   `cuda_kv_modes_match_cpu`). Inside a model the inputs differ by up to ε = `model_tol(A)`
//!   relative, and a code moves by one step s = amax / qmax only when the two inputs straddle a
//!   rounding midpoint, which for an input difference δ happens with probability about δ / s.
//!   Summed over a head of n values, the expected squared change is Σ (δᵢ / s) · s² = s · ‖δ‖₁
//!   ≤ s · √n · ε · ‖x‖, and with s ≤ ‖x‖ / qmax the relative change of the cached vector is at
//!   most √(√n · ε / qmax): 2.2 % for INT8 and 9 % for INT4 at n = 128 and the largest ε here.
//!   Attention mixes such vectors, so the logits move by no more than that:
//!   `mode_tol = model_tol(A) + √(√head_dim · model_tol(A) / qmax)`. Delta chains are re-encoded
//!   against the stored earlier iterations, so a flip is not carried into later iterations.
//! * **FP16 body cache** (`fp16_body_tol`): the GPU multiplies f16-rounded copies of the
//!   blocks' weights, ŵ = w (1 + ε) with |ε| ≤ u = 2⁻¹¹, where the CPU uses w. A product's error
//!   Σ εᵢ wᵢ xᵢ has, for independent roundings, an L2 norm of about u/√3 · ‖y‖ (random-sign
//!   terms: E[y²] = Σ wᵢ² xᵢ²); we allow u per product, and a block application has four
//!   products in sequence (QKV → attention → output; gate and up → down), each feeding the
//!   residual stream. On that path cuBLAS also rounds the gate and up products to f16 (relative
//!   error u each; SiLU's slope is within [−0.1, 1.1], so silu(ĝ) moves by at most 1.1 · u · |g|,
//!   about u of the activation where it matters): two more roundings of u. Over the A block
//!   applications (pre, loop and post), with every error adding up:
//!   `fp16_body_tol = fp16_kv_tol(A) + 6 · A · 2⁻¹¹` (1.2·10⁻² for tiny at L = 1,
//!   4.0·10⁻² for tl-407m at L = 8). A wrong offset, row or transpose in the cuBLAS call gives
//!   O(1) errors. One-row calls keep the GEMV on the codes, so they keep `model_tol`.
//! * **attention probabilities** (`P_F16_TOL`, `fp16_kv_tol`): steps of more than one row in
//!   the fp16 KV mode run on the tensor cores, which round each probability p = exp(s − m) ≤ 1
//!   to f16 before the product with V: p̂ = p (1 + ε), |ε| ≤ u = 2⁻¹¹ (below 2⁻¹⁴, in the
//!   subnormals, |p̂ − p| ≤ 2⁻²⁵). The normalizer l = Σ p stays f32 and l ≥ 1 (the maximum's own
//!   term), so an output element moves by |Σ (p̂ − p) v| / l ≤ u · Σ p |v| / l + n · 2⁻²⁵ ·
//!   max|v|: at most u · max|v| plus 1.8·10⁻⁵ · max|v| at n = 600 positions. For values of random
//!   sign the errors are independent, and their L2 norm is about u / √3 times that of the output
//!   (E[(Σ εp v)²] = Σ E[ε²] p² v², E[ε²] ≤ u²/3, against E[(Σ p v)²] = Σ p² v²), so we allow u:
//!   `P_F16_TOL` = 2⁻¹¹ on top of `OP_TOL`. In a model, that perturbation of the attention
//!   output reaches the residual stream through the output projection, like one flipped
//!   rounding, once per block application: `fp16_kv_tol(A) = model_tol(A) + A · 2⁻¹¹`. It
//!   applies wherever a multi-row step ran in the fp16 mode before the compared logits
//!   (`mode_tol` in that mode, the FP16 body cache, the looped-session tests). One-row steps
//!   (decode) keep the f32 probabilities.
//! * **greedy tokens**: identical (asserted exactly) in the fp16 modes, since argmax margins of
//!   these random models are far larger than the logit differences above; in the quantized modes,
//!   identical unless the CPU's best two logits are within the parity bound (`generate_parity`).
//! * **sampling**: exact. The kernel and the host sampler evaluate one integer-exact definition
//!   (src/generate/sampling.rs) from the same logits, so any difference is a bug.

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use half::f16;
use tinyloop::backend::cpu::CpuBackend;
use tinyloop::backend::cuda::{CudaBackend, CudaKv, DevBuf};
use tinyloop::backend::{
    choose_on_host, rope_table, AttentionShape, Backend, Choice, HostLinear, NormLayer, Residual,
    StepInput,
};
use tinyloop::format::DType;
use tinyloop::generate::sampling::{Rng, SamplingParams};
use tinyloop::kv::{Application, DepthMask, KvCache, KvLayout, KvMode, TierBounds, ALL_DEPTHS};
use tinyloop::model::forward::{chosen_token, decode_step, forward, Buffers, Decode};
use tinyloop::model::layout::Stage;
use tinyloop::model::quant::{f16_to_bytes, quantize_rtn};
use tinyloop::model::synth::{preset, random_model};
use tinyloop::model::weights::Weights;
use tinyloop::{
    BlockNorms, Device, Error, GenerateParams, GenerateStats, Model, ModelConfig, ModelFile,
    ModelOptions, NormKind,
};

use common::exit_agreement::{agreement, self_consistent, Agreement};
use common::{cuda_or_skip, prefill_and_decode, rel_l2 as rel};

const OP_TOL: f64 = 1e-4;
const CHAIN_TOL: f64 = 2.0 / 2048.0;
/// The relative error that rounding the probabilities to f16 adds to an attention output
/// (module doc, "attention probabilities").
const P_F16_TOL: f64 = 1.0 / 2048.0;

fn model_tol(applications: usize) -> f64 {
    (applications + 1) as f64 * 2f64.powi(-11)
}

/// `model_tol(A)` plus the f16 rounding of the attention probabilities that multi-row steps of
/// the fp16 KV mode add in each block application (module doc, "attention probabilities").
fn fp16_kv_tol(applications: usize) -> f64 {
    model_tol(applications) + applications as f64 * P_F16_TOL
}

/// The whole-model tolerance in a KV mode (module doc, "quantized KV modes").
fn mode_tol(mode: KvMode, applications: usize, head_dim: usize) -> f64 {
    let base = model_tol(applications);
    let qmax = match mode {
        KvMode::Fp16 => return fp16_kv_tol(applications),
        KvMode::Fp16H => return base,
        KvMode::Int8 | KvMode::Delta | KvMode::Int8H => 127.0,
        KvMode::Int4H | KvMode::Age(_) => 7.0,
    };
    base + ((head_dim as f64).sqrt() * base / qmax).sqrt()
}

// ---------------------------------------------------------------------------------------------
// Harness

fn quick() -> bool {
    std::env::var("TINYLOOP_PARITY_QUICK").as_deref() == Ok("1")
}

fn loop_counts() -> &'static [usize] {
    if quick() {
        &[1, 4]
    } else {
        &[1, 4, 8]
    }
}

fn report(line: &str) {
    let _ = writeln!(std::io::stderr(), "{line}");
    if let Ok(path) = std::env::var("TINYLOOP_PARITY_REPORT") {
        static LOCK: Mutex<()> = Mutex::new(());
        let _guard = LOCK.lock();
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            let _ = writeln!(f, "{line}");
        }
    }
}

fn normal(rng: &mut Rng) -> f32 {
    let u1 = rng.next_f64().max(f64::MIN_POSITIVE);
    let u2 = rng.next_f64();
    ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
}

fn randn(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| scale * normal(rng)).collect()
}

fn gpu() -> CudaBackend {
    CudaBackend::open(0).unwrap_or_else(|e| panic!("CUDA device present but unusable: {e}"))
}

/// Read an f16 buffer or the bytes of a KV cache of either backend.
trait Probe: Backend {
    fn read_half(&self, x: &Self::Half, len: usize) -> Vec<f32>;
    fn read_kv(&self, kv: &Self::KvStorage, len: usize) -> Vec<u8>;
}

impl Probe for CpuBackend {
    fn read_half(&self, x: &Vec<f32>, len: usize) -> Vec<f32> {
        x[..len].to_vec()
    }
    fn read_kv(&self, kv: &Vec<u8>, len: usize) -> Vec<u8> {
        kv[..len].to_vec()
    }
}

impl Probe for CudaBackend {
    fn read_half(&self, x: &DevBuf, len: usize) -> Vec<f32> {
        CudaBackend::read_half(self, x, 0, len).unwrap()
    }
    fn read_kv(&self, kv: &CudaKv, len: usize) -> Vec<u8> {
        self.read_kv_bytes(kv, len).unwrap()
    }
}

fn half_buf<B: Backend>(b: &B, values: &[f32]) -> B::Half {
    let n = values.len();
    let mut f = b.alloc_float(n).unwrap();
    b.write_float(&mut f, values).unwrap();
    let mut h = b.alloc_half(n).unwrap();
    b.to_half(&f, n, &mut h);
    h
}

fn float_buf<B: Backend>(b: &B, values: &[f32]) -> B::Float {
    let mut f = b.alloc_float(values.len()).unwrap();
    b.write_float(&mut f, values).unwrap();
    f
}

/// A random weight `[rows, cols]` stored at `bits` with `group` (bytes as in the file).
fn host_weight(
    rng: &mut Rng,
    rows: usize,
    cols: usize,
    bits: u32,
    group: usize,
) -> (DType, usize, Vec<u8>) {
    let values = randn(rng, rows * cols, 1.0 / (cols as f32).sqrt());
    let dtype = DType::from_bits(bits).unwrap();
    if bits == 16 {
        let h: Vec<f16> = values.iter().map(|&v| f16::from_f32(v)).collect();
        (dtype, cols, f16_to_bytes(&h))
    } else {
        let q = quantize_rtn(&values, rows, cols, dtype, group).unwrap();
        (dtype, q.group_size, q.to_bytes())
    }
}

// ---------------------------------------------------------------------------------------------
// Ops

fn linear_on<B: Backend>(
    b: &B,
    w: &HostLinear,
    x: &[f32],
    first_row: usize,
    rows: usize,
    init: &[f32],
    accumulate: bool,
) -> Vec<f32> {
    let lin = b.upload_linear(w).unwrap();
    let xh = half_buf(b, x);
    let mut out = float_buf(b, init);
    b.linear(&xh, first_row, rows, &lin, &mut out, accumulate);
    b.read_float(&out, 0, rows * w.rows).unwrap()
}

#[test]
fn cuda_linear_matches_cpu() {
    if !cuda_or_skip("cuda_linear_matches_cpu") {
        return;
    }
    let (cpu, gpu) = (CpuBackend, gpu());
    let mut rng = Rng::new(7);
    let mut worst = 0f64;
    // (N, K, group): fast paths (K and group multiples of 32), then the generic fallback.
    let shapes = [
        (96, 128, 32),
        (200, 256, 64),
        (70, 512, 128),
        (64, 2048, 128),
        (48, 48, 16),
        (33, 96, 96),
    ];
    for &(n, k, g) in &shapes {
        for bits in [16, 4, 2] {
            let (dtype, group_size, bytes) = host_weight(&mut rng, n, k, bits, g);
            let w = HostLinear {
                rows: n,
                cols: k,
                dtype,
                group_size,
                bytes: &bytes,
            };
            for rows in [1, 2, 3, 4, 5, 8, 16, 17, 70, 130] {
                for (first_row, accumulate) in [(0, false), (1, true)] {
                    let total = first_row + rows;
                    let x = randn(&mut rng, total * k, 1.0);
                    let init = randn(&mut rng, rows * n, 1.0);
                    let c = linear_on(&cpu, &w, &x, first_row, rows, &init, accumulate);
                    let d = linear_on(&gpu, &w, &x, first_row, rows, &init, accumulate);
                    let e = rel(&d, &c);
                    worst = worst.max(e);
                    assert!(
                        e <= OP_TOL,
                        "linear N={n} K={k} g={g} bits={bits} rows={rows} first_row={first_row} \
                         accumulate={accumulate}: rel error {e:.3e} > {OP_TOL:.0e}"
                    );
                }
            }
            // A row's product is the same whatever rows are computed with it: runs of 5 to 16
            // rows against the same rows of a 130-row product, bit for bit.
            let x = randn(&mut rng, 130 * k, 1.0);
            let zero = vec![0f32; 130 * n];
            let all = linear_on(&gpu, &w, &x, 0, 130, &zero, false);
            for (first, rows) in [(0, 5), (3, 8), (17, 16), (64, 13), (114, 16)] {
                let part = linear_on(&gpu, &w, &x, first, rows, &zero[..rows * n], false);
                assert!(
                    part == all[first * n..(first + rows) * n],
                    "linear N={n} K={k} g={g} bits={bits}: rows {first}..{} alone differ from \
                     the same rows of a 130-row product",
                    first + rows
                );
            }
        }
    }
    report(&format!(
        "op linear: worst rel error {worst:.2e} (tol {OP_TOL:.0e}); rows 5 to 16 bit-identical \
         to the same rows of a 130-row product"
    ));
}

/// A row's product is the same bits whatever rows are computed with it, across the GEMM kernels
/// (block tiles over all of K where they fill the GPU: the 300-row products here, `wgmma`'s on
/// sm_90a in blocks of 64 rows and, at N = 5632, of 128; blocks per segment where their partial
/// sums fit in the backend's scratch: the fewer rows of the wide products and every run of the
/// narrow ones; blocks of 16 weight rows otherwise) and every row-tile count of the small ones
/// (1, 2 and 4 MMA tiles per block), for K of one segment, several, and more segments than one
/// block's warps take in a wave, and for units of a group of 128, of 64 and 32 (several a K
/// tile), and of 160 (groups cut by segments).
#[test]
fn cuda_product_rows_do_not_depend_on_the_rows_with_them() {
    if !cuda_or_skip("cuda_product_rows_do_not_depend_on_the_rows_with_them") {
        return;
    }
    let gpu = gpu();
    let mut rng = Rng::new(11);
    let total = 300;
    for &(n, k, g) in &[
        (4096, 256, 128),
        (4096, 2560, 128),
        (520, 2048, 64),
        (96, 4608, 128),
        (5632, 256, 128),
        (2048, 1024, 32),
        (2048, 2048, 64),
        (2048, 2560, 160),
    ] {
        for bits in [16, 4, 2] {
            let (dtype, group_size, bytes) = host_weight(&mut rng, n, k, bits, g);
            let w = HostLinear {
                rows: n,
                cols: k,
                dtype,
                group_size,
                bytes: &bytes,
            };
            let x = randn(&mut rng, total * k, 1.0);
            let zero = vec![0f32; total * n];
            let all = linear_on(&gpu, &w, &x, 0, total, &zero, false);
            for (first, rows) in [(0, 5), (7, 16), (20, 30), (33, 61), (100, 100), (250, 50)] {
                let part = linear_on(&gpu, &w, &x, first, rows, &zero[..rows * n], false);
                assert!(
                    part == all[first * n..(first + rows) * n],
                    "linear N={n} K={k} g={g} bits={bits}: rows {first}..{} alone differ from \
                     the same rows of a {total}-row product",
                    first + rows
                );
            }
        }
    }
    report("op linear: rows 5 to 100 bit-identical to the same rows of a 300-row product");
}

#[test]
fn cuda_norms_match_cpu() {
    if !cuda_or_skip("cuda_norms_match_cpu") {
        return;
    }
    let (cpu, gpu) = (CpuBackend, gpu());
    let mut rng = Rng::new(11);
    let mut worst = 0f64;
    // Multiples of 4 keep the row in registers (one to eight values per thread), 200 does not.
    for d in [64, 128, 200, 384, 2048, 4096] {
        for rows in [1, 5, 9] {
            for kind in [NormKind::RmsNorm, NormKind::LayerNorm] {
                let x: Vec<f32> = randn(&mut rng, rows * d, 2.0)
                    .iter()
                    .map(|v| v + 0.5)
                    .collect();
                let (wv, bv) = random_norm(&mut rng, d);
                let run = |b: &dyn Fn() -> Vec<f32>| b();
                let c = run(&|| norm_on(&cpu, kind, &x, rows, &wv, &bv));
                let g = run(&|| norm_on(&gpu, kind, &x, rows, &wv, &bv));
                let e = rel(&g, &c);
                worst = worst.max(e);
                assert!(
                    e <= OP_TOL,
                    "norm {kind:?} d={d} rows={rows}: rel error {e:.3e}"
                );
            }
        }
    }
    // The decode GEMVs that normalize their input on the fly.
    let mut worst_fused = 0f64;
    for (d, n) in [(64, 96), (1024, 3072), (2048, 256)] {
        for bits in [16, 4, 2] {
            let (dtype, group_size, bytes) = host_weight(&mut rng, n, d, bits, 64);
            let lin = HostLinear {
                rows: n,
                cols: d,
                dtype,
                group_size,
                bytes: &bytes,
            };
            for kind in [NormKind::RmsNorm, NormKind::LayerNorm] {
                let x = randn(&mut rng, d, 2.0);
                let (wv, bv) = random_norm(&mut rng, d);
                let c = norm_linear_on(&cpu, kind, &x, &wv, &bv, &lin);
                let g = norm_linear_on(&gpu, kind, &x, &wv, &bv, &lin);
                for (what, e) in [("linear", rel(&g.0, &c.0)), ("gate_up", rel(&g.1, &c.1))] {
                    worst_fused = worst_fused.max(e);
                    assert!(
                        e <= CHAIN_TOL,
                        "norm+{what} {kind:?} d={d} n={n} bits={bits}: rel error {e:.3e}"
                    );
                }
            }
        }
    }
    report(&format!(
        "op norm: worst rel error {worst:.2e} (tol {OP_TOL:.0e}); fused into the GEMV {worst_fused:.2e} (tol {CHAIN_TOL:.1e})"
    ));
}

/// A norm's weight (about 1) and bias (about 0) for rows of `d` values.
fn random_norm(rng: &mut Rng, d: usize) -> (Vec<f16>, Vec<f16>) {
    let w = randn(rng, d, 0.1)
        .into_iter()
        .map(|v| f16::from_f32(1.0 + v));
    let w = w.collect();
    let b = randn(rng, d, 0.05).into_iter().map(f16::from_f32).collect();
    (w, b)
}

fn norm_on<B: Probe>(
    b: &B,
    kind: NormKind,
    x: &[f32],
    rows: usize,
    w: &[f16],
    bias: &[f16],
) -> Vec<f32> {
    let d = w.len();
    let xf = float_buf(b, x);
    let wv = b.upload_vector(w).unwrap();
    let bv = b.upload_vector(bias).unwrap();
    let mut out = b.alloc_half(rows * d).unwrap();
    b.norm(&norm_layer(kind, &wv, &bv), &xf, rows, &mut out);
    b.read_half(&out, rows * d)
}

fn norm_layer<'a, V>(kind: NormKind, w: &'a V, b: &'a V) -> NormLayer<'a, V> {
    NormLayer {
        kind,
        eps: 1e-5,
        weight: w,
        bias: (kind == NormKind::LayerNorm).then_some(b),
    }
}

/// `norm(x) · wᵀ` for one row through `norm_linear` and `norm_mlp_gate_up` (fused on the GPU).
fn norm_linear_on<B: Probe>(
    b: &B,
    kind: NormKind,
    x: &[f32],
    nw: &[f16],
    nb: &[f16],
    lin: &HostLinear,
) -> (Vec<f32>, Vec<f32>) {
    let d = nw.len();
    let xf = float_buf(b, x);
    let (wv, bv) = (b.upload_vector(nw).unwrap(), b.upload_vector(nb).unwrap());
    let norm = norm_layer(kind, &wv, &bv);
    let w = b.upload_linear(lin).unwrap();
    let mut h = b.alloc_half(d).unwrap();
    let mut out = b.alloc_float(lin.rows).unwrap();
    b.norm_linear(&norm, &xf, 1, &w, &mut h, &mut out);
    let mut gate = b.alloc_float(lin.rows).unwrap();
    let mut up = b.alloc_float(lin.rows).unwrap();
    let mut act = b.alloc_half(lin.rows).unwrap();
    let scratch = (&mut gate, &mut up);
    b.norm_mlp_gate_up(&norm, &xf, 1, &w, &w, &mut h, scratch, &mut act);
    let linear = b.read_float(&out, 0, lin.rows).unwrap();
    (linear, b.read_half(&act, lin.rows))
}

/// A sandwich sublayer's pending output added as the next normalizing GEMV loads its row (and
/// as the loop norm settles it, in one kernel), against the CPU's separate steps: the products
/// within `CHAIN_TOL` (the fused-norm argument above), the settled stream and the loop-normed
/// state within `OP_TOL` (f32 values, reordered sums). The cancelling inputs, a stream that the
/// output nearly undoes, leave a settled row a hundredth the size of its terms.
#[test]
fn cuda_sandwich_settle_matches_cpu() {
    if !cuda_or_skip("cuda_sandwich_settle_matches_cpu") {
        return;
    }
    let (cpu, gpu) = (CpuBackend, gpu());
    let mut rng = Rng::new(23);
    let (mut worst_product, mut worst_stream) = (0f64, 0f64);
    for (d, n) in [(64, 96), (2048, 256)] {
        let (dtype, group_size, bytes) = host_weight(&mut rng, n, d, 4, 64);
        let lin = HostLinear {
            rows: n,
            cols: d,
            dtype,
            group_size,
            bytes: &bytes,
        };
        for layout in [BlockNorms::Sandwich, BlockNorms::SandwichResidual] {
            for kind in [NormKind::RmsNorm, NormKind::LayerNorm] {
                for cancelling in [false, true] {
                    let inputs = SettleInputs::new(&mut rng, d, kind, layout, cancelling);
                    let c = settle_on(&cpu, &inputs, &lin);
                    let g = settle_on(&gpu, &inputs, &lin);
                    let case = format!("{layout:?} {kind:?} d={d} cancelling={cancelling}");
                    for (what, e) in [("linear", rel(&g.0, &c.0)), ("gate_up", rel(&g.1, &c.1))] {
                        worst_product = worst_product.max(e);
                        assert!(e <= CHAIN_TOL, "{case} {what}: rel error {e:.3e}");
                    }
                    for (what, e) in [("stream", rel(&g.2, &c.2)), ("state", rel(&g.3, &c.3))] {
                        worst_stream = worst_stream.max(e);
                        assert!(e <= OP_TOL, "{case} {what}: rel error {e:.3e}");
                    }
                }
            }
        }
    }
    report(&format!(
        "op sandwich settle: products {worst_product:.2e} (tol {CHAIN_TOL:.1e}), stream and \
         loop-normed state {worst_stream:.2e} (tol {OP_TOL:.0e})"
    ));
}

/// The row, pending output and norms of one settle.
struct SettleInputs {
    x: Vec<f32>,
    delta: Vec<f32>,
    norms: [(Vec<f16>, Vec<f16>); 2],
    kind: NormKind,
    layout: BlockNorms,
}

impl SettleInputs {
    /// Random inputs; `cancelling` makes the stream about minus the normalized output (or, with
    /// the norm after the residual add, the output about minus the stream), so that the settled
    /// row is a hundredth of its terms.
    fn new(rng: &mut Rng, d: usize, kind: NormKind, layout: BlockNorms, cancelling: bool) -> Self {
        let mut norm = || {
            let w: Vec<f16> = randn(rng, d, 0.1)
                .iter()
                .map(|v| f16::from_f32(1.0 + v))
                .collect();
            let b: Vec<f16> = randn(rng, d, 0.05)
                .iter()
                .map(|&v| f16::from_f32(v))
                .collect();
            (w, b)
        };
        let norms = [norm(), norm()];
        let delta = randn(rng, d, 2.0);
        let noise = randn(rng, d, 0.01);
        let x = if !cancelling {
            randn(rng, d, 2.0)
        } else if layout == BlockNorms::Sandwich {
            let mut normed = vec![0f32; d];
            let (w, b) = &norms[0];
            let bias = (kind == NormKind::LayerNorm).then_some(b.as_slice());
            host_norm(kind, &delta, w, bias, &mut normed);
            normed.iter().zip(&noise).map(|(o, e)| e - o).collect()
        } else {
            delta.iter().zip(&noise).map(|(o, e)| e - o).collect()
        };
        SettleInputs {
            x,
            delta,
            norms,
            kind,
            layout,
        }
    }
}

/// The normalized row `(v − mean) / √(var + 1e-5) · w + b` in f64 (mean 0 for RMSNorm).
fn host_norm(kind: NormKind, v: &[f32], w: &[f16], b: Option<&[f16]>, out: &mut [f32]) {
    let n = v.len() as f64;
    let mean = match kind {
        NormKind::LayerNorm => v.iter().map(|&a| a as f64).sum::<f64>() / n,
        NormKind::RmsNorm => 0.0,
    };
    let var = v.iter().map(|&a| (a as f64 - mean).powi(2)).sum::<f64>() / n;
    let inv = 1.0 / (var + 1e-5).sqrt();
    for (i, o) in out.iter_mut().enumerate() {
        let bias = b.map_or(0.0, |b| b[i].to_f64());
        *o = ((v[i] as f64 - mean) * inv * w[i].to_f64() + bias) as f32;
    }
}

/// Through `residual_norm_linear`, `residual_norm_mlp_gate_up` (the output norm `norms[0]`, the
/// pre-norm `norms[1]`) and `residual_norm_state` (the loop norm `norms[1]`): the product, the
/// gate-up activation, the settled stream and the loop-normed state.
fn settle_on<B: Probe>(
    b: &B,
    inputs: &SettleInputs,
    lin: &HostLinear,
) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
    let d = inputs.x.len();
    let vectors: Vec<_> = inputs
        .norms
        .iter()
        .map(|(w, bias)| (b.upload_vector(w).unwrap(), b.upload_vector(bias).unwrap()))
        .collect();
    let out_norm = norm_layer(inputs.kind, &vectors[0].0, &vectors[0].1);
    let pre_norm = norm_layer(inputs.kind, &vectors[1].0, &vectors[1].1);
    let delta = float_buf(b, &inputs.delta);
    let residual = Residual {
        norm: out_norm,
        delta: &delta,
        layout: inputs.layout,
    };
    let x = float_buf(b, &inputs.x);
    let w = b.upload_linear(lin).unwrap();
    let mut next = b.alloc_float(d).unwrap();
    let mut h = b.alloc_half(d).unwrap();
    let mut out = b.alloc_float(lin.rows).unwrap();
    b.residual_norm_linear(&residual, &x, 1, &mut next, &pre_norm, &w, &mut h, &mut out);
    let stream = b.read_float(&next, 0, d).unwrap();
    let mut gate = b.alloc_float(lin.rows).unwrap();
    let mut up = b.alloc_float(lin.rows).unwrap();
    let mut act = b.alloc_half(lin.rows).unwrap();
    let scratch = (&mut gate, &mut up);
    b.residual_norm_mlp_gate_up(
        &residual, &x, 1, &mut next, &pre_norm, &w, &w, &mut h, scratch, &mut act,
    );
    let mut state = float_buf(b, &inputs.x);
    b.residual_norm_state(&residual, &pre_norm, &mut state, 1);
    (
        b.read_float(&out, 0, lin.rows).unwrap(),
        b.read_half(&act, lin.rows),
        stream,
        b.read_float(&state, 0, d).unwrap(),
    )
}

/// The KV modes every KV test runs, age with boundaries small enough to be crossed.
const MODES: [&str; 7] = [
    "fp16",
    "fp16-h",
    "int8-h",
    "int4-h",
    "int8",
    "delta",
    "age:64:128",
];

/// A cache of `slots` slots for heads `heads`, as the forward pass makes one (one pre block, one
/// loop block: slot 0 is the pre block, slots 1, 2 iterations 1 and 2).
fn kv_cache<B: Backend>(
    b: &B,
    mode: KvMode,
    heads: AttentionShape,
    capacity: usize,
) -> KvCache<B::KvStorage> {
    let config = ModelConfig {
        dim: heads.q_dim(),
        n_heads: heads.n_heads,
        n_kv_heads: heads.n_kv_heads,
        n_pre_blocks: 1,
        n_loop_blocks: 1,
        n_post_blocks: 0,
        ..preset("tiny").unwrap()
    };
    let layout = KvLayout::new(&config, mode, capacity).unwrap();
    let slots = layout.slots(2);
    KvCache {
        storage: b.alloc_kv(layout.bytes(slots)).unwrap(),
        layout,
        slots,
        bounds: Default::default(),
        depths: Default::default(),
    }
}

/// Write `depths` for positions `first..` into the cache's depth mask (made, and on, at first).
fn write_depths<B: Backend>(b: &B, kv: &mut KvCache<B::KvStorage>, first: usize, depths: &[u32]) {
    if kv.depths.mask.is_none() {
        let storage = b.alloc_kv(4 * kv.layout.capacity).unwrap();
        kv.depths.mask = Some(DepthMask { storage, on: true });
        write_depths(b, kv, 0, &vec![ALL_DEPTHS; kv.layout.capacity]);
    }
    let bytes: Vec<u8> = depths.iter().flat_map(|d| d.to_le_bytes()).collect();
    let mask = kv.depths.mask.as_mut().unwrap();
    b.kv_write(&mut mask.storage, 4 * first, &bytes).unwrap();
}

/// Inputs of one KV op test: per step, the qkv and h rows of two loop iterations.
struct KvInputs {
    steps: Vec<(usize, usize)>,
    qkv: Vec<[Vec<f32>; 2]>,
    h: Vec<[Vec<f32>; 2]>,
}

/// Store + attention for two loop iterations per step through `rope_attention` (the forward
/// pass's entry, so the fused fp16 decode path runs for one-row steps), moving age tiers as the
/// forward pass does. With `depths` (one per position), each step's positions take theirs once
/// the step has run, as the depth mask of a call that stopped them early. Returns per step and
/// iteration the attention output, then the cache bytes of the slots.
fn kv_ops_on<B: Probe>(
    b: &B,
    mode: KvMode,
    heads: AttentionShape,
    capacity: usize,
    inputs: &KvInputs,
    w_qkv: &HostLinear,
    depths: Option<&[u32]>,
) -> (Vec<Vec<f32>>, Vec<u8>) {
    let rope = float_buf(b, &rope_table(capacity, heads.head_dim, 10000.0).unwrap());
    let w = b.upload_linear(w_qkv).unwrap();
    let mut kv = kv_cache(b, mode, heads, capacity);
    let its = [1, 2].map(|i| {
        kv.layout.at(Application {
            stage: Stage::Loop,
            block: 0,
            iteration: i,
        })
    });
    let max_rows = inputs.steps.iter().map(|s| s.1).max().unwrap();
    let mut step = b.alloc_step(max_rows).unwrap();
    let mut out = Vec::new();
    for (i, &(start, rows)) in inputs.steps.iter().enumerate() {
        let tokens = vec![0u32; rows];
        for mv in kv.advance_tiers(start, start + rows) {
            b.kv_move(&mut kv, &mv);
        }
        let input = StepInput {
            tokens: &tokens,
            start_pos: start,
            choice: Choice::Greedy,
        };
        b.set_step(&mut step, input, kv.bounds).unwrap();
        for (it, at) in its.iter().enumerate() {
            let mut q = float_buf(b, &inputs.qkv[i][it]);
            let h = half_buf(b, &inputs.h[i][it]);
            let mut att = b.alloc_half(rows * heads.q_dim()).unwrap();
            b.rope_attention(&mut q, &h, &step, rows, &rope, &mut kv, *at, &w, &mut att);
            out.push(b.read_half(&att, rows * heads.q_dim()));
        }
        if let Some(depths) = depths {
            write_depths(b, &mut kv, start, &depths[start..start + rows]);
        }
    }
    let slot_bytes = kv.layout.scratch_offset(kv.slots);
    (out, b.read_kv(&kv.storage, slot_bytes))
}

/// Every KV mode, op by op: the same inputs give the same cache bytes on both backends (the
/// quantizers are specified operation by operation, kv::codec), and attention outputs within
/// `OP_TOL` over all steps of a head shape (f32 reordering and f16 rounding, as for the other
/// ops; `2 · OP_TOL` in the h modes, which recompute K and V with a product summed in another
/// order and round them to f16 first: a second rounding stage of the same kind; `OP_TOL +
/// P_F16_TOL` in the fp16 mode, whose multi-row steps round the probabilities to f16). A single
/// step's output is as small as 64 values, where one flipped f16 rounding is already 6·10⁻⁵; per
/// step the bound is `CHAIN_TOL` (plus `P_F16_TOL` in the fp16 mode), i.e. no value moves by much
/// more than one f16 ulp.
#[test]
fn cuda_kv_modes_match_cpu() {
    if !cuda_or_skip("cuda_kv_modes_match_cpu") {
        return;
    }
    let cpu = CpuBackend;
    let engine = gpu();
    let mut rng = Rng::new(13);
    for mode in MODES {
        let mode: KvMode = mode.parse().unwrap();
        // The h modes round the recomputed K and V to f16 before attention rounds its output:
        // two rounding stages.
        // The fp16 mode's multi-row steps round the probabilities to f16: P_F16_TOL more.
        let p_f16 = if mode == KvMode::Fp16 { P_F16_TOL } else { 0.0 };
        let tol = if mode.stores_input() {
            2.0 * OP_TOL
        } else {
            OP_TOL + p_f16
        };
        let step_tol = CHAIN_TOL + p_f16;
        let (mut worst, mut overall) = (0f64, 0f64);
        let shapes: &[(usize, usize, usize)] = if quick() {
            &[(4, 2, 16), (16, 16, 128)]
        } else {
            &[
                (4, 4, 16),
                (4, 2, 16),
                (8, 8, 64),
                (16, 16, 128),
                (4, 2, 32),  // one head dimension per lane, whole words of codes
                (2, 1, 256), // eight per lane
                (2, 1, 96),  // four per lane, lanes 24..31 without one (Huginn's head dimension)
                (4, 1, 24),
                (2, 1, 6), // head_dim % 4 != 0: rope_kv's one-pair-per-thread path
            ]
        };
        for &(n_heads, n_kv_heads, head_dim) in shapes {
            let heads = AttentionShape {
                n_heads,
                n_kv_heads,
                head_dim,
            };
            // A session backend, so that decode attention splits positions across blocks.
            let config = ModelConfig {
                dim: n_heads * head_dim,
                n_heads,
                n_kv_heads,
                ..preset("tiny").unwrap()
            };
            let gpu = engine.session(&config).unwrap();
            let capacity = 300;
            // Prefill 37 rows, decode 1 row at a time, then a 3-row step and a long jump.
            let mut steps = vec![(0, 37)];
            steps.extend((37..45).map(|p| (p, 1)));
            steps.push((45, 3));
            steps.push((48, 200));
            steps.push((248, 1));
            // Age 64:128: the long jump moved entries young -> FP8 tier and wrote others into
            // every tier; this step moves INT4 -> FP8 and young -> INT4.
            steps.push((249, 40));
            let dim = heads.q_dim();
            let inputs = KvInputs {
                qkv: steps
                    .iter()
                    .map(|&(_, r)| [0, 1].map(|_| randn(&mut rng, r * heads.qkv_dim(), 1.5)))
                    .collect(),
                h: steps
                    .iter()
                    .map(|&(_, r)| [0, 1].map(|_| randn(&mut rng, r * dim, 1.0)))
                    .collect(),
                steps,
            };
            let (dtype, group_size, bytes) = host_weight(&mut rng, heads.qkv_dim(), dim, 4, 32);
            let w = HostLinear {
                rows: heads.qkv_dim(),
                cols: dim,
                dtype,
                group_size,
                bytes: &bytes,
            };
            let (c, cb) = kv_ops_on(&cpu, mode, heads, capacity, &inputs, &w, None);
            let (g, gb) = kv_ops_on(&gpu, mode, heads, capacity, &inputs, &w, None);
            let differing = cb.iter().zip(&gb).filter(|(x, y)| x != y).count();
            assert_eq!(
                differing, 0,
                "{mode} heads {heads:?}: {differing} cache bytes differ"
            );
            for (i, (ca, ga)) in c.iter().zip(&g).enumerate() {
                let e = rel(ga, ca);
                worst = worst.max(e);
                assert!(
                    e <= step_tol,
                    "{mode} attention heads {heads:?} step {} iteration {}: rel error {e:.3e}",
                    i / 2,
                    i % 2 + 1
                );
            }
            let e = rel(&g.concat(), &c.concat());
            assert!(
                e <= tol,
                "{mode} attention heads {heads:?}: rel error {e:.3e} overall"
            );
            overall = overall.max(e);
        }
        report(&format!(
            "op kv {mode:10}: cache bytes identical, attention rel error {overall:.2e} overall \
             (tol {tol:.1e}), worst step {worst:.2e} (tol {step_tol:.1e})"
        ));
    }
}

/// The depth mask of exit criteria (reference policy): attention in iteration 2 leaves out the
/// positions that stopped after iteration 1, in every mode's kernel (decode with its position
/// splits, the fused fp16 decode, the flash kernel of multi-row fp16 steps, the quantized and
/// the h modes' paths), as the CPU reference does. Every third position and positions 64..128
/// (whole warps, key tiles and splits with nothing to read) stop early. Tolerances and shapes as
/// `cuda_kv_modes_match_cpu`.
#[test]
fn cuda_depth_mask_matches_cpu() {
    if !cuda_or_skip("cuda_depth_mask_matches_cpu") {
        return;
    }
    let cpu = CpuBackend;
    let engine = gpu();
    let mut rng = Rng::new(31);
    let mut failures = Vec::new();
    for mode in MODES {
        let mode: KvMode = mode.parse().unwrap();
        let p_f16 = if mode == KvMode::Fp16 { P_F16_TOL } else { 0.0 };
        let step_tol = if mode.stores_input() {
            2.0 * CHAIN_TOL
        } else {
            CHAIN_TOL + p_f16
        };
        for (n_heads, n_kv_heads, head_dim) in [(4, 2, 16), (8, 8, 64)] {
            let heads = AttentionShape {
                n_heads,
                n_kv_heads,
                head_dim,
            };
            let config = ModelConfig {
                dim: n_heads * head_dim,
                n_heads,
                n_kv_heads,
                ..preset("tiny").unwrap()
            };
            let gpu = engine.session(&config).unwrap();
            let capacity = 300;
            let mut steps = vec![(0, 37)];
            steps.extend((37..45).map(|p| (p, 1)));
            steps.extend([(45, 3), (48, 100), (148, 1), (149, 70), (219, 1)]);
            let depths: Vec<u32> = (0..capacity)
                .map(|p| {
                    if p % 3 == 1 || (64..128).contains(&p) {
                        1
                    } else {
                        ALL_DEPTHS
                    }
                })
                .collect();
            let dim = heads.q_dim();
            let inputs = KvInputs {
                qkv: steps
                    .iter()
                    .map(|&(_, r)| [0, 1].map(|_| randn(&mut rng, r * heads.qkv_dim(), 1.5)))
                    .collect(),
                h: steps
                    .iter()
                    .map(|&(_, r)| [0, 1].map(|_| randn(&mut rng, r * dim, 1.0)))
                    .collect(),
                steps: steps.clone(),
            };
            let (dtype, group_size, bytes) = host_weight(&mut rng, heads.qkv_dim(), dim, 4, 32);
            let w = HostLinear {
                rows: heads.qkv_dim(),
                cols: dim,
                dtype,
                group_size,
                bytes: &bytes,
            };
            let masked = Some(depths.as_slice());
            let (c, _) = kv_ops_on(&cpu, mode, heads, capacity, &inputs, &w, masked);
            let (g, _) = kv_ops_on(&gpu, mode, heads, capacity, &inputs, &w, masked);
            let (plain, _) = kv_ops_on(&cpu, mode, heads, capacity, &inputs, &w, None);
            for (i, (ca, ga)) in c.iter().zip(&g).enumerate() {
                let e = rel(ga, ca);
                if e > step_tol || e.is_nan() {
                    failures.push(format!(
                        "{mode} heads {heads:?} step {} iteration {}: rel error {e:.3e}",
                        i / 2,
                        i % 2 + 1
                    ));
                }
            }
            // The mask changes iteration 2 after the first step, never iteration 1.
            let changed = |it: usize| {
                (2..2 * steps.len())
                    .filter(|i| i % 2 == it)
                    .any(|i| c[i] != plain[i])
            };
            if changed(0) || !changed(1) {
                failures.push(format!(
                    "{mode} heads {heads:?}: the mask applies to the wrong iteration"
                ));
            }
        }
    }
    finish("cuda_depth_mask_matches_cpu", failures);
}

/// Multi-row steps in the fp16 KV mode (the tensor-core kernel, cuda/flash.cu) against the CPU
/// reference: ragged row counts (2 to 513), steps from position 0 and after earlier positions,
/// MHA and GQA, head dimensions 64 and 128 (and 16, the tiny presets'). Each step and iteration
/// must stay within a relative L2 error of `OP_TOL + P_F16_TOL` (module doc, "attention
/// probabilities"). Printed per step: that error and the largest element error in units of
/// u · max|v| (u = 2⁻¹¹), the per-element bound of the probability rounding; a tile or mask
/// error shows as O(1) in both.
#[test]
fn cuda_flash_attention_matches_cpu() {
    if !cuda_or_skip("cuda_flash_attention_matches_cpu") {
        return;
    }
    let cpu = CpuBackend;
    let engine = gpu();
    let mut rng = Rng::new(29);
    let tol = OP_TOL + P_F16_TOL;
    let sequences: [&[(usize, usize)]; 3] = [
        &[(0, 2), (2, 17), (19, 64), (83, 100), (183, 130)],
        &[(0, 70), (70, 130)],
        &[(0, 513)],
    ];
    let shapes: &[(usize, usize, usize)] = if quick() {
        &[(8, 2, 64), (4, 1, 128)]
    } else {
        &[
            (4, 4, 64),
            (8, 2, 64),
            (4, 4, 128),
            (4, 1, 128),
            (4, 2, 16),
            (2, 1, 32),
        ]
    };
    let sequences = if quick() {
        &sequences[1..2]
    } else {
        &sequences[..]
    };
    let mut failures = Vec::new();
    let mut worst = 0f64;
    for &(n_heads, n_kv_heads, head_dim) in shapes {
        let heads = AttentionShape {
            n_heads,
            n_kv_heads,
            head_dim,
        };
        let config = ModelConfig {
            dim: n_heads * head_dim,
            n_heads,
            n_kv_heads,
            ..preset("tiny").unwrap()
        };
        let gpu = engine.session(&config).unwrap();
        let dim = heads.q_dim();
        let (dtype, group_size, bytes) = host_weight(&mut rng, heads.qkv_dim(), dim, 4, 32);
        let w = HostLinear {
            rows: heads.qkv_dim(),
            cols: dim,
            dtype,
            group_size,
            bytes: &bytes,
        };
        for &steps in sequences {
            let inputs = KvInputs {
                qkv: steps
                    .iter()
                    .map(|&(_, r)| [0, 1].map(|_| randn(&mut rng, r * heads.qkv_dim(), 1.5)))
                    .collect(),
                h: steps
                    .iter()
                    .map(|&(_, r)| [0, 1].map(|_| randn(&mut rng, r * dim, 1.0)))
                    .collect(),
                steps: steps.to_vec(),
            };
            let (c, cb) = kv_ops_on(&cpu, KvMode::Fp16, heads, 600, &inputs, &w, None);
            let (g, gb) = kv_ops_on(&gpu, KvMode::Fp16, heads, 600, &inputs, &w, None);
            if cb != gb {
                failures.push(format!(
                    "flash heads {heads:?} steps {steps:?}: cache bytes"
                ));
            }
            for (i, (ca, ga)) in c.iter().zip(&g).enumerate() {
                let ((start, rows), it) = (steps[i / 2], i % 2);
                // The largest |v| the step's rows attend to (this iteration's values so far).
                let v_max = inputs.qkv[..=i / 2]
                    .iter()
                    .flat_map(|q| q[it].chunks(heads.qkv_dim()))
                    .flat_map(|row| &row[dim + heads.kv_dim()..])
                    .fold(0f32, |m, v| m.max(v.abs()));
                let abs = ga
                    .iter()
                    .zip(ca)
                    .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
                let e = rel(ga, ca);
                worst = worst.max(e);
                report(&format!(
                    "op flash heads {n_heads}/{n_kv_heads} hd {head_dim:3} start {start:3} rows \
                     {rows:3} it {}: rel {e:.2e} (tol {tol:.1e}), max abs {abs:.2e} = {:.2} u·max|v|",
                    it + 1,
                    abs as f64 / (v_max as f64 * P_F16_TOL)
                ));
                if e > tol {
                    failures.push(format!(
                        "flash heads {heads:?} start {start} rows {rows} iteration {}: rel \
                         {e:.3e} > {tol:.3e}",
                        it + 1
                    ));
                }
            }
        }
    }
    report(&format!(
        "op flash attention: worst rel error {worst:.2e} (tol {tol:.1e})"
    ));
    finish("cuda_flash_attention_matches_cpu", failures);
}

#[test]
fn cuda_swiglu_embed_argmax_match_cpu() {
    if !cuda_or_skip("cuda_swiglu_embed_argmax_match_cpu") {
        return;
    }
    let (cpu, gpu) = (CpuBackend, gpu());
    let mut rng = Rng::new(17);
    let mut worst = 0f64;
    for (f, k, g) in [(256, 64, 64), (192, 64, 32), (2048, 512, 128), (40, 48, 16)] {
        for bits in [16, 4, 2] {
            let (dtype, gs, gate_bytes) = host_weight(&mut rng, f, k, bits, g);
            let (_, _, up_bytes) = host_weight(&mut rng, f, k, bits, g);
            let gate = HostLinear {
                rows: f,
                cols: k,
                dtype,
                group_size: gs,
                bytes: &gate_bytes,
            };
            let up = HostLinear {
                rows: f,
                cols: k,
                dtype,
                group_size: gs,
                bytes: &up_bytes,
            };
            for rows in [1, 3, 5, 20] {
                let x = randn(&mut rng, rows * k, 1.0);
                let c = gate_up_on(&cpu, &gate, &up, &x, rows);
                let d = gate_up_on(&gpu, &gate, &up, &x, rows);
                let e = rel(&d, &c);
                worst = worst.max(e);
                assert!(
                    e <= OP_TOL,
                    "gate_up F={f} K={k} bits={bits} rows={rows}: rel error {e:.3e}"
                );
            }
        }
    }
    // Embedding rows are copied exactly.
    let (vocab, d) = (50, 96);
    let table: Vec<f16> = randn(&mut rng, vocab * d, 1.0)
        .iter()
        .map(|&v| f16::from_f32(v))
        .collect();
    let table_bytes = f16_to_bytes(&table);
    let t = HostLinear {
        rows: vocab,
        cols: d,
        dtype: DType::F16,
        group_size: d,
        bytes: &table_bytes,
    };
    let tokens = [3u32, 0, 49, 7, 7];
    let embed = |b: &dyn Fn() -> Vec<f32>| b();
    let c = embed(&|| embed_on(&cpu, &t, &tokens));
    let g = embed(&|| embed_on(&gpu, &t, &tokens));
    assert_eq!(c, g, "embedding rows differ");
    // Argmax: ties go to the lowest index, NaN never wins.
    for values in [
        vec![1.0, 3.0, 3.0, -1.0],
        vec![f32::NAN, 2.0, f32::NAN, 2.0, 1.0],
        vec![f32::NAN; 5],
        vec![f32::NEG_INFINITY, f32::NAN, f32::NEG_INFINITY],
        randn(&mut rng, 50304, 3.0),
    ] {
        let c = choose_on(&cpu, &values, Choice::Greedy);
        let g = choose_on(&gpu, &values, Choice::Greedy);
        assert_eq!(c, g, "argmax of {} values", values.len());
    }
    report(&format!(
        "op swiglu: worst rel error {worst:.2e} (tol {OP_TOL:.0e}); embedding and argmax exact"
    ));
}

/// The token `choice` picks from `values`, through the backend's `choose`.
fn choose_on<B: Backend>(b: &B, values: &[f32], choice: Choice) -> u32 {
    let mut step = b.alloc_step(1).unwrap();
    let input = StepInput {
        tokens: &[0],
        start_pos: 0,
        choice,
    };
    b.set_step(&mut step, input, TierBounds::default()).unwrap();
    let x = float_buf(b, values);
    b.choose(&x, values.len(), &mut step);
    b.chosen_token(&step).unwrap()
}

#[test]
fn cuda_sampling_matches_the_host_sampler() {
    if !cuda_or_skip("cuda_sampling_matches_the_host_sampler") {
        return;
    }
    let gpu = gpu();
    let mut rng = Rng::new(23);
    let mut rows: Vec<Vec<f32>> = [1, 7, 256, 1000, 1025, 50304, 131072]
        .iter()
        .map(|&n| randn(&mut rng, n, 3.0))
        .collect();
    // Ties at every cut, and values that never win.
    rows.push((0..4096).map(|i| (i % 13) as f32 * 0.25).collect());
    let mut special = randn(&mut rng, 3000, 2.0);
    for i in (0..3000).step_by(7) {
        special[i] = if i % 2 == 0 {
            f32::NAN
        } else {
            f32::NEG_INFINITY
        };
    }
    rows.push(special);
    rows.push(vec![f32::NEG_INFINITY; 64]);
    let mut cases = 0;
    for values in &rows {
        let n = values.len();
        for (temperature, top_k, top_p) in [
            (1.0, 0, 1.0),
            (0.7, 40, 0.9),
            (1.5, 0, 0.5),
            (0.3, 1, 1.0),
            (2.0, n, 0.01),
            (1.0, 5, 1.0),
            (1.0, n + 10, 0.999),
        ] {
            for _ in 0..6 {
                let choice = Choice::Sample {
                    params: SamplingParams {
                        temperature,
                        top_k,
                        top_p,
                        seed: 0,
                    },
                    draw: rng.next_draw(),
                };
                let host = choose_on_host(values, &choice);
                let device = choose_on(&gpu, values, choice);
                assert_eq!(host, device, "n={n} {choice:?}");
                cases += 1;
            }
        }
    }
    report(&format!(
        "op sampling: {cases} draws, device token == host sampler token in all"
    ));
}

/// A capture that was begun and never ended (a panic between `graph_begin` and `graph_end`) is
/// abandoned by the next `set_step`, after which the session runs work again.
#[test]
fn cuda_unfinished_capture_is_abandoned() {
    if !cuda_or_skip("cuda_unfinished_capture_is_abandoned") {
        return;
    }
    let gpu = gpu();
    let mut step = gpu.alloc_step(1).unwrap();
    let input = StepInput {
        tokens: &[0],
        start_pos: 0,
        choice: Choice::Greedy,
    };
    gpu.set_step(&mut step, input, TierBounds::default())
        .unwrap();
    let capturing = gpu.graph_begin(&mut step, 1).unwrap();
    gpu.set_step(&mut step, input, TierBounds::default())
        .unwrap();
    let x = float_buf(&gpu, &[1.0, 3.0, 2.0]);
    gpu.choose(&x, 3, &mut step);
    assert_eq!(
        gpu.chosen_token(&step).unwrap(),
        1,
        "capturing: {capturing}"
    );
}

fn gate_up_on<B: Probe>(
    b: &B,
    gate: &HostLinear,
    up: &HostLinear,
    x: &[f32],
    rows: usize,
) -> Vec<f32> {
    let (g, u) = (b.upload_linear(gate).unwrap(), b.upload_linear(up).unwrap());
    let xh = half_buf(b, x);
    let mut gb = b.alloc_float(rows * gate.rows).unwrap();
    let mut ub = b.alloc_float(rows * gate.rows).unwrap();
    let mut out = b.alloc_half(rows * gate.rows).unwrap();
    b.mlp_gate_up(&xh, rows, &g, &u, &mut gb, &mut ub, &mut out);
    b.read_half(&out, rows * gate.rows)
}

fn embed_on<B: Backend>(b: &B, table: &HostLinear, tokens: &[u32]) -> Vec<f32> {
    let t = b.upload_linear(table).unwrap();
    let mut step = b.alloc_step(tokens.len()).unwrap();
    b.set_step(
        &mut step,
        StepInput {
            tokens,
            start_pos: 0,
            choice: Choice::Greedy,
        },
        TierBounds::default(),
    )
    .unwrap();
    let mut out = b.alloc_float(tokens.len() * table.cols).unwrap();
    b.embed(&t, &step, &mut out);
    b.read_float(&out, 0, tokens.len() * table.cols).unwrap()
}

#[test]
fn cuda_out_of_memory_is_an_error_and_the_device_keeps_working() {
    if !cuda_or_skip("cuda_out_of_memory_is_an_error_and_the_device_keeps_working") {
        return;
    }
    let gpu = gpu();
    match gpu.alloc_float(1 << 40) {
        Err(Error::OutOfMemory { bytes, what }) => {
            assert!(bytes >= 4 << 40, "{bytes}");
            report(&format!(
                "oom: alloc_float(2^40) -> OutOfMemory {{ bytes: {bytes}, what: {what:?} }}"
            ));
        }
        Err(other) => panic!("expected OutOfMemory, got {other}"),
        Ok(_) => panic!("a 4 TiB allocation succeeded"),
    }
    let mut x = gpu.alloc_float(1000).unwrap();
    gpu.write_float(&mut x, &[2.5; 1000]).unwrap();
    assert_eq!(gpu.read_float(&x, 10, 3).unwrap(), vec![2.5; 3]);

    // Through the Model API: a KV cache far beyond device memory, then normal use.
    let path = synth("tiny", 4, 64);
    let options = ModelOptions {
        max_seq_len: 2048,
        max_loops: 1 << 20,
        device: Some(Device::Cuda(0)),
        log: false,
        ..ModelOptions::default()
    };
    let model = Model::open(&path, &options).unwrap();
    let mut session = model.new_session().unwrap();
    let params = |loops| GenerateParams {
        max_tokens: 4,
        loops: Some(loops),
        ..GenerateParams::default()
    };
    match session.generate(&[1, 2, 3], &params(1 << 19)) {
        Err(Error::OutOfMemory { bytes, .. }) => {
            report(&format!("oom: KV cache of {bytes} bytes refused"))
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    assert_eq!(session.generate(&[1, 2, 3], &params(2)).unwrap().len(), 4);
}

// ---------------------------------------------------------------------------------------------
// Whole models

/// A synthetic model file, written once per process.
fn synth(name: &str, bits: u32, group: usize) -> PathBuf {
    static DONE: OnceLock<Mutex<Vec<PathBuf>>> = OnceLock::new();
    let dir = std::env::var_os("TINYLOOP_PARITY_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            std::env::temp_dir().join(format!("tinyloop-parity-{}", std::process::id()))
        });
    let path = dir.join(format!("{name}-b{bits}-g{group}.tinyloop"));
    let done = DONE.get_or_init(|| Mutex::new(Vec::new()));
    let mut done = done.lock().unwrap();
    if !done.contains(&path) && !path.exists() {
        std::fs::create_dir_all(&dir).unwrap();
        let config = preset(name).unwrap();
        random_model(&config, 1, bits, group)
            .unwrap()
            .write(&path)
            .unwrap();
    }
    done.push(path.clone());
    path
}

fn open(path: &Path, device: Device, max_seq_len: usize) -> Model {
    open_in(path, device, max_seq_len, KvMode::Fp16)
}

fn open_in(path: &Path, device: Device, max_seq_len: usize, kv_mode: KvMode) -> Model {
    let options = ModelOptions {
        max_seq_len,
        device: Some(device),
        kv_mode: Some(kv_mode),
        log: false,
        ..ModelOptions::default()
    };
    Model::open(path, &options)
        .unwrap_or_else(|e| panic!("open {} on {device}: {e}", path.display()))
}

fn prompt(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut rng = Rng::new(seed);
    (0..n)
        .map(|_| (rng.next_u64() % vocab as u64) as u32)
        .collect()
}

/// Score parity at loops 1, 4, 8 for every bit width (INT4 only outside the fp16 mode: the KV
/// mode does not touch the weights) in KV mode `mode`; records failures.
fn score_parity(name: &str, group: usize, seq: usize, mode: KvMode, failures: &mut Vec<String>) {
    let bits_list: &[u32] = if mode == KvMode::Fp16 {
        &[4, 2, 16]
    } else {
        &[4]
    };
    for &bits in bits_list {
        let path = synth(name, bits, group);
        let cpu = open_in(&path, Device::Cpu, 128, mode);
        let gpu = open_in(&path, Device::Cuda(0), 128, mode);
        let config = cpu.config().clone();
        let tokens = prompt(seq, config.vocab_size, bits as u64);
        let (mut cs, mut gs) = (cpu.new_session().unwrap(), gpu.new_session().unwrap());
        for &loops in loop_counts() {
            let tol = mode_tol(mode, config.applications(loops), config.head_dim());
            let c = cs.score(&tokens, Some(loops)).unwrap();
            let g = gs.score(&tokens, Some(loops)).unwrap();
            let e = rel(&g, &c);
            // Three tokens: the GEMV path (rows <= 4) instead of the tensor-core GEMM.
            let c3 = cs.score_last(&tokens[..3], Some(loops)).unwrap();
            let g3 = gs.score_last(&tokens[..3], Some(loops)).unwrap();
            let e3 = rel(&g3, &c3);
            let ok = e <= tol && e3 <= tol;
            report(&format!(
                "parity {name:9} {:5} {mode:10} L={loops}: score({seq}) rel {e:.2e}, score_last(3) rel {e3:.2e}, tol {tol:.2e} {}",
                DType::from_bits(bits).unwrap().name(),
                if ok { "ok" } else { "FAIL" }
            ));
            if !ok {
                failures.push(format!(
                    "{name} bits={bits} {mode} loops={loops}: {e:.3e} / {e3:.3e} > {tol:.3e}"
                ));
            }
        }
    }
}

/// Decode-step logits (the captured-graph path) against the CPU, through the forward-pass API,
/// switching loop counts so that graphs are captured, replayed, and reset when the KV cache grows.
fn decode_parity(
    name: &str,
    bits: u32,
    group: usize,
    steps: usize,
    mode: KvMode,
    failures: &mut Vec<String>,
) {
    let path = synth(name, bits, group);
    let file = ModelFile::open(&path).unwrap();
    let config = file.config.clone();
    let max_seq = 128;
    let layout = KvLayout::new(&config, mode, max_seq).unwrap();
    let cpu = CpuBackend;
    let wc = Weights::load(&cpu, &file, max_seq).unwrap();
    let mut bc = Buffers::new(
        &cpu,
        &config,
        16,
        layout.clone(),
        wc.body.loaded().unwrap(),
        tinyloop::StateInit::Model,
    )
    .unwrap();
    let engine = gpu();
    let wg = Weights::load(&engine, &file, max_seq).unwrap();
    engine.finish_load(&wg).unwrap();
    let session = engine.session(&config).unwrap();
    let mut bg = Buffers::new(
        &session,
        &config,
        16,
        layout,
        wg.body.loaded().unwrap(),
        tinyloop::StateInit::Model,
    )
    .unwrap();
    let never = std::sync::atomic::AtomicBool::new(false);
    let vocab = config.vocab_size;
    let tokens = prompt(5, vocab, 99);
    let mut worst = 0f64;
    let mut pos = 0;
    let mut draws = Rng::new(5);
    let rounds: &[usize] = if quick() { &[4, 1] } else { &[4, 8, 4, 1] };
    for (round, &loops) in rounds.iter().enumerate() {
        // Each round restarts the sequence (prefill), then decodes.
        let input = StepInput {
            tokens: &tokens,
            start_pos: 0,
            choice: Choice::Greedy,
        };
        forward(&cpu, &wc, &mut bc, input, loops, &never).unwrap();
        forward(&session, &wg, &mut bg, input, loops, &never).unwrap();
        pos = tokens.len();
        let mut next = tokens[tokens.len() - 1];
        let tol = mode_tol(mode, config.applications(loops), config.head_dim());
        for i in 0..steps {
            // Odd steps sample (their own captured graph): the device must pick exactly what the
            // host sampler picks from the device's logits.
            let choice = if i % 2 == 0 {
                Choice::Greedy
            } else {
                Choice::Sample {
                    params: SamplingParams {
                        temperature: 0.8,
                        top_k: 40,
                        top_p: 0.9,
                        seed: 0,
                    },
                    draw: draws.next_draw(),
                }
            };
            let input = StepInput {
                tokens: &[next],
                start_pos: pos,
                choice,
            };
            decode_step(&cpu, &wc, &mut bc, input, Decode::plain(loops)).unwrap();
            decode_step(&session, &wg, &mut bg, input, Decode::plain(loops)).unwrap();
            let c = cpu.read_float(&bc.logits, 0, vocab).unwrap();
            let g = session.read_float(&bg.logits, 0, vocab).unwrap();
            let e = rel(&g, &c);
            worst = worst.max(e);
            let (tc, tg) = (
                chosen_token(&cpu, &bc).unwrap(),
                chosen_token(&session, &bg).unwrap(),
            );
            // Greedy: the CPU's token, unless the CPU's logits of the two tokens lie closer than
            // twice the largest logit difference measured (a near tie the error explains);
            // sampled: the host sampler on the GPU's logits.
            let expected = if choice.is_sample() {
                choose_on_host(&g, &choice)
            } else {
                tc
            };
            let near_tie = !choice.is_sample() && {
                let worst = g
                    .iter()
                    .zip(&c)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                (c[tc as usize] - c[tg as usize]).abs() <= 2.0 * worst
            };
            if near_tie && tg != expected {
                report(&format!(
                    "{name} bits={bits} {mode} loops={loops} pos={pos}: greedy tokens {tc} and {tg} \
                     within the measured logit error"
                ));
            }
            if e > tol || (tg != expected && !near_tie) {
                failures.push(format!(
                    "{name} bits={bits} {mode} round {round} loops={loops} pos={pos}: decode rel {e:.3e} (tol {tol:.3e}), tokens {expected} vs {tg} ({choice:?})"
                ));
            }
            next = tc;
            pos += 1;
        }
    }
    let _ = pos;
    report(&format!(
        "parity {name:9} {:5} {mode:10} decode x{steps} per L in 4,8,4,1 (graphs): worst rel {worst:.2e}",
        DType::from_bits(bits).unwrap().name()
    ));
}

/// `Session::logprobs_decode` (every token a one-row decode step: GEMV, decode attention and
/// captured graphs on the GPU) against the CPU, whose decode path equals its one-step scoring bit
/// for bit (tests/generate.rs). The step logits obey the parity bound ‖Δl‖₂ ≤ tol · ‖l‖₂ with
/// `tol = model_tol(A)` (one-row steps keep f32 attention probabilities), and a log-probability
/// `l[t] − logsumexp(l)` moves by `Δl[t] − Σ p Δl`, at most 2 · max|Δl| ≤ 2 · tol · ‖l‖₂: the
/// bound of each position, with ‖l‖₂ from the CPU's logits of that row.
fn logprobs_decode_parity(name: &str, group: usize, seq: usize, failures: &mut Vec<String>) {
    let path = synth(name, 4, group);
    let (cpu, gpu) = (
        open(&path, Device::Cpu, 128),
        open(&path, Device::Cuda(0), 128),
    );
    let config = cpu.config().clone();
    let vocab = config.vocab_size;
    let tokens = prompt(seq, vocab, 17);
    let (mut cs, mut gs) = (cpu.new_session().unwrap(), gpu.new_session().unwrap());
    for &loops in loop_counts() {
        let tol = model_tol(config.applications(loops));
        let logits = cs.score(&tokens, Some(loops)).unwrap();
        let c = cs.logprobs(&tokens, Some(loops)).unwrap();
        let g = gs.logprobs_decode(&tokens, Some(loops)).unwrap();
        let mut worst = 0f64;
        for (i, (&a, &b)) in g.iter().zip(&c).enumerate() {
            let norm = logits[i * vocab..(i + 1) * vocab]
                .iter()
                .map(|&v| (v as f64).powi(2))
                .sum::<f64>()
                .sqrt();
            worst = worst.max((a as f64 - b as f64).abs() / (2.0 * tol * norm));
        }
        report(&format!(
            "parity {name:9} int4  fp16       L={loops}: logprobs_decode({seq}) worst |Δ| / bound {worst:.2e} {}",
            if worst <= 1.0 { "ok" } else { "FAIL" }
        ));
        if g.len() != c.len() || worst > 1.0 {
            failures.push(format!(
                "{name} loops={loops}: logprobs_decode {worst:.3e} of the bound ({} values)",
                g.len()
            ));
        }
    }
}

/// Greedy generation in KV mode `mode`: identical tokens, except after a near tie. The logits
/// of the two backends differ by at most `tol · ‖logits‖₂` per element (the parity bound), so
/// the GPU may pick another token only where the CPU's best two logits are within twice that;
/// a difference there ends the comparison of that run (reported), any other is a failure.
fn generate_parity(
    name: &str,
    group: usize,
    prompt_len: usize,
    new_tokens: usize,
    mode: KvMode,
    failures: &mut Vec<String>,
) {
    let bits_list: &[u32] = if mode == KvMode::Fp16 {
        &[4, 2, 16]
    } else {
        &[4]
    };
    for &bits in bits_list {
        let path = synth(name, bits, group);
        let max_seq = prompt_len + new_tokens + 8;
        let cpu = open_in(&path, Device::Cpu, max_seq, mode);
        let gpu = open_in(&path, Device::Cuda(0), max_seq, mode);
        let config = cpu.config().clone();
        for &loops in loop_counts() {
            let tokens = prompt(prompt_len, config.vocab_size, 1000 + loops as u64);
            let params = GenerateParams {
                max_tokens: if quick() { 8 } else { new_tokens },
                loops: Some(loops),
                ..GenerateParams::default()
            };
            let mut cs = cpu.new_session().unwrap();
            let c = cs.generate(&tokens, &params).unwrap();
            let g = gpu
                .new_session()
                .unwrap()
                .generate(&tokens, &params)
                .unwrap();
            let verdict = match c.iter().zip(&g).position(|(a, b)| a != b) {
                None => "identical".to_string(),
                Some(i) => {
                    let mut seq = tokens.clone();
                    seq.extend(&c[..i]);
                    let l = cs.score_last(&seq, Some(loops)).unwrap();
                    let tol = mode_tol(mode, config.applications(loops), config.head_dim());
                    let norm = l.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt();
                    let margin = (l[c[i] as usize] - l[g[i] as usize]) as f64;
                    let near_tie = margin <= 2.0 * tol * norm;
                    if !near_tie {
                        failures.push(format!(
                            "{name} bits={bits} {mode} loops={loops}: greedy tokens differ at {i} \
                             with margin {margin:.3e} > {:.3e}",
                            2.0 * tol * norm
                        ));
                    }
                    let bound = 2.0 * tol * norm;
                    if near_tie {
                        format!(
                            "differ at {i} after a near tie (margin {margin:.2e} <= {bound:.2e})"
                        )
                    } else {
                        format!("differ at {i}, margin {margin:.2e} > {bound:.2e}: FAIL")
                    }
                }
            };
            report(&format!(
                "parity {name:9} {:5} {mode:10} L={loops}: greedy {} tokens {verdict}",
                DType::from_bits(bits).unwrap().name(),
                c.len(),
            ));
        }
    }
}

fn finish(test: &str, failures: Vec<String>) {
    assert!(
        failures.is_empty(),
        "{test}: {} failure(s):\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn cuda_parity_tiny() {
    if !cuda_or_skip("cuda_parity_tiny") {
        return;
    }
    let mut failures = Vec::new();
    let fp16 = KvMode::Fp16;
    score_parity("tiny", 64, 24, fp16, &mut failures);
    decode_parity("tiny", 4, 64, 6, fp16, &mut failures);
    decode_parity("tiny", 2, 64, 6, fp16, &mut failures);
    logprobs_decode_parity("tiny", 64, 40, &mut failures);
    generate_parity("tiny", 64, 8, 64, fp16, &mut failures);
    finish("cuda_parity_tiny", failures);
}

#[test]
fn cuda_parity_small() {
    if !cuda_or_skip("cuda_parity_small") {
        return;
    }
    let mut failures = Vec::new();
    let fp16 = KvMode::Fp16;
    score_parity("small", 128, 24, fp16, &mut failures);
    decode_parity("small", 4, 128, 6, fp16, &mut failures);
    generate_parity("small", 128, 8, 64, fp16, &mut failures);
    finish("cuda_parity_small", failures);
}

#[test]
fn cuda_parity_tiny_gqa() {
    if !cuda_or_skip("cuda_parity_tiny_gqa") {
        return;
    }
    let mut failures = Vec::new();
    let fp16 = KvMode::Fp16;
    score_parity("tiny-gqa", 64, 24, fp16, &mut failures);
    decode_parity("tiny-gqa", 4, 64, 6, fp16, &mut failures);
    decode_parity("tiny-gqa", 16, 64, 6, fp16, &mut failures);
    logprobs_decode_parity("tiny-gqa", 64, 40, &mut failures);
    finish("cuda_parity_tiny_gqa", failures);
}

/// The architectures of the public looped families: Ouro's (sandwich norms, the loop norm after
/// every iteration, no head norm) and Huginn's (norms after the residual add, a QKV bias, a scaled
/// embedding, the loop adapter over a random initial state drawn on the host, the loop norm after
/// the loop), in f16 and int8 KV.
#[test]
fn cuda_parity_looped_families() {
    if !cuda_or_skip("cuda_parity_looped_families") {
        return;
    }
    let mut failures = Vec::new();
    for name in ["tiny-sandwich", "tiny-recurrent"] {
        for mode in [KvMode::Fp16, KvMode::Int8] {
            score_parity(name, 64, 24, mode, &mut failures);
            decode_parity(name, 4, 64, 6, mode, &mut failures);
        }
        generate_parity(name, 64, 8, 48, KvMode::Fp16, &mut failures);
    }
    finish("cuda_parity_looped_families", failures);
}

/// The checkpoint folder `tests/data/hf/{model}` (run from the repository root) and its f16
/// conversion, written for this process.
fn converted_hf(model: &str) -> (PathBuf, PathBuf) {
    use tinyloop::convert::{convert, ConvertOptions, Input, Method};
    let dir = Path::new("tests/data/hf").join(model);
    let out = std::env::temp_dir().join(format!(
        "tinyloop-cuda-{model}-{}.tinyloop",
        std::process::id()
    ));
    if !out.exists() {
        // Written under a temporary name: a test running beside this one may read it already.
        let tmp = out.with_extension(format!("tmp{:?}", std::thread::current().id()));
        convert(&ConvertOptions {
            input: Input::HuggingFace(dir.clone()),
            out: tmp.clone(),
            bits: 16,
            group_size: 0,
            method: Method::Rtn,
            calibration: Vec::new(),
            calibration_loops: None,
            window: 0,
            metadata: Default::default(),
            progress: false,
        })
        .unwrap();
        std::fs::rename(&tmp, &out).unwrap();
    }
    (dir, out)
}

/// Ouro and Huginn checkpoints converted from their Hugging Face folders (tests/data/hf, run from
/// the repository root) against their reference code's logits, on the GPU: the bound of
/// tests/hf.rs (4e-3) plus the GPU's reordering, which the CPU comparison above bounds.
#[test]
fn cuda_hf_checkpoints_match_their_reference() {
    if !cuda_or_skip("cuda_hf_checkpoints_match_their_reference") {
        return;
    }
    let mut failures = Vec::new();
    for (model, steps, state_init) in [
        ("ouro-tiny", [1usize, 2, 4], tinyloop::StateInit::Model),
        ("huginn-tiny", [1, 3, 8], tinyloop::StateInit::Zeros),
    ] {
        let (dir, out) = converted_hf(model);
        let options = ModelOptions {
            device: Some(Device::Cuda(0)),
            max_seq_len: 64,
            log: false,
            state_init,
            ..ModelOptions::default()
        };
        let gpu = Model::open(&out, &options).unwrap();
        let reference = dir.join("reference");
        let json: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(reference.join("reference.json")).unwrap(),
        )
        .unwrap();
        let prompt: Vec<u32> = json["prompt_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let mut session = gpu.new_session().unwrap();
        for loops in steps {
            let actual = session.score(&prompt, Some(loops)).unwrap();
            let bytes = std::fs::read(reference.join(format!("logits_steps{loops}.f32"))).unwrap();
            let expected: Vec<f32> = bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            let err = rel(&actual, &expected);
            report(&format!("{model} reference L={loops}: {err:.3e}"));
            if err >= 4e-3 {
                failures.push(format!("{model} at {loops} steps: relative L2 {err:.2e}"));
            }
        }
    }
    finish("cuda_hf_checkpoints_match_their_reference", failures);
}

/// An `.i32` array of a reference folder (tests/data/hf/README.md), as token ids or counts.
fn reference_ints(reference: &Path, file: &str) -> Vec<u32> {
    std::fs::read(reference.join(file))
        .unwrap()
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes(b.try_into().unwrap()) as u32)
        .collect()
}

/// A reference folder's `reference.json`.
fn reference_json(reference: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(reference.join("reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Ouro's exit gate on the GPU: the exit iteration of every position at thresholds 0.3 … 0.9 and
/// greedy generation at 0.5 equal the reference code's (tests/data/hf/ouro-tiny); the skip
/// policy (KV entries copied on the device) generates what it generates on the CPU.
#[test]
fn cuda_exit_rule_matches_the_reference() {
    if !cuda_or_skip("cuda_exit_rule_matches_the_reference") {
        return;
    }
    use tinyloop::{Exit, ExitPolicy, ExitRule};
    let (dir, out) = converted_hf("ouro-tiny");
    let reference = dir.join("reference");
    let ints = |file: &str| reference_ints(&reference, file);
    let json = reference_json(&reference);
    let ids = |key: &str| -> Vec<u32> {
        json[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect()
    };
    let gate = |t: f64, policy| Exit {
        rule: ExitRule::Gate { threshold: Some(t) },
        policy,
    };
    let gpu = open(&out, Device::Cuda(0), 64);
    let cpu = open(&out, Device::Cpu, 64);
    let mut failures = Vec::new();
    let prompt = ids("prompt_ids");
    let steps = ints("exit_steps_steps4.i32");
    let mut session = gpu.new_session().unwrap();
    for (i, t) in [0.3, 0.5, 0.7, 0.9].into_iter().enumerate() {
        let (_, exits) = session
            .score_exit(
                &prompt,
                prompt.len(),
                Some(4),
                gate(t, ExitPolicy::Reference),
            )
            .unwrap();
        let expected: Vec<u32> = steps[i * prompt.len()..(i + 1) * prompt.len()]
            .iter()
            .map(|&s| s + 1)
            .collect();
        if exits != expected {
            failures.push(format!(
                "threshold {t}: exits {exits:?}, reference {expected:?}"
            ));
        }
    }
    let short = ids("generation_prompt_ids");
    let generate = |model: &Model, policy| {
        let params = GenerateParams {
            max_tokens: 16,
            loops: Some(4),
            exit: Some(gate(0.5, policy)),
            ..GenerateParams::default()
        };
        let mut s = model.new_session().unwrap();
        let tokens = s.generate(&short, &params).unwrap();
        (tokens, s.last_generate_stats().exit_steps)
    };
    let (tokens, exits) = generate(&gpu, ExitPolicy::Reference);
    let expected_exits: Vec<u32> = ints("generate_steps4_exit0.5_exit_steps.i32")
        .iter()
        .map(|&s| s + 1)
        .collect();
    if tokens != ints("generate_steps4_exit0.5.i32") || exits != expected_exits {
        failures.push(format!("generation at 0.5: {tokens:?} exits {exits:?}"));
    }
    let (gpu_skip, cpu_skip) = (
        generate(&gpu, ExitPolicy::Skip),
        generate(&cpu, ExitPolicy::Skip),
    );
    report(&format!(
        "exit skip: gpu exits {:?}, cpu exits {:?}",
        gpu_skip.1, cpu_skip.1
    ));
    if gpu_skip != cpu_skip {
        failures.push(format!("skip: gpu {gpu_skip:?}, cpu {cpu_skip:?}"));
    }
    // Speculation (multi-row verify steps reading the gate) and a prefix cache give the plain
    // call's tokens and exits.
    let params = GenerateParams {
        max_tokens: 16,
        loops: Some(4),
        exit: Some(gate(0.5, ExitPolicy::Reference)),
        ..GenerateParams::default()
    };
    let mut s = gpu.new_session().unwrap();
    let spec = tinyloop::Speculation {
        draft_loops: 2,
        draft_len: 3,
        reuse: true,
    };
    let drafted = s
        .generate_speculative(&short, &params, &spec, &mut |_| true)
        .unwrap();
    let drafted = (drafted, s.last_generate_stats().exit_steps);
    let cache = s.build_prefix_cache(&short[..5], Some(4)).unwrap();
    let after = s
        .generate_with_prefix(&cache, &short[5..], &params, &mut |_| true)
        .unwrap();
    let after = (after, s.last_generate_stats().exit_steps);
    for (what, got) in [("speculation", drafted), ("prefix cache", after)] {
        if got != (tokens.clone(), exits.clone()) {
            failures.push(format!("{what} at 0.5: {got:?}"));
        }
    }
    finish("cuda_exit_rule_matches_the_reference", failures);
}

/// Huginn's exit criteria on the GPU (tests/data/hf/huginn-tiny): generation with three of them
/// (16 tokens, at most 32 iterations per call, zero initial state) gives the reference code's
/// tokens and iterations, its later tokens attending through the depth mask in the decode
/// kernel. With the prompt cut into steps of 5 rows (each a call of its own: multi-row steps
/// attend through the depth mask in the flash kernel) and in KV mode int8 (the quantized
/// kernel), the GPU generates what the CPU generates.
#[test]
fn cuda_exit_criteria_match_the_reference() {
    if !cuda_or_skip("cuda_exit_criteria_match_the_reference") {
        return;
    }
    use tinyloop::{Exit, ExitPolicy};
    let (dir, out) = converted_hf("huginn-tiny");
    let reference = dir.join("reference");
    let ints = |file: &str| reference_ints(&reference, file);
    let json = reference_json(&reference);
    let prompt: Vec<u32> = json["generation_prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let open_with = |device, kv_mode, prefill_chunk| {
        let options = ModelOptions {
            device: Some(device),
            max_seq_len: 64,
            kv_mode: Some(kv_mode),
            prefill_chunk,
            state_init: tinyloop::StateInit::Zeros,
            log: false,
            ..ModelOptions::default()
        };
        Model::open(&out, &options).unwrap()
    };
    let generate = |model: &Model, rule: &str| {
        let params = GenerateParams {
            max_tokens: 16,
            loops: Some(32),
            exit: Some(Exit {
                rule: rule.parse().unwrap(),
                policy: ExitPolicy::Reference,
            }),
            ..GenerateParams::default()
        };
        let mut s = model.new_session().unwrap();
        let tokens = s.generate(&prompt, &params).unwrap();
        (tokens, s.last_generate_stats())
    };
    // Each run is judged as tests/hf.rs judges the CPU's (common::exit_agreement): criterion
    // values within the noise of f16 activations, the same decisions wherever the other run's
    // value is clear of the threshold by more than that; a decision taken differently inside the
    // noise ends the comparison.
    let mut failures = Vec::new();
    let mut judge = |what: String, rule: &str, got: &(Vec<u32>, GenerateStats), other: Other| {
        let threshold: f64 = rule.split(':').nth(1).unwrap().parse().unwrap();
        let outcome = agreement(
            rule, threshold, &got.0, &got.1, &other.0, &other.1, &other.2,
        );
        match outcome {
            Ok(Agreement::Full) => report(&format!("{what}: every token and exit equal")),
            Ok(Agreement::Noise { token, step, .. }) => report(&format!(
                "{what}: equal up to token {token}, which decides otherwise at iteration {step} \
                 inside the noise"
            )),
            Err(e) => failures.push(format!("{what}: {e}")),
        }
    };
    let gpu = open_with(Device::Cuda(0), KvMode::Fp16, 0);
    let runs = [
        ("kl_explicit", "kl:0.005"),
        ("entropy_diff_explicit", "entropy-diff:0.02"),
        ("argmax_stability_explicit", "argmax-stability:2"),
    ];
    for (name, rule) in runs {
        let floats = |file: &str| -> Vec<f32> {
            std::fs::read(reference.join(file))
                .unwrap()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect()
        };
        let expected = (
            ints(&format!("adaptive_{name}_tokens.i32")),
            ints(&format!("adaptive_{name}_steps.i32")),
            floats(&format!("adaptive_{name}_exit_values.f32")),
        );
        let got = generate(&gpu, rule);
        judge(format!("{rule} gpu vs reference"), rule, &got, expected);
    }
    // A prompt cut into steps (each exits as a call of its own, only the last one's values are
    // kept) and int8 entries add discontinuities the noise above does not cover: an earlier
    // step's or a near tie's decision may differ from the CPU's unseen. There each run must
    // decide as its own values say, and the CPU's agreement is reported; the masked attention
    // itself is compared with the CPU's in every mode by cuda_depth_mask_matches_cpu.
    for (kv_mode, chunk) in [(KvMode::Fp16, 5), (KvMode::Int8, 0)] {
        let (gpu, cpu) = (
            open_with(Device::Cuda(0), kv_mode, chunk),
            open_with(Device::Cpu, kv_mode, chunk),
        );
        for (_, rule) in runs {
            let threshold: f64 = rule.split(':').nth(1).unwrap().parse().unwrap();
            let (on_gpu, on_cpu) = (generate(&gpu, rule), generate(&cpu, rule));
            if let Err(e) = self_consistent(rule, threshold, &on_gpu.1, 32) {
                failures.push(format!("{rule} {kv_mode} chunk {chunk}: gpu {e}"));
            }
            let same = (on_gpu.0 == on_cpu.0) && (on_gpu.1.exit_steps == on_cpu.1.exit_steps);
            report(&format!(
                "{rule} {kv_mode} chunk {chunk}: gpu exits {:?}, cpu exits {:?}{}",
                on_gpu.1.exit_steps,
                on_cpu.1.exit_steps,
                if same { " (equal)" } else { "" }
            ));
        }
    }
    finish("cuda_exit_criteria_match_the_reference", failures);
}

/// Another run's tokens, exit iterations and criterion values (`steps` per token, NaN-padded).
type Other = (Vec<u32>, Vec<u32>, Vec<f32>);

/// Group size 16: every linear takes the generic (elementwise-dequantize) kernel.
#[test]
fn cuda_parity_generic_kernels() {
    if !cuda_or_skip("cuda_parity_generic_kernels") {
        return;
    }
    let mut failures = Vec::new();
    for mode in ["fp16", "fp16-h", "int8"] {
        let mode = mode.parse().unwrap();
        score_parity("tiny", 16, 24, mode, &mut failures);
        decode_parity("tiny", 4, 16, 4, mode, &mut failures);
    }
    finish("cuda_parity_generic_kernels", failures);
}

#[test]
fn cuda_parity_tl407m() {
    if !cuda_or_skip("cuda_parity_tl407m") {
        return;
    }
    let mut failures = Vec::new();
    for mode in MODES {
        let mode = mode.parse().unwrap();
        score_parity("tl-407m", 128, 12, mode, &mut failures);
        decode_parity("tl-407m", 4, 128, 3, mode, &mut failures);
    }
    finish("cuda_parity_tl407m", failures);
}

/// Every KV mode on whole models: score, decode through graphs (modes that capture), and greedy
/// generation long enough (8 + 200 tokens) for age 64:128 to move entries across both boundaries.
#[test]
fn cuda_parity_kv_modes() {
    if !cuda_or_skip("cuda_parity_kv_modes") {
        return;
    }
    let mut failures = Vec::new();
    for mode in MODES {
        let mode = mode.parse().unwrap();
        for name in ["tiny", "tiny-gqa"] {
            score_parity(name, 64, 24, mode, &mut failures);
            decode_parity(name, 4, 64, 6, mode, &mut failures);
        }
        generate_parity("tiny", 64, 8, 200, mode, &mut failures);
    }
    finish("cuda_parity_kv_modes", failures);
}

/// Chunked prefill against single shot on the GPU, in every KV mode: logits after the prompt
/// and during decode, and the greedy tokens. Bit-identical in every mode but age, whatever the
/// chunks: every step of the prompt takes the kernels of the whole prompt's rows (the
/// tensor-core GEMM and unsplit attention, whose per-row results do not depend on how many rows
/// a step has), also chunks of 1 to 4 rows, which alone would take the GEMV and split attention
/// (chunks of 7, 66 and 199 leave tails of 4, 2 and 1 rows; chunks of 3 are all that small). In
/// age mode, entries that crossed a tier boundary between chunks were quantized twice; the
/// envelope is derived in tests/kv.rs.
#[test]
fn cuda_chunked_prefill_matches_single_shot() {
    if !cuda_or_skip("cuda_chunked_prefill_matches_single_shot") {
        return;
    }
    let path = synth("tiny-gqa", 4, 64);
    let file = ModelFile::open(&path).unwrap();
    let config = file.config.clone();
    let engine = gpu();
    let max_seq = 256;
    let weights = Weights::load(&engine, &file, max_seq).unwrap();
    engine.finish_load(&weights).unwrap();
    let session = engine.session(&config).unwrap();
    let prompt = prompt(200, config.vocab_size, 77);
    let run = |mode: KvMode, chunk| {
        let layout = KvLayout::new(&config, mode, max_seq).unwrap();
        prefill_and_decode(&session, &weights, layout, chunk, &prompt, 3, 8)
    };
    let worst = |a: &[Vec<f32>], b: &[Vec<f32>]| {
        a.iter().zip(b).map(|(x, y)| rel(x, y)).fold(0f64, f64::max)
    };
    for mode in MODES {
        let mode: KvMode = mode.parse().unwrap();
        let (single, single_tokens) = run(mode, 0);
        for chunk in [8, 40, 7, 66, 199, 3] {
            let (chunked, tokens) = run(mode, chunk);
            let e = worst(&chunked, &single);
            if matches!(mode, KvMode::Age(_)) {
                // tests/kv.rs: at most twice what the INT4 tiers change against delta.
                let envelope = 2.0 * worst(&single, &run(KvMode::Delta, 0).0);
                report(&format!(
                    "chunked {mode:10} chunk {chunk}: rel {e:.2e} vs single shot (envelope {envelope:.2e})"
                ));
                assert!(
                    e <= envelope,
                    "{mode} chunk {chunk}: {e:.3e} > {envelope:.3e}"
                );
            } else {
                assert_eq!(tokens, single_tokens, "{mode} chunk {chunk}: tokens");
                assert_eq!(e, 0.0, "{mode} chunk {chunk}: logits differ by {e:.3e}");
                report(&format!("chunked {mode:10} chunk {chunk}: bit-identical"));
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The FP16 body cache (docs/FORMAT.md "The FP16 body cache")

/// Whole-model tolerance with the FP16 body cache: `model_tol(A)` plus the rounding of every
/// block's weights to f16 (module doc, "FP16 body cache").
fn fp16_body_tol(config: &ModelConfig, loops: usize) -> f64 {
    let applications = config.applications(loops);
    fp16_kv_tol(applications) + (6 * applications) as f64 * 2f64.powi(-11)
}

/// Elements of the linear weights of every block (pre, loop and post), each applied once.
fn block_weight_elements(c: &ModelConfig) -> usize {
    let (d, f) = (c.dim, c.ffn_dim);
    let per_block = c.qkv_dim() * d + d * d + 3 * f * d;
    per_block * (c.n_pre_blocks + c.n_loop_blocks + c.n_post_blocks)
}

fn open_fp16_body(path: &Path, max_seq_len: usize) -> Model {
    let options = ModelOptions {
        max_seq_len,
        device: Some(Device::Cuda(0)),
        kv_mode: Some(KvMode::Fp16),
        log: false,
        fp16_body: Some(true),
        ..ModelOptions::default()
    };
    Model::open(path, &options)
        .unwrap_or_else(|e| panic!("open {} with the FP16 body cache: {e}", path.display()))
}

/// Prefill logits with the FP16 body cache against the CPU reference at ragged row counts
/// (cuBLAS M: 17, 100, 513; N and K are the models' widths, e.g. 192 and 64 on tiny, 6144 and
/// 2048 on tl-407m), and one row, which keeps the GEMV on the codes and so the plain tolerance.
/// The model's memory must count the copies, 2 bytes per block weight.
#[test]
fn cuda_fp16_body_matches_cpu() {
    if !cuda_or_skip("cuda_fp16_body_matches_cpu") {
        return;
    }
    let mut failures = Vec::new();
    for (name, group, bits, lengths) in [
        ("tiny", 64, 4, &[17usize, 100, 513][..]),
        ("tiny", 64, 2, &[17, 513][..]),
        ("tiny", 16, 4, &[17, 100][..]), // group 16: weights the fast kernels do not take
        ("tiny-gqa", 64, 4, &[17, 100][..]),
        ("tl-407m", 128, 4, &[17][..]),
    ] {
        let path = synth(name, bits, group);
        let cpu = open(&path, Device::Cpu, 600);
        let gpu = open_fp16_body(&path, 600);
        let plain = open(&path, Device::Cuda(0), 600);
        let config = cpu.config().clone();
        assert_eq!(
            gpu.memory_bytes() - plain.memory_bytes(),
            2 * block_weight_elements(&config),
            "{name}: the FP16 copies of every block's weights are counted in the model's memory"
        );
        let (mut cs, mut gs) = (cpu.new_session().unwrap(), gpu.new_session().unwrap());
        for &loops in loop_counts() {
            let tol = fp16_body_tol(&config, loops);
            for &n in lengths {
                let tokens = prompt(n, config.vocab_size, n as u64);
                let e = rel(
                    &gs.score(&tokens, Some(loops)).unwrap(),
                    &cs.score(&tokens, Some(loops)).unwrap(),
                );
                let ok = e <= tol;
                report(&format!(
                    "fp16-body {name:9} b{bits} L={loops}: score({n}) rel {e:.2e}, tol {tol:.2e} {}",
                    if ok { "ok" } else { "FAIL" }
                ));
                if !ok {
                    failures.push(format!(
                        "{name} b{bits} L={loops} n={n}: {e:.3e} > {tol:.3e}"
                    ));
                }
            }
            let one = &prompt(1, config.vocab_size, 5)[..];
            let plain_tol = model_tol(config.applications(loops));
            let e1 = rel(
                &gs.score_last(one, Some(loops)).unwrap(),
                &cs.score_last(one, Some(loops)).unwrap(),
            );
            report(&format!(
                "fp16-body {name:9} b{bits} L={loops}: score_last(1) rel {e1:.2e}, tol {plain_tol:.2e}"
            ));
            if e1 > plain_tol {
                failures.push(format!(
                    "{name} b{bits} L={loops} one row: {e1:.3e} > {plain_tol:.3e}"
                ));
            }
        }
    }
    finish("cuda_fp16_body_matches_cpu", failures);
}

/// With the FP16 body cache, chunked prefill stays bit-identical to single shot (every step of
/// the prompt takes cuBLAS, whose result for a row must not depend on the rows beside it; chunks
/// of 129, 7 and 519 leave tails of 4, 2 and 1 rows), in the fp16 and fp16-h KV modes, logits and
/// greedy tokens.
#[test]
fn cuda_fp16_body_chunked_prefill_matches_single_shot() {
    if !cuda_or_skip("cuda_fp16_body_chunked_prefill_matches_single_shot") {
        return;
    }
    let path = synth("tiny-gqa", 4, 64);
    let file = ModelFile::open(&path).unwrap();
    let config = file.config.clone();
    let mut engine = gpu();
    let max_seq = 600;
    engine.enable_fp16_body().unwrap();
    let weights = Weights::load(&engine, &file, max_seq).unwrap();
    engine.finish_load(&weights).unwrap();
    let session = engine.session(&config).unwrap();
    let prompt = prompt(520, config.vocab_size, 78);
    for mode in [KvMode::Fp16, KvMode::Fp16H] {
        let run = |chunk| {
            let layout = KvLayout::new(&config, mode, max_seq).unwrap();
            prefill_and_decode(&session, &weights, layout, chunk, &prompt, 3, 8)
        };
        let (single, single_tokens) = run(0);
        for chunk in [8, 40, 130, 129, 7, 519] {
            let (chunked, tokens) = run(chunk);
            let e = chunked
                .iter()
                .zip(&single)
                .map(|(x, y)| rel(x, y))
                .fold(0f64, f64::max);
            report(&format!(
                "fp16-body chunked {mode:7} chunk {chunk}: rel {e:.2e}"
            ));
            assert_eq!(tokens, single_tokens, "{mode} chunk {chunk}: tokens");
            assert_eq!(e, 0.0, "{mode} chunk {chunk}: logits differ by {e:.3e}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Device selection (runs everywhere)

#[test]
fn device_selection_falls_back_or_fails_cleanly() {
    let path = synth("tiny", 4, 64);
    let auto = open(&path, Device::Auto, 64);
    let cuda = Model::open(
        &path,
        &ModelOptions {
            device: Some(Device::Cuda(0)),
            log: false,
            ..ModelOptions::default()
        },
    );
    match tinyloop::backend::cuda::available() {
        Ok(_) => {
            assert!(
                auto.info().device.starts_with("cuda:0"),
                "{}",
                auto.info().device
            );
            assert!(cuda.is_ok());
            let missing = Model::open(
                &path,
                &ModelOptions {
                    device: Some(Device::Cuda(4096)),
                    log: false,
                    ..ModelOptions::default()
                },
            );
            assert!(matches!(missing, Err(Error::Device(_))), "{missing:?}");
        }
        Err(why) => {
            assert!(
                auto.info().device.starts_with("cpu"),
                "{}",
                auto.info().device
            );
            match cuda {
                Err(Error::Device(msg)) => assert!(msg.contains("cuda:0"), "{msg}"),
                other => {
                    panic!("--device cuda without a GPU must be a device error, got {other:?}")
                }
            }
            let _ = writeln!(
                std::io::stderr(),
                "no CUDA here ({why}): checked the CPU fallback and the clean error"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The looped-model calls

/// Whether greedy runs `a` and `b` agree, or part where the CPU reference's best two logits are
/// within `2 · bound · ‖logits‖` of each other (a near tie that logits differing by `bound`
/// relative may flip). Returns a description; records a failure otherwise.
#[allow(clippy::too_many_arguments)]
fn same_or_near_tie(
    what: &str,
    a: &[u32],
    b: &[u32],
    prompt: &[u32],
    reference: &mut tinyloop::Session,
    loops: usize,
    bound: f64,
    failures: &mut Vec<String>,
) -> String {
    let Some(i) = a.iter().zip(b).position(|(x, y)| x != y) else {
        if a.len() != b.len() {
            failures.push(format!("{what}: {} vs {} tokens", a.len(), b.len()));
        }
        return "identical".into();
    };
    let mut seq = prompt.to_vec();
    seq.extend(&a[..i]);
    let l = reference.score_last(&seq, Some(loops)).unwrap();
    let norm = l.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt();
    let margin = (l[a[i] as usize] - l[b[i] as usize]).abs() as f64;
    if margin > 2.0 * bound * norm {
        failures.push(format!(
            "{what}: tokens differ at {i} with margin {margin:.3e} > {:.3e}",
            2.0 * bound * norm
        ));
    }
    format!("differ at {i} after a near tie (margin {margin:.2e})")
}

/// Logit lens, trajectory, speculative decoding, prefix caches and resume handles on the GPU.
///
/// * Lens rows against the CPU within `model_tol` of their depth; on the GPU itself, row L is
///   bit-identical to `score_last` at L and the rows at L′ are the first rows at L (the same
///   kernels on the same rows).
/// * Speculative greedy output against the GPU's plain greedy output: the verify step computes
///   k + 1 rows with the multi-row kernels where plain decoding computes one row with the fused
///   GEMV, so logits differ by up to twice the GPU–CPU bound; tokens may part only at a near tie
///   of that size (`same_or_near_tie`).
/// * Prefix cache (prompt of 6 rows) and resume handle: bit-identical to a fresh generation. Steps
///   of more than 4 rows take the tensor-core GEMM and unsplit attention, whose per-row results do
///   not depend on the rows beside them, and a resume handle runs the same kernels on the same
///   rows as the fresh prefill.
#[test]
fn cuda_looped_calls_match() {
    if !cuda_or_skip("cuda_looped_calls_match") {
        return;
    }
    let mut failures = Vec::new();
    for name in ["tiny", "tiny-gqa"] {
        let path = synth(name, 4, 64);
        let cpu = open(&path, Device::Cpu, 256);
        let gpu = open(&path, Device::Cuda(0), 256);
        let config = cpu.config().clone();
        let vocab = config.vocab_size;
        let (mut cs, mut gs) = (cpu.new_session().unwrap(), gpu.new_session().unwrap());
        let tokens = prompt(19, vocab, 31);

        let (c, g) = (
            cs.score_logit_lens(&tokens, Some(6)).unwrap(),
            gs.score_logit_lens(&tokens, Some(6)).unwrap(),
        );
        let mut worst = 0f64;
        for l in 1..=6 {
            let row = |v: &[f32]| v[(l - 1) * vocab..l * vocab].to_vec();
            let e = rel(&row(&g), &row(&c));
            worst = worst.max(e);
            let tol = fp16_kv_tol(config.applications(l));
            if e > tol {
                failures.push(format!("{name} lens row {l}: {e:.3e} > {tol:.3e}"));
            }
            if row(&g) != gs.score_last(&tokens, Some(l)).unwrap() {
                failures.push(format!("{name}: GPU lens row {l} != GPU score_last at {l}"));
            }
        }
        if gs.score_logit_lens(&tokens, Some(3)).unwrap()[..] != g[..3 * vocab] {
            failures.push(format!(
                "{name}: GPU lens rows at 3 are not the first rows at 6"
            ));
        }
        let (ct, gt) = (
            cs.score_trajectory(&tokens, Some(6)).unwrap(),
            gs.score_trajectory(&tokens, Some(6)).unwrap(),
        );
        let same_argmax = ct
            .iter()
            .zip(&gt)
            .filter(|(a, b)| a.argmax == b.argmax)
            .count();
        report(&format!(
            "looped {name:9}: lens rows rel {worst:.2e} (tol L=6 {:.2e}); trajectory argmax equal \
             at {same_argmax}/6 iterations",
            fp16_kv_tol(config.applications(6))
        ));

        let loops = 6;
        let params = GenerateParams {
            max_tokens: 48,
            loops: Some(loops),
            ..GenerateParams::default()
        };
        let plain = gs.generate(&tokens, &params).unwrap();
        let bound = 2.0 * fp16_kv_tol(config.applications(loops));
        for (draft_loops, draft_len) in [(1, 4), (2, 8), (3, 2)] {
            for reuse in [true, false] {
                let spec = tinyloop::Speculation {
                    draft_loops,
                    draft_len,
                    reuse,
                };
                let out = gs
                    .generate_speculative(&tokens, &params, &spec, &mut |_| true)
                    .unwrap();
                let stats = gs.last_generate_stats();
                let what = format!("{name} speculative {draft_loops}/{draft_len} reuse {reuse}");
                let verdict = same_or_near_tie(
                    &what,
                    &plain,
                    &out,
                    &tokens,
                    &mut cs,
                    loops,
                    bound,
                    &mut failures,
                );
                report(&format!(
                    "looped {what}: {verdict}; accepted {}/{} drafts, agreement {:.2}",
                    stats.accepted,
                    stats.drafted,
                    stats.agreement()
                ));
            }
        }

        let prefix = prompt(23, vocab, 5);
        let rest = prompt(6, vocab, 6);
        let mut whole = prefix.clone();
        whole.extend(&rest);
        let fresh = gs.generate(&whole, &params).unwrap();
        let cache = gs.build_prefix_cache(&prefix, Some(loops)).unwrap();
        let mut other = gpu.new_session().unwrap();
        let cached = other
            .generate_with_prefix(&cache, &rest, &params, &mut |_| true)
            .unwrap();
        if cached != fresh {
            failures.push(format!(
                "{name}: prefix cache output differs from the whole text's"
            ));
        }
        let handle = gs.build_resume_handle(&tokens, Some(4)).unwrap();
        for l2 in [2, 4, 6] {
            let p = GenerateParams {
                loops: Some(l2),
                ..params.clone()
            };
            let fresh = gs.generate(&tokens, &p).unwrap();
            let resumed = other.resume_generate(&handle, &p, &mut |_| true).unwrap();
            if resumed != fresh {
                failures.push(format!(
                    "{name}: resume from 4 at {l2} differs from a fresh run"
                ));
            }
        }
        report(&format!(
            "looped {name:9}: prefix cache and resume (from 4 at 2, 4, 6) bit-identical: {}",
            failures.is_empty()
        ));
    }
    finish("cuda_looped_calls_match", failures);
}

/// Speculative greedy output against the GPU's plain greedy output in every KV mode, with and
/// without a tier policy (LONG from inside the prompt, or from inside the generation): rounds are
/// cut at every tier change (CTX-TIER and age), so the verify step computes the rows one-token
/// steps compute, up to the multi-row kernels' summation order: tokens may part only at a near
/// tie of twice the mode's GPU–CPU bound (`same_or_near_tie`). In age mode 9 + 240 tokens cross
/// the `age:64:128` bounds.
#[test]
fn cuda_speculation_matches_plain_in_every_mode_and_tier() {
    if !cuda_or_skip("cuda_speculation_matches_plain_in_every_mode_and_tier") {
        return;
    }
    let mut failures = Vec::new();
    let path = synth("tiny", 4, 64);
    let loops = 6;
    for mode in MODES {
        let kv: KvMode = mode.parse().unwrap();
        let gpu = open_in(&path, Device::Cuda(0), 256, kv);
        let cpu = open_in(&path, Device::Cpu, 256, kv);
        let config = gpu.config().clone();
        let bound = 2.0 * mode_tol(kv, config.applications(loops), config.head_dim());
        let tokens = prompt(9, config.vocab_size, 7);
        let (mut gs, mut cs) = (gpu.new_session().unwrap(), cpu.new_session().unwrap());
        let max_tokens = if mode.starts_with("age") { 240 } else { 48 };
        for policy in [None, Some(tier(4, 6)), Some(tier(4, 37))] {
            let params = GenerateParams {
                max_tokens,
                loops: Some(loops),
                ctx_tier: policy.clone(),
                ..GenerateParams::default()
            };
            let plain = gs.generate(&tokens, &params).unwrap();
            for (draft_loops, draft_len, reuse) in [(2, 7, true), (5, 15, false), (1, 3, true)] {
                let spec = tinyloop::Speculation {
                    draft_loops,
                    draft_len,
                    reuse,
                };
                let out = gs
                    .generate_speculative(&tokens, &params, &spec, &mut |_| true)
                    .unwrap();
                let long_t = policy.as_ref().map(|p| p.long_t);
                let what = format!("{mode} long_t {long_t:?} speculative {spec:?}");
                let verdict = match plain.iter().zip(&out).position(|(a, b)| a != b) {
                    None if plain.len() == out.len() => "identical".to_string(),
                    None => {
                        failures.push(format!("{what}: {} vs {} tokens", plain.len(), out.len()));
                        continue;
                    }
                    Some(i) => {
                        // The margin between the two tokens under the CPU reference with the
                        // same policy (a difference of logprobs is one of logits), against the
                        // bound relative to the logits' norm.
                        let mut seq = tokens.clone();
                        seq.extend(&plain[..i]);
                        let norm = l2(&cs.score_last(&seq, Some(loops)).unwrap());
                        let last_logprob = |t: u32, cs: &mut tinyloop::Session| {
                            let mut with = seq.clone();
                            with.push(t);
                            let lp = cs.logprobs_with(&with, Some(loops), policy.as_ref());
                            *lp.unwrap().last().unwrap() as f64
                        };
                        let margin =
                            (last_logprob(plain[i], &mut cs) - last_logprob(out[i], &mut cs)).abs();
                        if margin > 2.0 * bound * norm {
                            failures.push(format!(
                                "{what}: tokens differ at {i} with margin {margin:.3e} > {:.3e}",
                                2.0 * bound * norm
                            ));
                        }
                        format!("differ at {i} after a near tie (margin {margin:.2e})")
                    }
                };
                report(&format!("speculation {what}: {verdict}"));
            }
        }
    }
    finish(
        "cuda_speculation_matches_plain_in_every_mode_and_tier",
        failures,
    );
}

fn l2(v: &[f32]) -> f64 {
    v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt()
}

// CTX-TIER on the GPU: the re-pack kernel against the host routine, and the tier switch inside
// whole models (tests/ctx_tier.rs has the same checks on the CPU).

fn tier(short_t: usize, long_t: usize) -> tinyloop::CtxTier {
    tinyloop::CtxTier {
        short_t,
        long_t,
        ..tinyloop::CtxTier::default()
    }
}

fn tier_greedy(max_tokens: usize, ctx_tier: Option<tinyloop::CtxTier>) -> GenerateParams {
    GenerateParams {
        max_tokens,
        loops: Some(4),
        ctx_tier,
        ..GenerateParams::default()
    }
}

/// The `requantize_group` kernel gives exactly the codes, scales and zeros of
/// `QuantizedMatrix::requantize` (exact: the same f32 operations, IEEE division, rounding half
/// away from zero, f16 round-to-nearest-even), including per-row groups and the tl-407m
/// `mlp_down` shape; and a downloaded weight is the uploaded one.
#[test]
fn cuda_requantize_matches_the_host_repack() {
    if !cuda_or_skip("cuda_requantize_matches_the_host_repack") {
        return;
    }
    let b = gpu();
    let mut rng = Rng::new(17);
    for (rows, cols, group) in [
        (64, 256, 128),
        (48, 96, 32),
        (8, 2048, 2048),
        (3, 64, 4),
        (5, 40, 8),
        (2048, 8192, 128),
    ] {
        let w = randn(&mut rng, rows * cols, 0.05);
        let int4 = quantize_rtn(&w, rows, cols, DType::Int4, group).unwrap();
        let bytes = int4.to_bytes();
        let host = HostLinear {
            rows,
            cols,
            dtype: DType::Int4,
            group_size: group,
            bytes: &bytes,
        };
        let uploaded = b.upload_linear(&host).unwrap();
        assert_eq!(b.download_linear(&uploaded).unwrap().bytes, bytes);
        let repacked = b.requantize_linear(&uploaded, DType::Int2).unwrap();
        let down = b.download_linear(&repacked).unwrap();
        assert_eq!((down.dtype, down.group_size), (DType::Int2, group));
        let expected = int4.requantize(DType::Int2).unwrap().to_bytes();
        let first_bad = down.bytes.iter().zip(&expected).position(|(a, e)| a != e);
        assert_eq!(
            first_bad, None,
            "{rows}x{cols} g{group}: first differing byte"
        );
        assert_eq!(down.bytes.len(), expected.len());
    }
}

/// A model whose head `requantize --head-bits` quantized (INT4 and INT2, groups of 32) scores on
/// the GPU as on the CPU: the head takes the quantized product kernels, the tensor-core GEMM for
/// 24 rows and the GEMV for the last row, within the whole-model bound.
#[test]
fn cuda_quantized_head_matches_cpu() {
    if !cuda_or_skip("cuda_quantized_head_matches_cpu") {
        return;
    }
    use tinyloop::convert::requantize::{requantize_model, Requantization};
    let mut failures = Vec::new();
    let source = ModelFile::open(synth("small", 4, 32)).unwrap();
    for dtype in [DType::Int4, DType::Int2] {
        let plan = Requantization {
            head: Some((dtype, 32)),
            ..Requantization::default()
        };
        let path =
            common::scratch("cuda-quantized-head").join(format!("{}.tinyloop", dtype.name()));
        requantize_model(&source, &plan)
            .unwrap()
            .write(&path)
            .unwrap();
        let (cpu, gpu) = (
            open(&path, Device::Cpu, 128),
            open(&path, Device::Cuda(0), 128),
        );
        let config = cpu.config().clone();
        let tokens = prompt(24, config.vocab_size, 11);
        let (mut cs, mut gs) = (cpu.new_session().unwrap(), gpu.new_session().unwrap());
        for &loops in loop_counts() {
            let tol = model_tol(config.applications(loops));
            let e = rel(
                &gs.score(&tokens, Some(loops)).unwrap(),
                &cs.score(&tokens, Some(loops)).unwrap(),
            );
            let c1 = cs.score_last(&tokens, Some(loops)).unwrap();
            let e1 = rel(&gs.score_last(&tokens, Some(loops)).unwrap(), &c1);
            report(&format!(
                "parity small {} head L={loops}: score(24) rel {e:.2e}, score_last rel {e1:.2e}, tol {tol:.2e}",
                dtype.name()
            ));
            if e > tol || e1 > tol {
                failures.push(format!(
                    "{} head L={loops}: rel {e:.2e} / {e1:.2e} > {tol:.2e}",
                    dtype.name()
                ));
            }
        }
    }
    finish("cuda_quantized_head_matches_cpu", failures);
}

/// Device bytes of one uploaded weight: codes, parameters at the next 256-byte boundary, the
/// whole allocation rounded up to 256 bytes (src/backend/cuda/linear.rs, driver.rs).
fn cuda_weight_bytes(rows: usize, cols: usize, bits: usize, group: usize) -> usize {
    let codes = (rows * cols * bits / 8).div_ceil(256) * 256;
    (codes + 4 * rows * (cols / group)).div_ceil(256) * 256
}

/// A prompt across long_t switches at its position (two prefill steps); a call that stays LONG
/// from its first position (short_t = 1 after a LONG call) runs entirely at INT2: the same tokens
/// as a model whose loop body was re-quantized on the host (same kernels, same weights: exact). A
/// transition in the middle keeps the tokens chosen before it. Memory follows the bodies the
/// sessions hold.
#[test]
fn cuda_ctx_tier_matches_an_int2_body_model() {
    if !cuda_or_skip("cuda_ctx_tier_matches_an_int2_body_model") {
        return;
    }
    for name in ["small", "tiny-gqa"] {
        let path = synth(name, 4, 32);
        let model = open(&path, Device::Cuda(0), 256);
        let int2 = open(&common::with_int2_loop_body(&path), Device::Cuda(0), 256);
        let vocab = model.config().vocab_size;
        let long_prompt = prompt(10, vocab, 5);
        let mut session = model.new_session().unwrap();
        session
            .generate(&long_prompt, &tier_greedy(16, Some(tier(4, 8))))
            .unwrap();
        let stats = session.last_generate_stats().ctx_tier.unwrap();
        assert_eq!((stats.short_steps, stats.transitions), (1, 1), "{name}");
        let got = session
            .generate(&long_prompt, &tier_greedy(16, Some(tier(1, 8))))
            .unwrap();
        let stats = session.last_generate_stats().ctx_tier.unwrap();
        assert_eq!((stats.short_steps, stats.transitions), (0, 0), "{name}");
        let expected = int2
            .new_session()
            .unwrap()
            .generate(&long_prompt, &tier_greedy(16, None))
            .unwrap();
        assert_eq!(
            got, expected,
            "{name}: all positions at INT2 vs the INT2-body model"
        );

        // A transition at observation 4 (seq_len 8) of a 5-token prompt.
        let short_prompt = prompt(5, vocab, 9);
        let plain = model
            .new_session()
            .unwrap()
            .generate(&short_prompt, &tier_greedy(10, None))
            .unwrap();
        let mut mid = model.new_session().unwrap();
        let switched = mid
            .generate(&short_prompt, &tier_greedy(10, Some(tier(4, 8))))
            .unwrap();
        let stats = mid.last_generate_stats().ctx_tier.unwrap();
        assert_eq!((stats.short_steps, stats.long_steps), (3, 7), "{name}");
        assert_eq!(
            switched[..3],
            plain[..3],
            "{name}: tokens before the transition"
        );
        drop(mid);

        // Both sessions at LONG: INT4 is freed; back at SHORT it is restored exactly.
        let (int4_bytes, int2_bytes) = common::loop_body_bytes(&path, cuda_weight_bytes);
        let before = model.weight_bytes();
        assert_eq!(before, model.info().weight_bytes - int4_bytes + int2_bytes);
        let restored = session
            .generate(&short_prompt, &tier_greedy(10, None))
            .unwrap();
        assert_eq!(
            restored, plain,
            "{name}: INT4 uploaded again from the host copy"
        );
        assert_eq!(model.weight_bytes(), model.info().weight_bytes);
    }
}
