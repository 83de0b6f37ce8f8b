//! The engine thread, as the rest of the server sees it: it loads the model
//! ([`Loaded`], read-only), opens its [`Decoder`] (IREE objects live and die
//! on this one thread) and runs the queued requests with [`run`]:
//! continuous batching on the IREE backends (every running sequence
//! advances one token per batched step; new ones join between steps), one
//! at a time on the CPU backends and with speculative decoding. Between
//! steps it checks whether each client is still there, each request's
//! deadline, and shutdown.
//!
//! Inside, a file a concern; each uses this file's types and only the files
//! listed before it: `queue` (the bounded queue: jobs in, events out),
//! `generation` (one request's state, token by token), `single_sequence`
//! and `batched` (the two loops, each owning its decoder), `load` (the
//! model as loaded, and the decoder opened on it).

#[cfg(feature = "xla-iree")]
mod batched;
mod generation;
mod load;
mod queue;
mod single_sequence;

use std::sync::mpsc::Receiver;

use kiln_core::{Backend, Proposer};

pub use load::Loaded;
pub use queue::{Event, Finish, FinishReason, Job, Place, Queue, queue};

use super::Shared;

/// How the engine decodes: the mutable part, which steps. It borrows the
/// [`Loaded`] model's weights.
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

/// Runs jobs on `decoder` until the queue's senders are all dropped.
/// `shared.ready` is set by the caller once the decoder is open. The
/// decoder's kind picks the loop here, once; the loop owns the decoder.
pub fn run<'m>(loaded: &'m Loaded, decoder: Decoder<'m>, jobs: Receiver<Job>, shared: &Shared) {
    let tokenizer = &loaded.model().tokenizer;
    match decoder {
        Decoder::Single(backend) => single_sequence::run(tokenizer, backend, jobs, shared),
        Decoder::Speculative(speculative) => {
            single_sequence::run(tokenizer, *speculative, jobs, shared)
        }
        #[cfg(feature = "xla-iree")]
        Decoder::Batched(decoder) => batched::run(tokenizer, *decoder, jobs, shared),
    }
}
