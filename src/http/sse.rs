//! Server-sent events: a push decoder implementing the WHATWG "interpreting an event stream"
//! rules over raw bytes, and the matching encoder for our own streams. Input may be split
//! anywhere (inside a UTF-8 character, a CRLF, a field name), so the decoder keeps a byte
//! buffer and decodes each complete line. It must not know about HTTP framing (feed it
//! de-chunked body bytes), sockets, or what any event's data means to a model provider.

use std::fmt;

/// Longest line we buffer; model streams put a whole JSON event on one `data:` line, and
/// a broken proxy that never sends a line end must not grow memory without bound.
pub const MAX_SSE_LINE: usize = 1024 * 1024;

/// Most `data` bytes in one event; lines are capped separately, but a peer can send many
/// `data:` lines and never the blank line that dispatches them.
pub const MAX_SSE_EVENT: usize = 8 * 1024 * 1024;

/// One dispatched event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SseEvent {
    /// The `event:` field, or `"message"` when the event had none.
    pub event: String,
    /// The `data:` lines joined with `\n`.
    pub data: String,
    /// The last event ID at dispatch time. Like `EventSource.lastEventId` it carries over to
    /// later events until another `id:` changes it; an empty `id:` clears it.
    pub id: Option<String>,
}

/// Why a stream was abandoned. The decoder keeps returning the same error afterwards.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SseError {
    LineTooLong,
    EventTooLarge,
}

impl fmt::Display for SseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SseError::LineTooLong => {
                write!(f, "event stream line longer than {MAX_SSE_LINE} bytes")
            }
            SseError::EventTooLarge => {
                write!(
                    f,
                    "event stream event data larger than {MAX_SSE_EVENT} bytes"
                )
            }
        }
    }
}

impl std::error::Error for SseError {}

const BOM: &[u8] = "\u{feff}".as_bytes();

/// Incremental event-stream decoder; feed it body bytes as they arrive.
#[derive(Debug, Default)]
pub struct SseDecoder {
    /// Bytes of the current line, without its terminator.
    line: Vec<u8>,
    /// The previous byte was a CR that ended a line, so an LF now is the rest of that CRLF.
    after_cr: bool,
    /// Whether the stream start has been checked for the one BOM we strip.
    bom_done: bool,
    /// How many bytes of a BOM prefix were seen and held back at the stream start.
    bom_held: usize,
    data: String,
    event_type: String,
    last_event_id: String,
    /// Parsed as the SSE spec says and tested, but nothing here reconnects on its own yet
    /// (the model stream is retried by `model::retry`).
    #[cfg_attr(not(test), allow(dead_code))]
    retry_ms: Option<u64>,
    failed: Option<SseError>,
}

impl SseDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Decodes `bytes`, appending each dispatched event to `out`. An event is dispatched at
    /// its blank line; anything after the last blank line is kept for the next call, and the
    /// spec discards it at end of stream.
    pub fn feed(&mut self, bytes: &[u8], out: &mut Vec<SseEvent>) -> Result<(), SseError> {
        if let Some(err) = &self.failed {
            return Err(err.clone());
        }
        let res = self.feed_inner(bytes, out);
        if let Err(err) = &res {
            self.failed = Some(err.clone());
        }
        res
    }

    /// The current last event ID, `None` when never set or cleared by an empty `id:`.
    pub fn last_event_id(&self) -> Option<&str> {
        Some(self.last_event_id.as_str()).filter(|id| !id.is_empty())
    }

    /// The reconnection time from the last valid `retry:` field.
    pub fn retry_ms(&self) -> Option<u64> {
        self.retry_ms
    }

    fn feed_inner(&mut self, bytes: &[u8], out: &mut Vec<SseEvent>) -> Result<(), SseError> {
        let mut rest = self.strip_bom(bytes);
        while !rest.is_empty() {
            if std::mem::take(&mut self.after_cr)
                && let [b'\n', tail @ ..] = rest
            {
                rest = tail;
                continue;
            }
            let Some(at) = rest.iter().position(|&b| b == b'\n' || b == b'\r') else {
                self.push_line_bytes(rest)?;
                break;
            };
            let (text, tail) = rest.split_at_checked(at).unwrap_or((rest, &[]));
            let Some((&terminator, tail)) = tail.split_first() else {
                self.push_line_bytes(text)?;
                break;
            };
            // A lone CR ends a line by itself, so the line is processed now; if an LF turns
            // out to follow (maybe in the next feed) it is skipped as the second half.
            self.after_cr = terminator == b'\r';
            rest = tail;
            if self.line.is_empty() {
                // The whole line is in this read: no copy.
                if text.len() > MAX_SSE_LINE {
                    return Err(SseError::LineTooLong);
                }
                self.process_line(text, out)?;
                continue;
            }
            self.push_line_bytes(text)?;
            let line = std::mem::take(&mut self.line);
            let res = self.process_line(&line, out);
            self.line = line;
            self.line.clear();
            res?;
        }
        Ok(())
    }

    /// Strips one leading BOM, which may itself arrive split across feeds.
    fn strip_bom<'a>(&mut self, mut bytes: &'a [u8]) -> &'a [u8] {
        while !self.bom_done {
            let Some((&byte, tail)) = bytes.split_first() else {
                break;
            };
            if BOM.get(self.bom_held) == Some(&byte) {
                bytes = tail;
                self.bom_held = self.bom_held.saturating_add(1);
                self.bom_done = self.bom_held == BOM.len();
            } else {
                // Not a BOM after all: the held bytes start the first line. They hold no
                // line ends, and two bytes cannot matter to the line cap.
                self.line
                    .extend_from_slice(BOM.get(..self.bom_held).unwrap_or_default());
                self.bom_done = true;
            }
        }
        bytes
    }

    fn push_line_bytes(&mut self, bytes: &[u8]) -> Result<(), SseError> {
        if self.line.len().saturating_add(bytes.len()) > MAX_SSE_LINE {
            return Err(SseError::LineTooLong);
        }
        self.line.extend_from_slice(bytes);
        Ok(())
    }

    fn process_line(&mut self, line: &[u8], out: &mut Vec<SseEvent>) -> Result<(), SseError> {
        if line.is_empty() {
            self.dispatch(out);
            return Ok(());
        }
        // Line ends are ASCII and never inside a UTF-8 sequence, so decoding line by line
        // gives what decoding the whole stream would.
        let text = crate::text::lossy(line);
        if text.starts_with(':') {
            // A comment: keep-alives from llama.cpp and proxies.
            return Ok(());
        }
        let (field, value) = match text.split_once(':') {
            Some((field, value)) => (field, value.strip_prefix(' ').unwrap_or(value)),
            None => (&*text, ""),
        };
        match field {
            "event" => value.clone_into(&mut self.event_type),
            "data" => {
                let new_len = self
                    .data
                    .len()
                    .saturating_add(value.len())
                    .saturating_add(1);
                if new_len > MAX_SSE_EVENT {
                    return Err(SseError::EventTooLarge);
                }
                self.data.push_str(value);
                self.data.push('\n');
            }
            "id" if !value.contains('\0') => value.clone_into(&mut self.last_event_id),
            "retry" if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) => {
                // Too many digits for u64 is no reconnection time anyone meant; ignore it
                // like any other invalid value.
                if let Ok(ms) = value.parse() {
                    self.retry_ms = Some(ms);
                }
            }
            _ => {}
        }
        Ok(())
    }

    fn dispatch(&mut self, out: &mut Vec<SseEvent>) {
        let event_type = std::mem::take(&mut self.event_type);
        if self.data.is_empty() {
            return;
        }
        let mut data = std::mem::take(&mut self.data);
        if data.ends_with('\n') {
            data.pop();
        }
        let event = if event_type.is_empty() {
            "message".to_owned()
        } else {
            event_type
        };
        out.push(SseEvent {
            event,
            data,
            id: self.last_event_id().map(str::to_owned),
        });
    }
}

/// Encodes one event for our own streams: `event:` and `id:` when given, one `data:` line
/// per line of `data` (split at CRLF, LF or CR, the decoder's line ends), then the blank
/// line that dispatches it. CR and LF are dropped from `event` and `id`, where they would
/// end the field early and inject lines.
pub fn encode_event(event: Option<&str>, data: &str, id: Option<&str>) -> String {
    let mut out = String::with_capacity(data.len().saturating_add(32));
    if let Some(event) = event {
        push_field(&mut out, "event", event);
    }
    if let Some(id) = id {
        push_field(&mut out, "id", id);
    }
    let mut rest = data;
    loop {
        let Some(at) = rest.find(['\r', '\n']) else {
            push_data_line(&mut out, rest);
            break;
        };
        let (line, tail) = rest.split_at_checked(at).unwrap_or((rest, ""));
        push_data_line(&mut out, line);
        rest = tail
            .strip_prefix("\r\n")
            .or_else(|| tail.strip_prefix(['\r', '\n']))
            .unwrap_or("");
    }
    out.push('\n');
    out
}

/// Encodes a comment, which clients ignore but which keeps idle timers and proxies from
/// closing a quiet stream. Each line of `text` becomes its own comment line.
#[cfg(test)]
pub fn encode_comment(text: &str) -> String {
    let mut out = String::with_capacity(text.len().saturating_add(4));
    for line in text.split(['\r', '\n']) {
        out.push(':');
        if !line.is_empty() {
            out.push(' ');
            out.push_str(line);
        }
        out.push('\n');
    }
    out.push('\n');
    out
}

fn push_field(out: &mut String, name: &str, value: &str) {
    out.push_str(name);
    out.push_str(": ");
    out.extend(value.chars().filter(|c| !matches!(c, '\r' | '\n')));
    out.push('\n');
}

fn push_data_line(out: &mut String, line: &str) {
    // `data:` alone for an empty line avoids trailing spaces; the decoder strips one space
    // after the colon, so a line that starts with a space still round-trips.
    out.push_str("data:");
    if !line.is_empty() {
        out.push(' ');
        out.push_str(line);
    }
    out.push('\n');
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::testutil::{deliveries, noise};

    type Outcome = (
        Vec<SseEvent>,
        Result<(), SseError>,
        Option<String>,
        Option<u64>,
    );

    fn run(pieces: &[&[u8]]) -> Outcome {
        let mut decoder = SseDecoder::new();
        let mut events = Vec::new();
        let mut res = Ok(());
        for piece in pieces {
            res = decoder.feed(piece, &mut events);
            if res.is_err() {
                break;
            }
        }
        let id = decoder.last_event_id().map(str::to_owned);
        (events, res, id, decoder.retry_ms())
    }

    /// Asserts every delivery of `stream` gives the same events and state, and returns it.
    fn decode_split(stream: &[u8]) -> Outcome {
        let whole = run(&[stream]);
        for pieces in deliveries(stream) {
            assert_eq!(
                run(&pieces),
                whole,
                "split delivery of {:?}",
                String::from_utf8_lossy(stream)
            );
        }
        whole
    }

    fn events(stream: &[u8]) -> Vec<SseEvent> {
        let (events, res, _, _) = decode_split(stream);
        assert_eq!(res, Ok(()));
        events
    }

    fn ev(event: &str, data: &str, id: Option<&str>) -> SseEvent {
        SseEvent {
            event: event.into(),
            data: data.into(),
            id: id.map(Into::into),
        }
    }

    fn message(data: &str) -> SseEvent {
        ev("message", data, None)
    }

    /// WebKit's LayoutTests/http/tests/eventsource/resources/event-stream.php, with its
    /// `da` / `ta:` flush split kept as a separate feed and its CR-only line end feeding a
    /// CR-only blank line.
    const WEBKIT: &[&[u8]] = &[
        b"\n\
          : a comment (ignored)\n\
          this line will be ignored since there is no field and the line itself is not a field\n\
          field: an unknown field that will be ignored\n\
          :another commment\n\
          \n\
          data : this line will be ignored since there is a space after data\n\
          \n\
          data\n\
          data:\n\
          data\n\
          : dispatch event with two newlines\n\
          \n\
          data: simple\n\
          \n\
          data: spanning\n\
          data:multiple\n\
          data\n\
          data: lines\n\
          data\n\
          \n\
          id: 1\n\
          data: id is 1\n\
          \n\
          data: id is still 1\n\
          \n\
          id\n\
          data: no id\n\
          \n\
          event: open\n\
          data: a message event with the name \"open\"\n\
          \n\
          da",
        b"ta: a message event with the name \"message\"\n\
          \n\
          data: a line ending with crlf\r\n\
          data: a line with a : (colon)\n\
          data: a line ending with cr\r\
          \r\
          retry: 10000\n\
          : reconnection time set to 10 seconds\n\
          \n\
          retry: one thousand\n\
          : ignored invalid reconnection time value\n\
          \n\
          retry\n\
          : reset to ua default\n\
          \n",
    ];

    fn webkit_expected() -> Vec<SseEvent> {
        vec![
            message("\n\n"),
            message("simple"),
            message("spanning\nmultiple\n\nlines\n"),
            ev("message", "id is 1", Some("1")),
            ev("message", "id is still 1", Some("1")),
            message("no id"),
            ev("open", "a message event with the name \"open\"", None),
            message("a message event with the name \"message\""),
            message("a line ending with crlf\na line with a : (colon)\na line ending with cr"),
        ]
    }

    #[test]
    fn webkit_vector_in_its_own_flushes() {
        let (got, res, id, retry) = run(WEBKIT);
        assert_eq!(res, Ok(()));
        assert_eq!(got, webkit_expected());
        assert_eq!(id, None);
        // `retry: one thousand` is ignored and so is the empty `retry`, which older drafts
        // read as "reset to the default"; only digits count.
        assert_eq!(retry, Some(10000));
    }

    #[test]
    fn webkit_vector_at_every_split() {
        let stream = WEBKIT.concat();
        let (got, res, _, retry) = decode_split(&stream);
        assert_eq!(res, Ok(()));
        assert_eq!(got, webkit_expected());
        assert_eq!(retry, Some(10000));
    }

    #[test]
    fn anthropic_shaped_stream() {
        let stream = b"event: message_start\r\ndata: {\"type\":\"message_start\"}\r\n\r\n\
                       event: ping\r\ndata: {\"type\": \"ping\"}\r\n\r\n\
                       event: content_block_delta\r\ndata: {\"text\":\"h\xc3\xa9\"}\r\n\r\n";
        assert_eq!(
            events(stream),
            vec![
                ev("message_start", "{\"type\":\"message_start\"}", None),
                ev("ping", "{\"type\": \"ping\"}", None),
                ev("content_block_delta", "{\"text\":\"h\u{e9}\"}", None),
            ]
        );
    }

    #[test]
    fn llama_keepalive_comments() {
        let stream = b":\n\ndata: {\"choices\":[]}\n\n:\n\ndata: [DONE]\n\n";
        assert_eq!(
            events(stream),
            vec![message("{\"choices\":[]}"), message("[DONE]")]
        );
    }

    #[test]
    fn value_space_rules() {
        let stream = b"data:x\n\ndata: x\n\ndata:  x\n\ndata:\n\ndata: \n\ndata:a:b\n\n";
        let want = ["x", "x", " x", "", "", "a:b"].map(message);
        assert_eq!(events(stream), want);
    }

    #[test]
    fn event_type_resets_after_dispatch_and_after_empty_data() {
        let stream = b"event: a\n\ndata: 1\n\nevent: b\ndata: 2\n\ndata: 3\n\nevent:\ndata: 4\n\n";
        let want = vec![message("1"), ev("b", "2", None), message("3"), message("4")];
        assert_eq!(events(stream), want);
    }

    #[test]
    fn id_rules() {
        let stream = b"id: 7\n\ndata: a\n\nid: x\0y\ndata: b\n\nid:\ndata: c\n\nid: 9\n";
        let (got, res, id, _) = decode_split(stream);
        assert_eq!(res, Ok(()));
        // An id alone updates the last event ID without dispatching anything.
        assert_eq!(
            got,
            vec![
                ev("message", "a", Some("7")),
                ev("message", "b", Some("7")),
                message("c")
            ]
        );
        assert_eq!(id.as_deref(), Some("9"));
    }

    #[test]
    fn retry_rules() {
        let retry = |stream: &[u8]| decode_split(stream).3;
        assert_eq!(retry(b"retry: 1500\n"), Some(1500));
        assert_eq!(retry(b"retry:0\n"), Some(0));
        assert_eq!(retry(b"retry: 15x\n"), None);
        assert_eq!(retry(b"retry: -1\n"), None);
        assert_eq!(retry(b"retry:  15\n"), None);
        assert_eq!(retry(b"retry: 99999999999999999999999\n"), None);
        assert_eq!(retry(b"retry: 5\nretry: x\n"), Some(5));
    }

    #[test]
    fn line_endings_mixed() {
        let stream = b"data: a\rdata: b\r\ndata: c\n\r\n\rdata: d\r\r";
        assert_eq!(events(stream), vec![message("a\nb\nc"), message("d")]);
    }

    #[test]
    fn cr_held_across_feeds_is_not_a_second_line_end() {
        let mut decoder = SseDecoder::new();
        let mut out = Vec::new();
        decoder.feed(b"data: a\r", &mut out).unwrap();
        decoder.feed(b"\ndata: b\r", &mut out).unwrap();
        assert!(out.is_empty());
        decoder.feed(b"\n\r", &mut out).unwrap();
        assert_eq!(out, vec![message("a\nb")]);
        decoder.feed(b"\n", &mut out).unwrap();
        assert_eq!(out.len(), 1);
    }

    #[test]
    fn bom_is_stripped_once() {
        assert_eq!(events(b"\xef\xbb\xbfdata: a\n\n"), vec![message("a")]);
        assert_eq!(events(b"\xef\xbb\xbf\xef\xbb\xbfdata: a\n\n"), vec![]);
        assert_eq!(
            events(b"\xef\xbb\xbf\xef\xbb\xbfdata: a\n\ndata: b\n\n"),
            vec![message("b")]
        );
        // A partial BOM is ordinary (invalid) text of the first line.
        assert_eq!(
            events(b"\xef\xbbdata: a\n\ndata: b\n\n"),
            vec![message("b")]
        );
        assert_eq!(events(b"\xef\xbb\ndata: b\n\n"), vec![message("b")]);
        assert_eq!(events(b"\xefdata: a\n\n"), vec![]);
    }

    #[test]
    fn invalid_utf8_is_replaced() {
        assert_eq!(
            events(b"data: \xff\xe2\x82\n\n"),
            vec![message("\u{fffd}\u{fffd}")]
        );
        assert_eq!(events(b"data: \xe2\x82\xac\n\n"), vec![message("\u{20ac}")]);
    }

    #[test]
    fn unterminated_event_is_not_dispatched() {
        let (got, _, _, _) = decode_split(b"data: a\n\ndata: b\n");
        assert_eq!(got, vec![message("a")]);
    }

    #[test]
    fn line_cap() {
        let mut line = b"data: ".to_vec();
        line.resize(MAX_SSE_LINE, b'x');
        let mut decoder = SseDecoder::new();
        let mut out = Vec::new();
        decoder.feed(&line, &mut out).unwrap();
        decoder.feed(b"\n\n", &mut out).unwrap();
        assert_eq!(out.len(), 1);

        let mut decoder = SseDecoder::new();
        decoder.feed(&line, &mut out).unwrap();
        assert_eq!(decoder.feed(b"x", &mut out), Err(SseError::LineTooLong));
        // The error sticks, so a caller cannot resume mid-line with garbage state.
        assert_eq!(decoder.feed(b"\n\n", &mut out), Err(SseError::LineTooLong));
    }

    #[test]
    fn event_cap() {
        let line = format!("data: {}\n", "x".repeat(MAX_SSE_LINE - 7));
        let mut decoder = SseDecoder::new();
        let mut out = Vec::new();
        let mut res = Ok(());
        let mut n_lines = 0;
        while res.is_ok() {
            res = decoder.feed(line.as_bytes(), &mut out);
            n_lines += 1;
        }
        assert_eq!(res, Err(SseError::EventTooLarge));
        assert_eq!(n_lines, MAX_SSE_EVENT / (MAX_SSE_LINE - 6) + 1);
        assert!(out.is_empty());
    }

    #[test]
    fn encode_single_line() {
        let wire = encode_event(Some("message_stop"), "{\"type\":\"message_stop\"}", None);
        assert_eq!(
            wire,
            "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"
        );
        assert_eq!(encode_event(None, "x", Some("4")), "id: 4\ndata: x\n\n");
        assert_eq!(encode_event(None, "", None), "data:\n\n");
    }

    #[test]
    fn encode_multi_line_and_injection() {
        let wire = encode_event(Some("a\r\nb"), "one\ntwo\r\nthree\rfour\n", Some("i\nd"));
        assert_eq!(
            wire,
            "event: ab\nid: id\ndata: one\ndata: two\ndata: three\ndata: four\ndata:\n\n"
        );
        assert_eq!(encode_comment(""), ":\n\n");
        assert_eq!(encode_comment("ping\nx"), ": ping\n: x\n\n");
    }

    #[test]
    fn encode_round_trips_through_the_decoder() {
        let cases = [
            (Some("delta"), "plain", Some("1")),
            (None, "", None),
            (None, "\n", None),
            (None, " leading space\n\ntrailing newline\n", None),
            (Some("x"), "a\r\nb\rc", None),
            (None, ": not a comment\ndata: not a field", Some("2")),
        ];
        for (event, data, id) in cases {
            let mut wire = encode_comment("keep-alive").into_bytes();
            wire.extend_from_slice(encode_event(event, data, id).as_bytes());
            let want = ev(
                event.unwrap_or("message"),
                &data.replace("\r\n", "\n").replace('\r', "\n"),
                id,
            );
            assert_eq!(events(&wire), vec![want]);
        }
    }

    #[test]
    fn never_panics_on_noise() {
        let alphabet = b"data:eventidretry 019\r\n\xef\xbb\xbf\0";
        for seed in 0..2000u64 {
            let msg = noise(seed, alphabet, 120);
            let _ = run(&msg.chunks(1 + seed as usize % 7).collect::<Vec<_>>());
        }
    }

    #[test]
    fn display_is_lowercase_without_period() {
        for err in [SseError::LineTooLong, SseError::EventTooLarge] {
            let text = err.to_string();
            assert!(text.starts_with(|c: char| c.is_ascii_lowercase()), "{text}");
            assert!(!text.ends_with('.'), "{text}");
        }
    }
}
