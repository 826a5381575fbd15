//! The drive host: the one `engine::Host` every drive surface runs under. It owns the
//! `DriveCore` and a `Surface` (HTTP, MCP, ACP, print mode, …), gives every engine callback
//! to the core first and the surface second, performs the actions the core queued, and
//! routes timers and readiness by a typed key, so no surface forwards callbacks or carves
//! key ranges by hand.
//!
//! Architecture Invariant: the core sees a run's event, prompt, turn boundary and end before
//! the surface does, so whatever a surface reads from the core in a callback is already up
//! to date (a permission request a surface answers itself, `Surface::answer_ask`, is no
//! prompt and never reaches the core); and the core's queued actions are performed after
//! every callback, in order.

use std::collections::BTreeSet;
use std::time::Duration;

use mio::Token;

use crate::agent::compact::Trigger;
use crate::agent::event::{StopCondition, TurnEvent};
use crate::agent::run::ToolCall;
use crate::drive::table::{CoreAction, CoreTimer, DriveCore};
use crate::engine::{AskReply, Ctx, Host, HostAction, RetryNotice, Stats, ToolPlacement};
use crate::ids::{HostKey, RunId};
use crate::reactor::{Signal, TimerId};
use crate::stdio::StdinItem;

/// What the loop hands back to a drive host: a deadline of the core, or one of the
/// surface's own sources or timers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Key<S> {
    Core(CoreTimer),
    Surface(S),
}

/// What a surface may touch from inside a callback: the shared core, and the engine's
/// context narrowed to the surface's own keys.
pub struct Cx<'a, 'c, S: HostKey> {
    pub core: &'a mut DriveCore,
    ctx: &'a mut Ctx<'c, Key<S>>,
}

impl<S: HostKey> Cx<'_, '_, S> {
    pub fn registry(&self) -> &mio::Registry {
        self.ctx.registry()
    }

    /// A token whose readiness comes back as `Surface::on_io(key)`.
    pub fn host_token(&mut self, key: S) -> Token {
        self.ctx.host_token(Key::Surface(key))
    }

    pub fn forget_token(&mut self, token: Token) {
        self.ctx.forget_token(token);
    }

    /// A timer that comes back as `Surface::on_timer(key)`.
    pub fn add_timer(&mut self, after: Duration, key: S) -> TimerId {
        self.ctx.add_timer(after, Key::Surface(key))
    }

    pub fn cancel_timer(&mut self, id: TimerId) {
        self.ctx.cancel_timer(id);
    }

    /// An action for the engine that the core does not decide (a delegated tool's result,
    /// quitting).
    pub fn act(&mut self, action: HostAction) {
        self.ctx.act(action);
    }

    pub fn stats(&self) -> Stats {
        self.ctx.stats()
    }

    /// Starts an MCP server for the surface's runs (`engine::Ctx::mcp_start`).
    pub fn mcp_start(
        &mut self,
        config: crate::mcp_client::config::ServerConfig,
        cwd: std::path::PathBuf,
    ) -> crate::mcp_client::ServerId {
        self.ctx.mcp_start(config, cwd)
    }

    pub fn mcp_ensure(&mut self, id: crate::mcp_client::ServerId) -> crate::mcp_client::ServerId {
        self.ctx.mcp_ensure(id)
    }

    pub fn mcp_stop(&mut self, id: crate::mcp_client::ServerId) {
        self.ctx.mcp_stop(id);
    }

    /// The workspace's MCP servers still awaiting the user's approval.
    pub fn mcp_awaiting(&self) -> Vec<crate::mcp_client::config::ServerConfig> {
        self.ctx.mcp_awaiting()
    }

    /// The user's answer about a workspace MCP server (`engine::Ctx::mcp_decide`).
    pub fn mcp_decide(
        &mut self,
        name: &str,
        decision: crate::mcp_client::Approval,
    ) -> Result<(), String> {
        self.ctx.mcp_decide(name, decision)
    }
}

/// A drive surface: a protocol adapter over the core. Every callback has a default that
/// does nothing, so a surface implements only what its protocol shows.
pub trait Surface {
    type Key: HostKey;
    /// The core has recorded `event`.
    fn on_event(&mut self, _cx: &mut Cx<Self::Key>, _run: RunId, _event: &TurnEvent) {}
    /// A tool call needs permission. A surface with nobody to ask (print mode) answers it
    /// here, and the core records no prompt; otherwise (`None`) `on_ask` follows.
    fn answer_ask(
        &mut self,
        _cx: &mut Cx<Self::Key>,
        _run: RunId,
        _call: &ToolCall,
    ) -> Option<AskReply> {
        None
    }
    /// A tool call needs permission; the core queues the prompt right after this.
    fn on_ask(&mut self, _cx: &mut Cx<Self::Key>, _run: RunId, _call: &ToolCall) {}
    /// The run's model request failed before any output and is retried after
    /// `notice.delay` (print mode's `api_retry` frame). Not an event: nothing is recorded.
    fn on_retry(&mut self, _cx: &mut Cx<Self::Key>, _run: RunId, _notice: &RetryNotice) {}
    fn on_compaction_started(&mut self, _cx: &mut Cx<Self::Key>, _run: RunId, _trigger: Trigger) {}
    /// See `engine::Host::on_tool_start`.
    fn on_tool_start(
        &mut self,
        _cx: &mut Cx<Self::Key>,
        _run: RunId,
        _call: &ToolCall,
        _confined: bool,
    ) -> ToolPlacement {
        ToolPlacement::Local
    }
    /// The core has marked the run `awaiting_input`.
    fn on_await_input(&mut self, _cx: &mut Cx<Self::Key>, _run: RunId) {}
    /// The core has recorded the run's end.
    fn on_finished(&mut self, _cx: &mut Cx<Self::Key>, _run: RunId, _why: &StopCondition) {}
    fn on_stdin(&mut self, _cx: &mut Cx<Self::Key>, _item: StdinItem) {}
    fn on_signal(&mut self, cx: &mut Cx<Self::Key>, signal: Signal);
    fn on_io(&mut self, _cx: &mut Cx<Self::Key>, _key: Self::Key) {}
    fn on_timer(&mut self, _cx: &mut Cx<Self::Key>, _key: Self::Key) {}
    /// The engine's queues ran dry; `changed` are the runs whose events, status or prompt
    /// changed since the last call.
    fn after_batch(&mut self, _cx: &mut Cx<Self::Key>, _changed: &BTreeSet<RunId>) {}
    /// Appends the bytes for stdout (the stdio surfaces' protocol channel) to `out`.
    fn write_output(&mut self, _out: &mut Vec<u8>) {}
}

pub struct DriveHost<S> {
    pub core: DriveCore,
    pub surface: S,
}

impl<S: Surface> DriveHost<S> {
    pub fn new(core: DriveCore, surface: S) -> DriveHost<S> {
        DriveHost { core, surface }
    }

    /// Runs `f` on the surface, then performs what the core queued meanwhile.
    pub fn with<R>(
        &mut self,
        ctx: &mut Ctx<Key<S::Key>>,
        f: impl FnOnce(&mut S, &mut Cx<S::Key>) -> R,
    ) -> R {
        let mut cx = Cx {
            core: &mut self.core,
            ctx,
        };
        let result = f(&mut self.surface, &mut cx);
        self.perform(ctx);
        result
    }

    /// What the core queued before the loop runs (print mode's first prompt), for
    /// `Engine::push_action`. Only a surfaced permission prompt arms a timer, and none can be
    /// surfaced before the loop.
    pub fn take_engine_actions(&mut self) -> Vec<HostAction> {
        let mut engine = Vec::new();
        for action in self.core.take_actions() {
            match action {
                CoreAction::Engine(action) => engine.push(action),
                CoreAction::Arm(..) => debug_assert!(false, "a core timer before the loop"),
            }
        }
        engine
    }

    fn perform(&mut self, ctx: &mut Ctx<Key<S::Key>>) {
        for action in self.core.take_actions() {
            match action {
                CoreAction::Engine(action) => ctx.act(action),
                CoreAction::Arm(after, timer) => {
                    ctx.add_timer(after, Key::Core(timer));
                }
            }
        }
    }
}

impl<S: Surface> Host for DriveHost<S> {
    type Key = Key<S::Key>;

    fn on_event(&mut self, ctx: &mut Ctx<Self::Key>, run: RunId, event: &TurnEvent) {
        self.core.on_event(run, event);
        self.with(ctx, |s, cx| s.on_event(cx, run, event));
    }

    fn on_ask(&mut self, ctx: &mut Ctx<Self::Key>, run: RunId, call: &ToolCall) -> AskReply {
        if let Some(reply) = self.with(ctx, |s, cx| s.answer_ask(cx, run, call)) {
            return reply;
        }
        self.with(ctx, |s, cx| s.on_ask(cx, run, call));
        let reply = self.core.on_ask(run, call);
        self.perform(ctx);
        reply
    }

    fn on_retry(&mut self, ctx: &mut Ctx<Self::Key>, run: RunId, notice: &RetryNotice) {
        self.with(ctx, |s, cx| s.on_retry(cx, run, notice));
    }

    fn on_compaction_started(&mut self, ctx: &mut Ctx<Self::Key>, run: RunId, trigger: Trigger) {
        self.with(ctx, |s, cx| s.on_compaction_started(cx, run, trigger));
    }

    fn on_tool_start(
        &mut self,
        ctx: &mut Ctx<Self::Key>,
        run: RunId,
        call: &ToolCall,
        confined: bool,
    ) -> ToolPlacement {
        self.with(ctx, |s, cx| s.on_tool_start(cx, run, call, confined))
    }

    fn on_await_input(&mut self, ctx: &mut Ctx<Self::Key>, run: RunId) {
        self.core.on_await_input(run);
        self.with(ctx, |s, cx| s.on_await_input(cx, run));
    }

    fn on_finished(&mut self, ctx: &mut Ctx<Self::Key>, run: RunId, why: &StopCondition) {
        self.core.on_finished(run, why);
        self.with(ctx, |s, cx| s.on_finished(cx, run, why));
    }

    fn on_stdin(&mut self, ctx: &mut Ctx<Self::Key>, item: StdinItem) {
        self.with(ctx, |s, cx| s.on_stdin(cx, item));
    }

    fn on_signal(&mut self, ctx: &mut Ctx<Self::Key>, signal: Signal) {
        self.with(ctx, |s, cx| s.on_signal(cx, signal));
    }

    fn on_io(&mut self, ctx: &mut Ctx<Self::Key>, key: Self::Key) {
        if let Key::Surface(key) = key {
            self.with(ctx, |s, cx| s.on_io(cx, key));
        }
    }

    fn on_timer(&mut self, ctx: &mut Ctx<Self::Key>, key: Self::Key) {
        match key {
            Key::Core(timer) => {
                self.core.on_timer(timer);
                self.perform(ctx);
            }
            Key::Surface(key) => self.with(ctx, |s, cx| s.on_timer(cx, key)),
        }
    }

    fn after_batch(&mut self, ctx: &mut Ctx<Self::Key>) {
        self.core.after_batch();
        let changed = self.core.take_changed();
        self.with(ctx, |s, cx| s.after_batch(cx, &changed));
        self.core.end_round();
    }

    fn write_output(&mut self, out: &mut Vec<u8>) {
        self.surface.write_output(out);
    }
}
