//! Continuous batching: a fixed number of sequence slots, each with its own
//! KV cache on the device and its own position, decoded together one step at
//! a time. A sequence is admitted into a free slot (prefilled alone, its
//! caches becoming the slot's), joins the batch at the next step, and leaves
//! it when released; the other slots never pause for it beyond its prefill.
//!
//! A step runs the `decode_batch` module of the smallest compiled batch size
//! that holds the slots to decode ([`batch_sizes`]); spare rows are filled
//! with other slots, fed positions whose rows nobody reads. The caches never
//! leave the device: each step updates them in place. When the same slots
//! step again with the tokens the device chose, the step's own token and
//! position outputs are fed back without an upload, as in batch-1 greedy
//! decoding.

use kiln_core::Model;
use kiln_iree::DeviceTensor;

use crate::backend::{IreeBackend, ModuleKind};
use crate::module_cache::Origin;

/// The most sequence slots a decoder takes. Larger batched steps (16 and 32
/// rows) compile but fail at run time on IREE 3.11's `local-task` device
/// (`ABORTED` from the step's fence, or a crash), measured with the embedded
/// model; until that is understood they are refused rather than risked.
pub const MAX_SLOTS: usize = 8;

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

/// The batch sizes compiled for `slots` slots: 1 (a lone sequence steps at
/// batch-1 cost), then powers of two from 4, and `slots` itself. Decode reads
/// every weight once per step whatever the batch, so a few spare rows cost
/// little; skipping 2 saves a module that 4 covers.
pub fn batch_sizes(slots: usize) -> Vec<usize> {
    let mut sizes = vec![1];
    let mut size = 4;
    while size < slots {
        sizes.push(size);
        size *= 2;
    }
    if slots > 1 {
        sizes.push(slots);
    }
    sizes
}

struct Slot {
    /// `[L, KV, C, D]` keys and `[L, KV, D, C]` values, on the device.
    k: DeviceTensor,
    v: DeviceTensor,
    sequence: Option<Sequence>,
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
    /// The slot of each row; the first `real` rows were decoded.
    rows: Vec<usize>,
    real: usize,
    /// The greedy choice of each decoded row (`None`: sampled).
    chosen: Vec<Option<u32>>,
    tokens: DeviceTensor,
    positions: DeviceTensor,
}

/// The IREE backend's batched decoder (see the module's documentation).
pub struct BatchedDecoder<'m> {
    backend: IreeBackend<'m>,
    sizes: Vec<usize>,
    slots: Vec<Slot>,
    carry: Option<Carry>,
}

fn invalid(what: String) -> kiln_core::Error {
    kiln_core::Error::Invalid(what)
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
        let slots = (0..slots)
            .map(|_| {
                let (k, v) = backend.empty_caches()?;
                Ok(Slot {
                    k,
                    v,
                    sequence: None,
                })
            })
            .collect::<kiln_core::Result<Vec<_>>>()?;
        Ok(BatchedDecoder {
            sizes: batch_sizes(slots.len()),
            backend,
            slots,
            carry: None,
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

    /// Every module a step or an admission can need: the prefill buckets and
    /// the batch sizes' decode steps. Loads (compiling where needed) them all.
    pub fn prepare(
        &mut self,
        mut on_ready: impl FnMut(ModuleKind, Origin),
    ) -> kiln_core::Result<()> {
        let mut kinds = self.backend.module_kinds();
        kinds.retain(|k| matches!(k, ModuleKind::Prefill(_)));
        kinds.extend(self.sizes.iter().map(|&b| ModuleKind::DecodeBatch(b)));
        for kind in kinds {
            let origin = self.backend.load(kind)?;
            on_ready(kind, origin);
        }
        Ok(())
    }

    /// The lowest free slot.
    pub fn free_slot(&self) -> Option<usize> {
        self.slots.iter().position(|s| s.sequence.is_none())
    }

    pub fn active(&self) -> usize {
        self.slots.iter().filter(|s| s.sequence.is_some()).count()
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
        match self.slots.get(slot) {
            None => {
                return Err(invalid(format!(
                    "slot {slot} does not exist (the decoder has {})",
                    self.slots.len()
                )));
            }
            Some(s) if s.sequence.is_some() => {
                return Err(invalid(format!("slot {slot} is taken; release it first")));
            }
            Some(_) => {}
        }
        let (logits, k, v) = self.backend.prefill_caches(prompt)?;
        // The slot's old caches are dropped: a stale carry must not feed them.
        self.carry = None;
        self.slots[slot] = Slot {
            k,
            v,
            sequence: Some(Sequence {
                position: prompt.len(),
                choice,
                pending: None,
            }),
        };
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
            .and_then(|s| s.sequence.as_mut())
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
            s.sequence = None;
        }
    }

    /// One decode step of every slot that was fed a token; returns each such
    /// slot's output, in slot order. Slots not fed sit this step out.
    pub fn step(&mut self) -> kiln_core::Result<Vec<(usize, SlotOutput)>> {
        let real: Vec<usize> = (0..self.slots.len())
            .filter(|&s| matches!(&self.slots[s].sequence, Some(q) if q.pending.is_some()))
            .collect();
        if real.is_empty() {
            return Ok(Vec::new());
        }
        let size = self
            .sizes
            .iter()
            .copied()
            .find(|&b| b >= real.len())
            .expect("the largest batch size is the slot count");
        // Spare rows: other slots, free ones first. A free slot's cache is
        // overwritten on admission; a waiting slot is fed its own next
        // position, a row it writes again before it can read it.
        let mut rows = real.clone();
        let mut spare: Vec<usize> = (0..self.slots.len())
            .filter(|s| !real.contains(s))
            .collect();
        spare.sort_by_key(|&s| self.slots[s].sequence.is_some());
        rows.extend(spare.into_iter().take(size - real.len()));

        let (tokens, positions) = match self.carry.take() {
            Some(carry)
                if carry.rows == rows && carry.real == real.len() && {
                    real.iter().zip(&carry.chosen).all(|(&s, &chosen)| {
                        let pending = self.slots[s].sequence.as_ref().and_then(|q| q.pending);
                        chosen.is_some() && chosen == pending
                    })
                } =>
            {
                (carry.tokens, carry.positions)
            }
            _ => {
                let mut tokens = Vec::with_capacity(size);
                let mut positions = Vec::with_capacity(size);
                for &s in &rows {
                    let (token, position) = match &self.slots[s].sequence {
                        Some(q) => (q.pending.unwrap_or(0), q.position),
                        None => (0, 0),
                    };
                    tokens.push(token as i32);
                    positions.push(position as i32);
                }
                (
                    self.backend.upload_i32(tokens)?,
                    self.backend.upload_i32(positions)?,
                )
            }
        };

        let mut head: Vec<&DeviceTensor> = vec![&tokens, &positions];
        for &s in &rows {
            head.extend([&self.slots[s].k, &self.slots[s].v]);
        }
        let outputs = self.backend.call(
            ModuleKind::DecodeBatch(size),
            "decode_batch",
            &head,
            3 + 2 * size,
        );
        let mut outputs = match outputs {
            Ok(outputs) => outputs.into_iter(),
            Err(error) => {
                // The caches may be half-written: no slot can go on.
                for s in &real {
                    self.slots[*s].sequence = None;
                }
                return Err(error);
            }
        };
        let logits = outputs.next().expect("checked count");
        let next_tokens = outputs.next().expect("checked count");
        let next_positions = outputs.next().expect("checked count");
        for &s in &rows {
            self.slots[s].k = outputs.next().expect("checked count");
            self.slots[s].v = outputs.next().expect("checked count");
        }

        let chosen = self
            .backend
            .read_tokens("decode_batch", &next_tokens, size)?;
        let sampled = real
            .iter()
            .any(|&s| matches!(&self.slots[s].sequence, Some(q) if q.choice == Choice::Sampled));
        let mut logit_rows = if sampled {
            Some(
                self.backend
                    .read_logit_rows("decode_batch", &logits, size)?,
            )
        } else {
            None
        };
        let mut results = Vec::with_capacity(real.len());
        let mut carried = Vec::with_capacity(real.len());
        for (row, &s) in real.iter().enumerate() {
            let q = self.slots[s].sequence.as_mut().expect("a decoded slot");
            q.position += 1;
            q.pending = None;
            match (q.choice, logit_rows.as_mut()) {
                (Choice::Sampled, Some(rows)) => {
                    results.push((s, SlotOutput::Logits(std::mem::take(&mut rows[row]))));
                    carried.push(None);
                }
                _ => {
                    results.push((s, SlotOutput::Token(chosen[row])));
                    carried.push(Some(chosen[row]));
                }
            }
        }
        self.carry = Some(Carry {
            rows,
            real: real.len(),
            chosen: carried,
            tokens: next_tokens,
            positions: next_positions,
        });
        Ok(results)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_sizes_start_at_one_and_end_at_the_slot_count() {
        assert_eq!(batch_sizes(1), vec![1]);
        assert_eq!(batch_sizes(4), vec![1, 4]);
        assert_eq!(batch_sizes(8), vec![1, 4, 8]);
        assert_eq!(batch_sizes(12), vec![1, 4, 8, 12]);
        assert_eq!(batch_sizes(32), vec![1, 4, 8, 16, 32]);
    }
}
