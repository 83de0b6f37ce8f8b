//! What `kiln generate` prints is the tokenizer's decode of what it
//! generated, byte for byte, when characters span several tokens; `kiln
//! prefill` tells apart candidates that are parts of characters.

use std::process::Command;

use kiln_core::testing::{byte_level_json, successor_model};

/// The model of the reported case: after "x" it generates ids 139 154 103
/// 44 310, then EOS (0).
fn reported_case_model(dir: &std::path::Path) {
    let tokenizer = byte_level_json(&["<|endoftext|>", "<|im_start|>"]);
    let x = 2 + u32::from(b'x' - b'!'); // the prompt "x", one byte token
    let mut next = vec![0; 320]; // everything else ends the text (EOS 0)
    for (from, to) in [(x, 139), (139, 154), (154, 103), (103, 44), (44, 310)] {
        next[from as usize] = to;
    }
    successor_model(dir, &tokenizer, &next, vec![0]).unwrap();
}

/// The reported case: on a 320-token byte-level BPE, ids 139 154 103 44 310
/// (0xCD, 0xDC 0xA8, `K`, "as") decode as `�ܨKas`; the old printer wrote
/// `��as`.
#[test]
fn generate_prints_every_character_of_split_multibyte_text() {
    let dir = tempfile::tempdir().unwrap();
    reported_case_model(dir.path());

    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["generate", "--model"])
        .arg(dir.path())
        .arg("x")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("1 prompt tokens, 6 generated"), "{stderr}");
    assert_eq!(String::from_utf8(out.stdout).unwrap(), "\u{fffd}ܨKas\n");
}

#[test]
fn prefill_names_the_bytes_of_partial_characters() {
    let dir = tempfile::tempdir().unwrap();
    reported_case_model(dir.path());
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["prefill", "--top", "1", "--model"])
        .arg(dir.path())
        .arg("x")
        .output()
        .unwrap();
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Id 139 is the byte 0xCD, spelled "Í" in a GPT-2 style vocabulary.
    let line = stdout.lines().nth(1).unwrap();
    assert!(line.trim_start().starts_with("139 "), "{stdout}");
    assert!(
        line.ends_with("\"\u{fffd}\" (vocabulary entry \"Í\")"),
        "{stdout}"
    );
}
