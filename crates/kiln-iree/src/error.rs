//! Errors of the IREE binding, and the reading of the shim's errors into
//! them. IREE's own message is always kept.

use std::path::PathBuf;
use std::ptr::NonNull;

use crate::ffi;

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

/// Takes ownership of a shim error; `Ok` for NULL.
pub(crate) fn check(
    raw: *mut ffi::kiln_iree_error,
) -> std::result::Result<(), (StatusCode, String)> {
    let Some(raw) = NonNull::new(raw) else {
        return Ok(());
    };
    // SAFETY: a non-NULL error from the shim is valid until freed, and its
    // message is a NUL-terminated string owned by it; we copy both, then free
    // it exactly once.
    unsafe {
        let code = ffi::kiln_iree_error_code(raw.as_ptr());
        let message = std::ffi::CStr::from_ptr(ffi::kiln_iree_error_message(raw.as_ptr()))
            .to_string_lossy()
            .into_owned();
        ffi::kiln_iree_error_free(raw.as_ptr());
        Err((code, message))
    }
}

/// IREE's own error, its code and message kept.
pub(crate) fn iree_error((code, message): (StatusCode, String)) -> Error {
    Error::Iree { code, message }
}

/// [`check`], as this crate's error.
pub(crate) fn check_raw(raw: *mut ffi::kiln_iree_error) -> Result<()> {
    check(raw).map_err(iree_error)
}
