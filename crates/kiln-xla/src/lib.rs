//! kiln-xla: kiln's OpenXLA path. StableHLO modules are compiled ahead of time
//! by the pinned `iree-compile` and run through [`kiln_iree`].

mod compiler;
mod error;

pub use compiler::{Compiler, Target};
pub use error::{Error, Result};
