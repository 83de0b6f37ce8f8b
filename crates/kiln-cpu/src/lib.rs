//! kiln-cpu: the `cpu-q4` backend. The CPU reference's forward pass
//! (kiln-core's `forward`) over matrices stored in blocks of [`BLOCK`]
//! weights: each layer's in 4 bits with an f32 scale and minimum a block
//! (GGUF's Q4_1, f32 ends), the output projection in 8 bits with an f32
//! scale (Q8_0). The [`kernel`]s unpack and dequantize a block in
//! registers and accumulate against f32 activations; a product's output
//! rows are shared out over a [`team`] of threads kept awake between
//! products.
//!
//! A Q4_1 file's blocks (and its Q8_0 embedding) come back exactly, so on
//! such a model `cpu-q4` differs from the reference only by summation
//! order and the rounding of each dequantized weight (one fused
//! multiply-add, where the reference rounds twice); on other models it
//! adds the block rounding, at most half a step per weight. The
//! activations stay f32: no 8-bit rounding of them.

pub mod blocks;
pub mod kernel;
pub mod team;
mod weights;

pub use blocks::{BLOCK, BlockError, Q4Blocks, Q8Blocks};
pub use weights::Q4Weights;

use kiln_core::{CpuBackend, Model};

/// The `cpu-q4` backend over `model` with `threads` threads (at least 1):
/// its matrices quantized once, here.
pub fn backend(model: &Model, threads: usize) -> Result<CpuBackend<'_>, Error> {
    let weights = Q4Weights::new(&model.weights, threads)?;
    Ok(CpuBackend::with_weights(model, Box::new(weights), "cpu-q4"))
}

/// Why the `cpu-q4` backend cannot take a model.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("the cpu-q4 backend cannot store {matrix} in blocks")]
    Matrix {
        matrix: String,
        #[source]
        source: BlockError,
    },
    #[error("cannot start {threads} threads for the cpu-q4 backend: {reason}")]
    Threads { threads: usize, reason: String },
}
