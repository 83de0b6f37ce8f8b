//! The tokenizer a GGUF file describes in its `tokenizer.ggml.*` metadata,
//! built as a `tokenizers::Tokenizer` (the same one a Hugging Face
//! `tokenizer.json` gives), so every model goes through one tokenizer wrapper.
//!
//! `gpt2` is byte-level BPE with the pre-tokenizer `tokenizer.ggml.pre` names;
//! `llama` is SentencePiece BPE: merges ranked by the score of the merged
//! piece, `▁` for spaces and `<0xNN>` byte fallback.

use std::collections::HashMap;

use serde_json::{Value as Json, json};

use super::{GgufFile, Value};
use crate::error::Result;
use crate::model::ChatFormat;

/// llama.cpp's token types (`tokenizer.ggml.token_type`).
const NORMAL: i64 = 1;
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;

/// The GPT-2 split, as `tokenizers`' ByteLevel applies it with `use_regex`.
const PRE_GPT2: &[&str] = &["default", "gpt2", "gpt-2"];
/// llama.cpp's `smollm` and the pre-tokenizers that share its regex: every
/// digit alone, then the GPT-2 split.
const PRE_DIGITS_GPT2: &[&str] = &[
    "smollm",
    "starcoder",
    "refact",
    "command-r",
    "codeshell",
    "exaone",
    "minerva",
];
/// Llama 3's split.
const PRE_LLAMA3: &[&str] = &["llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral"];
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's split: Llama 3's with every digit alone. Hugging Face's Qwen2
/// tokenizers also put text in Unicode NFC first; kiln does as they do.
const PRE_QWEN2: &[&str] = &["qwen2"];
const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The tokenizer of `file`, with its special tokens and chat template.
pub fn tokenizer_from_gguf(file: &GgufFile) -> Result<(tokenizers::Tokenizer, ChatFormat)> {
    let model = file.require_str("tokenizer.ggml.model")?;
    let tokens = string_array(file, "tokenizer.ggml.tokens")?;
    let n = tokens.len();
    let types = match file.get("tokenizer.ggml.token_type") {
        None => vec![NORMAL; n],
        Some(_) => int_array(file, "tokenizer.ggml.token_type", n)?,
    };
    let arch = file.get("general.architecture").and_then(Value::as_str);
    let vocab_key = format!("{}.vocab_size", arch.unwrap_or("llama"));
    if let Some(vocab) = file.get(&vocab_key).and_then(Value::as_u64)
        && vocab != n as u64
    {
        return Err(file.error(format!(
            "tokenizer.ggml.tokens has {n} entries but {vocab_key} is {vocab}"
        )));
    }
    let id = |key: &str| -> Result<Option<u32>> {
        match file.optional(key, "a token id", |v| v.as_u64())? {
            None => Ok(None),
            Some(id) if id < n as u64 => Ok(Some(id as u32)),
            Some(id) => Err(file.error(format!(
                "{key} is {id}, outside the vocabulary of {n} tokens"
            ))),
        }
    };
    let special = ChatFormat {
        bos: id("tokenizer.ggml.bos_token_id")?,
        eos: id("tokenizer.ggml.eos_token_id")?,
        eot: id("tokenizer.ggml.eot_token_id")?,
        eom: id("tokenizer.ggml.eom_token_id")?,
        template: file
            .optional("tokenizer.chat_template", "a string", |v| v.as_str())?
            .map(str::to_string),
    };
    let unknown = id("tokenizer.ggml.unknown_token_id")?;
    let mut vocab = serde_json::Map::with_capacity(n);
    for (i, token) in tokens.iter().enumerate() {
        if vocab.insert(token.to_string(), json!(i)).is_some() {
            return Err(file.error(format!(
                "tokenizer.ggml.tokens has {token:?} twice (again at id {i})"
            )));
        }
    }
    let added: Vec<Json> = tokens
        .iter()
        .zip(&types)
        .enumerate()
        .filter(|(_, (_, t))| matches!(**t, CONTROL | USER_DEFINED))
        .map(|(i, (content, &t))| {
            json!({"id": i, "content": content, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": t == CONTROL})
        })
        .collect();
    let add_bos = file.optional("tokenizer.ggml.add_bos_token", "a bool", |v| v.as_bool())?;
    let (normalizer, pre_tokenizer, decoder, bpe, add_bos) = match model {
        "gpt2" => {
            let pre = file
                .optional("tokenizer.ggml.pre", "a string", |v| v.as_str())?
                .unwrap_or("default");
            let merges = merges_from_metadata(file)?;
            let byte_level = |use_regex: bool| {
                json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                       "use_regex": use_regex})
            };
            let split = |regex: &str| {
                json!({"type": "Sequence", "pretokenizers": [
                    {"type": "Split", "pattern": {"Regex": regex},
                     "behavior": "Isolated", "invert": false},
                    byte_level(false)]})
            };
            // Qwen2's tokenizers alone normalize (NFC) before splitting.
            let (normalizer, pre_tokenizer) = if PRE_GPT2.contains(&pre) {
                (Json::Null, byte_level(true))
            } else if PRE_DIGITS_GPT2.contains(&pre) {
                let digits = json!({"type": "Sequence", "pretokenizers": [
                    {"type": "Digits", "individual_digits": true}, byte_level(true)]});
                (Json::Null, digits)
            } else if PRE_LLAMA3.contains(&pre) {
                (Json::Null, split(LLAMA3_REGEX))
            } else if PRE_QWEN2.contains(&pre) {
                (json!({"type": "NFC"}), split(QWEN2_REGEX))
            } else {
                return Err(file.error(format!(
                    "tokenizer.ggml.pre {pre:?} is not supported; kiln knows {}",
                    [PRE_GPT2, PRE_DIGITS_GPT2, PRE_LLAMA3, PRE_QWEN2]
                        .concat()
                        .join(", ")
                )));
            };
            // Llama 3's tokenizer takes a piece that is a token of its own
            // as that token, whatever the merges would make of it (its
            // tokenizer.json sets `ignore_merges`, llama.cpp does the same
            // for `llama-bpe`): " Việt" is one token, not four.
            let ignore_merges = PRE_LLAMA3.contains(&pre);
            let bpe = json!({"type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": false, "byte_fallback": false, "ignore_merges": ignore_merges,
                "vocab": vocab, "merges": merges});
            (
                normalizer,
                pre_tokenizer,
                byte_level(true),
                bpe,
                add_bos.unwrap_or(false),
            )
        }
        "llama" => {
            let scores = float_array(file, "tokenizer.ggml.scores", n)?;
            let merges = merges_from_scores(&tokens, &types, &scores).map_err(|m| file.error(m))?;
            let prefix = file
                .optional("tokenizer.ggml.add_space_prefix", "a bool", |v| v.as_bool())?
                .unwrap_or(true);
            let replace = json!({"type": "Replace", "pattern": {"String": " "}, "content": "▁"});
            let mut decoders = vec![
                json!({"type": "Replace", "pattern": {"String": "▁"}, "content": " "}),
                json!({"type": "ByteFallback"}),
                json!({"type": "Fuse"}),
            ];
            let normalizer = if prefix {
                decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
                json!({"type": "Sequence", "normalizers": [
                    {"type": "Prepend", "prepend": "▁"}, replace]})
            } else {
                replace
            };
            let unk = unknown.map(|u| tokens[u as usize].to_string());
            let bpe = json!({"type": "BPE", "dropout": null, "unk_token": unk,
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                "vocab": vocab, "merges": merges});
            let decoder = json!({"type": "Sequence", "decoders": decoders});
            (
                normalizer,
                Json::Null,
                decoder,
                bpe,
                add_bos.unwrap_or(true),
            )
        }
        other => {
            return Err(file.error(format!(
                "tokenizer.ggml.model {other:?} is not supported (kiln reads gpt2 and llama)"
            )));
        }
    };
    let post_processor = match (add_bos, special.bos) {
        (true, Some(bos)) => {
            let bos_text = tokens[bos as usize];
            json!({"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": bos_text, "type_id": 0}},
                           {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": bos_text, "type_id": 0}},
                         {"Sequence": {"id": "A", "type_id": 0}},
                         {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {bos_text: {"id": bos_text, "ids": [bos], "tokens": [bos_text]}}})
        }
        (true, None) => {
            return Err(file.error(
                "tokenizer.ggml.add_bos_token is true but tokenizer.ggml.bos_token_id is missing",
            ));
        }
        (false, _) => Json::Null,
    };
    let description = json!({"version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added, "normalizer": normalizer, "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor, "decoder": decoder, "model": bpe});
    let tokenizer = description
        .to_string()
        .parse::<tokenizers::Tokenizer>()
        .map_err(|e| {
            file.error(format!(
                "the tokenizer metadata does not make a tokenizer: {e}"
            ))
        })?;
    Ok((tokenizer, special))
}

fn array<'a>(file: &'a GgufFile, key: &str) -> Result<&'a [Value]> {
    let value = file.require(key)?;
    value.as_array().ok_or_else(|| {
        file.error(format!(
            "{key} is a {}, expected an array",
            value.type_name()
        ))
    })
}

fn string_array<'a>(file: &'a GgufFile, key: &str) -> Result<Vec<&'a str>> {
    array(file, key)?
        .iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_str().ok_or_else(|| {
                file.error(format!(
                    "{key}[{i}] is a {}, expected a string",
                    v.type_name()
                ))
            })
        })
        .collect()
}

/// An array that must have one entry per token.
fn sized_array<'a>(file: &'a GgufFile, key: &str, n: usize) -> Result<&'a [Value]> {
    let values = array(file, key)?;
    if values.len() != n {
        return Err(file.error(format!(
            "{key} has {} entries but tokenizer.ggml.tokens has {n}",
            values.len()
        )));
    }
    Ok(values)
}

fn int_array(file: &GgufFile, key: &str, n: usize) -> Result<Vec<i64>> {
    sized_array(file, key, n)?
        .iter()
        .map(|v| {
            v.as_i64().ok_or_else(|| {
                file.error(format!(
                    "{key} holds a {}, expected integers",
                    v.type_name()
                ))
            })
        })
        .collect()
}

fn float_array(file: &GgufFile, key: &str, n: usize) -> Result<Vec<f32>> {
    sized_array(file, key, n)?
        .iter()
        .map(|v| match v {
            Value::F32(f) => Ok(*f),
            other => Err(file.error(format!(
                "{key} holds a {}, expected float32",
                other.type_name()
            ))),
        })
        .collect()
}

/// `tokenizer.ggml.merges`: "left right" strings, as pairs.
fn merges_from_metadata(file: &GgufFile) -> Result<Vec<Json>> {
    let key = "tokenizer.ggml.merges";
    string_array(file, key)?
        .into_iter()
        .enumerate()
        .map(|(i, merge)| {
            // The first space after the first character: a piece can be " ".
            let split = merge
                .char_indices()
                .skip(1)
                .find(|&(_, c)| c == ' ')
                .map(|(at, _)| at)
                .ok_or_else(|| file.error(format!("{key}[{i}] {merge:?} is not two tokens")))?;
            Ok(json!([&merge[..split], &merge[split + 1..]]))
        })
        .collect()
}

/// SentencePiece BPE as merges: every split of a normal piece into two
/// pieces of the vocabulary, ranked by the merged piece's score (higher
/// first), as llama.cpp's SentencePiece tokenizer picks bigrams.
fn merges_from_scores(
    tokens: &[&str],
    types: &[i64],
    scores: &[f32],
) -> std::result::Result<Vec<Json>, String> {
    // Each piece of length L is split L - 1 ways, each a lookup of up to L
    // bytes: the work (and the merges' text) grows as L squared. A crafted
    // vocabulary (`a`, `aa`, … 1,500 long, or one 1 MB piece) took minutes
    // and gigabytes; real ones need a few million.
    let work: u64 = tokens
        .iter()
        .enumerate()
        .filter(|(id, _)| types[*id] == NORMAL || types[*id] == USER_DEFINED)
        .map(|(_, piece)| (piece.len() as u64).pow(2))
        .sum();
    if work > MAX_MERGE_WORK {
        return Err(format!(
            "tokenizer.ggml.tokens: its pieces are too long to derive merges from (the sum of \
             their squared lengths is {work}, kiln's limit {MAX_MERGE_WORK}); no real \
             SentencePiece vocabulary comes near it"
        ));
    }
    let ids: HashMap<&str, usize> = tokens.iter().enumerate().map(|(i, t)| (*t, i)).collect();
    let mut ranked = Vec::new();
    for (id, piece) in tokens.iter().enumerate() {
        if types[id] != NORMAL && types[id] != USER_DEFINED {
            continue;
        }
        for (at, _) in piece.char_indices().skip(1) {
            let (left, right) = piece.split_at(at);
            if let (Some(&l), Some(&r)) = (ids.get(left), ids.get(right)) {
                ranked.push((scores[id], id, l, r));
            }
        }
    }
    ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    Ok(ranked
        .into_iter()
        .map(|(_, _, l, r)| json!([tokens[l], tokens[r]]))
        .collect())
}

/// The most work [`merges_from_scores`] does: the sum of the squared byte
/// lengths of the pieces. A 256k-token SentencePiece vocabulary is about
/// 20 million.
pub const MAX_MERGE_WORK: u64 = 256 << 20;
