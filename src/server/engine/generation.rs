//! One request being generated, whichever loop runs it: how its tokens are
//! chosen (its sampler), turned into text (the tokenizer's incremental
//! decoder), stopped (stop tokens, stop strings, `max_tokens`) and timed
//! (time to first token, inter-token latency), and whether it should go on
//! (its client, its deadline, shutdown). The loops own the decoder; a
//! generation owns nothing but its request, so both loops drive it one
//! token at a time in the same way.

use std::sync::atomic::Ordering;
use std::time::Instant;

use kiln_core::{Sampler, SamplingParams, TextStream, Tokenizer};
use tokio::sync::mpsc::UnboundedSender;

use crate::server::Shared;
use crate::server::error::ApiError;
use crate::server::prompt::Prepared;
use crate::server::stop::{Matched, StopMatcher};

use super::queue::{Event, Finish, FinishReason, Job};

/// One request being generated.
pub(super) struct Generation<'m> {
    pub(super) events: UnboundedSender<Event>,
    deadline: Instant,
    prompt_tokens: usize,
    pub(super) max_tokens: usize,
    stop_tokens: Vec<u32>,
    pub(super) sampling: SamplingParams,
    pub(super) sampler: Sampler,
    /// `None` once the text is finished.
    text: Option<TextStream<'m>>,
    stops: StopMatcher,
    /// Tokens accepted so far.
    pub(super) generated: usize,
    started: Instant,
    last: Instant,
}

impl<'m> Generation<'m> {
    /// Validates `job` against the model (its text read by `tokenizer`) and
    /// the context (`max_context` tokens); tells the client generation
    /// starts. Returns the generation and the prompt's ids.
    pub(super) fn start(
        tokenizer: &'m Tokenizer,
        max_context: usize,
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
        debug_assert!(prompt_ids.len() + max_tokens <= max_context);
        let sampler =
            Sampler::new(sampling.clone()).map_err(|e| ApiError::invalid(e.to_string()))?;
        let _ = events.send(Event::Started {
            prompt_tokens: prompt_ids.len(),
        });
        let now = Instant::now();
        let generation = Generation {
            events,
            deadline,
            prompt_tokens: prompt_ids.len(),
            max_tokens,
            stop_tokens,
            sampling,
            sampler,
            text: Some(TextStream::new(tokenizer)),
            stops: StopMatcher::new(stop),
            generated: 0,
            started: now,
            last: now,
        };
        Ok((generation, prompt_ids))
    }

    /// Takes the next token: streams its text; returns the finish once the
    /// request is complete.
    pub(super) fn accept(
        &mut self,
        token: u32,
        shared: &Shared,
    ) -> Result<Option<Finish>, ApiError> {
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
    fn finish_text(&mut self) -> Result<Matched, ApiError> {
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
    pub(super) fn interrupted(&self, shared: &Shared) -> Result<bool, ApiError> {
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

/// A backend's error as the client sees it.
pub(super) fn backend_failed(e: kiln_core::Error) -> ApiError {
    ApiError::internal(format!("the backend failed: {e}"))
}

fn send_text(events: &UnboundedSender<Event>, text: String) {
    if !text.is_empty() {
        let _ = events.send(Event::Text(text));
    }
}
