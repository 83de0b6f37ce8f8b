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

/// `y = W x` for a `[out, in]` matrix.
fn matvec(w: &Matrix, x: &[f32]) -> Vec<f32> {
    debug_assert_eq!(x.len(), w.cols);
    (0..w.rows)
        .map(|r| w.row(r).iter().zip(x).map(|(a, b)| a * b).sum())
        .collect()
}

/// RMSNorm: `x / sqrt(mean(x²) + eps) * weight`.
fn rms_norm(x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    let mean_square = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let scale = 1.0 / (mean_square + eps).sqrt();
    x.iter().zip(weight).map(|(v, w)| v * scale * w).collect()
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
        .flat_map(|&t| weights.embed.row(t as usize).iter().copied())
        .collect()
}

/// Runs `embeddings` (`n` rows of `hidden`) at the positions after those in
/// `cache`, appends their keys and values, and returns the logits of every
/// row, `[n * vocab]`.
pub fn forward(
    config: &ModelConfig,
    weights: &Weights,
    embeddings: &[f32],
    cache: &mut KvCache,
) -> Result<Vec<f32>> {
    forward_until(config, weights, embeddings, cache, &mut || true)
}

/// [`forward`], asking `keep_going` before each row of each layer and
/// returning [`Error::Interrupted`](crate::Error::Interrupted) (the cache
/// then half-extended: the caller discards it) when it says no. A long
/// prompt on this single-threaded reference takes minutes.
pub fn forward_until(
    config: &ModelConfig,
    weights: &Weights,
    embeddings: &[f32],
    cache: &mut KvCache,
    keep_going: &mut dyn FnMut() -> bool,
) -> Result<Vec<f32>> {
    let h = config.hidden_size;
    let d = config.head_dim;
    let group = config.group_size();
    let n = embeddings.len() / h;
    let start = cache.len;
    let (cos, sin) = config.rope_tables(start + n)?;
    let half = d / 2;
    let scale = 1.0 / (d as f32).sqrt();

    let mut xs: Vec<Vec<f32>> = embeddings.chunks_exact(h).map(<[f32]>::to_vec).collect();
    for (l, layer) in weights.layers.iter().enumerate() {
        // Project this chunk's rows and extend the cache first, so each row
        // attends to every earlier position and to itself.
        let mut queries = Vec::with_capacity(n);
        for (r, x) in xs.iter().enumerate() {
            let pos = start + r;
            let (c, s) = (&cos[pos * half..][..half], &sin[pos * half..][..half]);
            let normed = rms_norm(x, &layer.attn_norm, config.rms_norm_eps);
            let mut q = matvec(&layer.wq, &normed);
            let mut k = matvec(&layer.wk, &normed);
            apply_rope(&mut q, d, c, s);
            apply_rope(&mut k, d, c, s);
            cache.keys[l].extend_from_slice(&k);
            cache.values[l].extend_from_slice(&matvec(&layer.wv, &normed));
            queries.push(q);
        }
        let kv_width = config.num_kv_heads * d;
        for (r, x) in xs.iter_mut().enumerate() {
            if !keep_going() {
                return Err(crate::Error::Interrupted);
            }
            let visible = start + r + 1;
            let mut attended = vec![0.0f32; config.num_heads * d];
            for head in 0..config.num_heads {
                let kv_head = head / group;
                let q = &queries[r][head * d..][..d];
                let scores: Vec<f32> = (0..visible)
                    .map(|p| {
                        let k = &cache.keys[l][p * kv_width + kv_head * d..][..d];
                        q.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * scale
                    })
                    .collect();
                let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let exps: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f32 = exps.iter().sum();
                let out = &mut attended[head * d..][..d];
                for (p, e) in exps.iter().enumerate() {
                    let v = &cache.values[l][p * kv_width + kv_head * d..][..d];
                    for (o, vi) in out.iter_mut().zip(v) {
                        *o += e / total * vi;
                    }
                }
            }
            let projected = matvec(&layer.wo, &attended);
            for (xi, p) in x.iter_mut().zip(&projected) {
                *xi += p;
            }
            let normed = rms_norm(x, &layer.mlp_norm, config.rms_norm_eps);
            let gate = matvec(&layer.w_gate, &normed);
            let up = matvec(&layer.w_up, &normed);
            let hidden: Vec<f32> = gate.iter().zip(&up).map(|(g, u)| silu(*g) * u).collect();
            for (xi, m) in x.iter_mut().zip(matvec(&layer.w_down, &hidden)) {
                *xi += m;
            }
        }
    }
    cache.len += n;
    Ok(xs
        .iter()
        .flat_map(|x| {
            matvec(
                weights.output(),
                &rms_norm(x, &weights.final_norm, config.rms_norm_eps),
            )
        })
        .collect())
}
