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
                    float s = 0.0f, z = 0.0f;
                    if (n < N) {
                        s = f16_to_f32(__ldg(sz + (size_t)n * G + gi));
                        z = f16_to_f32(__ldg(zeros + (size_t)n * G + gi));
                    }
#pragma unroll
                    for (int mt = 0; mt < 2; mt++) {
                        acc[mt][nt][e] = fmaf(s, tq[mt][nt][e], fmaf(z, px[mt][0], acc[mt][nt][e]));
                        acc[mt][nt][e + 2] =
                            fmaf(s, tq[mt][nt][e + 2], fmaf(z, px[mt][2], acc[mt][nt][e + 2]));
                    }
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

// grid (ceil(N / 64), ceil(M / 64)), 128 threads. `sz` holds the scales [N][K / group] and
// `zeros` the zeros (passed apart so that a launch can cover a range of a weight's rows).
#define GEMM_KERNEL(B)                                                                             \
    extern "C" __global__ void __launch_bounds__(128)                                              \
        gemm_b##B(const f16_t* X, int M, int K, const u8* W, const f16_t* sz, const f16_t* zeros,  \
                  int N, int group, int stream, float* out, int accumulate) {                      \
        gemm<B>(X, M, K, W, sz, zeros, N, group, stream, out, accumulate);                         \
    }

GEMM_KERNEL(16)
GEMM_KERNEL(4)
GEMM_KERNEL(2)
