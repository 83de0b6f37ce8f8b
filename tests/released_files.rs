//! kiln against files the model families' makers released, carried in a
//! pinned archive (`reference_files` in nix/pins.json: llama-cpp-python's
//! source distribution, which vendors llama.cpp's copies): the vocabularies
//! of Llama 3 (`llama-bpe`), Qwen2 and Llama 2's SentencePiece, each with the
//! inputs and the token ids Hugging Face's tokenizers gave for them (made by
//! llama.cpp's `convert_hf_to_gguf_update.py`), and the chat templates of
//! Llama 3.1 and 3.2, Qwen2.5 and Mistral NeMo.
//!
//! `cargo xtask test` unpacks them and sets `KILN_REFERENCE_FILES` (and
//! `KILN_JINJA_PYTHON`, a Python with the pinned Jinja2, which renders the
//! templates as transformers does); without them these tests skip and say
//! so, and with `KILN_REQUIRE_MODELS=1` (CI) they fail instead.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use kiln_core::Tokenizer;
use kiln_core::chat_template::{ChatTemplate, Message};
use kiln_core::gguf::{GgufFile, tokenizer_from_gguf};
use kiln_core::testing::skip_unless_required;
use serde_json::{Value, json};

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
    skip_unless_required(reason)
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

/// The conversations each released template renders: a lone question, a
/// system turn and a finished exchange (with and without the generation
/// prompt), and text beyond ASCII.
fn conversations() -> Vec<(Vec<Message>, bool)> {
    let exchange = vec![
        Message::new("system", "You are terse."),
        Message::new("user", "Hi"),
        Message::new("assistant", "Hello."),
        Message::new("user", "What is the capital of France?"),
    ];
    vec![
        (vec![Message::new("user", "What is 2 + 2?")], true),
        (exchange.clone(), true),
        (exchange, false),
        (
            vec![Message::new("user", "Où est Paris ? ça va 東京")],
            true,
        ),
    ]
}

/// Jinja2's rendering of `template` (a reference file) for each
/// conversation, through scripts/chat_template_reference.py: the text, or
/// `{"error": ...}`.
fn jinja2_renders(template: &PathBuf, bos: &str, eos: &str) -> Option<Vec<Value>> {
    let Some(python) = std::env::var_os("KILN_JINJA_PYTHON") else {
        return skip_unless_required(
            "KILN_JINJA_PYTHON is unset (`cargo xtask test` sets it to a Python with the \
             pinned Jinja2)"
                .into(),
        );
    };
    let script =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/chat_template_reference.py");
    let cases: Vec<Value> = conversations()
        .into_iter()
        .map(|(messages, add_generation_prompt)| {
            json!({"messages": messages, "add_generation_prompt": add_generation_prompt})
        })
        .collect();
    let request = json!({"bos_token": bos, "eos_token": eos, "cases": cases});
    let mut child = Command::new(python)
        .arg(script)
        .arg("--render")
        .arg(template)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(request.to_string().as_bytes()).unwrap();
    drop(stdin);
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "chat_template_reference.py --render failed"
    );
    Some(serde_json::from_slice(&out.stdout).unwrap())
}

/// kiln renders the released `template` as Jinja2 does (as transformers'
/// `apply_chat_template` does), conversation by conversation.
fn renders_as_jinja2(template: &str, bos: &str, eos: &str) {
    let Some(path) = reference_file(template) else {
        return;
    };
    let Some(expected) = jinja2_renders(&path, bos, eos) else {
        return;
    };
    let source = std::fs::read_to_string(&path).unwrap();
    let kiln = ChatTemplate::new(template, &source, bos, eos).unwrap_or_else(|e| panic!("{e}"));
    for ((messages, generation), expected) in conversations().iter().zip(&expected) {
        let rendered = kiln.render(messages, *generation);
        match (expected.as_str(), rendered) {
            (Some(text), Ok(rendered)) => assert_eq!(
                rendered,
                text,
                "{template}, {} messages, generation prompt {generation}",
                messages.len()
            ),
            (None, Err(_)) => {}
            (_, rendered) => panic!(
                "{template}, {} messages: Jinja2 gave {expected}, kiln {rendered:?}",
                messages.len()
            ),
        }
    }
    println!(
        "{template}: {} conversations as Jinja2 renders them",
        expected.len()
    );
}

#[test]
fn llama_3_1_template_renders_as_jinja2_does() {
    renders_as_jinja2(
        "meta-llama-Llama-3.1-8B-Instruct.jinja",
        "<|begin_of_text|>",
        "<|eot_id|>",
    );
}

#[test]
fn llama_3_2_template_renders_as_jinja2_does() {
    renders_as_jinja2(
        "meta-llama-Llama-3.2-3B-Instruct.jinja",
        "<|begin_of_text|>",
        "<|eot_id|>",
    );
}

#[test]
fn qwen2_5_template_renders_as_jinja2_does() {
    renders_as_jinja2("Qwen-Qwen2.5-7B-Instruct.jinja", "", "<|im_end|>");
}

#[test]
fn mistral_nemo_template_renders_as_jinja2_does() {
    renders_as_jinja2("mistralai-Mistral-Nemo-Instruct-2407.jinja", "<s>", "</s>");
}

/// A reply ends at the special token each released template writes after
/// the assistant's text, whatever the vocabulary's EOS: llama.cpp's Llama 3
/// vocabulary (from the base model) has `<|end_of_text|>` for EOS while the
/// instruct templates end turns with `<|eot_id|>`; without it `kiln chat`
/// and `kiln-server` would go on into turns the model invents.
#[test]
fn replies_stop_where_each_released_template_ends_a_turn() {
    let cases = [
        (
            "ggml-vocab-llama-bpe.gguf",
            "meta-llama-Llama-3.1-8B-Instruct.jinja",
            "<|eot_id|>",
        ),
        (
            "ggml-vocab-llama-bpe.gguf",
            "meta-llama-Llama-3.2-3B-Instruct.jinja",
            "<|eot_id|>",
        ),
        (
            "ggml-vocab-qwen2.gguf",
            "Qwen-Qwen2.5-7B-Instruct.jinja",
            "<|im_end|>",
        ),
        (
            "ggml-vocab-llama-spm.gguf",
            "mistralai-Mistral-Nemo-Instruct-2407.jinja",
            "</s>",
        ),
    ];
    for (vocab, template, end_of_turn) in cases {
        let (Some(vocab_path), Some(template_path)) =
            (reference_file(vocab), reference_file(template))
        else {
            return;
        };
        let file = GgufFile::open(&vocab_path).unwrap();
        let (tokenizer, chat) = tokenizer_from_gguf(&file).unwrap();
        let tokenizer = Tokenizer::from_hugging_face(tokenizer);
        // The template's bos_token and eos_token as kiln spells a GGUF
        // file's (`kiln chat --model FILE`).
        let spell = |id: Option<u32>| {
            id.and_then(|id| tokenizer.vocabulary_entry(id))
                .unwrap_or_default()
        };
        let source = std::fs::read_to_string(&template_path).unwrap();
        let template =
            ChatTemplate::new(template, &source, &spell(chat.bos), &spell(chat.eos)).unwrap();
        let stops = kiln_core::chat::stop_tokens(&tokenizer, &chat.stop_ids(), &template);
        let want = tokenizer.token_to_id(end_of_turn).unwrap();
        assert!(
            stops.contains(&want),
            "{template:?} with {vocab}: stops {stops:?} lack {end_of_turn} ({want})"
        );
        println!(
            "{vocab} + {:?}: stops at {stops:?}",
            template_path.file_name().unwrap()
        );
    }
}
