//! The KV cache: what a session keeps of every earlier position for every block application.
//!
//! * [`KvMode`] says what an entry is: K and V (f16, INT8, INT8 deltas along the loop-iteration
//!   axis, or age-tiered deltas), or the block's normed attention input `h` (f16, INT8, INT4), from
//!   which K and V are recomputed with the block's weights.
//! * [`KvLayout`] is the one definition of where everything lives: the slot of each block
//!   application, the tiers and their regions, and the bytes. Both backends allocate exactly what
//!   it says and address it the same way, so a CPU cache and a GPU cache hold the same bytes.
//! * [`KvCache`] is the object a session owns: layout, allocated slots, the age-tier boundaries,
//!   and the backend's storage.
//! * [`codec`] holds the reference quantizers, which the CUDA kernels reproduce bit for bit.

pub mod codec;
mod layout;
pub mod pool;

use std::ffi::OsString;
use std::fmt;
use std::str::FromStr;

pub use layout::{
    Application, Codes, KvLayout, KvSlot, Scales, Scratch, Tier, AGE_BLOCK, H_TILE, KV_DESC_WORDS,
};

use crate::env::{self, Vars};
use crate::error::{Error, Result};

/// The environment variables of the default mode ([`KvMode::from_env`]).
pub const ENV_INT8: &str = "TINYLOOP_KV_INT8";
pub const ENV_DELTA: &str = "TINYLOOP_KV_DELTA";

/// Token-age boundaries of AGE-KV (seed page 003): entries younger than `int4_from` tokens are
/// INT8 deltas, older ones INT4 deltas with f16 scales, and from `fp8_from` on INT4 deltas with
/// FP8 (E4M3) scales. Both are multiples of [`AGE_BLOCK`], and `int4_from < fp8_from`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AgeTiers {
    pub int4_from: usize,
    pub fp8_from: usize,
}

impl Default for AgeTiers {
    fn default() -> Self {
        AgeTiers {
            int4_from: 1024,
            fp8_from: 4096,
        }
    }
}

impl AgeTiers {
    /// The bounds once a sequence is `seq_len` long: whole blocks of positions at least
    /// `int4_from` (`fp8_from`) older than the sequence's end.
    pub fn bounds(&self, seq_len: usize) -> TierBounds {
        let floor = |n: usize| n / AGE_BLOCK * AGE_BLOCK;
        TierBounds {
            mid_end: floor(seq_len.saturating_sub(self.int4_from)),
            old_end: floor(seq_len.saturating_sub(self.fp8_from)),
        }
    }

    pub fn validate(&self) -> Result<()> {
        let (a, b) = (self.int4_from, self.fp8_from);
        if a == 0 || !a.is_multiple_of(AGE_BLOCK) || !b.is_multiple_of(AGE_BLOCK) {
            return Err(Error::invalid(format!(
                "age tier boundaries must be positive multiples of {AGE_BLOCK}, got {a} and {b}"
            )));
        }
        if a >= b {
            return Err(Error::invalid(format!(
                "age tier boundaries out of order: the INT4 boundary ({a}) must be below the FP8 \
                 boundary ({b})"
            )));
        }
        Ok(())
    }

    /// Refuse a boundary above `max_position`: no entry of the model ever gets that old, so the
    /// caller meant something else. The defaults are the seed table's for every model and are
    /// taken as they are.
    pub fn check_reachable(&self, max_position: usize) -> Result<()> {
        if *self == AgeTiers::default() {
            return Ok(());
        }
        for (name, boundary) in [("INT4", self.int4_from), ("FP8", self.fp8_from)] {
            if boundary > max_position {
                return Err(Error::invalid(format!(
                    "KV mode {}: the {name} boundary {boundary} is above the model's \
                     max_position {max_position} (age boundaries must be at most \
                     {max_position})",
                    KvMode::Age(*self)
                )));
            }
        }
        Ok(())
    }
}

/// What the KV cache stores per position and block application (docs/NUMERICS.md "KV cache
/// modes").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvMode {
    /// K and V in f16.
    #[default]
    Fp16,
    /// The attention input h in f16; K and V are recomputed from it.
    Fp16H,
    /// h in INT8 with an f16 scale per head-sized group.
    Int8H,
    /// h in INT4 with an f16 scale per head-sized group.
    Int4H,
    /// K and V in INT8 with an f16 scale per token and head.
    Int8,
    /// Like `Int8`, but loop iteration i > 1 stores K_i − K̂_{i−1} and V_i − V̂_{i−1}, against
    /// the reconstruction K̂_{i−1} (the sum of the stored iterations 1..i−1).
    Delta,
    /// Delta entries whose precision falls with their age (AGE-KV).
    Age(AgeTiers),
}

/// The mode names, as accepted by [`KvMode::from_str`] and listed in errors.
pub const KV_MODE_NAMES: [&str; 7] = ["fp16", "fp16-h", "int8-h", "int4-h", "int8", "delta", "age"];

impl KvMode {
    /// The default mode when a caller names none: `TINYLOOP_KV_INT8=1` selects `int8`,
    /// `TINYLOOP_KV_DELTA=1` selects `delta` (the reference pages' variables), else `fp16`. Both
    /// on, or a value that is not a switch (docs/ABI.md "Environment variables"), is an error
    /// naming the variable.
    pub fn from_env() -> Result<KvMode> {
        Self::from_vars(env::process)
    }

    /// [`KvMode::from_env`] over any variable source.
    pub fn from_vars(var: impl Fn(&str) -> Option<OsString>) -> Result<KvMode> {
        let vars = Vars::new(&var);
        match (
            vars.switch(ENV_INT8, false)?,
            vars.switch(ENV_DELTA, false)?,
        ) {
            (true, true) => Err(Error::invalid(format!(
                "{ENV_INT8} and {ENV_DELTA} are both on: choose one KV mode"
            ))),
            (true, false) => Ok(KvMode::Int8),
            (false, true) => Ok(KvMode::Delta),
            (false, false) => Ok(KvMode::Fp16),
        }
    }

    /// Whether entries hold the attention input h (K and V are recomputed from it).
    pub fn stores_input(&self) -> bool {
        matches!(self, KvMode::Fp16H | KvMode::Int8H | KvMode::Int4H)
    }

    /// Whether loop iterations after the first store deltas against the previous iteration.
    pub fn is_delta(&self) -> bool {
        matches!(self, KvMode::Delta | KvMode::Age(_))
    }

    /// Whether a decode step can be captured as one graph: not when K and V are recomputed from
    /// h, since that work grows with the position.
    pub fn graph_capturable(&self) -> bool {
        !self.stores_input()
    }
}

impl fmt::Display for KvMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KvMode::Fp16 => f.write_str("fp16"),
            KvMode::Fp16H => f.write_str("fp16-h"),
            KvMode::Int8H => f.write_str("int8-h"),
            KvMode::Int4H => f.write_str("int4-h"),
            KvMode::Int8 => f.write_str("int8"),
            KvMode::Delta => f.write_str("delta"),
            KvMode::Age(t) if *t == AgeTiers::default() => f.write_str("age"),
            KvMode::Age(t) => write!(f, "age:{}:{}", t.int4_from, t.fp8_from),
        }
    }
}

impl FromStr for KvMode {
    type Err = Error;

    /// `fp16`, `fp16-h`, `int8-h`, `int4-h`, `int8`, `delta`, `age`, or `age:A:B` (AGE-KV with
    /// INT4 from age A and FP8 scales from age B).
    fn from_str(s: &str) -> Result<KvMode> {
        let mode = match s {
            "fp16" => KvMode::Fp16,
            "fp16-h" => KvMode::Fp16H,
            "int8-h" => KvMode::Int8H,
            "int4-h" => KvMode::Int4H,
            "int8" => KvMode::Int8,
            "delta" => KvMode::Delta,
            "age" => KvMode::Age(AgeTiers::default()),
            _ => match s
                .strip_prefix("age:")
                .map(|r| r.split(':').collect::<Vec<_>>())
            {
                Some(parts) if parts.len() == 2 => {
                    let number = |p: &str| {
                        p.parse::<usize>().map_err(|_| {
                            Error::invalid(format!("KV mode {s:?}: {p:?} is not an age in tokens"))
                        })
                    };
                    KvMode::Age(AgeTiers {
                        int4_from: number(parts[0])?,
                        fp8_from: number(parts[1])?,
                    })
                }
                _ => {
                    return Err(Error::invalid(format!(
                        "unknown KV mode {s:?}; the modes are {} (and age:A:B)",
                        KV_MODE_NAMES.join(", ")
                    )))
                }
            },
        };
        if let KvMode::Age(tiers) = mode {
            tiers.validate()?;
        }
        Ok(mode)
    }
}

/// Age-tier boundaries in positions: positions below `old_end` are in the FP8-scale tier, those
/// below `mid_end` in the INT4 tier, the rest in the INT8 tier. Always zero outside `age` mode.
/// Both only grow within a sequence, and are multiples of [`AGE_BLOCK`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierBounds {
    pub mid_end: usize,
    pub old_end: usize,
}

/// A range of positions whose entries move from one tier to a lower one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TierMove {
    pub from: usize,
    pub to: usize,
    pub first: usize,
    pub end: usize,
}

/// The KV cache of one session: its layout, the slots allocated so far, the age-tier bounds, the
/// backend's storage (zeroed at allocation), and the depth mask.
pub struct KvCache<S> {
    pub layout: KvLayout,
    pub slots: usize,
    pub bounds: TierBounds,
    pub storage: S,
    pub depths: Depths<S>,
}

/// The depth of a position that ran every loop iteration of its call.
pub const ALL_DEPTHS: u32 = u32::MAX;

/// How many loop iterations each position of the sequence reached, for calls that stop positions
/// early without filling the slots of the iterations they skip (exit criteria under the reference
/// policy): attention in a slot of loop iteration i reads only the positions whose depth is at
/// least i ([`KvLayout::depth_needed`]), as if the skipped entries did not exist. Pre and post
/// slots read every position.
///
/// The mask is `capacity` little-endian u32 in backend storage, allocated when a position first
/// stops early. While it is off (no position of the sequence stopped early) the backends read no
/// mask at all.
pub struct Depths<S> {
    pub mask: Option<DepthMask<S>>,
}

/// The storage of a depth mask, and whether it is on.
pub struct DepthMask<S> {
    pub storage: S,
    pub on: bool,
}

impl<S> Default for Depths<S> {
    fn default() -> Self {
        Depths { mask: None }
    }
}

impl<S> Depths<S> {
    /// The mask attention applies, when it is on.
    pub fn mask(&self) -> Option<&S> {
        self.mask.as_ref().filter(|m| m.on).map(|m| &m.storage)
    }

    /// Bytes of the mask's storage for a cache of `capacity` positions (0 until it is needed).
    pub fn bytes(&self, capacity: usize) -> usize {
        self.mask.as_ref().map_or(0, |_| 4 * capacity)
    }
}

impl<S> KvCache<S> {
    /// Bytes of device memory this cache holds (the layout's count, which the backends allocate
    /// exactly).
    pub fn bytes(&self) -> usize {
        self.layout.bytes(self.slots)
    }

    /// How many of the `rows` rows of a step from position `start` see the age-tier bounds that
    /// the first row would see alone (all of them outside `age` mode). A step of that many rows
    /// ages the cache exactly as one-row steps would.
    pub fn uniform_rows(&self, start: usize, rows: usize) -> usize {
        let KvMode::Age(tiers) = self.layout.mode else {
            return rows;
        };
        let first = tiers.bounds(start + 1);
        (1..=rows)
            .take_while(|&j| tiers.bounds(start + j) == first)
            .count()
    }

    /// Advance the tier bounds for a step that writes positions `start..end` and return the moves
    /// to make first (entries of positions below `start` that changed tier). A step at position
    /// 0 starts a new sequence.
    pub fn advance_tiers(&mut self, start: usize, end: usize) -> Vec<TierMove> {
        if start == 0 {
            self.bounds = TierBounds::default();
        }
        let KvMode::Age(tiers) = self.layout.mode else {
            return Vec::new();
        };
        let old = self.bounds;
        let at_end = tiers.bounds(end);
        let new = TierBounds {
            mid_end: old.mid_end.max(at_end.mid_end),
            old_end: old.old_end.max(at_end.old_end),
        };
        self.bounds = new;
        // Positions at or after `start` are written by this step straight into their tier.
        let mut moves = Vec::new();
        let mut push = |from, to, first: usize, end_: usize| {
            let end_ = end_.min(start);
            if first < end_ {
                moves.push(TierMove {
                    from,
                    to,
                    first,
                    end: end_,
                });
            }
        };
        push(1, 2, old.old_end, old.mid_end.min(new.old_end));
        push(0, 2, old.mid_end, new.old_end);
        push(0, 1, old.mid_end.max(new.old_end), new.mid_end);
        moves
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_and_print_round_trip() {
        for name in KV_MODE_NAMES {
            assert_eq!(name.parse::<KvMode>().unwrap().to_string(), name);
        }
        let custom: KvMode = "age:64:128".parse().unwrap();
        assert_eq!(
            custom,
            KvMode::Age(AgeTiers {
                int4_from: 64,
                fp8_from: 128
            })
        );
        assert_eq!(custom.to_string(), "age:64:128");
    }

    #[test]
    fn bad_modes_say_what_is_accepted() {
        let err = "int3".parse::<KvMode>().unwrap_err().to_string();
        for name in KV_MODE_NAMES {
            assert!(err.contains(name), "{err}");
        }
        let err = "age:4096:1024".parse::<KvMode>().unwrap_err().to_string();
        assert!(err.contains("out of order"), "{err}");
        let err = "age:100:200".parse::<KvMode>().unwrap_err().to_string();
        assert!(err.contains("multiples of 64"), "{err}");
        assert!("age:64".parse::<KvMode>().is_err());
        assert!("age:x:128".parse::<KvMode>().is_err());
    }

    #[test]
    fn environment_selects_the_default_mode() {
        let mode = |pairs: &[(&str, &[u8])]| KvMode::from_vars(env::table(pairs));
        assert_eq!(mode(&[]).unwrap(), KvMode::Fp16);
        assert_eq!(
            mode(&[(ENV_INT8, b""), (ENV_DELTA, b"")]).unwrap(),
            KvMode::Fp16
        );
        assert_eq!(
            mode(&[(ENV_INT8, b"0"), (ENV_DELTA, b"0")]).unwrap(),
            KvMode::Fp16
        );
        assert_eq!(mode(&[(ENV_INT8, b"1")]).unwrap(), KvMode::Int8);
        assert_eq!(
            mode(&[(ENV_INT8, b"1"), (ENV_DELTA, b"0")]).unwrap(),
            KvMode::Int8
        );
        assert_eq!(mode(&[(ENV_DELTA, b"1")]).unwrap(), KvMode::Delta);
        // The words every switch takes (these were once ignored here).
        assert_eq!(mode(&[(ENV_INT8, b"on")]).unwrap(), KvMode::Int8);
        assert_eq!(
            mode(&[(ENV_DELTA, b"true"), (ENV_INT8, b"off")]).unwrap(),
            KvMode::Delta
        );
        for var in [ENV_INT8, ENV_DELTA] {
            for bad in ["2", "yes", "-1", "10"] {
                let e = mode(&[(var, bad.as_bytes())]).unwrap_err().to_string();
                assert!(
                    e.contains(&format!(
                        "{var}={bad:?} is not accepted: expected 1, on or true"
                    )),
                    "{e}"
                );
            }
            let e = mode(&[(var, env::NOT_UTF8)]).unwrap_err().to_string();
            assert!(
                e.contains(&format!("{var}=\"1\\xFF\" is not valid UTF-8")),
                "{e}"
            );
        }
        let e = mode(&[(ENV_INT8, b"1"), (ENV_DELTA, b"1")])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("TINYLOOP_KV_INT8 and TINYLOOP_KV_DELTA are both on"),
            "{e}"
        );
        // A bad value is reported even beside a valid one that would have chosen the mode.
        let e = mode(&[(ENV_INT8, b"yes"), (ENV_DELTA, b"1")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("TINYLOOP_KV_INT8=\"yes\""), "{e}");
    }
}
