//! The Nix files against the pin file and the recorded input locks: the
//! checks `.ci/run` can make without evaluating the flake (nixpkgs cannot be
//! fetched there).

use std::path::{Path, PathBuf};

use serde_json::Value;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The flake's Nix sources are outside the source the flake builds from (so
/// that editing them rebuilds nothing); there, these tests have nothing to read.
fn nix_sources_present() -> bool {
    let present = root().join("flake.nix").is_file() && root().join("flake.lock").is_file();
    if !present {
        println!(
            "skipped: flake.nix/flake.lock are not in this source tree (the Nix build's filtered source)"
        );
    }
    present
}

fn json(path: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(root().join(path)).unwrap()).unwrap()
}

/// flake.nix and every file under nix/ that ends in .nix, except nix/eval/
/// and nix/build/: the evaluator's stand-in and the build's host-backed
/// package set stand for nixpkgs, not for kiln's packaging (the stand-in
/// describes nixpkgs' CUDA versions independently of the pins, so that
/// comparing the two means something; the package set fetches crane's own
/// helper's crates from crates.io by their Cargo.lock checksums).
fn nix_files() -> Vec<(PathBuf, String)> {
    let mut files = vec![root().join("flake.nix")];
    let mut dirs = vec![root().join("nix")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path == root().join("nix/eval") || path == root().join("nix/build") {
                continue;
            }
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "nix") {
                files.push(path);
            }
        }
    }
    files
        .into_iter()
        .map(|p| {
            let text = std::fs::read_to_string(&p).unwrap();
            (p, text)
        })
        .collect()
}

/// The input locks FACTS.md records (rev, narHash, lastModified). Moving one
/// is deliberate: change it here and say why in the commit.
const LOCKS: &[(&str, &str, &str, u64)] = &[
    (
        "nixpkgs",
        "531670d871c0e29724a02f3cbcac170adc65b58c",
        "sha256-ODZkEK9Gy50yg6h98u7KkitZ3oc/uuTFK00bh1CRdNA=",
        1785734586,
    ),
    (
        "crane",
        "10e6e3cb966f7cfcc789fe5eee7a85f3188ce08b",
        "sha256-nnGD2f8OlAZT2i5OfwikJsw+ifWfiA4d6A8BWlgOXV0=",
        1779041105,
    ),
    (
        "rust-overlay",
        "292249772330735cb32b90dedf44feddec40e7d0",
        "sha256-DauSP0ACycrq3MEEmDz/Scsxhs9TPBTexwKbTuE8Bw8=",
        1785736145,
    ),
];

#[test]
fn flake_lock_locks_every_input_by_revision_and_nar_hash() {
    if !nix_sources_present() {
        return;
    }
    let lock = json("flake.lock");
    assert_eq!(lock["version"], 7);
    let nodes = &lock["nodes"];
    let root_inputs: Vec<&String> = nodes["root"]["inputs"]
        .as_object()
        .unwrap()
        .keys()
        .collect();
    assert_eq!(root_inputs, ["crane", "nixpkgs", "rust-overlay"]);
    for (name, rev, nar_hash, last_modified) in LOCKS {
        let locked = &nodes[name]["locked"];
        assert_eq!(locked["type"], "github", "{name}");
        assert_eq!(locked["rev"], *rev, "{name}: rev");
        assert_eq!(locked["narHash"], *nar_hash, "{name}: narHash");
        assert_eq!(
            locked["lastModified"], *last_modified,
            "{name}: lastModified"
        );
    }
    assert_eq!(nodes["nixpkgs"]["original"]["ref"], "nixos-26.05");
    assert_eq!(nodes["crane"]["original"]["ref"], "v0.23.4");
    // rust-overlay uses the flake's nixpkgs, not a second one.
    assert_eq!(
        nodes["rust-overlay"]["inputs"]["nixpkgs"],
        serde_json::json!(["nixpkgs"])
    );
    // flake.nix declares the same inputs.
    let flake = std::fs::read_to_string(root().join("flake.nix")).unwrap();
    assert!(flake.contains("github:NixOS/nixpkgs/nixos-26.05"));
    assert!(flake.contains("github:ipetkov/crane/v0.23.4"));
    assert!(flake.contains("inputs.nixpkgs.follows = \"nixpkgs\""));
}

/// Every URL, hash, version, revision and CMake option name of the pin file.
fn pinned_strings(value: &Value, key: &str, out: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            for (k, v) in map {
                if k.starts_with('_') {
                    continue; // Comments.
                }
                if key == "common" || key == "cuda" && map.contains_key("IREE_HAL_DRIVER_CUDA") {
                    out.push(k.clone()); // A CMake option name.
                }
                pinned_strings(v, k, out);
            }
        }
        Value::Array(items) => items.iter().for_each(|v| pinned_strings(v, key, out)),
        Value::String(s)
            if matches!(
                key,
                "url" | "sha256" | "version" | "revision" | "version_line" | "name"
            ) =>
        {
            out.push(s.clone())
        }
        _ => {}
    }
}

#[test]
fn nix_files_take_every_url_hash_version_and_option_from_the_pin_file() {
    if !nix_sources_present() {
        return;
    }
    let mut pinned = Vec::new();
    pinned_strings(&json("nix/pins.json"), "", &mut pinned);
    assert!(pinned.len() > 40, "the walk found the pins: {pinned:?}");
    assert!(pinned.iter().any(|s| s == "IREE_HAL_DRIVER_CUDA"));
    for (path, text) in nix_files() {
        let shown = path
            .strip_prefix(root())
            .unwrap_or(&path)
            .display()
            .to_string();
        for pin in &pinned {
            assert!(
                !text.contains(pin.as_str()),
                "{shown} repeats {pin:?} from nix/pins.json"
            );
        }
        for literal in ["https://", "http://", "sha256-", "sha256 = \""] {
            assert!(
                !text.contains(literal),
                "{shown} has a `{literal}` literal: downloads come from nix/pins.json"
            );
        }
        // No 64-hex-digit hash of any kind.
        let hex_run = text
            .split(|c: char| !c.is_ascii_hexdigit())
            .any(|word| word.len() >= 40);
        assert!(!hex_run, "{shown} holds a hash literal");
    }
}

#[test]
fn the_nix_files_read_the_pin_file_and_the_toolchain_file() {
    if !nix_sources_present() {
        return;
    }
    let all: String = nix_files().into_iter().map(|(_, t)| t).collect();
    assert!(all.contains("importJSON ./pins.json"));
    assert!(all.contains("fromRustupToolchainFile ../rust-toolchain.toml"));
    assert!(Path::new(&root().join("rust-toolchain.toml")).is_file());
}
