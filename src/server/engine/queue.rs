//! The bounded queue between the HTTP side and the engine thread, and what
//! travels through it: jobs in ([`Job`]), each request's events out
//! ([`Event`]). It owns admission on both ends: a place reserved before a
//! prompt is prepared (so requests being prepared count against the
//! capacity), a job taken off by the engine, refused when shutdown's grace
//! is over, and a sequence's end reported (metrics, then its last event).
//! Both engine loops take jobs and end sequences through here, so they
//! count and answer alike.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TryRecvError, TrySendError};
use std::time::{Duration, Instant};

use kiln_core::SamplingParams;
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::server::Shared;
use crate::server::error::ApiError;
use crate::server::prompt::Prepared;

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

/// The next queued job: waits for one when `wait` (returning `None` once the
/// server has stopped or the queue is closed), else only takes one that is
/// there (`None` otherwise).
pub(super) fn next_job(jobs: &Receiver<Job>, shared: &Shared, wait: bool) -> Option<Job> {
    loop {
        let received = if wait {
            jobs.recv_timeout(Duration::from_millis(100))
        } else {
            jobs.try_recv().map_err(|e| match e {
                TryRecvError::Empty => RecvTimeoutError::Timeout,
                TryRecvError::Disconnected => RecvTimeoutError::Disconnected,
            })
        };
        match received {
            Ok(job) => return Some(taken(job)),
            Err(RecvTimeoutError::Timeout) if !wait || shared.stopped.load(Ordering::Relaxed) => {
                return None;
            }
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => return None,
        }
    }
}

/// `job` as the engine takes it: out of the queue, its place is free again.
pub(super) fn taken(mut job: Job) -> Job {
    job.place = None;
    job
}

/// `job`, unless shutdown's grace is over: then it is refused.
pub(super) fn admissible(job: Job, shared: &Shared) -> Option<Job> {
    if shared.cancel_all.load(Ordering::Relaxed) {
        let refused = Err(ApiError::unavailable("the server is shutting down"));
        report(&job.events, refused, shared, Counted::Queued);
        return None;
    }
    Some(job)
}

/// Whether a sequence that ends was counted in the active gauge.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Counted {
    Queued,
    Active,
}

/// Ends a sequence: its metrics first (its outcome, and the active gauge
/// when it was counted there), then its last event to the client. In that
/// order a client that has its whole answer finds it in `/metrics`.
pub(super) fn report(
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
