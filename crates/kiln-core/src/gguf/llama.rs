//! A GGUF `llama` or `qwen2` model: `<architecture>.*` metadata to
//! [`ModelConfig`], tensors to [`Weights`] (each matrix as the file stores
//! it, norms in f32), and the tokenizer from the metadata.

use std::path::Path;

use half::{bf16, f16};

use super::{GgmlType, GgufFile, TensorInfo, tokenizer_from_gguf};
use crate::config::{Family, ModelConfig, RopeScaling};
use crate::error::Result;
use crate::model::Model;
use crate::tokenizer::Tokenizer;
use crate::weights::{LayerWeights, Matrix, Stored, Values, Weights};

/// Loads a GGUF Llama (or Mistral) or Qwen2 model: configuration, weights
/// and tokenizer.
pub fn load_model(path: &Path) -> Result<Model> {
    let file = GgufFile::open(path)?;
    let mut config = model_config(&file)?;
    let (tokenizer, chat) = tokenizer_from_gguf(&file)?;
    config.bos_token_id = chat.bos;
    config.eos_token_ids = chat.stop_ids();
    config.validate().map_err(|m| file.error(m))?;
    let weights = weights(&file, &config)?;
    let name = file
        .get("general.name")
        .and_then(|v| v.as_str())
        .map_or_else(|| path.display().to_string(), str::to_string);
    Ok(Model {
        name,
        config,
        weights,
        tokenizer: Tokenizer::from_hugging_face(tokenizer),
        chat,
    })
}

fn usize_key(file: &GgufFile, key: &str) -> Result<usize> {
    let value = file.require_u64(key)?;
    usize::try_from(value).map_err(|_| file.error(format!("{key} is {value}, too large")))
}

fn optional_usize(file: &GgufFile, key: &str) -> Result<Option<usize>> {
    Ok(file
        .optional(key, "an unsigned integer", |v| v.as_u64())?
        .map(|v| usize::try_from(v).unwrap_or(usize::MAX)))
}

/// The model configuration from `<architecture>.*` metadata (without the
/// special token ids, which come with the tokenizer).
pub fn model_config(file: &GgufFile) -> Result<ModelConfig> {
    let arch = file.require_str("general.architecture")?;
    let family = match arch {
        "llama" => Family::Llama,
        "qwen2" => Family::Qwen2,
        _ => {
            return Err(file.error(format!(
                "general.architecture is {arch:?}; kiln reads GGUF files of the \"llama\" \
                 (Llama, and Mistral, which llama.cpp writes as \"llama\") and \"qwen2\" \
                 architectures"
            )));
        }
    };
    // Every model key is under the architecture's name.
    let key = |name: &str| format!("{arch}.{name}");
    let hidden_size = usize_key(file, &key("embedding_length"))?;
    let num_heads = usize_key(file, &key("attention.head_count"))?;
    let num_kv_heads = optional_usize(file, &key("attention.head_count_kv"))?.unwrap_or(num_heads);
    let head_dim = match optional_usize(file, &key("attention.key_length"))? {
        Some(d) => d,
        None if num_heads > 0 => hidden_size / num_heads,
        None => 0,
    };
    if let Some(rope_dims) = optional_usize(file, &key("rope.dimension_count"))?
        && rope_dims != head_dim
    {
        return Err(file.error(format!(
            "{} is {rope_dims} but heads have {head_dim} dimensions; kiln rotates whole heads",
            key("rope.dimension_count")
        )));
    }
    if file.tensor("rope_freqs.weight").is_some() {
        return Err(file.error(
            "the model has a rope_freqs tensor (Llama 3.1 frequency factors), which kiln does not apply yet",
        ));
    }
    let rope_scaling = match file.optional(&key("rope.scaling.type"), "a string", |v| v.as_str())? {
        None | Some("none") => None,
        Some("linear") => {
            let factor = file
                .optional(&key("rope.scaling.factor"), "a number", |v| v.as_f64())?
                .ok_or_else(|| {
                    file.error(format!(
                        "linear RoPE scaling without {}",
                        key("rope.scaling.factor")
                    ))
                })?;
            if !(factor.is_finite() && factor > 0.0) {
                return Err(file.error(format!(
                    "{} is {factor}; it must be a positive number",
                    key("rope.scaling.factor")
                )));
            }
            Some(RopeScaling::Linear { factor })
        }
        Some(other) => {
            return Err(file.error(format!(
                "{} {other:?} is not supported (kiln knows none and linear)",
                key("rope.scaling.type")
            )));
        }
    };
    let vocab_size = match optional_usize(file, &key("vocab_size"))? {
        Some(v) => v,
        None => file
            .require("tokenizer.ggml.tokens")?
            .as_array()
            .map(<[_]>::len)
            .ok_or_else(|| file.error("tokenizer.ggml.tokens is not an array"))?,
    };
    let rms_norm_eps = file
        .optional(&key("attention.layer_norm_rms_epsilon"), "a number", |v| {
            v.as_f64()
        })?
        .ok_or_else(|| {
            file.error(format!(
                "metadata key {} is missing",
                key("attention.layer_norm_rms_epsilon")
            ))
        })? as f32;
    let config = ModelConfig {
        hidden_size,
        intermediate_size: usize_key(file, &key("feed_forward_length"))?,
        num_layers: usize_key(file, &key("block_count"))?,
        num_heads,
        num_kv_heads,
        head_dim,
        vocab_size,
        rms_norm_eps,
        rope_theta: file
            .optional(&key("rope.freq_base"), "a number", |v| v.as_f64())?
            .unwrap_or(10_000.0),
        rope_scaling,
        tie_word_embeddings: file.tensor("output.weight").is_none(),
        max_position_embeddings: usize_key(file, &key("context_length"))?,
        // Where the file has one (llama.cpp's writer puts Mistral's here);
        // it caps the context as for a Hugging Face folder.
        sliding_window: optional_usize(file, &key("attention.sliding_window"))?,
        // Qwen2 always has q/k/v biases (llama.cpp's loader requires them).
        qkv_bias: family == Family::Qwen2,
        family,
        bos_token_id: None,
        eos_token_ids: Vec::new(),
    };
    config.validate().map_err(|m| file.error(m))?;
    // Each product sizes a weight matrix; none can hold more values than the
    // file has bytes (the tensors' own sizes are checked against it later).
    let bytes = file.len();
    for (what, a, b) in [
        ("head_count x key_length", config.num_heads, config.head_dim),
        (
            "head_count_kv x key_length",
            config.num_kv_heads,
            config.head_dim,
        ),
        (
            "vocab_size x embedding_length",
            config.vocab_size,
            config.hidden_size,
        ),
        (
            "feed_forward_length x embedding_length",
            config.intermediate_size,
            config.hidden_size,
        ),
    ] {
        if a.checked_mul(b).is_none_or(|n| n > bytes) {
            return Err(file.error(format!(
                "{arch}.* metadata make {what} = {a} x {b} weights, more than the file's {bytes} bytes hold"
            )));
        }
    }
    Ok(config)
}

/// Tensor `name`'s info, checked to have the expected GGUF dims (fastest
/// first).
fn info<'f>(file: &'f GgufFile, name: &str, dims: &[usize]) -> Result<&'f TensorInfo> {
    let info: &TensorInfo = file
        .tensor(name)
        .ok_or_else(|| file.error(format!("tensor {name} is missing")))?;
    if info.dims.len() != dims.len() || info.dims.iter().zip(dims).any(|(&a, &b)| a != b as u64) {
        return Err(file.error(format!(
            "tensor {name} has dims {:?}, the metadata implies {dims:?}",
            info.dims
        )));
    }
    Ok(info)
}

/// A tensor of the expected GGUF dims, dequantized, its values finite.
fn take(file: &GgufFile, name: &str, dims: &[usize]) -> Result<Vec<f32>> {
    let values = file.tensor_f32(info(file, name, dims)?)?;
    crate::weights::check_finite(name, values.iter().copied()).map_err(|m| file.error(m))?;
    Ok(values)
}

/// A `[rows, cols]` matrix (GGUF dims `[cols, rows]`) with the values the
/// file stores: f32, f16 and bf16 as such, blocks as their bytes.
fn matrix(file: &GgufFile, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
    let info = info(file, name, &[cols, rows])?;
    let bytes = file.tensor_bytes(info);
    let values = match info.ty {
        GgmlType::F32 => Values::F32(file.tensor_f32(info)?),
        GgmlType::F16 => Values::F16(
            bytes
                .chunks_exact(2)
                .map(|b| f16::from_le_bytes([b[0], b[1]]))
                .collect(),
        ),
        GgmlType::BF16 => Values::Bf16(
            bytes
                .chunks_exact(2)
                .map(|b| bf16::from_le_bytes([b[0], b[1]]))
                .collect(),
        ),
        ty => Values::Blocks {
            ty,
            bytes: bytes.to_vec(),
        },
    };
    // As for safetensors (`weights::check_finite`): a NaN or infinite weight
    // makes every logit NaN, which greedy decoding would read as token 0.
    values
        .check_finite(name)
        .map_err(|message| file.error(message))?;
    Matrix::stored(rows, cols, values)
        .map_err(|message| file.error(format!("tensor {name}: {message}")))
}

/// Undoes the row permutation llama.cpp's converter applies to q and k
/// projections, so that RoPE pairs `(i, i + head_dim/2)` as Hugging Face
/// does: within each head, GGUF row `2i + j` is Hugging Face row
/// `j * head_dim/2 + i`. Whole rows move, so the values stay as stored.
pub fn unpermute_rows(m: &Matrix, heads: usize) -> Matrix {
    let head_dim = m.rows / heads;
    let half = head_dim / 2;
    m.reorder_rows((0..m.rows).map(|row| {
        let (h, r) = (row / head_dim, row % head_dim);
        let (j, i) = (r / half, r % half);
        h * head_dim + 2 * i + j
    }))
}

/// How a file of `layers` layers stores its layers' matrices (read from
/// their types, nothing loaded): what a backend that keeps the model's
/// precision keeps.
pub fn stored_kind(file: &GgufFile, layers: usize) -> Stored {
    Stored::of_all((0..layers).flat_map(|l| {
        [
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
        ]
        .into_iter()
        .filter_map(move |name| file.tensor(&format!("blk.{l}.{name}.weight")))
        .map(|info| match info.ty {
            GgmlType::F32 => Stored::F32,
            GgmlType::F16 => Stored::F16,
            GgmlType::BF16 => Stored::BF16,
            blocks => Stored::Blocks(blocks.name()),
        })
    }))
}

fn weights(file: &GgufFile, c: &ModelConfig) -> Result<Weights> {
    let (h, i, v) = (c.hidden_size, c.intermediate_size, c.vocab_size);
    let q = c.num_heads * c.head_dim;
    let kv = c.num_kv_heads * c.head_dim;
    let embed = matrix(file, "token_embd.weight", v, h)?;
    let mut layers = Vec::with_capacity(c.num_layers.min(file.tensors.len()));
    for l in 0..c.num_layers {
        let p = format!("blk.{l}");
        let mut wq = matrix(file, &format!("{p}.attn_q.weight"), q, h)?;
        let mut wk = matrix(file, &format!("{p}.attn_k.weight"), kv, h)?;
        // llama.cpp's converter permutes Llama's q and k rows for its RoPE;
        // Qwen2's it stores as Hugging Face does (llama.cpp rotates those
        // in the half-split "neox" order).
        if c.family == Family::Llama {
            wq = unpermute_rows(&wq, c.num_heads);
            wk = unpermute_rows(&wk, c.num_kv_heads);
        }
        let qkv_bias = match c.qkv_bias {
            true => Some(
                [("attn_q", q), ("attn_k", kv), ("attn_v", kv)]
                    .iter()
                    .map(|(name, n)| take(file, &format!("{p}.{name}.bias"), &[*n]))
                    .collect::<Result<Vec<_>>>()?
                    .concat(),
            ),
            false => None,
        };
        layers.push(LayerWeights {
            attn_norm: take(file, &format!("{p}.attn_norm.weight"), &[h])?,
            wq,
            wk,
            wv: matrix(file, &format!("{p}.attn_v.weight"), kv, h)?,
            wo: matrix(file, &format!("{p}.attn_output.weight"), h, q)?,
            mlp_norm: take(file, &format!("{p}.ffn_norm.weight"), &[h])?,
            w_gate: matrix(file, &format!("{p}.ffn_gate.weight"), i, h)?,
            w_up: matrix(file, &format!("{p}.ffn_up.weight"), i, h)?,
            w_down: matrix(file, &format!("{p}.ffn_down.weight"), h, i)?,
            qkv_bias,
        });
    }
    let final_norm = take(file, "output_norm.weight", &[h])?;
    let lm_head = match c.tie_word_embeddings {
        true => None,
        false => Some(matrix(file, "output.weight", v, h)?),
    };
    let stored = stored_kind(file, c.num_layers);
    Ok(Weights {
        embed,
        layers,
        final_norm,
        lm_head,
        stored,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermute_inverts_the_converters_permutation() {
        // The converter: reshape(heads, 2, head_dim/2, cols).swapaxes(1, 2).
        let (heads, head_dim, cols) = (2, 4, 1);
        let hf: Vec<f32> = (0..heads * head_dim).map(|r| r as f32).collect();
        let mut gguf = vec![0f32; hf.len()];
        for h in 0..heads {
            for j in 0..2 {
                for i in 0..head_dim / 2 {
                    gguf[h * head_dim + i * 2 + j] = hf[h * head_dim + j * head_dim / 2 + i];
                }
            }
        }
        let m = Matrix::new(heads * head_dim, cols, gguf);
        assert_eq!(unpermute_rows(&m, heads).f32(), hf);
    }
}
