//! `kiln-bench-kernels`: cpu-q4's 4-bit block products (or, with
//! `--weights q8`, cpu-simd's Q8_0 ones, with `--weights f16` its F16
//! rows) alone, every kernel set this CPU
//! runs side by side in one run (f32 activations and 8-bit ones), beside a
//! plain read of the same bytes: what a product costs and how near it
//! reads at the rate one core streams memory.
//!
//! ```sh
//! # SmolLM2's gate/up product in decode, from memory (60 copies, 133 MB):
//! kiln-bench-kernels --rows 3072 --cols 576 --inputs 1 --copies 60
//! # the same in prefill, 8 rows at a time, from cache:
//! kiln-bench-kernels --rows 3072 --cols 576 --inputs 8
//! # its Q8_0 blocks in prefill, 128 rows (f32 rows also in tiles.rs's tiles):
//! kiln-bench-kernels --weights q8 --rows 3072 --cols 576 --inputs 128
//! # its F16 rows in decode, from memory (each one-input kernel this CPU runs):
//! kiln-bench-kernels --weights f16 --rows 3072 --cols 576 --copies 60
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
use kiln_cpu::dense::{DecodeKernel, Dense};
use kiln_cpu::inputs::Q8Inputs;
use kiln_cpu::pages::Pages;
use kiln_cpu::{BLOCK, Q4Blocks, Q8Blocks, integer, kernel, tiles};

#[derive(Parser)]
#[command(about = "cpu-q4's and cpu-simd's block products, every kernel set side by side")]
struct Args {
    /// The blocks: q4 (cpu-q4's layers, Q4_1), q8 (a Q8_0 file's in
    /// cpu-simd) or f16 (an F16 file's rows in cpu-simd).
    #[arg(long, value_parser = ["q4", "q8", "f16"], default_value = "q4")]
    weights: String,
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
    /// The f16 rows and the plain read's buffer on the system's small
    /// pages, as before cpu-simd asked for huge ones (kiln_cpu::pages).
    #[arg(long)]
    small_pages: bool,
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
    let w = Matrix::new(
        args.rows,
        args.cols,
        (0..args.rows * args.cols).map(|_| next()).collect(),
    );
    let x: Vec<f32> = (0..args.inputs * args.cols).map(|_| next()).collect();
    let copies: Vec<Q4Blocks> = match args.weights.as_str() {
        "q4" => (0..args.copies)
            .map(|_| Q4Blocks::quantize(&w))
            .collect::<Result<_, _>>()?,
        _ => Vec::new(),
    };
    let q8_copies: Vec<Q8Blocks> = match args.weights.as_str() {
        "q8" => (0..args.copies)
            .map(|_| Q8Blocks::quantize(&w))
            .collect::<Result<_, _>>()?,
        _ => Vec::new(),
    };
    // As cpu-simd keeps a model's matrices: one after another on huge pages.
    let mut pages = match args.small_pages {
        true => Pages::on_small_pages(),
        false => Pages::new(),
    };
    let dense_copies: Vec<Dense> = match args.weights.as_str() {
        "f16" => {
            // Each weight cut to f16's 11 significant bits (all of them
            // normal f16s: none is below 0.001 in magnitude but 0), so the
            // rows are kept at f16.
            let halves = Matrix::new(
                w.rows,
                w.cols,
                w.f32()
                    .iter()
                    .map(|&v| f32::from_bits(v.to_bits() & 0xffff_e000))
                    .collect(),
            );
            let copies: Vec<Dense> = (0..args.copies)
                .map(|_| Dense::stack_in(&mut pages, &[&halves]))
                .collect();
            if copies[0].precision() != "f16" {
                bail!(
                    "the weights were not kept at f16 but {}",
                    copies[0].precision()
                );
            }
            copies
        }
        _ => Vec::new(),
    };
    // Levels, scales and minimums (8-bit values and scales, 16-bit rows):
    // what a product reads of the weights.
    let bytes = match (copies.first(), q8_copies.first()) {
        (Some(q4), _) => q4.levels.len() + 8 * q4.scales.len(),
        (_, Some(q8)) => q8.values.len() + 4 * q8.scales.len(),
        _ => 2 * args.rows * args.cols,
    };
    let words = bytes * args.copies / 8;
    let plain = pages.store(words, std::iter::repeat_n(1u64, words));
    let reps = args
        .products
        .unwrap_or((2_000_000_000 / (args.rows * args.cols * args.inputs)).max(3));
    let mut out = vec![0.0f32; args.rows * args.inputs];
    println!(
        "{}x{} {} product, {} input row(s), {} cop{} ({:.1} MB), {reps} products a figure",
        args.rows,
        args.cols,
        args.weights,
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
        if !dense_copies.is_empty() {
            dense_round(&args, &dense_copies, &x, &mut out, reps, &report);
            continue;
        }
        let q4 = !copies.is_empty();
        for set in kernel::available() {
            let start = Instant::now();
            for r in 0..reps {
                match q4 {
                    true => (set.q4_rows)(&copies[r % args.copies], 0, &x, &mut out),
                    false => (set.q8_rows)(&q8_copies[r % args.copies], 0, &x, &mut out),
                }
            }
            report(
                &format!("f32 activations, {}", set.name),
                start.elapsed().as_secs_f64(),
            );
        }
        if !q4 {
            // cpu-simd's f32 prefill: rows widened once into tiles.
            let start = Instant::now();
            for r in 0..reps {
                let m = &q8_copies[r % args.copies];
                out.fill(0.0);
                tiles::product_here(m.cols, 0, &x, &mut out, |r, c, values| {
                    m.widen(r, c, values)
                });
            }
            report("f32 activations, tiles", start.elapsed().as_secs_f64());
        }
        for set in integer::available() {
            let start = Instant::now();
            for r in 0..reps {
                // Rounded each time, as a product does.
                let q = Q8Inputs::quantize(&x, args.cols);
                match q4 {
                    true => (set.q4_rows)(&copies[r % args.copies], 0, &q, &mut out),
                    false => (set.q8_rows)(&q8_copies[r % args.copies], 0, &q, &mut out),
                }
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

/// One round of `--weights f16`: each one-input kernel this CPU runs (with
/// one input), or the tiles (several).
fn dense_round(
    args: &Args,
    copies: &[Dense],
    x: &[f32],
    out: &mut [f32],
    reps: usize,
    report: &dyn Fn(&str, f64),
) {
    if args.inputs > 1 {
        let start = Instant::now();
        for r in 0..reps {
            copies[r % copies.len()].rows(0, x, out);
        }
        return report("f16 rows, tiles", start.elapsed().as_secs_f64());
    }
    for &kernel in DecodeKernel::ALL.iter().filter(|k| k.available()) {
        let start = Instant::now();
        for r in 0..reps {
            copies[r % copies.len()].one_input(kernel, 0, x, out);
        }
        report(
            &format!("f16 rows, {kernel:?}"),
            start.elapsed().as_secs_f64(),
        );
    }
    black_box(&out);
}
