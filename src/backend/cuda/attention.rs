//! Attention and the KV cache on the GPU: cache storage (the bytes of [`KvLayout`]), storing a
//! step's entries, attention over f16 or quantized entries (positions split across blocks for
//! decode; positions the depth mask leaves out skipped), recomputing K and V from cached h, and
//! moving entries between age tiers. The CPU reference of each is src/backend/cpu/kv.rs.

use cudarc::driver::{result, sys};

use super::driver::{device_error, Arg, DevBuf};
use super::linear::CudaLinear;
use super::step::CudaStep;
use super::{kernels, CudaBackend, SCRATCH_TICKETS};
use crate::error::Result;
use crate::kv::{KvCache, KvMode, KvSlot, TierMove, H_TILE, KV_DESC_WORDS};

/// Rows up to which decode attention splits positions across blocks (flash-decoding).
pub(super) const SPLIT_ROWS: usize = 4;
/// Most position splits per (row, head) (the kernel's merge by one warp takes at most 32).
pub(super) const MAX_SPLITS: usize = 32;

/// Warps of an attention block (cuda/attention.cu `ATT_WARPS`): the parts a (row, head, split)'s
/// positions are cut in, and the heads a block of the `heads` kernels takes.
const ATT_WARPS: usize = 4;

/// Blocks of one head each, per SM, from which a launch takes the `heads` kernels instead: enough
/// waves that the per-block work (q, the page table, the merges, a split's fence and ticket)
/// costs more than the longer chain of a warp that takes all of a head's parts in turn.
const WARP_HEADS_BLOCKS_PER_SM: usize = 16;
/// Largest head dimension the attention kernels take.
pub(super) const MAX_HEAD_DIM: usize = 256;
/// Threads of the KV kernels (cuda/kv.cu `KV_THREADS`).
const KV_THREADS: u32 = 128;

/// The bytes of one KV cache on the device (nothing while it is empty).
pub struct CudaKv {
    buf: Option<DevBuf>,
}

impl CudaKv {
    fn ptr(&self) -> u64 {
        self.buf.as_ref().map_or(0, |b| b.ptr)
    }

    pub(super) fn bytes(&self) -> usize {
        self.buf.as_ref().map_or(0, |b| b.bytes)
    }
}

/// The by-value parameter of the quantized kernels (cuda/attention.cu `QuantKv`): the cache, its
/// layout, and the chain of slots to sum.
#[repr(C)]
struct QuantKvArg {
    base: u64,
    desc: [i64; KV_DESC_WORDS],
    first: i32,
    count: i32,
    stride: i32,
}

/// Where f16 entries are: K and V of slot `slot` at `k + slot · slot_stride` (in f16 values),
/// positions `kv_dim` apart; and which of them attention reads.
pub(super) struct F16Entries {
    pub(super) k: u64,
    pub(super) v: u64,
    pub(super) slot: usize,
    pub(super) slot_stride: usize,
    capacity: usize,
    pub(super) depth: DepthArgs,
}

/// The depth-mask arguments of an attention kernel: the mask's address (0: none, every position
/// is read) and the depth a position needs ([`crate::kv::Depths`]).
#[derive(Clone, Copy)]
pub(super) struct DepthArgs {
    pub(super) mask: u64,
    pub(super) need: u32,
}

impl DepthArgs {
    /// The mask attention at `at` applies: none outside loop slots or while the mask is off.
    fn of(kv: &KvCache<CudaKv>, at: KvSlot) -> DepthArgs {
        let need = kv.layout.depth_needed(at);
        match kv.depths.mask() {
            Some(mask) if need > 0 => DepthArgs {
                mask: mask.ptr(),
                need,
            },
            _ => DepthArgs { mask: 0, need: 0 },
        }
    }

    pub(super) fn args(self) -> [Arg; 2] {
        [Arg::P(self.mask), Arg::I(self.need as i32)]
    }
}

impl CudaBackend {
    pub(super) fn new_kv(&self, bytes: usize) -> Result<CudaKv> {
        let buf = (bytes > 0)
            .then(|| self.gpu.zeroed(bytes, "KV cache"))
            .transpose()?;
        Ok(CudaKv { buf })
    }

    /// The first `len` bytes of a KV cache's storage (tests and tools).
    pub fn read_kv_bytes(&self, kv: &CudaKv, len: usize) -> Result<Vec<u8>> {
        assert!(len <= kv.bytes(), "read past a KV cache");
        self.check()?;
        let mut out = vec![0u8; len];
        if len > 0 {
            self.gpu.bind()?;
            // SAFETY: the range lies inside the allocation (asserted); we wait for the copy below.
            unsafe { result::memcpy_dtoh_async(&mut out, kv.ptr(), self.stream.cu_stream()) }
                .map_err(|e| device_error("copying to the host", e))?;
            self.sync()?;
        }
        Ok(out)
    }

    pub(super) fn copy_kv_bytes(
        &self,
        from: &CudaKv,
        from_offset: usize,
        to: &mut CudaKv,
        to_offset: usize,
        bytes: usize,
    ) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        assert!(
            from_offset + bytes <= from.bytes() && to_offset + bytes <= to.bytes(),
            "copy past a KV cache"
        );
        let (src, dst) = (from.ptr() + from_offset as u64, to.ptr() + to_offset as u64);
        self.copy_device(src, dst, bytes, "copying the KV cache")
    }

    /// [`crate::backend::Backend::kv_write`].
    pub(super) fn write_kv_bytes(&self, kv: &CudaKv, offset: usize, bytes: &[u8]) -> Result<()> {
        match &kv.buf {
            Some(buf) => self.upload(buf, offset, bytes),
            None => {
                assert!(bytes.is_empty(), "write past a KV cache");
                Ok(())
            }
        }
    }

    /// [`crate::backend::Backend::kv_copy_within`].
    pub(super) fn copy_kv_ranges(
        &self,
        kv: &CudaKv,
        ranges: &[(usize, usize, usize)],
    ) -> Result<()> {
        for &(from, to, len) in ranges {
            assert!(from.max(to) + len <= kv.bytes(), "copy past the KV cache");
            let base = kv.ptr();
            self.copy_device(
                base + from as u64,
                base + to as u64,
                len,
                "copying KV entries",
            )?;
        }
        Ok(())
    }

    /// [`crate::backend::Backend::kv_store`].
    #[allow(clippy::too_many_arguments)]
    pub(super) fn store_kv(
        &self,
        qkv: &mut DevBuf,
        h: &DevBuf,
        step: &CudaStep,
        rows: usize,
        rope: &DevBuf,
        kv: &mut KvCache<CudaKv>,
        at: KvSlot,
    ) {
        let layout = &kv.layout;
        let heads = layout.heads;
        if layout.mode == KvMode::Fp16 {
            let f16 = self.f16_entries(kv, at);
            // Two pairs and two V values per thread where the vector accesses are aligned.
            let pairs_aligned =
                heads.head_dim.is_multiple_of(4) && f16.slot_stride.is_multiple_of(2);
            let width = if pairs_aligned && (f16.k | f16.v).is_multiple_of(4) {
                2
            } else {
                1
            };
            // The flash kernel rotates Q as it loads it: then only K heads are rotated here.
            let first_head = match self.flash_variant(step, rows, kv, &f16) {
                Some(_) => heads.n_heads,
                None => 0,
            };
            let pairs = (heads.n_heads + heads.n_kv_heads - first_head) * heads.head_dim / 2;
            let work = (pairs + heads.kv_dim()) / width;
            let args = [
                Arg::P(qkv.ptr),
                Arg::P(step.buf.ptr),
                Arg::usize(heads.n_heads),
                Arg::usize(heads.n_kv_heads),
                Arg::usize(heads.head_dim),
                Arg::P(rope.ptr),
                Arg::P(f16.k),
                Arg::P(f16.v),
                Arg::usize(f16.slot),
                Arg::L(f16.slot_stride as i64),
                Arg::usize(width),
                Arg::usize(first_head),
            ];
            let grid = (rows as u32, work.div_ceil(256) as u32, 1);
            return self.run("rope_kv", self.gpu.kernels.rope_kv, grid, 256, 0, &args);
        }
        let groups = if layout.mode.stores_input() {
            heads.n_heads
        } else {
            heads.n_heads + heads.n_kv_heads
        };
        let desc = layout.descriptor();
        let args = [
            Arg::P(qkv.ptr),
            Arg::P(h.ptr),
            Arg::P(step.buf.ptr),
            Arg::usize(heads.n_heads),
            Arg::usize(heads.n_kv_heads),
            Arg::usize(heads.head_dim),
            Arg::P(rope.ptr),
            Arg::P(kv.storage.ptr()),
            Arg::S(desc.as_ptr().cast()),
            Arg::usize(at.first),
            Arg::usize(at.count),
            Arg::usize(at.stride),
        ];
        let grid = (rows as u32, groups as u32, 1);
        self.run(
            "kv_store",
            self.gpu.kernels.kv_store,
            grid,
            KV_THREADS,
            0,
            &args,
        );
    }

    /// [`crate::backend::Backend::attention`].
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attend_kv(
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
        let mode = kv.layout.mode;
        if mode == KvMode::Fp16 {
            let f16 = self.f16_entries(kv, at);
            if self.flash_attend(qkv, rope, step, rows, kv, &f16, out) {
                return;
            }
            return self.attend(qkv, step, rows, kv, &f16, out, None);
        }
        if !mode.stores_input() {
            return self.attend_quantized(qkv, step, rows, kv, at, out);
        }
        self.rebuild_from_h(step, rows, kv, at, qkv_weight, rope);
        let layout = &kv.layout;
        let scratch = kv.storage.ptr() + layout.scratch_offset(kv.slots) as u64;
        let f16 = F16Entries {
            k: scratch + layout.scratch.k as u64,
            v: scratch + layout.scratch.v as u64,
            slot: 0,
            slot_stride: 0,
            capacity: layout.capacity,
            depth: DepthArgs::of(kv, at),
        };
        self.attend(qkv, step, rows, kv, &f16, out, None);
    }

    /// Decode in the fp16 mode: one kernel rotates q and the new K, writes the entry and attends
    /// (not in an engine's backend, whose one-row steps run as its others do). Every other case
    /// stores, then attends.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn store_and_attend(
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
        if self.kernel_rows(rows) == 1 && kv.layout.mode == KvMode::Fp16 && self.invariant.is_none()
        {
            let f16 = self.f16_entries(kv, at);
            return self.attend(qkv, step, rows, kv, &f16, out, Some(rope));
        }
        self.store_kv(qkv, h, step, rows, rope, kv, at);
        self.attend_kv(qkv, step, rows, kv, at, qkv_weight, rope, out);
    }

    /// [`crate::backend::Backend::kv_move`].
    pub(super) fn move_kv(&self, kv: &mut KvCache<CudaKv>, mv: &TierMove) {
        let layout = &kv.layout;
        let iterations = layout.iterations(kv.slots);
        let chains = layout.single_slots()
            + if iterations > 0 {
                layout.loop_blocks()
            } else {
                0
            };
        let desc = layout.descriptor();
        let args = [
            Arg::P(kv.storage.ptr()),
            Arg::S(desc.as_ptr().cast()),
            Arg::usize(mv.first),
            Arg::usize(mv.from),
            Arg::usize(mv.to),
            Arg::usize(layout.single_slots()),
            Arg::usize(iterations),
            Arg::usize(layout.loop_blocks()),
        ];
        let grid = (
            (mv.end - mv.first) as u32,
            layout.heads.n_kv_heads as u32,
            chains as u32,
        );
        self.run(
            "kv_move",
            self.gpu.kernels.kv_move,
            grid,
            KV_THREADS,
            0,
            &args,
        );
    }

    /// The fp16 mode's entries of the application at `at`.
    fn f16_entries(&self, kv: &KvCache<CudaKv>, at: KvSlot) -> F16Entries {
        let layout = &kv.layout;
        let regions = layout.tiers[0].regions;
        let base = kv.storage.ptr();
        F16Entries {
            k: base + regions[0].codes as u64,
            v: base + regions[1].codes as u64,
            slot: at.own(),
            slot_stride: layout.slot_bytes / 2,
            capacity: layout.capacity,
            depth: DepthArgs::of(kv, at),
        }
    }

    /// K and V of positions `0..start_pos + rows` recomputed from the h cached in `at`, into the
    /// scratch (f16), `H_TILE` positions at a time: dequantize h (INT modes), multiply by the K
    /// and V rows of the QKV weight with a kernel whose per-row result does not depend on the
    /// tile, then RoPE and round.
    fn rebuild_from_h(
        &self,
        step: &CudaStep,
        rows: usize,
        kv: &KvCache<CudaKv>,
        at: KvSlot,
        w: &CudaLinear,
        rope: &DevBuf,
    ) {
        let layout = &kv.layout;
        let heads = layout.heads;
        let (hd, q_dim, kv_dim) = (heads.head_dim, heads.q_dim(), heads.kv_dim());
        let base = kv.storage.ptr();
        let scratch = base + layout.scratch_offset(kv.slots) as u64;
        let tier = &layout.tiers[0];
        let own = at.own();
        let positions = step.start_pos + rows;
        let desc = layout.descriptor();
        let k = &self.gpu.kernels;
        for p0 in (0..positions).step_by(H_TILE) {
            let n = H_TILE.min(positions - p0);
            let x = if layout.mode == KvMode::Fp16H {
                base + (own * layout.slot_bytes + tier.regions[0].codes + p0 * tier.row_bytes)
                    as u64
            } else {
                let h = scratch + layout.scratch.h as u64;
                let args = [
                    Arg::P(base),
                    Arg::S(desc.as_ptr().cast()),
                    Arg::usize(own),
                    Arg::usize(p0),
                    Arg::P(h),
                ];
                let grid = (n as u32, heads.n_heads as u32, 1);
                self.run("h_dequant", k.h_dequant, grid, KV_THREADS, 0, &args);
                h
            };
            let product = scratch + layout.scratch.product as u64;
            self.product(x, n, w, q_dim..q_dim + 2 * kv_dim, product, false);
            let work = heads.n_kv_heads * hd / 2 + kv_dim;
            let args = [
                Arg::P(product),
                Arg::usize(heads.n_kv_heads),
                Arg::usize(hd),
                Arg::usize(p0),
                Arg::P(rope.ptr),
                Arg::P(scratch + layout.scratch.k as u64),
                Arg::P(scratch + layout.scratch.v as u64),
            ];
            let grid = (n as u32, work.div_ceil(256) as u32, 1);
            self.run("h_finish", k.h_finish, grid, 256, 0, &args);
        }
    }

    /// Position splits per (row, head) of a launch, and the span of each (0: the positions cut in
    /// `splits`). Decode rows get enough blocks to fill the GPU, from shapes only (the rows of the
    /// step's call, not of the step), never from the position, so a captured graph stays valid.
    /// An engine's backend cuts every row in slices of its fixed span, as many as the step's
    /// longest row needs ([`super::RowInvariant`]).
    fn splits(
        &self,
        step: &CudaStep,
        rows: usize,
        n_heads: usize,
        capacity: usize,
    ) -> (usize, usize) {
        if let Some(invariant) = self.invariant {
            return (self.pooled_splits(step), invariant.span);
        }
        let kernel_rows = self.kernel_rows(rows);
        if kernel_rows <= SPLIT_ROWS && self.split_floats > 0 {
            let splits = (2 * self.gpu.sms)
                .div_ceil(kernel_rows * n_heads)
                .min(MAX_SPLITS)
                .min(capacity.div_ceil(32))
                .max(1);
            (splits, 0)
        } else {
            (1, 0)
        }
    }

    /// Whether a launch takes the `heads` attention kernels (a head per warp, [`ATT_WARPS`] a
    /// block): for launches of many blocks, where the per-block work costs more than a warp's
    /// longer chain. Both kernels give the same bits, so the choice may follow the launch's shape.
    fn head_per_warp(&self, rows: usize, n_heads: usize, splits: usize) -> bool {
        splits <= MAX_SPLITS && rows * n_heads * splits >= WARP_HEADS_BLOCKS_PER_SM * self.gpu.sms
    }

    /// An engine's attention splits for the staged step: the slices of its longest row (every
    /// launch of the step has this grid; rows that need fewer leave the rest idle).
    pub(super) fn pooled_splits(&self, step: &CudaStep) -> usize {
        let span = self.invariant.map_or(usize::MAX, |i| i.span);
        let longest = step.pooled.unwrap_or(step.start_pos + step.rows);
        longest.div_ceil(span).max(1)
    }

    /// The attention kernel variant for the head dimension (hd <= 32 · DJ), or None (recorded as
    /// a launch failure) when it exceeds the largest.
    fn attention_variant(&self, hd: usize) -> Option<usize> {
        let dj = kernels::ATT_DJ.iter().position(|&dj| 32 * dj >= hd);
        if dj.is_none() {
            let invalid = sys::CUresult::CUDA_ERROR_INVALID_VALUE;
            self.record("attention", Err(cudarc::driver::DriverError(invalid)));
        }
        dj
    }

    /// Attention over f16 entries; with `rope`, also RoPE + KV write of the staged row (one row).
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        qkv: &DevBuf,
        step: &CudaStep,
        rows: usize,
        kv: &KvCache<CudaKv>,
        entries: &F16Entries,
        out: &mut DevBuf,
        rope: Option<&DevBuf>,
    ) {
        let heads = kv.layout.heads;
        let hd = heads.head_dim;
        let Some(dj) = self.attention_variant(hd) else {
            return;
        };
        let (splits, span) = self.splits(step, rows, heads.n_heads, entries.capacity);
        let per_warp = rope.is_none() && self.head_per_warp(rows, heads.n_heads, splits);
        let partial = self.scratch.ptr + self.partial_offset as u64;
        let tickets = self.scratch.ptr + SCRATCH_TICKETS as u64;
        let [mask, need] = entries.depth.args();
        let args = [
            Arg::P(qkv.ptr),
            Arg::P(step.buf.ptr),
            Arg::usize(heads.n_heads),
            Arg::usize(heads.n_kv_heads),
            Arg::usize(hd),
            Arg::F(1.0 / (hd as f32).sqrt()),
            Arg::P(entries.k),
            Arg::P(entries.v),
            Arg::usize(entries.slot),
            Arg::L(entries.slot_stride as i64),
            Arg::usize(splits),
            Arg::usize(span),
            Arg::P(out.ptr),
            Arg::P(partial),
            Arg::P(tickets),
            Arg::P(rope.map_or(0, |r| r.ptr)),
            mask,
            need,
        ];
        let grid = attention_grid(per_warp, heads.n_heads, rows, splits);
        let f = self.gpu.kernels.attention[usize::from(per_warp)][dj];
        self.run("attention", f, grid, 128, 0, &args);
    }

    /// Attention over quantized entries, summed over the chain of `at`.
    fn attend_quantized(
        &self,
        qkv: &DevBuf,
        step: &CudaStep,
        rows: usize,
        kv: &KvCache<CudaKv>,
        at: KvSlot,
        out: &mut DevBuf,
    ) {
        let heads = kv.layout.heads;
        let hd = heads.head_dim;
        let Some(dj) = self.attention_variant(hd) else {
            return;
        };
        let (splits, span) = self.splits(step, rows, heads.n_heads, kv.layout.capacity);
        let per_warp = self.head_per_warp(rows, heads.n_heads, splits);
        let partial = self.scratch.ptr + self.partial_offset as u64;
        let tickets = self.scratch.ptr + SCRATCH_TICKETS as u64;
        let quant = QuantKvArg {
            base: kv.storage.ptr(),
            desc: kv.layout.descriptor(),
            first: at.first as i32,
            count: at.count as i32,
            stride: at.stride as i32,
        };
        let [mask, need] = DepthArgs::of(kv, at).args();
        let args = [
            Arg::P(qkv.ptr),
            Arg::P(step.buf.ptr),
            Arg::usize(heads.n_heads),
            Arg::usize(heads.n_kv_heads),
            Arg::usize(hd),
            Arg::F(1.0 / (hd as f32).sqrt()),
            Arg::usize(splits),
            Arg::usize(span),
            Arg::P(out.ptr),
            Arg::P(partial),
            Arg::P(tickets),
            mask,
            need,
            Arg::S((&quant as *const QuantKvArg).cast()),
        ];
        let grid = attention_grid(per_warp, heads.n_heads, rows, splits);
        let f = self.gpu.kernels.attention_q[usize::from(per_warp)][dj];
        self.run("attention_q", f, grid, 128, 0, &args);
    }
}

/// The attention kernels' grid: a block per (head, row, split), or per [`ATT_WARPS`] heads of a
/// (row, split) for the `heads` kernels.
fn attention_grid(per_warp: bool, n_heads: usize, rows: usize, splits: usize) -> (u32, u32, u32) {
    let heads_per_block = if per_warp { ATT_WARPS } else { 1 };
    (
        n_heads.div_ceil(heads_per_block) as u32,
        rows as u32,
        splits as u32,
    )
}
