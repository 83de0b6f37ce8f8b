//! Parsing the GGUF header and tensor table from the mapped bytes. Every
//! read goes through [`Cursor`], which refuses to read past the end; counts
//! are checked against the bytes left before anything is allocated for them.

use std::collections::HashMap;

use super::dequant::GgmlType;
use super::{TensorInfo, Value};

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml tensors have at most 4 dimensions.
const MAX_DIMS: u32 = 4;
/// Arrays of arrays are legal; deeper nesting than this is not a model.
const MAX_ARRAY_DEPTH: u32 = 4;
/// Array items in all the metadata together. Each is held as a 32-byte
/// [`Value`]: a 48 MB array of bytes took 1.6 GB. The largest real
/// vocabularies (256k tokens, with scores, types and merges) hold about a
/// million.
pub const MAX_METADATA_ITEMS: usize = 4 << 20;

pub struct Header {
    pub version: u32,
    pub metadata: HashMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    /// Where the data section starts in the file.
    pub data_start: usize,
}

struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    /// Metadata array items read so far.
    items: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], String> {
        if n > self.remaining() {
            return Err(format!(
                "truncated: {what} at byte {} needs {n} bytes, the file has {} left",
                self.pos,
                self.remaining()
            ));
        }
        let slice = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(slice)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], String> {
        Ok(self.take(N, what)?.try_into().expect("N bytes"))
    }

    fn u32(&mut self, what: &str) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &str) -> Result<String, String> {
        let len = self.u64(what)?;
        let len = usize::try_from(len)
            .ok()
            .filter(|&l| l <= self.remaining())
            .ok_or_else(|| {
                format!(
                    "{what} at byte {} claims {len} bytes, the file has {} left",
                    self.pos,
                    self.remaining()
                )
            })?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| format!("{what} is not valid UTF-8"))
    }

    /// A count of items of at least `min_size` bytes each, checked against
    /// the bytes left, so that it can size an allocation.
    fn count(&mut self, what: &str, min_size: usize) -> Result<usize, String> {
        let at = self.pos;
        let n = self.u64(what)?;
        let most = self.remaining() / min_size.max(1);
        usize::try_from(n)
            .ok()
            .filter(|&n| n <= most)
            .ok_or_else(|| {
                format!(
                    "{what} at byte {at} is {n}, but the {} bytes left hold at most {most}",
                    self.remaining()
                )
            })
    }
}

/// The smallest encoding of a value of GGUF type `ty`, in bytes.
fn min_size(ty: u32) -> usize {
    match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 | 10..=12 => 8,
        9 => 12,
        _ => 1,
    }
}

fn read_value(c: &mut Cursor, ty: u32, key: &str, depth: u32) -> Result<Value, String> {
    let what = || format!("the value of {key}");
    Ok(match ty {
        0 => Value::U8(c.array::<1>(&what())?[0]),
        1 => Value::I8(c.array::<1>(&what())?[0] as i8),
        2 => Value::U16(u16::from_le_bytes(c.array(&what())?)),
        3 => Value::I16(i16::from_le_bytes(c.array(&what())?)),
        4 => Value::U32(c.u32(&what())?),
        5 => Value::I32(i32::from_le_bytes(c.array(&what())?)),
        6 => Value::F32(f32::from_le_bytes(c.array(&what())?)),
        7 => match c.array::<1>(&what())?[0] {
            0 => Value::Bool(false),
            1 => Value::Bool(true),
            other => return Err(format!("{key} is a bool of value {other}, not 0 or 1")),
        },
        8 => Value::String(c.string(&what())?),
        9 => {
            if depth >= MAX_ARRAY_DEPTH {
                return Err(format!(
                    "{key} nests arrays more than {MAX_ARRAY_DEPTH} deep"
                ));
            }
            let element = c.u32(&format!("the element type of {key}"))?;
            if min_size(element) == 1 && !matches!(element, 0 | 1 | 7) {
                return Err(format!("{key} is an array of unknown type {element}"));
            }
            let n = c.count(&format!("the length of {key}"), min_size(element))?;
            c.items = c.items.saturating_add(n);
            if c.items > MAX_METADATA_ITEMS {
                return Err(format!(
                    "{key} brings the metadata's arrays to more than {MAX_METADATA_ITEMS} items; \
                     no model's metadata is that large"
                ));
            }
            let mut items = Vec::with_capacity(n);
            for _ in 0..n {
                items.push(read_value(c, element, key, depth + 1)?);
            }
            Value::Array(items)
        }
        10 => Value::U64(c.u64(&what())?),
        11 => Value::I64(i64::from_le_bytes(c.array(&what())?)),
        12 => Value::F64(f64::from_le_bytes(c.array(&what())?)),
        other => return Err(format!("{key} has unknown value type {other}")),
    })
}

pub fn parse(bytes: &[u8]) -> Result<Header, String> {
    let mut c = Cursor {
        bytes,
        pos: 0,
        items: 0,
    };
    let magic = c.take(4, "the magic number")?;
    if magic != MAGIC {
        return Err(format!(
            "not a GGUF file: it starts with {magic:02x?}, a GGUF file with \"GGUF\""
        ));
    }
    let version = c.u32("the version")?;
    match version {
        2 | 3 => {}
        1 => return Err("GGUF version 1 is not supported (kiln reads versions 2 and 3)".into()),
        v if v.swap_bytes() <= 3 => {
            return Err("a big-endian GGUF file; kiln reads little-endian files".into());
        }
        v => {
            return Err(format!(
                "GGUF version {v} is not supported (kiln reads 2 and 3)"
            ));
        }
    }
    // Each tensor entry takes at least 8 (name) + 4 (dims) + 4 (type) + 8 (offset)
    // bytes; each metadata entry at least 8 (key) + 4 (type) + 1.
    let tensor_count = c.u64("the tensor count")?;
    let kv_count = c.u64("the metadata count")?;
    let room = c.remaining();
    if tensor_count > (room / 24) as u64 || kv_count > (room / 13) as u64 {
        return Err(format!(
            "truncated or corrupt: the header claims {tensor_count} tensors and {kv_count} \
             metadata entries, more than the {room} bytes after it can hold"
        ));
    }
    let mut metadata = HashMap::with_capacity(kv_count as usize);
    for _ in 0..kv_count {
        let key = c.string("a metadata key")?;
        let ty = c.u32(&format!("the type of {key}"))?;
        let value = read_value(&mut c, ty, &key, 0)?;
        if metadata.insert(key.clone(), value).is_some() {
            return Err(format!("metadata key {key} appears twice"));
        }
    }
    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(Value::U32(a)) if a.is_power_of_two() => u64::from(*a),
        Some(other) => {
            return Err(format!(
                "general.alignment is {other:?}; it must be a power of two (uint32)"
            ));
        }
    };
    let mut raw = Vec::with_capacity(tensor_count as usize);
    for _ in 0..tensor_count {
        let name = c.string("a tensor name")?;
        let n_dims = c.u32(&format!("the dimension count of tensor {name}"))?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(format!(
                "tensor {name} has {n_dims} dimensions (ggml allows 1 to {MAX_DIMS})"
            ));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(c.u64(&format!("a dimension of tensor {name}"))?);
        }
        let ty = c.u32(&format!("the type of tensor {name}"))?;
        let offset = c.u64(&format!("the offset of tensor {name}"))?;
        raw.push((name, dims, ty, offset));
    }
    let data_start = (c.pos as u64).div_ceil(alignment) * alignment;
    let data_len = match (bytes.len() as u64).checked_sub(data_start) {
        Some(len) => len,
        // No tensors, no data section: llama.cpp writes a vocabulary alone
        // (its ggml-vocab-*.gguf) without the padding that would lead to one.
        None if raw.is_empty() => 0,
        None => {
            return Err(format!(
                "truncated: the data section starts at byte {data_start}, past the end ({} bytes)",
                bytes.len()
            ));
        }
    };
    let mut tensors = Vec::with_capacity(raw.len());
    let mut names = std::collections::HashSet::with_capacity(raw.len());
    for (name, dims, ty, offset) in raw {
        let ty = GgmlType::from_id(ty).ok_or_else(|| {
            format!(
                "tensor {name} has tensor type {ty}, which kiln cannot read (it reads {})",
                GgmlType::SUPPORTED
            )
        })?;
        let elements = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .filter(|&n| n <= data_len.saturating_mul(8))
            .ok_or_else(|| {
                format!("tensor {name} has dimensions {dims:?}, more elements than the file holds")
            })?;
        let (block, block_bytes) = ty.block();
        if dims[0] % block as u64 != 0 {
            return Err(format!(
                "tensor {name} has {} columns, not a multiple of {}'s block of {block}",
                dims[0],
                ty.name()
            ));
        }
        let size = elements / block as u64 * block_bytes as u64;
        if offset % alignment != 0 {
            return Err(format!(
                "tensor {name} starts at offset {offset}, not a multiple of the alignment {alignment}"
            ));
        }
        if offset.checked_add(size).is_none_or(|end| end > data_len) {
            return Err(format!(
                "tensor {name} ({size} bytes at data offset {offset}) runs past the end of the \
                 file (the data section holds {data_len} bytes): is the file truncated?"
            ));
        }
        if !names.insert(name.clone()) {
            return Err(format!("tensor {name} appears twice"));
        }
        tensors.push(TensorInfo {
            name,
            dims,
            ty,
            offset,
            size: size as usize,
        });
    }
    refuse_overlaps(&tensors)?;
    Ok(Header {
        version,
        metadata,
        tensors,
        data_start: data_start as usize,
    })
}

/// Each tensor has bytes of its own. Tensors that share bytes would let a
/// small file declare weights far larger than itself (1,024 layers over one
/// region of a 4.7 MB file reached 3 GB once dequantized).
fn refuse_overlaps(tensors: &[TensorInfo]) -> Result<(), String> {
    let mut spans: Vec<&TensorInfo> = tensors.iter().filter(|t| t.size > 0).collect();
    spans.sort_by_key(|t| t.offset);
    for pair in spans.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        if a.offset + a.size as u64 > b.offset {
            return Err(format!(
                "tensors {} (data bytes {}..{}) and {} (from {}) overlap; a GGUF file stores \
                 each tensor in bytes of its own",
                a.name,
                a.offset,
                a.offset + a.size as u64,
                b.name,
                b.offset
            ));
        }
    }
    Ok(())
}
