//! The networked agent's connections (`caliban agent serve`): one JSON message per line
//! both ways, over TLS on TCP or in the clear on a Unix socket, whose file mode (0600) is
//! its gate. On TCP the client's first line after the handshake must be the bearer
//! preamble `{"bearer":"<token>"}` (at most `MAX_PREAMBLE` bytes, compared in constant time
//! through `auth::Token`); a wrong, missing, slow or oversized preamble closes the
//! connection with nothing served. The preamble is the agent connection's head: it runs on
//! the front's head deadline (`HEAD_DEADLINE`, from accept, handshake included), and a
//! connection in it is *unadmitted* in the front's sense (its ADMISSION section), with the
//! front's one mechanism for those: at most `MAX_PENDING` connections wait in their
//! preamble, and past that a newcomer takes the place of the oldest, so peers that never
//! authenticate cannot hold the listener while a real client, which sends its preamble in
//! its first write, is never the oldest for long; and one remote address (an IPv6 /64) may
//! hold at most `MAX_PENDING_PER_PEER` of them, so a single peer cannot churn the oldest
//! out by itself. A connection on the Unix socket is admitted as it is accepted.
//!
//! `LineConn` is the connection: sans policy, it splits lines (each under its cap), queues
//! output and knows where its preamble is. The `Front<P, LineConn>` half at the bottom reads
//! connections, checks preambles (telling the shared half of each admission) and hands the
//! surface `LineEvent`s; accepting, the map, the caps and admission, socket options, the
//! idle timer, the head deadline and the write-stall deadline are the front's shared half.
//!
//! LIFECYCLE (`Phase`): `Preamble` (TCP only) → `Open` → `finish`: `Closing` (flush,
//! close_notify, shut down our side) → `Lingering` (discard what the peer still sends, so
//! the kernel does not answer it with a reset that could destroy the tail) → `Closed`.
//! `close`, a peer's EOF or an I/O error jump to `Closed`.
//!
//! Backpressure: nothing is read while `MAX_OUT_BUFFER` bytes wait to go out, so a peer that
//! sends but never reads its answers stops being read; a streaming surface paces itself with
//! `wants_more` and `LineEvent::Writable`; a queue past `MAX_QUEUED_OUT` means the peer reads
//! nothing at all, and the connection is closed, as it is once the peer has acknowledged
//! nothing for the front's `WRITE_STALL_DEADLINE` while output waited for it (a client that
//! comes back resumes). An unauthenticated peer costs at most its preamble cap plus one read.

use std::collections::VecDeque;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use mio::{Interest, Registry, Token as MioToken};
use serde_json::Value;

use super::{Caps, ConnId, Front, FrontKey, Keepalive, Wire, peer_key};
use crate::auth::Token;
use crate::http::server::LINGER_MAX_BYTES;
use crate::ids::HostKey;
use crate::log;
use crate::surface::host::Cx;
use crate::transport::{Conn, READ_BUDGET, ReadStatus};

/// The longest preamble line, newline excluded (upstream's cap): a token and its braces.
pub(crate) const MAX_PREAMBLE: usize = 4096;

/// The longest line after the preamble: the stdio surfaces' cap, so any message `acp serve`
/// takes on stdin fits here too. Longer lines are dropped whole (`LineEvent::Oversized`).
pub(crate) const MAX_LINE: usize = crate::stdio::MAX_LINE;

/// Connections still in their preamble (handshake included): the front's
/// `Caps::max_unadmitted`. Past this a newcomer takes the place of the oldest.
pub(crate) const MAX_PENDING: usize = 16;

/// Connections one remote address (an IPv6 /64) may hold in their preamble: the front's
/// `Caps::max_unadmitted_per_peer`; more are closed as soon as they are accepted. Below
/// `MAX_PENDING`, so one address alone never fills the preamble slots and cannot push a
/// client mid-handshake out by opening connections faster than it proves itself. Loopback
/// peers (a port-forward speaks for everyone from there) are not capped.
pub(crate) const MAX_PENDING_PER_PEER: usize = MAX_PENDING / 2;

/// How long a connection whose TLS handshake is done may not be displaced by a newcomer
/// (see the front's ADMISSION): a real client sends its preamble right after its
/// handshake, so without this a flood of connections arriving in that gap pushes it out.
/// A few seconds covers a slow client on a loaded machine; a flood's own handshaked
/// connections are displaceable again soon after, the address holding the most first.
pub(crate) const HANDSHAKED_GRACE: Duration = Duration::from_secs(3);

/// Open connections. The agent serves one client at a time; the rest is room for
/// `MAX_PENDING` peers proving themselves and for connections winding down.
pub(crate) const MAX_CONNECTIONS: usize = 32;

/// Queued output above which nothing more is read from the peer; streams pause at half.
pub(crate) const MAX_OUT_BUFFER: usize = 1024 * 1024;

/// Queued output past which the peer is taken to read nothing: the connection is closed.
/// Far above any burst a live client leaves unread (an ACP session replaying a long
/// conversation is a few MiB), far below what would hurt the process.
pub(crate) const MAX_QUEUED_OUT: usize = 64 * 1024 * 1024;

/// The write buffer an idle connection keeps for the next few lines; a larger one left by a
/// burst (a replay) is freed once it has drained.
const IDLE_OUT_CAPACITY: usize = 16 * 1024;

/// How often the front looks at a quiet connection. An authenticated one is kept however
/// quiet (its run may wait on a person for hours; TCP keepalive finds a vanished peer); one
/// winding down is closed once this passes without a byte.
const IDLE_CHECK: Duration = Duration::from_secs(60);

// The caps relate: a preamble is a short line, pending peers leave room for the client,
// streams pause long before the peer is given up on, and a preamble is cut off by its
// deadline before any idle check could look at it.
const _: () = assert!(
    MAX_PREAMBLE < MAX_LINE
        && MAX_PENDING_PER_PEER < MAX_PENDING
        && MAX_PENDING < MAX_CONNECTIONS
        && MAX_OUT_BUFFER < MAX_QUEUED_OUT
        && super::HEAD_DEADLINE.as_secs() < IDLE_CHECK.as_secs()
        && HANDSHAKED_GRACE.as_secs() < super::HEAD_DEADLINE.as_secs()
);

/// The agent's listener. A TCP listener always carries its TLS configuration and token, so
/// a plaintext or unauthenticated TCP listener cannot be built.
pub(crate) enum AgentListener {
    Tls {
        tcp: TcpListener,
        config: Arc<rustls::ServerConfig>,
        token: Box<Token>,
    },
    /// A Unix socket, created fresh with mode 0600 (see `surface::agent`).
    Unix { socket: UnixListener, path: PathBuf },
}

impl mio::event::Source for AgentListener {
    fn register(
        &mut self,
        registry: &Registry,
        token: MioToken,
        interest: Interest,
    ) -> io::Result<()> {
        match self {
            AgentListener::Tls { tcp, .. } => tcp.register(registry, token, interest),
            AgentListener::Unix { socket, .. } => socket.register(registry, token, interest),
        }
    }

    fn reregister(
        &mut self,
        registry: &Registry,
        token: MioToken,
        interest: Interest,
    ) -> io::Result<()> {
        match self {
            AgentListener::Tls { tcp, .. } => tcp.reregister(registry, token, interest),
            AgentListener::Unix { socket, .. } => socket.reregister(registry, token, interest),
        }
    }

    fn deregister(&mut self, registry: &Registry) -> io::Result<()> {
        match self {
            AgentListener::Tls { tcp, .. } => tcp.deregister(registry),
            AgentListener::Unix { socket, .. } => socket.deregister(registry),
        }
    }
}

/// The bytes of one connection.
enum Io {
    /// Always the server side of TLS (`Conn::TlsServer`).
    Tls(Conn),
    Unix(UnixStream),
}

impl Io {
    fn source(&mut self) -> &mut dyn mio::event::Source {
        match self {
            Io::Tls(conn) => conn.tcp(),
            Io::Unix(stream) => stream,
        }
    }

    fn tcp(&mut self) -> Option<&mut TcpStream> {
        match self {
            Io::Tls(conn) => Some(conn.tcp()),
            Io::Unix(_) => None,
        }
    }

    fn read(&mut self, out: &mut Vec<u8>, budget: usize) -> io::Result<ReadStatus> {
        match self {
            Io::Tls(conn) => conn.drain_read_upto(out, budget),
            Io::Unix(stream) => crate::transport::drain_read_plain(stream, out, budget),
        }
    }

    fn flush(&mut self, pending: &mut Vec<u8>) -> io::Result<()> {
        match self {
            Io::Tls(conn) => conn.flush(pending),
            Io::Unix(stream) => crate::transport::flush_plain(stream, pending),
        }
    }

    fn wants_write(&self) -> bool {
        match self {
            Io::Tls(conn) => conn.wants_write(),
            Io::Unix(_) => false,
        }
    }

    fn is_handshaking(&self) -> bool {
        match self {
            Io::Tls(conn) => conn.is_handshaking(),
            Io::Unix(_) => false,
        }
    }

    fn send_close_notify(&mut self) {
        if let Io::Tls(conn) = self {
            conn.send_close_notify();
        }
    }

    fn shutdown(&mut self, how: std::net::Shutdown) {
        let _ = match self {
            Io::Tls(conn) => conn.tcp().shutdown(how),
            Io::Unix(stream) => stream.shutdown(how),
        };
    }
}

/// What a peer sent, line by line.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Item {
    Line(Vec<u8>),
    /// A line over its cap; its bytes were dropped up to the next newline.
    Oversized,
}

/// Splits bytes into lines, each under its cap: `first_cap` for the first line (the
/// preamble), `cap` for the rest. A trailing `\r` is dropped. Sans-IO.
struct Splitter {
    partial: Vec<u8>,
    discarding: bool,
    first_cap: usize,
    cap: usize,
    lines: u64,
}

impl Splitter {
    fn new(first_cap: usize, cap: usize) -> Splitter {
        Splitter {
            partial: Vec::new(),
            discarding: false,
            first_cap,
            cap,
            lines: 0,
        }
    }

    fn current_cap(&self) -> usize {
        if self.lines == 0 {
            self.first_cap
        } else {
            self.cap
        }
    }

    fn push(&mut self, mut bytes: &[u8], out: &mut VecDeque<Item>) {
        while let Some(nl) = bytes.iter().position(|&b| b == b'\n') {
            let (head, rest) = bytes.split_at(nl);
            bytes = rest.get(1..).unwrap_or_default();
            let cap = self.current_cap();
            self.lines += 1;
            if std::mem::take(&mut self.discarding) {
                self.partial.clear();
                continue;
            }
            if self.partial.len() + head.len() > cap {
                self.partial.clear();
                out.push_back(Item::Oversized);
                continue;
            }
            let mut line = std::mem::take(&mut self.partial);
            line.extend_from_slice(head);
            if line.last() == Some(&b'\r') {
                line.pop();
            }
            out.push_back(Item::Line(line));
        }
        if self.discarding {
            return;
        }
        if self.partial.len() + bytes.len() > self.current_cap() {
            self.partial = Vec::new();
            self.discarding = true;
            out.push_back(Item::Oversized);
            return;
        }
        self.partial.extend_from_slice(bytes);
    }
}

/// See the module's LIFECYCLE section.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Waiting for the bearer line (TCP).
    Preamble,
    Open,
    Closing {
        close_notify_sent: bool,
    },
    Lingering {
        discarded: usize,
    },
    Closed,
}

/// Why a preamble was refused (for the log; the peer is told nothing).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    NotJson,
    /// Not exactly `{"bearer": <string>}`.
    WrongShape,
    BadToken,
    Oversized,
    /// A key twice (JSON parsers disagree on which one counts).
    DuplicateKey,
}

impl Refusal {
    fn as_str(self) -> &'static str {
        match self {
            Refusal::NotJson => "the preamble is not JSON",
            Refusal::WrongShape => "the preamble is not {\"bearer\":\"<token>\"}",
            Refusal::BadToken => "invalid bearer token",
            Refusal::Oversized => "the preamble is over 4 KiB",
            Refusal::DuplicateKey => "the preamble repeats a key",
        }
    }
}

/// The line a refused run's process reads (`front::kin`), in the vocabulary of the agent's
/// lines: the NDJSON plane's `Error`, which an ACP client takes for a line it does not know.
fn refusal_line() -> Vec<u8> {
    let mut line = serde_json::json!({"type": "Error", "error": super::kin::RULE})
        .to_string()
        .into_bytes();
    line.push(b'\n');
    line
}

/// Checks a preamble line: exactly `{"bearer": "<token>"}` with the right token.
pub(crate) fn check_preamble(line: &[u8], token: &Token) -> Result<(), Refusal> {
    let value: Value = serde_json::from_slice(line).map_err(|_| Refusal::NotJson)?;
    if let Some(map) = value.as_object()
        && top_level_members(line) != map.len()
    {
        return Err(Refusal::DuplicateKey);
    }
    let presented = match value.as_object() {
        Some(map) if map.len() == 1 => map.get("bearer").and_then(Value::as_str),
        _ => None,
    }
    .ok_or(Refusal::WrongShape)?;
    if token.matches(presented.as_bytes()) {
        Ok(())
    } else {
        Err(Refusal::BadToken)
    }
}

/// How many members the top-level object of `json` (valid JSON) spells out, repeated keys
/// counted each time: serde_json keeps the last of a repeated key, so only the text tells.
/// Each member has exactly one `:` at depth 1 outside strings.
fn top_level_members(json: &[u8]) -> usize {
    let (mut depth, mut in_string, mut escaped, mut members) = (0usize, false, false, 0);
    for &b in json {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'{' | b'[' => depth += 1,
            b'}' | b']' => depth = depth.saturating_sub(1),
            b':' if depth == 1 => members += 1,
            _ => {}
        }
    }
    members
}

/// One agent connection. See the module docs.
pub(crate) struct LineConn {
    io: Io,
    peer: String,
    /// The remote address of a TCP peer.
    peer_ip: Option<IpAddr>,
    phase: Phase,
    accepted: Instant,
    split: Splitter,
    items: VecDeque<Item>,
    /// Bytes of complete lines waiting in `items`; reading pauses past `READ_BUDGET`.
    item_bytes: usize,
    outbuf: Vec<u8>,
    last_activity: Instant,
    /// Since when queued output has waited with no byte taken by the socket (from when it
    /// was queued, or the last byte that went out); `None` while nothing waits.
    write_waiting_since: Option<Instant>,
    /// Output went over half of `MAX_OUT_BUFFER`: `Writable` is owed when it drains.
    writable_owed: bool,
    /// `Writable` is due (taken by `take_writable`).
    writable_due: bool,
    /// The peer hung up: once the lines it sent are taken, the connection is over.
    peer_eof: bool,
    /// A peer that needed no preamble is yet to be reported `Attached`.
    unannounced: bool,
    /// Answered with the refusal of a run's process (`turn_away`).
    turned_away: bool,
    /// When its TLS handshake was seen done (at once on the Unix socket).
    handshaked: Option<Instant>,
}

impl LineConn {
    fn new(io: Io, peer: String, peer_ip: Option<IpAddr>, preamble: bool) -> LineConn {
        let now = Instant::now();
        let (phase, first_cap) = if preamble {
            (Phase::Preamble, MAX_PREAMBLE)
        } else {
            (Phase::Open, MAX_LINE)
        };
        LineConn {
            io,
            peer,
            peer_ip,
            phase,
            accepted: now,
            split: Splitter::new(first_cap, MAX_LINE),
            items: VecDeque::new(),
            item_bytes: 0,
            outbuf: Vec::new(),
            last_activity: now,
            write_waiting_since: None,
            writable_owed: false,
            writable_due: false,
            peer_eof: false,
            unannounced: !preamble,
            turned_away: false,
            handshaked: None,
        }
    }

    /// Whether the peer still has to prove itself.
    pub(crate) fn in_preamble(&self) -> bool {
        self.phase == Phase::Preamble
    }

    /// Closed, or hung up with every line it sent taken.
    pub(crate) fn is_closed(&self) -> bool {
        self.phase == Phase::Closed || (self.peer_eof && self.items.is_empty())
    }

    /// Whether a stream may queue more now; when false, wait for `LineEvent::Writable`.
    pub(crate) fn wants_more(&self) -> bool {
        self.phase == Phase::Open && self.outbuf.len() < MAX_OUT_BUFFER / 2
    }

    /// Queues bytes for the peer (whole lines) and offers them to the socket. Nothing is
    /// queued unless the connection is open and authenticated; past `MAX_QUEUED_OUT` the
    /// peer is taken to read nothing and the connection closes.
    pub(crate) fn send(&mut self, bytes: &[u8]) {
        if self.phase != Phase::Open || bytes.is_empty() {
            return;
        }
        if self.outbuf.len() + bytes.len() > MAX_QUEUED_OUT {
            log::warn(&format!(
                "closing the agent connection from {}: it left {MAX_QUEUED_OUT} bytes unread",
                self.peer
            ));
            self.close_now();
            return;
        }
        self.outbuf.extend_from_slice(bytes);
        if self.outbuf.len() >= MAX_OUT_BUFFER / 2 {
            self.writable_owed = true;
        }
        self.flush_out();
    }

    /// Ends the connection once what is queued is out: close_notify, our FIN, then the
    /// peer's last bytes are discarded.
    pub(crate) fn finish(&mut self) {
        if matches!(self.phase, Phase::Preamble | Phase::Open) {
            self.phase = Phase::Closing {
                close_notify_sent: false,
            };
            self.items.clear();
            self.item_bytes = 0;
            self.pump();
        }
    }

    /// Answers a peer that may not be served (`front::kin`) with `line` and ends the
    /// connection; it is never announced, and nothing it sends is handed out.
    fn turn_away(&mut self, line: &[u8]) {
        self.unannounced = false;
        self.turned_away = true;
        if self.phase == Phase::Preamble {
            self.phase = Phase::Open;
        }
        self.items.clear();
        self.item_bytes = 0;
        self.send(line);
        self.finish();
    }

    fn authenticate(&mut self) {
        if self.phase == Phase::Preamble {
            self.phase = Phase::Open;
        }
    }

    fn take_item(&mut self) -> Option<Item> {
        let item = self.items.pop_front()?;
        if let Item::Line(line) = &item {
            self.item_bytes = self.item_bytes.saturating_sub(line.len());
        }
        Some(item)
    }

    fn take_writable(&mut self) -> bool {
        std::mem::take(&mut self.writable_due)
    }

    fn close_now(&mut self) {
        if self.phase == Phase::Closed {
            return;
        }
        self.io.send_close_notify();
        let mut nothing = Vec::new();
        let _ = self.io.flush(&mut nothing);
        self.io.shutdown(std::net::Shutdown::Both);
        self.enter_closed();
    }

    fn enter_closed(&mut self) {
        self.phase = Phase::Closed;
        self.items.clear();
        self.item_bytes = 0;
        self.outbuf = Vec::new();
        self.writable_owed = false;
        self.write_waiting_since = None;
    }

    fn flush_out(&mut self) {
        if self.outbuf.is_empty() && !self.io.wants_write() {
            self.write_waiting_since = None;
            return;
        }
        let before = self.outbuf.len();
        if self.io.flush(&mut self.outbuf).is_err() {
            self.enter_closed();
            return;
        }
        let moved = self.outbuf.len() < before;
        if moved {
            self.last_activity = Instant::now();
        }
        if self.outbuf.is_empty() && !self.io.wants_write() {
            self.write_waiting_since = None;
        } else if moved || self.write_waiting_since.is_none() {
            self.write_waiting_since = Some(Instant::now());
        }
        if self.outbuf.is_empty() && self.outbuf.capacity() > IDLE_OUT_CAPACITY {
            // A replay leaves a large buffer behind; a quiet connection gives it back.
            self.outbuf = Vec::new();
        }
        if self.writable_owed && self.outbuf.len() < MAX_OUT_BUFFER / 2 {
            self.writable_owed = false;
            self.writable_due = true;
        }
    }

    /// Flushes, winds down a closing connection, and reads what the phase allows, until
    /// nothing moves.
    fn pump(&mut self) {
        loop {
            self.flush_out();
            self.after_flush();
            if self.handshaked.is_none() && !self.io.is_handshaking() {
                self.handshaked = Some(Instant::now());
            }
            if !self.read_some() {
                return;
            }
        }
    }

    fn after_flush(&mut self) {
        let Phase::Closing { close_notify_sent } = self.phase else {
            return;
        };
        if !self.outbuf.is_empty() || self.io.wants_write() {
            return;
        }
        if !close_notify_sent {
            self.io.send_close_notify();
            self.phase = Phase::Closing {
                close_notify_sent: true,
            };
            self.flush_out();
            if self.phase == Phase::Closed || self.io.wants_write() {
                return;
            }
        }
        self.io.shutdown(std::net::Shutdown::Write);
        self.phase = Phase::Lingering { discarded: 0 };
    }

    /// Reads what the phase allows; whether anything happened (bytes or EOF).
    fn read_some(&mut self) -> bool {
        let (status, scratch) = match self.phase {
            Phase::Closing { .. } | Phase::Closed => return false,
            Phase::Lingering { discarded } => {
                let mut scratch = Vec::new();
                let status = self
                    .io
                    .read(&mut scratch, LINGER_MAX_BYTES.saturating_sub(discarded));
                if let Ok(status) = &status {
                    let total = discarded.saturating_add(status.n_bytes);
                    self.phase = Phase::Lingering { discarded: total };
                    if total >= LINGER_MAX_BYTES {
                        self.enter_closed();
                        return false;
                    }
                }
                (status, None)
            }
            Phase::Preamble | Phase::Open => {
                // Answers nobody reads, or lines the surface has not taken: wait.
                if self.peer_eof
                    || self.outbuf.len() >= MAX_OUT_BUFFER
                    || self.item_bytes >= READ_BUDGET
                {
                    return false;
                }
                let mut scratch = Vec::new();
                let status = self.io.read(&mut scratch, READ_BUDGET);
                (status, Some(scratch))
            }
        };
        let status = match status {
            Ok(status) => status,
            // A reset or a TLS failure (a plaintext client, one that refused our
            // certificate): nothing more can be delivered.
            Err(e) => {
                log::debug(&format!("agent connection from {}: {e}", self.peer));
                self.enter_closed();
                return false;
            }
        };
        if status.n_bytes > 0 {
            self.last_activity = Instant::now();
        }
        if let Some(bytes) = scratch {
            let before = self.items.len();
            self.split.push(&bytes, &mut self.items);
            for item in self.items.iter().skip(before) {
                if let Item::Line(line) = item {
                    self.item_bytes += line.len();
                }
            }
        }
        if status.eof {
            // A peer that hung up is gone: a line it left unfinished is dropped, the
            // complete ones are still handed out (`is_closed` waits for them).
            if matches!(self.phase, Phase::Lingering { .. }) {
                self.enter_closed();
            }
            self.peer_eof = true;
            return false;
        }
        status.n_bytes > 0
    }
}

impl Wire for LineConn {
    type Listener = AgentListener;
    type Setup = ();
    type Event<P> = LineEvent<P>;

    fn closed<P>(id: ConnId, state: P) -> LineEvent<P> {
        LineEvent::Closed(id, state)
    }

    fn accept(listener: &AgentListener, _: &()) -> io::Result<Result<Self, String>> {
        match listener {
            AgentListener::Tls { tcp, config, .. } => {
                let (tcp, peer) = tcp.accept()?;
                // Lines go out whole; Nagle would only delay the last segment of each.
                let _ = tcp.set_nodelay(true);
                Ok(Conn::Plain(tcp)
                    .accept_tls(Arc::clone(config))
                    .map(|conn| {
                        LineConn::new(Io::Tls(conn), peer.to_string(), Some(peer.ip()), true)
                    })
                    .map_err(|e| format!("cannot set up a connection from {peer}: {e}")))
            }
            AgentListener::Unix { socket, path } => {
                let (stream, _) = socket.accept()?;
                Ok(Ok(LineConn::new(
                    Io::Unix(stream),
                    path.display().to_string(),
                    None,
                    false,
                )))
            }
        }
    }

    fn source(&mut self) -> &mut dyn mio::event::Source {
        self.io.source()
    }

    fn unix_fd(&self) -> Option<std::os::fd::RawFd> {
        match &self.io {
            Io::Unix(stream) => Some(crate::sys::raw_fd(stream)),
            Io::Tls(_) => None,
        }
    }

    fn tcp(&mut self) -> Option<&mut TcpStream> {
        self.io.tcp()
    }

    fn peer_name(&self) -> String {
        self.peer.clone()
    }

    /// Until its preamble was right; a Unix socket's peer never has one to send.
    fn needs_admission(&self) -> bool {
        self.in_preamble()
    }

    fn peer_key(&self, _: &()) -> Option<IpAddr> {
        self.peer_ip
            .filter(|ip| !crate::auth::is_loopback(ip))
            .map(peer_key)
    }

    fn peer_group(&self) -> Option<IpAddr> {
        self.peer_ip.map(peer_key)
    }

    fn grace_until(&self) -> Option<Instant> {
        self.handshaked
            .filter(|_| self.in_preamble())
            .map(|at| at + HANDSHAKED_GRACE)
    }

    fn last_activity(&self) -> Instant {
        self.last_activity
    }

    fn head_started(&self) -> Option<Instant> {
        (self.phase == Phase::Preamble).then_some(self.accepted)
    }

    fn is_streaming(&self) -> bool {
        self.phase == Phase::Open
    }

    fn awaiting_response(&self) -> bool {
        false
    }

    fn write_stalled_for(&self) -> Option<Duration> {
        self.write_waiting_since.map(|since| since.elapsed())
    }

    fn stream_chunk(&mut self, data: &[u8]) {
        self.send(data);
    }

    fn close(&mut self) {
        self.close_now();
    }
}

/// What the surface must act on, in the order it happened.
#[derive(Debug)]
pub(crate) enum LineEvent<P> {
    /// A peer proved itself (its preamble was right, or it came over the Unix socket).
    Attached(ConnId),
    /// A line from an attached peer.
    Line(ConnId, Vec<u8>),
    /// A line over `MAX_LINE` from an attached peer, dropped whole.
    Oversized(ConnId),
    /// Queued output drained below half of `MAX_OUT_BUFFER`: write more.
    Writable(ConnId),
    /// The connection is gone; its payload comes back for the surface's clean-up.
    Closed(ConnId, P),
}

impl<P: Default> Front<P, LineConn> {
    /// A front over the agent's listener. An authenticated connection is kept however
    /// quiet; one in its preamble has the head deadline and counts as unadmitted.
    pub(crate) fn for_agent(listener: AgentListener) -> Front<P, LineConn> {
        let caps = Caps {
            max_connections: MAX_CONNECTIONS,
            max_unadmitted: MAX_PENDING,
            max_unadmitted_per_peer: MAX_PENDING_PER_PEER,
        };
        Front::with_listener(listener, (), caps, IDLE_CHECK, Keepalive::Silent)
    }

    /// The TCP address listened on (`None` for a Unix socket).
    pub(crate) fn local_addr(&self) -> Option<SocketAddr> {
        match &self.listener {
            AgentListener::Tls { tcp, .. } => tcp.local_addr().ok(),
            AgentListener::Unix { .. } => None,
        }
    }

    /// The Unix socket's path, to remove on exit.
    pub(crate) fn socket_path(&self) -> Option<&std::path::Path> {
        match &self.listener {
            AgentListener::Unix { path, .. } => Some(path),
            AgentListener::Tls { .. } => None,
        }
    }

    /// Readiness of one of the front's sources.
    pub(crate) fn on_io<K: HostKey + From<FrontKey>>(&mut self, cx: &mut Cx<K>, key: FrontKey) {
        match key {
            FrontKey::Listener => self.accept(cx),
            FrontKey::Conn(id) => self.look_again(id),
            FrontKey::Idle(_) | FrontKey::Head(_) | FrontKey::Stall(_) => {}
        }
    }

    /// Queues whole lines for an attached connection (see `LineConn::send`).
    pub(crate) fn send(&mut self, id: ConnId, bytes: &[u8]) {
        if let Some(slot) = self.conn_mut(id) {
            slot.conn.send(bytes);
        }
    }

    /// Whether a stream to `id` may queue more now.
    pub(crate) fn wants_more(&self, id: ConnId) -> bool {
        self.get(id).is_some_and(|slot| slot.conn.wants_more())
    }

    /// Ends `id` once its queued output is out (`LineConn::finish`).
    pub(crate) fn finish(&mut self, id: ConnId) {
        if let Some(slot) = self.conn_mut(id) {
            slot.conn.finish();
        }
    }

    /// Best effort at exit: offers what is queued to the sockets once more, without waiting.
    pub(crate) fn flush_all(&mut self) {
        for slot in self.slots.values_mut() {
            slot.conn.flush_out();
        }
    }

    /// The next thing the surface must act on; call until `None` after every callback that
    /// reached the front or wrote to a connection.
    pub(crate) fn next_event<K: HostKey + From<FrontKey>>(
        &mut self,
        cx: &mut Cx<K>,
    ) -> Option<LineEvent<P>> {
        loop {
            // Only the shared half queues events, the closes; the rest come from the lines.
            if let Some(event) = self.events.pop_front() {
                return Some(event);
            }
            let id = *self.dirty.front()?;
            let Some(slot) = self.slots.get_mut(&id) else {
                self.dirty.pop_front();
                continue;
            };
            if slot.conn.items.is_empty() {
                slot.conn.pump();
            }
            // A run's process is told why, once it can read a line: at once on the Unix
            // socket, after its preamble over TLS (whose handshake must finish first).
            if slot.from_a_run
                && !slot.conn.turned_away
                && (!slot.conn.in_preamble() || !slot.conn.items.is_empty())
            {
                slot.conn.turn_away(&refusal_line());
            }
            if std::mem::take(&mut slot.conn.unannounced) {
                return Some(LineEvent::Attached(id));
            }
            if slot.conn.take_writable() {
                return Some(LineEvent::Writable(id));
            }
            let preamble = slot.conn.in_preamble();
            match slot.conn.take_item() {
                Some(Item::Line(line)) if preamble => {
                    let AgentListener::Tls { token, .. } = &self.listener else {
                        slot.conn.authenticate();
                        self.admitted(id);
                        return Some(LineEvent::Attached(id));
                    };
                    match check_preamble(&line, token) {
                        Ok(()) => {
                            slot.conn.authenticate();
                            self.admitted(id);
                            self.watch(cx, id);
                            return Some(LineEvent::Attached(id));
                        }
                        Err(refusal) => self.refuse(cx, id, refusal),
                    }
                }
                Some(Item::Oversized) if preamble => self.refuse(cx, id, Refusal::Oversized),
                Some(Item::Line(line)) => return Some(LineEvent::Line(id, line)),
                Some(Item::Oversized) => return Some(LineEvent::Oversized(id)),
                None => {
                    self.dirty.pop_front();
                    if slot.conn.is_closed() {
                        self.close(cx, id);
                    } else {
                        // A new connection starts on the deadline; output that waits for
                        // the peer starts the write-stall deadline.
                        self.watch(cx, id);
                    }
                }
            }
        }
    }

    fn refuse<K: HostKey + From<FrontKey>>(&mut self, cx: &mut Cx<K>, id: ConnId, why: Refusal) {
        if let Some(slot) = self.slots.get(&id) {
            log::info(&format!(
                "refused the agent connection from {}: {}",
                slot.conn.peer,
                why.as_str()
            ));
        }
        self.close(cx, id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    fn split_all(first_cap: usize, cap: usize, chunks: &[&[u8]]) -> Vec<Item> {
        let mut splitter = Splitter::new(first_cap, cap);
        let mut out = VecDeque::new();
        for chunk in chunks {
            splitter.push(chunk, &mut out);
        }
        out.into_iter().collect()
    }

    #[test]
    fn lines_come_out_the_same_at_every_split_point() {
        let input = b"{\"bearer\":\"t\"}\r\n{\"type\":\"EndInput\"}\n\nlast\n";
        let want = vec![
            Item::Line(b"{\"bearer\":\"t\"}".to_vec()),
            Item::Line(b"{\"type\":\"EndInput\"}".to_vec()),
            Item::Line(Vec::new()),
            Item::Line(b"last".to_vec()),
        ];
        for at in 0..=input.len() {
            let (a, b) = input.split_at(at);
            assert_eq!(split_all(64, 64, &[a, b]), want, "split at {at}");
        }
        let bytes: Vec<&[u8]> = input.chunks(1).collect();
        assert_eq!(split_all(64, 64, &bytes), want);
    }

    #[test]
    fn the_first_line_has_its_own_cap_and_an_oversized_line_goes_whole() {
        // A preamble one byte over its cap, then a normal line.
        let mut input = vec![b'x'; 9];
        input.extend_from_slice(b"\nshort\n");
        for at in 0..=input.len() {
            let (a, b) = input.split_at(at);
            assert_eq!(
                split_all(8, 64, &[a, b]),
                vec![Item::Oversized, Item::Line(b"short".to_vec())],
                "split at {at}"
            );
        }
        // Exactly at the cap is fine; later lines get the larger cap.
        let input = b"12345678\n1234567890\n";
        assert_eq!(
            split_all(8, 16, &[input]),
            vec![
                Item::Line(b"12345678".to_vec()),
                Item::Line(b"1234567890".to_vec())
            ]
        );
        // An unfinished line over the cap is reported once, and its rest is skipped.
        assert_eq!(
            split_all(4, 4, &[b"abcdefgh", b"ijkl", b"mn\nok\n"]),
            vec![Item::Oversized, Item::Line(b"ok".to_vec())]
        );
    }

    /// A connection on one end of a Unix socket pair, the other end blocking.
    fn unix_pair(
        peer_ip: Option<IpAddr>,
        preamble: bool,
    ) -> (LineConn, std::os::unix::net::UnixStream) {
        let (ours, theirs) = std::os::unix::net::UnixStream::pair().expect("socket pair");
        ours.set_nonblocking(true).expect("nonblocking");
        let conn = LineConn::new(
            Io::Unix(UnixStream::from_std(ours)),
            "test".to_owned(),
            peer_ip,
            preamble,
        );
        (conn, theirs)
    }

    #[test]
    fn remote_peers_in_their_preamble_are_counted_by_address_and_local_ones_not() {
        let ip = |text: &str| text.parse::<IpAddr>().expect("address");
        for (addr, key) in [
            ("203.0.113.7", Some(ip("203.0.113.7"))),
            ("::ffff:203.0.113.7", Some(ip("203.0.113.7"))),
            ("2001:db8:1:2:aaaa::1", Some(ip("2001:db8:1:2::"))),
            ("127.0.0.1", None),
            ("127.0.0.2", None),
            ("::1", None),
            ("::ffff:127.0.0.1", None),
        ] {
            let (conn, _peer) = unix_pair(Some(ip(addr)), true);
            assert!(conn.needs_admission());
            assert_eq!(conn.peer_key(&()), key, "{addr}");
        }
        // A Unix socket's peer is admitted as it is accepted, and counted under no address.
        let (conn, _peer) = unix_pair(None, false);
        assert!(!conn.needs_admission());
        assert_eq!(conn.peer_key(&()), None);
    }

    #[test]
    fn output_a_peer_does_not_take_is_reported_as_stalled_until_it_drains() {
        let (mut conn, mut peer) = unix_pair(None, false);
        assert_eq!(conn.write_stalled_for(), None);
        // Far more than the socket buffers hold, so some waits here.
        let line = [vec![b'x'; 1023], vec![b'\n']].concat();
        let total = 4 * 1024 * 1024;
        for _ in 0..total / line.len() {
            conn.send(&line);
        }
        std::thread::sleep(Duration::from_millis(20));
        let stalled = conn.write_stalled_for().expect("output waits for the peer");
        assert!(stalled >= Duration::from_millis(20), "{stalled:?}");
        // The peer reads everything: nothing waits any more.
        let mut got = 0;
        let mut buf = vec![0u8; 64 * 1024];
        while got < total {
            got += peer.read(&mut buf).expect("read");
            conn.flush_out();
        }
        conn.flush_out();
        assert_eq!(conn.write_stalled_for(), None);
    }

    #[test]
    fn selfclient_members_are_counted_in_the_text_and_strings_are_opaque() {
        assert_eq!(top_level_members(br#"{"bearer":"a"}"#), 1);
        assert_eq!(top_level_members(br#"{"bearer":"a:b","x":{"y":1}}"#), 2);
        assert_eq!(top_level_members(br#"{"a\":\"":"x","a":[{"b":2}]}"#), 2);
        assert_eq!(top_level_members(br#"{"a":1,"a":2}"#), 2);
        assert_eq!(top_level_members(br#"{}"#), 0);
    }

    #[test]
    fn only_the_exact_preamble_with_the_right_token_passes() {
        let token = Token::new(b"s3cret");
        assert_eq!(check_preamble(br#"{"bearer":"s3cret"}"#, &token), Ok(()));
        assert_eq!(
            check_preamble(br#" { "bearer" : "s3cret" } "#, &token),
            Ok(())
        );
        for (line, why) in [
            (&br#"{"bearer":"s3cre"}"#[..], Refusal::BadToken),
            (br#"{"bearer":"s3cret "}"#, Refusal::BadToken),
            (br#"{"bearer":""}"#, Refusal::BadToken),
            (br#"{"bearer":"s3cret","x":1}"#, Refusal::WrongShape),
            // serde_json would keep the last; another parser in front of us the first.
            (
                br#"{"bearer":"wrong","bearer":"s3cret"}"#,
                Refusal::DuplicateKey,
            ),
            (
                br#"{"bearer":"s3cret","bearer":"s3cret"}"#,
                Refusal::DuplicateKey,
            ),
            (br#"{"token":"s3cret"}"#, Refusal::WrongShape),
            (br#"{"bearer":7}"#, Refusal::WrongShape),
            (br#"["s3cret"]"#, Refusal::WrongShape),
            (b"Bearer s3cret", Refusal::NotJson),
            (b"", Refusal::NotJson),
            (b"\xff\xfe", Refusal::NotJson),
        ] {
            assert_eq!(
                check_preamble(line, &token),
                Err(why),
                "{}",
                String::from_utf8_lossy(line)
            );
        }
    }
}
