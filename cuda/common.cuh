// Shared definitions of the TinyLoop CUDA kernels.
//
// The kernels include no CUDA header: f16 values travel as raw 16-bit words and are converted
// with PTX `cvt`, so NVRTC needs nothing but its built-ins at run time.
//
// Numerics contract (docs/FORMAT.md "Numerics"): f32 residual stream, linear outputs, scores and
// logits; f16 inputs of every linear layer; quantized weights dequantized as scale * q + zero and
// accumulated in f32. Elementwise epilogues use the explicitly rounded intrinsics (__fmul_rn,
// __fadd_rn, ...) so that they round exactly like the CPU reference, which never fuses.
#pragma once

typedef unsigned char u8;
typedef unsigned short f16_t; // raw IEEE binary16 bits
typedef unsigned int u32;
typedef unsigned long long u64;

#define DEV static __device__ __forceinline__

// Layout of a session's step block in device memory (src/backend/cuda/mod.rs, `StepLayout`).
#define STEP_START_POS 0
#define STEP_ROWS 1
#define STEP_RESULT 2 // the chosen token (argmax or sample)
#define STEP_ENTROPY 3   // BETA-MON: entropy in bits of logits rows 0..15, f32 (row 0 next to the token)
#define STEP_TOP_K 19    // sampling: keep the k largest logits (0: all)
#define STEP_INV_TEMP 20 // sampling: 1 / temperature, f32 bits
#define STEP_TOP_P 21    // sampling: nucleus mass, f32 bits
#define STEP_DRAW_LO 22  // sampling: 53-bit uniform draw, low word
#define STEP_DRAW_HI 23  //   and high word
#define STEP_MID_END 24  // KV age tiers: positions below this are in the INT4 tier (src/kv)
#define STEP_OLD_END 25  //   and below this in the FP8-scale tier
#define STEP_PAGE_SIZE 26 // a step over a KV pool: positions per page (0: rows are start_pos + r)
#define STEP_PLACES 27    //   and the word where its places begin (row_position, entry_index)
#define STEP_TOKENS 28

// Position of row r in its sequence: start_pos + r, or in a step over a KV pool the row's own.
// A pooled step's places are rows positions, then rows offsets (from the places' start) of each
// row's page table, then the page tables (src/backend/cuda/step.rs `stage_places`).
DEV int row_position(const int* step, int r) {
    return step[STEP_PAGE_SIZE] ? step[step[STEP_PLACES] + r] : step[STEP_START_POS] + r;
}

// Row r's pages in a step over a KV pool (page 0: the step has no pool), read once so that a
// kernel looking up many positions does not repeat the chain of loads that finds the table.
struct RowPages {
    int page;
    const int* table;
};

DEV RowPages row_pages(const int* step, int r) {
    const int page = step[STEP_PAGE_SIZE];
    if (page == 0) return {0, nullptr};
    const int* places = step + step[STEP_PLACES];
    return {page, places + places[step[STEP_ROWS] + r]};
}

// Where the entry of position t is in the cache: t itself, or in a step over a KV pool its
// page's index times the page size plus its place in the page.
DEV int entry_at(const RowPages& p, int t) {
    return p.page == 0 ? t : p.table[t / p.page] * p.page + t % p.page;
}

DEV int entry_index(const int* step, int r, int t) { return entry_at(row_pages(step, r), t); }

#define NEG_INF (-__int_as_float(0x7f800000))

// Programmatic dependent launch (sm_90+; src/backend/cuda/driver.rs `launch`). A kernel may be
// scheduled while its predecessor on the stream still runs, so each kernel calls
// `wait_for_predecessor` before touching memory that earlier work writes or reads (only immutable
// weights may be loaded before it), then `allow_successor` so that the next kernel's launch
// overlaps this one. Both are no-ops when the kernel was launched without the attribute.
DEV void wait_for_predecessor() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

DEV void allow_successor() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The usual start of a kernel: nothing to prefetch before the predecessor finishes.
DEV void kernel_start() {
    wait_for_predecessor();
    allow_successor();
}

DEV float f16_to_f32(f16_t h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

DEV f16_t f32_to_f16(float f) {
    f16_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// The value an f16 buffer would hold.
DEV float round_f16(float f) { return f16_to_f32(f32_to_f16(f)); }

// d += a * b on the tensor cores: m16n8k16, f16 inputs, f32 accumulation (sm_80 and later).
// Fragments (g = lane / 4, t = lane % 4; the lower 16 bits hold the lower index):
//   a[0]: A[g][2t..2t+1]   a[1]: A[g+8][2t..2t+1]   a[2]: A[g][2t+8..]   a[3]: A[g+8][2t+8..]
//   b[0]: B[2t..2t+1][g]   b[1]: B[2t+8..2t+9][g]
//   d[0..1]: D[g][2t..2t+1]   d[2..3]: D[g+8][2t..2t+1]
DEV void mma16816(float* d, const u32* a, const u32* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Four 8x8 f16 matrices; lane l gives the shared address of row l % 8 of matrix l / 8.
DEV void ldmatrix_x4(u32* r, u32 row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(row));
}

// One rotated pair: (a, b) at angle (c, s), each product rounded as the CPU reference does.
DEV float rotate_a(float a, float b, float c, float s) {
    return __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
}
DEV float rotate_b(float a, float b, float c, float s) {
    return __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
}

DEV float lo_f16(u32 w) { return f16_to_f32((f16_t)(w & 0xffffu)); }
DEV float hi_f16(u32 w) { return f16_to_f32((f16_t)(w >> 16)); }

// An integer below 2^23 (a code, or a code left in place in its word) as f32, exactly, without
// the quarter-rate I2F instruction.
DEV float code_f32(u32 q) { return __int_as_float(0x4B000000u | q) - 8388608.0f; }

// L2 policy for weight loads. Streamed weights are read once per token (pre and post blocks,
// head): evict-first, so that the loop body, re-read L times per token and loaded evict-last,
// stays resident in L2. Weights bypass L1 either way.
DEV u64 l2_policy(bool stream) {
    u64 p;
    if (stream) {
        asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
    } else {
        asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p));
    }
    return p;
}

// 16-, 8- and 4-byte read-only weight loads under an L2 policy.
DEV uint4 ld_w16(const void* p, u64 policy) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p), "l"(policy));
    return v;
}

DEV uint2 ld_w8(const void* p, u64 policy) {
    uint2 v;
    asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v2.u32 {%0,%1}, [%2], %3;"
        : "=r"(v.x), "=r"(v.y)
        : "l"(p), "l"(policy));
    return v;
}

DEV u32 ld_w4(const void* p, u64 policy) {
    u32 v;
    asm("ld.global.nc.L1::no_allocate.L2::cache_hint.u32 %0, [%1], %2;" : "=r"(v) : "l"(p), "l"(policy));
    return v;
}

// Asynchronous copies from global to shared memory (sm_80 and later), in groups: a thread
// commits the copies issued since its last commit as one group and later waits for all but the
// N most recent of its groups.
DEV void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Wait until at most N committed groups of this thread are still in flight.
template <int N> DEV void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

DEV u32 smem_addr(const void* p) {
    u32 s;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(s) : "l"(p));
    return s;
}

// 16 bytes from global to shared memory, bypassing L1; `bytes` (16 or 0) of them are read and
// the rest zero-filled, so a row past the step's end reads nothing and lands as zeros.
DEV void cp_async16(u32 smem, const void* gmem, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem), "l"(gmem), "r"(bytes)
                 : "memory");
}

// 8 bytes likewise (rows that are only 8-byte aligned: INT2 codes); all of them are read.
DEV void cp_async8(u32 smem, const void* gmem) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(smem), "l"(gmem) : "memory");
}

// The same for weights, under an L2 policy (l2_policy); 8-byte copies for rows that are only
// 8-byte aligned (INT2 codes).
DEV void cp_async16_w(u32 smem, const void* gmem, int bytes, u64 policy) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;" ::"r"(smem),
                 "l"(gmem), "r"(bytes), "l"(policy)
                 : "memory");
}
DEV void cp_async8_w(u32 smem, const void* gmem, int bytes, u64 policy) {
    asm volatile("cp.async.ca.shared.global.L2::cache_hint [%0], [%1], 8, %2, %3;" ::"r"(smem),
                 "l"(gmem), "r"(bytes), "l"(policy)
                 : "memory");
}


// silu(g) * u, rounded like the CPU reference: g / (1 + e^-g) * u.
DEV float silu_mul(float g, float u) {
    return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
}

DEV float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

DEV float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Maximum over a block of `blockDim.x` threads (a multiple of 32, at most 1024); every thread
// gets it. `scratch` holds 32 floats.
DEV float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < warps ? scratch[lane] : NEG_INF;
    return warp_max(t);
}

// Sum over a block of `blockDim.x` threads (a multiple of 32, at most 1024); every thread gets
// the total. `scratch` holds 32 floats. The order of additions is fixed, so results are
// deterministic.
DEV float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < warps ? scratch[lane] : 0.0f;
    return warp_sum(t);
}
