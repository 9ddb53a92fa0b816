// Matrix-vector products for decode: out[r, n] = sum_k x[r, k] * W[n, k] for up to R rows of x.
//
// Weights keep the file layout (docs/FORMAT.md): codes row-major, then f16 scales [N, G] and
// zeros [N, G] (`sz` points at the scales; zeros follow at sz + N * G).
//
// Quantized rows are computed in the factored form
//     sum_k (s_g q_k + z_g) x_k = sum_units s_g * (sum_{k in unit} q_k x_k) + z_g * (sum_{k in unit} x_k)
// with 32-code units that never straddle a group (the host only picks this kernel when the group
// size is a multiple of 32). Codes are integers, so every product is exact in f32 and the result
// equals the contract's f32 dequantize-and-accumulate up to the order of f32 additions.
//
// Each block of 256 threads stages x (as f32, unit-major with padding against bank conflicts, the
// unit sums in the padding) in shared memory, then gives each output row `tpr` threads that walk
// the row's 16-byte units, four loads in flight, and reduce with shuffles (and shared memory when
// tpr > 32). The reduction order is fixed, so results are deterministic.
#include "common.cuh"

#define GEMV_THREADS 256
#ifndef GEMV_UNROLL
#define GEMV_UNROLL 8 // units per lane and batch (plain GEMV; half of it for gate + up)
#endif
#ifndef GEMV_MIN_BLOCKS
#define GEMV_MIN_BLOCKS 1 // blocks per SM the register allocation must allow (launch bounds)
#endif
#define QUNIT 32   // codes per unit of a quantized row
#define QSTRIDE 36 // staged floats per quantized unit: 32 values, their sum, padding
#define HUNIT 8    // values per 16-byte unit of an f16 row
#define HSTRIDE 12 // staged floats per f16 unit

// 8 int4 codes of one word against 8 staged values, in one chain.
DEV float dot8_q4(u32 w, const float* xs, float acc) {
    const float4 a = *(const float4*)xs;
    const float4 b = *(const float4*)(xs + 4);
    acc = fmaf(code_f32(w & 0xFu), a.x, acc);
    acc = fmaf(code_f32((w >> 4) & 0xFu), a.y, acc);
    acc = fmaf(code_f32((w >> 8) & 0xFu), a.z, acc);
    acc = fmaf(code_f32((w >> 12) & 0xFu), a.w, acc);
    acc = fmaf(code_f32((w >> 16) & 0xFu), b.x, acc);
    acc = fmaf(code_f32((w >> 20) & 0xFu), b.y, acc);
    acc = fmaf(code_f32((w >> 24) & 0xFu), b.z, acc);
    acc = fmaf(code_f32(w >> 28), b.w, acc);
    return acc;
}

// 16 int2 codes of one word against 16 staged values, in one chain.
DEV float dot16_q2(u32 w, const float* xs, float acc) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float4 a = *(const float4*)(xs + 4 * i);
        const u32 v = w >> (8 * i);
        acc = fmaf(code_f32(v & 3u), a.x, acc);
        acc = fmaf(code_f32((v >> 2) & 3u), a.y, acc);
        acc = fmaf(code_f32((v >> 4) & 3u), a.z, acc);
        acc = fmaf(code_f32((v >> 6) & 3u), a.w, acc);
    }
    return acc;
}

// dot8_q4 with each code taken where it lies in the word: the nibble at bit 4j as q · 2^4j (below
// bit 23 after at most one shift of the word), so a code costs a mask and no shift. The products
// q · 2^4j · x are exact and go to the sum of their place: a[j] holds 2^4j times the f32 sum, in
// order, of the q · x at place j (j < 5).
DEV void dot8_q4_places(u32 w, const float* xs, float* a) {
    const float4 lo = *(const float4*)xs;
    const float4 hi = *(const float4*)(xs + 4);
    const u32 v = w >> 20;
    a[0] = fmaf(code_f32(w & 0xFu), lo.x, a[0]);
    a[1] = fmaf(code_f32(w & 0xF0u), lo.y, a[1]);
    a[2] = fmaf(code_f32(w & 0xF00u), lo.z, a[2]);
    a[3] = fmaf(code_f32(w & 0xF000u), lo.w, a[3]);
    a[4] = fmaf(code_f32(w & 0xF0000u), hi.x, a[4]);
    a[0] = fmaf(code_f32(v & 0xFu), hi.y, a[0]);
    a[1] = fmaf(code_f32(v & 0xF0u), hi.z, a[1]);
    a[2] = fmaf(code_f32(v & 0xF00u), hi.w, a[2]);
}

// dot16_q2 with the codes taken in place: the code at bit 2j of a byte, as q · 2^2j, goes to the
// sum of its place j (j < 4).
DEV void dot16_q2_places(u32 w, const float* xs, float* a) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float4 x = *(const float4*)(xs + 4 * i);
        const u32 v = w >> (8 * i);
        a[0] = fmaf(code_f32(v & 0x3u), x.x, a[0]);
        a[1] = fmaf(code_f32(v & 0xCu), x.y, a[1]);
        a[2] = fmaf(code_f32(v & 0x30u), x.z, a[2]);
        a[3] = fmaf(code_f32(v & 0xC0u), x.w, a[3]);
    }
}

// One unit of weights (`c`: 16 bytes for int4 and f16, the first 8 for int2) against x. With
// PLACES (one-row GEMVs) quantized codes are taken in place and the places' sums scaled back
// exactly (powers of two) and added from the lowest place up: a shift fewer per code. Multi-row
// GEMVs keep one chain per unit, since R sets of place sums would cost them registers and blocks.
template <int BITS, bool PLACES>
DEV float unit_dot(uint4 c, const float* xs) {
    if (BITS == 4 && PLACES) {
        float a[5] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        dot8_q4_places(c.x, xs, a);
        dot8_q4_places(c.y, xs + 8, a);
        dot8_q4_places(c.z, xs + 16, a);
        dot8_q4_places(c.w, xs + 24, a);
        float acc = fmaf(a[1], 0x1p-4f, a[0]);
        acc = fmaf(a[2], 0x1p-8f, acc);
        acc = fmaf(a[3], 0x1p-12f, acc);
        return fmaf(a[4], 0x1p-16f, acc);
    }
    if (BITS == 2 && PLACES) {
        float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        dot16_q2_places(c.x, xs, a);
        dot16_q2_places(c.y, xs + 16, a);
        const float acc = fmaf(a[1], 0x1p-2f, a[0]);
        return fmaf(a[3], 0x1p-6f, fmaf(a[2], 0x1p-4f, acc));
    }
    float acc = 0.0f;
    if (BITS == 4) {
        acc = dot8_q4(c.x, xs, acc);
        acc = dot8_q4(c.y, xs + 8, acc);
        acc = dot8_q4(c.z, xs + 16, acc);
        acc = dot8_q4(c.w, xs + 24, acc);
    } else if (BITS == 2) {
        acc = dot16_q2(c.x, xs, acc);
        acc = dot16_q2(c.y, xs + 16, acc);
    } else {
        const float4 a = *(const float4*)xs;
        const float4 b = *(const float4*)(xs + 4);
        acc = fmaf(lo_f16(c.x), a.x, acc);
        acc = fmaf(hi_f16(c.x), a.y, acc);
        acc = fmaf(lo_f16(c.y), a.z, acc);
        acc = fmaf(hi_f16(c.y), a.w, acc);
        acc = fmaf(lo_f16(c.z), b.x, acc);
        acc = fmaf(hi_f16(c.z), b.y, acc);
        acc = fmaf(lo_f16(c.w), b.z, acc);
        acc = fmaf(hi_f16(c.w), b.w, acc);
    }
    return acc;
}

template <int BITS>
DEV uint4 load_unit(const u8* p, u64 policy) {
    if (BITS == 2) {
        const uint2 v = ld_w8(p, policy);
        return make_uint4(v.x, v.y, 0u, 0u);
    }
    return ld_w16(p, policy);
}

// Sum `v` over the `tpr` consecutive threads of each row group; the group's first thread gets it.
DEV float row_sum(float v, int tpr, float* red, int slot, int slots) {
    const int width = tpr < 32 ? tpr : 32;
    for (int o = width >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (tpr <= 32) return v;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) red[warp * slots + slot] = v;
    __syncthreads();
    float total = 0.0f;
    if ((threadIdx.x % tpr) == 0) {
        const int first = threadIdx.x >> 5, warps = tpr >> 5;
        for (int w = 0; w < warps; w++) total += red[(first + w) * slots + slot];
    }
    __syncthreads();
    return total;
}

// Residual modes of a normalizing GEMV's input (those of norm_state_rows): none, or a sandwich
// sublayer's output `delta` still to be added, x + norm_o(delta) or norm_o(x + delta).
#define RES_NONE 0
#define RES_SANDWICH 1
#define RES_SANDWICH_RESIDUAL 2

// The input of a GEMV: f16 rows, or (NORM) f32 rows normalized on the fly like norm_rows. With a
// residual mode the row is first settled (the pending sublayer output added as norm_state_rows
// adds it, with the same norm kind and eps); block 0 writes the settled row to `x_next`.
struct GemvInput {
    const f16_t* x;  // f16 rows (plain)
    const float* xf; // f32 rows to normalize (NORM)
    const f16_t* nw; // norm weight
    const f16_t* nb; // norm bias, or null
    int layer_norm;
    float eps;
    int res_mode;       // RES_*
    const float* delta; // the pending sublayer output
    const f16_t* ow;    // its output norm's weight
    const f16_t* ob;    // and bias, or null
    float* x_next;      // the settled row
};

// A normalizing GEMV reads its row once: thread t keeps the 8-value chunks c = t + j * blockDim
// (j < NC) in registers through both norms and the staging. Each kernel is compiled for NC = 1
// (K <= 2048) and NC = 3 (K <= 6144; linear.rs `norm_chunks`): registers held for chunks a row
// does not have cost the GEMV its occupancy.
template <int NC>
using NormRow = float[NC][8];

DEV bool holds_chunk(int j, int chunks) { return threadIdx.x + j * blockDim.x < chunks; }

// Eight f32 values at `p` (16-byte aligned).
DEV void load8(const float* p, float* v) {
    const float4 a = ((const float4*)p)[0], b = ((const float4*)p)[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

// Mean and 1 / sqrt(var + eps) of the row held in `v` (mean = 0 for RMSNorm), summed per thread
// in chunk order and then over the block: the same order in every block, so every block
// normalizes identically. Every thread gets both.
template <int NC>
DEV float2 held_stats(const NormRow<NC>& v, int K, int layer_norm, float eps, float* scratch) {
    const int chunks = K >> 3;
    const float n = (float)K;
    float mean = 0.0f;
    if (layer_norm) {
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < NC; j++)
            if (holds_chunk(j, chunks))
#pragma unroll
                for (int k = 0; k < 8; k++) s += v[j][k];
        mean = __fdiv_rn(block_sum(s, scratch), n);
    }
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < NC; j++)
        if (holds_chunk(j, chunks))
#pragma unroll
            for (int k = 0; k < 8; k++) {
                const float d = __fsub_rn(v[j][k], mean);
                ss = fmaf(d, d, ss);
            }
    const float var = __fdiv_rn(block_sum(ss, scratch), n);
    return make_float2(mean, __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(var, eps))));
}

// (v - mean) * inv * w + b for the 8 values of chunk c, in f32 as norm_state_rows rounds it.
DEV void norm_f32x8(float* v, const f16_t* w, const f16_t* b, int c, float2 st) {
    const uint4 wv = *(const uint4*)(w + 8 * c);
    const uint4 bv = b ? *(const uint4*)(b + 8 * c) : make_uint4(0u, 0u, 0u, 0u);
    const u32 ws[4] = {wv.x, wv.y, wv.z, wv.w}, bs[4] = {bv.x, bv.y, bv.z, bv.w};
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const float wk = k & 1 ? hi_f16(ws[k >> 1]) : lo_f16(ws[k >> 1]);
        const float bk = k & 1 ? hi_f16(bs[k >> 1]) : lo_f16(bs[k >> 1]);
        v[k] = __fadd_rn(__fmul_rn(__fmul_rn(__fsub_rn(v[k], st.x), st.y), wk), bk);
    }
}

// The row a normalizing GEMV normalizes, into `v`: `xf`, or with a pending sublayer output the
// settled row (x + norm_o(delta), or norm_o(x + delta)), which block 0 writes to `x_next`.
template <int NC>
DEV void load_settled_row(const GemvInput& in, int K, NormRow<NC>& v, float* scratch) {
    const int chunks = K >> 3;
#pragma unroll
    for (int j = 0; j < NC; j++) {
        const int c = threadIdx.x + j * blockDim.x;
        if (!holds_chunk(j, chunks)) continue;
        load8(in.res_mode == RES_SANDWICH ? in.delta + 8 * c : in.xf + 8 * c, v[j]);
        if (in.res_mode == RES_SANDWICH_RESIDUAL) {
            float d[8];
            load8(in.delta + 8 * c, d);
#pragma unroll
            for (int k = 0; k < 8; k++) v[j][k] = __fadd_rn(v[j][k], d[k]);
        }
    }
    if (in.res_mode == RES_NONE) return;
    const float2 os = held_stats(v, K, in.layer_norm, in.eps, scratch);
#pragma unroll
    for (int j = 0; j < NC; j++) {
        const int c = threadIdx.x + j * blockDim.x;
        if (!holds_chunk(j, chunks)) continue;
        norm_f32x8(v[j], in.ow, in.ob, c, os);
        if (in.res_mode == RES_SANDWICH) {
            float x[8];
            load8(in.xf + 8 * c, x);
#pragma unroll
            for (int k = 0; k < 8; k++) v[j][k] = __fadd_rn(x[k], v[j][k]);
        }
        if (blockIdx.x == 0) {
            float4* dst = (float4*)(in.x_next + 8 * c);
            dst[0] = make_float4(v[j][0], v[j][1], v[j][2], v[j][3]);
            dst[1] = make_float4(v[j][4], v[j][5], v[j][6], v[j][7]);
        }
    }
}

// Four normalized values, rounded to f16 exactly like norm_rows, widened back to f32.
DEV float4 norm_f16x4(const float* xs, uint2 w, uint2 b, float2 st) {
    const float ws[4] = {lo_f16(w.x), hi_f16(w.x), lo_f16(w.y), hi_f16(w.y)};
    const float bs[4] = {lo_f16(b.x), hi_f16(b.x), lo_f16(b.y), hi_f16(b.y)};
    float o[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const float v = __fmul_rn(__fmul_rn(__fsub_rn(xs[j], st.x), st.y), ws[j]);
        o[j] = round_f16(__fadd_rn(v, bs[j]));
    }
    return make_float4(o[0], o[1], o[2], o[3]);
}

// Eight staged values (chunk c of row r) into shared memory, and for quantized weights their
// 32-value unit's sum (the four threads of a unit are adjacent lanes; every lane of the warp
// calls this, `in` says whether its values count).
DEV void stage_chunk(float* smem, int r, int c, int U, bool Q, float4 a, float4 b, bool in) {
    const int UNIT = Q ? QUNIT : HUNIT, STRIDE = Q ? QSTRIDE : HSTRIDE;
    const int u = (8 * c) / UNIT, off = (8 * c) - u * UNIT;
    float* dst = smem + (r * U + u) * STRIDE + off;
    if (in) {
        *(float4*)dst = a;
        *(float4*)(dst + 4) = b;
    }
    if (Q) {
        float part = ((a.x + a.y) + (a.z + a.w)) + ((b.x + b.y) + (b.z + b.w));
        part += __shfl_xor_sync(0xffffffffu, part, 1);
        part += __shfl_xor_sync(0xffffffffu, part, 2);
        if (in && off == 0) dst[QUNIT] = part;
    }
}

template <int BITS, int R, bool GATEUP, bool NORM, int NC = 1>
DEV void gemv(const GemvInput input, int rows, int K, const u8* __restrict__ w0,
              const f16_t* __restrict__ sz0, const u8* __restrict__ w1,
              const f16_t* __restrict__ sz1, int N, int group, int tpr, int stream_hint,
              float* __restrict__ out, int accumulate, f16_t* __restrict__ out_h) {
    static_assert(!NORM || R == 1, "normalizing GEMVs take one row");
    extern __shared__ __align__(16) float smem[];
    __shared__ float red[(GEMV_THREADS / 32) * 2 * R];
    const bool Q = BITS != 16;
    const int UNIT = Q ? QUNIT : HUNIT;
    const int STRIDE = Q ? QSTRIDE : HSTRIDE;
    const int UB = BITS == 2 ? 8 : 16; // bytes per unit
    // Units per lane and batch: every load of a batch is in flight before the first use.
    const int UNROLL = GATEUP ? (GEMV_UNROLL + 1) / 2 : GEMV_UNROLL;
    const int U = K / UNIT;
    const u64 policy = l2_policy(stream_hint != 0);

    // `tpr` threads per output row.
    const int rpb = blockDim.x / tpr;
    const int n = blockIdx.x * rpb + threadIdx.x / tpr;
    const int lane = threadIdx.x % tpr;
    const bool valid = n < N;
    const size_t nn = valid ? (size_t)n : 0;
    const size_t row_bytes = (size_t)K * BITS / 8;
    const int G = Q ? K / group : 1;
    const int upg = Q ? group / QUNIT : 1; // units per group
    const u8* r0 = w0 + nn * row_bytes;
    const u8* r1 = GATEUP ? w1 + nn * row_bytes : r0;
    const f16_t* s0 = sz0 + nn * G;
    const f16_t* z0 = sz0 + (size_t)N * G + nn * G;
    const f16_t* s1 = GATEUP ? sz1 + nn * G : s0;
    const f16_t* z1 = GATEUP ? sz1 + (size_t)N * G + nn * G : z0;

    uint4 c0[UNROLL], c1[UNROLL];
    f16_t q0[UNROLL][2], q1[UNROLL][2];
    auto load_batch = [&](int u0) {
#pragma unroll
        for (int j = 0; j < UNROLL; j++) {
            const int u = u0 + j * tpr;
            c0[j] = c1[j] = make_uint4(0u, 0u, 0u, 0u);
            q0[j][0] = q0[j][1] = q1[j][0] = q1[j][1] = 0;
            if (valid && u < U) {
                c0[j] = load_unit<BITS>(r0 + (size_t)u * UB, policy);
                if (GATEUP) c1[j] = load_unit<BITS>(r1 + (size_t)u * UB, policy);
                if (Q) {
                    const int gi = u / upg;
                    q0[j][0] = __ldg(s0 + gi);
                    q0[j][1] = __ldg(z0 + gi);
                    if (GATEUP) {
                        q1[j][0] = __ldg(s1 + gi);
                        q1[j][1] = __ldg(z1 + gi);
                    }
                }
            }
        }
    };
    // 1. The first batch of weights is requested before x is staged (and, with programmatic
    //    launch, before the kernel that writes x has finished), so the latencies overlap.
    load_batch(lane);
    kernel_start();

    // 2. Stage x as f32 (rows >= `rows` are zero), 8 values per thread and step; for quantized
    //    weights the four threads of a 32-value unit also sum it (shuffles, fixed order).
    const int chunks = K >> 3;
    if (NORM) {
        NormRow<NC> v;
        load_settled_row(input, K, v, red);
        const float2 st = held_stats(v, K, input.layer_norm, input.eps, red);
#pragma unroll
        for (int j = 0; j < NC; j++) {
            if (j * blockDim.x >= chunks) break; // block-uniform: every lane shuffles
            const int c = threadIdx.x + j * blockDim.x;
            const bool in = c < chunks;
            float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f), b = a;
            if (in) {
                const uint4 wv = *(const uint4*)(input.nw + 8 * c);
                const uint4 bv =
                    input.nb ? *(const uint4*)(input.nb + 8 * c) : make_uint4(0u, 0u, 0u, 0u);
                a = norm_f16x4(v[j], make_uint2(wv.x, wv.y), make_uint2(bv.x, bv.y), st);
                b = norm_f16x4(v[j] + 4, make_uint2(wv.z, wv.w), make_uint2(bv.z, bv.w), st);
            }
            stage_chunk(smem, 0, in ? c : 0, U, Q, a, b, in);
        }
    } else {
        const int total = R * chunks;
        for (int base = 0; base < total; base += blockDim.x) {
            const int i = base + threadIdx.x;
            const bool in = i < total;
            const int r = in ? i / chunks : 0, c = in ? i - r * chunks : 0;
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if (in && r < rows) v = *(const uint4*)(input.x + (size_t)r * K + 8 * c);
            const float4 a = make_float4(lo_f16(v.x), hi_f16(v.x), lo_f16(v.y), hi_f16(v.y));
            const float4 b = make_float4(lo_f16(v.z), hi_f16(v.z), lo_f16(v.w), hi_f16(v.w));
            stage_chunk(smem, r, c, U, Q, a, b, in);
        }
    }
    __syncthreads();

    float acc0[R], acc1[R];
#pragma unroll
    for (int r = 0; r < R; r++) acc0[r] = acc1[r] = 0.0f;
    auto dot = [](uint4 c, const float* xs) { return unit_dot<BITS, R == 1>(c, xs); };

    if (valid) {
        for (int u0 = lane; u0 < U; u0 += UNROLL * tpr) {
            if (u0 != lane) load_batch(u0);
#pragma unroll
            for (int j = 0; j < UNROLL; j++) {
                const int u = u0 + j * tpr;
                if (u >= U) break;
                if (Q) {
                    const float sc0 = f16_to_f32(q0[j][0]), ze0 = f16_to_f32(q0[j][1]);
                    const float sc1 = f16_to_f32(q1[j][0]), ze1 = f16_to_f32(q1[j][1]);
#pragma unroll
                    for (int r = 0; r < R; r++) {
                        const float* xs = smem + (r * U + u) * STRIDE;
                        const float xsum = xs[QUNIT];
                        acc0[r] = fmaf(sc0, dot(c0[j], xs), fmaf(ze0, xsum, acc0[r]));
                        if (GATEUP)
                            acc1[r] = fmaf(sc1, dot(c1[j], xs), fmaf(ze1, xsum, acc1[r]));
                    }
                } else {
#pragma unroll
                    for (int r = 0; r < R; r++) {
                        const float* xs = smem + (r * U + u) * STRIDE;
                        acc0[r] += dot(c0[j], xs);
                        if (GATEUP) acc1[r] += dot(c1[j], xs);
                    }
                }
            }
        }
    }

    // 3. Reduce over the row's threads (every thread takes part) and write.
#pragma unroll
    for (int r = 0; r < R; r++) {
        acc0[r] = row_sum(acc0[r], tpr, red, 2 * r, 2 * R);
        if (GATEUP) acc1[r] = row_sum(acc1[r], tpr, red, 2 * r + 1, 2 * R);
    }
    if (valid && lane == 0) {
#pragma unroll
        for (int r = 0; r < R; r++) {
            if (r >= rows) break;
            const size_t o = (size_t)r * N + n;
            if (GATEUP) {
                out_h[o] = f32_to_f16(silu_mul(acc0[r], acc1[r]));
            } else {
                out[o] = accumulate ? __fadd_rn(out[o], acc0[r]) : acc0[r];
            }
        }
    }
}

#define GEMV_KERNELS(B, R)                                                                        \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, GEMV_MIN_BLOCKS)                   \
        gemv_b##B##_r##R(const f16_t* x, int rows, int K, const u8* w, const f16_t* sz, int N,    \
                         int group, int tpr, int stream, float* out, int accumulate) {            \
        const GemvInput in = {x, nullptr, nullptr, nullptr, 0, 0.0f, RES_NONE};                   \
        gemv<B, R, false, false>(in, rows, K, w, sz, w, sz, N, group, tpr, stream, out,           \
                                 accumulate, nullptr);                                            \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, GEMV_MIN_BLOCKS)                   \
        gemv_gateup_b##B##_r##R(                                                                  \
        const f16_t* x, int rows, int K, const u8* wg, const f16_t* szg, const u8* wu,            \
        const f16_t* szu, int N, int group, int tpr, int stream, f16_t* out) {                    \
        const GemvInput in = {x, nullptr, nullptr, nullptr, 0, 0.0f, RES_NONE};                   \
        gemv<B, R, true, false>(in, rows, K, wg, szg, wu, szu, N, group, tpr, stream, nullptr, 0, \
                                out);                                                             \
    }

// One row normalized on the fly (decode): `nb` may be null (no bias). With `res_mode` the row is
// `xf` with the pending output `delta` added (output norm `ow`, `ob`), written to `x_next`.
#define GEMV_NORM_KERNELS(B, NC)                                                                  \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, GEMV_MIN_BLOCKS)                   \
        gemv_norm_b##B##_c##NC(                                                                   \
        const float* xf, int K, const f16_t* nw, const f16_t* nb, int layer_norm, float eps,      \
        const u8* w, const f16_t* sz, int N, int group, int tpr, int stream, float* out,          \
        int accumulate, int res_mode, const float* delta, const f16_t* ow, const f16_t* ob,       \
        float* x_next) {                                                                          \
        const GemvInput in = {nullptr, xf, nw, nb, layer_norm, eps, res_mode, delta, ow, ob,      \
                              x_next};                                                            \
        gemv<B, 1, false, true, NC>(in, 1, K, w, sz, w, sz, N, group, tpr, stream, out,           \
                                    accumulate, nullptr);                                         \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, GEMV_MIN_BLOCKS)                   \
        gemv_gateup_norm_b##B##_c##NC(                                                            \
        const float* xf, int K, const f16_t* nw, const f16_t* nb, int layer_norm, float eps,      \
        const u8* wg, const f16_t* szg, const u8* wu, const f16_t* szu, int N, int group,         \
        int tpr, int stream, f16_t* out, int res_mode, const float* delta, const f16_t* ow,       \
        const f16_t* ob, float* x_next) {                                                         \
        const GemvInput in = {nullptr, xf, nw, nb, layer_norm, eps, res_mode, delta, ow, ob,      \
                              x_next};                                                            \
        gemv<B, 1, true, true, NC>(in, 1, K, wg, szg, wu, szu, N, group, tpr, stream, nullptr,    \
                                   0, out);                                                       \
    }

// The library compiles one program per bit width (GEMV_BITS), in parallel; without GEMV_BITS
// (scripts/check-kernels.sh) every width is compiled. The generic fallback goes with width 16.
#ifdef GEMV_BITS
#define GEMV_ALL 0
#else
#define GEMV_ALL 1
#endif

#if GEMV_ALL || GEMV_BITS == 16
GEMV_KERNELS(16, 1)
GEMV_KERNELS(16, 2)
GEMV_KERNELS(16, 4)
GEMV_NORM_KERNELS(16, 1)
GEMV_NORM_KERNELS(16, 3)
#endif
#if GEMV_ALL || GEMV_BITS == 4
GEMV_KERNELS(4, 1)
GEMV_KERNELS(4, 2)
GEMV_KERNELS(4, 4)
GEMV_NORM_KERNELS(4, 1)
GEMV_NORM_KERNELS(4, 3)
#endif
#if GEMV_ALL || GEMV_BITS == 2
GEMV_KERNELS(2, 1)
GEMV_KERNELS(2, 2)
GEMV_KERNELS(2, 4)
GEMV_NORM_KERNELS(2, 1)
GEMV_NORM_KERNELS(2, 3)
#endif

#if GEMV_ALL || GEMV_BITS == 16
// Fallback for shapes the fast kernels do not take (K not a multiple of 32, group sizes not a
// multiple of 32): one warp per output, dequantized elementwise exactly like the CPU reference.
// `sz` holds the scales [N][K / group] and `zeros` the zeros. grid (ceil(N / 8), M), 256 threads.
extern "C" __global__ void linear_generic(const f16_t* __restrict__ X, int M, int K,
                                          const u8* __restrict__ W, const f16_t* __restrict__ sz,
                                          const f16_t* __restrict__ zero_rows, int bits, int N,
                                          int group, float* __restrict__ out, int accumulate) {
    kernel_start();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n = blockIdx.x * 8 + warp, m = blockIdx.y;
    if (n >= N || m >= M) return;
    const f16_t* x = X + (size_t)m * K;
    float acc = 0.0f;
    if (bits == 16) {
        const f16_t* w = (const f16_t*)W + (size_t)n * K;
        for (int k = lane; k < K; k += 32) acc = fmaf(f16_to_f32(w[k]), f16_to_f32(x[k]), acc);
    } else {
        const size_t row_bytes = (size_t)K * bits / 8;
        const int G = K / group, per = 8 / bits, mask = (1 << bits) - 1;
        const u8* codes = W + (size_t)n * row_bytes;
        const f16_t* scales = sz + (size_t)n * G;
        const f16_t* zeros = zero_rows + (size_t)n * G;
        for (int k = lane; k < K; k += 32) {
            const u32 q = (codes[k / per] >> ((k % per) * bits)) & mask;
            const int gi = k / group;
            const float wv = __fadd_rn(__fmul_rn(f16_to_f32(scales[gi]), (float)q), f16_to_f32(zeros[gi]));
            acc = fmaf(wv, f16_to_f32(x[k]), acc);
        }
    }
    acc = warp_sum(acc);
    if (lane == 0) {
        const size_t o = (size_t)m * N + n;
        out[o] = accumulate ? __fadd_rn(out[o], acc) : acc;
    }
}
#endif
