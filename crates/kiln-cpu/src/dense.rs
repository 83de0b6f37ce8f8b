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

use crate::pages::{Pages, Stored};
use crate::tiles;

/// Stored values of a [`Dense`] matrix (on huge pages where the system
/// gives them: a decode step reads them all from memory).
pub enum DenseData {
    F32(Stored<f32>),
    F16(Stored<f16>),
    BF16(Stored<bf16>),
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
        Dense::stack_in(&mut Pages::new(), parts)
    }

    /// [`Dense::stack`] into `pages`, beside the model's other matrices.
    pub fn stack_in(pages: &mut Pages, parts: &[&Matrix]) -> Dense {
        let cols = parts[0].cols;
        debug_assert!(parts.iter().all(|m| m.cols == cols));
        let rows: usize = parts.iter().map(|m| m.rows).sum();
        let len = rows * cols;
        let widened: Vec<_> = parts.iter().map(|m| m.f32()).collect();
        let values = || widened.iter().flat_map(|m| m.iter().copied());
        let data = if values().all(|v| f16::from_f32(v).to_f32().to_bits() == v.to_bits()) {
            DenseData::F16(pages.store(len, values().map(f16::from_f32)))
        } else if values().all(|v| bf16::from_f32(v).to_f32().to_bits() == v.to_bits()) {
            DenseData::BF16(pages.store(len, values().map(bf16::from_f32)))
        } else {
            DenseData::F32(pages.store(len, values()))
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
        self.one_input(DecodeKernel::best(), first, x, out);
    }

    /// [`Dense::rows`] of one input (`x` is `[cols]`) through `kernel`,
    /// which the CPU must run ([`DecodeKernel::available`]).
    pub fn one_input(&self, kernel: DecodeKernel, first: usize, x: &[f32], out: &mut [f32]) {
        assert!(kernel.available(), "{kernel:?} on a CPU without it");
        match kernel {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the CPU has every feature `rows_avx2` is compiled for.
            DecodeKernel::Avx2 => unsafe { rows_avx2(self, first, x, out) },
            DecodeKernel::Portable => rows_generic(self, first, x, out),
        }
    }
}

/// The kernels of a one-input (decode) product.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeKernel {
    /// 8 lanes.
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// Chunks widened into a buffer, then multiplied.
    Portable,
}

impl DecodeKernel {
    /// Every kernel, fastest first.
    pub const ALL: &[DecodeKernel] = &[
        #[cfg(target_arch = "x86_64")]
        DecodeKernel::Avx2,
        DecodeKernel::Portable,
    ];

    /// Whether this CPU runs it (checked once per kernel).
    pub fn available(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            use std::sync::OnceLock;
            static AVX2: OnceLock<bool> = OnceLock::new();
            let avx2 = || has!("avx2") && has!("fma") && has!("f16c");
            match self {
                DecodeKernel::Avx2 => *AVX2.get_or_init(avx2),
                DecodeKernel::Portable => true,
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        true
    }

    /// The fastest this CPU runs.
    pub fn best() -> DecodeKernel {
        *DecodeKernel::ALL
            .iter()
            .find(|k| k.available())
            .expect("the portable kernel runs anywhere")
    }
}

/// The product over rows `w` (`[rows, cols]`), `widen` turning the 8
/// values at a pointer into f32 lanes, against one input. Row by row, so
/// that the weights are read as one stream from start to end (four rows at
/// a time, sharing each load of the input, read half as fast from memory:
/// `kiln-bench-kernels --weights f16 --copies 60`), with four sums in
/// flight; but four rows' sums are added across their lanes together, by
/// three horizontal adds: `perf` found as many samples in one row's own
/// reduction as in its products on SmolLM2's 576-wide rows. A tail of fewer
/// than 8 columns in scalar code.
///
/// 16-lane AVX-512 registers read the same rows faster from cache but
/// slower from memory, where decoding reads them, on the Zen 4 this was
/// measured on (`kiln-bench-kernels --weights f16 --copies 60` at 71289c7,
/// which had both), so AVX2 serves both.
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
        __m256, _mm_add_ps, _mm_storeu_ps, _mm256_add_ps, _mm256_castps256_ps128,
        _mm256_extractf128_ps, _mm256_fmadd_ps, _mm256_hadd_ps, _mm256_loadu_ps, _mm256_setzero_ps,
        _mm256_storeu_ps,
    };
    assert!(x.len() >= cols && w.len() >= (first + out.len()) * cols);
    let whole = cols / 8 * 8;
    // One row's sum in 8 lanes.
    let row_sum = |r: usize| -> __m256 {
        let row = w[r * cols..].as_ptr();
        let mut sums = [_mm256_setzero_ps(); 4];
        let mut c = 0;
        while c + 32 <= whole {
            for (u, sum) in sums.iter_mut().enumerate() {
                let at = c + 8 * u;
                // SAFETY: `at + 8 <= cols`: within the row and `x`
                // (asserted above).
                let (weights, inputs) =
                    unsafe { (row.add(at), _mm256_loadu_ps(x.as_ptr().add(at))) };
                *sum = _mm256_fmadd_ps(widen(weights), inputs, *sum);
            }
            c += 32;
        }
        while c < whole {
            // SAFETY: as above.
            let (weights, inputs) = unsafe { (row.add(c), _mm256_loadu_ps(x.as_ptr().add(c))) };
            sums[0] = _mm256_fmadd_ps(widen(weights), inputs, sums[0]);
            c += 8;
        }
        _mm256_add_ps(
            _mm256_add_ps(sums[0], sums[1]),
            _mm256_add_ps(sums[2], sums[3]),
        )
    };
    let tail = |r: usize| -> f32 {
        let row = &w[r * cols..][..cols];
        (whole..cols).map(|c| row[c].into() * x[c]).sum()
    };
    let mut groups = out.chunks_exact_mut(4);
    let mut r = first;
    for group in &mut groups {
        let [a, b, c, d] = std::array::from_fn(|k| row_sum(r + k));
        // Within each 128-bit half: (a, b) pairs, (c, d) pairs, then the
        // four rows' sums; the halves added.
        let pairs = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
        let sums = _mm_add_ps(
            _mm256_castps256_ps128(pairs),
            _mm256_extractf128_ps::<1>(pairs),
        );
        let mut lanes = [0.0f32; 4];
        // SAFETY: `lanes` holds 4 f32.
        unsafe { _mm_storeu_ps(lanes.as_mut_ptr(), sums) };
        for (k, (out, lane)) in group.iter_mut().zip(lanes).enumerate() {
            *out = lane + tail(r + k);
        }
        r += 4;
    }
    for out in groups.into_remainder() {
        let mut lanes = [0.0f32; 8];
        // SAFETY: `lanes` holds 8 f32.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), row_sum(r)) };
        *out = lanes.iter().sum::<f32>() + tail(r);
        r += 1;
    }
}

/// [`rows_generic`] for AVX2, FMA and F16C: 8 values a register (f16 by
/// `vcvtph2ps`, bf16 by a 16-bit shift).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_avx2(m: &Dense, first: usize, x: &[f32], out: &mut [f32]) {
    use std::arch::x86_64::{
        _mm_loadu_si128, _mm256_castsi256_ps, _mm256_cvtepu16_epi32, _mm256_cvtph_ps,
        _mm256_loadu_ps, _mm256_slli_epi32,
    };
    // SAFETY (the three calls): this function's features are `avx2_rows'`;
    // each `widen` reads the 8 values of the row at its pointer.
    match &m.data {
        DenseData::F32(w) => unsafe {
            avx2_rows(m.cols, w, first, x, out, |p: *const f32| _mm256_loadu_ps(p))
        },
        DenseData::F16(w) => unsafe {
            avx2_rows(m.cols, w, first, x, out, |p: *const f16| {
                _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
            })
        },
        DenseData::BF16(w) => unsafe {
            avx2_rows(m.cols, w, first, x, out, |p: *const bf16| {
                let wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()));
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(wide))
            })
        },
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
                    .map(|c| f64::from(m.f32()[r * m.cols + c]) * f64::from(x[i * m.cols + c]))
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
            let scale = if kind == 1 { 1e6 } else { 1.0 };
            let bound = scale * (1e-5 * (cols as f64).sqrt() * 4.0 + 1e-6);
            for first in 0..rows {
                let mut out = vec![f32::NAN; (rows - first) * n];
                dense.rows(first, &x, &mut out);
                for (k, (&got, &want)) in out.iter().zip(&exact[first * n..]).enumerate() {
                    prop_assert!((f64::from(got) - want).abs() <= bound, "{k}: {got} vs {want}");
                }
                // Each one-input kernel this CPU runs, not only the fastest.
                let x = &x[..cols];
                for &kernel in DecodeKernel::ALL.iter().filter(|k| k.available()) {
                    let mut out = vec![f32::NAN; rows - first];
                    dense.one_input(kernel, first, x, &mut out);
                    for (k, &got) in out.iter().enumerate() {
                        let want = exact[(first + k) * n];
                        prop_assert!(
                            (f64::from(got) - want).abs() <= bound,
                            "{kernel:?}, row {}: {got} vs {want}", first + k
                        );
                    }
                }
            }
        }
    }
}
