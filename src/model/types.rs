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
    /// An image in a prompt, base64 as both providers take it; made by `ContentBlock::image`,
    /// which checks what they would refuse.
    Image {
        media_type: String,
        data: String,
    },
}

/// Image types both providers take.
pub const IMAGE_TYPES: [&str; 4] = ["image/png", "image/jpeg", "image/gif", "image/webp"];

/// The largest image accepted, in base64 characters (3 MiB, about 2.25 MiB of image):
/// under Anthropic's 5 MB per image, and small enough that a prompt with one still fits a
/// run's input queue (`drive::table::MAX_QUEUED_INPUT_BYTES`) and a session-file line.
pub const MAX_IMAGE_BASE64: usize = 3 << 20;

/// The most images one message may carry.
pub const MAX_IMAGES: usize = 8;

/// The type an image's first bytes say it is (its magic number), if one of `IMAGE_TYPES`.
pub fn sniff_image(bytes: &[u8]) -> Option<&'static str> {
    if bytes.starts_with(b"\x89PNG\r\n\x1a\n") {
        Some("image/png")
    } else if bytes.starts_with(&[0xff, 0xd8, 0xff]) {
        Some("image/jpeg")
    } else if bytes.starts_with(b"GIF87a") || bytes.starts_with(b"GIF89a") {
        Some("image/gif")
    } else if bytes.len() >= 12 && &bytes[..4] == b"RIFF" && &bytes[8..12] == b"WEBP" {
        Some("image/webp")
    } else {
        None
    }
}

/// Base64 characters of an image decoded to sniff it: 16 give 12 bytes, as many as the
/// longest magic number (WebP's) needs.
const SNIFF_BASE64_CHARS: usize = 16;

/// The first bytes of base64 `data` (already checked to be base64).
fn decode_prefix(data: &str) -> Vec<u8> {
    let value = |c: u8| match c {
        b'A'..=b'Z' => Some(c - b'A'),
        b'a'..=b'z' => Some(c - b'a' + 26),
        b'0'..=b'9' => Some(c - b'0' + 52),
        b'+' => Some(62),
        b'/' => Some(63),
        _ => None,
    };
    let mut out = Vec::new();
    let (mut acc, mut bits) = (0u32, 0);
    for c in data.bytes().take(SNIFF_BASE64_CHARS) {
        let Some(v) = value(c) else { break };
        acc = acc << 6 | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    out
}

impl ContentBlock {
    /// An image a client sent in a prompt: as `image`, and its bytes must be the type it
    /// claims, by the magic numbers `Read` trusts for image files (`sniff_image`), so a
    /// mislabelled picture or something that is no picture is refused to the client that
    /// sent it rather than passed to the provider under a false type.
    pub fn prompt_image(media_type: &str, data: &str) -> Result<ContentBlock, String> {
        let image = ContentBlock::image(media_type, data)?;
        check_sniffed(media_type, data)?;
        Ok(image)
    }

    /// An image block from base64 `data`, or why it cannot be sent: a type neither
    /// provider takes, an image over `MAX_IMAGE_BASE64`, data that is not base64. Errors
    /// are meant for the client that sent it; nothing is dropped silently.
    pub fn image(media_type: &str, data: &str) -> Result<ContentBlock, String> {
        if !IMAGE_TYPES.contains(&media_type) {
            return Err(format!(
                "unsupported image type `{media_type}`: expected one of {}",
                IMAGE_TYPES.join(", ")
            ));
        }
        if data.len() > MAX_IMAGE_BASE64 {
            return Err(format!(
                "image too large: {} bytes of base64, at most {MAX_IMAGE_BASE64}",
                data.len()
            ));
        }
        let body = data.trim_end_matches('=');
        let base64 = |b: u8| b.is_ascii_alphanumeric() || b == b'+' || b == b'/';
        let padding = data.len() - body.len();
        if data.is_empty()
            || !data.len().is_multiple_of(4)
            || padding > 2
            || !body.bytes().all(base64)
        {
            return Err("image data is not base64".to_owned());
        }
        Ok(ContentBlock::Image {
            media_type: media_type.to_owned(),
            data: data.to_owned(),
        })
    }

    /// An image block from the image's bytes, encoded as base64; refused as `image` refuses.
    pub fn image_of_bytes(media_type: &str, bytes: &[u8]) -> Result<ContentBlock, String> {
        if bytes.len().div_ceil(3) * 4 > MAX_IMAGE_BASE64 {
            return Err(format!(
                "image too large: {} bytes, at most {} ({MAX_IMAGE_BASE64} bytes of base64)",
                bytes.len(),
                MAX_IMAGE_BASE64 / 4 * 3
            ));
        }
        ContentBlock::image(media_type, &base64(bytes))
    }

    /// Images from upstream's block shape (`{"type":"image","source":{"type":"base64",
    /// "media_type","data"}}`), as prompts on the drive surfaces and print mode's input
    /// carry them; at most `MAX_IMAGES`.
    pub fn images_from_json(blocks: &[Value]) -> Result<Vec<ContentBlock>, String> {
        if blocks.len() > MAX_IMAGES {
            return Err(format!(
                "{} images in one message; at most {MAX_IMAGES}",
                blocks.len()
            ));
        }
        // Strict about the shape, unlike a session file's blocks: a client's typo (a field
        // meant for another API) is refused rather than ignored.
        let only = |value: &Value, keys: &[&str], what: &str| match value.as_object() {
            Some(obj) => match obj.keys().find(|k| !keys.contains(&k.as_str())) {
                Some(extra) => Err(format!("unexpected field `{extra}` in {what}")),
                None => Ok(()),
            },
            None => Ok(()),
        };
        blocks
            .iter()
            .enumerate()
            .map(|(i, block)| {
                if block.get("type").and_then(Value::as_str) != Some("image") {
                    return Err("expected an image block".to_owned());
                }
                only(block, &["type", "source"], "an image block")?;
                if let Some(source) = block.get("source") {
                    only(source, &["type", "media_type", "data"], "an image source")?;
                }
                match ContentBlock::from_json(block)? {
                    image @ ContentBlock::Image { .. } => {
                        image
                            .check_prompt_image()
                            .map_err(|e| format!("image {}: {e}", i + 1))?;
                        Ok(image)
                    }
                    _ => Err("expected an image block".to_owned()),
                }
            })
            .collect()
    }

    /// For an image block, `prompt_image`'s check of its bytes against its type.
    pub fn check_prompt_image(&self) -> Result<(), String> {
        match self {
            ContentBlock::Image { media_type, data } => check_sniffed(media_type, data),
            _ => Ok(()),
        }
    }

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
            ContentBlock::Image { media_type, data } => json!({
                "type": "image",
                "source": {"type": "base64", "media_type": media_type, "data": data},
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
            Some("image") => {
                let source = value.get("source").unwrap_or(&Value::Null);
                match source.get("type").and_then(Value::as_str) {
                    Some("base64") => {}
                    Some(other) => {
                        return Err(format!(
                            "unsupported image source `{other}`: send the image as base64"
                        ));
                    }
                    None => return Err("an image block needs a base64 `source`".to_owned()),
                }
                let field = |key: &str| source.get(key).and_then(Value::as_str);
                match (field("media_type"), field("data")) {
                    (Some(media_type), Some(data)) => ContentBlock::image(media_type, data),
                    _ => Err("an image source needs string `media_type` and `data`".to_owned()),
                }
            }
            Some(other) => Err(format!("unknown content block type `{other}`")),
            None => Err("content block has no `type`".to_owned()),
        }
    }
}

/// `blocks` with each image, tool results' included, replaced by what `swap` makes of it
/// (for views of a conversation that must not carry every picture in it).
pub fn swap_images(
    blocks: &[ContentBlock],
    swap: &mut impl FnMut(&ContentBlock) -> ContentBlock,
) -> Vec<ContentBlock> {
    blocks
        .iter()
        .map(|block| match block {
            ContentBlock::Image { .. } => swap(block),
            ContentBlock::ToolResult {
                tool_use_id,
                content,
                is_error,
            } => ContentBlock::ToolResult {
                tool_use_id: tool_use_id.clone(),
                content: swap_images(content, swap),
                is_error: *is_error,
            },
            other => other.clone(),
        })
        .collect()
}

/// `bytes` in standard base64 with padding (RFC 4648 §4), as both providers take images.
/// Whether base64 `data` starts as an image of `media_type` does.
fn check_sniffed(media_type: &str, data: &str) -> Result<(), String> {
    match sniff_image(&decode_prefix(data)) {
        Some(sniffed) if sniffed == media_type => Ok(()),
        Some(sniffed) => Err(format!(
            "claimed to be {media_type}, but its bytes are {sniffed}"
        )),
        None => Err(format!(
            "claimed to be {media_type}, but its bytes are not PNG, JPEG, GIF or WebP"
        )),
    }
}

fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[(n >> (18 - 6 * i) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
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

/// How hard the model should think before answering (ACP's `thought_level` option):
/// Anthropic's extended thinking budget, OpenAI's `reasoning_effort`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Effort {
    Low,
    Medium,
    High,
}

impl Effort {
    pub fn parse(s: &str) -> Option<Effort> {
        match s {
            "low" => Some(Effort::Low),
            "medium" => Some(Effort::Medium),
            "high" => Some(Effort::High),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Effort::Low => "low",
            Effort::Medium => "medium",
            Effort::High => "high",
        }
    }
}

/// Everything a provider codec needs to build one request body.
#[derive(Clone, Debug)]
pub struct ModelRequest<'a> {
    pub model: &'a str,
    pub max_tokens: u32,
    /// Extended thinking / reasoning effort; `None` leaves the provider's default.
    pub effort: Option<Effort>,
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
    fn prompt_images_must_be_what_they_claim() {
        let png = base64(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR");
        let jpeg = base64(&[0xff, 0xd8, 0xff, 0xe0, 0, 0x10]);
        let webp = base64(b"RIFF\x10\0\0\0WEBPVP8 ");
        let gif = base64(b"GIF89a\x01\0");
        for (media_type, data) in [
            ("image/png", &png),
            ("image/jpeg", &jpeg),
            ("image/webp", &webp),
            ("image/gif", &gif),
        ] {
            assert!(
                ContentBlock::prompt_image(media_type, data).is_ok(),
                "{media_type}"
            );
        }
        assert_eq!(decode_prefix("Zm9vYmFy"), b"foobar");
        assert_eq!(decode_prefix("Zm9vYg=="), b"foob");
        let err = ContentBlock::prompt_image("image/jpeg", &png).unwrap_err();
        assert_eq!(err, "claimed to be image/jpeg, but its bytes are image/png");
        let err = ContentBlock::prompt_image("image/png", &base64(b"not an image")).unwrap_err();
        assert!(err.contains("not PNG, JPEG, GIF or WebP"), "{err}");
        let blocks = [
            json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}),
            json!({"type": "image", "source": {"type": "base64", "media_type": "image/gif", "data": png}}),
        ];
        let err = ContentBlock::images_from_json(&blocks).unwrap_err();
        assert!(err.starts_with("image 2: claimed to be image/gif"), "{err}");
    }

    #[test]
    fn base64_matches_rfc_4648_vectors() {
        let cases = [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ];
        for (plain, encoded) in cases {
            assert_eq!(base64(plain.as_bytes()), encoded);
        }
        assert_eq!(base64(&[0xff, 0xfe, 0xfd]), "//79");
        let png = ContentBlock::image_of_bytes("image/png", b"\x89PNG\r\n\x1a\n").unwrap();
        assert_eq!(
            png,
            ContentBlock::image("image/png", "iVBORw0KGgo=").unwrap()
        );
        let big = vec![0u8; MAX_IMAGE_BASE64 / 4 * 3 + 1];
        assert!(
            ContentBlock::image_of_bytes("image/png", &big)
                .unwrap_err()
                .contains("too large")
        );
        assert!(ContentBlock::image_of_bytes("image/png", &big[1..]).is_ok());
    }

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
