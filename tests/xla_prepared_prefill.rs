//! Prepared prefill and decode through IREE (`local-task`) against the CPU
//! reference, for the embedded model and the transformers fixtures.
//!
//! Needs the `xla-iree` feature, `KILN_IREE_PREFIX` and `KILN_IREE_COMPILE`
//! (`cargo xtask test` sets them up).

use std::path::PathBuf;

use kiln_core::sampling::argmax;
use kiln_core::testing::max_abs_diff;
use kiln_core::{Backend, CpuBackend, Model, SamplingParams, generate};
use kiln_xla::{
    Buckets, Compiler, DecodeAttention, GraphOptions, IreeBackend, ModuleCache, ModuleKind, Origin,
    Precision, Q4Rows, Target, WeightLayout,
};

fn fixture(name: &str) -> Model {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    Model::load(&dir).unwrap()
}

/// The model with every weight rounded to f16 and back: the reference a
/// half-precision graph is compared with, so that what is measured is the
/// graph's own rounding (activations, KV cache), not the weights'.
fn rounded_to_f16(model: &Model) -> Model {
    let dir = tempfile::tempdir().unwrap();
    kiln_core::save::save_f16(dir.path(), &model.config, &model.weights).unwrap();
    let weights = kiln_core::weights::load_dir(dir.path(), &model.config).unwrap();
    with_weights(model, "f16 weights", weights)
}

/// `model`'s configuration with other weights, named for what they are.
fn with_weights(model: &Model, what: &str, weights: kiln_core::weights::Weights) -> Model {
    Model {
        name: format!("{} ({what})", model.name),
        config: model.config.clone(),
        weights,
        tokenizer: kiln_core::Tokenizer::Bytes(kiln_core::tokenizer::ByteTokenizer),
        chat: Default::default(),
    }
}

fn iree(model: &Model, cache: ModuleCache) -> IreeBackend<'_> {
    on_cpu(model, None, None, cache)
}

/// An IREE `local-task` backend at the given precision and layout (each
/// defaulting to the CPU target's).
fn on_cpu(
    model: &Model,
    precision: Option<Precision>,
    layout: Option<WeightLayout>,
    cache: ModuleCache,
) -> IreeBackend<'_> {
    let graph = GraphOptions::for_target(Target::LlvmCpu, precision, layout);
    with_graph_on_cpu(model, graph, cache)
}

/// An IREE `local-task` backend running `graph` (another target's choices
/// included) on the CPU. CUDA's rotation and cache append is a kernel for
/// the GPU only (`kernels/rope_append.cu`; its arithmetic is checked on the
/// host by kiln-xla's tests, and on the GPU by the `cuda::` tests): here
/// the graph's own arithmetic does it.
fn with_graph_on_cpu(model: &Model, graph: GraphOptions, cache: ModuleCache) -> IreeBackend<'_> {
    let graph = GraphOptions {
        append_kernel: false,
        q8_kernel: false,
        ..graph
    };
    open(model, "local-task", Target::LlvmCpu, graph, cache).unwrap_or_else(|e| panic!("{e}"))
}

/// An IREE backend with context 64. The compiler is optional: a GPU machine
/// runs modules prepared elsewhere (`kiln prepare`) from the carried cache.
fn open<'m>(
    model: &'m Model,
    uri: &str,
    target: Target,
    graph: GraphOptions,
    cache: ModuleCache,
) -> kiln_core::Result<IreeBackend<'m>> {
    let compiler = match Compiler::from_env() {
        Ok(compiler) => Some(compiler),
        Err(kiln_xla::Error::CompilerUnset) => None,
        Err(e) => panic!("{e}"),
    };
    IreeBackend::new(
        model,
        uri,
        target,
        graph,
        compiler,
        cache,
        Buckets::for_model(model, 64),
    )
}

fn default_cache() -> ModuleCache {
    ModuleCache::default_location().unwrap()
}

/// Prompts of several lengths, within the vocabulary.
fn prompts(model: &Model) -> Vec<Vec<u32>> {
    let v = model.config.vocab_size as u32;
    vec![
        vec![1 % v],
        (0..7).map(|i| (i * 13 + 5) % v).collect(),
        (0..40).map(|i| (i * 29 + 3) % v).collect(),
    ]
}

fn agrees_with_the_cpu_reference(model: &Model) {
    let mut xla = iree(model, default_cache());
    agrees(model, &mut xla, 1e-4, 16);
}

/// IREE logits within `tolerance` of the CPU reference for prompts of several
/// lengths and for decode steps (the logits path, which uploads each token);
/// prefill from embeddings equal to prefill from ids; `steps` greedy decode
/// steps (the device-argmax path) giving the CPU reference's tokens. Returns
/// the largest logit difference seen.
fn agrees(model: &Model, xla: &mut IreeBackend<'_>, tolerance: f32, steps: usize) -> f32 {
    let mut cpu = CpuBackend::new(model);
    let mut worst = 0.0f32;
    let mut check = |what: String, expected: &[f32], actual: &[f32]| {
        let diff = max_abs_diff(expected, actual);
        println!("{what}: max |iree - cpu| = {diff:e}");
        assert!(
            diff <= tolerance,
            "{what}: max abs diff {diff} > {tolerance}"
        );
        worst = worst.max(diff);
    };
    for prompt in prompts(model) {
        let expected = cpu.prefill(&prompt).unwrap();
        let actual = xla.prefill(&prompt).unwrap();
        check(
            format!("prefill of {} tokens", prompt.len()),
            &expected,
            &actual,
        );

        // Prepared prefill: the same tokens' embedding rows give the same logits.
        let rows = kiln_core::forward::embed(&model.weights, &prompt);
        let from_rows = xla.prefill_embeddings(&rows).unwrap();
        let diff = max_abs_diff(&actual, &from_rows);
        assert!(diff <= 1e-5, "embeddings vs ids: max abs diff {diff}");
    }
    // Decode logits, feeding tokens that are not the greedy choice.
    let prompt = &prompts(model)[1];
    cpu.prefill(prompt).unwrap();
    xla.prefill(prompt).unwrap();
    for step in 0..4u32 {
        let token = (step * 31 + 2) % model.config.vocab_size as u32;
        let expected = cpu.decode(token).unwrap();
        let actual = xla.decode(token).unwrap();
        check(format!("decode step {step}"), &expected, &actual);
    }
    // Greedy steps through the device-resident KV cache.
    let greedy = SamplingParams::default();
    let want = generate(&mut cpu, prompt, steps, greedy.clone(), &[], |_| Ok(())).unwrap();
    let got = generate(xla, prompt, steps, greedy, &[], |_| Ok(())).unwrap();
    assert_eq!(got, want, "{} greedy tokens on {}", steps, xla.name());
    worst
}

#[test]
fn embedded_model_matches_the_cpu_reference() {
    agrees_with_the_cpu_reference(&Model::embedded());
}

#[test]
fn untied_gqa_fixture_matches_the_cpu_reference() {
    agrees_with_the_cpu_reference(&fixture("llama-gqa-untied"));
}

#[test]
fn tied_mqa_fixture_matches_the_cpu_reference() {
    agrees_with_the_cpu_reference(&fixture("llama-mqa-tied"));
}

/// Mistral's config (θ 1e6, a sliding window the context is capped at):
/// the same graph, within the same bound (tests/hf_reference.rs holds the
/// reference to transformers).
#[test]
fn mistral_fixture_matches_the_cpu_reference() {
    let model = fixture("mistral-gqa-window");
    assert_eq!(model.config.context_limit(), 40);
    agrees_with_the_cpu_reference(&model);
}

/// Qwen2's q/k/v biases (far from zero in the fixture), tied embeddings,
/// θ 1e6: within the same bound (tests/hf_reference.rs holds the reference
/// to transformers).
#[test]
fn qwen2_fixture_matches_the_cpu_reference() {
    agrees_with_the_cpu_reference(&fixture("qwen2-tied-bias"));
}

/// A random model with a 32000-token vocabulary (`random-100m`).
fn wide_vocabulary_model() -> Model {
    let (config, seed) = kiln_core::model::preset("random-100m").unwrap();
    Model::random("random-100m", config, seed)
}

/// Greedy decoding through the device's argmax (`decode_greedy`) picks the
/// tokens the host's argmax picks from the same backend's logits.
fn device_argmax_matches_host_argmax(xla: &mut IreeBackend<'_>) {
    let prompt: Vec<u32> = (0..16).map(|i| (i * 7919 + 11) % 32_000).collect();
    let run = |xla: &mut IreeBackend<'_>, on_device: bool| -> Vec<u32> {
        let mut token = argmax(&xla.prefill(&prompt).unwrap());
        let mut tokens = vec![token];
        for _ in 0..8 {
            token = if on_device {
                xla.decode_greedy(token).unwrap()
            } else {
                argmax(&xla.decode(token).unwrap())
            };
            tokens.push(token);
        }
        tokens
    };
    let host = run(xla, false);
    let device = run(xla, true);
    assert_eq!(device, host, "device argmax on {}", xla.name());
}

/// What a caller sees of greedy decoding on `xla` (context 64): whole
/// runs of greedy steps, a token fed that is not the greedy choice (a
/// caller breaking off mid-chain), a sampled step (`decode`), a rewind, and
/// greedy steps until the context is full, where chains no longer fit.
fn greedy_transcript(xla: &mut IreeBackend<'_>, vocab: usize) -> Vec<String> {
    let vocab = vocab as u32;
    let prompt: Vec<u32> = (0..5).map(|i| (i * 13 + 5) % vocab).collect();
    let mut token = argmax(&xla.prefill(&prompt).unwrap());
    let mut seen = vec![format!("prefill {token}")];
    let greedy = |xla: &mut IreeBackend<'_>, token: &mut u32, n: usize, seen: &mut Vec<_>| {
        for _ in 0..n {
            *token = xla.decode_greedy(*token).unwrap();
            seen.push(format!("greedy {token} at {}", xla.sequence_len()));
        }
    };
    greedy(xla, &mut token, 9, &mut seen);
    token = (token + 1) % vocab;
    seen.push(format!("fed {token}"));
    greedy(xla, &mut token, 6, &mut seen);
    token = argmax(&xla.decode(token).unwrap());
    seen.push(format!("decode {token} at {}", xla.sequence_len()));
    greedy(xla, &mut token, 3, &mut seen);
    xla.rewind(20).unwrap();
    token = 7 % vocab;
    seen.push(format!("rewound, fed {token}"));
    greedy(xla, &mut token, 5, &mut seen);
    loop {
        match xla.decode_greedy(token) {
            Ok(next) => {
                token = next;
                seen.push(format!("greedy {token} at {}", xla.sequence_len()));
            }
            Err(error) => {
                seen.push(format!("{error} at {}", xla.sequence_len()));
                return seen;
            }
        }
        assert!(seen.len() < 200, "decoding past the context of 64");
    }
}

/// Greedy decoding with several steps a call sees what one step a call
/// sees (every token, the caller's position, the context's end), pipelined
/// or not, and does run the chained module.
fn chained_steps_match_single_steps(
    model: &'static Model,
    mut open: impl FnMut(usize, bool) -> IreeBackend<'static>,
) {
    let vocab = model.config.vocab_size;
    for pipelined in [true, false] {
        let mut single = open(1, pipelined);
        let expected = greedy_transcript(&mut single, vocab);
        assert!(expected.last().unwrap().contains("context"), "{expected:?}");
        for steps in [4, 3] {
            let mut chained = open(steps, pipelined);
            assert_eq!(
                greedy_transcript(&mut chained, vocab),
                expected,
                "{steps} steps a call, pipeline {pipelined}"
            );
            assert!(
                chained
                    .loaded_modules()
                    .contains(&ModuleKind::DecodeChain(steps)),
                "{:?}",
                chained.loaded_modules()
            );
        }
    }
}

#[test]
fn chained_greedy_steps_match_single_steps_on_the_cpu() {
    let model: &'static Model = Box::leak(Box::new(fixture("llama-gqa-untied")));
    chained_steps_match_single_steps(model, |steps, pipelined| {
        let mut xla = iree(model, default_cache());
        xla.set_pipelined(pipelined);
        xla.set_steps_per_call(steps).unwrap();
        xla
    });
}

#[test]
fn steps_per_call_out_of_range_are_refused_by_name() {
    let model = Model::embedded();
    let mut xla = iree(&model, default_cache());
    for steps in [0, kiln_xla::MAX_STEPS_PER_CALL + 1] {
        let error = xla.set_steps_per_call(steps).unwrap_err().to_string();
        assert!(error.contains("--steps-per-call"), "{error}");
    }
}

#[test]
fn device_argmax_matches_host_argmax_on_the_cpu() {
    let model = wide_vocabulary_model();
    device_argmax_matches_host_argmax(&mut iree(&model, default_cache()));
}

#[test]
fn both_weight_layouts_give_the_same_model() {
    let model = fixture("llama-gqa-untied");
    for layout in WeightLayout::ALL {
        let mut xla = on_cpu(&model, Some(Precision::F32), Some(layout), default_cache());
        agrees(&model, &mut xla, 1e-4, 8);
    }
}

/// A small random Llama whose gate/up and output rows at `[in, out]` are a
/// whole number of 4 KiB pages at f32 and at f16 (2,048 columns each), so
/// that both are stored padded ([`kiln_xla::padded_row`]).
fn page_wide_model() -> Model {
    let config = kiln_core::ModelConfig {
        hidden_size: 64,
        intermediate_size: 1024,
        num_layers: 2,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 16,
        vocab_size: 2048,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: None,
        tie_word_embeddings: false,
        max_position_embeddings: 128,
        sliding_window: None,
        qkv_bias: false,
        family: kiln_core::config::Family::Llama,
        bos_token_id: None,
        eos_token_ids: vec![],
    };
    Model::random("page-wide", config, 4096)
}

/// Padded rows (their zero columns sliced off in the graph) give the same
/// model: at f32 within the f32 bound, at f16 and bf16 within the half
/// bound of the reference on the rounded weights.
#[test]
fn padded_weight_rows_give_the_same_model() {
    let model = page_wide_model();
    for width in [2 * model.config.intermediate_size, model.config.vocab_size] {
        assert_ne!(kiln_xla::padded_row(width, 4), width);
        assert_ne!(kiln_xla::padded_row(width, 2), width);
    }
    let mut xla = on_cpu(
        &model,
        Some(Precision::F32),
        Some(WeightLayout::InOut),
        default_cache(),
    );
    agrees(&model, &mut xla, 1e-4, 8);
    let rounded = rounded_to_f16(&model);
    let mut xla = on_cpu(
        &rounded,
        Some(Precision::F16),
        Some(WeightLayout::InOut),
        default_cache(),
    );
    let worst = agrees(&rounded, &mut xla, F16_BOUND, 8);
    println!("page-wide f16 worst |iree - cpu| = {worst:e}");
}

/// The CUDA target's graph choices, run on the CPU: each KV head's query
/// group padded with zero heads, and the RMSNorm weights folded into the
/// next matrices with the one-row products in f32, in both weight layouts
/// (CUDA's is `[out, in]`).
/// They give the same model: at f32 within the f32 bound, at f16 within
/// [`F16_BOUND`] of the reference on the rounded weights. (Each choice alone
/// also passed when it was added.)
#[test]
fn the_cuda_graph_choices_give_the_same_model() {
    for name in ["llama-gqa-untied", "llama-mqa-tied"] {
        for layout in WeightLayout::ALL {
            for precision in [Precision::F32, Precision::F16] {
                let model = match precision {
                    Precision::F32 => fixture(name),
                    _ => rounded_to_f16(&fixture(name)),
                };
                let graph = GraphOptions::for_target(Target::Cuda, Some(precision), Some(layout));
                assert_ne!(
                    graph,
                    GraphOptions::for_target(Target::LlvmCpu, Some(precision), Some(layout)),
                    "the CUDA target makes graph choices of its own"
                );
                let mut xla = with_graph_on_cpu(&model, graph, default_cache());
                let bound = if precision == Precision::F32 {
                    1e-4
                } else {
                    F16_BOUND
                };
                let worst = agrees(&model, &mut xla, bound, 8);
                println!("{name} {precision} {layout}, CUDA's graph: worst {worst:e}");
            }
        }
    }
}

/// f16 weights and KV cache, against the CPU reference run on the same
/// rounded weights, within [`F16_BOUND`]; greedy tokens must still match.
#[test]
fn half_precisions_stay_within_their_bounds_on_the_cpu() {
    let model = rounded_to_f16(&fixture("llama-gqa-untied"));
    let mut xla = on_cpu(&model, Some(Precision::F16), None, default_cache());
    let worst = agrees(&model, &mut xla, F16_BOUND, 16);
    println!("f16 worst |iree - cpu| = {worst:e}");
}

/// The model with the weights a q4 graph computes with on `model`'s
/// (`kiln_xla::q4::device_weights`): the reference q4 is measured against.
fn q4_reference(model: &Model) -> Model {
    let weights = kiln_xla::q4::device_weights(&model.weights).unwrap();
    with_weights(model, "q4 weights", weights)
}

/// q4 weights (4-bit blocks dequantized inside the products), in the CPU
/// target's graph and in CUDA's (norms folded, rows in f32), against the
/// CPU reference on the dequantized weights, within [`Q4_BOUND`]; greedy
/// tokens match. The quantization is real: the reference's logits move by
/// far more than the bound from the unquantized model's.
#[test]
fn q4_weights_agree_with_the_reference_on_their_dequantized_weights() {
    // f16-exact weights: the embedding and norms the graph rounds to f16
    // are then the reference's too.
    let model = rounded_to_f16(&Model::embedded());
    for target in [Target::LlvmCpu, Target::Cuda] {
        let graph = GraphOptions::for_target(target, Some(Precision::Q4), None);
        // The reference's weights keep the norms apart, as every q4 graph does.
        assert!(
            !graph.folds_norm_weights(),
            "{target:?}'s q4 graph folds norm weights"
        );
        let reference = q4_reference(&model);
        let prompt = [3, 1, 4, 1, 5];
        let moved = max_abs_diff(
            &CpuBackend::new(&model).prefill(&prompt).unwrap(),
            &CpuBackend::new(&reference).prefill(&prompt).unwrap(),
        );
        assert!(
            moved > 10.0 * Q4_BOUND,
            "quantizing moved the logits by only {moved}"
        );
        // CUDA's one-row products are kiln's kernel, which runs on the GPU
        // only; on the CPU they are the same arithmetic through IREE.
        let on_cpu = GraphOptions {
            q4_rows: Q4Rows::Integer,
            ..graph
        };
        let mut xla = with_graph_on_cpu(&model, on_cpu, default_cache());
        let worst = agrees(&reference, &mut xla, Q4_BOUND, 16);
        println!(
            "q4, {target:?}'s graph: worst |iree - cpu| = {worst:e}; quantizing moved {moved:e}"
        );
    }
}

/// Qwen2 at q4: the q/k/v biases (kept in f16 beside the 4-bit matrices)
/// added after the 4-bit products, in the CPU target's graph and in CUDA's
/// choices run on the CPU (norms folded into the matrices), within
/// [`Q4_BOUND`] of the reference on the dequantized weights.
#[test]
fn qwen2_at_q4_matches_the_reference_on_its_dequantized_weights() {
    let model = rounded_to_f16(&fixture("qwen2-tied-bias"));
    assert!(model.weights.layers[0].qkv_bias.is_some());
    for target in [Target::LlvmCpu, Target::Cuda] {
        let graph = GraphOptions::for_target(target, Some(Precision::Q4), None);
        let reference = q4_reference(&model);
        let on_cpu = GraphOptions {
            q4_rows: Q4Rows::Integer,
            ..graph
        };
        let mut xla = with_graph_on_cpu(&model, on_cpu, default_cache());
        let worst = agrees(&reference, &mut xla, Q4_BOUND, 16);
        println!("qwen2 q4, {target:?}'s graph: worst |iree - cpu| = {worst:e}");
    }
}

/// The model with the weights a q8 graph computes with on `model`'s
/// (`kiln_xla::q8::device_weights`).
fn q8_reference(model: &Model) -> Model {
    let weights = kiln_xla::q8::device_weights(&model.weights).unwrap();
    with_weights(model, "q8 weights", weights)
}

/// q8 weights (8-bit blocks, GGUF's Q8_0, dequantized inside the
/// products), in the CPU target's graph and in CUDA's (norms folded, rows
/// in f32), on the embedded model and on Qwen2's biases, against the CPU
/// reference on the dequantized weights, within [`Q8_BOUND`]; greedy tokens
/// match. The quantization is real: on the embedded model the reference's
/// logits move from the unquantized model's by more than twice the bound,
/// so a graph that left the weights unquantized would fail.
#[test]
fn q8_weights_agree_with_the_reference_on_their_dequantized_weights() {
    for (model, visible) in [
        (Model::embedded(), true),
        (fixture("qwen2-tied-bias"), false),
    ] {
        let model = rounded_to_f16(&model);
        let reference = q8_reference(&model);
        let prompt = [3, 1, 4, 1, 5];
        let moved = max_abs_diff(
            &CpuBackend::new(&model).prefill(&prompt).unwrap(),
            &CpuBackend::new(&reference).prefill(&prompt).unwrap(),
        );
        assert!(
            moved > 0.0 && (!visible || moved > 2.0 * Q8_BOUND),
            "quantizing to 8 bits moved the logits by only {moved}"
        );
        for target in [Target::LlvmCpu, Target::Cuda] {
            let graph = GraphOptions::for_target(target, Some(Precision::Q8), None);
            assert!(!graph.folds_norm_weights());
            let mut xla = with_graph_on_cpu(&model, graph, default_cache());
            let worst = agrees(&reference, &mut xla, Q8_BOUND, 16);
            println!(
                "{} q8, {target:?}'s graph: worst |iree - cpu| = {worst:e}; quantizing moved {moved:e}",
                model.name
            );
        }
    }
}

/// The bound for the q4 graph against the reference on its dequantized
/// weights: 5x the worst measured (see the test's output).
const Q4_BOUND: f32 = 5e-3;

/// The bound for the q8 graph against the reference on its dequantized
/// weights: 2.6x the worst measured on the CPU (1.15e-3, the embedded
/// model; the f16 embedding and caches, not the blocks).
const Q8_BOUND: f32 = 3e-3;

/// The bound for the f16 graph against the reference on f16-rounded
/// weights: 5x the worst measured (1.0e-3 on the H200, embedded model;
/// 2.1e-4 on the CPU; docs/gpu.md).
const F16_BOUND: f32 = 5e-3;

/// A tensor-parallel rank's graphs need collectives, which IREE's CPU
/// devices do not have: opening them there is a clear error that says
/// where they run, not a failure inside IREE.
#[test]
fn tensor_parallel_graphs_on_the_cpu_are_a_clear_error() {
    let model = Model::embedded();
    let graph = GraphOptions {
        tensor_parallel: Some(1),
        ..GraphOptions::for_target(Target::LlvmCpu, None, None)
    };
    let error = open(
        &model,
        "local-task",
        Target::LlvmCpu,
        graph,
        default_cache(),
    )
    .err()
    .expect("tensor-parallel graphs opened on the CPU");
    let message = error.to_string();
    assert!(
        message.contains("collectives") && message.contains("iree-cuda"),
        "{message}"
    );
}

#[test]
fn a_prompt_longer_than_the_largest_bucket_is_a_clear_error() {
    let model = Model::embedded();
    let mut xla = iree(&model, default_cache());
    let largest = *xla.buckets().prefill.last().unwrap();
    let error = xla.prefill(&vec![3; largest + 1]).unwrap_err().to_string();
    assert!(error.contains("largest prefill bucket"), "{error}");
    assert!(error.contains(&largest.to_string()), "{error}");
}

#[test]
fn a_mismatched_cached_module_is_not_used() {
    let model = Model::embedded();
    let dir = tempfile::tempdir().unwrap();
    let entries = || -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        v.sort();
        v
    };
    let mut first = iree(&model, ModuleCache::at(dir.path()));
    assert_eq!(
        first.load(ModuleKind::Prefill(16)).unwrap(),
        Origin::Compiled
    );
    assert_eq!(first.load(ModuleKind::Decode).unwrap(), Origin::Compiled);
    let files = entries();
    assert_eq!(files.len(), 2);
    // Put the decode module where the prefill module belongs.
    let prefill_entry = files
        .iter()
        .find(|p| {
            std::fs::read(p)
                .unwrap()
                .windows(b"prefill_ids".len())
                .any(|w| w == b"prefill_ids")
        })
        .unwrap()
        .clone();
    let decode_entry = files.iter().find(|p| **p != prefill_entry).unwrap();
    std::fs::copy(decode_entry, &prefill_entry).unwrap();

    let mut second = iree(&model, ModuleCache::at(dir.path()));
    assert_eq!(second.load(ModuleKind::Decode).unwrap(), Origin::Cached);
    assert_eq!(
        second.load(ModuleKind::Prefill(16)).unwrap(),
        Origin::Rebuilt
    );
    let mut cpu = CpuBackend::new(&model);
    let prompt = [5, 6, 7];
    let diff = max_abs_diff(
        &cpu.prefill(&prompt).unwrap(),
        &second.prefill(&prompt).unwrap(),
    );
    assert!(diff <= 1e-4, "{diff}");
}

/// The same checks on a CUDA device: f32 within 1e-4, f16 (against the
/// reference on f16-rounded weights) within [`F16_BOUND`], 32 greedy steps
/// each. Where no GPU or no libcuda.so is present they are skipped, saying
/// why, unless `KILN_REQUIRE_GPU=1` (the GPU job) makes that a failure; on a
/// GPU machine they run. Modules come from the compiler here, or
/// from a module cache prepared elsewhere (`kiln prepare --backend iree-cuda
/// --max-context 64 --precision f32|f16`).
#[cfg(feature = "cuda")]
mod cuda {
    use super::*;

    /// No CUDA device: a skip that says why, or, where `KILN_REQUIRE_GPU=1`
    /// says there must be one, a failure.
    fn no_device(error: &dyn std::fmt::Display) {
        let reason = error.to_string();
        let reason = reason.lines().next().unwrap_or("");
        assert!(
            std::env::var("KILN_REQUIRE_GPU").as_deref() != Ok("1"),
            "KILN_REQUIRE_GPU=1 but no CUDA device was found: {reason}"
        );
        println!("skipped: no CUDA device here ({reason})");
    }

    fn on_gpu(model: &Model) {
        on_gpu_within(model, F16_BOUND, 32);
    }

    /// [`on_gpu`] with `f16_bound` and `f16_steps` greedy steps for the f16
    /// graph.
    fn on_gpu_within(model: &Model, f16_bound: f32, f16_steps: usize) {
        let graph = |p| GraphOptions::for_target(Target::Cuda, Some(p), None);
        match open(
            model,
            "cuda",
            Target::Cuda,
            graph(Precision::F32),
            default_cache(),
        ) {
            Ok(mut xla) => {
                let worst = agrees(model, &mut xla, 1e-4, 32);
                println!("{}: f32 worst |gpu - cpu| = {worst:e}", model.name);
            }
            Err(error) if error.to_string().contains("is not available") => {
                no_device(&error);
                return;
            }
            Err(error) => panic!("{error}"),
        }
        let rounded = rounded_to_f16(model);
        let mut xla = open(
            &rounded,
            "cuda",
            Target::Cuda,
            graph(Precision::F16),
            default_cache(),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let worst = agrees(&rounded, &mut xla, f16_bound, f16_steps);
        println!("{}: f16 worst |gpu - cpu| = {worst:e}", model.name);
    }

    /// Each family at its real widths and vocabulary (the folders under
    /// `KILN_WIDE_FIXTURES`, made by `scripts/make_fixture.py` where this
    /// runs; modules prepared from their config.json alone): f32 within the
    /// small fixtures' bound, f16 within [`WIDE_F16_BOUND`]. Skipped, saying
    /// why, when the variable is unset.
    #[test]
    fn wide_fixtures_match_the_cpu_reference() {
        for dir in kiln_core::testing::wide_fixtures() {
            let model = Model::load(&dir).unwrap_or_else(|e| panic!("{e}"));
            // f16 greedy tokens are not compared: a random model's top
            // logits lie closer together than f16's rounding at this width
            // (Llama-3.2-1B's parted within 32 steps); its logits are, at
            // every prefill length and through the cache.
            on_gpu_within(&model, WIDE_F16_BOUND, 0);
        }
    }

    /// The f16 bound at real widths: an f16 activation's rounding adds up
    /// over thousands of products (on the H200: Qwen2.5-0.5B's width 2.0e-3,
    /// Llama-3.2-1B's 5.7e-3, Mistral-7B's 8.0e-3, where the small fixtures
    /// stay under 1e-3), so the small models' bound does not hold there.
    /// 2.5x the worst measured (docs/gpu.md).
    const WIDE_F16_BOUND: f32 = 2e-2;

    /// q4 on the GPU: the embedded model within [`Q4_BOUND`] of the
    /// reference on its dequantized weights, 32 greedy steps.
    #[test]
    fn q4_weights_on_the_gpu_match_the_reference_on_their_dequantized_weights() {
        q4_on_the_gpu(&Model::embedded(), 32, None);
    }

    /// `model` (rounded to f16) at q4 on the GPU, its one-row products
    /// `rows` (default: CUDA's), within [`Q4_BOUND`] of the reference on
    /// its dequantized weights for `steps` greedy steps.
    fn q4_on_the_gpu(model: &Model, steps: usize, rows: Option<Q4Rows>) {
        let model = rounded_to_f16(model);
        let mut graph = GraphOptions::for_target(Target::Cuda, Some(Precision::Q4), None);
        if let Some(rows) = rows {
            graph.q4_rows = rows;
        }
        let reference = q4_reference(&model);
        match open(&model, "cuda", Target::Cuda, graph, default_cache()) {
            Ok(mut xla) => {
                let worst = agrees(&reference, &mut xla, Q4_BOUND, steps);
                println!(
                    "{}: q4 ({}) worst |gpu - cpu| = {worst:e}",
                    model.name, graph.q4_rows
                );
            }
            Err(error) if error.to_string().contains("is not available") => no_device(&error),
            Err(error) => panic!("{error}"),
        }
    }

    /// q8 on the GPU: the embedded model and random-100m (a 32,000-token
    /// vocabulary, 768-wide rows) within [`Q8_BOUND`] of the reference on
    /// their dequantized weights. Modules: `kiln prepare --backend
    /// iree-cuda --max-context 64 --precision q8` and `kiln-bench-decode
    /// --prepare --model random-100m --max-context 64 --precision q8`.
    #[test]
    fn q8_weights_on_the_gpu_match_the_reference_on_their_dequantized_weights() {
        for (model, steps) in [(Model::embedded(), 32), (wide_vocabulary_model(), 8)] {
            let model = rounded_to_f16(&model);
            let graph = GraphOptions::for_target(Target::Cuda, Some(Precision::Q8), None);
            match open(&model, "cuda", Target::Cuda, graph, default_cache()) {
                Ok(mut xla) => {
                    let worst = agrees(&q8_reference(&model), &mut xla, Q8_BOUND, steps);
                    println!("{}: q8 worst |gpu - cpu| = {worst:e}", model.name);
                }
                Err(error) if error.to_string().contains("is not available") => {
                    no_device(&error);
                    return;
                }
                Err(error) => panic!("{error}"),
            }
        }
    }

    /// A tensor-parallel rank's graphs in a world of one
    /// (`GraphOptions::tensor_parallel` 1): each layer's two all-reduces and
    /// the logits' gather run as NCCL collectives on the device's channel,
    /// which kiln's world (the C shim's channel provider) sets up; the
    /// logits are the reference's within the bound of the plain graph and
    /// the greedy tokens the same, at f16 and at q4 (where the row kernel
    /// leaves the residual to after the sum). NCCL is loaded from
    /// `libnccl.so` on the library path: without it the test skips and says
    /// so, or fails with `KILN_REQUIRE_GPU=1`. The modules are compiled
    /// wherever a compiler is (then carried in the cache).
    #[test]
    fn a_world_of_one_runs_its_collectives_through_nccl_and_matches_the_reference() {
        let model = rounded_to_f16(&Model::embedded());
        let q4 = q4_reference(&model);
        let cases = [
            (Precision::F16, &model, F16_BOUND),
            (Precision::Q4, &q4, Q4_BOUND),
        ];
        let graph = |precision| GraphOptions {
            tensor_parallel: Some(1),
            ..GraphOptions::for_target(Target::Cuda, Some(precision), None)
        };
        if let Ok(compiler) = Compiler::from_env() {
            let buckets = Buckets::for_model(&model, 64);
            let kinds = kiln_xla::prepared::module_kinds(&buckets, 1);
            for (precision, _, _) in cases {
                kiln_xla::prepared::prepare_kinds(
                    &model.config,
                    &graph(precision),
                    &kinds,
                    &buckets,
                    Target::Cuda,
                    &compiler,
                    &default_cache(),
                    |_, _, _| {},
                )
                .unwrap();
            }
        }
        for (precision, reference, bound) in cases {
            let graph = graph(precision);
            let mut xla = match open(&model, "cuda", Target::Cuda, graph, default_cache()) {
                Ok(xla) => xla,
                Err(error) if error.to_string().contains("is not available") => {
                    no_device(&error);
                    return;
                }
                Err(error) => panic!("{error}"),
            };
            // The first module made loads NCCL and makes the channel.
            match xla.prefill(&[1]) {
                Err(error) if error.to_string().contains("NCCL") => {
                    no_device(&error);
                    return;
                }
                other => {
                    other.unwrap();
                }
            }
            let worst = agrees(reference, &mut xla, bound, 32);
            println!("world of one, {precision}: worst |gpu - cpu| = {worst:e}");
        }
    }

    /// q4 on the GPU through kiln's kernel configuration: random-100m's
    /// gate-up, down and head products are wide enough to carry it (4 rows
    /// a workgroup over its 768-wide rows, 1 over the 2048-wide), its qkv
    /// and o products take IREE's own form. Within [`Q4_BOUND`] of the
    /// reference on the dequantized weights, 8 greedy steps. Modules:
    /// `kiln-bench-decode --prepare --model random-100m --max-context 64
    /// --precision q4 --q4-rows configured`.
    #[test]
    fn q4_kernel_configuration_on_the_gpu_matches_the_reference() {
        q4_on_the_gpu(&wide_vocabulary_model(), 8, Some(Q4Rows::Configured));
    }

    /// q4 through kiln's own CUDA kernel (`kernels/q4_row.cu`, CUDA's
    /// default, `--q4-rows kernel`) at every rows-per-warp choice: random-100m's
    /// qkv, o and down products take one row a warp, its gate-up two, its
    /// head four; the embedded model's narrow products one. Within
    /// [`Q4_BOUND`] of the reference on the dequantized weights. Modules:
    /// `kiln prepare --backend iree-cuda --max-context 64 --precision q4
    /// --q4-rows kernel` and `kiln-bench-decode --prepare --model
    /// random-100m --max-context 64 --precision q4 --q4-rows kernel`.
    #[test]
    fn q4_kernel_on_the_gpu_matches_the_reference() {
        q4_on_the_gpu(&Model::embedded(), 32, Some(Q4Rows::Kernel));
        q4_on_the_gpu(&wide_vocabulary_model(), 8, Some(Q4Rows::Kernel));
    }

    /// Decode steps attending through kiln's kernels
    /// (`kernels/attend_part.cu`, `attend_merge.cu`; `--decode-attention
    /// kernel`) on random-100m, whose 12 heads of 64 share 4 KV heads: f16
    /// and q4 within their bounds of the reference, 8 greedy steps, so that
    /// the kernels are checked on the GPU whichever attention is CUDA's
    /// default. Modules: `kiln-bench-decode --prepare --model random-100m
    /// --max-context 64 --precision f16 --precision q4 --decode-attention
    /// kernel`.
    #[test]
    fn decode_attention_kernels_on_the_gpu_match_the_reference() {
        let model = rounded_to_f16(&wide_vocabulary_model());
        let q4 = q4_reference(&model);
        for (precision, reference, bound) in [
            (Precision::F16, &model, F16_BOUND),
            (Precision::Q4, &q4, Q4_BOUND),
        ] {
            let graph = GraphOptions {
                decode_attention: DecodeAttention::Kernel,
                ..GraphOptions::for_target(Target::Cuda, Some(precision), None)
            };
            match open(&model, "cuda", Target::Cuda, graph, default_cache()) {
                Ok(mut xla) => {
                    let worst = agrees(reference, &mut xla, bound, 8);
                    println!(
                        "random-100m {precision}, attention kernels: worst |gpu - cpu| = {worst:e}"
                    );
                }
                Err(error) if error.to_string().contains("is not available") => {
                    no_device(&error);
                    return;
                }
                Err(error) => panic!("{error}"),
            }
        }
    }

    #[test]
    fn device_argmax_matches_host_argmax_on_the_gpu() {
        let model = wide_vocabulary_model();
        for precision in [Precision::F32, Precision::F16, Precision::Q4] {
            let graph = GraphOptions::for_target(Target::Cuda, Some(precision), None);
            match open(&model, "cuda", Target::Cuda, graph, default_cache()) {
                Ok(mut xla) => device_argmax_matches_host_argmax(&mut xla),
                Err(error) if error.to_string().contains("is not available") => {
                    no_device(&error);
                    return;
                }
                Err(error) => panic!("{error}"),
            }
        }
    }

    /// Greedy speculative decoding on the GPU gives exactly plain greedy
    /// decoding's tokens on the same device, at f32 and f16, with prompt
    /// lookup at K 3 and 7 (the 4- and 8-row multi-token steps) to the end
    /// of the context (where the last steps run token by token); drafts
    /// are both accepted and rejected. Modules: `kiln prepare … --draft-tokens 7`.
    fn speculates_losslessly_on_gpu(model: &Model) {
        use kiln_core::{PromptLookup, generate_speculative};
        let v = model.config.vocab_size as u32;
        let prompts = [
            [3u32, 9, 4, 3, 9, 4, 3, 9].map(|t| t % v).to_vec(),
            (0..12).map(|i| (i * 17 + 2) % v).collect(),
        ];
        for precision in [Precision::F32, Precision::F16] {
            let graph = GraphOptions::for_target(Target::Cuda, Some(precision), None);
            let mut xla = match open(model, "cuda", Target::Cuda, graph, default_cache()) {
                Ok(xla) => xla,
                Err(error) if error.to_string().contains("is not available") => {
                    no_device(&error);
                    return;
                }
                Err(error) => panic!("{error}"),
            };
            let (mut proposed, mut accepted) = (0, 0);
            for prompt in &prompts {
                let max_tokens = 64 - prompt.len();
                let greedy = SamplingParams::default;
                let plain =
                    generate(&mut xla, prompt, max_tokens, greedy(), &[], |_| Ok(())).unwrap();
                for k in [3, 7] {
                    let (tokens, stats) = generate_speculative(
                        &mut xla,
                        &mut PromptLookup::default(),
                        k,
                        prompt,
                        max_tokens,
                        greedy(),
                        &[],
                        |_| Ok(()),
                    )
                    .unwrap_or_else(|e| panic!("{e}"));
                    assert_eq!(
                        tokens, plain,
                        "{} {precision:?} K {k}: speculative tokens differ",
                        model.name
                    );
                    proposed += stats.proposed;
                    accepted += stats.accepted;
                }
            }
            println!(
                "{} {precision:?}: speculative = greedy; {accepted} of {proposed} drafts accepted",
                model.name
            );
            assert!(accepted > 0, "{precision:?}: no draft was accepted");
            assert!(accepted < proposed, "{precision:?}: no draft was rejected");
        }
    }

    /// Chained greedy steps on the GPU see what single steps see (f32, the
    /// untied GQA fixture). Modules: `kiln prepare --backend iree-cuda
    /// --model tests/fixtures/llama-gqa-untied --max-context 64 --precision
    /// f32 --steps-per-call N` for N = 3 and 4.
    #[test]
    fn chained_greedy_steps_on_the_gpu_match_single_steps() {
        let model: &'static Model = Box::leak(Box::new(fixture("llama-gqa-untied")));
        let graph = GraphOptions::for_target(Target::Cuda, Some(Precision::F32), None);
        if let Err(error) = open(model, "cuda", Target::Cuda, graph, default_cache()) {
            assert!(error.to_string().contains("is not available"), "{error}");
            return no_device(&error);
        }
        chained_steps_match_single_steps(model, |steps, pipelined| {
            let mut xla = open(model, "cuda", Target::Cuda, graph, default_cache())
                .unwrap_or_else(|e| panic!("{e}"));
            xla.set_pipelined(pipelined);
            xla.set_steps_per_call(steps).unwrap();
            xla
        });
    }

    /// The batched modules on the GPU (the untied GQA fixture, 4 slots, f32
    /// and f16): three prompts prefilled together in one call (one spare
    /// row) and one alone, then eight steps of all four slots (split-K
    /// products of four rows), every slot sampled so each step returns its
    /// logits; each slot's logits against its sequence on the batch-1
    /// modules of the same device and precision, fed the same tokens.
    /// Modules: `kiln prepare --backend iree-cuda --model
    /// tests/fixtures/llama-gqa-untied --max-context 64 --precision P
    /// --batch-slots 4`.
    #[test]
    fn batched_slots_on_the_gpu_match_each_sequence_alone() {
        use kiln_xla::{Admission, BatchedDecoder, Choice, SlotOutput};
        let model = fixture("llama-gqa-untied");
        let v = model.config.vocab_size as u32;
        let prompts: Vec<Vec<u32>> = [3u32, 9, 12, 40]
            .iter()
            .map(|&n| (0..n).map(|i| (i * 7 + n) % v).collect())
            .collect();
        let rounded = rounded_to_f16(&model);
        for (precision, model, bound) in [
            (Precision::F32, &model, 1e-4),
            (Precision::F16, &rounded, F16_BOUND),
        ] {
            let graph = GraphOptions::for_target(Target::Cuda, Some(precision), None);
            let backend = match open(model, "cuda", Target::Cuda, graph, default_cache()) {
                Ok(xla) => xla,
                Err(error) if error.to_string().contains("is not available") => {
                    return no_device(&error);
                }
                Err(error) => panic!("{error}"),
            };
            let mut decoder = BatchedDecoder::new(backend, 4).unwrap();
            let admissions: Vec<Admission> = Admission::in_order(&prompts, Choice::Sampled);
            let firsts: Vec<Vec<f32>> = decoder
                .admit_all(&admissions)
                .into_iter()
                .map(|r| r.unwrap_or_else(|e| panic!("{e}")))
                .collect();
            assert_eq!(decoder.prompts_prefilled_together(), 3);
            let mut alone: Vec<IreeBackend<'_>> = prompts
                .iter()
                .map(|_| open(model, "cuda", Target::Cuda, graph, default_cache()).unwrap())
                .collect();
            let mut worst = 0.0f32;
            let mut expected: Vec<Vec<f32>> = Vec::new();
            for ((prompt, single), first) in prompts.iter().zip(&mut alone).zip(&firsts) {
                let logits = single.prefill(prompt).unwrap();
                worst = worst.max(max_abs_diff(&logits, first));
                expected.push(logits);
            }
            for step in 0..8 {
                let fed: Vec<u32> = expected.iter().map(|l| argmax(l)).collect();
                for (slot, &token) in fed.iter().enumerate() {
                    decoder.feed(slot, token).unwrap();
                }
                let outputs = decoder.step().unwrap();
                assert_eq!(outputs.len(), 4, "step {step}");
                for ((slot, output), single) in outputs.into_iter().zip(&mut alone) {
                    let SlotOutput::Logits(logits) = output else {
                        panic!("a sampled slot returned a token");
                    };
                    expected[slot] = single.decode(fed[slot]).unwrap();
                    worst = worst.max(max_abs_diff(&expected[slot], &logits));
                }
            }
            println!("{precision:?}: batched slots worst |batched - alone| = {worst:e}");
            assert!(worst <= bound, "{precision:?}: {worst} > {bound}");
        }
    }

    #[test]
    fn speculative_decoding_on_the_gpu_equals_greedy() {
        for model in [
            Model::embedded(),
            fixture("llama-gqa-untied"),
            fixture("llama-mqa-tied"),
        ] {
            speculates_losslessly_on_gpu(&model);
        }
    }

    #[test]
    fn embedded_model_on_the_gpu_matches_the_cpu_reference() {
        on_gpu(&Model::embedded());
    }

    #[test]
    fn untied_gqa_fixture_on_the_gpu_matches_the_cpu_reference() {
        on_gpu(&fixture("llama-gqa-untied"));
    }

    #[test]
    fn tied_mqa_fixture_on_the_gpu_matches_the_cpu_reference() {
        on_gpu(&fixture("llama-mqa-tied"));
    }

    #[test]
    fn mistral_fixture_on_the_gpu_matches_the_cpu_reference() {
        on_gpu(&fixture("mistral-gqa-window"));
    }

    #[test]
    fn qwen2_fixture_on_the_gpu_matches_the_cpu_reference() {
        on_gpu(&fixture("qwen2-tied-bias"));
    }
}
