//! kiln-xla: kiln's OpenXLA path. StableHLO modules are compiled ahead of time
//! by the pinned `iree-compile` and run through [`kiln_iree`].

mod backend;
mod batched;
mod cache_dir;
mod compiler;
mod error;
mod graph;
mod host_cpu;
mod kernels;
pub mod llama;
mod module_cache;
mod pack;
mod plan;
pub mod prepared;
pub mod q4;
pub mod q8;
mod stablehlo;

pub use backend::{IreeBackend, MAX_STEPS_PER_CALL, check_steps_per_call};
pub use batched::{Admission, BatchedDecoder, Choice, MAX_SLOTS, SlotOutput};
pub use compiler::{Compiler, Target};
pub use error::{Error, Result};
pub use graph::{DecodeAttention, GraphOptions, Precision, Q4Rows, WeightLayout, padded_row};
pub use module_cache::{ModuleCache, Origin};
pub use plan::{
    APPEND_ROWS, Buckets, ModuleKind, PROMPT_MAX, batch_sizes, prompt_buckets, prompt_rows,
};
