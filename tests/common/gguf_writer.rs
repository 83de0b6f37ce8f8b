//! A GGUF v3 writer for the tests that need files no released model has
//! (a tiny model, a damaged header) or a released vocabulary written as
//! llama.cpp's converter writes it. Shared by tests/gguf_files.rs and
//! tests/released_files.rs (`#[path]` modules), each of which uses part.
#![allow(dead_code)]

/// A GGUF v3 file, written by hand.
#[derive(Default)]
pub struct Writer {
    pub kv: Vec<u8>,
    pub kv_count: u64,
    pub infos: Vec<u8>,
    pub data: Vec<u8>,
    pub tensor_count: u64,
}

pub fn string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

pub enum V<'a> {
    U32(u32),
    U64(u64),
    F32(f32),
    Bool(bool),
    Str(&'a str),
    Strs(Vec<String>),
    I32s(Vec<i32>),
    F32s(Vec<f32>),
}

impl Writer {
    pub fn kv(&mut self, key: &str, value: V) -> &mut Self {
        string(&mut self.kv, key);
        let out = &mut self.kv;
        match value {
            V::U32(v) => {
                out.extend(4u32.to_le_bytes());
                out.extend(v.to_le_bytes());
            }
            V::U64(v) => {
                out.extend(10u32.to_le_bytes());
                out.extend(v.to_le_bytes());
            }
            V::F32(v) => {
                out.extend(6u32.to_le_bytes());
                out.extend(v.to_le_bytes());
            }
            V::Bool(v) => {
                out.extend(7u32.to_le_bytes());
                out.push(v as u8);
            }
            V::Str(v) => {
                out.extend(8u32.to_le_bytes());
                string(out, v);
            }
            V::Strs(v) => {
                out.extend(9u32.to_le_bytes());
                out.extend(8u32.to_le_bytes());
                out.extend((v.len() as u64).to_le_bytes());
                v.iter().for_each(|s| string(out, s));
            }
            V::I32s(v) => {
                out.extend(9u32.to_le_bytes());
                out.extend(5u32.to_le_bytes());
                out.extend((v.len() as u64).to_le_bytes());
                v.iter().for_each(|i| out.extend(i.to_le_bytes()));
            }
            V::F32s(v) => {
                out.extend(9u32.to_le_bytes());
                out.extend(6u32.to_le_bytes());
                out.extend((v.len() as u64).to_le_bytes());
                v.iter().for_each(|f| out.extend(f.to_le_bytes()));
            }
        }
        self.kv_count += 1;
        self
    }

    /// An F32 tensor of GGUF dims `dims` (fastest first).
    pub fn tensor(&mut self, name: &str, dims: &[u64], values: &[f32]) -> &mut Self {
        while !self.data.len().is_multiple_of(32) {
            self.data.push(0);
        }
        string(&mut self.infos, name);
        self.infos.extend((dims.len() as u32).to_le_bytes());
        dims.iter().for_each(|d| self.infos.extend(d.to_le_bytes()));
        self.infos.extend(0u32.to_le_bytes());
        self.infos.extend((self.data.len() as u64).to_le_bytes());
        values
            .iter()
            .for_each(|v| self.data.extend(v.to_le_bytes()));
        self.tensor_count += 1;
        self
    }

    /// A Q8_0 tensor of GGUF dims `dims` (rows of a whole number of 32)
    /// written as llama.cpp's reference quantizer writes `values`: per
    /// block d = largest magnitude / 127, q = round(value / d), d stored as
    /// f16. Returns each block's (d, q) as written.
    pub fn tensor_q8_0(
        &mut self,
        name: &str,
        dims: &[u64],
        values: &[f32],
    ) -> Vec<(half::f16, [i8; 32])> {
        while !self.data.len().is_multiple_of(32) {
            self.data.push(0);
        }
        string(&mut self.infos, name);
        self.infos.extend((dims.len() as u32).to_le_bytes());
        dims.iter().for_each(|d| self.infos.extend(d.to_le_bytes()));
        self.infos.extend(8u32.to_le_bytes());
        self.infos.extend((self.data.len() as u64).to_le_bytes());
        let mut blocks = Vec::new();
        for block in values.chunks_exact(32) {
            let largest = block.iter().fold(0.0f32, |a, v| a.max(v.abs()));
            let d = largest / 127.0;
            let inverse = if d > 0.0 { 1.0 / d } else { 0.0 };
            let mut q = [0i8; 32];
            for (q, v) in q.iter_mut().zip(block) {
                *q = (v * inverse).round() as i8;
            }
            let stored = half::f16::from_f32(d);
            self.data.extend(stored.to_bits().to_le_bytes());
            self.data.extend(q.iter().map(|&v| v as u8));
            blocks.push((stored, q));
        }
        self.tensor_count += 1;
        blocks
    }

    pub fn bytes(&self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend(self.tensor_count.to_le_bytes());
        out.extend(self.kv_count.to_le_bytes());
        out.extend(&self.kv);
        out.extend(&self.infos);
        while !out.len().is_multiple_of(32) {
            out.push(0);
        }
        out.extend(&self.data);
        out
    }
}

/// The keys of a SentencePiece (`llama`) vocabulary as llama.cpp's
/// converter writes them: pieces, their types (SentencePiece's piece kinds,
/// which GGUF's token types number alike) and scores; BOS 1, EOS 2,
/// unknown 0.
pub fn sentencepiece_vocabulary(
    w: &mut Writer,
    tokens: Vec<String>,
    types: Vec<i32>,
    scores: Vec<f32>,
) -> &mut Writer {
    w.kv("tokenizer.ggml.model", V::Str("llama"))
        .kv("tokenizer.ggml.bos_token_id", V::U32(1))
        .kv("tokenizer.ggml.eos_token_id", V::U32(2))
        .kv("tokenizer.ggml.unknown_token_id", V::U32(0))
        .kv("tokenizer.ggml.tokens", V::Strs(tokens))
        .kv("tokenizer.ggml.token_type", V::I32s(types))
        .kv("tokenizer.ggml.scores", V::F32s(scores))
}
