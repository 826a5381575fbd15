//! The event loop: one `mio::Poll`, deadline timers, a `Waker` for worker threads and the
//! signal self-pipe. It turns kernel readiness, timer expiry and signals into `Wake` values
//! for the owner of the loop to dispatch; it knows nothing about protocols or runs.
//!
//! Tokens are handed out from a counter and never reused, so a stale event for a closed
//! source can never be mistaken for a new one (mio: "sporadic events happen").

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashSet};
use std::io::{self, Read};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mio::unix::pipe;
use mio::{Events, Interest, Poll, Registry, Token, Waker};

use crate::sys;

/// Fixed tokens; everything else comes from `Reactor::token`.
const WAKER: Token = Token(0);
const SIGNALS: Token = Token(1);
const FIRST_DYNAMIC: usize = 16;

/// How many readiness events one `poll` may return; more simply wait for the next round.
const EVENTS_CAPACITY: usize = 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TimerId(u64);

#[cfg(test)]
impl TimerId {
    /// A timer id no reactor issued, for the fake reactors of unit tests.
    pub fn fake(n: u64) -> TimerId {
        TimerId(n)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Signal {
    Interrupt,
    Terminate,
    Child,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wake {
    Io {
        token: Token,
        readable: bool,
        writable: bool,
        /// The peer hung up or the descriptor errored; a read will report how.
        closed: bool,
    },
    Timer(TimerId),
    /// A worker thread called `Waker::wake`; the owner drains its channels.
    Woken,
    Signal(Signal),
}

pub struct Reactor {
    poll: Poll,
    events: Events,
    next_token: usize,
    next_timer: u64,
    timers: BinaryHeap<Reverse<(Instant, TimerId)>>,
    /// Ids armed and neither fired nor cancelled; cancelling anything else is a no-op, so
    /// `cancelled` only ever holds ids still in the heap.
    armed: HashSet<TimerId>,
    /// Lazy cancellation: a cancelled id stays in the heap until it surfaces.
    cancelled: HashSet<TimerId>,
    waker: Arc<Waker>,
    signal_rx: pipe::Receiver,
    /// Kept open for the life of the reactor: the signal handler writes to its fd.
    _signal_tx: pipe::Sender,
}

impl Drop for Reactor {
    fn drop(&mut self) {
        // The handler must stop writing into a descriptor that is about to close (and may
        // be reused by the next open).
        sys::uninstall_signal_pipe(sys::raw_fd(&self._signal_tx));
    }
}

impl Reactor {
    pub fn new() -> io::Result<Reactor> {
        let poll = Poll::new()?;
        let waker = Arc::new(Waker::new(poll.registry(), WAKER)?);
        let (signal_tx, mut signal_rx) = pipe::new()?;
        poll.registry()
            .register(&mut signal_rx, SIGNALS, Interest::READABLE)?;
        sys::install_signal_pipe(sys::raw_fd(&signal_tx))?;
        sys::ignore_sigpipe();
        Ok(Reactor {
            poll,
            events: Events::with_capacity(EVENTS_CAPACITY),
            next_token: FIRST_DYNAMIC,
            next_timer: 1,
            timers: BinaryHeap::new(),
            armed: HashSet::new(),
            cancelled: HashSet::new(),
            waker,
            signal_rx,
            _signal_tx: signal_tx,
        })
    }

    pub fn token(&mut self) -> Token {
        let token = Token(self.next_token);
        self.next_token += 1;
        token
    }

    pub fn registry(&self) -> &Registry {
        self.poll.registry()
    }

    pub fn waker(&self) -> Arc<Waker> {
        Arc::clone(&self.waker)
    }

    pub fn add_timer(&mut self, after: Duration) -> TimerId {
        let id = TimerId(self.next_timer);
        self.next_timer += 1;
        self.timers.push(Reverse((Instant::now() + after, id)));
        self.armed.insert(id);
        id
    }

    pub fn cancel_timer(&mut self, id: TimerId) {
        if self.armed.remove(&id) {
            self.cancelled.insert(id);
        }
    }

    /// Blocks until at least one thing happened (or `max_wait` passed) and appends what
    /// happened to `out`. Expired timers are reported after I/O, in deadline order.
    pub fn wait(&mut self, out: &mut Vec<Wake>, max_wait: Option<Duration>) -> io::Result<()> {
        let now = Instant::now();
        let mut timeout = self
            .next_deadline()
            .map(|at| at.saturating_duration_since(now));
        if let Some(limit) = max_wait {
            timeout = Some(timeout.map_or(limit, |t| t.min(limit)));
        }
        if let Err(err) = self.poll.poll(&mut self.events, timeout) {
            // A signal interrupting epoll_wait is not an error: the handler already wrote
            // to the self-pipe, which the next round reports.
            if err.kind() != io::ErrorKind::Interrupted {
                return Err(err);
            }
        }
        let mut saw_signal = false;
        for event in self.events.iter() {
            match event.token() {
                WAKER => out.push(Wake::Woken),
                SIGNALS => saw_signal = true,
                token => out.push(Wake::Io {
                    token,
                    readable: event.is_readable() || event.is_read_closed(),
                    writable: event.is_writable() || event.is_write_closed(),
                    closed: event.is_error() || event.is_read_closed() || event.is_write_closed(),
                }),
            }
        }
        if saw_signal {
            self.drain_signals(out);
        }
        let now = Instant::now();
        while let Some(Reverse((at, id))) = self.timers.peek().copied() {
            if at > now {
                break;
            }
            self.timers.pop();
            if !self.cancelled.remove(&id) {
                self.armed.remove(&id);
                out.push(Wake::Timer(id));
            }
        }
        Ok(())
    }

    fn next_deadline(&mut self) -> Option<Instant> {
        while let Some(Reverse((at, id))) = self.timers.peek().copied() {
            if self.cancelled.remove(&id) {
                self.timers.pop();
                continue;
            }
            return Some(at);
        }
        None
    }

    fn drain_signals(&mut self, out: &mut Vec<Wake>) {
        let mut buf = [0u8; 64];
        // Interrupts are counted, not merged: a quick double Ctrl-C must read as two.
        let (mut child, mut ints, mut term) = (false, 0usize, false);
        loop {
            match self.signal_rx.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    for &byte in &buf[..n] {
                        match i32::from(byte) {
                            sys::SIGCHLD => child = true,
                            sys::SIGINT => ints += 1,
                            sys::SIGTERM => term = true,
                            _ => {}
                        }
                    }
                }
                Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => break,
            }
        }
        // Several SIGCHLDs coalesce into one wake: the owner reaps every child anyway.
        if child {
            out.push(Wake::Signal(Signal::Child));
        }
        for _ in 0..ints {
            out.push(Wake::Signal(Signal::Interrupt));
        }
        if term {
            out.push(Wake::Signal(Signal::Terminate));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timers_fire_in_order_and_cancelled_ones_do_not() {
        let mut reactor = Reactor::new().expect("reactor");
        let late = reactor.add_timer(Duration::from_millis(30));
        let early = reactor.add_timer(Duration::from_millis(1));
        let cancelled = reactor.add_timer(Duration::from_millis(2));
        reactor.cancel_timer(cancelled);
        let mut fired = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(5);
        while fired.len() < 2 && Instant::now() < deadline {
            let mut out = Vec::new();
            reactor
                .wait(&mut out, Some(Duration::from_millis(100)))
                .expect("wait");
            fired.extend(out.into_iter().filter_map(|w| match w {
                Wake::Timer(id) => Some(id),
                _ => None,
            }));
        }
        assert_eq!(fired, vec![early, late]);
    }

    #[test]
    fn waker_wakes() {
        let mut reactor = Reactor::new().expect("reactor");
        let waker = reactor.waker();
        std::thread::spawn(move || waker.wake().expect("wake"));
        let mut out = Vec::new();
        reactor
            .wait(&mut out, Some(Duration::from_secs(5)))
            .expect("wait");
        assert!(out.contains(&Wake::Woken));
    }
}
