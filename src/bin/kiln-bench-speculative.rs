//! `kiln-bench-speculative`: speculative decoding against plain greedy
//! decoding in one run, per proposer, draft length K and prompt: acceptance
//! rate, mean accepted length, decode tokens/s of both, the time of each
//! kind of pass of the model (a one-token step, a multi-token step), and
//! whether the tokens are identical (they must be). A table, and JSON.
//!
//! ```sh
//! kiln-bench-speculative --model smollm2-135m-instruct --backend cpu \
//!     --draft-tokens 2 --draft-tokens 4 --draft-tokens 8 --max-tokens 128
//! ```
//!
//! The prompts are real text through the model's chat template, as `kiln
//! chat` renders them: quote, edit and summarise a given passage (where the
//! reply repeats the prompt's words), and free generation (where it does
//! not).

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Parser;
use kiln::backends::{self, BackendKind, BackendOptions};
use kiln::speculation::{self, MAX_DRAFT_TOKENS, ProposerKind};
use kiln_core::{Backend, Chat, SamplingParams, generate, generate_speculative};
use serde::Serialize;

#[derive(Parser)]
#[command(about = "Speculative decoding against greedy decoding on kiln backends")]
struct Args {
    /// A GGUF file, a model folder, a pulled model's name (`kiln list`) or
    /// `embedded`.
    #[arg(long, default_value = "smollm2-135m-instruct")]
    model: PathBuf,
    /// `auto` (the default) is what every kiln command takes by default.
    #[arg(long, value_enum, default_value_t = BackendKind::Auto)]
    backend: BackendKind,
    #[command(flatten)]
    options: BackendOptions,
    /// Proposers to measure (repeat the flag).
    #[arg(long, value_enum, default_values_t = [ProposerKind::PromptLookup])]
    proposer: Vec<ProposerKind>,
    /// The draft model of `--proposer draft`.
    #[arg(long)]
    draft_model: Option<PathBuf>,
    /// The layers of `--proposer self`'s draft (default: a quarter).
    #[arg(long)]
    draft_layers: Option<usize>,
    /// Draft lengths K to measure (repeat the flag).
    #[arg(long, default_values_t = [2, 4, 8])]
    draft_tokens: Vec<usize>,
    /// Most tokens generated per prompt.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Only these prompts (repeat; by name). Default: all.
    #[arg(long)]
    prompt: Vec<String>,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// The passage the quote, edit and summary prompts work on (written for
/// this benchmark).
const PASSAGE: &str = "A kiln is an oven for turning clay into ceramic. The potter stacks the \
dried pieces inside, closes the door and raises the heat slowly, because water left in the clay \
turns to steam and can crack a pot that is heated too fast. Most wood-fired kilns take a day or \
more to reach their highest temperature, and the firing is watched through small spy holes in \
the wall. When the fire is finally stopped, the kiln must cool for as long again before the \
door can be opened without cracking the glazes.";

/// The benchmark's prompts: (name, user message).
fn prompts() -> Vec<(&'static str, String)> {
    vec![
        (
            "quote",
            format!("Copy the following passage word for word.\n\n{PASSAGE}"),
        ),
        (
            "edit",
            format!(
                "Rewrite the following passage, replacing the word \"kiln\" with \"furnace\" \
                 everywhere and changing nothing else.\n\n{PASSAGE}"
            ),
        ),
        (
            "summarise",
            format!("Summarise the following passage in two sentences.\n\n{PASSAGE}"),
        ),
        (
            "free",
            "Write a short story about a lighthouse keeper who finds a message in a bottle."
                .to_string(),
        ),
    ]
}

#[derive(Serialize)]
struct Row {
    model: String,
    backend: String,
    prompt: String,
    prompt_tokens: usize,
    proposer: String,
    draft_tokens: usize,
    generated_tokens: usize,
    /// Passes of the target after prefill, and how many tokens they checked.
    steps: usize,
    proposed: usize,
    accepted: usize,
    /// accepted / proposed.
    acceptance_rate: f64,
    /// Accepted draft tokens per pass of the target.
    mean_accepted_length: f64,
    /// Decode tokens/s (after the first token) of plain greedy decoding and
    /// of speculative decoding, measured in the same run.
    greedy_tokens_per_s: f64,
    speculative_tokens_per_s: f64,
    speedup: f64,
    /// Milliseconds per pass, by kind: plain greedy's one-token steps, and
    /// speculation's one-token steps (no draft) and multi-token steps. A
    /// speedup with few accepted drafts comes from a multi-token step that
    /// costs less than a one-token step, not from speculation.
    greedy_ms_per_step: f64,
    speculative_ms_per_step: f64,
    speculative_ms_per_multi_token_step: f64,
    speculative_multi_token_steps: usize,
    identical_tokens: bool,
}

/// A backend that times its passes: one-token steps (`decode`,
/// `decode_greedy`) and multi-token steps (`append`, `append_greedy`).
struct PassTimer<'b, 'm> {
    inner: &'b mut (dyn Backend + 'm),
    one: Passes,
    multi: Passes,
}

#[derive(Default, Clone, Copy)]
struct Passes {
    count: usize,
    seconds: f64,
}

impl Passes {
    fn time<T>(&mut self, pass: impl FnOnce() -> T) -> T {
        let started = Instant::now();
        let result = pass();
        self.seconds += started.elapsed().as_secs_f64();
        self.count += 1;
        result
    }

    /// NaN without passes: the JSON says null, the table "-".
    fn ms_per_pass(&self) -> f64 {
        if self.count == 0 {
            f64::NAN
        } else {
            1e3 * self.seconds / self.count as f64
        }
    }
}

impl<'b, 'm> PassTimer<'b, 'm> {
    fn new(inner: &'b mut (dyn Backend + 'm)) -> Self {
        PassTimer {
            inner,
            one: Passes::default(),
            multi: Passes::default(),
        }
    }
}

impl Backend for PassTimer<'_, '_> {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn max_context(&self) -> usize {
        self.inner.max_context()
    }
    fn prefill(&mut self, tokens: &[u32]) -> kiln_core::Result<Vec<f32>> {
        self.inner.prefill(tokens)
    }
    fn prefill_embeddings(&mut self, embeddings: &[f32]) -> kiln_core::Result<Vec<f32>> {
        self.inner.prefill_embeddings(embeddings)
    }
    fn decode(&mut self, token: u32) -> kiln_core::Result<Vec<f32>> {
        self.one.time(|| self.inner.decode(token))
    }
    fn decode_greedy(&mut self, token: u32) -> kiln_core::Result<u32> {
        self.one.time(|| self.inner.decode_greedy(token))
    }
    fn sequence_len(&self) -> usize {
        self.inner.sequence_len()
    }
    fn append(&mut self, tokens: &[u32]) -> kiln_core::Result<Vec<f32>> {
        self.multi.time(|| self.inner.append(tokens))
    }
    fn append_greedy(&mut self, tokens: &[u32]) -> kiln_core::Result<Vec<u32>> {
        self.multi.time(|| self.inner.append_greedy(tokens))
    }
    fn rewind(&mut self, len: usize) -> kiln_core::Result<()> {
        self.inner.rewind(len)
    }
}

/// Tokens and the decode rate of one generation: tokens after the first
/// (which prefill gives) per second after it.
struct Timed {
    tokens: Vec<u32>,
    decode_tokens_per_s: f64,
}

fn timed(run: impl FnOnce(&mut dyn FnMut()) -> Result<Vec<u32>>) -> Result<Timed> {
    let mut first = None;
    let tokens = run(&mut || {
        first.get_or_insert_with(Instant::now);
    })?;
    let elapsed = first.map_or(0.0, |t: Instant| t.elapsed().as_secs_f64());
    Ok(Timed {
        decode_tokens_per_s: tokens.len().saturating_sub(1) as f64 / elapsed.max(1e-9),
        tokens,
    })
}

fn main() -> std::process::ExitCode {
    kiln::bench::exit_code(run())
}

fn run() -> Result<()> {
    let args = Args::parse();
    if let Some(&k) = args
        .draft_tokens
        .iter()
        .find(|&&k| k == 0 || k > MAX_DRAFT_TOKENS)
    {
        bail!("--draft-tokens {k}: each must be 1 to {MAX_DRAFT_TOKENS}");
    }
    if args.max_tokens == 0 {
        bail!("--max-tokens must be positive");
    }
    let (model, template) = kiln::chat::load_with_template(&args.model)?;
    let template = template.with_context(|| {
        format!(
            "{} has no chat template; the benchmark's prompts need one",
            args.model.display()
        )
    })?;
    let chat = Chat::new(&model, template);
    let stops = chat.stop_tokens().to_vec();
    let mut selected = prompts();
    if !args.prompt.is_empty() {
        selected.retain(|(name, _)| args.prompt.iter().any(|p| p == name));
        if selected.is_empty() {
            let names: Vec<&str> = prompts().iter().map(|(n, _)| *n).collect();
            bail!("--prompt: none of {:?} is one of {names:?}", args.prompt);
        }
    }
    let mut drafts = Vec::new();
    for &kind in &args.proposer {
        let draft = speculation::draft_model(
            Some(kind),
            &model,
            args.draft_model.as_deref(),
            args.draft_layers,
        )?;
        drafts.push((kind, draft));
    }
    // Every module the run uses is loaded first (the model's and each draft
    // model's), so that no compilation or load is timed.
    let max_k = args.draft_tokens.iter().copied().max();
    let backend_kind = backends::choose(Some(args.backend), &model, &args.options)?;
    let mut backend = backends::open_loaded(&model, backend_kind, &args.options, max_k)?;
    println!(
        "{:<10} {:>6} {:<14} {:>2} {:>5} {:>6} {:>8} {:>8} {:>10} {:>10} {:>7} {:>8} {:>8} {:>8}  identical",
        "prompt",
        "prompt",
        "proposer",
        "K",
        "gen",
        "steps",
        "accept%",
        "acc/step",
        "greedy t/s",
        "spec t/s",
        "speedup",
        "ms/step",
        "ms/1-tok",
        "ms/multi",
    );
    let mut rows = Vec::new();
    for (name, message) in &selected {
        let rendered = chat.prompt_for(message)?;
        let prompt = model.tokenizer.encode_rendered(&rendered)?;
        let room = backend.max_context().saturating_sub(prompt.len());
        if room == 0 {
            eprintln!(
                "skipped {name}: its {} tokens fill the context of {} (raise --max-context for \
                 an IREE backend)",
                prompt.len(),
                backend.max_context()
            );
            continue;
        }
        let max_tokens = args.max_tokens.min(room);
        let mut greedy_passes = PassTimer::new(backend.as_mut());
        let greedy = timed(|tick| {
            Ok(generate(
                &mut greedy_passes,
                &prompt,
                max_tokens,
                SamplingParams::default(),
                &stops,
                |_| {
                    tick();
                    Ok(())
                },
            )?)
        })?;
        let greedy_steps = greedy_passes.one;
        for (kind, draft) in &drafts {
            for &k in &args.draft_tokens {
                let mut proposer = speculation::proposer_on(*kind, draft.as_ref(), |draft| {
                    backends::open_loaded(draft, backend_kind, &args.options, max_k)
                })?;
                let mut stats = None;
                let mut passes = PassTimer::new(backend.as_mut());
                let speculative = timed(|tick| {
                    let (tokens, s) = generate_speculative(
                        &mut passes,
                        proposer.as_mut(),
                        k,
                        &prompt,
                        max_tokens,
                        SamplingParams::default(),
                        &stops,
                        |_| {
                            tick();
                            Ok(())
                        },
                    )?;
                    stats = Some(s);
                    Ok(tokens)
                })?;
                let s = stats.expect("set by the run");
                let (one, multi) = (passes.one, passes.multi);
                let row = Row {
                    model: model.name.clone(),
                    backend: backend.name().to_string(),
                    prompt: name.to_string(),
                    prompt_tokens: prompt.len(),
                    proposer: proposer.name().to_string(),
                    draft_tokens: k,
                    generated_tokens: speculative.tokens.len(),
                    steps: s.steps,
                    proposed: s.proposed,
                    accepted: s.accepted,
                    acceptance_rate: s.acceptance_rate(),
                    mean_accepted_length: s.accepted as f64 / s.steps.max(1) as f64,
                    greedy_tokens_per_s: greedy.decode_tokens_per_s,
                    speculative_tokens_per_s: speculative.decode_tokens_per_s,
                    speedup: speculative.decode_tokens_per_s / greedy.decode_tokens_per_s,
                    greedy_ms_per_step: greedy_steps.ms_per_pass(),
                    speculative_ms_per_step: one.ms_per_pass(),
                    speculative_ms_per_multi_token_step: multi.ms_per_pass(),
                    speculative_multi_token_steps: multi.count,
                    identical_tokens: speculative.tokens == greedy.tokens,
                };
                println!(
                    "{:<10} {:>6} {:<14} {:>2} {:>5} {:>6} {:>8.1} {:>8.2} {:>10.1} {:>10.1} {:>7.2} {:>8.2} {:>8.2} {:>8.2}  {}",
                    row.prompt,
                    row.prompt_tokens,
                    row.proposer,
                    row.draft_tokens,
                    row.generated_tokens,
                    row.steps,
                    100.0 * row.acceptance_rate,
                    row.mean_accepted_length,
                    row.greedy_tokens_per_s,
                    row.speculative_tokens_per_s,
                    row.speedup,
                    row.greedy_ms_per_step,
                    row.speculative_ms_per_step,
                    row.speculative_ms_per_multi_token_step,
                    if row.identical_tokens { "yes" } else { "NO" }
                );
                rows.push(row);
            }
        }
    }
    if rows.is_empty() {
        bail!("no prompt fits the context of {}", backend.max_context());
    }
    write_json(&rows, args.json.as_deref())?;
    if rows.iter().any(|r| !r.identical_tokens) {
        bail!("speculative decoding produced other tokens than greedy decoding (rows marked NO)");
    }
    Ok(())
}

fn write_json(rows: &[Row], path: Option<&Path>) -> Result<()> {
    let json = serde_json::to_string_pretty(rows)?;
    match path {
        Some(path) => {
            std::fs::write(path, json).with_context(|| format!("writing {}", path.display()))
        }
        None => {
            println!("{json}");
            Ok(())
        }
    }
}
