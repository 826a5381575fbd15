//! `caliban acp serve`: caliban as an Agent Client Protocol agent on stdio, for editors;
//! the networked agent (`surface::agent`) serves the same surface over its connection,
//! handing it lines through `on_stdin` and writing what `write_output` gives.
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
//!
//! One module per concern, each adding its part of `AcpServe` and importing only rooms
//! listed before it: `call_ids` (session-unique tool-call ids on the wire), `card` (how a tool
//! call and its output look in an editor), `delegate` (the sans-IO machine of calls the
//! editor carries out), `outbox` (the ordered frames), `convo` (prompt content in, history
//! out and replayed), `params` (each method's params, decoded once), `commands` (slash
//! commands, config choices, titles), `updates` (events as `session/update`s and tool-call
//! cards), `permission` (permission prompts and "always" rules), `tasks` (where a tool call
//! runs, and the calls the editor carries out), `prompt` (the prompt lifecycle), `mcp` (the
//! session's MCP servers, and the editor's approval of the workspace's), `client` (a client
//! that goes away and comes back), `session` (the registry and the session requests). This
//! file holds the server's state, the dispatch of the client's messages and the `Surface`
//! callbacks.

mod call_ids;
mod card;
mod client;
mod commands;
mod convo;
mod delegate;
mod mcp;
mod outbox;
mod params;
mod permission;
mod prompt;
mod session;
mod tasks;
mod updates;

use std::collections::{BTreeSet, HashMap};
use std::marker::PhantomData;

use serde_json::{Value, json};

use crate::agent::event::{StopCondition, TurnEvent};
use crate::agent::run::ToolCall;
use crate::drive::table::DriveCore;
use crate::engine::{Engine, HostAction, RetryNotice, ToolPlacement};
use crate::ids::{HostKey, RunId};
use crate::jsonrpc::{self, Id, Ledger, Message, RpcError, notification};
use crate::log;
use crate::reactor::Signal;
use crate::stdio::StdinItem;
use crate::surface::host::{Cx, DriveHost, Key, Surface};
use delegate::ClientCaps;
use outbox::Outbox;

use session::Session;

/// The ACP major version spoken here.
pub const PROTOCOL_VERSION: u64 = 1;
/// ACP's "resource not found" (an unknown session).
pub const RESOURCE_NOT_FOUND: i64 = -32002;
/// ACP's "authentication required": what `session/new` and prompts answer while no model
/// provider is configured (Zed shows the message on its sign-in view).
pub const AUTH_REQUIRED: i64 = -32000;
/// The session-header field that ties a run to its ACP session.
pub const SESSION_FIELD: &str = "acp_session";
/// What this surface registers on the loop: deadlines of delegated calls (numbered by
/// `AcpServe::next_timer`); and `Host`, the keys of a surface that serves this one inside
/// its own (the networked agent's connections), which it handles before they reach here.
/// The sessions' MCP servers are the engine's (`mcp_client`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AcpKey<H> {
    Task(u64),
    Host(H),
}

/// Serves ACP on stdin/stdout until stdin closes or a signal arrives. Runs still going are
/// cancelled on the way out, which kills their tool processes.
///
/// `provider_problem` says why no model can be reached (none configured): the agent still
/// answers `initialize`, lists and loads sessions, and refuses `session/new` and prompts
/// with that message, so the editor shows it instead of a crashed agent.
///
/// `H` is the host slot of the keys (`AcpKey::Host`): nothing comes back on it here, and the
/// caller picks the one the networked agent uses, so both compile to one engine and one ACP.
pub fn run<H: HostKey>(
    engine: Engine<Key<AcpKey<H>>>,
    core: DriveCore,
    provider_problem: Option<String>,
) -> u8 {
    let mut serve = AcpServe::new();
    serve.provider_problem = provider_problem;
    crate::surface::serve(engine, DriveHost::new(core, serve))
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
    /// The editor is asked whether a workspace MCP server may start (`mcp`).
    ServerApproval {
        session: String,
        server: String,
        card: String,
    },
    Ignore,
}

pub struct AcpServe<H> {
    caps: ClientCaps,
    /// The client shows `notice` updates (`clientCapabilities.session.notices`).
    notices: bool,
    /// The client shows `compaction_update`s (`clientCapabilities.session.compaction`).
    compaction: bool,
    /// Numbers compactions, for their `compactionId`.
    next_compaction: u64,
    sessions: HashMap<String, Session>,
    /// The session of each run this process started and still runs.
    runs: HashMap<RunId, String>,
    outbox: Outbox,
    /// Our requests to the client, each with what its answer is for.
    pending: Ledger<Pending>,
    /// Delegated calls' deadlines: timer key → (session, tool call).
    timers: HashMap<u64, (String, String)>,
    next_timer: u64,
    quitting: bool,
    /// Why no model can be reached, if so: no session is started and no prompt taken.
    provider_problem: Option<String>,
    /// Workspace MCP servers the editor was asked about (once per server per process).
    approvals_asked: BTreeSet<String>,
    /// Only the keys carry `H`; no state of this surface is the host's.
    host: PhantomData<H>,
}

fn invalid_params(message: impl Into<String>) -> RpcError {
    RpcError::invalid_params(message)
}

fn unknown_session(id: &str) -> RpcError {
    RpcError::new(RESOURCE_NOT_FOUND, format!("unknown sessionId: {id}"))
}

impl<H: HostKey> AcpServe<H> {
    pub(crate) fn new() -> AcpServe<H> {
        AcpServe {
            caps: ClientCaps::default(),
            notices: false,
            compaction: false,
            next_compaction: 0,
            sessions: HashMap::new(),
            runs: HashMap::new(),
            outbox: Outbox::default(),
            pending: Ledger::default(),
            timers: HashMap::new(),
            next_timer: 0,
            quitting: false,
            provider_problem: None,
            approvals_asked: BTreeSet::new(),
            host: PhantomData,
        }
    }

    /// Refuses what needs a model while none can be reached, with the message print mode
    /// gives.
    fn needs_model(&self) -> Result<(), RpcError> {
        match &self.provider_problem {
            Some(problem) => Err(RpcError::new(AUTH_REQUIRED, problem.clone())),
            None => Ok(()),
        }
    }

    fn request(&mut self, method: &str, params: Value, pending: Pending) -> i64 {
        let (id, message) = self.pending.request(method, params, pending);
        self.outbox.frame(message);
        id
    }

    fn reply(&mut self, id: Id, result: Result<Value, RpcError>) {
        self.outbox.frame(Message::Response { id, result });
    }

    fn withdraw(&mut self, request: i64) {
        self.pending.withdraw(request);
        self.outbox.frame(notification(
            "$/cancel_request",
            json!({"requestId": request}),
        ));
    }

    // ---- the client's messages -----------------------------------------------------------

    fn on_line(&mut self, ctx: &mut Cx<AcpKey<H>>, line: &[u8]) {
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

    fn on_request(&mut self, ctx: &mut Cx<AcpKey<H>>, id: Id, method: &str, params: &Value) {
        // A session just opened gets its commands and title after the answer (Zed drops
        // updates for a session it does not know yet).
        let mut opened = None;
        let result = match self.answer(ctx, &id, method, params, &mut opened) {
            // Answered when the turn ends.
            Ok(None) => return,
            Ok(Some(answer)) => Ok(answer),
            Err(e) => Err(e),
        };
        self.reply(id, result);
        if let Some((sid, title)) = opened {
            self.announce_session(&sid, title);
            self.ask_server_approvals(ctx, &sid);
        }
    }

    /// A request's answer, `None` for one answered later (a prompt); `opened` is set to the
    /// session (and its stored title) a request opened.
    fn answer(
        &mut self,
        ctx: &mut Cx<AcpKey<H>>,
        id: &Id,
        method: &str,
        params: &Value,
        opened: &mut Option<(String, Option<String>)>,
    ) -> Result<Option<Value>, RpcError> {
        let answer = match method {
            "initialize" => self.initialize(params::Initialize::decode(params)?),
            "authenticate" => json!({}),
            "session/new" => {
                self.needs_model()?;
                let answer = self.new_session(ctx, params::NewSession::decode(params)?)?;
                *opened = answer["sessionId"].as_str().map(|s| (s.to_owned(), None));
                answer
            }
            "session/load" | "session/resume" => {
                let open = params::OpenSession::decode(params)?;
                let sid = open.session_id;
                let answer = self.open_session(ctx, open, method == "session/load")?;
                *opened = Some((sid.to_owned(), Self::stored_title(ctx.core, sid)));
                answer
            }
            "session/list" => self.list_sessions(ctx.core, params::ListSessions::decode(params)),
            "session/close" => self.close_session(ctx, params::session_id(params)?)?,
            "session/delete" => self.delete_session(ctx, params::session_id(params)?)?,
            "session/set_mode" => {
                self.set_mode(ctx, params::SetMode::decode(params)?)?;
                json!({})
            }
            "session/set_config_option" => {
                self.set_config_option(ctx, params::SetConfigOption::decode(params)?)?
            }
            "session/prompt" => {
                self.needs_model()?;
                self.prompt(ctx, id, params::Prompt::decode(params)?)?;
                return Ok(None);
            }
            _ => return Err(RpcError::method_not_found(method)),
        };
        Ok(Some(answer))
    }

    fn on_notification(&mut self, ctx: &mut Cx<AcpKey<H>>, method: &str, params: &Value) {
        match method {
            "session/cancel" => {
                if let Some(session) = params::cancelled_session(params) {
                    let session = session.to_owned();
                    self.cancel_turn(ctx, &session);
                }
            }
            // The client withdraws one of its requests: for a prompt, that is a cancel.
            "$/cancel_request" => {
                let Some(request) = params::withdrawn_request(params) else {
                    return;
                };
                let found = self
                    .sessions
                    .iter()
                    .find(|(_, s)| s.prompt.request().is_some_and(|p| &p.to_json() == request))
                    .map(|(id, _)| id.clone());
                if let Some(session) = found {
                    self.cancel_turn(ctx, &session);
                }
            }
            // Unknown notifications are ignored, as JSON-RPC and ACP ask.
            _ => {}
        }
    }

    fn on_response(&mut self, ctx: &mut Cx<AcpKey<H>>, id: &Id, result: Result<Value, RpcError>) {
        let Some((id, pending)) = self.pending.answer(id) else {
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
            Pending::ServerApproval {
                session,
                server,
                card,
            } => self.on_server_approval(ctx, &session, &server, &card, result),
            Pending::Ignore => {}
        }
    }

    fn initialize(&mut self, params: params::Initialize) -> Value {
        self.caps = params.caps;
        self.notices = params.notices;
        self.compaction = params.compaction;
        json!({
            "protocolVersion": PROTOCOL_VERSION,
            "agentCapabilities": {
                "loadSession": true,
                "promptCapabilities": {"image": true, "audio": false, "embeddedContext": true},
                "mcpCapabilities": {"http": true, "sse": true},
                "sessionCapabilities": {"list": {}, "resume": {}, "close": {}, "delete": {}},
            },
            "authMethods": [],
            "agentInfo": {"name": "caliban", "title": "Caliban", "version": crate::cli::VERSION},
        })
    }

    /// Stdin closed or a signal came: every run is cancelled (its tools killed) and the loop
    /// ends once the answers are written.
    pub(crate) fn shutdown(&mut self, ctx: &mut Cx<AcpKey<H>>) {
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
            Self::stop_servers(ctx, servers);
        }
        let mut runs: Vec<RunId> = self.runs.keys().copied().collect();
        runs.sort_unstable();
        for run in runs {
            let _ = ctx.core.cancel(run);
        }
        ctx.act(HostAction::Quit);
    }
}

impl<H: HostKey> Surface for AcpServe<H> {
    type Key = AcpKey<H>;

    fn on_event(&mut self, ctx: &mut Cx<AcpKey<H>>, run: RunId, event: &TurnEvent) {
        if let Some(sid) = self.runs.get(&run).cloned() {
            self.translate(ctx, &sid, event);
        }
    }

    fn on_ask(&mut self, _ctx: &mut Cx<AcpKey<H>>, run: RunId, call: &ToolCall) {
        if let Some(sid) = self.runs.get(&run).cloned() {
            let wire = self.wire_id(&sid, &call.id);
            self.show_input(&sid, &wire, &call.input);
        }
    }

    fn on_retry(&mut self, _ctx: &mut Cx<AcpKey<H>>, run: RunId, notice: &RetryNotice) {
        if let Some(sid) = self.runs.get(&run).cloned() {
            self.show_retry(&sid, notice);
        }
    }

    fn on_compaction_started(
        &mut self,
        _ctx: &mut Cx<AcpKey<H>>,
        run: RunId,
        trigger: crate::agent::compact::Trigger,
    ) {
        if let Some(sid) = self.runs.get(&run).cloned() {
            self.compaction_started(&sid, trigger);
        }
    }

    fn on_tool_start(
        &mut self,
        ctx: &mut Cx<AcpKey<H>>,
        run: RunId,
        call: &ToolCall,
        confined: bool,
    ) -> ToolPlacement {
        self.place_tool(ctx, run, call, confined)
    }

    fn on_await_input(&mut self, ctx: &mut Cx<AcpKey<H>>, run: RunId) {
        self.on_turn_end(ctx, run);
    }

    fn on_finished(&mut self, ctx: &mut Cx<AcpKey<H>>, run: RunId, why: &StopCondition) {
        self.on_run_finished(ctx, run, why);
    }

    fn on_stdin(&mut self, ctx: &mut Cx<AcpKey<H>>, item: StdinItem) {
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

    fn on_signal(&mut self, ctx: &mut Cx<AcpKey<H>>, signal: Signal) {
        log::info(&format!("{signal:?}: cancelling runs and shutting down"));
        self.shutdown(ctx);
    }

    fn on_timer(&mut self, ctx: &mut Cx<AcpKey<H>>, key: AcpKey<H>) {
        match key {
            AcpKey::Task(key) => self.on_task_deadline(ctx, key),
            AcpKey::Host(_) => {}
        }
    }

    fn after_batch(&mut self, ctx: &mut Cx<AcpKey<H>>, changed: &BTreeSet<RunId>) {
        self.sync_permissions(ctx, changed);
    }

    fn write_output(&mut self, out: &mut Vec<u8>) {
        self.outbox.write_to(out);
    }
}

#[cfg(test)]
mod tests {
    /// The rooms low to high, as the module doc lists them, with their source.
    const ROOMS: [(&str, &str); 14] = [
        ("call_ids", include_str!("call_ids.rs")),
        ("card", include_str!("card.rs")),
        ("delegate", include_str!("delegate.rs")),
        ("outbox", include_str!("outbox.rs")),
        ("convo", include_str!("convo.rs")),
        ("params", include_str!("params.rs")),
        ("commands", include_str!("commands.rs")),
        ("updates", include_str!("updates.rs")),
        ("permission", include_str!("permission.rs")),
        ("tasks", include_str!("tasks.rs")),
        ("prompt", include_str!("prompt.rs")),
        ("mcp", include_str!("mcp.rs")),
        ("client", include_str!("client.rs")),
        ("session", include_str!("session.rs")),
    ];

    /// Every room this file declares is listed (a new one must take its place in the order).
    #[test]
    fn every_room_is_in_the_order() {
        let declared: Vec<&str> = include_str!("mod.rs")
            .lines()
            .filter_map(|l| l.strip_prefix("mod ")?.strip_suffix(';'))
            .filter(|room| *room != "tests")
            .collect();
        let mut listed: Vec<&str> = ROOMS.iter().map(|(room, _)| *room).collect();
        listed.sort_unstable();
        assert_eq!(declared, listed);
    }

    /// The rooms `code` names: `super::room` and `acp::room` paths, and the names in a
    /// `super::{…}` group.
    fn named(code: &str) -> Vec<&str> {
        let mut names = Vec::new();
        for prefix in ["super::", "acp::"] {
            for (i, _) in code.match_indices(prefix) {
                let rest = &code[i + prefix.len()..];
                if let Some(group) = rest.strip_prefix('{') {
                    let group = &group[..group.find('}').unwrap_or(group.len())];
                    names.extend(
                        group
                            .split(',')
                            .map(|n| n.trim().split("::").next().unwrap_or_default()),
                    );
                } else {
                    let end = rest
                        .find(|c: char| c != '_' && !c.is_ascii_alphanumeric())
                        .unwrap_or(rest.len());
                    names.push(&rest[..end]);
                }
            }
        }
        names
    }

    /// A room names only rooms below it (outside its tests), so the rooms form no cycle;
    /// all of them build on this file's `AcpServe`.
    #[test]
    fn rooms_import_only_rooms_below_them() {
        for (at, (room, source)) in ROOMS.iter().enumerate() {
            let code = source.split("#[cfg(test)]").next().unwrap_or_default();
            let names = named(code);
            for (other, _) in &ROOMS[at..] {
                assert!(
                    !names.contains(other),
                    "{room} names `{other}`, a room not below it"
                );
            }
        }
        assert_eq!(
            named(
                "use super::{AcpKey, convo};\nsuper::updates::plan(x); crate::surface::acp::card::f"
            ),
            ["AcpKey", "convo", "updates", "card"]
        );
    }
}
