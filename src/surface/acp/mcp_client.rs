//! The editor's MCP servers (`mcpServers` of `session/new`, `session/load`, `session/resume`):
//! caliban as an MCP client over a child's newline-delimited stdio.
//!
//! `Client` is the sans-IO protocol: `initialize`, `notifications/initialized`, `tools/list`
//! (every page), then `tools/call`s; bytes in, bytes out, events for the host. `Server` owns
//! the child process (its own process group) and its non-blocking pipes, which the ACP host
//! registers on the reactor. Nothing here blocks, buffers are capped, and no server output
//! can make it panic.

use std::borrow::Cow;
use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};

use mio::unix::pipe;
use mio::{Interest, Registry, Token};
use serde_json::{Value, json};

use crate::jsonrpc::{self, Id, Message, RpcError};
use crate::model::types::ToolSpec;
use crate::tools::ToolOutput;
use crate::{reaper, sys};

/// The MCP revision asked for in `initialize`.
pub const PROTOCOL_VERSION: &str = "2025-06-18";
/// The prefix of the tools these servers offer, as the model sees them.
pub const TOOL_PREFIX: &str = "mcp__";
/// Most tools taken from one server; the rest are dropped with a warning.
const MAX_TOOLS: usize = 256;
/// Most `tools/list` pages followed (a server that keeps returning a cursor).
const MAX_PAGES: usize = 64;
/// Bytes queued for a server's stdin before further requests are refused.
const MAX_OUTBOX: usize = 32 * 1024 * 1024;
/// A tool result's text beyond this is cut.
const MAX_RESULT_TEXT: usize = 256 * 1024;
/// Longest name part (server or tool) kept in a model-facing tool name; providers cap the
/// whole name at 64 or 128 characters.
const MAX_NAME_PART: usize = 28;

/// A stdio server as the client configured it.
#[derive(Clone, Debug, PartialEq)]
pub struct ServerConfig {
    pub name: String,
    pub command: String,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
}

/// Reads `mcpServers`: the stdio servers, plus a warning for each one that cannot be used.
pub fn parse_servers(params: &Value) -> (Vec<ServerConfig>, Vec<String>) {
    let mut servers = Vec::new();
    let mut warnings = Vec::new();
    let Some(list) = params.get("mcpServers").and_then(Value::as_array) else {
        return (servers, warnings);
    };
    for raw in list {
        let name = raw.get("name").and_then(Value::as_str).unwrap_or("");
        let kind = raw.get("type").and_then(Value::as_str).unwrap_or("stdio");
        if kind != "stdio" {
            warnings.push(format!(
                "MCP server `{name}`: {kind} servers are not supported (only stdio); skipping it"
            ));
            continue;
        }
        let Some(command) = raw.get("command").and_then(Value::as_str) else {
            warnings.push(format!("MCP server `{name}`: no `command`; skipping it"));
            continue;
        };
        if name.is_empty() {
            warnings.push("an MCP server without a `name`; skipping it".to_owned());
            continue;
        }
        if servers.iter().any(|s: &ServerConfig| s.name == name) {
            warnings.push(format!(
                "MCP server `{name}` is listed twice; using the first"
            ));
            continue;
        }
        let args = raw
            .get("args")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_str)
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default();
        let env = match raw.get("env") {
            Some(Value::Array(vars)) => vars
                .iter()
                .filter_map(|v| {
                    Some((
                        v.get("name")?.as_str()?.to_owned(),
                        v.get("value")?.as_str()?.to_owned(),
                    ))
                })
                .collect(),
            Some(Value::Object(vars)) => vars
                .iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned())))
                .collect(),
            _ => Vec::new(),
        };
        servers.push(ServerConfig {
            name: name.to_owned(),
            command: command.to_owned(),
            args,
            env,
        });
    }
    (servers, warnings)
}

/// A name part providers accept: ASCII letters, digits, `_` and `-`.
fn sanitize(part: &str) -> String {
    let mut out: String = part
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .take(MAX_NAME_PART)
        .collect();
    if out.is_empty() {
        out.push('_');
    }
    out
}

/// The model-facing name of a server's tool.
pub fn tool_name(server: &str, tool: &str) -> String {
    format!("{TOOL_PREFIX}{}__{}", sanitize(server), sanitize(tool))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// `initialize` or `tools/list` is in flight.
    Starting,
    /// Tools are listed; calls may be made.
    Ready,
    /// The server failed or exited; it offers nothing.
    Failed,
}

/// What a request of ours is for.
enum Pending {
    Initialize,
    List,
    Call { tool_use_id: String },
}

/// Something the host must act on.
#[derive(Debug, PartialEq)]
pub enum Event {
    /// The tool list is complete (or the server failed): the phase left `Starting`.
    Settled,
    /// A `tools/call` was answered.
    CallDone {
        tool_use_id: String,
        output: ToolOutput,
    },
}

/// One server's MCP client state. Sans-IO: lines in, bytes out.
pub struct Client {
    server: String,
    phase: Phase,
    next_id: i64,
    pending: HashMap<i64, Pending>,
    pages: usize,
    tools: Vec<ToolSpec>,
    /// Model-facing name → the server's own tool name.
    names: HashMap<String, String>,
    out: Vec<u8>,
    /// Why the server failed, once it did.
    failure: Option<String>,
}

impl Client {
    /// A client whose `initialize` request is already queued.
    pub fn new(server: &str) -> Client {
        let mut client = Client {
            server: server.to_owned(),
            phase: Phase::Starting,
            next_id: 1,
            pending: HashMap::new(),
            pages: 0,
            tools: Vec::new(),
            names: HashMap::new(),
            out: Vec::new(),
            failure: None,
        };
        client.send_request(
            "initialize",
            json!({
                "protocolVersion": PROTOCOL_VERSION,
                "capabilities": {},
                "clientInfo": {"name": "caliban", "version": env!("CARGO_PKG_VERSION")},
            }),
            Pending::Initialize,
        );
        client
    }

    pub fn phase(&self) -> Phase {
        self.phase
    }

    pub fn name(&self) -> &str {
        &self.server
    }

    /// Why the server failed, once it did.
    pub fn failure(&self) -> Option<&str> {
        self.failure.as_deref()
    }

    /// The tools offered to the model (only once `Ready`).
    pub fn tools(&self) -> &[ToolSpec] {
        if self.phase == Phase::Ready {
            &self.tools
        } else {
            &[]
        }
    }

    pub fn has_tool(&self, model_name: &str) -> bool {
        self.phase == Phase::Ready && self.names.contains_key(model_name)
    }

    /// Bytes waiting for the server's stdin.
    pub fn outgoing(&mut self) -> &mut Vec<u8> {
        &mut self.out
    }

    fn send(&mut self, message: &Message) -> bool {
        let line = jsonrpc::to_line(message);
        if self.out.len() + line.len() > MAX_OUTBOX {
            return false;
        }
        self.out.extend_from_slice(&line);
        true
    }

    fn send_request(&mut self, method: &str, params: Value, pending: Pending) -> bool {
        let id = self.next_id;
        self.next_id += 1;
        let sent = self.send(&Message::Request {
            id: Id::Num(id),
            method: method.to_owned(),
            params,
        });
        if sent {
            self.pending.insert(id, pending);
        }
        sent
    }

    /// Calls a tool by its model-facing name. An immediate answer (a call that cannot be
    /// made) comes back as `Some`.
    pub fn call(
        &mut self,
        tool_use_id: &str,
        model_name: &str,
        input: &Value,
    ) -> Option<ToolOutput> {
        if self.phase != Phase::Ready {
            return Some(ToolOutput::error(format!(
                "MCP server `{}` is not available{}",
                self.server,
                self.failure
                    .as_deref()
                    .map(|f| format!(": {f}"))
                    .unwrap_or_default()
            )));
        }
        let Some(tool) = self.names.get(model_name).cloned() else {
            return Some(ToolOutput::error(format!(
                "MCP server `{}` has no tool `{model_name}`",
                self.server
            )));
        };
        let arguments = if input.is_object() {
            input.clone()
        } else {
            json!({})
        };
        let sent = self.send_request(
            "tools/call",
            json!({"name": tool, "arguments": arguments}),
            Pending::Call {
                tool_use_id: tool_use_id.to_owned(),
            },
        );
        (!sent).then(|| {
            ToolOutput::error(format!(
                "MCP server `{}` is not reading its input; the call was not sent",
                self.server
            ))
        })
    }

    /// The server is gone (its output ended, or it was killed): every open call is answered.
    pub fn fail(&mut self, why: &str) -> Vec<Event> {
        let mut events = Vec::new();
        if self.phase == Phase::Starting {
            events.push(Event::Settled);
        }
        self.phase = Phase::Failed;
        if self.failure.is_none() {
            self.failure = Some(why.to_owned());
        }
        let mut calls: Vec<(i64, Pending)> = self.pending.drain().collect();
        calls.sort_by_key(|c| c.0);
        for (_, pending) in calls {
            if let Pending::Call { tool_use_id } = pending {
                events.push(Event::CallDone {
                    tool_use_id,
                    output: ToolOutput::error(format!("MCP server `{}` {why}", self.server)),
                });
            }
        }
        self.out.clear();
        events
    }

    /// One line of the server's stdout (without its newline).
    pub fn on_line(&mut self, line: &[u8]) -> Vec<Event> {
        match jsonrpc::parse(line) {
            Ok(Some(Message::Response {
                id: Id::Num(id),
                result,
            })) => match self.pending.remove(&id) {
                Some(pending) => self.on_response(pending, result),
                None => Vec::new(),
            },
            Ok(Some(Message::Request { id, method, .. })) => {
                // We offer no client features (roots, sampling, elicitation); a ping is
                // answered.
                let reply = if method == "ping" {
                    jsonrpc::response(id, json!({}))
                } else {
                    jsonrpc::error_response(id, RpcError::method_not_found(&method))
                };
                self.send(&reply);
                Vec::new()
            }
            // Logging, progress and list-changed notifications are not acted on.
            Ok(_) => Vec::new(),
            Err(_) => {
                crate::log::warn(&format!(
                    "MCP server `{}` wrote a line that is not JSON-RPC; ignoring it",
                    self.server
                ));
                Vec::new()
            }
        }
    }

    fn on_response(&mut self, pending: Pending, result: Result<Value, RpcError>) -> Vec<Event> {
        match pending {
            Pending::Initialize => match result {
                Ok(_) => {
                    self.send(&jsonrpc::notification(
                        "notifications/initialized",
                        Value::Null,
                    ));
                    self.list(None)
                }
                Err(e) => self.fail(&format!("refused `initialize`: {}", e.message)),
            },
            Pending::List => match result {
                Ok(page) => self.on_tools_page(&page),
                Err(e) => self.fail(&format!("refused `tools/list`: {}", e.message)),
            },
            Pending::Call { tool_use_id } => vec![Event::CallDone {
                tool_use_id,
                output: call_output(result),
            }],
        }
    }

    fn list(&mut self, cursor: Option<&str>) -> Vec<Event> {
        self.pages += 1;
        let params = match cursor {
            Some(c) => json!({"cursor": c}),
            None => json!({}),
        };
        if self.send_request("tools/list", params, Pending::List) {
            Vec::new()
        } else {
            self.fail("is not reading its input")
        }
    }

    fn on_tools_page(&mut self, page: &Value) -> Vec<Event> {
        for tool in page
            .get("tools")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or_default()
        {
            let Some(name) = tool.get("name").and_then(Value::as_str) else {
                continue;
            };
            if self.tools.len() >= MAX_TOOLS {
                crate::log::warn(&format!(
                    "MCP server `{}` offers more than {MAX_TOOLS} tools; the rest are not offered",
                    self.server
                ));
                break;
            }
            let model_name = tool_name(&self.server, name);
            if self.names.contains_key(&model_name) {
                crate::log::warn(&format!(
                    "MCP server `{}`: tool `{name}` clashes with another as `{model_name}`; \
                     skipping it",
                    self.server
                ));
                continue;
            }
            let description = tool
                .get("description")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_owned();
            let mut schema = tool
                .get("inputSchema")
                .filter(|s| s.is_object())
                .cloned()
                .unwrap_or_else(|| json!({"type": "object"}));
            if schema.get("type").is_none() {
                schema["type"] = json!("object");
            }
            self.names.insert(model_name.clone(), name.to_owned());
            self.tools.push(ToolSpec {
                name: Cow::Owned(model_name),
                description: Cow::Owned(description),
                input_schema: schema,
            });
        }
        let cursor = page
            .get("nextCursor")
            .and_then(Value::as_str)
            .filter(|c| !c.is_empty());
        match cursor {
            Some(cursor) if self.pages < MAX_PAGES && self.tools.len() < MAX_TOOLS => {
                let cursor = cursor.to_owned();
                self.list(Some(&cursor))
            }
            _ => {
                self.phase = Phase::Ready;
                vec![Event::Settled]
            }
        }
    }
}

/// A `tools/call` answer as a tool result: its text content, `isError` an error.
fn call_output(result: Result<Value, RpcError>) -> ToolOutput {
    let result = match result {
        Ok(r) => r,
        Err(e) => return ToolOutput::error(format!("MCP error {}: {}", e.code, e.message)),
    };
    let mut text = String::new();
    for block in result
        .get("content")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default()
    {
        let piece = match block.get("type").and_then(Value::as_str) {
            Some("text") => block.get("text").and_then(Value::as_str).map(Cow::Borrowed),
            Some(other) => Some(Cow::Owned(format!("[{other} content not shown]"))),
            None => None,
        };
        if let Some(piece) = piece {
            if !text.is_empty() {
                text.push('\n');
            }
            text.push_str(&piece);
        }
    }
    if text.is_empty()
        && let Some(structured) = result.get("structuredContent")
    {
        text = structured.to_string();
    }
    if text.len() > MAX_RESULT_TEXT {
        let cut = text.floor_char_boundary(MAX_RESULT_TEXT);
        let dropped = text.len() - cut;
        text.truncate(cut);
        text.push_str(&format!("\n[… {dropped} more bytes not shown]"));
    }
    ToolOutput {
        is_error: result.get("isError").and_then(Value::as_bool) == Some(true),
        text,
    }
}

/// Splits a byte stream into lines, each at most `jsonrpc::MAX_MESSAGE_BYTES`; a longer line
/// is dropped whole.
#[derive(Default)]
pub struct LineReader {
    buf: Vec<u8>,
    /// Skipping the rest of an oversized line.
    skipping: bool,
}

impl LineReader {
    pub fn push(&mut self, mut bytes: &[u8], mut each: impl FnMut(&[u8])) {
        while !bytes.is_empty() {
            match bytes.iter().position(|&b| b == b'\n') {
                Some(at) => {
                    if !self.skipping {
                        self.buf.extend_from_slice(&bytes[..at]);
                        each(&self.buf);
                    }
                    self.buf.clear();
                    self.skipping = false;
                    bytes = &bytes[at + 1..];
                }
                None => {
                    if !self.skipping {
                        self.buf.extend_from_slice(bytes);
                        if self.buf.len() > jsonrpc::MAX_MESSAGE_BYTES {
                            crate::log::warn("an MCP server wrote an oversized line; dropping it");
                            self.buf = Vec::new();
                            self.skipping = true;
                        }
                    }
                    bytes = &[];
                }
            }
        }
    }
}

/// A running server: the child, its pipes, and the client speaking to it.
pub struct Server {
    pub client: Client,
    child: Child,
    pgid: u32,
    stdin: Option<pipe::Sender>,
    stdout: Option<pipe::Receiver>,
    lines: LineReader,
    pub tokens: [Token; 2],
    reaped: bool,
}

impl Server {
    /// Starts the server in its own process group, in the sandbox MCP servers get
    /// (`sandbox::mcp_server`); its stderr is ours.
    pub fn spawn(config: &ServerConfig, cwd: &Path) -> io::Result<Server> {
        let mut cmd = Command::new(&config.command);
        cmd.args(&config.args)
            .envs(config.env.iter().map(|(k, v)| (k, v)))
            .current_dir(cwd)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = reaper::spawn(&mut cmd, None, crate::sandbox::mcp_server(cwd)?)?;
        let pgid = child.id();
        let pipes = (|| -> io::Result<(pipe::Sender, pipe::Receiver)> {
            let stdin = pipe::Sender::from(child.stdin.take().ok_or(io::ErrorKind::BrokenPipe)?);
            let stdout =
                pipe::Receiver::from(child.stdout.take().ok_or(io::ErrorKind::BrokenPipe)?);
            stdin.set_nonblocking(true)?;
            stdout.set_nonblocking(true)?;
            Ok((stdin, stdout))
        })();
        let (stdin, stdout) = match pipes {
            Ok(p) => p,
            Err(e) => {
                let _ = sys::kill_group(pgid, sys::SIGKILL);
                let _ = child.kill();
                let _ = reaper::wait(&mut child);
                return Err(e);
            }
        };
        Ok(Server {
            client: Client::new(&config.name),
            child,
            pgid,
            stdin: Some(stdin),
            stdout: Some(stdout),
            lines: LineReader::default(),
            tokens: [Token(usize::MAX), Token(usize::MAX)],
            reaped: false,
        })
    }

    pub fn pid(&self) -> u32 {
        self.pgid
    }

    /// Registers the pipes: `tokens[0]` for stdout, `tokens[1]` for stdin.
    pub fn register(&mut self, registry: &Registry, tokens: [Token; 2]) -> io::Result<()> {
        self.tokens = tokens;
        if let Some(p) = self.stdout.as_mut() {
            registry.register(p, tokens[0], Interest::READABLE)?;
        }
        if let Some(p) = self.stdin.as_mut() {
            registry.register(p, tokens[1], Interest::WRITABLE)?;
        }
        Ok(())
    }

    /// Writes what the client queued until the pipe is full. A broken pipe fails the server.
    pub fn flush(&mut self, registry: &Registry) -> Vec<Event> {
        let Some(pipe) = self.stdin.as_mut() else {
            self.client.outgoing().clear();
            return Vec::new();
        };
        loop {
            let out = self.client.outgoing();
            if out.is_empty() {
                return Vec::new();
            }
            match pipe.write(out) {
                Ok(0) => break,
                Ok(n) => {
                    out.drain(..n);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Vec::new(),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => break,
            }
        }
        self.close(registry);
        self.client.fail("stopped reading its input")
    }

    /// Reads stdout until it would block; at EOF the server is taken as gone.
    pub fn read(&mut self, registry: &Registry) -> Vec<Event> {
        let mut events = Vec::new();
        let Some(pipe) = self.stdout.as_mut() else {
            return events;
        };
        let mut buf = [0u8; 16 * 1024];
        loop {
            match pipe.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    let client = &mut self.client;
                    self.lines
                        .push(&buf[..n], |line| events.extend(client.on_line(line)));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    // Answers to the server's requests, and requests that followed a response.
                    events.extend(self.flush(registry));
                    return events;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => break,
            }
        }
        self.close(registry);
        events.extend(self.client.fail("exited"));
        events
    }

    fn close(&mut self, registry: &Registry) {
        if let Some(mut p) = self.stdout.take() {
            let _ = registry.deregister(&mut p);
        }
        if let Some(mut p) = self.stdin.take() {
            let _ = registry.deregister(&mut p);
        }
    }

    /// Kills the process group and reaps the child (SIGKILL makes the wait short).
    pub fn kill(&mut self, registry: &Registry) -> Vec<Event> {
        self.close(registry);
        self.terminate();
        self.client.fail("was stopped")
    }

    fn terminate(&mut self) {
        if self.reaped {
            return;
        }
        // The group is killed while the leader is still unreaped, so its id is not reused.
        let _ = sys::kill_group(self.pgid, sys::SIGKILL);
        let _ = self.child.kill();
        let _ = reaper::wait(&mut self.child);
        self.reaped = true;
    }
}

impl Drop for Server {
    /// However a server is dropped, its process group does not outlive it.
    fn drop(&mut self) {
        self.terminate();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(client: &mut Client) -> Vec<Value> {
        let out = std::mem::take(client.outgoing());
        out.split(|&b| b == b'\n')
            .filter(|l| !l.is_empty())
            .map(|l| serde_json::from_slice(l).unwrap())
            .collect()
    }

    #[test]
    fn handshake_lists_every_page_then_calls() {
        let mut c = Client::new("my server");
        let sent = lines(&mut c);
        assert_eq!(sent[0]["method"], "initialize");
        assert_eq!(sent[0]["params"]["protocolVersion"], PROTOCOL_VERSION);
        assert_eq!(sent[0]["params"]["clientInfo"]["name"], "caliban");
        assert!(
            c.on_line(br#"{"jsonrpc":"2.0","id":1,"result":{"capabilities":{}}}"#)
                .is_empty()
        );
        let sent = lines(&mut c);
        assert_eq!(sent[0]["method"], "notifications/initialized");
        assert_eq!(sent[1]["method"], "tools/list");
        assert!(c
            .on_line(br#"{"jsonrpc":"2.0","id":2,"result":{"tools":[{"name":"a.b","description":"A","inputSchema":{"type":"object"}}],"nextCursor":"p2"}}"#)
            .is_empty());
        let sent = lines(&mut c);
        assert_eq!(sent[0]["params"]["cursor"], "p2");
        assert_eq!(c.phase(), Phase::Starting);
        let events = c.on_line(br#"{"jsonrpc":"2.0","id":3,"result":{"tools":[{"name":"c"}]}}"#);
        assert_eq!(events, vec![Event::Settled]);
        let names: Vec<&str> = c.tools().iter().map(|t| t.name.as_ref()).collect();
        assert_eq!(names, ["mcp__my_server__a_b", "mcp__my_server__c"]);
        assert_eq!(c.tools()[1].input_schema, json!({"type": "object"}));
        assert!(
            c.call("tu1", "mcp__my_server__a_b", &json!({"x": 1}))
                .is_none()
        );
        let sent = lines(&mut c);
        assert_eq!(
            sent[0]["params"],
            json!({"name": "a.b", "arguments": {"x": 1}})
        );
        let events = c.on_line(
            br#"{"jsonrpc":"2.0","id":4,"result":{"content":[{"type":"text","text":"no"}],"isError":true}}"#,
        );
        assert_eq!(
            events,
            vec![Event::CallDone {
                tool_use_id: "tu1".into(),
                output: ToolOutput::error("no")
            }]
        );
        assert!(c.call("tu2", "mcp__my_server__zzz", &json!({})).is_some());
    }

    #[test]
    fn garbage_and_exit_never_panic() {
        let mut c = Client::new("s");
        lines(&mut c);
        assert!(c.on_line(b"\xff{not json").is_empty());
        assert!(
            c.on_line(br#"{"jsonrpc":"2.0","id":99,"result":1}"#)
                .is_empty()
        );
        assert!(
            c.on_line(br#"{"jsonrpc":"2.0","id":5,"method":"roots/list"}"#)
                .is_empty()
        );
        assert_eq!(lines(&mut c)[0]["error"]["code"], jsonrpc::METHOD_NOT_FOUND);
        assert_eq!(c.fail("exited"), vec![Event::Settled]);
        assert!(c.tools().is_empty());
        assert!(c.call("t", "mcp__s__x", &json!({})).unwrap().is_error);
    }

    #[test]
    fn line_reader_drops_oversized_lines() {
        let mut r = LineReader::default();
        let mut got = Vec::new();
        r.push(b"ab", |l| got.push(l.to_vec()));
        r.push(b"c\nde\n", |l| got.push(l.to_vec()));
        assert_eq!(got, [b"abc".to_vec(), b"de".to_vec()]);
        got.clear();
        r.push(&vec![b'x'; jsonrpc::MAX_MESSAGE_BYTES + 1], |l| {
            got.push(l.to_vec())
        });
        r.push(b"xx\nok\n", |l| got.push(l.to_vec()));
        assert_eq!(got, [b"ok".to_vec()]);
    }

    #[test]
    fn servers_parse_stdio_and_skip_the_rest() {
        let (servers, warnings) = parse_servers(&json!({"mcpServers": [
            {"name": "a", "command": "/bin/a", "args": ["x"], "env": [{"name": "K", "value": "V"}]},
            {"type": "http", "name": "h", "url": "http://x", "headers": []},
            {"name": "a", "command": "/bin/b", "args": [], "env": []},
        ]}));
        assert_eq!(
            servers,
            [ServerConfig {
                name: "a".into(),
                command: "/bin/a".into(),
                args: vec!["x".into()],
                env: vec![("K".into(), "V".into())],
            }]
        );
        assert_eq!(warnings.len(), 2);
    }
}
