//! `kiln-bench-decode`: prefill and decode throughput of backends on a model,
//! side by side in one run, as a table and as JSON.
//!
//! ```sh
//! kiln-bench-decode --backend cpu --backend iree-cpu --model embedded --model random-100m
//! ```

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Result, bail};
use clap::Parser;
use kiln::backends::{self, BackendKind, IreeOptions};
use kiln_core::sampling::argmax;
use kiln_core::{Model, ModelConfig};
use serde::Serialize;

#[derive(Parser)]
#[command(about = "Prefill and decode tokens/s of kiln backends")]
struct Args {
    /// Backends to measure (repeat the flag); each runs the same work.
    #[arg(long, value_enum, default_values_t = [BackendKind::Cpu])]
    backend: Vec<BackendKind>,
    /// `embedded`, `random-100m` or `tinyllama-1.1b` (random-weight Llamas of
    /// those sizes, made on the fly), or a model folder. Repeat for several.
    #[arg(long, default_values_t = ["embedded".to_string()])]
    model: Vec<String>,
    /// Prompt length for the prefill measurement.
    #[arg(long, default_value_t = 64)]
    prompt_tokens: usize,
    /// Greedy decode steps after the prompt.
    #[arg(long, default_value_t = 32)]
    decode_tokens: usize,
    /// Timed repetitions of the prefill (after one untimed warm-up).
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Only compile the IREE modules the run would need into the module cache
    /// (needs the compiler, not the device), then stop.
    #[arg(long)]
    prepare: bool,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    #[command(flatten)]
    iree: IreeOptions,
}

#[derive(Serialize)]
struct Row {
    model: String,
    parameters: usize,
    backend: String,
    prompt_tokens: usize,
    prefill_tokens_per_s: f64,
    decode_tokens: usize,
    decode_tokens_per_s: f64,
    setup_s: f64,
}

/// A random-weight Llama of a named shape: `random-100m` (~100M parameters:
/// 12 layers, hidden 768, GQA 12:4, vocab 32000, tied) or `tinyllama-1.1b`
/// (TinyLlama-1.1B's shape: 22 layers, hidden 2048, intermediate 5632, GQA
/// 32:4, vocab 32000, untied).
fn preset(spec: &str) -> Option<(ModelConfig, u64)> {
    let (hidden, intermediate, layers, heads, kv_heads, tied, seed) = match spec {
        "random-100m" => (768, 2048, 12, 12, 4, true, 100),
        "tinyllama-1.1b" => (2048, 5632, 22, 32, 4, false, 1100),
        _ => return None,
    };
    let config = ModelConfig {
        hidden_size: hidden,
        intermediate_size: intermediate,
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim: hidden / heads,
        vocab_size: 32_000,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        rope_scaling: None,
        tie_word_embeddings: tied,
        max_position_embeddings: 2048,
        bos_token_id: None,
        eos_token_ids: Vec::new(),
    };
    Some((config, seed))
}

fn model(spec: &str) -> Result<Model> {
    Ok(match (spec, preset(spec)) {
        ("embedded", _) => Model::embedded(),
        (_, Some((config, seed))) => Model::random(spec, config, seed),
        (dir, None) => Model::load(&PathBuf::from(dir))?,
    })
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
        let config = match (spec.as_str(), preset(spec)) {
            ("embedded", _) => Model::embedded().config,
            (_, Some((config, _))) => config,
            (dir, None) => ModelConfig::from_file(&PathBuf::from(dir).join("config.json"))?,
        };
        let context = config.max_position_embeddings.min(args.iree.max_context);
        for &kind in args.backend.iter().filter(|k| **k != BackendKind::Cpu) {
            let target = backends::target(kind)?;
            let buckets = Buckets::for_context(context);
            prepared::prepare(
                &config,
                &buckets,
                target,
                &compiler,
                &cache,
                |m, origin, took| {
                    eprintln!(
                        "{spec} {target:?} {m:?}: {origin:?} in {:.1}s",
                        took.as_secs_f64()
                    )
                },
            )?;
        }
    }
    Ok(())
}

#[cfg(not(feature = "xla-iree"))]
fn prepare(_args: &Args) -> Result<()> {
    bail!("--prepare needs the IREE backends: rebuild with `--features xla-iree`")
}

fn measure(model: &Model, kind: BackendKind, args: &Args) -> Result<Row> {
    let v = model.config.vocab_size as u32;
    let prompt: Vec<u32> = (0..args.prompt_tokens as u32)
        .map(|i| (i * 7919 + 11) % v)
        .collect();
    let setup = Instant::now();
    let mut backend = backends::open(model, kind, &args.iree)?;
    // Warm-up: compiles (or loads) the modules this work needs.
    let mut logits = backend.prefill(&prompt)?;
    backend.decode(argmax(&logits))?;
    let setup_s = setup.elapsed().as_secs_f64();

    let started = Instant::now();
    for _ in 0..args.repeat {
        logits = backend.prefill(&prompt)?;
    }
    let prefill_s = started.elapsed().as_secs_f64() / args.repeat as f64;

    let started = Instant::now();
    for _ in 0..args.decode_tokens {
        logits = backend.decode(argmax(&logits))?;
    }
    let decode_s = started.elapsed().as_secs_f64();
    Ok(Row {
        model: model.name.clone(),
        parameters: model.parameter_count(),
        backend: backend.name().to_string(),
        prompt_tokens: args.prompt_tokens,
        prefill_tokens_per_s: args.prompt_tokens as f64 / prefill_s,
        decode_tokens: args.decode_tokens,
        decode_tokens_per_s: args.decode_tokens as f64 / decode_s,
        setup_s,
    })
}

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    let args = Args::parse();
    if args.prepare {
        return prepare(&args);
    }
    if args.repeat == 0 || args.prompt_tokens == 0 {
        bail!("--repeat and --prompt-tokens must be positive");
    }
    let mut rows = Vec::new();
    println!(
        "{:<14} {:>12} {:<10} {:>7} {:>14} {:>7} {:>13} {:>8}",
        "model",
        "parameters",
        "backend",
        "prompt",
        "prefill tok/s",
        "decode",
        "decode tok/s",
        "setup s"
    );
    for spec in &args.model {
        let model = model(spec)?;
        for &kind in &args.backend {
            let row = measure(&model, kind, &args)?;
            println!(
                "{:<14} {:>12} {:<10} {:>7} {:>14.1} {:>7} {:>13.1} {:>8.2}",
                row.model,
                row.parameters,
                row.backend,
                row.prompt_tokens,
                row.prefill_tokens_per_s,
                row.decode_tokens,
                row.decode_tokens_per_s,
                row.setup_s
            );
            rows.push(row);
        }
    }
    let json = serde_json::to_string_pretty(&rows)?;
    match &args.json {
        Some(path) => std::fs::write(path, json)?,
        None => println!("{json}"),
    }
    Ok(())
}
