//! A product's input rows rounded to 8 bits per block of [`BLOCK`], for the
//! integer kernels: `x ≈ d · q` with `q` in −127..=127 and `d` the block's
//! largest magnitude over 127 (llama.cpp's Q8_1 arithmetic, with `d` and
//! the block sums kept in f32 where Q8_1 stores f16).
//!
//! Each input moves by at most `d / 2`, so a product's output moves by at
//! most `Σ_blocks d/2 · Σ_block |w|`: [`Q8Inputs::rounding_bound`].

use crate::blocks::BLOCK;

/// Input rows in 8-bit blocks.
#[derive(Clone, Debug, PartialEq)]
pub struct Q8Inputs {
    pub cols: usize,
    /// `[rows, cols]`, each row's blocks in order.
    pub values: Vec<i8>,
    /// `d` of each block, `[rows, cols / BLOCK]`.
    pub scales: Vec<f32>,
    /// `d · Σ q` of each block, `[rows, cols / BLOCK]`: what a block's
    /// offset (a 4-bit block's `min`, the 8-bit kernels' level bias)
    /// multiplies.
    pub sums: Vec<f32>,
}

impl Q8Inputs {
    /// Rounds `x` (`[rows, cols]`, `cols` a whole number of blocks) to the
    /// nearest step, ties to even (as llama.cpp's SIMD quantizer does).
    pub fn quantize(x: &[f32], cols: usize) -> Q8Inputs {
        debug_assert!(cols.is_multiple_of(BLOCK) && x.len().is_multiple_of(cols));
        let blocks = x.len() / BLOCK;
        let mut q = Q8Inputs {
            cols,
            values: Vec::with_capacity(x.len()),
            scales: Vec::with_capacity(blocks),
            sums: Vec::with_capacity(blocks),
        };
        for block in x.chunks_exact(BLOCK) {
            let largest = block.iter().fold(0.0f32, |a, v| a.max(v.abs()));
            // `max` skips NaN and an infinity rounds every value to 0: a
            // non-finite activation would vanish into plausible tokens. Its
            // block's scale is NaN instead, so the product (and the logits,
            // which every backend checks) say so.
            let d = match block.iter().all(|v| v.is_finite()) {
                true => largest / 127.0,
                false => f32::NAN,
            };
            let inverse = if largest > 0.0 { 127.0 / largest } else { 0.0 };
            let start = q.values.len();
            q.values.extend(
                block
                    .iter()
                    .map(|&v| nearest_even(v * inverse).clamp(-127.0, 127.0) as i8),
            );
            let sum: i32 = q.values[start..].iter().map(|&v| i32::from(v)).sum();
            q.scales.push(d);
            q.sums.push(d * sum as f32);
        }
        q
    }

    /// Rows held.
    pub fn rows(&self) -> usize {
        self.values.len() / self.cols
    }

    /// Blocks per row.
    pub fn blocks_per_row(&self) -> usize {
        self.cols / BLOCK
    }

    /// Row `i`'s values, scales and sums.
    #[inline]
    pub fn row(&self, i: usize) -> (&[i8], &[f32], &[f32]) {
        let blocks = self.blocks_per_row();
        (
            &self.values[i * self.cols..][..self.cols],
            &self.scales[i * blocks..][..blocks],
            &self.sums[i * blocks..][..blocks],
        )
    }

    /// The f32 rows the blocks stand for.
    pub fn dequantize(&self) -> Vec<f32> {
        self.values
            .chunks_exact(BLOCK)
            .zip(&self.scales)
            .flat_map(|(block, &d)| block.iter().map(move |&q| f32::from(q) * d))
            .collect()
    }

    /// The most that rounding row `i` can move its product with a weight
    /// row `w` (dequantized, `cols` long): `Σ_blocks d/2 · Σ_block |w|`.
    pub fn rounding_bound(&self, i: usize, w: &[f32]) -> f64 {
        let (_, scales, _) = self.row(i);
        w.chunks_exact(BLOCK)
            .zip(scales)
            .map(|(w, &d)| f64::from(d) / 2.0 * w.iter().map(|v| f64::from(v.abs())).sum::<f64>())
            .sum()
    }
}

/// `v` (|v| ≤ 2²²) rounded to the nearest integer, ties to even: adding
/// 1.5·2²³ leaves no fraction bits, so the f32 addition itself rounds (in
/// the default rounding mode). `f32::round_ties_even` does the same but is a
/// call into libm on x86-64's baseline, which took 3 % of a decode step.
#[inline]
fn nearest_even(v: f32) -> f32 {
    const SHIFT: f32 = 12_582_912.0;
    (v + SHIFT) - SHIFT
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Every input within half its block's step; the sums are the
        /// blocks' own.
        #[test]
        fn each_input_is_within_half_a_step(
            x in proptest::collection::vec(-50.0f32..50.0, 2 * 64),
        ) {
            let q = Q8Inputs::quantize(&x, 64);
            prop_assert_eq!(q.rows(), 2);
            let back = q.dequantize();
            for (b, (want, got)) in x.chunks(BLOCK).zip(back.chunks(BLOCK)).enumerate() {
                let d = q.scales[b];
                for (w, g) in want.iter().zip(got) {
                    prop_assert!((w - g).abs() <= d / 2.0 * 1.0001, "block {}: {} -> {}", b, w, g);
                }
                let sum: f32 = q.values[b * BLOCK..][..BLOCK].iter().map(|&v| f32::from(v)).sum();
                prop_assert_eq!(q.sums[b], d * sum);
            }
        }
    }

    #[test]
    fn nearest_even_is_round_ties_even() {
        for v in [
            0.5f32, 1.5, 2.5, -0.5, -1.5, 126.5, -126.5, 3.49, -3.51, 0.0, 127.0, 63.5,
        ] {
            assert_eq!(nearest_even(v), v.round_ties_even(), "{v}");
        }
    }

    #[test]
    fn non_finite_inputs_give_non_finite_products() {
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut x = vec![0.5f32; 2 * BLOCK];
            x[BLOCK + 3] = bad;
            let q = Q8Inputs::quantize(&x, 2 * BLOCK);
            assert!(
                q.scales[0].is_finite(),
                "{bad}: the other block is untouched"
            );
            assert!(q.scales[1].is_nan() && q.sums[1].is_nan(), "{bad}");
            assert!(q.dequantize()[BLOCK..].iter().all(|v| v.is_nan()), "{bad}");
        }
    }

    #[test]
    fn zero_blocks_and_extremes() {
        let mut x = vec![0.0f32; 64];
        x[40] = -3.0;
        x[41] = 3.0;
        x[42] = 1.5;
        let q = Q8Inputs::quantize(&x, 64);
        assert_eq!(q.scales[0], 0.0);
        assert!(q.values[..32].iter().all(|&v| v == 0));
        assert_eq!(&q.values[40..43], &[-127, 127, 64]);
        // 63.5 steps: a tie, to even.
        assert_eq!(q.sums[1], q.scales[1] * 64.0);
    }
}
