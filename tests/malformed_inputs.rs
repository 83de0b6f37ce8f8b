//! Model folders and arguments crafted to crash a loader: each is an error
//! that names the problem, never a panic, an abort, a hang or an unbounded
//! read.

use std::path::{Path, PathBuf};
use std::process::Command;

use kiln_core::Model;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama-gqa-untied")
}

/// A copy of the fixture folder.
fn copy() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture()).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.path().join(path.file_name().unwrap())).unwrap();
    }
    dir
}

fn load_error(dir: &Path) -> String {
    match Model::load(dir) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e.to_string(),
    }
}

/// The fixture with one config.json field replaced by raw JSON text.
fn with_config(field: &str, value: &str) -> tempfile::TempDir {
    let dir = copy();
    let path = dir.path().join("config.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    json[field] = serde_json::from_str(value).unwrap();
    std::fs::write(&path, json.to_string()).unwrap();
    dir
}

#[test]
fn sizes_beyond_the_limits_are_named() {
    let cases = [
        ("num_hidden_layers", "1152921504606846976"), // 2^60: capacity overflow
        ("num_hidden_layers", "1000000000000"),       // 1e12: 328 TB of layers
        ("num_attention_heads", "4611686018427387904"), // products wrap
        ("num_key_value_heads", "4611686018427387904"),
        ("head_dim", "4611686018427387904"),
        ("hidden_size", "4611686018427387904"),
        ("vocab_size", "4611686018427387904"),
        ("intermediate_size", "4611686018427387904"),
        ("max_position_embeddings", "1000000000000000000"),
    ];
    for (field, value) in cases {
        let error = load_error(with_config(field, value).path());
        assert!(error.contains("limit"), "{field}={value}: {error}");
    }
}

#[test]
fn special_files_are_refused_without_reading_them() {
    for name in ["config.json", "tokenizer.json", "model.safetensors"] {
        let dir = copy();
        let path = dir.path().join(name);
        std::fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink("/dev/zero", &path).unwrap();
        let error = load_error(dir.path());
        assert!(error.contains("is a device"), "{name}: {error}");

        // A FIFO nobody writes to would block a reader forever.
        std::fs::remove_file(&path).unwrap();
        let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0);
        let error = load_error(dir.path());
        assert!(error.contains("is a FIFO"), "{name}: {error}");
    }
}

/// Peak resident memory of this process so far, in bytes.
fn peak_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    let kb: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kb * 1024
}

#[test]
fn a_huge_sparse_safetensors_file_is_rejected_from_its_header() {
    let dir = copy();
    let path = dir.path().join("model.safetensors");
    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    file.set_len(4 << 30).unwrap();
    let before = peak_rss();
    let error = load_error(dir.path());
    assert!(error.contains("not a safetensors file"), "{error}");
    let grown = peak_rss().saturating_sub(before);
    assert!(grown < 512 << 20, "loading read {grown} bytes into memory");
}

#[test]
fn unused_tensors_are_not_decoded() {
    // An int64 tensor the model does not use (some exports carry
    // rotary_emb.inv_freq or position ids): never read, so not an error.
    let dir = copy();
    let path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, safetensors::tensor::TensorView<'_>)> = file.tensors();
    let extra = [0u8; 16];
    tensors.push((
        "model.rotary_emb.position_ids".into(),
        safetensors::tensor::TensorView::new(safetensors::Dtype::I64, vec![2], &extra).unwrap(),
    ));
    safetensors::serialize_to_file(tensors, None, &path).unwrap();
    Model::load(dir.path()).unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn non_finite_weights_are_named() {
    for bad in [f32::NAN, f32::INFINITY] {
        let dir = copy();
        let path = dir.path().join("model.safetensors");
        let bytes = std::fs::read(&path).unwrap();
        let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut owned: Vec<(String, Vec<usize>, Vec<u8>)> = file
            .tensors()
            .into_iter()
            .map(|(name, view)| (name, view.shape().to_vec(), view.data().to_vec()))
            .collect();
        let norm = owned
            .iter_mut()
            .find(|t| t.0 == "model.norm.weight")
            .unwrap();
        norm.2[4..8].copy_from_slice(&bad.to_le_bytes());
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = owned
            .iter()
            .map(|(n, s, d)| {
                let view =
                    safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), d)
                        .unwrap();
                (n.clone(), view)
            })
            .collect();
        safetensors::serialize_to_file(views, None, &path).unwrap();
        let error = load_error(dir.path());
        assert!(
            error.contains("model.norm.weight holds") && error.contains("index 1"),
            "{bad}: {error}"
        );
    }
}

#[test]
fn a_max_tokens_that_overflows_is_a_context_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["generate", "--max-tokens", "18446744073709551615", "Hi"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("lower --max-tokens"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}
