//! Tokenizers: a model's `tokenizer.json` (through the `tokenizers` crate), or
//! the embedded model's byte-level one.

use std::path::Path;

mod charsmap;

use crate::contained::contain;
use crate::error::{Error, Result};

/// The embedded model's tokenizer: one token per printable ASCII byte and
/// newline, plus BOS and EOS.
#[derive(Clone, Debug)]
pub struct ByteTokenizer;

impl ByteTokenizer {
    /// Printable ASCII (0x20..=0x7e) and `\n`.
    const FIRST: u8 = 0x20;
    const LAST: u8 = 0x7e;
    pub const NEWLINE: u32 = (Self::LAST - Self::FIRST + 1) as u32;
    pub const BOS: u32 = Self::NEWLINE + 1;
    pub const EOS: u32 = Self::NEWLINE + 2;
    pub const VOCAB_SIZE: usize = Self::EOS as usize + 1;

    /// BOS (with `add_bos`), then one token per byte.
    fn encode(&self, text: &str, add_bos: bool) -> Result<Vec<u32>> {
        let bytes = text.bytes().map(|b| match b {
            b'\n' => Ok(Self::NEWLINE),
            Self::FIRST..=Self::LAST => Ok(u32::from(b - Self::FIRST)),
            other => Err(Error::Encode(format!(
                "byte 0x{other:02x} is not in the embedded model's vocabulary \
                     (printable ASCII and newline); pass --model for other text"
            ))),
        });
        add_bos
            .then_some(Ok(Self::BOS))
            .into_iter()
            .chain(bytes)
            .collect()
    }

    fn decode(&self, tokens: &[u32]) -> String {
        tokens
            .iter()
            .filter_map(|&t| match t {
                Self::NEWLINE => Some('\n'),
                t if t < Self::NEWLINE => Some(char::from(Self::FIRST + t as u8)),
                _ => None, // BOS and EOS print nothing.
            })
            .collect()
    }
}

/// The largest tokenizer.json kiln reads (large real ones are ~35 MB).
pub const TOKENIZER_FILE_LIMIT: u64 = 256 << 20;

#[derive(Clone)]
pub enum Tokenizer {
    Bytes(ByteTokenizer),
    /// Build through [`Tokenizer::from_hugging_face`], which hardens it.
    HuggingFace(Box<tokenizers::Tokenizer>),
}

impl Tokenizer {
    /// Reads a Hugging Face `tokenizer.json`.
    pub fn from_file(path: &Path) -> Result<Tokenizer> {
        let bytes = crate::files::read_limited(path, TOKENIZER_FILE_LIMIT, "a tokenizer.json")?;
        Tokenizer::from_json(path, &bytes)
    }

    /// A Hugging Face tokenizer from `tokenizer.json`'s bytes (`path` names
    /// it in errors).
    pub fn from_json(path: &Path, bytes: &[u8]) -> Result<Tokenizer> {
        let bad = |message: String| Error::Tokenizer {
            path: path.to_path_buf(),
            message,
        };
        charsmap::check(bytes).map_err(bad)?;
        let tokenizer = contain(|| tokenizers::Tokenizer::from_bytes(bytes))
            .map_err(|panic| bad(format!("the tokenizers library failed on it: {panic}")))?
            .map_err(|e| bad(e.to_string()))?;
        Ok(Tokenizer::from_hugging_face(tokenizer))
    }

    /// A Hugging Face tokenizer, however it was built, made fit for kiln:
    /// padding and truncation cleared (kiln encodes one prompt; a fixed
    /// padding of 10^8 would allocate gigabytes, and truncation would cut the
    /// prompt silently), and every encode and decode contained against the
    /// library's panics.
    pub fn from_hugging_face(mut tokenizer: tokenizers::Tokenizer) -> Tokenizer {
        tokenizer.with_padding(None);
        tokenizer
            .with_truncation(None)
            .expect("clearing truncation cannot fail");
        Tokenizer::HuggingFace(Box::new(tokenizer))
    }

    /// A copy that reads special tokens spelled in a text as that text:
    /// `<|im_start|>` typed by a user is characters, not the control token
    /// (the byte tokenizer has none to recognise).
    pub fn with_special_tokens_as_text(&self) -> Tokenizer {
        match self {
            Tokenizer::Bytes(t) => Tokenizer::Bytes(t.clone()),
            Tokenizer::HuggingFace(t) => {
                let mut t = t.clone();
                t.set_encode_special_tokens(true);
                Tokenizer::HuggingFace(t)
            }
        }
    }

    /// Token ids of `text`, with the special tokens the tokenizer adds.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_with(text, true)
    }

    /// Token ids of a prompt rendered by a chat template: special tokens
    /// spelled in the text are recognised, none is added (the template
    /// wrote the ones it wants), as transformers' `apply_chat_template`.
    pub fn encode_rendered(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_with(text, false)
    }

    fn encode_with(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        match self {
            Tokenizer::Bytes(t) => t.encode(text, add_special_tokens),
            Tokenizer::HuggingFace(t) => contain(|| t.encode(text, add_special_tokens))
                .map_err(|panic| Error::Encode(format!("the tokenizer failed: {panic}")))?
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| Error::Encode(e.to_string())),
        }
    }

    /// The most bytes any vocabulary entry is spelled with: at least the
    /// bytes of text one token can stand for (byte-level and SentencePiece
    /// vocabularies spell each byte with one to six), so a text longer than
    /// a context's worth of it cannot fit.
    pub fn longest_token_bytes(&self) -> usize {
        match self {
            Tokenizer::Bytes(_) => 1,
            Tokenizer::HuggingFace(t) => {
                t.get_vocab(true).keys().map(String::len).max().unwrap_or(1)
            }
        }
    }

    /// Whether `id` is one of the vocabulary's special tokens (Hugging
    /// Face's `added_tokens` marked special; a GGUF file's control tokens):
    /// markers a template writes, never pieces of ordinary text.
    pub fn is_special(&self, id: u32) -> bool {
        match self {
            Tokenizer::Bytes(_) => false,
            Tokenizer::HuggingFace(t) => t
                .get_added_tokens_decoder()
                .get(&id)
                .is_some_and(|token| token.special),
        }
    }

    /// How the vocabulary spells `id` (`Ġthe`, `<0xC3>`); `None` for the
    /// byte tokenizer, whose tokens are characters.
    pub fn vocabulary_entry(&self, id: u32) -> Option<String> {
        match self {
            Tokenizer::Bytes(_) => None,
            Tokenizer::HuggingFace(t) => t.id_to_token(id),
        }
    }

    /// The id of the vocabulary entry spelled `token` (`<|im_end|>`).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        match self {
            Tokenizer::Bytes(_) => None,
            Tokenizer::HuggingFace(t) => t.token_to_id(token),
        }
    }

    /// Text of `tokens`, special tokens left out.
    pub fn decode(&self, tokens: &[u32]) -> Result<String> {
        match self {
            Tokenizer::Bytes(t) => Ok(t.decode(tokens)),
            Tokenizer::HuggingFace(t) => contain(|| t.decode(tokens, true))
                .map_err(|panic| Error::Decode(format!("the tokenizer failed: {panic}")))?
                .map_err(|e| Error::Decode(e.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_round_trip_printable_text() {
        let t = Tokenizer::Bytes(ByteTokenizer);
        let text = "Hello, kiln!\n~ {x}";
        let ids = t.encode(text).unwrap();
        assert_eq!(ids[0], ByteTokenizer::BOS);
        assert_eq!(ids.len(), text.len() + 1);
        assert!(
            ids.iter()
                .all(|&i| (i as usize) < ByteTokenizer::VOCAB_SIZE)
        );
        assert_eq!(t.decode(&ids).unwrap(), text);
        assert_eq!(
            t.decode(&[ByteTokenizer::BOS, 0, ByteTokenizer::EOS])
                .unwrap(),
            " "
        );
    }

    /// A word-level tokenizer.json over `t0`..`t9` with `changes` merged in.
    fn hugging_face(changes: serde_json::Value) -> std::result::Result<Tokenizer, String> {
        let vocab: serde_json::Map<String, serde_json::Value> =
            (0..10).map(|i| (format!("t{i}"), i.into())).collect();
        let mut json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"}
        });
        for (key, value) in changes.as_object().unwrap() {
            json[key] = value.clone();
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        std::fs::write(&path, json.to_string()).unwrap();
        Tokenizer::from_file(&path).map_err(|e| e.to_string())
    }

    #[test]
    fn tokenizer_panics_are_errors() {
        // An empty charsmap trie panics on first use: while loading, where
        // the added tokens are normalized.
        let error = hugging_face(serde_json::json!({
            "normalizer": {"type": "Precompiled", "precompiled_charsmap": "AAAAAA=="},
            "added_tokens": [{"id": 1, "content": "t1", "single_word": false, "lstrip": false,
                              "rstrip": false, "normalized": true, "special": false}]}))
        .err()
        .expect("a broken charsmap loads");
        assert!(error.contains("failed on it"), "{error}");

        // A template naming a special token the tokenizer lacks panics at
        // encode.
        let template = hugging_face(serde_json::json!({"post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}],
            "special_tokens": {}}}))
        .unwrap();
        let error = template.encode("t1 t2").unwrap_err().to_string();
        assert!(error.contains("the tokenizer failed"), "{error}");

        // onig gives up on this backtracking and the library panics.
        let split = hugging_face(serde_json::json!({"pre_tokenizer": {
            "type": "Split", "pattern": {"Regex": "(a|aa)+$"},
            "behavior": "Isolated", "invert": false}}))
        .unwrap();
        let prompt = format!("{}!", "a".repeat(40));
        let error = split.encode(&prompt).unwrap_err().to_string();
        assert!(error.contains("the tokenizer failed"), "{error}");
    }

    #[test]
    fn an_oversized_charsmap_trie_is_refused_before_the_library_reserves_it() {
        // 8 bytes declaring a 3.5 GB trie: the library would reserve 7 GB.
        let error = hugging_face(serde_json::json!({
            "normalizer": {"type": "Precompiled", "precompiled_charsmap": "AAAA1A=="}}))
        .err()
        .expect("an oversized charsmap loads");
        assert!(
            error.contains("declares a trie of 3556769792 bytes"),
            "{error}"
        );
        assert!(error.contains("tokenizer.json"), "{error}");
    }

    #[test]
    fn padding_and_truncation_are_cleared() {
        let tokenizer = hugging_face(serde_json::json!({
            "padding": {"strategy": {"Fixed": 100_000_000}, "direction": "Right",
                        "pad_to_multiple_of": null, "pad_id": 0, "pad_type_id": 0,
                        "pad_token": "t0"},
            "truncation": {"direction": "Right", "max_length": 2,
                           "strategy": "LongestFirst", "stride": 0}}))
        .unwrap();
        assert_eq!(tokenizer.encode("t1 t2 t3 t4").unwrap(), vec![1, 2, 3, 4]);
    }

    #[test]
    fn bytes_outside_the_vocabulary_are_named() {
        let error = Tokenizer::Bytes(ByteTokenizer).encode("naïve").unwrap_err();
        assert!(error.to_string().contains("0xc3"), "{error}");
    }
}
