//! Matrices written as a GGUF file stores them: what the loader gives a
//! backend from such a file, for models made in memory (the benchmarks'
//! `NAME-q8_0` presets) and for tests of the paths that keep a file's
//! blocks.

use half::f16;

use super::GgmlType;
use crate::weights::{Matrix, Stored, Values, Weights};

/// `m` as a GGUF file stores it at `ty`: Q4_0, Q4_1 and Q8_0 blocks as
/// llama.cpp's reference quantizer (the `gguf` package's) writes them, or
/// F16 rows. `m`'s columns must be whole blocks.
pub fn quantize(m: &Matrix, ty: GgmlType) -> Result<Matrix, String> {
    if !m.cols.is_multiple_of(ty.block().0) {
        return Err(format!(
            "rows of {} values are not whole {} blocks",
            m.cols,
            ty.name()
        ));
    }
    let data = m.f32();
    let values = match ty {
        GgmlType::F16 => Values::F16(data.iter().map(|&v| f16::from_f32(v)).collect()),
        GgmlType::Q4_0 => {
            let mut bytes = Vec::with_capacity(data.len() / 32 * 18);
            for block in data.chunks_exact(32) {
                // The value of largest magnitude, sign and all, is level −8.
                let max = block.iter().fold(0.0f32, |a, &v| match v.abs() > a.abs() {
                    true => v,
                    false => a,
                });
                let d = max / -8.0;
                let inverse = if d != 0.0 { 1.0 / d } else { 0.0 };
                let level = |v: f32| ((v * inverse + 8.5) as u8).min(15);
                bytes.extend(f16::from_f32(d).to_le_bytes());
                bytes.extend((0..16).map(|j| level(block[j]) | (level(block[j + 16]) << 4)));
            }
            Values::Blocks { ty, bytes }
        }
        GgmlType::Q4_1 => {
            let mut bytes = Vec::with_capacity(data.len() / 32 * 20);
            for block in data.chunks_exact(32) {
                let (min, max) = (block.iter())
                    .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| {
                        (lo.min(v), hi.max(v))
                    });
                let d = (max - min) / 15.0;
                let inverse = if d != 0.0 { 1.0 / d } else { 0.0 };
                let level = |v: f32| (((v - min) * inverse + 0.5) as u8).min(15);
                bytes.extend(f16::from_f32(d).to_le_bytes());
                bytes.extend(f16::from_f32(min).to_le_bytes());
                bytes.extend((0..16).map(|j| level(block[j]) | (level(block[j + 16]) << 4)));
            }
            Values::Blocks { ty, bytes }
        }
        GgmlType::Q8_0 => {
            let mut bytes = Vec::with_capacity(data.len() / 32 * 34);
            for block in data.chunks_exact(32) {
                let d = block.iter().fold(0.0f32, |a, v| a.max(v.abs())) / 127.0;
                let inverse = if d > 0.0 { 1.0 / d } else { 0.0 };
                bytes.extend(f16::from_f32(d).to_le_bytes());
                bytes.extend(block.iter().map(|v| (v * inverse).round() as i8 as u8));
            }
            Values::Blocks { ty, bytes }
        }
        other => {
            return Err(format!(
                "kiln writes Q4_0, Q4_1, Q8_0 and F16 matrices, not {}",
                other.name()
            ));
        }
    };
    Matrix::stored(m.rows, m.cols, values)
}

/// `w` with every matrix (the embedding and the untied output projection
/// too) as [`quantize`] writes it at `ty`, named as stored so.
pub fn quantize_weights(w: &Weights, ty: GgmlType) -> Result<Weights, String> {
    let mut out = w.clone();
    out.embed = quantize(&w.embed, ty)?;
    for m in out.layers.iter_mut().flat_map(|l| l.matrices_mut()) {
        *m = quantize(m, ty)?;
    }
    out.lm_head = w.lm_head.as_ref().map(|m| quantize(m, ty)).transpose()?;
    out.stored = match ty {
        GgmlType::F16 => Stored::F16,
        _ => Stored::Blocks(ty.name()),
    };
    Ok(out)
}
