//! Model providers: which one is configured, how a request goes on the wire, and how its
//! stream decodes. The codecs (`anthropic`, `openai`) are pure; the engine moves the bytes.

pub mod anthropic;
pub mod catalog;
pub mod openai;
pub mod retry;
pub mod types;

use std::sync::Arc;

use rustls::ClientConfig;

use crate::http::client;
use crate::http::sse::SseEvent;
use crate::http::target::{Proxy, Target};
use crate::http::write;
use types::{ModelEvent, ModelRequest};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProviderKind {
    Anthropic,
    OpenAi,
}

impl ProviderKind {
    pub fn parse(s: &str) -> Option<ProviderKind> {
        match s {
            "anthropic" => Some(ProviderKind::Anthropic),
            "openai" | "openai-compatible" => Some(ProviderKind::OpenAi),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ProviderKind::Anthropic => "anthropic",
            ProviderKind::OpenAi => "openai",
        }
    }

    pub fn default_model(self) -> &'static str {
        match self {
            ProviderKind::Anthropic => "claude-sonnet-4-6",
            ProviderKind::OpenAi => "gpt-5.5",
        }
    }
}

/// The message printed (and exit code 78) when no provider is configured.
pub const NOT_CONFIGURED: &str = "no model provider is configured. Set one of:\n  \
ANTHROPIC_API_KEY=…                  Anthropic (optionally ANTHROPIC_BASE_URL)\n  \
OPENAI_API_KEY=…                     OpenAI (optionally OPENAI_BASE_URL)\n  \
OPENAI_BASE_URL=http://127.0.0.1:8080/v1   a local OpenAI-compatible server (llama-server, Ollama, vLLM, LM Studio)\n\
or pass --provider anthropic|openai with the matching variables. For an offline demo, start \
`caliban stub-model --script FILE` and point ANTHROPIC_BASE_URL at it.";

/// How much of a successful reply that is not an event stream is quoted in its error.
pub const MAX_NOT_A_STREAM_QUOTE: usize = 200;

/// Whether a `content-type` says Server-Sent Events. A reply without one gets the benefit of
/// the doubt (its body decides), so a server that forgets the header still works.
pub fn is_event_stream(content_type: Option<&str>) -> bool {
    content_type.is_none_or(|t| {
        t.split(';')
            .next()
            .is_some_and(|t| t.trim().eq_ignore_ascii_case("text/event-stream"))
    })
}

/// The error for a 2xx reply whose body is not the event stream asked for (a proxy's or a
/// web UI's HTML page, a JSON body from a server that ignored `stream: true`): what was
/// received, quoted, rather than "the stream ended early".
pub fn not_an_event_stream(status: u16, content_type: &str, body_head: &[u8]) -> String {
    let text = String::from_utf8_lossy(body_head);
    let text = text.split_whitespace().collect::<Vec<_>>().join(" ");
    let quote = crate::text::cap_chars(&text, MAX_NOT_A_STREAM_QUOTE);
    let mut message = format!(
        "the model server answered {status} with content-type `{content_type}`, not an event \
         stream (text/event-stream); is the base URL right?"
    );
    if !quote.is_empty() {
        message.push_str(&format!(" It sent: {quote}"));
    }
    message
}

#[derive(Clone)]
pub struct Provider {
    pub kind: ProviderKind,
    pub target: Target,
    /// Request path including any prefix from the base URL.
    pub path: String,
    pub proxy: Option<Proxy>,
    pub api_key: Option<String>,
    pub tls: Option<Arc<ClientConfig>>,
    pub model: String,
}

impl Provider {
    /// Chooses the provider from an explicit kind or from which variables are set, then
    /// reads its key and base URL. `Ok(None)` means nothing is configured at all.
    pub fn from_env(
        kind: Option<ProviderKind>,
        model: Option<String>,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Option<Provider>, String> {
        let set = |name: &str| env(name).filter(|v| !v.trim().is_empty());
        let kind = match kind {
            Some(kind) => kind,
            None if set("ANTHROPIC_API_KEY").is_some() || set("ANTHROPIC_BASE_URL").is_some() => {
                ProviderKind::Anthropic
            }
            None if set("OPENAI_API_KEY").is_some() || set("OPENAI_BASE_URL").is_some() => {
                ProviderKind::OpenAi
            }
            None => return Ok(None),
        };
        let (key_var, url_var, default_url, suffix) = match kind {
            ProviderKind::Anthropic => (
                "ANTHROPIC_API_KEY",
                "ANTHROPIC_BASE_URL",
                anthropic::DEFAULT_BASE_URL,
                anthropic::PATH,
            ),
            ProviderKind::OpenAi => (
                "OPENAI_API_KEY",
                "OPENAI_BASE_URL",
                openai::DEFAULT_BASE_URL,
                openai::PATH,
            ),
        };
        let api_key = set(key_var).map(|k| k.trim().to_owned());
        let base = set(url_var);
        if api_key.is_none() && base.is_none() {
            return Ok(None);
        }
        let base = base.unwrap_or_else(|| default_url.to_owned());
        let (target, prefix) =
            client::parse_base_url(base.trim()).map_err(|e| format!("{url_var}: {e}"))?;
        if api_key.is_none() && !client::is_loopback_host(&target.host) {
            return Err(format!(
                "{url_var} points at {} but {key_var} is not set",
                target.host
            ));
        }
        let proxy = client::proxy_for(&target, env)?;
        let tls = if target.tls {
            let (config, roots) = crate::transport::client_config()?;
            crate::log::debug(&format!("tls trusts {}", roots.describe()));
            Some(config)
        } else {
            None
        };
        // Anthropic's base URL is the host root; OpenAI's conventionally ends in /v1.
        let path = format!("{prefix}{suffix}");
        Ok(Some(Provider {
            kind,
            target,
            path,
            proxy,
            api_key,
            tls,
            model: model.unwrap_or_else(|| kind.default_model().to_owned()),
        }))
    }

    /// The full HTTP request for one streamed turn.
    pub fn build_request(&self, req: &ModelRequest) -> Vec<u8> {
        let (body, headers) = match self.kind {
            ProviderKind::Anthropic => (
                anthropic::request_body(req),
                anthropic::request_headers(self.api_key.as_deref().unwrap_or("")),
            ),
            ProviderKind::OpenAi => (
                openai::request_body(req),
                openai::request_headers(self.api_key.as_deref()),
            ),
        };
        let mut headers: Vec<(&str, String)> = headers
            .into_iter()
            .filter(|(name, value)| !(name.eq_ignore_ascii_case("x-api-key") && value.is_empty()))
            .collect();
        headers.push((
            "user-agent",
            format!("caliban/{}", env!("CARGO_PKG_VERSION")),
        ));
        let borrowed: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        write::request(
            "POST",
            &self.path,
            &self.target.host_header(),
            &borrowed,
            &body,
        )
    }

    pub fn decoder(&self) -> StreamDecoder {
        match self.kind {
            ProviderKind::Anthropic => StreamDecoder::Anthropic(Default::default()),
            ProviderKind::OpenAi => StreamDecoder::OpenAi(Default::default()),
        }
    }

    pub fn parse_error_body(&self, status: u16, body: &[u8]) -> retry::ProviderError {
        match self.kind {
            ProviderKind::Anthropic => anthropic::parse_error_body(status, body),
            ProviderKind::OpenAi => openai::parse_error_body(status, body),
        }
    }
}

pub enum StreamDecoder {
    Anthropic(anthropic::StreamDecoder),
    OpenAi(openai::StreamDecoder),
}

impl StreamDecoder {
    pub fn on_event(&mut self, ev: &SseEvent, out: &mut Vec<ModelEvent>) -> Result<(), String> {
        match self {
            StreamDecoder::Anthropic(d) => d.on_event(ev, out).map_err(|e| e.to_string()),
            StreamDecoder::OpenAi(d) => d.on_event(ev, out).map_err(|e| e.to_string()),
        }
    }

    pub fn is_done(&self) -> bool {
        match self {
            StreamDecoder::Anthropic(d) => d.is_done(),
            StreamDecoder::OpenAi(d) => d.is_done(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_stream_content_types() {
        for yes in [
            None,
            Some("text/event-stream"),
            Some("Text/Event-Stream; charset=utf-8"),
            Some(" text/event-stream "),
        ] {
            assert!(is_event_stream(yes), "{yes:?}");
        }
        for no in [
            Some("text/html"),
            Some("application/json"),
            Some(""),
            Some("text/event-streams"),
        ] {
            assert!(!is_event_stream(no), "{no:?}");
        }
    }

    #[test]
    fn a_reply_that_is_not_a_stream_is_quoted() {
        let message = not_an_event_stream(200, "text/html", b"<html>\n  <p>Hi</p>\n</html>");
        assert!(message.contains("200"), "{message}");
        assert!(message.contains("`text/html`"), "{message}");
        assert!(
            message.ends_with("It sent: <html> <p>Hi</p> </html>"),
            "{message}"
        );
        let long = "é".repeat(MAX_NOT_A_STREAM_QUOTE * 2);
        let message = not_an_event_stream(200, "text/plain", long.as_bytes());
        assert!(message.ends_with('…'), "{message}");
        let message = not_an_event_stream(204, "application/json", b"");
        assert!(!message.contains("It sent"), "{message}");
    }
}
