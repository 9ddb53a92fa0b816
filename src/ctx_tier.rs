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

use std::fmt;
use std::path::PathBuf;
use std::time::Instant;

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
    /// off. A bad value is an error naming the variable.
    pub fn from_env() -> Result<Option<CtxTier>> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// [`CtxTier::from_env`] over any variable source.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<CtxTier>> {
        if !flag(ENV_ENABLE, var(ENV_ENABLE))? {
            return Ok(None);
        }
        let number = |name: &str, default: usize| -> Result<usize> {
            match var(name) {
                None => Ok(default),
                Some(v) => v.trim().parse().map_err(|_| {
                    Error::invalid(format!("{name}={v:?} is not a non-negative integer"))
                }),
            }
        };
        let defaults = CtxTier::default();
        let tier = CtxTier {
            short_t: number(ENV_SHORT_T, defaults.short_t)?,
            long_t: number(ENV_LONG_T, defaults.long_t)?,
            long_bits: number(ENV_LONG_BITS, defaults.long_bits as usize)? as u32,
            verbose: flag(ENV_VERBOSE, var(ENV_VERBOSE))?,
            file: var(ENV_FILE).filter(|f| !f.is_empty()).map(PathBuf::from),
        };
        if var(ENV_LONG_BITS).is_some() && tier.long_bits != 2 {
            return Err(Error::invalid(format!(
                "{ENV_LONG_BITS}={} is not supported: the only LONG encoding is INT2 (2)",
                tier.long_bits
            )));
        }
        tier.check()
            .map_err(|why| Error::invalid(format!("{ENV_ENABLE} settings: {why}")))?;
        Ok(Some(tier))
    }
}

fn flag(name: &str, value: Option<String>) -> Result<bool> {
    match value.as_deref().map(str::trim) {
        None | Some("") | Some("0") | Some("off") | Some("false") => Ok(false),
        Some("1") | Some("on") | Some("true") => Ok(true),
        Some(v) => Err(Error::invalid(format!(
            "{name}={v:?} is not a switch (1/on/true or 0/off/false)"
        ))),
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

    #[test]
    fn environment_values_are_checked() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert_eq!(CtxTier::from_vars(vars(&[])).unwrap(), None);
        assert_eq!(
            CtxTier::from_vars(vars(&[(ENV_ENABLE, "1")])).unwrap(),
            Some(CtxTier::default())
        );
        let got = CtxTier::from_vars(vars(&[
            (ENV_ENABLE, "1"),
            (ENV_SHORT_T, "8"),
            (ENV_LONG_T, "24"),
            (ENV_VERBOSE, "1"),
            (ENV_FILE, "/tmp/x.json"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!((got.short_t, got.long_t, got.verbose), (8, 24, true));
        for (bad, named) in [
            (&[(ENV_ENABLE, "yes please")][..], ENV_ENABLE),
            (
                &[(ENV_ENABLE, "1"), (ENV_LONG_BITS, "3")][..],
                ENV_LONG_BITS,
            ),
            (&[(ENV_ENABLE, "1"), (ENV_SHORT_T, "x")][..], ENV_SHORT_T),
            (
                &[(ENV_ENABLE, "1"), (ENV_SHORT_T, "99"), (ENV_LONG_T, "9")][..],
                "short_t",
            ),
        ] {
            let owned: Vec<(String, String)> = bad
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            let err =
                CtxTier::from_vars(|n| owned.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone()))
                    .unwrap_err()
                    .to_string();
            assert!(err.contains(named), "{err}");
        }
    }
}
