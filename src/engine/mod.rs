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
//!
//! This file is the loop and effect dispatch; each kind of work has its owner beside it:
//! `call` (the model exchange, retry and backoff, the idle-connection pool), `procs`
//! (`Bash` processes, background shells, reaping, a run's work cancelled), `fetch`
//! (`WebFetch`) and `mcp` (the hub's glue). An owner keeps its state in a type of its own
//! and reaches the reactor only through a narrow view (`Reach`; the hub through `McpIo`),
//! so its logic is unit-tested on a fake (`fake::FakeReach`) without a reactor. The loop
//! itself is tested whole (`loop_tests`): a real reactor, a recording host, loopback models.

mod call;
mod fetch;
mod mcp;
mod procs;

#[cfg(test)]
mod fake;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::time::{Duration, Instant};

use mio::Token;
use mio::Waker;

use crate::agent::event::{StopCondition, TurnEvent};
use crate::agent::run::{Effect, Run, ToolCall};
use crate::ids::{HostKey, RunId};
use crate::mcp_client::{self, Alarm, Hub, Selection, ServerId, Source};
use crate::model::Provider;
use crate::model::retry::RetryPolicy;
use crate::model::types::ContentBlock;
use crate::reactor::{Reactor, Signal, TimerId, Wake};
use crate::sandbox;
use crate::stdio::{Stdin, StdinItem, Stdout};
use crate::tools::ToolOutput;
use crate::tools::bash::Stream;
use crate::tools::table::{self, Runs};
use crate::transport::Conn;
use crate::workers::Pool;

use call::{ModelState, Retries, Warm};
use fetch::FetchTask;
use mcp::{Lookups, McpIo, RunMcp};
use procs::Procs;

/// After a signal, how long a stalled stdout reader may hold up exit.
const STDOUT_GRACE_AFTER_SIGNAL: Duration = Duration::from_millis(200);
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
    io: &'a mut Routing<K>,
    actions: &'a mut VecDeque<HostAction>,
    stats: Stats,
    mcp: &'a mut Hub,
    lookups: Lookups<'a>,
}

impl<K: HostKey> Ctx<'_, K> {
    pub fn registry(&self) -> &mio::Registry {
        self.io.registry()
    }

    /// A token whose readiness is delivered to `Host::on_io(key)`.
    pub fn host_token(&mut self, key: K) -> Token {
        self.io.token(Owner::Host(key))
    }

    pub fn forget_token(&mut self, token: Token) {
        self.io.forget(token);
    }

    /// A timer delivered to `Host::on_timer(key)`.
    pub fn add_timer(&mut self, after: Duration, key: K) -> TimerId {
        self.io.timer(after, TimerOwner::Host(key))
    }

    pub fn cancel_timer(&mut self, id: TimerId) {
        self.io.cancel(id);
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
    fn mcp_io(&mut self) -> (&mut Hub, McpIo<'_, Routing<K>>) {
        let io = McpIo {
            reach: &mut *self.io,
            lookups: self.lookups,
        };
        (&mut *self.mcp, io)
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

/// The reactor as an owner (`call`, `procs`, `fetch`) sees it: tokens and timers named by
/// the work they belong to, which the loop routes back, and the registry its sources join.
/// Nothing more, so an owner's logic runs in a unit test on a fake (`fake::FakeReach`).
trait Reach {
    /// The host's key type (`Host::Key`), which `Owner::Host` and `TimerOwner::Host` carry.
    type Key;
    fn registry(&self) -> &mio::Registry;
    fn token(&mut self, owner: Owner<Self::Key>) -> Token;
    fn forget(&mut self, token: Token);
    fn timer(&mut self, after: Duration, owner: TimerOwner<Self::Key>) -> TimerId;
    fn cancel(&mut self, id: TimerId);
}

/// The reactor and who each of its tokens and timers belongs to: an `Engine` field of its
/// own, so an owner can be lent it (`Reach`) while the run's slot is borrowed too.
struct Routing<K> {
    reactor: Reactor,
    owners: HashMap<Token, Owner<K>>,
    timers: HashMap<TimerId, TimerOwner<K>>,
}

impl<K> Reach for Routing<K> {
    type Key = K;

    fn registry(&self) -> &mio::Registry {
        self.reactor.registry()
    }

    fn token(&mut self, owner: Owner<K>) -> Token {
        let token = self.reactor.token();
        self.owners.insert(token, owner);
        token
    }

    fn forget(&mut self, token: Token) {
        self.owners.remove(&token);
    }

    fn timer(&mut self, after: Duration, owner: TimerOwner<K>) -> TimerId {
        let id = self.reactor.add_timer(after);
        self.timers.insert(id, owner);
        id
    }

    fn cancel(&mut self, id: TimerId) {
        self.timers.remove(&id);
        self.reactor.cancel_timer(id);
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

struct RunSlot {
    run: Run,
    workspace: PathBuf,
    model: ModelState,
    retries: Retries,
    /// Its commands, background shells and the process calls waiting for a place.
    procs: Procs,
    /// `WebFetch` calls in flight, by tool_use_id.
    fetches: HashMap<String, FetchTask>,
    /// Its MCP servers, and whether its model request waits for their tool lists.
    mcp: RunMcp,
}

impl RunSlot {
    fn new(run: Run, workspace: PathBuf, mcp: Vec<ServerId>, mcp_all: bool) -> RunSlot {
        // The file tools hold this directory from now on, so a command that later renames
        // it and puts a symlink in its place (a workspace in a temp dir it may write) does
        // not move them with it.
        crate::tools::beneath::pin(&workspace);
        RunSlot {
            run,
            workspace,
            model: ModelState::Idle,
            retries: Retries::default(),
            procs: Procs::default(),
            fetches: HashMap::new(),
            mcp: RunMcp::new(mcp, mcp_all),
        }
    }
}

pub struct Engine<K: HostKey> {
    io: Routing<K>,
    config: EngineConfig,
    runs: BTreeMap<RunId, RunSlot>,
    /// Servers `mcp_select` started ahead of a run, for the next run started with that
    /// selection.
    selected: Option<(Selection, Vec<crate::mcp_client::ServerId>)>,
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
    /// Idle model connections, for the next model request of any run.
    pool: Warm<Conn>,
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
            io: Routing {
                reactor,
                owners: HashMap::new(),
                timers: HashMap::new(),
            },
            config,
            runs: BTreeMap::new(),
            selected: None,
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
            pool: Warm::new(idle_connections),
        })
    }

    pub fn attach_stdin(&mut self) -> std::io::Result<()> {
        let token = self.io.reactor.token();
        let stdin = Stdin::attach(self.io.reactor.registry(), token, self.io.reactor.waker())?;
        self.io.owners.insert(token, Owner::Stdin);
        self.stdin = Some(stdin);
        Ok(())
    }

    pub fn attach_stdout(&mut self) {
        let token = self.io.reactor.token();
        self.stdout = Some(Stdout::attach(self.io.reactor.registry(), token));
        self.io.owners.insert(token, Owner::Stdout);
    }

    /// Queues actions to perform when the loop starts (e.g. the first prompt).
    pub fn push_action(&mut self, action: HostAction) {
        self.actions.push_back(action);
    }

    fn ctx(&mut self) -> Ctx<'_, K> {
        Ctx {
            io: &mut self.io,
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
            self.io.reactor.wait(&mut wakes, None)?;
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
            Wake::Io { token, .. } => match self.io.owners.get(&token) {
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
        stdin.drain(self.io.reactor.registry(), &mut items);
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
                    .filter(|(_, s)| s.mcp.joins(&name, |id| self.mcp.name(id)))
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
                        slot.mcp.servers.extend(started.iter().copied());
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
                    slot.retries.reset();
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

    fn on_timer(&mut self, id: TimerId, host: &mut impl Host<Key = K>) {
        let Some(owner) = self.io.timers.remove(&id) else {
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
            TimerOwner::PoolIdle => self.pool.on_timer(&mut self.io, Instant::now()),
            TimerOwner::Model(run) => self.on_model_timer(run, id),
            TimerOwner::ModelDeadline(run) => self.on_model_deadline(run, id),
            TimerOwner::Backoff(run) => self.on_backoff(run, id),
            TimerOwner::BashTimeout(run, tool) => self.on_bash_timeout(run, &tool),
            TimerOwner::Fetch(run, id) => self.on_fetch_timeout(run, &id),
            TimerOwner::BashGrace(run, tool) => self.on_bash_grace(run, &tool),
        }
    }

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
                self.start_process(run, call, spawn);
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
                    Ok(op) => self.shell_op(run, &call.name, op),
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

    /// Feeds a tool's result to its run.
    fn tool_done(&mut self, run: RunId, tool_use_id: &str, output: ToolOutput) {
        if let Some(slot) = self.runs.get_mut(&run) {
            let effects = slot.run.on_tool_done(tool_use_id, output, Instant::now());
            self.push_effects(run, effects);
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

#[cfg(test)]
mod loop_tests;
