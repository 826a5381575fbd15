//! Print mode (`caliban -p`): one run driven from argv or stdin, reported on stdout as text,
//! one JSON result, or upstream's stream-json frames (`reference/upstream-caliban.md` §6.3),
//! ending with the exit codes of upstream's headless protocol.
//!
//! It is a drive `Surface` (`surface::host`): its run is started and fed through the drive
//! core, which records it in a session file as it records every run (that is what
//! `--continue` and `--resume` read back), and it renders the core's events. It answers Asks
//! itself (always "deny, here is how to allow it": nobody can be asked). It holds no agent
//! logic.

use std::collections::{BTreeSet, VecDeque};
use std::time::Instant;

use serde_json::{Value, json};

use crate::agent::event::{StopCondition, TurnEvent};
use crate::agent::run::ToolCall;
use crate::agent::tool_input::{StreamedCall, ToolInputs};
use crate::cli::{InputFormat, OutputFormat};
use crate::drive::table::{DriveCore, Inbound, RunSpec, text_and_images};
use crate::engine::{AskReply, HostAction, RetryNotice};
use crate::exit;
use crate::ids::RunId;
use crate::model::types::{ContentBlock, MAX_IMAGES, Message, Usage};
use crate::permissions::Policy;
use crate::reactor::Signal;
use crate::stdio::{self, StdinItem};
use crate::surface::host::{Cx, Surface};

/// The largest prompt read from stdin in text mode (upstream's cap).
pub const MAX_STDIN_PROMPT: usize = 10 * 1024 * 1024;

/// A stream-json input line waiting for the run's turn boundary.
enum Queued {
    Message(Vec<ContentBlock>),
    /// `{"type":"control","subtype":"compact"}`.
    Compact,
}

pub struct Printer {
    /// The run, once the core started it: text mode starts it before the loop, stream-json
    /// input with its first line.
    run: Option<RunId>,
    /// What the run is started with (everything but its first input), until it is.
    spec: Option<RunSpec>,
    output: OutputFormat,
    input: InputFormat,
    partial: bool,
    session_id: String,
    provider: &'static str,
    model: String,
    started: Instant,
    /// stream-json input: messages (and compactions) that arrived while a turn was still
    /// running. Held here rather than in the core's queue, which is bounded for clients
    /// that can be told to wait: a file piped to stdin cannot.
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
    /// Why print mode ends without a run (`end_unstarted`): the result waits for the end of
    /// the batch, so the rest of a stdin batch still counts (an input error after an
    /// interrupt outranks it), as it would for a run cancelled in that batch.
    unstarted_end: Option<StopCondition>,
    /// The result frame is written: nothing more is.
    ended: bool,
    pub exit_code: u8,
}

impl Printer {
    /// `spec` is the run to start, but for its first input (`prompt`, `images` or
    /// `compact_first`), which the printer fills in.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        spec: RunSpec,
        output: OutputFormat,
        input: InputFormat,
        partial: bool,
        session_id: String,
        provider: &'static str,
        model: String,
        policy: Policy,
    ) -> Printer {
        Printer {
            run: None,
            spec: Some(spec),
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
            unstarted_end: None,
            ended: false,
            interrupts: 0,
            out: Vec::new(),
            got_input: false,
            turns_without_edit: 0,
            policy,
            exit_code: exit::RUNTIME,
        }
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

    /// The frames (or the text kept for the result) an event makes.
    fn render(&mut self, event: &TurnEvent) {
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

    /// Starts the run in the core with its first input: the message goes to the model as it
    /// came, empty or not, and is the session's `prompt` (its text) and `images`; a
    /// compaction first starts it with none, compacting what `--continue` or `--resume`
    /// brought.
    fn start(&mut self, core: &mut DriveCore, first: Queued) -> Result<(), String> {
        let Some(mut spec) = self.spec.take() else {
            return Err("the print run was already started".into());
        };
        match first {
            Queued::Message(content) => {
                (spec.prompt, spec.images) = text_and_images(&content);
                spec.message = Some(content);
            }
            Queued::Compact => spec.compact_first = true,
        }
        let run = core.start_run(spec).map_err(|e| e.to_string())?;
        self.run = Some(run);
        Ok(())
    }

    /// Text input: the prompt is the run's one message; no more input will come.
    pub fn start_text(&mut self, core: &mut DriveCore, prompt: String) -> Result<(), String> {
        self.start(core, Queued::Message(vec![ContentBlock::text(prompt)]))
    }

    /// stream-json input: the run starts with the first user line.
    pub fn wait_for_first_line(&mut self) {
        self.awaiting_input = true;
    }

    fn feed_pending(&mut self, cx: &mut Cx<()>) {
        if !self.awaiting_input || self.unstarted_end.is_some() {
            return;
        }
        if let Some(queued) = self.queued.pop_front() {
            self.awaiting_input = false;
            let Some(run) = self.run else {
                if let Err(e) = self.start(cx.core, queued) {
                    // The core takes any first message (even an empty one is the model's to
                    // refuse); should it refuse one, that is a runtime error, as the model's
                    // refusal would be.
                    let why = StopCondition::ProviderError(format!("cannot start the run: {e}"));
                    self.end_unstarted(&why);
                }
                return;
            };
            let input = match queued {
                Queued::Message(content) => Inbound::Blocks(content),
                Queued::Compact => Inbound::Compact,
            };
            if let Err(e) = cx.core.send_input(run, input) {
                crate::log::warn(&format!("stream-json input not delivered: {e}"));
            }
            return;
        }
        if self.stdin_done {
            self.awaiting_input = false;
            match self.run {
                Some(run) => {
                    if let Err(e) = cx.core.send_input(run, Inbound::EndInput) {
                        crate::log::warn(&format!("cannot end the run's input: {e}"));
                    }
                }
                // Nothing ever started a run: the result says why (no input).
                None => self.end_unstarted(&StopCondition::EndOfTurn),
            }
        }
    }

    /// Stops the run's turn (or the run, when it waits for input); before there is a run,
    /// ends print mode as a cancelled run would.
    fn cancel(&mut self, cx: &mut Cx<()>) {
        match self.run {
            Some(run) => {
                let _ = cx.core.cancel(run);
            }
            None => self.end_unstarted(&StopCondition::Cancelled),
        }
    }

    /// The end of a print run that never started (stdin ended or was refused before its
    /// first line): the same result a run started with nothing would report, once, at the
    /// end of the batch (`after_batch`). The first reason stands.
    fn end_unstarted(&mut self, why: &StopCondition) {
        self.spec = None;
        self.unstarted_end.get_or_insert_with(|| why.clone());
    }

    /// The one result frame, and the end of print mode.
    fn finish(&mut self, cx: &mut Cx<()>, why: &StopCondition) {
        if !self.ended {
            self.ended = true;
            self.result(why);
            cx.act(HostAction::Quit);
        }
    }
}

impl Surface for Printer {
    /// Print mode registers no sources of its own.
    type Key = ();

    fn write_output(&mut self, out: &mut Vec<u8>) {
        out.append(&mut self.out);
    }

    fn on_event(&mut self, _cx: &mut Cx<()>, _run: RunId, event: &TurnEvent) {
        self.render(event);
    }

    fn answer_ask(&mut self, _cx: &mut Cx<()>, _run: RunId, call: &ToolCall) -> Option<AskReply> {
        Some(AskReply::Deny(
            self.policy.ask_denied_message(&call.name, &call.input),
        ))
    }

    fn on_retry(&mut self, _cx: &mut Cx<()>, _run: RunId, notice: &RetryNotice) {
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

    fn on_await_input(&mut self, cx: &mut Cx<()>, _run: RunId) {
        self.awaiting_input = true;
        self.feed_pending(cx);
    }

    fn on_finished(&mut self, cx: &mut Cx<()>, _run: RunId, why: &StopCondition) {
        self.finish(cx, why);
    }

    fn after_batch(&mut self, cx: &mut Cx<()>, _changed: &BTreeSet<RunId>) {
        if let Some(why) = self.unstarted_end.take() {
            self.finish(cx, &why);
        }
    }

    fn on_stdin(&mut self, cx: &mut Cx<()>, item: StdinItem) {
        if self.input != InputFormat::StreamJson || self.ended {
            return;
        }
        match item {
            StdinItem::Eof => {
                self.stdin_done = true;
                if !self.got_input && self.input_error.is_none() {
                    self.input_error = Some((
                        exit::NO_INPUT,
                        "no input: stdin ended before any user message".to_owned(),
                    ));
                }
                self.feed_pending(cx);
            }
            StdinItem::Oversized => {
                self.input_error = Some((
                    exit::USAGE,
                    format!(
                        "stream-json input: a line exceeds {} bytes",
                        stdio::MAX_LINE
                    ),
                ));
                self.cancel(cx);
            }
            StdinItem::Line(line) => match self.parse_input_line(&line) {
                Ok(None) => {}
                // A compaction is not a message: before any, it compacts what `--continue`
                // or `--resume` brought (a fresh run has nothing to compact and waits on).
                Ok(Some(Queued::Compact)) => {
                    self.queued.push_back(Queued::Compact);
                    self.feed_pending(cx);
                }
                Ok(Some(queued)) => {
                    self.got_input = true;
                    self.queued.push_back(queued);
                    self.feed_pending(cx);
                }
                // `control/interrupt`: stop the current turn, like a first Ctrl-C.
                Err(e) if e.is_empty() => self.cancel(cx),
                Err(e) => {
                    self.input_error = Some((exit::USAGE, e));
                    self.cancel(cx);
                }
            },
        }
    }

    fn on_signal(&mut self, cx: &mut Cx<()>, signal: Signal) {
        if signal == Signal::Interrupt {
            self.interrupts += 1;
        }
        if self.interrupts >= 2 {
            self.exit_code = exit::INTERRUPTED_TWICE;
            cx.act(HostAction::Quit);
            return;
        }
        self.cancel(cx);
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
    use crate::drive::table::{CoreAction, DriveConfig};

    fn printer(output: OutputFormat, partial: bool) -> Printer {
        let mut header = serde_json::Map::new();
        header.insert("surface".into(), json!("print"));
        header.insert("session_id".into(), json!("s"));
        Printer::new(
            RunSpec {
                extra_header: header,
                ..RunSpec::default()
            },
            output,
            InputFormat::Text,
            partial,
            "s".into(),
            "anthropic",
            "m".into(),
            Policy::new(
                Vec::new(),
                crate::permissions::Mode::Default,
                std::path::PathBuf::from("/ws"),
            ),
        )
    }

    fn frames(printer: &mut Printer) -> Vec<Value> {
        let mut out = Vec::new();
        printer.write_output(&mut out);
        out.split(|b| *b == b'\n')
            .filter(|line| !line.is_empty())
            .map(|line| serde_json::from_slice(line).expect("a JSON frame"))
            .collect()
    }

    fn turn_end(text: &str) -> TurnEvent {
        TurnEvent::TurnEnd {
            turn_index: 0,
            assistant_message: Message {
                role: crate::model::types::Role::Assistant,
                content: vec![ContentBlock::text(text.to_owned())],
            },
            tool_results: Vec::new(),
            stop_reason: crate::model::types::StopReason::EndTurn,
            usage: Usage {
                input_tokens: 12,
                output_tokens: 5,
                ..Usage::default()
            },
            ttft: None,
            tbt: None,
        }
    }

    #[test]
    fn tool_use_frames_hold_streamed_input_to_the_cap() {
        let mut printer = printer(OutputFormat::StreamJson, false);
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

    #[test]
    fn partial_messages_show_deltas_and_whole_ones_the_message() {
        let delta = TurnEvent::AssistantTextDelta {
            turn_index: 0,
            content_block_index: 0,
            text: "hi".into(),
        };
        let mut partial = printer(OutputFormat::StreamJson, true);
        partial.render(&delta);
        partial.render(&turn_end("hi"));
        assert_eq!(
            frames(&mut partial),
            [json!({"type": "text", "delta": "hi"})]
        );

        let mut whole = printer(OutputFormat::StreamJson, false);
        whole.render(&delta);
        whole.render(&turn_end("hi"));
        assert_eq!(
            frames(&mut whole),
            [json!({"type": "message", "role": "assistant",
                    "content": [{"type": "text", "text": "hi"}]})]
        );
    }

    #[test]
    fn the_result_counts_turns_and_usage_and_sets_the_exit_code() {
        let mut printer = printer(OutputFormat::Json, false);
        printer.render(&turn_end("first"));
        printer.render(&turn_end("second"));
        printer.result(&StopCondition::EndOfTurn);
        let [result] = &frames(&mut printer)[..] else {
            panic!("one result object");
        };
        assert_eq!(
            (
                &result["subtype"],
                &result["result"],
                &result["num_turns"],
                &result["total_input_tokens"],
                &result["is_error"]
            ),
            (
                &json!("success"),
                &json!("second"),
                &json!(2),
                &json!(24),
                &json!(false)
            )
        );
        assert_eq!(printer.exit_code, exit::OK);
    }

    #[test]
    fn an_input_error_outranks_how_the_run_ended() {
        let mut printer = printer(OutputFormat::Json, false);
        printer.render(&turn_end("partial answer"));
        printer.input_error = Some((exit::USAGE, "stream-json input: missing `type`".into()));
        printer.result(&StopCondition::Cancelled);
        let result = &frames(&mut printer)[0];
        assert_eq!(result["subtype"], "error");
        assert_eq!(result["error"], "stream-json input: missing `type`");
        assert_eq!(result["last_assistant_text"], "partial answer");
        assert_eq!(printer.exit_code, exit::USAGE);
    }

    /// A fresh sessions directory and workspace under the temp dir, removed on drop.
    struct Scratch(std::path::PathBuf);

    impl Scratch {
        fn new(name: &str) -> Scratch {
            let dir = std::env::temp_dir()
                .join(format!("caliban-print-test-{}-{name}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(dir.join("ws")).expect("create the workspace");
            Scratch(dir.canonicalize().expect("canonical"))
        }

        fn core(&self) -> DriveCore {
            let store = crate::drive::session::SessionStore::open(self.0.join("sessions"))
                .expect("open the store");
            let workspace = self.0.join("ws");
            let config = DriveConfig {
                run: crate::agent::run::RunConfig {
                    model: "m".into(),
                    max_tokens: 8192,
                    max_turns: 50,
                    system: String::new(),
                    tools: std::sync::Arc::default(),
                    interactive: false,
                    context_window: None,
                    effort: None,
                    sandbox_retry: false,
                    mcp_allowlist: None,
                },
                policy: Policy::new(
                    Vec::new(),
                    crate::permissions::Mode::Default,
                    workspace.clone(),
                ),
                workspace,
                provider: "anthropic",
                permission_timeout: crate::drive::table::DEFAULT_PERMISSION_TIMEOUT,
                system_prompt: Some("system".into()),
                instructions: Default::default(),
                max_working_runs: 1,
                max_live_runs: 1,
                context_windows: Default::default(),
                models: Vec::new(),
                mcp_names: Vec::new(),
            };
            DriveCore::new(store.without_syncs(), config)
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn engine_actions(core: &mut DriveCore) -> Vec<&'static str> {
        core.take_actions()
            .into_iter()
            .map(|action| match action {
                CoreAction::Engine(HostAction::StartRun { .. }) => "start",
                CoreAction::Engine(HostAction::SendInput(..)) => "input",
                CoreAction::Engine(HostAction::Compact(..)) => "compact",
                _ => "other",
            })
            .collect()
    }

    #[test]
    fn a_text_prompt_starts_the_run_through_the_core_which_records_it() {
        let scratch = Scratch::new("text");
        let mut core = scratch.core();
        let mut printer = printer(OutputFormat::Text, false);
        printer
            .start_text(&mut core, "say hi".into())
            .expect("started");
        assert_eq!(engine_actions(&mut core), ["start", "input"]);
        let run = printer.run.expect("a run");
        let header = core.header(run).expect("a header");
        assert_eq!(
            (
                &header["surface"],
                &header["session_id"],
                &header["prompt"],
                &header["interactive"]
            ),
            (
                &json!("print"),
                &json!("s"),
                &json!("say hi"),
                &json!(false)
            )
        );
        assert!(
            printer.start_text(&mut core, "again".into()).is_err(),
            "one run per printer"
        );
    }

    /// The model is sent the first message's blocks in their order, and an empty one too;
    /// the header records its text and its images.
    #[test]
    fn a_first_message_goes_to_the_model_as_it_came() {
        let image = ContentBlock::from_json(&json!({"type": "image", "source":
            {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}))
        .expect("an image block");
        let blocks = vec![
            image.clone(),
            ContentBlock::text("look ".to_owned()),
            image.clone(),
            ContentBlock::text("here".to_owned()),
        ];
        for (message, prompt, images) in [
            (blocks, "look here", vec![image.to_json(), image.to_json()]),
            (vec![ContentBlock::text(String::new())], "", Vec::new()),
        ] {
            let scratch = Scratch::new("first");
            let mut core = scratch.core();
            let mut printer = printer(OutputFormat::StreamJson, false);
            printer
                .start(&mut core, Queued::Message(message.clone()))
                .expect("started");
            let sent: Vec<Vec<ContentBlock>> = core
                .take_actions()
                .into_iter()
                .filter_map(|action| match action {
                    CoreAction::Engine(HostAction::SendInput(_, content)) => Some(content),
                    _ => None,
                })
                .collect();
            assert_eq!(sent, [message]);
            let header = core.header(printer.run.expect("a run")).expect("a header");
            assert_eq!(header["prompt"], prompt);
            assert_eq!(
                header.get("images").cloned(),
                (!images.is_empty()).then(|| json!(images))
            );
        }
    }

    #[test]
    fn a_compaction_first_starts_the_run_with_no_prompt() {
        let scratch = Scratch::new("compact");
        let mut core = scratch.core();
        let mut printer = printer(OutputFormat::StreamJson, false);
        printer.start(&mut core, Queued::Compact).expect("started");
        assert_eq!(engine_actions(&mut core), ["start", "compact"]);
        let header = core.header(printer.run.expect("a run")).expect("a header");
        assert_eq!(header["prompt"], "");
    }
}
