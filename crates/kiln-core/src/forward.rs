//! The CPU reference forward pass: plain loops over f32, written to be read
//! against the Hugging Face Llama implementation. It is the oracle every other
//! backend is tested against.

use crate::config::ModelConfig;
use crate::error::Result;
use crate::weights::{Matrix, Weights};

/// Keys and values of the positions seen so far, per layer:
/// `[position][kv_heads * head_dim]`, flattened.
#[derive(Clone, Debug, Default)]
pub struct KvCache {
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    len: usize,
}

impl KvCache {
    pub fn new(layers: usize) -> KvCache {
        KvCache {
            keys: vec![Vec::new(); layers],
            values: vec![Vec::new(); layers],
            len: 0,
        }
    }

    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Keeps the first `len` positions and drops the rest (the rows of
    /// speculated tokens the model rejected).
    pub fn truncate(&mut self, len: usize) {
        if len >= self.len {
            return;
        }
        for (keys, values) in self.keys.iter_mut().zip(&mut self.values) {
            let width = keys.len() / self.len;
            keys.truncate(len * width);
            values.truncate(len * width);
        }
        self.len = len;
    }
}

/// A weight matrix as the forward pass multiplies it: `rows` rows `x`
/// `[rows, in]` times its transpose, `[rows, out]`. The reference's f32
/// [`Matrix`] is one; a faster backend brings its own (kiln-cpu's 4-bit
/// blocks) and reuses the rest of this pass.
pub trait Linear: Sync {
    fn apply(&self, x: &[f32], rows: usize) -> Vec<f32>;
}

impl Linear for Matrix {
    /// In f32: a matrix stored narrower is widened for the call (the
    /// reference widens its model once, [`crate::CpuBackend::new`]).
    fn apply(&self, x: &[f32], rows: usize) -> Vec<f32> {
        debug_assert_eq!(x.len(), rows * self.cols);
        let w = self.f32();
        x.chunks_exact(self.cols)
            .flat_map(|row| matvec(&w, self.cols, row))
            .collect()
    }
}

impl<T: Linear + ?Sized> Linear for &T {
    fn apply(&self, x: &[f32], rows: usize) -> Vec<f32> {
        (**self).apply(x, rows)
    }
}

/// Several matrices of one input width as one product: each row's outputs
/// are the first matrix's, then the second's, and so on (the query, key and
/// value projections; the gate and up projections).
pub struct Stacked<'a>(pub Vec<&'a dyn Linear>);

impl Linear for Stacked<'_> {
    fn apply(&self, x: &[f32], rows: usize) -> Vec<f32> {
        gather_rows(self.0.iter().map(|m| m.apply(x, rows)).collect(), rows)
    }
}

/// One layer's weights as the forward pass takes them.
pub struct LayerView<'a> {
    pub attn_norm: &'a [f32],
    /// Outputs `[q | k | v]` per row.
    pub qkv: Box<dyn Linear + 'a>,
    /// Added to each row of `qkv`'s output, where the model has biases.
    pub qkv_bias: Option<&'a [f32]>,
    pub wo: &'a dyn Linear,
    pub mlp_norm: &'a [f32],
    /// Outputs `[gate | up]` per row.
    pub gate_up: Box<dyn Linear + 'a>,
    pub w_down: &'a dyn Linear,
}

/// A model's weights as the forward pass takes them (all but the embedding,
/// which [`embed`] reads from the model's own [`Weights`]).
pub trait ForwardWeights {
    fn num_layers(&self) -> usize;
    fn layer(&self, index: usize) -> LayerView<'_>;
    fn final_norm(&self) -> &[f32];
    /// The output projection, `[vocab, hidden]`.
    fn output(&self) -> &dyn Linear;

    /// `work(c, chunk)` for each chunk of `out` (`chunk_len` values, the
    /// last maybe fewer), on this backend's threads where it has them (a
    /// prefill's attention rows); here, one after another.
    fn for_each_chunk(
        &self,
        out: &mut [f32],
        chunk_len: usize,
        work: &(dyn Fn(usize, &mut [f32]) + Sync),
    ) {
        for (c, chunk) in out.chunks_mut(chunk_len).enumerate() {
            work(c, chunk);
        }
    }
}

impl ForwardWeights for Weights {
    fn num_layers(&self) -> usize {
        self.layers.len()
    }

    fn layer(&self, index: usize) -> LayerView<'_> {
        let l = &self.layers[index];
        LayerView {
            attn_norm: &l.attn_norm,
            qkv: Box::new(Stacked(vec![&l.wq, &l.wk, &l.wv])),
            qkv_bias: l.qkv_bias.as_deref(),
            wo: &l.wo,
            mlp_norm: &l.mlp_norm,
            gate_up: Box::new(Stacked(vec![&l.w_gate, &l.w_up])),
            w_down: &l.w_down,
        }
    }

    fn final_norm(&self) -> &[f32] {
        &self.final_norm
    }

    fn output(&self) -> &dyn Linear {
        Weights::output(self)
    }
}

impl<T: ForwardWeights + ?Sized> ForwardWeights for &T {
    fn num_layers(&self) -> usize {
        (**self).num_layers()
    }

    fn layer(&self, index: usize) -> LayerView<'_> {
        (**self).layer(index)
    }

    fn final_norm(&self) -> &[f32] {
        (**self).final_norm()
    }

    fn output(&self) -> &dyn Linear {
        (**self).output()
    }

    fn for_each_chunk(
        &self,
        out: &mut [f32],
        chunk_len: usize,
        work: &(dyn Fn(usize, &mut [f32]) + Sync),
    ) {
        (**self).for_each_chunk(out, chunk_len, work)
    }
}

/// `y = W x` for a row-major `[out, in]` matrix of `cols` inputs.
fn matvec(w: &[f32], cols: usize, x: &[f32]) -> Vec<f32> {
    debug_assert_eq!(x.len(), cols);
    w.chunks_exact(cols)
        .map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum())
        .collect()
}

/// `Σ a·b` in eight interleaved partial sums, which the compiler turns into
/// vector multiply-adds (one running sum is a chain it must keep in order);
/// the attention scores of long contexts are most of a step's work outside
/// the matrix products.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    const LANES: usize = 8;
    let mut partial = [0.0f32; LANES];
    let (a_body, a_tail) = a.split_at(a.len() - a.len() % LANES);
    for (ca, cb) in a_body.chunks_exact(LANES).zip(b.chunks_exact(LANES)) {
        for lane in 0..LANES {
            partial[lane] += ca[lane] * cb[lane];
        }
    }
    let tail: f32 = a_tail
        .iter()
        .zip(&b[a_body.len()..])
        .map(|(x, y)| x * y)
        .sum();
    partial.iter().sum::<f32>() + tail
}

/// One head's keys and values in a layer's cache: position `p`'s are
/// `[p * stride + offset..][..head_dim]` of each.
struct HeadCache<'c> {
    keys: &'c [f32],
    values: &'c [f32],
    stride: usize,
    offset: usize,
}

/// Adds to `out` the attention of query `q` over every position of `cache`
/// (softmax of the scaled scores, the values weighted by it); `scores` is
/// scratch. The same arithmetic on every CPU, in wider vectors where it
/// has AVX: the scores and the weighted sums of long contexts are most of
/// a decode step outside the matrix products.
fn attend(q: &[f32], cache: &HeadCache, scale: f32, scores: &mut Vec<f32>, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: the CPU has AVX (checked just above).
        return unsafe { attend_avx(q, cache, scale, scores, out) };
    }
    attend_body(q, cache, scale, scores, out)
}

/// [`attend`] compiled for AVX: the same operations in the same order per
/// lane (no fused multiply-add), so the same bits.
///
/// # Safety
/// The CPU must have AVX.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn attend_avx(
    q: &[f32],
    cache: &HeadCache,
    scale: f32,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    attend_body(q, cache, scale, scores, out)
}

#[inline(always)]
fn attend_body(q: &[f32], cache: &HeadCache, scale: f32, scores: &mut Vec<f32>, out: &mut [f32]) {
    let d = q.len();
    let positions = cache.keys.len() / cache.stride;
    scores.clear();
    // A plain loop, not `extend(map(..))`: the iterator's `fold` would be a
    // function of its own, compiled without `attend_avx`'s AVX (it took 14 %
    // of a 2-thread prefill of 512 tokens in SSE code, `perf`).
    scores.reserve(positions);
    for p in 0..positions {
        let k = &cache.keys[p * cache.stride + cache.offset..][..d];
        scores.push(dot(q, k) * scale);
    }
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    scores.iter_mut().for_each(|s| *s = (*s - max).exp());
    let total: f32 = scores.iter().sum();
    for (p, e) in scores.iter().enumerate() {
        let v = &cache.values[p * cache.stride + cache.offset..][..d];
        let weight = e / total;
        for (o, vi) in out.iter_mut().zip(v) {
            *o += weight * vi;
        }
    }
}

/// RMSNorm of `x` into `out`: `x / sqrt(mean(x²) + eps) * weight`.
fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let mean_square = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let scale = 1.0 / (mean_square + eps).sqrt();
    for ((o, v), w) in out.iter_mut().zip(x).zip(weight) {
        *o = v * scale * w;
    }
}

/// Rotates each head in place: pairs are `(i, i + head_dim/2)` ("rotate half").
fn apply_rope(x: &mut [f32], head_dim: usize, cos: &[f32], sin: &[f32]) {
    let half = head_dim / 2;
    for head in x.chunks_exact_mut(head_dim) {
        for i in 0..half {
            let (a, b) = (head[i], head[i + half]);
            head[i] = a * cos[i] - b * sin[i];
            head[i + half] = b * cos[i] + a * sin[i];
        }
    }
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// The embedding rows of `tokens`, `[tokens.len() * hidden]`.
pub fn embed(weights: &Weights, tokens: &[u32]) -> Vec<f32> {
    tokens
        .iter()
        .flat_map(|&t| weights.embed.row(t as usize).into_owned())
        .collect()
}

/// Runs `embeddings` (`n` rows of `hidden`) at the positions after those in
/// `cache`, appends their keys and values, and returns the logits of every
/// row, `[n * vocab]`.
pub fn forward(
    config: &ModelConfig,
    weights: &dyn ForwardWeights,
    embeddings: &[f32],
    cache: &mut KvCache,
) -> Result<Vec<f32>> {
    forward_until(
        config,
        weights,
        embeddings,
        cache,
        Logits::EveryRow,
        &mut || true,
    )
}

/// Rows of a prefill's attention between two questions to `keep_going`.
const ATTENTION_BLOCK: usize = 32;

/// Whose logits [`forward_until`] computes: the output projection is a
/// large product (SmolLM2's: 28 M weights, 13 % of a 128-token prefill on
/// `cpu-q4`) that a prefill needs for its last row only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    EveryRow,
    LastRow,
}

/// [`forward`] with the logits of the rows `logits` says, asking
/// `keep_going` before each block of [`ATTENTION_BLOCK`] rows of each layer and
/// returning [`Error::Interrupted`](crate::Error::Interrupted) (the cache
/// then half-extended: the caller discards it) when it says no. A long
/// prompt on the single-threaded reference takes minutes.
///
/// Each product takes all of the chunk's rows at once (a backend's product
/// can then read its weights once for all of them); every row's arithmetic
/// is the same as one row at a time.
pub fn forward_until(
    config: &ModelConfig,
    weights: &dyn ForwardWeights,
    embeddings: &[f32],
    cache: &mut KvCache,
    logits: Logits,
    keep_going: &mut dyn FnMut() -> bool,
) -> Result<Vec<f32>> {
    let mut whole = [Shard {
        config,
        weights,
        cache,
    }];
    forward_shards(&mut whole, embeddings, logits, keep_going)
}

/// One tensor-parallel rank's part of a forward pass: its slice of every
/// layer (some attention heads, some MLP columns, some vocabulary rows of
/// the output projection; see [`crate::tensor_parallel`]), the config of
/// that slice, and the keys and values of its heads. The whole model is
/// the one shard of itself.
pub struct Shard<'a> {
    pub config: &'a ModelConfig,
    pub weights: &'a dyn ForwardWeights,
    pub cache: &'a mut KvCache,
}

/// [`forward_until`] over the shards of one model, the all-reduce done
/// here: each layer's attention output and MLP output are the sum, in rank
/// order, of every shard's partial product, added to the residual that
/// every rank holds whole; the logits are each shard's vocabulary rows
/// side by side (the gather). One shard is the unsharded pass, bit for bit.
pub fn forward_shards(
    shards: &mut [Shard<'_>],
    embeddings: &[f32],
    logits: Logits,
    keep_going: &mut dyn FnMut() -> bool,
) -> Result<Vec<f32>> {
    let Some(first) = shards.first() else {
        return Err(crate::Error::Invalid(
            "a forward pass needs at least one shard".into(),
        ));
    };
    let (config, threads) = (first.config, first.weights);
    let h = config.hidden_size;
    let n = embeddings.len() / h;
    let start = first.cache.len;
    if shards.iter().any(|s| s.cache.len != start) {
        return Err(crate::Error::Invalid(
            "the shards' caches hold different positions".into(),
        ));
    }
    let (cos, sin) = config.rope_tables(start + n)?;
    let positions = Positions {
        start,
        half: config.head_dim / 2,
        cos: &cos,
        sin: &sin,
    };

    let mut xs = embeddings.to_vec();
    for l in 0..threads.num_layers() {
        let attn_norm = threads.layer(l).attn_norm;
        let normed = rms_norm_rows(threads, &xs, attn_norm, config.rms_norm_eps);
        let mut sum = Partials::default();
        for s in shards.iter_mut() {
            sum.add(attention_part(s, l, &normed, n, &positions, keep_going)?);
        }
        sum.add_to(&mut xs);
        let mlp_norm = threads.layer(l).mlp_norm;
        let normed = rms_norm_rows(threads, &xs, mlp_norm, config.rms_norm_eps);
        let mut sum = Partials::default();
        for s in shards.iter() {
            sum.add(mlp_part(s.weights, l, &normed, n));
        }
        sum.add_to(&mut xs);
    }
    for s in shards.iter_mut() {
        s.cache.len += n;
    }
    let (xs, rows) = match logits {
        Logits::EveryRow => (&xs[..], n),
        Logits::LastRow => (&xs[(n - 1) * h..], 1),
    };
    let normed = rms_norm_rows(threads, xs, threads.final_norm(), config.rms_norm_eps);
    let parts: Vec<Vec<f32>> = shards
        .iter()
        .map(|s| s.weights.output().apply(&normed, rows))
        .collect();
    Ok(gather_rows(parts, rows))
}

/// The rotary tables of a pass's positions, `start` the first.
struct Positions<'t> {
    start: usize,
    half: usize,
    cos: &'t [f32],
    sin: &'t [f32],
}

impl Positions<'_> {
    /// The tables of the pass's row `r`.
    fn of_row(&self, r: usize) -> (&[f32], &[f32]) {
        let at = (self.start + r) * self.half;
        (&self.cos[at..][..self.half], &self.sin[at..][..self.half])
    }
}

/// A running all-reduce: the first part taken as it is (so that one shard
/// adds nothing, not even a zero), each later one added element by element.
#[derive(Default)]
struct Partials(Option<Vec<f32>>);

impl Partials {
    fn add(&mut self, part: Vec<f32>) {
        match &mut self.0 {
            None => self.0 = Some(part),
            Some(sum) => sum.iter_mut().zip(part).for_each(|(s, p)| *s += p),
        }
    }

    /// The residual update `xs += sum`.
    fn add_to(self, xs: &mut [f32]) {
        for (x, p) in xs.iter_mut().zip(self.0.into_iter().flatten()) {
            *x += p;
        }
    }
}

/// Each row's columns from every part in turn: `parts[k]` is `[rows, w_k]`
/// (a stacked product's outputs; the ranks' logits).
fn gather_rows(mut parts: Vec<Vec<f32>>, rows: usize) -> Vec<f32> {
    if parts.len() == 1 {
        return parts.pop().unwrap_or_default();
    }
    let mut out = Vec::with_capacity(parts.iter().map(Vec::len).sum());
    for r in 0..rows {
        for part in &parts {
            let width = part.len() / rows;
            out.extend_from_slice(&part[r * width..][..width]);
        }
    }
    out
}

/// One shard's attention over the `n` normed rows of layer `l`: its heads'
/// queries, keys and values, the keys and values appended to its cache, and
/// its slice of the output projection, `[n, hidden]` (to be summed over the
/// shards).
fn attention_part(
    shard: &mut Shard<'_>,
    l: usize,
    normed: &[f32],
    n: usize,
    positions: &Positions,
    keep_going: &mut dyn FnMut() -> bool,
) -> Result<Vec<f32>> {
    let (config, weights) = (shard.config, shard.weights);
    let cache = &mut *shard.cache;
    let d = config.head_dim;
    let group = config.group_size();
    let scale = 1.0 / (d as f32).sqrt();
    let q_width = config.num_heads * d;
    let kv_width = config.num_kv_heads * d;
    let layer = weights.layer(l);
    // Project this chunk's rows and extend the cache first, so each row
    // attends to every earlier position and to itself.
    let mut qkv = layer.qkv.apply(normed, n);
    if let Some(bias) = layer.qkv_bias {
        for row in qkv.chunks_exact_mut(bias.len()) {
            row.iter_mut().zip(bias).for_each(|(v, b)| *v += b);
        }
    }
    let qkv_width = q_width + 2 * kv_width;
    let queries = rows_on_threads(weights, n, q_width, &|r, q| {
        q.copy_from_slice(&qkv[r * qkv_width..][..q_width]);
        let (c, s) = positions.of_row(r);
        apply_rope(q, d, c, s);
    });
    for (r, row) in qkv.chunks_exact(qkv_width).enumerate() {
        let (k, v) = row[q_width..].split_at(kv_width);
        let mut k = k.to_vec();
        let (c, s) = positions.of_row(r);
        apply_rope(&mut k, d, c, s);
        cache.keys[l].extend_from_slice(&k);
        cache.values[l].extend_from_slice(v);
    }
    let mut attended = vec![0.0f32; n * q_width];
    let (keys, values) = (&cache.keys[l], &cache.values[l]);
    let start = positions.start;
    // Row `r`'s heads, into `out`.
    let attend_row = |r: usize, out: &mut [f32]| {
        let visible = start + r + 1;
        let mut scores = Vec::with_capacity(visible);
        for head in 0..config.num_heads {
            let kv_head = head / group;
            let head_cache = HeadCache {
                keys: &keys[..visible * kv_width],
                values: &values[..visible * kv_width],
                stride: kv_width,
                offset: kv_head * d,
            };
            let q = &queries[r * q_width + head * d..][..d];
            attend(
                q,
                &head_cache,
                scale,
                &mut scores,
                &mut out[head * d..][..d],
            );
        }
    };
    // Rows in blocks, `keep_going` asked before each; a block's rows
    // shared out over the backend's threads (a lone row, decode's, on
    // this one: handing it over would cost more than it takes).
    for (b, block) in attended.chunks_mut(ATTENTION_BLOCK * q_width).enumerate() {
        if !keep_going() {
            return Err(crate::Error::Interrupted);
        }
        let first = b * ATTENTION_BLOCK;
        if n == 1 {
            attend_row(first, block);
        } else {
            weights.for_each_chunk(block, q_width, &|i, out| attend_row(first + i, out));
        }
    }
    Ok(layer.wo.apply(&attended, n))
}

/// One shard's MLP over the `n` normed rows of layer `l`: its columns of
/// gate and up, SiLU, and its rows of down, `[n, hidden]` (to be summed
/// over the shards).
fn mlp_part(weights: &dyn ForwardWeights, l: usize, normed: &[f32], n: usize) -> Vec<f32> {
    let layer = weights.layer(l);
    let gate_up = layer.gate_up.apply(normed, n);
    let inter = gate_up.len() / n / 2;
    let hidden = rows_on_threads(weights, n, inter, &|r, out| {
        let (gate, up) = gate_up[r * 2 * inter..][..2 * inter].split_at(inter);
        for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
            *o = silu(*g) * u;
        }
    });
    layer.w_down.apply(&hidden, n)
}

/// [`rms_norm`] of each row of `xs`, on the backend's threads.
fn rms_norm_rows(weights: &dyn ForwardWeights, xs: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    let width = weight.len();
    rows_on_threads(weights, xs.len() / width, width, &|r, out| {
        rms_norm(&xs[r * width..][..width], weight, eps, out)
    })
}

/// `rows` rows of `width` values, row r written by `work(r, row)`: shared
/// out over the backend's threads ([`ForwardWeights::for_each_chunk`]) when
/// there are several (a prefill's norms, rotations and SiLU, which would
/// otherwise run on one thread between threaded products); a lone row,
/// decode's, on this one, where handing it over would cost more than it
/// takes. Each row is computed as it would be alone: the same values
/// whatever the threads.
fn rows_on_threads(
    weights: &dyn ForwardWeights,
    rows: usize,
    width: usize,
    work: &(dyn Fn(usize, &mut [f32]) + Sync),
) -> Vec<f32> {
    let mut out = vec![0.0f32; rows * width];
    if rows == 1 {
        work(0, &mut out);
    } else {
        weights.for_each_chunk(&mut out, width, work);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The AVX build of the attention gives the portable build's bits, so
    /// the reference's logits do not depend on the CPU that computes them.
    #[test]
    fn attention_is_the_same_with_and_without_avx() {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx") {
            let (d, positions, stride) = (64, 37, 3 * 64);
            let value = |i: usize| ((i * 7919 + 13) % 2003) as f32 / 1001.0 - 1.0;
            let keys: Vec<f32> = (0..positions * stride).map(value).collect();
            let values: Vec<f32> = (0..positions * stride).map(|i| value(i + 5)).collect();
            let q: Vec<f32> = (0..d).map(|i| value(i + 11) * 4.0).collect();
            let cache = HeadCache {
                keys: &keys,
                values: &values,
                stride,
                offset: d,
            };
            let (mut portable, mut avx) = (vec![0.5f32; d], vec![0.5f32; d]);
            attend_body(&q, &cache, 0.125, &mut Vec::new(), &mut portable);
            // SAFETY: the CPU has AVX (checked above).
            unsafe { attend_avx(&q, &cache, 0.125, &mut Vec::new(), &mut avx) };
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&portable), bits(&avx));
            assert!(portable.iter().any(|&x| x != 0.5));
            return;
        }
        eprintln!("skipped: this CPU has no AVX, so only the portable attention runs");
    }
}
