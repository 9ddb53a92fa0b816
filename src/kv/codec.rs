//! The reference quantizers of the KV cache. cuda/kv.cu implements the same operations in the
//! same order, so the CPU and the GPU produce identical codes from identical values.
//!
//! A group of values (one head of K or V, or one head-sized group of h) is quantized
//! symmetrically: `scale = amax / qmax` stored as f16 (saturating at the f16 maximum) or as FP8
//! E4M3 rounded up, then `code = clamp(round_half_even(x / scale), −qmax, qmax)` with `scale`
//! read back from its stored form. A zero or non-finite scale gives all-zero codes. A value is
//! reconstructed as `scale · code` in f32, which is exact (an 11-bit by 8-bit product).

use half::f16;

use super::layout::{Codes, Scales};

/// Largest finite f16.
const F16_MAX: f32 = 65504.0;

/// The stored form of a scale, and its value.
pub fn store_scale(raw: f32, kind: Scales) -> (u16, f32) {
    match kind {
        Scales::None => (0, 1.0),
        Scales::F16 => {
            let h = f16::from_f32(raw.min(F16_MAX));
            (h.to_bits(), h.to_f32())
        }
        Scales::E4m3 => {
            let bits = e4m3_round_up(raw);
            (bits as u16, e4m3_value(bits))
        }
    }
}

/// The value of a stored scale.
pub fn scale_value(bits: u16, kind: Scales) -> f32 {
    match kind {
        Scales::None => 1.0,
        Scales::F16 => f16::from_bits(bits).to_f32(),
        Scales::E4m3 => e4m3_value(bits as u8),
    }
}

/// Quantize `x` with `qmax`; returns the stored scale bits and the codes.
pub fn quantize(x: &[f32], qmax: i32, kind: Scales, codes: &mut [i8]) -> u16 {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let (bits, scale) = store_scale(amax / qmax as f32, kind);
    let usable = scale > 0.0 && scale.is_finite();
    for (c, &v) in codes.iter_mut().zip(x) {
        *c = if usable {
            // NaN casts to 0.
            (v / scale)
                .round_ties_even()
                .clamp(-qmax as f32, qmax as f32) as i8
        } else {
            0
        };
    }
    if usable {
        bits
    } else {
        0
    }
}

/// Write `codes` in their stored form: bytes for I8, nibbles (code + 8) for I4.
pub fn pack(codes: &[i8], kind: Codes, out: &mut [u8]) {
    match kind {
        Codes::I8 => {
            for (o, &c) in out.iter_mut().zip(codes) {
                *o = c as u8;
            }
        }
        Codes::I4 => {
            for (o, pair) in out.iter_mut().zip(codes.chunks_exact(2)) {
                *o = ((pair[0] + 8) as u8) | (((pair[1] + 8) as u8) << 4);
            }
        }
        Codes::F16 => unreachable!("f16 entries are not quantized"),
    }
}

/// Code `i` of a stored row.
#[inline]
pub fn code(row: &[u8], i: usize, kind: Codes) -> i32 {
    match kind {
        Codes::I8 => row[i] as i8 as i32,
        Codes::I4 => ((row[i / 2] >> (4 * (i & 1))) & 0xF) as i32 - 8,
        Codes::F16 => unreachable!("f16 entries are not quantized"),
    }
}

/// The FP8 E4M3 value of `bits` (sign ignored: scales are non-negative). No NaN is ever stored.
pub fn e4m3_value(bits: u8) -> f32 {
    let e = ((bits >> 3) & 0xF) as i32;
    let m = (bits & 7) as f32;
    if e == 0 {
        m * (2f32).powi(-9)
    } else {
        (1.0 + m / 8.0) * (2f32).powi(e - 7)
    }
}

/// The smallest E4M3 value ≥ `x` (so a scale never shrinks and no code clips), for x ≥ 0;
/// saturates at 448. Exact: every step scales by powers of two or rounds an exact value.
pub fn e4m3_round_up(x: f32) -> u8 {
    if x.is_nan() || x <= 0.0 {
        return 0;
    }
    if x >= 448.0 {
        return 0x7E;
    }
    let min_normal = (2f32).powi(-6);
    if x <= min_normal {
        let m = (x * 512.0).ceil() as u8; // 1..=8 steps of 2^-9
        return if m == 8 { 0x08 } else { m };
    }
    let mut e = ((x.to_bits() >> 23) & 0xFF) as i32 - 127;
    let frac = x / (2f32).powi(e);
    let mut m = ((frac - 1.0) * 8.0).ceil() as i32;
    if m == 8 {
        e += 1;
        m = 0;
    }
    (((e + 7) << 3) | m) as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_round_up_is_the_least_upper_bound() {
        let values: Vec<f32> = (0..0x7Fu8).map(e4m3_value).collect();
        assert!(values.windows(2).all(|w| w[0] < w[1]), "increasing");
        assert_eq!(values[0x7E], 448.0);
        let mut x = 1e-4f32;
        while x < 448.0 {
            let b = e4m3_round_up(x);
            let v = e4m3_value(b);
            assert!(v >= x, "{x} -> {v}");
            if b > 0 {
                assert!(e4m3_value(b - 1) < x, "{x} -> {v} is not the least");
            }
            x *= 1.0173;
        }
        for (b, &v) in values.iter().enumerate() {
            assert_eq!(
                e4m3_round_up(v) as usize,
                b,
                "exact values map to themselves"
            );
        }
        assert_eq!(e4m3_round_up(0.0), 0);
        assert_eq!(e4m3_round_up(1e9), 0x7E);
    }

    #[test]
    fn quantization_error_is_half_a_step() {
        let x: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 64) as f32 - 31.5) * 0.173)
            .collect();
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (qmax, kind) in [(127, Scales::F16), (7, Scales::F16), (7, Scales::E4m3)] {
            let mut codes = vec![0i8; x.len()];
            let bits = quantize(&x, qmax, kind, &mut codes);
            let s = scale_value(bits, kind);
            for (&v, &c) in x.iter().zip(&codes) {
                let err = (v - s * c as f32).abs();
                // Half a step, plus the clip of the largest values when an f16 scale rounds down.
                assert!(err <= s / 2.0 + (amax - qmax as f32 * s).max(0.0) + 1e-6);
            }
        }
    }

    #[test]
    fn int4_packing_round_trips() {
        let codes: Vec<i8> = (-7..=7).chain(0..1).collect();
        let mut packed = vec![0u8; codes.len() / 2];
        pack(&codes, Codes::I4, &mut packed);
        for (i, &c) in codes.iter().enumerate() {
            assert_eq!(code(&packed, i, Codes::I4), c as i32);
        }
    }

    #[test]
    fn zero_and_nan_groups_quantize_to_zero() {
        let mut codes = vec![1i8; 4];
        assert_eq!(quantize(&[0.0; 4], 127, Scales::F16, &mut codes), 0);
        assert_eq!(codes, [0; 4]);
        quantize(&[f32::NAN, 1.0, -1.0, 0.5], 127, Scales::F16, &mut codes);
        assert_eq!(codes, [0, 127, -127, 64]);
    }
}
