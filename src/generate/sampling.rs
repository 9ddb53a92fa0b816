//! Token selection: greedy argmax, or temperature / top-k / top-p sampling from a seeded generator.

use crate::error::{Error, Result};

/// How the next token is chosen.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 selects greedy decoding; otherwise logits are divided by it.
    pub temperature: f32,
    /// Keep only the k most likely tokens; 0 keeps all.
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

/// Choose a token from `logits` (one row). Greedy when the temperature is 0.
pub fn sample(logits: &[f32], params: &SamplingParams, rng: &mut Rng) -> u32 {
    if params.is_greedy() {
        return argmax(logits);
    }
    let mut order: Vec<u32> = (0..logits.len() as u32).collect();
    // Descending logit, ascending index on ties: a total order, so the result is reproducible.
    order.sort_by(|&a, &b| {
        logits[b as usize]
            .total_cmp(&logits[a as usize])
            .then(a.cmp(&b))
    });
    if params.top_k > 0 {
        order.truncate(params.top_k);
    }
    let max = logits[order[0] as usize] as f64;
    let t = params.temperature as f64;
    let mut probs: Vec<f64> = order
        .iter()
        .map(|&i| ((logits[i as usize] as f64 - max) / t).exp())
        .collect();
    let total: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= total);
    if params.top_p < 1.0 {
        let mut cumulative = 0.0;
        let keep = probs
            .iter()
            .position(|p| {
                cumulative += p;
                cumulative >= params.top_p as f64
            })
            .map_or(probs.len(), |i| i + 1);
        probs.truncate(keep);
    }
    let mut target = rng.next_f64() * probs.iter().sum::<f64>();
    for (i, p) in probs.iter().enumerate() {
        target -= p;
        if target < 0.0 {
            return order[i];
        }
    }
    order[probs.len() - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_prefers_lowest_index_on_ties() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, -1.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 0.5]), 1);
    }

    #[test]
    fn top_k_one_is_greedy() {
        let logits = [0.1, 2.0, 1.9, -3.0];
        let params = SamplingParams {
            temperature: 1.5,
            top_k: 1,
            top_p: 1.0,
            seed: 7,
        };
        let mut rng = Rng::new(7);
        for _ in 0..20 {
            assert_eq!(sample(&logits, &params, &mut rng), 1);
        }
    }

    #[test]
    fn tiny_top_p_keeps_only_the_best() {
        let logits = [0.0, 5.0, 4.0];
        let params = SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.01,
            seed: 1,
        };
        let mut rng = Rng::new(3);
        for _ in 0..20 {
            assert_eq!(sample(&logits, &params, &mut rng), 1);
        }
    }

    #[test]
    fn sampling_follows_the_distribution() {
        // p = softmax([0, ln 3]) = [0.25, 0.75]; 4000 draws, 5-sigma band on the count of token 1.
        let logits = [0.0, 3f32.ln()];
        let params = SamplingParams {
            temperature: 1.0,
            ..Default::default()
        };
        let mut rng = Rng::new(42);
        let ones = (0..4000)
            .filter(|_| sample(&logits, &params, &mut rng) == 1)
            .count() as f64;
        let sigma = (4000.0f64 * 0.75 * 0.25).sqrt();
        assert!((ones - 3000.0).abs() < 5.0 * sigma, "count {ones}");
    }

    #[test]
    fn invalid_parameters_are_rejected() {
        let bad = [
            SamplingParams {
                temperature: -1.0,
                ..Default::default()
            },
            SamplingParams {
                temperature: f32::NAN,
                ..Default::default()
            },
            SamplingParams {
                top_p: 0.0,
                ..Default::default()
            },
            SamplingParams {
                top_p: 1.5,
                ..Default::default()
            },
        ];
        for p in bad {
            assert!(p.validate().is_err(), "{p:?} accepted");
        }
    }
}
