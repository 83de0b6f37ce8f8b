//! config.json: any text is a config that passes its limits, or an error.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(config) = kiln_core::ModelConfig::from_json(text) {
        // A config that passed is one whose sizes kiln can compute with.
        config.validate().expect("from_json returned an invalid config");
        let _ = config.group_size();
        let _ = config.rope_inv_freq();
        let _ = config.rope_tables(config.max_position_embeddings.min(64));
    }
});
