//! Continuous batching: a fixed number of sequence slots, each with its own
//! rows of one KV cache on the device and its own position, decoded together
//! one step at a time. A sequence is admitted into a free slot, joins the
//! batch at the next step, and leaves it when released; the other slots never
//! pause for it beyond its prefill. Sequences admitted together
//! ([`BatchedDecoder::admit_all`]) are prefilled together, several prompts
//! in one call writing straight into their slots (`prefill_batch`); one
//! alone, or one whose prompt is longer than [`PROMPT_MAX`], is prefilled
//! alone and its caches copied into the slot's rows on the device.
//!
//! A step runs the `decode_batch` module over the first `rows` slots, for the
//! smallest compiled row count ([`batch_sizes`]) that covers every slot to
//! decode; slots among them that are not decoded are fed positions whose rows
//! nobody reads. The caches never leave the device: each step updates them in
//! place. When the same slots step again with the tokens the device chose,
//! the step's own token and position outputs are fed back without an upload,
//! as in batch-1 greedy decoding; and when every slot is greedy, that next
//! step is queued before this step's tokens are read (pipelined, as the
//! batch-1 step is), and used if the caller feeds those tokens to the same
//! slots. A step queued ahead and not used wrote each slot's row at its next
//! position only, which the slot writes again before it reads it.
//!
//! [`PROMPT_MAX`]: crate::plan::PROMPT_MAX

use kiln_core::Model;
use kiln_iree::{DeviceTensor, Fence};

use crate::backend::IreeBackend;
use crate::module_cache::Origin;
use crate::plan::{ModuleKind, batch_sizes, decoder_module_kinds, prompt_buckets, prompt_rows};

/// The most sequence slots a decoder takes.
pub const MAX_SLOTS: usize = 32;

/// How a slot's next token is chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Choice {
    /// On the device (argmax): a step reads back 4 bytes for this slot.
    Greedy,
    /// On the host from the slot's logits (temperature, top-p).
    Sampled,
}

/// What one step produced for one slot.
#[derive(Clone, Debug, PartialEq)]
pub enum SlotOutput {
    /// The device's greedy choice (for [`Choice::Greedy`] slots).
    Token(u32),
    /// The slot's logits (for [`Choice::Sampled`] slots).
    Logits(Vec<f32>),
}

/// A sequence to admit: the free slot it takes, its prompt, and how its
/// tokens are chosen.
#[derive(Clone, Copy, Debug)]
pub struct Admission<'p> {
    pub slot: usize,
    pub prompt: &'p [u32],
    pub choice: Choice,
}

impl<'p> Admission<'p> {
    /// One admission per prompt, prompt `i` into slot `i`, all chosen as
    /// `choice`.
    pub fn in_order(prompts: &'p [Vec<u32>], choice: Choice) -> Vec<Admission<'p>> {
        prompts
            .iter()
            .enumerate()
            .map(|(slot, prompt)| Admission {
                slot,
                prompt,
                choice,
            })
            .collect()
    }
}

/// The sequence in a slot.
struct Sequence {
    /// Positions held: the next token is written at this one.
    position: usize,
    choice: Choice,
    /// The token to decode at the next step, once the caller fed it.
    pending: Option<u32>,
}

/// What the last step left on the device for the next one.
struct Carry {
    /// The rows it ran and the slots among them it decoded.
    rows: usize,
    real: Vec<usize>,
    /// The greedy choice of each decoded slot (`None`: sampled).
    chosen: Vec<Option<u32>>,
    tokens: DeviceTensor,
    positions: DeviceTensor,
    /// The step on `tokens` and `positions` if it was queued ahead: its
    /// `[logits, tokens, positions]`.
    ahead: Option<[DeviceTensor; 3]>,
}

/// The IREE backend's batched decoder (see the module's documentation).
pub struct BatchedDecoder<'m> {
    sizes: Vec<usize>,
    slots: Vec<Option<Sequence>>,
    /// Every slot's caches: `[L, S, KV, C, D]` keys, `[L, S, KV, D, C]`
    /// values.
    k: DeviceTensor,
    v: DeviceTensor,
    carry: Option<Carry>,
    /// Reached when the last queued step, the caches' last writer, is done.
    ready: Option<Fence>,
    /// Prompts prefilled in calls of several so far.
    together: usize,
    /// Last: the tensors above are dropped before its modules and device.
    backend: IreeBackend<'m>,
}

impl Drop for BatchedDecoder<'_> {
    fn drop(&mut self) {
        // A queued step holds the caches and the module until done: wait
        // rather than free them under it. A failure was the step's own.
        if let Some(ready) = self.ready.take() {
            let _ = ready.wait();
        }
    }
}

fn invalid(what: String) -> kiln_core::Error {
    kiln_core::Error::Invalid(what)
}

fn backend_error(error: kiln_iree::Error) -> kiln_core::Error {
    kiln_core::Error::Backend(error.to_string())
}

impl<'m> BatchedDecoder<'m> {
    /// `slots` sequence slots over `backend`, their caches allocated now.
    pub fn new(backend: IreeBackend<'m>, slots: usize) -> kiln_core::Result<BatchedDecoder<'m>> {
        if slots == 0 || slots > MAX_SLOTS {
            return Err(invalid(format!(
                "{slots} sequence slots: a batched decoder takes 1 to {MAX_SLOTS}; \
                 lower --batch-slots"
            )));
        }
        // The step addresses the caches with i32 flat indices.
        let c = &backend.model().config;
        let elements = [c.num_layers, c.num_kv_heads, c.head_dim, slots]
            .iter()
            .try_fold(backend.buckets().context, |n, &d| n.checked_mul(d));
        if elements.is_none_or(|n| n > i32::MAX as usize) {
            return Err(invalid(format!(
                "{slots} sequence slots of {} positions: the caches would hold more than \
                 2^31 values per tensor; lower --batch-slots or --max-context",
                backend.buckets().context
            )));
        }
        let (k, v) = backend.empty_slot_caches(slots)?;
        Ok(BatchedDecoder {
            sizes: batch_sizes(slots),
            backend,
            slots: (0..slots).map(|_| None).collect(),
            k,
            v,
            carry: None,
            ready: None,
            together: 0,
        })
    }

    pub fn model(&self) -> &'m Model {
        self.backend.model()
    }

    pub fn max_context(&self) -> usize {
        self.backend.buckets().context
    }

    pub fn slot_count(&self) -> usize {
        self.slots.len()
    }

    /// Every module a step or an admission can need: the prefill buckets,
    /// the row counts' decode steps and the admissions. Loads (compiling where
    /// needed) them all.
    pub fn prepare(
        &mut self,
        mut on_ready: impl FnMut(ModuleKind, Origin),
    ) -> kiln_core::Result<()> {
        let mut kinds = self.backend.module_kinds();
        kinds.retain(|k| matches!(k, ModuleKind::Prefill(_)));
        kinds.extend(decoder_module_kinds(
            self.backend.buckets(),
            self.slots.len(),
        ));
        for kind in kinds {
            let origin = self.backend.load(kind)?;
            on_ready(kind, origin);
        }
        Ok(())
    }

    /// The lowest free slot: admitting there keeps the rows a step runs few.
    pub fn free_slot(&self) -> Option<usize> {
        self.slots.iter().position(Option::is_none)
    }

    /// Every free slot, lowest first.
    pub fn free_slots(&self) -> Vec<usize> {
        (0..self.slots.len())
            .filter(|&s| self.slots[s].is_none())
            .collect()
    }

    /// How many prompts were prefilled in calls of several
    /// ([`admit_all`](BatchedDecoder::admit_all)) so far.
    pub fn prompts_prefilled_together(&self) -> usize {
        self.together
    }

    /// Whether the next step is already queued (see the module's
    /// documentation): the last step's slots were all greedy and the
    /// backend pipelines.
    pub fn queued_ahead(&self) -> bool {
        self.carry.as_ref().is_some_and(|c| c.ahead.is_some())
    }

    pub fn active(&self) -> usize {
        self.slots.iter().filter(|s| s.is_some()).count()
    }

    /// Prefills `prompt` into the free slot `slot`; returns the logits of its
    /// last token. The caller picks the first token from them and [`feed`]s
    /// it; the slot then decodes with the others at each [`step`].
    ///
    /// [`feed`]: BatchedDecoder::feed
    /// [`step`]: BatchedDecoder::step
    pub fn admit(
        &mut self,
        slot: usize,
        prompt: &[u32],
        choice: Choice,
    ) -> kiln_core::Result<Vec<f32>> {
        self.check_free(slot)?;
        let (logits, k, v) = self.backend.prefill_caches(prompt)?;
        // A carry fed the slot positions as a free one; it must not again.
        // The copy into the slot's rows comes after every queued step.
        self.carry = None;
        if let Some(ready) = self.ready.take() {
            ready.wait().map_err(backend_error)?;
        }
        let index = self.backend.scalar(slot)?;
        let slots = self.slots.len();
        let mut caches = self
            .backend
            .call_alone(
                ModuleKind::AdmitSlot { slots },
                "admit_slot",
                &[&self.k, &self.v, &k, &v, &index],
                2,
            )?
            .into_iter();
        self.k = caches.next().expect("checked count");
        self.v = caches.next().expect("checked count");
        self.slots[slot] = Some(Sequence {
            position: prompt.len(),
            choice,
            pending: None,
        });
        Ok(logits)
    }

    /// An error unless `slot` exists and is free.
    fn check_free(&self, slot: usize) -> kiln_core::Result<()> {
        match self.slots.get(slot) {
            None => Err(invalid(format!(
                "slot {slot} does not exist (the decoder has {})",
                self.slots.len()
            ))),
            Some(Some(_)) => Err(invalid(format!("slot {slot} is taken; release it first"))),
            Some(None) => Ok(()),
        }
    }

    /// Admits every sequence of `admissions` ([`admit`] each), prefilling
    /// prompts of the same length bucket (up to [`PROMPT_MAX`] tokens) in
    /// calls of several prompts; returns each one's result in order. A
    /// failed admission leaves its slot free; a failed call fails the
    /// admissions it held.
    ///
    /// [`admit`]: BatchedDecoder::admit
    /// [`PROMPT_MAX`]: crate::plan::PROMPT_MAX
    pub fn admit_all(&mut self, admissions: &[Admission]) -> Vec<kiln_core::Result<Vec<f32>>> {
        let mut results: Vec<Option<kiln_core::Result<Vec<f32>>>> =
            admissions.iter().map(|_| None).collect();
        let most = prompt_rows(self.slots.len()).last().copied().unwrap_or(1);
        // Admissions that can share a call, by prompt bucket.
        let mut by_bucket: std::collections::BTreeMap<usize, Vec<usize>> = Default::default();
        for (i, a) in admissions.iter().enumerate() {
            let taken_before = admissions[..i].iter().any(|b| b.slot == a.slot);
            let checked = match taken_before {
                true => Err(invalid(format!("slot {} is admitted twice", a.slot))),
                false => self
                    .check_free(a.slot)
                    .and_then(|()| self.check_prompt(a.prompt)),
            };
            let bucket = prompt_buckets(self.backend.buckets())
                .into_iter()
                .find(|&b| b >= a.prompt.len());
            match (checked, bucket) {
                (Err(e), _) => results[i] = Some(Err(e)),
                (Ok(()), Some(seq)) if most > 1 => by_bucket.entry(seq).or_default().push(i),
                (Ok(()), _) => {}
            }
        }
        for (seq, members) in by_bucket {
            for group in members.chunks(most).filter(|g| g.len() > 1) {
                let chosen: Vec<Admission> = group.iter().map(|&i| admissions[i]).collect();
                match self.prefill_together(&chosen, seq) {
                    Ok(logits) => {
                        for (&i, logits) in group.iter().zip(logits) {
                            results[i] = Some(Ok(logits));
                        }
                    }
                    Err(error) => {
                        let message = error.to_string();
                        for &i in group {
                            results[i] = Some(Err(kiln_core::Error::Backend(message.clone())));
                        }
                    }
                }
            }
        }
        // The rest, one at a time.
        admissions
            .iter()
            .zip(results)
            .map(|(a, result)| result.unwrap_or_else(|| self.admit(a.slot, a.prompt, a.choice)))
            .collect()
    }

    /// An error unless `prompt` is non-empty, of vocabulary tokens, and
    /// leaves the context room for a token after it.
    fn check_prompt(&self, prompt: &[u32]) -> kiln_core::Result<()> {
        kiln_core::backend::check_tokens(self.backend.model(), prompt)?;
        let context = self.max_context();
        if prompt.len() >= context {
            return Err(kiln_core::Error::ContextFull {
                needed: prompt.len() + 1,
                limit: context,
            });
        }
        Ok(())
    }

    /// Prefills the checked `admissions` (at least two, of prompts up to
    /// `seq` tokens) in one `prefill_batch` call; returns their logits.
    fn prefill_together(
        &mut self,
        admissions: &[Admission],
        seq: usize,
    ) -> kiln_core::Result<Vec<Vec<f32>>> {
        let slots = self.slots.len();
        let rows = prompt_rows(slots)
            .into_iter()
            .find(|&r| r >= admissions.len())
            .expect("callers group at most the largest row count");
        let last = admissions.last().expect("at least two admissions");
        // Spare rows repeat the last prompt into its slot: the same values
        // written to the same places.
        let padded = admissions
            .iter()
            .chain(std::iter::repeat_n(last, rows - admissions.len()));
        let (mut tokens, mut lengths, mut slot_ids) = (Vec::new(), Vec::new(), Vec::new());
        for a in padded {
            tokens.extend(a.prompt.iter().map(|&t| t as i32));
            tokens.extend(std::iter::repeat_n(0, seq - a.prompt.len()));
            lengths.push(a.prompt.len() as i32);
            slot_ids.push(a.slot as i32);
        }
        let tokens = self.backend.upload_i32(tokens)?;
        let lengths = self.backend.upload_i32(lengths)?;
        let slot_ids = self.backend.upload_i32(slot_ids)?;
        // The steps' carry fed these slots as free ones; queued behind the
        // last step, the call sees the caches that step left.
        self.carry = None;
        let (outputs, done) = self.backend.call_queued(
            ModuleKind::PrefillBatch { rows, seq, slots },
            "prefill_batch",
            &[&tokens, &lengths, &slot_ids, &self.k, &self.v],
            self.ready.as_ref(),
            3,
        )?;
        let mut outputs = outputs.into_iter();
        let logits = outputs.next().expect("checked count");
        // The caches are updated in place: these are the same buffers.
        self.k = outputs.next().expect("checked count");
        self.v = outputs.next().expect("checked count");
        self.ready.insert(done).wait().map_err(backend_error)?;
        let mut logits = self
            .backend
            .read_logit_rows("prefill_batch", &logits, rows)?;
        logits.truncate(admissions.len());
        self.together += admissions.len();
        for a in admissions {
            self.slots[a.slot] = Some(Sequence {
                position: a.prompt.len(),
                choice: a.choice,
                pending: None,
            });
        }
        Ok(logits)
    }

    /// The token slot `slot` decodes at the next step (appended at its
    /// position).
    pub fn feed(&mut self, slot: usize, token: u32) -> kiln_core::Result<()> {
        kiln_core::backend::check_tokens(self.backend.model(), &[token])?;
        let context = self.max_context();
        let sequence = self
            .slots
            .get_mut(slot)
            .and_then(Option::as_mut)
            .ok_or_else(|| invalid(format!("slot {slot} holds no sequence")))?;
        if sequence.position >= context {
            return Err(kiln_core::Error::ContextFull {
                needed: sequence.position + 1,
                limit: context,
            });
        }
        sequence.pending = Some(token);
        Ok(())
    }

    /// Frees `slot`; its sequence leaves the batch.
    pub fn release(&mut self, slot: usize) {
        if let Some(s) = self.slots.get_mut(slot) {
            *s = None;
        }
    }

    /// Queues the step of the first `rows` slots on `tokens` at
    /// `positions` behind the last queued one; returns its `[logits, tokens,
    /// positions]`, defined once `ready` is reached. On an error the slots
    /// in `real` are dropped: the caches may be half-written.
    fn queue(
        &mut self,
        rows: usize,
        real: &[usize],
        tokens: &DeviceTensor,
        positions: &DeviceTensor,
    ) -> kiln_core::Result<[DeviceTensor; 3]> {
        let slots = self.slots.len();
        let queued = self.backend.call_queued(
            ModuleKind::DecodeBatch { rows, slots },
            "decode_batch",
            &[tokens, positions, &self.k, &self.v],
            self.ready.as_ref(),
            5,
        );
        let (outputs, done) = match queued {
            Ok(queued) => queued,
            Err(error) => {
                for &s in real {
                    self.slots[s] = None;
                }
                return Err(error);
            }
        };
        self.ready = Some(done);
        let mut outputs = outputs.into_iter();
        let mut next = || outputs.next().expect("checked count");
        let step = [next(), next(), next()];
        // The caches are updated in place: these are the same buffers.
        self.k = next();
        self.v = next();
        Ok(step)
    }

    /// One decode step of every slot that was fed a token; returns each such
    /// slot's output, in slot order. Slots not fed sit this step out.
    pub fn step(&mut self) -> kiln_core::Result<Vec<(usize, SlotOutput)>> {
        let real: Vec<usize> = (0..self.slots.len())
            .filter(|&s| matches!(&self.slots[s], Some(q) if q.pending.is_some()))
            .collect();
        let Some(&last) = real.last() else {
            return Ok(Vec::new());
        };
        let rows = self
            .sizes
            .iter()
            .copied()
            .find(|&b| b > last)
            .expect("the largest batch size is the slot count");

        let matched = self.carry.take().filter(|carry| {
            carry.rows == rows
                && carry.real == real
                && real.iter().zip(&carry.chosen).all(|(&s, &chosen)| {
                    let pending = self.slots[s].as_ref().and_then(|q| q.pending);
                    chosen.is_some() && chosen == pending
                })
        });
        let [logits, next_tokens, next_positions] = match matched {
            Some(Carry {
                ahead: Some(outputs),
                ..
            }) => outputs,
            Some(carry) => self.queue(rows, &real, &carry.tokens, &carry.positions)?,
            None => {
                // A slot that waits is fed its own next position, a row it
                // writes again before it can read it; a free slot's rows are
                // overwritten on admission.
                let (tokens, positions) = self.slots[..rows]
                    .iter()
                    .map(|s| match s {
                        Some(q) => (q.pending.unwrap_or(0) as i32, q.position as i32),
                        None => (0, 0),
                    })
                    .unzip();
                let tokens = self.backend.upload_i32(tokens)?;
                let positions = self.backend.upload_i32(positions)?;
                self.queue(rows, &real, &tokens, &positions)?
            }
        };

        let read = self.backend.start_read(&next_tokens, self.ready.as_ref())?;
        let greedy = real
            .iter()
            .all(|&s| matches!(&self.slots[s], Some(q) if q.choice == Choice::Greedy));
        // The step ahead writes each slot's row at its next position.
        let context = self.max_context();
        let room = real
            .iter()
            .all(|&s| matches!(&self.slots[s], Some(q) if q.position + 1 < context));
        let ahead = (greedy && room && self.backend.pipelined())
            .then(|| self.queue(rows, &real, &next_tokens, &next_positions));
        // Finish the read before any error of the step queued ahead: the
        // reader stays busy until it is finished.
        let chosen = self.backend.finish_read_tokens("decode_batch", read, rows);
        let ahead = ahead.transpose()?;
        let chosen = chosen?;
        let mut logit_rows = match greedy {
            true => None,
            false => {
                if let Some(ready) = &self.ready {
                    ready.wait().map_err(backend_error)?;
                }
                Some(
                    self.backend
                        .read_logit_rows("decode_batch", &logits, rows)?,
                )
            }
        };
        let mut results = Vec::with_capacity(real.len());
        let mut carried = Vec::with_capacity(real.len());
        for &s in &real {
            let q = self.slots[s].as_mut().expect("a decoded slot");
            q.position += 1;
            q.pending = None;
            match (q.choice, logit_rows.as_mut()) {
                (Choice::Sampled, Some(rows)) => {
                    results.push((s, SlotOutput::Logits(std::mem::take(&mut rows[s]))));
                    carried.push(None);
                }
                _ => {
                    results.push((s, SlotOutput::Token(chosen[s])));
                    carried.push(Some(chosen[s]));
                }
            }
        }
        self.carry = Some(Carry {
            rows,
            real,
            chosen: carried,
            tokens: next_tokens,
            positions: next_positions,
            ahead,
        });
        Ok(results)
    }
}
