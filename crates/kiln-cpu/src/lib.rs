//! kiln-cpu: the `cpu-q4` backend. The CPU reference's forward pass
//! (kiln-core's `forward`) over matrices stored in blocks of [`BLOCK`]
//! weights: each layer's in 4 bits with an f32 scale and minimum a block
//! (GGUF's Q4_1, f32 ends), the output projection in 8 bits with an f32
//! scale (Q8_0). The [`kernel`]s unpack and dequantize a block in
//! registers and accumulate against f32 activations; a product's output
//! rows are shared out over a [`team`] of threads kept awake between
//! products. Where this CPU has SIMD [`integer`] kernels the layers'
//! activations are rounded to 8 bits per block first ([`inputs`]) and
//! multiplied in integers ([`Activations::fastest`]).
//!
//! A Q4_1 file's blocks (and its Q8_0 embedding) come back exactly, so on
//! such a model `cpu-q4` differs from the reference only by summation
//! order and the rounding of each dequantized weight (one fused
//! multiply-add, where the reference rounds twice); on other models it
//! adds the block rounding, at most half a step per weight. With
//! [`Activations::Q8`] each product adds the activations' 8-bit rounding
//! too, as llama.cpp's does.
//!
//! The `cpu-simd` backend ([`backend_at_stored_precision`]) keeps every
//! matrix as its file stored it; a Q8_0 file's layer blocks take f32
//! activations by default (the reference's numerics, up to the order of
//! sums) or, with [`Activations::Q8`], 8-bit ones multiplied in integers
//! ([`integer`]'s `q8_rows`), as llama.cpp's Q8_0 × Q8_0.

pub mod blocks;
pub mod dense;
pub mod inputs;
pub mod integer;
pub mod kernel;
pub mod pages;
pub mod team;
#[cfg(test)]
mod test_products;
pub mod tiles;
mod weights;

pub use blocks::{BLOCK, BlockError, Q4Blocks, Q8Blocks};
pub use weights::Q4Weights;

use kiln_core::{CpuBackend, Model};

/// The `cpu-q4` backend over `model` with `threads` threads (at least 1),
/// its products taking `activations`: its matrices quantized once, here.
pub fn backend(
    model: &Model,
    threads: usize,
    activations: Activations,
) -> Result<CpuBackend<'_>, Error> {
    let weights = Q4Weights::new(&model.weights, threads, activations)?;
    Ok(CpuBackend::with_weights(model, Box::new(weights), "cpu-q4"))
}

/// The `cpu-simd` backend over `model` with `threads` threads (at least
/// 1): every matrix at the precision its file stored it in, a Q8_0 file's
/// layer blocks multiplied against `activations` (see
/// [`Q4Weights::at_stored_precision`]).
pub fn backend_at_stored_precision(
    model: &Model,
    threads: usize,
    activations: Activations,
) -> Result<CpuBackend<'_>, Error> {
    let weights = Q4Weights::at_stored_precision(&model.weights, threads, activations)?;
    Ok(CpuBackend::with_weights(
        model,
        Box::new(weights),
        "cpu-simd",
    ))
}

/// What a layer's block products multiply: `cpu-q4`'s 4-bit blocks, or
/// `cpu-simd`'s 8-bit blocks of a Q8_0 file (dense rows, and the output
/// projection, take f32 activations either way: the projection's rounding
/// would go straight into the logits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activations {
    /// The input rows rounded to 8 bits per block of 32 ([`inputs`]) and
    /// multiplied in integers ([`integer`]), as llama.cpp's Q4_1 × Q8_1
    /// and Q8_0 × Q8_0:
    /// each product within [`inputs::Q8Inputs::rounding_bound`] of the
    /// exact one, and faster where the CPU has a SIMD integer kernel.
    Q8,
    /// The input rows as they are, f32 ([`kernel`]): the dequantized
    /// weights' product up to f32 rounding, as the reference computes it.
    F32,
}

impl Activations {
    /// [`Activations::Q8`] where this CPU runs a SIMD integer kernel
    /// (AVX-512 VNNI, AVX2), [`Activations::F32`] elsewhere, where the f32
    /// kernels are the faster (`kiln-bench-kernels`, docs/models.md).
    pub fn fastest() -> Activations {
        match integer::best().simd {
            true => Activations::Q8,
            false => Activations::F32,
        }
    }

    /// The name `--activations` takes.
    pub fn name(self) -> &'static str {
        match self {
            Activations::Q8 => "q8",
            Activations::F32 => "f32",
        }
    }
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
