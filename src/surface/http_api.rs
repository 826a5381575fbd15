//! `caliban http serve`: upstream's polling routes plus live NDJSON/SSE streams, run
//! listing, cancel and delete, health, metrics and the OpenAPI document, over HTTP/1.1 (or
//! HTTPS) on the engine's loop.
//!
//! It translates HTTP to drive-core calls and drive-core state to HTTP; it holds no agent
//! logic. It owns the listener, the connections and each live stream's position.

use std::collections::{BTreeSet, HashMap};
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::time::Duration;

use mio::net::TcpListener;
use mio::{Interest, Token};
use serde_json::{Value, json};

use crate::auth::Decision;
use crate::drive::ops::{self, Dialect, OpError, Problem};
use crate::drive::table::{DriveCore, DriveError, DriveStatus};
use crate::engine::{Engine, HostAction, RunId};
use crate::http::server::{ConnEvent, Connection, Request};
use crate::log;
use crate::reactor::{Signal, TimerId};
use crate::surface::host::{Cx, DriveHost, Key, Surface};
use crate::surface::{AcceptStep, ListenConfig, accept_next, register_connection};

pub const DEFAULT_ADDR: &str = "127.0.0.1:8730";
/// One poll response carries at most this many events / bytes; `next_cursor` continues.
const POLL_MAX_EVENTS: usize = 1000;
const POLL_MAX_BYTES: usize = 4 * 1024 * 1024;
/// A live stream takes this much from the log per step, so one follower cannot hog the loop.
const STREAM_STEP_EVENTS: usize = 256;
const STREAM_STEP_BYTES: usize = 256 * 1024;

const OPENAPI: &str = include_str!("openapi.json");

/// What this surface registers on the loop.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HttpKey {
    Listener,
    Conn(u64),
}

/// A live `follow=1` stream on one connection.
struct Follow {
    run: RunId,
    /// The opening status line was decided (sent, or deferred for a finished run).
    started: bool,
    next_cursor: u64,
    sent_status: Option<DriveStatus>,
    /// `None`: nothing sent yet; `Some(x)`: the last prompt state sent (x may be null).
    sent_prompt: Option<Value>,
    sse: bool,
}

struct Client {
    conn: Connection,
    token: Token,
    follow: Option<Follow>,
    idle_timer: TimerId,
}

pub struct HttpServe {
    config: ListenConfig,
    listener: TcpListener,
    listener_token: Option<Token>,
    clients: HashMap<u64, Client>,
    next_key: u64,
    accept_paused: bool,
}

fn json_response(conn: &mut Connection, status: u16, body: &Value) {
    conn.respond(
        status,
        &[("content-type", "application/json")],
        body.to_string().as_bytes(),
    );
}

fn error_response(conn: &mut Connection, status: u16, message: &str) {
    json_response(conn, status, &json!({"error": message}));
}

fn drive_error_status(err: &DriveError) -> u16 {
    match err {
        DriveError::UnknownRun(_) => 404,
        DriveError::Input(_) | DriveError::Permit(_) | DriveError::Foreign(_) => 409,
        DriveError::Busy(_) => 503,
        DriveError::BadRequest(_) => 400,
        DriveError::Build(_) => 500,
    }
}

/// Serves HTTP until SIGINT/SIGTERM; runs still going are cancelled on the way out.
pub fn run(mut engine: Engine<Key<HttpKey>>, core: DriveCore, listen: ListenConfig) -> u8 {
    let addr = listen.addr;
    let scheme = if listen.tls.is_some() {
        "https"
    } else {
        "http"
    };
    let server = match HttpServe::new(listen) {
        Ok(s) => s,
        Err(e) => {
            log::error(&format!("failed to bind {addr}: {e}"));
            return crate::exit::RUNTIME;
        }
    };
    let mut host = DriveHost::new(core, server);
    if let Err(e) = engine.with_ctx(|ctx| host.with(ctx, |http, cx| http.start(cx))) {
        log::error(&format!("cannot listen on {addr}: {e}"));
        return crate::exit::RUNTIME;
    }
    let local = host.surface.local_addr().unwrap_or(addr);
    // One line on stderr that scripts and tests can wait for (stdout stays unused).
    eprintln!("caliban http serve listening on {scheme}://{local}");
    if let Err(e) = engine.run_loop(&mut host) {
        log::error(&format!("event loop failed: {e}"));
        return crate::exit::RUNTIME;
    }
    crate::exit::OK
}

impl HttpServe {
    pub fn new(config: ListenConfig) -> std::io::Result<HttpServe> {
        let listener = TcpListener::bind(config.addr)?;
        Ok(HttpServe {
            config,
            listener,
            listener_token: None,
            clients: HashMap::new(),
            next_key: 0,
            accept_paused: false,
        })
    }

    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Registers the listener on the engine's loop.
    pub fn start(&mut self, ctx: &mut Cx<HttpKey>) -> std::io::Result<()> {
        let token = ctx.host_token(HttpKey::Listener);
        ctx.registry()
            .register(&mut self.listener, token, Interest::READABLE)?;
        self.listener_token = Some(token);
        Ok(())
    }

    fn accept(&mut self, ctx: &mut Cx<HttpKey>) {
        loop {
            let open = self.clients.len();
            match accept_next(&self.listener, open, self.config.max_connections) {
                AcceptStep::Conn(tcp, peer) => self.add_client(ctx, tcp, peer),
                AcceptStep::Drained => {
                    self.accept_paused = false;
                    return;
                }
                // `close_client` resumes accepting.
                AcceptStep::Full | AcceptStep::Failed => {
                    self.accept_paused = true;
                    return;
                }
            }
        }
    }

    fn add_client(&mut self, ctx: &mut Cx<HttpKey>, tcp: mio::net::TcpStream, peer: SocketAddr) {
        let key = self.next_key;
        self.next_key += 1;
        let Some(accepted) = register_connection(ctx, &self.config, tcp, peer, HttpKey::Conn(key))
        else {
            return;
        };
        self.clients.insert(
            key,
            Client {
                conn: accepted.conn,
                token: accepted.token,
                follow: None,
                idle_timer: accepted.idle_timer,
            },
        );
        // Bytes may already be waiting (a fast client); readiness was edge-triggered
        // before we registered, so look now.
        self.on_client_ready(ctx, key);
    }

    fn close_client(&mut self, ctx: &mut Cx<HttpKey>, key: u64) {
        if let Some(mut client) = self.clients.remove(&key) {
            let _ = ctx.registry().deregister(client.conn.tcp());
            ctx.forget_token(client.token);
            ctx.cancel_timer(client.idle_timer);
            client.conn.close();
        }
        if self.accept_paused {
            self.accept(ctx);
        }
    }

    fn on_client_ready(&mut self, ctx: &mut Cx<HttpKey>, key: u64) {
        let Some(client) = self.clients.get_mut(&key) else {
            return;
        };
        let events = client.conn.on_ready();
        for event in events {
            match event {
                ConnEvent::Request(request) => self.handle(ctx, key, request),
                ConnEvent::Writable => self.pump_follow(ctx.core, key),
                ConnEvent::Closed => {
                    self.close_client(ctx, key);
                    return;
                }
            }
        }
        // A follower that hung up will never read the rest of its stream.
        if let Some(client) = self.clients.get(&key)
            && client.follow.is_some()
            && client.conn.peer_eof()
        {
            self.close_client(ctx, key);
            return;
        }
        self.after_response(ctx, key);
    }

    /// Serves requests a pipelining client already sent, and drops closed connections.
    fn after_response(&mut self, ctx: &mut Cx<HttpKey>, key: u64) {
        loop {
            let Some(client) = self.clients.get_mut(&key) else {
                return;
            };
            if client.conn.is_closed() {
                self.close_client(ctx, key);
                return;
            }
            if client.follow.is_some() || client.conn.is_streaming() {
                return;
            }
            match client.conn.next_request() {
                Some(request) => self.handle(ctx, key, request),
                None => return,
            }
        }
    }

    fn handle(&mut self, ctx: &mut Cx<HttpKey>, key: u64, request: Request) {
        let Some(client) = self.clients.get_mut(&key) else {
            return;
        };
        let peer = self.config.gate.classify(&client.conn.peer().ip());
        if let Err(reason) = self.config.gate.check_browser_headers(
            peer,
            request.header("host"),
            request.header("origin"),
        ) {
            client.conn.respond(
                403,
                &[
                    ("content-type", "application/json"),
                    ("connection", "close"),
                ],
                json!({ "error": reason }).to_string().as_bytes(),
            );
            return;
        }
        if let Decision::Deny(_) = self
            .config
            .gate
            .authorize(peer, request.header("authorization"))
        {
            client.conn.respond(
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
        // The run a path names, parsed (and read back from disk if evicted or from before a
        // restart) once; routes report an unknown one where they would use it.
        let run = match run_in_path(&request.path) {
            Some(id) => ctx.core.resolve(id),
            None => Err(DriveError::UnknownRun(String::new())),
        };
        let run_or_status = || {
            run.clone()
                .map_err(|e| (drive_error_status(&e), e.to_string()))
        };
        let Some(client) = self.clients.get_mut(&key) else {
            return;
        };
        let segments: Vec<&str> = request
            .path
            .trim_start_matches('/')
            .split('/')
            .filter(|s| !s.is_empty())
            .collect();
        let method = request.method.as_str();
        match (method, segments.as_slice()) {
            ("GET", ["healthz"]) => json_response(
                &mut client.conn,
                200,
                &json!({"status": "ok", "version": crate::cli::VERSION}),
            ),
            ("GET", ["metrics"]) => {
                let text = self.metrics(ctx);
                let Some(client) = self.clients.get_mut(&key) else {
                    return;
                };
                client.conn.respond(
                    200,
                    &[("content-type", "text/plain; version=0.0.4; charset=utf-8")],
                    text.as_bytes(),
                );
            }
            ("GET", ["openapi.json"]) => client.conn.respond(
                200,
                &[("content-type", "application/json")],
                OPENAPI.as_bytes(),
            ),
            ("POST", ["runs"]) => {
                let result = parse_json_body(&request)
                    .and_then(|body| ops::run_spec(&body, Dialect::HTTP).map_err(op_error));
                let result = result.and_then(|spec| {
                    ctx.core
                        .start_run(spec)
                        .map_err(|e| (drive_error_status(&e), e.to_string()))
                });
                let Some(client) = self.clients.get_mut(&key) else {
                    return;
                };
                match result {
                    Ok(run) => {
                        json_response(&mut client.conn, 200, &json!({"run_id": run.to_string()}))
                    }
                    Err((status, message)) => error_response(&mut client.conn, status, &message),
                }
            }
            ("GET", ["runs"]) => {
                let runs: Vec<Value> = ctx
                    .core
                    .list()
                    .into_iter()
                    .map(|r| {
                        json!({"run_id": r.run_id.to_string(), "status": r.status.to_json(),
                               "interactive": r.interactive, "created_ms": r.created_ms,
                               "events": r.events, "prompt": preview(&r.prompt)})
                    })
                    .collect();
                json_response(&mut client.conn, 200, &json!({"runs": runs}));
            }
            ("GET", ["runs", _, "events"]) => self.events(ctx, key, run, &request),
            ("GET", ["runs", _, "status"]) => match run.and_then(|r| ctx.core.status(r)) {
                Ok(status) => {
                    json_response(&mut client.conn, 200, &json!({"status": status.to_json()}))
                }
                Err(e) => error_response(&mut client.conn, drive_error_status(&e), &e.to_string()),
            },
            ("POST", ["runs", _, "input"]) => {
                let result = parse_json_body(&request).and_then(|body| {
                    let input = ops::input(&body, Dialect::HTTP).map_err(op_error)?;
                    ctx.core
                        .send_input(run_or_status()?, input)
                        .map_err(|e| (drive_error_status(&e), e.to_string()))
                });
                self.reply_ok(key, result);
            }
            ("POST", ["runs", _, "permit"]) => {
                let result = parse_json_body(&request).and_then(|body| {
                    let answer = ops::answer(&body, Dialect::HTTP).map_err(op_error)?;
                    ctx.core
                        .permit(
                            run_or_status()?,
                            &answer.tool_use_id,
                            answer.allow,
                            answer.reason,
                        )
                        .map_err(|e| (drive_error_status(&e), e.to_string()))
                });
                self.reply_ok(key, result);
            }
            ("POST", ["runs", _, "cancel"]) => {
                let result = run_or_status().and_then(|run| {
                    ctx.core
                        .cancel(run)
                        .map_err(|e| (drive_error_status(&e), e.to_string()))
                });
                self.reply_ok(key, result);
            }
            ("DELETE", ["runs", _]) => {
                let result = run_or_status().and_then(|run| {
                    ctx.core
                        .delete(run)
                        .map_err(|e| (drive_error_status(&e), e.to_string()))
                });
                self.reply_ok(key, result);
            }
            (
                _,
                ["healthz"]
                | ["metrics"]
                | ["openapi.json"]
                | ["runs", _, "events"]
                | ["runs", _, "status"],
            ) => method_not_allowed(&mut client.conn, "GET"),
            (_, ["runs"]) => method_not_allowed(&mut client.conn, "GET, POST"),
            (_, ["runs", _, "input" | "permit" | "cancel"]) => {
                method_not_allowed(&mut client.conn, "POST")
            }
            (_, ["runs", _]) => method_not_allowed(&mut client.conn, "DELETE"),
            _ => error_response(&mut client.conn, 404, "not found"),
        }
    }

    fn reply_ok(&mut self, key: u64, result: Result<(), (u16, String)>) {
        let Some(client) = self.clients.get_mut(&key) else {
            return;
        };
        match result {
            Ok(()) => json_response(&mut client.conn, 200, &json!({"ok": true})),
            Err((status, message)) => error_response(&mut client.conn, status, &message),
        }
    }

    fn events(
        &mut self,
        ctx: &mut Cx<HttpKey>,
        key: u64,
        run: Result<RunId, DriveError>,
        request: &Request,
    ) {
        let Some(client) = self.clients.get_mut(&key) else {
            return;
        };
        let sse = request
            .header("accept")
            .is_some_and(|a| a.contains("text/event-stream"));
        let follow = matches!(request.query_param("follow"), Some("1" | "true"));
        // A reconnecting EventSource repeats its original URL (often `cursor=0`) and adds
        // `Last-Event-ID`: the header is the newer information, so it wins.
        let last_event_id = request
            .header("last-event-id")
            .and_then(|v| v.trim().parse::<u64>().ok());
        let cursor = match request.query_param("cursor") {
            _ if last_event_id.is_some() => last_event_id.unwrap_or(0),
            Some(raw) => match raw.parse::<u64>() {
                Ok(c) => c,
                Err(_) => {
                    error_response(
                        &mut client.conn,
                        400,
                        &format!("invalid cursor `{raw}`: expected a non-negative integer"),
                    );
                    return;
                }
            },
            None => 0,
        };
        let id = match run {
            Ok(id) => id,
            Err(e) => {
                error_response(&mut client.conn, drive_error_status(&e), &e.to_string());
                return;
            }
        };
        if follow {
            let content_type = if sse {
                "text/event-stream"
            } else {
                "application/x-ndjson"
            };
            client.conn.start_stream(
                200,
                &[
                    ("content-type", content_type),
                    ("cache-control", "no-store"),
                ],
            );
            client.follow = Some(Follow {
                run: id,
                started: false,
                next_cursor: cursor,
                sent_status: None,
                sent_prompt: None,
                sse,
            });
            self.pump_follow(ctx.core, key);
            return;
        }
        match ctx.core.poll(id, cursor, POLL_MAX_EVENTS, POLL_MAX_BYTES) {
            Ok(view) => client.conn.respond(
                200,
                &[("content-type", "application/json")],
                view.to_json_text().as_bytes(),
            ),
            Err(e) => error_response(&mut client.conn, drive_error_status(&e), &e.to_string()),
        }
    }

    /// Writes what a live stream has not seen yet, as far as the client keeps up: events in
    /// order, then (once caught up) the prompt and status if they changed. The stream ends
    /// after the line carrying a terminal status, which is only sent once every event was.
    fn pump_follow(&mut self, core: &DriveCore, key: u64) {
        let Some(client) = self.clients.get_mut(&key) else {
            return;
        };
        let Some(follow) = client.follow.as_mut() else {
            return;
        };
        let line = |follow: &Follow, cursor: u64, body: String| -> String {
            if follow.sse {
                format!("id: {cursor}\ndata: {body}\n\n")
            } else {
                format!("{body}\n")
            }
        };
        // The first line is the status (DESIGN §4.5) as of the starting cursor: for a live
        // run that is its current status; a replay of a finished run opens with the status
        // it had back then, so its terminal status still comes last, after every event.
        if !follow.started {
            follow.started = true;
            let (Ok(status), Ok(total)) = (
                core.status_at(follow.run, follow.next_cursor),
                core.event_count(follow.run),
            ) else {
                client.conn.end_stream();
                client.follow = None;
                return;
            };
            // A cursor past the end resumes from the end, as a poll does.
            follow.next_cursor = follow.next_cursor.min(total);
            let body = format!(
                "{{\"v\":1,\"cursor\":{},\"status\":{}}}",
                follow.next_cursor,
                status.to_json()
            );
            client
                .conn
                .stream_chunk(line(follow, follow.next_cursor, body).as_bytes());
            follow.sent_status = Some(status);
        }
        loop {
            if !client.conn.wants_more_stream() {
                return;
            }
            let view = match core.poll(
                follow.run,
                follow.next_cursor,
                STREAM_STEP_EVENTS,
                STREAM_STEP_BYTES,
            ) {
                Ok(view) => view,
                Err(_) => {
                    // Deleted while followed: nothing more will come.
                    client.conn.end_stream();
                    client.follow = None;
                    return;
                }
            };
            if !view.events.is_empty() {
                let mut chunk = String::new();
                for (cursor, raw) in &view.events {
                    let body = format!("{{\"v\":1,\"cursor\":{},\"event\":{raw}}}", cursor + 1);
                    chunk.push_str(&line(follow, cursor + 1, body));
                }
                follow.next_cursor = view.next_cursor;
                client.conn.stream_chunk(chunk.as_bytes());
                continue;
            }
            // Caught up with the log.
            follow.next_cursor = view.next_cursor;
            let prompt = view
                .permission_request
                .as_ref()
                .map_or(Value::Null, |p| p.to_json());
            if follow.sent_prompt.as_ref() != Some(&prompt)
                && !(follow.sent_prompt.is_none() && prompt.is_null())
            {
                let body = format!(
                    "{{\"v\":1,\"cursor\":{},\"permission_request\":{prompt}}}",
                    follow.next_cursor
                );
                client
                    .conn
                    .stream_chunk(line(follow, follow.next_cursor, body).as_bytes());
                follow.sent_prompt = Some(prompt);
            }
            if follow.sent_status.as_ref() != Some(&view.status) {
                let body = format!(
                    "{{\"v\":1,\"cursor\":{},\"status\":{}}}",
                    follow.next_cursor,
                    view.status.to_json()
                );
                client
                    .conn
                    .stream_chunk(line(follow, follow.next_cursor, body).as_bytes());
                follow.sent_status = Some(view.status.clone());
            }
            if view.status.is_terminal() {
                client.conn.end_stream();
                client.follow = None;
            }
            return;
        }
    }

    fn metrics(&self, ctx: &Cx<HttpKey>) -> String {
        let (by_state, events) = ctx.core.counts();
        let stats = ctx.stats();
        let mut out = String::new();
        out.push_str("# HELP caliban_runs Runs known to this server, by lifecycle state.\n");
        out.push_str("# TYPE caliban_runs gauge\n");
        for (state, n) in by_state {
            let _ = writeln!(out, "caliban_runs{{state=\"{state}\"}} {n}");
        }
        let counters: [(&str, &str, &str, u64); 6] = [
            (
                "caliban_events_total",
                "counter",
                "Turn events appended by this process.",
                events,
            ),
            (
                "caliban_http_connections",
                "gauge",
                "Open HTTP connections.",
                self.clients.len() as u64,
            ),
            (
                "caliban_model_requests_total",
                "counter",
                "Model requests started, retries included.",
                stats.model_requests,
            ),
            (
                "caliban_model_retries_total",
                "counter",
                "Model requests retried after a failure.",
                stats.model_retries,
            ),
            (
                "caliban_model_errors_total",
                "counter",
                "Runs ended by a model or transport failure.",
                stats.model_errors,
            ),
            (
                "caliban_tool_calls_total",
                "counter",
                "Tool calls executed.",
                stats.tool_calls,
            ),
        ];
        for (name, kind, help, value) in counters {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
            );
        }
        out
    }

    fn pump_all(&mut self, ctx: &mut Cx<HttpKey>, changed: &BTreeSet<RunId>) {
        if changed.is_empty() {
            return;
        }
        let keys: Vec<u64> = self
            .clients
            .iter()
            .filter(|(_, c)| c.follow.as_ref().is_some_and(|f| changed.contains(&f.run)))
            .map(|(k, _)| *k)
            .collect();
        for key in keys {
            self.pump_follow(ctx.core, key);
            self.after_response(ctx, key);
        }
    }
}

/// The listing shows the start of each prompt; the full text is in the run's session.
fn preview(prompt: &str) -> String {
    const MAX_CHARS: usize = 200;
    crate::text::cap_chars(prompt, MAX_CHARS)
}

/// The run id in `/runs/<id>[/…]`, if the path names one.
fn run_in_path(path: &str) -> Option<&str> {
    let rest = path.strip_prefix("/runs/")?;
    let id = rest.split('/').next()?;
    (!id.is_empty()).then_some(id)
}

fn method_not_allowed(conn: &mut Connection, allow: &str) {
    conn.respond(
        405,
        &[("content-type", "application/json"), ("allow", allow)],
        json!({"error": "method not allowed"})
            .to_string()
            .as_bytes(),
    );
}

/// The JSON body of a POST: 415 unless it says JSON, 400 if it does not parse, 422 if it is
/// not an object (upstream's axum answers the same way).
fn parse_json_body(request: &Request) -> Result<Value, (u16, String)> {
    let content_type = request.header("content-type").unwrap_or("");
    let is_json = content_type
        .split(';')
        .next()
        .is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json"));
    if !is_json {
        return Err((
            415,
            "expected request with `content-type: application/json`".to_owned(),
        ));
    }
    let value: Value = serde_json::from_slice(&request.body)
        .map_err(|e| (400, format!("invalid JSON body: {e}")))?;
    if !value.is_object() {
        return Err((422, "the body must be a JSON object".to_owned()));
    }
    Ok(value)
}

/// A body that does not decode: 422 for the wrong shape (what upstream's axum `Json`
/// extractor refuses), 400 for a well-typed value that is invalid or input with neither
/// `text` nor `end`.
fn op_error(e: OpError) -> (u16, String) {
    let status = match e.problem {
        Problem::NotObject { .. }
        | Problem::Missing { .. }
        | Problem::WrongType { .. }
        | Problem::Negative { .. } => 422,
        Problem::UnknownMode { .. } | Problem::BadRule { .. } | Problem::NoInput => 400,
    };
    (status, e.to_string())
}

impl Surface for HttpServe {
    type Key = HttpKey;

    fn on_signal(&mut self, ctx: &mut Cx<HttpKey>, signal: Signal) {
        log::info(&format!(
            "{signal:?}: cancelling live runs and shutting down"
        ));
        for summary in ctx.core.list() {
            if !summary.status.is_terminal() {
                let _ = ctx.core.cancel(summary.run_id);
            }
        }
        ctx.act(HostAction::Quit);
    }

    fn on_io(&mut self, ctx: &mut Cx<HttpKey>, key: HttpKey) {
        match key {
            HttpKey::Listener => self.accept(ctx),
            HttpKey::Conn(key) => self.on_client_ready(ctx, key),
        }
    }

    fn on_timer(&mut self, ctx: &mut Cx<HttpKey>, key: HttpKey) {
        let HttpKey::Conn(key) = key else {
            return;
        };
        let idle = self.config.limits.idle_timeout;
        let Some(client) = self.clients.get_mut(&key) else {
            return;
        };
        let quiet = client.conn.last_activity().elapsed();
        let streaming = client.follow.is_some() || client.conn.is_streaming();
        // Streams are allowed to be quiet (a run waiting on a prompt); request-response
        // connections are closed once idle.
        if !streaming && quiet >= idle {
            self.close_client(ctx, key);
            return;
        }
        // A stream checks back a full period later; a quiet stream must not spin the loop.
        let wait = if streaming {
            idle
        } else {
            idle.saturating_sub(quiet).max(Duration::from_millis(10))
        };
        client.idle_timer = ctx.add_timer(wait, HttpKey::Conn(key));
    }

    fn after_batch(&mut self, ctx: &mut Cx<HttpKey>, changed: &BTreeSet<RunId>) {
        self.pump_all(ctx, changed);
    }
}
