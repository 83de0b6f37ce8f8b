//! kiln-iree: a small safe binding of the IREE runtime, built from the pinned
//! source into a prefix (`cargo xtask iree`, or the flake's packages).
//!
//! ```no_run
//! use kiln_iree::{Instance, Tensor};
//! let instance = Instance::new()?;
//! let device = instance.device("local-task")?;
//! let module = device.load_module_file("add.vmfb".as_ref())?;
//! let a = Tensor::f32(&[4], vec![1.0, 2.0, 3.0, 4.0])?;
//! let out = module.call("add", &[a.clone(), a])?;
//! assert_eq!(out[0].as_f32()?, &[2.0, 4.0, 6.0, 8.0]);
//! # Ok::<(), kiln_iree::Error>(())
//! ```
//!
//! `unsafe` lives only in the calls into the shim (`csrc/`): [`runtime`]'s,
//! `flags`' and `error`'s reading of the shim's errors.

mod error;
mod ffi;
mod flags;
mod runtime;
mod tensor;

pub use error::{Error, Result, StatusCode};
pub use flags::{flags_in_effect, set_flags};
pub use runtime::{Device, DeviceTensor, Fence, Instance, Module, PendingRead, Reader, World};
pub use tensor::{ElementType, Tensor, TensorData};

/// The IREE revision of the runtime this crate was linked against (from the
/// prefix's link description). Modules must come from a compiler of the same
/// revision.
pub const RUNTIME_REVISION: &str = env!("KILN_IREE_RUNTIME_REVISION");

/// The HAL drivers of the prefix this crate was linked against.
pub const PREFIX_HAL_DRIVERS: &str = env!("KILN_IREE_HAL_DRIVERS");

/// The Rust target triple the prefix was built for (the build script checks
/// that it is this build's target).
pub const PREFIX_TARGET: &str = env!("KILN_IREE_PREFIX_TARGET");
