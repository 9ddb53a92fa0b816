// Matrix-matrix products for prefill: out[m, n] (+)= sum_k X[m, k] * W[n, k], on the tensor cores
// (mma.sync m16n8k16, f16 inputs, f32 accumulation; sm_80 and later).
//
// Quantized weights enter the tensor cores as their integer codes, which f16 holds exactly, so
// each unit of K (the 32-wide tiles of one quantization group inside one segment: the host
// requires group % 32 == 0) gives
//     T[m, n] = sum_k q[n, k] X[m, k]   and   S[m] = sum_k X[m, k]   (MMAs against ones),
// both exact products accumulated in f32, and the unit adds s[n, g] * T + z[n, g] * S: the
// contract's f32 dequantize-and-accumulate, up to the order of f32 additions. No weight is ever
// rounded to f16.
//
// Four kernels share that order (docs/NUMERICS.md "The tensor-core GEMM's order"): block tiles
// that walk all of K for many rows (gemm_tiled, and gemm_wgmma on sm_90a), warps that take K in
// parallel segments for few rows (gemm_small), and a block per segment whose sums a second kernel
// adds (gemm_split).
#include "common.cuh"

// All three kernels sum K in segments of this many: each segment's products from zero, then the
// segments' sums in order. The K-group and split kernels compute segments in parallel; the order
// of additions is the same.
#define GEMM_SEGMENT 256

// (1024 + c0, 1024 + c1) as f16x2 minus (1024, 1024): the codes as exact f16 values.
DEV u32 codes_to_f16x2(u32 pair) {
    u32 r;
    asm("sub.f16x2 %0, %1, %2;" : "=r"(r) : "r"(pair | 0x64006400u), "r"(0x64006400u));
    return r;
}

// Codes 2p and 2p+1 of a word of 8 int4 codes, as f16x2: byte p to both halves, the low code
// as 1024 + c and the high one as 1024 + 16 c, then (h - 1024, h / 16 - 64), exact in f16.
DEV u32 q4_pair(u32 w, int p) {
    u32 b, r;
    asm("prmt.b32 %0, %1, 0, %2;" : "=r"(b) : "r"(w), "r"(0x4040u | p | (p << 8)));
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(b), "r"(0x00F0000Fu), "r"(0x64006400u));
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(r), "r"(0x2C003C00u), "r"(0xD400E400u));
    return r;
}

// Codes 2p and 2p+1 of a word of 16 int2 codes, as f16x2.
DEV u32 q2_pair(u32 w, int p) {
    const u32 y = w >> (4 * p);
    return codes_to_f16x2((y & 0x3u) | ((y & 0xCu) << 14));
}

// A quantized product's step per unit of K, shared by the GEMM kernels so that a row's result
// does not depend on which of them computed it: acc += s * T + z * S with the unit's scale and
// zero for output column n (sz: zero past N) for rows g and g + 8 of an MMA tile (T in tq[e],
// tq[e + 2] and S in px[0], px[2], as mma16816 leaves them).
DEV void add_dequantized(float* acc, const float* tq, const float* px, int e, float2 sz) {
    acc[e] = fmaf(sz.x, tq[e], fmaf(sz.y, px[0], acc[e]));
    acc[e + 2] = fmaf(sz.x, tq[e + 2], fmaf(sz.y, px[2], acc[e + 2]));
}

// A warp's sums of 16 MT rows by 16 columns (as mma16816 leaves them) to dst[m * stride + n],
// the first `rows` rows and `cols` columns of them.
template <int MT>
DEV void store_warp_tile(const float (&acc)[MT][2][4], float* dst, int stride, int rows,
                         int cols) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int m = mt * 16 + g + (e >= 2 ? 8 : 0), n = nt * 8 + t * 2 + (e & 1);
                if (m < rows && n < cols) dst[(size_t)m * stride + n] = acc[mt][nt][e];
            }
}

// T and S of MT row tiles by NT column tiles back to zero, for the next unit.
template <int MT, int NT> DEV void zero_unit(float (&tq)[MT][NT][4], float (&px)[MT][4]) {
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int e = 0; e < 4; e++) px[mt][e] = 0.0f;
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) tq[mt][nt][e] = 0.0f;
    }
}

// Whether the 32-wide tile at k0 ends a unit: the next starts a quantization group, a segment,
// or is past K.
DEV bool unit_ends(int k0, int K, int group) {
    const int next = k0 + 32;
    return next >= K || next % GEMM_SEGMENT == 0 || next % group == 0;
}

// Products of few rows (decode rows of a batch, a speculative verify pass, a short prompt).
// There the tiled kernel is bound by latency, not by bytes: each block walks the whole of K one
// tile after the other, and for N = 2048 only 32 blocks run. This one splits K among the warps
// of a block: its SMALL_WARPS warps form `col_groups` groups of 16 weight rows (one per warp)
// times SMALL_WARPS / col_groups K groups; each K group takes one segment at a time (in waves when
// K has more), over up to 16 * MT rows of X (MT MMA tiles). A K group's warps stream their
// 32-wide K tiles (X, the codes, and the words holding their scales and zeros) through a ring of
// SMALL_STAGES stages in shared memory with cp.async, SMALL_STAGES - 1 tiles ahead of the math
// and across segment boundaries, so the K group's warps read X once between them; they leave
// each segment's partial sums in shared memory, where they are added in segment order. More
// column groups read X less often per weight byte; fewer give more blocks: the host picks per
// shape.
//
// Every output takes the operations of the tiled kernel in the same order (per segment, from
// zero: per unit, the MMAs of its 32-wide tiles chained from zero for T, the same against ones
// for S, then add_dequantized; the segments' sums added in order), so a row's result does not
// depend on which kernel, which MT or which column grouping computed it.
#define SMALL_WARPS 8  // warps per block
#define SMALL_OUTS 8   // outputs per thread in the final sums: MT * col_groups <= 8
#define SMALL_STAGES 4 // tiles in flight per K group
#define SMALL_X_ROW 80 // bytes per X row of a stage: 32 halves + 16 (ldmatrix, no bank conflicts)

// Bytes of one stage (src/backend/cuda/kernels.rs `small_gemm_smem` computes the same): X, the
// codes (f16 rows padded like X), then a scale word and a zero word per weight row.
DEV int small_w_row(int bits) { return bits == 16 ? SMALL_X_ROW : bits * 4; }
DEV int small_stage_bytes(int bits, int MT, int cols) {
    return 16 * MT * SMALL_X_ROW + cols * small_w_row(bits) + (bits == 16 ? 0 : cols * 8);
}

// One warp's fragments of a 32-wide K tile: weights of its 2 column tiles (as f16x2 codes, or
// f16 values), their scales and zeros, and X of its MT row tiles.
template <int MT> struct SmallFrags {
    u32 b[2][2][2]; // [column tile][16-wide half][fragment word]
    float2 sz[2][2]; // [column tile][column pair element]
    u32 a[MT][2][4]; // [row tile][16-wide half][fragment word]
};

// The high (`odd`) or low half of a word of two f16, as f32.
DEV float half_of_word(u32 word, int odd) {
    return f16_to_f32((f16_t)(odd ? word >> 16 : word & 0xffffu));
}

// The f16 at `p` from the aligned word holding it (the word a stage copied).
DEV float f16_of_word(u32 word, const f16_t* p) { return half_of_word(word, ((size_t)p >> 1) & 1); }

// A warp's X fragments of one 32-wide K tile held in shared memory: MT row tiles through
// ldmatrix from `x` (row 0 of the tile; rows `x_row` bytes apart).
template <int MT> DEV void read_x_frags(u32 (&a)[MT][2][4], u32 x, int x_row) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int h = 0; h < 2; h++)
            ldmatrix_x4(a[mt][h], x + (mt * 16 + (lane & 15)) * x_row + h * 32 + (lane >> 4) * 16);
}

// A warp's weight fragments of one 32-wide K tile: 16 weight rows from row `cr` of `w` (rows
// `w_row` bytes apart), as f16x2 codes or f16 values.
template <int BITS> DEV void read_w_frags(u32 (&b)[2][2][2], const u8* w, int w_row, int cr) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int nt = 0; nt < 2; nt++) {
        const u8* row = w + (cr + nt * 8 + g) * w_row;
        if (BITS == 4) {
            const uint4 v = *(const uint4*)row;
            b[nt][0][0] = q4_pair(v.x, t);
            b[nt][0][1] = q4_pair(v.y, t);
            b[nt][1][0] = q4_pair(v.z, t);
            b[nt][1][1] = q4_pair(v.w, t);
        } else if (BITS == 2) {
            const uint2 v = *(const uint2*)row;
            b[nt][0][0] = q2_pair(v.x, t);
            b[nt][0][1] = q2_pair(v.x, t + 4);
            b[nt][1][0] = q2_pair(v.y, t);
            b[nt][1][1] = q2_pair(v.y, t + 4);
        } else {
#pragma unroll
            for (int h = 0; h < 2; h++) {
                b[nt][h][0] = *(const u32*)(row + t * 4 + h * 32);
                b[nt][h][1] = *(const u32*)(row + t * 4 + h * 32 + 16);
            }
        }
    }
}

// Half h (K 16 h .. 16 h + 15) of the same: b[column tile][fragment word].
template <int BITS> DEV void read_w_half(u32 (&b)[2][2], const u8* w, int w_row, int cr, int h) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int nt = 0; nt < 2; nt++) {
        const u8* row = w + (cr + nt * 8 + g) * w_row;
        if (BITS == 4) {
            const uint2 v = *(const uint2*)(row + h * 8);
            b[nt][0] = q4_pair(v.x, t);
            b[nt][1] = q4_pair(v.y, t);
        } else if (BITS == 2) {
            const u32 v = *(const u32*)(row + h * 4);
            b[nt][0] = q2_pair(v, t);
            b[nt][1] = q2_pair(v, t + 4);
        } else {
            b[nt][0] = *(const u32*)(row + t * 4 + h * 32);
            b[nt][1] = *(const u32*)(row + t * 4 + h * 32 + 16);
        }
    }
}

// Both of the above into `f`.
template <int BITS, int MT>
DEV void read_frags(SmallFrags<MT>& f, u32 x, int x_row, const u8* w, int w_row, int cr) {
    read_x_frags<MT>(f.a, x, x_row);
    read_w_frags<BITS>(f.b, w, w_row, cr);
}

// The scales and zeros of a warp's weight rows cr .. cr + 15 from the aligned words holding
// element (nb + row) * G + gi of `sz` and `zeros` (`words`: a word per row, the zeros
// `zero_at` words after the scales).
DEV void words_scales(float2 (&q)[2][2], const u32* words, int zero_at, int cr, int nb,
                      const f16_t* __restrict__ sz, const f16_t* __restrict__ zeros, int G,
                      int gi) {
    const int t = threadIdx.x & 3;
#pragma unroll
    for (int nt = 0; nt < 2; nt++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int c = cr + nt * 8 + t * 2 + e;
            const size_t at = (size_t)(nb + c) * G + gi;
            q[nt][e] = make_float2(f16_of_word(words[c], sz + at),
                                   f16_of_word(words[zero_at + c], zeros + at));
        }
}

// The same from a table of (scale, zero) pairs, one per weight row.
template <int MT> DEV void table_scales(SmallFrags<MT>& f, const float2* table, int cr) {
    const int t = threadIdx.x & 3;
#pragma unroll
    for (int nt = 0; nt < 2; nt++) {
        const float4 v = *(const float4*)(table + cr + nt * 8 + t * 2);
        f.sz[nt][0] = make_float2(v.x, v.y);
        f.sz[nt][1] = make_float2(v.z, v.w);
    }
}

// Copy the aligned word holding `*p` to shared `dst` (4 bytes; zeros when `!valid`).
DEV void cp_async_word(u32 dst, const f16_t* p, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst),
                 "l"((size_t)p & ~(size_t)3), "r"(valid ? 4 : 0)
                 : "memory");
}

// Request tile `k0` of a K group's weight rows nb .. nb + cols into a stage: `gt` is the thread's
// place among the group's `gthreads`. Rows past N land as zeros and are never stored.
template <int BITS>
DEV void small_copy_weights(u32 stage, const u8* __restrict__ W, const f16_t* __restrict__ sz,
                            const f16_t* __restrict__ zeros, int N, int G, int group,
                            size_t row_bytes, int nb, int cols, int MT, int k0, int gt,
                            int gthreads, u64 policy) {
    const u32 ws = stage + 16 * MT * SMALL_X_ROW;
    if (BITS == 16) {
        for (int c = gt; c < cols * 4; c += gthreads) {
            const int r = c >> 2, part = c & 3, n = nb + r;
            const u8* src = W + (size_t)min(n, N - 1) * row_bytes + (size_t)k0 * 2 + part * 16;
            cp_async16_w(ws + r * SMALL_X_ROW + part * 16, src, n < N ? 16 : 0, policy);
        }
    } else {
        for (int r = gt; r < cols; r += gthreads) {
            const int n = nb + r;
            const u8* src = W + (size_t)min(n, N - 1) * row_bytes + (size_t)k0 * BITS / 8;
            if (BITS == 4)
                cp_async16_w(ws + r * 16, src, n < N ? 16 : 0, policy);
            else
                cp_async8_w(ws + r * 8, src, n < N ? 8 : 0, policy);
        }
        // A word each: the scales of the group's rows, then their zeros.
        for (int c = gt; c < 2 * cols; c += gthreads) {
            const int r = c % cols, n = nb + r;
            const f16_t* p = (c < cols ? sz : zeros) + (size_t)min(n, N - 1) * G + k0 / group;
            cp_async_word(ws + cols * small_w_row(BITS) + c * 4, p, n < N);
        }
    }
}

// Request tile `k0` of X's rows m0 .. m0 + 16 MT into a stage; rows past M land as zeros.
DEV void small_copy_x(u32 stage, const f16_t* __restrict__ X, int M, int K, int m0, int MT,
                      int k0, int gt, int gthreads) {
    for (int c = gt; c < 64 * MT; c += gthreads) {
        const int r = c >> 2, part = c & 3, m = m0 + r;
        const f16_t* src = X + (size_t)min(m, M - 1) * K + k0 + part * 8;
        cp_async16(stage + r * SMALL_X_ROW + part * 16, src, m < M ? 16 : 0);
    }
}

// The start of a ring of SMALL_STAGES stages: the first tiles' weights are requested before the
// predecessor has finished (they are immutable); each prologue group then adds its tile of X.
template <typename CopyWeights, typename CopyX>
DEV void ring_prologue(CopyWeights& copy_weights, CopyX& copy_x) {
#pragma unroll
    for (int j = 0; j < SMALL_STAGES - 1; j++) copy_weights(j);
    kernel_start();
#pragma unroll
    for (int j = 0; j < SMALL_STAGES - 1; j++) {
        copy_x(j);
        cp_async_commit();
    }
}

// One 32-wide tile's products, as the tiled kernel takes them: quantized weights into the
// unit's T (tq) and S (px), f16 weights straight into the segment's sums (acc).
template <int BITS, int MT>
DEV void tile_products(float (&acc)[MT][2][4], float (&tq)[MT][2][4], float (&px)[MT][4],
                       const SmallFrags<MT>& f) {
    const u32 ones[2] = {0x3C003C00u, 0x3C003C00u};
    // Half by half, so that the two MMAs chained on an accumulator are as far apart as can be.
#pragma unroll
    for (int h = 0; h < 2; h++)
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
#pragma unroll
            for (int nt = 0; nt < 2; nt++)
                mma16816(BITS == 16 ? acc[mt][nt] : tq[mt][nt], f.a[mt][h], f.b[nt][h]);
            if (BITS != 16) mma16816(px[mt], f.a[mt][h], ones);
        }
}

// The end of a unit: acc += s * T + z * S with the unit's scales and zeros (f.sz), as the tiled
// kernel adds them, and T and S back to zero.
template <int MT>
DEV void flush_unit(float (&acc)[MT][2][4], float (&tq)[MT][2][4], float (&px)[MT][4],
                    const SmallFrags<MT>& f) {
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int e = 0; e < 2; e++) add_dequantized(acc[mt][nt], tq[mt][nt], px[mt], e, f.sz[nt][e]);
    }
    zero_unit<MT, 2>(tq, px);
}

template <int BITS, int MT>
DEV void gemm_small(const f16_t* __restrict__ X, int M, int K, const u8* __restrict__ W,
                    const f16_t* __restrict__ sz, const f16_t* __restrict__ zeros, int N,
                    int group, int stream_hint, float* __restrict__ out, int accumulate,
                    int col_groups) {
    // The K groups' rings of stages, then the partial sums of one wave:
    // [K group][row][column] over the block's 16 MT x 16 col_groups outputs.
    extern __shared__ __align__(16) u8 smem[];
    const u64 policy = l2_policy(stream_hint != 0);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int cols = 16 * col_groups, k_groups = SMALL_WARPS / col_groups;
    const int cg = warp % col_groups, kg = warp / col_groups;
    const int gt = cg * 32 + lane, gthreads = 32 * col_groups;
    const int m0 = blockIdx.y * 16 * MT, nb = blockIdx.x * cols;
    const int outs = 16 * MT * cols;
    const size_t row_bytes = (size_t)K * BITS / 8;
    const int G = BITS != 16 ? K / group : 1;
    const int segments = (K + GEMM_SEGMENT - 1) / GEMM_SEGMENT;
    const int waves = (segments + k_groups - 1) / k_groups;
    const int tiles = waves * (GEMM_SEGMENT / 32); // of this K group, some past K
    const int stage_bytes = small_stage_bytes(BITS, MT, cols);
    u8* ring = smem + kg * SMALL_STAGES * stage_bytes;
    const u32 ring_addr = smem_addr(ring);
    float* partial = (float*)(smem + k_groups * SMALL_STAGES * stage_bytes);

    // Tile j of this K group: its K offset, or -1 past K.
    auto tile_k = [&](int j) {
        const int seg = (j / (GEMM_SEGMENT / 32)) * k_groups + kg;
        const int k0 = seg * GEMM_SEGMENT + (j % (GEMM_SEGMENT / 32)) * 32;
        return seg < segments && k0 < K ? k0 : -1;
    };
    auto copy_weights = [&](int j) {
        const int k0 = tile_k(j);
        if (k0 >= 0)
            small_copy_weights<BITS>(ring_addr + (j % SMALL_STAGES) * stage_bytes, W, sz, zeros,
                                     N, G, group, row_bytes, nb, cols, MT, k0, gt, gthreads,
                                     policy);
    };
    auto copy_x = [&](int j) {
        const int k0 = tile_k(j);
        if (k0 >= 0)
            small_copy_x(ring_addr + (j % SMALL_STAGES) * stage_bytes, X, M, K, m0, MT, k0, gt,
                         gthreads);
    };

    ring_prologue(copy_weights, copy_x);

    float total[SMALL_OUTS] = {}; // outputs tid + 256 i of the block, in (row, column) order
    for (int wave = 0; wave < waves; wave++) {
        float acc[MT][2][4] = {}, tq[MT][2][4] = {}, px[MT][4] = {};
        for (int i = 0; i < GEMM_SEGMENT / 32; i++) {
            const int j = wave * (GEMM_SEGMENT / 32) + i;
            cp_async_wait<SMALL_STAGES - 2>();
            __syncthreads(); // tile j has landed for every thread; tile j - 1's stage is free
            if (j + SMALL_STAGES - 1 < tiles) {
                copy_weights(j + SMALL_STAGES - 1);
                copy_x(j + SMALL_STAGES - 1);
            }
            cp_async_commit();
            const int k0 = tile_k(j);
            if (k0 >= 0) {
                const int s = j % SMALL_STAGES;
                const u8* stage = ring + s * stage_bytes;
                const u8* w = stage + 16 * MT * SMALL_X_ROW;
                SmallFrags<MT> f;
                read_frags<BITS, MT>(f, ring_addr + s * stage_bytes, SMALL_X_ROW, w,
                                     small_w_row(BITS), cg * 16);
                tile_products<BITS, MT>(acc, tq, px, f);
                if (BITS != 16 && unit_ends(k0, K, group)) {
                    words_scales(f.sz, (const u32*)(w + cols * small_w_row(BITS)), cols,
                                 cg * 16, nb, sz, zeros, G, k0 / group);
                    flush_unit<MT>(acc, tq, px, f);
                }
            }
        }
        if (wave * k_groups + kg < segments)
            store_warp_tile<MT>(acc, partial + kg * outs + cg * 16, cols, 16 * MT, 16);
        __syncthreads();
        const int here = min(k_groups, segments - wave * k_groups);
#pragma unroll
        for (int i = 0; i < SMALL_OUTS; i++) {
            const int o = tid + 256 * i;
            if (o < outs)
                for (int w = 0; w < here; w++)
                    total[i] = __fadd_rn(total[i], partial[w * outs + o]);
        }
    }

#pragma unroll
    for (int i = 0; i < SMALL_OUTS; i++) {
        const int o = tid + 256 * i;
        const int m = m0 + o / cols, n = nb + o % cols;
        if (o < outs && m < M && n < N) {
            const size_t at = (size_t)m * N + n;
            out[at] = accumulate ? __fadd_rn(out[at], total[i]) : total[i];
        }
    }
}

// Products of many rows (prefill, scoring, long verify passes). A block multiplies 64 WARPS_M
// rows of X by TILED_COLS weight rows over all of K: WARPS_M x 4 warps, each 64 rows (four MMA
// tiles) by 32 weight rows (four column tiles). The 32-wide K tiles (X, the codes, the scale and
// zero words) stream through a ring of SMALL_STAGES stages with cp.async as in the K-group
// kernel, and each warp turns its codes into f16 fragments in registers. T, S and the segment's
// sums stay in registers; the sum of the segments before goes to shared memory, each thread to
// its own slots (no barrier), which leaves the registers for a 64 x 32 warp tile. A tile's MMAs
// go half by half, so that the two chained on an accumulator are far apart.
#define TILED_COLS 128

// Dynamic shared memory (src/backend/cuda/kernels.rs `tiled_gemm_smem` computes the same): the
// ring, then each thread's 64 sums of the segments before.
template <int BITS, int WARPS_M>
DEV void gemm_tiled(const f16_t* __restrict__ X, int M, int K, const u8* __restrict__ W,
                    const f16_t* __restrict__ sz, const f16_t* __restrict__ zeros, int N,
                    int group, int /* stream_hint: see the copies */, float* __restrict__ out,
                    int accumulate) {
    constexpr int MT = 4, NT = 4, WARPS_N = TILED_COLS / (8 * NT);
    constexpr int THREADS = 32 * WARPS_M * WARPS_N, WARP_ROWS = 16 * MT, WARP_COLS = 8 * NT;
    constexpr int X_ROWS = WARP_ROWS * WARPS_M;
    // A thread's 16-byte pieces of X (4 a row), its pieces of codes (f16 rows: 4 a row; else
    // one a row, where there are fewer rows than threads), and its scale or zero words.
    constexpr int X_COPIES = 4 * X_ROWS / THREADS;
    constexpr int W_COPIES = BITS == 16 ? 4 * TILED_COLS / THREADS : (TILED_COLS + THREADS - 1) / THREADS;
    constexpr int P_COPIES = BITS == 16 ? 0 : (2 * TILED_COLS + THREADS - 1) / THREADS;
    extern __shared__ __align__(16) u8 smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int wm = warp / WARPS_N, wn = warp % WARPS_N;
    const int m0 = blockIdx.y * X_ROWS, nb = blockIdx.x * TILED_COLS;
    const size_t row_bytes = (size_t)K * BITS / 8;
    const int G = BITS != 16 ? K / group : 1;
    const int tiles = K / 32;
    const int stage_bytes = small_stage_bytes(BITS, X_ROWS / 16, TILED_COLS);
    const int w_row = small_w_row(BITS);
    const u32 ring = smem_addr(smem);
    float* before = (float*)(smem + SMALL_STAGES * stage_bytes) + tid; // [MT * NT * 4][THREADS]

    // The copies, worked out once: sources at K = 0 and destinations within a stage; each tile
    // only adds its offsets. Rows of X past M land as zeros; weight rows past N repeat row N - 1
    // (their outputs are never stored), so that every weight copy has a constant size. The
    // weights take no L2 policy here: every block of a column reads them, and the policy's
    // copies next to a uniform shared base make ptxas 13.0 emit an invalid instruction.
    const f16_t* x_src[X_COPIES];
    u32 x_dst[X_COPIES];
    int x_bytes[X_COPIES];
#pragma unroll
    for (int i = 0; i < X_COPIES; i++) {
        const int c = tid + i * THREADS, r = c >> 2, m = m0 + r;
        x_src[i] = X + (size_t)min(m, M - 1) * K + (c & 3) * 8;
        x_dst[i] = r * SMALL_X_ROW + (c & 3) * 16;
        x_bytes[i] = m < M ? 16 : 0;
    }
    const u8* w_src[W_COPIES];
    u32 w_dst[W_COPIES]; // ~0u: no piece for this thread
#pragma unroll
    for (int i = 0; i < W_COPIES; i++) {
        const int c = tid + i * THREADS, r = BITS == 16 ? c >> 2 : c, n = nb + r;
        const int part = BITS == 16 ? (c & 3) * 16 : 0;
        w_src[i] = W + (size_t)min(n, N - 1) * row_bytes + part;
        w_dst[i] = r < TILED_COLS ? X_ROWS * SMALL_X_ROW + r * w_row + part : ~0u;
    }
    const f16_t* p_src[P_COPIES > 0 ? P_COPIES : 1];
    u32 p_dst[P_COPIES > 0 ? P_COPIES : 1]; // ~0u: no word for this thread
#pragma unroll
    for (int i = 0; i < P_COPIES; i++) {
        const int c = tid + i * THREADS, n = nb + c % TILED_COLS;
        p_src[i] = (c < TILED_COLS ? sz : zeros) + (size_t)min(n, N - 1) * G;
        p_dst[i] = c < 2 * TILED_COLS ? X_ROWS * SMALL_X_ROW + TILED_COLS * w_row + c * 4 : ~0u;
    }
    // Tiles are copied in order, so the group of the next tile to copy is counted, not divided.
    int copy_group = 0, copy_group_end = group;
    auto copy_weights = [&](int j) {
        if (j >= tiles) return;
        const int k0 = j * 32;
        const u32 stage = ring + (j % SMALL_STAGES) * stage_bytes;
#pragma unroll
        for (int i = 0; i < W_COPIES; i++) {
            const u8* src = w_src[i] + (size_t)k0 * BITS / 8;
            if (w_dst[i] == ~0u) continue;
            if (BITS == 2)
                cp_async8(stage + w_dst[i], src);
            else
                cp_async16(stage + w_dst[i], src, 16);
        }
        if (k0 == copy_group_end) {
            copy_group++;
            copy_group_end += group;
        }
#pragma unroll
        for (int i = 0; i < P_COPIES; i++)
            if (p_dst[i] != ~0u) cp_async_word(stage + p_dst[i], p_src[i] + copy_group, true);
    };
    auto copy_x = [&](int j) {
        if (j >= tiles) return;
        const u32 stage = ring + (j % SMALL_STAGES) * stage_bytes;
#pragma unroll
        for (int i = 0; i < X_COPIES; i++)
            cp_async16(stage + x_dst[i], x_src[i] + j * 32, x_bytes[i]);
    };
    ring_prologue(copy_weights, copy_x);

    const u32 ones[2] = {0x3C003C00u, 0x3C003C00u};
    float acc[MT][NT][4] = {}, tq[MT][NT][4] = {}, px[MT][4] = {};
    int group_index = 0, group_end = group; // the current tile's quantization group
    for (int j = 0; j < tiles; j++) {
        cp_async_wait<SMALL_STAGES - 2>();
        __syncthreads(); // tile j has landed for every thread; tile j - 1's stage is free
        copy_weights(j + SMALL_STAGES - 1);
        copy_x(j + SMALL_STAGES - 1);
        cp_async_commit();
        const int s = j % SMALL_STAGES, k0 = j * 32;
        const u8* w = smem + s * stage_bytes + X_ROWS * SMALL_X_ROW;
        u32 a[MT][2][4];
        read_x_frags<MT>(a, ring + s * stage_bytes + wm * WARP_ROWS * SMALL_X_ROW, SMALL_X_ROW);
#pragma unroll
        for (int h = 0; h < 2; h++) {
            if (BITS != 16) {
#pragma unroll
                for (int mt = 0; mt < MT; mt++) mma16816(px[mt], a[mt][h], ones);
            }
#pragma unroll
            for (int c = 0; c < NT / 2; c++) {
                u32 b[2][2];
                read_w_half<BITS>(b, w, w_row, wn * WARP_COLS + c * 16, h);
#pragma unroll
                for (int mt = 0; mt < MT; mt++)
#pragma unroll
                    for (int nt = 0; nt < 2; nt++)
                        mma16816(BITS == 16 ? acc[mt][2 * c + nt] : tq[mt][2 * c + nt], a[mt][h],
                                 b[nt]);
            }
        }
        if (BITS != 16) {
            const bool group_ends = k0 + 32 == group_end;
            if (group_ends || k0 + 32 == K || (k0 + 32) % GEMM_SEGMENT == 0) {
                const u32* words = (const u32*)(w + TILED_COLS * w_row);
#pragma unroll
                for (int c = 0; c < NT / 2; c++) {
                    float2 q[2][2];
                    words_scales(q, words, TILED_COLS, wn * WARP_COLS + c * 16, nb, sz, zeros, G,
                                 group_index);
#pragma unroll
                    for (int mt = 0; mt < MT; mt++)
#pragma unroll
                        for (int nt = 0; nt < 2; nt++)
#pragma unroll
                            for (int e = 0; e < 2; e++)
                                add_dequantized(acc[mt][2 * c + nt], tq[mt][2 * c + nt], px[mt], e,
                                                q[nt][e]);
                }
                zero_unit<MT, NT>(tq, px);
            }
            if (group_ends) {
                group_index++;
                group_end += group;
            }
        }
        const bool last = j + 1 == tiles;
        if (!last && (k0 + 32) % GEMM_SEGMENT != 0) continue;
        // A segment ends: its sums join those before it, in order from zero.
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    float* slot = before + ((mt * NT + nt) * 4 + e) * THREADS;
                    const float sum = __fadd_rn(k0 < GEMM_SEGMENT ? 0.0f : *slot, acc[mt][nt][e]);
                    acc[mt][nt][e] = 0.0f;
                    if (!last) {
                        *slot = sum;
                        continue;
                    }
                    const int m = m0 + wm * WARP_ROWS + mt * 16 + g + (e >= 2 ? 8 : 0);
                    const int n = nb + wn * WARP_COLS + nt * 8 + t * 2 + (e & 1);
                    if (m < M && n < N) {
                        const size_t at = (size_t)m * N + n;
                        out[at] = accumulate ? __fadd_rn(out[at], sum) : sum;
                    }
                }
    }
}

// Products of few rows split by segment across blocks (the shapes an engine's decode steps
// take). Block (column block, segment, row block) multiplies its 16 MT rows of X by its
// 16 * warps weight rows over one segment of K, with everything it reads copied to shared memory
// at once (cp.async; the weights before the predecessor has finished), then each warp sums its
// 16 weight rows' 32-wide K tiles straight from there, and writes the segment's sums to
// `parts[segment][row][column]`. gemm_segments_sum then adds the segments in order. No barrier
// but the one after the copies, and a block per (columns, segment, rows): the grid fills the GPU
// where the K-group kernel above gives a block per column group only.
//
// Each output takes the same operations in the same order as in the other two kernels (the
// segment's products from zero, per unit as they do; the segments' sums added in order from
// zero), so a row's result does not depend on which kernel computed it.
#define SPLIT_X_ROW (2 * GEMM_SEGMENT + 16) // bytes per row of X: a segment + 16 (ldmatrix)

// Bytes of a block's shared memory (src/backend/cuda/kernels.rs `split_gemm_smem` computes the
// same): X's rows, the weight rows' codes over the segment (rows padded by 16 bytes, 8 for INT2,
// so that the eight rows a fragment load reads fall in distinct banks), then per quantization
// group the segment meets a scale word and a zero word per weight row.
DEV int split_w_row(int bits) {
    return bits == 16 ? SPLIT_X_ROW : GEMM_SEGMENT * bits / 8 + (bits == 2 ? 8 : 16);
}

template <int BITS, int MT>
DEV void gemm_split(const f16_t* __restrict__ X, int M, int K, const u8* __restrict__ W,
                    const f16_t* __restrict__ sz, const f16_t* __restrict__ zeros, int N,
                    int group, int stream_hint, float* __restrict__ parts) {
    extern __shared__ __align__(16) u8 smem[];
    const u64 policy = l2_policy(stream_hint != 0);
    const int tid = threadIdx.x, threads = blockDim.x, warp = tid >> 5;
    const int cols = 16 * (threads / 32); // 16 weight rows per warp
    const int nb = blockIdx.x * cols, seg = blockIdx.y, m0 = blockIdx.z * 16 * MT;
    const int k_begin = seg * GEMM_SEGMENT, k_len = min(GEMM_SEGMENT, K - k_begin);
    const size_t row_bytes = (size_t)K * BITS / 8;
    const int G = BITS != 16 ? K / group : 1;
    const int w_row = split_w_row(BITS);
    const u32 xs = smem_addr(smem);
    const u32 ws = xs + 16 * MT * SPLIT_X_ROW;
    const u32 ps = ws + cols * w_row;
    // The quantization groups this segment meets: g0 .. g0 + ng - 1 (f16 weights: none read).
    const int g0 = BITS != 16 ? k_begin / group : 0;
    const int ng = BITS != 16 ? (k_begin + k_len - 1) / group - g0 + 1 : 1;

    // Weights, scales and zeros (immutable) before the predecessor has finished: 16-byte
    // pieces, 8-byte ones for INT2 (whose rows are only 8-byte aligned).
    const int piece = BITS == 2 ? 8 : 16;
    const int pieces = k_len * BITS / 8 / piece; // of a weight row in the segment
    for (int c = tid; c < cols * pieces; c += threads) {
        const int r = c / pieces, part = c % pieces, n = nb + r;
        const u8* src = W + (size_t)min(n, N - 1) * row_bytes + (size_t)k_begin * BITS / 8;
        const u32 dst = ws + r * w_row + part * piece;
        if (BITS == 2)
            cp_async8_w(dst, src + part * piece, n < N ? 8 : 0, policy);
        else
            cp_async16_w(dst, src + part * piece, n < N ? 16 : 0, policy);
    }
    for (int c = tid; BITS != 16 && c < 2 * ng * cols; c += threads) {
        const int r = c % cols, gl = (c / cols) % ng, zero = c / (cols * ng), n = nb + r;
        const f16_t* p = (zero ? zeros : sz) + (size_t)min(n, N - 1) * G + g0 + gl;
        cp_async_word(ps + c * 4, p, n < N);
    }
    kernel_start();
    const int x_chunks = k_len / 8;
    for (int c = tid; c < 16 * MT * x_chunks; c += threads) {
        const int r = c / x_chunks, part = c % x_chunks, m = m0 + r;
        const f16_t* src = X + (size_t)min(m, M - 1) * K + k_begin + part * 8;
        cp_async16(xs + r * SPLIT_X_ROW + part * 16, src, m < M ? 16 : 0);
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();

    // The words become a table of (scale, zero) pairs [group][row], in place: every thread
    // reads its (at most 4: ng <= 8 groups, 2 rows per thread) before any is written.
    float2* table = (float2*)(smem + 16 * MT * SPLIT_X_ROW + cols * w_row);
    if (BITS != 16) {
        const u32* words = (const u32*)table;
        float2 mine[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int c = tid + i * threads, r = c % cols, gl = c / cols;
            if (c < ng * cols) {
                const size_t at = (size_t)(nb + r) * G + g0 + gl;
                mine[i] = make_float2(f16_of_word(words[c], sz + at),
                                      f16_of_word(words[ng * cols + c], zeros + at));
            }
        }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < 4; i++)
            if (tid + i * threads < ng * cols) table[tid + i * threads] = mine[i];
        __syncthreads();
    }

    float acc[MT][2][4] = {}, tq[MT][2][4] = {}, px[MT][4] = {};
    int gl = 0, next_group = (g0 + 1) * group; // the tile's group, and where the next begins
    for (int k = 0; k < k_len; k += 32) {
        SmallFrags<MT> f;
        read_frags<BITS, MT>(f, xs + k * 2, SPLIT_X_ROW,
                             smem + 16 * MT * SPLIT_X_ROW + k * BITS / 8, w_row, warp * 16);
        tile_products<BITS, MT>(acc, tq, px, f);
        // A unit ends with the segment or before the next group.
        if (BITS != 16 && (k + 32 == k_len || k_begin + k + 32 == next_group)) {
            table_scales<MT>(f, table + gl * cols, warp * 16);
            flush_unit<MT>(acc, tq, px, f);
            gl++;
            next_group += group;
        }
    }

    const int n0 = nb + warp * 16;
    store_warp_tile<MT>(acc, parts + ((size_t)seg * M + m0) * N + n0, N, M - m0, N - n0);
}

// out[i] (+)= the segments' sums of element i of parts[segment][M * N], added in order from zero.
extern "C" __global__ void __launch_bounds__(256)
    gemm_segments_sum(const float* __restrict__ parts, int segments, int MN,
                      float* __restrict__ out, int accumulate) {
    kernel_start();
    const int i = blockIdx.x * 256 + threadIdx.x;
    if (i >= MN) return;
    float total = 0.0f;
    for (int s = 0; s < segments; s++) total = __fadd_rn(total, parts[(size_t)s * MN + i]);
    out[i] = accumulate ? __fadd_rn(out[i], total) : total;
}

// out[i] = f16(silu(gate) * up) for the segments' sums of element i of gate and up (each as
// gemm_segments_sum adds them, then as swiglu combines them), for a gate and up split by segment.
extern "C" __global__ void __launch_bounds__(256)
    swiglu_segments(const float* __restrict__ gate, const float* __restrict__ up, int segments,
                    int MN, f16_t* __restrict__ out) {
    kernel_start();
    const int i = blockIdx.x * 256 + threadIdx.x;
    if (i >= MN) return;
    float g = 0.0f, u = 0.0f;
    for (int s = 0; s < segments; s++) {
        g = __fadd_rn(g, gate[(size_t)s * MN + i]);
        u = __fadd_rn(u, up[(size_t)s * MN + i]);
    }
    out[i] = f32_to_f16(silu_mul(g, u));
}

// Products of many rows on Hopper (sm_90a), where wgmma feeds the tensor cores from shared
// memory at a rate mma.sync cannot reach. The weights are wgmma's A operand, from registers, and
// X its B operand, from shared memory: the codes become f16 fragments on their way from shared
// memory to the tensor cores, and no weight is ever stored as f16. A block multiplies WG_COLS
// weight rows (two warpgroups of 64) by BM rows of X over all of K. The 64-wide K tiles (X in the
// 128-byte swizzle wgmma reads, the codes, the scale and zero words of both 32-wide halves, and the
// S of the units that end in the tile) stream through a ring of WG_STAGES stages with cp.async.
//
// Every output takes the operations of the other kernels, in their order: a chain of wgmma k16
// steps gives the f32 bits of the same chain of mma.sync m16n8k16 (the same products, added in the
// same order; tests/cuda_parity.rs checks rows bit for bit across the kernels), T starts each
// unit from zero, S is computed beforehand by gemm_unit_sums with the MMAs the other kernels use,
// and the unit, segment and output additions are theirs.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define TL_WGMMA 1
#else
#define TL_WGMMA 0
#endif
#define WG_COLS 128   // weight rows per block, 64 per warpgroup
#define WG_THREADS 256
#define WG_STAGES 5
// Tiles copied ahead of the math: a stage is refilled two tiles after its wgmmas were issued,
// and each warpgroup has waited for all but its latest tile's before the barrier that precedes
// the refill.
#define WG_AHEAD (WG_STAGES - 2)

// S of every unit of K for rows of X, as the other kernels take it: for the unit that ends with
// 32-wide tile j, sums[j * ld + m] is the chain of MMAs of row m against ones over the unit's
// 16-wide halves, from zero (tiles where no unit ends are left unwritten). A warp takes 16 rows
// over one segment. grid (segments, ceil(M / 128)), 256 threads.
extern "C" __global__ void __launch_bounds__(256)
    gemm_unit_sums(const f16_t* __restrict__ X, int M, int K, int group, int ld,
                   float* __restrict__ sums) {
    kernel_start();
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int m0 = (blockIdx.y * 8 + (threadIdx.x >> 5)) * 16;
    if (m0 >= M) return;
    const int k_begin = blockIdx.x * GEMM_SEGMENT, k_end = min(K, k_begin + GEMM_SEGMENT);
    const u32 ones[2] = {0x3C003C00u, 0x3C003C00u};
    const f16_t* r0 = X + (size_t)min(m0 + g, M - 1) * K + 2 * t;
    const f16_t* r8 = X + (size_t)min(m0 + g + 8, M - 1) * K + 2 * t;
    float px[4] = {};
    for (int k = k_begin; k < k_end; k += 32) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int kh = k + 16 * h;
            const u32 a[4] = {*(const u32*)(r0 + kh), *(const u32*)(r8 + kh),
                              *(const u32*)(r0 + kh + 8), *(const u32*)(r8 + kh + 8)};
            mma16816(px, a, ones);
        }
        if (!unit_ends(k, K, group)) continue;
        float* dst = sums + (size_t)(k / 32) * ld + m0 + g;
        if (t == 0 && m0 + g < M) dst[0] = px[0];
        if (t == 0 && m0 + g + 8 < M) dst[8] = px[2];
#pragma unroll
        for (int e = 0; e < 4; e++) px[e] = 0.0f;
    }
}

#if TL_WGMMA
// Bytes per weight row of a stage: a 64-wide tile's codes (INT4 padded to 48, so that the eight
// rows of a fragment load fall in distinct banks).
DEV int wg_code_row(int bits) { return bits == 4 ? 48 : 16; }

// Bytes of one stage (src/backend/cuda/kernels.rs `wgmma_gemm_smem` computes the same), a
// multiple of 1024 so that every stage's X keeps the swizzle's alignment: X (BM rows of 128
// bytes), the codes, the scale and zero words [half][scale, zero][row], and S [half][BM].
DEV int wg_stage_bytes(int bits, int bm) {
    if (bits == 16) return bm * 128 + WG_COLS * 128; // gemm_wgmma_f16: X, then the weights
    const int bytes = bm * 128 + WG_COLS * wg_code_row(bits) + 4 * WG_COLS * 4 + 2 * bm * 4;
    return (bytes + 1023) & ~1023;
}

// The wgmma descriptor of a K-major tile in the 128-byte swizzle at shared address `addr`: rows of
// 128 bytes, groups of 8 rows 1024 bytes apart.
DEV u64 swizzled_desc(u32 addr) {
    return (u64)((addr & 0x3FFFFu) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) |
           ((u64)1 << 62);
}

DEV void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
DEV void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> DEV void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Pin accumulators in place around the asynchronous wgmmas, so that the compiler neither moves
// them nor touches them while a wgmma may still write them.
template <int R> DEV void wgmma_pin(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; i++) asm volatile("" : "+f"(d[i])::"memory");
}

// The accumulator operands of a warpgroup's wgmma of BM (64 or 128) columns: the register list
// of its PTX and the constraints that bind d[0..BM/2) to it.
#define WG_D10(i)                                                                                  \
    "%" #i "0, %" #i "1, %" #i "2, %" #i "3, %" #i "4, %" #i "5, %" #i "6, %" #i "7, %" #i "8, %" #i "9"
#define WG_D30 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, " WG_D10(1) ", " WG_D10(2)
#define WG_D32 WG_D30 ", %30, %31"
#define WG_D64 WG_D30 ", " WG_D10(3) ", " WG_D10(4) ", " WG_D10(5) ", %60, %61, %62, %63"
#define WG_F4(d, i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define WG_F16(d, i) WG_F4(d, i), WG_F4(d, i + 4), WG_F4(d, i + 8), WG_F4(d, i + 12)
#define WG_OUT32(d) WG_F16(d, 0), WG_F16(d, 16)
#define WG_OUT64(d) WG_OUT32(d), WG_F16(d, 32), WG_F16(d, 48)

// d (+)= A · B for a warpgroup: A 64 x 16 from registers (each warp's 16 rows as mma.sync's A
// fragment), B BM x 16 K-major at `desc`; d from zero when `accumulate` is 0.
template <int BM> DEV void wgmma_step(float (&d)[BM / 2], const u32 (&a)[4], u64 desc,
                                      int accumulate) {
    if constexpr (BM == 64) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %36, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {" WG_D32 "}, "
                     "{%32, %33, %34, %35}, %37, p, 1, 1, 0;\n}\n"
                     : WG_OUT32(d)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(accumulate), "l"(desc)
                     : "memory");
    } else {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %68, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {" WG_D64 "}, "
                     "{%64, %65, %66, %67}, %69, p, 1, 1, 0;\n}\n"
                     : WG_OUT64(d)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(accumulate), "l"(desc)
                     : "memory");
    }
}

// The same with A from shared memory too: A 64 x 16 at `a_desc`, K-major like B.
template <int BM> DEV void wgmma_step_ss(float (&d)[BM / 2], u64 a_desc, u64 b_desc,
                                         int accumulate) {
    if constexpr (BM == 64) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {" WG_D32 "}, "
                     "%32, %33, p, 1, 1, 0, 0;\n}\n"
                     : WG_OUT32(d)
                     : "l"(a_desc), "l"(b_desc), "r"(accumulate)
                     : "memory");
    } else {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {" WG_D64 "}, "
                     "%64, %65, p, 1, 1, 0, 0;\n}\n"
                     : WG_OUT64(d)
                     : "l"(a_desc), "l"(b_desc), "r"(accumulate)
                     : "memory");
    }
}

// Weight rows `row` and `row + 8` of a stage's codes (rows `code_row` bytes apart) at K offset
// `k` (a multiple of 16) of the tile, as mma.sync's A fragment.
template <int BITS>
DEV void read_a_frag(u32 (&a)[4], const u8* codes, int code_row, int row, int k) {
    const int t = threadIdx.x & 3;
    const u8* r0 = codes + row * code_row + k * BITS / 8;
    const u8* r8 = r0 + 8 * code_row;
    if (BITS == 4) {
        const uint2 v0 = *(const uint2*)r0, v8 = *(const uint2*)r8;
        a[0] = q4_pair(v0.x, t);
        a[1] = q4_pair(v8.x, t);
        a[2] = q4_pair(v0.y, t);
        a[3] = q4_pair(v8.y, t);
    } else {
        const u32 v0 = *(const u32*)r0, v8 = *(const u32*)r8;
        a[0] = q2_pair(v0, t);
        a[1] = q2_pair(v8, t);
        a[2] = q2_pair(v0, t + 4);
        a[3] = q2_pair(v8, t + 4);
    }
}
#endif

// A thread's copies of a block's BM rows of X into a stage, worked out once (each tile adds its
// offset): piece c (8 halves) of row r goes to piece c ^ (r % 8) of the row (the 128-byte
// swizzle wgmma reads), rows past M land as zeros.
template <int BM> struct WgXCopies {
    static constexpr int COPIES = BM * 8 / WG_THREADS; // 16-byte pieces per thread and tile
    const f16_t* src[COPIES];
    int bytes[COPIES];
    u32 dst;

    __device__ WgXCopies(const f16_t* __restrict__ X, int M, int K, int m0) {
        const int part = threadIdx.x & 7, row = threadIdx.x >> 3;
        dst = row * 128 + ((part ^ (row & 7)) << 4);
#pragma unroll
        for (int i = 0; i < COPIES; i++) {
            const int m = m0 + row + i * (WG_THREADS / 8);
            src[i] = X + (size_t)min(m, M - 1) * K + part * 8;
            bytes[i] = m < M ? 16 : 0;
        }
    }

    // The 64-wide tile j into the stage at `st`.
    __device__ void copy(u32 st, int j) const {
#pragma unroll
        for (int i = 0; i < COPIES; i++)
            cp_async16(st + dst + i * (WG_THREADS / 8) * 128, src[i] + j * 64, bytes[i]);
    }
};

// Where a thread's outputs go: its weight rows n and n + 8 of the N, its rows of X m and m + 1
// (then every 8 after them) of the M.
struct WgOutputs {
    int n, m, N, M;
};

// A segment ends: its sums `seg` join those before it (`before`, four to a slot, the slots of
// one four of all threads side by side), in order from zero, and after the last segment the
// totals are stored (added to `out` when `accumulate`).
template <int ACC>
DEV void wg_segment_ends(const float (&seg)[ACC], float4* before, bool first, bool last,
                         WgOutputs o, float* __restrict__ out, int accumulate) {
#pragma unroll
    for (int c = 0; c < ACC / 4; c++) {
        float4* slot = before + c * WG_THREADS;
        const float4 b = first ? float4{0.0f, 0.0f, 0.0f, 0.0f} : *slot;
        const float sum[4] = {__fadd_rn(b.x, seg[4 * c]), __fadd_rn(b.y, seg[4 * c + 1]),
                              __fadd_rn(b.z, seg[4 * c + 2]), __fadd_rn(b.w, seg[4 * c + 3])};
        if (!last) {
            *slot = float4{sum[0], sum[1], sum[2], sum[3]};
            continue;
        }
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int n = o.n + (e & 2 ? 8 : 0), m = o.m + 8 * c + (e & 1);
            if (m < o.M && n < o.N) {
                const size_t at = (size_t)m * o.N + n;
                out[at] = accumulate ? __fadd_rn(out[at], sum[e]) : sum[e];
            }
        }
    }
}

// Dynamic shared memory: 1024 bytes of alignment slack, the ring, then each thread's BM / 2
// sums of the segments before the current one, four to a 16-byte slot (the slots of one four
// of all threads side by side, so that a warp's loads are whole lines). `sums` holds gemm_unit_sums' S (rows `ld` apart,
// ld a multiple of 4 and at least M). The host takes this kernel only on sm_90a, for K a
// multiple of 64; elsewhere it is empty.
template <int BITS, int BM>
DEV void gemm_wgmma(const f16_t* __restrict__ X, int M, int K, const u8* __restrict__ W,
                    const f16_t* __restrict__ sz, const f16_t* __restrict__ zeros, int N,
                    int group, const float* __restrict__ sums, int ld, float* __restrict__ out,
                    int accumulate) {
#if TL_WGMMA
    constexpr int ACC = BM / 2;
    constexpr int W_PIECES = BITS * 64 / 8 / 16;  // 16-byte pieces of a weight row's tile
    extern __shared__ __align__(16) u8 smem[];
    const int tid = threadIdx.x, t = tid & 3;
    // This thread's weight rows within the block: row0 and row0 + 8 (its warpgroup's 64 rows,
    // its warp's 16 of them).
    const int row0 = (tid >> 7) * 64 + ((tid >> 5) & 3) * 16 + ((tid & 31) >> 2);
    const int m0 = blockIdx.y * BM, nb = blockIdx.x * WG_COLS;
    const u32 base = smem_addr(smem), ring = (base + 1023) & ~1023u;
    u8* const ring_ptr = smem + (ring - base);
    const int stage_bytes = wg_stage_bytes(BITS, BM), code_row = wg_code_row(BITS);
    const int codes_at = BM * 128, words_at = codes_at + WG_COLS * code_row;
    const int sums_at = words_at + 4 * WG_COLS * 4;
    float4* before = (float4*)(ring_ptr + WG_STAGES * stage_bytes) + tid; // [ACC / 4][WG_THREADS]
    const size_t row_bytes = (size_t)K * BITS / 8;
    const int G = K / group, tiles = K / 64;

    // The copies, worked out once; each tile adds its offsets. Weight rows past N repeat row
    // N - 1 and their outputs are never stored. A thread copies the scale (or zero: the second
    // 128 threads) words of one weight row for both halves of a tile, and the first BM / 2
    // threads a piece of S each.
    const WgXCopies<BM> x_copies(X, M, K, m0);
    const int w_row = tid / W_PIECES, w_part = tid % W_PIECES;
    const u8* w_src = W + (size_t)min(nb + w_row, N - 1) * row_bytes + w_part * 16;
    const u32 w_dst = codes_at + w_row * code_row + w_part * 16;
    const f16_t* p_src = (tid >= WG_COLS ? zeros : sz) + (size_t)min(nb + (tid & 127), N - 1) * G;
    const int s_half = tid / (BM / 4), s_m = m0 + (tid % (BM / 4)) * 4;
    const float* s_src = sums + (size_t)s_half * ld + min(s_m, ld - 4);
    int copy_gi = 0, copy_gend = group; // the group of the next 32-wide half to copy

    // Tile j into its stage, as one group of copies (empty past K).
    auto copy_tile = [&](int j) {
        if (j < tiles) {
            const u32 st = ring + (j % WG_STAGES) * stage_bytes;
            x_copies.copy(st, j);
            if (w_row < WG_COLS) cp_async16(st + w_dst, w_src + j * (BITS * 8), 16);
#pragma unroll
            for (int h = 0; h < 2; h++) {
                if (j * 64 + 32 * h == copy_gend) {
                    copy_gi++;
                    copy_gend += group;
                }
                cp_async_word(st + words_at + (h * 2 * WG_COLS + tid) * 4, p_src + copy_gi, true);
            }
            if (tid < BM / 2)
                cp_async16(st + sums_at + tid * 16, s_src + (size_t)(2 * j) * ld, s_m < M ? 16 : 0);
        }
        cp_async_commit();
    };
    kernel_start();
#pragma unroll
    for (int j = 0; j < WG_AHEAD; j++) copy_tile(j);

    // Which half of its word each of the thread's scales and zeros is: the parity of its
    // element, the row's part once and the group's part as the groups go by.
    const size_t at0 = (size_t)(nb + row0) * G, at8 = at0 + (size_t)8 * G;
    const int odd_s0 = ((size_t)(sz + at0) >> 1) & 1, odd_s8 = ((size_t)(sz + at8) >> 1) & 1;
    const int odd_z0 = ((size_t)(zeros + at0) >> 1) & 1, odd_z8 = ((size_t)(zeros + at8) >> 1) & 1;
    float tq[ACC], seg[ACC];
#pragma unroll
    for (int i = 0; i < ACC; i++) seg[i] = 0.0f;
    int fresh = 1;                // the next wgmma starts a unit's T from zero
    int gi = 0, gend = group;     // the group of the current half, and where the next begins
    for (int j = 0; j < tiles; j++) {
        cp_async_wait<WG_AHEAD - 1>();
        // The tile's bytes, written through the generic proxy, for wgmma's async-proxy reads.
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncthreads();
        copy_tile(j + WG_AHEAD);
        const int k0 = j * 64;
        const u32 st = ring + (j % WG_STAGES) * stage_bytes;
        const u8* st_ptr = ring_ptr + (j % WG_STAGES) * stage_bytes;
#pragma unroll
        for (int h = 0; h < 2; h++) {
#pragma unroll
            for (int kk = 0; kk < 2; kk++) {
                u32 a[4];
                read_a_frag<BITS>(a, st_ptr + codes_at, code_row, row0, 32 * h + 16 * kk);
                wgmma_fence();
                wgmma_step<BM>(tq, a, swizzled_desc(st + 64 * h + 32 * kk), !fresh);
                fresh = 0;
            }
            const int next = k0 + 32 * h + 32, odd = gi & 1;
            if (next == gend) {
                gi++;
                gend += group;
            } else if (next != K && next % GEMM_SEGMENT != 0) {
                continue;
            }
            // The unit ends: seg += s · T + z · S, per output as add_dequantized does.
            wgmma_commit();
            wgmma_wait<0>();
            wgmma_pin(tq);
            const u32* words = (const u32*)(st_ptr + words_at) + h * 2 * WG_COLS;
            const float s0 = half_of_word(words[row0], odd_s0 ^ odd);
            const float z0 = half_of_word(words[WG_COLS + row0], odd_z0 ^ odd);
            const float s8 = half_of_word(words[row0 + 8], odd_s8 ^ odd);
            const float z8 = half_of_word(words[WG_COLS + row0 + 8], odd_z8 ^ odd);
            const float* S = (const float*)(st_ptr + sums_at) + h * BM + 2 * t;
#pragma unroll
            for (int c = 0; c < ACC / 4; c++) {
                const float2 sv = *(const float2*)(S + 8 * c);
                float* d = seg + 4 * c;
                const float* q = tq + 4 * c;
                d[0] = fmaf(s0, q[0], fmaf(z0, sv.x, d[0]));
                d[1] = fmaf(s0, q[1], fmaf(z0, sv.y, d[1]));
                d[2] = fmaf(s8, q[2], fmaf(z8, sv.x, d[2]));
                d[3] = fmaf(s8, q[3], fmaf(z8, sv.y, d[3]));
            }
            fresh = 1;
        }
        wgmma_commit();
        wgmma_wait<1>();
        const bool last = j + 1 == tiles;
        if (!last && (k0 + 64) % GEMM_SEGMENT != 0) continue;
        wg_segment_ends(seg, before, k0 < GEMM_SEGMENT, last, {nb + row0, m0 + 2 * t, N, M},
                        out, accumulate);
#pragma unroll
        for (int i = 0; i < ACC; i++) seg[i] = 0.0f;
    }
    wgmma_wait<0>();
#endif
}

// gemm_wgmma for f16 weights: both operands come from shared memory, the weight rows in the
// 128-byte swizzle of X (each warpgroup's 64 rows are its A), and the k16 chain of a segment
// accumulates into the segment's sums directly, as the other kernels' f16 path does. A stage is
// BM rows of X, then the WG_COLS weight rows; the segments' sums are gemm_wgmma's.
template <int BM>
DEV void gemm_wgmma_f16(const f16_t* __restrict__ X, int M, int K, const f16_t* __restrict__ W,
                        int N, float* __restrict__ out, int accumulate) {
#if TL_WGMMA
    constexpr int ACC = BM / 2;
    extern __shared__ __align__(16) u8 smem[];
    const int tid = threadIdx.x, t = tid & 3, warpgroup = tid >> 7;
    const int row0 = warpgroup * 64 + ((tid >> 5) & 3) * 16 + ((tid & 31) >> 2);
    const int m0 = blockIdx.y * BM, nb = blockIdx.x * WG_COLS;
    const u32 base = smem_addr(smem), ring = (base + 1023) & ~1023u;
    const int stage_bytes = wg_stage_bytes(16, BM), w_at = BM * 128;
    float4* before = (float4*)(smem + (ring - base) + WG_STAGES * stage_bytes) + tid;
    const int tiles = K / 64;

    // The block's weight rows are copied as X is (rows past N land as zeros; their outputs are
    // never stored).
    const WgXCopies<BM> x_copies(X, M, K, m0);
    const WgXCopies<WG_COLS> w_copies(W + (size_t)nb * K, N - nb, K, 0);
    auto copy_tile = [&](int j) {
        if (j < tiles) {
            const u32 st = ring + (j % WG_STAGES) * stage_bytes;
            x_copies.copy(st, j);
            w_copies.copy(st + w_at, j);
        }
        cp_async_commit();
    };
    kernel_start();
#pragma unroll
    for (int j = 0; j < WG_AHEAD; j++) copy_tile(j);

    // A segment's chain starts from zero by its first wgmma (as the other kernels' MMAs add to a
    // zeroed accumulator: the sums differ at most in the sign of a zero, which the segment's
    // addition from zero removes), so that no other instruction writes the accumulators; and a
    // loop of its own, so that no path where they are still being written joins one where they
    // are read.
    float seg[ACC];
    for (int j0 = 0; j0 < tiles; j0 += GEMM_SEGMENT / 64) {
        const int j_end = min(tiles, j0 + GEMM_SEGMENT / 64);
        for (int j = j0; j < j_end; j++) {
            cp_async_wait<WG_AHEAD - 1>();
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            __syncthreads();
            copy_tile(j + WG_AHEAD);
            const u32 st = ring + (j % WG_STAGES) * stage_bytes;
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < 4; kk++)
                wgmma_step_ss<BM>(seg, swizzled_desc(st + w_at + warpgroup * 64 * 128 + 32 * kk),
                                  swizzled_desc(st + 32 * kk), j > j0 || kk > 0);
            wgmma_commit();
            wgmma_wait<1>();
        }
        wgmma_wait<0>();
        wgmma_pin(seg);
        wg_segment_ends(seg, before, j0 == 0, j_end == tiles, {nb + row0, m0 + 2 * t, N, M}, out,
                        accumulate);
    }
#endif
}

// grid (ceil(N / TILED_COLS), ceil(M / (64 WM))), 128 WM threads. `sz` holds the scales
// [N][K / group] and `zeros` the zeros (passed apart so that a launch can cover a range of a
// weight's rows).
#define GEMM_TILED_KERNEL(B, WM)                                                                   \
    extern "C" __global__ void __launch_bounds__(128 * WM, 1)                                      \
        gemm_tiled_b##B##_w##WM(const f16_t* X, int M, int K, const u8* W, const f16_t* sz,        \
                                const f16_t* zeros, int N, int group, int stream, float* out,      \
                                int accumulate) {                                                  \
        gemm_tiled<B, WM>(X, M, K, W, sz, zeros, N, group, stream, out, accumulate);               \
    }

// grid (ceil(N / (16 col_groups)), ceil(M / (16 MT))), 32 SMALL_WARPS threads; the arguments
// of gemm_tiled_b*, then col_groups (1, 2, 4 or 8, with MT * col_groups <= SMALL_OUTS). Two blocks a
// SM where one or two row tiles leave the registers for it.
#define GEMM_SMALL_KERNEL(B, MT, MIN_BLOCKS)                                                       \
    extern "C" __global__ void __launch_bounds__(32 * SMALL_WARPS, MIN_BLOCKS)                     \
        gemm_small_b##B##_m##MT(const f16_t* X, int M, int K, const u8* W, const f16_t* sz,        \
                                const f16_t* zeros, int N, int group, int stream, float* out,      \
                                int accumulate, int col_groups) {                                  \
        gemm_small<B, MT>(X, M, K, W, sz, zeros, N, group, stream, out, accumulate, col_groups);   \
    }

// Blocks of 8 warps an SM keeps: four up to two row tiles (64 registers), two for four (128), so
// that the 512 blocks of an engine's wide products at 32 rows run in one wave.
#define SPLIT_BLOCKS(MT) ((MT) <= 2 ? 4 : 2)

// grid (ceil(N / (16 warps)), segments, ceil(M / (16 MT))), 32 warps threads (warps 4 or 8);
// the arguments of gemm_tiled_b* up to `stream`, then the segments' partial sums.
#define GEMM_SPLIT_KERNEL(B, MT)                                                                   \
    extern "C" __global__ void __launch_bounds__(256, SPLIT_BLOCKS(MT))                            \
        gemm_split_b##B##_m##MT(const f16_t* X, int M, int K, const u8* W, const f16_t* sz,        \
                                const f16_t* zeros, int N, int group, int stream, float* parts) {  \
        gemm_split<B, MT>(X, M, K, W, sz, zeros, N, group, stream, parts);                         \
    }

// grid (ceil(N / WG_COLS), ceil(M / BM)), WG_THREADS threads; the arguments of gemm_tiled_b* up
// to `group`, then gemm_unit_sums' S and its row stride, `out` and `accumulate`.
#define GEMM_WGMMA_KERNEL(B, BM)                                                                   \
    extern "C" __global__ void __launch_bounds__(WG_THREADS, 1)                                    \
        gemm_wgmma_b##B##_m##BM(const f16_t* X, int M, int K, const u8* W, const f16_t* sz,        \
                                const f16_t* zeros, int N, int group, const float* sums, int ld,  \
                                float* out, int accumulate) {                                      \
        if constexpr (B == 16)                                                                     \
            gemm_wgmma_f16<BM>(X, M, K, (const f16_t*)W, N, out, accumulate);                      \
        else                                                                                       \
            gemm_wgmma<B, BM>(X, M, K, W, sz, zeros, N, group, sums, ld, out, accumulate);         \
    }

GEMM_TILED_KERNEL(16, 1)
GEMM_TILED_KERNEL(16, 2)
GEMM_TILED_KERNEL(4, 1)
GEMM_TILED_KERNEL(4, 2)
GEMM_TILED_KERNEL(2, 1)
GEMM_TILED_KERNEL(2, 2)
GEMM_SMALL_KERNEL(16, 1, 2)
GEMM_SMALL_KERNEL(16, 2, 2)
GEMM_SMALL_KERNEL(16, 4, 1)
GEMM_SMALL_KERNEL(4, 1, 2)
GEMM_SMALL_KERNEL(4, 2, 2)
GEMM_SMALL_KERNEL(4, 4, 1)
GEMM_SMALL_KERNEL(2, 1, 2)
GEMM_SMALL_KERNEL(2, 2, 2)
GEMM_SMALL_KERNEL(2, 4, 1)
GEMM_SPLIT_KERNEL(16, 1)
GEMM_SPLIT_KERNEL(16, 2)
GEMM_SPLIT_KERNEL(16, 4)
GEMM_SPLIT_KERNEL(4, 1)
GEMM_SPLIT_KERNEL(4, 2)
GEMM_SPLIT_KERNEL(4, 4)
GEMM_SPLIT_KERNEL(2, 1)
GEMM_SPLIT_KERNEL(2, 2)
GEMM_SPLIT_KERNEL(2, 4)
GEMM_WGMMA_KERNEL(4, 64)
GEMM_WGMMA_KERNEL(4, 128)
GEMM_WGMMA_KERNEL(2, 64)
GEMM_WGMMA_KERNEL(2, 128)
GEMM_WGMMA_KERNEL(16, 64)
GEMM_WGMMA_KERNEL(16, 128)
