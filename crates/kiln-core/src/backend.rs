//! The `Backend` trait every engine implements, and the CPU reference backend.

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::forward::{self, ForwardWeights, KvCache, Logits, Shard};
use crate::model::Model;
use crate::tensor_parallel::ShardPlan;

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

    /// [`prefill`](Backend::prefill), asking `keep_going` as it goes where
    /// prefill is slow enough to need it (the CPU reference: per row and
    /// layer), and stopping with [`Error::Interrupted`] when it says no. A
    /// backend that prefills in one device call does it whole.
    fn prefill_until(
        &mut self,
        tokens: &[u32],
        keep_going: &mut dyn FnMut() -> bool,
    ) -> Result<Vec<f32>> {
        let _ = keep_going;
        self.prefill(tokens)
    }

    /// Appends one token to the sequence.
    fn decode(&mut self, token: u32) -> Result<Vec<f32>>;

    /// Appends one token and returns the greedy choice of the next one (the
    /// first largest logit). A device backend overrides this to pick the
    /// token where the logits are, so that only the token comes back.
    fn decode_greedy(&mut self, token: u32) -> Result<u32> {
        Ok(crate::sampling::argmax(&self.decode(token)?))
    }

    /// Positions the current sequence holds (0 before the first prefill).
    fn sequence_len(&self) -> usize;

    /// Appends `tokens` in one step and returns the logits after each of
    /// them (`tokens.len() * vocab_size`): how speculative decoding checks
    /// several proposed tokens with one pass over the weights.
    fn append(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        let _ = tokens;
        Err(Error::Unsupported {
            backend: self.name().to_string(),
            what: "append several tokens in one step (speculative decoding)",
        })
    }

    /// Appends `tokens` in one step and returns the greedy choice after each
    /// of them (the first largest logit). A device backend overrides this to
    /// choose where the logits are.
    fn append_greedy(&mut self, tokens: &[u32]) -> Result<Vec<u32>> {
        let logits = self.append(tokens)?;
        if logits.is_empty() || !logits.len().is_multiple_of(tokens.len()) {
            return Err(Error::Backend(format!(
                "the backend returned {} logits for {} appended tokens",
                logits.len(),
                tokens.len()
            )));
        }
        let vocab = logits.len() / tokens.len();
        Ok(logits
            .chunks_exact(vocab)
            .map(crate::sampling::argmax)
            .collect())
    }

    /// Forgets every position from `len` on, so that the next token goes to
    /// position `len`: the rows of rejected speculated tokens.
    fn rewind(&mut self, len: usize) -> Result<()> {
        let _ = len;
        Err(Error::Unsupported {
            backend: self.name().to_string(),
            what: "rewind its sequence (speculative decoding)",
        })
    }
}

/// The error of a [`Backend::rewind`] to beyond the sequence's end.
pub fn rewind_past_end(len: usize, held: usize) -> Error {
    Error::Invalid(format!(
        "cannot rewind to position {len}: the sequence holds only {held}"
    ))
}

/// The CPU forward pass behind the same trait as every other backend: the
/// f32 reference ([`CpuBackend::new`]), the same pass over another
/// backend's matrices ([`CpuBackend::with_weights`]), or the reference split
/// in tensor-parallel ranks run one after another
/// ([`CpuBackend::tensor_parallel`]).
pub struct CpuBackend<'m> {
    model: &'m Model,
    ranks: Vec<Rank<'m>>,
    name: &'static str,
}

/// One rank's share of the model: the whole model where there is one.
struct Rank<'m> {
    config: ModelConfig,
    weights: Box<dyn ForwardWeights + 'm>,
    cache: KvCache,
}

impl<'m> CpuBackend<'m> {
    /// The f32 reference over the model's own weights.
    pub fn new(model: &'m Model) -> CpuBackend<'m> {
        // A model stored narrower (a GGUF's blocks, f16 safetensors) is
        // widened once here, not every product.
        let weights: Box<dyn ForwardWeights + 'm> = match model.weights.is_f32() {
            true => Box::new(&model.weights),
            false => Box::new(model.weights.widened()),
        };
        CpuBackend::with_weights(model, weights, "cpu")
    }

    /// The forward pass over `weights` (which must be `model`'s, in another
    /// form), reported as `name`. The embedding rows still come from the
    /// model's own weights.
    pub fn with_weights(
        model: &'m Model,
        weights: Box<dyn ForwardWeights + 'm>,
        name: &'static str,
    ) -> CpuBackend<'m> {
        CpuBackend {
            model,
            ranks: vec![Rank {
                config: model.config.clone(),
                weights,
                cache: KvCache::new(model.config.num_layers),
            }],
            name,
        }
    }

    /// The f32 reference in `plan`'s ranks, each holding its slice of the
    /// weights, the all-reduces summed in memory: the oracle of the sharded
    /// backends, and the check of the plan against [`CpuBackend::new`].
    pub fn tensor_parallel(model: &'m Model, plan: &ShardPlan) -> CpuBackend<'m> {
        let ranks = (0..plan.ranks())
            .map(|r| Rank {
                config: plan.rank_config(r),
                weights: Box::new(plan.rank_weights(&model.weights, r)) as Box<dyn ForwardWeights>,
                cache: KvCache::new(model.config.num_layers),
            })
            .collect();
        CpuBackend {
            model,
            ranks,
            name: "cpu",
        }
    }

    fn cache_len(&self) -> usize {
        self.ranks[0].cache.len()
    }

    /// Every rank's cache emptied.
    fn clear(&mut self) {
        for rank in &mut self.ranks {
            rank.cache = KvCache::new(self.model.config.num_layers);
        }
    }

    /// The logits of the last of `embeddings`' rows, run after the cache.
    fn run(&mut self, embeddings: &[f32]) -> Result<Vec<f32>> {
        self.run_until(embeddings, &mut || true)
    }

    /// [`run`](Self::run), asking `keep_going` as it goes.
    fn run_until(
        &mut self,
        embeddings: &[f32],
        keep_going: &mut dyn FnMut() -> bool,
    ) -> Result<Vec<f32>> {
        self.run_rows_until(embeddings, Logits::LastRow, keep_going)
    }

    /// The logits of every one of `embeddings`' rows, run after the cache.
    fn run_rows(&mut self, embeddings: &[f32]) -> Result<Vec<f32>> {
        self.run_rows_until(embeddings, Logits::EveryRow, &mut || true)
    }

    fn run_rows_until(
        &mut self,
        embeddings: &[f32],
        rows: Logits,
        keep_going: &mut dyn FnMut() -> bool,
    ) -> Result<Vec<f32>> {
        let hidden = self.model.config.hidden_size;
        if embeddings.is_empty() || !embeddings.len().is_multiple_of(hidden) {
            return Err(Error::Invalid(format!(
                "embeddings must be a positive number of rows of {hidden} values, got {}",
                embeddings.len()
            )));
        }
        let needed = self.cache_len() + embeddings.len() / hidden;
        if needed > self.max_context() {
            return Err(Error::ContextFull {
                needed,
                limit: self.max_context(),
            });
        }
        let mut shards: Vec<Shard> = self
            .ranks
            .iter_mut()
            .map(|r| Shard {
                config: &r.config,
                weights: r.weights.as_ref(),
                cache: &mut r.cache,
            })
            .collect();
        let logits = forward::forward_shards(&mut shards, embeddings, rows, keep_going)?;
        // Finite weights can still overflow; greedy decoding would read NaN
        // logits as token 0. The IREE backends report the same.
        if logits.iter().any(|l| l.is_nan()) {
            return Err(Error::Backend(
                "the logits are NaN (the weights or the activations overflowed)".into(),
            ));
        }
        Ok(logits)
    }

    /// Logits of every prompt position (`n * vocab`), for tests.
    pub fn prefill_all(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        check_tokens(self.model, tokens)?;
        self.clear();
        let embeddings = forward::embed(&self.model.weights, tokens);
        self.run_rows(&embeddings)
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
        self.name
    }

    fn max_context(&self) -> usize {
        self.model.config.context_limit()
    }

    fn prefill(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        check_tokens(self.model, tokens)?;
        self.prefill_embeddings(&forward::embed(&self.model.weights, tokens))
    }

    fn prefill_embeddings(&mut self, embeddings: &[f32]) -> Result<Vec<f32>> {
        self.clear();
        self.run(embeddings)
    }

    fn prefill_until(
        &mut self,
        tokens: &[u32],
        keep_going: &mut dyn FnMut() -> bool,
    ) -> Result<Vec<f32>> {
        check_tokens(self.model, tokens)?;
        self.clear();
        let embeddings = forward::embed(&self.model.weights, tokens);
        let result = self.run_until(&embeddings, keep_going);
        if result.is_err() {
            // A half-extended cache is no sequence.
            self.clear();
        }
        result
    }

    fn decode(&mut self, token: u32) -> Result<Vec<f32>> {
        if self.cache_len() == 0 {
            return Err(Error::Invalid("decode before prefill".into()));
        }
        check_tokens(self.model, &[token])?;
        let row = forward::embed(&self.model.weights, &[token]);
        self.run(&row)
    }

    fn sequence_len(&self) -> usize {
        self.cache_len()
    }

    fn append(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        if self.cache_len() == 0 {
            return Err(Error::Invalid("append before prefill".into()));
        }
        check_tokens(self.model, tokens)?;
        let rows = forward::embed(&self.model.weights, tokens);
        self.run_rows(&rows)
    }

    fn rewind(&mut self, len: usize) -> Result<()> {
        if len > self.cache_len() {
            return Err(rewind_past_end(len, self.cache_len()));
        }
        for rank in &mut self.ranks {
            rank.cache.truncate(len);
        }
        Ok(())
    }
}
