//! Provider-neutral conversation types: messages, content blocks, usage and stop reasons.
//!
//! These are the shapes upstream serialises inside `TurnEvent`s (`reference/upstream-caliban.md`
//! §6.1): blocks tagged by snake_case `type`, usage with optional cache fields. Provider codecs
//! translate to and from their own wire shapes; nothing here knows about HTTP.

use serde_json::{Map, Value, json};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    User,
    Assistant,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum ContentBlock {
    Text {
        text: String,
    },
    Thinking {
        thinking: String,
        signature: Option<String>,
    },
    ToolUse {
        id: String,
        name: String,
        input: Value,
    },
    ToolResult {
        tool_use_id: String,
        content: Vec<ContentBlock>,
        is_error: bool,
    },
}

impl ContentBlock {
    pub fn text(text: impl Into<String>) -> ContentBlock {
        ContentBlock::Text { text: text.into() }
    }

    pub fn to_json(&self) -> Value {
        match self {
            ContentBlock::Text { text } => json!({"type": "text", "text": text}),
            ContentBlock::Thinking {
                thinking,
                signature,
            } => {
                let mut obj = json!({"type": "thinking", "thinking": thinking});
                if let Some(sig) = signature {
                    obj["signature"] = json!(sig);
                }
                obj
            }
            ContentBlock::ToolUse { id, name, input } => {
                json!({"type": "tool_use", "id": id, "name": name, "input": input})
            }
            ContentBlock::ToolResult {
                tool_use_id,
                content,
                is_error,
            } => json!({
                "type": "tool_result",
                "tool_use_id": tool_use_id,
                "content": content.iter().map(ContentBlock::to_json).collect::<Vec<_>>(),
                "is_error": is_error,
            }),
        }
    }

    /// Parses the upstream block shape; unknown block types are rejected so a session file
    /// written by a newer version fails loudly instead of being silently altered.
    pub fn from_json(value: &Value) -> Result<ContentBlock, String> {
        let str_field = |key: &str| -> Result<String, String> {
            value
                .get(key)
                .and_then(Value::as_str)
                .map(str::to_owned)
                .ok_or_else(|| format!("content block is missing string field `{key}`"))
        };
        match value.get("type").and_then(Value::as_str) {
            Some("text") => Ok(ContentBlock::Text {
                text: str_field("text")?,
            }),
            Some("thinking") => Ok(ContentBlock::Thinking {
                thinking: str_field("thinking")?,
                signature: value
                    .get("signature")
                    .and_then(Value::as_str)
                    .map(str::to_owned),
            }),
            Some("tool_use") => Ok(ContentBlock::ToolUse {
                id: str_field("id")?,
                name: str_field("name")?,
                input: value.get("input").cloned().unwrap_or_else(|| json!({})),
            }),
            Some("tool_result") => {
                let content = match value.get("content") {
                    Some(Value::Array(items)) => items
                        .iter()
                        .map(ContentBlock::from_json)
                        .collect::<Result<Vec<_>, _>>()?,
                    Some(Value::String(text)) => vec![ContentBlock::text(text.clone())],
                    _ => Vec::new(),
                };
                Ok(ContentBlock::ToolResult {
                    tool_use_id: str_field("tool_use_id")?,
                    content,
                    is_error: value
                        .get("is_error")
                        .and_then(Value::as_bool)
                        .unwrap_or(false),
                })
            }
            Some(other) => Err(format!("unknown content block type `{other}`")),
            None => Err("content block has no `type`".to_owned()),
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Message {
    pub role: Role,
    pub content: Vec<ContentBlock>,
}

impl Message {
    #[cfg(test)]
    pub fn user_text(text: impl Into<String>) -> Message {
        Message {
            role: Role::User,
            content: vec![ContentBlock::text(text)],
        }
    }

    pub fn to_json(&self) -> Value {
        json!({
            "role": self.role.as_str(),
            "content": self.content.iter().map(ContentBlock::to_json).collect::<Vec<_>>(),
        })
    }

    /// Model messages as session files and history headers store them: user and assistant
    /// messages with at least one block; another role, an empty message, or one with a
    /// block this build cannot read is left out (with a warning for the last).
    pub fn list_from_json(messages: &[Value]) -> Vec<Message> {
        let mut out = Vec::new();
        for message in messages {
            let role = match message.get("role").and_then(Value::as_str) {
                Some("user") => Role::User,
                Some("assistant") => Role::Assistant,
                _ => continue,
            };
            let blocks: Result<Vec<ContentBlock>, String> = message
                .get("content")
                .and_then(Value::as_array)
                .map(|blocks| blocks.iter().map(ContentBlock::from_json).collect())
                .unwrap_or_else(|| Ok(Vec::new()));
            match blocks {
                Ok(content) if !content.is_empty() => out.push(Message { role, content }),
                Ok(_) => {}
                Err(e) => crate::log::warn(&format!("leaving a message out of the history: {e}")),
            }
        }
        out
    }

    /// Concatenated text blocks, the "assistant text" of a turn.
    pub fn text(&self) -> String {
        let mut out = String::new();
        for block in &self.content {
            if let ContentBlock::Text { text } = block {
                out.push_str(text);
            }
        }
        out
    }
}

/// Token accounting. `input_tokens` is inclusive of cached input (upstream's convention);
/// the cache fields are subsets and are omitted from JSON when unknown.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cache_creation_input_tokens: Option<u64>,
    pub cache_read_input_tokens: Option<u64>,
}

impl Usage {
    pub fn add(&mut self, other: &Usage) {
        // Counts come from the model server: saturate rather than overflow on nonsense.
        self.input_tokens = self.input_tokens.saturating_add(other.input_tokens);
        self.output_tokens = self.output_tokens.saturating_add(other.output_tokens);
        let sum = |a: Option<u64>, b: Option<u64>| match (a, b) {
            (None, None) => None,
            (a, b) => Some(a.unwrap_or(0).saturating_add(b.unwrap_or(0))),
        };
        self.cache_creation_input_tokens = sum(
            self.cache_creation_input_tokens,
            other.cache_creation_input_tokens,
        );
        self.cache_read_input_tokens =
            sum(self.cache_read_input_tokens, other.cache_read_input_tokens);
    }

    pub fn to_json(self) -> Value {
        let mut obj = Map::new();
        obj.insert("input_tokens".into(), json!(self.input_tokens));
        obj.insert("output_tokens".into(), json!(self.output_tokens));
        if let Some(n) = self.cache_creation_input_tokens {
            obj.insert("cache_creation_input_tokens".into(), json!(n));
        }
        if let Some(n) = self.cache_read_input_tokens {
            obj.insert("cache_read_input_tokens".into(), json!(n));
        }
        Value::Object(obj)
    }
}

/// Why the model stopped one turn (upstream `StopReason`, snake_case on the wire).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    EndTurn,
    MaxTokens,
    StopSequence,
    ToolUse,
    ContentFilter,
    Refusal,
}

impl StopReason {
    pub fn as_str(self) -> &'static str {
        match self {
            StopReason::EndTurn => "end_turn",
            StopReason::MaxTokens => "max_tokens",
            StopReason::StopSequence => "stop_sequence",
            StopReason::ToolUse => "tool_use",
            StopReason::ContentFilter => "content_filter",
            StopReason::Refusal => "refusal",
        }
    }
}

/// A tool as offered to the model.
#[derive(Clone, Debug)]
pub struct ToolSpec {
    /// Built-in tools borrow their names; dynamic ones (MCP servers' tools) own them.
    pub name: std::borrow::Cow<'static, str>,
    pub description: std::borrow::Cow<'static, str>,
    pub input_schema: Value,
}

/// Everything a provider codec needs to build one request body.
#[derive(Clone, Debug)]
pub struct ModelRequest<'a> {
    pub model: &'a str,
    pub max_tokens: u32,
    pub system: &'a str,
    pub messages: &'a [Message],
    pub tools: &'a [ToolSpec],
}

/// What a provider stream decoder reports, in wire order. Block indices are the provider's
/// content-block positions (Anthropic `index`; for OpenAI, text is block 0 and tool calls follow).
#[derive(Clone, Debug, PartialEq)]
pub enum ModelEvent {
    /// The response began; carries the message id and model the provider reported, if any.
    Start {
        message_id: String,
        model: String,
    },
    TextDelta {
        index: u32,
        text: String,
    },
    ThinkingDelta {
        index: u32,
        text: String,
    },
    ThinkingSignature {
        index: u32,
        signature: String,
    },
    ToolCallStart {
        index: u32,
        id: String,
        name: String,
    },
    ToolCallInputDelta {
        index: u32,
        partial_json: String,
    },
    /// Latest cumulative usage seen so far (replace, do not add).
    Usage(Usage),
    /// The provider reported a stop reason (may arrive before the final usage).
    Stop(StopReason),
    /// The stream completed normally (Anthropic `message_stop`, OpenAI `[DONE]`).
    Done,
    /// An error frame inside an otherwise successful stream.
    Error {
        kind: String,
        message: String,
        retryable: bool,
    },
}

impl ModelEvent {
    /// Whether the event is the model's output rather than the response's bookkeeping: a
    /// server sends its start and usage before it has produced anything (llama.cpp's role
    /// chunk, then minutes of prompt processing), so those do not end the wait for the
    /// first output.
    pub fn is_output(&self) -> bool {
        !matches!(self, ModelEvent::Start { .. } | ModelEvent::Usage(_))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_and_usage_are_not_output() {
        let start = ModelEvent::Start {
            message_id: "m".into(),
            model: "x".into(),
        };
        assert!(!start.is_output());
        assert!(!ModelEvent::Usage(Usage::default()).is_output());
        let text = ModelEvent::TextDelta {
            index: 0,
            text: "hi".into(),
        };
        assert!(text.is_output());
        assert!(ModelEvent::Stop(StopReason::EndTurn).is_output());
        assert!(ModelEvent::Done.is_output());
    }
}
