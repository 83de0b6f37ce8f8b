//! kiln against files the model families' makers released, carried in a
//! pinned archive (`reference_files` in nix/pins.json: llama-cpp-python's
//! source distribution, which vendors llama.cpp's copies): the vocabularies
//! of Llama 3 (`llama-bpe`), Qwen2 and Llama 2's SentencePiece, each with the
//! inputs and the token ids Hugging Face's tokenizers gave for them (made by
//! llama.cpp's `convert_hf_to_gguf_update.py`), and the chat templates of
//! Llama 3.1 and 3.2, Qwen2.5 and Mistral NeMo.
//!
//! `cargo xtask test` unpacks them and sets `KILN_REFERENCE_FILES`; without
//! it these tests skip and say so, and with `KILN_REQUIRE_MODELS=1` (CI) they
//! fail instead.

use std::path::PathBuf;

use kiln_core::Tokenizer;
use kiln_core::gguf::{GgufFile, tokenizer_from_gguf};

/// A file of the unpacked reference files, or `None` (saying why) when they
/// are not provided and not required.
fn reference_file(name: &str) -> Option<PathBuf> {
    let reason = match std::env::var_os("KILN_REFERENCE_FILES") {
        Some(dir) => {
            let path = PathBuf::from(dir).join(name);
            if path.is_file() {
                return Some(path);
            }
            format!("{} is missing", path.display())
        }
        None => "KILN_REFERENCE_FILES is unset (`cargo xtask test` unpacks the pinned \
                 reference files and sets it)"
            .to_string(),
    };
    if std::env::var_os("KILN_REQUIRE_MODELS").is_some_and(|v| v == "1") {
        panic!("KILN_REQUIRE_MODELS=1 but {reason}");
    }
    eprintln!("skipped: {reason}");
    None
}

/// The texts of `<vocab>.inp` and the ids of `<vocab>.out`: each text
/// followed by a line `__ggml_vocab_test__`, one line of ids per text.
fn cases(vocab: &str) -> Option<Vec<(String, Vec<u32>)>> {
    let read = |ext: &str| {
        reference_file(&format!("{vocab}.{ext}")).map(|path| std::fs::read_to_string(path).unwrap())
    };
    let (inputs, outputs) = (read("inp")?, read("out")?);
    let mut texts: Vec<&str> = inputs.split("\n__ggml_vocab_test__\n").collect();
    assert_eq!(
        texts.pop(),
        Some(""),
        "{vocab}: the inputs end with a separator"
    );
    let ids: Vec<Vec<u32>> = outputs
        .lines()
        .map(|line| {
            line.split_whitespace()
                .map(|id| id.parse().unwrap())
                .collect()
        })
        .collect();
    assert_eq!(
        texts.len(),
        ids.len(),
        "{vocab}: inputs and outputs pair up"
    );
    Some(texts.into_iter().map(str::to_string).zip(ids).collect())
}

/// Every input of `vocab` encodes, with no special token added, to the ids
/// Hugging Face's tokenizer gave, and those ids decode back to the input.
fn tokenizes_as_hugging_face_does(vocab: &str) {
    let (Some(path), Some(cases)) = (reference_file(vocab), cases(vocab)) else {
        return;
    };
    let file = GgufFile::open(&path).unwrap_or_else(|e| panic!("{vocab}: {e}"));
    let (tokenizer, _) = tokenizer_from_gguf(&file).unwrap_or_else(|e| panic!("{vocab}: {e}"));
    let tokenizer = Tokenizer::from_hugging_face(tokenizer);
    let mut wrong = Vec::new();
    for (text, expected) in &cases {
        let ids = tokenizer.encode_rendered(text).unwrap();
        if &ids != expected {
            wrong.push(format!("{text:?}: kiln {ids:?}, Hugging Face {expected:?}"));
        }
    }
    assert!(
        wrong.is_empty(),
        "{vocab}: {} of {} inputs differ:\n{}",
        wrong.len(),
        cases.len(),
        wrong.join("\n")
    );
    println!(
        "{vocab}: {} inputs tokenized as Hugging Face's",
        cases.len()
    );
}

#[test]
fn llama3_vocabulary_tokenizes_as_hugging_face_does() {
    tokenizes_as_hugging_face_does("ggml-vocab-llama-bpe.gguf");
}

#[test]
fn qwen2_vocabulary_tokenizes_as_hugging_face_does() {
    tokenizes_as_hugging_face_does("ggml-vocab-qwen2.gguf");
}

#[test]
fn llama_sentencepiece_vocabulary_tokenizes_as_hugging_face_does() {
    tokenizes_as_hugging_face_does("ggml-vocab-llama-spm.gguf");
}
