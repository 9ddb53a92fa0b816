//! The CUDA tuning variables (README "Environment variables"), read when a model opens on CUDA
//! and kept by its backends, so that no launch or upload consults the environment.

use crate::env::Vars;
use crate::error::Result;

pub(crate) const GRAPHS: &str = "TINYLOOP_CUDA_GRAPHS";
pub(crate) const PDL: &str = "TINYLOOP_CUDA_PDL";
pub(crate) const UPLOAD: &str = "TINYLOOP_CUDA_UPLOAD";
pub(crate) const GEMV_TPR: &str = "TINYLOOP_CUDA_GEMV_TPR";

/// The widths [`GEMV_TPR`] accepts: powers of two up to a warp.
const GEMV_TPR_VALUES: [&str; 6] = ["1", "2", "4", "8", "16", "32"];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Tuning {
    /// Capture decode steps as CUDA graphs ([`GRAPHS`], default 1).
    pub graphs: bool,
    /// Programmatic dependent launch, on sm_90 and newer ([`PDL`], default 1).
    pub pdl: bool,
    /// Upload weights with one synchronous pageable copy each instead of through the pinned
    /// staging buffers ([`UPLOAD`]`=plain`; default `staged`).
    pub plain_upload: bool,
    /// Threads per GEMV row to start from ([`GEMV_TPR`], default 16; linear.rs `choose_tpr`).
    pub gemv_tpr: usize,
}

impl Tuning {
    pub fn from_vars(vars: Vars) -> Result<Tuning> {
        let gemv_tpr = match vars.word(GEMV_TPR, &GEMV_TPR_VALUES)? {
            Some(width) => width.parse().expect("GEMV_TPR_VALUES are numbers"),
            None => 16,
        };
        Ok(Tuning {
            graphs: vars.switch(GRAPHS, true)?,
            pdl: vars.switch(PDL, true)?,
            plain_upload: vars.word(UPLOAD, &["plain", "staged"])? == Some("plain"),
            gemv_tpr,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::env::{self, NOT_UTF8};

    fn read(pairs: &[(&str, &[u8])]) -> Result<Tuning> {
        let source = env::table(pairs);
        Tuning::from_vars(Vars::new(&source))
    }

    fn error(pairs: &[(&str, &[u8])]) -> String {
        read(pairs).unwrap_err().to_string()
    }

    const DEFAULT: Tuning = Tuning {
        graphs: true,
        pdl: true,
        plain_upload: false,
        gemv_tpr: 16,
    };

    #[test]
    fn unset_or_empty_is_the_default() {
        assert_eq!(read(&[]).unwrap(), DEFAULT);
        let empty = [GRAPHS, PDL, UPLOAD, GEMV_TPR].map(|name| (name, &b""[..]));
        assert_eq!(read(&empty).unwrap(), DEFAULT);
    }

    #[test]
    fn every_variable_is_read() {
        let off = read(&[
            (GRAPHS, b"0"),
            (PDL, b"0"),
            (UPLOAD, b"plain"),
            (GEMV_TPR, b"4"),
        ]);
        let expected = Tuning {
            graphs: false,
            pdl: false,
            plain_upload: true,
            gemv_tpr: 4,
        };
        assert_eq!(off.unwrap(), expected);
        let on = read(&[(GRAPHS, b"1"), (PDL, b"1"), (UPLOAD, b"staged")]);
        assert_eq!(on.unwrap(), DEFAULT);
        for width in GEMV_TPR_VALUES {
            let got = read(&[(GEMV_TPR, width.as_bytes())]).unwrap();
            assert_eq!(got.gemv_tpr.to_string(), width);
        }
    }

    #[test]
    fn bad_values_name_the_variable_and_value() {
        for var in [GRAPHS, PDL] {
            for bad in ["yes", "no", "2", "-1"] {
                let e = error(&[(var, bad.as_bytes())]);
                let expected = format!("{var}={bad:?} is not accepted: expected 1, on or true, or 0, off or false (unset or empty: 1)");
                assert!(e.contains(&expected), "{e}");
            }
        }
        let e = error(&[(UPLOAD, b"pinned")]);
        assert!(
            e.contains("TINYLOOP_CUDA_UPLOAD=\"pinned\" is not accepted: expected plain or staged"),
            "{e}"
        );
        for bad in ["0", "3", "64", "016", "4294967312"] {
            let e = error(&[(GEMV_TPR, bad.as_bytes())]);
            let expected =
                format!("{GEMV_TPR}={bad:?} is not accepted: expected 1, 2, 4, 8, 16 or 32");
            assert!(e.contains(&expected), "{e}");
        }
        for var in [GRAPHS, PDL, UPLOAD, GEMV_TPR] {
            let e = error(&[(var, NOT_UTF8)]);
            assert!(
                e.contains(&format!("{var}=\"1\\xFF\" is not valid UTF-8")),
                "{e}"
            );
        }
    }
}
