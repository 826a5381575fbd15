//! Stdin as a line source on the reactor, and stdout as a byte sink.
//!
//! Stdin is polled when it is a pipe, socket or terminal. epoll refuses regular files and
//! /dev/null (EPERM), so for those a helper thread reads and posts chunks through a channel
//! and the `Waker`. O_NONBLOCK set on an inherited descriptor is shared with our parent, so
//! the old flags are restored on drop.

use std::io;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};

use mio::unix::SourceFd;
use mio::{Interest, Registry, Token, Waker};

use crate::sys::{self, FdKind};

const STDIN_FD: i32 = 0;
const STDOUT_FD: i32 = 1;

/// The longest stdin line we accept (a stream-json user message with a pasted file fits;
/// a peer that never sends a newline does not grow us without bound).
pub const MAX_LINE: usize = 16 * 1024 * 1024;

/// Bytes asked of polled stdin per read. It lives on the loop's stack, and every stack page it
/// touches stays resident for the life of the process: 64 KiB (a whole pipe buffer) cost an
/// idle `acp serve` 48 KiB more than this, for a few more reads of a rare large message.
const READ_CHUNK: usize = 16 * 1024;

/// What stdin produced since the last call.
#[derive(Debug, PartialEq, Eq)]
pub enum StdinItem {
    Line(Vec<u8>),
    /// A line longer than `MAX_LINE`; its bytes were discarded up to the next newline.
    Oversized,
    Eof,
}

enum Mode {
    Polled { saved_flags: libc::c_int },
    Thread { rx: Receiver<Option<Vec<u8>>> },
    Finished,
}

pub struct Stdin {
    mode: Mode,
    partial: Vec<u8>,
    discarding: bool,
}

impl Stdin {
    /// Registers stdin under `token`, or starts the fallback reader thread.
    pub fn attach(registry: &Registry, token: Token, waker: Arc<Waker>) -> io::Result<Stdin> {
        let mode = match sys::fd_kind(STDIN_FD) {
            FdKind::Closed => Mode::Finished,
            FdKind::Pollable => {
                let saved_flags = sys::set_nonblocking(STDIN_FD, true)?;
                match registry.register(&mut SourceFd(&STDIN_FD), token, Interest::READABLE) {
                    Ok(()) => Mode::Polled { saved_flags },
                    Err(_) => {
                        sys::restore_flags(STDIN_FD, saved_flags);
                        spawn_reader(waker)?
                    }
                }
            }
            FdKind::NotPollable => spawn_reader(waker)?,
        };
        let mut stdin = Stdin {
            mode,
            partial: Vec::new(),
            discarding: false,
        };
        if matches!(stdin.mode, Mode::Finished) {
            stdin.partial.clear();
        }
        Ok(stdin)
    }

    /// Collects complete lines (and EOF) available now. Call on readiness of the stdin token
    /// and on every `Woken`.
    pub fn drain(&mut self, registry: &Registry, out: &mut Vec<StdinItem>) {
        match &self.mode {
            Mode::Finished => {}
            Mode::Polled { saved_flags } => {
                let saved = *saved_flags;
                let mut buf = [0u8; READ_CHUNK];
                loop {
                    match sys::read_fd(STDIN_FD, &mut buf) {
                        Ok(0) => {
                            let _ = registry.deregister(&mut SourceFd(&STDIN_FD));
                            sys::restore_flags(STDIN_FD, saved);
                            self.finish(out);
                            return;
                        }
                        Ok(n) => self.push(&buf[..n], out),
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                        Err(_) => {
                            let _ = registry.deregister(&mut SourceFd(&STDIN_FD));
                            sys::restore_flags(STDIN_FD, saved);
                            self.finish(out);
                            return;
                        }
                    }
                }
            }
            Mode::Thread { rx } => {
                let mut chunks = Vec::new();
                let mut eof = false;
                while let Ok(item) = rx.try_recv() {
                    match item {
                        Some(chunk) => chunks.push(chunk),
                        None => {
                            eof = true;
                            break;
                        }
                    }
                }
                for chunk in chunks {
                    self.push(&chunk, out);
                }
                if eof {
                    self.finish(out);
                }
            }
        }
    }

    fn push(&mut self, mut bytes: &[u8], out: &mut Vec<StdinItem>) {
        while let Some(nl) = bytes.iter().position(|&b| b == b'\n') {
            let (head, rest) = bytes.split_at(nl);
            bytes = &rest[1..];
            if self.discarding {
                self.discarding = false;
                self.partial.clear();
                continue;
            }
            if self.partial.len() + head.len() > MAX_LINE {
                self.partial.clear();
                out.push(StdinItem::Oversized);
                continue;
            }
            let mut line = std::mem::take(&mut self.partial);
            line.extend_from_slice(head);
            if line.last() == Some(&b'\r') {
                line.pop();
            }
            out.push(StdinItem::Line(line));
        }
        if self.discarding {
            return;
        }
        if self.partial.len() + bytes.len() > MAX_LINE {
            self.partial.clear();
            self.discarding = true;
            out.push(StdinItem::Oversized);
            return;
        }
        self.partial.extend_from_slice(bytes);
    }

    fn finish(&mut self, out: &mut Vec<StdinItem>) {
        if !self.partial.is_empty() && !self.discarding {
            out.push(StdinItem::Line(std::mem::take(&mut self.partial)));
        }
        self.mode = Mode::Finished;
        out.push(StdinItem::Eof);
    }
}

impl Drop for Stdin {
    fn drop(&mut self) {
        if let Mode::Polled { saved_flags } = self.mode {
            sys::restore_flags(STDIN_FD, saved_flags);
        }
    }
}

fn spawn_reader(waker: Arc<Waker>) -> io::Result<Mode> {
    let (tx, rx): (Sender<Option<Vec<u8>>>, _) = channel();
    std::thread::Builder::new()
        .name("caliban-stdin".into())
        .spawn(move || {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                match sys::read_fd(STDIN_FD, &mut buf) {
                    Ok(0) => break,
                    Ok(n) => {
                        if tx.send(Some(buf[..n].to_vec())).is_err() {
                            return;
                        }
                        let _ = waker.wake();
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(_) => break,
                }
            }
            let _ = tx.send(None);
            let _ = waker.wake();
        })?;
    Ok(Mode::Thread { rx })
}

/// The most output we hold for a stdout reader that is not keeping up. Past it the reader
/// is treated as gone: the run goes on to a clean end, and nothing more is printed.
pub const MAX_STDOUT_QUEUE: usize = 64 * 1024 * 1024;

enum OutMode {
    /// Non-blocking and registered for WRITABLE: writes never stall the loop.
    Polled { saved_flags: libc::c_int },
    /// A regular file or /dev/null: writes complete without waiting on a reader.
    Blocking,
}

/// Stdout as a queue the loop drains without blocking. A pipe whose reader stops reading
/// must not freeze signals, timeouts or tool kills.
pub struct Stdout {
    mode: OutMode,
    /// Output not yet written: `queue[sent..]`. What was written is cut off the front only
    /// when that is at least half the queue, so a reader that takes a pipe's worth at a time
    /// does not cost a move of everything behind it per write.
    queue: Vec<u8>,
    sent: usize,
    /// The last write found the pipe full: nothing is tried until WRITABLE says it has room.
    blocked: bool,
    /// The reader went away (EPIPE) or fell hopelessly behind; output is dropped.
    gone: bool,
}

/// Room the queue keeps between bursts; a larger one (a reader that fell behind) is freed.
const KEEP_QUEUE_BYTES: usize = 64 << 10;

impl Stdout {
    pub fn attach(registry: &Registry, token: Token) -> Stdout {
        let mode = match sys::fd_kind(STDOUT_FD) {
            FdKind::Pollable => match sys::set_nonblocking(STDOUT_FD, true) {
                Ok(saved_flags) => {
                    match registry.register(&mut SourceFd(&STDOUT_FD), token, Interest::WRITABLE) {
                        Ok(()) => OutMode::Polled { saved_flags },
                        Err(_) => {
                            sys::restore_flags(STDOUT_FD, saved_flags);
                            OutMode::Blocking
                        }
                    }
                }
                Err(_) => OutMode::Blocking,
            },
            FdKind::NotPollable | FdKind::Closed => OutMode::Blocking,
        };
        Stdout {
            mode,
            queue: Vec::new(),
            sent: 0,
            blocked: false,
            gone: false,
        }
    }

    /// Queues what `write` appends and writes what the pipe takes. `write` appends to the
    /// queue itself: a batch of protocol frames is built where it waits, with no copy.
    pub fn push_with(&mut self, write: impl FnOnce(&mut Vec<u8>)) {
        if self.gone {
            // Still taken, so the writer's buffer does not grow for nobody.
            write(&mut Vec::new());
            return;
        }
        self.compact();
        let before = self.queue.len();
        write(&mut self.queue);
        if self.queue.len() == before {
            return;
        }
        if self.queue.len() - self.sent > MAX_STDOUT_QUEUE {
            self.fell_behind();
            return;
        }
        if !self.blocked {
            self.flush();
        }
    }

    /// Cuts what was written off the front once that is at least half the queue.
    fn compact(&mut self) {
        if self.sent > 0 && self.sent >= self.queue.len() / 2 {
            self.queue.drain(..self.sent);
            self.sent = 0;
        }
    }

    fn fell_behind(&mut self) {
        crate::log::error(&format!(
            "stdout reader fell {MAX_STDOUT_QUEUE} bytes behind; dropping further output"
        ));
        self.gone = true;
        self.queue = Vec::new();
        self.sent = 0;
    }

    /// Writes until the queue is empty or the pipe is full. Call on WRITABLE too.
    pub fn flush(&mut self) {
        self.blocked = false;
        while self.sent < self.queue.len() && !self.gone {
            match sys::write_fd(STDOUT_FD, self.queue.get(self.sent..).unwrap_or_default()) {
                Ok(0) => self.gone = true,
                Ok(n) => self.sent += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.blocked = true;
                    break;
                }
                // EPIPE and friends: the reader is gone.
                Err(_) => self.gone = true,
            }
        }
        if self.gone || (self.sent == self.queue.len() && self.queue.capacity() > KEEP_QUEUE_BYTES)
        {
            self.queue = Vec::new();
            self.sent = 0;
        } else if self.sent == self.queue.len() {
            self.queue.clear();
            self.sent = 0;
        }
    }

    /// The reader went away (EPIPE) or fell `MAX_STDOUT_QUEUE` behind.
    pub fn is_gone(&self) -> bool {
        self.gone
    }

    /// At exit: waits for the reader to take what is queued, up to `deadline` if given. A
    /// SIGINT/SIGTERM arriving meanwhile shortens the wait to `grace`.
    pub fn finish(&mut self, mut deadline: Option<std::time::Instant>, grace: std::time::Duration) {
        loop {
            self.flush();
            if self.sent == self.queue.len() || self.gone {
                return;
            }
            if deadline.is_none() && sys::termination_requested() {
                deadline = Some(std::time::Instant::now() + grace);
            }
            // Poll in slices: the signal may be delivered to another thread, leaving this
            // one asleep unless it looks again.
            let slice = std::time::Duration::from_millis(100);
            let wait = match deadline {
                Some(at) => {
                    let left = at.saturating_duration_since(std::time::Instant::now());
                    if left.is_zero() {
                        return;
                    }
                    Some(left.min(slice))
                }
                None => Some(slice),
            };
            if sys::wait_writable(STDOUT_FD, wait).is_err() {
                return;
            }
        }
    }
}

impl Drop for Stdout {
    fn drop(&mut self) {
        if let OutMode::Polled { saved_flags } = self.mode {
            sys::restore_flags(STDOUT_FD, saved_flags);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(stdin: &mut Stdin, chunks: &[&[u8]]) -> Vec<StdinItem> {
        let mut out = Vec::new();
        for c in chunks {
            stdin.push(c, &mut out);
        }
        out
    }

    #[test]
    fn splits_lines_across_chunks() {
        let mut s = Stdin {
            mode: Mode::Finished,
            partial: Vec::new(),
            discarding: false,
        };
        let out = lines(&mut s, &[b"ab", b"c\r\nd", b"\n\n"]);
        assert_eq!(
            out,
            vec![
                StdinItem::Line(b"abc".to_vec()),
                StdinItem::Line(b"d".to_vec()),
                StdinItem::Line(Vec::new())
            ]
        );
    }

    #[test]
    fn oversized_lines_are_dropped_whole() {
        let mut s = Stdin {
            mode: Mode::Finished,
            partial: Vec::new(),
            discarding: false,
        };
        let big = vec![b'x'; MAX_LINE + 1];
        let out = lines(&mut s, &[&big, b"tail\nok\n"]);
        assert_eq!(
            out,
            vec![StdinItem::Oversized, StdinItem::Line(b"ok".to_vec())]
        );
    }
}
