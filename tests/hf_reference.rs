//! The CPU reference agrees with Hugging Face transformers' Llama, Mistral
//! and Qwen2: logits of every prompt position within 1e-4 (f32), and the same
//! greedy continuation. The fixtures are made by `scripts/make_fixture.py`.

use std::path::PathBuf;

use kiln_core::config::Family;
use kiln_core::{Backend, CpuBackend, Model};
use serde::Deserialize;

#[derive(Deserialize)]
struct Reference {
    prompts: Vec<Vec<u32>>,
    logits: Vec<Vec<Vec<f32>>>,
    greedy: Vec<Vec<u32>>,
}

fn fixture(name: &str) -> (Model, Reference) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    let model = Model::load(&dir).unwrap_or_else(|e| panic!("{e}"));
    let text = std::fs::read_to_string(dir.join("reference.json")).unwrap();
    (model, serde_json::from_str(&text).unwrap())
}

/// The fixture written as a GGUF file by `scripts/make_gguf_fixture.py`
/// (llama.cpp's writer, llama.cpp's layout for the family), with the
/// folder's reference.
fn gguf_fixture(name: &str) -> (Model, Reference) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/gguf")
        .join(format!("{name}.gguf"));
    let model = Model::load(&path).unwrap_or_else(|e| panic!("{e}"));
    (model, fixture(name).1)
}

fn check(name: &str) {
    let (model, reference) = fixture(name);
    agrees(name, &model, &reference);
}

/// The GGUF file describes the folder's model (the family, its switches
/// and sizes) and gives transformers' logits and greedy tokens.
fn check_gguf(name: &str) {
    let (model, reference) = gguf_fixture(name);
    let folder = fixture(name).0.config;
    // llama.cpp writes Mistral as `llama`: the same graph, and the window
    // is its own key.
    let family = match folder.family {
        Family::Mistral => Family::Llama,
        other => other,
    };
    let expected = kiln_core::ModelConfig { family, ..folder };
    assert_eq!(model.config, expected, "{name}");
    agrees(&format!("{name}.gguf"), &model, &reference);
}

fn agrees(name: &str, model: &Model, reference: &Reference) {
    let mut backend = CpuBackend::new(model);
    let vocab = model.config.vocab_size;
    for (i, prompt) in reference.prompts.iter().enumerate() {
        let ours = backend.prefill_all(prompt).unwrap();
        let theirs: Vec<f32> = reference.logits[i].iter().flatten().copied().collect();
        assert_eq!(ours.len(), prompt.len() * vocab);
        assert_eq!(ours.len(), theirs.len());
        let worst = kiln_core::testing::max_abs_diff(&ours, &theirs);
        println!("{name} prompt {i}: max |logit - transformers| = {worst:e}");
        assert!(
            worst <= 1e-4,
            "{name} prompt {i}: max abs logit difference {worst}"
        );

        // Greedy decoding with the KV cache gives transformers' tokens.
        let steps = reference.greedy[i].len();
        let generated =
            kiln_core::generate(&mut backend, prompt, steps, Default::default(), &[], |_| {
                Ok(())
            })
            .unwrap();
        assert_eq!(
            generated, reference.greedy[i],
            "{name} prompt {i}: greedy tokens"
        );
    }
}

/// Each family at its real widths and vocabulary agrees with transformers
/// as the small fixtures do.
#[test]
fn wide_fixtures_match_transformers() {
    for dir in kiln_core::testing::wide_fixtures() {
        let model = Model::load(&dir).unwrap_or_else(|e| panic!("{e}"));
        let text = std::fs::read_to_string(dir.join("reference.json")).unwrap();
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        agrees(&name, &model, &serde_json::from_str(&text).unwrap());
    }
}

#[test]
fn untied_grouped_query_llama3_rope_matches_transformers() {
    check("llama-gqa-untied");
}

#[test]
fn tied_multi_query_linear_rope_matches_transformers() {
    check("llama-mqa-tied");
}

#[test]
fn mistral_with_a_sliding_window_matches_transformers() {
    check("mistral-gqa-window");
}

/// kiln does not window attention: it runs a model with a sliding window
/// only up to the window, where the window holds every position, and
/// refuses a longer sequence instead of attending to all of it.
#[test]
fn a_sliding_window_caps_the_context() {
    let (model, _) = fixture("mistral-gqa-window");
    let window = model
        .config
        .sliding_window
        .expect("the fixture has a window");
    assert!(window < model.config.max_position_embeddings);
    let mut backend = CpuBackend::new(&model);
    assert_eq!(backend.max_context(), window);
    let ids: Vec<u32> = (0..window as u32).map(|i| i % 90 + 3).collect();
    backend
        .prefill(&ids)
        .expect("a window's worth of tokens runs");
    let mut longer = ids.clone();
    longer.push(5);
    let error = backend.prefill(&longer).unwrap_err().to_string();
    assert!(error.contains(&window.to_string()), "{error}");
}

/// Mistral as llama.cpp writes it: architecture `llama`, q and k rows
/// permuted, the window under `llama.attention.sliding_window`.
#[test]
fn mistral_gguf_matches_transformers() {
    check_gguf("mistral-gqa-window");
}

/// Qwen2 as llama.cpp writes it: architecture `qwen2`, q and k as stored,
/// the biases as `blk.N.attn_{q,k,v}.bias`, no output matrix (tied).
#[test]
fn qwen2_gguf_matches_transformers() {
    check_gguf("qwen2-tied-bias");
}

#[test]
fn qwen2_with_qkv_biases_matches_transformers() {
    check("qwen2-tied-bias");
}

#[test]
fn fixtures_cover_what_they_claim() {
    let (untied, _) = fixture("llama-gqa-untied");
    assert!(!untied.config.tie_word_embeddings && untied.weights.lm_head.is_some());
    assert_eq!(untied.config.group_size(), 3);
    assert!(matches!(
        untied.config.rope_scaling,
        Some(kiln_core::RopeScaling::Llama3 { .. })
    ));
    assert_eq!(untied.config.family, Family::Llama);
    let (mistral, _) = fixture("mistral-gqa-window");
    assert_eq!(mistral.config.family, Family::Mistral);
    assert_eq!(mistral.config.rope_theta, 1e6);
    assert!(mistral.config.rope_scaling.is_none() && mistral.weights.lm_head.is_some());
    let (qwen2, _) = fixture("qwen2-tied-bias");
    assert_eq!(qwen2.config.family, Family::Qwen2);
    assert!(qwen2.config.qkv_bias && qwen2.config.tie_word_embeddings);
    // Its window is switched off (`use_sliding_window: false`).
    assert_eq!(qwen2.config.context_limit(), 64);
    let bias = qwen2.weights.layers[1].qkv_bias.as_ref().unwrap();
    assert_eq!(bias.len(), 64 + 2 * 32);
    assert!(bias.iter().any(|b| b.abs() > 0.1), "biases far from zero");
    let (tied, _) = fixture("llama-mqa-tied");
    assert!(tied.config.tie_word_embeddings && tied.weights.lm_head.is_none());
    assert_eq!(tied.config.num_kv_heads, 1);
    assert!(matches!(
        tied.config.rope_scaling,
        Some(kiln_core::RopeScaling::Linear { .. })
    ));
}
