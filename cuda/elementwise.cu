// Row-wise and elementwise kernels: embedding, norms, RoPE + KV write, residual add, f16 rounding,
// SwiGLU, argmax. Each rounds exactly where the CPU reference rounds (src/backend/cpu).
#include "common.cuh"

// out[r] = table[token_r] for the staged tokens (f32 output). grid (rows, ceil(width / 256)).
extern "C" __global__ void embed_f32(const f16_t* __restrict__ table, const int* __restrict__ step,
                                     int vocab, int width, float* __restrict__ out) {
    kernel_start();
    const int r = blockIdx.x, i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i >= width) return;
    const int token = step[STEP_TOKENS + r];
    const bool ok = token >= 0 && token < vocab;
    out[(size_t)r * width + i] = ok ? f16_to_f32(table[(size_t)token * width + i]) : 0.0f;
}

// Same, f16 output (input of a factorized embedding projection).
extern "C" __global__ void embed_f16(const f16_t* __restrict__ table, const int* __restrict__ step,
                                     int vocab, int width, f16_t* __restrict__ out) {
    kernel_start();
    const int r = blockIdx.x, i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i >= width) return;
    const int token = step[STEP_TOKENS + r];
    const bool ok = token >= 0 && token < vocab;
    out[(size_t)r * width + i] = ok ? table[(size_t)token * width + i] : (f16_t)0;
}

// out = (x - mean) * inv * w + b for 4 values, rounded to f16 and packed.
DEV uint2 norm4(float4 x, uint2 w, uint2 b, float mean, float inv, bool has_bias) {
    const float xs[4] = {x.x, x.y, x.z, x.w};
    const float ws[4] = {lo_f16(w.x), hi_f16(w.x), lo_f16(w.y), hi_f16(w.y)};
    const float bs[4] = {lo_f16(b.x), hi_f16(b.x), lo_f16(b.y), hi_f16(b.y)};
    f16_t o[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const float v = __fmul_rn(__fmul_rn(__fsub_rn(xs[j], mean), inv), ws[j]);
        o[j] = f32_to_f16(__fadd_rn(v, has_bias ? bs[j] : 0.0f));
    }
    return make_uint2((u32)o[0] | ((u32)o[1] << 16), (u32)o[2] | ((u32)o[3] << 16));
}

// The mean (0 for RMSNorm) and 1 / sqrt(var + eps) of a row of d floats staged in shared memory,
// reduced over the block.
DEV void staged_row_stats(const float* srow, int d, int layer_norm, float eps, float* scratch,
                          float* mean_out, float* inv_out) {
    const float n = (float)d;
    float mean = 0.0f;
    if (layer_norm) {
        float s = 0.0f;
        for (int i = threadIdx.x; i < d; i += blockDim.x) s += srow[i];
        mean = __fdiv_rn(block_sum(s, scratch), n);
    }
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const float v = __fsub_rn(srow[i], mean);
        ss = fmaf(v, v, ss);
    }
    const float var = __fdiv_rn(block_sum(ss, scratch), n);
    const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(var, eps)));
    *mean_out = mean;
    *inv_out = inv;
}

// Value i of a staged row normalized with its statistics: (v - mean) * inv * w + b, in f32.
DEV float staged_normed(const float* srow, int i, float mean, float inv, const f16_t* w,
                        const f16_t* b, int has_bias) {
    const float bias = has_bias ? f16_to_f32(b[i]) : 0.0f;
    const float v = __fmul_rn(__fmul_rn(__fsub_rn(srow[i], mean), inv), f16_to_f32(w[i]));
    return __fadd_rn(v, bias);
}

// RMSNorm or LayerNorm of one row per block, rounded to f16:
// out = (x - mean) * inv * w + b with inv = 1 / sqrt(var + eps) (mean = 0, b = 0 for RMSNorm).
// Rows of up to 8 values per thread (d a multiple of 4) stay in registers, with every load
// issued up front; longer rows are staged in shared memory (d floats, dynamic).
extern "C" __global__ void norm_rows(const float* __restrict__ x, int d, int layer_norm, float eps,
                                     const f16_t* __restrict__ w, const f16_t* __restrict__ b,
                                     int has_bias, f16_t* __restrict__ out) {
    kernel_start();
    extern __shared__ __align__(16) float srow[];
    __shared__ float scratch[32];
    const float* row = x + (size_t)blockIdx.x * d;
    f16_t* dst = out + (size_t)blockIdx.x * d;
    const float n = (float)d;
    if ((d & 3) == 0 && d <= 8 * (int)blockDim.x) {
        const int nch = d >> 2;
        float4 xv[2];
        uint2 wv[2], bv[2];
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const int c = threadIdx.x + j * blockDim.x;
            xv[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            wv[j] = bv[j] = make_uint2(0u, 0u);
            if (c < nch) {
                xv[j] = ((const float4*)row)[c];
                wv[j] = ((const uint2*)w)[c];
                if (has_bias) bv[j] = ((const uint2*)b)[c];
            }
        }
        float mean = 0.0f;
        if (layer_norm) {
            float s = 0.0f;
#pragma unroll
            for (int j = 0; j < 2; j++) s += (xv[j].x + xv[j].y) + (xv[j].z + xv[j].w);
            mean = __fdiv_rn(block_sum(s, scratch), n);
        }
        float ss = 0.0f;
#pragma unroll
        for (int j = 0; j < 2; j++) {
            if (threadIdx.x + j * blockDim.x < nch) {
                const float e[4] = {xv[j].x, xv[j].y, xv[j].z, xv[j].w};
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    const float v = __fsub_rn(e[k], mean);
                    ss = fmaf(v, v, ss);
                }
            }
        }
        const float var = __fdiv_rn(block_sum(ss, scratch), n);
        const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(var, eps)));
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const int c = threadIdx.x + j * blockDim.x;
            if (c < nch) ((uint2*)dst)[c] = norm4(xv[j], wv[j], bv[j], mean, inv, has_bias != 0);
        }
        return;
    }
    if ((d & 3) == 0) {
        const float4* src = (const float4*)row;
#pragma unroll 4
        for (int i = threadIdx.x; i < (d >> 2); i += blockDim.x) ((float4*)srow)[i] = src[i];
    } else {
#pragma unroll 4
        for (int i = threadIdx.x; i < d; i += blockDim.x) srow[i] = row[i];
    }
    __syncthreads();
    float mean, inv;
    staged_row_stats(srow, d, layer_norm, eps, scratch, &mean, &inv);
#pragma unroll 4
    for (int i = threadIdx.x; i < d; i += blockDim.x)
        dst[i] = f32_to_f16(staged_normed(srow, i, mean, inv, w, b, has_bias));
}

// Rotate the Q and K heads of each row at its position (pairs (i, i + hd/2)), then write K and V,
// rounded to f16, into `slot` of the cache at the row's entry (K at kc + slot * slot_stride, V likewise). Rotated Q
// goes back into qkv; rotated K only into the cache (nothing reads it from qkv again). With
// first_head = n_heads the Q heads are left as they are: the flash attention kernel rotates them
// as it loads them.
// grid (rows, ceil(work / blockDim.x)): `width` (1 or 2) adjacent pairs or V elements per thread,
// so every thread waits for one round of loads only. Width 2 (8- and 16-byte loads, f16 pairs
// stored as one word) needs hd % 4 == 0, an even slot_stride and 4-byte aligned caches; the
// host checks.
extern "C" __global__ void rope_kv(float* __restrict__ qkv, const int* __restrict__ step,
                                   int n_heads, int n_kv_heads, int hd,
                                   const float* __restrict__ rope, f16_t* __restrict__ kc,
                                   f16_t* __restrict__ vc, int slot, long long slot_stride,
                                   int width, int first_head) {
    kernel_start();
    const int r = blockIdx.x;
    const int p = blockIdx.y * blockDim.x + threadIdx.x;
    const int pos = row_position(step, r);
    const int half = hd / 2;
    const int q_dim = n_heads * hd, kv_dim = n_kv_heads * hd;
    float* row = qkv + (size_t)r * (q_dim + 2 * kv_dim);
    const size_t at = (size_t)slot * slot_stride + (size_t)entry_index(step, r, pos) * kv_dim;
    const int per_head = half / width;
    const int items = (n_heads + n_kv_heads - first_head) * per_head;
    if (p < items) {
        const int head = first_head + p / per_head, i = (p % per_head) * width;
        float* h = row + head * hd;
        const float* table = rope + (size_t)pos * hd;
        f16_t* k = head >= n_heads ? kc + at + (size_t)(head - n_heads) * hd : nullptr;
        if (width == 2) {
            const float2 a = *(const float2*)(h + i), b = *(const float2*)(h + i + half);
            const float4 cs = *(const float4*)(table + 2 * i); // (c, s) of pairs i and i + 1
            const float2 ra = make_float2(rotate_a(a.x, b.x, cs.x, cs.y),
                                          rotate_a(a.y, b.y, cs.z, cs.w));
            const float2 rb = make_float2(rotate_b(a.x, b.x, cs.x, cs.y),
                                          rotate_b(a.y, b.y, cs.z, cs.w));
            if (k) {
                *(u32*)(k + i) = (u32)f32_to_f16(ra.x) | ((u32)f32_to_f16(ra.y) << 16);
                *(u32*)(k + i + half) = (u32)f32_to_f16(rb.x) | ((u32)f32_to_f16(rb.y) << 16);
            } else {
                *(float2*)(h + i) = ra;
                *(float2*)(h + i + half) = rb;
            }
        } else {
            const float c = table[2 * i], s = table[2 * i + 1];
            const float ra = rotate_a(h[i], h[i + half], c, s);
            const float rb = rotate_b(h[i], h[i + half], c, s);
            if (k) {
                k[i] = f32_to_f16(ra);
                k[i + half] = f32_to_f16(rb);
            } else {
                h[i] = ra;
                h[i + half] = rb;
            }
        }
    } else if (p < items + kv_dim / width) {
        const int i = (p - items) * width;
        const float* v = row + q_dim + kv_dim + i;
        if (width == 2) {
            const float2 x = *(const float2*)v;
            *(u32*)(vc + at + i) = (u32)f32_to_f16(x.x) | ((u32)f32_to_f16(x.y) << 16);
        } else {
            vc[at + i] = f32_to_f16(*v);
        }
    }
}

// out = f16(x) over `len` values.
extern "C" __global__ void to_half(const float* __restrict__ x, int len, f16_t* __restrict__ out) {
    kernel_start();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < len; i += gridDim.x * blockDim.x)
        out[i] = f32_to_f16(x[i]);
}

// out = f16(silu(gate) * up) over `len` values, four per thread and step (16-byte loads: the
// buffers are allocation-aligned), the last len % 4 one by one.
extern "C" __global__ void swiglu(const float* __restrict__ gate, const float* __restrict__ up,
                                  int len, f16_t* __restrict__ out) {
    kernel_start();
    const int first = blockIdx.x * blockDim.x + threadIdx.x, stride = gridDim.x * blockDim.x;
    const int quads = len >> 2;
    for (int i = first; i < quads; i += stride) {
        const float4 g = ((const float4*)gate)[i], u = ((const float4*)up)[i];
        const u32 x = f32_to_f16(silu_mul(g.x, u.x)), y = f32_to_f16(silu_mul(g.y, u.y));
        const u32 z = f32_to_f16(silu_mul(g.z, u.z)), w = f32_to_f16(silu_mul(g.w, u.w));
        ((uint2*)out)[i] = make_uint2(x | (y << 16), z | (w << 16));
    }
    for (int i = 4 * quads + first; i < len; i += stride)
        out[i] = f32_to_f16(silu_mul(gate[i], up[i]));
}

// As swiglu, gate and up f16 (the FP16 body cache's products), eight per thread and step.
extern "C" __global__ void swiglu_half(const f16_t* __restrict__ gate,
                                       const f16_t* __restrict__ up, int len,
                                       f16_t* __restrict__ out) {
    kernel_start();
    const int first = blockIdx.x * blockDim.x + threadIdx.x, stride = gridDim.x * blockDim.x;
    const int octets = len >> 3;
    for (int i = first; i < octets; i += stride) {
        const uint4 g = ((const uint4*)gate)[i], u = ((const uint4*)up)[i];
        const u32 gw[4] = {g.x, g.y, g.z, g.w}, uw[4] = {u.x, u.y, u.z, u.w};
        u32 r[4];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const u32 lo = f32_to_f16(silu_mul(f16_to_f32((f16_t)(gw[k] & 0xffffu)),
                                               f16_to_f32((f16_t)(uw[k] & 0xffffu))));
            const u32 hi = f32_to_f16(silu_mul(f16_to_f32((f16_t)(gw[k] >> 16)),
                                               f16_to_f32((f16_t)(uw[k] >> 16))));
            r[k] = lo | (hi << 16);
        }
        ((uint4*)out)[i] = make_uint4(r[0], r[1], r[2], r[3]);
    }
    for (int i = 8 * octets + first; i < len; i += stride)
        out[i] = f32_to_f16(silu_mul(f16_to_f32(gate[i]), f16_to_f32(up[i])));
}

// The CPU rule: the largest value wins, the lowest index on ties, NaN never wins (all NaN: 0).
DEV bool arg_better(float av, int ai, float bv, int bi) {
    const bool an = isnan(av), bn = isnan(bv);
    if (an != bn) return bn;
    if (!an && av != bv) return av > bv;
    return ai < bi;
}

// Reduce one (value, index) candidate per thread to the block's best; thread 0 returns it.
DEV void arg_reduce(float& bv, int& bi, float* sv, int* si) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (arg_better(ov, oi, bv, bi)) {
            bv = ov;
            bi = oi;
        }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        sv[warp] = bv;
        si[warp] = bi;
    }
    __syncthreads();
    if (warp == 0) {
        const int warps = blockDim.x >> 5;
        bv = lane < warps ? sv[lane] : __int_as_float(0x7fffffff);
        bi = lane < warps ? si[lane] : 0x7fffffff;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (arg_better(ov, oi, bv, bi)) {
                bv = ov;
                bi = oi;
            }
        }
    }
}

// result[r] = argmax of row r of x (rows of `len` values). grid (G, rows), 256 threads: block g
// of row r reduces a contiguous slice of the row to one candidate in part_v/part_i[r * G + g];
// the last of the row's blocks to finish (a ticket taken after a memory fence) reduces the G
// candidates and resets the row's ticket for the next launch. With G = 1 the block writes the
// result itself. Ties go to the lowest index whichever block finishes last, so the result is
// deterministic.
extern "C" __global__ void argmax_f32(const float* __restrict__ x, int len, float* part_v,
                                      int* part_i, int* tickets, int* __restrict__ result) {
    kernel_start();
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ bool last;
    const int G = gridDim.x, r = blockIdx.y;
    x += (size_t)r * len;
    part_v += (size_t)r * G;
    part_i += (size_t)r * G;
    const int per = (len + G - 1) / G;
    const int begin = blockIdx.x * per, end = min(len, begin + per);
    float bv = __int_as_float(0x7fffffff);
    int bi = 0x7fffffff;
#pragma unroll 4
    for (int i = begin + threadIdx.x; i < end; i += blockDim.x) {
        const float v = x[i];
        if (arg_better(v, i, bv, bi)) {
            bv = v;
            bi = i;
        }
    }
    arg_reduce(bv, bi, sv, si);
    if (G == 1) {
        if (threadIdx.x == 0) result[r] = bi == 0x7fffffff ? 0 : bi;
        return;
    }
    if (threadIdx.x == 0) {
        part_v[blockIdx.x] = bv;
        part_i[blockIdx.x] = bi;
        __threadfence();
        last = atomicAdd(tickets + r, 1) == G - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    bv = __int_as_float(0x7fffffff);
    bi = 0x7fffffff;
    for (int g = threadIdx.x; g < G; g += blockDim.x) {
        const float v = __ldcg(part_v + g);
        const int i = __ldcg(part_i + g);
        if (arg_better(v, i, bv, bi)) {
            bv = v;
            bi = i;
        }
    }
    __syncthreads();
    arg_reduce(bv, bi, sv, si);
    if (threadIdx.x == 0) {
        result[r] = bi == 0x7fffffff ? 0 : bi;
        tickets[r] = 0;
    }
}

// BETA-MON: entropy of softmax(x) from the moments of the logits around their running max m:
// S = sum e^(x - m) and T = sum (x - m) e^(x - m); then H = ln S - T / S nats. Both terms are
// >= 0 (ln S <= H and -T / S = H - ln S), so H is a sum without cancellation and f32 moments
// keep its relative error near the f32 rounding of the sums. Any logit that is not finite makes
// S or T NaN, as in the host reference (src/telemetry/beta_monitor).
struct Moments {
    float m, s, t;
};

// No logit yet (s = 0; the merges skip it).
DEV Moments moments_empty() { return {NEG_INF, 0.0f, 0.0f}; }

DEV void moments_add(Moments& a, float x) {
    if (x > a.m) { // a new max: rescale what came before, if anything did
        if (a.s != 0.0f) {
            const float d = a.m - x, e = expf(d);
            a.t = e * (a.t + d * a.s);
            a.s = e * a.s;
        }
        a.m = x;
    }
    const float z = x - a.m, e = expf(z);
    a.s += e;
    a.t += z * e;
}

DEV Moments moments_merge(Moments a, Moments b) {
    if (b.s == 0.0f) return a;
    if (a.s == 0.0f) return b;
    const float m = fmaxf(a.m, b.m);
    const float da = a.m - m, db = b.m - m, ea = expf(da), eb = expf(db);
    return {m, ea * a.s + eb * b.s, ea * (a.t + da * a.s) + eb * (b.t + db * b.s)};
}

DEV Moments moments_shfl(Moments a, int o) {
    return {__shfl_xor_sync(0xffffffffu, a.m, o), __shfl_xor_sync(0xffffffffu, a.s, o),
            __shfl_xor_sync(0xffffffffu, a.t, o)};
}

// Merges the block's moments in a fixed order; the result is valid in thread 0.
DEV Moments moments_reduce(Moments a, Moments* shared) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) a = moments_merge(a, moments_shfl(a, o));
    __syncthreads();
    if (lane == 0) shared[warp] = a;
    __syncthreads();
    if (warp == 0) {
        a = lane < warps ? shared[lane] : moments_empty();
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) a = moments_merge(a, moments_shfl(a, o));
    }
    return a;
}

// result[0] = entropy in bits of softmax(x[0..len)). grid (G <= 256 blocks), 256 threads, the
// same scheme as argmax_f32: block g reduces a contiguous slice into part[g], part[G + g],
// part[2G + g]; the last block to finish merges the G partials in index order (so the result
// does not depend on which block is last) and resets the ticket.
extern "C" __global__ void entropy_f32(const float* __restrict__ x, int len, float* part,
                                       int* ticket, float* __restrict__ result) {
    kernel_start();
    __shared__ Moments shared[32];
    __shared__ bool last;
    const int per = (len + gridDim.x - 1) / gridDim.x;
    const int begin = blockIdx.x * per, end = min(len, begin + per);
    Moments a = moments_empty();
#pragma unroll 4
    for (int i = begin + threadIdx.x; i < end; i += blockDim.x) moments_add(a, x[i]);
    a = moments_reduce(a, shared);
    const int g = gridDim.x;
    if (threadIdx.x == 0) {
        part[blockIdx.x] = a.m;
        part[g + blockIdx.x] = a.s;
        part[2 * g + blockIdx.x] = a.t;
        __threadfence();
        last = atomicAdd(ticket, 1) == g - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    a = moments_empty();
    for (int b = threadIdx.x; b < g; b += blockDim.x)
        a = moments_merge(a, {__ldcg(part + b), __ldcg(part + g + b), __ldcg(part + 2 * g + b)});
    __syncthreads();
    a = moments_reduce(a, shared);
    if (threadIdx.x == 0) {
        result[0] = (logf(a.s) - a.t / a.s) * 1.4426950408889634f; // nats to bits
        *ticket = 0;
    }
}

// The f32 norms of the architecture's choices (src/model/architecture.rs), one row per block,
// the row staged in shared memory (d floats, dynamic), from `x` into `out` (may be `x`):
//   mode 0: out = norm(x)             (the loop norm)
//   mode 1: out = x + norm(delta)     (sandwich block)
//   mode 2: out = norm(x + delta)     (sandwich block, norm after the residual add)
// With `w2`, the result is normalized again by that norm (the loop norm of a stream whose last
// sublayer output was pending), exactly as a second launch in mode 0 would.
extern "C" __global__ void norm_state_rows(const float* x, float* out,
                                           const float* __restrict__ delta, int mode, int d,
                                           int layer_norm, float eps,
                                           const f16_t* __restrict__ w,
                                           const f16_t* __restrict__ b, int has_bias,
                                           int layer_norm2, float eps2,
                                           const f16_t* __restrict__ w2,
                                           const f16_t* __restrict__ b2, int has_bias2) {
    kernel_start();
    extern __shared__ __align__(16) float srow[];
    __shared__ float scratch[32];
    const float* row = x + (size_t)blockIdx.x * d;
    float* dst = out + (size_t)blockIdx.x * d;
    const float* add = delta + (size_t)blockIdx.x * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x)
        srow[i] = mode == 0 ? row[i] : mode == 1 ? add[i] : __fadd_rn(row[i], add[i]);
    __syncthreads();
    float mean, inv;
    staged_row_stats(srow, d, layer_norm, eps, scratch, &mean, &inv);
    // Every thread has read the whole row once the statistics return (their reduction ends in
    // a barrier), so each may overwrite its own values of it.
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const float normed = staged_normed(srow, i, mean, inv, w, b, has_bias);
        const float result = mode == 1 ? __fadd_rn(row[i], normed) : normed;
        if (w2) {
            srow[i] = result;
        } else {
            dst[i] = result;
        }
    }
    if (!w2) return;
    __syncthreads();
    staged_row_stats(srow, d, layer_norm2, eps2, scratch, &mean, &inv);
    for (int i = threadIdx.x; i < d; i += blockDim.x)
        dst[i] = staged_normed(srow, i, mean, inv, w2, b2, has_bias2);
}

// x[r * width + i] += bias[i] for `rows` rows. grid (rows, ceil(width / blockDim.x)).
extern "C" __global__ void add_bias(float* __restrict__ x, int width,
                                    const f16_t* __restrict__ bias) {
    kernel_start();
    const int r = blockIdx.x, i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i < width) x[(size_t)r * width + i] = __fadd_rn(x[(size_t)r * width + i], f16_to_f32(bias[i]));
}

// x[i] *= factor over `len` values.
extern "C" __global__ void scale_f32(float* __restrict__ x, int len, float factor) {
    kernel_start();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < len; i += gridDim.x * blockDim.x)
        x[i] = __fmul_rn(x[i], factor);
}
