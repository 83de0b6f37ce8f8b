//! GGUF files without a real model: the synthetic fixture (one tensor of each
//! type, expected values from the `gguf` package's dequantizers, made by
//! scripts/gguf_dequant_fixture.py), a tiny Llama written here, and bad files
//! of each kind, which must be named errors rather than panics.

use std::path::{Path, PathBuf};

use kiln_core::gguf::GgufFile;
use kiln_core::{Error, Model};

#[path = "common/gguf_writer.rs"]
mod gguf_writer;
use gguf_writer::{V, Writer, sentencepiece_vocabulary, string};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/gguf")
        .join(name)
}

#[test]
fn every_type_dequantizes_as_the_reference_does() {
    let file = GgufFile::open(&fixture("synthetic.gguf")).unwrap();
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("synthetic.json")).unwrap()).unwrap();
    let expected = expected.as_object().unwrap();
    assert_eq!(expected.len(), 11, "one tensor per supported type");
    for (name, case) in expected {
        let info = file
            .tensor(name)
            .unwrap_or_else(|| panic!("{name} missing"));
        assert_eq!(info.ty.name(), case["type"].as_str().unwrap(), "{name}");
        let bits: Vec<u32> = file
            .tensor_f32(info)
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect();
        let want: Vec<u32> = case["bits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(bits.len(), want.len(), "{name}");
        if let Some(i) = (0..bits.len()).find(|&i| bits[i] != want[i]) {
            panic!(
                "{name}: value {i} is {} ({:#010x}), the reference says {} ({:#010x})",
                f32::from_bits(bits[i]),
                bits[i],
                f32::from_bits(want[i]),
                want[i]
            );
        }
    }
}

/// GPT-2's byte-to-character map: printable bytes are themselves, the rest
/// are shifted past 255.
fn byte_char(b: u8) -> char {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xa1..=0xac).contains(&b) || b >= 0xae;
    if printable(b) {
        return char::from(b);
    }
    let shifted = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + shifted).unwrap()
}

/// The `llama.*` keys of the one-layer model.
fn llama_header(w: &mut Writer) {
    llama_header_sized(w, HIDDEN, FFN);
}

/// The `llama.*` keys of a one-layer model `hidden` wide.
fn llama_header_sized(w: &mut Writer, hidden: u64, ffn: u64) {
    w.kv("general.architecture", V::Str("llama"))
        .kv("llama.block_count", V::U32(1))
        .kv("llama.context_length", V::U32(64))
        .kv("llama.embedding_length", V::U32(hidden as u32))
        .kv("llama.feed_forward_length", V::U32(ffn as u32))
        .kv("llama.attention.head_count", V::U32(2))
        .kv("llama.attention.head_count_kv", V::U32(1))
        .kv("llama.attention.layer_norm_rms_epsilon", V::F32(1e-5))
        .kv("llama.rope.freq_base", V::F32(10_000.0));
}

/// The one-layer model's tensors (F32, tied output) for `vocab` tokens.
fn llama_tensors(w: &mut Writer, vocab: u64) {
    let ramp = |n: u64| {
        (0..n)
            .map(|i| ((i % 7) as f32 - 3.0) * 0.05)
            .collect::<Vec<_>>()
    };
    let (q, kv) = (HIDDEN, HIDDEN / 2);
    w.tensor("token_embd.weight", &[HIDDEN, vocab], &ramp(HIDDEN * vocab))
        .tensor("blk.0.attn_norm.weight", &[HIDDEN], &[1.0; HIDDEN as usize])
        .tensor("blk.0.attn_q.weight", &[HIDDEN, q], &ramp(HIDDEN * q))
        .tensor("blk.0.attn_k.weight", &[HIDDEN, kv], &ramp(HIDDEN * kv))
        .tensor("blk.0.attn_v.weight", &[HIDDEN, kv], &ramp(HIDDEN * kv))
        .tensor("blk.0.attn_output.weight", &[q, HIDDEN], &ramp(HIDDEN * q))
        .tensor("blk.0.ffn_norm.weight", &[HIDDEN], &[1.0; HIDDEN as usize])
        .tensor("blk.0.ffn_gate.weight", &[HIDDEN, FFN], &ramp(HIDDEN * FFN))
        .tensor("blk.0.ffn_up.weight", &[HIDDEN, FFN], &ramp(HIDDEN * FFN))
        .tensor("blk.0.ffn_down.weight", &[FFN, HIDDEN], &ramp(HIDDEN * FFN))
        .tensor("output_norm.weight", &[HIDDEN], &[1.0; HIDDEN as usize]);
}

const HIDDEN: u64 = 8;
const FFN: u64 = 16;

/// A one-layer Llama over a byte-level vocabulary of 256 bytes, "<|im_end|>"
/// (a control token) and one merge, with `edit` applied to the metadata.
fn tiny_llama(edit: impl FnOnce(&mut Writer)) -> Writer {
    tiny_llama_splitting("smollm", &[], edit)
}

/// [`tiny_llama`] with the pre-tokenizer `pre` and, after its tokens and
/// merge, each of `merges` with the token it makes.
fn tiny_llama_splitting(pre: &str, merges: &[&str], edit: impl FnOnce(&mut Writer)) -> Writer {
    tiny_llama_shaped(pre, merges, edit, (HIDDEN, FFN), llama_tensors)
}

/// [`tiny_llama_splitting`] `shape` (hidden, feed-forward) wide, its tensors
/// written by `tensors` for the vocabulary's size.
fn tiny_llama_shaped(
    pre: &str,
    merges: &[&str],
    edit: impl FnOnce(&mut Writer),
    shape: (u64, u64),
    tensors: impl FnOnce(&mut Writer, u64),
) -> Writer {
    let mut w = Writer::default();
    let mut tokens: Vec<String> = (0..=255u8).map(|b| byte_char(b).to_string()).collect();
    tokens.push("<|im_end|>".into());
    tokens.push("ab".into());
    tokens.extend(merges.iter().map(|m| m.replace(' ', "")));
    let vocab = tokens.len() as u64;
    let mut types = vec![1; tokens.len()];
    types[256] = 3;
    llama_header_sized(&mut w, shape.0, shape.1);
    w.kv("tokenizer.ggml.model", V::Str("gpt2"))
        .kv("tokenizer.ggml.pre", V::Str(pre))
        .kv("tokenizer.ggml.eos_token_id", V::U32(256))
        .kv("tokenizer.ggml.add_bos_token", V::Bool(false))
        .kv("tokenizer.chat_template", V::Str("{{ messages }}"));
    edit(&mut w);
    if !w.kv.windows(21).any(|k| k == b"tokenizer.ggml.tokens") {
        w.kv("tokenizer.ggml.tokens", V::Strs(tokens));
    }
    if !w.kv.windows(25).any(|k| k == b"tokenizer.ggml.token_type") {
        w.kv("tokenizer.ggml.token_type", V::I32s(types));
    }
    if !w.kv.windows(21).any(|k| k == b"tokenizer.ggml.merges") {
        let all = ["a b"].iter().chain(merges).map(|m| m.to_string());
        w.kv("tokenizer.ggml.merges", V::Strs(all.collect()));
    }
    tensors(&mut w, vocab);
    w
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

#[test]
fn a_tiny_gguf_llama_loads_tokenizes_and_runs() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "tiny.gguf", &tiny_llama(|_| {}).bytes());
    let model = Model::load(&path).unwrap();
    assert_eq!(model.config.vocab_size, 258);
    assert_eq!(model.config.num_kv_heads, 1);
    assert!(model.config.tie_word_embeddings);
    assert_eq!(model.config.eos_token_ids, vec![256]);
    assert_eq!(model.chat.template.as_deref(), Some("{{ messages }}"));
    // The merge applies, digits and the control token are split out, and the
    // control token is left out of decoded text.
    let ids = model.tokenizer.encode("ab1<|im_end|>é").unwrap();
    assert_eq!(ids[0], 257, "{ids:?}");
    assert_eq!(ids[1], u32::from(b'1'));
    assert_eq!(ids[2], 256);
    assert_eq!(model.tokenizer.decode(&ids).unwrap(), "ab1é");
    let mut backend = kiln_core::CpuBackend::new(&model);
    let logits = kiln_core::Backend::prefill(&mut backend, &ids).unwrap();
    assert_eq!(logits.len(), 258);
    assert!(logits.iter().all(|v| v.is_finite()));
}

/// Qwen2's pre-tokenizer (`qwen2`) splits every digit alone where Llama 3's
/// keeps runs of three, and puts text in NFC first as Hugging Face's Qwen2
/// tokenizers do: a decomposed "é" is the precomposed one's token.
#[test]
fn qwen2_splits_digits_alone_and_composes_text() {
    let dir = tempfile::tempdir().unwrap();
    let encode = |pre: &str, text: &str| {
        let bytes = tiny_llama_splitting(pre, &["1 2", "12 3"], |_| {}).bytes();
        let path = write(dir.path(), &format!("{pre}.gguf"), &bytes);
        Model::load(&path).unwrap().tokenizer.encode(text).unwrap()
    };
    let byte = |b: u8| u32::from(b);
    assert_eq!(encode("llama-bpe", "12312"), [259, 258]);
    assert_eq!(
        encode("qwen2", "12312"),
        [b'1', b'2', b'3', b'1', b'2'].map(byte)
    );
    let composed = encode("qwen2", "\u{e9}");
    assert_eq!(composed, [0xc3, 0xa9].map(byte));
    assert_eq!(encode("qwen2", "e\u{301}"), composed);
    assert_ne!(encode("llama-bpe", "e\u{301}"), composed);
}

/// A vocabulary alone (no tensors), written as llama.cpp writes its
/// `ggml-vocab-*.gguf` files, without the padding before a data section it
/// does not have: its tokenizer loads. A file with tensors cut at that
/// padding is still truncated.
#[test]
fn a_vocabulary_without_tensors_needs_no_data_section() {
    let mut w = Writer::default();
    let tokens: Vec<String> = (0..=255u8).map(|b| byte_char(b).to_string()).collect();
    w.kv("general.architecture", V::Str("llama"))
        .kv("tokenizer.ggml.model", V::Str("gpt2"))
        .kv("tokenizer.ggml.pre", V::Str("llama-bpe"))
        .kv("tokenizer.ggml.tokens", V::Strs(tokens))
        .kv("tokenizer.ggml.merges", V::Strs(Vec::new()));
    let mut bytes = w.bytes();
    bytes.truncate(24 + w.kv.len());
    assert!(!bytes.len().is_multiple_of(32), "the padding is left out");
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "vocab.gguf", &bytes);
    let file = kiln_core::gguf::GgufFile::open(&path).unwrap();
    assert!(file.tensors.is_empty());
    let (tokenizer, _) = kiln_core::gguf::tokenizer_from_gguf(&file).unwrap();
    let ids = tokenizer.encode("hi", false).unwrap().get_ids().to_vec();
    assert_eq!(ids, [u32::from(b'h'), u32::from(b'i')]);

    let model = tiny_llama(|_| {});
    let header = 24 + model.kv.len() + model.infos.len();
    assert_rejected(&model.bytes()[..header], "past the end");
}

/// The error of loading `bytes`, which must name the file and `expected`.
fn assert_rejected(bytes: &[u8], expected: &str) {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "bad.gguf", bytes);
    let error = match Model::load(&path) {
        Ok(_) => panic!("loaded a bad file; expected an error containing {expected:?}"),
        Err(e) => e,
    };
    assert!(matches!(error, Error::Gguf { .. }), "{error:?}");
    let message = error.to_string();
    assert!(message.contains("bad.gguf"), "{message}");
    assert!(
        message.contains(expected),
        "expected {expected:?} in: {message}"
    );
}

fn patch_u64_after(bytes: &mut [u8], needle: &[u8], skip: usize, value: u64) {
    let at = bytes
        .windows(needle.len())
        .position(|w| w == needle)
        .unwrap()
        + needle.len()
        + skip;
    bytes[at..at + 8].copy_from_slice(&value.to_le_bytes());
}

#[test]
fn bad_files_are_named_errors() {
    let good = tiny_llama(|_| {}).bytes();

    assert_rejected(b"GGML\x03\0\0\0", "not a GGUF file");
    assert_rejected(&good[..6], "truncated");
    for cut in [100, good.len() / 2, good.len() - 1] {
        assert_rejected(&good[..cut], "truncated");
    }

    let mut absurd_count = good.clone();
    absurd_count[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    assert_rejected(&absurd_count, "claims 18446744073709551615 tensors");

    let mut absurd_kv = good.clone();
    absurd_kv[16..24].copy_from_slice(&(1u64 << 40).to_le_bytes());
    assert_rejected(&absurd_kv, "metadata entries");

    // A dimension of 2^62 rows: far more elements than the file holds.
    let mut absurd_dims = good.clone();
    patch_u64_after(&mut absurd_dims, b"token_embd.weight", 4 + 8, 1 << 62);
    assert_rejected(&absurd_dims, "more elements than the file holds");

    let mut past_end = good.clone();
    // The offset field of output_norm (the last tensor): after dims and type.
    patch_u64_after(&mut past_end, b"output_norm.weight", 4 + 8 + 4, 1 << 20);
    assert_rejected(&past_end, "runs past the end");

    let mut unknown_type = good.clone();
    let at = unknown_type
        .windows(18)
        .position(|w| w == b"output_norm.weight")
        .unwrap()
        + 18
        + 4
        + 8;
    unknown_type[at..at + 4].copy_from_slice(&99u32.to_le_bytes());
    assert_rejected(&unknown_type, "tensor type 99");

    let mut long_string = good.clone();
    patch_u64_after(
        &mut long_string,
        b"general.architecture\x08\0\0\0",
        0,
        u64::MAX / 2,
    );
    assert_rejected(&long_string, "claims");

    let mut long_array = good.clone();
    patch_u64_after(
        &mut long_array,
        b"tokenizer.ggml.tokens\x09\0\0\0\x08\0\0\0",
        0,
        1 << 60,
    );
    assert_rejected(&long_array, "the length of tokenizer.ggml.tokens");

    // Missing metadata: the file lacks the key.
    let without = |key: &str| {
        let mut w = tiny_llama(|_| {});
        let needle = {
            let mut n = (key.len() as u64).to_le_bytes().to_vec();
            n.extend(key.as_bytes());
            n
        };
        let at =
            w.kv.windows(needle.len())
                .position(|x| x == needle.as_slice())
                .unwrap();
        // Rename the key so that it is no longer the one looked up.
        w.kv[at + 8] = b'X';
        w.bytes()
    };
    assert_rejected(
        &without("llama.block_count"),
        "llama.block_count is missing",
    );
    assert_rejected(
        &without("tokenizer.ggml.tokens"),
        "tokenizer.ggml.tokens is missing",
    );

    let short_types = tiny_llama(|w| {
        w.kv("tokenizer.ggml.token_type", V::I32s(vec![1; 10]));
    });
    assert_rejected(
        &short_types.bytes(),
        "tokenizer.ggml.token_type has 10 entries",
    );

    let vocab_mismatch = tiny_llama(|w| {
        w.kv("llama.vocab_size", V::U32(300));
    });
    assert_rejected(
        &vocab_mismatch.bytes(),
        "tokenizer.ggml.tokens has 258 entries but llama.vocab_size is 300",
    );

    let bad_pre = tiny_llama(|w| {
        w.kv("tokenizer.ggml.pre", V::Str("mystery"));
    });
    // The key is written twice: the reader refuses duplicates first.
    assert_rejected(&bad_pre.bytes(), "tokenizer.ggml.pre appears twice");

    // head_count x key_length would overflow: the config's bounds refuse the
    // head size first, naming it (an error, not an arithmetic panic).
    let mut huge_heads = tiny_llama(|w| {
        w.kv("llama.attention.key_length", V::U64(1 << 62));
    });
    let at = huge_heads
        .kv
        .windows(26)
        .position(|k| k == b"llama.attention.head_count")
        .unwrap()
        + 26
        + 4;
    huge_heads.kv[at..at + 4].copy_from_slice(&8u32.to_le_bytes());
    let huge_heads = huge_heads.bytes();
    assert_rejected(
        &huge_heads,
        "head_dim is 4611686018427387904, above kiln's limit",
    );

    let bos_outside = tiny_llama(|w| {
        w.kv("tokenizer.ggml.bos_token_id", V::U32(100_000));
    });
    assert_rejected(&bos_outside.bytes(), "outside the vocabulary");
}

#[test]
fn an_unknown_pre_tokenizer_is_named() {
    let mut w = tiny_llama(|_| {});
    let at = w.kv.windows(6).position(|x| x == b"smollm").unwrap();
    w.kv[at..at + 6].copy_from_slice(b"zzzzzz");
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "pre.gguf", &w.bytes());
    let message = Model::load(&path).err().unwrap().to_string();
    assert!(
        message.contains("tokenizer.ggml.pre \"zzzzzz\" is not supported"),
        "{message}"
    );
}

/// The one-layer model over a SentencePiece (`llama`) vocabulary: BOS 1,
/// EOS 2, unknown 0.
fn sentencepiece_llama(tokens: Vec<String>, types: Vec<i32>, scores: Vec<f32>) -> Writer {
    let vocab = tokens.len() as u64;
    let mut w = Writer::default();
    llama_header(&mut w);
    sentencepiece_vocabulary(&mut w, tokens, types, scores);
    llama_tensors(&mut w, vocab);
    w
}

#[test]
fn a_sentencepiece_vocabulary_merges_by_score_and_falls_back_to_bytes() {
    let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
    let mut types = vec![2, 3, 3];
    tokens.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
    types.extend([6; 256]);
    let pieces = [
        ("▁", -1.0),
        ("h", -2.0),
        ("i", -3.0),
        ("▁h", -4.0),
        ("hi", -5.0),
        ("▁hi", -6.0),
    ];
    let mut scores = vec![0.0; tokens.len()];
    for (piece, score) in pieces {
        tokens.push(piece.into());
        types.push(1);
        scores.push(score);
    }
    let id = |t: &str| tokens.iter().position(|x| x == t).unwrap() as u32;
    let (bos, space, hi, space_hi) = (id("<s>"), id("▁"), id("hi"), id("▁hi"));
    let w = sentencepiece_llama(tokens.clone(), types, scores);
    let dir = tempfile::tempdir().unwrap();
    let model = Model::load(&write(dir.path(), "spm.gguf", &w.bytes())).unwrap();
    // BOS by default; a space prefix; "▁hi" is made through the higher
    // scored "▁h" + "i"; "é" is not a piece, so it is its two UTF-8 bytes.
    let ids = model.tokenizer.encode("hi hi é").unwrap();
    assert_eq!(
        ids,
        vec![bos, space_hi, space_hi, space, id("<0xC3>"), id("<0xA9>")],
        "{ids:?}"
    );
    assert_eq!(model.tokenizer.decode(&ids).unwrap(), "hi hi é");
    assert_eq!(
        model.tokenizer.encode("hihi").unwrap(),
        vec![bos, space_hi, hi]
    );
    assert_eq!(model.config.bos_token_id, Some(bos));
}

/// Files crafted to take memory or time out of proportion to their size
/// are refused from their header, quickly.
#[test]
fn files_that_declare_more_than_they_hold_are_refused() {
    // Two tensors over the same bytes: 1,024 such layers over one region of
    // a 4.7 MB file reached 3 GB.
    let mut overlapping = tiny_llama(|_| {}).bytes();
    let offset_of = |bytes: &[u8], name: &[u8]| {
        let at = bytes.windows(name.len()).position(|w| w == name).unwrap() + name.len();
        // n_dims (4), two dims (16), type (4), then the offset.
        u64::from_le_bytes(bytes[at + 24..at + 32].try_into().unwrap())
    };
    let q = offset_of(&overlapping, b"blk.0.attn_q.weight");
    patch_u64_after(&mut overlapping, b"blk.0.attn_k.weight", 24, q);
    assert_rejected(&overlapping, "overlap");

    // A metadata array of 4 Mi + 1 bytes: each held as a 32-byte value.
    let mut huge_array = tiny_llama(|w| {
        string(&mut w.kv, "general.junk");
        w.kv.extend(9u32.to_le_bytes());
        w.kv.extend(0u32.to_le_bytes());
        let n = kiln_core::gguf::MAX_METADATA_ITEMS + 1;
        w.kv.extend((n as u64).to_le_bytes());
        w.kv.extend(std::iter::repeat_n(7u8, n));
        w.kv_count += 1;
    });
    let started = std::time::Instant::now();
    assert_rejected(
        &huge_array.bytes(),
        "general.junk brings the metadata's arrays",
    );
    assert!(started.elapsed() < std::time::Duration::from_secs(10));
    huge_array.kv.clear();

    // A SentencePiece vocabulary with one 17 KB piece: deriving its merges
    // is quadratic in its length (1 MB took minutes).
    let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into(), "a".into()];
    tokens.push("a".repeat(17_000));
    let types = vec![2, 3, 3, 1, 1];
    let scores = vec![0.0, 0.0, 0.0, -1.0, -2.0];
    let w = sentencepiece_llama(tokens, types, scores);
    let started = std::time::Instant::now();
    assert_rejected(&w.bytes(), "too long to derive merges");
    assert!(started.elapsed() < std::time::Duration::from_secs(10));
}

/// A Qwen2 file without one of its q/k/v biases is refused by the tensor's
/// name (llama.cpp's loader requires them too), not run without it.
#[test]
fn a_qwen2_file_missing_a_bias_names_it() {
    let path = fixture("qwen2-tied-bias.gguf");
    let mut bytes = std::fs::read(path).unwrap();
    let name = b"blk.1.attn_k.bias";
    let at = bytes.windows(name.len()).position(|w| w == name).unwrap();
    bytes[at + name.len() - 1] = b'z';
    assert_rejected(&bytes, "tensor blk.1.attn_k.bias is missing");
}

/// A one-layer Llama 32 wide whose every matrix is Q8_0, as llama.cpp's
/// `llama-quantize ... Q8_0` writes one, over [`tiny_llama`]'s vocabulary.
fn q8_0_llama() -> Writer {
    q8_0_llama_with_norm(1.0)
}

/// [`q8_0_llama`] whose first norm weight is `first`.
fn q8_0_llama_with_norm(first: f32) -> Writer {
    let (h, ffn) = (32u64, 64u64);
    tiny_llama_shaped(
        "smollm",
        &[],
        |_| {},
        (h, ffn),
        |w, vocab| q8_0_tensors(w, h, ffn, vocab, first),
    )
}

fn q8_0_tensors(w: &mut Writer, h: u64, ffn: u64, vocab: u64, first_norm: f32) {
    let ramp = |n: u64| {
        (0..n)
            .map(|i| ((i * 37 % 19) as f32 - 9.0) * 0.02)
            .collect::<Vec<_>>()
    };
    let (q, kv) = (h, h / 2);
    w.tensor_q8_0("token_embd.weight", &[h, vocab], &ramp(h * vocab));
    let mut norm = [1.0; 32];
    norm[0] = first_norm;
    w.tensor("blk.0.attn_norm.weight", &[h], &norm);
    for (name, rows, cols) in [
        ("attn_q", q, h),
        ("attn_k", kv, h),
        ("attn_v", kv, h),
        ("attn_output", h, q),
        ("ffn_gate", ffn, h),
        ("ffn_up", ffn, h),
        ("ffn_down", h, ffn),
    ] {
        w.tensor_q8_0(
            &format!("blk.0.{name}.weight"),
            &[cols, rows],
            &ramp(rows * cols),
        );
    }
    w.tensor("blk.0.ffn_norm.weight", &[h], &[1.0; 32]);
    w.tensor("output_norm.weight", &[h], &[1.0; 32]);
}

/// A Q8_0 file's matrices stay the file's blocks in memory (an 8B model's
/// 8.5 GB, where f32 would be 32 GB), the q and k rows unpermuted as whole
/// rows of blocks, and widen to the values the file's dequantized tensors
/// give.
#[test]
fn a_q8_0_files_matrices_are_held_as_its_blocks() {
    use kiln_core::weights::{Matrix, Values};
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "q8_0.gguf", &q8_0_llama().bytes());
    let model = Model::load(&path).unwrap();
    assert_eq!(model.config.hidden_size, 32);
    let file = GgufFile::open(&path).unwrap();
    let layer = &model.weights.layers[0];
    let mut file_bytes = 0;
    for (m, name) in [&model.weights.embed]
        .into_iter()
        .chain(layer.matrices())
        .zip([
            "token_embd",
            "blk.0.attn_q",
            "blk.0.attn_k",
            "blk.0.attn_v",
            "blk.0.attn_output",
            "blk.0.ffn_gate",
            "blk.0.ffn_up",
            "blk.0.ffn_down",
        ])
    {
        let info = file.tensor(&format!("{name}.weight")).unwrap();
        assert!(
            matches!(m.values(), Values::Blocks { ty, .. } if ty.name() == "Q8_0"),
            "{name} is held as {}",
            m.values().stored()
        );
        file_bytes += info.size;
        let mut want = Matrix::new(m.rows, m.cols, file.tensor_f32(info).unwrap());
        let heads = match name {
            "blk.0.attn_q" => 2,
            "blk.0.attn_k" => 1,
            _ => 0,
        };
        if heads > 0 {
            want = kiln_core::gguf::unpermute_rows(&want, heads);
        }
        assert_eq!(m.f32(), want.f32(), "{name}");
    }
    assert_eq!(model.weights.matrix_bytes(), file_bytes);
    let ids = model.tokenizer.encode("ab").unwrap();
    let logits =
        kiln_core::Backend::prefill(&mut kiln_core::CpuBackend::new(&model), &ids).unwrap();
    assert!(logits.iter().all(|v| v.is_finite()));
}

/// A NaN or infinite weight makes every logit NaN, which greedy decoding
/// would read as token 0: a GGUF file that holds one is refused, naming the
/// tensor, as a safetensors checkpoint is.
#[test]
fn a_gguf_files_non_finite_weights_are_named() {
    for bad in [f32::NAN, f32::INFINITY] {
        let message = Model::load(&write(
            tempfile::tempdir().unwrap().path(),
            "bad.gguf",
            &q8_0_llama_with_norm(bad).bytes(),
        ))
        .err()
        .map(|e| e.to_string());
        let message = message.expect("a file with a non-finite weight loads");
        assert!(
            message.contains("tensor blk.0.attn_norm.weight holds") && message.contains("corrupt"),
            "{message}"
        );
    }
}

/// A Q8_0 tensor as llama.cpp writes it, read by kiln's GGUF loader and
/// stored for the IREE backends' q8 (`kiln_xla::q8`): every block's scale
/// and values are the file's, bit for bit, so `--precision q8` (a Q8_0
/// file's default there) computes with the file's own blocks.
#[cfg(feature = "xla-iree")]
#[test]
fn a_q8_0_files_blocks_reach_the_device_as_written() {
    let (rows, cols) = (3u64, 96u64);
    let values: Vec<f32> = (0..rows * cols)
        .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.02)
        .collect();
    let mut w = Writer::default();
    w.kv("general.architecture", V::Str("llama"));
    let written = w.tensor_q8_0("m", &[cols, rows], &values);
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "q8_0.gguf", &w.bytes());
    let file = GgufFile::open(&path).unwrap();
    let info = file.tensor("m").unwrap();
    assert_eq!(info.ty.name(), "Q8_0");
    // As the GGUF loader holds it: the file's bytes.
    let m = kiln_core::weights::Matrix::stored(
        rows as usize,
        cols as usize,
        kiln_core::weights::Values::Blocks {
            ty: info.ty,
            bytes: file.tensor_bytes(info).to_vec(),
        },
    )
    .unwrap();
    let q = kiln_xla::q8::Q8Matrix::from_matrix(&m).unwrap();
    for (b, (d, levels)) in written.iter().enumerate() {
        assert_eq!(q.scales[b].to_bits(), d.to_bits(), "block {b}'s scale");
        assert_eq!(&q.quants[32 * b..][..32], levels, "block {b}'s values");
    }
}
