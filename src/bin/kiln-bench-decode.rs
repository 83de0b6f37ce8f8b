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
    /// `embedded`, `random-100m` (a ~100M-parameter random Llama made on the
    /// fly), or a model folder. Repeat for several.
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

/// ~100M parameters: 12 layers, hidden 768, GQA 12:4, vocab 32000, tied.
fn random_100m() -> Model {
    let config = ModelConfig {
        hidden_size: 768,
        intermediate_size: 2048,
        num_layers: 12,
        num_heads: 12,
        num_kv_heads: 4,
        head_dim: 64,
        vocab_size: 32_000,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        rope_scaling: None,
        tie_word_embeddings: true,
        max_position_embeddings: 2048,
        bos_token_id: None,
        eos_token_ids: Vec::new(),
    };
    Model::random("random-100m", config, 100)
}

fn model(spec: &str) -> Result<Model> {
    Ok(match spec {
        "embedded" => Model::embedded(),
        "random-100m" => random_100m(),
        dir => Model::load(&PathBuf::from(dir))?,
    })
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
