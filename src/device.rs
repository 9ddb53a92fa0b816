//! Device selection: `auto | cpu | cuda | cuda:N`, defaulting to `TINYLOOP_DEVICE`.

use std::fmt;
use std::str::FromStr;

use crate::backend::cuda::CudaBackend;
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

impl Device {
    /// `requested`, or else the device named by `TINYLOOP_DEVICE`, or else `Auto`.
    pub fn resolve(requested: Option<Device>) -> Result<Device> {
        if let Some(device) = requested {
            return Ok(device);
        }
        match std::env::var("TINYLOOP_DEVICE") {
            Ok(v) if !v.trim().is_empty() => v
                .parse()
                .map_err(|e| Error::invalid(format!("TINYLOOP_DEVICE: {e}"))),
            _ => Ok(Device::Auto),
        }
    }
}

impl FromStr for Device {
    type Err = Error;

    fn from_str(s: &str) -> Result<Device> {
        let s = s.trim().to_ascii_lowercase();
        match s.as_str() {
            "auto" => Ok(Device::Auto),
            "cpu" => Ok(Device::Cpu),
            "cuda" | "gpu" => Ok(Device::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
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
/// [`Error::Device`] that says why; `auto` falls back to the CPU and the note says why.
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
