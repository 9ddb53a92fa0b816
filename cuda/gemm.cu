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

    float acc[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.0f;

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
                    out[o] = accumulate ? __fadd_rn(out[o], acc[mt][nt][e]) : acc[mt][nt][e];
                }
            }
        }
    }
}

// Products of at most 16 rows (a speculative verify pass, a short prompt). There the 64 x 64
// kernel is bound by latency, not by bytes: it keeps one K tile per block in flight and, for
// N = 2048, runs 32 blocks. This one takes one 16-row MMA tile of X and 16 weight rows per block
// (8 per warp), and streams both through a SMALL_STAGES-deep cp.async pipeline of K slices, the
// weights' first slices requested before the predecessor kernel finishes.
//
// Every output takes the operations of the 64 x 64 kernel in the same order (per 32-wide K tile:
// two MMAs from zero for T, the same two against ones for S, then add_dequantized), so a row's
// result does not depend on which of the two computed it.
#define SMALL_ROWS 16
#define SMALL_COLS 16 // 2 warps of 8
#define SMALL_STAGES 4

template <int BITS> struct SmallTile {
    static constexpr int KS = BITS == 16 ? 128 : 256;    // K per stage
    static constexpr int XROW = KS * 2 + 16;             // bytes per staged X row, padded so
    static constexpr int WROW = KS * BITS / 8 + 16;      // fragment loads avoid bank conflicts
    static constexpr int WCHUNK = BITS == 2 ? 8 : 16;    // INT2 rows are only 8-byte aligned
    static constexpr int X_BYTES = SMALL_ROWS * XROW;
    static constexpr int STAGE = X_BYTES + SMALL_COLS * WROW;
};

template <int BITS>
DEV void gemm_small(const f16_t* __restrict__ X, int M, int K, const u8* __restrict__ W,
                    const f16_t* __restrict__ sz, const f16_t* __restrict__ zeros, int N,
                    int group, int stream_hint, float* __restrict__ out, int accumulate) {
    using T = SmallTile<BITS>;
    __shared__ __align__(16) u8 stages[SMALL_STAGES][T::STAGE];
    const bool Q = BITS != 16;
    const u64 policy = l2_policy(stream_hint != 0);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int m0 = blockIdx.y * SMALL_ROWS, n0 = blockIdx.x * SMALL_COLS;
    const size_t row_bytes = (size_t)K * BITS / 8;
    const int G = Q ? K / group : 1;
    const int slices = (K + T::KS - 1) / T::KS;
    const u32 base = smem_addr(stages);
    const u32 ones[2] = {0x3C003C00u, 0x3C003C00u};

    // Slice s of the weights and of X into stage s % SMALL_STAGES; chunks past K, N or M read
    // nothing and land as zeros.
    auto copy_weights = [&](int s) {
        const u32 dst = base + (s % SMALL_STAGES) * T::STAGE + T::X_BYTES;
        const int per_row = T::KS * BITS / 8 / T::WCHUNK;
        for (int c = tid; c < SMALL_COLS * per_row; c += blockDim.x) {
            const int r = c / per_row, part = c - r * per_row;
            const size_t at = (size_t)s * T::KS * BITS / 8 + (size_t)part * T::WCHUNK;
            const bool in = n0 + r < N && at < row_bytes;
            const u8* src = in ? W + (size_t)(n0 + r) * row_bytes + at : W;
            const u32 d = dst + r * T::WROW + part * T::WCHUNK;
            if (T::WCHUNK == 16) {
                cp_async16_w(d, src, in ? 16 : 0, policy);
            } else {
                cp_async8_w(d, src, in ? 8 : 0, policy);
            }
        }
    };
    auto copy_x = [&](int s) {
        const u32 dst = base + (s % SMALL_STAGES) * T::STAGE;
        const int per_row = T::KS * 2 / 16;
        for (int c = tid; c < SMALL_ROWS * per_row; c += blockDim.x) {
            const int r = c / per_row, part = c - r * per_row;
            const int k = s * T::KS + part * 8;
            const bool in = m0 + r < M && k < K;
            const f16_t* src = in ? X + (size_t)(m0 + r) * K + k : X;
            cp_async16(dst + r * T::XROW + part * 16, src, in ? 16 : 0);
        }
    };

    // The first slices' weights are requested before the predecessor has finished (they are
    // immutable); each group from then on holds one slice of X, the first also these weights.
    for (int s = 0; s < SMALL_STAGES - 1 && s < slices; s++) copy_weights(s);
    kernel_start();
    for (int s = 0; s < SMALL_STAGES - 1; s++) {
        if (s < slices) copy_x(s);
        cp_async_commit();
    }

    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const int col = warp * 8 + g; // this thread's weight row within the block, for B fragments
    for (int s = 0; s < slices; s++) {
        cp_async_wait<SMALL_STAGES - 2>();
        __syncthreads();
        // Refill the stage every thread finished with in the previous iteration.
        const int next = s + SMALL_STAGES - 1;
        if (next < slices) {
            copy_weights(next);
            copy_x(next);
        }
        cp_async_commit();

        const u8* stage = stages[s % SMALL_STAGES];
        const u8* xg = stage + g * T::XROW;
        const u8* xg8 = stage + (g + 8) * T::XROW;
        const u8* wrow = stage + T::X_BYTES + col * T::WROW;
        const int tiles = min(T::KS, K - s * T::KS) / 32;
        for (int j = 0; j < tiles; j++) {
            // This 32-wide tile's weight pairs k = 2p, 2p + 1 for p = t, t + 4, t + 8, t + 12,
            // as the 64 x 64 kernel's B fragments hold them.
            u32 b[2][2];
            if (BITS == 4) {
                const uint4 w = *(const uint4*)(wrow + j * 16);
                b[0][0] = q4_pair(w.x, t);
                b[0][1] = q4_pair(w.y, t);
                b[1][0] = q4_pair(w.z, t);
                b[1][1] = q4_pair(w.w, t);
            } else if (BITS == 2) {
                const uint2 w = *(const uint2*)(wrow + j * 8);
                b[0][0] = q2_pair(w.x, t);
                b[0][1] = q2_pair(w.x, t + 4);
                b[1][0] = q2_pair(w.y, t);
                b[1][1] = q2_pair(w.y, t + 4);
            } else {
                const u32* w = (const u32*)(wrow + j * 64);
                b[0][0] = w[t];
                b[0][1] = w[t + 4];
                b[1][0] = w[t + 8];
                b[1][1] = w[t + 12];
            }
            float tq[4] = {0.0f, 0.0f, 0.0f, 0.0f}, px[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int k = (j * 32 + h * 16 + 2 * t) * 2; // byte offset of k = 2t in the row
                const u32 a[4] = {*(const u32*)(xg + k), *(const u32*)(xg8 + k),
                                  *(const u32*)(xg + k + 16), *(const u32*)(xg8 + k + 16)};
                mma16816(Q ? tq : acc, a, b[h]);
                if (Q) mma16816(px, a, ones);
            }
            if (Q) {
                const int gi = (s * T::KS + j * 32) / group;
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int n = n0 + warp * 8 + t * 2 + e;
                    add_dequantized(acc, tq, px, e, scale_zero(sz, zeros, n, N, G, gi));
                }
            }
        }
    }
    cp_async_wait<0>();

#pragma unroll
    for (int e = 0; e < 4; e++) {
        const int m = m0 + g + (e >= 2 ? 8 : 0);
        const int n = n0 + warp * 8 + t * 2 + (e & 1);
        if (m < M && n < N) {
            const size_t o = (size_t)m * N + n;
            out[o] = accumulate ? __fadd_rn(out[o], acc[e]) : acc[e];
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

// grid (ceil(N / 16), ceil(M / 16)), 64 threads; the arguments of gemm_b*.
#define GEMM_SMALL_KERNEL(B)                                                                       \
    extern "C" __global__ void __launch_bounds__(64)                                               \
        gemm_small_b##B(const f16_t* X, int M, int K, const u8* W, const f16_t* sz,                \
                        const f16_t* zeros, int N, int group, int stream, float* out,              \
                        int accumulate) {                                                          \
        gemm_small<B>(X, M, K, W, sz, zeros, N, group, stream, out, accumulate);                   \
    }

GEMM_KERNEL(16)
GEMM_KERNEL(4)
GEMM_KERNEL(2)
GEMM_SMALL_KERNEL(16)
GEMM_SMALL_KERNEL(4)
GEMM_SMALL_KERNEL(2)
