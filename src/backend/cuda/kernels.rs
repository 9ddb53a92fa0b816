//! The kernels in `cuda/`: embedded in the library, compiled by NVRTC for the device's
//! architecture at first use, and cached on disk as a cubin. Cubins shipped with the library
//! for the device's architecture ([`shipped`]) are used before both.
//!
//! Cache key: a hash of every source, the NVRTC options (with any `TINYLOOP_CUDA_DEFINES`), the
//! architecture and the NVRTC version.
//! The cache folder is `TINYLOOP_KERNEL_CACHE` (set it to `off` to disable the cache), else
//! `$XDG_CACHE_HOME/tinyloop/kernels`, else `~/.cache/tinyloop/kernels`.
//!
//! NVRTC (`libnvrtc.so.13`) is found by the usual library search; when that fails, the folder
//! named by `TINYLOOP_NVRTC` (a folder or the library itself), `$CUDA_HOME/lib64`,
//! `/usr/local/cuda/lib64` and the `nvidia-cuda-nvrtc` Python wheel's folder are tried. Without
//! NVRTC a warm cache still works: the cubin is looked up under the key that the last compile for
//! this architecture wrote (`latest-<arch>` file).

use std::ffi::{c_char, CString};
use std::path::{Path, PathBuf};
use std::time::Instant;

use cudarc::driver::{result, sys, CudaContext};
use cudarc::nvrtc::sys as nvrtc;
use rayon::prelude::*;

use super::driver::device_error;
use crate::env::{rejected, Vars};
use crate::error::{Error, Result};
use crate::model::config::ModelConfig;

mod shipped;
pub use shipped::ship;

/// Kernel sources, in include order (each `.cu` includes `common.cuh`).
pub(crate) const SOURCES: [(&str, &str); 10] = [
    ("common.cuh", include_str!("../../../cuda/common.cuh")),
    ("kv.cuh", include_str!("../../../cuda/kv.cuh")),
    (
        "elementwise.cu",
        include_str!("../../../cuda/elementwise.cu"),
    ),
    ("gemv.cu", include_str!("../../../cuda/gemv.cu")),
    ("gemm.cu", include_str!("../../../cuda/gemm.cu")),
    ("attention.cu", include_str!("../../../cuda/attention.cu")),
    ("flash.cu", include_str!("../../../cuda/flash.cu")),
    ("sample.cu", include_str!("../../../cuda/sample.cu")),
    ("kv.cu", include_str!("../../../cuda/kv.cu")),
    ("requantize.cu", include_str!("../../../cuda/requantize.cu")),
];

/// The programs NVRTC compiles, in parallel: a source file and its extra options. The GEMV file
/// is split by bit width because it dominates the compile time.
const PROGRAMS: [(&str, &str); 10] = [
    ("elementwise.cu", ""),
    ("gemv.cu", "-DGEMV_BITS=16"),
    ("gemv.cu", "-DGEMV_BITS=4"),
    ("gemv.cu", "-DGEMV_BITS=2"),
    ("gemm.cu", ""),
    ("attention.cu", ""),
    ("sample.cu", ""),
    ("kv.cu", ""),
    ("flash.cu", ""),
    ("requantize.cu", ""),
];

// Indices into PROGRAMS of the modules that hold each kernel family.
const ELEMENTWISE: usize = 0;
/// The GEMV program of BITS[i] is GEMV + i (the generic fallback is with width 16).
const GEMV: usize = 1;
const GEMM: usize = 4;
const ATTENTION: usize = 5;
const SAMPLE: usize = 6;
const KV: usize = 7;
const FLASH: usize = 8;
const REQUANTIZE: usize = 9;

/// Marks a cache file holding the cubins of every program (length-prefixed, in PROGRAMS order).
const CACHE_MAGIC: &[u8; 8] = b"TLCUBIN2";

/// NVRTC options besides the architecture. `-lineinfo` costs nothing at run time and lets
/// compute-sanitizer name source lines.
const OPTIONS: [&str; 3] = ["--std=c++17", "-lineinfo", "-DTL_NVRTC=1"];

/// Bits variants of the linear kernels, in index order.
pub(crate) const BITS: [u32; 3] = [16, 4, 2];
/// Row counts the GEMV kernels are instantiated for, in index order.
pub(crate) const GEMV_ROWS: [usize; 3] = [1, 2, 4];
/// The 8-value chunks per thread of the normalizing GEMV variants (cuda/gemv.cu `NormRow`): rows
/// of up to `8 · 256 · chunks` values.
pub(crate) const GEMV_NORM_CHUNKS: [usize; 2] = [1, 3];
/// The rows of one MMA tile, and the tiles of rows per block that `gemm_small` is instantiated
/// for, in index order (cuda/gemm.cu).
pub(crate) const MMA_ROWS: usize = 16;
pub(crate) const SMALL_GEMM_TILES: [usize; 3] = [1, 2, 4];
/// `gemm_small`'s threads per block, its groups of 16 weight rows per block (the most first), and
/// its outputs per thread (row tiles times column groups).
pub(crate) const SMALL_GEMM_THREADS: u32 = 256;
pub(crate) const SMALL_GEMM_COL_GROUPS: [usize; 4] = [8, 4, 2, 1];
pub(crate) const SMALL_GEMM_OUTS: usize = 8;

/// Bytes of one stage of the staged GEMM kernels (cuda/gemm.cu `small_stage_bytes`): `rows` X
/// rows of 80 bytes (32 halves and padding), the codes of `cols` weight rows (f16 rows padded
/// like X), then a scale word and a zero word per weight row.
fn gemm_stage_bytes(bits: u32, rows: usize, cols: usize) -> usize {
    const X_ROW: usize = 80;
    let w_row = if bits == 16 { X_ROW } else { bits as usize * 4 };
    let params = if bits == 16 { 0 } else { cols * 8 };
    rows * X_ROW + cols * w_row + params
}

/// Stages in the rings of the staged GEMM kernels (cuda/gemm.cu `SMALL_STAGES`).
const GEMM_STAGES: usize = 4;

/// Dynamic shared memory of `gemm_small`: each K group's ring of stages, then one wave's
/// partial sums.
pub(crate) fn small_gemm_smem(bits: u32, tiles: usize, col_groups: usize) -> usize {
    let (rows, cols) = (MMA_ROWS * tiles, 16 * col_groups);
    let k_groups = 8 / col_groups;
    k_groups * GEMM_STAGES * gemm_stage_bytes(bits, rows, cols) + k_groups * rows * cols * 4
}

/// `gemm_tiled`'s rows of X per block, in index order (64 rows a warp along them, four warps
/// along its 128 weight rows).
pub(crate) const TILED_GEMM_ROWS: [usize; 2] = [64, 128];
pub(crate) const TILED_GEMM_COLS: usize = 128;

/// Dynamic shared memory of `gemm_tiled` for blocks of `rows` rows: its ring of stages, then each
/// thread's 64 sums of the segments before the current one.
pub(crate) fn tiled_gemm_smem(bits: u32, rows: usize) -> usize {
    GEMM_STAGES * gemm_stage_bytes(bits, rows, TILED_GEMM_COLS) + tiled_gemm_threads(rows) * 64 * 4
}

fn tiled_gemm_threads(rows: usize) -> usize {
    32 * (rows / 64) * 4
}

/// The blocks of rows of X for a block-tile kernel whose blocks take `cols` weight rows and one
/// of `block_rows` (ascending) rows of X: the index of the largest that fits (`fits`) and gives
/// every one of `sms` SMs a block, else of the smallest that fits, and then of the smallest that
/// gives as many blocks (it wastes less of its tile past the last row); `None` where even the
/// smallest leaves more than half of the SMs idle or nothing fits.
fn row_blocks(
    rows: usize,
    n: usize,
    cols: usize,
    block_rows: &[usize],
    sms: usize,
    fits: impl Fn(usize) -> bool,
) -> Option<usize> {
    let blocks = |r: usize| n.div_ceil(cols) * rows.div_ceil(r);
    let mut i = (0..block_rows.len())
        .rev()
        .filter(|&i| fits(block_rows[i]))
        .find(|&i| blocks(block_rows[i]) >= sms || i == 0)?;
    while i > 0 && fits(block_rows[i - 1]) && blocks(block_rows[i - 1]) == blocks(block_rows[i]) {
        i -= 1;
    }
    (2 * blocks(block_rows[i]) >= sms).then_some(i)
}

/// How `gemm_tiled` covers a product of many rows: blocks of 128 rows of X where they give
/// every SM a block, else of 64.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TiledGemmPlan {
    /// Index into [`TILED_GEMM_ROWS`].
    pub rows_index: usize,
    pub threads: u32,
    pub smem: usize,
    grid: (u32, u32, u32),
}

impl TiledGemmPlan {
    /// The plan, or `None` for products of at most one MMA tile of rows, or whose blocks of 64
    /// rows would leave more than half of the `sms` SMs idle (the K-group kernel takes those),
    /// or when no block fits in `smem_limit`.
    pub fn new(bits: u32, rows: usize, n: usize, sms: usize, smem_limit: usize) -> Option<Self> {
        if rows <= MMA_ROWS {
            return None;
        }
        let fits = |r| tiled_gemm_smem(bits, r) <= smem_limit;
        let i = row_blocks(rows, n, TILED_GEMM_COLS, &TILED_GEMM_ROWS, sms, fits)?;
        let r = TILED_GEMM_ROWS[i];
        Some(TiledGemmPlan {
            rows_index: i,
            threads: tiled_gemm_threads(r) as u32,
            smem: tiled_gemm_smem(bits, r),
            grid: (
                n.div_ceil(TILED_GEMM_COLS) as u32,
                rows.div_ceil(r) as u32,
                1,
            ),
        })
    }

    pub fn grid(&self) -> (u32, u32, u32) {
        self.grid
    }
}

/// `gemm_wgmma`'s weight widths (16: f16 weights) and rows of X per block, in index order, its
/// weight rows per block (two warpgroups of 64) and its threads (cuda/gemm.cu `WG_COLS`,
/// `WG_THREADS`).
pub(crate) const WGMMA_GEMM_BITS: [u32; 3] = [4, 2, 16];
pub(crate) const WGMMA_GEMM_ROWS: [usize; 2] = [64, 128];
const WGMMA_GEMM_COLS: usize = 128;
pub(crate) const WGMMA_GEMM_THREADS: u32 = 256;
/// Stages in `gemm_wgmma`'s ring (cuda/gemm.cu `WG_STAGES`).
const WGMMA_GEMM_STAGES: usize = 5;

/// Bytes of one stage of `gemm_wgmma` (cuda/gemm.cu `wg_stage_bytes`): X in rows of 128 bytes,
/// the codes (INT4 rows padded to 48 bytes), the scale and zero words of both 32-wide halves, and
/// S of both halves, a multiple of 1024 bytes; for f16 weights X and the weight rows of 128 bytes.
fn wgmma_stage_bytes(bits: u32, rows: usize) -> usize {
    if bits == 16 {
        return (rows + WGMMA_GEMM_COLS) * 128;
    }
    let code_row = if bits == 4 { 48 } else { 16 };
    let bytes = rows * 128 + WGMMA_GEMM_COLS * code_row + 4 * WGMMA_GEMM_COLS * 4 + 2 * rows * 4;
    bytes.next_multiple_of(1024)
}

/// Dynamic shared memory of `gemm_wgmma` for blocks of `rows` rows of X: 1024 bytes of alignment
/// slack, the ring, then each thread's `rows / 2` sums of the segments before the current one.
pub(crate) fn wgmma_gemm_smem(bits: u32, rows: usize) -> usize {
    1024 + WGMMA_GEMM_STAGES * wgmma_stage_bytes(bits, rows)
        + WGMMA_GEMM_THREADS as usize * rows / 2 * 4
}

/// How `gemm_wgmma` covers a product of many rows on a GPU with wgmma (sm_90a): blocks of 128
/// rows of X where they give every SM a block and blocks of 64 would not give more, else of 64;
/// for quantized weights
/// `gemm_unit_sums` first writes the S of every unit, `sums_ld` floats per 32-wide K tile, to the
/// backend's scratch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WgmmaGemmPlan {
    /// Index into [`WGMMA_GEMM_BITS`].
    pub bits_index: usize,
    /// Index into [`WGMMA_GEMM_ROWS`].
    pub rows_index: usize,
    pub smem: usize,
    pub sums_ld: usize,
    grid: (u32, u32, u32),
    sums_grid: (u32, u32, u32),
}

impl WgmmaGemmPlan {
    /// The plan, or `None` for K not a multiple of 64, products whose blocks of 64 rows would
    /// leave more than half of the `sms` SMs idle, blocks that do not fit in `smem_limit`, or
    /// (quantized weights) S that does not fit in `sums_capacity` floats.
    pub fn new(
        shape: ProductShape,
        sms: usize,
        smem_limit: usize,
        sums_capacity: usize,
    ) -> Option<Self> {
        let ProductShape {
            bits, rows, n, k, ..
        } = shape;
        let bits_index = WGMMA_GEMM_BITS.iter().position(|&b| b == bits)?;
        let sums_ld = rows.next_multiple_of(4);
        let sums_fit = bits == 16 || sums_ld * (k / 32) <= sums_capacity;
        if k % 64 != 0 || !sums_fit {
            return None;
        }
        let fits = |r| wgmma_gemm_smem(bits, r) <= smem_limit;
        let i = row_blocks(rows, n, WGMMA_GEMM_COLS, &WGMMA_GEMM_ROWS, sms, fits)?;
        let r = WGMMA_GEMM_ROWS[i];
        Some(WgmmaGemmPlan {
            bits_index,
            rows_index: i,
            smem: wgmma_gemm_smem(bits, r),
            sums_ld,
            grid: (
                n.div_ceil(WGMMA_GEMM_COLS) as u32,
                rows.div_ceil(r) as u32,
                1,
            ),
            sums_grid: (
                k.div_ceil(GEMM_SEGMENT) as u32,
                rows.div_ceil(8 * MMA_ROWS) as u32,
                1,
            ),
        })
    }

    pub fn grid(&self) -> (u32, u32, u32) {
        self.grid
    }

    /// Whether the product reads the S of its units (quantized weights).
    pub fn needs_sums(&self) -> bool {
        WGMMA_GEMM_BITS[self.bits_index] != 16
    }

    /// `gemm_unit_sums`' grid (a warp per 16 rows and segment, 8 warps a block).
    pub fn sums_grid(&self) -> (u32, u32, u32) {
        self.sums_grid
    }
}

/// How `gemm_small` covers a product of `rows` rows and `n` outputs per row: its row tiles per
/// block, and its groups of 16 weight rows per block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SmallGemmPlan {
    /// Index into [`SMALL_GEMM_TILES`].
    pub tiles_index: usize,
    pub col_groups: usize,
    pub smem: usize,
    grid: (u32, u32, u32),
}

impl SmallGemmPlan {
    /// The fewest row tiles per block that cover `rows` (at most 4), then the widest column
    /// grouping that still gives every one of `sms` SMs a block (X is read once per K group and
    /// block), or the narrowest whose stages fit in `smem_limit`; fewer row tiles where none of
    /// them fits.
    pub fn new(bits: u32, rows: usize, n: usize, sms: usize, smem_limit: usize) -> Self {
        let wanted = rows.div_ceil(MMA_ROWS);
        let first = SMALL_GEMM_TILES
            .iter()
            .position(|&t| t >= wanted)
            .unwrap_or(SMALL_GEMM_TILES.len() - 1);
        (0..=first)
            .rev()
            .find_map(|ti| Self::with_tiles(bits, ti, rows, n, sms, smem_limit))
            .unwrap_or_else(|| Self::build(bits, 0, 1, rows, n))
    }

    fn with_tiles(
        bits: u32,
        ti: usize,
        rows: usize,
        n: usize,
        sms: usize,
        smem_limit: usize,
    ) -> Option<Self> {
        let tiles = SMALL_GEMM_TILES[ti];
        let row_blocks = rows.div_ceil(tiles * MMA_ROWS);
        let mut fitting = SMALL_GEMM_COL_GROUPS.into_iter().filter(|&c| {
            c * tiles <= SMALL_GEMM_OUTS && small_gemm_smem(bits, tiles, c) <= smem_limit
        });
        let col_groups = fitting
            .clone()
            .find(|&c| n.div_ceil(16 * c) * row_blocks >= sms)
            .or_else(|| fitting.next_back())?;
        Some(Self::build(bits, ti, col_groups, rows, n))
    }

    fn build(bits: u32, ti: usize, col_groups: usize, rows: usize, n: usize) -> Self {
        let tiles = SMALL_GEMM_TILES[ti];
        SmallGemmPlan {
            tiles_index: ti,
            col_groups,
            smem: small_gemm_smem(bits, tiles, col_groups),
            grid: (
                n.div_ceil(16 * col_groups) as u32,
                rows.div_ceil(tiles * MMA_ROWS) as u32,
                1,
            ),
        }
    }

    pub fn grid(&self) -> (u32, u32, u32) {
        self.grid
    }
}

/// The K of one segment of the GEMM kernels (cuda/gemm.cu `GEMM_SEGMENT`).
pub(crate) const GEMM_SEGMENT: usize = 256;

/// Dynamic shared memory of `gemm_split` (cuda/gemm.cu `split_w_row`): X's rows over a segment
/// (plus 16 bytes), the weight rows' codes (padded), and a scale word and a zero word per weight
/// row for each quantization group a segment can meet.
pub(crate) fn split_gemm_smem(bits: u32, tiles: usize, warps: usize, group: usize) -> usize {
    let x_row = 2 * GEMM_SEGMENT + 16;
    let w_row = match bits {
        16 => x_row,
        2 => GEMM_SEGMENT * 2 / 8 + 8,
        b => GEMM_SEGMENT * b as usize / 8 + 16,
    };
    let cols = 16 * warps;
    // A segment of 256 starting at a multiple of 32 meets at most this many groups.
    let groups = if bits == 16 {
        0
    } else {
        (GEMM_SEGMENT / 32).min((GEMM_SEGMENT - 1).div_ceil(group) + 1)
    };
    MMA_ROWS * tiles * x_row + cols * w_row + 2 * groups * cols * 4
}

/// The per-segment sums one row of the block products of a model with `config` needs at most
/// (N times the segments of K, over QKV, the output, gate and up side by side, down and the loop
/// adapter; the head is left to the unsplit kernels).
pub(crate) fn split_parts_per_row(config: &ModelConfig) -> usize {
    let (d, f) = (config.dim, config.ffn_dim);
    let qkv = (config.n_heads + 2 * config.n_kv_heads) * config.head_dim();
    let segments = |k: usize| k.div_ceil(GEMM_SEGMENT);
    [
        qkv * segments(d),
        d * segments(d),
        2 * f * segments(d),
        d * segments(f),
        d * segments(2 * d),
    ]
    .into_iter()
    .max()
    .unwrap_or(0)
}

/// A product's shape as the GEMM plans see it: `rows` rows of X times `n` weight rows of `bits`
/// bits over K = `k`, quantized in groups of `group` (K for f16 weights).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ProductShape {
    pub bits: u32,
    pub rows: usize,
    pub n: usize,
    pub k: usize,
    pub group: usize,
}

/// How `gemm_split` covers a product of `rows` rows by `n` weight rows over K = `k`: row tiles
/// and warps per block (16 weight rows each), one block per (column block, segment, row block);
/// `gemm_segments_sum` then adds `segments` partial sums of `rows * n` floats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SplitGemmPlan {
    /// Index into [`SMALL_GEMM_TILES`].
    pub tiles_index: usize,
    pub warps: usize,
    pub segments: usize,
    pub smem: usize,
    grid: (u32, u32, u32),
}

impl SplitGemmPlan {
    /// The plan for these shapes, or `None` when the partial sums need more than `parts_floats`
    /// floats (or no block fits in `smem_limit`). The fewest row tiles that cover the rows, in
    /// blocks of 8 warps where that gives every SM two blocks, else of 4; where neither does,
    /// fewer row tiles a block (more blocks, each reading the weights again from L2), down to
    /// one tile of 4 warps.
    pub fn new(
        shape: ProductShape,
        sms: usize,
        smem_limit: usize,
        parts_floats: usize,
    ) -> Option<Self> {
        let ProductShape {
            bits,
            rows,
            n,
            k,
            group,
        } = shape;
        let segments = k.div_ceil(GEMM_SEGMENT);
        if rows == 0 || n == 0 || segments * rows * n > parts_floats {
            return None;
        }
        let wanted = rows.div_ceil(MMA_ROWS);
        let first = SMALL_GEMM_TILES
            .iter()
            .position(|&t| t >= wanted)
            .unwrap_or(SMALL_GEMM_TILES.len() - 1);
        let mut fitting = (0..=first)
            .rev()
            .flat_map(|ti| [(ti, 8), (ti, 4)])
            .filter(|&(ti, w)| split_gemm_smem(bits, SMALL_GEMM_TILES[ti], w, group) <= smem_limit);
        let blocks = |(ti, warps): (usize, usize)| {
            n.div_ceil(16 * warps) * segments * rows.div_ceil(SMALL_GEMM_TILES[ti] * MMA_ROWS)
        };
        let (ti, warps) = fitting
            .clone()
            .find(|&plan| blocks(plan) >= 2 * sms)
            .or_else(|| fitting.next_back())?;
        let tiles = SMALL_GEMM_TILES[ti];
        Some(SplitGemmPlan {
            tiles_index: ti,
            warps,
            segments,
            smem: split_gemm_smem(bits, tiles, warps, group),
            grid: (
                n.div_ceil(16 * warps) as u32,
                segments as u32,
                rows.div_ceil(tiles * MMA_ROWS) as u32,
            ),
        })
    }

    pub fn grid(&self) -> (u32, u32, u32) {
        self.grid
    }
}

/// Head-dimension-per-lane variants of the attention kernel (hd <= 32 * DJ).
pub(crate) const ATT_DJ: [usize; 4] = [1, 2, 4, 8];
/// Head dimensions the tensor-core prefill attention is instantiated for, in index order.
pub(crate) const FLASH_HD: [usize; 4] = [16, 32, 64, 128];

/// Every kernel function of the loaded modules.
pub(crate) struct Kernels {
    modules: Vec<sys::CUmodule>,
    pub embed_f32: sys::CUfunction,
    pub embed_f16: sys::CUfunction,
    pub norm_rows: sys::CUfunction,
    pub norm_state_rows: sys::CUfunction,
    pub add_bias: sys::CUfunction,
    pub scale_f32: sys::CUfunction,
    pub rope_kv: sys::CUfunction,
    pub to_half: sys::CUfunction,
    pub swiglu: sys::CUfunction,
    pub swiglu_half: sys::CUfunction,
    pub argmax_f32: sys::CUfunction,
    pub entropy_f32: sys::CUfunction,
    pub sample_token: sys::CUfunction,
    /// `[bits index][rows index]`
    pub gemv: [[sys::CUfunction; 3]; 3],
    pub gemv_gateup: [[sys::CUfunction; 3]; 3],
    /// `[bits index][chunks index]`: one row, normalized on the fly, held in registers as
    /// [`GEMV_NORM_CHUNKS`] 8-value chunks per thread.
    pub gemv_norm: [[sys::CUfunction; 2]; 3],
    pub gemv_gateup_norm: [[sys::CUfunction; 2]; 3],
    /// `[bits index][TILED_GEMM_ROWS index]`: products of many rows.
    pub gemm_tiled: [[sys::CUfunction; 2]; 3],
    /// `[bits index][tiles index]`: products of few rows, [`SMALL_GEMM_TILES`] MMA tiles of
    /// rows per block.
    pub gemm_small: [[sys::CUfunction; 3]; 3],
    /// `[bits index][tiles index]`: products of few rows split by segment across blocks, and
    /// the kernel that adds their segments.
    pub gemm_split: [[sys::CUfunction; 3]; 3],
    pub gemm_segments_sum: sys::CUfunction,
    pub swiglu_segments: sys::CUfunction,
    /// `[WGMMA_GEMM_BITS index][WGMMA_GEMM_ROWS index]`: products of many rows on sm_90a (empty
    /// kernels elsewhere), and the S of their units.
    pub gemm_wgmma: [[sys::CUfunction; 2]; 3],
    pub gemm_unit_sums: sys::CUfunction,
    pub linear_generic: sys::CUfunction,
    /// `[a head per warp][dj index]`: over f16 entries, and over quantized entries; index 1 is
    /// the `heads` kernels (cuda/attention.cu), for launches of many blocks.
    pub attention: [[sys::CUfunction; 4]; 2],
    pub attention_q: [[sys::CUfunction; 4]; 2],
    /// `[FLASH_HD index]`: multi-row attention over f16 entries on the tensor cores.
    pub flash_attention: [sys::CUfunction; 4],
    pub kv_store: sys::CUfunction,
    pub kv_move: sys::CUfunction,
    pub h_dequant: sys::CUfunction,
    pub h_finish: sys::CUfunction,
    pub requantize_group: sys::CUfunction,
}

// SAFETY: CUmodules and CUfunctions are handles into a context that lives for the whole process
// (gpu::Gpu keeps it); the driver allows launching a function from any thread.
unsafe impl Send for Kernels {}
// SAFETY: as above; the handles are never mutated after loading.
unsafe impl Sync for Kernels {}

impl Kernels {
    /// Let the GEMV, norm, small-M GEMM and flash attention kernels use up to the device's
    /// opt-in shared memory per block.
    pub fn allow_dynamic_smem(&self, optin: usize) -> Result<()> {
        let limit = optin.saturating_sub(2048) as i32;
        let all = self.gemv.iter().chain(&self.gemv_gateup).flatten();
        let norm = self
            .gemv_norm
            .iter()
            .chain(&self.gemv_gateup_norm)
            .flatten();
        let norms = [&self.norm_rows, &self.norm_state_rows];
        let products = self.gemm_small.iter().chain(&self.gemm_split).flatten();
        let products = products
            .chain(self.gemm_tiled.iter().flatten())
            .chain(self.gemm_wgmma.iter().flatten());
        let staged = self.flash_attention.iter().chain(products);
        let others = norms.into_iter().chain(staged.clone());
        for f in all.chain(norm).chain(others) {
            set_attribute(
                *f,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                limit,
            )?;
        }
        // Flash attention and the small-M GEMM run several blocks of staged tiles per SM: all
        // of the unified L1 / shared memory as shared memory (a preference, in percent).
        for f in staged {
            set_attribute(
                *f,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                100,
            )?;
        }
        Ok(())
    }
}

fn set_attribute(
    f: sys::CUfunction,
    attribute: sys::CUfunction_attribute,
    value: i32,
) -> Result<()> {
    // SAFETY: `f` is a valid function of a loaded module.
    unsafe { sys::cuFuncSetAttribute(f, attribute, value) }
        .result()
        .map_err(|e| device_error("cuFuncSetAttribute", e))
}

/// The NVRTC target for compute capability `arch`: 9.0 takes the architecture-specific sm_90a,
/// whose wgmma the many-row GEMM needs (its cubins load on 9.0 devices only, which is all it is
/// chosen for); others their plain target.
pub(crate) fn arch_name(arch: (i32, i32)) -> String {
    let specific = if arch == WGMMA_ARCH { "a" } else { "" };
    format!("sm_{}{}{specific}", arch.0, arch.1)
}

/// The compute capability whose kernels have wgmma ([`arch_name`]).
pub(crate) const WGMMA_ARCH: (i32, i32) = (9, 0);

/// Load the kernels for `arch`: from the disk cache when possible, otherwise compiled by NVRTC
/// (and then cached). Returns the kernels and a note saying which happened and how long it took.
pub(crate) fn load(
    ctx: &CudaContext,
    arch: (i32, i32),
    options: &KernelOptions,
) -> Result<(Kernels, String)> {
    let start = Instant::now();
    let arch_name = arch_name(arch);
    let defines = &options.defines;
    // Says why shipped cubins were passed over, ahead of the note of what was done instead.
    let mut skipped = String::new();
    if let Some((cubins, path)) = shipped::find(&arch_name, defines) {
        match load_modules(ctx, &cubins) {
            Ok(kernels) => {
                let ms = start.elapsed().as_secs_f64() * 1e3;
                let note = format!("shipped cubin {} ({ms:.1} ms)", path.display());
                return Ok((kernels, note));
            }
            Err(e) => skipped = format!("shipped cubin {} not loaded ({e}); ", path.display()),
        }
    }
    let dir = &options.cache;
    let nvrtc_version = load_nvrtc().ok().map(|_| nvrtc_version()).transpose()?;
    let latest = dir.as_ref().map(|d| d.join(format!("latest-{arch_name}")));
    // The key under which to look: this NVRTC's, or (no NVRTC here) the one last written.
    let key = match nvrtc_version {
        Some(v) => Some(cache_key(&arch_name, v, defines)),
        None => latest
            .as_ref()
            .and_then(|p| std::fs::read_to_string(p).ok())
            .map(|s| s.trim().to_string()),
    };
    let cached = match (dir, &key) {
        (Some(dir), Some(key)) => std::fs::read(cache_file(dir, key))
            .ok()
            .and_then(|bytes| unpack(&bytes)),
        _ => None,
    };
    if let Some(cubins) = cached {
        if let Ok(kernels) = load_modules(ctx, &cubins) {
            let ms = start.elapsed().as_secs_f64() * 1e3;
            return Ok((kernels, format!("{skipped}disk cache hit ({ms:.1} ms)")));
        }
    }
    let Some(version) = nvrtc_version else {
        return Err(Error::Device(format!(
            "{skipped}the kernels are neither shipped nor cached for {arch_name} and NVRTC \
             (libnvrtc.so.13) was not found: {}",
            load_nvrtc()
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default()
        )));
    };
    let cubins = compile(&arch_name, defines)?;
    let compiled_ms = start.elapsed().as_secs_f64() * 1e3;
    let kernels = load_modules(ctx, &cubins)?;
    let mut note = format!(
        "{skipped}compiled by NVRTC {}.{} for {arch_name} in {compiled_ms:.0} ms",
        version.0, version.1
    );
    if let (Some(dir), Some(key)) = (dir, &key) {
        match store(dir, key, &pack(&cubins), latest.as_deref()) {
            Ok(path) => note.push_str(&format!(", cached in {}", path.display())),
            Err(e) => note.push_str(&format!(", not cached ({e})")),
        }
    }
    Ok((kernels, note))
}

/// What the kernel variables ask for, read when a model opens on CUDA.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct KernelOptions {
    /// The cache folder ([`CACHE`]), or None when caching is off.
    pub cache: Option<PathBuf>,
    /// Extra `-D` options ([`DEFINES`]); they are part of the cache key.
    pub defines: Vec<String>,
}

/// The cache folder: a path, or `off` (also `0`) to disable the cache.
pub(crate) const CACHE: &str = "TINYLOOP_KERNEL_CACHE";
/// Extra NVRTC defines for tuning experiments: space-separated `NAME` or `NAME=VALUE`, each
/// optionally written `-DNAME...`, e.g. `GEMV_MIN_BLOCKS=4`.
pub(crate) const DEFINES: &str = "TINYLOOP_CUDA_DEFINES";

impl KernelOptions {
    pub fn from_vars(vars: Vars) -> Result<KernelOptions> {
        let cache = match vars.path(CACHE) {
            Some(off) if off.as_os_str() == "off" || off.as_os_str() == "0" => None,
            Some(dir) => Some(dir),
            None => default_cache_dir(vars),
        };
        let text = vars.text(DEFINES)?.unwrap_or_default();
        let defines = text.split_whitespace().map(define).collect::<Option<_>>();
        let defines = defines.ok_or_else(|| {
            rejected(
                DEFINES,
                &text,
                "space-separated NAME or NAME=VALUE (NAME a C identifier, optionally written \
                 -DNAME)",
            )
        })?;
        Ok(KernelOptions { cache, defines })
    }
}

/// `NAME` or `NAME=VALUE`, optionally written `-D...`, as an NVRTC option; None when NAME is not
/// a C identifier.
fn define(item: &str) -> Option<String> {
    let item = item.strip_prefix("-D").unwrap_or(item);
    let name = item.split_once('=').map_or(item, |(name, _)| name);
    let identifier = name
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    identifier.then(|| format!("-D{item}"))
}

/// `$XDG_CACHE_HOME/tinyloop/kernels`, else `$HOME/.cache/tinyloop/kernels`.
fn default_cache_dir(vars: Vars) -> Option<PathBuf> {
    let base = vars
        .path("XDG_CACHE_HOME")
        .or_else(|| vars.path("HOME").map(|home| home.join(".cache")))?;
    Some(base.join("tinyloop").join("kernels"))
}

/// FNV-1a, 64 bits: stable across Rust versions, unlike `DefaultHasher`.
fn fnv1a(data: &[&[u8]]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for part in data {
        for &b in *part {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Hash of everything that makes the cubins besides the architecture and the compiler: the
/// sources, the programs and their options, and the extra `defines`.
fn source_hash(defines: &[String]) -> u64 {
    let mut parts: Vec<&[u8]> = Vec::new();
    for (name, src) in &SOURCES {
        parts.push(name.as_bytes());
        parts.push(src.as_bytes());
    }
    for (name, options) in &PROGRAMS {
        parts.push(name.as_bytes());
        parts.push(options.as_bytes());
    }
    for o in &OPTIONS {
        parts.push(o.as_bytes());
    }
    for o in defines {
        parts.push(o.as_bytes());
    }
    fnv1a(&parts)
}

fn cache_key(arch: &str, version: (i32, i32), defines: &[String]) -> String {
    format!(
        "{arch}-nvrtc{}{}-{:016x}",
        version.0,
        version.1,
        source_hash(defines)
    )
}

/// The cache file's bytes: CACHE_MAGIC, then each cubin as a little-endian u64 length and bytes.
fn pack(cubins: &[Vec<u8>]) -> Vec<u8> {
    let mut out = CACHE_MAGIC.to_vec();
    for cubin in cubins {
        out.extend_from_slice(&(cubin.len() as u64).to_le_bytes());
        out.extend_from_slice(cubin);
    }
    out
}

/// The cubins of a cache file, or None when it is not a complete one of this format.
fn unpack(mut bytes: &[u8]) -> Option<Vec<Vec<u8>>> {
    bytes = bytes.strip_prefix(CACHE_MAGIC)?;
    let mut cubins = Vec::with_capacity(PROGRAMS.len());
    while !bytes.is_empty() {
        let (len, rest) = bytes.split_first_chunk::<8>()?;
        let len = usize::try_from(u64::from_le_bytes(*len)).ok()?;
        if len > rest.len() {
            return None;
        }
        cubins.push(rest[..len].to_vec());
        bytes = &rest[len..];
    }
    (cubins.len() == PROGRAMS.len()).then_some(cubins)
}

/// The cache file of `key` in the cache folder `dir`.
fn cache_file(dir: &Path, key: &str) -> PathBuf {
    dir.join(format!("tinyloop-{key}.cubin"))
}

/// Write the cache file under its key (atomically: temporary file, then rename).
fn store(dir: &Path, key: &str, cubin: &[u8], latest: Option<&Path>) -> std::io::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let path = cache_file(dir, key);
    let tmp = dir.join(format!(".tinyloop-{key}.{}.tmp", std::process::id()));
    std::fs::write(&tmp, cubin)?;
    std::fs::rename(&tmp, &path)?;
    if let Some(latest) = latest {
        let tmp = dir.join(format!(".latest.{}.tmp", std::process::id()));
        std::fs::write(&tmp, key)?;
        std::fs::rename(&tmp, latest)?;
    }
    Ok(path)
}

/// Make sure the NVRTC library can be loaded, searching beyond the default library path.
fn load_nvrtc() -> Result<()> {
    // SAFETY: only tries to dlopen the library by its usual names.
    if unsafe { nvrtc::is_culib_present() } {
        return Ok(());
    }
    let dirs = library_dirs("TINYLOOP_NVRTC");
    for dir in &dirs {
        let lib = dir.join("libnvrtc.so.13");
        if !lib.is_file() {
            continue;
        }
        // NVRTC opens its builtins library by name when it compiles; load it first by path.
        if let Ok(entries) = std::fs::read_dir(dir) {
            for entry in entries.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                if name.starts_with("libnvrtc-builtins.so.13") && !name.contains(".alt.") {
                    dlopen_global(&entry.path());
                    break;
                }
            }
        }
        dlopen_global(&lib);
        // SAFETY: as above.
        if unsafe { nvrtc::is_culib_present() } {
            return Ok(());
        }
    }
    Err(Error::Device(
        "NVRTC (libnvrtc.so.13) was not found; set TINYLOOP_NVRTC to its folder".into(),
    ))
}

/// Folders that may hold the CUDA libraries (NVRTC, cuBLAS) when the usual library search does not
/// find them: the one named by `var` (a folder or a library in it), the toolkit's, and the CUDA
/// 13 Python wheels'.
pub(super) fn library_dirs(var: &str) -> Vec<PathBuf> {
    let vars = Vars::process();
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Some(p) = vars.path(var) {
        if p.is_file() {
            dirs.extend(p.parent().map(Path::to_path_buf));
        } else {
            dirs.push(p);
        }
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(p) = vars.path(var) {
            dirs.push(p.join("lib64"));
        }
    }
    dirs.push("/usr/local/cuda/lib64".into());
    dirs.push("/usr/local/cuda/targets/x86_64-linux/lib".into());
    dirs.push("/usr/local/cuda/targets/sbsa-linux/lib".into());
    for pattern in [
        "/usr/lib/python3*/site-packages/nvidia/cu13/lib",
        "/usr/local/lib/python3*/dist-packages/nvidia/cu13/lib",
        "/usr/local/lib/python3*/site-packages/nvidia/cu13/lib",
        "/opt/*/.venv/lib/python3*/site-packages/nvidia/cu13/lib",
    ] {
        dirs.extend(expand(pattern));
    }
    dirs
}

/// Load a shared library for the rest of the process, so that later loads by its soname find it.
pub(super) fn dlopen_global(path: &Path) {
    let Ok(c) = CString::new(path.as_os_str().as_encoded_bytes()) else {
        return;
    };
    // SAFETY: dlopen with a valid NUL-terminated path; the handle is deliberately kept open.
    unsafe {
        libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL);
    }
}

/// Expand `*` in the components of an absolute path pattern (no other glob syntax).
fn expand(pattern: &str) -> Vec<PathBuf> {
    let mut current = vec![PathBuf::from("/")];
    for part in pattern.split('/').filter(|p| !p.is_empty()) {
        let mut next = Vec::new();
        for base in &current {
            if let Some(star) = part.find('*') {
                let (prefix, suffix) = (&part[..star], &part[star + 1..]);
                if let Ok(entries) = std::fs::read_dir(base) {
                    for e in entries.flatten() {
                        let name = e.file_name().to_string_lossy().into_owned();
                        if name.starts_with(prefix) && name.ends_with(suffix) {
                            next.push(base.join(name));
                        }
                    }
                }
            } else {
                let p = base.join(part);
                if p.exists() {
                    next.push(p);
                }
            }
        }
        current = next;
    }
    current
}

fn nvrtc_version() -> Result<(i32, i32)> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: NVRTC is loaded (load_nvrtc succeeded); the out-pointers are valid.
    unsafe { nvrtc::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| Error::Device(format!("nvrtcVersion: {e}")))?;
    Ok((major, minor))
}

/// Compile every program for `arch` with the extra `defines`, in parallel; cubins in PROGRAMS
/// order.
pub(crate) fn compile(arch: &str, defines: &[String]) -> Result<Vec<Vec<u8>>> {
    load_nvrtc()?;
    PROGRAMS
        .par_iter()
        .map(|(file, options)| compile_program(arch, file, options, defines))
        .collect()
}

/// Compile one source file (with `common.cuh` available as a header) for `arch`.
fn compile_program(
    arch: &str,
    file: &str,
    program_options: &str,
    defines: &[String],
) -> Result<Vec<u8>> {
    let fail = |what: &str, e: cudarc::nvrtc::result::NvrtcError| {
        Error::Device(format!("NVRTC {what}: {e}"))
    };
    let main = CString::new(format!("#include \"{file}\"\n")).expect("no NUL in a file name");
    let names: Vec<CString> = SOURCES
        .iter()
        .map(|(n, _)| CString::new(*n).unwrap())
        .collect();
    let bodies: Vec<CString> = SOURCES
        .iter()
        .map(|(_, s)| CString::new(*s).expect("kernel sources contain no NUL"))
        .collect();
    let name_ptrs: Vec<*const c_char> = names.iter().map(|c| c.as_ptr()).collect();
    let body_ptrs: Vec<*const c_char> = bodies.iter().map(|c| c.as_ptr()).collect();
    let mut options: Vec<CString> =
        vec![CString::new(format!("--gpu-architecture={arch}")).unwrap()];
    options.extend(OPTIONS.iter().map(|o| CString::new(*o).unwrap()));
    options.extend(
        program_options
            .split_whitespace()
            .map(|o| CString::new(o).unwrap()),
    );
    for define in defines {
        options.push(
            CString::new(define.as_str())
                .map_err(|_| Error::invalid("NUL in TINYLOOP_CUDA_DEFINES"))?,
        );
    }
    let option_ptrs: Vec<*const c_char> = options.iter().map(|c| c.as_ptr()).collect();
    let program_name = CString::new("tinyloop.cu").unwrap();

    let mut prog: nvrtc::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: every pointer is a NUL-terminated string kept alive until the program is
    // destroyed below; the header arrays have SOURCES.len() entries each.
    unsafe {
        nvrtc::nvrtcCreateProgram(
            &mut prog,
            main.as_ptr(),
            program_name.as_ptr(),
            body_ptrs.len() as i32,
            body_ptrs.as_ptr(),
            name_ptrs.as_ptr(),
        )
        .result()
        .map_err(|e| fail("create program", e))?;
    }
    // SAFETY: `prog` is a valid program until nvrtcDestroyProgram; buffers are sized by the
    // matching Get*Size calls.
    let result = unsafe {
        let compiled =
            nvrtc::nvrtcCompileProgram(prog, option_ptrs.len() as i32, option_ptrs.as_ptr());
        let mut log_size = 0usize;
        let mut log = Vec::new();
        if nvrtc::nvrtcGetProgramLogSize(prog, &mut log_size)
            .result()
            .is_ok()
            && log_size > 1
        {
            log = vec![0u8; log_size];
            let _ = nvrtc::nvrtcGetProgramLog(prog, log.as_mut_ptr() as *mut c_char);
        }
        let log = String::from_utf8_lossy(&log)
            .trim_end_matches('\0')
            .trim()
            .to_string();
        match compiled.result() {
            Err(e) => Err(Error::Device(format!(
                "NVRTC compile of {file} {program_options} for {arch} failed ({e}):\n{log}"
            ))),
            Ok(()) => {
                let mut size = 0usize;
                nvrtc::nvrtcGetCUBINSize(prog, &mut size)
                    .result()
                    .map_err(|e| fail("cubin size", e))?;
                let mut cubin = vec![0u8; size];
                nvrtc::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut c_char)
                    .result()
                    .map_err(|e| fail("cubin", e))?;
                Ok(cubin)
            }
        }
    };
    // SAFETY: destroys the program created above exactly once.
    unsafe {
        let _ = nvrtc::nvrtcDestroyProgram(&mut prog);
    }
    result
}

fn load_modules(ctx: &CudaContext, cubins: &[Vec<u8>]) -> Result<Kernels> {
    ctx.bind_to_thread()
        .map_err(|e| device_error("binding the context", e))?;
    let mut modules = Vec::with_capacity(cubins.len());
    let unload = |modules: &[sys::CUmodule]| {
        for &m in modules {
            // SAFETY: each module was loaded below and is not referenced by anything yet.
            let _ = unsafe { result::module::unload(m) };
        }
    };
    for cubin in cubins {
        // SAFETY: `cubin` is a complete cubin image (from NVRTC, or a cache file whose framing
        // was checked); cuModuleLoadData validates it and fails cleanly on a corrupt one.
        match unsafe { result::module::load_data(cubin.as_ptr() as *const _) } {
            Ok(m) => modules.push(m),
            Err(e) => {
                unload(&modules);
                return Err(device_error("loading a kernel module", e));
            }
        }
    }
    let get = |program: usize, name: &str| -> Result<sys::CUfunction> {
        // SAFETY: the module of `program` is one of those loaded above.
        unsafe { result::module::get_function(modules[program], CString::new(name).unwrap()) }
            .map_err(|e| device_error(&format!("kernel {name}"), e))
    };
    let by_bits = |prefix: &str| -> Result<[[sys::CUfunction; 3]; 3]> {
        let mut out = [[std::ptr::null_mut(); 3]; 3];
        for (i, bits) in BITS.iter().enumerate() {
            for (j, rows) in GEMV_ROWS.iter().enumerate() {
                out[i][j] = get(GEMV + i, &format!("{prefix}_b{bits}_r{rows}"))?;
            }
        }
        Ok(out)
    };
    let by_chunks = |prefix: &str| -> Result<[[sys::CUfunction; 2]; 3]> {
        let mut out = [[std::ptr::null_mut(); 2]; 3];
        for (i, bits) in BITS.iter().enumerate() {
            for (j, chunks) in GEMV_NORM_CHUNKS.iter().enumerate() {
                out[i][j] = get(GEMV + i, &format!("{prefix}_b{bits}_c{chunks}"))?;
            }
        }
        Ok(out)
    };
    let by_dj = |prefix: &str| -> Result<[sys::CUfunction; 4]> {
        let mut out = [std::ptr::null_mut(); 4];
        for (i, dj) in ATT_DJ.iter().enumerate() {
            out[i] = get(ATTENTION, &format!("{prefix}_dj{dj}"))?;
        }
        Ok(out)
    };
    let by_tiles = |prefix: &str| -> Result<[[sys::CUfunction; 3]; 3]> {
        let mut out = [[std::ptr::null_mut(); 3]; 3];
        for (i, bits) in BITS.iter().enumerate() {
            for (j, tiles) in SMALL_GEMM_TILES.iter().enumerate() {
                out[i][j] = get(GEMM, &format!("{prefix}_b{bits}_m{tiles}"))?;
            }
        }
        Ok(out)
    };
    let by_rows = || -> Result<[[sys::CUfunction; 2]; 3]> {
        let mut out = [[std::ptr::null_mut(); 2]; 3];
        for (i, bits) in BITS.iter().enumerate() {
            for (j, rows) in TILED_GEMM_ROWS.iter().enumerate() {
                out[i][j] = get(GEMM, &format!("gemm_tiled_b{bits}_w{}", rows / 64))?;
            }
        }
        Ok(out)
    };
    let by_wgmma_rows = || -> Result<[[sys::CUfunction; 2]; 3]> {
        let mut out = [[std::ptr::null_mut(); 2]; 3];
        for (i, bits) in WGMMA_GEMM_BITS.iter().enumerate() {
            for (j, rows) in WGMMA_GEMM_ROWS.iter().enumerate() {
                out[i][j] = get(GEMM, &format!("gemm_wgmma_b{bits}_m{rows}"))?;
            }
        }
        Ok(out)
    };
    let loaded = (|| {
        Ok(Kernels {
            modules: modules.clone(),
            embed_f32: get(ELEMENTWISE, "embed_f32")?,
            embed_f16: get(ELEMENTWISE, "embed_f16")?,
            norm_rows: get(ELEMENTWISE, "norm_rows")?,
            norm_state_rows: get(ELEMENTWISE, "norm_state_rows")?,
            add_bias: get(ELEMENTWISE, "add_bias")?,
            scale_f32: get(ELEMENTWISE, "scale_f32")?,
            rope_kv: get(ELEMENTWISE, "rope_kv")?,
            to_half: get(ELEMENTWISE, "to_half")?,
            swiglu: get(ELEMENTWISE, "swiglu")?,
            swiglu_half: get(ELEMENTWISE, "swiglu_half")?,
            argmax_f32: get(ELEMENTWISE, "argmax_f32")?,
            entropy_f32: get(ELEMENTWISE, "entropy_f32")?,
            sample_token: get(SAMPLE, "sample_token")?,
            gemv: by_bits("gemv")?,
            gemv_gateup: by_bits("gemv_gateup")?,
            gemv_norm: by_chunks("gemv_norm")?,
            gemv_gateup_norm: by_chunks("gemv_gateup_norm")?,
            gemm_tiled: by_rows()?,
            gemm_small: by_tiles("gemm_small")?,
            gemm_split: by_tiles("gemm_split")?,
            gemm_segments_sum: get(GEMM, "gemm_segments_sum")?,
            swiglu_segments: get(GEMM, "swiglu_segments")?,
            gemm_wgmma: by_wgmma_rows()?,
            gemm_unit_sums: get(GEMM, "gemm_unit_sums")?,
            linear_generic: get(GEMV, "linear_generic")?,
            attention: [by_dj("attention")?, by_dj("attention_heads")?],
            attention_q: [by_dj("attention_q")?, by_dj("attention_q_heads")?],
            flash_attention: [
                get(FLASH, "flash_attention_hd16")?,
                get(FLASH, "flash_attention_hd32")?,
                get(FLASH, "flash_attention_hd64")?,
                get(FLASH, "flash_attention_hd128")?,
            ],
            kv_store: get(KV, "kv_store")?,
            kv_move: get(KV, "kv_move")?,
            h_dequant: get(KV, "h_dequant")?,
            h_finish: get(KV, "h_finish")?,
            requantize_group: get(REQUANTIZE, "requantize_group")?,
        })
    })();
    if loaded.is_err() {
        unload(&modules);
    }
    loaded
}

impl Drop for Kernels {
    fn drop(&mut self) {
        for &m in &self.modules {
            // SAFETY: each module is unloaded once; no launch can be in flight because the
            // owning Gpu is process-wide and dropped only at exit (if ever).
            let _ = unsafe { result::module::unload(m) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// H200: 132 SMs, 227 KiB of opt-in shared memory per block.
    const SMS: usize = 132;
    const SMEM: usize = 232_448 - 2048;

    #[test]
    fn small_gemm_plan_fills_the_sms_with_the_widest_blocks_that_fit() {
        // 32 decode rows, N 8192: two row tiles, 32-column blocks (64-column blocks would be
        // 128, fewer than the SMs).
        let p = SmallGemmPlan::new(4, 32, 8192, SMS, SMEM);
        assert_eq!((SMALL_GEMM_TILES[p.tiles_index], p.col_groups), (2, 2));
        assert_eq!(p.grid(), (256, 1, 1));
        // N 2048: no grouping gives every SM a block; the narrowest.
        let p = SmallGemmPlan::new(4, 32, 2048, SMS, SMEM);
        assert_eq!((p.col_groups, p.grid()), (1, (128, 1, 1)));
        // 5 rows: one row tile; 200 rows: four, in 4 row blocks.
        assert_eq!(SmallGemmPlan::new(2, 5, 4096, SMS, SMEM).tiles_index, 0);
        let p = SmallGemmPlan::new(4, 200, 4096, SMS, SMEM);
        assert_eq!((SMALL_GEMM_TILES[p.tiles_index], p.grid().1), (4, 4));
    }

    fn shape(bits: u32, rows: usize, n: usize, k: usize, group: usize) -> ProductShape {
        ProductShape {
            bits,
            rows,
            n,
            k,
            group,
        }
    }

    #[test]
    fn split_gemm_plan_gives_a_block_per_columns_segment_and_rows() {
        const PARTS: usize = 1 << 22;
        // 32 decode rows, N 6144, K 2048: 8 segments, 48 blocks of 128 columns each.
        let p = SplitGemmPlan::new(shape(4, 32, 6144, 2048, 128), SMS, SMEM, PARTS).unwrap();
        assert_eq!(
            (SMALL_GEMM_TILES[p.tiles_index], p.warps, p.segments),
            (2, 8, 8)
        );
        assert_eq!(p.grid(), (48, 8, 1));
        // N 2048: 128 blocks of 8 warps, or 256 of 4, would leave SMs with fewer than two; one
        // row tile a block, 512 blocks of 4 warps.
        let p = SplitGemmPlan::new(shape(4, 32, 2048, 2048, 128), SMS, SMEM, PARTS).unwrap();
        assert_eq!((p.tiles_index, p.warps, p.grid()), (0, 4, (32, 8, 2)));
        // One row and N 512: nothing gives two blocks an SM; the most blocks, 4 warps.
        let p = SplitGemmPlan::new(shape(4, 1, 512, 2048, 128), SMS, SMEM, PARTS).unwrap();
        assert_eq!((p.tiles_index, p.warps, p.grid()), (0, 4, (8, 8, 1)));
        // A partial last segment, 100 rows in two row blocks of 64.
        let p = SplitGemmPlan::new(shape(2, 100, 4096, 2080, 32), SMS, SMEM, PARTS).unwrap();
        assert_eq!((p.segments, p.grid().2), (9, 2));
        // Too many partial sums for the scratch: no split.
        assert_eq!(
            SplitGemmPlan::new(shape(4, 64, 50304, 2048, 128), SMS, SMEM, PARTS),
            None
        );
        assert_eq!(
            SplitGemmPlan::new(shape(4, 0, 2048, 2048, 128), SMS, SMEM, PARTS),
            None
        );
    }

    #[test]
    fn split_gemm_plan_fits_shared_memory() {
        for bits in BITS {
            for group in [32, 96, 128, 160, 2048] {
                for rows in [1, 16, 40, 64, 300] {
                    for limit in [SMEM, 163 * 1024, 99 * 1024] {
                        let s = shape(bits, rows, 2048, 4096, group);
                        let p = SplitGemmPlan::new(s, SMS, limit, usize::MAX).unwrap();
                        assert!(p.smem <= limit, "{s:?}: {p:?}");
                    }
                }
            }
        }
        // The largest block: 64 rows of f16 weights, 8 warps.
        assert_eq!(split_gemm_smem(16, 4, 8, 128), 64 * 528 + 128 * 528);
        // INT4, group 32: eight groups a segment, a scale and a zero word per row.
        assert_eq!(
            split_gemm_smem(4, 2, 8, 32),
            32 * 528 + 128 * 144 + 2 * 8 * 128 * 4
        );
    }

    #[test]
    fn tiled_gemm_plan_takes_128_rows_where_they_fill_the_sms() {
        // 2048 rows by 2048 outputs: 16 x 16 blocks of 128 rows.
        let p = TiledGemmPlan::new(4, 2048, 2048, SMS, SMEM).unwrap();
        assert_eq!((TILED_GEMM_ROWS[p.rows_index], p.threads), (128, 256));
        assert_eq!(p.grid(), (16, 16, 1));
        // 512 rows: 16 x 4 blocks of 128 rows leave SMs idle; 16 x 8 of 64 rows do not.
        let p = TiledGemmPlan::new(4, 512, 2048, SMS, SMEM).unwrap();
        assert_eq!((TILED_GEMM_ROWS[p.rows_index], p.threads), (64, 128));
        assert_eq!(p.grid(), (16, 8, 1));
        // 256 rows: 16 x 4 blocks of 64 rows leave more than half of the SMs idle, so the
        // K-group kernel takes them, as it takes a single MMA tile of rows.
        assert_eq!(TiledGemmPlan::new(4, 256, 2048, SMS, SMEM), None);
        assert_eq!(TiledGemmPlan::new(4, 16, 1 << 20, SMS, SMEM), None);
    }

    #[test]
    fn tiled_gemm_plan_fits_shared_memory() {
        for bits in BITS {
            for rows in [17, 300, 4096] {
                for limit in [SMEM, 163 * 1024, 99 * 1024] {
                    if let Some(p) = TiledGemmPlan::new(bits, rows, 65536, SMS, limit) {
                        assert!(p.smem <= limit, "{bits} bits, {rows} rows: {p:?}");
                    }
                }
            }
        }
        // 128 rows of f16 weights: four stages of 128 X rows and 128 weight rows of 80
        // bytes, then 64 sums for each of 256 threads.
        assert_eq!(
            tiled_gemm_smem(16, 128),
            4 * (128 * 80 + 128 * 80) + 256 * 64 * 4
        );
        // INT4, 64 rows: 16-byte code rows and a scale and a zero word per weight row.
        assert_eq!(
            tiled_gemm_smem(4, 64),
            4 * (64 * 80 + 128 * 16 + 128 * 8) + 128 * 64 * 4
        );
    }

    #[test]
    fn wgmma_gemm_plan_takes_products_of_many_rows() {
        let shape = |bits, rows, n, k| ProductShape {
            bits,
            rows,
            n,
            k,
            group: 128,
        };
        let sums = 1 << 20;
        // 2048 rows by 2048 outputs: 16 x 16 blocks of 128 rows; S of 2048 rows (already a
        // multiple of 4) for each of the 64 32-wide tiles of K.
        let p = WgmmaGemmPlan::new(shape(4, 2048, 2048, 2048), SMS, SMEM, sums).unwrap();
        assert_eq!((WGMMA_GEMM_ROWS[p.rows_index], p.sums_ld), (128, 2048));
        assert_eq!((p.grid(), p.sums_grid()), ((16, 16, 1), (8, 16, 1)));
        // 510 rows of INT2: blocks of 64 rows fill the SMs where 128 would not; S rows padded
        // to 512 floats.
        let p = WgmmaGemmPlan::new(shape(2, 510, 2048, 2048), SMS, SMEM, sums).unwrap();
        assert_eq!((p.bits_index, WGMMA_GEMM_ROWS[p.rows_index]), (1, 64));
        assert_eq!((p.grid(), p.sums_ld), ((16, 8, 1), 512));
        // f16 weights read no S, so any scratch does; 128-byte weight rows in a stage.
        let p = WgmmaGemmPlan::new(shape(16, 2048, 2048, 2048), SMS, SMEM, 0).unwrap();
        assert_eq!((p.bits_index, WGMMA_GEMM_ROWS[p.rows_index]), (2, 128));
        assert!(!p.needs_sums());
        assert_eq!(
            wgmma_gemm_smem(16, 128),
            1024 + 5 * 256 * 128 + 256 * 64 * 4
        );
        // 32 rows of a head (N = 50304): blocks of 128 rows would give the same 393 blocks as
        // blocks of 64, with three quarters of each tile past the last row.
        let p = WgmmaGemmPlan::new(shape(16, 32, 50304, 2048), SMS, SMEM, 0).unwrap();
        assert_eq!((WGMMA_GEMM_ROWS[p.rows_index], p.grid()), (64, (393, 1, 1)));
        // Not for K off the 64-wide tiles, too few blocks, S beyond the scratch, or blocks
        // beyond the shared memory.
        assert_eq!(
            WgmmaGemmPlan::new(shape(4, 2048, 2048, 2080), SMS, SMEM, sums),
            None
        );
        assert_eq!(
            WgmmaGemmPlan::new(shape(4, 256, 2048, 2048), SMS, SMEM, sums),
            None
        );
        assert_eq!(
            WgmmaGemmPlan::new(shape(4, 2048, 2048, 2048), SMS, SMEM, 65536),
            None
        );
        assert_eq!(
            WgmmaGemmPlan::new(shape(4, 2048, 2048, 2048), SMS, 99 * 1024, sums),
            None
        );
        // INT4, 128 rows: 5 stages of 16 KB of X, 48-byte code rows, the words and S, rounded
        // to 1 KB; then 64 sums for each of 256 threads, after 1 KB of alignment slack.
        let stage = (128 * 128 + 128 * 48 + 4 * 128 * 4 + 2 * 128 * 4_usize).next_multiple_of(1024);
        assert_eq!(wgmma_gemm_smem(4, 128), 1024 + 5 * stage + 256 * 64 * 4);
    }

    #[test]
    fn small_gemm_plan_keeps_its_stages_in_shared_memory() {
        for bits in BITS {
            for rows in [1, 16, 17, 33, 64, 300] {
                for n in [16, 100, 2048, 16384] {
                    for limit in [SMEM, 163 * 1024, 99 * 1024] {
                        let p = SmallGemmPlan::new(bits, rows, n, SMS, limit);
                        let tiles = SMALL_GEMM_TILES[p.tiles_index];
                        assert!(p.smem <= limit, "{bits} bits, {rows} rows, N {n}: {p:?}");
                        assert_eq!(p.smem, small_gemm_smem(bits, tiles, p.col_groups));
                        assert!(tiles * p.col_groups <= SMALL_GEMM_OUTS);
                        let (x, y, _) = p.grid();
                        assert!(x as usize * 16 * p.col_groups >= n);
                        assert!(y as usize * tiles * MMA_ROWS >= rows);
                    }
                }
            }
        }
        // f16 weights over 64 rows do not fit with one column group: two.
        let p = SmallGemmPlan::new(16, 64, 2048, SMS, SMEM);
        assert_eq!((SMALL_GEMM_TILES[p.tiles_index], p.col_groups), (4, 2));
        // A 99 KiB GPU takes f16 products of 64 rows in tiles of two.
        let p = SmallGemmPlan::new(16, 64, 2048, SMS, 99 * 1024);
        assert_eq!(SMALL_GEMM_TILES[p.tiles_index], 2);
    }

    #[test]
    fn program_indices_name_their_sources() {
        assert_eq!(PROGRAMS[ELEMENTWISE].0, "elementwise.cu");
        for (i, bits) in BITS.iter().enumerate() {
            assert_eq!(
                PROGRAMS[GEMV + i],
                ("gemv.cu", &*format!("-DGEMV_BITS={bits}"))
            );
        }
        assert_eq!(PROGRAMS[GEMM].0, "gemm.cu");
        assert_eq!(PROGRAMS[ATTENTION].0, "attention.cu");
        assert_eq!(PROGRAMS[SAMPLE].0, "sample.cu");
        assert_eq!(PROGRAMS[KV].0, "kv.cu");
        assert_eq!(PROGRAMS[FLASH].0, "flash.cu");
        assert_eq!(PROGRAMS[REQUANTIZE].0, "requantize.cu");
    }

    #[test]
    fn key_is_stable_and_depends_on_arch_and_version() {
        let a = cache_key("sm_90", (13, 0), &[]);
        assert_eq!(a, cache_key("sm_90", (13, 0), &[]));
        assert_ne!(a, cache_key("sm_80", (13, 0), &[]));
        assert_ne!(a, cache_key("sm_90", (13, 1), &[]));
        assert_ne!(a, cache_key("sm_90", (13, 0), &["-DX=1".into()]));
        assert!(a.starts_with("sm_90-nvrtc130-"));
    }

    fn kernel_options(pairs: &[(&str, &[u8])]) -> Result<KernelOptions> {
        let source = crate::env::table(pairs);
        KernelOptions::from_vars(Vars::new(&source))
    }

    #[test]
    fn kernel_variables_are_read() {
        let home = [("HOME", &b"/home/u"[..])];
        let default = kernel_options(&home).unwrap();
        assert_eq!(
            default.cache,
            Some(PathBuf::from("/home/u/.cache/tinyloop/kernels"))
        );
        assert!(default.defines.is_empty());
        let xdg = kernel_options(&[("HOME", b"/home/u"), ("XDG_CACHE_HOME", b"/x")]).unwrap();
        assert_eq!(xdg.cache, Some(PathBuf::from("/x/tinyloop/kernels")));
        assert_eq!(kernel_options(&[]).unwrap().cache, None);
        for off in ["off", "0"] {
            let got = kernel_options(&[("HOME", b"/home/u"), (CACHE, off.as_bytes())]);
            assert_eq!(got.unwrap().cache, None);
        }
        let empty = kernel_options(&[("HOME", b"/home/u"), (CACHE, b""), (DEFINES, b"")]);
        assert_eq!(empty.unwrap(), default);
        // A folder needs no UTF-8.
        use std::os::unix::ffi::OsStrExt;
        let dir = kernel_options(&[(CACHE, crate::env::NOT_UTF8)])
            .unwrap()
            .cache
            .unwrap();
        assert_eq!(dir.as_os_str().as_bytes(), crate::env::NOT_UTF8);
        let got = kernel_options(&[(DEFINES, b" GEMV_MIN_BLOCKS=4  -DFAST _X=a=b ")]).unwrap();
        assert_eq!(got.defines, ["-DGEMV_MIN_BLOCKS=4", "-DFAST", "-D_X=a=b"]);
    }

    #[test]
    fn bad_kernel_variables_name_the_variable_and_value() {
        for bad in ["4X=1", "-D", "=1", "A-B=2", "OK BAD;"] {
            let e = kernel_options(&[(DEFINES, bad.as_bytes())])
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(&format!(
                    "{DEFINES}={bad:?} is not accepted: expected space-separated NAME"
                )),
                "{e}"
            );
        }
        let e = kernel_options(&[(DEFINES, crate::env::NOT_UTF8)])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("TINYLOOP_CUDA_DEFINES=\"1\\xFF\" is not valid UTF-8"),
            "{e}"
        );
    }

    #[test]
    fn expand_finds_existing_paths_only() {
        assert!(expand("/definitely-not-here-*/x").is_empty());
        assert!(!expand("/t*").is_empty() || !Path::new("/tmp").exists());
    }

    /// Compiles every kernel with NVRTC when the library can be found (no GPU needed); set
    /// TINYLOOP_NVRTC to the folder of libnvrtc.so.13 (e.g. the nvidia-cuda-nvrtc wheel's).
    #[test]
    fn kernels_compile_with_nvrtc_when_present() {
        if load_nvrtc().is_err() {
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "skipped: NVRTC not found (set TINYLOOP_NVRTC; scripts/check-kernels.sh covers CI)"
            );
            return;
        }
        for arch in ["sm_80", "sm_90a"] {
            let cubins = compile(arch, &[]).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(cubins.len(), PROGRAMS.len());
            for cubin in &cubins {
                assert!(cubin.len() > 1000, "{arch}: cubin of {} bytes", cubin.len());
            }
            assert_eq!(unpack(&pack(&cubins)), Some(cubins));
        }
    }
}
