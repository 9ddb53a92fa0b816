//! Asymmetric group quantization: `w ≈ scale · q + zero`, q in [0, 2^bits − 1].
//!
//! Storage of a quantized `[rows, cols]` matrix (docs/FORMAT.md): packed codes row-major
//! (`cols · bits / 8` bytes per row, lowest bits hold the lowest column), then f16 scales
//! `[rows, cols / group]`, then f16 zeros `[rows, cols / group]`.

use half::f16;

use crate::alloc;
use crate::error::{Error, Result};
use crate::format::{check_group_size, DType};

/// A matrix in one of the stored linear-weight encodings.
#[derive(Clone, Debug, PartialEq)]
pub enum LinearData {
    F16(Vec<f16>),
    Quantized(QuantizedMatrix),
}

#[derive(Clone, Debug, PartialEq)]
pub struct QuantizedMatrix {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub group_size: usize,
    pub codes: Vec<u8>,
    pub scales: Vec<f16>,
    pub zeros: Vec<f16>,
}

impl QuantizedMatrix {
    pub fn groups_per_row(&self) -> usize {
        self.cols / self.group_size
    }

    /// Serialized bytes: codes, scales, zeros.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = self.codes.clone();
        out.extend(self.scales.iter().flat_map(|s| s.to_le_bytes()));
        out.extend(self.zeros.iter().flat_map(|z| z.to_le_bytes()));
        out
    }

    /// Parse the serialized layout. The caller has already checked the length against the shape;
    /// the copies are as large as the tensor, so their allocation may fail.
    pub fn from_bytes(
        dtype: DType,
        rows: usize,
        cols: usize,
        group_size: usize,
        bytes: &[u8],
    ) -> Result<QuantizedMatrix> {
        let code_len = rows * cols * dtype.bits() as usize / 8;
        let n_params = rows * (cols / group_size);
        let (codes, params) = bytes.split_at(code_len);
        let (scales, zeros) = params.split_at(n_params * 2);
        let mut code_copy = alloc::with_capacity(codes.len(), "quantized codes")?;
        code_copy.extend_from_slice(codes);
        let params = |bytes: &[u8], what: &str| -> Result<Vec<f16>> {
            let mut values = alloc::with_capacity(bytes.len() / 2, what)?;
            values.extend(f16_values(bytes));
            Ok(values)
        };
        Ok(QuantizedMatrix {
            dtype,
            rows,
            cols,
            group_size,
            codes: code_copy,
            scales: params(scales, "quantization scales")?,
            zeros: params(zeros, "quantization zeros")?,
        })
    }

    /// Code of element (row, col).
    pub fn code(&self, row: usize, col: usize) -> u8 {
        let bits = self.dtype.bits() as usize;
        let per_byte = 8 / bits;
        let byte = self.codes[(row * self.cols + col) / per_byte];
        (byte >> ((col % per_byte) * bits)) & ((1u8 << bits) - 1)
    }

    /// Dequantize one row into `out` (length `cols`).
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        let g = self.group_size;
        for (col, value) in out.iter_mut().enumerate() {
            let p = row * self.groups_per_row() + col / g;
            *value = self.scales[p].to_f32() * self.code(row, col) as f32 + self.zeros[p].to_f32();
        }
    }

    /// Re-quantize to `dtype` at the same group size: round-to-nearest of the dequantized
    /// values, group by group (CTX-TIER's INT4 → INT2 re-pack; every backend's re-pack kernel
    /// must equal this bit for bit).
    pub fn requantize(&self, dtype: DType) -> Result<QuantizedMatrix> {
        let mut values = alloc::zeroed(self.rows * self.cols, "the dequantized matrix")?;
        for (row, out) in values.chunks_exact_mut(self.cols).enumerate() {
            self.dequantize_row(row, out);
        }
        quantize_rtn(&values, self.rows, self.cols, dtype, self.group_size)
    }
}

pub fn f16_from_bytes(bytes: &[u8]) -> Vec<f16> {
    f16_values(bytes).collect()
}

/// The little-endian f16 values of `bytes`.
pub fn f16_values(bytes: &[u8]) -> impl Iterator<Item = f16> + '_ {
    bytes
        .chunks_exact(2)
        .map(|b| f16::from_le_bytes([b[0], b[1]]))
}

pub fn f16_to_bytes(values: &[f16]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// The group size for quantizing `cols` columns at `dtype` when `group_size` is asked for (0 means
/// one group per row; a size above `cols` is clamped to it), checked against the rule every backend
/// supports ([`check_group_size`]).
pub fn resolve_group_size(dtype: DType, cols: usize, group_size: usize) -> Result<usize> {
    resolve(dtype, cols, group_size).map_err(Error::invalid)
}

/// [`resolve_group_size`] for the weight `name`, naming it in the error.
pub fn group_size_for(name: &str, dtype: DType, cols: usize, group_size: usize) -> Result<usize> {
    resolve(dtype, cols, group_size).map_err(|why| Error::invalid(format!("tensor {name}: {why}")))
}

fn resolve(dtype: DType, cols: usize, group_size: usize) -> Result<usize, String> {
    let g = if group_size == 0 {
        cols
    } else {
        group_size.min(cols)
    };
    check_group_size(dtype, cols as u64, g as u64)?;
    Ok(g)
}

/// Round-to-nearest quantization of a row-major `[rows, cols]` matrix.
pub fn quantize_rtn(
    w: &[f32],
    rows: usize,
    cols: usize,
    dtype: DType,
    group_size: usize,
) -> Result<QuantizedMatrix> {
    assert_eq!(w.len(), rows * cols, "matrix length does not match shape");
    let g = resolve_group_size(dtype, cols, group_size)?;
    let bits = dtype.bits() as usize;
    let max_code = ((1u32 << bits) - 1) as f32;
    let per_byte = 8 / bits;
    let mut m = QuantizedMatrix {
        dtype,
        rows,
        cols,
        group_size: g,
        codes: vec![0; rows * cols / per_byte],
        scales: Vec::with_capacity(rows * cols / g),
        zeros: Vec::with_capacity(rows * cols / g),
    };
    for (group_index, group) in w.chunks_exact(g).enumerate() {
        let (lo, hi) = group
            .iter()
            .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &x| {
                (lo.min(x), hi.max(x))
            });
        // Stored parameters are f16, so codes are chosen against the rounded values.
        let scale = f16::from_f32((hi - lo) / max_code);
        let zero = f16::from_f32(lo);
        let (s, z) = (scale.to_f32(), zero.to_f32());
        m.scales.push(scale);
        m.zeros.push(zero);
        for (i, &x) in group.iter().enumerate() {
            let q = if s > 0.0 {
                ((x - z) / s).round().clamp(0.0, max_code) as u8
            } else {
                0
            };
            let flat = group_index * g + i;
            m.codes[flat / per_byte] |= q << ((flat % per_byte) * bits);
        }
    }
    Ok(m)
}
