//! CPU linear weights and `x · Wᵀ`.

use rayon::prelude::*;

use super::try_zeroed;
use crate::backend::HostLinear;
use crate::error::Result;
use crate::format::DType;
use crate::model::quant::{f16_from_bytes, QuantizedMatrix};

/// A linear weight `[rows, cols]` in host memory.
pub enum CpuLinear {
    /// f16 weights, widened once at load.
    Dense {
        rows: usize,
        cols: usize,
        w: Vec<f32>,
    },
    /// Packed codes with per-group scale and zero widened to f32.
    Quantized {
        rows: usize,
        cols: usize,
        bits: usize,
        group_size: usize,
        codes: Vec<u8>,
        scales: Vec<f32>,
        zeros: Vec<f32>,
    },
}

/// Output rows handled by one task: large enough to amortize scheduling, small enough to balance.
const ROWS_PER_TASK: usize = 16;

impl CpuLinear {
    pub fn new(host: &HostLinear) -> Result<CpuLinear> {
        let (rows, cols) = (host.rows, host.cols);
        if host.dtype == DType::F16 {
            let mut w = try_zeroed(rows * cols, "linear weight")?;
            for (o, v) in w.iter_mut().zip(f16_from_bytes(host.bytes)) {
                *o = v.to_f32();
            }
            return Ok(CpuLinear::Dense { rows, cols, w });
        }
        Ok(CpuLinear::from_quantized(host.to_quantized()?))
    }

    pub fn from_quantized(q: QuantizedMatrix) -> CpuLinear {
        let (rows, cols) = (q.rows, q.cols);
        CpuLinear::Quantized {
            rows,
            cols,
            bits: q.dtype.bits() as usize,
            group_size: q.group_size,
            codes: q.codes,
            scales: q.scales.iter().map(|s| s.to_f32()).collect(),
            zeros: q.zeros.iter().map(|z| z.to_f32()).collect(),
        }
    }

    pub fn dtype(&self) -> DType {
        match self {
            CpuLinear::Dense { .. } => DType::F16,
            CpuLinear::Quantized { bits: 4, .. } => DType::Int4,
            CpuLinear::Quantized { .. } => DType::Int2,
        }
    }

    /// The quantized matrix as stored (scales and zeros were widened from f16, so narrowing them
    /// back is exact); `None` for f16 weights.
    pub fn to_quantized(&self) -> Option<QuantizedMatrix> {
        match self {
            CpuLinear::Dense { .. } => None,
            CpuLinear::Quantized {
                rows,
                cols,
                group_size,
                codes,
                scales,
                zeros,
                ..
            } => Some(QuantizedMatrix {
                dtype: self.dtype(),
                rows: *rows,
                cols: *cols,
                group_size: *group_size,
                codes: codes.clone(),
                scales: scales.iter().map(|&s| half::f16::from_f32(s)).collect(),
                zeros: zeros.iter().map(|&z| half::f16::from_f32(z)).collect(),
            }),
        }
    }

    /// The weight's bytes in the file's encoding.
    pub fn to_bytes(&self) -> Vec<u8> {
        match (self, self.to_quantized()) {
            (_, Some(q)) => q.to_bytes(),
            (CpuLinear::Dense { w, .. }, None) => w
                .iter()
                .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
                .collect(),
            (CpuLinear::Quantized { .. }, None) => unreachable!("quantized weights convert"),
        }
    }

    pub fn rows(&self) -> usize {
        match self {
            CpuLinear::Dense { rows, .. } | CpuLinear::Quantized { rows, .. } => *rows,
        }
    }

    pub fn cols(&self) -> usize {
        match self {
            CpuLinear::Dense { cols, .. } | CpuLinear::Quantized { cols, .. } => *cols,
        }
    }

    pub fn bytes(&self) -> usize {
        match self {
            CpuLinear::Dense { w, .. } => w.len() * 4,
            CpuLinear::Quantized {
                codes,
                scales,
                zeros,
                ..
            } => codes.len() + (scales.len() + zeros.len()) * 4,
        }
    }

    /// Write weight row `n`, dequantized, into `out`.
    pub fn row_into(&self, n: usize, out: &mut [f32]) {
        match self {
            CpuLinear::Dense { cols, w, .. } => out.copy_from_slice(&w[n * cols..(n + 1) * cols]),
            CpuLinear::Quantized {
                cols,
                bits,
                group_size,
                codes,
                scales,
                zeros,
                ..
            } => {
                let per_byte = 8 / bits;
                let mask = (1u8 << bits) - 1;
                let row_codes = &codes[n * cols / per_byte..(n + 1) * cols / per_byte];
                let groups = cols / group_size;
                let group_codes = row_codes.chunks_exact(group_size / per_byte);
                for (g, (chunk, bytes)) in out
                    .chunks_exact_mut(*group_size)
                    .zip(group_codes)
                    .enumerate()
                {
                    let (s, z) = (scales[n * groups + g], zeros[n * groups + g]);
                    // Each byte expands to `per_byte` consecutive columns, lowest bits first.
                    for (values, &byte) in chunk.chunks_exact_mut(per_byte).zip(bytes) {
                        for (j, v) in values.iter_mut().enumerate() {
                            *v = s * ((byte >> (j * bits)) & mask) as f32 + z;
                        }
                    }
                }
            }
        }
    }

    /// `out[r, n] (+)= Σ_k x[r, k] · W[n, k]` for `r < rows`.
    pub fn matmul(&self, x: &[f32], rows: usize, out: &mut [f32], accumulate: bool) {
        self.matmul_rows(x, rows, 0..self.rows(), out, accumulate);
    }

    /// [`CpuLinear::matmul`] restricted to the weight rows `range`: `out` is `rows × range.len()`.
    /// Each value is the same dot product, in the same order, as in the full product.
    pub fn matmul_rows(
        &self,
        x: &[f32],
        rows: usize,
        range: std::ops::Range<usize>,
        out: &mut [f32],
        accumulate: bool,
    ) {
        let (n_out, k) = (range.len(), self.cols());
        // Results are gathered per weight row ([n, r]) so each task dequantizes a row once.
        let mut by_weight_row = vec![0f32; n_out * rows];
        by_weight_row
            .par_chunks_mut(ROWS_PER_TASK * rows)
            .enumerate()
            .for_each(|(task, chunk)| {
                let mut w_row = vec![0f32; k];
                for (i, out_n) in chunk.chunks_exact_mut(rows).enumerate() {
                    self.row_into(range.start + task * ROWS_PER_TASK + i, &mut w_row);
                    for (r, o) in out_n.iter_mut().enumerate() {
                        *o = dot(&x[r * k..(r + 1) * k], &w_row);
                    }
                }
            });
        for r in 0..rows {
            let out_row = &mut out[r * n_out..(r + 1) * n_out];
            for (n, o) in out_row.iter_mut().enumerate() {
                let v = by_weight_row[n * rows + r];
                *o = if accumulate { *o + v } else { v };
            }
        }
    }
}

/// f32 dot product with eight independent partial sums (lets the compiler vectorize it).
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for l in 0..8 {
            acc[l] += a[c * 8 + l] * b[c * 8 + l];
        }
    }
    let mut total: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        total += a[i] * b[i];
    }
    total
}
