//! Model weights: Hugging Face Llama safetensors (f32, f16 or bf16; one file
//! or shards), held as f32.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use safetensors::{Dtype, SafeTensors};

use crate::config::ModelConfig;
use crate::error::{Error, Result};

/// A row-major matrix, `[rows, cols]` (a Linear layer's `[out, in]`).
#[derive(Clone, Debug, PartialEq)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

impl Matrix {
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.cols..(i + 1) * self.cols]
    }

    /// The data of the transpose, `[cols, rows]` row-major.
    pub fn transposed(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.data.len()];
        for r in 0..self.rows {
            for (c, value) in self.row(r).iter().enumerate() {
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
}

#[derive(Clone, Debug)]
pub struct Weights {
    pub embed: Matrix,
    pub layers: Vec<LayerWeights>,
    pub final_norm: Vec<f32>,
    /// `None` when the output projection is tied to `embed`.
    pub lm_head: Option<Matrix>,
}

impl Weights {
    /// The output projection, `[vocab, hidden]`.
    pub fn output(&self) -> &Matrix {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }
}

/// Every tensor of the model's safetensors files, by name, as f32.
struct TensorTable {
    tensors: HashMap<String, (Vec<usize>, Vec<f32>)>,
    origin: PathBuf,
}

impl TensorTable {
    fn take(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let (actual, data) = self.tensors.remove(name).ok_or_else(|| Error::Weights {
            path: self.origin.clone(),
            message: format!("tensor {name} is missing"),
        })?;
        if actual != shape {
            return Err(Error::Weights {
                path: self.origin.clone(),
                message: format!(
                    "tensor {name} has shape {actual:?}, the config implies {shape:?}"
                ),
            });
        }
        Ok(data)
    }

    fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
        Ok(Matrix {
            rows,
            cols,
            data: self.take(name, &[rows, cols])?,
        })
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
    let mut table = TensorTable {
        tensors: HashMap::new(),
        origin: dir.to_path_buf(),
    };
    for file in &files {
        read_file(file, &mut table.tensors)?;
    }
    from_table(table, config)
}

fn read_file(path: &Path, out: &mut HashMap<String, (Vec<usize>, Vec<f32>)>) -> Result<()> {
    let bytes = std::fs::read(path).map_err(|error| Error::Io {
        path: path.to_path_buf(),
        error,
    })?;
    let bad = |message: String| Error::Weights {
        path: path.to_path_buf(),
        message,
    };
    let tensors = SafeTensors::deserialize(&bytes)
        .map_err(|e| bad(format!("not a safetensors file: {e}")))?;
    for (name, view) in tensors.tensors() {
        let data = view.data();
        let values = match view.dtype() {
            Dtype::F32 => data
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                .collect(),
            Dtype::F16 => data
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes(c.try_into().expect("2 bytes")).to_f32())
                .collect(),
            Dtype::BF16 => data
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes(c.try_into().expect("2 bytes")).to_f32())
                .collect(),
            other => {
                return Err(bad(format!(
                    "tensor {name} is {other:?}; kiln reads f32, f16 and bf16"
                )));
            }
        };
        if out
            .insert(name.clone(), (view.shape().to_vec(), values))
            .is_some()
        {
            return Err(bad(format!("tensor {name} appears in more than one file")));
        }
    }
    Ok(())
}

fn from_table(mut t: TensorTable, c: &ModelConfig) -> Result<Weights> {
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
        });
    }
    let final_norm = t.take("model.norm.weight", &[h])?;
    let lm_head = if c.tie_word_embeddings {
        // A tied checkpoint may still carry a copy of the embedding; it is unused.
        t.tensors.remove("lm_head.weight");
        None
    } else {
        Some(t.matrix("lm_head.weight", v, h)?)
    };
    Ok(Weights {
        embed,
        layers,
        final_norm,
        lm_head,
    })
}
