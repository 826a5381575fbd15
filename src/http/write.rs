//! HTTP/1.1 serialisation: request and response heads, chunks and the last chunk, as
//! bytes ready to queue on a transport. It owns the wire spelling (CRLF, Host and
//! Content-Length, reason phrases) and must not know about sockets, TLS, retries, or which
//! headers a model provider or surface wants. Fields never carry CR, LF or NUL out of
//! here, so no caller-supplied string can split a message in two.

/// The chunk that ends a chunked body, with no trailers.
pub const LAST_CHUNK: &[u8] = b"0\r\n\r\n";

/// Serialises a complete HTTP/1.1 request. `Host` comes from `host` (include the port when
/// it is not the scheme's default) and `Content-Length` from `body`, so those two names
/// are skipped in `headers` rather than sent twice. Content-Length is sent whenever there
/// is a body and also for empty POST, PUT and PATCH, where servers otherwise answer 411.
pub fn request(
    method: &str,
    target: &str,
    host: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Vec<u8> {
    let mut out = Vec::with_capacity(256usize.saturating_add(body.len()));
    push_token(&mut out, method);
    out.push(b' ');
    // A space in the target would end the request line early.
    out.extend(target.bytes().filter(|&b| !is_forbidden(b) && b != b' '));
    out.extend_from_slice(b" HTTP/1.1\r\n");
    push_header(&mut out, "Host", host);
    for &(name, value) in headers {
        if name.eq_ignore_ascii_case("host") || name.eq_ignore_ascii_case("content-length") {
            continue;
        }
        push_header(&mut out, name, value);
    }
    let needs_length = ["POST", "PUT", "PATCH"]
        .iter()
        .any(|m| m.eq_ignore_ascii_case(method));
    if !body.is_empty() || needs_length {
        push_header(&mut out, "Content-Length", &body.len().to_string());
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(body);
    out
}

/// Serialises a response status line and header fields, ending with the blank line. The
/// caller chooses the framing (Content-Length, or Transfer-Encoding: chunked for streams).
pub fn response_head(status: u16, headers: &[(&str, &str)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(128);
    out.extend_from_slice(format!("HTTP/1.1 {status} {}\r\n", reason_phrase(status)).as_bytes());
    for &(name, value) in headers {
        push_header(&mut out, name, value);
    }
    out.extend_from_slice(b"\r\n");
    out
}

/// One chunk of a chunked body. Empty data gives no bytes at all, because a zero-size
/// chunk is the terminator and must only be sent on purpose, as `LAST_CHUNK`.
pub fn chunk(data: &[u8]) -> Vec<u8> {
    if data.is_empty() {
        return Vec::new();
    }
    let mut out = Vec::with_capacity(data.len().saturating_add(20));
    out.extend_from_slice(format!("{:x}\r\n", data.len()).as_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n");
    out
}

/// The registered reason phrase for `status` (RFC 9110 §15, plus 429 and the 529 that
/// Anthropic sends when overloaded), or `"Unknown"`.
pub fn reason_phrase(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        101 => "Switching Protocols",
        102 => "Processing",
        103 => "Early Hints",
        200 => "OK",
        201 => "Created",
        202 => "Accepted",
        203 => "Non-Authoritative Information",
        204 => "No Content",
        205 => "Reset Content",
        206 => "Partial Content",
        207 => "Multi-Status",
        208 => "Already Reported",
        226 => "IM Used",
        300 => "Multiple Choices",
        301 => "Moved Permanently",
        302 => "Found",
        303 => "See Other",
        304 => "Not Modified",
        305 => "Use Proxy",
        307 => "Temporary Redirect",
        308 => "Permanent Redirect",
        400 => "Bad Request",
        401 => "Unauthorized",
        402 => "Payment Required",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        406 => "Not Acceptable",
        407 => "Proxy Authentication Required",
        408 => "Request Timeout",
        409 => "Conflict",
        410 => "Gone",
        411 => "Length Required",
        412 => "Precondition Failed",
        413 => "Content Too Large",
        414 => "URI Too Long",
        415 => "Unsupported Media Type",
        416 => "Range Not Satisfiable",
        417 => "Expectation Failed",
        421 => "Misdirected Request",
        422 => "Unprocessable Content",
        423 => "Locked",
        424 => "Failed Dependency",
        425 => "Too Early",
        426 => "Upgrade Required",
        428 => "Precondition Required",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        451 => "Unavailable For Legal Reasons",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        505 => "HTTP Version Not Supported",
        506 => "Variant Also Negotiates",
        507 => "Insufficient Storage",
        508 => "Loop Detected",
        510 => "Not Extended",
        511 => "Network Authentication Required",
        529 => "Overloaded",
        _ => "Unknown",
    }
}

/// CR, LF and NUL would end a line early or be read differently by different parsers.
/// An API key read from a file with its trailing newline is the likely way one gets here.
fn is_forbidden(b: u8) -> bool {
    matches!(b, b'\r' | b'\n' | 0)
}

/// Writes only token characters, so a name or method can hold no separator at all.
fn push_token(out: &mut Vec<u8>, token: &str) {
    out.extend(
        token
            .bytes()
            .filter(|&b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)),
    );
}

fn push_header(out: &mut Vec<u8>, name: &str, value: &str) {
    push_token(out, name);
    out.extend_from_slice(b": ");
    out.extend(
        value
            .trim_matches([' ', '\t'])
            .bytes()
            .filter(|&b| !is_forbidden(b)),
    );
    out.extend_from_slice(b"\r\n");
}

#[cfg(test)]
mod tests {
    use super::super::body::BodyDecoder;
    use super::super::head::{
        BodyKind, Parsed, parse_request_head, parse_response_head, request_body_kind,
        response_body_kind,
    };
    use super::super::sse::{SseDecoder, SseEvent, encode_event};
    use super::*;
    use crate::http::testutil::deliveries;

    #[test]
    fn request_wire_bytes() {
        let wire = request(
            "POST",
            "/v1/messages",
            "api.anthropic.com",
            &[
                ("content-type", "application/json"),
                ("x-api-key", "sk-1\n"),
            ],
            b"{}",
        );
        assert_eq!(
            wire,
            b"POST /v1/messages HTTP/1.1\r\nHost: api.anthropic.com\r\n\
              content-type: application/json\r\nx-api-key: sk-1\r\n\
              Content-Length: 2\r\n\r\n{}"
        );
    }

    #[test]
    fn content_length_only_when_needed() {
        let get = request("GET", "/health", "localhost:8080", &[], b"");
        assert_eq!(get, b"GET /health HTTP/1.1\r\nHost: localhost:8080\r\n\r\n");
        let post = request("POST", "/x", "h", &[], b"");
        assert_eq!(
            post,
            b"POST /x HTTP/1.1\r\nHost: h\r\nContent-Length: 0\r\n\r\n"
        );
        let delete = request("DELETE", "/x", "h", &[], b"ab");
        assert_eq!(
            delete,
            b"DELETE /x HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\n\r\nab"
        );
    }

    #[test]
    fn caller_host_and_length_are_not_duplicated() {
        let wire = request(
            "PUT",
            "/",
            "h",
            &[("HOST", "evil"), ("Content-length", "99")],
            b"a",
        );
        assert_eq!(
            wire,
            b"PUT / HTTP/1.1\r\nHost: h\r\nContent-Length: 1\r\n\r\na"
        );
    }

    #[test]
    fn no_field_can_split_the_message() {
        let wire = request(
            "GE T\r\n",
            "/a b\r\nX: y",
            "h\r\nInjected: 1",
            &[("Na me:\r\n", "v\r\n\r\nGET / HTTP/1.1\0")],
            b"",
        );
        assert_eq!(
            wire,
            b"GET /abX:y HTTP/1.1\r\nHost: hInjected: 1\r\nName: vGET / HTTP/1.1\r\n\r\n"
        );
    }

    #[test]
    fn response_head_wire_bytes() {
        let head = response_head(200, &[("Content-Type", "text/event-stream")]);
        assert_eq!(
            head,
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n"
        );
        assert_eq!(response_head(529, &[]), b"HTTP/1.1 529 Overloaded\r\n\r\n");
        assert_eq!(response_head(299, &[]), b"HTTP/1.1 299 Unknown\r\n\r\n");
    }

    #[test]
    fn reason_phrases() {
        assert_eq!(reason_phrase(404), "Not Found");
        assert_eq!(reason_phrase(429), "Too Many Requests");
        assert_eq!(reason_phrase(0), "Unknown");
        for status in 100..600 {
            let phrase = reason_phrase(status);
            assert!(
                !phrase.is_empty() && phrase.bytes().all(|b| b.is_ascii_graphic() || b == b' ')
            );
        }
    }

    #[test]
    fn chunks() {
        assert_eq!(chunk(b""), b"");
        assert_eq!(chunk(b"hello"), b"5\r\nhello\r\n");
        assert_eq!(chunk(&[b'x'; 26])[..4], *b"1a\r\n");
        assert_eq!(LAST_CHUNK, b"0\r\n\r\n");
    }

    #[test]
    fn request_round_trips_through_the_parsers() {
        let body = br#"{"model":"m","stream":true}"#;
        let wire = request(
            "POST",
            "/v1/chat/completions",
            "127.0.0.1:9",
            &[("Accept", "text/event-stream")],
            body,
        );
        for pieces in deliveries(&wire) {
            let mut buf = Vec::new();
            let mut head = None;
            let mut decoder = None;
            let mut decoded = Vec::new();
            let mut complete = false;
            for piece in pieces {
                buf.extend_from_slice(piece);
                if head.is_none() {
                    match parse_request_head(&buf) {
                        Ok(Parsed::Partial) => continue,
                        Ok(Parsed::Complete(parsed, n)) => {
                            buf.drain(..n);
                            let kind = request_body_kind(&parsed).unwrap();
                            decoder = Some(BodyDecoder::new(kind, 1 << 20));
                            head = Some(parsed);
                        }
                        Err(err) => panic!("{err}"),
                    }
                }
                if let Some(decoder) = decoder.as_mut() {
                    let (n, done) = decoder.decode(&buf, &mut decoded).unwrap();
                    buf.drain(..n);
                    complete = done;
                }
            }
            let head = head.unwrap();
            assert_eq!(head.method, "POST");
            assert_eq!(head.target, "/v1/chat/completions");
            assert_eq!(head.header("host"), Some("127.0.0.1:9"));
            assert!(complete);
            assert_eq!(decoded, body);
            assert!(buf.is_empty());
        }
    }

    #[test]
    fn chunked_sse_response_round_trips() {
        let events = [
            encode_event(Some("message_start"), "{\"a\":1}", None),
            encode_event(None, "two\nlines", Some("7")),
            encode_event(Some("message_stop"), "{}", None),
        ];
        let mut wire = response_head(
            200,
            &[
                ("Content-Type", "text/event-stream"),
                ("Transfer-Encoding", "chunked"),
            ],
        );
        // Chunk boundaries deliberately fall inside events and lines.
        let stream = events.concat();
        for piece in stream.as_bytes().chunks(7) {
            wire.extend_from_slice(&chunk(piece));
        }
        wire.extend_from_slice(LAST_CHUNK);
        wire.extend_from_slice(b"HTTP/1.1 204 No Content\r\n\r\n");

        let want = vec![
            SseEvent {
                event: "message_start".into(),
                data: "{\"a\":1}".into(),
                id: None,
            },
            SseEvent {
                event: "message".into(),
                data: "two\nlines".into(),
                id: Some("7".into()),
            },
            SseEvent {
                event: "message_stop".into(),
                data: "{}".into(),
                id: Some("7".into()),
            },
        ];
        for pieces in deliveries(&wire) {
            let mut buf = Vec::new();
            let mut decoder = None;
            let mut sse = SseDecoder::new();
            let mut got = Vec::new();
            let mut complete = false;
            for piece in pieces {
                buf.extend_from_slice(piece);
                if decoder.is_none() {
                    match parse_response_head(&buf).unwrap() {
                        Parsed::Partial => continue,
                        Parsed::Complete(head, n) => {
                            buf.drain(..n);
                            assert!(head.keep_alive());
                            let kind = response_body_kind(&head, false).unwrap();
                            assert_eq!(kind, BodyKind::Chunked);
                            decoder = Some(BodyDecoder::new(kind, 1 << 20));
                        }
                    }
                }
                if let Some(decoder) = decoder.as_mut() {
                    if complete {
                        continue;
                    }
                    let mut body = Vec::new();
                    let (n, done) = decoder.decode(&buf, &mut body).unwrap();
                    buf.drain(..n);
                    sse.feed(&body, &mut got).unwrap();
                    complete = done;
                }
            }
            assert!(complete);
            assert_eq!(got, want);
            assert_eq!(buf, b"HTTP/1.1 204 No Content\r\n\r\n");
        }
    }
}
