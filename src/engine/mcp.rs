//! The MCP glue: the hub's view of the reactor (`McpIo`, over `Reach`), DNS lookups
//! posted back as completions (`Lookups`), a run's servers and its bounded wait for their
//! tool lists (`RunMcp`), tool calls sent to the hub, and the session `DELETE`s at exit.

use std::sync::Arc;
use std::sync::mpsc::Sender;
use std::time::{Duration, Instant};

use mio::Token;
use mio::Waker;

use super::{Completion, Engine, Owner, Reach, Routing, TimerOwner};

use crate::agent::run::ToolCall;
use crate::ids::{HostKey, RunId};
use crate::log;
use crate::mcp_client::{self, Alarm, Hub, HubEvent, Selection, ServerId, Source};
use crate::reactor::{TimerId, Wake};
use crate::workers::Pool;

/// What DNS lookups need: the pool, and the way back to the loop.
#[derive(Clone, Copy)]
pub(super) struct Lookups<'a> {
    pub(super) pool: &'a Pool,
    pub(super) tx: &'a Sender<Completion>,
    pub(super) waker: &'a Arc<Waker>,
}

impl Lookups<'_> {
    /// Looks `host` up on the DNS pool; the answer comes back as the completion `done`
    /// makes of it. An address literal needs no lookup (and no thread), and a lookup the
    /// pool refuses fails at once: those answers are returned, for the caller to handle now.
    pub(super) fn look_up(
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
pub(super) struct McpIo<'a, R> {
    pub(super) reach: &'a mut R,
    pub(super) lookups: Lookups<'a>,
}

impl<R: Reach> mcp_client::Io for McpIo<'_, R> {
    fn registry(&self) -> &mio::Registry {
        self.reach.registry()
    }

    fn token(&mut self, server: ServerId, source: Source) -> Token {
        self.reach.token(Owner::Mcp(server, source))
    }

    fn forget_token(&mut self, token: Token) {
        self.reach.forget(token);
    }

    fn add_timer(&mut self, after: Duration, server: ServerId, alarm: Alarm) -> TimerId {
        self.reach.timer(after, TimerOwner::Mcp(server, alarm))
    }

    fn cancel_timer(&mut self, id: TimerId) {
        self.reach.cancel(id);
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

/// A run's MCP servers, and its model request's wait for their tool lists.
pub(super) struct RunMcp {
    /// The MCP servers whose tools the run is offered.
    pub(super) servers: Vec<ServerId>,
    /// The run sees every configured server (no per-run list), so a workspace server
    /// approved while it lives joins it.
    all: bool,
    wait: McpWait,
    /// A wait ran out: this run waits no more (a stuck server must not slow every turn).
    gave_up: bool,
}

impl RunMcp {
    pub(super) fn new(servers: Vec<ServerId>, all: bool) -> RunMcp {
        RunMcp {
            servers,
            all,
            wait: McpWait::Idle,
            gave_up: false,
        }
    }

    /// Whether the workspace server approved under `name` joins this run.
    pub(super) fn joins<'n>(&self, name: &str, name_of: impl Fn(ServerId) -> &'n str) -> bool {
        self.all && !self.servers.iter().any(|id| name_of(*id) == name)
    }

    /// Whether the model request waits: it already does, or (`listing`) a server of the
    /// run is listing its tools and no earlier wait of the run ran out, and it starts to.
    pub(super) fn wait(&mut self, reach: &mut impl Reach, run: RunId, listing: bool) -> bool {
        if let McpWait::Waiting(_) = self.wait {
            return true;
        }
        if !listing || self.gave_up {
            return false;
        }
        let timer = reach.timer(mcp_client::START_WAIT, TimerOwner::McpWait(run));
        self.wait = McpWait::Waiting(timer);
        true
    }

    /// Whether the hub's servers settling ends this run's wait.
    fn settled(&self, listing: impl Fn(&[ServerId]) -> bool) -> bool {
        matches!(self.wait, McpWait::Waiting(_)) && !listing(&self.servers)
    }

    /// Ends a wait, if one is in progress (and says so): its servers settled, the run's
    /// work was cancelled, or (`gave_up`, its timer fired) it ran out and this run waits
    /// no more.
    pub(super) fn end_wait(&mut self, reach: &mut impl Reach, gave_up: bool) -> bool {
        let McpWait::Waiting(timer) = self.wait else {
            return false;
        };
        self.wait = McpWait::Idle;
        self.gave_up |= gave_up;
        if !gave_up {
            reach.cancel(timer);
        }
        true
    }
}

impl<K: HostKey> Engine<K> {
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
    pub(super) fn mcp_io(&mut self) -> (&mut Hub, McpIo<'_, Routing<K>>) {
        (
            &mut self.mcp,
            McpIo {
                reach: &mut self.io,
                lookups: Lookups {
                    pool: &self.dns_workers,
                    tx: &self.tx,
                    waker: &self.waker,
                },
            },
        )
    }

    /// A run's wait for its servers is over: they all settled, or (`gave_up`) the wait ran
    /// out and the stragglers are left out of this turn.
    pub(super) fn end_mcp_wait(&mut self, run: RunId, gave_up: bool) {
        let Some(slot) = self.runs.get_mut(&run) else {
            return;
        };
        if !slot.mcp.end_wait(&mut self.io, gave_up) {
            return;
        }
        if gave_up {
            let stragglers: Vec<&str> = slot
                .mcp
                .servers
                .iter()
                .filter(|id| self.mcp.any_listing(&[**id]))
                .map(|id| self.mcp.name(*id))
                .collect();
            log::warn(&format!(
                "MCP servers still listing their tools after {} s, going ahead without their new lists: {}",
                mcp_client::START_WAIT.as_secs(),
                stragglers.join(", ")
            ));
        }
        self.request_model_waiting(run, false);
    }

    /// What the MCP hub reports: calls answered, servers ready.
    pub(super) fn on_hub_events(&mut self, events: Vec<HubEvent>) {
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
                        .filter(|(_, s)| s.mcp.settled(|ids| self.mcp.any_listing(ids)))
                        .map(|(id, _)| *id)
                        .collect();
                    for run in ready {
                        self.end_mcp_wait(run, false);
                    }
                }
            }
        }
    }

    /// Sends an MCP server's tool call; its answer comes back as a `HubEvent::CallDone`.
    pub(super) fn start_mcp_call(&mut self, run: RunId, call: ToolCall) {
        let Some(servers) = self.runs.get(&run).map(|s| s.mcp.servers.clone()) else {
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

    /// Gives the `DELETE`s that end stopped MCP servers' HTTP sessions (`shutdown` sent
    /// them) at most `EXIT_SESSION_WAIT`, running only the hub's part of the loop: nothing
    /// else is left to answer, and exit must stay prompt.
    pub(super) fn end_mcp_sessions(&mut self) -> std::io::Result<()> {
        let deadline = Instant::now() + mcp_client::EXIT_SESSION_WAIT;
        let mut wakes = Vec::new();
        while self.mcp.ending() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            wakes.clear();
            self.io.reactor.wait(&mut wakes, Some(left))?;
            for wake in wakes.drain(..) {
                match wake {
                    Wake::Io { token, .. } => {
                        if let Some(Owner::Mcp(server, source)) = self.io.owners.get(&token) {
                            let (server, source) = (*server, *source);
                            let (hub, mut io) = self.mcp_io();
                            hub.on_ready(&mut io, server, source);
                        }
                    }
                    Wake::Timer(id) => {
                        if let Some(TimerOwner::Mcp(server, alarm)) = self.io.timers.remove(&id) {
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
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc::{Receiver, channel};

    use mcp_client::Io;

    use super::super::fake::FakeReach;
    use super::*;

    const RUN: RunId = RunId(5);
    const SERVER: ServerId = ServerId(2);

    /// What the engine lends the hub besides the reactor: a DNS pool (its threads start
    /// lazily), the completion channel and the waker.
    struct Lent {
        pool: Pool,
        tx: Sender<Completion>,
        rx: Receiver<Completion>,
        waker: Arc<Waker>,
    }

    impl Lent {
        fn new(reach: &FakeReach) -> Lent {
            let (tx, rx) = channel();
            Lent {
                pool: Pool::new("caliban-test-dns", 1, 1),
                tx,
                rx,
                waker: Arc::new(Waker::new(reach.registry(), Token(0)).expect("waker")),
            }
        }

        fn io<'a>(&'a self, reach: &'a mut FakeReach) -> McpIo<'a, FakeReach> {
            McpIo {
                reach,
                lookups: Lookups {
                    pool: &self.pool,
                    tx: &self.tx,
                    waker: &self.waker,
                },
            }
        }
    }

    #[test]
    fn the_hubs_tokens_and_timers_are_routed_back_to_it() {
        let mut reach = FakeReach::new();
        let lent = Lent::new(&reach);
        let mut io = lent.io(&mut reach);
        let token = io.token(SERVER, Source::Http(4));
        let timer = io.add_timer(Duration::from_secs(9), SERVER, Alarm::Listing);
        assert!(matches!(
            reach.owners.get(&token),
            Some(Owner::Mcp(SERVER, Source::Http(4)))
        ));
        assert!(matches!(
            reach.timers.get(&timer),
            Some((_, TimerOwner::Mcp(SERVER, Alarm::Listing)))
        ));
        let mut io = lent.io(&mut reach);
        io.forget_token(token);
        io.cancel_timer(timer);
        assert!(reach.owners.is_empty() && reach.timers.is_empty());
    }

    #[test]
    fn an_address_literal_is_answered_as_a_completion_without_a_lookup() {
        let mut reach = FakeReach::new();
        // The pool's threads start lazily: a literal must not need one.
        let lent = Lent::new(&reach);
        lent.io(&mut reach)
            .resolve("127.0.0.1".to_owned(), 8123, SERVER, 11);
        match lent.rx.try_recv() {
            Ok(Completion::McpResolved {
                server,
                exchange,
                result,
            }) => {
                assert_eq!((server, exchange), (SERVER, 11));
                assert_eq!(result, Ok(vec!["127.0.0.1:8123".parse().unwrap()]));
            }
            _ => panic!("no completion"),
        }
    }

    #[test]
    fn a_request_waits_once_while_a_server_lists_its_tools() {
        let mut reach = FakeReach::new();
        let mut mcp = RunMcp::new(vec![SERVER], true);
        assert!(!mcp.wait(&mut reach, RUN, false), "nothing is listing");
        assert!(reach.timers.is_empty());
        assert!(mcp.wait(&mut reach, RUN, true));
        assert!(
            mcp.wait(&mut reach, RUN, false),
            "a wait in progress goes on"
        );
        let waits: Vec<_> = reach.timers.values().collect();
        assert!(matches!(
            waits[..],
            [(after, TimerOwner::McpWait(RUN))] if *after == mcp_client::START_WAIT
        ));
    }

    #[test]
    fn servers_settling_end_the_wait_and_its_timer() {
        let mut reach = FakeReach::new();
        let mut mcp = RunMcp::new(vec![SERVER], true);
        assert!(!mcp.settled(|_| false), "no wait, nothing to end");
        mcp.wait(&mut reach, RUN, true);
        assert!(!mcp.settled(|ids| ids == [SERVER]), "still listing");
        assert!(mcp.settled(|_| false));
        assert!(mcp.end_wait(&mut reach, false));
        assert!(reach.timers.is_empty(), "its timer is cancelled");
        assert!(!mcp.end_wait(&mut reach, false), "only once");
        assert!(
            mcp.wait(&mut reach, RUN, true),
            "a later turn may wait again"
        );
    }

    #[test]
    fn a_wait_that_ran_out_is_never_repeated() {
        let mut reach = FakeReach::new();
        let mut mcp = RunMcp::new(vec![SERVER], true);
        mcp.wait(&mut reach, RUN, true);
        assert!(mcp.end_wait(&mut reach, true));
        assert!(
            reach.cancelled.is_empty(),
            "a timer that fired is not cancelled"
        );
        assert!(
            !mcp.wait(&mut reach, RUN, true),
            "a stuck server slows no more turns"
        );
    }

    #[test]
    fn an_approved_server_joins_only_runs_that_see_every_server() {
        let name_of = |id: ServerId| if id == SERVER { "docs" } else { "other" };
        let every = RunMcp::new(vec![SERVER], true);
        assert!(every.joins("tickets", name_of));
        assert!(!every.joins("docs", name_of), "it has it already");
        let chosen = RunMcp::new(Vec::new(), false);
        assert!(!chosen.joins("tickets", name_of), "a run with its own list");
    }
}
