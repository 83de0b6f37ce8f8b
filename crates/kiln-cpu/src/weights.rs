//! A model's matrices in blocks, as the forward pass takes them: q, k and v
//! stacked into one product, gate and up into another, each layer's in 4
//! bits and the output projection in 8 (its error goes straight into the
//! logits: a Q4_1 GGUF keeps it at Q8_0, and so does kiln), and each
//! product's output rows shared out over the backend's [`Team`].

use std::sync::Arc;

use kiln_core::forward::{ForwardWeights, LayerView, Linear};
use kiln_core::weights::{Matrix, Weights};

use crate::blocks::{BLOCK, BlockError, Q4Blocks, Q8Blocks};
use crate::dense::Dense;
use crate::inputs::Q8Inputs;
use crate::pages::Pages;
use crate::team::{MAX_CHUNKS, Team};
use crate::{Activations, Error, integer, kernel, tiles};

/// The blocks of one product.
enum Blocks {
    /// A layer's 4-bit blocks, multiplied against its activations as given.
    Q4(Q4Blocks, Activations),
    /// 8-bit blocks against the activations given: a Q8_0 file's layer
    /// matrices in `cpu-simd`, and the output projection, whose activations
    /// are f32 always: rounding its input moves the logits themselves
    /// (SmolLM2-135M-Instruct's answer to the README's question turns from
    /// "The capital of France is Paris." to "L'Étoile, la Marseillaise,
    /// ...", which is also llama.cpp's answer on its Q4_1 file), and from
    /// memory its f32 kernel is as fast.
    Q8(Q8Blocks, Activations),
    /// Rows at the matrix's own precision (`cpu-simd`), against f32
    /// activations.
    Dense(Dense),
}

impl Blocks {
    /// `(rows, cols)`.
    fn shape(&self) -> (usize, usize) {
        match self {
            Blocks::Q4(m, _) => (m.rows, m.cols),
            Blocks::Q8(m, _) => (m.rows, m.cols),
            Blocks::Dense(m) => (m.rows, m.cols),
        }
    }

    /// Blocks in all (a dense matrix's weights in blocks' worth).
    fn count(&self) -> usize {
        match self {
            Blocks::Q4(m, _) => m.scales.len(),
            Blocks::Q8(m, _) => m.scales.len(),
            Blocks::Dense(m) => m.rows * m.cols / BLOCK,
        }
    }

    /// `x` (`[n, cols]`) as these blocks' kernels take it.
    fn inputs<'x>(&self, x: &'x [f32]) -> Inputs<'x> {
        match self {
            Blocks::Q4(m, Activations::Q8) => Inputs::Q8(Q8Inputs::quantize(x, m.cols)),
            // Several rows (prefill) too, though with AVX2 alone the f32
            // tiles are faster there (`kiln-bench-kernels --weights q8
            // --inputs 128`: AVX-512 VNNI 1.2x the tiles, AVX2 0.8x): a
            // row's product is then the same however many rows a product
            // takes, so appended rows (speculation's) equal decoded ones.
            Blocks::Q8(m, Activations::Q8) => Inputs::Q8(Q8Inputs::quantize(x, m.cols)),
            Blocks::Q4(_, Activations::F32)
            | Blocks::Q8(_, Activations::F32)
            | Blocks::Dense(_) => Inputs::F32(x),
        }
    }

    /// Output rows from `first` (as many as `out` holds, `[rows, n]`) of
    /// `x`, from [`Blocks::inputs`].
    fn rows(&self, first: usize, x: &Inputs, out: &mut [f32]) {
        match (self, x) {
            (Blocks::Q4(m, _), Inputs::F32(x)) => (kernel::best().q4_rows)(m, first, x, out),
            (Blocks::Q4(m, _), Inputs::Q8(x)) => (integer::best().q4_rows)(m, first, x, out),
            (Blocks::Q8(m, _), Inputs::F32(x)) if x.len() > m.cols => {
                // Several inputs (prefill): tiles of rows widened once.
                out.fill(0.0);
                tiles::product_here(m.cols, first, x, out, |r, c, values| m.widen(r, c, values))
            }
            (Blocks::Q8(m, _), Inputs::F32(x)) => (kernel::best().q8_rows)(m, first, x, out),
            (Blocks::Q8(m, _), Inputs::Q8(x)) => (integer::best().q8_rows)(m, first, x, out),
            (Blocks::Dense(m), Inputs::F32(x)) => m.rows(first, x, out),
            (Blocks::Dense(_), Inputs::Q8(_)) => {
                unreachable!("Blocks::inputs gives dense rows f32")
            }
        }
    }
}

/// A product's input rows as its kernels take them.
enum Inputs<'x> {
    F32(&'x [f32]),
    Q8(Q8Inputs),
}

/// Blocks × input rows below which a product runs on the calling thread
/// alone, the hand-off to the workers costing more than their share saves.
/// SmolLM2's smallest product (10,368 blocks) is above it: sharing every
/// product of a decode step took 2 threads from 81 to 130 tok/s on the
/// 2-core VM of docs/models.md, sharing only the output projection (as
/// when the workers slept between products) did not.
const MIN_SHARED_WORK: usize = 4_096;

/// Chunks a shared product is split into, per thread: at least
/// [`MIN_CHUNKS_PER_THREAD`], so that a worker that starts late, or is
/// descheduled, holds up a small part of the product, not its share; at
/// most [`MAX_CHUNKS_PER_THREAD`], and none below [`MIN_CHUNK_WORK`], as
/// each chunk costs a take (an atomic on a line all threads write) and a
/// fresh start of the kernel's memory stream: on a 2-core VM with nothing
/// else running, 2 threads decoded SmolLM2 12-19 % slower in 16 chunks a
/// product than in 2.
const MIN_CHUNKS_PER_THREAD: usize = 2;
const MAX_CHUNKS_PER_THREAD: usize = 8;

/// Blocks × input rows a chunk holds at least, beyond
/// [`MIN_CHUNKS_PER_THREAD`]: ~14 µs of one thread's decode on that VM
/// (~1.7 ns a block).
const MIN_CHUNK_WORK: usize = 8_192;

/// A chunk's output rows are a multiple of this, so that each runs as the
/// whole product would: the integer kernels take one input row into 4
/// output rows at once, the f32 kernels rows in tiles of 16.
const CHUNK_ROWS: usize = 16;

/// A product of blocks, its output rows shared out over a [`Team`].
struct PooledProduct {
    blocks: Blocks,
    team: Arc<Team>,
}

impl Linear for PooledProduct {
    fn apply(&self, x: &[f32], rows: usize) -> Vec<f32> {
        let (outputs, cols) = self.blocks.shape();
        debug_assert_eq!(x.len(), rows * cols);
        // Computed as `[out, rows]`: each thread owns whole output rows.
        let mut by_output = vec![0.0f32; outputs * rows];
        // Rounded once, here, for every thread's share.
        let x = &self.blocks.inputs(x);
        let threads = self.team.threads();
        if threads > 1 && self.blocks.count() * rows >= MIN_SHARED_WORK {
            // More chunks than threads, taken by whichever thread is free:
            // a descheduled worker holds up one chunk, not a share.
            let chunks = (self.blocks.count() * rows / MIN_CHUNK_WORK)
                .clamp(
                    threads * MIN_CHUNKS_PER_THREAD,
                    threads * MAX_CHUNKS_PER_THREAD,
                )
                .min(MAX_CHUNKS);
            let chunk_rows = outputs.div_ceil(chunks).next_multiple_of(CHUNK_ROWS);
            self.team
                .for_each_chunk_mut(&mut by_output, chunk_rows * rows, &|c, out| {
                    self.blocks.rows(c * chunk_rows, x, out);
                });
        } else {
            self.blocks.rows(0, x, &mut by_output);
        }
        if rows == 1 {
            return by_output;
        }
        transpose(&by_output, outputs, rows)
    }
}

/// `[a, b]` to `[b, a]`, a few rows of the source at a time: each
/// destination row then gets whole cache lines, not one value per line.
fn transpose(m: &[f32], a: usize, b: usize) -> Vec<f32> {
    const TILE: usize = 16;
    let mut out = vec![0.0f32; a * b];
    for start in (0..a).step_by(TILE) {
        let end = (start + TILE).min(a);
        for j in 0..b {
            for (i, slot) in (start..end).zip(&mut out[j * a + start..j * a + end]) {
                *slot = m[i * b + j];
            }
        }
    }
    out
}

struct Layer {
    attn_norm: Vec<f32>,
    qkv: PooledProduct,
    qkv_bias: Option<Vec<f32>>,
    wo: PooledProduct,
    mlp_norm: Vec<f32>,
    gate_up: PooledProduct,
    w_down: PooledProduct,
}

/// A model's matrices in 4-bit blocks; the embedding stays the model's.
pub struct Q4Weights {
    layers: Vec<Layer>,
    final_norm: Vec<f32>,
    output: PooledProduct,
}

impl Q4Weights {
    /// Quantizes `w`'s matrices, for products on `threads` threads against
    /// `activations`.
    pub fn new(w: &Weights, threads: usize, activations: Activations) -> Result<Q4Weights, Error> {
        let team = Arc::new(Team::new(threads).map_err(|e| Error::Threads {
            threads,
            reason: e.to_string(),
        })?);
        let pooled = |name: String, blocks: Result<Blocks, BlockError>| {
            Ok(PooledProduct {
                blocks: blocks.map_err(|source| Error::Matrix {
                    matrix: name,
                    source,
                })?,
                team: Arc::clone(&team),
            })
        };
        let product = |name: String, parts: &[&Matrix]| {
            pooled(
                name,
                Q4Blocks::stack(parts).map(|m| Blocks::Q4(m, activations)),
            )
        };
        let layers = w
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| {
                Ok(Layer {
                    attn_norm: l.attn_norm.clone(),
                    qkv: product(format!("layer {i} q/k/v"), &[&l.wq, &l.wk, &l.wv])?,
                    qkv_bias: l.qkv_bias.clone(),
                    wo: product(format!("layer {i} attention output"), &[&l.wo])?,
                    mlp_norm: l.mlp_norm.clone(),
                    gate_up: product(format!("layer {i} gate/up"), &[&l.w_gate, &l.w_up])?,
                    w_down: product(format!("layer {i} down"), &[&l.w_down])?,
                })
            })
            .collect::<Result<Vec<_>, Error>>()?;
        Ok(Q4Weights {
            layers,
            final_norm: w.final_norm.clone(),
            output: pooled(
                "the output projection".into(),
                Q8Blocks::quantize(w.output()).map(|m| Blocks::Q8(m, Activations::F32)),
            )?,
        })
    }
}

/// How [`Q4Weights::at_stored_precision`] keeps each product: as 8-bit
/// blocks where they give the stored values back exactly (a Q8_0 file's),
/// multiplied against `activations`, else as dense rows at the narrowest
/// exact precision (against f32 activations).
fn as_stored(pages: &mut Pages, parts: &[&Matrix], activations: Activations) -> Blocks {
    let joined = Matrix::new(
        parts.iter().map(|m| m.rows).sum(),
        parts[0].cols,
        parts.iter().flat_map(|m| m.f32().into_owned()).collect(),
    );
    match Q8Blocks::exact(&joined) {
        Some(q8) => Blocks::Q8(q8, activations),
        None => Blocks::Dense(Dense::stack_in(pages, parts)),
    }
}

impl Q4Weights {
    /// `w`'s matrices at the precision their file stored them in (`cpu-simd`):
    /// dense f16, bf16 or f32 rows, or 8-bit blocks where those give the
    /// values back exactly; products on `threads` threads. Dense rows and
    /// the output projection take f32 activations, the layers' 8-bit blocks
    /// `activations`: with [`Activations::F32`] the reference's numerics, up
    /// to the order of sums; with [`Activations::Q8`] each such product adds
    /// its inputs' 8-bit rounding too ([`Q8Inputs::rounding_bound`]), as
    /// llama.cpp's Q8_0 × Q8_0.
    pub fn at_stored_precision(
        w: &Weights,
        threads: usize,
        activations: Activations,
    ) -> Result<Q4Weights, Error> {
        let team = Arc::new(Team::new(threads).map_err(|e| Error::Threads {
            threads,
            reason: e.to_string(),
        })?);
        // Every dense matrix of the model on shared huge pages.
        let mut pages = Pages::new();
        let mut product = |parts: &[&Matrix], activations| PooledProduct {
            blocks: as_stored(&mut pages, parts, activations),
            team: Arc::clone(&team),
        };
        let layers = w
            .layers
            .iter()
            .map(|l| Layer {
                attn_norm: l.attn_norm.clone(),
                qkv: product(&[&l.wq, &l.wk, &l.wv], activations),
                qkv_bias: l.qkv_bias.clone(),
                wo: product(&[&l.wo], activations),
                mlp_norm: l.mlp_norm.clone(),
                gate_up: product(&[&l.w_gate, &l.w_up], activations),
                w_down: product(&[&l.w_down], activations),
            })
            .collect();
        Ok(Q4Weights {
            layers,
            final_norm: w.final_norm.clone(),
            output: product(&[w.output()], Activations::F32),
        })
    }
}

impl ForwardWeights for Q4Weights {
    fn num_layers(&self) -> usize {
        self.layers.len()
    }

    fn layer(&self, index: usize) -> LayerView<'_> {
        let l = &self.layers[index];
        LayerView {
            attn_norm: &l.attn_norm,
            qkv: Box::new(&l.qkv),
            qkv_bias: l.qkv_bias.as_deref(),
            wo: &l.wo,
            mlp_norm: &l.mlp_norm,
            gate_up: Box::new(&l.gate_up),
            w_down: &l.w_down,
        }
    }

    fn final_norm(&self) -> &[f32] {
        &self.final_norm
    }

    fn output(&self) -> &dyn Linear {
        &self.output
    }

    fn for_each_chunk(
        &self,
        out: &mut [f32],
        chunk_len: usize,
        work: &(dyn Fn(usize, &mut [f32]) + Sync),
    ) {
        self.output.team.for_each_chunk_mut(out, chunk_len, work);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dense::DenseData;
    use kiln_core::Model;

    /// cpu-simd's dense matrices lie on the huge-page regions
    /// (kiln_cpu::pages), not on the heap.
    #[test]
    fn dense_matrices_are_on_huge_pages() {
        let model = Model::embedded();
        let w = Q4Weights::at_stored_precision(&model.weights, 1, Activations::F32).unwrap();
        let products = w
            .layers
            .iter()
            .flat_map(|l| [&l.qkv, &l.wo, &l.gate_up, &l.w_down]);
        for p in products.chain([&w.output]) {
            let Blocks::Dense(m) = &p.blocks else {
                panic!("the embedded model's matrices are not Q8_0 blocks");
            };
            let in_pages = match &m.data {
                DenseData::F32(v) => v.in_pages(),
                DenseData::F16(v) => v.in_pages(),
                DenseData::BF16(v) => v.in_pages(),
            };
            assert!(in_pages);
        }
    }
}
