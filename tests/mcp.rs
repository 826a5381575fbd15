//! `caliban mcp serve` end to end, against `caliban stub-model`:
//!
//! - with the official MCP TypeScript SDK client (`tests/mcp/client.mjs`, one scenario per
//!   test) over stdio and Streamable HTTP: tools, a run long-polled to completion,
//!   interactive input with progress, permission prompts answered by `caliban_permit` and
//!   by elicitation, `caliban_cancel`, a cancelled request, error results, and several
//!   clients sharing one drive core;
//! - with raw JSON lines and raw HTTP for what an SDK hides: version negotiation, protocol
//!   errors, stdout hygiene, exit on EOF, the elicitation timeout, transport status codes
//!   and auth;
//! - with the official `@modelcontextprotocol/conformance` server suite against `--listen`,
//!   checked against `tests/conformance/baseline.yml`.
//!
//! The SDK, the suite and Node 22 (which the suite needs) are installed from the npm
//! registry with `npm ci` into `target/mcp-node` on first use, under a file lock, from the
//! checked-in `tests/mcp/package-lock.json`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::util::http::{Follow, HttpConn, Response, fixture, request};
use crate::util::mcp::*;
use crate::util::rpc::Peer;
use crate::util::*;

/// How long any one message may take to arrive.
const RECV: Duration = Duration::from_secs(15);
/// How long one SDK scenario (a node process) may take.
const SCENARIO_TIMEOUT: Duration = Duration::from_secs(90);
/// The whole conformance run (it takes a few seconds).
const CONFORMANCE_TIMEOUT: Duration = Duration::from_secs(170);

// ---- stub scripts ------------------------------------------------------------------------

/// The environment every `caliban` here gets: nothing from the developer's shell.
fn caliban_env(ws: &Workspace, stub: &Stub) -> Vec<(String, String)> {
    vec![
        ("PATH".into(), std::env::var("PATH").unwrap_or_default()),
        ("HOME".into(), path_str(&ws.path("home"))),
        ("XDG_CONFIG_HOME".into(), path_str(&ws.path("home/.config"))),
        ("XDG_STATE_HOME".into(), path_str(&ws.path("home/.state"))),
        ("ANTHROPIC_BASE_URL".into(), stub.url.clone()),
    ]
}

/// `caliban mcp serve -C <ws> ARGS` with that environment.
fn serve_command(ws: &Workspace, stub: &Stub, args: &[&str]) -> Command {
    let mut cmd = caliban(ws);
    for (k, v) in caliban_env(ws, stub) {
        cmd.env(k, v);
    }
    cmd.args(["mcp", "serve", "-C"]).arg(&ws.root).args(args);
    cmd
}

// ---- SDK scenarios -----------------------------------------------------------------------

/// Runs one scenario of `tests/mcp/client.mjs`; returns its `RESULT` object.
fn sdk(name: &str, ws: &Workspace, stub: &Stub, serve_args: &[&str]) -> Value {
    let kit = kit();
    let env: serde_json::Map<String, Value> = caliban_env(ws, stub)
        .into_iter()
        .map(|(k, v)| (k, Value::String(v)))
        .collect();
    let config = json!({
        "bin": BIN,
        "ws": path_str(&ws.root),
        "env": env,
        "args": serve_args,
    });
    let out = output_within(
        Command::new(kit.node())
            .arg(kit.script())
            .arg(name)
            .arg(config.to_string())
            .current_dir(&kit.dir)
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("HOME", ws.path("home")),
        "spawn node",
        SCENARIO_TIMEOUT,
    );
    assert_eq!(out.code, Some(0), "scenario {name} failed: {out:?}");
    let line = out
        .stdout
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix("RESULT "))
        .unwrap_or_else(|| panic!("no RESULT line: {out:?}"));
    serde_json::from_str(line).unwrap_or_else(|e| panic!("bad RESULT ({e}): {out:?}"))
}

#[test]
fn mcp_sdk_lists_tools_and_reports_errors() {
    let ws = Workspace::new("mcp-basics");
    let stub = Stub::start(&ws, &script(vec![]));
    let result = sdk("basics", &ws, &stub, &[]);
    assert_eq!(
        result["names"].as_array().map(Vec::len),
        Some(6),
        "{result}"
    );
    assert_eq!(result["serverVersion"], env!("CARGO_PKG_VERSION"));
}

#[test]
fn mcp_sdk_run_long_polls_to_completion() {
    let ws = Workspace::new("mcp-run");
    let stub = Stub::start(
        &ws,
        &script(vec![Turn::text("Hello from the stub.").usage(10, 4)]),
    );
    let result = sdk("run_to_completion", &ws, &stub, &[]);
    assert_eq!(result["text"], "Hello from the stub.", "{result}");
    // The run is durable like any drive run.
    let run = result["run_id"].as_str().expect("run id");
    let sessions = ws.path("home/.state/caliban/sessions");
    let file = std::fs::read_dir(&sessions)
        .expect("session dir")
        .flatten()
        .find(|e| e.file_name().to_string_lossy().contains(run));
    assert!(file.is_some(), "no session file for {run} in {sessions:?}");
}

#[test]
fn mcp_sdk_interactive_input_and_progress() {
    let ws = Workspace::new("mcp-interactive");
    let stub = Stub::start(
        &ws,
        &script(vec![
            Turn::text("first answer").usage(10, 4),
            Turn::text("second answer").usage(10, 4),
        ]),
    );
    let result = sdk("interactive", &ws, &stub, &[]);
    assert!(result["progress"].as_u64().unwrap_or(0) >= 1, "{result}");
}

#[test]
fn mcp_sdk_permission_answered_by_permit() {
    let ws = Workspace::new("mcp-permit");
    let stub = Stub::start(
        &ws,
        &script(vec![
            Turn::bash("toolu_perm", "echo permitted > permitted.txt"),
            Turn::text("wrote it").usage(10, 4),
        ]),
    );
    sdk("permit", &ws, &stub, &[]);
    assert_eq!(ws.read("permitted.txt"), "permitted\n");
}

#[test]
fn mcp_sdk_permission_answered_by_elicitation() {
    let ws = Workspace::new("mcp-elicit");
    let stub = Stub::start(
        &ws,
        &script(vec![
            Turn::bash("toolu_a", "echo elicited > elicited.txt"),
            Turn::text("made it").usage(10, 4),
            Turn::bash("toolu_b", "echo nope > nope.txt"),
            Turn::text("it was denied").usage(10, 4),
        ]),
    );
    let result = sdk("elicitation", &ws, &stub, &[]);
    assert_eq!(result["asked"], 2);
    assert_eq!(ws.read("elicited.txt"), "elicited\n");
    assert!(!ws.path("nope.txt").exists(), "a declined call ran");
}

#[test]
fn mcp_sdk_cancel_kills_the_tool() {
    let ws = Workspace::new("mcp-cancel");
    let marker = "sleep 47.31";
    let stub = Stub::start(
        &ws,
        &script(vec![
            Turn::bash("toolu_s", marker),
            Turn::text("never").usage(10, 4),
        ]),
    );
    sdk("cancel", &ws, &stub, &["--allow", "Bash"]);
    assert!(
        !process_with_marker_exists(marker),
        "the cancelled tool process is still running"
    );
}

#[test]
fn mcp_sdk_cancelled_request_stops_the_run() {
    let ws = Workspace::new("mcp-abort");
    let marker = "sleep 48.31";
    let stub = Stub::start(
        &ws,
        &script(vec![
            Turn::bash("toolu_s", marker),
            Turn::text("never").usage(10, 4),
        ]),
    );
    sdk("abort", &ws, &stub, &["--allow", "Bash"]);
    assert!(
        !process_with_marker_exists(marker),
        "the tool process outlived the cancelled request"
    );
}

#[test]
fn mcp_sdk_streamable_http_sessions_share_the_core() {
    let ws = Workspace::new("mcp-shared");
    let stub = Stub::start(
        &ws,
        &script(vec![
            Turn::bash("toolu_h", "echo shared > shared.txt"),
            Turn::text("done over http").usage(10, 4),
            Turn::text("second run").usage(10, 4),
            Turn::text("third").usage(10, 4),
        ]),
    );
    let result = sdk("shared", &ws, &stub, &[]);
    assert_eq!(result["asked"], 1, "{result}");
    assert_eq!(ws.read("shared.txt"), "shared\n");
}

// ---- raw stdio ---------------------------------------------------------------------------

/// `caliban mcp serve` with piped stdio (`serve_command`), speaking raw JSON-RPC.
fn start_raw(ws: &Workspace, stub: &Stub, args: &[&str]) -> Peer {
    Peer::spawn(serve_command(ws, stub, args), RECV)
}

#[test]
fn mcp_stdio_negotiates_protocol_versions() {
    let ws = Workspace::new("mcp-versions");
    let stub = Stub::start(&ws, &script(vec![]));
    for (asked, answered, modern) in [
        ("2025-11-25", "2025-11-25", true),
        ("2025-06-18", "2025-06-18", true),
        ("2025-03-26", "2025-03-26", false),
        ("1999-01-01", "2025-11-25", true),
    ] {
        let mut raw = start_raw(&ws, &stub, &[]);
        let init = raw.mcp_initialize(asked, json!({}), "raw");
        let result = &init["result"];
        assert_eq!(result["protocolVersion"], answered, "{init}");
        assert_eq!(result["serverInfo"]["name"], "caliban");
        assert!(
            result["instructions"]
                .as_str()
                .is_some_and(|i| i.len() < 2048)
        );
        assert_eq!(result["capabilities"]["logging"], json!({}));
        let tools = raw.request(1, "tools/list", json!({}));
        let first = &tools["result"]["tools"][0];
        assert_eq!(
            first.get("outputSchema").is_some(),
            modern,
            "{asked}: {first}"
        );
        let run = raw.tool(2, "caliban_status", json!({"run_id": "run-77"}));
        assert_eq!(run["isError"], true);
        assert_eq!(run["content"][0]["text"], "unknown run_id: run-77");
        raw.close_stdin();
        assert_eq!(raw.wait_exit(RECV), Some(0));
    }
}

#[test]
fn mcp_stdio_protocol_errors_and_clean_stdout() {
    let ws = Workspace::new("mcp-errors");
    let stub = Stub::start(&ws, &script(vec![Turn::text("fine").usage(10, 4)]));
    let mut raw = start_raw(&ws, &stub, &[]);
    // Before initialize: ping works, an unknown method is refused at once.
    assert_eq!(raw.request(1, "ping", Value::Null)["result"], json!({}));
    assert_eq!(
        raw.request(2, "server/discover", json!({}))["error"]["code"],
        -32601
    );
    raw.mcp_initialize("2025-11-25", json!({}), "raw");
    let again = raw.request(3, "initialize", json!({"protocolVersion": "2025-11-25"}));
    assert_eq!(again["error"]["code"], -32600, "{again}");
    let no_version = raw.request(4, "initialize", json!({}));
    assert_eq!(no_version["error"]["code"], -32602, "{no_version}");

    raw.send_line("{this is not json");
    let parse = raw.recv();
    assert_eq!(
        (parse["id"].clone(), parse["error"]["code"].clone()),
        (Value::Null, json!(-32700))
    );
    raw.send_line(r#"[{"jsonrpc":"2.0","id":9,"method":"ping"}]"#);
    assert_eq!(raw.recv()["error"]["code"], -32600);
    // JSON-RPC 2.0 ids: null and any number are ids, answered with the id exactly as sent
    // (as `acp serve` answers them).
    raw.send_line(r#"{"jsonrpc":"2.0","id":null,"method":"ping"}"#);
    let null = raw.recv();
    assert_eq!(
        (null["id"].clone(), null["result"].clone()),
        (Value::Null, json!({}))
    );
    for id in ["1.5", "1e23", "1.50", "18446744073709551616"] {
        raw.send_line(&format!(r#"{{"jsonrpc":"2.0","id":{id},"method":"ping"}}"#));
        let line = raw.recv_line();
        assert_eq!(
            line,
            format!(r#"{{"id":{id},"jsonrpc":"2.0","result":{{}}}}"#)
        );
    }
    // Notifications are never answered, known or not.
    raw.send(json!({"jsonrpc": "2.0", "method": "notifications/whatever"}));
    raw.send(
        json!({"jsonrpc": "2.0", "method": "notifications/cancelled",
                    "params": {"requestId": 12345}}),
    );
    assert_eq!(raw.request(5, "ping", json!({}))["result"], json!({}));

    let bad = raw.request(6, "tools/call", json!({"arguments": {}}));
    assert_eq!(bad["error"]["code"], -32602);
    let unknown = raw.request(7, "tools/call", json!({"name": "nope"}));
    assert_eq!(
        unknown["error"],
        json!({"code": -32602, "message": "tool not found"})
    );
    let wrong_type = raw.request(
        8,
        "tools/call",
        json!({"name": "caliban_poll", "arguments": {"run_id": 7}}),
    );
    assert_eq!(
        wrong_type["error"]["message"],
        "failed to deserialize parameters: invalid type: integer `7`, expected a string"
    );
    let cursor = raw.request(10, "tools/list", json!({"cursor": "bogus"}));
    assert_eq!(cursor["error"]["code"], -32602);

    // A run's tool output never reaches stdout: every line so far parsed as JSON-RPC.
    let started = raw.tool_body(11, "caliban_run", json!({"prompt": "hi"}));
    let run = started["run_id"].as_str().expect("run id").to_owned();
    let done = raw.tool_body(
        12,
        "caliban_poll",
        json!({"run_id": run, "cursor": 0, "wait_ms": 10000}),
    );
    assert!(done["events"].as_array().is_some_and(|e| !e.is_empty()));
    raw.close_stdin();
    assert_eq!(raw.wait_exit(RECV), Some(0));
    assert!(
        raw.seen.iter().all(|m| m.get("method").is_some()),
        "{:?}",
        raw.seen
    );
}

#[test]
fn mcp_stdio_eof_cancels_runs_and_kills_children() {
    let ws = Workspace::new("mcp-eof");
    let marker = "sleep 49.31";
    let stub = Stub::start(
        &ws,
        &script(vec![
            Turn::bash("toolu_s", marker),
            Turn::text("never").usage(10, 4),
        ]),
    );
    let mut raw = start_raw(&ws, &stub, &["--allow", "Bash"]);
    raw.mcp_initialize("2025-11-25", json!({}), "raw");
    let run = raw.tool_body(1, "caliban_run", json!({"prompt": "sleep"}))["run_id"]
        .as_str()
        .expect("run id")
        .to_owned();
    let deadline = Instant::now() + RECV;
    while !process_with_marker_exists(marker) {
        assert!(Instant::now() < deadline, "the tool never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    let t0 = Instant::now();
    raw.close_stdin();
    assert_eq!(raw.wait_exit(RECV), Some(0));
    let took = t0.elapsed();
    assert!(took < Duration::from_secs(5), "exit took {took:?}");
    assert!(
        !process_with_marker_exists(marker),
        "the child outlived the server"
    );
    // The run was cancelled and recorded so: its session file ends with a done status.
    let sessions = ws.path("home/.state/caliban/sessions");
    let text: String = std::fs::read_dir(&sessions)
        .expect("sessions")
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().contains(&run))
        .map(|e| std::fs::read_to_string(e.path()).unwrap_or_default())
        .collect();
    assert!(text.contains("Cancelled"), "{text}");
}

#[test]
fn mcp_stdio_elicitation_timeout_denies_and_is_withdrawn() {
    let ws = Workspace::new("mcp-elicit-timeout");
    let stub = Stub::start(
        &ws,
        &script(vec![
            Turn::bash("toolu_t", "echo late > late.txt"),
            Turn::text("gave up").usage(10, 4),
        ]),
    );
    let mut raw = start_raw(&ws, &stub, &["--permission-timeout", "1"]);
    raw.mcp_initialize("2025-06-18", json!({"elicitation": {}}), "raw");
    let run = raw.tool_body(1, "caliban_run", json!({"prompt": "try"}))["run_id"]
        .as_str()
        .expect("run id")
        .to_owned();
    // The elicitation arrives; we never answer it.
    let ask = loop {
        let m = raw.recv();
        if m["method"] == "elicitation/create" {
            break m;
        }
    };
    assert!(
        ask["params"].get("mode").is_none(),
        "2025-06-18 has no mode: {ask}"
    );
    assert!(
        ask["params"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("echo late"))
    );
    // After the timeout it is withdrawn and the run goes on without the tool.
    let withdrawn = loop {
        let m = raw.recv();
        if m["method"] == "notifications/cancelled" {
            break m;
        }
    };
    assert_eq!(withdrawn["params"]["requestId"], ask["id"]);
    let done = raw.tool_body(
        2,
        "caliban_poll",
        json!({"run_id": run, "cursor": 0, "wait_ms": 100}),
    );
    let mut events = done["events"].as_array().cloned().unwrap_or_default();
    let mut cursor = done["next_cursor"].as_u64().unwrap_or(0);
    let mut state = done["status"]["state"].clone();
    let mut id = 3;
    while state != "done" {
        let more = raw.tool_body(
            id,
            "caliban_poll",
            json!({"run_id": run, "cursor": cursor, "wait_ms": 5000}),
        );
        id += 1;
        events.extend(more["events"].as_array().cloned().unwrap_or_default());
        cursor = more["next_cursor"].as_u64().unwrap_or(cursor);
        state = more["status"]["state"].clone();
        assert!(id < 30, "run never finished: {more}");
    }
    let end = events
        .iter()
        .find(|e| e["event"]["type"] == "ToolCallEnd")
        .expect("ToolCallEnd");
    assert_eq!(end["event"]["is_error"], true, "{end}");
    assert!(
        end.to_string().contains("did not respond within 1s"),
        "{end}"
    );
    assert!(!ws.path("late.txt").exists());
    // A late answer to the withdrawn request is ignored.
    raw.send(json!({"jsonrpc": "2.0", "id": ask["id"], "result": {"action": "accept"}}));
    assert_eq!(raw.request(99, "ping", json!({}))["result"], json!({}));
}

/// Polls a run over raw stdio until it is terminal; every event.
fn raw_events_until_done(raw: &mut Peer, run: &str, first_id: u64) -> Vec<Value> {
    let mut id = first_id;
    events_until_done(run, 40, |cursor| {
        id += 1;
        let body = raw.tool_body(
            id - 1,
            "caliban_poll",
            json!({"run_id": run, "cursor": cursor, "wait_ms": 5000}),
        );
        let done = matches!(body["status"]["state"].as_str(), Some("done" | "failed"));
        if !done && !body["permission_request"].is_null() {
            // Nothing here answers prompts: a prompt means the options did not narrow.
            panic!("unexpected permission prompt: {body}");
        }
        body
    })
}

#[test]
fn mcp_stdio_run_options_only_narrow() {
    let ws = Workspace::new("mcp-narrow");
    std::fs::create_dir_all(ws.path("sub")).expect("mkdir");
    let stub = Stub::start(
        &ws,
        &script(vec![
            Turn::bash("toolu_d", "echo denied > denied.txt"),
            Turn::text("it was denied").usage(10, 4),
            Turn::bash("toolu_p", "echo planned > planned.txt"),
            Turn::text("plan mode said no").usage(10, 4),
            Turn::bash("toolu_c", "pwd > where.txt"),
            Turn::text("ran in sub").usage(10, 4),
        ]),
    );
    // The server allows Bash outright; per-run options can take that away, never add.
    let mut raw = start_raw(&ws, &stub, &["--allow", "Bash"]);
    raw.mcp_initialize("2025-11-25", json!({}), "raw");

    let run = raw.tool_body(
        1,
        "caliban_run",
        json!({"prompt": "a", "deny": ["Bash"],
                                                "model": "claude-per-run"}),
    )["run_id"]
        .as_str()
        .expect("run id")
        .to_owned();
    let events = raw_events_until_done(&mut raw, &run, 100);
    let end = events
        .iter()
        .find(|e| e["type"] == "ToolCallEnd")
        .expect("ToolCallEnd");
    assert_eq!(end["is_error"], true, "{end}");
    assert!(!ws.path("denied.txt").exists());
    assert_eq!(stub.requests()[0]["body"]["model"], "claude-per-run");

    let run = raw.tool_body(
        2,
        "caliban_run",
        json!({"prompt": "b", "permission_mode": "plan"}),
    )["run_id"]
        .as_str()
        .expect("run id")
        .to_owned();
    let events = raw_events_until_done(&mut raw, &run, 200);
    let end = events
        .iter()
        .find(|e| e["type"] == "ToolCallEnd")
        .expect("ToolCallEnd");
    assert_eq!(end["is_error"], true, "{end}");
    assert!(!ws.path("planned.txt").exists());

    let run = raw.tool_body(
        3,
        "caliban_run",
        json!({"prompt": "c", "cwd": "sub",
                                                "permission_mode": "bypassPermissions"}),
    )["run_id"]
        .as_str()
        .expect("run id")
        .to_owned();
    raw_events_until_done(&mut raw, &run, 300);
    assert_eq!(
        ws.read("sub/where.txt").trim(),
        path_str(&ws.path("sub")),
        "the run worked in its cwd"
    );

    let outside = raw.tool(4, "caliban_run", json!({"prompt": "d", "cwd": ".."}));
    assert_eq!(outside["isError"], true, "{outside}");
    assert!(
        outside["content"][0]["text"]
            .as_str()
            .is_some_and(|t| t.contains("inside the server's workspace")),
        "{outside}"
    );
    let bad = raw.request(
        5,
        "tools/call",
        json!({"name": "caliban_run", "arguments": {"prompt": "e", "permission_mode": "yolo"}}),
    );
    assert_eq!(bad["error"]["code"], -32602, "{bad}");
}

// ---- raw HTTP ----------------------------------------------------------------------------

const ACCEPT_BOTH: (&str, &str) = ("accept", "application/json, text/event-stream");
const JSON_BODY: (&str, &str) = ("content-type", "application/json");

fn init_body(version: &str) -> Vec<u8> {
    json!({"jsonrpc": "2.0", "id": 1, "method": "initialize",
           "params": {"protocolVersion": version, "capabilities": {"elicitation": {}},
                      "clientInfo": {"name": "raw-http", "version": "0"}}})
    .to_string()
    .into_bytes()
}

fn post(addr: SocketAddr, headers: &[(&str, &str)], body: &Value) -> Response {
    request(addr, "POST", "/mcp", headers, body.to_string().as_bytes())
}

/// The JSON-RPC messages in an SSE body.
fn sse_messages(resp: &Response) -> Vec<Value> {
    resp.text()
        .split("\n\n")
        .filter_map(|block| {
            let data: Vec<&str> = block
                .lines()
                .filter_map(|l| l.strip_prefix("data: "))
                .collect();
            (!data.is_empty()).then(|| serde_json::from_str(&data.join("\n")).expect("json"))
        })
        .collect()
}

fn open_session(addr: SocketAddr) -> String {
    let resp = request(
        addr,
        "POST",
        "/mcp",
        &[JSON_BODY, ACCEPT_BOTH],
        &init_body("2025-11-25"),
    );
    assert_eq!(resp.status, 200, "{resp:?}");
    assert_eq!(resp.json()["result"]["serverInfo"]["name"], "caliban");
    let id = resp
        .header("mcp-session-id")
        .expect("session id")
        .to_owned();
    assert!(id.len() >= 32 && id.bytes().all(|b| b.is_ascii_graphic()));
    let note = post(
        addr,
        &[JSON_BODY, ACCEPT_BOTH, ("mcp-session-id", &id)],
        &json!({"jsonrpc": "2.0", "method": "notifications/initialized"}),
    );
    assert_eq!(note.status, 202, "{note:?}");
    assert!(note.body.is_empty());
    id
}

#[test]
fn mcp_http_transport_rules() {
    let ws = Workspace::new("mcp-http");
    let stub = Stub::start(
        &ws,
        &script(vec![
            Turn::bash("toolu_g", "echo via-get > get.txt"),
            Turn::text("ok").usage(10, 4),
            Turn::text("your turn").usage(10, 4),
        ]),
    );
    let mut raw = start_raw(&ws, &stub, &["--listen", "127.0.0.1:0"]);
    let addr = raw.listen_addr("caliban mcp serve");
    let sid = open_session(addr);
    let with = |extra: &[(&'static str, &'static str)]| {
        let mut h = vec![JSON_BODY, ACCEPT_BOTH];
        h.extend_from_slice(extra);
        h
    };
    let ping = json!({"jsonrpc": "2.0", "id": 2, "method": "ping"});
    let session = [("mcp-session-id", sid.as_str())];
    let mut headers = with(&[]);
    headers.extend_from_slice(&session);

    // A request in a session is answered with JSON.
    let ok = post(addr, &headers, &ping);
    assert_eq!(ok.status, 200, "{ok:?}");
    assert_eq!(ok.header("content-type"), Some("application/json"));
    assert_eq!(ok.json()["result"], json!({}));
    // Supported protocol versions in the header, or none, are fine; others are 400.
    for v in ["2025-11-25", "2025-03-26"] {
        let mut h = headers.clone();
        h.push(("mcp-protocol-version", v));
        assert_eq!(post(addr, &h, &ping).status, 200);
    }
    let mut h = headers.clone();
    h.push(("mcp-protocol-version", "1999-01-01"));
    assert_eq!(post(addr, &h, &ping).status, 400);
    // No session, an unknown session.
    assert_eq!(post(addr, &with(&[]), &ping).status, 400);
    assert_eq!(
        post(addr, &with(&[("mcp-session-id", "nope")]), &ping).status,
        404
    );
    // Wrong media types.
    let resp = request(
        addr,
        "POST",
        "/mcp",
        &[ACCEPT_BOTH, ("mcp-session-id", &sid)],
        b"{}",
    );
    assert_eq!(resp.status, 415);
    let resp = request(
        addr,
        "POST",
        "/mcp",
        &[JSON_BODY, ("accept", "text/html"), ("mcp-session-id", &sid)],
        ping.to_string().as_bytes(),
    );
    assert_eq!(resp.status, 406);
    let resp = request(addr, "POST", "/mcp", &headers, b"{oops");
    assert_eq!(resp.status, 400);
    assert_eq!(resp.json()["error"]["code"], -32700);
    // DNS rebinding: a foreign Origin or Host is refused; loopback names are fine.
    let mut h = headers.clone();
    h.push(("origin", "http://evil.example.com"));
    assert_eq!(post(addr, &h, &ping).status, 403);
    let mut h = headers.clone();
    h.push(("origin", "http://localhost:6274"));
    assert_eq!(post(addr, &h, &ping).status, 200);
    let mut conn = HttpConn::connect(addr);
    conn.send_raw(
        format!(
            "POST /mcp HTTP/1.1\r\nhost: evil.example.com\r\ncontent-type: application/json\r\n\
             accept: application/json, text/event-stream\r\ncontent-length: {}\r\n\r\n{}",
            init_body("2025-11-25").len(),
            String::from_utf8_lossy(&init_body("2025-11-25"))
        )
        .as_bytes(),
    );
    assert_eq!(conn.read_response().status, 403);
    // A failed initialize opens no session.
    let failed = post(
        addr,
        &with(&[]),
        &json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}}),
    );
    assert_eq!(failed.json()["error"]["code"], -32602, "{failed:?}");
    assert!(failed.header("mcp-session-id").is_none(), "{failed:?}");
    // Other methods and paths.
    assert_eq!(request(addr, "PUT", "/mcp", &session, b"").status, 405);
    assert_eq!(request(addr, "POST", "/other", &headers, b"{}").status, 404);

    // The GET stream carries the elicitation for a run this session started; the answer
    // comes back as a POSTed response (202).
    let mut listen = Follow::open(
        addr,
        "/mcp",
        &[("accept", "text/event-stream"), ("mcp-session-id", &sid)],
    );
    assert_eq!(listen.header("content-type"), Some("text/event-stream"));
    let second = request(
        addr,
        "GET",
        "/mcp",
        &[("accept", "text/event-stream"), ("mcp-session-id", &sid)],
        b"",
    );
    assert_eq!(second.status, 409, "one GET stream per session");
    let started = post(
        addr,
        &headers,
        &json!({"jsonrpc": "2.0", "id": 3, "method": "tools/call",
                "params": {"name": "caliban_run", "arguments": {"prompt": "over http"}}}),
    );
    assert_eq!(started.status, 200, "{started:?}");
    let run = started.json()["result"]["structuredContent"]["run_id"]
        .as_str()
        .expect("run id")
        .to_owned();
    let ask = listen
        .next_sse()
        .expect("an event on the GET stream")
        .json();
    assert_eq!(ask["method"], "elicitation/create", "{ask}");
    assert_eq!(ask["params"]["mode"], "form");
    let answer = post(
        addr,
        &headers,
        &json!({"jsonrpc": "2.0", "id": ask["id"],
                "result": {"action": "accept", "content": {"allow": true}}}),
    );
    assert_eq!(answer.status, 202);
    // A long-poll answers on an SSE stream (progress first, since we sent a token).
    let mut done = false;
    let mut cursor = 0;
    for id in 10..30 {
        let resp = post(
            addr,
            &headers,
            &json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
                    "params": {"name": "caliban_poll",
                               "arguments": {"run_id": run, "cursor": cursor, "wait_ms": 3000},
                               "_meta": {"progressToken": "p"}}}),
        );
        assert_eq!(resp.status, 200, "{resp:?}");
        let body = if resp.header("content-type") == Some("text/event-stream") {
            sse_messages(&resp).pop().expect("the response")
        } else {
            resp.json()
        };
        assert_eq!(body["id"], id, "{body}");
        cursor = body["result"]["structuredContent"]["next_cursor"]
            .as_u64()
            .expect("next_cursor");
        if body["result"]["structuredContent"]["status"]["state"] == "done" {
            done = true;
            break;
        }
    }
    assert!(done, "the run never finished");
    assert_eq!(ws.read("get.txt"), "via-get\n");
    // A client that accepts only JSON still gets a long-poll: a plain response, late.
    let mut json_only = vec![JSON_BODY, ("accept", "application/json")];
    json_only.extend_from_slice(&session);
    let resp = post(
        addr,
        &json_only,
        &json!({"jsonrpc": "2.0", "id": 40, "method": "tools/call",
                "params": {"name": "caliban_poll",
                           "arguments": {"run_id": "run-999999", "wait_ms": 300}}}),
    );
    assert_eq!(resp.json()["result"]["isError"], true, "{resp:?}");
    let interactive = post(
        addr,
        &headers,
        &json!({"jsonrpc": "2.0", "id": 41, "method": "tools/call",
                "params": {"name": "caliban_run",
                           "arguments": {"prompt": "wait", "interactive": true}}}),
    );
    let waiting = interactive.json()["result"]["structuredContent"]["run_id"]
        .as_str()
        .expect("run id")
        .to_owned();
    let deadline = Instant::now() + RECV;
    loop {
        let status = post(
            addr,
            &headers,
            &json!({"jsonrpc": "2.0", "id": 43, "method": "tools/call",
                    "params": {"name": "caliban_status", "arguments": {"run_id": waiting}}}),
        );
        if status.json()["result"]["structuredContent"]["status"]["state"] == "awaiting_input" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "never awaiting input: {status:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let t0 = Instant::now();
    let resp = post(
        addr,
        &json_only,
        &json!({"jsonrpc": "2.0", "id": 42, "method": "tools/call",
                "params": {"name": "caliban_poll",
                           "arguments": {"run_id": waiting, "cursor": 1000000, "wait_ms": 700}}}),
    );
    assert_eq!(resp.status, 200, "{resp:?}");
    assert_eq!(resp.header("content-type"), Some("application/json"));
    assert_eq!(resp.json()["id"], 42);
    assert!(
        t0.elapsed() >= Duration::from_millis(600),
        "{:?}",
        t0.elapsed()
    );
    assert_eq!(
        resp.json()["result"]["structuredContent"]["events"],
        json!([])
    );

    // DELETE ends the session; its stream ends; the id is unknown afterwards.
    let deleted = request(addr, "DELETE", "/mcp", &session, b"");
    assert_eq!(deleted.status, 200);
    // (After the elicitation it carried the owner's log notice about the prompt.)
    while let Some(event) = listen.next_sse() {
        assert_eq!(event.json()["method"], "notifications/message", "{event:?}");
    }
    assert_eq!(post(addr, &headers, &ping).status, 404);
    // The run outlives the session, visible to stdio.
    raw.mcp_initialize("2025-11-25", json!({}), "raw");
    let status = raw.tool_body(1, "caliban_status", json!({"run_id": run}));
    assert_eq!(status, json!({"status": {"state": "done"}}));
}

#[test]
fn mcp_http_auth_gate_and_listen_checks() {
    let ws = Workspace::new("mcp-http-auth");
    let stub = Stub::start(&ws, &script(vec![]));
    // The test seam makes loopback peers count as remote: a token is required.
    let mut cmd = serve_command(&ws, &stub, &["--listen", "127.0.0.1:0"]);
    cmd.env("CALIBAN_DRIVE_TOKEN", "s3cret")
        .env("CALIBAN_TEST_LOOPBACK_IS_REMOTE", "1");
    let mut raw = Peer::spawn(cmd, RECV);
    let addr = raw.listen_addr("caliban mcp serve");
    let resp = request(
        addr,
        "POST",
        "/mcp",
        &[JSON_BODY, ACCEPT_BOTH],
        &init_body("2025-11-25"),
    );
    assert_eq!(resp.status, 401, "{resp:?}");
    assert_eq!(resp.header("www-authenticate"), Some("Bearer"));
    let resp = request(
        addr,
        "POST",
        "/mcp",
        &[JSON_BODY, ACCEPT_BOTH, ("authorization", "Bearer wrong")],
        &init_body("2025-11-25"),
    );
    assert_eq!(resp.status, 401);
    let resp = request(
        addr,
        "POST",
        "/mcp",
        &[JSON_BODY, ACCEPT_BOTH, ("authorization", "Bearer s3cret")],
        &init_body("2025-06-18"),
    );
    assert_eq!(resp.status, 200, "{resp:?}");
    assert_eq!(resp.json()["result"]["protocolVersion"], "2025-06-18");
    raw.close_stdin();
    // With --listen, stdin EOF ends only the stdio session: HTTP keeps serving.
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        raw.child().try_wait().expect("try_wait").is_none(),
        "exited on EOF"
    );
    let resp = request(
        addr,
        "POST",
        "/mcp",
        &[JSON_BODY, ACCEPT_BOTH, ("authorization", "Bearer s3cret")],
        &init_body("2025-11-25"),
    );
    assert_eq!(resp.status, 200);

    // Fail closed: a non-loopback --listen without a token is refused before binding.
    let out = run(serve_command(&ws, &stub, &["--listen", "0.0.0.0:0"]), "");
    assert_ne!(out.code, Some(0), "{out:?}");
    assert!(out.stderr.contains("refusing to bind"), "{out:?}");
    assert!(out.stdout.is_empty(), "{out:?}");
}

#[test]
fn mcp_http_initialize_floods_never_evict_live_sessions() {
    // `MAX_SESSIONS` in src/surface/mcp/http.rs.
    const MAX_SESSIONS: usize = 1024;
    let ws = Workspace::new("mcp-http-sessions");
    let stub = Stub::start(&ws, &script(vec![]));
    let raw = start_raw(&ws, &stub, &["--listen", "127.0.0.1:0"]);
    let addr = raw.listen_addr("caliban mcp serve");
    let sid = open_session(addr);
    let ping = json!({"jsonrpc": "2.0", "id": 2, "method": "ping"});
    let in_session = [JSON_BODY, ACCEPT_BOTH, ("mcp-session-id", sid.as_str())];

    // Anyone who can reach the listener sends `initialize` until the table is full, and
    // then some: the newcomers are refused, the live session stays.
    let mut conn = HttpConn::connect(addr);
    let mut refused = None;
    for n in 1..=MAX_SESSIONS + 8 {
        let resp = conn.request(
            "POST",
            "/mcp",
            &[JSON_BODY, ACCEPT_BOTH],
            &init_body("2025-11-25"),
        );
        if resp.status != 200 {
            refused = Some((n, resp));
            break;
        }
    }
    let (n, resp) = refused.expect("every initialize got a session: live ones were evicted");
    assert_eq!(
        n, MAX_SESSIONS,
        "the session table holds {MAX_SESSIONS} sessions"
    );
    assert_eq!(resp.status, 503, "{resp:?}");
    let body = resp.json();
    assert_eq!(body["jsonrpc"], "2.0", "{body}");
    assert_eq!(body["error"]["code"], -32000, "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("too many sessions"), "{body}");
    assert!(resp.header("mcp-session-id").is_none(), "{resp:?}");

    let resp = post(addr, &in_session, &ping);
    assert_eq!(resp.status, 200, "the first session was evicted: {resp:?}");
    assert_eq!(resp.json()["id"], 2, "{resp:?}");

    // Ending a session makes room for a new one.
    let resp = request(addr, "DELETE", "/mcp", &[("mcp-session-id", &sid)], b"");
    assert_eq!(resp.status, 200, "{resp:?}");
    let resp = conn.request(
        "POST",
        "/mcp",
        &[JSON_BODY, ACCEPT_BOTH],
        &init_body("2025-11-25"),
    );
    assert_eq!(resp.status, 200, "{resp:?}");
    assert!(resp.header("mcp-session-id").is_some(), "{resp:?}");
}

#[test]
fn mcp_http_over_tls() {
    let ws = Workspace::new("mcp-tls");
    let stub = Stub::start(&ws, &script(vec![]));
    let cert = path_str(&fixture("server.pem"));
    let key = path_str(&fixture("server-key.pem"));
    let raw = start_raw(
        &ws,
        &stub,
        &[
            "--listen",
            "127.0.0.1:0",
            "--tls-cert",
            &cert,
            "--tls-key",
            &key,
        ],
    );
    let addr = raw.listen_addr("caliban mcp serve");
    assert!(
        raw.stderr().contains("listening on https://"),
        "{}",
        raw.stderr()
    );
    let mut conn = HttpConn::connect_tls(addr, "localhost", &fixture("ca.pem"));
    let resp = conn.request(
        "POST",
        "/mcp",
        &[JSON_BODY, ACCEPT_BOTH],
        &init_body("2025-11-25"),
    );
    assert_eq!(resp.status, 200, "{resp:?}");
    let sid = resp.header("mcp-session-id").expect("session").to_owned();
    // Keep-alive on the same TLS connection.
    let resp = conn.request(
        "POST",
        "/mcp",
        &[JSON_BODY, ACCEPT_BOTH, ("mcp-session-id", &sid)],
        br#"{"jsonrpc":"2.0","id":2,"method":"tools/list"}"#,
    );
    assert_eq!(
        resp.json()["result"]["tools"].as_array().map(Vec::len),
        Some(6)
    );
    // Plain HTTP to the TLS port gets no HTTP answer.
    let mut plain = HttpConn::connect(addr);
    plain.send(
        "POST",
        "/mcp",
        &[JSON_BODY, ACCEPT_BOTH],
        &init_body("2025-11-25"),
    );
    assert!(plain.closed_by_peer(Instant::now() + Duration::from_secs(10)));
}

// ---- the official conformance suite ------------------------------------------------------

/// Scenario names listed in the baseline file.
fn baseline(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .expect("read baseline")
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- "))
        .map(|l| l.split('#').next().unwrap_or("").trim().to_owned())
        .filter(|l| !l.is_empty())
        .collect()
}

#[test]
fn mcp_conformance_suite_matches_baseline() {
    let kit = kit();
    let ws = Workspace::new("mcp-conformance");
    let stub = Stub::start(&ws, &script(vec![]));
    let mut raw = start_raw(&ws, &stub, &["--listen", "127.0.0.1:0"]);
    let addr = raw.listen_addr("caliban mcp serve");
    let url = format!("http://{addr}/mcp");
    let baseline_path = manifest_dir().join("tests/conformance/baseline.yml");
    let results = ws.path("conformance-results");
    let out = output_within(
        Command::new(kit.node())
            .arg(kit.conformance())
            .args(["server", "--url", &url, "--suite", "all"])
            .arg("--expected-failures")
            .arg(&baseline_path)
            .arg("-o")
            .arg(&results)
            .current_dir(&kit.dir)
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("HOME", ws.path("home"))
            .env("NO_COLOR", "1"),
        "spawn the conformance suite",
        CONFORMANCE_TIMEOUT,
    );
    // Per-scenario lines: `✓ ping: 1 passed, 0 failed` / `✗ tools-call-image: 0 passed, …`.
    let mut passed = Vec::new();
    let mut failed = Vec::new();
    for line in out.stdout.lines() {
        if let Some(rest) = line.strip_prefix("✓ ") {
            passed.push(rest.split(':').next().unwrap_or("").to_owned());
        } else if let Some(rest) = line.strip_prefix("✗ ") {
            failed.push(rest.split(':').next().unwrap_or("").to_owned());
        }
    }
    let summary = format!(
        "conformance (@modelcontextprotocol/conformance 0.1.16, --suite all): {} scenarios \
         passed, {} failed (all expected)\npassed: {}\nfailed: {}\n",
        passed.len(),
        failed.len(),
        passed.join(", "),
        failed.join(", ")
    );
    eprintln!("{summary}");
    let _ = std::fs::write(
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("mcp-conformance-summary.txt"),
        &summary,
    );
    assert_eq!(
        out.code,
        Some(0),
        "the conformance suite disagrees with tests/conformance/baseline.yml (a new failure \
         or a now-passing scenario to remove): {out:?}"
    );
    // The baseline explains exactly the failures, and the scenarios any correct server
    // passes are among the passes.
    let mut expected = baseline(&baseline_path);
    expected.sort();
    failed.sort();
    assert_eq!(failed, expected, "{out:?}");
    for must in [
        "server-initialize",
        "ping",
        "logging-set-level",
        "tools-list",
        "server-sse-multiple-streams",
        "dns-rebinding-protection",
    ] {
        assert!(
            passed.iter().any(|p| p == must),
            "{must} did not pass: {out:?}"
        );
    }
    raw.close_stdin();
}

// ---- context compaction (issue 14) ----------------------------------------------------------

/// `caliban_send_input` with `compact: true` compacts an interactive run's conversation (a
/// `Compaction` event, and the run waits for input again); a summary the model cannot give
/// fails the run with `CompactionFailed`.
#[test]
fn mcp_send_input_compact_and_a_failed_compaction() {
    let ws = Workspace::new("mcp-compact");
    let stub = Stub::start(
        &ws,
        &script(vec![
            Turn::text("first answer").usage(10, 4),
            Turn::text("THE-SUMMARY").usage(10, 4),
            Turn::bare().fault(Fault::Status(400)),
        ]),
    );
    let mut raw = start_raw(&ws, &stub, &[]);
    raw.mcp_initialize("2025-06-18", json!({}), "raw");
    let run = raw.tool_body(
        1,
        "caliban_run",
        json!({"prompt": "one", "interactive": true}),
    )["run_id"]
        .as_str()
        .expect("run_id")
        .to_owned();
    let mut id = 2;
    let mut cursor = 0;
    let mut events = Vec::new();
    let mut wait_until = |raw: &mut Peer, done: &dyn Fn(&Value, &[Value]) -> bool| loop {
        let body = raw.tool_body(
            id,
            "caliban_poll",
            json!({"run_id": run, "cursor": cursor, "wait_ms": 5000}),
        );
        id += 1;
        assert!(id < 60, "never got there: {body}");
        events.extend(body["events"].as_array().cloned().unwrap_or_default());
        cursor = body["next_cursor"].as_u64().expect("next_cursor");
        if done(&body["status"], &events) {
            return events.clone();
        }
    };
    let compactions = |events: &[Value]| {
        events
            .iter()
            .filter(|e| e["event"]["type"] == "Compaction")
            .count()
    };
    wait_until(&mut raw, &|s, _| s["state"] == "awaiting_input");
    let sent = raw.tool_body(
        100,
        "caliban_send_input",
        json!({"run_id": run, "compact": true}),
    );
    assert_eq!(sent, json!({"ok": true}));
    let seen = wait_until(&mut raw, &|s, e| {
        s["state"] == "awaiting_input" && compactions(e) == 1
    });
    let compaction = seen
        .iter()
        .find(|e| e["event"]["type"] == "Compaction")
        .expect("Compaction");
    assert_eq!(compaction["v"], 1);
    assert_eq!(compaction["event"]["trigger"], "manual");
    assert_eq!(compaction["event"]["summary"], "THE-SUMMARY");
    assert_eq!(compaction["event"]["messages_summarized"], 2);
    raw.tool_body(
        101,
        "caliban_send_input",
        json!({"run_id": run, "compact": true}),
    );
    let seen = wait_until(&mut raw, &|s, _| s["state"] == "failed");
    let end = &seen.last().expect("events")["event"];
    assert_eq!(end["type"], "RunEnd");
    assert!(end["stopped_for"]["CompactionFailed"].is_string(), "{end}");
}

/// `images` on `caliban_run` and `caliban_send_input` reach the model; one it could not take
/// is refused with the reason.
#[test]
fn mcp_images_on_run_and_send_input() {
    use crate::util::{PNG, image_block};
    let ws = Workspace::new("mcp-images");
    let stub = Stub::start(
        &ws,
        &script(vec![
            Turn::text("a red dot").usage(10, 4),
            Turn::text("another").usage(10, 4),
        ]),
    );
    let mut raw = start_raw(&ws, &stub, &[]);
    raw.mcp_initialize("2025-06-18", json!({}), "raw");
    let bad = raw.request(
        1,
        "tools/call",
        json!({"name": "caliban_run", "arguments": {"prompt": "x",
               "images": [image_block("image/tiff", "AAAA")]}}),
    );
    assert!(
        bad.to_string()
            .contains("unsupported image type `image/tiff`"),
        "{bad}"
    );
    let run = raw.tool_body(
        2,
        "caliban_run",
        json!({"prompt": "what is this?", "interactive": true,
               "images": [image_block("image/png", PNG)]}),
    )["run_id"]
        .as_str()
        .expect("run_id")
        .to_owned();
    for id in 3..40 {
        let body = raw.tool_body(
            id,
            "caliban_poll",
            json!({"run_id": run, "cursor": 0, "wait_ms": 2000}),
        );
        if body["status"]["state"] == "awaiting_input" {
            break;
        }
    }
    let sent = raw.tool_body(
        50,
        "caliban_send_input",
        json!({"run_id": run, "text": "and this?", "images": [image_block("image/jpeg", "/9j/4AAQ")]}),
    );
    assert_eq!(sent, json!({"ok": true}));
    let deadline = Instant::now() + Duration::from_secs(20);
    while stub.requests().len() < 2 {
        assert!(Instant::now() < deadline, "no second request");
        std::thread::sleep(Duration::from_millis(20));
    }
    let reqs = stub.requests();
    assert_eq!(
        reqs[0]["body"]["messages"][0]["content"][1]["source"]["data"],
        PNG
    );
    let last = reqs[1]["body"]["messages"]
        .as_array()
        .unwrap()
        .last()
        .cloned()
        .unwrap();
    assert_eq!(last["content"][0]["text"], "and this?");
    assert_eq!(last["content"][1]["source"]["media_type"], "image/jpeg");
}

/// A `caliban_run` of `mcp serve` calls the configured MCP servers' tools, and may name the
/// ones it wants with `mcp_servers`.
#[test]
fn mcp_serve_runs_call_configured_mcp_servers() {
    let ws = Workspace::new("mcp-serve-mcp-client");
    let stub = Stub::start(
        &ws,
        &script(vec![
            Turn::bare()
                .calling([Call::new(
                    "toolu_e",
                    "mcp__py__echo",
                    json!({"text": "nested"}),
                )])
                .usage(1, 1),
            Turn::text("done").usage(10, 4),
        ]),
    );
    ws.write(
        "mcp.json",
        &json!({"mcpServers": {"py": crate::util::mcp::stdio_server(&ws.root)}}).to_string(),
    );
    let cfg = path_str(&ws.path("mcp.json"));
    let mut raw = start_raw(&ws, &stub, &["--mcp-config", &cfg, "--allow", "mcp__py__*"]);
    raw.mcp_initialize("2025-11-25", json!({}), "raw");
    let run = raw.tool_body(
        1,
        "caliban_run",
        json!({"prompt": "echo", "mcp_servers": ["py"]}),
    )["run_id"]
        .as_str()
        .expect("run id")
        .to_owned();
    let events = raw_events_until_done(&mut raw, &run, 2);
    let end = events
        .iter()
        .find(|e| e["type"] == "ToolCallEnd")
        .expect("ToolCallEnd");
    assert_eq!(end["is_error"], false, "{end}");
    assert!(end.to_string().contains("echo: nested"), "{end}");
}
