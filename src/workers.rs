//! Small bounded worker pools for the blocking calls the event loop must not make itself:
//! file tools, DNS lookups (getaddrinfo) and session-file syncs.
//!
//! A pool owns at most a fixed number of threads and a queue with a fixed cap. Threads start
//! only when work arrives (start-up time and idle memory are product metrics, and most
//! processes never run a file tool) and leave again after `IDLE_EXIT` without work. A job that
//! cannot be queued is handed back to the caller (`Rejected`) rather than left to hang: the
//! caller turns it into a tool error or a failed lookup, or runs it itself.
//!
//! Jobs report through whatever they capture (the engine's `Completion` channel and `Waker`);
//! the pool knows nothing about the loop. Dropping a pool never waits: its threads finish the
//! jobs already queued and exit. A caller that must know its jobs are done (the session syncer
//! at exit) waits with a deadline through `wait_idle`.

use std::collections::VecDeque;
use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// A worker with nothing to do for this long exits, so a process that ran a burst of work
/// returns to its idle footprint; a busy pool keeps its threads warm.
const IDLE_EXIT: Duration = Duration::from_secs(60);

/// One unit of work, run once on a pool thread.
pub(crate) type Job = Box<dyn FnOnce() + Send + 'static>;

/// A bounded pool of lazily started threads.
pub(crate) struct Pool {
    shared: Arc<Shared>,
}

struct Shared {
    /// Thread name, shown by `ps -L`, `top -H` and in panic messages.
    name: &'static str,
    max_threads: usize,
    /// Jobs waiting for a thread (not counting those running).
    queue_cap: usize,
    idle_exit: Duration,
    /// Threads run at a lower priority (`background`).
    background: bool,
    state: Mutex<State>,
    /// Signalled when a job is queued or the pool is dropped.
    work: Condvar,
    /// Signalled when the last queued or running job is done.
    idle: Condvar,
}

#[derive(Default)]
struct State {
    queue: VecDeque<Job>,
    /// Threads alive (running a job, or waiting for one).
    threads: usize,
    /// Threads waiting for a job.
    waiting: usize,
    /// Jobs being run right now.
    running: usize,
    /// The `Pool` was dropped: threads exit once the queue is empty.
    closed: bool,
}

/// Why a job was not queued.
#[derive(Debug)]
pub(crate) enum Reason {
    /// `queue_cap` jobs are already waiting.
    Full { cap: usize },
    /// The pool has no thread and could not start one.
    Spawn(std::io::Error),
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reason::Full { cap } => write!(f, "the worker queue is full ({cap} jobs waiting)"),
            Reason::Spawn(e) => write!(f, "cannot start a worker thread: {e}"),
        }
    }
}

/// A job the pool did not take, handed back so the caller can fail it or run it itself.
pub(crate) struct Rejected {
    pub(crate) reason: Reason,
    pub(crate) job: Job,
}

impl fmt::Debug for Rejected {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rejected")
            .field("reason", &self.reason)
            .finish_non_exhaustive()
    }
}

impl fmt::Display for Rejected {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.reason.fmt(f)
    }
}

impl fmt::Debug for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pool")
            .field("name", &self.shared.name)
            .field("max_threads", &self.shared.max_threads)
            .field("queue_cap", &self.shared.queue_cap)
            .finish_non_exhaustive()
    }
}

impl Pool {
    /// A pool of at most `max_threads` threads named `name` and at most `queue_cap` waiting
    /// jobs. Starts no thread; that waits for the first job.
    pub(crate) fn new(name: &'static str, max_threads: usize, queue_cap: usize) -> Pool {
        Pool::with_idle_exit(name, max_threads, queue_cap, IDLE_EXIT)
    }

    fn with_idle_exit(
        name: &'static str,
        max_threads: usize,
        queue_cap: usize,
        idle_exit: Duration,
    ) -> Pool {
        assert!(max_threads > 0, "a pool needs at least one thread");
        Pool {
            shared: Arc::new(Shared {
                name,
                max_threads,
                queue_cap,
                idle_exit,
                background: false,
                state: Mutex::new(State::default()),
                work: Condvar::new(),
                idle: Condvar::new(),
            }),
        }
    }

    /// A pool for housekeeping that may wait while anything else wants the CPU: its
    /// threads run at `sys::BACKGROUND_NICE`. They still run whenever a CPU has a moment.
    pub(crate) fn background(mut self) -> Pool {
        if let Some(shared) = Arc::get_mut(&mut self.shared) {
            shared.background = true;
        }
        self
    }

    /// How many jobs may wait.
    pub(crate) fn queue_cap(&self) -> usize {
        self.shared.queue_cap
    }

    /// Queues `job`, starting a thread for it if none is free and the pool is not at its
    /// thread cap. Fails, handing the job back, when the queue is full or when no thread
    /// exists and none can be started (with a thread alive, the job waits for it instead).
    pub(crate) fn submit<F>(&self, job: F) -> Result<(), Rejected>
    where
        F: FnOnce() + Send + 'static,
    {
        let job: Job = Box::new(job);
        let shared = &self.shared;
        let mut state = shared.lock();
        if state.queue.len() >= shared.queue_cap {
            let cap = shared.queue_cap;
            return Err(Rejected {
                reason: Reason::Full { cap },
                job,
            });
        }
        state.queue.push_back(job);
        if state.waiting > 0 {
            shared.work.notify_one();
        }
        // Every queued job either has a waiting thread to take it or gets a new one.
        if state.queue.len() > state.waiting && state.threads < shared.max_threads {
            let worker = Arc::clone(shared);
            let spawned = std::thread::Builder::new()
                .name(shared.name.to_owned())
                .spawn(move || worker.work());
            match spawned {
                Ok(_) => state.threads += 1,
                Err(e) if state.threads == 0 => {
                    // Nobody would ever run it: give it back rather than let it wait forever.
                    let job = state.queue.pop_back().expect("the job just queued");
                    return Err(Rejected {
                        reason: Reason::Spawn(e),
                        job,
                    });
                }
                // A running thread will get to it.
                Err(_) => {}
            }
        }
        Ok(())
    }

    /// Waits until no job is queued or running, or until `deadline`; returns whether the pool
    /// went idle.
    pub(crate) fn wait_idle(&self, deadline: Instant) -> bool {
        let shared = &self.shared;
        let mut state = shared.lock();
        while !state.queue.is_empty() || state.running > 0 {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            state = shared
                .idle
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        true
    }

    #[cfg(test)]
    fn threads(&self) -> usize {
        self.shared.lock().threads
    }
}

impl Drop for Pool {
    /// Never waits: threads run what is already queued, then exit on their own.
    fn drop(&mut self) {
        self.shared.lock().closed = true;
        self.shared.work.notify_all();
    }
}

impl Shared {
    /// Jobs run outside the lock and panics are caught, so the lock cannot be poisoned by a
    /// job; recovering from poison keeps a bug elsewhere from taking the pool down too.
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A thread's life: run queued jobs; exit once the pool is dropped and the queue is empty,
    /// or after `idle_exit` without work.
    fn work(&self) {
        if self.background {
            crate::sys::lower_thread_priority();
        }
        let mut state = self.lock();
        loop {
            if let Some(job) = state.queue.pop_front() {
                state.running += 1;
                drop(state);
                // A panicking job (a bug) must not take the thread, and with it the pool's
                // count of running jobs, down with it.
                let _ = catch_unwind(AssertUnwindSafe(job));
                state = self.lock();
                state.running -= 1;
                if state.running == 0 && state.queue.is_empty() {
                    self.idle.notify_all();
                }
                continue;
            }
            if state.closed {
                break;
            }
            state.waiting += 1;
            let (next, timeout) = self
                .work
                .wait_timeout(state, self.idle_exit)
                .unwrap_or_else(PoisonError::into_inner);
            state = next;
            state.waiting -= 1;
            if timeout.timed_out() && state.queue.is_empty() {
                break;
            }
        }
        state.threads -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::{Receiver, Sender, channel};

    const LONG: Duration = Duration::from_secs(10);

    /// The calling thread's niceness, field 19 of its `stat` (after the command in parens).
    fn nice() -> i64 {
        let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap();
        let after = stat.rsplit_once(") ").unwrap().1;
        after.split(' ').nth(16).unwrap().parse().unwrap()
    }

    #[test]
    fn background_threads_run_at_a_lower_priority() {
        let base = nice();
        for (pool, want) in [
            (Pool::new("test-normal", 1, 4), base),
            (
                Pool::new("test-background", 1, 4).background(),
                i64::from(crate::sys::BACKGROUND_NICE).max(base),
            ),
        ] {
            let (tx, rx) = channel();
            pool.submit(move || tx.send(nice()).unwrap()).unwrap();
            assert_eq!(rx.recv_timeout(LONG).unwrap(), want);
        }
        assert_eq!(nice(), base, "the caller's own priority is untouched");
    }

    /// A job that reports it started, then blocks until `release` is sent to (or dropped).
    fn blocker(started: &Sender<()>) -> (impl FnOnce() + Send + 'static, Sender<()>) {
        let (release, gate): (Sender<()>, Receiver<()>) = channel();
        let started = started.clone();
        let job = move || {
            let _ = started.send(());
            let _ = gate.recv();
        };
        (job, release)
    }

    #[test]
    fn no_thread_starts_until_the_first_job() {
        let pool = Pool::new("test-lazy", 4, 8);
        assert_eq!(pool.threads(), 0);
        let (tx, rx) = channel();
        pool.submit(move || tx.send(7).unwrap()).unwrap();
        assert_eq!(rx.recv_timeout(LONG), Ok(7));
        assert_eq!(pool.threads(), 1, "one job needs one thread");
    }

    #[test]
    fn jobs_run_on_at_most_the_capped_number_of_threads() {
        let pool = Pool::new("test-jobs", 3, 100);
        let (tx, rx) = channel();
        for i in 0..50 {
            let tx = tx.clone();
            pool.submit(move || tx.send(i).unwrap()).unwrap();
            assert!(pool.threads() <= 3);
        }
        let mut seen: Vec<i32> = (0..50).map(|_| rx.recv_timeout(LONG).unwrap()).collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..50).collect::<Vec<_>>());
        assert!(pool.wait_idle(Instant::now() + LONG));
        assert!(pool.threads() <= 3);
    }

    #[test]
    fn the_queue_cap_is_enforced_and_the_job_handed_back() {
        let pool = Pool::new("test-cap", 1, 2);
        let (started, started_rx) = channel();
        let (job, release) = blocker(&started);
        pool.submit(job).unwrap();
        started_rx.recv_timeout(LONG).unwrap();
        // The one thread is busy: two jobs may wait, the third is refused.
        let (tx, rx) = channel();
        for i in 0..2 {
            let tx = tx.clone();
            pool.submit(move || tx.send(i).unwrap()).unwrap();
        }
        let tx3 = tx.clone();
        let rejected = pool.submit(move || tx3.send(2).unwrap()).unwrap_err();
        assert!(matches!(rejected.reason, Reason::Full { cap: 2 }));
        assert_eq!(
            rejected.to_string(),
            "the worker queue is full (2 jobs waiting)"
        );
        // The caller may run the job itself.
        (rejected.job)();
        assert_eq!(rx.recv_timeout(LONG), Ok(2));
        drop(release);
        assert_eq!(rx.recv_timeout(LONG), Ok(0));
        assert_eq!(rx.recv_timeout(LONG), Ok(1));
        assert_eq!(pool.threads(), 1);
    }

    #[test]
    fn wait_idle_honours_its_deadline() {
        let pool = Pool::new("test-idle", 1, 4);
        assert!(pool.wait_idle(Instant::now()), "a fresh pool is idle");
        let (started, started_rx) = channel();
        let (job, release) = blocker(&started);
        pool.submit(job).unwrap();
        started_rx.recv_timeout(LONG).unwrap();
        let before = Instant::now();
        assert!(!pool.wait_idle(before + Duration::from_millis(50)));
        assert!(before.elapsed() < LONG);
        drop(release);
        assert!(pool.wait_idle(Instant::now() + LONG));
    }

    #[test]
    fn dropping_a_busy_pool_does_not_wait_and_queued_jobs_still_run() {
        let pool = Pool::new("test-drop", 1, 4);
        let shared = Arc::clone(&pool.shared);
        let (started, started_rx) = channel();
        let (job, release) = blocker(&started);
        pool.submit(job).unwrap();
        started_rx.recv_timeout(LONG).unwrap();
        let (tx, rx) = channel();
        pool.submit(move || tx.send("queued").unwrap()).unwrap();
        let before = Instant::now();
        drop(pool);
        assert!(before.elapsed() < Duration::from_secs(1), "drop waited");
        drop(release);
        assert_eq!(rx.recv_timeout(LONG), Ok("queued"));
        // The thread exits once the queue is empty, letting go of the shared state.
        let deadline = Instant::now() + LONG;
        while Arc::strong_count(&shared) > 1 {
            assert!(Instant::now() < deadline, "the worker thread did not exit");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(shared.lock().threads, 0);
    }

    #[test]
    fn an_idle_thread_exits_and_a_new_one_starts_for_later_work() {
        let pool = Pool::with_idle_exit("test-exit", 2, 4, Duration::from_millis(20));
        let (tx, rx) = channel();
        let tx1 = tx.clone();
        pool.submit(move || tx1.send(1).unwrap()).unwrap();
        assert_eq!(rx.recv_timeout(LONG), Ok(1));
        let deadline = Instant::now() + LONG;
        while pool.threads() > 0 {
            assert!(Instant::now() < deadline, "the idle thread did not exit");
            std::thread::sleep(Duration::from_millis(5));
        }
        pool.submit(move || tx.send(2).unwrap()).unwrap();
        assert_eq!(rx.recv_timeout(LONG), Ok(2));
    }

    #[test]
    fn a_panicking_job_leaves_the_pool_working() {
        let pool = Pool::new("test-panic", 1, 4);
        pool.submit(|| panic!("a job's bug")).unwrap();
        let (tx, rx) = channel();
        pool.submit(move || tx.send(()).unwrap()).unwrap();
        assert_eq!(rx.recv_timeout(LONG), Ok(()));
        assert!(pool.wait_idle(Instant::now() + LONG));
        assert_eq!(pool.threads(), 1);
    }
}
