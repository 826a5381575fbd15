//! Retry policy for model requests, as data: which failures are worth another attempt and
//! how long to wait first.
//!
//! Pure functions only. The caller reads the status, headers and error body, supplies the
//! jitter (so tests are deterministic and this module needs no RNG), and arms its own timer.
//! The rules follow the Stainless-generated SDKs that Anthropic and OpenAI both ship
//! (`reference/models.md` §1.5, §2.2): retry connection failures, 408, 409, 429 and 5xx, let
//! `x-should-retry` override the table, and prefer the server's `retry-after` hint over our
//! exponential backoff when the hint is sane.

use std::fmt;
use std::time::Duration;

/// A non-2xx response from a provider, reduced to what we show and branch on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProviderError {
    pub status: u16,
    /// The provider's error type (`overloaded_error`, `insufficient_quota`, …); empty when the
    /// body was not a JSON error envelope.
    pub kind: String,
    pub message: String,
}

impl fmt::Display for ProviderError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.kind.is_empty() {
            write!(f, "http {}: {}", self.status, self.message)
        } else {
            write!(f, "{} (http {}): {}", self.kind, self.status, self.message)
        }
    }
}

impl std::error::Error for ProviderError {}

impl ProviderError {
    /// The request did not fit the model's context window (Anthropic's "prompt is too
    /// long", OpenAI's `context_length_exceeded`, llama.cpp's and vLLM's wordings): the run
    /// may compact and send it again (`Run::on_context_overflow`).
    pub fn is_context_overflow(&self) -> bool {
        if self.status != 400 && self.status != 413 {
            return false;
        }
        let message = self.message.to_ascii_lowercase();
        self.kind == "context_length_exceeded"
            || [
                "prompt is too long",
                "context window",
                "context length",
                "maximum context length",
                "context_length_exceeded",
                "exceeds the available context size",
            ]
            .iter()
            .any(|needle| message.contains(needle))
    }
}

impl ProviderError {
    /// The server takes no images (a text-only model behind an OpenAI-compatible server:
    /// llama.cpp's "image input is not supported", OpenAI's "image_url is only supported by
    /// certain models", vLLM's "not a multimodal model"): the run may send its conversation
    /// again with the pictures left out (`Run::drop_images`). Some servers say it with a 500.
    pub fn is_image_refusal(&self) -> bool {
        if !matches!(self.status, 400 | 415 | 422 | 500) {
            return false;
        }
        let message = self.message.to_ascii_lowercase();
        let names_images = ["image", "multimodal", "vision"]
            .iter()
            .any(|needle| message.contains(needle));
        let refuses = [
            "not supported",
            "unsupported",
            "only supported",
            "does not support",
            "not a multimodal",
        ]
        .iter()
        .any(|needle| message.contains(needle));
        names_images && refuses
    }
}

/// Largest slice of a non-JSON error body we keep. Proxies answer with whole HTML pages, and
/// the message ends up in a terminal line and in session logs.
pub const MAX_RAW_ERROR_BODY: usize = 2048;

/// The fallback message for an error body that is not a JSON error envelope: the body as
/// (lossy) UTF-8, trimmed, cut after [`MAX_RAW_ERROR_BODY`] bytes.
pub fn raw_error_message(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let text = text.trim();
    if text.is_empty() {
        return "empty response body".to_owned();
    }
    snippet(text, MAX_RAW_ERROR_BODY)
}

/// `text` cut at a character boundary at most `max` bytes in, with `…` marking a cut. Shared
/// by the codecs so an error quoting wire data stays one readable line.
pub(crate) fn snippet(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    format!("{}…", &text[..text.floor_char_boundary(max)])
}

/// How persistent to be. `max_retries` counts retries, not attempts: 4 means up to 5 requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    pub max_retries: u32,
    /// Delay before the first retry; doubled for each later one.
    pub base: Duration,
    /// Ceiling of the exponential backoff (before jitter).
    pub max_delay: Duration,
}

impl Default for RetryPolicy {
    /// The SDKs' delays (0.5 s doubling to 8 s) with two more retries than their default of 2,
    /// because an agent turn is expensive to lose and overloads usually clear within seconds.
    fn default() -> RetryPolicy {
        RetryPolicy {
            max_retries: 4,
            base: Duration::from_millis(500),
            max_delay: Duration::from_secs(8),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RetryDecision {
    Retry(Duration),
    GiveUp,
}

/// Longest server-supplied delay we honour. Anything longer (or zero, or unparseable) falls
/// back to our own backoff, as the SDKs do: a multi-minute wait is better surfaced to the user
/// than spent silently.
const MAX_SERVER_DELAY: Duration = Duration::from_secs(60);

/// Decides what to do after a non-2xx response.
///
/// `attempt` is the number of retries already made (0 after the first failure). `header`
/// looks up a response header by its lowercase name; the caller makes the lookup
/// case-insensitive. `kind` is [`ProviderError::kind`] when the body had one. `jitter` is a
/// caller-supplied random number in `0..1`; values outside are clamped.
pub fn decide_status(
    policy: &RetryPolicy,
    attempt: u32,
    status: u16,
    header: &dyn Fn(&str) -> Option<String>,
    kind: Option<&str>,
    jitter: f64,
) -> RetryDecision {
    if attempt >= policy.max_retries {
        return RetryDecision::GiveUp;
    }
    // An exhausted quota or billing cap does not clear in seconds, whatever the status or
    // headers say; retrying only delays the message the user needs to see.
    if matches!(kind, Some("insufficient_quota" | "billing_error")) {
        return RetryDecision::GiveUp;
    }
    let should_retry = match header("x-should-retry").as_deref().map(str::trim) {
        // The server knows its own state better than our status table.
        Some("true") => true,
        Some("false") => false,
        _ => is_retryable_status(status) || kind == Some("overloaded_error"),
    };
    if !should_retry {
        return RetryDecision::GiveUp;
    }
    let delay = server_delay(header).unwrap_or_else(|| backoff(policy, attempt, jitter));
    RetryDecision::Retry(delay)
}

/// Decides what to do after a failure with no HTTP response: connect refused or timed out,
/// TLS failure, or EOF before the first response byte (a stale pooled connection, which
/// local servers produce routinely). The request never reached a model, so resending it is
/// safe even though it is a POST.
pub fn decide_transport(policy: &RetryPolicy, attempt: u32, jitter: f64) -> RetryDecision {
    if attempt >= policy.max_retries {
        RetryDecision::GiveUp
    } else {
        RetryDecision::Retry(backoff(policy, attempt, jitter))
    }
}

/// `min(base · 2^attempt, max_delay) · (1 − 0.25 · jitter)`. The jitter only ever shortens
/// the delay, so `max_delay` stays a true ceiling, and it spreads out clients that failed
/// together (the usual case for an overload).
pub fn backoff(policy: &RetryPolicy, attempt: u32, jitter: f64) -> Duration {
    let exp = 1u32.checked_shl(attempt).unwrap_or(u32::MAX);
    let raw = policy
        .base
        .checked_mul(exp)
        .unwrap_or(policy.max_delay)
        .min(policy.max_delay);
    let jitter = if jitter.is_nan() {
        0.0
    } else {
        jitter.clamp(0.0, 1.0)
    };
    // `try_from` instead of `mul_f64`, which panics when the product rounds past
    // `Duration::MAX`; that can only happen for an absurd policy, where the raw value is fine.
    Duration::try_from_secs_f64(raw.as_secs_f64() * (1.0 - 0.25 * jitter)).unwrap_or(raw)
}

/// Like [`category`], but the error kind wins over the status, because overloads and rate
/// limits are sometimes reported with another status (Anthropic has sent `overloaded_error`
/// with 429).
pub fn category_for(status: u16, kind: Option<&str>) -> &'static str {
    match kind {
        Some("overloaded_error") => return "overloaded",
        Some("rate_limit_error" | "rate_limit_exceeded") => return "rate_limit",
        Some("timeout_error") => return "timeout",
        _ => {}
    }
    match status {
        529 => "overloaded",
        429 => "rate_limit",
        408 | 504 => "timeout",
        500..=599 => "server_error",
        _ => "other",
    }
}

/// The `error_category` for failures without an HTTP response ([`decide_transport`]).
pub const CATEGORY_NETWORK: &str = "network";

fn is_retryable_status(status: u16) -> bool {
    // 409 is a lock conflict on the provider side; 413 and the other 4xx would fail the same
    // way again.
    matches!(status, 408 | 409 | 429 | 500..=599)
}

/// The delay the server asked for, if it is within `0 < delay <= 60 s`.
///
/// `retry-after` may also be an HTTP-date; we do not parse that form. Anthropic and OpenAI
/// send seconds, and converting a date needs the wall clock, which this module does not read.
/// A date therefore falls back to our backoff.
fn server_delay(header: &dyn Fn(&str) -> Option<String>) -> Option<Duration> {
    let from_ms = header("retry-after-ms")
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map(|ms| ms / 1000.0);
    let secs =
        from_ms.or_else(|| header("retry-after").and_then(|v| v.trim().parse::<f64>().ok()))?;
    if !secs.is_finite() || secs <= 0.0 {
        return None;
    }
    let delay = Duration::try_from_secs_f64(secs).ok()?;
    (delay <= MAX_SERVER_DELAY).then_some(delay)
}

#[cfg(test)]
mod tests {

    #[test]
    fn image_refusals_are_recognised_by_wording() {
        let err = |status, message: &str| ProviderError {
            status,
            kind: String::new(),
            message: message.into(),
        };
        for (status, message) in [
            (
                500,
                "image input is not supported - hint: if this is unexpected, you may need to provide the mmproj",
            ),
            (
                400,
                "Invalid content type. image_url is only supported by certain models.",
            ),
            (400, "Qwen2ForCausalLM is not a multimodal model"),
        ] {
            assert!(err(status, message).is_image_refusal(), "{message}");
        }
        assert!(!err(500, "internal error").is_image_refusal());
        assert!(!err(429, "image input is not supported").is_image_refusal());
        assert!(!err(400, "prompt is too long").is_image_refusal());
    }

    #[test]
    fn context_overflow_is_recognised_by_status_and_wording() {
        let err = |status: u16, kind: &str, message: &str| ProviderError {
            status,
            kind: kind.into(),
            message: message.into(),
        };
        assert!(
            err(
                400,
                "invalid_request_error",
                "prompt is too long: 201000 tokens > 200000 maximum"
            )
            .is_context_overflow()
        );
        assert!(err(400, "context_length_exceeded", "whatever").is_context_overflow());
        assert!(
            err(
                400,
                "",
                "the request exceeds the available context size, try increasing it"
            )
            .is_context_overflow()
        );
        assert!(
            !err(400, "invalid_request_error", "max_tokens: must be positive")
                .is_context_overflow()
        );
        assert!(!err(500, "api_error", "prompt is too long").is_context_overflow());
    }

    use super::*;

    fn no_headers(_: &str) -> Option<String> {
        None
    }

    fn headers(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |name| {
            pairs
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| (*v).to_owned())
        }
    }

    fn decide(status: u16, kind: Option<&str>) -> RetryDecision {
        decide_status(&RetryPolicy::default(), 0, status, &no_headers, kind, 0.0)
    }

    #[test]
    fn retryable_statuses() {
        for status in [408, 409, 429, 500, 502, 503, 504, 529] {
            assert_eq!(
                decide(status, None),
                RetryDecision::Retry(Duration::from_millis(500)),
                "status {status}"
            );
        }
    }

    #[test]
    fn client_errors_give_up() {
        for status in [400, 401, 402, 403, 404, 413, 422] {
            assert_eq!(
                decide(status, None),
                RetryDecision::GiveUp,
                "status {status}"
            );
        }
    }

    #[test]
    fn overloaded_kind_retries_whatever_the_status() {
        assert!(matches!(
            decide(400, Some("overloaded_error")),
            RetryDecision::Retry(_)
        ));
    }

    #[test]
    fn insufficient_quota_gives_up_even_when_told_to_retry() {
        let h = headers(&[("x-should-retry", "true"), ("retry-after", "1")]);
        let d = decide_status(
            &RetryPolicy::default(),
            0,
            429,
            &h,
            Some("insufficient_quota"),
            0.0,
        );
        assert_eq!(d, RetryDecision::GiveUp);
    }

    #[test]
    fn should_retry_header_overrides_status() {
        let yes = headers(&[("x-should-retry", "true")]);
        let no = headers(&[("x-should-retry", "false")]);
        let p = RetryPolicy::default();
        assert!(matches!(
            decide_status(&p, 0, 400, &yes, None, 0.0),
            RetryDecision::Retry(_)
        ));
        assert_eq!(
            decide_status(&p, 0, 503, &no, None, 0.0),
            RetryDecision::GiveUp
        );
    }

    #[test]
    fn retry_after_headers() {
        let p = RetryPolicy::default();
        let secs = headers(&[("retry-after", "2")]);
        assert_eq!(
            decide_status(&p, 0, 429, &secs, None, 0.9),
            RetryDecision::Retry(Duration::from_secs(2))
        );
        let frac = headers(&[("retry-after", " 1.5 ")]);
        assert_eq!(
            decide_status(&p, 0, 429, &frac, None, 0.0),
            RetryDecision::Retry(Duration::from_millis(1500))
        );
        // retry-after-ms wins over retry-after.
        let ms = headers(&[("retry-after-ms", "250"), ("retry-after", "9")]);
        assert_eq!(
            decide_status(&p, 0, 429, &ms, None, 0.0),
            RetryDecision::Retry(Duration::from_millis(250))
        );
    }

    #[test]
    fn unusable_retry_after_falls_back_to_backoff() {
        let p = RetryPolicy::default();
        let backoff_2 = RetryDecision::Retry(Duration::from_secs(2));
        for value in [
            "0",
            "-1",
            "61",
            "NaN",
            "inf",
            "Wed, 21 Oct 2015 07:28:00 GMT",
            "",
        ] {
            let h = move |name: &str| (name == "retry-after").then(|| value.to_owned());
            assert_eq!(
                decide_status(&p, 2, 503, &h, None, 0.0),
                backoff_2,
                "{value:?}"
            );
        }
    }

    #[test]
    fn gives_up_after_max_retries() {
        let p = RetryPolicy::default();
        assert!(matches!(
            decide_status(&p, 3, 529, &no_headers, None, 0.0),
            RetryDecision::Retry(_)
        ));
        assert_eq!(
            decide_status(&p, 4, 529, &no_headers, None, 0.0),
            RetryDecision::GiveUp
        );
        assert_eq!(decide_transport(&p, 4, 0.0), RetryDecision::GiveUp);
    }

    #[test]
    fn backoff_doubles_caps_and_jitters_down() {
        let p = RetryPolicy::default();
        let ms = |attempt, jitter| backoff(&p, attempt, jitter).as_millis();
        assert_eq!(
            [ms(0, 0.0), ms(1, 0.0), ms(2, 0.0), ms(3, 0.0), ms(4, 0.0)],
            [500, 1000, 2000, 4000, 8000]
        );
        assert_eq!(ms(10, 0.0), 8000);
        assert_eq!(ms(u32::MAX, 0.0), 8000);
        assert_eq!(ms(4, 1.0), 6000);
        assert_eq!(ms(1, 0.5), 875);
        // Out-of-range jitter is clamped rather than trusted.
        assert_eq!(ms(1, 7.0), 750);
        assert_eq!(ms(1, -3.0), 1000);
        assert_eq!(ms(1, f64::NAN), 1000);
    }

    #[test]
    fn backoff_survives_an_absurd_policy() {
        let p = RetryPolicy {
            max_retries: u32::MAX,
            base: Duration::MAX,
            max_delay: Duration::MAX,
        };
        assert_eq!(backoff(&p, 0, 0.0), Duration::MAX);
        assert!(backoff(&p, 3, 0.5) > Duration::from_secs(1 << 40));
    }

    #[test]
    fn transport_uses_backoff() {
        assert_eq!(
            decide_transport(&RetryPolicy::default(), 2, 0.0),
            RetryDecision::Retry(Duration::from_secs(2))
        );
    }

    #[test]
    fn categories() {
        assert_eq!(category_for(529, None), "overloaded");
        assert_eq!(category_for(429, None), "rate_limit");
        assert_eq!(category_for(408, None), "timeout");
        assert_eq!(category_for(504, None), "timeout");
        assert_eq!(category_for(503, None), "server_error");
        assert_eq!(category_for(409, None), "other");
        assert_eq!(category_for(429, Some("overloaded_error")), "overloaded");
        assert_eq!(category_for(400, Some("rate_limit_exceeded")), "rate_limit");
        assert_eq!(category_for(500, Some("timeout_error")), "timeout");
        assert_eq!(category_for(500, Some("api_error")), "server_error");
        assert_eq!(category_for(502, Some("")), "server_error");
        assert_eq!(CATEGORY_NETWORK, "network");
    }

    #[test]
    fn provider_error_display() {
        let e = ProviderError {
            status: 529,
            kind: "overloaded_error".into(),
            message: "Overloaded".into(),
        };
        assert_eq!(e.to_string(), "overloaded_error (http 529): Overloaded");
        let e = ProviderError {
            status: 502,
            kind: String::new(),
            message: "bad gateway".into(),
        };
        assert_eq!(e.to_string(), "http 502: bad gateway");
    }

    #[test]
    fn raw_error_message_is_capped_on_a_char_boundary() {
        assert_eq!(raw_error_message(b"  \n"), "empty response body");
        assert_eq!(raw_error_message(b" <h1>502</h1>\n"), "<h1>502</h1>");
        let long = "é".repeat(MAX_RAW_ERROR_BODY);
        let msg = raw_error_message(long.as_bytes());
        assert!(msg.ends_with('…'));
        assert!(msg.len() <= MAX_RAW_ERROR_BODY + '…'.len_utf8());
        assert_eq!(raw_error_message(&[0xff, b'x']), "\u{fffd}x");
    }
}
