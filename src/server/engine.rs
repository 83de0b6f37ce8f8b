//! The engine thread: it loads the model, opens the backend (IREE objects
//! live and die on this one thread), and runs the queued requests one at a
//! time (batch 1), checking between steps whether the client is still there,
//! the request's deadline, and shutdown.

use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::time::{Duration, Instant};

use anyhow::Result;
use kiln_core::{Backend, ChatTemplate, Message, Model, Sampler, SamplingParams, TextStream};
use tokio::sync::mpsc::UnboundedSender;

use super::Shared;
use super::error::ApiError;
use super::metrics::Metrics;
use super::stop::StopMatcher;

pub enum Prompt {
    Text(String),
    Chat(Vec<Message>),
}

/// A validated request.
pub struct Request {
    pub prompt: Prompt,
    /// At most this many tokens; up to the context's room when `None`.
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
}

/// A request in the queue, with where its events go. The client is gone
/// when `events` is closed.
pub struct Job {
    pub request: Request,
    pub events: UnboundedSender<Event>,
    pub deadline: Instant,
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

/// The sending side of the bounded queue.
#[derive(Clone)]
pub struct Queue {
    sender: SyncSender<Job>,
    capacity: usize,
}

pub fn queue(capacity: usize) -> (Queue, Receiver<Job>) {
    let (sender, receiver) = std::sync::mpsc::sync_channel(capacity);
    (Queue { sender, capacity }, receiver)
}

impl Queue {
    /// Queues `job`, or refuses it at once when the queue is full.
    pub fn submit(&self, job: Job, metrics: &Metrics) -> Result<(), ApiError> {
        // Counted before sending so that the engine's decrement never runs first.
        metrics.queue_depth.inc();
        match self.sender.try_send(job) {
            Ok(()) => Ok(()),
            Err(error) => {
                metrics.queue_depth.dec();
                Err(match error {
                    TrySendError::Full(_) => ApiError::queue_full(self.capacity),
                    TrySendError::Disconnected(_) => {
                        ApiError::unavailable("the engine has stopped; the server is shutting down")
                    }
                })
            }
        }
    }
}

/// What the engine serves: the model, its chat template if it has one, and
/// how to open the backend. Built on the engine thread.
pub struct Loaded<'m> {
    pub model: &'m Model,
    pub template: Option<ChatTemplate>,
    pub backend: Box<dyn Backend + 'm>,
}

/// Runs jobs until the queue's senders are all dropped. `shared.ready` is
/// set by the caller once the backend is open.
pub fn run(loaded: &mut Loaded, jobs: Receiver<Job>, shared: &Shared) {
    loop {
        let job = match jobs.recv_timeout(Duration::from_millis(100)) {
            Ok(job) => job,
            Err(RecvTimeoutError::Timeout) if shared.stopped.load(Ordering::Relaxed) => return,
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => return,
        };
        shared.metrics.queue_depth.dec();
        if shared.cancel_all.load(Ordering::Relaxed) {
            let _ = job.events.send(Event::Failed(ApiError::unavailable(
                "the server is shutting down",
            )));
            shared.metrics.outcome("shutdown");
            continue;
        }
        shared.metrics.active.inc();
        let outcome = serve(loaded, job, shared);
        shared.metrics.active.dec();
        shared.metrics.outcome(outcome);
    }
}

/// Runs one job to its end; returns its outcome for the metrics.
fn serve(loaded: &mut Loaded, job: Job, shared: &Shared) -> &'static str {
    let Job {
        request,
        events,
        deadline,
    } = job;
    match generate(loaded, request, &events, deadline, shared) {
        Ok(Some(finish)) => {
            let _ = events.send(Event::Done(finish));
            "complete"
        }
        Ok(None) => "cancelled",
        Err(error) => {
            let outcome = if error.status.is_client_error() {
                "invalid"
            } else if error.status == axum::http::StatusCode::GATEWAY_TIMEOUT {
                "timeout"
            } else if error.status == axum::http::StatusCode::SERVICE_UNAVAILABLE {
                "shutdown"
            } else {
                "error"
            };
            let _ = events.send(Event::Failed(error));
            outcome
        }
    }
}

/// The prompt's ids and the tokens that end the generation.
fn tokenize(
    loaded: &Loaded,
    prompt: Prompt,
) -> Result<(Vec<u32>, Vec<u32>, &'static str), ApiError> {
    let model = loaded.model;
    let internal = |e: kiln_core::Error| ApiError::invalid(e.to_string());
    match prompt {
        Prompt::Text(text) => Ok((
            model.tokenizer.encode(&text).map_err(internal)?,
            model.config.eos_token_ids.clone(),
            "prompt",
        )),
        Prompt::Chat(messages) => {
            let template = loaded.template.as_ref().ok_or_else(|| {
                ApiError::invalid(format!(
                    "the model {} has no chat template; use /v1/completions",
                    model.name
                ))
            })?;
            let rendered = template.render(&messages, true).map_err(internal)?;
            let ids = model
                .tokenizer
                .encode_rendered(&rendered)
                .map_err(internal)?;
            Ok((ids, chat_stop_tokens(model, template), "messages"))
        }
    }
}

/// The stop tokens `kiln chat` uses for this model and template.
fn chat_stop_tokens(model: &Model, template: &ChatTemplate) -> Vec<u32> {
    let mut stops = model.config.eos_token_ids.clone();
    stops.extend(model.tokenizer.token_to_id(template.eos_token()));
    stops.sort_unstable();
    stops.dedup();
    stops
}

/// Generates; `Ok(None)` when the client left or the server is stopping.
fn generate(
    loaded: &mut Loaded,
    request: Request,
    events: &UnboundedSender<Event>,
    deadline: Instant,
    shared: &Shared,
) -> Result<Option<Finish>, ApiError> {
    // A request that waited out its time in the queue is not started.
    if Instant::now() >= deadline {
        return Err(ApiError::timeout(shared.request_timeout.as_secs()));
    }
    let (prompt_ids, stop_tokens, param) = tokenize(loaded, request.prompt)?;
    let context = loaded.backend.max_context();
    if prompt_ids.len() >= context {
        return Err(ApiError::context_length(
            param,
            format!(
                "the prompt is {} tokens long and the model's context holds {context}; shorten it",
                prompt_ids.len()
            ),
        ));
    }
    let room = context - prompt_ids.len();
    let max_tokens = match request.max_tokens {
        Some(max) if max > room => {
            return Err(ApiError::context_length(
                "max_tokens",
                format!(
                    "the prompt ({} tokens) and max_tokens ({max}) need {} positions and the \
                     model's context holds {context}; lower max_tokens or shorten the prompt",
                    prompt_ids.len(),
                    prompt_ids.len() + max
                ),
            ));
        }
        Some(max) => max,
        None => room,
    };
    let mut sampler =
        Sampler::new(request.sampling).map_err(|e| ApiError::invalid(e.to_string()))?;
    let _ = events.send(Event::Started {
        prompt_tokens: prompt_ids.len(),
    });
    let failed = |e: kiln_core::Error| ApiError::internal(format!("the backend failed: {e}"));
    let model = loaded.model;
    let backend = loaded.backend.as_mut();
    let mut text = TextStream::new(&model.tokenizer);
    let mut stops = StopMatcher::new(request.stop);
    let started = Instant::now();
    let mut last = started;
    let mut generated = 0;
    let mut token = sampler
        .sample(&backend.prefill(&prompt_ids).map_err(failed)?)
        .map_err(failed)?;
    let finish = |reason, generated| Finish {
        reason,
        prompt_tokens: prompt_ids.len(),
        completion_tokens: generated,
    };
    loop {
        generated += 1;
        let now = Instant::now();
        if generated == 1 {
            shared.metrics.ttft.observe((now - started).as_secs_f64());
        } else {
            shared.metrics.itl.observe((now - last).as_secs_f64());
        }
        last = now;
        shared.metrics.tokens.inc();
        if stop_tokens.contains(&token) {
            let rest = text.finish().map_err(failed)?;
            let matched = stops.push(rest.as_deref().unwrap_or(""));
            send_text(events, matched.text);
            if !matched.stopped {
                send_text(events, stops.finish());
            }
            return Ok(Some(finish(FinishReason::Stop, generated)));
        }
        if let Some(piece) = text.push(token).map_err(failed)? {
            let matched = stops.push(&piece);
            send_text(events, matched.text);
            if matched.stopped {
                return Ok(Some(finish(FinishReason::Stop, generated)));
            }
        }
        if generated == max_tokens {
            let rest = text.finish().map_err(failed)?;
            let matched = stops.push(rest.as_deref().unwrap_or(""));
            send_text(events, matched.text);
            if matched.stopped {
                return Ok(Some(finish(FinishReason::Stop, generated)));
            }
            send_text(events, stops.finish());
            return Ok(Some(finish(FinishReason::Length, generated)));
        }
        // Checked once per step: a client that left, shutdown, the deadline.
        if events.is_closed() {
            return Ok(None);
        }
        if shared.cancel_all.load(Ordering::Relaxed) {
            return Err(ApiError::unavailable(
                "the server is shutting down; the reply was cut short",
            ));
        }
        if Instant::now() >= deadline {
            return Err(ApiError::timeout(shared.request_timeout.as_secs()));
        }
        token = if sampler.is_greedy() {
            backend.decode_greedy(token).map_err(failed)?
        } else {
            sampler
                .sample(&backend.decode(token).map_err(failed)?)
                .map_err(failed)?
        };
    }
}

fn send_text(events: &UnboundedSender<Event>, text: String) {
    if !text.is_empty() {
        let _ = events.send(Event::Text(text));
    }
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
