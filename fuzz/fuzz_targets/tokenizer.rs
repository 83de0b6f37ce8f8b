//! tokenizer.json: any bytes are a tokenizer or an error, and a tokenizer
//! encodes and decodes a prompt or reports an error, never panics.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(tokenizer) = kiln_core::Tokenizer::from_json(Path::new("tokenizer.json"), data) else {
        return;
    };
    for prompt in ["Hello, kiln!", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa!", "t1 t2 t3"] {
        if let Ok(ids) = tokenizer.encode(prompt) {
            let _ = tokenizer.decode(&ids);
        }
    }
});
