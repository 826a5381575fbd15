//! `TurnEvent`, the run's observable stream, with upstream's exact JSON shape
//! (`reference/upstream-caliban.md` §6.1): internally tagged by PascalCase `type`, snake_case
//! fields, `Duration` as `{"secs","nanos"}`, `StopCondition` externally tagged.

use std::io;
use std::time::Duration;

use serde::Serialize;
use serde_json::{Map, Value, json};

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

    /// Writes the event's JSON into `out`, field by field: building a tree for each delta
    /// was most of the cost of recording a stream.
    pub fn write_json(&self, out: &mut Vec<u8>) -> io::Result<()> {
        let mut line = Line { out, first: true };
        self.fields(&mut line)?;
        line.out.push(b'}');
        Ok(())
    }

    /// The event's JSON as a tree, for a caller that inspects it before writing it (a session
    /// log checks how deep it nests).
    pub fn to_json(&self) -> Value {
        let mut tree = Map::new();
        // Nothing here can fail: every value is JSON, every key a string.
        let _ = self.fields(&mut tree);
        Value::Object(tree)
    }

    /// The one description of each event's JSON: its fields, in the order of their keys
    /// (upstream's events are `serde_json::Value` trees, which write their keys sorted: byte
    /// order, so `turn_index` before `type`). Nested conversation parts (messages, blocks,
    /// usage) are their own `to_json` trees, as a session file reads them back.
    fn fields(&self, f: &mut impl Fields) -> io::Result<()> {
        let ty = self.type_name();
        let values = |items: &[Message]| Value::Array(items.iter().map(Message::to_json).collect());
        match self {
            TurnEvent::TurnStart {
                turn_index,
                message_id,
                model,
            } => {
                f.field("message_id", message_id)?;
                f.field("model", model)?;
                f.field("turn_index", turn_index)?;
                f.field("type", ty)?;
                Ok(())
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
            } => {
                f.field("content_block_index", content_block_index)?;
                f.field("text", text)?;
                f.field("turn_index", turn_index)?;
                f.field("type", ty)?;
                Ok(())
            }
            TurnEvent::ToolCallStart {
                turn_index,
                tool_use_id,
                name,
            } => {
                f.field("name", name)?;
                f.field("tool_use_id", tool_use_id)?;
                f.field("turn_index", turn_index)?;
                f.field("type", ty)?;
                Ok(())
            }
            TurnEvent::ToolCallInputDelta {
                turn_index,
                tool_use_id,
                partial_json,
            } => {
                f.field("partial_json", partial_json)?;
                f.field("tool_use_id", tool_use_id)?;
                f.field("turn_index", turn_index)?;
                f.field("type", ty)?;
                Ok(())
            }
            TurnEvent::ToolCallEnd {
                turn_index,
                tool_use_id,
                is_error,
                content,
                result_text,
                truncated,
            } => {
                let content: Vec<Value> = content.iter().map(ContentBlock::to_json).collect();
                f.tree("content", Value::Array(content))?;
                f.field("is_error", is_error)?;
                f.field("result_text", result_text)?;
                f.field("tool_use_id", tool_use_id)?;
                f.field("truncated", truncated)?;
                f.field("turn_index", turn_index)?;
                f.field("type", ty)?;
                Ok(())
            }
            TurnEvent::TurnEnd {
                turn_index,
                assistant_message,
                tool_results,
                stop_reason,
                usage,
                ttft,
                tbt,
            } => {
                f.tree("assistant_message", assistant_message.to_json())?;
                f.field("stop_reason", stop_reason.as_str())?;
                f.tree("tbt", tbt.map_or(Value::Null, duration_json))?;
                f.tree("tool_results", values(tool_results))?;
                f.tree("ttft", ttft.map_or(Value::Null, duration_json))?;
                f.field("turn_index", turn_index)?;
                f.field("type", ty)?;
                f.tree("usage", usage.to_json())?;
                Ok(())
            }
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
            } => {
                f.tree("messages", values(messages))?;
                f.field("messages_kept", messages_kept)?;
                f.field("messages_summarized", messages_summarized)?;
                f.field("post_tokens", post_tokens)?;
                f.field("pre_tokens", pre_tokens)?;
                f.field("summary", summary)?;
                f.field("trigger", trigger.as_str())?;
                f.field("turn_index", turn_index)?;
                f.field("type", ty)?;
                f.tree("usage", usage.to_json())?;
                Ok(())
            }
            TurnEvent::PlanUpdate {
                turn_index,
                tool_use_id,
                todos,
            } => {
                let todos: Vec<Value> = todos.iter().map(Todo::to_json).collect();
                f.tree("todos", Value::Array(todos))?;
                f.field("tool_use_id", tool_use_id)?;
                f.field("turn_index", turn_index)?;
                f.field("type", ty)?;
                Ok(())
            }
            TurnEvent::RunEnd {
                final_messages,
                total_usage,
                turn_count,
                stopped_for,
                turns_without_edit,
                no_edit_nudge_emitted,
            } => {
                f.tree("final_messages", values(final_messages))?;
                f.field("no_edit_nudge_emitted", no_edit_nudge_emitted)?;
                f.tree("stopped_for", stopped_for.to_json())?;
                f.tree("total_usage", total_usage.to_json())?;
                f.field("turn_count", turn_count)?;
                f.field("turns_without_edit", turns_without_edit)?;
                f.field("type", ty)?;
                Ok(())
            }
        }
    }
}

/// Where an event's fields go, each once and in key order.
trait Fields {
    fn field<T: Serialize + ?Sized>(&mut self, key: &'static str, value: &T) -> io::Result<()>;

    /// A nested part already built as a tree, which a tree takes as it is.
    fn tree(&mut self, key: &'static str, value: Value) -> io::Result<()> {
        self.field(key, &value)
    }
}

/// Fields written as one JSON object, the keys as they stand (they need no escapes).
struct Line<'a> {
    out: &'a mut Vec<u8>,
    first: bool,
}

impl Fields for Line<'_> {
    fn field<T: Serialize + ?Sized>(&mut self, key: &'static str, value: &T) -> io::Result<()> {
        self.out.push(if self.first { b'{' } else { b',' });
        self.first = false;
        self.out.push(b'"');
        self.out.extend_from_slice(key.as_bytes());
        self.out.extend_from_slice(b"\":");
        Ok(serde_json::to_writer(&mut *self.out, value)?)
    }
}

impl Fields for Map<String, Value> {
    fn field<T: Serialize + ?Sized>(&mut self, key: &'static str, value: &T) -> io::Result<()> {
        self.tree(key, serde_json::to_value(value)?)
    }

    fn tree(&mut self, key: &'static str, value: Value) -> io::Result<()> {
        self.insert(key.to_owned(), value);
        Ok(())
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

    /// One of every variant, with the fields that change a shape (options, nested lists).
    fn every_variant() -> Vec<TurnEvent> {
        use crate::tools::todo::TodoStatus;
        let usage = Usage {
            input_tokens: 12,
            output_tokens: 3,
            cache_creation_input_tokens: None,
            cache_read_input_tokens: Some(8),
        };
        let assistant = Message {
            role: crate::model::types::Role::Assistant,
            content: vec![
                ContentBlock::text("hé \"q\"\n"),
                ContentBlock::ToolUse {
                    id: "toolu_1".into(),
                    name: "Read".into(),
                    input: json!({"path": "a.rs", "deep": {"z": [1, 2.5, null]}}),
                },
            ],
        };
        vec![
            TurnEvent::TurnStart {
                turn_index: 0,
                message_id: "msg_1".into(),
                model: "claude".into(),
            },
            TurnEvent::AssistantTextDelta {
                turn_index: 1,
                content_block_index: 2,
                text: "quote \" backslash \\ nul \u{0} é 🦀".into(),
            },
            TurnEvent::AssistantThinkingDelta {
                turn_index: u32::MAX,
                content_block_index: 0,
                text: String::new(),
            },
            TurnEvent::ToolCallStart {
                turn_index: 1,
                tool_use_id: "toolu_1".into(),
                name: "Read".into(),
            },
            TurnEvent::ToolCallInputDelta {
                turn_index: 1,
                tool_use_id: "toolu_\"x".into(),
                partial_json: "{\"path\": \"a\\nb\"".into(),
            },
            TurnEvent::ToolCallEnd {
                turn_index: 1,
                tool_use_id: "toolu_1".into(),
                is_error: true,
                content: vec![ContentBlock::text("no")],
                result_text: "no".into(),
                truncated: false,
            },
            TurnEvent::TurnEnd {
                turn_index: 1,
                assistant_message: assistant.clone(),
                tool_results: vec![Message::user_text("r")],
                stop_reason: StopReason::ToolUse,
                usage,
                ttft: Some(Duration::from_millis(1500)),
                tbt: None,
            },
            TurnEvent::Compaction {
                turn_index: 2,
                trigger: Trigger::Manual,
                pre_tokens: 9000,
                post_tokens: 800,
                messages_summarized: 6,
                messages_kept: 2,
                summary: "so far".into(),
                messages: vec![Message::user_text("s")],
                usage: Usage::default(),
            },
            TurnEvent::PlanUpdate {
                turn_index: 2,
                tool_use_id: "toolu_2".into(),
                todos: vec![Todo {
                    id: "1".into(),
                    content: "plan".into(),
                    status: TodoStatus::InProgress,
                }],
            },
            TurnEvent::RunEnd {
                final_messages: vec![assistant],
                total_usage: usage,
                turn_count: 3,
                stopped_for: StopCondition::StreamIdle(Duration::from_millis(2)),
                turns_without_edit: 1,
                no_edit_nudge_emitted: true,
            },
        ]
    }

    /// The bytes of every variant, as upstream's `Value` bodies write them (keys sorted).
    #[test]
    fn every_variant_is_written_with_upstream_bytes() {
        let expected = [
            r#"{"message_id":"msg_1","model":"claude","turn_index":0,"type":"TurnStart"}"#,
            r#"{"content_block_index":2,"text":"quote \" backslash \\ nul \u0000 é 🦀","turn_index":1,"type":"AssistantTextDelta"}"#,
            r#"{"content_block_index":0,"text":"","turn_index":4294967295,"type":"AssistantThinkingDelta"}"#,
            r#"{"name":"Read","tool_use_id":"toolu_1","turn_index":1,"type":"ToolCallStart"}"#,
            r#"{"partial_json":"{\"path\": \"a\\nb\"","tool_use_id":"toolu_\"x","turn_index":1,"type":"ToolCallInputDelta"}"#,
            r#"{"content":[{"text":"no","type":"text"}],"is_error":true,"result_text":"no","tool_use_id":"toolu_1","truncated":false,"turn_index":1,"type":"ToolCallEnd"}"#,
            r#"{"assistant_message":{"content":[{"text":"hé \"q\"\n","type":"text"},{"id":"toolu_1","input":{"deep":{"z":[1,2.5,null]},"path":"a.rs"},"name":"Read","type":"tool_use"}],"role":"assistant"},"stop_reason":"tool_use","tbt":null,"tool_results":[{"content":[{"text":"r","type":"text"}],"role":"user"}],"ttft":{"nanos":500000000,"secs":1},"turn_index":1,"type":"TurnEnd","usage":{"cache_read_input_tokens":8,"input_tokens":12,"output_tokens":3}}"#,
            r#"{"messages":[{"content":[{"text":"s","type":"text"}],"role":"user"}],"messages_kept":2,"messages_summarized":6,"post_tokens":800,"pre_tokens":9000,"summary":"so far","trigger":"manual","turn_index":2,"type":"Compaction","usage":{"input_tokens":0,"output_tokens":0}}"#,
            r#"{"todos":[{"content":"plan","id":"1","status":"in_progress"}],"tool_use_id":"toolu_2","turn_index":2,"type":"PlanUpdate"}"#,
            r#"{"final_messages":[{"content":[{"text":"hé \"q\"\n","type":"text"},{"id":"toolu_1","input":{"deep":{"z":[1,2.5,null]},"path":"a.rs"},"name":"Read","type":"tool_use"}],"role":"assistant"}],"no_edit_nudge_emitted":true,"stopped_for":{"StreamIdle":{"nanos":2000000,"secs":0}},"total_usage":{"cache_read_input_tokens":8,"input_tokens":12,"output_tokens":3},"turn_count":3,"turns_without_edit":1,"type":"RunEnd"}"#,
        ];
        let events = every_variant();
        assert_eq!(events.len(), expected.len());
        for (event, expected) in events.iter().zip(expected) {
            let mut written = Vec::new();
            event.write_json(&mut written).unwrap();
            assert_eq!(String::from_utf8(written).unwrap(), expected);
            // The tree is the same JSON, and a `Value` writes its keys sorted: a key written
            // out of order would show here too.
            assert_eq!(event.to_json().to_string(), expected);
        }
        assert!(events[1].is_delta() && events[4].is_delta() && !events[0].is_delta());
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
