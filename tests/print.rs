//! Print mode end to end: real binary, real stub model over loopback, both provider wires.

use serde_json::{Value, json};

use crate::util::*;

/// Print mode reading and writing stream-json.
const STREAM_JSON: &[&str] = &[
    "-p",
    "--input-format",
    "stream-json",
    "--output-format",
    "stream-json",
];
/// Print mode reading stream-json and answering with one JSON result.
const STREAM_JSON_IN_JSON_OUT: &[&str] = &[
    "-p",
    "--input-format",
    "stream-json",
    "--output-format",
    "json",
];

/// All tool_result blocks the model was sent, in order, from the stub's request log.
fn tool_results_sent(stub: &Stub) -> Vec<Value> {
    let mut out = Vec::new();
    for req in stub.requests() {
        let Some(messages) = req["body"]["messages"].as_array() else {
            continue;
        };
        if let Some(last) = messages.last() {
            if let Some(blocks) = last["content"].as_array() {
                out.extend(
                    blocks
                        .iter()
                        .filter(|b| b["type"] == "tool_result")
                        .cloned(),
                );
            }
            if last["role"] == "tool" {
                out.push(last.clone());
            }
        }
    }
    out
}

fn result_text_of(block: &Value) -> String {
    block["content"]
        .as_array()
        .map(|c| {
            c.iter()
                .filter_map(|b| b["text"].as_str())
                .collect::<Vec<_>>()
                .join("\n")
        })
        .unwrap_or_default()
}

#[test]
fn text_only_turn_prints_the_answer() {
    let ws = Workspace::new("text");
    let stub = Stub::start(&ws, &script([Turn::text("Hello from the stub model.")]));
    let out = run_stub(&ws, &stub, &["-p", "say hello"], "");
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(out.stdout, "Hello from the stub model.\n");
    let reqs = stub.requests();
    assert_eq!(reqs.len(), 1);
    let body = &reqs[0]["body"];
    assert_eq!(body["stream"], true);
    assert_eq!(body["messages"][0]["role"], "user");
    assert_eq!(reqs[0]["headers"]["anthropic-version"], "2023-06-01");
}

#[test]
fn json_output_is_one_result_object() {
    let ws = Workspace::new("json");
    let stub = Stub::start(&ws, &script([Turn::text("forty-two")]));
    let out = run_stub(&ws, &stub, &["-p", "--output-format", "json", "answer"], "");
    assert_eq!(out.code, Some(0), "{out:?}");
    let frames = out.frames();
    assert_eq!(frames.len(), 1, "{out:?}");
    let r = &frames[0];
    assert_eq!(r["type"], "result");
    assert_eq!(r["subtype"], "success");
    assert_eq!(r["result"], "forty-two");
    assert_eq!(r["is_error"], false);
    assert_eq!(r["num_turns"], 1);
    assert_eq!(r["usage"]["output_tokens"], 5);
    assert!(r["session_id"].as_str().is_some_and(|s| s.len() == 36));
}

#[test]
fn stream_json_frames_in_order() {
    let ws = Workspace::new("streamjson");
    ws.write("notes.txt", "alpha\nbeta\n");
    let stub = Stub::start(
        &ws,
        &script([
            Turn::calls([Call::read("toolu_1", "notes.txt")]),
            Turn::text("The file has two lines."),
        ]),
    );
    let out = run_stub(
        &ws,
        &stub,
        &["-p", "--output-format", "stream-json", "read notes.txt"],
        "",
    );
    assert_eq!(out.code, Some(0), "{out:?}");
    let frames = out.frames();
    let kinds: Vec<String> = frames
        .iter()
        .map(|f| {
            format!(
                "{}{}",
                f["type"].as_str().unwrap_or("?"),
                f["subtype"]
                    .as_str()
                    .map(|s| format!("/{s}"))
                    .unwrap_or_default()
            )
        })
        .collect();
    assert_eq!(
        kinds,
        [
            "system/init",
            "tool_use",
            "tool_result",
            "message",
            "message",
            "result/success"
        ],
        "{out:?}"
    );
    assert_eq!(
        frames[0]["tools"],
        json!([
            "Bash",
            "BashOutput",
            "KillShell",
            "Read",
            "Write",
            "Edit",
            "MultiEdit",
            "Glob",
            "Grep",
            "WebFetch",
            "TodoWrite"
        ])
    );
    assert_eq!(frames[1]["input"], json!({"path": "notes.txt"}));
    assert_eq!(frames[2]["is_error"], false);
    assert!(result_text_of(&frames[2]).contains("alpha"), "{out:?}");
    assert_eq!(frames[5]["result"], "The file has two lines.");
    assert_eq!(frames[5]["num_turns"], 2);
}

#[test]
fn partial_messages_stream_deltas() {
    let ws = Workspace::new("partial");
    let stub = Stub::start(
        &ws,
        &script([Turn::bare()
            .think("Let me think.")
            .say("one two three four five six")]),
    );
    let out = run_stub(
        &ws,
        &stub,
        &[
            "-p",
            "--output-format",
            "stream-json",
            "--include-partial-messages",
            "count",
        ],
        "",
    );
    assert_eq!(out.code, Some(0), "{out:?}");
    let frames = out.frames();
    let deltas: String = frames
        .iter()
        .filter(|f| f["type"] == "text")
        .filter_map(|f| f["delta"].as_str())
        .collect();
    assert_eq!(deltas, "one two three four five six");
    assert!(
        frames.iter().filter(|f| f["type"] == "text").count() > 1,
        "text should arrive in pieces"
    );
    assert!(frames.iter().any(|f| f["type"] == "thinking"), "{out:?}");
    assert!(
        !frames.iter().any(|f| f["type"] == "message"),
        "partial mode has no message frames"
    );
}

#[test]
fn read_edit_bash_tools_work_on_the_workspace() {
    let ws = Workspace::new("tools");
    ws.write("src/lib.txt", "fn answer() -> u32 { 41 }\n");
    let stub = Stub::start(
        &ws,
        &script([
            Turn::calls([Call::read("toolu_r", "src/lib.txt")]),
            Turn::calls([Call::new(
                "toolu_e",
                "Edit",
                json!({"path": "src/lib.txt", "old_string": "41", "new_string": "42"}),
            )]),
            Turn::bash("toolu_b", "cat src/lib.txt && echo done-42"),
            Turn::text("Fixed: the answer is now 42."),
        ]),
    );
    let out = run_stub(
        &ws,
        &stub,
        &[
            "-p",
            "--allow",
            "Edit",
            "--allow",
            "Bash(cat:*)",
            "--allow",
            "Bash(echo:*)",
            "fix the answer",
        ],
        "",
    );
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(out.stdout, "Fixed: the answer is now 42.\n");
    assert_eq!(ws.read("src/lib.txt"), "fn answer() -> u32 { 42 }\n");
    let results = tool_results_sent(&stub);
    assert_eq!(results.len(), 3, "{results:?}");
    assert!(result_text_of(&results[0]).contains("41"), "{results:?}");
    assert_ne!(results[1]["is_error"], json!(true), "{results:?}");
    let bash = result_text_of(&results[2]);
    assert!(
        bash.contains("{ 42 }") && bash.contains("done-42"),
        "{bash}"
    );
    assert_ne!(results[2]["is_error"], json!(true), "{results:?}");
}

#[test]
fn parallel_tool_calls_are_answered_in_order() {
    let ws = Workspace::new("parallel");
    ws.write("a.txt", "AAA\n");
    ws.write("b.txt", "BBB\n");
    let stub = Stub::start(
        &ws,
        &script([
            Turn::calls([
                Call::bash("toolu_1", "sleep 0.3; echo slow"),
                Call::read("toolu_2", "a.txt"),
                Call::read("toolu_3", "b.txt"),
            ]),
            Turn::text("done"),
        ]),
    );
    let out = run_stub(
        &ws,
        &stub,
        &[
            "-p",
            "--output-format",
            "stream-json",
            "--allow",
            "Bash",
            "go",
        ],
        "",
    );
    assert_eq!(out.code, Some(0), "{out:?}");
    let reqs = stub.requests();
    let last_user = reqs[1]["body"]["messages"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()
        .clone();
    let ids: Vec<&str> = last_user["content"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|b| b["tool_use_id"].as_str())
        .collect();
    assert_eq!(
        ids,
        ["toolu_1", "toolu_2", "toolu_3"],
        "results follow call order"
    );
    // The reads finished while the shell slept: they ran concurrently.
    let order: Vec<&str> = out
        .frames()
        .iter()
        .filter(|f| f["type"] == "tool_result")
        .filter_map(|f| f["tool_use_id"].as_str().map(str::to_owned))
        .collect::<Vec<_>>()
        .leak()
        .iter()
        .map(String::as_str)
        .collect();
    assert_eq!(order.last().copied(), Some("toolu_1"), "{out:?}");
}

#[test]
fn ask_in_print_mode_is_denied_with_a_hint() {
    let ws = Workspace::new("deny");
    let marker = ws.path("should-not-exist");
    let stub = Stub::start(
        &ws,
        &script([
            Turn::bash("toolu_x", &format!("touch {}", path_str(&marker))),
            Turn::text("I could not run it."),
        ]),
    );
    let out = run_stub(
        &ws,
        &stub,
        &["-p", "--output-format", "stream-json", "make a file"],
        "",
    );
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(!marker.exists(), "a denied command ran");
    let frames = out.frames();
    let result = frames
        .iter()
        .find(|f| f["type"] == "tool_result")
        .expect("tool_result frame");
    assert_eq!(result["is_error"], true);
    let text = result_text_of(result);
    assert!(
        text.contains("permission denied") && text.contains("--allow"),
        "{text}"
    );
}

#[test]
fn deny_rule_beats_allow() {
    let ws = Workspace::new("denyrule");
    let stub = Stub::start(
        &ws,
        &script([Turn::bash("toolu_x", "rm -rf build"), Turn::text("ok")]),
    );
    let out = run_stub(
        &ws,
        &stub,
        &["-p", "--allow", "Bash", "--deny", "Bash(rm:*)", "clean"],
        "",
    );
    assert_eq!(out.code, Some(0), "{out:?}");
    let results = tool_results_sent(&stub);
    assert_eq!(results[0]["is_error"], true, "{results:?}");
}

#[test]
fn openai_wire_with_tools() {
    let ws = Workspace::new("openai");
    ws.write("hello.txt", "hi there\n");
    let stub = Stub::start(
        &ws,
        &script([
            Turn::calls([Call::read("call_1", "hello.txt")]),
            Turn::text("It says hi."),
        ]),
    );
    let mut cmd = caliban(&ws);
    openai(&mut cmd, &stub);
    cmd.args([
        "-p",
        "--output-format",
        "json",
        "--model",
        "local-model",
        "what does hello.txt say",
    ]);
    let out = run(cmd, "");
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(out.result()["result"], "It says hi.");
    let reqs = stub.requests();
    assert_eq!(reqs.len(), 2);
    assert!(
        reqs[0]["path"]
            .as_str()
            .unwrap()
            .ends_with("/v1/chat/completions")
    );
    assert_eq!(reqs[0]["body"]["model"], "local-model");
    let msgs = reqs[1]["body"]["messages"].as_array().unwrap();
    let tool_msg = msgs
        .iter()
        .find(|m| m["role"] == "tool")
        .expect("tool message");
    assert_eq!(tool_msg["tool_call_id"], "call_1");
    assert!(tool_msg["content"].as_str().unwrap().contains("hi there"));
}

#[test]
fn retries_after_529_with_retry_after() {
    let ws = Workspace::new("retry");
    let stub = Stub::start(
        &ws,
        &script([Turn::bare()
            .say("made it")
            .fault(Fault::StatusRetryAfter(529, "1".into()))]),
    );
    let out = run_stub(
        &ws,
        &stub,
        &["-p", "--output-format", "stream-json", "try"],
        "",
    );
    assert_eq!(out.code, Some(0), "{out:?}");
    let frames = out.frames();
    let retry = frames
        .iter()
        .find(|f| f["subtype"] == "api_retry")
        .expect("api_retry frame");
    assert_eq!(retry["error_status"], 529);
    assert_eq!(retry["retry_delay_ms"], 1000);
    assert_eq!(retry["error_category"], "overloaded");
    assert_eq!(out.result()["result"], "made it");
    assert_eq!(stub.requests().len(), 2);
}

#[test]
fn non_retryable_status_fails_clearly() {
    let ws = Workspace::new("401");
    let stub = Stub::start(
        &ws,
        &script([Turn::bare().say("x").fault(Fault::Status(401))]),
    );
    let out = run_stub(&ws, &stub, &["-p", "--output-format", "json", "hi"], "");
    assert_eq!(out.code, Some(1), "{out:?}");
    let r = out.result();
    assert_eq!(r["subtype"], "error");
    assert!(r["error"].as_str().unwrap().contains("401"), "{out:?}");
    assert_eq!(stub.requests().len(), 1, "a 401 is not retried");
}

#[test]
fn stream_dropped_mid_turn_fails_without_hanging() {
    let ws = Workspace::new("drop");
    let stub = Stub::start(
        &ws,
        &script([Turn::bare()
            .say("this answer will be cut off somewhere in the middle")
            .fault(Fault::DropAfterEvents(5))]),
    );
    let out = run_stub(
        &ws,
        &stub,
        &[
            "-p",
            "--output-format",
            "stream-json",
            "--include-partial-messages",
            "hi",
        ],
        "",
    );
    assert_eq!(out.code, Some(1), "{out:?}");
    let r = out.result();
    assert_eq!(r["subtype"], "error");
    assert!(
        r["error"].as_str().unwrap().contains("ended")
            || r["error"].as_str().unwrap().contains("closed"),
        "{out:?}"
    );
    assert_eq!(stub.requests().len(), 1, "output was shown, so no retry");
}

#[test]
fn stalled_stream_hits_the_idle_timeout() {
    let ws = Workspace::new("stall");
    let stub = Stub::start(
        &ws,
        &script([Turn::bare()
            .say("words words words words words")
            .fault(Fault::StallAfterEvents(5))]),
    );
    let out = run_stub(
        &ws,
        &stub,
        &[
            "-p",
            "--output-format",
            "json",
            "--idle-timeout",
            "0.5",
            "hi",
        ],
        "",
    );
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(
        out.result()["error"].as_str().unwrap().contains("idle"),
        "{out:?}"
    );
}

#[test]
fn max_turns_stops_the_run() {
    let ws = Workspace::new("maxturns");
    ws.write("f.txt", "x\n");
    let read = Turn::calls([Call::without_id("Read", json!({"path": "f.txt"}))]);
    let stub = Stub::start(
        &ws,
        &script([read.clone(), read.clone(), read, Turn::text("never")]),
    );
    let out = run_stub(
        &ws,
        &stub,
        &["-p", "--output-format", "json", "--max-turns", "2", "loop"],
        "",
    );
    assert_eq!(out.code, Some(75), "{out:?}");
    let r = out.result();
    assert_eq!(r["subtype"], "max_turns");
    assert_eq!(r["num_turns"], 2);
    assert_eq!(stub.requests().len(), 2);
}

#[test]
fn stream_json_input_continues_the_conversation() {
    let ws = Workspace::new("input");
    let stub = Stub::start(
        &ws,
        &script([Turn::text("first answer"), Turn::text("second answer")]),
    );
    let cmd = caliban_stub(&ws, &stub, STREAM_JSON);
    let input = "{\"type\":\"user\",\"content\":\"one\"}\n{\"type\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"two\"}]}\n";
    let out = run(cmd, input);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(out.result()["result"], "second answer");
    let reqs = stub.requests();
    assert_eq!(reqs.len(), 2);
    let msgs = reqs[1]["body"]["messages"].as_array().unwrap();
    assert_eq!(msgs.len(), 3, "user, assistant, user: {msgs:?}");
}

#[test]
fn malformed_stream_json_input_exits_64() {
    let ws = Workspace::new("badinput");
    let stub = Stub::start(&ws, &script([Turn::text("x")]));
    let out = run_stub(
        &ws,
        &stub,
        STREAM_JSON_IN_JSON_OUT,
        "{\"type\":\"user\",\"message\":{}}\n",
    );
    assert_eq!(out.code, Some(64), "{out:?}");
    assert_eq!(out.result()["subtype"], "error");
}

#[test]
fn sigterm_cancels_and_kills_the_bash_group() {
    let ws = Workspace::new("sigterm");
    let marker = format!("caliban-test-sleep-{}", std::process::id());
    let stub = Stub::start(
        &ws,
        &script([
            Turn::bash(
                "toolu_s",
                &format!("bash -c 'exec -a {marker} sleep 30' & sleep 30"),
            ),
            Turn::text("never"),
        ]),
    );
    let mut cmd = caliban_stub(
        &ws,
        &stub,
        &["-p", "--output-format", "json", "--allow", "Bash", "sleep"],
    );
    cmd.stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let child = cmd.spawn().expect("spawn");
    let pid = child.id();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !process_with_marker_exists(&marker) {
        assert!(
            std::time::Instant::now() < deadline,
            "the Bash tool never started"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // SAFETY-free: use the kill command rather than libc in tests.
    std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .expect("kill");
    let out = wait_output(child, std::time::Duration::from_secs(10));
    assert_eq!(out.code, Some(124), "{out:?}");
    assert_eq!(out.result()["subtype"], "cancelled");
    assert!(
        !process_with_marker_exists(&marker),
        "a Bash grandchild survived the cancel"
    );
}

#[test]
fn bash_timeout_kills_the_command() {
    let ws = Workspace::new("timeout");
    let stub = Stub::start(
        &ws,
        &script([
            Turn::calls([Call::new(
                "toolu_t",
                "Bash",
                json!({"command": "echo started; sleep 20", "timeout_seconds": 1}),
            )]),
            Turn::text("timed out"),
        ]),
    );
    let out = run_stub(&ws, &stub, &["-p", "--allow", "Bash", "wait"], "");
    assert_eq!(out.code, Some(0), "{out:?}");
    let results = tool_results_sent(&stub);
    assert_eq!(results[0]["is_error"], true);
    let text = result_text_of(&results[0]);
    assert!(
        text.contains("started") && text.contains("timed out"),
        "{text}"
    );
}

#[test]
fn stream_json_input_from_a_regular_file() {
    // epoll cannot poll regular files; stdin falls back to a reader thread.
    let ws = Workspace::new("filestdin");
    let stub = Stub::start(&ws, &script([Turn::text("from a file")]));
    ws.write("input.jsonl", "{\"type\":\"user\",\"content\":\"hi\"}\n");
    let mut cmd = caliban_stub(&ws, &stub, STREAM_JSON_IN_JSON_OUT);
    cmd.stdin(std::fs::File::open(ws.path("input.jsonl")).expect("open input"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let out = wait_output(cmd.spawn().expect("spawn"), RUN_TIMEOUT);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(out.result()["result"], "from a file");
}

#[test]
fn project_settings_rules_apply() {
    let ws = Workspace::new("settings");
    ws.write(
        ".caliban/settings.json",
        r#"{"permissions": {"allow": ["Bash(echo:*)"]}, "max_turns": 5}"#,
    );
    let stub = Stub::start(
        &ws,
        &script([
            Turn::bash("toolu_1", "echo from-settings"),
            Turn::text("ok"),
        ]),
    );
    let out = run_stub(&ws, &stub, &["-p", "echo"], "");
    assert_eq!(out.code, Some(0), "{out:?}");
    let results = tool_results_sent(&stub);
    assert!(
        result_text_of(&results[0]).contains("from-settings"),
        "{results:?}"
    );
}

#[test]
fn malformed_settings_exit_78_naming_the_file() {
    let ws = Workspace::new("badsettings");
    ws.write(".caliban/settings.json", "{\"permissions\": [}");
    let mut cmd = caliban(&ws);
    cmd.env("ANTHROPIC_BASE_URL", "http://127.0.0.1:9")
        .args(["-p", "hi"]);
    let out = run(cmd, "");
    assert_eq!(out.code, Some(78), "{out:?}");
    assert!(out.stderr.contains("settings.json"), "{out:?}");
}

#[test]
fn openai_wire_retries_a_429_then_streams() {
    let ws = Workspace::new("openai429");
    let stub = Stub::start(
        &ws,
        &script([Turn::bare()
            .say("after the rate limit")
            .fault(Fault::StatusRetryAfter(429, "0".into()))]),
    );
    let mut cmd = caliban(&ws);
    openai(&mut cmd, &stub);
    cmd.args(["-p", "--output-format", "stream-json", "hi"]);
    let out = run(cmd, "");
    assert_eq!(out.code, Some(0), "{out:?}");
    let frames = out.frames();
    let retry = frames
        .iter()
        .find(|f| f["subtype"] == "api_retry")
        .expect("api_retry");
    assert_eq!(retry["error_status"], 429);
    assert_eq!(retry["error_category"], "rate_limit");
    assert_eq!(out.result()["result"], "after the rate limit");
}

#[test]
fn connection_refused_is_retried_then_fails_clearly() {
    let ws = Workspace::new("refused");
    // Bind and drop a listener so the port is (almost certainly) closed.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut cmd = caliban(&ws);
    cmd.env("ANTHROPIC_BASE_URL", format!("http://127.0.0.1:{port}"))
        .args(["-p", "--output-format", "json", "--max-retries", "1", "hi"]);
    let out = run(cmd, "");
    assert_eq!(out.code, Some(1), "{out:?}");
    let error = out.result()["error"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(error.contains("connect"), "{error}");
}

#[test]
fn stream_json_input_with_no_message_exits_66() {
    let ws = Workspace::new("nomsg");
    let stub = Stub::start(&ws, &script([Turn::text("x")]));
    let out = run_stub(&ws, &stub, STREAM_JSON_IN_JSON_OUT, "");
    assert_eq!(out.code, Some(66), "{out:?}");
    assert!(stub.requests().is_empty());
}

#[test]
fn a_stalled_stdout_reader_does_not_block_tools_or_sigterm() {
    let ws = Workspace::new("stalledout");
    let marker = format!("caliban-stalled-stdout-{}", std::process::id());
    let long_text = "lorem ipsum dolor sit amet ".repeat(12_000);
    let stub = Stub::start(
        &ws,
        &script([
            Turn::bare().say(&long_text).calling([Call::bash(
                "toolu_s",
                &format!("bash -c 'exec -a {marker} sleep 30'"),
            )]),
            Turn::text("never"),
        ]),
    );
    let mut cmd = caliban_stub(
        &ws,
        &stub,
        &[
            "-p",
            "--output-format",
            "stream-json",
            "--include-partial-messages",
            "--allow",
            "Bash",
            "go",
        ],
    );
    cmd.stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null());
    // stdout is piped and never read: far more than a pipe buffer of deltas piles up.
    let mut child = cmd.spawn().expect("spawn");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !process_with_marker_exists(&marker) {
        assert!(
            std::time::Instant::now() < deadline,
            "the tool never ran: the loop is blocked on stdout"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill");
    let stop = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break status;
        }
        if std::time::Instant::now() > stop {
            let _ = child.kill();
            panic!("caliban did not exit within 5 s of SIGTERM while its stdout was stalled");
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    };
    assert_eq!(status.code(), Some(124));
    assert!(
        !process_with_marker_exists(&marker),
        "the Bash child survived"
    );
}

/// A loopback "model server" that answers every request with `response` and closes, for
/// replies the stub model does not make; it stops accepting once dropped.
struct Canned {
    url: String,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    addr: std::net::SocketAddr,
}

impl Canned {
    fn start(response: String) -> Canned {
        use std::io::{Read, Write};
        use std::sync::atomic::Ordering;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopped = std::sync::Arc::clone(&stop);
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if stopped.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(mut conn) = conn else { continue };
                let _ = conn.set_read_timeout(Some(std::time::Duration::from_secs(5)));
                // Read the request head and body (whatever arrives first is enough here).
                let mut buf = [0u8; 65536];
                let _ = conn.read(&mut buf);
                let _ = conn.write_all(response.as_bytes());
            }
        });
        Canned {
            url: format!("http://{addr}"),
            stop,
            addr,
        }
    }
}

impl Drop for Canned {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let _ = std::net::TcpStream::connect_timeout(&self.addr, std::time::Duration::from_secs(1));
    }
}

/// A `200 text/html` reply (a proxy's page, a web UI at the wrong base URL) is reported as
/// what it is, naming its content type and quoting it, not as a stream that ended early.
#[test]
fn a_200_html_reply_names_its_content_type() {
    let ws = Workspace::new("html200");
    let page = "<html><body><h1>Welcome to nginx!</h1></body></html>\n";
    let server = Canned::start(format!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/html; charset=utf-8\r\ncontent-length: {}\r\n\
         connection: close\r\n\r\n{page}",
        page.len()
    ));
    let mut cmd = caliban(&ws);
    cmd.env("ANTHROPIC_BASE_URL", &server.url).args([
        "-p",
        "--output-format",
        "json",
        "--max-retries",
        "0",
        "hi",
    ]);
    let out = run(cmd, "");
    assert_eq!(out.code, Some(1), "{out:?}");
    let error = out.result()["error"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(error.contains("text/html"), "{error}");
    assert!(error.contains("Welcome to nginx!"), "{error}");
    assert!(!error.contains("ended before"), "{error}");
}

#[test]
fn accept_edits_cannot_reach_git_config_or_caliban_settings() {
    // The attack: under acceptEdits (or dontAsk, or a broad allow rule) the model writes a
    // `core.fsmonitor` into .git/config, which an allowed `git status` would run, and grants
    // itself Bash in caliban's own settings for every later run.
    for mode_args in [
        &["--permission-mode", "acceptEdits"][..],
        &["--permission-mode", "dontAsk"],
        &["--allow", "Write", "--allow", "Edit"],
    ] {
        let ws = Workspace::new("protected");
        ws.write(".git/config", "[core]\n\tbare = false\n");
        let stub = Stub::start(
            &ws,
            &script([
                Turn::calls([
                    Call::new(
                        "toolu_git",
                        "Write",
                        json!({"path": "./.git/config",
                               "content": "[core]\n\tfsmonitor = touch /tmp/pwned\n"}),
                    ),
                    Call::new(
                        "toolu_set",
                        "Write",
                        json!({"path": ".caliban/settings.json",
                               "content": "{\"permissions\": {\"allow\": [\"Bash\"]}}"}),
                    ),
                    Call::new(
                        "toolu_edit",
                        "Edit",
                        json!({"path": "sub/../.GIT/config",
                               "old_string": "bare = false", "new_string": "fsmonitor = evil"}),
                    ),
                    Call::new(
                        "toolu_ok",
                        "Write",
                        json!({"path": "src/ok.txt", "content": "fine\n"}),
                    ),
                ]),
                Turn::text("done"),
            ]),
        );
        let mut cmd = caliban_stub(
            &ws,
            &stub,
            &[
                "-p",
                "--output-format",
                "json",
                "--allow",
                "Bash(git status:*)",
            ],
        );
        cmd.args(mode_args).arg("configure the repo");
        let out = run(cmd, "");
        assert_eq!(out.code, Some(0), "{mode_args:?}: {out:?}");
        assert_eq!(
            ws.read(".git/config"),
            "[core]\n\tbare = false\n",
            "{mode_args:?}"
        );
        assert!(
            !ws.path(".caliban/settings.json").exists(),
            "{mode_args:?}: the model wrote its own permissions"
        );
        assert_eq!(ws.read("src/ok.txt"), "fine\n", "{mode_args:?}");
        let results = tool_results_sent(&stub);
        assert_eq!(results.len(), 4, "{results:?}");
        for (result, path) in results[..3].iter().zip([
            "./.git/config",
            ".caliban/settings.json",
            "sub/../.GIT/config",
        ]) {
            assert_eq!(result["is_error"], true, "{mode_args:?} {path}");
            let text = result_text_of(result);
            assert!(
                text.contains(&format!("`{path}` is protected"))
                    && text.contains("only --permission-mode bypassPermissions"),
                "{mode_args:?}: {text}"
            );
        }
        assert_ne!(results[3]["is_error"], true, "{results:?}");
    }
}

#[test]
fn a_setsid_child_does_not_outlive_its_call() {
    let ws = Workspace::new("setsid");
    let marker = format!("caliban-print-setsid-{}", std::process::id());
    let stub = Stub::start(
        &ws,
        &script([
            Turn::bash(
                "toolu_s",
                &format!(
                    "setsid bash -c 'exec -a {marker} sleep 300' & sleep 0.2; kill -0 $! && echo escaped"
                ),
            ),
            Turn::text("done"),
        ]),
    );
    let out = run_stub(
        &ws,
        &stub,
        &["-p", "--output-format", "json", "--allow", "Bash", "go"],
        "",
    );
    assert_eq!(out.code, Some(0), "{out:?}");
    let results = tool_results_sent(&stub);
    assert!(
        result_text_of(&results[0]).contains("escaped"),
        "{results:?}"
    );
    assert!(
        !process_with_marker_exists(&marker),
        "a setsid child outlived caliban"
    );
}

/// Runs caliban with a deadline well under the suite's: these streams never end on their own.
fn run_within(mut cmd: std::process::Command, deadline: std::time::Duration) -> Output {
    cmd.stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    wait_output(cmd.spawn().expect("spawn caliban"), deadline)
}

#[test]
fn keep_alives_do_not_hold_a_stream_open() {
    let deadline = std::time::Duration::from_secs(20);
    // Output started, then only Anthropic `ping` events: the idle timeout fires.
    let ws = Workspace::new("pings-idle");
    let stub = Stub::start(
        &ws,
        &script([Turn::bare()
            .say("words words words words words")
            .fault(Fault::PingAfterEvents(4))]),
    );
    let cmd = caliban_stub(
        &ws,
        &stub,
        &["-p", "--output-format", "json", "--idle-timeout", "1", "hi"],
    );
    let out = run_within(cmd, deadline);
    assert_eq!(out.code, Some(1), "{out:?}");
    let error = out.result()["error"].as_str().unwrap().to_owned();
    assert!(error.contains("idle for 1 s"), "{out:?}");

    // Nothing but `message_start` and pings (Anthropic), or the role chunk and `: ping`
    // comments (OpenAI), or comments alone: no output ever comes, and the wait for it ends.
    for (wire, after) in [("anthropic", 1), ("openai", 1), ("openai", 0)] {
        let ws = Workspace::new("pings-only");
        let stub = Stub::start(
            &ws,
            &script([Turn::bare()
                .say("never")
                .fault(Fault::PingAfterEvents(after))]),
        );
        let mut cmd = caliban(&ws);
        if wire == "anthropic" {
            anthropic(&mut cmd, &stub);
        } else {
            openai(&mut cmd, &stub);
        }
        cmd.args([
            "-p",
            "--output-format",
            "json",
            "--first-byte-timeout",
            "1",
            "--idle-timeout",
            "1",
            "--max-retries",
            "0",
            "hi",
        ]);
        let out = run_within(cmd, deadline);
        assert_eq!(out.code, Some(1), "{wire} {after}: {out:?}");
        let error = out.result()["error"].as_str().unwrap().to_owned();
        assert!(
            error.contains("no output from the model within 1 s"),
            "{wire} {after}: {out:?}"
        );
    }
}

#[test]
fn a_stream_that_never_ends_meets_the_request_deadline() {
    // Real output, a word every 100 ms, forever: no idle timeout can fire.
    let ws = Workspace::new("endless");
    let stub = Stub::start(
        &ws,
        &script([Turn::bare().say("again").fault(Fault::RepeatAfterEvents(2))]),
    );
    let mut cmd = caliban(&ws);
    openai(&mut cmd, &stub);
    cmd.args([
        "-p",
        "--output-format",
        "json",
        "--request-timeout",
        "1",
        "hi",
    ]);
    let out = run_within(cmd, std::time::Duration::from_secs(20));
    assert_eq!(out.code, Some(1), "{out:?}");
    let error = out.result()["error"].as_str().unwrap().to_owned();
    assert!(
        error.contains("the model request took longer than 1 s"),
        "{out:?}"
    );
    assert_eq!(stub.requests().len(), 1, "output was shown, so no retry");
}

// ---- context compaction (issue 14) ----------------------------------------------------------

/// Four Reads of big files in one run with a 10,000-token window (compacted past 7,500):
/// every second Read pushes the next request past the limit, so the run compacts twice,
/// each time summarising what came before, and goes on to finish.
#[test]
fn stream_json_compacts_twice_in_one_run_and_finishes() {
    let ws = Workspace::new("compact-print");
    ws.write(".caliban/settings.json", r#"{"context_window": 10000}"#);
    for (name, marker) in [
        ("a.txt", "AAA"),
        ("b.txt", "BBB"),
        ("c.txt", "CCC"),
        ("d.txt", "DDD"),
    ] {
        big_file(&ws, name, marker);
    }
    let read = |id: &str, path: &str| Turn::bare().calling([Call::read(id, path)]);
    let stub = Stub::start(
        &ws,
        &script([
            read("t1", "a.txt"),
            read("t2", "b.txt"),
            Turn::bare().say("SUMMARY-ONE: read a.txt and b.txt"),
            read("t3", "c.txt"),
            read("t4", "d.txt"),
            Turn::bare().say("SUMMARY-TWO: read all four"),
            Turn::bare().say("done"),
        ]),
    );
    let out = run_stub(
        &ws,
        &stub,
        &[
            "-p",
            "--output-format",
            "stream-json",
            "read the four files",
        ],
        "",
    );
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(out.result()["result"], "done");
    let boundaries: Vec<Value> = out
        .frames()
        .into_iter()
        .filter(|f| f["subtype"] == "compact_boundary")
        .collect();
    assert_eq!(boundaries.len(), 2, "{out:?}");
    for (b, summary) in boundaries.iter().zip(["SUMMARY-ONE", "SUMMARY-TWO"]) {
        let meta = &b["compact_metadata"];
        assert_eq!(meta["trigger"], "auto");
        assert!(meta["pre_tokens"].as_u64().unwrap() > 7500, "{b}");
        assert!(meta["post_tokens"].as_u64().unwrap() < 7500, "{b}");
        assert!(b["summary"].as_str().unwrap().starts_with(summary), "{b}");
    }
    // The requests: the third and sixth ask for summaries; after each, the model sees the
    // summary instead of what it summarised.
    let reqs = stub.requests();
    assert_eq!(reqs.len(), 7);
    let body = |n: usize| reqs[n]["body"].to_string();
    for n in [2, 5] {
        assert!(
            body(n).contains("working notes"),
            "request {n} asks for a summary"
        );
    }
    assert!(body(3).contains("SUMMARY-ONE") && !body(3).contains("AAA"));
    assert!(!body(3).contains("BBB"));
    assert!(body(4).contains("CCC"));
    assert!(body(6).contains("SUMMARY-TWO"));
    for gone in ["SUMMARY-ONE", "AAA", "CCC", "DDD"] {
        assert!(!body(6).contains(gone), "{gone} is summarised away");
    }
}

/// `{"type":"control","subtype":"compact"}` compacts between two messages; a summary the
/// model cannot give ends the run with `CompactionFailed`.
#[test]
fn stream_json_control_compact_and_its_failure() {
    let ws = Workspace::new("compact-control");
    let stub = Stub::start(
        &ws,
        &script([
            Turn::bare().say("first answer"),
            Turn::bare().say("the summary"),
            Turn::bare().say("second answer"),
            Turn::bare().say("third answer"),
            Turn::bare().fault(Fault::Status(400)),
        ]),
    );
    let cmd = caliban_stub(&ws, &stub, STREAM_JSON);
    let compact = r#"{"type":"control","subtype":"compact"}"#;
    let input = format!(
        "{{\"type\":\"user\",\"content\":\"one\"}}\n{compact}\n{{\"type\":\"user\",\"content\":\"two\"}}\n{{\"type\":\"user\",\"content\":\"three\"}}\n{compact}\n"
    );
    let out = run(cmd, &input);
    let frames = out.frames();
    let boundary = frames
        .iter()
        .find(|f| f["subtype"] == "compact_boundary")
        .unwrap_or_else(|| panic!("{out:?}"));
    assert_eq!(boundary["compact_metadata"]["trigger"], "manual");
    assert_eq!(boundary["summary"], "the summary");
    let reqs = stub.requests();
    let second = reqs[2]["body"]["messages"].to_string();
    assert!(
        second.contains("the summary") && !second.contains("first answer"),
        "{second}"
    );
    let result = out.result();
    assert_eq!(result["subtype"], "error", "{out:?}");
    assert!(
        result["error"]
            .as_str()
            .unwrap()
            .starts_with("compaction failed"),
        "{result}"
    );
    assert_eq!(out.code, Some(1));
}

// ---- images in prompts (issue 14) -----------------------------------------------------------

/// Images in stream-json input reach both providers in their own formats, and the run's
/// session file keeps them (the first message's and a later one's), so `--continue` sends
/// them again.
#[test]
fn stream_json_images_reach_both_wires() {
    for wire in ["anthropic", "openai"] {
        let ws = Workspace::new("image-print");
        let stub = Stub::start(
            &ws,
            &script([
                Turn::text("a red dot"),
                Turn::text("a jpeg"),
                Turn::text("both"),
            ]),
        );
        let command = || {
            let mut cmd = caliban(&ws);
            if wire == "anthropic" {
                anthropic(&mut cmd, &stub);
            } else {
                openai(&mut cmd, &stub);
            }
            cmd
        };
        let mut cmd = command();
        cmd.args([
            "-p",
            "--input-format",
            "stream-json",
            "--output-format",
            "stream-json",
        ]);
        let line = json!({"type": "user", "content": [
            {"type": "text", "text": "what is this?"}, image_block("image/png", PNG)]});
        let jpeg = json!({"type": "user", "content": [image_block("image/jpeg", "/9j/4AAQ")]});
        let out = run(cmd, &format!("{line}\n{jpeg}\n"));
        assert_eq!(out.code, Some(0), "{wire}: {out:?}");
        let mut cmd = command();
        cmd.args(["-p", "--continue", "and both?"]);
        assert_eq!(run(cmd, "").code, Some(0), "{wire}");
        let continued = stub.requests()[2]["body"]["messages"].to_string();
        assert!(
            continued.contains(PNG) && continued.contains("/9j/4AAQ"),
            "{wire}: {continued}"
        );
        let reqs = stub.requests();
        let user = &reqs[0]["body"]["messages"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["role"] == "user")
            .cloned()
            .unwrap();
        let expected = if wire == "anthropic" {
            json!([{"type": "text", "text": "what is this?", "cache_control": {"type": "ephemeral"}},
                   image_block("image/png", PNG)])
        } else {
            json!([{"type": "text", "text": "what is this?"},
                   {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{PNG}")}}])
        };
        if wire == "anthropic" {
            // The cache breakpoint goes on the last block of the last user message.
            assert_eq!(user["content"][0]["text"], "what is this?");
            assert_eq!(user["content"][1]["source"], expected[1]["source"]);
        } else {
            assert_eq!(user["content"], expected, "{user}");
        }
    }
}

/// An image neither provider takes is refused with the reason, never dropped.
#[test]
fn stream_json_refuses_images_it_cannot_send() {
    let ws = Workspace::new("image-refused");
    let stub = Stub::start(&ws, &script([Turn::text("unused")]));
    for (block, why) in [
        (
            image_block("image/tiff", "AAAA"),
            "unsupported image type `image/tiff`",
        ),
        (
            image_block("image/png", "not base64!"),
            "image data is not base64",
        ),
        (
            json!({"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}),
            "unsupported image source `url`",
        ),
        (
            image_block("image/png", &"A".repeat((3 << 20) + 4)),
            "image too large",
        ),
    ] {
        let cmd = caliban_stub(&ws, &stub, STREAM_JSON);
        let line = json!({"type": "user", "content": [block]});
        let out = run(cmd, &format!("{line}\n"));
        assert_eq!(out.code, Some(64), "{out:?}");
        let error = out.result()["error"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        assert!(error.contains(why), "{error}");
    }
    assert!(stub.requests().is_empty(), "nothing reached the model");
}

/// The user messages of a request, each as its blocks: `image`, or `text:` and the text.
fn user_blocks(request: &Value) -> Vec<Vec<String>> {
    let messages = request["body"]["messages"].as_array().expect("messages");
    messages
        .iter()
        .filter(|m| m["role"] == "user")
        .map(|m| {
            let blocks = m["content"].as_array().expect("content blocks");
            blocks
                .iter()
                .map(|b| match b["type"].as_str() {
                    Some("text") => format!("text:{}", b["text"].as_str().unwrap_or_default()),
                    other => other.unwrap_or_default().to_owned(),
                })
                .collect()
        })
        .collect()
}

/// A stream-json message reaches the model with its blocks in the order given, the first
/// line's and a later one's alike: text is not gathered ahead of the images.
#[test]
fn stream_json_blocks_reach_the_model_in_the_order_given() {
    let ws = Workspace::new("print-block-order");
    let stub = Stub::start(&ws, &script([Turn::text("first"), Turn::text("second")]));
    let image = image_block("image/png", PNG);
    let user = |content: Value| json!({"type": "user", "content": content});
    let first = user(json!([image, {"type": "text", "text": "look "}, image,
                            {"type": "text", "text": "here"}]));
    let later = user(json!([{"type": "text", "text": "a"}, image, {"type": "text", "text": "b"}]));
    let out = run_stub(&ws, &stub, STREAM_JSON, &format!("{first}\n{later}\n"));
    assert_eq!(out.code, Some(0), "{out:?}");
    let requests = stub.requests();
    assert_eq!(requests.len(), 2, "{requests:?}");
    assert_eq!(
        user_blocks(&requests[1]),
        [
            vec!["image", "text:look ", "image", "text:here"],
            vec!["text:a", "image", "text:b"]
        ]
    );
}

/// An empty first stream-json message starts the run like any other: it goes to the model,
/// and the model's refusal is the run's end (a runtime error), not print mode's.
#[test]
fn an_empty_first_stream_json_message_goes_to_the_model() {
    let ws = Workspace::new("print-empty-first");
    let stub = Stub::start(&ws, &script([Turn::text("never")]));
    let out = run_stub(
        &ws,
        &stub,
        STREAM_JSON,
        "{\"type\":\"user\",\"content\":\"\"}\n",
    );
    assert_eq!(out.code, Some(1), "{out:?}");
    let frames = out.frames();
    let kinds: Vec<&Value> = frames.iter().map(|f| &f["type"]).collect();
    assert_eq!(kinds, ["system", "result"], "{out:?}");
    let result = out.result();
    assert_eq!(
        (&result["subtype"], &result["num_turns"], &result["error"]),
        (
            &json!("error"),
            &json!(0),
            &json!("invalid_request_error (http 400): messages: at least one message is required")
        )
    );
}

/// A model that refuses a request as too long for its window (one caliban thought would
/// fit) gets a summary request instead, then the request again, compacted.
#[test]
fn prompt_too_long_compacts_and_sends_again() {
    let ws = Workspace::new("compact-overflow");
    big_file(&ws, "a.txt", "AAA");
    let too_long = r#"{"type":"error","error":{"type":"invalid_request_error","message":"prompt is too long: 201000 tokens > 200000 maximum"}}"#;
    let stub = Stub::start(
        &ws,
        &script([
            Turn::bare().calling([Call::read("t1", "a.txt")]),
            Turn::bare()
                .say("THE-SUMMARY")
                .fault(Fault::StatusBody(400, too_long.into())),
            Turn::bare().say("done"),
        ]),
    );
    let out = run_stub(
        &ws,
        &stub,
        &["-p", "--output-format", "stream-json", "read a.txt"],
        "",
    );
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(out.result()["result"], "done");
    let boundary = out
        .frames()
        .into_iter()
        .find(|f| f["subtype"] == "compact_boundary")
        .unwrap_or_else(|| panic!("{out:?}"));
    assert_eq!(boundary["summary"], "THE-SUMMARY");
    let reqs = stub.requests();
    assert_eq!(
        reqs.len(),
        4,
        "the refused request, the summary, the request again"
    );
    assert!(reqs[2]["body"].to_string().contains("working notes"));
    let resent = reqs[3]["body"]["messages"].to_string();
    assert!(
        resent.contains("THE-SUMMARY") && !resent.contains("AAA"),
        "{resent}"
    );
}

/// The session file's records, as `kind state-or-input`, events left out.
fn session_records(ws: &Workspace, run: &str) -> Vec<String> {
    ws.read(&format!("home/.state/caliban/sessions/{run}.jsonl"))
        .lines()
        .filter_map(|line| {
            let v: Value = serde_json::from_str(line).expect("a session line");
            match v["kind"].as_str()? {
                "status" => Some(format!("status {}", v["status"]["state"].as_str()?)),
                "input" => Some(format!("input {}", v["input"]["type"].as_str()?)),
                _ => None,
            }
        })
        .collect()
}

/// A print run is recorded by the drive core as any driven run is: its lifecycle, and each
/// stream-json line as the input it was, delivered at a turn boundary.
#[test]
fn print_runs_are_recorded_with_the_drive_cores_lifecycle() {
    let ws = Workspace::new("print-lifecycle");
    let stub = Stub::start(
        &ws,
        &script([
            Turn::text("first"),
            Turn::text("second"),
            Turn::text("third"),
        ]),
    );
    let out = run_stub(&ws, &stub, &["-p", "once"], "");
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(
        session_records(&ws, "run-1"),
        ["status starting", "status running", "status done"]
    );
    let input =
        "{\"type\":\"user\",\"content\":\"one\"}\n{\"type\":\"user\",\"content\":\"two\"}\n";
    let out = run_stub(&ws, &stub, STREAM_JSON_IN_JSON_OUT, input);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(
        session_records(&ws, "run-2"),
        [
            "status starting",
            "status running",
            "status awaiting_input",
            "input user_message",
            "status running",
            "status awaiting_input",
            "input end_input",
            "status done"
        ]
    );
    let header: Value = serde_json::from_str(
        ws.read("home/.state/caliban/sessions/run-2.jsonl")
            .lines()
            .next()
            .expect("a header"),
    )
    .expect("a JSON header");
    assert_eq!(
        (
            &header["prompt"],
            &header["interactive"],
            &header["session_id"]
        ),
        (&json!("one"), &json!(true), &out.result()["session_id"])
    );
}

/// However many lines follow a line that ends print mode before its run started, the run
/// reports one result, and the exit code is that of the input's first problem.
#[test]
fn a_print_run_that_never_started_reports_one_result() {
    let ws = Workspace::new("print-one-result");
    let stub = Stub::start(&ws, &script([Turn::text("x")]));
    let user = "{\"type\":\"user\",\"content\":\"hello\"}\n";
    let interrupt = "{\"type\":\"control\",\"subtype\":\"interrupt\"}\n";
    let cases = [
        (format!("garbage\n{user}{user}{user}"), 64),
        (format!("{interrupt}{user}"), 124),
        (interrupt.to_owned(), 66),
    ];
    for (input, code) in cases {
        let out = run_stub(&ws, &stub, STREAM_JSON, &input);
        assert_eq!(out.code, Some(code), "{input:?}: {out:?}");
        let results = out
            .frames()
            .iter()
            .filter(|f| f["type"] == "result")
            .count();
        assert_eq!(results, 1, "{input:?}: {}", out.stdout);
    }
    // `--output-format json` is one JSON document on stdout, whatever followed.
    let out = run_stub(
        &ws,
        &stub,
        STREAM_JSON_IN_JSON_OUT,
        &format!("garbage\n{user}"),
    );
    assert_eq!(out.code, Some(64), "{out:?}");
    let doc: Value = serde_json::from_str(&out.stdout).expect("one JSON document");
    assert_eq!(doc["subtype"], "error", "{doc}");
}

/// With no session store to open, a print run still runs and answers, unrecorded, even when
/// the temporary directory it would keep the run in does not exist yet.
#[test]
fn a_print_run_with_no_session_store_still_answers() {
    let ws = Workspace::new("print-no-store");
    let stub = Stub::start(&ws, &script([Turn::text("answered anyway")]));
    std::fs::write(ws.path("state-file"), "not a directory").expect("state file");
    let mut cmd = caliban_stub(&ws, &stub, &["-p", "hi", "--output-format", "json"]);
    cmd.env("XDG_STATE_HOME", ws.path("state-file/below"))
        .env("TMPDIR", ws.path("tmp-not-made-yet"));
    let out = run(cmd, "");
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(out.result()["result"], "answered anyway", "{out:?}");
    assert!(out.stderr.contains("not recorded"), "{}", out.stderr);
}
