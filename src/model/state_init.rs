//! The state a loop starts from when the architecture draws it at random (Huginn), and the model
//! option that chooses it. Values are a function of (seed, position, index) alone, drawn on the
//! host, so they do not depend on the backend or on how a prompt is cut into steps.

use std::fmt;
use std::str::FromStr;

use super::architecture::{Architecture, LoopState};
use crate::error::{Error, Result};

/// `state_init`: how a [`LoopState::Random`] initial state is drawn.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StateInit {
    /// What the model's own code does: the truncated normal of its config, here from seed 0.
    #[default]
    Model,
    /// All zeros.
    Zeros,
    /// The model's truncated normal from this seed.
    Seed(u64),
}

impl FromStr for StateInit {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "model" => Ok(StateInit::Model),
            "zeros" => Ok(StateInit::Zeros),
            _ => match s.strip_prefix("seed:").map(str::parse::<u64>) {
                Some(Ok(seed)) => Ok(StateInit::Seed(seed)),
                _ => Err(Error::invalid(format!(
                    "state_init {s:?}: expected model, zeros or seed:N (N an unsigned 64-bit integer)"
                ))),
            },
        }
    }
}

impl fmt::Display for StateInit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StateInit::Model => write!(f, "model"),
            StateInit::Zeros => write!(f, "zeros"),
            StateInit::Seed(seed) => write!(f, "seed:{seed}"),
        }
    }
}

impl StateInit {
    /// Whether this choice applies to a model of `arch`: a loop that carries its state from the
    /// pre blocks has no initial state to choose.
    pub fn check(self, arch: &Architecture) -> Result<()> {
        if arch.loop_state == LoopState::Carry && self != StateInit::Model {
            return Err(Error::invalid(format!(
                "state_init {self}: this model's loop starts from the output of its pre blocks, \
                 so only state_init model applies"
            )));
        }
        Ok(())
    }

    /// The initial states of positions `start..start + rows`, `rows × dim` values.
    pub fn fill(self, arch: &Architecture, start: usize, rows: usize, dim: usize, out: &mut [f32]) {
        let seed = match self {
            StateInit::Zeros => return out[..rows * dim].fill(0.0),
            StateInit::Model => 0,
            StateInit::Seed(seed) => seed,
        };
        for (r, row) in out[..rows * dim].chunks_exact_mut(dim).enumerate() {
            for (i, value) in row.iter_mut().enumerate() {
                let key = mix(mix(seed ^ mix((start + r) as u64)) ^ i as u64);
                *value = (arch.state_std * truncated_normal(key)) as f32;
            }
        }
    }
}

/// splitmix64's finalizer: a bijective mix of 64 bits.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A standard normal value truncated to [−3, 3] (rejection), from uniforms derived from `key`.
fn truncated_normal(key: u64) -> f64 {
    let uniform = |k: u64| ((mix(key ^ mix(k)) >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    (0u64..)
        .map(|draw| {
            let (u1, u2) = (uniform(2 * draw), uniform(2 * draw + 1));
            (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
        })
        .find(|z| z.abs() <= 3.0)
        .expect("a draw within 3 standard deviations comes with probability 0.997 each")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_every_choice() {
        for s in ["model", "zeros", "seed:0", "seed:18446744073709551615"] {
            assert_eq!(s.parse::<StateInit>().unwrap().to_string(), s);
        }
        for bad in ["", "seed:", "seed:-1", "seed:x", "random", "Seed:1"] {
            let e = bad.parse::<StateInit>().unwrap_err().to_string();
            assert!(e.contains("model, zeros or seed:N"), "{bad}: {e}");
        }
    }

    #[test]
    fn draws_depend_on_seed_and_position_only_and_stay_truncated() {
        let arch = Architecture {
            state_std: 2.0,
            ..Architecture::default()
        };
        let (dim, rows) = (64, 8);
        let mut whole = vec![0.0; rows * dim];
        StateInit::Seed(7).fill(&arch, 10, rows, dim, &mut whole);
        // Position 13 alone equals row 3 of the block that starts at 10.
        let mut one = vec![0.0; dim];
        StateInit::Seed(7).fill(&arch, 13, 1, dim, &mut one);
        assert_eq!(one, whole[3 * dim..4 * dim]);
        let mut other = vec![0.0; dim];
        StateInit::Seed(8).fill(&arch, 13, 1, dim, &mut other);
        assert_ne!(one, other);
        assert!(whole.iter().all(|v| v.abs() <= 6.0));
        let mean = whole.iter().sum::<f32>() / whole.len() as f32;
        let var = whole.iter().map(|v| (v - mean).powi(2)).sum::<f32>() / whole.len() as f32;
        // A normal truncated at ±3σ has variance 0.973σ²; 512 draws keep within ~15 %.
        assert!((var / 4.0 - 0.973).abs() < 0.15, "variance {var}");
        let mut zeros = vec![1.0; dim];
        StateInit::Zeros.fill(&arch, 0, 1, dim, &mut zeros);
        assert!(zeros.iter().all(|&v| v == 0.0));
    }
}
