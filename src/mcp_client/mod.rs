//! caliban as an MCP client, for every surface: the servers a run may call, their
//! connections on the engine's reactor (no thread per server), and the calls in flight.
//!
//! - `config`: where servers are configured (settings, `.mcp.json`, `--mcp-config`, ACP's
//!   `session/new`) and how; `approval`: project-scoped servers need the user's approval.
//! - `client`: the protocol (sans-IO): handshake, tool lists, calls, progress, cancellation.
//! - `stdio`, `http`: the transports (a child's pipes; Streamable HTTP and legacy HTTP+SSE
//!   over `http::client::Exchange`).
//! - `Hub` (here): every server of the process, keyed by `ServerId`. The engine owns it and
//!   lends it an `Io` (tokens, timers, DNS) in each call; it answers with `HubEvent`s.
//!
//! Which servers a run sees is its `Selection`: the configured servers (all, or the ones a
//! client named per run) plus servers a surface started for it (an ACP session's). A
//! configured server is started when the first run that selects it starts, and shared by
//! every run after it; one that died is reported once and started afresh by the next run
//! that selects it.

pub mod approval;
pub mod client;
pub mod config;
pub mod http;
pub mod stdio;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::time::Duration;

use mio::{Registry, Token};
use serde_json::Value;

use crate::log;
use crate::model::types::ToolSpec;
use crate::reactor::TimerId;
use crate::tools::ToolOutput;
use client::{CallKey, Client, Event, Phase};
use config::{ServerConfig, Transport};
use http::HttpConn;
use stdio::StdioConn;

/// Default per-call timeout: long enough for a real tool (a build, a search over a large
/// index), short enough that a server that never answers frees its run. A progress
/// notification restarts it.
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(300);
/// How long a run waits, before its first model request, for its servers to list their
/// tools: a run's first turn should see every tool, but one slow server must not hold it.
pub const START_WAIT: Duration = Duration::from_secs(10);
/// Longest a server may take to answer `initialize` and list its tools before it is given
/// up as hung (reported once, restarted by the next run that selects it). It is the call
/// timeout, but never less than `START_WAIT` (a slow start, like `npx` fetching a package,
/// is not a hang) nor more than this: a server that lists nothing for 30 s is not coming.
/// A re-list after `tools/list_changed` has the same deadline; one that misses it is
/// given up and the server keeps offering the tools it listed before (it still answers
/// calls, so killing it would lose more than a stale list does).
pub const LIST_DEADLINE: Duration = Duration::from_secs(30);
/// Longest the `DELETE` that ends an HTTP server's session may take before the connection
/// is simply dropped: the server frees an abandoned session on its own, later.
pub const SESSION_END_DEADLINE: Duration = Duration::from_secs(5);
/// How long a process that is exiting waits for those `DELETE`s: exit stays prompt, and a
/// server on the same machine or network answers well within it.
pub const EXIT_SESSION_WAIT: Duration = Duration::from_secs(1);

/// The user's answer about a workspace server that awaits approval (`Hub::decide`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Approval {
    /// Start it for this process.
    Once,
    /// Start it, and record the approval for the workspace (`approval::Approvals::remember`).
    Always,
    /// Leave it out.
    Refused,
    /// Leave it out, and record that for the workspace (`approval::Approvals::reject`):
    /// it is not asked about again.
    RefusedAlways,
}

/// One server instance (a process, or an HTTP session). A restarted server gets a new id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServerId(pub u64);

/// Which servers a run sees.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Selection {
    /// The configured servers by name; `None` is all of them.
    pub configured: Option<Vec<String>>,
    /// Servers a surface started for this run (an ACP session's), besides the configured.
    pub servers: Vec<ServerId>,
}

/// A source of readiness the engine routes back to `Hub::on_ready`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Source {
    StdioOut,
    StdioIn,
    /// One HTTP exchange of the server's, by number.
    Http(u64),
}

/// A timer the engine routes back to `Hub::on_timer`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Alarm {
    /// Call `request id`'s timeout.
    Call(i64),
    /// The HTTP transport's reconnect delay (a GET stream to resume).
    Reconnect,
    /// The deadline for `initialize` and the first `tools/list` (`Hub::list_deadline`).
    Listing,
    /// The same deadline for re-list number `n` after `tools/list_changed`.
    Relist(u64),
    /// `SESSION_END_DEADLINE` for the `DELETE` of a stopped HTTP server's session.
    SessionEnd,
}

/// What the hub borrows from its owner for one call: the reactor's registry, tokens and
/// timers routed back to it, and DNS lookups (answered with `Hub::on_resolved`).
pub trait Io {
    fn registry(&self) -> &Registry;
    fn token(&mut self, server: ServerId, source: Source) -> Token;
    fn forget_token(&mut self, token: Token);
    fn add_timer(&mut self, after: Duration, server: ServerId, alarm: Alarm) -> TimerId;
    fn cancel_timer(&mut self, id: TimerId);
    /// Looks `host` up off the loop; the answer comes to `Hub::on_resolved(server, n, …)`.
    fn resolve(&mut self, host: String, port: u16, server: ServerId, exchange: u64);
}

/// What the engine must act on.
#[derive(Debug, PartialEq)]
pub enum HubEvent {
    /// A server finished listing its tools (or failed): runs waiting for it may go on.
    Settled,
    /// A call was answered (or failed, or timed out).
    CallDone { key: CallKey, output: ToolOutput },
}

enum Conn {
    Stdio {
        conn: StdioConn,
        tokens: [Token; 2],
    },
    Http(Box<HttpConn>),
    /// An HTTP server let go, whose session's `DELETE` is in flight.
    Ending(Box<HttpConn>, TimerId),
    /// Could not be started, or stopped.
    None,
}

struct Entry {
    config: ServerConfig,
    cwd: PathBuf,
    client: Client,
    conn: Conn,
    /// Call timeouts by request id.
    timers: HashMap<i64, TimerId>,
    /// The listing deadline, while the first tool list is awaited.
    listing: Option<TimerId>,
    /// The deadline of the re-list in flight (`Client::relisting`'s number).
    relisting: Option<(u64, TimerId)>,
    /// The death was logged.
    reported: bool,
}

impl Entry {
    /// Lets the connection go: the process group killed, the HTTP exchanges closed (the
    /// session's `DELETE` sent: `Conn::Ending` until it is answered), every token and timer
    /// forgotten.
    fn disconnect(&mut self, io: &mut impl Io, id: ServerId) {
        for (_, timer) in self.timers.drain() {
            io.cancel_timer(timer);
        }
        if let Some(timer) = self.listing.take() {
            io.cancel_timer(timer);
        }
        if let Some((_, timer)) = self.relisting.take() {
            io.cancel_timer(timer);
        }
        match std::mem::replace(&mut self.conn, Conn::None) {
            Conn::Stdio { mut conn, tokens } => {
                conn.kill(io.registry());
                for t in tokens {
                    io.forget_token(t);
                }
            }
            Conn::Http(mut conn) => {
                if conn.end_session(io, id, &mut self.client) {
                    let timer = io.add_timer(SESSION_END_DEADLINE, id, Alarm::SessionEnd);
                    self.conn = Conn::Ending(conn, timer);
                }
            }
            // Already let go: its `DELETE` goes on (a failed server, now stopped).
            ending @ Conn::Ending(..) => self.conn = ending,
            Conn::None => {}
        }
    }

    /// Moves a session's `DELETE` on; once it is answered (or failed, or its deadline
    /// passed) the connection is gone.
    fn on_ending(&mut self, io: &mut impl Io, id: ServerId, wake: EndingWake) {
        let Conn::Ending(conn, timer) = &mut self.conn else {
            return;
        };
        // Nothing a server says now reaches a run: the client failed when it was let go.
        let _ = match wake {
            EndingWake::Ready(n) => conn.on_ready(io, id, n, &mut self.client),
            EndingWake::Resolved(n, result) => {
                conn.on_resolved(io, id, n, result, &mut self.client)
            }
            EndingWake::Deadline => {
                conn.close(io);
                Vec::new()
            }
        };
        if conn.is_idle() {
            io.cancel_timer(*timer);
            self.conn = Conn::None;
        }
    }
}

/// What moves a session's `DELETE` on (`Entry::on_ending`).
enum EndingWake {
    Ready(u64),
    Resolved(u64, Result<Vec<std::net::SocketAddr>, String>),
    Deadline,
}

/// Every MCP server of the process.
pub struct Hub {
    servers: BTreeMap<ServerId, Entry>,
    next: u64,
    /// The configured servers, and the instance of each that runs now.
    configured: Vec<ServerConfig>,
    running: HashMap<String, ServerId>,
    workspace: PathBuf,
    call_timeout: Duration,
    /// Events produced outside a readiness callback, for the engine's next look.
    early: Vec<HubEvent>,
    /// Servers stopped while their HTTP session's `DELETE` is in flight.
    ending: BTreeMap<ServerId, Entry>,
    /// The workspace's servers the user has not approved (yet), and where an approval
    /// for good is recorded.
    awaiting: Vec<ServerConfig>,
    approvals_file: Option<PathBuf>,
}

impl Hub {
    pub fn new(configured: Vec<ServerConfig>, workspace: PathBuf, call_timeout: Duration) -> Hub {
        Hub {
            servers: BTreeMap::new(),
            next: 1,
            configured,
            running: HashMap::new(),
            workspace,
            call_timeout,
            early: Vec::new(),
            ending: BTreeMap::new(),
            awaiting: Vec::new(),
            approvals_file: None,
        }
    }

    /// Workspace servers that start only once the user approves them (`decide`).
    pub fn await_approval(&mut self, servers: Vec<ServerConfig>, file: Option<PathBuf>) {
        self.awaiting = servers;
        self.approvals_file = file;
    }

    /// The workspace servers still awaiting the user's approval.
    pub fn awaiting(&self) -> &[ServerConfig] {
        &self.awaiting
    }

    /// The user's answer about an awaiting server: approved, it becomes a configured
    /// server, which runs started from now on see; `Always` also records the approval, so
    /// later starts in this workspace need none, and `RefusedAlways` the rejection, so they
    /// do not ask again (a failure to record is the `Err`; the answer holds for this
    /// process all the same).
    pub fn decide(&mut self, name: &str, decision: Approval) -> Result<(), String> {
        let Some(at) = self.awaiting.iter().position(|s| s.name == name) else {
            return Ok(());
        };
        let mut server = self.awaiting.remove(at);
        server.pin(&self.workspace);
        let file =
            || approval::Approvals::new(Vec::new(), Vec::new(), false, self.approvals_file.clone());
        let recorded = match decision {
            Approval::Refused => return Ok(()),
            Approval::RefusedAlways => return file().reject(&self.workspace, &server),
            Approval::Always => file().remember(&self.workspace, &server),
            Approval::Once => Ok(()),
        };
        self.configured.retain(|c| c.name != server.name);
        self.configured.push(server);
        recorded
    }

    /// The servers of a run's selection, starting configured ones not running yet and
    /// restarting those that died.
    pub fn select(&mut self, io: &mut impl Io, selection: &Selection) -> Vec<ServerId> {
        let mut ids = Vec::new();
        let wanted: Vec<ServerConfig> = self
            .configured
            .iter()
            .filter(|c| {
                selection
                    .configured
                    .as_ref()
                    .is_none_or(|names| names.contains(&c.name))
            })
            // A server the surface started for the run under the same name wins.
            .filter(|c| {
                !selection.servers.iter().any(|id| {
                    self.servers
                        .get(id)
                        .is_some_and(|e| e.config.name == c.name)
                })
            })
            .cloned()
            .collect();
        for config in wanted {
            let alive = self
                .running
                .get(&config.name)
                .copied()
                .filter(|id| self.phase(*id) != Phase::Failed);
            let id = match alive {
                Some(id) => id,
                None => {
                    if let Some(old) = self.running.remove(&config.name) {
                        self.stop(io, old);
                    }
                    let id = self.start(io, config.clone(), self.workspace.clone());
                    self.running.insert(config.name.clone(), id);
                    id
                }
            };
            ids.push(id);
        }
        for id in &selection.servers {
            ids.push(self.ensure(io, *id));
        }
        ids
    }

    /// Server `id`, or a fresh instance of it if it died (its calls were answered then).
    pub fn ensure(&mut self, io: &mut impl Io, id: ServerId) -> ServerId {
        match self.servers.get(&id) {
            Some(e) if e.client.phase() == Phase::Failed => {
                let (config, cwd) = (e.config.clone(), e.cwd.clone());
                self.stop(io, id);
                self.start(io, config, cwd)
            }
            _ => id,
        }
    }

    /// How long a server may take to list its tools (see `LIST_DEADLINE`).
    pub fn list_deadline(&self) -> Duration {
        self.call_timeout.clamp(START_WAIT, LIST_DEADLINE)
    }

    pub fn phase(&self, id: ServerId) -> Phase {
        self.servers
            .get(&id)
            .map_or(Phase::Failed, |e| e.client.phase())
    }

    /// Server `id`'s state as Claude Code's print-mode `system/init` frame names it:
    /// `pending` while it starts and lists its tools, then `connected` or `failed`.
    pub fn status(&self, id: ServerId) -> &'static str {
        match self.phase(id) {
            Phase::Starting => "pending",
            Phase::Ready => "connected",
            Phase::Failed => "failed",
        }
    }

    pub fn name(&self, id: ServerId) -> &str {
        self.servers.get(&id).map_or("?", |e| e.client.name())
    }

    /// Whether any of `ids` is still listing its tools (for the first time, or again after
    /// it said they changed).
    pub fn any_listing(&self, ids: &[ServerId]) -> bool {
        ids.iter()
            .any(|id| self.servers.get(id).is_some_and(|e| e.client.is_listing()))
    }

    /// The tools `ids` offer now, in their order.
    pub fn tools(&self, ids: &[ServerId]) -> Vec<ToolSpec> {
        ids.iter()
            .filter_map(|id| self.servers.get(id))
            .flat_map(|e| e.client.tools().iter().cloned())
            .collect()
    }

    /// Starts a server; a server that cannot start is a failed instance (so it is reported
    /// once and its tools are simply missing).
    pub fn start(&mut self, io: &mut impl Io, config: ServerConfig, cwd: PathBuf) -> ServerId {
        let id = ServerId(self.next);
        self.next += 1;
        let mut client = Client::new(&config.name);
        let changed = config.changed_file(&self.workspace);
        let conn = match &config.transport {
            Transport::Stdio { .. } if changed.is_some() => {
                client.fail(&format!(
                    "not started: `{}` changed since the server was approved; approve it \
                     again (`--approve-mcp {}`)",
                    changed.unwrap_or_default(),
                    config.name
                ));
                Conn::None
            }
            Transport::Stdio { command, args, env } => {
                match StdioConn::spawn(command, args, env, &cwd) {
                    Ok(mut conn) => {
                        let tokens = [
                            io.token(id, Source::StdioOut),
                            io.token(id, Source::StdioIn),
                        ];
                        match conn.register(io.registry(), tokens[0], tokens[1]) {
                            Ok(()) => {
                                log::info(&format!(
                                    "MCP server `{}` started (pid {})",
                                    config.name,
                                    conn.pid()
                                ));
                                Conn::Stdio { conn, tokens }
                            }
                            Err(e) => {
                                conn.kill(io.registry());
                                for t in tokens {
                                    io.forget_token(t);
                                }
                                client.fail(&format!("cannot be watched: {e}"));
                                Conn::None
                            }
                        }
                    }
                    Err(e) => {
                        client.fail(&format!("cannot start `{command}`: {e}"));
                        Conn::None
                    }
                }
            }
            Transport::Http { url, headers } => match HttpConn::new(url, headers, false) {
                Ok(conn) => Conn::Http(Box::new(conn)),
                Err(e) => {
                    client.fail(&e);
                    Conn::None
                }
            },
            Transport::Sse { url, headers } => match HttpConn::new(url, headers, true) {
                Ok(conn) => Conn::Http(Box::new(conn)),
                Err(e) => {
                    client.fail(&e);
                    Conn::None
                }
            },
        };
        self.servers.insert(
            id,
            Entry {
                config,
                cwd,
                client,
                conn,
                timers: HashMap::new(),
                listing: None,
                relisting: None,
                reported: false,
            },
        );
        let deadline = self.list_deadline();
        if let Some(entry) = self.servers.get_mut(&id)
            && entry.client.phase() == Phase::Starting
        {
            entry.listing = Some(io.add_timer(deadline, id, Alarm::Listing));
        }
        let mut events = Vec::new();
        self.flush(io, id, &mut events);
        let events = self.after(io, id, events);
        self.early.extend(events);
        id
    }

    /// Stops a server: its process group is killed or its HTTP session ended; open calls
    /// are answered (returned for the engine).
    pub fn stop(&mut self, io: &mut impl Io, id: ServerId) -> Vec<HubEvent> {
        let Some(mut entry) = self.servers.remove(&id) else {
            return Vec::new();
        };
        if self.running.get(&entry.config.name) == Some(&id) {
            self.running.remove(&entry.config.name);
        }
        let events = convert(entry.client.fail("was stopped"));
        entry.disconnect(io, id);
        if matches!(entry.conn, Conn::Ending(..)) {
            self.ending.insert(id, entry);
        }
        events
    }

    /// Whether a stopped server's session `DELETE` is still in flight (an exiting process
    /// gives them `EXIT_SESSION_WAIT`).
    pub fn ending(&self) -> bool {
        !self.ending.is_empty()
            || self
                .servers
                .values()
                .any(|e| matches!(e.conn, Conn::Ending(..)))
    }

    /// Readiness, a lookup or the deadline for a stopped server whose `DELETE` is in
    /// flight; it is forgotten once answered.
    fn on_ending(&mut self, io: &mut impl Io, id: ServerId, wake: EndingWake) {
        let Some(mut entry) = self.ending.remove(&id) else {
            return;
        };
        entry.on_ending(io, id, wake);
        if matches!(entry.conn, Conn::Ending(..)) {
            self.ending.insert(id, entry);
        }
    }

    /// Stops every server (the engine is ending).
    pub fn stop_all(&mut self, io: &mut impl Io) {
        let ids: Vec<ServerId> = self.servers.keys().copied().collect();
        for id in ids {
            self.stop(io, id);
        }
    }

    /// Calls `model_name` on whichever of `ids` offers it. `Err` is the answer now (no such
    /// tool, a dead server); `Ok` means a `HubEvent::CallDone` will come.
    pub fn call(
        &mut self,
        io: &mut impl Io,
        ids: &[ServerId],
        key: CallKey,
        model_name: &str,
        input: &Value,
    ) -> Result<(), ToolOutput> {
        let found = ids.iter().copied().find(|id| {
            self.servers
                .get(id)
                .is_some_and(|e| e.client.has_tool(model_name))
        });
        let Some(id) = found else {
            // A server of the run that offered it may have died since: say so.
            let dead = ids
                .iter()
                .filter_map(|id| self.servers.get(id))
                .find(|e| e.client.phase() == Phase::Failed && e.client.names_server(model_name));
            return Err(ToolOutput::error(match dead {
                Some(e) => format!(
                    "MCP server `{}` is not available: {}",
                    e.client.name(),
                    e.client.failure().unwrap_or("it failed")
                ),
                None => format!("no MCP server of this run offers `{model_name}`"),
            }));
        };
        let Some(entry) = self.servers.get_mut(&id) else {
            return Err(ToolOutput::error("MCP server gone"));
        };
        let request = entry.client.call(key, model_name, input)?;
        let timer = io.add_timer(self.call_timeout, id, Alarm::Call(request));
        entry.timers.insert(request, timer);
        let mut events = Vec::new();
        self.flush(io, id, &mut events);
        let events = self.after(io, id, events);
        if !events.is_empty() {
            // Answered at once (the server failed while sending): the engine still gets a
            // CallDone, through the hub's next batch.
            self.early.extend(events);
        }
        Ok(())
    }

    /// Events the engine should see on its next look (a server stopped from a host).
    pub fn defer(&mut self, events: Vec<HubEvent>) {
        self.early.extend(events);
    }

    /// Events produced outside a readiness callback (a call that failed while being sent).
    pub fn take_early(&mut self) -> Vec<HubEvent> {
        std::mem::take(&mut self.early)
    }

    /// Cancels run `run`'s calls: each server is told with `notifications/cancelled`.
    pub fn cancel_run(&mut self, io: &mut impl Io, run: u64) {
        let ids: Vec<ServerId> = self.servers.keys().copied().collect();
        for id in ids {
            let Some(entry) = self.servers.get_mut(&id) else {
                continue;
            };
            let calls = entry.client.calls_of(run);
            if calls.is_empty() {
                continue;
            }
            for request in calls {
                entry.client.cancel(request, "the run was cancelled");
                if let Some(timer) = entry.timers.remove(&request) {
                    io.cancel_timer(timer);
                }
            }
            let mut events = Vec::new();
            self.flush(io, id, &mut events);
            let events = self.after(io, id, events);
            self.early.extend(events);
        }
    }

    pub fn on_ready(&mut self, io: &mut impl Io, id: ServerId, source: Source) -> Vec<HubEvent> {
        let Some(entry) = self.servers.get_mut(&id) else {
            if let Source::Http(n) = source {
                self.on_ending(io, id, EndingWake::Ready(n));
            }
            return Vec::new();
        };
        let events = match (&mut entry.conn, source) {
            (Conn::Ending(..), Source::Http(n)) => {
                entry.on_ending(io, id, EndingWake::Ready(n));
                return Vec::new();
            }
            (Conn::Stdio { conn, .. }, Source::StdioOut) => {
                conn.read(&mut entry.client, io.registry())
            }
            (Conn::Stdio { conn, .. }, Source::StdioIn) => {
                conn.flush(&mut entry.client, io.registry())
            }
            (Conn::Http(conn), Source::Http(n)) => conn.on_ready(io, id, n, &mut entry.client),
            _ => Vec::new(),
        };
        let mut events = events;
        self.flush(io, id, &mut events);
        self.after(io, id, events)
    }

    pub fn on_resolved(
        &mut self,
        io: &mut impl Io,
        id: ServerId,
        exchange: u64,
        result: Result<Vec<std::net::SocketAddr>, String>,
    ) -> Vec<HubEvent> {
        let Some(entry) = self.servers.get_mut(&id) else {
            self.on_ending(io, id, EndingWake::Resolved(exchange, result));
            return Vec::new();
        };
        let mut events = match &mut entry.conn {
            Conn::Http(conn) => conn.on_resolved(io, id, exchange, result, &mut entry.client),
            Conn::Ending(..) => {
                entry.on_ending(io, id, EndingWake::Resolved(exchange, result));
                return Vec::new();
            }
            _ => Vec::new(),
        };
        self.flush(io, id, &mut events);
        self.after(io, id, events)
    }

    pub fn on_timer(&mut self, io: &mut impl Io, id: ServerId, alarm: Alarm) -> Vec<HubEvent> {
        let deadline = self.list_deadline();
        let Some(entry) = self.servers.get_mut(&id) else {
            if alarm == Alarm::SessionEnd {
                self.on_ending(io, id, EndingWake::Deadline);
            }
            return Vec::new();
        };
        let mut events = Vec::new();
        match alarm {
            Alarm::Call(request) => {
                entry.timers.remove(&request);
                let Some(since) = entry.client.call_active_since(request) else {
                    return Vec::new();
                };
                let quiet = since.elapsed();
                if quiet < self.call_timeout {
                    // Progress came since the timer was armed: push the deadline out.
                    let timer = io.add_timer(self.call_timeout - quiet, id, Alarm::Call(request));
                    entry.timers.insert(request, timer);
                    return Vec::new();
                }
                let secs = self.call_timeout.as_secs_f64();
                if let Some(key) = entry
                    .client
                    .cancel(request, &format!("timed out after {secs} s"))
                {
                    events.push(Event::CallDone {
                        key,
                        output: ToolOutput::error(format!(
                            "MCP server `{}` did not answer within {secs} s (and sent no \
                             progress); the call was cancelled",
                            entry.client.name()
                        )),
                    });
                }
            }
            Alarm::Reconnect => {
                if let Conn::Http(conn) = &mut entry.conn {
                    events.extend(conn.on_reconnect(io, id, &mut entry.client));
                }
            }
            Alarm::SessionEnd => {
                entry.on_ending(io, id, EndingWake::Deadline);
                return Vec::new();
            }
            Alarm::Relist(n) => {
                entry.relisting = None;
                if entry.client.relisting() == Some(n) && entry.client.abandon_relist() {
                    log::warn(&format!(
                        "MCP server `{}` said its tools changed but did not list them again \
                         within {} s; it keeps offering the {} tools it listed before",
                        entry.client.name(),
                        deadline.as_secs(),
                        entry.client.tools().len()
                    ));
                    // Runs waiting for the new list go on with the old one.
                    let mut hub_events = self.after(io, id, events);
                    hub_events.push(HubEvent::Settled);
                    return hub_events;
                }
            }
            Alarm::Listing => {
                entry.listing = None;
                if entry.client.phase() == Phase::Starting {
                    let secs = deadline.as_secs();
                    events.extend(
                        entry
                            .client
                            .fail(&format!("did not list its tools within {secs} s")),
                    );
                }
            }
        }
        self.flush(io, id, &mut events);
        self.after(io, id, events)
    }

    /// Sends what the client queued.
    fn flush(&mut self, io: &mut impl Io, id: ServerId, events: &mut Vec<Event>) {
        let Some(entry) = self.servers.get_mut(&id) else {
            return;
        };
        match &mut entry.conn {
            Conn::Stdio { conn, .. } => events.extend(conn.flush(&mut entry.client, io.registry())),
            Conn::Http(conn) => events.extend(conn.flush(io, id, &mut entry.client)),
            Conn::Ending(..) | Conn::None => while entry.client.take_outgoing().is_some() {},
        }
    }

    /// Turns client events into hub events, reports a death once and lets a dead server's
    /// connection go.
    fn after(&mut self, io: &mut impl Io, id: ServerId, events: Vec<Event>) -> Vec<HubEvent> {
        let Some(entry) = self.servers.get_mut(&id) else {
            return convert(events);
        };
        for event in &events {
            match event {
                Event::Settled if entry.client.phase() == Phase::Ready => {
                    let n = entry.client.tools().len();
                    log::info(&format!(
                        "MCP server `{}` offers {n} tool{}",
                        entry.client.name(),
                        if n == 1 { "" } else { "s" }
                    ));
                }
                Event::ToolsChanged => log::info(&format!(
                    "MCP server `{}` changed its tools; it now offers {}",
                    entry.client.name(),
                    entry.client.tools().len()
                )),
                Event::CallDone { .. } | Event::Settled => {}
            }
        }
        // Listed (or failed): the listing deadline goes.
        if entry.client.phase() != Phase::Starting
            && let Some(timer) = entry.listing.take()
        {
            io.cancel_timer(timer);
        }
        // A re-list begun gets the listing deadline; one that ended lets its deadline go.
        let relisting = entry.client.relisting();
        if entry.relisting.map(|(n, _)| n) != relisting {
            if let Some((_, timer)) = entry.relisting.take() {
                io.cancel_timer(timer);
            }
            if let Some(n) = relisting {
                let deadline = self.call_timeout.clamp(START_WAIT, LIST_DEADLINE);
                entry.relisting = Some((n, io.add_timer(deadline, id, Alarm::Relist(n))));
            }
        }
        // Calls answered: their timers go.
        if events.iter().any(|e| matches!(e, Event::CallDone { .. })) {
            let client = &entry.client;
            let answered: Vec<i64> = entry
                .timers
                .keys()
                .copied()
                .filter(|r| !client.is_pending(*r))
                .collect();
            for r in answered {
                if let Some(t) = entry.timers.remove(&r) {
                    io.cancel_timer(t);
                }
            }
        }
        if entry.client.phase() == Phase::Failed && !entry.reported {
            entry.reported = true;
            log::warn(&format!(
                "MCP server `{}` ({}) {}; its tools are not offered until a later run starts it again",
                entry.client.name(),
                entry.config.describe(),
                entry.client.failure().unwrap_or("failed")
            ));
            entry.disconnect(io, id);
        }
        convert(events)
    }
}

fn convert(events: Vec<Event>) -> Vec<HubEvent> {
    events
        .into_iter()
        .map(|e| match e {
            Event::Settled | Event::ToolsChanged => HubEvent::Settled,
            Event::CallDone { key, output } => HubEvent::CallDone { key, output },
        })
        .collect()
}
