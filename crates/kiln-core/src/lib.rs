//! kiln-core: the Llama-family model (configuration, weights, tokenizer), the
//! CPU reference forward pass, sampling, the generation loop, and the
//! [`Backend`] trait that the CPU reference and the IREE backend implement.

pub mod backend;
pub mod chat;
pub mod chat_template;
pub mod config;
pub mod contained;
mod error;
pub mod files;
pub mod forward;
pub mod generate;
pub mod gguf;
pub mod model;
pub mod pinned;
pub mod ranks;
pub mod sampling;
pub mod save;
pub mod speculative;
pub mod stream;
pub mod tensor_parallel;
pub mod tokenizer;
pub mod weights;

#[cfg(any(test, feature = "testing"))]
pub mod testing;

pub use backend::{Backend, CpuBackend};
pub use chat::{Chat, Reply};
pub use chat_template::{ChatTemplate, Message};
pub use config::{ModelConfig, RopeScaling};
pub use error::{Error, Result};
pub use generate::generate;
pub use model::{ChatFormat, Model};
pub use sampling::{Sampler, SamplingParams};
pub use speculative::{
    ModelDraft, PromptLookup, Proposer, SpeculationStats, Speculator, generate_speculative,
};
pub use stream::TextStream;
pub use tokenizer::Tokenizer;
