//! The weight buffers a model's modules take, made one matrix at a time
//! from the values its file stores: a GGUF's Q4_0 blocks become q4's, its
//! Q8_0 blocks q8's and f16 rows f16's without a pass through f32, and a
//! matrix that must be widened (another type of blocks, a norm folded into
//! it, the `[in, out]` layout) is widened alone and dropped before the
//! next. An 8B Q4_0 file then needs about its own size in host memory
//! beside the buffers, where widening the model first took 32 GB.

use std::borrow::Cow;

use half::{bf16, f16};
use kiln_core::Model;
use kiln_core::gguf::GgmlType;
use kiln_core::weights::{Matrix, Values, Weights};
use kiln_iree::Tensor;

use crate::graph::{GraphOptions, Precision, WeightLayout};
use crate::q4::Q4Matrix;
use crate::q8::Q8Matrix;

/// One weight argument before its layout and precision.
enum Part<'w> {
    /// A norm's weight or a bias.
    Vector(&'w [f32]),
    Matrix(Rows<'w>),
}

/// A matrix argument's rows, read from the model's matrices where they are:
/// q/k/v stacked and gate/up paired are not first copied into one matrix
/// (for an 8B model that was 9 GB of short-lived copies, most of the time
/// spent packing its Q4_0 file).
struct Rows<'w> {
    parts: Vec<Cow<'w, Matrix>>,
    /// Row k of the argument is row `order[k].1` of `parts[order[k].0]`.
    order: Vec<(usize, usize)>,
}

impl<'w> Rows<'w> {
    fn one(m: Cow<'w, Matrix>) -> Rows<'w> {
        let order = (0..m.rows).map(|r| (0, r)).collect();
        Rows {
            parts: vec![m],
            order,
        }
    }

    /// `[out, in]` matrices of one input width stacked into one.
    fn stacked(ms: &[&'w Matrix]) -> Rows<'w> {
        let order = (ms.iter().enumerate())
            .flat_map(|(p, m)| (0..m.rows).map(move |r| (p, r)))
            .collect();
        Rows {
            parts: ms.iter().map(|&m| Cow::Borrowed(m)).collect(),
            order,
        }
    }

    /// `a` and `b` (`[n, in]` each) as `[2n, in]` with their rows in pairs:
    /// row i of `a`, then row i of `b` ([`GraphOptions::pairs_mlp_rows`]).
    fn paired(a: &'w Matrix, b: &'w Matrix) -> Rows<'w> {
        assert_eq!((a.rows, a.cols), (b.rows, b.cols), "paired rows");
        Rows {
            parts: vec![Cow::Borrowed(a), Cow::Borrowed(b)],
            order: (0..a.rows).flat_map(|r| [(0, r), (1, r)]).collect(),
        }
    }

    fn cols(&self) -> usize {
        self.parts[0].cols
    }

    /// The rows as one matrix.
    fn join(&self) -> Matrix {
        let parts: Vec<&Matrix> = self.parts.iter().map(|m| &**m).collect();
        Matrix::join_rows(&parts, self.order.iter().copied())
    }

    /// Each row's bytes, where every part holds GGUF blocks of `ty`.
    fn blocks(&self, ty: GgmlType) -> Option<Vec<&[u8]>> {
        let parts = (self.parts.iter())
            .map(|m| blocks_of(m, ty))
            .collect::<Option<Vec<_>>>()?;
        let (block, block_bytes) = ty.block();
        let width = self.cols() / block * block_bytes;
        Some(
            (self.order.iter())
                .map(|&(p, r)| &parts[p][r * width..(r + 1) * width])
                .collect(),
        )
    }
}

/// The weight arguments in [`crate::llama::weight_shapes`] order, each made
/// when the iterator reaches it. kiln-core holds matrices `[out, in]`;
/// q/k/v and gate/up are stacked along the output dimension.
fn weight_parts<'w>(
    w: &'w Weights,
    graph: &'w GraphOptions,
) -> impl Iterator<Item = Part<'w>> + 'w {
    // A matrix after an RMSNorm, with the norm's weight folded into its
    // input columns when the graph folds norm weights.
    let after_norm = move |rows: Rows<'w>, norm: &[f32]| match graph.folds_norm_weights() {
        true => Part::Matrix(Rows::one(Cow::Owned(scale_columns(&rows.join(), norm)))),
        false => Part::Matrix(rows),
    };
    let layers = w.layers.iter().flat_map(move |l| {
        let qkv = std::iter::once_with(move || {
            after_norm(Rows::stacked(&[&l.wq, &l.wk, &l.wv]), &l.attn_norm)
        });
        let gate_up = std::iter::once_with(move || {
            let rows = match graph.pairs_mlp_rows {
                true => Rows::paired(&l.w_gate, &l.w_up),
                false => Rows::stacked(&[&l.w_gate, &l.w_up]),
            };
            after_norm(rows, &l.mlp_norm)
        });
        std::iter::once(Part::Vector(&l.attn_norm))
            .chain(qkv)
            .chain(l.qkv_bias.as_deref().map(Part::Vector))
            .chain([
                Part::Matrix(Rows::one(Cow::Borrowed(&l.wo))),
                Part::Vector(&l.mlp_norm),
            ])
            .chain(gate_up)
            .chain(std::iter::once_with(|| {
                Part::Matrix(Rows::one(Cow::Borrowed(&l.w_down)))
            }))
    });
    let output =
        std::iter::once_with(move || after_norm(Rows::one(output_rows(w, graph)), &w.final_norm));
    std::iter::once(Part::Matrix(Rows::one(Cow::Borrowed(&w.embed))))
        .chain(layers)
        .chain(std::iter::once(Part::Vector(&w.final_norm)))
        .chain(output)
}

/// The output projection with the rows the graph holds: a tensor-parallel
/// rank's share of the vocabulary, the last rank's padded with zero rows
/// to the others' count (their logits are dropped after the gather).
fn output_rows<'w>(w: &'w Weights, graph: &GraphOptions) -> Cow<'w, Matrix> {
    let (output, rows) = (w.output(), graph.output_rows(w.embed.rows));
    if output.rows >= rows {
        return Cow::Borrowed(output);
    }
    let mut data = output.f32().into_owned();
    data.resize(rows * output.cols, 0.0);
    Cow::Owned(Matrix::new(rows, output.cols, data))
}

/// `[out, in]` `m` with input column i multiplied by `scale[i]`: `m ·
/// diag(scale)`, an RMSNorm weight folded into the product after it.
fn scale_columns(m: &Matrix, scale: &[f32]) -> Matrix {
    debug_assert_eq!(m.cols, scale.len());
    let mut data = m.f32().into_owned();
    for row in data.chunks_exact_mut(m.cols) {
        for (w, s) in row.iter_mut().zip(scale) {
            *w *= s;
        }
    }
    Matrix::new(m.rows, m.cols, data)
}

/// Row-major rows of `width` elements, each followed by zeros up to
/// `padded` (see [`crate::graph::padded_row`]).
fn pad_rows(data: Vec<f32>, width: usize, padded: usize) -> Vec<f32> {
    if padded == width {
        return data;
    }
    let mut out = Vec::with_capacity(data.len() / width * padded);
    for row in data.chunks_exact(width) {
        out.extend_from_slice(row);
        out.resize(out.len() + padded - width, 0.0);
    }
    out
}

/// A dense buffer at the graph's precision, filled part by part.
enum Dense {
    F32(Vec<f32>),
    F16(Vec<f16>),
    Bf16(Vec<bf16>),
}

impl Dense {
    fn with_capacity(precision: Precision, len: usize) -> Dense {
        match precision {
            Precision::F32 => Dense::F32(Vec::with_capacity(len)),
            Precision::Bf16 => Dense::Bf16(Vec::with_capacity(len)),
            Precision::F16 | Precision::Q4 | Precision::Q8 => Dense::F16(Vec::with_capacity(len)),
        }
    }

    fn extend_f32(&mut self, values: &[f32]) {
        match self {
            Dense::F32(v) => v.extend_from_slice(values),
            Dense::F16(v) => v.extend(values.iter().map(|&x| f16::from_f32(x))),
            Dense::Bf16(v) => v.extend(values.iter().map(|&x| bf16::from_f32(x))),
        }
    }

    fn extend_f16(&mut self, values: &[f16]) {
        match self {
            Dense::F16(v) => v.extend_from_slice(values),
            Dense::F32(v) => v.extend(values.iter().map(|x| x.to_f32())),
            Dense::Bf16(v) => v.extend(values.iter().map(|x| bf16::from_f32(x.to_f32()))),
        }
    }

    /// The rows' values at `[out, in]`, from their own where they need no
    /// widening.
    fn extend_rows(&mut self, rows: &Rows) {
        let cols = rows.cols();
        for &(p, r) in &rows.order {
            let m = &rows.parts[p];
            let at = r * cols..(r + 1) * cols;
            match (m.values(), &mut *self) {
                (Values::F32(v), _) => self.extend_f32(&v[at]),
                (Values::F16(v), _) => self.extend_f16(&v[at]),
                (Values::Bf16(v), Dense::Bf16(out)) => out.extend_from_slice(&v[at]),
                _ => self.extend_f32(&m.rows_f32(r..r + 1)),
            }
        }
    }

    fn len(&self) -> usize {
        match self {
            Dense::F32(v) => v.len(),
            Dense::F16(v) => v.len(),
            Dense::Bf16(v) => v.len(),
        }
    }

    fn into_tensor(self) -> kiln_iree::Result<Tensor> {
        let shape = [self.len() as i64];
        match self {
            Dense::F32(v) => Tensor::f32(&shape, v),
            Dense::F16(v) => Tensor::f16(&shape, v),
            Dense::Bf16(v) => Tensor::bf16(&shape, v),
        }
    }
}

/// The weight buffers the modules take (see `weight_params` in
/// [`crate::llama`]): every weight argument concatenated in order and
/// rounded to the graph's precision; at q4 and q8, that buffer in f16 with
/// each quantized matrix's block scales (and q4's offsets) in its place,
/// and a second buffer of the matrices' values (packed 4-bit, or 8-bit).
pub(crate) fn packed_weights(
    model: &Model,
    graph: &GraphOptions,
) -> kiln_core::Result<Vec<Tensor>> {
    let invalid = |e: &dyn std::fmt::Display| {
        kiln_core::Error::Invalid(format!("{} weights: {e}", graph.precision))
    };
    let shapes = crate::llama::weight_shapes(&model.config, graph);
    let stored: Vec<Vec<usize>> = (shapes.iter().enumerate())
        .map(|(i, shape)| crate::llama::stored_shape(i, shape, graph))
        .collect();
    let blocked = graph.precision.is_blocked();
    let quantized = |i: usize| blocked && crate::llama::is_quantized(i, &stored[i]);
    let dense_len: usize = (stored.iter().enumerate())
        .map(|(i, s)| match quantized(i) {
            // One scale (and at q4 one offset) a block.
            true => {
                let blocks = s.iter().product::<usize>() / crate::q4::BLOCK;
                blocks
                    * if graph.precision == Precision::Q4 {
                        2
                    } else {
                        1
                    }
            }
            false => s.iter().product(),
        })
        .sum();
    let quantized_len: usize = (stored.iter().enumerate())
        .filter(|&(i, _)| quantized(i))
        .map(|(_, s)| s.iter().product::<usize>())
        .sum();
    // Each buffer at its full size from the start: grown as it filled, an
    // 8B model's spent most of its packing in copies and page faults.
    let mut dense = Dense::with_capacity(graph.precision, dense_len);
    let (mut q4, mut q8) = match graph.precision {
        Precision::Q4 => (Vec::with_capacity(quantized_len / 2), Vec::new()),
        Precision::Q8 => (Vec::new(), Vec::with_capacity(quantized_len)),
        _ => (Vec::new(), Vec::new()),
    };
    for (i, part) in weight_parts(&model.weights, graph).enumerate() {
        let rows = match part {
            Part::Vector(v) => {
                dense.extend_f32(v);
                continue;
            }
            Part::Matrix(rows) => rows,
        };
        // `[in, out]` matrices (all but the embedding) transposed, their
        // rows padded.
        let rows = match (i > 0, graph.layout) {
            (true, WeightLayout::InOut) => {
                let m = rows.join();
                let data = pad_rows(m.transposed(), m.rows, stored[i][1]);
                Rows::one(Cow::Owned(Matrix::new(stored[i][0], stored[i][1], data)))
            }
            _ => rows,
        };
        if !quantized(i) {
            dense.extend_rows(&rows);
            continue;
        }
        let Dense::F16(scales) = &mut dense else {
            unreachable!("blocks' scales go to an f16 buffer")
        };
        match (
            graph.precision,
            rows.blocks(GgmlType::Q4_0),
            rows.blocks(GgmlType::Q8_0),
        ) {
            // A file's blocks of the graph's kind, row by row into the
            // buffers.
            (Precision::Q4, Some(blocks), _) => {
                let before = scales.len();
                for row in blocks {
                    crate::q4::append_q4_0(row, &mut q4, scales).map_err(|e| invalid(&e))?;
                }
                let offsets = scales.len() - before;
                scales.extend(std::iter::repeat_n(f16::ZERO, offsets));
            }
            (Precision::Q8, _, Some(blocks)) => {
                for row in blocks {
                    crate::q8::append_q8_0(row, &mut q8, scales).map_err(|e| invalid(&e))?;
                }
            }
            (Precision::Q4, ..) => {
                let q = Q4Matrix::from_matrix(&rows.join()).map_err(|e| invalid(&e))?;
                scales.extend(q.scales.iter().chain(&q.offsets));
                q4.extend(q.quants);
            }
            _ => {
                let q = Q8Matrix::from_matrix(&rows.join()).map_err(|e| invalid(&e))?;
                scales.extend(q.scales);
                q8.extend(q.quants);
            }
        }
    }
    let mut tensors = vec![dense.into_tensor().map_err(to_core)?];
    if blocked {
        let values = match graph.precision {
            Precision::Q4 => Tensor::i4_packed(&[2 * q4.len() as i64], q4),
            _ => Tensor::i8(&[q8.len() as i64], q8),
        };
        tensors.push(values.map_err(to_core)?);
    }
    Ok(tensors)
}

fn to_core(error: impl std::fmt::Display) -> kiln_core::Error {
    kiln_core::Error::Backend(error.to_string())
}

/// `m`'s bytes, where it holds GGUF blocks of `ty`.
fn blocks_of(m: &Matrix, ty: GgmlType) -> Option<&[u8]> {
    m.blocks().filter(|&(t, _)| t == ty).map(|(_, bytes)| bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compiler::Target;

    /// The embedded model with `weights`.
    fn model(weights: Weights) -> Model {
        let mut m = Model::embedded();
        m.config.tie_word_embeddings = weights.lm_head.is_none();
        m.weights = weights;
        m
    }

    /// What every graph takes from a model whose file stores its matrices
    /// as `ty` is what it took when the loader widened them to f32 first:
    /// the same bytes, made one matrix at a time from the stored values.
    fn packs_alike(ty: GgmlType, graphs: &[GraphOptions]) {
        let mut random = Model::embedded().weights;
        for untied in [false, true] {
            if untied {
                let (rows, cols) = (random.embed.rows, random.embed.cols);
                random.lm_head = Some(Matrix::from_fn(rows, cols, |i| {
                    (i % 13) as f32 * 0.01 - 0.06
                }));
            }
            let stored = model(kiln_core::gguf::quantize_weights(&random, ty).unwrap());
            let widened = model(stored.weights.widened());
            assert!(!stored.weights.is_f32() && widened.weights.is_f32());
            assert!(2 * stored.weights.matrix_bytes() <= widened.weights.matrix_bytes());
            for graph in graphs {
                let (a, b) = (
                    packed_weights(&stored, graph),
                    packed_weights(&widened, graph),
                );
                assert!(
                    a.unwrap() == b.unwrap(),
                    "{ty:?} packed for {graph:?}, untied {untied}"
                );
            }
        }
    }

    #[test]
    fn a_files_blocks_pack_as_their_widened_values_do() {
        let cuda = |p| GraphOptions::for_target(Target::Cuda, Some(p), None);
        let cpu = |p| GraphOptions::for_target(Target::LlvmCpu, Some(p), None);
        packs_alike(
            GgmlType::Q4_0,
            &[
                cuda(Precision::Q4),
                cuda(Precision::Q8),
                cuda(Precision::F16),
            ],
        );
        packs_alike(
            GgmlType::Q8_0,
            &[
                cuda(Precision::Q8),
                cuda(Precision::Q4),
                cpu(Precision::F32),
            ],
        );
        // f16 rows: as they are at f16, folded norms and the `[in, out]`
        // layout from widened copies.
        packs_alike(
            GgmlType::F16,
            &[
                cuda(Precision::F16),
                cpu(Precision::F32),
                cpu(Precision::F16),
            ],
        );
    }

    #[test]
    fn q4_0_blocks_are_kept_as_written() {
        let m = Matrix::from_fn(6, 96, |i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.03);
        let stored = kiln_core::gguf::quantize(&m, GgmlType::Q4_0).unwrap();
        let q = Q4Matrix::from_matrix(&stored).unwrap();
        assert!(q.offsets.iter().all(|o| *o == f16::ZERO));
        // The file's values exactly (a zero level's −0 reads +0).
        let (got, want) = (q.dequantize(), stored.f32());
        assert_eq!(got.f32(), want, "the file's values");
        // Its scales are the file's.
        let Values::Blocks { bytes, .. } = stored.values() else {
            unreachable!()
        };
        for (b, scale) in q.scales.iter().enumerate() {
            assert_eq!(
                scale.to_le_bytes(),
                [bytes[18 * b], bytes[18 * b + 1]],
                "block {b}"
            );
        }
    }

    #[test]
    fn a_non_finite_scale_is_refused() {
        let m = Matrix::from_fn(1, 32, |i| i as f32);
        for ty in [GgmlType::Q4_0, GgmlType::Q8_0] {
            let stored = kiln_core::gguf::quantize(&m, ty).unwrap();
            let Values::Blocks { mut bytes, .. } = stored.values().clone() else {
                unreachable!()
            };
            bytes[..2].copy_from_slice(&f16::NAN.to_le_bytes());
            let bad = Matrix::stored(1, 32, Values::Blocks { ty, bytes }).unwrap();
            assert!(Q4Matrix::from_matrix(&bad).is_err() || ty != GgmlType::Q4_0);
            assert!(Q8Matrix::from_matrix(&bad).is_err() || ty != GgmlType::Q8_0);
        }
    }
}
