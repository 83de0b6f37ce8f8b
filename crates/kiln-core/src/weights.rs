//! Model weights: Hugging Face Llama safetensors (f32, f16 or bf16; one file
//! or shards), each matrix held at the precision its file stores it in.

use std::borrow::Cow;
use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::gguf::GgmlType;

/// A row-major matrix, `[rows, cols]` (a Linear layer's `[out, in]`), its
/// values as the model file stores them: an 8B model's Q4_0 matrices are
/// 4.5 GB as blocks and 32 GB as f32, so a backend that keeps the file's
/// precision must get the file's own values, and one that computes in f32
/// widens one matrix at a time ([`Matrix::f32`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    values: Values,
}

/// A matrix's values at the precision they were stored in.
#[derive(Clone, Debug, PartialEq)]
pub enum Values {
    F32(Vec<f32>),
    F16(Vec<f16>),
    Bf16(Vec<bf16>),
    /// GGUF blocks of one ggml type, each row a whole number of blocks, as
    /// the file lays them out.
    Blocks {
        ty: GgmlType,
        bytes: Vec<u8>,
    },
}

impl Values {
    /// Values held, or `None` where the bytes of blocks are not whole blocks.
    fn len(&self) -> Option<usize> {
        Some(match self {
            Values::F32(v) => v.len(),
            Values::F16(v) => v.len(),
            Values::Bf16(v) => v.len(),
            Values::Blocks { ty, bytes } => {
                let (block, block_bytes) = ty.block();
                if !bytes.len().is_multiple_of(block_bytes) {
                    return None;
                }
                bytes.len() / block_bytes * block
            }
        })
    }

    /// Every value in f32.
    pub fn into_f32(self) -> Vec<f32> {
        match self {
            Values::F32(v) => v,
            Values::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
            Values::Bf16(v) => v.iter().map(|x| x.to_f32()).collect(),
            Values::Blocks { ty, bytes } => {
                let n = bytes.len() / ty.block().1 * ty.block().0;
                crate::gguf::dequantize(ty, &bytes, n).expect("whole blocks")
            }
        }
    }

    /// An error naming the first NaN or infinity of tensor `name` (of
    /// blocks, the first non-finite scale: their other fields are
    /// integers): such a weight makes every logit NaN, which greedy
    /// decoding would read as token 0.
    pub fn check_finite(&self, name: &str) -> std::result::Result<(), String> {
        match self {
            Values::F32(v) => check_finite(name, v.iter().copied()),
            Values::F16(v) => check_finite(name, v.iter().map(|x| x.to_f32())),
            Values::Bf16(v) => check_finite(name, v.iter().map(|x| x.to_f32())),
            Values::Blocks { ty, bytes } => match crate::gguf::non_finite_block(*ty, bytes) {
                Some((block, v)) => Err(format!(
                    "tensor {name} holds a scale of {v} in block {block}; the file is corrupt"
                )),
                None => Ok(()),
            },
        }
    }

    /// How the values are stored, as [`Weights::stored`] names it.
    pub fn stored(&self) -> Stored {
        match self {
            Values::F32(_) => Stored::F32,
            Values::F16(_) => Stored::F16,
            Values::Bf16(_) => Stored::BF16,
            Values::Blocks { ty, .. } => Stored::Blocks(ty.name()),
        }
    }
}

/// Each part's values, where `get` takes them out of every part.
fn every<'a, T: 'a>(
    parts: &[&'a Matrix],
    get: impl Fn(&'a Values) -> Option<&'a Vec<T>>,
) -> Option<Vec<&'a [T]>> {
    parts
        .iter()
        .map(|m| get(&m.values).map(Vec::as_slice))
        .collect()
}

impl Matrix {
    /// `rows × cols` f32 values, row-major.
    pub fn new(rows: usize, cols: usize, data: Vec<f32>) -> Matrix {
        assert_eq!(data.len(), rows * cols, "a {rows}x{cols} matrix");
        Matrix {
            rows,
            cols,
            values: Values::F32(data),
        }
    }

    /// `rows × cols` values as stored, checked to be that many (blocks: each
    /// row whole blocks).
    pub fn stored(rows: usize, cols: usize, values: Values) -> std::result::Result<Matrix, String> {
        if let Values::Blocks { ty, .. } = &values {
            let block = ty.block().0;
            if !cols.is_multiple_of(block) {
                return Err(format!(
                    "rows of {cols} values are not whole {} blocks of {block}",
                    ty.name()
                ));
            }
        }
        match values.len() {
            Some(n) if n == rows * cols => Ok(Matrix { rows, cols, values }),
            _ => Err(format!(
                "{} values do not make a {rows}x{cols} matrix",
                values.stored()
            )),
        }
    }

    /// `rows × cols` with element `i` (row-major) `value(i)`.
    pub fn from_fn(rows: usize, cols: usize, value: impl Fn(usize) -> f32) -> Matrix {
        Matrix::new(rows, cols, (0..rows * cols).map(value).collect())
    }

    /// The values as stored.
    pub fn values(&self) -> &Values {
        &self.values
    }

    /// The block type and bytes, where the values are GGUF blocks.
    pub fn blocks(&self) -> Option<(GgmlType, &[u8])> {
        match &self.values {
            Values::Blocks { ty, bytes } => Some((*ty, bytes)),
            _ => None,
        }
    }

    /// Whether the values are f32 already ([`Matrix::f32`] borrows them).
    pub fn is_f32(&self) -> bool {
        matches!(self.values, Values::F32(_))
    }

    /// Every value in f32, row-major: borrowed where they are stored so,
    /// else widened (blocks dequantized) into a new vector.
    pub fn f32(&self) -> Cow<'_, [f32]> {
        match &self.values {
            Values::F32(v) => Cow::Borrowed(v),
            _ => Cow::Owned(self.rows_f32(0..self.rows)),
        }
    }

    /// The values of `rows` in f32, row-major.
    pub fn rows_f32(&self, rows: Range<usize>) -> Vec<f32> {
        let (start, end) = (rows.start * self.cols, rows.end * self.cols);
        match &self.values {
            Values::F32(v) => v[start..end].to_vec(),
            Values::F16(v) => v[start..end].iter().map(|x| x.to_f32()).collect(),
            Values::Bf16(v) => v[start..end].iter().map(|x| x.to_f32()).collect(),
            Values::Blocks { ty, bytes } => {
                let (block, block_bytes) = ty.block();
                let span = &bytes[start / block * block_bytes..end / block * block_bytes];
                crate::gguf::dequantize(*ty, span, end - start)
                    .expect("Matrix::stored checked the blocks' size")
            }
        }
    }

    /// The values, widened to f32 in place first where they are not, to
    /// change.
    pub fn f32_mut(&mut self) -> &mut Vec<f32> {
        if !self.is_f32() {
            self.values = Values::F32(self.f32().into_owned());
        }
        match &mut self.values {
            Values::F32(v) => v,
            _ => unreachable!("widened above"),
        }
    }

    /// The values in f32, row-major.
    pub fn into_f32(self) -> Vec<f32> {
        self.values.into_f32()
    }

    /// This matrix with its values in f32.
    pub fn widened(&self) -> Matrix {
        Matrix::new(self.rows, self.cols, self.f32().into_owned())
    }

    /// Row `i` in f32.
    pub fn row(&self, i: usize) -> Cow<'_, [f32]> {
        match &self.values {
            Values::F32(v) => Cow::Borrowed(&v[i * self.cols..(i + 1) * self.cols]),
            _ => Cow::Owned(self.rows_f32(i..i + 1)),
        }
    }

    /// This matrix's rows in the order `order` gives (row `k` of the result
    /// is row `order[k]` of this one), at the precision they are stored in.
    pub fn reorder_rows(&self, order: impl Iterator<Item = usize>) -> Matrix {
        Matrix::join_rows(&[self], order.map(|r| (0, r)))
    }

    /// Rows of several matrices of one width as one matrix: row `k` of the
    /// result is row `r` of `parts[p]` for the `k`-th `(p, r)` of `order`.
    /// The values stay as stored where every part stores them alike (the
    /// same type, or blocks of one type); else all are widened to f32.
    pub fn join_rows(parts: &[&Matrix], order: impl Iterator<Item = (usize, usize)>) -> Matrix {
        fn pick<'a, T: Copy + 'a>(
            parts: &[&'a [T]],
            width: usize,
            order: impl Iterator<Item = (usize, usize)>,
        ) -> Vec<T> {
            order
                .flat_map(|(p, r)| parts[p][r * width..(r + 1) * width].iter().copied())
                .collect()
        }
        let cols = parts[0].cols;
        assert!(parts.iter().all(|m| m.cols == cols), "join_rows: one width");
        let order: Vec<(usize, usize)> = order.collect();
        let rows = order.len();
        let order = order.into_iter();
        let width = |ty: GgmlType| cols / ty.block().0 * ty.block().1;
        let values = if let Some(v) = every(parts, |v| match v {
            Values::F32(v) => Some(v),
            _ => None,
        }) {
            Values::F32(pick(&v, cols, order))
        } else if let Some(v) = every(parts, |v| match v {
            Values::F16(v) => Some(v),
            _ => None,
        }) {
            Values::F16(pick(&v, cols, order))
        } else if let Some(v) = every(parts, |v| match v {
            Values::Bf16(v) => Some(v),
            _ => None,
        }) {
            Values::Bf16(pick(&v, cols, order))
        } else if let Some((ty, v)) = parts[0].blocks().and_then(|(ty, _)| {
            every(parts, |v| match v {
                Values::Blocks { ty: t, bytes } if *t == ty => Some(bytes),
                _ => None,
            })
            .map(|v| (ty, v))
        }) {
            Values::Blocks {
                ty,
                bytes: pick(&v, width(ty), order),
            }
        } else {
            // Stored unlike: all widened.
            let widened: Vec<_> = parts.iter().map(|m| m.f32()).collect();
            let slices: Vec<&[f32]> = widened.iter().map(|w| &w[..]).collect();
            Values::F32(pick(&slices, cols, order))
        };
        Matrix { rows, cols, values }
    }

    /// The columns `range` of every row, as stored where whole blocks (or
    /// rows of f32, f16, bf16) can be cut there; else widened to f32.
    pub fn columns(&self, range: Range<usize>) -> Matrix {
        fn cut<T: Copy>(v: &[T], cols: usize, at: &Range<usize>) -> Vec<T> {
            v.chunks_exact(cols.max(1))
                .flat_map(|row| row[at.clone()].iter().copied())
                .collect()
        }
        let (cols, width) = (self.cols, range.len());
        let values = match &self.values {
            Values::F32(v) => Values::F32(cut(v, cols, &range)),
            Values::F16(v) => Values::F16(cut(v, cols, &range)),
            Values::Bf16(v) => Values::Bf16(cut(v, cols, &range)),
            Values::Blocks { ty, bytes }
                if range.start.is_multiple_of(ty.block().0)
                    && width.is_multiple_of(ty.block().0) =>
            {
                let (block, block_bytes) = ty.block();
                let at = range.start / block * block_bytes..range.end / block * block_bytes;
                Values::Blocks {
                    ty: *ty,
                    bytes: cut(bytes, cols / block * block_bytes, &at),
                }
            }
            Values::Blocks { .. } => Values::F32(cut(&self.f32(), cols, &range)),
        };
        Matrix {
            rows: self.rows,
            cols: width,
            values,
        }
    }

    /// Bytes of its values in memory.
    pub fn bytes(&self) -> usize {
        match &self.values {
            Values::F32(v) => 4 * v.len(),
            Values::F16(v) => 2 * v.len(),
            Values::Bf16(v) => 2 * v.len(),
            Values::Blocks { bytes, .. } => bytes.len(),
        }
    }

    /// The data of the transpose, `[cols, rows]` row-major, in f32.
    pub fn transposed(&self) -> Vec<f32> {
        let data = self.f32();
        let mut out = vec![0.0; data.len()];
        for (r, row) in data.chunks_exact(self.cols.max(1)).enumerate() {
            for (c, value) in row.iter().enumerate() {
                out[c * self.rows + r] = *value;
            }
        }
        out
    }
}

#[derive(Clone, Debug)]
pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub wq: Matrix,
    pub wk: Matrix,
    pub wv: Matrix,
    pub wo: Matrix,
    pub mlp_norm: Vec<f32>,
    pub w_gate: Matrix,
    pub w_up: Matrix,
    pub w_down: Matrix,
    /// `[q | k | v]` biases, where the model has them (Qwen2).
    pub qkv_bias: Option<Vec<f32>>,
}

impl LayerWeights {
    /// The layer's seven matrices: q, k, v, o, gate, up, down.
    pub fn matrices(&self) -> [&Matrix; 7] {
        [
            &self.wq,
            &self.wk,
            &self.wv,
            &self.wo,
            &self.w_gate,
            &self.w_up,
            &self.w_down,
        ]
    }

    /// [`LayerWeights::matrices`], to change.
    pub fn matrices_mut(&mut self) -> [&mut Matrix; 7] {
        [
            &mut self.wq,
            &mut self.wk,
            &mut self.wv,
            &mut self.wo,
            &mut self.w_gate,
            &mut self.w_up,
            &mut self.w_down,
        ]
    }
}

/// How a model file stores its layers' weight matrices: the model's own
/// precision, which kiln changes only when asked (`--precision`, or a
/// backend that rounds, named by the user).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stored {
    F32,
    F16,
    BF16,
    /// GGUF blocks of one ggml type (`Q8_0`, `Q4_0`, `Q4_1`, `Q4_K`, ...).
    Blocks(&'static str),
    /// Layers in several types (a GGUF Q4_K_M mixes Q4_K and Q6_K).
    Mixed,
}

impl Stored {
    /// The one kind every item of `kinds` is, or [`Stored::Mixed`];
    /// [`Stored::F32`] for none (a model built in memory).
    pub fn of_all(kinds: impl IntoIterator<Item = Stored>) -> Stored {
        let mut kinds = kinds.into_iter();
        let Some(first) = kinds.next() else {
            return Stored::F32;
        };
        match kinds.all(|k| k == first) {
            true => first,
            false => Stored::Mixed,
        }
    }
}

impl std::fmt::Display for Stored {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Stored::F32 => f.write_str("f32"),
            Stored::F16 => f.write_str("f16"),
            Stored::BF16 => f.write_str("bf16"),
            Stored::Blocks(name) => write!(f, "{name} blocks"),
            Stored::Mixed => f.write_str("several types"),
        }
    }
}

#[derive(Clone, Debug)]
pub struct Weights {
    pub embed: Matrix,
    pub layers: Vec<LayerWeights>,
    pub final_norm: Vec<f32>,
    /// `None` when the output projection is tied to `embed`.
    pub lm_head: Option<Matrix>,
    /// How the file stored the layers' matrices (all of them f32 here).
    pub stored: Stored,
}

impl Weights {
    /// The output projection, `[vocab, hidden]`.
    pub fn output(&self) -> &Matrix {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// Every matrix: the embedding, each layer's seven, the untied output
    /// projection.
    pub fn all_matrices(&self) -> impl Iterator<Item = &Matrix> {
        std::iter::once(&self.embed)
            .chain(self.layers.iter().flat_map(|l| l.matrices()))
            .chain(self.lm_head.as_ref())
    }

    /// Whether every matrix holds f32 values.
    pub fn is_f32(&self) -> bool {
        self.all_matrices().all(Matrix::is_f32)
    }

    /// These weights with every matrix in f32 (what the reference computes
    /// with).
    pub fn widened(&self) -> Weights {
        let mut layers = self.layers.clone();
        for m in layers.iter_mut().flat_map(|l| l.matrices_mut()) {
            m.f32_mut();
        }
        Weights {
            embed: self.embed.widened(),
            layers,
            final_norm: self.final_norm.clone(),
            lm_head: self.lm_head.as_ref().map(Matrix::widened),
            stored: self.stored,
        }
    }

    /// Bytes the matrices hold in memory.
    pub fn matrix_bytes(&self) -> usize {
        self.all_matrices().map(Matrix::bytes).sum()
    }

    /// These weights with every product's matrix (each layer's seven and
    /// the output projection, untied) replaced by `f` of it; the embedding
    /// and norms as they are.
    pub fn try_map_products<E>(
        &self,
        f: impl Fn(&Matrix) -> std::result::Result<Matrix, E>,
    ) -> std::result::Result<Weights, E> {
        let mut layers = self.layers.clone();
        for m in layers.iter_mut().flat_map(|l| l.matrices_mut()) {
            *m = f(m)?;
        }
        Ok(Weights {
            embed: self.embed.clone(),
            layers,
            final_norm: self.final_norm.clone(),
            lm_head: Some(f(self.output())?),
            stored: self.stored,
        })
    }
}

/// The tensors of a model's safetensors files, by name. Each file is mapped
/// and its header validated (every tensor inside the file, the file no
/// longer than its tensors) before any tensor is read; a tensor is decoded
/// only when the model takes it.
struct TensorTable<'a> {
    files: Vec<(&'a Path, SafeTensors<'a>)>,
    /// The file of each tensor name.
    index: HashMap<String, usize>,
    origin: PathBuf,
    /// The dtype of each layer matrix taken, for [`Weights::stored`].
    matrix_dtypes: Vec<Stored>,
    /// The dtype of the tensor [`TensorTable::take`] read last.
    last_dtype: Stored,
}

impl<'a> TensorTable<'a> {
    fn new(origin: &Path, files: &[(&'a Path, &'a [u8])]) -> Result<TensorTable<'a>> {
        let mut table = TensorTable {
            files: Vec::with_capacity(files.len()),
            index: HashMap::new(),
            origin: origin.to_path_buf(),
            matrix_dtypes: Vec::new(),
            last_dtype: Stored::F32,
        };
        for &(path, bytes) in files {
            let tensors = SafeTensors::deserialize(bytes).map_err(|e| Error::Weights {
                path: path.to_path_buf(),
                message: format!("not a safetensors file: {e}"),
            })?;
            for name in tensors.names() {
                if table
                    .index
                    .insert(name.to_string(), table.files.len())
                    .is_some()
                {
                    return Err(Error::Weights {
                        path: path.to_path_buf(),
                        message: format!("tensor {name} appears in more than one file"),
                    });
                }
            }
            table.files.push((path, tensors));
        }
        Ok(table)
    }

    /// Decodes tensor `name`, which must have `shape`, to f32.
    fn take(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        Ok(self.take_values(name, shape)?.into_f32())
    }

    /// Tensor `name`, which must have `shape`, at its stored precision.
    fn take_values(&mut self, name: &str, shape: &[usize]) -> Result<Values> {
        let Some(file) = self.index.remove(name) else {
            return Err(Error::Weights {
                path: self.origin.clone(),
                message: format!("tensor {name} is missing"),
            });
        };
        let (path, tensors) = &self.files[file];
        let bad = |message: String| Error::Weights {
            path: path.to_path_buf(),
            message,
        };
        let view = tensors
            .tensor(name)
            .map_err(|e| bad(format!("tensor {name}: {e}")))?;
        if view.shape() != shape {
            return Err(bad(format!(
                "tensor {name} has shape {:?}, the config implies {shape:?}",
                view.shape()
            )));
        }
        let data = view.data();
        let values = match view.dtype() {
            Dtype::F32 => Values::F32(
                data.chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                    .collect(),
            ),
            Dtype::F16 => Values::F16(
                data.chunks_exact(2)
                    .map(|c| f16::from_le_bytes(c.try_into().expect("2 bytes")))
                    .collect(),
            ),
            Dtype::BF16 => Values::Bf16(
                data.chunks_exact(2)
                    .map(|c| bf16::from_le_bytes(c.try_into().expect("2 bytes")))
                    .collect(),
            ),
            other => {
                return Err(bad(format!(
                    "tensor {name} is {other:?}; kiln reads f32, f16 and bf16"
                )));
            }
        };
        self.last_dtype = values.stored();
        values.check_finite(name).map_err(bad)?;
        Ok(values)
    }

    fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
        let values = self.take_values(name, &[rows, cols])?;
        if name.starts_with("model.layers.") {
            self.matrix_dtypes.push(self.last_dtype);
        }
        Matrix::stored(rows, cols, values).map_err(|message| Error::Weights {
            path: self.origin.clone(),
            message: format!("tensor {name}: {message}"),
        })
    }

    /// Drops a tensor the model does not use, if present.
    fn skip(&mut self, name: &str) {
        self.index.remove(name);
    }
}

/// An error naming the first NaN or infinity of tensor `name`: such a
/// weight makes every logit NaN, which greedy decoding would read as token 0.
pub fn check_finite(
    name: &str,
    values: impl IntoIterator<Item = f32>,
) -> std::result::Result<(), String> {
    match values.into_iter().enumerate().find(|(_, v)| !v.is_finite()) {
        None => Ok(()),
        Some((i, v)) => Err(format!(
            "tensor {name} holds {v} at index {i}; the checkpoint is corrupt"
        )),
    }
}

/// Loads every `*.safetensors` file of `dir` and checks it against `config`.
pub fn load_dir(dir: &Path, config: &ModelConfig) -> Result<Weights> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|error| Error::Io {
            path: dir.to_path_buf(),
            error,
        })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(Error::Weights {
            path: dir.to_path_buf(),
            message: "no *.safetensors file in the model folder".into(),
        });
    }
    let maps = files
        .into_iter()
        .map(|path| map_file(&path).map(|map| (path, map)))
        .collect::<Result<Vec<_>>>()?;
    let files: Vec<(&Path, &[u8])> = maps.iter().map(|(p, m)| (p.as_path(), &m[..])).collect();
    from_safetensors(dir, &files, config)
}

/// The weights in the safetensors `files` (each a name for errors and its
/// bytes) of the model in `dir`, checked against `config`.
pub fn from_safetensors(
    dir: &Path,
    files: &[(&Path, &[u8])],
    config: &ModelConfig,
) -> Result<Weights> {
    from_table(TensorTable::new(dir, files)?, config)
}

/// Maps a regular file read-only.
fn map_file(path: &Path) -> Result<Mmap> {
    let (file, _) = crate::files::open_regular(path)?;
    // SAFETY: the mapping is read-only and private to kiln. Truncating or
    // rewriting a model file while kiln loads it is outside what kiln
    // defends against (whoever can do that chooses the model anyway); a
    // truncation while mapped raises SIGBUS on the next touch of a page
    // past the new end, which kills the process.
    unsafe { Mmap::map(&file) }.map_err(|error| Error::Io {
        path: path.to_path_buf(),
        error,
    })
}

fn from_table(mut t: TensorTable, c: &ModelConfig) -> Result<Weights> {
    c.validate().map_err(|message| Error::Weights {
        path: t.origin.clone(),
        message: format!("invalid config: {message}"),
    })?;
    let (h, i, v) = (c.hidden_size, c.intermediate_size, c.vocab_size);
    let q = c.num_heads * c.head_dim;
    let kv = c.num_kv_heads * c.head_dim;
    let embed = t.matrix("model.embed_tokens.weight", v, h)?;
    let mut layers = Vec::with_capacity(c.num_layers);
    for l in 0..c.num_layers {
        let p = format!("model.layers.{l}");
        layers.push(LayerWeights {
            attn_norm: t.take(&format!("{p}.input_layernorm.weight"), &[h])?,
            wq: t.matrix(&format!("{p}.self_attn.q_proj.weight"), q, h)?,
            wk: t.matrix(&format!("{p}.self_attn.k_proj.weight"), kv, h)?,
            wv: t.matrix(&format!("{p}.self_attn.v_proj.weight"), kv, h)?,
            wo: t.matrix(&format!("{p}.self_attn.o_proj.weight"), h, q)?,
            mlp_norm: t.take(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
            w_gate: t.matrix(&format!("{p}.mlp.gate_proj.weight"), i, h)?,
            w_up: t.matrix(&format!("{p}.mlp.up_proj.weight"), i, h)?,
            w_down: t.matrix(&format!("{p}.mlp.down_proj.weight"), h, i)?,
            qkv_bias: match c.qkv_bias {
                true => Some(
                    [("q", q), ("k", kv), ("v", kv)]
                        .iter()
                        .map(|(name, width)| {
                            t.take(&format!("{p}.self_attn.{name}_proj.bias"), &[*width])
                        })
                        .collect::<Result<Vec<_>>>()?
                        .concat(),
                ),
                false => None,
            },
        });
    }
    let final_norm = t.take("model.norm.weight", &[h])?;
    let lm_head = if c.tie_word_embeddings {
        // A tied checkpoint may still carry a copy of the embedding; it is unused.
        t.skip("lm_head.weight");
        None
    } else {
        Some(t.matrix("lm_head.weight", v, h)?)
    };
    Ok(Weights {
        embed,
        layers,
        final_norm,
        lm_head,
        stored: Stored::of_all(t.matrix_dtypes),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn as_stored(m: &Matrix, ty: GgmlType) -> Matrix {
        crate::gguf::quantize(m, ty).unwrap()
    }

    fn ramp(rows: usize, cols: usize, step: f32) -> Matrix {
        Matrix::from_fn(rows, cols, |i| ((i * 37 % 23) as f32 - 11.0) * step)
    }

    /// A matrix's rows joined, reordered or cut into columns keep the values
    /// as stored and give what the same cut of its f32 values gives.
    #[test]
    fn cuts_of_stored_values_stay_stored_and_widen_alike() {
        for ty in [GgmlType::Q4_0, GgmlType::Q8_0, GgmlType::F16] {
            let (a, b) = (
                as_stored(&ramp(3, 96, 0.01), ty),
                as_stored(&ramp(2, 96, 0.03), ty),
            );
            let (wa, wb) = (a.widened(), b.widened());
            let order = [(1, 0), (0, 2), (1, 1), (0, 0)];
            let joined = Matrix::join_rows(&[&a, &b], order.into_iter());
            assert_eq!(joined.values().stored(), a.values().stored(), "{ty:?}");
            assert_eq!(
                joined.f32(),
                Matrix::join_rows(&[&wa, &wb], order.into_iter()).f32(),
                "{ty:?}"
            );
            assert_eq!((joined.rows, joined.cols), (4, 96));
            assert_eq!(joined.row(1), wa.row(2), "{ty:?}");
            let cut = a.columns(32..96);
            assert_eq!(cut.values().stored(), a.values().stored(), "{ty:?}");
            assert_eq!(cut.f32(), wa.columns(32..96).f32(), "{ty:?}");
            // Columns inside a block are widened.
            let inside = a.columns(8..40);
            assert_eq!(inside.f32(), wa.columns(8..40).f32(), "{ty:?}");
            assert_eq!(inside.is_f32(), ty != GgmlType::F16, "{ty:?}");
        }
        // Parts stored alike no more are widened together.
        let (a, b) = (
            as_stored(&ramp(1, 64, 0.01), GgmlType::Q4_0),
            ramp(1, 64, 0.02),
        );
        let joined = Matrix::join_rows(&[&a, &b], [(0, 0), (1, 0)].into_iter());
        assert!(joined.is_f32());
        assert_eq!(joined.row(0), a.f32());
        assert_eq!(joined.row(1), b.f32());
    }

    #[test]
    fn values_that_do_not_fill_the_shape_are_refused() {
        let blocks = as_stored(&ramp(2, 64, 0.01), GgmlType::Q8_0)
            .values()
            .clone();
        assert!(Matrix::stored(2, 64, blocks.clone()).is_ok());
        assert!(Matrix::stored(3, 64, blocks.clone()).is_err());
        // The same 128 values as 4 rows of one block, but not as rows of 16.
        assert!(Matrix::stored(4, 32, blocks.clone()).is_ok());
        assert!(
            Matrix::stored(8, 16, blocks)
                .unwrap_err()
                .contains("whole Q8_0 blocks")
        );
    }
}
