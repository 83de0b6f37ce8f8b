//! A model: its configuration, weights and tokenizer — from a Hugging Face
//! folder, or the embedded default model.

use std::path::Path;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::tokenizer::{ByteTokenizer, Tokenizer};
use crate::weights::{self, LayerWeights, Matrix, Weights};

pub struct Model {
    pub name: String,
    pub config: ModelConfig,
    pub weights: Weights,
    pub tokenizer: Tokenizer,
    pub chat: ChatFormat,
}

/// What chat needs besides the tokenizer: the template and the special ids.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ChatFormat {
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    /// End of turn (GGUF `tokenizer.ggml.eot_token_id`).
    pub eot: Option<u32>,
    /// End of message (GGUF `tokenizer.ggml.eom_token_id`).
    pub eom: Option<u32>,
    /// The chat template (GGUF `tokenizer.chat_template`), Jinja.
    pub template: Option<String>,
}

impl ChatFormat {
    /// The ids that end a generation: EOS, EOT and EOM, each once.
    pub fn stop_ids(&self) -> Vec<u32> {
        let mut ids = Vec::new();
        for id in [self.eos, self.eot, self.eom].into_iter().flatten() {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
        ids
    }
}

/// The seed the embedded model's weights are drawn from: the bytes "kiln".
pub const EMBEDDED_SEED: u64 = 0x6b69_6c6e;

impl Model {
    /// Loads a GGUF file, or `config.json`, `*.safetensors` and
    /// `tokenizer.json` from the folder `dir`.
    pub fn load(dir: &Path) -> Result<Model> {
        if dir.is_file() {
            return crate::gguf::load_model(dir);
        }
        if !dir.is_dir() {
            return Err(Error::Invalid(format!(
                "model {} does not exist (expected a GGUF file, or a folder with config.json, \
                 *.safetensors and tokenizer.json)",
                dir.display()
            )));
        }
        let mut config = ModelConfig::from_file(&dir.join("config.json"))?;
        config.add_generation_config_eos(&dir.join("generation_config.json"))?;
        let weights = weights::load_dir(dir, &config)?;
        let tokenizer = Tokenizer::from_file(&dir.join("tokenizer.json"))?;
        Ok(Model {
            name: dir.display().to_string(),
            config,
            weights,
            tokenizer,
            chat: ChatFormat::default(),
        })
    }

    /// The embedded default model: a tiny Llama (2 layers, hidden 64, grouped
    /// query attention 4:2) over the byte tokenizer, with weights drawn
    /// uniformly from ±1/sqrt(fan_in) by ChaCha8 seeded with [`EMBEDDED_SEED`]
    /// in a fixed order (embedding, then each layer's q, k, v, o, gate, up,
    /// down; norms are ones). It needs no download and says nothing sensible.
    pub fn embedded() -> Model {
        let config = ModelConfig {
            hidden_size: 64,
            intermediate_size: 160,
            num_layers: 2,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 16,
            vocab_size: ByteTokenizer::VOCAB_SIZE,
            rms_norm_eps: 1e-5,
            rope_theta: 10_000.0,
            rope_scaling: None,
            tie_word_embeddings: true,
            max_position_embeddings: 256,
            sliding_window: None,
            qkv_bias: false,
            family: crate::config::Family::Llama,
            bos_token_id: Some(ByteTokenizer::BOS),
            eos_token_ids: vec![ByteTokenizer::EOS],
        };
        let weights = random_weights(&config, EMBEDDED_SEED);
        Model {
            name: "embedded".into(),
            config,
            weights,
            tokenizer: Tokenizer::Bytes(ByteTokenizer),
            chat: ChatFormat::default(),
        }
    }

    /// A model of `config` with weights from [`random_weights`], for
    /// benchmarks; its tokenizer is the byte one, so feed it token ids.
    pub fn random(name: &str, config: ModelConfig, seed: u64) -> Model {
        let weights = random_weights(&config, seed);
        Model {
            name: name.to_string(),
            config,
            weights,
            tokenizer: Tokenizer::Bytes(ByteTokenizer),
            chat: ChatFormat::default(),
        }
    }

    /// The model of this one's first `layers` layers with its embedding,
    /// final norm and output head: self-speculation's draft, which guesses
    /// what the whole model will choose at a fraction of its cost.
    pub fn first_layers(&self, layers: usize) -> Result<Model> {
        let total = self.config.num_layers;
        if layers == 0 || layers > total {
            return Err(Error::Invalid(format!(
                "{} has {total} layers; the self-speculation draft takes 1 to {total} of them, \
                 not {layers}",
                self.name
            )));
        }
        let mut config = self.config.clone();
        config.num_layers = layers;
        let weights = Weights {
            embed: self.weights.embed.clone(),
            layers: self.weights.layers[..layers].to_vec(),
            final_norm: self.weights.final_norm.clone(),
            lm_head: self.weights.lm_head.clone(),
            stored: self.weights.stored,
        };
        Ok(Model {
            name: format!("{} (first {layers} of {total} layers)", self.name),
            config,
            weights,
            // Token ids only: the draft never encodes or decodes text.
            tokenizer: Tokenizer::Bytes(ByteTokenizer),
            chat: ChatFormat::default(),
        })
    }

    /// The number of weights.
    pub fn parameter_count(&self) -> usize {
        let w = &self.weights;
        let layers: usize = w
            .layers
            .iter()
            .map(|l| {
                l.attn_norm.len()
                    + l.mlp_norm.len()
                    + l.matrices().iter().map(|m| m.rows * m.cols).sum::<usize>()
            })
            .sum();
        w.embed.rows * w.embed.cols
            + layers
            + w.final_norm.len()
            + w.lm_head.as_ref().map_or(0, |m| m.rows * m.cols)
    }

    /// A model from `dir`, or the embedded one when `dir` is `None`.
    pub fn load_or_embedded(dir: Option<&Path>) -> Result<Model> {
        match dir {
            Some(dir) => Model::load(dir),
            None => Ok(Model::embedded()),
        }
    }
}

/// The configuration and seed of a named random-weight Llama for benchmarks
/// and tests: `random-100m` (~100M parameters: 12 layers, hidden 768, GQA
/// 12:4, vocab 32000, tied), `tinyllama-1.1b` (TinyLlama-1.1B's shape: 22
/// layers, hidden 2048, intermediate 5632, GQA 32:4, vocab 32000, untied) or
/// `smollm2-135m` (SmolLM2-135M's shape: 30 layers, hidden 576, intermediate
/// 1536, GQA 9:3, vocab 49152, tied: the pinned real model's shape, for
/// measuring on a machine the model file is not carried to) or
/// `llama-3.1-8b` (Llama-3.1-8B's shape: 32 layers, hidden 4096,
/// intermediate 14336, GQA 32:8, vocab 128,256, untied, RoPE θ 5e5 with its
/// `llama3` scaling: the size most users run, 16 GB at f16).
/// [`Model::random`] makes the weights.
pub fn preset(name: &str) -> Option<(ModelConfig, u64)> {
    let (hidden, intermediate, layers, heads, kv_heads, tied, vocab, seed) = match name {
        "random-100m" => (768, 2048, 12, 12, 4, true, 32_000, 100),
        "tinyllama-1.1b" => (2048, 5632, 22, 32, 4, false, 32_000, 1100),
        "smollm2-135m" => (576, 1536, 30, 9, 3, true, 49_152, 135),
        "llama-3.1-8b" => (4096, 14_336, 32, 32, 8, false, 128_256, 8000),
        _ => return None,
    };
    let mut config = ModelConfig {
        hidden_size: hidden,
        intermediate_size: intermediate,
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim: hidden / heads,
        vocab_size: vocab,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        rope_scaling: None,
        tie_word_embeddings: tied,
        max_position_embeddings: 2048,
        sliding_window: None,
        qkv_bias: false,
        family: crate::config::Family::Llama,
        bos_token_id: None,
        eos_token_ids: Vec::new(),
    };
    if name == "llama-3.1-8b" {
        // Llama 3.1's positions: θ 5e5, its scaling, 128K context.
        config.rope_theta = 500_000.0;
        config.rope_scaling = Some(crate::config::RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0,
        });
        config.max_position_embeddings = 131_072;
    }
    Some((config, seed))
}

/// Weights for `config` drawn deterministically from `seed` (see
/// [`Model::embedded`]). Benchmarks use it for larger random models.
pub fn random_weights(config: &ModelConfig, seed: u64) -> Weights {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut matrix = |rows: usize, cols: usize| {
        let bound = 1.0 / (cols as f32).sqrt();
        Matrix::new(
            rows,
            cols,
            (0..rows * cols)
                .map(|_| rng.random_range(-bound..bound))
                .collect(),
        )
    };
    let (h, i) = (config.hidden_size, config.intermediate_size);
    let q = config.num_heads * config.head_dim;
    let kv = config.num_kv_heads * config.head_dim;
    let embed = matrix(config.vocab_size, h);
    let layers = (0..config.num_layers)
        .map(|_| LayerWeights {
            attn_norm: vec![1.0; h],
            wq: matrix(q, h),
            wk: matrix(kv, h),
            wv: matrix(kv, h),
            wo: matrix(h, q),
            mlp_norm: vec![1.0; h],
            w_gate: matrix(i, h),
            w_up: matrix(i, h),
            w_down: matrix(h, i),
            qkv_bias: None,
        })
        .collect();
    let lm_head = (!config.tie_word_embeddings).then(|| matrix(config.vocab_size, h));
    Weights {
        embed,
        layers,
        final_norm: vec![1.0; h],
        lm_head,
        stored: crate::weights::Stored::F32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The presets have the shapes their names promise: valid configs whose
    /// parameter counts are those of the models they stand in for.
    #[test]
    fn presets_have_their_models_shapes() {
        for (name, millions) in [
            ("random-100m", 100..120),
            ("tinyllama-1.1b", 1090..1110),
            ("smollm2-135m", 134..136),
            ("llama-3.1-8b", 8029..8031),
        ] {
            let (c, _) = preset(name).unwrap();
            c.validate().unwrap();
            let (h, kv) = (c.hidden_size, c.num_kv_heads * c.head_dim);
            let layer = 2 * h * h + 2 * h * kv + 3 * h * c.intermediate_size + 2 * h;
            let heads = if c.tie_word_embeddings { 1 } else { 2 };
            let count = (heads * c.vocab_size * h + c.num_layers * layer + h) / 1_000_000;
            assert!(millions.contains(&count), "{name}: {count}M parameters");
        }
        assert!(preset("gpt-5").is_none());
    }
}
