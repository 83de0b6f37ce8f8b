//! Writing a model as a Hugging Face Llama folder (`config.json` and one
//! f16 `model.safetensors`), so that another engine — transformers, in the
//! GPU benchmark — can run exactly the weights kiln runs.

use std::path::{Path, PathBuf};

use half::f16;
use safetensors::Dtype;
use safetensors::tensor::TensorView;
use serde_json::json;

use crate::config::{Family, ModelConfig, RopeScaling};
use crate::error::{Error, Result};
use crate::weights::{Matrix, Weights};

/// `x` as a JSON integer where it is whole, as transformers writes counts.
fn whole(x: f64) -> serde_json::Value {
    match x.fract() == 0.0 && x >= 0.0 && x <= u64::MAX as f64 {
        true => json!(x as u64),
        false => json!(x),
    }
}

/// The `config.json` of `config`, with the fields [`ModelConfig::from_json`]
/// reads back to an equal configuration.
fn config_json(config: &ModelConfig) -> serde_json::Value {
    let rope_scaling = config.rope_scaling.as_ref().map(|s| match s {
        RopeScaling::Linear { factor } => json!({"rope_type": "linear", "factor": factor}),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => json!({
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low_freq_factor,
            "high_freq_factor": high_freq_factor,
            // transformers refuses a float here ("must be an integer").
            "original_max_position_embeddings": whole(*original_max_position_embeddings),
        }),
    });
    json!({
        "architectures": [match config.family {
            Family::Llama => "LlamaForCausalLM",
            Family::Mistral => "MistralForCausalLM",
            Family::Qwen2 => "Qwen2ForCausalLM",
        }],
        "model_type": config.family.model_type(),
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": config.tie_word_embeddings,
        "max_position_embeddings": config.max_position_embeddings,
        "sliding_window": config.sliding_window,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_ids,
        "hidden_act": "silu",
        "attention_bias": false,
        "mlp_bias": false,
        "torch_dtype": "float16",
    })
}

/// Writes `config.json` and `model.safetensors` (weights rounded to f16)
/// into `dir`, creating it. Each file is written beside its final name and
/// renamed into place, so an interrupted write leaves no partial file.
pub fn save_f16(dir: &Path, config: &ModelConfig, weights: &Weights) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(write_error(dir))?;

    let tensors = named_f16_tensors(config, weights);
    let views = tensors
        .iter()
        .map(|(name, shape, bytes)| {
            TensorView::new(Dtype::F16, shape.clone(), bytes).map(|view| (name.as_str(), view))
        })
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| Error::Invalid(format!("building a safetensors view: {e}")))?;
    let weights_path = dir.join("model.safetensors");
    write_atomically(&weights_path, |partial| {
        safetensors::serialize_to_file(views, None, partial).map_err(|e| Error::Weights {
            path: partial.to_path_buf(),
            message: format!("writing safetensors: {e}"),
        })
    })?;

    save_config(dir, config)
}

/// Writes `config.json` alone into `dir`, creating it: enough for another
/// engine to draw random weights of the same shape where writing them would
/// take longer than measuring (`scripts/bench_transformers.py
/// --random-weights`).
pub fn save_config(dir: &Path, config: &ModelConfig) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(write_error(dir))?;
    let config_path = dir.join("config.json");
    let text = serde_json::to_string_pretty(&config_json(config))
        .map_err(|e| Error::Invalid(format!("serializing config.json: {e}")))?;
    write_atomically(&config_path, |partial| {
        std::fs::write(partial, text).map_err(write_error(partial))
    })
}

/// Hugging Face names, shapes and f16 bytes of every weight.
fn named_f16_tensors(config: &ModelConfig, w: &Weights) -> Vec<(String, Vec<usize>, Vec<u8>)> {
    let vector = |name: String, v: &[f32]| (name, vec![v.len()], f16_bytes(v));
    let matrix = |name: String, m: &Matrix| (name, vec![m.rows, m.cols], f16_bytes(&m.f32()));
    let mut out = vec![matrix("model.embed_tokens.weight".into(), &w.embed)];
    for (l, layer) in w.layers.iter().enumerate() {
        let p = format!("model.layers.{l}");
        out.extend([
            vector(format!("{p}.input_layernorm.weight"), &layer.attn_norm),
            matrix(format!("{p}.self_attn.q_proj.weight"), &layer.wq),
            matrix(format!("{p}.self_attn.k_proj.weight"), &layer.wk),
            matrix(format!("{p}.self_attn.v_proj.weight"), &layer.wv),
            matrix(format!("{p}.self_attn.o_proj.weight"), &layer.wo),
            vector(
                format!("{p}.post_attention_layernorm.weight"),
                &layer.mlp_norm,
            ),
            matrix(format!("{p}.mlp.gate_proj.weight"), &layer.w_gate),
            matrix(format!("{p}.mlp.up_proj.weight"), &layer.w_up),
            matrix(format!("{p}.mlp.down_proj.weight"), &layer.w_down),
        ]);
        if let Some(bias) = &layer.qkv_bias {
            let (q, kv) = (layer.wq.rows, layer.wk.rows);
            out.extend([
                vector(format!("{p}.self_attn.q_proj.bias"), &bias[..q]),
                vector(format!("{p}.self_attn.k_proj.bias"), &bias[q..q + kv]),
                vector(format!("{p}.self_attn.v_proj.bias"), &bias[q + kv..]),
            ]);
        }
    }
    out.push(vector("model.norm.weight".into(), &w.final_norm));
    if let (false, Some(head)) = (config.tie_word_embeddings, &w.lm_head) {
        out.push(matrix("lm_head.weight".into(), head));
    }
    out
}

fn f16_bytes(values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&x| f16::from_f32(x).to_le_bytes())
        .collect()
}

/// The error of a failed write of `path`.
fn write_error(path: &Path) -> impl FnOnce(std::io::Error) -> Error {
    let path = path.to_path_buf();
    move |error| Error::WriteFile { path, error }
}

/// Runs `write` on `<path>.partial`, then renames it to `path`; removes the
/// partial file if writing fails.
fn write_atomically(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let mut partial = PathBuf::from(path);
    partial.as_mut_os_string().push(".partial");
    let result =
        write(&partial).and_then(|()| std::fs::rename(&partial, path).map_err(write_error(path)));
    if result.is_err() {
        let _ = std::fs::remove_file(&partial);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Model, random_weights};

    #[test]
    fn a_saved_config_alone_reads_back_equal() {
        let (config, _) = crate::model::preset("llama-3.1-8b").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let folder = dir.path().join("8b");
        save_config(&folder, &config).unwrap();
        let text = std::fs::read_to_string(folder.join("config.json")).unwrap();
        assert_eq!(ModelConfig::from_json(&text).unwrap(), config);
        let names: Vec<_> = std::fs::read_dir(&folder)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["config.json"], "no weights, no partial file");
        // A folder that cannot be made is named as a write, not a read.
        let file = dir.path().join("a-file");
        std::fs::write(&file, b"").unwrap();
        let error = save_config(&file.join("8b"), &config)
            .unwrap_err()
            .to_string();
        assert!(error.starts_with("cannot write"), "{error}");
        assert!(error.contains("a-file"), "{error}");
    }

    #[test]
    fn a_saved_model_loads_back_as_its_f16_rounding() {
        let model = Model::embedded();
        let mut config = model.config.clone();
        config.tie_word_embeddings = false;
        config.rope_scaling = Some(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 128.0,
        });
        let weights = random_weights(&config, 7);
        let dir = tempfile::tempdir().unwrap();
        save_f16(dir.path(), &config, &weights).unwrap();

        let text = std::fs::read_to_string(dir.path().join("config.json")).unwrap();
        assert_eq!(ModelConfig::from_json(&text).unwrap(), config);
        // A count, as transformers requires.
        let json: serde_json::Value = serde_json::from_str(&text).unwrap();
        let original = &json["rope_scaling"]["original_max_position_embeddings"];
        assert!(original.is_u64(), "{original}");
        let loaded = crate::weights::load_dir(dir.path(), &config).unwrap();
        let round =
            |v: &[f32]| -> Vec<f32> { v.iter().map(|&x| f16::from_f32(x).to_f32()).collect() };
        assert_eq!(loaded.embed.f32(), round(&weights.embed.f32()));
        assert_eq!(
            loaded.layers[1].w_down.f32(),
            round(&weights.layers[1].w_down.f32())
        );
        assert_eq!(
            loaded.lm_head.unwrap().f32(),
            round(&weights.lm_head.unwrap().f32())
        );
        let leftovers: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .filter(|n| n.to_string_lossy().ends_with(".partial"))
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
    }
}
