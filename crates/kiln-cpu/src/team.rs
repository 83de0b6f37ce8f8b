//! A team of threads kept awake between the products of a forward pass.
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
//! [`Team::run`] calls a job once per thread, the caller's thread being
//! index 0, and returns when every call has returned.

use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins before it sleeps: longer than the gap
/// between two products of a step, or between two decode steps.
pub const SPIN: Duration = Duration::from_millis(2);

/// A job's address with its lifetime erased; see [`Team::run`] for why it
/// is never called after the job's borrow ends.
type Job = *const (dyn Fn(usize) + Sync);

struct Shared {
    /// Bumped once per job; a worker runs a job when it sees a new value.
    generation: AtomicU64,
    /// The current job, set before `generation` is bumped.
    job: Mutex<Option<SendJob>>,
    /// Workers that have not finished the current job.
    remaining: AtomicUsize,
    /// Whether a worker's call of the current job panicked.
    panicked: AtomicBool,
    stop: AtomicBool,
    /// Workers asleep, or about to be, on `wake`.
    sleepers: AtomicUsize,
    sleep: Mutex<()>,
    wake: Condvar,
    spin: Duration,
}

/// [`Job`] moved into the shared state.
#[derive(Clone, Copy)]
struct SendJob(Job);
// SAFETY: the job is `Sync`, so calling it from several threads at once is
// sound; the pointer is only dereferenced while the job is alive (`run`).
unsafe impl Send for SendJob {}

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
            generation: AtomicU64::new(0),
            job: Mutex::new(None),
            remaining: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            sleep: Mutex::new(()),
            wake: Condvar::new(),
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
                    .spawn(move || work(&shared, index))?,
            );
        }
        Ok(team)
    }

    /// Threads in the team, the caller's included.
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Calls `job(i)` for every `i` in `0..self.threads()` at once, `0` on
    /// this thread, and returns when all have returned. A panic in any call
    /// is raised here once all have returned. A job must not call `run` on
    /// its own team: that deadlocks (another team's is fine).
    pub fn run(&self, job: &(dyn Fn(usize) + Sync)) {
        let shared = &*self.shared;
        if self.workers.is_empty() {
            return job(0);
        }
        // A poisoned lock only means an earlier run's job panicked.
        let _turn = self.caller.lock().unwrap_or_else(|e| e.into_inner());
        shared.panicked.store(false, Ordering::SeqCst);
        // SAFETY (of the erasure): `Finish` below waits, even when `job(0)`
        // unwinds, until every worker has returned from its call and
        // cleared its hold, so no worker calls `job` after this borrow ends.
        let erased: Job = unsafe { std::mem::transmute::<_, Job>(job) };
        *shared.job.lock().expect("kiln-cpu team lock") = Some(SendJob(erased));
        shared.remaining.store(self.workers.len(), Ordering::SeqCst);
        shared.generation.fetch_add(1, Ordering::SeqCst);
        // From here the workers may be inside `job`: whatever unwinds, we
        // wait for them.
        let finish = Finish(shared);
        if shared.sleepers.load(Ordering::SeqCst) > 0 {
            let _held = shared.sleep.lock().expect("kiln-cpu team lock");
            shared.wake.notify_all();
        }
        job(0);
        drop(finish);
        if shared.panicked.load(Ordering::SeqCst) {
            panic!("a kiln-cpu worker thread panicked");
        }
    }
}

/// Waits, when dropped, until the workers have finished the current job.
struct Finish<'a>(&'a Shared);

impl Drop for Finish<'_> {
    fn drop(&mut self) {
        let started = Instant::now();
        while self.0.remaining.load(Ordering::Acquire) > 0 {
            if started.elapsed() < self.0.spin {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        *self.0.job.lock().expect("kiln-cpu team lock") = None;
    }
}

/// A worker's loop: wait for a new generation, call the job, report.
fn work(shared: &Shared, index: usize) {
    let mut seen = 0u64;
    loop {
        seen = wait_for_job(shared, seen);
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        let job = shared
            .job
            .lock()
            .expect("kiln-cpu team lock")
            .expect("a job is set before its generation");
        // SAFETY: `run` keeps the job alive until `remaining` reaches 0,
        // which this worker's decrement below is part of.
        let called = panic::catch_unwind(AssertUnwindSafe(|| unsafe { (*job.0)(index) }));
        if let Err(payload) = called {
            shared.panicked.store(true, Ordering::SeqCst);
            // A payload whose drop panics must not end this thread: the
            // next run would wait for it forever.
            let _ = panic::catch_unwind(AssertUnwindSafe(|| drop(payload)));
        }
        shared.remaining.fetch_sub(1, Ordering::Release);
    }
}

/// Spins, then sleeps, until the generation differs from `seen` or the
/// team stops; returns the generation seen.
fn wait_for_job(shared: &Shared, seen: u64) -> u64 {
    let started = Instant::now();
    let mut spins = 0u32;
    loop {
        let now = shared.generation.load(Ordering::Acquire);
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
        // `run` bumps the generation, then reads `sleepers`: one of the two
        // sees the other's write, so no wake-up is lost.
        while shared.generation.load(Ordering::SeqCst) == seen
            && !shared.stop.load(Ordering::SeqCst)
        {
            held = shared.wake.wait(held).expect("kiln-cpu team lock");
        }
        shared.sleepers.fetch_sub(1, Ordering::SeqCst);
        drop(held);
        return shared.generation.load(Ordering::Acquire);
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

    /// Each index is called once per run, over many runs, awake or asleep.
    #[test]
    fn every_thread_index_runs_once_per_job() {
        for spin in [Duration::ZERO, Duration::from_millis(1)] {
            for threads in [1, 2, 3, 5] {
                let team = Team::with_spin(threads, spin).unwrap();
                assert_eq!(team.threads(), threads);
                for round in 0..200 {
                    let calls: Vec<AtomicUsize> =
                        (0..threads).map(|_| AtomicUsize::new(0)).collect();
                    team.run(&|i| {
                        calls[i].fetch_add(1, Ordering::SeqCst);
                    });
                    let counts: Vec<usize> =
                        calls.iter().map(|c| c.load(Ordering::SeqCst)).collect();
                    assert_eq!(counts, vec![1; threads], "round {round}, spin {spin:?}");
                    if round % 50 == 0 {
                        // Long enough for the workers to fall asleep.
                        std::thread::sleep(spin * 2 + Duration::from_millis(1));
                    }
                }
            }
        }
    }

    /// A run returns only after the workers' calls have: their writes are
    /// all there.
    #[test]
    fn a_run_returns_after_every_call() {
        let team = Team::new(4).unwrap();
        let out: Vec<Mutex<u64>> = (0..4).map(|_| Mutex::new(0)).collect();
        team.run(&|i| {
            std::thread::sleep(Duration::from_millis(5 * i as u64));
            *out[i].lock().unwrap() = i as u64 + 1;
        });
        let got: Vec<u64> = out.iter().map(|v| *v.lock().unwrap()).collect();
        assert_eq!(got, [1, 2, 3, 4]);
    }

    /// A worker's panic reaches the caller, and the team still works.
    #[test]
    fn a_workers_panic_reaches_the_caller() {
        let team = Team::new(3).unwrap();
        let caught = panic::catch_unwind(AssertUnwindSafe(|| {
            team.run(&|i| assert_ne!(i, 2, "worker 2 fails"));
        }));
        assert!(caught.is_err());
        let ran = AtomicUsize::new(0);
        team.run(&|_| {
            ran.fetch_add(1, Ordering::SeqCst);
        });
        assert_eq!(ran.load(Ordering::SeqCst), 3);
    }
}
