//! Dense products at a matrix's own precision: rows of f32, f16 or bf16,
//! each kept in the narrowest of them that holds every value exactly (a
//! model read from f16 or bf16 files comes back to its file's values, read
//! at half the bytes), multiplied against f32 inputs with f32 sums.
//!
//! One input (decode) streams each row once, widened eight values at a time
//! in registers where the CPU has AVX2, FMA and F16C (picked at run time),
//! a chunk at a time into a buffer elsewhere. Several inputs (prefill) go to
//! [`tiles`], which widens a tile of rows once for all of them.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use kiln_core::weights::Matrix;

use crate::tiles;

/// Stored values of a [`Dense`] matrix.
pub enum DenseData {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
}

/// A `[rows, cols]` matrix at its stored precision.
pub struct Dense {
    pub rows: usize,
    pub cols: usize,
    pub data: DenseData,
}

/// Values converted at a time by the portable decode product.
const CHUNK: usize = 256;

impl Dense {
    /// `parts` (each `[rows_i, cols]`) stacked by rows, kept in f16 if every
    /// value is one, else bf16 if every value is one, else f32.
    pub fn stack(parts: &[&Matrix]) -> Dense {
        let cols = parts[0].cols;
        debug_assert!(parts.iter().all(|m| m.cols == cols));
        let rows = parts.iter().map(|m| m.rows).sum();
        let values = || parts.iter().flat_map(|m| m.data.iter().copied());
        let data = if values().all(|v| f16::from_f32(v).to_f32().to_bits() == v.to_bits()) {
            DenseData::F16(values().map(f16::from_f32).collect())
        } else if values().all(|v| bf16::from_f32(v).to_f32().to_bits() == v.to_bits()) {
            DenseData::BF16(values().map(bf16::from_f32).collect())
        } else {
            DenseData::F32(values().collect())
        };
        Dense { rows, cols, data }
    }

    /// The precision the values are kept at.
    pub fn precision(&self) -> &'static str {
        match self.data {
            DenseData::F32(_) => "f32",
            DenseData::F16(_) => "f16",
            DenseData::BF16(_) => "bf16",
        }
    }

    /// `out[(r − first) · n + i] = Σ_c w[r][c] · x[i][c]` for the rows from
    /// `first` that `out` (`[rows, n]`) has room for, `x` being `[n, cols]`.
    pub fn rows(&self, first: usize, x: &[f32], out: &mut [f32]) {
        if x.len() > self.cols {
            // Several inputs (prefill): tiles of rows widened once.
            out.fill(0.0);
            let cols = self.cols;
            return match &self.data {
                DenseData::F32(w) => tiles::product_here(cols, first, x, out, |r, c, values| {
                    values.copy_from_slice(&w[r * cols + c..][..values.len()])
                }),
                DenseData::F16(w) => tiles::product_here(cols, first, x, out, |r, c, values| {
                    w[r * cols + c..][..values.len()].convert_to_f32_slice(values)
                }),
                DenseData::BF16(w) => tiles::product_here(cols, first, x, out, |r, c, values| {
                    w[r * cols + c..][..values.len()].convert_to_f32_slice(values)
                }),
            };
        }
        #[cfg(target_arch = "x86_64")]
        if avx2_available() {
            // SAFETY: the CPU has every feature `rows_avx2` is compiled for.
            return unsafe { rows_avx2(self, first, x, out) };
        }
        rows_generic(self, first, x, out);
    }
}

#[cfg(target_arch = "x86_64")]
fn avx2_available() -> bool {
    use std::arch::is_x86_feature_detected as has;
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| has!("avx2") && has!("fma") && has!("f16c"))
}

/// [`rows_generic`] for AVX2, FMA and F16C: f16 and bf16 rows widened
/// eight at a time in registers (`vcvtph2ps`, a 16-bit shift), f32 rows
/// by the vectorized generic loop.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_avx2(m: &Dense, first: usize, x: &[f32], out: &mut [f32]) {
    use std::arch::x86_64::{
        _mm_loadu_si128, _mm256_castsi256_ps, _mm256_cvtepu16_epi32, _mm256_cvtph_ps,
        _mm256_slli_epi32,
    };
    match &m.data {
        DenseData::F32(_) => rows_generic(m, first, x, out),
        // SAFETY (both calls): this function's features are `avx2_rows`'.
        DenseData::F16(w) => unsafe {
            avx2_rows(m.cols, w, first, x, out, |p: *const f16| {
                // SAFETY: `p` points at 8 values of the row (`avx2_rows`).
                _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
            })
        },
        DenseData::BF16(w) => unsafe {
            avx2_rows(m.cols, w, first, x, out, |p: *const bf16| {
                // SAFETY: as above; a bf16 is the high half of its f32.
                let wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()));
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(wide))
            })
        },
    }
}

/// The product over 16-bit rows `w` (`[rows, cols]`), `widen` turning the
/// 8 values at a pointer into f32 lanes, against one input; a tail of fewer
/// than 8 columns in scalar code.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2_rows<T: Copy + Into<f32>>(
    cols: usize,
    w: &[T],
    first: usize,
    x: &[f32],
    out: &mut [f32],
    widen: impl Fn(*const T) -> std::arch::x86_64::__m256,
) {
    use std::arch::x86_64::{
        _mm256_add_ps, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_setzero_ps, _mm256_storeu_ps,
    };
    let whole = cols / 8 * 8;
    for (r, out) in (first..).zip(out.iter_mut()) {
        let row = &w[r * cols..][..cols];
        // Four sums in flight instead of one, which would wait out each
        // multiply-add's latency.
        let mut sums = [_mm256_setzero_ps(); 4];
        let mut c = 0;
        while c + 32 <= whole {
            for (u, sum) in sums.iter_mut().enumerate() {
                let at = c + 8 * u;
                // SAFETY: `x` holds `cols` inputs, past `at + 8`.
                let inputs = unsafe { _mm256_loadu_ps(x[at..at + 8].as_ptr()) };
                *sum = _mm256_fmadd_ps(widen(row[at..at + 8].as_ptr()), inputs, *sum);
            }
            c += 32;
        }
        while c < whole {
            // SAFETY: as above.
            let inputs = unsafe { _mm256_loadu_ps(x[c..c + 8].as_ptr()) };
            sums[0] = _mm256_fmadd_ps(widen(row[c..c + 8].as_ptr()), inputs, sums[0]);
            c += 8;
        }
        let sum = _mm256_add_ps(
            _mm256_add_ps(sums[0], sums[1]),
            _mm256_add_ps(sums[2], sums[3]),
        );
        let mut lanes = [0.0f32; 8];
        // SAFETY: `lanes` holds 8 f32.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), sum) };
        let tail: f32 = (whole..cols).map(|c| row[c].into() * x[c]).sum();
        *out = lanes.iter().sum::<f32>() + tail;
    }
}

#[inline(always)]
fn rows_generic(m: &Dense, first: usize, x: &[f32], out: &mut [f32]) {
    match &m.data {
        DenseData::F32(w) => rows_of(m.cols, w, first, x, out, |from, to| {
            to.copy_from_slice(from)
        }),
        DenseData::F16(w) => rows_of(m.cols, w, first, x, out, |from, to| {
            from.convert_to_f32_slice(to)
        }),
        DenseData::BF16(w) => rows_of(m.cols, w, first, x, out, |from, to| {
            from.convert_to_f32_slice(to)
        }),
    }
}

/// The product over stored values `w` (`[rows, cols]`) against one input,
/// each chunk of a row turned into f32 by `convert` before it is multiplied.
#[inline(always)]
fn rows_of<T: Copy>(
    cols: usize,
    w: &[T],
    first: usize,
    x: &[f32],
    out: &mut [f32],
    convert: impl Fn(&[T], &mut [f32]),
) {
    let mut row = [0.0f32; CHUNK];
    for (r, out) in (first..).zip(out.iter_mut()) {
        let stored = &w[r * cols..][..cols];
        let mut sums = [0.0f32; 8];
        for c in (0..cols).step_by(CHUNK) {
            let len = CHUNK.min(cols - c);
            let row = &mut row[..len];
            convert(&stored[c..c + len], row);
            let x = &x[c..c + len];
            let (whole, tail) = (len / 8 * 8, len % 8);
            for (w, x) in row[..whole].chunks_exact(8).zip(x.chunks_exact(8)) {
                for lane in 0..8 {
                    sums[lane] = w[lane].mul_add(x[lane], sums[lane]);
                }
            }
            for k in 0..tail {
                sums[k] = row[whole + k].mul_add(x[whole + k], sums[k]);
            }
        }
        *out = sums.iter().sum();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The exact product in f64, for the bound.
    fn reference(m: &Matrix, x: &[f32], n: usize) -> Vec<f64> {
        let mut out = vec![0.0; m.rows * n];
        for r in 0..m.rows {
            for i in 0..n {
                out[r * n + i] = (0..m.cols)
                    .map(|c| f64::from(m.data[r * m.cols + c]) * f64::from(x[i * m.cols + c]))
                    .sum();
            }
        }
        out
    }

    #[test]
    fn each_matrix_is_kept_at_the_narrowest_exact_precision() {
        let halves = Matrix::from_fn(3, 5, |i| f16::from_f32(i as f32 * 0.37).to_f32());
        let brains = Matrix::from_fn(3, 5, |i| bf16::from_f32(1e20 * (i as f32 + 1.0)).to_f32());
        let singles = Matrix::from_fn(3, 5, |i| 0.1 + i as f32 * 1e-7);
        assert_eq!(Dense::stack(&[&halves]).precision(), "f16");
        assert_eq!(Dense::stack(&[&brains]).precision(), "bf16");
        assert_eq!(Dense::stack(&[&singles]).precision(), "f32");
        // One value that is not f16 keeps the whole stack wider.
        assert_eq!(Dense::stack(&[&halves, &singles]).precision(), "f32");
        let stacked = Dense::stack(&[&halves, &halves]);
        assert_eq!((stacked.rows, stacked.cols), (6, 5));
    }

    proptest! {
        /// Every precision, width (chunk tails and lane tails) and input
        /// count (group tails) gives the product within f32 summation
        /// error of the exact one, from any first row.
        #[test]
        fn the_product_is_the_stored_matrix_times_the_inputs(
            rows in 1usize..6,
            cols in 1usize..600,
            n in 1usize..7,
            kind in 0usize..3,
            seed in any::<u32>(),
        ) {
            let uniform = |i: usize| {
                ((i as u32).wrapping_mul(2_654_435_761) ^ seed) as f32 / u32::MAX as f32 - 0.5
            };
            let value = |i: usize| {
                let v = uniform(i);
                match kind {
                    0 => f16::from_f32(v).to_f32(),
                    // Past f16's range: these stay bf16.
                    1 => bf16::from_f32(v * 1e6).to_f32(),
                    _ => v,
                }
            };
            let m = Matrix::from_fn(rows, cols, value);
            let x: Vec<f32> = (0..n * cols).map(|i| uniform(i + 7919) * 2.0).collect();
            let dense = Dense::stack(&[&m]);
            // The narrowest exact precision: the values' own, or narrower
            // where they happen to fit (an f32 of few bits, or a bf16 of
            // small magnitude, is an f16).
            let order = ["f16", "bf16", "f32"];
            let kept = order.iter().position(|p| *p == dense.precision()).unwrap();
            prop_assert!(kept <= kind, "{} for kind {kind}", dense.precision());
            if kind == 0 {
                prop_assert_eq!(kept, 0);
            }
            let exact = reference(&m, &x, n);
            for first in 0..rows {
                let mut out = vec![f32::NAN; (rows - first) * n];
                dense.rows(first, &x, &mut out);
                for (k, (&got, &want)) in out.iter().zip(&exact[first * n..]).enumerate() {
                    let scale = if kind == 1 { 1e6 } else { 1.0 };
                    let bound = scale * (1e-5 * (cols as f64).sqrt() * 4.0 + 1e-6);
                    prop_assert!((f64::from(got) - want).abs() <= bound, "{k}: {got} vs {want}");
                }
            }
        }
    }
}
