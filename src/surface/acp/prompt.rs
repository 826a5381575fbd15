//! The prompt lifecycle: `session/prompt` (input at the session's turn boundary, or a new
//! run that continues the conversation and is offered the session's MCP servers),
//! `session/cancel`, and the answer when the turn or the run ends. (The engine holds a
//! run's first model request until its MCP servers have listed their tools.)
//!
//! `PromptState` is the lifecycle as data, and its transitions are pure: they take the
//! state and what happened and give the next state and what to answer. `AcpServe` performs
//! them (replies, the run's cancel).

use serde_json::{Map, Value, json};

use super::commands::{self, Command};
use super::params::Prompt;
use super::{AcpKey, AcpServe, SESSION_FIELD, convo, unknown_session};
use crate::agent::event::StopCondition;
use crate::drive::table::{DriveStatus, Inbound, RunSpec};
use crate::ids::{HostKey, RunId};
use crate::jsonrpc::{INTERNAL_ERROR, INVALID_REQUEST, Id, RpcError};
use crate::mcp_client::Selection;
use crate::surface::host::Cx;

/// Where a session's `session/prompt` is. One per session; every variant but `Idle` holds
/// a request the client waits on an answer for.
///
/// Transitions (each a method below, done by value through `step`):
///
/// - `Idle` → `Running`: the prompt became input at the run's turn boundary, or started a
///   run (`AcpServe::prompt`, after `admit` said `Start`).
/// - `Running` → `Cancelling` (`on_cancel`): the run is being cancelled; answered when it
///   has ended. With no live run to cancel, `Running` → `Idle`, answered `cancelled` now.
/// - `Cancelling` → `Cancelling` (`admit`): a prompt that comes before the cancelled turn
///   ends is queued (one; a second is refused).
/// - `Running` → `Idle` (`on_turn_end`, `on_run_end`): answered with the stop reason.
/// - `Cancelling` → `Idle` (`on_turn_end`, `on_run_end`): answered `cancelled`; the queued
///   prompt, if any, is taken next.
///
/// Anything else leaves the state as it is: a stale cancel never reaches the next turn.
#[derive(Debug, Default, PartialEq)]
pub(super) enum PromptState {
    #[default]
    Idle,
    /// The prompt's turn is running.
    Running { request: Id },
    /// The prompt's run is being cancelled. `queued` is a prompt that arrived meanwhile (an
    /// editor sends `session/cancel` and the next `session/prompt` back to back); it starts
    /// as soon as the cancelled prompt is answered.
    Cancelling {
        request: Id,
        queued: Option<Deferred>,
    },
}

/// A `session/prompt` taken but not started yet: it goes through `AcpServe::prompt` again.
#[derive(Debug, PartialEq)]
pub(super) struct Deferred {
    pub(super) request: Id,
    pub(super) prompt: Prompt,
}

/// What to do with a `session/prompt`.
#[derive(Debug, PartialEq)]
pub(super) enum Admit {
    /// Nothing in flight: start it.
    Start,
    /// Queued behind the prompt being cancelled.
    Queued,
    /// A prompt is already in flight: refuse it.
    Busy,
}

/// What a cancel asks for.
#[derive(Debug, PartialEq)]
pub(super) enum Cancel {
    /// No prompt in flight, or its cancel is already under way.
    Nothing,
    /// Cancel the session's run; the prompt is answered once the run has ended.
    StopRun,
    /// Answer `cancelled` now: the prompt never started a run, or its run has ended.
    Answer { request: Id },
}

/// A `session/prompt` answer.
#[derive(Debug, PartialEq)]
pub(super) struct Answer {
    pub(super) request: Id,
    pub(super) result: Result<Value, RpcError>,
    /// The prompt queued behind this one: taken once this answer is out.
    pub(super) next: Option<Deferred>,
}

fn stop_reason(stop: &str) -> Value {
    json!({"stopReason": stop})
}

impl PromptState {
    /// Moves the state through `transition`, giving back what the transition says to do.
    pub(super) fn step<T>(&mut self, transition: impl FnOnce(Self) -> (Self, T)) -> T {
        let (next, todo) = transition(std::mem::take(self));
        *self = next;
        todo
    }

    pub(super) fn is_idle(&self) -> bool {
        matches!(self, PromptState::Idle)
    }

    /// The request in flight or waiting; a queued prompt's is not one a cancel names.
    pub(super) fn request(&self) -> Option<&Id> {
        match self {
            PromptState::Idle => None,
            PromptState::Running { request } | PromptState::Cancelling { request, .. } => {
                Some(request)
            }
        }
    }

    /// A `session/prompt` arrives; while a cancelled turn winds down, one is queued.
    pub(super) fn admit(&mut self, request: &Id, prompt: &Prompt) -> Admit {
        match self {
            PromptState::Idle => Admit::Start,
            PromptState::Cancelling {
                queued: queued @ None,
                ..
            } => {
                *queued = Some(Deferred {
                    request: request.clone(),
                    prompt: prompt.clone(),
                });
                Admit::Queued
            }
            PromptState::Running { .. }
            | PromptState::Cancelling {
                queued: Some(_), ..
            } => Admit::Busy,
        }
    }

    /// `session/cancel` (or `$/cancel_request` naming the prompt, or a permission request
    /// answered `cancelled`); `run_live` says whether the session's run is still going.
    pub(super) fn on_cancel(self, run_live: bool) -> (PromptState, Cancel) {
        match self {
            PromptState::Running { request } if run_live => (
                PromptState::Cancelling {
                    request,
                    queued: None,
                },
                Cancel::StopRun,
            ),
            PromptState::Running { request } => (PromptState::Idle, Cancel::Answer { request }),
            state @ (PromptState::Idle | PromptState::Cancelling { .. }) => {
                (state, Cancel::Nothing)
            }
        }
    }

    /// The run waits for input: the turn is over.
    pub(super) fn on_turn_end(self) -> (PromptState, Option<Answer>) {
        match self {
            PromptState::Running { request } => (
                PromptState::Idle,
                Some(Answer {
                    request,
                    result: Ok(stop_reason("end_turn")),
                    next: None,
                }),
            ),
            PromptState::Cancelling { request, queued } => (
                PromptState::Idle,
                Some(Answer {
                    request,
                    result: Ok(stop_reason("cancelled")),
                    next: queued,
                }),
            ),
            PromptState::Idle => (PromptState::Idle, None),
        }
    }

    /// The run ended `why`; `meta` is its accounting (`_meta` of a stop reason).
    pub(super) fn on_run_end(
        self,
        why: &StopCondition,
        meta: Option<Value>,
    ) -> (PromptState, Option<Answer>) {
        let (request, next, cancelling) = match self {
            PromptState::Running { request } => (request, None, false),
            PromptState::Cancelling { request, queued } => (request, queued, true),
            PromptState::Idle => return (PromptState::Idle, None),
        };
        let stop = match why {
            _ if cancelling => Ok("cancelled"),
            StopCondition::Cancelled => Ok("cancelled"),
            StopCondition::EndOfTurn => Ok("end_turn"),
            StopCondition::MaxTokensExhausted => Ok("max_tokens"),
            StopCondition::MaxTurnsReached(_) => Ok("max_turn_requests"),
            StopCondition::Refusal(_) | StopCondition::ContentFilter(_) => Ok("refusal"),
            StopCondition::ProviderError(e) => Err(e.clone()),
            StopCondition::CompactionFailed(e) => Err(format!("compaction failed: {e}")),
            StopCondition::StreamIdle(d) => Err(format!(
                "the model stream was idle for {} s",
                d.as_secs_f64()
            )),
        };
        let result = match stop {
            Ok(stop) => {
                let mut result = stop_reason(stop);
                if let Some(meta) = meta {
                    result["_meta"] = meta;
                }
                Ok(result)
            }
            Err(message) => Err(RpcError::new(INTERNAL_ERROR, message)),
        };
        (
            PromptState::Idle,
            Some(Answer {
                request,
                result,
                next,
            }),
        )
    }
}

impl<H: HostKey> AcpServe<H> {
    /// Takes a prompt: input at the session's turn boundary, or a new run that continues the
    /// conversation. The answer comes when the turn ends.
    pub(super) fn prompt(
        &mut self,
        ctx: &mut Cx<AcpKey<H>>,
        id: &Id,
        prompt: Prompt,
    ) -> Result<(), RpcError> {
        let sid = prompt.session_id.clone();
        let command = commands::parse(&prompt.text);
        let compact = command == Some(Command::Compact);
        if !self.sessions.contains_key(&sid) {
            return Err(unknown_session(&sid));
        }
        if let Some(command) = command.filter(|_| !compact) {
            return self.run_command(ctx, id, &sid, command);
        }
        let session = self
            .sessions
            .get_mut(&sid)
            .ok_or_else(|| unknown_session(&sid))?;
        if compact && session.run.is_none() {
            self.outbox.update(
                &sid,
                json!({"sessionUpdate": "agent_message_chunk",
                       "content": {"type": "text", "text": "Nothing to compact yet."}}),
            );
            self.reply(id.clone(), Ok(stop_reason("end_turn")));
            return Ok(());
        }
        match session.prompt.admit(id, &prompt) {
            Admit::Start => {
                for update in std::mem::take(&mut session.held) {
                    self.outbox.update(&sid, update);
                }
            }
            Admit::Queued => return Ok(()),
            Admit::Busy => {
                return Err(RpcError::new(
                    INVALID_REQUEST,
                    "a prompt is already running in this session; cancel it first",
                ));
            }
        }
        let Prompt { text, images, .. } = prompt;
        let live = session.run.filter(|run| ctx.core.is_live(*run));
        match live {
            Some(run) if ctx.core.status(run) == Ok(DriveStatus::AwaitingInput) => {
                let input = if compact {
                    Inbound::Compact
                } else {
                    Inbound::UserMessage { text, images }
                };
                ctx.core
                    .send_input(run, input)
                    .map_err(|e| RpcError::new(INTERNAL_ERROR, e.to_string()))?;
                // A client that came back may prompt without loading the session first.
                self.runs.insert(run, sid.clone());
            }
            Some(_) => {
                return Err(RpcError::new(
                    INVALID_REQUEST,
                    "the session is still busy with its last turn",
                ));
            }
            None => {
                // A server of the session that died is started afresh for the new run.
                let servers: Vec<_> = std::mem::take(&mut session.mcp)
                    .into_iter()
                    .map(|id| ctx.mcp_ensure(id))
                    .collect();
                session.mcp = servers.clone();
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
                if session.run.is_none() {
                    // The session's first prompt names it.
                    let title = commands::title_of(&text);
                    self.outbox.update(
                        &sid,
                        json!({"sessionUpdate": "session_info_update", "title": title}),
                    );
                }
                let default_model = &ctx.core.config().run.model;
                let spec = RunSpec {
                    prompt: if compact { String::new() } else { text },
                    images,
                    compact_first: compact,
                    model: (session.model != *default_model).then(|| session.model.clone()),
                    effort: session.effort,
                    interactive: true,
                    cwd: Some(session.cwd.clone()),
                    history,
                    continues: session.run,
                    continues_without_last_prompt: session.drop_last_prompt,
                    extra_header,
                    sandbox: Some(session.sandbox),
                    mcp: Selection {
                        configured: None,
                        servers,
                    },
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
                session.ids.close_all();
                session.run_end = None;
            }
        }
        session.prompt = PromptState::Running {
            request: id.clone(),
        };
        Ok(())
    }

    /// `session/cancel`: stops the turn in flight (the run ends; its model stream is dropped
    /// and its tools killed), and the prompt is answered `cancelled` once the run has ended.
    /// A cancel with no turn in flight does nothing, so a stale one never hits the next turn.
    pub(super) fn cancel_turn(&mut self, ctx: &mut Cx<AcpKey<H>>, sid: &str) {
        let Some(session) = self.sessions.get_mut(sid) else {
            return;
        };
        let run_live = session.run.is_some_and(|run| ctx.core.is_live(run));
        match session.prompt.step(|state| state.on_cancel(run_live)) {
            Cancel::Nothing => {}
            Cancel::StopRun => {
                if let Some(run) = session.run {
                    let _ = ctx.core.cancel(run);
                }
            }
            Cancel::Answer { request } => self.answer_cancelled(request),
        }
    }

    /// Answers a prompt `cancelled` now.
    pub(super) fn answer_cancelled(&mut self, request: Id) {
        self.reply(request, Ok(stop_reason("cancelled")));
    }

    /// Sends a prompt's answer, then takes the prompt queued behind it.
    fn send_answer(&mut self, ctx: &mut Cx<AcpKey<H>>, answer: Answer) {
        self.reply(answer.request, answer.result);
        if let Some(next) = answer.next {
            self.take_deferred(ctx, next);
        }
    }

    /// Takes a prompt that waited for a cancelled turn to end as if it came now; a refusal
    /// answers it.
    fn take_deferred(&mut self, ctx: &mut Cx<AcpKey<H>>, deferred: Deferred) {
        if let Err(e) = self.prompt(ctx, &deferred.request, deferred.prompt) {
            self.reply(deferred.request, Err(e));
        }
    }

    /// The run waits for input: the turn is over and its prompt is answered.
    pub(super) fn on_turn_end(&mut self, ctx: &mut Cx<AcpKey<H>>, run: RunId) {
        let Some(session) = self
            .runs
            .get(&run)
            .and_then(|sid| self.sessions.get_mut(sid))
        else {
            return;
        };
        if let Some(answer) = session.prompt.step(PromptState::on_turn_end) {
            self.send_answer(ctx, answer);
        }
    }

    /// The run ended: its prompt, if one is in flight, is answered with the stop reason.
    pub(super) fn on_run_finished(
        &mut self,
        ctx: &mut Cx<AcpKey<H>>,
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
        let answer = session.prompt.step(|state| state.on_run_end(why, meta));
        if let Some(asked) = asked {
            self.withdraw(asked.request);
        }
        if let Some(answer) = answer {
            self.send_answer(ctx, answer);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn deferred(n: i64) -> Deferred {
        Deferred {
            request: Id::Num(n),
            prompt: Prompt {
                session_id: "s".into(),
                text: n.to_string(),
                images: Vec::new(),
            },
        }
    }

    fn running(n: i64) -> PromptState {
        PromptState::Running {
            request: Id::Num(n),
        }
    }

    fn cancelling(n: i64, queued: Option<Deferred>) -> PromptState {
        PromptState::Cancelling {
            request: Id::Num(n),
            queued,
        }
    }

    fn answer(n: i64, result: Result<Value, RpcError>, next: Option<Deferred>) -> Option<Answer> {
        Some(Answer {
            request: Id::Num(n),
            result,
            next,
        })
    }

    #[test]
    fn one_prompt_at_a_time_and_one_queued_behind_a_cancel() {
        let params = deferred(2).prompt;
        let mut state = PromptState::Idle;
        assert_eq!(state.admit(&Id::Num(2), &params), Admit::Start);
        assert_eq!(state, PromptState::Idle, "the caller starts it");

        let busy = || [running(1), cancelling(1, Some(deferred(3)))];
        for (mut state, before) in busy().into_iter().zip(busy()) {
            assert_eq!(state.admit(&Id::Num(2), &params), Admit::Busy);
            assert_eq!(state, before, "a refused prompt changes nothing");
        }

        let mut state = cancelling(1, None);
        assert_eq!(state.admit(&Id::Num(2), &params), Admit::Queued);
        assert_eq!(state, cancelling(1, Some(deferred(2))));
        assert_eq!(state.admit(&Id::Num(3), &params), Admit::Busy);
        assert_eq!(state, cancelling(1, Some(deferred(2))));
    }

    #[test]
    fn a_cancel_stops_the_run_or_answers_at_once_and_a_stale_one_does_nothing() {
        let mut state = running(1);
        assert_eq!(state.step(|s| s.on_cancel(true)), Cancel::StopRun);
        assert_eq!(state, cancelling(1, None));
        // A second cancel while the first winds down is stale.
        assert_eq!(state.step(|s| s.on_cancel(true)), Cancel::Nothing);
        assert_eq!(state, cancelling(1, None));

        let mut state = running(1);
        let request = Id::Num(1);
        assert_eq!(
            state.step(|s| s.on_cancel(false)),
            Cancel::Answer { request }
        );
        assert!(state.is_idle());

        let mut state = PromptState::Idle;
        assert_eq!(state.step(|s| s.on_cancel(true)), Cancel::Nothing);
        assert!(state.is_idle());
    }

    #[test]
    fn a_turn_end_answers_and_takes_the_queued_prompt() {
        let mut state = running(1);
        assert_eq!(
            state.step(PromptState::on_turn_end),
            answer(1, Ok(json!({"stopReason": "end_turn"})), None)
        );
        assert!(state.is_idle());

        let mut state = cancelling(1, Some(deferred(2)));
        assert_eq!(
            state.step(PromptState::on_turn_end),
            answer(1, Ok(json!({"stopReason": "cancelled"})), Some(deferred(2)))
        );
        assert!(state.is_idle());

        let mut state = PromptState::Idle;
        assert_eq!(state.step(PromptState::on_turn_end), None);
        assert!(state.is_idle());
    }

    #[test]
    fn a_run_end_answers_with_its_stop_reason() {
        let meta = json!({"caliban/turns": 2});
        for (why, stop) in [
            (StopCondition::EndOfTurn, "end_turn"),
            (StopCondition::Cancelled, "cancelled"),
            (StopCondition::MaxTokensExhausted, "max_tokens"),
            (StopCondition::MaxTurnsReached(3), "max_turn_requests"),
            (StopCondition::Refusal("no".into()), "refusal"),
            (StopCondition::ContentFilter("no".into()), "refusal"),
        ] {
            let mut state = running(1);
            let got = state.step(|s| s.on_run_end(&why, Some(meta.clone())));
            let want = json!({"stopReason": stop, "_meta": meta});
            assert_eq!(got, answer(1, Ok(want), None), "{why:?}");
            assert!(state.is_idle());
        }

        let mut state = running(1);
        let got = state.step(|s| s.on_run_end(&StopCondition::EndOfTurn, None));
        assert_eq!(got, answer(1, Ok(json!({"stopReason": "end_turn"})), None));

        let why = StopCondition::ProviderError("overloaded".into());
        let mut state = running(1);
        let got = state.step(|s| s.on_run_end(&why, Some(meta.clone())));
        let error = RpcError::new(INTERNAL_ERROR, "overloaded");
        assert_eq!(got, answer(1, Err(error), None));

        let why = StopCondition::StreamIdle(Duration::from_millis(1500));
        let mut state = running(1);
        let got = state.step(|s| s.on_run_end(&why, None));
        let error = RpcError::new(INTERNAL_ERROR, "the model stream was idle for 1.5 s");
        assert_eq!(got, answer(1, Err(error), None));
    }

    #[test]
    fn a_cancelled_run_is_answered_cancelled_whatever_stopped_it() {
        let meta = json!({"caliban/turns": 1});
        for why in [
            StopCondition::EndOfTurn,
            StopCondition::ProviderError("gone".into()),
            StopCondition::StreamIdle(Duration::from_secs(1)),
        ] {
            let mut state = cancelling(1, Some(deferred(2)));
            let got = state.step(|s| s.on_run_end(&why, Some(meta.clone())));
            let want = json!({"stopReason": "cancelled", "_meta": meta});
            assert_eq!(got, answer(1, Ok(want), Some(deferred(2))), "{why:?}");
            assert!(state.is_idle());
        }
    }

    #[test]
    fn a_run_end_leaves_an_idle_prompt_alone() {
        let mut state = PromptState::Idle;
        assert_eq!(
            state.step(|s| s.on_run_end(&StopCondition::EndOfTurn, None)),
            None
        );
        assert!(state.is_idle());
    }

    #[test]
    fn a_cancel_request_names_the_prompt_in_flight_not_the_queued_one() {
        assert_eq!(PromptState::Idle.request(), None);
        assert_eq!(running(1).request(), Some(&Id::Num(1)));
        assert_eq!(
            cancelling(1, Some(deferred(2))).request(),
            Some(&Id::Num(1))
        );
    }
}
