//! GGUF files: any bytes open as a model (header, metadata, tokenizer, every
//! tensor dequantized) or are an error.
#![no_main]

use std::io::Write;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The reader maps a file, as kiln does with a real model.
    let mut file = tempfile::Builder::new()
        .suffix(".gguf")
        .tempfile()
        .expect("a temporary file");
    file.write_all(data).expect("writing the input");
    let path = file.path();
    if let Ok(gguf) = kiln_core::gguf::GgufFile::open(path) {
        for info in &gguf.tensors {
            let _ = gguf.tensor_f32(info);
        }
    }
    let _ = kiln_core::Model::load(path);
});
