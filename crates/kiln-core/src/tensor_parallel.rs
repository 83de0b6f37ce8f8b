//! Tensor parallelism's plan: how N ranks share one model, Megatron-style.
//!
//! Rank r of N holds every layer's slice:
//! - query heads `heads(r)` (q's rows, o's columns), and the key/value heads
//!   those queries read (`kv_heads(r)`): a contiguous share of them, or,
//!   where N exceeds the key/value heads, the one head its queries share,
//!   replicated on N / KV ranks;
//! - MLP columns `mlp(r)` (gate's and up's rows, down's columns);
//! - vocabulary rows `vocab(r)` of the output projection.
//!
//! The embedding and the norms are whole on every rank. A layer's attention
//! and MLP each end in a partial product per rank that an all-reduce sums,
//! and the logits are the ranks' vocabulary rows gathered: the reference
//! runs it in [`crate::forward::forward_shards`]
//! ([`crate::CpuBackend::tensor_parallel`]). The slices are cut from
//! the weights as loaded (never a sharded copy on disk).

use std::ops::Range;

use crate::config::ModelConfig;
use crate::model::Model;
use crate::weights::{LayerWeights, Matrix, Weights};

/// How a model's layers are shared out over `ranks` ranks.
#[derive(Clone, Debug, PartialEq)]
pub struct ShardPlan {
    config: ModelConfig,
    ranks: usize,
}

impl ShardPlan {
    /// The plan of `config` over `ranks`, or why it cannot be split so: the
    /// ranks must divide the attention heads and the MLP width, and divide
    /// or be a multiple of the key/value heads.
    pub fn new(config: &ModelConfig, ranks: usize) -> Result<ShardPlan, String> {
        if !splits(config, ranks) {
            let fits: Vec<String> = (1..=config.num_heads)
                .filter(|&n| splits(config, n))
                .map(|n| n.to_string())
                .collect();
            return Err(format!(
                "--tensor-parallel {ranks} does not split this model ({} attention heads, {} \
                 key/value heads, MLP width {}): the ranks must divide the heads and the MLP \
                 width, and divide or be a multiple of the key/value heads; choose one of {}",
                config.num_heads,
                config.num_kv_heads,
                config.intermediate_size,
                fits.join(", ")
            ));
        }
        Ok(ShardPlan {
            config: config.clone(),
            ranks,
        })
    }

    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// Rank `r`'s query heads.
    pub fn heads(&self, r: usize) -> Range<usize> {
        share(self.config.num_heads, self.ranks, r)
    }

    /// The key/value heads rank `r`'s queries read.
    pub fn kv_heads(&self, r: usize) -> Range<usize> {
        let kv = self.config.num_kv_heads;
        if self.ranks <= kv {
            share(kv, self.ranks, r)
        } else {
            let head = r / (self.ranks / kv);
            head..head + 1
        }
    }

    /// Rank `r`'s MLP columns.
    pub fn mlp(&self, r: usize) -> Range<usize> {
        share(self.config.intermediate_size, self.ranks, r)
    }

    /// Rank `r`'s rows of the output projection: [`ShardPlan::vocab_rows`]
    /// each, the last rank the rest (a device graph pads it to the others'
    /// count, so that the ranks' logits gather into equal parts).
    pub fn vocab(&self, r: usize) -> Range<usize> {
        let (v, each) = (self.config.vocab_size, self.vocab_rows());
        (r * each).min(v)..((r + 1) * each).min(v)
    }

    /// The most vocabulary rows a rank holds.
    pub fn vocab_rows(&self) -> usize {
        self.config.vocab_size.div_ceil(self.ranks)
    }

    /// The shape of rank `r`'s slice: its heads and MLP width (the rest as
    /// the model's; the vocabulary stays the model's, since every rank
    /// embeds any token).
    pub fn rank_config(&self, r: usize) -> ModelConfig {
        let mut c = self.config.clone();
        c.num_heads = self.heads(r).len();
        c.num_kv_heads = self.kv_heads(r).len();
        c.intermediate_size = self.mlp(r).len();
        c
    }

    /// Rank `r`'s model: its slice's config and weights under the model's
    /// name, tokenizer and chat format (a rank's backend needs only the
    /// first two; the others keep it a whole [`Model`]).
    pub fn rank_model(&self, model: &Model, r: usize) -> Model {
        Model {
            name: format!("{} (rank {r} of {})", model.name, self.ranks),
            config: self.rank_config(r),
            weights: self.rank_weights(&model.weights, r),
            tokenizer: model.tokenizer.clone(),
            chat: model.chat.clone(),
        }
    }

    /// Rank `r`'s slice of `weights`.
    pub fn rank_weights(&self, weights: &Weights, r: usize) -> Weights {
        let d = self.config.head_dim;
        let per_head = |heads: Range<usize>| heads.start * d..heads.end * d;
        let (q, kv, mlp) = (
            per_head(self.heads(r)),
            per_head(self.kv_heads(r)),
            self.mlp(r),
        );
        let q_width = self.config.num_heads * d;
        let kv_width = self.config.num_kv_heads * d;
        let layers = weights
            .layers
            .iter()
            .map(|l| LayerWeights {
                attn_norm: l.attn_norm.clone(),
                wq: rows(&l.wq, q.clone()),
                wk: rows(&l.wk, kv.clone()),
                wv: rows(&l.wv, kv.clone()),
                wo: columns(&l.wo, q.clone()),
                mlp_norm: l.mlp_norm.clone(),
                w_gate: rows(&l.w_gate, mlp.clone()),
                w_up: rows(&l.w_up, mlp.clone()),
                w_down: columns(&l.w_down, mlp.clone()),
                qkv_bias: l.qkv_bias.as_ref().map(|b| {
                    let (bq, rest) = b.split_at(q_width);
                    let (bk, bv) = rest.split_at(kv_width);
                    [&bq[q.clone()], &bk[kv.clone()], &bv[kv.clone()]].concat()
                }),
            })
            .collect();
        Weights {
            embed: weights.embed.clone(),
            layers,
            final_norm: weights.final_norm.clone(),
            lm_head: Some(rows(weights.output(), self.vocab(r))),
            stored: weights.stored,
        }
    }
}

/// Whether `ranks` ranks split `config`'s layers evenly.
fn splits(config: &ModelConfig, ranks: usize) -> bool {
    let kv = config.num_kv_heads;
    ranks > 0
        && config.num_heads.is_multiple_of(ranks)
        && config.intermediate_size.is_multiple_of(ranks)
        && (kv.is_multiple_of(ranks) || ranks.is_multiple_of(kv))
}

/// Part `r` of `0..total` cut in `ranks` equal parts.
fn share(total: usize, ranks: usize, r: usize) -> Range<usize> {
    let each = total / ranks;
    r * each..(r + 1) * each
}

/// The rows `range` of `m`, as stored.
fn rows(m: &Matrix, range: Range<usize>) -> Matrix {
    m.reorder_rows(range)
}

/// The columns `range` of `m`, as stored where they can be cut so.
fn columns(m: &Matrix, range: Range<usize>) -> Matrix {
    m.columns(range)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::preset;
    use crate::sampling::argmax;
    use crate::{Backend, CpuBackend};

    /// A small GQA model: 8 query heads over 4 key/value heads, MLP 96.
    fn model(qkv_bias: bool) -> Model {
        let (mut config, _) = preset("random-100m").unwrap();
        config.hidden_size = 64;
        config.head_dim = 8;
        config.num_heads = 8;
        config.num_kv_heads = 4;
        config.intermediate_size = 96;
        config.num_layers = 3;
        config.vocab_size = 101;
        config.qkv_bias = qkv_bias;
        let mut model = Model::random("tp", config, 7);
        if qkv_bias {
            let width = model.weights.layers[0].wq.rows + 2 * model.weights.layers[0].wk.rows;
            for (i, l) in model.weights.layers.iter_mut().enumerate() {
                l.qkv_bias = Some(
                    (0..width)
                        .map(|k| ((k + i) as f32 * 0.37).sin() * 0.1)
                        .collect(),
                );
            }
        }
        model
    }

    #[test]
    fn plans_take_the_ranks_that_split_the_model_and_say_which_do() {
        let m = model(false);
        for ranks in [1, 2, 4, 8] {
            assert!(ShardPlan::new(&m.config, ranks).is_ok(), "{ranks}");
        }
        let err = ShardPlan::new(&m.config, 3).unwrap_err();
        assert!(
            err.contains("--tensor-parallel 3") && err.contains("choose one of 1, 2, 4, 8"),
            "{err}"
        );
        assert!(ShardPlan::new(&m.config, 0).is_err());
        // SmolLM2's 9:3 heads split in 3 and 9? 9 does not divide 1536.
        let (smol, _) = preset("smollm2-135m").unwrap();
        let err = ShardPlan::new(&smol, 2).unwrap_err();
        assert!(err.contains("choose one of 1, 3"), "{err}");
    }

    #[test]
    fn every_row_and_column_belongs_to_exactly_one_rank_and_kv_heads_to_their_queries() {
        let m = model(false);
        let c = &m.config;
        for ranks in [1, 2, 4, 8] {
            let plan = ShardPlan::new(c, ranks).unwrap();
            let joined =
                |f: &dyn Fn(usize) -> Range<usize>| (0..ranks).flat_map(f).collect::<Vec<_>>();
            assert_eq!(
                joined(&|r| plan.heads(r)),
                (0..c.num_heads).collect::<Vec<_>>()
            );
            assert_eq!(
                joined(&|r| plan.mlp(r)),
                (0..c.intermediate_size).collect::<Vec<_>>()
            );
            assert_eq!(
                joined(&|r| plan.vocab(r)),
                (0..c.vocab_size).collect::<Vec<_>>()
            );
            let group = c.group_size();
            for r in 0..ranks {
                let kv = plan.kv_heads(r);
                for head in plan.heads(r) {
                    assert!(
                        kv.contains(&(head / group)),
                        "{ranks} ranks, rank {r}, head {head}"
                    );
                }
                // The rank's own grouping maps its heads onto its kv heads alike.
                let rc = plan.rank_config(r);
                assert_eq!(rc.num_heads % rc.num_kv_heads, 0);
                assert_eq!(rc.num_heads / rc.num_kv_heads, group.min(rc.num_heads));
            }
        }
    }

    /// Greedy tokens and every step's logits of the sharded reference
    /// against the unsharded one, from `prompt` for `steps` tokens; the
    /// largest logit difference over the largest logit.
    fn compare(m: &Model, ranks: usize, prompt: &[u32], steps: usize) -> f32 {
        let plan = ShardPlan::new(&m.config, ranks).unwrap();
        let mut sharded = CpuBackend::tensor_parallel(m, &plan);
        let mut whole = CpuBackend::new(m);
        let (mut a, mut b) = (
            whole.prefill(prompt).unwrap(),
            sharded.prefill(prompt).unwrap(),
        );
        let mut worst = 0.0f32;
        for step in 0..steps {
            let scale = a.iter().fold(1.0f32, |s, x| s.max(x.abs()));
            worst = worst.max(crate::testing::max_abs_diff(&a, &b) / scale);
            let (ta, tb) = (argmax(&a), argmax(&b));
            assert_eq!(
                ta, tb,
                "{ranks} ranks: step {step} chose {tb}, the whole model {ta}"
            );
            (a, b) = (whole.decode(ta).unwrap(), sharded.decode(ta).unwrap());
        }
        assert_eq!(sharded.sequence_len(), whole.sequence_len());
        worst
    }

    #[test]
    fn sharded_logits_and_greedy_tokens_are_the_whole_models() {
        for bias in [false, true] {
            let m = model(bias);
            let prompt: Vec<u32> = (0..11).map(|i| (i * 37 + 5) % 101).collect();
            for ranks in [1, 2, 4, 8] {
                let worst = compare(&m, ranks, &prompt, 24);
                println!(
                    "bias {bias}, {ranks} ranks: worst logit difference {worst:.2e} of the largest"
                );
                if ranks == 1 {
                    assert_eq!(worst, 0.0, "one rank is the unsharded pass");
                } else {
                    assert!(worst < 1e-5, "{ranks} ranks: {worst}");
                }
            }
        }
    }

    #[test]
    fn a_rank_holds_only_its_share_of_each_layer() {
        let m = model(true);
        let plan = ShardPlan::new(&m.config, 2).unwrap();
        let w = plan.rank_weights(&m.weights, 1);
        let (whole, part) = (&m.weights.layers[0], &w.layers[0]);
        assert_eq!(part.wq.rows * 2, whole.wq.rows);
        assert_eq!(part.wk.rows * 2, whole.wk.rows);
        assert_eq!(part.wo.cols * 2, whole.wo.cols);
        assert_eq!(part.w_down.cols * 2, whole.w_down.cols);
        // Rank 1's first query row is the model's row of head 4.
        assert_eq!(part.wq.row(0), whole.wq.row(4 * 8));
        assert_eq!(part.w_down.row(3)[0], whole.w_down.row(3)[48]);
        assert_eq!(w.output().rows, 50);
        assert_eq!(w.output().row(0), m.weights.output().row(51));
    }
}
