//! 4-bit weights for [`Precision::Q4`](crate::Precision::Q4): each `[out,
//! in]` matrix is cut, along its rows, into blocks of [`BLOCK`] inputs, and
//! each block stored as 4-bit signed integers `q` with an f16 `scale` and
//! `offset`: `w = q · scale + offset`. That is GGUF's Q4_1 (`w = d · u + m`,
//! `u` in 0..16) with `q = u − 8` and `offset = m + 8d`, so a Q4_1 file's
//! blocks come back exactly; 5 bits a weight in all, against 16 at f16.
//!
//! The device dequantizes inside the matrix-vector kernel (see
//! `crate::llama`), so a decode step reads the packed bytes, not f16.

use half::f16;
use kiln_core::gguf::GgmlType;
use kiln_core::weights::{Matrix, Weights};

/// Inputs per block: one scale and one offset each.
pub const BLOCK: usize = 32;

/// Bytes of a GGUF Q4_0 block: an f16 scale and 32 4-bit values.
const Q4_0_BYTES: usize = 18;

/// A matrix in 4-bit blocks, as the device takes it.
#[derive(Clone, Debug, PartialEq)]
pub struct Q4Matrix {
    pub rows: usize,
    pub cols: usize,
    /// `rows · cols` signed 4-bit values, two per byte, element 2k in the
    /// low nibble (IREE's packing of `i4`).
    pub quants: Vec<u8>,
    /// One per block, row-major `[rows, cols / BLOCK]`.
    pub scales: Vec<f16>,
    pub offsets: Vec<f16>,
}

/// GGUF Q4_0 blocks (`bytes`, whole blocks) as kiln's: their values
/// appended to `quants`, their scales to `scales`; their offsets are 0.
pub fn append_q4_0(
    bytes: &[u8],
    quants: &mut Vec<u8>,
    scales: &mut Vec<f16>,
) -> Result<(), Q4Error> {
    for block in bytes.chunks_exact(Q4_0_BYTES) {
        let scale = f16::from_le_bytes([block[0], block[1]]);
        if !scale.is_finite() {
            let s = scale.to_f32();
            return Err(Q4Error::Range { min: s, max: s });
        }
        // The file's element j is the low nibble of byte j, element j + 16
        // its high nibble, each u with w = d · (u − 8); kiln's element 2k
        // is the low nibble of byte k, as u − 8 in two's complement, which
        // is u xor 8.
        // Byte k < 8 of kiln's takes the low nibbles of the file's bytes 2k
        // and 2k + 1, byte 8 + k their high nibbles.
        let pairs = || block[2..18].chunks_exact(2);
        quants.extend(pairs().map(|p| ((p[0] & 0x0f) | (p[1] << 4)) ^ 0x88));
        quants.extend(pairs().map(|p| ((p[0] >> 4) | (p[1] & 0xf0)) ^ 0x88));
        scales.push(scale);
    }
    Ok(())
}

/// Why a matrix cannot be stored in 4 bits.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum Q4Error {
    #[error("a matrix of {cols} inputs is not a whole number of {BLOCK}-input blocks")]
    Width { cols: usize },
    #[error(
        "a block's range [{min}, {max}] does not fit f16 scales; use --precision f32, which keeps \
         such weights exactly"
    )]
    Range { min: f32, max: f32 },
}

impl Q4Matrix {
    /// `m` in 4-bit blocks: a GGUF Q4_0 file's blocks as they are (`q = u −
    /// 8`, the file's scale, no offset), any other values through
    /// [`Q4Matrix::quantize`].
    pub fn from_matrix(m: &Matrix) -> Result<Q4Matrix, Q4Error> {
        let Some((GgmlType::Q4_0, bytes)) = m.blocks() else {
            return Q4Matrix::quantize(m);
        };
        let blocks = bytes.len() / Q4_0_BYTES;
        let mut q = Q4Matrix {
            rows: m.rows,
            cols: m.cols,
            quants: Vec::with_capacity(blocks * BLOCK / 2),
            scales: Vec::with_capacity(blocks),
            offsets: vec![f16::ZERO; blocks],
        };
        append_q4_0(bytes, &mut q.quants, &mut q.scales)?;
        Ok(q)
    }

    /// Quantizes `m` block by block. A block whose weights are already
    /// `scale · q`, an f16 scale and `q` in −8..=7 (a GGUF Q4_0 block,
    /// dequantized), is stored as exactly that: the file's own blocks, no
    /// rounding. Any other block's smallest and largest weight are its
    /// ends, so the rounding error of a weight is at most half its block's
    /// step `(max − min) / 15` (plus the f16 rounding of the scale and
    /// offset).
    pub fn quantize(m: &Matrix) -> Result<Q4Matrix, Q4Error> {
        if !m.cols.is_multiple_of(BLOCK) {
            return Err(Q4Error::Width { cols: m.cols });
        }
        let blocks = m.rows * m.cols / BLOCK;
        let mut q = Q4Matrix {
            rows: m.rows,
            cols: m.cols,
            quants: Vec::with_capacity(m.rows * m.cols / 2),
            scales: Vec::with_capacity(blocks),
            offsets: Vec::with_capacity(blocks),
        };
        for block in m.f32().chunks_exact(BLOCK) {
            // min and max pass over NaN: without this, a NaN weight would
            // become a level in range.
            if let Some(&w) = block.iter().find(|w| !w.is_finite()) {
                return Err(Q4Error::Range { min: w, max: w });
            }
            if let Some((scale, levels)) = symmetric_levels(block) {
                let nibble = |q: i8| (q as u8) & 0x0f;
                q.quants.extend(
                    levels
                        .chunks_exact(2)
                        .map(|pair| nibble(pair[0]) | (nibble(pair[1]) << 4)),
                );
                q.scales.push(scale);
                q.offsets.push(f16::ZERO);
                continue;
            }
            let (min, max) = block
                .iter()
                .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &w| {
                    (lo.min(w), hi.max(w))
                });
            let scale = f16::from_f32((max - min) / 15.0);
            let offset = f16::from_f32(min + 8.0 * scale.to_f32());
            if !scale.is_finite() || !offset.is_finite() {
                return Err(Q4Error::Range { min, max });
            }
            let (s, o) = (scale.to_f32(), offset.to_f32());
            let level = |w: f32| {
                let q = if s > 0.0 { ((w - o) / s).round() } else { 0.0 };
                (q.clamp(-8.0, 7.0) as i8 as u8) & 0x0f
            };
            q.quants.extend(
                block
                    .chunks_exact(2)
                    .map(|pair| level(pair[0]) | (level(pair[1]) << 4)),
            );
            q.scales.push(scale);
            q.offsets.push(offset);
        }
        Ok(q)
    }

    /// The weights the device computes with, in f32.
    pub fn dequantize(&self) -> Matrix {
        let per_row = self.cols / BLOCK;
        let data = (0..self.rows * self.cols)
            .map(|i| {
                let byte = self.quants[i / 2];
                let nibble = if i % 2 == 0 { byte & 0x0f } else { byte >> 4 };
                // Sign-extend the 4-bit two's complement value.
                let q = ((nibble << 4) as i8 >> 4) as f32;
                let block = (i / self.cols) * per_row + (i % self.cols) / BLOCK;
                q * self.scales[block].to_f32() + self.offsets[block].to_f32()
            })
            .collect();
        Matrix::new(self.rows, self.cols, data)
    }
}

/// `block` as `scale · q` with an f16 `scale` and `q` in −8..=7, if its
/// weights are exactly that in f32 (as a Q4_0 block dequantized is: an f16
/// times a small integer is exact): the weight of largest magnitude is
/// `±k · scale` for some k in 1..=8, so the candidates are its magnitude
/// over ±k, each checked against every weight. The scale may be negative:
/// Q4_0's d is, where the block's far weight is positive (it is −8 d).
fn symmetric_levels(block: &[f32]) -> Option<(f16, [i8; BLOCK])> {
    let largest = block.iter().fold(0.0f32, |a, w| a.max(w.abs()));
    if !largest.is_finite() || largest == 0.0 {
        return None;
    }
    let candidates = (1..=8).flat_map(|k| [largest / k as f32, -largest / k as f32]);
    'candidates: for step in candidates {
        let scale = f16::from_f32(step);
        if scale.to_f32() != step {
            continue;
        }
        let mut levels = [0i8; BLOCK];
        for (level, &w) in levels.iter_mut().zip(block) {
            let q = (w / step).round();
            if !(-8.0..=7.0).contains(&q) || q * step != w {
                continue 'candidates;
            }
            *level = q as i8;
        }
        return Some((scale, levels));
    }
    None
}

/// The weights a q4 graph computes with, as f32 weights for the CPU
/// reference: every matrix but the embedding quantized and dequantized.
/// The embedding and norms are left as they are (the graph rounds them to
/// f16), since no q4 graph folds a norm's weight into its matrices
/// ([`crate::GraphOptions::folds_norm_weights`]).
pub fn device_weights(w: &Weights) -> Result<Weights, Q4Error> {
    w.try_map_products(|m| Q4Matrix::quantize(m).map(|q| q.dequantize()))
}

/// A one-row q4 product's test case and its check, for every form of the
/// product (`llama`'s integer graph, `kernels`' CUDA kernel on the host).
#[cfg(test)]
pub(crate) mod row_check {
    use super::{BLOCK, Q4Matrix};
    use kiln_core::weights::Matrix;

    /// Weights of `rows` outputs over `blocks` blocks, and a row whose
    /// blocks cycle through small, zero and large values (negative ones
    /// among them).
    pub fn case(rows: usize, blocks: usize) -> (Q4Matrix, Vec<f32>) {
        let cols = blocks * BLOCK;
        let m = Matrix::new(
            rows,
            cols,
            (0..rows * cols)
                .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.05)
                .collect(),
        );
        let x = (0..cols)
            .map(|i| match i / BLOCK % 3 {
                0 => ((i * 31 % 17) as f32 - 8.0) * 1e-4,
                1 => 0.0,
                _ => ((i * 13 % 29) as f32 - 14.0) * 7.0,
            })
            .collect();
        (Q4Matrix::quantize(&m).unwrap(), x)
    }

    /// Asserts each of `got` is the exact product of the dequantized
    /// weights `w` and `x` within what rounding the row to 16-bit levels allows
    /// (half a level of each block's largest magnitude per input, times the
    /// weight; `levels` the largest level); returns the worst error relative
    /// to `Σ|w·x|`. A swapped nibble, a wrong sign or a missing offset term
    /// is orders of magnitude beyond.
    pub fn worst_error(w: &Matrix, x: &[f32], got: &[f32], levels: f64) -> f64 {
        assert_eq!(got.len(), w.rows, "one output a row");
        let largest: Vec<f64> = x
            .chunks(BLOCK)
            .map(|b| b.iter().fold(0.0f64, |a, v| a.max(v.abs() as f64)))
            .collect();
        let mut worst = 0.0f64;
        for (n, (weights, &value)) in w.f32().chunks(w.cols).zip(got).enumerate() {
            let exact: f64 = weights
                .iter()
                .zip(x)
                .map(|(&a, &b)| a as f64 * b as f64)
                .sum();
            let magnitude: f64 = weights
                .iter()
                .zip(x)
                .map(|(a, b)| (a * b).abs() as f64)
                .sum();
            let rounding: f64 = weights
                .iter()
                .enumerate()
                .map(|(i, a)| a.abs() as f64 * largest[i / BLOCK] / levels / 2.0)
                .sum();
            let error = (value as f64 - exact).abs();
            assert!(
                error <= rounding + 1e-6 * magnitude,
                "output {n}: {value} against {exact}, error {error:e} beyond {rounding:e}"
            );
            worst = worst.max(error / magnitude);
        }
        worst
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each block of `m` beside what `q`, its quantization, gives back.
    fn round_trip_blocks(m: &Matrix, q: &Q4Matrix) -> Vec<(usize, Vec<f32>, Vec<f32>)> {
        let back = q.dequantize();
        let (m, back) = (m.f32(), back.f32());
        let blocks = m.chunks_exact(BLOCK).zip(back.chunks_exact(BLOCK));
        blocks
            .enumerate()
            .map(|(b, (orig, deq))| (b, orig.to_vec(), deq.to_vec()))
            .collect()
    }

    #[test]
    fn each_weight_is_within_half_a_step_of_its_block() {
        let m = Matrix::from_fn(3, 64, |i| ((i * 7919) % 1000) as f32 / 250.0 - 2.0);
        let q = Q4Matrix::quantize(&m).unwrap();
        assert_eq!((q.quants.len(), q.scales.len()), (96, 6));
        for (b, orig, deq) in round_trip_blocks(&m, &q) {
            let step = q.scales[b].to_f32();
            for (w, d) in orig.iter().zip(deq) {
                assert!(
                    (w - d).abs() <= step * 0.51 + 1e-3,
                    "{w} → {d}, step {step}"
                );
            }
        }
    }

    #[test]
    fn q4_1_blocks_come_back_exactly() {
        // A Q4_1 block: d · u + m with u over 0..16, both ends present.
        let (d, m) = (f16::from_f32(0.0625).to_f32(), f16::from_f32(-0.5).to_f32());
        let w = Matrix::from_fn(1, 32, |i| d * (i % 16) as f32 + m);
        assert_eq!(Q4Matrix::quantize(&w).unwrap().dequantize(), w);
        // Packing: element 2k low, 2k + 1 high; u = 0 is q = −8 (0x8).
        let q = Q4Matrix::quantize(&w).unwrap();
        assert_eq!(q.quants[0], 0x98);
        assert_eq!(q.quants[7], 0x76);
    }

    /// What q4 makes of a GGUF file's 4-bit blocks, from the file's
    /// dequantized weights. Weights drawn from a normal distribution,
    /// written as Q4_0 and Q4_1 the way llama.cpp's reference quantizer
    /// writes them (Q4_0: d = the weight of largest magnitude / −8; Q4_1:
    /// the block's range over 15) and as Q4_K, whose 32-weight sub-blocks
    /// are kiln's blocks, each sub-block's scale and min taken from its
    /// range (llama.cpp searches for them). Q4_0's blocks are taken as they
    /// are: every weight comes back bit for bit. Q4_1's and Q4_K's are
    /// quantized again, each block's grid spanning its smallest to its
    /// largest weight: every weight within half a step of kiln's grid,
    /// which is never coarser than the file's, and a block exactly (to the
    /// f16 rounding of kiln's scale and offset) where it used its lowest
    /// and highest level. The printed fractions and errors (in units of
    /// the file's step) are docs/perf-notes.md's.
    #[test]
    fn gguf_4_bit_blocks_come_back_within_half_a_step() {
        use kiln_core::gguf::{GgmlType, dequantize};
        // A deterministic normal sample (Box-Muller on a 64-bit LCG).
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut uniform = move || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        };
        let mut normal = move || {
            let (a, b) = (uniform(), uniform());
            ((-2.0 * a.ln()).sqrt() * (std::f64::consts::TAU * b).cos()) as f32
        };
        let blocks = 4096;
        let weights: Vec<f32> = (0..blocks * BLOCK).map(|_| normal() * 0.02).collect();
        // Each type's blocks of `weights` and each block's step in the file.
        let pack = |levels: &[u8]| -> Vec<u8> {
            (0..16).map(|j| levels[j] | (levels[j + 16] << 4)).collect()
        };
        let (mut q4_0, mut q4_1, mut q4_k) = (Vec::new(), Vec::new(), Vec::new());
        let (mut steps_0, mut steps_1, mut steps_k) = (Vec::new(), Vec::new(), Vec::new());
        for block in weights.chunks_exact(BLOCK) {
            // Q4_0: d = the weight of largest magnitude / −8.
            let far = block
                .iter()
                .fold(0.0f32, |a, &w| if w.abs() > a.abs() { w } else { a });
            let d = f16::from_f32(far / -8.0);
            let inv = if far == 0.0 { 0.0 } else { -8.0 / far };
            let levels: Vec<u8> = block
                .iter()
                .map(|w| (w * inv + 8.5).clamp(0.0, 15.0) as u8)
                .collect();
            q4_0.extend(d.to_le_bytes());
            q4_0.extend(pack(&levels));
            steps_0.push(d.to_f32().abs());
            // Q4_1: d = (max − min) / 15, m = min.
            let (lo, hi) = block
                .iter()
                .fold((f32::MAX, f32::MIN), |(l, h), &w| (l.min(w), h.max(w)));
            let (d, m) = (f16::from_f32((hi - lo) / 15.0), f16::from_f32(lo));
            let levels: Vec<u8> = block
                .iter()
                .map(|w| ((w - m.to_f32()) / d.to_f32() + 0.5).clamp(0.0, 15.0) as u8)
                .collect();
            q4_1.extend(d.to_le_bytes());
            q4_1.extend(m.to_le_bytes());
            q4_1.extend(pack(&levels));
            steps_1.push(d.to_f32());
        }
        // Q4_K: 256-weight super-blocks, an f16 d and dmin, each 32-weight
        // sub-block a 6-bit scale and min, w = d·sc·q − dmin·m, q in 0..16.
        for sup in weights.chunks_exact(256) {
            let ranges: Vec<(f32, f32)> = sup
                .chunks_exact(BLOCK)
                .map(|b| {
                    b.iter()
                        .fold((0.0f32, 0.0f32), |(l, h), &w| (l.min(w), h.max(w)))
                })
                .collect();
            let largest_step = ranges
                .iter()
                .map(|(l, h)| (h - l) / 15.0)
                .fold(0.0, f32::max);
            let largest_min = ranges.iter().map(|(l, _)| -l).fold(0.0, f32::max);
            let (d, dmin) = (
                f16::from_f32(largest_step / 63.0),
                f16::from_f32(largest_min / 63.0),
            );
            let (df, dminf) = (d.to_f32(), dmin.to_f32());
            let sc: Vec<u8> = ranges
                .iter()
                .map(|(l, h)| (((h - l) / 15.0 / df).round() as u8).clamp(1, 63))
                .collect();
            let mn: Vec<u8> = ranges
                .iter()
                .map(|(l, _)| ((-l / dminf).round() as u8).min(63))
                .collect();
            let mut scales = [0u8; 12];
            for j in 0..4 {
                scales[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
                scales[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6);
                scales[j + 8] = (sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4);
            }
            let mut qs = [0u8; 128];
            for (j, b) in sup.chunks_exact(BLOCK).enumerate() {
                let (step, min) = (df * sc[j] as f32, dminf * mn[j] as f32);
                for (i, w) in b.iter().enumerate() {
                    let q = ((w + min) / step + 0.5).clamp(0.0, 15.0) as u8;
                    // Pairs of sub-blocks share 32 bytes: low nibbles the first.
                    qs[32 * (j / 2) + i] |= q << (4 * (j % 2));
                }
                steps_k.push(step);
            }
            q4_k.extend(d.to_le_bytes());
            q4_k.extend(dmin.to_le_bytes());
            q4_k.extend(scales);
            q4_k.extend(qs);
        }
        for (ty, data, steps) in [
            (GgmlType::Q4_0, q4_0, steps_0),
            (GgmlType::Q4_1, q4_1, steps_1),
            (GgmlType::Q4K, q4_k, steps_k),
        ] {
            let file = dequantize(ty, &data, weights.len()).unwrap();
            let m = Matrix::from_fn(blocks, BLOCK, |i| file[i]);
            let q = Q4Matrix::quantize(&m).unwrap();
            let (mut exact, mut identical, mut worst) = (0, 0, 0.0f32);
            for (b, orig, deq) in round_trip_blocks(&m, &q) {
                // A Q4_0 block's scale is negative where its d is.
                let kiln_step = q.scales[b].to_f32().abs();
                assert!(
                    kiln_step <= steps[b] * 1.001 + 1e-9,
                    "block {b}: {kiln_step} > {}",
                    steps[b]
                );
                let error = orig
                    .iter()
                    .zip(deq)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0, f32::max);
                assert!(
                    error <= 0.51 * kiln_step + 1e-3 * steps[b],
                    "block {b}: {error}"
                );
                // Exact to the f16 rounding of kiln's scale and offset
                // (2^-11 of them, over 15 levels: 0.0073 of a step).
                exact += usize::from(error <= 1e-2 * steps[b]);
                identical += usize::from(error == 0.0);
                worst = worst.max(error / steps[b]);
            }
            println!(
                "{}: {:.1} % of blocks exact, {:.1} % bit for bit, worst error {worst:.3} of \
                 the file's step",
                ty.name(),
                100.0 * exact as f64 / blocks as f64,
                100.0 * identical as f64 / blocks as f64
            );
            if ty == GgmlType::Q4_0 {
                assert_eq!(identical, blocks, "Q4_0's blocks are taken as they are");
            }
        }
    }

    #[test]
    fn constant_blocks_and_bad_shapes() {
        let m = Matrix::from_fn(1, 32, |_| 0.25);
        assert_eq!(Q4Matrix::quantize(&m).unwrap().dequantize(), m);
        let error = Q4Matrix::quantize(&Matrix::from_fn(2, 48, |_| 0.0)).unwrap_err();
        assert_eq!(error, Q4Error::Width { cols: 48 });
        let error = Q4Matrix::quantize(&Matrix::from_fn(1, 32, |i| i as f32 * 1e5)).unwrap_err();
        assert!(error.to_string().contains("--precision f32"), "{error}");
        // A NaN or infinite weight is refused, not rounded to a level.
        for bad in [f32::NAN, f32::INFINITY] {
            let m = Matrix::from_fn(1, 32, |i| if i == 5 { bad } else { 0.5 });
            let error = Q4Matrix::quantize(&m).unwrap_err();
            assert!(matches!(error, Q4Error::Range { .. }), "{error}");
        }
    }
}
