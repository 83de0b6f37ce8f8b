//! Products of many input rows (prefill) for matrices that are widened to
//! f32 before they are multiplied (f16, bf16, f32 and 8-bit blocks).
//!
//! A tile of `R` weight rows is widened once, a chunk of [`CHUNK`] columns
//! at a time, into a buffer that stays in L1; the tile is then multiplied
//! into groups of `G` input rows with its `R × G` sums in registers, so each
//! widened weight serves `G` inputs and each input value `R` rows. Per
//! vector of columns that is `R + G` loads for `R · G` multiply-adds, where
//! one row against a group costs a load per multiply-add and widens each
//! weight again for every group. The sums of a chunk are added to the
//! output, which holds whole rows' sums when the last chunk is done.
//!
//! The kernels keep their sums in vector registers: AVX2 or AVX-512 (8
//! lanes; 16 or 32 registers, so a larger tile with AVX-512) or NEON (4
//! lanes), picked at run time; plain Rust elsewhere. On SmolLM2's F16 file
//! one thread prefilled 94 tok/s with a row against groups of 4 inputs and
//! 286 with 4 × 4 tiles of 1,024 columns (256 columns: 228; 2,048: 278).

/// Columns widened at a time: a 4-row tile's buffer is 16 KiB, half of a
/// typical L1, beside the 16 KiB of a group of 4 inputs.
pub const CHUNK: usize = 1024;

/// [`product`] with this CPU's kernel and the largest tile its registers
/// hold: 4 × 4 with AVX-512 (32 vector registers), 3 × 4 with AVX2 (16),
/// 4 × 2 with NEON (32 of 4 lanes) and the portable kernel.
pub fn product_here(
    cols: usize,
    first: usize,
    x: &[f32],
    out: &mut [f32],
    widen: impl Fn(usize, usize, &mut [f32]),
) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        static AVX512: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        static AVX2: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        if *AVX512.get_or_init(|| has!("avx512f") && has!("avx512vl") && has!("fma")) {
            return product::<x86::Avx512, 4, 4>(cols, first, x, out, widen);
        }
        if *AVX2.get_or_init(|| has!("avx2") && has!("fma")) {
            return product::<x86::Avx2, 3, 4>(cols, first, x, out, widen);
        }
    }
    #[cfg(target_arch = "aarch64")]
    return product::<arm::Neon, 4, 2>(cols, first, x, out, widen);
    #[allow(unreachable_code)]
    product::<Portable, 4, 2>(cols, first, x, out, widen)
}

/// A kernel: `R` rows of a tile against inputs `i..i + G` over a chunk,
/// sums added to `out` (`[R, n]`).
pub trait Kernel {
    fn run<const R: usize, const G: usize>(
        tile: &[[f32; CHUNK]],
        x: &[f32],
        at: Place,
        i: usize,
        out: &mut [f32],
    );
}

/// The inputs of a kernel call, `G` rows of `width` from column `c`.
#[inline(always)]
fn inputs<const G: usize>(x: &[f32], at: Place, i: usize) -> [&[f32]; G] {
    std::array::from_fn(|g| &x[(i + g) * at.cols + at.c..][..at.width])
}

/// Adds each sum, with the chunk's columns past its last whole vector, to
/// its output.
#[inline(always)]
fn finish<const R: usize, const G: usize>(
    tile: &[[f32; CHUNK]],
    inputs: [&[f32]; G],
    vectors: usize,
    sums: [[f32; G]; R],
    at: Place,
    i: usize,
    out: &mut [f32],
) {
    for (k, weights) in tile.iter().take(R).enumerate() {
        for (g, input) in inputs.iter().enumerate() {
            let tail: f32 = (vectors..at.width).map(|c| weights[c] * input[c]).sum();
            out[k * at.n + i + g] += sums[k][g] + tail;
        }
    }
}

/// Plain Rust: no vector registers promised.
pub struct Portable;

impl Kernel for Portable {
    #[inline(always)]
    fn run<const R: usize, const G: usize>(
        tile: &[[f32; CHUNK]],
        x: &[f32],
        at: Place,
        i: usize,
        out: &mut [f32],
    ) {
        let inputs = inputs::<G>(x, at, i);
        let mut sums = [[0.0f32; G]; R];
        for (k, weights) in tile.iter().take(R).enumerate() {
            for (g, input) in inputs.iter().enumerate() {
                sums[k][g] = weights[..at.width]
                    .iter()
                    .zip(*input)
                    .map(|(w, x)| w * x)
                    .sum();
            }
        }
        finish(tile, inputs, at.width, sums, at, i, out);
    }
}

/// The vector kernel over one instruction set's 8-lane (x86) or 4-lane
/// (NEON) registers: `$zero`, `$load`, `$fma` (`a · b + c`) and `$sum` (of
/// a register's lanes) name its operations.
macro_rules! vector_kernel {
    ($kernel:ident, $features:literal, $lanes:expr, $zero:expr, $load:expr, $fma:expr, $sum:expr) => {
        pub struct $kernel;

        impl $crate::tiles::Kernel for $kernel {
            #[inline(always)]
            fn run<const R: usize, const G: usize>(
                tile: &[[f32; $crate::tiles::CHUNK]],
                x: &[f32],
                at: $crate::tiles::Place,
                i: usize,
                out: &mut [f32],
            ) {
                // SAFETY: `product_here` picks this kernel only where the
                // CPU has its features.
                unsafe { run::<R, G>(tile, x, at, i, out) }
            }
        }

        #[target_feature(enable = $features)]
        unsafe fn run<const R: usize, const G: usize>(
            tile: &[[f32; $crate::tiles::CHUNK]],
            x: &[f32],
            at: $crate::tiles::Place,
            i: usize,
            out: &mut [f32],
        ) {
            let inputs = $crate::tiles::inputs::<G>(x, at, i);
            let vectors = at.width / $lanes * $lanes;
            let mut sums = [[$zero; G]; R];
            let mut c = 0;
            while c < vectors {
                for (g, input) in inputs.iter().enumerate() {
                    // SAFETY: `c + lanes <= width`, the input's length.
                    let input = unsafe { $load(input.as_ptr().add(c)) };
                    for (k, sums) in sums.iter_mut().enumerate() {
                        // SAFETY: as above, for the tile's row.
                        let weights = unsafe { $load(tile[k].as_ptr().add(c)) };
                        sums[g] = $fma(weights, input, sums[g]);
                    }
                }
                c += $lanes;
            }
            let mut totals = [[0.0f32; G]; R];
            for (totals, sums) in totals.iter_mut().zip(&sums) {
                for (total, &sum) in totals.iter_mut().zip(sums) {
                    *total = $sum(sum);
                }
            }
            $crate::tiles::finish(tile, inputs, vectors, totals, at, i, out);
        }
    };
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// A register's 8 lanes summed (inlined into the kernels, whose
    /// features include AVX's).
    #[target_feature(enable = "avx")]
    #[inline]
    fn sum(v: __m256) -> f32 {
        let half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let pairs = _mm_add_ps(half, _mm_movehl_ps(half, half));
        _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps::<1>(pairs, pairs)))
    }

    pub mod avx2 {
        use super::*;
        vector_kernel!(
            Avx2,
            "avx2,fma",
            8,
            _mm256_setzero_ps(),
            _mm256_loadu_ps,
            _mm256_fmadd_ps,
            sum
        );
    }
    pub mod avx512 {
        use super::*;
        // The same 8-lane code, given AVX-512's 32 registers for its sums.
        vector_kernel!(
            Avx512,
            "avx2,fma,avx512f,avx512vl",
            8,
            _mm256_setzero_ps(),
            _mm256_loadu_ps,
            _mm256_fmadd_ps,
            sum
        );
    }
    pub use avx2::Avx2;
    pub use avx512::Avx512;
}

#[cfg(target_arch = "aarch64")]
mod arm {
    use std::arch::aarch64::*;

    #[inline(always)]
    fn fma(a: float32x4_t, b: float32x4_t, c: float32x4_t) -> float32x4_t {
        // SAFETY: NEON is part of every aarch64 CPU.
        unsafe { vfmaq_f32(c, a, b) }
    }

    #[inline(always)]
    fn sum(v: float32x4_t) -> f32 {
        // SAFETY: as above.
        unsafe { vaddvq_f32(v) }
    }

    vector_kernel!(Neon, "neon", 4, vdupq_n_f32(0.0), vld1q_f32, fma, sum);
}

/// `out[(r − first) · n + i] += Σ_c w[r][c] · x[i][c]` for the rows from
/// `first` that `out` (`[rows, n]`, zeroed by the caller) has room for,
/// `x` being `[n, cols]`. `widen(r, c, values)` writes row `r`'s columns
/// from `c` (`values.len()` of them, `c` a multiple of [`CHUNK`]) as f32.
#[inline(always)]
pub fn product<K: Kernel, const R: usize, const G: usize>(
    cols: usize,
    first: usize,
    x: &[f32],
    out: &mut [f32],
    widen: impl Fn(usize, usize, &mut [f32]),
) {
    let n = x.len() / cols;
    let rows = out.len() / n;
    let mut tile = [[0.0f32; CHUNK]; R];
    let mut r = 0;
    while r < rows {
        let height = R.min(rows - r);
        for c in (0..cols).step_by(CHUNK) {
            let width = CHUNK.min(cols - c);
            for (k, values) in tile.iter_mut().enumerate().take(height) {
                widen(first + r + k, c, &mut values[..width]);
            }
            let at = Place { cols, c, width, n };
            let out = &mut out[r * n..(r + height) * n];
            if height == R {
                groups::<K, R, G>(&tile, x, at, out);
            } else {
                // The matrix's last rows, fewer than a tile: one at a time.
                for (k, out) in out.chunks_exact_mut(n).enumerate() {
                    groups::<K, 1, G>(std::slice::from_ref(&tile[k]), x, at, out);
                }
            }
        }
        r += height;
    }
}

/// Where a chunk lies: columns `c..c + width` of inputs `[n, cols]`.
#[derive(Clone, Copy)]
pub struct Place {
    cols: usize,
    c: usize,
    width: usize,
    n: usize,
}

/// A tile's chunk against every input row, `G` at a time, then the rest
/// one at a time; sums added to `out` (`[R, n]`).
#[inline(always)]
fn groups<K: Kernel, const R: usize, const G: usize>(
    tile: &[[f32; CHUNK]],
    x: &[f32],
    at: Place,
    out: &mut [f32],
) {
    let whole = at.n / G * G;
    for i in (0..whole).step_by(G) {
        K::run::<R, G>(tile, x, at, i, out);
    }
    for i in whole..at.n {
        K::run::<R, 1>(tile, x, at, i, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Every output is its row times its input, whatever the shape's
        /// remainders against the tile, the group, the chunk and the lanes.
        #[test]
        fn each_output_is_its_rows_product(
            rows in 1usize..11,
            cols in 1usize..600,
            n in 1usize..8,
            first in 0usize..3,
            seed in any::<u64>(),
        ) {
            let (w, x) = crate::test_products::random_product(seed, first + rows, cols, n);
            let w = w.f32();
            let widen = |r: usize, c: usize, values: &mut [f32]| {
                values.copy_from_slice(&w[r * cols + c..][..values.len()]);
            };
            let mut results = Vec::new();
            let mut out = vec![0.0f32; rows * n];
            product::<Portable, 4, 3>(cols, first, &x, &mut out, widen);
            results.push(("portable", out));
            let mut out = vec![0.0f32; rows * n];
            product_here(cols, first, &x, &mut out, widen);
            results.push(("this CPU's", out));
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                let mut out = vec![0.0f32; rows * n];
                product::<x86::Avx2, 3, 4>(cols, first, &x, &mut out, widen);
                results.push(("avx2", out));
            }
            for (kernel, out) in &results {
                for r in 0..rows {
                    for i in 0..n {
                        let exact: f64 = (0..cols)
                            .map(|c| f64::from(w[(first + r) * cols + c]) * f64::from(x[i * cols + c]))
                            .sum();
                        let got = f64::from(out[r * n + i]);
                        prop_assert!(
                            (got - exact).abs() <= 3e-5 * cols as f64,
                            "{kernel} kernel, row {r} input {i}: {got} against {exact}"
                        );
                    }
                }
            }
        }
    }
}
