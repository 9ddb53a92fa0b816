//! The BETA-MON environment variables, read once when a model is opened.

use std::ffi::OsString;
use std::path::PathBuf;

use super::{BetaMonitor, Names};
use crate::env::{self, Vars};
use crate::error::Result;

const MONITOR: &str = "TINYLOOP_BETA_MONITOR";
const VERBOSE: &str = "TINYLOOP_BETA_MON_VERBOSE";
const FLOOR: &str = "TINYLOOP_BETA_MON_AGREEMENT_FLOOR";
const LOW: &str = "TINYLOOP_BETA_MON_LOW_ENTROPY_BITS";
const HIGH: &str = "TINYLOOP_BETA_MON_HIGH_ENTROPY_BITS";
const FILE: &str = "TINYLOOP_BETA_MON_FILE";

/// What the BETA-MON variables ask for. Unset variables take the defaults: off, not verbose,
/// [`BetaMonitor::default`] thresholds, no file.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BetaMonEnv {
    /// `TINYLOOP_BETA_MONITOR=1`: monitor every call, print its summary line on stderr.
    pub enabled: bool,
    /// `TINYLOOP_BETA_MON_VERBOSE=1`: with the monitor on, also a line per token.
    pub verbose: bool,
    /// The thresholds of calls monitored because of `TINYLOOP_BETA_MONITOR`.
    pub thresholds: BetaMonitor,
    /// `TINYLOOP_BETA_MON_FILE`: after every monitored call, its summary as JSON here.
    pub file: Option<PathBuf>,
}

impl BetaMonEnv {
    /// Read the process environment; a variable with a bad value is an error naming it.
    pub fn from_env() -> Result<BetaMonEnv> {
        Self::from_vars(env::process)
    }

    /// [`BetaMonEnv::from_env`] over any source of variables.
    pub fn from_vars(var: impl Fn(&str) -> Option<OsString>) -> Result<BetaMonEnv> {
        let vars = Vars::new(&var);
        let defaults = BetaMonitor::default();
        let thresholds = BetaMonitor {
            low_entropy_bits: vars.real(LOW, defaults.low_entropy_bits)?,
            high_entropy_bits: vars.real(HIGH, defaults.high_entropy_bits)?,
            agreement_floor: vars.real(FLOOR, defaults.agreement_floor)?,
        };
        thresholds.check(&Names {
            low: LOW,
            high: HIGH,
            floor: FLOOR,
        })?;
        Ok(BetaMonEnv {
            enabled: vars.switch(MONITOR, false)?,
            verbose: vars.switch(VERBOSE, false)?,
            thresholds,
            file: vars.path(FILE),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(pairs: &[(&str, &[u8])]) -> Result<BetaMonEnv> {
        BetaMonEnv::from_vars(env::table(pairs))
    }

    fn error(pairs: &[(&str, &[u8])]) -> String {
        read(pairs).unwrap_err().to_string()
    }

    #[test]
    fn unset_or_empty_is_off_with_the_defaults() {
        assert_eq!(read(&[]).unwrap(), BetaMonEnv::default());
        let empty = [MONITOR, VERBOSE, FLOOR, LOW, HIGH, FILE].map(|name| (name, &b""[..]));
        assert_eq!(read(&empty).unwrap(), BetaMonEnv::default());
    }

    #[test]
    fn every_variable_is_read() {
        let env = read(&[
            (MONITOR, b"1"),
            (VERBOSE, b"1"),
            (FLOOR, b"0.9"),
            (LOW, b"0.25"),
            (HIGH, b"7"),
            (FILE, b"/tmp/beta.json"),
        ])
        .unwrap();
        assert!(env.enabled && env.verbose);
        assert_eq!(
            env.thresholds,
            BetaMonitor {
                low_entropy_bits: 0.25,
                high_entropy_bits: 7.0,
                agreement_floor: 0.9
            }
        );
        assert_eq!(env.file, Some(PathBuf::from("/tmp/beta.json")));
        let off = read(&[(MONITOR, b"0"), (VERBOSE, b"0")]).unwrap();
        assert!(!off.enabled && !off.verbose);
        // A path needs no UTF-8.
        use std::os::unix::ffi::OsStrExt;
        let file = read(&[(FILE, env::NOT_UTF8)]).unwrap().file.unwrap();
        assert_eq!(file.as_os_str().as_bytes(), env::NOT_UTF8);
    }

    #[test]
    fn bad_values_name_the_variable_and_value() {
        for var in [MONITOR, VERBOSE] {
            for bad in ["yes", "2", "On", "-1"] {
                let e = error(&[(var, bad.as_bytes())]);
                assert!(
                    e.contains(&format!(
                        "{var}={bad:?} is not accepted: expected 1, on or true"
                    )),
                    "{e}"
                );
            }
        }
        for var in [LOW, HIGH, FLOOR] {
            for bad in ["lots", "nan", "inf"] {
                let e = error(&[(var, bad.as_bytes())]);
                assert!(
                    e.contains(&format!(
                        "{var}={bad:?} is not accepted: expected a finite number"
                    )),
                    "{e}"
                );
            }
        }
        for var in [MONITOR, VERBOSE, LOW, HIGH, FLOOR] {
            let e = error(&[(var, env::NOT_UTF8)]);
            assert!(
                e.contains(&format!("{var}=\"1\\xFF\" is not valid UTF-8")),
                "{e}"
            );
        }
        let e = error(&[(LOW, b"-1")]);
        assert!(
            e.contains(
                "TINYLOOP_BETA_MON_LOW_ENTROPY_BITS must be a finite number of bits >= 0, got -1"
            ),
            "{e}"
        );
        let e = error(&[(LOW, b"3"), (HIGH, b"2")]);
        assert!(
            e.contains(LOW) && e.contains(HIGH) && e.contains("must not exceed"),
            "{e}"
        );
        let e = error(&[(FLOOR, b"1.5")]);
        assert!(
            e.contains("TINYLOOP_BETA_MON_AGREEMENT_FLOOR must be in [0, 1], got 1.5"),
            "{e}"
        );
    }
}
