// Causal attention of a multi-row step over f16 K and V (the fp16 KV mode), on the tensor cores.
//
// grid (query tiles, n_heads), FA_THREADS threads; each warp owns 16 query rows of the block's
// FA_BQ. Row r (position start_pos + r) attends to positions 0..start_pos + r. Key tiles start at
// multiples of FA_BK from position 0, whatever the step's start, so a row's sums run over the same
// tiles in the same order however the prompt was chunked: tiles past a row's position are masked
// entirely and leave its state unchanged (max unchanged, correction exp(0) = 1, p = 0).
//
// Per key tile: S = Q·Kᵀ (q rounded to f16, f32 accumulation), scaled in f32; an online softmax
// in f32 (running max and sum of the f32 p per row); p rounded to f16 for P·V (f32
// accumulation); the output divided by the sum and rounded to f16 once (docs/FORMAT.md
// "Numerics"). Positions past the step's last row are zero in shared memory, so stale cache
// entries never reach a product.
#include "common.cuh"

#define FA_BQ 64 // query rows per block
#define FA_BK 64 // positions per key tile
#define FA_THREADS 128

DEV u32 pack_f16x2(float lo, float hi) {
    return (u32)f32_to_f16(lo) | ((u32)f32_to_f16(hi) << 16);
}

DEV void cp_async16(void* smem, const void* gmem) {
    u32 s;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(s) : "l"(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}

DEV void cp_async_wait_all() {
    asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;" ::: "memory");
}

// The maximum (sum) over the four lanes of a quad, which hold one row's values.
DEV float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

DEV float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

template <int HD>
DEV void flash_attention(const float* __restrict__ qkv, const int* __restrict__ step, int rows,
                         int n_heads, int n_kv_heads, float scale, const f16_t* __restrict__ kc,
                         const f16_t* __restrict__ vc, long long slot_offset,
                         f16_t* __restrict__ out) {
    constexpr int SROW = HD + 8; // halves per shared row: padded so fragment loads avoid conflicts
    constexpr int NT = FA_BK / 8; // 8-position column blocks of S
    __shared__ __align__(16) f16_t Ks[FA_BK][SROW];
    __shared__ __align__(16) f16_t Vs[FA_BK][SROW];
    kernel_start();
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * FA_BQ; // the longest tiles start first
    const int h = blockIdx.y;
    const int kvh = h / (n_heads / n_kv_heads);
    const int start = step[STEP_START_POS];
    const int q_dim = n_heads * HD, kv_dim = n_kv_heads * HD;
    const int last = start + rows - 1;
    const int block_last = start + min(q0 + FA_BQ, rows) - 1;
    const int warp_last = start + q0 + warp * 16 + 15;
    const int r0 = q0 + warp * 16 + g, r1 = r0 + 8; // this thread's rows
    const int pos0 = start + r0, pos1 = start + r1;

    u32 qf[HD / 16][4];
    {
        const size_t stride = (size_t)q_dim + 2 * (size_t)kv_dim;
        const float* a = qkv + (size_t)r0 * stride + (size_t)h * HD + 2 * t;
        const float* b = qkv + (size_t)r1 * stride + (size_t)h * HD + 2 * t;
#pragma unroll
        for (int c = 0; c < HD / 16; c++) {
            const int d = 16 * c;
            qf[c][0] = r0 < rows ? pack_f16x2(a[d], a[d + 1]) : 0u;
            qf[c][1] = r1 < rows ? pack_f16x2(b[d], b[d + 1]) : 0u;
            qf[c][2] = r0 < rows ? pack_f16x2(a[d + 8], a[d + 9]) : 0u;
            qf[c][3] = r1 < rows ? pack_f16x2(b[d + 8], b[d + 9]) : 0u;
        }
    }

    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
    float o[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) o[n][e] = 0.0f;

    const f16_t* K = kc + slot_offset + (size_t)kvh * HD;
    const f16_t* V = vc + slot_offset + (size_t)kvh * HD;
    const int tiles = block_last / FA_BK + 1;
    for (int kt = 0; kt < tiles; kt++) {
        const int k0 = kt * FA_BK;
        __syncthreads(); // every warp is done with the previous tile
        for (int i = tid; i < FA_BK * HD / 8; i += FA_THREADS) {
            const int kr = i / (HD / 8), c = (i % (HD / 8)) * 8;
            const int p = k0 + kr;
            if (p <= last) {
                cp_async16(&Ks[kr][c], K + (size_t)p * kv_dim + c);
                cp_async16(&Vs[kr][c], V + (size_t)p * kv_dim + c);
            } else {
                *(uint4*)&Ks[kr][c] = make_uint4(0u, 0u, 0u, 0u);
                *(uint4*)&Vs[kr][c] = make_uint4(0u, 0u, 0u, 0u);
            }
        }
        cp_async_wait_all();
        __syncthreads();
        if (k0 > warp_last) continue; // past every row of this warp: it would change nothing

        float s[NT][4];
#pragma unroll
        for (int j = 0; j < NT; j++) {
#pragma unroll
            for (int e = 0; e < 4; e++) s[j][e] = 0.0f;
#pragma unroll
            for (int c = 0; c < HD / 16; c++) {
                const u32 b[2] = {*(const u32*)&Ks[8 * j + g][16 * c + 2 * t],
                                  *(const u32*)&Ks[8 * j + g][16 * c + 2 * t + 8]};
                mma16816(s[j], qf[c], b);
            }
        }
        float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int p = k0 + 8 * j + 2 * t + (e & 1);
                const bool row1 = e >= 2;
                const float v = p <= (row1 ? pos1 : pos0) ? __fmul_rn(s[j][e], scale) : NEG_INF;
                s[j][e] = v;
                if (row1) mx1 = fmaxf(mx1, v);
                else mx0 = fmaxf(mx0, v);
            }
        const float m0 = fmaxf(m[0], quad_max(mx0)), m1 = fmaxf(m[1], quad_max(mx1));
        // Position 0 is in the first tile of every row, so m0 and m1 are finite from there on.
        const float c0 = expf(m[0] - m0), c1 = expf(m[1] - m1);
        float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
        for (int j = 0; j < NT; j++) {
            s[j][0] = expf(s[j][0] - m0);
            s[j][1] = expf(s[j][1] - m0);
            s[j][2] = expf(s[j][2] - m1);
            s[j][3] = expf(s[j][3] - m1);
            sum0 += s[j][0] + s[j][1];
            sum1 += s[j][2] + s[j][3];
        }
        l[0] = l[0] * c0 + quad_sum(sum0);
        l[1] = l[1] * c1 + quad_sum(sum1);
        m[0] = m0;
        m[1] = m1;
#pragma unroll
        for (int n = 0; n < HD / 8; n++) {
            o[n][0] *= c0;
            o[n][1] *= c0;
            o[n][2] *= c1;
            o[n][3] *= c1;
        }
#pragma unroll
        for (int kk = 0; kk < FA_BK / 16; kk++) {
            const u32 a[4] = {pack_f16x2(s[2 * kk][0], s[2 * kk][1]),
                              pack_f16x2(s[2 * kk][2], s[2 * kk][3]),
                              pack_f16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              pack_f16x2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
            const int k = 16 * kk + 2 * t;
#pragma unroll
            for (int n = 0; n < HD / 8; n++) {
                const int d = 8 * n + g;
                const u32 b[2] = {(u32)Vs[k][d] | ((u32)Vs[k + 1][d] << 16),
                                  (u32)Vs[k + 8][d] | ((u32)Vs[k + 9][d] << 16)};
                mma16816(o[n], a, b);
            }
        }
    }

    f16_t* out0 = out + (size_t)r0 * q_dim + (size_t)h * HD + 2 * t;
    f16_t* out1 = out + (size_t)r1 * q_dim + (size_t)h * HD + 2 * t;
#pragma unroll
    for (int n = 0; n < HD / 8; n++) {
        if (r0 < rows) {
            out0[8 * n] = f32_to_f16(__fdiv_rn(o[n][0], l[0]));
            out0[8 * n + 1] = f32_to_f16(__fdiv_rn(o[n][1], l[0]));
        }
        if (r1 < rows) {
            out1[8 * n] = f32_to_f16(__fdiv_rn(o[n][2], l[1]));
            out1[8 * n + 1] = f32_to_f16(__fdiv_rn(o[n][3], l[1]));
        }
    }
}

// K and V of the step's slot start at kc + slot_offset and vc + slot_offset (f16 values),
// positions kv_dim apart; the host checks 16-byte alignment of rows.
#define FLASH_KERNEL(HD)                                                                           \
    extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_attention_hd##HD(               \
        const float* qkv, const int* step, int rows, int n_heads, int n_kv_heads, float scale,     \
        const f16_t* kc, const f16_t* vc, long long slot_offset, f16_t* out) {                     \
        flash_attention<HD>(qkv, step, rows, n_heads, n_kv_heads, scale, kc, vc, slot_offset,      \
                            out);                                                                  \
    }

FLASH_KERNEL(16)
FLASH_KERNEL(32)
FLASH_KERNEL(64)
FLASH_KERNEL(128)
