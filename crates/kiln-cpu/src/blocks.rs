//! Matrices in blocks: each `[out, in]` row cut into blocks of [`BLOCK`]
//! inputs. [`Q4Blocks`]: 4-bit levels `u` in 0..16 with an f32 `scale` and
//! `min` a block, `w = u · scale + min` (GGUF's Q4_1). [`Q8Blocks`]: signed
//! 8-bit `q` with an f32 `scale`, `w = q · scale` (GGUF's Q8_0), for the
//! output projection, whose error goes straight into the logits.

use half::f16;
use kiln_core::gguf::GgmlType;
use kiln_core::weights::Matrix;

/// Inputs per block.
pub const BLOCK: usize = 32;

/// Bytes of levels per block: two levels a byte.
pub const BLOCK_BYTES: usize = BLOCK / 2;

/// A matrix in 4-bit blocks.
#[derive(Clone, Debug, PartialEq)]
pub struct Q4Blocks {
    pub rows: usize,
    pub cols: usize,
    /// [`BLOCK_BYTES`] a block, blocks row-major: byte `j` of a block holds
    /// level `j` in its low nibble and level `j + 16` in its high nibble
    /// (GGUF's Q4_0/Q4_1 order), so one shift splits a block in halves.
    pub levels: Vec<u8>,
    /// One per block, row-major `[rows, cols / BLOCK]`.
    pub scales: Vec<f32>,
    pub mins: Vec<f32>,
}

/// `m`'s blocks where they are a GGUF file's Q4_0 or Q4_1 ones.
fn file_blocks(m: &Matrix) -> Option<(GgmlType, &[u8])> {
    m.blocks()
        .filter(|(ty, _)| matches!(ty, GgmlType::Q4_0 | GgmlType::Q4_1))
}

/// Why a matrix cannot be stored in 4-bit blocks.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum BlockError {
    #[error(
        "its rows of {cols} inputs are not a whole number of {BLOCK}-input blocks; \
         use --backend cpu (the f32 reference)"
    )]
    Width { cols: usize },
    #[error("the matrices stacked into one product have {0} and {1} inputs")]
    Mismatch(usize, usize),
}

impl Q4Blocks {
    /// Quantizes `m`: a GGUF file's Q4_0 or Q4_1 blocks are taken as they
    /// are (its values exactly); any other block's smallest and largest
    /// weight are its ends, `scale = (max − min) / 15`, and a weight's level
    /// is the nearest, so it moves by at most half a step.
    pub fn quantize(m: &Matrix) -> Result<Q4Blocks, BlockError> {
        Q4Blocks::stack(&[m])
    }

    /// `parts` quantized as one matrix: the rows of the first, then of the
    /// second, and so on (one product for q, k and v).
    pub fn stack(parts: &[&Matrix]) -> Result<Q4Blocks, BlockError> {
        let cols = parts.first().map_or(0, |m| m.cols);
        if let Some(other) = parts.iter().find(|m| m.cols != cols) {
            return Err(BlockError::Mismatch(cols, other.cols));
        }
        if cols == 0 || !cols.is_multiple_of(BLOCK) {
            return Err(BlockError::Width { cols });
        }
        let rows: usize = parts.iter().map(|m| m.rows).sum();
        let blocks = rows * cols / BLOCK;
        let mut q = Q4Blocks {
            rows,
            cols,
            levels: Vec::with_capacity(blocks * BLOCK_BYTES),
            scales: Vec::with_capacity(blocks),
            mins: Vec::with_capacity(blocks),
        };
        if let Some(files) = parts
            .iter()
            .map(|m| file_blocks(m))
            .collect::<Option<Vec<_>>>()
        {
            for (ty, bytes) in files {
                q.extend_from_file(ty, bytes);
            }
            return Ok(q);
        }
        let widened: Vec<_> = parts.iter().map(|m| m.f32()).collect();
        for block in widened.iter().flat_map(|m| m.chunks_exact(BLOCK)) {
            let (min, max) = block
                .iter()
                .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &w| {
                    (lo.min(w), hi.max(w))
                });
            let scale = (max - min) / 15.0;
            let level = |w: f32| match scale > 0.0 {
                true => ((w - min) / scale).round().clamp(0.0, 15.0) as u8,
                false => 0,
            };
            let (low, high) = block.split_at(BLOCK / 2);
            q.levels.extend(
                low.iter()
                    .zip(high)
                    .map(|(&a, &b)| level(a) | (level(b) << 4)),
            );
            q.scales.push(scale);
            q.mins.push(min);
        }
        Ok(q)
    }

    /// A GGUF Q4_0 or Q4_1 file's blocks as they are: the same levels in
    /// the same order, `scale = d`, `min = −8d` (Q4_0) or `m` (Q4_1), which
    /// give the file's values exactly (`u·d − 8d` is `d·(u − 8)`: every term
    /// is an f16 times a small integer, exact in f32).
    fn extend_from_file(&mut self, ty: GgmlType, bytes: &[u8]) {
        let half = |b: &[u8]| f16::from_le_bytes([b[0], b[1]]).to_f32();
        for block in bytes.chunks_exact(ty.block().1) {
            let d = half(&block[0..2]);
            let (min, levels) = match ty {
                GgmlType::Q4_0 => (-8.0 * d, &block[2..18]),
                _ => (half(&block[2..4]), &block[4..20]),
            };
            self.levels.extend_from_slice(levels);
            self.scales.push(d);
            self.mins.push(min);
        }
    }

    /// Blocks per row.
    pub fn blocks_per_row(&self) -> usize {
        self.cols / BLOCK
    }

    /// The f32 matrix the blocks stand for.
    pub fn dequantize(&self) -> Matrix {
        let mut data = Vec::with_capacity(self.rows * self.cols);
        for (b, bytes) in self.levels.chunks_exact(BLOCK_BYTES).enumerate() {
            let (scale, min) = (self.scales[b], self.mins[b]);
            let value = |u: u8| f32::from(u) * scale + min;
            data.extend(bytes.iter().map(|&q| value(q & 0x0f)));
            data.extend(bytes.iter().map(|&q| value(q >> 4)));
        }
        Matrix::new(self.rows, self.cols, data)
    }
}

/// A matrix in 8-bit blocks.
#[derive(Clone, Debug, PartialEq)]
pub struct Q8Blocks {
    pub rows: usize,
    pub cols: usize,
    /// [`BLOCK`] a block, blocks row-major.
    pub values: Vec<i8>,
    /// One per block, row-major `[rows, cols / BLOCK]`.
    pub scales: Vec<f32>,
}

impl Q8Blocks {
    /// Quantizes `m`: a block's scale is its largest magnitude over 127 and
    /// each weight's value the nearest, so it moves by at most half a step.
    /// A Q8_0 block (whose largest value is ±127 steps) comes back up to the
    /// rounding of the scale.
    pub fn quantize(m: &Matrix) -> Result<Q8Blocks, BlockError> {
        if m.cols == 0 || !m.cols.is_multiple_of(BLOCK) {
            return Err(BlockError::Width { cols: m.cols });
        }
        let blocks = m.rows * m.cols / BLOCK;
        let mut q = Q8Blocks {
            rows: m.rows,
            cols: m.cols,
            values: Vec::with_capacity(m.rows * m.cols),
            scales: Vec::with_capacity(blocks),
        };
        for block in m.f32().chunks_exact(BLOCK) {
            let largest = block.iter().fold(0.0f32, |a, w| a.max(w.abs()));
            let scale = largest / 127.0;
            q.values.extend(block.iter().map(|&w| match scale > 0.0 {
                true => (w / scale).round().clamp(-127.0, 127.0) as i8,
                false => 0,
            }));
            q.scales.push(scale);
        }
        Ok(q)
    }

    /// `m` in 8-bit blocks that give every value back bit for bit (whose
    /// [`Q8Blocks::dequantize`] is `m`), or `None` when it has none: the
    /// blocks of a Q8_0 file come back with their scale rounded to f16, as
    /// the file stores it.
    pub fn exact(m: &Matrix) -> Option<Q8Blocks> {
        if m.cols == 0 || !m.cols.is_multiple_of(BLOCK) {
            return None;
        }
        let mut q = Q8Blocks {
            rows: m.rows,
            cols: m.cols,
            values: Vec::with_capacity(m.rows * m.cols),
            scales: Vec::with_capacity(m.rows * m.cols / BLOCK),
        };
        for block in m.f32().chunks_exact(BLOCK) {
            let largest = block.iter().fold(0.0f32, |a, w| a.max(w.abs()));
            let plain = largest / 127.0;
            let candidates = [half::f16::from_f32(plain).to_f32(), plain];
            let found = candidates.into_iter().find_map(|scale| {
                let values: Vec<i8> = block
                    .iter()
                    .map(|&w| match scale > 0.0 {
                        true => (w / scale).round().clamp(-127.0, 127.0) as i8,
                        false => 0,
                    })
                    .collect();
                let back = values.iter().map(|&v| f32::from(v) * scale);
                back.zip(block)
                    .all(|(a, b)| a.to_bits() == b.to_bits())
                    .then_some((scale, values))
            })?;
            q.scales.push(found.0);
            q.values.extend(found.1);
        }
        Some(q)
    }

    /// Blocks per row.
    pub fn blocks_per_row(&self) -> usize {
        self.cols / BLOCK
    }

    /// Row `r`'s weights from column `c` (a whole number of blocks, as
    /// many as `values` holds) as f32.
    pub fn widen(&self, r: usize, c: usize, values: &mut [f32]) {
        let start = r * self.cols + c;
        let quants = self.values[start..][..values.len()].chunks_exact(BLOCK);
        let scales = &self.scales[start / BLOCK..];
        for ((values, quants), &scale) in values.chunks_exact_mut(BLOCK).zip(quants).zip(scales) {
            for (v, &q) in values.iter_mut().zip(quants) {
                *v = f32::from(q) * scale;
            }
        }
    }

    /// The f32 matrix the blocks stand for.
    pub fn dequantize(&self) -> Matrix {
        let data = self
            .values
            .chunks_exact(BLOCK)
            .zip(&self.scales)
            .flat_map(|(block, &scale)| block.iter().map(move |&q| f32::from(q) * scale))
            .collect();
        Matrix::new(self.rows, self.cols, data)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A file's Q4_0 and Q4_1 blocks are kept as written: the file's
    /// values exactly, stacked as one product.
    #[test]
    fn a_files_4_bit_blocks_are_its_values() {
        use kiln_core::gguf::GgmlType;
        let ramp =
            // −11 to 5 steps: a Q4_0 block's levels end well short of 15.
            |rows, step| Matrix::from_fn(rows, 64, move |i| ((i * 37 % 17) as f32 - 11.0) * step);
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1] {
            let (a, b) = (ramp(3, 0.01), ramp(2, 0.07));
            let (a, b) = (
                kiln_core::gguf::quantize(&a, ty).unwrap(),
                kiln_core::gguf::quantize(&b, ty).unwrap(),
            );
            let q = Q4Blocks::stack(&[&a, &b]).unwrap();
            let want: Vec<f32> = [a.f32(), b.f32()].concat();
            assert_eq!(q.dequantize().f32(), want, "{ty:?}");
            // Rounding the widened values again by their ends moves a Q4_0
            // file's (its levels are d·(u − 8), not spread over the range).
            if ty == GgmlType::Q4_0 {
                let again = Q4Blocks::stack(&[&a.widened(), &b.widened()]).unwrap();
                assert_ne!(again.dequantize().f32(), want);
            }
        }
    }

    /// Widening any whole blocks of a row gives the dequantized values.
    #[test]
    fn a_widened_run_of_blocks_is_the_dequantized_row() {
        let m = Matrix::from_fn(3, 4 * BLOCK, |i| (i as f32 * 0.37).sin() * 3.0);
        let q = Q8Blocks::quantize(&m).unwrap();
        let back = q.dequantize();
        for r in 0..3 {
            for (c, len) in [(0, 4 * BLOCK), (BLOCK, 2 * BLOCK), (3 * BLOCK, BLOCK)] {
                let mut values = vec![0.0f32; len];
                q.widen(r, c, &mut values);
                assert_eq!(
                    values,
                    back.f32()[r * m.cols + c..][..len],
                    "row {r} from {c}"
                );
            }
        }
    }

    proptest! {
        /// No weight moves by more than half its block's step.
        #[test]
        fn each_weight_is_within_half_a_step(
            data in proptest::collection::vec(-4.0f32..4.0, 3 * 64),
        ) {
            let m = Matrix::new(3, 64, data);
            let back = Q4Blocks::quantize(&m).unwrap().dequantize();
            for (block, (want, got)) in m.f32().chunks(BLOCK).zip(back.f32().chunks(BLOCK)).enumerate() {
                let (lo, hi) = want.iter().fold((f32::MAX, f32::MIN), |(l, h), &w| (l.min(w), h.max(w)));
                let half_step = (hi - lo) / 30.0;
                for (w, g) in want.iter().zip(got) {
                    prop_assert!((w - g).abs() <= half_step * 1.0001 + 1e-6,
                        "block {block}: {w} came back as {g} (half step {half_step})");
                }
            }
        }
    }

    /// Blocks of `d·u + m` using levels 0 and 15 (Q4_1's) come back to
    /// within the rounding of the scale.
    #[test]
    fn q4_1_blocks_come_back() {
        let (d, m) = (0.0123f32, -0.07f32);
        let m = Matrix::from_fn(2, 64, |i| f32::from(((i * 7) % 16) as u8) * d + m);
        let back = Q4Blocks::quantize(&m).unwrap().dequantize();
        for (w, g) in m.f32().iter().zip(back.f32().iter()) {
            assert!((w - g).abs() <= 1e-6, "{w} came back as {g}");
        }
    }

    #[test]
    fn stacking_keeps_the_rows_in_order() {
        let a = Matrix::from_fn(2, 32, |i| i as f32);
        let b = Matrix::from_fn(3, 32, |i| -(i as f32));
        let stacked = Q4Blocks::stack(&[&a, &b]).unwrap();
        assert_eq!((stacked.rows, stacked.cols), (5, 32));
        let parts = [
            Q4Blocks::quantize(&a).unwrap(),
            Q4Blocks::quantize(&b).unwrap(),
        ];
        assert_eq!(
            stacked.levels,
            [parts[0].levels.clone(), parts[1].levels.clone()].concat()
        );
        assert_eq!(
            Q4Blocks::stack(&[&a, &Matrix::from_fn(1, 64, |_| 0.0)]),
            Err(BlockError::Mismatch(32, 64))
        );
    }

    /// 8-bit blocks: within half a step, and Q8_0's blocks come back.
    #[test]
    fn eight_bit_blocks() {
        let m = Matrix::from_fn(2, 64, |i| ((i * 37) % 101) as f32 / 50.0 - 1.0);
        let back = Q8Blocks::quantize(&m).unwrap().dequantize();
        for (block, (want, got)) in m
            .f32()
            .chunks(BLOCK)
            .zip(back.f32().chunks(BLOCK))
            .enumerate()
        {
            let half_step = want.iter().fold(0.0f32, |a, w| a.max(w.abs())) / 254.0;
            for (w, g) in want.iter().zip(got) {
                assert!(
                    (w - g).abs() <= half_step * 1.0001,
                    "block {block}: {w} -> {g}"
                );
            }
        }
        let d = 0.0031f32;
        let q8_0 = Matrix::from_fn(1, 32, |i| (i as f32 * 8.0 - 127.0).clamp(-127.0, 127.0) * d);
        let back = Q8Blocks::quantize(&q8_0).unwrap().dequantize();
        assert!(kiln_core::testing::max_abs_diff(&q8_0.f32(), &back.f32()) <= 1e-6);
        assert_eq!(
            Q8Blocks::quantize(&Matrix::from_fn(1, 40, |_| 1.0)),
            Err(BlockError::Width { cols: 40 })
        );
    }

    #[test]
    fn constant_blocks_and_bad_widths() {
        let flat = Matrix::from_fn(1, 32, |_| 0.5);
        assert_eq!(Q4Blocks::quantize(&flat).unwrap().dequantize(), flat);
        let error = Q4Blocks::quantize(&Matrix::from_fn(2, 48, |_| 0.0)).unwrap_err();
        assert_eq!(error, BlockError::Width { cols: 48 });
        assert!(error.to_string().contains("--backend cpu"), "{error}");
    }
}
