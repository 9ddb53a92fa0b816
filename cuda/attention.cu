// Causal attention over the KV cache, for prefill and decode: over f16 entries (the fp16 mode,
// and the K and V that the h modes recompute), or over quantized entries read through the
// cache layout (kv.cuh: INT8, delta chains, age tiers), summed over the application's chain.
// Multi-row steps of the fp16 mode go to flash.cu instead when it takes the head dimension.
//
// grid (n_heads, rows, splits), 128 threads. Row r attends to positions 0..=row_position(r) of
// its sequence, read from the step block in device memory (so a captured decode graph replays at
// any position); in a step over a KV pool each row reads its own sequence's entries through its
// page table (common.cuh `row_pages`, found once per block; the pass over V reuses the entry
// indices that the pass over K looked up). With splits > 1 each block takes one slice of the
// positions and writes a partial (max, sum, un-normalized output); the last of the split blocks
// to finish merges them (flash-decoding, with the combine fused through a ticket counter). The
// slices are the positions cut in `splits` (span 0), or in slices of `span` positions, of which
// a row uses as many as its positions fill: then a row's result depends on its position only,
// never on the rows it runs with.
//
// With `depth` set (a depth mask, src/kv/mod.rs `Depths`), positions t with depth[t] < need did
// not reach this slot's loop iteration: their scores are -inf, so they take no weight. A warp or
// split whose positions are all left out keeps m = -inf and l = 0, which the merges skip.
//
// With `rope` set (decode, one row), the kernel also does rope_kv's work: it rotates q, and the
// block whose slice ends at the current position rotates that position's K and takes K and V
// from shared memory instead of the cache; the first query head of each KV head writes them to
// the cache (which no block of this launch reads at that position).
//
// Inside a block each warp takes 32 positions at a time, one per lane: the lane computes q . k
// for its position (q rounded to f16 as the contract says), the warp updates an online softmax,
// then accumulates p * v with lanes over head dimensions. Scores are f32, the output is rounded to
// f16 once, after the final division, like the CPU reference. V is read so that the loads of
// many positions are in flight together: a lane holds consecutive head dimensions (a position's
// values or codes for them in one load), loads for 8 to 16 positions are issued before any is
// used (for codes, the code and scale kinds pick widths and addresses, not branches), and codes
// become f32 by byte permutes instead of integer conversions (exact, so the sums are unchanged).
#include "kv.cuh"

#define ATT_THREADS 128
#define ATT_WARPS (ATT_THREADS / 32)
#define ATT_MAX_HD 256
// Blocks an SM keeps of the f16-entry kernels: five up to hd 128 (a register or two spilled at
// most), which their short blocks (one pass over 32 positions per warp in an engine's slices)
// need to cover the loads' latency.
#define ATT_BLOCKS(DJ) ((DJ) <= 4 ? 5 : 1)

// Whether position t reached the iteration `need` under the depth mask (always without one).
DEV bool reached(const unsigned* depth, unsigned need, int t) { return !depth || depth[t] >= need; }

// Merge `splits` partials (max, sum, un-normalized output) of one (row, head) into `out` (hd
// values), by the calling block (at most 128 splits). Reads go to L2 (__ldcg): the partials were
// written by other blocks. The order of additions is fixed (split 0 first).
DEV void combine_splits(const float* P, int hd, int splits, f16_t* out) {
    __shared__ float weight[128], sm[128], sl[128];
    __shared__ float total;
    for (int s = threadIdx.x; s < splits; s += blockDim.x) {
        sm[s] = __ldcg(P + s * (hd + 2));
        sl[s] = __ldcg(P + s * (hd + 2) + 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float M = NEG_INF;
        for (int s = 0; s < splits; s++)
            if (sl[s] > 0.0f) M = fmaxf(M, sm[s]);
        float L = 0.0f;
        for (int s = 0; s < splits; s++) {
            const float w = sl[s] > 0.0f ? expf(sm[s] - M) : 0.0f;
            weight[s] = w;
            L += sl[s] * w;
        }
        total = L;
    }
    __syncthreads();
    const float L = total;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float a = 0.0f;
#pragma unroll 8
        for (int s = 0; s < splits; s++) {
            const float w = weight[s];
            const float v = __ldcg(P + s * (hd + 2) + 2 + d);
            if (w != 0.0f) a += v * w;
        }
        out[d] = f32_to_f16(__fdiv_rn(a, L));
    }
}

// Where a quantized launch reads its entries: the cache bytes, their layout, and the chain of
// slots whose entries sum to the application's K and V. Kernels take it as a __grid_constant__
// parameter, so reading it through a reference costs no per-thread copy.
struct QuantKv {
    u8* base;
    KvDesc d;
    int first, count, stride;
};

// The dot product of q (f32 in shared memory) with a quantized K row of `hd` codes, summed in
// element order. With `vec` (hd a multiple of 32) every 16-byte word of the row is loaded before
// the first product, so the row costs one memory latency: at most 2 * DJ words of INT8 codes
// (hd <= 32 * DJ).
template <int DJ>
DEV float dot_codes(const float* sq, const u8* k, int hd, int codes, bool vec) {
    float dot = 0.0f;
    if (!vec) {
        for (int i = 0; i < hd; i++) dot = fmaf(sq[i], kv_code(k, i, codes), dot);
        return dot;
    }
    const int words = codes == KV_I8 ? hd / 16 : hd / 32;
    uint4 w[2 * DJ];
#pragma unroll
    for (int c = 0; c < 2 * DJ; c++)
        w[c] = c < words ? *(const uint4*)(k + 16 * c) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int c = 0; c < 2 * DJ; c++) {
        if (c >= words) break;
        const u32 ws[4] = {w[c].x, w[c].y, w[c].z, w[c].w};
        const int per = codes == KV_I8 ? 4 : 8; // codes per 32-bit word
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float* q = sq + (4 * c + i) * per;
            const float4 qa = *(const float4*)q;
            if (codes == KV_I8) {
                const u32 biased = ws[i] ^ 0x80808080u;
                dot = fmaf(qa.x, i8_code(biased, 0), dot);
                dot = fmaf(qa.y, i8_code(biased, 1), dot);
                dot = fmaf(qa.z, i8_code(biased, 2), dot);
                dot = fmaf(qa.w, i8_code(biased, 3), dot);
            } else {
                const float4 qb = *(const float4*)(q + 4);
                dot = fmaf(qa.x, i4_code(ws[i], 0), dot);
                dot = fmaf(qa.y, i4_code(ws[i], 1), dot);
                dot = fmaf(qa.z, i4_code(ws[i], 2), dot);
                dot = fmaf(qa.w, i4_code(ws[i], 3), dot);
                dot = fmaf(qb.x, i4_code(ws[i], 4), dot);
                dot = fmaf(qb.y, i4_code(ws[i], 5), dot);
                dot = fmaf(qb.z, i4_code(ws[i], 6), dot);
                dot = fmaf(qb.w, i4_code(ws[i], 7), dot);
            }
        }
    }
    return dot;
}

// A lane's V codes for head dimensions first .. first + DJ of a quantized row (DJ consecutive
// elements: DJ bytes of INT8 codes, or DJ / 2 bytes of INT4 codes, the byte that holds the
// element for DJ = 1), in one load whose width the code kind picks without a branch.
template <int BYTES> DEV uint2 load_bytes(const u8* p) {
    if (BYTES == 8) return *(const uint2*)p;
    if (BYTES == 4) return make_uint2(*(const u32*)p, 0u);
    if (BYTES == 2) return make_uint2(*(const unsigned short*)p, 0u);
    return make_uint2(*p, 0u);
}

// A lane's DJ consecutive f16 values of a row (f16 entries' V), as words of two.
template <int DJ> struct Halves {
    u32 w[(DJ + 1) / 2];
};

template <int DJ> DEV float half_at(const Halves<DJ>& v, int j) {
    return j & 1 ? hi_f16(v.w[j / 2]) : lo_f16(v.w[j / 2]);
}

// Values first .. first + DJ of `row`: one load where `whole` (hd a multiple of DJ, so the lane's
// values are aligned and inside the head), else one per value inside the head (the rest zero).
template <int DJ> DEV Halves<DJ> lane_halves(const f16_t* row, int first, int hd, bool whole) {
    Halves<DJ> v;
    if (whole) {
        const f16_t* p = row + first;
        if constexpr (DJ == 8) {
            const uint4 x = *(const uint4*)p;
            v.w[0] = x.x, v.w[1] = x.y, v.w[2] = x.z, v.w[3] = x.w;
        } else if constexpr (DJ == 4) {
            const uint2 x = *(const uint2*)p;
            v.w[0] = x.x, v.w[1] = x.y;
        } else if constexpr (DJ == 2) {
            v.w[0] = *(const u32*)p;
        } else {
            v.w[0] = *(const unsigned short*)p;
        }
        return v;
    }
#pragma unroll
    for (int i = 0; i < (DJ + 1) / 2; i++) {
        const int d = first + 2 * i;
        const u32 lo = d < hd ? *(const unsigned short*)(row + d) : 0u;
        const u32 hi = d + 1 < hd ? *(const unsigned short*)(row + d + 1) : 0u;
        v.w[i] = lo | hi << 16;
    }
    return v;
}

template <int DJ> DEV uint2 lane_codes(const u8* row, int first, int codes) {
    return codes == KV_I8 ? load_bytes<DJ>(row + first) : load_bytes<(DJ + 1) / 2>(row + first / 2);
}

// Element j of lane_codes' word as f32; `nibble` is the nibble of element 0 (first & 1 for INT4
// codes with DJ = 1, else 0).
DEV float lane_code(uint2 raw, int j, int codes, int nibble) {
    if (codes == KV_I8) return i8_code((j < 4 ? raw.x : raw.y) ^ 0x80808080u, j & 3);
    return i4_code(raw.x, nibble + j);
}

template <int DJ, bool Q> // head dimensions per lane: hd <= 32 * DJ; Q: quantized entries
DEV void attention(const float* __restrict__ qkv, const int* __restrict__ step, int n_heads,
                   int n_kv_heads, int hd, float scale, const f16_t* __restrict__ kc,
                   const f16_t* __restrict__ vc, int slot, long long slot_stride, int splits,
                   int span, f16_t* __restrict__ out, float* partial, int* tickets,
                   const float* __restrict__ rope, const QuantKv& qk,
                   const unsigned* __restrict__ depth, unsigned need) {
    __shared__ __align__(16) float sq[ATT_MAX_HD];
    __shared__ __align__(16) f16_t sk[ATT_MAX_HD], sv[ATT_MAX_HD];
    __shared__ float sm[ATT_WARPS], sl[ATT_WARPS];
    __shared__ float sacc[ATT_WARPS][32 * DJ];
    __shared__ KvTierDesc st[3];
    // Quantized entries: where each warp's 32 positions keep V (byte offsets of codes and
    // scales, and the tier's kinds), written by the lane that owns the position.
    __shared__ long long v_codes[ATT_WARPS][32], v_scales[ATT_WARPS][32];
    __shared__ int v_kinds[ATT_WARPS][32];
    // f16 entries: where each warp's 32 positions are (their entry index), likewise.
    __shared__ int v_entries[ATT_WARPS][32];
    if (Q && threadIdx.x < 3) st[threadIdx.x] = kv_tier(qk.d, threadIdx.x);
    kernel_start();
    const int h = blockIdx.x, r = blockIdx.y, s = blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int q_dim = n_heads * hd, kv_dim = n_kv_heads * hd;
    const int total = row_position(step, r) + 1;
    const int per = span > 0 ? span : (((total + splits - 1) / splits) + 31) & ~31;
    const int active = span > 0 ? (total + span - 1) / span : splits;
    if (s >= active) return;
    const int t_begin = s * per;
    const int t_end = min(total, t_begin + per);
    const int kvh = h / (n_heads / n_kv_heads);
    const RowPages pages = row_pages(step, r);
    const size_t base = (size_t)slot * slot_stride + (size_t)kvh * hd;
    const f16_t* K = kc + base;
    const f16_t* V = vc + base;
    const float* row = qkv + (size_t)r * (q_dim + 2 * kv_dim);
    const float* q = row + (size_t)h * hd;
    // The current position's K and V come from shared memory when this launch rotates them.
    const int own = rope && t_begin < total && t_end == total ? total - 1 : -1;
    if (rope) {
        const int half = hd / 2;
        const float* table = rope + (size_t)(total - 1) * hd;
        for (int i = threadIdx.x; i < half; i += blockDim.x) {
            const float c = table[2 * i], sn = table[2 * i + 1];
            sq[i] = round_f16(__fsub_rn(__fmul_rn(q[i], c), __fmul_rn(q[i + half], sn)));
            sq[i + half] = round_f16(__fadd_rn(__fmul_rn(q[i], sn), __fmul_rn(q[i + half], c)));
            if (own >= 0) {
                const float* k = row + q_dim + (size_t)kvh * hd;
                sk[i] = f32_to_f16(__fsub_rn(__fmul_rn(k[i], c), __fmul_rn(k[i + half], sn)));
                sk[i + half] = f32_to_f16(__fadd_rn(__fmul_rn(k[i], sn), __fmul_rn(k[i + half], c)));
            }
        }
        if (own >= 0) {
            const float* v = row + q_dim + kv_dim + (size_t)kvh * hd;
            for (int i = threadIdx.x; i < hd; i += blockDim.x) sv[i] = f32_to_f16(v[i]);
        }
        __syncthreads();
        if (own >= 0 && h % (n_heads / n_kv_heads) == 0) {
            const size_t entry = (size_t)entry_at(pages, own) * kv_dim;
            f16_t* kd = (f16_t*)K + entry;
            f16_t* vd = (f16_t*)V + entry;
            for (int i = threadIdx.x; i < hd; i += blockDim.x) {
                kd[i] = sk[i];
                vd[i] = sv[i];
            }
        }
    } else {
        for (int i = threadIdx.x; i < hd; i += blockDim.x) sq[i] = round_f16(q[i]);
        __syncthreads();
    }

    float m = NEG_INF, l = 0.0f;
    float acc[DJ];
#pragma unroll
    for (int j = 0; j < DJ; j++) acc[j] = 0.0f;
    const bool vec = (hd & 7) == 0;
    // A lane holds head dimensions d0 .. d0 + DJ of V (consecutive, so that one load brings a
    // position's values): quantized codes as whole words where hd is a multiple of 32, f16
    // values where hd is a multiple of DJ.
    const bool qvec = (hd & 31) == 0, vwhole = hd % DJ == 0;
    const int d0 = DJ * lane, nibble = DJ == 1 ? lane & 1 : 0;
    // Lanes past hd (hd 96 with four per lane: lanes 24..31; for codes only DJ >= 4 leaves any,
    // as they need hd a multiple of 32) hold no dimension; they read the head's first values,
    // which they never use, rather than beyond the head.
    const int d_load = DJ < 4 || d0 < hd ? d0 : 0, v_first = d0 < hd ? d0 : 0;
    for (int t0 = t_begin + warp * 32; t0 < t_end; t0 += ATT_WARPS * 32) {
        const int t = t0 + lane;
        float score = NEG_INF;
        if (Q && t < t_end) {
            const KvTierDesc& tr = st[kv_tier_of(t, step)];
            const int ring_t = kv_ring(entry_at(pages, t), tr.ring);
            const int gb = kv_group_bytes((int)tr.codes, hd);
            const u8* k0 = qk.base + tr.codes_off[0] + ring_t * tr.row_bytes + (size_t)kvh * gb;
            const u8* s0 = qk.base + tr.scales_off[0] + ring_t * tr.scale_row_bytes;
            float dot = 0.0f;
            for (int j = 0; j < qk.count; j++) {
                const long long slot_at = (long long)(qk.first + j * qk.stride) * qk.d.slot_bytes;
                const float ks = kv_scale_value(s0 + slot_at, kvh, (int)tr.scales);
                dot = fmaf(ks, dot_codes<DJ>(sq, k0 + slot_at, hd, (int)tr.codes, qvec), dot);
            }
            score = reached(depth, need, t) ? __fmul_rn(dot, scale) : NEG_INF;
            v_codes[warp][lane] = tr.codes_off[1] + ring_t * tr.row_bytes;
            v_scales[warp][lane] = tr.scales_off[1] + ring_t * tr.scale_row_bytes;
            v_kinds[warp][lane] = (int)tr.codes | (int)tr.scales << 4;
        } else if (!Q && t < t_end) {
            const int e = entry_at(pages, t);
            v_entries[warp][lane] = e;
            const f16_t* k = t == own ? sk : K + (size_t)e * kv_dim;
            float dot = 0.0f;
            if (vec) {
                // All of the row's 16-byte loads first (hd <= 32 * DJ), then the products.
                uint4 kk[4 * DJ];
#pragma unroll
                for (int c = 0; c < 4 * DJ; c++)
                    kk[c] = 8 * c < hd ? *(const uint4*)(k + 8 * c) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
                for (int c = 0; c < 4 * DJ; c++) {
                    if (8 * c >= hd) break;
                    const float4 qa = *(const float4*)(sq + 8 * c);
                    const float4 qb = *(const float4*)(sq + 8 * c + 4);
                    dot = fmaf(qa.x, lo_f16(kk[c].x), dot);
                    dot = fmaf(qa.y, hi_f16(kk[c].x), dot);
                    dot = fmaf(qa.z, lo_f16(kk[c].y), dot);
                    dot = fmaf(qa.w, hi_f16(kk[c].y), dot);
                    dot = fmaf(qb.x, lo_f16(kk[c].z), dot);
                    dot = fmaf(qb.y, hi_f16(kk[c].z), dot);
                    dot = fmaf(qb.z, lo_f16(kk[c].w), dot);
                    dot = fmaf(qb.w, hi_f16(kk[c].w), dot);
                }
            } else {
                for (int d = 0; d < hd; d++) dot = fmaf(sq[d], f16_to_f32(k[d]), dot);
            }
            score = reached(depth, need, t) ? __fmul_rn(dot, scale) : NEG_INF;
        }
        const float m_new = fmaxf(m, warp_max(score));
        // m_new is -inf only while every position so far was left out (a depth mask): nothing
        // is summed yet, and the correction must not be exp(-inf + inf).
        const bool none = m_new == NEG_INF;
        const float p = t < t_end && !none ? expf(score - m_new) : 0.0f;
        const float corr = none ? 1.0f : expf(m - m_new);
        l = l * corr + warp_sum(p);
#pragma unroll
        for (int j = 0; j < DJ; j++) acc[j] *= corr;
        const int count = min(32, t_end - t0);
        // p * v over the chunk's positions, eight positions' loads in flight at a time.
        __syncwarp();
        for (int j0 = 0; Q && j0 < count; j0 += 8) {
            // The chain's entries of eight positions: every load of one chain slot is issued
            // before the first is used.
            float v[8][DJ];
#pragma unroll
            for (int jj = 0; jj < 8; jj++)
#pragma unroll
                for (int j = 0; j < DJ; j++) v[jj][j] = 0.0f;
            for (int c = 0; c < qk.count; c++) {
                const long long slot_at = (long long)(qk.first + c * qk.stride) * qk.d.slot_bytes;
                // First every load (a lane's DJ consecutive head dimensions of each position),
                // then the conversions, so that the eight positions cost one memory latency.
                u32 sbits[8];
                uint2 raw[8];
                int kinds[8];
#pragma unroll
                for (int jj = 0; jj < 8; jj++) {
                    const int pj = (j0 + jj) & 31;
                    const bool valid = j0 + jj < count;
                    kinds[jj] = v_kinds[warp][pj];
                    const u8* vr = qk.base + v_codes[warp][pj] + slot_at;
                    const u8* vsc = qk.base + v_scales[warp][pj] + slot_at;
                    sbits[jj] = valid ? kv_scale_bits(vsc, kvh, kinds[jj] >> 4) : 0u;
                    raw[jj] = valid && qvec ? lane_codes<DJ>(vr, kvh * hd + d_load, kinds[jj] & 15)
                                            : make_uint2(0u, 0u);
                }
#pragma unroll
                for (int jj = 0; jj < 8; jj++) {
                    const bool valid = j0 + jj < count;
                    const int codes = kinds[jj] & 15;
                    const float vs = valid ? kv_scale_of(sbits[jj], kinds[jj] >> 4) : 0.0f;
#pragma unroll
                    for (int j = 0; j < DJ; j++) {
                        float code = 0.0f;
                        if (valid && d0 + j < hd) {
                            const u8* vr = qk.base + v_codes[warp][(j0 + jj) & 31] + slot_at;
                            code = qvec ? lane_code(raw[jj], j, codes, nibble)
                                        : kv_code(vr, kvh * hd + d0 + j, codes);
                        }
                        v[jj][j] += vs * code;
                    }
                }
            }
#pragma unroll
            for (int jj = 0; jj < 8; jj++) {
                const float pj = __shfl_sync(0xffffffffu, p, (j0 + jj) & 31);
                if (j0 + jj < count) {
#pragma unroll
                    for (int j = 0; j < DJ; j++) acc[j] = fmaf(pj, v[jj][j], acc[j]);
                }
            }
        }
        // p * v over the chunk's positions: a position's V is one load per lane (its DJ head
        // dimensions), V_ROUND positions' loads in flight at a time.
        __syncwarp();
        constexpr int V_ROUND = DJ >= 4 ? 8 : 16;
        for (int j0 = 0; !Q && j0 < count; j0 += V_ROUND) {
            Halves<DJ> v[V_ROUND];
#pragma unroll
            for (int jj = 0; jj < V_ROUND; jj++) {
                const int tv = t0 + j0 + jj;
                const int at = min(tv, t_end - 1) - t0;
                const f16_t* vr = tv == own ? sv : V + (size_t)v_entries[warp][at] * kv_dim;
                v[jj] = lane_halves<DJ>(vr, vwhole ? v_first : d0, hd, vwhole);
            }
#pragma unroll
            for (int jj = 0; jj < V_ROUND; jj++) {
                const float pj = __shfl_sync(0xffffffffu, p, (j0 + jj) & 31);
                if (j0 + jj < count) {
#pragma unroll
                    for (int j = 0; j < DJ; j++) acc[j] = fmaf(pj, half_at(v[jj], j), acc[j]);
                }
            }
        }
        m = m_new;
    }

    // Merge the warps of the block.
    if (lane == 0) {
        sm[warp] = m;
        sl[warp] = l;
    }
#pragma unroll
    for (int j = 0; j < DJ; j++) sacc[warp][d0 + j] = acc[j];
    __syncthreads();
    float M = NEG_INF;
    for (int w = 0; w < ATT_WARPS; w++)
        if (sl[w] > 0.0f) M = fmaxf(M, sm[w]);
    float L = 0.0f;
    for (int w = 0; w < ATT_WARPS; w++)
        if (sl[w] > 0.0f) L += sl[w] * expf(sm[w] - M);
    float* P = active > 1 ? partial + (((size_t)r * n_heads + h) * splits + s) * (hd + 2) : nullptr;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float a = 0.0f;
        for (int w = 0; w < ATT_WARPS; w++)
            if (sl[w] > 0.0f) a += sacc[w][d] * expf(sm[w] - M);
        if (active == 1) {
            out[(size_t)r * q_dim + (size_t)h * hd + d] = f32_to_f16(__fdiv_rn(a, L));
        } else {
            P[2 + d] = a;
        }
    }
    if (active == 1) return;
    // Publish this split's partial; the last split block of (row, head) to finish merges them
    // (ticket taken after a fence), so no separate combine launch is needed.
    __shared__ bool last;
    if (threadIdx.x == 0) {
        P[0] = M;
        P[1] = L;
    }
    __threadfence();
    __syncthreads();
    int* ticket = tickets + (size_t)r * n_heads + h;
    if (threadIdx.x == 0) last = atomicAdd(ticket, 1) == active - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    combine_splits(partial + ((size_t)r * n_heads + h) * splits * (hd + 2), hd, active,
                   out + (size_t)r * q_dim + (size_t)h * hd);
    if (threadIdx.x == 0) *ticket = 0;
}

// grid (n_heads, rows, splits), ATT_THREADS threads. f16 entries of `slot` (K at kc + slot *
// slot_stride, V likewise), positions kv_dim apart. `depth`: the depth mask, or null.
#define ATTENTION_KERNEL(DJ)                                                                       \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS, ATT_BLOCKS(DJ)) attention_dj##DJ(    \
        const float* qkv, const int* step, int n_heads, int n_kv_heads, int hd, float scale,       \
        const f16_t* kc, const f16_t* vc, int slot, long long slot_stride, int splits, int span,   \
        f16_t* out, float* partial, int* tickets, const float* rope, const unsigned* depth,        \
        unsigned need) {                                                                           \
        const QuantKv none = {};                                                                   \
        attention<DJ, false>(qkv, step, n_heads, n_kv_heads, hd, scale, kc, vc, slot, slot_stride, \
                             splits, span, out, partial, tickets, rope, none, depth, need);        \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS) attention_q_dj##DJ(                  \
        const float* qkv, const int* step, int n_heads, int n_kv_heads, int hd, float scale,       \
        int splits, int span, f16_t* out, float* partial, int* tickets, const unsigned* depth,     \
        unsigned need, const __grid_constant__ QuantKv qk) {                                       \
        attention<DJ, true>(qkv, step, n_heads, n_kv_heads, hd, scale, nullptr, nullptr, 0, 0,     \
                            splits, span, out, partial, tickets, nullptr, qk, depth, need);        \
    }

ATTENTION_KERNEL(1)
ATTENTION_KERNEL(2)
ATTENTION_KERNEL(4)
ATTENTION_KERNEL(8)
