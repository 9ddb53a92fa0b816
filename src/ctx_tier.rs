//! CTX-TIER: the loop body's precision follows the context length.
//!
//! The tier is a function of token positions: the row at position p runs at the tier the policy
//! gives for `seq_len = p + 1`, taking the rows in order. The session's tier moves SHORT → LONG
//! when `seq_len ≥ long_t` and LONG → SHORT when `seq_len < short_t` (hysteresis; since a call's
//! sequence only grows, that happens at its first rows). Steps are cut so that no step straddles a
//! change ([`TierTracker::ahead`]): a prompt of at least `long_t` tokens runs its first
//! `long_t − 1` positions at INT4 and the rest at INT2, however it is chunked, and a speculative
//! round computes what one-token decode steps would. Each step is one observation, of
//! `seq_len = start_pos + rows`, the sequence length once the step has run. At LONG the step runs
//! the loop body re-quantized to INT2 (model/body.rs). A call without a policy runs at SHORT.
//!
//! The tier is the session's: it persists between calls. This module is the policy and its
//! telemetry (stderr lines and the optional JSON file); model/body.rs holds the weights.

use std::ffi::OsString;
use std::fmt;
use std::path::PathBuf;
use std::time::Instant;

use crate::env::{self, Vars};
use crate::error::{Error, Result};
use crate::format::DType;

/// Environment variables of the default policy (used by generation calls that pass none).
pub const ENV_ENABLE: &str = "TINYLOOP_CTX_TIER";
pub const ENV_SHORT_T: &str = "TINYLOOP_CTX_TIER_SHORT_T";
pub const ENV_LONG_T: &str = "TINYLOOP_CTX_TIER_LONG_T";
pub const ENV_LONG_BITS: &str = "TINYLOOP_CTX_TIER_LONG_BITS";
pub const ENV_VERBOSE: &str = "TINYLOOP_CTX_TIER_VERBOSE";
pub const ENV_FILE: &str = "TINYLOOP_CTX_TIER_FILE";

/// A tier policy: the thresholds and what to report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CtxTier {
    /// LONG → SHORT when an observed `seq_len < short_t`.
    pub short_t: usize,
    /// SHORT → LONG when an observed `seq_len ≥ long_t`.
    pub long_t: usize,
    /// Bits of the loop body at LONG (only 2 exists in the format).
    pub long_bits: u32,
    /// Add every transition to the summary on stderr.
    pub verbose: bool,
    /// Write the call's summary here as JSON.
    pub file: Option<PathBuf>,
}

impl Default for CtxTier {
    fn default() -> Self {
        CtxTier {
            short_t: 512,
            long_t: 2048,
            long_bits: 2,
            verbose: false,
            file: None,
        }
    }
}

impl CtxTier {
    pub fn validate(&self) -> Result<()> {
        self.check().map_err(Error::invalid)
    }

    fn check(&self) -> std::result::Result<(), String> {
        if self.short_t == 0 {
            return Err("ctx_tier short_t must be >= 1".into());
        }
        if self.short_t > self.long_t {
            return Err(format!(
                "ctx_tier short_t ({}) must be <= long_t ({})",
                self.short_t, self.long_t
            ));
        }
        if self.long_bits != 2 {
            return Err(format!(
                "ctx_tier long_bits must be 2 (INT2, the only narrower encoding), got {}",
                self.long_bits
            ));
        }
        Ok(())
    }

    /// The tier after observing `seq_len` at `tier`.
    fn next(&self, tier: Tier, seq_len: usize) -> Tier {
        match tier {
            Tier::Short if seq_len >= self.long_t => Tier::Long,
            Tier::Long if seq_len < self.short_t => Tier::Short,
            tier => tier,
        }
    }

    /// The encoding of the loop body at LONG.
    pub fn long_dtype(&self) -> DType {
        DType::Int2
    }

    /// The policy `TINYLOOP_CTX_TIER=1` and its companions describe; `None` when it is unset or
    /// off. A bad value of any of the variables is an error naming it, even when the policy is
    /// off.
    pub fn from_env() -> Result<Option<CtxTier>> {
        Self::from_vars(env::process)
    }

    /// [`CtxTier::from_env`] over any variable source.
    pub fn from_vars(var: impl Fn(&str) -> Option<OsString>) -> Result<Option<CtxTier>> {
        let vars = Vars::new(&var);
        let defaults = CtxTier::default();
        let any = 1..=usize::MAX as u64;
        let enabled = vars.switch(ENV_ENABLE, false)?;
        let tier = CtxTier {
            short_t: vars.number(ENV_SHORT_T, defaults.short_t, any.clone())?,
            long_t: vars.number(ENV_LONG_T, defaults.long_t, any)?,
            long_bits: vars.number(ENV_LONG_BITS, defaults.long_bits, 2..=2)?,
            verbose: vars.switch(ENV_VERBOSE, false)?,
            file: vars.path(ENV_FILE),
        };
        if !enabled {
            return Ok(None);
        }
        // The variables' ranges leave one relation to check: short_t <= long_t.
        tier.check()
            .map_err(|why| Error::invalid(format!("{ENV_SHORT_T} and {ENV_LONG_T}: {why}")))?;
        Ok(Some(tier))
    }
}

/// The precision tier of a session.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Tier {
    /// The loop body as loaded (INT4).
    #[default]
    Short,
    /// The loop body re-quantized to INT2.
    Long,
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Tier::Short => "SHORT",
            Tier::Long => "LONG",
        })
    }
}

/// What one call with a tier policy observed.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CtxTierStats {
    /// Observations (steps).
    pub observations: usize,
    /// Steps that ran at each tier.
    pub short_steps: usize,
    pub long_steps: usize,
    pub transitions: usize,
    /// `seq_len` of the last observation.
    pub last_seq_len: usize,
    /// From the first observation to the end of the call.
    pub elapsed_ms: f64,
    /// Time spent making loop bodies at transitions (re-pack or upload again).
    pub apply_ms: f64,
    /// Net device bytes the call's transitions freed (negative: allocated).
    pub freed_bytes: i64,
    /// The session's tier at the end of the call.
    pub tier: Tier,
}

impl CtxTierStats {
    fn percent(&self, steps: usize) -> f64 {
        if self.observations == 0 {
            0.0
        } else {
            100.0 * steps as f64 / self.observations as f64
        }
    }
}

/// One transition of a call: observation number, `seq_len`, new tier.
#[derive(Clone, Copy, Debug)]
struct Transition {
    observation: usize,
    seq_len: usize,
    to: Tier,
}

struct Call {
    policy: CtxTier,
    /// Print the call's lines on stderr (the model's `log` option).
    log: bool,
    start: Instant,
    stats: CtxTierStats,
    transitions: Vec<Transition>,
    announced: bool,
}

impl Call {
    /// Print the policy once, when the call first observes anything (a call refused earlier
    /// prints nothing), and start its clock.
    fn announce(&mut self) {
        if self.announced {
            return;
        }
        self.announced = true;
        let p = &self.policy;
        log_line!(
            self.log,
            "[ctx_tier] enabled: short_t={} long_t={} long_bits=INT{}",
            p.short_t,
            p.long_t,
            p.long_bits
        );
        self.start = Instant::now();
    }
}

/// A session's tier and the record of its call in flight.
#[derive(Default)]
pub struct TierTracker {
    tier: Tier,
    call: Option<Call>,
}

impl TierTracker {
    /// The session's tier now.
    pub fn tier(&self) -> Tier {
        self.tier
    }

    /// Start a call under `policy` (none: the call runs at SHORT and reports nothing), printing
    /// its lines on stderr when `log`. Nothing is reported before its first step, so a call
    /// refused earlier prints nothing.
    pub fn begin(&mut self, policy: Option<CtxTier>, log: bool) {
        self.call = policy.map(|policy| Call {
            policy,
            log,
            start: Instant::now(),
            stats: CtxTierStats::default(),
            transitions: Vec::new(),
            announced: false,
        });
    }

    /// Observe a step that leaves the sequence `seq_len` long; returns the tier it runs at.
    pub fn observe(&mut self, seq_len: usize) -> Tier {
        let Some(call) = &mut self.call else {
            self.tier = Tier::Short;
            return self.tier;
        };
        call.announce();
        call.stats.observations += 1;
        call.stats.last_seq_len = seq_len;
        let next = call.policy.next(self.tier, seq_len);
        if next != self.tier {
            self.record(seq_len, next);
        }
        if let Some(call) = &mut self.call {
            match next {
                Tier::Short => call.stats.short_steps += 1,
                Tier::Long => call.stats.long_steps += 1,
            }
        }
        next
    }

    /// Take positions `0..n` as already computed at SHORT (a prefix cache or resume handle keeps
    /// INT4 results): the tracker goes on as if it had observed them. An error when the call's
    /// policy would run any of them at LONG, since the handle's entries would then differ from a
    /// fresh computation.
    pub fn replay_short(&mut self, n: usize) -> Result<()> {
        let Some(call) = &mut self.call else {
            return Ok(());
        };
        // The tiers of positions 0..n, one row at a time.
        let mut tier = self.tier;
        let any_long = (1..=n).any(|seq_len| {
            tier = call.policy.next(tier, seq_len);
            tier == Tier::Long
        });
        if any_long {
            return Err(Error::invalid(format!(
                "the handle's {n} positions were computed at the SHORT tier (INT4 loop body), but \
                 this call's ctx_tier policy would run some of them at LONG: use a long_t above \
                 {n}, or no policy"
            )));
        }
        call.announce();
        if self.tier == Tier::Long {
            // Position 0 (seq_len 1) took the sequence back to SHORT.
            self.record(1, Tier::Short);
        }
        Ok(())
    }

    /// The tier of the row at position `pos` in a step from there, and how many of the step's
    /// `rows` rows run at it: the rows up to the first whose `seq_len` changes the tier. A step of
    /// that many rows observes, at its end, the tier each of its rows would have observed alone.
    /// Observes nothing.
    pub fn ahead(&self, pos: usize, rows: usize) -> (Tier, usize) {
        let Some(call) = &self.call else {
            return (Tier::Short, rows);
        };
        let policy = &call.policy;
        let first = policy.next(self.tier, pos + 1);
        let same = (1..=rows)
            .take_while(|&j| {
                let seq_len = pos + j;
                policy.next(self.tier, seq_len) == first && policy.next(first, seq_len) == first
            })
            .count();
        (first, same)
    }

    /// The session's tier changes to `to` at `seq_len` (at the current observation; 0 before the
    /// call's first step).
    fn record(&mut self, seq_len: usize, to: Tier) {
        if let Some(call) = &mut self.call {
            let observation = call.stats.observations;
            log_line!(
                call.log,
                "[ctx_tier] transition at observation {observation} (seq_len={seq_len}): {} -> \
                 {to}",
                self.tier
            );
            call.stats.transitions += 1;
            call.transitions.push(Transition {
                observation,
                seq_len,
                to,
            });
        }
        self.tier = to;
    }

    /// Record a change of the session's loop body: `weights` made in `ms` (re-packed, or
    /// uploaded again), `freed` net device bytes. Reported only under a policy.
    pub fn applied(&mut self, to: Tier, weights: usize, ms: f64, freed: i64) {
        let Some(call) = &mut self.call else {
            return;
        };
        call.stats.apply_ms += ms;
        call.stats.freed_bytes += freed;
        let mb = freed as f64 / 1e6;
        match to {
            Tier::Long => log_line!(
                call.log,
                "[ctx_tier] apply: loop body, {weights} weights re-packed (INT4 → INT{}, {mb:.2} MB \
                 freed) in {ms:.1} ms",
                call.policy.long_bits
            ),
            Tier::Short => log_line!(
                call.log,
                "[ctx_tier] apply: loop body, {weights} weights restored (INT{} → INT4, {:.2} MB \
                 allocated) in {ms:.1} ms",
                call.policy.long_bits, -mb
            ),
        }
    }

    /// End the call: print the summary, write the JSON file, and return the statistics (none
    /// when the call had no policy or ran no step).
    pub fn finish(&mut self) -> Option<CtxTierStats> {
        let mut call = self.call.take().filter(|c| c.stats.observations > 0)?;
        let stats = &mut call.stats;
        stats.elapsed_ms = call.start.elapsed().as_secs_f64() * 1e3;
        stats.tier = self.tier;
        log_line!(
            call.log,
            "[ctx_tier] summary: n_obs={} elapsed={:.1}ms SHORT={:.1}% LONG={:.1}% transitions={} \
             last_seq_len={}",
            stats.observations,
            stats.elapsed_ms,
            stats.percent(stats.short_steps),
            stats.percent(stats.long_steps),
            stats.transitions,
            stats.last_seq_len
        );
        if call.policy.verbose {
            for t in &call.transitions {
                let from = match t.to {
                    Tier::Long => Tier::Short,
                    Tier::Short => Tier::Long,
                };
                log_line!(
                    call.log,
                    "[ctx_tier]   t={} seq_len={} : {from} -> {}",
                    t.observation,
                    t.seq_len,
                    t.to
                );
            }
        }
        if let Some(path) = &call.policy.file {
            if let Err(e) = std::fs::write(path, summary_json(&call).to_string()) {
                log_line!(
                    call.log,
                    "[ctx_tier] could not write {}: {e}",
                    path.display()
                );
            }
        }
        Some(call.stats)
    }
}

fn summary_json(call: &Call) -> serde_json::Value {
    let s = &call.stats;
    let transitions: Vec<_> = call
        .transitions
        .iter()
        .map(|t| {
            serde_json::json!({
                "observation": t.observation,
                "seq_len": t.seq_len,
                "to": t.to.to_string(),
            })
        })
        .collect();
    serde_json::json!({
        "short_t": call.policy.short_t,
        "long_t": call.policy.long_t,
        "long_bits": call.policy.long_bits,
        "n_obs": s.observations,
        "elapsed_ms": s.elapsed_ms,
        "short_pct": s.percent(s.short_steps),
        "long_pct": s.percent(s.long_steps),
        "transitions": s.transitions,
        "last_seq_len": s.last_seq_len,
        "tier": s.tier.to_string(),
        "apply_ms": s.apply_ms,
        "freed_bytes": s.freed_bytes,
        "transition_list": transitions,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(short_t: usize, long_t: usize) -> Option<CtxTier> {
        Some(CtxTier {
            short_t,
            long_t,
            ..CtxTier::default()
        })
    }

    #[test]
    fn hysteresis_between_the_thresholds() {
        let mut t = TierTracker::default();
        t.begin(policy(4, 8), false);
        let tiers: Vec<Tier> = [5, 6, 7, 8, 9].map(|s| t.observe(s)).to_vec();
        assert_eq!(tiers[..3], [Tier::Short; 3]);
        assert_eq!(tiers[3..], [Tier::Long; 2]);
        let stats = t.finish().unwrap();
        assert_eq!(
            (stats.transitions, stats.short_steps, stats.long_steps),
            (1, 3, 2)
        );
        // A new call between the thresholds stays LONG; below short_t it returns to SHORT.
        t.begin(policy(4, 8), false);
        assert_eq!(t.observe(5), Tier::Long);
        t.finish();
        t.begin(policy(4, 8), false);
        assert_eq!(t.observe(3), Tier::Short);
        assert_eq!(t.finish().unwrap().transitions, 1);
        // A call without a policy runs at SHORT.
        t.begin(policy(4, 8), false);
        t.observe(100);
        t.finish();
        t.begin(None, false);
        assert_eq!(t.observe(100), Tier::Short);
        assert!(t.finish().is_none());
    }

    fn from(pairs: &[(&str, &[u8])]) -> Result<Option<CtxTier>> {
        CtxTier::from_vars(env::table(pairs))
    }

    fn error(pairs: &[(&str, &[u8])]) -> String {
        from(pairs).unwrap_err().to_string()
    }

    #[test]
    fn environment_values_are_read() {
        assert_eq!(from(&[]).unwrap(), None);
        assert_eq!(from(&[(ENV_ENABLE, b"0")]).unwrap(), None);
        assert_eq!(from(&[(ENV_ENABLE, b"")]).unwrap(), None);
        assert_eq!(
            from(&[(ENV_ENABLE, b"1")]).unwrap(),
            Some(CtxTier::default())
        );
        let got = from(&[
            (ENV_ENABLE, b"1"),
            (ENV_SHORT_T, b"8"),
            (ENV_LONG_T, b"18446744073709551615"),
            (ENV_LONG_BITS, b"2"),
            (ENV_VERBOSE, b"1"),
            (ENV_FILE, b"/tmp/x.json"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            got,
            CtxTier {
                short_t: 8,
                long_t: usize::MAX,
                long_bits: 2,
                verbose: true,
                file: Some(PathBuf::from("/tmp/x.json")),
            }
        );
        // Empty is unset: the defaults.
        let got = from(&[(ENV_ENABLE, b"1"), (ENV_SHORT_T, b""), (ENV_FILE, b"")]);
        assert_eq!(got.unwrap(), Some(CtxTier::default()));
        // A path needs no UTF-8.
        use std::os::unix::ffi::OsStrExt;
        let got = from(&[(ENV_ENABLE, b"1"), (ENV_FILE, env::NOT_UTF8)]);
        let file = got.unwrap().unwrap().file.unwrap();
        assert_eq!(file.as_os_str().as_bytes(), env::NOT_UTF8);
    }

    #[test]
    fn bad_environment_values_name_the_variable_and_value() {
        let switch = "expected 1, on or true, or 0, off or false (unset or empty: 0)";
        let count = "expected an integer ≥ 1";
        for (var, value, expected) in [
            (ENV_ENABLE, "yes", switch),
            (ENV_ENABLE, "2", switch),
            (ENV_ENABLE, "ON", switch),
            (ENV_VERBOSE, "-1", switch),
            (ENV_SHORT_T, "0", count),
            (ENV_SHORT_T, "x", count),
            (ENV_SHORT_T, "18446744073709551616", count),
            (ENV_LONG_T, "-5", count),
            (ENV_LONG_BITS, "3", "expected 2"),
            (ENV_LONG_BITS, "4294967298", "expected 2"),
            (ENV_LONG_BITS, "4294967300", "expected 2"),
        ] {
            // The variables are checked whether or not the policy is on.
            for enable in [&b"1"[..], b"0"] {
                let pairs = [(ENV_ENABLE, enable), (var, value.as_bytes())];
                let pairs = if var == ENV_ENABLE {
                    &pairs[1..]
                } else {
                    &pairs[..]
                };
                let e = error(pairs);
                assert!(
                    e.contains(&format!("{var}={value:?} is not accepted: {expected}")),
                    "{e}"
                );
            }
        }
        for var in [
            ENV_ENABLE,
            ENV_SHORT_T,
            ENV_LONG_T,
            ENV_LONG_BITS,
            ENV_VERBOSE,
        ] {
            let e = error(&[(var, env::NOT_UTF8)]);
            assert!(
                e.contains(&format!("{var}=\"1\\xFF\" is not valid UTF-8")),
                "{e}"
            );
        }
        let e = error(&[(ENV_ENABLE, b"1"), (ENV_SHORT_T, b"99"), (ENV_LONG_T, b"9")]);
        assert!(
            e.contains("TINYLOOP_CTX_TIER_SHORT_T and TINYLOOP_CTX_TIER_LONG_T: ctx_tier short_t (99) must be <= long_t (9)"),
            "{e}"
        );
    }
}
