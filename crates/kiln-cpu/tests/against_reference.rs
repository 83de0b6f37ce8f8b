//! The cpu-q4 backend against the f32 reference on weights that 4-bit
//! blocks hold exactly (each matrix snapped to its blocks first): the two
//! differ only by summation order and the rounding of each dequantized
//! weight, so a wrong block, row or stacking order shows as a difference of
//! whole logits.

use kiln_core::testing::max_abs_diff;
use kiln_core::{Backend, CpuBackend, Model};
use kiln_cpu::{Activations, Q4Blocks, Q8Blocks};

mod common;
use common::{decode_alike, layer_matrices, shared_products_model};

/// The embedded model with every layer matrix replaced by its 4-bit
/// blocks' values and the (tied) output projection by its 8-bit ones.
fn snapped() -> Model {
    snap(Model::embedded())
}

/// `model` with every layer matrix replaced by its 4-bit blocks' values and
/// the tied output projection by its 8-bit ones.
fn snap(mut model: Model) -> Model {
    assert!(model.config.tie_word_embeddings);
    let snap = |m: &mut kiln_core::weights::Matrix| {
        *m = Q4Blocks::quantize(m).unwrap().dequantize();
    };
    for m in layer_matrices(&mut model) {
        snap(m);
    }
    let embed = &mut model.weights.embed;
    *embed = Q8Blocks::quantize(embed).unwrap().dequantize();
    model
}

/// Nineteen token ids of the embedded model's 98-token vocabulary.
const PROMPT: [u32; 19] = [
    1, 40, 69, 76, 76, 79, 12, 2, 87, 79, 82, 76, 68, 3, 2, 52, 72, 69, 2,
];

/// Measured: 9.5e-7 on logits of magnitude up to about 0.5 (1.2e-6 before
/// the fused dequantization); a wrong block or row moves them by far more.
const BOUND: f32 = 1e-5;

/// With the activations rounded to 8 bits a block (each input within 1/254
/// of its block's largest magnitude, each product within
/// `Q8Inputs::rounding_bound`, which the kernels' own tests hold), through
/// every layer. Measured: 1.9e-2 on the embedded model (whose rows are two
/// blocks, so the roundings average out little), 3.7e-3 on the Qwen2
/// fixture; the greedy tokens are the reference's. A wrong block, row or
/// scale moves these logits (magnitude up to about 0.5) by tenths.
const Q8_BOUND: f32 = 5e-2;

#[test]
fn logits_and_greedy_tokens_match_the_reference() {
    agrees_with_the_reference(&snapped(), &PROMPT, Activations::F32, BOUND);
}

#[test]
fn with_8_bit_activations_logits_stay_within_their_rounding() {
    agrees_with_the_reference(&snapped(), &PROMPT, Activations::Q8, Q8_BOUND);
}

/// Qwen2's q/k/v biases (the transformers fixture, whose sizes are whole
/// blocks) are added by cpu-q4 as by the reference.
#[test]
fn qwen2_biases_match_the_reference() {
    let dir = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/qwen2-tied-bias"
    );
    let model = Model::load(std::path::Path::new(dir)).unwrap();
    assert!(model.weights.layers[0].qkv_bias.is_some());
    let prompt: Vec<u32> = (0..19).map(|i| (i * 29 + 3) % 97).collect();
    let model = snap(model);
    agrees_with_the_reference(&model, &prompt, Activations::F32, BOUND);
    agrees_with_the_reference(&model, &prompt, Activations::Q8, Q8_BOUND);
}

fn agrees_with_the_reference(model: &Model, prompt: &[u32], activations: Activations, bound: f32) {
    let mut reference = CpuBackend::new(model);
    let mut q4 = kiln_cpu::backend(model, 2, activations).unwrap();
    assert_eq!(q4.name(), "cpu-q4");
    let (want, got) = (
        reference.prefill(prompt).unwrap(),
        q4.prefill(prompt).unwrap(),
    );
    let mut worst = max_abs_diff(&want, &got);
    let first = kiln_core::sampling::argmax(&want) as u32;
    worst = worst.max(decode_alike(&mut reference, &mut q4, first));
    let name = activations.name();
    eprintln!("largest |cpu-q4 ({name} activations) - cpu| logit difference: {worst:.2e}");
    assert!(worst <= bound, "logits differ by {worst:.2e} > {bound:.0e}");
}

/// Each output row is computed by the same code whichever thread takes it,
/// so the thread count changes nothing, to the bit.
#[test]
fn every_thread_count_gives_the_same_logits() {
    let model = shared_products_model();
    let prompt: Vec<u32> = (0..16).map(|i| (i * 577 + 3) % 9000).collect();
    for activations in [Activations::F32, Activations::Q8] {
        let logits = |threads| {
            let mut backend = kiln_cpu::backend(&model, threads, activations).unwrap();
            let mut all = backend.prefill(&prompt).unwrap();
            all.extend(backend.decode(42).unwrap());
            all
        };
        let one = logits(1);
        for threads in [2, 3, 5] {
            assert_eq!(logits(threads), one, "{threads} threads, {activations:?}");
        }
    }
}

/// Several rows in one product (prefill, speculation's append) give each
/// row what it gets alone.
#[test]
fn appending_rows_equals_decoding_them_one_by_one() {
    for activations in [Activations::F32, Activations::Q8] {
        appended_rows_equal_decoded_ones(activations);
    }
}

fn appended_rows_equal_decoded_ones(activations: Activations) {
    let model = Model::embedded();
    let mut one_by_one = kiln_cpu::backend(&model, 2, activations).unwrap();
    one_by_one.prefill(&PROMPT[..5]).unwrap();
    let mut want = Vec::new();
    for &t in &PROMPT[5..11] {
        want.extend(one_by_one.decode(t).unwrap());
    }
    let mut appended = kiln_cpu::backend(&model, 2, activations).unwrap();
    appended.prefill(&PROMPT[..5]).unwrap();
    let got = appended.append(&PROMPT[5..11]).unwrap();
    // A row's rounding is its own, and each (output, input) pair is summed
    // in the same order however many rows a product takes.
    assert!(max_abs_diff(&want, &got) <= 1e-6, "{activations:?}");
    // Rewinding drops the appended rows: the next decode is as if they
    // had never been.
    appended.rewind(5).unwrap();
    let mut fresh = kiln_cpu::backend(&model, 2, activations).unwrap();
    fresh.prefill(&PROMPT[..5]).unwrap();
    assert_eq!(appended.decode(7).unwrap(), fresh.decode(7).unwrap());
}

#[test]
fn a_width_that_is_not_whole_blocks_is_refused_with_the_fix() {
    let (mut config, seed) = kiln_core::model::preset("random-100m").unwrap();
    config.hidden_size = 48;
    config.num_heads = 3;
    config.num_kv_heads = 1;
    config.head_dim = 16;
    config.intermediate_size = 64;
    config.num_layers = 1;
    config.vocab_size = 300;
    let model = Model::random("narrow", config, seed);
    let error = kiln_cpu::backend(&model, 1, Activations::F32)
        .err()
        .unwrap();
    let why = std::error::Error::source(&error).unwrap().to_string();
    let error = format!("{error}: {why}");
    assert!(
        error.contains("cannot store layer 0 q/k/v")
            && error.contains("48 inputs")
            && error.contains("--backend cpu"),
        "{error}"
    );
}
