//! The cpu-simd backend (every matrix at its stored precision) against the
//! f32 reference: on weights that are f16, bf16, Q8_0 or plain f32 values it
//! computes the reference's products from the same values, so the two
//! differ by summation order only; a wrong row, chunk or conversion shows
//! as whole logits. With 8-bit activations (`--activations q8`) a Q8_0
//! model's layer products add their inputs' rounding, within a bound.

use half::{bf16, f16};
use kiln_core::testing::max_abs_diff;
use kiln_core::weights::Matrix;
use kiln_core::{Backend, CpuBackend, Model};
use kiln_cpu::{Activations, Q8Blocks};

mod common;
use common::{decode_alike, layer_matrices, shared_products_model};

/// `model` with every matrix's values replaced by `snap`'s.
fn snapped(mut model: Model, snap: impl Fn(&Matrix) -> Matrix) -> Model {
    for m in layer_matrices(&mut model) {
        *m = snap(m);
    }
    model.weights.embed = snap(&model.weights.embed);
    if let Some(head) = &mut model.weights.lm_head {
        *head = snap(head);
    }
    model
}

fn each_value(m: &Matrix, f: impl Fn(f32) -> f32) -> Matrix {
    Matrix::new(m.rows, m.cols, m.f32().iter().map(|&v| f(v)).collect())
}

/// A Q8_0 block's values as a GGUF file gives them: an f16 scale (the
/// block's largest magnitude over 127) times integers.
fn q8_0(m: &Matrix) -> Matrix {
    let mut data = Vec::with_capacity(m.f32().len());
    for block in m.f32().chunks_exact(32) {
        let largest = block.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        let d = f16::from_f32(largest / 127.0).to_f32();
        data.extend(block.iter().map(|&v| match d > 0.0 {
            true => f32::from((v / d).round().clamp(-127.0, 127.0) as i8) * d,
            false => 0.0,
        }));
    }
    Matrix::new(m.rows, m.cols, data)
}

/// Sixteen prompt tokens and twelve greedy steps: logits within `bound` of
/// the reference's and the same tokens, at 1, 2 and 3 threads (the same
/// logits, to the bit, at each); the largest difference is returned.
fn agrees_with_the_reference(model: &Model, activations: Activations, bound: f32) -> f32 {
    let prompt: Vec<u32> = (0..16).map(|i| (i * 131 + 7) % 9000).collect();
    let mut reference = CpuBackend::new(model);
    let want = reference.prefill(&prompt).unwrap();
    let mut first: Option<Vec<f32>> = None;
    let mut largest = 0.0f32;
    for threads in [1, 2, 3] {
        let mut simd = kiln_cpu::backend_at_stored_precision(model, threads, activations).unwrap();
        assert_eq!(simd.name(), "cpu-simd");
        let got = simd.prefill(&prompt).unwrap();
        match &first {
            None => first = Some(got.clone()),
            Some(first) => assert!(
                first
                    .iter()
                    .zip(&got)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{threads} threads changed the logits"
            ),
        }
        let mut worst = max_abs_diff(&want, &got);
        let mut reference = CpuBackend::new(model);
        reference.prefill(&prompt).unwrap();
        let first = kiln_core::sampling::argmax(&want) as u32;
        worst = worst.max(decode_alike(&mut reference, &mut simd, first));
        let name = activations.name();
        eprintln!(
            "{threads} threads, {name} activations: largest |cpu-simd - cpu| logit difference {worst:.2e}"
        );
        assert!(worst <= bound, "logits differ by {worst:.2e} > {bound:.0e}");
        largest = largest.max(worst);
    }
    largest
}

/// Measured: about 1e-6 on logits of magnitude about 1; a wrong row or
/// chunk moves them by tenths.
const BOUND: f32 = 2e-5;

#[test]
fn f16_weights_give_the_references_logits() {
    let model = snapped(shared_products_model(), |m| {
        each_value(m, |v| f16::from_f32(v).to_f32())
    });
    agrees_with_the_reference(&model, Activations::F32, BOUND);
}

#[test]
fn bf16_weights_give_the_references_logits() {
    let model = snapped(shared_products_model(), |m| {
        each_value(m, |v| bf16::from_f32(v).to_f32())
    });
    agrees_with_the_reference(&model, Activations::F32, BOUND);
}

#[test]
fn f32_weights_give_the_references_logits() {
    agrees_with_the_reference(&shared_products_model(), Activations::F32, BOUND);
}

/// Dense rows take f32 activations whatever `--activations` says: an f16
/// model's logits are the same, to the bit, with q8.
#[test]
fn dense_rows_ignore_8_bit_activations() {
    let model = snapped(shared_products_model(), |m| {
        each_value(m, |v| f16::from_f32(v).to_f32())
    });
    let prompt: Vec<u32> = (0..16).map(|i| (i * 131 + 7) % 9000).collect();
    let logits = |activations| {
        let mut simd = kiln_cpu::backend_at_stored_precision(&model, 2, activations).unwrap();
        let mut all = simd.prefill(&prompt).unwrap();
        all.extend(simd.decode(42).unwrap());
        all
    };
    assert_eq!(logits(Activations::Q8), logits(Activations::F32));
}

/// A Q8_0 file's matrices come back exactly as 8-bit blocks (read at a
/// quarter of f32's bytes), and their products are the reference's.
#[test]
fn q8_0_weights_are_kept_as_blocks_and_give_the_references_logits() {
    let model = snapped(shared_products_model(), q8_0);
    let wq = &model.weights.layers[0].wq;
    let blocks = Q8Blocks::exact(wq).expect("Q8_0 values are exact 8-bit blocks");
    assert_eq!(blocks.dequantize(), *wq);
    assert!(Q8Blocks::exact(&shared_products_model().weights.layers[0].wq).is_none());
    agrees_with_the_reference(&model, Activations::F32, BOUND);
}

/// With the activations rounded to 8 bits a block (each input within 1/254
/// of its block's largest magnitude, each product within
/// `Q8Inputs::rounding_bound`, which the kernels' own tests hold) in every
/// layer product, the output projection's input kept f32. Measured: 2.5e-2
/// on logits of magnitude about 1, the greedy tokens the reference's; a
/// wrong block, row or scale moves them by tenths.
const Q8_BOUND: f32 = 5e-2;

/// Several rows in one product (prefill, speculation's append) give each
/// row what it gets alone with 8-bit activations too: each row's rounding
/// is its own.
#[test]
fn with_8_bit_activations_appended_rows_equal_decoded_ones() {
    let model = snapped(shared_products_model(), q8_0);
    let prompt: Vec<u32> = (0..16).map(|i| (i * 131 + 7) % 9000).collect();
    let open = || kiln_cpu::backend_at_stored_precision(&model, 2, Activations::Q8).unwrap();
    let mut one_by_one = open();
    one_by_one.prefill(&prompt[..5]).unwrap();
    let mut want = Vec::new();
    for &t in &prompt[5..] {
        want.extend(one_by_one.decode(t).unwrap());
    }
    let mut appended = open();
    appended.prefill(&prompt[..5]).unwrap();
    let got = appended.append(&prompt[5..]).unwrap();
    let diff = max_abs_diff(&want, &got);
    assert!(diff <= 1e-5, "{diff:.2e}");
}

/// The rounding shows: the 8-bit path is taken (more than f32's summation
/// order), and stays within [`Q8_BOUND`] of the reference.
#[test]
fn q8_0_weights_with_8_bit_activations_stay_within_their_rounding() {
    let model = snapped(shared_products_model(), q8_0);
    let worst = agrees_with_the_reference(&model, Activations::Q8, Q8_BOUND);
    assert!(
        worst > 10.0 * BOUND,
        "{worst:.2e}: the activations were not rounded"
    );
}
