//! `/openapi.json` checked by real tools: the document by `openapi-spec-validator`, and every
//! example plus real responses captured from a running server by `jsonschema`, through
//! `tests/openapi_check.py`. The validators are installed from PyPI into a venv under the
//! target directory on first use (`tests/requirements-openapi.txt` pins them).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::util::http::{Follow, Serve, get, post_json, request};
use crate::util::*;

/// The venv's python with the validators (`tests/requirements-openapi.txt`).
fn python() -> &'static Path {
    static PYTHON: OnceLock<PathBuf> = OnceLock::new();
    PYTHON.get_or_init(|| venv_python("openapi-venv", "requirements-openapi.txt"))
}

/// Runs the checker; panics with its output unless it says `ok:`.
fn check(args: &[&str]) -> String {
    let out = Command::new(python())
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/openapi_check.py"
        ))
        .args(args)
        .output()
        .expect("run openapi_check.py");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success() && stdout.starts_with("ok:"),
        "openapi_check.py {args:?} failed:\n{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[test]
fn the_document_is_valid_openapi_and_every_example_validates() {
    check(&[]);
    check(&["--examples"]);
}

struct Captured {
    dir: PathBuf,
    n: usize,
    checked: Vec<String>,
}

impl Captured {
    /// Validates one real response body against the document's schema for `route`/`status`.
    fn validate(&mut self, route: &str, status: u16, body: &[u8], extra: &[&str]) {
        self.n += 1;
        let file = self.dir.join(format!("response-{}.txt", self.n));
        std::fs::write(&file, body).expect("write captured body");
        let status_text = status.to_string();
        let mut args = vec![
            "--response",
            route,
            status_text.as_str(),
            file.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        check(&args);
        self.checked.push(format!("{route} {status}"));
    }
}

fn wait_for_prompt(addr: std::net::SocketAddr, run: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let resp = request(
            addr,
            "GET",
            &format!("/runs/{run}/events?cursor=0"),
            &[],
            b"",
        );
        let body: Value = serde_json::from_slice(&resp.body).expect("poll json");
        if !body["permission_request"].is_null() {
            return body;
        }
        assert!(Instant::now() < deadline, "no permission prompt: {body}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn real_responses_validate_against_the_served_document() {
    let ws = Workspace::new("openapi-live");
    let stub = Stub::start(
        &ws,
        &script([
            Turn::bare()
                .say("Checking.")
                .calling([Call::bash("toolu_1", "echo ok")]),
            Turn::bare().say("All good."),
            Turn::bare().say("Second run.").fault(Fault::DripMs(50)),
            Turn::bare().say("Third run."),
        ]),
    );
    let server = Serve::start(&ws, &stub, &[], &[]);
    let addr = server.addr;
    let mut cap = Captured {
        dir: ws.path("captured"),
        n: 0,
        checked: Vec::new(),
    };
    std::fs::create_dir_all(&cap.dir).expect("capture dir");

    let served = get(addr, "/openapi.json");
    assert_eq!(served.status, 200);
    let on_disk = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/src/surface/openapi.json"
    ))
    .expect("openapi.json");
    assert_eq!(
        served.body, on_disk,
        "GET /openapi.json serves the checked-in document"
    );
    cap.validate("GET /openapi.json", 200, &served.body, &[]);
    let health = get(addr, "/healthz");
    cap.validate("GET /healthz", 200, &health.body, &[]);

    // Errors of POST /runs.
    let r = request(addr, "POST", "/runs", &[], b"{}");
    cap.validate("POST /runs", r.status, &r.body, &[]);
    let r = request(
        addr,
        "POST",
        "/runs",
        &[("content-type", "application/json")],
        b"{nope",
    );
    cap.validate("POST /runs", r.status, &r.body, &[]);
    let r = post_json(addr, "/runs", &json!({"interactive": true}));
    cap.validate("POST /runs", r.status, &r.body, &[]);

    // A run that stops on a permission prompt: poll, permit errors, then allow.
    let started = post_json(addr, "/runs", &json!({"prompt": "check"}));
    cap.validate("POST /runs", started.status, &started.body, &[]);
    let run: Value = serde_json::from_slice(&started.body).expect("run json");
    let run = run["run_id"].as_str().expect("run_id").to_owned();
    let mut follow = Follow::open(addr, &format!("/runs/{run}/events?cursor=0&follow=1"), &[]);
    let polled = wait_for_prompt(addr, &run);
    cap.validate(
        "GET /runs/{id}/events",
        200,
        polled.to_string().as_bytes(),
        &[],
    );
    let r = request(
        addr,
        "GET",
        &format!("/runs/{run}/events?cursor=x"),
        &[],
        b"",
    );
    cap.validate("GET /runs/{id}/events", r.status, &r.body, &[]);
    let r = get(addr, "/runs/run-999/events");
    cap.validate("GET /runs/{id}/events", r.status, &r.body, &[]);
    let r = get(addr, &format!("/runs/{run}/status"));
    cap.validate("GET /runs/{id}/status", r.status, &r.body, &[]);
    let r = get(addr, "/runs/run-999/status");
    cap.validate("GET /runs/{id}/status", r.status, &r.body, &[]);
    let r = post_json(
        addr,
        &format!("/runs/{run}/input"),
        &json!({"text": "more"}),
    );
    cap.validate("POST /runs/{id}/input", r.status, &r.body, &[]);
    let r = post_json(addr, &format!("/runs/{run}/input"), &json!({}));
    cap.validate("POST /runs/{id}/input", r.status, &r.body, &[]);
    let r = post_json(
        addr,
        &format!("/runs/{run}/permit"),
        &json!({"tool_use_id": "toolu_other", "allow": true}),
    );
    cap.validate("POST /runs/{id}/permit", r.status, &r.body, &[]);
    let r = post_json(
        addr,
        &format!("/runs/{run}/permit"),
        &json!({"tool_use_id": "toolu_1", "allow": true}),
    );
    cap.validate("POST /runs/{id}/permit", r.status, &r.body, &[]);
    // The lines as received, re-serialised one per line (NDJSON).
    let stream: String = follow.rest().iter().map(|v| format!("{v}\n")).collect();
    cap.validate(
        "GET /runs/{id}/events",
        200,
        stream.as_bytes(),
        &["--media-type", "application/x-ndjson", "--stream-complete"],
    );

    // A replay of the finished run as SSE, byte for byte (the stream ends by itself).
    let replay = request(
        addr,
        "GET",
        &format!("/runs/{run}/events?cursor=0&follow=1"),
        &[("accept", "text/event-stream")],
        b"",
    );
    assert_eq!(replay.status, 200);
    cap.validate(
        "GET /runs/{id}/events",
        200,
        &replay.body,
        &["--media-type", "text/event-stream", "--stream-complete"],
    );

    // Interactive run: input accepted, then cancel and delete; a non-interactive run's input.
    let second = post_json(
        addr,
        "/runs",
        &json!({"prompt": "again", "interactive": true}),
    );
    let second: Value = serde_json::from_slice(&second.body).expect("json");
    let second = second["run_id"].as_str().expect("run_id").to_owned();
    let r = request(addr, "POST", &format!("/runs/{second}/cancel"), &[], b"");
    cap.validate("POST /runs/{id}/cancel", r.status, &r.body, &[]);
    let r = request(addr, "POST", "/runs/run-999/cancel", &[], b"");
    cap.validate("POST /runs/{id}/cancel", r.status, &r.body, &[]);
    let r = post_json(addr, &format!("/runs/{run}/input"), &json!({"end": true}));
    cap.validate("POST /runs/{id}/input", r.status, &r.body, &[]);
    let runs = get(addr, "/runs");
    cap.validate("GET /runs", runs.status, &runs.body, &[]);
    let r = request(addr, "DELETE", &format!("/runs/{second}"), &[], b"");
    cap.validate("DELETE /runs/{id}", r.status, &r.body, &[]);
    let r = request(addr, "DELETE", &format!("/runs/{second}"), &[], b"");
    cap.validate("DELETE /runs/{id}", r.status, &r.body, &[]);
    let metrics = get(addr, "/metrics");
    cap.validate("GET /metrics", metrics.status, &metrics.body, &[]);

    // 401 from a remote peer (the test seam classifies loopback as remote).
    let guarded = Serve::start(
        &ws,
        &stub,
        &[],
        &[
            ("CALIBAN_TEST_LOOPBACK_IS_REMOTE", "1"),
            ("CALIBAN_DRIVE_TOKEN", "tok"),
        ],
    );
    let r = request(guarded.addr, "GET", "/runs", &[], b"");
    assert_eq!(r.status, 401);
    cap.validate("GET /runs", 401, &r.body, &["--media-type", "text/plain"]);

    assert!(cap.checked.len() >= 25, "checked {:?}", cap.checked);
}

/// The document and the server agree on what they accept: `tests/openapi_props.py`
/// generates requests from the served `/openapi.json` (ones its schemas allow and ones they
/// refuse, with a fixed seed and a bounded count), sends them to this server on loopback, and
/// fails on any answer the document does not describe: an undocumented status or body, an
/// allowed request refused as malformed, or a refused one accepted.
#[test]
fn generated_requests_agree_with_the_document() {
    let ws = Workspace::new("openapi-props");
    let stub = Stub::start(
        &ws,
        &Script::new([Turn::bare().say("Done.")])
            .repeat_last()
            .json(),
    );
    // The MCP server the document's `mcp_servers` example names (a command that exits at
    // once: the runs that select it are reported a dead server and go on).
    ws.write(
        "mcp.json",
        &json!({"mcpServers": {"docs": {"command": "true"}}}).to_string(),
    );
    let cfg = path_str(&ws.path("mcp.json"));
    let server = Serve::start(&ws, &stub, &["--mcp-config", &cfg], &[]);
    let addr = server.addr;
    // A finished, non-interactive run for the `{id}` routes.
    let started = post_json(addr, "/runs", &json!({"prompt": "the run the routes name"}));
    assert_eq!(started.status, 200, "{started:?}");
    let run: Value = serde_json::from_slice(&started.body).expect("run json");
    let run = run["run_id"].as_str().expect("run_id").to_owned();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let status = get(addr, &format!("/runs/{run}/status"));
        let body: Value = serde_json::from_slice(&status.body).expect("status json");
        if body["status"]["state"] == "done" {
            break;
        }
        assert!(Instant::now() < deadline, "the run did not finish: {body}");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut cmd = Command::new(python());
    cmd.arg(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/openapi_props.py"
    ))
    .args(["--base", &format!("http://{addr}"), "--run", &run])
    .args(["--seed", "20261201", "--cases", "20"]);
    let out = output_within(&mut cmd, "run openapi_props.py", Duration::from_secs(120));
    assert!(
        out.code == Some(0) && out.stdout.starts_with("ok:"),
        "the document and the server disagree:\n{}{}",
        out.stdout,
        out.stderr
    );
}

/// Beyond 64 runs at work, `POST /runs` answers 503, which the document lists.
#[test]
fn a_busy_server_answers_a_documented_503() {
    let ws = Workspace::new("openapi-busy");
    // Every model request waits long before its first byte: each run stays at work.
    let late = Turn::bare().say("late").fault(Fault::DelayMs(60000));
    let stub = Stub::start(&ws, &script(vec![late; 70]));
    let server = Serve::start(&ws, &stub, &[], &[]);
    let addr = server.addr;
    for n in 0..64 {
        let r = post_json(addr, "/runs", &json!({"prompt": format!("busy {n}")}));
        assert_eq!(r.status, 200, "run {n}: {r:?}");
    }
    let r = post_json(addr, "/runs", &json!({"prompt": "one too many"}));
    assert_eq!(r.status, 503, "{r:?}");
    let file = ws.path("busy.json");
    std::fs::write(&file, &r.body).expect("write body");
    check(&["--response", "POST /runs", "503", file.to_str().unwrap()]);
}
