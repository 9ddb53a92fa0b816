//! The per-call statistics of BETA-MON: the running entropy statistics of the returned tokens
//! (Welford mean and variance, min, max, threshold counts) and the summary they end in, as the
//! stderr line and as JSON.

use serde_json::json;

use super::{BetaMonitor, Monitoring};

/// The entropies of one call's returned tokens, folded as they come.
#[derive(Clone, Debug)]
pub(crate) struct EntropyLog {
    watch: Monitoring,
    n: usize,
    mean: f64,
    /// Sum of squared deviations from the running mean (Welford).
    m2: f64,
    min: f64,
    max: f64,
    low: usize,
    high: usize,
}

impl EntropyLog {
    pub fn new(watch: Monitoring) -> EntropyLog {
        EntropyLog {
            watch,
            n: 0,
            mean: 0.0,
            m2: 0.0,
            min: f64::INFINITY,
            max: f64::NEG_INFINITY,
            low: 0,
            high: 0,
        }
    }

    /// Add the entropy (bits) of the distribution `token` was chosen from.
    pub fn record(&mut self, token: u32, bits: f32) {
        let h = bits as f64;
        self.n += 1;
        let delta = h - self.mean;
        self.mean += delta / self.n as f64;
        self.m2 += delta * (h - self.mean);
        self.min = self.min.min(h);
        self.max = self.max.max(h);
        let t = &self.watch.thresholds;
        self.low += (h < t.low_entropy_bits) as usize;
        self.high += (h > t.high_entropy_bits) as usize;
        if self.watch.verbose {
            eprintln!("[beta_mon] token n={} id={token} H={h:.3} bits", self.n);
        }
    }

    /// The call's summary; `drafted` / `agreed` are its speculative counts (0 / 0 otherwise).
    pub fn summary(&self, drafted: usize, agreed: usize) -> BetaMonSummary {
        let n = self.n as f64;
        let any = self.n > 0;
        let rate = |count: usize| if any { count as f64 / n } else { 0.0 };
        BetaMonSummary {
            n_tokens: self.n,
            entropy_mean_bits: self.mean,
            entropy_std_bits: if any { (self.m2 / n).sqrt() } else { 0.0 },
            entropy_min_bits: if any { self.min } else { 0.0 },
            entropy_max_bits: if any { self.max } else { 0.0 },
            low_rate: rate(self.low),
            high_rate: rate(self.high),
            thresholds: self.watch.thresholds,
            drafted,
            agreement_rate: (drafted > 0).then(|| agreed as f64 / drafted as f64),
        }
    }
}

/// BETA-MON's account of one generation call. With no returned token every statistic is 0.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BetaMonSummary {
    /// Returned tokens, each with the entropy of the distribution it was chosen from.
    pub n_tokens: usize,
    /// Mean and population standard deviation of those entropies, in bits.
    pub entropy_mean_bits: f64,
    pub entropy_std_bits: f64,
    pub entropy_min_bits: f64,
    pub entropy_max_bits: f64,
    /// Share of tokens below `thresholds.low_entropy_bits`, and above `high_entropy_bits`.
    pub low_rate: f64,
    pub high_rate: f64,
    /// The thresholds the call was monitored with.
    pub thresholds: BetaMonitor,
    /// Speculative calls: drafted positions whose argmaxes were compared (0 otherwise).
    pub drafted: usize,
    /// Speculative calls: the share of drafted positions whose draft argmax equals the verify
    /// pass's; `None` without drafts.
    pub agreement_rate: Option<f64>,
}

impl BetaMonSummary {
    /// The agreement fell below `thresholds.agreement_floor`.
    pub fn agreement_below_floor(&self) -> bool {
        self.agreement_rate
            .is_some_and(|a| a < self.thresholds.agreement_floor)
    }

    /// The stderr summary line.
    pub fn line(&self) -> String {
        let t = &self.thresholds;
        let mut line = format!(
            "[beta_mon] summary: n_tokens={} H_mean={:.3}±{:.3} bits [min={:.3} max={:.3}] \
             low<{:.2}={:.1}% high>{:.2}={:.1}%",
            self.n_tokens,
            self.entropy_mean_bits,
            self.entropy_std_bits,
            self.entropy_min_bits,
            self.entropy_max_bits,
            t.low_entropy_bits,
            100.0 * self.low_rate,
            t.high_entropy_bits,
            100.0 * self.high_rate,
        );
        if let Some(a) = self.agreement_rate {
            line += &format!(
                " | draft/verify agreement={:.2}% (flip={:.2}%, n={})",
                100.0 * a,
                100.0 * (1.0 - a),
                self.drafted
            );
        }
        line
    }

    /// The one-line warning of a call whose agreement fell below the floor.
    pub fn agreement_warning(&self) -> Option<String> {
        let a = self
            .agreement_rate
            .filter(|_| self.agreement_below_floor())?;
        Some(format!(
            "[beta_mon] warning: draft/verify agreement {:.2}% (n={}) is below the floor {:.2}%: \
             the draft loops often pick another token than the verify loops \
             (docs/ABI.md \"BETA-MON\")",
            100.0 * a,
            self.drafted,
            100.0 * self.thresholds.agreement_floor
        ))
    }

    /// The summary as the JSON object written to `TINYLOOP_BETA_MON_FILE` (a NaN entropy, from
    /// logits that were not finite, is written as null).
    pub fn to_json(&self) -> serde_json::Value {
        let t = &self.thresholds;
        json!({
            "n_tokens": self.n_tokens,
            "entropy_mean_bits": self.entropy_mean_bits,
            "entropy_std_bits": self.entropy_std_bits,
            "entropy_min_bits": self.entropy_min_bits,
            "entropy_max_bits": self.entropy_max_bits,
            "low_rate": self.low_rate,
            "high_rate": self.high_rate,
            "agreement_rate": self.agreement_rate,
            "low_entropy_bits": t.low_entropy_bits,
            "high_entropy_bits": t.high_entropy_bits,
            "agreement_floor": t.agreement_floor,
            "drafted": self.drafted,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log(entropies: &[f32]) -> EntropyLog {
        let mut log = EntropyLog::new(Monitoring {
            thresholds: BetaMonitor::default(),
            verbose: false,
        });
        for (i, &h) in entropies.iter().enumerate() {
            log.record(i as u32, h);
        }
        log
    }

    #[test]
    fn statistics_match_a_direct_computation() {
        let hs = [0.0f32, 0.25, 3.5, 6.5, 11.649, 2.0, 0.49, 6.0];
        let s = log(&hs).summary(0, 0);
        let n = hs.len() as f64;
        let mean = hs.iter().map(|&h| h as f64).sum::<f64>() / n;
        let var = hs.iter().map(|&h| (h as f64 - mean).powi(2)).sum::<f64>() / n;
        // Welford and the two-pass formula agree to f64 rounding on 8 values of this size.
        assert!((s.entropy_mean_bits - mean).abs() < 1e-12);
        assert!((s.entropy_std_bits - var.sqrt()).abs() < 1e-12);
        assert_eq!(s.entropy_min_bits, 0.0);
        assert_eq!(s.entropy_max_bits, 11.649f32 as f64);
        // Below 0.5: 0, 0.25, 0.49; above 6.0: 6.5, 11.649 (6.0 itself is not above).
        assert_eq!(s.low_rate, 3.0 / 8.0);
        assert_eq!(s.high_rate, 2.0 / 8.0);
        assert_eq!(s.agreement_rate, None);
        assert!(!s.agreement_below_floor());
    }

    #[test]
    fn no_tokens_gives_zeros() {
        let s = log(&[]).summary(0, 0);
        assert_eq!(s.n_tokens, 0);
        for v in [
            s.entropy_mean_bits,
            s.entropy_std_bits,
            s.entropy_min_bits,
            s.entropy_max_bits,
            s.low_rate,
            s.high_rate,
        ] {
            assert_eq!(v, 0.0);
        }
    }

    #[test]
    fn the_line_has_the_documented_form() {
        let s = BetaMonSummary {
            n_tokens: 40,
            entropy_mean_bits: 3.989,
            entropy_std_bits: 3.752,
            entropy_min_bits: 0.0,
            entropy_max_bits: 11.649,
            low_rate: 0.3,
            high_rate: 0.325,
            thresholds: BetaMonitor::default(),
            drafted: 0,
            agreement_rate: None,
        };
        assert_eq!(
            s.line(),
            "[beta_mon] summary: n_tokens=40 H_mean=3.989±3.752 bits [min=0.000 max=11.649] \
             low<0.50=30.0% high>6.00=32.5%"
        );
        let spec = BetaMonSummary {
            drafted: 64,
            agreement_rate: Some(62.5 / 64.0),
            ..s
        };
        assert!(spec
            .line()
            .ends_with(" | draft/verify agreement=97.66% (flip=2.34%, n=64)"));
        assert_eq!(spec.agreement_warning(), None);
        let low = BetaMonSummary {
            agreement_rate: Some(0.5),
            ..spec
        };
        assert!(low.agreement_below_floor());
        let warning = low.agreement_warning().unwrap();
        assert!(warning.starts_with("[beta_mon] warning: draft/verify agreement 50.00% (n=64)"));
    }

    #[test]
    fn json_has_the_documented_fields() {
        let s = log(&[1.0, 3.0]).summary(4, 3);
        let v = s.to_json();
        assert_eq!(v["n_tokens"], 2);
        assert_eq!(v["entropy_mean_bits"], 2.0);
        assert_eq!(v["entropy_std_bits"], 1.0);
        assert_eq!(v["entropy_min_bits"], 1.0);
        assert_eq!(v["entropy_max_bits"], 3.0);
        assert_eq!(v["low_rate"], 0.0);
        assert_eq!(v["high_rate"], 0.0);
        assert_eq!(v["agreement_rate"], 0.75);
        assert_eq!(v["drafted"], 4);
        assert!(log(&[1.0]).summary(0, 0).to_json()["agreement_rate"].is_null());
    }
}
