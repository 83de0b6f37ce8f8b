//! The engine thread: it loads the model, opens the backend (IREE objects
//! live and die on this one thread), and runs the queued requests: with
//! continuous batching on the IREE backends (every running sequence advances
//! one token per batched step; new ones join between steps), one at a time on
//! the CPU backend. Between steps it checks whether each client is still
//! there, each request's deadline, and shutdown.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::time::{Duration, Instant};

use anyhow::Result;
use kiln_core::{
    Backend, ChatTemplate, Model, Proposer, Sampler, SamplingParams, Speculator, TextStream,
};
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::Shared;
use super::error::ApiError;
use super::prompt::Prepared;
use super::stop::StopMatcher;

/// A request in the queue, its prompt tokenized and fitting the context,
/// with where its events go. The client is gone when `events` is closed.
pub struct Job {
    pub prompt: Prepared,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub events: UnboundedSender<Event>,
    pub deadline: Instant,
    /// Its place in the queue, given back when the engine takes it.
    pub place: Option<Place>,
}

#[derive(Debug)]
pub enum Event {
    /// The prompt is accepted and generation starts.
    Started {
        prompt_tokens: usize,
    },
    Text(String),
    Done(Finish),
    /// The request failed; nothing follows.
    Failed(ApiError),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub struct Finish {
    pub reason: FinishReason,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
}

/// The sending side of the bounded queue. A request takes its place
/// ([`Queue::reserve`]) before its prompt is prepared, so that requests
/// being prepared count against the capacity as queued ones do.
#[derive(Clone)]
pub struct Queue {
    sender: SyncSender<Job>,
    places: Arc<Semaphore>,
    capacity: usize,
}

/// A place in the queue, from its reservation until the engine takes the
/// job (or the request ends before): counted in `queue_depth` meanwhile.
pub struct Place {
    _permit: OwnedSemaphorePermit,
    shared: Arc<Shared>,
}

impl Drop for Place {
    fn drop(&mut self) {
        self.shared.metrics.queue_depth.dec();
    }
}

pub fn queue(capacity: usize) -> (Queue, Receiver<Job>) {
    let (sender, receiver) = std::sync::mpsc::sync_channel(capacity);
    let places = Arc::new(Semaphore::new(capacity));
    (
        Queue {
            sender,
            places,
            capacity,
        },
        receiver,
    )
}

impl Queue {
    /// A place for one request, or a refusal at once when the queue is full.
    pub fn reserve(&self, shared: &Arc<Shared>) -> Result<Place, ApiError> {
        let permit = Arc::clone(&self.places)
            .try_acquire_owned()
            .map_err(|_| ApiError::queue_full(self.capacity))?;
        shared.metrics.queue_depth.inc();
        Ok(Place {
            _permit: permit,
            shared: Arc::clone(shared),
        })
    }

    /// Queues `job` in the place it holds.
    pub fn submit(&self, job: Job) -> Result<(), ApiError> {
        // Never full: each queued job holds one of `capacity` places.
        self.sender.try_send(job).map_err(|error| match error {
            TrySendError::Full(_) => ApiError::queue_full(self.capacity),
            TrySendError::Disconnected(_) => {
                ApiError::unavailable("the engine has stopped; the server is shutting down")
            }
        })
    }
}

/// What the engine serves: the model and its decoder. Built on the engine
/// thread; the model's read-only part that validation needs is shared with
/// the HTTP side as a [`super::prompt::Prompter`].
pub struct Loaded<'m> {
    pub model: &'m Model,
    pub decoder: Decoder<'m>,
}

/// How the engine decodes.
pub enum Decoder<'m> {
    /// One request at a time: the CPU backend, or an IREE backend with
    /// `--batch-slots 1`.
    Single(Box<dyn Backend + 'm>),
    /// One request at a time with speculative decoding (`--speculate`).
    Speculative(Box<Speculative<'m>>),
    /// Continuous batching over the IREE backend's sequence slots.
    #[cfg(feature = "xla-iree")]
    Batched(Box<kiln_xla::BatchedDecoder<'m>>),
}

/// The parts of speculative decoding: the model's backend, the proposer
/// (which may run a draft model on its own backend) and K.
pub struct Speculative<'m> {
    pub backend: Box<dyn Backend + 'm>,
    pub proposer: Box<dyn Proposer + 'm>,
    pub draft_tokens: usize,
}

impl Decoder<'_> {
    pub fn max_context(&self) -> usize {
        match self {
            Decoder::Single(backend) => backend.max_context(),
            Decoder::Speculative(speculative) => speculative.backend.max_context(),
            #[cfg(feature = "xla-iree")]
            Decoder::Batched(decoder) => decoder.max_context(),
        }
    }
}

/// Runs jobs until the queue's senders are all dropped. `shared.ready` is
/// set by the caller once the backend is open.
pub fn run(loaded: &mut Loaded, jobs: Receiver<Job>, shared: &Shared) {
    #[cfg(feature = "xla-iree")]
    if let Decoder::Batched(_) = loaded.decoder {
        return batched::run(loaded, jobs, shared);
    }
    loop {
        let Some(job) = next_job(&jobs, shared, true) else {
            return;
        };
        let Some(job) = admissible(job, shared) else {
            continue;
        };
        shared.metrics.active.inc();
        serve(loaded, job, shared);
    }
}

/// The next queued job: waits for one when `wait` (returning `None` once the
/// server has stopped or the queue is closed), else only takes one that is
/// there (`None` otherwise).
/// The longest an idle engine holds its first job for others whose places
/// are reserved: a short prompt is prepared in well under a millisecond.
#[cfg(feature = "xla-iree")]
const ADMISSION_WINDOW: Duration = Duration::from_millis(20);

fn next_job(jobs: &Receiver<Job>, shared: &Shared, wait: bool) -> Option<Job> {
    loop {
        let received = if wait {
            jobs.recv_timeout(Duration::from_millis(100))
        } else {
            jobs.try_recv().map_err(|e| match e {
                std::sync::mpsc::TryRecvError::Empty => RecvTimeoutError::Timeout,
                std::sync::mpsc::TryRecvError::Disconnected => RecvTimeoutError::Disconnected,
            })
        };
        match received {
            Ok(mut job) => {
                // Out of the queue: its place is free again.
                job.place = None;
                return Some(job);
            }
            Err(RecvTimeoutError::Timeout) if !wait || shared.stopped.load(Ordering::Relaxed) => {
                return None;
            }
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => return None,
        }
    }
}

/// `job`, unless shutdown's grace is over: then it is refused.
fn admissible(job: Job, shared: &Shared) -> Option<Job> {
    if shared.cancel_all.load(Ordering::Relaxed) {
        let refused = Err(ApiError::unavailable("the server is shutting down"));
        report(&job.events, refused, shared, Counted::Queued);
        return None;
    }
    Some(job)
}

/// Runs one (active) job to its end.
fn serve(loaded: &mut Loaded, job: Job, shared: &Shared) {
    let events = job.events.clone();
    let result = generate(loaded, job, shared);
    report(&events, result, shared, Counted::Active);
}

/// Whether a sequence that ends was counted in the active gauge.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Counted {
    Queued,
    Active,
}

/// Ends a sequence: its metrics first (its outcome, and the active gauge
/// when it was counted there), then its last event to the client. In that
/// order a client that has its whole answer finds it in `/metrics`.
fn report(
    events: &UnboundedSender<Event>,
    result: Result<Option<Finish>, ApiError>,
    shared: &Shared,
    counted: Counted,
) {
    let (outcome, event) = match result {
        Ok(Some(finish)) => ("complete", Some(Event::Done(finish))),
        Ok(None) => ("cancelled", None),
        Err(error) => {
            let outcome = error.outcome();
            (outcome, Some(Event::Failed(error)))
        }
    };
    if counted == Counted::Active {
        shared.metrics.active.dec();
    }
    shared.metrics.outcome(outcome);
    if let Some(event) = event {
        let _ = events.send(event);
    }
}

fn backend_failed(e: kiln_core::Error) -> ApiError {
    ApiError::internal(format!("the backend failed: {e}"))
}

/// One request being generated: how its tokens are chosen, turned into text
/// and stopped. Both decoders drive it one token at a time.
struct Generation<'m> {
    events: UnboundedSender<Event>,
    deadline: Instant,
    prompt_tokens: usize,
    max_tokens: usize,
    stop_tokens: Vec<u32>,
    sampling: SamplingParams,
    sampler: Sampler,
    /// `None` once the text is finished.
    text: Option<TextStream<'m>>,
    stops: StopMatcher,
    generated: usize,
    started: Instant,
    last: Instant,
}

impl<'m> Generation<'m> {
    /// Validates `job` against the model and the context; tells the client
    /// generation starts. Returns the generation and the prompt's ids.
    fn start(
        loaded: &Loaded<'m>,
        job: Job,
        shared: &Shared,
    ) -> Result<(Generation<'m>, Vec<u32>), ApiError> {
        let Job {
            prompt,
            sampling,
            stop,
            events,
            deadline,
            place: _,
        } = job;
        // A request that waited out its time in the queue is not started.
        if Instant::now() >= deadline {
            return Err(ApiError::timeout(shared.request_timeout.as_secs()));
        }
        let Prepared {
            ids: prompt_ids,
            stop_tokens,
            max_tokens,
        } = prompt;
        // Prepared against the decoder's context, which it still is.
        debug_assert!(prompt_ids.len() + max_tokens <= loaded.decoder.max_context());
        let sampler =
            Sampler::new(sampling.clone()).map_err(|e| ApiError::invalid(e.to_string()))?;
        let _ = events.send(Event::Started {
            prompt_tokens: prompt_ids.len(),
        });
        let model: &'m Model = loaded.model;
        let now = Instant::now();
        let generation = Generation {
            events,
            deadline,
            prompt_tokens: prompt_ids.len(),
            max_tokens,
            stop_tokens,
            sampling,
            sampler,
            text: Some(TextStream::new(&model.tokenizer)),
            stops: StopMatcher::new(stop),
            generated: 0,
            started: now,
            last: now,
        };
        Ok((generation, prompt_ids))
    }

    /// Takes the next token: streams its text; returns the finish once the
    /// request is complete.
    fn accept(&mut self, token: u32, shared: &Shared) -> Result<Option<Finish>, ApiError> {
        self.generated += 1;
        let now = Instant::now();
        if self.generated == 1 {
            shared
                .metrics
                .ttft
                .observe((now - self.started).as_secs_f64());
        } else {
            shared.metrics.itl.observe((now - self.last).as_secs_f64());
        }
        self.last = now;
        shared.metrics.tokens.inc();
        if self.stop_tokens.contains(&token) {
            let matched = self.finish_text()?;
            send_text(&self.events, matched.text);
            if !matched.stopped {
                send_text(&self.events, self.stops.finish());
            }
            return Ok(Some(self.finish(FinishReason::Stop)));
        }
        let text = self.text.as_mut().expect("accept after finish");
        if let Some(piece) = text.push(token).map_err(backend_failed)? {
            let matched = self.stops.push(&piece);
            send_text(&self.events, matched.text);
            if matched.stopped {
                return Ok(Some(self.finish(FinishReason::Stop)));
            }
        }
        if self.generated == self.max_tokens {
            let matched = self.finish_text()?;
            send_text(&self.events, matched.text);
            if matched.stopped {
                return Ok(Some(self.finish(FinishReason::Stop)));
            }
            send_text(&self.events, self.stops.finish());
            return Ok(Some(self.finish(FinishReason::Length)));
        }
        Ok(None)
    }

    /// The text the stream held back, through the stop matcher.
    fn finish_text(&mut self) -> Result<super::stop::Matched, ApiError> {
        let text = self.text.take().expect("the text finishes once");
        let rest = text.finish().map_err(backend_failed)?;
        Ok(self.stops.push(rest.as_deref().unwrap_or("")))
    }

    fn finish(&self, reason: FinishReason) -> Finish {
        Finish {
            reason,
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.generated,
        }
    }

    /// Checked once per step: `Ok(true)` when the client left; an error on
    /// shutdown or at the deadline.
    fn interrupted(&self, shared: &Shared) -> Result<bool, ApiError> {
        // The deadline first: at the deadline the HTTP side answers 504 and
        // closes the channel itself, and that is a timeout, not a departure.
        if Instant::now() >= self.deadline {
            return Err(ApiError::timeout(shared.request_timeout.as_secs()));
        }
        if self.events.is_closed() {
            return Ok(true);
        }
        if shared.cancel_all.load(Ordering::Relaxed) {
            return Err(ApiError::unavailable(
                "the server is shutting down; the reply was cut short",
            ));
        }
        Ok(false)
    }
}

/// Generates one request alone; `Ok(None)` when the client left or the
/// server is stopping.
fn generate(loaded: &mut Loaded, job: Job, shared: &Shared) -> Result<Option<Finish>, ApiError> {
    let (generation, prompt_ids) = Generation::start(loaded, job, shared)?;
    match &mut loaded.decoder {
        Decoder::Single(backend) => {
            generate_plain(backend.as_mut(), generation, &prompt_ids, shared)
        }
        Decoder::Speculative(speculative) => {
            generate_speculative(speculative, generation, &prompt_ids, shared)
        }
        #[cfg(feature = "xla-iree")]
        Decoder::Batched(_) => unreachable!("the batched decoder has its own loop"),
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

/// One token per pass of the model.
fn generate_plain(
    backend: &mut dyn Backend,
    mut generation: Generation,
    prompt_ids: &[u32],
    shared: &Shared,
) -> Result<Option<Finish>, ApiError> {
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

/// Several tokens per pass when the proposer guesses well; the same tokens
/// (greedy) or the same distribution (sampling) as [`generate_plain`]. The
/// client, the deadline and shutdown are checked between passes.
fn generate_speculative(
    speculative: &mut Speculative,
    mut generation: Generation,
    prompt_ids: &[u32],
    shared: &Shared,
) -> Result<Option<Finish>, ApiError> {
    let sampler =
        Sampler::new(generation.sampling.clone()).map_err(|e| ApiError::invalid(e.to_string()))?;
    let Some((mut speculator, first)) = unless_interrupted(&generation, shared, |keep_going| {
        Speculator::start(
            speculative.backend.as_mut(),
            speculative.proposer.as_mut(),
            speculative.draft_tokens,
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

/// The continuous-batching loop: queued requests are admitted into free
/// slots between steps, every running sequence advances one token per step,
/// and a finished, cancelled or failed one leaves its slot at once.
#[cfg(feature = "xla-iree")]
mod batched {
    use kiln_xla::{Admission, BatchedDecoder, Choice, SlotOutput};

    use super::*;

    pub fn run(loaded: &mut Loaded, jobs: Receiver<Job>, shared: &Shared) {
        let slots = match &loaded.decoder {
            Decoder::Batched(decoder) => decoder.slot_count(),
            Decoder::Single(_) | Decoder::Speculative(_) => {
                unreachable!("run only hands over the batched decoder")
            }
        };
        let mut running: Vec<Option<Generation>> = (0..slots).map(|_| None).collect();
        let mut open = true;
        loop {
            // Take what waits, while slots are free; wait only when idle.
            let Decoder::Batched(decoder) = &loaded.decoder else {
                unreachable!()
            };
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
                    let Ok(mut job) = jobs.recv_timeout(left) else {
                        break;
                    };
                    job.place = None;
                    waiting.extend(admissible(job, shared));
                }
            }
            if !waiting.is_empty() {
                admit(loaded, &mut running, waiting, shared);
            }
            if !open && running.iter().all(Option::is_none) {
                return;
            }
            let Decoder::Batched(decoder) = &mut loaded.decoder else {
                unreachable!()
            };
            step(decoder, &mut running, shared);
        }
    }

    /// Starts `jobs` (no more than the free slots) in free slots, together:
    /// validation, one prefill for the prompts that can share it, first
    /// tokens.
    fn admit<'m>(
        loaded: &mut Loaded<'m>,
        running: &mut [Option<Generation<'m>>],
        jobs: Vec<Job>,
        shared: &Shared,
    ) {
        let mut started = Vec::with_capacity(jobs.len());
        for job in jobs {
            let events = job.events.clone();
            match Generation::start(loaded, job, shared) {
                Ok(generation) => started.push(generation),
                Err(error) => report(&events, Err(error), shared, Counted::Queued),
            }
        }
        let Decoder::Batched(decoder) = &mut loaded.decoder else {
            unreachable!()
        };
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
}

fn send_text(events: &UnboundedSender<Event>, text: String) {
    if !text.is_empty() {
        let _ = events.send(Event::Text(text));
    }
}

/// The decoder of `--backend`: speculative with `--speculate` (one request
/// at a time), else IREE with `slots` > 1 batches and the rest run one
/// request at a time. Every module is loaded (or compiled) here, before the
/// server says it is ready. `draft` is the draft model of `--speculate
/// draft|self`.
pub fn open_decoder<'m>(
    model: &'m Model,
    draft: Option<&'m Model>,
    args: &crate::backends::ModelArgs,
    speculation: &crate::speculation::SpeculationArgs,
    slots: usize,
) -> Result<Decoder<'m>> {
    use crate::backends::open_loaded;
    let backend_kind = args.choose(model)?;
    if let Some(kind) = speculation.speculate {
        let draft_tokens = usize::from(speculation.draft_tokens);
        let backend = open_loaded(model, backend_kind, &args.options, Some(draft_tokens))?;
        let proposer = crate::speculation::proposer_on(kind, draft, |draft| {
            open_loaded(draft, backend_kind, &args.options, Some(draft_tokens))
        })?;
        return Ok(Decoder::Speculative(Box::new(Speculative {
            backend,
            proposer,
            draft_tokens,
        })));
    }
    #[cfg(feature = "xla-iree")]
    if slots > 1
        && matches!(
            backend_kind,
            crate::backends::BackendKind::IreeCpu | crate::backends::BackendKind::IreeCuda
        )
    {
        let backend = crate::backends::open_iree(model, backend_kind, &args.options)?;
        let mut decoder = kiln_xla::BatchedDecoder::new(backend, slots)?;
        decoder.prepare(|_, _| {})?;
        return Ok(Decoder::Batched(Box::new(decoder)));
    }
    // Batching needs the IREE backends; without them every slot count runs
    // one request at a time.
    #[cfg(not(feature = "xla-iree"))]
    let _ = slots;
    Ok(Decoder::Single(open_loaded(
        model,
        backend_kind,
        &args.options,
        None,
    )?))
}

/// Loads the model `--model` names and its chat template (kiln's ChatML for
/// the embedded model; the folder's or GGUF file's own, if any, otherwise).
pub fn load_model(spec: Option<&std::path::Path>) -> Result<(Model, Option<ChatTemplate>)> {
    match spec {
        None => Ok((
            crate::backends::load_model(None)?,
            Some(ChatTemplate::chatml()),
        )),
        Some(spec) => crate::chat::load_with_template(spec),
    }
}
