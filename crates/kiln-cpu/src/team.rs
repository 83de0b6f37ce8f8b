//! A team of threads for the products of a forward pass, which degrades
//! gracefully when the machine is busy.
//!
//! A decode step of a small model is a few hundred products of 10-150 µs
//! each. Handing one to a sleeping thread (rayon's, whose workers sleep
//! after a few µs idle) costs a wake-up — tens of µs on a VM — so sharing
//! them made a step slower, not faster. Here the workers spin for
//! [`SPIN`] after each job before they sleep: within a step the next
//! product finds them awake, and an idle engine still sleeps. (micropool,
//! the crate made for this, needs a newer Rust than kiln's pinned one;
//! rayon has no spin setting.)
//!
//! A laptop or a shared server runs other programs too, and the scheduler
//! deschedules any thread at any moment. When a product was one equal
//! share per thread and the caller waited for every share, one descheduled
//! worker stalled the whole step: beside one busy loop on 2 cores, 2
//! threads decoded 18-26 tok/s and 1 thread 81. So:
//!
//! - [`Team::run`] splits a job into more chunks than threads, and each
//!   thread that is free, the caller included, takes the next one from a
//!   shared counter. A worker that has not woken finds no chunk left, and
//!   one descheduled mid-chunk delays that chunk only.
//! - The caller, out of chunks, waits only for chunks that were taken and
//!   are unfinished: it spins about one chunk's time, then sleeps, leaving
//!   its core to the worker it waits for.
//! - The workers run at the lowest priority (nice 19, on Linux): a core
//!   that another thread wants, the caller's included, goes to that
//!   thread, so the workers add what the busy machine has spare and the
//!   caller runs as it would alone. Without that, the scheduler would put
//!   a worker on the caller's core (the other one being busy), where its
//!   spinning or its chunks kept the caller waiting: 2 threads beside a
//!   busy loop decoded ~100-110 tok/s against 1 thread's ~125.
//!
//! The job borrows the caller's data, its lifetime erased for the workers.
//! A chunk is taken by a compare-and-swap of one word holding the job's
//! generation, its next chunk and its chunk count, and a worker reads the
//! job only after a successful take. `run` returns only once every chunk
//! is finished, so a taken chunk always belongs to a live job: a worker
//! that wakes late sees a finished job (no chunk left) or a newer
//! generation, never the job it missed.

use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins before it sleeps: longer than the gap
/// between two products of a step, or between two decode steps. At nice
/// 19 the spinning costs a thread that wants the core little.
pub const SPIN: Duration = Duration::from_millis(2);

/// The longest the caller, out of chunks, spins on the chunks still running
/// on workers before it sleeps; it spins twice its own mean chunk time when
/// that is shorter. A chunk not finished by then is likely on a descheduled
/// worker, which may need the caller's core.
pub const FINISH_SPIN: Duration = Duration::from_micros(50);

/// The most chunks a job may have: the chunk counts share a 64-bit word
/// with the job's generation.
pub const MAX_CHUNKS: usize = u16::MAX as usize;

/// A job: called with a chunk's index and the index of the thread that
/// runs it (0 the caller's).
pub type Job<'a> = &'a (dyn Fn(usize, usize) + Sync);

/// The word threads take chunks from: the generation (32 bits, bumped once
/// per job), the next chunk (16) and the job's chunk count (16). One
/// compare-and-swap checks all three, so a take succeeds only on the live
/// job's state.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Word(u64);

impl Word {
    fn new(generation: u32, next: usize, chunks: usize) -> Word {
        debug_assert!(next <= chunks && chunks <= MAX_CHUNKS);
        Word((u64::from(generation) << 32) | ((next as u64) << 16) | chunks as u64)
    }

    fn generation(self) -> u32 {
        (self.0 >> 32) as u32
    }

    fn next(self) -> usize {
        ((self.0 >> 16) & 0xffff) as usize
    }

    fn chunks(self) -> usize {
        (self.0 & 0xffff) as usize
    }
}

/// A cache line of its own: every take writes [`Claim`]'s, every worker
/// that ran chunks [`Report`]'s, and neither should also move the other.
#[repr(align(64))]
struct Line<T>(T);

/// What a thread reads to take a chunk and run it.
struct Claim {
    /// The current job's [`Word`].
    word: AtomicU64,
    /// The caller's [`Job`] (a `*const Job<'_>` on `run`'s stack), set
    /// before its generation is published; read only by a thread holding a
    /// chunk of it.
    job: AtomicPtr<()>,
}

/// What the workers report once they find no chunk left.
struct Report {
    /// Chunks of the current job finished on workers (and, after the
    /// caller's panic, dropped untaken).
    done: AtomicUsize,
    /// Whether the caller sleeps, or is about to, on `Shared::finished`.
    caller_asleep: AtomicBool,
}

struct Shared {
    claim: Line<Claim>,
    report: Line<Report>,
    /// Whether a chunk of the current job panicked on a worker.
    panicked: AtomicBool,
    stop: AtomicBool,
    /// Workers asleep, or about to be, on `wake`.
    sleepers: AtomicUsize,
    sleep: Mutex<()>,
    wake: Condvar,
    finish: Mutex<()>,
    finished: Condvar,
    spin: Duration,
}

/// `threads − 1` workers and the caller.
pub struct Team {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Held through a run: two callers at once take turns.
    caller: Mutex<()>,
}

impl Team {
    /// A team of `threads` (the caller and `threads − 1` workers).
    pub fn new(threads: usize) -> std::io::Result<Team> {
        Team::with_spin(threads, SPIN)
    }

    /// As [`Team::new`], with workers that spin `spin` before they sleep.
    pub fn with_spin(threads: usize, spin: Duration) -> std::io::Result<Team> {
        let shared = Arc::new(Shared {
            claim: Line(Claim {
                word: AtomicU64::new(Word::new(0, 0, 0).0),
                job: AtomicPtr::new(std::ptr::null_mut()),
            }),
            report: Line(Report {
                done: AtomicUsize::new(0),
                caller_asleep: AtomicBool::new(false),
            }),
            panicked: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            sleep: Mutex::new(()),
            wake: Condvar::new(),
            finish: Mutex::new(()),
            finished: Condvar::new(),
            spin,
        });
        let mut team = Team {
            shared,
            workers: Vec::new(),
            caller: Mutex::new(()),
        };
        for index in 1..threads.max(1) {
            let shared = Arc::clone(&team.shared);
            // On an error, `team`'s drop stops the workers already started.
            team.workers.push(
                std::thread::Builder::new()
                    .name(format!("kiln-cpu-q4-{index}"))
                    .spawn(move || {
                        lowest_priority();
                        work(&shared, index);
                    })?,
            );
        }
        Ok(team)
    }

    /// Threads in the team, the caller's included.
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Calls `job(chunk, thread)` once for every `chunk` in `0..chunks`,
    /// each on whichever thread of the team takes it first (`thread` 0 is
    /// this one, which takes chunks too), and returns when all have
    /// returned. A panic in any call is raised here once all have returned.
    /// A job must not call `run` on its own team: that deadlocks (another
    /// team's is fine).
    ///
    /// # Panics
    ///
    /// If `chunks` exceeds [`MAX_CHUNKS`].
    pub fn run(&self, chunks: usize, job: Job<'_>) {
        assert!(
            chunks <= MAX_CHUNKS,
            "{chunks} chunks, at most {MAX_CHUNKS}"
        );
        let shared = &*self.shared;
        if self.workers.is_empty() || chunks <= 1 {
            return (0..chunks).for_each(|c| job(c, 0));
        }
        // A poisoned lock only means an earlier run's job panicked.
        let _turn = self.caller.lock().unwrap_or_else(|e| e.into_inner());
        let claim = &shared.claim.0;
        shared.panicked.store(false, Ordering::SeqCst);
        shared.report.0.done.store(0, Ordering::SeqCst);
        // SAFETY (of the erasure): the workers read this pointer only
        // while holding a chunk of this job, and `Finish` below waits, even
        // when a chunk on this thread unwinds, until every chunk is
        // finished or dropped untaken: no worker reads `job` after `run`.
        claim
            .job
            .store((&raw const job).cast::<()>().cast_mut(), Ordering::SeqCst);
        let generation = Word(claim.word.load(Ordering::SeqCst))
            .generation()
            .wrapping_add(1);
        // Publishes the job: from here the workers may take its chunks.
        claim
            .word
            .store(Word::new(generation, 0, chunks).0, Ordering::SeqCst);
        let mut finish = Finish {
            shared,
            generation,
            own: 0,
            holding: false,
            spin: FINISH_SPIN,
        };
        if shared.sleepers.load(Ordering::SeqCst) > 0 {
            let _held = shared.sleep.lock().expect("kiln-cpu team lock");
            shared.wake.notify_all();
        }
        let started = Instant::now();
        while let Some(chunk) = take(shared, generation) {
            finish.holding = true;
            job(chunk, 0);
            finish.holding = false;
            finish.own += 1;
        }
        // The workers' chunks were all taken before this thread found none
        // left, so should end within about one chunk's time of it.
        if let Ok(own @ 1..) = u32::try_from(finish.own) {
            finish.spin = finish.spin.min(started.elapsed() * 2 / own);
        }
        drop(finish);
        if shared.panicked.load(Ordering::SeqCst) {
            panic!("a kiln-cpu worker thread panicked");
        }
    }

    /// Calls `job(chunk, part)` for the parts of `data`, `chunk_len`
    /// elements each (the last maybe fewer), as [`Team::run`] calls its job.
    ///
    /// # Panics
    ///
    /// If `chunk_len` is 0, or `data` has more than [`MAX_CHUNKS`] parts.
    pub fn for_each_chunk_mut<T: Send>(
        &self,
        data: &mut [T],
        chunk_len: usize,
        job: &(dyn Fn(usize, &mut [T]) + Sync),
    ) {
        assert!(chunk_len > 0, "chunks of 0 elements");
        let (len, start) = (data.len(), Parts(data.as_mut_ptr()));
        self.run(len.div_ceil(chunk_len), &|c, _| {
            let first = c * chunk_len;
            // SAFETY: `run` calls each chunk index once, so the parts made
            // here are disjoint; each lies within `data`, which stays
            // mutably borrowed until `run` has returned from every call.
            let part = unsafe {
                std::slice::from_raw_parts_mut(start.at(first), chunk_len.min(len - first))
            };
            job(c, part);
        });
    }
}

/// The start of [`Team::for_each_chunk_mut`]'s data, shared by its calls.
struct Parts<T>(*mut T);

// SAFETY: each call makes a slice of its own part from it, which may be
// sent to the thread of that call (`T: Send`).
unsafe impl<T: Send> Sync for Parts<T> {}

impl<T> Parts<T> {
    /// The element at `index`. (A method: a closure then captures the
    /// `Sync` wrapper, not its bare pointer.)
    fn at(&self, index: usize) -> *mut T {
        self.0.wrapping_add(index)
    }
}

/// Takes the next chunk of the job of `generation`, if it is still the
/// current one and has a chunk left.
fn take(shared: &Shared, generation: u32) -> Option<usize> {
    let word_at = &shared.claim.0.word;
    let mut word = Word(word_at.load(Ordering::SeqCst));
    loop {
        if word.generation() != generation || word.next() >= word.chunks() {
            return None;
        }
        let taken = Word::new(generation, word.next() + 1, word.chunks());
        match word_at.compare_exchange_weak(word.0, taken.0, Ordering::SeqCst, Ordering::SeqCst) {
            Ok(_) => return Some(word.next()),
            Err(now) => word = Word(now),
        }
    }
}

/// Waits, when dropped, until every chunk of the caller's job is finished:
/// the chunks nobody took are dropped (left only when the caller unwound
/// from its chunk), then those on workers waited for, spinning, then
/// sleeping.
struct Finish<'a> {
    shared: &'a Shared,
    generation: u32,
    /// Chunks the caller finished.
    own: usize,
    /// Whether the caller is in a chunk: dropped then, it unwound from it.
    holding: bool,
    /// How long to spin on the workers' chunks before sleeping.
    spin: Duration,
}

impl Drop for Finish<'_> {
    fn drop(&mut self) {
        let shared = self.shared;
        let (claim, report) = (&shared.claim.0, &shared.report.0);
        // No chunk can be taken after this.
        let mut word = Word(claim.word.load(Ordering::SeqCst));
        while word.next() < word.chunks() {
            let closed = Word::new(self.generation, word.chunks(), word.chunks());
            match claim.word.compare_exchange_weak(
                word.0,
                closed.0,
                Ordering::SeqCst,
                Ordering::SeqCst,
            ) {
                Ok(_) => {
                    let untaken = word.chunks() - word.next();
                    report.done.fetch_add(untaken, Ordering::SeqCst);
                    break;
                }
                Err(now) => word = Word(now),
            }
        }
        // All but the caller's own: those the workers ran, and those
        // dropped just above.
        let theirs = word.chunks() - self.own - usize::from(self.holding);
        let started = Instant::now();
        let mut spins = 0u32;
        while report.done.load(Ordering::SeqCst) < theirs {
            spins = spins.wrapping_add(1);
            // The clock is read now and then: it costs more than a spin.
            if !spins.is_multiple_of(64) || started.elapsed() < self.spin {
                std::hint::spin_loop();
                continue;
            }
            let mut held = shared.finish.lock().expect("kiln-cpu team lock");
            report.caller_asleep.store(true, Ordering::SeqCst);
            // A worker adds to `done`, then reads `caller_asleep`: one of
            // the two sees the other's write, so no wake-up is lost.
            while report.done.load(Ordering::SeqCst) < theirs {
                held = shared.finished.wait(held).expect("kiln-cpu team lock");
            }
            report.caller_asleep.store(false, Ordering::SeqCst);
        }
        claim.job.store(std::ptr::null_mut(), Ordering::SeqCst);
    }
}

/// Makes this thread (a worker) the last to get a core that something
/// else wants: nice 19, the lowest priority a thread may set itself. On
/// Linux the nice value is the thread's own; elsewhere, and where the call
/// fails, the worker keeps its priority.
fn lowest_priority() {
    #[cfg(target_os = "linux")]
    // SAFETY: plain system calls on this thread, no memory passed.
    unsafe {
        let thread = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, thread, 19);
    }
}

/// A worker's loop: wait for a new generation, take its chunks while there
/// are any, report them.
fn work(shared: &Shared, index: usize) {
    let report = &shared.report.0;
    let mut seen = 0u32;
    loop {
        seen = wait_for_job(shared, seen);
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        let mut ran = 0;
        while let Some(chunk) = take(shared, seen) {
            // SAFETY: this worker holds a chunk of the live job, so `run`
            // has not returned (it waits for this chunk's report below),
            // and the pointer is that job's: it was stored before the
            // job's generation was published, which the take read.
            let called = panic::catch_unwind(AssertUnwindSafe(|| unsafe {
                let job = *shared.claim.0.job.load(Ordering::SeqCst).cast::<Job<'_>>();
                job(chunk, index);
            }));
            if let Err(payload) = called {
                shared.panicked.store(true, Ordering::SeqCst);
                // A payload whose drop panics must not end this thread: the
                // next run would wait for it forever.
                let _ = panic::catch_unwind(AssertUnwindSafe(|| drop(payload)));
            }
            ran += 1;
        }
        if ran > 0 {
            // Once the caller sees these the job may end: nothing of it is
            // read after the add.
            report.done.fetch_add(ran, Ordering::SeqCst);
            if report.caller_asleep.load(Ordering::SeqCst) {
                let _held = shared.finish.lock().expect("kiln-cpu team lock");
                shared.finished.notify_all();
            }
        }
    }
}

/// Spins, then sleeps, until the generation differs from `seen` or the
/// team stops; returns the generation seen.
fn wait_for_job(shared: &Shared, seen: u32) -> u32 {
    let generation = || Word(shared.claim.0.word.load(Ordering::SeqCst)).generation();
    let started = Instant::now();
    let mut spins = 0u32;
    loop {
        let now = generation();
        if now != seen || shared.stop.load(Ordering::Relaxed) {
            return now;
        }
        spins = spins.wrapping_add(1);
        // The clock is read now and then: it costs more than a spin.
        if !spins.is_multiple_of(256) || started.elapsed() < shared.spin {
            std::hint::spin_loop();
            continue;
        }
        let mut held = shared.sleep.lock().expect("kiln-cpu team lock");
        shared.sleepers.fetch_add(1, Ordering::SeqCst);
        // `run` publishes the generation, then reads `sleepers`: one of the
        // two sees the other's write, so no wake-up is lost.
        while generation() == seen && !shared.stop.load(Ordering::SeqCst) {
            held = shared.wake.wait(held).expect("kiln-cpu team lock");
        }
        shared.sleepers.fetch_sub(1, Ordering::SeqCst);
        drop(held);
        return generation();
    }
}

impl Drop for Team {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        {
            let _held = self.shared.sleep.lock().expect("kiln-cpu team lock");
            self.shared.wake.notify_all();
        }
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// How often each chunk of a `chunks`-chunk run is called, and which
    /// threads called them.
    fn run_counting(team: &Team, chunks: usize) -> (Vec<usize>, Vec<usize>) {
        let calls: Vec<AtomicUsize> = (0..chunks).map(|_| AtomicUsize::new(0)).collect();
        let by_thread: Vec<AtomicUsize> =
            (0..team.threads()).map(|_| AtomicUsize::new(0)).collect();
        team.run(chunks, &|c, t| {
            calls[c].fetch_add(1, Ordering::SeqCst);
            by_thread[t].fetch_add(1, Ordering::SeqCst);
        });
        let load = |v: &[AtomicUsize]| v.iter().map(|c| c.load(Ordering::SeqCst)).collect();
        (load(&calls), load(&by_thread))
    }

    /// Each chunk is called once per run, over many runs, workers awake or
    /// asleep.
    #[test]
    fn every_chunk_runs_once_per_job() {
        for spin in [Duration::ZERO, Duration::from_millis(1)] {
            for threads in [1, 2, 3, 5] {
                let team = Team::with_spin(threads, spin).unwrap();
                assert_eq!(team.threads(), threads);
                for round in 0..200 {
                    let chunks = [0, 1, threads, 8 * threads, 37][round % 5];
                    let (calls, by_thread) = run_counting(&team, chunks);
                    assert_eq!(calls, vec![1; chunks], "round {round}, spin {spin:?}");
                    assert_eq!(by_thread.iter().sum::<usize>(), chunks);
                    if round % 50 == 0 {
                        // Long enough for the workers to fall asleep.
                        std::thread::sleep(spin * 2 + Duration::from_millis(1));
                    }
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Any team size, any chunk counts in a row (a late worker must
        /// take no chunk of a finished job, nor miss one of the next), any
        /// spin: every chunk once, on a thread of the team.
        #[test]
        fn every_chunk_is_taken_exactly_once(
            threads in 1usize..7,
            spin_us in prop_oneof![Just(0u64), Just(20), Just(2_000)],
            runs in proptest::collection::vec(0usize..300, 1..40),
        ) {
            let team = Team::with_spin(threads, Duration::from_micros(spin_us)).unwrap();
            for chunks in runs {
                let (calls, by_thread) = run_counting(&team, chunks);
                prop_assert_eq!(calls, vec![1; chunks]);
                prop_assert_eq!(by_thread.len(), threads);
                prop_assert_eq!(by_thread.iter().sum::<usize>(), chunks);
            }
        }

        /// The parts of `for_each_chunk_mut` are the data's, in order, each
        /// handed out once.
        #[test]
        fn every_part_is_handed_out_once(
            threads in 1usize..5,
            len in 0usize..500,
            chunk_len in 1usize..40,
        ) {
            let team = Team::new(threads).unwrap();
            let mut data: Vec<(usize, usize)> = (0..len).map(|i| (i, 0)).collect();
            team.for_each_chunk_mut(&mut data, chunk_len, &|c, part| {
                assert!(!part.is_empty() && part.len() <= chunk_len);
                for (k, (index, calls)) in part.iter_mut().enumerate() {
                    assert_eq!(*index, c * chunk_len + k);
                    *calls += 1;
                }
            });
            prop_assert!(data.iter().all(|&(_, calls)| calls == 1));
        }
    }

    /// A run returns only after every chunk's call has: their writes are
    /// all there.
    #[test]
    fn a_run_returns_after_every_call() {
        let team = Team::new(4).unwrap();
        let out: Vec<Mutex<u64>> = (0..8).map(|_| Mutex::new(0)).collect();
        team.run(8, &|c, _| {
            std::thread::sleep(Duration::from_millis(2 * c as u64));
            *out[c].lock().unwrap() = c as u64 + 1;
        });
        let got: Vec<u64> = out.iter().map(|v| *v.lock().unwrap()).collect();
        assert_eq!(got, [1, 2, 3, 4, 5, 6, 7, 8]);
    }

    /// Waits (up to a generous limit, so that a broken team fails rather
    /// than hangs) until `flag` is set.
    fn wait_for(flag: &AtomicBool) {
        let started = Instant::now();
        while !flag.load(Ordering::SeqCst) && started.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_micros(100));
        }
        assert!(
            flag.load(Ordering::SeqCst),
            "no worker took a chunk in 10 s"
        );
    }

    /// A worker held up in its chunk (as one descheduled is) holds up that
    /// chunk only: the caller takes the others, and the run still waits
    /// for the held one before it returns.
    #[test]
    fn a_blocked_worker_delays_only_its_chunk() {
        for threads in [2, 3] {
            let team = Team::new(threads).unwrap();
            let chunks = 32;
            let blocked = AtomicBool::new(false);
            let calls: Vec<AtomicUsize> = (0..chunks).map(|_| AtomicUsize::new(0)).collect();
            let by_thread: Vec<AtomicUsize> = (0..threads).map(|_| AtomicUsize::new(0)).collect();
            let started = Instant::now();
            team.run(chunks, &|c, t| {
                if t == 1 && !blocked.swap(true, Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(200));
                } else if t != 1 {
                    // Worker 1 must be inside its chunk for the test to
                    // mean anything: the others leave it one.
                    wait_for(&blocked);
                    // Worker 2 shares the rest, it does not take it all.
                    std::thread::sleep(Duration::from_micros(500));
                }
                calls[c].fetch_add(1, Ordering::SeqCst);
                by_thread[t].fetch_add(1, Ordering::SeqCst);
            });
            let calls: Vec<usize> = calls.iter().map(|c| c.load(Ordering::SeqCst)).collect();
            assert_eq!(calls, vec![1; chunks]);
            let (caller, worker) = (
                by_thread[0].load(Ordering::SeqCst),
                by_thread[1].load(Ordering::SeqCst),
            );
            assert!(
                caller > worker,
                "the caller ran {caller} chunks, worker 1 {worker}"
            );
            assert!(started.elapsed() >= Duration::from_millis(200));
        }
    }

    /// A worker's panic reaches the caller, and the team still works.
    #[test]
    fn a_workers_panic_reaches_the_caller() {
        let team = Team::new(3).unwrap();
        let failed = AtomicBool::new(false);
        let caught = panic::catch_unwind(AssertUnwindSafe(|| {
            team.run(8, &|_, t| {
                if t == 0 {
                    wait_for(&failed);
                } else if !failed.swap(true, Ordering::SeqCst) {
                    panic!("worker {t} fails");
                }
            });
        }));
        let message = caught.unwrap_err();
        assert_eq!(
            message.downcast_ref::<&str>(),
            Some(&"a kiln-cpu worker thread panicked")
        );
        let (calls, _) = run_counting(&team, 24);
        assert_eq!(calls, vec![1; 24]);
    }

    /// The caller's panic leaves `run` only once the chunks running on
    /// workers have finished (they borrow the caller's data), and the team
    /// still works.
    #[test]
    fn the_callers_panic_waits_for_the_workers() {
        let team = Team::new(2).unwrap();
        let (started, finished) = (AtomicBool::new(false), AtomicBool::new(false));
        let caught = panic::catch_unwind(AssertUnwindSafe(|| {
            team.run(64, &|_, t| {
                if t == 0 {
                    wait_for(&started);
                    panic!("the caller fails");
                }
                if !started.swap(true, Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(50));
                    finished.store(true, Ordering::SeqCst);
                }
            });
        }));
        assert!(caught.is_err());
        assert!(
            finished.load(Ordering::SeqCst),
            "run unwound before its worker finished"
        );
        let (calls, _) = run_counting(&team, 24);
        assert_eq!(calls, vec![1; 24]);
    }
}
