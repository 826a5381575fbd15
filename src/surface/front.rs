//! The network front: what every listening drive surface (`http serve`, MCP's `--listen`,
//! `agent serve`) stands behind. It owns the listener and its registration; the
//! connections, in one map keyed by `ConnId` with the surface's per-connection state as a
//! payload; the connection cap (accept pauses, the kernel backlog holds the rest, a close
//! resumes it) and who may take a slot (see ADMISSION); socket setup; the idle timer with
//! each surface's keepalive choice; the head deadline; the write-stall deadline (a peer that
//! acknowledges none of our output for that long is gone); the auth gate (for HTTP: bearer
//! token for remote peers, the browser rule for loopback ones, DESIGN §4.6; for the agent's
//! lines: the bearer preamble, in `line`); and close. TLS is inside the connection type
//! (`http::server::Connection`, `line::LineConn`).
//!
//! An HTTP surface answers with values: it takes `Event`s from `next_event`, answers each
//! `Event::Request` with a `Reply` through `reply`, and writes what comes later (a live
//! stream, a deferred answer) through `conn_mut`. It never registers, times or closes a
//! socket itself except through `close`. (The agent's surface takes `line::LineEvent`s
//! the same way: each connection type has its own event, `Wire::Event`.)
//!
//! ADMISSION. A connection is *unadmitted* until its peer has proved itself: for HTTP, until
//! one of its requests passes the gate, which decides on each request's head before a byte
//! of its body is read (`Connection::require_admission`), so a refused peer's 401 neither
//! waits for nor buffers a body; for the agent's lines, until its bearer preamble was right
//! (a Unix socket connection, whose file mode is its gate, is admitted as it is accepted).
//! Unadmitted connections are what a peer without the token (or a loopback slowloris) can
//! hold, so, the same way for every connection type (`Caps`): a remote address (an IPv6 /64,
//! `peer_key`) may hold at most `max_unadmitted_per_peer` of them (more are closed as soon as
//! they are accepted; loopback peers are not capped, since they share one address that may
//! be a proxy speaking for everyone), and a new connection takes the place of an unadmitted
//! one when every slot is taken or when `max_unadmitted` are unadmitted already
//! (`at_the_door`): the oldest of the address holding the most of them, passing over those
//! within their grace (`Wire::grace_until`: the agent's handshaked connections, for
//! `line::HANDSHAKED_GRACE`), the newcomer refused when all are (`displaced`; HTTP: only the slots bound them, 16 per peer; the agent: at most 16 of
//! its 32 slots, 8 per peer, see `line`). Admitted connections are never displaced, so an
//! authorised client is served however many connections others hold open, as long as
//! authorised ones do not fill every slot themselves.
//!
//! LIFECYCLE of a connection: accepted and set up by its type (`Wire::accept`), or refused
//! by the per-peer cap → registered (socket options for TCP, idle timer armed) → what its
//! peer sends, read by its type's half: HTTP requests, each gated at its head then handed
//! out once the previous one is answered (`Connection` enforces one at a time); the agent's
//! preamble, then lines → closed by the peer, a protocol error, the idle timer, the head
//! deadline, the write-stall deadline, a newcomer taking its slot (unadmitted only) or the
//! surface → deregistered, timers cancelled, the wire's closed event (`Wire::closed`) hands
//! the payload back.
//!
//! Architecture Invariant: the accept / map / cap / deadline half (`accept`, `take_in`,
//! `add`, `close`, `admitted`, `on_idle`, `watch` with `watch_head` and `watch_stall`,
//! `on_head_timer`, `on_stall_timer`) never looks inside what a peer sends; only each
//! connection type's half reads it (`on_ready`, `service`, `admit` and `reply` here speak
//! HTTP; `line` reads the agent's lines). The shared half is written once over the
//! connection type (`Wire`): HTTP's `Connection` here, and the networked agent's lines (TLS
//! or a Unix socket, a bearer preamble first) in `line`, whose preamble runs on the same
//! head deadline. It learns what it needs through `Wire` (when a head began, whether output
//! waits, the peer's key, the TCP socket) and learns of an admission from the type's half
//! (`admitted`).

pub(crate) mod kin;
pub(crate) mod line;
mod wire;

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mio::net::TcpListener;
use mio::{Interest, Token};

use crate::auth::{Decision, Gate};
use crate::http::server::{ConnEvent, Connection, Limits, Request};
use crate::ids::HostKey;
use crate::log;
use crate::reactor::TimerId;
use crate::surface::host::Cx;
use wire::HttpSetup;
pub(crate) use wire::Wire;

/// Open connections beyond this wait in the kernel's backlog until one closes (or, when
/// some are unadmitted, take the place of the oldest of those; see ADMISSION).
pub const DEFAULT_MAX_CONNECTIONS: usize = 256;

/// Connections one remote address (an IPv6 /64) may hold before any of their requests has
/// passed the gate; more are closed as soon as they are accepted. An honest client's
/// connections pass the gate with their first request, milliseconds after connecting, so
/// even a busy one behind a NAT seldom has more than a few waiting at once; without a cap,
/// one peer without the token could take every slot (the oldest-unadmitted rule alone would
/// let it churn them). Loopback peers are not capped: they all share one address, which
/// may be a reverse proxy speaking for everyone. HTTP's cap; the agent has its own
/// (`line::MAX_PENDING_PER_PEER`), under its smaller bound on unadmitted connections.
pub(crate) const MAX_UNADMITTED_PER_PEER: usize = 16;

/// How long a client has from the first byte of a request head to its last. Any byte
/// resets the idle timer, so without this a client trickling a head (slowloris) holds a
/// connection slot forever; a real client sends its head in one write, and 20 s still
/// leaves room for a slow link or a person typing a request into `nc`.
pub(crate) const HEAD_DEADLINE: Duration = Duration::from_secs(20);

/// How long output may wait on a peer that acknowledges none of it before the connection
/// is closed. A peer that reads nothing while we have something to say (a follower that
/// stopped reading, a client suspended or gone behind a full window) would otherwise hold
/// its slot and its queued output forever: its stream's window stays full, so nothing else
/// happens on it, and the idle timer cannot tell since the peer may still send. Output
/// waits in our queue or in the kernel's; progress is the peer's TCP acknowledging bytes
/// (`sys::tcp_send_state`), not our writes, since the kernel keeps taking a little from a
/// stalled queue of ours now and then (without a TCP socket, a Unix one, our queue's
/// progress decides). A reading client acknowledges within milliseconds; 30 s leaves room
/// for a congested link and a client paused in a debugger, and one cut off resumes from its
/// cursor.
pub(crate) const WRITE_STALL_DEADLINE: Duration = Duration::from_secs(30);

/// How often a connection whose output waits is looked at for the write-stall deadline, so
/// it is closed at most this long after the deadline passed.
const STALL_CHECK: Duration = Duration::from_secs(5);

/// Silence after which the kernel probes a connection whose peer may have vanished.
const TCP_KEEPALIVE_IDLE: Duration = Duration::from_secs(60);

/// A deadline timer never re-arms sooner than this, so one that fires a hair early cannot
/// spin the loop.
const MIN_REARM: Duration = Duration::from_millis(10);

/// What `Keepalive::Comment` writes on a quiet stream: an SSE comment, which clients
/// ignore.
const KEEPALIVE_COMMENT: &[u8] = b": keepalive\n\n";

/// Where a network surface listens, checked before binding (fail closed).
pub struct ListenConfig {
    pub addr: SocketAddr,
    pub tls: Option<Arc<rustls::ServerConfig>>,
    pub limits: Limits,
    pub max_connections: usize,
    pub gate: Gate,
}

/// One accepted connection, for as long as it is open. Never reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnId(u64);

/// What the front registers on the loop; a surface's key wraps it (`HttpKey::Front`) and
/// hands it back through `Front::on_io` and `Front::on_timer`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FrontKey {
    Listener,
    /// Readiness of a connection's socket.
    Conn(ConnId),
    /// A connection's idle timer.
    Idle(ConnId),
    /// A connection's head deadline.
    Head(ConnId),
    /// A connection's write-stall deadline.
    Stall(ConnId),
}

/// How many connections a front holds, and how many of them may be unadmitted (see
/// ADMISSION).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Caps {
    /// Open connections. Beyond this a newcomer takes the place of the oldest unadmitted
    /// one, or waits in the kernel's backlog while none is.
    pub max_connections: usize,
    /// Unadmitted connections. A newcomer that has yet to prove itself beyond this takes
    /// the place of the oldest of them (`max_connections`: only the slots bound them).
    pub max_unadmitted: usize,
    /// Unadmitted connections one remote peer (`peer_key`) may hold; more are closed as
    /// soon as they are accepted.
    pub max_unadmitted_per_peer: usize,
}

/// What a quiet stream gets once an idle period passes: each surface's explicit choice.
/// Request-response connections are closed once idle either way, unless a request is with
/// the surface (a deferred answer is on its way).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Keepalive {
    /// Nothing: the stream is left open and looked at again a period later. For surfaces
    /// that send heartbeats of their own (`http serve`'s follow streams, whose NDJSON
    /// heartbeat carries a cursor), or streams that may rightly be quiet for hours (the
    /// agent's lines); TCP keepalive probes still find a vanished peer.
    Silent,
    /// An SSE comment (`: keepalive`), which keeps proxies from timing the stream out and
    /// turns a vanished peer into a write error.
    Comment,
}

/// What a connection's idle timer does when it fires.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum IdleStep {
    Close,
    /// Write the keepalive comment, then look again after this long.
    Ping(Duration),
    /// Look again after this long.
    Wait(Duration),
}

/// The idle decision for a connection `quiet` for that long (no byte either way), given
/// whether a response stream is open and whether a request is with the surface.
pub(crate) fn idle_step(
    keepalive: Keepalive,
    idle: Duration,
    quiet: Duration,
    streaming: bool,
    awaiting_response: bool,
) -> IdleStep {
    if quiet < idle {
        return IdleStep::Wait((idle - quiet).max(MIN_REARM));
    }
    match (streaming, keepalive) {
        (true, Keepalive::Comment) => IdleStep::Ping(idle),
        (true, Keepalive::Silent) => IdleStep::Wait(idle),
        (false, _) if awaiting_response => IdleStep::Wait(idle),
        (false, _) => IdleStep::Close,
    }
}

/// How long a head under way for `elapsed` still has; `None` once the deadline passed.
pub(crate) fn head_time_left(elapsed: Duration) -> Option<Duration> {
    HEAD_DEADLINE
        .checked_sub(elapsed)
        .filter(|left| !left.is_zero())
}

/// Whether the peer of a connection whose output waits is gone: it acknowledged nothing
/// for `unacked_for`, or, where the kernel cannot tell what it acknowledged (`acked` is
/// `None`), our queue has gone `stalled` (`None`: nothing waits there) without the kernel
/// taking a byte.
pub(crate) fn peer_gone(
    acked: Option<u64>,
    unacked_for: Duration,
    stalled: Option<Duration>,
) -> bool {
    let waited = if acked.is_some() {
        Some(unacked_for)
    } else {
        stalled
    };
    waited.is_some_and(|waited| waited >= WRITE_STALL_DEADLINE)
}

/// What becomes of a connection just accepted (see ADMISSION).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Door {
    /// Its peer already holds its share of unadmitted connections: closed at once.
    Refuse,
    /// It takes the place of the oldest unadmitted connection.
    TakeOldest,
    /// It takes a free slot.
    In,
}

/// The door's decision for a newcomer, given whether every slot is taken (`full`; then
/// some connection is unadmitted, or nobody would have been accepted), whether it has yet to
/// prove itself (`unadmitted_newcomer`), how many connections are unadmitted, and how many of
/// those its peer holds (`None`: an uncapped peer, or a newcomer admitted at once).
pub(crate) fn at_the_door(
    caps: &Caps,
    full: bool,
    unadmitted_newcomer: bool,
    unadmitted: usize,
    of_its_peer: Option<usize>,
) -> Door {
    if of_its_peer.is_some_and(|n| n >= caps.max_unadmitted_per_peer) {
        Door::Refuse
    } else if full || (unadmitted_newcomer && unadmitted >= caps.max_unadmitted) {
        Door::TakeOldest
    } else {
        Door::In
    }
}

/// An unadmitted connection as the door sees it when a newcomer needs its place.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Pending {
    pub id: ConnId,
    /// Its address's share (`Wire::peer_group`).
    pub group: Option<IpAddr>,
    /// Within its grace (`Wire::grace_until`): not to be displaced now.
    pub protected: bool,
}

/// Which unadmitted connection a newcomer of address `newcomer` displaces, given them oldest
/// first and counting the newcomer in its address's share: the oldest unprotected one of the
/// address that holds the most (the earliest such oldest on a tie), so a flood from one
/// address displaces itself before another's client. A grace protects only within an
/// address's `share` (a flood that holds more keeps none). `None` (the newcomer is then
/// refused) when every one is protected, or when the one to go belongs to an address
/// holding fewer than the newcomer's: a newcomer never pushes out a smaller share.
pub(crate) fn displaced(
    pending: &[Pending],
    newcomer: Option<IpAddr>,
    share: usize,
) -> Option<ConnId> {
    let mut held: HashMap<Option<IpAddr>, usize> = HashMap::new();
    for group in pending.iter().map(|p| p.group).chain([newcomer]) {
        *held.entry(group).or_insert(0) += 1;
    }
    let mut best: Option<(usize, usize)> = None;
    for (i, p) in pending.iter().enumerate() {
        let n = held[&p.group];
        if p.protected && n <= share {
            continue;
        }
        // Oldest first: a later one of the same address never wins, a later one of a
        // larger share does.
        if best.is_none_or(|(_, most)| n > most) {
            best = Some((i, n));
        }
    }
    let (i, n) = best?;
    (n >= held[&newcomer]).then_some(pending[i].id)
}

/// What connections count against the per-peer cap of unadmitted ones under: the address,
/// with an IPv4-mapped IPv6 one as its IPv4 self, and an IPv6 one as its /64 (one host's
/// share).
pub(crate) fn peer_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(Ipv6Addr::from_bits(v6.to_bits() & (u128::MAX << 64))),
        },
    }
}
/// A complete HTTP response, as a surface's handler returns it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Response {
    pub status: u16,
    pub headers: Vec<(&'static str, String)>,
    pub body: Vec<u8>,
}

impl Response {
    /// No fields, no body (202, an empty 200).
    pub(crate) fn empty(status: u16) -> Response {
        Response {
            status,
            headers: Vec::new(),
            body: Vec::new(),
        }
    }

    /// A body of `content_type`.
    pub(crate) fn with(
        status: u16,
        content_type: &'static str,
        body: impl Into<Vec<u8>>,
    ) -> Response {
        Response {
            status,
            headers: vec![("content-type", content_type.to_owned())],
            body: body.into(),
        }
    }

    pub(crate) fn json(status: u16, body: impl Into<Vec<u8>>) -> Response {
        Response::with(status, "application/json", body)
    }

    /// One more header field.
    pub(crate) fn header(mut self, name: &'static str, value: impl Into<String>) -> Response {
        self.headers.push((name, value.into()));
        self
    }

    fn header_refs(&self) -> Vec<(&str, &str)> {
        self.headers
            .iter()
            .map(|(name, value)| (*name, value.as_str()))
            .collect()
    }
}

/// A surface's answer to a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Reply {
    /// A complete response.
    Full(Response),
    /// A streamed response: the head, and `response.body` as its first chunk when not empty.
    /// `open` leaves the stream to the surface, which writes the rest through
    /// `Front::conn_mut` and ends it there; otherwise it ends here.
    Stream { response: Response, open: bool },
    /// Nothing yet: the surface answers later through `Front::conn_mut`.
    Later,
}

impl From<Response> for Reply {
    fn from(response: Response) -> Reply {
        Reply::Full(response)
    }
}

/// What each surface decides about its listener.
#[derive(Clone, Copy)]
pub(crate) struct Policy {
    pub keepalive: Keepalive,
    /// The 403 for a request the browser rule refuses (`auth::Gate::check_browser_headers`),
    /// given the rule's reason: the rule is shared, the response is the surface's.
    pub forbidden: fn(&'static str) -> Response,
    /// The answer to a request that any peer may make without the token, or `None`. A
    /// liveness probe is one: a kubelet probes from outside the pod and cannot hold a
    /// secret. It is answered at the gate and the connection closed, never admitted.
    pub public: fn(&Request) -> Option<Response>,
}

/// Something an HTTP surface must act on, in the order it happened (`Wire::Event` of
/// `Connection`).
#[derive(Debug)]
pub(crate) enum Event<P> {
    /// A request that passed the gate: answer it with `Front::reply`. Nothing else comes
    /// from this connection until that answer is complete.
    Request(ConnId, Request),
    /// A stream's queued output drained below the high-water mark: write more.
    Writable(ConnId),
    /// The peer sent EOF while a stream is open (told once per stream). Close it unless the
    /// peer is still owed something there (a half-closed client waiting on its answer).
    HungUp(ConnId),
    /// The connection is gone; its payload comes back for the surface's clean-up.
    Closed(ConnId, P),
}

/// One open connection: its machine (HTTP's by default) and the surface's state for it.
pub(crate) struct Slot<P, C = Connection> {
    pub conn: C,
    pub state: P,
    token: Token,
    idle_timer: TimerId,
    head_timer: Option<TimerId>,
    stall_timer: Option<TimerId>,
    /// What the peer had acknowledged when last looked at for the write-stall deadline, and
    /// since when (as far as we looked).
    stall_acked: (Option<u64>, Instant),
    /// `Event::HungUp` went out for the stream now open.
    told_hung_up: bool,
    /// The peer proved itself (see ADMISSION).
    admitted: bool,
    /// The per-peer key of a capped peer (`Wire::peer_key`), `None` for an uncapped one.
    remote: Option<IpAddr>,
    /// The peer is a process one of our runs started (`kin`): its type's half answers it
    /// with the refusal and closes, and serves it nothing.
    from_a_run: bool,
}

/// See the module docs. `P` is a surface's per-connection state, `P::default()` when a
/// connection is accepted; `C` the kind of connection.
pub(crate) struct Front<P, C: Wire = Connection> {
    setup: C::Setup,
    caps: Caps,
    idle_timeout: Duration,
    keepalive: Keepalive,
    listener: C::Listener,
    slots: HashMap<ConnId, Slot<P, C>>,
    next_id: u64,
    /// At the cap (or after an accept error): `close` retries accepting. Edge-triggered
    /// readiness will not fire again for connections already waiting in the backlog.
    accept_paused: bool,
    /// Connections whose peer has not proved itself yet, oldest first.
    unadmitted: BTreeSet<ConnId>,
    /// How many of those each capped peer (`peer_key`) holds.
    unadmitted_by_peer: HashMap<IpAddr, usize>,
    events: VecDeque<C::Event<P>>,
    /// Connections to look at again: a response completed or the surface wrote, so a
    /// pipelined request may be servable, or the close may be complete.
    dirty: VecDeque<ConnId>,
}

impl<P: Default> Front<P> {
    pub(crate) fn bind(config: ListenConfig, policy: Policy) -> std::io::Result<Front<P>> {
        let listener = TcpListener::bind(config.addr)?;
        let caps = Caps {
            max_connections: config.max_connections,
            // Only the slots bound them: a newcomer displaces one once every slot is taken.
            max_unadmitted: config.max_connections,
            max_unadmitted_per_peer: MAX_UNADMITTED_PER_PEER,
        };
        let idle_timeout = config.limits.idle_timeout;
        Ok(Front::with_listener(
            listener,
            HttpSetup { config, policy },
            caps,
            idle_timeout,
            policy.keepalive,
        ))
    }

    pub(crate) fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }
}

impl<P: Default, C: Wire> Front<P, C> {
    /// A front over a bound listener of any kind.
    fn with_listener(
        listener: C::Listener,
        setup: C::Setup,
        caps: Caps,
        idle_timeout: Duration,
        keepalive: Keepalive,
    ) -> Front<P, C> {
        Front {
            setup,
            caps,
            idle_timeout,
            keepalive,
            listener,
            slots: HashMap::new(),
            next_id: 0,
            accept_paused: false,
            unadmitted: BTreeSet::new(),
            unadmitted_by_peer: HashMap::new(),
            events: VecDeque::new(),
            dirty: VecDeque::new(),
        }
    }

    /// Registers the listener on the engine's loop.
    pub(crate) fn start<K: HostKey + From<FrontKey>>(
        &mut self,
        cx: &mut Cx<K>,
    ) -> std::io::Result<()> {
        let token = cx.host_token(FrontKey::Listener.into());
        cx.registry()
            .register(&mut self.listener, token, Interest::READABLE)
    }

    /// Expiry of one of the front's timers.
    pub(crate) fn on_timer<K: HostKey + From<FrontKey>>(&mut self, cx: &mut Cx<K>, key: FrontKey) {
        match key {
            FrontKey::Idle(id) => self.on_idle(cx, id),
            FrontKey::Head(id) => self.on_head_timer(cx, id),
            FrontKey::Stall(id) => self.on_stall_timer(cx, id),
            FrontKey::Listener | FrontKey::Conn(_) => {}
        }
    }

    /// A connection to write to later (a stream, a deferred answer) or to update the
    /// surface's state of. It is looked at again afterwards, so ending a response there
    /// serves the next request.
    pub(crate) fn conn_mut(&mut self, id: ConnId) -> Option<&mut Slot<P, C>> {
        if !self.slots.contains_key(&id) {
            return None;
        }
        self.look_again(id);
        self.slots.get_mut(&id)
    }

    pub(crate) fn get(&self, id: ConnId) -> Option<&Slot<P, C>> {
        self.slots.get(&id)
    }

    pub(crate) fn len(&self) -> usize {
        self.slots.len()
    }

    // ---- accept, map, cap, deadlines, close: nothing here reads what a peer sends -------

    fn accept<K: HostKey + From<FrontKey>>(&mut self, cx: &mut Cx<K>) {
        // Closing a connection to make room below must not re-enter.
        self.accept_paused = false;
        loop {
            let full = self.slots.len() >= self.caps.max_connections;
            if full && self.unadmitted.is_empty() {
                self.accept_paused = true;
                return;
            }
            match C::accept(&self.listener, &self.setup) {
                Ok(Ok(conn)) => self.take_in(cx, conn, full),
                Ok(Err(e)) => log::warn(&e),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // EMFILE and friends: retry when a connection closes.
                    log::warn(&format!("accept failed: {e}"));
                    self.accept_paused = true;
                    return;
                }
            }
        }
    }

    /// Admission at the door (see ADMISSION): a newcomer whose peer already holds its share
    /// of unadmitted connections is closed; otherwise it takes the place of the oldest
    /// unadmitted connection when every slot is taken (`full`), or when it has yet to prove
    /// itself and `max_unadmitted` have not either.
    fn take_in<K: HostKey + From<FrontKey>>(&mut self, cx: &mut Cx<K>, mut conn: C, full: bool) {
        let from_a_run = Self::from_a_run(&mut conn);
        if let Some(why) = from_a_run {
            log::warn(&format!(
                "refused the connection from {}: {why}; {}",
                conn.peer_name(),
                kin::RULE
            ));
        }
        // A refused peer is answered and closed by its type's half; until then it holds
        // a slot only as an unadmitted connection does, so it can be displaced.
        let unadmitted = conn.needs_admission() || from_a_run.is_some();
        let remote = if unadmitted {
            conn.peer_key(&self.setup)
        } else {
            None
        };
        let of_its_peer = remote.map(|key| self.unadmitted_by_peer.get(&key).copied().unwrap_or(0));
        match at_the_door(
            &self.caps,
            full,
            unadmitted,
            self.unadmitted.len(),
            of_its_peer,
        ) {
            Door::Refuse => {
                log::debug(&format!(
                    "refused a connection from {}: {} of its connections are not admitted yet",
                    conn.peer_name(),
                    self.caps.max_unadmitted_per_peer
                ));
                return;
            }
            Door::TakeOldest => {
                let now = Instant::now();
                let pending: Vec<Pending> = self
                    .unadmitted
                    .iter()
                    .filter_map(|&id| {
                        let slot = self.slots.get(&id)?;
                        Some(Pending {
                            id,
                            group: slot.conn.peer_group(),
                            protected: !slot.from_a_run
                                && slot.conn.grace_until().is_some_and(|until| until > now),
                        })
                    })
                    .collect();
                let share = self.caps.max_unadmitted_per_peer;
                let Some(victim) = displaced(&pending, conn.peer_group(), share) else {
                    log::debug(&format!(
                        "refused a connection from {}: none of the {} not admitted yet may \
                         give it their place",
                        conn.peer_name(),
                        pending.len()
                    ));
                    return;
                };
                log::debug(&format!(
                    "{} connections open, {} not admitted yet: closing the oldest of the \
                     address holding the most",
                    self.slots.len(),
                    self.unadmitted.len()
                ));
                self.close(cx, victim);
            }
            Door::In => {}
        }
        self.add(cx, conn, unadmitted, remote, from_a_run.is_some());
    }

    /// Whether the peer is a process one of our runs started (`kin`), and how we know: such
    /// a peer is never served.
    fn from_a_run(conn: &mut C) -> Option<&'static str> {
        let kin = if let Some(fd) = conn.unix_fd() {
            kin::of_unix_peer(fd)
        } else if let Some(tcp) = conn.tcp() {
            match (tcp.local_addr(), tcp.peer_addr()) {
                (Ok(local), Ok(peer)) => kin::of_tcp_peer(local, peer),
                _ => kin::Kin::Unknown("the connection's addresses cannot be read"),
            }
        } else {
            kin::Kin::Stranger
        };
        kin.refused()
    }

    /// Registers an accepted connection: socket options for a TCP one (of any kind: TCP
    /// keepalive and `TCP_USER_TIMEOUT`, `sys::set_keepalive`), registration, the idle
    /// timer, and its place among the unadmitted ones. A failing step is logged and the
    /// socket dropped.
    fn add<K: HostKey + From<FrontKey>>(
        &mut self,
        cx: &mut Cx<K>,
        mut conn: C,
        unadmitted: bool,
        remote: Option<IpAddr>,
        from_a_run: bool,
    ) {
        if let Some(tcp) = conn.tcp() {
            let _ = crate::sys::set_keepalive(crate::sys::raw_fd(tcp), TCP_KEEPALIVE_IDLE);
        }
        let id = ConnId(self.next_id);
        self.next_id += 1;
        let token = cx.host_token(FrontKey::Conn(id).into());
        if let Err(e) = cx.registry().register(
            conn.source(),
            token,
            Interest::READABLE | Interest::WRITABLE,
        ) {
            log::warn(&format!("cannot register a connection: {e}"));
            cx.forget_token(token);
            return;
        }
        let idle_timer = cx.add_timer(self.idle_timeout, FrontKey::Idle(id).into());
        self.slots.insert(
            id,
            Slot {
                conn,
                state: P::default(),
                token,
                idle_timer,
                head_timer: None,
                stall_timer: None,
                stall_acked: (None, Instant::now()),
                told_hung_up: false,
                admitted: !unadmitted,
                remote,
                from_a_run,
            },
        );
        if unadmitted {
            self.unadmitted.insert(id);
            if let Some(key) = remote {
                *self.unadmitted_by_peer.entry(key).or_insert(0) += 1;
            }
        }
        // Bytes may already be waiting (a fast client); readiness was edge-triggered
        // before we registered, so the type's half looks now (`next_event`).
        self.look_again(id);
    }

    /// Ends a connection at once (queued output is dropped); its closed event follows.
    pub(crate) fn close<K: HostKey + From<FrontKey>>(&mut self, cx: &mut Cx<K>, id: ConnId) {
        let Some(mut slot) = self.slots.remove(&id) else {
            return;
        };
        let _ = cx.registry().deregister(slot.conn.source());
        cx.forget_token(slot.token);
        cx.cancel_timer(slot.idle_timer);
        for timer in [slot.head_timer, slot.stall_timer].into_iter().flatten() {
            cx.cancel_timer(timer);
        }
        if !slot.admitted {
            self.forget_unadmitted(id, slot.remote);
        }
        slot.conn.close();
        self.events.push_back(C::closed(id, slot.state));
        if self.accept_paused {
            self.accept(cx);
        }
    }

    /// The peer of `id` proved itself (an HTTP request passed the gate, the agent's
    /// preamble was right): it leaves the unadmitted connections for good, and is never
    /// displaced. Told by the connection type's half.
    fn admitted(&mut self, id: ConnId) {
        let Some(slot) = self.slots.get_mut(&id) else {
            return;
        };
        if !slot.admitted {
            slot.admitted = true;
            let remote = slot.remote;
            self.forget_unadmitted(id, remote);
        }
    }

    /// A connection leaves the unadmitted ones (admitted, or closed before).
    fn forget_unadmitted(&mut self, id: ConnId, remote: Option<IpAddr>) {
        self.unadmitted.remove(&id);
        if let Some(key) = remote
            && let Some(n) = self.unadmitted_by_peer.get_mut(&key)
        {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.unadmitted_by_peer.remove(&key);
            }
        }
    }

    fn on_idle<K: HostKey + From<FrontKey>>(&mut self, cx: &mut Cx<K>, id: ConnId) {
        let idle = self.idle_timeout;
        let Some(slot) = self.slots.get_mut(&id) else {
            return;
        };
        let step = idle_step(
            self.keepalive,
            idle,
            slot.conn.last_activity().elapsed(),
            slot.conn.is_streaming(),
            slot.conn.awaiting_response(),
        );
        let wait = match step {
            IdleStep::Close => {
                self.close(cx, id);
                return;
            }
            IdleStep::Ping(wait) => {
                slot.conn.stream_chunk(KEEPALIVE_COMMENT);
                // A failed write closes the connection; have it noticed.
                self.look_again(id);
                wait
            }
            IdleStep::Wait(wait) => wait,
        };
        if let Some(slot) = self.slots.get_mut(&id) {
            slot.idle_timer = cx.add_timer(wait, FrontKey::Idle(id).into());
        }
    }

    /// After the type's half read, wrote or served a connection: its deadlines follow what
    /// it is doing now (`watch_head`, `watch_stall`).
    fn watch<K: HostKey + From<FrontKey>>(&mut self, cx: &mut Cx<K>, id: ConnId) {
        self.watch_head(cx, id);
        self.watch_stall(cx, id);
    }

    /// Arms the head deadline when a head has begun, and drops it once none is under way.
    fn watch_head<K: HostKey + From<FrontKey>>(&mut self, cx: &mut Cx<K>, id: ConnId) {
        let Some(slot) = self.slots.get_mut(&id) else {
            return;
        };
        match (slot.conn.head_started(), slot.head_timer) {
            (Some(started), None) => {
                let left = head_time_left(started.elapsed()).unwrap_or(MIN_REARM);
                slot.head_timer =
                    Some(cx.add_timer(left.max(MIN_REARM), FrontKey::Head(id).into()));
            }
            (None, Some(timer)) => {
                cx.cancel_timer(timer);
                slot.head_timer = None;
            }
            _ => {}
        }
    }

    fn on_head_timer<K: HostKey + From<FrontKey>>(&mut self, cx: &mut Cx<K>, id: ConnId) {
        let Some(slot) = self.slots.get_mut(&id) else {
            return;
        };
        slot.head_timer = None;
        let Some(started) = slot.conn.head_started() else {
            return;
        };
        if head_time_left(started.elapsed()).is_none() {
            log::debug(&format!(
                "closing the connection from {}: no complete request head within {}s",
                slot.conn.peer_name(),
                HEAD_DEADLINE.as_secs()
            ));
            self.close(cx, id);
            return;
        }
        // This head began after the one the timer was armed for.
        self.watch_head(cx, id);
    }

    /// Starts looking (every `STALL_CHECK`) at a connection whose output may wait on the
    /// peer: queued here, or anything on an open stream (the kernel may hold it while our
    /// queue is empty, and only asking it tells), noting what the peer has acknowledged so
    /// far. The looks go on while output waits here or in the kernel. The timer is left
    /// armed when the output drains (it then finds nothing waiting and stops): a fast
    /// stream's queue fills and drains many times a second, and every cancelled timer would
    /// stay in the reactor's heap until its deadline.
    fn watch_stall<K: HostKey + From<FrontKey>>(&mut self, cx: &mut Cx<K>, id: ConnId) {
        let Some(slot) = self.slots.get_mut(&id) else {
            return;
        };
        let may_wait = slot.conn.write_stalled_for().is_some() || slot.conn.is_streaming();
        if slot.stall_timer.is_none() && may_wait {
            let kernel = slot
                .conn
                .tcp()
                .and_then(|tcp| crate::sys::tcp_send_state(crate::sys::raw_fd(tcp)));
            slot.stall_acked = (kernel.map(|k| k.acked), Instant::now());
            slot.stall_timer = Some(cx.add_timer(STALL_CHECK, FrontKey::Stall(id).into()));
        }
    }

    fn on_stall_timer<K: HostKey + From<FrontKey>>(&mut self, cx: &mut Cx<K>, id: ConnId) {
        let Some(slot) = self.slots.get_mut(&id) else {
            return;
        };
        slot.stall_timer = None;
        let stalled = slot.conn.write_stalled_for();
        let kernel = slot
            .conn
            .tcp()
            .and_then(|tcp| crate::sys::tcp_send_state(crate::sys::raw_fd(tcp)));
        if stalled.is_none() && !kernel.is_some_and(|k| k.queued) {
            // Everything went out and was acknowledged.
            return;
        }
        let acked = kernel.map(|k| k.acked);
        if acked != slot.stall_acked.0 {
            slot.stall_acked = (acked, Instant::now());
        }
        if peer_gone(acked, slot.stall_acked.1.elapsed(), stalled) {
            log::debug(&format!(
                "closing the connection from {}: output waited {}s with nothing taken",
                slot.conn.peer_name(),
                WRITE_STALL_DEADLINE.as_secs()
            ));
            self.close(cx, id);
            return;
        }
        slot.stall_timer = Some(cx.add_timer(STALL_CHECK, FrontKey::Stall(id).into()));
    }

    fn look_again(&mut self, id: ConnId) {
        if !self.dirty.contains(&id) {
            self.dirty.push_back(id);
        }
    }
}

impl<P: Default> Front<P> {
    // ---- HTTP: requests in, through the gate --------------------------------------------

    /// Readiness of one of the front's sources.
    pub(crate) fn on_io<K: HostKey + From<FrontKey>>(&mut self, cx: &mut Cx<K>, key: FrontKey) {
        match key {
            FrontKey::Listener => self.accept(cx),
            FrontKey::Conn(id) => self.on_ready(cx, id),
            FrontKey::Idle(_) | FrontKey::Head(_) | FrontKey::Stall(_) => {}
        }
    }

    /// The next thing the surface must act on; call until `None` after every callback
    /// that reached the front or wrote to a connection.
    pub(crate) fn next_event<K: HostKey + From<FrontKey>>(
        &mut self,
        cx: &mut Cx<K>,
    ) -> Option<Event<P>> {
        loop {
            if let Some(event) = self.events.pop_front() {
                // A connection closed after its event was queued has nobody to answer.
                let gone = match &event {
                    Event::Request(id, _) | Event::Writable(id) | Event::HungUp(id) => {
                        !self.slots.contains_key(id)
                    }
                    Event::Closed(..) => false,
                };
                if !gone {
                    return Some(event);
                }
                continue;
            }
            let id = self.dirty.pop_front()?;
            self.service(cx, id);
        }
    }

    /// Answers the request `Event::Request` handed out for `id`.
    pub(crate) fn reply(&mut self, id: ConnId, reply: Reply) {
        let Some(slot) = self.slots.get_mut(&id) else {
            return;
        };
        match reply {
            Reply::Full(response) => {
                slot.conn
                    .respond(response.status, &response.header_refs(), &response.body);
            }
            Reply::Stream { response, open } => {
                slot.conn
                    .start_stream(response.status, &response.header_refs());
                slot.conn.stream_chunk(&response.body);
                if !open {
                    slot.conn.end_stream();
                }
            }
            Reply::Later => {}
        }
        self.look_again(id);
    }

    fn on_ready<K: HostKey + From<FrontKey>>(&mut self, cx: &mut Cx<K>, id: ConnId) {
        let Some(slot) = self.slots.get_mut(&id) else {
            return;
        };
        for event in slot.conn.on_ready() {
            match event {
                ConnEvent::Head(head) => self.admit(id, head),
                // Its head passed the gate.
                ConnEvent::Request(request) => self.events.push_back(Event::Request(id, request)),
                ConnEvent::Writable => self.events.push_back(Event::Writable(id)),
                ConnEvent::Closed => {
                    self.close(cx, id);
                    return;
                }
            }
        }
        self.watch(cx, id);
        self.look_again(id);
    }

    /// After a response completed or the surface wrote: finish closing, report a hang-up,
    /// or hand out the request a client already sent.
    fn service<K: HostKey + From<FrontKey>>(&mut self, cx: &mut Cx<K>, id: ConnId) {
        let Some(slot) = self.slots.get_mut(&id) else {
            return;
        };
        if slot.conn.is_closed() {
            self.close(cx, id);
            return;
        }
        if !slot.conn.is_streaming() {
            slot.told_hung_up = false;
        } else if slot.conn.peer_eof() && !slot.told_hung_up {
            slot.told_hung_up = true;
            self.events.push_back(Event::HungUp(id));
        }
        // `None` while a response is pending; reading may have paused meanwhile, and no
        // readiness comes for bytes that were already waiting. An admitted head's request
        // may follow at once.
        if let Some(head) = slot.conn.next_head() {
            self.admit(id, head);
        }
        if let Some(request) = self
            .slots
            .get_mut(&id)
            .and_then(|slot| slot.conn.next_request())
        {
            self.events.push_back(Event::Request(id, request));
        }
        if self
            .slots
            .get(&id)
            .is_some_and(|slot| slot.conn.is_closed())
        {
            self.close(cx, id);
            return;
        }
        self.watch(cx, id);
    }

    /// The gate, on a request's head before any of its body is read and before any surface
    /// sees it: the browser rule, then the bearer token. (They never both apply: the first
    /// concerns loopback peers, the second remote ones.) A refused request is answered here
    /// and the connection looked at again; an admitted one reads its body and comes out of
    /// `Connection` as a request for the surface, and its connection is admitted.
    fn admit(&mut self, id: ConnId, request: Request) {
        let Some(slot) = self.slots.get_mut(&id) else {
            return;
        };
        if slot.from_a_run {
            let mut response = (self.setup.policy.forbidden)(kin::RULE);
            if !response
                .headers
                .iter()
                .any(|(name, _)| *name == "connection")
            {
                response = response.header("connection", "close");
            }
            slot.conn
                .respond(response.status, &response.header_refs(), &response.body);
            self.look_again(id);
            return;
        }
        let gate = &self.setup.config.gate;
        let peer = gate.classify(&slot.conn.peer().ip());
        if let Err(reason) =
            gate.check_browser_headers(peer, request.header("host"), request.header("origin"))
        {
            log::debug(&format!("refused {}: {reason}", slot.conn.peer()));
            let response = (self.setup.policy.forbidden)(reason);
            slot.conn
                .respond(response.status, &response.header_refs(), &response.body);
            self.look_again(id);
            return;
        }
        if let Decision::Deny(reason) = gate.authorize(peer, request.header("authorization")) {
            if let Some(response) = (self.setup.policy.public)(&request) {
                let response = response.header("connection", "close");
                slot.conn
                    .respond(response.status, &response.header_refs(), &response.body);
                self.look_again(id);
                return;
            }
            log::debug(&format!("refused {}: {reason}", slot.conn.peer()));
            slot.conn.respond(
                401,
                &[
                    ("content-type", "text/plain; charset=utf-8"),
                    ("www-authenticate", "Bearer"),
                    // An unauthenticated peer does not get to keep a connection slot.
                    ("connection", "close"),
                ],
                b"unauthorized",
            );
            self.look_again(id);
            return;
        }
        slot.conn.admit(request);
        self.admitted(id);
        self.look_again(id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const IDLE: Duration = Duration::from_secs(60);

    fn secs(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    #[test]
    fn a_connection_not_yet_idle_is_looked_at_when_it_would_be() {
        for keepalive in [Keepalive::Silent, Keepalive::Comment] {
            for (streaming, awaiting) in [(false, false), (false, true), (true, true)] {
                assert_eq!(
                    idle_step(keepalive, IDLE, secs(45), streaming, awaiting),
                    IdleStep::Wait(secs(15))
                );
                // A timer that fires a hair early does not spin.
                assert_eq!(
                    idle_step(
                        keepalive,
                        IDLE,
                        IDLE - Duration::from_micros(1),
                        streaming,
                        awaiting
                    ),
                    IdleStep::Wait(MIN_REARM)
                );
            }
        }
    }

    #[test]
    fn an_idle_request_response_connection_closes_unless_an_answer_is_due() {
        for keepalive in [Keepalive::Silent, Keepalive::Comment] {
            assert_eq!(
                idle_step(keepalive, IDLE, IDLE, false, false),
                IdleStep::Close
            );
            assert_eq!(
                idle_step(keepalive, IDLE, secs(600), false, false),
                IdleStep::Close
            );
            // A deferred answer (an MCP long-poll) is on its way: keep waiting for it.
            assert_eq!(
                idle_step(keepalive, IDLE, secs(90), false, true),
                IdleStep::Wait(IDLE)
            );
        }
    }

    #[test]
    fn a_quiet_stream_is_kept_the_way_its_surface_chose() {
        assert_eq!(
            idle_step(Keepalive::Silent, IDLE, secs(61), true, true),
            IdleStep::Wait(IDLE)
        );
        assert_eq!(
            idle_step(Keepalive::Comment, IDLE, secs(61), true, true),
            IdleStep::Ping(IDLE)
        );
        // Never closed for being quiet, however long.
        for quiet in [IDLE, secs(3600), secs(86_400)] {
            assert_ne!(
                idle_step(Keepalive::Silent, IDLE, quiet, true, true),
                IdleStep::Close
            );
            assert_ne!(
                idle_step(Keepalive::Comment, IDLE, quiet, true, true),
                IdleStep::Close
            );
        }
    }

    #[test]
    fn a_head_has_until_the_deadline_and_not_a_moment_more() {
        assert_eq!(head_time_left(Duration::ZERO), Some(HEAD_DEADLINE));
        assert_eq!(head_time_left(secs(5)), Some(HEAD_DEADLINE - secs(5)));
        assert_eq!(head_time_left(HEAD_DEADLINE), None);
        assert_eq!(head_time_left(HEAD_DEADLINE + secs(1)), None);
        assert!((Duration::from_secs(10)..=Duration::from_secs(30)).contains(&HEAD_DEADLINE));
    }

    #[test]
    fn a_peer_that_acknowledged_nothing_while_output_waited_a_deadline_is_gone() {
        // Acknowledgements decide, however much (or little) the kernel took of our queue.
        assert!(peer_gone(Some(4096), WRITE_STALL_DEADLINE, None));
        assert!(peer_gone(Some(4096), WRITE_STALL_DEADLINE, Some(secs(1))));
        assert!(peer_gone(Some(1), secs(600), Some(Duration::ZERO)));
        assert!(!peer_gone(
            Some(4096),
            WRITE_STALL_DEADLINE - secs(1),
            Some(secs(600))
        ));
        // The kernel cannot tell: our own queue's progress decides.
        assert!(!peer_gone(
            None,
            secs(600),
            Some(WRITE_STALL_DEADLINE - secs(1))
        ));
        assert!(!peer_gone(None, secs(600), None));
        assert!(peer_gone(None, Duration::ZERO, Some(WRITE_STALL_DEADLINE)));
        // Longer than any heartbeat period, shorter than the idle timeout; looked at often
        // enough that the deadline is kept to within a fraction of itself.
        assert!((secs(20)..=secs(60)).contains(&WRITE_STALL_DEADLINE));
        assert!(STALL_CHECK * 4 <= WRITE_STALL_DEADLINE);
    }

    #[test]
    fn peers_are_counted_by_address_and_ipv6_hosts_by_their_slash_64() {
        let ip = |text: &str| text.parse::<IpAddr>().expect("address");
        assert_eq!(peer_key(ip("203.0.113.7")), ip("203.0.113.7"));
        // What a dual-stack listener reports for an IPv4 client is that client.
        assert_eq!(peer_key(ip("::ffff:203.0.113.7")), ip("203.0.113.7"));
        // One host's /64 is one peer, however many addresses it takes from it.
        assert_eq!(peer_key(ip("2001:db8:1:2:aaaa::1")), ip("2001:db8:1:2::"));
        assert_eq!(
            peer_key(ip("2001:db8:1:2:ffff:ffff:ffff:ffff")),
            ip("2001:db8:1:2::")
        );
        assert_ne!(peer_key(ip("2001:db8:1:3::1")), ip("2001:db8:1:2::"));
        // Far more than an honest client has waiting at once, far less than the slots.
        assert!((4..=DEFAULT_MAX_CONNECTIONS / 8).contains(&MAX_UNADMITTED_PER_PEER));
    }

    #[test]
    fn a_newcomer_is_refused_past_its_peers_share_and_displaces_the_oldest_unadmitted() {
        // HTTP: only the slots bound unadmitted connections.
        let http = Caps {
            max_connections: 24,
            max_unadmitted: 24,
            max_unadmitted_per_peer: MAX_UNADMITTED_PER_PEER,
        };
        assert_eq!(at_the_door(&http, false, true, 3, Some(2)), Door::In);
        assert_eq!(
            at_the_door(&http, false, true, 20, Some(MAX_UNADMITTED_PER_PEER)),
            Door::Refuse
        );
        // Refused even when the slots are full: a capped peer displaces nobody.
        assert_eq!(
            at_the_door(&http, true, true, 24, Some(MAX_UNADMITTED_PER_PEER)),
            Door::Refuse
        );
        assert_eq!(at_the_door(&http, true, true, 5, Some(0)), Door::TakeOldest);
        // A loopback peer is not counted, so never refused.
        assert_eq!(at_the_door(&http, true, true, 24, None), Door::TakeOldest);
        assert_eq!(at_the_door(&http, false, true, 23, None), Door::In);

        // The agent: at most 16 in their preamble, 8 of them from one address, in 32 slots.
        let agent = Caps {
            max_connections: 32,
            max_unadmitted: 16,
            max_unadmitted_per_peer: 8,
        };
        assert_eq!(at_the_door(&agent, false, true, 15, Some(7)), Door::In);
        assert_eq!(at_the_door(&agent, false, true, 16, None), Door::TakeOldest);
        assert_eq!(at_the_door(&agent, false, true, 16, Some(8)), Door::Refuse);
        // One admitted as it is accepted (the Unix socket) takes a free slot however many
        // others are still proving themselves, and the oldest of them only when none is free.
        assert_eq!(at_the_door(&agent, false, false, 16, None), Door::In);
        assert_eq!(at_the_door(&agent, true, false, 16, None), Door::TakeOldest);
    }

    #[test]
    fn selfclient_the_address_holding_the_most_is_displaced_first_and_a_grace_is_kept() {
        let ip = |text: &str| Some(text.parse::<IpAddr>().expect("address"));
        let p = |id: u64, group: Option<IpAddr>, protected: bool| Pending {
            id: ConnId(id),
            group,
            protected,
        };
        let (flood, client, other) = (ip("127.0.0.2"), ip("127.0.0.1"), ip("203.0.113.9"));
        let share = 8;
        // The client's connection is the oldest, the flood's hold the most: the oldest of
        // those goes, whoever comes.
        let pending = [
            p(1, client, false),
            p(2, flood, false),
            p(3, flood, false),
            p(4, flood, false),
        ];
        assert_eq!(displaced(&pending, flood, share), Some(ConnId(2)));
        assert_eq!(displaced(&pending, client, share), Some(ConnId(2)));
        // Within its share, a connection in its grace is passed over.
        let pending = [
            p(1, client, false),
            p(2, flood, true),
            p(3, flood, false),
            p(4, flood, true),
        ];
        assert_eq!(displaced(&pending, other, share), Some(ConnId(3)));
        // A newcomer never pushes out a smaller share: with the flood all in its grace, the
        // client mid-handshake stays and the flood's newcomer is refused...
        let pending = [p(1, client, false), p(2, flood, true), p(3, flood, true)];
        assert_eq!(displaced(&pending, flood, share), None);
        // ...while one of the client's own address may take its place.
        assert_eq!(displaced(&pending, client, share), Some(ConnId(1)));
        // A flood past its share keeps no grace.
        let mut pending = vec![p(1, client, true)];
        pending.extend((2..=10).map(|id| p(id, flood, true)));
        assert_eq!(displaced(&pending, flood, share), Some(ConnId(2)));
        assert_eq!(displaced(&pending, other, share), Some(ConnId(2)));
        // Everyone within the grace and their shares: nobody; the newcomer is refused.
        let pending = [p(1, client, true), p(2, flood, true)];
        assert_eq!(displaced(&pending, other, share), None);
        assert_eq!(displaced(&[], other, share), None);
        // A tie: the oldest of the tied shares.
        let pending = [
            p(1, client, false),
            p(2, other, false),
            p(3, client, false),
            p(4, other, false),
        ];
        assert_eq!(displaced(&pending, flood, share), Some(ConnId(1)));
        // HTTP keeps no grace: the oldest of the largest share, as before for one address.
        let pending = [p(1, None, false), p(2, None, false)];
        assert_eq!(
            displaced(&pending, None, MAX_UNADMITTED_PER_PEER),
            Some(ConnId(1))
        );
    }

    #[test]
    fn responses_carry_their_fields_in_order() {
        let response = Response::json(404, "{}").header("allow", "GET");
        assert_eq!(
            response.header_refs(),
            vec![("content-type", "application/json"), ("allow", "GET")]
        );
        assert_eq!(
            Reply::from(Response::empty(202)),
            Reply::Full(Response::empty(202))
        );
    }
}
