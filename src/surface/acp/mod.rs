//! `caliban acp serve`: caliban as an Agent Client Protocol agent on stdio, for editors.
//!
//! Newline-delimited JSON-RPC 2.0, protocol version 1 (`reference/acp.md`). It translates
//! ACP to drive-core calls and drive-core state to ACP and holds no agent logic: a session is
//! a sequence of interactive runs found again by the `acp_session` field of their session
//! headers; a prompt is input at the run's turn boundary (or a new run that continues the
//! conversation, after a cancel or any other end of a run); the run's `TurnEvent`s become
//! `session/update`s; a surfaced permission prompt becomes `session/request_permission`.
//!
//! Every outgoing frame goes through one ordered outbox, written once the engine's batch is
//! done, so a turn's updates always precede its `session/prompt` answer, and an opening
//! `tool_call` written in the same batch as the end of its input stream already carries it.
//!
//! Reads are never blocked by a prompt in flight: a prompt is answered from the engine's
//! callbacks (`on_await_input`, `on_finished`), so cancels and permission answers are read
//! while it runs.

mod card;
mod convo;
mod delegate;
mod mcp_client;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use serde_json::{Map, Value, json};

use crate::agent::event::{StopCondition, TurnEvent};
use crate::agent::run::{MAX_TOOL_INPUT_BYTES, ToolCall};
use crate::drive::table::{DriveCore, DriveStatus, Inbound, Prompt, RunSpec};
use crate::engine::{Engine, HostAction, RunId, ToolPlacement};
use crate::jsonrpc::{self, INTERNAL_ERROR, INVALID_REQUEST, Id, Message, RpcError, notification};
use crate::log;
use crate::permissions::{Action, Mode, Policy, Rule, RuleSource};
use crate::reactor::{Signal, TimerId};
use crate::stdio::StdinItem;
use crate::surface::host::{Cx, DriveHost, Key, Surface};
use card::{Described, JsonEnd, OldText};
use delegate::{Advance, ClientCaps, Step};
use mcp_client::{Phase, Server};

/// The ACP major version spoken here.
pub const PROTOCOL_VERSION: u64 = 1;
/// ACP's "resource not found" (an unknown session).
pub const RESOURCE_NOT_FOUND: i64 = -32002;
/// The session-header field that ties a run to its ACP session.
pub const SESSION_FIELD: &str = "acp_session";
/// What this surface registers on the loop: deadlines of delegated calls and of prompts
/// waiting for MCP servers (numbered by `AcpServe::next_timer`), and the pipes of MCP
/// server `n`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AcpKey {
    Task(u64),
    McpWait(u64),
    McpOut(u64),
    McpIn(u64),
}
/// The longest session title `session/list` shows.
const MAX_TITLE_CHARS: usize = 80;
/// How long a prompt waits for the session's MCP servers to list their tools.
const MCP_START_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// The permission modes a session can be switched to, as `session/new` advertises them.
const MODES: [(Mode, &str, &str); 5] = [
    (
        Mode::Default,
        "Default",
        "Ask before running commands and changing files",
    ),
    (
        Mode::AcceptEdits,
        "Accept edits",
        "Change files in the workspace without asking; still ask for commands",
    ),
    (
        Mode::Plan,
        "Plan",
        "Read only: look around and plan, change nothing",
    ),
    (
        Mode::DontAsk,
        "Don't ask",
        "Run whatever would ask, without asking; deny rules still deny",
    ),
    (
        Mode::BypassPermissions,
        "Bypass permissions",
        "Skip every permission check, deny rules included",
    ),
];

/// Serves ACP on stdin/stdout until stdin closes or a signal arrives. Runs still going are
/// cancelled on the way out, which kills their tool processes.
pub fn run(mut engine: Engine<Key<AcpKey>>, core: DriveCore) -> u8 {
    let mut server = DriveHost::new(core, AcpServe::new());
    match engine.run_loop(&mut server) {
        Ok(()) => crate::exit::OK,
        Err(e) => {
            log::error(&format!("event loop failed: {e}"));
            crate::exit::RUNTIME
        }
    }
}

/// One frame waiting to be written.
enum Out {
    Frame(Message),
    Update { session: String, update: Value },
}

/// Frames in the order they must reach the client.
#[derive(Default)]
struct Outbox {
    items: Vec<Out>,
    /// Opening `tool_call`s not written yet, by (session, tool call id): the input can still
    /// join them.
    open: HashMap<(String, String), usize>,
}

impl Outbox {
    fn frame(&mut self, message: Message) {
        self.items.push(Out::Frame(message));
    }

    fn update(&mut self, session: &str, update: Value) {
        self.items.push(Out::Update {
            session: session.to_owned(),
            update,
        });
    }

    fn open_card(&mut self, session: &str, tool: &str, update: Value) {
        self.open
            .insert((session.to_owned(), tool.to_owned()), self.items.len());
        self.update(session, update);
    }

    /// Adds `fields` to a still unwritten opening `tool_call`; false if it was written.
    fn join_open_card(&mut self, session: &str, tool: &str, fields: &Map<String, Value>) -> bool {
        let key = (session.to_owned(), tool.to_owned());
        let Some(&at) = self.open.get(&key) else {
            return false;
        };
        let Some(Out::Update { update, .. }) = self.items.get_mut(at) else {
            return false;
        };
        let Some(obj) = update.as_object_mut() else {
            return false;
        };
        obj.extend(fields.clone());
        true
    }

    fn take_bytes(&mut self) -> Vec<u8> {
        self.open.clear();
        let mut bytes = Vec::new();
        for item in self.items.drain(..) {
            let message = match item {
                Out::Frame(message) => message,
                Out::Update { session, update } => notification(
                    "session/update",
                    json!({"sessionId": session, "update": update}),
                ),
            };
            bytes.extend_from_slice(&jsonrpc::to_line(&message));
        }
        bytes
    }
}

/// A tool call's card while the call is open.
struct Card {
    name: String,
    /// The streamed input fragments, for `rawInput`.
    raw: String,
    /// The input passed `MAX_TOOL_INPUT_BYTES`; `raw` stopped growing.
    overflowed: bool,
    scan: JsonEnd,
    /// Title, locations and content were sent.
    described: bool,
    /// Content later updates keep (a diff, an embedded terminal).
    content: Vec<Value>,
}

/// A `session/request_permission` the client has not answered yet.
struct Asked {
    request: i64,
    tool_use_id: String,
}

/// A tool call the editor carries out.
struct Task {
    run: RunId,
    step: Step,
    /// The request whose answer moves the call on; answers to others are stale.
    waiting_on: Option<i64>,
    timer: Option<(TimerId, u64)>,
}

struct Session {
    cwd: PathBuf,
    mode: Mode,
    /// Rules from "always" answers, given to every run the session starts.
    rules: Vec<Rule>,
    /// The newest run (live or not): a new run continues its conversation.
    run: Option<RunId>,
    /// The newest run ended on a refusal: its last prompt is not carried on.
    drop_last_prompt: bool,
    /// The `session/prompt` being answered.
    prompt: Option<Id>,
    cancelling: bool,
    /// A prompt that arrived while the cancelled turn was still winding down (an editor
    /// sends `session/cancel` and the next `session/prompt` back to back); it starts as
    /// soon as the cancelled prompt is answered.
    queued_prompt: Option<(Id, Value)>,
    cards: HashMap<String, Card>,
    asked: Option<Asked>,
    tasks: HashMap<String, Task>,
    /// `_meta` from the run's `RunEnd`, for the prompt answer.
    run_end: Option<Value>,
    /// The session's MCP servers (keys of `AcpServe::mcp`).
    mcp: Vec<u64>,
    /// A prompt waiting for MCP servers to list their tools: (request, params, deadline).
    mcp_wait: Option<(Id, Value, TimerId, u64)>,
    /// A prompt already waited its full time: later ones do not wait for stragglers.
    mcp_gave_up: bool,
}

impl Session {
    fn new(cwd: PathBuf, mode: Mode, run: Option<RunId>) -> Session {
        Session {
            cwd,
            mode,
            rules: Vec::new(),
            run,
            drop_last_prompt: false,
            prompt: None,
            cancelling: false,
            queued_prompt: None,
            cards: HashMap::new(),
            asked: None,
            tasks: HashMap::new(),
            run_end: None,
            mcp: Vec::new(),
            mcp_wait: None,
            mcp_gave_up: false,
        }
    }
}

/// An MCP server of a session.
struct McpEntry {
    session: String,
    server: Server,
    /// Calls in flight: tool use id → run.
    calls: HashMap<String, RunId>,
}

/// What an answer to one of our requests is for.
enum Pending {
    Permission {
        session: String,
        run: RunId,
        tool_use_id: String,
        /// The rule an "always" answer adds.
        pattern: String,
    },
    Tool {
        session: String,
        tool: String,
        method: &'static str,
    },
    Ignore,
}

pub struct AcpServe {
    caps: ClientCaps,
    sessions: HashMap<String, Session>,
    /// The session of each run this process started and still runs.
    runs: HashMap<RunId, String>,
    outbox: Outbox,
    next_request: i64,
    pending: HashMap<i64, Pending>,
    /// Delegated calls' deadlines: timer key → (session, tool call).
    timers: HashMap<u64, (String, String)>,
    next_timer: u64,
    quitting: bool,
    mcp: HashMap<u64, McpEntry>,
    next_mcp: u64,
    /// Deadlines of prompts waiting for MCP servers: timer key → session.
    mcp_timers: HashMap<u64, String>,
}

fn invalid_params(message: impl Into<String>) -> RpcError {
    RpcError::invalid_params(message)
}

fn unknown_session(id: &str) -> RpcError {
    RpcError::new(RESOURCE_NOT_FOUND, format!("unknown sessionId: {id}"))
}

fn str_param<'a>(params: &'a Value, key: &str) -> Result<&'a str, RpcError> {
    params
        .get(key)
        .and_then(Value::as_str)
        .ok_or_else(|| invalid_params(format!("`{key}` is required and must be a string")))
}

fn text_content(text: &str) -> Value {
    json!({"type": "content", "content": {"type": "text", "text": text}})
}

/// Milliseconds since the epoch as ISO 8601 UTC (`2026-08-01T12:00:00Z`).
fn iso8601(ms: u64) -> String {
    crate::clock::Utc::from_unix_secs(ms / 1000).iso8601()
}

/// The session rules an "always" answer adds (`permissions::suggested_rules`); tools with
/// no argument to match (Glob, Grep) get their bare name.
fn always_patterns(tool: &str, input: &Value) -> Vec<String> {
    let rules = crate::permissions::suggested_rules(tool, input);
    if rules.is_empty() && tool != "Bash" {
        return vec![tool.to_owned()];
    }
    rules
}

fn modes_json(current: Mode) -> Value {
    json!({
        "currentModeId": current.as_str(),
        "availableModes": MODES.iter().map(|(mode, name, description)| json!({
            "id": mode.as_str(), "name": name, "description": description})).collect::<Vec<_>>(),
    })
}

fn config_options_json(current: Mode) -> Value {
    json!([{
        "id": "mode",
        "name": "Mode",
        "description": "What caliban may do without asking",
        "category": "mode",
        "type": "select",
        "currentValue": current.as_str(),
        "options": MODES.iter().map(|(mode, name, description)| json!({
            "value": mode.as_str(), "name": name, "description": description})).collect::<Vec<_>>(),
    }])
}

impl AcpServe {
    fn new() -> AcpServe {
        AcpServe {
            caps: ClientCaps::default(),
            sessions: HashMap::new(),
            runs: HashMap::new(),
            outbox: Outbox::default(),
            next_request: 1,
            pending: HashMap::new(),
            timers: HashMap::new(),
            next_timer: 0,
            quitting: false,
            mcp: HashMap::new(),
            next_mcp: 0,
            mcp_timers: HashMap::new(),
        }
    }

    fn request(&mut self, method: &str, params: Value, pending: Pending) -> i64 {
        let id = self.next_request;
        self.next_request += 1;
        self.pending.insert(id, pending);
        self.outbox.frame(Message::Request {
            id: Id::Num(id),
            method: method.to_owned(),
            params,
        });
        id
    }

    fn reply(&mut self, id: Id, result: Result<Value, RpcError>) {
        self.outbox.frame(Message::Response { id, result });
    }

    // ---- the client's messages -----------------------------------------------------------

    fn on_line(&mut self, ctx: &mut Cx<AcpKey>, line: &[u8]) {
        match jsonrpc::parse(line) {
            Ok(None) => {}
            Ok(Some(Message::Request { id, method, params })) => {
                self.on_request(ctx, id, &method, &params)
            }
            Ok(Some(Message::Notification { method, params })) => {
                self.on_notification(ctx, &method, &params)
            }
            Ok(Some(Message::Response { id, result })) => self.on_response(ctx, &id, result),
            Err(invalid) => self.reply(invalid.id, Err(invalid.error)),
        }
    }

    fn on_request(&mut self, ctx: &mut Cx<AcpKey>, id: Id, method: &str, params: &Value) {
        let result = match method {
            "initialize" => self.initialize(params),
            "authenticate" => Ok(json!({})),
            "session/new" => self.new_session(ctx, params),
            "session/load" => self.open_session(ctx, params, true),
            "session/resume" => self.open_session(ctx, params, false),
            "session/list" => self.list_sessions(ctx.core, params),
            "session/close" => self.close_session(ctx, params),
            "session/set_mode" => self.set_mode(ctx, params).map(|()| json!({})),
            "session/set_config_option" => self.set_config_option(ctx, params),
            "session/prompt" => match self.prompt(ctx, &id, params) {
                // Answered when the turn ends.
                Ok(()) => return,
                Err(e) => Err(e),
            },
            _ => Err(RpcError::method_not_found(method)),
        };
        self.reply(id, result);
    }

    fn on_notification(&mut self, ctx: &mut Cx<AcpKey>, method: &str, params: &Value) {
        match method {
            "session/cancel" => {
                if let Some(session) = params.get("sessionId").and_then(Value::as_str) {
                    let session = session.to_owned();
                    self.cancel_turn(ctx, &session);
                }
            }
            // The client withdraws one of its requests: for a prompt, that is a cancel.
            "$/cancel_request" => {
                let Some(request) = params.get("requestId") else {
                    return;
                };
                let found = self
                    .sessions
                    .iter()
                    .find(|(_, s)| {
                        s.prompt.as_ref().is_some_and(|p| &p.to_json() == request)
                            || s.mcp_wait
                                .as_ref()
                                .is_some_and(|w| &w.0.to_json() == request)
                    })
                    .map(|(id, _)| id.clone());
                if let Some(session) = found {
                    self.cancel_turn(ctx, &session);
                }
            }
            // Unknown notifications are ignored, as JSON-RPC and ACP ask.
            _ => {}
        }
    }

    fn on_response(&mut self, ctx: &mut Cx<AcpKey>, id: &Id, result: Result<Value, RpcError>) {
        let Id::Num(id) = *id else {
            return;
        };
        let Some(pending) = self.pending.remove(&id) else {
            return;
        };
        match pending {
            Pending::Permission {
                session,
                run,
                tool_use_id,
                pattern,
            } => self.on_permission_answer(ctx, id, &session, run, &tool_use_id, &pattern, result),
            Pending::Tool {
                session,
                tool,
                method,
            } => self.on_tool_answer(ctx, id, &session, &tool, method, result),
            Pending::Ignore => {}
        }
    }

    fn initialize(&mut self, params: &Value) -> Result<Value, RpcError> {
        if !params.get("protocolVersion").is_some_and(Value::is_u64) {
            return Err(invalid_params(
                "`protocolVersion` is required and must be an integer",
            ));
        }
        let caps = &params["clientCapabilities"];
        self.caps = ClientCaps {
            read: caps["fs"]["readTextFile"] == true,
            write: caps["fs"]["writeTextFile"] == true,
            terminal: caps["terminal"] == true,
        };
        Ok(json!({
            "protocolVersion": PROTOCOL_VERSION,
            "agentCapabilities": {
                "loadSession": true,
                "promptCapabilities": {"image": false, "audio": false, "embeddedContext": true},
                "mcpCapabilities": {"http": false, "sse": false},
                "sessionCapabilities": {"list": {}, "resume": {}, "close": {}},
            },
            "authMethods": [],
            "agentInfo": {"name": "caliban", "title": "Caliban", "version": crate::cli::VERSION},
        }))
    }

    /// A session's directory: absolute, existing, inside the workspace caliban serves (its
    /// settings and permission rules are that workspace's).
    fn session_cwd(core: &DriveCore, params: &Value) -> Result<PathBuf, RpcError> {
        let raw = str_param(params, "cwd")?;
        let path = Path::new(raw);
        if !path.is_absolute() {
            return Err(invalid_params(format!(
                "`cwd` must be an absolute path, not {raw}"
            )));
        }
        let canonical = path
            .canonicalize()
            .map_err(|e| invalid_params(format!("cwd {raw}: {e}")))?;
        let workspace = &core.config().workspace;
        if !canonical.is_dir() || !canonical.starts_with(workspace) {
            return Err(invalid_params(format!(
                "cwd {raw} is not a directory inside caliban's workspace {}; start `caliban acp \
                 serve` in the project (or pass -C {raw})",
                workspace.display()
            )));
        }
        Ok(canonical)
    }

    fn new_session(&mut self, ctx: &mut Cx<AcpKey>, params: &Value) -> Result<Value, RpcError> {
        let cwd = Self::session_cwd(ctx.core, params)?;
        let id = crate::auth::new_uuid();
        let mode = ctx.core.config().policy.mode();
        self.sessions
            .insert(id.clone(), Session::new(cwd, mode, None));
        self.connect_servers(ctx, &id, params);
        Ok(json!({"sessionId": id, "modes": modes_json(mode),
                  "configOptions": config_options_json(mode)}))
    }

    /// `session/load` (with `replay`) and `session/resume`: a session of this process or of
    /// an earlier one, found by its runs' session headers.
    fn open_session(
        &mut self,
        ctx: &mut Cx<AcpKey>,
        params: &Value,
        replay: bool,
    ) -> Result<Value, RpcError> {
        let id = str_param(params, "sessionId")?.to_owned();
        let cwd = Self::session_cwd(ctx.core, params)?;
        let newest = match self.sessions.get(&id) {
            Some(session) if session.prompt.is_some() || session.mcp_wait.is_some() => {
                return Err(RpcError::new(
                    INVALID_REQUEST,
                    "the session is answering a prompt; cancel it first",
                ));
            }
            Some(session) => session.run,
            None => {
                ctx.core.load_existing();
                let runs = ctx.core.find_by_header(SESSION_FIELD, &json!(id));
                match runs.last() {
                    Some(run) => Some(*run),
                    None => return Err(unknown_session(&id)),
                }
            }
        };
        if replay && let Some(run) = newest {
            let messages = ctx
                .core
                .messages(run)
                .map_err(|e| RpcError::new(INTERNAL_ERROR, e.to_string()))?;
            for update in convo::replay(&messages, &cwd) {
                self.outbox.update(&id, update);
            }
        }
        let default_mode = ctx.core.config().policy.mode();
        let session = self
            .sessions
            .entry(id.clone())
            .or_insert_with(|| Session::new(cwd.clone(), default_mode, newest));
        session.cwd = cwd;
        if let Some(run) = newest
            && ctx.core.is_live(run)
        {
            self.runs.insert(run, id.clone());
        }
        let mode = session.mode;
        self.connect_servers(ctx, &id, params);
        Ok(json!({"modes": modes_json(mode), "configOptions": config_options_json(mode)}))
    }

    fn list_sessions(&mut self, core: &mut DriveCore, params: &Value) -> Result<Value, RpcError> {
        core.load_existing();
        // Headers record the canonical directory.
        let cwd = params.get("cwd").and_then(Value::as_str).map(|c| {
            Path::new(c)
                .canonicalize()
                .map_or_else(|_| c.to_owned(), |p| p.display().to_string())
        });
        // session → (title, cwd, newest run's start)
        let mut found: BTreeMap<String, (String, String, u64)> = BTreeMap::new();
        for summary in core.list() {
            let Ok(header) = core.header(summary.run_id) else {
                continue;
            };
            let Some(session) = header.get(SESSION_FIELD).and_then(Value::as_str) else {
                continue;
            };
            let run_cwd = header["cwd"].as_str().unwrap_or_default().to_owned();
            if cwd.as_ref().is_some_and(|c| *c != run_cwd) {
                continue;
            }
            let entry = found.entry(session.to_owned()).or_insert_with(|| {
                let title: String = summary
                    .prompt
                    .lines()
                    .next()
                    .unwrap_or_default()
                    .chars()
                    .take(MAX_TITLE_CHARS)
                    .collect();
                (title, run_cwd, 0)
            });
            entry.2 = entry.2.max(summary.created_ms);
        }
        let mut sessions: Vec<(String, (String, String, u64))> = found.into_iter().collect();
        sessions.sort_by_key(|s| std::cmp::Reverse(s.1.2));
        let sessions: Vec<Value> = sessions
            .into_iter()
            .map(|(id, (title, cwd, updated))| {
                json!({"sessionId": id, "cwd": cwd, "title": title, "updatedAt": iso8601(updated)})
            })
            .collect();
        Ok(json!({"sessions": sessions}))
    }

    fn close_session(&mut self, ctx: &mut Cx<AcpKey>, params: &Value) -> Result<Value, RpcError> {
        let id = str_param(params, "sessionId")?.to_owned();
        let Some(mut session) = self.sessions.remove(&id) else {
            return Err(unknown_session(&id));
        };
        self.runs.retain(|_, s| *s != id);
        if let Some(run) = session.run
            && ctx.core.is_live(run)
        {
            let _ = ctx.core.cancel(run);
        }
        if let Some(prompt) = session.prompt.take() {
            self.reply(prompt, Ok(json!({"stopReason": "cancelled"})));
        }
        if let Some(asked) = session.asked.take() {
            self.withdraw(asked.request);
        }
        self.abandon_tasks(ctx, &id, &mut session);
        if let Some((prompt, _, key)) = Self::take_mcp_wait(ctx, &mut session) {
            self.mcp_timers.remove(&key);
            self.reply(prompt, Ok(json!({"stopReason": "cancelled"})));
        }
        self.stop_servers(ctx, std::mem::take(&mut session.mcp));
        Ok(json!({}))
    }

    fn set_mode(&mut self, ctx: &mut Cx<AcpKey>, params: &Value) -> Result<(), RpcError> {
        let id = str_param(params, "sessionId")?;
        let mode_id = str_param(params, "modeId")?;
        self.switch_mode(ctx, id, mode_id)
    }

    fn set_config_option(
        &mut self,
        ctx: &mut Cx<AcpKey>,
        params: &Value,
    ) -> Result<Value, RpcError> {
        let id = str_param(params, "sessionId")?.to_owned();
        let option = str_param(params, "configId")?;
        if option != "mode" {
            return Err(invalid_params(format!("unknown config option `{option}`")));
        }
        let value = str_param(params, "value")?;
        self.switch_mode(ctx, &id, value)?;
        let mode = self.sessions.get(&id).map_or(Mode::Default, |s| s.mode);
        Ok(json!({"configOptions": config_options_json(mode)}))
    }

    fn switch_mode(
        &mut self,
        ctx: &mut Cx<AcpKey>,
        id: &str,
        mode_id: &str,
    ) -> Result<(), RpcError> {
        let mode = Mode::parse(mode_id).ok_or_else(|| {
            invalid_params(format!(
                "unknown mode `{mode_id}`: expected default, acceptEdits, plan, dontAsk or \
                 bypassPermissions"
            ))
        })?;
        let session = self
            .sessions
            .get_mut(id)
            .ok_or_else(|| unknown_session(id))?;
        session.mode = mode;
        if let Some(run) = session.run
            && ctx.core.is_live(run)
        {
            let _ = ctx.core.update_policy(run, Some(mode), None);
        }
        Ok(())
    }

    /// Takes a prompt: input at the session's turn boundary, or a new run that continues the
    /// conversation. The answer comes when the turn ends.
    fn prompt(&mut self, ctx: &mut Cx<AcpKey>, id: &Id, params: &Value) -> Result<(), RpcError> {
        let sid = str_param(params, "sessionId")?.to_owned();
        let text = convo::prompt_text(params.get("prompt").unwrap_or(&Value::Null))
            .map_err(invalid_params)?;
        if text.trim().is_empty() {
            return Err(invalid_params("session/prompt requires non-empty text"));
        }
        let session = self
            .sessions
            .get_mut(&sid)
            .ok_or_else(|| unknown_session(&sid))?;
        if session.mcp_wait.is_some() {
            return Err(RpcError::new(
                INVALID_REQUEST,
                "a prompt is already running in this session; cancel it first",
            ));
        }
        if session.prompt.is_some() {
            if session.cancelling && session.queued_prompt.is_none() {
                session.queued_prompt = Some((id.clone(), params.clone()));
                return Ok(());
            }
            return Err(RpcError::new(
                INVALID_REQUEST,
                "a prompt is already running in this session; cancel it first",
            ));
        }
        let live = session.run.filter(|run| ctx.core.is_live(*run));
        match live {
            Some(run) if ctx.core.status(run) == Ok(DriveStatus::AwaitingInput) => {
                ctx.core
                    .send_input(run, Inbound::UserMessage(text))
                    .map_err(|e| RpcError::new(INTERNAL_ERROR, e.to_string()))?;
            }
            Some(_) => {
                return Err(RpcError::new(
                    INVALID_REQUEST,
                    "the session is still busy with its last turn",
                ));
            }
            None => {
                let starting = session.mcp.iter().any(|n| {
                    self.mcp
                        .get(n)
                        .is_some_and(|e| e.server.client.phase() == Phase::Starting)
                });
                if starting && !session.mcp_gave_up {
                    // The run's tools are fixed when it starts: wait for the servers' lists.
                    let key = self.next_timer;
                    self.next_timer += 1;
                    let timer = ctx.add_timer(MCP_START_WAIT, AcpKey::McpWait(key));
                    self.mcp_timers.insert(key, sid.clone());
                    session.mcp_wait = Some((id.clone(), params.clone(), timer, key));
                    return Ok(());
                }
                let extra_tools: Vec<_> = session
                    .mcp
                    .iter()
                    .filter_map(|n| self.mcp.get(n))
                    .flat_map(|e| e.server.client.tools().iter().cloned())
                    .collect();
                let mut history = match session.run {
                    Some(run) => {
                        // The newest run may have been evicted from memory since; `messages`
                        // reads it back.
                        let messages = ctx
                            .core
                            .messages(run)
                            .map_err(|e| RpcError::new(INTERNAL_ERROR, e.to_string()))?;
                        convo::history(&messages)
                    }
                    None => Vec::new(),
                };
                if session.drop_last_prompt {
                    convo::drop_last_prompt(&mut history);
                }
                let mut extra_header = Map::new();
                extra_header.insert(SESSION_FIELD.into(), json!(sid));
                let spec = RunSpec {
                    prompt: text,
                    interactive: true,
                    cwd: Some(session.cwd.clone()),
                    history,
                    continues: session.run,
                    continues_without_last_prompt: session.drop_last_prompt,
                    extra_header,
                    extra_tools,
                    ..RunSpec::default()
                };
                let run = ctx
                    .core
                    .start_run(spec)
                    .map_err(|e| RpcError::new(INTERNAL_ERROR, e.to_string()))?;
                // Queued after the run's first input: applied before any tool call is judged,
                // since that needs a model answer first.
                let _ = ctx.core.update_policy(run, Some(session.mode), None);
                for rule in &session.rules {
                    let _ = ctx.core.update_policy(run, None, Some(rule.clone()));
                }
                self.runs.insert(run, sid.clone());
                session.run = Some(run);
                session.drop_last_prompt = false;
                session.cards.clear();
                session.run_end = None;
            }
        }
        session.prompt = Some(id.clone());
        session.cancelling = false;
        Ok(())
    }

    /// `session/cancel`: stops the turn in flight (the run ends; its model stream is dropped
    /// and its tools killed), and the prompt is answered `cancelled` once the run has ended.
    /// A cancel with no turn in flight does nothing, so a stale one never hits the next turn.
    fn cancel_turn(&mut self, ctx: &mut Cx<AcpKey>, sid: &str) {
        let Some(session) = self.sessions.get_mut(sid) else {
            return;
        };
        if let Some((prompt, _, key)) = Self::take_mcp_wait(ctx, session) {
            self.mcp_timers.remove(&key);
            self.reply(prompt, Ok(json!({"stopReason": "cancelled"})));
            return;
        }
        if session.prompt.is_none() || session.cancelling {
            return;
        }
        session.cancelling = true;
        match session.run.filter(|run| ctx.core.is_live(*run)) {
            Some(run) => {
                let _ = ctx.core.cancel(run);
            }
            None => {
                if let Some(prompt) = session.prompt.take() {
                    self.reply(prompt, Ok(json!({"stopReason": "cancelled"})));
                }
            }
        }
    }

    /// Starts the prompt that waited for a cancelled turn to end, if any.
    fn start_queued_prompt(&mut self, ctx: &mut Cx<AcpKey>, sid: &str) {
        let Some((id, params)) = self
            .sessions
            .get_mut(sid)
            .and_then(|s| s.queued_prompt.take())
        else {
            return;
        };
        if let Err(e) = self.prompt(ctx, &id, &params) {
            self.reply(id, Err(e));
        }
    }

    // ---- permission prompts --------------------------------------------------------------

    /// Surfaces the core's prompts: one `session/request_permission` per run at a time, and
    /// a `$/cancel_request` for one the core resolved on its own (a timeout, the run ended).
    ///
    /// A prompt an "always" answer already covers (a call queued in the same turn, before
    /// the rule existed) is answered without asking again.
    fn sync_permissions(&mut self, ctx: &mut Cx<AcpKey>, changed: &BTreeSet<RunId>) {
        for &run in changed {
            let Some(sid) = self.runs.get(&run).cloned() else {
                continue;
            };
            let surfaced = ctx.core.surfaced_prompt(run).ok().flatten();
            let Some(session) = self.sessions.get_mut(&sid) else {
                continue;
            };
            let current = session.asked.as_ref().map(|a| a.tool_use_id.as_str());
            if current == surfaced.as_ref().map(|p| p.tool_use_id.as_str()) {
                continue;
            }
            if let Some(asked) = session.asked.take() {
                self.withdraw(asked.request);
            }
            let Some(prompt) = surfaced else {
                continue;
            };
            let workspace = &ctx.core.config().workspace;
            if let Some((allow, pattern)) = self.remembered(workspace, &sid, &prompt) {
                let reason = (!allow)
                    .then(|| format!("the user rejected every {pattern} call in this session"));
                let _ = ctx.core.permit(run, &prompt.tool_use_id, allow, reason);
                continue;
            }
            self.ask_client(&sid, run, prompt);
        }
    }

    /// The session's "always" answer for a call, if one covers it: (allow, its pattern).
    fn remembered(&self, workspace: &Path, sid: &str, prompt: &Prompt) -> Option<(bool, String)> {
        let session = self.sessions.get(sid)?;
        if session.rules.is_empty() {
            return None;
        }
        // Newest first, the order `Policy::with_session_rule` gives a run.
        let rules: Vec<Rule> = session.rules.iter().rev().cloned().collect();
        let policy =
            Policy::new(rules, Mode::Default, workspace.to_path_buf()).with_cwd(&session.cwd);
        let decision = policy.decide(&prompt.tool_name, &prompt.input);
        let pattern = decision.matched?;
        let ours = session.rules.iter().any(|r| r.pattern == pattern);
        (ours && decision.action != Action::Ask)
            .then(|| (decision.action == Action::Allow, pattern))
    }

    fn withdraw(&mut self, request: i64) {
        self.pending.remove(&request);
        self.outbox.frame(notification(
            "$/cancel_request",
            json!({"requestId": request}),
        ));
    }

    fn ask_client(&mut self, sid: &str, run: RunId, prompt: Prompt) {
        let Some(session) = self.sessions.get(sid) else {
            return;
        };
        let described = card::describe(
            &prompt.tool_name,
            &prompt.input,
            &session.cwd,
            OldText::ReadFile,
        );
        let mut tool_call = json!({
            "toolCallId": prompt.tool_use_id,
            "title": described.title,
            "kind": card::kind(&prompt.tool_name),
            "status": "pending",
            "rawInput": prompt.input,
        });
        if !described.locations.is_empty() {
            tool_call["locations"] = json!(described.locations);
        }
        if !described.content.is_empty() {
            tool_call["content"] = json!(described.content);
        }
        // The rules an "always" answer adds, one per line (a chained command needs one per
        // command word); none when no rule would be safe, and then no "always" options.
        let pattern = always_patterns(&prompt.tool_name, &prompt.input).join("\n");
        let shown = pattern.replace('\n', ", ");
        let mut options = vec![json!({"optionId": "allow", "name": "Allow", "kind": "allow_once"})];
        if !pattern.is_empty() {
            options.push(
                json!({"optionId": "allow_always", "name": format!("Always allow {shown}"),
                                "kind": "allow_always"}),
            );
        }
        options.push(json!({"optionId": "reject", "name": "Reject", "kind": "reject_once"}));
        if !pattern.is_empty() {
            options.push(
                json!({"optionId": "reject_always", "name": format!("Always reject {shown}"),
                                "kind": "reject_always"}),
            );
        }
        let params = json!({
            "sessionId": sid,
            "toolCall": tool_call,
            "options": options,
        });
        let tool_use_id = prompt.tool_use_id.clone();
        let request = self.request(
            "session/request_permission",
            params,
            Pending::Permission {
                session: sid.to_owned(),
                run,
                tool_use_id: tool_use_id.clone(),
                pattern,
            },
        );
        if let Some(session) = self.sessions.get_mut(sid) {
            session.asked = Some(Asked {
                request,
                tool_use_id,
            });
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn on_permission_answer(
        &mut self,
        ctx: &mut Cx<AcpKey>,
        request: i64,
        sid: &str,
        run: RunId,
        tool_use_id: &str,
        pattern: &str,
        answer: Result<Value, RpcError>,
    ) {
        let Some(session) = self.sessions.get_mut(sid) else {
            return;
        };
        if session.asked.as_ref().map(|a| a.request) != Some(request) {
            return;
        }
        session.asked = None;
        let outcome = answer.as_ref().ok().map(|v| &v["outcome"]);
        let chosen = outcome
            .filter(|o| o["outcome"] == "selected")
            .and_then(|o| o["optionId"].as_str());
        let mut cancel_turn = false;
        let (allow, reason, always) = match (chosen, &answer) {
            (Some("allow"), _) => (true, None, None),
            (Some("allow_always"), _) => (true, None, Some(Action::Allow)),
            (Some("reject"), _) => (false, Some("the user rejected this tool call".into()), None),
            (Some("reject_always"), _) => (
                false,
                Some(format!(
                    "the user rejected this tool call, and every {pattern} call in this session"
                )),
                Some(Action::Deny),
            ),
            (Some(other), _) => (
                false,
                Some(format!(
                    "the editor answered with an unknown option `{other}`"
                )),
                None,
            ),
            (None, Err(e)) => (
                false,
                Some(format!(
                    "the editor could not ask for permission: {}",
                    e.message
                )),
                None,
            ),
            (None, Ok(_)) => {
                // `cancelled` is reserved for a cancelled turn: stop it.
                cancel_turn = outcome.is_some_and(|o| o["outcome"] == "cancelled");
                (
                    false,
                    Some("the permission request was cancelled".into()),
                    None,
                )
            }
        };
        if let Some(action) = always {
            for pattern in pattern.split('\n').filter(|p| !p.is_empty()) {
                match Rule::new(pattern, action, None, RuleSource::Session) {
                    Ok(rule) => {
                        session.rules.push(rule.clone());
                        let _ = ctx.core.update_policy(run, None, Some(rule));
                    }
                    Err(e) => log::warn(&format!("cannot keep the answer as a rule: {e}")),
                }
            }
        }
        let _ = ctx.core.permit(run, tool_use_id, allow, reason);
        if cancel_turn {
            self.cancel_turn(ctx, sid);
        }
    }

    // ---- tool-call cards -----------------------------------------------------------------

    fn translate(&mut self, ctx: &mut Cx<AcpKey>, sid: &str, event: &TurnEvent) {
        let Some(session) = self.sessions.get_mut(sid) else {
            return;
        };
        match event {
            TurnEvent::AssistantTextDelta { text, .. } => self.outbox.update(
                sid,
                json!({"sessionUpdate": "agent_message_chunk",
                       "content": {"type": "text", "text": text}}),
            ),
            TurnEvent::AssistantThinkingDelta { text, .. } => self.outbox.update(
                sid,
                json!({"sessionUpdate": "agent_thought_chunk",
                       "content": {"type": "text", "text": text}}),
            ),
            TurnEvent::ToolCallStart {
                tool_use_id, name, ..
            } => {
                session.cards.insert(
                    tool_use_id.clone(),
                    Card {
                        name: name.clone(),
                        raw: String::new(),
                        overflowed: false,
                        scan: JsonEnd::default(),
                        described: false,
                        content: Vec::new(),
                    },
                );
                self.outbox.open_card(
                    sid,
                    tool_use_id,
                    json!({"sessionUpdate": "tool_call", "toolCallId": tool_use_id,
                           "title": name, "name": name, "kind": card::kind(name),
                           "status": "pending"}),
                );
            }
            TurnEvent::ToolCallInputDelta {
                tool_use_id,
                partial_json,
                ..
            } => {
                let Some(card) = session.cards.get_mut(tool_use_id) else {
                    return;
                };
                // Past the cap nothing more is kept (as the run does), so `rawInput` is a
                // clean prefix, never fragments spliced around a gap.
                if card.overflowed || card.raw.len() + partial_json.len() > MAX_TOOL_INPUT_BYTES {
                    card.overflowed = true;
                } else {
                    card.raw.push_str(partial_json);
                }
                if !card.described && card.scan.feed(partial_json) {
                    // The input is complete: show it now rather than after the whole turn.
                    if let Ok(input @ Value::Object(_)) = serde_json::from_str::<Value>(&card.raw) {
                        self.show_input(sid, tool_use_id, &input);
                    }
                }
            }
            TurnEvent::ToolCallEnd {
                tool_use_id,
                is_error,
                result_text,
                ..
            } => {
                let card = session.cards.remove(tool_use_id);
                let task = session.tasks.remove(tool_use_id);
                let raw = card.as_ref().and_then(|c| card::raw_input(&c.raw));
                let mut content = card.map(|c| c.content).unwrap_or_default();
                if !result_text.is_empty() {
                    content.push(text_content(result_text));
                }
                let mut update = json!({
                    "sessionUpdate": "tool_call_update",
                    "toolCallId": tool_use_id,
                    "status": if *is_error { "failed" } else { "completed" },
                    "content": content,
                });
                if let Some(raw) = raw {
                    update["rawInput"] = raw;
                }
                self.outbox.update(sid, update);
                if let Some(task) = task {
                    self.drop_task(ctx, sid, task);
                }
            }
            TurnEvent::RunEnd {
                total_usage,
                turn_count,
                stopped_for,
                ..
            } => {
                session.run_end = Some(json!({
                    "caliban/usage": total_usage.to_json(),
                    "caliban/turns": turn_count,
                }));
                let why = match stopped_for {
                    StopCondition::Cancelled => "cancelled".to_owned(),
                    other => format!("not run: the run ended ({})", other.to_json()),
                };
                let mut open: Vec<(String, Card)> = session.cards.drain().collect();
                open.sort_by(|a, b| a.0.cmp(&b.0));
                for (id, card) in open {
                    let mut content = card.content;
                    content.push(text_content(&why));
                    let mut update = json!({"sessionUpdate": "tool_call_update",
                        "toolCallId": id, "status": "failed", "content": content});
                    if let Some(raw) = card::raw_input(&card.raw) {
                        update["rawInput"] = raw;
                    }
                    self.outbox.update(sid, update);
                }
                if let Some(mut session) = self.sessions.remove(sid) {
                    self.abandon_tasks(ctx, sid, &mut session);
                    self.sessions.insert(sid.to_owned(), session);
                }
            }
            TurnEvent::TurnStart { .. } | TurnEvent::TurnEnd { .. } => {}
        }
    }

    /// Sends a card's title, input, locations and content once the input is known: joined
    /// to the opening `tool_call` if that is not written yet, else as an update.
    fn show_input(&mut self, sid: &str, tool: &str, input: &Value) {
        let Some(session) = self.sessions.get_mut(sid) else {
            return;
        };
        let Some(card) = session.cards.get_mut(tool) else {
            return;
        };
        if card.described {
            return;
        }
        card.described = true;
        let Described {
            title,
            locations,
            content,
        } = card::describe(&card.name, input, &session.cwd, OldText::ReadFile);
        card.content = content.clone();
        let mut fields = Map::new();
        fields.insert("title".into(), json!(title));
        fields.insert("rawInput".into(), input.clone());
        if !locations.is_empty() {
            fields.insert("locations".into(), json!(locations));
        }
        if !content.is_empty() {
            fields.insert("content".into(), json!(content));
        }
        if !self.outbox.join_open_card(sid, tool, &fields) {
            let mut update = Map::new();
            update.insert("sessionUpdate".into(), json!("tool_call_update"));
            update.insert("toolCallId".into(), json!(tool));
            update.extend(fields);
            self.outbox.update(sid, Value::Object(update));
        }
    }

    // ---- tool calls in the editor --------------------------------------------------------

    fn send_task_request(
        &mut self,
        ctx: &mut Cx<AcpKey>,
        sid: &str,
        tool: &str,
        request: delegate::Request,
    ) {
        let id = self.request(
            request.method,
            request.params,
            Pending::Tool {
                session: sid.to_owned(),
                tool: tool.to_owned(),
                method: request.method,
            },
        );
        let key = self.next_timer;
        self.next_timer += 1;
        let timer = ctx.add_timer(request.deadline, AcpKey::Task(key));
        self.timers.insert(key, (sid.to_owned(), tool.to_owned()));
        let Some(task) = self
            .sessions
            .get_mut(sid)
            .and_then(|s| s.tasks.get_mut(tool))
        else {
            ctx.cancel_timer(timer);
            self.timers.remove(&key);
            return;
        };
        task.waiting_on = Some(id);
        if let Some((old, old_key)) = task.timer.replace((timer, key)) {
            ctx.cancel_timer(old);
            self.timers.remove(&old_key);
        }
    }

    fn advance(&mut self, ctx: &mut Cx<AcpKey>, sid: &str, tool: &str, next: Advance) {
        if let Some(terminal) = next.show_terminal {
            let content = vec![json!({"type": "terminal", "terminalId": terminal})];
            if let Some(card) = self
                .sessions
                .get_mut(sid)
                .and_then(|s| s.cards.get_mut(tool))
            {
                card.content = content.clone();
            }
            self.outbox.update(
                sid,
                json!({"sessionUpdate": "tool_call_update", "toolCallId": tool,
                       "status": "in_progress", "content": content}),
            );
        }
        if let Some(request) = next.request {
            self.send_task_request(ctx, sid, tool, request);
        }
        if let Some(terminal) = next.release {
            self.request(
                "terminal/release",
                json!({"sessionId": sid, "terminalId": terminal}),
                Pending::Ignore,
            );
        }
        if let Some(output) = next.result
            && let Some(task) = self
                .sessions
                .get_mut(sid)
                .and_then(|s| s.tasks.remove(tool))
        {
            if let Some((timer, key)) = task.timer {
                ctx.cancel_timer(timer);
                self.timers.remove(&key);
            }
            ctx.act(HostAction::ToolResult {
                run: task.run,
                tool_use_id: tool.to_owned(),
                output,
            });
        }
    }

    fn on_tool_answer(
        &mut self,
        ctx: &mut Cx<AcpKey>,
        request: i64,
        sid: &str,
        tool: &str,
        method: &str,
        answer: Result<Value, RpcError>,
    ) {
        let task = self
            .sessions
            .get_mut(sid)
            .and_then(|s| s.tasks.get_mut(tool))
            .filter(|t| t.waiting_on == Some(request));
        let Some(task) = task else {
            // An abandoned call: a terminal the editor started after all must still go.
            if method == "terminal/create"
                && let Ok(answer) = &answer
                && let Some(terminal) = answer.get("terminalId").and_then(Value::as_str)
            {
                self.kill_terminal(sid, terminal);
            }
            return;
        };
        task.waiting_on = None;
        let next = delegate::on_answer(&mut task.step, answer.as_ref(), sid);
        self.advance(ctx, sid, tool, next);
    }

    /// Kills and releases a terminal nobody waits for. The release goes out right behind
    /// the kill rather than after its answer: an editor that never answers the kill must
    /// still get the release ACP requires (which would kill the command anyway).
    fn kill_terminal(&mut self, sid: &str, terminal: &str) {
        let params = json!({"sessionId": sid, "terminalId": terminal});
        self.request("terminal/kill", params.clone(), Pending::Ignore);
        self.request("terminal/release", params, Pending::Ignore);
    }

    /// Forgets a call the run no longer waits for; its terminal is killed and released.
    fn drop_task(&mut self, ctx: &mut Cx<AcpKey>, sid: &str, task: Task) {
        if let Some((timer, key)) = task.timer {
            ctx.cancel_timer(timer);
            self.timers.remove(&key);
        }
        if let Some(terminal) = delegate::terminal_of(&task.step) {
            let terminal = terminal.to_owned();
            self.kill_terminal(sid, &terminal);
        }
    }

    fn abandon_tasks(&mut self, ctx: &mut Cx<AcpKey>, sid: &str, session: &mut Session) {
        let mut tasks: Vec<(String, Task)> = session.tasks.drain().collect();
        tasks.sort_by(|a, b| a.0.cmp(&b.0));
        for (_, task) in tasks {
            self.drop_task(ctx, sid, task);
        }
    }

    // ---- MCP servers ---------------------------------------------------------------------

    /// Starts the servers a `session/new`, `session/load` or `session/resume` names; they
    /// replace the session's earlier ones. Without `mcpServers` the session keeps its own.
    fn connect_servers(&mut self, ctx: &mut Cx<AcpKey>, sid: &str, params: &Value) {
        if params.get("mcpServers").is_none() {
            return;
        }
        let Some(session) = self.sessions.get_mut(sid) else {
            return;
        };
        let old = std::mem::take(&mut session.mcp);
        let cwd = session.cwd.clone();
        self.stop_servers(ctx, old);
        let (configs, warnings) = mcp_client::parse_servers(params);
        for warning in warnings {
            log::warn(&warning);
        }
        for config in configs {
            let mut server = match Server::spawn(&config, &cwd) {
                Ok(server) => server,
                Err(e) => {
                    log::warn(&format!(
                        "MCP server `{}`: cannot start {}: {e}",
                        config.name, config.command
                    ));
                    continue;
                }
            };
            let n = self.next_mcp;
            self.next_mcp += 1;
            let tokens = [
                ctx.host_token(AcpKey::McpOut(n)),
                ctx.host_token(AcpKey::McpIn(n)),
            ];
            if let Err(e) = server.register(ctx.registry(), tokens) {
                log::warn(&format!(
                    "MCP server `{}`: cannot watch its pipes: {e}",
                    config.name
                ));
                server.kill(ctx.registry());
                for token in tokens {
                    ctx.forget_token(token);
                }
                continue;
            }
            log::info(&format!(
                "MCP server `{}` started (pid {})",
                config.name,
                server.pid()
            ));
            let events = server.flush(ctx.registry());
            self.mcp.insert(
                n,
                McpEntry {
                    session: sid.to_owned(),
                    server,
                    calls: HashMap::new(),
                },
            );
            if let Some(session) = self.sessions.get_mut(sid) {
                session.mcp.push(n);
            }
            self.on_mcp_events(ctx, n, events);
        }
    }

    /// Kills servers (their process groups) and answers their calls in flight.
    fn stop_servers(&mut self, ctx: &mut Cx<AcpKey>, servers: Vec<u64>) {
        for n in servers {
            let Some(mut entry) = self.mcp.remove(&n) else {
                continue;
            };
            for token in entry.server.tokens {
                ctx.forget_token(token);
            }
            let events = entry.server.kill(ctx.registry());
            Self::answer_calls(ctx, &mut entry, events);
        }
    }

    fn answer_calls(
        ctx: &mut Cx<AcpKey>,
        entry: &mut McpEntry,
        events: Vec<mcp_client::Event>,
    ) -> bool {
        let mut settled = false;
        for event in events {
            match event {
                mcp_client::Event::Settled => settled = true,
                mcp_client::Event::CallDone {
                    tool_use_id,
                    output,
                } => {
                    if let Some(run) = entry.calls.remove(&tool_use_id) {
                        ctx.act(HostAction::ToolResult {
                            run,
                            tool_use_id,
                            output,
                        });
                    }
                }
            }
        }
        settled
    }

    fn on_mcp_events(&mut self, ctx: &mut Cx<AcpKey>, n: u64, events: Vec<mcp_client::Event>) {
        let Some(entry) = self.mcp.get_mut(&n) else {
            return;
        };
        let settled = Self::answer_calls(ctx, entry, events);
        let sid = entry.session.clone();
        if entry.server.client.phase() == Phase::Failed {
            log::warn(&format!(
                "MCP server `{}` {}; its tools are not offered",
                entry.server.client.name(),
                entry.server.client.failure().unwrap_or("failed")
            ));
            if let Some(session) = self.sessions.get_mut(&sid) {
                session.mcp.retain(|m| *m != n);
            }
            self.stop_servers(ctx, vec![n]);
        } else if settled {
            let count = entry.server.client.tools().len();
            log::info(&format!(
                "MCP server `{}` offers {count} tool{}",
                entry.server.client.name(),
                if count == 1 { "" } else { "s" }
            ));
        }
        if settled {
            let starting = self.sessions.get(&sid).is_some_and(|s| {
                s.mcp.iter().any(|m| {
                    self.mcp
                        .get(m)
                        .is_some_and(|e| e.server.client.phase() == Phase::Starting)
                })
            });
            if !starting {
                self.mcp_wait_over(ctx, &sid, false);
            }
        }
    }

    fn take_mcp_wait(ctx: &mut Cx<AcpKey>, session: &mut Session) -> Option<(Id, TimerId, u64)> {
        let (prompt, _, timer, key) = session.mcp_wait.take()?;
        ctx.cancel_timer(timer);
        Some((prompt, timer, key))
    }

    /// A prompt that waited for the session's MCP servers goes ahead: they all listed their
    /// tools, or the wait ran out (`gave_up`) and the stragglers are left out.
    fn mcp_wait_over(&mut self, ctx: &mut Cx<AcpKey>, sid: &str, gave_up: bool) {
        let Some(session) = self.sessions.get_mut(sid) else {
            return;
        };
        let Some((id, params, timer, key)) = session.mcp_wait.take() else {
            return;
        };
        if gave_up {
            session.mcp_gave_up = true;
            let stragglers: Vec<&str> = session
                .mcp
                .iter()
                .filter_map(|n| self.mcp.get(n))
                .filter(|e| e.server.client.phase() == Phase::Starting)
                .map(|e| e.server.client.name())
                .collect();
            log::warn(&format!(
                "MCP servers still starting after {} s, going ahead without them: {}",
                MCP_START_WAIT.as_secs(),
                stragglers.join(", ")
            ));
        } else {
            ctx.cancel_timer(timer);
            self.mcp_timers.remove(&key);
        }
        if let Err(e) = self.prompt(ctx, &id, &params) {
            self.reply(id, Err(e));
        }
    }

    /// An `mcp__server__tool` call goes to the server that offers it.
    fn call_mcp_tool(&mut self, ctx: &mut Cx<AcpKey>, sid: &str, run: RunId, call: &ToolCall) {
        let found = self.sessions.get(sid).and_then(|s| {
            s.mcp.iter().copied().find(|n| {
                self.mcp
                    .get(n)
                    .is_some_and(|e| e.server.client.has_tool(&call.name))
            })
        });
        let Some(entry) = found.and_then(|n| self.mcp.get_mut(&n)) else {
            ctx.act(HostAction::ToolResult {
                run,
                tool_use_id: call.id.clone(),
                output: crate::tools::ToolOutput::error(format!(
                    "no MCP server of this session offers `{}` (it may have exited)",
                    call.name
                )),
            });
            return;
        };
        if let Some(output) = entry.server.client.call(&call.id, &call.name, &call.input) {
            ctx.act(HostAction::ToolResult {
                run,
                tool_use_id: call.id.clone(),
                output,
            });
            return;
        }
        entry.calls.insert(call.id.clone(), run);
        let events = entry.server.flush(ctx.registry());
        if let Some(n) = found {
            self.on_mcp_events(ctx, n, events);
        }
    }

    /// Stdin closed or a signal came: every run is cancelled (its tools killed) and the loop
    /// ends once the answers are written.
    fn shutdown(&mut self, ctx: &mut Cx<AcpKey>) {
        if self.quitting {
            return;
        }
        self.quitting = true;
        let mut sids: Vec<String> = self.sessions.keys().cloned().collect();
        sids.sort();
        for sid in sids {
            let Some(session) = self.sessions.get_mut(&sid) else {
                continue;
            };
            let servers = std::mem::take(&mut session.mcp);
            if let Some((prompt, _, key)) = Self::take_mcp_wait(ctx, session) {
                self.mcp_timers.remove(&key);
                self.reply(prompt, Ok(json!({"stopReason": "cancelled"})));
            }
            self.stop_servers(ctx, servers);
        }
        let mut runs: Vec<RunId> = self.runs.keys().copied().collect();
        runs.sort_unstable();
        for run in runs {
            let _ = ctx.core.cancel(run);
        }
        ctx.act(HostAction::Quit);
    }
}

impl Surface for AcpServe {
    type Key = AcpKey;

    fn on_event(&mut self, ctx: &mut Cx<AcpKey>, run: RunId, event: &TurnEvent) {
        if let Some(sid) = self.runs.get(&run).cloned() {
            self.translate(ctx, &sid, event);
        }
    }

    fn on_ask(&mut self, _ctx: &mut Cx<AcpKey>, run: RunId, call: &ToolCall) {
        if let Some(sid) = self.runs.get(&run).cloned() {
            self.show_input(&sid, &call.id, &call.input);
        }
    }

    fn on_tool_start(
        &mut self,
        ctx: &mut Cx<AcpKey>,
        run: RunId,
        call: &ToolCall,
    ) -> ToolPlacement {
        let Some(sid) = self.runs.get(&run).cloned() else {
            return ToolPlacement::Local;
        };
        self.show_input(&sid, &call.id, &call.input);
        self.outbox.update(
            &sid,
            json!({"sessionUpdate": "tool_call_update", "toolCallId": call.id,
                   "status": "in_progress"}),
        );
        if call.name.starts_with(mcp_client::TOOL_PREFIX) {
            self.call_mcp_tool(ctx, &sid, run, call);
            return ToolPlacement::Delegated;
        }
        let Some(session) = self.sessions.get_mut(&sid) else {
            return ToolPlacement::Local;
        };
        match delegate::start(self.caps, &call.name, &call.input, &session.cwd, &sid) {
            None => ToolPlacement::Local,
            Some(Err(refused)) => {
                ctx.act(HostAction::ToolResult {
                    run,
                    tool_use_id: call.id.clone(),
                    output: refused,
                });
                ToolPlacement::Delegated
            }
            Some(Ok((step, request))) => {
                session.tasks.insert(
                    call.id.clone(),
                    Task {
                        run,
                        step,
                        waiting_on: None,
                        timer: None,
                    },
                );
                self.send_task_request(ctx, &sid, &call.id, request);
                ToolPlacement::Delegated
            }
        }
    }

    fn on_await_input(&mut self, ctx: &mut Cx<AcpKey>, run: RunId) {
        let Some(session) = self
            .runs
            .get(&run)
            .and_then(|sid| self.sessions.get_mut(sid))
        else {
            return;
        };
        if let Some(prompt) = session.prompt.take() {
            let stop = if session.cancelling {
                "cancelled"
            } else {
                "end_turn"
            };
            self.reply(prompt, Ok(json!({"stopReason": stop})));
        }
        if let Some(sid) = self.runs.get(&run).cloned() {
            self.start_queued_prompt(ctx, &sid);
        }
    }

    fn on_finished(&mut self, ctx: &mut Cx<AcpKey>, run: RunId, why: &StopCondition) {
        let Some(sid) = self.runs.remove(&run) else {
            return;
        };
        let Some(session) = self.sessions.get_mut(&sid) else {
            return;
        };
        let asked = session.asked.take();
        if matches!(
            why,
            StopCondition::Refusal(_) | StopCondition::ContentFilter(_)
        ) {
            session.drop_last_prompt = true;
        }
        let meta = session.run_end.take();
        let prompt = session.prompt.take();
        let cancelling = session.cancelling;
        if let Some(asked) = asked {
            self.withdraw(asked.request);
        }
        let Some(prompt) = prompt else {
            return;
        };
        let stop = match why {
            _ if cancelling => "cancelled",
            StopCondition::Cancelled => "cancelled",
            StopCondition::EndOfTurn => "end_turn",
            StopCondition::MaxTokensExhausted => "max_tokens",
            StopCondition::MaxTurnsReached(_) => "max_turn_requests",
            StopCondition::Refusal(_) | StopCondition::ContentFilter(_) => "refusal",
            StopCondition::ProviderError(e) => {
                self.reply(prompt, Err(RpcError::new(INTERNAL_ERROR, e.clone())));
                return;
            }
            StopCondition::StreamIdle(d) => {
                let message = format!("the model stream was idle for {} s", d.as_secs_f64());
                self.reply(prompt, Err(RpcError::new(INTERNAL_ERROR, message)));
                return;
            }
        };
        let mut result = json!({"stopReason": stop});
        if let Some(meta) = meta {
            result["_meta"] = meta;
        }
        self.reply(prompt, Ok(result));
        self.start_queued_prompt(ctx, &sid);
    }

    fn on_stdin(&mut self, ctx: &mut Cx<AcpKey>, item: StdinItem) {
        match item {
            StdinItem::Line(line) => self.on_line(ctx, &line),
            StdinItem::Oversized => self.reply(
                Id::Null,
                Err(RpcError::new(
                    jsonrpc::PARSE_ERROR,
                    format!("message exceeds {} bytes", crate::stdio::MAX_LINE),
                )),
            ),
            StdinItem::Eof => self.shutdown(ctx),
        }
    }

    fn on_signal(&mut self, ctx: &mut Cx<AcpKey>, signal: Signal) {
        log::info(&format!("{signal:?}: cancelling runs and shutting down"));
        self.shutdown(ctx);
    }

    fn on_timer(&mut self, ctx: &mut Cx<AcpKey>, key: AcpKey) {
        let key = match key {
            AcpKey::McpWait(key) => {
                if let Some(sid) = self.mcp_timers.remove(&key) {
                    self.mcp_wait_over(ctx, &sid, true);
                }
                return;
            }
            AcpKey::Task(key) => key,
            AcpKey::McpOut(_) | AcpKey::McpIn(_) => return,
        };
        let Some((sid, tool)) = self.timers.remove(&key) else {
            return;
        };
        let Some(task) = self
            .sessions
            .get_mut(&sid)
            .and_then(|s| s.tasks.get_mut(&tool))
            .filter(|t| t.timer.is_some_and(|(_, k)| k == key))
        else {
            return;
        };
        task.timer = None;
        // The request the deadline cut short is withdrawn: its late answer must not be
        // applied (a write the model was told failed), and its entry must not linger.
        let abandoned = task.waiting_on.take();
        let next = delegate::on_deadline(&mut task.step, &sid);
        if let Some(request) = abandoned {
            self.withdraw(request);
        }
        self.advance(ctx, &sid, &tool, next);
    }

    fn on_io(&mut self, ctx: &mut Cx<AcpKey>, key: AcpKey) {
        let (n, stdout) = match key {
            AcpKey::McpOut(n) => (n, true),
            AcpKey::McpIn(n) => (n, false),
            AcpKey::Task(_) | AcpKey::McpWait(_) => return,
        };
        let Some(entry) = self.mcp.get_mut(&n) else {
            return;
        };
        let events = if stdout {
            entry.server.read(ctx.registry())
        } else {
            entry.server.flush(ctx.registry())
        };
        self.on_mcp_events(ctx, n, events);
    }

    fn after_batch(&mut self, ctx: &mut Cx<AcpKey>, changed: &BTreeSet<RunId>) {
        self.sync_permissions(ctx, changed);
    }

    fn take_output(&mut self) -> Vec<u8> {
        self.outbox.take_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iso8601_dates() {
        assert_eq!(iso8601(0), "1970-01-01T00:00:00Z");
        assert_eq!(iso8601(951_782_400_000), "2000-02-29T00:00:00Z");
        assert_eq!(iso8601(1_785_585_600_123), "2026-08-01T12:00:00Z");
    }

    #[test]
    fn always_patterns_are_valid_rules() {
        for (tool, input, want) in [
            (
                "Bash",
                json!({"command": "cargo test --all"}),
                vec!["Bash(cargo:*)"],
            ),
            (
                "Bash",
                json!({"command": "cd . && FOO=1 echo hi"}),
                vec!["Bash(cd:*)", "Bash(echo:*)"],
            ),
            (
                "Bash",
                json!({"command": "sudo rm -rf build"}),
                vec!["Bash(sudo rm -rf build)"],
            ),
            ("Edit", json!({"path": "x"}), vec!["Edit(x)"]),
            ("Glob", json!({"pattern": "*.rs"}), vec!["Glob"]),
        ] {
            let patterns = always_patterns(tool, &input);
            assert_eq!(patterns, want);
            for pattern in patterns {
                assert!(
                    Rule::new(&pattern, Action::Allow, None, RuleSource::Session).is_ok(),
                    "{pattern}"
                );
            }
        }
    }

    #[test]
    fn an_open_card_takes_its_input_until_written() {
        let mut out = Outbox::default();
        out.open_card(
            "s",
            "t",
            json!({"sessionUpdate": "tool_call", "toolCallId": "t"}),
        );
        let mut fields = Map::new();
        fields.insert("rawInput".into(), json!({"a": 1}));
        assert!(out.join_open_card("s", "t", &fields));
        let bytes = out.take_bytes();
        let frame: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(frame["params"]["update"]["rawInput"], json!({"a": 1}));
        assert!(!out.join_open_card("s", "t", &fields));
    }
}
