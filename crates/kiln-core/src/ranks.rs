//! Tensor-parallel ranks kept in step: one thread per rank, each owning its
//! backend (a device and the rank's slice of the model, see
//! [`crate::tensor_parallel`]), behind one [`Backend`] that hands every
//! call to all of them and returns rank 0's answer.
//!
//! The ranks' graphs meet in collectives, so every rank must make the same
//! calls in the same order: that is all this module does. A call every rank
//! refuses alike (checks made before any collective: a full context, a
//! token outside the vocabulary) returns rank 0's error and the ranks go
//! on. A rank that fails alone (or panics) ends the whole: its error is
//! returned naming it, and every later call is refused. A rank that does not answer within the timeout (stuck in a
//! collective whose partner died, say) is named the same way; its thread
//! cannot be stopped from outside and is left behind, so the caller should
//! end the process rather than start another world beside it.
//!
//! One process driving N devices rather than N processes: IREE's CUDA HAL
//! makes a channel per device and NCCL takes one rank per thread of a
//! process, so N threads need no launcher and no messages between
//! processes, and die with the process.

use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::time::{Duration, Instant};

use crate::backend::Backend;
use crate::error::{Error, Result};

/// Opens rank `rank`'s backend on the rank's own thread and hands it to
/// `serve`, which returns when the ranks are done; an error if the backend
/// cannot be opened. The backend and what it borrows live on that thread.
pub trait RankOpener: Send + Sync + 'static {
    fn with_rank(&self, rank: usize, serve: &mut dyn FnMut(&mut dyn Backend)) -> Result<()>;
}

/// A call every rank makes.
#[derive(Clone, Debug)]
enum Call {
    Prefill(Vec<u32>),
    PrefillEmbeddings(Vec<f32>),
    Decode(u32),
    DecodeGreedy(u32),
    Append(Vec<u32>),
    AppendGreedy(Vec<u32>),
    Rewind(usize),
}

impl Call {
    /// What the call is, for errors.
    fn name(&self) -> &'static str {
        match self {
            Call::Prefill(_) => "a prefill",
            Call::PrefillEmbeddings(_) => "a prefill of embeddings",
            Call::Decode(_) => "a decode step",
            Call::DecodeGreedy(_) => "a greedy decode step",
            Call::Append(_) => "an append",
            Call::AppendGreedy(_) => "a greedy append",
            Call::Rewind(_) => "a rewind",
        }
    }
}

#[derive(Debug)]
enum Reply {
    Opened { name: String, max_context: usize },
    Logits(Vec<f32>),
    Tokens(Vec<u32>),
    Done,
}

/// A rank's answer to one call.
struct Answered {
    rank: usize,
    /// The reply, or the error.
    reply: Result<Reply>,
    /// The positions the rank's backend holds after the call.
    len: usize,
    /// The rank's thread has ended (it could not open, or panicked).
    ended: bool,
}

/// How long the other ranks have to fail alike once one has failed.
const ALIKE_WITHIN: Duration = Duration::from_secs(5);

/// The ranks of one tensor-parallel world, as one backend.
pub struct Ranks {
    calls: Vec<Sender<Call>>,
    replies: Receiver<Answered>,
    threads: Vec<std::thread::JoinHandle<()>>,
    timeout: Duration,
    name: String,
    max_context: usize,
    /// Rank 0's positions after the last call.
    len: usize,
    /// Set by the first failure that leaves the ranks out of step.
    failed: Option<String>,
}

/// How long dropping the ranks waits for their threads to let go of their
/// devices.
const THREADS_END_WITHIN: Duration = Duration::from_secs(30);

impl Ranks {
    /// Starts `count` rank threads, each opening its backend with `opener`,
    /// and waits (at most `open_within`) until every one is open; every
    /// call after is answered within `answer_within` or fails.
    pub fn start(
        count: usize,
        opener: impl RankOpener,
        open_within: Duration,
        answer_within: Duration,
    ) -> Result<Ranks> {
        if count == 0 {
            return Err(Error::Invalid(
                "a tensor-parallel world has at least one rank".into(),
            ));
        }
        let opener = std::sync::Arc::new(opener);
        let (reply_to, replies) = channel();
        let mut ranks = Ranks {
            calls: Vec::with_capacity(count),
            replies,
            threads: Vec::with_capacity(count),
            timeout: open_within,
            name: String::new(),
            max_context: 0,
            len: 0,
            failed: None,
        };
        for rank in 0..count {
            let (call_to, incoming) = channel();
            let (opener, reply_to) = (opener.clone(), reply_to.clone());
            let thread = std::thread::Builder::new()
                .name(format!("kiln-rank-{rank}"))
                .spawn(move || serve_rank(rank, opener.as_ref(), incoming, reply_to))
                .map_err(|e| Error::Backend(format!("starting rank {rank}'s thread: {e}")))?;
            ranks.calls.push(call_to);
            ranks.threads.push(thread);
        }
        // Only the ranks hold senders now: when every one has ended, the
        // wait below ends too.
        drop(reply_to);
        let opened = ranks.collect("opening its backend")?;
        ranks.timeout = answer_within;
        let Some(Reply::Opened { name, max_context }) = opened.into_iter().next() else {
            unreachable!("every rank answers its opening with Opened");
        };
        ranks.name = format!("{name} ×{count}");
        ranks.max_context = max_context;
        Ok(ranks)
    }

    /// `call` to every rank; rank 0's reply.
    fn all(&mut self, call: Call) -> Result<Reply> {
        if let Some(failure) = &self.failed {
            return Err(Error::Backend(format!(
                "the tensor-parallel ranks stopped at an earlier failure ({failure})"
            )));
        }
        for (rank, to) in self.calls.iter().enumerate() {
            if to.send(call.clone()).is_err() {
                return Err(self.fail(format!("rank {rank} has stopped")));
            }
        }
        Ok(self.collect(call.name())?.swap_remove(0))
    }

    /// Every rank's reply to one call, in rank order. Where every rank
    /// refused it alike (the same check, made before any collective: a full
    /// context, a token outside the vocabulary), rank 0's error as it is,
    /// the ranks still in step. Otherwise (some failed, a rank's thread
    /// ended, the ranks' positions disagree, some did not answer in time)
    /// an error naming the ranks, and the ranks stop. Once one rank has
    /// failed, the others get [`ALIKE_WITHIN`] to fail alike: a rank that
    /// failed alone leaves them in a collective that never ends.
    fn collect(&mut self, what: &str) -> Result<Vec<Reply>> {
        let count = self.calls.len();
        let mut deadline = Instant::now() + self.timeout;
        let mut answers: Vec<Option<Answered>> = (0..count).map(|_| None).collect();
        while answers.iter().any(Option::is_none) {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.replies.recv_timeout(left) {
                Ok(answer) => {
                    if answer.reply.is_err() {
                        deadline = deadline.min(Instant::now() + ALIKE_WITHIN);
                    }
                    let rank = answer.rank;
                    answers[rank] = Some(answer);
                }
                Err(RecvTimeoutError::Timeout) | Err(RecvTimeoutError::Disconnected) => {
                    let errors: Vec<String> = answers
                        .iter()
                        .flatten()
                        .filter_map(|a| {
                            let e = a.reply.as_ref().err()?;
                            Some(format!("rank {}, {what}: {e}; ", a.rank))
                        })
                        .collect();
                    let silent: Vec<String> = (0..count)
                        .filter(|&r| answers[r].is_none())
                        .map(|r| r.to_string())
                        .collect();
                    let waited = match errors.is_empty() {
                        true => self.timeout,
                        false => ALIKE_WITHIN,
                    };
                    return Err(self.fail(format!(
                        "{}rank {} did not answer {what} within {waited:.0?} (a rank that failed \
                         or died leaves the others waiting in a collective)",
                        errors.concat(),
                        silent.join(", "),
                    )));
                }
            }
        }
        let answers: Vec<Answered> = answers.into_iter().flatten().collect();
        let lengths_agree = answers.iter().all(|a| a.len == answers[0].len);
        let ended = answers.iter().any(|a| a.ended);
        self.len = answers[0].len;
        let errors: Vec<(usize, String, bool)> = answers
            .iter()
            .filter_map(|a| {
                let e = a.reply.as_ref().err()?;
                let pre_collective = matches!(e, Error::Invalid(_) | Error::ContextFull { .. });
                Some((a.rank, e.to_string(), pre_collective))
            })
            .collect();
        let Some((first, message, _)) = errors.first().cloned() else {
            if !lengths_agree {
                return Err(self.fail(format!("after {what} the ranks hold different positions")));
            }
            return Ok(answers.into_iter().filter_map(|a| a.reply.ok()).collect());
        };
        let alike = errors.len() == count && errors.iter().all(|(_, m, pre)| *pre && *m == message);
        if alike
            && lengths_agree
            && !ended
            && let Some(Answered { reply: Err(e), .. }) = answers.into_iter().next()
        {
            return Err(e);
        }
        Err(self.fail(format!("rank {first}, {what}: {message}")))
    }

    fn fail(&mut self, failure: String) -> Error {
        self.failed = Some(failure.clone());
        Error::Backend(failure)
    }

    fn logits(&mut self, call: Call) -> Result<Vec<f32>> {
        match self.all(call)? {
            Reply::Logits(logits) => Ok(logits),
            other => unreachable!("a logits call answered {other:?}"),
        }
    }

    fn tokens(&mut self, call: Call) -> Result<Vec<u32>> {
        match self.all(call)? {
            Reply::Tokens(tokens) => Ok(tokens),
            other => unreachable!("a tokens call answered {other:?}"),
        }
    }
}

impl Drop for Ranks {
    /// Ends the ranks' threads and waits, within a bound, for them to let
    /// go of their devices, so that a world opened next does not meet the
    /// last one's memory; a thread stuck in a collective is left behind.
    fn drop(&mut self) {
        self.calls.clear();
        let deadline = Instant::now() + THREADS_END_WITHIN;
        for thread in std::mem::take(&mut self.threads) {
            while !thread.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            if thread.is_finished() {
                let _ = thread.join();
            }
        }
    }
}

/// A rank's thread: open, say so, then answer calls until the ranks are
/// dropped. A panic in the rank's backend is answered as an error naming
/// it, not left for the others to time out on.
fn serve_rank(
    rank: usize,
    opener: &dyn RankOpener,
    incoming: Receiver<Call>,
    reply_to: Sender<Answered>,
) {
    let run = std::panic::AssertUnwindSafe(|| {
        opener.with_rank(rank, &mut |backend| {
            let opened = Reply::Opened {
                name: backend.name().to_string(),
                max_context: backend.max_context(),
            };
            let opened = Answered {
                rank,
                reply: Ok(opened),
                len: 0,
                ended: false,
            };
            if reply_to.send(opened).is_err() {
                return;
            }
            while let Ok(call) = incoming.recv() {
                let reply = answer(backend, call);
                let answered = Answered {
                    rank,
                    reply,
                    len: backend.sequence_len(),
                    ended: false,
                };
                if reply_to.send(answered).is_err() {
                    return;
                }
            }
        })
    });
    let error = match std::panic::catch_unwind(run) {
        Ok(Ok(())) => return,
        Ok(Err(e)) => e,
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            Error::Backend(format!("rank {rank} panicked: {what}"))
        }
    };
    let _ = reply_to.send(Answered {
        rank,
        reply: Err(error),
        len: 0,
        ended: true,
    });
}

fn answer(backend: &mut dyn Backend, call: Call) -> Result<Reply> {
    Ok(match call {
        Call::Prefill(tokens) => Reply::Logits(backend.prefill(&tokens)?),
        Call::PrefillEmbeddings(rows) => Reply::Logits(backend.prefill_embeddings(&rows)?),
        Call::Decode(token) => Reply::Logits(backend.decode(token)?),
        Call::DecodeGreedy(token) => Reply::Tokens(vec![backend.decode_greedy(token)?]),
        Call::Append(tokens) => Reply::Logits(backend.append(&tokens)?),
        Call::AppendGreedy(tokens) => Reply::Tokens(backend.append_greedy(&tokens)?),
        Call::Rewind(len) => {
            backend.rewind(len)?;
            Reply::Done
        }
    })
}

impl Backend for Ranks {
    fn name(&self) -> &str {
        &self.name
    }

    fn max_context(&self) -> usize {
        self.max_context
    }

    fn prefill(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        self.logits(Call::Prefill(tokens.to_vec()))
    }

    fn prefill_embeddings(&mut self, embeddings: &[f32]) -> Result<Vec<f32>> {
        self.logits(Call::PrefillEmbeddings(embeddings.to_vec()))
    }

    /// A prefill runs to its end on every rank (they cannot stop at
    /// different rows): `keep_going` is asked once, before it starts.
    fn prefill_until(
        &mut self,
        tokens: &[u32],
        keep_going: &mut dyn FnMut() -> bool,
    ) -> Result<Vec<f32>> {
        if !keep_going() {
            return Err(Error::Interrupted);
        }
        self.prefill(tokens)
    }

    fn decode(&mut self, token: u32) -> Result<Vec<f32>> {
        self.logits(Call::Decode(token))
    }

    fn decode_greedy(&mut self, token: u32) -> Result<u32> {
        Ok(self.tokens(Call::DecodeGreedy(token))?[0])
    }

    fn sequence_len(&self) -> usize {
        self.len
    }

    fn append(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        self.logits(Call::Append(tokens.to_vec()))
    }

    fn append_greedy(&mut self, tokens: &[u32]) -> Result<Vec<u32>> {
        self.tokens(Call::AppendGreedy(tokens.to_vec()))
    }

    fn rewind(&mut self, len: usize) -> Result<()> {
        self.all(Call::Rewind(len)).map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Model;
    use crate::sampling::SamplingParams;
    use crate::{CpuBackend, generate};

    /// Every rank serves the whole embedded model on the CPU reference:
    /// the same answers as one backend alone, whatever the rank count.
    struct Whole;

    impl RankOpener for Whole {
        fn with_rank(&self, _: usize, serve: &mut dyn FnMut(&mut dyn Backend)) -> Result<()> {
            let model = Model::embedded();
            serve(&mut CpuBackend::new(&model));
            Ok(())
        }
    }

    /// Each rank fails as its entry says (`None`, or no entry: it serves
    /// the whole model).
    struct Failing(Vec<Option<How>>);

    impl Failing {
        /// Rank `bad` fails as `how` says; the others serve.
        fn rank(bad: usize, how: How) -> Failing {
            let mut hows = vec![None; bad + 1];
            hows[bad] = Some(how);
            Failing(hows)
        }
    }

    #[derive(Clone, Copy)]
    enum How {
        AtOpening,
        /// Its thread panics before it opens.
        PanicAtOpening,
        /// Its decode steps return an error.
        Erring,
        /// Its decode steps never return.
        Stuck,
    }

    /// The whole model, whose decode steps fail as `how` says.
    struct Broken<'m> {
        inner: CpuBackend<'m>,
        how: How,
    }

    impl Backend for Broken<'_> {
        fn name(&self) -> &str {
            "broken"
        }
        fn max_context(&self) -> usize {
            self.inner.max_context()
        }
        fn prefill(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
            self.inner.prefill(tokens)
        }
        fn prefill_embeddings(&mut self, rows: &[f32]) -> Result<Vec<f32>> {
            self.inner.prefill_embeddings(rows)
        }
        fn prefill_until(&mut self, t: &[u32], k: &mut dyn FnMut() -> bool) -> Result<Vec<f32>> {
            self.inner.prefill_until(t, k)
        }
        fn decode(&mut self, token: u32) -> Result<Vec<f32>> {
            match self.how {
                How::Stuck => loop {
                    std::thread::park();
                },
                _ => Err(Error::Backend(format!("step of {token} failed"))),
            }
        }
        fn sequence_len(&self) -> usize {
            self.inner.sequence_len()
        }
    }

    impl RankOpener for Failing {
        fn with_rank(&self, rank: usize, serve: &mut dyn FnMut(&mut dyn Backend)) -> Result<()> {
            let model = Model::embedded();
            match self.0.get(rank).copied().flatten() {
                None => serve(&mut CpuBackend::new(&model)),
                Some(How::AtOpening) => return Err(Error::Backend("no such device".into())),
                Some(How::PanicAtOpening) => panic!("no device for rank {rank}"),
                Some(how) => serve(&mut Broken {
                    inner: CpuBackend::new(&model),
                    how,
                }),
            }
            Ok(())
        }
    }

    const TIMEOUT: Duration = Duration::from_secs(20);

    #[test]
    fn ranks_in_step_answer_as_one_backend() {
        let model = Model::embedded();
        let prompt = [3, 1, 4, 1, 5];
        let greedy = SamplingParams::default();
        let mut alone = CpuBackend::new(&model);
        let want = generate(&mut alone, &prompt, 12, greedy.clone(), &[], |_| Ok(())).unwrap();
        let want_len = alone.sequence_len();
        alone.rewind(3).unwrap();
        let want_appended = alone.append(&[9, 2]).unwrap();
        for count in [1, 2, 4] {
            let mut ranks = Ranks::start(count, Whole, TIMEOUT, TIMEOUT).unwrap();
            assert_eq!(ranks.name(), format!("cpu ×{count}"));
            let got = generate(&mut ranks, &prompt, 12, greedy.clone(), &[], |_| Ok(())).unwrap();
            assert_eq!(got, want, "{count} ranks");
            assert_eq!(ranks.sequence_len(), want_len);
            ranks.rewind(3).unwrap();
            assert_eq!(ranks.append(&[9, 2]).unwrap(), want_appended);
        }
    }

    #[test]
    fn a_rank_that_cannot_open_is_named() {
        let bad = Failing::rank(1, How::AtOpening);
        let error = Ranks::start(3, bad, TIMEOUT, TIMEOUT)
            .err()
            .unwrap()
            .to_string();
        assert!(
            error.contains("rank 1") && error.contains("no such device"),
            "{error}"
        );
    }

    #[test]
    fn a_failing_rank_is_named_and_the_ranks_stop() {
        let mut ranks = Ranks::start(3, Failing::rank(2, How::Erring), TIMEOUT, TIMEOUT).unwrap();
        ranks.prefill(&[1, 2]).unwrap();
        let error = ranks.decode(7).unwrap_err().to_string();
        assert!(
            error.contains("rank 2") && error.contains("step of 7 failed"),
            "{error}"
        );
        let later = ranks.prefill(&[1]).unwrap_err().to_string();
        assert!(later.contains("earlier failure"), "{later}");
    }

    #[test]
    fn a_rank_that_does_not_answer_is_named_within_the_timeout() {
        let mut ranks = Ranks::start(
            2,
            Failing::rank(1, How::Stuck),
            TIMEOUT,
            Duration::from_millis(300),
        )
        .unwrap();
        ranks.prefill(&[1, 2]).unwrap();
        let started = Instant::now();
        let error = ranks.decode(7).unwrap_err().to_string();
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(
            error.contains("rank 1 did not answer a decode step"),
            "{error}"
        );
        // Dropping would wait out the stuck thread's bound.
        std::mem::forget(ranks);
    }

    /// Rank 1's step fails while rank 0's never returns (as a rank waits
    /// in a collective its partner left): the error is rank 1's own, within
    /// [`ALIKE_WITHIN`], not a timeout of the whole call.
    #[test]
    fn a_rank_that_fails_alone_is_named_while_the_others_wait() {
        let split = Failing(vec![Some(How::Stuck), Some(How::Erring)]);
        let mut ranks = Ranks::start(2, split, TIMEOUT, Duration::from_secs(120)).unwrap();
        ranks.prefill(&[1, 2]).unwrap();
        let started = Instant::now();
        let error = ranks.decode(7).unwrap_err().to_string();
        assert!(started.elapsed() < ALIKE_WITHIN + Duration::from_secs(5));
        assert!(
            error.contains("rank 1, a decode step: step of 7 failed")
                && error.contains("rank 0 did not answer"),
            "{error}"
        );
        std::mem::forget(ranks);
    }

    #[test]
    fn a_call_every_rank_refuses_alike_keeps_its_error_and_the_ranks_go_on() {
        let mut ranks = Ranks::start(2, Whole, TIMEOUT, TIMEOUT).unwrap();
        let error = ranks.decode(7).unwrap_err();
        assert!(matches!(error, Error::Invalid(_)), "{error}");
        let error = ranks.prefill(&[1, 100_000]).unwrap_err();
        assert!(matches!(error, Error::Invalid(_)), "{error}");
        ranks.prefill(&[1, 2]).unwrap();
        assert_eq!(ranks.sequence_len(), 2);
        ranks.decode(3).unwrap();
        assert_eq!(ranks.sequence_len(), 3);
    }

    #[test]
    fn a_rank_that_panics_is_named_at_once() {
        let started = Instant::now();
        let error = Ranks::start(2, Failing::rank(1, How::PanicAtOpening), TIMEOUT, TIMEOUT)
            .err()
            .unwrap()
            .to_string();
        assert!(started.elapsed() < Duration::from_secs(10));
        assert!(
            error.contains("rank 1 panicked") && error.contains("no device for rank 1"),
            "{error}"
        );
    }
}
