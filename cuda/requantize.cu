// Re-quantization of a group-quantized weight to fewer bits at the same group size (CTX-TIER's
// INT4 -> INT2 re-pack of the loop body). Bit for bit the host routine
// `QuantizedMatrix::requantize` (src/model/quant.rs): dequantize each value as scale * q + zero
// in f32 (no fused multiply-add), then round-to-nearest quantization of the group:
//   scale = f16((hi - lo) / max_code), zero = f16(lo),
//   q = clamp(round((x - zero) / scale), 0, max_code)   (0 when the rounded scale is 0),
// with IEEE division, rounding half away from zero (roundf, like Rust's round()) and f16
// conversion to nearest even.
#include "common.cuh"

#define REQ_THREADS 128

// Value `col` of row `row` of a matrix with `bits`-bit codes (lowest bits hold the lowest column).
DEV float dequantized(const u8* codes, float scale, float zero, size_t row_start, int col, int bits) {
    const int per_byte = 8 / bits;
    const size_t flat = row_start + (size_t)col;
    const u32 q = (codes[flat / per_byte] >> ((flat % per_byte) * bits)) & ((1u << bits) - 1u);
    return __fadd_rn(__fmul_rn(scale, (float)q), zero);
}

// One block per (row, group). `src_*` hold the source codes and per-group f16 scales and zeros
// (`[rows, cols / group]`), `dst_*` receive the re-quantized ones. group is a multiple of
// 8 / dst_bits, so every destination byte belongs to one group (one writer, no races).
extern "C" __global__ void __launch_bounds__(REQ_THREADS)
    requantize_group(const u8* __restrict__ src_codes, const f16_t* __restrict__ src_scales,
                     const f16_t* __restrict__ src_zeros, int src_bits, u8* __restrict__ dst_codes,
                     f16_t* __restrict__ dst_scales, f16_t* __restrict__ dst_zeros, int dst_bits,
                     int cols, int group) {
    __shared__ float scratch[32];
    kernel_start();
    const int groups = cols / group;
    const size_t p = blockIdx.x;
    const size_t row = p / groups;
    const int first = (int)(p % groups) * group;
    const size_t row_start = row * (size_t)cols;
    const float s_in = f16_to_f32(src_scales[p]), z_in = f16_to_f32(src_zeros[p]);

    float lo = -NEG_INF, hi = NEG_INF;
    for (int i = threadIdx.x; i < group; i += blockDim.x) {
        const float x = dequantized(src_codes, s_in, z_in, row_start, first + i, src_bits);
        lo = fminf(lo, x);
        hi = fmaxf(hi, x);
    }
    hi = block_max(hi, scratch);
    lo = -block_max(-lo, scratch);

    const float max_code = (float)((1 << dst_bits) - 1);
    const f16_t scale = f32_to_f16(__fdiv_rn(__fsub_rn(hi, lo), max_code));
    const f16_t zero = f32_to_f16(lo);
    const float s = f16_to_f32(scale), z = f16_to_f32(zero);
    if (threadIdx.x == 0) {
        dst_scales[p] = scale;
        dst_zeros[p] = zero;
    }
    const int per_byte = 8 / dst_bits;
    for (int b = threadIdx.x; b < group / per_byte; b += blockDim.x) {
        u32 byte = 0;
        for (int j = 0; j < per_byte; j++) {
            const int col = first + b * per_byte + j;
            const float x = dequantized(src_codes, s_in, z_in, row_start, col, src_bits);
            u32 q = 0;
            if (s > 0.0f) {
                q = (u32)fminf(fmaxf(roundf(__fdiv_rn(__fsub_rn(x, z), s)), 0.0f), max_code);
            }
            byte |= q << (j * dst_bits);
        }
        dst_codes[(row_start + (size_t)first) / per_byte + b] = (u8)byte;
    }
}
