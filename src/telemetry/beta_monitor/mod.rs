//! BETA-MON: per returned token, the entropy of the next-token distribution it was chosen from;
//! per call, their running statistics and, in speculative calls, the draft/verify argmax
//! agreement (docs/ABI.md "BETA-MON").
//!
//! The entropy is that of softmax(logits) at temperature 1 over the whole vocabulary, in bits:
//! sampling parameters do not change it. Backends compute it where the logits are
//! ([`crate::backend::Backend::entropy_rows`]); [`entropy_bits`] is the f64 reference.
//!
//! A call is monitored when it asks for it ([`BetaMonitor`] in its parameters) or when
//! `TINYLOOP_BETA_MONITOR=1` ([`BetaMonEnv`]); its [`BetaMonSummary`] is then part of the call's
//! statistics, and [`report`] prints and writes what the environment asks for.

mod env;
mod summary;

pub use env::BetaMonEnv;
pub use summary::BetaMonSummary;
pub(crate) use summary::EntropyLog;

use std::f64::consts::LN_2;
use std::io::Write;

use crate::error::{Error, Result};

/// The thresholds of a monitored call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BetaMonitor {
    /// Entropies below this many bits count in `low_rate` (over-confidence). Default 0.5.
    pub low_entropy_bits: f64,
    /// Entropies above this many bits count in `high_rate` (uncertainty). Default 6.0.
    pub high_entropy_bits: f64,
    /// Speculative calls: an agreement below this share is flagged. Default 0.95.
    pub agreement_floor: f64,
}

impl Default for BetaMonitor {
    fn default() -> Self {
        BetaMonitor {
            low_entropy_bits: 0.5,
            high_entropy_bits: 6.0,
            agreement_floor: 0.95,
        }
    }
}

/// How [`BetaMonitor::check`] names the three values in its errors.
pub(crate) struct Names<'a> {
    pub low: &'a str,
    pub high: &'a str,
    pub floor: &'a str,
}

impl BetaMonitor {
    /// Thresholds must be finite and >= 0 with low <= high; the floor must be in [0, 1].
    pub fn validate(&self) -> Result<()> {
        self.check(&Names {
            low: "beta_monitor.low_entropy_bits",
            high: "beta_monitor.high_entropy_bits",
            floor: "beta_monitor.agreement_floor",
        })
    }

    pub(crate) fn check(&self, names: &Names) -> Result<()> {
        for (name, value) in [
            (names.low, self.low_entropy_bits),
            (names.high, self.high_entropy_bits),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                return Err(Error::invalid(format!(
                    "{name} must be a finite number of bits >= 0, got {value}"
                )));
            }
        }
        if self.low_entropy_bits > self.high_entropy_bits {
            return Err(Error::invalid(format!(
                "{} ({}) must not exceed {} ({})",
                names.low, self.low_entropy_bits, names.high, self.high_entropy_bits
            )));
        }
        if !(0.0..=1.0).contains(&self.agreement_floor) {
            return Err(Error::invalid(format!(
                "{} must be in [0, 1], got {}",
                names.floor, self.agreement_floor
            )));
        }
        Ok(())
    }
}

/// What a generation request monitors: its thresholds, and whether each token is printed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Monitoring {
    pub thresholds: BetaMonitor,
    pub verbose: bool,
}

/// The monitoring of a call: its own thresholds, else the environment's when
/// `TINYLOOP_BETA_MONITOR=1`, else none. Tokens are printed with `TINYLOOP_BETA_MON_VERBOSE=1`
/// when the model logs (`log`).
pub(crate) fn resolve(
    call: Option<BetaMonitor>,
    env: &BetaMonEnv,
    log: bool,
) -> Result<Option<Monitoring>> {
    if let Some(thresholds) = &call {
        thresholds.validate()?;
    }
    let thresholds = call.or(env.enabled.then_some(env.thresholds));
    Ok(thresholds.map(|thresholds| Monitoring {
        thresholds,
        verbose: env.enabled && env.verbose && log,
    }))
}

/// Entropy in bits of softmax(`logits`) in f64: `H = ln S − T / S` over `z = l − max` with
/// `S = Σ e^z` and `T = Σ z e^z`, divided by ln 2. NaN when a logit is not finite.
pub fn entropy_bits(logits: &[f32]) -> f64 {
    let max = logits
        .iter()
        .fold(f64::NEG_INFINITY, |m, &l| m.max(l as f64));
    let (mut s, mut t) = (0.0f64, 0.0f64);
    for &l in logits {
        let z = l as f64 - max;
        let e = z.exp();
        s += e;
        t += z * e;
    }
    (s.ln() - t / s) / LN_2
}

/// After a monitored call: with `TINYLOOP_BETA_MONITOR=1`, the summary line (and the agreement
/// warning) on stderr; with `TINYLOOP_BETA_MON_FILE`, the summary as JSON in that file. A file
/// that cannot be written costs a one-line warning, not the call's tokens. Nothing is printed
/// unless the model logs (`log`).
pub fn report(summary: &BetaMonSummary, env: &BetaMonEnv, log: bool) {
    if env.enabled {
        log_line!(log, "{}", summary.line());
        if let Some(warning) = summary.agreement_warning() {
            log_line!(log, "{warning}");
        }
    }
    if let Some(path) = &env.file {
        let written = std::fs::File::create(path).and_then(|mut f| {
            let json = summary.to_json().to_string();
            f.write_all(json.as_bytes())?;
            f.write_all(b"\n")
        });
        if let Err(e) = written {
            log_line!(
                log,
                "[beta_mon] warning: cannot write TINYLOOP_BETA_MON_FILE={}: {e}",
                path.display()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entropy_of_known_distributions() {
        // Uniform over 256: exactly 8 bits; a 1e-12 margin covers the f64 sums.
        assert!((entropy_bits(&[3.0; 256]) - 8.0).abs() < 1e-12);
        // Two logits ln 3 apart: p = (3/4, 1/4), H = 2 − (3/4) log2 3.
        let h = entropy_bits(&[(3.0f32).ln(), 0.0]);
        let expected = 2.0 - 0.75 * 3.0f64.log2();
        assert!((h - expected).abs() < 1e-7, "{h} vs {expected}"); // ln 3 rounded to f32
                                                                   // One dominant logit: all mass on it.
        assert!(entropy_bits(&[0.0, -200.0, -300.0]) < 1e-80);
        assert!(entropy_bits(&[0.0, f32::NAN]).is_nan());
        assert!(entropy_bits(&[0.0, f32::INFINITY]).is_nan());
    }

    #[test]
    fn bad_thresholds_are_named() {
        let with = |low, high, floor| BetaMonitor {
            low_entropy_bits: low,
            high_entropy_bits: high,
            agreement_floor: floor,
        };
        assert!(BetaMonitor::default().validate().is_ok());
        assert!(with(0.0, 0.0, 0.0).validate().is_ok());
        assert!(with(1.0, 1.0, 1.0).validate().is_ok());
        let err = |m: BetaMonitor| m.validate().unwrap_err().to_string();
        assert!(err(with(-0.1, 6.0, 0.9)).contains("beta_monitor.low_entropy_bits must be"));
        assert!(err(with(0.5, f64::NAN, 0.9)).contains("beta_monitor.high_entropy_bits"));
        let e = err(with(7.0, 6.0, 0.9));
        assert!(e.contains("low_entropy_bits (7) must not exceed"), "{e}");
        assert!(err(with(0.5, 6.0, 1.5)).contains("agreement_floor must be in [0, 1], got 1.5"));
        assert!(err(with(0.5, 6.0, -0.5)).contains("agreement_floor"));
    }

    #[test]
    fn a_call_s_own_thresholds_win_over_the_environment() {
        let env = BetaMonEnv {
            enabled: true,
            verbose: true,
            thresholds: BetaMonitor {
                low_entropy_bits: 1.0,
                ..Default::default()
            },
            file: None,
        };
        let own = BetaMonitor::default();
        assert_eq!(
            resolve(Some(own), &env, true).unwrap().unwrap().thresholds,
            own
        );
        let from_env = resolve(None, &env, true).unwrap().unwrap();
        assert_eq!(from_env.thresholds, env.thresholds);
        assert!(from_env.verbose);
        let silent = resolve(None, &env, false).unwrap().unwrap();
        assert!(
            !silent.verbose,
            "a model opened with log false prints no token lines"
        );
        let off = BetaMonEnv::default();
        assert_eq!(resolve(None, &off, true).unwrap(), None);
        let asked = resolve(Some(own), &off, true).unwrap().unwrap();
        assert!(
            !asked.verbose,
            "per-token lines need the environment's monitor"
        );
        let bad = BetaMonitor {
            agreement_floor: 2.0,
            ..own
        };
        assert!(resolve(Some(bad), &off, true).is_err());
    }
}
