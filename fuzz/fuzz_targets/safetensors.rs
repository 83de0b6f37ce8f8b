//! Safetensors weights: any bytes load as the small Llama of the seed corpus
//! (the test fixture's shape) or are an error.
#![no_main]

use std::path::Path;
use std::sync::OnceLock;

use kiln_core::ModelConfig;
use libfuzzer_sys::fuzz_target;

/// tests/fixtures/llama-gqa-untied's config.
const CONFIG: &str = r#"{"model_type": "llama", "hidden_size": 60, "intermediate_size": 97,
    "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 10,
    "vocab_size": 103, "rms_norm_eps": 1e-5, "max_position_embeddings": 64}"#;

fuzz_target!(|data: &[u8]| {
    static CONFIG_PARSED: OnceLock<ModelConfig> = OnceLock::new();
    let config = CONFIG_PARSED.get_or_init(|| ModelConfig::from_json(CONFIG).unwrap());
    let name = Path::new("model.safetensors");
    let _ = kiln_core::weights::from_safetensors(Path::new("."), &[(name, data)], config);
});
