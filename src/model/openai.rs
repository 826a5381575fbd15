//! OpenAI Chat Completions codec: request bodies and headers out, streamed chunks in.
//!
//! This is the lingua franca of local servers (llama.cpp, Ollama, vLLM, LM Studio), so the
//! decoder is written against what those servers actually send (`reference/models.md` §2.2,
//! §2.4, §4.5), not only against OpenAI's reference: ids, indices and `[DONE]` may be
//! missing, arguments may be an object, and `finish_reason` may lie about tool calls.
//! Sans-IO like the Anthropic codec: bytes out, parsed SSE events in, no sockets.

use std::fmt;

use serde_json::{Map, Value, json};

use crate::http::sse::SseEvent;
use crate::model::retry::{ProviderError, raw_error_message, snippet};
use crate::model::types::{
    ContentBlock, Message, ModelEvent, ModelRequest, Role, StopReason, ToolSpec, Usage,
};

/// The base URL includes the `/v1` prefix, and [`PATH`] is appended to it, so a local
/// server's `OPENAI_BASE_URL=http://127.0.0.1:8080/v1` works the way it does for the SDKs.
pub const DEFAULT_BASE_URL: &str = "https://api.openai.com/v1";
pub const PATH: &str = "/chat/completions";

/// Builds the JSON body of a streaming Chat Completions request.
///
/// `max_tokens` rather than `max_completion_tokens`: every local server accepts it, and so
/// does OpenAI for non-reasoning models. `tool_choice` is left at its default (`auto` when
/// tools are present), because some strict servers reject keys they do not implement.
pub fn request_body(req: &ModelRequest) -> Vec<u8> {
    let mut body = Map::new();
    body.insert("model".into(), json!(req.model));
    body.insert("stream".into(), json!(true));
    // Without this OpenAI sends no usage at all on a stream.
    body.insert("stream_options".into(), json!({"include_usage": true}));
    body.insert("max_tokens".into(), json!(req.max_tokens));
    if let Some(effort) = req.effort {
        body.insert("reasoning_effort".into(), json!(effort.as_str()));
    }
    let mut messages = Vec::with_capacity(req.messages.len() + 1);
    if !req.system.is_empty() {
        messages.push(json!({"role": "system", "content": req.system}));
    }
    for message in req.messages {
        match message.role {
            Role::User => push_user(message, &mut messages),
            Role::Assistant => messages.push(assistant_json(message)),
        }
    }
    body.insert("messages".into(), Value::Array(messages));
    if !req.tools.is_empty() {
        body.insert("tools".into(), tools_json(req.tools));
    }
    Value::Object(body).to_string().into_bytes()
}

/// Headers for a Chat Completions request; the HTTP client adds `host` and `content-length`.
/// Local servers usually need no key, so `Authorization` is only sent when one is set.
pub fn request_headers(api_key: Option<&str>) -> Vec<(&'static str, String)> {
    let mut headers = vec![
        ("content-type", "application/json".to_owned()),
        ("accept", "text/event-stream".to_owned()),
    ];
    if let Some(key) = api_key.map(str::trim).filter(|k| !k.is_empty()) {
        headers.push(("authorization", format!("Bearer {key}")));
    }
    headers
}

fn tools_json(tools: &[ToolSpec]) -> Value {
    tools
        .iter()
        .map(|tool| {
            json!({
                "type": "function",
                "function": {
                    "name": tool.name,
                    "description": tool.description,
                    "parameters": tool.input_schema,
                },
            })
        })
        .collect()
}

/// Concatenates the text blocks of `blocks`. Multi-part `content` arrays exist, but several
/// local chat templates only handle a plain string.
fn joined_text(blocks: &[ContentBlock]) -> String {
    let texts: Vec<&str> = blocks
        .iter()
        .filter_map(|b| match b {
            ContentBlock::Text { text } if !text.is_empty() => Some(text.as_str()),
            _ => None,
        })
        .collect();
    texts.join("\n")
}

/// A user turn becomes one `tool` message per tool result, then the user's own text. The
/// tool messages come first because they must directly follow the assistant message whose
/// `tool_calls` they answer. A `tool` message takes only text, so the images of the results
/// (`Read` of a picture, an MCP tool's image) follow all of them in one `user` message, each
/// group introduced by the call it came from, with the user's own words after them.
fn push_user(message: &Message, out: &mut Vec<Value>) {
    let mut had_results = false;
    let mut parts = Vec::new();
    for block in &message.content {
        if let ContentBlock::ToolResult {
            tool_use_id,
            content,
            ..
        } = block
        {
            // There is no `is_error` on this wire; the tool's text already says what failed.
            had_results = true;
            let mut text = joined_text(content);
            let images = image_parts(content);
            if !images.is_empty() {
                if !text.is_empty() {
                    text.push('\n');
                }
                text.push_str(&format!(
                    "[{} image(s) of this result follow in the next user message]",
                    images.len()
                ));
                parts.push(json!({"type": "text",
                                  "text": format!("Images from tool call {tool_use_id}:")}));
                parts.extend(images);
            }
            out.push(json!({
                "role": "tool",
                "tool_call_id": tool_use_id,
                "content": text,
            }));
        }
    }
    let text = joined_text(&message.content);
    let images = image_parts(&message.content);
    if !images.is_empty() || !parts.is_empty() {
        // Parts only when there is an image: a plain string suits more chat templates.
        if !text.is_empty() {
            parts.push(json!({"type": "text", "text": text}));
        }
        parts.extend(images);
        out.push(json!({"role": "user", "content": parts}));
        return;
    }
    // An empty user message is kept when it is the only thing in the turn, so that roles
    // still alternate (several chat templates raise otherwise).
    if !text.is_empty() || !had_results {
        out.push(json!({"role": "user", "content": text}));
    }
}

/// The image blocks of `blocks` as `image_url` parts with `data:` URLs.
fn image_parts(blocks: &[ContentBlock]) -> Vec<Value> {
    blocks
        .iter()
        .filter_map(|block| match block {
            ContentBlock::Image { media_type, data } => Some(json!({
                "type": "image_url",
                "image_url": {"url": format!("data:{media_type};base64,{data}")},
            })),
            _ => None,
        })
        .collect()
}

/// An assistant turn: text as `content`, tool uses as `tool_calls`. Thinking is dropped:
/// this wire has no way to send it back, and servers re-derive reasoning anyway.
fn assistant_json(message: &Message) -> Value {
    let calls: Vec<Value> = message
        .content
        .iter()
        .filter_map(|block| match block {
            ContentBlock::ToolUse { id, name, input } => Some(json!({
                "id": id,
                "type": "function",
                "function": {"name": name, "arguments": arguments_string(input)},
            })),
            _ => None,
        })
        .collect();
    let text = joined_text(&message.content);
    let mut obj = Map::new();
    obj.insert("role".into(), json!("assistant"));
    if calls.is_empty() {
        // `content` is required without tool calls; an empty reply stays an empty string so
        // that roles keep alternating.
        obj.insert("content".into(), json!(text));
    } else {
        let content = if text.is_empty() {
            Value::Null
        } else {
            json!(text)
        };
        obj.insert("content".into(), content);
        obj.insert("tool_calls".into(), Value::Array(calls));
    }
    Value::Object(obj)
}

/// `function.arguments` is a JSON string. An input held as a string is assumed to be the
/// model's raw (possibly invalid) arguments and is sent back unchanged, so the model sees
/// what it actually wrote.
fn arguments_string(input: &Value) -> String {
    match input {
        Value::String(raw) => raw.clone(),
        other => other.to_string(),
    }
}

/// A streamed chunk that could not be understood.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DecodeError {
    /// The event's `data` was neither JSON nor `[DONE]`.
    Json { error: String, data: String },
    /// The `data` was JSON but not an object.
    NotAChunk { data: String },
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecodeError::Json { error, data } => {
                write!(
                    f,
                    "malformed json in openai stream chunk: {error} (data: {data})"
                )
            }
            DecodeError::NotAChunk { data } => {
                write!(f, "openai stream chunk is not a json object: {data}")
            }
        }
    }
}

impl std::error::Error for DecodeError {}

/// How much of an offending `data` payload a `DecodeError` quotes.
const MAX_QUOTED_DATA: usize = 200;

/// One tool call being accumulated.
#[derive(Debug)]
struct ToolCall {
    /// The server's `index`, when it sent one.
    wire_index: Option<u64>,
    /// The server's `id`, when it sent a non-empty one.
    wire_id: Option<String>,
    /// Our content-block index.
    block: u32,
    /// Whether `ToolCallStart` was emitted. It waits for the name, because the consumer
    /// cannot do anything with a nameless call.
    started: bool,
    /// Every argument fragment so far. Those that arrived before the name are sent with
    /// `ToolCallStart`; the whole is kept to tell a finished call from a partial one.
    args: String,
}

/// Turns one response's chunks into `ModelEvent`s.
///
/// Block indices are assigned in order of first appearance, like Anthropic's content
/// positions: in the usual reply text is block 0 and tool call *i* is block 1 + *i*; a
/// reasoning block, or a reply that opens with a tool call, shifts that. Only choice 0 is
/// read, since we never ask for more than one.
#[derive(Debug, Default)]
pub struct StreamDecoder {
    started: bool,
    /// `[DONE]` arrived.
    done: bool,
    /// A `finish_reason` arrived.
    finished: bool,
    next_block: u32,
    text_block: Option<u32>,
    thinking_block: Option<u32>,
    calls: Vec<ToolCall>,
}

impl StreamDecoder {
    /// Decodes one SSE event, appending zero or more `ModelEvent`s to `out`. The SSE event
    /// name is ignored: OpenAI sends none, and the JSON says what the chunk is. Events after
    /// `[DONE]` are ignored, since the response is already complete.
    pub fn on_event(
        &mut self,
        ev: &SseEvent,
        out: &mut Vec<ModelEvent>,
    ) -> Result<(), DecodeError> {
        let data = ev.data.trim();
        if self.done || data.is_empty() {
            return Ok(());
        }
        if data == "[DONE]" {
            self.start(&Value::Null, out);
            // A server that skipped `finish_reason` still ended the turn explicitly.
            self.finish(None, out);
            self.done = true;
            out.push(ModelEvent::Done);
            return Ok(());
        }
        let chunk: Value = serde_json::from_str(data).map_err(|e| DecodeError::Json {
            error: e.to_string(),
            data: snippet(data, MAX_QUOTED_DATA),
        })?;
        if !chunk.is_object() {
            return Err(DecodeError::NotAChunk {
                data: snippet(data, MAX_QUOTED_DATA),
            });
        }
        // Mid-stream failures (context overflow on LM Studio, vLLM and llama.cpp) arrive as an
        // error envelope on an HTTP 200 stream.
        if let Some(error) = chunk.get("error").filter(|e| !e.is_null()) {
            out.push(error_event(error));
            return Ok(());
        }
        self.start(&chunk, out);
        let choice = chunk
            .get("choices")
            .and_then(Value::as_array)
            .and_then(|choices| {
                choices
                    .iter()
                    .find(|c| c.get("index").and_then(Value::as_u64).unwrap_or(0) == 0)
            });
        if let Some(choice) = choice {
            if let Some(delta) = choice.get("delta").filter(|d| d.is_object()) {
                self.on_delta(delta, out);
            }
            // Ollama has been seen delivering tool calls on the finishing chunk itself, so
            // the delta above is processed first.
            if let Some(reason) = choice.get("finish_reason").and_then(Value::as_str) {
                self.finish(Some(reason), out);
            }
        }
        // Usage may ride on any chunk: a separate `choices: []` chunk (OpenAI with
        // `include_usage`), the finish chunk, or every chunk (llama.cpp).
        if let Some(usage) = chunk.get("usage").filter(|u| u.is_object()) {
            out.push(ModelEvent::Usage(to_usage(usage)));
        }
        Ok(())
    }

    /// True after `[DONE]`, or after a `finish_reason`: several servers omit `[DONE]`, so
    /// EOF after a finish chunk is a normal end. EOF before either is a truncated response.
    pub fn is_done(&self) -> bool {
        self.done || self.finished
    }

    fn start(&mut self, chunk: &Value, out: &mut Vec<ModelEvent>) {
        if self.started {
            return;
        }
        self.started = true;
        let text = |key: &str| {
            chunk
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

    fn alloc_block(&mut self) -> u32 {
        let block = self.next_block;
        self.next_block = self.next_block.saturating_add(1);
        block
    }

    fn on_delta(&mut self, delta: &Value, out: &mut Vec<ModelEvent>) {
        let text = |key: &str| {
            delta
                .get(key)
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
        };
        // Servers that send both names carry the same text in each; `reasoning_content` is
        // the older and more common one.
        if let Some(reasoning) = text("reasoning_content").or_else(|| text("reasoning")) {
            let index = match self.thinking_block {
                Some(index) => index,
                None => {
                    let index = self.alloc_block();
                    self.thinking_block = Some(index);
                    index
                }
            };
            out.push(ModelEvent::ThinkingDelta {
                index,
                text: reasoning.to_owned(),
            });
        }
        if let Some(content) = text("content") {
            let index = match self.text_block {
                Some(index) => index,
                None => {
                    let index = self.alloc_block();
                    self.text_block = Some(index);
                    index
                }
            };
            out.push(ModelEvent::TextDelta {
                index,
                text: content.to_owned(),
            });
        }
        if let Some(calls) = delta.get("tool_calls").and_then(Value::as_array) {
            for fragment in calls.iter().filter(|c| c.is_object()) {
                self.on_tool_fragment(fragment, out);
            }
        }
    }

    fn on_tool_fragment(&mut self, fragment: &Value, out: &mut Vec<ModelEvent>) {
        let wire_index = fragment.get("index").and_then(Value::as_u64);
        let id = fragment
            .get("id")
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty());
        let function = fragment.get("function").unwrap_or(&Value::Null);
        let name = function
            .get("name")
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty());
        let args = match function.get("arguments") {
            Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
            Some(Value::String(_) | Value::Null) | None => None,
            // Ollama's native shape: the arguments as an object rather than a string.
            Some(other) => Some(other.to_string()),
        };

        let pos = match self.find_call(wire_index, id, name) {
            Some(pos) => pos,
            None => {
                let block = self.alloc_block();
                self.calls.push(ToolCall {
                    wire_index,
                    wire_id: None,
                    block,
                    started: false,
                    args: String::new(),
                });
                self.calls.len() - 1
            }
        };
        let call = &mut self.calls[pos];
        if call.wire_id.is_none()
            && !call.started
            && let Some(id) = id
        {
            call.wire_id = Some(id.to_owned());
        }
        if let Some(name) = name
            && !call.started
        {
            call.started = true;
            out.push(ModelEvent::ToolCallStart {
                index: call.block,
                id: call_id(call, pos),
                name: name.to_owned(),
            });
            if !call.args.is_empty() {
                out.push(ModelEvent::ToolCallInputDelta {
                    index: call.block,
                    partial_json: call.args.clone(),
                });
            }
        }
        if let Some(args) = args {
            call.args.push_str(&args);
            if call.started {
                out.push(ModelEvent::ToolCallInputDelta {
                    index: call.block,
                    partial_json: args,
                });
            }
        }
    }

    /// Which accumulated call a fragment continues, or `None` for a new call.
    ///
    /// Normally `index` decides. Two server bugs are tolerated. A missing `index` (Ollama
    /// before #7881, which sent each call whole): a fragment with a new id starts a new call,
    /// and so does a name without an id once the previous call's arguments form a complete
    /// object (some servers repeat the name on every fragment of one call). And an `index`
    /// reused for a different call: a new non-empty id under a taken index is a new call.
    fn find_call(
        &self,
        wire_index: Option<u64>,
        id: Option<&str>,
        name: Option<&str>,
    ) -> Option<usize> {
        let differs = |call: &ToolCall| matches!((id, &call.wire_id), (Some(a), Some(b)) if a != b);
        match wire_index {
            Some(index) => {
                let pos = self
                    .calls
                    .iter()
                    .rposition(|c| c.wire_index == Some(index))?;
                (!differs(&self.calls[pos])).then_some(pos)
            }
            None => {
                let pos = self.calls.len().checked_sub(1)?;
                let last = &self.calls[pos];
                let new_name = id.is_none()
                    && name.is_some()
                    && last.started
                    && serde_json::from_str::<Value>(&last.args).is_ok_and(|v| v.is_object());
                (!differs(last) && !new_name).then_some(pos)
            }
        }
    }

    /// Reports the stop reason once, first starting any call whose name never came so its
    /// arguments are not lost (the consumer will report an unknown tool).
    ///
    /// Accumulated tool calls outrank `finish_reason`, because gpt-4o, Ollama and several
    /// proxies say `stop` after tool calls. `length` and `content_filter` still win: the
    /// calls' arguments may be cut off, and the agent must know that.
    fn finish(&mut self, reason: Option<&str>, out: &mut Vec<ModelEvent>) {
        if self.finished {
            return;
        }
        self.finished = true;
        for (pos, call) in self.calls.iter_mut().enumerate() {
            if call.started {
                continue;
            }
            call.started = true;
            out.push(ModelEvent::ToolCallStart {
                index: call.block,
                id: call_id(call, pos),
                name: String::new(),
            });
            if !call.args.is_empty() {
                out.push(ModelEvent::ToolCallInputDelta {
                    index: call.block,
                    partial_json: call.args.clone(),
                });
            }
        }
        let has_calls = !self.calls.is_empty();
        let stop = match reason {
            Some("length") => StopReason::MaxTokens,
            Some("content_filter") => StopReason::ContentFilter,
            // `tool_calls` (and the legacy `function_call`) without any call leaves the
            // agent nothing to run, so it ends the turn like `stop` does.
            _ if has_calls => StopReason::ToolUse,
            _ => StopReason::EndTurn,
        };
        out.push(ModelEvent::Stop(stop));
    }
}

/// The call's id, or `call_<n>` when the server sent none (LM Studio): tool results must
/// name the call they answer, and an empty id would collide across parallel calls.
fn call_id(call: &ToolCall, pos: usize) -> String {
    call.wire_id
        .clone()
        .unwrap_or_else(|| format!("call_{pos}"))
}

/// `prompt_tokens` already includes cached tokens, matching our inclusive `input_tokens`.
/// There is no cache-write count on this wire.
fn to_usage(usage: &Value) -> Usage {
    let field = |key: &str| usage.get(key).and_then(Value::as_u64);
    Usage {
        input_tokens: field("prompt_tokens").unwrap_or(0),
        output_tokens: field("completion_tokens").unwrap_or(0),
        cache_creation_input_tokens: None,
        cache_read_input_tokens: usage
            .get("prompt_tokens_details")
            .and_then(|d| d.get("cached_tokens"))
            .and_then(Value::as_u64),
    }
}

/// The error kind of an OpenAI-style envelope. `code` is the more specific field on OpenAI
/// (`insufficient_quota`, `rate_limit_exceeded`, `context_length_exceeded`, while `type` may
/// just be `requests` or `invalid_request_error`); llama.cpp puts the HTTP status in `code`
/// and the meaning in `type`.
fn error_kind(error: &Value) -> Option<&str> {
    let text = |key: &str| {
        error
            .get(key)
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
    };
    text("code").or_else(|| text("type"))
}

/// An in-stream error. Transient kinds, and a numeric `code` of 429 or 5xx (llama.cpp, vLLM),
/// are retryable if nothing was shown yet.
fn error_event(error: &Value) -> ModelEvent {
    // Some servers send the message as a bare string: `{"error":"…"}`.
    if let Some(message) = error.as_str() {
        return ModelEvent::Error {
            kind: "error".to_owned(),
            message: message.to_owned(),
            retryable: false,
        };
    }
    let kind = error_kind(error).unwrap_or("error").to_owned();
    let message = error
        .get("message")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    let status_says_transient = error
        .get("code")
        .and_then(Value::as_u64)
        .is_some_and(|code| code == 429 || (500..=599).contains(&code));
    let retryable = status_says_transient
        || matches!(
            kind.as_str(),
            "server_error" | "rate_limit_exceeded" | "overloaded_error" | "api_error"
        );
    ModelEvent::Error {
        kind,
        message,
        retryable,
    }
}

/// Reads a non-2xx response body: `{"error":{"message","type","param","code"}}` from OpenAI
/// and most compatible servers, `{"error":"…"}` from a few. Anything else (a proxy's HTML
/// page, FastAPI's `{"detail":…}`) becomes the message as text.
pub fn parse_error_body(status: u16, body: &[u8]) -> ProviderError {
    let parsed: Option<Value> = serde_json::from_slice(body).ok();
    let error = parsed.as_ref().and_then(|v| v.get("error"));
    if let Some(message) = error.and_then(Value::as_str) {
        return ProviderError {
            status,
            kind: String::new(),
            message: message.to_owned(),
        };
    }
    match error.and_then(|e| Some((e, e.get("message")?.as_str()?))) {
        Some((error, message)) => ProviderError {
            status,
            kind: error_kind(error).unwrap_or_default().to_owned(),
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

    fn sse(data: &str) -> SseEvent {
        SseEvent {
            event: "message".to_owned(),
            data: data.to_owned(),
            id: None,
        }
    }

    /// Feeds every `data: ` line of a transcript.
    fn decode(transcript: &str) -> (StreamDecoder, Vec<ModelEvent>) {
        let mut decoder = StreamDecoder::default();
        let mut out = Vec::new();
        for line in transcript.lines() {
            if let Some(data) = line.strip_prefix("data: ") {
                decoder.on_event(&sse(data), &mut out).unwrap();
            }
        }
        (decoder, out)
    }

    fn start(id: &str, model: &str) -> ModelEvent {
        ModelEvent::Start {
            message_id: id.into(),
            model: model.into(),
        }
    }

    fn text(index: u32, text: &str) -> ModelEvent {
        ModelEvent::TextDelta {
            index,
            text: text.into(),
        }
    }

    fn call(index: u32, id: &str, name: &str) -> ModelEvent {
        ModelEvent::ToolCallStart {
            index,
            id: id.into(),
            name: name.into(),
        }
    }

    fn args(index: u32, partial_json: &str) -> ModelEvent {
        ModelEvent::ToolCallInputDelta {
            index,
            partial_json: partial_json.into(),
        }
    }

    fn body_json(req: &ModelRequest) -> Value {
        serde_json::from_slice(&request_body(req)).unwrap()
    }

    #[test]
    fn request_matches_the_documented_shape() {
        let messages = [
            Message::user_text("Open README.md"),
            Message {
                role: Role::Assistant,
                content: vec![
                    ContentBlock::Thinking {
                        thinking: "hmm".into(),
                        signature: Some("sig".into()),
                    },
                    ContentBlock::ToolUse {
                        id: "call_abc".into(),
                        name: "read_file".into(),
                        input: json!({"path": "README.md"}),
                    },
                ],
            },
            Message {
                role: Role::User,
                content: vec![ContentBlock::ToolResult {
                    tool_use_id: "call_abc".into(),
                    content: vec![ContentBlock::text("# Hello")],
                    is_error: false,
                }],
            },
        ];
        let tools = [ToolSpec {
            name: "read_file".into(),
            description: "Read a file".into(),
            input_schema: json!({"type": "object", "properties": {"path": {"type": "string"}},
                                 "required": ["path"]}),
        }];
        let req = ModelRequest {
            model: "gpt-4.1",
            max_tokens: 1024,
            effort: None,
            system: "You are a coding agent.",
            messages: &messages,
            tools: &tools,
        };
        assert_eq!(
            body_json(&req),
            json!({
                "model": "gpt-4.1", "stream": true, "stream_options": {"include_usage": true},
                "max_tokens": 1024,
                "messages": [
                    {"role": "system", "content": "You are a coding agent."},
                    {"role": "user", "content": "Open README.md"},
                    {"role": "assistant", "content": null, "tool_calls": [
                        {"id": "call_abc", "type": "function",
                         "function": {"name": "read_file", "arguments": "{\"path\":\"README.md\"}"}}]},
                    {"role": "tool", "tool_call_id": "call_abc", "content": "# Hello"},
                ],
                "tools": [{"type": "function", "function": {"name": "read_file",
                    "description": "Read a file",
                    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                   "required": ["path"]}}}],
            })
        );
    }

    #[test]
    fn request_edge_cases() {
        let messages = [
            Message::user_text("go"),
            // An empty reply stays, with "" content, so roles alternate.
            Message {
                role: Role::Assistant,
                content: vec![],
            },
            Message::user_text("again"),
            Message {
                role: Role::Assistant,
                content: vec![
                    ContentBlock::text("Two calls."),
                    ContentBlock::ToolUse {
                        id: "a".into(),
                        name: "x".into(),
                        input: json!("{\"broken"),
                    },
                    ContentBlock::ToolUse {
                        id: "b".into(),
                        name: "y".into(),
                        input: json!({}),
                    },
                ],
            },
            Message {
                role: Role::User,
                content: vec![
                    ContentBlock::text("and then"),
                    ContentBlock::ToolResult {
                        tool_use_id: "a".into(),
                        content: vec![ContentBlock::text("line 1"), ContentBlock::text("line 2")],
                        is_error: true,
                    },
                    ContentBlock::ToolResult {
                        tool_use_id: "b".into(),
                        content: vec![],
                        is_error: false,
                    },
                ],
            },
        ];
        let req = ModelRequest {
            model: "m",
            max_tokens: 5,
            effort: None,
            system: "",
            messages: &messages,
            tools: &[],
        };
        let body = body_json(&req);
        assert_eq!(body.get("tools"), None);
        assert_eq!(
            body["messages"],
            json!([
                {"role": "user", "content": "go"},
                {"role": "assistant", "content": ""},
                {"role": "user", "content": "again"},
                {"role": "assistant", "content": "Two calls.", "tool_calls": [
                    {"id": "a", "type": "function", "function": {"name": "x", "arguments": "{\"broken"}},
                    {"id": "b", "type": "function", "function": {"name": "y", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "a", "content": "line 1\nline 2"},
                {"role": "tool", "tool_call_id": "b", "content": ""},
                {"role": "user", "content": "and then"},
            ])
        );
    }

    #[test]
    fn tool_result_images_follow_every_tool_message_in_one_user_message() {
        let png = ContentBlock::image("image/png", "iVBORw0KGgo=").unwrap();
        let gif = ContentBlock::image("image/gif", "R0lGOD==").unwrap();
        let messages = [
            Message {
                role: Role::Assistant,
                content: vec![
                    ContentBlock::ToolUse {
                        id: "a".into(),
                        name: "Read".into(),
                        input: json!({"path": "a.png"}),
                    },
                    ContentBlock::ToolUse {
                        id: "b".into(),
                        name: "Bash".into(),
                        input: json!({}),
                    },
                    ContentBlock::ToolUse {
                        id: "c".into(),
                        name: "mcp__s__shot".into(),
                        input: json!({}),
                    },
                ],
            },
            Message {
                role: Role::User,
                content: vec![
                    ContentBlock::ToolResult {
                        tool_use_id: "a".into(),
                        content: vec![png.clone()],
                        is_error: false,
                    },
                    ContentBlock::ToolResult {
                        tool_use_id: "b".into(),
                        content: vec![ContentBlock::text("ok")],
                        is_error: false,
                    },
                    ContentBlock::ToolResult {
                        tool_use_id: "c".into(),
                        content: vec![ContentBlock::text("two shots"), png, gif],
                        is_error: false,
                    },
                    ContentBlock::text("and look"),
                ],
            },
        ];
        let req = ModelRequest {
            model: "m",
            max_tokens: 5,
            effort: None,
            system: "",
            messages: &messages,
            tools: &[],
        };
        let url = |t: &str, d: &str| json!({"type": "image_url", "image_url": {"url": format!("data:{t};base64,{d}")}});
        let body = body_json(&req);
        assert_eq!(
            body["messages"].as_array().unwrap()[1..],
            [
                json!({"role": "tool", "tool_call_id": "a",
                       "content": "[1 image(s) of this result follow in the next user message]"}),
                json!({"role": "tool", "tool_call_id": "b", "content": "ok"}),
                json!({"role": "tool", "tool_call_id": "c", "content":
                       "two shots\n[2 image(s) of this result follow in the next user message]"}),
                json!({"role": "user", "content": [
                    {"type": "text", "text": "Images from tool call a:"},
                    url("image/png", "iVBORw0KGgo="),
                    {"type": "text", "text": "Images from tool call c:"},
                    url("image/png", "iVBORw0KGgo="),
                    url("image/gif", "R0lGOD=="),
                    {"type": "text", "text": "and look"},
                ]}),
            ]
        );
    }

    #[test]
    fn headers() {
        let base = vec![
            ("content-type", "application/json".to_owned()),
            ("accept", "text/event-stream".to_owned()),
        ];
        assert_eq!(request_headers(None), base);
        assert_eq!(request_headers(Some("  ")), base);
        let mut with_key = base.clone();
        with_key.push(("authorization", "Bearer sk-1".to_owned()));
        assert_eq!(request_headers(Some("sk-1")), with_key);
    }

    /// Text frames as llama-server sends them (models.md §4.5): usage on a `choices: []`
    /// chunk with `timings`, then `[DONE]`.
    #[test]
    fn decodes_llama_server_text() {
        let (decoder, events) = decode(
            r#"
data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":null}}],"created":1795980831,"id":"chatcmpl-Sulf","model":"model/SmolLM2-135M-Instruct.Q4_1.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}
data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"Hello"}}],"created":1795980831,"id":"chatcmpl-Sulf","model":"model/SmolLM2-135M-Instruct.Q4_1.gguf","object":"chat.completion.chunk"}
data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":","}}],"created":1795980831,"id":"chatcmpl-Sulf","model":"model/SmolLM2-135M-Instruct.Q4_1.gguf","object":"chat.completion.chunk"}
data: {"choices":[{"finish_reason":"stop","index":0,"delta":{}}],"created":1795980831,"id":"chatcmpl-Sulf","model":"model/SmolLM2-135M-Instruct.Q4_1.gguf","object":"chat.completion.chunk"}
data: {"choices":[],"created":1795980831,"id":"chatcmpl-Sulf","model":"model/SmolLM2-135M-Instruct.Q4_1.gguf","object":"chat.completion.chunk","usage":{"completion_tokens":2,"prompt_tokens":30,"total_tokens":32},"timings":{"prompt_n":30}}
data: [DONE]
"#,
        );
        assert_eq!(
            events,
            vec![
                start("chatcmpl-Sulf", "model/SmolLM2-135M-Instruct.Q4_1.gguf"),
                text(0, "Hello"),
                text(0, ","),
                ModelEvent::Stop(StopReason::EndTurn),
                ModelEvent::Usage(Usage {
                    input_tokens: 30,
                    output_tokens: 2,
                    cache_creation_input_tokens: None,
                    cache_read_input_tokens: None,
                }),
                ModelEvent::Done,
            ]
        );
        assert!(decoder.is_done());
    }

    /// The streamed tool call captured from llama-server (models.md §4.5).
    #[test]
    fn decodes_llama_server_tool_call() {
        let (_, events) = decode(
            r#"
data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":null}}],"id":"chatcmpl-1","model":"qwen"}
data: {"choices":[{"finish_reason":null,"index":0,"delta":{"tool_calls":[{"index":0,"id":"rPQJ9CPodOdfkJHc9IXOb7RFnKrvL5RH","type":"function","function":{"name":"get_weather","arguments":"{"}}]}}]}
data: {"choices":[{"finish_reason":null,"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"\"city\":\""}}]}}]}
data: {"choices":[{"finish_reason":null,"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"Paris"}}]}}]}
data: {"choices":[{"finish_reason":null,"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"\""}}]}}]}
data: {"choices":[{"finish_reason":null,"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"}"}}]}}]}
data: {"choices":[{"finish_reason":"tool_calls","index":0,"delta":{}}]}
data: {"choices":[],"usage":{"completion_tokens":24,"prompt_tokens":277,"total_tokens":301,"prompt_tokens_details":{"cached_tokens":276}},"timings":{}}
data: [DONE]
"#,
        );
        assert_eq!(
            events,
            vec![
                start("chatcmpl-1", "qwen"),
                call(0, "rPQJ9CPodOdfkJHc9IXOb7RFnKrvL5RH", "get_weather"),
                args(0, "{"),
                args(0, "\"city\":\""),
                args(0, "Paris"),
                args(0, "\""),
                args(0, "}"),
                ModelEvent::Stop(StopReason::ToolUse),
                ModelEvent::Usage(Usage {
                    input_tokens: 277,
                    output_tokens: 24,
                    cache_creation_input_tokens: None,
                    cache_read_input_tokens: Some(276),
                }),
                ModelEvent::Done,
            ]
        );
    }

    #[test]
    fn interleaved_parallel_calls_after_text() {
        let (_, events) = decode(
            r#"
data: {"id":"c","model":"m","choices":[{"index":0,"delta":{"content":"Reading both."}}]}
data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_a","type":"function","function":{"name":"read","arguments":""}}]}}]}
data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":1,"id":"call_b","type":"function","function":{"name":"read","arguments":"{\"p\":"}}]}}]}
data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"p\":1}"}}]}}]}
data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":1,"function":{"arguments":"2}"}}]}}]}
data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}
"#,
        );
        assert_eq!(
            events,
            vec![
                start("c", "m"),
                text(0, "Reading both."),
                call(1, "call_a", "read"),
                call(2, "call_b", "read"),
                args(2, "{\"p\":"),
                args(1, "{\"p\":1}"),
                args(2, "2}"),
                // `stop` with accumulated calls is still a tool-use turn.
                ModelEvent::Stop(StopReason::ToolUse),
            ]
        );
    }

    #[test]
    fn eof_after_finish_is_a_normal_end() {
        let (decoder, _) = decode(
            r#"
data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}
"#,
        );
        assert!(!decoder.is_done());
        let (decoder, events) = decode(
            r#"
data: {"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":"length"}]}
"#,
        );
        assert!(decoder.is_done());
        assert_eq!(
            events,
            vec![
                start("", ""),
                text(0, "hi"),
                ModelEvent::Stop(StopReason::MaxTokens)
            ]
        );
    }

    #[test]
    fn ollama_whole_calls_without_index_or_id() {
        // Missing `index`, missing `id`, arguments as an object, all on the finish chunk.
        let (_, events) = decode(
            r#"
data: {"id":"o","model":"qwen3","choices":[{"index":0,"delta":{"tool_calls":[{"function":{"name":"a","arguments":{"x":1}}},{"function":{"name":"b","arguments":{}}}]},"finish_reason":"stop"}]}
"#,
        );
        assert_eq!(
            events,
            vec![
                start("o", "qwen3"),
                call(0, "call_0", "a"),
                args(0, r#"{"x":1}"#),
                call(1, "call_1", "b"),
                args(1, "{}"),
                ModelEvent::Stop(StopReason::ToolUse),
            ]
        );
    }

    #[test]
    fn missing_index_continues_the_last_call_and_new_ids_start_new_ones() {
        let (_, events) = decode(
            r#"
data: {"choices":[{"delta":{"tool_calls":[{"id":"x1","function":{"name":"a","arguments":"{"}}]}}]}
data: {"choices":[{"delta":{"tool_calls":[{"function":{"arguments":"}"}}]}}]}
data: {"choices":[{"delta":{"tool_calls":[{"id":"x2","function":{"name":"b"}}]}}]}
data: {"choices":[{"delta":{"tool_calls":[{"id":"x2","function":{"arguments":"[]"}}]}}]}
data: {"choices":[{"delta":{"tool_calls":[{"index":0,"id":"y1","function":{"name":"c","arguments":"{}"}}]}}]}
"#,
        );
        assert_eq!(
            events,
            vec![
                start("", ""),
                call(0, "x1", "a"),
                args(0, "{"),
                args(0, "}"),
                call(1, "x2", "b"),
                args(1, "[]"),
                // Index 0 was never used by the server, so this is its own call.
                call(2, "y1", "c"),
                args(2, "{}"),
            ]
        );
    }

    #[test]
    fn name_repeated_on_every_fragment_is_one_call() {
        let (_, events) = decode(
            r#"
data: {"choices":[{"delta":{"tool_calls":[{"function":{"name":"f","arguments":"{\"a\":"}}]}}]}
data: {"choices":[{"delta":{"tool_calls":[{"function":{"name":"f","arguments":"1}"}}]}}]}
data: {"choices":[{"delta":{"tool_calls":[{"function":{"name":"f","arguments":"{}"}}]}}]}
"#,
        );
        assert_eq!(
            events,
            vec![
                start("", ""),
                call(0, "call_0", "f"),
                args(0, "{\"a\":"),
                args(0, "1}"),
                // The first call's arguments were complete, so this is a second call.
                call(1, "call_1", "f"),
                args(1, "{}"),
            ]
        );
    }

    #[test]
    fn reused_index_with_a_new_id_is_a_new_call() {
        let (_, events) = decode(
            r#"
data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"a","function":{"name":"f","arguments":"{}"}}]}}]}
data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"b","function":{"name":"g","arguments":"{}"}}]}}]}
data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"b","function":{"arguments":""}}]}}]}
"#,
        );
        assert_eq!(
            events,
            vec![
                start("", ""),
                call(0, "a", "f"),
                args(0, "{}"),
                call(1, "b", "g"),
                args(1, "{}"),
            ]
        );
    }

    #[test]
    fn arguments_before_the_name_are_held_back() {
        let (_, events) = decode(
            r#"
data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"","function":{"arguments":"{\"a\""}}]}}]}
data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"name":"f","arguments":":1}"}}]}}]}
data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":3,"function":{"arguments":"{}"}}]}}]}
data: [DONE]
"#,
        );
        assert_eq!(
            events,
            vec![
                start("", ""),
                call(0, "call_0", "f"),
                args(0, "{\"a\""),
                args(0, ":1}"),
                // A call whose name never came is still surfaced at the end.
                call(1, "call_1", ""),
                args(1, "{}"),
                ModelEvent::Stop(StopReason::ToolUse),
                ModelEvent::Done,
            ]
        );
    }

    #[test]
    fn reasoning_gets_its_own_block() {
        let (_, events) = decode(
            r#"
data: {"choices":[{"index":0,"delta":{"reasoning_content":"think"}}]}
data: {"choices":[{"index":0,"delta":{"reasoning":"more","reasoning_content":"more"}}]}
data: {"choices":[{"index":0,"delta":{"reasoning":"vllm"}}]}
data: {"choices":[{"index":0,"delta":{"content":"answer"}}]}
data: {"choices":[{"index":0,"delta":{"content":""},"finish_reason":"content_filter"}]}
"#,
        );
        let thinking = |text: &str| ModelEvent::ThinkingDelta {
            index: 0,
            text: text.into(),
        };
        assert_eq!(
            events,
            vec![
                start("", ""),
                thinking("think"),
                thinking("more"),
                thinking("vllm"),
                text(1, "answer"),
                ModelEvent::Stop(StopReason::ContentFilter),
            ]
        );
    }

    #[test]
    fn finish_reasons() {
        for (reason, expected) in [
            ("stop", StopReason::EndTurn),
            ("length", StopReason::MaxTokens),
            ("content_filter", StopReason::ContentFilter),
            ("tool_calls", StopReason::EndTurn),
            ("whatever", StopReason::EndTurn),
        ] {
            let data =
                format!(r#"{{"choices":[{{"index":0,"delta":{{}},"finish_reason":"{reason}"}}]}}"#);
            let (_, events) = decode(&format!("data: {data}\n"));
            assert_eq!(events.last(), Some(&ModelEvent::Stop(expected)), "{reason}");
        }
        // With a call accumulated, only length and content_filter survive.
        for (reason, expected) in [
            ("tool_calls", StopReason::ToolUse),
            ("length", StopReason::MaxTokens),
            ("content_filter", StopReason::ContentFilter),
        ] {
            let (_, events) = decode(&format!(
                "data: {}\ndata: {}\n",
                r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"i","function":{"name":"f","arguments":"{\"a"}}]}}]}"#,
                format_args!(
                    r#"{{"choices":[{{"index":0,"delta":{{}},"finish_reason":"{reason}"}}]}}"#
                ),
            ));
            assert_eq!(events.last(), Some(&ModelEvent::Stop(expected)), "{reason}");
        }
    }

    #[test]
    fn stop_is_reported_once() {
        let (_, events) = decode(
            r#"
data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"usage":{"prompt_tokens":5,"completion_tokens":1}}
data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}
data: [DONE]
data: {"choices":[{"index":0,"delta":{"content":"late"}}]}
"#,
        );
        let usage = Usage {
            input_tokens: 5,
            output_tokens: 1,
            ..Usage::default()
        };
        assert_eq!(
            events,
            vec![
                start("", ""),
                ModelEvent::Stop(StopReason::EndTurn),
                ModelEvent::Usage(usage),
                ModelEvent::Done,
            ]
        );
    }

    #[test]
    fn done_alone_still_reports_start_and_stop() {
        let (decoder, events) = decode("data: [DONE]\n");
        assert_eq!(
            events,
            vec![
                start("", ""),
                ModelEvent::Stop(StopReason::EndTurn),
                ModelEvent::Done
            ]
        );
        assert!(decoder.is_done());
    }

    #[test]
    fn error_chunks() {
        let (decoder, events) = decode(
            r#"
data: {"error":{"message":"context length exceeded","type":"invalid_request_error","code":"context_length_exceeded"}}
data: {"error":{"code":500,"message":"boom","type":"server_error"}}
data: {"error":{"object":"error","message":"bad","type":"BadRequestError","param":null,"code":400}}
data: {"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}
data: {"error":"model not found"}
"#,
        );
        assert_eq!(
            events,
            vec![
                ModelEvent::Error {
                    kind: "context_length_exceeded".into(),
                    message: "context length exceeded".into(),
                    retryable: false,
                },
                ModelEvent::Error {
                    kind: "server_error".into(),
                    message: "boom".into(),
                    retryable: true,
                },
                ModelEvent::Error {
                    kind: "BadRequestError".into(),
                    message: "bad".into(),
                    retryable: false,
                },
                ModelEvent::Error {
                    kind: "unavailable_error".into(),
                    message: "Loading model".into(),
                    retryable: true,
                },
                ModelEvent::Error {
                    kind: "error".into(),
                    message: "model not found".into(),
                    retryable: false,
                },
            ]
        );
        assert!(!decoder.is_done());
    }

    #[test]
    fn malformed_input_is_an_error_not_a_panic() {
        let mut decoder = StreamDecoder::default();
        let mut out = Vec::new();
        let mut feed = |data: &str| decoder.on_event(&sse(data), &mut out);
        assert!(matches!(
            feed("{\"choices\":"),
            Err(DecodeError::Json { .. })
        ));
        assert_eq!(
            feed("42"),
            Err(DecodeError::NotAChunk { data: "42".into() })
        );
        // Odd shapes inside an object are skipped.
        for data in [
            r#"{"choices":7}"#,
            r#"{"choices":[{"index":1,"delta":{"content":"other choice"}}]}"#,
            r#"{"choices":[{"index":0,"delta":"x","finish_reason":5}]}"#,
            r#"{"choices":[{"index":0,"delta":{"content":7,"tool_calls":[1,null,{"index":-1}]}}]}"#,
            r#"{"choices":[],"usage":null,"error":null}"#,
            "",
            "  ",
        ] {
            assert_eq!(feed(data), Ok(()), "{data}");
        }
        let (out_start, rest) = out.split_first().unwrap();
        assert_eq!(out_start, &start("", ""));
        // The index -1 fragment opened a nameless call, held until the finish.
        assert_eq!(rest, &[]);
        assert_eq!(
            DecodeError::NotAChunk { data: "42".into() }.to_string(),
            "openai stream chunk is not a json object: 42"
        );
    }

    #[test]
    fn error_bodies() {
        let quota = br#"{"error":{"message":"You exceeded your current quota","type":"insufficient_quota","param":null,"code":"insufficient_quota"}}"#;
        assert_eq!(
            parse_error_body(429, quota),
            ProviderError {
                status: 429,
                kind: "insufficient_quota".into(),
                message: "You exceeded your current quota".into(),
            }
        );
        let rate = br#"{"error":{"message":"Rate limit reached. Please try again in 1.2s.","type":"requests","param":null,"code":"rate_limit_exceeded"}}"#;
        assert_eq!(parse_error_body(429, rate).kind, "rate_limit_exceeded");
        let llama = br#"{"error":{"code":400,"message":"[json.exception.parse_error.101] bad","type":"invalid_request_error"}}"#;
        assert_eq!(parse_error_body(400, llama).kind, "invalid_request_error");
        let bare = br#"{"error":"model 'x' not found"}"#;
        assert_eq!(parse_error_body(404, bare).message, "model 'x' not found");
        let detail = br#"{"detail":"Not Found"}"#;
        assert_eq!(
            parse_error_body(404, detail),
            ProviderError {
                status: 404,
                kind: String::new(),
                message: r#"{"detail":"Not Found"}"#.into(),
            }
        );
        assert_eq!(parse_error_body(503, b"").message, "empty response body");
    }
}
