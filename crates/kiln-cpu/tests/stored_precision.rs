//! The cpu-simd backend (every matrix at its stored precision) against the
//! f32 reference: on weights that are f16, bf16, Q8_0 or plain f32 values it
//! computes the reference's products from the same values, so the two
//! differ by summation order only; a wrong row, chunk or conversion shows
//! as whole logits.

use half::{bf16, f16};
use kiln_core::testing::max_abs_diff;
use kiln_core::weights::Matrix;
use kiln_core::{Backend, CpuBackend, Model};
use kiln_cpu::Q8Blocks;

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
    Matrix {
        data: m.data.iter().map(|&v| f(v)).collect(),
        ..m.clone()
    }
}

/// A Q8_0 block's values as a GGUF file gives them: an f16 scale (the
/// block's largest magnitude over 127) times integers.
fn q8_0(m: &Matrix) -> Matrix {
    let mut data = Vec::with_capacity(m.data.len());
    for block in m.data.chunks_exact(32) {
        let largest = block.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        let d = f16::from_f32(largest / 127.0).to_f32();
        data.extend(block.iter().map(|&v| match d > 0.0 {
            true => f32::from((v / d).round().clamp(-127.0, 127.0) as i8) * d,
            false => 0.0,
        }));
    }
    Matrix { data, ..m.clone() }
}

/// Sixteen prompt tokens and twelve greedy steps: logits within `bound` of
/// the reference's and the same tokens, at 1, 2 and 3 threads (the same
/// logits, to the bit, at each).
fn agrees_with_the_reference(model: &Model, bound: f32) {
    let prompt: Vec<u32> = (0..16).map(|i| (i * 131 + 7) % 9000).collect();
    let mut reference = CpuBackend::new(model);
    let want = reference.prefill(&prompt).unwrap();
    let mut first: Option<Vec<f32>> = None;
    for threads in [1, 2, 3] {
        let mut simd = kiln_cpu::backend_at_stored_precision(model, threads).unwrap();
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
        eprintln!("{threads} threads: largest |cpu-simd - cpu| logit difference {worst:.2e}");
        assert!(worst <= bound, "logits differ by {worst:.2e} > {bound:.0e}");
    }
}

/// Measured: about 1e-6 on logits of magnitude about 1; a wrong row or
/// chunk moves them by tenths.
const BOUND: f32 = 2e-5;

#[test]
fn f16_weights_give_the_references_logits() {
    let model = snapped(shared_products_model(), |m| {
        each_value(m, |v| f16::from_f32(v).to_f32())
    });
    agrees_with_the_reference(&model, BOUND);
}

#[test]
fn bf16_weights_give_the_references_logits() {
    let model = snapped(shared_products_model(), |m| {
        each_value(m, |v| bf16::from_f32(v).to_f32())
    });
    agrees_with_the_reference(&model, BOUND);
}

#[test]
fn f32_weights_give_the_references_logits() {
    agrees_with_the_reference(&shared_products_model(), BOUND);
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
    agrees_with_the_reference(&model, BOUND);
}
