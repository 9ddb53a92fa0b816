// Token sampling (temperature, top-k, top-p) on integers, so that the GPU picks the bit-identical
// token of the CPU reference: src/generate/sampling.rs (`sample_raw`), whose module doc defines
// the rule. Every float operation is an explicitly rounded intrinsic: a plain `a * b + c` could be
// contracted into an FMA and round differently from the CPU.
#include "common.cuh"

#define FULL_MASK 0xffffffffu
#define DRAW_MASK ((1ull << 53) - 1ull)

// Shared with sampling.rs, spelled alike (a unit test there checks the exp_neg constants).
#define Z_MIN (-28.0f)            // below, the mass truncates to 0 anyway
#define MASS_ONE 1099511627776.0f // 2^40: the top token's weight
#define LOG2E 1.442695f
#define LN2_HI 0.69314575f // n * LN2_HI is exact for |n| <= 126
#define LN2_LO 1.4286068e-6f
#define EXP_C1 0.9999998f
#define EXP_C2 0.50000584f
#define EXP_C3 0.16660976f
#define EXP_C4 0.0419162f
#define EXP_C5 0.0077904644f
#define EXP_C6 0.0019497636f

// float4 loads in flight per thread in the passes over the row: with one float at a time, a
// single block is bound by memory latency.
#define UNROLL 4
// Copies of the radix histogram, one per (lane + warp) mod 16: logits crowd into a few digits,
// and without copies the lanes and warps adding to one digit would serialize on one word (the
// 64-bit shared atomic add is a compare-and-swap loop, which also retries under contention).
#define COPIES 16

struct SampleShared {
    union {                      // radix select: weight per digit, copy c of digit d at
        u32 count[256 * COPIES]; // d * COPIES + c; counts for top-k, masses for top-p
        u64 mass[256 * COPIES];
    } hist;
    u64 bins[256];          // the copies summed
    u64 part[32];           // one value per warp: reductions and the scan
    u64 need;               // radix select: weight still to reach inside the chosen digit
    u64 total;              // radix select: the weight of the first pass (top-p: M_k)
    u64 rest;               // inverse CDF: r less the mass before the owner's chunk
    float arg_v[32];        // argmax fallback: best (value, index) per warp
    int arg_i[32];
    u32 prefix; // radix select: the key digits chosen so far
    int owner;  // inverse CDF: the warp whose chunk holds r
};

// Order-preserving key: a larger key is a larger value; NaN gets 0, below -inf.
DEV u32 order_key(float v) {
    const u32 b = __float_as_uint(v);
    if ((b & 0x7fffffffu) > 0x7f800000u) return 0u;
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The value of a non-zero key.
DEV float key_value(u32 k) { return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k); }

// e^z for z in [-87, 0], operation for operation as in sampling.rs: z = n ln2 + r, e^r by a
// degree-6 polynomial, 2^n from exponent bits (n >= -126, so a normal number).
DEV float exp_neg(float z) {
    const float n = floorf(__fmul_rn(z, LOG2E));
    const float r = __fsub_rn(__fsub_rn(z, __fmul_rn(n, LN2_HI)), __fmul_rn(n, LN2_LO));
    float p = EXP_C6;
    p = __fadd_rn(__fmul_rn(p, r), EXP_C5);
    p = __fadd_rn(__fmul_rn(p, r), EXP_C4);
    p = __fadd_rn(__fmul_rn(p, r), EXP_C3);
    p = __fadd_rn(__fmul_rn(p, r), EXP_C2);
    p = __fadd_rn(__fmul_rn(p, r), EXP_C1);
    p = __fadd_rn(__fmul_rn(p, r), 1.0f);
    return __fmul_rn(p, __uint_as_float((u32)((int)n + 127) << 23));
}

// Fixed-point weight of one logit (0 for NaN, -inf, far below the max, or a negative scale).
DEV u64 token_mass(float logit, float max, float inv_temp) {
    const float z = __fmul_rn(__fsub_rn(logit, max), inv_temp);
    if (!(z >= Z_MIN && z <= 0.0f)) return 0ull;
    return __float2ull_rz(__fmul_rn(exp_neg(z), MASS_ONE));
}

// Calls f(logit, index, valid) for the indices of [begin, end) that thread `me` of a group of
// `size` threads (the block, or a warp) owns: me, me + size, ... counted in float4 units when
// the range is 16-byte aligned (the usual case: a row starts a device allocation), in floats
// for the rest. Every lane of a warp makes the same calls (valid is false past the end).
template <typename F>
DEV void for_range(const float* __restrict__ logits, int begin, int end, int me, int size, F&& f) {
    const int first = me & ~31, lane = me & 31;
    int rest = begin;
    if (((size_t)(logits + begin) & 15) == 0) {
        const float4* quad = (const float4*)(logits + begin);
        const int quads = (end - begin) >> 2;
        for (int base = first; base < quads; base += UNROLL * size) {
            float4 v[UNROLL];
#pragma unroll
            for (int j = 0; j < UNROLL; j++) {
                const int q = base + lane + j * size;
                v[j] = q < quads ? quad[q] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
#pragma unroll
            for (int j = 0; j < UNROLL; j++) {
                const int q = base + lane + j * size, i = begin + 4 * q;
                const bool valid = q < quads;
                f(v[j].x, i, valid);
                f(v[j].y, i + 1, valid);
                f(v[j].z, i + 2, valid);
                f(v[j].w, i + 3, valid);
            }
        }
        rest = begin + 4 * quads;
    }
    for (int base = rest + first; base < end; base += UNROLL * size) {
        float v[UNROLL];
#pragma unroll
        for (int j = 0; j < UNROLL; j++) {
            const int i = base + lane + j * size;
            v[j] = i < end ? logits[i] : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < UNROLL; j++) {
            const int i = base + lane + j * size;
            f(v[j], i, i < end);
        }
    }
}

// for_range over the whole row, split over the block.
template <typename F>
DEV void for_each_logit(const float* __restrict__ logits, int n, F&& f) {
    for_range(logits, 0, n, threadIdx.x, blockDim.x, f);
}

DEV u64 warp_sum_u64(u64 v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// Block-wide max of a u32; every thread gets it.
DEV u32 block_max_u32(u32 v, u64* part) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const u32 x = __shfl_xor_sync(FULL_MASK, v, o);
        v = x > v ? x : v;
    }
    __syncthreads(); // `part` may still be read by a previous helper
    if (lane == 0) part[warp] = v;
    __syncthreads();
    v = lane < warps ? (u32)part[lane] : 0u;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const u32 x = __shfl_xor_sync(FULL_MASK, v, o);
        v = x > v ? x : v;
    }
    return v;
}

// Inclusive scan of a warp's values, lane 0 first.
DEV u64 warp_inclusive_scan(u64 v) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u64 x = __shfl_up_sync(FULL_MASK, v, o);
        if (lane >= o) v += x;
    }
    return v;
}

// Block-wide exclusive scan of a u64 in thread order; `total` gets the sum of all.
DEV u64 block_exclusive_scan(u64 v, u64* part, u64& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const u64 incl = warp_inclusive_scan(v);
    __syncthreads();
    if (lane == 31) part[warp] = incl;
    __syncthreads();
    if (warp == 0) part[lane] = warp_inclusive_scan(lane < warps ? part[lane] : 0ull);
    __syncthreads();
    total = part[warps - 1];
    return (warp > 0 ? part[warp - 1] : 0ull) + incl - v;
}

// The CPU argmax rule: the largest value wins, the lowest index on ties, NaN never wins.
DEV bool arg_beats(float av, int ai, float bv, int bi) {
    const bool an = isnan(av), bn = isnan(bv);
    if (an != bn) return bn;
    if (!an && av != bv) return av > bv;
    return ai < bi;
}

// Keeps the better of each lane's (value, index) and its partners' across the warp.
DEV void warp_arg_reduce(float& bv, int& bi) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(FULL_MASK, bv, o);
        const int oi = __shfl_xor_sync(FULL_MASK, bi, o);
        if (arg_beats(ov, oi, bv, bi)) {
            bv = ov;
            bi = oi;
        }
    }
}

// argmax of x[0..n) (all NaN: 0); valid in thread 0. arg_beats is a strict total order, so the
// reduction order cannot change the winner.
DEV int block_argmax(const float* __restrict__ x, int n, SampleShared& sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    float bv = __int_as_float(0x7fffffff);
    int bi = 0x7fffffff;
    for_each_logit(x, n, [&](float v, int i, bool valid) {
        if (valid && arg_beats(v, i, bv, bi)) {
            bv = v;
            bi = i;
        }
    });
    warp_arg_reduce(bv, bi);
    __syncthreads();
    if (lane == 0) {
        sh.arg_v[warp] = bv;
        sh.arg_i[warp] = bi;
    }
    __syncthreads();
    if (warp == 0) {
        bv = lane < warps ? sh.arg_v[lane] : __int_as_float(0x7fffffff);
        bi = lane < warps ? sh.arg_i[lane] : 0x7fffffff;
        warp_arg_reduce(bv, bi);
    }
    return bi;
}

// The largest key t such that the weight of the keys >= t (among keys >= floor) reaches the
// target. Counting keys (BY_MASS false), the target is `k` and t is the k-th largest key with
// multiplicity (needs 1 <= k < n). Weighing by mass, the target is max(1, top_p * M) for the
// total mass M of the keys >= floor, found by the first pass; `sh.total` gets M, and when M is
// 0 the search stops there (the result is then meaningless).
//
// Four passes over 8-bit digits from the top; each pass histograms the keys whose higher digits
// equal the prefix chosen so far, then warp 0 picks the digit where the weight from the top
// first reaches what is still needed. Integer atomics make the histogram exact and
// deterministic.
template <bool BY_MASS, typename W>
DEV u32 radix_select(const float* __restrict__ logits, int n, float max, float inv_temp, u32 floor,
                     u32 k, float top_p, W* hist, SampleShared& sh) {
    W* copy = hist + ((threadIdx.x + (threadIdx.x >> 5)) & (COPIES - 1));
    u32 prefix = 0;
    for (int pass = 0; pass < 4; pass++) {
        const int shift = 24 - 8 * pass;
        for (int b = threadIdx.x; b < 256 * COPIES; b += blockDim.x) hist[b] = 0;
        __syncthreads();
        for_each_logit(logits, n, [&](float l, int, bool valid) {
            const u32 key = order_key(l);
            if (!valid || key < floor || (pass > 0 && (key >> (shift + 8)) != prefix)) return;
            const W w = BY_MASS ? (W)token_mass(l, max, inv_temp) : (W)1;
            if (w != 0) atomicAdd(copy + ((key >> shift) & 255u) * COPIES, w);
        });
        __syncthreads();
        for (int b = threadIdx.x; b < 256; b += blockDim.x) {
            u64 s = 0;
            // Rotated by digit, so that a warp's lanes read different banks.
#pragma unroll
            for (int c = 0; c < COPIES; c++) s += hist[b * COPIES + ((c + b) & (COPIES - 1))];
            sh.bins[b] = s;
        }
        __syncthreads();
        if (threadIdx.x < 32) {
            // Lane j owns the 8 digits 255 - 8j down to 248 - 8j; the first lane whose inclusive
            // total reaches `need` holds the digit and walks its 8 bins.
            const int lane = threadIdx.x, top = 255 - 8 * lane;
            u64 own = 0;
#pragma unroll
            for (int j = 0; j < 8; j++) own += sh.bins[top - j];
            const u64 incl = warp_inclusive_scan(own);
            u64 need;
            if (pass > 0) {
                need = sh.need;
            } else {
                const u64 total = __shfl_sync(FULL_MASK, incl, 31);
                if (BY_MASS) {
                    need = __double2ull_rz(__dmul_rn((double)top_p, __ull2double_rn(total)));
                    need = need > 0 ? need : 1; // <= total when total > 0, since top_p < 1
                } else {
                    need = k;
                }
                if (lane == 0) sh.total = total;
            }
            const u32 reached = __ballot_sync(FULL_MASK, incl >= need);
            if (reached != 0 && lane == __ffs(reached) - 1) {
                u64 above = incl - own;
                for (int j = 0; j < 8; j++) {
                    const u64 h = sh.bins[top - j];
                    if (above + h >= need) {
                        sh.prefix = (prefix << 8) | (u32)(top - j);
                        sh.need = need - above;
                        break;
                    }
                    above += h;
                }
            }
        }
        __syncthreads();
        if (BY_MASS && sh.total == 0) return 0;
        prefix = sh.prefix;
    }
    return prefix;
}

// Samples one token from logits[0..n) with the parameters of the step block (top_k, inv_temp,
// top_p, draw) and writes it to step[STEP_RESULT]. Launch: grid 1, block 1024 (any multiple of
// 32 from 256 up works); 35360 bytes of static shared memory. n up to 2^23 (exact u64 sums).
//
// Passes over the row (mass is recomputed from the logits each time, no global scratch): the
// max; the top-k cut (4 radix passes, skipped when top_k is 0 or >= n); the top-p cut (4 radix
// passes whose first also sums M_k; skipped when top_p >= 1); then the inverse CDF in index
// order, over per-warp chunks and then over per-thread pieces of the chunk holding r.
extern "C" __global__ void __launch_bounds__(1024)
    sample_token(const float* __restrict__ logits, int n, int* __restrict__ step) {
    __shared__ SampleShared sh;
    kernel_start();
    if (n <= 0) {
        if (threadIdx.x == 0) step[STEP_RESULT] = 0;
        return;
    }
    const u32 top_k = (u32)step[STEP_TOP_K];
    const float inv_temp = __int_as_float(step[STEP_INV_TEMP]);
    const float top_p = __int_as_float(step[STEP_TOP_P]);
    const u64 draw =
        (((u64)(u32)step[STEP_DRAW_HI] << 32) | (u64)(u32)step[STEP_DRAW_LO]) & DRAW_MASK;

    // The max through its key, like the CPU (+0 beats -0; NaN has key 0).
    u32 best = 0;
    for_each_logit(logits, n, [&](float l, int, bool valid) {
        const u32 key = valid ? order_key(l) : 0u;
        best = key > best ? key : best;
    });
    best = block_max_u32(best, sh.part);
    const float max = best != 0 ? key_value(best) : NEG_INF;

    u32 cut = 0;
    if (top_k > 0 && top_k < (u32)n)
        cut = radix_select<false>(logits, n, max, inv_temp, 0u, top_k, 1.0f, sh.hist.count, sh);
    if (top_p < 1.0f) {
        const u32 cut_p =
            radix_select<true>(logits, n, max, inv_temp, cut, 0u, top_p, sh.hist.mass, sh);
        if (sh.total == 0) { // no mass in the top-k set (block-uniform)
            const int t = block_argmax(logits, n, sh);
            if (threadIdx.x == 0) step[STEP_RESULT] = t;
            return;
        }
        cut = cut_p; // a key of the top-k set, so >= the top-k cut
    }

    // Inverse CDF in index order, in two levels. First each warp sums the mass of a contiguous
    // chunk of indices (read coalesced), and a scan over the warps finds the chunk holding r.
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int chunk = ((n + warps - 1) / warps + 128 * UNROLL - 1) & ~(128 * UNROLL - 1);
    u64 own = 0;
    for_range(logits, min(n, warp * chunk), min(n, warp * chunk + chunk), lane, 32,
              [&](float l, int, bool valid) {
                  if (valid && order_key(l) >= cut) own += token_mass(l, max, inv_temp);
              });
    own = warp_sum_u64(own);
    __syncthreads();
    if (lane == 0) sh.part[warp] = own;
    __syncthreads();
    if (warp == 0) {
        const u64 mass = lane < warps ? sh.part[lane] : 0ull;
        const u64 incl = warp_inclusive_scan(mass);
        const u64 total = __shfl_sync(FULL_MASK, incl, 31);
        if (lane == 0) sh.total = total;
        if (total > 0) {
            // 2^-53 is exact, and so is the draw (53 bits) as a double.
            const double u = __dmul_rn(__ull2double_rn(draw), 1.0 / 9007199254740992.0);
            u64 r = __double2ull_rz(__dmul_rn(u, __ull2double_rn(total)));
            r = r < total - 1 ? r : total - 1;
            const u32 over = __ballot_sync(FULL_MASK, incl > r);
            if (lane == __ffs(over) - 1) {
                sh.owner = lane;
                sh.rest = r - (incl - mass);
            }
        }
    }
    __syncthreads();
    if (sh.total == 0) { // no mass at all (block-uniform)
        const int t = block_argmax(logits, n, sh);
        if (threadIdx.x == 0) step[STEP_RESULT] = t;
        return;
    }

    // Then the whole block splits that chunk into contiguous pieces, one per thread; a block
    // scan finds the piece holding the rest of r, and its thread walks it.
    const int piece = (chunk + blockDim.x - 1) / blockDim.x;
    const int chunk_end = min(n, sh.owner * chunk + chunk);
    const int from = min(chunk_end, sh.owner * chunk + (int)threadIdx.x * piece);
    const int to = min(chunk_end, from + piece);
    const u64 rest = sh.rest;
    u64 mine = 0;
    for (int i = from; i < to; i++) {
        const float l = logits[i];
        if (order_key(l) >= cut) mine += token_mass(l, max, inv_temp);
    }
    u64 chunk_mass;
    const u64 before = block_exclusive_scan(mine, sh.part, chunk_mass);
    // Exactly one thread's mass range [before, before + mine) holds the rest.
    if (before <= rest && rest - before < mine) {
        u64 acc = before;
        for (int i = from; i < to; i++) {
            const float l = logits[i];
            if (order_key(l) < cut) continue;
            acc += token_mass(l, max, inv_temp);
            if (acc > rest) {
                step[STEP_RESULT] = i;
                break;
            }
        }
    }
}
