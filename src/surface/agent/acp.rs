//! ACP over the network: the very `AcpServe` of `caliban acp serve`, fed the client's lines
//! through its `on_stdin` and writing what `write_output` gives to the connection instead of
//! stdout. Nothing here speaks ACP. The ACP-level auth gate is off: the peer proved itself
//! one layer down (TLS and the preamble, or the Unix socket's mode).
//!
//! When the client goes away its sessions stay (`AcpServe::client_gone`); a client that
//! reconnects with the same token `session/load`s them. A connection closing is not stdin's
//! EOF: only SIGTERM/SIGINT or the idle exit end the agent.

use std::collections::BTreeSet;

use super::{Link, LinkEvent, NetKey, Served, cancel_live_runs};
use crate::agent::event::{StopCondition, TurnEvent};
use crate::agent::run::ToolCall;
use crate::engine::{RetryNotice, ToolPlacement};
use crate::ids::RunId;
use crate::reactor::Signal;
use crate::stdio::StdinItem;
use crate::surface::acp::{AcpKey, AcpServe};
use crate::surface::front::FrontKey;
use crate::surface::host::{Cx, Surface};

/// The agent's keys: `AcpServe`'s, with the connections' and the idle exit's in its host
/// slot, handled here before the rest reach `AcpServe`.
pub(crate) type AgentKey = AcpKey<NetKey>;

impl From<NetKey> for AgentKey {
    fn from(key: NetKey) -> AgentKey {
        AcpKey::Host(key)
    }
}

impl From<FrontKey> for AgentKey {
    fn from(key: FrontKey) -> AgentKey {
        AcpKey::Host(NetKey::Front(key))
    }
}

/// What an ACP client reads when a newer one takes its place (then its connection closes):
/// a JSON-RPC notification of an extension method (ACP's `_` prefix), which a client that
/// does not know it ignores.
pub(super) fn replaced_line() -> Vec<u8> {
    let mut line = serde_json::json!({
        "jsonrpc": "2.0",
        "method": "_caliban/replaced",
        "params": {"reason": super::ndjson::REPLACED},
    })
    .to_string()
    .into_bytes();
    line.push(b'\n');
    line
}

pub(crate) struct NetAcp {
    acp: AcpServe<NetKey>,
    link: Link,
}

impl NetAcp {
    pub(super) fn new(link: Link) -> NetAcp {
        NetAcp {
            acp: AcpServe::new(),
            link,
        }
    }
}

impl Served for NetAcp {
    const PROTOCOL: &'static str = "acp";

    fn link(&mut self) -> &mut Link {
        &mut self.link
    }

    fn start(&mut self, cx: &mut Cx<AgentKey>) -> Result<(), String> {
        self.link
            .start(cx)
            .map_err(|e| format!("cannot listen: {e}"))
    }
}

impl NetAcp {
    fn serve(&mut self, cx: &mut Cx<AgentKey>) {
        while let Some(event) = self.link.next_event(cx) {
            match event {
                LinkEvent::Attached(_) | LinkEvent::Writable => {}
                LinkEvent::Detached(_) => self.acp.client_gone(),
                LinkEvent::Line(line) => self.acp.on_stdin(cx, StdinItem::Line(line)),
                LinkEvent::Oversized => self.acp.on_stdin(cx, StdinItem::Oversized),
            }
        }
    }
}

impl Surface for NetAcp {
    type Key = AgentKey;

    fn on_event(&mut self, cx: &mut Cx<AgentKey>, run: RunId, event: &TurnEvent) {
        self.acp.on_event(cx, run, event);
    }

    fn on_ask(&mut self, cx: &mut Cx<AgentKey>, run: RunId, call: &ToolCall) {
        self.acp.on_ask(cx, run, call);
    }

    fn on_retry(&mut self, cx: &mut Cx<AgentKey>, run: RunId, notice: &RetryNotice) {
        self.acp.on_retry(cx, run, notice);
    }

    fn on_tool_start(
        &mut self,
        cx: &mut Cx<AgentKey>,
        run: RunId,
        call: &ToolCall,
        confined: bool,
    ) -> ToolPlacement {
        self.acp.on_tool_start(cx, run, call, confined)
    }

    fn on_await_input(&mut self, cx: &mut Cx<AgentKey>, run: RunId) {
        self.acp.on_await_input(cx, run);
    }

    fn on_finished(&mut self, cx: &mut Cx<AgentKey>, run: RunId, why: &StopCondition) {
        self.acp.on_finished(cx, run, why);
    }

    fn on_signal(&mut self, cx: &mut Cx<AgentKey>, signal: Signal) {
        // Runs a client left behind are not the surface's any more; the core knows them.
        cancel_live_runs(cx.core);
        self.acp.on_signal(cx, signal);
    }

    fn on_io(&mut self, cx: &mut Cx<AgentKey>, key: AgentKey) {
        match key {
            AcpKey::Host(NetKey::Front(key)) => {
                self.link.on_io(cx, key);
                self.serve(cx);
            }
            AcpKey::Host(NetKey::Idle | NetKey::Replay) => {}
            other => self.acp.on_io(cx, other),
        }
    }

    fn on_timer(&mut self, cx: &mut Cx<AgentKey>, key: AgentKey) {
        match key {
            AcpKey::Host(NetKey::Front(key)) => {
                self.link.on_timer(cx, key);
                self.serve(cx);
            }
            AcpKey::Host(NetKey::Idle) => {
                if self.link.idle_expired(cx.core) {
                    // As for a signal: the sessions' MCP servers go with the runs.
                    cancel_live_runs(cx.core);
                    self.acp.shutdown(cx);
                }
            }
            AcpKey::Host(NetKey::Replay) => {}
            other => self.acp.on_timer(cx, other),
        }
    }

    fn after_batch(&mut self, cx: &mut Cx<AgentKey>, changed: &BTreeSet<RunId>) {
        self.serve(cx);
        self.acp.after_batch(cx, changed);
        self.acp.ask_pending(cx);
        // The engine calls this last before it would write stdout: the ordered outbox goes
        // to the client instead, whole.
        let mut out = Vec::new();
        self.acp.write_output(&mut out);
        self.link.send(&out);
        self.serve(cx);
        self.link.watch_idle(cx);
    }
}
