//! Entry points for the fuzz targets in `fuzz/`, one per parser that takes bytes from a peer
//! or a file. NOT AN API: this module exists only so the fuzz crate can reach parsers that
//! are private to this crate. It is compiled only for fuzz builds (`--cfg fuzzing`, which
//! cargo-fuzz sets) and for this crate's tests, which replay `fuzz/seeds/` through it.
//!
//! Each function drives one parser with the fuzzer's bytes and panics when an invariant
//! fails: not just "no panic", but split-point equivalence, consumption within the input,
//! byte caps, and round trips where the codec has an encoder. The first few bytes of an input
//! are knobs (split points, a body kind, a cap); the rest is what the parser sees.

use std::cell::RefCell;
use std::fmt::Debug;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::{fs, io};

use serde_json::{Value, json};

use crate::drive::session::{EventLog, SessionStore};
use crate::http::body::{BodyDecoder, BodyError, MAX_CHUNK_LINE, MAX_TRAILER_BYTES};
use crate::http::head::{self, BodyKind, HeadError, MAX_HEAD_BYTES, MAX_HEADERS, Parsed};
use crate::http::sse::{self, MAX_SSE_EVENT, SseDecoder, SseEvent};
use crate::jsonrpc::{self, INVALID_REQUEST, PARSE_ERROR};
use crate::permissions::{self, Action, Mode, PatternError, Policy, Rule, RuleSource};

/// A fuzz target: the fuzzer's bytes in, a panic on a broken invariant.
pub type Target = fn(&[u8]);

/// Every target by the name of its `fuzz/fuzz_targets/<name>.rs` and seed directory.
pub const TARGETS: &[(&str, Target)] = &[
    ("http_head", http_head),
    ("http_body", http_body),
    ("sse", sse),
    ("jsonrpc", jsonrpc),
    ("permission_pattern", permission_pattern),
    ("shell_split", shell_split),
    ("session_file", session_file),
];

/// Request and response heads: a reader that appends to one buffer and parses after each
/// read gets the answer parsing the whole buffer gives; `Complete(n)` ends with the blank
/// line and depends on nothing after it; `Partial` never holds `MAX_HEAD_BYTES` or more.
pub fn http_head(data: &[u8]) {
    let ([at_lo, at_hi, run, fill, c1_lo, c1_hi, c2_lo, c2_hi], payload) = knobs(data);
    // Runs of up to 127 KiB, so a short input can cross the 64 KiB head cap.
    let run = usize::from(run) * usize::from(run) * 2;
    let buf = stretch(payload, point(at_lo, at_hi, payload.len()), run, fill);
    let cuts = [
        point(c1_lo, c1_hi, buf.len()),
        point(c2_lo, c2_hi, buf.len()),
    ];
    check_head(&buf, cuts, head::parse_request_head, |head| {
        assert!(!head.method.is_empty() && !head.target.is_empty());
        assert!(!head.target.bytes().any(|b| b.is_ascii_whitespace()));
        check_fields(&head.headers);
        // Chunked framing is only trusted alone: never beside Content-Length or on HTTP/1.0,
        // the shapes request smuggling uses.
        if head::request_body_kind(head) == Ok(BodyKind::Chunked) {
            assert!(head.minor_version >= 1 && head.header("content-length").is_none());
        }
        let _ = head.keep_alive();
    });
    check_head(&buf, cuts, head::parse_response_head, |head| {
        assert!((100..1000).contains(&head.status));
        assert!(!head.reason.contains(['\r', '\n', '\0']));
        check_fields(&head.headers);
        assert_eq!(head::response_body_kind(head, true), Ok(BodyKind::None));
        let _ = (head::response_body_kind(head, false), head.is_interim());
    });
}

/// Content-Length, chunked and close-delimited bodies: every delivery gives the same body and
/// stops at the same byte; no call consumes more than it was given or emits more than it
/// consumed; the decoded body never exceeds the cap; a chunk-size line, the CRLF around it
/// and the trailers are the only bytes taken without output, within their caps; errors stick.
pub fn http_body(data: &[u8]) {
    let (knob, payload) = knobs(data);
    let [
        kind,
        len_lo,
        len_hi,
        cap,
        at_lo,
        at_hi,
        run,
        fill,
        c1_lo,
        c1_hi,
        c2_lo,
        c2_hi,
    ] = knob;
    let kind = match kind % 8 {
        0..=4 => BodyKind::Chunked,
        5 => BodyKind::ContentLength(u64::from(u16::from_le_bytes([len_lo, len_hi]))),
        6 => BodyKind::UntilClose,
        _ => BodyKind::None,
    };
    let cap = match cap {
        255 => u64::MAX,
        n => u64::from(n) * u64::from(n),
    };
    // Runs of up to 32 KiB, past both the size-line and the trailer caps.
    let run = usize::from(run) * usize::from(run) / 2;
    let input = stretch(payload, point(at_lo, at_hi, payload.len()), run, fill);
    let cuts = [
        point(c1_lo, c1_hi, input.len()),
        point(c2_lo, c2_hi, input.len()),
    ];
    let [whole, pieces, bytes] = deliveries(&input, cuts).map(|d| decode_body(kind, cap, &d));
    for other in [&pieces, &bytes] {
        match (&whole.result, &other.result) {
            (Ok(_), Ok(_)) => assert_eq!(&whole, other, "split delivery"),
            (a, b) => assert_eq!(a.clone().err(), b.clone().err(), "split delivery"),
        }
    }
    let n_input = input.len();
    match kind {
        BodyKind::ContentLength(n) if n > cap => {
            assert_eq!(whole.result, Err(BodyError::TooLarge));
        }
        BodyKind::ContentLength(n) => {
            let n_body = usize::try_from(n).map_or(n_input, |n| n.min(n_input));
            assert_eq!(whole.body, input[..n_body]);
            assert_eq!(whole.consumed, n_body);
            assert_eq!(whole.result, Ok(n_body as u64 == n));
        }
        BodyKind::UntilClose if n_input as u64 > cap => {
            assert_eq!(whole.result, Err(BodyError::TooLarge));
        }
        BodyKind::UntilClose => {
            assert_eq!(
                (&whole.body[..], whole.result.clone()),
                (&input[..], Ok(false))
            );
        }
        BodyKind::None => {
            assert_eq!((whole.consumed, whole.result.clone()), (0, Ok(true)));
        }
        BodyKind::Chunked => assert!(whole.body.len() <= whole.consumed),
    }
}

/// The event-stream decoder: every delivery gives the same events, error and last event ID;
/// events need two line ends each and hold no CR; each event re-encoded by `encode_event`
/// decodes to itself, and `encode_event` on arbitrary text injects no field.
pub fn sse(data: &[u8]) {
    let ([c1_lo, c1_hi, c2_lo, c2_hi], stream) = knobs(data);
    let cuts = [
        point(c1_lo, c1_hi, stream.len()),
        point(c2_lo, c2_hi, stream.len()),
    ];
    let [whole, pieces, bytes] = deliveries(stream, cuts).map(|d| decode_sse(&d));
    assert_eq!(whole, pieces, "split delivery");
    assert_eq!(whole, bytes, "byte-at-a-time delivery");
    let (events, _, _) = whole;
    let n_line_ends = stream.iter().filter(|&&b| b == b'\n' || b == b'\r').count();
    assert!(2 * events.len() <= n_line_ends);
    // Each input byte becomes at most one U+FFFD (three bytes) of data.
    let n_data: usize = events.iter().map(|event| event.data.len()).sum();
    assert!(n_data <= 3 * stream.len());
    for event in &events {
        assert!(!event.event.is_empty() && !event.event.contains(['\r', '\n']));
        assert!(!event.data.contains('\r') && event.data.len() < MAX_SSE_EVENT);
        assert!(event.id.as_ref().is_none_or(|id| !id.is_empty()));
        assert!(
            !event
                .id
                .as_ref()
                .is_some_and(|id| id.contains(['\r', '\n', '\0']))
        );
        let wire = sse::encode_event(Some(&event.event), &event.data, event.id.as_deref());
        assert_eq!(
            decode_sse(&[wire.as_bytes()]).0,
            std::slice::from_ref(event),
            "re-encoded"
        );
    }
    let text = String::from_utf8_lossy(stream);
    let wire = sse::encode_event(Some(&text), &text, Some(&text));
    let flat: String = text.chars().filter(|c| !matches!(c, '\r' | '\n')).collect();
    let want = SseEvent {
        event: if flat.is_empty() {
            "message".into()
        } else {
            flat.clone()
        },
        data: text.replace("\r\n", "\n").replace('\r', "\n"),
        id: Some(flat).filter(|id| !id.is_empty() && !id.contains('\0')),
    };
    assert_eq!(decode_sse(&[wire.as_bytes()]).0, [want], "encoded text");
}

/// JSON-RPC lines as stdio splits them: blank lines are skipped and nothing else is;
/// refusals carry the spec's codes; a parsed message serialises to exactly one line that
/// parses back to the same message.
pub fn jsonrpc(data: &[u8]) {
    for line in data.split(|&b| b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let parsed = jsonrpc::parse(line);
        let blank = line.iter().all(u8::is_ascii_whitespace);
        assert_eq!(matches!(parsed, Ok(None)), blank);
        match parsed {
            Ok(None) => {}
            Ok(Some(message)) => {
                let wire = jsonrpc::to_line(&message);
                let body = wire.strip_suffix(b"\n").expect("a line ends in a newline");
                assert!(!body.contains(&b'\n'), "one message, one line");
                assert_eq!(jsonrpc::parse(body), Ok(Some(message)), "round trip");
            }
            Err(invalid) => assert!([PARSE_ERROR, INVALID_REQUEST].contains(&invalid.error.code)),
        }
    }
}

/// Permission patterns (`Rule::new`) and the policy over them: only a blank pattern is
/// `Empty`; deciding never panics; `bypassPermissions` allows; a narrowing profile never
/// widens; every rule `suggested_rules` offers for a call is a valid pattern.
pub fn permission_pattern(data: &[u8]) {
    let ([rule_action, profile_action, mode, tool], rest) = knobs(data);
    let text = String::from_utf8_lossy(rest);
    let mut parts = text.splitn(4, '\n');
    let mut part = || parts.next().unwrap_or("");
    let (pattern, profile, tool_text, arg) = (part(), part(), part(), part());
    const TOOLS: [&str; 7] = ["Bash", "Read", "Write", "Edit", "Glob", "Grep", "WebFetch"];
    let tool = TOOLS
        .get(usize::from(tool % 8))
        .copied()
        .unwrap_or(tool_text);
    let action = |knob: u8| [Action::Allow, Action::Ask, Action::Deny][usize::from(knob % 3)];
    let mode = Mode::ALL[usize::from(mode) % Mode::ALL.len()];

    let rule = Rule::new(pattern, action(rule_action), None, RuleSource::Cli);
    let empty = matches!(rule, Err(PatternError::Empty));
    assert_eq!(empty, pattern.trim().is_empty());
    if let Err(err) = &rule {
        assert!(!err.to_string().is_empty());
    }
    let input = json!({"command": arg, "path": arg, "url": arg});
    let policy = Policy::new(
        rule.into_iter().collect(),
        mode,
        PathBuf::from("/home/u/proj"),
    );
    let base = policy.decide(tool, &input);
    if mode == Mode::BypassPermissions {
        // Only a deny rule stands in bypass mode.
        assert!(base.action == Action::Allow || base.action == Action::Deny);
    }
    if let Ok(narrowing) = Rule::new(profile, action(profile_action), None, RuleSource::Cli) {
        let narrowed = policy.narrowed(vec![narrowing], None).decide(tool, &input);
        assert!(
            strictness(narrowed.action) >= strictness(base.action),
            "a profile widened"
        );
    }
    let mut suggested = Vec::new();
    for suggestion in permissions::suggested_rules(tool, &input) {
        match Rule::new(&suggestion, Action::Allow, None, RuleSource::Session) {
            Ok(rule) => suggested.push(rule),
            Err(err) => panic!("suggested rule {suggestion:?} for {tool} {arg:?}: {err}"),
        }
    }
    // Where the call is already in the shape its rule is written in (one plain command with
    // single spaces, or a plain relative path), "always allow" must allow it again.
    let words: Vec<&str> = arg.split(' ').collect();
    let plain_command = tool == "Bash"
        && !words
            .iter()
            .any(|w| w.is_empty() || w.contains(char::is_whitespace))
        && !words[0].contains('=')
        && permissions::split_command(arg).is_some_and(|pieces| pieces == [arg]);
    let components: Vec<&str> = arg.split('/').collect();
    let plain_path = ["Read", "Write", "Edit", "Glob", "Grep"].contains(&tool)
        && !components
            .iter()
            .any(|c| c.is_empty() || *c == "." || *c == "..");
    if plain_command || plain_path {
        let policy = Policy::new(suggested, Mode::Default, PathBuf::from("/home/u/proj"));
        let decision = policy.decide(tool, &input);
        assert_eq!(
            decision.action,
            Action::Allow,
            "{tool} {arg:?}: {decision:?}"
        );
    }
}

/// The Bash splitter: pieces are non-empty and their size is bounded by the input's; two
/// commands that split on their own split, joined by a newline, into both their pieces.
pub fn shell_split(data: &[u8]) {
    let ([cut_lo, cut_hi], rest) = knobs(data);
    let command = String::from_utf8_lossy(rest);
    let chars: Vec<char> = command.chars().collect();
    if let Some(pieces) = permissions::split_command(&command) {
        assert!(pieces.len() <= chars.len());
        assert!(pieces.iter().all(|piece| !piece.is_empty()));
        // A character is copied into its own piece and into the text of each substitution
        // around it (at most the splitter's 16 levels), and a redirection adds one space.
        let n_out: usize = pieces.iter().map(|piece| piece.chars().count()).sum();
        assert!(
            n_out <= 18 * chars.len(),
            "{n_out} characters out of {}",
            chars.len()
        );
    }
    let cut = point(cut_lo, cut_hi, chars.len());
    let first: String = chars[..cut].iter().collect();
    let second: String = chars[cut..].iter().collect();
    let escapes_newline = first.chars().rev().take_while(|&c| c == '\\').count() % 2 == 1;
    if let (Some(mut a), Some(b), false) = (
        permissions::split_command(&first),
        permissions::split_command(&second),
        escapes_newline,
    ) {
        a.extend(b);
        let joined = permissions::split_command(&format!("{first}\n{second}"));
        assert_eq!(joined, Some(a), "{first:?} then {second:?}");
    }
}

/// Session files, which may be cut at any byte or damaged: a partial last line is ignored;
/// a file cut short loads a prefix of the events; a damaged line ends the readable prefix, so
/// no event after it is returned; every event the log counts can be read, alone or in
/// batches within the limits asked for.
pub fn session_file(data: &[u8]) {
    let ([cut_lo, cut_hi, from, max_events, max_bytes], file) = knobs(data);
    let limits = (
        u64::from(from),
        usize::from(max_events),
        usize::from(max_bytes) * 16,
    );
    let whole_lines = |bytes: &[u8]| bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    let full = load_session(file, limits);
    let prefix = load_session(&file[..whole_lines(file)], limits);
    same_load(&full, &prefix, "a partial last line");

    let cut = point(cut_lo, cut_hi, file.len());
    match (&full, load_session(&file[..cut], limits)) {
        (Ok(full), Ok(short)) => {
            assert!(full.events.starts_with(&short.events), "cut at {cut}");
            assert!(short.header.is_null() || short.header == full.header);
        }
        (Ok(_), Err(err)) => panic!("cut at {cut}: {err}"),
        (Err(_), _) => {}
    }

    let boundary = whole_lines(&file[..cut]);
    let mut damaged = file[..boundary].to_vec();
    damaged.extend_from_slice(b"\xff\n");
    damaged.extend_from_slice(&file[boundary..]);
    let before = load_session(&file[..boundary], limits);
    same_load(&load_session(&damaged, limits), &before, "damage");
}

/// Splits the first `N` bytes off as knobs (zero where the input is shorter).
fn knobs<const N: usize>(data: &[u8]) -> ([u8; N], &[u8]) {
    let mut knobs = [0; N];
    let n = data.len().min(N);
    knobs[..n].copy_from_slice(&data[..n]);
    (knobs, &data[n..])
}

/// A point in `0..=len` chosen by a 16-bit knob; every point is reachable while `len` fits
/// in 16 bits.
fn point(lo: u8, hi: u8, len: usize) -> usize {
    usize::from(u16::from_le_bytes([lo, hi])) * len / usize::from(u16::MAX)
}

/// `payload` with `run` copies of `fill` inserted at `at`, so a short input can reach a
/// byte cap that mutations alone would take very long to grow into.
fn stretch(payload: &[u8], at: usize, run: usize, fill: u8) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + run);
    out.extend_from_slice(&payload[..at]);
    out.resize(at + run, fill);
    out.extend_from_slice(&payload[at..]);
    out
}

/// Whole; in three pieces at two cuts; one byte at a time (one empty piece when there is no
/// byte, so every delivery makes at least one call).
fn deliveries(input: &[u8], [c1, c2]: [usize; 2]) -> [Vec<&[u8]>; 3] {
    let (lo, hi) = (c1.min(c2), c1.max(c2));
    let pieces = vec![&input[..lo], &input[lo..hi], &input[hi..]];
    let bytes = if input.is_empty() {
        vec![input]
    } else {
        input.chunks(1).collect()
    };
    [vec![input], pieces, bytes]
}

fn check_head<T: Clone + PartialEq + Debug>(
    buf: &[u8],
    cuts: [usize; 2],
    parse: fn(&[u8]) -> Result<Parsed<T>, HeadError>,
    check: impl Fn(&T),
) {
    let whole = parse(buf);
    match &whole {
        Ok(Parsed::Partial) => assert!(buf.len() < MAX_HEAD_BYTES, "partial at the cap"),
        Ok(Parsed::Complete(head, n)) => {
            assert!(*n <= buf.len().min(MAX_HEAD_BYTES), "consumed {n}");
            assert_eq!(buf.get(n.wrapping_sub(1)), Some(&b'\n'));
            assert_eq!(parse(&buf[..*n]), whole, "a head depends only on its bytes");
            check(head);
        }
        Err(HeadError::TooLarge) => assert!(buf.len() >= MAX_HEAD_BYTES),
        Err(_) => {}
    }
    let (lo, hi) = (cuts[0].min(cuts[1]), cuts[0].max(cuts[1]));
    let mut answer = Ok(Parsed::Partial);
    for end in [lo, hi, buf.len()] {
        answer = parse(&buf[..end]);
        if answer != Ok(Parsed::Partial) {
            break;
        }
    }
    assert_eq!(answer, whole, "reads ending at {lo} and {hi}");
}

fn check_fields(headers: &[(String, String)]) {
    assert!(headers.len() <= MAX_HEADERS);
    for (name, value) in headers {
        assert!(!name.is_empty() && !name.contains(|c: char| c == ':' || c.is_whitespace()));
        assert!(!value.contains(['\r', '\n', '\0']));
        assert_eq!(value.trim_matches([' ', '\t']), value);
    }
}

#[derive(Debug, PartialEq)]
struct BodyRun {
    body: Vec<u8>,
    consumed: usize,
    /// Whether the body completed, or why it failed.
    result: Result<bool, BodyError>,
}

/// Feeds `pieces` the way a reader does (unconsumed bytes are offered again with the next
/// read), checking each call.
fn decode_body(kind: BodyKind, cap: u64, pieces: &[&[u8]]) -> BodyRun {
    let mut decoder = BodyDecoder::new(kind, cap);
    let (mut buf, mut body) = (Vec::new(), Vec::new());
    let mut run = BodyRun {
        body: Vec::new(),
        consumed: 0,
        result: Ok(decoder.is_complete()),
    };
    // Bytes consumed one at a time since the body last grew: framing held or skipped.
    let mut quiet = 0;
    for piece in pieces {
        buf.extend_from_slice(piece);
        let before = body.len();
        let res = decoder.decode(&buf, &mut body);
        assert!(
            body.len() as u64 <= cap,
            "{} body bytes over a cap of {cap}",
            body.len()
        );
        let (n, complete) = match res {
            Ok(answer) => answer,
            Err(err) => {
                let n_body = body.len();
                assert_eq!(decoder.decode(b"0\r\n\r\n", &mut body), Err(err.clone()));
                assert_eq!(
                    (decoder.finish_eof(), body.len()),
                    (Err(err.clone()), n_body)
                );
                run.result = Err(err);
                return run;
            }
        };
        let grew = body.len() - before;
        assert!(
            n <= buf.len() && grew <= n,
            "{n} of {} consumed, {grew} out",
            buf.len()
        );
        assert_eq!(complete, decoder.is_complete());
        if buf.len() == 1 && n == 1 {
            if grew == 0 {
                quiet += 1;
            } else {
                // CRLF after data, a size line up to its cap, its LF.
                assert!(
                    quiet <= MAX_CHUNK_LINE + 3,
                    "{quiet} framing bytes before data"
                );
                quiet = 0;
            }
        }
        buf.drain(..n);
        run.consumed += n;
        run.result = Ok(complete);
        if complete {
            // Nothing past the end is taken.
            assert_eq!(decoder.decode(&buf, &mut body), Ok((0, true)));
            break;
        }
    }
    assert!(
        quiet <= MAX_CHUNK_LINE + 3 + MAX_TRAILER_BYTES,
        "{quiet} framing bytes"
    );
    let eof = decoder.finish_eof();
    match run.result {
        Ok(false) if kind != BodyKind::UntilClose => assert_eq!(eof, Err(BodyError::Truncated)),
        _ => assert_eq!(eof, Ok(())),
    }
    run.body = body;
    run
}

type SseRun = (Vec<SseEvent>, Result<(), sse::SseError>, Option<String>);

fn decode_sse(pieces: &[&[u8]]) -> SseRun {
    let mut decoder = SseDecoder::new();
    let mut events = Vec::new();
    let mut res = Ok(());
    for piece in pieces {
        res = decoder.feed(piece, &mut events);
        if res.is_err() {
            break;
        }
    }
    (events, res, decoder.last_event_id().map(str::to_owned))
}

fn strictness(action: Action) -> u8 {
    match action {
        Action::Allow => 0,
        Action::Ask => 1,
        Action::Deny => 2,
    }
}

/// What a loaded session shows its readers.
#[derive(Debug, PartialEq)]
struct Session {
    header: Value,
    events: Vec<String>,
    status: Option<Value>,
    messages: Vec<Value>,
}

thread_local! {
    /// One sessions directory per thread (tests run in parallel), reused across inputs.
    static STORE: RefCell<Option<(SessionStore, PathBuf)>> = const { RefCell::new(None) };
}

/// Loads `bytes` as a run's session file and reads every event back, checking the reads.
fn load_session(bytes: &[u8], limits: (u64, usize, usize)) -> io::Result<Session> {
    static DIRS: AtomicUsize = AtomicUsize::new(0);
    STORE.with_borrow_mut(|store| {
        let (store, dir) = match store {
            Some(store) => store,
            None => {
                let n = DIRS.fetch_add(1, Ordering::Relaxed);
                let name = format!("caliban-fuzz-sessions-{}-{n}", std::process::id());
                let dir = std::env::temp_dir().join(name);
                store.insert((SessionStore::open(dir.clone())?, dir))
            }
        };
        let path = dir.join("run-1.jsonl");
        fs::write(&path, bytes)?;
        let session = store.load("run-1").map(|log| read_back(&log, limits));
        fs::remove_file(&path)?;
        session
    })
}

/// Every event of a loaded log, read in full, one by one and in one batch within limits.
fn read_back(log: &EventLog, (from, max_events, max_bytes): (u64, usize, usize)) -> Session {
    let all = log
        .read(0, usize::MAX, usize::MAX)
        .expect("every counted event reads");
    assert_eq!(all.len() as u64, log.len());
    for (i, (cursor, text)) in all.iter().enumerate() {
        assert_eq!(*cursor, i as u64);
        assert!(
            serde_json::from_str::<Value>(text).is_ok(),
            "event {i} is JSON"
        );
        assert_eq!(
            log.read(*cursor, 1, 0).expect("read one"),
            [(*cursor, text.clone())]
        );
    }
    assert!(
        log.read(log.len(), 1, usize::MAX)
            .expect("read past the end")
            .is_empty()
    );
    // A batch: at most `max_events` and `max_bytes`, except that the first always comes.
    let batch = log.read(from, max_events, max_bytes).expect("read a batch");
    let mut want = Vec::new();
    let mut n_bytes = 0;
    for (cursor, text) in all.iter().skip(usize::try_from(from).unwrap_or(usize::MAX)) {
        let fits = want.len() < max_events && n_bytes + text.len() <= max_bytes;
        if !fits && !want.is_empty() {
            break;
        }
        n_bytes += text.len();
        want.push((*cursor, text.clone()));
    }
    assert_eq!(batch, want, "batch from {from}");
    Session {
        header: log.header().clone(),
        events: all.iter().map(|(_, text)| text.to_string()).collect(),
        status: log.last_status().cloned(),
        messages: log.messages().expect("messages of a loaded log"),
    }
}

fn same_load(a: &io::Result<Session>, b: &io::Result<Session>, what: &str) {
    match (a, b) {
        (Ok(a), Ok(b)) => assert_eq!(a, b, "{what}"),
        (Err(a), Err(b)) => assert_eq!(a.kind(), b.kind(), "{what}"),
        _ => panic!("{what}: {a:?} against {b:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every file under `fuzz/seeds/<target>/` passes its target, so an input kept there
    /// (a finding included) is checked again by `cargo test`.
    #[test]
    fn seed_corpus_passes_every_target() {
        let seeds = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds");
        for (name, target) in TARGETS {
            let mut n_seeds = 0;
            for entry in fs::read_dir(seeds.join(name)).expect("a seed directory per target") {
                let path = entry.expect("seed entry").path();
                let input = fs::read(&path).expect("read seed");
                let res = std::panic::catch_unwind(|| target(&input));
                assert!(res.is_ok(), "{name} failed on {}", path.display());
                n_seeds += 1;
            }
            assert!(n_seeds > 0, "{name} has no seeds");
        }
        if let Some((_, dir)) = STORE.take() {
            let _ = fs::remove_dir_all(dir);
        }
    }
}
