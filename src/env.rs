//! The environment variables, read one way by every feature (docs/ABI.md "Environment
//! variables"). A variable that is unset or empty takes its default. Otherwise its value must be
//! valid UTF-8 and, by kind:
//!
//! * a switch: exactly `1`, `on` or `true` (on), or `0`, `off` or `false` (off);
//! * a number: decimal digits, parsed as a u64 and checked against the variable's range before
//!   it is narrowed to the type that holds it;
//! * a real number: anything Rust's `f64` parser reads, and finite;
//! * one of a list of words, exactly as listed;
//! * a path: taken as the operating system gives it (any bytes; no UTF-8 needed).
//!
//! Anything else is an [`Error::InvalidArgument`](crate::Error::InvalidArgument) naming the
//! variable, its value and what is accepted, so a bad value fails the call that reads it
//! (usually opening a model) instead of being ignored. Readers take a variable source rather
//! than the process environment, so tests supply values without touching the process.
//!
//! The words for accepted values ([`decimal`], [`integers`], [`either`]) are public: the CLI
//! states the ranges of its options the same way.

use std::ffi::OsString;
use std::ops::RangeInclusive;
use std::path::PathBuf;

use crate::error::{Error, Result};

/// The process environment as a variable source.
pub(crate) fn process(name: &str) -> Option<OsString> {
    std::env::var_os(name)
}

/// The variables of one source.
#[derive(Clone, Copy)]
pub(crate) struct Vars<'a> {
    source: &'a dyn Fn(&str) -> Option<OsString>,
}

impl Vars<'static> {
    /// The variables of the process environment.
    pub fn process() -> Vars<'static> {
        Vars { source: &process }
    }
}

impl<'a> Vars<'a> {
    pub fn new(source: &'a dyn Fn(&str) -> Option<OsString>) -> Vars<'a> {
        Vars { source }
    }

    /// The value of `name`; `None` when it is unset or empty.
    fn raw(&self, name: &str) -> Option<OsString> {
        (self.source)(name).filter(|value| !value.is_empty())
    }

    /// The value of `name` as text; `None` when it is unset or empty.
    pub fn text(&self, name: &str) -> Result<Option<String>> {
        self.raw(name)
            .map(|value| {
                value
                    .into_string()
                    .map_err(|value| Error::invalid(format!("{name}={value:?} is not valid UTF-8")))
            })
            .transpose()
    }

    /// A switch: `1`, `on` or `true` is on, `0`, `off` or `false` is off, unset or empty is
    /// `default`.
    pub fn switch(&self, name: &str, default: bool) -> Result<bool> {
        match self.text(name)?.as_deref() {
            None => Ok(default),
            Some("1" | "on" | "true") => Ok(true),
            Some("0" | "off" | "false") => Ok(false),
            Some(other) => Err(rejected(
                name,
                other,
                &format!(
                    "1, on or true, or 0, off or false (unset or empty: {})",
                    u8::from(default)
                ),
            )),
        }
    }

    /// A whole number in `range`, as a `T` (every value of `range` must fit in `T`); unset or
    /// empty is `default`.
    pub fn number<T: TryFrom<u64>>(
        &self,
        name: &str,
        default: T,
        range: RangeInclusive<u64>,
    ) -> Result<T> {
        let Some(text) = self.text(name)? else {
            return Ok(default);
        };
        decimal(&text)
            .filter(|n| range.contains(n))
            .and_then(|n| T::try_from(n).ok())
            .ok_or_else(|| rejected(name, &text, &integers(&range)))
    }

    /// A finite real number; unset or empty is `default`. Its range is the caller's to check.
    pub fn real(&self, name: &str, default: f64) -> Result<f64> {
        let Some(text) = self.text(name)? else {
            return Ok(default);
        };
        text.parse::<f64>()
            .ok()
            .filter(|v| v.is_finite())
            .ok_or_else(|| rejected(name, &text, "a finite number"))
    }

    /// One of `words`, exactly; unset or empty is `None`.
    pub fn word(&self, name: &str, words: &[&'static str]) -> Result<Option<&'static str>> {
        let Some(text) = self.text(name)? else {
            return Ok(None);
        };
        match words.iter().find(|w| **w == text) {
            Some(word) => Ok(Some(word)),
            None => Err(rejected(name, &text, &either(words))),
        }
    }

    /// A path, as the operating system gives it; unset or empty is `None`.
    pub fn path(&self, name: &str) -> Option<PathBuf> {
        self.raw(name).map(PathBuf::from)
    }
}

/// The error for a value of `name` that is not one of what it accepts.
pub(crate) fn rejected(name: &str, value: &str, accepted: &str) -> Error {
    Error::invalid(format!(
        "{name}={value:?} is not accepted: expected {accepted}"
    ))
}

/// Decimal digits (no sign, no spaces) as a u64; `None` for anything else, or a number past
/// u64::MAX.
pub fn decimal(text: &str) -> Option<u64> {
    let digits = !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit());
    digits.then(|| text.parse().ok()).flatten()
}

/// The integers of `range` in words: `2`, `an integer ≥ 1`, `an integer from 1 to 64`.
pub fn integers(range: &RangeInclusive<u64>) -> String {
    match (*range.start(), *range.end()) {
        (lo, hi) if lo == hi => lo.to_string(),
        (lo, u64::MAX) => format!("an integer ≥ {lo}"),
        (lo, hi) => format!("an integer from {lo} to {hi}"),
    }
}

/// A choice among `items` in words: `a`, `a or b`, `a, b or c`.
pub fn either(items: &[impl ToString]) -> String {
    let items: Vec<String> = items.iter().map(ToString::to_string).collect();
    match items.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
        _ => items.concat(),
    }
}

/// A variable source over a table, for tests: values are bytes, so non-UTF-8 ones can be given.
#[cfg(test)]
pub(crate) fn table(pairs: &[(&str, &[u8])]) -> impl Fn(&str) -> Option<OsString> {
    use std::os::unix::ffi::OsStringExt;
    let pairs: Vec<(String, Vec<u8>)> = pairs
        .iter()
        .map(|(name, value)| (name.to_string(), value.to_vec()))
        .collect();
    move |name| {
        pairs
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| OsString::from_vec(v.clone()))
    }
}

/// Bytes that are not UTF-8, for tests of how a variable rejects them.
#[cfg(test)]
pub(crate) const NOT_UTF8: &[u8] = b"1\xff";

#[cfg(test)]
mod tests {
    use super::*;

    fn read<T>(pairs: &[(&str, &[u8])], f: impl FnOnce(Vars) -> Result<T>) -> Result<T> {
        let source = table(pairs);
        f(Vars::new(&source))
    }

    fn message<T: std::fmt::Debug>(result: Result<T>) -> String {
        result.unwrap_err().to_string()
    }

    #[test]
    fn accepted_values_in_words() {
        assert_eq!(integers(&(2..=2)), "2");
        assert_eq!(integers(&(1..=64)), "an integer from 1 to 64");
        assert_eq!(integers(&(1..=u64::MAX)), "an integer ≥ 1");
        assert_eq!(either(&["a"]), "a");
        assert_eq!(either(&["a", "b"]), "a or b");
        assert_eq!(either(&[16, 4, 2]), "16, 4 or 2");
        assert_eq!(decimal("0"), Some(0));
        assert_eq!(decimal("18446744073709551615"), Some(u64::MAX));
        for not in [
            "",
            "18446744073709551616",
            "+1",
            "-0",
            " 1",
            "1_000",
            "0x10",
        ] {
            assert_eq!(decimal(not), None, "{not:?}");
        }
    }

    #[test]
    fn unset_and_empty_take_the_default() {
        for pairs in [&[][..], &[("V", &b""[..])][..]] {
            assert!(read(pairs, |v| v.switch("V", true)).unwrap());
            assert!(!read(pairs, |v| v.switch("V", false)).unwrap());
            assert_eq!(read(pairs, |v| v.number("V", 7u32, 1..=9)).unwrap(), 7);
            assert_eq!(read(pairs, |v| v.real("V", 0.5)).unwrap(), 0.5);
            assert_eq!(read(pairs, |v| v.word("V", &["a"])).unwrap(), None);
            assert_eq!(read(pairs, |v| Ok(v.path("V"))).unwrap(), None);
            assert_eq!(read(pairs, |v| v.text("V")).unwrap(), None);
        }
    }

    #[test]
    fn switches_take_exactly_the_documented_words() {
        for on in ["1", "on", "true"] {
            assert!(read(&[("V", on.as_bytes())], |v| v.switch("V", false)).unwrap());
        }
        for off in ["0", "off", "false"] {
            assert!(!read(&[("V", off.as_bytes())], |v| v.switch("V", true)).unwrap());
        }
        for bad in ["2", "-1", "10", "yes", "no", "ON", "True", " 1", "1 ", "01"] {
            let e = message(read(&[("V", bad.as_bytes())], |v| v.switch("V", false)));
            assert_eq!(
                e,
                format!(
                    "invalid argument: V={bad:?} is not accepted: expected 1, on or true, or 0, \
                     off or false (unset or empty: 0)"
                )
            );
        }
    }

    #[test]
    fn numbers_are_range_checked_before_narrowing() {
        let u32_var = |value: &str| {
            read(&[("V", value.as_bytes())], |v| {
                v.number::<u32>("V", 2, 2..=2)
            })
        };
        assert_eq!(u32_var("2").unwrap(), 2);
        // 2^32 + 2 would be 2 after a truncating cast; it is out of the range instead.
        for bad in ["4294967298", "4294967300", "18446744073709551617", "3", "0"] {
            let e = message(u32_var(bad));
            assert!(
                e.contains(&format!("V={bad:?} is not accepted: expected 2")),
                "{e}"
            );
        }
        let narrow = |value: &str| {
            read(&[("V", value.as_bytes())], |v| {
                v.number::<u8>("V", 1, 1..=64)
            })
        };
        assert_eq!(narrow("64").unwrap(), 64);
        let e = message(narrow("65"));
        assert!(
            e.contains("V=\"65\" is not accepted: expected an integer from 1 to 64"),
            "{e}"
        );
        let wide = |value: &str| {
            read(&[("V", value.as_bytes())], |v| {
                v.number::<usize>("V", 1, 1..=u64::MAX)
            })
        };
        assert_eq!(wide("18446744073709551615").unwrap(), usize::MAX);
        for bad in ["0", "-1", "+5", "1.0", "1e3", " 5", "x"] {
            let e = message(wide(bad));
            assert!(
                e.contains(&format!(
                    "V={bad:?} is not accepted: expected an integer ≥ 1"
                )),
                "{e}"
            );
        }
    }

    #[test]
    fn reals_are_finite() {
        let real = |value: &str| read(&[("V", value.as_bytes())], |v| v.real("V", 0.0));
        assert_eq!(real("0.25").unwrap(), 0.25);
        assert_eq!(real("-3").unwrap(), -3.0);
        for bad in ["nan", "inf", "-inf", "1e999", "half", "0,5"] {
            assert!(
                message(real(bad)).contains("expected a finite number"),
                "{bad}"
            );
        }
    }

    #[test]
    fn words_are_exact() {
        let word = |value: &str| {
            read(&[("V", value.as_bytes())], |v| {
                v.word("V", &["a", "b", "c"])
            })
        };
        assert_eq!(word("b").unwrap(), Some("b"));
        let e = message(word("B"));
        assert!(
            e.contains("V=\"B\" is not accepted: expected a, b or c"),
            "{e}"
        );
    }

    #[test]
    fn non_utf8_is_an_error_naming_the_variable_except_for_paths() {
        let pairs = [("V", NOT_UTF8)];
        let e = message(read(&pairs, |v| v.switch("V", false)));
        assert_eq!(e, "invalid argument: V=\"1\\xFF\" is not valid UTF-8");
        assert!(read(&pairs, |v| v.number::<u64>("V", 0, 0..=9)).is_err());
        assert!(read(&pairs, |v| v.real("V", 0.0)).is_err());
        assert!(read(&pairs, |v| v.word("V", &["1"])).is_err());
        use std::os::unix::ffi::OsStrExt;
        let path = read(&pairs, |v| Ok(v.path("V"))).unwrap().unwrap();
        assert_eq!(path.as_os_str().as_bytes(), NOT_UTF8);
    }
}
