//! The IREE backend: kiln-core's [`Backend`] on prepared StableHLO modules.
//! Weights and RoPE tables are uploaded once; the KV cache lives on the
//! device between steps and only logits come back to the host.

use std::collections::BTreeMap;

use kiln_core::weights::Weights;
use kiln_core::{Backend, Model};
use kiln_iree::{Device, DeviceTensor, Instance, Module, Tensor};

use crate::compiler::{Compiler, Target};
use crate::llama;
use crate::module_cache::{ModuleCache, Origin};
use crate::prepared;

/// Sequence lengths prefill is compiled for, and the context (KV cache)
/// length every module shares.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Buckets {
    pub prefill: Vec<usize>,
    pub context: usize,
}

impl Buckets {
    /// The buckets of [`Buckets::for_context`] for the model's
    /// `max_position_embeddings` capped at `max_context`.
    pub fn for_model(model: &Model, max_context: usize) -> Buckets {
        Buckets::for_context(model.config.max_position_embeddings.min(max_context))
    }

    /// Prefill buckets 16, 64, 128, 256, 512, 1024, 2048 below `context`, and
    /// `context` itself.
    pub fn for_context(context: usize) -> Buckets {
        let mut prefill: Vec<usize> = [16, 64, 128, 256, 512, 1024, 2048]
            .into_iter()
            .filter(|&b| b < context)
            .collect();
        prefill.push(context);
        Buckets { prefill, context }
    }
}

/// Which kind of module a compilation is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum ModuleKind {
    Prefill(usize),
    Decode,
}

/// The weight arguments, in [`llama::weight_shapes`] order. Matrices go in
/// transposed, `[in, out]`: IREE's llvm-cpu code decodes the ~100M-parameter
/// benchmark model 4x faster on that layout than on `[out, in]` (13.6 → 53.9
/// tok/s, `kiln-bench-decode --backend iree-cpu --model random-100m`).
fn weight_arguments(w: &Weights) -> Vec<Vec<f32>> {
    let mut args = vec![w.embed.data.clone()];
    for l in &w.layers {
        args.extend([
            l.attn_norm.clone(),
            l.wq.transposed(),
            l.wk.transposed(),
            l.wv.transposed(),
            l.wo.transposed(),
            l.mlp_norm.clone(),
            l.w_gate.transposed(),
            l.w_up.transposed(),
            l.w_down.transposed(),
        ]);
    }
    args.push(w.final_norm.clone());
    args.push(w.output().transposed());
    args
}

fn to_core(error: impl std::fmt::Display) -> kiln_core::Error {
    kiln_core::Error::Backend(error.to_string())
}

pub struct IreeBackend<'m> {
    model: &'m Model,
    name: String,
    target: Target,
    device: Device,
    /// `None` on a machine without the compiler: modules must be prepared.
    compiler: Option<Compiler>,
    cache: ModuleCache,
    buckets: Buckets,
    modules: BTreeMap<ModuleKind, Module>,
    weights: Vec<DeviceTensor>,
    cos: DeviceTensor,
    sin: DeviceTensor,
    /// K and V caches `[layers, context, kv_heads, head_dim]` on the device.
    kv: Option<(DeviceTensor, DeviceTensor)>,
    position: usize,
}

impl<'m> IreeBackend<'m> {
    /// Opens `device_uri` (`local-task`, `local-sync`, `cuda`) and uploads the
    /// weights. Modules compile on first use, or all at once in [`prepare`].
    ///
    /// [`prepare`]: IreeBackend::prepare
    pub fn new(
        model: &'m Model,
        device_uri: &str,
        target: Target,
        compiler: Option<Compiler>,
        cache: ModuleCache,
        buckets: Buckets,
    ) -> kiln_core::Result<IreeBackend<'m>> {
        let device = Instance::new()
            .and_then(|i| i.device(device_uri))
            .map_err(to_core)?;
        let upload = |shape: &[usize], data: Vec<f32>| {
            let shape: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
            Tensor::f32(&shape, data)
                .and_then(|t| device.upload(&t))
                .map_err(to_core)
        };
        let weights = llama::weight_shapes(&model.config)
            .iter()
            .zip(weight_arguments(&model.weights))
            .map(|(shape, data)| upload(shape, data))
            .collect::<kiln_core::Result<Vec<_>>>()?;
        let (cos, sin) = model.config.rope_tables(buckets.context);
        let half = model.config.head_dim / 2;
        let cos = upload(&[buckets.context, half], cos)?;
        let sin = upload(&[buckets.context, half], sin)?;
        Ok(IreeBackend {
            model,
            name: format!(
                "iree-{}",
                if target == Target::Cuda {
                    "cuda"
                } else {
                    "cpu"
                }
            ),
            target,
            device,
            compiler,
            cache,
            buckets,
            modules: BTreeMap::new(),
            weights,
            cos,
            sin,
            kv: None,
            position: 0,
        })
    }

    pub fn buckets(&self) -> &Buckets {
        &self.buckets
    }

    /// Every module this backend can use.
    pub fn module_kinds(&self) -> Vec<ModuleKind> {
        prepared::module_kinds(&self.buckets)
    }

    /// Finds (or compiles) and loads one module.
    pub fn load(&mut self, kind: ModuleKind) -> kiln_core::Result<Origin> {
        if self.modules.contains_key(&kind) {
            return Ok(Origin::Cached);
        }
        let (vmfb, origin) = prepared::obtain(
            &self.model.config,
            kind,
            &self.buckets,
            self.target,
            self.compiler.as_ref(),
            &self.cache,
        )
        .map_err(to_core)?;
        let module = self.device.load_module(&vmfb).map_err(to_core)?;
        self.modules.insert(kind, module);
        Ok(origin)
    }

    fn call(
        &mut self,
        kind: ModuleKind,
        function: &str,
        head: Vec<DeviceTensor>,
        kv: Option<(DeviceTensor, DeviceTensor)>,
    ) -> kiln_core::Result<Vec<f32>> {
        self.load(kind)?;
        let module = &self.modules[&kind];
        let mut inputs: Vec<&DeviceTensor> = head.iter().collect();
        if let Some((k, v)) = &kv {
            inputs.extend([k, v]);
        }
        inputs.extend([&self.cos, &self.sin]);
        inputs.extend(self.weights.iter());
        let mut outputs = module.invoke(function, &inputs).map_err(to_core)?;
        if outputs.len() != 3 {
            return Err(to_core(format!(
                "{function} returned {} outputs, expected 3",
                outputs.len()
            )));
        }
        let v = outputs.pop().expect("three outputs");
        let k = outputs.pop().expect("three outputs");
        let logits = outputs
            .pop()
            .expect("three outputs")
            .read()
            .map_err(to_core)?;
        self.kv = Some((k, v));
        logits.as_f32().map(<[f32]>::to_vec).map_err(to_core)
    }

    fn scalar(&self, value: usize) -> kiln_core::Result<DeviceTensor> {
        let t = Tensor::i32(&[], vec![value as i32]).map_err(to_core)?;
        self.device.upload(&t).map_err(to_core)
    }

    /// The smallest prefill bucket that holds `n` rows.
    fn bucket_for(&self, n: usize) -> kiln_core::Result<usize> {
        if n == 0 {
            return Err(kiln_core::Error::Invalid("the prompt is empty".into()));
        }
        self.buckets.prefill.iter().copied().find(|&b| b >= n).ok_or_else(|| {
            kiln_core::Error::Invalid(format!(
                "the prompt has {n} tokens, more than the largest prefill bucket ({}) of the {} backend; \
                 shorten the prompt",
                self.buckets.prefill.last().copied().unwrap_or(0),
                self.name
            ))
        })
    }
}

impl Backend for IreeBackend<'_> {
    fn name(&self) -> &str {
        &self.name
    }

    fn max_context(&self) -> usize {
        self.buckets.context
    }

    fn prefill(&mut self, tokens: &[u32]) -> kiln_core::Result<Vec<f32>> {
        kiln_core::backend::check_tokens(self.model, tokens)?;
        let seq = self.bucket_for(tokens.len())?;
        let mut ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        ids.resize(seq, 0);
        let ids = Tensor::i32(&[seq as i64], ids)
            .and_then(|t| self.device.upload(&t))
            .map_err(to_core)?;
        let length = self.scalar(tokens.len())?;
        let logits = self.call(
            ModuleKind::Prefill(seq),
            "prefill_ids",
            vec![ids, length],
            None,
        )?;
        self.position = tokens.len();
        Ok(logits)
    }

    fn prefill_embeddings(&mut self, embeddings: &[f32]) -> kiln_core::Result<Vec<f32>> {
        let h = self.model.config.hidden_size;
        if embeddings.is_empty() || !embeddings.len().is_multiple_of(h) {
            return Err(kiln_core::Error::Invalid(format!(
                "embeddings must be a positive number of rows of {h} values, got {}",
                embeddings.len()
            )));
        }
        let n = embeddings.len() / h;
        let seq = self.bucket_for(n)?;
        let mut rows = embeddings.to_vec();
        rows.resize(seq * h, 0.0);
        let input = Tensor::f32(&[seq as i64, h as i64], rows)
            .and_then(|t| self.device.upload(&t))
            .map_err(to_core)?;
        let length = self.scalar(n)?;
        let logits = self.call(
            ModuleKind::Prefill(seq),
            "prefill_embeddings",
            vec![input, length],
            None,
        )?;
        self.position = n;
        Ok(logits)
    }

    fn decode(&mut self, token: u32) -> kiln_core::Result<Vec<f32>> {
        kiln_core::backend::check_tokens(self.model, &[token])?;
        let kv = self
            .kv
            .take()
            .ok_or_else(|| kiln_core::Error::Invalid("decode before prefill".into()))?;
        if self.position >= self.buckets.context {
            self.kv = Some(kv);
            return Err(kiln_core::Error::ContextFull {
                needed: self.position + 1,
                limit: self.buckets.context,
            });
        }
        let token = Tensor::i32(&[1], vec![token as i32])
            .and_then(|t| self.device.upload(&t))
            .map_err(to_core)?;
        let pos = self.scalar(self.position)?;
        let logits = self.call(
            ModuleKind::Decode,
            "decode_step",
            vec![token, pos],
            Some(kv),
        )?;
        self.position += 1;
        Ok(logits)
    }
}
