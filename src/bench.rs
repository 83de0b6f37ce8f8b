//! What the `kiln-bench-*` programs share: the models they measure and how
//! they exit.

use std::path::Path;

use anyhow::Result;
use kiln_core::gguf::GgmlType;
use kiln_core::tokenizer::ByteTokenizer;
use kiln_core::weights::Stored;
use kiln_core::{Model, ModelConfig, Tokenizer};

/// A benchmark's exit: success, or its error printed with its causes.
pub fn exit_code(result: Result<()>) -> std::process::ExitCode {
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// The model `spec` names: `embedded`, a random-weight preset
/// (`tinyllama-1.1b`, …; with `-q8_0` after its name, every matrix rounded
/// to Q8_0 blocks, see [`q8_0`]), a GGUF file or pulled model's name, or a
/// model folder (read with the byte tokenizer, see [`load_folder`]).
pub fn model(spec: &str) -> Result<Model> {
    if let Some((config, seed)) = q8_0_preset(spec) {
        return q8_0(Model::random(spec, config, seed));
    }
    Ok(match (spec, kiln_core::model::preset(spec)) {
        ("embedded", _) => Model::embedded(),
        (_, Some((config, seed))) => Model::random(spec, config, seed),
        (spec, None) => {
            let path = kiln_core::pinned::resolve(Path::new(spec))?;
            match path.is_file() {
                true => Model::load(&path)?,
                false => load_folder(&path)?,
            }
        }
    })
}

/// A model folder's config and weights, with the byte tokenizer (the
/// benchmarks feed token ids, so `--write-model` folders carry none).
pub fn load_folder(dir: &Path) -> Result<Model> {
    let config = ModelConfig::from_file(&dir.join("config.json"))?;
    let weights = kiln_core::weights::load_dir(dir, &config)?;
    Ok(Model {
        name: dir.display().to_string(),
        config,
        weights,
        tokenizer: Tokenizer::Bytes(ByteTokenizer),
        chat: Default::default(),
    })
}

/// The preset a `NAME-q8_0` spec names.
fn q8_0_preset(spec: &str) -> Option<(ModelConfig, u64)> {
    kiln_core::model::preset(spec.strip_suffix("-q8_0")?)
}

/// `model` with every matrix (the embedding too) as a Q8_0 file of it would
/// store it (llama.cpp's quantizer): what `cpu-simd` and IREE's q8 keep as
/// Q8_0 blocks, for measuring those paths where no Q8_0 file is at hand.
pub fn q8_0(mut model: Model) -> Result<Model> {
    model.weights = kiln_core::gguf::quantize_weights(&model.weights, GgmlType::Q8_0)
        .map_err(|e| anyhow::anyhow!("{}: {e}", model.name))?;
    Ok(model)
}

/// The configuration of a model spec, without making its weights, and how
/// it stores its matrices where that is known without loading them: a GGUF
/// file's blocks (read from its tensor types), a `-q8_0` preset's Q8_0, a
/// preset's f32; `None` for a folder (safetensors, whose f32, f16 or bf16
/// matrices no precision keeps as blocks).
pub fn header(spec: &str) -> Result<(ModelConfig, Option<Stored>)> {
    if let Some((config, _)) = q8_0_preset(spec) {
        return Ok((config, Some(Stored::Blocks("Q8_0"))));
    }
    Ok(match (spec, kiln_core::model::preset(spec)) {
        ("embedded", _) => {
            let model = Model::embedded();
            (model.config, Some(model.weights.stored))
        }
        (_, Some((config, _))) => (config, Some(Stored::F32)),
        (spec, None) => {
            let path = kiln_core::pinned::resolve(Path::new(spec))?;
            match path.is_file() {
                true => {
                    let file = kiln_core::gguf::GgufFile::open(&path)?;
                    let config = kiln_core::gguf::model_config(&file)?;
                    let stored = kiln_core::gguf::stored_kind(&file, config.num_layers);
                    (config, Some(stored))
                }
                false => (ModelConfig::from_file(&path.join("config.json"))?, None),
            }
        }
    })
}
