//! The IREE backend: kiln-core's [`Backend`] on prepared StableHLO modules.
//! Weights and RoPE tables are uploaded once; the KV cache lives on the
//! device between steps, updated in place. Greedy decoding reads back only
//! the chosen token, and feeds the device's own token and position tensors
//! to the next step, so a step uploads nothing.

use std::collections::BTreeMap;

use half::{bf16, f16};
use kiln_core::{Backend, Model};
use kiln_iree::{
    Device, DeviceTensor, Fence, Instance, Module, PendingRead, Reader, Tensor, World,
};

use crate::compiler::{Compiler, Target};
use crate::graph::{GraphOptions, Precision};
use crate::module_cache::{ModuleCache, Origin};
use crate::plan::{self, APPEND_ROWS, Buckets, ModuleKind};
use crate::prepared;

/// `values` as a tensor of `shape` at `precision`'s storage type.
fn stored(
    precision: Precision,
    shape: &[i64],
    values: impl Iterator<Item = f32>,
) -> kiln_iree::Result<Tensor> {
    match precision {
        Precision::F32 => Tensor::f32(shape, values.collect()),
        Precision::F16 | Precision::Q4 | Precision::Q8 => {
            Tensor::f16(shape, values.map(f16::from_f32).collect())
        }
        Precision::Bf16 => Tensor::bf16(shape, values.map(bf16::from_f32).collect()),
    }
}

fn to_core(error: impl std::fmt::Display) -> kiln_core::Error {
    kiln_core::Error::Backend(error.to_string())
}

/// What the last decode step left on the device for the next one: the greedy
/// token it chose and the position after it.
struct NextStep {
    token: u32,
    position: usize,
    token_tensor: DeviceTensor,
    position_tensor: DeviceTensor,
}

/// A decode step [`IreeBackend::decode_greedy`] queued ahead of its caller:
/// it decodes `token` (the greedy choice of the step before, which the
/// device fed it) at `position`, and is used if the caller continues with
/// that token there.
struct Queued {
    token: u32,
    position: usize,
    /// Greedy steps the call runs (1: `decode_step`, more: `decode_chain`).
    steps: usize,
    /// `[logits or chosen tokens, next token, next position]`, defined once
    /// the backend's `kv_ready` fence is reached.
    outputs: Vec<DeviceTensor>,
}

/// Tokens a chained greedy call chose beyond the one it returned: each is
/// returned in turn while the caller continues with the one before it
/// (`expect`) at `position`.
struct ChosenAhead {
    expect: u32,
    position: usize,
    tokens: std::collections::VecDeque<u32>,
}

/// The most greedy steps one call may chain (`--steps-per-call`): compile
/// time and the tokens wasted past a stop grow with it.
pub const MAX_STEPS_PER_CALL: usize = 16;

/// Checks a number of greedy steps per call (see
/// [`IreeBackend::set_steps_per_call`]).
pub fn check_steps_per_call(steps: usize) -> kiln_core::Result<()> {
    if (1..=MAX_STEPS_PER_CALL).contains(&steps) {
        return Ok(());
    }
    Err(kiln_core::Error::Invalid(format!(
        "--steps-per-call {steps}: a call chains 1 to {MAX_STEPS_PER_CALL} greedy steps"
    )))
}

pub struct IreeBackend<'m> {
    model: &'m Model,
    name: String,
    target: Target,
    graph: GraphOptions,
    device: Device,
    /// Reads logits and tokens back without a staging allocation per read.
    reader: Reader,
    /// `None` on a machine without the compiler: modules must be prepared.
    compiler: Option<Compiler>,
    cache: ModuleCache,
    buckets: Buckets,
    modules: BTreeMap<ModuleKind, Module>,
    /// Every weight in one buffer, as [`crate::llama::weight_shapes`] lists
    /// them (two at q4).
    weights: Vec<DeviceTensor>,
    cos: DeviceTensor,
    sin: DeviceTensor,
    /// K and V caches `[layers, context, kv_heads, head_dim]` on the device.
    kv: Option<(DeviceTensor, DeviceTensor)>,
    /// Reached when the last queued decode step, the caches' last writer,
    /// is done; `None` when nothing is in flight.
    kv_ready: Option<Fence>,
    position: usize,
    next: Option<NextStep>,
    queued: Option<Queued>,
    /// Whether greedy decoding queues each step before reading the token
    /// of the one before (see [`IreeBackend::decode_greedy`]).
    pipelined: bool,
    /// Greedy steps per call of the device (1: `decode_step` alone).
    steps_per_call: usize,
    chosen_ahead: Option<ChosenAhead>,
    /// The device has joined its tensor-parallel world (or needs none).
    in_world: bool,
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
        graph: GraphOptions,
        compiler: Option<Compiler>,
        cache: ModuleCache,
        buckets: Buckets,
    ) -> kiln_core::Result<IreeBackend<'m>> {
        // Every size below is a product of the config's: bounded only if valid.
        model.config.validate().map_err(kiln_core::Error::Invalid)?;
        let device = Instance::new()
            .and_then(|i| i.device(device_uri))
            .map_err(to_core)?;
        graph.check_for(target).map_err(kiln_core::Error::Invalid)?;
        let mut in_world = false;
        match graph.tensor_parallel {
            None => {}
            // A world of one: the graph's collectives through the device's
            // channel (NCCL on CUDA) with nobody else.
            Some(1) => {
                device.join_world(&World::alone()).map_err(to_core)?;
                in_world = true;
            }
            // The caller joins the world (`join_world`) before the first call.
            Some(_) => {}
        }
        let upload = |shape: &[i64], data: Vec<f32>| {
            Tensor::f32(shape, data)
                .and_then(|t| device.upload(&t))
                .map_err(to_core)
        };
        let rows = graph.output_rows(model.config.vocab_size);
        if model.weights.output().rows > rows {
            return Err(kiln_core::Error::Invalid(format!(
                "a tensor-parallel rank's graphs hold {rows} rows of the output projection, \
                 not the model's {}: open a rank's slice (ShardPlan::rank_model)",
                model.weights.output().rows
            )));
        }
        let weights = crate::pack::packed_weights(model, &graph)?
            .into_iter()
            .map(|t| device.upload(&t).map_err(to_core))
            .collect::<kiln_core::Result<Vec<_>>>()?;
        let (cos, sin) = model.config.rope_tables(buckets.context)?;
        let rows = [buckets.context as i64, model.config.head_dim as i64 / 2];
        let cos = upload(&rows, cos)?;
        let sin = upload(&rows, sin)?;
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
            graph,
            reader: device.reader().map_err(to_core)?,
            device,
            compiler,
            cache,
            buckets,
            modules: BTreeMap::new(),
            weights,
            cos,
            sin,
            kv: None,
            kv_ready: None,
            position: 0,
            next: None,
            queued: None,
            pipelined: true,
            steps_per_call: 1,
            chosen_ahead: None,
            in_world,
        })
    }

    /// Makes this backend's device rank `world.rank` of the world its
    /// tensor-parallel graphs sum over; before the first module is loaded.
    pub fn join_world(&mut self, world: &World) -> kiln_core::Result<()> {
        let ranks = self.graph.tensor_parallel;
        if ranks != Some(world.count as usize) {
            return Err(kiln_core::Error::Invalid(format!(
                "a world of {} ranks, but the graphs are for {ranks:?}",
                world.count
            )));
        }
        if !self.modules.is_empty() {
            return Err(kiln_core::Error::Invalid(
                "join the world before the first module is loaded".into(),
            ));
        }
        self.device.join_world(world).map_err(to_core)?;
        self.in_world = true;
        Ok(())
    }

    pub fn buckets(&self) -> &Buckets {
        &self.buckets
    }

    /// Turns the greedy pipeline on (the default) or off: off, each greedy
    /// step is queued only once the token before it is read, so the device
    /// waits while the host reads and queues; the results are the same.
    pub fn set_pipelined(&mut self, on: bool) {
        self.pipelined = on;
    }

    /// Greedy decode steps one call of the device runs, 1 to
    /// [`MAX_STEPS_PER_CALL`]: with more than one, greedy decoding runs
    /// `decode_chain` (the host's work per call is spread over the steps,
    /// and the tokens come back in groups of that many), and single steps
    /// only where the context has no room for a whole chain.
    pub fn set_steps_per_call(&mut self, steps: usize) -> kiln_core::Result<()> {
        check_steps_per_call(steps)?;
        self.steps_per_call = steps;
        Ok(())
    }

    /// The greedy steps of a call at `position`: a whole chain where the
    /// context holds its rows, one step otherwise.
    fn steps_at(&self, position: usize) -> usize {
        match self.steps_per_call {
            n if n > 1 && position + n <= self.buckets.context => n,
            _ => 1,
        }
    }

    /// Waits for queued decode steps and drops a step queued ahead and
    /// the tokens a chain chose ahead: what comes next may read the caches,
    /// or write them out of turn.
    fn settle(&mut self) -> kiln_core::Result<()> {
        self.queued = None;
        self.chosen_ahead = None;
        if let Some(fence) = self.kv_ready.take() {
            fence.wait().map_err(to_core)?;
        }
        Ok(())
    }

    /// Every module this backend can use.
    pub fn module_kinds(&self) -> Vec<ModuleKind> {
        plan::module_kinds(&self.buckets, self.steps_per_call)
    }

    /// The modules loaded so far (each on first use, or by [`load`]).
    ///
    /// [`load`]: IreeBackend::load
    pub fn loaded_modules(&self) -> Vec<ModuleKind> {
        self.modules.keys().copied().collect()
    }

    /// Finds (or compiles) and loads one module.
    pub fn load(&mut self, kind: ModuleKind) -> kiln_core::Result<Origin> {
        if self.modules.contains_key(&kind) {
            return Ok(Origin::Cached);
        }
        if self.graph.tensor_parallel.is_some() && !self.in_world {
            return Err(kiln_core::Error::Invalid(
                "a rank's modules run in its tensor-parallel world: join it first (join_world)"
                    .into(),
            ));
        }
        let (vmfb, origin) = prepared::obtain(
            &self.model.config,
            &self.graph,
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

    /// Runs `function` on `head` (and the KV cache, for decode) followed by
    /// the RoPE tables and weights; keeps the last two outputs as the new KV
    /// cache and returns the others.
    fn invoke(
        &mut self,
        kind: ModuleKind,
        function: &str,
        head: &[&DeviceTensor],
        kv: Option<(DeviceTensor, DeviceTensor)>,
        outputs: usize,
    ) -> kiln_core::Result<Vec<DeviceTensor>> {
        self.settle()?;
        self.load(kind)?;
        let module = &self.modules[&kind];
        let mut inputs: Vec<&DeviceTensor> = head.to_vec();
        if let Some((k, v)) = &kv {
            inputs.extend([k, v]);
        }
        inputs.extend([&self.cos, &self.sin]);
        inputs.extend(&self.weights);
        let results = module.invoke(function, &inputs).map_err(to_core)?;
        self.keep_caches(function, results, outputs)
    }

    /// Checks a call of `function` returned `outputs` results, keeps the
    /// last two as the new KV caches (none if the count is wrong) and
    /// returns the others.
    fn keep_caches(
        &mut self,
        function: &str,
        mut results: Vec<DeviceTensor>,
        outputs: usize,
    ) -> kiln_core::Result<Vec<DeviceTensor>> {
        if results.len() != outputs {
            self.kv = None;
            return Err(unexpected_output(
                function,
                format!("{} outputs, not {outputs}", results.len()),
            ));
        }
        let v = results.pop().expect("checked count");
        let k = results.pop().expect("checked count");
        self.kv = Some((k, v));
        Ok(results)
    }

    /// A prefill function on its bucket's module; returns the logits.
    fn run_prefill(
        &mut self,
        seq: usize,
        function: &str,
        input: DeviceTensor,
        rows: usize,
    ) -> kiln_core::Result<Vec<f32>> {
        self.next = None;
        let length = self.scalar(rows)?;
        let outputs = self.invoke(
            ModuleKind::Prefill(seq),
            function,
            &[&input, &length],
            None,
            3,
        )?;
        self.position = rows;
        self.read_logits(function, &outputs[0])
    }

    /// Queues `steps` decode steps from `token` at the current position,
    /// after checking the context has room; returns their outputs `[logits
    /// (one step) or chosen tokens, next token, next position]`, defined
    /// once `kv_ready` is reached. The position is the caller's to advance.
    fn queue_step(&mut self, token: u32, steps: usize) -> kiln_core::Result<Vec<DeviceTensor>> {
        kiln_core::backend::check_tokens(self.model, &[token])?;
        if self.position + steps > self.buckets.context {
            return Err(kiln_core::Error::ContextFull {
                needed: self.position + steps,
                limit: self.buckets.context,
            });
        }
        // The previous greedy step left this token and position on the device.
        let (token_tensor, position_tensor) = match self.next.take() {
            Some(next) if next.token == token && next.position == self.position => {
                (next.token_tensor, next.position_tensor)
            }
            _ => {
                let t = Tensor::i32(&[1], vec![token as i32])
                    .and_then(|t| self.device.upload(&t))
                    .map_err(to_core)?;
                (t, self.scalar(self.position)?)
            }
        };
        self.queue_decode(&token_tensor, &position_tensor, steps)
    }

    /// Queues `decode_step` (or, for several `steps`, `decode_chain`) on
    /// device-side inputs behind the last queued step; the caches become its
    /// outputs and `kv_ready` its fence.
    fn queue_decode(
        &mut self,
        token: &DeviceTensor,
        position: &DeviceTensor,
        steps: usize,
    ) -> kiln_core::Result<Vec<DeviceTensor>> {
        let (kind, function) = decode_function(steps);
        self.load(kind)?;
        let (k, v) = self
            .kv
            .as_ref()
            .ok_or_else(|| kiln_core::Error::Invalid("decode before prefill".into()))?;
        let mut inputs = vec![token, position, k, v, &self.cos, &self.sin];
        inputs.extend(&self.weights);
        let (results, done) = self.modules[&kind]
            .invoke_async(function, &inputs, self.kv_ready.as_ref())
            .map_err(to_core)?;
        // The step is queued and will write the caches: from here on they
        // are its outputs, whatever the check finds.
        self.kv_ready = Some(done);
        self.keep_caches(function, results, 5)
    }

    /// The next token a chain chose ahead, if the caller continues with
    /// the one before it where that one left off.
    fn take_chosen_ahead(&mut self, token: u32) -> Option<u32> {
        let ahead = self.chosen_ahead.as_mut()?;
        if ahead.expect != token || ahead.position != self.position {
            return None;
        }
        let next = ahead.tokens.pop_front()?;
        ahead.expect = next;
        ahead.position += 1;
        Some(next)
    }

    /// `count` greedy choices read from the device, each checked to be in
    /// the vocabulary (the argmax says -1 where the logits are NaN).
    fn vocabulary_tokens(
        &self,
        function: &str,
        chosen: &[i32],
        count: usize,
    ) -> kiln_core::Result<Vec<u32>> {
        if chosen.len() != count {
            return Err(unexpected_output(
                function,
                format!("{} tokens, not {count}", chosen.len()),
            ));
        }
        let vocab = self.model.config.vocab_size;
        chosen
            .iter()
            .map(|&t| {
                u32::try_from(t)
                    .ok()
                    .filter(|&t| (t as usize) < vocab)
                    .ok_or_else(|| {
                        to_core(format!(
                            "{function} chose token {t}, outside the vocabulary of {vocab}: \
                             the logits are NaN (the weights or the precision overflowed)"
                        ))
                    })
            })
            .collect()
    }

    pub(crate) fn scalar(&self, value: usize) -> kiln_core::Result<DeviceTensor> {
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

/// What [`crate::BatchedDecoder`] needs beyond the [`Backend`] trait.
impl<'m> IreeBackend<'m> {
    pub(crate) fn model(&self) -> &'m Model {
        self.model
    }

    /// Prefills one sequence and hands its caches over rather than keeping
    /// them: they become a batch slot's.
    pub(crate) fn prefill_caches(
        &mut self,
        tokens: &[u32],
    ) -> kiln_core::Result<(Vec<f32>, DeviceTensor, DeviceTensor)> {
        let logits = self.prefill(tokens)?;
        let (k, v) = self
            .kv
            .take()
            .ok_or_else(|| unexpected_output("prefill_ids", "no caches"))?;
        Ok((logits, k, v))
    }

    /// Zeroed K and V caches of `slots` sequences: `[L, S, KV, C, D]` and
    /// `[L, S, KV, D, C]`.
    pub(crate) fn empty_slot_caches(
        &self,
        slots: usize,
    ) -> kiln_core::Result<(DeviceTensor, DeviceTensor)> {
        let c = &self.model.config;
        let (layers, kv, context, d) = (
            c.num_layers as i64,
            c.num_kv_heads as i64,
            self.buckets.context as i64,
            c.head_dim as i64,
        );
        let zeros = |shape: &[i64]| {
            let n = shape.iter().product::<i64>() as usize;
            stored(self.graph.precision, shape, std::iter::repeat_n(0.0, n))
                .and_then(|t| self.device.upload(&t))
                .map_err(to_core)
        };
        let slots = slots as i64;
        let k = zeros(&[layers, slots, kv, context, d])?;
        let v = zeros(&[layers, slots, kv, d, context])?;
        Ok((k, v))
    }

    pub(crate) fn upload_i32(&self, values: Vec<i32>) -> kiln_core::Result<DeviceTensor> {
        let t = Tensor::i32(&[values.len() as i64], values).map_err(to_core)?;
        self.device.upload(&t).map_err(to_core)
    }

    /// Queues `function` of `kind` (compiled async-external) on `head`
    /// followed by the RoPE tables and the weights, behind `after`; returns
    /// its outputs, defined once the returned fence is reached, after
    /// checking their number.
    pub(crate) fn call_queued(
        &mut self,
        kind: ModuleKind,
        function: &str,
        head: &[&DeviceTensor],
        after: Option<&Fence>,
        outputs: usize,
    ) -> kiln_core::Result<(Vec<DeviceTensor>, Fence)> {
        self.load(kind)?;
        let mut inputs: Vec<&DeviceTensor> = head.to_vec();
        inputs.extend([&self.cos, &self.sin]);
        inputs.extend(&self.weights);
        let (results, done) = self.modules[&kind]
            .invoke_async(function, &inputs, after)
            .map_err(to_core)?;
        if results.len() != outputs {
            return Err(unexpected_output(
                function,
                format!("{} outputs, not {outputs}", results.len()),
            ));
        }
        Ok((results, done))
    }

    /// Whether greedy steps are queued before the token of the step before
    /// is read (see [`IreeBackend::set_pipelined`]).
    pub(crate) fn pipelined(&self) -> bool {
        self.pipelined
    }

    /// Starts reading `tensor` once `after` is reached; the reader is busy
    /// until [`finish_read_tokens`](Self::finish_read_tokens).
    pub(crate) fn start_read(
        &mut self,
        tensor: &DeviceTensor,
        after: Option<&Fence>,
    ) -> kiln_core::Result<PendingRead> {
        self.reader.start(tensor, after).map_err(to_core)
    }

    /// The `count` token ids of a read [`start_read`](Self::start_read)
    /// started, each checked against the vocabulary.
    pub(crate) fn finish_read_tokens(
        &mut self,
        function: &str,
        read: PendingRead,
        count: usize,
    ) -> kiln_core::Result<Vec<u32>> {
        let host = self.reader.finish(read).map_err(to_core)?;
        let chosen = host.as_i32().map_err(|e| unexpected_output(function, e))?;
        self.vocabulary_tokens(function, chosen, count)
    }

    /// Runs `function` of `kind` on exactly `inputs` (a module that takes
    /// no tables or weights); checks the number of outputs.
    pub(crate) fn call_alone(
        &mut self,
        kind: ModuleKind,
        function: &str,
        inputs: &[&DeviceTensor],
        outputs: usize,
    ) -> kiln_core::Result<Vec<DeviceTensor>> {
        self.load(kind)?;
        invoke_checked(&self.modules[&kind], function, inputs, outputs)
    }

    /// `count` token ids a module chose, each checked against the vocabulary.
    pub(crate) fn read_tokens(
        &mut self,
        function: &str,
        tensor: &DeviceTensor,
        count: usize,
    ) -> kiln_core::Result<Vec<u32>> {
        let host = self.reader.read(tensor).map_err(to_core)?;
        let chosen = host.as_i32().map_err(|e| unexpected_output(function, e))?;
        self.vocabulary_tokens(function, chosen, count)
    }

    /// `rows` rows of logits a module returned, one f32 per vocabulary entry
    /// each.
    pub(crate) fn read_logit_rows(
        &mut self,
        function: &str,
        tensor: &DeviceTensor,
        rows: usize,
    ) -> kiln_core::Result<Vec<Vec<f32>>> {
        let host = self.reader.read(tensor).map_err(to_core)?;
        let logits = host.as_f32().map_err(|e| unexpected_output(function, e))?;
        let vocab = self.model.config.vocab_size;
        if logits.len() != rows * vocab {
            return Err(unexpected_output(
                function,
                format!("{} logits for {rows} rows of {vocab}", logits.len()),
            ));
        }
        Ok(logits.chunks(vocab).map(<[f32]>::to_vec).collect())
    }
}

impl IreeBackend<'_> {
    /// Appends `tokens` in one multi-token step; returns their logits (only
    /// when `greedy_only` is false) and the device's greedy choice after
    /// each. Near the end of the context, where no compiled row count fits
    /// (the padding rows would run past the cache), it runs one decode step
    /// per token instead: the same positions, the same result.
    fn append_rows(
        &mut self,
        tokens: &[u32],
        greedy_only: bool,
    ) -> kiln_core::Result<(Vec<Vec<f32>>, Vec<u32>)> {
        kiln_core::backend::check_tokens(self.model, tokens)?;
        if self.kv.is_none() {
            return Err(kiln_core::Error::Invalid("append before prefill".into()));
        }
        let n = tokens.len();
        let context = self.buckets.context;
        if self.position + n > context {
            return Err(kiln_core::Error::ContextFull {
                needed: self.position + n,
                limit: context,
            });
        }
        self.next = None;
        let position = self.position;
        let Some(rows) = APPEND_ROWS
            .iter()
            .copied()
            .find(|&b| b >= n && position + b <= context)
        else {
            let mut logits = Vec::with_capacity(n);
            for &token in tokens {
                logits.push(self.decode(token)?);
            }
            let chosen = logits
                .iter()
                .map(|l| kiln_core::sampling::argmax(l))
                .collect();
            return Ok((logits, chosen));
        };
        let mut ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        ids.resize(rows, 0);
        let ids = self.upload_i32(ids)?;
        let pos = self.scalar(position)?;
        let kv = self.kv.take();
        let outputs = self.invoke(
            ModuleKind::Append(rows),
            "append_tokens",
            &[&ids, &pos],
            kv,
            4,
        )?;
        self.position += n;
        let mut chosen = self.read_tokens("append_tokens", &outputs[1], rows)?;
        chosen.truncate(n);
        let logits = if greedy_only {
            Vec::new()
        } else {
            let mut rows = self.read_logit_rows("append_tokens", &outputs[0], rows)?;
            rows.truncate(n);
            rows
        };
        Ok((logits, chosen))
    }

    /// The logits a module returned, which must be one f32 per token of the
    /// vocabulary: a module is checked like any other input before use.
    fn read_logits(
        &mut self,
        function: &str,
        tensor: &DeviceTensor,
    ) -> kiln_core::Result<Vec<f32>> {
        let host = self.reader.read(tensor).map_err(to_core)?;
        let logits = host.as_f32().map_err(|e| unexpected_output(function, e))?;
        let vocab = self.model.config.vocab_size;
        if logits.len() != vocab {
            return Err(unexpected_output(
                function,
                format!("{} logits for a vocabulary of {vocab}", logits.len()),
            ));
        }
        Ok(logits.to_vec())
    }
}

/// An output that does not fit the model: the module is not this model's.
fn unexpected_output(function: &str, what: impl std::fmt::Display) -> kiln_core::Error {
    to_core(format!(
        "{function} returned {what}: the module does not fit this model (a damaged or \
         foreign module cache entry?); clear the module cache or run `kiln prepare`"
    ))
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
        self.run_prefill(seq, "prefill_ids", ids, tokens.len())
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
        self.run_prefill(seq, "prefill_embeddings", input, n)
    }

    fn decode(&mut self, token: u32) -> kiln_core::Result<Vec<f32>> {
        let outputs = self.queue_step(token, 1)?;
        self.position += 1;
        // Also drops a step queued ahead (a token chosen for sampling).
        self.settle()?;
        self.read_logits("decode_step", &outputs[0])
    }

    fn sequence_len(&self) -> usize {
        self.position
    }

    fn append(&mut self, tokens: &[u32]) -> kiln_core::Result<Vec<f32>> {
        Ok(self.append_rows(tokens, false)?.0.concat())
    }

    fn append_greedy(&mut self, tokens: &[u32]) -> kiln_core::Result<Vec<u32>> {
        Ok(self.append_rows(tokens, true)?.1)
    }

    fn rewind(&mut self, len: usize) -> kiln_core::Result<()> {
        if len > self.position {
            return Err(kiln_core::backend::rewind_past_end(len, self.position));
        }
        // Rows from `len` on stay on the device until overwritten; no
        // later step sees them (each attends to `0..=its position`). A step
        // queued ahead wrote one such row; the next step waits for it.
        self.position = len;
        self.next = None;
        self.queued = None;
        self.chosen_ahead = None;
        Ok(())
    }

    /// One greedy step, pipelined: the step for `token` (queued by the
    /// call before, if that call's choice was `token`) is followed on the
    /// device by a copy of its chosen token and by the next step, which
    /// takes that token and position from the device; only then does the
    /// host wait for the token. The device thus runs the next step while the
    /// host reads this one's token, returns it and is called again. A step
    /// queued for a token the caller does not continue with is dropped: it
    /// wrote only the cache row at the next position, which the step that
    /// comes there overwrites.
    ///
    /// With several steps per call ([`IreeBackend::set_steps_per_call`]),
    /// each "step" above is a chain of them: the call returns the first
    /// token it chose and keeps the others for the calls that continue with
    /// the token before each (the rows they wrote are then the caller's).
    fn decode_greedy(&mut self, token: u32) -> kiln_core::Result<u32> {
        if let Some(chosen) = self.take_chosen_ahead(token) {
            self.position += 1;
            return Ok(chosen);
        }
        self.chosen_ahead = None;
        let steps = self.steps_at(self.position);
        let mut outputs = match self.queued.take() {
            Some(q) if q.token == token && q.position == self.position && q.steps == steps => {
                q.outputs
            }
            _ => self.queue_step(token, steps)?,
        };
        let (_, function) = decode_function(steps);
        let next_position = self.position + steps;
        self.position += 1;
        let position_tensor = outputs.pop().expect("three outputs");
        let token_tensor = outputs.pop().expect("three outputs");
        // One step's token is its next token; a chain's are its first output.
        let chosen_tensor = if steps == 1 {
            &token_tensor
        } else {
            &outputs[0]
        };
        if token_tensor.shape() != [1] || chosen_tensor.shape() != [steps as i64] {
            return Err(unexpected_output(
                function,
                format!(
                    "tokens of shapes {:?} and {:?}, not {steps} and one",
                    chosen_tensor.shape(),
                    token_tensor.shape()
                ),
            ));
        }
        let read = self
            .reader
            .start(chosen_tensor, self.kv_ready.as_ref())
            .map_err(to_core)?;
        let next_steps = self.steps_at(next_position);
        let ahead = (self.pipelined && next_position < self.buckets.context)
            .then(|| self.queue_decode(&token_tensor, &position_tensor, next_steps));
        // Finish the read before any error of the step queued ahead: the
        // reader stays busy until it is finished.
        let host = self.reader.finish(read).map_err(to_core)?;
        let ahead = ahead.transpose()?;
        let chosen = host.as_i32().map_err(|e| unexpected_output(function, e))?;
        let chosen = self.vocabulary_tokens(function, chosen, steps)?;
        let last = *chosen.last().expect("at least one step");
        match ahead {
            Some(outputs) => {
                self.queued = Some(Queued {
                    token: last,
                    position: next_position,
                    steps: next_steps,
                    outputs,
                })
            }
            None => {
                self.next = Some(NextStep {
                    token: last,
                    position: next_position,
                    token_tensor,
                    position_tensor,
                })
            }
        }
        if steps > 1 {
            self.chosen_ahead = Some(ChosenAhead {
                expect: chosen[0],
                position: self.position,
                tokens: chosen[1..].iter().copied().collect(),
            });
        }
        Ok(chosen[0])
    }
}

/// The module and function that run `steps` greedy decode steps in one
/// call: `decode_step` for one, `decode_chain` for more.
fn decode_function(steps: usize) -> (ModuleKind, &'static str) {
    match steps {
        1 => (ModuleKind::Decode, "decode_step"),
        n => (ModuleKind::DecodeChain(n), "decode_chain"),
    }
}

impl Drop for IreeBackend<'_> {
    fn drop(&mut self) {
        // Queued steps hold the caches and weights until done; wait rather
        // than free the device under them. A failure was the step's own.
        let _ = self.settle();
    }
}

/// Invokes `function` and checks it returned `outputs` results.
fn invoke_checked(
    module: &kiln_iree::Module,
    function: &str,
    inputs: &[&DeviceTensor],
    outputs: usize,
) -> kiln_core::Result<Vec<DeviceTensor>> {
    let results = module.invoke(function, inputs).map_err(to_core)?;
    if results.len() != outputs {
        return Err(unexpected_output(
            function,
            format!("{} outputs, not {outputs}", results.len()),
        ));
    }
    Ok(results)
}
