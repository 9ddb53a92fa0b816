// Causal attention over the KV cache, for prefill and decode: over f16 entries (the fp16 mode,
// and the K and V that the h modes recompute), or over quantized entries read through the
// cache layout (kv.cuh: INT8, delta chains, age tiers), summed over the application's chain.
// Multi-row steps of the fp16 mode go to flash.cu instead when it takes the head dimension.
//
// grid (n_heads, rows, splits), 128 threads. Row r attends to positions 0..=row_position(r) of
// its sequence, read from the step block in device memory (so a captured decode graph replays at
// any position); in a step over a KV pool each row reads its own sequence's entries through its
// page table (common.cuh `row_pages`, found once per block; a position's entry is looked up once
// for both its K and its V). With splits > 1 each block takes one slice of the positions and
// writes a partial (max, sum, un-normalized output); the last to finish of the blocks whose
// slices hold positions merges them (flash-decoding, with the combine fused through a ticket
// counter; blocks past the row's positions have nothing to add and leave at once). The
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
// Inside a block each warp takes a few positions at a time with lanes over head dimensions
// (f16_positions, quant_positions): every load of the group's K and V rows (for codes, of each
// slot of the chain; the code and scale kinds pick widths and addresses, not branches) is in
// flight at once, the lanes' partial q . k of the group are summed by halving exchanges that
// leave each lane one position's score (one exp per lane, not one per position), and the online
// softmax takes the group at once. Codes become f32 by byte permutes instead of integer
// conversions (exact). q is rounded to f16 as the contract says, scores are f32, and the output
// is rounded to f16 once, after the final division, like the CPU reference.
//
// The positions of a (row, head, split) are cut in ATT_WARPS parts, part p taking the groups p,
// p + ATT_WARPS, ... The parts are a block's warps, or, in the `heads` kernels (for launches of
// many blocks), one warp's passes in turn, the block's warps taking ATT_WARPS heads of the row:
// the per-block work (q, the page table, the merges, a split's fence and ticket) then serves
// four heads. The parts and their merge are the same, so the results are the same bits.
#include "kv.cuh"

#define ATT_THREADS 128
#define ATT_WARPS (ATT_THREADS / 32)
#define ATT_MAX_HD 256
// Blocks an SM keeps of the f16-entry kernels up to hd 128: as many as leave a warp the registers
// for two groups of positions' K and V (the one it sums and the next one's loads) without
// spilling, four of the kernels with a head a block and five of those with a head a warp (96
// registers).
#define ATT_BLOCKS(DJ, HEADS) ((DJ) <= 4 ? ((HEADS) ? 5 : 4) : 1)

// Whether position t reached the iteration `need` under the depth mask (always without one).
DEV bool reached(const unsigned* depth, unsigned need, int t) { return !depth || depth[t] >= need; }

// Partial results (running max m, sum l, unnormalized output) merge the same way whether they
// are a block's warps, a warp's parts or a row's splits: M is the largest m of the partials that
// hold positions (l > 0), each partial weighs exp(m - M) (0 without positions), L adds l times
// the weight in order, and an output element adds its partials' values times their weights in
// order, from zero.
DEV float merged_max(float M, float m, float l) { return l > 0.0f ? fmaxf(M, m) : M; }
DEV float merge_weight(float M, float m, float l) { return l > 0.0f ? expf(m - M) : 0.0f; }

// Merge `splits` partials (max, sum, un-normalized output; hd + 2 floats apart) of one (row,
// head) into `out` (hd values), by the calling block (at most 128 splits). Reads go to L2
// (__ldcg): the partials were written by other blocks.
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
        for (int s = 0; s < splits; s++) M = merged_max(M, sm[s], sl[s]);
        float L = 0.0f;
        for (int s = 0; s < splits; s++) {
            weight[s] = merge_weight(M, sm[s], sl[s]);
            L = fmaf(sl[s], weight[s], L);
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
            if (w != 0.0f) a = fmaf(v, w, a);
        }
        out[d] = f32_to_f16(__fdiv_rn(a, L));
    }
}

// combine_splits by one warp (at most 32 splits; lane s holds split s's max and sum), lane l
// writing dimensions DJ * l .. DJ * l + DJ: the same operations in the same order.
template <int DJ> DEV void combine_splits_warp(const float* P, int hd, int splits, f16_t* out) {
    const int lane = threadIdx.x & 31;
    const float m_own = lane < splits ? __ldcg(P + lane * (hd + 2)) : NEG_INF;
    const float l_own = lane < splits ? __ldcg(P + lane * (hd + 2) + 1) : 0.0f;
    float M = NEG_INF;
    for (int s = 0; s < splits; s++)
        M = merged_max(M, __shfl_sync(0xffffffffu, m_own, s), __shfl_sync(0xffffffffu, l_own, s));
    const float w_own = merge_weight(M, m_own, l_own);
    float L = 0.0f;
    for (int s = 0; s < splits; s++)
        L = fmaf(__shfl_sync(0xffffffffu, l_own, s), __shfl_sync(0xffffffffu, w_own, s), L);
    float a[DJ];
#pragma unroll
    for (int j = 0; j < DJ; j++) a[j] = 0.0f;
    const int d0 = DJ * lane;
    for (int s = 0; s < splits; s++) {
        const float w = __shfl_sync(0xffffffffu, w_own, s);
#pragma unroll
        for (int j = 0; j < DJ; j++) {
            if (w != 0.0f && d0 + j < hd)
                a[j] = fmaf(__ldcg(P + s * (hd + 2) + 2 + d0 + j), w, a[j]);
        }
    }
#pragma unroll
    for (int j = 0; j < DJ; j++)
        if (d0 + j < hd) out[d0 + j] = f32_to_f16(__fdiv_rn(a[j], L));
}

// Where a quantized launch reads its entries: the cache bytes, their layout, and the chain of
// slots whose entries sum to the application's K and V. Kernels take it as a __grid_constant__
// parameter, so reading it through a reference costs no per-thread copy.
struct QuantKv {
    u8* base;
    KvDesc d;
    int first, count, stride;
};

// A lane's K or V codes for head dimensions first .. first + DJ of a quantized row (DJ consecutive
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

// Positions a warp takes at once: the loads of their K and V rows are all in flight together.
#define ATT_GROUP(DJ) ((DJ) >= 8 ? 4 : 8)

// log2 of a group's positions (ATT_GROUP: 8 or 4), and which of them a lane's score is after
// group_score: lane L holds position L >> share_shift<G>() of the group.
template <int G> DEV constexpr int group_log() {
    static_assert(G == 8 || G == 4, "a group is 8 or 4 positions");
    return G == 8 ? 3 : 2;
}
template <int G> DEV constexpr int share_shift() { return 5 - group_log<G>(); }

// The score of this lane's position of a group from t0 (lane L: position L >> share_shift): each
// lane's partial q . k over its dimensions (`holds`: the lane has any) summed across the warp,
// first by halving exchanges (at xor 16, 8, ... a lane keeps half of the positions it carries and
// adds its partner's partials of that half), then by a butterfly over the lanes that share the
// position. Positions past t_end or left out by the depth mask score -inf.
template <int G>
DEV float group_score(float (&partial)[G], bool holds, int t0, int t_end, const unsigned* depth,
                      unsigned need, float scale) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < G; j++) partial[j] = holds ? partial[j] : 0.0f;
#pragma unroll
    for (int step = 0; step < group_log<G>(); step++) {
        const int o = 16 >> step, half = (G >> step) / 2;
        const bool upper = lane & o;
#pragma unroll
        for (int j = 0; j < half; j++) {
            const float give = upper ? partial[j] : partial[j + half];
            const float keep = upper ? partial[j + half] : partial[j];
            partial[j] = keep + __shfl_xor_sync(0xffffffffu, give, o);
        }
    }
    float dot = partial[0];
#pragma unroll
    for (int o = 16 >> group_log<G>(); o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    const int t = t0 + (lane >> share_shift<G>());
    return t < t_end && reached(depth, need, t) ? __fmul_rn(dot, scale) : NEG_INF;
}

// The online softmax over a group, all at once: `s` is this lane's position's score
// (group_score). The running maximum m takes the group's, l adds the group's exp(s - m) summed
// by a butterfly over the positions, and acc (the lane's DJ dimensions of the unnormalized
// output) is rescaled once and then adds p * value(j, i) of the positions in order.
template <int G, int DJ, typename Value>
DEV void group_update(float s, Value value, float& m, float& l, float (&acc)[DJ]) {
    constexpr int SHIFT = share_shift<G>();
    float group_max = s;
#pragma unroll
    for (int o = 16; o >= (1 << SHIFT); o >>= 1)
        group_max = fmaxf(group_max, __shfl_xor_sync(0xffffffffu, group_max, o));
    const float m_new = fmaxf(m, group_max);
    // m_new is -inf only while every position so far was left out (a depth mask): nothing is
    // summed yet, and the correction must not be exp(-inf + inf).
    if (m_new == NEG_INF) return;
    const float corr = expf(m - m_new);
    const float p_own = expf(s - m_new);
    float p_sum = p_own;
#pragma unroll
    for (int o = 16; o >= (1 << SHIFT); o >>= 1) p_sum += __shfl_xor_sync(0xffffffffu, p_sum, o);
    l = l * corr + p_sum;
    float p[G];
#pragma unroll
    for (int j = 0; j < G; j++) p[j] = __shfl_sync(0xffffffffu, p_own, j << SHIFT);
#pragma unroll
    for (int i = 0; i < DJ; i++) {
        float a = acc[i] * corr;
#pragma unroll
        for (int j = 0; j < G; j++) a = fmaf(p[j], value(j, i), a);
        acc[i] = a;
    }
    m = m_new;
}

// A group's K and V: each lane's DJ head dimensions of every position of the group.
template <int DJ> struct F16Group {
    Halves<DJ> k[ATT_GROUP(DJ)], v[ATT_GROUP(DJ)];
};

// Loads the group of positions starting at t0 (positions past t_end repeat the last one; the
// caller leaves them out). The current position's entry comes from shared memory when this
// launch rotated it (`own`). Over a KV pool lane j looks up position j's entry in its page table
// and passes it to the warp, so the lookup is not repeated by every lane.
template <int DJ>
DEV F16Group<DJ> load_f16_group(const f16_t* K, const f16_t* V, const f16_t* sk,
                                const f16_t* sv, int own, const RowPages& pages, int kv_dim,
                                int t0, int t_end, int first, int hd, bool whole) {
    constexpr int G = ATT_GROUP(DJ);
    const int lane_t = min(t0 + (int)(threadIdx.x & (G - 1)), t_end - 1);
    const int lane_entry = pages.page ? entry_at(pages, lane_t) : 0;
    F16Group<DJ> g;
#pragma unroll
    for (int j = 0; j < G; j++) {
        const int t = min(t0 + j, t_end - 1);
        const int entry = pages.page ? __shfl_sync(0xffffffffu, lane_entry, j) : t;
        const size_t e = (size_t)entry * kv_dim;
        // own >= 0 first: where it is known to be -1 (the heads kernels) the loads are global.
        const bool mine = own >= 0 && t == own;
        g.k[j] = lane_halves<DJ>(mine ? sk : K + e, first, hd, whole);
        g.v[j] = lane_halves<DJ>(mine ? sv : V + e, first, hd, whole);
    }
    return g;
}

// A part's running max, sum and unnormalized output (the lane's DJ dimensions), from nothing.
template <int DJ> struct PartState {
    float m = NEG_INF, l = 0.0f, acc[DJ] = {};
};

// The f16 entries' pass over positions t_begin .. t_end for parts p_first .. p_end in turn: part
// p takes the groups of G positions that start at t_begin + G * (p + ATT_WARPS * i), lanes over
// head dimensions (lane l holds d0 = DJ * l .. d0 + DJ, as in the output), and hands its state
// to `done(p, state)` when its groups are through. A position's score is the lanes' partial
// products (each over its DJ dimensions in order) summed across the warp (group_score); the
// online softmax then takes the group at once (group_update). The next group's loads, the next
// part's first one included, are issued before this one's sums, so a warp waits for memory once
// per group, not per position, and once per pass, not per part.
template <int DJ, typename Done>
DEV void f16_positions(const float* sq, const f16_t* K, const f16_t* V, const f16_t* sk,
                       const f16_t* sv, int own, const RowPages& pages, int kv_dim, int hd,
                       float scale, int t_begin, int t_end, const unsigned* depth, unsigned need,
                       int p_first, int p_end, Done done) {
    constexpr int G = ATT_GROUP(DJ);
    const int lane = threadIdx.x & 31;
    // Whole: hd a multiple of DJ, so a lane holds all of its DJ dimensions or none (hd 96 with
    // four per lane: lanes 24..31 hold none; they read the head's first values and add nothing).
    const bool whole = hd % DJ == 0;
    const int d0 = DJ * lane;
    const bool holds = d0 < hd;
    const int first = whole && !holds ? 0 : d0;
    float q[DJ];
#pragma unroll
    for (int j = 0; j < DJ; j++) q[j] = d0 + j < hd ? sq[d0 + j] : 0.0f;
    const auto load = [&](int from) {
        return load_f16_group<DJ>(K, V, sk, sv, own, pages, kv_dim, from, t_end, first, hd, whole);
    };
    // Part p's first group starts at first_of(p), later parts' later: once a part has none,
    // neither has any part after it.
    const auto first_of = [&](int p) { return t_begin + G * p; };
    int p = p_first, t0 = first_of(p);
    PartState<DJ> state;
    if (t0 < t_end) {
        F16Group<DJ> cur = load(t0);
        for (;;) {
            int next_p = p, next = t0 + G * ATT_WARPS;
            if (next >= t_end) next = first_of(++next_p);
            const bool more = next_p < p_end && next < t_end;
            F16Group<DJ> nxt;
            if (more) nxt = load(next);
            float partial[G];
#pragma unroll
            for (int j = 0; j < G; j++) {
                float dot = 0.0f;
#pragma unroll
                for (int i = 0; i < DJ; i++) dot = fmaf(q[i], half_at(cur.k[j], i), dot);
                partial[j] = dot;
            }
            const float s = group_score<G>(partial, holds, t0, t_end, depth, need, scale);
            group_update<G, DJ>(s, [&](int j, int i) { return half_at(cur.v[j], i); }, state.m,
                                state.l, state.acc);
            if (next_p != p) {
                done(p, state);
                state = PartState<DJ>();
            }
            if (!more) break;
            cur = nxt;
            p = next_p;
            t0 = next;
        }
        p++;
    }
    for (; p < p_end; p++) done(p, state);
}

// Where a position's quantized entries are (byte offsets from the cache's base, of the chain's
// first slot: K codes, K scales, V codes, V scales) and its tier's kinds (codes | scales << 4).
struct QuantAt {
    long long k_codes, k_scales, v_codes, v_scales;
    int kinds;
};

DEV QuantAt quant_at(const KvTierDesc* st, const RowPages& pages, const int* step, int t) {
    const KvTierDesc& tr = st[kv_tier_of(t, step)];
    const long long ring_t = kv_ring(entry_at(pages, t), tr.ring);
    return {tr.codes_off[0] + ring_t * tr.row_bytes, tr.scales_off[0] + ring_t * tr.scale_row_bytes,
            tr.codes_off[1] + ring_t * tr.row_bytes, tr.scales_off[1] + ring_t * tr.scale_row_bytes,
            (int)tr.codes | (int)tr.scales << 4};
}

// Element d + i of the head whose codes start at element `head` of `row`: from the lane's codes
// (`raw`, loaded by lane_codes) where hd is a multiple of 32, else read alone (0 past hd).
DEV float lane_code_at(uint2 raw, const u8* row, int head, int d, int i, int hd, int codes,
                       int nibble, bool vec) {
    if (vec) return lane_code(raw, i, codes, nibble);
    return d + i < hd ? kv_code(row, head + d + i, codes) : 0.0f;
}

// The quantized entries' pass over positions t_begin .. t_end, laid out as f16_positions: part p
// takes the groups of G positions from t_begin + G * (p + ATT_WARPS * i), lanes over head
// dimensions. For each slot of the application's chain every load of the group (codes and scales
// of K and V) is issued before the first is used; a lane's partial q . k adds, slot by slot,
// the slot's scale times its codes' products (in element order), and V's value is the sum over
// the chain of scale * code. `st`: the cache's tiers (kv_tier), in shared memory.
template <int DJ>
DEV void quant_positions(const float* sq, const KvTierDesc* st, const RowPages& pages,
                         const int* step, int kvh, int hd, float scale, int t_begin, int t_end,
                         const QuantKv& qk, const unsigned* depth, unsigned need, int part,
                         float& m, float& l, float (&acc)[DJ]) {
    constexpr int G = ATT_GROUP(DJ);
    // Lane j finds position j's entries; the warp reads them from here.
    __shared__ QuantAt group_at[ATT_WARPS][G];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // Codes load as whole words where hd is a multiple of 32; lanes past hd (only DJ >= 4 leaves
    // any then) hold no dimension and read the head's first codes, which add nothing.
    const bool vec = (hd & 31) == 0;
    const int d0 = DJ * lane, nibble = DJ == 1 ? lane & 1 : 0;
    const bool holds = d0 < hd;
    const int head = kvh * hd, first = head + (holds ? d0 : 0);
    float q[DJ];
#pragma unroll
    for (int i = 0; i < DJ; i++) q[i] = d0 + i < hd ? sq[d0 + i] : 0.0f;
    for (int t0 = t_begin + G * part; t0 < t_end; t0 += G * ATT_WARPS) {
        __syncwarp();
        if (lane < G) group_at[warp][lane] = quant_at(st, pages, step, min(t0 + lane, t_end - 1));
        __syncwarp();
        float partial[G], v[G][DJ];
#pragma unroll
        for (int j = 0; j < G; j++) {
            partial[j] = 0.0f;
#pragma unroll
            for (int i = 0; i < DJ; i++) v[j][i] = 0.0f;
        }
        for (int c = 0; c < qk.count; c++) {
            const u8* slot = qk.base + (long long)(qk.first + c * qk.stride) * qk.d.slot_bytes;
            u32 k_bits[G], v_bits[G];
            uint2 k_raw[G], v_raw[G];
#pragma unroll
            for (int j = 0; j < G; j++) {
                const QuantAt& at = group_at[warp][j];
                const int codes = at.kinds & 15, scales = at.kinds >> 4;
                k_bits[j] = kv_scale_bits(slot + at.k_scales, kvh, scales);
                v_bits[j] = kv_scale_bits(slot + at.v_scales, kvh, scales);
                k_raw[j] = vec ? lane_codes<DJ>(slot + at.k_codes, first, codes) : make_uint2(0u, 0u);
                v_raw[j] = vec ? lane_codes<DJ>(slot + at.v_codes, first, codes) : make_uint2(0u, 0u);
            }
#pragma unroll
            for (int j = 0; j < G; j++) {
                const QuantAt& at = group_at[warp][j];
                const int codes = at.kinds & 15, scales = at.kinds >> 4;
                float dot = 0.0f;
#pragma unroll
                for (int i = 0; i < DJ; i++) {
                    const float code = lane_code_at(k_raw[j], slot + at.k_codes, head, d0, i, hd,
                                                    codes, nibble, vec);
                    dot = fmaf(q[i], code, dot);
                }
                partial[j] = fmaf(kv_scale_of(k_bits[j], scales), dot, partial[j]);
                const float vs = kv_scale_of(v_bits[j], scales);
#pragma unroll
                for (int i = 0; i < DJ; i++)
                    v[j][i] += vs * lane_code_at(v_raw[j], slot + at.v_codes, head, d0, i, hd,
                                                 codes, nibble, vec);
            }
        }
        const float s = group_score<G>(partial, holds, t0, t_end, depth, need, scale);
        group_update<G, DJ>(s, [&](int j, int i) { return v[j][i]; }, m, l, acc);
    }
}

// The passes of parts p_first .. p_end over positions t_begin .. t_end (see f16_positions), each
// part's state handed to `done(p, state)`.
template <int DJ, bool Q, typename Done>
DEV void part_positions(const float* sq, const f16_t* K, const f16_t* V, const f16_t* sk,
                        const f16_t* sv, int own, const RowPages& pages, int kv_dim, int hd,
                        float scale, int t_begin, int t_end, const KvTierDesc* st, const int* step,
                        int kvh, const QuantKv& qk, const unsigned* depth, unsigned need,
                        int p_first, int p_end, Done done) {
    if constexpr (!Q) {
        f16_positions<DJ>(sq, K, V, sk, sv, own, pages, kv_dim, hd, scale, t_begin, t_end, depth,
                          need, p_first, p_end, done);
    } else {
#pragma unroll 1
        for (int p = p_first; p < p_end; p++) {
            PartState<DJ> state;
            quant_positions<DJ>(sq, st, pages, step, kvh, hd, scale, t_begin, t_end, qk, depth,
                                need, p, state.m, state.l, state.acc);
            done(p, state);
        }
    }
}

// DJ: head dimensions per lane (hd <= 32 * DJ); Q: quantized entries; HEADS: a head per warp.
template <int DJ, bool Q, bool HEADS>
DEV void attention(const float* __restrict__ qkv, const int* __restrict__ step, int n_heads,
                   int n_kv_heads, int hd, float scale, const f16_t* __restrict__ kc,
                   const f16_t* __restrict__ vc, int slot, long long slot_stride, int splits,
                   int span, f16_t* __restrict__ out, float* partial, int* tickets,
                   const float* __restrict__ rope, const QuantKv& qk,
                   const unsigned* __restrict__ depth, unsigned need) {
    constexpr int H = HEADS ? ATT_WARPS : 1; // heads a block takes
    __shared__ __align__(16) float sq_heads[H][ATT_MAX_HD];
    __shared__ __align__(16) f16_t sk[ATT_MAX_HD], sv[ATT_MAX_HD];
    // The parts' results, [head of the block][part].
    __shared__ float sm[H][ATT_WARPS], sl[H][ATT_WARPS];
    __shared__ float sacc[H][ATT_WARPS][32 * DJ];
    __shared__ KvTierDesc st[3];
    if (Q && threadIdx.x < 3) st[threadIdx.x] = kv_tier(qk.d, threadIdx.x);
    kernel_start();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // One head a block (its warps take parts of the positions), or one a warp (it takes every
    // part in turn), the results the same.
    const int h = HEADS ? blockIdx.x * ATT_WARPS + warp : blockIdx.x;
    const int r = blockIdx.y, s = blockIdx.z;
    const bool head_here = h < n_heads;
    const int q_dim = n_heads * hd, kv_dim = n_kv_heads * hd;
    const int total = row_position(step, r) + 1;
    // The splits that hold positions; the others have nothing to add to the merge.
    const int per = span > 0 ? span : (((total + splits - 1) / splits) + 31) & ~31;
    const int active = min(splits, (total + per - 1) / per);
    if (s >= active) return;
    const int t_begin = s * per;
    const int t_end = min(total, t_begin + per);
    const int kvh = (head_here ? h : 0) / (n_heads / n_kv_heads);
    const RowPages pages = row_pages(step, r);
    const size_t base = (size_t)slot * slot_stride + (size_t)kvh * hd;
    const f16_t* K = kc + base;
    const f16_t* V = vc + base;
    const float* row = qkv + (size_t)r * (q_dim + 2 * kv_dim);
    const float* q = row + (size_t)(head_here ? h : 0) * hd;
    float* sq = sq_heads[HEADS ? warp : 0];
    // The current position's K and V come from shared memory when this launch rotates them.
    const int own = !HEADS && rope && t_begin < total && t_end == total ? total - 1 : -1;
    if (!HEADS && rope) {
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
        const int from = HEADS ? lane : threadIdx.x, stride = HEADS ? 32 : blockDim.x;
        if (head_here)
            for (int i = from; i < hd; i += stride) sq[i] = round_f16(q[i]);
        __syncthreads();
    }
    if (!head_here) return;

    // Each part's running max, sum and unnormalized output, in shared memory for the merge.
    float* part_m = sm[HEADS ? warp : 0];
    float* part_l = sl[HEADS ? warp : 0];
    float(*part_acc)[32 * DJ] = sacc[HEADS ? warp : 0];
    const int d0 = DJ * lane;
    const auto done = [&](int p, const PartState<DJ>& state) {
        if (lane == 0) {
            part_m[p] = state.m;
            part_l[p] = state.l;
        }
#pragma unroll
        for (int j = 0; j < DJ; j++) part_acc[p][d0 + j] = state.acc[j];
    };
    // A warp takes every part in turn, or its own.
    part_positions<DJ, Q>(sq, K, V, sk, sv, own, pages, kv_dim, hd, scale, t_begin, t_end, st, step,
                          kvh, qk, depth, need, HEADS ? 0 : warp, HEADS ? ATT_WARPS : warp + 1,
                          done);
    if constexpr (HEADS) {
        __syncwarp();
    } else {
        __syncthreads();
    }
    float M = NEG_INF;
#pragma unroll
    for (int p = 0; p < ATT_WARPS; p++) M = merged_max(M, part_m[p], part_l[p]);
    float weight[ATT_WARPS], L = 0.0f;
#pragma unroll
    for (int p = 0; p < ATT_WARPS; p++) {
        weight[p] = merge_weight(M, part_m[p], part_l[p]);
        L = fmaf(part_l[p], weight[p], L);
    }
    const auto merged = [&](int d) {
        float a = 0.0f;
#pragma unroll
        for (int p = 0; p < ATT_WARPS; p++)
            if (weight[p] != 0.0f) a = fmaf(part_acc[p][d], weight[p], a);
        return a;
    };
    float* P = active > 1 ? partial + (((size_t)r * n_heads + h) * splits + s) * (hd + 2) : nullptr;
    f16_t* o = out + (size_t)r * q_dim + (size_t)h * hd;
    if constexpr (HEADS) {
#pragma unroll
        for (int j = 0; j < DJ; j++) {
            if (d0 + j >= hd) continue;
            const float a = merged(d0 + j);
            if (active == 1) {
                o[d0 + j] = f32_to_f16(__fdiv_rn(a, L));
            } else {
                P[2 + d0 + j] = a;
            }
        }
    } else {
        for (int d = threadIdx.x; d < hd; d += blockDim.x) {
            const float a = merged(d);
            if (active == 1) {
                o[d] = f32_to_f16(__fdiv_rn(a, L));
            } else {
                P[2 + d] = a;
            }
        }
    }
    if (active == 1) return;
    // Publish this split's partial; the last split of (row, head) to finish merges them (ticket
    // taken after a fence), so no separate combine launch is needed.
    __shared__ bool last_block;
    if ((HEADS ? lane : threadIdx.x) == 0) {
        P[0] = M;
        P[1] = L;
    }
    __threadfence();
    int* ticket = tickets + (size_t)r * n_heads + h;
    const float* parts = partial + ((size_t)r * n_heads + h) * splits * (hd + 2);
    if constexpr (HEADS) {
        __syncwarp();
        const bool took_last = lane == 0 && atomicAdd(ticket, 1) == active - 1;
        const bool last = __shfl_sync(0xffffffffu, took_last, 0);
        if (!last) return;
        __threadfence();
        combine_splits_warp<DJ>(parts, hd, active, o);
        if (lane == 0) *ticket = 0;
        return;
    }
    __syncthreads();
    if (threadIdx.x == 0) last_block = atomicAdd(ticket, 1) == active - 1;
    __syncthreads();
    if (!last_block) return;
    __threadfence();
    combine_splits(parts, hd, active, o);
    if (threadIdx.x == 0) *ticket = 0;
}

// grid (n_heads, rows, splits), ATT_THREADS threads; the `heads` kernels take ATT_WARPS heads a
// block (grid.x = ceil(n_heads / ATT_WARPS)) and no rope. f16 entries of `slot` (K at kc + slot *
// slot_stride, V likewise), positions kv_dim apart. `depth`: the depth mask, or null.
#define ATTENTION_KERNEL(NAME, DJ, HEADS)                                                          \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS, ATT_BLOCKS(DJ, HEADS))               \
        NAME(const float* qkv, const int* step, int n_heads, int n_kv_heads, int hd, float scale,  \
             const f16_t* kc, const f16_t* vc, int slot, long long slot_stride, int splits,        \
             int span, f16_t* out, float* partial, int* tickets, const float* rope,                \
             const unsigned* depth, unsigned need) {                                               \
        const QuantKv none = {};                                                                   \
        attention<DJ, false, HEADS>(qkv, step, n_heads, n_kv_heads, hd, scale, kc, vc, slot,       \
                                    slot_stride, splits, span, out, partial, tickets, rope, none,  \
                                    depth, need);                                                  \
    }
#define ATTENTION_Q_KERNEL(NAME, DJ, HEADS)                                                        \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS) NAME(                                \
        const float* qkv, const int* step, int n_heads, int n_kv_heads, int hd, float scale,       \
        int splits, int span, f16_t* out, float* partial, int* tickets, const unsigned* depth,     \
        unsigned need, const __grid_constant__ QuantKv qk) {                                       \
        attention<DJ, true, HEADS>(qkv, step, n_heads, n_kv_heads, hd, scale, nullptr, nullptr,    \
                                   0, 0, splits, span, out, partial, tickets, nullptr, qk, depth,  \
                                   need);                                                          \
    }
#define ATTENTION_KERNELS(DJ)                                                                      \
    ATTENTION_KERNEL(attention_dj##DJ, DJ, false)                                                  \
    ATTENTION_KERNEL(attention_heads_dj##DJ, DJ, true)                                             \
    ATTENTION_Q_KERNEL(attention_q_dj##DJ, DJ, false)                                              \
    ATTENTION_Q_KERNEL(attention_q_heads_dj##DJ, DJ, true)

ATTENTION_KERNELS(1)
ATTENTION_KERNELS(2)
ATTENTION_KERNELS(4)
ATTENTION_KERNELS(8)
