// The KV cache layout and codecs on the device: src/kv/layout.rs defines the layout (passed to
// kernels by value as a KvDesc) and src/kv/codec.rs the quantizers, which these functions
// reproduce operation for operation, so the GPU stores the same codes as the CPU from the same
// values.
#pragma once
#include "common.cuh"

#define KV_F16 0
#define KV_I8 1
#define KV_I4 2
#define SCALE_NONE 0
#define SCALE_F16 1
#define SCALE_E4M3 2

// One tier (src/kv/layout.rs `Tier`); offsets in bytes within a slot, per tensor (K, V; h is 0).
struct KvTierDesc {
    long long ring, codes, scales, row_bytes, scale_row_bytes;
    long long codes_off[2], scales_off[2];
};

// `KvLayout::descriptor`, word for word.
struct KvDesc {
    long long slot_bytes, width, groups, group_size, n_tiers, tensors;
    KvTierDesc tier[3];
};

// Tier `i` of the layout. Indexing the parameter with a run-time index would copy the whole
// struct to the stack of every thread; selecting among constant indices does not.
DEV KvTierDesc kv_tier(const KvDesc& d, int i) {
    return i == 0 ? d.tier[0] : (i == 1 ? d.tier[1] : d.tier[2]);
}

// The tier of position t under the step's age-tier bounds.
DEV int kv_tier_of(int t, const int* step) {
    return t < step[STEP_OLD_END] ? 2 : (t < step[STEP_MID_END] ? 1 : 0);
}

// Ring index of position t in a tier of `ring` positions: no division unless the ring wraps
// (only the age tiers do).
DEV int kv_ring(int t, long long ring) {
    const int r = (int)ring;
    return t < r ? t : t % r;
}

DEV u8* kv_codes(u8* base, const KvDesc& d, const KvTierDesc& tr, int tensor, int slot, int t) {
    return base + slot * d.slot_bytes + tr.codes_off[tensor] + kv_ring(t, tr.ring) * tr.row_bytes;
}

DEV u8* kv_scales(u8* base, const KvDesc& d, const KvTierDesc& tr, int tensor, int slot, int t) {
    return base + slot * d.slot_bytes + tr.scales_off[tensor] +
           kv_ring(t, tr.ring) * tr.scale_row_bytes;
}

// 2^e as an exact f32 (normal range).
DEV float pow2(int e) { return __uint_as_float((u32)(e + 127) << 23); }

DEV float e4m3_value(u32 bits) {
    const int e = (bits >> 3) & 15, m = bits & 7;
    return e == 0 ? (float)m * 0.001953125f : (1.0f + (float)m * 0.125f) * pow2(e - 7);
}

// The smallest E4M3 value >= x (x >= 0), saturating at 448 (codec.rs `e4m3_round_up`).
DEV u32 e4m3_round_up(float x) {
    if (!(x > 0.0f)) return 0;
    if (x >= 448.0f) return 0x7E;
    if (x <= 0.015625f) {
        const int m = (int)ceilf(x * 512.0f);
        return m == 8 ? 0x08 : (u32)m;
    }
    int e = (int)((__float_as_uint(x) >> 23) & 0xFF) - 127;
    const float frac = x / pow2(e);
    int m = (int)ceilf((frac - 1.0f) * 8.0f);
    if (m == 8) {
        e += 1;
        m = 0;
    }
    return (u32)(((e + 7) << 3) | m);
}

// Code i of a quantized row (I8 or I4), as f32.
DEV float kv_code(const u8* row, int i, int codes) {
    if (codes == KV_I8) return (float)(signed char)row[i];
    return (float)((int)((row[i >> 1] >> (4 * (i & 1))) & 15u) - 8);
}

// Byte b (0..3) of a word of INT8 codes as f32, given the word with every byte biased by 128
// (w ^ 0x80808080): the biased byte becomes the low mantissa of 2^23 and 2^23 + 128 is taken
// away. Exact, so equal to the integer conversion, in two instructions off the conversion pipe.
DEV float i8_code(u32 biased, int b) {
    return __int_as_float(__byte_perm(biased, 0x4B000000u, 0x7440u | (u32)b)) - 8388736.0f;
}

// Nibble n (0..7) of a word of INT4 codes (code + 8) as f32, exactly, the same way.
DEV float i4_code(u32 w, int n) {
    return __int_as_float(0x4B000000u | ((w >> (4 * n)) & 15u)) - 8388616.0f;
}

// The bits of a group's scale (f16 or E4M3). The kind picks the address and the width without a
// branch, so the loads of several positions can all be in flight before the first is used.
DEV u32 kv_scale_bits(const u8* scales, int group, int kind) {
    const bool wide = kind == SCALE_F16;
    const u8* at = scales + (wide ? 2 * group : group);
    return wide ? (u32)*(const unsigned short*)at : (u32)*at;
}

DEV float kv_scale_of(u32 bits, int kind) {
    return kind == SCALE_F16 ? f16_to_f32((f16_t)bits) : e4m3_value(bits);
}

DEV float kv_scale_value(const u8* scales, int group, int kind) {
    return kv_scale_of(kv_scale_bits(scales, group, kind), kind);
}

// The stored value of element i (within the whole row) of (tensor, slot, t), group `group`.
DEV float kv_value(u8* base, const KvDesc& d, const KvTierDesc& tr, int tensor, int slot, int t,
                   int group, int i) {
    const u8* row = kv_codes(base, d, tr, tensor, slot, t);
    if (tr.codes == KV_F16) return f16_to_f32(((const f16_t*)row)[i]);
    const float s = kv_scale_value(kv_scales(base, d, tr, tensor, slot, t), group, (int)tr.scales);
    return s * kv_code(row, i, (int)tr.codes);
}

// Store one group of n <= 2 * blockDim.x values (thread-held: v[k] is element
// threadIdx.x + k * blockDim.x) at element offset `group * n` of `row`, with its scale; called by
// every thread of the block. Returns, per element, the value as stored (scale * code).
DEV void kv_encode(const float v[2], int n, int group, u8* row, u8* scales, int codes,
                   int scale_kind, float* red, float stored[2]) {
    if (codes == KV_F16) {
        for (int k = 0; k < 2; k++) {
            const int i = threadIdx.x + k * blockDim.x;
            if (i < n) {
                const f16_t h = f32_to_f16(v[k]);
                ((f16_t*)row)[group * n + i] = h;
                stored[k] = f16_to_f32(h);
            }
        }
        return;
    }
    const float qmax = codes == KV_I8 ? 127.0f : 7.0f;
    float amax = 0.0f;
    for (int k = 0; k < 2; k++)
        if (threadIdx.x + k * blockDim.x < n) amax = fmaxf(amax, fabsf(v[k]));
    amax = block_max(amax, red);
    const float raw = __fdiv_rn(amax, qmax);
    float s;
    u32 bits;
    if (scale_kind == SCALE_F16) {
        bits = f32_to_f16(fminf(raw, 65504.0f));
        s = f16_to_f32((f16_t)bits);
    } else {
        bits = e4m3_round_up(raw);
        s = e4m3_value(bits);
    }
    const bool usable = s > 0.0f && s <= 3.0e38f;
    for (int k = 0; k < 2; k++) {
        const int i = threadIdx.x + k * blockDim.x;
        int q = 0;
        if (usable && i < n && v[k] == v[k])
            q = (int)fminf(fmaxf(rintf(__fdiv_rn(v[k], s)), -qmax), qmax);
        stored[k] = usable ? s * (float)q : 0.0f;
        if (codes == KV_I8) {
            if (i < n) ((signed char*)row)[group * n + i] = (signed char)q;
        } else {
            // Elements 2m and 2m + 1 are held by neighbouring lanes of one warp.
            const int partner = __shfl_down_sync(0xffffffffu, q, 1);
            if (i < n && (i & 1) == 0)
                row[(group * n + i) >> 1] = (u8)((q + 8) | ((partner + 8) << 4));
        }
    }
    if (threadIdx.x == 0) {
        if (scale_kind == SCALE_F16)
            ((f16_t*)scales)[group] = usable ? (f16_t)bits : (f16_t)0;
        else
            scales[group] = usable ? (u8)bits : (u8)0;
    }
}
