//! Tool results that carry pictures, end to end: the real binary, `caliban stub-model`
//! asking for the calls and recording what it was sent, and a real MCP server written with
//! the official Python SDK (`tests/tool_results/server.py`, in the venv `tests/mcp_client.rs`
//! installs). An image must reach the model as an image in each provider's wire shape:
//! inside the `tool_result` on Anthropic's, in a `user` message after the turn's `tool`
//! messages on OpenAI's. `Read` of a PNG does the same; what cannot go is refused in words.

use std::process::Command;

use serde_json::{Value, json};

use crate::util::mcp::python;
use crate::util::*;

/// The 1×1 PNG `server.py` sends, as base64.
const PNG: &str = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==";

fn picture_server(ws: &Workspace) -> String {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/tool_results/server.py");
    let config = json!({"mcpServers": {"pics": {"command": path_str(python()), "args": [script]}}});
    ws.write("mcp.json", &config.to_string());
    path_str(&ws.path("mcp.json"))
}

/// Print mode on `wire`, the model calling the picture server's `tools` (ids t1, t2, …)
/// in one turn and then finishing; the run's output and the stub that recorded it.
fn call_pictures(ws: &Workspace, wire: &str, tools: &[&str]) -> (Output, Stub) {
    let batch = tools.iter().enumerate().map(|(i, tool)| {
        let (id, name) = (format!("t{}", i + 1), format!("mcp__pics__{tool}"));
        Call::new(&id, &name, json!({}))
    });
    let stub = Stub::start(ws, &calls_then_done(batch));
    let cfg = picture_server(ws);
    let out = print_run(
        ws,
        &stub,
        wire,
        &["--mcp-config", &cfg, "--allow", "mcp__pics__*"],
    );
    (out, stub)
}

/// Print mode against the stub on `wire` ("anthropic" or "openai"), streaming frames.
fn print_run(ws: &Workspace, stub: &Stub, wire: &str, args: &[&str]) -> Output {
    let mut cmd: Command = caliban(ws);
    match wire {
        "openai" => {
            openai(&mut cmd, stub);
            cmd.args(["--provider", "openai"]);
        }
        _ => anthropic(&mut cmd, stub),
    }
    cmd.args(["-p", "--output-format", "stream-json"])
        .args(args)
        .arg("look at it");
    let out = run(cmd, "");
    assert_eq!(out.code, Some(0), "{out:?}");
    out
}

/// The messages of the last request the model was sent.
fn last_messages(stub: &Stub) -> Vec<Value> {
    let requests = stub.requests();
    let last = requests.last().expect("the model was asked");
    last["body"]["messages"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// The Anthropic `tool_result` block answering `id`.
fn anthropic_result(messages: &[Value], id: &str) -> Value {
    messages
        .iter()
        .flat_map(|m| m["content"].as_array().cloned().unwrap_or_default())
        .find(|b| b["type"] == "tool_result" && b["tool_use_id"] == id)
        .unwrap_or_else(|| panic!("no tool_result for {id} in {messages:?}"))
}

fn anthropic_image(media_type: &str, data: &str) -> Value {
    json!({"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}})
}

#[test]
fn tool_results_mcp_images_reach_the_model_on_the_anthropic_wire() {
    let ws = Workspace::new("results-anthropic");
    let (out, stub) = call_pictures(&ws, "anthropic", &["shot", "mixed"]);
    let messages = last_messages(&stub);
    assert_eq!(
        anthropic_result(&messages, "t1")["content"],
        json!([{"type": "text", "text": "a screenshot"}, anthropic_image("image/png", PNG)])
    );
    let mixed = anthropic_result(&messages, "t2");
    let content = mixed["content"].as_array().unwrap();
    assert_eq!(
        content.last().unwrap(),
        &anthropic_image("image/png", PNG),
        "{mixed}"
    );
    let text = texts(&mixed["content"]);
    for line in [
        "[resource file:///report.pdf (application/pdf, 8 bytes of base64) not shown",
        "[audio audio/wav (8 bytes of base64) not shown: the model takes no audio]",
        "[resource link file:///big.csv big.csv]",
        "[resource file:///notes.txt]\nresource body",
    ] {
        assert!(text.contains(line), "{line:?} in {text}");
    }
    // Print mode's tool_result frame carries the picture as the model got it.
    let frame = out
        .frames()
        .into_iter()
        .find(|f| f["type"] == "tool_result" && f["tool_use_id"] == "t1")
        .expect("a tool_result frame");
    assert_eq!(frame["content"][1], anthropic_image("image/png", PNG));
}

#[test]
fn tool_results_mcp_images_reach_the_model_on_the_openai_wire() {
    let ws = Workspace::new("results-openai");
    let (_, stub) = call_pictures(&ws, "openai", &["shot", "mixed"]);
    let messages = last_messages(&stub);
    let at = messages
        .iter()
        .position(|m| m["role"] == "assistant" && m["tool_calls"].is_array())
        .expect("the assistant's calls");
    // Both tool messages straight after the calls, then one user message with the images.
    let after = &messages[at + 1..];
    assert_eq!(
        after
            .iter()
            .map(|m| m["role"].as_str().unwrap())
            .collect::<Vec<_>>(),
        ["tool", "tool", "user"],
        "{after:?}"
    );
    assert_eq!(after[0]["tool_call_id"], "t1");
    assert_eq!(
        after[0]["content"],
        "a screenshot\n[1 image(s) of this result follow in the next user message]"
    );
    assert_eq!(after[1]["tool_call_id"], "t2");
    assert!(
        after[1]["content"]
            .as_str()
            .unwrap()
            .contains("[resource link file:///big.csv big.csv]")
    );
    let url = json!({"type": "image_url",
                     "image_url": {"url": format!("data:image/png;base64,{PNG}")}});
    assert_eq!(
        after[2]["content"],
        json!([
            {"type": "text", "text": "Images from tool call t1:"}, url,
            {"type": "text", "text": "Images from tool call t2:"}, url,
        ])
    );
}

#[test]
fn tool_results_an_oversized_mcp_image_is_refused_in_words() {
    let ws = Workspace::new("results-huge");
    let (_, stub) = call_pictures(&ws, "anthropic", &["huge"]);
    let result = anthropic_result(&last_messages(&stub), "t1");
    assert!(
        result["content"]
            .as_array()
            .unwrap()
            .iter()
            .all(|b| b["type"] == "text"),
        "{result}"
    );
    let text = texts(&result["content"]);
    assert!(
        text.starts_with("too big\n[image 1 (image/png) not passed on to the model: image too large: 3333428 bytes of base64, at most 3145728]"),
        "{text}"
    );
}

#[test]
fn tool_results_read_of_a_png_reaches_the_model_and_survives_continue() {
    let ws = Workspace::new("results-read");
    // A PNG as far as Read can tell (its signature), and one past the cap.
    std::fs::write(ws.path("shot.png"), b"\x89PNG\r\n\x1a\n0123").unwrap();
    let mut big = b"\x89PNG\r\n\x1a\n".to_vec();
    big.resize(3 << 20, 0);
    std::fs::write(ws.path("big.png"), big).unwrap();
    let stub = Stub::start(
        &ws,
        &script([
            Turn::calls([Call::read("r1", "shot.png"), Call::read("r2", "big.png")]),
            Turn::text("done"),
            Turn::text("done"),
        ]),
    );
    print_run(&ws, &stub, "anthropic", &[]);
    let data = "iVBORw0KGgowMTIz";
    let messages = last_messages(&stub);
    assert_eq!(
        anthropic_result(&messages, "r1")["content"],
        json!([{"type": "text", "text": "→ Read shot.png: image/png, 12 bytes, shown as an image"},
               anthropic_image("image/png", data)])
    );
    let refused = anthropic_result(&messages, "r2");
    assert_eq!(refused["is_error"], true);
    assert!(
        texts(&refused["content"])
            .contains("`big.png` is an image of 3145728 bytes, too large to show the model"),
        "{refused}"
    );
    // The session file keeps the picture: --continue sends it again.
    let mut cmd = caliban(&ws);
    anthropic(&mut cmd, &stub);
    cmd.args(["-p", "--continue", "and again"]);
    let out = run(cmd, "");
    assert_eq!(out.code, Some(0), "{out:?}");
    let again = last_messages(&stub);
    assert_eq!(
        anthropic_result(&again, "r1")["content"][1],
        anthropic_image("image/png", data)
    );
}

#[test]
fn tool_results_acp_cards_show_the_picture_read_here_not_in_the_editor() {
    use crate::util::acp::{drive, tool_updates};
    let ws = Workspace::new("results-acp");
    std::fs::write(ws.path("shot.png"), b"\x89PNG\r\n\x1a\n0123").unwrap();
    let stub = Stub::start(
        &ws,
        &script(vec![
            Turn::call("toolu_img", "Read", json!({"path": "shot.png"})),
            Turn::text("A picture."),
        ]),
    );
    // The editor offers its files: a text file would be read through it, a picture is not
    // (its `fs/read_text_file` gives text).
    let r = drive(
        &ws,
        &stub,
        json!({"scenario": "prompts", "prompts": ["look"],
               "caps": {"fs": {"readTextFile": true, "writeTextFile": true}}}),
    );
    assert_eq!(r["fs"], json!([]), "the picture is read here");
    let card = tool_updates(&r["updates"], "toolu_img");
    let done = card.last().unwrap();
    assert_eq!(done["status"], "completed", "{card:?}");
    let content = done["content"].as_array().unwrap();
    assert_eq!(
        content.last().unwrap(),
        &json!({"type": "content", "content": {"type": "image", "mimeType": "image/png",
                                               "data": "iVBORw0KGgowMTIz"}})
    );
    let messages = last_messages(&stub);
    assert_eq!(
        anthropic_result(&messages, "toolu_img")["content"][1],
        anthropic_image("image/png", "iVBORw0KGgowMTIz")
    );
}

#[test]
fn tool_results_a_text_only_server_gets_the_turn_again_without_its_images() {
    let ws = Workspace::new("results-text-only");
    std::fs::write(ws.path("shot.png"), b"\x89PNG\r\n\x1a\n0123").unwrap();
    // llama.cpp's `llama-server` with a model that has no vision part answers so (a 500).
    let refusal = json!({"error": {"code": 500, "type": "server_error",
        "message": "image input is not supported - hint: if this is unexpected, you may need to provide the mmproj"}});
    let answer = Turn::text("done").fault(Fault::StatusBody(500, refusal.to_string()));
    let stub = Stub::start(
        &ws,
        &script([Turn::calls([Call::read("r1", "shot.png")]), answer]),
    );
    print_run(&ws, &stub, "openai", &[]);
    let requests = stub.requests();
    assert_eq!(requests.len(), 3, "{requests:?}");
    let has_image = |request: &Value| request["body"].to_string().contains("image_url");
    assert!(has_image(&requests[1]), "the picture was offered first");
    assert!(!has_image(&requests[2]), "{}", requests[2]["body"]);
    let messages = last_messages(&stub);
    let tool = messages
        .iter()
        .find(|m| m["role"] == "tool")
        .expect("the tool message");
    assert!(
        tool["content"]
            .as_str()
            .unwrap()
            .contains("[an image (image/png) was left out: the model server does not take images]"),
        "{tool}"
    );
}
