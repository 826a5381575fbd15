//! The loop and its effect dispatch, driven whole: a real `Engine` on a real reactor, a test
//! `Host` that records what it hears, and models on loopback (a canned reply, a port that
//! refuses, a listener that never answers).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use super::*;
use crate::agent::run::RunConfig;
use crate::permissions::{Mode, Policy};

const RUN: RunId = RunId(1);
/// Bounds a test whose model never answers, should the host never act.
const STALL: Duration = Duration::from_secs(5);

#[derive(Debug, PartialEq)]
enum Heard {
    /// A `TurnEvent` by its variant's name, a text delta with its text.
    Event(RunId, String),
    Retry(RunId, u32),
    AwaitInput(RunId),
    Finished(RunId, StopCondition),
}

/// Records every callback; at each `await_input` ends the run's input, and after `quit_after`
/// runs finished (or at its timer, with `on_timer` queued) acts as told.
struct Probe {
    heard: Vec<Heard>,
    quit_after: usize,
    on_timer: Vec<HostAction>,
    stats: Stats,
}

impl Probe {
    fn new(quit_after: usize) -> Probe {
        Probe {
            heard: Vec::new(),
            quit_after,
            on_timer: Vec::new(),
            stats: Stats::default(),
        }
    }

    fn finished(&self) -> Vec<&Heard> {
        self.heard
            .iter()
            .filter(|h| matches!(h, Heard::Finished(..)))
            .collect()
    }
}

impl Host for Probe {
    type Key = ();

    fn on_event(&mut self, _ctx: &mut Ctx<()>, run: RunId, event: &TurnEvent) {
        let name = match event {
            TurnEvent::AssistantTextDelta { text, .. } => format!("Text {text}"),
            other => {
                let debug = format!("{other:?}");
                debug
                    .split(|c: char| !c.is_alphanumeric())
                    .next()
                    .unwrap_or_default()
                    .to_owned()
            }
        };
        self.heard.push(Heard::Event(run, name));
    }

    fn on_ask(&mut self, _ctx: &mut Ctx<()>, _run: RunId, call: &ToolCall) -> AskReply {
        AskReply::Deny(format!("no tools here: {}", call.name))
    }

    fn on_retry(&mut self, _ctx: &mut Ctx<()>, run: RunId, notice: &RetryNotice) {
        self.heard.push(Heard::Retry(run, notice.attempt));
    }

    fn on_await_input(&mut self, ctx: &mut Ctx<()>, run: RunId) {
        self.heard.push(Heard::AwaitInput(run));
        ctx.act(HostAction::EndInput(run));
    }

    fn on_finished(&mut self, ctx: &mut Ctx<()>, run: RunId, why: &StopCondition) {
        self.heard.push(Heard::Finished(run, why.clone()));
        self.stats = ctx.stats();
        if self.finished().len() == self.quit_after {
            ctx.act(HostAction::Quit);
        }
    }

    fn on_signal(&mut self, _ctx: &mut Ctx<()>, _signal: Signal) {}

    fn on_timer(&mut self, ctx: &mut Ctx<()>, _key: ()) {
        for action in self.on_timer.drain(..) {
            ctx.act(action);
        }
    }
}

fn engine(port: u16, max_retries: u32) -> Engine<()> {
    let env = move |name: &str| match name {
        "ANTHROPIC_BASE_URL" => Some(format!("http://127.0.0.1:{port}")),
        "ANTHROPIC_API_KEY" => Some("test-key".to_owned()),
        _ => None,
    };
    let provider = Provider::from_env(None, Some("m".into()), &env)
        .expect("provider")
        .expect("configured");
    let config = EngineConfig {
        provider,
        retry: RetryPolicy {
            max_retries,
            base: Duration::from_millis(1),
            max_delay: Duration::from_millis(1),
        },
        first_byte_timeout: STALL,
        idle_timeout: STALL,
        request_timeout: STALL,
        mcp: McpConfig::default(),
        idle_connections: 1,
        webfetch_block_private: true,
    };
    Engine::new(config).expect("engine")
}

fn start(id: RunId, interactive: bool) -> HostAction {
    let config = RunConfig {
        model: "m".into(),
        max_tokens: 100,
        max_turns: 5,
        system: String::new(),
        tools: Arc::new(Vec::new()),
        interactive,
        context_window: None,
        effort: None,
        sandbox_retry: false,
        mcp_allowlist: None,
    };
    let policy = Policy::new(Vec::new(), Mode::Default, std::env::temp_dir());
    HostAction::StartRun {
        id,
        run: Box::new(Run::new(config, policy, Vec::new())),
        workspace: std::env::temp_dir(),
        mcp: Selection::default(),
    }
}

fn say(id: RunId, text: &str) -> HostAction {
    HostAction::SendInput(id, vec![ContentBlock::text(text)])
}

/// A port nothing listens on: connecting is refused.
fn refused_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("addr").port()
}

/// One Anthropic text turn saying `text`, as the Messages API streams it.
fn text_reply(text: &str) -> Vec<u8> {
    let events = [
        r#"{"type":"message_start","message":{"id":"msg_1","type":"message","role":"assistant","model":"m","content":[],"stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":3,"output_tokens":1}}}"#.to_owned(),
        r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#.to_owned(),
        format!(
            r#"{{"type":"content_block_delta","index":0,"delta":{{"type":"text_delta","text":{}}}}}"#,
            serde_json::Value::from(text)
        ),
        r#"{"type":"content_block_stop","index":0}"#.to_owned(),
        r#"{"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},"usage":{"output_tokens":1}}"#.to_owned(),
        r#"{"type":"message_stop"}"#.to_owned(),
    ];
    let mut body = String::new();
    for data in &events {
        let kind: serde_json::Value = serde_json::from_str(data).expect("json");
        let kind = kind["type"].as_str().expect("type");
        body.push_str(&format!("event: {kind}\ndata: {data}\n\n"));
    }
    let head = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {}\r\n\
         connection: close\r\n\r\n",
        body.len()
    );
    [head.into_bytes(), body.into_bytes()].concat()
}

/// Reads one HTTP request (headers and a `content-length` body) and returns it as text.
fn read_request(stream: &mut TcpStream) -> String {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = stream.read(&mut buf).expect("read request");
        assert!(n > 0, "the client hung up mid-request");
        got.extend_from_slice(&buf[..n]);
        let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") else {
            continue;
        };
        let head = String::from_utf8_lossy(&got[..end]).to_ascii_lowercase();
        let length = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .map_or(0, |v| v.trim().parse::<usize>().expect("length"));
        if got.len() >= end + 4 + length {
            return String::from_utf8_lossy(&got).into_owned();
        }
    }
}

/// A loopback model answering its first connection with `reply`; joins to the request read.
fn serve_once(reply: Vec<u8>) -> (u16, JoinHandle<String>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let server = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().expect("accept");
        stream.set_read_timeout(Some(STALL)).expect("timeout");
        let request = read_request(&mut stream);
        stream.write_all(&reply).expect("reply");
        request
    });
    (port, server)
}

/// Whether the engine still routes anything to a model exchange of `run`.
fn model_owned(engine: &Engine<()>, run: RunId) -> bool {
    let tokens = engine
        .io
        .owners
        .values()
        .any(|o| matches!(o, Owner::Model(r) if *r == run));
    let timers = engine.io.timers.values().any(|t| {
        matches!(t, TimerOwner::Model(r) | TimerOwner::ModelDeadline(r) | TimerOwner::Backoff(r)
            if *r == run)
    });
    tokens || timers
}

/// The far end of a model connection that was accepted but never answered: what the engine
/// sent, once it closed the connection.
fn after_close(listener: &TcpListener) -> String {
    let (mut stream, _) = listener.accept().expect("accept");
    stream.set_read_timeout(Some(STALL)).expect("timeout");
    let mut got = Vec::new();
    stream
        .read_to_end(&mut got)
        .expect("the engine closed the connection");
    String::from_utf8_lossy(&got).into_owned()
}

fn event(name: &str) -> Heard {
    Heard::Event(RUN, name.to_owned())
}

#[test]
fn a_text_turn_is_heard_in_order_then_the_run_awaits_input_and_ends() {
    let (port, server) = serve_once(text_reply("hello"));
    let mut engine = engine(port, 0);
    let mut host = Probe::new(1);
    engine.push_action(start(RUN, true));
    engine.push_action(say(RUN, "hi"));
    engine.run_loop(&mut host).expect("loop");

    let request = server.join().expect("server");
    assert!(
        request.starts_with("POST /v1/messages HTTP/1.1\r\n"),
        "{request}"
    );
    assert!(request.contains(r#""text":"hi""#), "{request}");
    assert_eq!(
        host.heard,
        [
            event("TurnStart"),
            event("Text hello"),
            event("TurnEnd"),
            Heard::AwaitInput(RUN),
            event("RunEnd"),
            Heard::Finished(RUN, StopCondition::EndOfTurn),
        ]
    );
    assert_eq!(host.stats.model_requests, 1);
    assert!(engine.runs.is_empty(), "a finished run is forgotten");
}

#[test]
fn a_refused_model_with_no_retries_finishes_the_run_failed() {
    let mut engine = engine(refused_port(), 0);
    let mut host = Probe::new(1);
    engine.push_action(start(RUN, false));
    engine.push_action(say(RUN, "hi"));
    engine.run_loop(&mut host).expect("loop");

    assert!(
        !host.heard.iter().any(|h| matches!(h, Heard::Retry(..))),
        "{:?}",
        host.heard
    );
    let [Heard::Finished(run, StopCondition::ProviderError(why))] = host.finished()[..] else {
        panic!("one failed finish: {:?}", host.heard);
    };
    assert_eq!(*run, RUN);
    assert!(!why.is_empty());
    assert_eq!(host.heard.last(), host.finished().last().copied());
    assert!(!model_owned(&engine, RUN));
}

#[test]
fn a_refused_model_with_one_retry_is_retried_once_first() {
    let mut engine = engine(refused_port(), 1);
    let mut host = Probe::new(1);
    engine.push_action(start(RUN, false));
    engine.push_action(say(RUN, "hi"));
    engine.run_loop(&mut host).expect("loop");

    let retries: Vec<&Heard> = host
        .heard
        .iter()
        .filter(|h| matches!(h, Heard::Retry(..)))
        .collect();
    // The notice names the attempt about to be made: the first retry is the second attempt.
    assert_eq!(retries, [&Heard::Retry(RUN, 2)], "{:?}", host.heard);
    let retry_at = host.heard.iter().position(|h| *h == Heard::Retry(RUN, 2));
    let finish_at = host
        .heard
        .iter()
        .position(|h| matches!(h, Heard::Finished(_, StopCondition::ProviderError(_))));
    assert!(retry_at < finish_at, "{:?}", host.heard);
    assert_eq!(host.stats.model_retries, 1);
}

#[test]
fn a_cancel_mid_request_ends_the_run_interrupted_and_forgets_its_exchange() {
    // Accepted by the kernel and never answered: the request waits for its first byte.
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let mut engine = engine(listener.local_addr().expect("addr").port(), 0);
    let mut host = Probe::new(1);
    host.on_timer.push(HostAction::Cancel(RUN));
    engine.with_ctx(|ctx| ctx.add_timer(Duration::from_millis(100), ()));
    engine.push_action(start(RUN, false));
    engine.push_action(say(RUN, "hi"));
    engine.run_loop(&mut host).expect("loop");

    assert_eq!(
        host.finished(),
        [&Heard::Finished(RUN, StopCondition::Cancelled)],
        "{:?}",
        host.heard
    );
    assert!(!model_owned(&engine, RUN));
    assert!(engine.runs.is_empty());
    let sent = after_close(&listener);
    assert!(sent.starts_with("POST /v1/messages"), "{sent}");
}

#[test]
fn quit_ends_the_loop_and_the_live_runs_work() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let mut engine = engine(listener.local_addr().expect("addr").port(), 0);
    let mut host = Probe::new(1);
    host.on_timer.push(HostAction::Quit);
    engine.with_ctx(|ctx| ctx.add_timer(Duration::from_millis(100), ()));
    engine.push_action(start(RUN, false));
    engine.push_action(say(RUN, "hi"));
    let began = Instant::now();
    engine.run_loop(&mut host).expect("loop");

    assert!(began.elapsed() < STALL, "the loop ended at the quit");
    assert!(host.finished().is_empty(), "{:?}", host.heard);
    assert!(!model_owned(&engine, RUN));
    let sent = after_close(&listener);
    assert!(sent.starts_with("POST /v1/messages"), "{sent}");
}

#[test]
fn actions_pushed_before_the_loop_run_in_the_order_pushed() {
    let later = RunId(2);
    let mut engine = engine(refused_port(), 0);
    let mut host = Probe::new(1);
    // Input for a run not started yet finds no run; input after its start begins a turn.
    engine.push_action(say(later, "too early"));
    engine.push_action(start(later, false));
    engine.push_action(start(RUN, false));
    engine.push_action(say(RUN, "hi"));
    engine.run_loop(&mut host).expect("loop");

    assert!(
        host.heard
            .iter()
            .all(|h| !matches!(h, Heard::Event(r, _) | Heard::Finished(r, _) if *r == later)),
        "{:?}",
        host.heard
    );
    assert!(matches!(
        host.finished()[..],
        [Heard::Finished(RUN, StopCondition::ProviderError(_))]
    ));
    assert!(engine.runs.contains_key(&later), "still idle, never asked");
    assert_eq!(host.stats.model_requests, 1);
}

#[test]
fn a_permit_for_an_unknown_call_or_run_is_ignored() {
    let (port, server) = serve_once(text_reply("fine"));
    let mut engine = engine(port, 0);
    let mut host = Probe::new(1);
    let permit = |run| HostAction::Permit {
        run,
        tool_use_id: "toolu_nobody".to_owned(),
        allow: true,
        message: String::new(),
    };
    engine.push_action(start(RUN, false));
    engine.push_action(permit(RUN));
    engine.push_action(permit(RunId(9)));
    engine.push_action(say(RUN, "hi"));
    engine.push_action(permit(RUN));
    engine.run_loop(&mut host).expect("loop");

    server.join().expect("server");
    assert_eq!(
        host.heard,
        [
            event("TurnStart"),
            event("Text fine"),
            event("TurnEnd"),
            event("RunEnd"),
            Heard::Finished(RUN, StopCondition::EndOfTurn),
        ]
    );
}
