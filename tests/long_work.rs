//! The agent for long work (issue 14): project instructions, more tools (MultiEdit,
//! background shells, WebFetch), TodoWrite plans and print-mode sessions that continue, each
//! on every surface where it shows, against the real binary and `caliban stub-model`.

use std::time::Duration;

use serde_json::{Value, json};

use crate::util::http::{Serve, get, post_json};
use crate::util::rpc::Peer;
use crate::util::*;

const RECV: Duration = Duration::from_secs(30);

/// The `system` text of every model request the stub received, in order.
fn systems_sent(stub: &Stub) -> Vec<String> {
    stub.requests()
        .iter()
        .map(|req| req["body"]["system"].to_string())
        .collect()
}

fn print_frames(ws: &Workspace, stub: &Stub, args: &[&str]) -> (Output, Vec<Value>) {
    let mut cmd = caliban_stub(ws, stub, &["-p", "--output-format", "stream-json"]);
    cmd.args(args);
    let out = run(cmd, "");
    let frames = out.frames();
    (out, frames)
}

/// Polls an MCP run until it is done; its events.
fn mcp_events(rpc: &mut Peer, first_id: u64, run: &str) -> Vec<Value> {
    let mut id = first_id;
    events_until_done(run, 50, |cursor| {
        id += 1;
        rpc.tool_body(
            id - 1,
            "caliban_poll",
            json!({"run_id": run, "cursor": cursor, "wait_ms": 5000}),
        )
    })
}

fn mcp_serve(ws: &Workspace, stub: &Stub, args: &[&str]) -> Peer {
    let mut cmd = caliban_stub(ws, stub, &["mcp", "serve", "-C"]);
    cmd.arg(&ws.root).args(args);
    let mut rpc = Peer::spawn(cmd, RECV);
    let init = rpc.mcp_initialize("2025-11-25", json!({}), "long-work-test");
    assert!(init.get("result").is_some(), "{init}");
    rpc
}

fn acp_serve(ws: &Workspace, stub: &Stub, args: &[&str]) -> Peer {
    let mut cmd = caliban_stub(ws, stub, &["acp", "serve"]);
    cmd.args(args);
    let mut rpc = Peer::spawn(cmd, RECV);
    let init = rpc.request(
        0,
        "initialize",
        json!({"protocolVersion": 1, "clientCapabilities": {}}),
    );
    assert_eq!(init["result"]["protocolVersion"], 1, "{init}");
    rpc
}

/// The `session/update`s of one session seen so far, as their `update` objects.
fn acp_updates(rpc: &Peer, kind: &str) -> Vec<Value> {
    rpc.seen
        .iter()
        .filter(|m| m["method"] == "session/update")
        .map(|m| m["params"]["update"].clone())
        .filter(|u| u["sessionUpdate"] == kind)
        .collect()
}

fn http_post(serve: &Serve, path: &str, body: &Value) -> Value {
    let response = post_json(serve.addr, path, body);
    assert_eq!(response.status, 200, "{response:?}");
    response.json()
}

/// Polls an HTTP run until it is done; its events.
fn http_events(serve: &Serve, run: &str) -> Vec<Value> {
    let mut first = true;
    events_until_done(run, 500, |cursor| {
        if !std::mem::take(&mut first) {
            std::thread::sleep(Duration::from_millis(20));
        }
        get(serve.addr, &format!("/runs/{run}/events?cursor={cursor}")).json()
    })
}

// ---- 1. project instructions ---------------------------------------------------------------

/// A repository (`.git` marks its root, so nothing above the test's workspace is read) with
/// instructions at its root and in `sub`, and a user-level file.
fn instructed_workspace(name: &str) -> Workspace {
    let ws = Workspace::new(name);
    ws.write(".git/HEAD", "ref: refs/heads/main\n");
    ws.write(
        "AGENTS.md",
        "Run `make check` before you finish. ROOT-RULE\n",
    );
    ws.write("CLAUDE.md", "a copy of AGENTS.md: never read beside it\n");
    ws.write("sub/CALIBAN.md", "In sub, use tabs. SUB-RULE\n");
    ws.write(
        "home/.config/caliban/AGENTS.md",
        "Answer in English. USER-RULE\n",
    );
    ws
}

#[test]
fn print_mode_appends_instructions_and_names_them_in_init() {
    let ws = instructed_workspace("instr-print");
    let stub = Stub::start(&ws, &script([Turn::text("ok"), Turn::text("ok")]));
    let sub = path_str(&ws.path("sub"));
    let (out, frames) = print_frames(&ws, &stub, &["-C", &sub, "hi"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let init = &frames[0];
    assert_eq!(init["subtype"], "init");
    let paths: Vec<String> = init["instructions"]
        .as_array()
        .expect("instructions")
        .iter()
        .map(|f| f["path"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        paths,
        [
            path_str(&ws.path("home/.config/caliban/AGENTS.md")),
            path_str(&ws.path("AGENTS.md")),
            path_str(&ws.path("sub/CALIBAN.md")),
        ]
    );
    assert_eq!(init["instructions"][1]["truncated"], false);
    let system = &systems_sent(&stub)[0];
    let at = |text: &str| {
        system
            .find(text)
            .unwrap_or_else(|| panic!("{text} not in {system}"))
    };
    assert!(at("USER-RULE") < at("ROOT-RULE") && at("ROOT-RULE") < at("SUB-RULE"));
    assert!(system.contains(&path_str(&ws.path("sub/CALIBAN.md"))));
    assert!(!system.contains("never read beside it"));

    // Turned off by the flag, or by a setting.
    let (out, frames) = print_frames(&ws, &stub, &["--no-project-instructions", "hi"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(frames[0]["instructions"], json!([]));
    assert!(!systems_sent(&stub)[1].contains("ROOT-RULE"));
}

#[test]
fn a_setting_turns_instructions_off_and_the_cap_is_noted() {
    let ws = instructed_workspace("instr-setting");
    ws.write(
        ".caliban/settings.json",
        r#"{"project_instructions": false}"#,
    );
    let stub = Stub::start(&ws, &script([Turn::text("ok")]));
    let (out, frames) = print_frames(&ws, &stub, &["hi"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(frames[0]["instructions"], json!([]));
    assert!(!systems_sent(&stub)[0].contains("ROOT-RULE"));

    let ws = instructed_workspace("instr-cap");
    ws.write("AGENTS.md", &"x".repeat(100 * 1024));
    let stub = Stub::start(&ws, &script([Turn::text("ok")]));
    let (out, frames) = print_frames(&ws, &stub, &["hi"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let root = &frames[0]["instructions"][1];
    assert_eq!(
        (root["bytes"].clone(), root["truncated"].clone()),
        (json!(100 * 1024), json!(true))
    );
    let system = &systems_sent(&stub)[0];
    assert!(
        system.contains("[caliban: cut here: this file is 102400 bytes"),
        "{system}"
    );
}

#[test]
fn http_mcp_and_acp_name_the_instructions_of_their_runs() {
    let ws = instructed_workspace("instr-surfaces");
    let stub = Stub::start(
        &ws,
        &script([Turn::text("one"), Turn::text("two"), Turn::text("three")]),
    );

    let serve = Serve::start(&ws, &stub, &[], &[]);
    let created = http_post(&serve, "/runs", &json!({"prompt": "hi", "cwd": "sub"}));
    let files = created["instructions"].as_array().expect("instructions");
    assert_eq!(files.len(), 3, "{created}");
    assert_eq!(files[2]["path"], path_str(&ws.path("sub/CALIBAN.md")));
    let run = created["run_id"].as_str().unwrap().to_owned();
    http_events(&serve, &run);
    assert!(systems_sent(&stub)[0].contains("SUB-RULE"));
    drop(serve);

    let mut mcp = mcp_serve(&ws, &stub, &[]);
    let body = mcp.tool_body(1, "caliban_run", json!({"prompt": "hi"}));
    let files = body["instructions"].as_array().expect("instructions");
    assert_eq!(files.len(), 2, "{body}");
    assert_eq!(files[1]["path"], path_str(&ws.path("AGENTS.md")));
    let run = body["run_id"].as_str().unwrap().to_owned();
    mcp_events(&mut mcp, 2, &run);
    assert!(systems_sent(&stub)[1].contains("ROOT-RULE"));
    drop(mcp);

    let mut acp = acp_serve(&ws, &stub, &[]);
    let session = acp.request(
        1,
        "session/new",
        json!({"cwd": path_str(&ws.path("sub")), "mcpServers": []}),
    );
    let files = &session["result"]["_meta"]["caliban/instructions"];
    assert_eq!(files.as_array().map(Vec::len), Some(3), "{session}");
    let sid = session["result"]["sessionId"].clone();
    let done = acp.request(
        2,
        "session/prompt",
        json!({"sessionId": sid, "prompt": [{"type": "text", "text": "hi"}]}),
    );
    assert_eq!(done["result"]["stopReason"], "end_turn", "{done}");
    assert!(systems_sent(&stub)[2].contains("SUB-RULE"));

    // Without instructions the start replies keep upstream's exact bodies.
    let bare = Workspace::new("instr-none");
    bare.write(".git/HEAD", "ref\n");
    let stub = Stub::start(&bare, &script([Turn::text("ok")]));
    let serve = Serve::start(&bare, &stub, &[], &[]);
    assert_eq!(
        http_post(&serve, "/runs", &json!({"prompt": "hi"})),
        json!({"run_id": "run-1"})
    );
}

// ---- 4. more tools ------------------------------------------------------------------------

#[test]
fn multi_edit_is_all_or_nothing() {
    let ws = Workspace::new("multiedit");
    ws.write("src/lib.rs", "fn a() {}\nfn b() {}\n");
    let stub = Stub::start(
        &ws,
        &script([
            Turn::calls([Call::new(
                "m1",
                "MultiEdit",
                json!({"path": "src/lib.rs", "edits": [
                    {"old_string": "fn a()", "new_string": "fn alpha()"},
                    {"old_string": "fn b() {}", "new_string": "fn beta() { alpha() }"},
                ]}),
            )]),
            Turn::calls([Call::new(
                "m2",
                "MultiEdit",
                json!({"path": "src/lib.rs", "edits": [
                    {"old_string": "fn alpha()", "new_string": "fn first()"},
                    {"old_string": "fn gamma()", "new_string": "fn third()"},
                ]}),
            )]),
            Turn::text("done"),
        ]),
    );
    let (out, _) = print_frames(&ws, &stub, &["--allow", "MultiEdit(src/**)", "rename"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let (failed, text) = tool_result(&stub, "m1");
    assert!(!failed, "{text}");
    assert!(
        text.starts_with("→ MultiEdit src/lib.rs: 2 edits applied"),
        "{text}"
    );
    let (failed, text) = tool_result(&stub, "m2");
    assert!(failed, "{text}");
    assert!(text.contains("edit 2 of 2 failed"), "{text}");
    // The first edit of the failed call was not applied either.
    assert_eq!(
        ws.read("src/lib.rs"),
        "fn alpha() {}\nfn beta() { alpha() }\n"
    );
}

#[test]
fn background_shells_are_read_killed_and_die_with_the_run() {
    let ws = Workspace::new("shells");
    let marker = format!("caliban-bg-marker-{}", std::process::id());
    let stub = Stub::start(
        &ws,
        &script([
            Turn::calls([
                Call::new(
                    "b1",
                    "Bash",
                    json!({"background": true,
                           "command": "echo line-1; echo err-1 >&2; touch ready; exec sleep 60"}),
                ),
                Call::new(
                    "b2",
                    "Bash",
                    json!({"background": true,
                           "command": format!("sleep 60 # {marker}")}),
                ),
            ]),
            // The first shell's output is in its pipe once `ready` exists.
            Turn::calls([Call::new(
                "w",
                "Bash",
                json!({
                    "command": "while [ ! -f ready ]; do sleep 0.02; done"}),
            )]),
            Turn::calls([Call::new(
                "o1",
                "BashOutput",
                json!({"shell_id": "shell_1"}),
            )]),
            Turn::calls([Call::new("k1", "KillShell", json!({"shell_id": "shell_1"}))]),
            Turn::calls([
                Call::new("o2", "BashOutput", json!({"shell_id": "shell_1"})),
                Call::new(
                    "o3",
                    "BashOutput",
                    json!({"shell_id": "shell_1", "since_offset": 0}),
                ),
                Call::new("o4", "BashOutput", json!({"shell_id": "shell_9"})),
            ]),
            Turn::text("done"),
        ]),
    );
    let (out, frames) = print_frames(&ws, &stub, &["--allow", "Bash", "go"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let tools = &frames[0]["tools"];
    assert!(
        tools.as_array().unwrap().iter().any(|t| t == "BashOutput"),
        "{tools}"
    );
    let (_, started) = tool_result(&stub, "b1");
    assert!(
        started.starts_with("Started background shell shell_1"),
        "{started}"
    );
    assert!(tool_result(&stub, "b2").1.contains("shell_2"));
    let (failed, first) = tool_result(&stub, "o1");
    assert!(!failed, "{first}");
    assert!(first.starts_with("shell_1: running\n"), "{first}");
    assert!(
        first.contains("line-1") && first.contains("err-1"),
        "{first}"
    );
    assert!(first.ends_with("next since_offset 13]"), "{first}");
    let (_, killed) = tool_result(&stub, "k1");
    assert!(killed.starts_with("Killed shell_1"), "{killed}");
    let (_, after) = tool_result(&stub, "o2");
    assert!(
        after.starts_with("shell_1: killed (KillShell)\n[no new output]"),
        "{after}"
    );
    let (_, again) = tool_result(&stub, "o3");
    assert!(again.contains("line-1"), "{again}");
    let (failed, unknown) = tool_result(&stub, "o4");
    assert!(failed, "{unknown}");
    assert!(
        unknown.contains("this run's shells: shell_1, shell_2"),
        "{unknown}"
    );
    // The second shell was never killed by the model: the run's end killed it.
    assert!(!process_with_marker_exists(&marker));
}

#[test]
fn web_fetch_reads_pages_under_the_permission_rules() {
    let ws = Workspace::new("webfetch");
    let site = web_server();
    let fetch = |id: &str, path: &str, extra: Value| {
        let mut input = json!({"url": format!("{site}{path}")});
        input
            .as_object_mut()
            .unwrap()
            .extend(extra.as_object().cloned().unwrap_or_default());
        Call::new(id, "WebFetch", input)
    };
    let stub = Stub::start(
        &ws,
        &script([
            Turn::calls([
                fetch("f1", "/page", json!({"prompt": "the version"})),
                fetch("f2", "/moved", json!({})),
                fetch("f3", "/away", json!({})),
                fetch("f4", "/missing", json!({})),
                fetch("f5", "/slow", json!({"timeout_seconds": 1})),
            ]),
            Turn::text("done"),
            // The second run: no rule allows WebFetch.
            Turn::calls([fetch("g1", "/page", json!({}))]),
            Turn::text("denied"),
        ]),
    );
    let (out, _) = print_frames(
        &ws,
        &stub,
        &["--allow", "WebFetch(domain:127.0.0.1)", "fetch"],
    );
    assert_eq!(out.code, Some(0), "{out:?}");
    let (failed, page) = tool_result(&stub, "f1");
    assert!(!failed, "{page}");
    assert!(
        page.starts_with(&format!("→ WebFetch {site}/page (200, text/html, ")),
        "{page}"
    );
    assert!(page.contains("Looking for: the version"), "{page}");
    assert!(
        page.ends_with("# Fixture\n\n# Release notes\n\nVersion 4.2 & more.\n\n[docs](/docs)"),
        "{page}"
    );
    let (failed, moved) = tool_result(&stub, "f2");
    assert!(
        !failed && moved.contains("/page (200") && moved.contains("Release notes"),
        "{moved}"
    );
    let (failed, away) = tool_result(&stub, "f3");
    assert!(!failed, "{away}");
    assert!(
        away.contains("to another site: http://elsewhere.invalid/x"),
        "{away}"
    );
    let (failed, missing) = tool_result(&stub, "f4");
    assert!(
        failed && missing.contains("(404, text/plain") && missing.ends_with("no such page"),
        "{missing}"
    );
    let (failed, slow) = tool_result(&stub, "f5");
    assert!(
        failed && slow.contains("no complete answer") && slow.contains("within 1 s"),
        "{slow}"
    );

    // Print mode asks nobody: without a rule the fetch is denied, with a hint.
    let (out, _) = print_frames(&ws, &stub, &["fetch"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let (failed, denied) = tool_result(&stub, "g1");
    assert!(failed, "{denied}");
    assert!(
        denied.contains("--allow 'WebFetch(http://127.0.0.1"),
        "{denied}"
    );
}

// ---- 3. plans -----------------------------------------------------------------------------

fn plan_turns(runs: usize) -> Value {
    let todos = json!([
        {"id": "1", "content": "Read the failing test", "status": "completed"},
        {"id": "2", "content": "Fix the parser", "status": "in_progress"},
        {"id": "3", "content": "Rewrite everything", "status": "cancelled"},
    ]);
    let mut turns = Vec::new();
    for _ in 0..runs {
        turns.push(Turn::calls([Call::new(
            "t1",
            "TodoWrite",
            json!({"todos": todos}),
        )]));
        turns.push(Turn::text("planned"));
    }
    script(turns)
}

/// The PlanUpdate of `t1` among a run's events, after the call's start and before its end.
fn assert_plan_event(events: &[Value]) {
    let at = |ty: &str| {
        events
            .iter()
            .position(|e| e["type"] == ty)
            .unwrap_or_else(|| panic!("no {ty} in {events:?}"))
    };
    let plan = &events[at("PlanUpdate")];
    assert!(at("ToolCallStart") < at("PlanUpdate") && at("PlanUpdate") < at("ToolCallEnd"));
    assert_eq!(plan["tool_use_id"], "t1");
    assert_eq!(plan["turn_index"], 0);
    assert_eq!(plan["todos"].as_array().map(Vec::len), Some(3), "{plan}");
    assert_eq!(
        plan["todos"][1],
        json!({"id": "2", "content": "Fix the parser", "status": "in_progress"})
    );
}

#[test]
fn todo_write_plans_show_on_every_surface() {
    let ws = Workspace::new("plans");
    let stub = Stub::start(&ws, &plan_turns(5));

    // Print mode: a system/plan frame between the call's tool_use and tool_result.
    let (out, frames) = print_frames(&ws, &stub, &["plan it"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let kinds: Vec<String> = frames
        .iter()
        .map(|f| {
            format!(
                "{}/{}",
                f["type"].as_str().unwrap(),
                f["subtype"].as_str().unwrap_or("")
            )
        })
        .collect();
    assert_eq!(
        kinds[..4],
        ["system/init", "tool_use/", "system/plan", "tool_result/"],
        "{out:?}"
    );
    assert_eq!(frames[2]["tool_use_id"], "t1");
    assert_eq!(frames[2]["todos"][2]["status"], "cancelled");
    let (failed, result) = tool_result(&stub, "t1");
    assert!(
        !failed && result.starts_with("Plan updated: 3 items"),
        "{result}"
    );

    // HTTP and MCP: the PlanUpdate event in the run's log.
    let serve = Serve::start(&ws, &stub, &[], &[]);
    let run = http_post(&serve, "/runs", &json!({"prompt": "plan it"}))["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_plan_event(&http_events(&serve, &run));
    drop(serve);
    let mut mcp = mcp_serve(&ws, &stub, &[]);
    let body = mcp.tool_body(1, "caliban_run", json!({"prompt": "plan it"}));
    assert_plan_event(&mcp_events(&mut mcp, 2, body["run_id"].as_str().unwrap()));
    drop(mcp);

    // ACP: a `plan` update (cancelled items left out), live and on session/load.
    let mut acp = acp_serve(&ws, &stub, &[]);
    let cwd = path_str(&ws.root);
    let session = acp.request(1, "session/new", json!({"cwd": cwd, "mcpServers": []}));
    let sid = session["result"]["sessionId"].clone();
    let done = acp.request(
        2,
        "session/prompt",
        json!({"sessionId": sid, "prompt": [{"type": "text", "text": "plan it"}]}),
    );
    assert_eq!(done["result"]["stopReason"], "end_turn", "{done}");
    let want = json!({"sessionUpdate": "plan", "entries": [
        {"content": "Read the failing test", "priority": "medium", "status": "completed"},
        {"content": "Fix the parser", "priority": "medium", "status": "in_progress"},
    ]});
    assert_eq!(acp_updates(&acp, "plan"), std::slice::from_ref(&want));
    drop(acp);
    let mut acp = acp_serve(&ws, &stub, &[]);
    let loaded = acp.request(
        1,
        "session/load",
        json!({"sessionId": sid, "cwd": cwd, "mcpServers": []}),
    );
    assert!(loaded.get("result").is_some(), "{loaded}");
    assert_eq!(acp_updates(&acp, "plan"), [want]);
}

// ---- 7. print-mode sessions that continue -------------------------------------------------

/// The user and assistant texts of the `n`th model request, in order.
fn conversation_sent(stub: &Stub, n: usize) -> Vec<String> {
    let requests = stub.requests();
    requests[n]["body"]["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .map(|m| {
            let text = match &m["content"] {
                Value::String(text) => text.clone(),
                blocks => blocks
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|b| b["text"].as_str())
                    .collect::<Vec<_>>()
                    .join(""),
            };
            format!("{}: {text}", m["role"].as_str().unwrap_or("?"))
        })
        .collect()
}

#[test]
fn print_runs_are_recorded_and_continue() {
    let ws = Workspace::new("continue");
    let stub = Stub::start(
        &ws,
        &script([
            Turn::text("Noted: 7."),
            Turn::text("It was 7."),
            Turn::text("Still 7."),
            Turn::text("From run-1 only."),
            Turn::text("Second line seen."),
            Turn::text("Both lines seen."),
        ]),
    );
    let first = run_stub(
        &ws,
        &stub,
        &["-p", "--output-format", "json", "remember 7"],
        "",
    );
    assert_eq!(first.code, Some(0), "{first:?}");
    let session = first.result()["session_id"].as_str().unwrap().to_owned();
    let file = ws.read("home/.state/caliban/sessions/run-1.jsonl");
    let header: Value = serde_json::from_str(file.lines().next().unwrap()).unwrap();
    assert_eq!(
        (
            header["surface"].clone(),
            header["session_id"].clone(),
            header["prompt"].clone()
        ),
        (json!("print"), json!(session), json!("remember 7"))
    );

    // --continue: the latest print run in this workspace, keeping its session id.
    let second = run_stub(
        &ws,
        &stub,
        &[
            "-p",
            "--output-format",
            "json",
            "--continue",
            "which number?",
        ],
        "",
    );
    assert_eq!(second.code, Some(0), "{second:?}");
    assert_eq!(second.result()["session_id"], json!(session));
    assert_eq!(
        conversation_sent(&stub, 1),
        [
            "user: remember 7",
            "assistant: Noted: 7.",
            "user: which number?"
        ]
    );

    // --resume SESSION: the newest run of that session, its whole chain.
    let third = run_stub(&ws, &stub, &["-p", "--resume", &session, "and now?"], "");
    assert_eq!(
        (third.code, third.stdout.as_str()),
        (Some(0), "Still 7.\n"),
        "{third:?}"
    );
    assert_eq!(conversation_sent(&stub, 2).len(), 5);

    // --resume run-1: that run's conversation only.
    let cmd = caliban_stub(&ws, &stub, &["-p", "-r", "run-1", "fork"]);
    assert_eq!(run(cmd, "").code, Some(0));
    assert_eq!(
        conversation_sent(&stub, 3),
        ["user: remember 7", "assistant: Noted: 7.", "user: fork"]
    );

    // stream-json input: every line is recorded, and continues.
    let out = run_stub(
        &ws,
        &stub,
        &[
            "-p",
            "--input-format",
            "stream-json",
            "--output-format",
            "stream-json",
        ],
        "{\"type\":\"user\",\"content\":\"line one\"}\n",
    );
    assert_eq!(out.code, Some(0), "{out:?}");
    let cmd = caliban_stub(&ws, &stub, &["-p", "-c", "line two"]);
    assert_eq!(run(cmd, "").code, Some(0));
    assert_eq!(
        conversation_sent(&stub, 5),
        [
            "user: line one",
            "assistant: Second line seen.",
            "user: line two"
        ]
    );

    // A print run is a run like any other for the drive surfaces.
    let serve = Serve::start(&ws, &stub, &[], &[]);
    let events = http_events(&serve, "run-1");
    assert_eq!(events.last().unwrap()["type"], "RunEnd");

    // Nothing to continue, or an unknown id: a configuration error naming it.
    for args in [
        vec!["--resume", "no-such-session"],
        vec!["--resume", "run-99"],
    ] {
        let out = run_stub(&ws, &stub, &[&["-p"], &args[..], &["hi"]].concat(), "");
        assert_eq!(out.code, Some(78), "{out:?}");
        assert!(out.stderr.contains(args[1]), "{out:?}");
    }
    let empty = Workspace::new("continue-none");
    let out = run_stub(&empty, &stub, &["-p", "--continue", "hi"], "");
    assert_eq!(out.code, Some(78), "{out:?}");
    assert!(
        out.stderr.contains("no earlier print-mode session"),
        "{out:?}"
    );
    let mut cmd = caliban(&empty);
    cmd.args(["mcp", "serve", "--continue"]);
    assert_eq!(run(cmd, "").code, Some(64));
}

/// A compaction and the print-mode sessions that continue (issues 14.2, 14.3, 14.7
/// together): a run that compacts is recorded with its compaction, so `--continue` goes on
/// from the summary; the plan the summarised conversation held is carried over word for
/// word, through a second compaction; and a compaction asked for before any message of a
/// continued run (`control/compact` first) is recorded too.
#[test]
fn compacted_print_runs_continue_from_the_summary_with_their_plan() {
    let ws = Workspace::new("continue-compacted");
    let plan = json!({"todos": [
        {"id": "1", "content": "read the code", "status": "completed"},
        {"id": "2", "content": "fix the bug", "status": "in_progress"}]});
    let stub = Stub::start(
        &ws,
        &script([
            Turn::calls([Call::new("p1", "TodoWrite", plan)]),
            Turn::text("planned"),
            Turn::text("SUMMARY-P"),
            Turn::text("continuing"),
            Turn::text("SUMMARY-Q"),
            Turn::text("ok"),
            Turn::text("fine"),
        ]),
    );
    let compact = r#"{"type":"control","subtype":"compact"}"#;
    let user = |text: &str| format!("{{\"type\":\"user\",\"content\":\"{text}\"}}\n");
    let print = |args: &[&str], input: &str| {
        let out = run_stub(&ws, &stub, &[&["-p"], args].concat(), input);
        assert_eq!(out.code, Some(0), "{out:?}");
        out
    };
    let stream = [
        "--input-format",
        "stream-json",
        "--output-format",
        "stream-json",
    ];
    let first = print(&stream, &format!("{}{compact}\n", user("plan it")));
    let frames = first.frames();
    assert!(frames.iter().any(|f| f["subtype"] == "plan"), "{first:?}");
    assert!(
        frames.iter().any(|f| f["subtype"] == "compact_boundary"),
        "{first:?}"
    );

    // --continue: the summary and the plan, not what they replaced.
    print(&["--continue", "go on"], "");
    let sent = conversation_sent(&stub, 3);
    assert_eq!(sent.len(), 3, "{sent:?}");
    assert!(
        sent[0].contains("SUMMARY-P") && sent[0].contains("fix the bug"),
        "{sent:?}"
    );
    assert_eq!(sent[2], "user: go on");
    assert!(!sent.concat().contains("plan it"), "{sent:?}");

    // A compaction first, then a message: recorded, and the plan carried again.
    let third = print(
        &[&stream[..], &["--continue"]].concat(),
        &format!("{compact}\n{}", user("after")),
    );
    assert!(
        third
            .frames()
            .iter()
            .any(|f| f["subtype"] == "compact_boundary"),
        "{third:?}"
    );
    let sent = conversation_sent(&stub, 5);
    assert!(
        sent[0].contains("SUMMARY-Q") && sent[0].contains("fix the bug"),
        "{sent:?}"
    );
    assert_eq!(sent.last().unwrap(), "user: after");
    assert!(!sent.concat().contains("SUMMARY-P"), "{sent:?}");

    print(&["-c", "last"], "");
    let sent = conversation_sent(&stub, 6);
    assert!(sent[0].contains("SUMMARY-Q"), "{sent:?}");
    assert!(!sent.concat().contains("SUMMARY-P"), "{sent:?}");
    assert_eq!(
        sent[sent.len() - 3..],
        ["user: after", "assistant: ok", "user: last"]
    );
}

/// An editor that offers its file system gets MultiEdit's read and write, as for Edit: the
/// edits apply to its buffer (unsaved changes included), all at once.
#[test]
fn acp_multi_edit_goes_through_the_editors_buffer() {
    let ws = Workspace::new("acp-multiedit");
    ws.write("a.rs", "on disk\n");
    let stub = Stub::start(
        &ws,
        &script([
            Turn::calls([Call::new(
                "m1",
                "MultiEdit",
                json!({"path": "a.rs", "edits": [
                    {"old_string": "one", "new_string": "uno"},
                    {"old_string": "two", "new_string": "dos"},
                ]}),
            )]),
            Turn::text("edited"),
        ]),
    );
    let cmd = caliban_stub(&ws, &stub, &["acp", "serve", "--allow", "MultiEdit"]);
    let mut acp = Peer::spawn(cmd, RECV);
    let init = acp.request(
        0,
        "initialize",
        json!({"protocolVersion": 1, "clientCapabilities":
               {"fs": {"readTextFile": true, "writeTextFile": true}}}),
    );
    assert_eq!(init["result"]["protocolVersion"], 1, "{init}");
    let session = acp.request(
        1,
        "session/new",
        json!({"cwd": path_str(&ws.root), "mcpServers": []}),
    );
    let sid = session["result"]["sessionId"].clone();
    acp.send(
        json!({"jsonrpc": "2.0", "id": 2, "method": "session/prompt",
                    "params": {"sessionId": sid, "prompt": [{"type": "text", "text": "edit"}]}}),
    );
    let mut written = None;
    acp.response_answering(2, |message| match message["method"].as_str() {
        Some("fs/read_text_file") => Some(json!({"content": "one, two\n"})),
        Some("fs/write_text_file") => {
            written = Some(message["params"]["content"].clone());
            Some(Value::Null)
        }
        _ => None,
    });
    assert_eq!(written, Some(json!("uno, dos\n")));
    assert_eq!(
        ws.read("a.rs"),
        "on disk\n",
        "the editor wrote it, not caliban"
    );
    let (failed, text) = tool_result(&stub, "m1");
    assert!(
        !failed && text.starts_with("→ MultiEdit a.rs: 2 edits applied"),
        "{text}"
    );
}
