// Causal attention of a multi-row step over f16 K and V (the fp16 KV mode), on the tensor cores.
//
// grid n_heads x 2 x query tiles, FA_THREADS threads; each warp owns 16 query rows of the block's
// FA_BQ. Row r (position p = start_pos + r) attends to positions 0..p, which fall in the key
// tiles 0..T-1, T = p / FA_BK + 1. Key tiles start at multiples of FA_BK from position 0, whatever
// the step's start. The row's tiles are split in two parts by its own position: part A is tiles
// [0, ceil(T/2)), part B the rest, each summed by its own block with its own running max and sum,
// and the two are merged at the end. So the longest chain of tiles a block runs is half a row's,
// and a row's sums run over the same tiles in the same order however the prompt was chunked:
// tiles outside a row's part are masked entirely and leave its state unchanged.
//
// Per key tile: S = Q·Kᵀ (q rounded to f16, f32 accumulation), scaled in f32 by scale · log2 e;
// an online softmax in f32 in base 2 (running max and sum of the f32 p = 2^(s - m) per row, the
// powers by the special function unit's ex2); p rounded to f16 for P·V (f32
// accumulation). The two parts merge as M = max(mA, mB), L = lA 2^(mA-M) + lB 2^(mB-M),
// O = oA 2^(mA-M) + oB 2^(mB-M); the output O · (1 / L), 1 / L rounded to f32, is rounded to f16
// once (docs/FORMAT.md "Numerics"). The merge is symmetric in its operands, so whichever block
// finishes last may do it. Positions past the step's last row are zero in shared memory, so
// stale cache entries never reach a product.
//
// With a depth mask (`depth` not null, src/kv/mod.rs `Depths`), positions t with depth[t] < need
// did not reach this slot's loop iteration and are masked like positions past a row's own. A part
// may then sum nothing for a row (m = -inf, l = 0); the row's own position is never masked, so
// the other part's m is finite and the merge gives the empty part a factor 0.
//
// K and V tiles are double-buffered in dynamic shared memory (sized by src/backend/cuda/flash.rs):
// the next tile's cp.async copies run while the tensor cores work on this one. Fragments come
// from shared memory through ldmatrix (K as stored; V transposed), rows padded by 16 bytes so
// that the eight row addresses of each 8x8 matrix fall in different banks.
#include "common.cuh"

#define FA_BQ 64 // query rows per block
#define FA_BK 64 // positions per key tile
#define FA_THREADS 128
// Blocks per SM the registers must allow (at most 168 per thread): three blocks' two-stage tiles
// fit the shared memory of sm_90 (the host asks for the largest carve-out), and twelve warps per
// SM hide the latency of each warp's dependent chain (scores, softmax, P·V) better than eight.
#define FA_MIN_BLOCKS 3
// Added to a query tile's ticket when the first of its two blocks has left its partial sums.
#define FA_WRITTEN 16

// Two values rounded to f16 (to nearest even) in one instruction, lo in the lower half.
DEV u32 pack_f16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// Two 8x8 f16 matrices; lanes 0-15 give the row addresses (the others' are not read).
DEV void ldmatrix_x2(u32* r, u32 row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(row));
}

// As ldmatrix_x4, each matrix transposed.
DEV void ldmatrix_x4_trans(u32* r, u32 row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(row));
}

// 2^x by the special function unit (relative error below 2^-22; 2^-inf = 0; results below
// 2^-126 flushed to zero, far under the f16 rounding of the probabilities).
DEV float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// The maximum (sum) over the four lanes of a quad, which hold one row's values.
DEV float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

// The number of key tiles in part A of a row at `pos`: half of its pos / FA_BK + 1, rounded up.
DEV int part_a_tiles(int pos) { return (pos / FA_BK + 2) / 2; }

DEV float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// PART (0: A, 1: B) is the block's part of its rows' key tiles, a template argument so that each
// instantiation keeps only the tile bounds its part can have (registers are the kernel's limit).
template <int HD, int PART>
DEV void flash_attention(const float* __restrict__ qkv, const float* __restrict__ rope,
                         const int* __restrict__ step, int rows,
                         int n_heads, int n_kv_heads, float scale, const f16_t* __restrict__ kc,
                         const f16_t* __restrict__ vc, long long slot_offset,
                         f16_t* __restrict__ out, int* __restrict__ tickets,
                         float* __restrict__ partials, const unsigned* __restrict__ depth,
                         unsigned need) {
    constexpr int SROW = HD + 8; // halves per shared row: padded so fragment loads avoid conflicts
    constexpr int NT = FA_BK / 8; // 8-position column blocks of S
    // Shared memory: K stages 0 and 1, then V stages 0 and 1, each FA_BK rows of SROW halves.
    // Addresses are kept as 32-bit shared offsets, so that every fragment load and copy of a
    // tile is a per-thread base plus a constant the instruction encodes.
    constexpr u32 TILE_BYTES = FA_BK * SROW * 2;
    extern __shared__ __align__(16) unsigned char fa_smem[];
    const u32 smem = smem_addr(fa_smem);
    kernel_start();
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    // Longest work first: the heads vary fastest, then the parts (A, B), then the query tiles,
    // counted down from the last.
    const int h = blockIdx.x % n_heads, unit = blockIdx.x / n_heads;
    const int qt = (rows + FA_BQ - 1) / FA_BQ - 1 - unit / 2;
    constexpr int part = PART;
    const int q0 = qt * FA_BQ;
    const int kvh = h / (n_heads / n_kv_heads);
    const int start = step[STEP_START_POS];
    const int q_dim = n_heads * HD, kv_dim = n_kv_heads * HD;
    const int last = start + rows - 1;
    const int block_first = start + q0, block_last = start + min(q0 + FA_BQ, rows) - 1;
    const int warp_first = start + q0 + warp * 16, warp_last = warp_first + 15;
    const int r0 = q0 + warp * 16 + g, r1 = r0 + 8; // this thread's rows
    const int pos0 = start + r0, pos1 = start + r1;
    // This part's key tiles [lo, hi) for a row at `pos`; both bounds grow with pos.
    auto lo_tile = [&](int pos) { return part == 0 ? 0 : part_a_tiles(pos); };
    auto hi_tile = [&](int pos) { return part == 0 ? part_a_tiles(pos) : pos / FA_BK + 1; };
    const float scale_log2 = __fmul_rn(scale, 1.44269504f); // log2 e, rounded to f32

    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
    float o[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) o[n][e] = 0.0f;

    const f16_t* K = kc + slot_offset + (size_t)kvh * HD;
    const f16_t* V = vc + slot_offset + (size_t)kvh * HD;
    // Tile copies: this thread moves the 16 bytes at column `copy_col` of rows copy_row +
    // COPY_ROWS · i of a tile, for i < FA_BK / COPY_ROWS.
    constexpr int ROW_CHUNKS = HD / 8, COPY_ROWS = FA_THREADS / ROW_CHUNKS;
    static_assert(FA_BK % COPY_ROWS == 0, "a tile is a whole number of copy passes");
    const int copy_row = tid / ROW_CHUNKS, copy_col = (tid % ROW_CHUNKS) * 8;
    const u32 copy_smem = smem + (u32)(copy_row * SROW + copy_col) * 2;
    // Copy key tile kt into stage kt % 2 (positions past the step's last row as zeros).
    auto load_tile = [&](int kt) {
        const u32 ks = copy_smem + (kt & 1) * TILE_BYTES, vs = ks + 2 * TILE_BYTES;
        const int p0 = kt * FA_BK + copy_row;
#pragma unroll
        for (int i = 0; i < FA_BK / COPY_ROWS; i++) {
            const int p = p0 + i * COPY_ROWS;
            const bool in = p <= last;
            const size_t at = in ? (size_t)p * kv_dim + copy_col : 0;
            const u32 so = (u32)(i * COPY_ROWS * SROW * 2);
            cp_async16(ks + so, K + at, in ? 16 : 0);
            cp_async16(vs + so, V + at, in ? 16 : 0);
        }
        cp_async_commit();
    };
    // This lane's row of the 8x8 matrices its ldmatrix loads (matrix mi = lane / 8), as shared
    // offsets within a stage: K fragments as stored, V's transposed.
    const int mrow = lane & 7, mi = lane >> 3;
    const u32 k_frag = smem + (u32)(mrow * SROW + 8 * mi) * 2;
    const u32 k_frag2 = smem + (u32)(mrow * SROW + 8 * (mi & 1)) * 2; // x2 loads: lanes 0-15
    const u32 v_frag =
        smem + 2 * TILE_BYTES + (u32)((8 * (mi & 1) + mrow) * SROW + 8 * (mi >> 1)) * 2;
    const int first_tile = lo_tile(block_first), tiles = hi_tile(block_last);
    if (first_tile < tiles) load_tile(first_tile);
    // Q's fragments, while the first tile's copies are in flight: this thread's dimensions
    // 16c + 2t (+1) and 16c + 8 + 2t (+1) of its two rows, rotated at their positions exactly as
    // rope_kv rotates (pairs (i, i + HD/2), both halves held by the same thread), then rounded.
    u32 qf[HD / 16][4];
    {
        const size_t stride = (size_t)q_dim + 2 * (size_t)kv_dim;
        float2 q[2][HD / 16][2]; // [row][chunk][dims +0 / +8]
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int r = i == 0 ? r0 : r1;
            const float* src = qkv + (size_t)r * stride + (size_t)h * HD + 2 * t;
#pragma unroll
            for (int c = 0; c < HD / 16; c++)
#pragma unroll
                for (int e = 0; e < 2; e++)
                    q[i][c][e] = r < rows ? *(const float2*)(src + 16 * c + 8 * e)
                                          : make_float2(0.0f, 0.0f);
        }
        constexpr int HALF = HD / 2;
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int r = i == 0 ? r0 : r1;
            if (r >= rows) continue;
            const float* table = rope + (size_t)(start + r) * HD;
#pragma unroll
            for (int c = 0; c < HD / 16; c++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    // The lower half's pairs; the partner is HALF dimensions on: HALF / 16 chunks
                    // later, or (HD = 16) the other half of the same chunk.
                    const bool lower = HALF % 16 == 0 ? c < HALF / 16 : e == 0;
                    if (!lower) continue;
                    const int c2 = HALF % 16 == 0 ? c + HALF / 16 : c;
                    const int e2 = HALF % 16 == 0 ? e : 1;
                    const int d = 16 * c + 8 * e + 2 * t; // pairs d and d + 1
                    const float4 cs = *(const float4*)(table + 2 * d);
                    const float2 a = q[i][c][e], b = q[i][c2][e2];
                    q[i][c][e] = make_float2(rotate_a(a.x, b.x, cs.x, cs.y),
                                             rotate_a(a.y, b.y, cs.z, cs.w));
                    q[i][c2][e2] = make_float2(rotate_b(a.x, b.x, cs.x, cs.y),
                                               rotate_b(a.y, b.y, cs.z, cs.w));
                }
        }
#pragma unroll
        for (int c = 0; c < HD / 16; c++) {
            qf[c][0] = pack_f16x2(q[0][c][0].x, q[0][c][0].y);
            qf[c][1] = pack_f16x2(q[1][c][0].x, q[1][c][0].y);
            qf[c][2] = pack_f16x2(q[0][c][1].x, q[0][c][1].y);
            qf[c][3] = pack_f16x2(q[1][c][1].x, q[1][c][1].y);
        }
    }
    for (int kt = first_tile; kt < tiles; kt++) {
        const int k0 = kt * FA_BK;
        if (kt + 1 < tiles) {
            load_tile(kt + 1); // into the stage the previous iteration finished with
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads(); // tile kt is in shared memory for every warp
        const u32 stage = (kt & 1) * TILE_BYTES;
        // Outside the part of every row of this warp, the tile would change nothing.
        if (kt >= lo_tile(warp_first) && kt < hi_tile(warp_last)) {
            float s[NT][4];
#pragma unroll
            for (int j = 0; j < NT; j++) {
#pragma unroll
                for (int e = 0; e < 4; e++) s[j][e] = 0.0f;
#pragma unroll
                for (int c = 0; c < HD / 16; c += 2) {
                    // Positions 8j.., dims 16c + 8·mi: the B fragments of chunks c and c + 1.
                    u32 b[4];
                    const u32 at = stage + (u32)(8 * j * SROW + 16 * c) * 2;
                    if (c + 1 < HD / 16) {
                        ldmatrix_x4(b, k_frag + at);
                        mma16816(s[j], qf[c], b);
                        mma16816(s[j], qf[c + 1], b + 2);
                    } else { // the last chunk of an odd count (HD = 16)
                        ldmatrix_x2(b, k_frag2 + at);
                        mma16816(s[j], qf[c], b);
                    }
                }
            }
            // Scores in log2 units (scale · log2 e), so that p = 2^(s - m) is one ex2.
#pragma unroll
            for (int j = 0; j < NT; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) s[j][e] = __fmul_rn(s[j][e], scale_log2);
            // Mask where a row's part or its position may end inside or before this tile.
            if (kt < lo_tile(warp_last) || kt + 1 >= hi_tile(warp_first)) {
                const bool in0 = kt >= lo_tile(pos0) && kt < hi_tile(pos0);
                const bool in1 = kt >= lo_tile(pos1) && kt < hi_tile(pos1);
#pragma unroll
                for (int j = 0; j < NT; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int p = k0 + 8 * j + 2 * t + (e & 1);
                        if (e >= 2 ? !in1 || p > pos1 : !in0 || p > pos0) s[j][e] = NEG_INF;
                    }
            }
            if (depth) {
#pragma unroll
                for (int j = 0; j < NT; j++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        const int p = k0 + 8 * j + 2 * t + e;
                        if (p <= last && depth[p] < need) {
                            s[j][e] = NEG_INF;
                            s[j][e + 2] = NEG_INF;
                        }
                    }
            }
            float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
            for (int j = 0; j < NT; j++) {
                mx0 = fmaxf(mx0, fmaxf(s[j][0], s[j][1]));
                mx1 = fmaxf(mx1, fmaxf(s[j][2], s[j][3]));
            }
            const float m0 = fmaxf(m[0], quad_max(mx0)), m1 = fmaxf(m[1], quad_max(mx1));
            // A row none of whose positions was summed yet keeps m = -inf; it subtracts 0
            // instead, so that its p and correction are 0 rather than 2^(-inf + inf).
            const float b0 = m0 == NEG_INF ? 0.0f : m0, b1 = m1 == NEG_INF ? 0.0f : m1;
            const float c0 = exp2_approx(m[0] - b0), c1 = exp2_approx(m[1] - b1);
            float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
            for (int j = 0; j < NT; j++) {
                s[j][0] = exp2_approx(s[j][0] - b0);
                s[j][1] = exp2_approx(s[j][1] - b0);
                s[j][2] = exp2_approx(s[j][2] - b1);
                s[j][3] = exp2_approx(s[j][3] - b1);
                sum0 += s[j][0] + s[j][1];
                sum1 += s[j][2] + s[j][3];
            }
            l[0] = l[0] * c0 + quad_sum(sum0);
            l[1] = l[1] * c1 + quad_sum(sum1);
            m[0] = m0;
            m[1] = m1;
            // A correction of 1 (no row's maximum grew: most tiles after the first) changes
            // nothing, so the warp skips the rescale when none of its rows needs one.
            if (__any_sync(0xffffffffu, c0 != 1.0f || c1 != 1.0f)) {
#pragma unroll
                for (int n = 0; n < HD / 8; n++) {
                    o[n][0] *= c0;
                    o[n][1] *= c0;
                    o[n][2] *= c1;
                    o[n][3] *= c1;
                }
            }
#pragma unroll
            for (int kk = 0; kk < FA_BK / 16; kk++) {
                const u32 a[4] = {pack_f16x2(s[2 * kk][0], s[2 * kk][1]),
                                  pack_f16x2(s[2 * kk][2], s[2 * kk][3]),
                                  pack_f16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                  pack_f16x2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
                for (int n = 0; n < HD / 8; n += 2) {
                    // Positions 16kk + 8·(mi & 1), dims 8n + 8·(mi >> 1), transposed: the B
                    // fragments of column blocks n and n + 1.
                    u32 b[4];
                    ldmatrix_x4_trans(b, v_frag + stage + (u32)(16 * kk * SROW + 8 * n) * 2);
                    mma16816(o[n], a, b);
                    mma16816(o[n + 1], a, b + 2);
                }
            }
        }
        __syncthreads(); // every warp is done with this stage before it is loaded again
    }

    // The first of the query tile's two blocks to finish leaves its (o, m, l); the second
    // merges them with its own and writes the output.
    float* slot = partials + ((size_t)qt * n_heads + h) * (FA_BQ * (HD + 2));
    float* slot_m = slot + FA_BQ * HD;
    float* slot_l = slot_m + FA_BQ;
    int* ticket = tickets + (size_t)qt * n_heads + h;
    const int lr0 = warp * 16 + g, lr1 = lr0 + 8; // rows within the tile
    __shared__ int arrival;
    if (tid == 0) arrival = atomicAdd(ticket, 1);
    __syncthreads();
    if (arrival == 0) {
#pragma unroll
        for (int n = 0; n < HD / 8; n++) {
            *(float2*)&slot[lr0 * HD + 8 * n + 2 * t] = make_float2(o[n][0], o[n][1]);
            *(float2*)&slot[lr1 * HD + 8 * n + 2 * t] = make_float2(o[n][2], o[n][3]);
        }
        if (t == 0) {
            slot_m[lr0] = m[0];
            slot_m[lr1] = m[1];
            slot_l[lr0] = l[0];
            slot_l[lr1] = l[1];
        }
        __threadfence();
        __syncthreads();
        if (tid == 0) atomicAdd(ticket, FA_WRITTEN);
        return;
    }
    if (tid == 0) {
        // The partner took the first ticket, so it is running and owes only its stores.
        while (atomicAdd(ticket, 0) < FA_WRITTEN) __nanosleep(64);
        __threadfence();
    }
    __syncthreads();

    // Merge: part A's row sums with part B's, rows that sum no tile of a part (m = -inf, l = 0,
    // o = 0) taking a factor 0 for it. Every row sums tile 0 in part A, and the tile of its own
    // position (never masked), so M is finite.
    float fa[2], fb[2], inv_l[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int lr = i == 0 ? lr0 : lr1;
        const float m_other = __ldcg(&slot_m[lr]), l_other = __ldcg(&slot_l[lr]);
        const float ma = part == 0 ? m[i] : m_other, mb = part == 0 ? m_other : m[i];
        const float la = part == 0 ? l[i] : l_other, lb = part == 0 ? l_other : l[i];
        const float mm = fmaxf(ma, mb);
        fa[i] = ma == mm ? 1.0f : exp2_approx(ma - mm);
        fb[i] = mb == mm ? 1.0f : exp2_approx(mb - mm);
        // The merged sum L, and its reciprocal rounded to f32: one division per row.
        inv_l[i] = __frcp_rn(__fadd_rn(__fmul_rn(la, fa[i]), __fmul_rn(lb, fb[i])));
    }
    // This block's factor, and the partner's.
    const float fm0 = part == 0 ? fa[0] : fb[0], fo0 = part == 0 ? fb[0] : fa[0];
    const float fm1 = part == 0 ? fa[1] : fb[1], fo1 = part == 0 ? fb[1] : fa[1];
    auto merged = [](float mine, float f_mine, float other, float f_other, float inv) {
        return __fmul_rn(__fadd_rn(__fmul_rn(mine, f_mine), __fmul_rn(other, f_other)), inv);
    };
    // The partner's partial sums, every load in flight before the first is used.
    float2 other0[HD / 8], other1[HD / 8];
#pragma unroll
    for (int n = 0; n < HD / 8; n++) {
        other0[n] = __ldcg((const float2*)&slot[lr0 * HD + 8 * n + 2 * t]);
        other1[n] = __ldcg((const float2*)&slot[lr1 * HD + 8 * n + 2 * t]);
    }
    // Each pair of outputs rounded to f16 and stored as one word (even columns: 4-byte aligned).
    u32* out0 = (u32*)(out + (size_t)r0 * q_dim + (size_t)h * HD + 2 * t);
    u32* out1 = (u32*)(out + (size_t)r1 * q_dim + (size_t)h * HD + 2 * t);
#pragma unroll
    for (int n = 0; n < HD / 8; n++) {
        if (r0 < rows)
            out0[4 * n] = pack_f16x2(merged(o[n][0], fm0, other0[n].x, fo0, inv_l[0]),
                                     merged(o[n][1], fm0, other0[n].y, fo0, inv_l[0]));
        if (r1 < rows)
            out1[4 * n] = pack_f16x2(merged(o[n][2], fm1, other1[n].x, fo1, inv_l[1]),
                                     merged(o[n][3], fm1, other1[n].y, fo1, inv_l[1]));
    }
    __syncthreads(); // every read of the partner's slot is done: the ticket is free again
    if (tid == 0) *ticket = 0;
}

// Q comes unrotated from qkv (rope_kv with first_head = n_heads) and is rotated by the table
// `rope` (cos, sin per pair and position). K and V of the step's slot start at kc + slot_offset
// and vc + slot_offset (f16 values), positions kv_dim apart; the host checks 16-byte alignment
// of rows and launches with 2 stages x (K, V) x FA_BK x (HD + 8) halves of dynamic shared memory.
// tickets (zero between launches) and partials hold a slot per (query tile, head): an int,
// FA_BQ x (HD + 2) floats. `depth`: the depth mask, or null.
#define FLASH_KERNEL(HD)                                                                           \
    extern "C" __global__ void __launch_bounds__(FA_THREADS, FA_MIN_BLOCKS)                        \
        flash_attention_hd##HD(const float* qkv, const float* rope, const int* step, int rows,     \
                               int n_heads, int n_kv_heads, float scale, const f16_t* kc,          \
                               const f16_t* vc, long long slot_offset, f16_t* out, int* tickets,   \
                               float* partials, const unsigned* depth, unsigned need) {            \
        if ((blockIdx.x / n_heads) % 2 == 0)                                                       \
            flash_attention<HD, 0>(qkv, rope, step, rows, n_heads, n_kv_heads, scale, kc, vc,      \
                                   slot_offset, out, tickets, partials, depth, need);              \
        else                                                                                       \
            flash_attention<HD, 1>(qkv, rope, step, rows, n_heads, n_kv_heads, scale, kc, vc,      \
                                   slot_offset, out, tickets, partials, depth, need);              \
    }

FLASH_KERNEL(16)
FLASH_KERNEL(32)
FLASH_KERNEL(64)
FLASH_KERNEL(128)
