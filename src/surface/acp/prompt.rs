//! The prompt lifecycle: `session/prompt` (input at the session's turn boundary, or a new
//! run that continues the conversation, once the session's MCP servers have listed their
//! tools), `session/cancel`, and the answer when the turn or the run ends.

use serde_json::{Map, Value, json};

use super::mcp_client::Phase;
use super::session::Session;
use super::{AcpKey, AcpServe, SESSION_FIELD, convo, invalid_params, str_param, unknown_session};
use crate::agent::event::StopCondition;
use crate::drive::table::{DriveStatus, Inbound, RunSpec};
use crate::engine::RunId;
use crate::jsonrpc::{INTERNAL_ERROR, INVALID_REQUEST, Id, RpcError};
use crate::log;
use crate::reactor::TimerId;
use crate::surface::host::Cx;

/// How long a prompt waits for the session's MCP servers to list their tools.
const MCP_START_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

impl AcpServe {
    /// Takes a prompt: input at the session's turn boundary, or a new run that continues the
    /// conversation. The answer comes when the turn ends.
    pub(super) fn prompt(
        &mut self,
        ctx: &mut Cx<AcpKey>,
        id: &Id,
        params: &Value,
    ) -> Result<(), RpcError> {
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
    pub(super) fn cancel_turn(&mut self, ctx: &mut Cx<AcpKey>, sid: &str) {
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

    pub(super) fn take_mcp_wait(
        ctx: &mut Cx<AcpKey>,
        session: &mut Session,
    ) -> Option<(Id, TimerId, u64)> {
        let (prompt, _, timer, key) = session.mcp_wait.take()?;
        ctx.cancel_timer(timer);
        Some((prompt, timer, key))
    }

    /// A prompt that waited for the session's MCP servers goes ahead: they all listed their
    /// tools, or the wait ran out (`gave_up`) and the stragglers are left out.
    pub(super) fn mcp_wait_over(&mut self, ctx: &mut Cx<AcpKey>, sid: &str, gave_up: bool) {
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

    /// The run waits for input: the turn is over and its prompt is answered.
    pub(super) fn on_turn_end(&mut self, ctx: &mut Cx<AcpKey>, run: RunId) {
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

    /// The run ended: its prompt, if one is in flight, is answered with the stop reason.
    pub(super) fn on_run_finished(
        &mut self,
        ctx: &mut Cx<AcpKey>,
        run: RunId,
        why: &StopCondition,
    ) {
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
}
