//! The single-sequence loop: one request at a time, from its prompt to its
//! last token, on a decoder that cannot batch (the CPU backends, an IREE
//! backend with `--batch-slots 1`, speculative decoding). The loop is
//! generic over the decoder ([`SingleSequenceDecoder`]: a plain backend or
//! [`Speculative`]), so the kind is chosen once, when the loop starts. The
//! client, the deadline and shutdown are checked between steps and inside
//! prefill.

use std::sync::mpsc::Receiver;

use kiln_core::{Backend, Sampler, Speculator, Tokenizer};

use crate::server::Shared;
use crate::server::error::ApiError;

use super::Speculative;
use super::generation::{Generation, backend_failed};
use super::queue::{Counted, Finish, Job, admissible, next_job, report};

/// A decoder that runs one request at a time.
pub(super) trait SingleSequenceDecoder {
    /// The context the prompts were prepared against.
    fn max_context(&self) -> usize;

    /// Runs `generation` from its prompt to its end; `Ok(None)` when the
    /// client left or the server is stopping.
    fn generate(
        &mut self,
        generation: Generation,
        prompt_ids: &[u32],
        shared: &Shared,
    ) -> Result<Option<Finish>, ApiError>;
}

/// Runs jobs one at a time on `decoder` until the queue's senders are all
/// dropped (or the server has stopped and the queue is empty).
pub(super) fn run(
    tokenizer: &Tokenizer,
    mut decoder: impl SingleSequenceDecoder,
    jobs: Receiver<Job>,
    shared: &Shared,
) {
    let max_context = decoder.max_context();
    loop {
        let Some(job) = next_job(&jobs, shared, true) else {
            return;
        };
        let Some(job) = admissible(job, shared) else {
            continue;
        };
        shared.metrics.active.inc();
        let events = job.events.clone();
        let result = Generation::start(tokenizer, max_context, job, shared)
            .and_then(|(generation, prompt_ids)| decoder.generate(generation, &prompt_ids, shared));
        report(&events, result, shared, Counted::Active);
    }
}

/// One token per pass of the model.
impl SingleSequenceDecoder for Box<dyn Backend + '_> {
    fn max_context(&self) -> usize {
        self.as_ref().max_context()
    }

    fn generate(
        &mut self,
        mut generation: Generation,
        prompt_ids: &[u32],
        shared: &Shared,
    ) -> Result<Option<Finish>, ApiError> {
        let backend = self.as_mut();
        let Some(logits) = unless_interrupted(&generation, shared, |keep_going| {
            backend.prefill_until(prompt_ids, keep_going)
        })?
        else {
            return Ok(None);
        };
        let mut token = generation.sampler.sample(&logits).map_err(backend_failed)?;
        loop {
            if let Some(finish) = generation.accept(token, shared)? {
                return Ok(Some(finish));
            }
            if generation.interrupted(shared)? {
                return Ok(None);
            }
            token = if generation.sampler.is_greedy() {
                backend.decode_greedy(token).map_err(backend_failed)?
            } else {
                generation
                    .sampler
                    .sample(&backend.decode(token).map_err(backend_failed)?)
                    .map_err(backend_failed)?
            };
        }
    }
}

/// Several tokens per pass when the proposer guesses well; the same tokens
/// (greedy) or the same distribution (sampling) as a plain backend. The
/// client, the deadline and shutdown are checked between passes.
impl SingleSequenceDecoder for Speculative<'_> {
    fn max_context(&self) -> usize {
        self.backend.max_context()
    }

    fn generate(
        &mut self,
        mut generation: Generation,
        prompt_ids: &[u32],
        shared: &Shared,
    ) -> Result<Option<Finish>, ApiError> {
        let sampler = Sampler::new(generation.sampling.clone())
            .map_err(|e| ApiError::invalid(e.to_string()))?;
        let Some((mut speculator, first)) =
            unless_interrupted(&generation, shared, |keep_going| {
                Speculator::start(
                    self.backend.as_mut(),
                    self.proposer.as_mut(),
                    self.draft_tokens,
                    sampler,
                    prompt_ids,
                    keep_going,
                )
            })?
        else {
            return Ok(None);
        };
        let mut tokens = vec![first];
        loop {
            for token in tokens {
                if let Some(finish) = generation.accept(token, shared)? {
                    return Ok(Some(finish));
                }
            }
            if generation.interrupted(shared)? {
                return Ok(None);
            }
            let before = speculator.stats();
            tokens = speculator
                .step(generation.max_tokens - generation.generated)
                .map_err(backend_failed)?;
            let after = speculator.stats();
            shared.metrics.speculated(
                after.proposed - before.proposed,
                after.accepted - before.accepted,
            );
        }
    }
}

/// Runs `work` (a prefill), which asks as it goes whether `generation`
/// should stop: the client, the deadline and shutdown are checked inside
/// prefill too (on the CPU reference a long prompt takes minutes).
/// `Ok(None)` when the client left.
fn unless_interrupted<T>(
    generation: &Generation,
    shared: &Shared,
    work: impl FnOnce(&mut dyn FnMut() -> bool) -> kiln_core::Result<T>,
) -> Result<Option<T>, ApiError> {
    let mut stopped = None;
    let result = work(&mut || match generation.interrupted(shared) {
        Ok(false) => true,
        Ok(true) => {
            stopped = Some(Ok(None));
            false
        }
        Err(error) => {
            stopped = Some(Err(error));
            false
        }
    });
    match result {
        Err(kiln_core::Error::Interrupted) => stopped.expect("interrupted when asked to stop"),
        other => other.map(Some).map_err(backend_failed),
    }
}
