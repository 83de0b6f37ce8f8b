//! kiln-core: the Llama-family model (configuration, weights, tokenizer), the
//! CPU reference forward pass, sampling, the generation loop, and the
//! [`Backend`] trait that the CPU reference and the IREE backend implement.

pub mod backend;
pub mod config;
pub mod contained;
mod error;
pub mod files;
pub mod forward;
pub mod generate;
pub mod model;
pub mod sampling;
pub mod save;
pub mod tokenizer;
pub mod weights;

pub use backend::{Backend, CpuBackend};
pub use config::{ModelConfig, RopeScaling};
pub use error::{Error, Result};
pub use generate::generate;
pub use model::Model;
pub use sampling::{Sampler, SamplingParams};
pub use tokenizer::Tokenizer;
