//! The HTTP transports, over the crate's own client (`http::client::Exchange`: one request
//! per connection, TLS by rustls, `HTTPS_PROXY` by CONNECT) on the engine's reactor.
//!
//! **Streamable HTTP** (2025-11-25): every message is a POST to the endpoint with
//! `Accept: application/json, text/event-stream`. A request's answer comes as one JSON
//! body or as an SSE stream carrying the server's notifications (progress) and then the
//! response. The `Mcp-Session-Id` the server gives on `initialize` goes on every later
//! request, with `MCP-Protocol-Version`. Once the server is ready a GET opens the standalone
//! stream for what the server says unprompted (`tools/list_changed`); a server that answers
//! it 405 has none. A stream that breaks before its response came is resumed with a GET
//! carrying `Last-Event-ID`, if the server gave event ids; otherwise the request fails. A 404
//! on a request with a session means the session ended: the server is taken as gone, and
//! the next run starts a new session.
//!
//! **HTTP+SSE** (2024-11-05, `legacy`): a GET event stream is opened first; its `endpoint`
//! event names the URL to POST messages to, and every answer comes on that stream.
//!
//! Ordering: a message goes out only once every notification and response sent before it
//! has been acknowledged (its response head arrived), so `notifications/initialized` reaches
//! the server before `tools/list`, and a cancel before what follows it. Requests do not
//! wait for each other: a slow call never holds up another.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rustls::ClientConfig;
use serde_json::{Value, json};

use super::client::{Client, Event};
use super::{Alarm, Io, ServerId, Source};
use crate::http::client::{self as http_client, ClientEvent, Exchange};
use crate::http::sse::SseDecoder;
use crate::http::target::{Proxy, Target};
use crate::http::write;
use crate::jsonrpc;

/// Resumptions of one request's stream, and reconnections of the standalone stream in a
/// row without an event between them, before giving up: a server that drops every stream
/// at once must not make caliban reconnect forever.
const MAX_RECONNECTS: u32 = 5;
/// Delay before reopening the standalone stream when the server named none (`retry:`).
const RECONNECT_DELAY: Duration = Duration::from_secs(1);

/// What an exchange carries.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Carries {
    /// A request of ours: its id, answered in this exchange's body (or a resumed stream).
    Request(i64),
    /// A notification or a response of ours: acknowledged by the response head.
    Ack,
    /// The standalone GET stream (or, `legacy`, the one stream everything comes on).
    Stream,
    /// A GET resuming a request's stream after it broke (`Last-Event-ID`).
    Resume(i64),
    /// A message POSTed on the legacy transport, whose answer (if any, for the request
    /// named) comes on the event stream: acknowledged by the response head like `Ack`.
    Posted(Option<i64>),
    /// The `DELETE` that ends the session: done with its response head.
    Delete,
}

struct Ex {
    exchange: Exchange,
    carries: Carries,
    status: Option<u16>,
    content_type: String,
    sse: SseDecoder,
    /// A JSON reply's body.
    body: Vec<u8>,
}

pub struct HttpConn {
    target: Target,
    path: String,
    headers: Vec<(String, String)>,
    proxy: Option<Proxy>,
    tls: Option<Arc<ClientConfig>>,
    legacy: bool,
    /// The legacy transport's POST path, from its `endpoint` event.
    endpoint: Option<String>,
    session: Option<String>,
    /// The server ended the session itself (a 404): there is nothing to `DELETE`.
    session_gone: bool,
    addrs: Option<Vec<SocketAddr>>,
    exchanges: BTreeMap<u64, Ex>,
    next: u64,
    /// The standalone GET stream is not wanted (405) or not to be reopened.
    no_stream: bool,
    /// The last event id seen on the standalone stream, to resume it.
    stream_event_id: Option<String>,
    reconnects: u32,
    reconnect_timer: Option<crate::reactor::TimerId>,
}

impl HttpConn {
    pub fn new(url: &str, headers: &[(String, String)], legacy: bool) -> Result<HttpConn, String> {
        let (target, path) = http_client::parse_base_url(url)?;
        let env = |name: &str| std::env::var(name).ok();
        let proxy = http_client::proxy_for(&target, &env)?;
        let tls = if target.tls {
            Some(crate::transport::client_config()?.0)
        } else {
            None
        };
        let path = if path.is_empty() {
            "/".to_owned()
        } else {
            path
        };
        Ok(HttpConn {
            target,
            path,
            headers: headers.to_vec(),
            proxy,
            tls,
            legacy,
            endpoint: None,
            session: None,
            session_gone: false,
            addrs: None,
            exchanges: BTreeMap::new(),
            next: 1,
            no_stream: false,
            stream_event_id: None,
            reconnects: 0,
            reconnect_timer: None,
        })
    }

    /// Every exchange is closed (the server is stopped or gone).
    pub fn close(&mut self, io: &mut impl Io) {
        for (_, mut ex) in std::mem::take(&mut self.exchanges) {
            ex.exchange.close(io.registry());
            io.forget_token(ex.exchange.token());
        }
        if let Some(t) = self.reconnect_timer.take() {
            io.cancel_timer(t);
        }
    }

    /// Ends the connection as the spec asks a client to: every exchange is closed and, if
    /// the server gave a session id it has not ended itself, a `DELETE` with it tells the
    /// server to free the session (a 405 means it keeps sessions until they expire, which
    /// is fine). Whether that `DELETE` is still in flight (`is_idle` says when it is done).
    pub fn end_session(&mut self, io: &mut impl Io, id: ServerId, client: &mut Client) -> bool {
        self.close(io);
        if self.legacy || self.session_gone || self.session.is_none() {
            return false;
        }
        let request = self.request_bytes("DELETE", &self.path.clone(), b"", None, client.version());
        // Whatever the server answers, nothing more is sent on this session.
        self.no_stream = true;
        let _ = self.begin(io, id, request, Carries::Delete, client);
        !self.is_idle()
    }

    /// No exchange is open (a `DELETE` in flight has finished).
    pub fn is_idle(&self) -> bool {
        self.exchanges.is_empty()
    }

    fn request_bytes(
        &self,
        method: &str,
        path: &str,
        body: &[u8],
        last_event_id: Option<&str>,
        version: &str,
    ) -> Vec<u8> {
        let mut headers: Vec<(&str, &str)> = Vec::new();
        for (k, v) in &self.headers {
            headers.push((k, v));
        }
        if method == "POST" {
            headers.push(("Content-Type", "application/json"));
            headers.push(("Accept", "application/json, text/event-stream"));
        } else {
            headers.push(("Accept", "text/event-stream"));
        }
        if let Some(session) = &self.session {
            headers.push(("Mcp-Session-Id", session));
        }
        if !self.legacy && self.session.is_some() {
            headers.push(("MCP-Protocol-Version", version));
        }
        if let Some(id) = last_event_id {
            headers.push(("Last-Event-ID", id));
        }
        let agent = format!("caliban/{}", env!("CARGO_PKG_VERSION"));
        headers.push(("User-Agent", &agent));
        write::request(method, path, &self.target.host_header(), &headers, body)
    }

    /// Starts an exchange; its DNS lookup goes through `io` unless the address is known.
    fn begin(
        &mut self,
        io: &mut impl Io,
        id: ServerId,
        request: Vec<u8>,
        carries: Carries,
        client: &mut Client,
    ) -> Vec<Event> {
        let n = self.next;
        self.next += 1;
        let token = io.token(id, Source::Http(n));
        let exchange = Exchange::new(
            token,
            self.target.clone(),
            self.proxy.clone(),
            self.tls.clone(),
            request,
        );
        let (host, port) = exchange.dial_target();
        self.exchanges.insert(
            n,
            Ex {
                exchange,
                carries,
                status: None,
                content_type: String::new(),
                sse: SseDecoder::new(),
                body: Vec::new(),
            },
        );
        let literal = crate::transport::literal_addr(&host, port).map(|addr| vec![addr]);
        match literal.or_else(|| self.addrs.clone().filter(|_| self.proxy.is_none())) {
            Some(addrs) => {
                let mut out = Vec::new();
                if let Some(ex) = self.exchanges.get_mut(&n) {
                    ex.exchange.on_resolved(io.registry(), Ok(addrs), &mut out);
                }
                // A connection refused at once is answered here (not flushing again: the
                // caller is flushing).
                self.on_client_events(io, id, n, out, client, false)
            }
            None => {
                io.resolve(host, port, id, n);
                Vec::new()
            }
        }
    }

    /// Sends what the client queued, in order, as far as acknowledgements allow.
    pub fn flush(&mut self, io: &mut impl Io, id: ServerId, client: &mut Client) -> Vec<Event> {
        let mut events = Vec::new();
        if self.legacy && self.endpoint.is_none() {
            if !self
                .exchanges
                .values()
                .any(|e| e.carries == Carries::Stream)
                && client.phase() != super::Phase::Failed
            {
                let request =
                    self.request_bytes("GET", &self.path.clone(), b"", None, client.version());
                events.extend(self.begin(io, id, request, Carries::Stream, client));
            }
            return events;
        }
        loop {
            let waiting_ack = self.exchanges.values().any(|e| {
                matches!(e.carries, Carries::Ack | Carries::Posted(_)) && e.status.is_none()
            });
            if waiting_ack || !client.has_outgoing() {
                break;
            }
            let Some(message) = client.take_outgoing() else {
                break;
            };
            let request = match serde_json::from_slice::<Value>(&message) {
                Ok(v) if v.get("method").is_some() => v.get("id").and_then(Value::as_i64),
                _ => None,
            };
            let carries = match request {
                _ if self.legacy => Carries::Posted(request),
                Some(rid) => Carries::Request(rid),
                None => Carries::Ack,
            };
            let path = self.endpoint.clone().unwrap_or_else(|| self.path.clone());
            let request = self.request_bytes("POST", &path, &message, None, client.version());
            events.extend(self.begin(io, id, request, carries, client));
        }
        // The standalone stream, once the server is ready and if it offers one.
        if !self.legacy
            && !self.no_stream
            && self.reconnect_timer.is_none()
            && client.phase() == super::Phase::Ready
            && !self
                .exchanges
                .values()
                .any(|e| e.carries == Carries::Stream)
        {
            let request = self.request_bytes(
                "GET",
                &self.path.clone(),
                b"",
                self.stream_event_id.clone().as_deref(),
                client.version(),
            );
            events.extend(self.begin(io, id, request, Carries::Stream, client));
        }
        events
    }

    pub fn on_resolved(
        &mut self,
        io: &mut impl Io,
        id: ServerId,
        n: u64,
        result: Result<Vec<SocketAddr>, String>,
        client: &mut Client,
    ) -> Vec<Event> {
        if let Ok(addrs) = &result
            && self.proxy.is_none()
        {
            self.addrs = Some(addrs.clone());
        }
        let mut out = Vec::new();
        let Some(ex) = self.exchanges.get_mut(&n) else {
            return Vec::new();
        };
        ex.exchange.on_resolved(io.registry(), result, &mut out);
        self.on_client_events(io, id, n, out, client, true)
    }

    pub fn on_ready(
        &mut self,
        io: &mut impl Io,
        id: ServerId,
        n: u64,
        client: &mut Client,
    ) -> Vec<Event> {
        let mut out = Vec::new();
        let Some(ex) = self.exchanges.get_mut(&n) else {
            return Vec::new();
        };
        ex.exchange.on_ready(io.registry(), &mut out);
        self.on_client_events(io, id, n, out, client, true)
    }

    pub fn on_reconnect(
        &mut self,
        io: &mut impl Io,
        id: ServerId,
        client: &mut Client,
    ) -> Vec<Event> {
        self.reconnect_timer = None;
        self.flush(io, id, client)
    }

    fn on_client_events(
        &mut self,
        io: &mut impl Io,
        id: ServerId,
        n: u64,
        out: Vec<ClientEvent>,
        client: &mut Client,
        flush_after: bool,
    ) -> Vec<Event> {
        let mut events = Vec::new();
        self.each_client_event(io, id, n, out, &mut events, client);
        if flush_after {
            events.extend(self.flush(io, id, client));
        }
        events
    }

    fn each_client_event(
        &mut self,
        io: &mut impl Io,
        id: ServerId,
        n: u64,
        out: Vec<ClientEvent>,
        events: &mut Vec<Event>,
        client: &mut Client,
    ) {
        for event in out {
            let Some(ex) = self.exchanges.get_mut(&n) else {
                return;
            };
            match event {
                ClientEvent::Head(head) => {
                    ex.status = Some(head.status);
                    let header = |name: &str| {
                        head.headers
                            .iter()
                            .find(|(k, _)| k.eq_ignore_ascii_case(name))
                            .map(|(_, v)| v.clone())
                    };
                    ex.content_type = header("content-type")
                        .unwrap_or_default()
                        .to_ascii_lowercase();
                    if let Some(session) = header("mcp-session-id").filter(|s| {
                        !s.is_empty()
                            && s.len() <= 256
                            && s.bytes().all(|b| (0x21..=0x7e).contains(&b))
                    }) && self.session.is_none()
                    {
                        self.session = Some(session);
                    }
                    let status = head.status;
                    if ex.carries == Carries::Stream && status == 405 {
                        self.no_stream = true;
                    }
                    if ex.carries == Carries::Delete {
                        crate::log::debug(&format!(
                            "MCP server `{}` answered the end of its session with HTTP {status}",
                            client.name()
                        ));
                        self.end_exchange(io, id, n, events, client, None);
                        return;
                    }
                    if status == 404 && self.session.is_some() && ex.carries != Carries::Stream {
                        self.session_gone = true;
                        events.extend(client.fail("ended its session (HTTP 404)"));
                        return;
                    }
                    if !(200..300).contains(&status) {
                        match ex.carries {
                            Carries::Request(rid)
                            | Carries::Resume(rid)
                            | Carries::Posted(Some(rid)) => {
                                let why = format!("HTTP {status} {}", head.reason);
                                events.extend(answer_error(client, rid, &why));
                            }
                            Carries::Stream if self.legacy => {
                                let why = format!("refused its event stream (HTTP {status})");
                                events.extend(client.fail(&why));
                            }
                            _ => {}
                        }
                    }
                }
                ClientEvent::Body(bytes) => {
                    let ok = ex.status.is_some_and(|s| (200..300).contains(&s));
                    if !ok || matches!(ex.carries, Carries::Posted(_) | Carries::Ack) {
                        continue;
                    }
                    if ex.content_type.starts_with("text/event-stream") {
                        let mut sse_events = Vec::new();
                        if ex.sse.feed(&bytes, &mut sse_events).is_err() {
                            crate::log::warn(
                                "an MCP server sent a malformed event stream; closing it",
                            );
                            let broken = Some("a malformed event stream");
                            self.end_exchange(io, id, n, events, client, broken);
                            return;
                        }
                        let carries = ex.carries;
                        if carries == Carries::Stream {
                            if let Some(eid) = ex.sse.last_event_id() {
                                self.stream_event_id = Some(eid.to_owned());
                            }
                            if !sse_events.is_empty() {
                                self.reconnects = 0;
                            }
                        }
                        for sse in sse_events {
                            if self.legacy && sse.event == "endpoint" {
                                self.endpoint = Some(resolve_endpoint(&self.path, sse.data.trim()));
                                continue;
                            }
                            if sse.data.trim().is_empty() {
                                // A priming event (an id for resumption, no message).
                                continue;
                            }
                            events.extend(client.on_bytes(sse.data.as_bytes()));
                        }
                    } else if ex.body.len() + bytes.len() <= jsonrpc::MAX_MESSAGE_BYTES {
                        ex.body.extend_from_slice(&bytes);
                    }
                }
                ClientEvent::End => {
                    self.end_exchange(io, id, n, events, client, None);
                    return;
                }
                ClientEvent::Failed { error, .. } => {
                    crate::log::debug(&format!("MCP HTTP exchange failed: {error}"));
                    let error = error.to_string();
                    self.end_exchange(io, id, n, events, client, Some(&error));
                    return;
                }
            }
        }
    }

    /// An exchange is over (its body ended, or it broke): a JSON reply is read, a request
    /// still unanswered is resumed or failed, the standalone stream is reopened later.
    fn end_exchange(
        &mut self,
        io: &mut impl Io,
        id: ServerId,
        n: u64,
        events: &mut Vec<Event>,
        client: &mut Client,
        // Why the exchange broke, if it did (a TLS or connection error).
        broken: Option<&str>,
    ) {
        let Some(mut ex) = self.exchanges.remove(&n) else {
            return;
        };
        ex.exchange.close(io.registry());
        io.forget_token(ex.exchange.token());
        let ok = ex.status.is_some_and(|s| (200..300).contains(&s));
        if ok && !ex.content_type.starts_with("text/event-stream") && !ex.body.is_empty() {
            events.extend(client.on_bytes(&ex.body));
        }
        match ex.carries {
            Carries::Request(rid) | Carries::Resume(rid) if client.is_pending(rid) => {
                let resume_from = ex.sse.last_event_id().map(str::to_owned);
                let resumes = if matches!(ex.carries, Carries::Resume(_)) {
                    self.reconnects + 1
                } else {
                    1
                };
                match resume_from {
                    Some(eid)
                        if ok
                            && ex.content_type.starts_with("text/event-stream")
                            && resumes <= MAX_RECONNECTS
                            && !self.legacy =>
                    {
                        self.reconnects = resumes;
                        let request = self.request_bytes(
                            "GET",
                            &self.path.clone(),
                            b"",
                            Some(&eid),
                            client.version(),
                        );
                        events.extend(self.begin(io, id, request, Carries::Resume(rid), client));
                    }
                    _ if ok || broken.is_some() => {
                        let why = match broken {
                            Some(error) => format!("the connection failed ({error})"),
                            None => "the stream ended".to_owned(),
                        };
                        events.extend(answer_error(
                            client,
                            rid,
                            &format!("{why} before the answer came"),
                        ));
                    }
                    _ => {}
                }
            }
            Carries::Stream if self.legacy => {
                events.extend(client.fail("closed its event stream"));
            }
            Carries::Stream if ok && !self.no_stream => {
                self.reconnects += 1;
                if self.reconnects > MAX_RECONNECTS {
                    crate::log::info(&format!(
                        "MCP server `{}` keeps closing its event stream; not reopening it",
                        client.name()
                    ));
                    self.no_stream = true;
                } else {
                    let delay = ex
                        .sse
                        .retry_ms()
                        .map_or(RECONNECT_DELAY, Duration::from_millis);
                    self.reconnect_timer = Some(io.add_timer(
                        delay.min(Duration::from_secs(30)),
                        id,
                        Alarm::Reconnect,
                    ));
                }
            }
            Carries::Stream => self.no_stream = true,
            _ => {}
        }
    }
}

/// An error response for request `rid`, as if the server had sent it.
fn answer_error(client: &mut Client, rid: i64, message: &str) -> Vec<Event> {
    let line = json!({"jsonrpc": "2.0", "id": rid, "error": {"code": -32000, "message": message}});
    client.on_bytes(line.to_string().as_bytes())
}

/// The legacy transport's `endpoint` event: a path (absolute or relative) or a full URL on
/// the same server; only its path and query are used, so it cannot send caliban elsewhere.
fn resolve_endpoint(stream_path: &str, endpoint: &str) -> String {
    let path = match endpoint.find("://") {
        Some(at) => {
            let rest = &endpoint[at + 3..];
            rest.find('/').map_or("/", |i| &rest[i..])
        }
        None => endpoint,
    };
    if path.starts_with('/') {
        path.to_owned()
    } else {
        let base = stream_path.rsplit_once('/').map_or("", |(b, _)| b);
        format!("{base}/{path}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_stay_on_the_server() {
        assert_eq!(
            resolve_endpoint("/sse", "/messages/?session_id=1"),
            "/messages/?session_id=1"
        );
        assert_eq!(resolve_endpoint("/a/sse", "messages?x"), "/a/messages?x");
        assert_eq!(resolve_endpoint("/sse", "http://evil.test/m?s=1"), "/m?s=1");
    }
}
