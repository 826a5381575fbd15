//! The engine owns the reactor and every run's I/O: model exchanges, tool processes and
//! worker threads. Runs (`agent::run::Run`) decide; the engine performs their `Effect`s and
//! feeds the results back. A `Host` (`surface::host::DriveHost`, under which every surface,
//! print mode included, runs) sees the events and answers permission prompts; it talks back
//! only through `HostAction`s queued on its `Ctx`, and names its own sources and timers by
//! a key type of its choosing (`Host::Key`).
//!
//! Architecture Invariant: nothing here blocks the loop. DNS and file tools run on small
//! bounded worker pools (`workers`) whose jobs post a `Completion` and wake the reactor;
//! sockets and pipes are non-blocking.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::time::{Duration, Instant};

use mio::Token;
use mio::Waker;
use serde_json::Value;

use crate::agent::event::{StopCondition, TurnEvent};
use crate::agent::run::{Effect, Run, ToolCall};
use crate::http::client::{self as http_client, ClientEvent, Exchange};
use crate::http::pool as conn_pool;
use crate::http::sse::SseDecoder;
use crate::log;
use crate::mcp_client::{self, Alarm, Hub, HubEvent, Selection, ServerId, Source};
use crate::model::retry::{self, RetryDecision, RetryPolicy};
use crate::model::types::{ContentBlock, ModelEvent};
use crate::model::{self, Provider, StreamDecoder};
use crate::reactor::{Reactor, Signal, TimerId, Wake};
use crate::reaper::{self, Sweep};
use crate::sandbox;
use crate::stdio::{Stdin, StdinItem, Stdout};
use crate::tools::ToolOutput;
use crate::tools::bash::{BashJob, SHELL_BUFFER_CAP, ShellOp, Stream};
use crate::tools::table::{self, Runs};
use crate::tools::web::{FetchRequest, MAX_FETCH_BODY};
use crate::transport::Conn;
use crate::workers::Pool;

/// Error bodies are read for their message and retry hints, never kept whole.
const MAX_ERROR_BODY: usize = 64 * 1024;
/// After a signal, how long a stalled stdout reader may hold up exit.
const STDOUT_GRACE_AFTER_SIGNAL: Duration = Duration::from_millis(200);
/// After the shell exits, how long its pipes may stay open (a grandchild holding them).
const PIPE_GRACE: Duration = Duration::from_millis(500);
/// Threads for file tool calls. Enough that one slow Grep over a large tree does not hold up
/// other runs' reads and edits; few enough that 64 working runs issuing parallel reads share
/// four threads instead of starting hundreds (each a stack mapping, a malloc arena and a
/// share of the CPU), while most calls take milliseconds.
const TOOL_WORKERS: usize = 4;
/// File tool calls waiting for a tool thread. A run issues its reads in parallel but its edits
/// one at a time, so 64 working runs × 16 parallel reads fit; a call beyond that fails at once
/// as a tool error the model can retry instead of queueing behind a thousand others.
const TOOL_QUEUE_CAP: usize = 1024;
/// Threads for DNS lookups. A run has one model request at a time, to one provider host that
/// the system resolver usually has cached, so lookups are short and two keep one slow lookup
/// from delaying every other run's.
const DNS_WORKERS: usize = 2;
/// DNS lookups waiting for a thread: one per working run (the drive table admits 64), twice
/// over for lookups of attempts abandoned on timeout that are still waiting. Beyond it the
/// lookup fails and the request takes the usual retry path.
const DNS_QUEUE_CAP: usize = 128;
/// Background shells one run keeps, running or finished. A finished one gives its place to a
/// new one (the oldest goes first); when all are running, a new one is refused until the
/// model stops one, so a loop of `background: true` calls cannot fill the machine.
const MAX_SHELLS_PER_RUN: usize = 16;
/// A run's process tools alive at once: its foreground commands plus its background shells
/// still running. A turn of 200 `Bash` calls once started 200 process trees together; past
/// this the rest wait, in order, and start as earlier ones end. It is above
/// `MAX_SHELLS_PER_RUN`, so shells left running can never keep every foreground call
/// waiting.
const MAX_LIVE_PROCESSES_PER_RUN: usize = 24;

/// How a process tool's child is started (`tools::table::Runs::Process`).
type Spawn = fn(&Value, &Path, sandbox::Mode) -> Result<BashJob, ToolOutput>;

/// A run's id, the one spelling of it everywhere in the process; `run-N` on the wire and in
/// session file names (`Display`/`parse`), so a string is parsed once, at a surface's edge.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RunId(pub u64);

impl RunId {
    /// `run-<N>` in its one canonical spelling (no sign, no leading zeros), so a run has
    /// exactly one id string.
    pub fn parse(id: &str) -> Option<RunId> {
        let digits = id.strip_prefix("run-")?;
        let canonical = !digits.is_empty()
            && digits.bytes().all(|b| b.is_ascii_digit())
            && (digits == "0" || !digits.starts_with('0'));
        canonical.then(|| digits.parse().ok().map(RunId)).flatten()
    }
}

impl std::fmt::Display for RunId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "run-{}", self.0)
    }
}

/// What a host names its own event sources and timers by: a small `Copy` enum of its
/// choosing, handed back verbatim in `Host::on_io` / `Host::on_timer`.
pub trait HostKey: Copy + Eq + std::hash::Hash + std::fmt::Debug {}
impl<K: Copy + Eq + std::hash::Hash + std::fmt::Debug> HostKey for K {}

/// Default `EngineConfig::first_byte_timeout`: local models on a CPU may process a long
/// prompt for minutes before their first token.
pub const DEFAULT_FIRST_BYTE_TIMEOUT: Duration = Duration::from_secs(300);
/// Default `EngineConfig::idle_timeout`: a working model streams every few seconds, and a
/// stall this long is a stuck server, not a slow one.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(90);
/// Default `EngineConfig::request_timeout`: long enough for the longest reply a working model
/// streams (64k tokens at 20 a second is under 55 minutes), short enough that a stream
/// trickling output forever frees its run within the hour.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(3600);

/// Every model request is bounded three ways, and keep-alives (Anthropic `ping` events, SSE
/// comments, anything that decodes to no `ModelEvent`) count for none of them, so a server
/// that only says it is alive cannot hold a run: until the first output (a `ModelEvent`
/// other than the response's start and usage) by `first_byte_timeout` from the request;
/// after it by `idle_timeout` since the last event; and always by `request_timeout`.
#[derive(Clone)]
pub struct EngineConfig {
    pub provider: Provider,
    pub retry: RetryPolicy,
    /// Connect, headers and prompt processing: the longest wait for the first output.
    pub first_byte_timeout: Duration,
    /// Longest gap between model events once output started.
    pub idle_timeout: Duration,
    /// Longest a whole request may take, however steadily it streams.
    pub request_timeout: Duration,
    /// The configured MCP servers and how long one of their calls may go quiet.
    pub mcp: McpConfig,
    /// Idle model connections kept for the next request (`http::pool`): at least
    /// `MAX_IDLE_PER_KEY`, and the drive surfaces' `--max-working-runs` when larger.
    pub idle_connections: usize,
    /// `webfetch.block_private`: `WebFetch` refuses the addresses `netaddr::class` names,
    /// judged on the URL's host and on every address it resolves to.
    pub webfetch_block_private: bool,
}

/// What the engine's MCP hub starts from (`mcp_client`).
#[derive(Clone, Debug)]
pub struct McpConfig {
    /// Servers from settings, `.mcp.json` and `--mcp-config`, approvals applied.
    pub servers: Vec<mcp_client::config::ServerConfig>,
    /// Where configured stdio servers run.
    pub workspace: PathBuf,
    /// A call with no answer and no progress for this long is cancelled.
    pub call_timeout: Duration,
    /// The workspace's servers the user has not approved yet (`Ctx::mcp_awaiting`), and
    /// the approvals file an approval is recorded in.
    pub unapproved: Vec<mcp_client::config::ServerConfig>,
    pub approvals_file: Option<PathBuf>,
}

impl Default for McpConfig {
    fn default() -> McpConfig {
        McpConfig {
            servers: Vec::new(),
            workspace: PathBuf::from("."),
            call_timeout: mcp_client::DEFAULT_CALL_TIMEOUT,
            unapproved: Vec::new(),
            approvals_file: None,
        }
    }
}

pub enum AskReply {
    Deny(String),
    /// The host surfaced the prompt and will answer with `HostAction::Permit`.
    Pending,
}

#[derive(Clone, Debug)]
pub struct RetryNotice {
    /// 1-based number of the attempt about to be made.
    pub attempt: u32,
    pub max_retries: u32,
    pub delay: Duration,
    pub status: Option<u16>,
    pub category: &'static str,
    pub message: String,
}

pub enum HostAction {
    /// Adds a run under a host-chosen id (ids are the host's namespace, e.g. `run-7` ↔ 7).
    StartRun {
        id: RunId,
        run: Box<Run>,
        workspace: PathBuf,
        /// The MCP servers whose tools the run is offered.
        mcp: Selection,
    },
    SendInput(RunId, Vec<ContentBlock>),
    EndInput(RunId),
    /// A client asked an idle interactive run to compact its conversation.
    Compact(RunId),
    /// A client chose another model or thinking effort for the run's next requests.
    Reconfigure {
        run: RunId,
        model: String,
        context_window: Option<u64>,
        effort: Option<crate::model::types::Effort>,
    },
    Cancel(RunId),
    Permit {
        run: RunId,
        tool_use_id: String,
        allow: bool,
        message: String,
    },
    /// Changes a run's permission mode and/or adds a session rule.
    UpdatePolicy {
        run: RunId,
        mode: Option<crate::permissions::Mode>,
        rule: Option<Box<crate::permissions::Rule>>,
    },
    /// Changes a run's sandbox (within the server's; the drive core checked).
    SetSandbox {
        run: RunId,
        sandbox: crate::sandbox::Mode,
    },
    /// The result of a tool call the host took with `ToolPlacement::Delegated`.
    ToolResult {
        run: RunId,
        tool_use_id: String,
        output: ToolOutput,
    },
    /// The user approved the workspace's MCP server of this name (`Ctx::mcp_decide`):
    /// live runs that see every configured server get it from their next turn.
    McpApproved(String),
    Quit,
}

/// Counters the engine keeps for `/metrics`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Stats {
    pub model_requests: u64,
    pub model_errors: u64,
    pub model_retries: u64,
    pub tool_calls: u64,
}

/// What a host may do from inside a callback: register its own sources and timers (a
/// listener, its connections, a prompt deadline) and queue actions for the engine.
pub struct Ctx<'a, K> {
    reactor: &'a mut Reactor,
    owners: &'a mut HashMap<Token, Owner<K>>,
    timers: &'a mut HashMap<TimerId, TimerOwner<K>>,
    actions: &'a mut VecDeque<HostAction>,
    stats: Stats,
    mcp: &'a mut Hub,
    lookups: Lookups<'a>,
}

impl<K: HostKey> Ctx<'_, K> {
    pub fn registry(&self) -> &mio::Registry {
        self.reactor.registry()
    }

    /// A token whose readiness is delivered to `Host::on_io(key)`.
    pub fn host_token(&mut self, key: K) -> Token {
        let token = self.reactor.token();
        self.owners.insert(token, Owner::Host(key));
        token
    }

    pub fn forget_token(&mut self, token: Token) {
        self.owners.remove(&token);
    }

    /// A timer delivered to `Host::on_timer(key)`.
    pub fn add_timer(&mut self, after: Duration, key: K) -> TimerId {
        let id = self.reactor.add_timer(after);
        self.timers.insert(id, TimerOwner::Host(key));
        id
    }

    pub fn cancel_timer(&mut self, id: TimerId) {
        self.timers.remove(&id);
        self.reactor.cancel_timer(id);
    }

    pub fn act(&mut self, action: HostAction) {
        self.actions.push_back(action);
    }

    pub fn stats(&self) -> Stats {
        self.stats
    }

    /// Starts an MCP server for the host's own use (an ACP session's), to name in a run's
    /// `Selection::servers`.
    pub fn mcp_start(
        &mut self,
        config: mcp_client::config::ServerConfig,
        cwd: PathBuf,
    ) -> ServerId {
        let (hub, mut io) = self.mcp_io();
        hub.start(&mut io, config, cwd)
    }

    /// A server `mcp_start` started, or a fresh instance of it if it died (so a run
    /// started now gets its tools again).
    pub fn mcp_ensure(&mut self, id: ServerId) -> ServerId {
        let (hub, mut io) = self.mcp_io();
        hub.ensure(&mut io, id)
    }

    /// Stops a server `mcp_start` started; its calls in flight are answered as failed.
    pub fn mcp_stop(&mut self, id: ServerId) {
        let (hub, mut io) = self.mcp_io();
        let events = hub.stop(&mut io, id);
        hub.defer(events);
    }

    /// The workspace's servers still awaiting the user's approval (`Hub::awaiting`).
    pub fn mcp_awaiting(&self) -> Vec<mcp_client::config::ServerConfig> {
        self.mcp.awaiting().to_vec()
    }

    /// The user's answer about a workspace server (`Hub::decide`); an approved one joins
    /// the live runs that see every configured server (`HostAction::McpApproved`).
    pub fn mcp_decide(&mut self, name: &str, decision: mcp_client::Approval) -> Result<(), String> {
        let waiting = self.mcp.awaiting().iter().any(|s| s.name == name);
        let recorded = self.mcp.decide(name, decision);
        let approved = matches!(
            decision,
            mcp_client::Approval::Once | mcp_client::Approval::Always
        );
        if waiting && approved {
            self.act(HostAction::McpApproved(name.to_owned()));
        }
        recorded
    }

    /// The hub and the reactor lent to it, borrowed apart.
    fn mcp_io(&mut self) -> (&mut Hub, McpIo<'_, K>) {
        (
            &mut *self.mcp,
            McpIo {
                reactor: &mut *self.reactor,
                owners: &mut *self.owners,
                timers: &mut *self.timers,
                lookups: self.lookups,
            },
        )
    }
}

/// What DNS lookups need: the pool, and the way back to the loop.
#[derive(Clone, Copy)]
struct Lookups<'a> {
    pool: &'a Pool,
    tx: &'a Sender<Completion>,
    waker: &'a Arc<Waker>,
}

impl Lookups<'_> {
    /// Looks `host` up on the DNS pool; the answer comes back as the completion `done`
    /// makes of it. An address literal needs no lookup (and no thread), and a lookup the
    /// pool refuses fails at once: those answers are returned, for the caller to handle now.
    fn look_up(
        &self,
        host: String,
        port: u16,
        done: impl FnOnce(Result<Vec<std::net::SocketAddr>, String>) -> Completion + Send + 'static,
    ) -> Option<Result<Vec<std::net::SocketAddr>, String>> {
        if let Some(addr) = crate::transport::literal_addr(&host, port) {
            return Some(Ok(vec![addr]));
        }
        let tx = self.tx.clone();
        let waker = Arc::clone(self.waker);
        crate::transport::resolve_in_background(self.pool, host, port, move |result| {
            let _ = tx.send(done(result));
            let _ = waker.wake();
        })
        .err()
        .map(Err)
    }
}

/// The engine's reactor lent to the MCP hub: its tokens and timers are routed back to it.
struct McpIo<'a, K> {
    reactor: &'a mut Reactor,
    owners: &'a mut HashMap<Token, Owner<K>>,
    timers: &'a mut HashMap<TimerId, TimerOwner<K>>,
    lookups: Lookups<'a>,
}

impl<K> mcp_client::Io for McpIo<'_, K> {
    fn registry(&self) -> &mio::Registry {
        self.reactor.registry()
    }

    fn token(&mut self, server: ServerId, source: Source) -> Token {
        let token = self.reactor.token();
        self.owners.insert(token, Owner::Mcp(server, source));
        token
    }

    fn forget_token(&mut self, token: Token) {
        self.owners.remove(&token);
    }

    fn add_timer(&mut self, after: Duration, server: ServerId, alarm: Alarm) -> TimerId {
        let id = self.reactor.add_timer(after);
        self.timers.insert(id, TimerOwner::Mcp(server, alarm));
        id
    }

    fn cancel_timer(&mut self, id: TimerId) {
        self.timers.remove(&id);
        self.reactor.cancel_timer(id);
    }

    fn resolve(&mut self, host: String, port: u16, server: ServerId, exchange: u64) {
        let done = move |result| Completion::McpResolved {
            server,
            exchange,
            result,
        };
        // The hub takes every answer as a completion, also one known at once.
        if let Some(result) = self.lookups.look_up(host, port, done) {
            let _ = self.lookups.tx.send(done(result));
            let _ = self.lookups.waker.wake();
        }
    }
}

/// The surface that drives runs: print mode, or the drive core with its network surfaces.
/// Callbacks run on the loop; they must not block, and they talk back through `Ctx`.
pub trait Host {
    /// How the host names its own sources and timers (see `Ctx::host_token`).
    type Key: HostKey;
    fn on_event(&mut self, ctx: &mut Ctx<Self::Key>, run: RunId, event: &TurnEvent);
    fn on_ask(&mut self, ctx: &mut Ctx<Self::Key>, run: RunId, call: &ToolCall) -> AskReply;
    fn on_retry(&mut self, _ctx: &mut Ctx<Self::Key>, _run: RunId, _notice: &RetryNotice) {}
    /// The run began to compact its conversation (`Effect::CompactionStarted`).
    fn on_compaction_started(
        &mut self,
        _ctx: &mut Ctx<Self::Key>,
        _run: RunId,
        _trigger: crate::agent::compact::Trigger,
    ) {
    }
    fn on_await_input(&mut self, ctx: &mut Ctx<Self::Key>, run: RunId);
    fn on_finished(&mut self, ctx: &mut Ctx<Self::Key>, run: RunId, why: &StopCondition);
    fn on_stdin(&mut self, _ctx: &mut Ctx<Self::Key>, _item: StdinItem) {}
    fn on_signal(&mut self, ctx: &mut Ctx<Self::Key>, signal: Signal);
    /// Readiness of a source registered with `Ctx::host_token(key)`.
    fn on_io(&mut self, _ctx: &mut Ctx<Self::Key>, _key: Self::Key) {}
    /// Expiry of a timer armed with `Ctx::add_timer(_, key)`.
    fn on_timer(&mut self, _ctx: &mut Ctx<Self::Key>, _key: Self::Key) {}
    /// Called once the engine has no queued work left after a round of wake-ups (everything
    /// one `epoll_wait` reported): a good moment to push buffered stream data to clients.
    fn after_batch(&mut self, _ctx: &mut Ctx<Self::Key>) {}
    /// Appends the bytes the host wants on stdout to `out` (the stdout queue itself); the
    /// engine writes them without blocking the loop.
    fn write_output(&mut self, _out: &mut Vec<u8>) {}
    /// An allowed tool call is about to run. A host that can run it elsewhere (an editor's
    /// own file system or terminal) answers `Delegated` and later reports the result with
    /// `HostAction::ToolResult`. A `confined` call is a command in the run's sandbox: only
    /// caliban can confine it, so it must run here (`Local`), never in an editor's terminal.
    fn on_tool_start(
        &mut self,
        _ctx: &mut Ctx<Self::Key>,
        _run: RunId,
        _call: &ToolCall,
        _confined: bool,
    ) -> ToolPlacement {
        ToolPlacement::Local
    }
}

pub enum ToolPlacement {
    Local,
    Delegated,
}

enum Owner<K> {
    Model(RunId),
    BashOut(RunId, String),
    BashErr(RunId, String),
    /// A background shell's pipes, by its `shell_id`.
    ShellOut(RunId, String),
    ShellErr(RunId, String),
    /// A `WebFetch` call's connection, by its tool_use_id.
    Fetch(RunId, String),
    Stdin,
    Stdout,
    Mcp(ServerId, Source),
    Host(K),
}

enum TimerOwner<K> {
    /// The first-output or idle limit of the run's request.
    Model(RunId),
    /// The whole request's deadline.
    ModelDeadline(RunId),
    Backoff(RunId),
    BashTimeout(RunId, String),
    BashGrace(RunId, String),
    /// A `WebFetch` call's deadline.
    Fetch(RunId, String),
    Mcp(ServerId, Alarm),
    /// How long a run's model request waits for its MCP servers' tool lists.
    McpWait(RunId),
    /// The oldest idle model connection is due to close.
    PoolIdle,
    Host(K),
}

enum Completion {
    Resolved {
        run: RunId,
        token: Token,
        result: Result<Vec<std::net::SocketAddr>, String>,
    },
    Tool {
        run: RunId,
        tool_use_id: String,
        output: ToolOutput,
    },
    /// The address of a `WebFetch` call's host (or proxy).
    FetchResolved {
        run: RunId,
        tool_use_id: String,
        token: Token,
        result: Result<Vec<std::net::SocketAddr>, String>,
    },
    McpResolved {
        server: ServerId,
        exchange: u64,
        result: Result<Vec<std::net::SocketAddr>, String>,
    },
}

/// A `WebFetch` call in flight.
struct FetchTask {
    request: FetchRequest,
    exchange: Exchange,
    /// Whether the addresses the host resolves to are judged (`webfetch.block_private`,
    /// dialled directly: through a proxy, only the proxy knows them).
    guard_addresses: bool,
    deadline: TimerId,
    status: Option<u16>,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

/// Why `webfetch.block_private` refuses a URL's host before any lookup: it names this
/// machine (`localhost`) or spells an address of a refused class in any form.
fn blocked_host(host: &str) -> Option<String> {
    if crate::netaddr::is_localhost_name(host) {
        return Some(format!(
            "`{host}` is this machine, which webfetch.block_private refuses"
        ));
    }
    let ip = crate::netaddr::parse_ip(host)?;
    let class = crate::netaddr::class(ip)?;
    Some(format!(
        "`{host}` is {ip}, a {class} address, which webfetch.block_private refuses"
    ))
}

impl FetchTask {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

struct ModelCall {
    exchange: Exchange,
    sse: SseDecoder,
    decoder: StreamDecoder,
    status: Option<u16>,
    headers: Vec<(String, String)>,
    error_body: Vec<u8>,
    /// When the request started: the first-output limit counts from here.
    started: Instant,
    /// When the last model event arrived, once output started: the idle limit counts from
    /// here. Keep-alives never move it.
    last_event: Instant,
    timer: TimerId,
    /// Whether output started, so `timer` measures the idle gap rather than the wait for
    /// the first output.
    output_started: bool,
    /// `request_timeout` from `started`.
    deadline: TimerId,
}

impl ModelCall {
    fn content_type(&self) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case("content-type"))
            .map(|(_, v)| v.as_str())
    }

    /// For a 2xx reply whose content type is not an event stream: how much of its body to
    /// keep, to quote in the error.
    fn not_a_stream_head(&self) -> Option<usize> {
        (!model::is_event_stream(self.content_type())).then_some(4 * model::MAX_NOT_A_STREAM_QUOTE)
    }

    /// The error naming what a 2xx reply sent instead of an event stream, if it did.
    fn not_a_stream(&self) -> Option<String> {
        let status = self.status.filter(|s| (200..300).contains(s))?;
        let content_type = self
            .content_type()
            .filter(|t| !model::is_event_stream(Some(t)))?;
        Some(model::not_an_event_stream(
            status,
            content_type,
            &self.error_body,
        ))
    }
}

/// Where a run's model request is. One enum so a request in flight and a pending retry
/// can never coexist.
enum ModelState {
    Idle,
    InFlight(Box<ModelCall>),
    /// Waiting out a retry delay; the timer starts the next attempt.
    Backoff(TimerId),
}

impl ModelState {
    fn call_mut(&mut self) -> Option<&mut ModelCall> {
        match self {
            ModelState::InFlight(call) => Some(call),
            _ => None,
        }
    }

    /// Takes the call in flight, leaving `Idle`; other states are left alone.
    fn take_call(&mut self) -> Option<Box<ModelCall>> {
        match std::mem::replace(self, ModelState::Idle) {
            ModelState::InFlight(call) => Some(call),
            other => {
                *self = other;
                None
            }
        }
    }
}

struct BashTask {
    job: BashJob,
    tokens: [Token; 2],
    timeout: TimerId,
    grace: Option<TimerId>,
}

/// A background shell of a run (`Bash` with `background: true`), by its `shell_id`.
struct ShellTask {
    job: BashJob,
    tokens: [Token; 2],
    /// Where the last `BashOutput` of this shell stopped: the next one starts there.
    read_at: u64,
    /// The pipes are closed and their tokens forgotten.
    released: bool,
}

struct RunSlot {
    run: Run,
    workspace: PathBuf,
    model: ModelState,
    attempt: u32,
    bash: HashMap<String, BashTask>,
    /// Process tool calls waiting for a place (`MAX_LIVE_PROCESSES_PER_RUN`), in call order.
    waiting: VecDeque<(ToolCall, Spawn)>,
    shells: BTreeMap<String, ShellTask>,
    /// Numbers the run's shells: `shell_1`, `shell_2`, …
    shells_started: u64,
    /// `WebFetch` calls in flight, by tool_use_id.
    fetches: HashMap<String, FetchTask>,
    /// The MCP servers whose tools the run is offered.
    mcp: Vec<ServerId>,
    /// The run sees every configured server (no per-run list), so a workspace server
    /// approved while it lives joins it.
    mcp_all: bool,
    mcp_wait: McpWait,
    /// A wait ran out: this run waits no more (a stuck server must not slow every turn).
    mcp_gave_up: bool,
}

/// Whether a run's model request waits for its MCP servers to list their tools (at most
/// `mcp_client::START_WAIT`): so its first turn sees them, and a turn after a server said
/// its tools changed (`tools/list_changed`, usually during the call just answered) sees
/// the new list.
#[derive(Clone, Copy, Debug, PartialEq)]
enum McpWait {
    /// No wait in progress.
    Idle,
    /// The request waits; the timer ends the wait.
    Waiting(TimerId),
}

impl RunSlot {
    /// The run's process tools alive now: foreground commands and running shells.
    fn live_processes(&self) -> usize {
        self.bash.len() + self.shells.values().filter(|s| !s.job.exited()).count()
    }

    fn new(run: Run, workspace: PathBuf, mcp: Vec<ServerId>, mcp_all: bool) -> RunSlot {
        // The file tools hold this directory from now on, so a command that later renames
        // it and puts a symlink in its place (a workspace in a temp dir it may write) does
        // not move them with it.
        crate::tools::beneath::pin(&workspace);
        RunSlot {
            run,
            workspace,
            model: ModelState::Idle,
            attempt: 0,
            bash: HashMap::new(),
            waiting: VecDeque::new(),
            shells: BTreeMap::new(),
            shells_started: 0,
            fetches: HashMap::new(),
            mcp,
            mcp_all,
            mcp_wait: McpWait::Idle,
            mcp_gave_up: false,
        }
    }
}

pub struct Engine<K: HostKey> {
    reactor: Reactor,
    config: EngineConfig,
    runs: BTreeMap<RunId, RunSlot>,
    /// Servers `mcp_select` started ahead of a run, for the next run started with that
    /// selection.
    selected: Option<(Selection, Vec<crate::mcp_client::ServerId>)>,
    owners: HashMap<Token, Owner<K>>,
    timers: HashMap<TimerId, TimerOwner<K>>,
    tx: Sender<Completion>,
    rx: Receiver<Completion>,
    waker: Arc<Waker>,
    /// File tool calls run here (`start_tool`); started lazily, so idle costs nothing.
    tool_workers: Pool,
    /// DNS lookups for model requests and `WebFetch` run here.
    dns_workers: Pool,
    /// TLS for `WebFetch`: the provider's when it has one, else built on first use.
    web_tls: Option<Arc<rustls::ClientConfig>>,
    stdin: Option<Stdin>,
    stdout: Option<Stdout>,
    /// A SIGINT/SIGTERM arrived: the final stdout flush gets a deadline.
    signalled: bool,
    stdout_gone_reported: bool,
    queue: VecDeque<(RunId, Effect)>,
    actions: VecDeque<HostAction>,
    notices: VecDeque<(RunId, RetryNotice)>,
    stats: Stats,
    quit: bool,
    /// Every MCP server of the process; runs name theirs in `RunSlot::mcp`.
    mcp: Hub,
    /// Idle model connections (keep-alive), deregistered, for the next model request; one
    /// timer (`pool_timer`) closes the ones idle too long.
    pool: conn_pool::Pool<Conn>,
    /// What makes a model connection reusable: the provider's target, proxy and TLS config.
    /// Built at the first model request, not at start-up (an idle server runs none of it).
    model_key: Option<conn_pool::Key>,
    pool_timer: Option<TimerId>,
}

impl<K: HostKey> Engine<K> {
    pub fn new(config: EngineConfig) -> std::io::Result<Engine<K>> {
        let reactor = Reactor::new()?;
        let waker = reactor.waker();
        let (tx, rx) = channel();
        let mut mcp = Hub::new(
            config.mcp.servers.clone(),
            config.mcp.workspace.clone(),
            config.mcp.call_timeout,
        );
        mcp.await_approval(
            config.mcp.unapproved.clone(),
            config.mcp.approvals_file.clone(),
        );
        let idle_connections = config.idle_connections;
        Ok(Engine {
            reactor,
            config,
            runs: BTreeMap::new(),
            selected: None,
            owners: HashMap::new(),
            timers: HashMap::new(),
            tx,
            rx,
            waker,
            tool_workers: Pool::new("caliban-tool", TOOL_WORKERS, TOOL_QUEUE_CAP),
            dns_workers: Pool::new("caliban-dns", DNS_WORKERS, DNS_QUEUE_CAP),
            web_tls: None,
            stdin: None,
            stdout: None,
            signalled: false,
            stdout_gone_reported: false,
            queue: VecDeque::new(),
            actions: VecDeque::new(),
            notices: VecDeque::new(),
            stats: Stats::default(),
            quit: false,
            mcp,
            pool: conn_pool::Pool::new(conn_pool::Limits {
                per_key: idle_connections,
                total: idle_connections.max(conn_pool::MAX_IDLE),
                idle: conn_pool::IDLE_TIMEOUT,
            }),
            model_key: None,
            pool_timer: None,
        })
    }

    pub fn attach_stdin(&mut self) -> std::io::Result<()> {
        let token = self.reactor.token();
        let stdin = Stdin::attach(self.reactor.registry(), token, self.reactor.waker())?;
        self.owners.insert(token, Owner::Stdin);
        self.stdin = Some(stdin);
        Ok(())
    }

    pub fn attach_stdout(&mut self) {
        let token = self.reactor.token();
        self.stdout = Some(Stdout::attach(self.reactor.registry(), token));
        self.owners.insert(token, Owner::Stdout);
    }

    /// Starts the MCP servers a run with `selection` is given, now, and names them with
    /// their state (`Hub::status`): print mode's init frame shows them before its run starts.
    /// The next run started with the same selection takes these very servers, so one that
    /// already failed is not started a second time.
    pub fn mcp_select(&mut self, selection: &Selection) -> Vec<(String, &'static str)> {
        let (hub, mut io) = self.mcp_io();
        let ids = hub.select(&mut io, selection);
        let named = ids
            .iter()
            .map(|id| (self.mcp.name(*id).to_owned(), self.mcp.status(*id)))
            .collect();
        self.selected = Some((selection.clone(), ids));
        named
    }

    /// The hub and the reactor lent to it, borrowed apart.
    fn mcp_io(&mut self) -> (&mut Hub, McpIo<'_, K>) {
        (
            &mut self.mcp,
            McpIo {
                reactor: &mut self.reactor,
                owners: &mut self.owners,
                timers: &mut self.timers,
                lookups: Lookups {
                    pool: &self.dns_workers,
                    tx: &self.tx,
                    waker: &self.waker,
                },
            },
        )
    }

    /// Queues actions to perform when the loop starts (e.g. the first prompt).
    pub fn push_action(&mut self, action: HostAction) {
        self.actions.push_back(action);
    }

    fn ctx(&mut self) -> Ctx<'_, K> {
        Ctx {
            reactor: &mut self.reactor,
            owners: &mut self.owners,
            timers: &mut self.timers,
            actions: &mut self.actions,
            stats: self.stats,
            mcp: &mut self.mcp,
            lookups: Lookups {
                pool: &self.dns_workers,
                tx: &self.tx,
                waker: &self.waker,
            },
        }
    }

    /// Lets a host set up its sources (listeners) before the loop starts.
    pub fn with_ctx<T>(&mut self, f: impl FnOnce(&mut Ctx<K>) -> T) -> T {
        f(&mut self.ctx())
    }

    /// Runs the loop until a host asks to quit; then kills whatever is still running.
    pub fn run_loop(&mut self, host: &mut impl Host<Key = K>) -> std::io::Result<()> {
        let mut wakes = Vec::new();
        self.drain(host);
        while !self.quit {
            wakes.clear();
            self.reactor.wait(&mut wakes, None)?;
            for wake in wakes.drain(..) {
                self.dispatch(wake, host);
                self.perform_queued(host);
                if self.quit {
                    break;
                }
            }
            // Once per round of wakes, not once per wake: with many runs streaming, one
            // epoll_wait reports many model sockets, and the host fans their events out
            // (follow streams, long-polls, the ACP outbox on stdout) in one pass, with one
            // write per client instead of one per model read.
            self.drain(host);
        }
        self.shutdown();
        self.end_mcp_sessions()?;
        if let Some(stdout) = self.stdout.as_mut() {
            // After a signal the caller asked us to stop: give a stalled reader a moment,
            // not forever. A normal end waits for the reader like any command-line tool.
            let deadline = self
                .signalled
                .then(|| Instant::now() + STDOUT_GRACE_AFTER_SIGNAL);
            stdout.finish(deadline, STDOUT_GRACE_AFTER_SIGNAL);
        }
        Ok(())
    }

    fn dispatch(&mut self, wake: Wake, host: &mut impl Host<Key = K>) {
        match wake {
            Wake::Io { token, .. } => match self.owners.get(&token) {
                Some(Owner::Model(run)) => {
                    let run = *run;
                    self.on_model_ready(run);
                }
                Some(Owner::BashOut(run, id)) => {
                    let (run, id) = (*run, id.clone());
                    self.on_bash_ready(run, &id, Stream::Stdout);
                }
                Some(Owner::BashErr(run, id)) => {
                    let (run, id) = (*run, id.clone());
                    self.on_bash_ready(run, &id, Stream::Stderr);
                }
                Some(Owner::ShellOut(run, id)) => {
                    let (run, id) = (*run, id.clone());
                    self.on_shell_ready(run, &id, Some(Stream::Stdout));
                }
                Some(Owner::ShellErr(run, id)) => {
                    let (run, id) = (*run, id.clone());
                    self.on_shell_ready(run, &id, Some(Stream::Stderr));
                }
                Some(Owner::Fetch(run, id)) => {
                    let (run, id) = (*run, id.clone());
                    self.on_fetch_ready(run, &id);
                }
                Some(Owner::Stdin) => self.drain_stdin(host),
                Some(Owner::Stdout) => {
                    if let Some(stdout) = self.stdout.as_mut() {
                        stdout.flush();
                    }
                }
                Some(Owner::Mcp(server, source)) => {
                    let (server, source) = (*server, *source);
                    let (hub, mut io) = self.mcp_io();
                    let events = hub.on_ready(&mut io, server, source);
                    self.on_hub_events(events);
                }
                Some(Owner::Host(key)) => {
                    let key = *key;
                    host.on_io(&mut self.ctx(), key);
                }
                None => {}
            },
            Wake::Woken => {
                while let Ok(done) = self.rx.try_recv() {
                    self.on_completion(done);
                }
                self.drain_stdin(host);
            }
            Wake::Timer(id) => self.on_timer(id, host),
            Wake::Signal(Signal::Child) => self.reap_children(),
            Wake::Signal(signal) => {
                self.signalled = true;
                host.on_signal(&mut self.ctx(), signal);
            }
        }
    }

    fn drain_stdin(&mut self, host: &mut impl Host<Key = K>) {
        let Some(stdin) = self.stdin.as_mut() else {
            return;
        };
        let mut items = Vec::new();
        stdin.drain(self.reactor.registry(), &mut items);
        for item in items {
            host.on_stdin(&mut self.ctx(), item);
        }
    }

    /// Performs queued effects and host actions until both queues are empty.
    fn perform_queued(&mut self, host: &mut impl Host<Key = K>) {
        loop {
            if let Some((run, notice)) = self.notices.pop_front() {
                host.on_retry(&mut self.ctx(), run, &notice);
                continue;
            }
            if let Some((run, effect)) = self.queue.pop_front() {
                self.perform(run, effect, host);
                continue;
            }
            if let Some(action) = self.actions.pop_front() {
                self.act(action);
                continue;
            }
            let early = self.mcp.take_early();
            if !early.is_empty() {
                self.on_hub_events(early);
                continue;
            }
            return;
        }
    }

    /// `perform_queued`, then the host's `after_batch` (again while it queues actions), then
    /// the host's output to stdout.
    fn drain(&mut self, host: &mut impl Host<Key = K>) {
        loop {
            self.perform_queued(host);
            host.after_batch(&mut self.ctx());
            if self.actions.is_empty() {
                break;
            }
        }
        if let Some(stdout) = self.stdout.as_mut() {
            stdout.push_with(|out| host.write_output(out));
            // A protocol peer that stopped reading (or hung up) can no longer be answered:
            // tell the host as if its input had ended, so it winds down instead of working
            // for nobody.
            if stdout.is_gone() && !self.stdout_gone_reported {
                self.stdout_gone_reported = true;
                crate::log::warn("stdout is gone; ending as if stdin had closed");
                host.on_stdin(&mut self.ctx(), StdinItem::Eof);
                self.drain(host);
            }
        }
    }

    fn push_effects(&mut self, run: RunId, effects: Vec<Effect>) {
        self.queue.extend(effects.into_iter().map(|e| (run, e)));
    }

    fn act(&mut self, action: HostAction) {
        let now = Instant::now();
        match action {
            HostAction::StartRun {
                id,
                run,
                workspace,
                mcp,
            } => {
                let servers = match self.selected.take() {
                    Some((selection, ids)) if selection == mcp => ids,
                    _ => {
                        let (hub, mut io) = self.mcp_io();
                        hub.select(&mut io, &mcp)
                    }
                };
                let all = mcp.configured.is_none();
                self.runs
                    .insert(id, RunSlot::new(*run, workspace, servers, all));
            }
            HostAction::McpApproved(name) => {
                let runs: Vec<RunId> = self
                    .runs
                    .iter()
                    .filter(|(_, s)| {
                        s.mcp_all && !s.mcp.iter().any(|id| self.mcp.name(*id) == name)
                    })
                    .map(|(id, _)| *id)
                    .collect();
                if runs.is_empty() {
                    return;
                }
                let only = Selection {
                    configured: Some(vec![name]),
                    servers: Vec::new(),
                };
                let (hub, mut io) = self.mcp_io();
                let started = hub.select(&mut io, &only);
                for run in runs {
                    if let Some(slot) = self.runs.get_mut(&run) {
                        slot.mcp.extend(started.iter().copied());
                    }
                }
            }
            HostAction::SendInput(run, content) => {
                if let Some(slot) = self.runs.get_mut(&run) {
                    let effects = slot.run.send_user(content, now);
                    self.push_effects(run, effects);
                }
            }
            HostAction::EndInput(run) => {
                if let Some(slot) = self.runs.get_mut(&run) {
                    let effects = slot.run.end_input();
                    self.push_effects(run, effects);
                }
            }
            HostAction::Compact(run) => {
                if let Some(slot) = self.runs.get_mut(&run) {
                    let effects = slot.run.compact();
                    self.push_effects(run, effects);
                }
            }
            HostAction::Reconfigure {
                run,
                model,
                context_window,
                effort,
            } => {
                if let Some(slot) = self.runs.get_mut(&run) {
                    slot.run.reconfigure(model, context_window, effort);
                }
            }
            HostAction::Cancel(run) => {
                if let Some(slot) = self.runs.get_mut(&run) {
                    let effects = slot.run.cancel();
                    self.push_effects(run, effects);
                }
            }
            HostAction::Permit {
                run,
                tool_use_id,
                allow,
                message,
            } => {
                if let Some(slot) = self.runs.get_mut(&run) {
                    let effects = slot.run.on_permission(&tool_use_id, allow, &message, now);
                    self.push_effects(run, effects);
                }
            }
            HostAction::ToolResult {
                run,
                tool_use_id,
                output,
            } => {
                if let Some(slot) = self.runs.get_mut(&run) {
                    let effects = slot.run.on_tool_done(&tool_use_id, output, now);
                    self.push_effects(run, effects);
                }
            }
            HostAction::UpdatePolicy { run, mode, rule } => {
                if let Some(slot) = self.runs.get_mut(&run) {
                    let policy = slot.run.policy_mut();
                    if let Some(mode) = mode {
                        policy.set_mode(mode);
                    }
                    if let Some(rule) = rule {
                        policy.with_session_rule(*rule);
                    }
                }
            }
            HostAction::SetSandbox { run, sandbox } => {
                if let Some(slot) = self.runs.get_mut(&run) {
                    slot.run.policy_mut().set_sandbox(sandbox);
                }
            }
            HostAction::Quit => self.quit = true,
        }
    }

    fn perform(&mut self, run: RunId, effect: Effect, host: &mut impl Host<Key = K>) {
        match effect {
            Effect::Emit(event) => host.on_event(&mut self.ctx(), run, &event),
            Effect::RequestModel => {
                if let Some(slot) = self.runs.get_mut(&run) {
                    slot.attempt = 0;
                }
                self.request_model(run);
            }
            Effect::RunTool(call) => {
                self.stats.tool_calls += 1;
                let Some(slot) = self.runs.get_mut(&run) else {
                    return;
                };
                // The sandbox answers a file tool's call first, wherever it would run, so
                // neither the tool nor an editor can do what a command may not.
                let mode = slot.run.sandbox_for(&call.id);
                if let Err(why) =
                    crate::tools::check_in_sandbox(mode, &call.name, &call.input, &slot.workspace)
                {
                    let output = ToolOutput::error(format!("{}: {why}", call.name));
                    let effects =
                        slot.run
                            .on_tool_sandboxed(&call.id, output, &why, Instant::now());
                    self.push_effects(run, effects);
                    return;
                }
                // A command the sandbox confines runs here, never in an editor's terminal,
                // which nothing of ours would confine.
                let process = matches!(
                    table::lookup(&call.name).map(|tool| tool.runs),
                    Some(Runs::Process(_))
                );
                let confined = process && sandbox::confines(mode);
                match host.on_tool_start(&mut self.ctx(), run, &call, confined) {
                    ToolPlacement::Local => self.start_tool(run, call),
                    ToolPlacement::Delegated => {}
                }
            }
            Effect::Ask(call) => match host.on_ask(&mut self.ctx(), run, &call) {
                AskReply::Deny(message) => self.actions.push_back(HostAction::Permit {
                    run,
                    tool_use_id: call.id,
                    allow: false,
                    message,
                }),
                AskReply::Pending => {}
            },
            Effect::AbortWork => self.abort_work(run),
            Effect::CompactionStarted(trigger) => {
                host.on_compaction_started(&mut self.ctx(), run, trigger)
            }
            Effect::AwaitInput => host.on_await_input(&mut self.ctx(), run),
            Effect::Finished(why) => {
                self.abort_work(run);
                host.on_finished(&mut self.ctx(), run, &why);
                // RunEnd was the last event: nothing of the run is needed any more.
                self.runs.remove(&run);
            }
        }
    }

    // ---- model requests ------------------------------------------------------------------

    /// A new model request: it waits (bounded) while any of the run's MCP servers is
    /// listing its tools; then it offers the tools they list now, so a server that finished
    /// listing late, or changed its tools, reaches the run's next turn.
    fn request_model(&mut self, run: RunId) {
        self.request_model_waiting(run, true);
    }

    fn request_model_waiting(&mut self, run: RunId, may_wait: bool) {
        let Some(slot) = self.runs.get_mut(&run) else {
            return;
        };
        if let McpWait::Waiting(_) = slot.mcp_wait {
            return;
        }
        if may_wait && !slot.mcp_gave_up && self.mcp.any_listing(&slot.mcp) {
            let timer = self.reactor.add_timer(mcp_client::START_WAIT);
            self.timers.insert(timer, TimerOwner::McpWait(run));
            slot.mcp_wait = McpWait::Waiting(timer);
            return;
        }
        if !slot.mcp.is_empty() {
            slot.run.set_extra_tools(self.mcp.tools(&slot.mcp));
        }
        self.start_model(run);
    }

    /// A run's wait for its servers is over: they all settled, or (`gave_up`) the wait ran
    /// out and the stragglers are left out of this turn.
    fn end_mcp_wait(&mut self, run: RunId, gave_up: bool) {
        let Some(slot) = self.runs.get_mut(&run) else {
            return;
        };
        let McpWait::Waiting(timer) = slot.mcp_wait else {
            return;
        };
        slot.mcp_wait = McpWait::Idle;
        slot.mcp_gave_up |= gave_up;
        if gave_up {
            let stragglers: Vec<&str> = slot
                .mcp
                .iter()
                .filter(|id| self.mcp.any_listing(&[**id]))
                .map(|id| self.mcp.name(*id))
                .collect();
            log::warn(&format!(
                "MCP servers still listing their tools after {} s, going ahead without their new lists: {}",
                mcp_client::START_WAIT.as_secs(),
                stragglers.join(", ")
            ));
        } else {
            self.timers.remove(&timer);
            self.reactor.cancel_timer(timer);
        }
        self.request_model_waiting(run, false);
    }

    /// What the MCP hub reports: calls answered, servers ready.
    fn on_hub_events(&mut self, events: Vec<HubEvent>) {
        let now = Instant::now();
        for event in events {
            match event {
                HubEvent::CallDone { key, output } => {
                    let run = RunId(key.run);
                    if let Some(slot) = self.runs.get_mut(&run) {
                        let effects = slot.run.on_tool_done(&key.tool_use_id, output, now);
                        self.push_effects(run, effects);
                    }
                }
                HubEvent::Settled => {
                    let ready: Vec<RunId> = self
                        .runs
                        .iter()
                        .filter(|(_, s)| {
                            matches!(s.mcp_wait, McpWait::Waiting(_))
                                && !self.mcp.any_listing(&s.mcp)
                        })
                        .map(|(id, _)| *id)
                        .collect();
                    for run in ready {
                        self.end_mcp_wait(run, false);
                    }
                }
            }
        }
    }

    fn start_model(&mut self, run: RunId) {
        if let Some(mut stale) = self.runs.get_mut(&run).and_then(|s| s.model.take_call()) {
            self.release_model(&mut stale);
        }
        let Some(slot) = self.runs.get_mut(&run) else {
            return;
        };
        let provider = &self.config.provider;
        let request = provider.build_request(&slot.run.model_request());
        let token = self.reactor.token();
        let mut exchange = Exchange::new(
            token,
            provider.target.clone(),
            provider.proxy.clone(),
            provider.tls.clone(),
            request,
        );
        let (host, port) = exchange.dial_target();
        self.stats.model_requests += 1;
        log::debug(&format!(
            "model request for run {} to {}:{}{}",
            run.0, provider.target.host, provider.target.port, provider.path
        ));
        let timer = self.reactor.add_timer(self.config.first_byte_timeout);
        self.timers.insert(timer, TimerOwner::Model(run));
        let deadline = self.reactor.add_timer(self.config.request_timeout);
        self.timers.insert(deadline, TimerOwner::ModelDeadline(run));
        self.owners.insert(token, Owner::Model(run));
        // A warm connection from an earlier turn (of any run) skips DNS, TCP and TLS.
        let key = self.model_key.get_or_insert_with(|| {
            conn_pool::Key::new(
                provider.target.clone(),
                provider.proxy.clone(),
                provider.tls.clone(),
            )
        });
        let reused = match self.pool.take(key, http_client::idle_alive) {
            Some(parked) => exchange.reuse(self.reactor.registry(), parked).is_ok(),
            None => false,
        };
        slot.model = ModelState::InFlight(Box::new(ModelCall {
            exchange,
            sse: SseDecoder::new(),
            decoder: provider.decoder(),
            status: None,
            headers: Vec::new(),
            error_body: Vec::new(),
            started: Instant::now(),
            last_event: Instant::now(),
            timer,
            output_started: false,
            deadline,
        }));
        if reused {
            return;
        }
        let done = move |result| Completion::Resolved { run, token, result };
        if let Some(now) = self.look_up(host, port, done) {
            self.on_resolved(run, token, now);
        }
    }

    /// A model response ended cleanly: its connection waits in the pool for the next
    /// request, if both sides keep it open.
    fn park_model(&mut self, call: &mut ModelCall) {
        let Some(parked) = call.exchange.park(self.reactor.registry()) else {
            return;
        };
        let Some(key) = self.model_key.clone() else {
            return;
        };
        self.pool.put(key, parked, Instant::now());
        if self.pool_timer.is_none() {
            let timer = self.reactor.add_timer(conn_pool::IDLE_TIMEOUT);
            self.timers.insert(timer, TimerOwner::PoolIdle);
            self.pool_timer = Some(timer);
        }
    }

    /// The pool's timer: close what idled too long, and wake again for the next.
    fn on_pool_timer(&mut self) {
        self.pool_timer = None;
        let now = Instant::now();
        if let Some(due) = self.pool.expire(now) {
            let timer = self.reactor.add_timer(due.saturating_duration_since(now));
            self.timers.insert(timer, TimerOwner::PoolIdle);
            self.pool_timer = Some(timer);
        }
    }

    /// `Lookups::look_up` on the engine's DNS pool.
    fn look_up(
        &self,
        host: String,
        port: u16,
        done: impl FnOnce(Result<Vec<std::net::SocketAddr>, String>) -> Completion + Send + 'static,
    ) -> Option<Result<Vec<std::net::SocketAddr>, String>> {
        Lookups {
            pool: &self.dns_workers,
            tx: &self.tx,
            waker: &self.waker,
        }
        .look_up(host, port, done)
    }

    fn on_resolved(
        &mut self,
        run: RunId,
        token: Token,
        result: Result<Vec<std::net::SocketAddr>, String>,
    ) {
        let Some(call) = self
            .runs
            .get_mut(&run)
            .and_then(|s| s.model.call_mut())
            .filter(|c| c.exchange.token() == token)
        else {
            return;
        };
        let mut events = Vec::new();
        call.exchange
            .on_resolved(self.reactor.registry(), result, &mut events);
        self.on_client_events(run, events);
    }

    fn on_model_ready(&mut self, run: RunId) {
        let Some(call) = self.runs.get_mut(&run).and_then(|s| s.model.call_mut()) else {
            return;
        };
        let mut events = Vec::new();
        call.exchange.on_ready(self.reactor.registry(), &mut events);
        self.on_client_events(run, events);
    }

    fn on_client_events(&mut self, run: RunId, events: Vec<ClientEvent>) {
        for event in events {
            let Some(slot) = self.runs.get_mut(&run) else {
                return;
            };
            let Some(call) = slot.model.call_mut() else {
                return;
            };
            match event {
                ClientEvent::Head(head) => {
                    call.status = Some(head.status);
                    call.headers = head.headers;
                }
                ClientEvent::Body(bytes) => {
                    if call.status.is_some_and(|s| (200..300).contains(&s)) {
                        if let Some(head) = call.not_a_stream_head() {
                            // Kept to say what came instead, if no stream comes of it.
                            let room = head.saturating_sub(call.error_body.len());
                            call.error_body
                                .extend_from_slice(&bytes[..room.min(bytes.len())]);
                        }
                        let mut sse_events = Vec::new();
                        if let Err(e) = call.sse.feed(&bytes, &mut sse_events) {
                            let error = call
                                .not_a_stream()
                                .unwrap_or_else(|| format!("bad event stream: {e}"));
                            self.model_failed(run, error, None, true);
                            return;
                        }
                        let mut model_events = Vec::new();
                        for ev in &sse_events {
                            if let Err(e) = call.decoder.on_event(ev, &mut model_events) {
                                self.model_failed(
                                    run,
                                    format!("bad model stream: {e}"),
                                    None,
                                    false,
                                );
                                return;
                            }
                        }
                        let now = Instant::now();
                        // Bytes are not progress (a keep-alive is bytes); model events are.
                        if !model_events.is_empty() {
                            call.last_event = now;
                        }
                        if !call.output_started && model_events.iter().any(ModelEvent::is_output) {
                            // Output started: from now on a gap between events is measured
                            // by the (usually much shorter) idle limit.
                            self.reactor.cancel_timer(call.timer);
                            self.timers.remove(&call.timer);
                            call.timer = self.reactor.add_timer(self.config.idle_timeout);
                            call.output_started = true;
                            self.timers.insert(call.timer, TimerOwner::Model(run));
                        }
                        for ev in model_events {
                            if let ModelEvent::Error {
                                kind,
                                message,
                                retryable,
                            } = &ev
                            {
                                let msg = format!("{kind}: {message}");
                                self.model_failed(run, msg, None, *retryable);
                                return;
                            }
                            let Some(slot) = self.runs.get_mut(&run) else {
                                return;
                            };
                            let effects = slot.run.on_model_event(ev, now);
                            self.push_effects(run, effects);
                        }
                    } else {
                        let room = MAX_ERROR_BODY.saturating_sub(call.error_body.len());
                        call.error_body
                            .extend_from_slice(&bytes[..room.min(bytes.len())]);
                    }
                }
                ClientEvent::End => self.model_ended(run),
                ClientEvent::Failed { error, permanent } => {
                    let error = call.not_a_stream().unwrap_or(error);
                    self.model_failed(run, error, None, !permanent);
                    return;
                }
            }
        }
    }

    fn model_ended(&mut self, run: RunId) {
        let Some(slot) = self.runs.get_mut(&run) else {
            return;
        };
        let Some(mut call) = slot.model.take_call() else {
            return;
        };
        self.park_model(&mut call);
        self.release_model(&mut call);
        self.finish_model(run, *call);
    }

    fn finish_model(&mut self, run: RunId, call: ModelCall) {
        let status = call.status.unwrap_or(0);
        if (200..300).contains(&status) {
            // Flush a final event that arrived without its blank line only if the decoder
            // is not done yet; a complete stream needs nothing more.
            if call.decoder.is_done() {
                let now = Instant::now();
                if let Some(slot) = self.runs.get_mut(&run) {
                    let effects = slot.run.on_model_complete(now);
                    self.push_effects(run, effects);
                }
            } else {
                let error = call.not_a_stream().unwrap_or_else(|| {
                    "the model stream ended before the response was complete".to_owned()
                });
                self.retry_or_fail(run, error, None, true);
            }
            return;
        }
        let err = self
            .config
            .provider
            .parse_error_body(status, &call.error_body);
        let headers = call.headers.clone();
        let header = move |name: &str| {
            headers
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.clone())
        };
        let attempt = self.runs.get(&run).map_or(0, |s| s.attempt);
        let decision = retry::decide_status(
            &self.config.retry,
            attempt,
            status,
            &header,
            Some(err.kind.as_str()),
            jitter(),
        );
        let message = err.to_string();
        if err.is_context_overflow()
            && let Some(slot) = self.runs.get_mut(&run)
        {
            // The model says the request did not fit: the run may compact and resend.
            let effects = slot.run.on_context_overflow();
            if !effects.is_empty() {
                self.push_effects(run, effects);
                return;
            }
        }
        if err.is_image_refusal()
            && let Some(slot) = self.runs.get_mut(&run)
            && slot.run.drop_images()
        {
            // A text-only model: the pictures become lines and the turn goes again at once.
            let message = format!("{message}; sending it again without its images");
            let category = retry::category_for(status, Some(err.kind.as_str()));
            self.schedule_retry(run, Duration::ZERO, Some(status), category, message);
            return;
        }
        let can_retry = self.runs.get(&run).is_some_and(|s| s.run.can_retry_turn());
        match decision {
            RetryDecision::Retry(delay) if can_retry => {
                let category = retry::category_for(status, Some(err.kind.as_str()));
                self.schedule_retry(run, delay, Some(status), category, message)
            }
            _ => self.fail_run(run, StopCondition::ProviderError(message)),
        }
    }

    /// A transport-level or stream-level failure of the current model call.
    fn model_failed(&mut self, run: RunId, error: String, status: Option<u16>, retryable: bool) {
        if let Some(mut call) = self.runs.get_mut(&run).and_then(|s| s.model.take_call()) {
            self.release_model(&mut call);
        }
        self.retry_or_fail(run, error, status, retryable);
    }

    fn retry_or_fail(&mut self, run: RunId, error: String, status: Option<u16>, retryable: bool) {
        let Some(slot) = self.runs.get(&run) else {
            return;
        };
        if retryable
            && slot.run.can_retry_turn()
            && let RetryDecision::Retry(delay) =
                retry::decide_transport(&self.config.retry, slot.attempt, jitter())
        {
            self.schedule_retry(run, delay, status, retry::CATEGORY_NETWORK, error);
            return;
        }
        self.fail_run(run, StopCondition::ProviderError(error));
    }

    fn schedule_retry(
        &mut self,
        run: RunId,
        delay: Duration,
        status: Option<u16>,
        category: &'static str,
        message: String,
    ) {
        let Some(slot) = self.runs.get_mut(&run) else {
            return;
        };
        self.stats.model_retries += 1;
        slot.attempt += 1;
        slot.run.reset_turn_for_retry(Instant::now() + delay);
        let notice = RetryNotice {
            attempt: slot.attempt + 1,
            max_retries: self.config.retry.max_retries,
            delay,
            status,
            category,
            message,
        };
        log::info(&format!(
            "model request failed ({}); retry {} of {} in {} ms",
            notice.message,
            slot.attempt,
            notice.max_retries,
            delay.as_millis()
        ));
        let timer = self.reactor.add_timer(delay);
        slot.model = ModelState::Backoff(timer);
        self.timers.insert(timer, TimerOwner::Backoff(run));
        self.notices.push_back((run, notice));
    }

    fn fail_run(&mut self, run: RunId, condition: StopCondition) {
        self.stats.model_errors += 1;
        if let Some(slot) = self.runs.get_mut(&run) {
            let effects = slot.run.on_model_failed(condition);
            self.push_effects(run, effects);
        }
    }

    fn release_model(&mut self, call: &mut ModelCall) {
        call.exchange.close(self.reactor.registry());
        self.owners.remove(&call.exchange.token());
        for timer in [call.timer, call.deadline] {
            self.timers.remove(&timer);
            self.reactor.cancel_timer(timer);
        }
    }

    // ---- timers --------------------------------------------------------------------------

    fn on_timer(&mut self, id: TimerId, host: &mut impl Host<Key = K>) {
        let Some(owner) = self.timers.remove(&id) else {
            return;
        };
        match owner {
            TimerOwner::Host(key) => host.on_timer(&mut self.ctx(), key),
            TimerOwner::Mcp(server, alarm) => {
                let (hub, mut io) = self.mcp_io();
                let events = hub.on_timer(&mut io, server, alarm);
                self.on_hub_events(events);
            }
            TimerOwner::McpWait(run) => self.end_mcp_wait(run, true),
            TimerOwner::PoolIdle => self.on_pool_timer(),
            TimerOwner::Model(run) => self.on_model_timer(run, id),
            TimerOwner::ModelDeadline(run) => self.on_model_deadline(run, id),
            TimerOwner::Backoff(run) => {
                if let Some(slot) = self.runs.get_mut(&run)
                    && matches!(slot.model, ModelState::Backoff(timer) if timer == id)
                {
                    slot.model = ModelState::Idle;
                    self.start_model(run);
                }
            }
            TimerOwner::BashTimeout(run, tool) => {
                if let Some(task) = self.runs.get_mut(&run).and_then(|s| s.bash.get_mut(&tool)) {
                    let secs = task.job.timeout.as_secs();
                    task.job.kill(if secs == 1 {
                        "timed out after 1 second; the process group was killed"
                    } else {
                        "timed out; the process group was killed"
                    });
                    self.reap_children();
                }
            }
            TimerOwner::Fetch(run, id) => {
                let Some(task) = self.runs.get(&run).and_then(|s| s.fetches.get(&id)) else {
                    return;
                };
                let output = ToolOutput::error(format!(
                    "WebFetch: no complete answer from {} within {} s",
                    task.request.url,
                    task.request.timeout.as_secs()
                ));
                self.end_fetch(run, &id, output);
            }
            TimerOwner::BashGrace(run, tool) => {
                if let Some(task) = self.runs.get_mut(&run).and_then(|s| s.bash.get_mut(&tool)) {
                    task.job.close_pipes(self.reactor.registry());
                }
                self.maybe_finish_bash(run, &tool);
            }
        }
    }

    fn on_model_timer(&mut self, run: RunId, id: TimerId) {
        let Some(call) = self.runs.get_mut(&run).and_then(|s| s.model.call_mut()) else {
            return;
        };
        if call.timer != id {
            return;
        }
        let (limit, since) = if call.output_started {
            (self.config.idle_timeout, call.last_event)
        } else {
            (self.config.first_byte_timeout, call.started)
        };
        let quiet = since.elapsed();
        if quiet < limit {
            // Events since the timer was armed: push the deadline out instead of re-arming
            // a timer per event.
            let timer = self.reactor.add_timer(limit - quiet);
            call.timer = timer;
            self.timers.insert(timer, TimerOwner::Model(run));
            return;
        }
        let secs = limit.as_secs_f64();
        let message = if call.output_started {
            format!("the model stream was idle for {secs} s")
        } else if call.exchange.got_response_byte() {
            format!("no output from the model within {secs} s (keep-alives do not count)")
        } else {
            format!("no response from the model within {secs} s")
        };
        if let Some(mut call) = self.runs.get_mut(&run).and_then(|s| s.model.take_call()) {
            self.release_model(&mut call);
        }
        let can_retry = self.runs.get(&run).is_some_and(|s| s.run.can_retry_turn());
        if can_retry {
            self.retry_or_fail(run, message, None, true);
        } else {
            self.fail_run(run, StopCondition::StreamIdle(limit));
        }
    }

    /// The whole request took `request_timeout`: a stream that keeps producing output (or
    /// keeps producing it too slowly) must still end. Retried like a stall while nothing was
    /// shown; otherwise the run fails.
    fn on_model_deadline(&mut self, run: RunId, id: TimerId) {
        let Some(call) = self.runs.get_mut(&run).and_then(|s| s.model.call_mut()) else {
            return;
        };
        if call.deadline != id {
            return;
        }
        let message = format!(
            "the model request took longer than {} s",
            self.config.request_timeout.as_secs_f64()
        );
        if let Some(mut call) = self.runs.get_mut(&run).and_then(|s| s.model.take_call()) {
            self.release_model(&mut call);
        }
        self.retry_or_fail(run, message, None, true);
    }

    // ---- tools ---------------------------------------------------------------------------

    /// Starts an allowed call the host left to us, where its row in the tool table says it
    /// runs.
    fn start_tool(&mut self, run: RunId, call: ToolCall) {
        let Some(slot) = self.runs.get_mut(&run) else {
            return;
        };
        let workspace = slot.workspace.clone();
        let runs = match table::lookup(&call.name) {
            Some(tool) => tool.runs,
            None => {
                let output = ToolOutput::error(format!("unknown tool `{}`", call.name));
                let effects = slot.run.on_tool_done(&call.id, output, Instant::now());
                self.push_effects(run, effects);
                return;
            }
        };
        let work = match runs {
            Runs::Worker(work) => work,
            Runs::Process(spawn) => {
                if slot.live_processes() >= MAX_LIVE_PROCESSES_PER_RUN || !slot.waiting.is_empty() {
                    slot.waiting.push_back((call, spawn));
                } else {
                    self.start_process(run, call, spawn, &workspace);
                }
                return;
            }
            Runs::Fetch(parse) => {
                match parse(&call.input) {
                    Ok(request) => self.start_fetch(run, call.id, request),
                    Err(refused) => self.tool_done(run, &call.id, refused),
                }
                return;
            }
            Runs::Plan(parse) => {
                let output = match parse(&call.input) {
                    Ok(todos) => {
                        let output = crate::tools::todo::summary(&todos);
                        let event = TurnEvent::PlanUpdate {
                            turn_index: slot.run.turn_index(),
                            tool_use_id: call.id.clone(),
                            todos,
                        };
                        // Shown before the call's end, like the work of any other tool.
                        self.push_effects(run, vec![Effect::Emit(event)]);
                        output
                    }
                    Err(refused) => refused,
                };
                self.tool_done(run, &call.id, output);
                return;
            }
            Runs::Shell(parse) => {
                let output = match parse(&call.input) {
                    Ok(op) => self.shell_op(run, op),
                    Err(refused) => refused,
                };
                self.tool_done(run, &call.id, output);
                // A shell killed gives its place to a waiting call.
                self.admit_waiting(run);
                return;
            }
            Runs::Mcp => {
                self.start_mcp_call(run, call);
                return;
            }
        };
        let tx = self.tx.clone();
        let waker = Arc::clone(&self.waker);
        let tool_use_id = call.id.clone();
        let queued = self.tool_workers.submit(move || {
            let output = work(&call.input, &workspace);
            let _ = tx.send(Completion::Tool {
                run,
                tool_use_id: call.id,
                output,
            });
            let _ = waker.wake();
        });
        if let Err(rejected) = queued {
            // A job the pool did not take can never report; answer for it now rather than
            // leaving the run waiting forever.
            let output = ToolOutput::error(format!("cannot run the tool: {rejected}"));
            if let Some(slot) = self.runs.get_mut(&run) {
                let effects = slot.run.on_tool_done(&tool_use_id, output, Instant::now());
                self.push_effects(run, effects);
            }
        }
    }

    /// Starts waiting process tool calls of `run`, oldest first, while it has places.
    fn admit_waiting(&mut self, run: RunId) {
        loop {
            let Some(slot) = self.runs.get_mut(&run) else {
                return;
            };
            if slot.live_processes() >= MAX_LIVE_PROCESSES_PER_RUN {
                return;
            }
            let Some((call, spawn)) = slot.waiting.pop_front() else {
                return;
            };
            let workspace = slot.workspace.clone();
            self.start_process(run, call, spawn, &workspace);
        }
    }

    /// Spawns a process tool's child and watches its pipes and its deadline on the reactor.
    fn start_process(&mut self, run: RunId, call: ToolCall, spawn: Spawn, workspace: &Path) {
        let Some(slot) = self.runs.get_mut(&run) else {
            return;
        };
        // A background shell is spawned here too, in the run's sandbox: it is confined
        // exactly as a foreground command is.
        let mode = slot.run.sandbox_for(&call.id);
        match spawn(&call.input, workspace, mode) {
            Ok(job) if job.is_background() => {
                let output = self.start_shell(run, &call, job);
                self.tool_done(run, &call.id, output);
            }
            Ok(mut job) => {
                let tokens = [self.reactor.token(), self.reactor.token()];
                if let Err(e) = job.register(self.reactor.registry(), tokens[0], tokens[1]) {
                    job.kill("could not watch the process");
                    job.reap_blocking();
                    let effects = slot.run.on_tool_done(
                        &call.id,
                        ToolOutput::error(format!("{}: cannot watch pipes: {e}", call.name)),
                        Instant::now(),
                    );
                    self.push_effects(run, effects);
                    return;
                }
                self.owners
                    .insert(tokens[0], Owner::BashOut(run, call.id.clone()));
                self.owners
                    .insert(tokens[1], Owner::BashErr(run, call.id.clone()));
                let timeout = self.reactor.add_timer(job.timeout);
                self.timers
                    .insert(timeout, TimerOwner::BashTimeout(run, call.id.clone()));
                slot.bash.insert(
                    call.id,
                    BashTask {
                        job,
                        tokens,
                        timeout,
                        grace: None,
                    },
                );
            }
            Err(output) => {
                let effects = slot.run.on_tool_done(&call.id, output, Instant::now());
                self.push_effects(run, effects);
            }
        }
    }

    /// Feeds a tool's result to its run.
    fn tool_done(&mut self, run: RunId, tool_use_id: &str, output: ToolOutput) {
        if let Some(slot) = self.runs.get_mut(&run) {
            let effects = slot.run.on_tool_done(tool_use_id, output, Instant::now());
            self.push_effects(run, effects);
        }
    }

    /// Sends an MCP server's tool call; its answer comes back as a `HubEvent::CallDone`.
    fn start_mcp_call(&mut self, run: RunId, call: ToolCall) {
        let Some(servers) = self.runs.get(&run).map(|s| s.mcp.clone()) else {
            return;
        };
        let key = mcp_client::client::CallKey {
            run: run.0,
            tool_use_id: call.id.clone(),
        };
        let (hub, mut io) = self.mcp_io();
        if let Err(output) = hub.call(&mut io, &servers, key, &call.name, &call.input)
            && let Some(slot) = self.runs.get_mut(&run)
        {
            let effects = slot.run.on_tool_done(&call.id, output, Instant::now());
            self.push_effects(run, effects);
        }
    }

    // ---- background shells ---------------------------------------------------------------

    /// Keeps a job started with `background: true` as a shell of the run, watching its
    /// pipes; the answer is the call's result.
    fn start_shell(&mut self, run: RunId, call: &ToolCall, mut job: BashJob) -> ToolOutput {
        let Some(slot) = self.runs.get_mut(&run) else {
            return ToolOutput::error("the run is gone");
        };
        if slot.shells.len() >= MAX_SHELLS_PER_RUN {
            // The lowest-numbered finished shell is the oldest (the map's order is the ids'
            // text, not their numbers).
            let oldest_finished = slot
                .shells
                .iter()
                .filter(|(_, shell)| shell.job.exited())
                .min_by_key(|(id, _)| shell_number(id))
                .map(|(id, _)| id.clone());
            match oldest_finished.and_then(|id| slot.shells.remove(&id)) {
                Some(mut gone) => {
                    release_shell(&mut self.owners, self.reactor.registry(), &mut gone);
                }
                None => {
                    job.kill("too many background shells");
                    job.reap_blocking();
                    return ToolOutput::error(format!(
                        "Bash: {MAX_SHELLS_PER_RUN} background shells are running; stop one \
                         with KillShell first"
                    ));
                }
            }
        }
        slot.shells_started += 1;
        let id = format!("shell_{}", slot.shells_started);
        let tokens = [self.reactor.token(), self.reactor.token()];
        if let Err(e) = job.register(self.reactor.registry(), tokens[0], tokens[1]) {
            job.kill("could not watch the process");
            job.close_pipes(self.reactor.registry());
            job.reap_blocking();
            return ToolOutput::error(format!("Bash: cannot watch pipes: {e}"));
        }
        self.owners
            .insert(tokens[0], Owner::ShellOut(run, id.clone()));
        self.owners
            .insert(tokens[1], Owner::ShellErr(run, id.clone()));
        slot.shells.insert(
            id.clone(),
            ShellTask {
                job,
                tokens,
                read_at: 0,
                released: false,
            },
        );
        let command = call.input["command"].as_str().unwrap_or_default();
        ToolOutput::ok(format!(
            "Started background shell {id}: {command}\nRead its output with BashOutput \
             (shell_id \"{id}\") and stop it with KillShell; it is killed when the run ends."
        ))
    }

    /// Reads what waits in a shell's pipes (one, or both when `None`), and lets its pipes go
    /// once it has exited and they are drained.
    fn on_shell_ready(&mut self, run: RunId, id: &str, stream: Option<Stream>) {
        let Some(shell) = self.runs.get_mut(&run).and_then(|s| s.shells.get_mut(id)) else {
            return;
        };
        let registry = self.reactor.registry();
        match stream {
            Some(stream) => shell.job.drain(registry, stream),
            None => {
                shell.job.drain(registry, Stream::Stdout);
                shell.job.drain(registry, Stream::Stderr);
            }
        }
        let exited = shell.job.exited();
        if shell.job.is_complete() {
            release_shell(&mut self.owners, registry, shell);
        }
        if exited {
            self.admit_waiting(run);
        }
    }

    /// Answers `BashOutput` and `KillShell`.
    fn shell_op(&mut self, run: RunId, op: ShellOp) -> ToolOutput {
        let (tool, id) = match &op {
            ShellOp::Output { shell_id, .. } => ("BashOutput", shell_id.clone()),
            ShellOp::Kill { shell_id } => ("KillShell", shell_id.clone()),
        };
        // The freshest answer includes what is waiting in the pipes right now.
        self.on_shell_ready(run, &id, None);
        let Some(slot) = self.runs.get_mut(&run) else {
            return ToolOutput::error("the run is gone");
        };
        let known = || {
            let ids: Vec<&str> = slot.shells.keys().map(String::as_str).collect();
            if ids.is_empty() {
                "this run has started none".to_owned()
            } else {
                format!("this run's shells: {}", ids.join(", "))
            }
        };
        if !slot.shells.contains_key(&id) {
            return ToolOutput::error(format!("{tool}: no background shell `{id}`; {}", known()));
        }
        let Some(shell) = slot.shells.get_mut(&id) else {
            return ToolOutput::error(format!("{tool}: no background shell `{id}`"));
        };
        match op {
            ShellOp::Output { since, .. } => {
                let read = shell.job.shell_output(since.unwrap_or(shell.read_at));
                shell.read_at = read.to;
                let mut text = format!("{id}: {}\n", shell.job.shell_state());
                if read.lost > 0 {
                    text.push_str(&format!(
                        "[{} bytes before offset {} were dropped: only the latest {} KiB are \
                         kept]\n",
                        read.lost,
                        read.from,
                        SHELL_BUFFER_CAP / 1024
                    ));
                }
                if read.text.is_empty() {
                    text.push_str("[no new output]\n");
                } else {
                    text.push_str(&read.text);
                    if !read.text.ends_with('\n') {
                        text.push('\n');
                    }
                    // A background shell is confined as a foreground command is; the model
                    // hears why a write failed the same way (no retry prompt: the shell is
                    // already running).
                    if let Some(note) = shell.job.sandbox_note(&read.text) {
                        text.push_str(&format!("[sandbox: {note}]\n"));
                    }
                }
                if read.to < read.total {
                    text.push_str(&format!(
                        "[bytes {}-{} of {}; more waits: call BashOutput with since_offset {}]",
                        read.from, read.to, read.total, read.to
                    ));
                } else {
                    text.push_str(&format!(
                        "[bytes {}-{} of {}; next since_offset {}]",
                        read.from, read.to, read.total, read.to
                    ));
                }
                ToolOutput::ok(text)
            }
            ShellOp::Kill { .. } => {
                if shell.job.exited() {
                    return ToolOutput::ok(format!(
                        "{id} had already ended ({}); nothing to kill",
                        shell.job.shell_state()
                    ));
                }
                shell.job.kill("KillShell");
                shell.job.reap_blocking();
                // What it wrote before it died stays readable.
                let registry = self.reactor.registry();
                shell.job.drain(registry, Stream::Stdout);
                shell.job.drain(registry, Stream::Stderr);
                release_shell(&mut self.owners, registry, shell);
                let total = shell.job.shell_output(u64::MAX).total;
                ToolOutput::ok(format!(
                    "Killed {id} and every process it started; its {total} bytes of output stay \
                     readable with BashOutput."
                ))
            }
        }
    }

    // ---- WebFetch ------------------------------------------------------------------------

    /// Starts (or, after a same-site redirect, restarts) a `WebFetch` call's GET.
    fn start_fetch(&mut self, run: RunId, tool_use_id: String, request: FetchRequest) {
        let block_private = self.config.webfetch_block_private;
        if block_private && let Some(why) = blocked_host(&request.target.host) {
            let output = ToolOutput::error(format!("WebFetch: {why}"));
            return self.tool_done(run, &tool_use_id, output);
        }
        let proxy =
            match crate::http::client::proxy_for(&request.target, &|name| std::env::var(name).ok())
            {
                Ok(proxy) => proxy,
                Err(e) => {
                    return self.tool_done(
                        run,
                        &tool_use_id,
                        ToolOutput::error(format!("WebFetch: {e}")),
                    );
                }
            };
        let tls = if request.target.tls {
            match self.web_tls() {
                Ok(tls) => Some(tls),
                Err(e) => {
                    let output = ToolOutput::error(format!("WebFetch: TLS: {e}"));
                    return self.tool_done(run, &tool_use_id, output);
                }
            }
        } else {
            None
        };
        let Some(slot) = self.runs.get_mut(&run) else {
            return;
        };
        let token = self.reactor.token();
        let proxied = proxy.is_some();
        let exchange = Exchange::new(
            token,
            request.target.clone(),
            proxy,
            tls,
            request.request_bytes(),
        );
        let (host, port) = exchange.dial_target();
        let deadline = self.reactor.add_timer(request.timeout);
        self.timers
            .insert(deadline, TimerOwner::Fetch(run, tool_use_id.clone()));
        self.owners
            .insert(token, Owner::Fetch(run, tool_use_id.clone()));
        slot.fetches.insert(
            tool_use_id.clone(),
            FetchTask {
                request,
                exchange,
                guard_addresses: block_private && !proxied,
                deadline,
                status: None,
                headers: Vec::new(),
                body: Vec::new(),
            },
        );
        let id = tool_use_id.clone();
        let done = move |result| Completion::FetchResolved {
            run,
            tool_use_id: id,
            token,
            result,
        };
        if let Some(now) = self.look_up(host, port, done) {
            self.on_fetch_resolved(run, &tool_use_id, token, now);
        }
    }

    /// The roots and settings `WebFetch` trusts: the model client's, or loaded once.
    fn web_tls(&mut self) -> Result<Arc<rustls::ClientConfig>, String> {
        if let Some(tls) = self.web_tls.as_ref().or(self.config.provider.tls.as_ref()) {
            return Ok(Arc::clone(tls));
        }
        // Once per process: reading the system's CA bundle is the one blocking step.
        let (tls, _) = crate::transport::client_config()?;
        self.web_tls = Some(Arc::clone(&tls));
        Ok(tls)
    }

    fn on_fetch_resolved(
        &mut self,
        run: RunId,
        id: &str,
        token: Token,
        result: Result<Vec<std::net::SocketAddr>, String>,
    ) {
        let Some(task) = self
            .runs
            .get_mut(&run)
            .and_then(|s| s.fetches.get_mut(id))
            .filter(|t| t.exchange.token() == token)
        else {
            return;
        };
        // Judged on what is dialled, so a name that resolves (or rebinds) to 127.0.0.1 is
        // refused like the address itself.
        let result = match result {
            Ok(addrs) if task.guard_addresses => {
                let blocked = addrs
                    .iter()
                    .find_map(|a| crate::netaddr::class(a.ip()).map(|class| (a.ip(), class)));
                match blocked {
                    Some((ip, class)) => Err(format!(
                        "`{}` resolves to {ip}, a {class} address, which \
                         webfetch.block_private refuses",
                        task.request.target.host
                    )),
                    None => Ok(addrs),
                }
            }
            other => other,
        };
        let mut events = Vec::new();
        task.exchange
            .on_resolved(self.reactor.registry(), result, &mut events);
        self.on_fetch_events(run, id, events);
    }

    fn on_fetch_ready(&mut self, run: RunId, id: &str) {
        let Some(task) = self.runs.get_mut(&run).and_then(|s| s.fetches.get_mut(id)) else {
            return;
        };
        let mut events = Vec::new();
        task.exchange.on_ready(self.reactor.registry(), &mut events);
        self.on_fetch_events(run, id, events);
    }

    fn on_fetch_events(&mut self, run: RunId, id: &str, events: Vec<ClientEvent>) {
        for event in events {
            let Some(task) = self.runs.get_mut(&run).and_then(|s| s.fetches.get_mut(id)) else {
                return;
            };
            match event {
                ClientEvent::Head(head) => {
                    task.status = Some(head.status);
                    task.headers = head.headers;
                }
                ClientEvent::Body(bytes) => {
                    let room = MAX_FETCH_BODY - task.body.len();
                    task.body.extend_from_slice(&bytes[..room.min(bytes.len())]);
                    if bytes.len() > room {
                        // Enough: the rest is never read.
                        return self.finish_fetch(run, id, true);
                    }
                }
                ClientEvent::End => return self.finish_fetch(run, id, false),
                ClientEvent::Failed { error, .. } => {
                    let output =
                        ToolOutput::error(format!("WebFetch: {}: {error}", task.request.url));
                    return self.end_fetch(run, id, output);
                }
            }
        }
    }

    /// The response is complete (or `cut` at the cap): follow a same-site redirect, or
    /// answer with the page.
    fn finish_fetch(&mut self, run: RunId, id: &str, cut: bool) {
        let Some(task) = self.runs.get(&run).and_then(|s| s.fetches.get(id)) else {
            return;
        };
        let status = task.status.unwrap_or(0);
        let output = if (300..400).contains(&status) && status != 304 {
            match task.request.redirect(status, task.header("location")) {
                Ok(next) => {
                    self.end_fetch_quietly(run, id);
                    return self.start_fetch(run, id.to_owned(), next);
                }
                Err(output) => output,
            }
        } else {
            let content_type = task.header("content-type").unwrap_or_default();
            task.request.render(status, content_type, &task.body, cut)
        };
        self.end_fetch(run, id, output);
    }

    /// Drops a fetch's connection, token and deadline.
    fn end_fetch_quietly(&mut self, run: RunId, id: &str) -> bool {
        let Some(mut task) = self.runs.get_mut(&run).and_then(|s| s.fetches.remove(id)) else {
            return false;
        };
        task.exchange.close(self.reactor.registry());
        self.owners.remove(&task.exchange.token());
        self.timers.remove(&task.deadline);
        self.reactor.cancel_timer(task.deadline);
        true
    }

    /// Ends a fetch with its result for the model.
    fn end_fetch(&mut self, run: RunId, id: &str, output: ToolOutput) {
        if self.end_fetch_quietly(run, id) {
            self.tool_done(run, id, output);
        }
    }

    fn on_completion(&mut self, done: Completion) {
        match done {
            Completion::FetchResolved {
                run,
                tool_use_id,
                token,
                result,
            } => self.on_fetch_resolved(run, &tool_use_id, token, result),
            Completion::McpResolved {
                server,
                exchange,
                result,
            } => {
                let (hub, mut io) = self.mcp_io();
                let events = hub.on_resolved(&mut io, server, exchange, result);
                self.on_hub_events(events);
            }
            Completion::Resolved { run, token, result } => self.on_resolved(run, token, result),
            Completion::Tool {
                run,
                tool_use_id,
                output,
            } => {
                if let Some(slot) = self.runs.get_mut(&run) {
                    let effects = slot.run.on_tool_done(&tool_use_id, output, Instant::now());
                    self.push_effects(run, effects);
                }
            }
        }
    }

    fn on_bash_ready(&mut self, run: RunId, tool: &str, stream: Stream) {
        if let Some(task) = self.runs.get_mut(&run).and_then(|s| s.bash.get_mut(tool)) {
            task.job.drain(self.reactor.registry(), stream);
        }
        self.maybe_finish_bash(run, tool);
    }

    fn reap_children(&mut self) {
        let mut check = Vec::new();
        let mut shells = Vec::new();
        for (run_id, slot) in self.runs.iter_mut() {
            for (tool, task) in slot.bash.iter_mut() {
                if !task.job.exited() && task.job.try_reap() {
                    check.push((*run_id, tool.clone()));
                }
            }
            for (id, shell) in slot.shells.iter_mut() {
                if !shell.job.exited() && shell.job.try_reap() {
                    shells.push((*run_id, id.clone()));
                }
            }
        }
        for (run, tool) in check {
            self.maybe_finish_bash(run, &tool);
        }
        for (run, id) in shells {
            self.on_shell_ready(run, &id, None);
        }
        // Processes caliban adopted: reap those that exited, kill those of calls now over.
        reaper::sweep(Sweep::Ended);
    }

    fn maybe_finish_bash(&mut self, run: RunId, tool: &str) {
        let Some(slot) = self.runs.get_mut(&run) else {
            return;
        };
        let Some(task) = slot.bash.get_mut(tool) else {
            return;
        };
        if !task.job.exited() {
            return;
        }
        if !task.job.is_complete() {
            if task.grace.is_none() {
                let timer = self.reactor.add_timer(PIPE_GRACE);
                task.grace = Some(timer);
                self.timers
                    .insert(timer, TimerOwner::BashGrace(run, tool.to_owned()));
            }
            return;
        }
        let Some(task) = slot.bash.remove(tool) else {
            return;
        };
        let (output, sandboxed) = task.job.result();
        self.forget_bash(&task);
        self.admit_waiting(run);
        if let Some(slot) = self.runs.get_mut(&run) {
            let effects = match sandboxed {
                Some(why) => slot
                    .run
                    .on_tool_sandboxed(tool, output, &why, Instant::now()),
                None => slot.run.on_tool_done(tool, output, Instant::now()),
            };
            self.push_effects(run, effects);
        }
    }

    fn forget_bash(&mut self, task: &BashTask) {
        for token in task.tokens {
            self.owners.remove(&token);
        }
        self.timers.remove(&task.timeout);
        self.reactor.cancel_timer(task.timeout);
        if let Some(grace) = task.grace {
            self.timers.remove(&grace);
            self.reactor.cancel_timer(grace);
        }
    }

    /// Stops the model stream and kills every tool process of a run (cancel or end).
    fn abort_work(&mut self, run: RunId) {
        let Some(slot) = self.runs.get_mut(&run) else {
            return;
        };
        let model = std::mem::replace(&mut slot.model, ModelState::Idle);
        let tasks: Vec<BashTask> = slot.bash.drain().map(|(_, t)| t).collect();
        // Calls still waiting for a place never start.
        slot.waiting.clear();
        let shells = std::mem::take(&mut slot.shells);
        let fetches: Vec<String> = slot.fetches.keys().cloned().collect();
        if let McpWait::Waiting(timer) = slot.mcp_wait {
            slot.mcp_wait = McpWait::Idle;
            self.timers.remove(&timer);
            self.reactor.cancel_timer(timer);
        }
        if !slot.mcp.is_empty() {
            let (hub, mut io) = self.mcp_io();
            hub.cancel_run(&mut io, run.0);
        }
        match model {
            ModelState::InFlight(mut call) => self.release_model(&mut call),
            ModelState::Backoff(timer) => {
                self.timers.remove(&timer);
                self.reactor.cancel_timer(timer);
            }
            ModelState::Idle => {}
        }
        for mut task in tasks {
            task.job.kill("cancelled");
            task.job.close_pipes(self.reactor.registry());
            task.job.reap_blocking();
            self.forget_bash(&task);
        }
        for id in fetches {
            self.end_fetch_quietly(run, &id);
        }
        // Background shells live as long as their run.
        for (_, mut shell) in shells {
            shell.job.kill("the run ended");
            release_shell(&mut self.owners, self.reactor.registry(), &mut shell);
            shell.job.reap_blocking();
        }
    }

    /// Gives the `DELETE`s that end stopped MCP servers' HTTP sessions (`shutdown` sent
    /// them) at most `EXIT_SESSION_WAIT`, running only the hub's part of the loop: nothing
    /// else is left to answer, and exit must stay prompt.
    fn end_mcp_sessions(&mut self) -> std::io::Result<()> {
        let deadline = Instant::now() + mcp_client::EXIT_SESSION_WAIT;
        let mut wakes = Vec::new();
        while self.mcp.ending() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            wakes.clear();
            self.reactor.wait(&mut wakes, Some(left))?;
            for wake in wakes.drain(..) {
                match wake {
                    Wake::Io { token, .. } => {
                        if let Some(Owner::Mcp(server, source)) = self.owners.get(&token) {
                            let (server, source) = (*server, *source);
                            let (hub, mut io) = self.mcp_io();
                            hub.on_ready(&mut io, server, source);
                        }
                    }
                    Wake::Timer(id) => {
                        if let Some(TimerOwner::Mcp(server, alarm)) = self.timers.remove(&id) {
                            let (hub, mut io) = self.mcp_io();
                            hub.on_timer(&mut io, server, alarm);
                        }
                    }
                    Wake::Woken => {
                        while let Ok(done) = self.rx.try_recv() {
                            if let Completion::McpResolved {
                                server,
                                exchange,
                                result,
                            } = done
                            {
                                let (hub, mut io) = self.mcp_io();
                                hub.on_resolved(&mut io, server, exchange, result);
                            }
                        }
                    }
                    Wake::Signal(_) => {}
                }
            }
        }
        Ok(())
    }

    fn shutdown(&mut self) {
        let ids: Vec<RunId> = self.runs.keys().copied().collect();
        for run in ids {
            self.abort_work(run);
        }
        let (hub, mut io) = self.mcp_io();
        hub.stop_all(&mut io);
        // Nothing is left to answer: the hub's last events are dropped.
        self.mcp.take_early();
        // Idle connections are simply closed: no request is on them, nothing waits.
        self.pool.clear();
    }
}

impl<K: HostKey> Drop for Engine<K> {
    /// However the engine goes away (an error return, a panic unwinding), no tool process
    /// outlives it.
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Closes a shell's pipes and forgets their tokens (once).
fn release_shell<K>(
    owners: &mut HashMap<Token, Owner<K>>,
    registry: &mio::Registry,
    shell: &mut ShellTask,
) {
    if shell.released {
        return;
    }
    shell.released = true;
    shell.job.close_pipes(registry);
    for token in shell.tokens {
        owners.remove(&token);
    }
}

/// `shell_7` → 7, for telling which shell is older.
fn shell_number(id: &str) -> u64 {
    id.strip_prefix("shell_")
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// A cheap jitter source for backoff; it only needs to de-synchronise clients.
fn jitter() -> f64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    f64::from(nanos % 1000) / 1000.0
}
