//! HTTP/1.1 message heads (RFC 9112 §2–§6): push parsers for the status line, the request
//! line and header fields, plus the rules that decide how the body that follows is framed.
//! The caller owns the buffer and calls again with more bytes after `Parsed::Partial`
//! (httparse's shape); nothing is kept between calls. This module must not know about
//! sockets, TLS, timeouts, body contents, or what a request or response means to the agent.

use std::fmt;

/// Largest head (start line, header fields and the blank line) we accept; a push parser on
/// a growing buffer needs a byte cap or a peer that never sends the blank line pins memory.
pub const MAX_HEAD_BYTES: usize = 64 * 1024;

/// Most header fields in one head; many tiny fields fit under the byte cap, and this keeps
/// the `Vec` and the linear `header()` lookups small anyway.
pub const MAX_HEADERS: usize = 256;

/// The result of offering a buffer to a head parser.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Parsed<T> {
    /// No blank line yet; call again with the same bytes plus more.
    Partial,
    /// The head and the bytes it took, including the blank line that ends it. Anything after
    /// that belongs to the body or the next message and stays in the caller's buffer.
    Complete(T, usize),
}

/// A parsed status line and header fields.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResponseHead {
    pub status: u16,
    pub reason: String,
    pub headers: Vec<(String, String)>,
    /// The `x` in `HTTP/1.x`; HTTP/1.0 changes the keep-alive default.
    pub minor_version: u8,
}

/// A parsed request line and header fields.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestHead {
    pub method: String,
    pub target: String,
    pub minor_version: u8,
    pub headers: Vec<(String, String)>,
}

/// How the body after a head is delimited (RFC 9112 §6.3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BodyKind {
    None,
    ContentLength(u64),
    Chunked,
    /// The body runs until the peer closes, so the connection cannot be reused.
    UntilClose,
}

/// Why a head was rejected. Variants carry no peer bytes so they are safe to log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HeadError {
    TooLarge,
    TooManyHeaders,
    BadStatusLine,
    BadRequestLine,
    UnsupportedVersion,
    BadHeaderName,
    BadHeaderValue,
    /// A continuation line (leading SP or HTAB) with no field before it to continue.
    FoldWithoutField,
    BadContentLength,
    ConflictingContentLength,
    /// A request whose Transfer-Encoding we cannot frame safely.
    BadTransferEncoding,
}

impl fmt::Display for HeadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HeadError::TooLarge => write!(f, "http head larger than {MAX_HEAD_BYTES} bytes"),
            HeadError::TooManyHeaders => write!(f, "more than {MAX_HEADERS} header fields"),
            HeadError::BadStatusLine => f.write_str("malformed status line"),
            HeadError::BadRequestLine => f.write_str("malformed request line"),
            HeadError::UnsupportedVersion => f.write_str("unsupported http version"),
            HeadError::BadHeaderName => f.write_str("malformed header field name"),
            HeadError::BadHeaderValue => f.write_str("malformed header field value"),
            HeadError::FoldWithoutField => f.write_str("continuation line before any header field"),
            HeadError::BadContentLength => f.write_str("malformed content-length"),
            HeadError::ConflictingContentLength => f.write_str("conflicting content-length values"),
            HeadError::BadTransferEncoding => {
                f.write_str("unsupported or ambiguous transfer-encoding")
            }
        }
    }
}

impl std::error::Error for HeadError {}

impl ResponseHead {
    /// The first field called `name`, compared case-insensitively.
    #[cfg(test)]
    pub fn header(&self, name: &str) -> Option<&str> {
        find_header(&self.headers, name)
    }

    /// Whether the connection may carry another exchange after this response's body.
    /// Besides the Connection field, a response framed by both Transfer-Encoding and
    /// Content-Length (or Transfer-Encoding on HTTP/1.0) is a smuggling shape, and
    /// RFC 9112 §6.1 says not to reuse the connection after it.
    pub fn keep_alive(&self) -> bool {
        let has_te = find_header(&self.headers, "transfer-encoding").is_some();
        let ambiguous = has_te
            && (self.minor_version == 0 || find_header(&self.headers, "content-length").is_some());
        !ambiguous && connection_allows_reuse(&self.headers, self.minor_version)
    }

    /// A 1xx other than 101: informational, followed by the real response on the same
    /// connection, so the caller skips it and parses the next head.
    pub fn is_interim(&self) -> bool {
        (100..200).contains(&self.status) && self.status != 101
    }
}

impl RequestHead {
    /// The first field called `name`, compared case-insensitively.
    pub fn header(&self, name: &str) -> Option<&str> {
        find_header(&self.headers, name)
    }

    /// Whether the client expects the connection to stay open after our response.
    pub fn keep_alive(&self) -> bool {
        connection_allows_reuse(&self.headers, self.minor_version)
    }
}

/// Parses a status line and header fields from the start of `buf`.
pub fn parse_response_head(buf: &[u8]) -> Result<Parsed<ResponseHead>, HeadError> {
    // Fail at once when the peer is not speaking HTTP (a TLS port spoken to in plaintext, a
    // banner), instead of waiting for a line end that may never come.
    let n_prefix = buf.len().min(HTTP_PREFIX.len());
    if buf.get(..n_prefix) != HTTP_PREFIX.get(..n_prefix) {
        return Err(HeadError::BadStatusLine);
    }
    let mut lines = Lines::new(buf);
    let Some(start) = lines.next_line() else {
        return incomplete(buf);
    };
    let (minor_version, status, reason) = parse_status_line(start)?;
    match parse_fields(&mut lines)? {
        Some(headers) => {
            let head = ResponseHead {
                status,
                reason,
                headers,
                minor_version,
            };
            Ok(Parsed::Complete(head, lines.consumed))
        }
        None => incomplete(buf),
    }
}

/// Parses a request line and header fields from the start of `buf`.
pub fn parse_request_head(buf: &[u8]) -> Result<Parsed<RequestHead>, HeadError> {
    let mut lines = Lines::new(buf);
    // RFC 9112 §2.2: a server should ignore empty lines before the request line, which some
    // clients send after a POST body. They still count as consumed.
    let start = loop {
        match lines.next_line() {
            None => return incomplete(buf),
            Some([]) => {}
            Some(line) => break line,
        }
    };
    let (method, target, minor_version) = parse_request_line(start)?;
    match parse_fields(&mut lines)? {
        Some(headers) => {
            let head = RequestHead {
                method,
                target,
                minor_version,
                headers,
            };
            Ok(Parsed::Complete(head, lines.consumed))
        }
        None => incomplete(buf),
    }
}

/// RFC 9112 §6.3 for responses. `request_was_head` matters because a response to HEAD
/// carries the headers of a GET but no body.
pub fn response_body_kind(
    head: &ResponseHead,
    request_was_head: bool,
) -> Result<BodyKind, HeadError> {
    if request_was_head || (100..200).contains(&head.status) || matches!(head.status, 204 | 304) {
        return Ok(BodyKind::None);
    }
    if let Some(codings) = transfer_codings(&head.headers) {
        // Content-Length is ignored when Transfer-Encoding is present; keep_alive() refuses
        // reuse for that shape. Any coding we cannot undo leaves only the close as delimiter.
        let chunked_last = codings.last().is_some_and(|coding| coding == "chunked");
        return Ok(if chunked_last {
            BodyKind::Chunked
        } else {
            BodyKind::UntilClose
        });
    }
    Ok(match content_length(&head.headers)? {
        Some(n) => BodyKind::ContentLength(n),
        None => BodyKind::UntilClose,
    })
}

/// RFC 9112 §6.3 for requests: a request body is never delimited by close.
pub fn request_body_kind(head: &RequestHead) -> Result<BodyKind, HeadError> {
    if let Some(codings) = transfer_codings(&head.headers) {
        // Anything but exactly `chunked` is either a coding we cannot undo (501 territory) or
        // a request-smuggling shape: TE alongside CL, or TE on HTTP/1.0 (RFC 9112 §6.1).
        let only_chunked = matches!(codings.as_slice(), [coding] if coding == "chunked");
        if !only_chunked
            || head.minor_version == 0
            || find_header(&head.headers, "content-length").is_some()
        {
            return Err(HeadError::BadTransferEncoding);
        }
        return Ok(BodyKind::Chunked);
    }
    Ok(BodyKind::ContentLength(
        content_length(&head.headers)?.unwrap_or(0),
    ))
}

const HTTP_PREFIX: &[u8] = b"HTTP/";

/// No blank line in `buf` yet: wait for more, unless the cap already rules out completion.
fn incomplete<T>(buf: &[u8]) -> Result<Parsed<T>, HeadError> {
    if buf.len() >= MAX_HEAD_BYTES {
        Err(HeadError::TooLarge)
    } else {
        Ok(Parsed::Partial)
    }
}

/// Complete lines from the first `MAX_HEAD_BYTES` of a buffer. A line is complete only at
/// its LF, so a CR that arrives without its LF never ends a line; one CR before the LF is
/// stripped, which also accepts bare-LF line ends.
struct Lines<'a> {
    rest: &'a [u8],
    consumed: usize,
}

impl<'a> Lines<'a> {
    fn new(buf: &'a [u8]) -> Self {
        let window = buf.get(..buf.len().min(MAX_HEAD_BYTES)).unwrap_or(buf);
        Lines {
            rest: window,
            consumed: 0,
        }
    }

    fn next_line(&mut self) -> Option<&'a [u8]> {
        let lf = self.rest.iter().position(|&b| b == b'\n')?;
        let (line, rest) = self.rest.split_at_checked(lf)?;
        self.rest = rest.get(1..)?;
        self.consumed = self.consumed.saturating_add(lf.saturating_add(1));
        Some(line.strip_suffix(b"\r").unwrap_or(line))
    }
}

/// Header fields up to the blank line; `None` when the blank line has not arrived yet.
/// Lines are checked as they complete, so a bad field fails before the head is whole.
fn parse_fields(lines: &mut Lines<'_>) -> Result<Option<Vec<(String, String)>>, HeadError> {
    let mut headers: Vec<(String, String)> = Vec::new();
    loop {
        let Some(line) = lines.next_line() else {
            return Ok(None);
        };
        match line {
            [] => return Ok(Some(headers)),
            [b' ' | b'\t', ..] => {
                // Obsolete line folding (RFC 9112 §5.2): the continuation joins the previous
                // value with a single space.
                let (_, value) = headers.last_mut().ok_or(HeadError::FoldWithoutField)?;
                let more = check_value(trim_ows(line))?;
                if !more.is_empty() {
                    if !value.is_empty() {
                        value.push(' ');
                    }
                    value.push_str(&String::from_utf8_lossy(more));
                }
            }
            _ => {
                if headers.len() >= MAX_HEADERS {
                    return Err(HeadError::TooManyHeaders);
                }
                headers.push(parse_field(line)?);
            }
        }
    }
}

fn parse_field(line: &[u8]) -> Result<(String, String), HeadError> {
    let (name, value) = split_once(line, b':').ok_or(HeadError::BadHeaderName)?;
    // Whitespace before the colon is rejected here too: RFC 9112 §5.1 makes it a hard
    // error because intermediaries disagree about what the name is.
    if name.is_empty() || !name.iter().all(|&b| is_tchar(b)) {
        return Err(HeadError::BadHeaderName);
    }
    let value = check_value(trim_ows(value))?;
    Ok((
        String::from_utf8_lossy(name).into_owned(),
        String::from_utf8_lossy(value).into_owned(),
    ))
}

/// NUL and a stray CR inside a value are how header injection survives one parser and not
/// the next; obs-text bytes (0x80..) are tolerated and decoded lossily.
fn check_value(value: &[u8]) -> Result<&[u8], HeadError> {
    if value.iter().any(|&b| b == 0 || b == b'\r') {
        Err(HeadError::BadHeaderValue)
    } else {
        Ok(value)
    }
}

fn parse_status_line(line: &[u8]) -> Result<(u8, u16, String), HeadError> {
    let rest = line
        .strip_prefix(HTTP_PREFIX)
        .ok_or(HeadError::BadStatusLine)?;
    let (version, rest) = split_once(rest, b' ').ok_or(HeadError::BadStatusLine)?;
    let minor_version = parse_version(version)?;
    // Some servers end the line right after the code, without the space before an empty
    // reason phrase.
    let (code, reason) = split_once(rest, b' ').unwrap_or((rest, &[]));
    let status = match *code {
        [b'1'..=b'9', b'0'..=b'9', b'0'..=b'9'] => std::str::from_utf8(code)
            .ok()
            .and_then(|digits| digits.parse().ok())
            .ok_or(HeadError::BadStatusLine)?,
        _ => return Err(HeadError::BadStatusLine),
    };
    if reason.iter().any(|&b| b == 0 || b == b'\r') {
        return Err(HeadError::BadStatusLine);
    }
    Ok((
        minor_version,
        status,
        String::from_utf8_lossy(reason).into_owned(),
    ))
}

fn parse_request_line(line: &[u8]) -> Result<(String, String, u8), HeadError> {
    let mut parts = line.split(|&b| b == b' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(HeadError::BadRequestLine);
    };
    if method.is_empty() || !method.iter().all(|&b| is_tchar(b)) {
        return Err(HeadError::BadRequestLine);
    }
    if target.is_empty() || !target.iter().all(u8::is_ascii_graphic) {
        return Err(HeadError::BadRequestLine);
    }
    let version = version
        .strip_prefix(HTTP_PREFIX)
        .ok_or(HeadError::BadRequestLine)?;
    let minor_version = parse_version(version)?;
    Ok((
        String::from_utf8_lossy(method).into_owned(),
        String::from_utf8_lossy(target).into_owned(),
        minor_version,
    ))
}

/// `1.x` after `HTTP/`; any 1.x is read as 1.1-compatible (RFC 9110 §2.5).
fn parse_version(version: &[u8]) -> Result<u8, HeadError> {
    match *version {
        [b'1', b'.', minor @ b'0'..=b'9'] => Ok(minor.saturating_sub(b'0')),
        _ => Err(HeadError::UnsupportedVersion),
    }
}

/// RFC 9110 §5.6.2 token characters.
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// Strips optional whitespace (SP and HTAB only, unlike `trim_ascii`, so that a stray CR
/// is still seen and rejected).
fn trim_ows(mut bytes: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = bytes {
        bytes = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = bytes {
        bytes = rest;
    }
    bytes
}

fn split_once(bytes: &[u8], sep: u8) -> Option<(&[u8], &[u8])> {
    let at = bytes.iter().position(|&b| b == sep)?;
    let (before, after) = bytes.split_at_checked(at)?;
    Some((before, after.get(1..)?))
}

fn find_header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(field, _)| field.eq_ignore_ascii_case(name))
        .map(|(_, value)| value.as_str())
}

/// The comma-separated elements of every field called `name`, in order and trimmed;
/// RFC 9110 §5.3 says repeated fields mean the same as one joined with commas.
fn list_elements<'a>(
    headers: &'a [(String, String)],
    name: &'a str,
) -> impl Iterator<Item = &'a str> + 'a {
    headers
        .iter()
        .filter(move |(field, _)| field.eq_ignore_ascii_case(name))
        .flat_map(|(_, value)| value.split(','))
        .map(|element| element.trim_matches([' ', '\t']))
}

fn connection_allows_reuse(headers: &[(String, String)], minor_version: u8) -> bool {
    let mut close = false;
    let mut keep_alive = false;
    for option in list_elements(headers, "connection") {
        close |= option.eq_ignore_ascii_case("close");
        keep_alive |= option.eq_ignore_ascii_case("keep-alive");
    }
    !close && (minor_version >= 1 || keep_alive)
}

/// The transfer codings in order, lowercased and without parameters; `None` when no
/// Transfer-Encoding field is present.
fn transfer_codings(headers: &[(String, String)]) -> Option<Vec<String>> {
    find_header(headers, "transfer-encoding")?;
    let codings = list_elements(headers, "transfer-encoding")
        .filter(|element| !element.is_empty())
        .map(|element| {
            let name = element.split(';').next().unwrap_or(element);
            name.trim_matches([' ', '\t']).to_ascii_lowercase()
        })
        .collect();
    Some(codings)
}

/// Content-Length, accepting repeats (as fields or a comma list) only when every value is
/// the same (RFC 9110 §8.6); differing values are how responses get smuggled.
fn content_length(headers: &[(String, String)]) -> Result<Option<u64>, HeadError> {
    let mut found: Option<u64> = None;
    for element in list_elements(headers, "content-length") {
        // `u64::from_str` would also take a leading `+`, which the grammar does not.
        if element.is_empty() || !element.bytes().all(|b| b.is_ascii_digit()) {
            return Err(HeadError::BadContentLength);
        }
        let n: u64 = element.parse().map_err(|_| HeadError::BadContentLength)?;
        match found {
            Some(previous) if previous != n => return Err(HeadError::ConflictingContentLength),
            _ => found = Some(n),
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::testutil::{deliveries, noise};

    type ParseFn<T> = fn(&[u8]) -> Result<Parsed<T>, HeadError>;

    /// Feeds `msg` the way a reader does (appending to one buffer, parsing after each read)
    /// and asserts every delivery gives the same answer, which is returned.
    fn parse_split<T: Clone + PartialEq + fmt::Debug>(
        msg: &[u8],
        parse: ParseFn<T>,
    ) -> Result<Parsed<T>, HeadError> {
        let whole = parse(msg);
        for pieces in deliveries(msg) {
            let mut buf = Vec::new();
            let mut res = Ok(Parsed::Partial);
            for piece in pieces {
                buf.extend_from_slice(piece);
                res = parse(&buf);
                if res != Ok(Parsed::Partial) {
                    break;
                }
            }
            assert_eq!(
                res,
                whole,
                "split delivery of {:?}",
                String::from_utf8_lossy(msg)
            );
        }
        whole
    }

    fn response(msg: &[u8]) -> (ResponseHead, usize) {
        match parse_split(msg, parse_response_head) {
            Ok(Parsed::Complete(head, n)) => (head, n),
            other => panic!("expected a complete response head, got {other:?}"),
        }
    }

    fn request(msg: &[u8]) -> (RequestHead, usize) {
        match parse_split(msg, parse_request_head) {
            Ok(Parsed::Complete(head, n)) => (head, n),
            other => panic!("expected a complete request head, got {other:?}"),
        }
    }

    fn fields(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect()
    }

    fn response_with(headers: &[(&str, &str)]) -> ResponseHead {
        ResponseHead {
            status: 200,
            reason: "OK".into(),
            headers: fields(headers),
            minor_version: 1,
        }
    }

    fn request_with(minor_version: u8, headers: &[(&str, &str)]) -> RequestHead {
        RequestHead {
            method: "POST".into(),
            target: "/".into(),
            minor_version,
            headers: fields(headers),
        }
    }

    #[test]
    fn response_head_with_body_after() {
        let msg = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\
                    content-length: 5\r\n\r\nhello";
        let (head, n) = response(msg);
        assert_eq!(n, msg.len() - 5);
        assert_eq!(head.status, 200);
        assert_eq!(head.reason, "OK");
        assert_eq!(head.minor_version, 1);
        assert_eq!(head.header("CONTENT-TYPE"), Some("text/event-stream"));
        assert_eq!(head.header("Content-Length"), Some("5"));
        assert_eq!(head.header("missing"), None);
        assert!(head.keep_alive());
        assert!(!head.is_interim());
        assert_eq!(
            response_body_kind(&head, false),
            Ok(BodyKind::ContentLength(5))
        );
    }

    #[test]
    fn bare_lf_and_multiword_reason() {
        let msg = b"HTTP/1.1 404 Not Found\nX-A: 1\n\n";
        let (head, n) = response(msg);
        assert_eq!(n, msg.len());
        assert_eq!(head.reason, "Not Found");
        assert_eq!(head.headers, fields(&[("X-A", "1")]));
    }

    #[test]
    fn status_line_without_reason() {
        let (head, _) = response(b"HTTP/1.1 204\r\n\r\n");
        assert_eq!(head.status, 204);
        assert_eq!(head.reason, "");
        let (head, _) = response(b"HTTP/1.1 200 \r\n\r\n");
        assert_eq!(head.reason, "");
    }

    #[test]
    fn first_header_wins_and_case_is_kept() {
        let (head, _) = response(b"HTTP/1.1 200 OK\r\nx-id: a\r\nX-Id: b\r\n\r\n");
        assert_eq!(head.header("X-ID"), Some("a"));
        assert_eq!(head.headers, fields(&[("x-id", "a"), ("X-Id", "b")]));
    }

    #[test]
    fn values_are_trimmed_and_may_be_empty() {
        let (head, _) = response(b"HTTP/1.1 200 OK\r\nA:\t  x y \t\r\nB:\r\nC: \r\n\r\n");
        assert_eq!(head.headers, fields(&[("A", "x y"), ("B", ""), ("C", "")]));
    }

    #[test]
    fn obs_fold_joins_with_one_space() {
        let msg = b"HTTP/1.1 200 OK\r\nX-Long: one\r\n   two\r\n\tthree \r\nY: z\r\n\r\n";
        let (head, _) = response(msg);
        assert_eq!(
            head.headers,
            fields(&[("X-Long", "one two three"), ("Y", "z")])
        );
        let (head, _) = response(b"HTTP/1.1 200 OK\r\nX-Empty:\r\n more\r\n\r\n");
        assert_eq!(head.header("x-empty"), Some("more"));
    }

    #[test]
    fn fold_before_first_field_is_rejected() {
        let res = parse_split(b"HTTP/1.1 200 OK\r\n folded\r\n\r\n", parse_response_head);
        assert_eq!(res, Err(HeadError::FoldWithoutField));
    }

    #[test]
    fn obs_text_is_decoded_lossily() {
        let (head, _) = response(b"HTTP/1.1 200 OK\r\nX: caf\xe9\r\n\r\n");
        assert_eq!(head.header("x"), Some("caf\u{fffd}"));
    }

    #[test]
    fn bad_response_heads() {
        let cases: &[(&[u8], HeadError)] = &[
            (b"\x16\x03\x01\x02\x00", HeadError::BadStatusLine),
            (b"SSH-2.0-OpenSSH\r\n", HeadError::BadStatusLine),
            (b"HTTP/2 200\r\n\r\n", HeadError::UnsupportedVersion),
            (b"HTTP/1.1\r\n\r\n", HeadError::BadStatusLine),
            (b"HTTP/1.1 20 OK\r\n\r\n", HeadError::BadStatusLine),
            (b"HTTP/1.1 2000 OK\r\n\r\n", HeadError::BadStatusLine),
            (b"HTTP/1.1 099 OK\r\n\r\n", HeadError::BadStatusLine),
            (b"HTTP/1.1 abc OK\r\n\r\n", HeadError::BadStatusLine),
            (b"HTTP/1.1 200 O\rK\r\n\r\n", HeadError::BadStatusLine),
            (
                b"HTTP/1.1 200 OK\r\nNo colon\r\n\r\n",
                HeadError::BadHeaderName,
            ),
            (
                b"HTTP/1.1 200 OK\r\nName : v\r\n\r\n",
                HeadError::BadHeaderName,
            ),
            (b"HTTP/1.1 200 OK\r\n: v\r\n\r\n", HeadError::BadHeaderName),
            (
                b"HTTP/1.1 200 OK\r\nA(b): v\r\n\r\n",
                HeadError::BadHeaderName,
            ),
            (
                b"HTTP/1.1 200 OK\r\nA: x\0y\r\n\r\n",
                HeadError::BadHeaderValue,
            ),
            (
                b"HTTP/1.1 200 OK\r\nA: x\ry\r\n\r\n",
                HeadError::BadHeaderValue,
            ),
            (
                b"HTTP/1.1 200 OK\r\nA: x\r\r\n\r\n",
                HeadError::BadHeaderValue,
            ),
            (
                b"HTTP/1.1 200 OK\r\nA: x\r\n b\0\r\n\r\n",
                HeadError::BadHeaderValue,
            ),
        ];
        for (msg, want) in cases {
            let got = parse_split(msg, parse_response_head);
            assert_eq!(got, Err(want.clone()), "{:?}", String::from_utf8_lossy(msg));
        }
    }

    #[test]
    fn garbage_fails_before_a_line_end() {
        assert_eq!(parse_response_head(b"HTTP/1.1 2"), Ok(Parsed::Partial));
        assert_eq!(parse_response_head(b"HTT"), Ok(Parsed::Partial));
        assert_eq!(parse_response_head(b""), Ok(Parsed::Partial));
        assert_eq!(parse_response_head(b"HTX"), Err(HeadError::BadStatusLine));
    }

    #[test]
    fn partial_until_blank_line() {
        for msg in [
            &b"HTTP/1.1 200 OK\r\nA: b\r\n\r"[..],
            b"HTTP/1.1 200 OK\r\nA: b\r\n",
        ] {
            assert_eq!(parse_response_head(msg), Ok(Parsed::Partial));
        }
        assert_eq!(parse_request_head(b"\r\n\r\n\n"), Ok(Parsed::Partial));
    }

    #[test]
    fn head_size_cap() {
        let mut msg = b"HTTP/1.1 200 OK\r\nX: ".to_vec();
        msg.resize(MAX_HEAD_BYTES - 4, b'a');
        msg.extend_from_slice(b"\r\n\r\n");
        assert_eq!(msg.len(), MAX_HEAD_BYTES);
        // Too big for every split point in a debug build; the ends are where the cap bites.
        for at in (1..8).chain(msg.len() - 8..msg.len()) {
            assert_eq!(parse_response_head(&msg[..at]), Ok(Parsed::Partial), "{at}");
        }
        let Ok(Parsed::Complete(_, n)) = parse_response_head(&msg) else {
            panic!("a head of exactly MAX_HEAD_BYTES must parse");
        };
        assert_eq!(n, MAX_HEAD_BYTES);

        let mut long = msg.clone();
        long.insert(20, b'a');
        assert_eq!(
            parse_response_head(&long[..MAX_HEAD_BYTES - 1]),
            Ok(Parsed::Partial)
        );
        assert_eq!(
            parse_response_head(&long[..MAX_HEAD_BYTES]),
            Err(HeadError::TooLarge)
        );
        assert_eq!(parse_response_head(&long), Err(HeadError::TooLarge));
        // Still only partial, but the cap already rules out completion.
        let endless = vec![b'a'; MAX_HEAD_BYTES];
        assert_eq!(parse_request_head(&endless), Err(HeadError::TooLarge));
        assert_eq!(parse_request_head(&endless[1..]), Ok(Parsed::Partial));
    }

    #[test]
    fn header_count_cap() {
        let mut msg = b"HTTP/1.1 200 OK\r\n".to_vec();
        for _ in 0..MAX_HEADERS {
            msg.extend_from_slice(b"a: b\r\n");
        }
        let mut full = msg.clone();
        full.extend_from_slice(b"\r\n");
        assert_eq!(response(&full).0.headers.len(), MAX_HEADERS);
        msg.extend_from_slice(b"a: b\r\n\r\n");
        assert_eq!(parse_response_head(&msg), Err(HeadError::TooManyHeaders));
    }

    #[test]
    fn request_head() {
        let msg = b"POST /v1/messages?x=1 HTTP/1.1\r\nHost: example.com:8080\r\n\
                    Content-Length: 2\r\n\r\n{}";
        let (head, n) = request(msg);
        assert_eq!(n, msg.len() - 2);
        assert_eq!(head.method, "POST");
        assert_eq!(head.target, "/v1/messages?x=1");
        assert_eq!(head.minor_version, 1);
        assert_eq!(head.header("host"), Some("example.com:8080"));
        assert!(head.keep_alive());
        assert_eq!(request_body_kind(&head), Ok(BodyKind::ContentLength(2)));
    }

    #[test]
    fn leading_empty_lines_before_request_are_skipped() {
        let msg = b"\r\n\n\r\nGET / HTTP/1.0\n\n";
        let (head, n) = request(msg);
        assert_eq!(n, msg.len());
        assert_eq!(head.method, "GET");
        assert_eq!(head.minor_version, 0);
        assert!(!head.keep_alive());
        assert_eq!(request_body_kind(&head), Ok(BodyKind::ContentLength(0)));
    }

    #[test]
    fn bad_request_heads() {
        let cases: &[(&[u8], HeadError)] = &[
            (b"GET / HTTP/1.1 extra\r\n\r\n", HeadError::BadRequestLine),
            (b"GET  / HTTP/1.1\r\n\r\n", HeadError::BadRequestLine),
            (b"GET /\r\n\r\n", HeadError::BadRequestLine),
            (b"G(T / HTTP/1.1\r\n\r\n", HeadError::BadRequestLine),
            (b"GET /\x7f HTTP/1.1\r\n\r\n", HeadError::BadRequestLine),
            (b"GET /\xc3\xa9 HTTP/1.1\r\n\r\n", HeadError::BadRequestLine),
            (b"GET / FTP/1.1\r\n\r\n", HeadError::BadRequestLine),
            (b"GET / HTTP/2.0\r\n\r\n", HeadError::UnsupportedVersion),
            (
                b"GET / HTTP/1.1\r\nBad Name: x\r\n\r\n",
                HeadError::BadHeaderName,
            ),
        ];
        for (msg, want) in cases {
            let got = parse_split(msg, parse_request_head);
            assert_eq!(got, Err(want.clone()), "{:?}", String::from_utf8_lossy(msg));
        }
    }

    #[test]
    fn keep_alive_rules() {
        let with = |minor: u8, connection: &[(&str, &str)]| {
            let mut head = response_with(connection);
            head.minor_version = minor;
            (
                head.keep_alive(),
                request_with(minor, connection).keep_alive(),
            )
        };
        assert_eq!(with(1, &[]), (true, true));
        assert_eq!(with(1, &[("Connection", "close")]), (false, false));
        assert_eq!(with(1, &[("connection", "Upgrade, CLOSE")]), (false, false));
        assert_eq!(
            with(1, &[("Connection", "upgrade"), ("Connection", "close")]),
            (false, false)
        );
        assert_eq!(with(0, &[]), (false, false));
        assert_eq!(with(0, &[("Connection", "Keep-Alive")]), (true, true));
        assert_eq!(
            with(0, &[("Connection", "keep-alive, close")]),
            (false, false)
        );
        assert_eq!(with(1, &[("Connection", "closed")]), (true, true));
    }

    #[test]
    fn ambiguous_response_framing_is_not_reused() {
        let both = response_with(&[("Transfer-Encoding", "chunked"), ("Content-Length", "3")]);
        assert_eq!(response_body_kind(&both, false), Ok(BodyKind::Chunked));
        assert!(!both.keep_alive());
        let mut old = response_with(&[("Transfer-Encoding", "chunked")]);
        assert!(old.keep_alive());
        old.minor_version = 0;
        old.headers.push(("Connection".into(), "keep-alive".into()));
        assert!(!old.keep_alive());
    }

    #[test]
    fn interim_responses() {
        for (status, interim) in [
            (100, true),
            (103, true),
            (101, false),
            (199, true),
            (200, false),
        ] {
            let head = ResponseHead {
                status,
                ..response_with(&[])
            };
            assert_eq!(head.is_interim(), interim, "{status}");
        }
    }

    #[test]
    fn response_body_kinds() {
        let kind = |status: u16, headers: &[(&str, &str)], was_head: bool| {
            let head = ResponseHead {
                status,
                ..response_with(headers)
            };
            response_body_kind(&head, was_head)
        };
        let cl = [("Content-Length", "10")];
        assert_eq!(kind(200, &cl, true), Ok(BodyKind::None));
        assert_eq!(kind(100, &cl, false), Ok(BodyKind::None));
        assert_eq!(kind(101, &[], false), Ok(BodyKind::None));
        assert_eq!(kind(204, &cl, false), Ok(BodyKind::None));
        assert_eq!(kind(304, &cl, false), Ok(BodyKind::None));
        assert_eq!(kind(200, &cl, false), Ok(BodyKind::ContentLength(10)));
        assert_eq!(kind(200, &[], false), Ok(BodyKind::UntilClose));
        let te = |value| kind(200, &[("Transfer-Encoding", value)], false);
        assert_eq!(te("chunked"), Ok(BodyKind::Chunked));
        assert_eq!(te("Chunked"), Ok(BodyKind::Chunked));
        assert_eq!(te("gzip, chunked"), Ok(BodyKind::Chunked));
        assert_eq!(te("chunked, gzip"), Ok(BodyKind::UntilClose));
        assert_eq!(te("gzip"), Ok(BodyKind::UntilClose));
        assert_eq!(te(""), Ok(BodyKind::UntilClose));
        let split_te = [
            ("Transfer-Encoding", "gzip"),
            ("transfer-encoding", "chunked"),
        ];
        assert_eq!(kind(200, &split_te, false), Ok(BodyKind::Chunked));
        // Transfer-Encoding wins even over a malformed Content-Length.
        let both = [("Content-Length", "x"), ("Transfer-Encoding", "chunked")];
        assert_eq!(kind(200, &both, false), Ok(BodyKind::Chunked));
    }

    #[test]
    fn content_length_rules() {
        let kind = |headers: &[(&str, &str)]| response_body_kind(&response_with(headers), false);
        assert_eq!(
            kind(&[("Content-Length", "007")]),
            Ok(BodyKind::ContentLength(7))
        );
        assert_eq!(
            kind(&[("Content-Length", "5, 5")]),
            Ok(BodyKind::ContentLength(5))
        );
        let twice = [("Content-Length", "5"), ("content-length", "5")];
        assert_eq!(kind(&twice), Ok(BodyKind::ContentLength(5)));
        let max = u64::MAX.to_string();
        let max_kind = kind(&[("Content-Length", max.as_str())]);
        assert_eq!(max_kind, Ok(BodyKind::ContentLength(u64::MAX)));
        let conflict = Err(HeadError::ConflictingContentLength);
        assert_eq!(kind(&[("Content-Length", "5, 6")]), conflict);
        assert_eq!(
            kind(&[("Content-Length", "5"), ("Content-Length", "6")]),
            conflict
        );
        for bad in ["", "+5", "-1", "5,", "0x10", "1 2", "18446744073709551616"] {
            let got = kind(&[("Content-Length", bad)]);
            assert_eq!(got, Err(HeadError::BadContentLength), "{bad:?}");
        }
    }

    #[test]
    fn request_body_kinds() {
        let kind =
            |minor: u8, headers: &[(&str, &str)]| request_body_kind(&request_with(minor, headers));
        assert_eq!(
            kind(1, &[("Transfer-Encoding", "chunked")]),
            Ok(BodyKind::Chunked)
        );
        assert_eq!(
            kind(1, &[("Content-Length", "3")]),
            Ok(BodyKind::ContentLength(3))
        );
        let bad_te = Err(HeadError::BadTransferEncoding);
        assert_eq!(kind(1, &[("Transfer-Encoding", "gzip")]), bad_te);
        assert_eq!(kind(1, &[("Transfer-Encoding", "gzip, chunked")]), bad_te);
        assert_eq!(
            kind(1, &[("Transfer-Encoding", "chunked, chunked")]),
            bad_te
        );
        assert_eq!(kind(0, &[("Transfer-Encoding", "chunked")]), bad_te);
        let both = [("Transfer-Encoding", "chunked"), ("Content-Length", "3")];
        assert_eq!(kind(1, &both), bad_te);
        let conflict = [("Content-Length", "3"), ("Content-Length", "4")];
        assert_eq!(kind(1, &conflict), Err(HeadError::ConflictingContentLength));
    }

    #[test]
    fn never_panics_on_noise() {
        let alphabet = b"HTTP/1.0 20:\r\n\t ,;chunked-Length";
        for seed in 0..2000u64 {
            let mut msg = if seed.is_multiple_of(2) {
                b"HTTP/1.1 200 OK\r\n".to_vec()
            } else {
                Vec::new()
            };
            msg.extend(noise(seed, alphabet, 80));
            for at in 0..=msg.len() {
                if let Ok(Parsed::Complete(head, _)) = parse_response_head(&msg[..at]) {
                    let _ = (response_body_kind(&head, false), head.keep_alive());
                }
                if let Ok(Parsed::Complete(head, _)) = parse_request_head(&msg[..at]) {
                    let _ = (request_body_kind(&head), head.keep_alive());
                }
            }
        }
    }

    #[test]
    fn display_is_lowercase_without_period() {
        let all = [
            HeadError::TooLarge,
            HeadError::TooManyHeaders,
            HeadError::BadStatusLine,
            HeadError::BadRequestLine,
            HeadError::UnsupportedVersion,
            HeadError::BadHeaderName,
            HeadError::BadHeaderValue,
            HeadError::FoldWithoutField,
            HeadError::BadContentLength,
            HeadError::ConflictingContentLength,
            HeadError::BadTransferEncoding,
        ];
        for err in all {
            let text = err.to_string();
            assert!(text.starts_with(|c: char| c.is_ascii_lowercase()), "{text}");
            assert!(!text.ends_with('.'), "{text}");
        }
    }
}
