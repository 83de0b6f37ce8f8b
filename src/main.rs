//! `kiln`: the command line of the kiln inference engine.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Result;
use clap::{Parser, Subcommand};
use kiln_core::{Model, SamplingParams, TextStream};

use kiln::backends::{self, ModelArgs};
use kiln::print_text;
use kiln::speculation::SpeculationArgs;

#[derive(Parser)]
#[command(
    name = "kiln",
    version,
    about = "A Llama-family inference engine with an ahead-of-time compiled OpenXLA/IREE path"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text after a prompt, streaming it to stdout.
    Generate {
        #[command(flatten)]
        model: ModelArgs,
        /// The prompt.
        #[arg(default_value = "Once upon a time")]
        prompt: String,
        #[arg(long, default_value_t = 32)]
        max_tokens: usize,
        /// 0 for greedy decoding.
        #[arg(long, default_value_t = 0.0)]
        temperature: f32,
        /// Sample from the k most likely tokens only (0: all).
        #[arg(long, default_value_t = 0)]
        top_k: usize,
        /// Sample from the smallest set of tokens whose probability reaches p.
        #[arg(long, default_value_t = 1.0)]
        top_p: f32,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        #[command(flatten)]
        speculation: SpeculationArgs,
    },
    /// Chat with a model through its chat template: answer QUESTION, or hold
    /// a conversation on the terminal (Ctrl-D ends), or answer each line of
    /// piped input in one conversation. Without --model: the pinned
    /// smollm2-135m-instruct, pulled on first use (`kiln pull`).
    Chat(ChatArgs),
    /// Run the prompt once and print the most likely next tokens and their logits.
    Prefill {
        #[command(flatten)]
        model: ModelArgs,
        #[arg(default_value = "Once upon a time")]
        prompt: String,
        /// How many candidates to print.
        #[arg(long, default_value_t = 5)]
        top: usize,
    },
    /// Compile and cache the IREE modules of a model for a backend ahead of time.
    Prepare {
        #[command(flatten)]
        model: ModelArgs,
        /// Also the batched decode modules of `kiln-server --batch-slots N`
        /// (for a GPU machine that has no compiler).
        #[arg(long, default_value_t = 1)]
        batch_slots: usize,
        /// Also the multi-token modules of `--speculate … --draft-tokens K`
        /// up to this K.
        #[arg(long, value_parser = clap::value_parser!(u16).range(1..=kiln::speculation::MAX_DRAFT_TOKENS as i64))]
        draft_tokens: Option<u16>,
    },
    /// Download a pinned model into the cache (sha256-verified).
    Pull {
        /// The model's name, as `kiln list` prints it.
        name: String,
        /// Hash a pulled copy again even if its stamp vouches for it; a
        /// damaged one is replaced.
        #[arg(long)]
        verify: bool,
    },
    /// List the pinned models and whether each is pulled.
    List,
    /// Report the model, the IREE runtime and compiler, and the devices found.
    Inspect {
        /// A GGUF file, a model folder or a pulled model's name; the embedded
        /// model when left out.
        #[arg(long)]
        model: Option<PathBuf>,
    },
}

#[derive(clap::Args)]
struct ChatArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The question; read turns from stdin when left out.
    question: Option<String>,
    #[command(flatten)]
    options: kiln::chat::ChatOptions,
}

fn main() -> ExitCode {
    // Chat templates are rendered in a child: this executable, asked so.
    kiln_core::chat_template::serve_child_if_asked();
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn load(path: Option<&PathBuf>) -> Result<Model> {
    backends::load_model(path.map(PathBuf::as_path))
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Generate {
            model,
            prompt,
            max_tokens,
            temperature,
            top_k,
            top_p,
            seed,
            speculation,
        } => {
            let sampling = SamplingParams {
                temperature,
                top_k,
                top_p,
                seed,
            };
            speculation.check()?;
            generate(&model, &prompt, max_tokens, sampling, &speculation)
        }
        Command::Chat(args) => chat(&args),
        Command::Prefill { model, prompt, top } => prefill(&model, &prompt, top),
        Command::Prepare {
            model,
            batch_slots,
            draft_tokens,
        } => prepare(&model, batch_slots, draft_tokens.map(usize::from)),
        Command::Pull { name, verify } => kiln::pull::pull(&name, verify),
        Command::List => kiln::pull::list(),
        Command::Inspect { model } => inspect(model.as_ref()),
    }
}

fn generate(
    args: &ModelArgs,
    prompt: &str,
    max_tokens: usize,
    sampling: SamplingParams,
    speculation: &SpeculationArgs,
) -> Result<()> {
    let model = load(args.model.as_ref())?;
    let prompt_ids = model.tokenizer.encode(prompt)?;
    let draft = speculation.draft_model(&model)?;
    let kind = args.choose(&model)?;
    let mut backend = backends::open(&model, kind, &args.options)?;
    let started = Instant::now();
    let mut first_token_at = None;
    let mut text = TextStream::new(&model.tokenizer);
    let mut stdout = std::io::stdout().lock();
    let on_token = |token| {
        first_token_at.get_or_insert_with(Instant::now);
        print_text(&mut stdout, text.push(token)?.as_deref())
    };
    let stops = &model.config.eos_token_ids;
    let (tokens, stats) = match speculation.speculate {
        None => (
            kiln_core::generate(
                backend.as_mut(),
                &prompt_ids,
                max_tokens,
                sampling,
                stops,
                on_token,
            )?,
            None,
        ),
        Some(speculate) => {
            let mut proposer =
                kiln::speculation::proposer(speculate, draft.as_ref(), kind, &args.options)?;
            let (tokens, stats) = kiln_core::generate_speculative(
                backend.as_mut(),
                proposer.as_mut(),
                usize::from(speculation.draft_tokens),
                &prompt_ids,
                max_tokens,
                sampling,
                stops,
                on_token,
            )?;
            (tokens, Some(stats))
        }
    };
    print_text(&mut stdout, text.finish()?.as_deref())?;
    writeln!(stdout)?;
    let total = started.elapsed().as_secs_f64();
    let prefill = first_token_at.map_or(total, |t| (t - started).as_secs_f64());
    eprintln!(
        "[{}: {} prompt tokens, {} generated in {:.3}s; prefill {:.3}s, decode {:.1} tok/s]",
        backend.name(),
        prompt_ids.len(),
        tokens.len(),
        total,
        prefill,
        (tokens.len().saturating_sub(1)) as f64 / (total - prefill).max(1e-9)
    );
    if let Some(s) = stats {
        eprintln!(
            "[speculation: {} steps after prefill, {} of {} proposed tokens accepted ({:.1}%), \
             {:.2} tokens per step]",
            s.steps,
            s.accepted,
            s.proposed,
            100.0 * s.acceptance_rate(),
            s.tokens_per_step()
        );
    }
    Ok(())
}

fn chat(args: &ChatArgs) -> Result<()> {
    let (model, template) = match &args.model.model {
        Some(path) => kiln::chat::load(path)?,
        None => kiln::chat::default_model()?,
    };
    let mut backend = backends::open(&model, args.model.choose(&model)?, &args.model.options)?;
    kiln::chat::run(
        &model,
        template,
        backend.as_mut(),
        args.question.as_deref(),
        &args.options,
    )
}

fn prefill(args: &ModelArgs, prompt: &str, top: usize) -> Result<()> {
    let model = load(args.model.as_ref())?;
    let ids = model.tokenizer.encode(prompt)?;
    let mut backend = backends::open(&model, args.choose(&model)?, &args.options)?;
    let logits = backend.prefill(&ids)?;
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    println!(
        "{} prompt tokens on {}; next-token candidates:",
        ids.len(),
        backend.name()
    );
    for &i in order.iter().take(top) {
        let text = model.tokenizer.decode(&[i as u32])?;
        // A token holding part of a character decodes alone as U+FFFD; its
        // vocabulary entry tells such tokens apart.
        let entry = model
            .tokenizer
            .vocabulary_entry(i as u32)
            .filter(|_| text.contains('\u{fffd}'))
            .map(|entry| format!(" (vocabulary entry {entry:?})"))
            .unwrap_or_default();
        println!("{i:>8}  {:>12.6}  {text:?}{entry}", logits[i]);
    }
    Ok(())
}

/// Compiles every module of the model for the backend's target into the
/// module cache. Needs the compiler, not the device: modules for a GPU can be
/// prepared here and the cache carried to the GPU machine.
#[cfg(feature = "xla-iree")]
fn prepare(args: &ModelArgs, batch_slots: usize, draft_tokens: Option<usize>) -> Result<()> {
    use anyhow::Context;
    use indicatif::{ProgressBar, ProgressStyle};
    // Modules are prepared for a target named, not for the device this
    // machine happens to have (they are often carried to another).
    let kind = match args.backend {
        None | Some(backends::BackendKind::Auto) => anyhow::bail!(
            "prepare compiles modules for an IREE target: pass --backend iree-cpu or iree-cuda"
        ),
        Some(
            kind @ (backends::BackendKind::Cpu
            | backends::BackendKind::CpuQ4
            | backends::BackendKind::CpuSimd),
        ) => {
            anyhow::bail!(
                "the {} backend has nothing to prepare; pass --backend iree-cpu or iree-cuda",
                kind.name()
            )
        }
        Some(kind) => kind,
    };
    if batch_slots > kiln_xla::MAX_SLOTS {
        anyhow::bail!(
            "--batch-slots {batch_slots}: kiln-server batches at most {} slots; lower it",
            kiln_xla::MAX_SLOTS
        );
    }
    kiln_xla::check_steps_per_call(args.options.steps_per_call)?;
    let model = load(args.model.as_ref())?;
    let target = backends::target(kind)?;
    let buckets = backends::buckets(&model, &args.options)?;
    let mut graph = backends::graph(target, &args.options, Some(model.weights.stored))?;
    backends::say_stored_precision(&args.options, model.weights.stored);
    let config = backends::prepared_config(
        &model.config,
        target,
        &mut graph,
        args.options.tensor_parallel,
    )?;
    let compiler = kiln_xla::Compiler::from_env()?;
    let cache = kiln_xla::ModuleCache::default_location()?;
    let started = Instant::now();
    let mut kinds = kiln_xla::prepared::module_kinds(&buckets, args.options.steps_per_call);
    kinds.extend(kiln_xla::prepared::batch_module_kinds(
        &buckets,
        batch_slots,
    ));
    if let Some(k) = draft_tokens {
        kinds.extend(kiln_xla::prepared::append_module_kinds(k));
    }
    let bar = ProgressBar::new(kinds.len() as u64).with_style(
        ProgressStyle::with_template(
            "{spinner} preparing modules {bar:30} {pos}/{len} [{elapsed}]",
        )
        .context("progress template")?,
    );
    bar.enable_steady_tick(std::time::Duration::from_millis(200));
    kiln_xla::prepared::prepare_kinds(
        &config,
        &graph,
        &kinds,
        &buckets,
        target,
        &compiler,
        &cache,
        |kind, origin, took| {
            // Printed beside the bar, and also when stderr is not a terminal.
            bar.suspend(|| eprintln!("{kind:?}: {origin:?} in {:.2}s", took.as_secs_f64()));
            bar.inc(1);
        },
    )?;
    bar.finish_and_clear();
    println!(
        "prepared {} for {:?} at {} with {} weights (context {}, prefill buckets {:?}) in {:.2}s; cache: {}",
        model.name,
        target,
        graph.precision,
        graph.layout,
        buckets.context,
        buckets.prefill,
        started.elapsed().as_secs_f64(),
        cache.dir().display()
    );
    Ok(())
}

#[cfg(not(feature = "xla-iree"))]
fn prepare(args: &ModelArgs, _batch_slots: usize, _draft_tokens: Option<usize>) -> Result<()> {
    // Opening the backend reports what is not compiled in.
    let model = load(args.model.as_ref())?;
    let kind = args.backend.unwrap_or(backends::BackendKind::Auto);
    backends::open(&model, kind, &args.options)?;
    anyhow::bail!(
        "the {} backend has nothing to prepare; pass --backend iree-cpu or iree-cuda",
        kind.name()
    )
}

fn inspect(model: Option<&PathBuf>) -> Result<()> {
    println!("kiln built for:        {}", env!("KILN_TARGET"));
    let model = load(model)?;
    let c = &model.config;
    let parameters = model.parameter_count();
    println!(
        "model:                 {} ({parameters} parameters)",
        model.name
    );
    println!(
        "  family {}: layers {}, hidden {}, intermediate {}, heads {}/{} (q/kv), head dim {}, vocab {}, context {}",
        c.family.model_type(),
        c.num_layers,
        c.hidden_size,
        c.intermediate_size,
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
        c.vocab_size,
        c.context_limit()
    );
    let rope = match &c.rope_scaling {
        None => "none".to_string(),
        Some(kiln_core::RopeScaling::Linear { factor }) => format!("linear x{factor}"),
        Some(kiln_core::RopeScaling::Llama3 { factor, .. }) => format!("llama3 x{factor}"),
    };
    println!(
        "  rope theta {}, scaling {rope}, tied output {}, q/k/v biases {}, sliding window {}",
        c.rope_theta,
        c.tie_word_embeddings,
        c.qkv_bias,
        match c.sliding_window {
            Some(w) if w < c.max_position_embeddings => format!(
                "{w} (kiln runs it up to {w} positions, where attention is full; \
                 max_position_embeddings {})",
                c.max_position_embeddings
            ),
            Some(w) => format!("{w} (wider than the context: full attention)"),
            None => "none".into(),
        }
    );
    let activations = kiln_cpu::Activations::fastest();
    println!(
        "cpu-q4 kernels:        {} (f32 activations), {} (q8 activations); default activations {}",
        kiln_cpu::kernel::best().name,
        kiln_cpu::integer::best().name,
        activations.name()
    );
    iree_report()
}

#[cfg(feature = "xla-iree")]
fn iree_report() -> Result<()> {
    use kiln_iree::Instance;
    use kiln_xla::Compiler;
    println!("IREE runtime revision: {}", kiln_iree::RUNTIME_REVISION);
    println!("IREE prefix drivers:   {}", kiln_iree::PREFIX_HAL_DRIVERS);
    println!("IREE prefix target:    {}", kiln_iree::PREFIX_TARGET);
    match Compiler::from_env() {
        Ok(compiler) => println!(
            "iree-compile:          {} ({})",
            compiler.version_line(),
            compiler.path().display()
        ),
        Err(error) => println!("iree-compile:          unavailable: {error}"),
    }
    let instance = Instance::new()?;
    for driver in instance.drivers()? {
        match instance.device(&driver) {
            Ok(_) => println!("device {driver:<12} available"),
            Err(error) => println!("device {driver:<12} unavailable: {error}"),
        }
    }
    Ok(())
}

#[cfg(not(feature = "xla-iree"))]
fn iree_report() -> Result<()> {
    println!(
        "IREE backend:          not compiled in (build with --features xla-iree or cuda,xla-iree)"
    );
    Ok(())
}
