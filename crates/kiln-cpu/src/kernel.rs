//! The block products: output rows of a [`Q4Blocks`] or [`Q8Blocks`]
//! matrix against `n` f32 input rows. A 4-bit block is unpacked and
//! dequantized in registers once (`scale · level + min`, fused) and then
//! multiplied into a group of input rows: per block and input row, two
//! vector multiply-adds on AVX-512, four on AVX2; the weights are read once
//! for all `n` rows, and the rows go in tiles so that a group's inputs stay
//! in L1. An 8-bit block's product is summed per block and scaled (`scale ·
//! Σ q·x`), one input at a time: the decode step has one, and several go
//! through `crate::tiles`.
//!
//! Each set of [`Kernels`] computes the same products: AVX-512 (16 lanes),
//! AVX2+FMA (8 lanes), and portable loops the compiler vectorizes for any
//! CPU (aarch64's among them). [`best`] is the first of [`available`] this
//! CPU runs; the tests hold every available set against the dequantized
//! product.

use std::sync::OnceLock;

use crate::blocks::{BLOCK, BLOCK_BYTES, Q4Blocks, Q8Blocks};

/// Output rows computed against one group of inputs before the next group:
/// the group's inputs (4-8 × cols f32, 9-48 KB on SmolLM2) stay in L1
/// across the tile instead of being read again from L2 for every row.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const ROW_TILE: usize = 16;

/// Calls `group(row, inputs, out)` for each output row from `first` that
/// `out` (`[rows, n]`) has room for and each `GROUP` of the `n` inputs
/// (handled together: their accumulators stay in registers), `out` being
/// that row's slots for those inputs; rows in tiles of [`ROW_TILE`].
#[inline(always)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) fn for_each_group<const GROUP: usize>(
    first: usize,
    n: usize,
    out: &mut [f32],
    mut group: impl FnMut(usize, std::ops::Range<usize>, &mut [f32]),
) {
    let rows = out.len() / n;
    for tile in (0..rows).step_by(ROW_TILE) {
        for start in (0..n).step_by(GROUP) {
            let inputs = start..(start + GROUP).min(n);
            for r in tile..(tile + ROW_TILE).min(rows) {
                let slots = r * n + inputs.start..r * n + inputs.end;
                group(first + r, inputs.clone(), &mut out[slots]);
            }
        }
    }
}

/// [`for_each_group`] over a 4-bit matrix: `group(levels, scales, mins, x,
/// out)` gets one output row's blocks and one group's inputs.
#[inline(always)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn q4_rows_in_groups<const GROUP: usize>(
    m: &Q4Blocks,
    first: usize,
    x: &[f32],
    out: &mut [f32],
    group: impl Fn(&[u8], &[f32], &[f32], &[f32], &mut [f32]),
) {
    let blocks = m.blocks_per_row();
    let n = x.len() / m.cols;
    for_each_group::<GROUP>(first, n, out, |r, inputs, out| {
        let row_blocks = r * blocks..(r + 1) * blocks;
        let levels = &m.levels[row_blocks.start * BLOCK_BYTES..row_blocks.end * BLOCK_BYTES];
        let (scales, mins) = (&m.scales[row_blocks.clone()], &m.mins[row_blocks]);
        let x = &x[inputs.start * m.cols..inputs.end * m.cols];
        group(levels, scales, mins, x, out);
    });
}

/// [`for_each_group`] over an 8-bit matrix: `group(values, scales, x, out)`
/// gets one output row's blocks and one group's inputs.
#[inline(always)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn q8_rows_in_groups<const GROUP: usize>(
    m: &Q8Blocks,
    first: usize,
    x: &[f32],
    out: &mut [f32],
    group: impl Fn(&[i8], &[f32], &[f32], &mut [f32]),
) {
    let blocks = m.blocks_per_row();
    let n = x.len() / m.cols;
    for_each_group::<GROUP>(first, n, out, |r, inputs, out| {
        let values = &m.values[r * m.cols..][..m.cols];
        let scales = &m.scales[r * blocks..][..blocks];
        group(
            values,
            scales,
            &x[inputs.start * m.cols..inputs.end * m.cols],
            out,
        );
    });
}

/// `out[(r − first) · n + i] = Σ_c w[r][c] · x[i][c]` for the rows `first..`
/// that `out` has room for (`out.len() / n` of them).
pub type Q4Rows = fn(m: &Q4Blocks, first: usize, x: &[f32], out: &mut [f32]);

/// [`Q4Rows`] of 8-bit blocks.
pub type Q8Rows = fn(m: &Q8Blocks, first: usize, x: &[f32], out: &mut [f32]);

/// One implementation of both products.
pub struct Kernels {
    pub name: &'static str,
    pub q4_rows: Q4Rows,
    pub q8_rows: Q8Rows,
}

/// The kernel sets this CPU can run, fastest first; the portable set last.
pub fn available() -> Vec<Kernels> {
    let mut sets = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx512f") {
            sets.push(Kernels {
                name: "avx512",
                q4_rows: avx512::q4_rows_checked,
                q8_rows: avx512::q8_rows_checked,
            });
        }
        if has!("avx2") && has!("fma") {
            sets.push(Kernels {
                name: "avx2",
                q4_rows: avx2::q4_rows_checked,
                q8_rows: avx2::q8_rows_checked,
            });
        }
    }
    sets.push(Kernels {
        name: "portable",
        q4_rows: portable_q4_rows,
        q8_rows: portable_q8_rows,
    });
    sets
}

/// The fastest kernel set this CPU runs.
pub fn best() -> &'static Kernels {
    static BEST: OnceLock<Kernels> = OnceLock::new();
    BEST.get_or_init(|| available().swap_remove(0))
}

/// [`Q8Rows`] without SIMD intrinsics.
pub fn portable_q8_rows(m: &Q8Blocks, first: usize, x: &[f32], out: &mut [f32]) {
    let blocks = m.blocks_per_row();
    let n = x.len() / m.cols;
    for (r, out) in (first..).zip(out.chunks_exact_mut(n)) {
        let values = &m.values[r * m.cols..][..m.cols];
        let scales = &m.scales[r * blocks..][..blocks];
        for (i, out) in out.iter_mut().enumerate() {
            let x = &x[i * m.cols..][..m.cols];
            *out = values
                .chunks_exact(BLOCK)
                .zip(x.chunks_exact(BLOCK))
                .zip(scales)
                .map(|((q, x), s)| {
                    s * q
                        .iter()
                        .zip(x)
                        .map(|(&q, &x)| f32::from(q) * x)
                        .sum::<f32>()
                })
                .sum();
        }
    }
}

/// [`Q4Rows`] without SIMD intrinsics.
pub fn portable_q4_rows(m: &Q4Blocks, first: usize, x: &[f32], out: &mut [f32]) {
    let blocks = m.blocks_per_row();
    let n = x.len() / m.cols;
    for (r, out) in (first..).zip(out.chunks_exact_mut(n)) {
        let row_blocks = r * blocks..(r + 1) * blocks;
        let levels = &m.levels[row_blocks.start * BLOCK_BYTES..row_blocks.end * BLOCK_BYTES];
        let (scales, mins) = (&m.scales[row_blocks.clone()], &m.mins[row_blocks]);
        for (i, out) in out.iter_mut().enumerate() {
            let x = &x[i * m.cols..][..m.cols];
            let mut total = 0.0f32;
            for b in 0..blocks {
                let bytes = &levels[b * BLOCK_BYTES..][..BLOCK_BYTES];
                let (low, high) = x[b * BLOCK..][..BLOCK].split_at(BLOCK / 2);
                let weight = |level: u8| scales[b].mul_add(f32::from(level), mins[b]);
                total += bytes
                    .iter()
                    .zip(low.iter().zip(high))
                    .map(|(&q, (&a, &c))| weight(q & 0x0f) * a + weight(q >> 4) * c)
                    .sum::<f32>();
            }
            *out = total;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{BLOCK, BLOCK_BYTES, Q4Blocks, Q8Blocks, q4_rows_in_groups, q8_rows_in_groups};

    /// Inputs a block is applied to at once (16 registers: four
    /// accumulators, the block's four vectors, the products).
    const GROUP: usize = 4;

    use std::arch::x86_64::*;

    /// [`q4_rows`], for [`super::available`], which lists it only where
    /// the CPU has AVX2 and FMA.
    pub fn q4_rows_checked(m: &Q4Blocks, first: usize, x: &[f32], out: &mut [f32]) {
        assert!(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"));
        // SAFETY: checked just above.
        unsafe { q4_rows(m, first, x, out) }
    }

    /// [`q8_rows`], as [`q4_rows_checked`].
    pub fn q8_rows_checked(m: &Q8Blocks, first: usize, x: &[f32], out: &mut [f32]) {
        assert!(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"));
        // SAFETY: checked just above.
        unsafe { q8_rows(m, first, x, out) }
    }

    /// [`super::Q8Rows`] with AVX2 and FMA.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn q8_rows(m: &Q8Blocks, first: usize, x: &[f32], out: &mut [f32]) {
        q8_rows_in_groups::<GROUP>(m, first, x, out, |values, scales, x, out| {
            q8_group(values, scales, m.cols, x, out)
        });
    }

    /// One row of 8-bit blocks against up to [`GROUP`] inputs, one input
    /// at a time (a decode step has one; several go through
    /// `crate::tiles`), the blocks summed into two accumulators, even and
    /// odd, so that one block's multiply-add does not wait for the last's.
    #[target_feature(enable = "avx2,fma")]
    fn q8_group(values: &[i8], scales: &[f32], cols: usize, x: &[f32], out: &mut [f32]) {
        let block = |b: usize, x: &[f32], acc: __m256| {
            let block = &values[b * BLOCK..][..BLOCK];
            // SAFETY: `block` holds the 32 bytes the two loads read.
            let (first, second) = unsafe {
                let p = block.as_ptr().cast::<__m128i>();
                (_mm_loadu_si128(p), _mm_loadu_si128(p.add(1)))
            };
            let q = [
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(first)),
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(first))),
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(second)),
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(second))),
            ];
            let t = dot32(&q, &x[b * BLOCK..][..BLOCK]);
            _mm256_fmadd_ps(_mm256_set1_ps(scales[b]), t, acc)
        };
        for (i, out) in out.iter_mut().enumerate() {
            let x = &x[i * cols..][..cols];
            let (mut even, mut odd) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            for pair in 0..scales.len() / 2 {
                even = block(2 * pair, x, even);
                odd = block(2 * pair + 1, x, odd);
            }
            if scales.len() % 2 == 1 {
                even = block(scales.len() - 1, x, even);
            }
            *out = horizontal_sum(_mm256_add_ps(even, odd));
        }
    }

    /// The lane-wise products of `w`'s 32 values and `x`, summed to 8 lanes.
    #[target_feature(enable = "avx2,fma")]
    fn dot32(w: &[__m256; 4], x: &[f32]) -> __m256 {
        assert!(x.len() >= BLOCK);
        // SAFETY: `x` holds the 32 f32 the four loads read (checked above).
        unsafe {
            let p = x.as_ptr();
            let t = _mm256_mul_ps(w[0], _mm256_loadu_ps(p));
            let t = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(p.add(8)), t);
            let t = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(p.add(16)), t);
            _mm256_fmadd_ps(w[3], _mm256_loadu_ps(p.add(24)), t)
        }
    }

    /// [`super::Q4Rows`] with AVX2 and FMA.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn q4_rows(m: &Q4Blocks, first: usize, x: &[f32], out: &mut [f32]) {
        q4_rows_in_groups::<GROUP>(m, first, x, out, |levels, scales, mins, x, out| {
            q4_group(levels, scales, mins, m.cols, x, out)
        });
    }

    /// One row of 4-bit blocks against up to [`GROUP`] inputs (`out.len()`
    /// of them).
    #[target_feature(enable = "avx2,fma")]
    fn q4_group(
        levels: &[u8],
        scales: &[f32],
        mins: &[f32],
        cols: usize,
        x: &[f32],
        out: &mut [f32],
    ) {
        let blocks = cols / BLOCK;
        let mask = _mm_set1_epi8(0x0f);
        let mut acc = [_mm256_setzero_ps(); GROUP];
        for b in 0..blocks {
            let bytes = &levels[b * BLOCK_BYTES..][..BLOCK_BYTES];
            // SAFETY: `bytes` holds the 16 bytes the unaligned load reads.
            let packed = unsafe { _mm_loadu_si128(bytes.as_ptr().cast()) };
            let low = _mm_and_si128(packed, mask);
            let high = _mm_and_si128(_mm_srli_epi16::<4>(packed), mask);
            let (scale, min) = (_mm256_set1_ps(scales[b]), _mm256_set1_ps(mins[b]));
            // Weights 0-7, 8-15 (low nibbles), 16-23, 24-31 (high).
            let weight = |levels| _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(levels), min);
            let w = [
                weight(_mm256_cvtepu8_epi32(low)),
                weight(_mm256_cvtepu8_epi32(_mm_srli_si128::<8>(low))),
                weight(_mm256_cvtepu8_epi32(high)),
                weight(_mm256_cvtepu8_epi32(_mm_srli_si128::<8>(high))),
            ];
            for (i, acc) in acc.iter_mut().enumerate().take(out.len()) {
                let t = dot32(&w, &x[i * cols + b * BLOCK..][..BLOCK]);
                *acc = _mm256_add_ps(t, *acc);
            }
        }
        for (out, acc) in out.iter_mut().zip(acc) {
            *out = horizontal_sum(acc);
        }
    }

    /// The sum of the eight lanes.
    #[target_feature(enable = "avx2,fma")]
    fn horizontal_sum(v: __m256) -> f32 {
        let halves = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let pairs = _mm_add_ps(halves, _mm_movehl_ps(halves, halves));
        let one = _mm_add_ss(pairs, _mm_shuffle_ps::<1>(pairs, pairs));
        _mm_cvtss_f32(one)
    }
}

/// The AVX2 kernels' arithmetic on 16 lanes: a block is two vectors, its
/// low and high nibbles (levels 0-15 and 16-31).
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{BLOCK, BLOCK_BYTES, Q4Blocks, Q8Blocks, q4_rows_in_groups, q8_rows_in_groups};

    /// Inputs a block is applied to at once (32 registers).
    const GROUP: usize = 8;

    use std::arch::x86_64::*;

    /// [`q4_rows`], for [`super::available`], which lists it only where
    /// the CPU has AVX-512F.
    pub fn q4_rows_checked(m: &Q4Blocks, first: usize, x: &[f32], out: &mut [f32]) {
        assert!(is_x86_feature_detected!("avx512f"));
        // SAFETY: checked just above.
        unsafe { q4_rows(m, first, x, out) }
    }

    /// [`q8_rows`], as [`q4_rows_checked`].
    pub fn q8_rows_checked(m: &Q8Blocks, first: usize, x: &[f32], out: &mut [f32]) {
        assert!(is_x86_feature_detected!("avx512f"));
        // SAFETY: checked just above.
        unsafe { q8_rows(m, first, x, out) }
    }

    /// [`super::Q4Rows`] with AVX-512F.
    ///
    /// # Safety
    /// The CPU must have AVX-512F.
    #[target_feature(enable = "avx512f")]
    unsafe fn q4_rows(m: &Q4Blocks, first: usize, x: &[f32], out: &mut [f32]) {
        q4_rows_in_groups::<GROUP>(m, first, x, out, |levels, scales, mins, x, out| {
            q4_group(levels, scales, mins, m.cols, x, out)
        });
    }

    /// One row of 4-bit blocks against up to [`GROUP`] inputs (`out.len()`
    /// of them).
    #[target_feature(enable = "avx512f")]
    fn q4_group(
        levels: &[u8],
        scales: &[f32],
        mins: &[f32],
        cols: usize,
        x: &[f32],
        out: &mut [f32],
    ) {
        let blocks = cols / BLOCK;
        let mask = _mm_set1_epi8(0x0f);
        let mut acc = [[_mm512_setzero_ps(); 2]; GROUP];
        for b in 0..blocks {
            let bytes = &levels[b * BLOCK_BYTES..][..BLOCK_BYTES];
            // SAFETY: `bytes` holds the 16 bytes the load reads.
            let packed = unsafe { _mm_loadu_si128(bytes.as_ptr().cast()) };
            let low = _mm_and_si128(packed, mask);
            let high = _mm_and_si128(_mm_srli_epi16::<4>(packed), mask);
            let (scale, min) = (_mm512_set1_ps(scales[b]), _mm512_set1_ps(mins[b]));
            // Weights 0-15 (low nibbles) and 16-31 (high).
            let weight = |levels| _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(levels), min);
            let w = [
                weight(_mm512_cvtepu8_epi32(low)),
                weight(_mm512_cvtepu8_epi32(high)),
            ];
            // Two sums an input, each half its own chain of multiply-adds.
            for (i, acc) in acc.iter_mut().enumerate().take(out.len()) {
                // SAFETY: the slice holds the 32 f32 the two loads read.
                let p = x[i * cols + b * BLOCK..][..BLOCK].as_ptr();
                let (a, c) = unsafe { (_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16))) };
                acc[0] = _mm512_fmadd_ps(w[0], a, acc[0]);
                acc[1] = _mm512_fmadd_ps(w[1], c, acc[1]);
            }
        }
        for (out, acc) in out.iter_mut().zip(acc) {
            *out = _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
        }
    }

    /// [`super::Q8Rows`] with AVX-512F.
    ///
    /// # Safety
    /// The CPU must have AVX-512F.
    #[target_feature(enable = "avx512f")]
    unsafe fn q8_rows(m: &Q8Blocks, first: usize, x: &[f32], out: &mut [f32]) {
        q8_rows_in_groups::<GROUP>(m, first, x, out, |values, scales, x, out| {
            q8_group(values, scales, m.cols, x, out)
        });
    }

    /// One row of 8-bit blocks against up to [`GROUP`] inputs, as the
    /// AVX2 set's `q8_group` does it.
    #[target_feature(enable = "avx512f")]
    fn q8_group(values: &[i8], scales: &[f32], cols: usize, x: &[f32], out: &mut [f32]) {
        let block = |b: usize, x: &[f32], acc: __m512| {
            let block = &values[b * BLOCK..][..BLOCK];
            // SAFETY: `block` holds the 32 bytes the two loads read.
            let (first, second) = unsafe {
                let p = block.as_ptr().cast::<__m128i>();
                (_mm_loadu_si128(p), _mm_loadu_si128(p.add(1)))
            };
            let q = [
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(first)),
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(second)),
            ];
            let t = dot32(&q, &x[b * BLOCK..][..BLOCK]);
            _mm512_fmadd_ps(_mm512_set1_ps(scales[b]), t, acc)
        };
        for (i, out) in out.iter_mut().enumerate() {
            let x = &x[i * cols..][..cols];
            let (mut even, mut odd) = (_mm512_setzero_ps(), _mm512_setzero_ps());
            for pair in 0..scales.len() / 2 {
                even = block(2 * pair, x, even);
                odd = block(2 * pair + 1, x, odd);
            }
            if scales.len() % 2 == 1 {
                even = block(scales.len() - 1, x, even);
            }
            *out = _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
        }
    }

    /// The lane-wise products of `w`'s 32 values and `x`, summed to 16
    /// lanes.
    #[target_feature(enable = "avx512f")]
    fn dot32(w: &[__m512; 2], x: &[f32]) -> __m512 {
        assert!(x.len() >= BLOCK);
        // SAFETY: `x` holds the 32 f32 the two loads read (checked above).
        unsafe {
            let p = x.as_ptr();
            let t = _mm512_mul_ps(w[0], _mm512_loadu_ps(p));
            _mm512_fmadd_ps(w[1], _mm512_loadu_ps(p.add(16)), t)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_products::{exact_products, later_rows_alone, random_product};
    use kiln_core::weights::Matrix;
    use proptest::prelude::*;

    /// `kernel(first, out)` computes the rows from `first` of the matrix
    /// whose dequantized values are `w`.
    fn check(w: &Matrix, x: &[f32], kernel: &dyn Fn(usize, &mut [f32])) {
        let n = x.len() / w.cols;
        let want = exact_products(w, x);
        let mut got = vec![0.0; w.rows * n];
        kernel(0, &mut got);
        // Relative to the sum of the terms' magnitudes: f32 accumulation.
        let scale: f64 = x.iter().map(|v| f64::from(v.abs())).sum::<f64>() + 1.0;
        for (k, (w, g)) in want.iter().zip(&got).enumerate() {
            assert!(
                (w - f64::from(*g)).abs() <= 2e-5 * scale,
                "output {k}: {g} against {w}"
            );
        }
        later_rows_alone(w.rows, &got, kernel);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        #[test]
        fn both_kernels_compute_the_dequantized_product(
            // Past a row tile (16) and the widest input group (8), partial
            // ones included.
            height in 1usize..40,
            blocks in 1usize..5,
            n in 1usize..20,
            seed in any::<u64>(),
        ) {
            let (w, x) = random_product(seed, height, blocks * BLOCK, n);
            let q4 = Q4Blocks::quantize(&w).unwrap();
            let q4_values = q4.dequantize();
            let q8 = Q8Blocks::quantize(&w).unwrap();
            let q8_values = q8.dequantize();
            for kernels in available() {
                eprintln!("{}", kernels.name);
                check(&q4_values, &x, &|first, out| (kernels.q4_rows)(&q4, first, &x, out));
                check(&q8_values, &x, &|first, out| (kernels.q8_rows)(&q8, first, &x, out));
            }
        }
    }
}
