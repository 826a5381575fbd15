//! Issue 21's policy findings, end to end: caliban's secrets kept from every process a tool
//! starts, deny rules that hold in `bypassPermissions`, MCP approvals that cover what runs,
//! `WebFetch` rules on canonical addresses, the per-run cap on process tools, and prompt
//! images checked against their claimed type. The model's side is the stub's scripted
//! `tool_use` blocks; nothing here reaches beyond loopback.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::util::*;

/// Each tool result's (text, is_error) by id, from print mode's stream-json frames.
fn results(out: &Output) -> HashMap<String, (String, bool)> {
    out.frames()
        .into_iter()
        .filter(|f| f["type"] == "tool_result")
        .map(|f| {
            let text = texts(&f["content"]);
            let id = f["tool_use_id"].as_str().unwrap_or_default().to_owned();
            (id, (text, f["is_error"] == json!(true)))
        })
        .collect()
}

/// Print mode running `script` with `args` and extra `env`, the user maybe `user`.
fn print_with(
    ws: &Workspace,
    script: &Value,
    args: &[&str],
    env: &[(&str, &str)],
    user: Option<(u32, u32)>,
) -> Output {
    let stub = Stub::start(ws, script);
    let mut cmd = caliban(ws);
    anthropic(&mut cmd, &stub);
    cmd.args(["-p", "go", "--output-format", "stream-json"])
        .args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    if let Some(user) = user {
        ws.give_to(user);
        as_user(&mut cmd, user);
    }
    run(cmd, "")
}

fn user_settings(ws: &Workspace, settings: Value) {
    ws.write("home/.config/caliban/settings.json", &settings.to_string());
}

// ---- finding 7: secrets stay with caliban ---------------------------------------------------

const SECRETS: &[(&str, &str)] = &[
    ("ANTHROPIC_API_KEY", "sk-ant-test-secret"),
    ("OPENAI_API_KEY", "sk-openai-test-secret"),
    ("MY_SECRET_TOKEN", "tok-1"),
    ("db_password", "hunter2"),
    ("GITHUB_TOKEN", "ghp-kept"),
    ("PROJECT_TOKEN", "proj-not-kept"),
    ("PLAIN_VARIABLE", "plain"),
];

/// Which of `SECRETS` a dump of an environment shows.
fn seen(dump: &str) -> Vec<&'static str> {
    SECRETS
        .iter()
        .filter(|(name, value)| dump.contains(&format!("{name}={value}")))
        .map(|(name, _)| *name)
        .collect()
}

fn passthrough_settings(ws: &Workspace) {
    user_settings(
        ws,
        json!({"sandbox": {"env_passthrough": ["GITHUB_TOKEN"]}}),
    );
    // A workspace must not pass a secret through: this is ignored with a warning.
    ws.write(
        ".caliban/settings.json",
        &json!({"sandbox": {"env_passthrough": ["PROJECT_TOKEN"]}}).to_string(),
    );
}

#[test]
fn commands_do_not_see_caliban_s_keys_nor_secret_looking_variables() {
    let users = std::iter::once(None).chain(ordinary_user().map(Some));
    for user in users {
        for mode in ["workspace-write", "off"] {
            let ws = Workspace::new("pol-env");
            passthrough_settings(&ws);
            let calls = vec![
                Call::bash("fg", "env"),
                Call::new(
                    "bg",
                    "Bash",
                    json!({"command": "env > bg-env.txt", "background": true}),
                ),
            ];
            let script = script([
                Turn::calls(calls),
                Turn::bash(
                    "wait",
                    "for i in $(seq 100); do [ -s bg-env.txt ] && break; sleep 0.1; done",
                ),
                Turn::text("done"),
            ]);
            let out = print_with(
                &ws,
                &script,
                &["--allow", "Bash", "--sandbox", mode],
                SECRETS,
                user,
            );
            let results = results(&out);
            let fg = &results.get("fg").unwrap_or_else(|| panic!("{out:?}")).0;
            assert!(fg.contains("PLAIN_VARIABLE=plain"), "{fg}");
            assert_eq!(
                seen(fg),
                ["GITHUB_TOKEN", "PLAIN_VARIABLE"],
                "{mode} {user:?}: {fg}"
            );
            let bg = ws.read("bg-env.txt");
            assert_eq!(
                seen(&bg),
                ["GITHUB_TOKEN", "PLAIN_VARIABLE"],
                "{mode} {user:?}: {bg}"
            );
            assert!(
                out.stderr.contains("sandbox.env_passthrough"),
                "the workspace's passthrough is refused aloud: {out:?}"
            );
        }
    }
}

#[test]
fn an_mcp_server_gets_its_own_configured_env_but_not_caliban_s_secrets() {
    let ws = Workspace::new("pol-mcp-env");
    passthrough_settings(&ws);
    let dump = ws.path("mcp-env.txt");
    let config = json!({"mcpServers": {"dump": {
        "command": "/bin/sh",
        "args": ["-c", format!("env > {}", path_str(&dump))],
        "env": {"SERVER_API_KEY": "configured-for-the-server"},
    }}});
    ws.write("mcp.json", &config.to_string());
    let config = path_str(&ws.path("mcp.json"));
    let script = script([Turn::bare().say("done").usage(1, 1)]);
    let out = print_with(&ws, &script, &["--mcp-config", &config], SECRETS, None);
    assert_eq!(out.code, Some(0), "{out:?}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !dump.exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let env = std::fs::read_to_string(&dump).unwrap_or_else(|e| panic!("{e}: {out:?}"));
    assert_eq!(seen(&env), ["GITHUB_TOKEN", "PLAIN_VARIABLE"], "{env}");
    assert!(
        env.contains("SERVER_API_KEY=configured-for-the-server"),
        "{env}"
    );
}

// ---- finding 10: deny beats bypass ----------------------------------------------------------

#[test]
fn deny_rules_hold_in_bypass_permissions() {
    let ws = Workspace::new("pol-bypass");
    user_settings(&ws, json!({"permissions": {"deny": ["Bash(touch:*)"]}}));
    let calls = vec![
        Call::bash("cli", "echo ran > cli.txt"),
        Call::bash("settings", "touch settings.txt"),
        Call::new("fetch", "WebFetch", json!({"url": "http://127.0.0.1:9/"})),
        Call::new(
            "write",
            "Write",
            json!({"path": "written.txt", "content": "x"}),
        ),
    ];
    let out = print_with(
        &ws,
        &calls_then_done(calls),
        &[
            "--permission-mode",
            "bypassPermissions",
            "--deny",
            "Bash(echo:*)",
            "--deny",
            "WebFetch",
        ],
        &[],
        None,
    );
    let results = results(&out);
    for id in ["cli", "settings", "fetch"] {
        let (text, error) = results.get(id).unwrap_or_else(|| panic!("{id}: {out:?}"));
        assert!(*error && text.contains("denied"), "{id}: {text}");
    }
    assert!(!ws.path("cli.txt").exists() && !ws.path("settings.txt").exists());
    // What no deny rule names still runs without asking.
    assert!(!results["write"].1, "{:?}", results["write"]);
    assert_eq!(ws.read("written.txt"), "x");
}

// ---- findings 8 and 11: approvals cover what runs -------------------------------------------

fn text_only() -> Value {
    script([Turn::bare().say("done").usage(1, 1)])
}

fn starts(ws: &Workspace) -> Vec<String> {
    std::fs::read_to_string(ws.path("started.txt"))
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

#[test]
fn a_workspace_server_whose_script_the_model_rewrote_is_asked_about_again() {
    let ws = Workspace::new("pol-approve-file");
    ws.write(
        ".mcp.json",
        &json!({"mcpServers": {"proj": {"command": "/bin/sh", "args": ["tool_server.sh"]}}})
            .to_string(),
    );
    ws.write("tool_server.sh", "echo approved >> started.txt\n");
    let out = print_with(&ws, &text_only(), &["--approve-mcp", "proj"], &[], None);
    assert_eq!(out.code, Some(0), "{out:?}");
    let out = print_with(&ws, &text_only(), &[], &[], None);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(
        starts(&ws),
        ["approved", "approved"],
        "the approval is remembered"
    );
    // The model's Write, allowed by acceptEdits, rewrites the approved script.
    let write = Call::new(
        "w",
        "Write",
        json!({"path": "tool_server.sh",
               "content": "echo unconfined >> started.txt\n"}),
    );
    let out = print_with(
        &ws,
        &calls_then_done(vec![write]),
        &["--permission-mode", "acceptEdits"],
        &[],
        None,
    );
    assert!(!results(&out)["w"].1, "{out:?}");
    let out = print_with(&ws, &text_only(), &[], &[], None);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(
        !starts(&ws).contains(&"unconfined".to_owned()),
        "the rewritten script ran: {:?}",
        starts(&ws)
    );
    assert!(
        out.stderr
            .contains("not approved (`tool_server.sh` changed since it was approved)"),
        "{out:?}"
    );
    // Approved again, it runs.
    let out = print_with(&ws, &text_only(), &["--approve-mcp", "proj"], &[], None);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(starts(&ws).last().map(String::as_str), Some("unconfined"));
}

#[test]
fn a_header_added_to_an_approved_workspace_server_needs_approval_again() {
    let ws = Workspace::new("pol-approve-header");
    let url = "http://127.0.0.1:9/mcp";
    ws.write(
        ".mcp.json",
        &json!({"mcpServers": {"web": {"type": "http", "url": url}}}).to_string(),
    );
    let out = print_with(&ws, &text_only(), &["--approve-mcp", "web"], &[], None);
    assert_eq!(out.code, Some(0), "{out:?}");
    let out = print_with(&ws, &text_only(), &[], &[], None);
    assert!(!out.stderr.contains("not approved"), "{out:?}");
    ws.write(
        ".mcp.json",
        &json!({"mcpServers": {"web": {"type": "http", "url": url,
                                        "headers": {"X": "${ANTHROPIC_API_KEY}"}}}})
        .to_string(),
    );
    let out = print_with(
        &ws,
        &text_only(),
        &[],
        &[("ANTHROPIC_API_KEY", "sk-x")],
        None,
    );
    assert!(
        out.stderr
            .contains("not approved (its configuration changed since it was approved)"),
        "{out:?}"
    );
    assert!(
        out.stderr.contains("it is given ${ANTHROPIC_API_KEY}") && !out.stderr.contains("sk-x"),
        "the warning names the variable, never its value: {out:?}"
    );
}

// ---- finding 13: WebFetch compares canonical addresses --------------------------------------

/// A loopback HTTP server answering every request with `PAGE`; serves until the test ends.
fn page_server() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            std::thread::spawn(move || {
                use std::io::{Read, Write};
                let mut stream = stream;
                let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
                let mut buf = [0u8; 4096];
                let _ = stream.read(&mut buf);
                let body = PAGE;
                let _ = write!(
                    stream,
                    "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n\
                     connection: close\r\n\r\n{body}",
                    body.len()
                );
            });
        }
    });
    port
}

const PAGE: &str = "the loopback page";

/// Spellings of this machine's loopback address that the resolver dials as such.
const LOOPBACK_SPELLINGS: &[&str] = &[
    "127.0.0.1",
    "127.1",
    "0x7f000001",
    "2130706433",
    "0177.0.0.1",
    "127.0.0.2",
    "0.0.0.0",
    "[::ffff:127.0.0.1]",
    "localhost",
    "localhost.",
];

fn fetch_call(id: &str, url: &str) -> Call {
    Call::new(id, "WebFetch", json!({ "url": url }))
}

fn fetch_all(ws: &Workspace, port: u16, args: &[&str]) -> HashMap<String, (String, bool)> {
    let calls: Vec<Call> = LOOPBACK_SPELLINGS
        .iter()
        .map(|host| fetch_call(host, &format!("http://{host}:{port}/")))
        .collect();
    let out = print_with(ws, &calls_then_done(calls), args, &[], None);
    let results = results(&out);
    assert_eq!(results.len(), LOOPBACK_SPELLINGS.len(), "{out:?}");
    results
}

#[test]
fn web_fetch_deny_rules_catch_every_spelling_of_loopback() {
    let port = page_server();
    let ws = Workspace::new("pol-fetch");
    // Without a deny rule these spellings reach the page: the test is of real addresses.
    let open = fetch_all(&ws, port, &["--allow", "WebFetch"]);
    // (127.0.0.2 is loopback too, but the page listens on 127.0.0.1 only; not every
    // resolver reads `localhost.`.)
    for host in [
        "127.1",
        "0x7f000001",
        "2130706433",
        "0177.0.0.1",
        "localhost",
    ] {
        assert!(open[host].0.contains(PAGE), "{host}: {:?}", open[host]);
    }
    for rule in [
        "WebFetch(domain:127.0.0.1)",
        "WebFetch(domain:localhost)",
        "WebFetch(domain:::1)",
    ] {
        let denied = fetch_all(&ws, port, &["--deny", rule, "--allow", "WebFetch"]);
        for host in LOOPBACK_SPELLINGS {
            let (text, error) = &denied[*host];
            assert!(
                *error && !text.contains(PAGE) && text.contains("denied"),
                "{rule} let {host} through: {text}"
            );
        }
    }
}

#[test]
fn web_fetch_block_private_refuses_names_that_resolve_to_loopback() {
    use std::net::ToSocketAddrs;
    let port = page_server();
    let ws = Workspace::new("pol-fetch-private");
    user_settings(&ws, json!({"webfetch": {"block_private": true}}));
    // A name other than localhost that resolves to loopback, when the machine has one (its
    // own host name often does), exercises the check on the resolved address.
    let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap_or_default()
        .trim()
        .to_owned();
    let resolves_local = !hostname.is_empty()
        && (hostname.as_str(), port)
            .to_socket_addrs()
            .is_ok_and(|mut addrs| addrs.all(|a| a.ip().is_loopback()));
    let mut calls: Vec<Call> = LOOPBACK_SPELLINGS
        .iter()
        .map(|host| fetch_call(host, &format!("http://{host}:{port}/")))
        .collect();
    calls.push(fetch_call(
        "metadata",
        "http://169.254.169.254/latest/meta-data/",
    ));
    calls.push(fetch_call("private", "http://10.0.0.1:9/"));
    if resolves_local {
        calls.push(fetch_call("name", &format!("http://{hostname}:{port}/")));
    } else {
        eprintln!("no name but localhost resolves to loopback here; the lookup case is skipped");
    }
    let out = print_with(
        &ws,
        &calls_then_done(calls),
        &["--allow", "WebFetch"],
        &[],
        None,
    );
    let results = results(&out);
    for (id, (text, error)) in &results {
        assert!(
            *error && !text.contains(PAGE) && text.contains("webfetch.block_private"),
            "{id}: {text}"
        );
    }
    if resolves_local {
        assert!(
            results["name"].0.contains("resolves to 127."),
            "{:?}",
            results["name"]
        );
    }
}

// ---- finding 15: prompt images must be what they claim --------------------------------------

/// Mislabelled images: a PNG claimed as JPEG, and bytes that are no image claimed as PNG.
fn mislabelled() -> [(Value, &'static str); 2] {
    use crate::util::{PNG, image_block};
    [
        (
            image_block("image/jpeg", PNG),
            "image 1: claimed to be image/jpeg, but its bytes are image/png",
        ),
        (
            // "hello, world" in base64.
            image_block("image/png", "aGVsbG8sIHdvcmxk"),
            "image 1: claimed to be image/png, but its bytes are not PNG, JPEG, GIF or WebP",
        ),
    ]
}

#[test]
fn http_serve_refuses_a_prompt_image_that_is_not_what_it_claims() {
    use crate::util::http::{Serve, post_json};
    let ws = Workspace::new("pol-img-http");
    let stub = Stub::start(&ws, &text_only());
    let server = Serve::start(&ws, &stub, &[], &[]);
    for (block, why) in mislabelled() {
        let resp = post_json(
            server.addr,
            "/runs",
            &json!({"prompt": "x", "images": [block]}),
        );
        assert_eq!(resp.status, 400, "{resp:?}");
        assert_eq!(
            resp.json(),
            json!({"error": format!("`images`: {why}")}),
            "{resp:?}"
        );
    }
    assert!(stub.requests().is_empty(), "nothing reached the model");
}

#[test]
fn print_mode_refuses_a_prompt_image_that_is_not_what_it_claims() {
    let ws = Workspace::new("pol-img-print");
    let stub = Stub::start(&ws, &text_only());
    for (block, why) in mislabelled() {
        let cmd = caliban_stub(
            &ws,
            &stub,
            &[
                "-p",
                "--input-format",
                "stream-json",
                "--output-format",
                "stream-json",
            ],
        );
        let line = json!({"type": "user", "content": [{"type": "text", "text": "what?"}, block]});
        let out = run(cmd, &format!("{line}\n"));
        assert_eq!(out.code, Some(64), "{out:?}");
        let error = out.result()["error"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let why = why.trim_start_matches("image 1: ");
        assert!(error.contains(why), "{error}");
    }
    assert!(stub.requests().is_empty(), "nothing reached the model");
}

// ---- finding 14: a per-run cap on process tools ---------------------------------------------

/// `MAX_LIVE_PROCESSES_PER_RUN` in `src/engine.rs`.
const PROCESS_CAP: usize = 24;

#[test]
fn a_turn_of_many_bash_calls_never_runs_more_than_the_cap_at_once() {
    let ws = Workspace::new("pol-cap");
    std::fs::create_dir_all(ws.path("live")).expect("mkdir");
    let n = 40;
    // Each call marks itself live, records how many are live, holds its place, and leaves.
    let calls: Vec<Call> = (0..n)
        .map(|i| {
            Call::bash(
                &format!("c{i}"),
                &format!(
                    "touch live/{i}; ls live | wc -l >> counts.txt; sleep 1.5; rm live/{i}; \
                     echo done-{i}"
                ),
            )
        })
        .collect();
    let out = print_with(
        &ws,
        &calls_then_done(calls),
        &["--allow", "Bash"],
        &[],
        None,
    );
    assert_eq!(out.code, Some(0), "{out:?}");
    let results = results(&out);
    for i in 0..n {
        let (text, error) = &results[&format!("c{i}")];
        assert!(
            !error && text.contains(&format!("done-{i}")),
            "c{i}: {text}"
        );
    }
    let counts: Vec<usize> = ws
        .read("counts.txt")
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    assert_eq!(counts.len(), n, "{counts:?}");
    let most = counts.iter().copied().max().unwrap_or(0);
    assert!(
        most <= PROCESS_CAP,
        "{most} calls were alive at once: {counts:?}"
    );
    assert!(most > 1, "the calls still run side by side: {counts:?}");
}

#[test]
fn cancel_ends_a_run_whose_calls_wait_for_a_place_and_they_never_start() {
    use crate::util::http::{Serve, request};
    use crate::util::http::{start_run, status_of, wait_for, wait_terminal};
    let ws = Workspace::new("pol-cap-cancel");
    std::fs::create_dir_all(ws.path("started")).expect("mkdir");
    let n = PROCESS_CAP + 6;
    let calls: Vec<Call> = (0..n)
        .map(|i| Call::bash(&format!("c{i}"), &format!("touch started/{i}; sleep 60")))
        .collect();
    let stub = Stub::start(&ws, &calls_then_done(calls));
    let server = Serve::start(&ws, &stub, &["--allow", "Bash"], &[]);
    let started = || std::fs::read_dir(ws.path("started")).map_or(0, |d| d.count());
    let run = start_run(server.addr, json!({"prompt": "many"}));
    wait_for("the first calls to start", || {
        (started() >= PROCESS_CAP).then_some(())
    });
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(started(), PROCESS_CAP, "only the cap's worth start");
    assert_eq!(status_of(server.addr, &run), json!({"state": "running"}));
    let cancelled = Instant::now();
    let resp = request(
        server.addr,
        "POST",
        &format!("/runs/{run}/cancel"),
        &[],
        b"",
    );
    assert_eq!(resp.status, 200, "{resp:?}");
    assert_eq!(wait_terminal(server.addr, &run), json!({"state": "done"}));
    assert!(
        cancelled.elapsed() < Duration::from_secs(10),
        "{:?}",
        cancelled.elapsed()
    );
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        started(),
        PROCESS_CAP,
        "a waiting call started after the cancel"
    );
}

#[test]
fn a_workspace_allow_rule_does_not_lift_the_user_s_deny() {
    let ws = Workspace::new("pol-deny-order");
    user_settings(&ws, json!({"permissions": {"deny": ["Bash(touch:*)"]}}));
    ws.write(
        ".caliban/settings.json",
        &json!({"permissions": {"allow": ["Bash"]}}).to_string(),
    );
    let calls = vec![
        Call::bash("touch", "touch t.txt"),
        Call::bash("echo", "echo hi"),
    ];
    let out = print_with(&ws, &calls_then_done(calls), &[], &[], None);
    let results = results(&out);
    assert!(
        results["touch"].1 && results["touch"].0.contains("denied"),
        "{out:?}"
    );
    assert!(!ws.path("t.txt").exists());
    assert!(
        !results["echo"].1,
        "the workspace's allow still allows the rest: {out:?}"
    );
}

#[test]
fn http_serve_does_not_restart_an_approved_server_from_a_rewritten_script() {
    use crate::util::http::Serve;
    use crate::util::http::{start_run, wait_terminal};
    let ws = Workspace::new("pol-approve-restart");
    ws.write(
        ".mcp.json",
        &json!({"mcpServers": {"proj": {"command": "/bin/sh", "args": ["tool_server.sh"]}}})
            .to_string(),
    );
    // A server that exits at once, so each run starts it again.
    ws.write("tool_server.sh", "echo approved >> started.txt\n");
    let stub = Stub::start(
        &ws,
        &script([Turn::text("one").usage(1, 1), Turn::text("two").usage(1, 1)]),
    );
    let serve = Serve::start(&ws, &stub, &["--approve-mcp", "proj"], &[]);
    let first = start_run(serve.addr, json!({"prompt": "one"}));
    wait_terminal(serve.addr, &first);
    let deadline = Instant::now() + Duration::from_secs(10);
    while starts(&ws).is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(starts(&ws), ["approved"]);
    // What a command or the model's Write would do while the server runs.
    ws.write("tool_server.sh", "echo unconfined >> started.txt\n");
    let second = start_run(serve.addr, json!({"prompt": "two"}));
    wait_terminal(serve.addr, &second);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        starts(&ws),
        ["approved"],
        "restarted from the rewritten script"
    );
    let stderr = serve.stderr();
    assert!(
        stderr.contains("`tool_server.sh` changed since the server was approved"),
        "{stderr}"
    );
}
