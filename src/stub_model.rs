//! `caliban stub-model`: a loopback HTTP/1.1 server that plays a JSON script of model turns
//! over the real Anthropic Messages and OpenAI Chat Completions streaming wires, and injects
//! faults on demand. Tests, benchmarks and integrators point `ANTHROPIC_BASE_URL` or
//! `OPENAI_BASE_URL` at it to run caliban offline and deterministically.
//!
//! It is a test tool, so it uses plain blocking `std::net` I/O with one thread per connection
//! (no reactor); it reuses the project's sans-IO HTTP codecs (`crate::http`) for framing.
//!
//! # Script format
//!
//! ```json
//! {"turns": [TURN, ...], "repeat_last": false}
//! ```
//!
//! Every model request that completes a turn uses it up (see `match` and `reuse` below for
//! the exceptions). When no turn is left for a request the server answers HTTP 500 with the
//! provider's error envelope and a message starting `stub-model script exhausted`, unless
//! `"repeat_last": true`, which replays the last turn forever (with fresh message and tool
//! ids) to every request it matches. Unknown fields are errors, so a typo in a script fails
//! loudly instead of being ignored.
//!
//! ```text
//! TURN = {
//!   "thinking":    "…",        optional; a thinking block (Anthropic) / reasoning_content (OpenAI)
//!   "text":        "…",        optional; streamed a few words per delta
//!   "stamps":      N,          optional; after the text, N more text deltas, each
//!                              `@` and the time it is written (19 digits, ns since the
//!                              Unix epoch) then a space: relay benchmarks measure the
//!                              latency from this byte to their client's
//!   "tool_calls":  [{"id": "toolu_1"?, "name": "Read", "input": {…}?}, …],   optional
//!   "stop_reason": "end_turn" | "tool_use" | "max_tokens" | "refusal",
//!                              optional; default "tool_use" when tool_calls is non-empty,
//!                              else "end_turn" (OpenAI finish_reason: stop, tool_calls,
//!                              length, content_filter)
//!   "usage": {"input_tokens": N?, "output_tokens": N?, "cache_read_input_tokens": N?,
//!             "cache_creation_input_tokens": N?},
//!                              optional; defaults: input ≈ request bytes / 4, output ≈
//!                              streamed characters / 4, cache fields 0. On the OpenAI wire
//!                              prompt_tokens = input + cache_read + cache_creation and
//!                              prompt_tokens_details.cached_tokens = cache_read
//!   "model":       "…",        optional; default: the request's "model"
//!   "faults":      [FAULT, …]  optional
//!   "match":       {"tools": true | false?, "model": "…"?},
//!                              optional; the turn serves only requests that offer tools (a
//!                              non-empty "tools" array) or offer none, and/or that ask for
//!                              exactly this model
//!   "reuse":       true        optional; the turn is never used up: it answers every request
//!                              it matches (with fresh ids), and later turns stay reachable
//! }
//! ```
//!
//! A request is served by the first turn, in script order, that is not used up and whose
//! `match` accepts it; a turn without `match` accepts every request. Without `match` and
//! `reuse` that is simply the next turn. With them, a script can answer an agent's side
//! requests, which may arrive at any point and in any order against its main loop: Claude
//! Code, for one, asks for a session title without tools while it asks for the turn with
//! them, so a script gives its main turns `"match": {"tools": true}` and ends with
//! `{"match": {"tools": false}, "reuse": true, "text": "{\"title\": \"…\"}"}`. A reusable
//! turn without `match` answers everything after it is reached, so put it last.
//!
//! Default tool ids are `toolu_stub_<R>_<I>` (Anthropic) and `call_stub_<R>_<I>` (OpenAI),
//! where `R` counts streamed responses from 1 and `I` is the call's position in the turn.
//! Message ids are `msg_stub_<R>` and `chatcmpl-stub<R>`.
//!
//! Faults apply to the first requests that reach their turn, one fault per request, in order.
//! A status fault (and a `hang_up`) does not consume the turn, so the client's retry meets
//! the next fault or finally the real turn; every other fault consumes it.
//!
//! ```text
//! FAULT = {"status": 529, "retry_after": "1"?, "body": "…"?}
//!             that HTTP status with the provider's error envelope (Anthropic 529
//!             overloaded_error, 429 rate_limit_error, 500 api_error, …; OpenAI
//!             {"error":{"message","type","param","code"}}), Content-Length framed, with a
//!             retry-after header when given; "body" replaces the envelope verbatim
//!       | {"hang_up": true}          close the connection without a byte of response, as a
//!                                    server does to a keep-alive connection it just timed out
//!       | {"delay_ms": N}            wait N ms before the first response byte, then serve the turn
//!       | {"drip_ms": N}             serve the turn with N ms between SSE events
//!       | {"start_at_ms": N}         hold the first response byte until N ms after the Unix
//!                                    epoch (then `delay_ms`): streams of many connections
//!                                    begin at one instant, however their requests trickled in
//!       | {"drop_after_events": N}   send N SSE events, then close the socket mid-stream
//!       | {"stall_after_events": N}  send N SSE events, then go silent with the socket open
//!                                    until the client closes it (idle-timeout tests)
//!       | {"ping_after_events": N}   send N SSE events, then only keep-alives every 100 ms
//!                                    until the client closes the socket: `event: ping` on
//!                                    the Anthropic wire, a `: ping` comment on OpenAI's
//!       | {"repeat_after_events": N} send N SSE events (N ≥ 1), then send the last of them
//!                                    again every 100 ms until the client closes the socket:
//!                                    a text delta repeated is real output that never ends
//!       | {"close_after": true}      serve the whole turn (its head says keep-alive), then
//!                                    close the connection: a server whose idle timeout is 0
//! ```
//!
//! `start_at_ms`, `delay_ms`, `drip_ms`, `close_after` and one of the four `…_after_events` may
//! be combined in one fault; `status` and `hang_up` stand alone. Events are counted as SSE events, `data: [DONE]`
//! included; a count past the end sends the whole stream but never its terminating chunk.
//!
//! # Routes
//!
//! - `POST …/v1/messages`: Anthropic Messages SSE. Requires the `anthropic-version` header and
//!   `model`, `max_tokens`, `messages` in the body.
//! - `POST …/chat/completions`: OpenAI chat.completion.chunk SSE. Requires `model` and
//!   `messages`; a usage chunk is sent when `stream_options.include_usage` is true.
//! - Any prefix before those suffixes is ignored, so base URLs with or without `/v1` work.
//!   Both require `"stream": true`; a bad request gets 400 with the provider's envelope and
//!   does not touch the script.
//! - `GET /_stub/requests`: JSON array of every request received so far (the `/_stub/` routes
//!   excepted), each `{"method","path","headers":{lowercased name: value},"body","connection"}`,
//!   where `body` is the parsed JSON, or a string when it is not JSON, or null when empty, and
//!   `connection` numbers the connection it came on (accepted connections count from 1), so
//!   a test can tell which requests shared one.
//! - `GET /_stub/health`: 200 `ok`. Anything else: 404.
//!
//! Responses are chunked `text/event-stream` on keep-alive connections; pipelined requests are
//! answered in order. Request bodies are capped at [`MAX_REQUEST_BODY`] (413 past it). API keys
//! (`x-api-key`, `authorization`) are not checked, only recorded. Error responses carry
//! `request-id` (Anthropic) or `x-request-id` (OpenAI) as `req_stub_<N>`.
//!
//! # Running it
//!
//! `caliban stub-model --script FILE [--addr 127.0.0.1:0]` binds loopback only, prints one
//! line, `listening on http://127.0.0.1:PORT`, and serves until killed; when its stdin is a
//! pipe it also exits once that pipe reaches EOF (a parent that spawned it with a piped stdin
//! and went away). Each model request logs one line on stderr. Tests and benchmarks can embed
//! it instead: `serve(TcpListener::bind("127.0.0.1:0")?, Script::parse(json)?)` on a thread.

use std::collections::VecDeque;
use std::fs;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread;
use std::time::Duration;

use serde_json::{Map, Value};

use crate::http::body::{BodyDecoder, BodyError};
use crate::http::head::{self, BodyKind, HeadError, Parsed, RequestHead};
use crate::http::sse::encode_event;
use crate::http::write::{LAST_CHUNK, chunk, response_head};

/// Largest request body accepted; larger ones get 413 and the connection is closed.
pub const MAX_REQUEST_BODY: u64 = 16 * 1024 * 1024;
/// Bytes asked of the socket per read.
const READ_CHUNK: usize = 64 * 1024;
/// Most requests kept for `GET /_stub/requests`, and most body bytes among them; past either,
/// the oldest are forgotten so a long benchmark cannot grow the stub without bound.
const MAX_LOGGED_REQUESTS: usize = 10_000;
const MAX_LOGGED_BYTES: usize = 64 * 1024 * 1024;
/// How often `ping_after_events` sends a keep-alive and `repeat_after_events` its event:
/// far more often than any idle timeout a test sets, so only a client that ignores them
/// as progress can time out.
const KEEPALIVE_INTERVAL: Duration = Duration::from_millis(100);
/// Stack of a connection thread: enough for serde_json's 128-level nesting limit, small
/// enough for a thousand concurrent connections.
const CONN_STACK_BYTES: usize = 512 * 1024;
/// Most stamped deltas one turn may ask for.
const MAX_STAMPS: u64 = 1_000_000;
/// A stamped delta's text until it is written: the placeholder is as long as the stamp
/// (`stamp_now`) and unlike anything else a turn streams.
const STAMPED_DELTA: &str = "@0000000000000000000 ";
/// Words per streamed text or thinking delta.
const WORDS_PER_DELTA: usize = 3;
/// `created` stamp on OpenAI chunks: fixed so that transcripts are byte-for-byte reproducible.
const CREATED: u64 = 1_735_689_600;

/// Arguments of `caliban stub-model`.
#[derive(Clone, Debug)]
pub struct StubArgs {
    pub script: PathBuf,
    /// Loopback address to bind; `127.0.0.1:0` picks a free port.
    pub addr: String,
}

impl Default for StubArgs {
    fn default() -> StubArgs {
        StubArgs {
            script: PathBuf::new(),
            addr: "127.0.0.1:0".to_string(),
        }
    }
}

/// Loads the script, binds a loopback listener, prints `listening on http://ADDR` on stdout
/// and serves until the process is killed (or until stdin, when it is a pipe, reaches EOF).
pub fn run(args: &StubArgs) -> Result<(), String> {
    let shown = args.script.display();
    let text = fs::read_to_string(&args.script).map_err(|e| format!("{shown}: {e}"))?;
    let script = Script::parse(&text).map_err(|e| format!("{shown}: {e}"))?;
    let addrs: Vec<SocketAddr> = args
        .addr
        .to_socket_addrs()
        .map_err(|e| format!("bad address {:?}: {e}", args.addr))?
        .collect();
    if addrs.is_empty() {
        return Err(format!("bad address {:?}: resolves to nothing", args.addr));
    }
    if let Some(remote) = addrs.iter().find(|a| !a.ip().to_canonical().is_loopback()) {
        return Err(format!(
            "refusing to bind {remote}: stub-model only listens on loopback addresses"
        ));
    }
    let listener =
        TcpListener::bind(&addrs[..]).map_err(|e| format!("bind {:?}: {e}", args.addr))?;
    let local = listener
        .local_addr()
        .map_err(|e| format!("bind {:?}: {e}", args.addr))?;
    {
        let mut out = io::stdout().lock();
        writeln!(out, "listening on http://{local}")
            .and_then(|()| out.flush())
            .map_err(|e| format!("stdout: {e}"))?;
    }
    exit_on_stdin_eof();
    serve(listener, script).map_err(|e| format!("accept: {e}"))
}

/// When stdin is a pipe, a parent that goes away closes it: treat EOF as the signal to exit,
/// like the ACP agent does. A terminal or `/dev/null` stdin is left alone.
fn exit_on_stdin_eof() {
    use std::os::fd::AsFd;
    use std::os::unix::fs::FileTypeExt;

    let Ok(fd) = io::stdin().as_fd().try_clone_to_owned() else {
        return;
    };
    let mut file = fs::File::from(fd);
    let is_pipe = file.metadata().is_ok_and(|m| m.file_type().is_fifo());
    if !is_pipe {
        return;
    }
    let spawned = thread::Builder::new()
        .name("stub-stdin".to_string())
        .spawn(move || {
            let mut sink = [0u8; 4096];
            loop {
                match file.read(&mut sink) {
                    Ok(0) => std::process::exit(crate::exit::OK.into()),
                    Ok(_) => continue,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(_) => return,
                }
            }
        });
    drop(spawned);
}

/// Serves `script` on `listener` forever, one thread per connection. Returns only when the
/// listener itself fails.
pub fn serve(listener: TcpListener, script: Script) -> io::Result<()> {
    let shared = Arc::new(Shared::new(script));
    let mut accepted = 0u64;
    loop {
        let stream = match listener.accept() {
            Ok((stream, _peer)) => stream,
            Err(e) if is_transient_accept_error(&e) => {
                // Out of fds or a peer that reset before accept: the listener is fine, so
                // back off briefly instead of spinning.
                thread::sleep(Duration::from_millis(10));
                continue;
            }
            Err(e) => return Err(e),
        };
        let conn_shared = Arc::clone(&shared);
        accepted += 1;
        let number = accepted;
        let spawned = thread::Builder::new()
            .name("stub-conn".to_string())
            .stack_size(CONN_STACK_BYTES)
            .spawn(move || on_connection(stream, &conn_shared, number));
        if let Err(e) = spawned {
            eprintln!("stub-model: cannot spawn a connection thread: {e}");
        }
    }
}

fn is_transient_accept_error(e: &io::Error) -> bool {
    use io::ErrorKind::*;
    if matches!(
        e.kind(),
        Interrupted | WouldBlock | ConnectionAborted | ConnectionReset
    ) {
        return true;
    }
    // ENOMEM, ENFILE, EMFILE and ENOBUFS on Linux: resource exhaustion that may pass.
    matches!(e.raw_os_error(), Some(12 | 23 | 24 | 105))
}

// ---------------------------------------------------------------------------------------------
// Script

/// A parsed, validated script of model turns.
#[derive(Clone, Debug)]
pub struct Script {
    turns: Vec<Turn>,
    repeat_last: bool,
}

#[derive(Clone, Debug)]
struct Turn {
    thinking: Option<String>,
    text: Option<String>,
    /// Text deltas stamped with their send time, after `text`.
    stamps: u64,
    tool_calls: Vec<ToolCall>,
    stop_reason: StopReason,
    usage: UsageSpec,
    model: Option<String>,
    faults: Vec<Fault>,
    /// Which requests the turn answers.
    accepts: Match,
    /// Never used up.
    reuse: bool,
}

/// A turn's `match`: what a request must be for the turn to answer it. Empty accepts all.
#[derive(Clone, Debug, Default)]
struct Match {
    /// Whether the request offers tools (a non-empty `tools` array).
    tools: Option<bool>,
    /// The request's `model`, exactly.
    model: Option<String>,
}

impl Match {
    fn accepts(&self, body: &Map<String, Value>) -> bool {
        let offers_tools = body
            .get("tools")
            .and_then(Value::as_array)
            .is_some_and(|tools| !tools.is_empty());
        let model = body.get("model").and_then(Value::as_str);
        self.tools.is_none_or(|want| want == offers_tools)
            && self.model.as_deref().is_none_or(|want| Some(want) == model)
    }
}

#[derive(Clone, Debug)]
struct ToolCall {
    id: Option<String>,
    name: String,
    /// Always a JSON object.
    input: Value,
}

#[derive(Clone, Copy, Debug, Default)]
struct UsageSpec {
    input_tokens: Option<u64>,
    output_tokens: Option<u64>,
    cache_read_input_tokens: Option<u64>,
    cache_creation_input_tokens: Option<u64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum StopReason {
    EndTurn,
    ToolUse,
    MaxTokens,
    Refusal,
}

impl StopReason {
    const NAMES: &[&str] = &["end_turn", "tool_use", "max_tokens", "refusal"];

    fn from_name(name: &str) -> Option<StopReason> {
        match name {
            "end_turn" => Some(StopReason::EndTurn),
            "tool_use" => Some(StopReason::ToolUse),
            "max_tokens" => Some(StopReason::MaxTokens),
            "refusal" => Some(StopReason::Refusal),
            _ => None,
        }
    }

    fn anthropic(self) -> &'static str {
        match self {
            StopReason::EndTurn => "end_turn",
            StopReason::ToolUse => "tool_use",
            StopReason::MaxTokens => "max_tokens",
            StopReason::Refusal => "refusal",
        }
    }

    fn openai(self) -> &'static str {
        match self {
            StopReason::EndTurn => "stop",
            StopReason::ToolUse => "tool_calls",
            StopReason::MaxTokens => "length",
            StopReason::Refusal => "content_filter",
        }
    }
}

#[derive(Clone, Debug)]
enum Fault {
    Status(StatusFault),
    /// Close the connection before any response byte.
    HangUp,
    Stream(StreamFault),
}

#[derive(Clone, Debug)]
struct StatusFault {
    status: u16,
    retry_after: Option<String>,
    body: Option<String>,
}

#[derive(Clone, Copy, Debug, Default)]
struct StreamFault {
    /// Unix time in ms before which no byte goes out; 0: none.
    start_at_ms: u64,
    delay_ms: u64,
    drip_ms: u64,
    cut: Option<Cut>,
    /// Close the connection after the whole response, whatever its head said.
    close_after: bool,
}

/// How a faulted stream ends early: after this many SSE events.
#[derive(Clone, Copy, Debug)]
enum Cut {
    Drop(u64),
    Stall(u64),
    /// Keep-alives only, forever.
    Ping(u64),
    /// The last event sent, again and again.
    Repeat(u64),
}

/// The fields that cut a stream short, one of which a fault may hold.
const CUTS: [&str; 4] = [
    "drop_after_events",
    "stall_after_events",
    "ping_after_events",
    "repeat_after_events",
];

impl Script {
    /// Parses and validates a script; errors name the offending spot, e.g.
    /// `turns[1].faults[0]: unknown field "stauts"`.
    pub fn parse(json: &str) -> Result<Script, String> {
        let root: Value = serde_json::from_str(json).map_err(|e| format!("invalid JSON: {e}"))?;
        let obj = as_object(&root, "script")?;
        check_keys(obj, "script", &["turns", "repeat_last"])?;
        let turns_json = match obj.get("turns") {
            Some(Value::Array(turns)) => turns,
            Some(_) => return Err("script: \"turns\" must be an array".to_string()),
            None => return Err("script: missing \"turns\" array".to_string()),
        };
        let repeat_last = match obj.get("repeat_last") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err("script: \"repeat_last\" must be true or false".to_string()),
        };
        let turns = turns_json
            .iter()
            .enumerate()
            .map(|(i, t)| parse_turn(t, &format!("turns[{i}]")))
            .collect::<Result<Vec<Turn>, String>>()?;
        if repeat_last && turns.is_empty() {
            return Err("script: \"repeat_last\" needs at least one turn".to_string());
        }
        Ok(Script { turns, repeat_last })
    }

    /// Number of turns in the script.
    #[cfg(test)]
    pub fn turn_count(&self) -> usize {
        self.turns.len()
    }
}

fn parse_turn(value: &Value, at: &str) -> Result<Turn, String> {
    let obj = as_object(value, at)?;
    check_keys(
        obj,
        at,
        &[
            "thinking",
            "text",
            "stamps",
            "tool_calls",
            "stop_reason",
            "usage",
            "model",
            "faults",
            "match",
            "reuse",
        ],
    )?;
    let thinking = opt_string(obj, "thinking", at)?.filter(|s| !s.is_empty());
    let text = opt_string(obj, "text", at)?.filter(|s| !s.is_empty());
    let stamps = opt_u64(obj, "stamps", at)?.unwrap_or(0);
    if stamps > MAX_STAMPS {
        return Err(format!("{at}: \"stamps\" is at most {MAX_STAMPS}"));
    }
    let tool_calls = match obj.get("tool_calls") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(calls)) => calls
            .iter()
            .enumerate()
            .map(|(i, c)| parse_tool_call(c, &format!("{at}.tool_calls[{i}]")))
            .collect::<Result<Vec<ToolCall>, String>>()?,
        Some(_) => return Err(format!("{at}: \"tool_calls\" must be an array")),
    };
    let stop_reason = match opt_string(obj, "stop_reason", at)? {
        Some(name) => StopReason::from_name(&name).ok_or_else(|| {
            format!(
                "{at}: unknown stop_reason {name:?} (expected one of: {})",
                StopReason::NAMES.join(", ")
            )
        })?,
        None if tool_calls.is_empty() => StopReason::EndTurn,
        None => StopReason::ToolUse,
    };
    let usage = match obj.get("usage") {
        None | Some(Value::Null) => UsageSpec::default(),
        Some(value) => {
            let usage_at = format!("{at}.usage");
            let usage = as_object(value, &usage_at)?;
            check_keys(
                usage,
                &usage_at,
                &[
                    "input_tokens",
                    "output_tokens",
                    "cache_read_input_tokens",
                    "cache_creation_input_tokens",
                ],
            )?;
            UsageSpec {
                input_tokens: opt_u64(usage, "input_tokens", &usage_at)?,
                output_tokens: opt_u64(usage, "output_tokens", &usage_at)?,
                cache_read_input_tokens: opt_u64(usage, "cache_read_input_tokens", &usage_at)?,
                cache_creation_input_tokens: opt_u64(
                    usage,
                    "cache_creation_input_tokens",
                    &usage_at,
                )?,
            }
        }
    };
    let model = opt_string(obj, "model", at)?;
    let faults = match obj.get("faults") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(faults)) => faults
            .iter()
            .enumerate()
            .map(|(i, f)| parse_fault(f, &format!("{at}.faults[{i}]")))
            .collect::<Result<Vec<Fault>, String>>()?,
        Some(_) => return Err(format!("{at}: \"faults\" must be an array")),
    };
    let accepts = match obj.get("match") {
        None | Some(Value::Null) => Match::default(),
        Some(value) => {
            let match_at = format!("{at}.match");
            let fields = as_object(value, &match_at)?;
            check_keys(fields, &match_at, &["tools", "model"])?;
            let tools = match fields.get("tools") {
                None | Some(Value::Null) => None,
                Some(Value::Bool(b)) => Some(*b),
                Some(_) => return Err(format!("{match_at}: \"tools\" must be true or false")),
            };
            let model = opt_string(fields, "model", &match_at)?;
            Match { tools, model }
        }
    };
    let reuse = match obj.get("reuse") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(format!("{at}: \"reuse\" must be true or false")),
    };
    Ok(Turn {
        thinking,
        text,
        stamps,
        tool_calls,
        stop_reason,
        usage,
        model,
        faults,
        accepts,
        reuse,
    })
}

fn parse_tool_call(value: &Value, at: &str) -> Result<ToolCall, String> {
    let obj = as_object(value, at)?;
    check_keys(obj, at, &["id", "name", "input"])?;
    let name = opt_string(obj, "name", at)?
        .filter(|n| !n.is_empty())
        .ok_or_else(|| format!("{at}: missing \"name\""))?;
    let id = opt_string(obj, "id", at)?.filter(|s| !s.is_empty());
    let input = match obj.get("input") {
        None | Some(Value::Null) => Value::Object(Map::new()),
        Some(input @ Value::Object(_)) => input.clone(),
        Some(_) => return Err(format!("{at}: \"input\" must be a JSON object")),
    };
    Ok(ToolCall { id, name, input })
}

fn parse_fault(value: &Value, at: &str) -> Result<Fault, String> {
    let obj = as_object(value, at)?;
    check_keys(
        obj,
        at,
        &[
            "status",
            "retry_after",
            "body",
            "delay_ms",
            "drip_ms",
            "start_at_ms",
            "drop_after_events",
            "stall_after_events",
            "ping_after_events",
            "repeat_after_events",
            "hang_up",
            "close_after",
        ],
    )?;
    if opt_bool(obj, "hang_up", at)? {
        if let Some(other) = obj.keys().find(|k| k.as_str() != "hang_up") {
            return Err(format!(
                "{at}: \"hang_up\" cannot be combined with \"{other}\" (use two faults)"
            ));
        }
        return Ok(Fault::HangUp);
    }
    if let Some(status) = opt_u64(obj, "status", at)? {
        if let Some(other) = ["delay_ms", "drip_ms", "start_at_ms", "close_after"]
            .iter()
            .chain(CUTS.iter())
            .find(|k| obj.contains_key(**k))
        {
            return Err(format!(
                "{at}: \"status\" cannot be combined with \"{other}\" (use two faults)"
            ));
        }
        let status = u16::try_from(status)
            .ok()
            .filter(|s| (400..=599).contains(s))
            .ok_or_else(|| format!("{at}: \"status\" must be between 400 and 599"))?;
        let retry_after = match obj.get("retry_after") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) if !s.is_empty() && !s.contains(['\r', '\n']) => Some(s.clone()),
            Some(Value::Number(n)) => Some(n.to_string()),
            Some(_) => return Err(format!("{at}: \"retry_after\" must be a string or number")),
        };
        let body = opt_string(obj, "body", at)?;
        return Ok(Fault::Status(StatusFault {
            status,
            retry_after,
            body,
        }));
    }
    if let Some(key) = ["retry_after", "body"]
        .iter()
        .find(|k| obj.contains_key(**k))
    {
        return Err(format!("{at}: \"{key}\" only goes with \"status\""));
    }
    let given: Vec<&str> = CUTS
        .iter()
        .copied()
        .filter(|k| obj.contains_key(*k))
        .collect();
    if let [first, second, ..] = given.as_slice() {
        return Err(format!(
            "{at}: \"{first}\" and \"{second}\" exclude each other"
        ));
    }
    let cut = match given.first() {
        None => None,
        Some(&key) => {
            let n = opt_u64(obj, key, at)?.unwrap_or(0);
            Some(match key {
                "drop_after_events" => Cut::Drop(n),
                "stall_after_events" => Cut::Stall(n),
                "ping_after_events" => Cut::Ping(n),
                _ if n == 0 => {
                    return Err(format!("{at}: \"{key}\" needs an event to repeat (N ≥ 1)"));
                }
                _ => Cut::Repeat(n),
            })
        }
    };
    let delay_ms = opt_u64(obj, "delay_ms", at)?;
    let drip_ms = opt_u64(obj, "drip_ms", at)?;
    let start_at_ms = opt_u64(obj, "start_at_ms", at)?;
    let close_after = opt_bool(obj, "close_after", at)?;
    if cut.is_none()
        && delay_ms.is_none()
        && drip_ms.is_none()
        && start_at_ms.is_none()
        && !close_after
    {
        return Err(format!(
            "{at}: a fault needs one of \"status\", \"hang_up\", \"delay_ms\", \"drip_ms\", \
             \"start_at_ms\", \"drop_after_events\", \"stall_after_events\", \
             \"ping_after_events\", \"repeat_after_events\", \"close_after\""
        ));
    }
    Ok(Fault::Stream(StreamFault {
        start_at_ms: start_at_ms.unwrap_or(0),
        delay_ms: delay_ms.unwrap_or(0),
        drip_ms: drip_ms.unwrap_or(0),
        cut,
        close_after,
    }))
}

fn as_object<'v>(value: &'v Value, at: &str) -> Result<&'v Map<String, Value>, String> {
    value
        .as_object()
        .ok_or_else(|| format!("{at}: expected a JSON object"))
}

fn check_keys(obj: &Map<String, Value>, at: &str, allowed: &[&str]) -> Result<(), String> {
    match obj.keys().find(|k| !allowed.contains(&k.as_str())) {
        Some(key) => Err(format!(
            "{at}: unknown field {key:?} (expected one of: {})",
            allowed.join(", ")
        )),
        None => Ok(()),
    }
}

fn opt_string(obj: &Map<String, Value>, key: &str, at: &str) -> Result<Option<String>, String> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(format!("{at}: \"{key}\" must be a string")),
    }
}

/// A flag: absent or null is false; only `true` and `false` are accepted.
fn opt_bool(obj: &Map<String, Value>, key: &str, at: &str) -> Result<bool, String> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(format!("{at}: \"{key}\" must be true or false")),
    }
}

fn opt_u64(obj: &Map<String, Value>, key: &str, at: &str) -> Result<Option<u64>, String> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(value) => value
            .as_u64()
            .map(Some)
            .ok_or_else(|| format!("{at}: \"{key}\" must be a non-negative integer")),
    }
}

// ---------------------------------------------------------------------------------------------
// Shared state: where the script stands and what was received

struct Shared {
    script: Script,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Per turn, whether it was used up.
    used_up: Vec<bool>,
    /// Turns used up so far.
    n_used_up: usize,
    /// Per turn, how many of its faults were already used.
    faults_used: Vec<usize>,
    /// Requests seen on the model routes (request ids).
    n_model_requests: u64,
    /// Streams started (message and default tool ids).
    n_streams: u64,
    /// Every request except the `/_stub/` ones, as served by `GET /_stub/requests`, with the
    /// body size each entry accounts for.
    log: VecDeque<(Value, usize)>,
    log_bytes: usize,
}

/// What to do with a valid model request.
enum Plan {
    Status(StatusFault),
    HangUp,
    Stream {
        turn_idx: usize,
        fault: StreamFault,
        stream_seq: u64,
    },
    Exhausted {
        used_up: usize,
    },
}

impl Shared {
    fn new(script: Script) -> Shared {
        let state = State {
            used_up: vec![false; script.turns.len()],
            faults_used: vec![0; script.turns.len()],
            ..State::default()
        };
        Shared {
            script,
            state: Mutex::new(state),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Nothing panics while holding the lock, but a poisoned log is still a good log.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The `request-id` of the next model request: `req_stub_<N>`, counting from 1.
    fn next_request_id(&self) -> String {
        let mut st = self.lock();
        st.n_model_requests += 1;
        format!("req_stub_{}", st.n_model_requests)
    }

    /// Picks the turn that answers a valid request with this `body`: the first one in script
    /// order that is not used up and accepts it.
    fn plan(&self, body: &Map<String, Value>) -> Plan {
        let turns = &self.script.turns;
        let mut st = self.lock();
        let last = turns.len().checked_sub(1);
        let Some(turn_idx) = (0..turns.len()).find(|&i| {
            let replayed = self.script.repeat_last && Some(i) == last;
            (!st.used_up[i] || replayed) && turns[i].accepts.accepts(body)
        }) else {
            return Plan::Exhausted {
                used_up: st.n_used_up,
            };
        };
        let turn = &turns[turn_idx];
        let used = st.faults_used[turn_idx];
        let fault = match turn.faults.get(used) {
            Some(fault) => {
                st.faults_used[turn_idx] += 1;
                match fault {
                    Fault::Status(status) => return Plan::Status(status.clone()),
                    Fault::HangUp => return Plan::HangUp,
                    Fault::Stream(stream) => *stream,
                }
            }
            None => StreamFault::default(),
        };
        if !turn.reuse && !st.used_up[turn_idx] {
            st.used_up[turn_idx] = true;
            st.n_used_up += 1;
        }
        st.n_streams += 1;
        Plan::Stream {
            turn_idx,
            fault,
            stream_seq: st.n_streams,
        }
    }

    fn record(&self, req: &Request) {
        let mut headers = Map::new();
        for (name, value) in &req.headers {
            let merged = match headers.get(name) {
                Some(Value::String(prev)) => format!("{prev}, {value}"),
                _ => value.clone(),
            };
            headers.insert(name.clone(), Value::String(merged));
        }
        let body = if req.body.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&req.body)
                .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&req.body).into_owned()))
        };
        let mut entry = Map::new();
        entry.insert("method".to_string(), Value::String(req.method.clone()));
        entry.insert("path".to_string(), Value::String(req.target.clone()));
        entry.insert("headers".to_string(), Value::Object(headers));
        entry.insert("body".to_string(), body);
        entry.insert("connection".to_string(), Value::from(req.connection));
        let size = req.body.len();
        let mut st = self.lock();
        st.log.push_back((Value::Object(entry), size));
        st.log_bytes += size;
        while st.log.len() > MAX_LOGGED_REQUESTS || st.log_bytes > MAX_LOGGED_BYTES {
            let Some((_, old)) = st.log.pop_front() else {
                break;
            };
            st.log_bytes -= old;
        }
    }

    fn log_json(&self) -> String {
        let st = self.lock();
        let entries: Vec<&Value> = st.log.iter().map(|(entry, _)| entry).collect();
        serde_json::to_string(&entries).unwrap_or_else(|_| "[]".to_string())
    }
}

// ---------------------------------------------------------------------------------------------
// Connections

/// One request, head and body read in full.
struct Request {
    method: String,
    target: String,
    /// Names lowercased, in arrival order.
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    keep_alive: bool,
    /// HTTP/1.0 cannot take a chunked response: the stream is delimited by close instead.
    http10: bool,
    /// Which accepted connection it came on, counting from 1.
    connection: u64,
}

impl Request {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The target without its query string.
    fn path(&self) -> &str {
        self.target.split('?').next().unwrap_or("")
    }
}

/// Whether the connection may carry another request after a response.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Next {
    KeepAlive,
    Close,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Wire {
    Anthropic,
    OpenAi,
}

impl Wire {
    fn request_id_header(self) -> &'static str {
        match self {
            Wire::Anthropic => "request-id",
            Wire::OpenAi => "x-request-id",
        }
    }
}

enum Route {
    Health,
    Requests,
    Model(Wire),
    NotFound,
}

fn route(path: &str) -> Route {
    match path {
        "/_stub/health" => Route::Health,
        "/_stub/requests" => Route::Requests,
        p if p.ends_with("/v1/messages") => Route::Model(Wire::Anthropic),
        p if p.ends_with("/chat/completions") => Route::Model(Wire::OpenAi),
        _ => Route::NotFound,
    }
}

fn on_connection(mut stream: TcpStream, shared: &Shared, number: u64) {
    // Each SSE event goes out as its own write; without NODELAY Nagle would batch them and
    // clients would not see real streaming.
    let _ = stream.set_nodelay(true);
    let mut buf: Vec<u8> = Vec::new();
    // Any I/O error just ends this connection; the peer sees a close.
    while let Ok(Next::KeepAlive) = serve_one(&mut stream, &mut buf, shared, number) {}
    let _ = stream.shutdown(Shutdown::Both);
}

/// Reads one request from `stream` (bytes already buffered first) and answers it.
fn serve_one(
    stream: &mut TcpStream,
    buf: &mut Vec<u8>,
    shared: &Shared,
    connection: u64,
) -> io::Result<Next> {
    let head = loop {
        match head::parse_request_head(buf) {
            Ok(Parsed::Complete(head, used)) => {
                buf.drain(..used);
                break head;
            }
            Err(e @ (HeadError::TooLarge | HeadError::TooManyHeaders)) => {
                write_plain(stream, 431, &format!("{e}\n"), Next::Close)?;
                return Ok(Next::Close);
            }
            Ok(Parsed::Partial) => {
                if fill(stream, buf)? == 0 {
                    // EOF between requests is the normal end of a keep-alive connection.
                    return Ok(Next::Close);
                }
            }
            Err(e) => {
                write_plain(
                    stream,
                    400,
                    &format!("bad request head: {e}\n"),
                    Next::Close,
                )?;
                return Ok(Next::Close);
            }
        }
    };
    let path = head.target.split('?').next().unwrap_or("").to_string();
    let wire = match route(&path) {
        Route::Model(wire) => Some(wire),
        _ => None,
    };
    let kind = match head::request_body_kind(&head) {
        Ok(BodyKind::UntilClose) => {
            reject(
                stream,
                shared,
                wire,
                ApiError::new(411, "a request body needs a length"),
            )?;
            return Ok(Next::Close);
        }
        Ok(kind) => kind,
        Err(e) => {
            reject(
                stream,
                shared,
                wire,
                ApiError::new(400, format!("bad request framing: {e}")),
            )?;
            return Ok(Next::Close);
        }
    };
    // Refuse an oversized declared body before reading any of it (the decoder would too, but
    // only after a 100 Continue invited the client to send it).
    if matches!(kind, BodyKind::ContentLength(n) if n > MAX_REQUEST_BODY) {
        reject(stream, shared, wire, too_large())?;
        return Ok(Next::Close);
    }
    let expects_continue = head
        .header("expect")
        .is_some_and(|v| v.eq_ignore_ascii_case("100-continue"));
    if expects_continue && !matches!(kind, BodyKind::None) && buf.is_empty() {
        stream.write_all(&response_head(100, &[]))?;
    }
    let body = match read_body(stream, buf, kind)? {
        BodyRead::Complete(body) => body,
        BodyRead::TooLarge => {
            reject(stream, shared, wire, too_large())?;
            return Ok(Next::Close);
        }
        BodyRead::Malformed(why) => {
            reject(
                stream,
                shared,
                wire,
                ApiError::new(400, format!("bad request body: {why}")),
            )?;
            return Ok(Next::Close);
        }
        BodyRead::Eof => return Ok(Next::Close),
    };
    let req = into_request(&head, body, connection);
    let next = if req.keep_alive {
        Next::KeepAlive
    } else {
        Next::Close
    };
    match route(req.path()) {
        Route::Health => write_plain(stream, 200, "ok", next),
        Route::Requests => write_json(stream, 200, &[], &shared.log_json(), next),
        Route::NotFound => {
            shared.record(&req);
            write_plain(stream, 404, "not found\n", next)
        }
        Route::Model(wire) => {
            shared.record(&req);
            serve_model(stream, &req, wire, shared, next)
        }
    }
}

fn into_request(head: &RequestHead, body: Vec<u8>, connection: u64) -> Request {
    Request {
        method: head.method.to_string(),
        target: head.target.to_string(),
        headers: head
            .headers
            .iter()
            .map(|(name, value)| (name.to_ascii_lowercase(), value.to_string()))
            .collect(),
        body,
        keep_alive: head.keep_alive(),
        http10: head.minor_version == 0,
        connection,
    }
}

enum BodyRead {
    Complete(Vec<u8>),
    TooLarge,
    Malformed(String),
    Eof,
}

fn read_body(stream: &mut TcpStream, buf: &mut Vec<u8>, kind: BodyKind) -> io::Result<BodyRead> {
    let mut decoder = BodyDecoder::new(kind, MAX_REQUEST_BODY);
    let mut body = Vec::new();
    loop {
        match decoder.decode(buf, &mut body) {
            Ok((used, done)) => {
                buf.drain(..used.min(buf.len()));
                if done {
                    return Ok(BodyRead::Complete(body));
                }
            }
            Err(BodyError::TooLarge) => return Ok(BodyRead::TooLarge),
            Err(e) => return Ok(BodyRead::Malformed(e.to_string())),
        }
        if fill(stream, buf)? == 0 {
            return Ok(BodyRead::Eof);
        }
    }
}

/// Appends one read's worth of bytes to `buf`; `Ok(0)` is EOF.
fn fill(stream: &mut TcpStream, buf: &mut Vec<u8>) -> io::Result<usize> {
    let start = buf.len();
    buf.resize(start + READ_CHUNK, 0);
    let res = loop {
        match stream.read(&mut buf[start..]) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            res => break res,
        }
    };
    buf.truncate(start + *res.as_ref().unwrap_or(&0));
    res
}

// ---------------------------------------------------------------------------------------------
// Model requests

/// A provider-shaped HTTP error.
struct ApiError {
    status: u16,
    message: String,
    /// OpenAI's `param` and `code`.
    param: Option<&'static str>,
    code: Option<&'static str>,
}

impl ApiError {
    fn new(status: u16, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            param: None,
            code: None,
        }
    }

    fn openai(
        status: u16,
        message: impl Into<String>,
        param: &'static str,
        code: &'static str,
    ) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            param: Some(param),
            code: Some(code),
        }
    }

    fn body(&self, wire: Wire, request_id: &str) -> String {
        match wire {
            Wire::Anthropic => format!(
                r#"{{"type":"error","error":{{"type":"{}","message":{}}},"request_id":{}}}"#,
                anthropic_error_type(self.status),
                js(&self.message),
                js(request_id),
            ),
            Wire::OpenAi => {
                let (kind, default_code) = openai_error_kind(self.status);
                format!(
                    r#"{{"error":{{"message":{},"type":"{kind}","param":{},"code":{}}}}}"#,
                    js(&self.message),
                    opt_js(self.param),
                    opt_js(self.code.or(default_code)),
                )
            }
        }
    }
}

fn too_large() -> ApiError {
    ApiError::new(
        413,
        format!("request exceeds the maximum allowed number of bytes ({MAX_REQUEST_BODY})"),
    )
}

fn anthropic_error_type(status: u16) -> &'static str {
    match status {
        401 => "authentication_error",
        402 => "billing_error",
        403 => "permission_error",
        404 => "not_found_error",
        409 => "conflict_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        504 => "timeout_error",
        529 => "overloaded_error",
        500..=599 => "api_error",
        _ => "invalid_request_error",
    }
}

/// OpenAI's `type` and default `code` for a status.
fn openai_error_kind(status: u16) -> (&'static str, Option<&'static str>) {
    match status {
        401 => ("invalid_request_error", Some("invalid_api_key")),
        429 => ("requests", Some("rate_limit_exceeded")),
        500..=599 => ("server_error", None),
        _ => ("invalid_request_error", None),
    }
}

/// The message a provider sends with a status fault.
fn default_message(wire: Wire, status: u16) -> &'static str {
    match (wire, status) {
        (Wire::Anthropic, 529) => "Overloaded",
        (Wire::Anthropic, 429) => {
            "This request would exceed your organization's rate limit. Please try again later."
        }
        (Wire::Anthropic, 500) => "Internal server error",
        (Wire::Anthropic, 504) => "Request timed out",
        (Wire::Anthropic, 401) => "invalid x-api-key",
        (Wire::OpenAi, 429) => "Rate limit reached for requests. Please try again in 1s.",
        (Wire::OpenAi, 401) => "Incorrect API key provided.",
        (Wire::OpenAi, 503 | 529) => "The engine is currently overloaded, please try again later.",
        (Wire::OpenAi, 500..=599) => {
            "The server had an error while processing your request. Sorry about that!"
        }
        (_, 403) => "Your API key does not have permission to use the specified resource.",
        (_, 404) => "Not found",
        (_, 413) => "Request exceeds the maximum allowed number of bytes.",
        (_, 500..=599) => "Internal server error",
        _ => "Invalid request",
    }
}

/// Answers a framing-level failure and closes: with the provider's envelope on a model route,
/// else in plain text.
fn reject(
    stream: &mut TcpStream,
    shared: &Shared,
    wire: Option<Wire>,
    err: ApiError,
) -> io::Result<Next> {
    let Some(wire) = wire else {
        let text = format!("{}\n", err.message);
        return write_plain(stream, err.status, &text, Next::Close);
    };
    let request_id = shared.next_request_id();
    let headers = [(wire.request_id_header(), request_id.as_str())];
    let text = err.body(wire, &request_id);
    write_json(stream, err.status, &headers, &text, Next::Close)
}

fn serve_model(
    stream: &mut TcpStream,
    req: &Request,
    wire: Wire,
    shared: &Shared,
    next: Next,
) -> io::Result<Next> {
    let request_id = shared.next_request_id();
    let id_header = (wire.request_id_header(), request_id.as_str());
    let body = match validate(req, wire) {
        Ok(body) => body,
        Err(err) => {
            // Invalid requests leave the script alone: a real API would not have run the model.
            log_line(req, None, err.status, &err.message);
            let text = err.body(wire, &request_id);
            return write_json(stream, err.status, &[id_header], &text, next);
        }
    };
    match shared.plan(&body) {
        Plan::Status(fault) => {
            let text = fault.body.clone().unwrap_or_else(|| {
                let message = default_message(wire, fault.status);
                ApiError::new(fault.status, message).body(wire, &request_id)
            });
            let mut headers = vec![id_header];
            if let Some(after) = &fault.retry_after {
                headers.push(("retry-after", after.as_str()));
            }
            log_line(req, Some(&body), fault.status, "status fault");
            write_json(stream, fault.status, &headers, &text, next)
        }
        Plan::HangUp => {
            log_line(
                req,
                Some(&body),
                0,
                "hang-up fault: closed without a response",
            );
            Ok(Next::Close)
        }
        Plan::Exhausted { used_up } => {
            let message = format!(
                "stub-model script exhausted: no turn is left for this request \
                 ({used_up} of {} turns used up; \"repeat_last\": true replays the last one)",
                shared.script.turns.len()
            );
            log_line(req, Some(&body), 500, &message);
            let text = ApiError::new(500, message).body(wire, &request_id);
            write_json(stream, 500, &[id_header], &text, next)
        }
        Plan::Stream {
            turn_idx,
            fault,
            stream_seq,
        } => {
            let turn = &shared.script.turns[turn_idx];
            let ctx = StreamCtx::new(turn, &body, req.body.len(), stream_seq);
            let events = match wire {
                Wire::Anthropic => anthropic_events(turn, &ctx),
                Wire::OpenAi => openai_events(turn, &ctx),
            };
            let what = format!("turn {} of {}", turn_idx + 1, shared.script.turns.len());
            log_line(req, Some(&body), 200, &what);
            write_stream(stream, req, wire, &events, fault, id_header, next)
        }
    }
}

/// One stderr line per model request, so a failing test's output shows what the stub did;
/// a valid request's model and tool count are what `match` looks at.
fn log_line(req: &Request, body: Option<&Map<String, Value>>, status: u16, what: &str) {
    let asked = body.map_or_else(String::new, |body| {
        let model = body.get("model").and_then(Value::as_str).unwrap_or("");
        let tools = body
            .get("tools")
            .and_then(Value::as_array)
            .map_or(0, Vec::len);
        format!(" ({model}, {tools} tools)")
    });
    eprintln!(
        "stub-model: {} {}{asked} -> {status}: {what}",
        req.method, req.target
    );
}

/// Checks a model request the way the provider would, returning its parsed body.
fn validate(req: &Request, wire: Wire) -> Result<Map<String, Value>, ApiError> {
    if req.method != "POST" {
        return Err(ApiError::new(
            405,
            format!("method {} not allowed; use POST", req.method),
        ));
    }
    let parsed: Result<Value, _> = serde_json::from_slice(&req.body);
    let body = match (parsed, wire) {
        (Ok(Value::Object(body)), _) => body,
        (_, Wire::Anthropic) => {
            return Err(ApiError::new(
                400,
                "There was an error parsing the body of your request: expected a JSON object",
            ));
        }
        (_, Wire::OpenAi) => {
            return Err(ApiError::new(
                400,
                "We could not parse the JSON body of your request. (HINT: This likely means \
                 you aren't using your HTTP library correctly. The OpenAI API expects a JSON \
                 payload, but what was sent was not valid JSON.)",
            ));
        }
    };
    match wire {
        Wire::Anthropic => {
            if req.header("anthropic-version").is_none() {
                return Err(ApiError::new(400, "anthropic-version: header is required"));
            }
            if !body.get("model").is_some_and(Value::is_string) {
                return Err(ApiError::new(400, "model: Field required"));
            }
            match body.get("max_tokens") {
                None => return Err(ApiError::new(400, "max_tokens: Field required")),
                Some(v) if v.as_u64().is_none_or(|n| n == 0) => {
                    return Err(ApiError::new(
                        400,
                        "max_tokens: Input should be a valid integer greater than or equal to 1",
                    ));
                }
                Some(_) => {}
            }
            match body.get("messages") {
                None => return Err(ApiError::new(400, "messages: Field required")),
                Some(v) if !v.is_array() => {
                    return Err(ApiError::new(400, "messages: Input should be a valid list"));
                }
                Some(v) if v.as_array().is_some_and(Vec::is_empty) => {
                    return Err(ApiError::new(
                        400,
                        "messages: at least one message is required",
                    ));
                }
                Some(_) => {}
            }
        }
        Wire::OpenAi => {
            if !body.get("model").is_some_and(Value::is_string) {
                return Err(ApiError::new(400, "you must provide a model parameter"));
            }
            match body.get("messages") {
                None => {
                    return Err(ApiError::openai(
                        400,
                        "Missing required parameter: 'messages'.",
                        "messages",
                        "missing_required_parameter",
                    ));
                }
                Some(v) if !v.is_array() => {
                    return Err(ApiError::openai(
                        400,
                        "Invalid type for 'messages': expected an array.",
                        "messages",
                        "invalid_type",
                    ));
                }
                Some(v) if v.as_array().is_some_and(Vec::is_empty) => {
                    return Err(ApiError::openai(
                        400,
                        "Invalid 'messages': empty array. Expected an array with minimum length 1.",
                        "messages",
                        "empty_array",
                    ));
                }
                Some(_) => {}
            }
        }
    }
    if body.get("stream") != Some(&Value::Bool(true)) {
        return Err(ApiError::new(
            400,
            "stub-model only serves streaming requests: set \"stream\": true",
        ));
    }
    Ok(body)
}

// ---------------------------------------------------------------------------------------------
// Frames

/// Per-response values shared by both wires.
struct StreamCtx {
    model: String,
    stream_seq: u64,
    input_tokens: u64,
    output_tokens: u64,
    cache_read: u64,
    cache_creation: u64,
    include_usage: bool,
}

impl StreamCtx {
    fn new(turn: &Turn, body: &Map<String, Value>, body_len: usize, stream_seq: u64) -> StreamCtx {
        let model = turn
            .model
            .clone()
            .or_else(|| {
                body.get("model")
                    .and_then(Value::as_str)
                    .map(str::to_string)
            })
            .unwrap_or_else(|| "stub-model".to_string());
        let streamed: u64 = estimate_tokens(turn.thinking.as_deref().unwrap_or(""))
            + estimate_tokens(turn.text.as_deref().unwrap_or(""))
            + turn
                .tool_calls
                .iter()
                .map(|c| 8 + estimate_tokens(&c.input.to_string()))
                .sum::<u64>();
        let include_usage = body
            .get("stream_options")
            .and_then(|o| o.get("include_usage"))
            .and_then(Value::as_bool)
            .unwrap_or(false);
        StreamCtx {
            model,
            stream_seq,
            input_tokens: turn
                .usage
                .input_tokens
                .unwrap_or((body_len as u64 / 4).max(1)),
            output_tokens: turn.usage.output_tokens.unwrap_or(streamed.max(1)),
            cache_read: turn.usage.cache_read_input_tokens.unwrap_or(0),
            cache_creation: turn.usage.cache_creation_input_tokens.unwrap_or(0),
            include_usage,
        }
    }
}

fn estimate_tokens(text: &str) -> u64 {
    (text.chars().count() as u64).div_ceil(4)
}

/// The Anthropic Messages event sequence for `turn`, each already SSE-encoded.
fn anthropic_events(turn: &Turn, ctx: &StreamCtx) -> Vec<String> {
    let mut events = Vec::new();
    let mut push = |data: String| {
        let kind = event_type(&data);
        events.push(encode_event(Some(kind), &data, None));
    };
    push(format!(
        r#"{{"type":"message_start","message":{{"id":"msg_stub_{}","type":"message","role":"assistant","model":{},"content":[],"stop_reason":null,"stop_sequence":null,"usage":{{"input_tokens":{},"cache_creation_input_tokens":{},"cache_read_input_tokens":{},"output_tokens":1}}}}}}"#,
        ctx.stream_seq,
        js(&ctx.model),
        ctx.input_tokens,
        ctx.cache_creation,
        ctx.cache_read,
    ));
    let mut index = 0;
    let mut pinged = false;
    // The real API sends its first ping right after the first block opens.
    let mut ping_once = |push: &mut dyn FnMut(String)| {
        if !pinged {
            pinged = true;
            push(r#"{"type":"ping"}"#.to_string());
        }
    };
    if let Some(thinking) = &turn.thinking {
        push(block_start(
            index,
            r#"{"type":"thinking","thinking":"","signature":""}"#,
        ));
        ping_once(&mut push);
        for piece in split_words(thinking, WORDS_PER_DELTA) {
            push(block_delta(
                index,
                &format!(r#"{{"type":"thinking_delta","thinking":{}}}"#, js(piece)),
            ));
        }
        push(block_delta(
            index,
            &format!(
                r#"{{"type":"signature_delta","signature":"{}"}}"#,
                signature(thinking)
            ),
        ));
        push(block_stop(index));
        index += 1;
    }
    if turn.text.is_some() || turn.stamps > 0 {
        push(block_start(index, r#"{"type":"text","text":""}"#));
        ping_once(&mut push);
        for piece in text_pieces(turn) {
            push(block_delta(
                index,
                &format!(r#"{{"type":"text_delta","text":{}}}"#, js(piece)),
            ));
        }
        push(block_stop(index));
        index += 1;
    }
    for (call_idx, call) in turn.tool_calls.iter().enumerate() {
        let id = call
            .id
            .clone()
            .unwrap_or_else(|| format!("toolu_stub_{}_{call_idx}", ctx.stream_seq));
        push(block_start(
            index,
            &format!(
                r#"{{"type":"tool_use","id":{},"name":{},"input":{{}}}}"#,
                js(&id),
                js(&call.name)
            ),
        ));
        ping_once(&mut push);
        let input = call.input.to_string();
        for piece in std::iter::once("").chain(split_fragments(&input)) {
            push(block_delta(
                index,
                &format!(
                    r#"{{"type":"input_json_delta","partial_json":{}}}"#,
                    js(piece)
                ),
            ));
        }
        push(block_stop(index));
        index += 1;
    }
    ping_once(&mut push);
    push(format!(
        r#"{{"type":"message_delta","delta":{{"stop_reason":"{}","stop_sequence":null}},"usage":{{"output_tokens":{}}}}}"#,
        turn.stop_reason.anthropic(),
        ctx.output_tokens,
    ));
    push(r#"{"type":"message_stop"}"#.to_string());
    events
}

/// A turn's text deltas: its words a few at a time, then its stamps.
fn text_pieces(turn: &Turn) -> impl Iterator<Item = &str> {
    let words = turn
        .text
        .as_deref()
        .map(|t| split_words(t, WORDS_PER_DELTA));
    words
        .into_iter()
        .flatten()
        .chain((0..turn.stamps).map(|_| STAMPED_DELTA))
}

/// `event` with its stamp placeholders replaced by the time now.
fn stamp_now(event: &str) -> std::borrow::Cow<'_, str> {
    let placeholder = STAMPED_DELTA.trim_end();
    if !event.contains(placeholder) {
        return std::borrow::Cow::Borrowed(event);
    }
    // Stamps are unique across the stub's connection threads (two reading the clock in the
    // same nanosecond get consecutive values), so a client can tell every event apart.
    static LAST: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let clock = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    let previous = LAST.fetch_max(clock, std::sync::atomic::Ordering::Relaxed);
    let now = if clock > previous {
        clock
    } else {
        LAST.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1
    };
    std::borrow::Cow::Owned(event.replace(placeholder, &format!("@{now:019}")))
}

/// The `type` of an event we built: the SSE `event:` name always equals it.
fn event_type(data: &str) -> &str {
    const PREFIX: &str = r#"{"type":""#;
    data.strip_prefix(PREFIX)
        .and_then(|rest| rest.split('"').next())
        .unwrap_or("message")
}

fn block_start(index: usize, block: &str) -> String {
    format!(r#"{{"type":"content_block_start","index":{index},"content_block":{block}}}"#)
}

fn block_delta(index: usize, delta: &str) -> String {
    format!(r#"{{"type":"content_block_delta","index":{index},"delta":{delta}}}"#)
}

fn block_stop(index: usize) -> String {
    format!(r#"{{"type":"content_block_stop","index":{index}}}"#)
}

/// A deterministic stand-in for a thinking signature, base64-alphabet only like the real one.
fn signature(thinking: &str) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in thinking.bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("EqStubSignature{hash:016x}")
}

/// The OpenAI chat.completion.chunk sequence for `turn`, each already SSE-encoded.
fn openai_events(turn: &Turn, ctx: &StreamCtx) -> Vec<String> {
    let model = js(&ctx.model);
    let usage_null = if ctx.include_usage {
        r#","usage":null"#
    } else {
        ""
    };
    let frame = |delta: &str, finish: Option<&str>| {
        let data = format!(
            r#"{{"id":"chatcmpl-stub{}","object":"chat.completion.chunk","created":{CREATED},"model":{model},"system_fingerprint":"fp_stub","choices":[{{"index":0,"delta":{delta},"logprobs":null,"finish_reason":{}}}]{usage_null}}}"#,
            ctx.stream_seq,
            opt_js(finish),
        );
        encode_event(None, &data, None)
    };
    let mut events = Vec::new();
    let content = if turn.text.is_some() || turn.stamps > 0 {
        r#""""#
    } else {
        "null"
    };
    events.push(frame(
        &format!(r#"{{"role":"assistant","content":{content},"refusal":null}}"#),
        None,
    ));
    if let Some(thinking) = &turn.thinking {
        for piece in split_words(thinking, WORDS_PER_DELTA) {
            events.push(frame(
                &format!(r#"{{"reasoning_content":{}}}"#, js(piece)),
                None,
            ));
        }
    }
    for piece in text_pieces(turn) {
        events.push(frame(&format!(r#"{{"content":{}}}"#, js(piece)), None));
    }
    // Each call opens with id, type and name, then streams its arguments; parallel calls are
    // interleaved round-robin so clients must really key fragments by index.
    let queues: Vec<Vec<String>> = turn
        .tool_calls
        .iter()
        .enumerate()
        .map(|(call_idx, call)| {
            let id = call
                .id
                .clone()
                .unwrap_or_else(|| format!("call_stub_{}_{call_idx}", ctx.stream_seq));
            let mut deltas = vec![format!(
                r#"{{"tool_calls":[{{"index":{call_idx},"id":{},"type":"function","function":{{"name":{},"arguments":""}}}}]}}"#,
                js(&id),
                js(&call.name),
            )];
            let arguments = call.input.to_string();
            for piece in split_fragments(&arguments) {
                deltas.push(format!(
                    r#"{{"tool_calls":[{{"index":{call_idx},"function":{{"arguments":{}}}}}]}}"#,
                    js(piece)
                ));
            }
            deltas
        })
        .collect();
    let longest = queues.iter().map(Vec::len).max().unwrap_or(0);
    for step in 0..longest {
        for queue in &queues {
            if let Some(delta) = queue.get(step) {
                events.push(frame(delta, None));
            }
        }
    }
    events.push(frame("{}", Some(turn.stop_reason.openai())));
    if ctx.include_usage {
        let prompt = ctx.input_tokens + ctx.cache_read + ctx.cache_creation;
        let reasoning = estimate_tokens(turn.thinking.as_deref().unwrap_or(""));
        let data = format!(
            r#"{{"id":"chatcmpl-stub{}","object":"chat.completion.chunk","created":{CREATED},"model":{model},"system_fingerprint":"fp_stub","choices":[],"usage":{{"prompt_tokens":{prompt},"completion_tokens":{},"total_tokens":{},"prompt_tokens_details":{{"cached_tokens":{}}},"completion_tokens_details":{{"reasoning_tokens":{reasoning}}}}}}}"#,
            ctx.stream_seq,
            ctx.output_tokens,
            prompt + ctx.output_tokens,
            ctx.cache_read,
        );
        events.push(encode_event(None, &data, None));
    }
    events.push(encode_event(None, "[DONE]", None));
    events
}

/// Splits text into pieces of `words` words; every piece after the first starts with the
/// whitespace that preceded its first word, as real token streams do.
fn split_words(text: &str, words: usize) -> Vec<&str> {
    let mut pieces = Vec::new();
    let mut start = 0;
    let mut n_words = 0;
    let mut prev_ws = true;
    for (at, ch) in text.char_indices() {
        let ws = ch.is_whitespace();
        if ws && !prev_ws {
            n_words += 1;
            if n_words == words {
                if at > start {
                    pieces.push(&text[start..at]);
                }
                start = at;
                n_words = 0;
            }
        }
        prev_ws = ws;
    }
    if start < text.len() {
        pieces.push(&text[start..]);
    }
    pieces
}

/// Splits serialized JSON into 2–3 fragments at byte points that ignore its syntax (but fall
/// on char boundaries), so fragments are not JSON on their own.
fn split_fragments(json: &str) -> Vec<&str> {
    let len = json.len();
    let parts = match len {
        0..=1 => 1,
        2..=23 => 2,
        _ => 3,
    };
    let mut cuts = vec![0];
    for k in 1..parts {
        let at = json.ceil_char_boundary(len * k / parts);
        if at > cuts[cuts.len() - 1] && at < len {
            cuts.push(at);
        }
    }
    cuts.push(len);
    cuts.windows(2)
        .map(|w| &json[w[0]..w[1]])
        .filter(|piece| !piece.is_empty())
        .collect()
}

/// A JSON string literal.
fn js(text: &str) -> String {
    Value::String(text.to_string()).to_string()
}

fn opt_js(text: Option<&str>) -> String {
    text.map_or_else(|| "null".to_string(), js)
}

// ---------------------------------------------------------------------------------------------
// Writing responses

fn connection_header(next: Next) -> &'static str {
    match next {
        Next::KeepAlive => "keep-alive",
        Next::Close => "close",
    }
}

fn write_plain(stream: &mut TcpStream, status: u16, text: &str, next: Next) -> io::Result<Next> {
    write_fixed(
        stream,
        status,
        "text/plain; charset=utf-8",
        &[],
        text.as_bytes(),
        next,
    )
}

fn write_json(
    stream: &mut TcpStream,
    status: u16,
    extra: &[(&str, &str)],
    text: &str,
    next: Next,
) -> io::Result<Next> {
    write_fixed(
        stream,
        status,
        "application/json",
        extra,
        text.as_bytes(),
        next,
    )
}

/// A Content-Length framed response.
fn write_fixed(
    stream: &mut TcpStream,
    status: u16,
    content_type: &str,
    extra: &[(&str, &str)],
    body: &[u8],
    next: Next,
) -> io::Result<Next> {
    let length = body.len().to_string();
    let mut headers = vec![
        ("content-type", content_type),
        ("content-length", length.as_str()),
        ("connection", connection_header(next)),
    ];
    headers.extend_from_slice(extra);
    let mut out = response_head(status, &headers);
    out.extend_from_slice(body);
    stream.write_all(&out)?;
    Ok(next)
}

/// Streams `events` as a chunked SSE body, applying `fault`.
fn write_stream(
    stream: &mut TcpStream,
    req: &Request,
    wire: Wire,
    events: &[String],
    fault: StreamFault,
    request_id: (&str, &str),
    next: Next,
) -> io::Result<Next> {
    let start_at = std::time::UNIX_EPOCH + Duration::from_millis(fault.start_at_ms);
    if let Ok(wait) = start_at.duration_since(std::time::SystemTime::now()) {
        thread::sleep(wait);
    }
    if fault.delay_ms > 0 {
        thread::sleep(Duration::from_millis(fault.delay_ms));
    }
    // HTTP/1.0 has no chunked coding: the body is delimited by closing the connection.
    let next = if req.http10 { Next::Close } else { next };
    let mut headers = vec![
        ("content-type", "text/event-stream; charset=utf-8"),
        ("cache-control", "no-cache"),
        ("connection", connection_header(next)),
        request_id,
    ];
    if !req.http10 {
        headers.push(("transfer-encoding", "chunked"));
    }
    stream.write_all(&response_head(200, &headers))?;
    let ping = match wire {
        Wire::Anthropic => encode_event(Some("ping"), r#"{"type": "ping"}"#, None),
        // An SSE comment line, as llama.cpp and proxies send while a model works.
        Wire::OpenAi => ": ping\n\n".to_owned(),
    };
    for (n_sent, event) in events.iter().enumerate() {
        match fault.cut {
            Some(Cut::Drop(n)) if n_sent as u64 >= n => return drop_connection(stream),
            Some(Cut::Stall(n)) if n_sent as u64 >= n => return stall(stream),
            Some(Cut::Ping(n)) if n_sent as u64 >= n => return forever(stream, req, &ping),
            Some(Cut::Repeat(n)) if n_sent as u64 >= n => {
                return forever(stream, req, &events[n_sent - 1]);
            }
            _ => {}
        }
        if n_sent > 0 && fault.drip_ms > 0 {
            thread::sleep(Duration::from_millis(fault.drip_ms));
        }
        let event = stamp_now(event);
        if req.http10 {
            stream.write_all(event.as_bytes())?;
        } else {
            stream.write_all(&chunk(event.as_bytes()))?;
        }
    }
    match fault.cut {
        Some(Cut::Drop(_)) => return drop_connection(stream),
        Some(Cut::Stall(_)) => return stall(stream),
        Some(Cut::Ping(_)) => return forever(stream, req, &ping),
        Some(Cut::Repeat(_)) => match events.last() {
            Some(last) => return forever(stream, req, last),
            None => return stall(stream),
        },
        None => {}
    }
    if !req.http10 {
        stream.write_all(LAST_CHUNK)?;
    }
    Ok(if fault.close_after { Next::Close } else { next })
}

/// Ends the stream without its terminating chunk, as a crashed upstream would.
fn drop_connection(stream: &mut TcpStream) -> io::Result<Next> {
    let _ = stream.shutdown(Shutdown::Both);
    Ok(Next::Close)
}

/// Sends `event` every `KEEPALIVE_INTERVAL` until the client closes the socket (the write
/// fails).
fn forever(stream: &mut TcpStream, req: &Request, event: &str) -> io::Result<Next> {
    loop {
        thread::sleep(KEEPALIVE_INTERVAL);
        let sent = if req.http10 {
            stream.write_all(event.as_bytes())
        } else {
            stream.write_all(&chunk(event.as_bytes()))
        };
        if sent.is_err() {
            return Ok(Next::Close);
        }
    }
}

/// Keeps the socket open and silent until the client gives up and closes it.
fn stall(stream: &mut TcpStream) -> io::Result<Next> {
    let _ = stream.flush();
    let mut sink = [0u8; 4096];
    loop {
        match stream.read(&mut sink) {
            Ok(0) => return Ok(Next::Close),
            Ok(_) => continue,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => return Ok(Next::Close),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    const RECV_TIMEOUT: Duration = Duration::from_secs(10);

    fn start(script: &str) -> SocketAddr {
        let script = Script::parse(script).expect("test script parses");
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
        let addr = listener.local_addr().expect("local addr");
        thread::spawn(move || serve(listener, script));
        addr
    }

    #[derive(Debug, PartialEq)]
    enum End {
        Complete,
        Eof,
        Timeout,
    }

    #[derive(Debug)]
    struct Response {
        status: u16,
        headers: Vec<(String, String)>,
        body: Vec<u8>,
        end: End,
    }

    impl Response {
        fn header(&self, name: &str) -> Option<&str> {
            self.headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.as_str())
        }

        fn text(&self) -> String {
            String::from_utf8(self.body.clone()).expect("utf-8 body")
        }

        fn json(&self) -> Value {
            serde_json::from_slice(&self.body).expect("JSON body")
        }
    }

    struct Client {
        stream: TcpStream,
        buf: Vec<u8>,
    }

    impl Client {
        fn connect(addr: SocketAddr) -> Client {
            let stream = TcpStream::connect(addr).expect("connect");
            stream.set_read_timeout(Some(RECV_TIMEOUT)).unwrap();
            Client {
                stream,
                buf: Vec::new(),
            }
        }

        fn send(&mut self, bytes: &[u8]) {
            self.stream.write_all(bytes).expect("send");
        }

        /// Reads more bytes; `Err(end)` on EOF or timeout.
        fn more(&mut self) -> Result<(), End> {
            let mut tmp = [0u8; 8192];
            match self.stream.read(&mut tmp) {
                Ok(0) => Err(End::Eof),
                Ok(n) => {
                    self.buf.extend_from_slice(&tmp[..n]);
                    Ok(())
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    Err(End::Timeout)
                }
                Err(_) => Err(End::Eof),
            }
        }

        fn line(&mut self) -> Result<String, End> {
            loop {
                if let Some(at) = self.buf.windows(2).position(|w| w == b"\r\n") {
                    let line = String::from_utf8_lossy(&self.buf[..at]).into_owned();
                    self.buf.drain(..at + 2);
                    return Ok(line);
                }
                self.more()?;
            }
        }

        fn response(&mut self) -> Response {
            let status_line = self.line().expect("status line");
            let status: u16 = status_line
                .split(' ')
                .nth(1)
                .and_then(|s| s.parse().ok())
                .unwrap_or_else(|| panic!("bad status line {status_line:?}"));
            let mut headers = Vec::new();
            loop {
                let line = self.line().expect("header line");
                if line.is_empty() {
                    break;
                }
                let (name, value) = line.split_once(':').expect("header colon");
                headers.push((name.trim().to_ascii_lowercase(), value.trim().to_string()));
            }
            let mut res = Response {
                status,
                headers,
                body: Vec::new(),
                end: End::Complete,
            };
            if status < 200 {
                return res;
            }
            if res.header("transfer-encoding") == Some("chunked") {
                loop {
                    let size_line = match self.line() {
                        Ok(line) => line,
                        Err(end) => {
                            res.end = end;
                            return res;
                        }
                    };
                    let size = usize::from_str_radix(size_line.trim(), 16).expect("chunk size");
                    while self.buf.len() < size + 2 {
                        if let Err(end) = self.more() {
                            res.end = end;
                            return res;
                        }
                    }
                    res.body.extend_from_slice(&self.buf[..size]);
                    self.buf.drain(..size + 2);
                    if size == 0 {
                        return res;
                    }
                }
            }
            let length: usize = res
                .header("content-length")
                .map(|v| v.parse().expect("content-length"))
                .unwrap_or(usize::MAX);
            while self.buf.len() < length {
                if let Err(end) = self.more() {
                    res.end = end;
                    res.body = std::mem::take(&mut self.buf);
                    return res;
                }
            }
            res.body = self.buf.drain(..length).collect();
            res
        }

        fn call(&mut self, request: &[u8]) -> Response {
            self.send(request);
            self.response()
        }
    }

    fn post(path: &str, headers: &[(&str, &str)], body: &str) -> Vec<u8> {
        let mut req = format!(
            "POST {path} HTTP/1.1\r\nhost: stub\r\ncontent-type: application/json\r\n\
             content-length: {}\r\n",
            body.len()
        );
        for (name, value) in headers {
            req.push_str(&format!("{name}: {value}\r\n"));
        }
        req.push_str("\r\n");
        req.push_str(body);
        req.into_bytes()
    }

    fn get(path: &str) -> Vec<u8> {
        format!("GET {path} HTTP/1.1\r\nhost: stub\r\n\r\n").into_bytes()
    }

    const ANTHROPIC_BODY: &str = r#"{"model":"claude-test","max_tokens":1024,"stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
    const OPENAI_BODY: &str = r#"{"model":"gpt-test","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"hi"}]}"#;

    fn anthropic(body: &str) -> Vec<u8> {
        post(
            "/v1/messages",
            &[("anthropic-version", "2023-06-01"), ("x-api-key", "k")],
            body,
        )
    }

    fn openai(body: &str) -> Vec<u8> {
        post(
            "/v1/chat/completions",
            &[("authorization", "Bearer k")],
            body,
        )
    }

    /// (event name, data) pairs of an SSE body, checking the framing as it goes.
    fn sse(body: &[u8]) -> Vec<(Option<String>, String)> {
        let text = std::str::from_utf8(body).expect("utf-8 SSE");
        let mut events = Vec::new();
        for block in text.split("\n\n").filter(|b| !b.is_empty()) {
            let mut name = None;
            let mut data = None;
            for line in block.lines() {
                if let Some(v) = line.strip_prefix("event: ") {
                    name = Some(v.to_string());
                } else if let Some(v) = line.strip_prefix("data: ") {
                    assert!(data.is_none(), "one data line per event: {block:?}");
                    data = Some(v.to_string());
                } else {
                    panic!("unexpected SSE line {line:?}");
                }
            }
            events.push((name, data.expect("data line")));
        }
        events
    }

    /// Anthropic events as JSON, asserting the `event:` name matches the JSON `type`.
    fn anthropic_json(body: &[u8]) -> Vec<Value> {
        sse(body)
            .into_iter()
            .map(|(name, data)| {
                let value: Value = serde_json::from_str(&data).expect("event JSON");
                assert_eq!(name.as_deref(), value["type"].as_str(), "{data}");
                value
            })
            .collect()
    }

    fn types(events: &[Value]) -> Vec<&str> {
        events.iter().map(|e| e["type"].as_str().unwrap()).collect()
    }

    fn deltas(events: &[Value], index: u64, kind: &str, field: &str) -> Vec<String> {
        events
            .iter()
            .filter(|e| e["type"] == "content_block_delta" && e["index"] == index)
            .filter(|e| e["delta"]["type"] == kind)
            .map(|e| e["delta"][field].as_str().unwrap().to_string())
            .collect()
    }

    // -- script parsing ------------------------------------------------------------------

    #[test]
    fn script_errors_name_the_spot() {
        let cases = [
            ("nope", "invalid JSON"),
            ("[]", "script: expected a JSON object"),
            ("{}", "missing \"turns\""),
            (r#"{"turns":{}}"#, "\"turns\" must be an array"),
            (r#"{"turns":[],"extra":1}"#, "unknown field \"extra\""),
            (
                r#"{"turns":[{"txt":"hi"}]}"#,
                "turns[0]: unknown field \"txt\"",
            ),
            (
                r#"{"turns":[{"text":1}]}"#,
                "turns[0]: \"text\" must be a string",
            ),
            (
                r#"{"turns":[{},{"stop_reason":"done"}]}"#,
                "turns[1]: unknown stop_reason \"done\"",
            ),
            (
                r#"{"turns":[{"tool_calls":[{"input":{}}]}]}"#,
                "turns[0].tool_calls[0]: missing \"name\"",
            ),
            (
                r#"{"turns":[{"tool_calls":[{"name":"Read","input":[1]}]}]}"#,
                "turns[0].tool_calls[0]: \"input\" must be a JSON object",
            ),
            (
                r#"{"turns":[{"usage":{"input_tokens":-1}}]}"#,
                "turns[0].usage: \"input_tokens\" must be a non-negative integer",
            ),
            (
                r#"{"turns":[{"faults":[{"stauts":529}]}]}"#,
                "turns[0].faults[0]: unknown field \"stauts\"",
            ),
            (
                r#"{"turns":[{"faults":[{"status":200}]}]}"#,
                "between 400 and 599",
            ),
            (
                r#"{"turns":[{"faults":[{"status":529,"delay_ms":5}]}]}"#,
                "cannot be combined",
            ),
            (
                r#"{"turns":[{"faults":[{"drop_after_events":1,"stall_after_events":1}]}]}"#,
                "exclude each other",
            ),
            (r#"{"turns":[{"faults":[{}]}]}"#, "a fault needs one of"),
            (
                r#"{"turns":[{"faults":[{"retry_after":"1"}]}]}"#,
                "only goes with",
            ),
            (
                r#"{"turns":[],"repeat_last":true}"#,
                "needs at least one turn",
            ),
            (
                r#"{"turns":[{"match":{"tool":true}}]}"#,
                "turns[0].match: unknown field \"tool\"",
            ),
            (
                r#"{"turns":[{"match":{"tools":"yes"}}]}"#,
                "turns[0].match: \"tools\" must be true or false",
            ),
            (
                r#"{"turns":[{"match":{"model":1}}]}"#,
                "turns[0].match: \"model\" must be a string",
            ),
            (
                r#"{"turns":[{"match":[]}]}"#,
                "turns[0].match: expected a JSON object",
            ),
            (
                r#"{"turns":[{"reuse":1}]}"#,
                "turns[0]: \"reuse\" must be true or false",
            ),
        ];
        for (json, want) in cases {
            let err = Script::parse(json).expect_err(json);
            assert!(err.contains(want), "{json}: {err:?} lacks {want:?}");
        }
    }

    #[test]
    fn script_defaults() {
        let script = Script::parse(
            r#"{"turns":[{"text":"a"},{"tool_calls":[{"name":"Read"}]},
                {"text":"b","stop_reason":"max_tokens","faults":[{"status":529,"retry_after":2}]}]}"#,
        )
        .unwrap();
        assert_eq!(script.turn_count(), 3);
        assert_eq!(script.turns[0].stop_reason, StopReason::EndTurn);
        assert_eq!(script.turns[1].stop_reason, StopReason::ToolUse);
        assert_eq!(script.turns[1].tool_calls[0].input, serde_json::json!({}));
        assert_eq!(script.turns[2].stop_reason, StopReason::MaxTokens);
        match &script.turns[2].faults[0] {
            Fault::Status(s) => assert_eq!(s.retry_after.as_deref(), Some("2")),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn run_refuses_bad_script_and_non_loopback() {
        let missing = StubArgs {
            script: PathBuf::from("/nonexistent/stub-script.json"),
            ..StubArgs::default()
        };
        let err = run(&missing).unwrap_err();
        assert!(err.starts_with("/nonexistent/stub-script.json: "), "{err}");

        let dir = std::env::temp_dir().join(format!("stub-model-test-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let bad = dir.join("bad.json");
        fs::write(&bad, r#"{"turns":[{"txt":"x"}]}"#).unwrap();
        let err = run(&StubArgs {
            script: bad.clone(),
            ..StubArgs::default()
        })
        .unwrap_err();
        assert!(err.contains("bad.json: turns[0]: unknown field"), "{err}");

        let good = dir.join("good.json");
        fs::write(&good, r#"{"turns":[]}"#).unwrap();
        let err = run(&StubArgs {
            script: good,
            addr: "0.0.0.0:0".to_string(),
        })
        .unwrap_err();
        assert!(err.contains("only listens on loopback"), "{err}");
        let _ = fs::remove_dir_all(&dir);
    }

    // -- splitting -----------------------------------------------------------------------

    #[test]
    fn split_words_keeps_every_byte() {
        let text = "Hello there, how are you today?\nAll  good — thanks.";
        let pieces = split_words(text, 3);
        assert_eq!(pieces.concat(), text);
        assert_eq!(pieces[0], "Hello there, how");
        assert!(pieces.len() >= 3, "{pieces:?}");
        assert!(
            pieces[1..]
                .iter()
                .all(|p| p.starts_with(char::is_whitespace))
        );
        assert_eq!(split_words("one", 3), vec!["one"]);
        assert!(split_words("", 3).is_empty());
    }

    #[test]
    fn split_fragments_lands_on_char_boundaries() {
        let json = r#"{"path":"ééé/ñandú/日本語.md","limit":10}"#;
        let pieces = split_fragments(json);
        assert_eq!(pieces.len(), 3);
        assert_eq!(pieces.concat(), json);
        assert!(
            pieces
                .iter()
                .all(|p| serde_json::from_str::<Value>(p).is_err())
        );
        assert_eq!(split_fragments("{}"), vec!["{", "}"]);
    }

    // -- Anthropic wire ------------------------------------------------------------------

    #[test]
    fn anthropic_text_turn() {
        let addr = start(
            r#"{"turns":[{"text":"Hello there, this is a stub model speaking to you.",
                "usage":{"input_tokens":472,"output_tokens":12,"cache_read_input_tokens":2048}}]}"#,
        );
        let res = Client::connect(addr).call(&anthropic(ANTHROPIC_BODY));
        assert_eq!(res.status, 200);
        assert_eq!(res.end, End::Complete);
        assert_eq!(res.header("transfer-encoding"), Some("chunked"));
        assert_eq!(
            res.header("content-type"),
            Some("text/event-stream; charset=utf-8")
        );
        assert_eq!(res.header("request-id"), Some("req_stub_1"));
        let events = anthropic_json(&res.body);
        assert_eq!(
            types(&events),
            [
                "message_start",
                "content_block_start",
                "ping",
                "content_block_delta",
                "content_block_delta",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop"
            ]
        );
        let message = &events[0]["message"];
        assert_eq!(message["id"], "msg_stub_1");
        assert_eq!(message["model"], "claude-test");
        assert_eq!(message["role"], "assistant");
        assert_eq!(message["content"], serde_json::json!([]));
        assert_eq!(message["stop_reason"], Value::Null);
        assert_eq!(message["usage"]["input_tokens"], 472);
        assert_eq!(message["usage"]["cache_read_input_tokens"], 2048);
        assert_eq!(
            events[1]["content_block"],
            serde_json::json!({"type":"text","text":""})
        );
        let text = deltas(&events, 0, "text_delta", "text");
        assert_eq!(text[0], "Hello there, this");
        assert_eq!(
            text.concat(),
            "Hello there, this is a stub model speaking to you."
        );
        assert_eq!(events[8]["delta"]["stop_reason"], "end_turn");
        assert_eq!(events[8]["delta"]["stop_sequence"], Value::Null);
        assert_eq!(events[8]["usage"]["output_tokens"], 12);
        // The exact bytes of a frame, as a real client sees them.
        let raw = String::from_utf8(res.body.clone()).unwrap();
        assert!(
            raw.ends_with("event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"),
            "{raw}"
        );
    }

    #[test]
    fn anthropic_thinking_and_tool_turn() {
        let addr = start(
            r#"{"turns":[{"thinking":"The user wants the README, so read it first.",
                "text":"Let me open it.",
                "tool_calls":[{"id":"toolu_A","name":"Read","input":{"path":"README.md","limit":200}},
                              {"name":"Glob","input":{"pattern":"**/*.rs"}}],
                "model":"claude-scripted"}]}"#,
        );
        let res = Client::connect(addr).call(&anthropic(ANTHROPIC_BODY));
        assert_eq!(res.status, 200);
        let events = anthropic_json(&res.body);
        assert_eq!(events[0]["message"]["model"], "claude-scripted");
        let starts: Vec<&Value> = events
            .iter()
            .filter(|e| e["type"] == "content_block_start")
            .collect();
        assert_eq!(starts.len(), 4);
        assert_eq!(
            starts[0]["content_block"],
            serde_json::json!({"type":"thinking","thinking":"","signature":""})
        );
        let thinking = deltas(&events, 0, "thinking_delta", "thinking");
        assert!(thinking.len() > 1);
        assert_eq!(
            thinking.concat(),
            "The user wants the README, so read it first."
        );
        let sig = deltas(&events, 0, "signature_delta", "signature");
        assert_eq!(sig.len(), 1);
        let stop0 = events
            .iter()
            .position(|e| e["type"] == "content_block_stop" && e["index"] == 0)
            .unwrap();
        assert_eq!(events[stop0 - 1]["delta"]["type"], "signature_delta");
        assert_eq!(
            deltas(&events, 1, "text_delta", "text").concat(),
            "Let me open it."
        );
        assert_eq!(
            starts[2]["content_block"],
            serde_json::json!({"type":"tool_use","id":"toolu_A","name":"Read","input":{}})
        );
        assert_eq!(starts[3]["content_block"]["id"], "toolu_stub_1_1");
        for (index, want) in [
            (2, serde_json::json!({"path":"README.md","limit":200})),
            (3, serde_json::json!({"pattern":"**/*.rs"})),
        ] {
            let fragments = deltas(&events, index, "input_json_delta", "partial_json");
            assert_eq!(fragments[0], "", "empty first fragment");
            assert!((3..=4).contains(&fragments.len()), "{fragments:?}");
            let input: Value = serde_json::from_str(&fragments.concat()).unwrap();
            assert_eq!(input, want);
        }
        let pings = types(&events).iter().filter(|t| **t == "ping").count();
        assert_eq!(pings, 1);
        let delta = &events[events.len() - 2];
        assert_eq!(delta["delta"]["stop_reason"], "tool_use");
        assert_eq!(types(&events).last(), Some(&"message_stop"));
    }

    // -- OpenAI wire ---------------------------------------------------------------------

    fn openai_chunks(body: &[u8]) -> (Vec<Value>, bool) {
        let events = sse(body);
        assert!(
            events.iter().all(|(name, _)| name.is_none()),
            "no event: lines"
        );
        let done = events.last().is_some_and(|(_, data)| data == "[DONE]");
        let chunks = events[..events.len() - usize::from(done)]
            .iter()
            .map(|(_, data)| serde_json::from_str(data).expect("chunk JSON"))
            .collect();
        (chunks, done)
    }

    #[test]
    fn openai_text_turn_with_usage() {
        let addr = start(
            r#"{"turns":[{"thinking":"Short thought here, nothing more.",
                "text":"Hello there, this is a stub model speaking.",
                "usage":{"input_tokens":70,"output_tokens":20,"cache_read_input_tokens":10}}]}"#,
        );
        let res = Client::connect(addr).call(&openai(OPENAI_BODY));
        assert_eq!(res.status, 200);
        assert_eq!(res.end, End::Complete);
        assert_eq!(res.header("x-request-id"), Some("req_stub_1"));
        let (chunks, done) = openai_chunks(&res.body);
        assert!(done, "ends with data: [DONE]");
        for chunk in &chunks {
            assert_eq!(chunk["object"], "chat.completion.chunk");
            assert_eq!(chunk["id"], "chatcmpl-stub1");
            assert_eq!(chunk["model"], "gpt-test");
            assert!(chunk.get("usage").is_some(), "usage key when include_usage");
        }
        assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
        let field = |name: &str| -> String {
            chunks
                .iter()
                .filter_map(|c| c["choices"][0]["delta"][name].as_str())
                .collect()
        };
        assert_eq!(
            field("reasoning_content"),
            "Short thought here, nothing more."
        );
        assert_eq!(
            field("content"),
            "Hello there, this is a stub model speaking."
        );
        let content_chunks = chunks
            .iter()
            .filter(|c| {
                c["choices"][0]["delta"]["content"]
                    .as_str()
                    .is_some_and(|s| !s.is_empty())
            })
            .count();
        assert!(content_chunks >= 3);
        let finish = &chunks[chunks.len() - 2];
        assert_eq!(finish["choices"][0]["finish_reason"], "stop");
        assert_eq!(finish["choices"][0]["delta"], serde_json::json!({}));
        let usage = &chunks[chunks.len() - 1];
        assert_eq!(usage["choices"], serde_json::json!([]));
        assert_eq!(usage["usage"]["prompt_tokens"], 80);
        assert_eq!(usage["usage"]["completion_tokens"], 20);
        assert_eq!(usage["usage"]["total_tokens"], 100);
        assert_eq!(usage["usage"]["prompt_tokens_details"]["cached_tokens"], 10);
    }

    #[test]
    fn openai_parallel_tool_calls() {
        let addr = start(
            r#"{"turns":[{"tool_calls":[
                {"name":"Read","input":{"path":"README.md"}},
                {"id":"call_B","name":"Grep","input":{"pattern":"fn main","path":"src"}}]}]}"#,
        );
        let body = r#"{"model":"m","stream":true,"messages":[{"role":"user","content":"x"}]}"#;
        let res = Client::connect(addr).call(&post("/chat/completions", &[], body));
        assert_eq!(res.status, 200);
        let (chunks, done) = openai_chunks(&res.body);
        assert!(done);
        assert!(chunks.iter().all(|c| c.get("usage").is_none()), "no usage");
        let mut calls: Vec<(String, String, String)> = vec![Default::default(); 2];
        let mut order = Vec::new();
        for chunk in &chunks {
            let Some(fragments) = chunk["choices"][0]["delta"]["tool_calls"].as_array() else {
                continue;
            };
            for fragment in fragments {
                let index = fragment["index"].as_u64().unwrap() as usize;
                order.push(index);
                let call = &mut calls[index];
                if let Some(id) = fragment["id"].as_str() {
                    assert!(call.0.is_empty(), "id only in the first fragment");
                    assert_eq!(fragment["type"], "function");
                    call.0 = id.to_string();
                    call.1 = fragment["function"]["name"].as_str().unwrap().to_string();
                } else {
                    assert!(!call.0.is_empty(), "first fragment carries the id");
                    assert!(fragment["function"].get("name").is_none());
                }
                call.2 += fragment["function"]["arguments"].as_str().unwrap();
            }
        }
        assert_eq!(calls[0].0, "call_stub_1_0");
        assert_eq!(calls[0].1, "Read");
        assert_eq!(
            serde_json::from_str::<Value>(&calls[0].2).unwrap(),
            serde_json::json!({"path":"README.md"})
        );
        assert_eq!(calls[1].0, "call_B");
        assert_eq!(calls[1].1, "Grep");
        assert_eq!(
            serde_json::from_str::<Value>(&calls[1].2).unwrap(),
            serde_json::json!({"pattern":"fn main","path":"src"})
        );
        assert_eq!(&order[..4], &[0, 1, 0, 1], "parallel calls interleave");
        let finish = chunks.last().unwrap();
        assert_eq!(finish["choices"][0]["finish_reason"], "tool_calls");
    }

    // -- faults --------------------------------------------------------------------------

    #[test]
    fn status_faults_then_the_turn() {
        let addr = start(
            r#"{"turns":[{"text":"finally","faults":[
                {"status":529},{"status":429,"retry_after":"1"},{"status":500}]}]}"#,
        );
        let mut client = Client::connect(addr);
        let res = client.call(&anthropic(ANTHROPIC_BODY));
        assert_eq!(res.status, 529);
        assert_eq!(
            res.header("content-length"),
            Some(&*res.body.len().to_string())
        );
        assert_eq!(res.header("retry-after"), None);
        assert_eq!(
            res.json(),
            serde_json::json!({"type":"error","error":{"type":"overloaded_error","message":"Overloaded"},
                "request_id":"req_stub_1"})
        );
        let res = client.call(&anthropic(ANTHROPIC_BODY));
        assert_eq!(res.status, 429);
        assert_eq!(res.header("retry-after"), Some("1"));
        assert_eq!(res.json()["error"]["type"], "rate_limit_error");
        let res = client.call(&anthropic(ANTHROPIC_BODY));
        assert_eq!(res.status, 500);
        assert_eq!(res.json()["error"]["type"], "api_error");
        let res = client.call(&anthropic(ANTHROPIC_BODY));
        assert_eq!(res.status, 200);
        let events = anthropic_json(&res.body);
        assert_eq!(events[0]["message"]["id"], "msg_stub_1");
        assert_eq!(deltas(&events, 0, "text_delta", "text").concat(), "finally");
    }

    #[test]
    fn status_faults_on_openai_and_custom_body() {
        let addr = start(
            r#"{"turns":[{"text":"ok","faults":[{"status":429},{"status":503,"body":"upstream sad"}]}]}"#,
        );
        let mut client = Client::connect(addr);
        let res = client.call(&openai(OPENAI_BODY));
        assert_eq!(res.status, 429);
        let error = &res.json()["error"];
        assert_eq!(error["code"], "rate_limit_exceeded");
        assert_eq!(error["param"], Value::Null);
        assert!(error["message"].is_string() && error["type"].is_string());
        let res = client.call(&openai(OPENAI_BODY));
        assert_eq!(res.status, 503);
        assert_eq!(res.text(), "upstream sad");
        assert_eq!(client.call(&openai(OPENAI_BODY)).status, 200);
    }

    #[test]
    fn delay_and_drip_faults() {
        let addr = start(
            r#"{"turns":[{"text":"one two three four five six seven","faults":[{"delay_ms":150}]},
                         {"text":"one two three four five six seven","faults":[{"drip_ms":30}]}]}"#,
        );
        let mut client = Client::connect(addr);
        let began = Instant::now();
        let res = client.call(&anthropic(ANTHROPIC_BODY));
        assert_eq!(res.status, 200);
        assert!(began.elapsed() >= Duration::from_millis(150));
        let began = Instant::now();
        let res = client.call(&anthropic(ANTHROPIC_BODY));
        assert_eq!(res.end, End::Complete);
        let n_events = anthropic_json(&res.body).len() as u32;
        assert!(began.elapsed() >= Duration::from_millis(30) * (n_events - 1));
    }

    #[test]
    fn start_at_holds_the_stream_until_then() {
        let now_ns = || {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        };
        let start_ms = now_ns() / 1_000_000 + 150;
        let addr = start(&format!(
            r#"{{"turns":[{{"stamps":2,"faults":[{{"start_at_ms":{start_ms}}}]}},{{"stamps":1,"faults":[{{"start_at_ms":1}}]}}]}}"#
        ));
        let mut client = Client::connect(addr);
        let res = client.call(&anthropic(ANTHROPIC_BODY));
        let stamps: Vec<u128> = anthropic_json(&res.body)
            .iter()
            .filter_map(|e| e["delta"]["text"].as_str())
            .map(|t| t.trim_matches(['@', ' ']).parse().unwrap())
            .collect();
        assert_eq!(stamps.len(), 2);
        assert!(
            stamps.iter().all(|&s| s >= start_ms * 1_000_000),
            "{stamps:?}"
        );
        // A moment already past holds nothing back.
        let res = client.call(&anthropic(ANTHROPIC_BODY));
        assert_eq!(res.end, End::Complete);
        let bad = Script::parse(r#"{"turns":[{"faults":[{"status":529,"start_at_ms":5}]}]}"#);
        assert!(bad.unwrap_err().contains("cannot be combined"));
    }

    #[test]
    fn stamped_deltas_carry_their_send_time() {
        let addr = start(r#"{"turns":[{"text":"hi","stamps":3},{"stamps":2}]}"#);
        let mut client = Client::connect(addr);
        let before = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let res = client.call(&anthropic(ANTHROPIC_BODY));
        let texts: Vec<String> = anthropic_json(&res.body)
            .iter()
            .filter(|e| e["delta"]["type"] == "text_delta")
            .map(|e| e["delta"]["text"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(texts.len(), 4, "{texts:?}");
        assert_eq!(texts[0], "hi");
        for stamp in &texts[1..] {
            let digits = stamp.strip_prefix('@').unwrap().strip_suffix(' ').unwrap();
            assert_eq!(digits.len(), 19, "{stamp:?}");
            assert!(digits.parse::<u128>().unwrap() >= before, "{stamp:?}");
        }
        // On the OpenAI wire too, a turn of stamps alone is a text turn.
        let res = Client::connect(addr).call(&openai(OPENAI_BODY));
        let (chunks, _) = openai_chunks(&res.body);
        let stamps: Vec<&str> = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .filter(|t| t.starts_with('@'))
            .collect();
        assert_eq!(stamps.len(), 2, "{chunks:?}");
    }

    #[test]
    fn drop_after_events_then_next_turn() {
        let addr = start(
            r#"{"turns":[{"text":"lost words here","faults":[{"drop_after_events":3}]},
                         {"text":"second"}]}"#,
        );
        let mut client = Client::connect(addr);
        let res = client.call(&anthropic(ANTHROPIC_BODY));
        assert_eq!(res.status, 200);
        assert_eq!(res.end, End::Eof, "no terminating chunk");
        assert_eq!(
            types(&anthropic_json(&res.body)),
            ["message_start", "content_block_start", "ping"]
        );
        // The dropped stream consumed its turn: a retry gets the next one.
        let res = Client::connect(addr).call(&openai(OPENAI_BODY));
        let (chunks, _) = openai_chunks(&res.body);
        assert_eq!(chunks[1]["choices"][0]["delta"]["content"], "second");
        assert_eq!(chunks[1]["id"], "chatcmpl-stub2");
    }

    #[test]
    fn stall_after_events_keeps_the_socket_silent() {
        let addr = start(
            r#"{"turns":[{"text":"never finished","faults":[{"stall_after_events":2}]},{"text":"next"}]}"#,
        );
        let mut client = Client::connect(addr);
        client
            .stream
            .set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        let res = client.call(&openai(OPENAI_BODY));
        assert_eq!(res.status, 200);
        assert_eq!(res.end, End::Timeout);
        let (chunks, done) = openai_chunks(&res.body);
        assert!(!done);
        assert_eq!(
            chunks.len(),
            2,
            "role chunk and first content chunk, then silence"
        );
        assert_eq!(
            chunks[1]["choices"][0]["delta"]["content"],
            "never finished"
        );
        drop(client);
        let res = Client::connect(addr).call(&openai(OPENAI_BODY));
        assert_eq!(res.status, 200);
        assert!(res.text().contains("\"next\""));
    }

    /// Everything the stub sends for `request` within `how_long`: a stream that never ends
    /// and never pauses cannot be read to a timeout.
    fn read_for(addr: SocketAddr, request: &[u8], how_long: Duration) -> String {
        let mut stream = TcpStream::connect(addr).expect("connect");
        stream.write_all(request).expect("send");
        stream
            .set_read_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        let deadline = Instant::now() + how_long;
        let mut raw = Vec::new();
        let mut buf = [0u8; 8192];
        while Instant::now() < deadline {
            match stream.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => raw.extend_from_slice(&buf[..n]),
                Err(_) => {}
            }
        }
        String::from_utf8_lossy(&raw).into_owned()
    }

    #[test]
    fn ping_after_events_sends_only_keep_alives() {
        let turn = r#"{"text":"never finished","faults":[{"ping_after_events":1}]}"#;
        let addr = start(&format!(r#"{{"turns":[{turn},{turn}]}}"#));
        let wait = Duration::from_millis(450);
        let text = read_for(addr, &anthropic(ANTHROPIC_BODY), wait);
        assert!(text.contains("event: message_start"), "{text}");
        assert!(
            text.matches("event: ping\ndata: {\"type\": \"ping\"}\n\n")
                .count()
                >= 2,
            "{text}"
        );
        assert!(!text.contains("content_block"), "{text}");
        let text = read_for(addr, &openai(OPENAI_BODY), wait);
        assert_eq!(text.matches("chat.completion.chunk").count(), 1, "{text}");
        assert!(text.matches(": ping\n\n").count() >= 2, "{text}");
    }

    #[test]
    fn repeat_after_events_streams_one_delta_forever() {
        let addr = start(r#"{"turns":[{"text":"again","faults":[{"repeat_after_events":2}]}]}"#);
        let text = read_for(addr, &openai(OPENAI_BODY), Duration::from_millis(450));
        assert!(text.matches(r#""content":"again""#).count() >= 3, "{text}");
        assert!(!text.contains("[DONE]") && !text.contains("finish_reason\":\"stop"));
        let err = Script::parse(r#"{"turns":[{"faults":[{"repeat_after_events":0}]}]}"#);
        assert!(err.unwrap_err().contains("needs an event to repeat"));
        let err = Script::parse(
            r#"{"turns":[{"faults":[{"ping_after_events":1,"stall_after_events":1}]}]}"#,
        );
        assert!(
            err.unwrap_err()
                .contains("\"stall_after_events\" and \"ping_after_events\" exclude each other")
        );
    }

    // -- connections, exhaustion, validation, stub routes --------------------------------

    #[test]
    fn keep_alive_and_pipelining() {
        let addr = start(r#"{"turns":[{"text":"first"},{"text":"second"},{"text":"third"}]}"#);
        let mut client = Client::connect(addr);
        let res = client.call(&anthropic(ANTHROPIC_BODY));
        assert_eq!(res.header("connection"), Some("keep-alive"));
        assert!(res.text().contains("\"first\""));
        // Two requests in one write: answered in order on the same connection.
        let mut both = anthropic(ANTHROPIC_BODY);
        both.extend(openai(OPENAI_BODY));
        client.send(&both);
        let second = client.response();
        let third = client.response();
        assert!(second.text().contains("\"second\""));
        assert!(third.text().contains("\"third\""));
        assert!(third.text().ends_with("data: [DONE]\n\n"));
    }

    #[test]
    fn hang_up_and_close_after_and_connection_numbers() {
        let addr = start(
            r#"{"turns":[{"text":"one","faults":[{"close_after":true}]},
                         {"text":"two","faults":[{"hang_up":true}]}]}"#,
        );
        let mut first = Client::connect(addr);
        let res = first.call(&anthropic(ANTHROPIC_BODY));
        // The head promised keep-alive; the server closes anyway.
        assert_eq!(res.header("connection"), Some("keep-alive"));
        assert!(res.text().contains("\"one\""));
        assert!(matches!(first.more(), Err(End::Eof)));
        // No byte of response, and the turn is still there for the next request.
        let mut second = Client::connect(addr);
        second.send(&anthropic(ANTHROPIC_BODY));
        assert!(matches!(second.more(), Err(End::Eof)));
        assert!(second.buf.is_empty());
        let mut third = Client::connect(addr);
        assert!(
            third
                .call(&anthropic(ANTHROPIC_BODY))
                .text()
                .contains("\"two\"")
        );
        let log = third.call(&get("/_stub/requests")).json();
        let conns: Vec<u64> = log
            .as_array()
            .expect("log")
            .iter()
            .map(|r| r["connection"].as_u64().expect("connection"))
            .collect();
        assert_eq!(conns, [1, 2, 3]);
        assert!(
            Script::parse(r#"{"turns":[{"faults":[{"hang_up":true,"delay_ms":1}]}]}"#).is_err()
        );
        assert!(
            Script::parse(r#"{"turns":[{"faults":[{"status":500,"close_after":true}]}]}"#).is_err()
        );
    }

    #[test]
    fn connection_close_is_honoured() {
        let addr = start(r#"{"turns":[{"text":"bye"}]}"#);
        let mut client = Client::connect(addr);
        let body = ANTHROPIC_BODY;
        let req = post(
            "/v1/messages",
            &[("anthropic-version", "2023-06-01"), ("connection", "close")],
            body,
        );
        let res = client.call(&req);
        assert_eq!(res.header("connection"), Some("close"));
        assert_eq!(client.more(), Err(End::Eof));
    }

    #[test]
    fn exhaustion_and_repeat_last() {
        let addr = start(r#"{"turns":[{"text":"only"}]}"#);
        let mut client = Client::connect(addr);
        assert_eq!(client.call(&anthropic(ANTHROPIC_BODY)).status, 200);
        let res = client.call(&anthropic(ANTHROPIC_BODY));
        assert_eq!(res.status, 500);
        let body = res.json();
        assert_eq!(body["error"]["type"], "api_error");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(
            message.starts_with("stub-model script exhausted"),
            "{message}"
        );
        let res = client.call(&openai(OPENAI_BODY));
        assert_eq!(res.status, 500);
        assert_eq!(res.json()["error"]["type"], "server_error");

        let addr = start(r#"{"turns":[{"tool_calls":[{"name":"Read"}]}],"repeat_last":true}"#);
        let mut client = Client::connect(addr);
        for round in 1..=3 {
            let res = client.call(&anthropic(ANTHROPIC_BODY));
            assert_eq!(res.status, 200);
            let events = anthropic_json(&res.body);
            assert_eq!(events[0]["message"]["id"], format!("msg_stub_{round}"));
        }
    }

    /// The text a streamed Anthropic response carries.
    fn streamed_text(res: &Response) -> String {
        anthropic_json(&res.body)
            .iter()
            .filter_map(|e| e["delta"]["text"].as_str().map(str::to_string))
            .collect()
    }

    #[test]
    fn match_on_tools_serves_side_requests_in_any_order() {
        // An agent's main loop (with tools) and its side requests (a title, without tools),
        // arriving interleaved: each gets its own turns, the reusable side turn every time.
        let addr = start(
            r#"{"turns":[
                {"match":{"tools":true},"text":"first"},
                {"match":{"tools":true},"text":"second"},
                {"match":{"tools":false},"reuse":true,"text":"{\"title\": \"T\"}"}]}"#,
        );
        let with_tools = r#"{"model":"m","max_tokens":8,"stream":true,"tools":[{"name":"Read","input_schema":{"type":"object"}}],"messages":[{"role":"user","content":"hi"}]}"#;
        let empty_tools = r#"{"model":"m","max_tokens":8,"stream":true,"tools":[],"messages":[{"role":"user","content":"hi"}]}"#;
        let mut client = Client::connect(addr);
        let side = client.call(&anthropic(ANTHROPIC_BODY));
        assert_eq!(streamed_text(&side), r#"{"title": "T"}"#);
        assert_eq!(streamed_text(&client.call(&anthropic(with_tools))), "first");
        // An empty tools array offers no tools.
        let side = client.call(&anthropic(empty_tools));
        assert_eq!(streamed_text(&side), r#"{"title": "T"}"#);
        assert_eq!(
            streamed_text(&client.call(&anthropic(with_tools))),
            "second"
        );
        let res = client.call(&anthropic(with_tools));
        assert_eq!(res.status, 500);
        let message = res.json()["error"]["message"].as_str().unwrap().to_string();
        assert!(
            message.starts_with("stub-model script exhausted") && message.contains("2 of 3"),
            "{message}"
        );
        // The OpenAI wire reads `tools` the same way.
        let side = client.call(&openai(OPENAI_BODY));
        assert_eq!(side.status, 200);
        assert!(
            side.text().contains(r#"{\"title\": \"T\"}"#),
            "{}",
            side.text()
        );
    }

    #[test]
    fn match_on_model_and_repeat_last() {
        let addr = start(
            r#"{"turns":[{"match":{"model":"small"},"text":"small"},
                         {"match":{"model":"claude-test"},"text":"big"}],
                "repeat_last":true}"#,
        );
        let mut client = Client::connect(addr);
        let small = ANTHROPIC_BODY.replace("claude-test", "small");
        // The first turn is skipped, not used up, by a request it does not match; the last
        // turn is replayed only to requests it matches.
        assert_eq!(
            streamed_text(&client.call(&anthropic(ANTHROPIC_BODY))),
            "big"
        );
        assert_eq!(
            streamed_text(&client.call(&anthropic(ANTHROPIC_BODY))),
            "big"
        );
        assert_eq!(streamed_text(&client.call(&anthropic(&small))), "small");
        assert_eq!(client.call(&anthropic(&small)).status, 500);
        let other = ANTHROPIC_BODY.replace("claude-test", "other");
        assert_eq!(client.call(&anthropic(&other)).status, 500);
        assert_eq!(
            streamed_text(&client.call(&anthropic(ANTHROPIC_BODY))),
            "big"
        );
    }

    #[test]
    fn status_faults_of_a_reusable_turn_do_not_use_it_up() {
        let addr = start(
            r#"{"turns":[{"reuse":true,"text":"again","faults":[{"status":529}]},
                         {"text":"never"}]}"#,
        );
        let mut client = Client::connect(addr);
        assert_eq!(client.call(&anthropic(ANTHROPIC_BODY)).status, 529);
        for _ in 0..3 {
            assert_eq!(
                streamed_text(&client.call(&anthropic(ANTHROPIC_BODY))),
                "again"
            );
        }
    }

    #[test]
    fn invalid_requests_get_provider_errors_and_keep_the_turn() {
        let addr = start(r#"{"turns":[{"text":"kept"}]}"#);
        let mut client = Client::connect(addr);
        let no_version = post("/v1/messages", &[], ANTHROPIC_BODY);
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (no_version, "anthropic-version: header is required"),
            (
                anthropic(r#"{"max_tokens":1,"stream":true,"messages":[]}"#),
                "model: Field required",
            ),
            (
                anthropic(r#"{"model":"m","stream":true,"messages":[]}"#),
                "max_tokens: Field required",
            ),
            (
                anthropic(r#"{"model":"m","max_tokens":1,"stream":true}"#),
                "messages: Field required",
            ),
            (
                anthropic(r#"{"model":"m","max_tokens":1,"stream":true,"messages":[]}"#),
                "messages: at least one message is required",
            ),
            (
                anthropic(r#"{"model":"m","max_tokens":1,"messages":[{"role":"user"}]}"#),
                "set \"stream\": true",
            ),
            (anthropic("not json"), "error parsing the body"),
        ];
        for (req, want) in cases {
            let res = client.call(&req);
            assert_eq!(res.status, 400, "{want}");
            let body = res.json();
            assert_eq!(body["type"], "error");
            assert_eq!(body["error"]["type"], "invalid_request_error");
            let message = body["error"]["message"].as_str().unwrap();
            assert!(message.contains(want), "{message:?} lacks {want:?}");
        }
        let res = client.call(&openai(r#"{"model":"m","stream":true}"#));
        assert_eq!(res.status, 400);
        assert_eq!(
            res.json(),
            serde_json::json!({"error":{"message":"Missing required parameter: 'messages'.",
                "type":"invalid_request_error","param":"messages","code":"missing_required_parameter"}})
        );
        let res = client.call(&openai(r#"{"model":"m","stream":true,"messages":[]}"#));
        assert_eq!(res.status, 400);
        assert_eq!(res.json()["error"]["code"], "empty_array");
        let res = client.call(&openai(r#"{"model":"m","stream":false,"messages":[{}]}"#));
        assert_eq!(res.status, 400);
        assert_eq!(res.json()["error"]["type"], "invalid_request_error");
        let res = client.call(&get("/v1/messages"));
        assert_eq!(res.status, 405);
        // None of that consumed the turn.
        let res = client.call(&anthropic(ANTHROPIC_BODY));
        assert_eq!(res.status, 200);
        assert!(res.text().contains("\"kept\""));
    }

    #[test]
    fn stub_routes_record_requests() {
        let addr = start(r#"{"turns":[{"text":"a"},{"text":"b"}]}"#);
        let mut client = Client::connect(addr);
        let res = client.call(&get("/_stub/health"));
        assert_eq!((res.status, res.text().as_str()), (200, "ok"));
        assert_eq!(client.call(&get("/nope")).status, 404);
        client.call(&anthropic(ANTHROPIC_BODY));
        let second = r#"{"model":"m","stream":true,"messages":[{"role":"tool","tool_call_id":"call_1","content":"42"}]}"#;
        client.call(&post(
            "/openai/v1/chat/completions?x=1",
            &[("X-Trace", "t1")],
            second,
        ));
        let res = client.call(&get("/_stub/requests"));
        assert_eq!(res.status, 200);
        assert_eq!(res.header("content-type"), Some("application/json"));
        let log = res.json();
        let log = log.as_array().unwrap();
        assert_eq!(log.len(), 3, "{log:?}");
        assert_eq!(log[0]["path"], "/nope");
        assert_eq!(log[0]["body"], Value::Null);
        assert_eq!(log[1]["path"], "/v1/messages");
        assert_eq!(log[1]["headers"]["anthropic-version"], "2023-06-01");
        assert_eq!(log[1]["body"]["max_tokens"], 1024);
        assert_eq!(log[2]["method"], "POST");
        assert_eq!(log[2]["path"], "/openai/v1/chat/completions?x=1");
        assert_eq!(log[2]["headers"]["x-trace"], "t1");
        assert_eq!(log[2]["body"]["messages"][0]["tool_call_id"], "call_1");
    }

    #[test]
    fn oversized_and_garbage_requests() {
        let addr = start(r#"{"turns":[{"text":"a"}]}"#);
        let mut client = Client::connect(addr);
        let huge = format!(
            "POST /v1/messages HTTP/1.1\r\nanthropic-version: 2023-06-01\r\n\
             content-length: {}\r\n\r\n",
            MAX_REQUEST_BODY + 1
        );
        let res = client.call(huge.as_bytes());
        assert_eq!(res.status, 413);
        assert_eq!(res.json()["error"]["type"], "request_too_large");
        assert_eq!(client.more(), Err(End::Eof));

        let mut client = Client::connect(addr);
        let res = client.call(b"\x00\x01 garbage\r\n\r\n");
        assert_eq!(res.status, 400);
        assert_eq!(client.more(), Err(End::Eof));

        // The server still serves, and the turn is intact.
        let res = Client::connect(addr).call(&anthropic(ANTHROPIC_BODY));
        assert_eq!(res.status, 200);
    }

    #[test]
    fn expect_continue_is_answered() {
        let addr = start(r#"{"turns":[{"text":"a"}]}"#);
        let mut client = Client::connect(addr);
        let head = format!(
            "POST /v1/messages HTTP/1.1\r\nanthropic-version: 2023-06-01\r\n\
             expect: 100-continue\r\ncontent-length: {}\r\n\r\n",
            ANTHROPIC_BODY.len()
        );
        let interim = client.call(head.as_bytes());
        assert_eq!(interim.status, 100);
        let res = client.call(ANTHROPIC_BODY.as_bytes());
        assert_eq!(res.status, 200);
        assert_eq!(res.end, End::Complete);
    }

    #[test]
    fn http10_stream_is_close_delimited() {
        let addr = start(r#"{"turns":[{"text":"old client"}]}"#);
        let mut client = Client::connect(addr);
        let req = String::from_utf8(anthropic(ANTHROPIC_BODY))
            .unwrap()
            .replacen("HTTP/1.1", "HTTP/1.0", 1);
        let res = client.call(req.as_bytes());
        assert_eq!(res.status, 200);
        assert_eq!(res.header("transfer-encoding"), None);
        assert_eq!(res.end, End::Eof);
        assert!(
            res.text()
                .ends_with("event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n")
        );
    }

    #[test]
    fn streams_decode_with_the_project_sse_decoder() {
        use crate::http::sse::SseDecoder;

        let addr = start(
            r#"{"turns":[{"thinking":"hmm, let me think about it","text":"Done — «ünïcödé» ok.\nSecond line here.",
                "tool_calls":[{"name":"Write","input":{"path":"a.txt","content":"x\ny"}}]},
                {"text":"and the OpenAI one","tool_calls":[{"name":"Read","input":{"path":"é"}}]}]}"#,
        );
        let mut client = Client::connect(addr);
        for req in [anthropic(ANTHROPIC_BODY), openai(OPENAI_BODY)] {
            let res = client.call(&req);
            let ours = sse(&res.body);
            // Feed the body in awkward 7-byte pieces, as TCP might deliver it.
            let mut decoder = SseDecoder::new();
            let mut decoded = Vec::new();
            for piece in res.body.chunks(7) {
                decoder.feed(piece, &mut decoded).expect("valid SSE");
            }
            assert_eq!(decoded.len(), ours.len());
            for (got, (name, data)) in decoded.iter().zip(&ours) {
                assert_eq!(got.event, name.as_deref().unwrap_or("message"));
                assert_eq!(&got.data, data);
            }
        }
    }

    #[test]
    fn chunked_request_body_is_accepted() {
        let addr = start(r#"{"turns":[{"text":"chunked ok"}]}"#);
        let mut client = Client::connect(addr);
        let (left, right) = ANTHROPIC_BODY.split_at(20);
        let req = format!(
            "POST /v1/messages HTTP/1.1\r\nanthropic-version: 2023-06-01\r\n\
             transfer-encoding: chunked\r\n\r\n{:x}\r\n{left}\r\n{:x}\r\n{right}\r\n0\r\n\r\n",
            left.len(),
            right.len()
        );
        let res = client.call(req.as_bytes());
        assert_eq!(res.status, 200);
        assert!(res.text().contains("\"chunked ok\""));
        let log = client.call(&get("/_stub/requests")).json();
        assert_eq!(log[0]["body"]["model"], "claude-test");
    }
}
