//! The model configuration: the fields of a Hugging Face Llama, Mistral or
//! Qwen2 `config.json` that kiln uses, checked for consistency.

use std::path::Path;

use serde::Deserialize;

use crate::error::{Error, Result};

/// RoPE frequency scaling, as `config.json`'s `rope_scaling` describes it.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// Positions divided by `factor` (`"rope_type": "linear"`).
    Linear { factor: f64 },
    /// Llama 3's frequency-dependent scaling (`"rope_type": "llama3"`).
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
}

/// The model families kiln runs: one graph (Llama's), named as the model's
/// `model_type` names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    Llama,
    /// Llama's graph under Mistral's own config; v0.1 sets a sliding
    /// window (see [`ModelConfig::sliding_window`]).
    Mistral,
    /// Llama's graph with biases on the q, k and v projections
    /// ([`ModelConfig::qkv_bias`]).
    Qwen2,
}

impl Family {
    /// The `model_type` that names it.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Mistral => "mistral",
            Family::Qwen2 => "qwen2",
        }
    }
}

/// The largest `config.json` kiln reads (real ones are a few KB).
pub const CONFIG_FILE_LIMIT: u64 = 1 << 20;

/// The largest value of each size, in [`ModelConfig::validate`]'s order:
/// well above any released Llama-family model, and small enough that all
/// products of sizes fit in 64 bits (the largest, layers × context × heads ×
/// head_dim × 4 bytes, is 2^10 · 2^24 · 2^10 · 2^12 · 2^2 = 2^58).
pub const LIMITS: [(&str, usize); 8] = [
    ("hidden_size", 1 << 16),
    ("intermediate_size", 1 << 20),
    ("num_hidden_layers", 1 << 10),
    ("num_attention_heads", 1 << 10),
    ("num_key_value_heads", 1 << 10),
    ("head_dim", 1 << 12),
    ("vocab_size", 1 << 22),
    ("max_position_embeddings", 1 << 24),
];

/// A Llama-architecture decoder's shape and constants.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub family: Family,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f64,
    pub rope_scaling: Option<RopeScaling>,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,
    /// Mistral v0.1's sliding-window attention: each position attends to
    /// the last `w` only. kiln does not window its attention; it caps the
    /// context at `w` instead ([`ModelConfig::context_limit`]), where the
    /// window holds every position and attention is full.
    pub sliding_window: Option<usize>,
    /// Biases added to the q, k and v projections (Qwen2's); the layer
    /// weights then carry them ([`crate::weights::LayerWeights::qkv_bias`]).
    pub qkv_bias: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

#[derive(Deserialize)]
struct RawConfig {
    model_type: Option<String>,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    vocab_size: usize,
    rms_norm_eps: f32,
    rope_theta: Option<f64>,
    rope_scaling: Option<serde_json::Value>,
    /// transformers 5 writes `rope_theta` and the scaling here instead.
    rope_parameters: Option<serde_json::Value>,
    #[serde(default)]
    tie_word_embeddings: bool,
    max_position_embeddings: Option<usize>,
    sliding_window: Option<usize>,
    /// Qwen2's switch for its `sliding_window` (off in every Qwen2.5).
    use_sliding_window: Option<bool>,
    bos_token_id: Option<u32>,
    eos_token_id: Option<serde_json::Value>,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    mlp_bias: bool,
    hidden_act: Option<String>,
}

impl ModelConfig {
    /// Reads `config.json`.
    pub fn from_file(path: &Path) -> Result<ModelConfig> {
        let text = crate::files::read_text_limited(path, CONFIG_FILE_LIMIT, "a config.json")?;
        ModelConfig::from_json(&text).map_err(|message| Error::Config {
            path: path.to_path_buf(),
            message,
        })
    }

    /// Adds the end-of-sequence ids of `generation_config.json` (when the
    /// file exists): generation stops at all of them, as in transformers,
    /// and instruct models often list their end-of-turn token only there.
    pub fn add_generation_config_eos(&mut self, path: &Path) -> Result<()> {
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(error) => {
                return Err(Error::Io {
                    path: path.to_path_buf(),
                    error,
                });
            }
        };
        let invalid = |message: String| Error::Config {
            path: path.to_path_buf(),
            message,
        };
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| invalid(format!("not valid JSON: {e}")))?;
        for id in parse_eos(json.get("eos_token_id")).map_err(invalid)? {
            if id as usize >= self.vocab_size {
                return Err(invalid(format!(
                    "eos_token_id {id} is outside the vocabulary ({})",
                    self.vocab_size
                )));
            }
            if !self.eos_token_ids.contains(&id) {
                self.eos_token_ids.push(id);
            }
        }
        Ok(())
    }

    /// Parses and checks config JSON; the error says which field is wrong.
    pub fn from_json(text: &str) -> std::result::Result<ModelConfig, String> {
        let mut deserializer = serde_json::Deserializer::from_str(text);
        let raw: RawConfig = serde_path_to_error::deserialize(&mut deserializer).map_err(|e| {
            match e.path().to_string().as_str() {
                "." => e.inner().to_string(),
                path => format!("field {path}: {}", e.inner()),
            }
        })?;
        let family = match raw.model_type.as_deref() {
            None | Some("llama") => Family::Llama,
            Some("mistral") => Family::Mistral,
            Some("qwen2") => Family::Qwen2,
            Some(kind) => {
                return Err(format!(
                    "model_type is {kind:?}; kiln runs the Llama, Mistral and Qwen2 families \
                     (\"llama\", \"mistral\", \"qwen2\")"
                ));
            }
        };
        // Qwen2 applies its window only where `use_sliding_window` says so;
        // Mistral wherever one is set.
        let sliding_window = match (family, raw.use_sliding_window) {
            (Family::Qwen2, Some(true)) | (Family::Llama | Family::Mistral, _) => {
                raw.sliding_window
            }
            (Family::Qwen2, _) => None,
        };
        if raw.attention_bias || raw.mlp_bias {
            return Err(
                "attention_bias/mlp_bias are set; kiln runs only Qwen2's biases (q, k and v; \
                 attention_bias also biases the output projection, mlp_bias the MLP)"
                    .into(),
            );
        }
        if let Some(act) = &raw.hidden_act
            && act != "silu"
        {
            return Err(format!(
                "hidden_act is {act:?}; the Llama MLP uses \"silu\""
            ));
        }
        let num_kv_heads = raw.num_key_value_heads.unwrap_or(raw.num_attention_heads);
        let head_dim = match raw.head_dim {
            Some(d) => d,
            None if raw.num_attention_heads > 0 => raw.hidden_size / raw.num_attention_heads,
            None => 0,
        };
        let config = ModelConfig {
            family,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_layers: raw.num_hidden_layers,
            num_heads: raw.num_attention_heads,
            num_kv_heads,
            head_dim,
            vocab_size: raw.vocab_size,
            rms_norm_eps: raw.rms_norm_eps,
            rope_theta: raw
                .rope_theta
                .or_else(|| {
                    raw.rope_parameters
                        .as_ref()
                        .and_then(|p| p.get("rope_theta"))
                        .and_then(|v| v.as_f64())
                })
                .unwrap_or(10_000.0),
            rope_scaling: parse_rope_scaling(
                raw.rope_scaling.as_ref().or(raw.rope_parameters.as_ref()),
            )?,
            tie_word_embeddings: raw.tie_word_embeddings,
            max_position_embeddings: raw.max_position_embeddings.unwrap_or(2048),
            sliding_window,
            qkv_bias: family == Family::Qwen2,
            bos_token_id: raw.bos_token_id,
            eos_token_ids: parse_eos(raw.eos_token_id.as_ref())?,
        };
        config.validate()?;
        Ok(config)
    }

    /// Checks each size against [`LIMITS`] and the relations between them.
    /// Within the limits every product of sizes kiln forms (weights, caches,
    /// RoPE tables, in elements or bytes) fits in a `u64`, so a config that
    /// passes cannot make arithmetic wrap. Every constructor of a config
    /// from outside data must call it; backends call it again.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let sizes = [
            self.hidden_size,
            self.intermediate_size,
            self.num_layers,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.vocab_size,
            self.max_position_embeddings,
        ];
        for ((name, limit), value) in LIMITS.iter().zip(sizes) {
            if value == 0 {
                return Err(format!("{name} must be positive"));
            }
            if value > *limit {
                return Err(format!(
                    "{name} is {value}, above kiln's limit of {limit} for it"
                ));
            }
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return Err(format!(
                "num_attention_heads ({}) is not a multiple of num_key_value_heads ({})",
                self.num_heads, self.num_kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(format!(
                "head_dim ({}) must be even for RoPE",
                self.head_dim
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err("rms_norm_eps must be positive".into());
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err("rope_theta must be positive".into());
        }
        if self.sliding_window == Some(0) {
            return Err("sliding_window must be positive (or null: no window)".into());
        }
        if let Some(bad) = self
            .eos_token_ids
            .iter()
            .chain(self.bos_token_id.iter())
            .find(|&&id| id as usize >= self.vocab_size)
        {
            return Err(format!("special token id {bad} is outside the vocabulary"));
        }
        Ok(())
    }

    /// The longest sequence kiln runs the model at: its
    /// `max_position_embeddings`, or its sliding window where that is
    /// shorter (beyond it the model would attend to a window, which kiln
    /// does not do).
    pub fn context_limit(&self) -> usize {
        match self.sliding_window {
            Some(window) => self.max_position_embeddings.min(window),
            None => self.max_position_embeddings,
        }
    }

    /// Query heads per key/value head.
    pub fn group_size(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }

    /// The RoPE inverse frequencies (`head_dim / 2` of them), scaling applied,
    /// computed as Hugging Face does: in f64 here, rounded to f32 once.
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        let dim = self.head_dim as f64;
        (0..self.head_dim / 2)
            .map(|i| {
                let freq = 1.0 / self.rope_theta.powf((2 * i) as f64 / dim);
                let scaled = match &self.rope_scaling {
                    None => freq,
                    Some(RopeScaling::Linear { factor }) => freq / factor,
                    Some(RopeScaling::Llama3 {
                        factor,
                        low_freq_factor,
                        high_freq_factor,
                        original_max_position_embeddings: original,
                    }) => {
                        let wavelen = 2.0 * std::f64::consts::PI / freq;
                        let low_freq_wavelen = original / low_freq_factor;
                        let high_freq_wavelen = original / high_freq_factor;
                        if wavelen < high_freq_wavelen {
                            freq
                        } else if wavelen > low_freq_wavelen {
                            freq / factor
                        } else {
                            let smooth = (original / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * freq / factor + smooth * freq
                        }
                    }
                };
                scaled as f32
            })
            .collect()
    }

    /// cos and sin tables for positions `0..positions`, `[positions, head_dim/2]`
    /// each, row-major; the angle is computed in f32 as Hugging Face does.
    /// An allocation failure (a context too large for memory) is an error.
    pub fn rope_tables(&self, positions: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        let inv_freq = self.rope_inv_freq();
        let too_large = || {
            Error::Invalid(format!(
                "no memory for RoPE tables of {positions} positions; lower --max-context"
            ))
        };
        let len = positions
            .checked_mul(inv_freq.len())
            .ok_or_else(too_large)?;
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        cos.try_reserve_exact(len).map_err(|_| too_large())?;
        sin.try_reserve_exact(len).map_err(|_| too_large())?;
        for p in 0..positions {
            for f in &inv_freq {
                let angle = p as f32 * f;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        Ok((cos, sin))
    }
}

fn parse_rope_scaling(
    value: Option<&serde_json::Value>,
) -> std::result::Result<Option<RopeScaling>, String> {
    let Some(value) = value.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let kind = value
        .get("rope_type")
        .or_else(|| value.get("type"))
        .and_then(|v| v.as_str())
        .ok_or("rope_scaling has no rope_type")?;
    // Every number here divides positions or frequencies: zero gave NaN
    // logits, a negative one garbage.
    let number = |name: &str| {
        let n = value
            .get(name)
            .and_then(|v| v.as_f64())
            .ok_or(format!("rope_scaling ({kind}) needs a number {name}"))?;
        if !(n.is_finite() && n > 0.0) {
            return Err(format!(
                "rope_scaling.{name} is {n}; it must be a positive number"
            ));
        }
        Ok(n)
    };
    match kind {
        "default" => Ok(None),
        "linear" => Ok(Some(RopeScaling::Linear {
            factor: number("factor")?,
        })),
        "llama3" => {
            let (low, high) = (number("low_freq_factor")?, number("high_freq_factor")?);
            // The smoothing between them divides by their difference.
            if high <= low {
                return Err(format!(
                    "rope_scaling.high_freq_factor ({high}) must be greater than \
                     rope_scaling.low_freq_factor ({low})"
                ));
            }
            Ok(Some(RopeScaling::Llama3 {
                factor: number("factor")?,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position_embeddings: number("original_max_position_embeddings")?,
            }))
        }
        other => Err(format!(
            "rope_scaling type {other:?} is not supported (kiln knows linear and llama3)"
        )),
    }
}

fn parse_eos(value: Option<&serde_json::Value>) -> std::result::Result<Vec<u32>, String> {
    let as_id = |v: &serde_json::Value| {
        v.as_u64()
            .and_then(|id| u32::try_from(id).ok())
            .ok_or(format!("eos_token_id {v} is not a token id"))
    };
    match value {
        None | Some(serde_json::Value::Null) => Ok(Vec::new()),
        Some(serde_json::Value::Array(ids)) => ids.iter().map(as_id).collect(),
        Some(v) => Ok(vec![as_id(v)?]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_config_adds_its_eos_ids() {
        let mut c = ModelConfig::from_json(BASE).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("generation_config.json");
        c.add_generation_config_eos(&path).unwrap(); // absent: nothing changes
        assert_eq!(c.eos_token_ids, vec![2, 3]);
        std::fs::write(&path, r#"{"eos_token_id": [3, 7], "temperature": 0.2}"#).unwrap();
        c.add_generation_config_eos(&path).unwrap();
        assert_eq!(c.eos_token_ids, vec![2, 3, 7]);
        std::fs::write(&path, r#"{"eos_token_id": 99}"#).unwrap();
        let error = c.add_generation_config_eos(&path).unwrap_err().to_string();
        assert!(
            error.contains("generation_config.json") && error.contains("99"),
            "{error}"
        );
    }

    const BASE: &str = r#"{"model_type": "llama", "hidden_size": 64, "intermediate_size": 100,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 50, "rms_norm_eps": 1e-5, "eos_token_id": [2, 3]}"#;

    fn with(field: &str, value: &str) -> std::result::Result<ModelConfig, String> {
        let mut json: serde_json::Value = serde_json::from_str(BASE).unwrap();
        json[field] = serde_json::from_str(value).unwrap();
        ModelConfig::from_json(&json.to_string())
    }

    #[test]
    fn mistral_is_the_llama_graph_with_its_window() {
        let v03 = with("model_type", "\"mistral\"").unwrap();
        assert_eq!(v03.family, Family::Mistral);
        assert_eq!((v03.sliding_window, v03.context_limit()), (None, 2048));
        let mut json: serde_json::Value = serde_json::from_str(BASE).unwrap();
        json["model_type"] = "mistral".into();
        json["sliding_window"] = 512.into();
        let v01 = ModelConfig::from_json(&json.to_string()).unwrap();
        assert_eq!((v01.sliding_window, v01.context_limit()), (Some(512), 512));
        json["sliding_window"] = serde_json::Value::Null;
        let null = ModelConfig::from_json(&json.to_string()).unwrap();
        assert_eq!(null.sliding_window, None);
    }

    #[test]
    fn qwen2_has_qkv_biases_and_its_window_only_when_switched_on() {
        let mut json: serde_json::Value = serde_json::from_str(BASE).unwrap();
        json["model_type"] = "qwen2".into();
        json["sliding_window"] = 32.into();
        json["use_sliding_window"] = false.into();
        let off = ModelConfig::from_json(&json.to_string()).unwrap();
        assert_eq!(off.family, Family::Qwen2);
        assert!(off.qkv_bias);
        assert_eq!((off.sliding_window, off.context_limit()), (None, 2048));
        json["use_sliding_window"] = true.into();
        let on = ModelConfig::from_json(&json.to_string()).unwrap();
        assert_eq!((on.sliding_window, on.context_limit()), (Some(32), 32));
        assert!(!with("model_type", "\"mistral\"").unwrap().qkv_bias);
    }

    #[test]
    fn defaults_are_filled_in() {
        let c = ModelConfig::from_json(BASE).unwrap();
        assert_eq!(c.head_dim, 16);
        assert_eq!(c.rope_theta, 10_000.0);
        assert_eq!(c.eos_token_ids, vec![2, 3]);
        assert!(!c.tie_word_embeddings);
    }

    #[test]
    fn malformed_configs_name_the_problem() {
        let cases = [
            (
                "num_key_value_heads",
                "3",
                "multiple of num_key_value_heads",
            ),
            ("model_type", "\"gpt2\"", "model_type"),
            ("model_type", "\"gemma\"", "Llama, Mistral and Qwen2"),
            ("sliding_window", "0", "sliding_window"),
            ("head_dim", "15", "even"),
            ("hidden_size", "\"wide\"", "hidden_size"),
            (
                "rope_scaling",
                r#"{"rope_type": "yarn", "factor": 4.0}"#,
                "yarn",
            ),
            ("eos_token_id", "99", "outside the vocabulary"),
            ("attention_bias", "true", "bias"),
            // A zero factor gave NaN logits (and, through 8-bit
            // activations, plausible-looking tokens).
            (
                "rope_scaling",
                r#"{"rope_type": "linear", "factor": 0}"#,
                "rope_scaling.factor is 0; it must be a positive number",
            ),
            (
                "rope_scaling",
                r#"{"rope_type": "linear", "factor": -2.0}"#,
                "rope_scaling.factor is -2",
            ),
            (
                "rope_scaling",
                r#"{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}"#,
                "must be greater than rope_scaling.low_freq_factor",
            ),
        ];
        for (field, value, expected) in cases {
            let error = with(field, value).unwrap_err();
            assert!(error.contains(expected), "{field}={value}: {error}");
        }
        assert!(ModelConfig::from_json("{").unwrap_err().contains("EOF"));
    }

    #[test]
    fn both_rope_layouts_are_read() {
        let v4 = with("rope_scaling", r#"{"type": "linear", "factor": 2.0}"#).unwrap();
        assert_eq!(v4.rope_scaling, Some(RopeScaling::Linear { factor: 2.0 }));
        let v5 = with(
            "rope_parameters",
            r#"{"rope_type": "linear", "factor": 4.0, "rope_theta": 500000.0}"#,
        )
        .unwrap();
        assert_eq!(v5.rope_scaling, Some(RopeScaling::Linear { factor: 4.0 }));
        assert_eq!(v5.rope_theta, 500_000.0);
        let inv = v5.rope_inv_freq();
        assert_eq!(inv.len(), 8);
        assert!(
            (inv[0] - 0.25).abs() < 1e-7,
            "linear scaling divides by the factor"
        );
    }
}
