// Matrix-matrix products for prefill: out[m, n] (+)= sum_k X[m, k] * W[n, k], on the tensor cores
// (mma.sync m16n8k16, f16 inputs, f32 accumulation; sm_80 and later).
//
// Quantized weights enter the tensor cores as their integer codes, which f16 holds exactly, so
// each 32-wide K tile (inside one quantization group: the host requires group % 32 == 0) gives
//     T[m, n] = sum_k q[n, k] X[m, k]   and   S[m] = sum_k X[m, k]   (an mma against ones),
// both exact products accumulated in f32, and the tile adds s[n, g] * T + z[n, g] * S: the
// contract's f32 dequantize-and-accumulate, up to the order of f32 additions. No weight is ever
// rounded to f16.
//
// Block tile 64 x 64, K tile 32, 4 warps of 32 x 32; shared-memory rows padded by 16 bytes so the
// fragment loads are free of bank conflicts; the next tile's global loads overlap the current
// tile's math.
#include "common.cuh"

#define BM 64
#define BN 64
#define BK 32
#define SROW (BK / 2 + 4) // u32 words per shared row: 16 (32 halves) + 4 padding
// Both kernels sum K in segments of this many: each segment's products from zero, then the
// segments' sums in order. The small-M kernel computes the segments in parallel; the order of
// additions is the same.
#define GEMM_SEGMENT 256

// (1024 + c0, 1024 + c1) as f16x2 minus (1024, 1024): the codes as exact f16 values.
DEV u32 codes_to_f16x2(u32 pair) {
    u32 r;
    asm("sub.f16x2 %0, %1, %2;" : "=r"(r) : "r"(pair | 0x64006400u), "r"(0x64006400u));
    return r;
}

// Codes 2p and 2p+1 of a word of 8 int4 codes, as f16x2.
DEV u32 q4_pair(u32 w, int p) {
    const u32 y = w >> (8 * p);
    return codes_to_f16x2((y & 0xFu) | ((y & 0xF0u) << 12));
}

// Codes 2p and 2p+1 of a word of 16 int2 codes, as f16x2.
DEV u32 q2_pair(u32 w, int p) {
    const u32 y = w >> (4 * p);
    return codes_to_f16x2((y & 0x3u) | ((y & 0xCu) << 14));
}

// A quantized product's step per 32-wide K tile, shared by both GEMM kernels so that a row's
// result does not depend on which of them computed it: output column n's scale and zero for
// the tile (zero past N), then acc += s * T + z * S for rows g and g + 8 of an MMA tile (T in
// tq[e], tq[e + 2] and S in px[0], px[2], as mma16816 leaves them).
DEV float2 scale_zero(const f16_t* __restrict__ sz, const f16_t* __restrict__ zeros, int n,
                      int N, int G, int gi) {
    if (n >= N) return make_float2(0.0f, 0.0f);
    return make_float2(f16_to_f32(__ldg(sz + (size_t)n * G + gi)),
                       f16_to_f32(__ldg(zeros + (size_t)n * G + gi)));
}

DEV void add_dequantized(float* acc, const float* tq, const float* px, int e, float2 sz) {
    acc[e] = fmaf(sz.x, tq[e], fmaf(sz.y, px[0], acc[e]));
    acc[e + 2] = fmaf(sz.x, tq[e + 2], fmaf(sz.y, px[2], acc[e + 2]));
}

template <int BITS>
DEV void gemm(const f16_t* __restrict__ X, int M, int K, const u8* __restrict__ W,
              const f16_t* __restrict__ sz, const f16_t* __restrict__ zeros, int N, int group,
              int stream_hint, float* __restrict__ out, int accumulate) {
    __shared__ __align__(16) u32 As[BM][SROW];
    __shared__ __align__(16) u32 Bs[BN][SROW];
    kernel_start();
    const bool Q = BITS != 16;
    const u64 policy = l2_policy(stream_hint != 0);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp >> 1, wn = warp & 1;
    const int g = lane >> 2, t = lane & 3;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const size_t row_bytes = (size_t)K * BITS / 8;
    const int G = Q ? K / group : 1;
    const u32 ones[2] = {0x3C003C00u, 0x3C003C00u};

    float acc[2][4][4] = {};   // the current segment
    float total[2][4][4] = {}; // the segments before it

    // Software pipeline: the next K tile's global loads are in flight (in registers) while the
    // tensor cores work on the current tile in shared memory.
    const int brow = tid >> 1, bhalf = tid & 1;
    const int bn = n0 + brow;
    uint4 ra[2];
    uint4 rb[2];
    auto load_tile = [&](int k0) {
#pragma unroll
        for (int c2 = 0; c2 < 2; c2++) {
            const int c = tid + c2 * 128;
            const int row = c >> 2, part = c & 3;
            ra[c2] = make_uint4(0u, 0u, 0u, 0u);
            if (m0 + row < M) ra[c2] = *(const uint4*)(X + (size_t)(m0 + row) * K + k0 + part * 8);
        }
        rb[0] = rb[1] = make_uint4(0u, 0u, 0u, 0u);
        if (bn < N) {
            const u8* src = W + (size_t)bn * row_bytes;
            if (BITS == 16) {
                const u8* p = src + (size_t)k0 * 2 + bhalf * 32;
                rb[0] = ld_w16(p, policy);
                rb[1] = ld_w16(p + 16, policy);
            } else if (BITS == 4) {
                const uint2 w = ld_w8(src + k0 / 2 + bhalf * 8, policy);
                rb[0].x = w.x;
                rb[0].y = w.y;
            } else {
                rb[0].x = ld_w4(src + k0 / 4 + bhalf * 4, policy);
            }
        }
    };
    auto store_tile = [&]() {
#pragma unroll
        for (int c2 = 0; c2 < 2; c2++) {
            const int c = tid + c2 * 128;
            *(uint4*)&As[c >> 2][(c & 3) * 4] = ra[c2];
        }
        uint4 lo = rb[0], hi = rb[1];
        if (BITS == 4) {
            const u32 x = rb[0].x, y = rb[0].y;
            lo = make_uint4(q4_pair(x, 0), q4_pair(x, 1), q4_pair(x, 2), q4_pair(x, 3));
            hi = make_uint4(q4_pair(y, 0), q4_pair(y, 1), q4_pair(y, 2), q4_pair(y, 3));
        } else if (BITS == 2) {
            const u32 x = rb[0].x;
            lo = make_uint4(q2_pair(x, 0), q2_pair(x, 1), q2_pair(x, 2), q2_pair(x, 3));
            hi = make_uint4(q2_pair(x, 4), q2_pair(x, 5), q2_pair(x, 6), q2_pair(x, 7));
        }
        *(uint4*)&Bs[brow][bhalf * 8] = lo;
        *(uint4*)&Bs[brow][bhalf * 8 + 4] = hi;
    };

    load_tile(0);
    store_tile();
    __syncthreads();
    for (int k0 = 0; k0 < K; k0 += BK) {
        const bool more = k0 + BK < K;
        if (more) load_tile(k0 + BK);
        float tq[2][4][4], px[2][4];
        if (Q) {
#pragma unroll
            for (int i = 0; i < 2; i++) {
#pragma unroll
                for (int e = 0; e < 4; e++) px[i][e] = 0.0f;
#pragma unroll
                for (int j = 0; j < 4; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++) tq[i][j][e] = 0.0f;
            }
        }
#pragma unroll
        for (int ks = 0; ks < BK / 2; ks += 8) {
            u32 a[2][4], b[4][2];
#pragma unroll
            for (int mt = 0; mt < 2; mt++) {
                const int rb = wm * 32 + mt * 16;
                a[mt][0] = As[rb + g][ks + t];
                a[mt][1] = As[rb + g + 8][ks + t];
                a[mt][2] = As[rb + g][ks + t + 4];
                a[mt][3] = As[rb + g + 8][ks + t + 4];
            }
#pragma unroll
            for (int nt = 0; nt < 4; nt++) {
                const int cb = wn * 32 + nt * 8;
                b[nt][0] = Bs[cb + g][ks + t];
                b[nt][1] = Bs[cb + g][ks + t + 4];
            }
#pragma unroll
            for (int mt = 0; mt < 2; mt++) {
#pragma unroll
                for (int nt = 0; nt < 4; nt++) mma16816(Q ? tq[mt][nt] : acc[mt][nt], a[mt], b[nt]);
                if (Q) mma16816(px[mt], a[mt], ones);
            }
        }
        if (Q) {
            const int gi = k0 / group;
#pragma unroll
            for (int nt = 0; nt < 4; nt++) {
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int n = n0 + wn * 32 + nt * 8 + t * 2 + e;
                    const float2 q = scale_zero(sz, zeros, n, N, G, gi);
#pragma unroll
                    for (int mt = 0; mt < 2; mt++)
                        add_dequantized(acc[mt][nt], tq[mt][nt], px[mt], e, q);
                }
            }
        }
        if ((k0 + BK) % GEMM_SEGMENT == 0 || !more) {
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
#pragma unroll
                for (int nt = 0; nt < 4; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        total[mt][nt][e] = __fadd_rn(total[mt][nt][e], acc[mt][nt][e]);
                        acc[mt][nt][e] = 0.0f;
                    }
        }
        __syncthreads();
        if (more) {
            store_tile();
            __syncthreads();
        }
    }

#pragma unroll
    for (int mt = 0; mt < 2; mt++) {
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int m = m0 + wm * 32 + mt * 16 + g + (e >= 2 ? 8 : 0);
                const int n = n0 + wn * 32 + nt * 8 + t * 2 + (e & 1);
                if (m < M && n < N) {
                    const size_t o = (size_t)m * N + n;
                    out[o] = accumulate ? __fadd_rn(out[o], total[mt][nt][e]) : total[mt][nt][e];
                }
            }
        }
    }
}

// Products of few rows (decode rows of a batch, a speculative verify pass, a short prompt).
// There the 64 x 64 kernel is bound by latency, not by bytes: each block walks the whole of K one
// tile after the other, and for N = 2048 only 32 blocks run. This one splits K among the warps
// of a block: its SMALL_WARPS warps form `col_groups` groups of 16 weight rows (one per warp)
// times SMALL_WARPS / col_groups K groups; each K group takes one segment at a time (in waves when
// K has more), over up to 16 * MT rows of X (MT MMA tiles). A warp loads its fragments straight
// from global memory one tile ahead of the math (the warps of a K group read the same X, which
// L1 then serves) and leaves the segment's partial sums in shared memory, where they are added
// in segment order. More column groups read X less often per weight byte; fewer give more
// blocks: the host picks per shape.
//
// Every output takes the operations of the 64 x 64 kernel in the same order (per segment, from
// zero: per 32-wide K tile, two MMAs from zero for T, the same two against ones for S, then
// add_dequantized; the segments' sums added in order), so a row's result does not depend on which
// kernel, which MT or which column grouping computed it.
#define SMALL_WARPS 8 // warps per block
#define SMALL_OUTS 8  // outputs per thread in the final sums: MT * col_groups <= 8

// One warp's fragments of a 32-wide K tile: weights of its 2 column tiles (as f16x2 codes, or
// f16 values), their scales and zeros, and X of its MT row tiles.
template <int MT> struct SmallFrags {
    u32 b[2][2][2]; // [column tile][16-wide half][fragment word]
    float2 sz[2][2]; // [column tile][column pair element]
    u32 a[MT][2][4]; // [row tile][16-wide half][fragment word]
};

template <int BITS, int MT>
DEV void small_load_weights(SmallFrags<MT>& f, const u8* __restrict__ W,
                            const f16_t* __restrict__ sz, const f16_t* __restrict__ zeros, int N,
                            int G, int group, size_t row_bytes, int n0, int k0, u64 policy) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int nt = 0; nt < 2; nt++) {
        const int n = n0 + nt * 8 + g;
        const u8* row = W + (size_t)min(n, N - 1) * row_bytes;
        if (BITS == 4) {
            const uint4 w = ld_w16(row + k0 / 2, policy);
            f.b[nt][0][0] = q4_pair(w.x, t);
            f.b[nt][0][1] = q4_pair(w.y, t);
            f.b[nt][1][0] = q4_pair(w.z, t);
            f.b[nt][1][1] = q4_pair(w.w, t);
        } else if (BITS == 2) {
            const uint2 w = ld_w8(row + k0 / 4, policy);
            f.b[nt][0][0] = q2_pair(w.x, t);
            f.b[nt][0][1] = q2_pair(w.x, t + 4);
            f.b[nt][1][0] = q2_pair(w.y, t);
            f.b[nt][1][1] = q2_pair(w.y, t + 4);
        } else {
            const u8* p = row + (size_t)k0 * 2 + t * 4;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                f.b[nt][h][0] = ld_w4(p + h * 32, policy);
                f.b[nt][h][1] = ld_w4(p + h * 32 + 16, policy);
            }
        }
        // Rows past N are computed from row N - 1 and never stored.
        if (BITS != 16) {
#pragma unroll
            for (int e = 0; e < 2; e++)
                f.sz[nt][e] = scale_zero(sz, zeros, n0 + nt * 8 + t * 2 + e, N, G, k0 / group);
        }
    }
}

template <int MT>
DEV void small_load_x(SmallFrags<MT>& f, const f16_t* __restrict__ X, int M, int K, int m0,
                      int k0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        const int r0 = m0 + mt * 16 + g, r1 = r0 + 8;
        const u32* x0 = (const u32*)(X + (size_t)r0 * K + k0) + t;
        const u32* x1 = (const u32*)(X + (size_t)r1 * K + k0) + t;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            f.a[mt][h][0] = r0 < M ? x0[h * 8] : 0u;
            f.a[mt][h][1] = r1 < M ? x1[h * 8] : 0u;
            f.a[mt][h][2] = r0 < M ? x0[h * 8 + 4] : 0u;
            f.a[mt][h][3] = r1 < M ? x1[h * 8 + 4] : 0u;
        }
    }
}

// acc += this tile's contribution, as the 64 x 64 kernel adds it.
template <int BITS, int MT>
DEV void small_tile(float (&acc)[MT][2][4], const SmallFrags<MT>& f) {
    const u32 ones[2] = {0x3C003C00u, 0x3C003C00u};
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        if (BITS == 16) {
#pragma unroll
            for (int h = 0; h < 2; h++)
#pragma unroll
                for (int nt = 0; nt < 2; nt++) mma16816(acc[mt][nt], f.a[mt][h], f.b[nt][h]);
            continue;
        }
        float tq[2][4] = {}, px[4] = {};
#pragma unroll
        for (int h = 0; h < 2; h++) {
#pragma unroll
            for (int nt = 0; nt < 2; nt++) mma16816(tq[nt], f.a[mt][h], f.b[nt][h]);
            mma16816(px, f.a[mt][h], ones);
        }
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int e = 0; e < 2; e++) add_dequantized(acc[mt][nt], tq[nt], px, e, f.sz[nt][e]);
    }
}

template <int BITS, int MT>
DEV void gemm_small(const f16_t* __restrict__ X, int M, int K, const u8* __restrict__ W,
                    const f16_t* __restrict__ sz, const f16_t* __restrict__ zeros, int N,
                    int group, int stream_hint, float* __restrict__ out, int accumulate,
                    int col_groups) {
    // Partial sums of one wave: [K group][row][column] over the block's 16 MT x 16 col_groups.
    __shared__ float partial[SMALL_WARPS * 16 * MT * 16];
    const u64 policy = l2_policy(stream_hint != 0);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int cols = 16 * col_groups, k_groups = SMALL_WARPS / col_groups;
    const int cg = warp % col_groups, kg = warp / col_groups;
    const int m0 = blockIdx.y * 16 * MT, nb = blockIdx.x * cols, n0 = nb + cg * 16;
    const int outs = 16 * MT * cols;
    const size_t row_bytes = (size_t)K * BITS / 8;
    const int G = BITS != 16 ? K / group : 1;
    const int segments = (K + GEMM_SEGMENT - 1) / GEMM_SEGMENT;

    // The first tile's weights are requested before the predecessor has finished (they are
    // immutable).
    SmallFrags<MT> next;
    if (kg < segments)
        small_load_weights<BITS, MT>(next, W, sz, zeros, N, G, group, row_bytes, n0,
                                     kg * GEMM_SEGMENT, policy);
    kernel_start();

    float total[SMALL_OUTS] = {}; // outputs tid + 256 i of the block, in (row, column) order
    for (int first = 0; first < segments; first += k_groups) {
        const int seg = first + kg;
        if (seg < segments) {
            const int k_begin = seg * GEMM_SEGMENT, k_end = min(K, k_begin + GEMM_SEGMENT);
            if (first > 0)
                small_load_weights<BITS, MT>(next, W, sz, zeros, N, G, group, row_bytes, n0,
                                             k_begin, policy);
            small_load_x<MT>(next, X, M, K, m0, k_begin);
            float acc[MT][2][4] = {};
            for (int k0 = k_begin; k0 < k_end; k0 += 32) {
                const SmallFrags<MT> cur = next;
                if (k0 + 32 < k_end) {
                    small_load_weights<BITS, MT>(next, W, sz, zeros, N, G, group, row_bytes, n0,
                                                 k0 + 32, policy);
                    small_load_x<MT>(next, X, M, K, m0, k0 + 32);
                }
                small_tile<BITS, MT>(acc, cur);
            }
            float* mine = partial + kg * outs + cg * 16;
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int nt = 0; nt < 2; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int m = mt * 16 + g + (e >= 2 ? 8 : 0);
                        mine[m * cols + nt * 8 + t * 2 + (e & 1)] = acc[mt][nt][e];
                    }
        }
        __syncthreads();
        const int here = min(k_groups, segments - first);
#pragma unroll
        for (int i = 0; i < SMALL_OUTS; i++) {
            const int o = tid + 256 * i;
            if (o < outs)
                for (int w = 0; w < here; w++)
                    total[i] = __fadd_rn(total[i], partial[w * outs + o]);
        }
        __syncthreads();
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

// grid (ceil(N / 64), ceil(M / 64)), 128 threads. `sz` holds the scales [N][K / group] and
// `zeros` the zeros (passed apart so that a launch can cover a range of a weight's rows).
#define GEMM_KERNEL(B)                                                                             \
    extern "C" __global__ void __launch_bounds__(128)                                              \
        gemm_b##B(const f16_t* X, int M, int K, const u8* W, const f16_t* sz, const f16_t* zeros,  \
                  int N, int group, int stream, float* out, int accumulate) {                      \
        gemm<B>(X, M, K, W, sz, zeros, N, group, stream, out, accumulate);                         \
    }

// grid (ceil(N / (16 col_groups)), ceil(M / (16 MT))), 32 SMALL_WARPS threads; the arguments
// of gemm_b*, then col_groups (1, 2 or 4, with MT * col_groups <= SMALL_OUTS). Two blocks a
// SM where one or two row tiles leave the registers for it.
#define GEMM_SMALL_KERNEL(B, MT, MIN_BLOCKS)                                                       \
    extern "C" __global__ void __launch_bounds__(32 * SMALL_WARPS, MIN_BLOCKS)                     \
        gemm_small_b##B##_m##MT(const f16_t* X, int M, int K, const u8* W, const f16_t* sz,        \
                                const f16_t* zeros, int N, int group, int stream, float* out,      \
                                int accumulate, int col_groups) {                                  \
        gemm_small<B, MT>(X, M, K, W, sz, zeros, N, group, stream, out, accumulate, col_groups);   \
    }

GEMM_KERNEL(16)
GEMM_KERNEL(4)
GEMM_KERNEL(2)
GEMM_SMALL_KERNEL(16, 1, 2)
GEMM_SMALL_KERNEL(16, 2, 2)
GEMM_SMALL_KERNEL(16, 4, 1)
GEMM_SMALL_KERNEL(4, 1, 2)
GEMM_SMALL_KERNEL(4, 2, 2)
GEMM_SMALL_KERNEL(4, 4, 1)
GEMM_SMALL_KERNEL(2, 1, 2)
GEMM_SMALL_KERNEL(2, 2, 2)
GEMM_SMALL_KERNEL(2, 4, 1)
