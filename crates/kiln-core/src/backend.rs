//! The `Backend` trait every engine implements, and the CPU reference backend.

use crate::error::{Error, Result};
use crate::forward::{self, KvCache};
use crate::model::Model;

/// A way to run a model: prefill a prompt, then decode one token at a time.
/// Both return the logits of the last position (`vocab_size` values).
pub trait Backend {
    /// A short name for reports (`cpu`, `iree-cpu`, `iree-cuda`).
    fn name(&self) -> &str;

    /// The most positions (prompt plus generated tokens) one sequence can hold.
    fn max_context(&self) -> usize;

    /// Starts a new sequence from token ids.
    fn prefill(&mut self, tokens: &[u32]) -> Result<Vec<f32>>;

    /// Starts a new sequence from precomputed embedding rows (`n * hidden`),
    /// e.g. from a vision encoder: the "prepared prefill" input.
    fn prefill_embeddings(&mut self, embeddings: &[f32]) -> Result<Vec<f32>>;

    /// Appends one token to the sequence.
    fn decode(&mut self, token: u32) -> Result<Vec<f32>>;

    /// Appends one token and returns the greedy choice of the next one (the
    /// first largest logit). A device backend overrides this to pick the
    /// token where the logits are, so that only the token comes back.
    fn decode_greedy(&mut self, token: u32) -> Result<u32> {
        Ok(crate::sampling::argmax(&self.decode(token)?))
    }
}

/// The CPU reference, behind the same trait as every other backend.
pub struct CpuBackend<'m> {
    model: &'m Model,
    cache: KvCache,
}

impl<'m> CpuBackend<'m> {
    pub fn new(model: &'m Model) -> CpuBackend<'m> {
        CpuBackend {
            model,
            cache: KvCache::new(model.config.num_layers),
        }
    }

    fn run(&mut self, embeddings: &[f32]) -> Result<Vec<f32>> {
        let hidden = self.model.config.hidden_size;
        if embeddings.is_empty() || !embeddings.len().is_multiple_of(hidden) {
            return Err(Error::Invalid(format!(
                "embeddings must be a positive number of rows of {hidden} values, got {}",
                embeddings.len()
            )));
        }
        let needed = self.cache.len() + embeddings.len() / hidden;
        if needed > self.max_context() {
            return Err(Error::ContextFull {
                needed,
                limit: self.max_context(),
            });
        }
        let logits = forward::forward(
            &self.model.config,
            &self.model.weights,
            embeddings,
            &mut self.cache,
        )?;
        let vocab = self.model.config.vocab_size;
        let last = &logits[logits.len() - vocab..];
        // Finite weights can still overflow; greedy decoding would read NaN
        // logits as token 0. The IREE backends report the same.
        if last.iter().any(|l| l.is_nan()) {
            return Err(Error::Backend(
                "the logits are NaN (the weights or the activations overflowed)".into(),
            ));
        }
        Ok(last.to_vec())
    }

    /// Logits of every prompt position (`n * vocab`), for tests.
    pub fn prefill_all(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        check_tokens(self.model, tokens)?;
        self.cache = KvCache::new(self.model.config.num_layers);
        let embeddings = forward::embed(&self.model.weights, tokens);
        forward::forward(
            &self.model.config,
            &self.model.weights,
            &embeddings,
            &mut self.cache,
        )
    }
}

/// Rejects token ids outside the vocabulary.
pub fn check_tokens(model: &Model, tokens: &[u32]) -> Result<()> {
    if tokens.is_empty() {
        return Err(Error::Invalid("the prompt is empty".into()));
    }
    match tokens
        .iter()
        .find(|&&t| t as usize >= model.config.vocab_size)
    {
        Some(t) => Err(Error::Invalid(format!(
            "token id {t} is outside the vocabulary of {} tokens",
            model.config.vocab_size
        ))),
        None => Ok(()),
    }
}

impl Backend for CpuBackend<'_> {
    fn name(&self) -> &str {
        "cpu"
    }

    fn max_context(&self) -> usize {
        self.model.config.max_position_embeddings
    }

    fn prefill(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        check_tokens(self.model, tokens)?;
        self.prefill_embeddings(&forward::embed(&self.model.weights, tokens))
    }

    fn prefill_embeddings(&mut self, embeddings: &[f32]) -> Result<Vec<f32>> {
        self.cache = KvCache::new(self.model.config.num_layers);
        self.run(embeddings)
    }

    fn decode(&mut self, token: u32) -> Result<Vec<f32>> {
        if self.cache.is_empty() {
            return Err(Error::Invalid("decode before prefill".into()));
        }
        check_tokens(self.model, &[token])?;
        let row = forward::embed(&self.model.weights, &[token]);
        self.run(&row)
    }
}
