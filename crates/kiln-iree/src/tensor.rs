//! Host tensors: a shape and dense row-major data of one element type.

use half::{bf16, f16};

use crate::error::{Error, Result};
use crate::ffi;

/// The element types kiln exchanges with IREE modules.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ElementType {
    F32,
    F16,
    BF16,
    I32,
    /// Signed 4-bit integers, two per byte, element 2k in the low nibble:
    /// how IREE's modules pack an `i4` tensor.
    I4,
    /// Signed 8-bit integers, one per byte.
    I8,
}

impl ElementType {
    pub(crate) fn to_raw(self) -> ffi::kiln_iree_element_type::Type {
        match self {
            ElementType::F32 => ffi::kiln_iree_element_type::KILN_IREE_F32,
            ElementType::F16 => ffi::kiln_iree_element_type::KILN_IREE_F16,
            ElementType::BF16 => ffi::kiln_iree_element_type::KILN_IREE_BF16,
            ElementType::I32 => ffi::kiln_iree_element_type::KILN_IREE_I32,
            ElementType::I4 => ffi::kiln_iree_element_type::KILN_IREE_I4,
            ElementType::I8 => ffi::kiln_iree_element_type::KILN_IREE_I8,
        }
    }

    pub(crate) fn from_raw(raw: ffi::kiln_iree_element_type::Type) -> Result<ElementType> {
        match raw {
            ffi::kiln_iree_element_type::KILN_IREE_F32 => Ok(ElementType::F32),
            ffi::kiln_iree_element_type::KILN_IREE_F16 => Ok(ElementType::F16),
            ffi::kiln_iree_element_type::KILN_IREE_BF16 => Ok(ElementType::BF16),
            ffi::kiln_iree_element_type::KILN_IREE_I32 => Ok(ElementType::I32),
            ffi::kiln_iree_element_type::KILN_IREE_I4 => Ok(ElementType::I4),
            ffi::kiln_iree_element_type::KILN_IREE_I8 => Ok(ElementType::I8),
            other => Err(Error::Tensor(format!("unknown element type {other}"))),
        }
    }

    /// Bits per element.
    pub fn bits(self) -> usize {
        match self {
            ElementType::F32 | ElementType::I32 => 32,
            ElementType::F16 | ElementType::BF16 => 16,
            ElementType::I8 => 8,
            ElementType::I4 => 4,
        }
    }

    /// Bytes of `count` packed elements.
    pub fn byte_length(self, count: usize) -> usize {
        (count * self.bits()).div_ceil(8)
    }
}

/// The data of a tensor, typed.
#[derive(Clone, Debug, PartialEq)]
pub enum TensorData {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
    I32(Vec<i32>),
    /// Packed [`ElementType::I4`] elements: `(n + 1) / 2` bytes for `n`.
    I4(Vec<u8>),
    I8(Vec<i8>),
}

/// A dense row-major host tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    shape: Vec<i64>,
    data: TensorData,
}

impl Tensor {
    /// A tensor of `shape` holding `data`; the element count must match.
    pub fn new(shape: &[i64], data: TensorData) -> Result<Tensor> {
        let expected = element_count(shape)?;
        let actual = match &data {
            TensorData::F32(v) => v.len(),
            TensorData::F16(v) => v.len(),
            TensorData::BF16(v) => v.len(),
            TensorData::I32(v) => v.len(),
            TensorData::I8(v) => v.len(),
            TensorData::I4(v) => {
                let bytes = ElementType::I4.byte_length(expected);
                if v.len() != bytes {
                    return Err(Error::Tensor(format!(
                        "shape {shape:?} packs into {bytes} bytes of i4 but {} were given",
                        v.len()
                    )));
                }
                expected
            }
        };
        if expected != actual {
            return Err(Error::Tensor(format!(
                "shape {shape:?} has {expected} elements but {actual} were given"
            )));
        }
        Ok(Tensor {
            shape: shape.to_vec(),
            data,
        })
    }

    pub fn f32(shape: &[i64], data: Vec<f32>) -> Result<Tensor> {
        Tensor::new(shape, TensorData::F32(data))
    }

    pub fn f16(shape: &[i64], data: Vec<f16>) -> Result<Tensor> {
        Tensor::new(shape, TensorData::F16(data))
    }

    pub fn bf16(shape: &[i64], data: Vec<bf16>) -> Result<Tensor> {
        Tensor::new(shape, TensorData::BF16(data))
    }

    pub fn i32(shape: &[i64], data: Vec<i32>) -> Result<Tensor> {
        Tensor::new(shape, TensorData::I32(data))
    }

    /// A tensor of packed signed 4-bit elements (see [`ElementType::I4`]).
    pub fn i4_packed(shape: &[i64], data: Vec<u8>) -> Result<Tensor> {
        Tensor::new(shape, TensorData::I4(data))
    }

    pub fn i8(shape: &[i64], data: Vec<i8>) -> Result<Tensor> {
        Tensor::new(shape, TensorData::I8(data))
    }

    pub fn shape(&self) -> &[i64] {
        &self.shape
    }

    pub fn data(&self) -> &TensorData {
        &self.data
    }

    pub fn element_type(&self) -> ElementType {
        match self.data {
            TensorData::F32(_) => ElementType::F32,
            TensorData::F16(_) => ElementType::F16,
            TensorData::BF16(_) => ElementType::BF16,
            TensorData::I32(_) => ElementType::I32,
            TensorData::I4(_) => ElementType::I4,
            TensorData::I8(_) => ElementType::I8,
        }
    }

    /// The f32 data, or an error naming the actual type.
    pub fn as_f32(&self) -> Result<&[f32]> {
        match &self.data {
            TensorData::F32(v) => Ok(v),
            _ => Err(self.wrong_type("f32")),
        }
    }

    pub fn as_f16(&self) -> Result<&[f16]> {
        match &self.data {
            TensorData::F16(v) => Ok(v),
            _ => Err(self.wrong_type("f16")),
        }
    }

    pub fn as_bf16(&self) -> Result<&[bf16]> {
        match &self.data {
            TensorData::BF16(v) => Ok(v),
            _ => Err(self.wrong_type("bf16")),
        }
    }

    pub fn as_i32(&self) -> Result<&[i32]> {
        match &self.data {
            TensorData::I32(v) => Ok(v),
            _ => Err(self.wrong_type("i32")),
        }
    }

    fn wrong_type(&self, wanted: &str) -> Error {
        Error::Tensor(format!(
            "wanted {wanted} data, the tensor holds {:?}",
            self.element_type()
        ))
    }

    /// The raw little-endian bytes, as IREE takes them.
    pub(crate) fn bytes(&self) -> Vec<u8> {
        match &self.data {
            TensorData::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            TensorData::F16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            TensorData::BF16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            TensorData::I32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            TensorData::I4(v) => v.clone(),
            TensorData::I8(v) => v.iter().map(|&x| x as u8).collect(),
        }
    }

    /// Rebuilds a tensor from raw little-endian bytes.
    pub(crate) fn from_bytes(shape: Vec<i64>, ty: ElementType, bytes: &[u8]) -> Result<Tensor> {
        let data = match ty {
            ElementType::F32 => TensorData::F32(decode(bytes, f32::from_le_bytes)),
            ElementType::I32 => TensorData::I32(decode(bytes, i32::from_le_bytes)),
            ElementType::F16 => TensorData::F16(decode(bytes, f16::from_le_bytes)),
            ElementType::BF16 => TensorData::BF16(decode(bytes, bf16::from_le_bytes)),
            ElementType::I4 => TensorData::I4(bytes.to_vec()),
            ElementType::I8 => TensorData::I8(bytes.iter().map(|&b| b as i8).collect()),
        };
        Tensor::new(&shape, data)
    }
}

/// Decodes consecutive `N`-byte little-endian values.
fn decode<T, const N: usize>(bytes: &[u8], from_le: fn([u8; N]) -> T) -> Vec<T> {
    bytes
        .chunks_exact(N)
        .map(|chunk| from_le(chunk.try_into().expect("chunks_exact yields N bytes")))
        .collect()
}

fn element_count(shape: &[i64]) -> Result<usize> {
    shape.iter().try_fold(1usize, |acc, &d| {
        usize::try_from(d)
            .ok()
            .and_then(|d| acc.checked_mul(d))
            .ok_or_else(|| Error::Tensor(format!("invalid shape {shape:?}")))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_must_match_the_shape() {
        let error = Tensor::f32(&[2, 3], vec![0.0; 5]).unwrap_err();
        assert!(error.to_string().contains("6 elements but 5"), "{error}");
        assert!(Tensor::i32(&[-1], vec![]).is_err());
        assert!(Tensor::f32(&[i64::MAX, i64::MAX], vec![]).is_err());
        assert!(Tensor::f32(&[0, 7], vec![]).is_ok());
        let error = Tensor::i4_packed(&[4], vec![0; 3]).unwrap_err();
        assert!(error.to_string().contains("2 bytes of i4 but 3"), "{error}");
        assert!(Tensor::i4_packed(&[5], vec![0; 3]).is_ok());
    }

    #[test]
    fn bytes_round_trip_every_type() {
        let tensors = [
            Tensor::f32(&[2], vec![1.5, -0.0]).unwrap(),
            Tensor::f16(&[2], vec![f16::from_f32(0.5), f16::NEG_INFINITY]).unwrap(),
            Tensor::bf16(&[1, 2], vec![bf16::from_f32(3.0), bf16::MIN_POSITIVE]).unwrap(),
            Tensor::i32(&[3], vec![i32::MIN, 0, i32::MAX]).unwrap(),
            Tensor::i4_packed(&[3], vec![0x7f, 0x08]).unwrap(),
            Tensor::i8(&[3], vec![i8::MIN, -1, i8::MAX]).unwrap(),
        ];
        for tensor in tensors {
            let bytes = tensor.bytes();
            assert_eq!(
                bytes.len(),
                tensor
                    .element_type()
                    .byte_length(element_count(tensor.shape()).unwrap())
            );
            let back =
                Tensor::from_bytes(tensor.shape().to_vec(), tensor.element_type(), &bytes).unwrap();
            assert_eq!(back, tensor);
        }
    }

    #[test]
    fn typed_access_names_the_actual_type() {
        let tensor = Tensor::i32(&[1], vec![7]).unwrap();
        let error = tensor.as_f32().unwrap_err();
        assert!(error.to_string().contains("I32"), "{error}");
    }
}
