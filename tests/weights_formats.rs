//! Weights in every layout kiln reads: one file or shards, f32, f16 or bf16;
//! and the errors for tensors that are missing, misshapen or duplicated.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use kiln_core::Model;
use safetensors::{Dtype, SafeTensors, serialize_to_file, tensor::TensorView};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama-gqa-untied")
}

/// The fixture's tensors as (name, shape, f32 values).
fn tensors() -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(fixture().join("model.safetensors")).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<_> = file
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            assert_eq!(view.dtype(), Dtype::F32);
            let values = view
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            (name, view.shape().to_vec(), values)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn encode(values: &[f32], dtype: Dtype) -> Vec<u8> {
    match dtype {
        Dtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        Dtype::F16 => values
            .iter()
            .flat_map(|v| f16::from_f32(*v).to_le_bytes())
            .collect(),
        Dtype::BF16 => values
            .iter()
            .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
            .collect(),
        other => panic!("{other:?}"),
    }
}

/// A model folder with the fixture's config and tokenizer and the given
/// tensors split over `shards` files in `dtype`.
fn folder(
    tensors: &[(String, Vec<usize>, Vec<f32>)],
    dtype: Dtype,
    shards: usize,
) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for file in ["config.json", "tokenizer.json"] {
        std::fs::copy(fixture().join(file), dir.path().join(file)).unwrap();
    }
    let encoded: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(n, s, v)| (n.clone(), s.clone(), encode(v, dtype)))
        .collect();
    for shard in 0..shards {
        let views: HashMap<String, TensorView<'_>> = encoded
            .iter()
            .enumerate()
            .filter(|(i, _)| i % shards == shard)
            .map(|(_, (n, s, b))| (n.clone(), TensorView::new(dtype, s.clone(), b).unwrap()))
            .collect();
        let name = format!("model-{:05}-of-{shards:05}.safetensors", shard + 1);
        serialize_to_file(&views, None, &dir.path().join(name)).unwrap();
    }
    dir
}

fn max_diff(a: &Model, b: &Model) -> f32 {
    let pairs = [
        (a.weights.embed.f32(), b.weights.embed.f32()),
        (
            a.weights.final_norm[..].into(),
            b.weights.final_norm[..].into(),
        ),
    ];
    let mut worst = 0.0f32;
    for (x, y) in pairs {
        worst = worst.max(kiln_core::testing::max_abs_diff(&x, &y));
    }
    for (la, lb) in a.weights.layers.iter().zip(&b.weights.layers) {
        for (x, y) in [
            (la.wq.f32(), lb.wq.f32()),
            (la.w_down.f32(), lb.w_down.f32()),
        ] {
            worst = worst.max(kiln_core::testing::max_abs_diff(&x, &y));
        }
    }
    worst
}

fn load(dir: &Path) -> kiln_core::Result<Model> {
    Model::load(dir)
}

#[test]
fn shards_and_half_precisions_load_to_the_same_weights() {
    let original = load(&fixture()).unwrap();
    let all = tensors();
    let sharded = folder(&all, Dtype::F32, 3);
    assert_eq!(max_diff(&original, &load(sharded.path()).unwrap()), 0.0);
    // f16 keeps 11 significant bits, bf16 8: the weights here are below 1.5.
    let f16_model = load(folder(&all, Dtype::F16, 2).path()).unwrap();
    assert!(
        max_diff(&original, &f16_model) <= 1.5 * 2f32.powi(-11),
        "f16"
    );
    let bf16_model = load(folder(&all, Dtype::BF16, 1).path()).unwrap();
    let d = max_diff(&original, &bf16_model);
    assert!(d > 0.0 && d <= 1.5 * 2f32.powi(-8), "bf16: {d}");
}

#[test]
fn missing_misshapen_and_duplicated_tensors_are_named() {
    let all = tensors();
    let missing: Vec<_> = all
        .iter()
        .filter(|t| t.0 != "model.norm.weight")
        .cloned()
        .collect();
    let error = load(folder(&missing, Dtype::F32, 1).path())
        .err()
        .unwrap()
        .to_string();
    assert!(error.contains("model.norm.weight is missing"), "{error}");

    let mut misshapen = all.clone();
    let norm = misshapen
        .iter_mut()
        .find(|t| t.0 == "model.norm.weight")
        .unwrap();
    norm.1 = vec![norm.2.len() - 1];
    norm.2.pop();
    let error = load(folder(&misshapen, Dtype::F32, 1).path())
        .err()
        .unwrap()
        .to_string();
    assert!(error.contains("model.norm.weight has shape"), "{error}");

    // The same tensor in two shards.
    let dir = folder(&all, Dtype::F32, 1);
    let first = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .unwrap();
    std::fs::copy(&first, dir.path().join("copy.safetensors")).unwrap();
    let error = load(dir.path()).err().unwrap().to_string();
    assert!(error.contains("more than one file"), "{error}");

    // Not a safetensors file at all.
    std::fs::write(dir.path().join("copy.safetensors"), b"not safetensors").unwrap();
    let error = load(dir.path()).err().unwrap().to_string();
    assert!(error.contains("not a safetensors file"), "{error}");
}
