//! The continuous-batching loop over the IREE backend's sequence slots: it
//! owns the [`BatchedDecoder`] for as long as the engine runs. Queued
//! requests are admitted into free slots between steps (those that arrive
//! together share one prefill), every running sequence advances one token
//! per batched step, and a finished, cancelled or failed one leaves its slot
//! at once.

use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use kiln_core::Tokenizer;
use kiln_xla::{Admission, BatchedDecoder, Choice, SlotOutput};

use crate::server::Shared;
use crate::server::error::ApiError;

use super::generation::{Generation, backend_failed};
use super::queue::{Counted, Job, admissible, next_job, report, taken};

/// The longest an idle engine holds its first job for others whose places
/// are reserved: a short prompt is prepared in well under a millisecond.
const ADMISSION_WINDOW: Duration = Duration::from_millis(20);

/// Runs jobs on `decoder` until the queue's senders are all dropped (or the
/// server has stopped) and every running sequence has ended.
pub(super) fn run(
    tokenizer: &Tokenizer,
    mut decoder: BatchedDecoder,
    jobs: Receiver<Job>,
    shared: &Shared,
) {
    let max_context = decoder.max_context();
    let mut running: Vec<Option<Generation>> = (0..decoder.slot_count()).map(|_| None).collect();
    let mut open = true;
    loop {
        // Take what waits, while slots are free; wait only when idle.
        let free = decoder.free_slots().len();
        let mut waiting = Vec::new();
        while open && waiting.len() < free {
            let idle = waiting.is_empty() && running.iter().all(Option::is_none);
            let Some(job) = next_job(&jobs, shared, idle) else {
                // Idle and nothing came: the queue is closed or stopped.
                open = !idle;
                break;
            };
            waiting.extend(admissible(job, shared));
        }
        // Requests that hold places are still being prepared (rendered,
        // tokenized) on the HTTP side: an idle engine waits a moment
        // for them, so that requests that came together share their
        // prefill, whatever the order their preparations end in.
        if open && !waiting.is_empty() && running.iter().all(Option::is_none) {
            let until = Instant::now() + ADMISSION_WINDOW;
            while waiting.len() < free && shared.metrics.queue_depth.get() > 0 {
                let Some(left) = until.checked_duration_since(Instant::now()) else {
                    break;
                };
                let Ok(job) = jobs.recv_timeout(left) else {
                    break;
                };
                waiting.extend(admissible(taken(job), shared));
            }
        }
        if !waiting.is_empty() {
            admit(
                tokenizer,
                max_context,
                &mut decoder,
                &mut running,
                waiting,
                shared,
            );
        }
        if !open && running.iter().all(Option::is_none) {
            return;
        }
        step(&mut decoder, &mut running, shared);
    }
}

/// Starts `jobs` (no more than the free slots) in free slots, together:
/// validation, one prefill for the prompts that can share it, first tokens.
/// Their text is read by `tokenizer`; their prompts were prepared against
/// `max_context`.
fn admit<'m>(
    tokenizer: &'m Tokenizer,
    max_context: usize,
    decoder: &mut BatchedDecoder,
    running: &mut [Option<Generation<'m>>],
    jobs: Vec<Job>,
    shared: &Shared,
) {
    let mut started = Vec::with_capacity(jobs.len());
    for job in jobs {
        let events = job.events.clone();
        match Generation::start(tokenizer, max_context, job, shared) {
            Ok(generation) => started.push(generation),
            Err(error) => report(&events, Err(error), shared, Counted::Queued),
        }
    }
    // `run` takes no more jobs than the decoder has free slots.
    let free = decoder.free_slots();
    debug_assert!(started.len() <= free.len());
    let results = {
        let admissions: Vec<Admission> = started
            .iter()
            .zip(&free)
            .map(|((generation, prompt_ids), &slot)| Admission {
                slot,
                prompt: prompt_ids,
                choice: match generation.sampler.is_greedy() {
                    true => Choice::Greedy,
                    false => Choice::Sampled,
                },
            })
            .collect();
        let before = decoder.prompts_prefilled_together();
        let results = decoder.admit_all(&admissions);
        let together = decoder.prompts_prefilled_together() - before;
        shared.metrics.prefilled_together.inc_by(together as u64);
        results
    };
    for (((mut generation, _), slot), logits) in started.into_iter().zip(free).zip(results) {
        shared.metrics.active.inc();
        let events = generation.events.clone();
        let first = logits
            .and_then(|logits| generation.sampler.sample(&logits))
            .map_err(backend_failed);
        match first.and_then(|token| advance(decoder, slot, &mut generation, token, shared)) {
            Ok(true) => running[slot] = Some(generation),
            Ok(false) => {}
            Err(error) => {
                decoder.release(slot);
                report(&events, Err(error), shared, Counted::Active);
            }
        }
    }
}

/// Hands `token` to the slot's generation; feeds it to the decoder when
/// the sequence goes on (`Ok(true)`), else reports the end and frees the
/// slot (`Ok(false)`).
fn advance(
    decoder: &mut BatchedDecoder,
    slot: usize,
    generation: &mut Generation,
    token: u32,
    shared: &Shared,
) -> Result<bool, ApiError> {
    let ended = match generation.accept(token, shared)? {
        Some(finish) => Some(Ok(Some(finish))),
        None if generation.interrupted(shared)? => Some(Ok(None)),
        None => None,
    };
    if let Some(result) = ended {
        decoder.release(slot);
        report(&generation.events, result, shared, Counted::Active);
        return Ok(false);
    }
    decoder.feed(slot, token).map_err(backend_failed)?;
    Ok(true)
}

/// One batched step of every running sequence.
fn step(decoder: &mut BatchedDecoder, running: &mut [Option<Generation>], shared: &Shared) {
    let outputs = match decoder.step() {
        Ok(outputs) => outputs,
        Err(error) => {
            // The decoder dropped the stepped sequences: they all fail.
            let error = backend_failed(error);
            for (slot, generation) in running.iter_mut().enumerate() {
                if let Some(generation) = generation.take() {
                    decoder.release(slot);
                    let result = Err(error.clone());
                    report(&generation.events, result, shared, Counted::Active);
                }
            }
            return;
        }
    };
    for (slot, output) in outputs {
        let Some(generation) = running[slot].as_mut() else {
            continue;
        };
        let token = match output {
            SlotOutput::Token(token) => Ok(token),
            SlotOutput::Logits(logits) => {
                generation.sampler.sample(&logits).map_err(backend_failed)
            }
        };
        let events = generation.events.clone();
        match token.and_then(|token| advance(decoder, slot, generation, token, shared)) {
            Ok(true) => {}
            Ok(false) => running[slot] = None,
            Err(error) => {
                decoder.release(slot);
                running[slot] = None;
                report(&events, Err(error), shared, Counted::Active);
            }
        }
    }
}
