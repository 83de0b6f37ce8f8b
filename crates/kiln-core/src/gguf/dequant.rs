//! ggml tensor types and their dequantization to f32.
//!
//! Each formula is written in the order of operations of the `gguf` Python
//! package's `gguf.quants` (the reference that ships with llama.cpp), so the
//! results agree bit for bit: products are separate from sums (no fused
//! multiply-add), and scales are combined as that code combines them.

use half::{bf16, f16};

/// The tensor types kiln dequantizes, with their ggml ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q4K,
    Q5K,
    Q6K,
    BF16,
}

const QK_K: usize = 256;

impl GgmlType {
    pub const SUPPORTED: &str = "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K";

    pub fn from_id(id: u32) -> Option<GgmlType> {
        Some(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            12 => GgmlType::Q4K,
            13 => GgmlType::Q5K,
            14 => GgmlType::Q6K,
            30 => GgmlType::BF16,
            _ => return None,
        })
    }

    /// ggml's name of the type.
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q5_1 => "Q5_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q4K => "Q4_K",
            GgmlType::Q5K => "Q5_K",
            GgmlType::Q6K => "Q6_K",
            GgmlType::BF16 => "BF16",
        }
    }

    /// Elements per block and bytes per block.
    pub fn block(self) -> (usize, usize) {
        match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 | GgmlType::BF16 => (1, 2),
            GgmlType::Q4_0 => (32, 18),
            GgmlType::Q4_1 => (32, 20),
            GgmlType::Q5_0 => (32, 22),
            GgmlType::Q5_1 => (32, 24),
            GgmlType::Q8_0 => (32, 34),
            GgmlType::Q4K => (QK_K, 144),
            GgmlType::Q5K => (QK_K, 176),
            GgmlType::Q6K => (QK_K, 210),
        }
    }
}

impl GgmlType {
    /// Where each block keeps its f16 scales (and minimums): every other
    /// field of a block is an integer, so a block's values are all finite
    /// exactly when these are.
    pub fn scale_fields(self) -> &'static [usize] {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => &[],
            GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
            GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
            GgmlType::Q6K => &[208],
        }
    }
}

/// The first block of `ty` in `bytes` (whole blocks) whose scale or minimum
/// is not finite, with that value.
pub fn non_finite_block(ty: GgmlType, bytes: &[u8]) -> Option<(usize, f32)> {
    let fields = ty.scale_fields();
    if fields.is_empty() {
        return None;
    }
    bytes
        .chunks_exact(ty.block().1)
        .enumerate()
        .find_map(|(b, block)| {
            fields
                .iter()
                .map(|&at| half(&block[at..at + 2]))
                .find(|v| !v.is_finite())
                .map(|v| (b, v))
        })
}

fn half(bytes: &[u8]) -> f32 {
    f16::from_le_bytes([bytes[0], bytes[1]]).to_f32()
}

/// Dequantizes `elements` values of type `ty` from `data`.
pub fn dequantize(ty: GgmlType, data: &[u8], elements: usize) -> Result<Vec<f32>, String> {
    let (block, block_bytes) = ty.block();
    if !elements.is_multiple_of(block) || data.len() != elements / block * block_bytes {
        return Err(format!(
            "{} bytes of {} cannot hold {elements} values",
            data.len(),
            ty.name()
        ));
    }
    let mut out = vec![0f32; elements];
    let blocks = data
        .chunks_exact(block_bytes)
        .zip(out.chunks_exact_mut(block));
    match ty {
        GgmlType::F32 => blocks.for_each(|(b, o)| o[0] = f32::from_le_bytes(b.try_into().unwrap())),
        GgmlType::F16 => blocks.for_each(|(b, o)| o[0] = half(b)),
        GgmlType::BF16 => {
            blocks.for_each(|(b, o)| o[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32())
        }
        GgmlType::Q4_0 => blocks.for_each(|(b, o)| q4_0(b, o)),
        GgmlType::Q4_1 => blocks.for_each(|(b, o)| q4_1(b, o)),
        GgmlType::Q5_0 => blocks.for_each(|(b, o)| q5_0(b, o)),
        GgmlType::Q5_1 => blocks.for_each(|(b, o)| q5_1(b, o)),
        GgmlType::Q8_0 => blocks.for_each(|(b, o)| q8_0(b, o)),
        GgmlType::Q4K => blocks.for_each(|(b, o)| q4_k(b, o)),
        GgmlType::Q5K => blocks.for_each(|(b, o)| q5_k(b, o)),
        GgmlType::Q6K => blocks.for_each(|(b, o)| q6_k(b, o)),
    }
    Ok(out)
}

/// The 4-bit value `j` (0..32) of a 16-byte block: low nibbles first, then high.
fn nibble(qs: &[u8], j: usize) -> u8 {
    if j < 16 {
        qs[j] & 0x0f
    } else {
        qs[j - 16] >> 4
    }
}

/// Block: f16 d, 16 bytes of nibbles; x = d * (q - 8).
fn q4_0(b: &[u8], out: &mut [f32]) {
    let d = half(&b[0..2]);
    for (j, o) in out.iter_mut().enumerate() {
        *o = d * (nibble(&b[2..18], j) as i8 - 8) as f32;
    }
}

/// Block: f16 d, f16 m, 16 bytes of nibbles; x = d * q + m.
fn q4_1(b: &[u8], out: &mut [f32]) {
    let (d, m) = (half(&b[0..2]), half(&b[2..4]));
    for (j, o) in out.iter_mut().enumerate() {
        *o = d * nibble(&b[4..20], j) as f32 + m;
    }
}

/// The fifth bit of value `j`, from a little-endian u32 of high bits.
fn high_bit(qh: &[u8], j: usize) -> u8 {
    ((u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]) >> j) & 1) as u8
}

/// Block: f16 d, 4 bytes of high bits, 16 bytes of nibbles; x = d * (q - 16).
fn q5_0(b: &[u8], out: &mut [f32]) {
    let d = half(&b[0..2]);
    for (j, o) in out.iter_mut().enumerate() {
        let q = nibble(&b[6..22], j) | (high_bit(&b[2..6], j) << 4);
        *o = d * (q as i8 - 16) as f32;
    }
}

/// Block: f16 d, f16 m, 4 bytes of high bits, 16 bytes of nibbles; x = d * q + m.
fn q5_1(b: &[u8], out: &mut [f32]) {
    let (d, m) = (half(&b[0..2]), half(&b[2..4]));
    for (j, o) in out.iter_mut().enumerate() {
        let q = nibble(&b[8..24], j) | (high_bit(&b[4..8], j) << 4);
        *o = d * q as f32 + m;
    }
}

/// Block: f16 d, 32 signed bytes; x = q * d.
fn q8_0(b: &[u8], out: &mut [f32]) {
    let d = half(&b[0..2]);
    for (o, &q) in out.iter_mut().zip(&b[2..34]) {
        *o = q as i8 as f32 * d;
    }
}

/// The 8 six-bit scales and mins of a Q4_K/Q5_K super-block, packed in 12 bytes.
fn scale_min_k4(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let (mut sc, mut mn) = ([0u8; 8], [0u8; 8]);
    for j in 0..4 {
        sc[j] = s[j] & 0x3f;
        mn[j] = s[j + 4] & 0x3f;
        sc[j + 4] = (s[j + 8] & 0x0f) | ((s[j] >> 2) & 0x30);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
    }
    (sc, mn)
}

/// Super-block: f16 d, f16 dmin, 12 bytes of scales, 128 bytes of nibbles;
/// sub-block i (32 values) is x = (d * sc[i]) * q - (dmin * m[i]). Sub-blocks
/// 2c and 2c+1 are the low and high nibbles of the 32 bytes of chunk c.
fn q4_k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (half(&b[0..2]), half(&b[2..4]));
    let (sc, mn) = scale_min_k4(&b[4..16]);
    let qs = &b[16..144];
    for (i, sub) in out.chunks_exact_mut(32).enumerate() {
        let (scale, min) = (d * sc[i] as f32, dmin * mn[i] as f32);
        let chunk = &qs[(i / 2) * 32..][..32];
        for (l, o) in sub.iter_mut().enumerate() {
            let q = (chunk[l] >> (4 * (i % 2))) & 0x0f;
            *o = scale * q as f32 - min;
        }
    }
}

/// As Q4_K with a fifth bit per value: bit i of byte l of the 32 high-bit
/// bytes belongs to value l of sub-block i.
fn q5_k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (half(&b[0..2]), half(&b[2..4]));
    let (sc, mn) = scale_min_k4(&b[4..16]);
    let qh = &b[16..48];
    let qs = &b[48..176];
    for (i, sub) in out.chunks_exact_mut(32).enumerate() {
        let (scale, min) = (d * sc[i] as f32, dmin * mn[i] as f32);
        let chunk = &qs[(i / 2) * 32..][..32];
        for (l, o) in sub.iter_mut().enumerate() {
            let low = (chunk[l] >> (4 * (i % 2))) & 0x0f;
            let q = low | (((qh[l] >> i) & 1) << 4);
            *o = scale * q as f32 - min;
        }
    }
}

/// Super-block: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 signed
/// scales, f16 d; x = (d * scale[e / 16]) * (q - 32). In each half h of 128
/// values, value r takes nibble r / 64 of low byte h*64 + r % 64 and bit pair
/// r / 32 of high byte h*32 + r % 32.
fn q6_k(b: &[u8], out: &mut [f32]) {
    let (ql, qh, scales) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = half(&b[208..210]);
    for (e, o) in out.iter_mut().enumerate() {
        let (h, r) = (e / 128, e % 128);
        let low = (ql[h * 64 + r % 64] >> (4 * (r / 64))) & 0x0f;
        let high = (qh[h * 32 + r % 32] >> (2 * (r / 32))) & 0x03;
        let q = (low | (high << 4)) as i8 - 32;
        *o = (d * scales[e / 16] as i8 as f32) * q as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_short_buffer_is_an_error() {
        let error = dequantize(GgmlType::Q4_1, &[0; 19], 32).unwrap_err();
        assert!(error.contains("cannot hold 32"), "{error}");
        assert!(dequantize(GgmlType::Q4K, &[0; 144], 32).is_err());
    }

    #[test]
    fn q8_0_scales_signed_bytes() {
        let mut block = vec![0u8; 34];
        block[0..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        block[2] = 0xff; // -1
        block[3] = 4;
        let x = dequantize(GgmlType::Q8_0, &block, 32).unwrap();
        assert_eq!(&x[..3], &[-0.5, 2.0, 0.0]);
    }

    /// A block's values are finite exactly when its scale fields are: the
    /// check finds the block whose dequantized values are not.
    #[test]
    fn the_block_with_a_non_finite_scale_is_found() {
        let types = [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q5_1,
            GgmlType::Q8_0,
            GgmlType::Q4K,
            GgmlType::Q5K,
            GgmlType::Q6K,
        ];
        for ty in types {
            let (block, bytes_a_block) = ty.block();
            // Bytes of 0x11 dequantize to finite values (scales of f16 0x1111).
            let mut bytes = vec![0x11u8; 3 * bytes_a_block];
            assert_eq!(non_finite_block(ty, &bytes), None, "{ty:?}");
            for &at in ty.scale_fields() {
                let mut bad = bytes.clone();
                bad[bytes_a_block + at..][..2].copy_from_slice(&f16::INFINITY.to_le_bytes());
                assert_eq!(
                    non_finite_block(ty, &bad),
                    Some((1, f32::INFINITY)),
                    "{ty:?}"
                );
                let values = dequantize(ty, &bad, 3 * block).unwrap();
                assert!(values[..block].iter().all(|v| v.is_finite()), "{ty:?}");
                assert!(
                    values[block..2 * block].iter().any(|v| !v.is_finite()),
                    "{ty:?}"
                );
            }
            bytes.truncate(bytes_a_block);
        }
    }
}
