//! Linear layers on the GPU: weights, the GEMV kernels for decode (norm and SwiGLU fused), the
//! tensor-core GEMM for prefill, and the generic fallback for shapes the fast kernels do not take.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use super::blas::Output;
use super::driver::{Arg, DevBuf};
use super::kernels::{
    self, ProductShape, SmallGemmPlan, SplitGemmPlan, TiledGemmPlan, WgmmaGemmPlan,
};
use super::{blocks_for, CudaBackend};
use crate::backend::{Backend, HostLinear, NormLayer, OwnedLinear, Residual};
use crate::error::{Error, Result};
use crate::format::{check_group_size, DType};
use crate::model::config::NormKind;

/// A linear weight on the device: codes (or f16 values) at offset 0, then f16 scales and zeros
/// at `params_offset` (the file's layout, with the parameters moved to an aligned offset).
pub struct CudaLinear {
    pub(super) buf: DevBuf,
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) bits: u32,
    group: usize,
    params_offset: usize,
    /// The shape suits the fast kernels (K and the group size multiples of 32).
    fast: bool,
    /// Threads per output row in the GEMV kernels.
    tpr: u32,
    /// Loads are marked evict-first in L2 (everything but the loop body; see `finish_load`).
    pub(super) streamed: AtomicBool,
    /// FP16 values for cuBLAS prefill products (the opt-in FP16 body cache; `fp16_body`).
    pub(super) fp16: OnceLock<DevBuf>,
}

impl CudaLinear {
    pub(super) fn ptr(&self) -> u64 {
        self.buf.ptr
    }
    fn params(&self) -> u64 {
        self.buf.ptr + self.params_offset as u64
    }
    /// Where weight row `first`'s codes, scales and zeros are.
    fn rows_at(&self, first: usize) -> (u64, u64, u64) {
        let groups = if self.bits == 16 {
            1
        } else {
            self.cols / self.group
        };
        let codes = self.ptr() + (first * self.cols * self.bits as usize / 8) as u64;
        let scales = self.params() + (first * groups * 2) as u64;
        let zeros = self.params() + ((self.rows + first) * groups * 2) as u64;
        (codes, scales, zeros)
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
    pub(super) buf: DevBuf,
    pub(super) len: usize,
}

impl CudaBackend {
    /// Upload a linear weight (codes, then its scales and zeros at an aligned offset).
    pub(super) fn upload_weight(&self, w: &HostLinear) -> Result<CudaLinear> {
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
        let buf = self.gpu.alloc(
            params_offset + params_len,
            &format!("a {}x{} {} weight", w.rows, w.cols, w.dtype.name()),
        )?;
        self.upload(&buf, 0, &w.bytes[..codes_len])?;
        self.upload(&buf, params_offset, &w.bytes[codes_len..])?;
        Ok(self.linear_in(buf, w.rows, w.cols, w.dtype, w.group_size, params_offset))
    }

    /// A weight over `buf` (codes at 0, parameters at `params_offset`).
    fn linear_in(
        &self,
        buf: DevBuf,
        rows: usize,
        cols: usize,
        dtype: DType,
        group: usize,
        params_offset: usize,
    ) -> CudaLinear {
        let quantized = dtype.is_quantized();
        let fast = cols.is_multiple_of(32) && (!quantized || group.is_multiple_of(32));
        let units = if quantized { cols / 32 } else { cols / 8 };
        CudaLinear {
            buf,
            rows,
            cols,
            bits: dtype.bits(),
            group,
            params_offset,
            fast,
            tpr: choose_tpr(rows, units.max(1), self.gpu.sms, self.tuning.gemv_tpr),
            streamed: AtomicBool::new(true),
            fp16: OnceLock::new(),
        }
    }

    pub(super) fn dtype_of(w: &CudaLinear) -> DType {
        match w.bits {
            4 => DType::Int4,
            2 => DType::Int2,
            _ => DType::F16,
        }
    }

    /// `w` re-quantized to `dtype` at the same group size by the `requantize_group` kernel (bit
    /// for bit `QuantizedMatrix::requantize`), in stream order.
    pub(super) fn requantize_weight(&self, w: &CudaLinear, dtype: DType) -> Result<CudaLinear> {
        if w.bits == 16 || !dtype.is_quantized() {
            return Err(Error::invalid(format!(
                "cannot re-quantize a {} weight to {}: both must be quantized",
                Self::dtype_of(w).name(),
                dtype.name()
            )));
        }
        check_group_size(dtype, w.cols as u64, w.group as u64).map_err(|why| {
            Error::invalid(format!("cannot re-quantize to {}: {why}", dtype.name()))
        })?;
        let n_params = w.rows * (w.cols / w.group);
        let codes_len = w.rows * w.cols * dtype.bits() as usize / 8;
        let params_offset = codes_len.div_ceil(256) * 256;
        let buf = self.gpu.alloc(
            params_offset + 4 * n_params,
            &format!("a {}x{} {} weight", w.rows, w.cols, dtype.name()),
        )?;
        let out = self.linear_in(buf, w.rows, w.cols, dtype, w.group, params_offset);
        let zeros = 2 * n_params as u64;
        self.run(
            "requantize_group",
            self.gpu.kernels.requantize_group,
            (u32::try_from(n_params).expect("groups fit a grid"), 1, 1),
            128,
            0,
            &[
                Arg::P(w.ptr()),
                Arg::P(w.params()),
                Arg::P(w.params() + zeros),
                Arg::I(w.bits as i32),
                Arg::P(out.ptr()),
                Arg::P(out.params()),
                Arg::P(out.params() + zeros),
                Arg::I(dtype.bits() as i32),
                Arg::usize(w.cols),
                Arg::usize(w.group),
            ],
        );
        self.check()?;
        Ok(out)
    }

    /// A weight's bytes in the file's encoding: codes (or f16 values), then scales and zeros.
    pub(super) fn download_weight(&self, w: &CudaLinear) -> Result<OwnedLinear> {
        let dtype = Self::dtype_of(w);
        let codes_len = w.rows * w.cols * w.bits as usize / 8;
        let params_len = if dtype.is_quantized() {
            4 * w.rows * (w.cols / w.group)
        } else {
            0
        };
        let mut bytes = self.download(&w.buf, 0, codes_len)?;
        bytes.extend(self.download(&w.buf, w.params_offset, params_len)?);
        Ok(OwnedLinear {
            rows: w.rows,
            cols: w.cols,
            dtype,
            group_size: w.group_arg(),
            bytes,
        })
    }

    /// `out[r] (+)= x[r] · wᵀ` for `rows` rows at `x` (f16) into `out` (f32).
    pub(super) fn matmul(&self, x: u64, rows: usize, w: &CudaLinear, out: u64, accumulate: bool) {
        let k = &self.gpu.kernels;
        let (n, kk) = (w.rows, w.cols);
        let stream = Arg::I(w.streamed.load(Ordering::Relaxed) as i32);
        let acc = Arg::I(accumulate as i32);
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
        self.product(x, rows, w, 0..n, out, accumulate);
    }

    /// `out[r] (+)= x[r] · w[range]ᵀ` without the GEMV path (`out` rows are `range.len()` wide):
    /// the tensor-core GEMM (a block per segment of K where the partial sums fit in the
    /// scratch; else tiles of 64 or 128 rows by 128 weight rows where they fill the GPU;
    /// otherwise, and for at most one MMA tile of rows, blocks of 16 weight rows whose warps take
    /// K in parallel segments), or the generic kernel for shapes it does not take. Each output
    /// is accumulated in the same order whatever `rows` is, in every kernel, so a row's result
    /// does not depend on the rows computed with it.
    pub(super) fn product(
        &self,
        x: u64,
        rows: usize,
        w: &CudaLinear,
        range: std::ops::Range<usize>,
        out: u64,
        accumulate: bool,
    ) {
        if self.fp16_product(x, rows, w, &range, (out, Output::F32), accumulate) {
            return;
        }
        let n = range.len();
        let k = &self.gpu.kernels;
        let args = gemm_args(x, rows, w, range.start, n, out, accumulate);
        if !w.fast {
            // gemm_b*'s arguments with the bits after the zeros and no stream hint (args[8]).
            let a = args;
            let bits = Arg::I(w.bits as i32);
            let args = [
                a[0], a[1], a[2], a[3], a[4], a[5], bits, a[6], a[7], a[9], a[10],
            ];
            let grid = (n.div_ceil(8) as u32, rows as u32, 1);
            return self.run("linear_generic", k.linear_generic, grid, 256, 0, &args);
        }
        // The block kernels ([`Self::block_plan`]), then block tiles over all of K where they
        // fill the GPU, blocks of 16 weight rows where they do not. Every kernel sums a row's
        // products in one order, so the choice never changes a row's bits.
        let (parts, floats) = self.gemm_parts();
        match self.block_plan(rows, w, n, floats) {
            Some(BlockPlan::Wgmma(plan)) => return self.wgmma_product(&args, plan),
            Some(BlockPlan::Split(plan)) => {
                self.split_product(&args, plan, w, parts);
                return self.segments_sum(parts, plan.segments, rows * n, out, accumulate);
            }
            None => {}
        }
        let smem_limit = self.gpu.smem_optin.saturating_sub(2048);
        if let Some(plan) = TiledGemmPlan::new(w.bits, rows, n, self.gpu.sms, smem_limit) {
            return self.run(
                "gemm_tiled",
                k.gemm_tiled[w.bits_index()][plan.rows_index],
                plan.grid(),
                plan.threads,
                plan.smem,
                &args,
            );
        }
        let plan = SmallGemmPlan::new(w.bits, rows, n, self.gpu.sms, smem_limit);
        let mut args = args.to_vec();
        args.push(Arg::usize(plan.col_groups));
        self.run(
            "gemm_small",
            k.gemm_small[w.bits_index()][plan.tiles_index],
            plan.grid(),
            kernels::SMALL_GEMM_THREADS,
            plan.smem,
            &args,
        )
    }

    /// The block kernel a product of `rows` rows by `n` weight rows of `w` takes, with `parts`
    /// floats of the scratch for its partial sums: wgmma's blocks on sm_90a for a whole block of
    /// rows (64) or more, where they fill the GPU and the units' S fits; otherwise split by
    /// segment wherever the partial sums fit; then wgmma for fewer rows; else none (the tiled and
    /// small kernels). f16 weights (the head) take wgmma wherever its blocks fill the GPU,
    /// whatever the rows: they have no unit sums to compute first, and the split kernel's
    /// partial sums of a product as wide as a head are tens of megabytes written and read again.
    fn block_plan(&self, rows: usize, w: &CudaLinear, n: usize, parts: usize) -> Option<BlockPlan> {
        let smem_limit = self.gpu.smem_optin.saturating_sub(2048);
        let shape = ProductShape {
            bits: w.bits,
            rows,
            n,
            k: w.cols,
            group: w.group_arg(),
        };
        let wgmma = (self.gpu.arch == kernels::WGMMA_ARCH)
            .then(|| WgmmaGemmPlan::new(shape, self.gpu.sms, smem_limit, parts))
            .flatten();
        match (
            wgmma,
            SplitGemmPlan::new(shape, self.gpu.sms, smem_limit, parts),
        ) {
            (Some(plan), split)
                if rows >= kernels::WGMMA_GEMM_ROWS[0] || split.is_none() || !plan.needs_sums() =>
            {
                Some(BlockPlan::Wgmma(plan))
            }
            (_, Some(plan)) => Some(BlockPlan::Split(plan)),
            _ => None,
        }
    }

    /// A product of many rows on wgmma ([`WgmmaGemmPlan`]): the S of every unit into the
    /// scratch's partial sums, then the product. `args` are `gemm_b*`'s.
    fn wgmma_product(&self, args: &[Arg], plan: WgmmaGemmPlan) {
        self.unit_sums(args, plan);
        self.wgmma_on_sums(args, plan);
    }

    /// The S of every unit of X (`args` are `gemm_b*`'s) for `plan`, into the scratch's partial
    /// sums, where [`Self::wgmma_on_sums`] reads them (none for f16 weights).
    fn unit_sums(&self, args: &[Arg], plan: WgmmaGemmPlan) {
        if !plan.needs_sums() {
            return;
        }
        let (sums, _) = self.gemm_parts();
        let (x, rows, cols, group) = (args[0], args[1], args[2], args[7]);
        let sums_args = [x, rows, cols, group, Arg::usize(plan.sums_ld), Arg::P(sums)];
        self.run(
            "gemm_unit_sums",
            self.gpu.kernels.gemm_unit_sums,
            plan.sums_grid(),
            256,
            0,
            &sums_args,
        );
    }

    /// The product of `args` on wgmma, over the S that [`Self::unit_sums`] left for its X.
    fn wgmma_on_sums(&self, args: &[Arg], plan: WgmmaGemmPlan) {
        let (sums, _) = self.gemm_parts();
        let mut product_args = args[..8].to_vec();
        product_args.extend([Arg::P(sums), Arg::usize(plan.sums_ld), args[9], args[10]]);
        self.run(
            "gemm_wgmma",
            self.gpu.kernels.gemm_wgmma[plan.bits_index][plan.rows_index],
            plan.grid(),
            kernels::WGMMA_GEMM_THREADS,
            plan.smem,
            &product_args,
        );
    }

    /// Gate and up of `rows` rows on wgmma, over one computation of their X's S (the same X, so
    /// the same S): runs (and returns true) only where both would take wgmma anyway.
    fn wgmma_gate_up(
        &self,
        x: u64,
        rows: usize,
        gate: &CudaLinear,
        up: &CudaLinear,
        (gate_out, up_out): (u64, u64),
    ) -> bool {
        let fast = gate.fast && same_shape(gate, up);
        if !fast || self.has_fp16_product(gate) || self.has_fp16_product(up) {
            return false;
        }
        let (_, floats) = self.gemm_parts();
        let Some(BlockPlan::Wgmma(plan)) = self.block_plan(rows, gate, gate.rows, floats) else {
            return false;
        };
        let gate_args = gemm_args(x, rows, gate, 0, gate.rows, gate_out, false);
        self.unit_sums(&gate_args, plan);
        self.wgmma_on_sums(&gate_args, plan);
        self.wgmma_on_sums(&gemm_args(x, rows, up, 0, up.rows, up_out, false), plan);
        true
    }

    /// A product of few rows split by segment ([`SplitGemmPlan`]): each segment's sums into
    /// `parts` (`[segment][row][column]`), which the caller adds. `args` are `gemm_b*`'s.
    fn split_product(&self, args: &[Arg], plan: SplitGemmPlan, w: &CudaLinear, parts: u64) {
        let k = &self.gpu.kernels;
        let mut split_args = args[..9].to_vec();
        split_args.push(Arg::P(parts));
        self.run(
            "gemm_split",
            k.gemm_split[w.bits_index()][plan.tiles_index],
            plan.grid(),
            32 * plan.warps as u32,
            plan.smem,
            &split_args,
        );
    }

    /// `out` (+)= the in-order sums of `segments` partial sums of `outputs` floats at `parts`.
    fn segments_sum(&self, parts: u64, segments: usize, outputs: usize, out: u64, acc: bool) {
        let sum_args = [
            Arg::P(parts),
            Arg::usize(segments),
            Arg::usize(outputs),
            Arg::P(out),
            Arg::I(acc as i32),
        ];
        let grid = (outputs.div_ceil(256) as u32, 1, 1);
        let k = &self.gpu.kernels;
        self.run(
            "gemm_segments_sum",
            k.gemm_segments_sum,
            grid,
            256,
            0,
            &sum_args,
        );
    }

    /// Gate and up of `rows` rows split by segment, their sums side by side in the scratch, then
    /// one kernel that adds each one's segments in order and applies SwiGLU: the values of two
    /// `gemm_segments_sum` and `swiglu`, in one launch instead of three. Runs (and returns true)
    /// only where both products would take the split kernel anyway and both sums fit.
    fn split_swiglu(
        &self,
        x: u64,
        rows: usize,
        gate: &CudaLinear,
        up: &CudaLinear,
        out: u64,
    ) -> bool {
        if !same_shape(gate, up) || self.has_fp16_product(gate) || self.has_fp16_product(up) {
            return false;
        }
        let (parts, floats) = self.gemm_parts();
        let n = gate.rows;
        let half = floats / 2 / 64 * 64;
        let plan = match (
            self.block_plan(rows, gate, n, floats),
            self.block_plan(rows, gate, n, half),
        ) {
            (Some(BlockPlan::Split(plan)), Some(BlockPlan::Split(_))) => plan,
            _ => return false,
        };
        let up_parts = parts + half as u64 * 4;
        self.split_product(&gemm_args(x, rows, gate, 0, n, 0, false), plan, gate, parts);
        self.split_product(&gemm_args(x, rows, up, 0, n, 0, false), plan, up, up_parts);
        let len = rows * n;
        self.run(
            "swiglu_segments",
            self.gpu.kernels.swiglu_segments,
            (len.div_ceil(256) as u32, 1, 1),
            256,
            0,
            &[
                Arg::P(parts),
                Arg::P(up_parts),
                Arg::usize(plan.segments),
                Arg::usize(len),
                Arg::P(out),
            ],
        );
        true
    }

    /// Whether one row's norm can be fused into the GEMV of `w` (decode): the normalizing
    /// GEMV variant that does it.
    fn fused_norm(
        &self,
        norm: &NormLayer<CudaVector>,
        rows: usize,
        w: &CudaLinear,
    ) -> Option<usize> {
        let fits = self.kernel_rows(rows) == 1
            && norm.weight.len == w.cols
            && self.gemv_rows(w, 1).is_some();
        norm_chunks(w.cols).filter(|_| fits)
    }

    /// The GEMV row variant (index into GEMV_ROWS) for `rows` rows, if the GEMV path applies
    /// (never in an engine's backend, [`super::RowInvariant`]).
    fn gemv_rows(&self, w: &CudaLinear, rows: usize) -> Option<usize> {
        if self.invariant.is_some() {
            return None;
        }
        let ri = kernels::GEMV_ROWS
            .iter()
            .position(|&r| r >= self.kernel_rows(rows))?;
        let limit = self.gpu.smem_optin.saturating_sub(2048);
        (w.fast && w.gemv_smem(kernels::GEMV_ROWS[ri]) <= limit).then_some(ri)
    }

    /// [`Backend::norm_linear`] (and with `pending`, [`Backend::residual_norm_linear`]): fused
    /// into one GEMV for a decode row when the shapes allow.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn norm_then_linear(
        &self,
        norm: &NormLayer<CudaVector>,
        x: &DevBuf,
        pending: Pending<'_, '_>,
        rows: usize,
        w: &CudaLinear,
        h: &mut DevBuf,
        out: &mut DevBuf,
    ) {
        let Some(chunks) = self.fused_norm(norm, rows, w) else {
            let x = self.settle(x, pending, rows);
            self.norm_rows(norm, x, rows, h);
            return self.matmul(h.ptr, rows, w, out.ptr, false);
        };
        let k = &self.gpu.kernels;
        let [a0, a1, a2, a3, a4, a5] = norm_args(norm, x);
        let [r0, r1, r2, r3, r4] = residual_args(pending);
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
            r0,
            r1,
            r2,
            r3,
            r4,
        ];
        let grid = (w.rows.div_ceil(256 / w.tpr as usize) as u32, 1, 1);
        let smem = w.gemv_smem(1);
        self.run(
            "gemv_norm",
            k.gemv_norm[w.bits_index()][chunks],
            grid,
            256,
            smem,
            &args,
        );
    }

    /// [`Backend::norm_mlp_gate_up`] (and with `pending`, [`Backend::residual_norm_mlp_gate_up`]):
    /// fused into one GEMV for a decode row when the shapes allow.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn norm_then_gate_up(
        &self,
        norm: &NormLayer<CudaVector>,
        x: &DevBuf,
        pending: Pending<'_, '_>,
        rows: usize,
        gate: &CudaLinear,
        up: &CudaLinear,
        h: &mut DevBuf,
        scratch: (&mut DevBuf, &mut DevBuf),
        out: &mut DevBuf,
    ) {
        let fused = self.fused_norm(norm, rows, gate);
        let Some(chunks) = fused.filter(|_| same_shape(gate, up)) else {
            let x = self.settle(x, pending, rows);
            self.norm_rows(norm, x, rows, h);
            return self.gate_up(h, rows, gate, up, scratch.0, scratch.1, out);
        };
        let k = &self.gpu.kernels;
        let [a0, a1, a2, a3, a4, a5] = norm_args(norm, x);
        let [r0, r1, r2, r3, r4] = residual_args(pending);
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
            r0,
            r1,
            r2,
            r3,
            r4,
        ];
        let grid = (gate.rows.div_ceil(256 / gate.tpr as usize) as u32, 1, 1);
        let smem = gate.gemv_smem(1);
        let f = k.gemv_gateup_norm[gate.bits_index()][chunks];
        self.run("gemv_gateup_norm", f, grid, 256, smem, &args);
    }

    /// The stream a normalizing product reads: `x`, or with a pending sublayer output, `next`
    /// once the output is added into it.
    fn settle<'b>(&self, x: &'b DevBuf, pending: Pending<'_, 'b>, rows: usize) -> &'b DevBuf {
        match pending {
            None => x,
            Some((residual, next)) => {
                self.residual_norm_into(residual, x, rows, next);
                next
            }
        }
    }

    /// [`Backend::mlp_gate_up`]: gate and up in one GEMV (SiLU fused) when they fit, else two
    /// products split by segment whose sums one kernel adds and combines
    /// ([`Self::split_swiglu`]), else two products and a SwiGLU kernel.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gate_up(
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
            None if self.has_fp16_product(gate) && self.has_fp16_product(up) => {
                // cuBLAS writes gate and up as f16 (half the bytes SwiGLU reads) into the
                // first half of their f32 buffers.
                let all = 0..gate.rows;
                self.fp16_product(x.ptr, rows, gate, &all, (gate_buf.ptr, Output::F16), false);
                self.fp16_product(x.ptr, rows, up, &all, (up_buf.ptr, Output::F16), false);
                let len = rows * gate.rows;
                self.run(
                    "swiglu_half",
                    self.gpu.kernels.swiglu_half,
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
            None => {
                if self.split_swiglu(x.ptr, rows, gate, up, out.ptr) {
                    return;
                }
                let outs = (gate_buf.ptr, up_buf.ptr);
                if !self.wgmma_gate_up(x.ptr, rows, gate, up, outs) {
                    self.matmul(x.ptr, rows, gate, gate_buf.ptr, false);
                    self.matmul(x.ptr, rows, up, up_buf.ptr, false);
                }
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
}

/// The arguments of the `gemm_b*` kernels for a product of `rows` rows of X at `x` by the `n`
/// weight rows of `w` from row `first`.
fn gemm_args(
    x: u64,
    rows: usize,
    w: &CudaLinear,
    first: usize,
    n: usize,
    out: u64,
    accumulate: bool,
) -> [Arg; 11] {
    let (codes, scales, zeros) = w.rows_at(first);
    [
        Arg::P(x),
        Arg::usize(rows),
        Arg::usize(w.cols),
        Arg::P(codes),
        Arg::P(scales),
        Arg::P(zeros),
        Arg::usize(n),
        Arg::usize(w.group_arg()),
        Arg::I(w.streamed.load(Ordering::Relaxed) as i32),
        Arg::P(out),
        Arg::I(accumulate as i32),
    ]
}

/// A product's block kernel ([`CudaBackend::block_plan`]).
enum BlockPlan {
    Wgmma(WgmmaGemmPlan),
    Split(SplitGemmPlan),
}

/// Threads per output row for a GEMV over `units` 16-byte units per row and `n` rows: up to `cap`
/// (`TINYLOOP_CUDA_GEMV_TPR`, default 16: measured on an H200 for tl-407m, 16 rows of 16 threads
/// per block beat 8 rows of 32, 0.545 vs 0.60 ms/token, by amortizing the staging of x over more
/// rows), more while the grid would leave SMs idle.
fn choose_tpr(n: usize, units: usize, sms: usize, cap: usize) -> u32 {
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

/// The normalizing GEMV variant (index into [`kernels::GEMV_NORM_CHUNKS`]) for rows of `k`
/// values: the fewest chunks per thread that hold the row.
fn norm_chunks(k: usize) -> Option<usize> {
    kernels::GEMV_NORM_CHUNKS
        .iter()
        .position(|&chunks| k <= 8 * 256 * chunks)
}

/// The leading arguments of the normalizing GEMV kernels: the f32 row and the norm layer.
/// A pending sandwich sublayer output and the buffer that receives the stream with it added.
pub(super) type Pending<'r, 'b> = Option<(&'r Residual<'r, CudaVector, DevBuf>, &'b mut DevBuf)>;

/// The residual arguments of the normalizing GEMVs (`res_mode`, `delta`, `ow`, `ob`, `x_next`).
fn residual_args(pending: Pending<'_, '_>) -> [Arg; 5] {
    match pending {
        None => [Arg::I(0), Arg::P(0), Arg::P(0), Arg::P(0), Arg::P(0)],
        Some((residual, next)) => [
            Arg::I(super::residual_mode(residual.layout)),
            Arg::P(residual.delta.ptr),
            Arg::P(residual.norm.weight.buf.ptr),
            Arg::P(residual.norm.bias.map_or(0, |b| b.buf.ptr)),
            Arg::P(next.ptr),
        ],
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tpr_fills_the_gpu_for_short_grids() {
        // tl-407m shapes on 132 SMs.
        assert_eq!(choose_tpr(6144, 64, 132, 16), 16); // qkv: 384 blocks
        assert_eq!(choose_tpr(2048, 256, 132, 16), 32); // down: 128 blocks at 16 → widened
        assert_eq!(choose_tpr(50304, 256, 132, 16), 16); // head
        assert_eq!(choose_tpr(64, 2, 132, 16), 2); // tiny: two units per row
        assert_eq!(choose_tpr(64, 64, 132, 16), 64);
    }
}
