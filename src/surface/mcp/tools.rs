//! The MCP tools: upstream's five (`reference/upstream-caliban.md` §3.1–§3.2) with their
//! exact names, descriptions and input schemas (as rmcp 1.7 generates them from upstream's
//! argument structs), plus `caliban_cancel`, `wait_ms` on `caliban_poll` and the optional
//! per-run fields on `caliban_run`. Arguments are decoded by `drive::ops` in its serde
//! dialect, so a bad call gets the same `-32602` text upstream's `Parameters<T>` gives.
//!
//! Result bodies have sorted keys, as upstream's do: it builds them as `serde_json::Value`s
//! (`json!`) without serde_json's `preserve_order`, and `Content::json` serialises those.

use serde_json::{Map, Value, json};

use crate::drive::ops::{self, Dialect, Op, OpError, OpKind};
use crate::drive::table::{DriveStatus, PollView, Prompt};
use crate::text::cap_chars;
use crate::tools::table;

/// Longest `wait_ms` honoured: well under the 60 s many clients give a tool call.
pub const MAX_WAIT_MS: u64 = 30_000;

pub const RUN: &str = "caliban_run";
pub const POLL: &str = "caliban_poll";
pub const STATUS: &str = "caliban_status";
pub const SEND_INPUT: &str = "caliban_send_input";
pub const PERMIT: &str = "caliban_permit";
pub const CANCEL: &str = "caliban_cancel";

const SCHEMA_2020_12: &str = "https://json-schema.org/draft/2020-12/schema";

/// `caliban_poll`'s body (see `PollView::to_json_text`), with the base64 of images left
/// out: an MCP host hands this text to its model, where megabytes of base64 would fill the
/// context and show nothing. Each such block keeps its shape, with `data` empty and
/// `omitted_bytes` saying how much was there; HTTP polls and the session file keep it whole.
pub fn poll_text(view: &PollView) -> String {
    let body = view.to_json_text();
    if !body.contains("\"base64\"") {
        return body;
    }
    match serde_json::from_str::<Value>(&body) {
        Ok(mut value) => {
            omit_base64(&mut value);
            value.to_string()
        }
        Err(_) => body,
    }
}

/// Empties the `data` of every `{"type":"base64","data":…}` source in `value`.
fn omit_base64(value: &mut Value) {
    match value {
        Value::Object(map) => {
            if map.get("type").and_then(Value::as_str) == Some("base64")
                && let Some(Value::String(data)) = map.get_mut("data")
            {
                let bytes = std::mem::take(data).len();
                map.insert("omitted_bytes".into(), bytes.into());
            }
            map.values_mut().for_each(omit_base64);
        }
        Value::Array(items) => items.iter_mut().for_each(omit_base64),
        _ => {}
    }
}

pub fn run_text(run_id: &str, instructions: Option<Value>) -> String {
    match instructions {
        // Keys sorted, as upstream's bodies are.
        Some(files) => json!({"instructions": files, "run_id": run_id}).to_string(),
        None => format!("{{\"run_id\":{}}}", Value::String(run_id.to_owned())),
    }
}

pub fn status_body_text(status: &DriveStatus) -> String {
    json!({"status": status.to_json()}).to_string()
}

pub const OK_TEXT: &str = "{\"ok\":true}";

fn prop(description: &str, kind: &str) -> Value {
    json!({"description": description, "type": kind})
}

fn optional_string(description: &str) -> Value {
    json!({"default": null, "description": description, "type": ["string", "null"]})
}

fn input_schema(title: &str, properties: Value, required: &[&str]) -> Value {
    json!({
        "$schema": SCHEMA_2020_12,
        "properties": properties,
        "required": required,
        "title": title,
        "type": "object",
    })
}

fn status_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "state": {
                "type": "string",
                "enum": ["starting", "running", "awaiting_input", "done", "failed"]
            },
            "error": {"type": "string"}
        },
        "required": ["state"]
    })
}

fn ok_schema() -> Value {
    json!({
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"]
    })
}

fn annotations(read_only: bool, destructive: bool, idempotent: bool, open_world: bool) -> Value {
    json!({
        "readOnlyHint": read_only,
        "destructiveHint": destructive,
        "idempotentHint": idempotent,
        "openWorldHint": open_world,
    })
}

/// One tool's listing. `modern` (2025-06-18 and later) adds `title` and `outputSchema`,
/// which 2025-03-26 did not have.
fn tool(
    name: &str,
    title: &str,
    description: &str,
    input: Value,
    output: Value,
    hints: Value,
    modern: bool,
) -> Value {
    let mut t = json!({
        "name": name,
        "description": description,
        "inputSchema": input,
        "annotations": hints,
    });
    if modern {
        t["title"] = json!(title);
        t["outputSchema"] = output;
    }
    t
}

/// The `tools/list` result: sorted by name, as rmcp lists upstream's.
pub fn list(modern: bool) -> Value {
    let run_id = |d: &str| prop(d, "string");
    let tools = vec![
        tool(
            CANCEL,
            "Cancel a caliban run",
            "Cancel a run: its model request is dropped and its tool processes are killed; it \
             ends with status done and a RunEnd event whose stopped_for is Cancelled.",
            input_schema(
                OpKind::Cancel.args_title(),
                json!({"run_id": run_id("The run to cancel.")}),
                &["run_id"],
            ),
            ok_schema(),
            annotations(false, true, true, false),
            modern,
        ),
        tool(
            PERMIT,
            "Answer a permission prompt",
            "Answer a run's pending permission prompt (from caliban_poll).",
            input_schema(
                OpKind::Permit.args_title(),
                json!({
                    "allow": prop("Allow (true) or deny (false) the tool call.", "boolean"),
                    "reason": optional_string("Optional denial reason."),
                    "run_id": run_id("The run whose pending permission prompt to answer."),
                    "tool_use_id": run_id(
                        "The `tool_use_id` from the poll response's `permission_request`."
                    ),
                }),
                &["run_id", "tool_use_id", "allow"],
            ),
            ok_schema(),
            annotations(false, false, false, false),
            modern,
        ),
        tool(
            POLL,
            "Read a caliban run's events",
            "Fetch new events for a run from `cursor` onward, plus status and any pending \
             permission prompt.",
            input_schema(
                OpKind::Poll.args_title(),
                json!({
                    "cursor": {
                        "default": 0,
                        "description": "Number of events already consumed; events from here on are returned.",
                        "format": "uint",
                        "minimum": 0,
                        "type": "integer",
                    },
                    "run_id": run_id("The run to poll."),
                    "wait_ms": {
                        "default": 0,
                        "description": "Long-poll: when there is nothing new past `cursor`, wait up to this many milliseconds (capped at 30000) for a new event, a status change or a new permission prompt before answering.",
                        "format": "uint",
                        "minimum": 0,
                        "type": "integer",
                    },
                }),
                &["run_id"],
            ),
            json!({
                "type": "object",
                "properties": {
                    "events": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {
                                "v": {"type": "integer"},
                                "event": {"type": "object"}
                            },
                            "required": ["v", "event"]
                        }
                    },
                    "next_cursor": {"type": "integer", "minimum": 0},
                    "status": status_schema(),
                    "permission_request": {
                        "type": ["object", "null"],
                        "properties": {
                            "tool_use_id": {"type": "string"},
                            "tool_name": {"type": "string"},
                            "input": {}
                        },
                        "required": ["tool_use_id", "tool_name", "input"]
                    }
                },
                "required": ["events", "next_cursor", "status", "permission_request"]
            }),
            annotations(true, false, true, false),
            modern,
        ),
        tool(
            RUN,
            "Start a caliban run",
            "Start an agent run from a prompt; returns a run_id to poll.",
            input_schema(
                OpKind::Run.args_title(),
                json!({
                    "ask": {
                        "default": [],
                        "description": "Extra rules (e.g. `Bash(git push:*)`) whose matching tool calls must ask first in this run. Per-run rules only narrow the server's permissions.",
                        "items": {"type": "string"},
                        "type": "array",
                    },
                    "images": {
                        "default": [],
                        "description": "Images for the model, each an image block with a base64 source (`{\"type\":\"image\",\"source\":{\"type\":\"base64\",\"media_type\":\"image/png\",\"data\":\"…\"}}`): png, jpeg, gif or webp, at most 3 MiB of base64 each, 8 a message. Anything else is refused.",
                        "items": {"type": "object"},
                        "type": "array",
                    },
                    "cwd": optional_string(
                        "Directory for this run, relative to the server's workspace and inside it (default: the workspace)."
                    ),
                    "deny": {
                        "default": [],
                        "description": "Extra rules (e.g. `Bash(rm:*)`) whose matching tool calls are denied in this run.",
                        "items": {"type": "string"},
                        "type": "array",
                    },
                    "interactive": {
                        "default": false,
                        "description": "Pause awaiting further input at each turn boundary (default false).",
                        "type": "boolean",
                    },
                    "mcp_servers": {
                        "default": null,
                        "description": "Names of the server's configured MCP servers this run may use (default: all of them; [] for none).",
                        "items": {"type": "string"},
                        "type": ["array", "null"],
                    },
                    "model": optional_string("Model for this run (default: the server's)."),
                    "permission_mode": {
                        "default": null,
                        "description": "Permission mode for this run. It can only narrow the server's configuration: a wider mode than the server's has no effect.",
                        "enum": ["default", "acceptEdits", "plan", "dontAsk", "bypassPermissions", null],
                        "type": ["string", "null"],
                    },
                    "prompt": prop("The initial user prompt.", "string"),
                    "sandbox": {
                        "default": null,
                        "description": "Sandbox for this run's commands (default: the server's). It can only narrow the server's: a wider one has no effect.",
                        "enum": ["read-only", "workspace-write", "network", "off", null],
                        "type": ["string", "null"],
                    },
                }),
                &["prompt"],
            ),
            json!({
                "type": "object",
                "properties": {"run_id": {"type": "string"}},
                "required": ["run_id"]
            }),
            annotations(false, true, false, true),
            modern,
        ),
        tool(
            SEND_INPUT,
            "Send input to a caliban run",
            "Send a follow-up message to an interactive run, or end its input.",
            input_schema(
                OpKind::SendInput.args_title(),
                json!({
                    "compact": {
                        "default": false,
                        "description": "Compact the run's conversation now (summarise the older part; a `Compaction` event follows) instead of sending a message. `end` wins over it, and it over `text`.",
                        "type": "boolean",
                    },
                    "end": {
                        "default": false,
                        "description": "End the conversation instead of sending a message.",
                        "type": "boolean",
                    },
                    "images": {
                        "default": [],
                        "description": "Images for the model, each an image block with a base64 source (`{\"type\":\"image\",\"source\":{\"type\":\"base64\",\"media_type\":\"image/png\",\"data\":\"…\"}}`): png, jpeg, gif or webp, at most 3 MiB of base64 each, 8 a message. Anything else is refused.",
                        "items": {"type": "object"},
                        "type": "array",
                    },
                    "run_id": run_id("The run to feed."),
                    "text": optional_string("A follow-up user message to inject."),
                }),
                &["run_id"],
            ),
            ok_schema(),
            annotations(false, false, false, false),
            modern,
        ),
        tool(
            STATUS,
            "Read a caliban run's status",
            "Read a run's current lifecycle status.",
            input_schema(
                OpKind::Status.args_title(),
                json!({"run_id": run_id("The run to query.")}),
                &["run_id"],
            ),
            json!({
                "type": "object",
                "properties": {"status": status_schema()},
                "required": ["status"]
            }),
            annotations(true, false, true, false),
            modern,
        ),
    ];
    json!({ "tools": tools })
}

/// Why a `tools/call` is refused before any tool runs.
#[derive(Debug, PartialEq, Eq)]
pub enum CallError {
    /// `-32602 tool not found`, as rmcp answers.
    UnknownTool,
    /// `-32602 failed to deserialize parameters: …`, except for `send_input` with neither
    /// `text` nor `end` (`Problem::NoInput`), which upstream answers as a tool error.
    BadArguments(OpError),
}

/// Decodes `tools/call` params' `name` and `arguments` (absent arguments are `{}`).
pub fn parse_call(name: &str, arguments: Option<&Value>) -> Result<Op, CallError> {
    let op = match name {
        RUN => OpKind::Run,
        POLL => OpKind::Poll,
        STATUS => OpKind::Status,
        SEND_INPUT => OpKind::SendInput,
        PERMIT => OpKind::Permit,
        CANCEL => OpKind::Cancel,
        _ => return Err(CallError::UnknownTool),
    };
    let empty = Value::Object(Map::new());
    let arguments = arguments.filter(|a| !a.is_null()).unwrap_or(&empty);
    ops::decode(op, arguments, Dialect::MCP).map_err(CallError::BadArguments)
}

/// The permission question sent as `elicitation/create` (form mode): a real schema, a
/// default that makes a bare "accept" mean allow. A shell command is shown as the command
/// line (the tool's permission subject says which field holds it), anything else as JSON.
pub fn elicitation_params(run_id: &str, prompt: &Prompt, with_mode: bool) -> Value {
    let command = table::lookup(&prompt.tool_name)
        .and_then(|tool| tool.permission.subject.command_field())
        .and_then(|field| prompt.input.get(field)?.as_str());
    let detail = match command {
        Some(cmd) => format!("`{}`", cap_chars(cmd, 400)),
        None => cap_chars(&prompt.input.to_string(), 400),
    };
    let mut params = json!({
        "message": format!(
            "caliban {run_id} asks to use {}: {detail}. Allow it?",
            prompt.tool_name
        ),
        "requestedSchema": {
            "type": "object",
            "properties": {
                "allow": {
                    "type": "boolean",
                    "title": "Allow",
                    "description": format!("Allow this {} call (false denies it)", prompt.tool_name),
                    "default": true
                },
                "reason": {
                    "type": "string",
                    "title": "Reason",
                    "description": "Why it is denied (passed to the model)"
                }
            },
            "required": []
        }
    });
    if with_mode {
        params["mode"] = json!("form");
    }
    params
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::drive::session::EventText;

    /// What rmcp 1.7 lists for upstream's argument structs, byte for byte (generated with
    /// rmcp 1.7.0 + schemars 1 from upstream's `caliban/src/serve/mcp.rs`). Our schemas
    /// extend these with new optional properties only.
    const UPSTREAM: &str = r#"{"tools":[{"description":"Answer a run's pending permission prompt (from caliban_poll).","inputSchema":{"$schema":"https://json-schema.org/draft/2020-12/schema","properties":{"allow":{"description":"Allow (true) or deny (false) the tool call.","type":"boolean"},"reason":{"default":null,"description":"Optional denial reason.","type":["string","null"]},"run_id":{"description":"The run whose pending permission prompt to answer.","type":"string"},"tool_use_id":{"description":"The `tool_use_id` from the poll response's `permission_request`.","type":"string"}},"required":["run_id","tool_use_id","allow"],"title":"PermitArgs","type":"object"},"name":"caliban_permit"},{"description":"Fetch new events for a run from `cursor` onward, plus status and any pending permission prompt.","inputSchema":{"$schema":"https://json-schema.org/draft/2020-12/schema","properties":{"cursor":{"default":0,"description":"Number of events already consumed; events from here on are returned.","format":"uint","minimum":0,"type":"integer"},"run_id":{"description":"The run to poll.","type":"string"}},"required":["run_id"],"title":"PollArgs","type":"object"},"name":"caliban_poll"},{"description":"Start an agent run from a prompt; returns a run_id to poll.","inputSchema":{"$schema":"https://json-schema.org/draft/2020-12/schema","properties":{"interactive":{"default":false,"description":"Pause awaiting further input at each turn boundary (default false).","type":"boolean"},"prompt":{"description":"The initial user prompt.","type":"string"}},"required":["prompt"],"title":"RunArgs","type":"object"},"name":"caliban_run"},{"description":"Send a follow-up message to an interactive run, or end its input.","inputSchema":{"$schema":"https://json-schema.org/draft/2020-12/schema","properties":{"end":{"default":false,"description":"End the conversation instead of sending a message.","type":"boolean"},"run_id":{"description":"The run to feed.","type":"string"},"text":{"default":null,"description":"A follow-up user message to inject.","type":["string","null"]}},"required":["run_id"],"title":"SendInputArgs","type":"object"},"name":"caliban_send_input"},{"description":"Read a run's current lifecycle status.","inputSchema":{"$schema":"https://json-schema.org/draft/2020-12/schema","properties":{"run_id":{"description":"The run to query.","type":"string"}},"required":["run_id"],"title":"StatusArgs","type":"object"},"name":"caliban_status"}]}"#;

    #[test]
    fn upstream_tools_are_byte_compatible() {
        let upstream: Value = serde_json::from_str(UPSTREAM).unwrap();
        let ours = list(true);
        let ours = ours["tools"].as_array().unwrap();
        for theirs in upstream["tools"].as_array().unwrap() {
            let name = theirs["name"].as_str().unwrap();
            let mine = ours.iter().find(|t| t["name"] == name).unwrap();
            assert_eq!(mine["description"], theirs["description"], "{name}");
            // Same keys, same bytes, for every property upstream has.
            let (a, b) = (&mine["inputSchema"], &theirs["inputSchema"]);
            for key in ["$schema", "required", "title", "type"] {
                assert_eq!(a[key], b[key], "{name}.{key}");
            }
            for (prop, schema) in b["properties"].as_object().unwrap() {
                assert_eq!(
                    a["properties"][prop].to_string(),
                    schema.to_string(),
                    "{name}.{prop}"
                );
            }
        }
        let names: Vec<&str> = ours.iter().map(|t| t["name"].as_str().unwrap()).collect();
        let mut sorted = names.clone();
        sorted.sort_unstable();
        assert_eq!(names, sorted);
        assert!(names.contains(&CANCEL));
    }

    #[test]
    fn old_protocol_gets_no_output_schema() {
        for t in list(false)["tools"].as_array().unwrap() {
            assert!(t.get("outputSchema").is_none() && t.get("title").is_none());
        }
        for t in list(true)["tools"].as_array().unwrap() {
            assert_eq!(t["outputSchema"]["type"], "object");
        }
    }

    #[test]
    fn bodies_have_upstreams_sorted_keys() {
        let view = PollView {
            events: vec![(0, EventText::from(r#"{"type":"TurnStart","turn_index":0}"#))],
            next_cursor: 1,
            status: DriveStatus::Failed("boom \"x\"".into()),
            permission_request: Some(Prompt {
                tool_use_id: "toolu_1".into(),
                tool_name: "Bash".into(),
                input: json!({"command": "ls"}),
            }),
        };
        assert_eq!(
            poll_text(&view),
            r#"{"events":[{"event":{"type":"TurnStart","turn_index":0},"v":1}],"next_cursor":1,"permission_request":{"input":{"command":"ls"},"tool_name":"Bash","tool_use_id":"toolu_1"},"status":{"error":"boom \"x\"","state":"failed"}}"#
        );
        assert_eq!(run_text("run-1", None), r#"{"run_id":"run-1"}"#);
        assert_eq!(
            run_text("run-2", Some(json!([{"path": "/r/AGENTS.md"}]))),
            r#"{"instructions":[{"path":"/r/AGENTS.md"}],"run_id":"run-2"}"#
        );
        assert_eq!(
            status_body_text(&DriveStatus::AwaitingInput),
            r#"{"status":{"state":"awaiting_input"}}"#
        );
        // Every body parses, so it can be mirrored as structuredContent.
        for text in [poll_text(&view), OK_TEXT.to_owned()] {
            serde_json::from_str::<Value>(&text).unwrap();
        }
    }

    #[test]
    fn poll_bodies_leave_image_data_out() {
        let event = json!({"type": "ToolCallEnd", "tool_use_id": "t", "content": [
            {"type": "text", "text": "a \"base64\" word"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}},
        ]});
        let view = PollView {
            events: vec![(0, EventText::from(event.to_string().as_str()))],
            next_cursor: 1,
            status: DriveStatus::Running,
            permission_request: None,
        };
        let body: Value = serde_json::from_str(&poll_text(&view)).unwrap();
        let content = &body["events"][0]["event"]["content"];
        assert_eq!(content[0]["text"], "a \"base64\" word");
        assert_eq!(
            content[1]["source"],
            json!({"type": "base64", "media_type": "image/png", "data": "", "omitted_bytes": 12})
        );
        assert_eq!(body["next_cursor"], 1);
    }

    #[test]
    fn arguments_are_checked_with_serde_wording() {
        let bad = |name: &str, args: Value| match parse_call(name, Some(&args)) {
            Err(CallError::BadArguments(m)) => m.to_string(),
            other => panic!("{other:?}"),
        };
        assert_eq!(bad(RUN, json!({})), "missing field `prompt`");
        assert_eq!(
            bad(RUN, json!({"prompt": 5})),
            "invalid type: integer `5`, expected a string"
        );
        assert_eq!(
            bad(POLL, json!({"run_id": "run-1", "cursor": -1})),
            "invalid value: integer `-1`, expected usize"
        );
        assert_eq!(
            bad(PERMIT, json!({"run_id": "r", "tool_use_id": "t"})),
            "missing field `allow`"
        );
        assert_eq!(
            bad(SEND_INPUT, json!({"run_id": "r", "end": "yes"})),
            "invalid type: string \"yes\", expected a boolean"
        );
        assert!(bad(RUN, json!({"prompt": "x", "permission_mode": "yolo"})).contains("yolo"));
        assert_eq!(
            parse_call("nope", Some(&json!({}))).unwrap_err(),
            CallError::UnknownTool
        );
        match parse_call(POLL, None) {
            Err(CallError::BadArguments(m)) => assert_eq!(m.to_string(), "missing field `run_id`"),
            other => panic!("{other:?}"),
        }
        match parse_call(POLL, Some(&json!({"run_id": "run-3", "wait_ms": 500}))).unwrap() {
            Op::Poll {
                run_id,
                cursor,
                wait_ms,
            } => assert_eq!((run_id.as_str(), cursor, wait_ms), ("run-3", 0, 500)),
            other => panic!("{other:?}"),
        }
    }
}
