//! JSON-RPC 2.0 messages as MCP and ACP use them: newline-delimited, one object per line.
//! Sans-IO: a line in, a `Message` out; a `Message` in, a line out; and the `Ledger` that
//! matches the answers to our own requests, for ACP and the MCP client alike. It knows no
//! methods.

use std::collections::HashMap;

use serde_json::{Map, Value, json};

/// The longest line we parse; longer input is answered with a parse error and dropped.
pub const MAX_MESSAGE_BYTES: usize = 16 * 1024 * 1024;

pub const PARSE_ERROR: i64 = -32700;
pub const INVALID_REQUEST: i64 = -32600;
pub const METHOD_NOT_FOUND: i64 = -32601;
pub const INVALID_PARAMS: i64 = -32602;
pub const INTERNAL_ERROR: i64 = -32603;

/// A request id. JSON-RPC 2.0 allows a string, any number, or null; the answer carries the
/// same value. A null id is legal (if discouraged: answers with no readable id use null too),
/// and MCP and ACP alike answer it like any other id.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Id {
    Num(i64),
    Str(String),
    /// Any other number (a fraction, an exponent, an integer beyond i64), as the JSON text
    /// the peer sent, so the answer names exactly that id. Our own requests never use one.
    Other(String),
    Null,
}

impl Id {
    pub fn to_json(&self) -> Value {
        match self {
            Id::Num(n) => json!(n),
            Id::Str(s) => json!(s),
            Id::Other(text) => serde_json::from_str(text).unwrap_or(Value::Null),
            Id::Null => Value::Null,
        }
    }

    /// The id as JSON text, exactly as the peer wrote it for an `Other`.
    fn to_text(&self) -> String {
        match self {
            Id::Other(text) => text.clone(),
            other => other.to_json().to_string(),
        }
    }

    /// An id held in a JSON value (e.g. a `requestId` in params): an `Other` is written as
    /// serde writes the number, which is the peer's text for every id we ever answered
    /// unless it spelled the number unusually (`1.50`, `1E3`).
    pub fn from_json(value: &Value) -> Option<Id> {
        match value {
            Value::Number(n) => Some(n.as_i64().map_or_else(|| Id::Other(n.to_string()), Id::Num)),
            Value::String(s) => Some(Id::Str(s.clone())),
            Value::Null => Some(Id::Null),
            _ => None,
        }
    }
}

/// The text of a message's top-level `id` member as the peer wrote it (the last one, as
/// for any duplicated member), for an id that is a number but not an `i64`.
fn raw_id(line: &[u8]) -> Option<String> {
    let members: std::collections::BTreeMap<String, Box<serde_json::value::RawValue>> =
        serde_json::from_slice(line).ok()?;
    members.get("id").map(|raw| raw.get().to_owned())
}

#[derive(Clone, Debug, PartialEq)]
pub struct RpcError {
    pub code: i64,
    pub message: String,
    pub data: Option<Value>,
}

impl RpcError {
    pub fn new(code: i64, message: impl Into<String>) -> RpcError {
        RpcError {
            code,
            message: message.into(),
            data: None,
        }
    }

    pub fn invalid_params(message: impl Into<String>) -> RpcError {
        RpcError::new(INVALID_PARAMS, message)
    }

    pub fn method_not_found(method: &str) -> RpcError {
        RpcError::new(METHOD_NOT_FOUND, format!("method not found: {method}"))
    }

    fn to_json(&self) -> Value {
        let mut obj = json!({"code": self.code, "message": self.message});
        if let Some(data) = &self.data {
            obj["data"] = data.clone();
        }
        obj
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum Message {
    Request {
        id: Id,
        method: String,
        params: Value,
    },
    Notification {
        method: String,
        params: Value,
    },
    Response {
        id: Id,
        result: Result<Value, RpcError>,
    },
}

/// Why a line is not a message; the caller answers with `error_response(Id::Null, …)` when
/// it carried no usable id, as JSON-RPC requires.
#[derive(Clone, Debug, PartialEq)]
pub struct Invalid {
    pub id: Id,
    pub error: RpcError,
}

/// Parses one line (without its newline). Blank lines are `Ok(None)`.
pub fn parse(line: &[u8]) -> Result<Option<Message>, Invalid> {
    if line.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    if line.len() > MAX_MESSAGE_BYTES {
        return Err(Invalid {
            id: Id::Null,
            error: RpcError::new(
                PARSE_ERROR,
                format!("message exceeds {MAX_MESSAGE_BYTES} bytes"),
            ),
        });
    }
    let value: Value = serde_json::from_slice(line).map_err(|e| Invalid {
        id: Id::Null,
        error: RpcError::new(PARSE_ERROR, format!("parse error: {e}")),
    })?;
    let Value::Object(obj) = value else {
        // Batches were removed from MCP in 2025-06-18 and ACP never had them.
        return Err(Invalid {
            id: Id::Null,
            error: RpcError::new(INVALID_REQUEST, "expected a JSON-RPC object"),
        });
    };
    from_object(obj, line).map(Some)
}

fn from_object(mut obj: Map<String, Value>, line: &[u8]) -> Result<Message, Invalid> {
    let id = match obj.get("id") {
        None => None,
        Some(raw) => Some(match Id::from_json(raw) {
            Some(Id::Other(text)) => Id::Other(raw_id(line).unwrap_or(text)),
            Some(id) => id,
            None => {
                return Err(Invalid {
                    id: Id::Null,
                    error: RpcError::new(
                        INVALID_REQUEST,
                        "`id` must be a string, a number or null",
                    ),
                });
            }
        }),
    };
    let invalid = |id: &Option<Id>, message: &str| Invalid {
        id: id.clone().unwrap_or(Id::Null),
        error: RpcError::new(INVALID_REQUEST, message),
    };
    if obj.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
        return Err(invalid(&id, "`jsonrpc` must be \"2.0\""));
    }
    if let Some(method) = obj.get("method") {
        let Some(method) = method.as_str().map(str::to_owned) else {
            return Err(invalid(&id, "`method` must be a string"));
        };
        let params = obj.remove("params").unwrap_or(Value::Null);
        if !(params.is_null() || params.is_object() || params.is_array()) {
            return Err(invalid(&id, "`params` must be an object or an array"));
        }
        return Ok(match id {
            Some(id) => Message::Request { id, method, params },
            None => Message::Notification { method, params },
        });
    }
    let Some(id) = id else {
        return Err(invalid(&id, "a message needs `method` or `id`"));
    };
    if let Some(error) = obj.get("error") {
        let code = error
            .get("code")
            .and_then(Value::as_i64)
            .unwrap_or(INTERNAL_ERROR);
        let message = error
            .get("message")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned();
        return Ok(Message::Response {
            id,
            result: Err(RpcError {
                code,
                message,
                data: error.get("data").cloned(),
            }),
        });
    }
    match obj.remove("result") {
        Some(result) => Ok(Message::Response {
            id,
            result: Ok(result),
        }),
        // Answering with its id would look like the answer to one of the peer's own
        // requests; a null id cannot be mistaken for one.
        None => Err(invalid(&None, "a response needs `result` or `error`")),
    }
}

/// A response's text (no newline) around the result `write` appends, JSON text the caller
/// vouches for: an answer built as text (an MCP poll body) is not parsed into a value only to
/// be written out again, and is built in the one buffer it is sent from.
pub fn response_text(id: &Id, write: impl FnOnce(&mut Vec<u8>)) -> String {
    let mut text = Vec::new();
    write_response(&mut text, id, write);
    // Only JSON text is written here; a bad byte would be the writer's bug, not lost output.
    String::from_utf8(text).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into())
}

/// `response_text` appended to `out` (no newline): an answer written where it is sent from.
pub fn write_response(out: &mut Vec<u8>, id: &Id, write: impl FnOnce(&mut Vec<u8>)) {
    out.extend_from_slice(response_head(id).as_bytes());
    write(out);
    out.push(b'}');
}

fn response_head(id: &Id) -> String {
    format!("{{\"id\":{},\"jsonrpc\":\"2.0\",\"result\":", id.to_text())
}

/// Serialises a message as one line, newline included. Written by hand, the keys in the
/// order serde_json's sorted maps would give them, so the params are not copied into a new
/// object first (an ACP prompt's updates are most of what `acp serve` writes), and an
/// `Id::Other` goes out as the peer wrote it.
pub fn to_line(message: &Message) -> Vec<u8> {
    let mut line = Vec::new();
    write_line(&mut line, message);
    line
}

/// `to_line`, appended to `line`: a batch of messages is one buffer, one write.
pub fn write_line(line: &mut Vec<u8>, message: &Message) {
    let params = |line: &mut Vec<u8>, params: &Value| {
        if !params.is_null() {
            line.extend_from_slice(b",\"params\":");
            let _ = serde_json::to_writer(&mut *line, params);
        }
    };
    let method = |line: &mut Vec<u8>, method: &str| {
        line.extend_from_slice(b"\"method\":");
        let _ = serde_json::to_writer(&mut *line, method);
    };
    match message {
        Message::Request {
            id,
            method: name,
            params: p,
        } => {
            line.extend_from_slice(
                format!("{{\"id\":{},\"jsonrpc\":\"2.0\",", id.to_text()).as_bytes(),
            );
            method(line, name);
            params(line, p);
        }
        Message::Notification {
            method: name,
            params: p,
        } => {
            line.extend_from_slice(b"{\"jsonrpc\":\"2.0\",");
            method(line, name);
            params(line, p);
        }
        Message::Response { id, result } => match result {
            Ok(result) => {
                line.extend_from_slice(response_head(id).as_bytes());
                let _ = serde_json::to_writer(&mut *line, result);
            }
            Err(error) => line.extend_from_slice(
                format!(
                    "{{\"error\":{},\"id\":{},\"jsonrpc\":\"2.0\"",
                    error.to_json(),
                    id.to_text()
                )
                .as_bytes(),
            ),
        },
    }
    line.extend_from_slice(b"}\n");
}

/// A `session/update`-like notification whose params are `{"sessionId":…,"update":…}`,
/// appended to `line` as `write_line` writes it (params keys in sorted order), without
/// building the params object: ACP sends one per streamed event.
pub fn write_session_notification(
    line: &mut Vec<u8>,
    method: &str,
    session: &str,
    update: impl FnOnce(&mut Vec<u8>),
) {
    line.extend_from_slice(b"{\"jsonrpc\":\"2.0\",\"method\":");
    let _ = serde_json::to_writer(&mut *line, method);
    line.extend_from_slice(b",\"params\":{\"sessionId\":");
    let _ = serde_json::to_writer(&mut *line, session);
    line.extend_from_slice(b",\"update\":");
    update(line);
    line.extend_from_slice(b"}}\n");
}

pub fn response(id: Id, result: Value) -> Message {
    Message::Response {
        id,
        result: Ok(result),
    }
}

pub fn error_response(id: Id, error: RpcError) -> Message {
    Message::Response {
        id,
        result: Err(error),
    }
}

pub fn notification(method: &str, params: Value) -> Message {
    Message::Notification {
        method: method.to_owned(),
        params,
    }
}

/// Our own requests to the peer still waiting for their answers, each with what its answer
/// is for (`P`): the one place ids are handed out and answers matched. Ids are numbers from
/// 1, never reused, so a late answer to a withdrawn request finds nothing rather than another
/// request's purpose. It keeps no time: a caller that times requests out keeps the clock in
/// `P` (an MCP call's last progress) or in its own timers (an ACP delegated call).
pub struct Ledger<P> {
    next: i64,
    pending: HashMap<i64, P>,
}

impl<P> Default for Ledger<P> {
    fn default() -> Ledger<P> {
        Ledger {
            next: 1,
            pending: HashMap::new(),
        }
    }
}

impl<P> Ledger<P> {
    /// The id the next request gets, for params that name their own request (an MCP
    /// progress token).
    pub fn next_id(&self) -> i64 {
        self.next
    }

    /// A request waiting for its answer, for `purpose`: the message to send and its id.
    /// A caller that cannot send it `withdraw`s the id.
    pub fn request(&mut self, method: &str, params: Value, purpose: P) -> (i64, Message) {
        let id = self.next;
        self.next += 1;
        self.pending.insert(id, purpose);
        let message = Message::Request {
            id: Id::Num(id),
            method: method.to_owned(),
            params,
        };
        (id, message)
    }

    /// What the answer with `id` is for, once: an id we never used, or one already answered
    /// or withdrawn, is `None` (the peer's mistake or a late answer, to be dropped).
    pub fn answer(&mut self, id: &Id) -> Option<(i64, P)> {
        let Id::Num(id) = *id else {
            return None;
        };
        self.pending.remove(&id).map(|purpose| (id, purpose))
    }

    /// Gives up waiting for request `id`; its purpose, if it still waited.
    pub fn withdraw(&mut self, id: i64) -> Option<P> {
        self.pending.remove(&id)
    }

    pub fn get(&self, id: i64) -> Option<&P> {
        self.pending.get(&id)
    }

    pub fn get_mut(&mut self, id: i64) -> Option<&mut P> {
        self.pending.get_mut(&id)
    }

    pub fn contains(&self, id: i64) -> bool {
        self.pending.contains_key(&id)
    }

    /// The waiting requests, in the order they were sent.
    pub fn ids(&self, mut keep: impl FnMut(&P) -> bool) -> Vec<i64> {
        let mut ids: Vec<i64> = self
            .pending
            .iter()
            .filter(|(_, p)| keep(p))
            .map(|(id, _)| *id)
            .collect();
        ids.sort_unstable();
        ids
    }

    /// Stops waiting for the requests `keep` refuses.
    pub fn retain(&mut self, mut keep: impl FnMut(&P) -> bool) {
        self.pending.retain(|_, p| keep(p));
    }

    /// Stops waiting for every request: their purposes, in the order they were sent. Ids
    /// go on from where they were, so an answer that comes late matches nothing.
    pub fn drain(&mut self) -> Vec<(i64, P)> {
        let mut all: Vec<(i64, P)> = self.pending.drain().collect();
        all.sort_unstable_by_key(|(id, _)| *id);
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ledger_matches_each_answer_to_its_request_once() {
        let mut ledger = Ledger::default();
        assert_eq!(ledger.next_id(), 1);
        let (a, sent) = ledger.request("fs/read_text_file", json!({"path": "/x"}), "read");
        let (b, _) = ledger.request("terminal/kill", Value::Null, "kill");
        assert_eq!((a, b, ledger.next_id()), (1, 2, 3));
        assert_eq!(
            sent,
            Message::Request {
                id: Id::Num(1),
                method: "fs/read_text_file".into(),
                params: json!({"path": "/x"})
            }
        );
        // Only our own numeric ids match; each answer is taken once.
        assert_eq!(ledger.answer(&Id::Str("1".into())), None);
        assert_eq!(ledger.answer(&Id::Null), None);
        assert_eq!(ledger.answer(&Id::Num(2)), Some((2, "kill")));
        assert_eq!(ledger.answer(&Id::Num(2)), None);
        assert_eq!(ledger.answer(&Id::Num(9)), None);
        assert!(ledger.contains(1));
    }

    #[test]
    fn a_withdrawn_request_is_not_answered_and_its_id_is_not_reused() {
        let mut ledger = Ledger::default();
        let (a, _) = ledger.request("session/request_permission", json!({}), 'p');
        assert_eq!(ledger.withdraw(a), Some('p'));
        assert_eq!(ledger.withdraw(a), None);
        assert_eq!(ledger.answer(&Id::Num(a)), None);
        let (b, _) = ledger.request("session/request_permission", json!({}), 'q');
        assert_ne!(a, b);
        assert_eq!(ledger.get(b), Some(&'q'));
        *ledger.get_mut(b).unwrap() = 'r';
        assert_eq!(ledger.answer(&Id::Num(b)), Some((b, 'r')));
    }

    #[test]
    fn the_ledger_lists_and_drains_in_the_order_sent() {
        let mut ledger = Ledger::default();
        for n in 0..20 {
            ledger.request("tools/call", Value::Null, n);
        }
        assert_eq!(ledger.ids(|n| n % 5 == 0), vec![1, 6, 11, 16]);
        ledger.retain(|n| n % 2 == 0);
        let drained = ledger.drain();
        assert_eq!(drained.len(), 10);
        assert!(drained.windows(2).all(|w| w[0].0 < w[1].0));
        assert_eq!(drained[0], (1, 0));
        assert_eq!(ledger.drain(), Vec::new());
        // After a drain, ids go on: an answer to a drained request finds nothing new.
        let (next, _) = ledger.request("ping", Value::Null, 99);
        assert_eq!(next, 21);
        assert_eq!(ledger.answer(&Id::Num(1)), None);
    }

    #[test]
    fn a_session_notification_is_written_as_to_line_writes_it() {
        let update = json!({"sessionUpdate": "agent_message_chunk",
                            "content": {"type": "text", "text": "a \"b\"\n"}});
        let mut line = b"before\n".to_vec();
        write_session_notification(&mut line, "session/update", "sess \"1\"", |line| {
            serde_json::to_writer(line, &update).unwrap()
        });
        let want = to_line(&notification(
            "session/update",
            json!({"sessionId": "sess \"1\"", "update": update}),
        ));
        assert_eq!(
            line.strip_prefix(b"before\n".as_slice()),
            Some(want.as_slice())
        );
    }

    #[test]
    fn requests_notifications_responses() {
        let req = parse(br#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"a":1}}"#)
            .unwrap()
            .unwrap();
        assert_eq!(
            req,
            Message::Request {
                id: Id::Num(1),
                method: "initialize".into(),
                params: json!({"a": 1})
            }
        );
        let note = parse(br#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#)
            .unwrap()
            .unwrap();
        assert!(matches!(
            note,
            Message::Notification {
                params: Value::Null,
                ..
            }
        ));
        let resp = parse(br#"{"jsonrpc":"2.0","id":"x","result":{"ok":true}}"#)
            .unwrap()
            .unwrap();
        assert_eq!(resp, response(Id::Str("x".into()), json!({"ok": true})));
        let err = parse(br#"{"jsonrpc":"2.0","id":3,"error":{"code":-1,"message":"no"}}"#)
            .unwrap()
            .unwrap();
        assert!(matches!(
            err,
            Message::Response {
                result: Err(RpcError { code: -1, .. }),
                ..
            }
        ));
        assert_eq!(parse(b"   ").unwrap(), None);
    }

    #[test]
    fn invalid_input_gets_the_spec_codes() {
        assert_eq!(parse(b"{nope").unwrap_err().error.code, PARSE_ERROR);
        assert_eq!(parse(b"[1,2]").unwrap_err().error.code, INVALID_REQUEST);
        let bad = parse(br#"{"jsonrpc":"1.0","id":7,"method":"x"}"#).unwrap_err();
        assert_eq!((bad.id, bad.error.code), (Id::Num(7), INVALID_REQUEST));
        assert_eq!(
            parse(br#"{"jsonrpc":"2.0","id":{},"method":"x"}"#)
                .unwrap_err()
                .id,
            Id::Null
        );
        assert_eq!(
            parse(br#"{"jsonrpc":"2.0","id":1,"method":"x","params":3}"#)
                .unwrap_err()
                .error
                .code,
            INVALID_REQUEST
        );
    }

    #[test]
    fn any_number_is_an_id_and_is_answered_as_sent() {
        for raw in [
            "1.5",
            "1e23",
            "1E23",
            "1.50",
            "-0.25",
            "123456789012345678901234567890",
        ] {
            let line = format!(r#"{{"jsonrpc":"2.0","id":{raw},"method":"ping"}}"#);
            let Ok(Some(Message::Request { id, .. })) = parse(line.as_bytes()) else {
                panic!("{raw} refused");
            };
            assert_eq!(id, Id::Other(raw.to_owned()));
            let answer = to_line(&response(id.clone(), json!({})));
            assert_eq!(
                String::from_utf8(answer).unwrap(),
                format!("{{\"id\":{raw},\"jsonrpc\":\"2.0\",\"result\":{{}}}}\n")
            );
            let refused = to_line(&error_response(id, RpcError::new(-1, "no")));
            let refused: Value = serde_json::from_slice(&refused).unwrap();
            assert_eq!(refused["id"], serde_json::from_str::<Value>(raw).unwrap());
        }
        // The last of duplicated members counts, as it does for the parsed message.
        let dup = parse(br#"{"jsonrpc":"2.0","id":1.5,"id":2.50,"method":"x"}"#);
        assert!(matches!(dup, Ok(Some(Message::Request { id: Id::Other(t), .. })) if t == "2.50"));
        // Integers stay plain ids; a null id is an id too (JSON-RPC 2.0 allows it).
        let req = parse(br#"{"jsonrpc":"2.0","id":7,"method":"x"}"#)
            .unwrap()
            .unwrap();
        assert!(matches!(req, Message::Request { id: Id::Num(7), .. }));
        let req = parse(br#"{"jsonrpc":"2.0","id":null,"method":"x"}"#)
            .unwrap()
            .unwrap();
        assert!(matches!(req, Message::Request { id: Id::Null, .. }));
        assert_eq!(
            to_line(&response(Id::Null, json!(1))),
            b"{\"id\":null,\"jsonrpc\":\"2.0\",\"result\":1}\n"
        );
    }

    #[test]
    fn responses_are_written_as_serde_writes_them() {
        for msg in [
            response(Id::Num(-3), json!({"b": [1, {"z": null}], "a": "x"})),
            response(Id::Str("s\"\n".into()), Value::Null),
            error_response(Id::Str("e".into()), RpcError::new(PARSE_ERROR, "bad \"x\"")),
            error_response(
                Id::Num(9),
                RpcError {
                    code: 1,
                    message: "m".into(),
                    data: Some(json!({"id": null})),
                },
            ),
        ] {
            let Message::Response { id, result } = &msg else {
                unreachable!()
            };
            let by_serde = match result {
                Ok(r) => json!({"jsonrpc": "2.0", "id": id.to_json(), "result": r}),
                Err(e) => json!({"jsonrpc": "2.0", "id": id.to_json(), "error": e.to_json()}),
            };
            let mut want = by_serde.to_string().into_bytes();
            want.push(b'\n');
            assert_eq!(to_line(&msg), want);
        }
    }

    #[test]
    fn numbers_survive_a_round_trip() {
        // Found by fuzz/jsonrpc: serde_json's default float parsing may miss by one ulp, so
        // this number came back from its own serialisation as a different f64.
        let line = br#"{"jsonrpc":"2.0","id":10,"method":"m","params":{"a":2444444444444444444444444444444444444444444444444444044444444444444444444444410}}"#;
        let message = parse(line).unwrap().unwrap();
        let wire = to_line(&message);
        assert_eq!(parse(&wire[..wire.len() - 1]).unwrap(), Some(message));
    }

    #[test]
    fn lines_round_trip() {
        for msg in [
            response(Id::Num(1), json!({"x": [1, 2]})),
            error_response(Id::Null, RpcError::new(PARSE_ERROR, "bad")),
            notification("session/update", json!({"sessionId": "s"})),
            Message::Request {
                id: Id::Str("r".into()),
                method: "fs/read_text_file".into(),
                params: json!({"path": "/x"}),
            },
        ] {
            let line = to_line(&msg);
            assert_eq!(line.last(), Some(&b'\n'));
            assert_eq!(parse(&line[..line.len() - 1]).unwrap(), Some(msg));
        }
    }
}
