//! Kernels of kiln's own, for what IREE's code generation does not make
//! fast: CUDA C under `crates/kiln-xla/kernels/`, compiled to PTX by `cargo
//! xtask kernels` (the PTX is committed beside its source, so a build needs
//! no CUDA compiler), embedded in the modules that dispatch them
//! ([`Function::dispatch_extern`]) and assembled for the real GPU by its
//! driver at load time, as IREE's own kernels are.

use crate::q4::BLOCK;
use crate::stablehlo::{ExternDispatch, ExternObject, Function, Ty, Val};

/// The one-row q4 product (`kernels/q4_row.cu`).
pub static Q4_ROW: ExternObject = ExternObject {
    name: "kiln_q4_row",
    ptx: include_str!("../kernels/q4_row.ptx"),
};

/// [`Q4_ROW`]'s only entry point; rows a warp are its last constant. IREE
/// links every `hal.dispatch.extern` of one object in a module into one
/// executable that exports the first dispatch's entry only, and every
/// dispatch runs it: with an entry per row count, the products of two and
/// four rows a warp ran the one-row code over a grid made for more rows
/// and left half or three quarters of their outputs unwritten (found on an
/// H100, 2026-12-05: NaN and infinite logits on random-100m).
pub const Q4_ROW_ENTRY: &str = "kiln_q4_row";

/// Every object a module may dispatch: [`crate::stablehlo::module`] adds
/// the ones its functions use.
pub static OBJECTS: [&ExternObject; 1] = [&Q4_ROW];

/// Warps in one of [`Q4_ROW`]'s workgroups (`WARPS` in the source).
const Q4_ROW_WARPS: usize = 8;

/// The fewest workgroups a [`Q4_ROW`] product is given before a warp takes
/// more than one row: about two per SM of an H200 (132). Rows per warp
/// share the warp's rounding of the row; workgroups keep the SMs' loads in
/// flight.
const Q4_ROW_MIN_WORKGROUPS: usize = 256;

/// Rows a warp takes in a product of `out` outputs: 4, 2 or 1, the most
/// that still gives [`Q4_ROW_MIN_WORKGROUPS`].
pub fn q4_rows_per_warp(out: usize) -> usize {
    [4, 2]
        .into_iter()
        .find(|rows| out.div_ceil(rows * Q4_ROW_WARPS) >= Q4_ROW_MIN_WORKGROUPS)
        .unwrap_or(1)
}

/// The RMSNorm a [`q4_row`] product applies to its row.
pub struct RowNorm<'a> {
    pub eps: f32,
    /// `[in]` f16.
    pub weight: &'a Val,
}

/// One f32 row `x` `[in]` times q4 weights (`quants` `[out, in / BLOCK,
/// BLOCK]` i4, `scales` and `offsets` `[out, in / BLOCK]` f16) with
/// [`Q4_ROW`]: `[out]` f32. The kernel rounds each block of the row to
/// 16-bit levels, as the CPU graph's integer product does. With `norm`,
/// the product is that of the RMSNorm'd row: the kernel reads the whole
/// row anyway, so it multiplies it by the norm's weight as it rounds it,
/// sums its squares and scales its outputs by `1 / sqrt(mean(x²) + eps)`.
/// That spares the step the norm's reduction and scaling kernels, and the
/// matrix keeps its blocks as given (no norm weight folded into them).
pub fn q4_row(
    f: &mut Function,
    quants: &Val,
    scales: &Val,
    offsets: &Val,
    x: &Val,
    norm: Option<RowNorm>,
) -> Val {
    let (out, blocks) = (quants.shape[0], quants.shape[1]);
    assert_eq!(quants.shape[2], BLOCK, "q4_row: block width");
    assert_eq!(x.shape, [blocks * BLOCK], "q4_row: row shape");
    // The kernel indexes blocks in 32 bits.
    assert!(out * blocks < 1 << 32, "q4_row: {out}x{blocks} blocks");
    // eps 0 says "no norm", and the weight binding is then not read: the
    // scales stand in for it. An RMSNorm's eps is positive.
    let (eps_bits, weight) = match &norm {
        Some(RowNorm { eps, weight }) => {
            assert!(*eps > 0.0, "q4_row: eps {eps}");
            assert_eq!(weight.shape, [blocks * BLOCK], "q4_row: norm weight shape");
            assert_eq!(weight.ty, Ty::F16, "q4_row: norm weight type");
            (eps.to_bits(), *weight)
        }
        None => (0, scales),
    };
    let rows = q4_rows_per_warp(out);
    let bytes = f.i4_as_bytes(quants);
    f.dispatch_extern(
        &ExternDispatch {
            object: &Q4_ROW,
            // One entry for every row count (see `Q4_ROW_ENTRY`).
            entry: Q4_ROW_ENTRY,
            workgroups: out.div_ceil(rows * Q4_ROW_WARPS),
            workgroup_size: Q4_ROW_WARPS * 32,
            constants: &[out as u32, blocks as u32, rows as u32, eps_bits],
        },
        &[&bytes, scales, offsets, x, weight],
        &[out],
        Ty::F32,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The products of the shapes kiln serves get at least two workgroups
    /// an SM where they have the rows for it, and the most rows a warp
    /// that allows.
    #[test]
    fn q4_rows_per_warp_keep_the_gpu_busy() {
        // TinyLlama: qkv, o and down, then gate-up and the head.
        assert_eq!(q4_rows_per_warp(2560), 1);
        assert_eq!(q4_rows_per_warp(2048), 1);
        assert_eq!(q4_rows_per_warp(11264), 4);
        assert_eq!(q4_rows_per_warp(32000), 4);
        // Llama-3.1-8B's qkv, and random-100m's gate-up (the GPU test's).
        assert_eq!(q4_rows_per_warp(6144), 2);
        assert_eq!(q4_rows_per_warp(4096), 2);
        // Too few outputs for even one workgroup an SM.
        assert_eq!(q4_rows_per_warp(64), 1);
    }

    /// `kernels/q4_row.cu`'s arithmetic built for the host
    /// (`q4_row_host.cpp`, the GPU instructions as the PTX ISA defines
    /// them, every lane of the grid in turn) against the exact product
    /// within what rounding the row to 16-bit levels allows, at 1, 2 and 4
    /// rows a warp: a last warp with rows past the end, lanes with no block
    /// and lanes with two, blocks of very different magnitudes and of zeros.
    /// The instructions themselves run on a GPU only
    /// (`cuda::q4_kernel_on_the_gpu_matches_the_reference`).
    #[test]
    fn q4_row_arithmetic_on_the_host_is_within_the_rows_rounding() {
        use std::io::Write;
        use std::process::{Command, Stdio};
        let dir = tempfile::tempdir().unwrap();
        let exe = dir.path().join("q4_row_host");
        let source = concat!(env!("CARGO_MANIFEST_DIR"), "/kernels/q4_row_host.cpp");
        let compiler = std::env::var("CXX").unwrap_or_else(|_| "c++".to_string());
        let status = Command::new(&compiler)
            .args(["-O2", "-std=c++17", "-ffp-contract=off", "-Wall", "-Werror"])
            .args(["-Wno-unknown-pragmas", "-o"])
            .arg(&exe)
            .arg(source)
            .status()
            .unwrap_or_else(|e| panic!("cannot run the C++ compiler {compiler}: {e}"));
        assert!(status.success(), "{compiler} failed on {source}");
        for (rows_per_warp, outputs, blocks) in [
            (1, 37, 3),
            (2, 300, 40),
            (4, 300, 40),
            (4, 70, 1),
            (2, 20, 448),
            (1, 9, 449),
            (1, 10, 300),
        ] {
            let (q, x) = crate::q4::row_check::case(outputs, blocks);
            // Without the norm, then with it (both paths: the shared row's
            // and the per-lane one's 449 blocks).
            // The norm's weights: f16 values from 0.25 to 1.75.
            let weight: Vec<half::f16> = (0..x.len())
                .map(|i| half::f16::from_f32(0.25 + (i % 7) as f32 * 0.25))
                .collect();
            for eps in [None, Some(1e-5f32)] {
                let mut input = Vec::new();
                let eps_bits = eps.map_or(0, f32::to_bits);
                for v in [rows_per_warp, outputs as u32, blocks as u32, eps_bits] {
                    input.extend(v.to_le_bytes());
                }
                input.extend(&q.quants);
                for v in q.scales.iter().chain(&q.offsets) {
                    input.extend(v.to_bits().to_le_bytes());
                }
                for v in &x {
                    input.extend(v.to_le_bytes());
                }
                if eps.is_some() {
                    for w in &weight {
                        input.extend(w.to_bits().to_le_bytes());
                    }
                }
                let mut child = Command::new(&exe)
                    .stdin(Stdio::piped())
                    .stdout(Stdio::piped())
                    .spawn()
                    .unwrap();
                child.stdin.take().unwrap().write_all(&input).unwrap();
                let out = child.wait_with_output().unwrap();
                assert!(out.status.success(), "{:?}", out.status);
                let got: Vec<f32> = out
                    .stdout
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                    .collect();
                // With the norm, the outputs over the exact 1/rms must be the
                // product: a missing or wrong factor is far beyond the rounding.
                let inv_rms = eps.map_or(1.0, |eps| {
                    let mean = x.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / x.len() as f64;
                    1.0 / (mean + eps as f64).sqrt()
                });
                let unscaled: Vec<f32> = got.iter().map(|&y| (y as f64 / inv_rms) as f32).collect();
                // The row the product is of: x times the norm's weight.
                let weighted: Vec<f32> = match eps {
                    Some(_) => x
                        .iter()
                        .zip(&weight)
                        .map(|(&v, w)| v * w.to_f32())
                        .collect(),
                    None => x.clone(),
                };
                // LEVELS in the source.
                let worst = crate::q4::row_check::worst_error(&q, &weighted, &unscaled, 32767.0);
                println!(
                    "{rows_per_warp} rows a warp, {outputs}x{blocks} blocks, eps {eps:?}: worst {worst:e}"
                );
            }
        }
    }

    /// The PTX has exactly one entry point, the one the products dispatch
    /// (see [`Q4_ROW_ENTRY`]), and declares the PTX version and target the
    /// driver needs.
    #[test]
    fn the_ptx_has_the_one_entry_point() {
        let entries: Vec<&str> = Q4_ROW
            .ptx
            .lines()
            .filter_map(|line| line.strip_prefix(".visible .entry "))
            .collect();
        assert_eq!(entries, [format!("{Q4_ROW_ENTRY}(")]);
        assert!(Q4_ROW.ptx.contains("\n.target sm_80\n"));
    }
}
