use super::{Completion, Engine, Owner, TimerOwner};
use crate::agent::run::ToolCall;
use crate::ids::{HostKey, RunId};
use crate::log;
use crate::mcp_client::{self, Alarm, Hub, HubEvent, ServerId, Source};
use crate::reactor::{Reactor, TimerId, Wake};
use crate::workers::Pool;
use mio::Token;
use mio::Waker;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::mpsc::Sender;
use std::time::{Duration, Instant};

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
pub(super) struct McpIo<'a, K> {
    pub(super) reactor: &'a mut Reactor,
    pub(super) owners: &'a mut HashMap<Token, Owner<K>>,
    pub(super) timers: &'a mut HashMap<TimerId, TimerOwner<K>>,
    pub(super) lookups: Lookups<'a>,
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

/// Whether a run's model request waits for its MCP servers to list their tools (at most
/// `mcp_client::START_WAIT`): so its first turn sees them, and a turn after a server said
/// its tools changed (`tools/list_changed`, usually during the call just answered) sees
/// the new list.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum McpWait {
    /// No wait in progress.
    Idle,
    /// The request waits; the timer ends the wait.
    Waiting(TimerId),
}

impl<K: HostKey> Engine<K> {
    /// The MCP servers of run `run`, by name, with their state (`Hub::status`).
    pub fn mcp_status(&self, run: RunId) -> Vec<(String, &'static str)> {
        self.runs.get(&run).map_or_else(Vec::new, |slot| {
            slot.mcp
                .iter()
                .map(|id| (self.mcp.name(*id).to_owned(), self.mcp.status(*id)))
                .collect()
        })
    }

    /// The hub and the reactor lent to it, borrowed apart.
    pub(super) fn mcp_io(&mut self) -> (&mut Hub, McpIo<'_, K>) {
        (
            &mut self.mcp,
            McpIo {
                reactor: &mut self.io.reactor,
                owners: &mut self.io.owners,
                timers: &mut self.io.timers,
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
            self.io.timers.remove(&timer);
            self.io.reactor.cancel_timer(timer);
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

    /// Sends an MCP server's tool call; its answer comes back as a `HubEvent::CallDone`.
    pub(super) fn start_mcp_call(&mut self, run: RunId, call: ToolCall) {
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
