//! The opt-in FP16 body cache (`ModelOptions::fp16_body`, `TINYLOOP_EXPERIMENTAL_FP16_BODY=1`):
//! an FP16 copy of every transformer block's quantized linears (pre blocks, the loop body, post
//! blocks), kept beside the codes, that feeds cuBLAS for the multi-row products of prefill. The
//! blocks' GEMMs are nearly all of a prefill's arithmetic (the loop body's L times over); cuBLAS
//! runs them at tensor-core rate on FP16 operands. The embedding and the head keep their codes.
//!
//! Numerics (docs/FORMAT.md "The FP16 body cache"): each weight is dequantized as
//! `scale · q + zero` in f32 (the CPU reference's rule) and rounded once to f16; products are
//! accumulated in f32, the gate and up products written as f16 for SwiGLU (half the bytes).
//! Decode rows (the GEMV path) keep reading the codes, so only products of more rows than the
//! GEMV takes change.

use rayon::prelude::*;

use half::f16;

use super::blas::{self, Blas, Output};
use super::{CudaBackend, CudaLinear};
use crate::backend::HostLinear;
use crate::env::Vars;
use crate::error::{Error, Result};
use crate::model::quant::f16_to_bytes;
use crate::model::weights::Weights;

/// The switch of the FP16 body cache when a caller does not say.
pub const ENV: &str = "TINYLOOP_EXPERIMENTAL_FP16_BODY";

/// Whether [`ENV`] asks for the FP16 body cache (`1`; `0`, unset or empty: no).
pub(crate) fn from_vars(vars: Vars) -> Result<bool> {
    vars.switch(ENV, false)
}

impl CudaBackend {
    /// Turn the FP16 body cache on before the weights are loaded: the pre and post blocks as
    /// loaded, and every loop body this backend or its sessions make (loaded, CTX-TIER's
    /// re-pack, or uploaded again), then give each quantized weight its FP16 copy
    /// ([`CudaBackend::attach_fp16_copy`]), and sessions get a cuBLAS handle each. Fails with a
    /// device error naming cuBLAS when it cannot be loaded.
    pub fn enable_fp16_body(&mut self) -> Result<()> {
        blas::load()?;
        // A handle made and dropped here: a cuBLAS that loads but cannot start fails the open.
        self.new_blas()?;
        self.fp16_body = true;
        Ok(())
    }

    /// Device bytes of the FP16 copies held by the block weights (pre and post blocks, and the
    /// loaded loop body), for the load log.
    pub fn fp16_body_bytes(&self, weights: &Weights<CudaBackend>) -> usize {
        let body = weights.body.loaded();
        let loop_blocks = body.iter().flat_map(|b| &b.blocks);
        weights
            .unshared
            .iter()
            .chain(loop_blocks)
            .flat_map(|b| b.all())
            .filter_map(|w| w.fp16.get().map(|copy| copy.bytes))
            .sum()
    }

    /// Give a quantized weight its FP16 copy, dequantized on the host from the weight's own
    /// device bytes (so that a re-packed body's copy holds its INT2 values). F16 weights need
    /// none: the tensor-core GEMM reads them as they are.
    pub(super) fn attach_fp16_copy(&self, w: &CudaLinear) -> Result<()> {
        if w.bits == 16 || w.fp16.get().is_some() {
            return Ok(());
        }
        let host = self.download_weight(w)?;
        let copy = self.upload_fp16_copy(&host.as_host())?;
        self.sync()?; // other sessions' streams read the copy: it must be complete first
        w.fp16
            .set(copy)
            .map_err(|_| Error::Device("the FP16 copy of a weight was built twice".into()))
    }

    /// A cuBLAS handle on this backend's stream.
    pub(super) fn new_blas(&self) -> Result<Blas> {
        Blas::new(&self.gpu, self.stream.cu_stream())
    }

    /// The FP16 values of a quantized linear on the device: `scale · q + zero` in f32, rounded
    /// to f16 (round to nearest even), row-major `[rows, cols]`.
    fn upload_fp16_copy(&self, host: &HostLinear) -> Result<super::DevBuf> {
        let q = host.to_quantized()?;
        let what = format!("the FP16 copy of a {}x{} weight", host.rows, host.cols);
        let mut values: Vec<f16> = crate::alloc::zeroed(host.rows * host.cols, &what)?;
        values.par_chunks_mut(host.cols).enumerate().for_each_init(
            || vec![0f32; host.cols],
            |row_f32, (row, out)| {
                q.dequantize_row(row, row_f32);
                for (o, &v) in out.iter_mut().zip(row_f32.iter()) {
                    *o = f16::from_f32(v);
                }
            },
        );
        let buf = self.gpu.alloc(values.len() * 2, &what)?;
        self.upload(&buf, 0, &f16_to_bytes(&values))?;
        Ok(buf)
    }

    /// Whether products with `w` run through cuBLAS on its FP16 copy: it has one and this
    /// backend a cuBLAS handle (sessions do).
    pub(super) fn has_fp16_product(&self, w: &CudaLinear) -> bool {
        w.fp16.get().is_some() && self.blas.is_some()
    }

    /// `out[r] (+)= x[r] · w[range]ᵀ` through cuBLAS on the FP16 copy of `w`, `out` of the given
    /// element type, if [`Self::has_fp16_product`]; returns whether it ran. A cuBLAS failure is
    /// remembered and returned by the next call that returns a `Result`.
    pub(super) fn fp16_product(
        &self,
        x: u64,
        rows: usize,
        w: &CudaLinear,
        range: &std::ops::Range<usize>,
        out: (u64, Output),
        accumulate: bool,
    ) -> bool {
        let (Some(copy), Some(blas)) = (w.fp16.get(), self.blas.as_ref()) else {
            return false;
        };
        let first = copy.ptr + (range.start * w.cols * 2) as u64;
        let r = self
            .gpu
            .bind()
            .and_then(|_| blas.gemm_f16(x, rows, w.cols, first, range.len(), out, accumulate));
        if let Err(e) = r {
            self.remember(e.to_string());
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::env;

    fn read(value: &[u8]) -> Result<bool> {
        let source = env::table(&[(ENV, value)]);
        from_vars(Vars::new(&source))
    }

    #[test]
    fn the_switch_is_0_or_1() {
        let source = env::table(&[]);
        assert!(!from_vars(Vars::new(&source)).unwrap());
        assert!(!read(b"").unwrap());
        assert!(!read(b"0").unwrap());
        assert!(read(b"1").unwrap());
        for bad in ["yes", "2", "-1"] {
            let e = read(bad.as_bytes()).unwrap_err().to_string();
            assert!(
                e.contains(&format!(
                    "{ENV}={bad:?} is not accepted: expected 1, on or true"
                )),
                "{e}"
            );
        }
        let e = read(env::NOT_UTF8).unwrap_err().to_string();
        assert!(
            e.contains(&format!("{ENV}=\"1\\xFF\" is not valid UTF-8")),
            "{e}"
        );
    }
}
