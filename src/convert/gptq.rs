//! GPTQ (Frantar et al., 2022): quantize a weight column by column, spreading each column's
//! rounding error over the not-yet-quantized columns in proportion to the inverse Hessian of the
//! layer's inputs, so the layer's *output* error (not the weight error) is minimized.
//!
//! Group parameters (scale, zero) are fitted to the error-updated weights when a group starts,
//! and are stored as f16 exactly like round-to-nearest, so the file format is unchanged.

use half::f16;
use rayon::prelude::*;

use crate::alloc;
use crate::error::{Error, Result};
use crate::format::DType;
use crate::model::quant::{resolve_group_size, QuantizedMatrix};

/// Dampening added to the Hessian diagonal, as a fraction of its mean (the paper's 1 %).
const DAMPING: f64 = 0.01;

/// Quantize `w` (`rows × cols`, row-major) given `h`, the dense `cols × cols` input second moment.
pub fn quantize_gptq(
    w: &[f32],
    rows: usize,
    cols: usize,
    h: &[f64],
    dtype: DType,
    group_size: usize,
) -> Result<QuantizedMatrix> {
    let g = resolve_group_size(dtype, cols, group_size)?;
    let bits = dtype.bits() as usize;
    let max_code = ((1u32 << bits) - 1) as f64;
    let per_byte = 8 / bits;

    let mut h = {
        let mut copy = alloc::with_capacity(h.len(), "a GPTQ Hessian")?;
        copy.extend_from_slice(h);
        copy
    };
    let mut w = {
        let mut wide = alloc::with_capacity(w.len(), "a GPTQ weight")?;
        wide.extend(w.iter().map(|&v| f64::from(v)));
        wide
    };
    // Inputs that never fire carry no information: pin their weights to zero.
    for i in 0..cols {
        if h[i * cols + i] == 0.0 {
            h[i * cols + i] = 1.0;
            (0..rows).for_each(|r| w[r * cols + i] = 0.0);
        }
    }
    let mean_diag = (0..cols).map(|i| h[i * cols + i]).sum::<f64>() / cols as f64;
    (0..cols).for_each(|i| h[i * cols + i] += DAMPING * mean_diag);
    let u = upper_cholesky_of_inverse(&h, cols)?;

    let groups = cols / g;
    let mut m = QuantizedMatrix {
        dtype,
        rows,
        cols,
        group_size: g,
        codes: vec![0; rows * cols / per_byte],
        scales: vec![f16::ZERO; rows * groups],
        zeros: vec![f16::ZERO; rows * groups],
    };
    // Rows are independent: each sees only its own errors, through the shared U.
    w.par_chunks_mut(cols)
        .zip(m.codes.par_chunks_mut(cols / per_byte))
        .zip(
            m.scales
                .par_chunks_mut(groups)
                .zip(m.zeros.par_chunks_mut(groups)),
        )
        .for_each(|((row, codes), (scales, zeros))| {
            let (mut scale, mut zero) = (0.0, 0.0);
            for i in 0..cols {
                if i % g == 0 {
                    let group = &row[i..i + g];
                    let lo = group.iter().copied().fold(f64::INFINITY, f64::min);
                    let hi = group.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    scales[i / g] = f16::from_f64((hi - lo) / max_code);
                    zeros[i / g] = f16::from_f64(lo);
                    (scale, zero) = (scales[i / g].to_f64(), zeros[i / g].to_f64());
                }
                let value = row[i];
                let q = if scale > 0.0 {
                    ((value - zero) / scale).round().clamp(0.0, max_code)
                } else {
                    0.0
                };
                codes[i / per_byte] |= (q as u8) << ((i % per_byte) * bits);
                let err = (value - (scale * q + zero)) / u[i * cols + i];
                let u_row = &u[i * cols..(i + 1) * cols];
                for (v, &uij) in row[i + 1..].iter_mut().zip(&u_row[i + 1..]) {
                    *v -= err * uij;
                }
            }
        });
    Ok(m)
}

/// The layer-output error GPTQ minimizes: `Σ_rows Δwᵀ H Δw` with `Δw = w − dequantize(q)`.
pub fn output_error(w: &[f32], q: &QuantizedMatrix, h: &[f64]) -> f64 {
    let cols = q.cols;
    (0..q.rows)
        .into_par_iter()
        .map(|r| {
            let mut row = vec![0f32; cols];
            q.dequantize_row(r, &mut row);
            let d: Vec<f64> = (0..cols)
                .map(|c| (w[r * cols + c] - row[c]) as f64)
                .collect();
            (0..cols)
                .map(|i| {
                    d[i] * h[i * cols..(i + 1) * cols]
                        .iter()
                        .zip(&d)
                        .map(|(a, b)| a * b)
                        .sum::<f64>()
                })
                .sum::<f64>()
        })
        .sum()
}

/// `U` upper-triangular with `Uᵀ U = H⁻¹`: Cholesky of H, inverse, then Cholesky of the inverse.
fn upper_cholesky_of_inverse(h: &[f64], n: usize) -> Result<Vec<f64>> {
    let l = cholesky(h, n)?;
    // H⁻¹ = L⁻ᵀ L⁻¹; invert the lower-triangular L by forward substitution.
    let mut l_inv = alloc::zeroed(n * n, "GPTQ's inverse Hessian")?;
    for col in 0..n {
        for i in col..n {
            let mut sum = if i == col { 1.0 } else { 0.0 };
            for k in col..i {
                sum -= l[i * n + k] * l_inv[k * n + col];
            }
            l_inv[i * n + col] = sum / l[i * n + i];
        }
    }
    let mut inv = alloc::zeroed(n * n, "GPTQ's inverse Hessian")?;
    for i in 0..n {
        for j in 0..=i {
            let v: f64 = (i..n).map(|k| l_inv[k * n + i] * l_inv[k * n + j]).sum();
            inv[i * n + j] = v;
            inv[j * n + i] = v;
        }
    }
    let lower = cholesky(&inv, n)?;
    let mut upper = alloc::zeroed(n * n, "GPTQ's inverse Hessian")?;
    for i in 0..n {
        for j in 0..=i {
            upper[j * n + i] = lower[i * n + j];
        }
    }
    Ok(upper)
}

/// Lower-triangular L with L Lᵀ = a.
fn cholesky(a: &[f64], n: usize) -> Result<Vec<f64>> {
    let mut l = alloc::zeroed(n * n, "a GPTQ Cholesky factor")?;
    for i in 0..n {
        for j in 0..=i {
            let dot: f64 = (0..j).map(|k| l[i * n + k] * l[j * n + k]).sum();
            if i == j {
                let d = a[i * n + i] - dot;
                if d <= 0.0 {
                    return Err(Error::invalid(
                        "GPTQ: Hessian is not positive definite (too little calibration data?)",
                    ));
                }
                l[i * n + i] = d.sqrt();
            } else {
                l[i * n + j] = (a[i * n + j] - dot) / l[j * n + j];
            }
        }
    }
    Ok(l)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generate::sampling::Rng;
    use crate::model::quant::quantize_rtn;

    fn sample_output_error(w: &[f32], q: &QuantizedMatrix, x: &[f32], n_x: usize) -> f64 {
        let (rows, cols) = (q.rows, q.cols);
        let mut row = vec![0f32; cols];
        let mut total = 0.0;
        for r in 0..rows {
            q.dequantize_row(r, &mut row);
            for s in 0..n_x {
                let xs = &x[s * cols..(s + 1) * cols];
                let exact: f64 = xs
                    .iter()
                    .zip(&w[r * cols..])
                    .map(|(a, b)| (a * b) as f64)
                    .sum();
                let approx: f64 = xs.iter().zip(&row).map(|(a, b)| (a * b) as f64).sum();
                total += (exact - approx).powi(2);
            }
        }
        total
    }

    /// On correlated inputs GPTQ must beat round-to-nearest on the layer's output error.
    #[test]
    fn gptq_beats_rtn_on_correlated_inputs() {
        let (rows, cols, n_x) = (16, 64, 256);
        let mut rng = Rng::new(9);
        let mut normal = || ((rng.next_f64() - 0.5) * 3.46) as f32; // unit variance
        let w: Vec<f32> = (0..rows * cols).map(|_| normal()).collect();
        // Inputs share a strong common component, so columns are correlated.
        let mut x = Vec::with_capacity(n_x * cols);
        for _ in 0..n_x {
            let common = normal();
            x.extend((0..cols).map(|_| common + 0.3 * normal()));
        }
        let mut h = vec![0.0; cols * cols];
        for s in 0..n_x {
            for i in 0..cols {
                for j in 0..cols {
                    h[i * cols + j] += (x[s * cols + i] * x[s * cols + j]) as f64 / n_x as f64;
                }
            }
        }
        for dtype in [DType::Int4, DType::Int2] {
            let gptq = quantize_gptq(&w, rows, cols, &h, dtype, 32).unwrap();
            let rtn = quantize_rtn(&w, rows, cols, dtype, 32).unwrap();
            let (e_gptq, e_rtn) = (
                sample_output_error(&w, &gptq, &x, n_x),
                sample_output_error(&w, &rtn, &x, n_x),
            );
            assert!(
                e_gptq < 0.8 * e_rtn,
                "{dtype:?}: gptq {e_gptq} vs rtn {e_rtn}"
            );
        }
    }

    #[test]
    fn cholesky_of_inverse_reconstructs_the_inverse() {
        let h = [4.0, 2.0, 0.6, 2.0, 5.0, 1.0, 0.6, 1.0, 3.0];
        let u = upper_cholesky_of_inverse(&h, 3).unwrap();
        // (Uᵀ U) H = I within f64 round-off.
        for i in 0..3 {
            for j in 0..3 {
                let v: f64 = (0..3)
                    .map(|k| {
                        (0..3).map(|m| u[m * 3 + i] * u[m * 3 + k]).sum::<f64>() * h[k * 3 + j]
                    })
                    .sum();
                let expected = if i == j { 1.0 } else { 0.0 };
                assert!((v - expected).abs() < 1e-12, "({i},{j}) = {v}");
            }
        }
    }
}
