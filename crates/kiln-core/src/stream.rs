//! Text out of generated token ids as they come, for the CLI, chat and a
//! server alike. What [`TextStream`] hands out, concatenated, equals the
//! tokenizer's decode of all the ids: text that a later token may still
//! change (an incomplete UTF-8 sequence, a byte-fallback run) is held back
//! until it is final, and [`TextStream::finish`] hands out the rest.

use crate::error::{Error, Result};
use crate::tokenizer::Tokenizer;

/// Incremental decoding of one generation's ids (special tokens left out,
/// as [`Tokenizer::decode`] does).
pub struct TextStream<'t> {
    tokenizer: &'t Tokenizer,
    /// The `tokenizers` crate's incremental decoder state (see
    /// `tokenizers::tokenizer::step_decode_stream`): the window of ids whose
    /// decode yields `prefix` plus text not yet handed out, and where in the
    /// window `prefix`'s ids end.
    window: Vec<u32>,
    prefix: String,
    prefix_index: usize,
    /// Byte-fallback tokens (`<0xC3>`) not yet given to the decoder: the
    /// `ByteFallback` decoder turns a whole run of byte tokens into one `�`
    /// per byte when any byte of the run is invalid, so a run is only final
    /// once a token that is not a byte (nor a skipped special token) ends it.
    pending_bytes: Vec<u32>,
}

impl<'t> TextStream<'t> {
    pub fn new(tokenizer: &'t Tokenizer) -> TextStream<'t> {
        TextStream {
            tokenizer,
            window: Vec::new(),
            prefix: String::new(),
            prefix_index: 0,
            pending_bytes: Vec::new(),
        }
    }

    /// Adds one generated id; returns the text that became final with it,
    /// if any.
    pub fn push(&mut self, id: u32) -> Result<Option<String>> {
        let tokenizer = match self.tokenizer {
            // One token per character, no context: every token is final.
            Tokenizer::Bytes(_) => return non_empty(self.tokenizer.decode(&[id])?),
            Tokenizer::HuggingFace(t) => t,
        };
        let token = tokenizer.id_to_token(id);
        let is_byte = token.as_deref().is_some_and(is_byte_token);
        // A skipped special token is no text, so it does not end a run: the
        // bytes on either side of it decode as one.
        let inside_run = !self.pending_bytes.is_empty()
            && token
                .as_deref()
                .is_some_and(|t| tokenizer.get_added_vocabulary().is_special_token(t));
        if is_byte || inside_run {
            self.pending_bytes.push(id);
            return Ok(None);
        }
        let mut ids = std::mem::take(&mut self.pending_bytes);
        ids.push(id);
        self.step(tokenizer, ids)
    }

    /// Ends the generation: returns the text still held back (an incomplete
    /// character at the very end decodes as `�`, as in a decode of all ids).
    pub fn finish(mut self) -> Result<Option<String>> {
        let tokenizer = match self.tokenizer {
            Tokenizer::Bytes(_) => return Ok(None),
            Tokenizer::HuggingFace(t) => t,
        };
        let pending = std::mem::take(&mut self.pending_bytes);
        let mut out = if pending.is_empty() {
            None
        } else {
            self.step(tokenizer, pending)?
        };
        let text = decode(tokenizer, &self.window)?;
        let rest = text
            .strip_prefix(self.prefix.as_str())
            .ok_or_else(|| mismatch(&self.prefix, &text))?;
        if !rest.is_empty() {
            out.get_or_insert_with(String::new).push_str(rest);
        }
        Ok(out)
    }

    fn step(&mut self, tokenizer: &tokenizers::Tokenizer, ids: Vec<u32>) -> Result<Option<String>> {
        tokenizers::tokenizer::step_decode_stream(
            tokenizer,
            ids,
            SKIP_SPECIAL_TOKENS,
            &mut self.window,
            &mut self.prefix,
            &mut self.prefix_index,
        )
        .map_err(|e| Error::Decode(e.to_string()))
    }
}

/// As [`Tokenizer::decode`]: special tokens are not text.
const SKIP_SPECIAL_TOKENS: bool = true;

fn decode(tokenizer: &tokenizers::Tokenizer, ids: &[u32]) -> Result<String> {
    tokenizer
        .decode(ids, SKIP_SPECIAL_TOKENS)
        .map_err(|e| Error::Decode(e.to_string()))
}

fn mismatch(prefix: &str, text: &str) -> Error {
    Error::Decode(format!(
        "the incremental decode lost its place: expected text starting with {prefix:?}, got {text:?}"
    ))
}

fn non_empty(text: String) -> Result<Option<String>> {
    Ok((!text.is_empty()).then_some(text))
}

/// Whether `token` is a SentencePiece byte-fallback token, spelled `<0xNN>`.
fn is_byte_token(token: &str) -> bool {
    token.len() == 6
        && token.starts_with("<0x")
        && token.ends_with('>')
        && token[3..5].bytes().all(|b| b.is_ascii_hexdigit())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{byte_level_320, sentencepiece_byte_fallback};
    use proptest::prelude::*;
    use std::sync::LazyLock;

    static BYTE_LEVEL: LazyLock<Tokenizer> = LazyLock::new(byte_level_320);
    static BYTE_FALLBACK: LazyLock<Tokenizer> = LazyLock::new(sentencepiece_byte_fallback);

    /// Everything the stream hands out for `ids`, concatenated.
    fn streamed(tokenizer: &Tokenizer, ids: &[u32]) -> String {
        let mut stream = TextStream::new(tokenizer);
        let mut out = String::new();
        for &id in ids {
            out.extend(stream.push(id).unwrap());
        }
        out.extend(stream.finish().unwrap());
        out
    }

    /// The report: a multi-byte character spread over several byte-level
    /// tokens, after an invalid byte, lost `ܨ` and `K`.
    #[test]
    fn byte_level_regression_keeps_every_character() {
        let tokenizer = byte_level_320();
        let ids = [139, 154, 103, 44, 310];
        let whole = tokenizer.decode(&ids).unwrap();
        assert_eq!(whole, "\u{fffd}ܨKas");
        assert_eq!(streamed(&tokenizer, &ids), whole);
    }

    #[test]
    fn pieces_come_out_as_soon_as_they_are_final() {
        let tokenizer = byte_level_320();
        let mut stream = TextStream::new(&tokenizer);
        // 0xCD is held (it may start a character), 0xDC shows it was not
        // one, 0xA8 completes `ܨ`.
        assert_eq!(stream.push(139).unwrap(), None);
        assert_eq!(stream.push(154).unwrap(), None);
        assert_eq!(stream.push(103).unwrap().as_deref(), Some("\u{fffd}ܨ"));
        assert_eq!(stream.push(44).unwrap().as_deref(), Some("K"));
        assert_eq!(stream.push(310).unwrap().as_deref(), Some("as"));
        assert_eq!(stream.finish().unwrap(), None);
    }

    #[test]
    fn an_incomplete_character_at_the_end_is_flushed() {
        let tokenizer = byte_level_320();
        // "as", then 0xCD: a character that never completes.
        let ids = [310, 139];
        assert_eq!(streamed(&tokenizer, &ids), "as\u{fffd}");
    }

    #[test]
    fn byte_fallback_runs_wait_for_their_end() {
        let tokenizer = sentencepiece_byte_fallback();
        let a = tokenizer.encode("A").unwrap();
        let byte = |b: u8| match &tokenizer {
            Tokenizer::HuggingFace(t) => t.token_to_id(&format!("<0x{b:02X}>")).unwrap(),
            Tokenizer::Bytes(_) => unreachable!(),
        };
        // `<0x41>` is "A" alone, but the run <0x41><0x80> decodes as "��".
        let ids = [a[1], byte(0x41), byte(0x80), a[1]];
        let whole = tokenizer.decode(&ids).unwrap();
        assert_eq!(whole, "A\u{fffd}\u{fffd}▁A".replace('▁', " "));
        assert_eq!(streamed(&tokenizer, &ids), whole);
    }

    /// Found by the property test: a skipped special token inside a byte
    /// run does not end it (`<0xC2><0x80><unk><0x80>` is one invalid run).
    #[test]
    fn a_special_token_inside_a_byte_run_does_not_end_it() {
        let tokenizer = &*BYTE_FALLBACK;
        let ids = [197, 131, 0, 131];
        let whole = tokenizer.decode(&ids).unwrap();
        assert_eq!(whole, "\u{fffd}".repeat(3));
        assert_eq!(streamed(tokenizer, &ids), whole);
    }

    #[test]
    fn the_embedded_byte_tokenizer_streams_each_token() {
        let tokenizer = Tokenizer::Bytes(crate::tokenizer::ByteTokenizer);
        let ids = tokenizer.encode("Hi there\n").unwrap();
        assert_eq!(streamed(&tokenizer, &ids), "Hi there\n");
    }

    proptest! {
        #[test]
        fn byte_level_stream_equals_whole_decode(ids in prop::collection::vec(0u32..320, 0..48)) {
            let tokenizer = &*BYTE_LEVEL;
            prop_assert_eq!(streamed(tokenizer, &ids), tokenizer.decode(&ids).unwrap());
        }

        /// Mostly multi-byte UTF-8 lead and continuation bytes, where text
        /// gets lost if anything does.
        #[test]
        fn byte_level_stream_equals_whole_decode_on_high_bytes(
            ids in prop::collection::vec(prop_oneof![94u32..190, 0u32..320], 0..48)
        ) {
            let tokenizer = &*BYTE_LEVEL;
            prop_assert_eq!(streamed(tokenizer, &ids), tokenizer.decode(&ids).unwrap());
        }

        #[test]
        fn byte_fallback_stream_equals_whole_decode(ids in prop::collection::vec(0u32..270, 0..48)) {
            let tokenizer = &*BYTE_FALLBACK;
            prop_assert_eq!(streamed(tokenizer, &ids), tokenizer.decode(&ids).unwrap());
        }
    }
}
