//! The module plan: which modules a model's backend can use and how each is
//! compiled — the buckets, the module kinds and their compile flags, the
//! append rows and the batched decoder's row counts and prompt shapes. It
//! describes modules only; `prepared` builds them and `backend` loads and
//! runs them, both from here.

use kiln_core::Model;

use crate::compiler::Target;

/// Sequence lengths prefill is compiled for, and the context (KV cache)
/// length every module shares.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Buckets {
    pub prefill: Vec<usize>,
    pub context: usize,
}

impl Buckets {
    /// The buckets of [`Buckets::for_context`] for the model's context limit
    /// (`ModelConfig::context_limit`) capped at `max_context`.
    pub fn for_model(model: &Model, max_context: usize) -> Buckets {
        Buckets::for_context(model.config.context_limit().min(max_context))
    }

    /// Prefill buckets 16, 64, 128, 256, 512, 1024, 2048 below `context`, and
    /// `context` itself.
    pub fn for_context(context: usize) -> Buckets {
        let mut prefill: Vec<usize> = [16, 64, 128, 256, 512, 1024, 2048]
            .into_iter()
            .filter(|&b| b < context)
            .collect();
        prefill.push(context);
        Buckets { prefill, context }
    }
}

/// Which kind of module a compilation is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum ModuleKind {
    Prefill(usize),
    Decode,
    /// This many greedy decode steps chained in one call (`decode_chain`).
    DecodeChain(usize),
    /// The batched decode step over the first `rows` of `slots` sequence
    /// slots.
    DecodeBatch {
        rows: usize,
        slots: usize,
    },
    /// Admits a prefilled sequence into one of `slots` sequence slots.
    AdmitSlot {
        slots: usize,
    },
    /// Prefills `rows` prompts of up to `seq` tokens, each into its own of
    /// `slots` sequence slots (`prefill_batch`).
    PrefillBatch {
        rows: usize,
        seq: usize,
        slots: usize,
    },
    /// The multi-token step of this many rows (speculative decoding).
    Append(usize),
}

/// The decode step's execution model: its function returns once its work is
/// queued and takes a wait and a signal fence after its tensors, so kiln can
/// queue the next greedy step while this one runs (see the backend's
/// `decode_greedy`).
const ASYNC_EXTERNAL: &str = "--iree-execution-model=async-external";

/// Split-K on CUDA for products of several rows: each product's inputs in
/// four parts, each a kernel's worth of workgroups, the parts' sums added by
/// a small reduction. IREE tiles such products in 32×32 (32 rows) or 64×64
/// (64 rows and more) output tiles, so a product of 2,048 outputs had 64
/// workgroups for 132 SMs, each reading its slice of the weights alone: 0.3
/// TB/s for the batched step's down projection (Nsight Compute over
/// `kiln-bench-batch`, docs/server.md), and the 8B's 128-token prefill took
/// 28.5 ms where split-K gives 24.2 (docs/perf-notes.md).
const SPLIT_K: &str = "--iree-dispatch-creation-split-matmul-reduction=4";

/// The most rows a product splits its inputs for. Measured at 128 rows
/// (docs/perf-notes.md, "Split-K for prefill"); at 256 the 64×64 tiles of a
/// 4,096-output product are still 256 workgroups, two an SM, and from 512
/// rows the tiles alone fill the GPU (reckoned, not measured).
pub const SPLIT_K_MAX_ROWS: usize = 256;

impl ModuleKind {
    /// The rows each of the module's matrix products multiplies.
    fn product_rows(self) -> usize {
        match self {
            ModuleKind::Prefill(seq) => seq,
            ModuleKind::Decode | ModuleKind::DecodeChain(_) | ModuleKind::AdmitSlot { .. } => 1,
            ModuleKind::DecodeBatch { rows, .. } | ModuleKind::Append(rows) => rows,
            ModuleKind::PrefillBatch { rows, seq, .. } => rows * seq,
        }
    }

    /// The iree-compile flags this kind adds to `target`'s.
    pub fn compile_flags(self, target: Target) -> &'static [&'static str] {
        let asynchronous = matches!(
            self,
            ModuleKind::Decode
                | ModuleKind::DecodeChain(_)
                | ModuleKind::DecodeBatch { .. }
                | ModuleKind::PrefillBatch { .. }
        );
        let rows = self.product_rows();
        let split = target == Target::Cuda && rows > 1 && rows <= SPLIT_K_MAX_ROWS;
        match (asynchronous, split) {
            (true, true) => &[ASYNC_EXTERNAL, SPLIT_K],
            (true, false) => &[ASYNC_EXTERNAL],
            (false, true) => &[SPLIT_K],
            (false, false) => &[],
        }
    }
}

/// The row counts the multi-token step is compiled for: an append of n
/// tokens runs in the smallest that holds n (padding rows are discarded).
pub const APPEND_ROWS: [usize; 3] = [4, 8, 16];

/// The row counts compiled for `slots` slots: 1 (a lone sequence, admitted
/// into slot 0, steps at batch-1 cost), then powers of two from 4, and
/// `slots` itself. Decode reads every weight once per step whatever the
/// batch, so a few spare rows cost little; skipping 2 saves a module that 4
/// covers.
pub fn batch_sizes(slots: usize) -> Vec<usize> {
    let mut sizes = vec![1];
    let mut size = 4;
    while size < slots {
        sizes.push(size);
        size *= 2;
    }
    if slots > 1 {
        sizes.push(slots);
    }
    sizes
}

/// The longest prompt prefilled together with others; longer ones are
/// prefilled alone (a long prompt is a large call by itself).
pub const PROMPT_MAX: usize = 128;

/// The prompt counts `prefill_batch` is compiled for with `slots` slots:
/// 4 and 8 (a call of 8 prompts of 64 tokens multiplies 512 rows at a time),
/// or the slot count below 4. More waiting prompts take several calls; a
/// call's spare rows repeat a real prompt.
pub fn prompt_rows(slots: usize) -> Vec<usize> {
    if slots < 2 {
        return Vec::new();
    }
    let rows: Vec<usize> = [4, 8].into_iter().filter(|&r| r <= slots).collect();
    if rows.is_empty() { vec![slots] } else { rows }
}

/// The prompt lengths `prefill_batch` is compiled for: the prefill buckets
/// up to [`PROMPT_MAX`].
pub fn prompt_buckets(buckets: &Buckets) -> Vec<usize> {
    buckets
        .prefill
        .iter()
        .copied()
        .filter(|&b| b <= PROMPT_MAX)
        .collect()
}

/// Every module of a model for `buckets`, greedy decoding chaining
/// `steps_per_call` steps in a call.
pub fn module_kinds(buckets: &Buckets, steps_per_call: usize) -> Vec<ModuleKind> {
    let mut kinds: Vec<ModuleKind> = buckets
        .prefill
        .iter()
        .map(|&s| ModuleKind::Prefill(s))
        .collect();
    kinds.push(ModuleKind::Decode);
    if steps_per_call > 1 {
        kinds.push(ModuleKind::DecodeChain(steps_per_call));
    }
    kinds
}

/// The multi-token modules speculative decoding with up to `draft_tokens`
/// proposed tokens uses (each step appends them after the last chosen token).
pub fn append_module_kinds(draft_tokens: usize) -> Vec<ModuleKind> {
    let rows = draft_tokens + 1;
    APPEND_ROWS
        .iter()
        .take_while(|&&b| b < rows)
        .chain(APPEND_ROWS.iter().find(|&&b| b >= rows))
        .map(|&b| ModuleKind::Append(b))
        .collect()
}

/// The modules of a batched decoder of `slots` slots beside the prefill
/// buckets: the decode step of each row count ([`batch_sizes`]), the
/// admission of one prefilled sequence, and the joint prefill of each prompt
/// count and length ([`prompt_rows`], [`prompt_buckets`]).
pub fn decoder_module_kinds(buckets: &Buckets, slots: usize) -> Vec<ModuleKind> {
    let mut kinds: Vec<ModuleKind> = batch_sizes(slots)
        .into_iter()
        .map(|rows| ModuleKind::DecodeBatch { rows, slots })
        .collect();
    kinds.push(ModuleKind::AdmitSlot { slots });
    for rows in prompt_rows(slots) {
        for seq in prompt_buckets(buckets) {
            kinds.push(ModuleKind::PrefillBatch { rows, seq, slots });
        }
    }
    kinds
}

/// The batched modules kiln-server's decoder of `slots` sequence slots uses
/// beside the prefill buckets: the decode steps of each row count, the
/// admission of one prefilled sequence and the prefill of several prompts
/// together (none for one slot: it runs the batch-1 `decode_step`).
pub fn batch_module_kinds(buckets: &Buckets, slots: usize) -> Vec<ModuleKind> {
    if slots <= 1 {
        return Vec::new();
    }
    decoder_module_kinds(buckets, slots)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_products_of_a_few_rows_split_their_inputs() {
        let splits = |kind: ModuleKind, target| kind.compile_flags(target).contains(&SPLIT_K);
        for kind in [
            ModuleKind::Prefill(16),
            ModuleKind::Prefill(128),
            ModuleKind::Prefill(SPLIT_K_MAX_ROWS),
            ModuleKind::Append(8),
            ModuleKind::DecodeBatch { rows: 4, slots: 8 },
            ModuleKind::PrefillBatch {
                rows: 4,
                seq: 64,
                slots: 8,
            },
        ] {
            assert!(splits(kind, Target::Cuda), "{kind:?}");
            assert!(!splits(kind, Target::LlvmCpu), "{kind:?} on the CPU");
        }
        for kind in [
            ModuleKind::Decode,
            ModuleKind::DecodeChain(3),
            ModuleKind::DecodeBatch { rows: 1, slots: 8 },
            ModuleKind::AdmitSlot { slots: 8 },
            ModuleKind::Prefill(2 * SPLIT_K_MAX_ROWS),
            ModuleKind::PrefillBatch {
                rows: 8,
                seq: 64,
                slots: 8,
            },
        ] {
            assert!(!splits(kind, Target::Cuda), "{kind:?}");
        }
        // The asynchronous kinds keep their execution model beside the split.
        let batch = ModuleKind::DecodeBatch { rows: 4, slots: 8 }.compile_flags(Target::Cuda);
        assert!(batch.contains(&ASYNC_EXTERNAL));
        assert!(
            !ModuleKind::Prefill(128)
                .compile_flags(Target::Cuda)
                .contains(&ASYNC_EXTERNAL)
        );
    }

    #[test]
    fn batch_sizes_start_at_one_and_end_at_the_slot_count() {
        assert_eq!(batch_sizes(1), vec![1]);
        assert_eq!(batch_sizes(4), vec![1, 4]);
        assert_eq!(batch_sizes(8), vec![1, 4, 8]);
        assert_eq!(batch_sizes(12), vec![1, 4, 8, 12]);
        assert_eq!(batch_sizes(32), vec![1, 4, 8, 16, 32]);
    }

    #[test]
    fn speculation_needs_every_row_count_up_to_the_one_holding_k_plus_one() {
        let rows = |k| -> Vec<usize> {
            append_module_kinds(k)
                .into_iter()
                .map(|kind| match kind {
                    ModuleKind::Append(rows) => rows,
                    other => panic!("{other:?}"),
                })
                .collect()
        };
        assert_eq!(rows(1), [4]);
        assert_eq!(rows(3), [4]);
        assert_eq!(rows(4), [4, 8]);
        assert_eq!(rows(15), [4, 8, 16]);
    }
}
