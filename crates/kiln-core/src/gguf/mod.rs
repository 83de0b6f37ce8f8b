//! GGUF, llama.cpp's one-file model format: a header of typed metadata, a
//! table of tensors, and the tensors' data (often block-quantized).
//!
//! The file is memory-mapped and treated as untrusted: every count, length
//! and offset is checked against the bytes that are actually there before it
//! is used, and no allocation is sized by a header field that was not checked.

mod dequant;
mod llama;
mod quantize;
mod reader;
pub use reader::MAX_METADATA_ITEMS;
mod tokenizer;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

pub use dequant::{GgmlType, dequantize, non_finite_block};
pub use llama::{load_model, model_config, stored_kind, unpermute_rows};
pub use quantize::{quantize, quantize_weights};
pub use tokenizer::tokenizer_from_gguf;

/// A metadata value, as GGUF types it.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
}

impl Value {
    /// The value as an unsigned integer, if it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::I8(v) => Some(v.into()),
            Value::I16(v) => Some(v.into()),
            Value::I32(v) => Some(v.into()),
            Value::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }

    /// GGUF's name of the value's type, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "uint8",
            Value::I8(_) => "int8",
            Value::U16(_) => "uint16",
            Value::I16(_) => "int16",
            Value::U32(_) => "uint32",
            Value::I32(_) => "int32",
            Value::U64(_) => "uint64",
            Value::I64(_) => "int64",
            Value::F32(_) => "float32",
            Value::F64(_) => "float64",
            Value::Bool(_) => "bool",
            Value::String(_) => "string",
            Value::Array(_) => "array",
        }
    }
}

/// One entry of the tensor table; `offset` is relative to the data section
/// and has been checked to lie, with the whole tensor, inside the file.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    /// GGUF order: `dims[0]` varies fastest (a matrix's columns).
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    pub offset: u64,
    /// Bytes of the tensor's data.
    pub size: usize,
}

impl TensorInfo {
    /// Number of elements.
    pub fn elements(&self) -> usize {
        // Checked against the file size at parse time, so it cannot overflow.
        self.dims.iter().product::<u64>() as usize
    }
}

/// An open GGUF file.
pub struct GgufFile {
    path: PathBuf,
    map: memmap2::Mmap,
    pub version: u32,
    pub metadata: HashMap<String, Value>,
    /// In file order.
    pub tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
    data_start: usize,
}

impl GgufFile {
    /// Maps `path` and parses its header and tensor table.
    pub fn open(path: &Path) -> Result<GgufFile> {
        let file = std::fs::File::open(path).map_err(|error| Error::Io {
            path: path.to_path_buf(),
            error,
        })?;
        // SAFETY: the map is read-only and private to this process. A file
        // changed by another process while mapped could change what is read
        // (every read is bounds-checked against the length mapped), as for
        // any model loader that maps its weights. A file truncated while
        // mapped is worse: touching a page past its new end raises SIGBUS,
        // which kills the process (llama.cpp and safetensors users share
        // this). kiln trusts a model file not to shrink while it runs; copy
        // the file rather than truncate or rewrite it in place.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|error| Error::Io {
            path: path.to_path_buf(),
            error,
        })?;
        let header = reader::parse(&map).map_err(|message| Error::Gguf {
            path: path.to_path_buf(),
            message,
        })?;
        let by_name = header
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(GgufFile {
            path: path.to_path_buf(),
            map,
            version: header.version,
            metadata: header.metadata,
            tensors: header.tensors,
            by_name,
            data_start: header.data_start,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file's size in bytes.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// An error about this file.
    pub fn error(&self, message: impl Into<String>) -> Error {
        Error::Gguf {
            path: self.path.clone(),
            message: message.into(),
        }
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// A metadata key that must be there.
    pub fn require(&self, key: &str) -> Result<&Value> {
        self.get(key)
            .ok_or_else(|| self.error(format!("metadata key {key} is missing")))
    }

    pub fn require_u64(&self, key: &str) -> Result<u64> {
        let value = self.require(key)?;
        value.as_u64().ok_or_else(|| {
            self.error(format!(
                "metadata key {key} is a {}, expected an unsigned integer",
                value.type_name()
            ))
        })
    }

    pub fn require_str(&self, key: &str) -> Result<&str> {
        let value = self.require(key)?;
        value.as_str().ok_or_else(|| {
            self.error(format!(
                "metadata key {key} is a {}, expected a string",
                value.type_name()
            ))
        })
    }

    /// An optional key of a given kind: absent is `None`, the wrong type an error.
    pub fn optional<'a, T>(
        &'a self,
        key: &str,
        kind: &str,
        convert: impl Fn(&'a Value) -> Option<T>,
    ) -> Result<Option<T>> {
        match self.get(key) {
            None => Ok(None),
            Some(value) => convert(value).map(Some).ok_or_else(|| {
                self.error(format!(
                    "metadata key {key} is a {}, expected {kind}",
                    value.type_name()
                ))
            }),
        }
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// The raw bytes of a tensor (bounds were checked at open).
    pub fn tensor_bytes(&self, info: &TensorInfo) -> &[u8] {
        let start = self.data_start + info.offset as usize;
        &self.map[start..start + info.size]
    }

    /// A tensor dequantized to f32, in GGUF element order.
    pub fn tensor_f32(&self, info: &TensorInfo) -> Result<Vec<f32>> {
        dequant::dequantize(info.ty, self.tensor_bytes(info), info.elements())
            .map_err(|message| self.error(format!("tensor {}: {message}", info.name)))
    }
}
