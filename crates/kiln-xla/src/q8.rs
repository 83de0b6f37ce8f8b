//! 8-bit weights for [`Precision::Q8`](crate::Precision::Q8): each `[out,
//! in]` matrix cut along its rows into blocks of [`BLOCK`] inputs, each
//! block stored as 8-bit signed integers `q` with one f16 `scale`: `w = q ·
//! scale`. That is GGUF's Q8_0 (`w = d · q`), so a Q8_0 file's blocks come
//! back exactly; 8.5 bits a weight, against 16 at f16.
//!
//! The device dequantizes inside the matrix-vector kernel (see
//! `crate::llama`), so a decode step reads the 8-bit values, not f16.

use half::f16;
use kiln_core::gguf::GgmlType;
use kiln_core::weights::{Matrix, Weights};

/// Inputs per block, as in Q8_0.
pub const BLOCK: usize = 32;

/// Bytes of a GGUF Q8_0 block: an f16 scale and 32 signed bytes.
const Q8_0_BYTES: usize = 34;

/// The largest level: Q8_0's quantizer maps a block's largest magnitude to
/// ±127 (−128 is left unused, so that the levels are symmetric).
const LEVELS: f32 = 127.0;

/// A matrix in 8-bit blocks, as the device takes it.
#[derive(Clone, Debug, PartialEq)]
pub struct Q8Matrix {
    pub rows: usize,
    pub cols: usize,
    /// `rows · cols` values, row-major.
    pub quants: Vec<i8>,
    /// One per block, row-major `[rows, cols / BLOCK]`.
    pub scales: Vec<f16>,
}

/// GGUF Q8_0 blocks (`bytes`, whole blocks) as kiln's: their values
/// appended to `quants`, their scales to `scales`.
pub fn append_q8_0(
    bytes: &[u8],
    quants: &mut Vec<i8>,
    scales: &mut Vec<f16>,
) -> Result<(), Q8Error> {
    for block in bytes.chunks_exact(Q8_0_BYTES) {
        let scale = f16::from_le_bytes([block[0], block[1]]);
        if !scale.is_finite() {
            return Err(Q8Error::Range {
                weight: scale.to_f32(),
            });
        }
        quants.extend(block[2..].iter().map(|&b| b as i8));
        scales.push(scale);
    }
    Ok(())
}

/// Why a matrix cannot be stored in 8 bits.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum Q8Error {
    #[error("a matrix of {cols} inputs is not a whole number of {BLOCK}-input blocks")]
    Width { cols: usize },
    #[error(
        "a block's weight {weight} does not fit 8-bit blocks with an f16 scale; use --precision \
         f32, which keeps such weights exactly"
    )]
    Range { weight: f32 },
}

impl Q8Matrix {
    /// `m` in 8-bit blocks: a GGUF Q8_0 file's blocks as they are, any
    /// other values through [`Q8Matrix::quantize`].
    pub fn from_matrix(m: &Matrix) -> Result<Q8Matrix, Q8Error> {
        let Some((GgmlType::Q8_0, bytes)) = m.blocks() else {
            return Q8Matrix::quantize(m);
        };
        let blocks = bytes.len() / Q8_0_BYTES;
        let mut q = Q8Matrix {
            rows: m.rows,
            cols: m.cols,
            quants: Vec::with_capacity(blocks * BLOCK),
            scales: Vec::with_capacity(blocks),
        };
        append_q8_0(bytes, &mut q.quants, &mut q.scales)?;
        Ok(q)
    }

    /// Quantizes `m` block by block. A block whose weights are already
    /// `scale · q`, an f16 scale and `q` in −128..=127 with the largest
    /// magnitude at 127 or 128 steps (a GGUF Q8_0 block, dequantized), is
    /// stored as exactly that: the file's own blocks, no rounding. Any
    /// other block's scale is its largest magnitude over 127, rounded to
    /// f16, and each weight moves by at most half a step (plus the scale's
    /// rounding).
    pub fn quantize(m: &Matrix) -> Result<Q8Matrix, Q8Error> {
        if m.cols == 0 || !m.cols.is_multiple_of(BLOCK) {
            return Err(Q8Error::Width { cols: m.cols });
        }
        let mut q = Q8Matrix {
            rows: m.rows,
            cols: m.cols,
            quants: Vec::with_capacity(m.rows * m.cols),
            scales: Vec::with_capacity(m.rows * m.cols / BLOCK),
        };
        for block in m.f32().chunks_exact(BLOCK) {
            if let Some(&weight) = block.iter().find(|w| !w.is_finite()) {
                return Err(Q8Error::Range { weight });
            }
            let largest = block.iter().fold(0.0f32, |a, w| a.max(w.abs()));
            let exact = [LEVELS, LEVELS + 1.0]
                .into_iter()
                .find_map(|steps| exact_levels(block, largest / steps));
            let (scale, levels) = match exact {
                Some(found) => found,
                None => {
                    let scale = f16::from_f32(largest / LEVELS);
                    if !scale.is_finite() {
                        return Err(Q8Error::Range { weight: largest });
                    }
                    let step = scale.to_f32();
                    let level = |w: f32| match step > 0.0 {
                        true => (w / step).round().clamp(-LEVELS - 1.0, LEVELS) as i8,
                        false => 0,
                    };
                    (scale, block.iter().map(|&w| level(w)).collect())
                }
            };
            q.quants.extend(levels);
            q.scales.push(scale);
        }
        Ok(q)
    }

    /// The weights the device computes with, in f32.
    pub fn dequantize(&self) -> Matrix {
        let data = self
            .quants
            .chunks_exact(BLOCK)
            .zip(&self.scales)
            .flat_map(|(block, scale)| block.iter().map(move |&q| f32::from(q) * scale.to_f32()))
            .collect();
        Matrix::new(self.rows, self.cols, data)
    }
}

/// `block` as `step · q` with `q` in −128..=127, if `step` is an f16 and
/// every weight is exactly that in f32 (an f16 times an 8-bit integer is
/// exact in f32).
fn exact_levels(block: &[f32], step: f32) -> Option<(f16, Vec<i8>)> {
    let scale = f16::from_f32(step);
    if !step.is_finite() || step <= 0.0 || scale.to_f32() != step {
        return None;
    }
    block
        .iter()
        .map(|&w| {
            let q = (w / step).round();
            ((-LEVELS - 1.0..=LEVELS).contains(&q) && q * step == w).then_some(q as i8)
        })
        .collect::<Option<Vec<i8>>>()
        .map(|levels| (scale, levels))
}

/// The weights a q8 graph computes with, as f32 weights for the CPU
/// reference: every matrix but the embedding quantized and dequantized
/// (see [`crate::q4::device_weights`]).
pub fn device_weights(w: &Weights) -> Result<Weights, Q8Error> {
    w.try_map_products(|m| Q8Matrix::quantize(m).map(|q| q.dequantize()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Blocks written the way llama.cpp's reference Q8_0 quantizer writes
    /// them (d = largest magnitude / 127 in f32, q = round(w / d), d stored
    /// as f16), then dequantized as a GGUF reader does: the device's blocks
    /// are the file's, bit for bit.
    #[test]
    fn q8_0_blocks_come_back_exactly() {
        let original = Matrix::from_fn(4, 96, |i| ((i * 7919 % 1000) as f32 / 300.0 - 1.6) * 0.03);
        let mut file_values = Vec::new();
        let mut file_blocks = Vec::new();
        for block in original.f32().chunks_exact(BLOCK) {
            let largest = block.iter().fold(0.0f32, |a, w| a.max(w.abs()));
            let d = largest / 127.0;
            let levels: Vec<i8> = block.iter().map(|&w| (w / d).round() as i8).collect();
            let stored = f16::from_f32(d);
            file_values.extend(levels.iter().map(|&q| f32::from(q) * stored.to_f32()));
            file_blocks.push((stored, levels));
        }
        let file = Matrix::new(original.rows, original.cols, file_values);
        let q = Q8Matrix::quantize(&file).unwrap();
        for (b, (scale, levels)) in file_blocks.iter().enumerate() {
            assert_eq!(q.scales[b], *scale, "block {b}'s scale");
            assert_eq!(
                &q.quants[b * BLOCK..][..BLOCK],
                levels.as_slice(),
                "block {b}"
            );
        }
        assert_eq!(q.dequantize(), file);
    }

    /// A block with a weight at −128 steps (a valid Q8_0 value the
    /// reference quantizer never writes) is still taken as it is.
    #[test]
    fn a_block_reaching_minus_128_steps_is_kept() {
        let step = f16::from_f32(0.01).to_f32();
        let w = Matrix::from_fn(1, 32, |i| (i as f32 * 8.0 - 128.0).min(127.0) * step);
        let q = Q8Matrix::quantize(&w).unwrap();
        assert_eq!(q.quants[0], -128);
        assert_eq!(q.dequantize(), w);
    }

    #[test]
    fn other_weights_move_by_at_most_half_a_step() {
        let m = Matrix::from_fn(3, 64, |i| ((i * 7919) % 1000) as f32 / 250.0 - 2.0);
        let q = Q8Matrix::quantize(&m).unwrap();
        let back = q.dequantize();
        for (b, (orig, deq)) in m
            .f32()
            .chunks_exact(BLOCK)
            .zip(back.f32().chunks_exact(BLOCK))
            .enumerate()
        {
            let step = q.scales[b].to_f32();
            let largest = orig.iter().fold(0.0f32, |a, w| a.max(w.abs()));
            assert!(
                (step * 127.0 - largest).abs() <= largest * 1e-3,
                "block {b}"
            );
            for (w, d) in orig.iter().zip(deq) {
                assert!((w - d).abs() <= step * 0.5 + largest * 1e-3, "{w} → {d}");
            }
        }
        // A block of zeros stays zeros.
        let zeros = Matrix::from_fn(1, 32, |_| 0.0);
        assert_eq!(Q8Matrix::quantize(&zeros).unwrap().dequantize(), zeros);
    }

    #[test]
    fn unfit_matrices_are_refused_with_the_way_out() {
        assert_eq!(
            Q8Matrix::quantize(&Matrix::from_fn(2, 48, |_| 1.0)),
            Err(Q8Error::Width { cols: 48 })
        );
        let error = Q8Matrix::quantize(&Matrix::from_fn(1, 32, |_| 1e9)).unwrap_err();
        assert!(matches!(error, Q8Error::Range { .. }));
        assert!(error.to_string().contains("--precision f32"), "{error}");
        let error = Q8Matrix::quantize(&Matrix::from_fn(1, 32, |_| f32::NAN)).unwrap_err();
        assert!(matches!(error, Q8Error::Range { .. }), "{error}");
    }
}
