//! `TurnEvent`, the run's observable stream, with upstream's exact JSON shape
//! (`reference/upstream-caliban.md` §6.1): internally tagged by PascalCase `type`, snake_case
//! fields, `Duration` as `{"secs","nanos"}`, `StopCondition` externally tagged.

use std::io::{self, Write};
use std::time::Duration;

use serde_json::{Value, json};

use crate::agent::compact::Trigger;
use crate::model::types::{ContentBlock, Message, StopReason, Usage};
use crate::tools::todo::Todo;

/// Upstream caps `ToolCallEnd.result_text` at this many characters (head kept).
pub const STREAM_RESULT_TEXT_CAP: usize = 8 * 1024;

/// Why a run ended (upstream `StopCondition`).
#[derive(Clone, Debug, PartialEq)]
pub enum StopCondition {
    EndOfTurn,
    Cancelled,
    MaxTokensExhausted,
    MaxTurnsReached(u32),
    ProviderError(String),
    Refusal(String),
    ContentFilter(String),
    StreamIdle(Duration),
    /// The summary that would have let the conversation go on could not be had.
    CompactionFailed(String),
}

impl StopCondition {
    pub fn to_json(&self) -> Value {
        match self {
            StopCondition::EndOfTurn => json!("EndOfTurn"),
            StopCondition::Cancelled => json!("Cancelled"),
            StopCondition::MaxTokensExhausted => json!("MaxTokensExhausted"),
            StopCondition::MaxTurnsReached(n) => json!({"MaxTurnsReached": n}),
            StopCondition::ProviderError(e) => json!({"ProviderError": e}),
            StopCondition::Refusal(e) => json!({"Refusal": e}),
            StopCondition::ContentFilter(e) => json!({"ContentFilter": e}),
            StopCondition::StreamIdle(d) => json!({"StreamIdle": duration_json(*d)}),
            StopCondition::CompactionFailed(e) => json!({"CompactionFailed": e}),
        }
    }
}

pub fn duration_json(d: Duration) -> Value {
    json!({"secs": d.as_secs(), "nanos": d.subsec_nanos()})
}

#[derive(Clone, Debug, PartialEq)]
pub enum TurnEvent {
    TurnStart {
        turn_index: u32,
        message_id: String,
        model: String,
    },
    AssistantTextDelta {
        turn_index: u32,
        content_block_index: u32,
        text: String,
    },
    AssistantThinkingDelta {
        turn_index: u32,
        content_block_index: u32,
        text: String,
    },
    ToolCallStart {
        turn_index: u32,
        tool_use_id: String,
        name: String,
    },
    ToolCallInputDelta {
        turn_index: u32,
        tool_use_id: String,
        partial_json: String,
    },
    ToolCallEnd {
        turn_index: u32,
        tool_use_id: String,
        is_error: bool,
        content: Vec<ContentBlock>,
        result_text: String,
        truncated: bool,
    },
    TurnEnd {
        turn_index: u32,
        assistant_message: Message,
        tool_results: Vec<Message>,
        stop_reason: StopReason,
        usage: Usage,
        ttft: Option<Duration>,
        tbt: Option<Duration>,
    },
    /// The older conversation was replaced by a summary (not one of upstream's eight: its
    /// runs compact inside the provider layer and say nothing). `messages` replace the
    /// summarised ones and the last `messages_kept` stay, which is how a session file
    /// replays it (`agent::compact::replay`).
    Compaction {
        turn_index: u32,
        trigger: Trigger,
        /// The estimated size of the context before and after.
        pre_tokens: u64,
        post_tokens: u64,
        messages_summarized: u32,
        messages_kept: u32,
        summary: String,
        messages: Vec<Message>,
        /// What the summary request cost.
        usage: Usage,
    },
    /// The model's plan, after a `TodoWrite` call changed it: the whole list. Not one of
    /// upstream's eight variants (it has no plan event); it comes between the call's
    /// `ToolCallStart` and `ToolCallEnd`.
    PlanUpdate {
        turn_index: u32,
        tool_use_id: String,
        todos: Vec<Todo>,
    },
    RunEnd {
        final_messages: Vec<Message>,
        total_usage: Usage,
        turn_count: u32,
        stopped_for: StopCondition,
        turns_without_edit: u32,
        no_edit_nudge_emitted: bool,
    },
}

impl TurnEvent {
    pub fn type_name(&self) -> &'static str {
        match self {
            TurnEvent::TurnStart { .. } => "TurnStart",
            TurnEvent::AssistantTextDelta { .. } => "AssistantTextDelta",
            TurnEvent::AssistantThinkingDelta { .. } => "AssistantThinkingDelta",
            TurnEvent::ToolCallStart { .. } => "ToolCallStart",
            TurnEvent::ToolCallInputDelta { .. } => "ToolCallInputDelta",
            TurnEvent::ToolCallEnd { .. } => "ToolCallEnd",
            TurnEvent::TurnEnd { .. } => "TurnEnd",
            TurnEvent::Compaction { .. } => "Compaction",
            TurnEvent::PlanUpdate { .. } => "PlanUpdate",
            TurnEvent::RunEnd { .. } => "RunEnd",
        }
    }

    /// A streamed delta (text, thinking, tool input): nearly every event of a stream, and
    /// flat (its JSON nests one level).
    pub fn is_delta(&self) -> bool {
        matches!(
            self,
            TurnEvent::AssistantTextDelta { .. }
                | TurnEvent::AssistantThinkingDelta { .. }
                | TurnEvent::ToolCallInputDelta { .. }
        )
    }

    /// Writes `to_json`'s JSON into `out`, byte for byte (keys in the same sorted order).
    /// Deltas are written field by field: building a `Value` tree for each was most of the
    /// cost of recording a stream.
    pub fn write_json(&self, out: &mut Vec<u8>) -> io::Result<()> {
        let ty = self.type_name();
        match self {
            TurnEvent::AssistantTextDelta {
                turn_index,
                content_block_index,
                text,
            }
            | TurnEvent::AssistantThinkingDelta {
                turn_index,
                content_block_index,
                text,
            } => {
                write!(
                    out,
                    "{{\"content_block_index\":{content_block_index},\"text\":"
                )?;
                serde_json::to_writer(&mut *out, text)?;
                write!(out, ",\"turn_index\":{turn_index},\"type\":\"{ty}\"}}")?;
            }
            TurnEvent::ToolCallInputDelta {
                turn_index,
                tool_use_id,
                partial_json,
            } => {
                out.extend_from_slice(b"{\"partial_json\":");
                serde_json::to_writer(&mut *out, partial_json)?;
                out.extend_from_slice(b",\"tool_use_id\":");
                serde_json::to_writer(&mut *out, tool_use_id)?;
                write!(out, ",\"turn_index\":{turn_index},\"type\":\"{ty}\"}}")?;
            }
            _ => serde_json::to_writer(&mut *out, &self.to_json())?,
        }
        Ok(())
    }

    pub fn to_json(&self) -> Value {
        let ty = self.type_name();
        match self {
            TurnEvent::TurnStart {
                turn_index,
                message_id,
                model,
            } => {
                json!({"type": ty, "turn_index": turn_index, "message_id": message_id, "model": model})
            }
            TurnEvent::AssistantTextDelta {
                turn_index,
                content_block_index,
                text,
            }
            | TurnEvent::AssistantThinkingDelta {
                turn_index,
                content_block_index,
                text,
            } => json!({"type": ty, "turn_index": turn_index,
                        "content_block_index": content_block_index, "text": text}),
            TurnEvent::ToolCallStart {
                turn_index,
                tool_use_id,
                name,
            } => {
                json!({"type": ty, "turn_index": turn_index, "tool_use_id": tool_use_id, "name": name})
            }
            TurnEvent::ToolCallInputDelta {
                turn_index,
                tool_use_id,
                partial_json,
            } => json!({"type": ty, "turn_index": turn_index, "tool_use_id": tool_use_id,
                        "partial_json": partial_json}),
            TurnEvent::ToolCallEnd {
                turn_index,
                tool_use_id,
                is_error,
                content,
                result_text,
                truncated,
            } => json!({"type": ty, "turn_index": turn_index, "tool_use_id": tool_use_id,
                        "is_error": is_error,
                        "content": content.iter().map(ContentBlock::to_json).collect::<Vec<_>>(),
                        "result_text": result_text, "truncated": truncated}),
            TurnEvent::TurnEnd {
                turn_index,
                assistant_message,
                tool_results,
                stop_reason,
                usage,
                ttft,
                tbt,
            } => json!({"type": ty, "turn_index": turn_index,
                        "assistant_message": assistant_message.to_json(),
                        "tool_results": tool_results.iter().map(Message::to_json).collect::<Vec<_>>(),
                        "stop_reason": stop_reason.as_str(), "usage": usage.to_json(),
                        "ttft": ttft.map(duration_json), "tbt": tbt.map(duration_json)}),
            TurnEvent::Compaction {
                turn_index,
                trigger,
                pre_tokens,
                post_tokens,
                messages_summarized,
                messages_kept,
                summary,
                messages,
                usage,
            } => json!({"type": ty, "turn_index": turn_index, "trigger": trigger.as_str(),
                        "pre_tokens": pre_tokens, "post_tokens": post_tokens,
                        "messages_summarized": messages_summarized,
                        "messages_kept": messages_kept, "summary": summary,
                        "messages": messages.iter().map(Message::to_json).collect::<Vec<_>>(),
                        "usage": usage.to_json()}),
            TurnEvent::PlanUpdate {
                turn_index,
                tool_use_id,
                todos,
            } => json!({"type": ty, "turn_index": turn_index, "tool_use_id": tool_use_id,
                        "todos": todos.iter().map(Todo::to_json).collect::<Vec<_>>()}),
            TurnEvent::RunEnd {
                final_messages,
                total_usage,
                turn_count,
                stopped_for,
                turns_without_edit,
                no_edit_nudge_emitted,
            } => json!({"type": ty,
                        "final_messages": final_messages.iter().map(Message::to_json).collect::<Vec<_>>(),
                        "total_usage": total_usage.to_json(), "turn_count": turn_count,
                        "stopped_for": stopped_for.to_json(),
                        "turns_without_edit": turns_without_edit,
                        "no_edit_nudge_emitted": no_edit_nudge_emitted}),
        }
    }
}

/// Flattens a tool result to upstream's `result_text`: text blocks joined by `\n`, head-capped
/// at `STREAM_RESULT_TEXT_CAP` characters. Returns the text and whether it was cut.
pub fn result_text(content: &[ContentBlock]) -> (String, bool) {
    let joined = content
        .iter()
        .filter_map(|b| match b {
            ContentBlock::Text { text } => Some(text.as_str()),
            _ => None,
        })
        .collect::<Vec<_>>()
        .join("\n");
    match crate::text::cut_chars(&joined, STREAM_RESULT_TEXT_CAP) {
        Some((kept, _)) => (kept.to_owned(), true),
        None => (joined, false),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deltas_are_written_as_to_json_serialises_them() {
        let awkward = "quote \" backslash \\ newline \n tab \t nul \u{0} é 🦀 \u{2028}";
        let events = [
            TurnEvent::AssistantTextDelta {
                turn_index: 3,
                content_block_index: 1,
                text: awkward.into(),
            },
            TurnEvent::AssistantThinkingDelta {
                turn_index: u32::MAX,
                content_block_index: 0,
                text: String::new(),
            },
            TurnEvent::ToolCallInputDelta {
                turn_index: 0,
                tool_use_id: "toolu_\"x".into(),
                partial_json: "{\"path\": \"a\\nb\"".into(),
            },
        ];
        for event in &events {
            assert!(event.is_delta());
            let mut fast = Vec::new();
            event.write_json(&mut fast).unwrap();
            let slow = serde_json::to_vec(&event.to_json()).unwrap();
            assert_eq!(
                String::from_utf8(fast).unwrap(),
                String::from_utf8(slow).unwrap()
            );
        }
        let start = TurnEvent::TurnStart {
            turn_index: 0,
            message_id: "m".into(),
            model: "x".into(),
        };
        assert!(!start.is_delta());
        let mut out = Vec::new();
        start.write_json(&mut out).unwrap();
        assert_eq!(out, serde_json::to_vec(&start.to_json()).unwrap());
    }

    #[test]
    fn upstream_fixtures() {
        let end = TurnEvent::ToolCallEnd {
            turn_index: 0,
            tool_use_id: "toolu_01".into(),
            is_error: false,
            content: vec![ContentBlock::text("ok")],
            result_text: "ok".into(),
            truncated: false,
        };
        assert_eq!(
            end.to_json().to_string(),
            r#"{"content":[{"text":"ok","type":"text"}],"is_error":false,"result_text":"ok","tool_use_id":"toolu_01","truncated":false,"turn_index":0,"type":"ToolCallEnd"}"#
        );
        let run_end = TurnEvent::RunEnd {
            final_messages: vec![],
            total_usage: Usage::default(),
            turn_count: 1,
            stopped_for: StopCondition::EndOfTurn,
            turns_without_edit: 0,
            no_edit_nudge_emitted: false,
        };
        let v = run_end.to_json();
        assert_eq!(v["stopped_for"], json!("EndOfTurn"));
        assert_eq!(
            v["total_usage"],
            json!({"input_tokens":0,"output_tokens":0})
        );
        assert_eq!(
            StopCondition::MaxTurnsReached(50).to_json(),
            json!({"MaxTurnsReached": 50})
        );
        assert_eq!(
            StopCondition::StreamIdle(Duration::from_millis(1500)).to_json(),
            json!({"StreamIdle": {"secs": 1, "nanos": 500_000_000}})
        );
    }

    #[test]
    fn result_text_caps_by_chars() {
        let long = "é".repeat(STREAM_RESULT_TEXT_CAP + 5);
        let (text, truncated) = result_text(&[ContentBlock::text(long)]);
        assert!(truncated);
        assert_eq!(text.chars().count(), STREAM_RESULT_TEXT_CAP);
        let (text, truncated) = result_text(&[ContentBlock::text("a"), ContentBlock::text("b")]);
        assert_eq!((text.as_str(), truncated), ("a\nb", false));
    }
}
