//! The choices that shape a model's graph beyond its configuration: the
//! precision weights and KV cache are stored in, and the layout of weight
//! matrices. Both are part of every module's cache key (through the MLIR).

use std::fmt;
use std::str::FromStr;

use crate::compiler::Target;
use crate::stablehlo::Ty;

/// The element type of the weights and the KV cache on the device. Matrix
/// products accumulate in f32, and norms, RoPE, softmax and the residual
/// stream are f32 at every precision.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Precision {
    F32,
    F16,
    Bf16,
    /// Weight matrices in 4-bit blocks with f16 scales and offsets
    /// ([`crate::q4`]), dequantized inside the products; the embedding,
    /// norms and KV cache in f16. Needs the out-in layout (blocks run along
    /// each output's inputs).
    Q4,
    /// Weight matrices in 8-bit blocks with an f16 scale each ([`crate::q8`],
    /// GGUF's Q8_0), dequantized inside the products; the rest as at q4.
    Q8,
}

impl Precision {
    pub const ALL: [Precision; 5] = [
        Precision::F32,
        Precision::F16,
        Precision::Bf16,
        Precision::Q4,
        Precision::Q8,
    ];

    /// Whether the weight matrices are stored in blocks of integers with
    /// their own scales (q4, q8), which the products dequantize.
    pub fn is_blocked(self) -> bool {
        matches!(self, Precision::Q4 | Precision::Q8)
    }

    /// The precision a target runs at unless told otherwise: f16 on CUDA
    /// (half the bytes per decode step; its error against the f32 reference
    /// is measured in the GPU tests), f32 on the CPU (IREE's llvm-cpu code
    /// has no fast f16 matrix path on x86_64).
    pub fn default_for(target: Target) -> Precision {
        match target {
            Target::Cuda => Precision::F16,
            Target::LlvmCpu => Precision::F32,
        }
    }

    pub(crate) fn storage(self) -> Ty {
        match self {
            Precision::F32 => Ty::F32,
            Precision::F16 | Precision::Q4 | Precision::Q8 => Ty::F16,
            Precision::Bf16 => Ty::BF16,
        }
    }

    /// Bytes per stored weight element (q4's and q8's scales are f16).
    pub fn storage_bytes(self) -> usize {
        match self {
            Precision::F32 => 4,
            Precision::F16 | Precision::Bf16 | Precision::Q4 | Precision::Q8 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::F16 => "f16",
            Precision::Bf16 => "bf16",
            Precision::Q4 => "q4",
            Precision::Q8 => "q8",
        }
    }

    /// Bits of one stored weight of a matrix: at q4, 4 plus its share of
    /// its block's f16 scale and offset; at q8, 8 plus its share of the
    /// block's f16 scale.
    pub fn bits_per_weight(self) -> f64 {
        match self {
            Precision::F32 => 32.0,
            Precision::F16 | Precision::Bf16 => 16.0,
            Precision::Q4 => 4.0 + 32.0 / crate::q4::BLOCK as f64,
            Precision::Q8 => 8.0 + 16.0 / crate::q8::BLOCK as f64,
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Precision {
    type Err = String;

    fn from_str(s: &str) -> Result<Precision, String> {
        by_name(&Precision::ALL, Precision::name, s, "precision")
    }
}

/// The entry of `all` called `s`, or an error listing the names.
fn by_name<T: Copy>(
    all: &[T],
    name: fn(T) -> &'static str,
    s: &str,
    what: &str,
) -> Result<T, String> {
    all.iter().copied().find(|&v| name(v) == s).ok_or_else(|| {
        let names: Vec<&str> = all.iter().map(|&v| name(v)).collect();
        let (last, rest) = names.split_last().expect("a non-empty list");
        format!("unknown {what} `{s}`: use {} or {last}", rest.join(", "))
    })
}

/// How weight matrices are laid out in device memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightLayout {
    /// `[in, out]`, the transpose of a Hugging Face Linear weight. IREE's
    /// llvm-cpu code decodes 4x faster on it (13.6 → 53.9 tok/s,
    /// `kiln-bench-decode --backend iree-cpu --model random-100m`).
    InOut,
    /// `[out, in]`, as Hugging Face stores it: each output's weights are one
    /// contiguous row, which IREE's GPU matrix-vector code reduces along.
    OutIn,
}

impl WeightLayout {
    pub const ALL: [WeightLayout; 2] = [WeightLayout::InOut, WeightLayout::OutIn];

    pub fn default_for(target: Target) -> WeightLayout {
        match target {
            Target::Cuda => WeightLayout::OutIn,
            Target::LlvmCpu => WeightLayout::InOut,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            WeightLayout::InOut => "in-out",
            WeightLayout::OutIn => "out-in",
        }
    }
}

impl fmt::Display for WeightLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for WeightLayout {
    type Err = String;

    fn from_str(s: &str) -> Result<WeightLayout, String> {
        by_name(&WeightLayout::ALL, WeightLayout::name, s, "weight layout")
    }
}

/// The row length, in elements, a matrix row of `columns` elements of
/// `bytes` each is stored with: one 64-byte line longer when the row would
/// be a whole number of 4 KiB pages. A matrix-vector kernel over `[in, out]`
/// weights reads one line from each of 16 consecutive rows per iteration;
/// with a page-multiple stride those lines all fall in the same cache sets
/// and evict each other. On SmolLM2's f32 step the gate/up (12,288-byte
/// rows) and output (196,608-byte rows) products read 7-13 GB/s against
/// 23-35 GB/s for the others (`perf` over `iree-benchmark-module`); padded,
/// the f32 decode runs 1.5-1.6x faster (docs/models.md). The padding columns
/// are zeros the graph slices off inside the product's own dispatch.
pub fn padded_row(columns: usize, bytes: usize) -> usize {
    const PAGE: usize = 4096;
    const LINE: usize = 64;
    if (columns * bytes).is_multiple_of(PAGE) {
        columns + LINE / bytes
    } else {
        columns
    }
}

/// The graph choices of one backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GraphOptions {
    pub precision: Precision,
    pub layout: WeightLayout,
    /// The fewest query rows per KV head the attention products compute:
    /// a smaller group is padded with zero rows (see [`attention_rows_for`]).
    pub attention_rows: usize,
    /// Each RMSNorm's weight is folded into the matrix after it (on upload)
    /// and its 1/rms scale applied to that product's output, so that no
    /// kernel normalises the rows themselves (see [`fold_norms_for`]).
    pub fold_norms: bool,
    /// How one-row q4 products are computed (see [`q4_rows_for`]).
    pub q4_rows: Q4Rows,
    /// How decode steps attend (see [`decode_attention_for`]).
    pub decode_attention: DecodeAttention,
    /// Decode steps rotate each row's q and k and append its k and v to the
    /// caches with kiln's kernel (see [`append_kernel_for`]).
    pub append_kernel: bool,
    /// One-row q8 products are kiln's kernel (see [`q8_kernel_for`]).
    pub q8_kernel: bool,
    /// Each layer's gate and up matrices are stored with their rows in
    /// pairs (gate row i, then up row i) rather than one after the other
    /// (see [`pairs_mlp_rows_for`]).
    pub pairs_mlp_rows: bool,
    /// The graph is one rank's of a tensor-parallel world of this many
    /// ranks (`kiln_core::tensor_parallel`): its weights are the rank's
    /// slice, each layer's attention and MLP outputs are summed over the
    /// ranks (`all_reduce`), the logits gathered (`all_gather`). `Some(1)`
    /// is a world of one, whose collectives still go through the device's
    /// channel; `None` is the whole model without collectives.
    pub tensor_parallel: Option<usize>,
}

/// How a decode step's query rows attend to the KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DecodeAttention {
    /// IREE's kernels: q·K, the masked softmax and p·V, over the whole
    /// context.
    Graph,
    /// kiln's kernels (`kernels/attend_part.cu`, `attend_merge.cu`):
    /// split-K attention over the positions each row has, then the merge
    /// (the first alone, in one pass, where there is one split).
    /// Where a model's heads or cache do not fit them
    /// ([`crate::kernels::decode_attention_fits`]), the step attends as
    /// [`DecodeAttention::Graph`] does.
    Kernel,
    /// [`DecodeAttention::Kernel`] where the caches hold at least
    /// [`KERNEL_ATTENTION_MIN_CONTEXT`] positions or the step's one row
    /// meets 4- or 8-bit blocks, [`DecodeAttention::Graph`] otherwise: the
    /// graph's cost grows with the context whatever the position, the
    /// kernels' with the position.
    Auto,
}

/// The context from which [`DecodeAttention::Auto`] attends through kiln's
/// kernels. On an H100 (2026-12-06, TinyLlama's shape, 16 prompt and 256
/// decoded tokens, docs/perf-notes.md) the graph was the faster at 640
/// positions (f16 626.1 tok/s against 553.5, q4 784.0 against 758.8) and
/// the kernels at 2,048 (f16 546.8 against 413.8, q4 738.2 against 477.9);
/// the graph's step grew 0.58 µs a position of context and the kernels'
/// hardly, which puts the two level at about 710 (q4) to 1,000 (f16).
/// Below it the kernels still win where one row meets blocked weights:
/// since the kernels' single pass (764f845) q4 at 640 positions decoded at
/// 962.9 against the graph's 921.1, and at 972.7 against 793.0 with
/// 283d787 (two calls on H100s), the 8B Q4_0 file at 306.0 against 299.7.
pub const KERNEL_ATTENTION_MIN_CONTEXT: usize = 1024;

impl DecodeAttention {
    pub const ALL: [DecodeAttention; 3] = [
        DecodeAttention::Graph,
        DecodeAttention::Kernel,
        DecodeAttention::Auto,
    ];

    pub fn name(self) -> &'static str {
        match self {
            DecodeAttention::Graph => "graph",
            DecodeAttention::Kernel => "kernel",
            DecodeAttention::Auto => "auto",
        }
    }

    /// Whether a decode step over caches of `context` positions attends
    /// through kiln's kernels (where its shapes fit them);
    /// `one_row_over_blocks` says whether the step's o product takes one row
    /// against 4- or 8-bit blocks.
    pub fn kernels_at(self, context: usize, one_row_over_blocks: bool) -> bool {
        match self {
            DecodeAttention::Graph => false,
            DecodeAttention::Kernel => true,
            DecodeAttention::Auto => context >= KERNEL_ATTENTION_MIN_CONTEXT || one_row_over_blocks,
        }
    }
}

impl FromStr for DecodeAttention {
    type Err = String;

    fn from_str(s: &str) -> Result<DecodeAttention, String> {
        by_name(
            &DecodeAttention::ALL,
            DecodeAttention::name,
            s,
            "decode attention",
        )
    }
}

impl fmt::Display for DecodeAttention {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How `target`'s decode steps attend by default: on CUDA by the context
/// ([`DecodeAttention::Auto`]); on the CPU through IREE's graph, kiln's
/// kernels being CUDA's.
pub fn decode_attention_for(target: Target) -> DecodeAttention {
    match target {
        Target::LlvmCpu => DecodeAttention::Graph,
        Target::Cuda => DecodeAttention::Auto,
    }
}

/// Whether `target`'s decode steps rotate and append with kiln's kernel
/// (`kernels/rope_append.cu`, where the caches are f16): on CUDA a step is
/// bound by its small kernels, and IREE's graph runs three for this (the
/// rotation and a scatter into each cache, about 4 µs each on an H100) in
/// every layer.
pub fn append_kernel_for(target: Target) -> bool {
    matches!(target, Target::Cuda)
}

/// Whether `target`'s one-row q8 products are kiln's kernel
/// (`kernels/q8_row.cu`, the q4 kernel built for 8-bit blocks): on CUDA,
/// IREE's own code for the dequantizing product read the 8B's Q8_0 blocks
/// at a quarter of the bandwidth llama.cpp's did (73.3 tok/s against
/// 236.0, H100, 2026-12-07, docs/perf-notes.md).
pub fn q8_kernel_for(target: Target) -> bool {
    matches!(target, Target::Cuda)
}

/// Whether `target` stores the MLP's gate and up rows in pairs at
/// `precision`: where kiln's row kernel takes the one-row gate/up product
/// (q4 and q8 on CUDA), a warp then holds both halves of its hidden values
/// and writes `SiLU(gate) · up` itself, and the down product reads the
/// hidden row as it is, where every one of its workgroups combined the two
/// halves again (on an H100, 2026-12-07: Llama-3.1-8B's down product 22.7
/// µs with that, 17.7 without, `scripts/q4_kernel_bench.cu`). Products of
/// several rows take the pairs apart, so any graph computes right with
/// either layout.
pub fn pairs_mlp_rows_for(target: Target, precision: Precision) -> bool {
    target == Target::Cuda && precision.is_blocked()
}

/// How a one-row q4 product is computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Q4Rows {
    /// Each block of the row rounded to 16-bit levels of its largest
    /// magnitude and `level · value` summed in i32, the sums scaled after
    /// (at most 1/65534 of the block's largest magnitude off), in
    /// StableHLO and linalg through IREE's code generation.
    Integer,
    /// The row rounded to f16 and the product in f32, one linalg op that
    /// carries kiln's kernel configuration for NVIDIA GPUs where its shape
    /// has one, IREE's own choice elsewhere.
    Configured,
    /// [`Q4Rows::Integer`]'s arithmetic in kiln's own CUDA kernel
    /// (`kernels/q4_row.cu`), dispatched as an external object.
    Kernel,
}

impl std::str::FromStr for Q4Rows {
    type Err = String;

    fn from_str(s: &str) -> Result<Q4Rows, String> {
        match s {
            "integer" => Ok(Q4Rows::Integer),
            "configured" => Ok(Q4Rows::Configured),
            "kernel" => Ok(Q4Rows::Kernel),
            _ => Err(format!(
                "unknown q4 row product {s:?} (integer, configured or kernel)"
            )),
        }
    }
}

impl std::fmt::Display for Q4Rows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Q4Rows::Integer => "integer",
            Q4Rows::Configured => "configured",
            Q4Rows::Kernel => "kernel",
        })
    }
}

/// How `target` computes one-row q4 products by default. On the CPU, in
/// integers: IREE's CPU code keeps an f32 sum over a block in order (floats
/// may not be reassociated) and unpacks i4 values one at a time, where
/// integer sums vectorize and the bytes are unpacked with shifts (SmolLM2
/// at q4 then decoded at 1.9x f16 on one thread, where it ran at
/// 0.22-0.24x; docs/models.md). On CUDA, kiln's own kernel
/// ([`Q4Rows::Kernel`]), the fastest measured (an H100, 2026-12-06,
/// docs/perf-notes.md): TinyLlama's shape 703.0 tok/s against 676.1 for
/// IREE's configured product and 644.0 at f16 in one call, Llama-3.1-8B's
/// 265.1 against 187.2 configured and 148.7-149.8 at f16;
/// `--q4-rows configured` keeps IREE's code generation.
pub fn q4_rows_for(target: Target) -> Q4Rows {
    match target {
        Target::LlvmCpu => Q4Rows::Integer,
        Target::Cuda => Q4Rows::Kernel,
    }
}

/// Whether `target` folds the RMSNorm weights into the next matrix. On CUDA
/// a decode step is bound by how many kernels it issues (about 6 µs of host
/// work each on the H200, docs/perf-notes.md), and a normalised row is a
/// kernel of its own per norm: folding leaves only the sum of squares, and
/// the one-row product reads the f32 row directly (IREE fuses the weights'
/// widening into the matrix-vector kernel), 45 kernels fewer per
/// TinyLlama step (363 → 318, `iree-compile --compile-to=flow`). The CPU
/// is not bound that way: its graph stays as it was.
pub fn fold_norms_for(target: Target) -> bool {
    matches!(target, Target::Cuda)
}

/// The fewest query rows per KV head for which `target`'s code generation
/// runs the attention products well. On CUDA, IREE gives a product with
/// fewer than 8 rows a 32-thread SIMT configuration: SmolLM2's group of 3
/// query heads took 163 µs per q·K product at one row, TinyLlama's group of
/// 8 took 3 µs with tensor-core MMA (`iree-compile
/// --iree-hal-dump-executable-configurations-to`; 4 rows still got SIMT;
/// docs/perf-notes.md). The CPU's code has no such cliff: no padding.
pub fn attention_rows_for(target: Target) -> usize {
    match target {
        Target::Cuda => 8,
        Target::LlvmCpu => 1,
    }
}

impl GraphOptions {
    /// Whether a folded norm's weight is folded into the matrix after it
    /// (`fold_norms`). Not at q4: a matrix keeps the 4-bit blocks it was
    /// given (a GGUF file's Q4_0 blocks exactly, [`crate::q4`]), where
    /// scaling its columns would round every block again; the norm's
    /// weight multiplies the row instead, inside kiln's q4 kernel for one
    /// row.
    pub fn folds_norm_weights(&self) -> bool {
        self.fold_norms && !self.precision.is_blocked()
    }

    /// The given choices, each defaulting to `target`'s (the layout to
    /// out-in at q4, which needs it).
    pub fn for_target(
        target: Target,
        precision: Option<Precision>,
        layout: Option<WeightLayout>,
    ) -> GraphOptions {
        let precision = precision.unwrap_or_else(|| Precision::default_for(target));
        let layout = match (layout, precision) {
            (Some(layout), _) => layout,
            (None, Precision::Q4 | Precision::Q8) => WeightLayout::OutIn,
            (None, _) => WeightLayout::default_for(target),
        };
        GraphOptions {
            precision,
            layout,
            attention_rows: attention_rows_for(target),
            fold_norms: fold_norms_for(target),
            q4_rows: q4_rows_for(target),
            decode_attention: decode_attention_for(target),
            append_kernel: append_kernel_for(target),
            q8_kernel: q8_kernel_for(target),
            pairs_mlp_rows: pairs_mlp_rows_for(target, precision),
            tensor_parallel: None,
        }
    }

    /// Rows of the output projection this graph holds: the vocabulary, or
    /// a rank's share of it rounded up (the last rank's padded with zero
    /// rows, whose logits the gather drops).
    pub fn output_rows(&self, vocab: usize) -> usize {
        match self.tensor_parallel {
            Some(ranks) => vocab.div_ceil(ranks.max(1)),
            None => vocab,
        }
    }

    /// An error for choices that do not go together.
    pub fn check(&self) -> Result<(), String> {
        if self.precision.is_blocked() && self.layout != WeightLayout::OutIn {
            return Err(format!(
                "{p} weights are blocked along each output's inputs: use the {} layout (the \
                 default at {p}), not {}",
                WeightLayout::OutIn,
                self.layout,
                p = self.precision,
            ));
        }
        if self.tensor_parallel == Some(0) {
            return Err("a tensor-parallel world has at least one rank".into());
        }
        Ok(())
    }

    /// [`GraphOptions::check`], and an error for graphs `target` cannot run:
    /// a tensor-parallel rank's sum over the ranks with collectives, which
    /// only CUDA's devices have (NCCL).
    pub fn check_for(&self, target: Target) -> Result<(), String> {
        self.check()?;
        if self.tensor_parallel.is_some() && target != Target::Cuda {
            return Err(
                "tensor-parallel graphs sum over their ranks with collectives, which \
                        IREE's CPU devices do not have: run them on iree-cuda (NCCL), or check \
                        the split on the CPU reference (kiln's --backend cpu)"
                    .into(),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precision_names_round_trip_and_unknown_ones_are_explained() {
        for p in Precision::ALL {
            assert_eq!(p.to_string().parse::<Precision>(), Ok(p));
        }
        let error = "fp8".parse::<Precision>().unwrap_err();
        assert!(error.contains("fp8") && error.contains("f16"), "{error}");
        for l in WeightLayout::ALL {
            assert_eq!(l.to_string().parse::<WeightLayout>(), Ok(l));
        }
        assert!("rows".parse::<WeightLayout>().is_err());
        for a in DecodeAttention::ALL {
            assert_eq!(a.to_string().parse::<DecodeAttention>(), Ok(a));
        }
        let error = "flash".parse::<DecodeAttention>().unwrap_err();
        assert!(
            error.contains("flash") && error.contains("kernel"),
            "{error}"
        );
    }

    #[test]
    fn blocked_precisions_take_the_out_in_layout_and_refuse_the_other() {
        for precision in [Precision::Q4, Precision::Q8] {
            let blocked = GraphOptions::for_target(Target::LlvmCpu, Some(precision), None);
            assert_eq!(blocked.layout, WeightLayout::OutIn);
            assert_eq!(blocked.check(), Ok(()));
            assert!(!blocked.folds_norm_weights());
            let in_out = GraphOptions {
                layout: WeightLayout::InOut,
                ..blocked
            };
            let error = in_out.check().unwrap_err();
            assert!(
                error.contains("out-in")
                    && error.contains("in-out")
                    && error.contains(precision.name()),
                "{error}"
            );
        }
    }
}
