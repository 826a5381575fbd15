//! caliban as an MCP client, end to end: the real binary, `caliban stub-model` asking for
//! `mcp__<server>__<tool>` calls, and real MCP servers written with the official SDKs:
//!
//! - `tests/mcp_client/server.py`, on the Python SDK (`mcp` 2.x `MCPServer`, which 1.x
//!   called FastMCP), over stdio, Streamable HTTP and the legacy HTTP+SSE transport;
//! - `@modelcontextprotocol/server-everything`, the reference server, over stdio.
//!
//! The Python SDK is installed from PyPI into a venv under the target directory on first
//! use (pinned by `tests/requirements-mcp-client.txt`); server-everything comes with the
//! Node kit `tests/mcp.rs` installs from `tests/mcp/package-lock.json`.
//!
//! No assertion is timed: a call that must time out is given a one-second limit and the
//! test checks what the model was told, and whatever happens in a server is observed
//! through files it leaves (`MARK_DIR`), waited for with a deadline.

use std::net::SocketAddr;

use serde_json::{Value, json};

use crate::util::http::{Serve, fixture, request};
use crate::util::mcp::*;
use crate::util::*;

// ---- helpers ------------------------------------------------------------------------------

/// Writes an MCP config file (`{"mcpServers": …}`) in the workspace; returns its path.
fn config(ws: &Workspace, name: &str, servers: Value) -> String {
    ws.write(name, &json!({ "mcpServers": servers }).to_string());
    path_str(&ws.path(name))
}

/// An MCP config file naming one Streamable HTTP server; returns its path.
fn http_config(ws: &Workspace, name: &str, url: &str) -> String {
    config(
        ws,
        "mcp.json",
        json!({ name: {"type": "http", "url": url} }),
    )
}

/// Every tool result the model was sent, by tool use id: (is_error, text).
fn results(stub: &Stub) -> Vec<(String, bool, String)> {
    let mut out = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for req in stub.requests() {
        for message in req["body"]["messages"].as_array().into_iter().flatten() {
            for block in message["content"].as_array().into_iter().flatten() {
                if block["type"] != "tool_result" {
                    continue;
                }
                let id = block["tool_use_id"].as_str().unwrap_or_default().to_owned();
                if !seen.insert(id.clone()) {
                    continue;
                }
                out.push((
                    id,
                    block["is_error"] == json!(true),
                    texts(&block["content"]),
                ));
            }
        }
    }
    out
}

fn result<'a>(all: &'a [(String, bool, String)], id: &str) -> &'a (String, bool, String) {
    all.iter()
        .find(|r| r.0 == id)
        .unwrap_or_else(|| panic!("no result for {id} in {all:?}"))
}

/// The names of the MCP tools offered in request `n`.
fn offered(stub: &Stub, n: usize) -> Vec<String> {
    stub.requests()[n]["body"]["tools"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| t["name"].as_str())
        .filter(|n| n.starts_with("mcp__"))
        .map(str::to_owned)
        .collect()
}

fn print_mode(ws: &Workspace, stub: &Stub, args: &[&str]) -> Output {
    let mut cmd = caliban(ws);
    anthropic(&mut cmd, stub);
    cmd.arg("-p").args(args).arg("use the tools");
    run(cmd, "")
}

// ---- transports, from print mode ------------------------------------------------------------

#[test]
fn mcp_client_stdio_round_trip_with_images_and_resources() {
    let ws = Workspace::new("mcpc-stdio");
    let stub = Stub::start(
        &ws,
        &script([
            Turn::calls([
                Call::new("t1", "mcp__py__echo", json!({"text": "hi"})),
                Call::new("t2", "mcp__py__picture", json!({})),
            ]),
            Turn::text("done"),
        ]),
    );
    let cfg = config(&ws, "mcp.json", json!({"py": stdio_server(&ws.root)}));
    let out = print_mode(&ws, &stub, &["--mcp-config", &cfg, "--allow", "mcp__py__*"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let tools = offered(&stub, 0);
    for name in ["mcp__py__echo", "mcp__py__slow", "mcp__py__picture"] {
        assert!(tools.iter().any(|t| t == name), "{tools:?}");
    }
    let all = results(&stub);
    assert_eq!(result(&all, "t1").2, "echo: hi");
    let picture = &result(&all, "t2").2;
    // The image itself reaches the model (tests/tool_results.rs checks the wire shapes).
    assert!(
        stub.requests()
            .last()
            .unwrap()
            .to_string()
            .contains("iVBORw0KGgo=")
    );
    assert!(
        picture.contains("[resource file:///notes.txt]\nresource body"),
        "{picture}"
    );
}

#[test]
fn mcp_client_streamable_http_resumes_streams_follows_progress_and_list_changed() {
    let ws = Workspace::new("mcpc-http");
    let server = PyHttp::start("http", &ws.root);
    let stub = Stub::start(
        &ws,
        &script([
            Turn::calls([
                Call::new("t1", "mcp__web__echo", json!({"text": "over http"})),
                Call::new("t2", "mcp__web__hop", json!({})),
                Call::new("t3", "mcp__web__ticking", json!({"seconds": 2.0})),
            ]),
            Turn::call("t4", "mcp__web__grow", json!({})),
            Turn::call("t5", "mcp__web__late", json!({})),
            Turn::text("done"),
        ]),
    );
    let cfg = config(
        &ws,
        "mcp.json",
        json!({"web": {"type": "http", "url": server.url,
                       "headers": {"X-Test": "${CALIBAN_TEST_HEADER}"}}}),
    );
    let out = print_mode(
        &ws,
        &stub,
        &[
            "--mcp-config",
            &cfg,
            "--allow",
            "mcp__web__*",
            "--mcp-timeout",
            "1",
        ],
    );
    assert_eq!(out.code, Some(0), "{out:?}");
    let all = results(&stub);
    assert_eq!(result(&all, "t1").2, "echo: over http");
    assert_eq!(result(&all, "t2").2, "hopped");
    assert_eq!(
        result(&all, "t3").2,
        "ticked 10 times",
        "progress resets the timeout"
    );
    assert_eq!(result(&all, "t4").2, "grown");
    // The list changed mid-run: the next request offered the new tool, and it ran.
    assert!(!offered(&stub, 0).iter().any(|t| t == "mcp__web__late"));
    assert!(offered(&stub, 2).iter().any(|t| t == "mcp__web__late"));
    assert_eq!(result(&all, "t5").2, "late tool ran");
    assert!(
        out.stderr.contains("CALIBAN_TEST_HEADER not set"),
        "{out:?}"
    );
    // Exiting, caliban ended its session.
    server.assert_session_deleted(&ws.root);
}

#[test]
fn mcp_client_standalone_stream_is_heard_and_resumed_with_last_event_id() {
    let ws = Workspace::new("mcpc-standalone");
    let server = PyHttp::start("http", &ws.root);
    let stub = Stub::start(
        &ws,
        &script([
            // Says the list changed on the GET stream (twice, the stream broken between),
            // and answers only once caliban listed again after each.
            Turn::call("t1", "mcp__web__announce", json!({})),
            Turn::calls([
                Call::new("t2", "mcp__web__early", json!({})),
                Call::new("t3", "mcp__web__later", json!({})),
            ]),
            Turn::text("done"),
        ]),
    );
    let cfg = http_config(&ws, "web", &server.url);
    let out = print_mode(
        &ws,
        &stub,
        &["--mcp-config", &cfg, "--allow", "mcp__web__*"],
    );
    assert_eq!(out.code, Some(0), "{out:?}");
    let all = results(&stub);
    assert_eq!(result(&all, "t1").2, "announced");
    let tools = offered(&stub, 1);
    for name in ["mcp__web__early", "mcp__web__later"] {
        assert!(tools.iter().any(|t| t == name), "{tools:?}");
    }
    assert_eq!(result(&all, "t2").2, "early ran");
    assert_eq!(result(&all, "t3").2, "later ran");
    // The second notification came on the standalone stream caliban resumed from the
    // first one's event id.
    let resumed = std::fs::read_to_string(ws.path("standalone-resumed"))
        .expect("the standalone stream was resumed with Last-Event-ID");
    assert!(!resumed.is_empty());
}

#[test]
fn mcp_client_streamable_http_over_tls_with_a_private_ca_and_through_a_proxy() {
    let ws = Workspace::new("mcpc-tls");
    let server = PyHttp::start("https", &ws.root);
    assert!(
        server.url.starts_with("https://localhost:"),
        "{}",
        server.url
    );
    let stub = Stub::start(
        &ws,
        &script([
            Turn::call("t1", "mcp__tls__echo", json!({"text": "over tls"})),
            Turn::text("done"),
        ]),
    );
    let cfg = http_config(&ws, "tls", &server.url);
    let mut cmd = caliban(&ws);
    anthropic(&mut cmd, &stub);
    cmd.env("SSL_CERT_FILE", fixture("ca.pem")).args([
        "-p",
        "--mcp-config",
        &cfg,
        "--allow",
        "mcp__tls__*",
        "echo",
    ]);
    let out = run(cmd, "");
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(result(&results(&stub), "t1").2, "echo: over tls");
    server.assert_session_deleted(&ws.root);
    // Through an HTTPS_PROXY: every exchange is tunnelled with CONNECT.
    std::fs::remove_file(ws.path("session-deleted")).expect("remove the mark");
    let proxy = crate::util::tls::connect_proxy(crate::util::tls::ProxyMode::Tunnel);
    let stub = Stub::start(
        &ws,
        &script([
            Turn::call("t2", "mcp__tls__echo", json!({"text": "via proxy"})),
            Turn::text("done"),
        ]),
    );
    let mut cmd = caliban(&ws);
    anthropic(&mut cmd, &stub);
    cmd.env("SSL_CERT_FILE", fixture("ca.pem"))
        .env("HTTPS_PROXY", format!("http://127.0.0.1:{}", proxy.port()))
        .args(["-p", "--mcp-config", &cfg, "--allow", "mcp__tls__*", "echo"]);
    let out = run(cmd, "");
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(result(&results(&stub), "t2").2, "echo: via proxy");
    server.assert_session_deleted(&ws.root);
    let seen = proxy.seen();
    let port = server
        .url
        .split(':')
        .nth(2)
        .and_then(|p| p.split('/').next());
    let connect = format!("CONNECT localhost:{} HTTP/1.1", port.unwrap_or_default());
    assert!(
        seen.len() >= 3 && seen.iter().all(|s| *s == connect),
        "{seen:?}"
    );
    // Without the private CA the server is not trusted: reported, its tools not offered.
    let stub = Stub::start(&ws, &script([Turn::text("done")]));
    let mut cmd = caliban(&ws);
    anthropic(&mut cmd, &stub);
    cmd.env("SSL_CERT_FILE", fixture("other-ca.pem"))
        .args(["-p", "--mcp-config", &cfg, "echo"]);
    let out = run(cmd, "");
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(offered(&stub, 0).is_empty(), "{:?}", offered(&stub, 0));
    assert!(out.stderr.contains("MCP server `tls` ("), "{out:?}");
}

/// A server that answers every POST with a single JSON body instead of an event stream
/// (`json_response` in the Python SDK) works the same.
#[test]
fn mcp_client_streamable_http_json_replies_round_trip() {
    let ws = Workspace::new("mcpc-http-json");
    let server = PyHttp::start("http-json", &ws.root);
    let stub = Stub::start(
        &ws,
        &script([
            Turn::calls([
                Call::new("t1", "mcp__web__echo", json!({"text": "as json"})),
                Call::new("t2", "mcp__web__slow", json!({"seconds": 0})),
            ]),
            Turn::text("done"),
        ]),
    );
    let cfg = http_config(&ws, "web", &server.url);
    let out = print_mode(
        &ws,
        &stub,
        &["--mcp-config", &cfg, "--allow", "mcp__web__*"],
    );
    assert_eq!(out.code, Some(0), "{out:?}");
    let all = results(&stub);
    assert_eq!(result(&all, "t1").2, "echo: as json");
    assert_eq!(result(&all, "t2").2, "slept");
    server.assert_session_deleted(&ws.root);
}

#[test]
fn mcp_client_legacy_http_sse_round_trip() {
    let ws = Workspace::new("mcpc-sse");
    let server = PyHttp::start("sse", &ws.root);
    let stub = Stub::start(
        &ws,
        &script([
            Turn::call("t1", "mcp__old__echo", json!({"text": "legacy"})),
            Turn::text("done"),
        ]),
    );
    let cfg = config(
        &ws,
        "mcp.json",
        json!({"old": {"type": "sse", "url": server.url}}),
    );
    let out = print_mode(
        &ws,
        &stub,
        &["--mcp-config", &cfg, "--allow", "mcp__old__echo"],
    );
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(result(&results(&stub), "t1").2, "echo: legacy");
}

#[test]
fn mcp_client_server_everything_over_stdio() {
    let kit = crate::util::mcp::kit();
    let ws = Workspace::new("mcpc-everything");
    let stub = Stub::start(
        &ws,
        &script([
            Turn::calls([
                Call::new("t1", "mcp__everything__get-sum", json!({"a": 2, "b": 3})),
                Call::new("t2", "mcp__everything__echo", json!({"message": "hey"})),
                Call::new("t3", "mcp__everything__get-tiny-image", json!({})),
            ]),
            Turn::text("done"),
        ]),
    );
    let everything = kit
        .dir
        .join("node_modules/@modelcontextprotocol/server-everything/dist/index.js");
    let cfg = config(
        &ws,
        "mcp.json",
        json!({"everything": {"command": path_str(&kit.node()),
                              "args": [path_str(&everything), "stdio"]}}),
    );
    let out = print_mode(
        &ws,
        &stub,
        &["--mcp-config", &cfg, "--allow", "mcp__everything__*"],
    );
    assert_eq!(out.code, Some(0), "{out:?}");
    let all = results(&stub);
    assert!(result(&all, "t1").2.contains('5'), "{all:?}");
    assert!(result(&all, "t2").2.contains("hey"), "{all:?}");
    // The tiny image reaches the model as an image (tests/tool_results.rs checks the shapes).
    let last = stub.requests().last().unwrap().to_string();
    assert!(last.contains(r#""media_type":"image/png""#), "{all:?}");
}

#[test]
fn mcp_client_print_init_frame_names_the_servers_with_their_status() {
    let ws = Workspace::new("mcpc-init");
    let stub = Stub::start(&ws, &script([Turn::text("done")]));
    let cfg = config(
        &ws,
        "mcp.json",
        json!({"py": stdio_server(&ws.root),
               "missing": {"command": path_str(&ws.path("no-such-server"))}}),
    );
    let out = print_mode(
        &ws,
        &stub,
        &["--mcp-config", &cfg, "--output-format", "stream-json"],
    );
    assert_eq!(out.code, Some(0), "{out:?}");
    let init = out
        .frames()
        .into_iter()
        .find(|f| f["type"] == "system" && f["subtype"] == "init")
        .unwrap_or_else(|| panic!("no init frame: {out:?}"));
    let mut servers = init["mcp_servers"].as_array().cloned().unwrap_or_default();
    servers.sort_by_key(|s| s["name"].to_string());
    // The frame comes before the loop runs: a server that started is still listing.
    assert_eq!(
        servers,
        vec![
            json!({"name": "missing", "status": "failed"}),
            json!({"name": "py", "status": "pending"}),
        ],
        "{init}"
    );
}

// ---- timeouts, cancellation, crashes, rules ------------------------------------------------

#[test]
fn mcp_client_slow_call_times_out_and_the_server_is_told() {
    let ws = Workspace::new("mcpc-timeout");
    let stub = Stub::start(
        &ws,
        &script([
            Turn::call("t1", "mcp__py__slow", json!({"seconds": 60})),
            Turn::call("t2", "mcp__py__echo", json!({"text": "still here"})),
            Turn::text("done"),
        ]),
    );
    let cfg = config(&ws, "mcp.json", json!({"py": stdio_server(&ws.root)}));
    let out = print_mode(
        &ws,
        &stub,
        &[
            "--mcp-config",
            &cfg,
            "--allow",
            "mcp__py__*",
            "--mcp-timeout",
            "1",
        ],
    );
    assert_eq!(out.code, Some(0), "{out:?}");
    let all = results(&stub);
    let (_, is_error, text) = result(&all, "t1");
    assert!(
        *is_error && text.contains("did not answer within 1 s"),
        "{text}"
    );
    // The server heard `notifications/cancelled` and stopped the work; it still serves.
    wait_until("the server to cancel the slow call", || {
        ws.path("slow-cancelled").exists()
    });
    assert_eq!(result(&all, "t2").2, "echo: still here");
}

#[test]
fn mcp_client_rules_deny_and_print_mode_denies_what_would_ask() {
    let ws = Workspace::new("mcpc-rules");
    let stub = Stub::start(
        &ws,
        &script([
            Turn::calls([
                Call::new("t1", "mcp__py__echo", json!({"text": "no"})),
                Call::new("t2", "mcp__py__picture", json!({})),
                Call::new("t3", "mcp__py__slow", json!({"seconds": 0})),
            ]),
            Turn::text("done"),
        ]),
    );
    let cfg = config(&ws, "mcp.json", json!({"py": stdio_server(&ws.root)}));
    let out = print_mode(
        &ws,
        &stub,
        &[
            "--mcp-config",
            &cfg,
            "--deny",
            "mcp__py__echo",
            "--allow",
            "mcp__py__slow",
        ],
    );
    assert_eq!(out.code, Some(0), "{out:?}");
    let all = results(&stub);
    assert!(result(&all, "t1").1, "a deny rule: {all:?}");
    // No rule for it: it asks, and print mode has no one to ask.
    assert!(result(&all, "t2").1, "{all:?}");
    assert!(!result(&all, "t3").1, "allowed: {all:?}");
    assert_eq!(result(&all, "t3").2, "slept");
}

// ---- the drive surfaces -----------------------------------------------------------------

fn start_run(addr: SocketAddr, body: Value) -> Result<String, (u16, String)> {
    let resp = request(
        addr,
        "POST",
        "/runs",
        &[("content-type", "application/json")],
        body.to_string().as_bytes(),
    );
    if resp.status != 200 {
        return Err((resp.status, resp.text()));
    }
    Ok(resp.json()["run_id"].as_str().expect("run_id").to_owned())
}

fn state(addr: SocketAddr, run: &str) -> String {
    let resp = request(addr, "GET", &format!("/runs/{run}/status"), &[], b"");
    resp.json()["status"]["state"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

fn wait_done(addr: SocketAddr, run: &str) {
    wait_until(&format!("{run} to end"), || {
        matches!(state(addr, run).as_str(), "done" | "failed")
    });
}

#[test]
fn mcp_client_http_serve_crash_is_reported_and_the_next_run_restarts_the_server() {
    let ws = Workspace::new("mcpc-crash");
    let stub = Stub::start(
        &ws,
        &script([
            Turn::call("t1", "mcp__py__crash", json!({})),
            Turn::call("t2", "mcp__py__echo", json!({"text": "after the crash"})),
            Turn::text("first run over"),
            Turn::call("t3", "mcp__py__echo", json!({"text": "restarted"})),
            Turn::text("second run over"),
        ]),
    );
    let cfg = config(&ws, "mcp.json", json!({"py": stdio_server(&ws.root)}));
    let serve = Serve::start(
        &ws,
        &stub,
        &["--mcp-config", &cfg, "--allow", "mcp__py__*"],
        &[],
    );
    let first = start_run(serve.addr, json!({"prompt": "crash it"})).expect("run");
    wait_done(serve.addr, &first);
    let second = start_run(serve.addr, json!({"prompt": "again"})).expect("run");
    wait_done(serve.addr, &second);
    let all = results(&stub);
    let (_, crashed, text) = result(&all, "t1");
    assert!(
        *crashed && text.contains("MCP server `py` exited"),
        "{text}"
    );
    // The dead server's tools are no longer offered to the run's next turns.
    let (_, gone, text) = result(&all, "t2");
    assert!(
        *gone && text.contains("unknown tool 'mcp__py__echo'"),
        "{text}"
    );
    assert!(offered(&stub, 1).is_empty(), "{:?}", offered(&stub, 1));
    assert_eq!(result(&all, "t3").2, "echo: restarted");
    let stderr = serve.stderr();
    assert_eq!(
        stderr.matches("MCP server `py` (").count(),
        1,
        "reported once: {stderr}"
    );
}

#[test]
fn mcp_client_server_that_never_lists_is_given_up_and_the_run_goes_on() {
    let ws = Workspace::new("mcpc-hung");
    let stub = Stub::start(&ws, &script([Turn::text("went on without it")]));
    // Reads its input and never answers `initialize`.
    let cfg = config(
        &ws,
        "mcp.json",
        json!({"hung": {"command": "python3", "args": ["-c", "import sys; sys.stdin.read()"]}}),
    );
    // A 1 s call timeout makes the listing deadline its floor, `START_WAIT` (10 s).
    let serve = Serve::start(
        &ws,
        &stub,
        &["--mcp-config", &cfg, "--mcp-timeout", "1"],
        &[],
    );
    let run = start_run(serve.addr, json!({"prompt": "hello"})).expect("run");
    wait_done(serve.addr, &run);
    assert_eq!(state(serve.addr, &run), "done");
    assert!(offered(&stub, 0).is_empty(), "{:?}", offered(&stub, 0));
    wait_until("the hung server to be reported", || {
        serve
            .stderr()
            .contains("did not list its tools within 10 s")
    });
    let stderr = serve.stderr();
    assert_eq!(
        stderr.matches("MCP server `hung` (").count(),
        1,
        "reported once, by name: {stderr}"
    );
}

#[test]
fn mcp_client_relist_that_hangs_is_given_up_and_the_old_tools_stay() {
    let ws = Workspace::new("mcpc-relist-hangs");
    let stub = Stub::start(
        &ws,
        &script([
            Turn::call("t1", "mcp__hangs__change", json!({})),
            Turn::text("first run over"),
            Turn::call("t2", "mcp__hangs__echo", json!({"text": "old list"})),
            Turn::text("second run over"),
        ]),
    );
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/mcp_client/relist_hangs.py"
    );
    let cfg = config(
        &ws,
        "mcp.json",
        json!({"hangs": {"command": "python3", "args": [script]}}),
    );
    // A 1 s call timeout makes the re-list deadline its floor, `START_WAIT` (10 s).
    let serve = Serve::start(
        &ws,
        &stub,
        &[
            "--mcp-config",
            &cfg,
            "--allow",
            "mcp__hangs__*",
            "--mcp-timeout",
            "1",
        ],
        &[],
    );
    let first = start_run(serve.addr, json!({"prompt": "change"})).expect("run");
    wait_done(serve.addr, &first);
    assert_eq!(result(&results(&stub), "t1").2, "changed");
    wait_until("the hung re-list to be given up", || {
        serve
            .stderr()
            .contains("did not list them again within 10 s; it keeps offering the 2 tools")
    });
    // The server is neither listing nor dropped: the next run is offered the old list at
    // once and calls it.
    let second = start_run(serve.addr, json!({"prompt": "echo"})).expect("run");
    wait_done(serve.addr, &second);
    assert_eq!(state(serve.addr, &second), "done");
    let tools = offered(&stub, 2);
    assert!(tools.contains(&"mcp__hangs__echo".to_owned()), "{tools:?}");
    assert_eq!(result(&results(&stub), "t2").2, "echo: old list");
    let stderr = serve.stderr();
    assert!(
        !stderr.contains("MCP server `hangs` ("),
        "not dropped: {stderr}"
    );
}

/// A cancelled run's MCP call is cancelled with `notifications/cancelled`, over stdio and
/// over Streamable HTTP (where it is a POST of its own while the call's stream is open).
#[test]
fn mcp_client_http_serve_cancel_sends_notifications_cancelled() {
    for transport in ["stdio", "http"] {
        let ws = Workspace::new(&format!("mcpc-cancel-{transport}"));
        let stub = Stub::start(
            &ws,
            &script([
                Turn::call("t1", "mcp__py__slow", json!({"seconds": 60})),
                Turn::text("x"),
            ]),
        );
        let http = (transport == "http").then(|| PyHttp::start("http", &ws.root));
        let server = match &http {
            Some(http) => json!({"type": "http", "url": http.url}),
            None => stdio_server(&ws.root),
        };
        let cfg = config(&ws, "mcp.json", json!({ "py": server }));
        let serve = Serve::start(
            &ws,
            &stub,
            &["--mcp-config", &cfg, "--allow", "mcp__py__*"],
            &[],
        );
        let run = start_run(serve.addr, json!({"prompt": "wait"})).expect("run");
        wait_until("the slow call to start", || {
            ws.path("slow-started").exists()
        });
        let resp = request(serve.addr, "POST", &format!("/runs/{run}/cancel"), &[], b"");
        assert_eq!(resp.status, 200, "{transport}: {resp:?}");
        wait_until(
            &format!("the {transport} server to cancel the call"),
            || ws.path("slow-cancelled").exists(),
        );
        wait_done(serve.addr, &run);
    }
}

#[test]
fn mcp_client_per_run_servers_are_names_from_the_configuration() {
    let ws = Workspace::new("mcpc-select");
    let stub = Stub::start(&ws, &script([Turn::text("a"), Turn::text("b")]));
    let cfg = config(
        &ws,
        "mcp.json",
        json!({"one": stdio_server(&ws.root), "two": stdio_server(&ws.root)}),
    );
    let serve = Serve::start(&ws, &stub, &["--mcp-config", &cfg], &[]);
    let refused = start_run(
        serve.addr,
        json!({"prompt": "p", "mcp_servers": ["one", "/bin/sh"]}),
    );
    let (status, body) = refused.expect_err("an unknown server is refused");
    assert_eq!(status, 400);
    assert!(body.contains("unknown MCP server `/bin/sh`"), "{body}");
    let run = start_run(serve.addr, json!({"prompt": "p", "mcp_servers": ["two"]})).expect("run");
    wait_done(serve.addr, &run);
    let tools = offered(&stub, 0);
    assert!(
        tools.iter().all(|t| t.starts_with("mcp__two__")),
        "{tools:?}"
    );
    assert!(tools.contains(&"mcp__two__echo".to_owned()), "{tools:?}");
    let run = start_run(serve.addr, json!({"prompt": "p", "mcp_servers": []})).expect("run");
    wait_done(serve.addr, &run);
    assert!(offered(&stub, 1).is_empty());
}

#[test]
fn mcp_client_workspace_servers_need_approval_once() {
    let ws = Workspace::new("mcpc-approve");
    let stub = Stub::start(
        &ws,
        &script([Turn::text("a"), Turn::text("b"), Turn::text("c")]),
    );
    ws.write(
        ".mcp.json",
        &json!({"mcpServers": {"proj": stdio_server(&ws.root)}}).to_string(),
    );
    let out = print_mode(&ws, &stub, &[]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(
        offered(&stub, 0).is_empty(),
        "not approved: nothing started"
    );
    assert!(out.stderr.contains("--approve-mcp proj"), "{out:?}");
    let out = print_mode(&ws, &stub, &["--approve-mcp", "proj"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(offered(&stub, 1).contains(&"mcp__proj__echo".to_owned()));
    // Remembered for the workspace.
    let out = print_mode(&ws, &stub, &[]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(
        offered(&stub, 2).contains(&"mcp__proj__echo".to_owned()),
        "{out:?}"
    );
}
