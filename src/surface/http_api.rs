//! `caliban http serve`: upstream's polling routes plus live NDJSON/SSE streams, run
//! listing, cancel and delete, health, metrics and the OpenAPI document, over HTTP/1.1 (or
//! HTTPS) on the engine's loop.
//!
//! It translates HTTP to drive-core calls and drive-core state to HTTP; it holds no agent
//! logic. It owns each live stream's position and heartbeat; the listener, the connections,
//! their deadlines and the auth gate are the network front's (`surface::front`).
//!
//! Backpressure: a live stream reads the run's log only as its peer drains the connection
//! (`pump_follow` on `Event::Writable`), one step at a time, so what waits for a follower
//! that stopped reading is its connection's window (`http::server::STREAM_WINDOW`) plus one
//! step, never the rest of the run; the front closes the connection once such a peer has
//! taken nothing for its write-stall deadline.
//!
//! Fairness: one pass of the pump writes at most `PUMP_BUDGET` bytes across all followers;
//! the rest waits in `Pump`'s queue for a zero-delay timer, which the reactor reports after
//! the I/O of its round, so fan-out to many followers never keeps the loop from answering
//! everyone else.

use std::collections::{BTreeMap, BTreeSet, HashSet, VecDeque};
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::time::Duration;

use serde_json::{Value, json};

use crate::cli;
use crate::drive::ops::{self, Dialect, OpError, Problem};
use crate::drive::table::{DriveCore, DriveError, DriveStatus, MAX_RUNS_PAGE};
use crate::engine::{Engine, HostAction};
use crate::http::server::Request;
use crate::ids::RunId;
use crate::log;
use crate::reactor::{Signal, TimerId};
use crate::surface::front::{Event, Front, Keepalive, Policy, Reply, Response};
use crate::surface::host::{Cx, DriveHost, Key, Surface};
use crate::surface::{self, Listening, Listens};
use crate::surface::{ConnId, FrontKey, ListenConfig};

pub const DEFAULT_ADDR: &str = "127.0.0.1:8730";
/// One poll response carries at most this many events / bytes; `next_cursor` continues.
const POLL_MAX_EVENTS: usize = 1000;
const POLL_MAX_BYTES: usize = 4 * 1024 * 1024;
/// A live stream takes this much from the log per step, so one follower cannot hog the loop,
/// and steps only while its connection's window has room: a follower's queued output stays
/// under `http::server::STREAM_WINDOW` plus one step (about 100 KiB with the line framing),
/// or one event when a single event is larger than a step.
const STREAM_STEP_EVENTS: usize = 256;
const STREAM_STEP_BYTES: usize = 32 * 1024;
/// A live stream that carried nothing for this long gets a heartbeat: on NDJSON the line
/// `{"v":1,"cursor":N,"heartbeat":true}` (N is the cursor reached so far), on SSE the
/// comment `: heartbeat`. A run may rightly be quiet for hours (a prompt nobody answered
/// yet); the heartbeat keeps proxies, which commonly cut a connection silent for 60 s, from
/// ending the stream, lets a client tell a quiet run from a dead connection, and makes a
/// vanished peer a failed write (the kernel's `TCP_USER_TIMEOUT`, see `sys::set_keepalive`).
const HEARTBEAT_PERIOD: Duration = Duration::from_secs(15);
/// A heartbeat timer never re-arms sooner than this, so one that fires a hair early cannot
/// spin the loop.
const HEARTBEAT_MIN_REARM: Duration = Duration::from_millis(10);
const SSE_HEARTBEAT: &[u8] = b": heartbeat\n\n";
/// What one pass of the follow pump (a batch of engine work, a round of the front's events,
/// or the pump's own timer) may write to followers before the rest waits for the next round.
/// Without it, a large event fanned out to many followers is one long stall of the loop: 60
/// followers of a run whose last event carried 8 MB of text kept a status request waiting
/// 5 s (debug build). At least one step is always taken, so every pass makes progress.
const PUMP_BUDGET: usize = 4 << 20;

const OPENAPI: &str = include_str!("openapi.json");

/// What this surface registers on the loop: the front's listener, connections and their
/// timers, and each live stream's heartbeat timer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HttpKey {
    Front(FrontKey),
    Heartbeat(ConnId),
    /// The follow pump's next pass (see `PUMP_BUDGET`).
    Pump,
}

impl From<FrontKey> for HttpKey {
    fn from(key: FrontKey) -> HttpKey {
        HttpKey::Front(key)
    }
}

/// This surface's choices for the front. The front leaves a quiet follow stream alone: the
/// surface sends its heartbeats itself (`HEARTBEAT_PERIOD`), since the NDJSON one carries
/// the stream's cursor. A request the browser rule refuses gets the API's JSON error, and
/// the connection ends with it. `GET /healthz` needs no token, so a kubelet's probe (which
/// cannot carry a secret) sees the server alive; it tells only what `/healthz` tells.
const POLICY: Policy = Policy {
    keepalive: Keepalive::Silent,
    forbidden,
    public,
};

fn public(request: &Request) -> Option<Response> {
    (request.method == "GET" && path_segments(request) == ["healthz"]).then(health)
}

fn health() -> Response {
    Response::json(
        200,
        json!({"status": "ok", "version": crate::cli::VERSION}).to_string(),
    )
}

/// The request's path as its non-empty segments, which is how routes are matched.
fn path_segments(request: &Request) -> Vec<&str> {
    request
        .path
        .trim_start_matches('/')
        .split('/')
        .filter(|s| !s.is_empty())
        .collect()
}

fn forbidden(reason: &'static str) -> Response {
    Response::json(403, json!({ "error": reason }).to_string()).header("connection", "close")
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
    /// The stream's heartbeat timer (`HttpKey::Heartbeat`), cancelled when it ends.
    heartbeat: TimerId,
}

/// What a live stream's heartbeat timer does when it fires, the connection having been
/// `quiet` (no byte either way) for that long, with or without output still waiting for
/// the peer: whether to write a heartbeat now, and when to look again.
fn heartbeat_step(quiet: Duration, output_waiting: bool) -> (bool, Duration) {
    if quiet < HEARTBEAT_PERIOD {
        return (false, (HEARTBEAT_PERIOD - quiet).max(HEARTBEAT_MIN_REARM));
    }
    // Bytes that wait for the peer are news enough; it is the front's to give up on a
    // peer that never takes them.
    (!output_waiting, HEARTBEAT_PERIOD)
}

pub struct HttpServe {
    /// Each connection's live stream, if it has one.
    front: Front<Option<Follow>>,
    /// The connections following each run, so a change reaches its followers without a
    /// look at every connection: with a thousand follow streams, that scan was the largest
    /// cost a model event had in user space. A hint, checked on use: an entry whose stream
    /// ended or moved on is dropped when its run next changes or its connection closes.
    followers: BTreeMap<RunId, Vec<ConnId>>,
    pump: Pump,
}

/// Followers that have more to be sent than the last pass could take, in turn.
#[derive(Default)]
struct Pump {
    queue: VecDeque<ConnId>,
    queued: HashSet<ConnId>,
    timer: Option<TimerId>,
    /// Where a step's event lines are put together before they are held on the connection:
    /// kept between steps (a thousand followers take a step each per round of events).
    lines: String,
}

fn json_reply(status: u16, body: &Value) -> Reply {
    Response::json(status, body.to_string()).into()
}

fn error_reply(status: u16, message: &str) -> Reply {
    json_reply(status, &json!({"error": message}))
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
pub fn run(engine: Engine<Key<HttpKey>>, core: DriveCore, listen: ListenConfig) -> u8 {
    let listening = Listening::new(cli::Surface::Http.name(), &listen, "");
    match listening.bound(HttpServe::new(listen)) {
        Ok(server) => surface::serve_listening(engine, DriveHost::new(core, server), &listening),
        Err(code) => code,
    }
}

impl Listens for HttpServe {
    fn listen(&mut self, cx: &mut Cx<HttpKey>) -> std::io::Result<()> {
        self.start(cx)
    }

    fn bound_addr(&self) -> std::io::Result<SocketAddr> {
        self.local_addr()
    }
}

impl HttpServe {
    pub fn new(config: ListenConfig) -> std::io::Result<HttpServe> {
        Ok(HttpServe {
            followers: BTreeMap::new(),
            front: Front::bind(config, POLICY)?,
            pump: Pump::default(),
        })
    }

    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.front.local_addr()
    }

    /// Registers the listener on the engine's loop.
    pub fn start(&mut self, ctx: &mut Cx<HttpKey>) -> std::io::Result<()> {
        self.front.start(ctx)
    }

    /// Acts on what the front has for us: answers requests, feeds live streams.
    fn serve(&mut self, ctx: &mut Cx<HttpKey>) {
        let mut budget = PUMP_BUDGET;
        while let Some(event) = self.front.next_event(ctx) {
            match event {
                Event::Request(conn, request) => {
                    let reply = self.handle(ctx, conn, request);
                    self.front.reply(conn, reply);
                    // A follow stream that just opened gets what there is to see.
                    self.pump_within(ctx, conn, &mut budget);
                }
                Event::Writable(conn) => self.pump_within(ctx, conn, &mut budget),
                // A follower that hung up will never read the rest of its stream.
                Event::HungUp(conn) => self.front.close(ctx, conn),
                Event::Closed(conn, follow) => {
                    if let Some(follow) = follow {
                        ctx.cancel_timer(follow.heartbeat);
                        self.unfollow(follow.run, conn);
                    }
                }
            }
        }
    }

    fn handle(&mut self, ctx: &mut Cx<HttpKey>, conn: ConnId, request: Request) -> Reply {
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
        let segments = path_segments(&request);
        let method = request.method.as_str();
        match (method, segments.as_slice()) {
            ("GET", ["healthz"]) => health().into(),
            ("GET", ["metrics"]) => Response::with(
                200,
                "text/plain; version=0.0.4; charset=utf-8",
                self.metrics(ctx),
            )
            .into(),
            ("GET", ["openapi.json"]) => Response::json(200, OPENAPI).into(),
            ("POST", ["runs"]) => {
                let result = parse_json_body(&request)
                    .and_then(|body| ops::run_spec(&body, Dialect::HTTP).map_err(op_error));
                let result = result.and_then(|spec| {
                    ctx.core
                        .start_run(spec)
                        .map_err(|e| (drive_error_status(&e), e.to_string()))
                });
                match result {
                    Ok(run) => {
                        let mut body = json!({"run_id": run.to_string()});
                        if let Some(files) = ctx.core.instructions(run) {
                            body["instructions"] = files;
                        }
                        json_reply(200, &body)
                    }
                    Err((status, message)) => error_reply(status, &message),
                }
            }
            ("GET", ["runs"]) => list_runs(ctx.core, &request),
            ("GET", ["runs", _, "events"]) => self.events(ctx, conn, run, &request),
            ("GET", ["runs", _, "status"]) => match run.and_then(|r| ctx.core.status(r)) {
                Ok(status) => json_reply(200, &json!({"status": status.to_json()})),
                Err(e) => error_reply(drive_error_status(&e), &e.to_string()),
            },
            ("POST", ["runs", _, "input"]) => {
                let result = parse_json_body(&request).and_then(|body| {
                    let input = ops::input(&body, Dialect::HTTP).map_err(op_error)?;
                    ctx.core
                        .send_input(run_or_status()?, input)
                        .map_err(|e| (drive_error_status(&e), e.to_string()))
                });
                reply_ok(result)
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
                reply_ok(result)
            }
            ("POST", ["runs", _, "cancel"]) => {
                let result = run_or_status().and_then(|run| {
                    ctx.core
                        .cancel(run)
                        .map_err(|e| (drive_error_status(&e), e.to_string()))
                });
                reply_ok(result)
            }
            ("DELETE", ["runs", _]) => {
                let result = run_or_status().and_then(|run| {
                    ctx.core
                        .delete(run)
                        .map_err(|e| (drive_error_status(&e), e.to_string()))
                });
                reply_ok(result)
            }
            (
                _,
                ["healthz"]
                | ["metrics"]
                | ["openapi.json"]
                | ["runs", _, "events"]
                | ["runs", _, "status"],
            ) => method_not_allowed("GET"),
            (_, ["runs"]) => method_not_allowed("GET, POST"),
            (_, ["runs", _, "input" | "permit" | "cancel"]) => method_not_allowed("POST"),
            (_, ["runs", _]) => method_not_allowed("DELETE"),
            _ => error_reply(404, "not found"),
        }
    }

    /// A poll of a run's events, or (with `follow=1`) the start of its live stream.
    fn events(
        &mut self,
        ctx: &mut Cx<HttpKey>,
        conn: ConnId,
        run: Result<RunId, DriveError>,
        request: &Request,
    ) -> Reply {
        let sse = request
            .header("accept")
            .is_some_and(|a| a.contains("text/event-stream"));
        let follow = matches!(request.query_param("follow"), Some("1" | "true"));
        // A reconnecting EventSource repeats its original URL (often `cursor=0`) and adds
        // `Last-Event-ID`: the header is the newer information, so it wins.
        let last_event_id = request
            .header("last-event-id")
            .and_then(|v| v.trim().parse::<u64>().ok());
        // A malformed `cursor` is refused even when the header overrides it, as the
        // document's schema for it says.
        let cursor = match request.query_param("cursor") {
            Some(raw) => match raw.parse::<u64>() {
                Ok(c) => c,
                Err(_) => {
                    return error_reply(
                        400,
                        &format!("invalid cursor `{raw}`: expected a non-negative integer"),
                    );
                }
            },
            None => 0,
        };
        let cursor = last_event_id.unwrap_or(cursor);
        let id = match run {
            Ok(id) => id,
            Err(e) => return error_reply(drive_error_status(&e), &e.to_string()),
        };
        if follow {
            let content_type = if sse {
                "text/event-stream"
            } else {
                "application/x-ndjson"
            };
            // `serve` pumps the stream once its head is out.
            if let Some(slot) = self.front.conn_mut(conn) {
                let heartbeat = ctx.add_timer(HEARTBEAT_PERIOD, HttpKey::Heartbeat(conn));
                let previous = slot.state.replace(Follow {
                    run: id,
                    started: false,
                    next_cursor: cursor,
                    sent_status: None,
                    sent_prompt: None,
                    sse,
                    heartbeat,
                });
                if let Some(previous) = previous {
                    ctx.cancel_timer(previous.heartbeat);
                    self.unfollow(previous.run, conn);
                }
                self.followers.entry(id).or_default().push(conn);
            }
            return Reply::Stream {
                response: Response::with(200, content_type, Vec::new())
                    .header("cache-control", "no-store"),
                open: true,
            };
        }
        match ctx.core.poll(id, cursor, POLL_MAX_EVENTS, POLL_MAX_BYTES) {
            Ok(view) => Response::json(200, view.to_json_text()).into(),
            Err(e) => error_reply(drive_error_status(&e), &e.to_string()),
        }
    }

    /// Writes what a live stream has not seen yet, as far as the client keeps up: events in
    /// order, then (once caught up) the prompt and status if they changed. The stream ends
    /// after the line carrying a terminal status, which is only sent once every event was.
    /// Feeds `conn`'s live stream if `budget` allows, or queues it for the pump's next pass.
    fn pump_within(&mut self, ctx: &mut Cx<HttpKey>, conn: ConnId, budget: &mut usize) {
        if *budget == 0 || self.pump_follow(ctx, conn, budget) {
            self.pump_later(ctx, conn);
        }
    }

    fn pump_later(&mut self, ctx: &mut Cx<HttpKey>, conn: ConnId) {
        if self.pump.queued.insert(conn) {
            self.pump.queue.push_back(conn);
        }
        if self.pump.timer.is_none() {
            self.pump.timer = Some(ctx.add_timer(Duration::ZERO, HttpKey::Pump));
        }
    }

    /// The pump's timer: a pass over the followers that waited, oldest first.
    fn on_pump(&mut self, ctx: &mut Cx<HttpKey>) {
        self.pump.timer = None;
        let waiting = std::mem::take(&mut self.pump.queue);
        self.pump.queued.clear();
        let mut budget = PUMP_BUDGET;
        for conn in waiting {
            self.pump_within(ctx, conn, &mut budget);
        }
    }

    /// Writes what `conn`'s live stream has to say while its window has room, taking what it
    /// writes from `budget`. True when it stopped because the budget ran out with more to say.
    fn pump_follow(&mut self, ctx: &mut Cx<HttpKey>, conn: ConnId, budget: &mut usize) -> bool {
        let more = self.hold_follow(ctx, conn, budget);
        // A finished run's last events, its terminal status and the body's end go out in one
        // `send`: flat out, three per run were a third of the loop's time in the kernel.
        if let Some(slot) = self.front.conn_mut(conn) {
            slot.conn.flush_stream();
        }
        more
    }

    /// `pump_follow`'s lines, held on the connection (`hold_stream_chunk`) for one write.
    fn hold_follow(&mut self, ctx: &mut Cx<HttpKey>, conn: ConnId, budget: &mut usize) -> bool {
        let Some(slot) = self.front.conn_mut(conn) else {
            return false;
        };
        let Some(follow) = slot.state.as_mut() else {
            return false;
        };
        // An SSE `id:` names a place in the event log, so only event lines carry one (their
        // cursor). A status or prompt line has no place of its own: it carries none, and an
        // SSE client keeps the last event's id, which is where a reconnect must resume; an
        // id of its own would repeat the event's, and look like that event sent again.
        let line = |follow: &Follow, body: String| -> String {
            if follow.sse {
                format!("data: {body}\n\n")
            } else {
                format!("{body}\n")
            }
        };
        // The first line is the status (DESIGN §4.5) as of the starting cursor, so that a
        // terminal status still comes last, after every event. A stream that starts behind
        // the end of the log (a replay, of a finished run say) opens with the status the run
        // had at that point, which is no longer its status: the line says so with
        // `"replay":true`, and the status lines after the events bring it up to date.
        if !follow.started {
            follow.started = true;
            let (Ok(status), Ok(total)) = (
                ctx.core.status_at(follow.run, follow.next_cursor),
                ctx.core.event_count(follow.run),
            ) else {
                slot.conn.end_stream();
                end_follow(ctx, &mut slot.state);
                return false;
            };
            // A cursor past the end resumes from the end, as a poll does.
            follow.next_cursor = follow.next_cursor.min(total);
            let replay = if follow.next_cursor < total {
                ",\"replay\":true"
            } else {
                ""
            };
            let body = format!(
                "{{\"v\":1,\"cursor\":{},\"status\":{}{replay}}}",
                follow.next_cursor,
                status.to_json()
            );
            slot.conn.hold_stream_chunk(line(follow, body).as_bytes());
            follow.sent_status = Some(status);
        }
        loop {
            if !slot.conn.wants_more_stream() {
                // What is held counts against the window until the socket takes it.
                slot.conn.flush_stream();
                if !slot.conn.wants_more_stream() {
                    return false;
                }
            }
            if *budget == 0 {
                return true;
            }
            let view = match ctx.core.poll(
                follow.run,
                follow.next_cursor,
                STREAM_STEP_EVENTS,
                STREAM_STEP_BYTES,
            ) {
                Ok(view) => view,
                Err(_) => {
                    // Deleted while followed: nothing more will come.
                    slot.conn.end_stream();
                    end_follow(ctx, &mut slot.state);
                    return false;
                }
            };
            if !view.events.is_empty() {
                // Event lines carry their cursor as the SSE `id:`; written in place, since a
                // flat-out stream is many small events per step, and two strings each were
                // most of the pump's own time.
                let text: usize = view.events.iter().map(|(_, raw)| raw.len()).sum();
                let chunk = &mut self.pump.lines;
                chunk.clear();
                chunk.reserve(text + 64 * view.events.len());
                for (cursor, raw) in &view.events {
                    let next = cursor + 1;
                    if follow.sse {
                        let _ = write!(chunk, "id: {next}\ndata: ");
                    }
                    let _ = write!(chunk, "{{\"v\":1,\"cursor\":{next},\"event\":{raw}}}");
                    chunk.push_str(if follow.sse { "\n\n" } else { "\n" });
                }
                follow.next_cursor = view.next_cursor;
                slot.conn.hold_stream_chunk(chunk.as_bytes());
                *budget = budget.saturating_sub(chunk.len());
                if chunk.capacity() > 2 * STREAM_STEP_BYTES {
                    // A step of large events is not kept for the small ones after it.
                    *chunk = String::new();
                }
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
                slot.conn.hold_stream_chunk(line(follow, body).as_bytes());
                follow.sent_prompt = Some(prompt);
            }
            if follow.sent_status.as_ref() != Some(&view.status) {
                let body = format!(
                    "{{\"v\":1,\"cursor\":{},\"status\":{}}}",
                    follow.next_cursor,
                    view.status.to_json()
                );
                slot.conn.hold_stream_chunk(line(follow, body).as_bytes());
                follow.sent_status = Some(view.status.clone());
            }
            if view.status.is_terminal() {
                slot.conn.end_stream();
                end_follow(ctx, &mut slot.state);
            }
            return false;
        }
    }

    /// A live stream's heartbeat timer fired: a heartbeat if the connection has been quiet
    /// for a period (see `HEARTBEAT_PERIOD`), and the timer again.
    fn on_heartbeat(&mut self, ctx: &mut Cx<HttpKey>, conn: ConnId) {
        let Some(slot) = self.front.conn_mut(conn) else {
            return;
        };
        let Some(follow) = slot.state.as_mut() else {
            return;
        };
        let (beat, wait) = heartbeat_step(
            slot.conn.last_activity().elapsed(),
            slot.conn.write_stalled_for().is_some(),
        );
        if beat {
            if follow.sse {
                slot.conn.stream_chunk(SSE_HEARTBEAT);
            } else {
                let line = format!(
                    "{{\"v\":1,\"cursor\":{},\"heartbeat\":true}}\n",
                    follow.next_cursor
                );
                slot.conn.stream_chunk(line.as_bytes());
            }
        }
        follow.heartbeat = ctx.add_timer(wait, HttpKey::Heartbeat(conn));
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
                self.front.len() as u64,
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
        let mut budget = PUMP_BUDGET;
        for &run in changed {
            let Some(conns) = self.followers.get(&run).cloned() else {
                continue;
            };
            for &conn in &conns {
                self.pump_within(ctx, conn, &mut budget);
            }
            // Streams that ended (a terminal status went out) or moved on leave the index.
            let front = &self.front;
            let still: Vec<ConnId> = conns
                .into_iter()
                .filter(|&conn| {
                    front
                        .get(conn)
                        .is_some_and(|slot| slot.state.as_ref().is_some_and(|f| f.run == run))
                })
                .collect();
            if still.is_empty() {
                self.followers.remove(&run);
            } else {
                self.followers.insert(run, still);
            }
        }
    }

    /// `conn` no longer follows `run`.
    fn unfollow(&mut self, run: RunId, conn: ConnId) {
        if let Some(conns) = self.followers.get_mut(&run) {
            conns.retain(|&c| c != conn);
            if conns.is_empty() {
                self.followers.remove(&run);
            }
        }
    }
}

/// A live stream is over: its state goes, and its heartbeat timer with it.
fn end_follow(ctx: &mut Cx<HttpKey>, state: &mut Option<Follow>) {
    if let Some(follow) = state.take() {
        ctx.cancel_timer(follow.heartbeat);
    }
}

/// `GET /runs`: one page of every run on disk (`DriveCore::list_page`), the newest `limit`
/// (at most and by default `MAX_RUNS_PAGE`) below `cursor`, oldest first, with
/// `next_cursor` for the page before when older runs remain.
fn list_runs(core: &DriveCore, request: &Request) -> Reply {
    let limit = match request.query_param("limit") {
        None => MAX_RUNS_PAGE,
        Some(raw) => match raw.parse::<usize>() {
            Ok(n) if (1..=MAX_RUNS_PAGE).contains(&n) => n,
            _ => {
                return error_reply(
                    400,
                    &format!(
                        "invalid limit `{raw}`: expected an integer from 1 to {MAX_RUNS_PAGE}"
                    ),
                );
            }
        },
    };
    let below = match request.query_param("cursor") {
        None => None,
        Some(raw) => match raw.parse::<u64>() {
            Ok(n) => Some(n),
            Err(_) => {
                return error_reply(
                    400,
                    &format!("invalid cursor `{raw}`: expected a non-negative integer"),
                );
            }
        },
    };
    let (runs, next) = match core.list_page(below, limit) {
        Ok(page) => page,
        Err(e) => return error_reply(drive_error_status(&e), &e.to_string()),
    };
    let runs: Vec<Value> = runs
        .into_iter()
        .map(|r| {
            json!({"run_id": r.run_id.to_string(), "status": r.status.to_json(),
                   "interactive": r.interactive, "created_ms": r.created_ms,
                   "events": r.events, "prompt": preview(&r.prompt)})
        })
        .collect();
    let mut body = json!({"runs": runs});
    if let Some(next) = next {
        body["next_cursor"] = json!(next);
    }
    json_reply(200, &body)
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

fn method_not_allowed(allow: &str) -> Reply {
    Response::json(405, json!({"error": "method not allowed"}).to_string())
        .header("allow", allow)
        .into()
}

fn reply_ok(result: Result<(), (u16, String)>) -> Reply {
    match result {
        Ok(()) => json_reply(200, &json!({"ok": true})),
        Err((status, message)) => error_reply(status, &message),
    }
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
        Problem::NotObject { .. } | Problem::Missing { .. } | Problem::WrongType { .. } => 422,
        Problem::UnknownMode { .. }
        | Problem::UnknownSandbox { .. }
        | Problem::BadRule { .. }
        | Problem::NoInput
        | Problem::BadImage { .. } => 400,
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
        if let HttpKey::Front(key) = key {
            self.front.on_io(ctx, key);
        }
        self.serve(ctx);
    }

    fn on_timer(&mut self, ctx: &mut Cx<HttpKey>, key: HttpKey) {
        match key {
            HttpKey::Front(key) => self.front.on_timer(ctx, key),
            HttpKey::Heartbeat(conn) => self.on_heartbeat(ctx, conn),
            HttpKey::Pump => self.on_pump(ctx),
        }
        self.serve(ctx);
    }

    fn after_batch(&mut self, ctx: &mut Cx<HttpKey>, changed: &BTreeSet<RunId>) {
        self.pump_all(ctx, changed);
        self.serve(ctx);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    #[test]
    fn a_stream_quiet_for_a_period_gets_a_heartbeat_and_the_timer_again() {
        assert_eq!(
            heartbeat_step(HEARTBEAT_PERIOD, false),
            (true, HEARTBEAT_PERIOD)
        );
        assert_eq!(heartbeat_step(secs(3600), false), (true, HEARTBEAT_PERIOD));
        // Something went out meanwhile: look again when the period since then is over.
        assert_eq!(
            heartbeat_step(secs(5), false),
            (false, HEARTBEAT_PERIOD - secs(5))
        );
        // A timer that fires a hair early does not spin.
        assert_eq!(
            heartbeat_step(HEARTBEAT_PERIOD - Duration::from_micros(1), false),
            (false, HEARTBEAT_MIN_REARM)
        );
        // Output already waits for the peer: no heartbeat on top of it.
        assert_eq!(heartbeat_step(secs(60), true), (false, HEARTBEAT_PERIOD));
        // Well inside the 60 s after which proxies commonly cut a silent connection.
        assert!(HEARTBEAT_PERIOD * 3 <= secs(60));
    }
}
