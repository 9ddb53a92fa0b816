//! The CPU backend: the reference implementation of every op, written plainly.
//! Work is split across threads (rayon) by output element, so results never depend on the
//! thread count: each value is computed by one thread in a fixed order.

mod kv;
mod linear;

use half::f16;

use super::{
    choose_on_host, pool_index, Backend, Choice, HostLinear, NormLayer, OwnedLinear, PooledRows,
    Residual, StepInput,
};
use crate::error::{Error, Result};
use crate::format::DType;
use crate::generate::sampling;
use crate::kv::{KvCache, KvSlot, TierBounds, TierMove};
use crate::model::architecture::BlockNorms;
use crate::model::config::NormKind;
use crate::model::forward::LOGIT_ROWS;
use crate::telemetry::beta_monitor::entropy_bits;

pub use kv::read as read_kv_entry;
pub(crate) use linear::dot;
pub use linear::CpuLinear;

/// Round to the nearest f16 and back: the value an f16 buffer would hold.
#[inline]
pub fn round_f16(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

#[derive(Clone, Copy, Debug, Default)]
pub struct CpuBackend;

pub struct CpuStep {
    tokens: Vec<u32>,
    start_pos: usize,
    /// For a step over a KV pool, where its rows live.
    places: Option<Places>,
    choice: Choice,
    chosen: u32,
    /// The tokens of the last `argmax_rows`.
    chosen_rows: Vec<u32>,
    /// The entropies (bits) of the last `entropy_rows`.
    entropies: Vec<f32>,
}

/// The rows of a step over a KV pool: each row's position and its sequence's page table.
struct Places {
    page_size: usize,
    rows: Vec<(usize, Vec<u32>)>,
}

impl CpuStep {
    /// The position of row `r` in its sequence.
    fn position(&self, r: usize) -> usize {
        match &self.places {
            None => self.start_pos + r,
            Some(places) => places.rows[r].0,
        }
    }

    /// Where the entry of position `t` of row `r`'s sequence lives in the cache.
    fn index(&self, r: usize, t: usize) -> usize {
        match &self.places {
            None => t,
            Some(places) => pool_index(&places.rows[r].1, places.page_size, t),
        }
    }
}

/// Allocate a zeroed vector, reporting failure as an error instead of aborting.
pub(crate) fn try_zeroed<T: Clone + Default>(len: usize, what: &str) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| Error::OutOfMemory {
        bytes: len * std::mem::size_of::<T>(),
        what: what.to_string(),
    })?;
    v.resize(len, T::default());
    Ok(v)
}

/// `out = norm(row)` in f32: `(row − mean) / sqrt(var + ε) · weight (+ bias)`, the mean and
/// variance summed in index order (the mean is 0 for RMSNorm).
fn normalize(norm: &NormLayer<Vec<f32>>, row: &[f32], out: &mut [f32]) {
    let n = row.len() as f32;
    let (mean, var) = match norm.kind {
        NormKind::RmsNorm => (0.0, row.iter().map(|v| v * v).sum::<f32>() / n),
        NormKind::LayerNorm => {
            let mean = row.iter().sum::<f32>() / n;
            let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
            (mean, var)
        }
    };
    let inv = 1.0 / (var + norm.eps).sqrt();
    for (i, out) in out.iter_mut().enumerate() {
        let b = norm.bias.map_or(0.0, |b| b[i]);
        *out = (row[i] - mean) * inv * norm.weight[i] + b;
    }
}

impl Backend for CpuBackend {
    type Float = Vec<f32>;
    type Half = Vec<f32>;
    type Linear = CpuLinear;
    type Vector = Vec<f32>;
    type Step = CpuStep;
    type KvStorage = Vec<u8>;

    fn describe(&self) -> String {
        format!("cpu ({} threads)", rayon::current_num_threads())
    }

    fn upload_linear(&self, weight: &HostLinear) -> Result<CpuLinear> {
        CpuLinear::new(weight)
    }

    fn upload_vector(&self, values: &[f16]) -> Result<Vec<f32>> {
        Ok(values.iter().map(|v| v.to_f32()).collect())
    }

    fn alloc_float(&self, len: usize) -> Result<Vec<f32>> {
        try_zeroed(len, "f32 activations")
    }

    fn alloc_half(&self, len: usize) -> Result<Vec<f32>> {
        try_zeroed(len, "f16 activations")
    }

    fn alloc_step(&self, max_rows: usize) -> Result<CpuStep> {
        Ok(CpuStep {
            tokens: Vec::with_capacity(max_rows),
            start_pos: 0,
            places: None,
            choice: Choice::Greedy,
            chosen: 0,
            chosen_rows: Vec::with_capacity(max_rows),
            entropies: Vec::with_capacity(LOGIT_ROWS),
        })
    }

    fn alloc_kv(&self, bytes: usize) -> Result<Vec<u8>> {
        try_zeroed(bytes, "KV cache")
    }

    fn copy_kv(
        &self,
        from: &Vec<u8>,
        from_offset: usize,
        to: &mut Vec<u8>,
        to_offset: usize,
        bytes: usize,
    ) -> Result<()> {
        to[to_offset..to_offset + bytes].copy_from_slice(&from[from_offset..from_offset + bytes]);
        Ok(())
    }

    fn kv_write(&self, storage: &mut Vec<u8>, offset: usize, bytes: &[u8]) -> Result<()> {
        storage[offset..offset + bytes.len()].copy_from_slice(bytes);
        Ok(())
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
        to[to_row * width..(to_row + rows) * width]
            .copy_from_slice(&from[from_row * width..(from_row + rows) * width]);
    }

    fn linear_bytes(&self, w: &CpuLinear) -> usize {
        w.bytes()
    }

    fn linear_dtype(&self, w: &CpuLinear) -> DType {
        w.dtype()
    }

    fn requantize_linear(&self, w: &CpuLinear, dtype: DType) -> Result<CpuLinear> {
        let q = w.to_quantized().ok_or_else(|| {
            Error::invalid("only a quantized weight can be re-quantized (this one is f16)")
        })?;
        Ok(CpuLinear::from_quantized(q.requantize(dtype)?))
    }

    fn download_linear(&self, w: &CpuLinear) -> Result<OwnedLinear> {
        Ok(OwnedLinear {
            rows: w.rows(),
            cols: w.cols(),
            dtype: w.dtype(),
            group_size: match w {
                CpuLinear::Quantized { group_size, .. } => *group_size,
                CpuLinear::Dense { cols, .. } => *cols,
            },
            bytes: w.to_bytes(),
        })
    }

    fn kv_bytes(&self, kv: &Vec<u8>) -> usize {
        kv.len()
    }

    // The CPU reads the tier bounds from the cache object itself.
    fn set_step(&self, step: &mut CpuStep, input: StepInput, _: TierBounds) -> Result<()> {
        step.tokens.clear();
        step.tokens.extend_from_slice(input.tokens);
        step.start_pos = input.start_pos;
        step.places = None;
        step.choice = input.choice;
        Ok(())
    }

    fn set_places(&self, step: &mut CpuStep, places: PooledRows) -> Result<u64> {
        step.places = Some(Places {
            page_size: places.page_size,
            rows: places
                .rows
                .iter()
                .map(|r| (r.position, r.table.to_vec()))
                .collect(),
        });
        Ok(0)
    }

    fn embed(&self, table: &CpuLinear, step: &CpuStep, out: &mut Vec<f32>) {
        for (r, &token) in step.tokens.iter().enumerate() {
            let width = table.cols();
            table.row_into(token as usize, &mut out[r * width..(r + 1) * width]);
        }
    }

    fn embed_half(&self, table: &CpuLinear, step: &CpuStep, out: &mut Vec<f32>) {
        // The table is f16, so its values are already exact f16 values.
        self.embed(table, step, out);
    }

    fn norm(&self, norm: &NormLayer<Vec<f32>>, x: &Vec<f32>, rows: usize, out: &mut Vec<f32>) {
        let d = norm.weight.len();
        for (row, out) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)).take(rows) {
            normalize(norm, row, out);
            out.iter_mut().for_each(|v| *v = round_f16(*v));
        }
    }

    fn norm_state(&self, norm: &NormLayer<Vec<f32>>, x: &mut Vec<f32>, rows: usize) {
        let d = norm.weight.len();
        let mut normed = vec![0.0; d];
        for row in x.chunks_exact_mut(d).take(rows) {
            normalize(norm, row, &mut normed);
            row.copy_from_slice(&normed);
        }
    }

    fn residual_norm(
        &self,
        residual: &Residual<Vec<f32>, Vec<f32>>,
        rows: usize,
        x: &mut Vec<f32>,
    ) {
        let norm = &residual.norm;
        let d = norm.weight.len();
        let mut normed = vec![0.0; d];
        let deltas = residual.delta.chunks_exact(d);
        for (row, delta) in x.chunks_exact_mut(d).zip(deltas).take(rows) {
            match residual.layout {
                BlockNorms::Pre => unreachable!("pre-norm blocks have no output norm"),
                BlockNorms::Sandwich => {
                    normalize(norm, delta, &mut normed);
                    row.iter_mut().zip(&normed).for_each(|(x, n)| *x += n);
                }
                BlockNorms::SandwichResidual => {
                    row.iter_mut().zip(delta).for_each(|(x, d)| *x += d);
                    normalize(norm, row, &mut normed);
                    row.copy_from_slice(&normed);
                }
            }
        }
    }

    fn residual_norm_into(
        &self,
        residual: &Residual<Vec<f32>, Vec<f32>>,
        x: &Vec<f32>,
        rows: usize,
        next: &mut Vec<f32>,
    ) {
        let len = rows * residual.norm.weight.len();
        next[..len].copy_from_slice(&x[..len]);
        self.residual_norm(residual, rows, next);
    }

    fn add_bias(&self, x: &mut Vec<f32>, rows: usize, bias: &Vec<f32>) {
        for row in x.chunks_exact_mut(bias.len()).take(rows) {
            row.iter_mut().zip(bias).for_each(|(x, b)| *x += b);
        }
    }

    fn kv_copy_within(
        &self,
        kv: &mut KvCache<Vec<u8>>,
        ranges: &[(usize, usize, usize)],
    ) -> Result<()> {
        for &(from, to, len) in ranges {
            kv.storage.copy_within(from..from + len, to);
        }
        Ok(())
    }

    fn scale(&self, x: &mut Vec<f32>, len: usize, factor: f32) {
        x[..len].iter_mut().for_each(|v| *v *= factor);
    }

    fn linear(
        &self,
        x: &Vec<f32>,
        first_row: usize,
        rows: usize,
        w: &CpuLinear,
        out: &mut Vec<f32>,
        accumulate: bool,
    ) {
        let k = w.cols();
        w.matmul(
            &x[first_row * k..(first_row + rows) * k],
            rows,
            out,
            accumulate,
        );
    }

    fn mlp_gate_up(
        &self,
        x: &Vec<f32>,
        rows: usize,
        gate: &CpuLinear,
        up: &CpuLinear,
        gate_buf: &mut Vec<f32>,
        up_buf: &mut Vec<f32>,
        out: &mut Vec<f32>,
    ) {
        self.linear(x, 0, rows, gate, gate_buf, false);
        self.linear(x, 0, rows, up, up_buf, false);
        let n = rows * gate.rows();
        for ((o, &g), &u) in out[..n].iter_mut().zip(&gate_buf[..n]).zip(&up_buf[..n]) {
            *o = round_f16(g / (1.0 + (-g).exp()) * u);
        }
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
        kv::store(qkv, h, step, rows, rope, kv, at);
    }

    fn attention(
        &self,
        qkv: &Vec<f32>,
        step: &CpuStep,
        rows: usize,
        kv: &mut KvCache<Vec<u8>>,
        at: KvSlot,
        qkv_weight: &CpuLinear,
        rope: &Vec<f32>,
        out: &mut Vec<f32>,
    ) {
        kv::attention(qkv, step, rows, kv, at, qkv_weight, rope, out);
    }

    fn kv_move(&self, kv: &mut KvCache<Vec<u8>>, mv: &TierMove) {
        kv::move_tier(kv, mv);
    }

    fn to_half(&self, x: &Vec<f32>, len: usize, out: &mut Vec<f32>) {
        for (o, &v) in out[..len].iter_mut().zip(&x[..len]) {
            *o = round_f16(v);
        }
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    fn read_float_into(&self, x: &Vec<f32>, offset: usize, out: &mut [f32]) -> Result<()> {
        out.copy_from_slice(&x[offset..offset + out.len()]);
        Ok(())
    }

    fn write_float(&self, x: &mut Vec<f32>, values: &[f32]) -> Result<()> {
        x[..values.len()].copy_from_slice(values);
        Ok(())
    }

    fn choose(&self, logits: &Vec<f32>, len: usize, step: &mut CpuStep) {
        step.chosen = choose_on_host(&logits[..len], &step.choice);
    }

    fn chosen_token(&self, step: &CpuStep) -> Result<u32> {
        Ok(step.chosen)
    }

    fn argmax_rows(&self, logits: &Vec<f32>, rows: usize, len: usize, step: &mut CpuStep) {
        step.chosen_rows.clear();
        step.chosen_rows
            .extend(logits[..rows * len].chunks_exact(len).map(sampling::argmax));
    }

    fn chosen_tokens(&self, step: &CpuStep, rows: usize) -> Result<Vec<u32>> {
        Ok(step.chosen_rows[..rows].to_vec())
    }

    fn entropy_rows(&self, logits: &Vec<f32>, rows: usize, len: usize, step: &mut CpuStep) {
        step.entropies.clear();
        step.entropies.extend(
            logits[..rows * len]
                .chunks_exact(len)
                .map(|row| entropy_bits(row) as f32),
        );
    }

    fn chosen_measured(&self, step: &CpuStep) -> Result<(u32, f32)> {
        Ok((step.chosen, step.entropies[0]))
    }

    fn entropies(&self, step: &CpuStep, rows: usize) -> Result<Vec<f32>> {
        Ok(step.entropies[..rows].to_vec())
    }
}
