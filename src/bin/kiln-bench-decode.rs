//! `kiln-bench-decode`: prefill and greedy-decode throughput of backends on a
//! model, side by side in one run, as a table and as JSON.
//!
//! ```sh
//! kiln-bench-decode --backend cpu --backend iree-cpu --model embedded --model random-100m
//! kiln-bench-decode --backend iree-cuda --model tinyllama-1.1b --precision f32 --precision f16 \
//!     --prompt-tokens 128 --prompt-tokens 512 --decode-tokens 64 --max-context 640
//! ```
//!
//! `--write-model DIR` saves a named random model as a Hugging Face folder
//! (f16 safetensors), so another engine can be measured on the same weights
//! (`scripts/bench_gpu.py` does that with transformers).

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Parser;
use kiln::backends::{self, ActivationsKind, BackendKind, BackendOptions};
use kiln_core::Model;
use kiln_core::sampling::argmax;
use serde::Serialize;

#[derive(Parser)]
#[command(about = "Prefill and decode tokens/s of kiln backends")]
struct Args {
    /// Backends to measure (repeat the flag); each runs the same work.
    /// `auto` (the default) is what every kiln command takes by default for
    /// each model.
    #[arg(long, value_enum, default_values_t = [BackendKind::Auto])]
    backend: Vec<BackendKind>,
    /// `embedded`, `random-100m`, `tinyllama-1.1b`, `smollm2-135m` or `llama-3.1-8b` (random-weight Llamas of
    /// those sizes, made on the fly; `NAME-q8_0`, e.g. `smollm2-135m-q8_0`,
    /// with every matrix rounded to Q8_0 blocks), a model folder (config.json and
    /// safetensors; no tokenizer needed), a GGUF file or a pulled model's
    /// name (`kiln list`). Repeat for several.
    #[arg(long, default_values_t = ["embedded".to_string()])]
    model: Vec<String>,
    /// Prompt lengths for the prefill measurement (repeat for several); the
    /// decode is measured after each.
    #[arg(long, default_values_t = [64])]
    prompt_tokens: Vec<usize>,
    /// Greedy decode steps after the prompt.
    #[arg(long, default_value_t = 32)]
    decode_tokens: usize,
    /// Timed repetitions of the prefill (after one untimed warm-up).
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Longest sequence the IREE modules hold.
    #[arg(long, default_value_t = 256)]
    max_context: usize,
    /// IREE precisions to measure (repeat for several); default: each
    /// backend's own.
    #[arg(long)]
    precision: Vec<String>,
    /// IREE weight layouts to measure (repeat for several); default: each
    /// backend's own.
    #[arg(long)]
    weight_layout: Vec<String>,
    /// Sets of IREE runtime flags to measure (repeat for several; each a
    /// space-separated list, `""` for none), e.g.
    /// `--iree-flags "" --iree-flags "--cuda_allow_inline_execution=true"`.
    #[arg(long, allow_hyphen_values = true)]
    iree_flags: Vec<String>,
    /// Threads of the cpu-q4 and iree-cpu backends (default: one per core;
    /// see `kiln generate --threads`).
    #[arg(long, value_name = "N")]
    threads: Option<u16>,
    /// What cpu-q4's and cpu-simd's block products multiply, to measure
    /// (repeat for several: q8, f32; see `kiln generate --activations`);
    /// default: each backend's own.
    #[arg(long, value_enum)]
    activations: Vec<ActivationsKind>,
    /// Greedy pipeline settings to measure (repeat for several): `on`
    /// queues each step while the host reads the token before it, `off`
    /// only after (see `--no-pipeline`).
    #[arg(long, value_parser = ["on", "off"], default_values_t = ["on".to_string()])]
    pipeline: Vec<String>,
    /// How q4's one-row products are computed, to measure (repeat for
    /// several: configured, kernel, integer; see `kiln generate
    /// --q4-rows`); applies to the q4 variants.
    #[arg(long)]
    q4_rows: Vec<String>,
    /// How iree-cuda's decode steps attend, to measure (repeat for several:
    /// auto, kernel, graph; see `kiln generate --decode-attention`).
    #[arg(long)]
    decode_attention: Vec<String>,
    /// Greedy steps per call of the device to measure (repeat for several;
    /// see `--steps-per-call`).
    #[arg(long, default_values_t = [1])]
    steps_per_call: Vec<usize>,
    /// Split each model in N ranks on GPUs 0 to N-1 (iree-cuda; see `kiln
    /// generate --tensor-parallel`). 1 runs a rank's graphs, collectives
    /// and all, on one GPU: what they cost against the plain graphs.
    #[arg(long, value_name = "N")]
    tensor_parallel: Option<u16>,
    /// Only compile the IREE modules the run would need into the module cache
    /// (needs the compiler, not the device), then stop.
    #[arg(long)]
    prepare: bool,
    /// With --prepare: also write each module's StableHLO (`.mlir`) and
    /// compiled `.vmfb` here, for `iree-compile` and `iree-benchmark-module`.
    #[arg(long, requires = "prepare")]
    export: Option<PathBuf>,
    /// Write the (single) model as a Hugging Face folder with f16 weights to
    /// this directory, then stop.
    #[arg(long, conflicts_with = "write_config")]
    write_model: Option<PathBuf>,
    /// Write only the (single) model's `config.json` to this directory, then
    /// stop: for `scripts/bench_transformers.py --random-weights`, which draws
    /// weights of that shape on the GPU.
    #[arg(long)]
    write_config: Option<PathBuf>,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

impl Args {
    /// The IREE options of each variant to measure for `kind`: one for the
    /// CPU reference, every precision × layout asked for otherwise.
    fn variants(&self, kind: BackendKind) -> Vec<BackendOptions> {
        let some_or_default = |v: &[String]| -> Vec<Option<String>> {
            if v.is_empty() {
                vec![None]
            } else {
                v.iter().cloned().map(Some).collect()
            }
        };
        match kind {
            BackendKind::Auto => unreachable!("auto is resolved for each model first"),
            BackendKind::Cpu => return vec![self.iree(None, None)],
            BackendKind::CpuQ4 | BackendKind::CpuSimd => {
                let kinds = match self.activations.as_slice() {
                    [] => vec![None],
                    kinds => kinds.iter().copied().map(Some).collect(),
                };
                return kinds
                    .into_iter()
                    .map(|kind| {
                        let mut options = self.iree(None, None);
                        options.threads = self.threads;
                        options.activations = kind;
                        options
                    })
                    .collect();
            }
            BackendKind::IreeCpu | BackendKind::IreeCuda => {}
        }
        let flag_sets = if self.iree_flags.is_empty() {
            vec![String::new()]
        } else {
            self.iree_flags.clone()
        };
        let mut out = Vec::new();
        for precision in some_or_default(&self.precision) {
            let q4_rows = match precision.as_deref() {
                Some("q4") => some_or_default(&self.q4_rows),
                _ => vec![None],
            };
            for layout in some_or_default(&self.weight_layout) {
                for flags in &flag_sets {
                    for pipeline in &self.pipeline {
                        for &steps in &self.steps_per_call {
                            for rows in &q4_rows {
                                for attention in some_or_default(&self.decode_attention) {
                                    let mut options = self.iree(precision.clone(), layout.clone());
                                    options.iree_flag =
                                        flags.split_whitespace().map(str::to_string).collect();
                                    options.no_pipeline = pipeline == "off";
                                    options.steps_per_call = steps;
                                    options.threads = self.threads;
                                    options.q4_rows = rows.clone();
                                    options.decode_attention = attention;
                                    out.push(options);
                                }
                            }
                        }
                    }
                }
            }
        }
        out
    }

    fn iree(&self, precision: Option<String>, weight_layout: Option<String>) -> BackendOptions {
        BackendOptions {
            threads: None,
            activations: None,
            max_context: self.max_context,
            precision,
            weight_layout,
            q4_rows: None,
            decode_attention: None,
            iree_flag: Vec::new(),
            no_pipeline: false,
            steps_per_call: 1,
            tensor_parallel: self.tensor_parallel,
        }
    }
}

#[derive(Serialize)]
struct Row {
    model: String,
    parameters: usize,
    backend: String,
    /// Weight and KV-cache precision, and weight layout (IREE backends).
    precision: String,
    layout: String,
    /// IREE runtime flags the variant ran with.
    iree_flags: String,
    /// Whether greedy steps were pipelined (`--pipeline`).
    pipelined: bool,
    /// Greedy steps per call of the device (`--steps-per-call`).
    steps_per_call: usize,
    /// Bytes of weights a decode step must read at this precision (every
    /// matrix once, one embedding row), the numerator of the bandwidth bound.
    decode_weight_bytes: u64,
    prompt_tokens: usize,
    prefill_tokens_per_s: f64,
    decode_tokens: usize,
    decode_tokens_per_s: f64,
    setup_s: f64,
}

/// Bytes a decode step reads from the weights at `bits_per_weight`: all but
/// the embedding table, of which one row.
fn decode_weight_bytes(model: &Model, bits_per_weight: f64) -> u64 {
    let c = &model.config;
    let mut weights =
        (model.parameter_count() - c.vocab_size * c.hidden_size + c.hidden_size) as u64;
    if c.tie_word_embeddings {
        // The tied table is read whole as the output projection.
        weights += (c.vocab_size * c.hidden_size) as u64;
    }
    (weights as f64 * bits_per_weight / 8.0) as u64
}

fn write_model(args: &Args, dir: &Path) -> Result<()> {
    let [spec] = args.model.as_slice() else {
        bail!("--write-model writes one model: pass exactly one --model");
    };
    let model = kiln::bench::model(spec)?;
    kiln_core::save::save_f16(dir, &model.config, &model.weights)
        .with_context(|| format!("writing {spec} to {}", dir.display()))?;
    println!(
        "wrote {spec} ({} parameters, f16) to {}",
        model.parameter_count(),
        dir.display()
    );
    Ok(())
}

fn write_config(args: &Args, dir: &Path) -> Result<()> {
    let [spec] = args.model.as_slice() else {
        bail!("--write-config writes one model's: pass exactly one --model");
    };
    let (config, _) = kiln::bench::header(spec)?;
    kiln_core::save::save_config(dir, &config)
        .with_context(|| format!("writing {spec}'s config.json to {}", dir.display()))?;
    println!("wrote {spec}'s config.json to {}", dir.display());
    Ok(())
}

/// Compiles the IREE modules of each model for each IREE backend into the
/// module cache, from the configuration alone (no weights, no device), so
/// that a GPU machine without the compiler can run the benchmark.
#[cfg(feature = "xla-iree")]
fn prepare(args: &Args) -> Result<()> {
    use kiln_xla::{Buckets, Compiler, ModuleCache, prepared};
    let compiler = Compiler::from_env()?;
    let cache = ModuleCache::default_location()?;
    for spec in &args.model {
        let (config, stored) = kiln::bench::header(spec)?;
        let context = config.context_limit().min(args.max_context);
        for &kind in args
            .backend
            .iter()
            .filter(|k| matches!(k, BackendKind::IreeCpu | BackendKind::IreeCuda))
        {
            let target = backends::target(kind)?;
            let buckets = Buckets::for_context(context);
            for options in args.variants(kind) {
                let mut graph = backends::graph(target, &options, stored)?;
                let config =
                    backends::prepared_config(&config, target, &mut graph, args.tensor_parallel)?;
                kiln_xla::check_steps_per_call(options.steps_per_call)?;
                let kinds = prepared::module_kinds(&buckets, options.steps_per_call);
                if let Some(dir) = &args.export {
                    export(
                        dir, spec, &config, &graph, &kinds, &buckets, target, &compiler, &cache,
                    )?;
                }
                prepared::prepare_kinds(
                    &config,
                    &graph,
                    &kinds,
                    &buckets,
                    target,
                    &compiler,
                    &cache,
                    |m, origin, took| {
                        eprintln!(
                            "{spec} {target:?} {} {} {m:?}: {origin:?} in {:.1}s",
                            graph.precision,
                            graph.layout,
                            took.as_secs_f64()
                        )
                    },
                )?;
            }
        }
    }
    Ok(())
}

/// Writes `<model>-<target>-<precision>-<layout>-<module>.{mlir,vmfb}`.
#[cfg(feature = "xla-iree")]
#[allow(clippy::too_many_arguments)]
fn export(
    dir: &Path,
    spec: &str,
    config: &kiln_core::ModelConfig,
    graph: &kiln_xla::GraphOptions,
    kinds: &[kiln_xla::ModuleKind],
    buckets: &kiln_xla::Buckets,
    target: kiln_xla::Target,
    compiler: &kiln_xla::Compiler,
    cache: &kiln_xla::ModuleCache,
) -> Result<()> {
    use kiln_xla::{ModuleKind, prepared};
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let model = Path::new(spec)
        .file_name()
        .map_or(spec.into(), |n| n.to_string_lossy());
    for &kind in kinds {
        let module = match kind {
            ModuleKind::Prefill(seq) => format!("prefill{seq}"),
            ModuleKind::Decode => "decode".into(),
            ModuleKind::DecodeChain(steps) => format!("decode-chain{steps}"),
            ModuleKind::DecodeBatch { rows, slots } => format!("decode-batch{rows}of{slots}"),
            ModuleKind::AdmitSlot { slots } => format!("admit-slot{slots}"),
            ModuleKind::PrefillBatch { rows, seq, slots } => {
                format!("prefill-batch{rows}x{seq}of{slots}")
            }
            ModuleKind::Append(rows) => format!("append{rows}"),
        };
        let stem = format!(
            "{model}-{target:?}-{}-{}-{module}",
            graph.precision, graph.layout
        )
        .to_lowercase();
        let (mlir, _) = prepared::source(config, graph, kind, buckets.context);
        let (vmfb, _) =
            prepared::obtain(config, graph, kind, buckets, target, Some(compiler), cache)?;
        for (ext, bytes) in [("mlir", mlir.as_bytes()), ("vmfb", vmfb.as_slice())] {
            let path = dir.join(format!("{stem}.{ext}"));
            std::fs::write(&path, bytes).with_context(|| format!("writing {}", path.display()))?;
        }
    }
    Ok(())
}

#[cfg(not(feature = "xla-iree"))]
fn prepare(_args: &Args) -> Result<()> {
    bail!("--prepare needs the IREE backends: rebuild with `--features xla-iree`")
}

/// Opens `kind` with `options`, then for each prompt length: the prefill
/// (warm-up, then `repeat` timed runs) and `decode_tokens` greedy steps.
fn measure(
    model: &Model,
    kind: BackendKind,
    options: &BackendOptions,
    args: &Args,
) -> Result<Vec<Row>> {
    let v = model.config.vocab_size as u32;
    let setup = Instant::now();
    let mut backend = backends::open(model, kind, options)?;
    let (precision, layout, bits_per_weight) = describe(kind, options, model)?;
    let mut rows = Vec::new();
    for &prompt_tokens in &args.prompt_tokens {
        let prompt: Vec<u32> = (0..prompt_tokens as u32)
            .map(|i| (i * 7919 + 11) % v)
            .collect();
        // Warm-up: compiles (or loads) the modules this work needs.
        let logits = backend.prefill(&prompt)?;
        backend.decode_greedy(argmax(&logits))?;
        let setup_s = setup.elapsed().as_secs_f64();

        let started = Instant::now();
        let mut logits = Vec::new();
        for _ in 0..args.repeat {
            logits = backend.prefill(&prompt)?;
        }
        let prefill_s = started.elapsed().as_secs_f64() / args.repeat as f64;

        let started = Instant::now();
        let mut token = argmax(&logits);
        for _ in 0..args.decode_tokens {
            token = backend.decode_greedy(token)?;
        }
        let decode_s = started.elapsed().as_secs_f64();
        rows.push(Row {
            model: model.name.clone(),
            parameters: model.parameter_count(),
            backend: backend.name().to_string(),
            precision: precision.clone(),
            layout: layout.clone(),
            iree_flags: options.iree_flag.join(" "),
            pipelined: !options.no_pipeline,
            steps_per_call: options.steps_per_call,
            decode_weight_bytes: decode_weight_bytes(model, bits_per_weight),
            prompt_tokens,
            prefill_tokens_per_s: prompt_tokens as f64 / prefill_s,
            decode_tokens: args.decode_tokens,
            decode_tokens_per_s: args.decode_tokens as f64 / decode_s,
            setup_s,
        });
    }
    Ok(rows)
}

/// Precision and layout names of a variant, and its bits per weight.
fn describe(
    kind: BackendKind,
    options: &BackendOptions,
    model: &Model,
) -> Result<(String, String, f64)> {
    match kind {
        BackendKind::Auto => unreachable!("auto is resolved for each model first"),
        BackendKind::Cpu => return Ok(("f32".into(), "out-in".into(), 32.0)),
        // The model's own precision: its stored matrices' bits (Q8_0's
        // 34 bytes a block of 32, 8.5 bits; other blocks are multiplied as
        // f32); Q8_0's activations after `x`.
        BackendKind::CpuSimd => {
            use kiln_core::weights::Stored;
            let stored = model.weights.stored;
            let (bits, precision) = match stored {
                Stored::F16 | Stored::BF16 => (16.0, stored.to_string()),
                Stored::Blocks("Q8_0") => {
                    let activations = backends::simd_activations(options);
                    (8.5, format!("q8_0 x {}", activations.name()))
                }
                _ => (32.0, stored.to_string()),
            };
            return Ok((precision, "out-in".into(), bits));
        }
        // 4 bits a weight and an f32 scale and minimum a block of 32; the
        // activations it multiplies after `x`.
        BackendKind::CpuQ4 => {
            let activations = options
                .activations
                .map_or_else(kiln_cpu::Activations::fastest, Into::into);
            let precision = format!("q4 x {}", kiln_cpu::Activations::name(activations));
            return Ok((precision, "out-in".into(), 6.0));
        }
        BackendKind::IreeCpu | BackendKind::IreeCuda => {}
    }
    iree_graph(kind, options, model)
}

#[cfg(feature = "xla-iree")]
fn iree_graph(
    kind: BackendKind,
    options: &BackendOptions,
    model: &Model,
) -> Result<(String, String, f64)> {
    let target = backends::target(kind)?;
    let graph = backends::graph(target, options, Some(model.weights.stored))?;
    // A q4 variant names its row products where they are not the default.
    let mut precision = match options.q4_rows {
        Some(_) => format!("{}/{}", graph.precision, graph.q4_rows),
        None => graph.precision.to_string(),
    };
    // And its attention where chosen.
    if options.decode_attention.is_some() {
        precision = format!("{precision}, attention {}", graph.decode_attention);
    }
    Ok((
        precision,
        graph.layout.to_string(),
        graph.precision.bits_per_weight(),
    ))
}

#[cfg(not(feature = "xla-iree"))]
fn iree_graph(
    kind: BackendKind,
    options: &BackendOptions,
    _model: &Model,
) -> Result<(String, String, f64)> {
    // Opening reports that the backend is not compiled in.
    let _ = (kind, options);
    bail!("IREE backends need `--features xla-iree`")
}

fn main() -> std::process::ExitCode {
    kiln::bench::exit_code(run())
}

fn run() -> Result<()> {
    let args = Args::parse();
    if let Some(dir) = &args.write_model {
        return write_model(&args, dir);
    }
    if let Some(dir) = &args.write_config {
        return write_config(&args, dir);
    }
    if args.prepare {
        return prepare(&args);
    }
    if args.repeat == 0 || args.prompt_tokens.contains(&0) {
        bail!("--repeat and --prompt-tokens must be positive");
    }
    let mut rows = Vec::new();
    println!(
        "{:<14} {:>12} {:<10} {:<5} {:<7} {:>7} {:>14} {:>7} {:>13} {:>8} {:<4} {:>5}  IREE flags",
        "model",
        "parameters",
        "backend",
        "prec",
        "layout",
        "prompt",
        "prefill tok/s",
        "decode",
        "decode tok/s",
        "setup s",
        "pipe",
        "steps",
    );
    for spec in &args.model {
        let model = kiln::bench::model(spec)?;
        for &asked in &args.backend {
            let mut base = args.iree(None, None);
            base.threads = args.threads;
            let kind = backends::choose(Some(asked), &model, &base)?;
            for options in args.variants(kind) {
                for row in measure(&model, kind, &options, &args)? {
                    println!(
                        "{:<14} {:>12} {:<10} {:<5} {:<7} {:>7} {:>14.1} {:>7} {:>13.1} {:>8.2} {:<4} {:>5}  {}",
                        row.model,
                        row.parameters,
                        row.backend,
                        row.precision,
                        row.layout,
                        row.prompt_tokens,
                        row.prefill_tokens_per_s,
                        row.decode_tokens,
                        row.decode_tokens_per_s,
                        row.setup_s,
                        if row.pipelined { "on" } else { "off" },
                        row.steps_per_call,
                        row.iree_flags
                    );
                    rows.push(row);
                }
            }
        }
    }
    let json = serde_json::to_string_pretty(&rows)?;
    match &args.json {
        Some(path) => std::fs::write(path, json)?,
        None => println!("{json}"),
    }
    Ok(())
}
