//! A backend that runs the CPU reference and records, for every linear weight, the second moment
//! `H = Σ x xᵀ` of the inputs it sees: the statistic GPTQ needs. Running calibration text through
//! the ordinary forward pass with this backend covers every application of the shared loop body.

use std::sync::Mutex;

use half::f16;
use rayon::prelude::*;

use crate::alloc;
use crate::backend::cpu::{dot, CpuBackend, CpuLinear, CpuStep};
use crate::backend::{Backend, HostLinear, NormLayer, OwnedLinear, Residual, StepInput};
use crate::error::{Error, Result};
use crate::format::DType;
use crate::kv::{KvCache, KvSlot, TierBounds, TierMove};

/// Accumulated `Σ x xᵀ` (lower triangle, f64) over `rows` input rows.
pub struct Hessian {
    pub dim: usize,
    pub rows: usize,
    pub lower: Vec<f64>,
}

impl Hessian {
    fn new(dim: usize) -> Result<Hessian> {
        let len = dim.checked_mul(dim).ok_or_else(|| {
            Error::invalid(format!("a {dim}x{dim} Hessian exceeds the address space"))
        })?;
        Ok(Hessian {
            dim,
            rows: 0,
            lower: alloc::zeroed(len, "a GPTQ Hessian")?,
        })
    }

    /// Add the rows of `x` (`rows × dim`, row-major).
    fn add(&mut self, x: &[f32], rows: usize) {
        let k = self.dim;
        // Column-major copy so each H entry is a contiguous dot product over rows.
        let mut columns = vec![0f32; k * rows];
        for r in 0..rows {
            for i in 0..k {
                columns[i * rows + r] = x[r * k + i];
            }
        }
        self.lower
            .par_chunks_mut(k)
            .enumerate()
            .for_each(|(i, h_row)| {
                let xi = &columns[i * rows..(i + 1) * rows];
                for (j, h) in h_row.iter_mut().enumerate().take(i + 1) {
                    let xj = &columns[j * rows..(j + 1) * rows];
                    *h += dot(xi, xj) as f64;
                }
            });
        self.rows += rows;
    }

    /// The full symmetric matrix, averaged over rows.
    pub fn to_dense(&self) -> Result<Vec<f64>> {
        let k = self.dim;
        let n = self.rows.max(1) as f64;
        let mut h = alloc::zeroed(k * k, "a GPTQ Hessian")?;
        for i in 0..k {
            for j in 0..=i {
                let v = self.lower[i * k + j] / n;
                h[i * k + j] = v;
                h[j * k + i] = v;
            }
        }
        Ok(h)
    }
}

pub struct CaptureLinear {
    pub inner: CpuLinear,
    pub hessian: Mutex<Hessian>,
}

impl CaptureLinear {
    fn record(&self, x: &[f32], first_row: usize, rows: usize) {
        let k = self.inner.cols();
        let mut h = self.hessian.lock().expect("hessian lock is never poisoned");
        h.add(&x[first_row * k..(first_row + rows) * k], rows);
    }
}

#[derive(Clone, Copy, Debug, Default)]
pub struct CaptureBackend;

impl Backend for CaptureBackend {
    type Float = Vec<f32>;
    type Half = Vec<f32>;
    type Linear = CaptureLinear;
    type Vector = Vec<f32>;
    type Step = CpuStep;
    type KvStorage = Vec<u8>;

    fn describe(&self) -> String {
        "cpu (calibration)".into()
    }

    fn upload_linear(&self, weight: &HostLinear) -> Result<CaptureLinear> {
        Ok(CaptureLinear {
            inner: CpuBackend.upload_linear(weight)?,
            hessian: Mutex::new(Hessian::new(weight.cols)?),
        })
    }

    fn upload_vector(&self, values: &[f16]) -> Result<Vec<f32>> {
        CpuBackend.upload_vector(values)
    }

    fn alloc_float(&self, len: usize) -> Result<Vec<f32>> {
        CpuBackend.alloc_float(len)
    }

    fn alloc_half(&self, len: usize) -> Result<Vec<f32>> {
        CpuBackend.alloc_half(len)
    }

    fn alloc_step(&self, max_rows: usize) -> Result<CpuStep> {
        CpuBackend.alloc_step(max_rows)
    }

    fn alloc_kv(&self, bytes: usize) -> Result<Vec<u8>> {
        CpuBackend.alloc_kv(bytes)
    }

    fn kv_write(&self, storage: &mut Vec<u8>, offset: usize, bytes: &[u8]) -> Result<()> {
        CpuBackend.kv_write(storage, offset, bytes)
    }

    fn copy_kv(
        &self,
        from: &Vec<u8>,
        from_offset: usize,
        to: &mut Vec<u8>,
        to_offset: usize,
        bytes: usize,
    ) -> Result<()> {
        CpuBackend.copy_kv(from, from_offset, to, to_offset, bytes)
    }

    fn copy_rows(
        &self,
        from: &Vec<f32>,
        from_row: usize,
        to: &mut Vec<f32>,
        to_row: usize,
        rows: usize,
        width: usize,
    ) {
        CpuBackend.copy_rows(from, from_row, to, to_row, rows, width)
    }

    fn linear_bytes(&self, w: &CaptureLinear) -> usize {
        CpuBackend.linear_bytes(&w.inner)
    }

    fn linear_dtype(&self, w: &CaptureLinear) -> DType {
        w.inner.dtype()
    }

    fn requantize_linear(&self, w: &CaptureLinear, dtype: DType) -> Result<CaptureLinear> {
        Ok(CaptureLinear {
            inner: CpuBackend.requantize_linear(&w.inner, dtype)?,
            hessian: Mutex::new(Hessian::new(w.inner.cols())?),
        })
    }

    fn download_linear(&self, w: &CaptureLinear) -> Result<OwnedLinear> {
        CpuBackend.download_linear(&w.inner)
    }

    fn kv_bytes(&self, kv: &Vec<u8>) -> usize {
        CpuBackend.kv_bytes(kv)
    }

    fn set_step(&self, step: &mut CpuStep, input: StepInput, tiers: TierBounds) -> Result<()> {
        CpuBackend.set_step(step, input, tiers)
    }

    fn embed(&self, table: &CaptureLinear, step: &CpuStep, out: &mut Vec<f32>) {
        CpuBackend.embed(&table.inner, step, out)
    }

    fn embed_half(&self, table: &CaptureLinear, step: &CpuStep, out: &mut Vec<f32>) {
        CpuBackend.embed_half(&table.inner, step, out)
    }

    fn norm(&self, norm: &NormLayer<Vec<f32>>, x: &Vec<f32>, rows: usize, out: &mut Vec<f32>) {
        CpuBackend.norm(norm, x, rows, out)
    }

    fn norm_state(&self, norm: &NormLayer<Vec<f32>>, x: &mut Vec<f32>, rows: usize) {
        CpuBackend.norm_state(norm, x, rows)
    }

    fn residual_norm(
        &self,
        residual: &Residual<Vec<f32>, Vec<f32>>,
        rows: usize,
        x: &mut Vec<f32>,
    ) {
        CpuBackend.residual_norm(residual, rows, x)
    }

    fn residual_norm_into(
        &self,
        residual: &Residual<Vec<f32>, Vec<f32>>,
        x: &Vec<f32>,
        rows: usize,
        next: &mut Vec<f32>,
    ) {
        CpuBackend.residual_norm_into(residual, x, rows, next)
    }

    fn add_bias(&self, x: &mut Vec<f32>, rows: usize, bias: &Vec<f32>) {
        CpuBackend.add_bias(x, rows, bias)
    }

    fn kv_copy_within(
        &self,
        kv: &mut KvCache<Vec<u8>>,
        ranges: &[(usize, usize, usize)],
    ) -> Result<()> {
        CpuBackend.kv_copy_within(kv, ranges)
    }

    fn scale(&self, x: &mut Vec<f32>, len: usize, factor: f32) {
        CpuBackend.scale(x, len, factor)
    }

    fn linear(
        &self,
        x: &Vec<f32>,
        first_row: usize,
        rows: usize,
        w: &CaptureLinear,
        out: &mut Vec<f32>,
        accumulate: bool,
    ) {
        w.record(x, first_row, rows);
        CpuBackend.linear(x, first_row, rows, &w.inner, out, accumulate)
    }

    fn mlp_gate_up(
        &self,
        x: &Vec<f32>,
        rows: usize,
        gate: &CaptureLinear,
        up: &CaptureLinear,
        gate_buf: &mut Vec<f32>,
        up_buf: &mut Vec<f32>,
        out: &mut Vec<f32>,
    ) {
        gate.record(x, 0, rows);
        up.record(x, 0, rows);
        CpuBackend.mlp_gate_up(x, rows, &gate.inner, &up.inner, gate_buf, up_buf, out)
    }

    fn kv_store(
        &self,
        qkv: &mut Vec<f32>,
        h: &Vec<f32>,
        step: &CpuStep,
        rows: usize,
        rope: &Vec<f32>,
        kv: &mut KvCache<Vec<u8>>,
        at: KvSlot,
    ) {
        CpuBackend.kv_store(qkv, h, step, rows, rope, kv, at)
    }

    fn attention(
        &self,
        qkv: &Vec<f32>,
        step: &CpuStep,
        rows: usize,
        kv: &mut KvCache<Vec<u8>>,
        at: KvSlot,
        qkv_weight: &CaptureLinear,
        rope: &Vec<f32>,
        out: &mut Vec<f32>,
    ) {
        CpuBackend.attention(qkv, step, rows, kv, at, &qkv_weight.inner, rope, out)
    }

    fn kv_move(&self, kv: &mut KvCache<Vec<u8>>, mv: &TierMove) {
        CpuBackend.kv_move(kv, mv)
    }

    fn to_half(&self, x: &Vec<f32>, len: usize, out: &mut Vec<f32>) {
        CpuBackend.to_half(x, len, out)
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    fn read_float_into(&self, x: &Vec<f32>, offset: usize, out: &mut [f32]) -> Result<()> {
        CpuBackend.read_float_into(x, offset, out)
    }

    fn write_float(&self, x: &mut Vec<f32>, values: &[f32]) -> Result<()> {
        CpuBackend.write_float(x, values)
    }

    fn choose(&self, logits: &Vec<f32>, len: usize, step: &mut CpuStep) {
        CpuBackend.choose(logits, len, step)
    }

    fn chosen_token(&self, step: &CpuStep) -> Result<u32> {
        CpuBackend.chosen_token(step)
    }

    fn argmax_rows(&self, logits: &Vec<f32>, rows: usize, len: usize, step: &mut CpuStep) {
        CpuBackend.argmax_rows(logits, rows, len, step)
    }

    fn chosen_tokens(&self, step: &CpuStep, rows: usize) -> Result<Vec<u32>> {
        CpuBackend.chosen_tokens(step, rows)
    }

    fn entropy_rows(&self, logits: &Vec<f32>, rows: usize, len: usize, step: &mut CpuStep) {
        CpuBackend.entropy_rows(logits, rows, len, step)
    }

    fn chosen_measured(&self, step: &CpuStep) -> Result<(u32, f32)> {
        CpuBackend.chosen_measured(step)
    }

    fn entropies(&self, step: &CpuStep, rows: usize) -> Result<Vec<f32>> {
        CpuBackend.entropies(step, rows)
    }
}
