//! `kiln-bench-kernels`: cpu-q4's 4-bit block products alone, every kernel
//! set this CPU runs side by side in one run (f32 activations and 8-bit
//! ones), beside a plain read of the same bytes: what a product costs and
//! how near it reads at the rate one core streams memory.
//!
//! ```sh
//! # SmolLM2's gate/up product in decode, from memory (60 copies, 133 MB):
//! kiln-bench-kernels --rows 3072 --cols 576 --inputs 1 --copies 60
//! # the same in prefill, 8 rows at a time, from cache:
//! kiln-bench-kernels --rows 3072 --cols 576 --inputs 8
//! ```
//!
//! `--copies N` cycles through N copies of the matrix, so that with enough of
//! them each product reads its blocks from memory, not from a cache, as a
//! decode step does. Single-threaded; weights and inputs are random.

use std::hint::black_box;
use std::time::Instant;

use anyhow::{Result, bail};
use clap::Parser;
use kiln_core::weights::Matrix;
use kiln_cpu::inputs::Q8Inputs;
use kiln_cpu::{BLOCK, Q4Blocks, integer, kernel};

#[derive(Parser)]
#[command(about = "cpu-q4's block products, every kernel set side by side")]
struct Args {
    /// Output rows of the product.
    #[arg(long, default_value_t = 3072)]
    rows: usize,
    /// Inputs per row (a whole number of 32-weight blocks).
    #[arg(long, default_value_t = 576)]
    cols: usize,
    /// Input rows multiplied at once (1: decode).
    #[arg(long, default_value_t = 1)]
    inputs: usize,
    /// Copies of the matrix cycled through (enough: from memory).
    #[arg(long, default_value_t = 1)]
    copies: usize,
    /// Timed rounds; each times every kernel set once.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Products a figure (default: about 2·10⁹ weight-input products' worth).
    #[arg(long)]
    products: Option<usize>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.cols == 0 || !args.cols.is_multiple_of(BLOCK) || args.rows == 0 {
        bail!("--cols must be a positive multiple of {BLOCK} and --rows positive");
    }
    if args.inputs == 0 || args.copies == 0 || args.rounds == 0 || args.products == Some(0) {
        bail!("--inputs, --copies, --rounds and --products must be at least 1");
    }
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % 2001) as f32 / 1000.0 - 1.0
    };
    let w = Matrix {
        rows: args.rows,
        cols: args.cols,
        data: (0..args.rows * args.cols).map(|_| next()).collect(),
    };
    let x: Vec<f32> = (0..args.inputs * args.cols).map(|_| next()).collect();
    let copies: Vec<Q4Blocks> = (0..args.copies)
        .map(|_| Q4Blocks::quantize(&w))
        .collect::<Result<_, _>>()?;
    // Levels, scales and minimums: what a product reads of the weights.
    let bytes = copies[0].levels.len() + 8 * copies[0].scales.len();
    let plain: Vec<u64> = vec![1; bytes * args.copies / 8];
    let reps = args
        .products
        .unwrap_or((2_000_000_000 / (args.rows * args.cols * args.inputs)).max(3));
    let mut out = vec![0.0f32; args.rows * args.inputs];
    println!(
        "{}x{} product, {} input row(s), {} cop{} ({:.1} MB), {reps} products a figure",
        args.rows,
        args.cols,
        args.inputs,
        args.copies,
        if args.copies == 1 { "y" } else { "ies" },
        (bytes * args.copies) as f64 / 1e6
    );
    let report = |name: &str, seconds: f64| {
        let each = seconds / reps as f64;
        println!(
            "  {name:<28} {:>9.1} us  {:>6.1} GB/s",
            each * 1e6,
            bytes as f64 / each / 1e9
        );
    };
    for round in 1..=args.rounds {
        println!("round {round}:");
        let start = Instant::now();
        for r in 0..reps {
            // The same bytes a product reads, summed: the memory's rate.
            let share = plain.len() / args.copies;
            let part = &plain[(r % args.copies) * share..][..share];
            black_box(part.iter().fold(0u64, |a, &v| a.wrapping_add(v)));
        }
        report("plain read", start.elapsed().as_secs_f64());
        for set in kernel::available() {
            let start = Instant::now();
            for r in 0..reps {
                (set.q4_rows)(&copies[r % args.copies], 0, &x, &mut out);
            }
            report(
                &format!("f32 activations, {}", set.name),
                start.elapsed().as_secs_f64(),
            );
        }
        for set in integer::available() {
            let start = Instant::now();
            for r in 0..reps {
                // Rounded each time, as a product does.
                let q = Q8Inputs::quantize(&x, args.cols);
                (set.q4_rows)(&copies[r % args.copies], 0, &q, &mut out);
            }
            report(
                &format!("q8 activations, {}", set.name),
                start.elapsed().as_secs_f64(),
            );
        }
        black_box(&out);
    }
    Ok(())
}
