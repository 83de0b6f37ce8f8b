//! What the kiln-cpu integration tests share.

use kiln_core::Model;
use kiln_core::weights::Matrix;

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
    model.weights.layers.iter_mut().flat_map(|l| {
        [
            &mut l.wq,
            &mut l.wk,
            &mut l.wv,
            &mut l.wo,
            &mut l.w_gate,
            &mut l.w_up,
            &mut l.w_down,
        ]
    })
}
