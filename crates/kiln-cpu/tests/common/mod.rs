//! What the kiln-cpu integration tests share.

use kiln_core::testing::max_abs_diff;
use kiln_core::weights::Matrix;
use kiln_core::{Backend, Model};

/// A model whose products are large enough to be shared between threads
/// (kiln-cpu shares a product only above a size): in a 16-token prefill
/// every product, in a decode step the output projection.
pub fn shared_products_model() -> Model {
    let (mut config, seed) = kiln_core::model::preset("random-100m").unwrap();
    (config.hidden_size, config.intermediate_size) = (512, 1024);
    (config.num_heads, config.num_kv_heads, config.head_dim) = (8, 2, 64);
    (config.num_layers, config.vocab_size) = (2, 9000);
    Model::random("shared", config, seed)
}

/// Every layer matrix of `model`, for a test to replace its values.
pub fn layer_matrices(model: &mut Model) -> impl Iterator<Item = &mut Matrix> {
    model
        .weights
        .layers
        .iter_mut()
        .flat_map(|l| l.matrices_mut())
}

/// Twelve greedy decode steps of `reference` and `other` from `token`
/// (both already prefilled): asserts the same tokens, returns the largest
/// logit difference.
pub fn decode_alike(reference: &mut dyn Backend, other: &mut dyn Backend, mut token: u32) -> f32 {
    let mut worst = 0.0f32;
    for step in 0..12 {
        let (want, got) = (
            reference.decode(token).unwrap(),
            other.decode(token).unwrap(),
        );
        worst = worst.max(max_abs_diff(&want, &got));
        let next = kiln_core::sampling::argmax(&want) as u32;
        assert_eq!(
            kiln_core::sampling::argmax(&got) as u32,
            next,
            "step {step}"
        );
        token = next;
    }
    worst
}
