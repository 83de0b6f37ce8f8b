//! kiln against files the model families' makers released, carried in a
//! pinned archive (`reference_files` in nix/pins.json: llama-cpp-python's
//! source distribution, which vendors llama.cpp's copies): the vocabularies
//! of Llama 3 (`llama-bpe`), Qwen2 and Llama 2's SentencePiece, each with the
//! inputs and the token ids Hugging Face's tokenizers gave for them (made by
//! llama.cpp's `convert_hf_to_gguf_update.py`), and the chat templates of
//! Llama 3.1 and 3.2, Qwen2.5 and Mistral NeMo, and llama.cpp's own
//! chat-template tests (Mistral 7B's templates with the text each must
//! render); and (`mistral-common`'s
//! source distribution) Mistral 7B v0.3's v3 SentencePiece model, with the
//! ids SentencePiece gives in tests/fixtures/mistral-v3-ids.json.
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

#[path = "common/gguf_writer.rs"]
mod gguf_writer;
#[path = "common/reference_files.rs"]
mod reference_files;
use gguf_writer::{V, Writer, sentencepiece_vocabulary};
use reference_files::{MISTRAL_V3_TEMPLATE_CASE, llama_cpp_template_case, reference_file};

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

/// As much of SentencePiece's model file (`sentencepiece_model.proto`) as a
/// vocabulary needs: its pieces.
#[derive(Clone, PartialEq, prost::Message)]
struct SentencePieceModel {
    #[prost(message, repeated, tag = "1")]
    pieces: Vec<SentencePiece>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct SentencePiece {
    #[prost(string, optional, tag = "1")]
    piece: Option<String>,
    #[prost(float, optional, tag = "2")]
    score: Option<f32>,
    /// NORMAL 1 (the default), UNKNOWN 2, CONTROL 3, USER_DEFINED 4,
    /// UNUSED 5, BYTE 6: the numbers GGUF's token types use too.
    #[prost(int32, optional, tag = "3")]
    kind: Option<i32>,
}

/// A vocabulary-only GGUF file of a SentencePiece model, with the keys
/// llama.cpp's converter writes for one (BOS added).
fn sentencepiece_as_gguf(model: &SentencePieceModel) -> Vec<u8> {
    let mut w = Writer::default();
    w.kv("general.architecture", V::Str("llama"));
    sentencepiece_vocabulary(
        &mut w,
        model
            .pieces
            .iter()
            .map(|p| p.piece.clone().unwrap_or_default())
            .collect(),
        model.pieces.iter().map(|p| p.kind.unwrap_or(1)).collect(),
        model
            .pieces
            .iter()
            .map(|p| p.score.unwrap_or(0.0))
            .collect(),
    )
    .kv("tokenizer.ggml.add_bos_token", V::Bool(true));
    w.bytes()
}

/// Mistral 7B v0.3's vocabulary, as llama.cpp's converter puts its v3
/// SentencePiece model into a GGUF file, tokenizes every input of
/// llama.cpp's SentencePiece test file and kiln's own to the ids
/// SentencePiece — the library Mistral's own tokenizer runs — gives
/// (tests/fixtures/mistral-v3-ids.json, from scripts/mistral_v3_ids.py),
/// and reads each instruct control token's text as that token, as the ids
/// Mistral's tokenizer writes for a conversation have them.
#[test]
fn mistral_v3_vocabulary_tokenizes_as_sentencepiece_does() {
    let fixture: Value =
        serde_json::from_str(include_str!("fixtures/mistral-v3-ids.json")).unwrap();
    let name = fixture["model"].as_str().unwrap();
    let (Some(model_path), Some(inputs_path)) = (
        reference_file(name),
        reference_file(fixture["inputs_file"].as_str().unwrap()),
    ) else {
        return;
    };
    // The ids were made with the pinned model.
    let pins: Value = serde_json::from_str(include_str!("../nix/pins.json")).unwrap();
    let pinned = pins["reference_files"]
        .as_object()
        .unwrap()
        .values()
        .filter_map(|archive| archive["members"].as_object())
        .flat_map(|members| members.iter())
        .find(|(member, _)| member.ends_with(&format!("/{name}")))
        .map(|(_, sha256)| sha256.as_str().unwrap())
        .unwrap();
    assert_eq!(fixture["model_sha256"].as_str().unwrap(), pinned);

    let bytes = std::fs::read(&model_path).unwrap();
    let model = <SentencePieceModel as prost::Message>::decode(bytes.as_slice()).unwrap();
    assert_eq!(model.pieces.len(), 32_768, "the v3 vocabulary");
    let dir = tempfile::tempdir().unwrap();
    let gguf = dir.path().join("mistral-v3-vocabulary.gguf");
    std::fs::write(&gguf, sentencepiece_as_gguf(&model)).unwrap();
    let file = GgufFile::open(&gguf).unwrap();
    let (tokenizer, format) = tokenizer_from_gguf(&file).unwrap();
    assert_eq!((format.bos, format.eos), (Some(1), Some(2)));
    let tokenizer = Tokenizer::from_hugging_face(tokenizer);

    let texts = std::fs::read_to_string(&inputs_path).unwrap();
    let mut texts: Vec<&str> = texts.split("\n__ggml_vocab_test__\n").collect();
    assert_eq!(texts.pop(), Some(""), "the inputs end with a separator");
    let ids = |v: &Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|id| id.as_u64().unwrap() as u32)
            .collect()
    };
    let mut cases: Vec<(String, Vec<u32>)> = texts
        .iter()
        .zip(fixture["inputs"].as_array().unwrap())
        .map(|(text, expected)| (text.to_string(), ids(expected)))
        .collect();
    assert_eq!(cases.len(), fixture["inputs"].as_array().unwrap().len());
    for own in fixture["own"].as_array().unwrap() {
        cases.push((own["text"].as_str().unwrap().to_string(), ids(&own["ids"])));
    }
    let mut wrong = Vec::new();
    for (text, expected) in &cases {
        let got = tokenizer.encode_rendered(text).unwrap();
        if &got != expected {
            wrong.push(format!(
                "{text:?}: kiln {got:?}, SentencePiece {expected:?}"
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "{} of {} inputs differ:\n{}",
        wrong.len(),
        cases.len(),
        wrong.join("\n")
    );
    for (text, id) in [("[INST]", 3u32), ("[/INST]", 4), ("[TOOL_CALLS]", 5)] {
        assert_eq!(tokenizer.encode_rendered(text).unwrap(), vec![id], "{text}");
    }
    println!(
        "Mistral v3 vocabulary: {} inputs tokenized as SentencePiece's",
        cases.len()
    );
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
    file_renders_as_jinja2(template, &path, bos, eos);
}

/// [`renders_as_jinja2`] for the template in the file at `path`.
fn file_renders_as_jinja2(template: &str, path: &PathBuf, bos: &str, eos: &str) {
    let Some(expected) = jinja2_renders(path, bos, eos) else {
        return;
    };
    let source = std::fs::read_to_string(path).unwrap();
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

/// Mistral 7B's released templates, as llama.cpp's tests carry them: v0.2's
/// first (no system turn), v0.2's later one (a system turn before the first
/// question) and the `v3` template Mistral ships with its v3 tokenizer
/// (Mistral-7B-Instruct-v0.3's; the copy is Mistral-Large-Instruct-2407's,
/// the other model of that tokenizer, with tools and the system turn before
/// the last question). kiln renders llama.cpp's conversation to the text
/// llama.cpp's tests expect, and kiln's conversations as Jinja2 does.
#[test]
fn mistral_7b_templates_render_as_llama_cpp_and_jinja2_do() {
    let cases = [
        (
            "mistralai/Mistral-7B-Instruct-v0.2 (NOTE: Old pre-v1 without a system prompt)",
            "mistral-7b-v0.2.jinja",
            false,
        ),
        (
            "mistralai/Mistral-7B-Instruct-v0.2 (mistralai 'v1' template with a system prompt)",
            "mistral-7b-v0.2-system.jinja",
            true,
        ),
        (MISTRAL_V3_TEMPLATE_CASE, "mistral-v3.jinja", true),
    ];
    let conversation = [
        ("system", "You are a helpful assistant"),
        ("user", "Hello"),
        ("assistant", "Hi there"),
        ("user", "Who are you"),
        ("assistant", "   I am an assistant   "),
        ("user", "Another question"),
    ]
    .map(|(role, content)| Message::new(role, content));
    let dir = tempfile::tempdir().unwrap();
    for (name, file, takes_system) in cases {
        let Some(case) = llama_cpp_template_case(name) else {
            return;
        };
        let template = ChatTemplate::new(file, &case.template, &case.bos, &case.eos)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let as_given = template.render(&conversation, true);
        let rendered = if takes_system {
            as_given.unwrap_or_else(|e| panic!("{name}: {e}"))
        } else {
            // The template refuses a system turn (as Jinja2 does: it raises);
            // llama.cpp then puts the system text before the first question.
            assert!(as_given.is_err(), "{name}: a system turn was taken");
            let mut merged = conversation[1..].to_vec();
            merged[0].content = format!("{}\n{}", conversation[0].content, merged[0].content);
            template
                .render(&merged, true)
                .unwrap_or_else(|e| panic!("{name}: {e}"))
        };
        assert_eq!(
            rendered, case.expected,
            "{name}: as llama.cpp's tests expect"
        );

        let path = dir.path().join(file);
        std::fs::write(&path, &case.template).unwrap();
        file_renders_as_jinja2(file, &path, "<s>", "</s>");
    }
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
