//! Anthropic Messages API codec: request bodies and headers out, streamed SSE events in.
//!
//! Sans-IO: `request_body` returns bytes for the HTTP client to send, and `StreamDecoder`
//! turns already-parsed SSE events into provider-neutral `ModelEvent`s. Nothing here knows
//! about sockets, timers or retries. Wire shapes follow `reference/models.md` §1, plus the
//! deviations observed on llama-server's `/v1/messages` route (§4.5), which this decoder must
//! tolerate because it is our offline test server.

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;
use serde_json::{Map, Value, json};

use crate::http::sse::SseEvent;
use crate::model::retry::{ProviderError, raw_error_message, snippet};
use crate::model::types::{
    ContentBlock, Effort, Message, ModelEvent, ModelRequest, Role, StopReason, ToolSpec, Usage,
};

pub const DEFAULT_BASE_URL: &str = "https://api.anthropic.com";
pub const PATH: &str = "/v1/messages";
/// Still the current version; the header is required on every request.
pub const API_VERSION: &str = "2023-06-01";

/// Builds the JSON body of a streaming Messages request.
///
/// Three prompt-cache breakpoints are placed (the API allows four): the last tool, the system
/// prompt, and the last block of the last user message. Tools → system → messages is the
/// cache's prefix order, so each turn reuses everything up to the previous turn's user block.
/// That only works while the bytes before a breakpoint stay identical, so tool order and
/// system text must not change between turns.
pub fn request_body(req: &ModelRequest) -> Vec<u8> {
    let mut body = Map::new();
    body.insert("model".into(), json!(req.model));
    body.insert("max_tokens".into(), json!(req.max_tokens));
    body.insert("stream".into(), json!(true));
    if !req.system.is_empty() {
        body.insert(
            "system".into(),
            json!([{"type": "text", "text": req.system, "cache_control": ephemeral()}]),
        );
    }
    if !req.tools.is_empty() {
        body.insert("tools".into(), tools_json(req.tools));
    }
    if let Some(budget) = req.effort.and_then(|e| thinking_budget(e, req.max_tokens)) {
        body.insert(
            "thinking".into(),
            json!({"type": "enabled", "budget_tokens": budget}),
        );
    }
    body.insert("messages".into(), messages_json(req.messages));
    Value::Object(body).to_string().into_bytes()
}

/// The extended-thinking budget for `effort`. The API wants at least 1024 tokens and less
/// than `max_tokens` (thinking counts towards it), so a budget is cut to leave half of
/// `max_tokens` for the answer, and no thinking is asked for when that leaves under 1024.
fn thinking_budget(effort: Effort, max_tokens: u32) -> Option<u32> {
    const MIN_BUDGET: u32 = 1024;
    let wanted = match effort {
        Effort::Low => 2048,
        Effort::Medium => 8192,
        Effort::High => 24_576,
    };
    let budget = wanted.min(max_tokens / 2);
    (budget >= MIN_BUDGET).then_some(budget)
}

/// Headers for a Messages request; the HTTP client adds `host` and `content-length`.
pub fn request_headers(api_key: &str) -> Vec<(&'static str, String)> {
    vec![
        ("x-api-key", api_key.to_owned()),
        ("anthropic-version", API_VERSION.to_owned()),
        ("content-type", "application/json".to_owned()),
        ("accept", "text/event-stream".to_owned()),
    ]
}

fn ephemeral() -> Value {
    json!({"type": "ephemeral"})
}

fn tools_json(tools: &[ToolSpec]) -> Value {
    let mut out: Vec<Value> = tools
        .iter()
        .map(|tool| {
            json!({
                "name": tool.name,
                "description": tool.description,
                "input_schema": tool.input_schema,
            })
        })
        .collect();
    if let Some(Value::Object(last)) = out.last_mut() {
        last.insert("cache_control".into(), ephemeral());
    }
    Value::Array(out)
}

fn messages_json(messages: &[Message]) -> Value {
    let mut out = Vec::with_capacity(messages.len());
    let mut last_user = None;
    for message in messages {
        let mut blocks: Vec<Value> = message.content.iter().filter_map(block_json).collect();
        if message.role == Role::User {
            // The API requires `tool_result` blocks to lead the user turn that answers a
            // `tool_use`; a stable partition keeps everything else in its original order.
            let (mut results, rest): (Vec<Value>, Vec<Value>) = blocks
                .into_iter()
                .partition(|b| b.get("type").and_then(Value::as_str) == Some("tool_result"));
            results.extend(rest);
            blocks = results;
        }
        // A message left with no content is a 400. Skipping it can put two same-role turns
        // next to each other, which the API merges, so skipping is the lesser evil.
        if blocks.is_empty() {
            continue;
        }
        if message.role == Role::User {
            last_user = Some(out.len());
        }
        out.push(json!({"role": message.role.as_str(), "content": blocks}));
    }
    if let Some(idx) = last_user
        && let Some(Value::Array(blocks)) = out[idx].get_mut("content")
        && let Some(Value::Object(block)) = blocks.last_mut()
    {
        block.insert("cache_control".into(), ephemeral());
    }
    Value::Array(out)
}

/// One content block in request form, or `None` when the API would reject it.
fn block_json(block: &ContentBlock) -> Option<Value> {
    match block {
        // Empty and whitespace-only text blocks are a 400 ("text content blocks must contain
        // non-whitespace text"); they appear when a turn streamed nothing but a tool call.
        ContentBlock::Text { text } if text.trim().is_empty() => None,
        ContentBlock::Text { text } => Some(json!({"type": "text", "text": text})),
        image @ ContentBlock::Image { .. } => Some(image.to_json()),
        // Thinking must be echoed verbatim with its signature. One without a signature (a cut
        // stream, or reasoning recorded from an OpenAI-compatible server) would be rejected,
        // and the model does not need it to continue.
        ContentBlock::Thinking {
            thinking,
            signature: Some(signature),
        } => Some(json!({"type": "thinking", "thinking": thinking, "signature": signature})),
        ContentBlock::Thinking {
            signature: None, ..
        } => None,
        ContentBlock::ToolUse { id, name, input } => {
            // `input` must be an object. A call whose arguments failed to parse is answered
            // by a tool_result saying so; sending `{}` keeps the pair valid.
            let input = if input.is_object() {
                input.clone()
            } else {
                json!({})
            };
            Some(json!({"type": "tool_use", "id": id, "name": name, "input": input}))
        }
        ContentBlock::ToolResult {
            tool_use_id,
            content,
            is_error,
        } => {
            // Text and image blocks, as the API takes them inside a result (a tool's
            // images reach the model this way: `Read` of a picture, an MCP tool's image).
            let inner: Vec<Value> = content
                .iter()
                .filter_map(|inner| match inner {
                    ContentBlock::Text { text } if !text.trim().is_empty() => {
                        Some(json!({"type": "text", "text": text}))
                    }
                    image @ ContentBlock::Image { .. } => Some(image.to_json()),
                    _ => None,
                })
                .collect();
            let mut obj = Map::new();
            obj.insert("type".into(), json!("tool_result"));
            obj.insert("tool_use_id".into(), json!(tool_use_id));
            // `content` is optional; an empty text block inside it would be a 400.
            if !inner.is_empty() {
                obj.insert("content".into(), Value::Array(inner));
            }
            if *is_error {
                obj.insert("is_error".into(), json!(true));
            }
            Some(Value::Object(obj))
        }
    }
}

/// A streamed event that could not be understood.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DecodeError {
    /// The event's `data` was not JSON.
    Json { error: String, data: String },
    /// The `data` was JSON but not an event object with a `type`.
    NotAnEvent { data: String },
    /// A known event lacked a field it cannot be interpreted without.
    MissingField {
        event: &'static str,
        field: &'static str,
    },
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecodeError::Json { error, data } => {
                write!(
                    f,
                    "malformed json in anthropic stream event: {error} (data: {data})"
                )
            }
            DecodeError::NotAnEvent { data } => {
                write!(f, "anthropic stream event has no `type`: {data}")
            }
            DecodeError::MissingField { event, field } => {
                write!(f, "anthropic `{event}` event is missing `{field}`")
            }
        }
    }
}

impl std::error::Error for DecodeError {}

/// How much of an offending `data` payload a `DecodeError` quotes.
const MAX_QUOTED_DATA: usize = 200;

fn quote(data: &str) -> String {
    snippet(data, MAX_QUOTED_DATA)
}

/// Usage exactly as the wire reports it. Anthropic's `input_tokens` excludes cache reads and
/// writes; the conversion to our inclusive `Usage` happens in `to_usage`.
#[derive(Clone, Copy, Debug, Default)]
struct WireUsage {
    input_tokens: Option<u64>,
    output_tokens: Option<u64>,
    cache_creation_input_tokens: Option<u64>,
    cache_read_input_tokens: Option<u64>,
}

impl WireUsage {
    /// Overwrites each field present (and non-null) in `usage`. `message_delta.usage` is
    /// cumulative but may omit the input side that `message_start` carried, so replacing the
    /// whole struct would lose cache counts (upstream caliban's bug #423).
    fn merge(&mut self, usage: &Value) {
        let field = |key: &str| usage.get(key).and_then(Value::as_u64);
        if let Some(n) = field("input_tokens") {
            self.input_tokens = Some(n);
        }
        if let Some(n) = field("output_tokens") {
            self.output_tokens = Some(n);
        }
        if let Some(n) = field("cache_creation_input_tokens") {
            self.cache_creation_input_tokens = Some(n);
        }
        if let Some(n) = field("cache_read_input_tokens") {
            self.cache_read_input_tokens = Some(n);
        }
    }

    /// Our `Usage.input_tokens` is the whole prompt (upstream's convention): uncached input
    /// plus cache writes plus cache reads. The cache fields stay `None` when the server never
    /// mentioned them (llama-server omits cache creation).
    fn to_usage(self) -> Usage {
        let cache_creation = self.cache_creation_input_tokens;
        let cache_read = self.cache_read_input_tokens;
        Usage {
            input_tokens: self
                .input_tokens
                .unwrap_or(0)
                .saturating_add(cache_creation.unwrap_or(0))
                .saturating_add(cache_read.unwrap_or(0)),
            output_tokens: self.output_tokens.unwrap_or(0),
            cache_creation_input_tokens: cache_creation,
            cache_read_input_tokens: cache_read,
        }
    }
}

/// Turns one response's SSE events into `ModelEvent`s.
///
/// LIFECYCLE: `message_start`, then per block `content_block_start` → deltas →
/// `content_block_stop`, then `message_delta` (stop reason, usage), then `message_stop`.
/// The decoder does not enforce that order: it reports what arrives, and `is_done` tells the
/// caller whether EOF was a normal end. `ping` and unknown event, block and delta types are
/// ignored, because Anthropic adds new ones without a version bump.
#[derive(Debug, Default)]
pub struct StreamDecoder {
    started: bool,
    done: bool,
    usage: WireUsage,
    /// Whether any `tool_use` block began, to correct an `end_turn` from a compatible server.
    saw_tool_use: bool,
}

impl StreamDecoder {
    /// Decodes one SSE event, appending zero or more `ModelEvent`s to `out`.
    ///
    /// Dispatch is on the JSON `type`, not the SSE event name: Anthropic keeps them equal,
    /// but the JSON is what we must understand anyway. Events after `message_stop` are
    /// ignored, since the response is already complete.
    pub fn on_event(
        &mut self,
        ev: &SseEvent,
        out: &mut Vec<ModelEvent>,
    ) -> Result<(), DecodeError> {
        if self.done || ev.data.trim().is_empty() {
            return Ok(());
        }
        // Nearly every event of a stream is a delta: it is read from its members as raw text,
        // with no `Value` tree built and only the delta's text copied out. Every other event
        // (a handful a turn), and anything that is not an object, is read as a `Value`.
        if let Ok(event) = serde_json::from_str::<Members>(&ev.data)
            && event.get("type").and_then(text).as_deref() == Some("content_block_delta")
        {
            return on_block_delta(&event, out);
        }
        let value: Value = serde_json::from_str(&ev.data).map_err(|e| DecodeError::Json {
            error: e.to_string(),
            data: quote(&ev.data),
        })?;
        let Some(kind) = value.get("type").and_then(Value::as_str) else {
            // llama-server uses the OpenAI error envelope on every route, so an untyped
            // `{"error":{…}}` is still an error report rather than garbage.
            if let Some(error) = value.get("error") {
                out.push(error_event(error));
                return Ok(());
            }
            return Err(DecodeError::NotAnEvent {
                data: quote(&ev.data),
            });
        };
        match kind {
            "message_start" => self.on_message_start(&value, out),
            "content_block_start" => self.on_block_start(&value, out)?,
            // (`content_block_delta` was read above: any object reads as `Members`.)
            "message_delta" => self.on_message_delta(&value, out),
            "message_stop" => {
                self.done = true;
                out.push(ModelEvent::Done);
            }
            "error" => out.push(error_event(value.get("error").unwrap_or(&Value::Null))),
            // `ping`, `content_block_stop` (the consumer closes blocks itself) and types added
            // after this was written.
            _ => {}
        }
        Ok(())
    }

    /// True once `message_stop` arrived. EOF before that is a truncated response, even if a
    /// stop reason was already seen.
    pub fn is_done(&self) -> bool {
        self.done
    }

    fn on_message_start(&mut self, value: &Value, out: &mut Vec<ModelEvent>) {
        let message = value.get("message").unwrap_or(&Value::Null);
        if !self.started {
            self.started = true;
            let text = |key: &str| {
                message
                    .get(key)
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned()
            };
            out.push(ModelEvent::Start {
                message_id: text("id"),
                model: text("model"),
            });
        }
        if let Some(usage) = message.get("usage").filter(|u| u.is_object()) {
            self.usage.merge(usage);
            out.push(ModelEvent::Usage(self.usage.to_usage()));
        }
    }

    fn on_block_start(
        &mut self,
        value: &Value,
        out: &mut Vec<ModelEvent>,
    ) -> Result<(), DecodeError> {
        let index = block_index(value, "content_block_start")?;
        let block = value.get("content_block").unwrap_or(&Value::Null);
        let text = |key: &str| block.get(key).and_then(Value::as_str).unwrap_or_default();
        match block.get("type").and_then(Value::as_str) {
            // Start blocks normally carry empty text; forward anything else so nothing is lost.
            Some("text") if !text("text").is_empty() => out.push(ModelEvent::TextDelta {
                index,
                text: text("text").to_owned(),
            }),
            Some("thinking") => {
                if !text("thinking").is_empty() {
                    out.push(ModelEvent::ThinkingDelta {
                        index,
                        text: text("thinking").to_owned(),
                    });
                }
                if !text("signature").is_empty() {
                    out.push(ModelEvent::ThinkingSignature {
                        index,
                        signature: text("signature").to_owned(),
                    });
                }
            }
            Some("tool_use") => {
                self.saw_tool_use = true;
                out.push(ModelEvent::ToolCallStart {
                    index,
                    id: text("id").to_owned(),
                    name: text("name").to_owned(),
                });
                // Anthropic starts with `input: {}` and streams the arguments as deltas
                // (llama-server omits `input`). A non-empty object can only come from a proxy
                // that has the whole call at once, and then no deltas follow.
                if let Some(input) = block.get("input").and_then(Value::as_object)
                    && !input.is_empty()
                {
                    out.push(ModelEvent::ToolCallInputDelta {
                        index,
                        partial_json: Value::Object(input.clone()).to_string(),
                    });
                }
            }
            // `redacted_thinking` has no representation in `ContentBlock`, and server-tool
            // blocks are never requested; both are dropped.
            _ => {}
        }
        Ok(())
    }

    fn on_message_delta(&mut self, value: &Value, out: &mut Vec<ModelEvent>) {
        if let Some(reason) = value
            .get("delta")
            .and_then(|d| d.get("stop_reason"))
            .and_then(Value::as_str)
        {
            let mut stop = map_stop_reason(reason);
            // Compatible servers have been seen ending tool-call turns with `end_turn`; the
            // calls are what the agent has to act on.
            if stop == StopReason::EndTurn && self.saw_tool_use {
                stop = StopReason::ToolUse;
            }
            out.push(ModelEvent::Stop(stop));
        }
        if let Some(usage) = value.get("usage").filter(|u| u.is_object()) {
            self.usage.merge(usage);
            out.push(ModelEvent::Usage(self.usage.to_usage()));
        }
    }
}

/// A JSON object's members in their order, each value left as its raw JSON text. An event
/// has a few: a list is quicker to fill, search and drop than a map.
#[derive(Default)]
struct Members<'a>(Vec<(Cow<'a, str>, &'a RawValue)>);

impl<'a> Members<'a> {
    /// The member named `key`: the last one, as a `Value` keeps the last of repeated keys.
    fn get(&self, key: &str) -> Option<&'a RawValue> {
        self.0.iter().rev().find(|(k, _)| k == key).map(|(_, v)| *v)
    }
}

impl<'de> Deserialize<'de> for Members<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Members<'de>, D::Error> {
        struct Visit;
        impl<'de> Visitor<'de> for Visit {
            type Value = Members<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Members<'de>, A::Error> {
                let mut members = Vec::with_capacity(4);
                while let Some((key, value)) = map.next_entry::<Text, &RawValue>()? {
                    members.push((key.0, value));
                }
                Ok(Members(members))
            }
        }
        deserializer.deserialize_map(Visit)
    }
}

/// A JSON string, borrowed from the event's text unless it had escapes to undo.
struct Text<'a>(Cow<'a, str>);

impl<'de> Deserialize<'de> for Text<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Text<'de>, D::Error> {
        struct Visit;
        impl<'de> Visitor<'de> for Visit {
            type Value = Text<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, text: &'de str) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Borrowed(text)))
            }
            fn visit_str<E: de::Error>(self, text: &str) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Owned(text.to_owned())))
            }
        }
        deserializer.deserialize_str(Visit)
    }
}

/// A member's value if it is a string (anything else reads as absent).
fn text(raw: &RawValue) -> Option<Cow<'_, str>> {
    let json = raw.get();
    // Raw values are valid JSON: a string with no escape is its text between the quotes.
    match json.strip_prefix('"').and_then(|s| s.strip_suffix('"')) {
        Some(plain) if !plain.contains('\\') => Some(Cow::Borrowed(plain)),
        _ => serde_json::from_str::<Text>(json).ok().map(|text| text.0),
    }
}

/// A `content_block_delta`. A delta that is not an object, an unknown delta type or a text
/// that is not a string (or is empty) is no event.
fn on_block_delta(event: &Members, out: &mut Vec<ModelEvent>) -> Result<(), DecodeError> {
    let index = event
        .get("index")
        .and_then(|raw| serde_json::from_str::<u32>(raw.get()).ok())
        .ok_or(DecodeError::MissingField {
            event: "content_block_delta",
            field: "index",
        })?;
    let delta: Members = event
        .get("delta")
        .and_then(|raw| serde_json::from_str(raw.get()).ok())
        .unwrap_or_default();
    let field = match delta.get("type").and_then(text).as_deref() {
        Some("text_delta") => "text",
        Some("thinking_delta") => "thinking",
        Some("signature_delta") => "signature",
        // The first fragment is usually `""`; fragments are not JSON on their own, and the
        // consumer parses the concatenation when the turn ends.
        Some("input_json_delta") => "partial_json",
        // `citations_delta` and future delta types.
        _ => return Ok(()),
    };
    let Some(text) = delta
        .get(field)
        .and_then(|raw| serde_json::from_str::<String>(raw.get()).ok())
        .filter(|text| !text.is_empty())
    else {
        return Ok(());
    };
    out.push(match field {
        "text" => ModelEvent::TextDelta { index, text },
        "thinking" => ModelEvent::ThinkingDelta { index, text },
        "signature" => ModelEvent::ThinkingSignature {
            index,
            signature: text,
        },
        _ => ModelEvent::ToolCallInputDelta {
            index,
            partial_json: text,
        },
    });
    Ok(())
}

fn block_index(value: &Value, event: &'static str) -> Result<u32, DecodeError> {
    value
        .get("index")
        .and_then(Value::as_u64)
        .and_then(|n| u32::try_from(n).ok())
        .ok_or(DecodeError::MissingField {
            event,
            field: "index",
        })
}

/// Maps Anthropic's stop reasons onto ours.
///
/// - `pause_turn` means a server-side tool paused a long turn. We never offer server tools,
///   so it should not occur; if it does, ending the turn shows the user what arrived instead
///   of resending in a loop we cannot reason about.
/// - `model_context_window_exceeded` means generation stopped because the context filled
///   up: like `max_tokens`, the reply is cut short, and the agent's remedy (compact, then
///   continue) is the same.
/// - Unknown reasons end the turn; the model stopped for a reason we cannot act on.
fn map_stop_reason(reason: &str) -> StopReason {
    match reason {
        "max_tokens" | "model_context_window_exceeded" => StopReason::MaxTokens,
        "stop_sequence" => StopReason::StopSequence,
        "tool_use" => StopReason::ToolUse,
        "refusal" => StopReason::Refusal,
        _ => StopReason::EndTurn,
    }
}

/// An `error` event. Overloads, internal errors and rate limits are transient: the caller may
/// retry the turn if nothing was shown yet.
fn error_event(error: &Value) -> ModelEvent {
    let kind = error
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or("error")
        .to_owned();
    let message = error
        .get("message")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    let retryable = matches!(
        kind.as_str(),
        "overloaded_error" | "api_error" | "rate_limit_error"
    );
    ModelEvent::Error {
        kind,
        message,
        retryable,
    }
}

/// Reads a non-2xx response body. Anthropic sends
/// `{"type":"error","error":{"type","message"},"request_id"}`; llama-server sends the OpenAI
/// envelope `{"error":{"type","message","code"}}` even on this route. Both put `type` and
/// `message` under `error`. Anything else (a proxy's HTML page) becomes the message as text.
pub fn parse_error_body(status: u16, body: &[u8]) -> ProviderError {
    let parsed: Option<Value> = serde_json::from_slice(body).ok();
    let error = parsed.as_ref().and_then(|v| v.get("error"));
    let field = |key: &str| error.and_then(|e| e.get(key)).and_then(Value::as_str);
    match field("message") {
        Some(message) => ProviderError {
            status,
            kind: field("type").unwrap_or_default().to_owned(),
            message: message.to_owned(),
        },
        None => ProviderError {
            status,
            kind: String::new(),
            message: raw_error_message(body),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_deltas_read_from_their_members() {
        let text = |index, text: &str| {
            Ok(vec![ModelEvent::TextDelta {
                index,
                text: text.into(),
            }])
        };
        let none = || Ok(vec![]);
        let no_index = || Err("anthropic `content_block_delta` event is missing `index`".into());
        let cases: [(&str, Result<Vec<ModelEvent>, String>); 19] = [
            (
                r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hi \"there\"\n\u00e9"}}"#,
                text(0, "Hi \"there\"\n\u{e9}"),
            ),
            (
                r#"{"type":"content_block_delta","index":2,"delta":{"type":"thinking_delta","thinking":"hmm"}}"#,
                Ok(vec![ModelEvent::ThinkingDelta {
                    index: 2,
                    text: "hmm".into(),
                }]),
            ),
            (
                r#"{"type":"content_block_delta","index":2,"delta":{"type":"signature_delta","signature":"c2ln"}}"#,
                Ok(vec![ModelEvent::ThinkingSignature {
                    index: 2,
                    signature: "c2ln".into(),
                }]),
            ),
            (
                r#"{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":""}}"#,
                none(),
            ),
            (
                r#"{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"{\"a\":"}}"#,
                Ok(vec![ModelEvent::ToolCallInputDelta {
                    index: 1,
                    partial_json: "{\"a\":".into(),
                }]),
            ),
            (
                r#"{"delta":{"text":"late type","type":"text_delta"},"index":3,"type":"content_block_delta"}"#,
                text(3, "late type"),
            ),
            (
                r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":null}}"#,
                none(),
            ),
            // The last of a repeated member counts, as in a `Value`.
            (
                r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"a","text":"b"}}"#,
                text(0, "b"),
            ),
            (
                r#"{"type":"content_block_delta","index":0,"delta":{"type":"citations_delta","citation":{}}}"#,
                none(),
            ),
            (
                r#"{"type":"content_block_delta","index":-1,"delta":{"type":"text_delta","text":"x"}}"#,
                no_index(),
            ),
            (
                r#"{"type":"content_block_delta","index":4294967296,"delta":{"type":"text_delta","text":"x"}}"#,
                no_index(),
            ),
            (
                r#"{"type":"content_block_delta","index":1.0,"delta":{"type":"text_delta","text":"x"}}"#,
                no_index(),
            ),
            (
                r#"{"type":"content_block_delta","delta":{"type":"text_delta","text":"x"}}"#,
                no_index(),
            ),
            (
                r#"{"type":"content_block_delta","index":0,"delta":"text"}"#,
                none(),
            ),
            (r#"{"type":"content_block_delta","index":0}"#, none()),
            // Escaped keys and names are read as what they spell.
            (
                r#"{"typ\u0065":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"x"}}"#,
                text(0, "x"),
            ),
            (
                r#"{"type":"content\u005fblock_delta","index":0,"delta":{"t\u0079pe":"text\u005fdelta","text":"y"}}"#,
                text(0, "y"),
            ),
            (r#"{"type":"content_block_stop","index":0}"#, none()),
            (
                r#"[1,2]"#,
                Err("anthropic stream event has no `type`: [1,2]".into()),
            ),
        ];
        for (data, expected) in cases {
            let mut decoder = StreamDecoder::default();
            let mut out = Vec::new();
            let got = decoder
                .on_event(&sse("content_block_delta", data), &mut out)
                .map(|()| out)
                .map_err(|e| e.to_string());
            assert_eq!(got, expected, "{data}");
        }
    }

    fn sse(event: &str, data: &str) -> SseEvent {
        SseEvent {
            event: event.to_owned(),
            data: data.to_owned(),
            id: None,
        }
    }

    /// Feeds a transcript in `event: …\ndata: …\n\n` form, as printed in models.md.
    fn decode(transcript: &str) -> (StreamDecoder, Vec<ModelEvent>) {
        let mut decoder = StreamDecoder::default();
        let mut out = Vec::new();
        let mut name = "message";
        for line in transcript.lines() {
            if let Some(rest) = line.strip_prefix("event: ") {
                name = rest;
            } else if let Some(data) = line.strip_prefix("data: ") {
                decoder.on_event(&sse(name, data), &mut out).unwrap();
                name = "message";
            }
        }
        (decoder, out)
    }

    fn body_json(req: &ModelRequest) -> Value {
        serde_json::from_slice(&request_body(req)).unwrap()
    }

    fn read_file_tool() -> ToolSpec {
        ToolSpec {
            name: "read_file".into(),
            description: "Read a file".into(),
            input_schema: json!({
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            }),
        }
    }

    #[test]
    fn minimal_request_matches_the_documented_shape() {
        let messages = [Message::user_text("Open README.md")];
        let tools = [read_file_tool()];
        let req = ModelRequest {
            model: "claude-sonnet-4-5",
            max_tokens: 1024,
            effort: None,
            system: "You are a coding agent.",
            messages: &messages,
            tools: &tools,
        };
        assert_eq!(
            body_json(&req),
            json!({
                "model": "claude-sonnet-4-5",
                "max_tokens": 1024,
                "stream": true,
                "system": [{"type": "text", "text": "You are a coding agent.",
                            "cache_control": {"type": "ephemeral"}}],
                "tools": [{"name": "read_file", "description": "Read a file",
                           "input_schema": {"type": "object",
                                            "properties": {"path": {"type": "string"}},
                                            "required": ["path"]},
                           "cache_control": {"type": "ephemeral"}}],
                "messages": [{"role": "user", "content": [
                    {"type": "text", "text": "Open README.md",
                     "cache_control": {"type": "ephemeral"}}]}],
            })
        );
    }

    #[test]
    fn request_bytes_are_compact_json() {
        let messages = [Message::user_text("hi")];
        let req = ModelRequest {
            model: "m",
            max_tokens: 8,
            effort: None,
            system: "",
            messages: &messages,
            tools: &[],
        };
        assert_eq!(
            String::from_utf8(request_body(&req)).unwrap(),
            r#"{"max_tokens":8,"messages":[{"content":[{"cache_control":{"type":"ephemeral"},"text":"hi","type":"text"}],"role":"user"}],"model":"m","stream":true}"#
        );
    }

    #[test]
    fn history_is_translated_for_replay() {
        let messages = [
            Message::user_text("Open README.md"),
            Message {
                role: Role::Assistant,
                content: vec![
                    ContentBlock::Thinking {
                        thinking: "The user wants the README".into(),
                        signature: Some("EqQB".into()),
                    },
                    ContentBlock::Thinking {
                        thinking: "unsigned".into(),
                        signature: None,
                    },
                    ContentBlock::text(""),
                    ContentBlock::text("Let me open it."),
                    ContentBlock::ToolUse {
                        id: "toolu_01".into(),
                        name: "read_file".into(),
                        input: json!({"path": "README.md"}),
                    },
                    ContentBlock::ToolUse {
                        id: "toolu_02".into(),
                        name: "read_file".into(),
                        input: json!("{\"path\": \"READ"),
                    },
                ],
            },
            Message {
                role: Role::User,
                content: vec![
                    ContentBlock::text("also, be quick"),
                    ContentBlock::ToolResult {
                        tool_use_id: "toolu_01".into(),
                        content: vec![ContentBlock::text("# Hello"), ContentBlock::text("")],
                        is_error: false,
                    },
                    ContentBlock::ToolResult {
                        tool_use_id: "toolu_02".into(),
                        content: vec![],
                        is_error: true,
                    },
                ],
            },
            // Dropped entirely: nothing sendable is left.
            Message {
                role: Role::Assistant,
                content: vec![ContentBlock::text("  \n")],
            },
        ];
        let req = ModelRequest {
            model: "m",
            max_tokens: 100,
            effort: None,
            system: "",
            messages: &messages,
            tools: &[],
        };
        let body = body_json(&req);
        assert_eq!(body.get("system"), None);
        assert_eq!(body.get("tools"), None);
        assert_eq!(
            body["messages"],
            json!([
                {"role": "user", "content": [{"type": "text", "text": "Open README.md"}]},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "The user wants the README", "signature": "EqQB"},
                    {"type": "text", "text": "Let me open it."},
                    {"type": "tool_use", "id": "toolu_01", "name": "read_file",
                     "input": {"path": "README.md"}},
                    {"type": "tool_use", "id": "toolu_02", "name": "read_file", "input": {}},
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_01",
                     "content": [{"type": "text", "text": "# Hello"}]},
                    {"type": "tool_result", "tool_use_id": "toolu_02", "is_error": true},
                    {"type": "text", "text": "also, be quick",
                     "cache_control": {"type": "ephemeral"}},
                ]},
            ])
        );
    }

    #[test]
    fn tool_result_images_travel_inside_the_result() {
        let png = ContentBlock::image("image/png", "iVBORw0KGgo=").unwrap();
        let messages = [Message {
            role: Role::User,
            content: vec![
                ContentBlock::ToolResult {
                    tool_use_id: "toolu_01".into(),
                    content: vec![ContentBlock::text("a screenshot"), png.clone()],
                    is_error: false,
                },
                ContentBlock::ToolResult {
                    tool_use_id: "toolu_02".into(),
                    content: vec![png],
                    is_error: false,
                },
            ],
        }];
        let req = ModelRequest {
            model: "m",
            max_tokens: 100,
            effort: None,
            system: "",
            messages: &messages,
            tools: &[],
        };
        let image = json!({"type": "image", "source": {"type": "base64",
                           "media_type": "image/png", "data": "iVBORw0KGgo="}});
        assert_eq!(
            body_json(&req)["messages"],
            json!([{"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01",
                 "content": [{"type": "text", "text": "a screenshot"}, image]},
                {"type": "tool_result", "tool_use_id": "toolu_02", "content": [image],
                 "cache_control": {"type": "ephemeral"}},
            ]}])
        );
    }

    #[test]
    fn headers() {
        assert_eq!(
            request_headers("sk-ant-x"),
            vec![
                ("x-api-key", "sk-ant-x".to_owned()),
                ("anthropic-version", "2023-06-01".to_owned()),
                ("content-type", "application/json".to_owned()),
                ("accept", "text/event-stream".to_owned()),
            ]
        );
    }

    /// The documented sequence from models.md §1.2: thinking, text, tool_use, with a ping.
    const DOCUMENTED: &str = r#"
event: message_start
data: {"type":"message_start","message":{"id":"msg_01XFD","type":"message","role":"assistant","model":"claude-sonnet-4-5","content":[],"stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":472,"cache_creation_input_tokens":0,"cache_read_input_tokens":2048,"output_tokens":2}}}

event: content_block_start
data: {"type":"content_block_start","index":0,"content_block":{"type":"thinking","thinking":"","signature":""}}

event: content_block_delta
data: {"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta","thinking":"The user wants the README"}}

event: content_block_delta
data: {"type":"content_block_delta","index":0,"delta":{"type":"signature_delta","signature":"EqQBCgIYAhIM1gbcDa9GJwZA"}}

event: content_block_stop
data: {"type":"content_block_stop","index":0}

event: content_block_start
data: {"type":"content_block_start","index":1,"content_block":{"type":"text","text":""}}

event: ping
data: {"type":"ping"}

event: content_block_delta
data: {"type":"content_block_delta","index":1,"delta":{"type":"text_delta","text":"Let me open it."}}

event: content_block_stop
data: {"type":"content_block_stop","index":1}

event: content_block_start
data: {"type":"content_block_start","index":2,"content_block":{"type":"tool_use","id":"toolu_01T1x","name":"read_file","input":{}}}

event: content_block_delta
data: {"type":"content_block_delta","index":2,"delta":{"type":"input_json_delta","partial_json":""}}

event: content_block_delta
data: {"type":"content_block_delta","index":2,"delta":{"type":"input_json_delta","partial_json":"{\"path\": \"READ"}}

event: content_block_delta
data: {"type":"content_block_delta","index":2,"delta":{"type":"input_json_delta","partial_json":"ME.md\"}"}}

event: content_block_stop
data: {"type":"content_block_stop","index":2}

event: message_delta
data: {"type":"message_delta","delta":{"stop_reason":"tool_use","stop_sequence":null},"usage":{"output_tokens":89}}

event: message_stop
data: {"type":"message_stop"}
"#;

    #[test]
    fn decodes_the_documented_stream() {
        let (decoder, events) = decode(DOCUMENTED);
        let start_usage = Usage {
            input_tokens: 472 + 2048,
            output_tokens: 2,
            cache_creation_input_tokens: Some(0),
            cache_read_input_tokens: Some(2048),
        };
        assert_eq!(
            events,
            vec![
                ModelEvent::Start {
                    message_id: "msg_01XFD".into(),
                    model: "claude-sonnet-4-5".into(),
                },
                ModelEvent::Usage(start_usage),
                ModelEvent::ThinkingDelta {
                    index: 0,
                    text: "The user wants the README".into(),
                },
                ModelEvent::ThinkingSignature {
                    index: 0,
                    signature: "EqQBCgIYAhIM1gbcDa9GJwZA".into(),
                },
                ModelEvent::TextDelta {
                    index: 1,
                    text: "Let me open it.".into(),
                },
                ModelEvent::ToolCallStart {
                    index: 2,
                    id: "toolu_01T1x".into(),
                    name: "read_file".into(),
                },
                ModelEvent::ToolCallInputDelta {
                    index: 2,
                    partial_json: "{\"path\": \"READ".into(),
                },
                ModelEvent::ToolCallInputDelta {
                    index: 2,
                    partial_json: "ME.md\"}".into(),
                },
                ModelEvent::Stop(StopReason::ToolUse),
                // Output replaced, input side kept from message_start.
                ModelEvent::Usage(Usage {
                    output_tokens: 89,
                    ..start_usage
                }),
                ModelEvent::Done,
            ]
        );
        assert!(decoder.is_done());
    }

    /// Frames captured from llama-server's `/v1/messages` (models.md §4.5): no `input` on the
    /// tool_use start, no `ping`, no `cache_creation_input_tokens`.
    #[test]
    fn decodes_llama_server_tool_call() {
        let (decoder, events) = decode(
            r#"
event: message_start
data: {"type":"message_start","message":{"id":"chatcmpl-LH4q","type":"message","role":"assistant","content":[],"model":"model/qwen2.5-coder-0.5b-instruct.gguf","stop_reason":null,"stop_sequence":null,"usage":{"cache_read_input_tokens":5,"input_tokens":259,"output_tokens":0}}}
event: content_block_start
data: {"type":"content_block_start","index":0,"content_block":{"type":"tool_use","id":"6sCjp6gk","name":"get_weather"}}
event: content_block_delta
data: {"type":"content_block_delta","index":0,"delta":{"type":"input_json_delta","partial_json":"{"}}
event: content_block_delta
data: {"type":"content_block_delta","index":0,"delta":{"type":"input_json_delta","partial_json":"\"city\":\""}}
event: content_block_stop
data: {"type":"content_block_stop","index":0}
event: message_delta
data: {"type":"message_delta","delta":{"stop_reason":"tool_use","stop_sequence":null},"usage":{"output_tokens":26}}
event: message_stop
data: {"type":"message_stop"}
"#,
        );
        let usage = Usage {
            input_tokens: 264,
            output_tokens: 0,
            cache_creation_input_tokens: None,
            cache_read_input_tokens: Some(5),
        };
        assert_eq!(
            events,
            vec![
                ModelEvent::Start {
                    message_id: "chatcmpl-LH4q".into(),
                    model: "model/qwen2.5-coder-0.5b-instruct.gguf".into(),
                },
                ModelEvent::Usage(usage),
                ModelEvent::ToolCallStart {
                    index: 0,
                    id: "6sCjp6gk".into(),
                    name: "get_weather".into(),
                },
                ModelEvent::ToolCallInputDelta {
                    index: 0,
                    partial_json: "{".into(),
                },
                ModelEvent::ToolCallInputDelta {
                    index: 0,
                    partial_json: "\"city\":\"".into(),
                },
                ModelEvent::Stop(StopReason::ToolUse),
                ModelEvent::Usage(Usage {
                    output_tokens: 26,
                    ..usage
                }),
                ModelEvent::Done,
            ]
        );
        assert!(decoder.is_done());
    }

    #[test]
    fn message_delta_usage_overwrites_only_present_fields() {
        let (_, events) = decode(
            r#"
data: {"type":"message_start","message":{"id":"m","model":"x","usage":{"input_tokens":10,"cache_creation_input_tokens":100,"cache_read_input_tokens":1000,"output_tokens":1}}}
data: {"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"input_tokens":12,"cache_read_input_tokens":null,"output_tokens":7}}
"#,
        );
        assert_eq!(
            events.last(),
            Some(&ModelEvent::Usage(Usage {
                input_tokens: 12 + 100 + 1000,
                output_tokens: 7,
                cache_creation_input_tokens: Some(100),
                cache_read_input_tokens: Some(1000),
            }))
        );
    }

    #[test]
    fn stop_reasons() {
        for (wire, ours) in [
            ("end_turn", StopReason::EndTurn),
            ("max_tokens", StopReason::MaxTokens),
            ("stop_sequence", StopReason::StopSequence),
            ("tool_use", StopReason::ToolUse),
            ("refusal", StopReason::Refusal),
            ("pause_turn", StopReason::EndTurn),
            ("model_context_window_exceeded", StopReason::MaxTokens),
            ("something_new", StopReason::EndTurn),
        ] {
            let data = format!(r#"{{"type":"message_delta","delta":{{"stop_reason":"{wire}"}}}}"#);
            let mut out = Vec::new();
            StreamDecoder::default()
                .on_event(&sse("message_delta", &data), &mut out)
                .unwrap();
            assert_eq!(out, vec![ModelEvent::Stop(ours)], "{wire}");
        }
    }

    #[test]
    fn end_turn_after_a_tool_call_is_tool_use() {
        let (_, events) = decode(
            r#"
data: {"type":"content_block_start","index":0,"content_block":{"type":"tool_use","id":"t","name":"n","input":{}}}
data: {"type":"message_delta","delta":{"stop_reason":"end_turn"}}
"#,
        );
        assert_eq!(events.last(), Some(&ModelEvent::Stop(StopReason::ToolUse)));
    }

    #[test]
    fn error_events() {
        let (decoder, events) = decode(
            r#"
event: error
data: {"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}
data: {"type":"error","error":{"type":"invalid_request_error","message":"bad"}}
data: {"error":{"code":500,"message":"boom","type":"server_error"}}
"#,
        );
        assert_eq!(
            events,
            vec![
                ModelEvent::Error {
                    kind: "overloaded_error".into(),
                    message: "Overloaded".into(),
                    retryable: true,
                },
                ModelEvent::Error {
                    kind: "invalid_request_error".into(),
                    message: "bad".into(),
                    retryable: false,
                },
                ModelEvent::Error {
                    kind: "server_error".into(),
                    message: "boom".into(),
                    retryable: false,
                },
            ]
        );
        assert!(!decoder.is_done());
    }

    #[test]
    fn unknown_things_are_ignored() {
        let (decoder, events) = decode(
            r#"
data: {"type":"ping"}
data: {"type":"brand_new_event","x":1}
data: {"type":"content_block_start","index":0,"content_block":{"type":"redacted_thinking","data":"EmwK"}}
data: {"type":"content_block_start","index":1,"content_block":{"type":"server_tool_use","id":"s","name":"web_search"}}
data: {"type":"content_block_delta","index":1,"delta":{"type":"citations_delta","citation":{}}}
data: {"type":"content_block_stop","index":1}
"#,
        );
        assert_eq!(events, vec![]);
        assert!(!decoder.is_done());
    }

    #[test]
    fn tolerant_block_starts() {
        let (_, events) = decode(
            r#"
data: {"type":"content_block_start","index":0,"content_block":{"type":"text","text":"Hi"}}
data: {"type":"content_block_start","index":1,"content_block":{"type":"tool_use","id":"t","name":"n","input":{"a":1}}}
"#,
        );
        assert_eq!(
            events,
            vec![
                ModelEvent::TextDelta {
                    index: 0,
                    text: "Hi".into(),
                },
                ModelEvent::ToolCallStart {
                    index: 1,
                    id: "t".into(),
                    name: "n".into(),
                },
                ModelEvent::ToolCallInputDelta {
                    index: 1,
                    partial_json: r#"{"a":1}"#.into(),
                },
            ]
        );
    }

    #[test]
    fn start_is_reported_once_and_nothing_after_stop() {
        let (_, events) = decode(
            r#"
data: {"type":"message_start","message":{"id":"a","model":"m"}}
data: {"type":"message_start","message":{"id":"b","model":"m"}}
data: {"type":"message_stop"}
data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"late"}}
data: not json after the end
"#,
        );
        assert_eq!(
            events,
            vec![
                ModelEvent::Start {
                    message_id: "a".into(),
                    model: "m".into(),
                },
                ModelEvent::Done,
            ]
        );
    }

    #[test]
    fn malformed_input_is_an_error_not_a_panic() {
        let mut decoder = StreamDecoder::default();
        let mut out = Vec::new();
        let mut feed = |data: &str| decoder.on_event(&sse("message", data), &mut out);
        assert!(matches!(feed("{\"type\":"), Err(DecodeError::Json { .. })));
        assert_eq!(
            feed("[1,2]"),
            Err(DecodeError::NotAnEvent {
                data: "[1,2]".into()
            })
        );
        assert_eq!(
            feed(r#"{"type":"content_block_delta","delta":{"type":"text_delta","text":"x"}}"#),
            Err(DecodeError::MissingField {
                event: "content_block_delta",
                field: "index",
            })
        );
        assert_eq!(
            feed(r#"{"type":"content_block_start","index":-1,"content_block":{}}"#),
            Err(DecodeError::MissingField {
                event: "content_block_start",
                field: "index",
            })
        );
        // Wrongly typed fields inside known events are skipped, not fatal.
        assert_eq!(feed(r#"{"type":"message_start","message":7}"#), Ok(()));
        assert_eq!(
            feed(r#"{"type":"message_delta","delta":null,"usage":"x"}"#),
            Ok(())
        );
        assert_eq!(feed(""), Ok(()));
        let long = "x".repeat(1000);
        match feed(&long) {
            Err(DecodeError::Json { data, .. }) => assert!(data.len() < 300),
            other => panic!("unexpected {other:?}"),
        }
        assert_eq!(
            out,
            vec![ModelEvent::Start {
                message_id: String::new(),
                model: String::new(),
            }]
        );
    }

    #[test]
    fn decode_error_display() {
        assert_eq!(
            DecodeError::MissingField {
                event: "content_block_delta",
                field: "index"
            }
            .to_string(),
            "anthropic `content_block_delta` event is missing `index`"
        );
    }

    #[test]
    fn error_bodies() {
        let anthropic = br#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"},"request_id":"req_1"}"#;
        assert_eq!(
            parse_error_body(529, anthropic),
            ProviderError {
                status: 529,
                kind: "overloaded_error".into(),
                message: "Overloaded".into(),
            }
        );
        let llama = br#"{"error":{"code":400,"message":"request (9008 tokens) exceeds the available context size (8192 tokens), try increasing it","type":"exceed_context_size_error","n_prompt_tokens":9008,"n_ctx":8192}}"#;
        let e = parse_error_body(400, llama);
        assert_eq!(e.kind, "exceed_context_size_error");
        assert!(e.message.starts_with("request (9008 tokens)"));
        let html = parse_error_body(502, b"<html>Bad Gateway</html>\r\n");
        assert_eq!(
            html,
            ProviderError {
                status: 502,
                kind: String::new(),
                message: "<html>Bad Gateway</html>".into(),
            }
        );
        let huge = vec![b'a'; 10_000];
        assert!(parse_error_body(500, &huge).message.len() < 2100);
    }
}
