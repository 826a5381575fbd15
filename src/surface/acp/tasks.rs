//! Where a tool call runs, and the calls the editor carries out: `fs/*` and `terminal/*`
//! requests sent for a `delegate::Step`, their deadlines, the answers that move them on, and
//! the terminals killed when nobody waits for them any more. `delegate` is the sans-IO
//! machine; this is its I/O.

use std::collections::HashMap;

use serde_json::{Value, json};

use super::delegate::{self, Advance, ClientCaps, Step};
use super::{AcpKey, AcpServe, Pending};
use crate::agent::run::ToolCall;
use crate::engine::{HostAction, ToolPlacement};
use crate::ids::{HostKey, RunId};
use crate::jsonrpc::RpcError;
use crate::reactor::TimerId;
use crate::surface::host::Cx;

/// A tool call the editor carries out (kept by its card's wire id).
pub(super) struct Task {
    run: RunId,
    /// The model's id, which the run knows the call by.
    tool_use_id: String,
    step: Step,
    /// The request whose answer moves the call on; answers to others are stale.
    waiting_on: Option<i64>,
    timer: Option<(TimerId, u64)>,
}

impl<H: HostKey> AcpServe<H> {
    /// Shows the call as started and picks where it runs: an MCP server of the session, the
    /// editor (when it can and the call is one it carries out), or here.
    pub(super) fn place_tool(
        &mut self,
        ctx: &mut Cx<AcpKey<H>>,
        run: RunId,
        call: &ToolCall,
        confined: bool,
    ) -> ToolPlacement {
        let Some(sid) = self.runs.get(&run).cloned() else {
            return ToolPlacement::Local;
        };
        let wire = self.wire_id(&sid, &call.id);
        self.show_input(&sid, &wire, &call.input);
        self.outbox.update(
            &sid,
            json!({"sessionUpdate": "tool_call_update", "toolCallId": wire,
                   "status": "in_progress"}),
        );
        let Some(session) = self.sessions.get_mut(&sid) else {
            return ToolPlacement::Local;
        };
        // A command in the sandbox runs in caliban, where the sandbox reaches: its card shows
        // the result as text instead of an editor terminal.
        let caps = ClientCaps {
            terminal: self.caps.terminal && !confined,
            ..self.caps
        };
        match delegate::start(caps, &call.name, &call.input, &session.cwd, &sid) {
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
                    wire.clone(),
                    Task {
                        run,
                        tool_use_id: call.id.clone(),
                        step,
                        waiting_on: None,
                        timer: None,
                    },
                );
                self.send_task_request(ctx, &sid, &wire, request);
                ToolPlacement::Delegated
            }
        }
    }

    fn send_task_request(
        &mut self,
        ctx: &mut Cx<AcpKey<H>>,
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

    fn advance(&mut self, ctx: &mut Cx<AcpKey<H>>, sid: &str, tool: &str, next: Advance) {
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
                tool_use_id: task.tool_use_id,
                output,
            });
        }
    }

    pub(super) fn on_tool_answer(
        &mut self,
        ctx: &mut Cx<AcpKey<H>>,
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
    pub(super) fn drop_task(&mut self, ctx: &mut Cx<AcpKey<H>>, sid: &str, task: Task) {
        if let Some((timer, key)) = task.timer {
            ctx.cancel_timer(timer);
            self.timers.remove(&key);
        }
        if let Some(terminal) = delegate::terminal_of(&task.step) {
            let terminal = terminal.to_owned();
            self.kill_terminal(sid, &terminal);
        }
    }

    /// Drops a session's delegated calls (`drop_task`), in a fixed order.
    pub(super) fn abandon_tasks(
        &mut self,
        ctx: &mut Cx<AcpKey<H>>,
        sid: &str,
        tasks: HashMap<String, Task>,
    ) {
        let mut tasks: Vec<(String, Task)> = tasks.into_iter().collect();
        tasks.sort_by(|a, b| a.0.cmp(&b.0));
        for (_, task) in tasks {
            self.drop_task(ctx, sid, task);
        }
    }

    /// A delegated call's deadline passed.
    pub(super) fn on_task_deadline(&mut self, ctx: &mut Cx<AcpKey<H>>, key: u64) {
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
}
