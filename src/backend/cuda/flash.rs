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

    /// Attention of `rows` > 1 rows in the fp16 mode through the tensor-core kernel; false (and
    /// nothing launched) when the shape is not one it takes: an uninstantiated head dimension,
    /// cache rows not 16-byte aligned, a device with too little shared memory per block, or more
    /// blocks than a grid holds.
    pub(super) fn flash_attend(
        &self,
        qkv: &DevBuf,
        step: &CudaStep,
        rows: usize,
        kv: &KvCache<CudaKv>,
        entries: &F16Entries,
        out: &mut DevBuf,
    ) -> bool {
        let heads = kv.layout.heads;
        let hd = heads.head_dim;
        let Some(variant) = kernels::FLASH_HD.iter().position(|&d| d == hd) else {
            return false;
        };
        let Some(scratch) = step.flash.as_ref() else {
            return false;
        };
        let slot_offset = entries.slot * entries.slot_stride;
        let aligned = (entries.k | entries.v | (2 * slot_offset) as u64).is_multiple_of(16);
        let smem = smem_bytes(hd);
        let fits = smem <= self.gpu.smem_optin.saturating_sub(2048); // allow_dynamic_smem's limit
        if rows < 2 || kv.layout.mode != KvMode::Fp16 || !aligned || !fits {
            return false;
        }
        let args = [
            Arg::P(qkv.ptr),
            Arg::P(step.buf.ptr),
            Arg::usize(rows),
            Arg::usize(heads.n_heads),
            Arg::usize(heads.n_kv_heads),
            Arg::F(1.0 / (hd as f32).sqrt()),
            Arg::P(entries.k),
            Arg::P(entries.v),
            Arg::L(slot_offset as i64),
            Arg::P(out.ptr),
            Arg::P(scratch.buf.ptr),
            Arg::P(scratch.buf.ptr + scratch.partials as u64),
        ];
        // Two blocks (the parts of the rows' key tiles) per query tile and head, in the x
        // dimension (2³¹ − 1 blocks; y's 65 535 would cap a step near 2 M rows).
        let blocks = heads.n_heads * 2 * rows.div_ceil(BLOCK_ROWS);
        if blocks > i32::MAX as usize {
            return false;
        }
        let grid = (blocks as u32, 1, 1);
        let f = self.gpu.kernels.flash_attention[variant];
        self.run("flash_attention", f, grid, THREADS, smem, &args);
        true
    }
}
