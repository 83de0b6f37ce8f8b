//! The Llama decoder as StableHLO: `prefill_ids` and `prefill_embeddings` for
//! one sequence bucket, and `decode_step` over a device-resident KV cache.
//!
//! Every function takes the RoPE tables and then all weights as trailing
//! arguments: the weights packed into one 1-D buffer, in the order and shapes
//! of [`weight_shapes`], which the graph slices (IREE binds the slices as
//! views, no copies). One buffer instead of ~200 cuts the per-call cost of
//! passing arguments. The backend uploads it once and passes it to every
//! call. Weights and caches are stored at the [`GraphOptions`]' precision;
//! everything else is f32. At q4 there are two buffers (see
//! [`weight_params`]): f16 for the unquantized weights and each matrix's
//! block scales and offsets, and packed i4 for the matrices' values. With
//! [`GraphOptions::fold_norms`] (CUDA), the matrix after each RMSNorm
//! arrives with the norm's weight already folded into its input columns
//! (the backend does it on upload), and the graph applies only the 1/rms
//! scale.
//!
//! - `prefill_*(input, length: i32, cos, sin, weights…) -> (logits[V], k, v)`:
//!   `input` is `[S]` token ids or `[S, H]` embeddings, the first `length`
//!   rows real and the rest padding; `logits` are those of row `length - 1`;
//!   `k` (`[L, KV, C, D]`) and `v` (`[L, KV, D, C]`) are caches holding
//!   positions `0..S`, laid out so that both attention products reduce along
//!   a contiguous dimension: no transpose per step.
//! - `decode_step(token: [1] i32, pos: i32, k, v, cos, sin, weights…) ->
//!   (logits[V], next: [1] i32, pos + 1, k, v)`: appends the token at `pos`,
//!   attends to `0..=pos`, and returns the greedy choice `next` beside the
//!   logits, so that greedy decoding reads 4 bytes back and feeds `next` and
//!   `pos + 1` to the following step without an upload. `k` and `v` are
//!   updated in place (`iree.abi.output`): no cache-sized buffer is
//!   allocated per step.
//! - `append_tokens(tokens: [R] i32, pos: i32, k, v, cos, sin, weights…) ->
//!   (logits[R, V], next: [R] i32, k, v)`: appends R tokens at `pos..pos+R`
//!   in one pass over the weights and returns every row's logits and greedy
//!   choice: the check of speculated tokens. Padding rows past the real ones
//!   only write cache rows that no real row sees and that later steps
//!   overwrite; the caller keeps `pos + R` within the context.
//! - `decode_batch(tokens: [B] i32, positions: [B] i32, k_0, v_0, …,
//!   k_{B-1}, v_{B-1}, cos, sin, weights…) -> (logits[B, V], next: [B] i32,
//!   positions + 1, k_0, v_0, …)`: one step of B independent sequences
//!   (continuous batching), each slot's caches updated in place.

use kiln_core::ModelConfig;

use crate::graph::{DecodeAttention, GraphOptions, Precision, Q4Rows, WeightLayout, padded_row};
use crate::kernels;
use crate::q4::BLOCK;
use crate::stablehlo::{Function, Ty, Val};

// q4's and q8's blocks are sliced alike.
const _: () = assert!(crate::q4::BLOCK == crate::q8::BLOCK);

/// The shapes of the weight arguments, in order: embedding `[V, H]`; per
/// layer the attention norm, the fused q/k/v projection, o, the MLP norm,
/// the fused gate/up projection, down; the final norm; the output
/// projection. Matrices are `[in, out]` or `[out, in]` as `layout` says.
/// Fusing q/k/v and gate/up makes one larger matrix-vector product of each
/// group per decode step instead of three or two small ones.
pub fn weight_shapes(c: &ModelConfig, g: &GraphOptions) -> Vec<Vec<usize>> {
    let (h, i, v) = (c.hidden_size, c.intermediate_size, c.vocab_size);
    let layout = g.layout;
    let q = c.num_heads * c.head_dim;
    let kv = c.num_kv_heads * c.head_dim;
    let matrix = |inputs: usize, outputs: usize| match layout {
        WeightLayout::InOut => vec![inputs, outputs],
        WeightLayout::OutIn => vec![outputs, inputs],
    };
    let mut shapes = vec![vec![v, h]];
    for _ in 0..c.num_layers {
        shapes.extend([vec![h], matrix(h, q + 2 * kv)]);
        if c.qkv_bias {
            shapes.push(vec![q + 2 * kv]);
        }
        shapes.extend([matrix(q, h), vec![h], matrix(h, 2 * i), matrix(i, h)]);
    }
    shapes.push(vec![h]);
    shapes.push(matrix(h, g.output_rows(v)));
    shapes
}

/// How entry `index` of [`weight_shapes`] is stored in the packed buffer:
/// at `[in, out]`, a product matrix's rows padded by [`padded_row`] (the
/// graph slices the padding off). The embedding is read a row at a time,
/// and `[out, in]` rows are reduced along their length: both are stored as
/// they are (padding `[out, in]` rows made TinyLlama's f32 decode 25 %
/// slower, docs/models.md).
pub fn stored_shape(index: usize, shape: &[usize], g: &GraphOptions) -> Vec<usize> {
    match (index > 0, shape, g.layout) {
        (true, &[inputs, outputs], WeightLayout::InOut) => {
            vec![inputs, padded_row(outputs, g.precision.storage_bytes())]
        }
        _ => shape.to_vec(),
    }
}

/// Whether entry `index` of [`weight_shapes`] is stored in 4-bit blocks at
/// q4: every matrix but the embedding, of which a step reads one row.
pub fn is_quantized(index: usize, shape: &[usize]) -> bool {
    index > 0 && shape.len() == 2
}

/// A weight matrix in the graph.
enum Weight {
    Dense(Val),
    /// `[out, in]` as blocks: `quants` `[out, in / BLOCK, BLOCK]` i4,
    /// `scales` and `offsets` `[out, in / BLOCK]` f16.
    Q4 {
        quants: Val,
        scales: Val,
        offsets: Val,
    },
    /// `[out, in]` as 8-bit blocks: `quants` `[out, in / BLOCK, BLOCK]` i8,
    /// `scales` `[out, in / BLOCK]` f16.
    Q8 {
        quants: Val,
        scales: Val,
    },
}

impl Weight {
    /// A q4 matrix's `(quants, scales, offsets)`; `what` names the caller,
    /// which only q4 weights reach.
    fn q4_parts(&self, what: &str) -> (&Val, &Val, &Val) {
        match self {
            Weight::Q4 {
                quants,
                scales,
                offsets,
            } => (quants, scales, offsets),
            _ => unreachable!("{what} is called on q4 weights"),
        }
    }

    /// A blocked (q4 or q8) matrix's `(quants, scales, offsets)`, offsets
    /// at q4 only; `None` for a dense one.
    fn blocks(&self) -> Option<(&Val, &Val, Option<&Val>)> {
        match self {
            Weight::Dense(_) => None,
            Weight::Q4 {
                quants,
                scales,
                offsets,
            } => Some((quants, scales, Some(offsets))),
            Weight::Q8 { quants, scales } => Some((quants, scales, None)),
        }
    }

    /// A weight that is never quantized (a vector, the embedding).
    fn dense(self) -> Val {
        match self {
            Weight::Dense(v) => v,
            _ => unreachable!("is_quantized keeps vectors and the embedding dense"),
        }
    }
}

/// One layer's weights.
struct Layer {
    attn_norm: Val,
    qkv: Weight,
    /// `[q | k | v]` biases (Qwen2's), where the model has them.
    qkv_bias: Option<Val>,
    o: Weight,
    mlp_norm: Val,
    gate_up: Weight,
    down: Weight,
}

/// The weights as function parameters.
struct Params {
    embed: Val,
    layers: Vec<Layer>,
    final_norm: Val,
    lm_head: Weight,
}

/// The packed weight parameters, sliced and reshaped into the weights. At
/// q4: an f16 buffer holding, in [`weight_shapes`] order, each unquantized
/// weight, or a quantized matrix's scales then offsets; and an i4 buffer of
/// the quantized matrices' values, in the same order. At q8 the same with
/// scales only and an i8 buffer.
fn weight_params(f: &mut Function, c: &ModelConfig, g: &GraphOptions) -> Params {
    let shapes = weight_shapes(c, g);
    let blocked = g.precision.is_blocked();
    let quantized = |i: usize, s: &[usize]| blocked && is_quantized(i, s);
    // f16 numbers a quantized matrix keeps per block: scale (and offset).
    let per_block = match g.precision {
        Precision::Q4 => 2,
        _ => 1,
    };
    let dense_size = |i: usize, s: &Vec<usize>| match quantized(i, s) {
        true => per_block * s[0] * s[1] / BLOCK,
        false => s.iter().product(),
    };
    let total: usize = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| dense_size(i, &stored_shape(i, s, g)))
        .sum();
    let dense = f.param(&[total], g.precision.storage());
    let quants = blocked.then(|| {
        let count = shapes.iter().enumerate().filter(|(i, s)| quantized(*i, s));
        let total: usize = count.map(|(_, s)| s[0] * s[1]).sum();
        let ty = match g.precision {
            Precision::Q4 => Ty::I4,
            _ => Ty::I8,
        };
        f.param(&[total], ty)
    });
    let (mut offset, mut q_offset) = (0, 0);
    let take = |f: &mut Function, all: &Val, at: &mut usize, shape: &[usize]| {
        let size: usize = shape.iter().product();
        let flat = f.slice(all, &[*at], &[*at + size]);
        *at += size;
        f.reshape(&flat, shape)
    };
    let mut weights = Vec::with_capacity(shapes.len());
    for (i, s) in shapes.iter().enumerate() {
        weights.push(match (&quants, quantized(i, s)) {
            (Some(all_quants), true) => {
                let blocks = [s[0], s[1] / BLOCK];
                let scales = take(f, &dense, &mut offset, &blocks);
                let offsets = (per_block == 2).then(|| take(f, &dense, &mut offset, &blocks));
                let quants = take(f, all_quants, &mut q_offset, &[s[0], s[1] / BLOCK, BLOCK]);
                match offsets {
                    Some(offsets) => Weight::Q4 {
                        quants,
                        scales,
                        offsets,
                    },
                    None => Weight::Q8 { quants, scales },
                }
            }
            _ => {
                let stored = stored_shape(i, s, g);
                let w = take(f, &dense, &mut offset, &stored);
                Weight::Dense(if stored == *s {
                    w
                } else {
                    f.slice(&w, &[0, 0], s)
                })
            }
        });
    }
    let mut weights = weights.into_iter();
    let mut next = || weights.next().expect("weight_shapes covers every weight");
    let embed = next().dense();
    let layers = (0..c.num_layers)
        .map(|_| Layer {
            attn_norm: next().dense(),
            qkv: next(),
            qkv_bias: c.qkv_bias.then(|| next().dense()),
            o: next(),
            mlp_norm: next().dense(),
            gate_up: next(),
            down: next(),
        })
        .collect();
    Params {
        embed,
        layers,
        final_norm: next().dense(),
        lm_head: next(),
    }
}

/// The graph's sizes and choices.
struct Dims {
    h: usize,
    heads: usize,
    kv_heads: usize,
    d: usize,
    layers: usize,
    /// The element type of weights and caches.
    storage: Ty,
    layout: WeightLayout,
    attention_rows: usize,
    fold_norms: bool,
    /// See [`GraphOptions::folds_norm_weights`]: where false, a folded
    /// norm's weight multiplies the rows instead.
    norm_weights_in_matrices: bool,
    /// Folded norms: the rows go into the products in f32, not rounded to
    /// the storage precision. True for the step functions, whose few rows
    /// must all see the same arithmetic (a speculative step's rows must
    /// give the one-row step's tokens); prefill keeps f16 rows for the
    /// tensor cores.
    rows_in_f32: bool,
    /// See [`GraphOptions::q4_rows`].
    q4_rows: Q4Rows,
    /// See [`GraphOptions::decode_attention`].
    decode_attention: DecodeAttention,
    /// See [`GraphOptions::append_kernel`].
    append_kernel: bool,
    /// See [`GraphOptions::q8_kernel`].
    q8_kernel: bool,
    /// See [`GraphOptions::pairs_mlp_rows`].
    paired_mlp: bool,
    /// See [`GraphOptions::tensor_parallel`].
    ranks: Option<usize>,
    /// The model's vocabulary (the logits after the gather).
    vocab: usize,
}

fn dims(c: &ModelConfig, g: &GraphOptions) -> Dims {
    Dims {
        h: c.hidden_size,
        heads: c.num_heads,
        kv_heads: c.num_kv_heads,
        d: c.head_dim,
        layers: c.num_layers,
        storage: g.precision.storage(),
        layout: g.layout,
        attention_rows: g.attention_rows,
        fold_norms: g.fold_norms,
        norm_weights_in_matrices: g.folds_norm_weights(),
        rows_in_f32: true,
        q4_rows: g.q4_rows,
        decode_attention: g.decode_attention,
        append_kernel: g.append_kernel,
        q8_kernel: g.q8_kernel,
        paired_mlp: g.pairs_mlp_rows,
        ranks: g.tensor_parallel,
        vocab: c.vocab_size,
    }
}

/// RMSNorm'd f32 rows `[n, h]`, in the form the product after the norm
/// takes them.
enum Normed {
    /// The normalised rows.
    Rows(Val),
    /// The raw rows and their 1/rms (`[n]`), the scale applied to the
    /// product's output ([`GraphOptions::fold_norms`]); the norm's weight
    /// is folded into the next matrix, or where the matrices keep their
    /// blocks (q4), it is `weight` and multiplies the rows. kiln's q4
    /// kernel does all of it itself, from `eps` and `weight`.
    Folded {
        x: Val,
        inv_rms: Val,
        eps: f32,
        weight: Option<Val>,
    },
}

impl Normed {
    fn rows(&self) -> usize {
        match self {
            Normed::Rows(x) | Normed::Folded { x, .. } => x.shape[0],
        }
    }
}

/// RMSNorm of f32 rows `[n, h]`, in f32.
fn rms_norm(f: &mut Function, dm: &Dims, x: &Val, weight: &Val, eps: f32) -> Normed {
    let (n, h) = (x.shape[0], x.shape[1]);
    let squares = f.binary("multiply", x, x);
    let sum = f.reduce("add", &squares, &[1], 0.0);
    let inv_h = f.constant(1.0 / h as f64, &[n], Ty::F32);
    let mean = f.binary("multiply", &sum, &inv_h);
    let eps_constant = f.constant(eps.into(), &[n], Ty::F32);
    let shifted = f.binary("add", &mean, &eps_constant);
    let scale = f.unary("rsqrt", &shifted);
    if dm.fold_norms {
        return Normed::Folded {
            x: x.clone(),
            inv_rms: scale,
            eps,
            weight: (!dm.norm_weights_in_matrices).then(|| weight.clone()),
        };
    }
    let scale = f.broadcast(&scale, &[n, h], &[0]);
    let normed = f.binary("multiply", x, &scale);
    let weight = f.convert(weight, Ty::F32);
    let weight = f.broadcast(&weight, &[n, h], &[1]);
    Normed::Rows(f.binary("multiply", &normed, &weight))
}

/// `normed · w`, the product after an RMSNorm. Folded, one row is
/// multiplied in f32 against the widened weights: IREE fuses the widening
/// into the matrix-vector kernel, where rounding the row to f16 first would
/// be a kernel of its own.
fn linear_normed(f: &mut Function, dm: &Dims, normed: &Normed, w: &Weight) -> Val {
    linear_normed_fused(f, dm, normed, w, false)
}

/// [`linear_normed`], and where `paired_swiglu` (the rows of `w` an MLP's
/// gate and up rows in pairs) kiln's kernel writes `SiLU(gate) · up`, `[1,
/// out / 2]`, where it takes the product; elsewhere the product is
/// returned as it is, `[n, out]`.
fn linear_normed_fused(
    f: &mut Function,
    dm: &Dims,
    normed: &Normed,
    w: &Weight,
    paired_swiglu: bool,
) -> Val {
    let (x, inv_rms, eps, weight) = match normed {
        Normed::Rows(x) => return linear(f, dm, x, w),
        Normed::Folded {
            x,
            inv_rms,
            eps,
            weight,
        } => (x, inv_rms, *eps, weight.as_ref()),
    };
    // The kernel normalises: the graph's sum of squares and 1/rms go
    // unused, and IREE drops them.
    if let Some(weight) = weight
        && row_kernel_takes(dm, x, w)
        && dm.rows_in_f32
    {
        let fusion = kernels::RowFusion {
            norm: Some(kernels::RowNorm { eps, weight }),
            paired_swiglu,
            ..Default::default()
        };
        return kernel_row_product(f, x, w, fusion);
    }
    // The norm's weight, where the matrix does not hold it, on the rows.
    let weighted;
    let x = match weight {
        Some(weight) => {
            let weight = f.convert(weight, Ty::F32);
            let weight = f.broadcast(&weight, &x.shape, &[1]);
            weighted = f.binary("multiply", x, &weight);
            &weighted
        }
        None => x,
    };
    if dm.rows_in_f32 && dm.layout == WeightLayout::OutIn {
        let out = match w {
            _ if one_row_over_blocks(w, x.shape[0]) => blocked_one_row(f, dm, x, w),
            _ => {
                let wide = dense_weight(f, dm, w);
                let wide = f.convert(&wide, Ty::F32);
                product(f, dm.layout, x, &wide)
            }
        };
        let scale = f.broadcast(inv_rms, &out.shape, &[0]);
        f.binary("multiply", &out, &scale)
    } else {
        // Prefill: a product IREE runs on tensor cores wants its rows
        // rounded to the storage precision, which is a kernel anyway, so
        // the rows are scaled there (their norm weight is in `w`).
        let scale = f.broadcast(inv_rms, &x.shape, &[0]);
        let normed = f.binary("multiply", x, &scale);
        linear(f, dm, &normed, w)
    }
}

/// `x · w` of f32 rows `x` `[n, in]`: `x` is rounded to the weights'
/// precision and the product accumulates in f32. One row against q4
/// weights stays in f32 (see [`q4_row_product`]).
fn linear(f: &mut Function, dm: &Dims, x: &Val, w: &Weight) -> Val {
    if one_row_over_blocks(w, x.shape[0]) {
        return blocked_one_row(f, dm, x, w);
    }
    let w = dense_weight(f, dm, w);
    let x = f.convert(x, dm.storage);
    product(f, dm.layout, &x, &w)
}

/// `w` as one `[out, in]` matrix at the storage precision: at q4 and q8,
/// the blocks dequantized (in f32, then rounded), a kernel of its own; for
/// products of several rows (prefill, multi-token steps), whose cost is
/// not the weights' bytes.
fn dense_weight(f: &mut Function, dm: &Dims, w: &Weight) -> Val {
    match w {
        Weight::Dense(v) => v.clone(),
        _ => {
            let values = dequantized(f, w);
            let (out, inputs) = (values.shape[0], values.shape[1] * BLOCK);
            let values = f.reshape(&values, &[out, inputs]);
            f.convert(&values, dm.storage)
        }
    }
}

/// The f32 weights of q4 or q8 `w`, `[out, in / BLOCK, BLOCK]`: `q · scale
/// (+ offset at q4)`. Elementwise with the scales broadcast along each
/// block, which IREE takes as a dequantization and fuses into the kernel
/// that consumes it.
fn dequantized(f: &mut Function, w: &Weight) -> Val {
    let (quants, scales, offsets) = w
        .blocks()
        .expect("dequantized is called on blocked weights");
    let shape = quants.shape.clone();
    let q = f.convert(quants, Ty::F32);
    let scale = f.convert(scales, Ty::F32);
    let scale = f.broadcast(&scale, &shape, &[0, 1]);
    let scaled = f.binary("multiply", &q, &scale);
    let Some(offsets) = offsets else {
        return scaled;
    };
    let offset = f.convert(offsets, Ty::F32);
    let offset = f.broadcast(&offset, &shape, &[0, 1]);
    f.binary("add", &scaled, &offset)
}

/// One f32 row `x` `[1, in]` times q4 `w`: `[1, out]`, in f32, as
/// [`Dims::q4_rows`] says.
fn q4_row_product(f: &mut Function, dm: &Dims, x: &Val, w: &Weight) -> Val {
    let (quants, scales, offsets) = w.q4_parts("q4_row_product");
    let (out, groups) = (quants.shape[0], quants.shape[1]);
    match dm.q4_rows {
        Q4Rows::Integer => q4_integer_row_product(f, x, w),
        Q4Rows::Kernel => kernel_row_product(f, x, w, Default::default()),
        // The row rounded to f16: half the bytes each lane reads beside
        // its weights.
        Q4Rows::Configured => match q4_row_kernel(out, groups) {
            Some(info) => {
                let row = f.convert(x, Ty::F16);
                let row = f.reshape(&row, &[groups, BLOCK]);
                let product = f.q4_row_product(quants, scales, offsets, &row, &info);
                f.reshape(&product, &[1, out])
            }
            None => blocked_row_product(f, x, w),
        },
    }
}

/// One f32 row `x` `[1, in]` times q4 or q8 `w`: `[1, out]`, in f32, by
/// kiln's kernel where [`row_kernel_takes`] it, else as
/// [`q4_row_product`] says (q4) or the graph's product (q8).
fn blocked_one_row(f: &mut Function, dm: &Dims, x: &Val, w: &Weight) -> Val {
    match w {
        Weight::Q4 { .. } => q4_row_product(f, dm, x, w),
        _ if row_kernel_takes(dm, x, w) => kernel_row_product(f, x, w, Default::default()),
        _ => blocked_row_product(f, x, w),
    }
}

/// Whether `x · w` is kiln's kernel's: one row against q4 weights where
/// [`Dims::q4_rows`] chooses it (as [`q4_row_product`] does), or against q8
/// weights where [`Dims::q8_kernel`] does.
fn row_kernel_takes(dm: &Dims, x: &Val, w: &Weight) -> bool {
    let chosen = match w {
        Weight::Q4 { .. } => dm.q4_rows == Q4Rows::Kernel,
        Weight::Q8 { .. } => dm.q8_kernel,
        Weight::Dense(_) => false,
    };
    chosen && x.shape[0] == 1
}

/// One f32 row `x` `[1, in]` (`[1, 2 · in]` with `fusion.swiglu`) times q4
/// or q8 `w` with kiln's kernel ([`kernels::q4_row`], [`kernels::q8_row`],
/// with what `fusion` adds; its residual `[1, out]`): `[1, out]`.
fn kernel_row_product(f: &mut Function, x: &Val, w: &Weight, fusion: kernels::RowFusion) -> Val {
    let (quants, scales, offsets) = w.blocks().expect("kiln's row kernels take blocked weights");
    let out = quants.shape[0] / if fusion.paired_swiglu { 2 } else { 1 };
    let row = f.reshape(x, &[x.shape[1]]);
    let residual = fusion.residual.map(|r| f.reshape(r, &[out]));
    let fusion = kernels::RowFusion {
        residual: residual.as_ref(),
        ..fusion
    };
    let product = match offsets {
        Some(offsets) => kernels::q4_row(f, quants, scales, offsets, &row, fusion),
        None => kernels::q8_row(f, quants, scales, &row, fusion),
    };
    f.reshape(&product, &[1, out])
}

/// `residual + x · w` for f32 rows: kiln's q4 kernel adds the residual as
/// it writes its outputs, a kernel fewer than the product and the sum.
fn linear_plus(f: &mut Function, dm: &Dims, x: &Val, w: &Weight, residual: &Val) -> Val {
    if row_kernel_takes(dm, x, w) {
        return fused_plus(f, dm, x, w, false, residual);
    }
    let product = linear(f, dm, x, w);
    plus_partial(f, dm, residual, &product)
}

/// `residual + product`, the product being a rank's partial sum where the
/// graph is one of several ranks': summed over them first.
fn plus_partial(f: &mut Function, dm: &Dims, residual: &Val, product: &Val) -> Val {
    match dm.ranks {
        Some(ranks) => {
            let whole = f.all_reduce_sum(product, ranks);
            f.binary("add", residual, &whole)
        }
        None => f.binary("add", residual, product),
    }
}

/// `residual + x · w` by kiln's row kernel (of `SiLU(gate) · up` where
/// `swiglu`): the kernel adds the residual itself, unless the product is a
/// rank's partial sum, which meets the other ranks' first.
fn fused_plus(
    f: &mut Function,
    dm: &Dims,
    x: &Val,
    w: &Weight,
    swiglu: bool,
    residual: &Val,
) -> Val {
    let fusion = kernels::RowFusion {
        swiglu,
        residual: dm.ranks.is_none().then_some(residual),
        ..Default::default()
    };
    let product = kernel_row_product(f, x, w, fusion);
    match dm.ranks {
        Some(_) => plus_partial(f, dm, residual, &product),
        None => product,
    }
}

/// The largest 16-bit level of a row's block in [`q4_integer_row_product`].
const ROW_LEVELS: f64 = 32767.0;

/// One f32 row `x` `[1, in]` times q4 `w` in integers: `[1, out]`. Each
/// block of the row is rounded to 16-bit levels of its largest magnitude
/// (`x ≈ step · level`), the levels times the 4-bit values summed in i32 per
/// block ([`Function::q4_block_sums`]), then per block `Σ w·x ≈ scale ·
/// step · Σ q·level + offset · Σ x`, `Σ x` from the f32 row. The sums cannot
/// overflow: 32 terms of at most 8 · 32767.
fn q4_integer_row_product(f: &mut Function, x: &Val, w: &Weight) -> Val {
    let (quants, scales, offsets) = w.q4_parts("q4_integer_row_product");
    let (out, blocks) = (scales.shape[0], scales.shape[1]);
    let x = f.reshape(x, &[blocks, BLOCK]);
    // Each kernel here is a wake-up of IREE's worker (tens of µs on a VM),
    // so the row's side is two: both sums in one, the levels in one.
    let magnitudes = f.unary("abs", &x);
    let (largest, row_sums) = f.reduce_pair(["maximum", "add"], (&magnitudes, &x), &[1], [0.0; 2]);
    // `[2, blocks, BLOCK / 2]`: even positions (low nibbles), then odd.
    let pairs = f.reshape(&x, &[blocks, BLOCK / 2, 2]);
    let pairs = f.transpose(&pairs, &[2, 0, 1]);
    // Everything in the levels' shape, so that it is one kernel. A block
    // of zeros: any finite factor gives levels of zero.
    let largest_here = f.broadcast(&largest, &pairs.shape, &[1]);
    let tiny = f.constant(1e-30, &pairs.shape, Ty::F32);
    let nonzero = f.binary("maximum", &largest_here, &tiny);
    let top = f.constant(ROW_LEVELS, &pairs.shape, Ty::F32);
    let factor = f.binary("divide", &top, &nonzero);
    let levels = f.binary("multiply", &pairs, &factor);
    let levels = f.unary("round_nearest_even", &levels);
    let levels = f.convert(&levels, Ty::I16);
    // Left to itself IREE fuses the rounding into the sums' kernel, which
    // then rounds the row again for every output.
    let levels = f.barrier(&levels);
    let bytes = f.i4_as_bytes(quants);
    let half = |f: &mut Function, i: usize| {
        let one = f.slice(&levels, &[i, 0, 0], &[i + 1, blocks, BLOCK / 2]);
        f.reshape(&one, &[blocks, BLOCK / 2])
    };
    let (even, odd) = (half(f, 0), half(f, 1));
    let sums = f.q4_block_sums(&bytes, &even, &odd);
    let sums = f.convert(&sums, Ty::F32);
    let per_block = |f: &mut Function, v: &Val| f.broadcast(v, &[out, blocks], &[1]);
    let largest = per_block(f, &largest);
    let level = f.constant(1.0 / ROW_LEVELS, &[out, blocks], Ty::F32);
    let step = f.binary("multiply", &largest, &level);
    let row_sums = per_block(f, &row_sums);
    let scale = f.convert(scales, Ty::F32);
    let offset = f.convert(offsets, Ty::F32);
    let scaled = f.binary("multiply", &sums, &step);
    let scaled = f.binary("multiply", &scaled, &scale);
    let shifted = f.binary("multiply", &offset, &row_sums);
    let terms = f.binary("add", &scaled, &shifted);
    let product = f.reduce("add", &terms, &[1], 0.0);
    f.reshape(&product, &[1, out])
}

/// The fewest workgroups [`q4_row_kernel`] gives a product: about four per
/// SM of an H200 (132). Its workgroups are one 32-thread subgroup, and with
/// 16 rows each SmolLM2's qkv product (960 outputs) would be 60 of them,
/// fewer than the SMs; below this, IREE's own configuration (one row a
/// workgroup) takes the product. (SmolLM2 decoded at 338-353 tok/s with
/// every product configured, 349-355 with this bound: within the noise;
/// docs/perf-notes.md.)
const Q4_ROW_MIN_WORKGROUPS: usize = 512;

/// The `compilation_info` of a one-row q4 product on CUDA, or `None` where
/// its shape has none or too few workgroups. One 32-lane subgroup per
/// workgroup; each lane takes whole blocks (one 16-byte load of values),
/// `lanes` lanes side by side along a row's blocks and `32 / lanes` rows
/// per workgroup. `lanes` must divide the row's block count (iree-compile
/// did not finish on 32 lanes over 176 blocks), so it is the largest power
/// of two up to 32 that does; the rows per workgroup must divide `out`.
/// Measured on the H200 against IREE's own choice, on matrices far larger
/// than L2: 131072×2048 0.287 against 0.628 ms, 262144×576 0.243 against
/// 0.439 ms (docs/perf-notes.md).
fn q4_row_kernel(out: usize, groups: usize) -> Option<String> {
    let lanes = [32, 16, 8, 4, 2, 1]
        .into_iter()
        .find(|lanes| groups.is_multiple_of(*lanes))?;
    let rows = 32 / lanes;
    if !out.is_multiple_of(rows) || out / rows < Q4_ROW_MIN_WORKGROUPS {
        return None;
    }
    // One row a workgroup: no thread tiling along the rows.
    let thread_rows = usize::from(rows > 1);
    Some(format!(
        "#iree_codegen.compilation_info<lowering_config = #iree_gpu.lowering_config<{{\
         lane_basis = [[{rows}, {lanes}, 1], [0, 1, 2]], partial_reduction = [0, {lanes}, {BLOCK}], \
         subgroup_basis = [[1, 1, 1], [0, 1, 2]], thread = [{thread_rows}, 1, {BLOCK}], \
         workgroup = [{rows}, 0, 0]}}>, translation_info = \
         #iree_codegen.translation_info<pipeline = LLVMGPUVectorDistribute \
         workgroup_size = [32, 1, 1] subgroup_size = 32>>"
    ))
}

/// One f32 row `x` `[1, in]` times q4 or q8 `w` as StableHLO: a product and
/// a reduction over both block dimensions, which IREE fuses with the
/// dequantization into one kernel that reads the stored values. q8's
/// one-row products, and q4's on CUDA shapes [`q4_row_kernel`] has no
/// configuration for.
fn blocked_row_product(f: &mut Function, x: &Val, w: &Weight) -> Val {
    let values = dequantized(f, w);
    let shape = values.shape.clone();
    let row = f.reshape(x, &[shape[1], shape[2]]);
    let row = f.broadcast(&row, &shape, &[1, 2]);
    let terms = f.binary("multiply", &values, &row);
    let out = f.reduce("add", &terms, &[1, 2], 0.0);
    f.reshape(&out, &[1, shape[0]])
}

/// `x · w` of rows `x` `[n, in]` and weights `w` of one element type, laid
/// out as `layout` says; accumulated in f32.
fn product(f: &mut Function, layout: WeightLayout, x: &Val, w: &Val) -> Val {
    match layout {
        WeightLayout::InOut => f.dot(x, w, (&[], &[]), (&[1], &[0]), Ty::F32),
        // One row: a matrix-vector product with the weight on the left.
        WeightLayout::OutIn if x.shape[0] == 1 => {
            let row = f.reshape(x, &[x.shape[1]]);
            let out = f.dot(w, &row, (&[], &[]), (&[1], &[0]), Ty::F32);
            f.reshape(&out, &[1, w.shape[0]])
        }
        WeightLayout::OutIn => f.dot(x, w, (&[], &[]), (&[1], &[1]), Ty::F32),
    }
}

/// Columns `start..end` of `[n, m]` rows.
fn columns(f: &mut Function, x: &Val, start: usize, end: usize) -> Val {
    f.slice(x, &[0, start], &[x.shape[0], end])
}

/// RoPE factors of the rows' positions as full-width `[n, d]` tables:
/// `cos` repeated, and `sin` negated then repeated, so that [`rope`] is one
/// elementwise expression (no slices or concatenation to fuse across).
fn rope_factors(f: &mut Function, cos: &Val, sin: &Val) -> (Val, Val) {
    let cos_full = f.concatenate(&[cos, cos], 1);
    let zero = f.constant(0.0, &sin.shape, Ty::F32);
    let negated = f.binary("subtract", &zero, sin);
    let sin_signed = f.concatenate(&[&negated, sin], 1);
    (cos_full, sin_signed)
}

/// Rotate-half RoPE on `[n, heads, d]` with the `[n, d]` f32 tables of
/// [`rope_factors`]: `x * cos + swap_halves(x) * sin_signed`. Computed in
/// f32 whatever `x`'s type; the result has `x`'s type. The swapped halves
/// are each half broadcast over both and one picked by position: slices,
/// broadcasts and a select, which IREE fuses with the rest into one kernel
/// (a `reverse` of the halves became a kernel of its own).
fn rope(f: &mut Function, x: &Val, cos_full: &Val, sin_signed: &Val) -> Val {
    let (n, heads, d) = (x.shape[0], x.shape[1], x.shape[2]);
    let halves_shape = [n, heads, 2, d / 2];
    let halves = f.reshape(x, &halves_shape);
    let half = |f: &mut Function, i: usize| {
        let one = f.slice(&halves, &[0, 0, i, 0], &[n, heads, i + 1, d / 2]);
        let one = f.reshape(&one, &[n, heads, d / 2]);
        f.broadcast(&one, &halves_shape, &[0, 1, 3])
    };
    let (first, second) = (half(f, 0), half(f, 1));
    let which = f.iota(&halves_shape, 2);
    let zero = f.constant_i32(0, &halves_shape);
    let in_first = f.compare_i32("EQ", &which, &zero);
    let swapped = f.select(&in_first, &second, &first);
    let swapped = f.convert(&swapped, Ty::F32);
    let wide = f.convert(&halves, Ty::F32);
    // Everything in the halves' shape up to the result: a reshape between
    // two elementwise ops keeps IREE from fusing them.
    let table = |f: &mut Function, t: &Val| {
        let t = f.reshape(t, &[n, 2, d / 2]);
        f.broadcast(&t, &halves_shape, &[0, 2, 3])
    };
    let c = table(f, cos_full);
    let s = table(f, sin_signed);
    let xc = f.binary("multiply", &wide, &c);
    let ss = f.binary("multiply", &swapped, &s);
    let out = f.binary("add", &xc, &ss);
    let out = f.convert(&out, x.ty);
    f.reshape(&out, &[n, heads, d])
}

/// Grouped-query attention of `q` `[n, heads, d]` over `k` `[kv, t, d]`
/// and `v_t` `[kv, d, t]` (at the storage precision, the caches' layouts)
/// where `visible` (`[n, t]`, i1) allows; scores and softmax are f32.
/// Returns f32 `[n, heads * d]`. Both products reduce along their operands'
/// contiguous last dimension.
fn attention(f: &mut Function, dm: &Dims, q: &Val, k: &Val, v_t: &Val, visible: &Val) -> Val {
    let n = q.shape[0];
    let t = k.shape[1];
    let group = dm.heads / dm.kv_heads;
    let padded = padded_group(dm, group, n);
    let q = f.convert(q, dm.storage);
    let q = f.reshape(&q, &[n, dm.kv_heads, group, dm.d]);
    let q = pad_rows(f, &q, 2, padded);
    let q = f.transpose(&q, &[1, 2, 0, 3]);
    let scores = f.dot(&q, k, (&[0], &[0]), (&[3], &[2]), Ty::F32);
    let probs = masked_softmax(f, dm, &scores, visible, &[2, 3]);
    debug_assert_eq!(v_t.shape[2], t);
    let out = f.dot(&probs, v_t, (&[0], &[0]), (&[3], &[2]), Ty::F32);
    let out = first_rows(f, &out, 1, group);
    let out = f.transpose(&out, &[2, 0, 1, 3]);
    f.reshape(&out, &[n, dm.heads * dm.d])
}

/// Whether a decode step of `rows` rows over caches of `context` positions
/// attends with kiln's kernels (as [`DecodeAttention::kernels_at`] says for
/// the o product `o`, where its shapes fit them).
fn uses_attention_kernels(dm: &Dims, context: usize, rows: usize, o: &Weight) -> bool {
    dm.decode_attention
        .kernels_at(context, one_row_over_blocks(o, rows))
        && kernels::decode_attention_fits(dm.d, dm.heads / dm.kv_heads, dm.storage, context)
}

/// Whether `rows` rows meet `w` as one row against blocked weights: kiln's
/// row kernels and IREE's one-row products, which take the row in f32;
/// otherwise [`linear`] rounds the rows to the storage precision.
fn one_row_over_blocks(w: &Weight, rows: usize) -> bool {
    w.blocks().is_some() && rows == 1
}

/// The element type the o projection of `rows` rows reads them at (see
/// [`one_row_over_blocks`]). kiln's attention kernels write that, so that
/// no kernel of its own rounds them.
fn o_rows_ty(dm: &Dims, rows: usize, o: &Weight) -> Ty {
    match one_row_over_blocks(o, rows) {
        true => Ty::F32,
        false => dm.storage,
    }
}

/// The query rows each KV head's products compute for `n` rows of a group
/// of `group` heads: the group padded with zero heads until `group × n`
/// reaches `dm.attention_rows` ([`crate::graph::attention_rows_for`] says
/// why). The padded heads' results are sliced away.
fn padded_group(dm: &Dims, group: usize, n: usize) -> usize {
    if group * n >= dm.attention_rows {
        group
    } else {
        dm.attention_rows.div_ceil(n)
    }
}

/// `x` padded with zeros along `dim` to `rows` (no op when it has them).
fn pad_rows(f: &mut Function, x: &Val, dim: usize, rows: usize) -> Val {
    if x.shape[dim] == rows {
        return x.clone();
    }
    let mut high = vec![0; x.shape.len()];
    high[dim] = rows - x.shape[dim];
    f.pad_high(x, 0.0, &high)
}

/// The first `rows` of `x` along `dim` (no op when it has no more).
fn first_rows(f: &mut Function, x: &Val, dim: usize, rows: usize) -> Val {
    if x.shape[dim] == rows {
        return x.clone();
    }
    let mut limit = x.shape.clone();
    limit[dim] = rows;
    f.slice(x, &vec![0; limit.len()], &limit)
}

/// Attention of one query row per sequence slot: `q` `[b, heads, d]` against
/// slot b's own keys `[b, kv, t, d]` and values `[b, kv, d, t]`, where
/// `visible` (`[b, t]`) allows. The slots are a batch dimension of each
/// product, so a step runs one set of attention kernels for all of them.
/// Returns f32 `[b, heads * d]`.
fn slot_attention(f: &mut Function, dm: &Dims, q: &Val, k: &Val, v_t: &Val, visible: &Val) -> Val {
    let (b, t) = (q.shape[0], k.shape[2]);
    let (kv, group, d) = (dm.kv_heads, dm.heads / dm.kv_heads, dm.d);
    let padded = padded_group(dm, group, 1);
    // Slots and KV heads merged into one batch dimension (free reshapes):
    // with two, IREE transposes both caches before each product.
    let q = f.convert(q, dm.storage);
    let q = f.reshape(&q, &[b * kv, group, d]);
    let q = pad_rows(f, &q, 1, padded);
    let k = f.reshape(k, &[b * kv, t, d]);
    let scores = f.dot(&q, &k, (&[0], &[0]), (&[2], &[2]), Ty::F32);
    let scores = f.reshape(&scores, &[b, kv, padded, t]);
    let probs = masked_softmax(f, dm, &scores, visible, &[0, 3]);
    let probs = f.reshape(&probs, &[b * kv, padded, t]);
    let v_t = f.reshape(v_t, &[b * kv, d, t]);
    let out = f.dot(&probs, &v_t, (&[0], &[0]), (&[2], &[2]), Ty::F32);
    let out = first_rows(f, &out, 1, group);
    f.reshape(&out, &[b, dm.heads * d])
}

/// Scaled, masked softmax of f32 `scores` along their last dimension, where
/// `visible` (i1, spread over `scores` along `visible_dims`) allows; the
/// probabilities at the storage precision, the second product's operand.
fn masked_softmax(
    f: &mut Function,
    dm: &Dims,
    scores: &Val,
    visible: &Val,
    visible_dims: &[usize],
) -> Val {
    let shape = scores.shape.clone();
    let last = shape.len() - 1;
    let kept: Vec<usize> = (0..last).collect();
    let scale = f.constant(1.0 / (dm.d as f64).sqrt(), &shape, Ty::F32);
    let scores = f.binary("multiply", scores, &scale);
    let visible = f.broadcast(visible, &shape, visible_dims);
    let masked = f.constant(f64::NEG_INFINITY, &shape, Ty::F32);
    let scores = f.select(&visible, &scores, &masked);
    let max = f.reduce("maximum", &scores, &[last], f64::NEG_INFINITY);
    let max = f.broadcast(&max, &shape, &kept);
    let shifted = f.binary("subtract", &scores, &max);
    let exps = f.unary("exponential", &shifted);
    let total = f.reduce("add", &exps, &[last], 0.0);
    let total = f.broadcast(&total, &shape, &kept);
    let probs = f.binary("divide", &exps, &total);
    f.convert(&probs, dm.storage)
}

/// `residual` plus the MLP (SwiGLU) of normed rows `x`.
fn mlp_plus(
    f: &mut Function,
    dm: &Dims,
    x: &Normed,
    [gate_up, down]: [&Weight; 2],
    residual: &Val,
) -> Val {
    if dm.paired_mlp {
        let hidden = paired_hidden(f, dm, x, gate_up);
        return linear_plus(f, dm, &hidden, down, residual);
    }
    let both = linear_normed(f, dm, x, gate_up);
    // kiln's q4 kernel reads the gate and up halves as SiLU(gate) · up and
    // adds the residual: the SiLU's kernel and the sum's are spared.
    if row_kernel_takes(dm, &both, down) && both.ty == Ty::F32 {
        return fused_plus(f, dm, &both, down, true, residual);
    }
    let i = both.shape[1] / 2;
    let g = columns(f, &both, 0, i);
    let u = columns(f, &both, i, 2 * i);
    let hidden = swiglu(f, &g, &u);
    linear_plus(f, dm, &hidden, down, residual)
}

/// The MLP's hidden rows `SiLU(gate) · up` of normed rows `x`, `gate_up`'s
/// rows in pairs ([`GraphOptions::pairs_mlp_rows`]): one row by kiln's
/// kernel, which writes them itself; several (prefill, batched steps) from
/// the product's columns, taken apart.
fn paired_hidden(f: &mut Function, dm: &Dims, x: &Normed, gate_up: &Weight) -> Val {
    let product = linear_normed_fused(f, dm, x, gate_up, true);
    let (n, width) = (product.shape[0], product.shape[1]);
    // The kernel's hidden row is half as wide as the matrix has rows.
    if gate_up
        .blocks()
        .is_some_and(|(quants, _, _)| quants.shape[0] == 2 * width)
    {
        return product;
    }
    let i = width / 2;
    let pairs = f.reshape(&product, &[n, i, 2]);
    let half = |f: &mut Function, k: usize| {
        let column = f.slice(&pairs, &[0, 0, k], &[n, i, k + 1]);
        f.reshape(&column, &[n, i])
    };
    let (g, u) = (half(f, 0), half(f, 1));
    swiglu(f, &g, &u)
}

/// `SiLU(g) · u`.
fn swiglu(f: &mut Function, g: &Val, u: &Val) -> Val {
    let sig = f.unary("logistic", g);
    let silu = f.binary("multiply", g, &sig);
    f.binary("multiply", &silu, u)
}

/// Final norm and output projection of one row `[1, H]`; returns f32 `[V]`.
fn logits(f: &mut Function, c: &ModelConfig, dm: &Dims, p: &Params, row: &Val) -> Val {
    let normed = rms_norm(f, dm, row, &p.final_norm, c.rms_norm_eps);
    let out = output_product(f, dm, &normed, &p.lm_head);
    f.reshape(&out, &[c.vocab_size])
}

/// The logits of normed rows, `[n, V]`: where the graph is a rank's, its
/// share of the vocabulary's rows gathered with the others' and the last
/// rank's padding dropped.
fn output_product(f: &mut Function, dm: &Dims, normed: &Normed, lm_head: &Weight) -> Val {
    let share = linear_normed(f, dm, normed, lm_head);
    match dm.ranks {
        Some(ranks) => {
            let all = f.all_gather(&share, 1, ranks);
            f.slice(&all, &[0, 0], &[all.shape[0], dm.vocab])
        }
        None => share,
    }
}

/// Embedding rows of `ids` (`[n]` i32), in f32.
fn embed(f: &mut Function, p: &Params, ids: &Val) -> Val {
    let rows = f.take_rows(&p.embed, ids);
    f.convert(&rows, Ty::F32)
}

/// The attention inputs of normed f32 rows `[n, H]`: `q` `[n, heads, d]`
/// and `k`, `v` `[n, kv, d]`, all at the storage precision, RoPE applied to
/// `q` and `k` together (in f32, one elementwise pass over both). Rounding
/// the projection to the storage precision once, where it is computed, lets
/// IREE fuse the conversion into the matrix-vector kernel.
fn project_qkv(
    f: &mut Function,
    dm: &Dims,
    normed: &Normed,
    layer: &Layer,
    rope_tables: &(Val, Val),
) -> (Val, Val, Val) {
    let n = normed.rows();
    let (q_width, kv_width) = (dm.heads * dm.d, dm.kv_heads * dm.d);
    let qkv = qkv_product(f, dm, normed, layer);
    let qkv = f.convert(&qkv, dm.storage);
    let qk = columns(f, &qkv, 0, q_width + kv_width);
    let v = columns(f, &qkv, q_width + kv_width, q_width + 2 * kv_width);
    let qk = f.reshape(&qk, &[n, dm.heads + dm.kv_heads, dm.d]);
    let qk = rope(f, &qk, &rope_tables.0, &rope_tables.1);
    let q = f.slice(&qk, &[0, 0, 0], &[n, dm.heads, dm.d]);
    let k = f.slice(&qk, &[0, dm.heads, 0], &[n, dm.heads + dm.kv_heads, dm.d]);
    let v = f.reshape(&v, &[n, dm.kv_heads, dm.d]);
    (q, k, v)
}

/// The q, k and v projections of normed f32 rows, `[n, (heads + 2 kv) ·
/// d]`, with their biases where the model has them (added in f32, as the
/// reference adds them to its f32 product).
fn qkv_product(f: &mut Function, dm: &Dims, normed: &Normed, layer: &Layer) -> Val {
    let qkv = linear_normed(f, dm, normed, &layer.qkv);
    match &layer.qkv_bias {
        Some(bias) => {
            let wide = f.convert(&qkv, Ty::F32);
            let bias = f.convert(bias, Ty::F32);
            let bias = f.broadcast(&bias, &wide.shape, &[1]);
            f.binary("add", &wide, &bias)
        }
        None => qkv,
    }
}

/// Whether a decode step rotates and appends with kiln's kernel
/// ([`kernels::rope_append`]).
fn uses_append_kernel(dm: &Dims) -> bool {
    dm.append_kernel && kernels::rope_append_fits(dm.d, dm.storage)
}

/// How a decode step rotates each row's q and k and appends its k and v
/// to the caches, with what each way needs, made once a step: kiln's
/// kernel takes the tables and the positions as they are; IREE's graph the
/// rotation factors of the rows' positions and every layer's flat indices
/// into the caches.
enum DecodeAppend {
    Kernel {
        cos: Val,
        sin: Val,
        positions: Val,
    },
    Graph {
        rope_tables: (Val, Val),
        key_at: Val,
        value_at: Val,
    },
}

impl DecodeAppend {
    /// The append of rows at `positions` (`[rows]` i32; row r is slot r of
    /// `slots`, or the one sequence where `slots` is 1 and the caches have
    /// no slots dimension) with RoPE tables `cos` and `sin` (`[context, d /
    /// 2]`).
    fn new(
        f: &mut Function,
        dm: &Dims,
        [cos, sin]: [&Val; 2],
        positions: &Val,
        slots: usize,
        context: usize,
    ) -> DecodeAppend {
        if uses_append_kernel(dm) {
            return DecodeAppend::Kernel {
                cos: cos.clone(),
                sin: sin.clone(),
                positions: positions.clone(),
            };
        }
        let cos = f.take_rows(cos, positions);
        let sin = f.take_rows(sin, positions);
        let rope_tables = rope_factors(f, &cos, &sin);
        let (key_at, value_at) = cache_write_indices(f, dm, positions, slots, context);
        DecodeAppend::Graph {
            rope_tables,
            key_at,
            value_at,
        }
    }

    /// One decode layer's attention inputs: the rows' q `[rows, heads, d]`
    /// at the storage precision, their k and v written into layer `l` of
    /// the caches. With kiln's kernel one dispatch does the rotation and
    /// both writes.
    fn qkv(
        &self,
        f: &mut Function,
        dm: &Dims,
        normed: &Normed,
        (layer, l): (&Layer, usize),
        [keys, values]: [&mut Val; 2],
    ) -> Val {
        match self {
            DecodeAppend::Kernel {
                cos,
                sin,
                positions,
            } => {
                let qkv = qkv_product(f, dm, normed, layer);
                let qkv = f.convert(&qkv, Ty::F32);
                let caches = kernels::DecodeCaches {
                    keys,
                    values,
                    layer: l,
                };
                let (q, k, v) =
                    kernels::rope_append(f, &qkv, [cos, sin], positions, &caches, dm.heads);
                (*keys, *values) = (k, v);
                q
            }
            DecodeAppend::Graph {
                rope_tables,
                key_at,
                value_at,
            } => {
                let (q, k, v) = project_qkv(f, dm, normed, layer, rope_tables);
                let d = k.shape[k.shape.len() - 1];
                let at = layer_rows(f, key_at, l);
                *keys = scatter_flat(f, keys, &at, &k, d);
                let at = layer_rows(f, value_at, l);
                *values = scatter_flat(f, values, &at, &v, 1);
                q
            }
        }
    }
}

/// The rest of a layer after attention: output projection, residual, MLP,
/// residual.
fn finish_layer(
    f: &mut Function,
    c: &ModelConfig,
    dm: &Dims,
    x: &Val,
    attended: &Val,
    w: &Layer,
) -> Val {
    let x = linear_plus(f, dm, attended, &w.o, x);
    let normed = rms_norm(f, dm, &x, &w.mlp_norm, c.rms_norm_eps);
    mlp_plus(f, dm, &normed, [&w.gate_up, &w.down], &x)
}

/// The prefill function for sequence bucket `seq` and context `context`.
fn prefill(
    c: &ModelConfig,
    g: &GraphOptions,
    seq: usize,
    context: usize,
    from_embeddings: bool,
) -> String {
    let dm = Dims {
        rows_in_f32: false,
        ..dims(c, g)
    };
    let name = if from_embeddings {
        "prefill_embeddings"
    } else {
        "prefill_ids"
    };
    let mut f = Function::new(name);
    let input = if from_embeddings {
        f.param(&[seq, dm.h], Ty::F32)
    } else {
        f.param(&[seq], Ty::I32)
    };
    let length = f.param(&[], Ty::I32);
    let cos = f.param(&[context, dm.d / 2], Ty::F32);
    let sin = f.param(&[context, dm.d / 2], Ty::F32);
    let p = weight_params(&mut f, c, g);

    let mut x = if from_embeddings {
        input
    } else {
        embed(&mut f, &p, &input)
    };
    let cos = f.slice(&cos, &[0, 0], &[seq, dm.d / 2]);
    let sin = f.slice(&sin, &[0, 0], &[seq, dm.d / 2]);
    let rope_tables = rope_factors(&mut f, &cos, &sin);
    let rows = f.iota(&[seq, seq], 0);
    let cols = f.iota(&[seq, seq], 1);
    let causal = f.compare_i32("LE", &cols, &rows);

    let mut keys = Vec::new();
    let mut values = Vec::new();
    for w in &p.layers {
        let normed = rms_norm(&mut f, &dm, &x, &w.attn_norm, c.rms_norm_eps);
        let (q, k, v) = project_qkv(&mut f, &dm, &normed, w, &rope_tables);
        // The caches' layouts: k [kv, t, d], v [kv, d, t].
        let k = f.transpose(&k, &[1, 0, 2]);
        let v = f.transpose(&v, &[1, 2, 0]);
        let attended = attention(&mut f, &dm, &q, &k, &v, &causal);
        x = finish_layer(&mut f, c, &dm, &x, &attended, w);
        let k = f.pad_high(&k, 0.0, &[0, context - seq, 0]);
        keys.push(f.reshape(&k, &[1, dm.kv_heads, context, dm.d]));
        let v = f.pad_high(&v, 0.0, &[0, 0, context - seq]);
        values.push(f.reshape(&v, &[1, dm.kv_heads, dm.d, context]));
    }
    let one = f.constant_i32(1, &[]);
    let last = f.binary("subtract", &length, &one);
    let zero = f.constant_i32(0, &[]);
    let row = f.dynamic_slice(&x, &[&last, &zero], &[1, dm.h]);
    let logits = logits(&mut f, c, &dm, &p, &row);
    let k = f.concatenate(&keys.iter().collect::<Vec<_>>(), 0);
    let v = f.concatenate(&values.iter().collect::<Vec<_>>(), 0);
    f.finish(&[&logits, &k, &v])
}

/// The decode step over `[L, KV, C, D]` keys and `[L, KV, D, C]` values.
fn decode_step(c: &ModelConfig, g: &GraphOptions, context: usize) -> String {
    let dm = dims(c, g);
    let mut f = Function::new("decode_step");
    let token = f.param(&[1], Ty::I32);
    let pos = f.param(&[], Ty::I32);
    // Results 3 and 4 are the updated caches, written over these arguments.
    let mut caches = DecodeCaches::params(&mut f, &dm, context, 3);
    let cos = f.param(&[context, dm.d / 2], Ty::F32);
    let sin = f.param(&[context, dm.d / 2], Ty::F32);
    let p = weight_params(&mut f, c, g);
    let logits = decode_one(&mut f, c, &dm, &p, &token, &pos, &mut caches, [&cos, &sin]);
    let next = f.argmax(&logits);
    let one = f.constant_i32(1, &[]);
    let next_pos = f.binary("add", &pos, &one);
    f.finish(&[&logits, &next, &next_pos, &caches.k, &caches.v])
}

/// `steps` greedy decode steps in one call: the token at `pos`, then each
/// step's argmax at the next position. Returns the `[steps]` chosen tokens,
/// the last of them again as `[1]` and the position after it (the next
/// call's inputs, left on the device), and the caches. The host's work per
/// call is spread over `steps` tokens.
fn decode_chain(c: &ModelConfig, g: &GraphOptions, context: usize, steps: usize) -> String {
    let dm = dims(c, g);
    let mut f = Function::new("decode_chain");
    let mut token = f.param(&[1], Ty::I32);
    let mut pos = f.param(&[], Ty::I32);
    // Results 3 and 4 are the updated caches, written over these arguments.
    let mut caches = DecodeCaches::params(&mut f, &dm, context, 3);
    let cos = f.param(&[context, dm.d / 2], Ty::F32);
    let sin = f.param(&[context, dm.d / 2], Ty::F32);
    let p = weight_params(&mut f, c, g);
    let one = f.constant_i32(1, &[]);
    let mut chosen = Vec::with_capacity(steps);
    for _ in 0..steps {
        let logits = decode_one(&mut f, c, &dm, &p, &token, &pos, &mut caches, [&cos, &sin]);
        token = f.argmax(&logits);
        pos = f.binary("add", &pos, &one);
        chosen.push(token.clone());
    }
    let tokens = f.concatenate(&chosen.iter().collect::<Vec<_>>(), 0);
    f.finish(&[&tokens, &token, &pos, &caches.k, &caches.v])
}

/// The decode caches inside a function: `[L, KV, C, D]` keys and `[L, KV,
/// D, C]` values.
struct DecodeCaches {
    k: Val,
    v: Val,
}

impl DecodeCaches {
    /// The caches as parameters, written over by results `first_result`
    /// and the one after.
    fn params(f: &mut Function, dm: &Dims, context: usize, first_result: usize) -> DecodeCaches {
        let (layers, kv) = (dm.layers, dm.kv_heads);
        DecodeCaches {
            k: f.param_output(&[layers, kv, context, dm.d], dm.storage, first_result),
            v: f.param_output(&[layers, kv, dm.d, context], dm.storage, first_result + 1),
        }
    }
}

/// One token through the model at `pos`: its key and value rows written
/// into `caches`, attending to `0..=pos`. Returns the `[vocab]` logits.
#[allow(clippy::too_many_arguments)]
fn decode_one(
    f: &mut Function,
    c: &ModelConfig,
    dm: &Dims,
    p: &Params,
    token: &Val,
    pos: &Val,
    caches: &mut DecodeCaches,
    [cos, sin]: [&Val; 2],
) -> Val {
    let (kv, d, context) = (dm.kv_heads, dm.d, caches.k.shape[2]);
    // The position is only ever an index into device memory (a gather, a
    // scatter, a mask), never a slice offset: IREE reads a slice offset back
    // to the host, which makes the call wait for the step that computed the
    // position (and each step of a chain wait for the one before it).
    let positions = f.reshape(pos, &[1]);
    let append = DecodeAppend::new(f, dm, [cos, sin], &positions, 1, context);
    let cols = f.iota(&[1, context], 1);
    let pos_row = f.broadcast(pos, &[1, context], &[]);
    let visible = f.compare_i32("LE", &cols, &pos_row);

    let mut x = embed(f, p, token);
    for (l, w) in p.layers.iter().enumerate() {
        let normed = rms_norm(f, dm, &x, &w.attn_norm, c.rms_norm_eps);
        let q = append.qkv(f, dm, &normed, (w, l), [&mut caches.k, &mut caches.v]);
        let attended = if uses_attention_kernels(dm, context, 1, &w.o) {
            let layer = kernels::DecodeCaches {
                keys: &caches.k,
                values: &caches.v,
                layer: l,
            };
            kernels::decode_attention(f, &q, &layer, &positions, o_rows_ty(dm, 1, &w.o))
        } else {
            let keys = f.slice(&caches.k, &[l, 0, 0, 0], &[l + 1, kv, context, d]);
            let keys = f.reshape(&keys, &[kv, context, d]);
            let values = f.slice(&caches.v, &[l, 0, 0, 0], &[l + 1, kv, d, context]);
            let values = f.reshape(&values, &[kv, dm.d, context]);
            attention(f, dm, &q, &keys, &values, &visible)
        };
        x = finish_layer(f, c, dm, &x, &attended, w);
    }
    logits(f, c, dm, p, &x)
}

/// The multi-token step: `rows` tokens appended at `pos..pos+rows` of
/// `[L, KV, C, D]` keys and `[L, KV, D, C]` values, row r attending to
/// `0..=pos+r`.
fn append_tokens(c: &ModelConfig, g: &GraphOptions, context: usize, rows: usize) -> String {
    let dm = dims(c, g);
    let mut f = Function::new("append_tokens");
    let tokens = f.param(&[rows], Ty::I32);
    let pos = f.param(&[], Ty::I32);
    let (layers, kv) = (dm.layers, dm.kv_heads);
    // Results 2 and 3 are the updated caches, written over these arguments.
    let mut k_cache = f.param_output(&[layers, kv, context, dm.d], dm.storage, 2);
    let mut v_cache = f.param_output(&[layers, kv, dm.d, context], dm.storage, 3);
    let cos = f.param(&[context, dm.d / 2], Ty::F32);
    let sin = f.param(&[context, dm.d / 2], Ty::F32);
    let p = weight_params(&mut f, c, g);

    let zero = f.constant_i32(0, &[]);
    let cos = f.dynamic_slice(&cos, &[&pos, &zero], &[rows, dm.d / 2]);
    let sin = f.dynamic_slice(&sin, &[&pos, &zero], &[rows, dm.d / 2]);
    let rope_tables = rope_factors(&mut f, &cos, &sin);
    let cols = f.iota(&[rows, context], 1);
    let row_index = f.iota(&[rows, context], 0);
    let pos_rows = f.broadcast(&pos, &[rows, context], &[]);
    let last_visible = f.binary("add", &row_index, &pos_rows);
    let visible = f.compare_i32("LE", &cols, &last_visible);

    let mut x = embed(&mut f, &p, &tokens);
    for (l, w) in p.layers.iter().enumerate() {
        let normed = rms_norm(&mut f, &dm, &x, &w.attn_norm, c.rms_norm_eps);
        let (q, k, v) = project_qkv(&mut f, &dm, &normed, w, &rope_tables);
        let layer = f.constant_i32(l as i32, &[]);
        let k = f.transpose(&k, &[1, 0, 2]);
        let k = f.reshape(&k, &[1, kv, rows, dm.d]);
        k_cache = f.dynamic_update_slice(&k_cache, &k, &[&layer, &zero, &pos, &zero]);
        let keys = f.slice(&k_cache, &[l, 0, 0, 0], &[l + 1, kv, context, dm.d]);
        let keys = f.reshape(&keys, &[kv, context, dm.d]);
        let v = f.transpose(&v, &[1, 2, 0]);
        let v = f.reshape(&v, &[1, kv, dm.d, rows]);
        v_cache = f.dynamic_update_slice(&v_cache, &v, &[&layer, &zero, &zero, &pos]);
        let values = f.slice(&v_cache, &[l, 0, 0, 0], &[l + 1, kv, dm.d, context]);
        let values = f.reshape(&values, &[kv, dm.d, context]);
        let attended = attention(&mut f, &dm, &q, &keys, &values, &visible);
        x = finish_layer(&mut f, c, &dm, &x, &attended, w);
    }
    let normed = rms_norm(&mut f, &dm, &x, &p.final_norm, c.rms_norm_eps);
    let logits = output_product(&mut f, &dm, &normed, &p.lm_head);
    let next = f.argmax_rows(&logits);
    f.finish(&[&logits, &next, &k_cache, &v_cache])
}

/// The batched decode step over the first `rows` of `slots` sequence slots.
/// Every slot's caches are one pair of tensors, `[L, S, KV, C, D]` keys and
/// `[L, S, KV, D, C]` values, updated in place: row r is slot r, with its own
/// position. Weight products run on all rows at once (the weights are read
/// once per step, not once per sequence); each row's new key and value are
/// scattered into its slot at its position, and attention runs over the
/// slots as a batch dimension, each row masked to its own slot's positions,
/// so slots never see each other's rows and the kernel count does not grow
/// with the rows.
fn decode_batch(
    c: &ModelConfig,
    g: &GraphOptions,
    context: usize,
    rows: usize,
    slots: usize,
) -> String {
    // One row (a lone sequence) multiplies as the single step does. More
    // are a matrix product, which in f32 ran on CUDA's SIMT cores in
    // 32-thread workgroups (12.2 ms a step of 32 rows against 1.4 ms for
    // one, docs/server.md); rounded to the storage precision it is IREE's
    // tensor-core product, as prefill's.
    let dm = Dims {
        rows_in_f32: rows == 1,
        ..dims(c, g)
    };
    let mut f = Function::new("decode_batch");
    let tokens = f.param(&[rows], Ty::I32);
    let positions = f.param(&[rows], Ty::I32);
    let (kv, d) = (dm.kv_heads, dm.d);
    // Results 3 and 4 are the updated caches, written over these arguments.
    let mut caches = SlotCaches::params(&mut f, &dm, slots, context, 3);
    let cos = f.param(&[context, d / 2], Ty::F32);
    let sin = f.param(&[context, d / 2], Ty::F32);
    let p = weight_params(&mut f, c, g);

    let append = DecodeAppend::new(&mut f, &dm, [&cos, &sin], &positions, slots, context);
    let cols = f.iota(&[rows, context], 1);
    let position_cols = f.broadcast(&positions, &[rows, context], &[0]);
    let visible = f.compare_i32("LE", &cols, &position_cols);

    let mut x = embed(&mut f, &p, &tokens);
    for (l, w) in p.layers.iter().enumerate() {
        let normed = rms_norm(&mut f, &dm, &x, &w.attn_norm, c.rms_norm_eps);
        let q = append.qkv(&mut f, &dm, &normed, (w, l), [&mut caches.k, &mut caches.v]);
        let attended = if uses_attention_kernels(&dm, context, rows, &w.o) {
            let layer = kernels::DecodeCaches {
                keys: &caches.k,
                values: &caches.v,
                layer: l,
            };
            let out = o_rows_ty(&dm, rows, &w.o);
            kernels::decode_attention(&mut f, &q, &layer, &positions, out)
        } else {
            let keys = f.slice(&caches.k, &[l, 0, 0, 0, 0], &[l + 1, rows, kv, context, d]);
            let keys = f.reshape(&keys, &[rows, kv, context, d]);
            let values = f.slice(&caches.v, &[l, 0, 0, 0, 0], &[l + 1, rows, kv, d, context]);
            let values = f.reshape(&values, &[rows, kv, d, context]);
            slot_attention(&mut f, &dm, &q, &keys, &values, &visible)
        };
        x = finish_layer(&mut f, c, &dm, &x, &attended, w);
    }
    let normed = rms_norm(&mut f, &dm, &x, &p.final_norm, c.rms_norm_eps);
    let logits = output_product(&mut f, &dm, &normed, &p.lm_head);
    let next = f.argmax_rows(&logits);
    let ones = f.constant_i32(1, &[rows]);
    let next_positions = f.binary("add", &positions, &ones);
    f.finish(&[&logits, &next, &next_positions, &caches.k, &caches.v])
}

/// Prefills `rows` prompts of up to `seq` tokens at once, each into its own
/// slot of `slots`: how several waiting sequences join the batch in one call
/// rather than one prefill each. Row r's tokens (`[rows · seq]`, prompt after
/// prompt, the first
/// `lengths[r]` real) are written at positions `0..seq` of slot
/// `slot_ids[r]`, in place, and attend causally among themselves; the
/// products run on all `rows × seq` rows together. Returns each row's
/// logits at its last real token, `[rows, V]`. Positions from `lengths[r]`
/// on hold padding, which the slot's decode steps overwrite before they
/// read it; rows naming the same slot must carry the same prompt (the
/// caller pads with copies of a real row).
fn prefill_batch(
    c: &ModelConfig,
    g: &GraphOptions,
    context: usize,
    rows: usize,
    seq: usize,
    slots: usize,
) -> String {
    let dm = Dims {
        rows_in_f32: false,
        ..dims(c, g)
    };
    let mut f = Function::new("prefill_batch");
    let n = rows * seq;
    let tokens = f.param(&[n], Ty::I32);
    let lengths = f.param(&[rows], Ty::I32);
    let slot_ids = f.param(&[rows], Ty::I32);
    let (kv, d) = (dm.kv_heads, dm.d);
    // Results 1 and 2 are the updated caches, written over these arguments.
    let mut caches = SlotCaches::params(&mut f, &dm, slots, context, 1);
    let cos = f.param(&[context, d / 2], Ty::F32);
    let sin = f.param(&[context, d / 2], Ty::F32);
    let p = weight_params(&mut f, c, g);

    let cos = f.slice(&cos, &[0, 0], &[seq, d / 2]);
    let sin = f.slice(&sin, &[0, 0], &[seq, d / 2]);
    let (cos_full, sin_signed) = rope_factors(&mut f, &cos, &sin);
    let every_row = |f: &mut Function, table: &Val| {
        let table = f.broadcast(table, &[rows, seq, d], &[1, 2]);
        f.reshape(&table, &[n, d])
    };
    let rope_tables = (every_row(&mut f, &cos_full), every_row(&mut f, &sin_signed));
    let query = f.iota(&[seq, seq], 0);
    let key = f.iota(&[seq, seq], 1);
    let causal = f.compare_i32("LE", &key, &query);
    let (key_at, value_at) = prompt_write_indices(&mut f, &dm, &slot_ids, seq, slots, context);

    let mut x = embed(&mut f, &p, &tokens);
    for (l, w) in p.layers.iter().enumerate() {
        let normed = rms_norm(&mut f, &dm, &x, &w.attn_norm, c.rms_norm_eps);
        let (q, k, v) = project_qkv(&mut f, &dm, &normed, w, &rope_tables);
        // Each prompt's keys `[kv, seq, d]` and values `[kv, d, seq]`: the
        // caches' layouts, written into its slot and attended to as they are.
        let k = f.reshape(&k, &[rows, seq, kv, d]);
        let k = f.transpose(&k, &[0, 2, 1, 3]);
        let v = f.reshape(&v, &[rows, seq, kv, d]);
        let v = f.transpose(&v, &[0, 2, 3, 1]);
        caches.write_layer(&mut f, [&key_at, &value_at], l, &k, &v);
        let attended = prompts_attention(&mut f, &dm, &q, &k, &v, &causal);
        x = finish_layer(&mut f, c, &dm, &x, &attended, w);
    }
    // Row r's last real token is row r · seq + lengths[r] - 1 of `x`.
    let starts = f.iota(&[rows], 0);
    let seq_len = f.constant_i32(seq as i32, &[rows]);
    let starts = f.binary("multiply", &starts, &seq_len);
    let ones = f.constant_i32(1, &[rows]);
    let last = f.binary("subtract", &lengths, &ones);
    let last = f.binary("add", &starts, &last);
    let last_rows = f.take_rows(&x, &last);
    let normed = rms_norm(&mut f, &dm, &last_rows, &p.final_norm, c.rms_norm_eps);
    let logits = output_product(&mut f, &dm, &normed, &p.lm_head);
    f.finish(&[&logits, &caches.k, &caches.v])
}

/// Every slot's caches inside a function: `[L, S, KV, C, D]` keys and `[L,
/// S, KV, D, C]` values, updated in place.
struct SlotCaches {
    k: Val,
    v: Val,
}

impl SlotCaches {
    /// The caches of `slots` slots as parameters, written over by results
    /// `first_result` and the one after.
    fn params(
        f: &mut Function,
        dm: &Dims,
        slots: usize,
        context: usize,
        first_result: usize,
    ) -> SlotCaches {
        let (layers, kv, d) = (dm.layers, dm.kv_heads, dm.d);
        SlotCaches {
            k: f.param_output(&[layers, slots, kv, context, d], dm.storage, first_result),
            v: f.param_output(
                &[layers, slots, kv, d, context],
                dm.storage,
                first_result + 1,
            ),
        }
    }

    /// Writes layer `l`'s new keys `k` and values `v` where `[key_at,
    /// value_at]` (every layer's flat indices, from [`cache_write_indices`]
    /// or [`prompt_write_indices`]) say.
    fn write_layer(
        &mut self,
        f: &mut Function,
        [key_at, value_at]: [&Val; 2],
        l: usize,
        k: &Val,
        v: &Val,
    ) {
        let d = k.shape[k.shape.len() - 1];
        let at = layer_rows(f, key_at, l);
        self.k = scatter_flat(f, &self.k, &at, k, d);
        let at = layer_rows(f, value_at, l);
        self.v = scatter_flat(f, &self.v, &at, v, 1);
    }
}

/// Causal attention within each of several prompts: `q` `[r · s, heads,
/// d]` (prompt-major rows) over the prompts' own keys `[r, kv, s, d]` and
/// values `[r, kv, d, s]`, where `causal` (`[s, s]`, query × key) allows.
/// Prompts and KV heads are one batch dimension of both products, as in
/// [`slot_attention`]. Returns f32 `[r · s, heads · d]`.
fn prompts_attention(
    f: &mut Function,
    dm: &Dims,
    q: &Val,
    k: &Val,
    v_t: &Val,
    causal: &Val,
) -> Val {
    let (r, s) = (k.shape[0], k.shape[2]);
    let (kv, group, d) = (dm.kv_heads, dm.heads / dm.kv_heads, dm.d);
    let padded = padded_group(dm, group, s);
    let q = f.convert(q, dm.storage);
    let q = f.reshape(&q, &[r, s, kv, group, d]);
    let q = pad_rows(f, &q, 3, padded);
    let q = f.transpose(&q, &[0, 2, 3, 1, 4]);
    let q = f.reshape(&q, &[r * kv, padded * s, d]);
    let k = f.reshape(k, &[r * kv, s, d]);
    let scores = f.dot(&q, &k, (&[0], &[0]), (&[2], &[2]), Ty::F32);
    let scores = f.reshape(&scores, &[r * kv, padded, s, s]);
    let probs = masked_softmax(f, dm, &scores, causal, &[2, 3]);
    let probs = f.reshape(&probs, &[r * kv, padded * s, s]);
    let v_t = f.reshape(v_t, &[r * kv, d, s]);
    let out = f.dot(&probs, &v_t, (&[0], &[0]), (&[2], &[2]), Ty::F32);
    let out = f.reshape(&out, &[r, kv, padded, s, d]);
    let out = first_rows(f, &out, 2, group);
    let out = f.transpose(&out, &[0, 3, 1, 2, 4]);
    f.reshape(&out, &[r * s, dm.heads * d])
}

/// Where row r (slot r of `slots`) writes its key and value at
/// `positions[r]` in every layer: flat indices, `[layers, n, 1]`, into the
/// keys as rows of `d` (the position is the row) and into the values element
/// by element (the position is the innermost dimension), the tables
/// [`scatter_flat`] writes. IREE scatters along leading dimensions only,
/// hence the flat views.
fn cache_write_indices(
    f: &mut Function,
    dm: &Dims,
    positions: &Val,
    slots: usize,
    context: usize,
) -> (Val, Val) {
    let rows = positions.shape[0];
    let (kv, d) = (dm.kv_heads, dm.d);
    // Every layer's keys of every slot, between two layers' first.
    let layer_keys = slots * kv * context;
    // Row r writes slot r at its position.
    let slot = |f: &mut Function, shape: &[usize]| f.iota(shape, 0);
    let position = |f: &mut Function, shape: &[usize]| f.broadcast(positions, shape, &[0]);
    let strides = [kv * context, context, 1];
    let key_at = flat_index(f, &[rows, kv, 1], slot, position, &strides);
    let key_at = every_layer(f, &key_at, dm.layers, layer_keys);
    let strides = [kv * d * context, d * context, context, 1];
    let value_at = flat_index(f, &[rows, kv, d, 1], slot, position, &strides);
    let value_at = every_layer(f, &value_at, dm.layers, layer_keys * d);
    (key_at, value_at)
}

/// Where the rows of `seqs` prompts of `seq` tokens (row r into slot
/// `slot_ids[r]`, at positions `0..seq`) write their keys and values in
/// every layer: the tables of [`cache_write_indices`], for keys `[r, kv,
/// seq, d]` and values `[r, kv, d, seq]`.
fn prompt_write_indices(
    f: &mut Function,
    dm: &Dims,
    slot_ids: &Val,
    seq: usize,
    slots: usize,
    context: usize,
) -> (Val, Val) {
    let rows = slot_ids.shape[0];
    let (kv, d) = (dm.kv_heads, dm.d);
    let layer_keys = slots * kv * context;
    // Row r writes slot `slot_ids[r]` at positions `0..seq`.
    let slot = |f: &mut Function, shape: &[usize]| f.broadcast(slot_ids, shape, &[0]);
    let position = |f: &mut Function, shape: &[usize]| f.iota(shape, shape.len() - 1);
    let strides = [kv * context, context, 1];
    let key_at = flat_index(f, &[rows, kv, seq], slot, position, &strides);
    let key_at = every_layer(f, &key_at, dm.layers, layer_keys);
    let strides = [kv * d * context, d * context, context, 1];
    let value_at = flat_index(f, &[rows, kv, d, seq], slot, position, &strides);
    let value_at = every_layer(f, &value_at, dm.layers, layer_keys * d);
    (key_at, value_at)
}

/// Flat indices, `[n, 1]` i32, into a cache of layer 0, over indices of
/// `shape`: `slot · strides[0] + Σ index along dim i · strides[i] +
/// position`, where `slot` and `position` make tensors of `shape`, whose
/// first dimension is the rows' and whose last is the position's (its
/// stride, 1, is the last of `strides`); the dimensions between are
/// iterated. `n` is the shape's size.
fn flat_index(
    f: &mut Function,
    shape: &[usize],
    slot: impl Fn(&mut Function, &[usize]) -> Val,
    position: impl Fn(&mut Function, &[usize]) -> Val,
    strides: &[usize],
) -> Val {
    debug_assert_eq!(strides.len(), shape.len());
    let slot = slot(f, shape);
    let stride = f.constant_i32(strides[0] as i32, shape);
    let mut index = f.binary("multiply", &slot, &stride);
    for (dim, &stride) in strides.iter().enumerate().take(shape.len() - 1).skip(1) {
        let along = f.iota(shape, dim);
        let stride = f.constant_i32(stride as i32, shape);
        let step = f.binary("multiply", &along, &stride);
        index = f.binary("add", &index, &step);
    }
    let position = position(f, shape);
    let index = f.binary("add", &index, &position);
    let count = shape.iter().product();
    f.reshape(&index, &[count, 1])
}

/// `cache` with `new`'s values written at the flat indices `at` (`[n, 1]`,
/// from [`cache_write_indices`]): the cache seen as a table of rows `width`
/// wide, `new` as `n` such rows.
fn scatter_flat(f: &mut Function, cache: &Val, at: &Val, new: &Val, width: usize) -> Val {
    let count: usize = cache.shape.iter().product();
    let (table, new) = if width == 1 {
        (f.reshape(cache, &[count]), f.reshape(new, &[at.shape[0]]))
    } else {
        (
            f.reshape(cache, &[count / width, width]),
            f.reshape(new, &[at.shape[0], width]),
        )
    };
    let table = f.scatter(&table, at, &new, &[0]);
    f.reshape(&table, &cache.shape.clone())
}

/// The flat indices `index` (`[n, 1]`, layer 0's) of every layer, `[layers,
/// n, 1]`, a layer `stride` apart: computed once per step rather than once
/// per layer, which would be a kernel per layer.
fn every_layer(f: &mut Function, index: &Val, layers: usize, stride: usize) -> Val {
    let shape = [layers, index.shape[0], 1];
    let layer = f.iota(&shape, 0);
    let stride = f.constant_i32(stride as i32, &shape);
    let offset = f.binary("multiply", &layer, &stride);
    let index = f.broadcast(index, &shape, &[1, 2]);
    f.binary("add", &offset, &index)
}

/// Layer `l`'s rows of [`every_layer`]'s indices, `[n, 1]`.
fn layer_rows(f: &mut Function, indices: &Val, l: usize) -> Val {
    let n = indices.shape[1];
    let rows = f.slice(indices, &[l, 0, 0], &[l + 1, n, 1]);
    f.reshape(&rows, &[n, 1])
}

/// Copies one sequence's caches — prefill's `[L, KV, C, D]` keys and
/// `[L, KV, D, C]` values — into slot `slot` of every slot's caches, in
/// place: how a prefilled sequence joins the batch.
fn admit_slot(c: &ModelConfig, g: &GraphOptions, context: usize, slots: usize) -> String {
    let dm = dims(c, g);
    let (layers, kv, d) = (dm.layers, dm.kv_heads, dm.d);
    let mut f = Function::new("admit_slot");
    let caches = SlotCaches::params(&mut f, &dm, slots, context, 0);
    let k = f.param(&[layers, kv, context, d], dm.storage);
    let v = f.param(&[layers, kv, d, context], dm.storage);
    let slot = f.param(&[], Ty::I32);
    let zero = f.constant_i32(0, &[]);
    let at = [&zero, &slot, &zero, &zero, &zero];
    let k = f.reshape(&k, &[layers, 1, kv, context, d]);
    let k_cache = f.dynamic_update_slice(&caches.k, &k, &at);
    let v = f.reshape(&v, &[layers, 1, kv, d, context]);
    let v_cache = f.dynamic_update_slice(&caches.v, &v, &at);
    f.finish(&[&k_cache, &v_cache])
}

/// `functions` as a module, with the objects of kiln's kernels they
/// dispatch.
fn module(functions: &[String]) -> String {
    crate::stablehlo::module(functions, &kernels::OBJECTS)
}

/// The module of one prefill bucket: `prefill_ids` and `prefill_embeddings`.
pub fn prefill_module(c: &ModelConfig, g: &GraphOptions, seq: usize, context: usize) -> String {
    module(&[
        prefill(c, g, seq, context, false),
        prefill(c, g, seq, context, true),
    ])
}

/// The decode module: `decode_step`.
pub fn decode_module(c: &ModelConfig, g: &GraphOptions, context: usize) -> String {
    module(&[decode_step(c, g, context)])
}

/// The module of `steps` chained greedy decode steps: `decode_chain`.
pub fn decode_chain_module(
    c: &ModelConfig,
    g: &GraphOptions,
    context: usize,
    steps: usize,
) -> String {
    module(&[decode_chain(c, g, context, steps)])
}

/// The multi-token module for `rows` tokens: `append_tokens`.
pub fn append_module(c: &ModelConfig, g: &GraphOptions, context: usize, rows: usize) -> String {
    module(&[append_tokens(c, g, context, rows)])
}

/// The batched decode module over the first `rows` of `slots` slots:
/// `decode_batch`.
pub fn decode_batch_module(
    c: &ModelConfig,
    g: &GraphOptions,
    context: usize,
    rows: usize,
    slots: usize,
) -> String {
    module(&[decode_batch(c, g, context, rows, slots)])
}

/// The module that admits a sequence into one of `slots` slots:
/// `admit_slot`.
pub fn admit_slot_module(
    c: &ModelConfig,
    g: &GraphOptions,
    context: usize,
    slots: usize,
) -> String {
    module(&[admit_slot(c, g, context, slots)])
}

/// The module that prefills `rows` prompts of up to `seq` tokens into slots
/// of `slots`: `prefill_batch`.
pub fn prefill_batch_module(
    c: &ModelConfig,
    g: &GraphOptions,
    context: usize,
    rows: usize,
    seq: usize,
    slots: usize,
) -> String {
    module(&[prefill_batch(c, g, context, rows, seq, slots)])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::Precision;
    use crate::{Target, graph::attention_rows_for};

    fn config(heads: usize, kv_heads: usize) -> ModelConfig {
        ModelConfig {
            hidden_size: heads * 8,
            intermediate_size: 32,
            num_layers: 1,
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim: 8,
            vocab_size: 16,
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            rope_scaling: None,
            tie_word_embeddings: false,
            max_position_embeddings: 64,
            sliding_window: None,
            qkv_bias: false,
            family: kiln_core::config::Family::Llama,
            bos_token_id: None,
            eos_token_ids: vec![],
        }
    }

    fn graph(target: Target) -> GraphOptions {
        GraphOptions::for_target(target, Some(Precision::F16), None)
    }

    /// The q·K product's query operand (`[kv, rows, n, d]`) as it appears
    /// in the module text.
    fn pads_queries_to(module: &str, shape: &str) -> bool {
        module
            .lines()
            .any(|l| l.contains("stablehlo.pad") && l.ends_with(shape))
    }

    /// The shapes of real models' weights (kiln's presets and two more).
    fn real_shapes() -> Vec<ModelConfig> {
        let mut configs: Vec<ModelConfig> = ["random-100m", "tinyllama-1.1b", "smollm2-135m"]
            .iter()
            .map(|name| kiln_core::model::preset(name).unwrap().0)
            .collect();
        // Qwen2.5-0.5B and Llama-3.2-1B.
        for (h, i, heads, kv, v) in [(896, 4864, 14, 2, 151_936), (2048, 8192, 32, 8, 128_256)] {
            let mut c = configs[0].clone();
            (c.hidden_size, c.intermediate_size, c.num_heads) = (h, i, heads);
            (c.num_kv_heads, c.head_dim, c.vocab_size) = (kv, h / heads, v);
            configs.push(c);
        }
        configs
    }

    #[test]
    fn no_in_out_row_is_a_whole_number_of_pages() {
        // Such rows put the lines a matrix-vector kernel loads together in
        // the same cache sets (see `padded_row`).
        for c in real_shapes() {
            for precision in [Precision::F32, Precision::F16, Precision::Bf16] {
                let g = GraphOptions::for_target(
                    crate::compiler::Target::LlvmCpu,
                    Some(precision),
                    None,
                );
                assert_eq!(g.layout, WeightLayout::InOut);
                let bytes = precision.storage_bytes();
                let mut padded = 0;
                for (i, shape) in weight_shapes(&c, &g).iter().enumerate() {
                    let stored = stored_shape(i, shape, &g);
                    if i == 0 || shape.len() != 2 {
                        assert_eq!(&stored, shape, "only product matrices are padded");
                        continue;
                    }
                    let stride = stored[1] * bytes;
                    assert_ne!(
                        stride % 4096,
                        0,
                        "{precision} {shape:?}: rows of {stride} bytes"
                    );
                    assert!(stored[1] - shape[1] <= 64 / bytes);
                    padded += usize::from(stored != *shape);
                }
                println!(
                    "hidden {} {precision}: {padded} matrices padded",
                    c.hidden_size
                );
            }
        }
        // SmolLM2 at f32: every gate/up (3,072 columns) and the output (49,152).
        let smollm2 = kiln_core::model::preset("smollm2-135m").unwrap().0;
        let g =
            GraphOptions::for_target(crate::compiler::Target::LlvmCpu, Some(Precision::F32), None);
        let shapes = weight_shapes(&smollm2, &g);
        let padded: Vec<usize> = (0..shapes.len())
            .filter(|&i| stored_shape(i, &shapes[i], &g) != shapes[i])
            .collect();
        assert_eq!(padded.len(), smollm2.num_layers + 1);
        assert_eq!(
            stored_shape(shapes.len() - 1, &shapes[shapes.len() - 1], &g),
            [576, 49_168]
        );
    }

    #[test]
    fn cuda_pads_small_query_groups_to_eight_rows() {
        assert_eq!(attention_rows_for(Target::Cuda), 8);
        // SmolLM2's group of 3: one decode row padded to 8 heads; the
        // batched step's slots too; a 4-row multi-token step has 12 rows.
        let smol = config(9, 3);
        let cuda = graph(Target::Cuda);
        assert!(pads_queries_to(
            &decode_module(&smol, &cuda, 64),
            "tensor<1x3x8x8xf16>"
        ));
        assert!(pads_queries_to(
            &decode_batch_module(&smol, &cuda, 64, 4, 4),
            "tensor<12x8x8xf16>"
        ));
        let unpadded = GraphOptions {
            attention_rows: 1,
            ..cuda
        };
        assert_eq!(
            append_module(&smol, &cuda, 64, 4),
            append_module(&smol, &unpadded, 64, 4)
        );
        // Two rows of 3 heads: padded to 4 heads, 8 rows.
        assert!(pads_queries_to(
            &append_module(&smol, &cuda, 64, 2),
            "tensor<2x3x4x8xf16>"
        ));
        // TinyLlama's group of 8 is left alone, as is every group on the CPU.
        let tiny = config(32, 4);
        assert_eq!(
            decode_module(&tiny, &cuda, 64),
            decode_module(&tiny, &unpadded, 64)
        );
        assert_eq!(attention_rows_for(Target::LlvmCpu), 1);
    }

    /// The q4 row kernel's lanes divide the row's blocks (iree-compile did
    /// not finish otherwise) and its rows per workgroup divide the outputs;
    /// where they cannot, there is no configuration.
    #[test]
    fn q4_row_kernels_fit_their_shapes() {
        let lanes_rows = |out, groups| {
            let info = q4_row_kernel(out, groups)?;
            let basis = info.split("lane_basis = [[").nth(1).unwrap();
            let v: Vec<usize> = basis
                .split(']')
                .next()
                .unwrap()
                .split(", ")
                .map(|n| n.parse().unwrap())
                .collect();
            Some((v[1], v[0]))
        };
        // TinyLlama's products: the 2048-wide rows (64 blocks) and the
        // 5632-wide ones of the down projection (176).
        assert_eq!(lanes_rows(11264, 64), Some((32, 1)));
        assert_eq!(lanes_rows(32000, 64), Some((32, 1)));
        assert_eq!(lanes_rows(2048, 176), Some((16, 2)));
        // SmolLM2's 576-wide rows (18 blocks): 16 rows a workgroup, which
        // only the head has enough outputs for.
        assert_eq!(lanes_rows(49152, 18), Some((2, 16)));
        assert_eq!(lanes_rows(960, 18), None, "60 workgroups");
        assert_eq!(lanes_rows(576, 48), None, "288 workgroups");
        assert_eq!(lanes_rows(16 * 600 + 8, 18), None, "16 rows do not divide");
    }

    /// The CPU's one-row q4 product in integers against the exact product
    /// of the dequantized weights and the row, within what rounding the row
    /// to 16-bit levels allows (`q4::row_check`), on blocks of very
    /// different magnitudes, a block of zeros and negative values.
    #[test]
    fn q4_integer_rows_are_within_the_rows_rounding_of_the_exact_product() {
        use crate::compiler::Compiler;
        use kiln_iree::{Instance, Tensor};
        let (rows, blocks) = (48, 3);
        let (q, x) = crate::q4::row_check::case(rows, blocks);
        let cols = blocks * BLOCK;
        let mut f = Function::new("row");
        let quants = f.param(&[rows, blocks, BLOCK], Ty::I4);
        let scales = f.param(&[rows, blocks], Ty::F16);
        let offsets = f.param(&[rows, blocks], Ty::F16);
        let row = f.param(&[1, cols], Ty::F32);
        let weight = Weight::Q4 {
            quants,
            scales,
            offsets,
        };
        let y = q4_integer_row_product(&mut f, &row, &weight);
        let mlir = module(&[f.finish(&[&y])]);
        let compiler = Compiler::from_env().unwrap_or_else(|e| panic!("{e}"));
        let vmfb = compiler.compile(&mlir, Target::LlvmCpu, &[]).unwrap();
        let device = Instance::new().unwrap().device("local-task").unwrap();
        let module = device.load_module(&vmfb).unwrap();
        let shape = [rows as i64, blocks as i64];
        let inputs = [
            Tensor::i4_packed(&[shape[0], shape[1], BLOCK as i64], q.quants.clone()).unwrap(),
            Tensor::f16(&shape, q.scales.clone()).unwrap(),
            Tensor::f16(&shape, q.offsets.clone()).unwrap(),
            Tensor::f32(&[1, cols as i64], x.clone()).unwrap(),
        ];
        let out = module.call("row", &inputs).unwrap();
        let got = out[0].as_f32().unwrap();
        let worst = crate::q4::row_check::worst_error(&q.dequantize(), &x, got, ROW_LEVELS);
        println!("worst error relative to Σ|w·x|: {worst:e}");
    }

    /// A one-row q4 product on CUDA carries the kernel configuration where
    /// its shape has one, and is IREE's own fused form where not; both
    /// compile. The CPU's products sum in integers over the values' bytes,
    /// unconfigured.
    #[test]
    fn cuda_q4_rows_carry_their_kernel_configuration() {
        let q4 = |target| GraphOptions {
            q4_rows: match target {
                Target::Cuda => Q4Rows::Configured,
                Target::LlvmCpu => Q4Rows::Integer,
            },
            ..GraphOptions::for_target(target, Some(Precision::Q4), None)
        };
        let configured = "attrs = {compilation_info = #iree_codegen.compilation_info";
        // Every product with at least 512 workgroups: qkv 1536 rows, o and
        // gate-up 1024, down 1024 of 512 inputs (2 rows a workgroup), the
        // head 512.
        let mut wide = config(16, 4);
        (wide.hidden_size, wide.head_dim) = (1024, 64);
        (wide.intermediate_size, wide.vocab_size) = (512, 512);
        let cuda = decode_module(&wide, &q4(Target::Cuda), 64);
        assert_eq!(cuda.matches(configured).count(), 4 + 1);
        let cpu = decode_module(&wide, &q4(Target::LlvmCpu), 64);
        assert_eq!(cpu.matches("linalg.generic").count(), 4 + 1);
        assert_eq!(cpu.matches("flow.tensor.bitcast").count(), 4 + 1);
        assert!(!cpu.contains("compilation_info"));
        // Too few outputs everywhere: no configuration, no linalg.
        let mut narrow = config(4, 2);
        (narrow.hidden_size, narrow.head_dim) = (64, 16);
        (narrow.intermediate_size, narrow.vocab_size) = (96, 64);
        let small = decode_module(&narrow, &q4(Target::Cuda), 64);
        assert!(!small.contains("linalg.generic"));
        match crate::compiler::Compiler::from_env() {
            Ok(compiler) => {
                for module in [cuda, small] {
                    compiler.compile(&module, Target::Cuda, &[]).unwrap();
                }
                compiler.compile(&cpu, Target::LlvmCpu, &[]).unwrap();
            }
            Err(e) => println!("skipped compiling for CUDA: {e}"),
        }
    }

    /// With `--decode-attention kernel`, CUDA's decode steps (one sequence,
    /// a chain, the batched step) attend with kiln's kernels, once each a
    /// layer (the first alone, in one pass, where a context of one tile
    /// leaves one split), where the heads are 64 or 128 wide with at most 8
    /// to a KV head and the cache f16; otherwise, and on the CPU, they attend
    /// through IREE, as by default below 1,024 positions. Prefill never
    /// uses them. The modules compile.
    #[test]
    fn cuda_decode_steps_attend_with_kilns_kernels_where_the_heads_fit() {
        let part = "hal.dispatch.extern \"kiln_attend_part\"[";
        let merge = "hal.dispatch.extern \"kiln_attend_merge\"[";
        let count = |module: &str| (module.matches(part).count(), module.matches(merge).count());
        let options = |target, precision| GraphOptions {
            decode_attention: DecodeAttention::Kernel,
            ..GraphOptions::for_target(target, Some(precision), None)
        };
        let mut tiny = config(8, 2);
        (tiny.hidden_size, tiny.head_dim, tiny.num_layers) = (512, 64, 2);
        let layers = tiny.num_layers;
        let mut modules = Vec::new();
        for precision in [Precision::F16, Precision::Q4] {
            let g = options(Target::Cuda, precision);
            for (context, merged) in [(64, 0), (256, 1)] {
                for module in [
                    decode_module(&tiny, &g, context),
                    decode_chain_module(&tiny, &g, context, 2),
                    decode_batch_module(&tiny, &g, context, 3, 4),
                ] {
                    let chained = if module.contains("decode_chain") {
                        2
                    } else {
                        1
                    };
                    let n = layers * chained;
                    assert_eq!(count(&module), (n, n * merged), "{context} positions");
                    // The attention in the type the o product takes its
                    // rows at: f16 at f16 and for several rows, f32 where
                    // one row meets q4 blocks.
                    let batched = module.contains("decode_batch");
                    let want = match precision == Precision::F16 || batched {
                        true => "xf16>",
                        false => "xf32>",
                    };
                    let last = if merged == 1 { merge } else { part };
                    for (i, _) in module.match_indices(last) {
                        let line = module[i..].lines().next().unwrap();
                        assert!(line.ends_with(want), "{precision:?}: {line}");
                    }
                    modules.push(module);
                }
            }
            assert_eq!(count(&prefill_module(&tiny, &g, 16, 64)), (0, 0));
        }
        // CUDA's default at f16: the kernels from 1,024 positions, the graph
        // below; the graph when asked, at any context.
        let default = GraphOptions::for_target(Target::Cuda, Some(Precision::F16), None);
        assert_eq!(
            default.decode_attention,
            DecodeAttention::Auto,
            "CUDA's default"
        );
        assert_eq!(count(&decode_module(&tiny, &default, 1016)), (0, 0));
        assert_eq!(
            count(&decode_module(&tiny, &default, 1024)),
            (layers, layers)
        );
        let graph = GraphOptions {
            decode_attention: DecodeAttention::Graph,
            ..default
        };
        assert_eq!(count(&decode_module(&tiny, &graph, 1024)), (0, 0));
        // Below 1,024 positions the default takes the kernels where one row
        // meets 4-bit blocks (the step and its chains), not for several rows.
        let q4 = GraphOptions::for_target(Target::Cuda, Some(Precision::Q4), None);
        assert_eq!(q4.decode_attention, DecodeAttention::Auto, "q4's default");
        assert_eq!(count(&decode_module(&tiny, &q4, 64)), (layers, 0));
        assert_eq!(
            count(&decode_chain_module(&tiny, &q4, 64, 2)),
            (2 * layers, 0)
        );
        assert_eq!(count(&decode_batch_module(&tiny, &q4, 64, 3, 4)), (0, 0));
        let q4_graph = GraphOptions {
            decode_attention: DecodeAttention::Graph,
            ..q4
        };
        assert_eq!(count(&decode_module(&tiny, &q4_graph, 64)), (0, 0));
        // bf16 and f32 caches, heads of 16, a group of 9, a context that is
        // not a whole number of 16-byte value rows: IREE's attention.
        for precision in [Precision::Bf16, Precision::F32] {
            let module = decode_module(&tiny, &options(Target::Cuda, precision), 64);
            assert_eq!(count(&module), (0, 0));
        }
        let mut narrow = tiny.clone();
        (narrow.hidden_size, narrow.head_dim) = (128, 16);
        let mut wide_group = tiny.clone();
        (wide_group.num_heads, wide_group.num_kv_heads) = (9, 1);
        wide_group.hidden_size = 9 * 64;
        for (c, context) in [(&narrow, 64), (&wide_group, 64), (&tiny, 60)] {
            let module = decode_module(c, &options(Target::Cuda, Precision::F16), context);
            assert_eq!(count(&module), (0, 0));
        }
        let cpu = decode_module(&tiny, &options(Target::LlvmCpu, Precision::F32), 64);
        assert!(!cpu.contains("hal.dispatch.extern"));
        match crate::compiler::Compiler::from_env() {
            Ok(compiler) => {
                for module in modules {
                    compiler.compile(&module, Target::Cuda, &[]).unwrap();
                }
            }
            Err(e) => println!("skipped compiling the modules: {e}"),
        }
    }

    /// CUDA's default for one-row q4 products is kiln's own kernel (the
    /// fastest measured, `graph::q4_rows_for`), the CPU's the integer form.
    /// CUDA's decode steps with f16 caches (f16 and q4) rotate each row's
    /// q and k and append its k and v with kiln's kernel, one dispatch a
    /// layer where the graph has the rotation and two scatters; the caches
    /// are tied to the kernel's results, so IREE writes them in place: the
    /// compiled step copies no cache. f32 caches, heads too wide for the
    /// kernel and the CPU keep the graph's scatters.
    #[test]
    fn cuda_decode_steps_rotate_and_append_with_kilns_kernel() {
        let c = config(4, 2);
        let append = "hal.dispatch.extern \"kiln_rope_append\"[";
        let cuda = |precision| GraphOptions::for_target(Target::Cuda, Some(precision), None);
        let mut compiled = Vec::new();
        for precision in [Precision::F16, Precision::Q4, Precision::Q8] {
            let g = cuda(precision);
            for (module, appends) in [
                (decode_module(&c, &g, 64), c.num_layers),
                (decode_chain_module(&c, &g, 64, 3), 3 * c.num_layers),
                (decode_batch_module(&c, &g, 64, 4, 8), c.num_layers),
            ] {
                assert_eq!(module.matches(append).count(), appends, "{precision}");
                assert!(!module.contains("stablehlo.scatter"), "{precision}");
                compiled.push(module);
            }
        }
        let mut wide = config(4, 2);
        wide.head_dim = 256;
        for (c, g) in [
            (&c, cuda(Precision::F32)),
            (&wide, cuda(Precision::F16)),
            (
                &c,
                GraphOptions::for_target(Target::LlvmCpu, Some(Precision::F16), None),
            ),
        ] {
            let module = decode_module(c, &g, 64);
            assert!(!module.contains(append));
            assert!(module.contains("stablehlo.scatter"));
        }
        match crate::compiler::Compiler::from_env() {
            Ok(compiler) => {
                for module in &compiled {
                    let stream = compiler
                        .compile(module, Target::Cuda, &["--compile-to=stream"])
                        .unwrap();
                    let stream = String::from_utf8(stream).unwrap();
                    assert!(stream.contains("kiln_rope_append"));
                    for copy in ["stream.async.clone", "stream.async.copy"] {
                        assert!(!stream.contains(copy), "the step has a {copy}");
                    }
                    compiler.compile(module, Target::Cuda, &[]).unwrap();
                }
            }
            Err(e) => println!("skipped compiling the modules: {e}"),
        }
    }

    #[test]
    fn cuda_defaults_to_kilns_q4_kernel() {
        let q4 = |target| GraphOptions::for_target(target, Some(Precision::Q4), None);
        assert_eq!(q4(Target::Cuda).q4_rows, Q4Rows::Kernel);
        assert_eq!(q4(Target::LlvmCpu).q4_rows, Q4Rows::Integer);
    }

    /// With [`Q4Rows::Kernel`] every one-row q4 product on CUDA is a
    /// dispatch of kiln's kernel, whatever its shape, the kernel's PTX in
    /// the module once; the CPU's products sum in integers over the values'
    /// bytes through IREE. Both compile.
    #[test]
    fn cuda_q4_rows_dispatch_kilns_kernel() {
        // Attention as IREE's graph: only the products are kiln's.
        let q4 = |target| GraphOptions {
            q4_rows: Q4Rows::Kernel,
            decode_attention: DecodeAttention::Graph,
            ..GraphOptions::for_target(target, Some(Precision::Q4), None)
        };
        let mut wide = config(16, 4);
        (wide.hidden_size, wide.head_dim) = (1024, 64);
        (wide.intermediate_size, wide.vocab_size) = (512, 512);
        let mut narrow = config(4, 2);
        (narrow.hidden_size, narrow.head_dim) = (64, 16);
        (narrow.intermediate_size, narrow.vocab_size) = (96, 64);
        let products = |c: &ModelConfig| 4 * c.num_layers + 1;
        let mut cuda = Vec::new();
        for c in [&wide, &narrow] {
            let module = decode_module(c, &q4(Target::Cuda), 64);
            // The products, and each layer's rotation and cache append.
            let dispatches = products(c) + c.num_layers;
            assert_eq!(module.matches("hal.dispatch.extern").count(), dispatches);
            // Every dispatch names the one entry: IREE runs the first
            // dispatch's entry for all of them (`kernels::Q4_ROW_ENTRY`).
            let entry = format!("hal.dispatch.extern \"{}\"[", crate::kernels::Q4_ROW_ENTRY);
            assert_eq!(module.matches(&entry).count(), products(c));
            assert_eq!(module.matches("kiln_q4_row: \"0x").count(), 1);
            assert!(!module.contains("linalg.generic"));
            // The kernel takes in each layer's SiLU and both residual sums:
            // o's and down's products add the residual (flags 2), the
            // gate/up product's paired rows come out as SiLU(gate) · up
            // (flags 4), and no product reads the MLP's two halves (3).
            assert!(!module.contains("stablehlo.logistic"));
            for (flags, count) in [(2, 2 * c.num_layers), (4, c.num_layers), (3, 0)] {
                let constant = format!("c4 = arith.constant {flags} : i32");
                assert_eq!(module.matches(&constant).count(), count, "{flags}");
            }
            cuda.push(module);
        }
        let cpu = GraphOptions::for_target(Target::LlvmCpu, Some(Precision::Q4), None);
        let cpu = decode_module(&wide, &cpu, 64);
        assert_eq!(cpu.matches("linalg.generic").count(), products(&wide));
        assert_eq!(cpu.matches("stablehlo.logistic").count(), wide.num_layers);
        assert!(!cpu.contains("hal.dispatch.extern"));
        assert!(!cpu.contains("dialect_resources"));
        match crate::compiler::Compiler::from_env() {
            Ok(compiler) => {
                for module in cuda {
                    compiler.compile(&module, Target::Cuda, &[]).unwrap();
                }
                compiler.compile(&cpu, Target::LlvmCpu, &[]).unwrap();
            }
            Err(e) => println!("skipped compiling the modules: {e}"),
        }
    }

    /// The batched step's products after a folded norm take one row in
    /// f32 against the widened weights, as the single step does, and
    /// several rows at the storage precision (a tensor-core product on
    /// CUDA): no weight widened to f32 then.
    #[test]
    fn batched_rows_multiply_at_the_storage_precision() {
        let c = config(4, 2);
        let cuda = GraphOptions::for_target(Target::Cuda, Some(Precision::F16), None);
        // The qkv and gate-up weights, 64 outputs of 32 inputs, widened.
        let widened = "-> tensor<64x32xf32>";
        assert!(decode_batch_module(&c, &cuda, 64, 1, 8).contains(widened));
        assert!(decode_module(&c, &cuda, 64).contains(widened));
        for rows in [4, 8] {
            let module = decode_batch_module(&c, &cuda, 64, rows, 8);
            assert!(!module.contains(widened), "{rows} rows");
        }
    }

    /// q8 modules take the matrices' 8-bit values in an i8 buffer beside
    /// the f16 one (embedding, norms, one scale a block): a one-row step
    /// multiplies the blocks where they lie, widening no whole matrix,
    /// while prefill's rows multiply the dequantized matrix. On CUDA every
    /// one-row product of a step is kiln's q8 kernel, with the q4 kernel's
    /// fusions (no SiLU left in the graph); the CPU's are IREE's. The
    /// modules compile for both targets.
    #[test]
    fn q8_steps_read_the_8_bit_blocks() {
        let c = config(4, 2);
        let (h, qkv) = (
            c.hidden_size,
            (c.num_heads + 2 * c.num_kv_heads) * c.head_dim,
        );
        let values: usize = c.num_layers
            * (h * qkv + c.num_heads * c.head_dim * h + 3 * h * c.intermediate_size)
            + c.vocab_size * h * usize::from(!c.tie_word_embeddings);
        let scales = values / BLOCK;
        let dense = c.vocab_size * h + (2 * c.num_layers + 1) * h + scales;
        let mut compiled = Vec::new();
        for target in [Target::LlvmCpu, Target::Cuda] {
            let g = GraphOptions::for_target(target, Some(Precision::Q8), None);
            let step = decode_module(&c, &g, 64);
            assert!(step.contains(&format!("tensor<{values}xi8>")), "{step}");
            assert!(step.contains(&format!("tensor<{dense}xf16>")));
            // The qkv matrix whole, widened or at f16, is what a step must
            // not make; prefill makes it for its product.
            let whole = format!("tensor<{qkv}x{h}x");
            assert!(!step.contains(&whole), "{target:?}'s step widens a matrix");
            let prefill = prefill_module(&c, &g, 16, 64);
            assert!(prefill.contains(&format!("{whole}f16>")), "{target:?}");
            // A step: qkv, o, gate-up, down a layer and the head; prefill
            // (by ids and by embeddings): the head's product of the last
            // row only.
            let kernels = |m: &str| m.matches("hal.dispatch.extern \"kiln_q8_row\"[").count();
            match target {
                Target::Cuda => {
                    assert_eq!(kernels(&step), 4 * c.num_layers + 1);
                    assert_eq!(kernels(&prefill), 2);
                    assert!(!step.contains("stablehlo.logistic"));
                }
                Target::LlvmCpu => assert_eq!(kernels(&step) + kernels(&prefill), 0),
            }
            compiled.push((target, step));
            compiled.push((target, prefill));
        }
        match crate::compiler::Compiler::from_env() {
            Ok(compiler) => {
                for (target, module) in &compiled {
                    compiler.compile(module, *target, &[]).unwrap();
                }
            }
            Err(e) => println!("skipped compiling the modules: {e}"),
        }
    }

    /// A decode call reads nothing back to the host. IREE reads a slice
    /// offset that the device computes back before it records the rest of
    /// the call, so a position used as one made each call wait for the
    /// step before it and split a chain of steps at every step; as a device
    /// index (gather, scatter, mask) it does not, and IREE records the call
    /// once (a memoized command buffer) instead of on every call.
    #[test]
    fn decode_calls_read_nothing_back_to_the_host() {
        use crate::plan::ModuleKind;
        let c = config(4, 2);
        let cuda = graph(Target::Cuda);
        // At q4 through kiln's own kernel, every product is its dispatch.
        let q4 = GraphOptions {
            q4_rows: Q4Rows::Kernel,
            ..GraphOptions::for_target(Target::Cuda, Some(Precision::Q4), None)
        };
        let modules = [
            (ModuleKind::Decode, decode_module(&c, &cuda, 64)),
            (ModuleKind::Decode, decode_module(&c, &q4, 64)),
            (
                ModuleKind::DecodeChain(3),
                decode_chain_module(&c, &cuda, 64, 3),
            ),
            (
                ModuleKind::DecodeBatch { rows: 4, slots: 8 },
                decode_batch_module(&c, &cuda, 64, 4, 8),
            ),
        ];
        for (kind, module) in &modules {
            // What IREE turns into a host read: a slice at a device value.
            assert!(!module.contains("dynamic_slice"), "{kind:?}");
            assert!(!module.contains("dynamic_update_slice"), "{kind:?}");
        }
        let compiler = match crate::compiler::Compiler::from_env() {
            Ok(compiler) => compiler,
            Err(e) => return println!("skipped compiling the modules: {e}"),
        };
        for (kind, module) in modules {
            let mut flags = kind.compile_flags(Target::Cuda).to_vec();
            flags.push("--output-format=vm-asm");
            let program = compiler.compile(&module, Target::Cuda, &flags).unwrap();
            let program = String::from_utf8(program).unwrap();
            let calls = |op: &str| {
                let callee = format!(" @hal.{op}(");
                let call = |line: &&str| line.contains("vm.call") && line.contains(&callee);
                program.lines().filter(call).count()
            };
            assert_eq!(calls("buffer.load"), 0, "{kind:?} reads a value back");
            // The dispatches recorded once, executed with this call's buffers.
            assert_eq!(calls("device.queue.execute.indirect"), 1, "{kind:?}");
            // Recorded once means when the module loads: the command buffer
            // executed is the memoized one, not one the call records anew
            // (what extern dispatches whose bindings were not `Indirect` made
            // IREE do: every q4 kernel step then paid for a new CUDA graph).
            let execute = program
                .lines()
                .find(|line| {
                    line.contains("vm.call")
                        && line.contains(" @hal.device.queue.execute.indirect(")
                })
                .unwrap();
            assert!(
                execute.contains("_memoize_result_"),
                "{kind:?} records its command buffer on every call: {execute}"
            );
        }
    }

    /// A tensor-parallel rank's graphs (`GraphOptions::tensor_parallel`):
    /// its own slice's shapes, one all-reduce after each layer's attention
    /// and one after its MLP, and the logits gathered from every rank's
    /// share of the vocabulary (the last rank's padded, the padding dropped
    /// after the gather); the whole model's graphs have no collective. On
    /// both targets, at f16 and at q4 (CUDA's row kernel then leaves the
    /// residual to after the sum), the modules compile.
    #[test]
    fn a_ranks_graphs_sum_each_layers_partials_and_gather_the_logits() {
        use kiln_core::tensor_parallel::ShardPlan;
        let mut whole = config(8, 4);
        (whole.hidden_size, whole.intermediate_size) = (64, 128);
        (whole.num_layers, whole.vocab_size) = (3, 101);
        let rank = ShardPlan::new(&whole, 2).unwrap().rank_config(1);
        assert_eq!(
            (rank.num_heads, rank.num_kv_heads, rank.intermediate_size),
            (4, 2, 64)
        );
        let compiler = crate::compiler::Compiler::from_env();
        for target in [Target::Cuda, Target::LlvmCpu] {
            for precision in [Precision::F16, Precision::Q4] {
                let plain = GraphOptions::for_target(target, Some(precision), None);
                let ranked = GraphOptions {
                    tensor_parallel: Some(2),
                    ..plain
                };
                let shapes = weight_shapes(&rank, &ranked);
                let head = shapes.last().unwrap();
                assert!(head.contains(&51) && head.contains(&64), "{head:?}");
                let step = decode_module(&rank, &ranked, 64);
                let prompt = prefill_module(&rank, &ranked, 16, 64);
                for module in [&step, &prompt] {
                    let functions = module.matches("func.func").count();
                    let count = |op: &str| module.matches(op).count();
                    assert_eq!(count("\"stablehlo.all_reduce\""), functions * 2 * 3);
                    assert_eq!(count("\"stablehlo.all_gather\""), functions);
                    assert!(
                        module.contains("-> tensor<1x102xf32>"),
                        "the gather of 2 × 51 rows"
                    );
                }
                for module in [
                    decode_module(&whole, &plain, 64),
                    prefill_module(&whole, &plain, 16, 64),
                ] {
                    assert!(!module.contains("stablehlo.all_"));
                }
                match &compiler {
                    Ok(compiler) => {
                        for module in [&step, &prompt] {
                            compiler
                                .compile(module, target, &[])
                                .unwrap_or_else(|e| panic!("{target:?} {precision}: {e}"));
                        }
                    }
                    Err(e) => println!("skipped compiling the ranks' modules: {e}"),
                }
            }
        }
    }

    /// Every module that updates the KV caches does so in the caller's
    /// buffers: IREE's stream program (CUDA and CPU) holds no copy of a
    /// whole cache. Without `iree.abi.consume` beside `iree.abi.output` a
    /// step copied each cache in, worked on the copy and copied it back.
    #[test]
    fn caches_are_updated_in_place_without_copies() {
        let compiler = match crate::compiler::Compiler::from_env() {
            Ok(compiler) => compiler,
            Err(e) => return println!("skipped: no IREE compiler ({e})"),
        };
        let mut c = config(4, 2);
        c.num_layers = 2;
        let context = 64;
        for target in [Target::Cuda, Target::LlvmCpu] {
            let g = graph(target);
            // An f16 cache: layers × slots × kv × context × d values.
            let cache_bytes =
                |slots: usize| c.num_layers * slots * c.num_kv_heads * context * c.head_dim * 2;
            let modules = [
                ("decode", decode_module(&c, &g, context), cache_bytes(1)),
                ("append", append_module(&c, &g, context, 4), cache_bytes(1)),
                (
                    "decode_batch",
                    decode_batch_module(&c, &g, context, 1, 4),
                    cache_bytes(4),
                ),
                (
                    "prefill_batch",
                    prefill_batch_module(&c, &g, context, 2, 16, 4),
                    cache_bytes(4),
                ),
            ];
            for (name, module, bytes) in modules {
                assert!(module.contains("iree.abi.consume"), "{name}");
                let stream = compiler
                    .compile(&module, target, &["--compile-to=stream"])
                    .unwrap();
                let stream = String::from_utf8(stream).unwrap();
                let size = format!("%c{bytes} ");
                let copies = stream
                    .lines()
                    .filter(|l| l.contains("stream.cmd.copy") && l.contains(&size))
                    .count();
                assert_eq!(copies, 0, "{name} on {target:?} copies a whole cache");
                assert!(
                    stream.contains(&size),
                    "{name}: no resource of {bytes} bytes"
                );
            }
        }
    }
}
