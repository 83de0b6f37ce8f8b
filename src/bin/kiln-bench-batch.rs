//! The batched decode step on its own: for each slot count, every slot
//! holds a sequence and every step decodes all of them greedily, the way
//! `kiln-server` steps under load but without HTTP, tokenizers or
//! admissions between steps. Prints each slot count's step time and tokens/s
//! beside one slot's, so the batch's own gain (or its cost at one row)
//! shows apart from the server's, and the time it took to admit every slot
//! (together, as the server admits the requests waiting at a step, or one
//! at a time with `--admit-alone`).
//!
//! ```sh
//! kiln-bench-batch --backend iree-cuda --model /tmp/kiln-tinyllama-1.1b \
//!     --max-context 256 --slots 1 --slots 8 --slots 32
//! ```

use std::path::PathBuf;

use anyhow::{Result, bail};
use clap::Parser;
use kiln::backends::{BackendKind, BackendOptions};
use serde::Serialize;

/// Times the IREE backends' batched decode step at several slot counts.
#[derive(Parser)]
struct Args {
    /// `iree-cpu` or `iree-cuda`.
    #[arg(long, value_enum)]
    backend: BackendKind,
    /// A model folder, a GGUF file, a pulled model's name, or a random-weight
    /// preset (`tinyllama-1.1b`, `smollm2-135m`, …).
    #[arg(long)]
    model: String,
    /// Slot counts to measure (repeat for several); each runs with all its
    /// slots busy.
    #[arg(long = "slots", default_values_t = [1, 8, 32])]
    slots: Vec<usize>,
    /// Slots that hold a sequence, the lowest ones (default: all of them).
    /// `--busy 1` is a lone request on a server with that many slots: it
    /// should step as fast as one slot does.
    #[arg(long)]
    busy: Option<usize>,
    /// Prompt tokens of each sequence (prefilled once, before timing).
    #[arg(long, default_value_t = 16)]
    prompt_tokens: usize,
    /// Timed steps per slot count, after two untimed ones.
    #[arg(long, default_value_t = 64)]
    steps: usize,
    /// Admit the slots one at a time (each prompt prefilled alone), not
    /// together.
    #[arg(long)]
    admit_alone: bool,
    #[command(flatten)]
    backend_options: BackendOptions,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Serialize)]
struct Row {
    slots: usize,
    /// Slots holding a sequence.
    busy: usize,
    /// Admitting every slot, from the first prefill to the last first token.
    admit_ms: f64,
    steps: usize,
    step_ms: f64,
    tokens_per_s: f64,
}

fn main() -> std::process::ExitCode {
    kiln::bench::exit_code(run())
}

fn run() -> Result<()> {
    let args = Args::parse();
    if !matches!(args.backend, BackendKind::IreeCpu | BackendKind::IreeCuda) {
        bail!("the batched step is the IREE backends': use --backend iree-cpu or iree-cuda");
    }
    if args.steps == 0 || args.prompt_tokens == 0 || args.busy == Some(0) {
        bail!("--steps, --prompt-tokens and --busy must be positive");
    }
    if let Some(busy) = args.busy
        && let Some(&slots) = args.slots.iter().find(|&&slots| busy > slots)
    {
        bail!("--busy {busy} is more than the {slots} slots");
    }
    let needed = args.prompt_tokens + args.steps + 2;
    if needed > args.backend_options.max_context {
        bail!(
            "{} prompt tokens and {} steps (and two warm-up steps) need a context of {needed}; \
             raise --max-context",
            args.prompt_tokens,
            args.steps
        );
    }
    let rows = measure(&args)?;
    println!(
        "{:>6} {:>5} {:>9} {:>7} {:>9} {:>12} {:>10}",
        "slots", "busy", "admit ms", "steps", "step ms", "tokens/s", "x 1 slot"
    );
    let one = rows.iter().find(|r| r.slots == 1).map(|r| r.tokens_per_s);
    for row in &rows {
        let gain = one.map_or("—".to_string(), |one| {
            format!("{:.2}", row.tokens_per_s / one)
        });
        println!(
            "{:>6} {:>5} {:>9.2} {:>7} {:>9.3} {:>12.1} {:>10}",
            row.slots, row.busy, row.admit_ms, row.steps, row.step_ms, row.tokens_per_s, gain
        );
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&rows)?)?;
    }
    Ok(())
}

#[cfg(feature = "xla-iree")]
fn measure(args: &Args) -> Result<Vec<Row>> {
    use kiln_core::sampling::argmax;
    use kiln_xla::{Admission, BatchedDecoder, Choice, SlotOutput};
    use std::time::Instant;

    let model = kiln::bench::model(&args.model)?;
    let v = model.config.vocab_size as u32;
    let mut rows = Vec::new();
    for &slots in &args.slots {
        let backend = kiln::backends::open_iree(&model, args.backend, &args.backend_options)?;
        let mut decoder = BatchedDecoder::new(backend, slots)?;
        decoder.prepare(|_, _| {})?;
        let busy = args.busy.unwrap_or(slots);
        // A different prompt per slot, so that the rows differ.
        let prompts: Vec<Vec<u32>> = (0..busy as u32)
            .map(|slot| {
                (0..args.prompt_tokens as u32)
                    .map(|i| (i * 7919 + 11 + 104_729 * slot) % v)
                    .collect()
            })
            .collect();
        let admitted = Instant::now();
        let logits: Vec<Vec<f32>> = match args.admit_alone {
            true => (0..busy)
                .map(|slot| decoder.admit(slot, &prompts[slot], Choice::Greedy))
                .collect::<kiln_core::Result<_>>()?,
            false => decoder
                .admit_all(&Admission::in_order(&prompts, Choice::Greedy))
                .into_iter()
                .collect::<kiln_core::Result<_>>()?,
        };
        let admit_ms = admitted.elapsed().as_secs_f64() * 1e3;
        for (slot, logits) in logits.iter().enumerate() {
            decoder.feed(slot, argmax(logits))?;
        }
        let step = |decoder: &mut BatchedDecoder| -> Result<()> {
            for (slot, output) in decoder.step()? {
                let SlotOutput::Token(token) = output else {
                    bail!("a greedy slot returned logits");
                };
                decoder.feed(slot, token)?;
            }
            Ok(())
        };
        step(&mut decoder)?;
        step(&mut decoder)?;
        let started = Instant::now();
        for _ in 0..args.steps {
            step(&mut decoder)?;
        }
        let seconds = started.elapsed().as_secs_f64();
        rows.push(Row {
            slots,
            busy,
            admit_ms,
            steps: args.steps,
            step_ms: seconds * 1e3 / args.steps as f64,
            tokens_per_s: (busy * args.steps) as f64 / seconds,
        });
    }
    Ok(rows)
}

#[cfg(not(feature = "xla-iree"))]
fn measure(_args: &Args) -> Result<Vec<Row>> {
    bail!("the batched step needs the IREE backends: rebuild with `--features xla-iree`")
}
