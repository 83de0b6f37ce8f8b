//! Fixtures for tests of kiln and of the crates that use it (the `testing`
//! feature): small tokenizers of the two kinds real Llama models use —
//! GPT-2 style byte-level BPE and SentencePiece BPE with byte fallback — and
//! a model folder whose greedy generation follows a given table, so that a
//! test can make the real CLI generate exactly the ids it needs.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use crate::config::ModelConfig;
use crate::error::Result;
use crate::tokenizer::Tokenizer;
use crate::weights::{LayerWeights, Matrix, Weights};

/// The file of a pulled pinned model, for tests that need a real one. When it
/// is not pulled the test skips and says why, unless `KILN_REQUIRE_MODELS=1`
/// (as in CI), where a missing model is a failure.
pub fn pulled_model(name: &str) -> Option<PathBuf> {
    let path = crate::pinned::find(name).unwrap().path().unwrap();
    if path.is_file() {
        return Some(path);
    }
    skip_unless_required(format!(
        "{} is not pulled (run `cargo run -- pull {name}`)",
        path.display()
    ))
}

/// `None` for a test whose outside input is missing, saying `reason`; a
/// failure instead where `KILN_REQUIRE_MODELS=1` (CI) says the inputs must
/// be there.
pub fn skip_unless_required<T>(reason: String) -> Option<T> {
    if std::env::var_os("KILN_REQUIRE_MODELS").is_some_and(|v| v == "1") {
        panic!("KILN_REQUIRE_MODELS=1 but {reason}");
    }
    eprintln!("skipped: {reason}");
    None
}

/// The model folders under `KILN_WIDE_FIXTURES`: each family at its real
/// widths (`scripts/make_fixture.py DIR qwen2.5-0.5b-wide ...`, too large to
/// commit), made where the tests run. Empty, saying why, when it is unset.
pub fn wide_fixtures() -> Vec<PathBuf> {
    let Some(root) = std::env::var_os("KILN_WIDE_FIXTURES") else {
        eprintln!("skipped: KILN_WIDE_FIXTURES is unset (scripts/make_fixture.py makes them)");
        return Vec::new();
    };
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("KILN_WIDE_FIXTURES: {e}"))
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("reference.json").is_file())
        .collect();
    dirs.sort();
    assert!(!dirs.is_empty(), "KILN_WIDE_FIXTURES has no fixture");
    dirs
}

/// The largest absolute difference between two equally long slices, with a
/// NaN anywhere (in either, or from infinities) counted as infinite: folding
/// with `f32::max` alone drops NaNs, and NaN logits from a GPU kernel then
/// compared as 0 apart from the reference's.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            let difference = (x - y).abs();
            if difference.is_nan() {
                f32::INFINITY
            } else {
                difference
            }
        })
        .fold(0.0, f32::max)
}

/// A kiln tokenizer from `tokenizer.json` text.
pub fn tokenizer(json: &Value) -> Tokenizer {
    let tokenizer: tokenizers::Tokenizer = json.to_string().parse().unwrap();
    Tokenizer::HuggingFace(Box::new(tokenizer))
}

fn special(id: u32, content: &str) -> Value {
    json!({"id": id, "content": content, "single_word": false, "lstrip": false,
           "rstrip": false, "normalized": false, "special": true})
}

/// GPT-2's byte-to-character map, in its vocabulary order: printable bytes
/// stand for themselves, the others for U+0100 onwards.
fn byte_chars() -> Vec<char> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xa1..=0xac | 0xae..=0xff);
    let mut chars: Vec<char> = (0..=255u8)
        .filter(|&b| printable(b))
        .map(char::from)
        .collect();
    let others = (0..=255u8).filter(|&b| !printable(b)).count() as u32;
    chars.extend((0..others).map(|n| char::from_u32(256 + n).unwrap()));
    chars
}

/// A byte-level BPE's `tokenizer.json` as the `tokenizers` trainer makes
/// one: the special tokens (ids from 0), the 256 byte characters in
/// code-point order, then 62 two-letter merges, "as" the 53rd of them.
pub fn byte_level_json(specials: &[&str]) -> Value {
    let mut vocab = serde_json::Map::new();
    for (i, s) in specials.iter().enumerate() {
        vocab.insert((*s).into(), json!(i));
    }
    let first_byte = specials.len();
    for (i, c) in byte_chars().into_iter().enumerate() {
        vocab.insert(c.to_string(), json!(first_byte + i));
    }
    let letters = "etaoinshrdl";
    let mut pairs: Vec<String> = letters
        .chars()
        .flat_map(|a| letters.chars().map(move |b| format!("{a}{b}")))
        .filter(|p| p != "as")
        .take(61)
        .collect();
    pairs.insert(52, "as".into());
    let mut merges = Vec::new();
    for (i, pair) in pairs.iter().enumerate() {
        vocab.insert(pair.clone(), json!(first_byte + 256 + i));
        merges.push(format!("{} {}", &pair[..1], &pair[1..]));
    }
    let added: Vec<Value> = (0..).zip(specials).map(|(i, s)| special(i, s)).collect();
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false,
                            "trim_offsets": true, "use_regex": true});
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": byte_level,
        "post_processor": null,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": merges},
    })
}

/// The 320-token byte-level BPE of the streaming bug report: two special
/// tokens, so ids 139, 154, 103 and 44 are the bytes 0xCD, 0xDC, 0xA8 and
/// `K`, and id 310 is "as".
pub fn byte_level_320() -> Tokenizer {
    tokenizer(&byte_level_json(&["<|endoftext|>", "<|im_start|>"]))
}

/// A Llama-2 style SentencePiece BPE: `<unk>`, `<s>`, `</s>` (0..=2), the
/// byte tokens `<0x00>`..`<0xFF>` (3..=258), then 11 pieces (259..=269);
/// `<s>` is added in front of every encoding.
pub fn sentencepiece_byte_fallback() -> Tokenizer {
    let mut vocab = serde_json::Map::new();
    for (i, t) in ["<unk>", "<s>", "</s>"].iter().enumerate() {
        vocab.insert((*t).into(), json!(i));
    }
    for b in 0..=255u32 {
        vocab.insert(format!("<0x{b:02X}>"), json!(3 + b));
    }
    let pieces = ["▁", "A", "▁A", "t", "h", "▁t", "▁th", "é", "▁é", "x", "y"];
    for (i, p) in pieces.iter().enumerate() {
        vocab.insert((*p).into(), json!(259 + i));
    }
    tokenizer(&json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [special(0, "<unk>"), special(1, "<s>"), special(2, "</s>")],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
        "pre_tokenizer": null,
        "post_processor": {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>",
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                  "vocab": vocab, "merges": ["▁ A", "▁ t", "▁t h", "▁ é"]},
    }))
}

/// Writes a model folder (`config.json`, `model.safetensors`,
/// `tokenizer.json`) whose greedy next token after `t` is `next[t]` whatever
/// came before: one layer whose attention and MLP add nothing, one-hot
/// embeddings, and an output row per token that picks its predecessors.
pub fn successor_model(
    dir: &Path,
    tokenizer_json: &Value,
    next: &[u32],
    eos_token_ids: Vec<u32>,
) -> Result<()> {
    let vocab = next.len();
    // One-hot embeddings need hidden >= vocab; 4 heads of an even size.
    let hidden = vocab.div_ceil(8) * 8;
    let config = ModelConfig {
        hidden_size: hidden,
        intermediate_size: 8,
        num_layers: 1,
        num_heads: 4,
        num_kv_heads: 4,
        head_dim: hidden / 4,
        vocab_size: vocab,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        rope_scaling: None,
        tie_word_embeddings: false,
        max_position_embeddings: 1024,
        sliding_window: None,
        qkv_bias: false,
        family: crate::config::Family::Llama,
        bos_token_id: None,
        eos_token_ids,
    };
    let zeros = |rows, cols| Matrix::new(rows, cols, vec![0.0; rows * cols]);
    let mut embed = zeros(vocab, hidden);
    let mut lm_head = zeros(vocab, hidden);
    for (t, &n) in next.iter().enumerate() {
        embed.f32_mut()[t * hidden + t] = 1.0;
        lm_head.f32_mut()[n as usize * hidden + t] = 1.0;
    }
    let layer = LayerWeights {
        attn_norm: vec![1.0; hidden],
        wq: zeros(hidden, hidden),
        wk: zeros(hidden, hidden),
        wv: zeros(hidden, hidden),
        wo: zeros(hidden, hidden),
        mlp_norm: vec![1.0; hidden],
        w_gate: zeros(8, hidden),
        w_up: zeros(8, hidden),
        w_down: zeros(hidden, 8),
        qkv_bias: None,
    };
    let weights = Weights {
        embed,
        layers: vec![layer],
        final_norm: vec![1.0; hidden],
        lm_head: Some(lm_head),
        stored: crate::weights::Stored::F32,
    };
    crate::save::save_f16(dir, &config, &weights)?;
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, tokenizer_json.to_string())
        .map_err(|error| crate::Error::WriteFile { path, error })
}

/// The ChatML specials of [`chatml_model`]'s vocabulary, ids 0, 1, 2.
pub const CHATML_SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// Writes a model folder over a byte-level ChatML vocabulary
/// ([`CHATML_SPECIALS`]) that, after a newline (where a ChatML prompt ends),
/// answers "Hi" and then `<|im_end|>`; it would go on with "!" forever.
/// `config.json`'s EOS is `<|endoftext|>` only. With `chat_template`, a
/// `tokenizer_config.json` carries it, with `<|im_start|>` and `<|im_end|>`
/// as BOS and EOS, as SmolLM2's does.
pub fn chatml_model(dir: &Path, chat_template: Option<&str>) -> Result<()> {
    let tokenizer = byte_level_json(&CHATML_SPECIALS);
    let byte = |b: u8| 3 + u32::from(b - b'!');
    // 0x0a is the 11th of the bytes GPT-2 maps past the 188 printable ones.
    let newline = 3 + 188 + 10;
    let mut next = vec![byte(b'!'); 3 + 256 + 62];
    next[newline] = byte(b'H');
    next[byte(b'H') as usize] = byte(b'i');
    next[byte(b'i') as usize] = 2;
    successor_model(dir, &tokenizer, &next, vec![0])?;
    if let Some(template) = chat_template {
        let config = json!({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                            "chat_template": template});
        let path = dir.join("tokenizer_config.json");
        std::fs::write(&path, config.to_string())
            .map_err(|error| crate::Error::WriteFile { path, error })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::max_abs_diff;

    #[test]
    fn a_nan_is_never_close() {
        assert_eq!(max_abs_diff(&[1.0, 2.0], &[1.5, 2.0]), 0.5);
        for (a, b) in [
            ([1.0, f32::NAN], [1.0, 2.0]),
            ([1.0, f32::NAN], [1.0, f32::NAN]),
            ([f32::INFINITY, 0.0], [f32::INFINITY, 0.0]),
            ([f32::NEG_INFINITY, 0.0], [0.0, 0.0]),
        ] {
            assert_eq!(max_abs_diff(&a, &b), f32::INFINITY, "{a:?} {b:?}");
        }
    }
}
