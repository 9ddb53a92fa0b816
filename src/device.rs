//! Device selection: `auto | cpu | cuda | cuda:N`, defaulting to `TINYLOOP_DEVICE`.

use std::fmt;
use std::str::FromStr;

use crate::backend::cuda::CudaBackend;
use crate::env::{decimal, rejected, Vars};
use crate::error::{Error, Result};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Device {
    /// CUDA when a driver and GPU are usable, otherwise CPU.
    #[default]
    Auto,
    Cpu,
    /// The CUDA device with this ordinal.
    Cuda(usize),
}

/// The device of calls that name none.
pub const ENV: &str = "TINYLOOP_DEVICE";

impl Device {
    /// `requested`, or else the device named by [`ENV`] (read from `vars`), or else `Auto`.
    pub(crate) fn resolve(requested: Option<Device>, vars: Vars) -> Result<Device> {
        if let Some(device) = requested {
            return Ok(device);
        }
        match vars.text(ENV)? {
            None => Ok(Device::Auto),
            Some(name) => name
                .parse()
                .map_err(|_| rejected(ENV, &name, "auto, cpu, cuda or cuda:N")),
        }
    }
}

impl FromStr for Device {
    type Err = Error;

    /// Exactly `auto`, `cpu`, `cuda` or `cuda:N` (N in decimal digits).
    fn from_str(s: &str) -> Result<Device> {
        let ordinal = |n: &str| decimal(n).and_then(|n| usize::try_from(n).ok());
        match s {
            "auto" => Ok(Device::Auto),
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(ordinal)
                .map(Device::Cuda)
                .ok_or_else(|| {
                    Error::invalid(format!(
                        "unknown device {s:?} (expected auto, cpu, cuda or cuda:N)"
                    ))
                }),
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Auto => write!(f, "auto"),
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// The backend a model will load onto.
pub(crate) enum Selected {
    /// The CPU; `note` says why when `auto` fell back to it.
    Cpu {
        note: Option<String>,
    },
    Cuda(Box<CudaBackend>),
}

/// Resolve a requested device to a usable backend. `cuda` / `cuda:N` without a usable GPU is an
/// [`Error::Device`] that says why; `auto` falls back to the CPU and the note says why, except
/// for a bad CUDA variable, which fails as it would with `cuda`.
pub(crate) fn select(requested: Device) -> Result<Selected> {
    match requested {
        Device::Cpu => Ok(Selected::Cpu { note: None }),
        Device::Cuda(n) => CudaBackend::open(n)
            .map(|b| Selected::Cuda(Box::new(b)))
            .map_err(|e| match e {
                Error::Device(why) => Error::Device(format!("cuda:{n} is not usable: {why}")),
                other => other,
            }),
        Device::Auto => match CudaBackend::open(0) {
            Ok(b) => Ok(Selected::Cuda(Box::new(b))),
            Err(e @ Error::InvalidArgument(_)) => Err(e),
            Err(e) => {
                let why = match e {
                    Error::Device(why) => why,
                    other => other.to_string(),
                };
                Ok(Selected::Cpu {
                    note: Some(format!(
                        "device auto: using the CPU: CUDA is unavailable ({why})"
                    )),
                })
            }
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::env::{self, NOT_UTF8};

    fn resolve(requested: Option<Device>, pairs: &[(&str, &[u8])]) -> Result<Device> {
        let source = env::table(pairs);
        Device::resolve(requested, Vars::new(&source))
    }

    #[test]
    fn names_parse_exactly() {
        for (name, device) in [
            ("auto", Device::Auto),
            ("cpu", Device::Cpu),
            ("cuda", Device::Cuda(0)),
            ("cuda:0", Device::Cuda(0)),
            ("cuda:3", Device::Cuda(3)),
        ] {
            assert_eq!(name.parse::<Device>().unwrap(), device);
            assert_eq!(device.to_string().parse::<Device>().unwrap(), device);
        }
        for bad in [
            "",
            "CPU",
            " cpu",
            "gpu",
            "cuda:",
            "cuda:-1",
            "cuda:+1",
            "cuda:x",
            "cuda:18446744073709551616",
        ] {
            let e = bad.parse::<Device>().unwrap_err().to_string();
            assert!(
                e.contains("expected auto, cpu, cuda or cuda:N"),
                "{bad:?}: {e}"
            );
        }
    }

    #[test]
    fn the_variable_is_the_default_of_calls_that_name_none() {
        assert_eq!(resolve(None, &[]).unwrap(), Device::Auto);
        assert_eq!(resolve(None, &[(ENV, b"")]).unwrap(), Device::Auto);
        assert_eq!(resolve(None, &[(ENV, b"cpu")]).unwrap(), Device::Cpu);
        assert_eq!(resolve(None, &[(ENV, b"cuda:1")]).unwrap(), Device::Cuda(1));
        // A call's own device wins; the variable is then not read.
        assert_eq!(
            resolve(Some(Device::Cpu), &[(ENV, b"bogus")]).unwrap(),
            Device::Cpu
        );
        let e = resolve(None, &[(ENV, b"gpu0")]).unwrap_err().to_string();
        assert!(
            e.contains(
                "TINYLOOP_DEVICE=\"gpu0\" is not accepted: expected auto, cpu, cuda or cuda:N"
            ),
            "{e}"
        );
        let e = resolve(None, &[(ENV, NOT_UTF8)]).unwrap_err().to_string();
        assert!(
            e.contains("TINYLOOP_DEVICE=\"1\\xFF\" is not valid UTF-8"),
            "{e}"
        );
    }
}
