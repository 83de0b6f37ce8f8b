//! Errors of kiln-core: each names what is wrong and, where there is one, the fix.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot read {path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },

    #[error("cannot write {path}: {error} (name a folder you can write to, on a disk with room)")]
    WriteFile {
        path: PathBuf,
        error: std::io::Error,
    },

    #[error(
        "{path} is {kind}; kiln reads model files only from regular files (or symlinks to them)"
    )]
    NotAFile { path: PathBuf, kind: &'static str },

    #[error(
        "{path} holds {size} bytes, more than the {limit} kiln accepts for {what}; \
         is it the right file?"
    )]
    TooLarge {
        path: PathBuf,
        size: u64,
        limit: u64,
        what: &'static str,
    },

    #[error("cannot write to {what}: {error}")]
    Write {
        what: &'static str,
        error: std::io::Error,
    },

    #[error("{path} is not a valid Llama config.json: {message}")]
    Config { path: PathBuf, message: String },

    #[error("the weights in {path} do not fit the model: {message}")]
    Weights { path: PathBuf, message: String },

    #[error("{path} is not a usable GGUF model: {message}")]
    Gguf { path: PathBuf, message: String },

    #[error("{path} is not a usable tokenizer: {message}")]
    Tokenizer { path: PathBuf, message: String },

    #[error("cannot encode the prompt: {0}")]
    Encode(String),

    #[error("cannot decode the generated tokens: {0}")]
    Decode(String),

    #[error("the chat template from {origin}: {message}")]
    ChatTemplate { origin: String, message: String },

    /// The template refused this conversation (`raise_exception`: roles
    /// that do not alternate, a system turn where none is allowed).
    #[error("the chat template from {origin} rejected the conversation: {message}")]
    ConversationRejected { origin: String, message: String },

    #[error(
        "the prompt and generation need {needed} positions but the model's context holds {limit}; \
         shorten the prompt or lower --max-tokens"
    )]
    ContextFull { needed: usize, limit: usize },

    #[error("{0}")]
    Invalid(String),

    /// The caller asked a long computation to stop (its client left, its
    /// deadline passed, the server is stopping); nothing of it is kept.
    #[error("stopped before the end, as asked")]
    Interrupted,

    #[error(
        "the {backend} backend cannot {what}; use --backend cpu (or a backend that can) for it"
    )]
    Unsupported { backend: String, what: &'static str },

    /// A failure inside a backend (IREE and others), with its own message.
    #[error("{0}")]
    Backend(String),
}

pub type Result<T> = std::result::Result<T, Error>;
