//! Token selection: greedy argmax, or temperature / top-k / top-p sampling from a seeded draw.
//!
//! Sampling is defined on integers so that this file (the reference) and the CUDA kernel
//! `sample_token` (cuda/sample.cu) pick the bit-identical token for identical logits:
//!
//! * Every logit gets an order-preserving `u32` key (NaN lowest); thresholds are keys.
//! * A token's weight ("mass") is `exp((l - max) / T)` in fixed point: truncated to a multiple of
//!   2^-40 of the top token's weight, with our own `exp_neg` built from separately rounded f32
//!   operations (no libm, no fused multiply-add). Tokens below about 2^-40 of the top token, and
//!   NaN or -inf logits, weigh 0 and are never sampled.
//! * Top-k keeps every token whose key is at least the k-th largest key: ties at the cut are all
//!   kept, so more than k tokens may survive.
//! * Top-p then keeps the fewest keys, from the largest down, whose mass reaches
//!   `p * (mass kept by top-k)` (at least one unit), again keeping every tie at the cut.
//! * The 53-bit draw picks `r` in `[0, M)` for the kept mass `M`, and the token is the first one
//!   *in index order* whose running mass exceeds `r` (an inverse CDF over indices, which the GPU
//!   computes with a prefix scan). If nothing has positive mass (all logits NaN or -inf, an
//!   infinite logit, ...) the result is [`argmax`].
//!
//! Greedy decoding (temperature 0) does not sample: callers use [`argmax`].
//! Mass sums are exact in `u64` for vocabularies below 2^23 tokens.

use crate::error::{Error, Result};

/// How the next token is chosen.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 selects greedy decoding; otherwise logits are divided by it.
    pub temperature: f32,
    /// Keep only the k most likely tokens (and any tied with the k-th); 0 keeps all.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches p; 1 keeps all.
    pub top_p: f32,
    /// Seed of the generator; the same seed and inputs give the same tokens.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(Error::invalid(format!(
                "temperature must be a finite number >= 0, got {}",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::invalid(format!(
                "top_p must be in (0, 1], got {}",
                self.top_p
            )));
        }
        Ok(())
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

/// SplitMix64: tiny, fast, and identical on every platform and binding.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1) with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// A uniform 53-bit integer: the `draw` argument of [`sample`].
    pub fn next_draw(&mut self) -> u64 {
        self.next_u64() >> 11
    }
}

/// Index of the largest value; the lowest index wins ties. NaN never wins.
pub fn argmax(values: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate() {
        if v > values[best] || values[best].is_nan() && !v.is_nan() {
            best = i;
        }
    }
    best as u32
}

/// `1 / temperature` in f32: the CPU and the GPU scale logits by this same number.
pub fn inv_temperature(params: &SamplingParams) -> f32 {
    1.0 / params.temperature
}

/// Choose a token from `logits` (one row) with a 53-bit uniform `draw` ([`Rng::next_draw`]).
/// Greedy parameters give [`argmax`].
pub fn sample(logits: &[f32], params: &SamplingParams, draw: u64) -> u32 {
    if params.is_greedy() {
        return argmax(logits);
    }
    sample_raw(
        logits,
        params.top_k,
        inv_temperature(params),
        params.top_p,
        draw,
    )
}

/// The exact contract of the CUDA kernel `sample_token`: sampling with the logit scale
/// `inv_temp` given directly, no greedy shortcut. `top_k` 0 or >= `logits.len()` keeps all,
/// `top_p` >= 1 keeps all; only the low 53 bits of `draw` are used.
pub fn sample_raw(logits: &[f32], top_k: usize, inv_temp: f32, top_p: f32, draw: u64) -> u32 {
    let (kept, total) = kept_masses(logits, top_k, inv_temp, top_p);
    if total == 0 {
        return argmax(logits);
    }
    let u = (draw & DRAW_MASK) as f64 * (1.0 / (1u64 << 53) as f64);
    let r = ((u * total as f64) as u64).min(total - 1);
    let mut acc = 0u64;
    for (i, w) in kept.iter().enumerate() {
        acc += w;
        if acc > r {
            return i as u32;
        }
    }
    unreachable!("the running mass reaches total > r")
}

/// The probability of each token under [`sample`] with `params` (one-hot on the argmax when
/// greedy or when nothing keeps any mass). Exact up to the 2⁻⁵³ resolution of a draw.
pub fn distribution(logits: &[f32], params: &SamplingParams) -> Vec<f64> {
    let (kept, total) = if params.is_greedy() {
        (Vec::new(), 0)
    } else {
        kept_masses(logits, params.top_k, inv_temperature(params), params.top_p)
    };
    if total == 0 {
        let mut p = vec![0.0; logits.len()];
        p[argmax(logits) as usize] = 1.0;
        return p;
    }
    kept.iter().map(|&w| w as f64 / total as f64).collect()
}

/// The fixed-point mass each token keeps after the top-k and top-p cuts, and their total.
fn kept_masses(logits: &[f32], top_k: usize, inv_temp: f32, top_p: f32) -> (Vec<u64>, u64) {
    let keys: Vec<u32> = logits.iter().map(|&v| order_key(v)).collect();
    // The max through its key, so that +0 beats -0 deterministically (NaN has key 0).
    let max = match keys.iter().copied().max() {
        Some(k) if k != 0 => key_value(k),
        _ => f32::NEG_INFINITY,
    };
    let masses: Vec<u64> = logits
        .iter()
        .map(|&v| token_mass(v, max, inv_temp))
        .collect();

    // Both cuts are keys reached by walking the keys from the largest down.
    let mut by_key: Vec<(u32, u64)> = keys.iter().copied().zip(masses.iter().copied()).collect();
    by_key.sort_unstable_by_key(|e| std::cmp::Reverse(e.0));
    let n = logits.len();
    let cut_k = if top_k > 0 && top_k < n {
        by_key[top_k - 1].0
    } else {
        0
    };
    let kept_k = || by_key.iter().take_while(|e| e.0 >= cut_k);
    let mass_k: u64 = kept_k().map(|e| e.1).sum();
    if mass_k == 0 {
        return (vec![0; n], 0);
    }
    let cut = if top_p < 1.0 {
        let target = ((top_p as f64 * mass_k as f64) as u64).max(1);
        let mut acc = 0u64;
        // target <= mass_k (top_p < 1), so the walk always stops inside the top-k set.
        kept_k()
            .find(|e| {
                acc += e.1;
                acc >= target
            })
            .map_or(cut_k, |e| e.0)
    } else {
        cut_k
    };
    let kept: Vec<u64> = keys
        .iter()
        .zip(&masses)
        .map(|(&k, &w)| if k >= cut { w } else { 0 })
        .collect();
    let total = kept.iter().sum();
    (kept, total)
}

const DRAW_MASK: u64 = (1 << 53) - 1;

/// Fixed-point unit of mass: the top token weighs 2^40.
const MASS_ONE: f32 = 1_099_511_627_776.0;

/// Scaled logits below this weigh 0. The definition cuts at -87 (where 2^n stays normal), but
/// from -28 down e^z * 2^40 < 0.77 truncates to 0 anyway (checked by a test), and cutting here
/// skips `exp_neg` for most of a vocabulary.
const Z_MIN: f32 = -28.0;

// exp_neg's constants, spelled alike in cuda/sample.cu (a test checks these and Z_MIN).
const LOG2E: f32 = std::f32::consts::LOG2_E;
// ln 2 split so that n * LN2_HI is exact for |n| <= 126 (15 significant bits).
const LN2_HI: f32 = 0.69314575;
const LN2_LO: f32 = 1.4286068e-6;
// e^r ~= 1 + r (C1 + r (C2 + ... + r C6)) on [-0.001, 0.6942]: relative error 2.0e-9 in exact
// arithmetic (Lawson minimax fit); f32 evaluation dominates the total error.
const EXP_POLY: [f32; 6] = [
    0.9999998,
    0.50000584,
    0.16660976,
    0.0419162,
    0.0077904644,
    0.0019497636,
];

/// Order-preserving key of an f32: a larger key is a larger value; NaN gets 0, below -inf.
fn order_key(v: f32) -> u32 {
    let b = v.to_bits();
    if v.is_nan() {
        0
    } else if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    }
}

/// The value of a non-zero key.
fn key_value(k: u32) -> f32 {
    f32::from_bits(if k & 0x8000_0000 != 0 {
        k & 0x7fff_ffff
    } else {
        !k
    })
}

/// e^z for z in [-87, 0], from separately rounded f32 operations only, so that the GPU computes
/// the same bits. Max relative error 1.1e-7 over a sweep of [-87, 0] (see the test).
///
/// z = n ln2 + r with the split ln 2 (Cody-Waite): computing z * log2(e) and taking its
/// fractional part directly would lose up to 2^-18 of it to rounding for |z| near 87.
fn exp_neg(z: f32) -> f32 {
    let n = (z * LOG2E).floor();
    let r = (z - n * LN2_HI) - n * LN2_LO;
    let mut p = EXP_POLY[5];
    for &c in EXP_POLY[..5].iter().rev() {
        p = p * r + c;
    }
    p = p * r + 1.0;
    // n >= -126 because z >= -87, so 2^n is a normal number.
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// Fixed-point weight of one logit given the row's max and the logit scale.
fn token_mass(logit: f32, max: f32, inv_temp: f32) -> u64 {
    let z = (logit - max) * inv_temp;
    // z > 0 only with a negative scale, which `validate` rejects; treat it as no mass.
    if !(Z_MIN..=0.0).contains(&z) {
        return 0;
    }
    (exp_neg(z) * MASS_ONE) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The domain of `exp_neg`: 2^n is a normal number down to here.
    const EXP_NEG_MIN: f32 = -87.0;

    fn params(temperature: f32, top_k: usize, top_p: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            seed: 0,
        }
    }

    /// Draws spread evenly over [0, 2^53), both ends included.
    fn sweep_draws(count: u64) -> impl Iterator<Item = u64> {
        (0..count).map(move |i| i * (DRAW_MASK / (count - 1)))
    }

    #[test]
    fn argmax_prefers_lowest_index_on_ties() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, -1.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 0.5]), 1);
    }

    #[test]
    fn exp_neg_matches_f64_exp() {
        let steps = 4_000_000;
        let mut worst = (0.0f64, 0.0f32);
        for i in 0..=steps {
            let z = (EXP_NEG_MIN as f64 * i as f64 / steps as f64) as f32;
            let e = exp_neg(z);
            let rel = (e as f64 / (z as f64).exp() - 1.0).abs();
            if rel > worst.0 {
                worst = (rel, z);
            }
        }
        assert!(
            worst.0 < 3e-7,
            "relative error {} at z = {}",
            worst.0,
            worst.1
        );
        assert_eq!(exp_neg(0.0), 1.0);
        assert_eq!(exp_neg(-0.0), 1.0);
    }

    #[test]
    fn the_early_cut_drops_no_mass() {
        // Every f32 in [-87, -28): the definition's cut at -87 gives the same (zero) masses.
        for bits in Z_MIN.to_bits() + 1..=EXP_NEG_MIN.to_bits() {
            let z = f32::from_bits(bits);
            assert_eq!((exp_neg(z) * MASS_ONE) as u64, 0, "z = {z}");
        }
    }

    #[test]
    fn kernel_spells_the_constants_alike() {
        let cuda = include_str!("../../cuda/sample.cu");
        for c in [Z_MIN, LOG2E, LN2_HI, LN2_LO].iter().chain(&EXP_POLY) {
            let literal = format!("{c:?}f");
            assert!(
                cuda.contains(&literal),
                "{literal} missing from cuda/sample.cu"
            );
        }
    }

    #[test]
    fn keys_preserve_order() {
        let values = [
            f32::NEG_INFINITY,
            -2.5,
            -0.0,
            0.0,
            1e-30,
            7.0,
            f32::INFINITY,
        ];
        for w in values.windows(2) {
            assert!(order_key(w[0]) < order_key(w[1]), "{w:?}");
            assert_eq!(key_value(order_key(w[1])).to_bits(), w[1].to_bits());
        }
        assert!(order_key(f32::NAN) < order_key(f32::NEG_INFINITY));
    }

    #[test]
    fn top_k_one_is_greedy() {
        let logits = [0.1, 2.0, 1.9, -3.0];
        let params = params(1.5, 1, 1.0);
        for draw in sweep_draws(20) {
            assert_eq!(sample(&logits, &params, draw), 1);
        }
    }

    #[test]
    fn ties_at_the_top_k_cut_are_kept() {
        let logits = [1.0, 3.0, 2.0, 2.0, 0.0];
        let params = params(1.0, 2, 1.0);
        // Draw 0 picks the first kept index, the largest draw the last one.
        assert_eq!(sample(&logits, &params, 0), 1);
        assert_eq!(sample(&logits, &params, DRAW_MASK), 3);
        for draw in sweep_draws(200) {
            assert!([1, 2, 3].contains(&sample(&logits, &params, draw)));
        }
    }

    #[test]
    fn tiny_top_p_keeps_only_the_best() {
        let logits = [0.0, 5.0, 4.0];
        let params = params(1.0, 0, 0.01);
        for draw in sweep_draws(20) {
            assert_eq!(sample(&logits, &params, draw), 1);
        }
    }

    #[test]
    fn top_p_keeps_the_smallest_set_reaching_p() {
        // Probabilities 0.5, 0.3, 0.2 in index order: the largest draw picks the last kept token.
        let logits = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln()];
        for (top_p, last) in [(0.4, 0), (0.7, 1), (0.9, 2), (1.0, 2)] {
            let params = params(1.0, 0, top_p);
            assert_eq!(sample(&logits, &params, DRAW_MASK), last, "top_p {top_p}");
            assert_eq!(sample(&logits, &params, 0), 0, "top_p {top_p}");
        }
    }

    #[test]
    fn nan_and_negative_infinity_are_never_chosen() {
        let logits = [
            f32::NAN,
            f32::NEG_INFINITY,
            0.0,
            f32::NAN,
            f32::NEG_INFINITY,
            1.0,
        ];
        for (top_k, top_p) in [(0, 1.0), (4, 1.0), (0, 0.9), (5, 0.99)] {
            let params = params(2.0, top_k, top_p);
            for draw in sweep_draws(500) {
                let t = sample(&logits, &params, draw);
                assert!(t == 2 || t == 5, "token {t}");
            }
        }
    }

    #[test]
    fn no_positive_mass_falls_back_to_argmax() {
        let params = params(1.0, 0, 1.0);
        assert_eq!(sample(&[f32::NEG_INFINITY; 4], &params, 123), 0);
        assert_eq!(sample(&[f32::NAN, f32::NAN], &params, 123), 0);
        // An infinite logit makes every difference infinite or NaN: argmax takes the first one.
        assert_eq!(
            sample(&[0.0, f32::INFINITY, 1.0, f32::INFINITY], &params, 5),
            1
        );
    }

    #[test]
    fn same_draw_same_token() {
        let mut rng = Rng::new(9);
        let logits: Vec<f32> = (0..1000).map(|_| (rng.next_f64() * 8.0) as f32).collect();
        let params = params(0.8, 50, 0.9);
        for _ in 0..100 {
            let draw = rng.next_draw();
            assert_eq!(
                sample(&logits, &params, draw),
                sample(&logits, &params, draw)
            );
        }
    }

    #[test]
    fn sampling_follows_the_distribution() {
        // p = softmax([0, ln 3]) = [0.25, 0.75]; 4000 draws, 5-sigma band on the count of token 1.
        let logits = [0.0, 3f32.ln()];
        let params = params(1.0, 0, 1.0);
        let mut rng = Rng::new(42);
        let ones = (0..4000)
            .filter(|_| sample(&logits, &params, rng.next_draw()) == 1)
            .count() as f64;
        let sigma = (4000.0f64 * 0.75 * 0.25).sqrt();
        assert!((ones - 3000.0).abs() < 5.0 * sigma, "count {ones}");
    }

    /// The definition read literally: each cut is the largest candidate key that qualifies.
    fn brute_force(logits: &[f32], top_k: usize, inv_temp: f32, top_p: f32, draw: u64) -> u32 {
        let keys: Vec<u32> = logits.iter().map(|&v| order_key(v)).collect();
        let max = logits
            .iter()
            .filter(|v| !v.is_nan())
            .fold(f32::NEG_INFINITY, |a, &b| if b > a { b } else { a });
        let mass: Vec<u64> = logits
            .iter()
            .map(|&v| token_mass(v, max, inv_temp))
            .collect();
        let weight = |t: u32, floor: u32| -> u64 {
            (0..logits.len())
                .filter(|&i| keys[i] >= t && keys[i] >= floor)
                .map(|i| mass[i])
                .sum()
        };
        let cut_k = if top_k > 0 && top_k < logits.len() {
            *keys
                .iter()
                .filter(|&&t| keys.iter().filter(|&&k| k >= t).count() >= top_k)
                .max()
                .unwrap()
        } else {
            0
        };
        let mass_k = weight(0, cut_k);
        if mass_k == 0 {
            return argmax(logits);
        }
        let mut cut = cut_k;
        if top_p < 1.0 {
            let target = ((top_p as f64 * mass_k as f64) as u64).max(1);
            let cut_p = *keys
                .iter()
                .filter(|&&t| t >= cut_k && weight(t, cut_k) >= target)
                .max()
                .unwrap();
            cut = cut.max(cut_p);
        }
        let total = weight(cut, 0);
        let r = (((draw as f64 / (1u64 << 53) as f64) * total as f64) as u64).min(total - 1);
        let mut acc = 0;
        for (i, &k) in keys.iter().enumerate() {
            if k >= cut {
                acc += mass[i];
                if acc > r {
                    return i as u32;
                }
            }
        }
        unreachable!()
    }

    #[test]
    fn matches_a_literal_reading_of_the_definition() {
        let mut rng = Rng::new(2024);
        for case in 0..300 {
            let n = 1 + (rng.next_u64() % 40) as usize;
            // Few distinct values, so ties straddle the cuts; some NaN and infinities.
            let logits: Vec<f32> = (0..n)
                .map(|_| match rng.next_u64() % 16 {
                    0 => f32::NAN,
                    1 => f32::NEG_INFINITY,
                    v => (v as f32 - 8.0) * 0.75,
                })
                .collect();
            let top_k = (rng.next_u64() % (n as u64 + 2)) as usize;
            let top_p = [1.0, 0.95, 0.5, 0.2, 1e-6][case % 5];
            let inv_temp = [1.0, 0.3, 4.0][case % 3];
            for _ in 0..10 {
                let draw = rng.next_draw();
                assert_eq!(
                    sample_raw(&logits, top_k, inv_temp, top_p, draw),
                    brute_force(&logits, top_k, inv_temp, top_p, draw),
                    "{logits:?} k {top_k} p {top_p} inv_temp {inv_temp} draw {draw}"
                );
            }
        }
    }

    #[test]
    fn invalid_parameters_are_rejected() {
        let bad = [
            params(-1.0, 0, 1.0),
            params(f32::NAN, 0, 1.0),
            params(f32::INFINITY, 0, 1.0),
            params(1.0, 0, 0.0),
            params(1.0, 0, 1.5),
            params(1.0, 0, f32::NAN),
        ];
        for p in bad {
            assert!(p.validate().is_err(), "{p:?} accepted");
        }
        assert!(params(0.7, 40, 0.9).validate().is_ok());
    }
}
