//! A check of tokenizer.json ahead of the `tokenizers` crate, for the one
//! field it trusts to size an allocation: a SentencePiece normalizer's
//! `precompiled_charsmap` starts with the byte length of its trie, and the
//! library reserves that many entries before reading them. A damaged or
//! crafted charsmap of 8 bytes that declares a 3.5 GB trie makes it reserve
//! 7 GB: where memory is capped, an abort, not an error.

use std::cell::RefCell;
use std::fmt;

use base64::Engine;
use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

/// Every `precompiled_charsmap` in `json` (at any depth: normalizers nest in
/// sequences) declares a trie that fits in it. `Err` says which does not and
/// what to do; JSON that does not parse is left for the library to report.
pub(super) fn check(json: &[u8]) -> Result<(), String> {
    let problem = RefCell::new(None);
    let walk = Walk { problem: &problem };
    // A syntax error, or a `problem` stopping the walk, ends it early.
    let _ = walk.deserialize(&mut serde_json::Deserializer::from_slice(json));
    if let Some(problem) = problem.into_inner() {
        return Err(problem);
    }
    // The walk stops at the first syntax error, yet the library has been
    // seen to reach a charsmap past one (the fuzzer's find: `"nor", …`
    // before the normalizer). So every literal occurrence of the key is
    // checked too, wherever it stands.
    literal_charsmaps(json)
        .find_map(|charsmap| oversized_trie(&charsmap))
        .map_or(Ok(()), Err)
}

/// The string after each `"precompiled_charsmap"` key spelled without
/// escapes, read as a JSON string (escapes in it decoded).
fn literal_charsmaps(json: &[u8]) -> impl Iterator<Item = String> + '_ {
    const KEY: &[u8] = b"\"precompiled_charsmap\"";
    (0..json.len().saturating_sub(KEY.len()))
        .filter(move |&at| json[at..].starts_with(KEY))
        .filter_map(move |at| {
            let rest = &json[at + KEY.len()..];
            let rest = rest
                .trim_ascii_start()
                .strip_prefix(b":")?
                .trim_ascii_start();
            let mut strings = serde_json::Deserializer::from_slice(rest).into_iter::<String>();
            strings.next()?.ok()
        })
}

/// Why `charsmap` (base64) cannot be a precompiled charsmap; `None` if its
/// trie fits, or if it is not base64 at all (the library refuses that).
fn oversized_trie(charsmap: &str) -> Option<String> {
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(charsmap)
        .ok()?;
    let header: [u8; 4] = bytes.get(..4)?.try_into().ok()?;
    let declared = u64::from(u32::from_le_bytes(header));
    let held = (bytes.len() - 4) as u64;
    (declared > held).then(|| {
        format!(
            "its normalizer's precompiled_charsmap declares a trie of {declared} bytes \
             but holds {held} after its header: the file is damaged; download the \
             model's tokenizer.json again"
        )
    })
}

/// Walks a JSON value without keeping it, checking each charsmap on the way.
#[derive(Clone, Copy)]
struct Walk<'a> {
    problem: &'a RefCell<Option<String>>,
}

impl Walk<'_> {
    fn stop<E: serde::de::Error>(self, message: String) -> E {
        *self.problem.borrow_mut() = Some(message);
        E::custom("a precompiled_charsmap is oversized")
    }
}

impl<'de> DeserializeSeed<'de> for Walk<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Walk<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut items: A) -> Result<(), A::Error> {
        while items.next_element_seed(self)?.is_some() {}
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut entries: A) -> Result<(), A::Error> {
        while let Some(key) = entries.next_key::<String>()? {
            if key == "precompiled_charsmap" {
                let value: serde_json::Value = entries.next_value()?;
                if let Some(message) = value.as_str().and_then(oversized_trie) {
                    return Err(self.stop(message));
                }
            } else {
                entries.next_value_seed(self)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn charsmap(bytes: &[u8]) -> String {
        base64::engine::general_purpose::STANDARD.encode(bytes)
    }

    /// The fuzzer's second find: a syntax error before the normalizer
    /// stopped the walk, and the library still sized its trie.
    #[test]
    fn a_charsmap_past_a_syntax_error_is_checked_too() {
        let json = br#"{"version": "1.0", "added_tokens": [], "nor", "normalizer": {"type": "Precompiled", "precompiled_charsmap" : "AAAA1A=="}, "model"#;
        let error = check(json).unwrap_err();
        assert!(error.contains("trie of 3556769792 bytes"), "{error}");
        // A sound charsmap past the same error passes.
        let mut sound = 4u32.to_le_bytes().to_vec();
        sound.extend([0; 4]);
        let json = format!(
            r#"{{"nor", "precompiled_charsmap": "{}"}}"#,
            charsmap(&sound)
        );
        assert_eq!(check(json.as_bytes()), Ok(()));
    }

    #[test]
    fn a_trie_larger_than_its_charsmap_is_named() {
        // The fuzzer's find: 8 bytes declaring a 0xd4000000-byte trie.
        let json = r#"{"normalizer": {"type": "Precompiled", "precompiled_charsmap": "AAAA1A=="}}"#;
        let error = check(json.as_bytes()).unwrap_err();
        assert!(
            error.contains("declares a trie of 3556769792 bytes but holds 0"),
            "{error}"
        );
        assert!(error.contains("download"), "{error}");

        // Nested in a sequence of normalizers, behind an escaped key.
        let mut header = 64u32.to_le_bytes().to_vec();
        header.extend([0; 60]);
        let nested = serde_json::json!({"normalizer": {"type": "Sequence", "normalizers": [
            {"type": "NFKC"},
            {"type": "Precompiled", "precompiled_charsmap": charsmap(&header)}]}})
        .to_string()
        .replace("precompiled_charsmap", r"precompiled\u005fcharsmap");
        let error = check(nested.as_bytes()).unwrap_err();
        assert!(error.contains("trie of 64 bytes but holds 60"), "{error}");
    }

    #[test]
    fn fitting_tries_and_other_json_pass() {
        let mut fits = 8u32.to_le_bytes().to_vec();
        fits.extend([0; 8]);
        fits.extend(b"a\0");
        let json = serde_json::json!({"normalizer": {
            "type": "Precompiled", "precompiled_charsmap": charsmap(&fits)},
            "model": {"vocab": [["a", -1.5], ["b", 2]], "byte_fallback": true, "x": null}});
        assert_eq!(check(json.to_string().as_bytes()), Ok(()));
        // Not JSON, not base64, too short for a header: the library's to refuse.
        for other in [
            &b"{\"normalizer\": "[..],
            br#"{"precompiled_charsmap": "not base64!"}"#,
            br#"{"precompiled_charsmap": "AAA="}"#,
            br#"{"precompiled_charsmap": 7}"#,
        ] {
            assert_eq!(check(other), Ok(()), "{}", String::from_utf8_lossy(other));
        }
    }
}
