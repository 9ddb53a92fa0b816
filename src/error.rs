//! The one error type of the crate. Each variant maps to exactly one C status code.

use std::path::PathBuf;

/// Every failure the library can report.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A caller-supplied value is out of range or malformed.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// A file could not be opened or read.
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A file could not be written.
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A `.tinyloop` file (or another model file) is malformed; the message names the failure point.
    #[error("invalid model file: {0}")]
    Format(String),

    /// A buffer of the named size could not be allocated.
    #[error("out of memory: could not allocate {bytes} bytes for {what}")]
    OutOfMemory { bytes: usize, what: String },

    /// The compute device failed or is unusable.
    #[error("device error: {0}")]
    Device(String),

    /// The model or session was closed; the message names the method that was called.
    #[error("{0} called on a closed model; construct a new one")]
    Closed(String),

    /// Another call is running on the same session.
    #[error("session is busy: another call is running on it")]
    Busy,

    /// The call was stopped by `cancel`.
    #[error("cancelled")]
    Cancelled,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn invalid(msg: impl Into<String>) -> Self {
        Error::InvalidArgument(msg.into())
    }

    pub(crate) fn format(msg: impl Into<String>) -> Self {
        Error::Format(msg.into())
    }

    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}
