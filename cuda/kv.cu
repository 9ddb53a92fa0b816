// KV cache writes and conversions for the quantized and h modes (src/kv; the CPU reference is
// src/backend/cpu/kv.rs). The fp16 mode keeps its own fused paths (rope_kv, attention).
#include "kv.cuh"

#define KV_THREADS 128

// RoPE of element i of a head (pairs (i, i + hd/2)) from the head's f32 values `x`, rounded like
// the CPU: a*cos - b*sin and a*sin + b*cos, each product and sum rounded separately.
DEV float rotated(const float* x, int i, int hd, const float* table) {
    const int half = hd / 2, p = i < half ? i : i - half;
    const float c = table[2 * p], s = table[2 * p + 1];
    const float a = x[p], b = x[p + half];
    return i < half ? __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s))
                    : __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
}

// Rotate the Q heads of the staged rows and store each row's entries in slot
// `first + (count - 1) * stride`: the rotated K and V (delta modes: minus the sum of the chain's
// earlier slots), or in the h modes the groups of h. grid (rows, n_heads [+ n_kv_heads for K/V
// modes]), KV_THREADS threads; head_dim <= 2 * KV_THREADS.
extern "C" __global__ void __launch_bounds__(KV_THREADS)
    kv_store(float* __restrict__ qkv, const f16_t* __restrict__ h, const int* __restrict__ step,
             int n_heads, int n_kv_heads, int hd, const float* __restrict__ rope, u8* base,
             const __grid_constant__ KvDesc d, int first, int count, int stride) {
    __shared__ float red[32];
    __shared__ float head[2 * KV_THREADS];
    kernel_start();
    const int r = blockIdx.x, y = blockIdx.y;
    const int t = row_position(step, r);
    const int q_dim = n_heads * hd, kv_dim = n_kv_heads * hd;
    float* row = qkv + (size_t)r * (q_dim + 2 * kv_dim);
    const float* table = rope + (size_t)t * hd;
    const int tier = kv_tier_of(t, step);
    // The entry's place: the position, or its place in a KV pool.
    const int pos = entry_index(step, r, t);
    const KvTierDesc tr = kv_tier(d, tier);
    const int own = first + (count - 1) * stride;
    float v[2], stored[2];
    if (y < n_heads) {
        float* q = row + (size_t)y * hd;
        for (int i = threadIdx.x; i < hd; i += blockDim.x) head[i] = q[i];
        __syncthreads();
        for (int i = threadIdx.x; i < hd; i += blockDim.x) q[i] = rotated(head, i, hd, table);
        if (d.tensors != 1) return;
        const f16_t* hr = h + (size_t)r * d.width + (size_t)y * hd;
        for (int k = 0; k < 2; k++) {
            const int i = threadIdx.x + k * blockDim.x;
            v[k] = i < hd ? f16_to_f32(hr[i]) : 0.0f;
        }
        kv_encode(v, hd, y, kv_codes(base, d, tr, 0, own, pos), kv_scales(base, d, tr, 0, own, pos),
                  (int)tr.codes, (int)tr.scales, red, stored);
        return;
    }
    const int g = y - n_heads;
    for (int tensor = 0; tensor < 2; tensor++) {
        const float* src = row + q_dim + (size_t)tensor * kv_dim + (size_t)g * hd;
        __syncthreads();
        for (int i = threadIdx.x; i < hd; i += blockDim.x) head[i] = src[i];
        __syncthreads();
        for (int k = 0; k < 2; k++) {
            const int i = threadIdx.x + k * blockDim.x;
            if (i >= hd) {
                v[k] = 0.0f;
                continue;
            }
            float x = tensor == 0 ? rotated(head, i, hd, table) : head[i];
            float prev = 0.0f;
            if (count > 1) {
                const u8* c0 = kv_codes(base, d, tr, tensor, first, pos);
                const u8* s0 = kv_scales(base, d, tr, tensor, first, pos);
                for (int j = 0; j + 1 < count; j++) {
                    const long long at = (long long)j * stride * d.slot_bytes;
                    const float s = kv_scale_value(s0 + at, g, (int)tr.scales);
                    prev += s * kv_code(c0 + at, g * hd + i, (int)tr.codes);
                }
            }
            v[k] = count > 1 ? __fsub_rn(x, prev) : x;
        }
        kv_encode(v, hd, g, kv_codes(base, d, tr, tensor, own, pos),
                  kv_scales(base, d, tr, tensor, own, pos), (int)tr.codes, (int)tr.scales, red,
                  stored);
    }
}

// Move positions first_pos + blockIdx.x from tier `from` to tier `to` (AGE-KV), for KV head
// blockIdx.y and chain blockIdx.z: chains below n_single are the single pre and post slots, the
// rest the loop blocks over `iterations` iterations (stride n_loop). Each chain is re-encoded in
// iteration order against the new encoding of its earlier iterations (closed loop), as
// cpu/kv.rs `move_tier`. KV_THREADS threads.
extern "C" __global__ void __launch_bounds__(KV_THREADS)
    kv_move(u8* base, const __grid_constant__ KvDesc d, int first_pos, int from, int to, int n_single,
            int iterations, int n_loop) {
    __shared__ float red[32];
    kernel_start();
    const int t = first_pos + blockIdx.x, g = blockIdx.y, c = blockIdx.z;
    const int hd = (int)d.group_size;
    // Pre and post slots are 0..n_single; loop block b's first iteration is slot n_single + b.
    const int first = c;
    const int count = c < n_single ? 1 : iterations;
    const KvTierDesc src = kv_tier(d, from), dst = kv_tier(d, to);
    for (int tensor = 0; tensor < 2; tensor++) {
        float old_sum[2] = {0.0f, 0.0f}, new_sum[2] = {0.0f, 0.0f};
        for (int j = 0; j < count; j++) {
            const int slot = first + j * n_loop;
            float delta[2], stored[2];
            for (int k = 0; k < 2; k++) {
                const int i = threadIdx.x + k * blockDim.x;
                if (i < hd) old_sum[k] += kv_value(base, d, src, tensor, slot, t, g, g * hd + i);
                delta[k] = i < hd ? __fsub_rn(old_sum[k], new_sum[k]) : 0.0f;
            }
            kv_encode(delta, hd, g, kv_codes(base, d, dst, tensor, slot, t),
                      kv_scales(base, d, dst, tensor, slot, t), (int)dst.codes, (int)dst.scales,
                      red, stored);
            for (int k = 0; k < 2; k++) new_sum[k] += stored[k];
        }
    }
}

// The cached h of positions p0 + blockIdx.x of `slot`, dequantized and rounded to f16, into row
// blockIdx.x of `out` (width d.width). grid (rows, n_heads), KV_THREADS threads.
extern "C" __global__ void __launch_bounds__(KV_THREADS)
    h_dequant(u8* base, const __grid_constant__ KvDesc d, int slot, int p0, f16_t* __restrict__ out) {
    kernel_start();
    const int t = p0 + blockIdx.x, g = blockIdx.y, n = (int)d.group_size;
    const KvTierDesc tr = d.tier[0];
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        out[(size_t)blockIdx.x * d.width + (size_t)g * n + i] =
            f32_to_f16(kv_value(base, d, tr, 0, slot, t, g, g * n + i));
}

// K and V of positions p0 + blockIdx.x from the f32 product of h with the K and V weight rows
// (`kv`, rows of 2 * kv_dim): K rotated at its position, both rounded to f16 into `kc` / `vc`
// (rows of kv_dim). grid (rows, ceil((n_kv_heads * hd / 2 + kv_dim) / 256)), 256 threads.
extern "C" __global__ void h_finish(const float* __restrict__ kv, int n_kv_heads, int hd, int p0,
                                    const float* __restrict__ rope, f16_t* __restrict__ kc,
                                    f16_t* __restrict__ vc) {
    kernel_start();
    const int r = blockIdx.x, t = p0 + r;
    const int p = blockIdx.y * blockDim.x + threadIdx.x;
    const int half = hd / 2, kv_dim = n_kv_heads * hd;
    const float* row = kv + (size_t)r * 2 * kv_dim;
    const size_t at = (size_t)t * kv_dim;
    const int pairs = n_kv_heads * half;
    if (p < pairs) {
        const int head = p / half, i = p - head * half;
        const float* x = row + head * hd;
        const float* table = rope + (size_t)t * hd;
        kc[at + head * hd + i] = f32_to_f16(rotated(x, i, hd, table));
        kc[at + head * hd + i + half] = f32_to_f16(rotated(x, i + half, hd, table));
    } else if (p < pairs + kv_dim) {
        const int i = p - pairs;
        vc[at + i] = f32_to_f16(row[kv_dim + i]);
    }
}
