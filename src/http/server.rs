//! One inbound HTTP/1.1 connection (plain or TLS) as a state machine driven by readiness:
//! read a request head, read its body, hand the `Request` to the owner, queue the owner's
//! response (whole, or streamed in chunks), then the next request; protocol errors are
//! answered here (400, 413, 417, 431, 501, 505) and end the connection.
//!
//! It uses the sans-IO codecs next door and `transport::Conn` for the bytes. It must not know
//! about routes, runs, auth or JSON beyond its own error bodies, and it owns no timers: the
//! owner enforces `Limits::idle_timeout` with `last_activity()` and a deadline for each
//! request head with `head_started()`, and calls `close`.
//!
//! LIFECYCLE (`Phase`): `ReadingHead` → `ReadingBody` → `Dispatched` → (`respond`) →
//! `ReadingHead` again, or `Dispatched` → `start_stream` → `Streaming` → `end_stream` →
//! `ReadingHead`. With `require_admission`, a complete head first goes `Admitting` (the
//! owner's `admit` goes on to `ReadingBody` or `Dispatched`; its `respond` refuses the
//! request without reading a byte of its body). When the connection must end (the request said close, a protocol error,
//! the peer's EOF) it goes `Closing` (flush, close_notify, shut down our side) → `Lingering`
//! (discard what the peer still sends) → `Closed`. `close` jumps straight to `Closed`.
//!
//! Backpressure: at most one request is out with the owner at a time, so pipelined requests
//! wait in `inbuf`, which never grows past `Limits::max_head`; a new request is only parsed
//! while queued output is under `Limits::max_out_buffer`; a streaming owner paces itself with
//! `wants_more_stream` and `ConnEvent::Writable`, which keep a stream's queue under
//! `STREAM_WINDOW`. A client that pipelines forever or never reads therefore costs at most
//! max_head + max_body + max_out_buffer (plus one response), and a live stream it never reads
//! about `STREAM_WINDOW` plus what the owner queues at once; `write_stalled_for` tells the
//! owner how long output has waited on such a peer, so it can give up on it.

use std::io::{self, Write as _};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use mio::net::TcpStream;

use crate::http::body::{BodyDecoder, BodyError};
use crate::http::head::{self, BodyKind, HeadError, Parsed, RequestHead};
use crate::http::write;
use crate::transport::Conn;

/// Default `Limits::max_head`: generous for browsers' cookies, small enough that a thousand
/// idle connections with half-sent heads cost a few MiB.
pub const DEFAULT_MAX_HEAD: usize = 16 * 1024;

/// Default `Limits::max_body`: run prompts and permission answers are small JSON documents.
pub const DEFAULT_MAX_BODY: u64 = 1024 * 1024;

/// Default `Limits::max_out_buffer`.
pub const DEFAULT_MAX_OUT_BUFFER: usize = 1024 * 1024;

/// Most bytes a streamed response queues before `wants_more_stream` turns false (or half of
/// `Limits::max_out_buffer`, if smaller); `ConnEvent::Writable` comes once it drains below.
/// The rest of a stream stays with the owner (a run's log, on disk) and is read as the peer
/// drains, so a peer that stops reading holds this much of it here, not the whole stream,
/// while the kernel's socket buffers (outside the process) keep a fast reader busy.
pub const STREAM_WINDOW: usize = 64 * 1024;

/// Default `Limits::idle_timeout`.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// Most bytes discarded after we shut down our side. Closing a socket with unread input
/// makes the kernel send RST, which can destroy the error response still in flight (a 413
/// sent while the client is still uploading); reading a little first lets it arrive.
pub const LINGER_MAX_BYTES: usize = 256 * 1024;

/// Guard against a livelock bug in `pump`: every loop ends long before this because each
/// round reads bytes and every byte source is capped. Not a fairness budget.
const MAX_PUMP_ROUNDS: usize = 1 << 20;

const CONTINUE: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";

#[derive(Clone, Debug)]
pub struct Limits {
    /// Largest request head (request line, header fields, blank line), and so also the most
    /// pipelined bytes held while a request is with the owner. Over it: 431. Values above
    /// `head::MAX_HEAD_BYTES` (64 KiB) act as that cap.
    pub max_head: usize,
    /// Largest request body, decoded. A declared Content-Length over it is refused with 413
    /// before any of the body is read.
    pub max_body: u64,
    /// High-water mark for queued response bytes: no new request is parsed above it, and
    /// streams should pause (see `Connection::wants_more_stream`).
    pub max_out_buffer: usize,
    /// How long a connection may go without a byte in either direction; enforced by the
    /// owner's timer against `Connection::last_activity`.
    pub idle_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_head: DEFAULT_MAX_HEAD,
            max_body: DEFAULT_MAX_BODY,
            max_out_buffer: DEFAULT_MAX_OUT_BUFFER,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
        }
    }
}

/// A complete request, body included.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    pub method: String,
    /// The request target as sent.
    pub target: String,
    /// The percent-decoded path, without the query; `*` for `OPTIONS *`. For an
    /// absolute-form target (`http://host/p`) this is the path part.
    pub path: String,
    /// Decoded (`+` is a space) query pairs in order; `a` alone gives `("a", "")`.
    pub query: Vec<(String, String)>,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// Whether the client wants the connection kept open after the response.
    pub keep_alive: bool,
}

impl Request {
    /// The first header field called `name`, compared case-insensitively.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(field, _)| field.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.as_str())
    }

    /// The first query parameter called `name` (case-sensitive, as URLs are).
    pub fn query_param(&self, name: &str) -> Option<&str> {
        self.query
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.as_str())
    }
}

#[derive(Debug, PartialEq, Eq)]
pub enum ConnEvent {
    /// With `require_admission`: a complete request head (`body` empty, none of it read
    /// yet). `admit` it to read its body (a `Request` follows), or refuse it with
    /// `respond`, which ends the connection if a body was announced.
    Head(Request),
    /// A complete request; answer it with `respond` or `start_stream`. No other request is
    /// yielded until this one's response is complete.
    Request(Request),
    /// The peer hung up or errored, or the connection finished closing; deregister and drop.
    Closed,
    /// Queued output drained below the stream window (`STREAM_WINDOW`) while streaming:
    /// send more.
    Writable,
}

/// What the connection remembers about the request being answered.
#[derive(Clone, Copy, Debug)]
struct Exchange {
    keep_alive: bool,
    /// A HEAD request: the response carries headers only.
    is_head: bool,
    /// HTTP/1.0 cannot read chunked bodies, so its streams are delimited by the close.
    http10: bool,
}

/// See the module's LIFECYCLE section.
enum Phase {
    /// Waiting for a complete request head in `inbuf`.
    ReadingHead,
    /// A complete head is with the owner (`ConnEvent::Head`), to `admit` or refuse; `body`
    /// is how its body is delimited and whether it asked for `100 Continue`, when it has
    /// one.
    Admitting {
        exchange: Exchange,
        body: Option<(BodyKind, bool)>,
    },
    /// Decoding the body of `request` from `inbuf`.
    ReadingBody {
        request: Request,
        exchange: Exchange,
        decoder: BodyDecoder,
    },
    /// The request is with the owner; waiting for `respond` or `start_stream`.
    Dispatched {
        exchange: Exchange,
    },
    /// A streamed response is going out; `chunked` is false for HTTP/1.0 peers.
    Streaming {
        exchange: Exchange,
        chunked: bool,
    },
    /// Nothing more will be read or answered: flush `outbuf`, then close_notify, then shut
    /// down our side.
    Closing {
        close_notify_sent: bool,
    },
    /// Our side is shut down; discard input until EOF or `LINGER_MAX_BYTES`.
    Lingering {
        discarded: usize,
    },
    Closed,
}

pub struct Connection {
    conn: Conn,
    peer: SocketAddr,
    limits: Limits,
    phase: Phase,
    /// Received bytes not yet parsed: at most `max_head` (plus one TLS read's overshoot).
    inbuf: Vec<u8>,
    /// Response bytes not yet on the socket. Bounded by the owner honouring
    /// `max_out_buffer` (no request is parsed above it; streams pace themselves).
    outbuf: Vec<u8>,
    /// A request parsed by `pump`, waiting for `on_ready` or `next_request` to hand it out.
    ready: Option<Request>,
    /// Heads go to the owner for admission before their bodies are read.
    admission: bool,
    /// A head in `Admitting`, waiting for `on_ready` or `next_head` to hand it out.
    head_ready: Option<Request>,
    /// Events produced outside `on_ready` (by `respond` and friends) for the next call.
    events: Vec<ConnEvent>,
    last_activity: Instant,
    /// When the first byte of the request head now in `inbuf` arrived; `None` when no head
    /// is under way. Unlike `last_activity`, more bytes do not move it.
    head_started: Option<Instant>,
    peer_eof: bool,
    /// The last read of the socket ended in `WouldBlock` and no readiness came since, so
    /// another read would only say `WouldBlock` again: with edge-triggered readiness, bytes
    /// or a hang-up arriving later bring `on_ready`. Every write to a live stream looks at
    /// its connection again (for a pipelined request, a hang-up); without this, each such
    /// look cost two empty `recv`s per event per follower.
    socket_drained: bool,
    /// A stream went over its window (`stream_window`); `Writable` is owed when it drains.
    writable_owed: bool,
    /// Since when queued output has waited with no byte taken by the socket (from when it
    /// was queued, or the last byte that went out); `None` while nothing waits.
    write_waiting_since: Option<Instant>,
    closed_reported: bool,
    /// Pipelined input was dropped during a stream: the connection closes after it.
    discarded_behind_stream: bool,
}

impl Connection {
    /// Takes an accepted, non-blocking socket. With `tls`, the handshake runs inside the first
    /// `on_ready` calls. Register `tcp()` for READABLE | WRITABLE (edge-triggered) once.
    pub fn new(
        tcp: TcpStream,
        peer: SocketAddr,
        tls: Option<Arc<rustls::ServerConfig>>,
        limits: Limits,
    ) -> Result<Connection, String> {
        // Responses are written whole or in deliberate chunks; Nagle would only add latency
        // to the last segment of each.
        let _ = tcp.set_nodelay(true);
        let conn = match tls {
            Some(config) => Conn::Plain(tcp).accept_tls(config)?,
            None => Conn::Plain(tcp),
        };
        Ok(Connection {
            conn,
            peer,
            limits,
            phase: Phase::ReadingHead,
            inbuf: Vec::new(),
            outbuf: Vec::new(),
            ready: None,
            admission: false,
            head_ready: None,
            events: Vec::new(),
            last_activity: Instant::now(),
            head_started: None,
            peer_eof: false,
            socket_drained: false,
            writable_owed: false,
            write_waiting_since: None,
            closed_reported: false,
            discarded_behind_stream: false,
        })
    }

    /// The socket, to register and deregister.
    pub fn tcp(&mut self) -> &mut TcpStream {
        self.conn.tcp()
    }

    pub fn peer(&self) -> SocketAddr {
        self.peer
    }

    /// From now on every request head is handed out (`ConnEvent::Head`, `next_head`) for
    /// the owner to `admit` or refuse before any of its body is read, so a refusal (a peer
    /// without credentials) neither waits for nor buffers a body.
    pub fn require_admission(&mut self) {
        self.admission = true;
    }

    /// Call on any readiness for this connection's token: reads (and handshakes), flushes,
    /// parses. Yields at most one `Head` or `Request`, and only when no response is in
    /// progress.
    pub fn on_ready(&mut self) -> Vec<ConnEvent> {
        self.socket_drained = false;
        self.pump();
        let mut events = std::mem::take(&mut self.events);
        if let Some(head) = self.head_ready.take() {
            events.push(ConnEvent::Head(head));
        }
        if let Some(request) = self.ready.take() {
            events.push(ConnEvent::Request(request));
        }
        if matches!(self.phase, Phase::Closed) && !self.closed_reported {
            self.closed_reported = true;
            events.push(ConnEvent::Closed);
        }
        events
    }

    /// The next request, once the previous response is complete: one already buffered
    /// (pipelined) or readable now. Call it after `respond` and `end_stream` until it gives
    /// `None`; reading may have been paused while the response was pending, and no readiness
    /// event comes for bytes that were already waiting. Check `is_closed` afterwards.
    pub fn next_request(&mut self) -> Option<Request> {
        self.pump();
        self.ready.take()
    }

    /// With `require_admission`, the next request head to admit or refuse, as for
    /// `next_request` (call both: an admitted head's request follows).
    pub fn next_head(&mut self) -> Option<Request> {
        self.pump();
        self.head_ready.take()
    }

    /// Lets the head handed out as `ConnEvent::Head` proceed: its body is read (after a
    /// `100 Continue` if it asked for one), and the complete request comes from `on_ready`
    /// or `next_request`. Ignored unless a head awaits admission.
    pub fn admit(&mut self, head: Request) {
        let Phase::Admitting { exchange, body } = self.phase else {
            return;
        };
        match body {
            None => self.dispatch(head, exchange),
            Some((kind, expects_continue)) => {
                // RFC 9110 §10.1.1: an HTTP/1.0 client cannot read an interim response, and
                // a client that already started sending the body is not waiting for one.
                if expects_continue && !exchange.http10 && self.inbuf.is_empty() {
                    self.outbuf.extend_from_slice(CONTINUE);
                }
                self.phase = Phase::ReadingBody {
                    request: head,
                    exchange,
                    decoder: BodyDecoder::new(kind, self.limits.max_body),
                };
            }
        }
        self.pump();
    }

    /// Answers the pending request with a complete response. `Content-Length`, `Date` and
    /// (when the connection will end) `Connection: close` are added; `Content-Length`,
    /// `Transfer-Encoding` and `Connection` in `headers` are dropped, except that
    /// `Connection: close` there ends the connection after this response. Ignored when no
    /// request is pending or `status` is informational (1xx). A head awaiting admission is
    /// refused this way: the body it announced is never read, so the connection ends after
    /// the response.
    pub fn respond(&mut self, status: u16, headers: &[(&str, &str)], body: &[u8]) {
        let exchange = match self.phase {
            Phase::Dispatched { exchange } => exchange,
            Phase::Admitting { exchange, body } => Exchange {
                keep_alive: exchange.keep_alive && body.is_none(),
                ..exchange
            },
            _ => return,
        };
        self.head_ready = None;
        if status < 200 {
            return;
        }
        let keep_alive = exchange.keep_alive && !asks_close(headers);
        // RFC 9110 §6.4.1: these statuses never have content, so no length either.
        let bodiless = matches!(status, 204 | 304);
        let length = body.len().to_string();
        let framing: &[(&str, &str)] = if bodiless {
            &[]
        } else {
            &[("Content-Length", length.as_str())]
        };
        self.queue_head(status, headers, framing, keep_alive, exchange.http10);
        if !bodiless && !exchange.is_head {
            self.outbuf.extend_from_slice(body);
        }
        self.finish_exchange(keep_alive);
    }

    /// Starts a streamed response to the pending request: `Transfer-Encoding: chunked` (for
    /// HTTP/1.0 peers, a body delimited by the close). Header rules as for `respond`.
    pub fn start_stream(&mut self, status: u16, headers: &[(&str, &str)]) {
        let Phase::Dispatched { exchange } = self.phase else {
            return;
        };
        if status < 200 {
            return;
        }
        let chunked = !exchange.http10;
        let keep_alive = chunked && exchange.keep_alive && !asks_close(headers);
        let framing: &[(&str, &str)] = if chunked {
            &[("Transfer-Encoding", "chunked")]
        } else {
            &[]
        };
        self.queue_head(status, headers, framing, keep_alive, exchange.http10);
        self.phase = Phase::Streaming {
            exchange: Exchange {
                keep_alive,
                ..exchange
            },
            chunked,
        };
        self.flush_after_queue();
    }

    /// Queues one chunk of a streamed response (nothing for empty `data`, whose chunk would
    /// end the body) and offers it to the socket. Always queues: pace with
    /// `wants_more_stream` and `Writable`.
    pub fn stream_chunk(&mut self, data: &[u8]) {
        self.hold_stream_chunk(data);
        self.flush_stream();
    }

    /// `stream_chunk` without the write: an owner with several chunks for one connection
    /// holds them and sends them with one `flush_stream` (or `end_stream`), one `send`
    /// instead of one per chunk.
    pub fn hold_stream_chunk(&mut self, data: &[u8]) {
        let Phase::Streaming { exchange, chunked } = self.phase else {
            return;
        };
        if data.is_empty() || exchange.is_head {
            return;
        }
        if chunked {
            let _ = write!(self.outbuf, "{:x}\r\n", data.len());
            self.outbuf.extend_from_slice(data);
            self.outbuf.extend_from_slice(b"\r\n");
        } else {
            self.outbuf.extend_from_slice(data);
        }
    }

    /// Offers held stream chunks to the socket.
    pub fn flush_stream(&mut self) {
        if self.is_streaming() {
            self.flush_after_queue();
        }
    }

    /// Ends a streamed response; the next request may then proceed (see `next_request`).
    pub fn end_stream(&mut self) {
        let Phase::Streaming { exchange, chunked } = self.phase else {
            return;
        };
        if chunked && !exchange.is_head {
            self.outbuf.extend_from_slice(write::LAST_CHUNK);
        }
        self.writable_owed = false;
        self.finish_exchange(exchange.keep_alive && !self.discarded_behind_stream);
    }

    /// Response bytes queued and not yet accepted by the socket.
    #[cfg(test)]
    pub fn out_buffered(&self) -> usize {
        self.outbuf.len()
    }

    pub fn is_streaming(&self) -> bool {
        matches!(self.phase, Phase::Streaming { .. })
    }

    /// Whether a stream may queue more now; when false, wait for `ConnEvent::Writable`.
    pub fn wants_more_stream(&self) -> bool {
        self.is_streaming() && self.outbuf.len() < self.stream_window()
    }

    /// How long queued output has waited without the socket taking a byte of it; `None`
    /// while nothing is queued here. A peer that reads nothing while we have something to
    /// say (a follower that stopped reading, a client that vanished behind a full window) is
    /// the owner's to give up on, since the idle timer cannot tell (the peer may still
    /// send). The socket taking bytes is a weak sign of life: a kernel frees a little room
    /// now and then even for a peer that reads nothing, so the owner asks the kernel what
    /// the peer acknowledged (`sys::tcp_send_state`) where it can.
    pub fn write_stalled_for(&self) -> Option<Duration> {
        self.write_waiting_since.map(|since| since.elapsed())
    }

    fn stream_window(&self) -> usize {
        STREAM_WINDOW.min(self.limits.max_out_buffer / 2)
    }

    /// Whether a request is with the owner and not yet fully answered; the owner may want
    /// to exempt such connections from the idle timeout while it computes the response.
    pub fn awaiting_response(&self) -> bool {
        matches!(
            self.phase,
            Phase::Admitting { .. } | Phase::Dispatched { .. } | Phase::Streaming { .. }
        ) || self.ready.is_some()
    }

    /// Whether the peer has sent EOF. Its pending request is still answered (a client may
    /// half-close after sending), but a live stream nobody will read may be abandoned: an
    /// owner holding a quiet stream can check this after each `on_ready`. (EOF is seen while
    /// a request is out because pipelined bytes are still read, up to `max_head`.)
    pub fn peer_eof(&self) -> bool {
        self.peer_eof
    }

    /// When a byte last moved in either direction (or the connection was made).
    pub fn last_activity(&self) -> Instant {
        self.last_activity
    }

    /// When the request head being read began to arrive, while it is incomplete; the owner
    /// closes a connection whose head takes too long, since any byte moves
    /// `last_activity` and a client trickling a head would otherwise hold it forever. The
    /// clock starts at the head's first byte (for a pipelined head, when it becomes the one
    /// being read), so a keep-alive connection waiting between requests is not on it.
    pub fn head_started(&self) -> Option<Instant> {
        self.head_started
    }

    pub fn is_closed(&self) -> bool {
        matches!(self.phase, Phase::Closed)
    }

    /// Ends the connection now, dropping queued output (a TLS close_notify is attempted).
    /// The socket stays open until the `Connection` is dropped so it can be deregistered.
    pub fn close(&mut self) {
        if matches!(self.phase, Phase::Closed) {
            return;
        }
        self.conn.send_close_notify();
        let mut nothing = Vec::new();
        let _ = self.conn.flush(&mut nothing);
        let _ = self.conn.tcp().shutdown(std::net::Shutdown::Both);
        self.enter_closed();
    }

    fn enter_closed(&mut self) {
        self.phase = Phase::Closed;
        self.head_started = None;
        self.ready = None;
        self.head_ready = None;
        self.outbuf = Vec::new();
        self.inbuf = Vec::new();
        self.writable_owed = false;
        self.write_waiting_since = None;
    }

    /// The response head: status line, the owner's fields minus the ones we own, then
    /// `fields` (framing) and the connection fields.
    fn queue_head(
        &mut self,
        status: u16,
        headers: &[(&str, &str)],
        framing: &[(&str, &str)],
        keep_alive: bool,
        http10: bool,
    ) {
        const OWNED: [&str; 3] = ["content-length", "transfer-encoding", "connection"];
        let mut all: Vec<(&str, &str)> = headers
            .iter()
            .filter(|(name, _)| !OWNED.iter().any(|owned| name.eq_ignore_ascii_case(owned)))
            .chain(framing)
            .copied()
            .collect();
        let date = http_date(SystemTime::now());
        if !headers.iter().any(|(n, _)| n.eq_ignore_ascii_case("date")) {
            all.push(("Date", date.as_str()));
        }
        if !keep_alive {
            all.push(("Connection", "close"));
        } else if http10 {
            // HTTP/1.0 closes by default; say that we will not.
            all.push(("Connection", "keep-alive"));
        }
        self.outbuf
            .extend_from_slice(&write::response_head(status, &all));
    }

    /// After the last byte of a response is queued: close, or look for the next request.
    fn finish_exchange(&mut self, keep_alive: bool) {
        self.phase = if keep_alive {
            Phase::ReadingHead
        } else {
            Phase::Closing {
                close_notify_sent: false,
            }
        };
        // Runs the machine on: flushes, and parses a pipelined request into `ready` (which
        // `next_request` hands out), or finishes closing.
        self.pump();
    }

    /// Queued bytes must be offered to the socket now: with edge-triggered readiness no
    /// writable event comes for a socket that never filled up.
    fn flush_after_queue(&mut self) {
        if self.flush_out().is_err() {
            self.enter_closed();
            return;
        }
        if self.is_streaming() && self.outbuf.len() >= self.stream_window() {
            self.writable_owed = true;
        }
    }

    fn flush_out(&mut self) -> io::Result<()> {
        if self.outbuf.is_empty() && !self.conn.wants_write() {
            self.write_waiting_since = None;
            return Ok(());
        }
        let before = self.outbuf.len();
        self.conn.flush(&mut self.outbuf)?;
        let moved = self.outbuf.len() < before;
        if moved {
            self.last_activity = Instant::now();
        }
        if self.outbuf.is_empty() && !self.conn.wants_write() {
            self.write_waiting_since = None;
        } else if moved || self.write_waiting_since.is_none() {
            self.write_waiting_since = Some(Instant::now());
        }
        Ok(())
    }

    /// Flush, close or parse, and read, until nothing moves.
    fn pump(&mut self) {
        for _ in 0..MAX_PUMP_ROUNDS {
            if matches!(self.phase, Phase::Closed) {
                return;
            }
            if self.flush_out().is_err() {
                self.enter_closed();
                return;
            }
            self.after_flush();
            self.advance();
            // `advance` may have queued an error response or `100 Continue`.
            if self.flush_out().is_err() {
                self.enter_closed();
                return;
            }
            self.after_flush();
            if !self.read_some() {
                return;
            }
        }
        crate::log::warn(&format!(
            "http connection from {} exceeded {MAX_PUMP_ROUNDS} pump rounds; closing",
            self.peer
        ));
        self.close();
    }

    /// Steps that wait on the out buffer draining: a stream's `Writable`, and closing.
    fn after_flush(&mut self) {
        match self.phase {
            Phase::Streaming { .. }
                if self.writable_owed && self.outbuf.len() < self.stream_window() =>
            {
                self.writable_owed = false;
                self.events.push(ConnEvent::Writable);
            }
            Phase::Closing { close_notify_sent } => {
                if !self.outbuf.is_empty() || self.conn.wants_write() {
                    return;
                }
                if !close_notify_sent {
                    self.conn.send_close_notify();
                    self.phase = Phase::Closing {
                        close_notify_sent: true,
                    };
                    if self.flush_out().is_err() {
                        self.enter_closed();
                        return;
                    }
                    if self.conn.wants_write() {
                        return;
                    }
                }
                // Our FIN tells the client the response is complete; its reads end cleanly.
                let _ = self.conn.tcp().shutdown(std::net::Shutdown::Write);
                if self.peer_eof {
                    self.enter_closed();
                } else {
                    self.inbuf = Vec::new();
                    self.phase = Phase::Lingering { discarded: 0 };
                }
            }
            _ => {}
        }
    }

    /// Reads what the phase allows; returns whether anything happened (bytes or EOF).
    fn read_some(&mut self) -> bool {
        if self.socket_drained {
            return false;
        }
        let res = match &mut self.phase {
            Phase::Closing { .. } | Phase::Closed => return false,
            Phase::Lingering { discarded } => {
                let so_far = *discarded;
                let mut scratch = Vec::new();
                let res = self
                    .conn
                    .drain_read_upto(&mut scratch, LINGER_MAX_BYTES.saturating_sub(so_far));
                if let Ok(status) = &res {
                    let total = so_far.saturating_add(status.n_bytes);
                    self.phase = Phase::Lingering { discarded: total };
                    if total >= LINGER_MAX_BYTES {
                        // A peer that keeps sending after our close is not waiting for the
                        // response; stop spending reads on it.
                        self.enter_closed();
                        return false;
                    }
                }
                res
            }
            _ => {
                if self.peer_eof {
                    return false;
                }
                let room = self.in_cap().saturating_sub(self.inbuf.len());
                if room == 0 && self.is_streaming() {
                    // A live stream can last hours: keep reading so a hang-up is seen,
                    // but drop what a client pipelined past the cap behind it, and close
                    // once the stream ends, since those requests are lost.
                    self.discarded_behind_stream = true;
                    let mut scratch = Vec::new();
                    self.conn.drain_read_upto(&mut scratch, LINGER_MAX_BYTES)
                } else if room == 0 {
                    // Full of pipelined bytes while a request is out: stop draining the
                    // socket. The kernel's window then pushes back on the client.
                    return false;
                } else {
                    self.conn.drain_read_upto(&mut self.inbuf, room)
                }
            }
        };
        match res {
            // A reset or a TLS failure: nothing more can be delivered either way.
            Err(_) => {
                self.enter_closed();
                false
            }
            Ok(status) => {
                // Neither the budget nor EOF stopped the drain: the socket said `WouldBlock`.
                self.socket_drained = !status.more && !status.eof;
                if status.n_bytes > 0 {
                    self.last_activity = Instant::now();
                }
                if status.eof {
                    self.on_peer_eof();
                }
                status.n_bytes > 0 || status.eof
            }
        }
    }

    fn on_peer_eof(&mut self) {
        if self.peer_eof {
            return;
        }
        self.peer_eof = true;
        // Otherwise `advance` decides: buffered complete requests are still answered.
        if let Phase::Lingering { .. } = self.phase {
            self.enter_closed();
        }
    }

    fn in_cap(&self) -> usize {
        self.limits.max_head.max(1)
    }

    /// Parses what `inbuf` holds as far as the phase allows: at most one request is handed
    /// out (into `ready`), and none while output is over the high-water mark.
    fn advance(&mut self) {
        loop {
            match &mut self.phase {
                Phase::ReadingHead => {
                    if self.inbuf.is_empty() && self.peer_eof {
                        self.begin_close();
                        return;
                    }
                    if self.outbuf.len() >= self.limits.max_out_buffer || self.inbuf.is_empty() {
                        return;
                    }
                    if !plausible_request_start(&self.inbuf) {
                        // Not HTTP at all (a TLS hello on the plain port, a stray protocol):
                        // answer at once rather than waiting for a line end.
                        self.reject(400, "malformed request line".to_owned());
                        return;
                    }
                    match head::parse_request_head(&self.inbuf) {
                        Ok(Parsed::Partial) => {
                            self.head_started.get_or_insert_with(Instant::now);
                            if self.inbuf.len() >= self.limits.max_head {
                                self.reject_head_too_large();
                            } else if self.peer_eof {
                                // A request cut short: nobody is left to answer.
                                self.begin_close();
                            }
                            return;
                        }
                        Err(err) => {
                            let status = head_error_status(&err);
                            if status == 431 {
                                self.reject_head_too_large();
                            } else {
                                self.reject(status, err.to_string());
                            }
                            return;
                        }
                        Ok(Parsed::Complete(head, used)) => {
                            self.head_started = None;
                            if used > self.limits.max_head {
                                self.reject_head_too_large();
                                return;
                            }
                            self.inbuf.drain(..used.min(self.inbuf.len()));
                            if !self.start_body(head) {
                                return;
                            }
                        }
                    }
                }
                Phase::ReadingBody {
                    request, decoder, ..
                } => {
                    let res = decoder.decode(&self.inbuf, &mut request.body);
                    match res {
                        Err(BodyError::TooLarge) => {
                            let max = self.limits.max_body;
                            self.reject(413, format!("request body larger than {max} bytes"));
                            return;
                        }
                        Err(err) => {
                            self.reject(400, err.to_string());
                            return;
                        }
                        Ok((used, done)) => {
                            self.inbuf.drain(..used.min(self.inbuf.len()));
                            if done {
                                let Phase::ReadingBody {
                                    request, exchange, ..
                                } = std::mem::replace(&mut self.phase, Phase::ReadingHead)
                                else {
                                    return;
                                };
                                self.dispatch(request, exchange);
                            } else if self.peer_eof {
                                self.begin_close();
                            }
                            return;
                        }
                    }
                }
                _ => return,
            }
        }
    }

    /// A head arrived: check it and set up its body. Returns whether to keep parsing (only
    /// when the body is still to come and the phase is now `ReadingBody`).
    fn start_body(&mut self, head: RequestHead) -> bool {
        let kind = match head::request_body_kind(&head) {
            Ok(kind) => kind,
            Err(HeadError::BadTransferEncoding) => {
                // A coding we cannot undo is 501 (RFC 9112 §6.1); the smuggling shapes
                // (with Content-Length, or on HTTP/1.0) are malformed requests.
                let smuggling = head.minor_version == 0 || head.header("content-length").is_some();
                if smuggling {
                    self.reject(
                        400,
                        "transfer-encoding with content-length or on http/1.0".into(),
                    );
                } else {
                    self.reject(501, "unsupported transfer-encoding".to_owned());
                }
                return false;
            }
            Err(err) => {
                self.reject(400, err.to_string());
                return false;
            }
        };
        let max_body = self.limits.max_body;
        if let BodyKind::ContentLength(n) = kind
            && n > max_body
        {
            self.reject(413, format!("request body larger than {max_body} bytes"));
            return false;
        }
        let exchange = Exchange {
            keep_alive: head.keep_alive(),
            is_head: head.method == "HEAD",
            http10: head.minor_version == 0,
        };
        let expects_continue = match head.header("expect") {
            None => false,
            Some(value) if value.trim().eq_ignore_ascii_case("100-continue") => true,
            Some(_) => {
                self.reject(417, "unsupported expectation".to_owned());
                return false;
            }
        };
        let request = match request_from_head(head) {
            Ok(request) => request,
            Err(message) => {
                self.reject(400, message);
                return false;
            }
        };
        let has_body = !matches!(kind, BodyKind::None | BodyKind::ContentLength(0));
        if self.admission {
            self.phase = Phase::Admitting {
                exchange,
                body: has_body.then_some((kind, expects_continue)),
            };
            self.head_ready = Some(request);
            return false;
        }
        if !has_body {
            self.dispatch(request, exchange);
            return false;
        }
        // RFC 9110 §10.1.1: an HTTP/1.0 client cannot read an interim response, and a
        // client that already started sending the body is not waiting for one.
        if expects_continue && !exchange.http10 && self.inbuf.is_empty() {
            self.outbuf.extend_from_slice(CONTINUE);
        }
        self.phase = Phase::ReadingBody {
            request,
            exchange,
            decoder: BodyDecoder::new(kind, max_body),
        };
        true
    }

    fn dispatch(&mut self, request: Request, exchange: Exchange) {
        self.phase = Phase::Dispatched { exchange };
        self.ready = Some(request);
    }

    fn reject_head_too_large(&mut self) {
        let max = self.limits.max_head;
        self.reject(431, format!("request head larger than {max} bytes"));
    }

    /// Answers a protocol error with a JSON body and ends the connection.
    fn reject(&mut self, status: u16, message: String) {
        let body = serde_json::json!({ "error": message }).to_string();
        let length = body.len().to_string();
        let framing = [
            ("Content-Type", "application/json"),
            ("Content-Length", length.as_str()),
        ];
        self.queue_head(status, &[], &framing, false, false);
        self.outbuf.extend_from_slice(body.as_bytes());
        self.inbuf = Vec::new();
        self.begin_close();
    }

    fn begin_close(&mut self) {
        self.head_started = None;
        self.phase = Phase::Closing {
            close_notify_sent: false,
        };
    }
}

/// Whether `Connection: close` is among the owner's fields.
fn asks_close(headers: &[(&str, &str)]) -> bool {
    headers.iter().any(|(name, value)| {
        name.eq_ignore_ascii_case("connection")
            && value
                .split(',')
                .any(|option| option.trim().eq_ignore_ascii_case("close"))
    })
}

/// Whether `buf` could begin a request: optional blank lines, then a method character.
fn plausible_request_start(buf: &[u8]) -> bool {
    match buf.iter().find(|&&b| b != b'\r' && b != b'\n') {
        None => true,
        Some(&b) => b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b),
    }
}

fn head_error_status(err: &HeadError) -> u16 {
    match err {
        HeadError::TooLarge | HeadError::TooManyHeaders => 431,
        HeadError::UnsupportedVersion => 505,
        _ => 400,
    }
}

/// The parts of a request the owner routes on, checked: one Host field (RFC 9112 §3.2), a
/// target in origin, absolute or asterisk form, and valid percent-encoding.
fn request_from_head(head: RequestHead) -> Result<Request, String> {
    let n_hosts = head
        .headers
        .iter()
        .filter(|(name, _)| name.eq_ignore_ascii_case("host"))
        .count();
    if head.minor_version >= 1 && n_hosts == 0 {
        return Err("missing host header".to_owned());
    }
    if n_hosts > 1 {
        return Err("more than one host header".to_owned());
    }
    let (path, query) = split_target(&head.method, &head.target)?;
    let keep_alive = head.keep_alive();
    Ok(Request {
        method: head.method,
        target: head.target,
        path,
        query,
        headers: head.headers,
        body: Vec::new(),
        keep_alive,
    })
}

type Query = Vec<(String, String)>;

/// Decodes a request target into its path and query.
fn split_target(method: &str, target: &str) -> Result<(String, Query), String> {
    const BAD_TARGET: &str = "malformed request target";
    if target == "*" {
        return if method == "OPTIONS" {
            Ok(("*".to_owned(), Vec::new()))
        } else {
            Err(BAD_TARGET.to_owned())
        };
    }
    let origin = if target.starts_with('/') {
        target
    } else {
        // Absolute form (RFC 9112 §3.2.2), which proxies send: keep what follows the
        // authority.
        let scheme_len = ["http://", "https://"]
            .iter()
            .find(|scheme| {
                target
                    .get(..scheme.len())
                    .is_some_and(|prefix| prefix.eq_ignore_ascii_case(scheme))
            })
            .map(|scheme| scheme.len())
            .ok_or_else(|| BAD_TARGET.to_owned())?;
        let rest = target.get(scheme_len..).unwrap_or("");
        rest.find(['/', '?', '#'])
            .and_then(|at| rest.get(at..))
            .unwrap_or("")
    };
    // A fragment is not part of a request target; tolerate and drop one.
    let origin = origin.split('#').next().unwrap_or(origin);
    let (raw_path, raw_query) = origin.split_once('?').unwrap_or((origin, ""));
    let raw_path = if raw_path.is_empty() { "/" } else { raw_path };
    let path = percent_decode(raw_path, false)
        .filter(|path| !path.contains('\0'))
        .ok_or_else(|| "malformed percent-encoding in path".to_owned())?;
    let mut query = Vec::new();
    for pair in raw_query.split('&').filter(|pair| !pair.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        let decoded = percent_decode(key, true).zip(percent_decode(value, true));
        let (key, value) =
            decoded.ok_or_else(|| "malformed percent-encoding in query".to_owned())?;
        query.push((key, value));
    }
    Ok((path, query))
}

/// `%XX` escapes (and `+` as a space in a query) to UTF-8 text; `None` for a bad escape or
/// bytes that are not UTF-8.
fn percent_decode(text: &str, plus_is_space: bool) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut at = 0;
    while let Some(&b) = bytes.get(at) {
        match b {
            b'%' => {
                let hi = hex_value(*bytes.get(at + 1)?)?;
                let lo = hex_value(*bytes.get(at + 2)?)?;
                out.push(hi << 4 | lo);
                at += 3;
            }
            b'+' if plus_is_space => {
                out.push(b' ');
                at += 1;
            }
            _ => {
                out.push(b);
                at += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

fn hex_value(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// An IMF-fixdate (RFC 9110 §5.6.7), e.g. `Sun, 06 Nov 1994 08:49:37 GMT`.
pub fn http_date(time: SystemTime) -> String {
    const DAYS: [&str; 7] = ["Thu", "Fri", "Sat", "Sun", "Mon", "Tue", "Wed"];
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    let t = crate::clock::Utc::from_unix_secs(crate::clock::millis_since_epoch(time) / 1000);
    let weekday = DAYS
        .get(t.weekday_from_thursday as usize)
        .copied()
        .unwrap_or("Thu");
    let month_name = MONTHS.get((t.month - 1) as usize).copied().unwrap_or("Jan");
    format!(
        "{weekday}, {:02} {month_name} {} {:02}:{:02}:{:02} GMT",
        t.day, t.year, t.hour, t.minute, t.second
    )
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::{Shutdown, TcpListener as StdListener, TcpStream as StdStream};
    use std::path::PathBuf;

    use mio::{Events, Interest, Poll, Token};

    use super::*;
    use crate::http::head::{ResponseHead, parse_response_head, response_body_kind};
    use crate::http::testutil::noise;

    const TOKEN: Token = Token(7);
    /// Every wait in these tests ends by this; a hang is a failure, not a stuck run.
    const WAIT: Duration = Duration::from_secs(10);

    struct Server {
        poll: Poll,
        events: Events,
        conn: Connection,
        closed: bool,
    }

    fn setup(tls: Option<Arc<rustls::ServerConfig>>, limits: Limits) -> (Server, StdStream) {
        let listener = StdListener::bind("127.0.0.1:0").expect("bind loopback");
        let client =
            StdStream::connect(listener.local_addr().expect("local addr")).expect("connect");
        client.set_read_timeout(Some(WAIT)).expect("read timeout");
        client.set_nodelay(true).expect("nodelay");
        let (accepted, peer) = listener.accept().expect("accept");
        accepted.set_nonblocking(true).expect("nonblocking");
        let mut conn =
            Connection::new(TcpStream::from_std(accepted), peer, tls, limits).expect("connection");
        let poll = Poll::new().expect("poll");
        poll.registry()
            .register(conn.tcp(), TOKEN, Interest::READABLE | Interest::WRITABLE)
            .expect("register");
        let server = Server {
            poll,
            events: Events::with_capacity(16),
            conn,
            closed: false,
        };
        (server, client)
    }

    fn plain() -> (Server, StdStream) {
        setup(None, Limits::default())
    }

    impl Server {
        /// One poll (up to `wait`); `on_ready` when the socket had readiness.
        fn turn(&mut self, wait: Duration) -> Vec<ConnEvent> {
            self.poll.poll(&mut self.events, Some(wait)).expect("poll");
            if self.events.is_empty() {
                return Vec::new();
            }
            let events = self.conn.on_ready();
            if events.contains(&ConnEvent::Closed) {
                self.closed = true;
            }
            events
        }

        /// Answers requests with `handler` (then any pipelined ones) until `n` were handled
        /// or the connection closed; returns them in order.
        fn serve(
            &mut self,
            n: usize,
            mut handler: impl FnMut(&mut Connection, &Request),
        ) -> Vec<Request> {
            let deadline = Instant::now() + WAIT;
            let mut handled = Vec::new();
            while handled.len() < n && !self.closed {
                assert!(Instant::now() < deadline, "timed out after {handled:?}");
                for event in self.turn(Duration::from_millis(20)) {
                    if let ConnEvent::Request(request) = event {
                        handler(&mut self.conn, &request);
                        handled.push(request);
                        while let Some(request) = self.conn.next_request() {
                            handler(&mut self.conn, &request);
                            handled.push(request);
                        }
                    }
                }
                self.closed |= self.conn.is_closed();
            }
            handled
        }

        /// Until our side is shut down (the response is all out and FIN sent); the
        /// connection then lingers until the client closes.
        fn run_until_shut(&mut self) {
            let deadline = Instant::now() + WAIT;
            while !matches!(self.conn.phase, Phase::Lingering { .. } | Phase::Closed) {
                assert!(Instant::now() < deadline, "connection never shut down");
                for event in self.turn(Duration::from_millis(20)) {
                    assert!(
                        !matches!(event, ConnEvent::Request(_)),
                        "unexpected {event:?}"
                    );
                }
            }
        }

        fn run_until_closed(&mut self) {
            let deadline = Instant::now() + WAIT;
            while !self.closed {
                assert!(Instant::now() < deadline, "connection never closed");
                for event in self.turn(Duration::from_millis(20)) {
                    assert!(
                        !matches!(event, ConnEvent::Request(_)),
                        "unexpected {event:?}"
                    );
                }
                self.closed |= self.conn.is_closed();
            }
        }
    }

    /// Echoes `METHOD path` and the body.
    fn echo(conn: &mut Connection, request: &Request) {
        let mut body = format!("{} {}", request.method, request.path).into_bytes();
        if !request.body.is_empty() {
            body.push(b' ');
            body.extend_from_slice(&request.body);
        }
        conn.respond(200, &[("Content-Type", "text/plain")], &body);
    }

    /// Reads one response (skipping none: 1xx heads are returned too) from `client`,
    /// keeping bytes after it in `buf`.
    fn read_response(
        client: &mut impl Read,
        buf: &mut Vec<u8>,
        request_was_head: bool,
    ) -> (ResponseHead, Vec<u8>) {
        let mut chunk = [0u8; 64 * 1024];
        let (head, used) = loop {
            match parse_response_head(buf).expect("valid response head") {
                Parsed::Complete(head, used) => break (head, used),
                Parsed::Partial => {}
            }
            let n = client.read(&mut chunk).expect("read response head");
            assert!(n > 0, "eof before a response head; got {:?}", lossy(buf));
            buf.extend_from_slice(&chunk[..n]);
        };
        buf.drain(..used);
        if head.is_interim() {
            return (head, Vec::new());
        }
        let kind = response_body_kind(&head, request_was_head).expect("framing");
        let mut decoder = BodyDecoder::new(kind, u64::MAX);
        let mut body = Vec::new();
        loop {
            let (used, done) = decoder.decode(buf, &mut body).expect("valid body");
            buf.drain(..used);
            if done {
                return (head, body);
            }
            let n = client.read(&mut chunk).expect("read response body");
            if n == 0 {
                decoder.finish_eof().expect("complete body at eof");
                return (head, body);
            }
            buf.extend_from_slice(&chunk[..n]);
        }
    }

    /// Everything until the server closes.
    fn read_to_end(client: &mut StdStream) -> Vec<u8> {
        let mut all = Vec::new();
        client.read_to_end(&mut all).expect("read to eof");
        all
    }

    fn lossy(bytes: &[u8]) -> String {
        String::from_utf8_lossy(bytes).into_owned()
    }

    /// The wire text with the Date field's value blanked, so it can be compared exactly.
    fn without_date(bytes: &[u8]) -> String {
        lossy(bytes)
            .split("\r\n")
            .map(|line| match line.strip_prefix("Date: ") {
                Some(date) => {
                    assert_eq!(date.len(), 29, "imf-fixdate length: {date}");
                    "Date: *"
                }
                None => line,
            })
            .collect::<Vec<_>>()
            .join("\r\n")
    }

    fn error_of(body: &[u8]) -> String {
        let value: serde_json::Value = serde_json::from_slice(body).expect("json error body");
        value["error"].as_str().expect("error string").to_owned()
    }

    /// Sends `msg`, expects one error response with `status` and then the close.
    fn expect_rejection(limits: Limits, msg: &[u8], status: u16) -> String {
        let (mut server, mut client) = setup(None, limits);
        client.write_all(msg).expect("write");
        server.run_until_shut();
        let mut buf = read_to_end(&mut client);
        drop(client);
        server.run_until_closed();
        let (head, body) = read_response(&mut &b""[..], &mut buf, false);
        assert_eq!(head.status, status, "{}", lossy(&body));
        assert_eq!(head.header("content-type"), Some("application/json"));
        assert_eq!(head.header("connection"), Some("close"));
        assert!(buf.is_empty(), "bytes after the error: {}", lossy(&buf));
        error_of(&body)
    }

    #[test]
    fn simple_get_exact_wire() {
        let (mut server, mut client) = plain();
        client
            .write_all(b"GET /hello?x=1 HTTP/1.1\r\nHost: localhost\r\n\r\n")
            .unwrap();
        let handled = server.serve(1, echo);
        assert_eq!(handled[0].method, "GET");
        assert_eq!(handled[0].target, "/hello?x=1");
        assert_eq!(handled[0].query_param("x"), Some("1"));
        assert_eq!(handled[0].header("HOST"), Some("localhost"));
        assert!(handled[0].keep_alive);
        let mut buf = Vec::new();
        let mut chunk = [0u8; 1024];
        while parse_response_head(&buf) == Ok(Parsed::Partial) || !buf.ends_with(b"/hello") {
            let n = client.read(&mut chunk).unwrap();
            assert!(n > 0);
            buf.extend_from_slice(&chunk[..n]);
        }
        assert_eq!(
            without_date(&buf),
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 10\r\n\
             Date: *\r\n\r\nGET /hello"
        );
        assert!(!server.conn.is_closed());
        assert_eq!(server.conn.out_buffered(), 0);
    }

    #[test]
    fn post_with_body() {
        let (mut server, mut client) = plain();
        client
            .write_all(
                b"POST /runs HTTP/1.1\r\nHost: h\r\nContent-Length: 11\r\n\r\n{\"a\":\"bcd\"}",
            )
            .unwrap();
        let handled = server.serve(1, echo);
        assert_eq!(handled[0].body, b"{\"a\":\"bcd\"}");
        let (head, body) = read_response(&mut client, &mut Vec::new(), false);
        assert_eq!(head.status, 200);
        assert_eq!(body, b"POST /runs {\"a\":\"bcd\"}");
    }

    #[test]
    fn keep_alive_two_requests() {
        let (mut server, mut client) = plain();
        let mut buf = Vec::new();
        for path in ["/one", "/two"] {
            write!(client, "GET {path} HTTP/1.1\r\nHost: h\r\n\r\n").unwrap();
            server.serve(1, echo);
            let (head, body) = read_response(&mut client, &mut buf, false);
            assert_eq!(head.header("connection"), None);
            assert_eq!(body, format!("GET {path}").as_bytes());
        }
        assert!(!server.conn.is_closed());
        client.shutdown(Shutdown::Write).unwrap();
        server.run_until_closed();
    }

    #[test]
    fn pipelined_requests_are_yielded_one_at_a_time_in_order() {
        let (mut server, mut client) = plain();
        client
            .write_all(
                b"GET /a HTTP/1.1\r\nHost: h\r\n\r\n\
                  POST /b HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\n\r\nxyz\
                  GET /c HTTP/1.1\r\nHost: h\r\n\r\n",
            )
            .unwrap();
        // The owner defers its answer: nothing else may come out meanwhile.
        let mut first = Vec::new();
        let deadline = Instant::now() + WAIT;
        while first.is_empty() {
            assert!(Instant::now() < deadline);
            first = server.turn(Duration::from_millis(20));
        }
        assert_eq!(first.len(), 1, "{first:?}");
        let Some(ConnEvent::Request(a)) = first.pop() else {
            panic!("expected a request")
        };
        assert_eq!(a.path, "/a");
        assert!(server.conn.awaiting_response());
        assert_eq!(server.conn.next_request(), None);
        assert!(server.turn(Duration::from_millis(50)).is_empty());
        echo(&mut server.conn, &a);
        let b = server.conn.next_request().expect("second request buffered");
        assert_eq!((b.path.as_str(), b.body.as_slice()), ("/b", &b"xyz"[..]));
        assert_eq!(
            server.conn.next_request(),
            None,
            "third waits for the second"
        );
        echo(&mut server.conn, &b);
        let c = server.conn.next_request().expect("third request buffered");
        echo(&mut server.conn, &c);
        assert_eq!(server.conn.next_request(), None);
        let mut buf = Vec::new();
        for expected in ["GET /a", "POST /b xyz", "GET /c"] {
            let (_, body) = read_response(&mut client, &mut buf, false);
            assert_eq!(lossy(&body), expected);
        }
    }

    #[test]
    fn request_split_byte_by_byte() {
        let (mut server, mut client) = plain();
        let msg = b"POST /split%20path?q=a+b&r=%41 HTTP/1.1\r\nHost: h\r\n\
                    Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;ext=1\r\nde\r\n0\r\nX-T: 1\r\n\r\n";
        let mut got = None;
        for (at, byte) in msg.iter().enumerate() {
            client.write_all(&[*byte]).unwrap();
            for event in server.turn(Duration::from_millis(500)) {
                if let ConnEvent::Request(request) = event {
                    assert_eq!(at, msg.len() - 1, "request complete early");
                    got = Some(request);
                }
            }
        }
        let request = got.expect("request after the last byte");
        assert_eq!(request.path, "/split path");
        assert_eq!(
            request.query,
            vec![("q".into(), "a b".into()), ("r".into(), "A".into())]
        );
        assert_eq!(request.body, b"abcde");
        echo(&mut server.conn, &request);
        let (_, body) = read_response(&mut client, &mut Vec::new(), false);
        assert_eq!(body, b"POST /split path abcde");
    }

    #[test]
    fn head_clock_runs_from_a_heads_first_byte_until_it_is_complete() {
        let (mut server, mut client) = plain();
        let turn_until = |server: &mut Server, done: &dyn Fn(&Server) -> bool| {
            let deadline = Instant::now() + WAIT;
            while !done(server) {
                assert!(Instant::now() < deadline, "timed out");
                server.turn(Duration::from_millis(20));
            }
        };
        assert_eq!(
            server.conn.head_started(),
            None,
            "a fresh connection is not on it"
        );
        client.write_all(b"GET /a HTTP/1.1\r\n").unwrap();
        turn_until(&mut server, &|s| s.conn.head_started().is_some());
        let started = server.conn.head_started();
        // More bytes of the same head do not move it (they do move `last_activity`).
        client.write_all(b"Host: h\r\n").unwrap();
        let before = server.conn.last_activity();
        turn_until(&mut server, &|s| s.conn.last_activity() > before);
        assert_eq!(server.conn.head_started(), started);
        client.write_all(b"\r\n").unwrap();
        let handled = server.serve(1, echo);
        assert_eq!(handled.len(), 1);
        assert_eq!(server.conn.head_started(), None, "complete: off the clock");
        read_response(&mut client, &mut Vec::new(), false);
        // Between requests a keep-alive connection waits off the clock.
        assert_eq!(server.conn.head_started(), None);
    }

    #[test]
    fn chunked_request_body() {
        let (mut server, mut client) = plain();
        client
            .write_all(
                b"PUT /x HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n\
                  5\r\nhello\r\n6\r\n world\r\n0\r\n\r\nGET /y HTTP/1.1\r\nHost: h\r\n\r\n",
            )
            .unwrap();
        let handled = server.serve(2, echo);
        assert_eq!(handled[0].body, b"hello world");
        assert_eq!(handled[1].path, "/y");
    }

    #[test]
    fn malformed_requests_get_400_and_close() {
        let cases: &[&[u8]] = &[
            b"GET / HTTP/1.1\r\nHost: h\r\nBad Header\r\n\r\n",
            b"GET  / HTTP/1.1\r\nHost: h\r\n\r\n",
            b"GET / HTTP/1.1\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
            b"GET relative HTTP/1.1\r\nHost: h\r\n\r\n",
            b"GET /%zz HTTP/1.1\r\nHost: h\r\n\r\n",
            b"GET /%00 HTTP/1.1\r\nHost: h\r\n\r\n",
            b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 1, 2\r\n\r\n",
            b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            // A TLS ClientHello on the plain port is refused at once.
            b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",
        ];
        for msg in cases {
            let error = expect_rejection(Limits::default(), msg, 400);
            assert!(!error.is_empty(), "{}", lossy(msg));
        }
        let error = expect_rejection(Limits::default(), b"GET / HTTP/1.1\r\n\r\n", 400);
        assert_eq!(error, "missing host header");
    }

    #[test]
    fn version_and_expectation_errors() {
        expect_rejection(Limits::default(), b"GET / HTTP/2.0\r\nHost: h\r\n\r\n", 505);
        let error = expect_rejection(
            Limits::default(),
            b"POST / HTTP/1.1\r\nHost: h\r\nExpect: teapot\r\nContent-Length: 1\r\n\r\nx",
            417,
        );
        assert_eq!(error, "unsupported expectation");
    }

    #[test]
    fn oversized_head_gets_431() {
        let limits = Limits {
            max_head: 1024,
            ..Limits::default()
        };
        let mut big = b"GET / HTTP/1.1\r\nHost: h\r\nX-Big: ".to_vec();
        big.extend(std::iter::repeat_n(b'a', 2000));
        // Without the blank line: refused once the cap is reached, not at some later line.
        let error = expect_rejection(limits.clone(), &big, 431);
        assert_eq!(error, "request head larger than 1024 bytes");
        big.extend_from_slice(b"\r\n\r\n");
        expect_rejection(limits.clone(), &big, 431);
        let mut many = b"GET / HTTP/1.1\r\nHost: h\r\n".to_vec();
        for i in 0..300 {
            many.extend_from_slice(format!("X-{i}: 1\r\n").as_bytes());
        }
        many.extend_from_slice(b"\r\n");
        expect_rejection(Limits::default(), &many, 431);
    }

    #[test]
    fn oversized_body_gets_413_before_it_is_read() {
        let limits = Limits {
            max_body: 100,
            ..Limits::default()
        };
        let error = expect_rejection(
            limits.clone(),
            b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 101\r\n\r\n",
            413,
        );
        assert_eq!(error, "request body larger than 100 bytes");
        // Chunked: refused when the chunk that crosses the cap is announced (0x50 = 80
        // bytes fits, the second 80 does not), before its data is read.
        let mut msg =
            b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n50\r\n".to_vec();
        msg.extend([b'a'; 80]);
        msg.extend_from_slice(b"\r\n50\r\n");
        expect_rejection(limits.clone(), &msg, 413);
        // With 100-continue, no Continue goes out for a body we will refuse.
        let (mut server, mut client) = setup(None, limits);
        client
            .write_all(
                b"POST / HTTP/1.1\r\nHost: h\r\nExpect: 100-continue\r\n\
                  Content-Length: 5000\r\n\r\n",
            )
            .unwrap();
        server.run_until_shut();
        let all = read_to_end(&mut client);
        assert!(all.starts_with(b"HTTP/1.1 413 "), "{}", lossy(&all));
        drop(client);
        server.run_until_closed();
    }

    #[test]
    fn large_upload_refused_mid_send_still_gets_its_413() {
        // The client keeps uploading after our 413; lingering reads keep the kernel from
        // resetting the connection under the response.
        let limits = Limits {
            max_body: 1000,
            ..Limits::default()
        };
        let (mut server, mut client) = setup(None, limits);
        let mut writer = client.try_clone().unwrap();
        let uploader = std::thread::spawn(move || {
            let _ = writer
                .write_all(b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n");
            for _ in 0..16 {
                if writer.write_all(b"1000\r\n").is_err()
                    || writer.write_all(&[b'u'; 0x1000]).is_err()
                    || writer.write_all(b"\r\n").is_err()
                {
                    break;
                }
            }
            let _ = writer.shutdown(Shutdown::Write);
        });
        server.run_until_closed();
        let (head, body) = read_response(&mut client, &mut Vec::new(), false);
        assert_eq!(head.status, 413, "{}", lossy(&body));
        uploader.join().unwrap();
    }

    #[test]
    fn unsupported_transfer_encoding_gets_501() {
        let error = expect_rejection(
            Limits::default(),
            b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
            501,
        );
        assert_eq!(error, "unsupported transfer-encoding");
    }

    #[test]
    fn expect_100_continue_before_the_body() {
        let (mut server, mut client) = plain();
        client
            .write_all(
                b"POST /up HTTP/1.1\r\nHost: h\r\nExpect: 100-continue\r\nContent-Length: 4\r\n\r\n",
            )
            .unwrap();
        let events = server.turn(WAIT);
        assert!(events.is_empty(), "{events:?}");
        let mut buf = Vec::new();
        let (interim, _) = read_response(&mut client, &mut buf, false);
        assert_eq!(interim.status, 100);
        assert!(buf.is_empty());
        client.write_all(b"data").unwrap();
        let handled = server.serve(1, echo);
        assert_eq!(handled[0].body, b"data");
        let (head, body) = read_response(&mut client, &mut buf, false);
        assert_eq!((head.status, body.as_slice()), (200, &b"POST /up data"[..]));
    }

    /// Turns until the connection yields a head for admission.
    fn next_head(server: &mut Server) -> Request {
        let deadline = Instant::now() + WAIT;
        loop {
            assert!(Instant::now() < deadline, "no head for admission");
            if let Some(event) = server.turn(Duration::from_millis(20)).into_iter().next() {
                match event {
                    ConnEvent::Head(head) => return head,
                    other => panic!("unexpected {other:?} before the head"),
                }
            }
        }
    }

    #[test]
    fn a_head_refused_at_admission_gets_its_answer_without_its_body() {
        let (mut server, mut client) = plain();
        server.conn.require_admission();
        client
            .write_all(
                b"POST /runs HTTP/1.1\r\nHost: h\r\nExpect: 100-continue\r\n\
                  Content-Length: 100000\r\n\r\n",
            )
            .unwrap();
        let head = next_head(&mut server);
        assert_eq!(
            (head.method.as_str(), head.path.as_str()),
            ("POST", "/runs")
        );
        assert!(head.body.is_empty());
        server
            .conn
            .respond(401, &[("WWW-Authenticate", "Bearer")], b"unauthorized");
        server.run_until_shut();
        // No `100 Continue` asked for a body nobody will read; the connection ends.
        let all = read_to_end(&mut client);
        assert!(all.starts_with(b"HTTP/1.1 401 "), "{}", lossy(&all));
        assert!(lossy(&all).contains("Connection: close"), "{}", lossy(&all));
        assert!(all.ends_with(b"unauthorized"), "{}", lossy(&all));
        drop(client);
        server.run_until_closed();
    }

    #[test]
    fn an_admitted_head_goes_on_to_its_body_and_its_request() {
        let (mut server, mut client) = plain();
        server.conn.require_admission();
        client
            .write_all(
                b"POST /up HTTP/1.1\r\nHost: h\r\nExpect: 100-continue\r\nContent-Length: 4\r\n\r\n",
            )
            .unwrap();
        let head = next_head(&mut server);
        server.conn.admit(head);
        // Only now is the body asked for.
        let mut buf = Vec::new();
        let (interim, _) = read_response(&mut client, &mut buf, false);
        assert_eq!(interim.status, 100);
        client.write_all(b"data").unwrap();
        let handled = server.serve(1, echo);
        assert_eq!(handled[0].body, b"data");
        let (head, body) = read_response(&mut client, &mut buf, false);
        assert_eq!((head.status, body.as_slice()), (200, &b"POST /up data"[..]));

        // A request without a body: admitted, it is the request; refused, the connection
        // stays open for the next one.
        client
            .write_all(b"GET /a HTTP/1.1\r\nHost: h\r\n\r\nGET /b HTTP/1.1\r\nHost: h\r\n\r\n")
            .unwrap();
        let head = next_head(&mut server);
        assert_eq!(head.path, "/a");
        server.conn.respond(403, &[], b"no");
        let (refused, body) = read_response(&mut client, &mut buf, false);
        assert_eq!((refused.status, body.as_slice()), (403, &b"no"[..]));
        let head = server.conn.next_head().expect("the pipelined head");
        assert_eq!(head.path, "/b");
        server.conn.admit(head);
        let request = server.conn.next_request().expect("the admitted request");
        assert_eq!(request.path, "/b");
        echo(&mut server.conn, &request);
        let (head, body) = read_response(&mut client, &mut buf, false);
        assert_eq!((head.status, body.as_slice()), (200, &b"GET /b"[..]));
        assert!(!server.conn.is_closed());
    }

    #[test]
    fn streaming_response_in_chunks() {
        let (mut server, mut client) = plain();
        client
            .write_all(b"GET /s HTTP/1.1\r\nHost: h\r\n\r\nGET /after HTTP/1.1\r\nHost: h\r\n\r\n")
            .unwrap();
        let handled = server.serve(1, |conn, _| {
            conn.start_stream(200, &[("Content-Type", "application/x-ndjson")]);
            assert!(conn.is_streaming());
            assert!(conn.wants_more_stream());
            conn.stream_chunk(b"{\"n\":1}\n");
            conn.stream_chunk(b"");
            conn.stream_chunk(b"{\"n\":2}\n");
            conn.stream_chunk(b"{\"n\":3}\n");
        });
        assert_eq!(handled.len(), 1);
        assert_eq!(server.conn.next_request(), None, "stream still open");
        server.conn.end_stream();
        assert!(!server.conn.is_streaming());
        let after = server
            .conn
            .next_request()
            .expect("pipelined request after the stream");
        echo(&mut server.conn, &after);
        let mut expected = b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\n\
                    Transfer-Encoding: chunked\r\nDate: *\r\n\r\n\
                    8\r\n{\"n\":1}\n\r\n8\r\n{\"n\":2}\n\r\n8\r\n{\"n\":3}\n\r\n0\r\n\r\n"
            .to_vec();
        expected.extend_from_slice(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 10\r\n\
              Date: *\r\n\r\nGET /after",
        );
        let mut got = Vec::new();
        let mut chunk = [0u8; 4096];
        while without_date(&got).len() < expected.len() {
            let n = client.read(&mut chunk).unwrap();
            assert!(n > 0);
            got.extend_from_slice(&chunk[..n]);
        }
        assert_eq!(without_date(&got), lossy(&expected));
    }

    #[test]
    fn slow_stream_reader_is_paced_by_the_out_buffer() {
        let limits = Limits {
            max_out_buffer: 64 * 1024,
            ..Limits::default()
        };
        let (mut server, mut client) = setup(None, limits);
        client
            .write_all(b"GET /s HTTP/1.1\r\nHost: h\r\n\r\nGET /next HTTP/1.1\r\nHost: h\r\n\r\n")
            .unwrap();
        server.serve(1, |conn, _| conn.start_stream(200, &[]));
        // The client reads nothing: queue while allowed; the kernel fills, then our buffer.
        const PIECE: usize = 16 * 1024;
        const TOTAL: usize = 64 * 1024 * 1024;
        let mut sent = 0;
        while server.conn.wants_more_stream() && sent < TOTAL {
            server.conn.stream_chunk(&[b's'; PIECE]);
            sent += PIECE;
        }
        assert!(
            sent < TOTAL,
            "the kernel took {sent} bytes without a reader"
        );
        let buffered = server.conn.out_buffered();
        assert!(
            (32 * 1024..32 * 1024 + PIECE + 32).contains(&buffered),
            "{buffered}"
        );
        // Nothing more comes out of the socket meanwhile: no second request, no growth.
        for _ in 0..5 {
            let events = server.turn(Duration::from_millis(10));
            assert!(
                !events.iter().any(|e| matches!(e, ConnEvent::Request(_))),
                "{events:?}"
            );
        }
        assert!(server.conn.inbuf.len() <= server.conn.in_cap());
        assert_eq!(server.conn.out_buffered(), buffered);
        // Now the client reads; each Writable lets the stream go on until it is done.
        let reader = std::thread::spawn(move || {
            let mut buf = Vec::new();
            let (_, body) = read_response(&mut client, &mut buf, false);
            let (_, next) = read_response(&mut client, &mut buf, false);
            (body.len(), next)
        });
        let deadline = Instant::now() + WAIT;
        let mut writables = 0;
        while server.conn.is_streaming() {
            assert!(Instant::now() < deadline, "stream stalled at {sent}");
            for event in server.turn(Duration::from_millis(20)) {
                match event {
                    ConnEvent::Writable => writables += 1,
                    ConnEvent::Request(r) => panic!("request {r:?} during the stream"),
                    _ => {}
                }
            }
            while server.conn.wants_more_stream() && sent < TOTAL {
                server.conn.stream_chunk(&[b's'; PIECE]);
                sent += PIECE;
            }
            if sent >= TOTAL {
                server.conn.end_stream();
            }
        }
        assert!(writables > 0);
        let next = server
            .conn
            .next_request()
            .expect("second request after the stream");
        echo(&mut server.conn, &next);
        // The stream's tail may still be queued ahead of that answer: keep the loop turning
        // until the socket has taken all of it, as the server's owner would.
        while server.conn.out_buffered() > 0 {
            assert!(Instant::now() < deadline, "answer stuck behind the stream");
            server.turn(Duration::from_millis(20));
        }
        let (n_body, next_body) = reader.join().unwrap();
        assert_eq!(n_body, TOTAL);
        assert_eq!(next_body, b"GET /next");
    }

    #[test]
    fn client_that_never_reads_stops_getting_requests_served() {
        // Whole responses to pipelined requests: once output is over the cap, no further
        // request is parsed, so memory stays bounded however many are pipelined.
        const N: usize = 64;
        const BODY: usize = 1024 * 1024;
        let limits = Limits {
            max_out_buffer: 64 * 1024,
            max_head: 4096,
            ..Limits::default()
        };
        let (mut server, mut client) = setup(None, limits);
        let mut pipelined = Vec::new();
        for i in 0..N {
            let close = if i == N - 1 {
                "Connection: close\r\n"
            } else {
                ""
            };
            write!(pipelined, "GET /{i} HTTP/1.1\r\nHost: h\r\n{close}\r\n").unwrap();
        }
        client.write_all(&pipelined).unwrap();
        let body = vec![b'b'; BODY];
        let answer = |conn: &mut Connection, _: &Request| {
            conn.respond(200, &[("Date", "x")], &body);
        };
        let mut served = 0;
        let until = Instant::now() + Duration::from_millis(300);
        while Instant::now() < until {
            for event in server.turn(Duration::from_millis(20)) {
                if let ConnEvent::Request(request) = event {
                    answer(&mut server.conn, &request);
                    served += 1;
                    while let Some(request) = server.conn.next_request() {
                        answer(&mut server.conn, &request);
                        served += 1;
                    }
                }
            }
        }
        assert!(served < N, "served all {served} without a reader");
        assert!(server.conn.out_buffered() <= 64 * 1024 + BODY);
        assert!(server.conn.inbuf.len() <= 4096);
        let reader = std::thread::spawn(move || read_to_end(&mut client).len());
        let deadline = Instant::now() + WAIT;
        while !server.closed {
            assert!(Instant::now() < deadline, "served {served} of {N}");
            for event in server.turn(Duration::from_millis(20)) {
                match event {
                    ConnEvent::Request(request) => {
                        answer(&mut server.conn, &request);
                        served += 1;
                        while let Some(request) = server.conn.next_request() {
                            answer(&mut server.conn, &request);
                            served += 1;
                        }
                    }
                    ConnEvent::Closed => server.closed = true,
                    _ => {}
                }
            }
            server.closed |= server.conn.is_closed();
        }
        assert_eq!(served, N);
        let head_len = "HTTP/1.1 200 OK\r\nDate: x\r\nContent-Length: 1048576\r\n\r\n".len();
        let close_len = "Connection: close\r\n".len();
        assert_eq!(reader.join().unwrap(), N * (head_len + BODY) + close_len);
    }

    #[test]
    fn peer_close_mid_request_is_closed() {
        for partial in [
            &b"GET /x HTTP/1.1\r\nHo"[..],
            b"POST /x HTTP/1.1\r\nHost: h\r\nContent-Length: 10\r\n\r\nabc",
            b"",
        ] {
            let (mut server, mut client) = plain();
            client.write_all(partial).unwrap();
            drop(client);
            server.run_until_closed();
            assert!(server.conn.is_closed());
        }
    }

    #[test]
    fn half_closed_client_still_gets_answers() {
        let (mut server, mut client) = plain();
        client
            .write_all(b"GET /1 HTTP/1.1\r\nHost: h\r\n\r\nGET /2 HTTP/1.1\r\nHost: h\r\n\r\n")
            .unwrap();
        client.shutdown(Shutdown::Write).unwrap();
        let mut events = Vec::new();
        let deadline = Instant::now() + WAIT;
        while events.is_empty() {
            assert!(Instant::now() < deadline);
            events = server.turn(Duration::from_millis(20));
        }
        assert!(matches!(events[..], [ConnEvent::Request(_)]), "{events:?}");
        assert!(server.conn.peer_eof());
        server.conn.respond(204, &[], b"ignored");
        let second = server
            .conn
            .next_request()
            .expect("second pipelined request");
        echo(&mut server.conn, &second);
        assert!(server.conn.is_closed(), "closes once both are answered");
        let mut buf = read_to_end(&mut client);
        let (first, body) = read_response(&mut &b""[..], &mut buf, false);
        assert_eq!((first.status, first.header("content-length")), (204, None));
        assert!(body.is_empty());
        let (_, body) = read_response(&mut &b""[..], &mut buf, false);
        assert_eq!(body, b"GET /2");
    }

    #[test]
    fn http10_keep_alive_only_when_asked() {
        let (mut server, mut client) = plain();
        client.write_all(b"GET /old HTTP/1.0\r\n\r\n").unwrap();
        let handled = server.serve(1, echo);
        assert!(!handled[0].keep_alive);
        server.run_until_shut();
        let mut buf = read_to_end(&mut client);
        let (head, body) = read_response(&mut &b""[..], &mut buf, false);
        assert_eq!(head.header("connection"), Some("close"));
        assert_eq!(body, b"GET /old");

        let (mut server, mut client) = plain();
        let mut buf = Vec::new();
        for _ in 0..2 {
            client
                .write_all(b"GET /ka HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
                .unwrap();
            server.serve(1, echo);
            let (head, _) = read_response(&mut client, &mut buf, false);
            assert_eq!(head.header("connection"), Some("keep-alive"));
        }
        assert!(!server.conn.is_closed());

        // A stream to HTTP/1.0 is delimited by the close, not chunked.
        let (mut server, mut client) = plain();
        client
            .write_all(b"GET /s HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
            .unwrap();
        server.serve(1, |conn, _| {
            conn.start_stream(200, &[]);
            conn.stream_chunk(b"ab");
            conn.stream_chunk(b"cd");
            conn.end_stream();
        });
        server.run_until_shut();
        let mut buf = read_to_end(&mut client);
        let (head, body) = read_response(&mut &b""[..], &mut buf, false);
        assert_eq!(head.header("transfer-encoding"), None);
        assert_eq!(head.header("connection"), Some("close"));
        assert_eq!(body, b"abcd");
    }

    #[test]
    fn head_request_gets_length_but_no_body() {
        let (mut server, mut client) = plain();
        client
            .write_all(b"HEAD /h HTTP/1.1\r\nHost: h\r\n\r\nGET /g HTTP/1.1\r\nHost: h\r\n\r\n")
            .unwrap();
        server.serve(2, echo);
        let mut buf = Vec::new();
        let (head, body) = read_response(&mut client, &mut buf, true);
        assert_eq!(head.header("content-length"), Some("7"));
        assert!(body.is_empty());
        let (_, body) = read_response(&mut client, &mut buf, false);
        assert_eq!(body, b"GET /g");
    }

    #[test]
    fn owner_may_close_and_owned_fields_are_replaced() {
        let (mut server, mut client) = plain();
        client
            .write_all(b"GET / HTTP/1.1\r\nHost: h\r\n\r\nGET /never HTTP/1.1\r\nHost: h\r\n\r\n")
            .unwrap();
        let handled = server.serve(1, |conn, _| {
            conn.respond(
                503,
                &[
                    ("Content-Length", "999"),
                    ("Transfer-Encoding", "chunked"),
                    ("Connection", "close"),
                    ("Date", "Thu, 01 Jan 1970 00:00:00 GMT"),
                ],
                b"bye",
            );
        });
        assert_eq!(handled.len(), 1);
        assert_eq!(server.conn.next_request(), None);
        server.run_until_shut();
        let all = read_to_end(&mut client);
        drop(client);
        server.run_until_closed();
        assert_eq!(
            lossy(&all),
            "HTTP/1.1 503 Service Unavailable\r\nDate: Thu, 01 Jan 1970 00:00:00 GMT\r\n\
             Content-Length: 3\r\nConnection: close\r\n\r\nbye"
        );
    }

    #[test]
    fn misuse_is_ignored_not_a_panic() {
        let (mut server, _client) = plain();
        server.conn.respond(200, &[], b"nobody asked");
        server.conn.stream_chunk(b"x");
        server.conn.end_stream();
        server.conn.start_stream(200, &[]);
        assert_eq!(server.conn.out_buffered(), 0);
        server.conn.close();
        assert!(server.conn.is_closed());
        server.conn.close();
        assert_eq!(server.conn.on_ready(), vec![ConnEvent::Closed]);
        assert_eq!(server.conn.on_ready(), Vec::new());
    }

    #[test]
    fn noise_never_panics_and_always_ends() {
        let alphabet = b"GET POST HTTP/1.1\r\n: Host Content-Length Transfer-Encoding chunked 0123456789abcdef;%?&=/";
        for seed in 0..40u64 {
            let limits = Limits {
                max_head: 512,
                max_body: 256,
                ..Limits::default()
            };
            let (mut server, mut client) = setup(None, limits);
            let mut msg = b"POST / HTTP/1.1\r\nHost: h\r\n".to_vec();
            msg.extend(noise(seed, alphabet, 2048));
            client.write_all(&msg).unwrap();
            client.shutdown(Shutdown::Write).unwrap();
            let deadline = Instant::now() + WAIT;
            while !server.closed {
                assert!(Instant::now() < deadline, "seed {seed} never ended");
                for event in server.turn(Duration::from_millis(20)) {
                    if let ConnEvent::Request(request) = event {
                        echo(&mut server.conn, &request);
                        while let Some(request) = server.conn.next_request() {
                            echo(&mut server.conn, &request);
                        }
                    }
                }
                server.closed |= server.conn.is_closed();
            }
        }
    }

    fn fixture(name: &str) -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(name)
    }

    fn test_client_config() -> Arc<rustls::ClientConfig> {
        use rustls::pki_types::CertificateDer;
        use rustls::pki_types::pem::PemObject;
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_file_iter(fixture("ca.pem")).unwrap() {
            roots.add(cert.unwrap()).unwrap();
        }
        let mut config =
            rustls::ClientConfig::builder_with_provider(crate::transport::crypto_provider())
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_root_certificates(roots)
                .with_no_client_auth();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Arc::new(config)
    }

    #[test]
    fn get_over_tls() {
        let server_config =
            crate::transport::server_config(&fixture("server.pem"), &fixture("server-key.pem"))
                .expect("server config");
        let (mut server, client) = setup(Some(server_config), Limits::default());
        let exchange = std::thread::spawn(move || {
            let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
            let tls = rustls::ClientConnection::new(test_client_config(), name).unwrap();
            let mut stream = rustls::StreamOwned::new(tls, client);
            stream
                .write_all(b"GET /secure HTTP/1.1\r\nHost: localhost\r\n\r\n")
                .unwrap();
            let mut buf = Vec::new();
            let first = read_response(&mut stream, &mut buf, false);
            stream
                .write_all(b"POST /again HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Length: 2\r\n\r\nhi")
                .unwrap();
            let second = read_response(&mut stream, &mut buf, false);
            // close_notify then EOF: a clean end, nothing after the response.
            let mut rest = Vec::new();
            stream.read_to_end(&mut rest).expect("clean tls close");
            let alpn = stream.conn.alpn_protocol().map(<[u8]>::to_vec);
            (first, second, rest, alpn)
        });
        let handled = server.serve(2, echo);
        assert_eq!(handled.len(), 2);
        server.run_until_closed();
        let ((head, body), (_, second), rest, alpn) = exchange.join().unwrap();
        assert_eq!(head.status, 200);
        assert_eq!(body, b"GET /secure");
        assert_eq!(second, b"POST /again hi");
        assert!(rest.is_empty());
        assert_eq!(alpn.as_deref(), Some(&b"http/1.1"[..]));
    }

    #[test]
    fn plaintext_on_the_tls_port_is_closed() {
        let server_config =
            crate::transport::server_config(&fixture("server.pem"), &fixture("server-key.pem"))
                .unwrap();
        let (mut server, mut client) = setup(Some(server_config), Limits::default());
        client
            .write_all(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
            .unwrap();
        server.run_until_closed();
    }

    #[test]
    fn server_config_errors_name_the_file() {
        let missing = fixture("no-such.pem");
        let err =
            crate::transport::server_config(&missing, &fixture("server-key.pem")).unwrap_err();
        assert!(
            err.starts_with("tls certificate ") && err.contains("no-such.pem"),
            "{err}"
        );
        let err = crate::transport::server_config(&fixture("server.pem"), &missing).unwrap_err();
        assert!(
            err.starts_with("tls key ") && err.contains("no-such.pem"),
            "{err}"
        );
        // A certificate file given as the key: no key inside.
        let err = crate::transport::server_config(&fixture("server.pem"), &fixture("ca.pem"))
            .unwrap_err();
        assert!(err.contains("ca.pem"), "{err}");
        // The wrong key for the certificate.
        let err =
            crate::transport::server_config(&fixture("README.md"), &fixture("server-key.pem"))
                .unwrap_err();
        assert!(err.contains("no certificates found"), "{err}");
    }

    #[test]
    fn targets_paths_and_queries() {
        let ok = |method: &str, target: &str| split_target(method, target).unwrap();
        assert_eq!(ok("GET", "/"), ("/".into(), vec![]));
        assert_eq!(
            ok(
                "GET",
                "/runs/r%2F1/events?cursor=5&follow=1&flag&=v&&x=a%26b#frag"
            ),
            (
                "/runs/r/1/events".into(),
                vec![
                    ("cursor".into(), "5".into()),
                    ("follow".into(), "1".into()),
                    ("flag".into(), "".into()),
                    ("".into(), "v".into()),
                    ("x".into(), "a&b".into()),
                ]
            )
        );
        assert_eq!(ok("GET", "/a+b"), ("/a+b".into(), vec![]));
        assert_eq!(ok("GET", "/%C3%A9"), ("/é".into(), vec![]));
        assert_eq!(
            ok("GET", "http://example.com:80/x?y=1"),
            ("/x".into(), vec![("y".into(), "1".into())])
        );
        assert_eq!(ok("GET", "HTTPS://example.com"), ("/".into(), vec![]));
        assert_eq!(
            ok("GET", "http://h?q=1"),
            ("/".into(), vec![("q".into(), "1".into())])
        );
        assert_eq!(ok("OPTIONS", "*"), ("*".into(), vec![]));
        for bad in [
            "*", "x", "ftp://h/", "/%", "/%4", "/%g0", "/%ff", "/?a=%zz", "/%00",
        ] {
            assert!(split_target("GET", bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn request_accessors() {
        let request = Request {
            method: "GET".into(),
            target: "/?a=1&a=2".into(),
            path: "/".into(),
            query: vec![("a".into(), "1".into()), ("a".into(), "2".into())],
            headers: vec![("X-Token".into(), "t".into())],
            body: Vec::new(),
            keep_alive: true,
        };
        assert_eq!(request.header("x-token"), Some("t"));
        assert_eq!(request.header("x-other"), None);
        assert_eq!(request.query_param("a"), Some("1"));
        assert_eq!(request.query_param("A"), None);
    }

    #[test]
    fn imf_fixdate() {
        let at = |secs| http_date(SystemTime::UNIX_EPOCH + Duration::from_secs(secs));
        assert_eq!(at(784_111_777), "Sun, 06 Nov 1994 08:49:37 GMT");
        assert_eq!(at(0), "Thu, 01 Jan 1970 00:00:00 GMT");
        assert_eq!(at(951_782_400), "Tue, 29 Feb 2000 00:00:00 GMT");
        assert_eq!(at(4_102_444_799), "Thu, 31 Dec 2099 23:59:59 GMT");
    }

    #[test]
    fn limits_defaults() {
        let limits = Limits::default();
        assert_eq!(limits.max_head, 16 * 1024);
        assert_eq!(limits.max_body, 1024 * 1024);
        assert_eq!(limits.max_out_buffer, 1024 * 1024);
        assert_eq!(limits.idle_timeout, Duration::from_secs(60));
    }
}
