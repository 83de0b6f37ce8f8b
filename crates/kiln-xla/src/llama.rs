//! The Llama decoder as StableHLO: `prefill_ids` and `prefill_embeddings` for
//! one sequence bucket, and `decode_step` over a device-resident KV cache.
//!
//! Every function takes the RoPE tables and the weights as trailing
//! arguments, in the order of [`weight_shapes`]; the backend uploads them once
//! and passes the same device buffers to every call. Weights and caches are
//! stored at the [`GraphOptions`]' precision; everything else is f32.
//!
//! - `prefill_*(input, length: i32, cos, sin, weights…) -> (logits[V], k, v)`:
//!   `input` is `[S]` token ids or `[S, H]` embeddings, the first `length`
//!   rows real and the rest padding; `logits` are those of row `length - 1`;
//!   `k`, `v` are `[L, C, KV, D]` caches holding rows `0..S`.
//! - `decode_step(token: [1] i32, pos: i32, k, v, cos, sin, weights…) ->
//!   (logits[V], next: [1] i32, pos + 1, k, v)`: appends the token at `pos`,
//!   attends to `0..=pos`, and returns the greedy choice `next` beside the
//!   logits, so that greedy decoding reads 4 bytes back and feeds `next` and
//!   `pos + 1` to the following step without an upload. `k` and `v` are
//!   updated in place (`iree.abi.output`): no cache-sized buffer is
//!   allocated per step.

use kiln_core::ModelConfig;

use crate::graph::{GraphOptions, WeightLayout};
use crate::stablehlo::{Function, Ty, Val, module};

/// The shapes of the weight arguments, in order: embedding `[V, H]`; per
/// layer the attention norm, q, k, v, o, the MLP norm, gate, up, down; the
/// final norm; the output projection. Matrices are `[in, out]` or `[out,
/// in]` as `layout` says.
pub fn weight_shapes(c: &ModelConfig, layout: WeightLayout) -> Vec<Vec<usize>> {
    let (h, i, v) = (c.hidden_size, c.intermediate_size, c.vocab_size);
    let q = c.num_heads * c.head_dim;
    let kv = c.num_kv_heads * c.head_dim;
    let matrix = |inputs: usize, outputs: usize| match layout {
        WeightLayout::InOut => vec![inputs, outputs],
        WeightLayout::OutIn => vec![outputs, inputs],
    };
    let mut shapes = vec![vec![v, h]];
    for _ in 0..c.num_layers {
        shapes.extend([
            vec![h],
            matrix(h, q),
            matrix(h, kv),
            matrix(h, kv),
            matrix(q, h),
            vec![h],
            matrix(h, i),
            matrix(h, i),
            matrix(i, h),
        ]);
    }
    shapes.push(vec![h]);
    shapes.push(matrix(h, v));
    shapes
}

/// The weights as function parameters.
struct Params {
    embed: Val,
    layers: Vec<[Val; 9]>,
    final_norm: Val,
    lm_head: Val,
}

fn weight_params(f: &mut Function, c: &ModelConfig, g: &GraphOptions) -> Params {
    let mut vals = weight_shapes(c, g.layout)
        .into_iter()
        .map(|s| f.param(&s, g.precision.storage()))
        .collect::<Vec<_>>()
        .into_iter();
    let mut next = || vals.next().expect("weight_shapes covers every weight");
    let embed = next();
    let layers = (0..c.num_layers)
        .map(|_| std::array::from_fn(|_| next()))
        .collect();
    Params {
        embed,
        layers,
        final_norm: next(),
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
    }
}

/// RMSNorm of f32 rows `[n, h]`, in f32.
fn rms_norm(f: &mut Function, x: &Val, weight: &Val, eps: f32) -> Val {
    let (n, h) = (x.shape[0], x.shape[1]);
    let squares = f.binary("multiply", x, x);
    let sum = f.reduce("add", &squares, &[1], 0.0);
    let inv_h = f.constant(1.0 / h as f64, &[n], Ty::F32);
    let mean = f.binary("multiply", &sum, &inv_h);
    let eps = f.constant(eps.into(), &[n], Ty::F32);
    let shifted = f.binary("add", &mean, &eps);
    let scale = f.unary("rsqrt", &shifted);
    let scale = f.broadcast(&scale, &[n, h], &[0]);
    let normed = f.binary("multiply", x, &scale);
    let weight = f.convert(weight, Ty::F32);
    let weight = f.broadcast(&weight, &[n, h], &[1]);
    f.binary("multiply", &normed, &weight)
}

/// `x · w` of f32 rows `x` `[n, in]`: `x` is rounded to the weights'
/// precision and the product accumulates in f32.
fn linear(f: &mut Function, dm: &Dims, x: &Val, w: &Val) -> Val {
    let x = f.convert(x, dm.storage);
    let contract: &[usize] = match dm.layout {
        WeightLayout::InOut => &[0],
        WeightLayout::OutIn => &[1],
    };
    f.dot(&x, w, (&[], &[]), (&[1], contract), Ty::F32)
}

/// Rotate-half RoPE on `[n, heads, d]` with `[n, d/2]` cos and sin rows.
fn rope(f: &mut Function, x: &Val, cos: &Val, sin: &Val) -> Val {
    let (n, heads, d) = (x.shape[0], x.shape[1], x.shape[2]);
    let half = d / 2;
    let x1 = f.slice(x, &[0, 0, 0], &[n, heads, half]);
    let x2 = f.slice(x, &[0, 0, half], &[n, heads, d]);
    let c = f.broadcast(cos, &[n, heads, half], &[0, 2]);
    let s = f.broadcast(sin, &[n, heads, half], &[0, 2]);
    let x1c = f.binary("multiply", &x1, &c);
    let x2s = f.binary("multiply", &x2, &s);
    let first = f.binary("subtract", &x1c, &x2s);
    let x2c = f.binary("multiply", &x2, &c);
    let x1s = f.binary("multiply", &x1, &s);
    let second = f.binary("add", &x2c, &x1s);
    f.concatenate(&[&first, &second], 2)
}

/// Grouped-query attention of f32 `q` `[n, heads, d]` over `k`, `v` `[t,
/// kv, d]` (at the storage precision) where `visible` (`[n, t]`, i1) allows;
/// scores and softmax are f32. Returns f32 `[n, heads * d]`.
fn attention(f: &mut Function, dm: &Dims, q: &Val, k: &Val, v: &Val, visible: &Val) -> Val {
    let n = q.shape[0];
    let t = k.shape[0];
    let group = dm.heads / dm.kv_heads;
    let q = f.convert(q, dm.storage);
    let q = f.reshape(&q, &[n, dm.kv_heads, group, dm.d]);
    let q = f.transpose(&q, &[1, 2, 0, 3]);
    let k = f.transpose(k, &[1, 0, 2]);
    let scores = f.dot(&q, &k, (&[0], &[0]), (&[3], &[2]), Ty::F32);
    let scale = f.constant(1.0 / (dm.d as f64).sqrt(), &scores.shape, Ty::F32);
    let scores = f.binary("multiply", &scores, &scale);
    let shape = scores.shape.clone();
    let visible = f.broadcast(visible, &shape, &[2, 3]);
    let masked = f.constant(f64::NEG_INFINITY, &shape, Ty::F32);
    let scores = f.select(&visible, &scores, &masked);
    let max = f.reduce("maximum", &scores, &[3], f64::NEG_INFINITY);
    let max = f.broadcast(&max, &shape, &[0, 1, 2]);
    let shifted = f.binary("subtract", &scores, &max);
    let exps = f.unary("exponential", &shifted);
    let total = f.reduce("add", &exps, &[3], 0.0);
    let total = f.broadcast(&total, &shape, &[0, 1, 2]);
    let probs = f.binary("divide", &exps, &total);
    let probs = f.convert(&probs, dm.storage);
    let v = f.transpose(v, &[1, 0, 2]);
    debug_assert_eq!(v.shape[1], t);
    let out = f.dot(&probs, &v, (&[0], &[0]), (&[3], &[1]), Ty::F32);
    let out = f.transpose(&out, &[2, 0, 1, 3]);
    f.reshape(&out, &[n, dm.heads * dm.d])
}

fn mlp(f: &mut Function, dm: &Dims, x: &Val, w: [&Val; 3]) -> Val {
    let [gate, up, down] = w;
    let g = linear(f, dm, x, gate);
    let u = linear(f, dm, x, up);
    let sig = f.unary("logistic", &g);
    let silu = f.binary("multiply", &g, &sig);
    let hidden = f.binary("multiply", &silu, &u);
    linear(f, dm, &hidden, down)
}

/// Final norm and output projection of one row `[1, H]`; returns f32 `[V]`.
fn logits(f: &mut Function, c: &ModelConfig, dm: &Dims, p: &Params, row: &Val) -> Val {
    let normed = rms_norm(f, row, &p.final_norm, c.rms_norm_eps);
    let out = linear(f, dm, &normed, &p.lm_head);
    f.reshape(&out, &[c.vocab_size])
}

/// Embedding rows of `ids` (`[n]` i32), in f32.
fn embed(f: &mut Function, p: &Params, ids: &Val) -> Val {
    let rows = f.take_rows(&p.embed, ids);
    f.convert(&rows, Ty::F32)
}

/// The prefill function for sequence bucket `seq` and context `context`.
fn prefill(
    c: &ModelConfig,
    g: &GraphOptions,
    seq: usize,
    context: usize,
    from_embeddings: bool,
) -> String {
    let dm = dims(c, g);
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
    let rows = f.iota(&[seq, seq], 0);
    let cols = f.iota(&[seq, seq], 1);
    let causal = f.compare_i32("LE", &cols, &rows);

    let mut keys = Vec::new();
    let mut values = Vec::new();
    for w in &p.layers {
        let [attn_norm, wq, wk, wv, wo, mlp_norm, gate, up, down] = w;
        let normed = rms_norm(&mut f, &x, attn_norm, c.rms_norm_eps);
        let q = linear(&mut f, &dm, &normed, wq);
        let q = f.reshape(&q, &[seq, dm.heads, dm.d]);
        let q = rope(&mut f, &q, &cos, &sin);
        let k = linear(&mut f, &dm, &normed, wk);
        let k = f.reshape(&k, &[seq, dm.kv_heads, dm.d]);
        let k = rope(&mut f, &k, &cos, &sin);
        let k = f.convert(&k, dm.storage);
        let v = linear(&mut f, &dm, &normed, wv);
        let v = f.reshape(&v, &[seq, dm.kv_heads, dm.d]);
        let v = f.convert(&v, dm.storage);
        let attended = attention(&mut f, &dm, &q, &k, &v, &causal);
        let projected = linear(&mut f, &dm, &attended, wo);
        x = f.binary("add", &x, &projected);
        let normed = rms_norm(&mut f, &x, mlp_norm, c.rms_norm_eps);
        let m = mlp(&mut f, &dm, &normed, [gate, up, down]);
        x = f.binary("add", &x, &m);
        for (cache, val) in [(&mut keys, k), (&mut values, v)] {
            let padded = f.pad_high(&val, 0.0, &[context - seq, 0, 0]);
            cache.push(f.reshape(&padded, &[1, context, dm.kv_heads, dm.d]));
        }
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

/// The decode step over a `[L, C, KV, D]` cache.
fn decode_step(c: &ModelConfig, g: &GraphOptions, context: usize) -> String {
    let dm = dims(c, g);
    let mut f = Function::new("decode_step");
    let token = f.param(&[1], Ty::I32);
    let pos = f.param(&[], Ty::I32);
    let cache_shape = [dm.layers, context, dm.kv_heads, dm.d];
    // Results 3 and 4 are the updated caches, written over these arguments.
    let mut k_cache = f.param_output(&cache_shape, dm.storage, 3);
    let mut v_cache = f.param_output(&cache_shape, dm.storage, 4);
    let cos = f.param(&[context, dm.d / 2], Ty::F32);
    let sin = f.param(&[context, dm.d / 2], Ty::F32);
    let p = weight_params(&mut f, c, g);

    let zero = f.constant_i32(0, &[]);
    let cos = f.dynamic_slice(&cos, &[&pos, &zero], &[1, dm.d / 2]);
    let sin = f.dynamic_slice(&sin, &[&pos, &zero], &[1, dm.d / 2]);
    let cols = f.iota(&[1, context], 1);
    let pos_row = f.broadcast(&pos, &[1, context], &[]);
    let visible = f.compare_i32("LE", &cols, &pos_row);

    let mut x = embed(&mut f, &p, &token);
    for (l, w) in p.layers.iter().enumerate() {
        let [attn_norm, wq, wk, wv, wo, mlp_norm, gate, up, down] = w;
        let normed = rms_norm(&mut f, &x, attn_norm, c.rms_norm_eps);
        let q = linear(&mut f, &dm, &normed, wq);
        let q = f.reshape(&q, &[1, dm.heads, dm.d]);
        let q = rope(&mut f, &q, &cos, &sin);
        let k = linear(&mut f, &dm, &normed, wk);
        let k = f.reshape(&k, &[1, dm.kv_heads, dm.d]);
        let k = rope(&mut f, &k, &cos, &sin);
        let v = linear(&mut f, &dm, &normed, wv);
        let layer = f.constant_i32(l as i32, &[]);
        let mut layer_view = Vec::new();
        for (cache, new) in [(&mut k_cache, k), (&mut v_cache, v)] {
            let new = f.convert(&new, dm.storage);
            let new = f.reshape(&new, &[1, 1, dm.kv_heads, dm.d]);
            *cache = f.dynamic_update_slice(cache, &new, &[&layer, &pos, &zero, &zero]);
            let rows = f.slice(cache, &[l, 0, 0, 0], &[l + 1, context, dm.kv_heads, dm.d]);
            layer_view.push(f.reshape(&rows, &[context, dm.kv_heads, dm.d]));
        }
        let attended = attention(&mut f, &dm, &q, &layer_view[0], &layer_view[1], &visible);
        let projected = linear(&mut f, &dm, &attended, wo);
        x = f.binary("add", &x, &projected);
        let normed = rms_norm(&mut f, &x, mlp_norm, c.rms_norm_eps);
        let m = mlp(&mut f, &dm, &normed, [gate, up, down]);
        x = f.binary("add", &x, &m);
    }
    let logits = logits(&mut f, c, &dm, &p, &x);
    let next = f.argmax(&logits);
    let one = f.constant_i32(1, &[]);
    let next_pos = f.binary("add", &pos, &one);
    f.finish(&[&logits, &next, &next_pos, &k_cache, &v_cache])
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
