//! A run's `TurnEvent`s as `session/update`s: message and thought chunks, and the tool-call
//! cards (`tool_call`, then `tool_call_update`s) with their streamed input, shown as soon as
//! it is complete, and their end.

use serde_json::{Map, Value, json};

use super::card::{self, Described, JsonEnd, OldText};
use super::{AcpKey, AcpServe};
use crate::agent::compact::Trigger;
use crate::agent::event::{StopCondition, TurnEvent};
use crate::agent::tool_input::ToolInput;
use crate::engine::RetryNotice;
use crate::ids::HostKey;
use crate::model::types::ContentBlock;
use crate::surface::host::Cx;

/// How a compaction ended, for `show_compaction`.
#[derive(Debug, PartialEq)]
pub(super) enum Compacted<'a> {
    Done(&'a str),
    Failed(&'a str),
    Cancelled,
}

/// A tool call's card while the call is open.
pub(super) struct Card {
    name: String,
    /// The streamed input, for `rawInput`: capped as the run caps it, so past the cap it
    /// stays a clean prefix, never fragments spliced around a gap.
    input: ToolInput,
    scan: JsonEnd,
    /// Title, locations and content were sent.
    described: bool,
    /// Content later updates keep (a diff, an embedded terminal).
    pub(super) content: Vec<Value>,
}

fn text_content(text: &str) -> Value {
    json!({"type": "content", "content": {"type": "text", "text": text}})
}

impl<H: HostKey> AcpServe<H> {
    pub(super) fn translate(&mut self, ctx: &mut Cx<AcpKey<H>>, sid: &str, event: &TurnEvent) {
        let Some(session) = self.sessions.get_mut(sid) else {
            return;
        };
        match event {
            TurnEvent::AssistantTextDelta { text, .. } => {
                self.outbox.chunk(sid, "agent_message_chunk", text);
            }
            TurnEvent::AssistantThinkingDelta { text, .. } => {
                self.outbox.chunk(sid, "agent_thought_chunk", text);
            }
            TurnEvent::ToolCallStart {
                tool_use_id, name, ..
            } => {
                let wire = session.ids.open(tool_use_id);
                session.cards.insert(
                    wire.clone(),
                    Card {
                        name: name.clone(),
                        input: ToolInput::default(),
                        scan: JsonEnd::default(),
                        described: false,
                        content: Vec::new(),
                    },
                );
                self.outbox.open_card(
                    sid,
                    &wire,
                    json!({"sessionUpdate": "tool_call", "toolCallId": wire,
                           "title": name, "name": name, "kind": card::kind(name),
                           "status": "pending"}),
                );
            }
            TurnEvent::ToolCallInputDelta {
                tool_use_id,
                partial_json,
                ..
            } => {
                let Some(wire) = session.ids.streaming(tool_use_id).map(str::to_owned) else {
                    return;
                };
                let Some(card) = session.cards.get_mut(&wire) else {
                    return;
                };
                card.input.push(partial_json);
                if !card.described && card.scan.feed(partial_json) {
                    // The input is complete: show it now rather than after the whole turn.
                    if let Ok(input @ Value::Object(_)) =
                        serde_json::from_str::<Value>(card.input.text())
                    {
                        self.show_input(sid, &wire, &input);
                    }
                }
            }
            TurnEvent::ToolCallEnd {
                tool_use_id,
                is_error,
                result_text,
                content: result,
                ..
            } => {
                // A call whose opening this session never saw keeps the model's id.
                let wire = session
                    .ids
                    .close(tool_use_id)
                    .unwrap_or_else(|| tool_use_id.clone());
                let card = session.cards.remove(&wire);
                let task = session.tasks.remove(&wire);
                let raw = card.as_ref().and_then(|c| card::raw_input(c.input.text()));
                let mut content = card.map(|c| c.content).unwrap_or_default();
                if !result_text.is_empty() {
                    content.push(text_content(result_text));
                }
                // The pictures the model was shown (`Read` of an image, an MCP tool's).
                content.extend(
                    result
                        .iter()
                        .filter(|b| matches!(b, ContentBlock::Image { .. }))
                        .map(|b| card::image_content(&b.to_json())),
                );
                let mut update = json!({
                    "sessionUpdate": "tool_call_update",
                    "toolCallId": wire,
                    "status": if *is_error { "failed" } else { "completed" },
                    "content": content,
                });
                if let Some(raw) = raw {
                    update["rawInput"] = raw;
                }
                self.outbox.update(sid, update);
                if let Some(task) = task {
                    self.drop_task(ctx, sid, task);
                }
            }
            TurnEvent::RunEnd {
                total_usage,
                turn_count,
                stopped_for,
                ..
            } => {
                session.run_end = Some(json!({
                    "caliban/usage": total_usage.to_json(),
                    "caliban/turns": turn_count,
                }));
                // A compaction still open ended with the run.
                match stopped_for {
                    StopCondition::CompactionFailed(error) => {
                        self.show_compaction(sid, Compacted::Failed(error), json!({}))
                    }
                    StopCondition::Cancelled => {
                        self.show_compaction(sid, Compacted::Cancelled, json!({}))
                    }
                    _ => {}
                }
                let Some(session) = self.sessions.get_mut(sid) else {
                    return;
                };
                let why = match stopped_for {
                    StopCondition::Cancelled => "cancelled".to_owned(),
                    other => format!("not run: the run ended ({})", other.to_json()),
                };
                session.ids.close_all();
                let mut open: Vec<(String, Card)> = session.cards.drain().collect();
                open.sort_by(|a, b| a.0.cmp(&b.0));
                for (id, card) in open {
                    let mut content = card.content;
                    content.push(text_content(&why));
                    let mut update = json!({"sessionUpdate": "tool_call_update",
                        "toolCallId": id, "status": "failed", "content": content});
                    if let Some(raw) = card::raw_input(card.input.text()) {
                        update["rawInput"] = raw;
                    }
                    self.outbox.update(sid, update);
                }
                if let Some(session) = self.sessions.get_mut(sid) {
                    let tasks = std::mem::take(&mut session.tasks);
                    self.abandon_tasks(ctx, sid, tasks);
                }
            }
            TurnEvent::TurnEnd { usage, .. } => {
                session.usage.add(usage);
                let used = usage.input_tokens.saturating_add(usage.output_tokens);
                self.show_usage(ctx, sid, used);
            }
            TurnEvent::Compaction {
                trigger,
                pre_tokens,
                post_tokens,
                summary,
                usage,
                ..
            } => {
                session.usage.add(usage);
                let meta = json!({"caliban/compaction": {
                    "trigger": trigger.as_str(), "pre_tokens": pre_tokens,
                    "post_tokens": post_tokens}});
                self.show_compaction(sid, Compacted::Done(summary), meta);
                self.show_usage(ctx, sid, *post_tokens);
            }
            TurnEvent::TurnStart { .. } => {}
            TurnEvent::PlanUpdate { todos, .. } => {
                self.outbox.update(sid, card::plan_update(todos))
            }
        }
    }

    /// A compaction began: `in_progress` for a client that advertised
    /// `session.compaction` (its first update fixes where the editor shows it); nothing for
    /// one that did not.
    pub(super) fn compaction_started(&mut self, sid: &str, trigger: Trigger) {
        if !self.compaction {
            return;
        }
        let Some(session) = self.sessions.get_mut(sid) else {
            return;
        };
        self.next_compaction += 1;
        let id = format!("compaction-{}", self.next_compaction);
        session.compacting = Some(id.clone());
        self.outbox.update(
            sid,
            json!({"sessionUpdate": "compaction_update", "compactionId": id,
                   "status": "in_progress",
                   "_meta": {"caliban/compaction": {"trigger": trigger.as_str()}}}),
        );
    }

    /// How a compaction ended, as the client can show it: the `compaction_update` that
    /// closes the one in progress for a client that advertised `session.compaction`, else
    /// a thought chunk (like a retry), so the user still learns why the agent's memory of
    /// the early conversation is now a summary. A run that ends with no compaction open
    /// shows nothing for `Cancelled`.
    pub(super) fn show_compaction(&mut self, sid: &str, outcome: Compacted, meta: Value) {
        let Some(session) = self.sessions.get_mut(sid) else {
            return;
        };
        let open = session.compacting.take();
        if open.is_none() && outcome == Compacted::Cancelled {
            return;
        }
        let update = if self.compaction {
            let id = open.unwrap_or_else(|| {
                self.next_compaction += 1;
                format!("compaction-{}", self.next_compaction)
            });
            let mut update =
                json!({"sessionUpdate": "compaction_update", "compactionId": id, "_meta": meta});
            match outcome {
                Compacted::Done(summary) => {
                    update["status"] = json!("completed");
                    update["summary"] = json!([{"type": "text", "text": summary}]);
                }
                Compacted::Failed(error) => {
                    update["status"] = json!("failed");
                    update["error"] = json!(error);
                }
                Compacted::Cancelled => update["status"] = json!("cancelled"),
            }
            update
        } else {
            let text = match outcome {
                Compacted::Done(summary) => format!(
                    "The conversation was compacted to free the context window. Summary:\n\n{summary}\n\n"
                ),
                Compacted::Failed(error) => {
                    format!("Compacting the conversation failed: {error}\n\n")
                }
                Compacted::Cancelled => "Compacting the conversation was cancelled.\n\n".into(),
            };
            json!({"sessionUpdate": "agent_thought_chunk",
                   "content": {"type": "text", "text": text}, "_meta": meta})
        };
        self.outbox.update(sid, update);
    }

    /// `usage_update`: the context's size against the model's window, and what the session
    /// cost so far where the model's price is known. Not sent for a model whose window is
    /// unknown (`size` is required).
    pub(super) fn show_usage(&mut self, ctx: &mut Cx<AcpKey<H>>, sid: &str, used: u64) {
        let Some(session) = self.sessions.get(sid) else {
            return;
        };
        let Some(size) = ctx.core.config().context_windows.of(&session.model) else {
            return;
        };
        let mut update = json!({"sessionUpdate": "usage_update", "used": used, "size": size});
        if let Some(cost) = crate::model::catalog::cost_usd(&session.model, &session.usage) {
            update["cost"] = json!({"amount": cost, "currency": "USD"});
        }
        self.outbox.update(sid, update);
    }

    /// A retry of the model request, which would otherwise be seconds of nothing: a
    /// `notice` for a client that shows them (`session.notices`), else a thought chunk,
    /// which every editor renders in the turn's reasoning rather than in the answer (an
    /// agent message would read as the model's words, and merge with them). Print mode's
    /// `api_retry` fields ride along in `_meta`.
    pub(super) fn show_retry(&mut self, sid: &str, notice: &RetryNotice) {
        let why = match notice.status {
            Some(status) => format!("HTTP {status}, {}", notice.category),
            None => notice.category.to_owned(),
        };
        let retry = notice.attempt.saturating_sub(1);
        let title = format!(
            "The model request failed ({why}); retry {retry} of {} in {:.1} s",
            notice.max_retries,
            notice.delay.as_secs_f64()
        );
        let mut meta = json!({
            "attempt": notice.attempt, "max_retries": notice.max_retries,
            "retry_delay_ms": notice.delay.as_millis() as u64,
            "error_category": notice.category,
        });
        if let Some(status) = notice.status {
            meta["error_status"] = json!(status);
        }
        let meta = json!({"caliban/api_retry": meta});
        let update = if self.notices {
            json!({"sessionUpdate": "notice", "severity": "warning", "title": title,
                   "description": notice.message, "_meta": meta})
        } else {
            // Blank lines keep it apart from the model's own thinking in the same block.
            let text = format!("{title}: {}\n\n", notice.message);
            json!({"sessionUpdate": "agent_thought_chunk",
                   "content": {"type": "text", "text": text}, "_meta": meta})
        };
        self.outbox.update(sid, update);
    }

    /// The wire id of the call the model's `tool_use_id` names now (the one that runs, asks
    /// or is placed); the model's id for a call this session has no card of.
    pub(super) fn wire_id(&self, sid: &str, tool_use_id: &str) -> String {
        self.sessions
            .get(sid)
            .and_then(|s| s.ids.current(tool_use_id))
            .unwrap_or(tool_use_id)
            .to_owned()
    }

    /// Sends a card's title, input, locations and content once the input is known: joined
    /// to the opening `tool_call` if that is not written yet, else as an update. `tool` is
    /// the card's wire id.
    pub(super) fn show_input(&mut self, sid: &str, tool: &str, input: &Value) {
        let Some(session) = self.sessions.get_mut(sid) else {
            return;
        };
        let Some(card) = session.cards.get_mut(tool) else {
            return;
        };
        if card.described {
            return;
        }
        card.described = true;
        let Described {
            title,
            locations,
            content,
        } = card::describe(&card.name, input, &session.cwd, OldText::ReadFile);
        card.content = content.clone();
        let mut fields = Map::new();
        fields.insert("title".into(), json!(title));
        fields.insert("rawInput".into(), input.clone());
        if !locations.is_empty() {
            fields.insert("locations".into(), json!(locations));
        }
        if !content.is_empty() {
            fields.insert("content".into(), json!(content));
        }
        if !self.outbox.join_open_card(sid, tool, &fields) {
            let mut update = Map::new();
            update.insert("sessionUpdate".into(), json!("tool_call_update"));
            update.insert("toolCallId".into(), json!(tool));
            update.extend(fields);
            self.outbox.update(sid, Value::Object(update));
        }
    }
}
