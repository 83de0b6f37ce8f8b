//! Errors of the IREE binding. IREE's own message is always kept.

use std::path::PathBuf;

/// An IREE status code (`iree_status_code_t`), as reported with an error.
pub type StatusCode = u32;
/// `IREE_STATUS_NOT_FOUND`.
pub const STATUS_NOT_FOUND: StatusCode = 5;
/// `IREE_STATUS_UNAVAILABLE`.
pub const STATUS_UNAVAILABLE: StatusCode = 14;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A failure reported by the IREE runtime.
    #[error("IREE: {message}")]
    Iree { code: StatusCode, message: String },

    /// The device's driver is not compiled into this runtime.
    #[error(
        "device `{uri}` needs the IREE `{driver}` HAL driver, which this build of kiln does not have \
         (it has: {available}). {hint}"
    )]
    DriverMissing {
        uri: String,
        driver: String,
        available: String,
        hint: &'static str,
    },

    /// The driver is compiled in but cannot reach a device (no GPU, no
    /// `libcuda.so`, …).
    #[error("device `{uri}` is not available: {message}{hint}")]
    DeviceUnavailable {
        uri: String,
        message: String,
        hint: &'static str,
    },

    /// The module has no function of that name.
    #[error("the module has no function `{function}`: {message}")]
    FunctionNotFound { function: String, message: String },

    /// A tensor whose data does not match its shape, or a type kiln does not
    /// exchange.
    #[error("invalid tensor: {0}")]
    Tensor(String),

    /// A string argument with an interior NUL byte.
    #[error("{what} contains a NUL byte: {value:?}")]
    Nul { what: &'static str, value: String },

    /// An IREE runtime flag kiln will not pass to IREE.
    #[error("IREE flag `{flag}`: {why}")]
    Flag { flag: String, why: String },

    /// New flags while a device exists (devices read them when created).
    #[error(
        "IREE flags are process-wide and a device is open with `{current}`; `{requested}` \
         cannot apply until every device (backend) of this process is closed"
    )]
    FlagsInUse { current: String, requested: String },

    #[error("cannot read the module {path}: {error}")]
    ReadModule {
        path: PathBuf,
        error: std::io::Error,
    },
}

pub type Result<T> = std::result::Result<T, Error>;
