//! `caliban acp serve` end to end. Most tests drive the real binary with the official ACP
//! TypeScript SDK (`@agentclientprotocol/sdk`, `tests/acp/driver.mjs`), which npm installs
//! into `target/acp-sdk` on first use, and every frame caliban sends in them is validated
//! against the ACP JSON schema the SDK ships. The raw-wire tests speak NDJSON by hand, for
//! what an SDK would never send (bad JSON, unknown methods) and for stdin EOF.

use std::io::Write;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::util::acp::*;
use crate::util::rpc::Peer;
use crate::util::*;

/// The longest any single frame may take to arrive on the raw wire.
const RECV_TIMEOUT: Duration = Duration::from_secs(20);

// ---- helpers ---------------------------------------------------------------------------------

fn of_kind<'a>(updates: &'a Value, kind: &str) -> Vec<&'a Value> {
    updates
        .as_array()
        .map(|u| u.iter().filter(|u| u["sessionUpdate"] == kind).collect())
        .unwrap_or_default()
}

fn text_of(updates: &Value, kind: &str) -> String {
    of_kind(updates, kind)
        .iter()
        .filter_map(|u| u["content"]["text"].as_str())
        .collect()
}

/// The text of every block of the messages the model was sent in request `n` (0-based).
fn request_messages(stub: &Stub, n: usize) -> Vec<Value> {
    let requests = stub.requests();
    requests
        .get(n)
        .and_then(|r| r["body"]["messages"].as_array().cloned())
        .unwrap_or_else(|| panic!("no request {n} among {}", requests.len()))
}

fn flat(messages: &[Value]) -> String {
    serde_json::to_string(messages).unwrap_or_default()
}

// ---- the seed's lifecycle ----------------------------------------------------------------

#[test]
fn acp_seed_handshake_then_a_second_prompt_continues_the_conversation() {
    let ws = Workspace::new("acp-handshake");
    let stub = Stub::start(
        &ws,
        &script(vec![
            Turn::text("The README describes a small agent."),
            Turn::text("You asked about the README."),
        ]),
    );
    let r = drive(
        &ws,
        &stub,
        json!({"scenario": "prompts", "prompts": ["summarize the README", "what did I ask?"]}),
    );
    let init = &r["init"];
    assert_eq!(init["protocolVersion"], 1);
    assert_eq!(init["authMethods"], json!([]));
    let caps = &init["agentCapabilities"];
    assert_eq!(caps["loadSession"], true);
    assert_eq!(
        caps["promptCapabilities"],
        json!({"image": true, "audio": false, "embeddedContext": true})
    );
    assert_eq!(init["agentInfo"]["name"], "caliban");
    assert_eq!(r["auth"], json!({}));
    let modes = &r["session"]["modes"];
    assert_eq!(modes["currentModeId"], "default");
    let ids: Vec<&str> = modes["availableModes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    assert_eq!(
        ids,
        [
            "default",
            "acceptEdits",
            "plan",
            "dontAsk",
            "bypassPermissions"
        ]
    );
    // The run stays open between prompts, so there is no `_meta` yet.
    assert_eq!(
        r["stops"],
        json!([{"stopReason": "end_turn"}, {"stopReason": "end_turn"}])
    );
    assert_eq!(
        text_of(&r["updates"], "agent_message_chunk"),
        "The README describes a small agent.You asked about the README."
    );
    // The second prompt continued the same conversation.
    let second = flat(&request_messages(&stub, 1));
    for part in [
        "summarize the README",
        "The README describes a small agent.",
        "what did I ask?",
    ] {
        assert!(second.contains(part), "{part:?} missing from {second}");
    }
}

#[test]
fn acp_tool_call_cards_carry_kind_title_locations_and_raw_input() {
    let ws = Workspace::new("acp-card");
    ws.write("notes.txt", "alpha\nbeta\n");
    let stub = Stub::start(
        &ws,
        &script(vec![
            Turn::bare()
                .think("Look at the notes first.")
                .say("Reading.")
                .calling([Call::read("toolu_r", "notes.txt")]),
            Turn::text("Two lines."),
        ]),
    );
    let r = drive(
        &ws,
        &stub,
        json!({"scenario": "prompts", "prompts": ["read the notes"]}),
    );
    let updates = &r["updates"];
    assert_eq!(
        text_of(updates, "agent_thought_chunk"),
        "Look at the notes first."
    );
    let card = tool_updates(updates, "toolu_r");
    let abs = path_str(&ws.path("notes.txt"));
    assert_eq!(card[0]["sessionUpdate"], "tool_call");
    assert_eq!(card[0]["kind"], "read");
    assert_eq!(card[0]["status"], "pending");
    // The input is shown as soon as it is complete: on the opening card or the next update,
    // and before the call runs.
    let shown = card
        .iter()
        .position(|u| u["rawInput"] == json!({"path": "notes.txt"}))
        .expect("the input on the card");
    let running = card
        .iter()
        .position(|u| u["status"] == "in_progress")
        .expect("an in_progress update");
    assert!(shown < running, "{card:?}");
    assert_eq!(card[shown]["title"], "Read notes.txt");
    assert_eq!(card[shown]["locations"], json!([{"path": abs}]));
    let done = card.last().unwrap();
    assert_eq!(done["status"], "completed");
    assert_eq!(done["rawInput"], json!({"path": "notes.txt"}));
    let text = done["content"][0]["content"]["text"].as_str().unwrap();
    assert!(text.contains("alpha") && text.contains("beta"), "{text}");
    assert_eq!(r["permissions"], json!([]), "Read needs no permission");
    assert_eq!(r["stops"], json!([{"stopReason": "end_turn"}]));
}

#[test]
fn acp_permission_prompts_allowed_and_rejected() {
    let ws = Workspace::new("acp-permit");
    let stub = Stub::start(
        &ws,
        &script(vec![
            Turn::bash("toolu_ok", "echo allowed-run"),
            Turn::bash("toolu_no", "touch rejected.txt"),
            Turn::bash("toolu_err", "touch errored.txt"),
            Turn::text("One ran, two were not allowed."),
        ]),
    );
    let r = drive(
        &ws,
        &stub,
        json!({"scenario": "prompts", "prompts": ["run them"],
               "answers": ["allow", "reject", "error"]}),
    );
    let asks = r["permissions"].as_array().unwrap();
    assert_eq!(asks.len(), 3, "{asks:?}");
    let options: Vec<(&str, &str)> = asks[0]["options"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| (o["optionId"].as_str().unwrap(), o["kind"].as_str().unwrap()))
        .collect();
    assert_eq!(
        options,
        [
            ("allow", "allow_once"),
            ("allow_always", "allow_always"),
            ("reject", "reject_once"),
            ("reject_always", "reject_always")
        ]
    );
    assert_eq!(asks[0]["toolCall"]["toolCallId"], "toolu_ok");
    assert_eq!(asks[0]["toolCall"]["title"], "echo allowed-run");
    assert_eq!(asks[0]["toolCall"]["kind"], "execute");
    assert_eq!(
        asks[0]["toolCall"]["rawInput"],
        json!({"command": "echo allowed-run"})
    );
    let ok = tool_updates(&r["updates"], "toolu_ok");
    assert_eq!(ok.last().unwrap()["status"], "completed");
    assert!(
        ok.last().unwrap()["content"][0]["content"]["text"]
            .as_str()
            .unwrap()
            .contains("allowed-run")
    );
    let no = tool_updates(&r["updates"], "toolu_no");
    assert_eq!(no.last().unwrap()["status"], "failed");
    assert!(
        !no.iter().any(|u| u["status"] == "in_progress"),
        "a rejected call never runs"
    );
    assert!(!ws.path("rejected.txt").exists());
    let told = flat(&request_messages(&stub, 2));
    assert!(told.contains("the user rejected this tool call"), "{told}");
    // A client that fails to answer denies too.
    let err = tool_updates(&r["updates"], "toolu_err");
    assert_eq!(err.last().unwrap()["status"], "failed");
    assert!(!ws.path("errored.txt").exists());
    let told = flat(&request_messages(&stub, 3));
    assert!(
        told.contains("the editor could not ask for permission"),
        "{told}"
    );
    assert_eq!(r["stops"], json!([{"stopReason": "end_turn"}]));
}

#[test]
fn acp_allow_always_adds_a_session_rule() {
    let ws = Workspace::new("acp-always");
    let stub = Stub::start(
        &ws,
        &script(vec![
            // Both calls ask; the answer to the first covers the second.
            Turn::bare().calling([
                Call::bash("toolu_1", "echo one"),
                Call::bash("toolu_2", "echo two"),
            ]),
            Turn::bash("toolu_3", "pwd"),
            Turn::bash("toolu_4", "echo three"),
            Turn::text("done"),
            Turn::bash("toolu_5", "echo four"),
            Turn::text("still allowed"),
        ]),
    );
    let r = drive(
        &ws,
        &stub,
        json!({"scenario": "prompts", "prompts": ["go", "again"],
               "answers": ["allow_always", "allow"]}),
    );
    let asked: Vec<&str> = r["permissions"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| p["toolCall"]["toolCallId"].as_str())
        .collect();
    // `echo` was allowed for the session; `pwd` is another command and still asks.
    assert_eq!(asked, ["toolu_1", "toolu_3"]);
    assert_eq!(
        r["permissions"][0]["options"][1]["name"],
        "Always allow Bash(echo:*)"
    );
    for id in ["toolu_1", "toolu_2", "toolu_3", "toolu_4", "toolu_5"] {
        let card = tool_updates(&r["updates"], id);
        assert_eq!(
            card.last().unwrap()["status"],
            "completed",
            "{id}: {card:?}"
        );
    }
}

// ---- cancel ----------------------------------------------------------------------------------

#[test]
fn acp_cancel_during_a_streaming_reply() {
    let ws = Workspace::new("acp-cancel-stream");
    let long = (1..=40)
        .map(|i| format!("word{i}"))
        .collect::<Vec<_>>()
        .join(" ");
    let stub = Stub::start(
        &ws,
        &script(vec![
            Turn::bare().say(&long).fault(Fault::DripMs(100)),
            Turn::text("A fresh answer."),
        ]),
    );
    let r = drive(
        &ws,
        &stub,
        json!({"scenario": "cancel", "prompts": ["tell me a long story", "short one please"]}),
    );
    let stop = &r["stop"];
    assert_eq!(stop["stopReason"], "cancelled");
    // The run ended, so its accounting comes along.
    assert!(stop["_meta"]["caliban/usage"].is_object(), "{stop}");
    assert!(stop["_meta"]["caliban/turns"].is_u64(), "{stop}");
    let streamed = text_of(&r["cancelled"], "agent_message_chunk");
    assert!(streamed.starts_with("word1"), "{streamed}");
    assert!(
        !streamed.contains("word40"),
        "the stream was not stopped: {streamed}"
    );
    assert_eq!(r["updatesAfterAnswer"], json!([]));
    // Nothing of the cancelled turn leaks into the next prompt.
    assert_eq!(r["second"], json!({"stopReason": "end_turn"}));
    assert_eq!(
        text_of(&r["secondUpdates"], "agent_message_chunk"),
        "A fresh answer."
    );
    // Besides the answer, only the turn's context meter.
    assert_eq!(
        r["secondUpdates"].as_array().unwrap().len(),
        of_kind(&r["secondUpdates"], "agent_message_chunk").len()
            + of_kind(&r["secondUpdates"], "usage_update").len()
    );
    // The next prompt continues the conversation in a new run: the cancelled request is
    // there, its partial answer is not.
    let next = flat(&request_messages(&stub, 1));
    assert!(next.contains("tell me a long story"), "{next}");
    assert!(next.contains("short one please"), "{next}");
    assert!(!next.contains("word1"), "{next}");
}

#[test]
fn acp_cancel_during_a_running_bash_kills_it() {
    let ws = Workspace::new("acp-cancel-bash");
    let marker = format!("acp-cancel-marker-{}", std::process::id());
    let stub = Stub::start(
        &ws,
        &script(vec![
            Turn::call(
                "toolu_sleep",
                "Bash",
                json!({"command": format!("sleep 30; echo {marker}")}),
            ),
            Turn::text("after the cancel"),
        ]),
    );
    let r = drive(
        &ws,
        &stub,
        json!({"scenario": "cancel", "cancelOn": "running", "cancelDelayMs": 300,
               "prompts": ["sleep", "next"]}),
    );
    assert_eq!(r["stop"]["stopReason"], "cancelled");
    assert!(
        r["cancelMs"].as_u64().unwrap() < 10_000,
        "{}",
        r["cancelMs"]
    );
    let card = tool_updates(&r["cancelled"], "toolu_sleep");
    let last = card.last().unwrap();
    assert_eq!(last["status"], "failed", "{card:?}");
    assert_eq!(last["content"][0]["content"]["text"], "cancelled");
    assert!(
        !process_with_marker_exists(&marker),
        "the Bash process outlived the cancel"
    );
    assert_eq!(r["second"], json!({"stopReason": "end_turn"}));
}

#[test]
fn acp_cancel_during_bash_in_an_editor_terminal() {
    let ws = Workspace::new("acp-cancel-term");
    let marker = format!("acp-term-marker-{}", std::process::id());
    let stub = Stub::start(
        &ws,
        &script(vec![
            Turn::call(
                "toolu_t",
                "Bash",
                json!({"command": format!("sleep 30; echo {marker}")}),
            ),
            Turn::text("after the cancel"),
        ]),
    );
    let r = drive(
        &ws,
        &stub,
        // An editor's terminal is outside the sandbox's reach: with one on, Bash runs in
        // caliban instead (`acp_a_sandboxed_bash_runs_in_caliban_and_may_be_retried_outside`).
        json!({"scenario": "cancel", "cancelOn": "terminal", "cancelDelayMs": 200,
               "agent": agent(&["--sandbox", "off"]),
               "caps": {"terminal": true}, "prompts": ["sleep", "next"]}),
    );
    assert_eq!(r["stop"]["stopReason"], "cancelled");
    let methods: Vec<&str> = r["terminal"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|c| c["method"].as_str())
        .collect();
    assert_eq!(
        methods,
        [
            "terminal/create",
            "terminal/wait_for_exit",
            "terminal/kill",
            "terminal/release"
        ]
    );
    assert_eq!(r["killedTerminals"], 1);
    let card = tool_updates(&r["cancelled"], "toolu_t");
    assert_eq!(card.last().unwrap()["status"], "failed");
    assert!(!process_with_marker_exists(&marker));
    assert_eq!(r["second"], json!({"stopReason": "end_turn"}));
}

#[test]
fn acp_cancel_answers_a_pending_permission_prompt() {
    let ws = Workspace::new("acp-cancel-ask");
    let stub = Stub::start(
        &ws,
        &script(vec![
            Turn::bash("toolu_ask", "touch never.txt"),
            Turn::text("ok"),
        ]),
    );
    let r = drive(
        &ws,
        &stub,
        json!({"scenario": "cancel", "cancelOn": "permission", "cancelDelayMs": 100,
               "answers": ["never"], "prompts": ["touch it", "next"]}),
    );
    assert_eq!(r["stop"]["stopReason"], "cancelled");
    assert_eq!(r["permissions"].as_array().unwrap().len(), 1);
    let card = tool_updates(&r["cancelled"], "toolu_ask");
    assert_eq!(card.last().unwrap()["status"], "failed");
    assert!(!ws.path("never.txt").exists());
    assert_eq!(r["second"], json!({"stopReason": "end_turn"}));
}

// ---- sessions --------------------------------------------------------------------------------

#[test]
fn acp_session_load_replays_the_conversation_after_a_restart() {
    let ws = Workspace::new("acp-load");
    ws.write("notes.txt", "gamma\n");
    let stub = Stub::start(
        &ws,
        &script(vec![
            Turn::bare()
                .say("Let me read.")
                .calling([Call::read("toolu_n", "notes.txt")]),
            Turn::text("It says gamma."),
            Turn::text("Still here."),
        ]),
    );
    let r = drive(
        &ws,
        &stub,
        json!({"scenario": "restart", "prompts": ["what do the notes say?"],
               "after": "are you still there?"}),
    );
    let replay = &r["second"]["replay"];
    let kinds: Vec<&str> = replay
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|u| u["sessionUpdate"].as_str())
        .collect();
    assert_eq!(
        kinds,
        [
            "user_message_chunk",
            "agent_message_chunk",
            "tool_call",
            "agent_message_chunk"
        ]
    );
    assert_eq!(replay[0]["content"]["text"], "what do the notes say?");
    assert_eq!(replay[1]["content"]["text"], "Let me read.");
    let call = &replay[2];
    assert_eq!(call["toolCallId"], "toolu_n");
    assert_eq!(call["kind"], "read");
    assert_eq!(call["status"], "completed");
    assert_eq!(call["rawInput"], json!({"path": "notes.txt"}));
    assert!(
        call["content"][0]["content"]["text"]
            .as_str()
            .unwrap()
            .contains("gamma")
    );
    assert_eq!(replay[3]["content"]["text"], "It says gamma.");
    assert!(r["second"]["loaded"]["modes"].is_object());
    // The loaded session goes on with its whole conversation.
    assert_eq!(r["second"]["stop"], json!({"stopReason": "end_turn"}));
    let after = flat(&request_messages(&stub, 2));
    for part in [
        "what do the notes say?",
        "toolu_n",
        "It says gamma.",
        "are you still there?",
    ] {
        assert!(after.contains(part), "{part:?} missing from {after}");
    }
    assert_eq!(r["second"]["unknown"]["code"], -32002);
}

/// A model server that repeats tool-call ids (local servers send `call_0` every turn, or one
/// id for parallel calls): every card gets its own `toolCallId`, live and in a replay, and
/// each shows its own call's result; the model still sees its own ids.
#[test]
fn acp_repeated_model_tool_ids_get_their_own_cards() {
    let ws = Workspace::new("acp-repeated-ids");
    for (file, text) in [("a.txt", "alpha"), ("b.txt", "bravo"), ("c.txt", "charlie")] {
        ws.write(file, &format!("{text}\n"));
    }
    let read = |path: &str| Call::read("call_0", path);
    let stub = Stub::start(
        &ws,
        &script(vec![
            Turn::bare().calling([read("a.txt")]),
            Turn::bare().calling([read("b.txt")]),
            Turn::bare().calling([read("c.txt"), read("a.txt")]),
            Turn::text("Read them all."),
            Turn::text("Still here."),
        ]),
    );
    let r = drive(
        &ws,
        &stub,
        json!({"scenario": "restart", "prompts": ["read the files"], "after": "again"}),
    );
    // Live: four cards, four ids, each completed with its own file (the repeat in one turn
    // refused).
    let updates = &r["first"]["updates"];
    let opened: Vec<&str> = of_kind(updates, "tool_call")
        .iter()
        .filter_map(|u| u["toolCallId"].as_str())
        .collect();
    assert_eq!(
        opened,
        ["call_0", "call_0#2", "call_0#3", "call_0#4"],
        "{updates:#}"
    );
    let outcome = |updates: &Value, id: &str| -> (String, String) {
        let last = tool_updates(updates, id)
            .into_iter()
            .rev()
            .find(|u| u["status"] == "completed" || u["status"] == "failed")
            .cloned()
            .unwrap_or_else(|| panic!("{id} never ended: {updates:#}"));
        let text = last["content"]
            .as_array()
            .and_then(|c| c.iter().rev().find_map(|c| c["content"]["text"].as_str()))
            .unwrap_or_default()
            .to_owned();
        (last["status"].as_str().unwrap_or_default().to_owned(), text)
    };
    let live: Vec<(String, String)> = opened.iter().map(|id| outcome(updates, id)).collect();
    for (n, (want_status, want_text)) in [
        ("completed", "alpha"),
        ("completed", "bravo"),
        ("completed", "charlie"),
        ("failed", "duplicate tool_use id"),
    ]
    .into_iter()
    .enumerate()
    {
        assert_eq!(live[n].0, want_status, "card {n}: {live:?}");
        assert!(live[n].1.contains(want_text), "card {n}: {live:?}");
    }
    // Replayed after a restart: the same four cards, each with its own result.
    let replay = &r["second"]["replay"];
    let cards: Vec<(&str, &str, &str)> = of_kind(replay, "tool_call")
        .iter()
        .map(|u| {
            (
                u["toolCallId"].as_str().unwrap_or_default(),
                u["rawInput"]["path"].as_str().unwrap_or_default(),
                u["status"].as_str().unwrap_or_default(),
            )
        })
        .collect();
    assert_eq!(
        cards,
        [
            ("call_0", "a.txt", "completed"),
            ("call_0#2", "b.txt", "completed"),
            ("call_0#3", "c.txt", "completed"),
            ("call_0#4", "a.txt", "failed"),
        ]
    );
    for (card, text) in of_kind(replay, "tool_call").iter().zip([
        "alpha",
        "bravo",
        "charlie",
        "duplicate tool_use id",
    ]) {
        assert!(card["content"].to_string().contains(text), "{card}");
    }
    // The model was sent its own ids throughout.
    let sent = flat(&request_messages(&stub, 3));
    assert!(
        sent.contains("\"call_0\"") && !sent.contains("call_0#"),
        "{sent}"
    );
}

/// A model request that is retried (429, 5xx, 529 before any output) shows in the editor
/// while it waits, as print mode's `api_retry` frame does: as a `notice` for a client that
/// shows them, else as a thought chunk; the turn then goes on as usual.
#[test]
fn acp_model_retries_are_shown_while_they_wait() {
    for notices in [false, true] {
        let ws = Workspace::new("acp-retry");
        let stub = Stub::start(
            &ws,
            &script(vec![
                Turn::bare()
                    .say("Back again.")
                    .fault(Fault::StatusRetryAfter(529, "0".into()))
                    .fault(Fault::StatusRetryAfter(503, "0".into())),
            ]),
        );
        let caps = if notices {
            json!({"session": {"notices": {}}})
        } else {
            json!({})
        };
        let r = drive(
            &ws,
            &stub,
            json!({"scenario": "prompts", "prompts": ["hello"], "caps": caps}),
        );
        assert_eq!(r["stops"], json!([{"stopReason": "end_turn"}]));
        let updates = &r["updates"];
        let shown: Vec<&Value> = updates
            .as_array()
            .unwrap()
            .iter()
            .filter(|u| !u["_meta"]["caliban/api_retry"].is_null())
            .collect();
        assert_eq!(shown.len(), 2, "{updates:#}");
        let first = &shown[0];
        assert_eq!(first["_meta"]["caliban/api_retry"]["error_status"], 529);
        assert_eq!(first["_meta"]["caliban/api_retry"]["attempt"], 2);
        assert_eq!(shown[1]["_meta"]["caliban/api_retry"]["error_status"], 503);
        if notices {
            assert_eq!(first["sessionUpdate"], "notice", "{first}");
            assert_eq!(first["severity"], "warning");
            let title = first["title"].as_str().unwrap_or_default();
            assert!(
                title.contains("HTTP 529") && title.contains("retry 1 of 4"),
                "{title}"
            );
            assert!(text_of(updates, "agent_thought_chunk").is_empty());
        } else {
            assert_eq!(first["sessionUpdate"], "agent_thought_chunk", "{first}");
            let thought = text_of(updates, "agent_thought_chunk");
            assert!(
                thought.contains("HTTP 529") && thought.contains("retry 1 of 4"),
                "{thought}"
            );
            assert!(thought.contains("retry 2 of 4"), "{thought}");
        }
        // The retries come before the answer.
        let answer_at = updates
            .as_array()
            .unwrap()
            .iter()
            .position(|u| u["sessionUpdate"] == "agent_message_chunk")
            .expect("the answer");
        let last_retry_at = updates
            .as_array()
            .unwrap()
            .iter()
            .rposition(|u| !u["_meta"]["caliban/api_retry"].is_null())
            .unwrap();
        assert!(last_retry_at < answer_at);
        assert_eq!(text_of(updates, "agent_message_chunk"), "Back again.");
    }
}

#[test]
fn acp_sessions_are_listed_resumed_and_closed() {
    let ws = Workspace::new("acp-sessions");
    let stub = Stub::start(
        &ws,
        &script(vec![
            Turn::text("a"),
            Turn::text("b"),
            Turn::text("resumed"),
        ]),
    );
    let r = drive(&ws, &stub, json!({"scenario": "sessions"}));
    let first = &r["first"];
    let listed: Vec<&str> = first["list"]["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|s| s["sessionId"].as_str())
        .collect();
    assert_eq!(listed.len(), 2);
    assert!(listed.contains(&first["a"].as_str().unwrap()));
    assert_eq!(first["closed"], json!({}));
    assert_eq!(first["afterClose"]["code"], -32002);
    let second = &r["second"];
    let titles: Vec<&str> = second["list"]["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|s| s["title"].as_str())
        .collect();
    assert_eq!(titles.len(), 2, "{second}");
    assert!(titles.contains(&"first session"), "{titles:?}");
    assert_eq!(second["replayed"], 0, "resume does not replay");
    assert_eq!(second["stop"], json!({"stopReason": "end_turn"}));
}

// ---- the editor's file system and terminals ------------------------------------------------

#[test]
fn acp_fs_and_terminal_delegation() {
    let ws = Workspace::new("acp-delegate");
    ws.write("buffered.txt", "what is on disk\n");
    ws.write("edit.txt", "alpha beta\n");
    let stub = Stub::start(
        &ws,
        &script(vec![
            Turn::call("toolu_read", "Read", json!({"path": "buffered.txt"})),
            Turn::call(
                "toolu_edit",
                "Edit",
                json!({"path": "edit.txt", "old_string": "alpha", "new_string": "ALPHA"}),
            ),
            Turn::call(
                "toolu_write",
                "Write",
                json!({"path": "sub/new.txt", "content": "brand new\n"}),
            ),
            Turn::bash("toolu_bash", "echo from-the-terminal"),
            Turn::text("All done."),
        ]),
    );
    let buffered = path_str(&ws.path("buffered.txt"));
    let r = drive(
        &ws,
        &stub,
        // Delegated to the editor's terminal only without a sandbox (see the test above).
        json!({"scenario": "prompts", "prompts": ["do it all"], "mode": "bypassPermissions",
               "agent": agent(&["--sandbox", "off"]),
               "caps": {"fs": {"readTextFile": true, "writeTextFile": true}, "terminal": true},
               "buffers": {buffered.clone(): "the unsaved buffer\n"}}),
    );
    assert_eq!(r["mode"], json!({}));
    assert_eq!(
        r["permissions"],
        json!([]),
        "bypassPermissions asks nothing"
    );
    let fs: Vec<(String, String)> = r["fs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let path = c["params"]["path"].as_str().unwrap();
            let rel = path
                .strip_prefix(&format!("{}/", ws.root.display()))
                .unwrap_or(path);
            (c["method"].as_str().unwrap().to_owned(), rel.to_owned())
        })
        .collect();
    let expect = |m: &str, p: &str| (m.to_owned(), p.to_owned());
    assert_eq!(
        fs,
        [
            expect("fs/read_text_file", "buffered.txt"),
            expect("fs/read_text_file", "edit.txt"),
            expect("fs/write_text_file", "edit.txt"),
            expect("fs/write_text_file", "sub/new.txt"),
        ]
    );
    // Read saw the editor's buffer, not the disk.
    let after_read = flat(&request_messages(&stub, 1));
    assert!(after_read.contains("the unsaved buffer"), "{after_read}");
    assert!(!after_read.contains("what is on disk"), "{after_read}");
    // Edit and Write went through the editor, which stored them.
    assert_eq!(ws.read("edit.txt"), "ALPHA beta\n");
    assert_eq!(ws.read("sub/new.txt"), "brand new\n");
    let edit = tool_updates(&r["updates"], "toolu_edit");
    let diff = json!({"type": "diff", "path": path_str(&ws.path("edit.txt")),
                      "oldText": "alpha", "newText": "ALPHA"});
    assert!(
        edit.iter()
            .any(|u| u["content"].as_array().is_some_and(|c| c.contains(&diff))),
        "{edit:?}"
    );
    assert_eq!(edit[0]["kind"], "edit");
    let done = edit.last().unwrap();
    assert_eq!(done["status"], "completed");
    assert_eq!(
        done["content"][0], diff,
        "the diff stays on the finished card"
    );
    let write = tool_updates(&r["updates"], "toolu_write");
    let new_file = write
        .iter()
        .find_map(|u| u["content"].as_array().and_then(|c| c.first()))
        .expect("a diff for the write");
    assert_eq!(new_file["oldText"], Value::Null);
    assert_eq!(new_file["newText"], "brand new\n");
    // Bash ran in an editor terminal, embedded in its card, and was released.
    let methods: Vec<&str> = r["terminal"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|c| c["method"].as_str())
        .collect();
    assert_eq!(
        methods,
        [
            "terminal/create",
            "terminal/wait_for_exit",
            "terminal/output",
            "terminal/release"
        ]
    );
    let create = &r["terminal"][0]["params"];
    assert_eq!(
        create["args"],
        json!(["-c", "exec </dev/null\necho from-the-terminal"])
    );
    assert_eq!(create["cwd"], path_str(&ws.root));
    let bash = tool_updates(&r["updates"], "toolu_bash");
    let terminal_id = r["terminal"][1]["params"]["terminalId"].clone();
    assert!(
        bash.iter()
            .any(|u| u["content"][0] == json!({"type": "terminal", "terminalId": terminal_id})),
        "{bash:?}"
    );
    let result = bash.last().unwrap()["content"][1]["content"]["text"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(result, "from-the-terminal\n[exit code: 0]");
    assert_eq!(r["stops"], json!([{"stopReason": "end_turn"}]));
}

#[test]
fn acp_a_sandboxed_bash_runs_in_caliban_and_may_be_retried_outside() {
    let ws = Workspace::new("acp-sandbox-retry");
    let outside = outside_root().join(format!("acp-outside-{}", std::process::id()));
    let _ = std::fs::remove_file(&outside);
    let command = format!("echo x > {}", outside.display());
    let stub = Stub::start(
        &ws,
        &script(vec![Turn::bash("toolu_out", &command), Turn::text("done")]),
    );
    // Bash asks (allow), runs in the sandbox and is refused; the retry asks again (allow)
    // and runs outside it.
    let r = drive(
        &ws,
        &stub,
        json!({"scenario": "prompts", "prompts": ["write outside"], "answers": ["allow", "allow"],
               "caps": {"terminal": true}}),
    );
    // The sandboxed attempt ran in caliban; only the one the user let out of the sandbox
    // went to the editor's terminal, which the sandbox does not reach anyway.
    let creates: Vec<&Value> = r["terminal"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["method"] == "terminal/create")
        .collect();
    assert_eq!(creates.len(), 1, "{}", r["terminal"]);
    let permissions = r["permissions"].as_array().unwrap();
    assert_eq!(permissions.len(), 2, "{permissions:?}");
    let retry = &permissions[1];
    assert_eq!(
        retry["toolCall"]["title"],
        format!("Run outside the sandbox: {command}")
    );
    let why = retry["toolCall"]["rawInput"]["sandbox"].as_str().unwrap();
    assert!(
        why.starts_with("retry outside the sandbox (workspace-write): write to "),
        "{why}"
    );
    let options: Vec<&str> = retry["options"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["optionId"].as_str().unwrap())
        .collect();
    assert_eq!(
        options,
        ["allow", "reject"],
        "no rule can say \"always\" to this"
    );
    let done = tool_updates(&r["updates"], "toolu_out");
    assert_eq!(done.last().unwrap()["status"], "completed", "{done:?}");
    assert_eq!(std::fs::read_to_string(&outside).unwrap(), "x\n");
    let _ = std::fs::remove_file(&outside);
}

#[test]
fn acp_the_sandbox_config_option_narrows_a_session() {
    let ws = Workspace::new("acp-sandbox-option");
    let stub = Stub::start(
        &ws,
        &script(vec![
            Turn::bash("toolu_w", "echo x > inside.txt"),
            Turn::text("done"),
        ]),
    );
    let r = drive(
        &ws,
        &stub,
        json!({"scenario": "prompts", "prompts": ["write"], "configSandbox": "read-only",
               "answers": ["allow", "reject"]}),
    );
    let sandbox = r["session"]["configOptions"]
        .as_array()
        .and_then(|options| options.iter().find(|o| o["id"] == "sandbox"))
        .expect("a sandbox config option");
    assert_eq!(sandbox["currentValue"], "workspace-write");
    let offered: Vec<&str> = sandbox["options"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["value"].as_str().unwrap())
        .collect();
    assert_eq!(
        offered,
        ["read-only", "workspace-write"],
        "never wider than the server's"
    );
    let chosen = r["sandbox"]["configOptions"]
        .as_array()
        .and_then(|options| options.iter().find(|o| o["id"] == "sandbox"))
        .expect("the sandbox option in set_config_option's answer");
    assert_eq!(chosen["currentValue"], "read-only");
    assert!(!ws.path("inside.txt").exists());
    let done = tool_updates(&r["updates"], "toolu_w");
    let text = done.last().unwrap()["content"][0]["content"]["text"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        text.contains("blocked by the sandbox (read-only)"),
        "{text}"
    );
    let wider = drive(
        &ws,
        &stub,
        json!({"scenario": "prompts", "prompts": [], "configSandbox": "off"}),
    );
    assert!(
        wider["sandbox"]["error"]
            .as_str()
            .unwrap_or_default()
            .contains("sandbox `off` is not offered"),
        "{}",
        wider["sandbox"]
    );
}

// ---- modes, stop reasons, timeouts ---------------------------------------------------------

#[test]
fn acp_set_config_option_switches_the_permission_mode() {
    let ws = Workspace::new("acp-mode");
    let stub = Stub::start(
        &ws,
        &script(vec![
            Turn::call(
                "toolu_w",
                "Write",
                json!({"path": "out.txt", "content": "x"}),
            ),
            Turn::text("written"),
        ]),
    );
    let r = drive(
        &ws,
        &stub,
        json!({"scenario": "prompts", "prompts": ["write"], "configMode": "acceptEdits"}),
    );
    let options = &r["config"]["configOptions"][0];
    assert_eq!(options["id"], "mode");
    assert_eq!(options["currentValue"], "acceptEdits");
    assert_eq!(
        r["permissions"],
        json!([]),
        "acceptEdits writes without asking"
    );
    assert_eq!(ws.read("out.txt"), "x");
}

#[test]
fn acp_other_stop_reasons() {
    for (turn, flags, want) in [
        (
            Turn::bare().say("cut off").stop(Stop::MaxTokens),
            vec![],
            "max_tokens",
        ),
        (
            Turn::bare().say("I can't").stop(Stop::Refusal),
            vec![],
            "refusal",
        ),
        (
            Turn::call("toolu_m", "Read", json!({"path": "."})),
            vec!["--max-turns", "1"],
            "max_turn_requests",
        ),
    ] {
        let ws = Workspace::new("acp-stop");
        let stub = Stub::start(&ws, &script(vec![turn, Turn::text("next")]));
        let r = drive(
            &ws,
            &stub,
            json!({"scenario": "prompts", "prompts": ["go", "again"], "agent": agent(&flags)}),
        );
        let stop = &r["stops"][0];
        assert_eq!(stop["stopReason"], want, "{stop}");
        assert_eq!(stop["_meta"]["caliban/turns"], 1, "{stop}");
        assert!(
            stop["_meta"]["caliban/usage"]["output_tokens"].is_u64(),
            "{stop}"
        );
        // The session goes on in a new run.
        assert_eq!(r["stops"][1], json!({"stopReason": "end_turn"}), "{want}");
        if want == "refusal" {
            // ACP: a refused prompt is not carried into the next one.
            let next = flat(&request_messages(&stub, 1));
            assert!(!next.contains("I can't"), "{next}");
        }
    }
}

#[test]
fn acp_unanswered_permission_is_denied_and_withdrawn() {
    let ws = Workspace::new("acp-timeout");
    let stub = Stub::start(
        &ws,
        &script(vec![
            Turn::bash("toolu_late", "touch late.txt"),
            Turn::text("denied"),
        ]),
    );
    let r = drive(
        &ws,
        &stub,
        json!({"scenario": "prompts", "prompts": ["touch"], "answers": ["never"],
               "agent": agent(&["--permission-timeout", "1"])}),
    );
    assert_eq!(r["permissions"].as_array().unwrap().len(), 1);
    assert_eq!(r["withdrawn"].as_array().unwrap().len(), 1, "{r}");
    let card = tool_updates(&r["updates"], "toolu_late");
    assert_eq!(card.last().unwrap()["status"], "failed");
    assert!(!ws.path("late.txt").exists());
    assert_eq!(r["stops"], json!([{"stopReason": "end_turn"}]));
}

// ---- the raw wire ----------------------------------------------------------------------------

/// `caliban acp serve` with pipes, speaking raw JSON-RPC lines.
fn start_raw(ws: &Workspace, stub: &Stub, flags: &[&str]) -> Peer {
    let mut cmd = caliban(ws);
    anthropic(&mut cmd, stub);
    spawn_raw(cmd, flags)
}

/// `caliban acp serve` from a command with its environment already set.
fn spawn_raw(mut cmd: Command, flags: &[&str]) -> Peer {
    cmd.args(["acp", "serve"]).args(flags);
    Peer::spawn(cmd, RECV_TIMEOUT)
}

/// `initialize` (id 1) on the raw wire; its answer.
fn raw_initialize(raw: &mut Peer) -> Value {
    raw.send_line(r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":1,"clientCapabilities":{}}}"#);
    raw.recv()
}

/// `session/new` (id 2) in the workspace on the raw wire; the session id.
fn raw_new_session(raw: &mut Peer, ws: &Workspace) -> Value {
    raw.send_line(&format!(
        r#"{{"jsonrpc":"2.0","id":2,"method":"session/new","params":{{"cwd":{},"mcpServers":[]}}}}"#,
        json!(path_str(&ws.root))
    ));
    raw.recv()["result"]["sessionId"].clone()
}

/// The line of a `session/prompt` request `id` with one text block.
fn raw_prompt_line(id: u64, session: &Value, text: &str) -> String {
    format!(
        r#"{{"jsonrpc":"2.0","id":{id},"method":"session/prompt","params":{{"sessionId":{session},"prompt":[{{"type":"text","text":"{text}"}}]}}}}"#
    )
}

#[test]
fn acp_raw_wire_errors_are_answered_and_serving_goes_on() {
    let ws = Workspace::new("acp-raw");
    let stub = Stub::start(&ws, &script(vec![Turn::text("hi")]));
    let mut raw = start_raw(&ws, &stub, &[]);
    raw.send_line("{nope");
    let e = raw.recv();
    assert_eq!(
        (e["id"].clone(), e["error"]["code"].clone()),
        (Value::Null, json!(-32700))
    );
    raw.send_line("[1,2]");
    assert_eq!(raw.recv()["error"]["code"], -32600);
    raw.send_line(r#"{"jsonrpc":"2.0","id":5,"method":"no/such_method","params":{}}"#);
    let e = raw.recv();
    assert_eq!(
        (e["id"].clone(), e["error"]["code"].clone()),
        (json!(5), json!(-32601))
    );
    // Unknown notifications are ignored; the next answer is for the next request.
    raw.send_line(r#"{"jsonrpc":"2.0","method":"_vendor/ping","params":{}}"#);
    raw.send_line(r#"{"jsonrpc":"2.0","id":"i","method":"initialize","params":{"protocolVersion":1,"clientCapabilities":{}}}"#);
    let init = raw.recv();
    assert_eq!(init["id"], "i");
    assert_eq!(init["result"]["protocolVersion"], 1);
    raw.send_line(r#"{"jsonrpc":"2.0","id":6,"method":"session/prompt","params":{"sessionId":"nope","prompt":[{"type":"text","text":"x"}]}}"#);
    assert_eq!(raw.recv()["error"]["code"], -32002);
    raw.send_line(
        r#"{"jsonrpc":"2.0","id":7,"method":"session/new","params":{"cwd":"relative/dir","mcpServers":[]}}"#,
    );
    assert_eq!(raw.recv()["error"]["code"], -32602);
    raw.send_line(
        r#"{"jsonrpc":"2.0","id":8,"method":"session/new","params":{"cwd":"/","mcpServers":[]}}"#,
    );
    let outside = raw.recv();
    assert_eq!(outside["error"]["code"], -32602);
    assert!(
        outside["error"]["message"]
            .as_str()
            .unwrap()
            .contains("workspace"),
        "{outside}"
    );
    let (code, _) = raw.close();
    assert_eq!(code, Some(0));
}

/// With no model provider configured the agent still starts and answers `initialize` (an
/// editor shows a bare "agent crashed" for one that exits first); `session/new` and prompts
/// are refused with the message print mode gives, and the agent keeps serving.
#[test]
fn acp_without_a_provider_answers_initialize_and_says_what_to_set() {
    let ws = Workspace::new("acp-noprovider");
    let mut raw = spawn_raw(caliban(&ws), &[]);
    let init = raw_initialize(&mut raw);
    assert_eq!(init["id"], 1, "{init}");
    assert_eq!(init["result"]["protocolVersion"], 1, "{init}");
    let cwd = path_str(&ws.root);
    raw.send_line(
        &json!({"jsonrpc": "2.0", "id": 2, "method": "session/new",
                     "params": {"cwd": cwd, "mcpServers": []}})
        .to_string(),
    );
    let refused = raw.recv();
    assert_eq!(refused["id"], 2, "{refused}");
    assert_eq!(refused["error"]["code"], -32000, "{refused}");
    let message = refused["error"]["message"].as_str().unwrap_or_default();
    for what in [
        "no model provider is configured",
        "ANTHROPIC_API_KEY",
        "OPENAI_BASE_URL",
    ] {
        assert!(message.contains(what), "{what:?} missing: {message}");
    }
    raw.send_line(r#"{"jsonrpc":"2.0","id":3,"method":"session/prompt","params":{"sessionId":"s","prompt":[{"type":"text","text":"hi"}]}}"#);
    assert_eq!(raw.recv()["error"]["code"], -32000);
    // Still serving: sessions can be listed.
    raw.send_line(r#"{"jsonrpc":"2.0","id":4,"method":"session/list","params":{}}"#);
    assert_eq!(raw.recv()["result"], json!({"sessions": []}));
    let (code, _) = raw.close();
    assert_eq!(code, Some(0));
}

/// JSON-RPC 2.0 request ids are strings, any number, or null, and the answer carries the
/// id exactly as sent (`mcp serve` answers them the same way).
#[test]
fn acp_any_json_rpc_id_is_answered_as_sent() {
    let ws = Workspace::new("acp-ids");
    let stub = Stub::start(&ws, &script(vec![Turn::text("hi")]));
    let mut raw = start_raw(&ws, &stub, &[]);
    let init = r#""method":"initialize","params":{"protocolVersion":1,"clientCapabilities":{}}"#;
    for id in [
        "1.5",
        "1e23",
        "1.50",
        "-7.25",
        "18446744073709551616",
        "null",
    ] {
        raw.send_line(&format!(r#"{{"jsonrpc":"2.0","id":{id},{init}}}"#));
        let line = raw.recv_line();
        assert!(
            line.starts_with(&format!(r#"{{"id":{id},"jsonrpc":"2.0","result":{{"#)),
            "{id}: {line}"
        );
    }
    let (code, _) = raw.close();
    assert_eq!(code, Some(0));
}

#[test]
fn acp_stdin_eof_cancels_the_turn_and_kills_its_tools() {
    let ws = Workspace::new("acp-eof");
    let marker = format!("acp-eof-marker-{}", std::process::id());
    let stub = Stub::start(
        &ws,
        &script(vec![Turn::call(
            "toolu_e",
            "Bash",
            json!({"command": format!("sleep 30; echo {marker}")}),
        )]),
    );
    let mut raw = start_raw(&ws, &stub, &["--permission-mode", "bypassPermissions"]);
    raw_initialize(&mut raw);
    let session = raw_new_session(&mut raw, &ws);
    raw.send_line(&raw_prompt_line(3, &session, "sleep"));
    raw.recv_until(|f| f["params"]["update"]["status"] == "in_progress");
    assert!(process_with_marker_exists(&marker), "the command runs");
    let (code, took) = raw.close();
    assert_eq!(code, Some(0));
    assert!(took < Duration::from_secs(5), "exit took {took:?}");
    let (answer, _) = raw.recv_until(|f| f["id"] == 3);
    assert_eq!(answer["result"]["stopReason"], "cancelled");
    assert!(
        !process_with_marker_exists(&marker),
        "the command outlived caliban"
    );
}

#[test]
fn acp_closing_a_session_answers_the_prompt_queued_behind_a_cancel() {
    let ws = Workspace::new("acp-close-queued");
    let marker = format!("acp-close-queued-marker-{}", std::process::id());
    let stub = Stub::start(
        &ws,
        &script(vec![Turn::call(
            "toolu_c",
            "Bash",
            json!({"command": format!("sleep 30; echo {marker}")}),
        )]),
    );
    let mut raw = start_raw(&ws, &stub, &["--permission-mode", "bypassPermissions"]);
    raw_initialize(&mut raw);
    let session = raw_new_session(&mut raw, &ws);
    raw.send_line(&raw_prompt_line(3, &session, "sleep"));
    raw.recv_until(|f| f["params"]["update"]["status"] == "in_progress");
    // One write: the cancel, the next prompt (queued behind it) and the close.
    raw.send_line(&format!(
        "{}\n{}\n{}",
        format_args!(
            r#"{{"jsonrpc":"2.0","method":"session/cancel","params":{{"sessionId":{session}}}}}"#
        ),
        raw_prompt_line(4, &session, "next"),
        format_args!(
            r#"{{"jsonrpc":"2.0","id":5,"method":"session/close","params":{{"sessionId":{session}}}}}"#
        )
    ));
    let mut answered = std::collections::BTreeMap::new();
    while answered.len() < 3 {
        let (frame, _) = raw.recv_until(|f| f.get("id").is_some_and(|id| id.is_number()));
        answered.insert(frame["id"].as_i64().unwrap_or(-1), frame);
    }
    assert_eq!(
        answered[&3]["result"]["stopReason"], "cancelled",
        "{}",
        answered[&3]
    );
    assert_eq!(
        answered[&4]["result"]["stopReason"], "cancelled",
        "{}",
        answered[&4]
    );
    assert_eq!(answered[&5]["result"], json!({}), "{}", answered[&5]);
    let (code, _) = raw.close();
    assert_eq!(code, Some(0));
}

#[test]
fn acp_a_prompt_sent_right_after_a_cancel_runs_once_the_turn_has_ended() {
    // Editors cancel the running turn and send the next prompt back to back.
    let ws = Workspace::new("acp-cancel-then-prompt");
    let marker = format!("acp-queued-marker-{}", std::process::id());
    let stub = Stub::start(
        &ws,
        &script(vec![
            Turn::call(
                "toolu_q",
                "Bash",
                json!({"command": format!("sleep 30; echo {marker}")}),
            ),
            Turn::text("the second prompt's answer"),
        ]),
    );
    let mut raw = start_raw(&ws, &stub, &["--permission-mode", "bypassPermissions"]);
    raw_initialize(&mut raw);
    let session = raw_new_session(&mut raw, &ws);
    raw.send_line(&raw_prompt_line(3, &session, "sleep"));
    raw.recv_until(|f| f["params"]["update"]["status"] == "in_progress");
    // One write, two lines: the cancel and the next prompt.
    raw.send_line(&format!(
        "{}\n{}",
        format_args!(
            r#"{{"jsonrpc":"2.0","method":"session/cancel","params":{{"sessionId":{session}}}}}"#
        ),
        raw_prompt_line(4, &session, "next")
    ));
    let (first, _) = raw.recv_until(|f| f["id"] == 3);
    assert_eq!(first["result"]["stopReason"], "cancelled", "{first}");
    let (second, updates) = raw.recv_until(|f| f["id"] == 4);
    assert_eq!(second["result"]["stopReason"], "end_turn", "{second}");
    let text: String = updates
        .iter()
        .filter(|u| u["params"]["update"]["sessionUpdate"] == "agent_message_chunk")
        .filter_map(|u| u["params"]["update"]["content"]["text"].as_str())
        .collect();
    assert_eq!(text, "the second prompt's answer");
    assert!(
        !process_with_marker_exists(&marker),
        "the cancelled Bash survived"
    );
    let (code, _) = raw.close();
    assert_eq!(code, Some(0));
}

#[test]
fn acp_exits_when_the_editor_stops_reading_its_stdout() {
    // An editor that crashed closes our stdout before our stdin: nobody can be answered.
    let ws = Workspace::new("acp-stdout-gone");
    let stub = Stub::start(&ws, &script(vec![Turn::text("hi")]));
    let mut cmd = caliban(&ws);
    cmd.env("ANTHROPIC_BASE_URL", &stub.url)
        .args(["acp", "serve"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null());
    let mut child = cmd.spawn().expect("spawn acp serve");
    drop(child.stdout.take());
    let mut stdin = child.stdin.take().expect("stdin");
    stdin
        .write_all(
            b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"initialize\",\"params\":{\"protocolVersion\":1,\"clientCapabilities\":{}}}\n",
        )
        .expect("write");
    stdin.flush().expect("flush");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "acp serve kept running with nobody reading its stdout"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(status.code().is_some(), "exited normally: {status:?}");
    drop(stdin);
}

/// Live (not zombie) processes whose environment holds `marker`.
fn processes_with_env_marker(marker: &str) -> Vec<u32> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return found;
    };
    for entry in entries.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(environ) = std::fs::read(entry.path().join("environ")) else {
            continue;
        };
        if !environ
            .split(|&b| b == 0)
            .any(|var| var == marker.as_bytes())
        {
            continue;
        }
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        let state = stat.rsplit(')').next().unwrap_or_default().trim_start();
        if !state.starts_with('Z') {
            found.push(pid);
        }
    }
    found
}

#[test]
fn acp_session_mcp_servers_offer_their_tools_to_the_model() {
    let ws = Workspace::new("acp-mcp-servers");
    let stub = Stub::start(
        &ws,
        &script(vec![
            Turn::call(
                "toolu_m",
                "mcp__inner__caliban_status",
                json!({"run_id": "run-999"}),
            ),
            Turn::text("The inner server does not know that run."),
        ]),
    );
    let marker = format!("CALIBAN_ACP_MCP_MARKER={}", std::process::id());
    let (marker_name, marker_value) = marker.split_once('=').unwrap();
    let mut raw = start_raw(&ws, &stub, &["--permission-mode", "bypassPermissions"]);
    raw_initialize(&mut raw);
    let servers = json!([
        {"name": "inner", "command": BIN, "args": ["mcp", "serve"],
         "env": [{"name": "ANTHROPIC_BASE_URL", "value": stub.url},
                 {"name": marker_name, "value": marker_value}]},
        {"type": "http", "name": "remote", "url": "http://127.0.0.1:9/mcp", "headers": []},
    ]);
    raw.send_line(
        &json!({"jsonrpc": "2.0", "id": 2, "method": "session/new",
                "params": {"cwd": path_str(&ws.root), "mcpServers": servers}})
        .to_string(),
    );
    let session = raw.recv()["result"]["sessionId"].clone();
    assert!(session.is_string(), "{session}");
    // Sent at once: the prompt waits for the server to list its tools.
    raw.send_line(
        &json!({"jsonrpc": "2.0", "id": 3, "method": "session/prompt",
                "params": {"sessionId": session,
                           "prompt": [{"type": "text", "text": "status of run-999"}]}})
        .to_string(),
    );
    let (answer, updates) = raw.recv_until(|f| f["id"] == 3);
    assert_eq!(answer["result"]["stopReason"], "end_turn", "{answer}");
    assert_eq!(
        processes_with_env_marker(&marker).len(),
        1,
        "the inner server runs while the session is open"
    );
    // The model was offered the server's tools under their prefixed names.
    let first = &stub.requests()[0]["body"];
    let tools: Vec<&str> = first["tools"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|t| t["name"].as_str())
        .collect();
    assert!(tools.contains(&"Bash"), "{tools:?}");
    assert!(tools.contains(&"mcp__inner__caliban_status"), "{tools:?}");
    let status = first["tools"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "mcp__inner__caliban_status")
        .unwrap();
    assert!(
        status["input_schema"]["properties"]["run_id"].is_object(),
        "{status}"
    );
    // The call went to the server, and its answer is the tool result.
    let done = updates
        .iter()
        .map(|f| &f["params"]["update"])
        .rfind(|u| u["toolCallId"] == "toolu_m")
        .expect("updates for the MCP call");
    let sent = flat(&request_messages(&stub, 1));
    assert!(sent.contains("unknown run_id: run-999"), "{sent}");
    assert_eq!(done["status"], "failed", "{done}");
    assert!(
        done.to_string().contains("unknown run_id: run-999"),
        "{done}"
    );
    let (code, _) = raw.close();
    assert_eq!(code, Some(0));
    assert_eq!(
        processes_with_env_marker(&marker),
        Vec::<u32>::new(),
        "the inner MCP server outlived caliban"
    );
}

#[test]
fn acp_mcp_servers_run_in_the_sandbox_the_settings_give_them() {
    let ws = Workspace::new("acp-mcp-sandbox");
    let stub = Stub::start(
        &ws,
        &script(vec![
            Turn::call(
                "toolu_m",
                "mcp__inner__caliban_status",
                json!({"run_id": "run-7"}),
            ),
            Turn::text("ok"),
        ]),
    );
    ws.write(
        "home/.config/caliban/settings.json",
        r#"{"sandbox": {"mcp_servers": "workspace-write"}}"#,
    );
    let outside = outside_root().join(format!("acp-mcp-outside-{}", std::process::id()));
    let _ = std::fs::remove_file(&outside);
    let state = format!("/tmp/caliban-acp-mcp-state-{}", std::process::id());
    // The server tries a write outside the workspace before it starts serving.
    let start = format!(
        "echo x > {} 2>/dev/null; echo in > mcp-ran; exec {BIN} mcp serve",
        outside.display()
    );
    let mut raw = start_raw(&ws, &stub, &["--permission-mode", "bypassPermissions"]);
    raw_initialize(&mut raw);
    // Settings of its own: caliban's are on the deny list, which a confined root cannot
    // enter any more than another user can.
    let config = ws.path("inner-config");
    std::fs::create_dir_all(&config).expect("mkdir");
    let servers = json!([
        {"name": "inner", "command": "/bin/sh", "args": ["-c", start],
         "env": [{"name": "ANTHROPIC_BASE_URL", "value": stub.url},
                 {"name": "XDG_STATE_HOME", "value": state},
                 {"name": "XDG_CONFIG_HOME", "value": path_str(&config)}]},
    ]);
    raw.send_line(
        &json!({"jsonrpc": "2.0", "id": 2, "method": "session/new",
                "params": {"cwd": path_str(&ws.root), "mcpServers": servers}})
        .to_string(),
    );
    let session = raw.recv()["result"]["sessionId"].clone();
    raw.send_line(
        &json!({"jsonrpc": "2.0", "id": 3, "method": "session/prompt",
                "params": {"sessionId": session,
                           "prompt": [{"type": "text", "text": "status of run-7"}]}})
        .to_string(),
    );
    let (answer, _) = raw.recv_until(|f| f["id"] == 3);
    assert_eq!(answer["result"]["stopReason"], "end_turn", "{answer}");
    // It served, wrote in the workspace, and could not write outside it.
    let sent = flat(&request_messages(&stub, 1));
    assert!(sent.contains("unknown run_id: run-7"), "{sent}");
    assert!(ws.path("mcp-ran").exists());
    assert!(
        !outside.exists(),
        "the MCP server wrote outside its sandbox"
    );
    let (code, _) = raw.close();
    assert_eq!(code, Some(0));
    let _ = std::fs::remove_dir_all(&state);
}

#[test]
fn acp_mcp_servers_that_fail_do_not_hold_up_prompts() {
    let ws = Workspace::new("acp-mcp-fail");
    let stub = Stub::start(&ws, &script(vec![Turn::text("no tools, still fine")]));
    let mut raw = start_raw(&ws, &stub, &[]);
    raw_initialize(&mut raw);
    let servers = json!([
        {"name": "missing", "command": "/nonexistent/mcp-server", "args": [], "env": []},
        {"name": "quitter", "command": "/bin/sh", "args": ["-c", "exit 3"], "env": []},
        {"name": "babbler", "command": "/bin/sh", "args": ["-c", "echo not-json; sleep 0.2"],
         "env": []},
    ]);
    raw.send_line(
        &json!({"jsonrpc": "2.0", "id": 2, "method": "session/new",
                "params": {"cwd": path_str(&ws.root), "mcpServers": servers}})
        .to_string(),
    );
    let session = raw.recv()["result"]["sessionId"].clone();
    let start = Instant::now();
    raw.send_line(
        &json!({"jsonrpc": "2.0", "id": 3, "method": "session/prompt",
                "params": {"sessionId": session,
                           "prompt": [{"type": "text", "text": "hello"}]}})
        .to_string(),
    );
    let (answer, _) = raw.recv_until(|f| f["id"] == 3);
    assert_eq!(answer["result"]["stopReason"], "end_turn", "{answer}");
    assert!(
        start.elapsed() < Duration::from_secs(8),
        "{:?}",
        start.elapsed()
    );
    let tools = stub.requests()[0]["body"]["tools"].to_string();
    assert!(!tools.contains("mcp__"), "{tools}");
    let (code, _) = raw.close();
    assert_eq!(code, Some(0));
}

// ---- the agent for long work (issue 14) ------------------------------------------------------

/// A session whose second prompt outgrows a 10,000-token window twice compacts on its own
/// twice in that one run, going on after each; `/compact` compacts it a third time; after a
/// restart `session/load` replays the summary (a `compaction_update` for a client that shows
/// them) and the next prompt continues from the latest summary alone.
#[test]
fn acp_compaction_auto_and_by_command_survives_session_load() {
    let ws = Workspace::new("acp-compact");
    ws.write(".caliban/settings.json", r#"{"context_window": 10000}"#);
    for (name, marker) in [
        ("a.txt", "AAA"),
        ("b.txt", "BBB"),
        ("c.txt", "CCC"),
        ("d.txt", "DDD"),
    ] {
        crate::util::big_file(&ws, name, marker);
    }
    let read = |id: &str, path: &str| Turn::bare().calling([Call::read(id, path)]);
    let stub = Stub::start(
        &ws,
        &script(vec![
            read("ta", "a.txt"),
            Turn::bare().say("ok one"),
            read("tb", "b.txt"),
            Turn::bare().say("SUMMARY-ONE"),
            read("tc", "c.txt"),
            read("td", "d.txt"),
            Turn::bare().say("SUMMARY-TWO"),
            Turn::bare().say("ok two"),
            Turn::bare().say("SUMMARY-THREE"),
            Turn::bare().say("ok four"),
        ]),
    );
    let r = drive(
        &ws,
        &stub,
        json!({"scenario": "restart", "prompts": ["one", "two", "/compact"], "after": "four",
               "caps": {"session": {"compaction": {}}}}),
    );
    let first = &r["first"];
    let end_turn = json!({"stopReason": "end_turn"});
    assert_eq!(first["stops"], json!([end_turn, end_turn, end_turn]));
    assert_eq!(
        text_of(&first["updates"], "agent_message_chunk"),
        "ok oneok two"
    );
    // Each compaction is one entity: `in_progress` when it starts, then `completed`.
    let updates = of_kind(&first["updates"], "compaction_update");
    let started: Vec<&Value> = updates
        .iter()
        .filter(|u| u["status"] == "in_progress")
        .copied()
        .collect();
    let compactions: Vec<&Value> = updates
        .iter()
        .filter(|u| u["status"] == "completed")
        .copied()
        .collect();
    assert_eq!(
        (started.len(), compactions.len()),
        (3, 3),
        "{}",
        first["updates"]
    );
    for (s, c) in started.iter().zip(&compactions) {
        assert_eq!(s["compactionId"], c["compactionId"]);
    }
    let expected = [
        ("SUMMARY-ONE", "auto"),
        ("SUMMARY-TWO", "auto"),
        ("SUMMARY-THREE", "manual"),
    ];
    for (c, (summary, trigger)) in compactions.iter().zip(expected) {
        assert_eq!(c["status"], "completed");
        assert_eq!(c["summary"], json!([{"type": "text", "text": summary}]));
        assert_eq!(c["_meta"]["caliban/compaction"]["trigger"], trigger);
    }
    assert_ne!(
        compactions[0]["compactionId"],
        compactions[1]["compactionId"]
    );
    // The context meter follows the conversation, and drops with each compaction.
    let usage: Vec<u64> = of_kind(&first["updates"], "usage_update")
        .iter()
        .map(|u| {
            assert_eq!(u["size"], 10000);
            u["used"].as_u64().unwrap()
        })
        .collect();
    // Per turn and compaction: Read a, "ok one", Read b, compaction, Read c, Read d,
    // compaction, "ok two", compaction.
    assert_eq!(usage.len(), 9, "{usage:?}");
    assert!(usage[1] > 5000 && usage[5] > 4000, "{usage:?}");
    // After a compaction the context is what the first request held (the system prompt
    // and the tools, about 2,400 tokens with the long-work tools) and a summary; a big
    // file is about 3,000.
    for at in [3, 6, 8] {
        assert!(
            usage[at] < usage[0] + 1500,
            "a compaction empties the context: {usage:?}"
        );
    }
    // Within the run, the request after each automatic compaction holds its summary and
    // not what it summarised.
    let after_one = flat(&request_messages(&stub, 4));
    assert!(
        after_one.contains("SUMMARY-ONE") && !after_one.contains("BBB"),
        "{after_one}"
    );
    let after_two = flat(&request_messages(&stub, 7));
    assert!(
        after_two.contains("SUMMARY-TWO") && !after_two.contains("DDD"),
        "{after_two}"
    );
    // The replay shows the summary where the conversation it replaced was.
    let second = &r["second"];
    let kinds: Vec<&str> = second["replay"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|u| u["sessionUpdate"].as_str())
        .collect();
    assert_eq!(kinds, ["compaction_update"], "{}", second["replay"]);
    assert_eq!(second["replay"][0]["summary"][0]["text"], "SUMMARY-THREE");
    assert_eq!(second["stop"], end_turn);
    assert_eq!(
        text_of(&second["updates"], "agent_message_chunk"),
        "ok four"
    );
    let after = flat(&request_messages(&stub, 9));
    assert!(
        after.contains("SUMMARY-THREE") && after.contains("four"),
        "{after}"
    );
    for gone in [
        "AAA",
        "BBB",
        "CCC",
        "DDD",
        "SUMMARY-ONE",
        "SUMMARY-TWO",
        "ok one",
    ] {
        assert!(!after.contains(gone), "{gone} was summarised away: {after}");
    }
}

/// What an editor shows for caliban: `/` commands, model and thinking selectors that
/// change the model's requests, a title and a context meter per turn, slash commands
/// answered without a model turn, and `session/delete`.
#[test]
fn acp_editor_commands_selectors_usage_title_and_delete() {
    let ws = Workspace::new("acp-editor");
    ws.write(
        ".caliban/settings.json",
        r#"{"model": "claude-sonnet-4-5", "models": ["claude-haiku-4-5"]}"#,
    );
    let stub = Stub::start(
        &ws,
        &script(vec![Turn::text("hi there"), Turn::text("again to you")]),
    );
    let r = drive(
        &ws,
        &stub,
        json!({"scenario": "editor", "model": "claude-haiku-4-5",
               "prompts": ["hello there\nsecond line", "/model", "/plan",
                           "/model claude-sonnet-4-5", "again"]}),
    );
    assert_eq!(
        r["init"]["agentCapabilities"]["sessionCapabilities"]["delete"],
        json!({})
    );
    assert_eq!(
        r["init"]["agentCapabilities"]["promptCapabilities"]["image"],
        true
    );
    let options = r["session"]["configOptions"].as_array().unwrap();
    let ids: Vec<(&str, &str)> = options
        .iter()
        .map(|o| {
            (
                o["id"].as_str().unwrap(),
                o["category"].as_str().unwrap_or(""),
            )
        })
        .collect();
    // The sandbox has no ACP category (it is not a mode, a model or a thought level).
    assert_eq!(
        ids,
        [
            ("mode", "mode"),
            ("model", "model"),
            ("thought_level", "thought_level"),
            ("sandbox", "")
        ]
    );
    let models: Vec<&str> = options[1]["options"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|o| o["value"].as_str())
        .collect();
    assert_eq!(models, ["claude-sonnet-4-5", "claude-haiku-4-5"]);
    assert_eq!(options[1]["currentValue"], "claude-sonnet-4-5");
    assert_eq!(options[2]["currentValue"], "off");
    assert_eq!(
        r["setModel"]["configOptions"][1]["currentValue"],
        "claude-haiku-4-5"
    );
    assert_eq!(r["setThought"]["configOptions"][2]["currentValue"], "high");
    assert_eq!(r["badModel"]["code"], -32602);
    // The commands an editor completes after `/`.
    let commands = of_kind(&r["updates"], "available_commands_update");
    let names: Vec<&str> = commands[0]["availableCommands"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|c| c["name"].as_str())
        .collect();
    for name in ["compact", "model", "mode", "default", "acceptEdits", "plan"] {
        assert!(names.contains(&name), "{name} missing from {names:?}");
    }
    assert!(
        r["stops"]
            .as_array()
            .unwrap()
            .iter()
            .all(|s| s["stopReason"] == "end_turn")
    );
    // The title, once, from the first prompt's first line.
    let titles = of_kind(&r["updates"], "session_info_update");
    assert_eq!(titles.len(), 1, "{}", r["updates"]);
    assert_eq!(titles[0]["title"], "hello there");
    // A context meter per model turn, with the cost at list prices.
    let usage = of_kind(&r["updates"], "usage_update");
    assert_eq!(usage.len(), 2, "{}", r["updates"]);
    assert_eq!(usage[0]["size"], 200_000);
    assert_eq!(usage[0]["used"], 17);
    assert_eq!(usage[0]["cost"]["currency"], "USD");
    assert!(usage[1]["cost"]["amount"].as_f64().unwrap() > 0.0);
    // Slash commands: answered here, with what is now set.
    let said = text_of(&r["updates"], "agent_message_chunk");
    assert!(
        said.contains("Model: claude-haiku-4-5. Available: claude-sonnet-4-5, claude-haiku-4-5"),
        "{said}"
    );
    assert!(
        said.contains("Mode: plan") && said.contains("Model: claude-sonnet-4-5"),
        "{said}"
    );
    let modes = of_kind(&r["updates"], "current_mode_update");
    assert_eq!(modes[0]["currentModeId"], "plan");
    assert!(!of_kind(&r["updates"], "config_option_update").is_empty());
    // The selectors reach the model: the chosen model and a thinking budget, and the
    // later switch applies to the live run's next request.
    let requests = stub.requests();
    assert_eq!(requests.len(), 2, "slash commands ask no model");
    assert_eq!(requests[0]["body"]["model"], "claude-haiku-4-5");
    assert_eq!(
        requests[0]["body"]["thinking"],
        json!({"type": "enabled", "budget_tokens": 4096})
    );
    assert_eq!(requests[1]["body"]["model"], "claude-sonnet-4-5");
    // session/delete: gone from the list, and not loadable.
    assert_eq!(r["list"]["sessions"].as_array().unwrap().len(), 1);
    assert_eq!(r["deleted"], json!({}));
    assert_eq!(r["listAfter"]["sessions"], json!([]));
    assert_eq!(r["loadDeleted"]["code"], -32002);
}

/// Image blocks in a prompt (`promptCapabilities.image`) reach the model and come back in a
/// `session/load` replay and in the continued conversation; one the model could not take is
/// refused with the reason.
#[test]
fn acp_image_prompts_reach_the_model_and_survive_load() {
    use crate::util::PNG;
    let ws = Workspace::new("acp-image");
    let stub = Stub::start(
        &ws,
        &script(vec![Turn::text("a red dot"), Turn::text("still a red dot")]),
    );
    let r = drive(
        &ws,
        &stub,
        json!({"scenario": "restart", "after": "and now?", "prompts": [
            [{"type": "text", "text": "what is this?"},
             {"type": "image", "mimeType": "image/png", "data": PNG}],
            [{"type": "image", "mimeType": "image/tiff", "data": "AAAA"}],
        ]}),
    );
    let stops = &r["first"]["stops"];
    assert_eq!(stops[0], json!({"stopReason": "end_turn"}));
    assert_eq!(stops[1]["error"]["code"], -32602, "{stops}");
    assert!(
        stops[1]["error"]["message"]
            .as_str()
            .unwrap()
            .contains("unsupported image type `image/tiff`"),
        "{stops}"
    );
    let first = request_messages(&stub, 0);
    assert_eq!(first[0]["content"][0]["text"], "what is this?");
    assert_eq!(first[0]["content"][1]["source"]["data"], PNG);
    let replay = &r["second"]["replay"];
    assert_eq!(replay[1]["sessionUpdate"], "user_message_chunk", "{replay}");
    assert_eq!(
        replay[1]["content"],
        json!({"type": "image", "mimeType": "image/png", "data": PNG})
    );
    let after = request_messages(&stub, 1);
    assert_eq!(after[0]["content"][1]["source"]["data"], PNG, "{after:?}");
}

/// A compaction the model cannot summarise fails the prompt with the reason, and a client
/// that shows compactions sees it go from `in_progress` to `failed`.
#[test]
fn acp_failed_compaction_is_shown_and_fails_the_prompt() {
    let ws = Workspace::new("acp-compact-failed");
    let stub = Stub::start(
        &ws,
        &script(vec![
            Turn::text("ok"),
            Turn::bare().fault(Fault::Status(400)),
        ]),
    );
    let r = drive(
        &ws,
        &stub,
        json!({"scenario": "prompts", "caps": {"session": {"compaction": {}}},
               "prompts": ["one", [{"type": "text", "text": "/compact"}]]}),
    );
    assert_eq!(r["stops"][0], json!({"stopReason": "end_turn"}));
    let error = &r["stops"][1]["error"];
    assert!(
        error["message"]
            .as_str()
            .unwrap()
            .starts_with("compaction failed"),
        "{error}"
    );
    let updates = of_kind(&r["updates"], "compaction_update");
    let statuses: Vec<&str> = updates
        .iter()
        .filter_map(|u| u["status"].as_str())
        .collect();
    assert_eq!(statuses, ["in_progress", "failed"], "{}", r["updates"]);
    assert_eq!(updates[0]["compactionId"], updates[1]["compactionId"]);
    assert!(updates[1]["error"].is_string());
}

#[test]
fn acp_session_http_mcp_server_is_called_and_capabilities_say_so() {
    let ws = Workspace::new("acp-mcp-http");
    let server = crate::util::mcp::PyHttp::start("http", &ws.root);
    let stub = Stub::start(
        &ws,
        &script(vec![
            Turn::call("toolu_h", "mcp__web__echo", json!({"text": "from acp"})),
            Turn::text("done"),
        ]),
    );
    let mut raw = start_raw(&ws, &stub, &["--permission-mode", "bypassPermissions"]);
    let init = raw_initialize(&mut raw);
    assert_eq!(
        init["result"]["agentCapabilities"]["mcpCapabilities"],
        json!({"http": true, "sse": true}),
        "{init}"
    );
    let servers = json!([{"type": "http", "name": "web", "url": server.url,
                          "headers": [{"name": "X-Editor", "value": "test"}]}]);
    raw.send_line(
        &json!({"jsonrpc": "2.0", "id": 2, "method": "session/new",
                "params": {"cwd": path_str(&ws.root), "mcpServers": servers}})
        .to_string(),
    );
    let session = raw.recv()["result"]["sessionId"].clone();
    raw.send_line(
        &json!({"jsonrpc": "2.0", "id": 3, "method": "session/prompt",
                "params": {"sessionId": session,
                           "prompt": [{"type": "text", "text": "echo"}]}})
        .to_string(),
    );
    let (answer, updates) = raw.recv_until(|f| f["id"] == 3);
    assert_eq!(answer["result"]["stopReason"], "end_turn", "{answer}");
    let opening = updates
        .iter()
        .map(|f| &f["params"]["update"])
        .find(|u| u["sessionUpdate"] == "tool_call" && u["toolCallId"] == "toolu_h")
        .expect("a tool_call card for the MCP call");
    assert_eq!(opening["kind"], "other", "{opening}");
    assert_eq!(opening["title"], "mcp__web__echo", "{opening}");
    let sent = flat(&request_messages(&stub, 1));
    assert!(sent.contains("echo: from acp"), "{sent}");
    // Closing the session stops its servers: the HTTP one's session is ended with a
    // DELETE while caliban goes on.
    raw.send_line(
        &json!({"jsonrpc": "2.0", "id": 4, "method": "session/close",
                "params": {"sessionId": session}})
        .to_string(),
    );
    let (closed, _) = raw.recv_until(|f| f["id"] == 4);
    assert_eq!(closed["result"], json!({}), "{closed}");
    server.assert_session_deleted(&ws.root);
    let (code, _) = raw.close();
    assert_eq!(code, Some(0));
}

/// A workspace's own MCP server (`.mcp.json`) needs the user's approval: the editor is
/// asked once with `session/request_permission`; a rejection leaves it out and the session
/// says so, "always allow" starts it for the live session and records the approval in the
/// file `--approve-mcp` writes, so a later process asks no more, and "always reject" is
/// recorded there too, so a later process does not ask about it again either.
#[test]
fn acp_workspace_mcp_servers_are_approved_by_the_editor_once() {
    let ws = Workspace::new("acp-mcp-approve");
    ws.write(
        ".mcp.json",
        &json!({"mcpServers": {"proj": crate::util::mcp::stdio_server(&ws.root),
                                "zother": crate::util::mcp::stdio_server(&ws.root)}})
        .to_string(),
    );
    let approvals = ws.path("home/.state/caliban/mcp-approvals.json");
    let card = "caliban-mcp-approval-proj";
    let flags = ["--allow", "mcp__proj__*"];
    let offered = |stub: &Stub, n: usize| -> Vec<String> {
        stub.requests()[n]["body"]["tools"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|t| t["name"].as_str())
            .filter(|t| t.starts_with("mcp__"))
            .map(str::to_owned)
            .collect()
    };
    let card_updates = |r: &Value| -> Vec<Value> {
        tool_updates(&r["updates"], card)
            .into_iter()
            .cloned()
            .collect()
    };

    // Rejected: not started, and the session says so on the server's card; the other
    // server is rejected for good.
    let stub = Stub::start(&ws, &script(vec![Turn::text("without it")]));
    let r = drive(
        &ws,
        &stub,
        json!({"scenario": "prompts", "agent": agent(&flags), "prompts": ["hello"],
               "answers": ["reject", "reject_always"]}),
    );
    let asks = r["permissions"].as_array().unwrap();
    assert_eq!(asks.len(), 2, "{asks:?}");
    assert_eq!(
        asks[1]["toolCall"]["toolCallId"],
        "caliban-mcp-approval-zother"
    );
    assert_eq!(asks[0]["toolCall"]["toolCallId"], card);
    let title = asks[0]["toolCall"]["title"].as_str().unwrap();
    assert!(
        title.starts_with("Start MCP server `proj` from the workspace"),
        "{title}"
    );
    let kinds: Vec<&str> = asks[0]["options"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["kind"].as_str().unwrap())
        .collect();
    assert_eq!(
        kinds,
        ["allow_once", "allow_always", "reject_once", "reject_always"]
    );
    let updates = card_updates(&r);
    assert_eq!(updates.len(), 1, "{updates:?}");
    assert_eq!(updates[0]["status"], "failed");
    assert!(
        updates[0].to_string().contains("was not approved"),
        "{}",
        updates[0]
    );
    assert!(offered(&stub, 0).is_empty(), "{:?}", offered(&stub, 0));
    let recorded = std::fs::read_to_string(&approvals).expect("the rejection was recorded");
    let file: Value = serde_json::from_str(&recorded).expect("the approvals file is JSON");
    let key = ws.root.display().to_string();
    assert_eq!(file[&key]["zother"]["rejected"], true, "{recorded}");
    assert!(
        !recorded.contains("\"proj\""),
        "a plain rejection records nothing: {recorded}"
    );

    // Always allowed: the live session's next turn has its tools, and the approval is kept.
    let stub = Stub::start(
        &ws,
        &script(vec![
            Turn::text("first"),
            Turn::call("toolu_p", "mcp__proj__echo", json!({"text": "approved"})),
            Turn::text("done"),
        ]),
    );
    let r = drive(
        &ws,
        &stub,
        json!({"scenario": "prompts", "agent": agent(&flags), "prompts": ["one", "two"],
               "answers": ["allow_always"]}),
    );
    // Only `proj` is asked about: `zother` was rejected for good.
    let asks = r["permissions"].as_array().unwrap();
    assert_eq!(asks.len(), 1, "{asks:?}");
    assert_eq!(asks[0]["toolCall"]["toolCallId"], card);
    let updates = card_updates(&r);
    assert_eq!(updates.len(), 1, "{updates:?}");
    assert_eq!(updates[0]["status"], "completed");
    assert!(offered(&stub, 1).contains(&"mcp__proj__echo".to_owned()));
    assert!(
        !offered(&stub, 1)
            .iter()
            .any(|t| t.starts_with("mcp__zother__"))
    );
    let sent = flat(&request_messages(&stub, 2));
    assert!(sent.contains("echo: approved"), "{sent}");
    let recorded = std::fs::read_to_string(&approvals).expect("the approval was recorded");
    assert!(recorded.contains("\"proj\""), "{recorded}");

    // A later process asks no more.
    let stub = Stub::start(
        &ws,
        &script(vec![
            Turn::call("toolu_q", "mcp__proj__echo", json!({"text": "remembered"})),
            Turn::text("done"),
        ]),
    );
    let r = drive(
        &ws,
        &stub,
        json!({"scenario": "prompts", "agent": agent(&flags), "prompts": ["three"]}),
    );
    assert_eq!(r["permissions"], json!([]));
    let sent = flat(&request_messages(&stub, 1));
    assert!(sent.contains("echo: remembered"), "{sent}");
}
