//! Print mode (`caliban -p`): one run driven from argv or stdin, reported on stdout as text,
//! one JSON result, or upstream's stream-json frames (`reference/upstream-caliban.md` §6.3),
//! ending with the exit codes of upstream's headless protocol.
//!
//! It is a `Host` of the engine: it renders events and answers Asks (always "deny, here is
//! how to allow it": nobody can be asked). It holds no agent logic. Its run is recorded in a
//! session file exactly as the drive core records a driven run (`Recorder`), which is what
//! `--continue` and `--resume` read back.

use std::collections::VecDeque;
use std::time::Instant;

use serde_json::{Value, json};

use crate::agent::event::{StopCondition, TurnEvent};
use crate::agent::run::ToolCall;
use crate::agent::tool_input::{StreamedCall, ToolInputs};
use crate::cli::{InputFormat, OutputFormat};
use crate::drive::session::{EventLog, SessionStore};
use crate::drive::table::{DriveStatus, Inbound};
use crate::engine::{AskReply, Ctx, Host, HostAction, RetryNotice};
use crate::exit;
use crate::ids::RunId;
use crate::model::types::{ContentBlock, MAX_IMAGES, Message, Usage};
use crate::permissions::Policy;
use crate::reactor::Signal;
use crate::stdio::{self, StdinItem};

/// The largest prompt read from stdin in text mode (upstream's cap).
pub const MAX_STDIN_PROMPT: usize = 10 * 1024 * 1024;

/// A stream-json input line waiting for the run's turn boundary.
enum Queued {
    Message(Vec<ContentBlock>),
    /// `{"type":"control","subtype":"compact"}`.
    Compact,
}

pub struct Printer {
    run: RunId,
    output: OutputFormat,
    input: InputFormat,
    partial: bool,
    session_id: String,
    provider: &'static str,
    model: String,
    started: Instant,
    /// stream-json input: messages (and compactions) that arrived while a turn was still
    /// running.
    queued: VecDeque<Queued>,
    stdin_done: bool,
    awaiting_input: bool,
    /// The text of the latest completed assistant turn (the `result`).
    last_text: String,
    tool_calls_seen: u32,
    /// tool_use frames wait until the model finished the turn, when inputs are complete.
    pending_tool_inputs: ToolInputs,
    turns: u32,
    usage: Usage,
    /// A problem with the input itself, and the exit code it maps to (64 or 66).
    input_error: Option<(u8, String)>,
    interrupts: u32,
    out: Vec<u8>,
    /// A stream-json user line arrived (an input stream with none is "no input").
    got_input: bool,
    turns_without_edit: u32,
    /// The run's permission policy, to tell the model how an Ask could be allowed.
    policy: Policy,
    /// Where the run is recorded, unless no session directory could be opened.
    recorder: Option<Recorder>,
    pub exit_code: u8,
}

/// A print run's session file, written line by line as `drive::table::DriveCore` writes a
/// driven run's (header, statuses, events, inputs), so everything that reads runs back (`GET
/// /runs`, `DriveCore::messages` for `--continue`) reads it the same way. A write that fails
/// is reported once and recording stops; the run goes on.
pub struct Recorder {
    store: SessionStore,
    /// The header's fields; the prompt is added when the first user message arrives.
    header: serde_json::Map<String, Value>,
    log: Option<EventLog>,
    broken: bool,
}

impl Recorder {
    pub fn new(store: SessionStore, header: serde_json::Map<String, Value>) -> Recorder {
        Recorder {
            store,
            header,
            log: None,
            broken: false,
        }
    }

    fn failed(&mut self, what: &str, error: std::io::Error) {
        if !self.broken {
            self.broken = true;
            crate::log::warn(&format!(
                "cannot {what} the session file ({error}); this run will not be resumable"
            ));
        }
    }

    /// Starts the file at the run's first record, with `prompt` as the header's.
    fn open(&mut self, prompt: &str, images: &[ContentBlock]) -> std::io::Result<()> {
        let mut header = self.header.clone();
        header.insert("prompt".into(), json!(prompt));
        if !images.is_empty() {
            header.insert(
                "images".into(),
                Value::Array(images.iter().map(ContentBlock::to_json).collect()),
            );
        }
        let mut log = self.store.create(header)?;
        log.append_status(&DriveStatus::Starting.to_json())?;
        log.append_status(&DriveStatus::Running.to_json())?;
        self.log = Some(log);
        Ok(())
    }

    /// A user message: the first one starts the file (it is the header's `prompt` and
    /// `images`), later ones are input lines, as the drive core writes them.
    fn user(&mut self, content: &[ContentBlock]) {
        if self.broken {
            return;
        }
        let text = Message {
            role: crate::model::types::Role::User,
            content: content.to_vec(),
        }
        .text();
        let images: Vec<ContentBlock> = content
            .iter()
            .filter(|b| matches!(b, ContentBlock::Image { .. }))
            .cloned()
            .collect();
        let written = match self.log.as_mut() {
            Some(log) => log
                .append_input(&Inbound::UserMessage { text, images }.to_json())
                .and_then(|()| log.append_status(&DriveStatus::Running.to_json())),
            None => self.open(&text, &images),
        };
        if let Err(e) = written {
            self.failed("write", e);
        }
    }

    /// An event; one before any user message (a compaction of what `--continue` brought)
    /// starts the file with an empty prompt.
    fn event(&mut self, event: &TurnEvent) {
        if self.broken {
            return;
        }
        if self.log.is_none()
            && let Err(e) = self.open("", &[])
        {
            self.failed("write", e);
            return;
        }
        if let Some(log) = self.log.as_mut()
            && let Err(e) = log.append_event(&event.to_json())
        {
            self.failed("append to", e);
        }
    }

    fn status(&mut self, status: &DriveStatus) {
        if let Some(log) = self.log.as_mut().filter(|_| !self.broken)
            && let Err(e) = log.append_status(&status.to_json())
        {
            self.failed("append to", e);
        }
    }

    /// The run ended: its last status, then the file is closed. Unlike a server's finished
    /// run it is not fsynced: every line is already written (a crash of this process loses
    /// nothing), and waiting for the disk at exit cost about 20 ms a run here, more than the
    /// rest of a short print run; only a power cut right after a run can lose its end.
    fn finish(&mut self, why: &StopCondition) {
        self.status(&DriveStatus::ended(why));
        // Dropping the log closes its descriptor, which releases its lock.
        self.log = None;
    }
}

impl Printer {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        run: RunId,
        output: OutputFormat,
        input: InputFormat,
        partial: bool,
        session_id: String,
        provider: &'static str,
        model: String,
        policy: Policy,
    ) -> Printer {
        Printer {
            run,
            output,
            input,
            partial,
            session_id,
            provider,
            model,
            started: Instant::now(),
            queued: VecDeque::new(),
            stdin_done: input == InputFormat::Text,
            awaiting_input: false,
            last_text: String::new(),
            tool_calls_seen: 0,
            pending_tool_inputs: ToolInputs::default(),
            turns: 0,
            usage: Usage::default(),
            input_error: None,
            interrupts: 0,
            out: Vec::new(),
            got_input: false,
            turns_without_edit: 0,
            policy,
            recorder: None,
            exit_code: exit::RUNTIME,
        }
    }

    /// Records the run in a session file (see `Recorder`).
    pub fn record(&mut self, recorder: Recorder) {
        self.recorder = Some(recorder);
    }

    /// Writes one stream-json frame (only in that format).
    fn frame(&mut self, value: Value) {
        if self.output == OutputFormat::StreamJson {
            let mut line = value.to_string();
            line.push('\n');
            self.write(line.as_bytes());
        }
    }

    /// Output is queued here and handed to the engine, which writes stdout without ever
    /// blocking the loop.
    fn write(&mut self, bytes: &[u8]) {
        self.out.extend_from_slice(bytes);
    }

    /// The opening frame; `sandbox` is `sandbox::describe` of the run's mode, so a reader
    /// sees whether its commands are confined before any runs; `instructions` the project
    /// instructions the run was given; `mcp_servers` the run's MCP servers by name with
    /// their state now (`pending` until they list their tools: the frame comes first).
    pub fn init_frame(
        &mut self,
        tools: &[String],
        mcp_servers: &[(String, &str)],
        cwd: &str,
        permission_mode: &str,
        sandbox: Value,
        instructions: &crate::instructions::Loaded,
    ) {
        let mcp_servers: Vec<Value> = mcp_servers
            .iter()
            .map(|(name, status)| json!({"name": name, "status": status}))
            .collect();
        self.frame(json!({
            "type": "system", "subtype": "init", "session_id": self.session_id,
            "model": format!("{}/{}", self.provider, self.model), "tools": tools, "plugins": [],
            "settingSources": ["user", "project"], "mcp_servers": mcp_servers, "bare_mode": false,
            "cwd": cwd, "permission_mode": permission_mode, "sandbox": sandbox,
            "instructions": instructions.to_json(),
        }));
    }

    fn flush_tool_uses(&mut self) {
        for StreamedCall { id, name, input } in self.pending_tool_inputs.take() {
            let raw = input.text();
            // An input over the cap is shown as the run recorded it, `{}` (the call was
            // refused): a prefix of megabytes would say nothing more.
            let input = if input.overflowed() || raw.trim().is_empty() {
                json!({})
            } else {
                serde_json::from_str(raw).unwrap_or_else(|_| Value::String(raw.to_owned()))
            };
            self.frame(json!({"type": "tool_use", "id": id, "name": name, "input": input}));
        }
    }

    fn result(&mut self, why: &StopCondition) {
        let (subtype, code, error) = match why {
            StopCondition::EndOfTurn => ("success", exit::OK, None),
            StopCondition::MaxTurnsReached(_) => ("max_turns", exit::MAX_TURNS, None),
            StopCondition::Cancelled => ("cancelled", exit::CANCELLED, None),
            StopCondition::MaxTokensExhausted => ("max_tokens", exit::ASSISTANT, None),
            StopCondition::Refusal(e) | StopCondition::ContentFilter(e) => {
                ("error", exit::ASSISTANT, Some(e.clone()))
            }
            StopCondition::ProviderError(e) => ("error", exit::RUNTIME, Some(e.clone())),
            StopCondition::CompactionFailed(e) => (
                "error",
                exit::RUNTIME,
                Some(format!("compaction failed: {e}")),
            ),
            StopCondition::StreamIdle(d) => (
                "error",
                exit::RUNTIME,
                Some(format!(
                    "the model stream was idle for {} s",
                    d.as_secs_f64()
                )),
            ),
        };
        let (subtype, code, error) = match &self.input_error {
            Some((code, e)) => ("error", *code, Some(e.clone())),
            None => (subtype, code, error),
        };
        self.exit_code = code;
        let mut frame = json!({
            "type": "result", "subtype": subtype, "session_id": self.session_id,
            "total_cost_usd": cost_usd(&self.model, &self.usage),
            "turns": self.turns, "num_turns": self.turns,
            "total_input_tokens": self.usage.input_tokens,
            "total_output_tokens": self.usage.output_tokens,
            "is_error": subtype != "success",
            "duration_ms": self.started.elapsed().as_millis() as u64,
            "usage": self.usage.to_json(),
            "turns_without_edit": self.turns_without_edit, "no_edit_nudge_emitted": false,
        });
        if subtype == "success" {
            frame["result"] = json!(self.last_text);
        } else {
            if !self.last_text.is_empty() {
                frame["last_assistant_text"] = json!(self.last_text);
            }
            frame["tool_calls_seen"] = json!(self.tool_calls_seen);
            if let Some(error) = &error {
                frame["error"] = json!(error);
            }
        }
        match self.output {
            OutputFormat::StreamJson => self.frame(frame),
            OutputFormat::Json => {
                let line = format!("{frame}\n");
                self.write(line.as_bytes());
            }
            OutputFormat::Text => {
                if subtype == "success" {
                    let mut text = self.last_text.clone();
                    if !text.ends_with('\n') {
                        text.push('\n');
                    }
                    self.write(text.as_bytes());
                } else {
                    let detail = error.unwrap_or_else(|| subtype.replace('_', " "));
                    crate::log::error(&format!("run ended: {detail}"));
                    if !self.last_text.is_empty() {
                        let text = format!("{}\n", self.last_text);
                        self.write(text.as_bytes());
                    }
                }
            }
        }
    }

    fn parse_input_line(&mut self, line: &[u8]) -> Result<Option<Queued>, String> {
        if line.iter().all(u8::is_ascii_whitespace) {
            return Ok(None);
        }
        let value: Value =
            serde_json::from_slice(line).map_err(|e| format!("stream-json input: {e}"))?;
        let obj = value
            .as_object()
            .ok_or("stream-json input: each line must be a JSON object")?;
        match obj.get("type").and_then(Value::as_str) {
            Some("user") => {
                if let Some(extra) = obj.keys().find(|k| *k != "type" && *k != "content") {
                    return Err(format!(
                        "stream-json input: unexpected field `{extra}` in a user message"
                    ));
                }
                let content = match obj.get("content") {
                    Some(Value::String(text)) => vec![ContentBlock::text(text.clone())],
                    Some(Value::Array(blocks)) => {
                        let images = blocks.iter().filter(|b| b["type"] == "image").count();
                        if images > MAX_IMAGES {
                            return Err(format!(
                                "stream-json input: {images} images in one message; at most {MAX_IMAGES}"
                            ));
                        }
                        blocks
                            .iter()
                            .map(|b| match ContentBlock::from_json(b) {
                                Ok(block @ ContentBlock::Text { .. }) => Ok(block),
                                Ok(block @ ContentBlock::Image { .. }) => block
                                    .check_prompt_image()
                                    .map(|()| block)
                                    .map_err(|e| format!("stream-json input: an image {e}")),
                                Ok(_) => Err("stream-json input: only text and image blocks \
                                              are accepted"
                                    .to_owned()),
                                Err(e) => Err(format!("stream-json input: {e}")),
                            })
                            .collect::<Result<Vec<_>, _>>()?
                    }
                    _ => return Err(
                        "stream-json input: `content` must be a string or an array of text and image blocks"
                            .into(),
                    ),
                };
                Ok(Some(Queued::Message(content)))
            }
            Some("control") => match obj.get("subtype").and_then(Value::as_str) {
                Some("interrupt") => Err(String::new()),
                Some("compact") => Ok(Some(Queued::Compact)),
                other => Err(format!(
                    "stream-json input: unknown control subtype {other:?}"
                )),
            },
            Some(other) => Err(format!("stream-json input: unknown message type `{other}`")),
            None => Err("stream-json input: missing `type`".into()),
        }
    }

    fn feed_pending(&mut self) -> Vec<HostAction> {
        if !self.awaiting_input {
            return Vec::new();
        }
        if let Some(queued) = self.queued.pop_front() {
            self.awaiting_input = false;
            return vec![match queued {
                Queued::Message(content) => {
                    if let Some(recorder) = self.recorder.as_mut() {
                        recorder.user(&content);
                    }
                    HostAction::SendInput(self.run, content)
                }
                Queued::Compact => HostAction::Compact(self.run),
            }];
        }
        if self.stdin_done {
            self.awaiting_input = false;
            return vec![HostAction::EndInput(self.run)];
        }
        Vec::new()
    }
}

impl Host for Printer {
    /// Print mode registers no sources of its own.
    type Key = ();

    fn write_output(&mut self, out: &mut Vec<u8>) {
        out.append(&mut self.out);
    }

    fn on_event(&mut self, _ctx: &mut Ctx<()>, _run: RunId, event: &TurnEvent) {
        if let Some(recorder) = self.recorder.as_mut() {
            recorder.event(event);
        }
        match event {
            TurnEvent::AssistantTextDelta { text, .. } if self.partial => {
                self.frame(json!({"type": "text", "delta": text}));
            }
            TurnEvent::AssistantThinkingDelta { text, .. } if self.partial => {
                self.frame(json!({"type": "thinking", "delta": text}));
            }
            TurnEvent::ToolCallStart {
                tool_use_id, name, ..
            } => {
                self.tool_calls_seen += 1;
                self.pending_tool_inputs.start(tool_use_id, name);
            }
            TurnEvent::ToolCallInputDelta {
                tool_use_id,
                partial_json,
                ..
            } => self.pending_tool_inputs.push(tool_use_id, partial_json),
            TurnEvent::ToolCallEnd {
                tool_use_id,
                is_error,
                content,
                ..
            } => {
                self.flush_tool_uses();
                self.frame(json!({
                    "type": "tool_result", "tool_use_id": tool_use_id, "is_error": is_error,
                    "content": content.iter().map(ContentBlock::to_json).collect::<Vec<_>>(),
                }));
            }
            TurnEvent::PlanUpdate {
                tool_use_id, todos, ..
            } => {
                // After the call's tool_use frame, before its tool_result.
                self.flush_tool_uses();
                self.frame(json!({
                    "type": "system", "subtype": "plan", "tool_use_id": tool_use_id,
                    "todos": todos.iter().map(crate::tools::todo::Todo::to_json).collect::<Vec<_>>(),
                }));
            }
            TurnEvent::RunEnd {
                turns_without_edit, ..
            } => self.turns_without_edit = *turns_without_edit,
            // Claude Code's `compact_boundary`, with caliban's figures and the summary.
            TurnEvent::Compaction {
                trigger,
                pre_tokens,
                post_tokens,
                messages_summarized,
                messages_kept,
                summary,
                usage,
                ..
            } => {
                self.usage.add(usage);
                self.frame(json!({
                    "type": "system", "subtype": "compact_boundary",
                    "session_id": self.session_id,
                    "compact_metadata": {
                        "trigger": trigger.as_str(), "pre_tokens": pre_tokens,
                        "post_tokens": post_tokens,
                        "messages_summarized": messages_summarized,
                        "messages_kept": messages_kept,
                    },
                    "summary": summary,
                }));
            }
            TurnEvent::TurnEnd {
                assistant_message,
                usage,
                ..
            } => {
                self.flush_tool_uses();
                self.turns += 1;
                self.usage.add(usage);
                self.last_text = assistant_message.text();
                if !self.partial {
                    let Message { content, .. } = assistant_message;
                    self.frame(json!({
                        "type": "message", "role": "assistant",
                        "content": content.iter().map(ContentBlock::to_json).collect::<Vec<_>>(),
                    }));
                }
            }
            _ => {}
        }
    }

    fn on_ask(&mut self, _ctx: &mut Ctx<()>, _run: RunId, call: &ToolCall) -> AskReply {
        AskReply::Deny(self.policy.ask_denied_message(&call.name, &call.input))
    }

    fn on_retry(&mut self, _ctx: &mut Ctx<()>, _run: RunId, notice: &RetryNotice) {
        let mut frame = json!({
            "type": "system", "subtype": "api_retry", "attempt": notice.attempt,
            "max_retries": notice.max_retries, "retry_delay_ms": notice.delay.as_millis() as u64,
            "error_category": notice.category,
        });
        if let Some(status) = notice.status {
            frame["error_status"] = json!(status);
        }
        self.frame(frame);
    }

    fn on_await_input(&mut self, ctx: &mut Ctx<()>, _run: RunId) {
        self.awaiting_input = true;
        if let Some(recorder) = self.recorder.as_mut() {
            recorder.status(&DriveStatus::AwaitingInput);
        }
        for action in self.feed_pending() {
            ctx.act(action);
        }
    }

    fn on_finished(&mut self, ctx: &mut Ctx<()>, _run: RunId, why: &StopCondition) {
        if let Some(recorder) = self.recorder.as_mut() {
            recorder.finish(why);
        }
        self.result(why);
        ctx.act(HostAction::Quit);
    }

    fn on_stdin(&mut self, ctx: &mut Ctx<()>, item: StdinItem) {
        if self.input != InputFormat::StreamJson {
            return;
        }
        let actions = match item {
            StdinItem::Eof => {
                self.stdin_done = true;
                if !self.got_input && self.input_error.is_none() {
                    self.input_error = Some((
                        exit::NO_INPUT,
                        "no input: stdin ended before any user message".to_owned(),
                    ));
                }
                self.feed_pending()
            }
            StdinItem::Oversized => {
                self.input_error = Some((
                    exit::USAGE,
                    format!(
                        "stream-json input: a line exceeds {} bytes",
                        stdio::MAX_LINE
                    ),
                ));
                vec![HostAction::Cancel(self.run)]
            }
            StdinItem::Line(line) => match self.parse_input_line(&line) {
                Ok(None) => Vec::new(),
                // A compaction is not a message: before any, it compacts what `--continue`
                // or `--resume` brought (a fresh run has nothing to compact and waits on).
                Ok(Some(Queued::Compact)) => {
                    self.queued.push_back(Queued::Compact);
                    self.feed_pending()
                }
                Ok(Some(queued)) => {
                    self.got_input = true;
                    self.queued.push_back(queued);
                    self.feed_pending()
                }
                // `control/interrupt`: stop the current turn, like a first Ctrl-C.
                Err(e) if e.is_empty() => vec![HostAction::Cancel(self.run)],
                Err(e) => {
                    self.input_error = Some((exit::USAGE, e));
                    vec![HostAction::Cancel(self.run)]
                }
            },
        };
        for action in actions {
            ctx.act(action);
        }
    }

    fn on_signal(&mut self, ctx: &mut Ctx<()>, signal: Signal) {
        if signal == Signal::Interrupt {
            self.interrupts += 1;
        }
        if self.interrupts >= 2 {
            self.exit_code = exit::INTERRUPTED_TWICE;
            ctx.act(HostAction::Quit);
            return;
        }
        ctx.act(HostAction::Cancel(self.run));
    }
}

impl Printer {
    /// Marks the printer as started by a text-mode prompt: no more input will come.
    pub fn start_text(&mut self, prompt: String) -> HostAction {
        let content = vec![ContentBlock::text(prompt)];
        if let Some(recorder) = self.recorder.as_mut() {
            recorder.user(&content);
        }
        HostAction::SendInput(self.run, content)
    }

    /// stream-json input: the run starts with the first user line.
    pub fn wait_for_first_line(&mut self) {
        self.awaiting_input = true;
    }
}

/// The run's cost at list prices, or null for a model whose price is unknown.
fn cost_usd(model: &str, usage: &Usage) -> Value {
    crate::model::catalog::cost_usd(model, usage).map_or(Value::Null, |cost| json!(cost))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::tool_input::MAX_TOOL_INPUT_BYTES;

    fn frames(printer: &mut Printer) -> Vec<Value> {
        let mut out = Vec::new();
        printer.write_output(&mut out);
        out.split(|b| *b == b'\n')
            .filter(|line| !line.is_empty())
            .map(|line| serde_json::from_slice(line).expect("a JSON frame"))
            .collect()
    }

    #[test]
    fn tool_use_frames_hold_streamed_input_to_the_cap() {
        let mut printer = Printer::new(
            RunId(1),
            OutputFormat::StreamJson,
            InputFormat::Text,
            false,
            "s".into(),
            "anthropic",
            "m".into(),
            Policy::new(
                Vec::new(),
                crate::permissions::Mode::Default,
                std::path::PathBuf::from("/ws"),
            ),
        );
        let inputs = &mut printer.pending_tool_inputs;
        inputs.start("big", "Write");
        inputs.start("small", "Read");
        inputs.start("bare", "Glob");
        let head = format!(
            "{{\"path\":\"x\",\"content\":\"{}",
            "A".repeat(MAX_TOOL_INPUT_BYTES - 40)
        );
        inputs.push("big", &head);
        // Past the cap: nothing more is kept, however much more streams.
        for _ in 0..3 {
            inputs.push("big", &"B".repeat(MAX_TOOL_INPUT_BYTES / 2));
        }
        inputs.push("big", "\"}");
        inputs.push("small", r#"{"path":"#);
        inputs.push("small", r#""a.rs"}"#);
        printer.flush_tool_uses();
        let out = frames(&mut printer);
        let inputs: Vec<(&Value, &Value)> = out.iter().map(|f| (&f["id"], &f["input"])).collect();
        assert_eq!(
            inputs,
            [
                (&json!("big"), &json!({})),
                (&json!("small"), &json!({"path": "a.rs"})),
                (&json!("bare"), &json!({}))
            ]
        );
        printer.flush_tool_uses();
        assert!(frames(&mut printer).is_empty(), "each call is shown once");
    }
}
