//! `caliban mcp serve`: an MCP server (revision 2025-11-25, negotiating down to 2025-06-18
//! and 2025-03-26) over stdio and, with `--listen`, Streamable HTTP at `/mcp`. Another agent
//! drives caliban as a worker through upstream's five tools plus `caliban_cancel`
//! (`reference/upstream-caliban.md` §3, `reference/mcp.md` §2–§3).
//!
//! Every client — the stdio peer and each HTTP session — is a `Session` over the one shared
//! `DriveCore`; a reply goes back to the session (and, over HTTP, the request stream) it
//! answers. It translates MCP to drive-core calls and drive-core state to MCP; it holds no
//! agent logic.
//!
//! Nothing blocks the loop: a long-poll (`caliban_poll` with `wait_ms`) is a `Wait` that
//! `after_batch` completes when `DriveCore::take_changed` reports news for its run, or a
//! host timer completes at its deadline (sending `notifications/progress` on the way when
//! the client gave a token). A permission prompt goes to the run's owner as
//! `elicitation/create` when that client declared form elicitation; the core's prompt
//! timer still denies it when nobody answers, and an elicitation overtaken by
//! `caliban_permit` or the timeout is withdrawn with `notifications/cancelled`.

mod http;
mod tools;

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::cli;
use crate::drive::ops::{Op, Problem};
use crate::drive::table::PollView;
use crate::drive::table::{DriveCore, DriveError, DriveStatus};
use crate::engine::{Engine, HostAction};
use crate::ids::RunId;
use crate::jsonrpc::{self, Id, Message, RpcError};
use crate::log;
use crate::reactor::{Signal, TimerId};
use crate::stdio::StdinItem;
use crate::surface::host::{Cx, DriveHost, Key, Surface};
use crate::surface::{self, Listening, Listens};
use crate::surface::{FrontKey, ListenConfig};

/// What we answer `initialize` with when the client asks for something we do not speak.
pub const LATEST_VERSION: &str = "2025-11-25";
/// Revisions we speak, newest first.
pub const SUPPORTED_VERSIONS: [&str; 3] = ["2025-11-25", "2025-06-18", "2025-03-26"];

/// One `caliban_poll` answer carries at most this many events / bytes; `next_cursor`
/// continues. MCP hosts hand results to a model (Claude Code caps them near 25k tokens).
const POLL_MAX_EVENTS: usize = 500;
const POLL_MAX_BYTES: usize = 256 * 1024;
/// How often a waiting call with a progress token hears from us.
const PROGRESS_EVERY: Duration = Duration::from_secs(1);

/// What this surface registers on the loop: the network front's listener, connections
/// and their timers, and the deadlines of long-polls.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum McpKey {
    Front(FrontKey),
    Wait(u64),
}

impl From<FrontKey> for McpKey {
    fn from(key: FrontKey) -> McpKey {
        McpKey::Front(key)
    }
}

const INSTRUCTIONS: &str = "Drive a caliban agent over MCP. Start a run with caliban_run, then loop \
caliban_poll with an advancing cursor to read TurnEvent batches (each wrapped as {v, event}) until \
status is done/failed. Use caliban_send_input to feed an interactive run and caliban_permit to answer \
permission prompts surfaced by poll.\n\nPass wait_ms (up to 30000) to caliban_poll to long-poll: it \
answers as soon as there is a new event, a status change or a new permission prompt, so there is no \
need to poll in a tight loop. caliban_cancel stops a run (model request dropped, tool processes \
killed); so does cancelling a caliban_poll request that is waiting on it. If your client supports \
elicitation, permission prompts for runs you started are also asked directly; either answer counts. \
A prompt nobody answers is denied after the server's permission timeout (10 minutes by default).";

/// RFC 5424 severities as MCP names them, least severe first.
const LEVELS: [&str; 8] = [
    "debug",
    "info",
    "notice",
    "warning",
    "error",
    "critical",
    "alert",
    "emergency",
];
const NOTICE: usize = 2;

type SessionKey = u64;
const STDIO: SessionKey = 0;

struct Session {
    /// Negotiated revision; before `initialize` we assume the oldest we speak.
    version: &'static str,
    initialized: bool,
    /// The client declared form-mode elicitation.
    elicit_form: bool,
    /// Least severe level sent as `notifications/message`.
    log_min: usize,
    next_out_id: i64,
}

impl Session {
    fn new() -> Session {
        Session {
            version: "2025-03-26",
            initialized: false,
            elicit_form: false,
            log_min: NOTICE,
            next_out_id: 1,
        }
    }

    /// 2025-06-18 brought `outputSchema`, `structuredContent` and elicitation.
    fn modern(&self) -> bool {
        self.version != "2025-03-26"
    }
}

/// A `caliban_poll` waiting for news.
struct Wait {
    session: SessionKey,
    request: Id,
    run: RunId,
    cursor: u64,
    seen_status: DriveStatus,
    seen_prompt: Option<String>,
    started: Instant,
    deadline: Instant,
    total_ms: u64,
    timer: TimerId,
    progress_token: Option<Value>,
    last_progress: u64,
}

/// A permission prompt we asked a client about with `elicitation/create`.
struct Elicit {
    session: SessionKey,
    tool_use_id: String,
    /// Our request id, or `None` once the client failed the request (the prompt then waits
    /// for `caliban_permit`; we do not ask again).
    request: Option<i64>,
}

/// How a message reaches a session over HTTP: as the answer to a request, as a message
/// about a request (progress), or on its own (elicitation, logs).
#[derive(Clone, Copy)]
enum Route<'a> {
    Reply(&'a Id),
    Related(&'a Id),
    Unrelated,
}

enum Outcome {
    Reply(Result<Value, RpcError>),
    /// The answer comes later (a long-poll).
    Deferred,
}

pub struct McpHost {
    sessions: HashMap<SessionKey, Session>,
    /// Bytes for stdout: protocol lines only.
    stdout: Vec<u8>,
    stdio_open: bool,
    waits: HashMap<u64, Wait>,
    wait_index: HashMap<(SessionKey, Id), u64>,
    /// The waits on each run, so a change looks at its own waits only: with a thousand
    /// long-polls, a look at every wait was most of a model event's cost in user space.
    run_waits: HashMap<RunId, Vec<u64>>,
    next_wait: u64,
    /// Which session started each run still in progress.
    owners: HashMap<RunId, SessionKey>,
    /// Per run: the status label and prompt the owner was last told about.
    told: HashMap<RunId, (&'static str, Option<String>)>,
    elicits: HashMap<RunId, Elicit>,
    http: Option<http::HttpSide>,
}

/// Serves MCP on stdio until stdin closes or a signal arrives; with `listen`, Streamable
/// HTTP there too, until a signal.
pub fn run(engine: Engine<Key<McpKey>>, core: DriveCore, listen: Option<ListenConfig>) -> u8 {
    let mut mcp = McpHost::new();
    let Some(listen) = listen else {
        return surface::serve(engine, DriveHost::new(core, mcp));
    };
    let listening = Listening::new(cli::Surface::Mcp.name(), &listen, "/mcp");
    match listening.bound(http::HttpSide::bind(listen)) {
        Ok(side) => {
            mcp.http = Some(side);
            surface::serve_listening(engine, DriveHost::new(core, mcp), &listening)
        }
        Err(code) => code,
    }
}

/// Listens when it has its Streamable HTTP side (`--listen`).
impl Listens for McpHost {
    fn listen(&mut self, cx: &mut Cx<McpKey>) -> std::io::Result<()> {
        self.start_http(cx)
    }

    fn bound_addr(&self) -> std::io::Result<std::net::SocketAddr> {
        match &self.http {
            Some(side) => side.local_addr(),
            None => Err(std::io::ErrorKind::NotConnected.into()),
        }
    }
}

fn version_for(requested: &str) -> &'static str {
    SUPPORTED_VERSIONS
        .into_iter()
        .find(|v| *v == requested)
        .unwrap_or(LATEST_VERSION)
}

fn tool_ok(modern: bool, text: String) -> Value {
    let mut result = json!({"content": [{"type": "text", "text": text}], "isError": false});
    if modern && let Ok(body) = serde_json::from_str::<Value>(&text) {
        result["structuredContent"] = body;
    }
    result
}

/// `tool_ok` as JSON text, for a body that is JSON text already (a poll's): the
/// `structuredContent` is the body itself, not the body parsed into a value and written out
/// again (a long-poll answer per event was mostly that).
fn push_tool_ok_text(out: &mut Vec<u8>, modern: bool, body: &str) {
    out.reserve(2 * body.len() + 96);
    out.extend_from_slice(b"{\"content\":[{\"text\":");
    crate::text::push_json_string(out, body);
    out.extend_from_slice(b",\"type\":\"text\"}],\"isError\":false");
    if modern {
        out.extend_from_slice(b",\"structuredContent\":");
        out.extend_from_slice(body.as_bytes());
    }
    out.push(b'}');
}

fn tool_error(message: impl Into<String>) -> Value {
    json!({"content": [{"type": "text", "text": message.into()}], "isError": true})
}

impl McpHost {
    fn new() -> McpHost {
        let mut sessions = HashMap::new();
        sessions.insert(STDIO, Session::new());
        McpHost {
            sessions,
            stdout: Vec::new(),
            stdio_open: true,
            waits: HashMap::new(),
            run_waits: HashMap::new(),
            wait_index: HashMap::new(),
            next_wait: 0,
            owners: HashMap::new(),
            told: HashMap::new(),
            elicits: HashMap::new(),
            http: None,
        }
    }

    fn modern(&self, session: SessionKey) -> bool {
        self.sessions.get(&session).is_some_and(Session::modern)
    }

    // ---- delivery ------------------------------------------------------------------------

    fn deliver(&mut self, session: SessionKey, route: Route, message: &Message) {
        if session == STDIO {
            if self.stdio_open {
                self.stdout.extend_from_slice(&jsonrpc::to_line(message));
            }
            return;
        }
        if let Some(http) = self.http.as_mut() {
            http.deliver(session, route, message);
        }
    }

    /// `deliver` of a message already written out (no newline).
    fn deliver_text(&mut self, session: SessionKey, route: Route, text: String, kind: http::Kind) {
        if session == STDIO {
            if self.stdio_open {
                self.stdout.extend_from_slice(text.as_bytes());
                self.stdout.push(b'\n');
            }
            return;
        }
        if let Some(http) = self.http.as_mut() {
            http.deliver_text(session, route, text, kind);
        }
    }

    fn notify(&mut self, session: SessionKey, route: Route, method: &str, params: Value) {
        self.deliver(session, route, &jsonrpc::notification(method, params));
    }

    fn log_to(&mut self, session: SessionKey, level: usize, message: String) {
        let Some(s) = self.sessions.get(&session) else {
            return;
        };
        if level < s.log_min || !s.initialized {
            return;
        }
        self.notify(
            session,
            Route::Unrelated,
            "notifications/message",
            json!({"level": LEVELS[level], "logger": "caliban", "data": message}),
        );
    }

    // ---- messages ------------------------------------------------------------------------

    /// One parsed message from `session`; a request's immediate answer is returned to the
    /// transport, which knows how to frame it.
    fn on_message(
        &mut self,
        ctx: &mut Cx<McpKey>,
        session: SessionKey,
        message: Message,
    ) -> Option<Outcome> {
        match message {
            // Any id JSON-RPC 2.0 allows, null included, is answered with that id: MCP asks
            // clients not to send null, and a server that answers one anyway behaves as
            // JSON-RPC (and the ACP surface) does.
            Message::Request { id, method, params } => {
                Some(self.on_request(ctx, session, id, &method, params))
            }
            Message::Notification { method, params } => {
                self.on_notification(ctx, session, &method, &params);
                None
            }
            Message::Response { id, result } => {
                self.on_response(ctx, session, &id, result);
                None
            }
        }
    }

    fn on_request(
        &mut self,
        ctx: &mut Cx<McpKey>,
        session: SessionKey,
        id: Id,
        method: &str,
        params: Value,
    ) -> Outcome {
        if !(params.is_null() || params.is_object()) {
            return Outcome::Reply(Err(RpcError::invalid_params("`params` must be an object")));
        }
        let reply = match method {
            "initialize" => self.initialize(session, &params),
            "ping" => Ok(json!({})),
            "tools/list" => match params.get("cursor") {
                None | Some(Value::Null) => Ok(tools::list(self.modern(session))),
                Some(_) => Err(RpcError::invalid_params("invalid cursor")),
            },
            "tools/call" => return self.call_tool(ctx, session, id, &params),
            "logging/setLevel" => {
                let level = params.get("level").and_then(Value::as_str).unwrap_or("");
                match LEVELS.iter().position(|l| *l == level) {
                    Some(i) => {
                        if let Some(s) = self.sessions.get_mut(&session) {
                            s.log_min = i;
                        }
                        Ok(json!({}))
                    }
                    None => Err(RpcError::invalid_params(format!(
                        "invalid log level `{level}`: expected one of {}",
                        LEVELS.join(", ")
                    ))),
                }
            }
            // Nothing to list, but some hosts ask regardless of capabilities.
            "resources/list" => Ok(json!({"resources": []})),
            "resources/templates/list" => Ok(json!({"resourceTemplates": []})),
            "prompts/list" => Ok(json!({"prompts": []})),
            other => Err(RpcError::method_not_found(other)),
        };
        Outcome::Reply(reply)
    }

    fn initialize(&mut self, session: SessionKey, params: &Value) -> Result<Value, RpcError> {
        let Some(requested) = params.get("protocolVersion").and_then(Value::as_str) else {
            return Err(RpcError::invalid_params(
                "initialize requires `protocolVersion` (a string)",
            ));
        };
        let Some(s) = self.sessions.get_mut(&session) else {
            return Err(RpcError::new(jsonrpc::INVALID_REQUEST, "unknown session"));
        };
        if s.initialized {
            return Err(RpcError::new(
                jsonrpc::INVALID_REQUEST,
                "initialize was already called in this session",
            ));
        }
        let version = version_for(requested);
        s.version = version;
        s.initialized = true;
        // `elicitation: {}` means form mode; `{url: {}}` alone means no form.
        s.elicit_form = version != "2025-03-26"
            && match params.pointer("/capabilities/elicitation") {
                Some(Value::Object(modes)) => modes.is_empty() || modes.contains_key("form"),
                _ => false,
            };
        let client = params
            .pointer("/clientInfo/name")
            .and_then(Value::as_str)
            .unwrap_or("?");
        log::info(&format!(
            "MCP client {client} initialized (protocol {version}, elicitation {})",
            if s.elicit_form { "on" } else { "off" }
        ));
        Ok(json!({
            "protocolVersion": version,
            "capabilities": {"tools": {"listChanged": false}, "logging": {}},
            "serverInfo": {"name": "caliban", "title": "caliban", "version": crate::cli::VERSION},
            "instructions": INSTRUCTIONS,
        }))
    }

    fn on_notification(
        &mut self,
        ctx: &mut Cx<McpKey>,
        session: SessionKey,
        method: &str,
        params: &Value,
    ) {
        if method != "notifications/cancelled" {
            // notifications/initialized, roots/list_changed, …: nothing to do.
            return;
        }
        let Some(id) = params.get("requestId").and_then(Id::from_json) else {
            return;
        };
        // Only a waiting call is still ours to stop; anything else already got its answer.
        let Some(wait_id) = self.wait_index.get(&(session, id)).copied() else {
            return;
        };
        let Some(wait) = self.drop_wait(ctx, wait_id) else {
            return;
        };
        let reason = params
            .get("reason")
            .and_then(Value::as_str)
            .unwrap_or("no reason given");
        // A person stopping the call (a host's Esc or stop button) means "stop this run";
        // a client's own request timeout (the SDKs send `notifications/cancelled` with a
        // "timed out" reason) only ends the wait: the run goes on and can be polled again.
        // No response is sent for a cancelled request either way.
        let timed_out = reason.to_ascii_lowercase().contains("timed out")
            || reason.to_ascii_lowercase().contains("timeout");
        if timed_out {
            log::info(&format!(
                "poll of {} timed out at the client ({reason})",
                wait.run
            ));
        } else {
            log::info(&format!(
                "request cancelled by the client ({reason}): cancelling {}",
                wait.run
            ));
            let _ = ctx.core.cancel(wait.run);
        }
        if let Some(http) = self.http.as_mut() {
            http.abandon(session, &wait.request);
        }
    }

    fn on_response(
        &mut self,
        ctx: &mut Cx<McpKey>,
        session: SessionKey,
        id: &Id,
        result: Result<Value, RpcError>,
    ) {
        let Id::Num(request) = id else {
            return;
        };
        let Some(run) = self
            .elicits
            .iter()
            .find(|(_, e)| e.session == session && e.request == Some(*request))
            .map(|(run, _)| *run)
        else {
            return;
        };
        let run_id = run;
        let Some(elicit) = self.elicits.get_mut(&run) else {
            return;
        };
        elicit.request = None;
        let tool_use_id = elicit.tool_use_id.clone();
        let answer = match &result {
            Ok(v) => match v.get("action").and_then(Value::as_str) {
                Some("accept") => {
                    let content = v.get("content");
                    let allow = content
                        .and_then(|c| c.get("allow"))
                        .and_then(Value::as_bool)
                        .unwrap_or(true);
                    let reason = content
                        .and_then(|c| c.get("reason"))
                        .and_then(Value::as_str)
                        .map(str::to_owned);
                    Some((allow, reason))
                }
                Some("decline") => Some((false, Some("denied by client".to_owned()))),
                Some("cancel") => Some((
                    false,
                    Some("permission request dismissed by client".to_owned()),
                )),
                _ => None,
            },
            Err(_) => None,
        };
        let Some((allow, reason)) = answer else {
            log::warn(&format!(
                "the client could not answer the permission prompt for {run_id} ({}); it \
                 waits for caliban_permit",
                match &result {
                    Err(e) => e.message.clone(),
                    Ok(v) => format!("unexpected result {v}"),
                }
            ));
            return;
        };
        // Answered meanwhile (caliban_permit, the timeout)? Then this answer is moot.
        if ctx
            .core
            .surfaced_prompt(run)
            .ok()
            .flatten()
            .is_some_and(|p| p.tool_use_id == tool_use_id)
        {
            let _ = ctx.core.permit(run, &tool_use_id, allow, reason);
        }
    }

    // ---- tools ---------------------------------------------------------------------------

    fn call_tool(
        &mut self,
        ctx: &mut Cx<McpKey>,
        session: SessionKey,
        id: Id,
        params: &Value,
    ) -> Outcome {
        let Some(name) = params.get("name").and_then(Value::as_str) else {
            return Outcome::Reply(Err(RpcError::invalid_params(
                "tools/call requires `name` (a string)",
            )));
        };
        let call = match tools::parse_call(name, params.get("arguments")) {
            Ok(call) => call,
            Err(tools::CallError::UnknownTool) => {
                return Outcome::Reply(Err(RpcError::invalid_params("tool not found")));
            }
            // Neither `text` nor `end`: upstream's arguments decode, its tool refuses them.
            Err(tools::CallError::BadArguments(e)) if e.problem == Problem::NoInput => {
                return Outcome::Reply(Ok(tool_error(e.to_string())));
            }
            Err(tools::CallError::BadArguments(m)) => {
                return Outcome::Reply(Err(RpcError::invalid_params(format!(
                    "failed to deserialize parameters: {m}"
                ))));
            }
        };
        // The run named, parsed (and read back from disk if evicted or from before a
        // restart) once; each tool reports an unknown one where it would use it.
        let resolved = call.run_id().map(|id| ctx.core.resolve(id));
        let run = || {
            resolved
                .clone()
                .unwrap_or(Err(DriveError::UnknownRun(String::new())))
        };
        let modern = self.modern(session);
        let ok = |text: String| Outcome::Reply(Ok(tool_ok(modern, text)));
        let fail = |e: DriveError| Outcome::Reply(Ok(tool_error(e.to_string())));
        match call {
            Op::Run(mut spec) => {
                spec.extra_header.insert("surface".into(), json!("mcp"));
                match ctx.core.start_run(spec) {
                    Ok(run) => {
                        self.owners.insert(run, session);
                        self.log_to(session, 1, format!("{run} started"));
                        ok(tools::run_text(
                            &run.to_string(),
                            ctx.core.instructions(run),
                        ))
                    }
                    Err(e) => fail(e),
                }
            }
            Op::Poll {
                cursor, wait_ms, ..
            } => {
                let view = match run()
                    .and_then(|run| ctx.core.poll(run, cursor, POLL_MAX_EVENTS, POLL_MAX_BYTES))
                {
                    Ok(view) => view,
                    Err(e) => return fail(e),
                };
                if wait_ms == 0 || !view.events.is_empty() || view.status.is_terminal() {
                    return ok(tools::poll_text(&view));
                }
                let progress_token = params
                    .pointer("/_meta/progressToken")
                    .filter(|t| t.is_string() || t.is_number())
                    .cloned();
                let Ok(run) = run() else {
                    return ok(tools::poll_text(&view));
                };
                self.start_wait(
                    ctx,
                    session,
                    id,
                    run,
                    cursor,
                    &view,
                    wait_ms,
                    progress_token,
                );
                Outcome::Deferred
            }
            Op::Status { .. } => match run().and_then(|run| ctx.core.status(run)) {
                Ok(status) => ok(tools::status_body_text(&status)),
                Err(e) => fail(e),
            },
            Op::SendInput { input, .. } => {
                match run().and_then(|run| ctx.core.send_input(run, input)) {
                    Ok(()) => ok(tools::OK_TEXT.to_owned()),
                    Err(e) => fail(e),
                }
            }
            Op::Permit { answer, .. } => match run().and_then(|run| {
                ctx.core
                    .permit(run, &answer.tool_use_id, answer.allow, answer.reason)
            }) {
                Ok(()) => ok(tools::OK_TEXT.to_owned()),
                Err(e) => fail(e),
            },
            Op::Cancel { .. } => match run().and_then(|run| ctx.core.cancel(run)) {
                Ok(()) => ok(tools::OK_TEXT.to_owned()),
                Err(e) => fail(e),
            },
        }
    }

    // ---- long-polls ----------------------------------------------------------------------

    #[allow(clippy::too_many_arguments)]
    fn start_wait(
        &mut self,
        ctx: &mut Cx<McpKey>,
        session: SessionKey,
        request: Id,
        run: RunId,
        cursor: u64,
        view: &PollView,
        wait_ms: u64,
        progress_token: Option<Value>,
    ) {
        let total_ms = wait_ms.min(tools::MAX_WAIT_MS);
        let wait_id = self.next_wait;
        self.next_wait += 1;
        let total = Duration::from_millis(total_ms);
        let first = if progress_token.is_some() {
            total.min(PROGRESS_EVERY)
        } else {
            total
        };
        let timer = ctx.add_timer(first, McpKey::Wait(wait_id));
        let now = Instant::now();
        self.wait_index.insert((session, request.clone()), wait_id);
        self.run_waits.entry(run).or_default().push(wait_id);
        self.waits.insert(
            wait_id,
            Wait {
                session,
                request,
                run,
                cursor,
                seen_status: view.status.clone(),
                seen_prompt: view
                    .permission_request
                    .as_ref()
                    .map(|p| p.tool_use_id.clone()),
                started: now,
                deadline: now + total,
                total_ms,
                timer,
                progress_token,
                last_progress: 0,
            },
        );
    }

    /// Forgets a wait without answering it.
    fn drop_wait(&mut self, ctx: &mut Cx<McpKey>, wait_id: u64) -> Option<Wait> {
        let wait = self.waits.remove(&wait_id)?;
        ctx.cancel_timer(wait.timer);
        self.wait_index
            .remove(&(wait.session, wait.request.clone()));
        if let Some(ids) = self.run_waits.get_mut(&wait.run) {
            ids.retain(|&id| id != wait_id);
            if ids.is_empty() {
                self.run_waits.remove(&wait.run);
            }
        }
        Some(wait)
    }

    fn has_news(core: &DriveCore, wait: &Wait) -> bool {
        let (Ok(count), Ok(status), Ok(prompt)) = (
            core.event_count(wait.run),
            core.status(wait.run),
            core.surfaced_prompt(wait.run),
        ) else {
            return true;
        };
        count > wait.cursor
            || status != wait.seen_status
            || prompt.map(|p| p.tool_use_id) != wait.seen_prompt
    }

    /// Answers a wait with a poll of its run as it is now.
    fn finish_wait(&mut self, ctx: &mut Cx<McpKey>, wait_id: u64) {
        let Some(wait) = self.drop_wait(ctx, wait_id) else {
            return;
        };
        let modern = self.modern(wait.session);
        let poll = ctx
            .core
            .poll(wait.run, wait.cursor, POLL_MAX_EVENTS, POLL_MAX_BYTES);
        let answer = |out: &mut Vec<u8>| match poll {
            Ok(view) => push_tool_ok_text(out, modern, &tools::poll_text(&view)),
            Err(e) => out.extend_from_slice(tool_error(e.to_string()).to_string().as_bytes()),
        };
        if wait.session == STDIO {
            // Written straight into the stdout batch: flat out, building each answer apart
            // and copying it in was a tenth of the loop.
            if self.stdio_open {
                jsonrpc::write_response(&mut self.stdout, &wait.request, answer);
                self.stdout.push(b'\n');
            }
            return;
        }
        let text = jsonrpc::response_text(&wait.request, answer);
        self.deliver_text(
            wait.session,
            Route::Reply(&wait.request),
            text,
            http::Kind::Other,
        );
    }

    fn on_wait_timer(&mut self, ctx: &mut Cx<McpKey>, wait_id: u64) {
        let now = Instant::now();
        let Some(wait) = self.waits.get_mut(&wait_id) else {
            return;
        };
        if now >= wait.deadline {
            self.finish_wait(ctx, wait_id);
            return;
        }
        let remaining = wait.deadline - now;
        wait.timer = ctx.add_timer(remaining.min(PROGRESS_EVERY), McpKey::Wait(wait_id));
        let Some(token) = wait.progress_token.clone() else {
            return;
        };
        // Progress must increase: milliseconds waited, out of the wait asked for.
        let elapsed = (now - wait.started).as_millis() as u64;
        let progress = elapsed.max(wait.last_progress + 1).min(wait.total_ms);
        if progress <= wait.last_progress {
            return;
        }
        wait.last_progress = progress;
        let (session, request, run_id, total) =
            (wait.session, wait.request.clone(), wait.run, wait.total_ms);
        let state = ctx.core.status(run_id).map(|s| s.label()).unwrap_or("gone");
        self.notify(
            session,
            Route::Related(&request),
            "notifications/progress",
            json!({
                "progressToken": token,
                "progress": progress,
                "total": total,
                "message": format!("{run_id} is {state}; waiting for news ({} of {} s)",
                    progress / 1000, total / 1000),
            }),
        );
    }

    /// Drops every wait of a session (it ended or its stream went away), unanswered.
    fn drop_session_waits(&mut self, ctx: &mut Cx<McpKey>, session: SessionKey) {
        let ids: Vec<u64> = self
            .waits
            .iter()
            .filter(|(_, w)| w.session == session)
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            self.drop_wait(ctx, id);
        }
    }

    /// A request stream closed before its answer: the answer has nowhere to go.
    fn drop_request_wait(&mut self, ctx: &mut Cx<McpKey>, session: SessionKey, request: &Id) {
        if let Some(id) = self.wait_index.get(&(session, request.clone())).copied() {
            self.drop_wait(ctx, id);
        }
    }

    // ---- prompts and run news ------------------------------------------------------------

    /// Keeps the owner's elicitation in step with the run's surfaced prompt, and tells the
    /// owner (as log messages) about status changes and new prompts.
    fn sync_run(&mut self, core: &DriveCore, run: RunId) {
        let run_id = run.to_string();
        let Some(owner) = self.owners.get(&run).copied() else {
            return;
        };
        let prompt = core.surfaced_prompt(run).ok().flatten();
        let status = core.status(run).ok();

        // Withdraw an elicitation the prompt has moved past.
        if let Some(e) = self.elicits.get(&run)
            && prompt.as_ref().map(|p| &p.tool_use_id) != Some(&e.tool_use_id)
        {
            let e = self.elicits.remove(&run).expect("checked above");
            if let Some(request) = e.request {
                let withdrawn = self
                    .http
                    .as_mut()
                    .is_some_and(|h| h.retract(e.session, request));
                if !withdrawn {
                    self.notify(
                        e.session,
                        Route::Unrelated,
                        "notifications/cancelled",
                        json!({"requestId": request,
                               "reason": "the permission prompt was answered or timed out"}),
                    );
                }
            }
        }
        if let Some(p) = &prompt
            && !self.elicits.contains_key(&run)
            && self
                .sessions
                .get(&owner)
                .is_some_and(|s| s.initialized && s.elicit_form)
            && (owner != STDIO || self.stdio_open)
        {
            let s = self.sessions.get_mut(&owner).expect("checked above");
            let request = s.next_out_id;
            s.next_out_id += 1;
            let with_mode = s.version == LATEST_VERSION;
            let message = Message::Request {
                id: Id::Num(request),
                method: "elicitation/create".into(),
                params: tools::elicitation_params(&run_id, p, with_mode),
            };
            self.elicits.insert(
                run,
                Elicit {
                    session: owner,
                    tool_use_id: p.tool_use_id.clone(),
                    request: Some(request),
                },
            );
            self.deliver(owner, Route::Unrelated, &message);
        }

        // Log what changed, once each.
        let Some(status) = status else {
            self.owners.remove(&run);
            self.told.remove(&run);
            return;
        };
        let prompt_id = prompt.as_ref().map(|p| p.tool_use_id.clone());
        let (told_label, told_prompt) = self.told.get(&run).cloned().unwrap_or(("running", None));
        if prompt_id.is_some() && prompt_id != told_prompt {
            let p = prompt.as_ref().expect("prompt_id is some");
            self.log_to(
                owner,
                NOTICE,
                format!(
                    "{run_id} asks to use {} (tool_use_id {}); answer with caliban_permit",
                    p.tool_name, p.tool_use_id
                ),
            );
        }
        if status.label() != told_label {
            let (level, text) = match &status {
                DriveStatus::Failed(e) => (4, format!("{run_id} failed: {e}")),
                other => (1, format!("{run_id} is {}", other.label())),
            };
            self.log_to(owner, level, text);
        }
        if status.is_terminal() {
            self.owners.remove(&run);
            self.told.remove(&run);
            self.elicits.remove(&run);
        } else {
            self.told.insert(run, (status.label(), prompt_id));
        }
    }

    // ---- lifecycle -----------------------------------------------------------------------

    fn cancel_all_runs(&mut self, ctx: &mut Cx<McpKey>) {
        for summary in ctx.core.list() {
            if !summary.status.is_terminal() {
                let _ = ctx.core.cancel(summary.run_id);
            }
        }
    }

    fn shutdown(&mut self, ctx: &mut Cx<McpKey>) {
        self.cancel_all_runs(ctx);
        ctx.act(HostAction::Quit);
    }

    fn on_stdin_line(&mut self, ctx: &mut Cx<McpKey>, line: &[u8]) {
        let message = match jsonrpc::parse(line) {
            Ok(Some(m)) => m,
            Ok(None) => return,
            Err(invalid) => {
                let reply = jsonrpc::error_response(invalid.id, invalid.error);
                self.deliver(STDIO, Route::Unrelated, &reply);
                return;
            }
        };
        let id = match &message {
            Message::Request { id, .. } => Some(id.clone()),
            _ => None,
        };
        // An id still waiting on a long-poll cannot be reused: both answers would carry it.
        if let Some(id) = &id
            && self.wait_index.contains_key(&(STDIO, id.clone()))
        {
            let reply = jsonrpc::error_response(
                id.clone(),
                jsonrpc::RpcError::new(jsonrpc::INVALID_REQUEST, "request id is already in use"),
            );
            self.deliver(STDIO, Route::Unrelated, &reply);
            return;
        }
        if let (Some(Outcome::Reply(result)), Some(id)) = (self.on_message(ctx, STDIO, message), id)
        {
            let reply = Message::Response { id, result };
            self.deliver(STDIO, Route::Unrelated, &reply);
        }
    }
}

impl Surface for McpHost {
    type Key = McpKey;

    fn on_stdin(&mut self, ctx: &mut Cx<McpKey>, item: StdinItem) {
        if !self.stdio_open {
            return;
        }
        match item {
            StdinItem::Line(line) => self.on_stdin_line(ctx, &line),
            StdinItem::Oversized => {
                let reply = jsonrpc::error_response(
                    Id::Null,
                    RpcError::new(
                        jsonrpc::PARSE_ERROR,
                        format!("message exceeds {} bytes", crate::stdio::MAX_LINE),
                    ),
                );
                self.deliver(STDIO, Route::Unrelated, &reply);
            }
            StdinItem::Eof => {
                if self.http.is_some() {
                    // The HTTP side keeps serving until SIGTERM/SIGINT; the stdio client
                    // is gone, so nothing more is written to stdout.
                    log::info("stdin closed; still serving HTTP until SIGTERM");
                    self.stdio_open = false;
                    self.drop_session_waits(ctx, STDIO);
                    if let Some(s) = self.sessions.get_mut(&STDIO) {
                        s.elicit_form = false;
                    }
                } else {
                    log::info("stdin closed: cancelling live runs and exiting");
                    self.shutdown(ctx);
                }
            }
        }
    }

    fn on_signal(&mut self, ctx: &mut Cx<McpKey>, signal: Signal) {
        log::info(&format!(
            "{signal:?}: cancelling live runs and shutting down"
        ));
        self.shutdown(ctx);
    }

    fn on_io(&mut self, ctx: &mut Cx<McpKey>, key: McpKey) {
        match key {
            McpKey::Front(key) => self.http_io(ctx, key),
            McpKey::Wait(_) => {}
        }
    }

    fn on_timer(&mut self, ctx: &mut Cx<McpKey>, key: McpKey) {
        match key {
            McpKey::Wait(wait) => self.on_wait_timer(ctx, wait),
            McpKey::Front(key) => self.http_timer(ctx, key),
        }
    }

    fn after_batch(&mut self, ctx: &mut Cx<McpKey>, changed: &BTreeSet<RunId>) {
        if !changed.is_empty() {
            let ready: Vec<u64> = changed
                .iter()
                .filter_map(|run| self.run_waits.get(run))
                .flatten()
                .filter(|id| {
                    self.waits
                        .get(id)
                        .is_some_and(|w| Self::has_news(ctx.core, w))
                })
                .copied()
                .collect();
            for id in ready {
                self.finish_wait(ctx, id);
            }
            for run in changed {
                self.sync_run(ctx.core, *run);
            }
        }
        self.http_serve(ctx);
    }

    fn write_output(&mut self, out: &mut Vec<u8>) {
        if out.is_empty() {
            // Nothing waits on stdout: the answers become the queue, with no copy, and the
            // queue's old buffer is the next batch's.
            std::mem::swap(out, &mut self.stdout);
        } else {
            out.append(&mut self.stdout);
        }
        if self.stdout.capacity() > 64 << 10 {
            // A burst's worth of answers is not kept for an idle server.
            self.stdout = Vec::new();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poll_answer_written_as_text_is_the_answer_written_from_values() {
        let body = r#"{"events":[{"event":{"text":"a \"q\" \\ é \u0001 </x>","type":"TextDelta"},"v":1}],"next_cursor":1,"permission_request":null,"status":{"state":"running"}}"#;
        for id in [Id::Num(7), Id::Str("r-1".into())] {
            for modern in [true, false] {
                let from_values =
                    jsonrpc::to_line(&jsonrpc::response(id.clone(), tool_ok(modern, body.into())));
                let text = jsonrpc::response_text(&id, |out| push_tool_ok_text(out, modern, body));
                assert_eq!(format!("{text}\n").as_bytes(), from_values.as_slice());
            }
        }
    }
}
