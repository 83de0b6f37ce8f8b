//! Tokenizers: a model's `tokenizer.json` (through the `tokenizers` crate), or
//! the embedded model's byte-level one.

use std::path::Path;

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

pub enum Tokenizer {
    Bytes(ByteTokenizer),
    HuggingFace(Box<tokenizers::Tokenizer>),
}

impl Tokenizer {
    /// Reads a Hugging Face `tokenizer.json`.
    pub fn from_file(path: &Path) -> Result<Tokenizer> {
        let tokenizer = tokenizers::Tokenizer::from_file(path).map_err(|e| Error::Tokenizer {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        Ok(Tokenizer::HuggingFace(Box::new(tokenizer)))
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
            Tokenizer::HuggingFace(t) => t
                .encode(text, add_special_tokens)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| Error::Encode(e.to_string())),
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
            Tokenizer::HuggingFace(t) => t
                .decode(tokens, true)
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

    #[test]
    fn bytes_outside_the_vocabulary_are_named() {
        let error = Tokenizer::Bytes(ByteTokenizer).encode("naïve").unwrap_err();
        assert!(error.to_string().contains("0xc3"), "{error}");
    }
}
