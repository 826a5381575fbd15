//! Streamable HTTP (MCP 2025-11-25 §transports) at `/mcp`, on the engine's loop:
//! `POST` carries one JSON-RPC message (a request is answered with JSON, or with an SSE
//! stream when the answer waits or server requests are queued), `GET` opens the session's
//! stream for messages unrelated to a request, `DELETE` ends the session. Sessions are
//! named by `Mcp-Session-Id`; `MCP-Protocol-Version` must be one we speak. The network
//! front (`surface::front`) checks `Host` and `Origin` against DNS rebinding with the one
//! browser rule, and applies the shared auth gate and optional TLS as on every drive
//! surface (DESIGN §4.6); a refusal of the browser rule here is a 403 with a JSON-RPC
//! error body, like this transport's other refusals.
//!
//! It owns each session's transport state (its `GET` stream, the messages waiting for one)
//! and each connection's `Role`; the listener, the connections and their deadlines are the
//! front's, and what the messages mean is `McpHost`'s business.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde_json::json;

use super::{McpHost, McpKey, Outcome, Route, SUPPORTED_VERSIONS, Session, SessionKey};
use crate::http::server::Request;
use crate::jsonrpc::{self, Id, Message};
use crate::surface::front::{Event, Front, Keepalive, Policy, Reply, Response};
use crate::surface::host::Cx;
use crate::surface::{ConnId, FrontKey, ListenConfig};

pub const PATH: &str = "/mcp";
/// Sessions kept at once. When the table is full, an `initialize` may only take the place
/// of a session abandoned past `SESSION_ABANDONED_AFTER`; otherwise it is refused (503).
const MAX_SESSIONS: usize = 1024;
/// How long a session must go unused (no request naming it, no `GET` stream open, no answer
/// pending) before a newcomer may take its place in a full table. A live session is never
/// dropped for a newcomer: anyone who can reach the listener could otherwise end every
/// other client's session by sending `initialize` `MAX_SESSIONS` times. Clients that vanish
/// without `DELETE` still free their place, just not at once.
const SESSION_ABANDONED_AFTER: Duration = Duration::from_secs(10 * 60);
/// Server requests held for a session with no open stream; the oldest go first.
const MAX_PENDING: usize = 64;

/// This surface's choices for the front. A quiet SSE stream gets a comment each idle
/// period: a `GET` stream may carry nothing for hours, and the comment keeps proxies from
/// timing it out and shows a vanished peer as a write error. A request the browser rule
/// refuses gets a JSON-RPC error body, as every refusal of this transport does.
const POLICY: Policy = Policy {
    keepalive: Keepalive::Comment,
    forbidden,
    public: |_| None,
};

fn forbidden(reason: &'static str) -> Response {
    Response::json(403, rpc_error(-32000, reason))
}

/// What a connection is to this transport: the front's payload for it.
#[derive(Clone, Debug, Default)]
enum Role {
    /// Request-response (or nothing yet).
    #[default]
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

struct HttpSession {
    id: String,
    listen: Option<ConnId>,
    /// Server-to-client requests (with our id) waiting for a stream to go out on.
    pending: VecDeque<(i64, String)>,
    last_used: Instant,
}

pub(super) struct HttpSide {
    front: Front<Role>,
    sessions: HashMap<SessionKey, HttpSession>,
    by_id: HashMap<String, SessionKey>,
    next_session: SessionKey,
    /// Which connection carries the answer to a session's request.
    replies: HashMap<(SessionKey, Id), ConnId>,
}

fn sse_event(text: &str) -> String {
    format!("event: message\ndata: {text}\n\n")
}

/// What a message written out is, for where it may go when no stream takes it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    /// Dropped.
    Notification,
    /// A server request (by its id): waits for the session's next stream.
    Request(i64),
    /// A response: its stream is its request's.
    Other,
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

/// A transport-level refusal: `status` with a JSON-RPC error body.
fn refusal(status: u16, code: i64, message: &str) -> Reply {
    Response::json(status, rpc_error(code, message)).into()
}

/// An SSE response for `session_id`: `events` now, and more later while `open`.
fn sse_reply(session_id: &str, events: String, open: bool) -> Reply {
    Reply::Stream {
        response: Response::with(200, "text/event-stream", events)
            .header("cache-control", "no-cache")
            .header("mcp-session-id", session_id),
        open,
    }
}

/// Whether a session last used at `last_used` may give its place to a newcomer at `now`:
/// nothing open (`in_use`: a `GET` stream or a pending answer) and unused for
/// `SESSION_ABANDONED_AFTER`.
fn abandoned(now: Instant, last_used: Instant, in_use: bool) -> bool {
    !in_use && now.saturating_duration_since(last_used) >= SESSION_ABANDONED_AFTER
}

/// A cryptographically random session id (visible ASCII, as the spec asks).
fn new_session_id() -> String {
    use ring::rand::SecureRandom;
    let mut bytes = [0u8; 16];
    if ring::rand::SystemRandom::new().fill(&mut bytes).is_err() {
        // No randomness: refuse to hand out a guessable id; the caller answers 503.
        return String::new();
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
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

/// A supported `MCP-Protocol-Version`, or none (then 2025-03-26 is assumed).
fn check_version(request: &Request) -> Result<(), Reply> {
    match request.header("mcp-protocol-version") {
        Some(v) if !SUPPORTED_VERSIONS.contains(&v.trim()) => Err(refusal(
            400,
            -32000,
            &format!(
                "Bad Request: unsupported MCP-Protocol-Version {v} (supported: {})",
                SUPPORTED_VERSIONS.join(", ")
            ),
        )),
        _ => Ok(()),
    }
}

impl HttpSide {
    pub(super) fn bind(config: ListenConfig) -> std::io::Result<HttpSide> {
        Ok(HttpSide {
            front: Front::bind(config, POLICY)?,
            sessions: HashMap::new(),
            by_id: HashMap::new(),
            next_session: 1,
            replies: HashMap::new(),
        })
    }

    pub(super) fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.front.local_addr()
    }

    /// Writes one SSE event on a stream. A `droppable` one (a notification) is skipped
    /// while the client is not reading, so a stalled reader cannot grow our buffers.
    fn write_event(&mut self, conn: ConnId, text: &str, droppable: bool) -> bool {
        let Some(slot) = self.front.conn_mut(conn) else {
            return false;
        };
        if droppable && !slot.conn.wants_more_stream() {
            return false;
        }
        match slot.state {
            Role::Listen { .. } | Role::Reply { sse: true, .. } if slot.conn.is_streaming() => {
                slot.conn.stream_chunk(sse_event(text).as_bytes());
                true
            }
            _ => false,
        }
    }

    /// Sends the answer on the connection that waits for it and ends that response.
    fn write_final(&mut self, conn: ConnId, text: &str) {
        let Some(slot) = self.front.conn_mut(conn) else {
            return;
        };
        match slot.state {
            Role::Reply { sse: true, .. } => {
                slot.conn.stream_chunk(sse_event(text).as_bytes());
                slot.conn.end_stream();
            }
            Role::Reply { sse: false, .. } => {
                slot.conn.respond(
                    200,
                    &[("content-type", "application/json")],
                    text.as_bytes(),
                );
            }
            _ => return,
        }
        slot.state = Role::Plain;
    }

    /// Puts a message on the right stream of `session` (see `Route`). A server request
    /// with nowhere to go waits for the session's next stream; a notification is dropped.
    pub(super) fn deliver(&mut self, session: SessionKey, route: Route, message: &Message) {
        let kind = match message {
            Message::Notification { .. } => Kind::Notification,
            Message::Request {
                id: Id::Num(request),
                ..
            } => Kind::Request(*request),
            _ => Kind::Other,
        };
        self.deliver_text(session, route, message_text(message), kind);
    }

    /// `deliver` of a message already written out.
    pub(super) fn deliver_text(
        &mut self,
        session: SessionKey,
        route: Route,
        text: String,
        kind: Kind,
    ) {
        let droppable = kind == Kind::Notification;
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
                let streams: Vec<ConnId> = self
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
                if let Kind::Request(request) = kind
                    && let Some(s) = self.sessions.get_mut(&session)
                {
                    if s.pending.len() >= MAX_PENDING {
                        s.pending.pop_front();
                    }
                    s.pending.push_back((request, text));
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
        let Some(conn) = self.replies.remove(&(session, id.clone())) else {
            return;
        };
        let Some(slot) = self.front.conn_mut(conn) else {
            return;
        };
        match slot.state {
            Role::Reply { sse: true, .. } => slot.conn.end_stream(),
            Role::Reply { sse: false, .. } => slot.conn.respond(202, &[], b""),
            _ => return,
        }
        slot.state = Role::Plain;
    }

    /// Queued server requests for `session` as SSE events, for a stream that is opening.
    fn take_pending(&mut self, session: SessionKey) -> String {
        self.sessions
            .get_mut(&session)
            .map(|s| {
                s.pending
                    .drain(..)
                    .map(|(_, text)| sse_event(&text))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The session a non-initialize request names, or the 400/404 it gets.
    fn session_for(&mut self, request: &Request) -> Result<SessionKey, Reply> {
        let Some(id) = request.header("mcp-session-id") else {
            return Err(refusal(
                400,
                -32000,
                "Bad Request: Mcp-Session-Id header is required",
            ));
        };
        let Some(session) = self.by_id.get(id.trim()).copied() else {
            return Err(refusal(404, -32001, "Session not found"));
        };
        if let Some(s) = self.sessions.get_mut(&session) {
            s.last_used = Instant::now();
        }
        Ok(session)
    }
}

impl McpHost {
    /// Registers the listener on the engine's loop.
    pub(super) fn start_http(&mut self, ctx: &mut Cx<McpKey>) -> std::io::Result<()> {
        match self.http.as_mut() {
            Some(http) => http.front.start(ctx),
            None => Ok(()),
        }
    }

    /// Readiness of one of the front's sources.
    pub(super) fn http_io(&mut self, ctx: &mut Cx<McpKey>, key: FrontKey) {
        if let Some(http) = self.http.as_mut() {
            http.front.on_io(ctx, key);
        }
        self.http_serve(ctx);
    }

    /// Expiry of one of the front's timers.
    pub(super) fn http_timer(&mut self, ctx: &mut Cx<McpKey>, key: FrontKey) {
        if let Some(http) = self.http.as_mut() {
            http.front.on_timer(ctx, key);
        }
        self.http_serve(ctx);
    }

    /// Acts on what the front has for us: requests, hang-ups, closes.
    pub(super) fn http_serve(&mut self, ctx: &mut Cx<McpKey>) {
        loop {
            let Some(event) = self.http.as_mut().and_then(|h| h.front.next_event(ctx)) else {
                return;
            };
            match event {
                Event::Request(conn, request) => {
                    let reply = self
                        .on_http_request(ctx, conn, &request)
                        .unwrap_or_else(|refused| refused);
                    if let Some(http) = self.http.as_mut() {
                        http.front.reply(conn, reply);
                    }
                }
                Event::Writable(_) => {}
                // A GET stream whose reader hung up will never be read. (A half-closed
                // client waiting on a POST reply still gets its answer.)
                Event::HungUp(conn) => {
                    if let Some(http) = self.http.as_mut()
                        && http
                            .front
                            .get(conn)
                            .is_some_and(|slot| matches!(slot.state, Role::Listen { .. }))
                    {
                        http.front.close(ctx, conn);
                    }
                }
                Event::Closed(conn, role) => self.http_closed(ctx, conn, role),
            }
        }
    }

    fn http_closed(&mut self, ctx: &mut Cx<McpKey>, conn: ConnId, role: Role) {
        let Some(http) = self.http.as_mut() else {
            return;
        };
        match role {
            Role::Reply { session, id, .. } => {
                // A disconnect is not a cancel, but the answer has nowhere to go now. Only
                // this connection's own entry goes (never another request's).
                if http.replies.get(&(session, id.clone())) == Some(&conn) {
                    http.replies.remove(&(session, id.clone()));
                    self.drop_request_wait(ctx, session, &id);
                }
            }
            Role::Listen { session } => {
                if let Some(s) = http.sessions.get_mut(&session)
                    && s.listen == Some(conn)
                {
                    s.listen = None;
                }
            }
            Role::Plain => {}
        }
    }

    /// `self.http`, which is there whenever an HTTP request is being handled.
    fn http_side(&mut self) -> Result<&mut HttpSide, Reply> {
        // Without it there is no connection to answer on either.
        self.http.as_mut().ok_or(Reply::Later)
    }

    /// A request that passed the front's gate. `Err` is a refusal.
    fn on_http_request(
        &mut self,
        ctx: &mut Cx<McpKey>,
        conn: ConnId,
        request: &Request,
    ) -> Result<Reply, Reply> {
        if request.path != PATH {
            return Ok(Response::json(
                404,
                json!({"error": "not found: MCP is served at /mcp"}).to_string(),
            )
            .into());
        }
        match request.method.as_str() {
            "POST" => self.http_post(ctx, conn, request),
            "GET" => self.http_get(conn, request),
            "DELETE" => self.http_delete(ctx, request),
            _ => Ok(Response::json(405, rpc_error(-32000, "Method not allowed"))
                .header("allow", "GET, POST, DELETE")
                .into()),
        }
    }

    /// A new session for an `initialize`. A full table makes room only by dropping the
    /// longest-abandoned session (see `SESSION_ABANDONED_AFTER`); `None` when there is none
    /// (or no randomness for an id), which the caller answers with 503.
    fn new_http_session(&mut self, ctx: &mut Cx<McpKey>) -> Option<(SessionKey, String)> {
        let http = self.http.as_mut()?;
        if http.sessions.len() >= MAX_SESSIONS {
            let busy: Vec<SessionKey> = http.replies.keys().map(|(s, _)| *s).collect();
            let now = Instant::now();
            let victim = http
                .sessions
                .iter()
                .filter(|(k, s)| {
                    abandoned(now, s.last_used, s.listen.is_some() || busy.contains(k))
                })
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
        let mut listen = None;
        if let Some(s) = http.sessions.remove(&session) {
            http.by_id.remove(&s.id);
            listen = s.listen;
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
        // The session's one GET stream (a second one is refused with 409).
        if let Some(conn) = listen
            && let Some(slot) = http.front.conn_mut(conn)
            && matches!(slot.state, Role::Listen { session: s } if s == session)
        {
            slot.conn.end_stream();
            slot.state = Role::Plain;
        }
    }

    fn http_post(
        &mut self,
        ctx: &mut Cx<McpKey>,
        conn: ConnId,
        request: &Request,
    ) -> Result<Reply, Reply> {
        let (json_ok, sse_ok) = accepts(request);
        if !json_ok && !sse_ok {
            return Err(refusal(
                406,
                -32000,
                "Not Acceptable: accept application/json or text/event-stream",
            ));
        }
        let is_json = request
            .header("content-type")
            .and_then(|t| t.split(';').next())
            .is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json"));
        if !is_json {
            return Err(refusal(
                415,
                -32000,
                "Unsupported Media Type: Content-Type must be application/json",
            ));
        }
        let message = match jsonrpc::parse(&request.body) {
            Ok(Some(message)) => message,
            Ok(None) => {
                return Err(refusal(
                    400,
                    jsonrpc::PARSE_ERROR,
                    "Parse error: empty body",
                ));
            }
            Err(invalid) => {
                let body = message_text(&jsonrpc::error_response(invalid.id, invalid.error));
                return Err(Response::json(400, body).into());
            }
        };
        let is_init = matches!(&message, Message::Request { method, .. } if method == "initialize");
        let (session, session_id, created) = if is_init {
            match self.new_http_session(ctx) {
                Some((session, id)) => (session, id, true),
                None => {
                    return Err(refusal(
                        503,
                        -32000,
                        &format!(
                            "Service Unavailable: too many sessions ({MAX_SESSIONS} open); \
                             end one with DELETE or retry later"
                        ),
                    ));
                }
            }
        } else {
            check_version(request)?;
            let http = self.http_side()?;
            let session = http.session_for(request)?;
            let id = http
                .sessions
                .get(&session)
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
                .http_side()?
                .replies
                .contains_key(&(session, id.clone()))
        {
            let reply = jsonrpc::error_response(
                id.clone(),
                jsonrpc::RpcError::new(jsonrpc::INVALID_REQUEST, "request id is already in use"),
            );
            return Ok(Response::json(200, message_text(&reply)).into());
        }
        let outcome = self.on_message(ctx, session, message);
        let (Some(outcome), Some(id)) = (outcome, request_id) else {
            // A notification or a response: accepted, nothing to say.
            return Ok(Response::empty(202).into());
        };
        match outcome {
            Outcome::Reply(result) => {
                // A failed initialize leaves no session behind.
                let created = created && result.is_ok();
                if is_init && !created {
                    self.end_http_session(ctx, session);
                }
                let text = message_text(&Message::Response { id, result });
                let http = self.http_side()?;
                let queued = http
                    .sessions
                    .get(&session)
                    .is_some_and(|s| !s.pending.is_empty());
                if queued && sse_ok {
                    // Deliver waiting server requests on this response's stream first.
                    let mut events = http.take_pending(session);
                    events.push_str(&sse_event(&text));
                    return Ok(sse_reply(&session_id, events, false));
                }
                let mut response = Response::json(200, text);
                if created {
                    response = response.header("mcp-session-id", session_id);
                }
                Ok(response.into())
            }
            Outcome::Deferred => {
                let http = self.http_side()?;
                http.replies.insert((session, id.clone()), conn);
                if let Some(slot) = http.front.conn_mut(conn) {
                    slot.state = Role::Reply {
                        session,
                        id,
                        sse: sse_ok,
                    };
                }
                if sse_ok {
                    let events = http.take_pending(session);
                    Ok(sse_reply(&session_id, events, true))
                } else {
                    Ok(Reply::Later)
                }
            }
        }
    }

    fn http_get(&mut self, conn: ConnId, request: &Request) -> Result<Reply, Reply> {
        let (_, sse_ok) = accepts(request);
        if !sse_ok {
            return Err(refusal(
                406,
                -32000,
                "Not Acceptable: GET needs Accept: text/event-stream",
            ));
        }
        check_version(request)?;
        let http = self.http_side()?;
        let session = http.session_for(request)?;
        let Some(s) = http.sessions.get(&session) else {
            return Err(refusal(404, -32001, "Session not found"));
        };
        if s.listen.is_some_and(|c| http.front.get(c).is_some()) {
            return Err(refusal(
                409,
                -32000,
                "Conflict: this session already has a GET stream",
            ));
        }
        let session_id = s.id.clone();
        if let Some(slot) = http.front.conn_mut(conn) {
            slot.state = Role::Listen { session };
        }
        if let Some(s) = http.sessions.get_mut(&session) {
            s.listen = Some(conn);
        }
        let events = http.take_pending(session);
        Ok(sse_reply(&session_id, events, true))
    }

    fn http_delete(&mut self, ctx: &mut Cx<McpKey>, request: &Request) -> Result<Reply, Reply> {
        check_version(request)?;
        let session = self.http_side()?.session_for(request)?;
        self.end_http_session(ctx, session);
        Ok(Response::empty(200).into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_session_unused_past_the_limit_and_with_nothing_open_gives_way() {
        let now = Instant::now() + SESSION_ABANDONED_AFTER + Duration::from_secs(3600);
        let ago = |d: Duration| now - d;
        assert!(abandoned(now, ago(SESSION_ABANDONED_AFTER), false));
        assert!(abandoned(now, ago(Duration::from_secs(3600)), false));
        // Recently used, however full the table: never.
        assert!(!abandoned(now, now, false));
        assert!(!abandoned(
            now,
            ago(SESSION_ABANDONED_AFTER - Duration::from_secs(1)),
            false
        ));
        // A stream open or an answer pending: never, however long ago the last request.
        assert!(!abandoned(now, ago(Duration::from_secs(3600)), true));
        assert!(SESSION_ABANDONED_AFTER >= Duration::from_secs(600));
    }

    #[test]
    fn session_ids_are_random_hex() {
        let (a, b) = (new_session_id(), new_session_id());
        assert_eq!(a.len(), 32);
        assert_ne!(a, b);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
    }
}
