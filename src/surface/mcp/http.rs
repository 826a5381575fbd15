//! Streamable HTTP (MCP 2025-11-25 §transports) at `/mcp`, on the engine's loop:
//! `POST` carries one JSON-RPC message (a request is answered with JSON, or with an SSE
//! stream when the answer waits or server requests are queued), `GET` opens the session's
//! stream for messages unrelated to a request, `DELETE` ends the session. Sessions are
//! named by `Mcp-Session-Id`; `MCP-Protocol-Version` must be one we speak; `Host` and
//! `Origin` are checked against DNS rebinding; the shared auth gate and optional TLS apply
//! as on every drive surface (DESIGN §4.6).
//!
//! It owns the listener, the connections and each session's transport state (its `GET`
//! stream, the messages waiting for one); what the messages mean is `McpHost`'s business.

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use mio::net::TcpListener;
use mio::{Interest, Token};
use serde_json::json;

use super::{McpHost, McpKey, Outcome, Route, SUPPORTED_VERSIONS, Session, SessionKey};
use crate::auth::{Decision, Peer};
use crate::http::server::{ConnEvent, Connection, Request};
use crate::jsonrpc::{self, Id, Message};
use crate::log;
use crate::reactor::TimerId;
use crate::surface::host::Cx;
use crate::surface::{AcceptStep, ListenConfig, accept_next, register_connection};

pub const PATH: &str = "/mcp";
/// Sessions kept at once; past it the least recently used idle one is dropped.
const MAX_SESSIONS: usize = 1024;
/// Server requests held for a session with no open stream; the oldest go first.
const MAX_PENDING: usize = 64;
/// Silence after which the kernel probes a connection whose peer may have vanished (a

#[derive(Clone, Debug)]
enum Role {
    /// Request-response (or nothing yet).
    Plain,
    /// The pending answer to `id`: an SSE stream, or (for a client that only accepts JSON)
    /// a response held back until the answer is ready.
    Reply {
        session: SessionKey,
        id: Id,
        sse: bool,
    },
    /// The session's `GET` stream.
    Listen { session: SessionKey },
}

struct HttpConn {
    conn: Connection,
    token: Token,
    idle_timer: TimerId,
    role: Role,
}

struct HttpSession {
    id: String,
    listen: Option<u64>,
    /// Server-to-client requests (with our id) waiting for a stream to go out on.
    pending: VecDeque<(i64, String)>,
    last_used: Instant,
}

pub(super) struct HttpSide {
    config: ListenConfig,
    listener: TcpListener,
    listener_token: Option<Token>,
    conns: HashMap<u64, HttpConn>,
    next_key: u64,
    accept_paused: bool,
    sessions: HashMap<SessionKey, HttpSession>,
    by_id: HashMap<String, SessionKey>,
    next_session: SessionKey,
    /// Which connection carries the answer to a session's request.
    replies: HashMap<(SessionKey, Id), u64>,
    /// Connections whose response just completed: serve what they sent next.
    dirty: Vec<u64>,
}

fn sse_event(text: &str) -> String {
    format!("event: message\ndata: {text}\n\n")
}

fn message_text(message: &Message) -> String {
    let mut line = jsonrpc::to_line(message);
    line.pop();
    String::from_utf8(line).unwrap_or_default()
}

/// A JSON-RPC error body for transport-level refusals (no request id to answer).
fn rpc_error(code: i64, message: &str) -> Vec<u8> {
    json!({"jsonrpc": "2.0", "id": null, "error": {"code": code, "message": message}})
        .to_string()
        .into_bytes()
}

/// A cryptographically random session id (visible ASCII, as the spec asks).
fn new_session_id() -> String {
    use ring::rand::SecureRandom;
    let mut bytes = [0u8; 16];
    if ring::rand::SystemRandom::new().fill(&mut bytes).is_err() {
        // No randomness: refuse to hand out a guessable id; the caller answers 500.
        return String::new();
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The host part of a `Host` header or an origin's authority, without the port.
fn hostname(authority: &str) -> &str {
    if authority.starts_with('[') {
        return authority
            .find(']')
            .map_or(authority, |end| &authority[..=end]);
    }
    authority.split(':').next().unwrap_or(authority)
}

fn is_loopback_name(host: &str) -> bool {
    let host = host.to_ascii_lowercase();
    if host == "localhost" || host == "[::1]" {
        return true;
    }
    host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// Which of our two response types a client accepts.
fn accepts(request: &Request) -> (bool, bool) {
    let Some(accept) = request.header("accept") else {
        return (true, true);
    };
    let accept = accept.to_ascii_lowercase();
    let any = accept.contains("*/*");
    (
        any || accept.contains("application/json") || accept.contains("application/*"),
        any || accept.contains("text/event-stream") || accept.contains("text/*"),
    )
}

impl HttpSide {
    pub(super) fn bind(config: ListenConfig) -> std::io::Result<HttpSide> {
        let listener = TcpListener::bind(config.addr)?;
        Ok(HttpSide {
            config,
            listener,
            listener_token: None,
            conns: HashMap::new(),
            next_key: 0,
            accept_paused: false,
            sessions: HashMap::new(),
            by_id: HashMap::new(),
            next_session: 1,
            replies: HashMap::new(),
            dirty: Vec::new(),
        })
    }

    pub(super) fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Writes one SSE event on a stream. A `droppable` one (a notification) is skipped
    /// while the client is not reading, so a stalled reader cannot grow our buffers.
    fn write_event(&mut self, key: u64, text: &str, droppable: bool) -> bool {
        let Some(c) = self.conns.get_mut(&key) else {
            return false;
        };
        if droppable && !c.conn.wants_more_stream() {
            return false;
        }
        match c.role {
            Role::Listen { .. } | Role::Reply { sse: true, .. } if c.conn.is_streaming() => {
                c.conn.stream_chunk(sse_event(text).as_bytes());
                true
            }
            _ => false,
        }
    }

    /// Sends the answer on the connection that waits for it and ends that response.
    fn write_final(&mut self, key: u64, text: &str) {
        let Some(c) = self.conns.get_mut(&key) else {
            return;
        };
        match c.role {
            Role::Reply { sse: true, .. } => {
                c.conn.stream_chunk(sse_event(text).as_bytes());
                c.conn.end_stream();
            }
            Role::Reply { sse: false, .. } => {
                c.conn.respond(
                    200,
                    &[("content-type", "application/json")],
                    text.as_bytes(),
                );
            }
            _ => return,
        }
        c.role = Role::Plain;
        self.dirty.push(key);
    }

    /// Puts a message on the right stream of `session` (see `Route`). A server request
    /// with nowhere to go waits for the session's next stream; a notification is dropped.
    pub(super) fn deliver(&mut self, session: SessionKey, route: Route, message: &Message) {
        let text = message_text(message);
        let droppable = matches!(message, Message::Notification { .. });
        match route {
            Route::Reply(id) => {
                if let Some(key) = self.replies.remove(&(session, id.clone())) {
                    self.write_final(key, &text);
                }
            }
            Route::Related(id) => {
                if let Some(key) = self.replies.get(&(session, id.clone())).copied() {
                    self.write_event(key, &text, droppable);
                }
            }
            Route::Unrelated => {
                let listen = self.sessions.get(&session).and_then(|s| s.listen);
                if let Some(key) = listen
                    && self.write_event(key, &text, droppable)
                {
                    return;
                }
                let streams: Vec<u64> = self
                    .replies
                    .iter()
                    .filter(|((s, _), _)| *s == session)
                    .map(|(_, key)| *key)
                    .collect();
                for key in streams {
                    if self.write_event(key, &text, droppable) {
                        return;
                    }
                }
                if let Message::Request {
                    id: Id::Num(request),
                    ..
                } = message
                    && let Some(s) = self.sessions.get_mut(&session)
                {
                    if s.pending.len() >= MAX_PENDING {
                        s.pending.pop_front();
                    }
                    s.pending.push_back((*request, text));
                }
            }
        }
    }

    /// Withdraws a queued server request that never went out; false if it was sent.
    pub(super) fn retract(&mut self, session: SessionKey, request: i64) -> bool {
        let Some(s) = self.sessions.get_mut(&session) else {
            return true;
        };
        let before = s.pending.len();
        s.pending.retain(|(id, _)| *id != request);
        s.pending.len() != before
    }

    /// Ends the response for a request that will not be answered (it was cancelled).
    pub(super) fn abandon(&mut self, session: SessionKey, id: &Id) {
        let Some(key) = self.replies.remove(&(session, id.clone())) else {
            return;
        };
        let Some(c) = self.conns.get_mut(&key) else {
            return;
        };
        match c.role {
            Role::Reply { sse: true, .. } => c.conn.end_stream(),
            Role::Reply { sse: false, .. } => c.conn.respond(202, &[], b""),
            _ => return,
        }
        c.role = Role::Plain;
        self.dirty.push(key);
    }

    /// Queued server requests for `session`, to send on a stream that just opened.
    fn flush_pending(&mut self, session: SessionKey, key: u64) {
        let pending: Vec<(i64, String)> = self
            .sessions
            .get_mut(&session)
            .map(|s| s.pending.drain(..).collect())
            .unwrap_or_default();
        for (_, text) in pending {
            self.write_event(key, &text, false);
        }
    }

    fn respond(&mut self, key: u64, status: u16, headers: &[(&str, &str)], body: &[u8]) {
        if let Some(c) = self.conns.get_mut(&key) {
            c.conn.respond(status, headers, body);
        }
    }

    fn respond_error(&mut self, key: u64, status: u16, code: i64, message: &str) {
        self.respond(
            key,
            status,
            &[("content-type", "application/json")],
            &rpc_error(code, message),
        );
    }

    /// Opens an SSE response on `key` in the given role.
    fn start_sse(&mut self, key: u64, session_id: &str, role: Role) {
        if let Some(c) = self.conns.get_mut(&key) {
            c.conn.start_stream(
                200,
                &[
                    ("content-type", "text/event-stream"),
                    ("cache-control", "no-cache"),
                    ("mcp-session-id", session_id),
                ],
            );
            c.role = role;
        }
    }
}

impl McpHost {
    /// Registers the listener on the engine's loop.
    pub(super) fn start_http(&mut self, ctx: &mut Cx<McpKey>) -> std::io::Result<()> {
        let Some(http) = self.http.as_mut() else {
            return Ok(());
        };
        let token = ctx.host_token(McpKey::Listener);
        ctx.registry()
            .register(&mut http.listener, token, Interest::READABLE)?;
        http.listener_token = Some(token);
        Ok(())
    }

    pub(super) fn accept(&mut self, ctx: &mut Cx<McpKey>) {
        loop {
            let Some(http) = self.http.as_mut() else {
                return;
            };
            let open = http.conns.len();
            match accept_next(&http.listener, open, http.config.max_connections) {
                AcceptStep::Conn(tcp, peer) => self.add_conn(ctx, tcp, peer),
                AcceptStep::Drained => {
                    http.accept_paused = false;
                    return;
                }
                // `close_conn` resumes accepting.
                AcceptStep::Full | AcceptStep::Failed => {
                    http.accept_paused = true;
                    return;
                }
            }
        }
    }

    fn add_conn(&mut self, ctx: &mut Cx<McpKey>, tcp: mio::net::TcpStream, peer: SocketAddr) {
        let Some(http) = self.http.as_mut() else {
            return;
        };
        let key = http.next_key;
        http.next_key += 1;
        let Some(accepted) = register_connection(ctx, &http.config, tcp, peer, McpKey::Conn(key))
        else {
            return;
        };
        http.conns.insert(
            key,
            HttpConn {
                conn: accepted.conn,
                token: accepted.token,
                idle_timer: accepted.idle_timer,
                role: Role::Plain,
            },
        );
        // Bytes may already be waiting; readiness fired before we registered.
        self.on_conn_ready(ctx, key);
    }

    fn close_conn(&mut self, ctx: &mut Cx<McpKey>, key: u64) {
        let Some(http) = self.http.as_mut() else {
            return;
        };
        let Some(mut c) = http.conns.remove(&key) else {
            return;
        };
        let _ = ctx.registry().deregister(c.conn.tcp());
        ctx.forget_token(c.token);
        ctx.cancel_timer(c.idle_timer);
        c.conn.close();
        match c.role {
            Role::Reply { session, id, .. } => {
                // A disconnect is not a cancel, but the answer has nowhere to go now. Only
                // this connection's own entry goes (never another request's).
                if http.replies.get(&(session, id.clone())) == Some(&key) {
                    http.replies.remove(&(session, id.clone()));
                    self.drop_request_wait(ctx, session, &id);
                }
            }
            Role::Listen { session } => {
                if let Some(s) = http.sessions.get_mut(&session)
                    && s.listen == Some(key)
                {
                    s.listen = None;
                }
            }
            Role::Plain => {}
        }
        if self.http.as_ref().is_some_and(|h| h.accept_paused) {
            self.accept(ctx);
        }
    }

    pub(super) fn on_conn_ready(&mut self, ctx: &mut Cx<McpKey>, key: u64) {
        let Some(c) = self.http.as_mut().and_then(|h| h.conns.get_mut(&key)) else {
            return;
        };
        let events = c.conn.on_ready();
        for event in events {
            match event {
                ConnEvent::Request(request) => self.on_http_request(ctx, key, request),
                ConnEvent::Writable => {}
                ConnEvent::Closed => {
                    self.close_conn(ctx, key);
                    return;
                }
            }
        }
        // A GET stream whose reader hung up will never be read. (A half-closed client
        // waiting on a POST reply still gets its answer.)
        if let Some(c) = self.http.as_ref().and_then(|h| h.conns.get(&key))
            && matches!(c.role, Role::Listen { .. })
            && c.conn.is_streaming()
            && c.conn.peer_eof()
        {
            self.close_conn(ctx, key);
            return;
        }
        self.serve_next(ctx, key);
    }

    /// Serves requests a client sent while the previous response was pending, and drops
    /// connections that finished closing.
    fn serve_next(&mut self, ctx: &mut Cx<McpKey>, key: u64) {
        loop {
            let Some(c) = self.http.as_mut().and_then(|h| h.conns.get_mut(&key)) else {
                return;
            };
            if c.conn.is_closed() {
                self.close_conn(ctx, key);
                return;
            }
            if !matches!(c.role, Role::Plain) || c.conn.is_streaming() {
                return;
            }
            match c.conn.next_request() {
                Some(request) => self.on_http_request(ctx, key, request),
                None => return,
            }
        }
    }

    /// Connections whose response completed since the last look.
    pub(super) fn http_service(&mut self, ctx: &mut Cx<McpKey>) {
        loop {
            let Some(key) = self.http.as_mut().and_then(|h| h.dirty.pop()) else {
                return;
            };
            self.serve_next(ctx, key);
        }
    }

    pub(super) fn http_timer(&mut self, ctx: &mut Cx<McpKey>, key: u64) {
        let Some(http) = self.http.as_mut() else {
            return;
        };
        let idle = http.config.limits.idle_timeout;
        let Some(c) = http.conns.get_mut(&key) else {
            return;
        };
        let quiet = c.conn.last_activity().elapsed();
        let streaming = c.conn.is_streaming();
        if quiet >= idle {
            if streaming {
                // An SSE comment keeps proxies and dead-peer detection honest.
                c.conn.stream_chunk(b": keepalive\n\n");
            } else if !c.conn.awaiting_response() {
                self.close_conn(ctx, key);
                return;
            }
        }
        let Some(c) = self.http.as_mut().and_then(|h| h.conns.get_mut(&key)) else {
            return;
        };
        let wait = if quiet >= idle { idle } else { idle - quiet };
        c.idle_timer = ctx.add_timer(wait.max(Duration::from_millis(10)), McpKey::Conn(key));
    }

    /// Host and Origin, against DNS rebinding: a peer that reached us without a token
    /// (loopback) must have used a loopback name, and a browser page must be from one.
    fn origin_allowed(&self, request: &Request, peer: Peer) -> Result<(), &'static str> {
        let host = request.header("host").map(hostname);
        if peer == Peer::Loopback && host.is_some_and(|h| !is_loopback_name(h)) {
            return Err("Forbidden: Host header is not a loopback name");
        }
        if let Some(origin) = request.header("origin") {
            let authority = origin
                .split_once("://")
                .map(|(_, rest)| rest.split('/').next().unwrap_or(rest));
            let allowed = authority.map(hostname).is_some_and(|o| {
                is_loopback_name(o) || host.is_some_and(|h| h.eq_ignore_ascii_case(o))
            });
            if !allowed {
                return Err("Forbidden: Origin not allowed");
            }
        }
        Ok(())
    }

    fn on_http_request(&mut self, ctx: &mut Cx<McpKey>, key: u64, request: Request) {
        let Some(http) = self.http.as_mut() else {
            return;
        };
        let Some(c) = http.conns.get_mut(&key) else {
            return;
        };
        let peer = http.config.gate.classify(&c.conn.peer().ip());
        if let Decision::Deny(reason) = http
            .config
            .gate
            .authorize(peer, request.header("authorization"))
        {
            log::debug(&format!("refused {}: {}", c.conn.peer(), reason.as_str()));
            c.conn.respond(
                401,
                &[
                    ("content-type", "text/plain; charset=utf-8"),
                    ("www-authenticate", "Bearer"),
                    // An unauthenticated peer does not get to keep a connection slot.
                    ("connection", "close"),
                ],
                b"unauthorized",
            );
            return;
        }
        if request.path != PATH {
            http.respond(
                key,
                404,
                &[("content-type", "application/json")],
                json!({"error": "not found: MCP is served at /mcp"})
                    .to_string()
                    .as_bytes(),
            );
            return;
        }
        if let Err(why) = self.origin_allowed(&request, peer) {
            if let Some(http) = self.http.as_mut() {
                http.respond_error(key, 403, -32000, why);
            }
            return;
        }
        match request.method.as_str() {
            "POST" => self.http_post(ctx, key, &request),
            "GET" => self.http_get(key, &request),
            "DELETE" => self.http_delete(ctx, key, &request),
            _ => {
                if let Some(http) = self.http.as_mut() {
                    http.respond(
                        key,
                        405,
                        &[
                            ("content-type", "application/json"),
                            ("allow", "GET, POST, DELETE"),
                        ],
                        &rpc_error(-32000, "Method not allowed"),
                    );
                }
            }
        }
    }

    /// The session a non-initialize request names, or the 400/404 it gets.
    fn session_for(&mut self, key: u64, request: &Request) -> Option<SessionKey> {
        let http = self.http.as_mut()?;
        let Some(id) = request.header("mcp-session-id") else {
            http.respond_error(
                key,
                400,
                -32000,
                "Bad Request: Mcp-Session-Id header is required",
            );
            return None;
        };
        let Some(session) = http.by_id.get(id.trim()).copied() else {
            http.respond_error(key, 404, -32001, "Session not found");
            return None;
        };
        if let Some(s) = http.sessions.get_mut(&session) {
            s.last_used = Instant::now();
        }
        Some(session)
    }

    /// A supported `MCP-Protocol-Version`, or none (then 2025-03-26 is assumed).
    fn version_ok(&mut self, key: u64, request: &Request) -> bool {
        match request.header("mcp-protocol-version") {
            Some(v) if !SUPPORTED_VERSIONS.contains(&v.trim()) => {
                if let Some(http) = self.http.as_mut() {
                    http.respond_error(
                        key,
                        400,
                        -32000,
                        &format!(
                            "Bad Request: unsupported MCP-Protocol-Version {v} (supported: {})",
                            SUPPORTED_VERSIONS.join(", ")
                        ),
                    );
                }
                false
            }
            _ => true,
        }
    }

    /// A new session for an `initialize`, making room by dropping the least recently used
    /// idle one when full.
    fn new_http_session(&mut self, ctx: &mut Cx<McpKey>) -> Option<(SessionKey, String)> {
        let http = self.http.as_mut()?;
        if http.sessions.len() >= MAX_SESSIONS {
            let busy: Vec<SessionKey> = http.replies.keys().map(|(s, _)| *s).collect();
            let victim = http
                .sessions
                .iter()
                .filter(|(k, s)| s.listen.is_none() && !busy.contains(k))
                .min_by_key(|(_, s)| s.last_used)
                .map(|(k, _)| *k)?;
            self.end_http_session(ctx, victim);
        }
        let http = self.http.as_mut()?;
        let id = new_session_id();
        if id.is_empty() {
            return None;
        }
        let session = http.next_session;
        http.next_session += 1;
        http.by_id.insert(id.clone(), session);
        http.sessions.insert(
            session,
            HttpSession {
                id: id.clone(),
                listen: None,
                pending: VecDeque::new(),
                last_used: Instant::now(),
            },
        );
        self.sessions.insert(session, Session::new());
        Some((session, id))
    }

    /// Forgets a session: its streams end, its waits go unanswered, its runs go on.
    fn end_http_session(&mut self, ctx: &mut Cx<McpKey>, session: SessionKey) {
        self.drop_session_waits(ctx, session);
        self.sessions.remove(&session);
        self.elicits.retain(|_, e| e.session != session);
        let Some(http) = self.http.as_mut() else {
            return;
        };
        if let Some(s) = http.sessions.remove(&session) {
            http.by_id.remove(&s.id);
        }
        let ids: Vec<Id> = http
            .replies
            .keys()
            .filter(|(s, _)| *s == session)
            .map(|(_, id)| id.clone())
            .collect();
        for id in ids {
            http.abandon(session, &id);
        }
        for (key, c) in http.conns.iter_mut() {
            if matches!(c.role, Role::Listen { session: s } if s == session) {
                c.conn.end_stream();
                c.role = Role::Plain;
                http.dirty.push(*key);
            }
        }
    }

    fn http_post(&mut self, ctx: &mut Cx<McpKey>, key: u64, request: &Request) {
        let (json_ok, sse_ok) = accepts(request);
        let Some(http) = self.http.as_mut() else {
            return;
        };
        if !json_ok && !sse_ok {
            http.respond_error(
                key,
                406,
                -32000,
                "Not Acceptable: accept application/json or text/event-stream",
            );
            return;
        }
        let is_json = request
            .header("content-type")
            .and_then(|t| t.split(';').next())
            .is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json"));
        if !is_json {
            http.respond_error(
                key,
                415,
                -32000,
                "Unsupported Media Type: Content-Type must be application/json",
            );
            return;
        }
        let message = match jsonrpc::parse(&request.body) {
            Ok(Some(message)) => message,
            Ok(None) => {
                http.respond_error(key, 400, jsonrpc::PARSE_ERROR, "Parse error: empty body");
                return;
            }
            Err(invalid) => {
                let body = message_text(&jsonrpc::error_response(invalid.id, invalid.error));
                http.respond(
                    key,
                    400,
                    &[("content-type", "application/json")],
                    body.as_bytes(),
                );
                return;
            }
        };
        let is_init = matches!(&message, Message::Request { method, .. } if method == "initialize");
        let (session, session_id, created) = if is_init {
            match self.new_http_session(ctx) {
                Some((session, id)) => (session, id, true),
                None => {
                    if let Some(http) = self.http.as_mut() {
                        http.respond_error(
                            key,
                            503,
                            -32000,
                            "Service Unavailable: too many sessions",
                        );
                    }
                    return;
                }
            }
        } else {
            if !self.version_ok(key, request) {
                return;
            }
            let Some(session) = self.session_for(key, request) else {
                return;
            };
            let id = self
                .http
                .as_ref()
                .and_then(|h| h.sessions.get(&session))
                .map(|s| s.id.clone())
                .unwrap_or_default();
            (session, id, false)
        };
        let request_id = match &message {
            Message::Request { id, .. } => Some(id.clone()),
            _ => None,
        };
        // Replies are routed by (session, id): a second request with an id still in flight
        // would steal the first one's answer, so it is refused.
        if let Some(id) = &request_id
            && self
                .http
                .as_ref()
                .is_some_and(|h| h.replies.contains_key(&(session, id.clone())))
        {
            let reply = jsonrpc::error_response(
                id.clone(),
                jsonrpc::RpcError::new(jsonrpc::INVALID_REQUEST, "request id is already in use"),
            );
            if let Some(http) = self.http.as_mut() {
                http.respond(
                    key,
                    200,
                    &[("content-type", "application/json")],
                    message_text(&reply).as_bytes(),
                );
            }
            return;
        }
        let outcome = self.on_message(ctx, session, message);
        let Some(http) = self.http.as_mut() else {
            return;
        };
        let (Some(outcome), Some(id)) = (outcome, request_id) else {
            // A notification or a response: accepted, nothing to say.
            http.respond(key, 202, &[], b"");
            return;
        };
        match outcome {
            Outcome::Reply(result) => {
                // A failed initialize leaves no session behind.
                let created = created && result.is_ok();
                if is_init && !created {
                    self.end_http_session(ctx, session);
                }
                let text = message_text(&Message::Response { id, result });
                let Some(http) = self.http.as_mut() else {
                    return;
                };
                let queued = http
                    .sessions
                    .get(&session)
                    .is_some_and(|s| !s.pending.is_empty());
                if queued && sse_ok {
                    // Deliver waiting server requests on this response's stream first.
                    http.start_sse(key, &session_id, Role::Plain);
                    let pending: Vec<(i64, String)> = http
                        .sessions
                        .get_mut(&session)
                        .map(|s| s.pending.drain(..).collect())
                        .unwrap_or_default();
                    if let Some(c) = http.conns.get_mut(&key) {
                        for (_, queued) in pending {
                            c.conn.stream_chunk(sse_event(&queued).as_bytes());
                        }
                        c.conn.stream_chunk(sse_event(&text).as_bytes());
                        c.conn.end_stream();
                    }
                    return;
                }
                let mut headers = vec![("content-type", "application/json")];
                if created {
                    headers.push(("mcp-session-id", session_id.as_str()));
                }
                http.respond(key, 200, &headers, text.as_bytes());
            }
            Outcome::Deferred => {
                http.replies.insert((session, id.clone()), key);
                if sse_ok {
                    http.start_sse(
                        key,
                        &session_id,
                        Role::Reply {
                            session,
                            id,
                            sse: true,
                        },
                    );
                    http.flush_pending(session, key);
                } else if let Some(c) = http.conns.get_mut(&key) {
                    c.role = Role::Reply {
                        session,
                        id,
                        sse: false,
                    };
                }
            }
        }
    }

    fn http_get(&mut self, key: u64, request: &Request) {
        let (_, sse_ok) = accepts(request);
        if !sse_ok {
            if let Some(http) = self.http.as_mut() {
                http.respond_error(
                    key,
                    406,
                    -32000,
                    "Not Acceptable: GET needs Accept: text/event-stream",
                );
            }
            return;
        }
        if !self.version_ok(key, request) {
            return;
        }
        let Some(session) = self.session_for(key, request) else {
            return;
        };
        let Some(http) = self.http.as_mut() else {
            return;
        };
        let Some(s) = http.sessions.get(&session) else {
            return;
        };
        if s.listen.is_some_and(|k| http.conns.contains_key(&k)) {
            http.respond_error(
                key,
                409,
                -32000,
                "Conflict: this session already has a GET stream",
            );
            return;
        }
        let session_id = s.id.clone();
        http.start_sse(key, &session_id, Role::Listen { session });
        if let Some(s) = http.sessions.get_mut(&session) {
            s.listen = Some(key);
        }
        http.flush_pending(session, key);
    }

    fn http_delete(&mut self, ctx: &mut Cx<McpKey>, key: u64, request: &Request) {
        if !self.version_ok(key, request) {
            return;
        }
        let Some(session) = self.session_for(key, request) else {
            return;
        };
        self.end_http_session(ctx, session);
        if let Some(http) = self.http.as_mut() {
            http.respond(key, 200, &[], b"");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostnames_and_loopback_names() {
        assert_eq!(hostname("localhost:8080"), "localhost");
        assert_eq!(hostname("[::1]:80"), "[::1]");
        assert_eq!(hostname("127.0.0.1"), "127.0.0.1");
        assert!(is_loopback_name("LOCALHOST"));
        assert!(is_loopback_name("127.0.0.9"));
        assert!(is_loopback_name("[::1]"));
        assert!(!is_loopback_name("evil.example.com"));
        assert!(!is_loopback_name("10.0.0.1"));
    }

    #[test]
    fn session_ids_are_random_hex() {
        let (a, b) = (new_session_id(), new_session_id());
        assert_eq!(a.len(), 32);
        assert_ne!(a, b);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
    }
}
