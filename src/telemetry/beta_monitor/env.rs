//! The BETA-MON environment variables, read once when a model is opened.

use std::path::PathBuf;

use super::{BetaMonitor, Names};
use crate::error::{Error, Result};

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
        Self::from_vars(|name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()))
    }

    /// [`BetaMonEnv::from_env`] over any source of variables.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<BetaMonEnv> {
        let defaults = BetaMonitor::default();
        let number = |name: &str, default: f64| match var(name) {
            None => Ok(default),
            Some(v) => v
                .trim()
                .parse::<f64>()
                .map_err(|_| Error::invalid(format!("{name} must be a number, got {v:?}"))),
        };
        let thresholds = BetaMonitor {
            low_entropy_bits: number(LOW, defaults.low_entropy_bits)?,
            high_entropy_bits: number(HIGH, defaults.high_entropy_bits)?,
            agreement_floor: number(FLOOR, defaults.agreement_floor)?,
        };
        thresholds.check(&Names {
            low: LOW,
            high: HIGH,
            floor: FLOOR,
        })?;
        let file = match var(FILE) {
            None => None,
            Some(path) if path.is_empty() => {
                return Err(Error::invalid(format!(
                    "{FILE} is empty (unset it, or name the JSON file to write)"
                )))
            }
            Some(path) => Some(PathBuf::from(path)),
        };
        Ok(BetaMonEnv {
            enabled: switch(MONITOR, var(MONITOR))?,
            verbose: switch(VERBOSE, var(VERBOSE))?,
            thresholds,
            file,
        })
    }
}

/// An on/off variable: unset, empty, 0, off or false is off; 1, on or true is on.
fn switch(name: &str, value: Option<String>) -> Result<bool> {
    match value.as_deref().map(str::trim) {
        None | Some("" | "0" | "off" | "false") => Ok(false),
        Some("1" | "on" | "true") => Ok(true),
        Some(other) => Err(Error::invalid(format!(
            "{name} must be 1 or 0 (on/off, true/false), got {other:?}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(vars: &[(&str, &str)]) -> Result<BetaMonEnv> {
        BetaMonEnv::from_vars(|name| {
            vars.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.to_string())
        })
    }

    #[test]
    fn unset_is_off_with_the_defaults() {
        assert_eq!(read(&[]).unwrap(), BetaMonEnv::default());
    }

    #[test]
    fn every_variable_is_read() {
        let env = read(&[
            (MONITOR, "1"),
            (VERBOSE, "on"),
            (FLOOR, "0.9"),
            (LOW, "0.25"),
            (HIGH, "7"),
            (FILE, "/tmp/beta.json"),
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
        assert!(!read(&[(MONITOR, "0")]).unwrap().enabled);
    }

    #[test]
    fn bad_values_name_the_variable() {
        let err = |vars: &[(&str, &str)]| read(vars).unwrap_err().to_string();
        let e = err(&[(MONITOR, "yes")]);
        assert!(e.contains("TINYLOOP_BETA_MONITOR must be 1 or 0"), "{e}");
        assert!(err(&[(VERBOSE, "2")]).contains(VERBOSE));
        let e = err(&[(LOW, "-1")]);
        assert!(
            e.contains("TINYLOOP_BETA_MON_LOW_ENTROPY_BITS must be a finite"),
            "{e}"
        );
        assert!(
            err(&[(HIGH, "lots")]).contains("TINYLOOP_BETA_MON_HIGH_ENTROPY_BITS must be a number")
        );
        let e = err(&[(LOW, "3"), (HIGH, "2")]);
        assert!(
            e.contains(LOW) && e.contains(HIGH) && e.contains("must not exceed"),
            "{e}"
        );
        let e = err(&[(FLOOR, "1.5")]);
        assert!(
            e.contains("TINYLOOP_BETA_MON_AGREEMENT_FLOOR must be in [0, 1]"),
            "{e}"
        );
        assert!(err(&[(FILE, "")]).contains("TINYLOOP_BETA_MON_FILE is empty"));
    }
}
