//! `caliban http serve` end to end: the real server on loopback, driven by a hand-rolled
//! HTTP/1.1 client (and once by `curl`), against `caliban stub-model`. Routes, codes and
//! error texts follow `reference/upstream-caliban.md` §1.2–§1.4, §2, §4 and §7; the live
//! stream, cancel, delete, restart, TLS and auth follow DESIGN §4.1, §4.5, §4.6 and §5.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::util::http::*;
use crate::util::*;

const NOT_INTERACTIVE: &str =
    "cannot send input: drive session is not interactive; it accepts no input";
const ENDED: &str = "cannot send input: drive session has ended; it accepts no further input";
const INPUT_REQUIRES: &str = "input requires `text` or `end: true`";
const NO_PENDING: &str = "no pending permission request for this run";
const BIND_REFUSED: &str = "refusing to bind a drive surface to a non-loopback address without a bearer token (set CALIBAN_DRIVE_TOKEN)";

/// Asserts a JSON response with this status and exactly this body.
fn assert_json(resp: &Response, status: u16, body: Value) {
    assert_eq!(resp.status, status, "{resp:?}");
    assert!(
        resp.header("content-type")
            .is_some_and(|t| t.starts_with("application/json")),
        "{resp:?}"
    );
    assert_eq!(resp.json(), body, "{resp:?}");
}

fn assert_error(resp: &Response, status: u16, message: &str) {
    assert_json(resp, status, json!({ "error": message }));
}

fn of_type<'a>(events: &'a [Value], ty: &str) -> Vec<&'a Value> {
    events.iter().filter(|e| e["type"] == ty).collect()
}

fn run_end(events: &[Value]) -> &Value {
    let last = events.last().expect("no events");
    assert_eq!(last["type"], "RunEnd", "RunEnd must be last: {events:#?}");
    assert_eq!(of_type(events, "RunEnd").len(), 1, "{events:#?}");
    last
}

/// Checks the lines of a live stream that began at `start` (DESIGN §4.5): each has `"v":1`,
/// a `cursor` and exactly one of `status` / `event` / `permission_request`; the first is a
/// status; event cursors run on from `start` without a gap (an event's cursor is the value
/// to resume from, so one past its index), other lines carry the cursor reached so far; a
/// terminal status is the last line and the only terminal one (when `complete`, there is
/// one). Returns the events.
fn check_stream(lines: &[Value], start: u64, complete: bool) -> Vec<Value> {
    assert!(!lines.is_empty(), "empty stream");
    assert!(
        lines[0].get("status").is_some(),
        "the first line must be a status: {lines:#?}"
    );
    let mut at = start;
    let mut events = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let obj = line.as_object().expect("stream line is an object");
        assert_eq!(obj.get("v"), Some(&json!(1)), "{line}");
        let cursor = obj
            .get("cursor")
            .and_then(Value::as_u64)
            .unwrap_or_else(|| panic!("no cursor in {line}"));
        let kinds: Vec<&str> = ["status", "event", "permission_request"]
            .into_iter()
            .filter(|k| obj.contains_key(*k))
            .collect();
        assert_eq!(kinds.len(), 1, "exactly one payload per line: {line}");
        // The opening status of a stream that starts behind the end of the log says so.
        let replay = i == 0 && obj.get("replay") == Some(&json!(true));
        assert_eq!(obj.len(), 3 + usize::from(replay), "{line}");
        match kinds[0] {
            "event" => {
                assert_eq!(cursor, at + 1, "event cursors must be contiguous: {line}");
                at += 1;
                events.push(line["event"].clone());
            }
            "status" => {
                assert_eq!(cursor, at, "{line}");
                if is_terminal(&line["status"]) {
                    assert_eq!(
                        i,
                        lines.len() - 1,
                        "the stream must end right after its terminal status: {lines:#?}"
                    );
                }
            }
            _ => assert_eq!(cursor, at, "{line}"),
        }
    }
    if complete {
        let last = lines.last().expect("lines");
        assert!(
            last.get("status").is_some_and(is_terminal),
            "a complete stream ends with a terminal status: {lines:#?}"
        );
    }
    events
}

/// One sample of `GET /metrics`, by its series name as printed (labels included).
fn metric(addr: SocketAddr, series: &str) -> Option<f64> {
    let resp = get(addr, "/metrics");
    assert_eq!(resp.status, 200, "{resp:?}");
    resp.text().lines().find_map(|line| {
        let (name, value) = line.rsplit_once(' ')?;
        (name == series).then(|| value.parse().expect("numeric sample"))
    })
}

fn follow_path(run: &str, cursor: u64) -> String {
    format!("/runs/{run}/events?cursor={cursor}&follow=1")
}

fn unique_marker(tag: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("caliban-http-{tag}-{}-{nanos}", std::process::id())
}

// ---- 1. routes and codes ------------------------------------------------------------------

#[test]
fn post_runs_answers_200_415_400_422() {
    let ws = Workspace::new("http-post-runs");
    let stub = Stub::start(&ws, &script([Turn::text("one"), Turn::text("two")]));
    let server = Serve::start(&ws, &stub, &[], &[]);
    let addr = server.addr;

    // No content type, or not JSON: 415.
    let resp = request(addr, "POST", "/runs", &[], br#"{"prompt":"hi"}"#);
    assert_eq!(resp.status, 415, "{resp:?}");
    assert!(resp.json()["error"].is_string(), "{resp:?}");
    let resp = request(
        addr,
        "POST",
        "/runs",
        &[("content-type", "text/plain")],
        br#"{"prompt":"hi"}"#,
    );
    assert_eq!(resp.status, 415, "{resp:?}");
    // Malformed JSON: 400.
    let resp = request(
        addr,
        "POST",
        "/runs",
        &[("content-type", "application/json")],
        br#"{"prompt":"#,
    );
    assert_eq!(resp.status, 400, "{resp:?}");
    assert!(resp.json()["error"].is_string(), "{resp:?}");
    // Well-formed but the wrong shape: 422.
    for body in [
        json!({}),
        json!({"prompt": 5}),
        json!(["hi"]),
        json!({"interactive": true}),
    ] {
        let resp = post_json(addr, "/runs", &body);
        assert_eq!(resp.status, 422, "{body}: {resp:?}");
        assert!(resp.json()["error"].is_string(), "{resp:?}");
    }
    let resp = post_json(addr, "/runs", &json!({}));
    assert_error(&resp, 422, "missing field `prompt`");
    // None of those started a run.
    assert_json(&get(addr, "/runs"), 200, json!({"runs": []}));

    // 200 (not 201) with upstream's body; ids count from run-1.
    let resp = post_json(addr, "/runs", &json!({"prompt": "first"}));
    assert_json(&resp, 200, json!({"run_id": "run-1"}));
    wait_terminal(addr, "run-1");
    // A charset parameter is still JSON.
    let resp = request(
        addr,
        "POST",
        "/runs",
        &[("content-type", "application/json; charset=utf-8")],
        json!({"prompt": "second", "interactive": false})
            .to_string()
            .as_bytes(),
    );
    assert_json(&resp, 200, json!({"run_id": "run-2"}));
    wait_terminal(addr, "run-2");
    assert_eq!(stub.requests().len(), 2);
}

#[test]
fn events_route_cursor_rules_and_404() {
    let ws = Workspace::new("http-events");
    let stub = Stub::start(
        &ws,
        &script([Turn::text("alpha beta gamma delta epsilon zeta eta theta")]),
    );
    let server = Serve::start(&ws, &stub, &[], &[]);
    let addr = server.addr;
    let run = start_run(addr, json!({"prompt": "go"}));
    assert_eq!(run, "run-1");
    assert_eq!(
        wait_terminal(addr, &run),
        json!({"state": "done"}),
        "{}",
        server.stderr()
    );

    // Default cursor 0: the whole run.
    let resp = get(addr, "/runs/run-1/events");
    assert_eq!(resp.status, 200, "{resp:?}");
    let page = resp.json();
    let full = all_events(addr, &run);
    let total = full.len() as u64;
    assert_eq!(page["next_cursor"], total);
    assert_eq!(page["status"], json!({"state": "done"}));
    assert_eq!(page["permission_request"], Value::Null);
    let events: Vec<Value> = page["events"]
        .as_array()
        .expect("events")
        .iter()
        .map(|e| e["event"].clone())
        .collect();
    assert_eq!(events, full);
    assert_eq!(full[0]["type"], "TurnStart");
    assert!(!of_type(&full, "AssistantTextDelta").is_empty());
    let end = run_end(&full);
    assert_eq!(end["stopped_for"], "EndOfTurn");
    let text: String = of_type(&full, "AssistantTextDelta")
        .iter()
        .map(|e| e["text"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(text, "alpha beta gamma delta epsilon zeta eta theta");

    // A cursor inside the log: the rest. At or past the end: an empty batch, next = total.
    let page = events_page(addr, &run, 2);
    let rest: Vec<Value> = page["events"]
        .as_array()
        .expect("events")
        .iter()
        .map(|e| e["event"].clone())
        .collect();
    assert_eq!(rest, full[2..].to_vec());
    assert_eq!(page["next_cursor"], total);
    for cursor in [total, total + 1, total + 1000] {
        let page = events_page(addr, &run, cursor);
        assert_eq!(page["events"], json!([]));
        assert_eq!(page["next_cursor"], total);
        assert_eq!(page["status"], json!({"state": "done"}));
    }

    // A cursor that is not a non-negative integer: 400.
    for bad in ["abc", "-1", "1.5", ""] {
        let resp = get(addr, &format!("/runs/run-1/events?cursor={bad}"));
        assert_eq!(resp.status, 400, "cursor={bad}: {resp:?}");
        assert!(resp.json()["error"].is_string(), "{resp:?}");
    }

    // Unknown runs: 404 with upstream's text, on both polling routes.
    assert_error(
        &get(addr, "/runs/run-999/events"),
        404,
        "unknown run_id: run-999",
    );
    assert_error(
        &get(addr, "/runs/run-999/events?follow=1"),
        404,
        "unknown run_id: run-999",
    );
    assert_error(
        &get(addr, "/runs/run-999/status"),
        404,
        "unknown run_id: run-999",
    );
    assert_error(
        &get(addr, "/runs/bogus/events"),
        404,
        "unknown run_id: bogus",
    );

    assert_json(
        &get(addr, "/runs/run-1/status"),
        200,
        json!({"status": {"state": "done"}}),
    );
}

#[test]
fn input_and_permit_errors_use_upstream_texts() {
    let ws = Workspace::new("http-input-permit");
    let stub = Stub::start(
        &ws,
        &script([
            Turn::text("ready"),
            Turn::bash("toolu_p", "echo permitted"),
            Turn::text("tool ran"),
            Turn::text("not interactive"),
        ]),
    );
    let server = Serve::start(&ws, &stub, &[], &[]);
    let addr = server.addr;
    let run = start_run(addr, json!({"prompt": "hello", "interactive": true}));
    wait_state(addr, &run, "awaiting_input");

    // Input needs `text` or `end: true`.
    for body in [json!({}), json!({"end": false})] {
        assert_error(
            &post_json(addr, &format!("/runs/{run}/input"), &body),
            400,
            INPUT_REQUIRES,
        );
    }
    let resp = request(addr, "POST", &format!("/runs/{run}/input"), &[], b"{}");
    assert_eq!(resp.status, 415, "{resp:?}");
    // Nothing to permit on a live run with no prompt.
    let permit = |tool_use_id: &str, allow: bool| {
        post_json(
            addr,
            &format!("/runs/{run}/permit"),
            &json!({"tool_use_id": tool_use_id, "allow": allow}),
        )
    };
    assert_error(&permit("toolu_p", true), 409, NO_PENDING);
    let resp = post_json(
        addr,
        &format!("/runs/{run}/permit"),
        &json!({"allow": true}),
    );
    assert_eq!(resp.status, 422, "{resp:?}");
    // Unknown runs: 404.
    assert_error(
        &post_json(addr, "/runs/run-999/input", &json!({"text": "x"})),
        404,
        "unknown run_id: run-999",
    );
    assert_error(
        &post_json(
            addr,
            "/runs/run-999/permit",
            &json!({"tool_use_id": "t", "allow": true}),
        ),
        404,
        "unknown run_id: run-999",
    );

    // The next turn calls Bash, which asks.
    assert_json(
        &post_json(
            addr,
            &format!("/runs/{run}/input"),
            &json!({"text": "use the tool"}),
        ),
        200,
        json!({"ok": true}),
    );
    let prompt = wait_prompt(addr, &run);
    assert_eq!(
        prompt,
        json!({"tool_use_id": "toolu_p", "tool_name": "Bash", "input": {"command": "echo permitted"}})
    );
    // A permit for another id: 409 naming both, and the prompt stays.
    assert_error(
        &permit("toolu_zzz", true),
        409,
        "no pending permission with tool_use_id toolu_zzz; current prompt is toolu_p",
    );
    assert_eq!(events_page(addr, &run, 0)["permission_request"], prompt);
    assert_json(&permit("toolu_p", true), 200, json!({"ok": true}));
    // Answered: nothing pending any more.
    assert_error(&permit("toolu_p", true), 409, NO_PENDING);
    wait_state(addr, &run, "awaiting_input");
    let events = all_events(addr, &run);
    let end = tool_end(&events, "toolu_p");
    assert_eq!(end["is_error"], false, "{end}");
    assert!(
        end["result_text"]
            .as_str()
            .unwrap_or_default()
            .contains("permitted"),
        "{end}"
    );

    assert_json(
        &post_json(addr, &format!("/runs/{run}/input"), &json!({"end": true})),
        200,
        json!({"ok": true}),
    );
    assert_eq!(wait_terminal(addr, &run), json!({"state": "done"}));
    assert_error(
        &post_json(
            addr,
            &format!("/runs/{run}/input"),
            &json!({"text": "more"}),
        ),
        409,
        ENDED,
    );
    assert_error(
        &permit("toolu_p", true),
        409,
        "no pending permission request for this run",
    );

    // A non-interactive run takes no input, running or not.
    let plain = start_run(addr, json!({"prompt": "once"}));
    assert_error(
        &post_json(addr, &format!("/runs/{plain}/input"), &json!({"text": "x"})),
        409,
        NOT_INTERACTIVE,
    );
    wait_terminal(addr, &plain);
    assert_error(
        &post_json(addr, &format!("/runs/{plain}/input"), &json!({"end": true})),
        409,
        NOT_INTERACTIVE,
    );
}

#[test]
fn parallel_asks_surface_one_prompt_at_a_time_in_order() {
    let ws = Workspace::new("http-prompt-queue");
    let stub = Stub::start(
        &ws,
        &script([
            Turn::calls([
                Call::bash("toolu_1", "echo first-call"),
                Call::bash("toolu_2", "echo second-call"),
            ]),
            Turn::text("both answered"),
        ]),
    );
    let server = Serve::start(&ws, &stub, &[], &[]);
    let addr = server.addr;
    let run = start_run(addr, json!({"prompt": "two calls"}));
    let permit = |id: &str, allow: bool| {
        post_json(
            addr,
            &format!("/runs/{run}/permit"),
            &json!({"tool_use_id": id, "allow": allow}),
        )
    };
    let prompt = wait_prompt(addr, &run);
    assert_eq!(prompt["tool_use_id"], "toolu_1", "{prompt}");
    // The queued second prompt cannot be answered ahead of the first.
    assert_error(
        &permit("toolu_2", true),
        409,
        "no pending permission with tool_use_id toolu_2; current prompt is toolu_1",
    );
    assert_json(&permit("toolu_1", true), 200, json!({"ok": true}));
    let prompt = wait_for("the second prompt", || {
        let prompt = events_page(addr, &run, 0)["permission_request"].clone();
        (prompt["tool_use_id"] == "toolu_2").then_some(prompt)
    });
    assert_eq!(prompt["input"], json!({"command": "echo second-call"}));
    assert_json(&permit("toolu_2", false), 200, json!({"ok": true}));
    assert_eq!(wait_terminal(addr, &run), json!({"state": "done"}));
    let events = all_events(addr, &run);
    let first = tool_end(&events, "toolu_1");
    assert_eq!(first["is_error"], false, "{first}");
    let second = tool_end(&events, "toolu_2");
    assert_eq!(second["is_error"], true, "{second}");
    assert!(
        second["result_text"]
            .as_str()
            .unwrap_or_default()
            .contains("denied by client"),
        "upstream's default denial reason: {second}"
    );
}

#[test]
fn cancel_delete_and_list() {
    let ws = Workspace::new("http-cancel-delete");
    let stub = Stub::start(&ws, &script([Turn::bash("toolu_c", "echo never")]));
    let server = Serve::start(&ws, &stub, &[], &[]);
    let addr = server.addr;
    assert_json(&get(addr, "/runs"), 200, json!({"runs": []}));

    let run = start_run(addr, json!({"prompt": "list me"}));
    wait_prompt(addr, &run);
    let list = get(addr, "/runs");
    assert_eq!(list.status, 200, "{list:?}");
    let runs = list.json()["runs"].as_array().expect("runs").clone();
    assert_eq!(runs.len(), 1, "{runs:?}");
    let entry = &runs[0];
    assert_eq!(entry["run_id"], "run-1");
    assert_eq!(entry["status"], json!({"state": "running"}));
    assert_eq!(entry["interactive"], false);
    assert_eq!(entry["prompt"], "list me");
    assert!(
        entry["created_ms"].as_u64().is_some_and(|t| t > 0),
        "{entry}"
    );
    assert!(entry["events"].as_u64().is_some_and(|n| n > 0), "{entry}");
    assert!(session_file(&ws, &run).exists());

    // Cancel a run blocked on its prompt: the prompt goes, the run ends done/Cancelled.
    assert_json(
        &request(addr, "POST", &format!("/runs/{run}/cancel"), &[], b""),
        200,
        json!({"ok": true}),
    );
    assert_eq!(wait_terminal(addr, &run), json!({"state": "done"}));
    let page = events_page(addr, &run, 0);
    assert_eq!(page["permission_request"], Value::Null);
    let events = all_events(addr, &run);
    assert_eq!(run_end(&events)["stopped_for"], "Cancelled");
    // Cancelling a finished run is a no-op; an unknown one is 404.
    assert_json(
        &request(addr, "POST", &format!("/runs/{run}/cancel"), &[], b""),
        200,
        json!({"ok": true}),
    );
    assert_error(
        &request(addr, "POST", "/runs/run-999/cancel", &[], b""),
        404,
        "unknown run_id: run-999",
    );

    // Delete: gone from every route, and from disk.
    assert_json(
        &request(addr, "DELETE", &format!("/runs/{run}"), &[], b""),
        200,
        json!({"ok": true}),
    );
    assert_error(
        &get(addr, &format!("/runs/{run}/status")),
        404,
        "unknown run_id: run-1",
    );
    assert_error(
        &get(addr, &format!("/runs/{run}/events")),
        404,
        "unknown run_id: run-1",
    );
    assert_json(&get(addr, "/runs"), 200, json!({"runs": []}));
    assert!(!session_file(&ws, &run).exists());
    assert_error(
        &request(addr, "DELETE", &format!("/runs/{run}"), &[], b""),
        404,
        "unknown run_id: run-1",
    );
}

#[test]
fn healthz_metrics_and_openapi() {
    let ws = Workspace::new("http-meta");
    let stub = Stub::start(&ws, &script([Turn::text("counted")]));
    let server = Serve::start(&ws, &stub, &[], &[]);
    let addr = server.addr;

    let health = get(addr, "/healthz");
    assert_eq!(health.status, 200, "{health:?}");
    assert_eq!(health.json()["status"], "ok");
    assert!(health.json()["version"].is_string(), "{health:?}");

    let run = start_run(addr, json!({"prompt": "count"}));
    wait_terminal(addr, &run);
    let events = all_events(addr, &run);

    let metrics = get(addr, "/metrics");
    assert_eq!(metrics.status, 200, "{metrics:?}");
    assert!(
        metrics
            .header("content-type")
            .is_some_and(|t| t.starts_with("text/plain")),
        "{metrics:?}"
    );
    let text = metrics.text();
    let mut typed = Vec::new();
    let mut samples = std::collections::BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("TYPE line");
            assert!(
                ["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind),
                "{line}"
            );
            typed.push(name.to_owned());
            continue;
        }
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').expect("sample line");
        value
            .parse::<f64>()
            .unwrap_or_else(|e| panic!("bad sample value in {line:?}: {e}"));
        let name = series.split('{').next().unwrap_or_default();
        assert!(
            !name.is_empty()
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b':'),
            "bad metric name in {line:?}"
        );
        if let Some(labels) = series.strip_prefix(name) {
            assert!(
                labels.is_empty() || (labels.starts_with('{') && labels.ends_with('}')),
                "{line:?}"
            );
        }
        assert!(typed.iter().any(|t| t == name), "no # TYPE for {line:?}");
        samples.insert(series.to_owned(), value.to_owned());
    }
    assert_eq!(samples["caliban_runs{state=\"done\"}"], "1", "{text}");
    for state in ["starting", "running", "awaiting_input", "failed"] {
        assert_eq!(
            samples[&format!("caliban_runs{{state=\"{state}\"}}")],
            "0",
            "{text}"
        );
    }
    assert_eq!(
        samples["caliban_events_total"],
        events.len().to_string(),
        "{text}"
    );

    let resp = get(addr, "/openapi.json");
    assert_eq!(resp.status, 200, "{resp:?}");
    assert!(
        resp.header("content-type")
            .is_some_and(|t| t.starts_with("application/json")),
        "{resp:?}"
    );
    let doc = resp.json();
    assert!(
        doc["openapi"]
            .as_str()
            .is_some_and(|v| v.starts_with("3.1.")),
        "{}",
        doc["openapi"]
    );
    let routes = [
        ("/runs", &["get", "post"][..]),
        ("/runs/{id}/events", &["get"]),
        ("/runs/{id}/status", &["get"]),
        ("/runs/{id}/input", &["post"]),
        ("/runs/{id}/permit", &["post"]),
        ("/runs/{id}/cancel", &["post"]),
        ("/runs/{id}", &["delete"]),
        ("/healthz", &["get"]),
        ("/metrics", &["get"]),
        ("/openapi.json", &["get"]),
    ];
    for (path, methods) in routes {
        let item = &doc["paths"][path];
        assert!(item.is_object(), "openapi.json lacks {path}");
        for method in methods {
            assert!(
                item[*method].is_object(),
                "openapi.json lacks {method} {path}"
            );
        }
    }
}

#[test]
fn unknown_paths_404_and_wrong_methods_405_with_allow() {
    let ws = Workspace::new("http-404-405");
    let stub = Stub::start(&ws, &script([Turn::text("unused")]));
    let server = Serve::start(&ws, &stub, &[], &[]);
    let addr = server.addr;
    for path in [
        "/",
        "/nope",
        "/runs/run-1/bogus",
        "/runs/run-1/events/x",
        "/v1/runs",
    ] {
        let resp = get(addr, path);
        assert_eq!(resp.status, 404, "GET {path}: {resp:?}");
        assert!(resp.json()["error"].is_string(), "{resp:?}");
    }
    let cases = [
        ("PUT", "/runs", "GET, POST"),
        ("DELETE", "/runs", "GET, POST"),
        ("POST", "/healthz", "GET"),
        ("DELETE", "/metrics", "GET"),
        ("POST", "/openapi.json", "GET"),
        ("POST", "/runs/run-1/events", "GET"),
        ("PUT", "/runs/run-1/status", "GET"),
        ("GET", "/runs/run-1/input", "POST"),
        ("GET", "/runs/run-1/permit", "POST"),
        ("GET", "/runs/run-1/cancel", "POST"),
        ("GET", "/runs/run-1", "DELETE"),
        ("PATCH", "/runs/run-1", "DELETE"),
    ];
    for (method, path, allow) in cases {
        let resp = request(addr, method, path, &[], b"");
        assert_eq!(resp.status, 405, "{method} {path}: {resp:?}");
        assert_eq!(
            resp.header("allow"),
            Some(allow),
            "{method} {path}: {resp:?}"
        );
    }
}

// ---- 2. the interactive lifecycle -----------------------------------------------------------

#[test]
fn interactive_run_lifecycle() {
    let ws = Workspace::new("http-interactive");
    let stub = Stub::start(
        &ws,
        &script([Turn::text("first answer"), Turn::text("second answer")]),
    );
    let server = Serve::start(&ws, &stub, &[], &[]);
    let addr = server.addr;
    let run = start_run(addr, json!({"prompt": "start", "interactive": true}));
    // A follower sees every lifecycle change as a status line.
    let mut follow = Follow::open(addr, &follow_path(&run, 0), &[]);
    let state = status_of(addr, &run)["state"].clone();
    assert!(
        state == "starting" || state == "running" || state == "awaiting_input",
        "{state}"
    );

    // Status never runs ahead of events: a page saying awaiting_input already holds the
    // turn's TurnEnd; there is no RunEnd before the end.
    let page = wait_for("the first awaiting_input page", || {
        let page = events_page(addr, &run, 0);
        (page["status"]["state"] == "awaiting_input").then_some(page)
    });
    let events: Vec<Value> = page["events"]
        .as_array()
        .expect("events")
        .iter()
        .map(|e| e["event"].clone())
        .collect();
    assert_eq!(of_type(&events, "TurnEnd").len(), 1, "{events:#?}");
    assert!(of_type(&events, "RunEnd").is_empty(), "{events:#?}");
    assert_eq!(events.last().expect("events")["type"], "TurnEnd");

    assert_json(
        &post_json(
            addr,
            &format!("/runs/{run}/input"),
            &json!({"text": "and then?"}),
        ),
        200,
        json!({"ok": true}),
    );
    let page = wait_for("the second awaiting_input page", || {
        let page = events_page(addr, &run, 0);
        (page["status"]["state"] == "awaiting_input"
            && page["events"]
                .as_array()
                .expect("events")
                .iter()
                .filter(|e| e["event"]["type"] == "TurnEnd")
                .count()
                == 2)
            .then_some(page)
    });
    assert_eq!(page["permission_request"], Value::Null);
    // The follow-up went to the model as a user message after the first answer.
    let requests = stub.requests();
    assert_eq!(requests.len(), 2);
    let messages = requests[1]["body"]["messages"]
        .as_array()
        .expect("messages");
    let last = messages.last().expect("a message");
    assert_eq!(last["role"], "user");
    assert!(last.to_string().contains("and then?"), "{last}");
    assert!(
        messages
            .iter()
            .any(|m| m["role"] == "assistant" && m.to_string().contains("first answer")),
        "{messages:?}"
    );

    assert_json(
        &post_json(addr, &format!("/runs/{run}/input"), &json!({"end": true})),
        200,
        json!({"ok": true}),
    );
    // Terminal status only once RunEnd is readable, in the same page.
    let page = wait_for("the done page", || {
        let page = events_page(addr, &run, 0);
        is_terminal(&page["status"]).then_some(page)
    });
    assert_eq!(page["status"], json!({"state": "done"}));
    let events: Vec<Value> = page["events"]
        .as_array()
        .expect("events")
        .iter()
        .map(|e| e["event"].clone())
        .collect();
    let end = run_end(&events);
    assert_eq!(end["stopped_for"], "EndOfTurn");
    assert_eq!(end["turn_count"], 2);
    assert_eq!(of_type(&events, "TurnStart").len(), 2);

    assert_error(
        &post_json(
            addr,
            &format!("/runs/{run}/input"),
            &json!({"text": "late"}),
        ),
        409,
        ENDED,
    );
    assert_error(
        &post_json(addr, &format!("/runs/{run}/input"), &json!({"end": true})),
        409,
        ENDED,
    );
    assert_eq!(stub.requests().len(), 2);

    let lines = follow.rest();
    let streamed = check_stream(&lines, 0, true);
    assert_eq!(streamed, events);
    let mut states: Vec<&str> = Vec::new();
    for line in &lines {
        if let Some(state) = line.get("status").and_then(|s| s["state"].as_str())
            && states.last() != Some(&state)
        {
            states.push(state);
        }
    }
    let changes = ["awaiting_input", "running", "awaiting_input", "done"];
    assert!(
        states == changes || states[..] == [&["running"][..], &changes[..]].concat()[..],
        "{states:?}"
    );
}

// ---- 3–5. live streams --------------------------------------------------------------------

#[test]
fn live_ndjson_stream_with_a_permission_prompt() {
    let ws = Workspace::new("http-follow");
    let stub = Stub::start(
        &ws,
        &script([
            Turn::bash("toolu_live", "echo streamed-bash-output"),
            Turn::text("all done"),
        ]),
    );
    let server = Serve::start(&ws, &stub, &[], &[]);
    let addr = server.addr;
    let run = start_run(addr, json!({"prompt": "stream it"}));
    let mut follow = Follow::open(addr, &follow_path(&run, 0), &[]);
    assert!(
        follow
            .header("content-type")
            .is_some_and(|t| t.starts_with("application/x-ndjson")),
        "{:?}",
        follow.headers
    );

    let first = follow.next_line().expect("a first line");
    assert!(
        first["status"]["state"] == "starting" || first["status"]["state"] == "running",
        "{first}"
    );
    let mut lines = vec![first];
    let mut permitted = false;
    while let Some(line) = follow.next_line() {
        if let Some(prompt) = line.get("permission_request")
            && !prompt.is_null()
        {
            assert!(!permitted, "the prompt came twice: {line}");
            assert_eq!(
                *prompt,
                json!({"tool_use_id": "toolu_live", "tool_name": "Bash",
                       "input": {"command": "echo streamed-bash-output"}})
            );
            let resp = post_json(
                addr,
                &format!("/runs/{run}/permit"),
                &json!({"tool_use_id": "toolu_live", "allow": true}),
            );
            assert_json(&resp, 200, json!({"ok": true}));
            permitted = true;
        }
        lines.push(line);
    }
    assert!(permitted, "no permission_request line: {lines:#?}");
    let events = check_stream(&lines, 0, true);
    assert_eq!(
        lines.last().expect("lines")["status"],
        json!({"state": "done"})
    );

    // The prompt line comes after the call it asks about, and is cleared by a null line.
    let prompt_at = lines
        .iter()
        .position(|l| l.get("permission_request").is_some_and(|p| !p.is_null()))
        .expect("prompt line");
    let cleared_at = lines
        .iter()
        .position(|l| l.get("permission_request").is_some_and(Value::is_null))
        .expect("a permission_request: null line");
    assert!(cleared_at > prompt_at, "{lines:#?}");
    let start_at = lines
        .iter()
        .position(|l| {
            l["event"]["type"] == "ToolCallStart" && l["event"]["tool_use_id"] == "toolu_live"
        })
        .expect("ToolCallStart line");
    assert!(start_at < prompt_at, "{lines:#?}");
    let end_at = lines
        .iter()
        .position(|l| l["event"]["type"] == "ToolCallEnd")
        .expect("ToolCallEnd line");
    assert!(end_at > prompt_at, "{lines:#?}");

    let end = tool_end(&events, "toolu_live");
    assert_eq!(end["is_error"], false, "{end}");
    assert!(
        end["result_text"]
            .as_str()
            .unwrap_or_default()
            .contains("streamed-bash-output"),
        "{end}"
    );
    run_end(&events);
    // The stream carried exactly what polling returns.
    assert_eq!(events, all_events(addr, &run));
}

/// A run that is still streaming for a second or two: many small deltas, dripped.
fn dripping_turn() -> Turn {
    let words: Vec<String> = (0..45).map(|i| format!("word{i}")).collect();
    Turn::bare().say(&words.join(" ")).fault(Fault::DripMs(100))
}

#[test]
fn ndjson_stream_resumes_after_a_disconnect() {
    let ws = Workspace::new("http-resume");
    let stub = Stub::start(&ws, &script([dripping_turn()]));
    let server = Serve::start(&ws, &stub, &[], &[]);
    let addr = server.addr;
    let run = start_run(addr, json!({"prompt": "drip"}));

    let mut follow = Follow::open(addr, &follow_path(&run, 0), &[]);
    let mut first = Vec::new();
    while first
        .iter()
        .filter(|l: &&Value| l.get("event").is_some())
        .count()
        < 3
    {
        first.push(follow.next_line().expect("the stream ended early"));
    }
    // Hang up mid-stream.
    drop(follow);
    let before = check_stream(&first, 0, false);
    let resume_at = first.last().expect("lines")["cursor"]
        .as_u64()
        .expect("cursor");
    assert_eq!(resume_at, before.len() as u64);

    let mut follow = Follow::open(addr, &follow_path(&run, resume_at), &[]);
    let second = follow.rest();
    assert!(
        !is_terminal(&second[0]["status"]),
        "the run should still be going when we reconnect: {second:#?}"
    );
    let after = check_stream(&second, resume_at, true);
    assert!(!after.is_empty());

    let mut union = before;
    union.extend(after);
    assert_eq!(union, all_events(addr, &run), "a gap or a duplicate");
    run_end(&union);
    assert_eq!(wait_terminal(addr, &run), json!({"state": "done"}));

    // Neither follower's connection outlives its client (the metrics request is the one).
    drop(follow);
    wait_for("the followers' connections to close", || {
        (metric(addr, "caliban_http_connections") == Some(1.0)).then_some(())
    });
}

#[test]
fn sse_stream_resumes_with_last_event_id() {
    let ws = Workspace::new("http-sse");
    let stub = Stub::start(&ws, &script([dripping_turn()]));
    let server = Serve::start(&ws, &stub, &[], &[]);
    let addr = server.addr;
    let run = start_run(addr, json!({"prompt": "drip"}));
    let accept = [("accept", "text/event-stream")];

    let read_sse = |follow: &mut Follow, stop_after_events: Option<usize>| -> Vec<Value> {
        let mut lines = Vec::new();
        while stop_after_events.is_none_or(|n| {
            lines
                .iter()
                .filter(|l: &&Value| l.get("event").is_some())
                .count()
                < n
        }) {
            let Some(event) = follow.next_sse() else {
                break;
            };
            let data = event.json();
            // Event lines carry their cursor as the SSE id; status and prompt lines none.
            if data.get("event").is_some() {
                let id = event.id.clone().expect("every event line has an id");
                assert_eq!(id, data["cursor"].to_string(), "id must be the cursor");
            } else {
                assert_eq!(event.id, None, "{data}");
            }
            lines.push(data);
        }
        lines
    };

    let mut follow = Follow::open(addr, &follow_path(&run, 0), &accept);
    assert!(
        follow
            .header("content-type")
            .is_some_and(|t| t.starts_with("text/event-stream")),
        "{:?}",
        follow.headers
    );
    let first = read_sse(&mut follow, Some(3));
    drop(follow);
    let before = check_stream(&first, 0, false);
    let last_id = first.last().expect("events")["cursor"].to_string();

    // Resume the way an EventSource does: the same URL without a cursor, plus Last-Event-ID.
    let mut follow = Follow::open(
        addr,
        &format!("/runs/{run}/events?follow=1"),
        &[("accept", "text/event-stream"), ("last-event-id", &last_id)],
    );
    let second = read_sse(&mut follow, None);
    let resume_at: u64 = last_id.parse().expect("numeric id");
    assert!(!is_terminal(&second[0]["status"]), "{second:#?}");
    let after = check_stream(&second, resume_at, true);
    let mut union = before;
    union.extend(after);
    assert_eq!(union, all_events(addr, &run), "a gap or a duplicate");
    run_end(&union);
}

/// DESIGN §4.5: "The response ends after the line carrying a terminal status." A follower
/// that starts behind the end of a finished run (a late subscriber, or a resume after the
/// run ended) must still get every event before the terminal status, and nothing after it.
#[test]
fn follow_of_a_finished_run_ends_with_its_terminal_status() {
    let ws = Workspace::new("http-follow-finished");
    let stub = Stub::start(
        &ws,
        &script([Turn::text("one two three four five six seven eight nine")]),
    );
    let server = Serve::start(&ws, &stub, &[], &[]);
    let addr = server.addr;
    let run = start_run(addr, json!({"prompt": "finish first"}));
    wait_terminal(addr, &run);
    let full = all_events(addr, &run);
    let total = full.len() as u64;

    // Caught up: one terminal status line, then the end.
    let lines = Follow::open(addr, &follow_path(&run, total), &[]).rest();
    assert_eq!(
        lines,
        vec![json!({"v": 1, "cursor": total, "status": {"state": "done"}})]
    );

    for start in [0, 2] {
        let lines = Follow::open(addr, &follow_path(&run, start), &[]).rest();
        let events = check_stream(&lines, start, true);
        assert_eq!(events, full[start as usize..].to_vec());
    }
}

/// A stream that starts behind the end of the log opens with the status the run had at
/// that point, so its terminal status can still come last; that line says it is history
/// (`"replay":true`), rather than claim a finished run is `running`.
#[test]
fn a_replay_says_its_opening_status_is_history() {
    let ws = Workspace::new("http-replay-status");
    let stub = Stub::start(&ws, &script([Turn::text("one two three")]));
    let server = Serve::start(&ws, &stub, &[], &[]);
    let addr = server.addr;
    let run = start_run(addr, json!({"prompt": "finish first"}));
    wait_terminal(addr, &run);
    let total = all_events(addr, &run).len() as u64;

    let lines = Follow::open(addr, &follow_path(&run, 0), &[]).rest();
    assert_eq!(
        lines[0],
        json!({"v": 1, "cursor": 0, "status": {"state": "running"}, "replay": true})
    );
    check_stream(&lines, 0, true);
    assert_eq!(
        lines.last().expect("lines")["status"],
        json!({"state": "done"})
    );
    // The same over SSE.
    let mut sse = Follow::open(
        addr,
        &follow_path(&run, 1),
        &[("accept", "text/event-stream")],
    );
    let opening = sse.next_sse().expect("an opening line");
    assert_eq!(opening.id, None);
    assert_eq!(
        opening.json(),
        json!({"v": 1, "cursor": 1, "status": {"state": "running"}, "replay": true})
    );
    drop(sse);
    // Caught up, the status is the present one: no flag.
    let lines = Follow::open(addr, &follow_path(&run, total), &[]).rest();
    assert_eq!(
        lines,
        vec![json!({"v": 1, "cursor": total, "status": {"state": "done"}})]
    );
}

/// SSE ids are event cursors and nothing else: status and prompt lines carry none, so no
/// id is ever sent twice (a status used to repeat the previous event's), and a reconnect
/// with the last id seen resumes right after the last event, nothing lost or repeated.
#[test]
fn sse_ids_belong_to_events_only() {
    let ws = Workspace::new("http-sse-ids");
    let stub = Stub::start(
        &ws,
        &script([
            Turn::bash("toolu_s", "echo sse"),
            Turn::text("all done, thanks"),
        ]),
    );
    let server = Serve::start(&ws, &stub, &[], &[]);
    let addr = server.addr;
    let run = start_run(addr, json!({"prompt": "stream it"}));
    let accept = ("accept", "text/event-stream");
    let mut follow = Follow::open(addr, &follow_path(&run, 0), &[accept]);
    let mut seen: Vec<(Option<String>, Value)> = Vec::new();
    let mut last_id_at_prompt = None;
    while let Some(event) = follow.next_sse() {
        let data = event.json();
        if data.get("permission_request").is_some_and(|p| !p.is_null()) {
            last_id_at_prompt = seen.iter().rev().find_map(|(id, _)| id.clone());
            let resp = post_json(
                addr,
                &format!("/runs/{run}/permit"),
                &json!({"tool_use_id": "toolu_s", "allow": true}),
            );
            assert_json(&resp, 200, json!({"ok": true}));
        }
        seen.push((event.id, data));
    }
    let lines: Vec<Value> = seen.iter().map(|(_, d)| d.clone()).collect();
    let events = check_stream(&lines, 0, true);
    let mut ids = Vec::new();
    for (id, data) in &seen {
        match data.get("event") {
            Some(_) => {
                let id = id.clone().unwrap_or_else(|| panic!("no id on {data}"));
                assert_eq!(id, data["cursor"].to_string(), "{data}");
                ids.push(id.parse::<u64>().expect("numeric id"));
            }
            None => assert_eq!(*id, None, "a status or prompt line with an id: {data}"),
        }
    }
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "ids repeat: {ids:?}");
    assert!(
        lines.iter().any(|l| l.get("permission_request").is_some()),
        "{lines:#?}"
    );

    // Reconnecting with the id last seen when the prompt came resumes after that event.
    let last_id = last_id_at_prompt.expect("an event before the prompt");
    let resumed = request(
        addr,
        "GET",
        &follow_path(&run, 0),
        &[accept, ("last-event-id", &last_id)],
        b"",
    );
    let after: u64 = last_id.parse().expect("numeric id");
    let body = String::from_utf8_lossy(&resumed.body).into_owned();
    let resumed_events: Vec<Value> = body
        .split("\n\n")
        .filter_map(|block| block.lines().find_map(|l| l.strip_prefix("data: ")))
        .map(|data| serde_json::from_str::<Value>(data).expect("json"))
        .filter_map(|line| line.get("event").cloned())
        .collect();
    assert_eq!(resumed_events, events[after as usize..].to_vec());
}

/// Upstream's poll clamps an over-large cursor (`next_cursor = len`); a stream started
/// past the end must report the clamped cursor too, or its cursors run backwards.
#[test]
fn follow_from_past_the_end_reports_the_clamped_cursor() {
    let ws = Workspace::new("http-follow-past-end");
    let stub = Stub::start(&ws, &script([Turn::bash("toolu_e", "echo never")]));
    let server = Serve::start(&ws, &stub, &[], &[]);
    let addr = server.addr;
    let run = start_run(addr, json!({"prompt": "wait"}));
    let prompt = wait_prompt(addr, &run);
    let so_far = events_page(addr, &run, 0)["next_cursor"]
        .as_u64()
        .expect("next_cursor");

    let mut follow = Follow::open(addr, &follow_path(&run, so_far + 1000), &[]);
    let first = follow.next_line().expect("a status line");
    let second = follow.next_line().expect("a prompt line");
    drop(follow);
    assert_eq!(
        [first, second],
        [
            json!({"v": 1, "cursor": so_far, "status": {"state": "running"}}),
            json!({"v": 1, "cursor": so_far, "permission_request": prompt}),
        ]
    );

    assert_json(
        &request(addr, "POST", &format!("/runs/{run}/cancel"), &[], b""),
        200,
        json!({"ok": true}),
    );
    wait_terminal(addr, &run);
    let total = all_events(addr, &run).len() as u64;
    let lines = Follow::open(addr, &follow_path(&run, total + 1000), &[]).rest();
    assert_eq!(
        lines,
        vec![json!({"v": 1, "cursor": total, "status": {"state": "done"}})]
    );
}

#[test]
fn deleting_a_followed_run_ends_the_stream() {
    let ws = Workspace::new("http-delete-followed");
    let stub = Stub::start(&ws, &script([Turn::bash("toolu_d", "echo never")]));
    let server = Serve::start(&ws, &stub, &[], &[]);
    let addr = server.addr;
    let run = start_run(addr, json!({"prompt": "wait on me"}));
    let mut follow = Follow::open(addr, &follow_path(&run, 0), &[]);
    loop {
        let line = follow.next_line().expect("stream ended before the prompt");
        if line.get("permission_request").is_some_and(|p| !p.is_null()) {
            break;
        }
    }
    assert_json(
        &request(addr, "DELETE", &format!("/runs/{run}"), &[], b""),
        200,
        json!({"ok": true}),
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match follow.next_line_within(left) {
            Ok(Some(_)) => continue,
            Ok(None) => break,
            Err(()) => panic!("the stream of a deleted run did not end"),
        }
    }
    assert_error(
        &get(addr, &format!("/runs/{run}/status")),
        404,
        "unknown run_id: run-1",
    );
}

// ---- 6. permission timeout ----------------------------------------------------------------

#[test]
fn unanswered_prompt_times_out_as_a_denial() {
    let ws = Workspace::new("http-prompt-timeout");
    let stub = Stub::start(
        &ws,
        &script([
            Turn::bash("toolu_t", "echo should-not-run"),
            Turn::text("denied then"),
        ]),
    );
    let server = Serve::start(&ws, &stub, &["--permission-timeout", "0.5"], &[]);
    let addr = server.addr;
    let run = start_run(addr, json!({"prompt": "ask and wait"}));
    assert_eq!(
        wait_terminal(addr, &run),
        json!({"state": "done"}),
        "{}",
        server.stderr()
    );
    let events = all_events(addr, &run);
    let end = tool_end(&events, "toolu_t");
    assert_eq!(end["is_error"], true, "{end}");
    let text = end["result_text"].as_str().unwrap_or_default();
    assert!(text.contains("did not respond within"), "{text}");
    assert!(
        text.contains(
            "permission denied for tool 'Bash': drive client did not respond within 0.5s"
        ),
        "{text}"
    );
    assert!(!text.contains("[exit code:"), "Bash ran: {text}");
    assert_eq!(run_end(&events)["stopped_for"], "EndOfTurn");
    assert_eq!(
        events_page(addr, &run, 0)["permission_request"],
        Value::Null
    );
}

// ---- 7. cancel kills the tool's processes --------------------------------------------------

#[test]
fn cancel_kills_a_running_bash_child() {
    let ws = Workspace::new("http-cancel-bash");
    let marker = unique_marker("sleep");
    let stub = Stub::start(
        &ws,
        &script([
            Turn::bash("toolu_s", &format!("bash -c 'exec -a {marker} sleep 30'")),
            Turn::text("never"),
        ]),
    );
    let server = Serve::start(&ws, &stub, &["--allow", "Bash"], &[]);
    let addr = server.addr;
    let run = start_run(addr, json!({"prompt": "sleep"}));
    wait_for("the Bash child to start", || {
        process_with_marker_exists(&marker).then_some(())
    });
    assert_eq!(status_of(addr, &run), json!({"state": "running"}));

    assert_json(
        &request(addr, "POST", &format!("/runs/{run}/cancel"), &[], b""),
        200,
        json!({"ok": true}),
    );
    assert_eq!(wait_terminal(addr, &run), json!({"state": "done"}));
    let events = all_events(addr, &run);
    assert_eq!(run_end(&events)["stopped_for"], "Cancelled");
    let deadline = Instant::now() + Duration::from_secs(5);
    while process_with_marker_exists(&marker) {
        assert!(
            Instant::now() < deadline,
            "the Bash child survived the cancel"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // The cancelled run never asked the model again.
    assert_eq!(stub.requests().len(), 1);
}

/// A command that starts `sleep 300` in a session of its own (so outside the call's process
/// group), named `marker`, with its output away from the call's pipes.
fn escapee(marker: &str) -> String {
    format!("setsid bash -c 'exec -a {marker} sleep 300' </dev/null >/dev/null 2>&1 &")
}

fn wait_gone(marker: &str, what: &str) {
    wait_for(what, || (!process_with_marker_exists(marker)).then_some(()));
}

#[test]
fn setsid_children_die_with_their_call_its_cancel_and_the_server() {
    let ws = Workspace::new("http-setsid");
    let ended = unique_marker("setsid-ended");
    let cancelled = unique_marker("setsid-cancelled");
    let orphaned = unique_marker("setsid-orphaned");
    let untagged = unique_marker("setsid-untagged");
    let stub = Stub::start(
        &ws,
        &script([
            // The call ends at once, leaving its escapee behind; `kill -0` proves it started.
            Turn::bash(
                "toolu_end",
                &format!("{} sleep 0.2; kill -0 $! && echo escaped", escapee(&ended)),
            ),
            Turn::text("left one behind"),
            // The call runs on with its escapee as a child; the run is cancelled.
            Turn::bash(
                "toolu_cancel",
                &format!("{} sleep 300", escapee(&cancelled)),
            ),
            // Escapees whose parent (a subshell) already exited, so caliban adopted them while
            // the call still runs; one dropped its environment. The server is then stopped.
            Turn::bash(
                "toolu_exit",
                &format!(
                    "({}); (setsid env -i bash -c 'exec -a {untagged} sleep 300' </dev/null >/dev/null 2>&1 &); sleep 300",
                    escapee(&orphaned)
                ),
            ),
        ]),
    );
    let mut server = Serve::start(&ws, &stub, &["--allow", "Bash"], &[]);
    let addr = server.addr;

    let run = start_run(addr, json!({"prompt": "leave one"}));
    assert_eq!(wait_terminal(addr, &run), json!({"state": "done"}));
    let events = all_events(addr, &run);
    let end = tool_end(&events, "toolu_end");
    assert!(end.to_string().contains("escaped"), "{end}");
    wait_gone(&ended, "the escapee of an ended call to be killed");

    let run = start_run(addr, json!({"prompt": "cancel me"}));
    wait_for("the escapee to start", || {
        process_with_marker_exists(&cancelled).then_some(())
    });
    assert_json(
        &request(addr, "POST", &format!("/runs/{run}/cancel"), &[], b""),
        200,
        json!({"ok": true}),
    );
    assert_eq!(wait_terminal(addr, &run), json!({"state": "done"}));
    wait_gone(&cancelled, "the escapee of a cancelled call to be killed");

    let run = start_run(addr, json!({"prompt": "stop the server"}));
    wait_for("both orphans to start", || {
        (process_with_marker_exists(&orphaned) && process_with_marker_exists(&untagged))
            .then_some(())
    });
    assert_eq!(status_of(addr, &run), json!({"state": "running"}));
    assert_eq!(server.terminate(), Some(0), "{}", server.stderr());
    // The server has exited: nothing its tools started may remain.
    for marker in [&ended, &cancelled, &orphaned, &untagged] {
        assert!(
            !process_with_marker_exists(marker),
            "{marker} outlived the server"
        );
    }
}

// ---- 8. restart -----------------------------------------------------------------------------

#[test]
fn finished_run_is_listed_after_a_restart() {
    let ws = Workspace::new("http-restart");
    let stub = Stub::start(
        &ws,
        &script([
            Turn::text("remember me please"),
            Turn::text("after restart"),
        ]),
    );
    let mut server = Serve::start(&ws, &stub, &[], &[]);
    let run = start_run(server.addr, json!({"prompt": "persist"}));
    wait_terminal(server.addr, &run);
    let events = all_events(server.addr, &run);
    assert_eq!(
        server.terminate(),
        Some(0),
        "SIGTERM should exit cleanly: {}",
        server.stderr()
    );

    server.restart(&ws, &stub);
    let addr = server.addr;
    let list = get(addr, "/runs");
    assert_eq!(list.status, 200, "{list:?}");
    let runs = list.json()["runs"].as_array().expect("runs").clone();
    assert_eq!(runs.len(), 1, "{runs:?}");
    assert_eq!(runs[0]["run_id"], run);
    assert_eq!(runs[0]["status"], json!({"state": "done"}));
    assert_eq!(runs[0]["prompt"], "persist");
    assert_eq!(runs[0]["events"], events.len() as u64);
    assert_eq!(status_of(addr, &run), json!({"state": "done"}));
    assert_eq!(all_events(addr, &run), events);
    // The old run can also be followed, and new runs do not reuse its id.
    let lines = Follow::open(addr, &follow_path(&run, events.len() as u64), &[]).rest();
    assert_eq!(
        lines.last().expect("lines")["status"],
        json!({"state": "done"})
    );
    let next = start_run(addr, json!({"prompt": "again"}));
    assert_eq!(next, "run-2");
    wait_terminal(addr, &next);
}

#[test]
fn run_killed_with_the_server_is_failed_interrupted_after_restart() {
    let ws = Workspace::new("http-restart-kill");
    // The model answers only after 30 s, so the run is mid-flight when the server dies.
    let stub = Stub::start(
        &ws,
        &script([Turn::bare().say("too late").fault(Fault::DelayMs(30000))]),
    );
    let mut server = Serve::start(&ws, &stub, &[], &[]);
    let run = start_run(server.addr, json!({"prompt": "hang"}));
    wait_for("the model request", || {
        (!stub.requests().is_empty()).then_some(())
    });
    assert_eq!(status_of(server.addr, &run), json!({"state": "running"}));
    server.kill();

    server.restart(&ws, &stub);
    let addr = server.addr;
    let runs = get(addr, "/runs").json()["runs"]
        .as_array()
        .expect("runs")
        .clone();
    assert_eq!(runs.len(), 1, "{runs:?}");
    assert_eq!(runs[0]["run_id"], run);
    let status = runs[0]["status"].clone();
    assert_eq!(status["state"], "failed", "{status}");
    assert!(
        status["error"]
            .as_str()
            .is_some_and(|e| e.contains("interrupted")),
        "{status}"
    );
    assert_eq!(status_of(addr, &run), status);
    let page = events_page(addr, &run, 0);
    assert_eq!(page["status"], status);
    assert_eq!(page["permission_request"], Value::Null);
    // A stream of it ends at once with the failed status.
    let lines = Follow::open(addr, &follow_path(&run, 0), &[]).rest();
    check_stream(&lines, 0, true);
    assert_eq!(lines.last().expect("lines")["status"], status);
    assert_error(
        &post_json(
            addr,
            &format!("/runs/{run}/permit"),
            &json!({"tool_use_id": "x", "allow": true}),
        ),
        409,
        "no pending permission request for this run",
    );
}

// ---- 9. TLS -------------------------------------------------------------------------------

#[test]
fn https_with_the_fixture_certificate() {
    let ws = Workspace::new("http-tls");
    let stub = Stub::start(&ws, &script([Turn::text("over tls")]));
    let cert = path_str(&fixture("server.pem"));
    let key = path_str(&fixture("server-key.pem"));
    let server = Serve::start(&ws, &stub, &["--tls-cert", &cert, "--tls-key", &key], &[]);
    assert_eq!(server.scheme, "https", "{}", server.stderr());
    let addr = server.addr;

    for name in ["localhost", "127.0.0.1"] {
        let mut conn = HttpConn::connect_tls(addr, name, &fixture("ca.pem"));
        let resp = conn.request("GET", "/healthz", &[], b"");
        assert_eq!(resp.status, 200, "{resp:?}");
        assert_eq!(resp.json()["status"], "ok");
        // A second request on the same TLS connection (keep-alive).
        let resp = conn.request("GET", "/runs", &[], b"");
        assert_eq!(resp.status, 200, "{resp:?}");
    }
    let mut conn = HttpConn::connect_tls(addr, "localhost", &fixture("ca.pem"));
    let resp = conn.request(
        "POST",
        "/runs",
        &[("content-type", "application/json")],
        br#"{"prompt":"secure"}"#,
    );
    assert_json(&resp, 200, json!({"run_id": "run-1"}));

    // Plain HTTP to the TLS port gets no HTTP answer.
    let mut plain = HttpConn::connect(addr);
    plain.send("GET", "/healthz", &[], b"");
    let closed = plain.closed_by_peer(Instant::now() + Duration::from_secs(10));
    assert!(closed, "the TLS listener kept a plaintext client open");
}

// ---- 10. auth -------------------------------------------------------------------------------

fn assert_unauthorized(resp: &Response) {
    assert_eq!(resp.status, 401, "{resp:?}");
    assert_eq!(resp.text(), "unauthorized", "{resp:?}");
}

/// `GET /healthz` answers a remote peer without the token (a kubelet's probe cannot carry
/// one), with the connection closed after it; no other method or path does.
fn assert_public_health(addr: std::net::SocketAddr) {
    for headers in [&[][..], &[("authorization", "Bearer wrong")][..]] {
        let resp = request(addr, "GET", "/healthz", headers, b"");
        assert_eq!(resp.status, 200, "{resp:?}");
        assert_eq!(resp.json()["status"], "ok");
        assert_eq!(resp.header("connection"), Some("close"), "{resp:?}");
    }
    assert_unauthorized(&request(addr, "POST", "/healthz", &[], b""));
    assert_unauthorized(&get(addr, "/healthz/x"));
}

#[test]
fn remote_peers_need_the_bearer_token() {
    let ws = Workspace::new("http-auth");
    let stub = Stub::start(&ws, &script([Turn::text("authorised")]));
    let remote = ("CALIBAN_TEST_LOOPBACK_IS_REMOTE", "1");

    // No token configured: every remote request is refused, whatever it presents, but the
    // liveness probe.
    let server = Serve::start(&ws, &stub, &[], &[remote]);
    let addr = server.addr;
    assert_unauthorized(&get(addr, "/metrics"));
    assert_unauthorized(&request(
        addr,
        "GET",
        "/metrics",
        &[("authorization", "Bearer s3cret")],
        b"",
    ));
    assert_unauthorized(&post_json(addr, "/runs", &json!({"prompt": "x"})));
    assert_public_health(addr);
    drop(server);

    // A token: missing, wrong, mis-cased or padded is 401; the exact bearer is 200.
    let server = Serve::start(
        &ws,
        &stub,
        &[],
        &[remote, ("CALIBAN_DRIVE_TOKEN", "s3cret")],
    );
    let addr = server.addr;
    assert_unauthorized(&get(addr, "/metrics"));
    assert_public_health(addr);
    for bad in [
        "Bearer wrong",
        "Bearer s3cre",
        "Bearer s3cret2",
        "bearer s3cret",
        "Bearer  s3cret",
        "Basic s3cret",
        "s3cret",
    ] {
        assert_unauthorized(&request(
            addr,
            "GET",
            "/metrics",
            &[("authorization", bad)],
            b"",
        ));
    }
    let auth = [("authorization", "Bearer s3cret")];
    let resp = request(addr, "GET", "/metrics", &auth, b"");
    assert_eq!(resp.status, 200, "{resp:?}");
    let resp = request(addr, "GET", "/healthz", &auth, b"");
    assert_eq!(resp.status, 200, "{resp:?}");
    assert_eq!(resp.json()["status"], "ok");
    assert_unauthorized(&post_json(addr, "/runs", &json!({"prompt": "x"})));
    let resp = request(
        addr,
        "POST",
        "/runs",
        &[
            ("authorization", "Bearer s3cret"),
            ("content-type", "application/json"),
        ],
        br#"{"prompt":"with token"}"#,
    );
    assert_json(&resp, 200, json!({"run_id": "run-1"}));
    let resp = request(addr, "GET", "/runs/run-1/status", &auth, b"");
    assert_eq!(resp.status, 200, "{resp:?}");
    assert_unauthorized(&get(addr, "/runs/run-1/status"));
}

#[test]
fn loopback_needs_no_token_even_when_one_is_set() {
    let ws = Workspace::new("http-auth-loopback");
    let stub = Stub::start(&ws, &script([Turn::text("open")]));
    let server = Serve::start(&ws, &stub, &[], &[("CALIBAN_DRIVE_TOKEN", "s3cret")]);
    let addr = server.addr;
    let resp = get(addr, "/healthz");
    assert_eq!(resp.status, 200, "{resp:?}");
    // A wrong token from loopback is never even looked at.
    let resp = request(
        addr,
        "GET",
        "/healthz",
        &[("authorization", "Bearer wrong")],
        b"",
    );
    assert_eq!(resp.status, 200, "{resp:?}");
    let run = start_run(addr, json!({"prompt": "open"}));
    assert_eq!(wait_terminal(addr, &run), json!({"state": "done"}));
}

#[test]
fn non_loopback_bind_without_token_is_refused() {
    let ws = Workspace::new("http-bind-refused");
    let stub = Stub::start(&ws, &script([Turn::text("never")]));
    for token in [None, Some("   ")] {
        let mut cmd = caliban(&ws);
        anthropic(&mut cmd, &stub);
        cmd.args(["http", "serve", "--addr", "0.0.0.0:0", "-C"])
            .arg(&ws.root);
        if let Some(token) = token {
            cmd.env("CALIBAN_DRIVE_TOKEN", token);
        }
        let out = run(cmd, "");
        assert!(out.code.is_some_and(|c| c != 0), "{out:?}");
        assert!(out.stderr.contains(BIND_REFUSED), "{out:?}");
        assert!(!out.stderr.contains("listening"), "{out:?}");
    }
}

// ---- 11. per-run fields only narrow ---------------------------------------------------------

#[test]
fn per_run_fields_only_narrow() {
    // A server that allows Bash: a run that denies it gets no Bash.
    let ws = Workspace::new("http-narrow-allow");
    let stub = Stub::start(
        &ws,
        &script([
            Turn::bash("toolu_d", "echo denied-run"),
            Turn::text("ok"),
            Turn::bash("toolu_a", "echo allowed-run"),
            Turn::text("ok"),
        ]),
    );
    let server = Serve::start(&ws, &stub, &["--allow", "Bash"], &[]);
    let addr = server.addr;
    let run = start_run(addr, json!({"prompt": "no bash", "deny": ["Bash"]}));
    assert_eq!(wait_terminal(addr, &run), json!({"state": "done"}));
    let events = all_events(addr, &run);
    let end = tool_end(&events, "toolu_d");
    assert_eq!(end["is_error"], true, "{end}");
    assert!(
        !end["result_text"]
            .as_str()
            .unwrap_or_default()
            .contains("[exit code:"),
        "Bash ran: {end}"
    );
    // Control: without the per-run deny the server's allow applies, with no prompt.
    let run = start_run(addr, json!({"prompt": "bash ok"}));
    assert_eq!(wait_terminal(addr, &run), json!({"state": "done"}));
    let events = all_events(addr, &run);
    let end = tool_end(&events, "toolu_a");
    assert_eq!(end["is_error"], false, "{end}");
    assert!(
        end["result_text"]
            .as_str()
            .unwrap_or_default()
            .contains("allowed-run"),
        "{end}"
    );
    drop(server);

    // A server that asks for Bash: neither bypassPermissions nor a per-run allow widens it.
    let ws = Workspace::new("http-narrow-ask");
    let stub = Stub::start(
        &ws,
        &script([
            Turn::bash("toolu_b", "echo bypass"),
            Turn::text("ok"),
            Turn::bash("toolu_c", "echo allow"),
            Turn::text("ok"),
        ]),
    );
    let server = Serve::start(&ws, &stub, &[], &[]);
    let addr = server.addr;
    for (body, id) in [
        (
            json!({"prompt": "bypass", "permission_mode": "bypassPermissions"}),
            "toolu_b",
        ),
        (json!({"prompt": "allow", "allow": ["Bash"]}), "toolu_c"),
    ] {
        let run = start_run(addr, body.clone());
        let prompt = wait_prompt(addr, &run);
        assert_eq!(prompt["tool_use_id"], id, "{body}: {prompt}");
        assert_eq!(prompt["tool_name"], "Bash", "{prompt}");
        let resp = post_json(
            addr,
            &format!("/runs/{run}/permit"),
            &json!({"tool_use_id": id, "allow": false, "reason": "not widened"}),
        );
        assert_json(&resp, 200, json!({"ok": true}));
        assert_eq!(wait_terminal(addr, &run), json!({"state": "done"}));
        let events = all_events(addr, &run);
        let end = tool_end(&events, id);
        assert_eq!(end["is_error"], true, "{end}");
        assert!(
            end["result_text"]
                .as_str()
                .unwrap_or_default()
                .contains("not widened"),
            "{end}"
        );
    }
    // Malformed narrowing fields are refused before a run starts.
    let resp = post_json(
        addr,
        "/runs",
        &json!({"prompt": "x", "permission_mode": "yolo"}),
    );
    assert_eq!(resp.status, 400, "{resp:?}");
    let resp = post_json(addr, "/runs", &json!({"prompt": "x", "deny": "Bash"}));
    assert_eq!(resp.status, 422, "{resp:?}");
    assert_eq!(
        get(addr, "/runs").json()["runs"].as_array().map(Vec::len),
        Some(2)
    );
}

#[test]
fn cwd_outside_the_workspace_is_rejected() {
    let ws = Workspace::new("http-cwd");
    ws.write("sub/marker.txt", "here\n");
    let stub = Stub::start(
        &ws,
        &script([Turn::bash("toolu_pwd", "pwd"), Turn::text("ok")]),
    );
    let server = Serve::start(&ws, &stub, &["--allow", "Bash"], &[]);
    let addr = server.addr;
    for cwd in ["/", "..", "sub/../..", "/tmp"] {
        let resp = post_json(addr, "/runs", &json!({"prompt": "escape", "cwd": cwd}));
        assert_eq!(resp.status, 400, "cwd {cwd}: {resp:?}");
        let error = resp.json()["error"].as_str().unwrap_or_default().to_owned();
        assert!(
            error.contains("is not a directory inside the server's workspace"),
            "{error}"
        );
    }
    let resp = post_json(addr, "/runs", &json!({"prompt": "x", "cwd": "missing"}));
    assert_eq!(resp.status, 400, "{resp:?}");
    assert_json(&get(addr, "/runs"), 200, json!({"runs": []}));

    // A subdirectory is fine, and the tools run there.
    let run = start_run(addr, json!({"prompt": "where", "cwd": "sub"}));
    assert_eq!(wait_terminal(addr, &run), json!({"state": "done"}));
    let events = all_events(addr, &run);
    let end = tool_end(&events, "toolu_pwd");
    assert_eq!(end["is_error"], false, "{end}");
    let sub = path_str(&ws.path("sub"));
    assert!(
        end["result_text"]
            .as_str()
            .unwrap_or_default()
            .contains(&sub),
        "{end}"
    );
}

// ---- 12. keep-alive, pipelining, slow readers -----------------------------------------------

#[test]
fn pipelined_requests_are_answered_in_order_on_one_connection() {
    let ws = Workspace::new("http-pipeline");
    let stub = Stub::start(&ws, &script([Turn::text("piped")]));
    let server = Serve::start(&ws, &stub, &[], &[]);
    let addr = server.addr;
    let mut conn = HttpConn::connect(addr);
    let mut batch = request_bytes("GET", "/healthz", &[], b"");
    batch.extend(request_bytes("GET", "/runs/run-404/status", &[], b""));
    batch.extend(request_bytes(
        "POST",
        "/runs",
        &[("content-type", "application/json")],
        br#"{"prompt":"pipelined"}"#,
    ));
    batch.extend(request_bytes("GET", "/runs", &[], b""));
    conn.send_raw(&batch);

    let health = conn.read_response();
    assert_eq!(health.status, 200, "{health:?}");
    assert_eq!(health.json()["status"], "ok");
    assert_error(&conn.read_response(), 404, "unknown run_id: run-404");
    assert_json(&conn.read_response(), 200, json!({"run_id": "run-1"}));
    let list = conn.read_response();
    assert_eq!(list.status, 200, "{list:?}");
    assert_eq!(list.json()["runs"][0]["run_id"], "run-1");

    // Still open for more (keep-alive), until a request asks to close.
    wait_terminal(addr, "run-1");
    let resp = conn.request("GET", "/runs/run-1/status", &[], b"");
    assert_json(&resp, 200, json!({"status": {"state": "done"}}));
    let resp = conn.request("GET", "/healthz", &[("connection", "close")], b"");
    assert_eq!(resp.status, 200, "{resp:?}");
    assert!(
        conn.closed_by_peer(Instant::now() + Duration::from_secs(10)),
        "the server kept the connection after `connection: close`"
    );
}

#[test]
fn a_follower_that_never_reads_does_not_block_others() {
    let ws = Workspace::new("http-slow-reader");
    // ~3 MB of text in 150 KB deltas: the stream of it (deltas, TurnEnd, RunEnd) is ~9 MB,
    // far beyond what the socket buffers of a reader that never reads can absorb.
    let word = "x".repeat(50_000);
    let text = vec![word.as_str(); 60].join(" ");
    let stub = Stub::start(&ws, &script([Turn::bare().say(&text)]));
    let server = Serve::start(&ws, &stub, &[], &[]);
    let addr = server.addr;
    let run = start_run(addr, json!({"prompt": "flood"}));
    let mut slow = Follow::open(addr, &follow_path(&run, 0), &[]);

    // The run finishes while the follower sits on its stream; other clients are served.
    wait_terminal(addr, &run);
    for _ in 0..3 {
        let started = Instant::now();
        let resp = get(addr, "/healthz");
        assert_eq!(resp.status, 200, "{resp:?}");
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "healthz took {:?} behind a stalled follower",
            started.elapsed()
        );
        let started = Instant::now();
        let resp = get(addr, &format!("/runs/{run}/status"));
        assert_json(&resp, 200, json!({"status": {"state": "done"}}));
        assert!(started.elapsed() < Duration::from_secs(2));
    }

    // The stalled follower still gets its whole stream once it reads.
    let lines = slow.rest();
    let events = check_stream(&lines, 0, true);
    assert_eq!(
        events.len() as u64,
        events_page(addr, &run, u64::MAX)["next_cursor"]
    );
    let streamed: String = of_type(&events, "AssistantTextDelta")
        .iter()
        .map(|e| e["text"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(streamed.len(), text.len());
}

// ---- 13. curl -------------------------------------------------------------------------------

#[test]
fn curl_drives_a_run_to_completion() {
    let found = std::process::Command::new("curl")
        .arg("--version")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status();
    assert!(
        found.is_ok_and(|s| s.success()),
        "this test requires the `curl` binary on PATH (install curl); it drives the API with it"
    );
    let ws = Workspace::new("http-curl");
    let words: Vec<String> = (0..12).map(|i| format!("w{i}")).collect();
    let stub = Stub::start(
        &ws,
        &script([Turn::bare().say(&words.join(" ")).fault(Fault::DripMs(100))]),
    );
    let server = Serve::start(&ws, &stub, &[], &[]);
    let base = format!("http://{}", server.addr);

    let curl = |args: &[&str]| {
        let mut cmd = std::process::Command::new("curl");
        cmd.env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .args([
                "--silent",
                "--show-error",
                "--noproxy",
                "*",
                "--max-time",
                "30",
            ])
            .args(args);
        output_within(&mut cmd, "spawn curl", Duration::from_secs(40))
    };

    let out = curl(&[
        &format!("{base}/runs"),
        "-H",
        "content-type: application/json",
        "-d",
        r#"{"prompt":"list the crates","interactive":false}"#,
    ]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let body: Value = serde_json::from_str(&out.stdout).expect("curl POST /runs body");
    assert_eq!(body, json!({"run_id": "run-1"}));

    let out = curl(&["-N", &format!("{base}/runs/run-1/events?follow=1")]);
    assert_eq!(
        out.code,
        Some(0),
        "curl must see a cleanly ended stream: {out:?}"
    );
    let lines = out.frames();
    let events = check_stream(&lines, 0, true);
    assert_eq!(
        lines.last().expect("lines")["status"],
        json!({"state": "done"})
    );
    run_end(&events);
    assert_eq!(events, all_events(server.addr, "run-1"));
}

// ---- hardening: what a browser, a greedy client or a second server can do ---------------

#[test]
fn browser_requests_to_loopback_are_refused() {
    let ws = Workspace::new("hs-browser");
    let stub = Stub::start(&ws, &script([Turn::text("x")]));
    let server = Serve::start(&ws, &stub, &[], &[]);
    let addr = server.addr;
    // DNS rebinding: the page's own host name now resolves to 127.0.0.1.
    let mut conn = HttpConn::connect(addr);
    conn.send_raw(
        b"POST /runs HTTP/1.1\r\nhost: attacker.example:8730\r\ncontent-type: application/json\r\ncontent-length: 15\r\n\r\n{\"prompt\":\"hi\"}",
    );
    let rebound = conn.read_response();
    assert_eq!(rebound.status, 403, "{rebound:?}");
    // A cross-origin request from a page that targets 127.0.0.1 directly.
    let cross = request(
        addr,
        "POST",
        "/runs/run-1/cancel",
        &[("origin", "http://attacker.example")],
        b"",
    );
    assert_eq!(cross.status, 403, "{cross:?}");
    // The same request from a loopback origin (a local tool's page) is fine.
    let local = request(
        addr,
        "GET",
        "/runs",
        &[("origin", "http://localhost:3000")],
        b"",
    );
    assert_eq!(local.status, 200, "{local:?}");
    assert!(
        get(addr, "/runs").json()["runs"]
            .as_array()
            .unwrap()
            .is_empty()
    );
}

#[test]
fn a_trickled_request_head_is_cut_off_at_the_head_deadline() {
    use std::io::{ErrorKind, Read, Write};
    use std::net::TcpStream;
    // `HEAD_DEADLINE` in src/surface/front.rs: a head must be complete this long after its
    // first byte, however steadily the rest trickles in.
    const HEAD_DEADLINE: Duration = Duration::from_secs(20);
    let ws = Workspace::new("hs-slowloris");
    let stub = Stub::start(&ws, &script([Turn::text("x")]));
    let server = Serve::start(&ws, &stub, &[], &[]);
    let addr = server.addr;
    // A keep-alive client that has not started a request yet is not on that clock.
    let mut waiting = HttpConn::connect(addr);
    let mut slow = TcpStream::connect(addr).expect("connect");
    slow.set_read_timeout(Some(Duration::from_secs(1)))
        .expect("read timeout");
    let started = Instant::now();
    slow.write_all(b"GET /healthz HTTP/1.1\r\nhost: localhost\r\nx-slow: ")
        .expect("send the start of a head");
    // A byte a second keeps the idle timer (60 s) from ever firing.
    let closed_after = loop {
        let elapsed = started.elapsed();
        assert!(
            elapsed < HEAD_DEADLINE + Duration::from_secs(10),
            "a trickling head still holds its connection after {elapsed:?}"
        );
        let mut buf = [0u8; 256];
        match slow.read(&mut buf) {
            Ok(0) => break started.elapsed(),
            Ok(n) => panic!(
                "no response was due: {:?}",
                String::from_utf8_lossy(&buf[..n])
            ),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => break started.elapsed(),
        }
        if slow.write_all(b"a").is_err() {
            break started.elapsed();
        }
    };
    assert!(
        closed_after >= HEAD_DEADLINE - Duration::from_millis(500),
        "closed after only {closed_after:?}"
    );
    assert!(
        !waiting.closed_by_peer(Instant::now() + Duration::from_millis(200)),
        "an idle keep-alive connection was cut off by the head deadline"
    );
    let resp = waiting.request("GET", "/healthz", &[], b"");
    assert_eq!(resp.status, 200, "{resp:?}");
}

#[test]
fn a_capped_poll_never_reports_the_end_early() {
    let ws = Workspace::new("hs-capped");
    let words = "word ".repeat(6000);
    let stub = Stub::start(&ws, &script([Turn::text(&words)]));
    let server = Serve::start(&ws, &stub, &[], &[]);
    let addr = server.addr;
    let run = start_run(addr, json!({"prompt": "long"}));
    wait_terminal(addr, &run);
    let first = events_page(addr, &run, 0);
    assert_eq!(
        first["events"].as_array().unwrap().len(),
        1000,
        "one capped batch"
    );
    assert!(
        !is_terminal(&first["status"]),
        "a batch that leaves events behind reports a terminal status: {}",
        first["status"]
    );
    let all = all_events(addr, &run);
    assert!(all.len() > 1000);
    assert_eq!(run_end(&all)["type"], "RunEnd");
    let last = events_page(addr, &run, all.len() as u64);
    assert_eq!(last["status"]["state"], "done");
}

#[test]
fn queued_input_is_bounded_and_nothing_follows_end() {
    let ws = Workspace::new("hs-inputs");
    let stub = Stub::start(
        &ws,
        &Script::new([
            Turn::bare().say("slow").fault(Fault::DelayMs(1500)),
            Turn::text("b"),
        ])
        .repeat_last()
        .json(),
    );
    let server = Serve::start(&ws, &stub, &[], &[]);
    let addr = server.addr;
    let run = start_run(addr, json!({"prompt": "go", "interactive": true}));
    // While the first turn is still waiting on the model, input queues up to the cap.
    for i in 0..16 {
        let r = post_json(
            addr,
            &format!("/runs/{run}/input"),
            &json!({"text": format!("m{i}")}),
        );
        assert_json(&r, 200, json!({"ok": true}));
    }
    let over = post_json(
        addr,
        &format!("/runs/{run}/input"),
        &json!({"text": "one too many"}),
    );
    assert_eq!(over.status, 409, "{over:?}");
    // After end, nothing more is accepted.
    let run2 = start_run(addr, json!({"prompt": "again", "interactive": true}));
    wait_state(addr, &run2, "awaiting_input");
    let end = post_json(addr, &format!("/runs/{run2}/input"), &json!({"end": true}));
    assert_json(&end, 200, json!({"ok": true}));
    let after = post_json(
        addr,
        &format!("/runs/{run2}/input"),
        &json!({"text": "late"}),
    );
    assert_error(
        &after,
        409,
        "cannot send input: drive session has ended; it accepts no further input",
    );
}

#[test]
fn last_event_id_wins_over_the_urls_cursor() {
    let ws = Workspace::new("hs-lastid");
    let stub = Stub::start(&ws, &script([Turn::text("one two three four five six")]));
    let server = Serve::start(&ws, &stub, &[], &[]);
    let addr = server.addr;
    let run = start_run(addr, json!({"prompt": "x"}));
    wait_terminal(addr, &run);
    let total = all_events(addr, &run).len() as u64;
    // An EventSource reconnects to its original URL (cursor=0) with Last-Event-ID.
    let resumed = request(
        addr,
        "GET",
        &follow_path(&run, 0),
        &[
            ("accept", "text/event-stream"),
            ("last-event-id", &(total - 1).to_string()),
        ],
        b"",
    );
    assert_eq!(resumed.status, 200);
    let body = String::from_utf8_lossy(&resumed.body).into_owned();
    let events = body.matches("\"event\":").count();
    assert_eq!(events, 1, "only the one event after Last-Event-ID: {body}");
    // The header replaces a cursor, not the need for a well-formed one.
    let malformed = request(
        addr,
        "GET",
        &format!("/runs/{run}/events?cursor=-1&follow=1"),
        &[
            ("accept", "text/event-stream"),
            ("last-event-id", &(total - 1).to_string()),
        ],
        b"",
    );
    assert_eq!(malformed.status, 400, "{malformed:?}");
}

#[test]
fn deleted_run_ids_are_not_reused_after_a_restart() {
    let ws = Workspace::new("hs-reuse");
    let stub = Stub::start(&ws, &Script::new([Turn::text("a")]).repeat_last().json());
    let mut server = Serve::start(&ws, &stub, &[], &[]);
    let first = start_run(server.addr, json!({"prompt": "first"}));
    let second = start_run(server.addr, json!({"prompt": "second"}));
    wait_terminal(server.addr, &second);
    wait_terminal(server.addr, &first);
    let deleted = request(server.addr, "DELETE", &format!("/runs/{second}"), &[], b"");
    assert_json(&deleted, 200, json!({"ok": true}));
    server.restart(&ws, &stub);
    let third = start_run(server.addr, json!({"prompt": "third"}));
    assert_ne!(third, second, "a deleted run's id came back");
    assert_eq!(third, "run-3");
}

#[test]
fn a_prompt_left_pending_by_a_cancel_is_no_longer_waited_on() {
    let ws = Workspace::new("hs-abandoned");
    let stub = Stub::start(
        &ws,
        &script([Turn::bash("toolu_a", "echo hi"), Turn::text("x")]),
    );
    let server = Serve::start(&ws, &stub, &[], &[]);
    let addr = server.addr;
    let run = start_run(addr, json!({"prompt": "go"}));
    let prompt = wait_prompt(addr, &run);
    assert_eq!(prompt["tool_use_id"], "toolu_a");
    let r = request(addr, "POST", &format!("/runs/{run}/cancel"), &[], b"");
    assert_json(&r, 200, json!({"ok": true}));
    wait_terminal(addr, &run);
    let permit = |id: &str| {
        post_json(
            addr,
            &format!("/runs/{run}/permit"),
            &json!({"tool_use_id": id, "allow": true}),
        )
    };
    assert_error(
        &permit("toolu_a"),
        409,
        "run is no longer waiting on that prompt",
    );
    assert_error(
        &permit("toolu_other"),
        409,
        "no pending permission request for this run",
    );
}

// ---- hardening: followers that are quiet, slow or gone ------------------------------------

/// `HEARTBEAT_PERIOD` in src/surface/http_api.rs: a follow stream that carried nothing for
/// this long gets a heartbeat.
const FOLLOW_HEARTBEAT: Duration = Duration::from_secs(15);
/// `WRITE_STALL_DEADLINE` in src/surface/front.rs: a connection whose queued output the
/// peer has not taken a byte of for this long is closed.
const WRITE_STALL_DEADLINE: Duration = Duration::from_secs(30);
/// Room for a loaded machine on top of a documented period.
const SLACK: Duration = Duration::from_secs(10);

fn vm_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no VmRSS in /proc/{pid}/status"))
}

#[test]
fn a_quiet_follow_stream_gets_heartbeats() {
    let ws = Workspace::new("hs-heartbeat");
    let stub = Stub::start(&ws, &script([Turn::text("your turn")]));
    let server = Serve::start(&ws, &stub, &[], &[]);
    let addr = server.addr;
    // An interactive run waiting for input: nothing happens on it until we say so.
    let run = start_run(addr, json!({"prompt": "wait", "interactive": true}));
    wait_state(addr, &run, "awaiting_input");
    let cursor = events_page(addr, &run, u64::MAX)["next_cursor"]
        .as_u64()
        .expect("cursor");
    let mut ndjson = Follow::open(addr, &follow_path(&run, cursor), &[]);
    let mut sse = Follow::open(
        addr,
        &follow_path(&run, cursor),
        &[("accept", "text/event-stream")],
    );
    assert_eq!(
        ndjson.next_line(),
        Some(json!({"v": 1, "cursor": cursor, "status": {"state": "awaiting_input"}}))
    );
    let opening = sse
        .next_raw_within(b"\n\n", RECV_TIMEOUT)
        .expect("the SSE status event")
        .expect("an open SSE stream");
    // A status line is no place in the log: it carries no `id:` (only events do).
    assert!(opening.starts_with("data: "), "{opening:?}");

    // A line a client can skip, with the cursor to resume from; an SSE comment.
    let beat = ndjson
        .next_line_within(FOLLOW_HEARTBEAT + SLACK)
        .unwrap_or_else(|()| panic!("no heartbeat line within {FOLLOW_HEARTBEAT:?}"));
    assert_eq!(
        beat,
        Some(json!({"v": 1, "cursor": cursor, "heartbeat": true}))
    );
    let comment = sse
        .next_raw_within(b"\n\n", FOLLOW_HEARTBEAT + SLACK)
        .unwrap_or_else(|()| panic!("no SSE heartbeat within {FOLLOW_HEARTBEAT:?}"));
    assert_eq!(comment.as_deref(), Some(": heartbeat"));

    // The run goes on as before: both streams carry its end and end.
    assert_json(
        &post_json(addr, &format!("/runs/{run}/input"), &json!({"end": true})),
        200,
        json!({"ok": true}),
    );
    let rest = ndjson.rest();
    let mut lines = vec![json!({"v": 1, "cursor": cursor, "status": {"state": "awaiting_input"}})];
    lines.extend(rest);
    let events = check_stream(&lines, cursor, true);
    run_end(&events);
    let mut last = None;
    while let Some(event) = sse.next_sse() {
        last = Some(event);
    }
    assert_eq!(
        last.expect("SSE events").json()["status"],
        json!({"state": "done"})
    );
}

#[test]
fn followers_that_stop_reading_hold_a_small_window_and_are_reaped() {
    const FOLLOWERS: usize = 60;
    // Each follower costs the server its connection and a window of queued output
    // (`http::server::STREAM_WINDOW`, 64 KiB, plus one step of the log): under 10 MiB for
    // all of them, allocator slack included. They used to take ~45 MiB (up to ~768 KiB of
    // queued stream each).
    const MAX_GROWTH_KIB: u64 = 10 * 1024;
    let ws = Workspace::new("hs-stalled-followers");
    // ~8 MB of text in 1 KB words, ~2,700 deltas of 3 KB: each follower's stream is far
    // beyond what the socket buffers of a reader that never reads absorb, and it stalls
    // long before the turn's end (whose single event carries all of the text).
    let word = "x".repeat(1000);
    let text = vec![word.as_str(); 8000].join(" ");
    let stub = Stub::start(
        &ws,
        &script([
            Turn::text("warm"),
            Turn::bare().say(&text),
            Turn::bare().say(&text),
        ]),
    );
    let server = Serve::start(&ws, &stub, &[], &[]);
    let addr = server.addr;
    let warm = start_run(addr, json!({"prompt": "warm up"}));
    wait_terminal(addr, &warm);
    let before = vm_rss_kib(server.pid());
    // The same flood without followers: what one 8 MB event costs the server on its own
    // (the event, its session line, the log's tail, what the allocator keeps of them) is
    // not the followers' to pay, and it moves with the allocator and the build.
    let alone = start_run(addr, json!({"prompt": "flood, unfollowed"}));
    wait_terminal(addr, &alone);
    let flood_alone = vm_rss_kib(server.pid()).saturating_sub(before);

    let run = start_run(addr, json!({"prompt": "flood"}));
    let followers: Vec<Follow> = (0..FOLLOWERS)
        .map(|_| Follow::open(addr, &follow_path(&run, 0), &[]))
        .collect();
    wait_terminal(addr, &run);
    // Let every follower's stream go as far as it can.
    std::thread::sleep(Duration::from_secs(1));
    let after = vm_rss_kib(server.pid());
    assert!(
        after.saturating_sub(before) < flood_alone + MAX_GROWTH_KIB,
        "{FOLLOWERS} followers that never read took RSS from {before} KiB to {after} KiB \
         (the flood alone: +{flood_alone} KiB)"
    );
    assert_eq!(
        metric(addr, "caliban_http_connections"),
        Some(FOLLOWERS as f64 + 1.0)
    );

    // Nobody reads: each connection is closed once the peer took nothing for the stall
    // deadline, and its slot is free again. A follower's clock starts when its last byte
    // went out: fed in turn from the file (`PUMP_BUDGET` in src/surface/http_api.rs), the
    // 60 followers here take their ~4 MB each in well under a second in a release build,
    // but up to half a minute in a debug build on a busy machine. A bound, not a timing:
    // the test ends as soon as the slots are free.
    let deadline = Instant::now() + WRITE_STALL_DEADLINE + 6 * SLACK;
    loop {
        if metric(addr, "caliban_http_connections") == Some(1.0) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "stalled followers still hold {:?} connections well past {WRITE_STALL_DEADLINE:?}",
            metric(addr, "caliban_http_connections").map(|n| n - 1.0)
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    drop(followers);
    let resp = get(addr, "/healthz");
    assert_eq!(resp.status, 200, "{resp:?}");
}

// ---- hardening: peers without the token ------------------------------------------------------

/// Whether the server has closed `stream` (EOF or reset), reading at most `wait`.
fn closed_by_server(stream: &mut std::net::TcpStream, wait: Duration) -> bool {
    use std::io::{ErrorKind, Read};
    stream.set_read_timeout(Some(wait)).expect("read timeout");
    let mut buf = [0u8; 512];
    match stream.read(&mut buf) {
        Ok(0) => true,
        Ok(n) => panic!(
            "no response was due: {:?}",
            String::from_utf8_lossy(&buf[..n])
        ),
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => false,
        Err(_) => true,
    }
}

#[test]
fn unauthenticated_peers_cannot_hold_every_slot() {
    use std::io::Write;
    use std::net::Ipv4Addr;
    // `MAX_UNADMITTED_PER_PEER` in src/surface/front.rs.
    const PER_PEER: usize = 16;
    const SLOTS: usize = 24;
    let ws = Workspace::new("hs-slots");
    let stub = Stub::start(&ws, &script([Turn::text("served")]));
    let server = Serve::start(
        &ws,
        &stub,
        &["--max-connections", &SLOTS.to_string()],
        &[
            ("CALIBAN_TEST_LOOPBACK_IS_REMOTE", "1"),
            ("CALIBAN_DRIVE_TOKEN", "s3cret"),
        ],
    );
    let addr = server.addr;
    let auth = [("authorization", "Bearer s3cret")];

    // Without the token, a request is refused at its head: the 401 does not wait for the
    // body it announced (nor ask for it with 100 Continue), and the connection ends.
    for expect in [None, Some("100-continue")] {
        let mut conn = HttpConn::connect(addr);
        let mut head =
            "POST /runs HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n\
                        content-length: 100000\r\n"
                .to_owned();
        if let Some(expect) = expect {
            head.push_str(&format!("expect: {expect}\r\n"));
        }
        head.push_str("\r\n");
        conn.send_raw(head.as_bytes());
        assert_unauthorized(&conn.read_response());
        assert!(
            conn.closed_by_peer(Instant::now() + Duration::from_secs(10)),
            "an unauthenticated connection was kept open"
        );
    }

    // One peer trickles request heads on more connections than a peer may hold before
    // authenticating: the excess is refused at once.
    let trickle = |from: Ipv4Addr| {
        let mut stream = connect_from(from, addr);
        stream
            .write_all(b"GET /healthz HTTP/1.1\r\nhost: localhost\r\nx-slow: ")
            .expect("the start of a head");
        stream
    };
    let holding_since = Instant::now();
    let mut first: Vec<_> = (0..PER_PEER + 4)
        .map(|_| trickle(Ipv4Addr::new(127, 0, 0, 2)))
        .collect();
    let mut closed = vec![false; first.len()];
    let deadline = Instant::now() + Duration::from_secs(5);
    while closed.iter().filter(|c| **c).count() < 4 && Instant::now() < deadline {
        for (stream, closed) in first.iter_mut().zip(closed.iter_mut()) {
            *closed = *closed || closed_by_server(stream, Duration::from_millis(10));
        }
    }
    std::thread::sleep(Duration::from_millis(200));
    for (stream, closed) in first.iter_mut().zip(closed.iter_mut()) {
        *closed = *closed || closed_by_server(stream, Duration::from_millis(10));
    }
    let refused = closed.iter().filter(|c| **c).count();
    assert_eq!(
        refused,
        4,
        "{} connections of one peer were let in",
        PER_PEER + 4 - refused
    );

    // A second peer does the same: between them they would fill every slot.
    let second: Vec<_> = (0..PER_PEER)
        .map(|_| trickle(Ipv4Addr::new(127, 0, 0, 3)))
        .collect();

    // An authorised client is still served while they hold their slots: before the head
    // deadline (`HEAD_DEADLINE` in src/surface/front.rs) of any of them frees one.
    const HEAD_DEADLINE: Duration = Duration::from_secs(20);
    let resp = request(addr, "GET", "/healthz", &auth, b"");
    assert_eq!(resp.status, 200, "{resp:?}");
    assert!(
        holding_since.elapsed() < HEAD_DEADLINE,
        "the authorised client was only served once a head deadline freed a slot"
    );
    let resp = request(addr, "GET", "/metrics", &auth, b"");
    assert_eq!(resp.status, 200, "{resp:?}");
    let open = resp
        .text()
        .lines()
        .find_map(|l| l.strip_prefix("caliban_http_connections "))
        .and_then(|v| v.parse::<f64>().ok())
        .expect("caliban_http_connections");
    assert!(
        open <= SLOTS as f64,
        "{open} connections open with a cap of {SLOTS}"
    );
    drop((first, second));
}

/// `GET /runs` pages through every run on disk, not only the newest 1,000 the server holds:
/// the newest page first (oldest first within it), `next_cursor` to the page before, pages
/// that neither overlap nor skip, bounded `limit`s, and a table that does not grow for it.
#[test]
fn every_run_on_disk_is_listed_page_by_page() {
    const RUNS: u64 = 1205;
    let ws = Workspace::new("hs-runs-pages");
    let dir = ws.path("home/.state/caliban/sessions");
    std::fs::create_dir_all(&dir).expect("sessions dir");
    for n in 1..=RUNS {
        let header = json!({"kind": "header", "v": 1, "run_id": format!("run-{n}"),
                            "created_ms": 1_767_225_600_000u64 + n, "interactive": false,
                            "prompt": format!("prompt {n}")});
        // run-5 was still running when its server died.
        let state = if n == 5 { "running" } else { "done" };
        let status = json!({"kind": "status", "cursor": 0, "status": {"state": state}});
        std::fs::write(
            dir.join(format!("run-{n}.jsonl")),
            format!("{header}\n{status}\n"),
        )
        .expect("write session");
    }
    let stub = Stub::start(&ws, &script([Turn::text("unused")]));
    let server = Serve::start(&ws, &stub, &[], &[]);
    let addr = server.addr;
    let numbers = |page: &Value| -> Vec<u64> {
        page["runs"]
            .as_array()
            .expect("runs")
            .iter()
            .map(|r| {
                let id = r["run_id"].as_str().expect("run_id");
                id.trim_start_matches("run-").parse().expect("number")
            })
            .collect()
    };

    // Without parameters: the newest 1,000, oldest first, and where to go on.
    let first = get(addr, "/runs");
    assert_eq!(first.status, 200, "{first:?}");
    let first = first.json();
    assert_eq!(numbers(&first), (RUNS - 999..=RUNS).collect::<Vec<_>>());
    assert_eq!(first["runs"][0]["prompt"], format!("prompt {}", RUNS - 999));
    assert_eq!(first["next_cursor"], RUNS - 999);
    let rest = get(addr, &format!("/runs?cursor={}", RUNS - 999)).json();
    assert_eq!(numbers(&rest), (1..=RUNS - 1000).collect::<Vec<_>>());
    assert_eq!(rest["runs"][0]["status"], json!({"state": "done"}));
    let interrupted = &rest["runs"][4]["status"];
    assert_eq!(interrupted["state"], "failed", "{interrupted}");
    assert!(
        interrupted["error"]
            .as_str()
            .is_some_and(|e| e.contains("interrupted"))
    );
    assert!(rest.get("next_cursor").is_none(), "{}", rest["next_cursor"]);

    // Small pages walk back through everything exactly once.
    let mut seen = Vec::new();
    let mut path = "/runs?limit=300".to_owned();
    for _ in 0..10 {
        let page = get(addr, &path).json();
        let mut got = numbers(&page);
        assert!(got.len() <= 300, "{}", got.len());
        got.append(&mut seen);
        seen = got;
        match page.get("next_cursor").and_then(Value::as_u64) {
            Some(next) => path = format!("/runs?limit=300&cursor={next}"),
            None => break,
        }
    }
    assert_eq!(seen, (1..=RUNS).collect::<Vec<_>>());

    // A run started now is on the first page; bad parameters are refused.
    let run = start_run(addr, json!({"prompt": "newest"}));
    wait_terminal(addr, &run);
    let newest = get(addr, "/runs?limit=1").json();
    assert_eq!(run, format!("run-{}", RUNS + 1));
    assert_eq!(newest["runs"][0]["run_id"], run);
    assert_eq!(newest["next_cursor"], RUNS + 1);
    for bad in [
        "limit=0",
        "limit=1001",
        "limit=x",
        "cursor=-1",
        "cursor=18446744073709551616",
    ] {
        let resp = get(addr, &format!("/runs?{bad}"));
        assert_eq!(resp.status, 400, "{bad}: {resp:?}");
    }
    // Listing read the older runs without keeping them: the table holds at most 1,000
    // finished runs (and the live ones).
    let held: f64 = ["starting", "running", "awaiting_input", "done", "failed"]
        .iter()
        .filter_map(|state| metric(addr, &format!("caliban_runs{{state=\"{state}\"}}")))
        .sum();
    assert!(held <= 1001.0, "{held} runs in memory");
}

// ---- context compaction (issue 14) ----------------------------------------------------------

/// An interactive run that outgrows a 10,000-token window compacts on its own; an input
/// `{"compact": true}` compacts it again; both `Compaction` events are in the log, the run
/// ends with the compacted conversation, and a restarted server replays the same events.
#[test]
fn compaction_auto_and_by_input_then_replayed_after_a_restart() {
    let ws = Workspace::new("http-compact");
    ws.write(".caliban/settings.json", r#"{"context_window": 10000}"#);
    crate::util::big_file(&ws, "a.txt", "AAA");
    crate::util::big_file(&ws, "b.txt", "BBB");
    let read = |id: &str, path: &str| Turn::bare().calling([Call::read(id, path)]);
    let stub = Stub::start(
        &ws,
        &script([
            read("ta", "a.txt"),
            read("tb", "b.txt"),
            Turn::bare().say("SUMMARY-ONE"),
            Turn::bare().say("ok"),
            Turn::bare().say("SUMMARY-TWO"),
        ]),
    );
    let mut server = Serve::start(&ws, &stub, &[], &[]);
    let addr = server.addr;
    let run = start_run(addr, json!({"prompt": "read both", "interactive": true}));
    wait_state(addr, &run, "awaiting_input");
    let resp = post_json(
        addr,
        &format!("/runs/{run}/input"),
        &json!({"compact": true}),
    );
    assert_eq!(resp.status, 200, "{resp:?}");
    wait_for("the manual compaction", || {
        let events = all_events(addr, &run);
        (of_type(&events, "Compaction").len() == 2).then_some(())
    });
    wait_state(addr, &run, "awaiting_input");
    let resp = post_json(addr, &format!("/runs/{run}/input"), &json!({"end": true}));
    assert_eq!(resp.status, 200, "{resp:?}");
    wait_terminal(addr, &run);
    let events = all_events(addr, &run);
    let compactions = of_type(&events, "Compaction");
    assert_eq!(compactions[0]["trigger"], "auto");
    assert_eq!(compactions[0]["summary"], "SUMMARY-ONE");
    assert_eq!(compactions[1]["trigger"], "manual");
    assert_eq!(compactions[1]["summary"], "SUMMARY-TWO");
    let end = run_end(&events);
    assert_eq!(end["stopped_for"], "EndOfTurn");
    let final_messages = end["final_messages"].to_string();
    assert!(final_messages.contains("SUMMARY-TWO"), "{final_messages}");
    assert!(!final_messages.contains("AAA") && !final_messages.contains("SUMMARY-ONE"));

    server.restart(&ws, &stub);
    assert_eq!(all_events(server.addr, &run), events);
}

// ---- images in prompts (issue 14) -----------------------------------------------------------

/// `images` on `POST /runs` and on input reach the model; one it could not take is a 400
/// that says why.
#[test]
fn images_on_runs_and_input() {
    use crate::util::{PNG, image_block};
    let ws = Workspace::new("http-images");
    let stub = Stub::start(
        &ws,
        &script([Turn::text("a red dot"), Turn::text("another")]),
    );
    let server = Serve::start(&ws, &stub, &[], &[]);
    let addr = server.addr;
    let bad = post_json(
        addr,
        "/runs",
        &json!({"prompt": "x", "images": [image_block("image/bmp", "AAAA")]}),
    );
    assert_error(
        &bad,
        400,
        "`images`: unsupported image type `image/bmp`: expected one of image/png, image/jpeg, image/gif, image/webp",
    );
    let run = start_run(
        addr,
        json!({"prompt": "what is this?", "interactive": true,
               "images": [image_block("image/png", PNG)]}),
    );
    wait_state(addr, &run, "awaiting_input");
    let bad = post_json(
        addr,
        &format!("/runs/{run}/input"),
        &json!({"images": [{"type": "text", "text": "not an image"}]}),
    );
    assert_error(&bad, 400, "`images`: expected an image block");
    let resp = post_json(
        addr,
        &format!("/runs/{run}/input"),
        &json!({"images": [image_block("image/gif", "R0lGODlhAQABAAAAACw=")]}),
    );
    assert_eq!(resp.status, 200, "{resp:?}");
    wait_for("the second turn", || {
        (stub.requests().len() == 2).then_some(())
    });
    let reqs = stub.requests();
    let first = reqs[0]["body"]["messages"][0]["content"].clone();
    assert_eq!(first[0]["text"], "what is this?");
    assert_eq!(first[1]["source"]["data"], PNG);
    let last = reqs[1]["body"]["messages"]
        .as_array()
        .unwrap()
        .last()
        .cloned()
        .unwrap();
    assert_eq!(
        last["content"][0]["source"]["media_type"], "image/gif",
        "{last}"
    );
}
