//! Multi-row attention over f16 K and V on the tensor cores (cuda/flash.cu): every step of more
//! than one row in the fp16 KV mode, whatever its length, so that chunked prefill sums each row
//! exactly as single shot does. Decode rows keep the fused kernel of src/backend/cuda/attention.rs.

use super::attention::{CudaKv, F16Entries};
use super::driver::{Arg, DevBuf};
use super::step::CudaStep;
use super::{kernels, CudaBackend};
use crate::error::Result;
use crate::kv::{KvCache, KvMode};

/// Query rows per block (cuda/flash.cu `FA_BQ`).
const BLOCK_ROWS: usize = 64;
/// Threads per block (cuda/flash.cu `FA_THREADS`).
const THREADS: u32 = 128;
/// Positions per key tile (cuda/flash.cu `FA_BK`).
const TILE_KEYS: usize = 64;

/// The kernel's scratch for steps of up to some number of rows: a ticket per (query tile, head),
/// zero between launches, then a slot per (query tile, head) for the partial sums of the first of
/// its two blocks to finish, `BLOCK_ROWS` × (head_dim + 2) floats.
pub(super) struct FlashScratch {
    pub(super) buf: DevBuf,
    /// Byte offset of the partial sums in `buf`.
    partials: usize,
}

/// Dynamic shared memory of the kernel for head dimension `hd`: two stages of a K and a V tile,
/// rows padded by 8 halves (cuda/flash.cu). 69 632 bytes at `hd` = 128.
pub(super) fn smem_bytes(hd: usize) -> usize {
    2 * 2 * TILE_KEYS * (hd + 8) * 2
}

impl CudaBackend {
    /// The kernel's scratch for steps of up to `max_rows` rows of `n_heads` heads of `hd`; none
    /// where the kernel has no variant for `hd` or no step has more than one row.
    pub(super) fn new_flash_scratch(
        &self,
        max_rows: usize,
        n_heads: usize,
        hd: usize,
    ) -> Result<Option<Box<FlashScratch>>> {
        if max_rows < 2 || !kernels::FLASH_HD.contains(&hd) {
            return Ok(None);
        }
        let slots = max_rows.div_ceil(BLOCK_ROWS) * n_heads;
        let partials = (slots * 4).div_ceil(256) * 256;
        let bytes = partials + slots * BLOCK_ROWS * (hd + 2) * 4;
        let buf = self.gpu.zeroed(bytes, "flash attention scratch")?;
        Ok(Some(Box::new(FlashScratch { buf, partials })))
    }

    /// The kernel variant (an index into `kernels::FLASH_HD`) that attends this step of `rows`
    /// rows, or None when the step is not one it takes: one row (of a one-row call), another KV
    /// mode, an uninstantiated head dimension, cache rows not 16-byte aligned, a device with too
    /// little shared memory per block, or more blocks than a grid holds. rope_kv asks too: Q is rotated
    /// by the flash kernel when it takes the step, by rope_kv otherwise.
    pub(super) fn flash_variant(
        &self,
        step: &CudaStep,
        rows: usize,
        kv: &KvCache<CudaKv>,
        entries: &F16Entries,
    ) -> Option<usize> {
        let heads = kv.layout.heads;
        let hd = heads.head_dim;
        let variant = kernels::FLASH_HD.iter().position(|&d| d == hd)?;
        step.flash.as_ref()?;
        let slot_offset = entries.slot * entries.slot_stride;
        let aligned = (entries.k | entries.v | (2 * slot_offset) as u64).is_multiple_of(16);
        // allow_dynamic_smem's limit
        let fits = smem_bytes(hd) <= self.gpu.smem_optin.saturating_sub(2048);
        let blocks_fit = flash_blocks(heads.n_heads, rows) <= i32::MAX as usize;
        let one_sequence = step.pooled.is_none();
        let takes = self.kernel_rows(rows) >= 2
            && one_sequence
            && kv.layout.mode == KvMode::Fp16
            && aligned
            && fits
            && blocks_fit;
        takes.then_some(variant)
    }

    /// Attention of `rows` > 1 rows in the fp16 mode through the tensor-core kernel, Q rotated by
    /// `rope` as it is loaded; false (and nothing launched) when [`Self::flash_variant`] has none.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn flash_attend(
        &self,
        qkv: &DevBuf,
        rope: &DevBuf,
        step: &CudaStep,
        rows: usize,
        kv: &KvCache<CudaKv>,
        entries: &F16Entries,
        out: &mut DevBuf,
    ) -> bool {
        let Some(variant) = self.flash_variant(step, rows, kv, entries) else {
            return false;
        };
        let Some(scratch) = step.flash.as_ref() else {
            return false;
        };
        let heads = kv.layout.heads;
        let hd = heads.head_dim;
        let [mask, need] = entries.depth.args();
        let args = [
            Arg::P(qkv.ptr),
            Arg::P(rope.ptr),
            Arg::P(step.buf.ptr),
            Arg::usize(rows),
            Arg::usize(heads.n_heads),
            Arg::usize(heads.n_kv_heads),
            Arg::F(1.0 / (hd as f32).sqrt()),
            Arg::P(entries.k),
            Arg::P(entries.v),
            Arg::L((entries.slot * entries.slot_stride) as i64),
            Arg::P(out.ptr),
            Arg::P(scratch.buf.ptr),
            Arg::P(scratch.buf.ptr + scratch.partials as u64),
            mask,
            need,
        ];
        let grid = (flash_blocks(heads.n_heads, rows) as u32, 1, 1);
        let f = self.gpu.kernels.flash_attention[variant];
        self.run("flash_attention", f, grid, THREADS, smem_bytes(hd), &args);
        true
    }
}

/// Two blocks (the parts of the rows' key tiles) per query tile and head, all in the grid's x
/// dimension (2³¹ − 1 blocks; y's 65 535 would cap a step near 2 M rows).
fn flash_blocks(n_heads: usize, rows: usize) -> usize {
    n_heads * 2 * rows.div_ceil(BLOCK_ROWS)
}
