//! One MCP server's client protocol, sans-IO and transport-agnostic: `initialize`,
//! `notifications/initialized`, `tools/list` (every page, and again after
//! `notifications/tools/list_changed`), `tools/call` with a progress token, and
//! `notifications/cancelled`. Messages in, serialized messages out (`take_outgoing`), events
//! for the hub. The stdio and HTTP transports move the bytes; nothing here can block, every
//! buffer is capped, and no server output can make it panic.

use std::borrow::Cow;
use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use serde_json::{Value, json};

use crate::jsonrpc::{self, Ledger, Message, RpcError};
use crate::model::types::ToolSpec;
use crate::tools::ToolOutput;
use crate::tools::mcp_name::{sanitize, server_part, tool_name};

/// The MCP revision asked for in `initialize`; servers may answer with an older one.
pub const PROTOCOL_VERSION: &str = "2025-11-25";
/// Most tools taken from one server; the rest are dropped with a warning.
const MAX_TOOLS: usize = 256;
/// Most `tools/list` pages followed (a server that keeps returning a cursor).
const MAX_PAGES: usize = 64;
/// Bytes queued for a server before further requests are refused (a server that stopped
/// reading must not make caliban grow).
const MAX_OUTBOX: usize = 32 * 1024 * 1024;
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// `initialize` or the first `tools/list` is in flight.
    Starting,
    /// Tools are listed; calls may be made.
    Ready,
    /// The server failed or exited; it offers nothing.
    Failed,
}

/// Who a `tools/call` is for: the engine's run number and the model's tool use id.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CallKey {
    pub run: u64,
    pub tool_use_id: String,
}

/// What a request of ours is for.
enum Pending {
    Initialize,
    List,
    Call {
        key: CallKey,
        /// When the call was sent or last reported progress: the timeout counts from here.
        active: Instant,
    },
}

/// Something the hub must act on.
#[derive(Debug, PartialEq)]
pub enum Event {
    /// The first tool list is complete (or the server failed): the phase left `Starting`.
    Settled,
    /// The server said its tools changed and the new list is complete.
    ToolsChanged,
    /// A `tools/call` was answered.
    CallDone { key: CallKey, output: ToolOutput },
}

/// One server's MCP client state.
pub struct Client {
    server: String,
    phase: Phase,
    /// Our requests to the server, each with what its answer is for.
    pending: Ledger<Pending>,
    pages: usize,
    tools: Vec<ToolSpec>,
    /// The list being read after `list_changed`: it replaces `tools` when complete, so a
    /// run never sees half a list.
    relist: Option<(Vec<ToolSpec>, HashMap<String, String>)>,
    /// A `list_changed` arrived while a list was in flight: list again when it ends.
    relist_again: bool,
    /// Counts the re-lists begun, so the hub's deadline is for the one in flight.
    relists: u64,
    /// Model-facing name → the server's own tool name.
    names: HashMap<String, String>,
    out: VecDeque<Vec<u8>>,
    out_bytes: usize,
    /// The protocol version the server answered `initialize` with.
    version: String,
    /// Why the server failed, once it did.
    failure: Option<String>,
}

impl Client {
    /// A client whose `initialize` request is already queued.
    pub fn new(server: &str) -> Client {
        let mut client = Client {
            server: server.to_owned(),
            phase: Phase::Starting,
            pending: Ledger::default(),
            pages: 0,
            tools: Vec::new(),
            relist: None,
            relist_again: false,
            relists: 0,
            names: HashMap::new(),
            out: VecDeque::new(),
            out_bytes: 0,
            version: PROTOCOL_VERSION.to_owned(),
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

    /// The negotiated protocol version (for HTTP's `MCP-Protocol-Version`).
    pub fn version(&self) -> &str {
        &self.version
    }

    /// Why the server failed, once it did.
    pub fn failure(&self) -> Option<&str> {
        self.failure.as_deref()
    }

    /// Whether a tool list is being read: the first, or a new one after `list_changed`.
    pub fn is_listing(&self) -> bool {
        self.phase == Phase::Starting || self.relist.is_some()
    }

    /// The re-list in flight after `list_changed`, by number (each begun gets the next).
    pub fn relisting(&self) -> Option<u64> {
        self.relist.is_some().then_some(self.relists)
    }

    /// Gives up the re-list in flight (its deadline passed): the tools listed before stay
    /// offered, the late answer is ignored, and a later `list_changed` lists afresh.
    /// Whether one was in flight.
    pub fn abandon_relist(&mut self) -> bool {
        if self.relist.take().is_none() {
            return false;
        }
        self.relist_again = false;
        // Once `Ready`, every `tools/list` in flight is a re-list's.
        self.pending.retain(|p| !matches!(p, Pending::List));
        true
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

    /// The next serialized message for the server (no trailing newline).
    pub fn take_outgoing(&mut self) -> Option<Vec<u8>> {
        let message = self.out.pop_front()?;
        self.out_bytes -= message.len();
        Some(message)
    }

    pub fn has_outgoing(&self) -> bool {
        !self.out.is_empty()
    }

    fn send(&mut self, message: &Message) -> bool {
        let mut line = jsonrpc::to_line(message);
        line.pop();
        if self.out_bytes + line.len() > MAX_OUTBOX {
            return false;
        }
        self.out_bytes += line.len();
        self.out.push_back(line);
        true
    }

    fn send_request(&mut self, method: &str, params: Value, pending: Pending) -> Option<i64> {
        let (id, request) = self.pending.request(method, params, pending);
        if self.send(&request) {
            Some(id)
        } else {
            self.pending.withdraw(id);
            None
        }
    }

    /// Calls a tool by its model-facing name: the request's id, or the answer for a call
    /// that cannot be made. The request carries a progress token (its own id), so a server
    /// that reports progress keeps the call from timing out.
    pub fn call(
        &mut self,
        key: CallKey,
        model_name: &str,
        input: &Value,
    ) -> Result<i64, ToolOutput> {
        if self.phase != Phase::Ready {
            return Err(ToolOutput::error(format!(
                "MCP server `{}` is not available{}",
                self.server,
                self.failure
                    .as_deref()
                    .map(|f| format!(": {f}"))
                    .unwrap_or_default()
            )));
        }
        let Some(tool) = self.names.get(model_name).cloned() else {
            return Err(ToolOutput::error(format!(
                "MCP server `{}` has no tool `{model_name}`",
                self.server
            )));
        };
        let arguments = if input.is_object() {
            input.clone()
        } else {
            json!({})
        };
        let id = self.pending.next_id();
        self.send_request(
            "tools/call",
            json!({"name": tool, "arguments": arguments, "_meta": {"progressToken": id}}),
            Pending::Call {
                key,
                active: Instant::now(),
            },
        )
        .ok_or_else(|| {
            ToolOutput::error(format!(
                "MCP server `{}` is not reading its input; the call was not sent",
                self.server
            ))
        })
    }

    /// When call `id` was sent or last reported progress; `None` once it is answered.
    pub fn call_active_since(&self, id: i64) -> Option<Instant> {
        match self.pending.get(id) {
            Some(Pending::Call { active, .. }) => Some(*active),
            _ => None,
        }
    }

    /// Whether request `id` still waits for its answer.
    pub fn is_pending(&self, id: i64) -> bool {
        self.pending.contains(id)
    }

    /// Whether `model_name` is named for this server (`mcp__<server>__…`), offered or not.
    pub fn names_server(&self, model_name: &str) -> bool {
        server_part(model_name) == Some(sanitize(&self.server).as_str())
    }

    /// Gives up on call `id`: the server is told with `notifications/cancelled` and its late
    /// answer is ignored. The call's key, if it was still open.
    pub fn cancel(&mut self, id: i64, reason: &str) -> Option<CallKey> {
        let Some(Pending::Call { key, .. }) = self.pending.withdraw(id) else {
            return None;
        };
        self.send(&jsonrpc::notification(
            "notifications/cancelled",
            json!({"requestId": id, "reason": reason}),
        ));
        Some(key)
    }

    /// The open calls of run `run`, by request id.
    pub fn calls_of(&self, run: u64) -> Vec<i64> {
        self.pending
            .ids(|p| matches!(p, Pending::Call { key, .. } if key.run == run))
    }

    /// The server is gone (its output ended, it was killed, its session ended): every open
    /// call is answered.
    pub fn fail(&mut self, why: &str) -> Vec<Event> {
        let mut events = Vec::new();
        if self.phase == Phase::Starting {
            events.push(Event::Settled);
        }
        self.phase = Phase::Failed;
        if self.failure.is_none() {
            self.failure = Some(why.to_owned());
        }
        for (_, pending) in self.pending.drain() {
            if let Pending::Call { key, .. } = pending {
                events.push(Event::CallDone {
                    key,
                    output: ToolOutput::error(format!("MCP server `{}` {why}", self.server)),
                });
            }
        }
        self.out.clear();
        self.out_bytes = 0;
        events
    }

    /// One message from the server, as bytes (a stdio line, an HTTP body, an SSE `data`).
    pub fn on_bytes(&mut self, bytes: &[u8]) -> Vec<Event> {
        match jsonrpc::parse(bytes) {
            Ok(Some(message)) => self.on_message(message),
            Ok(None) => Vec::new(),
            Err(_) => {
                crate::log::warn(&format!(
                    "MCP server `{}` sent something that is not JSON-RPC; ignoring it",
                    self.server
                ));
                Vec::new()
            }
        }
    }

    fn on_message(&mut self, message: Message) -> Vec<Event> {
        match message {
            Message::Response { id, result } => match self.pending.answer(&id) {
                Some((_, pending)) => self.on_response(pending, result),
                None => Vec::new(),
            },
            Message::Request { id, method, .. } => {
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
            Message::Notification { method, params } => match method.as_str() {
                "notifications/progress" => {
                    let token = params.get("progressToken").and_then(Value::as_i64);
                    if let Some(Pending::Call { active, .. }) =
                        token.and_then(|t| self.pending.get_mut(t))
                    {
                        *active = Instant::now();
                    }
                    Vec::new()
                }
                "notifications/tools/list_changed" if self.phase == Phase::Ready => {
                    if self.relist.is_some() {
                        self.relist_again = true;
                        Vec::new()
                    } else {
                        self.begin_relist()
                    }
                }
                // Logging and other notifications are not acted on.
                _ => Vec::new(),
            },
        }
    }

    fn on_response(&mut self, pending: Pending, result: Result<Value, RpcError>) -> Vec<Event> {
        match pending {
            Pending::Initialize => match result {
                Ok(init) => {
                    if let Some(v) = init.get("protocolVersion").and_then(Value::as_str) {
                        self.version = v.chars().take(32).collect();
                    }
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
                Err(e) if self.relist.is_some() => {
                    crate::log::warn(&format!(
                        "MCP server `{}` refused `tools/list` after its tools changed ({}); \
                         keeping the old list",
                        self.server, e.message
                    ));
                    self.relist = None;
                    // The list did not change after all: runs waiting for it go on.
                    vec![Event::ToolsChanged]
                }
                Err(e) => self.fail(&format!("refused `tools/list`: {}", e.message)),
            },
            Pending::Call { key, .. } => vec![Event::CallDone {
                key,
                output: call_output(result),
            }],
        }
    }

    fn begin_relist(&mut self) -> Vec<Event> {
        self.relist = Some(Default::default());
        self.relists += 1;
        self.pages = 0;
        self.list(None)
    }

    fn list(&mut self, cursor: Option<&str>) -> Vec<Event> {
        self.pages += 1;
        let params = match cursor {
            Some(c) => json!({"cursor": c}),
            None => json!({}),
        };
        if self
            .send_request("tools/list", params, Pending::List)
            .is_some()
        {
            Vec::new()
        } else {
            self.fail("is not reading its input")
        }
    }

    fn on_tools_page(&mut self, page: &Value) -> Vec<Event> {
        // The first list is read into `tools` (hidden until `Ready`); a later one aside.
        let relisting = self.relist.is_some();
        let (mut list, mut names) = match self.relist.take() {
            Some(partial) => partial,
            None => (
                std::mem::take(&mut self.tools),
                std::mem::take(&mut self.names),
            ),
        };
        for tool in page
            .get("tools")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or_default()
        {
            let Some(name) = tool.get("name").and_then(Value::as_str) else {
                continue;
            };
            if list.len() >= MAX_TOOLS {
                crate::log::warn(&format!(
                    "MCP server `{}` offers more than {MAX_TOOLS} tools; the rest are not offered",
                    self.server
                ));
                break;
            }
            let model_name = tool_name(&self.server, name);
            if names.contains_key(&model_name) {
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
            names.insert(model_name.clone(), name.to_owned());
            list.push(ToolSpec {
                name: Cow::Owned(model_name),
                description: Cow::Owned(description),
                input_schema: schema,
            });
        }
        let cursor = page
            .get("nextCursor")
            .and_then(Value::as_str)
            .filter(|c| !c.is_empty())
            .map(str::to_owned);
        let more = cursor.filter(|_| self.pages < MAX_PAGES && list.len() < MAX_TOOLS);
        if relisting {
            if let Some(cursor) = more {
                self.relist = Some((list, names));
                return self.list(Some(&cursor));
            }
            self.tools = list;
            self.names = names;
            let mut events = vec![Event::ToolsChanged];
            if std::mem::take(&mut self.relist_again) {
                events.extend(self.begin_relist());
            }
            return events;
        }
        self.tools = list;
        self.names = names;
        match more {
            Some(cursor) => self.list(Some(&cursor)),
            None => {
                self.phase = Phase::Ready;
                vec![Event::Settled]
            }
        }
    }
}

/// A `tools/call` answer as a tool result: its text and embedded text resources as text,
/// its images and embedded image blobs as images for the model (`ToolOutput::add_image`,
/// which explains any it must leave out), a line naming each audio block, other blob and
/// resource link; `isError` an error. The text is capped like every tool's output; the
/// images have their own caps.
fn call_output(result: Result<Value, RpcError>) -> ToolOutput {
    let result = match result {
        Ok(r) => r,
        Err(e) => return ToolOutput::error(format!("MCP error {}: {}", e.code, e.message)),
    };
    let mut out = ToolOutput::new(
        result.get("isError").and_then(Value::as_bool) == Some(true),
        "",
    );
    let mut text = String::new();
    // Images are added after the text is capped, so their refusals are never cut off.
    let mut images: Vec<(String, &str, &str)> = Vec::new();
    let mut n_images = 0;
    for block in result
        .get("content")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default()
    {
        let field = |k: &str| block.get(k).and_then(Value::as_str).unwrap_or("");
        let piece: Option<Cow<str>> = match block.get("type").and_then(Value::as_str) {
            Some("text") => block.get("text").and_then(Value::as_str).map(Cow::Borrowed),
            Some("image") => {
                n_images += 1;
                images.push((
                    format!("image {n_images}"),
                    field("mimeType"),
                    field("data"),
                ));
                None
            }
            Some("resource") => {
                let resource = block.get("resource").unwrap_or(&Value::Null);
                let get = |k: &str| resource.get(k).and_then(Value::as_str);
                let uri = get("uri").unwrap_or("");
                match (get("text"), get("blob"), get("mimeType")) {
                    (Some(t), _, _) => Some(Cow::Owned(format!("[resource {uri}]\n{t}"))),
                    (None, Some(b), Some(mime)) if mime.starts_with("image/") => {
                        images.push((format!("resource {uri}"), mime, b));
                        None
                    }
                    (None, Some(b), mime) => Some(Cow::Owned(format!(
                        "[resource {uri} ({}, {} bytes of base64) not shown: only text and \
                         image resources reach the model]",
                        mime.unwrap_or("binary"),
                        b.len()
                    ))),
                    (None, None, _) => Some(Cow::Owned(format!("[resource {uri}]"))),
                }
            }
            Some("resource_link") => Some(Cow::Owned(format!(
                "[resource link {} {}]",
                field("uri"),
                field("name")
            ))),
            Some("audio") => Some(Cow::Owned(format!(
                "[audio {} ({} bytes of base64) not shown: the model takes no audio]",
                field("mimeType"),
                field("data").len()
            ))),
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
        && images.is_empty()
        && let Some(structured) = result.get("structuredContent")
    {
        text = structured.to_string();
    }
    out.text = crate::tools::fs::cap_output(text);
    for (what, media_type, data) in images {
        out.add_image(&what, media_type, data);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sent(client: &mut Client) -> Vec<Value> {
        let mut out = Vec::new();
        while let Some(m) = client.take_outgoing() {
            out.push(serde_json::from_slice(&m).unwrap());
        }
        out
    }

    fn key(id: &str) -> CallKey {
        CallKey {
            run: 1,
            tool_use_id: id.into(),
        }
    }

    fn ready(name: &str) -> Client {
        let mut c = Client::new(name);
        sent(&mut c);
        c.on_bytes(br#"{"jsonrpc":"2.0","id":1,"result":{"protocolVersion":"2025-06-18","capabilities":{}}}"#);
        sent(&mut c);
        c.on_bytes(br#"{"jsonrpc":"2.0","id":2,"result":{"tools":[{"name":"a"}]}}"#);
        c
    }

    #[test]
    fn handshake_lists_every_page_then_calls() {
        let mut c = Client::new("my server");
        let out = sent(&mut c);
        assert_eq!(out[0]["method"], "initialize");
        assert_eq!(out[0]["params"]["protocolVersion"], PROTOCOL_VERSION);
        assert_eq!(out[0]["params"]["clientInfo"]["name"], "caliban");
        assert!(
            c.on_bytes(br#"{"jsonrpc":"2.0","id":1,"result":{"protocolVersion":"2025-06-18","capabilities":{}}}"#)
                .is_empty()
        );
        assert_eq!(c.version(), "2025-06-18");
        let out = sent(&mut c);
        assert_eq!(out[0]["method"], "notifications/initialized");
        assert_eq!(out[1]["method"], "tools/list");
        assert!(c
            .on_bytes(br#"{"jsonrpc":"2.0","id":2,"result":{"tools":[{"name":"a.b","description":"A","inputSchema":{"type":"object"}}],"nextCursor":"p2"}}"#)
            .is_empty());
        let out = sent(&mut c);
        assert_eq!(out[0]["params"]["cursor"], "p2");
        assert_eq!(c.phase(), Phase::Starting);
        let events = c.on_bytes(br#"{"jsonrpc":"2.0","id":3,"result":{"tools":[{"name":"c"}]}}"#);
        assert_eq!(events, vec![Event::Settled]);
        let names: Vec<&str> = c.tools().iter().map(|t| t.name.as_ref()).collect();
        assert_eq!(names, ["mcp__my_server__a_b", "mcp__my_server__c"]);
        assert_eq!(c.tools()[1].input_schema, json!({"type": "object"}));
        let id = c
            .call(key("tu1"), "mcp__my_server__a_b", &json!({"x": 1}))
            .unwrap();
        let out = sent(&mut c);
        assert_eq!(
            out[0]["params"],
            json!({"name": "a.b", "arguments": {"x": 1}, "_meta": {"progressToken": id}})
        );
        let events = c.on_bytes(
            br#"{"jsonrpc":"2.0","id":4,"result":{"content":[{"type":"text","text":"no"}],"isError":true}}"#,
        );
        assert_eq!(
            events,
            vec![Event::CallDone {
                key: key("tu1"),
                output: ToolOutput::error("no")
            }]
        );
        assert!(
            c.call(key("tu2"), "mcp__my_server__zzz", &json!({}))
                .is_err()
        );
    }

    #[test]
    fn progress_keeps_a_call_alive_and_cancel_tells_the_server() {
        let mut c = ready("s");
        sent(&mut c);
        let id = c.call(key("t"), "mcp__s__a", &json!({})).unwrap();
        sent(&mut c);
        let before = c.call_active_since(id).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(2));
        c.on_bytes(
            format!(r#"{{"jsonrpc":"2.0","method":"notifications/progress","params":{{"progressToken":{id},"progress":1}}}}"#)
                .as_bytes(),
        );
        assert!(c.call_active_since(id).unwrap() > before);
        assert_eq!(c.calls_of(1), [id]);
        assert_eq!(c.cancel(id, "timed out"), Some(key("t")));
        let out = sent(&mut c);
        assert_eq!(out[0]["method"], "notifications/cancelled");
        assert_eq!(out[0]["params"]["requestId"], id);
        // A late answer is ignored.
        assert!(
            c.on_bytes(
                format!(r#"{{"jsonrpc":"2.0","id":{id},"result":{{"content":[]}}}}"#).as_bytes()
            )
            .is_empty()
        );
        assert_eq!(c.cancel(id, "again"), None);
    }

    #[test]
    fn list_changed_replaces_the_list_when_complete() {
        let mut c = ready("s");
        sent(&mut c);
        let events =
            c.on_bytes(br#"{"jsonrpc":"2.0","method":"notifications/tools/list_changed"}"#);
        assert!(events.is_empty());
        let out = sent(&mut c);
        assert_eq!(out[0]["method"], "tools/list");
        let id = out[0]["id"].as_i64().unwrap();
        // Still the old list while the new one is read.
        assert!(c.has_tool("mcp__s__a"));
        let events = c.on_bytes(
            format!(r#"{{"jsonrpc":"2.0","id":{id},"result":{{"tools":[{{"name":"b"}}]}}}}"#)
                .as_bytes(),
        );
        assert_eq!(events, vec![Event::ToolsChanged]);
        assert!(!c.has_tool("mcp__s__a"));
        assert!(c.has_tool("mcp__s__b"));
    }

    #[test]
    fn a_relist_given_up_keeps_the_old_list_and_ignores_the_late_answer() {
        let mut c = ready("s");
        sent(&mut c);
        assert_eq!(c.relisting(), None);
        c.on_bytes(br#"{"jsonrpc":"2.0","method":"notifications/tools/list_changed"}"#);
        let id = sent(&mut c)[0]["id"].as_i64().unwrap();
        assert_eq!(c.relisting(), Some(1));
        assert!(c.is_listing());
        assert!(c.abandon_relist());
        assert!(!c.is_listing());
        assert!(!c.abandon_relist());
        assert!(c.has_tool("mcp__s__a"));
        // The late answer changes nothing.
        let late =
            format!(r#"{{"jsonrpc":"2.0","id":{id},"result":{{"tools":[{{"name":"b"}}]}}}}"#);
        assert!(c.on_bytes(late.as_bytes()).is_empty());
        assert!(c.has_tool("mcp__s__a") && !c.has_tool("mcp__s__b"));
        // A later change lists afresh, under a new number.
        c.on_bytes(br#"{"jsonrpc":"2.0","method":"notifications/tools/list_changed"}"#);
        assert_eq!(c.relisting(), Some(2));
    }

    #[test]
    fn garbage_and_exit_never_panic() {
        let mut c = Client::new("s");
        sent(&mut c);
        assert!(c.on_bytes(b"\xff{not json").is_empty());
        assert!(
            c.on_bytes(br#"{"jsonrpc":"2.0","id":99,"result":1}"#)
                .is_empty()
        );
        assert!(
            c.on_bytes(br#"{"jsonrpc":"2.0","id":5,"method":"roots/list"}"#)
                .is_empty()
        );
        assert_eq!(sent(&mut c)[0]["error"]["code"], jsonrpc::METHOD_NOT_FOUND);
        assert_eq!(c.fail("exited"), vec![Event::Settled]);
        assert!(c.tools().is_empty());
        assert!(c.call(key("t"), "mcp__s__x", &json!({})).is_err());
    }

    #[test]
    fn results_pass_on_images_and_resources() {
        let out = call_output(Ok(json!({"content": [
            {"type": "text", "text": "hi"},
            {"type": "image", "data": "AAAA", "mimeType": "image/png"},
            {"type": "resource", "resource": {"uri": "file:///a", "text": "body"}},
            {"type": "resource_link", "uri": "file:///b", "name": "b"},
            {"type": "resource", "resource": {"uri": "file:///c.jpg", "blob": "BBBB", "mimeType": "image/jpeg"}},
            {"type": "resource", "resource": {"uri": "file:///d.bin", "blob": "CCCC", "mimeType": "application/pdf"}},
            {"type": "audio", "data": "DDDD", "mimeType": "audio/wav"},
            {"type": "image", "data": "EEEE", "mimeType": "image/bmp"},
        ]})));
        assert!(!out.is_error);
        assert_eq!(
            out.text,
            "hi\n[resource file:///a]\nbody\n[resource link file:///b b]\n\
             [resource file:///d.bin (application/pdf, 4 bytes of base64) not shown: only text \
             and image resources reach the model]\n\
             [audio audio/wav (4 bytes of base64) not shown: the model takes no audio]\n\
             [image 2 (image/bmp) not passed on to the model: unsupported image type \
             `image/bmp`: expected one of image/png, image/jpeg, image/gif, image/webp]"
        );
        assert_eq!(
            out.images,
            vec![
                crate::model::types::ContentBlock::image("image/png", "AAAA").unwrap(),
                crate::model::types::ContentBlock::image("image/jpeg", "BBBB").unwrap(),
            ]
        );
        // An image alone: no text block, and `structuredContent` is not put in its place.
        let only = call_output(Ok(json!({"content": [
            {"type": "image", "data": "AAAA", "mimeType": "image/webp"}],
            "structuredContent": {"x": 1}})));
        assert_eq!((only.text.as_str(), only.images.len()), ("", 1));
        let big = call_output(Ok(
            json!({"content": [{"type": "text", "text": "x".repeat(1 << 20)}]}),
        ));
        assert!(big.text.len() < 70 * 1024);
        // A capped text still ends with what was refused.
        let huge = "A".repeat(crate::model::types::MAX_IMAGE_BASE64 + 4);
        let both = call_output(Ok(json!({"content": [
            {"type": "text", "text": "x".repeat(1 << 20)},
            {"type": "image", "data": huge, "mimeType": "image/png"}]})));
        assert!(both.images.is_empty());
        assert!(
            both.text
                .ends_with("image too large: 3145732 bytes of base64, at most 3145728]"),
            "{}",
            &both.text[both.text.len() - 200..]
        );
    }
}
