//! Choosing a backend by name. A backend that was not compiled in, or whose
//! device is absent, is an error: kiln never falls back to another one.

use std::path::{Path, PathBuf};

use anyhow::{Result, bail};
use clap::ValueEnum;
use kiln_core::weights::Stored;
use kiln_core::{Backend, CpuBackend, Model};

/// The model and backend options every command that runs a model takes
/// (the CLI's commands and `kiln-server`).
#[derive(Clone, Debug, clap::Args)]
pub struct ModelArgs {
    /// A GGUF file, a Hugging Face Llama folder (config.json, *.safetensors,
    /// tokenizer.json), a pulled pinned model (`kiln list`) or `embedded`;
    /// the embedded model when left out (chat: the pinned SmolLM2).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// The backend. `auto` (the default) takes the fastest one built in
    /// that keeps the model's precision, and says which: iree-cuda where
    /// this kiln has CUDA and a GPU answers, else cpu-q4 for a file of Q4_1
    /// blocks, else cpu-simd (every matrix as stored). `cpu` is the f32
    /// one-thread reference, only when asked for.
    #[arg(long, value_enum)]
    pub backend: Option<BackendKind>,
    #[command(flatten)]
    pub options: BackendOptions,
}

impl ModelArgs {
    /// The backend for `model`: `--backend`, or what `auto` chooses for it
    /// (one line on stderr says what and why).
    pub fn choose(&self, model: &Model) -> Result<BackendKind> {
        choose(self.backend, model, &self.options)
    }
}

/// `asked`, or, when it is `auto` or left out, the fastest backend built in
/// that keeps `model`'s precision, said on stderr with the reason.
pub fn choose(
    asked: Option<BackendKind>,
    model: &Model,
    options: &BackendOptions,
) -> Result<BackendKind> {
    if let Some(kind) = asked.filter(|&k| k != BackendKind::Auto) {
        return Ok(kind);
    }
    let (kind, why) = auto(model, options);
    eprintln!("kiln: backend auto: {} ({why})", kind.name());
    Ok(kind)
}

/// What `auto` takes for `model`, and why.
fn auto(model: &Model, options: &BackendOptions) -> (BackendKind, String) {
    let gpu = gpu_answers();
    if gpu.is_ok() {
        return (
            BackendKind::IreeCuda,
            "this kiln has CUDA and a GPU answered".into(),
        );
    }
    let no_gpu = gpu.err().unwrap_or_default();
    match model.weights.stored {
        // cpu-q4 takes a Q4_0 or Q4_1 file's blocks as they are.
        Stored::Blocks(ty @ ("Q4_0" | "Q4_1")) => {
            let threads = options.threads.map_or_else(default_threads, usize::from);
            (
                BackendKind::CpuQ4,
                format!(
                    "{no_gpu}the model's matrices are {ty} blocks, which cpu-q4 keeps as stored; \
                     {threads} threads"
                ),
            )
        }
        stored => {
            let threads = options.threads.map_or_else(default_threads, usize::from);
            (
                BackendKind::CpuSimd,
                format!(
                    "{no_gpu}the model's matrices are {stored}, which cpu-simd keeps as stored; \
                     {threads} threads; `--backend cpu-q4` rounds them to 4 bits"
                ),
            )
        }
    }
}

/// Whether a CUDA device answers (with a reason, ending "; ", when not).
#[cfg(feature = "cuda")]
fn gpu_answers() -> std::result::Result<(), String> {
    let device = kiln_iree::Instance::new().and_then(|instance| instance.device("cuda").map(drop));
    device.map_err(|error| format!("no GPU answered ({error}); "))
}

#[cfg(not(feature = "cuda"))]
fn gpu_answers() -> std::result::Result<(), String> {
    Err(String::new())
}

/// One thread per core: cpu-q4's count when `--threads` is left out.
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

/// The name `--model` takes for kiln's embedded model (the default of every
/// command but `chat`).
pub const EMBEDDED: &str = "embedded";

/// The model `--model` names: the embedded one when it is left out or named.
pub fn load_model(spec: Option<&Path>) -> Result<Model> {
    let spec = spec.filter(|s| *s != Path::new(EMBEDDED));
    let path = spec.map(kiln_core::pinned::resolve).transpose()?;
    Ok(Model::load_or_embedded(path.as_deref())?)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendKind {
    /// The fastest backend built in that keeps the model's precision
    /// ([`choose`] says which; never a backend that rounds it).
    Auto,
    /// The pure-Rust CPU reference: f32, one thread.
    Cpu,
    /// The CPU reference's forward pass over matrices in 4-bit blocks (a
    /// Q4_0 or Q4_1 GGUF's as stored, others quantized on load), SIMD block
    /// products on `--threads` threads: kiln's fastest CPU decode.
    CpuQ4,
    /// The CPU reference's forward pass over SIMD products on `--threads`
    /// threads, every matrix at the precision its file stores it in (f16,
    /// bf16 or f32 rows, Q8_0 blocks): the reference's numerics, up to the
    /// order of sums, at the speed of the cores (`--activations q8` rounds
    /// the Q8_0 blocks' inputs to 8 bits, as llama.cpp does).
    CpuSimd,
    /// IREE on the CPU (`local-task`), modules compiled for llvm-cpu.
    IreeCpu,
    /// IREE on an NVIDIA GPU (`cuda`), sm_80 PTX JIT-compiled by the driver.
    IreeCuda,
}

impl BackendKind {
    /// The name `--backend` takes.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Auto => "auto",
            BackendKind::Cpu => "cpu",
            BackendKind::CpuQ4 => "cpu-q4",
            BackendKind::CpuSimd => "cpu-simd",
            BackendKind::IreeCpu => "iree-cpu",
            BackendKind::IreeCuda => "iree-cuda",
        }
    }
}

/// Backend options: the IREE backends' and cpu-q4's thread count.
#[derive(Clone, Debug, clap::Args)]
pub struct BackendOptions {
    /// Threads of the CPU backends (default: one per core): cpu-q4's
    /// products, or iree-cpu's kernels (1 runs them on the calling thread,
    /// IREE's `local-sync` driver; more, `local-task` with that many
    /// workers).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub threads: Option<u16>,
    /// What the layers' block products multiply, cpu-q4's 4-bit ones and
    /// cpu-simd's Q8_0 ones: q8, the activations rounded to 8 bits per
    /// block of 32 and multiplied in integers, as llama.cpp's Q4_1 × Q8_1
    /// and Q8_0 × Q8_0; or f32, the activations as they are (the
    /// dequantized weights' exact product). Default for cpu-q4: q8 where the
    /// CPU has AVX-512 VNNI or AVX2 (kiln's SIMD integer kernels), f32
    /// elsewhere, where it is the faster; for cpu-simd: f32, the
    /// reference's numerics (its dense f16, bf16 and f32 rows take f32
    /// either way).
    #[arg(long, value_enum, value_name = "KIND")]
    pub activations: Option<ActivationsKind>,
    /// Longest sequence (prompt plus generated tokens) the IREE modules hold.
    #[arg(long, default_value_t = 256)]
    pub max_context: usize,
    /// Precision of the weights and KV cache on the device: f32, f16, bf16,
    /// q4 (matrices in 4-bit blocks of 32 with f16 scales and offsets, the
    /// KV cache in f16) or q8 (matrices in 8-bit blocks of 32 with an f16
    /// scale, GGUF's Q8_0; the KV cache in f16). Matrix products accumulate
    /// in f32 at each. Default: the precision that keeps a GGUF file's
    /// Q4_0/Q4_1 (q4) or Q8_0 (q8) blocks as stored; otherwise f16 for
    /// iree-cuda, f32 for iree-cpu.
    #[arg(long)]
    pub precision: Option<String>,
    /// Layout of weight matrices on the device: in-out or out-in. Default:
    /// the faster one measured for the target (out-in for iree-cuda, in-out
    /// for iree-cpu).
    #[arg(long)]
    pub weight_layout: Option<String>,
    /// How iree-cuda's one-row q4 products (decode) are computed: `kernel`
    /// (default: kiln's own CUDA kernel, kernels/q4_row.cu, the fastest
    /// measured: 1.04-1.12x `configured` on TinyLlama's shape and 1.4x on
    /// Llama-3.1-8B's, on an H100), `configured` (IREE's code generation
    /// with kiln's kernel configuration), or `integer` (the CPU's form).
    /// For --precision q4 only.
    #[arg(long, value_name = "FORM")]
    pub q4_rows: Option<String>,
    /// How iree-cuda's decode steps attend to the KV cache: `graph` (IREE's
    /// products over the whole context), `kernel` (kiln's split-K kernels,
    /// kernels/attend_part.cu, which read only the positions a sequence
    /// has; heads 64 or 128 wide, up to 8 a KV head, f16 or q4), or `auto`
    /// (the default: the kernels from a context of 1,024 positions, and
    /// below it for one-row steps over q4 or q8 blocks, the graph otherwise:
    /// the faster of the two in each case as measured, docs/perf-notes.md).
    #[arg(long, value_name = "FORM")]
    pub decode_attention: Option<String>,
    /// An IREE runtime flag for the device's driver, as IREE's own tools
    /// take it (`--iree-flag=--cuda_allow_inline_execution=true`); repeat for
    /// several. For experiments: kiln's defaults are the measured best.
    #[arg(long, value_name = "FLAG", allow_hyphen_values = true)]
    pub iree_flag: Vec<String>,
    /// Queue each greedy decode step only after reading the token before it,
    /// rather than while the host reads it. For measuring the pipeline: the
    /// tokens are the same either way.
    #[arg(long)]
    pub no_pipeline: bool,
    /// Greedy decode steps the device runs per call (1 to 16): more spread
    /// the host's work per call over more tokens, which then come back in
    /// groups of that many; steps past a stop are computed and discarded.
    /// Sampling decodes one step per call whatever this is.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub steps_per_call: usize,
    /// Split the model over N GPUs (iree-cuda: GPUs 0 to N-1, tensor
    /// parallelism): each holds its share of every layer's heads and MLP
    /// columns, and the shares' partial products are summed through NCCL
    /// (loaded from `libnccl.so` on the library path). With `cpu`, the
    /// reference split in N ranks run one after another, to check a split.
    /// N must divide the model's heads and MLP width (an error lists the N
    /// that do). docs/tensor-parallel.md.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=64))]
    pub tensor_parallel: Option<u16>,
}

pub fn open<'m>(
    model: &'m Model,
    kind: BackendKind,
    options: &BackendOptions,
) -> Result<Box<dyn Backend + 'm>> {
    let auto_chose = kind == BackendKind::Auto;
    let kind = choose(Some(kind), model, options)?;
    check_threads(kind, options)?;
    if let Some(ranks) = options.tensor_parallel {
        return tensor_parallel(model, kind, options, usize::from(ranks), auto_chose);
    }
    match kind {
        BackendKind::Auto => unreachable!("choose resolves auto"),
        BackendKind::Cpu => Ok(Box::new(CpuBackend::new(model))),
        BackendKind::CpuQ4 => {
            let threads = options.threads.map_or_else(default_threads, usize::from);
            let activations = options
                .activations
                .map_or_else(kiln_cpu::Activations::fastest, Into::into);
            Ok(Box::new(kiln_cpu::backend(model, threads, activations)?))
        }
        BackendKind::CpuSimd => {
            let threads = options.threads.map_or_else(default_threads, usize::from);
            Ok(Box::new(kiln_cpu::backend_at_stored_precision(
                model,
                threads,
                simd_activations(options),
            )?))
        }
        BackendKind::IreeCpu | BackendKind::IreeCuda => iree(model, kind, options),
    }
}

/// `--tensor-parallel N`: the model split in N ranks, on GPUs 0 to N-1
/// (iree-cuda), or the reference split on the CPU (cpu).
#[cfg_attr(not(feature = "xla-iree"), allow(unused_variables))]
fn tensor_parallel<'m>(
    model: &'m Model,
    kind: BackendKind,
    options: &BackendOptions,
    ranks: usize,
    auto_chose: bool,
) -> Result<Box<dyn Backend + 'm>> {
    let plan = kiln_core::tensor_parallel::ShardPlan::new(&model.config, ranks)
        .map_err(anyhow::Error::msg)?;
    match kind {
        BackendKind::Cpu => Ok(Box::new(CpuBackend::tensor_parallel(model, &plan))),
        #[cfg(feature = "xla-iree")]
        BackendKind::IreeCuda => Ok(Box::new(iree_ranks(model, &plan, options)?)),
        other => bail!(
            "--tensor-parallel splits a model over GPUs (iree-cuda), or checks the split on the \
             reference (cpu); {} does not split{}",
            other.name(),
            if auto_chose {
                " (auto chose it: name --backend iree-cuda or cpu)"
            } else {
                ""
            }
        ),
    }
}

/// The model config whose modules `kiln prepare` (and `kiln-bench-decode
/// --prepare`) compiles for `target` with `--tensor-parallel ranks`: a
/// rank's slice, every rank's having the same shapes, with `graph` made a
/// rank's; without it, the model's own.
#[cfg(feature = "xla-iree")]
pub fn prepared_config(
    config: &kiln_core::ModelConfig,
    target: kiln_xla::Target,
    graph: &mut kiln_xla::GraphOptions,
    ranks: Option<u16>,
) -> Result<kiln_core::ModelConfig> {
    let Some(ranks) = ranks else {
        return Ok(config.clone());
    };
    graph.tensor_parallel = Some(ranks.into());
    graph.check_for(target).map_err(anyhow::Error::msg)?;
    let plan = kiln_core::tensor_parallel::ShardPlan::new(config, ranks.into())
        .map_err(anyhow::Error::msg)?;
    Ok(plan.rank_config(0))
}

/// How long the ranks may take to open (compiling the modules the cache
/// lacks, loading every one, uploading the weights), and to answer a call.
#[cfg(feature = "xla-iree")]
const RANKS_OPEN_WITHIN: std::time::Duration = std::time::Duration::from_secs(3600);
#[cfg(feature = "xla-iree")]
const RANKS_ANSWER_WITHIN: std::time::Duration = std::time::Duration::from_secs(300);
/// How long a rank waits for rank 0's NCCL id of a module: rank 0 uploads
/// its weights first; well within the opening's bound, so that a rank 0
/// that died is reported by the rank that waited for it.
#[cfg(feature = "xla-iree")]
const RANKS_ID_WITHIN: std::time::Duration = std::time::Duration::from_secs(600);

/// The ranks of `plan` on GPUs 0 to N-1, one thread each.
#[cfg(feature = "xla-iree")]
fn iree_ranks(
    model: &Model,
    plan: &kiln_core::tensor_parallel::ShardPlan,
    options: &BackendOptions,
) -> Result<kiln_core::ranks::Ranks> {
    let target = kiln_xla::Target::Cuda;
    let (_, flags) = iree_device(target, options.threads, &options.iree_flag);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    kiln_iree::set_flags(&flags)?;
    say_stored_precision(options, model.weights.stored);
    let mut graph = graph(target, options, Some(model.weights.stored))?;
    graph.tensor_parallel = Some(plan.ranks());
    // The folder the ranks meet in: created 0700, so that no other user
    // can read rank 0's NCCL id (and join the world) or plant one.
    let rendezvous = tempfile::Builder::new()
        .prefix("kiln-ranks-")
        .tempdir()
        .map_err(|e| anyhow::anyhow!("a folder for the ranks to meet in: {e}"))?;
    let buckets = buckets(model, options)?;
    // Every rank's modules are the same: compiled here once (where the
    // cache lacks them and a compiler is), not by N ranks at once.
    if let Some(compiler) = compiler()? {
        let kinds = kiln_xla::prepared::module_kinds(&buckets, options.steps_per_call);
        kiln_xla::prepared::prepare_kinds(
            &plan.rank_config(0),
            &graph,
            &kinds,
            &buckets,
            target,
            &compiler,
            &kiln_xla::ModuleCache::default_location()?,
            |_, _, _| {},
        )?;
    }
    // Each rank's slice (with its own copy of the embedding), beside the
    // whole model the caller holds: twice the weights in host memory
    // while the ranks open.
    let opener = IreeRanks {
        models: std::sync::Mutex::new(
            (0..plan.ranks())
                .map(|r| Some(plan.rank_model(model, r)))
                .collect(),
        ),
        graph,
        buckets,
        rendezvous,
        steps_per_call: options.steps_per_call,
        pipelined: !options.no_pipeline,
    };
    Ok(kiln_core::ranks::Ranks::start(
        plan.ranks(),
        opener,
        RANKS_OPEN_WITHIN,
        RANKS_ANSWER_WITHIN,
    )?)
}

/// Opens each rank's IREE backend on its own GPU, in its world.
#[cfg(feature = "xla-iree")]
struct IreeRanks {
    /// Each rank's model, taken by its thread.
    models: std::sync::Mutex<Vec<Option<Model>>>,
    graph: kiln_xla::GraphOptions,
    buckets: kiln_xla::Buckets,
    rendezvous: tempfile::TempDir,
    steps_per_call: usize,
    pipelined: bool,
}

#[cfg(feature = "xla-iree")]
impl kiln_core::ranks::RankOpener for IreeRanks {
    fn with_rank(
        &self,
        rank: usize,
        serve: &mut dyn FnMut(&mut dyn Backend),
    ) -> kiln_core::Result<()> {
        let to_core = |e: anyhow::Error| kiln_core::Error::Backend(format!("{e:#}"));
        let model = self
            .models
            .lock()
            .map_err(|_| kiln_core::Error::Backend("another rank panicked".into()))?
            .get_mut(rank)
            .and_then(Option::take)
            .ok_or_else(|| kiln_core::Error::Backend(format!("rank {rank}'s model was taken")))?;
        let ranks = self.graph.tensor_parallel.unwrap_or(1);
        let mut backend = kiln_xla::IreeBackend::new(
            &model,
            &format!("cuda://{rank}"),
            kiln_xla::Target::Cuda,
            self.graph,
            compiler().map_err(to_core)?,
            kiln_xla::ModuleCache::default_location().map_err(|e| to_core(e.into()))?,
            self.buckets.clone(),
        )?;
        backend.join_world(&kiln_iree::World {
            rank: rank as i32,
            count: ranks as i32,
            rendezvous: Some(self.rendezvous.path().join("nccl-id")),
            timeout: RANKS_ID_WITHIN,
        })?;
        backend.set_pipelined(self.pipelined);
        backend.set_steps_per_call(self.steps_per_call)?;
        // Every module now: a call must not wait on a compile in one rank
        // while the others wait in a collective.
        for kind in backend.module_kinds() {
            backend.load(kind)?;
        }
        serve(&mut backend);
        Ok(())
    }
}

/// What cpu-simd's Q8_0 blocks multiply: `--activations`, else f32 (the
/// reference's numerics; q8 is opt-in).
pub fn simd_activations(options: &BackendOptions) -> kiln_cpu::Activations {
    options
        .activations
        .map_or(kiln_cpu::Activations::F32, Into::into)
}

/// `--activations` (cpu-q4's and cpu-simd's), as clap parses it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ActivationsKind {
    Q8,
    F32,
}

impl From<ActivationsKind> for kiln_cpu::Activations {
    fn from(kind: ActivationsKind) -> Self {
        match kind {
            ActivationsKind::Q8 => kiln_cpu::Activations::Q8,
            ActivationsKind::F32 => kiln_cpu::Activations::F32,
        }
    }
}

/// `--threads` is for the backends that run on this machine's cores
/// besides the f32 reference, which is one thread by design;
/// `--activations` for cpu-q4 and cpu-simd, the backends whose products
/// take them either way; `--q4-rows` for the IREE backends.
fn check_threads(kind: BackendKind, options: &BackendOptions) -> Result<()> {
    if options.threads.is_some()
        && !matches!(
            kind,
            BackendKind::CpuQ4 | BackendKind::CpuSimd | BackendKind::IreeCpu
        )
    {
        bail!(
            "--threads is for the cpu-q4, cpu-simd and iree-cpu backends; {} does not take it",
            kind.name()
        );
    }
    if options.decode_attention.is_some() && kind != BackendKind::IreeCuda {
        bail!(
            "--decode-attention chooses iree-cuda's attention kernels; {} does not take it",
            kind.name()
        );
    }
    if options.q4_rows.is_some() && !matches!(kind, BackendKind::IreeCpu | BackendKind::IreeCuda) {
        bail!(
            "--q4-rows is for the IREE backends' q4 products; {} does not take it",
            kind.name()
        );
    }
    if options.activations.is_some() && !matches!(kind, BackendKind::CpuQ4 | BackendKind::CpuSimd) {
        bail!(
            "--activations is for the cpu-q4 and cpu-simd backends; {} does not take it",
            kind.name()
        );
    }
    Ok(())
}

/// [`open`], with every module the backend can need loaded (compiled where
/// the module cache lacks it) now rather than at first use: the prefill
/// buckets, the decode step and, for speculation with up to `draft_tokens`
/// proposed tokens, the multi-token steps. For a server, which says it is
/// ready only when no request will wait for a compile.
pub fn open_loaded<'m>(
    model: &'m Model,
    kind: BackendKind,
    options: &BackendOptions,
    draft_tokens: Option<usize>,
) -> Result<Box<dyn Backend + 'm>> {
    #[cfg(feature = "xla-iree")]
    if matches!(kind, BackendKind::IreeCpu | BackendKind::IreeCuda)
        && options.tensor_parallel.is_none()
    {
        let mut backend = open_iree(model, kind, options)?;
        let mut kinds = backend.module_kinds();
        if let Some(k) = draft_tokens {
            kinds.extend(kiln_xla::prepared::append_module_kinds(k));
        }
        for kind in kinds {
            backend.load(kind)?;
        }
        return Ok(Box::new(backend));
    }
    let _ = draft_tokens;
    open(model, kind, options)
}

#[cfg(feature = "xla-iree")]
fn iree<'m>(
    model: &'m Model,
    kind: BackendKind,
    options: &BackendOptions,
) -> Result<Box<dyn Backend + 'm>> {
    Ok(Box::new(open_iree(model, kind, options)?))
}

/// The IREE backend itself (for `prepare`, which needs more than the trait).
#[cfg(feature = "xla-iree")]
pub fn open_iree<'m>(
    model: &'m Model,
    kind: BackendKind,
    options: &BackendOptions,
) -> Result<kiln_xla::IreeBackend<'m>> {
    use kiln_xla::{IreeBackend, ModuleCache};
    let target = target(kind)?;
    check_threads(kind, options)?;
    let (uri, flags) = iree_device(target, options.threads, &options.iree_flag);
    // Process-wide: a backend opened later with other flags is an error
    // while this one is open, never a silent mix of both.
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    kiln_iree::set_flags(&flags)?;
    say_stored_precision(options, model.weights.stored);
    let mut backend = IreeBackend::new(
        model,
        uri,
        target,
        graph(target, options, Some(model.weights.stored))?,
        compiler()?,
        ModuleCache::default_location()?,
        buckets(model, options)?,
    )?;
    backend.set_pipelined(!options.no_pipeline);
    backend.set_steps_per_call(options.steps_per_call)?;
    Ok(backend)
}

/// How long an idle IREE worker spins for the next kernel before it sleeps,
/// in µs. A decode step is hundreds of kernels, each handed to the workers:
/// sleeping between them, two workers decoded SmolLM2 at q4 slower than the
/// calling thread alone (36-44 tok/s against 63); spinning 30, 100 or 300 µs
/// gave 55-69, and f16 and f32 gained 5-10 % (docs/models.md).
#[cfg(feature = "xla-iree")]
const IREE_WORKER_SPIN_US: u32 = 100;

/// The IREE device URI and runtime flags for `target` at `threads`: kiln's
/// defaults first, then the user's `--iree-flag`s, which IREE lets override
/// them (the last value of a flag wins); the worker count last, as
/// `--threads` is how that is chosen.
#[cfg(feature = "xla-iree")]
fn iree_device(
    target: kiln_xla::Target,
    threads: Option<u16>,
    user_flags: &[String],
) -> (&'static str, Vec<String>) {
    use kiln_xla::Target;
    let with_defaults = |defaults: Vec<String>| -> Vec<String> {
        defaults
            .into_iter()
            .chain(user_flags.iter().cloned())
            .collect()
    };
    match (target, threads) {
        (Target::Cuda, _) => ("cuda", with_defaults(Vec::new())),
        // One thread: the kernels run on the calling thread, with no
        // hand-over to a worker for each of them, which q4's many small
        // kernels feel most (docs/models.md).
        (Target::LlvmCpu, Some(1)) => ("local-sync", with_defaults(Vec::new())),
        (Target::LlvmCpu, threads) => {
            let mut flags =
                with_defaults(vec![format!("--task_worker_spin_us={IREE_WORKER_SPIN_US}")]);
            if let Some(n) = threads {
                flags.push(format!("--task_topology_group_count={n}"));
            }
            ("local-task", flags)
        }
    }
}

/// The IREE target of an IREE backend kind.
#[cfg(feature = "xla-iree")]
pub fn target(kind: BackendKind) -> Result<kiln_xla::Target> {
    match kind {
        BackendKind::IreeCuda if !cfg!(feature = "cuda") => bail!(
            "the iree-cuda backend is not compiled into this kiln; rebuild with `--features cuda,xla-iree`"
        ),
        BackendKind::IreeCuda => Ok(kiln_xla::Target::Cuda),
        BackendKind::IreeCpu => Ok(kiln_xla::Target::LlvmCpu),
        BackendKind::Auto | BackendKind::Cpu | BackendKind::CpuQ4 | BackendKind::CpuSimd => {
            bail!("the {} backend is not an IREE backend", kind.name())
        }
    }
}

/// Says on stderr when [`graph`] takes the precision from the model's
/// blocks, and how to choose another.
#[cfg(feature = "xla-iree")]
pub fn say_stored_precision(options: &BackendOptions, stored: Stored) {
    if options.precision.is_none()
        && let Some(kept) = stored_precision(stored)
    {
        eprintln!(
            "kiln: precision {kept}: the model's matrices are {stored}, which {kept} keeps as \
             stored; --precision f16 widens them"
        );
    }
}

/// The IREE precision that keeps a model file's matrices as they are
/// stored: q4 for Q4_0 and Q4_1 blocks (taken bit for bit, kiln_xla::q4),
/// q8 for Q8_0 (kiln_xla::q8); `None` for anything else, where the
/// target's default applies (K-quants and mixed files would be rounded
/// again at q4).
#[cfg(feature = "xla-iree")]
pub fn stored_precision(stored: Stored) -> Option<kiln_xla::Precision> {
    match stored {
        Stored::Blocks("Q4_0" | "Q4_1") => Some(kiln_xla::Precision::Q4),
        Stored::Blocks("Q8_0") => Some(kiln_xla::Precision::Q8),
        _ => None,
    }
}

/// The graph choices of `target` with the user's overrides. Without
/// `--precision`, a model stored in blocks an IREE graph keeps as they
/// are (`stored`, see [`stored_precision`]; `None` where the model's
/// matrices cannot be such blocks) runs at that precision: a Q4_0 file
/// reads its 4-bit blocks on the GPU, not f16 weights 3.5 times the size
/// ([`say_stored_precision`] says so).
#[cfg(feature = "xla-iree")]
pub fn graph(
    target: kiln_xla::Target,
    options: &BackendOptions,
    stored: Option<Stored>,
) -> Result<kiln_xla::GraphOptions> {
    let precision = parse_option("--precision", options.precision.as_deref())?
        .or_else(|| stored.and_then(stored_precision));
    let layout = parse_option("--weight-layout", options.weight_layout.as_deref())?;
    let q4_rows: Option<kiln_xla::Q4Rows> = parse_option("--q4-rows", options.q4_rows.as_deref())?;
    let mut graph = kiln_xla::GraphOptions::for_target(target, precision, layout);
    if let Some(rows) = q4_rows {
        if graph.precision != kiln_xla::Precision::Q4 {
            bail!(
                "--q4-rows is for --precision q4; {} has no 4-bit products",
                graph.precision
            );
        }
        if target == kiln_xla::Target::LlvmCpu && rows != kiln_xla::Q4Rows::Integer {
            bail!(
                "--q4-rows {rows} runs on NVIDIA GPUs (iree-cuda) only; iree-cpu's q4 products are integer"
            );
        }
        graph.q4_rows = rows;
    }
    let attention: Option<kiln_xla::DecodeAttention> =
        parse_option("--decode-attention", options.decode_attention.as_deref())?;
    if let Some(attention) = attention {
        graph.decode_attention = attention;
    }
    Ok(graph)
}

/// An optional option value parsed, an error naming the option otherwise.
#[cfg(feature = "xla-iree")]
fn parse_option<T: std::str::FromStr<Err = String>>(
    option: &str,
    value: Option<&str>,
) -> Result<Option<T>> {
    value
        .map(str::parse)
        .transpose()
        .map_err(|e| anyhow::anyhow!("{option}: {e}"))
}

/// The sequence buckets and context the IREE modules are compiled for.
#[cfg(feature = "xla-iree")]
pub fn buckets(model: &Model, options: &BackendOptions) -> Result<kiln_xla::Buckets> {
    if options.max_context == 0 {
        bail!("--max-context must be positive");
    }
    Ok(kiln_xla::Buckets::for_model(model, options.max_context))
}

/// The pinned compiler, or `None` where `KILN_IREE_COMPILE` is unset (a GPU
/// machine running prepared modules); any other problem is an error.
#[cfg(feature = "xla-iree")]
pub fn compiler() -> Result<Option<kiln_xla::Compiler>> {
    match kiln_xla::Compiler::from_env() {
        Ok(compiler) => Ok(Some(compiler)),
        Err(kiln_xla::Error::CompilerUnset) => Ok(None),
        Err(error) => Err(error.into()),
    }
}

#[cfg(not(feature = "xla-iree"))]
fn iree<'m>(
    _model: &'m Model,
    kind: BackendKind,
    _options: &BackendOptions,
) -> Result<Box<dyn Backend + 'm>> {
    let features = if kind == BackendKind::IreeCuda {
        "cuda,xla-iree"
    } else {
        "xla-iree"
    };
    bail!(
        "the {} backend is not compiled into this kiln; rebuild with `--features {features}`",
        kind.to_possible_value()
            .expect("no skipped variants")
            .get_name()
    )
}

#[cfg(all(test, feature = "xla-iree"))]
mod tests {
    use super::*;
    use kiln_xla::Target;

    #[test]
    fn iree_workers_spin_by_default_and_the_user_has_the_last_word() {
        let spin = format!("--task_worker_spin_us={IREE_WORKER_SPIN_US}");
        let user = vec!["--task_worker_spin_us=0".to_string()];
        assert_eq!(
            iree_device(Target::LlvmCpu, None, &[]),
            ("local-task", vec![spin.clone()])
        );
        assert_eq!(
            iree_device(Target::LlvmCpu, Some(2), &user),
            (
                "local-task",
                vec![
                    spin,
                    user[0].clone(),
                    "--task_topology_group_count=2".to_string()
                ]
            )
        );
        // No workers, nothing to spin.
        assert_eq!(
            iree_device(Target::LlvmCpu, Some(1), &user),
            ("local-sync", user.clone())
        );
        assert_eq!(iree_device(Target::Cuda, None, &[]), ("cuda", Vec::new()));
    }

    /// Without --precision, a GGUF file's Q4_0, Q4_1 or Q8_0 blocks run at
    /// the IREE precision that keeps them (on either target); K-quants,
    /// mixed files and dense matrices take the target's default; the
    /// user's --precision wins.
    #[test]
    fn a_files_blocks_choose_the_precision_that_keeps_them() {
        use clap::Parser;
        use kiln_xla::Precision;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            options: BackendOptions,
        }
        let options = |args: &[&str]| {
            Cli::try_parse_from(std::iter::once("kiln").chain(args.iter().copied()))
                .unwrap()
                .options
        };
        let chosen = |target, args: &[&str], stored| {
            graph(target, &options(args), stored).unwrap().precision
        };
        for target in [Target::Cuda, Target::LlvmCpu] {
            let default = Precision::default_for(target);
            for (stored, want) in [
                (Some(Stored::Blocks("Q4_0")), Precision::Q4),
                (Some(Stored::Blocks("Q4_1")), Precision::Q4),
                (Some(Stored::Blocks("Q8_0")), Precision::Q8),
                (Some(Stored::Blocks("Q4_K")), default),
                (Some(Stored::Mixed), default),
                (Some(Stored::F16), default),
                (None, default),
            ] {
                assert_eq!(chosen(target, &[], stored), want, "{stored:?}");
            }
            let f16 = chosen(
                target,
                &["--precision", "f16"],
                Some(Stored::Blocks("Q8_0")),
            );
            assert_eq!(f16, Precision::F16);
        }
    }
}

/// Without a GPU, `auto` keeps a file's 4-bit blocks on `cpu-q4` and every
/// other precision on `cpu-simd`.
#[cfg(all(test, not(feature = "cuda")))]
mod auto_tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        options: BackendOptions,
    }

    #[test]
    fn a_files_4_bit_blocks_go_to_cpu_q4_and_the_rest_to_cpu_simd() {
        let options = Cli::try_parse_from(["kiln"]).unwrap().options;
        let mut model = Model::embedded();
        for (stored, want) in [
            (Stored::Blocks("Q4_0"), BackendKind::CpuQ4),
            (Stored::Blocks("Q4_1"), BackendKind::CpuQ4),
            (Stored::Blocks("Q8_0"), BackendKind::CpuSimd),
            (Stored::Blocks("Q4_K"), BackendKind::CpuSimd),
            (Stored::F16, BackendKind::CpuSimd),
        ] {
            model.weights.stored = stored;
            let (kind, why) = auto(&model, &options);
            assert_eq!(kind, want, "{stored:?}: {why}");
            assert!(why.contains("keeps as stored"), "{why}");
        }
    }
}
