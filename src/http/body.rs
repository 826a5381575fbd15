//! HTTP/1.1 message bodies (RFC 9112 §6–§7): a push decoder for Content-Length,
//! chunked and read-until-close framing that turns wire bytes into body bytes under a size
//! cap. It stops at the exact end of the body so a pipelined or kept-alive next message
//! stays in the caller's buffer. It must not know about sockets, heads (beyond `BodyKind`),
//! content types or SSE: de-chunked bytes are just bytes.

use std::fmt;

use super::head::BodyKind;

/// Longest chunk-size line (hex size, ignored extensions, line end) we hold; real servers
/// send a few hex digits, and extensions must not let a peer grow the buffer unbounded.
pub const MAX_CHUNK_LINE: usize = 4 * 1024;

/// Most bytes of trailer fields after the last chunk; trailers are discarded, so they only
/// need a bound, and nobody we talk to sends more than a few short lines.
pub const MAX_TRAILER_BYTES: usize = 16 * 1024;

/// Why a body could not be decoded. Every one of these ends the connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BodyError {
    /// More decoded bytes than the cap given to `BodyDecoder::new`.
    TooLarge,
    BadChunkSize,
    ChunkSizeOverflow,
    ChunkLineTooLong,
    /// Chunk data not followed by its line end.
    BadChunkEnd,
    TrailersTooLarge,
    /// The peer closed before the body's end.
    Truncated,
}

impl fmt::Display for BodyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BodyError::TooLarge => f.write_str("http body larger than the allowed size"),
            BodyError::BadChunkSize => f.write_str("malformed chunk size line"),
            BodyError::ChunkSizeOverflow => f.write_str("chunk size does not fit in 64 bits"),
            BodyError::ChunkLineTooLong => {
                write!(f, "chunk size line longer than {MAX_CHUNK_LINE} bytes")
            }
            BodyError::BadChunkEnd => f.write_str("chunk data not followed by a line end"),
            BodyError::TrailersTooLarge => {
                write!(f, "chunked trailers larger than {MAX_TRAILER_BYTES} bytes")
            }
            BodyError::Truncated => f.write_str("connection closed before the end of the body"),
        }
    }
}

impl std::error::Error for BodyError {}

/// Decoder phases. Content-Length bodies are `Length` until `Done`; close-delimited ones
/// stay `UntilClose`; chunked ones cycle `ChunkSize` → `ChunkData` → `ChunkDataEnd` →
/// `ChunkSize` until a zero size leads to `Trailers` → `Done`. Any error moves to `Failed`
/// for good, so a caller that calls again gets the same error rather than garbage.
#[derive(Debug)]
enum State {
    Length {
        remaining: u64,
    },
    UntilClose,
    /// Holds the size line read so far, without its LF.
    ChunkSize {
        line: Vec<u8>,
    },
    ChunkData {
        remaining: u64,
    },
    /// After chunk data; `seen_cr` once the CR of its CRLF arrived.
    ChunkDataEnd {
        seen_cr: bool,
    },
    /// `line_len` counts non-CR bytes of the current trailer line, so an empty line (with
    /// or without CR) is the end; `total` counts every trailer byte against the cap.
    Trailers {
        line_len: usize,
        total: usize,
    },
    Done,
    Failed(BodyError),
}

/// Decodes one message body. Feed it the bytes after the head, and after each call drop
/// the consumed prefix from your buffer.
#[derive(Debug)]
pub struct BodyDecoder {
    state: State,
    cap: u64,
    decoded: u64,
}

impl BodyDecoder {
    /// `cap` is the most decoded bytes to accept; a declared Content-Length above it fails
    /// on the first `decode`, before any byte is buffered.
    pub fn new(kind: BodyKind, cap: u64) -> BodyDecoder {
        let state = match kind {
            BodyKind::None | BodyKind::ContentLength(0) => State::Done,
            BodyKind::ContentLength(n) if n > cap => State::Failed(BodyError::TooLarge),
            BodyKind::ContentLength(n) => State::Length { remaining: n },
            BodyKind::Chunked => State::ChunkSize { line: Vec::new() },
            BodyKind::UntilClose => State::UntilClose,
        };
        BodyDecoder {
            state,
            cap,
            decoded: 0,
        }
    }

    /// Appends the body bytes found in `input` to `out`. Returns how many input bytes were
    /// consumed and whether the body is complete. Bytes past the end of the body are never
    /// consumed; partial chunk-size and trailer lines are, and are remembered here.
    pub fn decode(&mut self, input: &[u8], out: &mut Vec<u8>) -> Result<(usize, bool), BodyError> {
        let mut rest = input;
        let res = self.decode_inner(&mut rest, out);
        let consumed = input.len().saturating_sub(rest.len());
        match res {
            Ok(()) => Ok((consumed, self.is_complete())),
            Err(err) => {
                self.state = State::Failed(err.clone());
                Err(err)
            }
        }
    }

    /// Called when the peer closed: fine for a close-delimited or finished body, otherwise
    /// the body was cut short.
    pub fn finish_eof(&self) -> Result<(), BodyError> {
        match &self.state {
            State::Done | State::UntilClose => Ok(()),
            State::Failed(err) => Err(err.clone()),
            _ => Err(BodyError::Truncated),
        }
    }

    pub fn is_complete(&self) -> bool {
        matches!(self.state, State::Done)
    }

    /// Advances `rest` past what was consumed.
    fn decode_inner(&mut self, rest: &mut &[u8], out: &mut Vec<u8>) -> Result<(), BodyError> {
        loop {
            match &mut self.state {
                State::Done => return Ok(()),
                State::Failed(err) => return Err(err.clone()),
                _ if rest.is_empty() => return Ok(()),
                State::Length { remaining } => {
                    *remaining = take_data(rest, *remaining, out);
                    if *remaining == 0 {
                        self.state = State::Done;
                    }
                    // The cap was checked against the declared length up front.
                }
                State::UntilClose => {
                    let n_bytes = u64::try_from(rest.len()).unwrap_or(u64::MAX);
                    self.decoded = self.decoded.saturating_add(n_bytes);
                    if self.decoded > self.cap {
                        return Err(BodyError::TooLarge);
                    }
                    out.extend_from_slice(rest);
                    *rest = &[];
                }
                State::ChunkSize { line } => {
                    let Some(text) = take_line(rest, line.len(), MAX_CHUNK_LINE)? else {
                        line.extend_from_slice(std::mem::take(rest));
                        continue;
                    };
                    line.extend_from_slice(text);
                    let size = parse_chunk_size(line)?;
                    if size == 0 {
                        self.state = State::Trailers {
                            line_len: 0,
                            total: 0,
                        };
                        continue;
                    }
                    // Checked when the size is announced, so an oversized chunk fails before
                    // its data is read.
                    self.decoded = self.decoded.saturating_add(size);
                    if self.decoded > self.cap {
                        return Err(BodyError::TooLarge);
                    }
                    self.state = State::ChunkData { remaining: size };
                }
                State::ChunkData { remaining } => {
                    *remaining = take_data(rest, *remaining, out);
                    if *remaining == 0 {
                        self.state = State::ChunkDataEnd { seen_cr: false };
                    }
                }
                State::ChunkDataEnd { seen_cr } => {
                    let Some((&byte, tail)) = rest.split_first() else {
                        return Ok(());
                    };
                    *rest = tail;
                    match byte {
                        b'\r' if !*seen_cr => *seen_cr = true,
                        // A bare LF is tolerated, as everywhere in framing.
                        b'\n' => self.state = State::ChunkSize { line: Vec::new() },
                        _ => return Err(BodyError::BadChunkEnd),
                    }
                }
                State::Trailers { line_len, total } => {
                    let end = rest.iter().position(|&b| b == b'\n');
                    let n_take = end.map_or(rest.len(), |at| at.saturating_add(1));
                    let (taken, tail) = rest.split_at_checked(n_take).unwrap_or((rest, &[]));
                    *total = total.saturating_add(taken.len());
                    if *total > MAX_TRAILER_BYTES {
                        return Err(BodyError::TrailersTooLarge);
                    }
                    *line_len = line_len.saturating_add(
                        taken.iter().filter(|&&b| b != b'\r' && b != b'\n').count(),
                    );
                    *rest = tail;
                    if end.is_some() {
                        if *line_len == 0 {
                            self.state = State::Done;
                        } else {
                            *line_len = 0;
                        }
                    }
                }
            }
        }
    }
}

/// Moves up to `remaining` bytes from the front of `rest` into `out`; returns what is
/// still owed.
fn take_data(rest: &mut &[u8], remaining: u64, out: &mut Vec<u8>) -> u64 {
    let n_take = usize::try_from(remaining).map_or(rest.len(), |r| r.min(rest.len()));
    let (data, tail) = rest.split_at_checked(n_take).unwrap_or((rest, &[]));
    out.extend_from_slice(data);
    *rest = tail;
    remaining.saturating_sub(u64::try_from(n_take).unwrap_or(u64::MAX))
}

/// If `rest` holds the LF that ends a line, consumes through it and returns the bytes
/// before it. `held` bytes of the line are already buffered; the whole line must fit `cap`.
fn take_line<'a>(
    rest: &mut &'a [u8],
    held: usize,
    cap: usize,
) -> Result<Option<&'a [u8]>, BodyError> {
    let end = rest.iter().position(|&b| b == b'\n');
    let n_line = end.unwrap_or(rest.len());
    if held.saturating_add(n_line) > cap {
        return Err(BodyError::ChunkLineTooLong);
    }
    let Some(at) = end else {
        return Ok(None);
    };
    let (line, tail) = rest.split_at_checked(at).unwrap_or((rest, &[]));
    *rest = tail.get(1..).unwrap_or_default();
    Ok(Some(line))
}

/// `hex-size [BWS] [; ext...]` with an optional CR; extensions are ignored (RFC 9112 §7.1.1).
fn parse_chunk_size(line: &[u8]) -> Result<u64, BodyError> {
    let mut rest = line.strip_suffix(b"\r").unwrap_or(line);
    let mut size: u64 = 0;
    let mut n_digits = 0usize;
    while let [byte, tail @ ..] = rest {
        let Some(digit) = char::from(*byte).to_digit(16) else {
            break;
        };
        // Leading zeros are allowed, so the digit count alone says nothing about overflow.
        size = size
            .checked_mul(16)
            .and_then(|s| s.checked_add(u64::from(digit)))
            .ok_or(BodyError::ChunkSizeOverflow)?;
        n_digits = n_digits.saturating_add(1);
        rest = tail;
    }
    if n_digits == 0 {
        return Err(BodyError::BadChunkSize);
    }
    while let [b' ' | b'\t', tail @ ..] = rest {
        rest = tail;
    }
    match rest {
        [] | [b';', ..] => Ok(size),
        _ => Err(BodyError::BadChunkSize),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::testutil::{deliveries, noise};

    const CAP: u64 = 1 << 20;

    /// What a caller ends up with: the body, how many input bytes belonged to it, and
    /// whether it completed.
    type Outcome = Result<(Vec<u8>, usize, bool), BodyError>;

    /// Feeds the pieces the way a reader does: unconsumed bytes stay in its buffer and are
    /// offered again with the next read.
    fn run(kind: BodyKind, cap: u64, pieces: &[&[u8]]) -> Outcome {
        let mut decoder = BodyDecoder::new(kind, cap);
        let mut buf = Vec::new();
        let mut body = Vec::new();
        let mut total = 0;
        let mut done = false;
        for piece in pieces {
            buf.extend_from_slice(piece);
            let (n, complete) = decoder.decode(&buf, &mut body)?;
            assert_eq!(complete, decoder.is_complete());
            buf.drain(..n);
            total += n;
            done = complete;
            if done {
                break;
            }
        }
        Ok((body, total, done))
    }

    /// Asserts every delivery of `msg` gives the same outcome, and returns it.
    fn decode_split(kind: BodyKind, cap: u64, msg: &[u8]) -> Outcome {
        let whole = run(kind, cap, &[msg]);
        for pieces in deliveries(msg) {
            let got = run(kind, cap, &pieces);
            assert_eq!(
                got,
                whole,
                "split delivery of {:?}",
                String::from_utf8_lossy(msg)
            );
        }
        whole
    }

    fn complete(kind: BodyKind, msg: &[u8]) -> (Vec<u8>, usize) {
        match decode_split(kind, CAP, msg) {
            Ok((body, n, true)) => (body, n),
            other => panic!("expected a complete body, got {other:?}"),
        }
    }

    #[test]
    fn content_length_stops_at_the_body_end() {
        let (body, n) = complete(BodyKind::ContentLength(5), b"helloHTTP/1.1 200 OK\r\n");
        assert_eq!(body, b"hello");
        assert_eq!(n, 5);
    }

    #[test]
    fn content_length_partial_and_eof() {
        let mut decoder = BodyDecoder::new(BodyKind::ContentLength(4), CAP);
        let mut out = Vec::new();
        assert_eq!(decoder.decode(b"ab", &mut out), Ok((2, false)));
        assert_eq!(decoder.decode(b"", &mut out), Ok((0, false)));
        assert_eq!(decoder.finish_eof(), Err(BodyError::Truncated));
        assert_eq!(decoder.decode(b"cdef", &mut out), Ok((2, true)));
        assert_eq!(decoder.decode(b"ef", &mut out), Ok((0, true)));
        assert_eq!(out, b"abcd");
        assert_eq!(decoder.finish_eof(), Ok(()));
    }

    #[test]
    fn empty_bodies_are_complete_at_once() {
        for kind in [BodyKind::None, BodyKind::ContentLength(0)] {
            let decoder = BodyDecoder::new(kind, 0);
            assert!(decoder.is_complete());
            assert_eq!(decoder.finish_eof(), Ok(()));
            assert_eq!(complete(kind, b"next"), (Vec::new(), 0));
        }
    }

    #[test]
    fn content_length_over_cap_fails_before_reading() {
        let got = decode_split(BodyKind::ContentLength(11), 10, b"");
        assert_eq!(got, Err(BodyError::TooLarge));
        let decoder = BodyDecoder::new(BodyKind::ContentLength(11), 10);
        assert_eq!(decoder.finish_eof(), Err(BodyError::TooLarge));
        let (body, _) = match decode_split(BodyKind::ContentLength(10), 10, b"0123456789") {
            Ok((body, n, true)) => (body, n),
            other => panic!("{other:?}"),
        };
        assert_eq!(body, b"0123456789");
    }

    #[test]
    fn until_close() {
        let got = decode_split(BodyKind::UntilClose, CAP, b"all of it\r\n0\r\n\r\n");
        assert_eq!(got, Ok((b"all of it\r\n0\r\n\r\n".to_vec(), 16, false)));
        let decoder = BodyDecoder::new(BodyKind::UntilClose, CAP);
        assert_eq!(decoder.finish_eof(), Ok(()));
        assert!(!decoder.is_complete());
        assert_eq!(
            decode_split(BodyKind::UntilClose, 3, b"abcd"),
            Err(BodyError::TooLarge)
        );
        assert!(decode_split(BodyKind::UntilClose, 4, b"abcd").is_ok());
    }

    #[test]
    fn chunked_with_extensions_leading_zeros_and_trailers() {
        let msg = b"5\r\nhello\r\n0006;name=value;x\r\n world\r\n\
                    A \t;ext\r\n0123456789\r\n000\r\nExpires: never\r\nX: y\r\n\r\nNEXT";
        let (body, n) = complete(BodyKind::Chunked, msg);
        assert_eq!(body, b"hello world0123456789");
        assert_eq!(n, msg.len() - 4);
    }

    #[test]
    fn chunked_bare_lf_and_uppercase_hex() {
        let msg = b"1A\nabcdefghijklmnopqrstuvwxyz\n0\n\n";
        let (body, n) = complete(BodyKind::Chunked, msg);
        assert_eq!(body, b"abcdefghijklmnopqrstuvwxyz");
        assert_eq!(n, msg.len());
    }

    #[test]
    fn chunked_data_may_hold_line_ends() {
        let msg = b"4\r\n\r\n\r\n\r\n0\r\n\r\n";
        assert_eq!(complete(BodyKind::Chunked, msg).0, b"\r\n\r\n");
    }

    #[test]
    fn chunked_stops_before_the_next_message() {
        let msg = b"3\r\nabc\r\n0\r\n\r\nHTTP/1.1 200 OK\r\n\r\n";
        let (_, n) = complete(BodyKind::Chunked, msg);
        assert_eq!(n, 13);
    }

    #[test]
    fn chunked_incomplete_is_truncated_at_eof() {
        for msg in [
            &b"3\r\nab"[..],
            b"3\r\nabc\r\n",
            b"3\r\nabc\r\n0\r\n",
            b"0\r\nX: y\r\n",
        ] {
            let mut decoder = BodyDecoder::new(BodyKind::Chunked, CAP);
            let mut out = Vec::new();
            assert_eq!(decoder.decode(msg, &mut out), Ok((msg.len(), false)));
            assert_eq!(decoder.finish_eof(), Err(BodyError::Truncated));
        }
    }

    #[test]
    fn chunked_errors() {
        let cases: &[(&[u8], BodyError)] = &[
            (b"\r\n", BodyError::BadChunkSize),
            (b";ext\r\n", BodyError::BadChunkSize),
            (b"-1\r\n", BodyError::BadChunkSize),
            (b"0x3\r\nabc\r\n", BodyError::BadChunkSize),
            (b"3 4\r\n", BodyError::BadChunkSize),
            (b"3\r\nabcX\r\n", BodyError::BadChunkEnd),
            (b"3\r\nabc\r\r\n", BodyError::BadChunkEnd),
            (b"10000000000000000\r\n", BodyError::ChunkSizeOverflow),
            (b"100001\r\n", BodyError::TooLarge),
        ];
        for (msg, want) in cases {
            let got = decode_split(BodyKind::Chunked, 16, msg);
            assert_eq!(got, Err(want.clone()), "{:?}", String::from_utf8_lossy(msg));
        }
        // Many leading zeros are not an overflow.
        let msg = b"00000000000000000000000000001\r\na\r\n0\r\n\r\n";
        assert_eq!(
            decode_split(BodyKind::Chunked, 16, msg),
            Ok((b"a".to_vec(), 39, true))
        );
        let max = b"ffffffffffffffff\r\n";
        assert_eq!(
            decode_split(BodyKind::Chunked, u64::MAX, max),
            Ok((Vec::new(), 18, false))
        );
    }

    #[test]
    fn chunked_cap_counts_all_chunks() {
        let msg = b"4\r\nabcd\r\n4\r\nefgh\r\n0\r\n\r\n";
        assert_eq!(
            decode_split(BodyKind::Chunked, 7, msg),
            Err(BodyError::TooLarge)
        );
        assert!(matches!(
            decode_split(BodyKind::Chunked, 8, msg),
            Ok((_, _, true))
        ));
    }

    #[test]
    fn errors_are_sticky() {
        let mut decoder = BodyDecoder::new(BodyKind::Chunked, CAP);
        let mut out = Vec::new();
        assert_eq!(
            decoder.decode(b"zz\r\n", &mut out),
            Err(BodyError::BadChunkSize)
        );
        assert_eq!(
            decoder.decode(b"0\r\n\r\n", &mut out),
            Err(BodyError::BadChunkSize)
        );
        assert_eq!(decoder.finish_eof(), Err(BodyError::BadChunkSize));
    }

    #[test]
    fn size_line_cap() {
        // The cap counts the CR but not the LF.
        let mut line = b"1;".to_vec();
        line.resize(MAX_CHUNK_LINE - 1, b'x');
        let mut decoder = BodyDecoder::new(BodyKind::Chunked, CAP);
        let mut out = Vec::new();
        assert_eq!(decoder.decode(&line, &mut out), Ok((line.len(), false)));
        assert_eq!(
            decoder.decode(b"\r\na\r\n0\r\n\r\n", &mut out),
            Ok((10, true))
        );
        assert_eq!(out, b"a");

        line.extend_from_slice(b"xx");
        let mut decoder = BodyDecoder::new(BodyKind::Chunked, CAP);
        let got = decoder.decode(&line, &mut out);
        assert_eq!(got, Err(BodyError::ChunkLineTooLong));
        // Fails without the line end too, so a peer cannot stream extensions forever.
        let mut decoder = BodyDecoder::new(BodyKind::Chunked, CAP);
        assert_eq!(decoder.decode(&line[..10], &mut out), Ok((10, false)));
        assert_eq!(
            decoder.decode(&line[10..], &mut out),
            Err(BodyError::ChunkLineTooLong)
        );
    }

    #[test]
    fn trailer_cap() {
        let mut msg = b"0\r\nX: ".to_vec();
        msg.resize(MAX_TRAILER_BYTES + 3 - 4, b'y');
        msg.extend_from_slice(b"\r\n\r\n");
        let mut decoder = BodyDecoder::new(BodyKind::Chunked, CAP);
        let mut out = Vec::new();
        assert_eq!(decoder.decode(&msg, &mut out), Ok((msg.len(), true)));
        msg.insert(5, b'y');
        let mut decoder = BodyDecoder::new(BodyKind::Chunked, CAP);
        assert_eq!(
            decoder.decode(&msg, &mut out),
            Err(BodyError::TrailersTooLarge)
        );
    }

    #[test]
    fn never_panics_on_noise() {
        let alphabet = b"0123456789abcdefF;\r\n \t:x";
        for seed in 0..2000u64 {
            let msg = noise(seed, alphabet, 60);
            for kind in [
                BodyKind::Chunked,
                BodyKind::ContentLength(7),
                BodyKind::UntilClose,
            ] {
                for cap in [0, 16, u64::MAX] {
                    let _ = run(
                        kind,
                        cap,
                        &msg.chunks(1 + seed as usize % 5).collect::<Vec<_>>(),
                    );
                }
            }
        }
    }

    #[test]
    fn display_is_lowercase_without_period() {
        let all = [
            BodyError::TooLarge,
            BodyError::BadChunkSize,
            BodyError::ChunkSizeOverflow,
            BodyError::ChunkLineTooLong,
            BodyError::BadChunkEnd,
            BodyError::TrailersTooLarge,
            BodyError::Truncated,
        ];
        for err in all {
            let text = err.to_string();
            assert!(text.starts_with(|c: char| c.is_ascii_lowercase()), "{text}");
            assert!(!text.ends_with('.'), "{text}");
        }
    }
}
