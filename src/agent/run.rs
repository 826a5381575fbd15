//! One agent run as a state machine: it turns model events, tool results and permission
//! answers into `TurnEvent`s and into requests for work (`Effect`s) that the engine performs.
//! It never touches a socket, a process or a clock it was not handed.
//!
//! LIFECYCLE (`Phase`): `Idle` → `Model` (one streamed model turn) → `Tools` (permission
//! checks and tool execution for that turn) → `Model` … until the model stops asking for
//! tools; then `Idle` again for an interactive run waiting for input, or `Done` after
//! `RunEnd`, which is always the last event.
//!
//! COMPACTION (`Phase::Compact`): before a model turn whose request would not fit the
//! context window (`RunConfig::context_window`), or when a client asks (`Run::compact`), the
//! run asks the model for a summary of the older conversation instead, replaces those
//! messages with it (`agent::compact`), emits `Compaction` and carries on with the turn (or
//! waits for input again). A summary that cannot be had ends the run with
//! `CompactionFailed`.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::agent::compact::{self, Next, Trigger};
use crate::agent::event::{StopCondition, TurnEvent, result_text};
use crate::agent::tool_input::ToolInput;
use crate::model::types::{
    ContentBlock, Effort, MAX_IMAGES, Message, ModelEvent, ModelRequest, Role, StopReason,
    ToolSpec, Usage, swap_images,
};
use crate::permissions::{Action, Mode, Policy};
use crate::sandbox;
use crate::tools::{MAX_RESULT_IMAGES_BASE64, ToolOutput, mcp_name, table};

#[derive(Clone, Debug)]
pub struct RunConfig {
    pub model: String,
    pub max_tokens: u32,
    pub max_turns: u32,
    pub system: String,
    /// Shared by every run a server starts: the built-in tools' schemas are a tree of JSON
    /// values, which copied into each of 10,000 idle runs was most of their memory. A run
    /// with tools of its own (MCP servers, an allowlist) gets a copy of its own.
    pub tools: Arc<Vec<ToolSpec>>,
    /// Interactive runs stop at each turn boundary and wait for `send_input`.
    pub interactive: bool,
    /// The model's context window in tokens, when known: requests that would not fit are
    /// compacted first. `None`: never compacted unless a client asks.
    pub context_window: Option<u64>,
    /// Extended thinking / reasoning effort (ACP's `thought_level`).
    pub effort: Option<Effort>,
    /// Someone can be asked to run a call the sandbox refused outside it (a drive
    /// surface); print mode has no one to ask.
    pub sandbox_retry: bool,
    /// The MCP tools a networked agent's `tool_allowlist` admits (`mcp__server__tool`,
    /// `mcp__server__*`); `None` admits every tool the run's servers offer.
    pub mcp_allowlist: Option<Arc<[String]>>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    pub input: Value,
}

/// Work the run asks its engine to do.
#[derive(Clone, Debug, PartialEq)]
pub enum Effect {
    Emit(TurnEvent),
    /// Start (or retry) a streamed model request built from `Run::model_request`.
    RequestModel,
    /// Execute an allowed tool call; answer with `on_tool_done`.
    RunTool(ToolCall),
    /// An Ask rule matched: someone must answer with `on_permission`.
    Ask(ToolCall),
    /// Stop the model stream and kill running tools (the run was cancelled).
    AbortWork,
    /// A compaction began (its summary request follows); `Emit(Compaction)` or `RunEnd`
    /// ends it. Hosts that show a compaction's progress (ACP) start showing it here.
    CompactionStarted(Trigger),
    /// The turn ended and an interactive run now waits for input.
    AwaitInput,
    /// `RunEnd` was emitted; nothing more will happen.
    Finished(StopCondition),
}

#[derive(Debug, Default)]
struct BlockAcc {
    kind: BlockKind,
    /// Text and thinking blocks' text.
    text: String,
    signature: Option<String>,
    tool_id: String,
    tool_name: String,
    /// A tool-use block's streamed input.
    input: ToolInput,
}

#[derive(Debug, Default, PartialEq)]
enum BlockKind {
    #[default]
    Text,
    Thinking,
    ToolUse,
}

#[derive(Debug)]
struct TurnAcc {
    message_id: String,
    model: String,
    /// `TurnStart` is held back until the first content arrives, so a request that fails
    /// before producing anything can be retried without a duplicate `TurnStart`.
    announced: bool,
    blocks: BTreeMap<u32, BlockAcc>,
    usage: Usage,
    stop: Option<StopReason>,
    requested_at: Instant,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    gaps: Duration,
    n_gaps: u32,
}

#[derive(Debug)]
struct ToolsPhase {
    assistant: Message,
    stop_reason: StopReason,
    usage: Usage,
    ttft: Option<Duration>,
    tbt: Option<Duration>,
    calls: Vec<ToolCall>,
    results: Vec<Option<ToolOutput>>,
    /// The file-changing call (`tools::table::edits_files`: Write, Edit) now running;
    /// others wait in `deferred`, in call order, so two edits of one file never race (each
    /// would read the file before the other wrote it, and one edit would be lost).
    mutating: Option<String>,
    deferred: VecDeque<ToolCall>,
    /// Results of calls the sandbox refused, held while the user is asked whether to run
    /// them outside it.
    held: BTreeMap<String, ToolOutput>,
    /// Calls the user let run outside the sandbox.
    unconfined: BTreeSet<String>,
}

impl ToolsPhase {
    /// Runs `call` now, or queues it behind the file change in progress.
    fn start(&mut self, call: ToolCall) -> Option<Effect> {
        if !table::edits_files(&call.name) {
            return Some(Effect::RunTool(call));
        }
        if self.mutating.is_some() {
            self.deferred.push_back(call);
            return None;
        }
        self.mutating = Some(call.id.clone());
        Some(Effect::RunTool(call))
    }

    /// A call finished: if it was the running file change, start the next queued one.
    fn finished(&mut self, tool_use_id: &str) -> Option<Effect> {
        if self.mutating.as_deref() != Some(tool_use_id) {
            return None;
        }
        self.mutating = None;
        let next = self.deferred.pop_front()?;
        self.start(next)
    }
}

/// What the run does once its compaction is done.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Then {
    /// Send the model turn the compaction made room for.
    Turn,
    /// Wait for input again (a client asked while the run was idle).
    Idle,
}

#[derive(Debug)]
struct CompactAcc {
    trigger: Trigger,
    then: Then,
    /// The summary request's messages.
    request: Vec<Message>,
    /// `messages[..split]` are summarised, the rest kept.
    split: usize,
    pre_tokens: u64,
    text: String,
    usage: Usage,
}

#[derive(Debug)]
enum Phase {
    Idle,
    Model(TurnAcc),
    Tools(ToolsPhase),
    Compact(CompactAcc),
    Done,
}

pub struct Run {
    config: RunConfig,
    /// What the model is offered: the configured tools (taken out of `config`, not copied:
    /// an idle run's size counts), then the tools MCP servers offer now (`set_extra_tools`).
    /// Shared with every run of the same configuration (see `RunConfig::tools`) until MCP
    /// servers add tools of their own.
    tools: Arc<Vec<ToolSpec>>,
    /// How many of `tools` are the configured ones.
    configured_tools: usize,
    policy: Policy,
    messages: Vec<Message>,
    phase: Phase,
    turn_index: u32,
    turn_count: u32,
    total_usage: Usage,
    turns_without_edit: u32,
    /// The context's size in tokens as the last response reported it, and how many
    /// messages it covered; `None` before the first response and after a compaction.
    context: Option<(u64, usize)>,
    /// The run compacted on its own and no model turn has completed since: it does not
    /// compact again before one has (a kept part too large to fit would loop).
    compacted_last: bool,
}

impl Run {
    pub fn new(mut config: RunConfig, policy: Policy, history: Vec<Message>) -> Run {
        let tools = std::mem::take(&mut config.tools);
        Run {
            configured_tools: tools.len(),
            tools,
            config,
            policy,
            messages: history,
            phase: Phase::Idle,
            turn_index: 0,
            turn_count: 0,
            total_usage: Usage::default(),
            turns_without_edit: 0,
            context: None,
            compacted_last: false,
        }
    }

    /// A client chose another model or thinking effort: the next request uses them.
    pub fn reconfigure(
        &mut self,
        model: String,
        context_window: Option<u64>,
        effort: Option<Effort>,
    ) {
        self.config.model = model;
        self.config.context_window = context_window;
        self.config.effort = effort;
    }

    /// The tools offered besides the configured ones (MCP servers' tools, as they list
    /// them now, less those an allowlist leaves out): the next model request offers them,
    /// and calls are checked against them.
    pub fn set_extra_tools(&mut self, mut extra: Vec<ToolSpec>) {
        if let Some(allowed) = &self.config.mcp_allowlist {
            extra.retain(|t| mcp_name::allowlist_admits(allowed, &t.name));
        }
        if extra.is_empty() && self.tools.len() == self.configured_tools {
            return;
        }
        let tools = Arc::make_mut(&mut self.tools);
        tools.truncate(self.configured_tools);
        tools.extend(extra);
    }

    pub fn policy_mut(&mut self) -> &mut Policy {
        &mut self.policy
    }

    pub fn is_done(&self) -> bool {
        matches!(self.phase, Phase::Done)
    }

    pub fn is_idle(&self) -> bool {
        matches!(self.phase, Phase::Idle)
    }

    /// The turn in progress (or the next one, between turns), for events the engine adds.
    pub fn turn_index(&self) -> u32 {
        self.turn_index
    }

    /// The request for the turn in flight (or for the summary, while compacting).
    pub fn model_request(&self) -> ModelRequest<'_> {
        if let Phase::Compact(acc) = &self.phase {
            return ModelRequest {
                model: &self.config.model,
                max_tokens: self.config.max_tokens.min(compact::SUMMARY_MAX_TOKENS),
                effort: None,
                system: compact::SYSTEM,
                messages: &acc.request,
                // Offered although not wanted: Anthropic refuses a conversation with tool
                // calls in it and no tools defined.
                tools: &self.tools,
            };
        }
        ModelRequest {
            model: &self.config.model,
            max_tokens: self.config.max_tokens,
            effort: self.config.effort,
            system: &self.config.system,
            messages: &self.messages,
            tools: &self.tools,
        }
    }

    /// Delivers a user message: the first prompt, or follow-up input at a turn boundary.
    pub fn send_user(&mut self, content: Vec<ContentBlock>, now: Instant) -> Vec<Effect> {
        if !self.is_idle() {
            return Vec::new();
        }
        self.messages.push(Message {
            role: Role::User,
            content,
        });
        self.begin_turn(now)
    }

    /// The estimated size in tokens of the next request: the last reported context plus
    /// what was added since, or all of it estimated from its bytes.
    pub fn context_tokens(&self) -> u64 {
        match self.context {
            Some((tokens, at)) if at <= self.messages.len() => self.messages[at..]
                .iter()
                .map(compact::message_tokens)
                .fold(tokens, u64::saturating_add),
            _ => {
                let tools: usize = self
                    .tools
                    .iter()
                    .map(|t| t.name.len() + t.description.len() + t.input_schema.to_string().len())
                    .sum();
                let fixed = compact::tokens_of_bytes(self.config.system.len() + tools);
                self.messages
                    .iter()
                    .map(compact::message_tokens)
                    .fold(fixed, u64::saturating_add)
            }
        }
    }

    /// Compacts the conversation of an idle interactive run, as a client asked; the run
    /// waits for input again afterwards. A conversation with nothing to summarise is left
    /// as it is.
    pub fn compact(&mut self) -> Vec<Effect> {
        if !self.is_idle() {
            return Vec::new();
        }
        let pre_tokens = self.context_tokens();
        let keep = pre_tokens / 4;
        self.start_compaction(Trigger::Manual, Then::Idle, pre_tokens, keep)
            .unwrap_or_else(|| vec![Effect::AwaitInput])
    }

    fn start_compaction(
        &mut self,
        trigger: Trigger,
        then: Then,
        pre_tokens: u64,
        keep_tokens: u64,
    ) -> Option<Vec<Effect>> {
        let split = compact::split_point(&self.messages, keep_tokens);
        // Only what the model said can be summarised; a lone prompt is what it is.
        if !self.messages[..split]
            .iter()
            .any(|m| m.role == Role::Assistant)
        {
            return None;
        }
        self.phase = Phase::Compact(CompactAcc {
            trigger,
            then,
            request: compact::request_messages(&self.messages[..split]),
            split,
            pre_tokens,
            text: String::new(),
            usage: Usage::default(),
        });
        Some(vec![
            Effect::CompactionStarted(trigger),
            Effect::RequestModel,
        ])
    }

    /// The summary arrived: the summarised messages give way to it, and the run goes on.
    fn finish_compaction(&mut self, acc: CompactAcc, now: Instant) -> Vec<Effect> {
        let summary = acc.text.trim();
        if summary.is_empty() {
            return self.finish(StopCondition::CompactionFailed(
                "the model answered the summary request with no text".to_owned(),
            ));
        }
        self.total_usage.add(&acc.usage);
        let tail = self.messages.split_off(acc.split.min(self.messages.len()));
        let next = if tail.is_empty() && acc.then == Then::Turn {
            Next::Model
        } else {
            Next::User
        };
        // The plan lives in the conversation: when its last version is being summarised,
        // the compacted head carries it word for word.
        let plan = compact::latest_plan(&tail)
            .is_none()
            .then(|| compact::latest_plan(&self.messages))
            .flatten();
        let head = compact::head(summary, next, plan.as_deref());
        let summarized = self.messages.len();
        let kept = tail.len();
        self.messages = head.clone();
        self.messages.extend(tail);
        self.context = None;
        let mut out = vec![Effect::Emit(TurnEvent::Compaction {
            turn_index: self.turn_index,
            trigger: acc.trigger,
            pre_tokens: acc.pre_tokens,
            post_tokens: self.context_tokens(),
            messages_summarized: u32::try_from(summarized).unwrap_or(u32::MAX),
            messages_kept: u32::try_from(kept).unwrap_or(u32::MAX),
            summary: summary.to_owned(),
            messages: head,
            usage: acc.usage,
        })];
        match acc.then {
            Then::Turn => {
                self.compacted_last = true;
                out.extend(self.begin_turn(now));
            }
            Then::Idle => {
                self.phase = Phase::Idle;
                out.push(Effect::AwaitInput);
            }
        }
        out
    }

    fn begin_turn(&mut self, now: Instant) -> Vec<Effect> {
        if let Some(window) = self.config.context_window
            && !self.compacted_last
        {
            let limit = compact::limit(window, self.config.max_tokens);
            let estimate = self.context_tokens();
            if estimate > limit
                && let Some(effects) =
                    self.start_compaction(Trigger::Auto, Then::Turn, estimate, limit / 4)
            {
                return effects;
            }
        }
        self.phase = Phase::Model(TurnAcc {
            message_id: String::new(),
            model: self.config.model.clone(),
            announced: false,
            blocks: BTreeMap::new(),
            usage: Usage::default(),
            stop: None,
            requested_at: now,
            first_token: None,
            last_token: None,
            gaps: Duration::ZERO,
            n_gaps: 0,
        });
        vec![Effect::RequestModel]
    }

    /// True while nothing of the current model turn has been shown, so a failed request may
    /// be re-sent without the client seeing anything twice.
    pub fn can_retry_turn(&self) -> bool {
        match &self.phase {
            Phase::Model(acc) => !acc.announced,
            // A summary request shows nothing until it is complete.
            Phase::Compact(_) => true,
            _ => false,
        }
    }

    /// Forgets a failed attempt's partial state before a retry.
    pub fn reset_turn_for_retry(&mut self, now: Instant) {
        if let Phase::Model(acc) = &mut self.phase {
            acc.blocks.clear();
            acc.usage = Usage::default();
            acc.stop = None;
            acc.requested_at = now;
        }
        if let Phase::Compact(acc) = &mut self.phase {
            acc.text.clear();
            acc.usage = Usage::default();
        }
    }

    pub fn on_model_event(&mut self, event: ModelEvent, now: Instant) -> Vec<Effect> {
        let turn_index = self.turn_index;
        if let Phase::Compact(acc) = &mut self.phase {
            // The summary is gathered, not shown: it is emitted whole in `Compaction`.
            match event {
                ModelEvent::TextDelta { text, .. } => acc.text.push_str(&text),
                ModelEvent::Usage(usage) => acc.usage = usage,
                _ => {}
            }
            return Vec::new();
        }
        let Phase::Model(acc) = &mut self.phase else {
            return Vec::new();
        };
        let mut out = Vec::new();
        let content = |acc: &mut TurnAcc, out: &mut Vec<Effect>| {
            if !acc.announced {
                acc.announced = true;
                out.push(Effect::Emit(TurnEvent::TurnStart {
                    turn_index,
                    message_id: acc.message_id.clone(),
                    model: acc.model.clone(),
                }));
            }
            if let Some(last) = acc.last_token {
                acc.gaps += now.saturating_duration_since(last);
                acc.n_gaps += 1;
            } else {
                acc.first_token = Some(now);
            }
            acc.last_token = Some(now);
        };
        match event {
            ModelEvent::Start { message_id, model } => {
                if !message_id.is_empty() {
                    acc.message_id = message_id;
                }
                if !model.is_empty() {
                    acc.model = model;
                }
            }
            ModelEvent::TextDelta { index, text } => {
                if text.is_empty() {
                    return out;
                }
                content(acc, &mut out);
                acc.blocks.entry(index).or_default().text.push_str(&text);
                out.push(Effect::Emit(TurnEvent::AssistantTextDelta {
                    turn_index,
                    content_block_index: index,
                    text,
                }));
            }
            ModelEvent::ThinkingDelta { index, text } => {
                content(acc, &mut out);
                let block = acc.blocks.entry(index).or_default();
                block.kind = BlockKind::Thinking;
                block.text.push_str(&text);
                out.push(Effect::Emit(TurnEvent::AssistantThinkingDelta {
                    turn_index,
                    content_block_index: index,
                    text,
                }));
            }
            ModelEvent::ThinkingSignature { index, signature } => {
                let block = acc.blocks.entry(index).or_default();
                block.kind = BlockKind::Thinking;
                block.signature = Some(signature);
            }
            ModelEvent::ToolCallStart { index, id, name } => {
                content(acc, &mut out);
                let block = acc.blocks.entry(index).or_default();
                block.kind = BlockKind::ToolUse;
                block.tool_id = id.clone();
                block.tool_name = name.clone();
                out.push(Effect::Emit(TurnEvent::ToolCallStart {
                    turn_index,
                    tool_use_id: id,
                    name,
                }));
            }
            ModelEvent::ToolCallInputDelta {
                index,
                partial_json,
            } => {
                if partial_json.is_empty() {
                    return out;
                }
                let Some(block) = acc.blocks.get_mut(&index) else {
                    return out;
                };
                if block.kind != BlockKind::ToolUse {
                    return out;
                }
                content(acc, &mut out);
                let Some(block) = acc.blocks.get_mut(&index) else {
                    return out;
                };
                block.input.push(&partial_json);
                out.push(Effect::Emit(TurnEvent::ToolCallInputDelta {
                    turn_index,
                    tool_use_id: block.tool_id.clone(),
                    partial_json,
                }));
            }
            ModelEvent::Usage(usage) => acc.usage = usage,
            ModelEvent::Stop(reason) => acc.stop = Some(reason),
            ModelEvent::Done | ModelEvent::Error { .. } => {}
        }
        out
    }

    /// The model stream ended normally: close the turn and decide what happens next.
    pub fn on_model_complete(&mut self, now: Instant) -> Vec<Effect> {
        let turn_index = self.turn_index;
        let mut acc = match std::mem::replace(&mut self.phase, Phase::Idle) {
            Phase::Model(acc) => acc,
            Phase::Compact(acc) => return self.finish_compaction(acc, now),
            other => {
                self.phase = other;
                return Vec::new();
            }
        };
        let mut out = Vec::new();
        if !acc.announced {
            acc.announced = true;
            out.push(Effect::Emit(TurnEvent::TurnStart {
                turn_index,
                message_id: acc.message_id.clone(),
                model: acc.model.clone(),
            }));
        }
        let mut content = Vec::new();
        let mut calls = Vec::new();
        // Per call (same index): why it must not run, decided before permissions.
        let mut refusals: Vec<Option<String>> = Vec::new();
        // Per call: it repeats an earlier call's id in this turn.
        let mut repeats: Vec<bool> = Vec::new();
        for block in std::mem::take(&mut acc.blocks).into_values() {
            match block.kind {
                BlockKind::Text if !block.text.is_empty() => {
                    content.push(ContentBlock::Text { text: block.text })
                }
                BlockKind::Text => {}
                BlockKind::Thinking => content.push(ContentBlock::Thinking {
                    thinking: block.text,
                    signature: block.signature,
                }),
                BlockKind::ToolUse => {
                    let (input, mut error) = match block.input.parse() {
                        Ok(input) => (input, None),
                        Err(error) => (Value::Object(Default::default()), Some(error)),
                    };
                    // Results are matched to calls by id, so a repeated id (a confused model
                    // or server) could only ever be answered once: refuse the repeats.
                    let repeat = calls.iter().any(|c: &ToolCall| c.id == block.tool_id);
                    if repeat {
                        error = Some(format!(
                            "duplicate tool_use id `{}` in one turn; the call was not executed",
                            block.tool_id
                        ));
                    }
                    repeats.push(repeat);
                    content.push(ContentBlock::ToolUse {
                        id: block.tool_id.clone(),
                        name: block.tool_name.clone(),
                        input: input.clone(),
                    });
                    refusals.push(error);
                    calls.push(ToolCall {
                        id: block.tool_id,
                        name: block.tool_name,
                        input,
                    });
                }
            }
        }
        let stop_reason = match acc.stop {
            // Tool calls are authoritative over a provider that said `stop` (models.md §2.2).
            Some(StopReason::EndTurn) | None if !calls.is_empty() => StopReason::ToolUse,
            Some(reason) => reason,
            None => StopReason::EndTurn,
        };
        let ttft = acc
            .first_token
            .map(|t| t.saturating_duration_since(acc.requested_at));
        let tbt = (acc.n_gaps > 0).then(|| acc.gaps / acc.n_gaps);
        self.total_usage.add(&acc.usage);
        self.turn_count += 1;
        let assistant = Message {
            role: Role::Assistant,
            content,
        };
        self.messages.push(assistant.clone());
        let context = acc
            .usage
            .input_tokens
            .saturating_add(acc.usage.output_tokens);
        // A server that reports no usage leaves the estimate to the bytes.
        self.context = (context > 0).then_some((context, self.messages.len()));
        self.compacted_last = false;

        if calls.is_empty() {
            out.push(Effect::Emit(TurnEvent::TurnEnd {
                turn_index,
                assistant_message: assistant,
                tool_results: Vec::new(),
                stop_reason,
                usage: acc.usage,
                ttft,
                tbt,
            }));
            self.turn_index += 1;
            self.turns_without_edit += 1;
            let condition = match stop_reason {
                StopReason::MaxTokens => StopCondition::MaxTokensExhausted,
                StopReason::Refusal => StopCondition::Refusal("the model refused".to_owned()),
                StopReason::ContentFilter => StopCondition::ContentFilter(
                    "the provider's content filter stopped the turn".to_owned(),
                ),
                _ => StopCondition::EndOfTurn,
            };
            if self.config.interactive && condition == StopCondition::EndOfTurn {
                out.push(Effect::AwaitInput);
            } else {
                out.extend(self.finish(condition));
            }
            return out;
        }

        let mut tools = ToolsPhase {
            assistant,
            stop_reason,
            usage: acc.usage,
            ttft,
            tbt,
            results: vec![None; calls.len()],
            calls: calls.clone(),
            mutating: None,
            deferred: VecDeque::new(),
            held: BTreeMap::new(),
            unconfined: BTreeSet::new(),
        };
        let mut asks = Vec::new();
        for ((slot, call), refusal) in calls.into_iter().enumerate().zip(refusals) {
            if let Some(error) = refusal {
                tools.results[slot] = Some(ToolOutput::error(error));
                continue;
            }
            if !self.tools.iter().any(|t| t.name == call.name) {
                tools.results[slot] = Some(ToolOutput::error(format!(
                    "unknown tool '{}'; available tools: {}",
                    call.name,
                    self.tools
                        .iter()
                        .map(|t| t.name.as_ref())
                        .collect::<Vec<_>>()
                        .join(", ")
                )));
                continue;
            }
            let decision = self.policy.decide(&call.name, &call.input);
            match decision.action {
                Action::Allow => out.extend(tools.start(call)),
                Action::Deny => tools.results[slot] = Some(ToolOutput::error(decision.reason)),
                Action::Ask => asks.push(call),
            }
        }
        out.extend(asks.into_iter().map(Effect::Ask));
        self.phase = Phase::Tools(tools);
        // Denied calls are answered at once; emit their ToolCallEnds now. The refused
        // repeats of an id go first, so every end of an id but its last is a repeat's and
        // the last is the call that counts, whenever that one is decided: a reader that
        // pairs ends with starts by id (ACP's cards) can tell them apart.
        let mut decided: Vec<(bool, String, ToolOutput)> = match &self.phase {
            Phase::Tools(t) => t
                .calls
                .iter()
                .zip(&t.results)
                .zip(&repeats)
                .filter_map(|((c, r), repeat)| r.clone().map(|r| (*repeat, c.id.clone(), r)))
                .collect(),
            _ => Vec::new(),
        };
        decided.sort_by_key(|(repeat, ..)| !repeat);
        for (_, id, result) in decided {
            out.push(Effect::Emit(tool_call_end(turn_index, &id, &result)));
        }
        out.extend(self.maybe_close_tools(now));
        out
    }

    /// A permission answer for an `Ask`. Denials become error results the model can read.
    pub fn on_permission(
        &mut self,
        tool_use_id: &str,
        allow: bool,
        denial: &str,
        now: Instant,
    ) -> Vec<Effect> {
        let turn_index = self.turn_index;
        let Phase::Tools(tools) = &mut self.phase else {
            return Vec::new();
        };
        let Some(slot) = tools.calls.iter().position(|c| c.id == tool_use_id) else {
            return Vec::new();
        };
        if tools.results[slot].is_some() {
            return Vec::new();
        }
        if let Some(mut held) = tools.held.remove(tool_use_id) {
            // The answer to "run it outside the sandbox?": the call already holds its place
            // (a file change's turn included), so it runs again at once, or ends as refused.
            if allow {
                tools.unconfined.insert(tool_use_id.to_owned());
                return vec![Effect::RunTool(tools.calls[slot].clone())];
            }
            held.text
                .push_str(&format!("\n[not run outside the sandbox: {denial}]"));
            return self.on_tool_done(tool_use_id, held, now);
        }
        if allow {
            let call = tools.calls[slot].clone();
            return tools.start(call).into_iter().collect();
        }
        let result = ToolOutput::error(denial);
        tools.results[slot] = Some(result.clone());
        let mut out = vec![Effect::Emit(tool_call_end(
            turn_index,
            tool_use_id,
            &result,
        ))];
        out.extend(self.maybe_close_tools(now));
        out
    }

    /// The sandbox mode a call runs in: the run's, or `off` once the user let it run
    /// outside the sandbox.
    pub fn sandbox_for(&self, tool_use_id: &str) -> sandbox::Mode {
        match &self.phase {
            Phase::Tools(tools) if tools.unconfined.contains(tool_use_id) => sandbox::Mode::Off,
            _ => self.policy.sandbox(),
        }
    }

    /// A call the sandbox refused (`why`), or a command that failed in a way it explains:
    /// where someone can be asked and the permission mode asks at all, they are asked
    /// whether to run it outside the sandbox, a prompt like any other for the same call,
    /// its input showing why (`"sandbox": "retry outside the sandbox …"`); otherwise, and
    /// once they said no, the call ends with `output`. `bypassPermissions` and `dontAsk`
    /// never lift the sandbox.
    pub fn on_tool_sandboxed(
        &mut self,
        tool_use_id: &str,
        output: ToolOutput,
        why: &str,
        now: Instant,
    ) -> Vec<Effect> {
        let asks = self.config.sandbox_retry
            && matches!(
                self.policy.mode(),
                Mode::Default | Mode::AcceptEdits | Mode::Plan
            );
        let mode = self.policy.sandbox();
        let Phase::Tools(tools) = &mut self.phase else {
            return Vec::new();
        };
        let Some(slot) = tools.calls.iter().position(|c| c.id == tool_use_id) else {
            return Vec::new();
        };
        if !asks || tools.unconfined.contains(tool_use_id) || tools.results[slot].is_some() {
            return self.on_tool_done(tool_use_id, output, now);
        }
        let mut shown = tools.calls[slot].clone();
        if let Value::Object(fields) = &mut shown.input {
            fields.insert(
                "sandbox".to_owned(),
                json!(format!("retry outside the sandbox ({mode}): {why}")),
            );
        }
        tools.held.insert(tool_use_id.to_owned(), output);
        vec![Effect::Ask(shown)]
    }

    pub fn on_tool_done(
        &mut self,
        tool_use_id: &str,
        output: ToolOutput,
        now: Instant,
    ) -> Vec<Effect> {
        let turn_index = self.turn_index;
        let Phase::Tools(tools) = &mut self.phase else {
            return Vec::new();
        };
        let Some(slot) = tools.calls.iter().position(|c| c.id == tool_use_id) else {
            return Vec::new();
        };
        if tools.results[slot].is_some() {
            return Vec::new();
        }
        if !output.is_error && table::edits_files(&tools.calls[slot].name) {
            self.turns_without_edit = 0;
        }
        // The turn's results go to the model (and into one `TurnEnd`) as one message, so
        // its images share one budget; a result's images past it are named in its text
        // before anyone sees the result.
        let mut output = output;
        let used = tools.results.iter().flatten().fold((0, 0), |(n, b), r| {
            (n + r.images.len(), b + r.image_bytes())
        });
        output.fit_images((
            MAX_IMAGES.saturating_sub(used.0),
            MAX_RESULT_IMAGES_BASE64.saturating_sub(used.1),
        ));
        tools.results[slot] = Some(output.clone());
        let next = tools.finished(tool_use_id);
        let mut out = vec![Effect::Emit(tool_call_end(
            turn_index,
            tool_use_id,
            &output,
        ))];
        out.extend(next);
        out.extend(self.maybe_close_tools(now));
        out
    }

    fn maybe_close_tools(&mut self, now: Instant) -> Vec<Effect> {
        let Phase::Tools(tools) = &self.phase else {
            return Vec::new();
        };
        if tools.results.iter().any(Option::is_none) {
            return Vec::new();
        }
        let Phase::Tools(tools) = std::mem::replace(&mut self.phase, Phase::Idle) else {
            return Vec::new();
        };
        let blocks = tools
            .calls
            .iter()
            .zip(tools.results)
            .map(|(call, result)| {
                let result = result.unwrap_or_else(|| ToolOutput::error("no result"));
                ContentBlock::ToolResult {
                    tool_use_id: call.id.clone(),
                    content: result.content(),
                    is_error: result.is_error,
                }
            })
            .collect();
        let results = Message {
            role: Role::User,
            content: blocks,
        };
        self.messages.push(results.clone());
        let mut out = vec![Effect::Emit(TurnEvent::TurnEnd {
            turn_index: self.turn_index,
            assistant_message: tools.assistant,
            tool_results: vec![results],
            stop_reason: tools.stop_reason,
            usage: tools.usage,
            ttft: tools.ttft,
            tbt: tools.tbt,
        })];
        self.turn_index += 1;
        if self.turn_count >= self.config.max_turns {
            out.extend(self.finish(StopCondition::MaxTurnsReached(self.config.max_turns)));
            return out;
        }
        out.extend(self.begin_turn(now));
        out
    }

    /// The model refused the request as larger than its context window: a turn that showed
    /// nothing yet compacts and is sent again (once between two completed turns, as
    /// `begin_turn` compacts). Nothing to do — an empty answer — when the request was the
    /// summary itself, or the run compacted since its last turn: the caller fails the run.
    pub fn on_context_overflow(&mut self) -> Vec<Effect> {
        let fresh = matches!(&self.phase, Phase::Model(acc) if !acc.announced);
        if !fresh || self.compacted_last {
            return Vec::new();
        }
        let estimate = self.context_tokens();
        let window = self.config.context_window.unwrap_or(estimate);
        let keep = compact::limit(window, self.config.max_tokens) / 4;
        self.start_compaction(Trigger::Auto, Then::Turn, estimate, keep)
            .unwrap_or_default()
    }

    /// The model server takes no images: every picture in the conversation becomes a line
    /// saying so, and the turn may be sent again. False when there was none to leave out (so
    /// a server that keeps refusing is not asked again for that reason), or when the turn
    /// has shown output.
    pub fn drop_images(&mut self) -> bool {
        if !self.can_retry_turn() {
            return false;
        }
        let mut dropped = 0;
        for message in &mut self.messages {
            message.content = swap_images(&message.content, &mut |block| match block {
                ContentBlock::Image { media_type, .. } => {
                    dropped += 1;
                    ContentBlock::text(format!(
                        "[an image ({media_type}) was left out: the model server does not take images]"
                    ))
                }
                other => other.clone(),
            });
        }
        dropped > 0
    }

    /// The model request failed for good (retries exhausted, or output already shown).
    pub fn on_model_failed(&mut self, condition: StopCondition) -> Vec<Effect> {
        if self.is_done() {
            return Vec::new();
        }
        if matches!(self.phase, Phase::Compact(_)) {
            let why = match condition {
                StopCondition::ProviderError(e) => e,
                other => other.to_json().to_string(),
            };
            return self.finish(StopCondition::CompactionFailed(why));
        }
        self.finish(condition)
    }

    /// Cancels whatever is in flight and ends the run.
    pub fn cancel(&mut self) -> Vec<Effect> {
        if self.is_done() {
            return Vec::new();
        }
        let mut out = vec![Effect::AbortWork];
        out.extend(self.finish(StopCondition::Cancelled));
        out
    }

    /// Ends an interactive run on end-of-input.
    pub fn end_input(&mut self) -> Vec<Effect> {
        if !self.is_idle() {
            return Vec::new();
        }
        self.finish(StopCondition::EndOfTurn)
    }

    fn finish(&mut self, condition: StopCondition) -> Vec<Effect> {
        self.phase = Phase::Done;
        vec![
            Effect::Emit(TurnEvent::RunEnd {
                final_messages: final_messages(&self.messages),
                total_usage: self.total_usage,
                turn_count: self.turn_count,
                stopped_for: condition.clone(),
                turns_without_edit: self.turns_without_edit,
                no_edit_nudge_emitted: false,
            }),
            Effect::Finished(condition),
        ]
    }
}

/// The most image base64 `RunEnd.final_messages` carries. The event is one session-file
/// line (16 MiB) and holds the whole conversation, so a run that was shown a few pictures
/// would otherwise end with an unreadable `Oversized` marker in place of its `RunEnd`.
const FINAL_IMAGES_BASE64: usize = 8 << 20;

/// The conversation as `RunEnd` reports it: the messages, with each image after the first
/// `FINAL_IMAGES_BASE64` bytes of them replaced by a line naming it (the `TurnEnd` that
/// carried it, and so every replay, keeps it).
fn final_messages(messages: &[Message]) -> Vec<Message> {
    let mut budget = FINAL_IMAGES_BASE64;
    let mut fit = |image: &ContentBlock| match image {
        ContentBlock::Image { media_type, data } if data.len() > budget => {
            ContentBlock::text(format!(
                "[an image ({media_type}, {} bytes of base64) left out of final_messages; \
                 the TurnEnd that carried it has it]",
                data.len()
            ))
        }
        ContentBlock::Image { data, .. } => {
            budget -= data.len();
            image.clone()
        }
        other => other.clone(),
    };
    messages
        .iter()
        .map(|m| Message {
            role: m.role,
            content: swap_images(&m.content, &mut fit),
        })
        .collect()
}

fn tool_call_end(turn_index: u32, tool_use_id: &str, output: &ToolOutput) -> TurnEvent {
    let content = output.content();
    let (text, truncated) = result_text(&content);
    TurnEvent::ToolCallEnd {
        turn_index,
        tool_use_id: tool_use_id.to_owned(),
        is_error: output.is_error,
        content,
        result_text: text,
        truncated,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::permissions::{Mode, Rule, RuleSource};

    fn run() -> Run {
        let config = RunConfig {
            model: "m".into(),
            max_tokens: 100,
            max_turns: 5,
            system: String::new(),
            tools: Arc::new(table::specs()),
            interactive: false,
            context_window: None,
            effort: None,
            sandbox_retry: true,
            mcp_allowlist: None,
        };
        let policy = Policy::new(Vec::new(), Mode::Default, std::env::temp_dir());
        Run::new(config, policy, Vec::new())
    }

    fn tool_start(index: u32, id: &str, name: &str) -> ModelEvent {
        ModelEvent::ToolCallStart {
            index,
            id: id.into(),
            name: name.into(),
        }
    }

    fn input(index: u32, json: &str) -> ModelEvent {
        ModelEvent::ToolCallInputDelta {
            index,
            partial_json: json.into(),
        }
    }

    fn emitted(effects: &[Effect]) -> Vec<&TurnEvent> {
        effects
            .iter()
            .filter_map(|e| match e {
                Effect::Emit(ev) => Some(ev),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn images_are_dropped_once_and_only_before_output() {
        let mut r = run();
        let now = Instant::now();
        let png = ContentBlock::image("image/png", "iVBORw0KGgo=").unwrap();
        r.send_user(vec![ContentBlock::text("look"), png], now);
        assert!(r.drop_images());
        assert_eq!(
            r.model_request().messages[0].content[1],
            ContentBlock::text(
                "[an image (image/png) was left out: the model server does not take images]"
            )
        );
        // Nothing left to leave out: a server that still refuses fails the run as before.
        assert!(!r.drop_images());
        let mut shown = run();
        let png = ContentBlock::image("image/png", "iVBORw0KGgo=").unwrap();
        shown.send_user(vec![png], now);
        shown.on_model_event(
            ModelEvent::TextDelta {
                index: 0,
                text: "seen".into(),
            },
            now,
        );
        assert!(
            !shown.drop_images(),
            "a turn that showed output is not sent again"
        );
    }

    #[test]
    fn turn_start_waits_for_content_so_retries_are_invisible() {
        let mut r = run();
        let now = Instant::now();
        assert_eq!(
            r.send_user(vec![ContentBlock::text("hi")], now),
            vec![Effect::RequestModel]
        );
        let start = ModelEvent::Start {
            message_id: "msg_1".into(),
            model: "m".into(),
        };
        assert!(r.on_model_event(start, now).is_empty());
        assert!(r.can_retry_turn());
        let out = r.on_model_event(
            ModelEvent::TextDelta {
                index: 0,
                text: "hello".into(),
            },
            now,
        );
        let events = emitted(&out);
        assert!(
            matches!(events[0], TurnEvent::TurnStart { message_id, .. } if message_id == "msg_1")
        );
        assert!(matches!(events[1], TurnEvent::AssistantTextDelta { .. }));
        assert!(!r.can_retry_turn());
        let out = r.on_model_complete(now);
        let last = out.last().expect("effects");
        assert_eq!(last, &Effect::Finished(StopCondition::EndOfTurn));
        assert!(matches!(
            emitted(&out).last(),
            Some(TurnEvent::RunEnd { .. })
        ));
    }

    #[test]
    fn repeated_tool_ids_are_refused_not_hung() {
        let mut r = run();
        let now = Instant::now();
        r.send_user(vec![ContentBlock::text("go")], now);
        for (i, path) in [(1, "a"), (2, "b")] {
            r.on_model_event(tool_start(i, "t1", "Read"), now);
            r.on_model_event(input(i, &format!("{{\"path\":\"{path}\"}}")), now);
        }
        let out = r.on_model_complete(now);
        let runs: Vec<_> = out
            .iter()
            .filter(|e| matches!(e, Effect::RunTool(_)))
            .collect();
        assert_eq!(runs.len(), 1, "only the first t1 runs: {out:?}");
        let ends: Vec<_> = emitted(&out)
            .into_iter()
            .filter(|e| matches!(e, TurnEvent::ToolCallEnd { is_error: true, .. }))
            .collect();
        assert_eq!(ends.len(), 1);
        let out = r.on_tool_done("t1", ToolOutput::ok("A"), now);
        assert!(
            out.contains(&Effect::RequestModel),
            "the turn closes: {out:?}"
        );
    }

    #[test]
    fn a_repeated_ids_refusals_come_before_the_end_of_the_call_that_counts() {
        let mut r = run();
        let now = Instant::now();
        r.send_user(vec![ContentBlock::text("go")], now);
        // The first t1 is decided at once (an unknown tool), and so are its two repeats.
        for (i, name) in [(1, "Nope"), (2, "Read"), (3, "Read")] {
            r.on_model_event(tool_start(i, "t1", name), now);
            r.on_model_event(input(i, "{\"path\":\"a\"}"), now);
        }
        let out = r.on_model_complete(now);
        let ends: Vec<&str> = emitted(&out)
            .into_iter()
            .filter_map(|e| match e {
                TurnEvent::ToolCallEnd { result_text, .. } => Some(result_text.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(ends.len(), 3, "{out:?}");
        assert!(
            ends[0].starts_with("duplicate tool_use id `t1`"),
            "{ends:?}"
        );
        assert!(
            ends[1].starts_with("duplicate tool_use id `t1`"),
            "{ends:?}"
        );
        assert!(ends[2].starts_with("unknown tool 'Nope'"), "{ends:?}");
    }

    #[test]
    fn oversized_tool_input_is_never_spliced() {
        let mut r = run();
        let now = Instant::now();
        r.send_user(vec![ContentBlock::text("go")], now);
        r.on_model_event(tool_start(1, "w", "Write"), now);
        let head = format!(
            "{{\"path\":\"x\",\"content\":\"{}",
            "A".repeat(crate::agent::tool_input::MAX_TOOL_INPUT_BYTES - 40)
        );
        r.on_model_event(input(1, &head), now);
        r.on_model_event(input(1, &"B".repeat(100)), now);
        r.on_model_event(input(1, "C\"}"), now);
        let out = r.on_model_complete(now);
        assert!(
            !out.iter().any(|e| matches!(e, Effect::RunTool(_))),
            "{:?}",
            out.len()
        );
        let refused = emitted(&out).into_iter().any(|e| {
            matches!(e, TurnEvent::ToolCallEnd { is_error: true, result_text, .. } if result_text.contains("exceeds"))
        });
        assert!(refused);
    }

    #[test]
    fn file_changes_run_one_at_a_time_in_call_order() {
        let mut r = run();
        let now = Instant::now();
        r.policy_mut().with_session_rule(
            Rule::new("Edit", Action::Allow, None, RuleSource::Session).expect("rule"),
        );
        r.send_user(vec![ContentBlock::text("go")], now);
        for (i, id) in [(1, "e1"), (2, "e2"), (3, "r3")] {
            let name = if id.starts_with('e') { "Edit" } else { "Read" };
            r.on_model_event(tool_start(i, id, name), now);
            r.on_model_event(
                input(i, r#"{"path":"a.txt","old_string":"x","new_string":"y"}"#),
                now,
            );
        }
        let started = |effects: &[Effect]| -> Vec<String> {
            effects
                .iter()
                .filter_map(|e| match e {
                    Effect::RunTool(c) => Some(c.id.clone()),
                    _ => None,
                })
                .collect()
        };
        let out = r.on_model_complete(now);
        assert_eq!(started(&out), ["e1", "r3"], "the second edit waits");
        let out = r.on_tool_done("r3", ToolOutput::ok("read"), now);
        assert!(started(&out).is_empty());
        let out = r.on_tool_done("e1", ToolOutput::ok("edited"), now);
        assert_eq!(started(&out), ["e2"]);
        let out = r.on_tool_done("e2", ToolOutput::ok("edited"), now);
        assert!(out.contains(&Effect::RequestModel));
    }

    #[test]
    fn invalid_tool_json_becomes_an_error_result() {
        let mut r = run();
        let now = Instant::now();
        r.send_user(vec![ContentBlock::text("go")], now);
        r.on_model_event(tool_start(1, "t", "Read"), now);
        r.on_model_event(input(1, "{\"path\": \"unterminated"), now);
        let out = r.on_model_complete(now);
        assert!(!out.iter().any(|e| matches!(e, Effect::RunTool(_))));
        assert!(
            out.contains(&Effect::RequestModel),
            "the model is told and asked again"
        );
    }

    fn text(index: u32, text: &str) -> ModelEvent {
        ModelEvent::TextDelta {
            index,
            text: text.into(),
        }
    }

    fn usage(input_tokens: u64) -> ModelEvent {
        ModelEvent::Usage(Usage {
            input_tokens,
            output_tokens: 10,
            ..Usage::default()
        })
    }

    #[test]
    fn a_turns_results_share_one_image_budget_and_carry_their_images() {
        let mut r = run();
        let now = Instant::now();
        r.send_user(vec![ContentBlock::text("go")], now);
        r.on_model_event(tool_start(1, "t1", "Read"), now);
        r.on_model_event(input(1, r#"{"path":"a.png"}"#), now);
        r.on_model_event(tool_start(2, "t2", "Read"), now);
        r.on_model_event(input(2, r#"{"path":"b.png"}"#), now);
        r.on_model_complete(now);
        let shots = |n: usize| {
            let mut out = ToolOutput::ok("");
            for _ in 0..n {
                out.add_image("i", "image/png", "AAAA");
            }
            out
        };
        let out = r.on_tool_done("t1", shots(6), now);
        let TurnEvent::ToolCallEnd { content, .. } = emitted(&out)[0] else {
            panic!("{out:?}")
        };
        assert_eq!(content.len(), 6, "images only, no empty text");
        let out = r.on_tool_done("t2", shots(4), now);
        let events = emitted(&out);
        let TurnEvent::ToolCallEnd {
            content,
            result_text,
            ..
        } = events[0]
        else {
            panic!("{out:?}")
        };
        // Two of the four fit the turn's eight; the text says the others were left out.
        assert_eq!(content.len(), 3, "{content:?}");
        assert!(result_text.contains("this turn's tool results already carry 8 images"));
        let TurnEvent::TurnEnd { tool_results, .. } = events[1] else {
            panic!("{out:?}")
        };
        let images = |block: &ContentBlock| match block {
            ContentBlock::ToolResult { content, .. } => content
                .iter()
                .filter(|b| matches!(b, ContentBlock::Image { .. }))
                .count(),
            _ => 0,
        };
        let counts: Vec<usize> = tool_results[0].content.iter().map(images).collect();
        assert_eq!(counts, [6, 2]);
    }

    #[test]
    fn final_messages_keep_images_up_to_a_budget() {
        let big = "A".repeat(crate::model::types::MAX_IMAGE_BASE64);
        let image = ContentBlock::image("image/png", &big).unwrap();
        let result = |id: &str| ContentBlock::ToolResult {
            tool_use_id: id.into(),
            content: vec![ContentBlock::text("shot"), image.clone()],
            is_error: false,
        };
        let messages = [Message {
            role: Role::User,
            content: vec![result("a"), result("b"), result("c")],
        }];
        let out = final_messages(&messages);
        let kept: Vec<bool> = out[0]
            .content
            .iter()
            .map(|b| match b {
                ContentBlock::ToolResult { content, .. } => {
                    matches!(content[1], ContentBlock::Image { .. })
                }
                _ => false,
            })
            .collect();
        assert_eq!(kept, [true, true, false]);
        let ContentBlock::ToolResult { content, .. } = &out[0].content[2] else {
            panic!()
        };
        assert!(
            matches!(&content[1], ContentBlock::Text { text } if text.contains("left out of final_messages"))
        );
    }

    #[test]
    fn a_request_that_would_not_fit_is_compacted_first_and_the_turn_goes_on() {
        let mut r = run();
        r.config.context_window = Some(3000);
        r.config.max_tokens = 100;
        let now = Instant::now();
        r.send_user(vec![ContentBlock::text("go")], now);
        r.on_model_event(tool_start(1, "t1", "Read"), now);
        r.on_model_event(input(1, r#"{"path":"a"}"#), now);
        r.on_model_event(usage(500), now);
        let out = r.on_model_complete(now);
        assert!(
            out.iter().any(|e| matches!(e, Effect::RunTool(_))),
            "{out:?}"
        );
        // 500 + 10 reported, plus ~3000 tokens of result: past the limit of 2900.
        let out = r.on_tool_done("t1", ToolOutput::ok("x".repeat(12_000)), now);
        assert!(out.contains(&Effect::RequestModel), "{out:?}");
        let request = r.model_request();
        assert_eq!(request.system, compact::SYSTEM);
        assert!(
            request
                .messages
                .last()
                .unwrap()
                .text()
                .contains(compact::INSTRUCTION)
        );
        assert!(r.can_retry_turn());
        assert!(r.on_model_event(text(0, "the summary"), now).is_empty());
        let out = r.on_model_complete(now);
        let events = emitted(&out);
        let TurnEvent::Compaction {
            trigger,
            pre_tokens,
            post_tokens,
            messages_summarized,
            messages_kept,
            summary,
            ..
        } = events[0]
        else {
            panic!("{out:?}")
        };
        assert_eq!(*trigger, Trigger::Auto);
        assert!(pre_tokens > post_tokens, "{pre_tokens} > {post_tokens}");
        assert_eq!((*messages_summarized, *messages_kept), (3, 0));
        assert_eq!(summary, "the summary");
        assert_eq!(out.last(), Some(&Effect::RequestModel), "the turn goes on");
        let request = r.model_request();
        assert_ne!(request.system, compact::SYSTEM);
        assert_eq!(request.messages.len(), 1);
        assert!(request.messages[0].text().contains("the summary"));
        // It does not compact again before a turn completes, even if still too large.
        r.on_model_event(text(0, "done"), now);
        let out = r.on_model_complete(now);
        assert_eq!(
            out.last(),
            Some(&Effect::Finished(StopCondition::EndOfTurn))
        );
    }

    #[test]
    fn a_failed_or_empty_summary_ends_the_run() {
        for fail in [true, false] {
            let mut r = run();
            r.config.interactive = true;
            let now = Instant::now();
            r.send_user(vec![ContentBlock::text("go")], now);
            r.on_model_event(text(0, "hi"), now);
            assert_eq!(r.on_model_complete(now).last(), Some(&Effect::AwaitInput));
            assert_eq!(
                r.compact(),
                vec![
                    Effect::CompactionStarted(Trigger::Manual),
                    Effect::RequestModel
                ]
            );
            let out = if fail {
                r.on_model_failed(StopCondition::ProviderError("overloaded".into()))
            } else {
                r.on_model_complete(now)
            };
            let Some(Effect::Finished(StopCondition::CompactionFailed(why))) = out.last() else {
                panic!("{out:?}")
            };
            assert_eq!(why.contains("overloaded"), fail, "{why}");
        }
    }

    /// Before any usage is known, the estimate counts every tool offered: the configured
    /// ones (taken out of the config) and an MCP server's.
    #[test]
    fn the_estimate_counts_the_tools_offered() {
        let mut r = run();
        let bare = r.context_tokens();
        let specs: usize = table::specs()
            .iter()
            .map(|t| t.name.len() + t.description.len() + t.input_schema.to_string().len())
            .sum();
        assert_eq!(bare, compact::tokens_of_bytes(specs));
        r.set_extra_tools(vec![ToolSpec {
            name: "mcp__s__t".to_owned().into(),
            description: "x".repeat(4000).into(),
            input_schema: serde_json::json!({}),
        }]);
        assert!(r.context_tokens() > bare + 1000);
    }

    /// A networked agent's allowlist admits only the MCP tools it names: the others are
    /// not offered, and a call to one is refused as an unknown tool.
    #[test]
    fn an_allowlist_limits_the_mcp_tools_offered_and_called() {
        let mut r = run();
        r.config.mcp_allowlist = Some(vec!["mcp__s__a".to_owned()].into());
        let spec = |name: &str| ToolSpec {
            name: name.to_owned().into(),
            description: "".into(),
            input_schema: serde_json::json!({"type": "object"}),
        };
        r.set_extra_tools(vec![spec("mcp__s__a"), spec("mcp__s__b")]);
        let offered: Vec<String> = r
            .model_request()
            .tools
            .iter()
            .map(|t| t.name.to_string())
            .filter(|n| n.starts_with("mcp__"))
            .collect();
        assert_eq!(offered, ["mcp__s__a"]);
        let now = Instant::now();
        r.send_user(vec![ContentBlock::text("go")], now);
        r.on_model_event(tool_start(1, "t1", "mcp__s__b"), now);
        r.on_model_event(input(1, "{}"), now);
        let out = r.on_model_complete(now);
        assert!(
            !out.iter().any(|e| matches!(e, Effect::RunTool(_))),
            "{out:?}"
        );
        let refused = emitted(&out).into_iter().any(|e| {
            matches!(e, TurnEvent::ToolCallEnd { is_error: true, result_text, .. }
                if result_text.starts_with("unknown tool 'mcp__s__b'"))
        });
        assert!(refused, "{out:?}");
    }

    #[test]
    fn a_manual_compaction_waits_for_input_again() {
        let mut r = run();
        r.config.interactive = true;
        let now = Instant::now();
        // Nothing to compact yet: the run just waits on.
        assert_eq!(r.compact(), vec![Effect::AwaitInput]);
        r.send_user(vec![ContentBlock::text("go")], now);
        r.on_model_event(text(0, "hi"), now);
        r.on_model_complete(now);
        // An MCP server's tool the conversation may have called: the summary request
        // offers it too (Anthropic refuses tool calls of tools not defined).
        r.set_extra_tools(vec![ToolSpec {
            name: "mcp__s__t".to_owned().into(),
            description: "".into(),
            input_schema: serde_json::json!({"type": "object"}),
        }]);
        r.compact();
        let request = r.model_request();
        assert_eq!(request.system, compact::SYSTEM);
        assert!(request.tools.iter().any(|t| t.name == "mcp__s__t"));
        assert_eq!(request.tools.len(), table::specs().len() + 1);
        r.on_model_event(text(0, "S"), now);
        let out = r.on_model_complete(now);
        assert!(matches!(
            emitted(&out)[0],
            TurnEvent::Compaction {
                trigger: Trigger::Manual,
                ..
            }
        ));
        assert_eq!(out.last(), Some(&Effect::AwaitInput));
        r.send_user(vec![ContentBlock::text("next")], now);
        let roles: Vec<Role> = r.model_request().messages.iter().map(|m| m.role).collect();
        assert_eq!(
            roles,
            [Role::User, Role::Assistant, Role::User],
            "roles alternate"
        );
    }

    #[test]
    fn cancel_ends_with_run_end_once() {
        let mut r = run();
        let now = Instant::now();
        r.send_user(vec![ContentBlock::text("go")], now);
        let out = r.cancel();
        assert_eq!(out[0], Effect::AbortWork);
        assert_eq!(
            out.last(),
            Some(&Effect::Finished(StopCondition::Cancelled))
        );
        assert!(r.cancel().is_empty());
        assert!(r.on_model_complete(now).is_empty());
    }

    /// A run whose model called `Bash` once, allowed, the call started; and the effects.
    fn bash_started(mode: Mode, retry: bool) -> (Run, Instant) {
        let mut r = run();
        r.config.sandbox_retry = retry;
        r.policy_mut().set_mode(mode);
        r.policy_mut().set_sandbox(sandbox::Mode::WorkspaceWrite);
        r.policy_mut().with_session_rule(
            Rule::new("Bash", Action::Allow, None, RuleSource::Session).expect("rule"),
        );
        let now = Instant::now();
        r.send_user(vec![ContentBlock::text("go")], now);
        r.on_model_event(tool_start(1, "b", "Bash"), now);
        r.on_model_event(input(1, r#"{"command":"touch /etc/x"}"#), now);
        let out = r.on_model_complete(now);
        assert!(
            out.iter()
                .any(|e| matches!(e, Effect::RunTool(c) if c.id == "b"))
        );
        assert_eq!(r.sandbox_for("b"), sandbox::Mode::WorkspaceWrite);
        (r, now)
    }

    fn refused() -> ToolOutput {
        ToolOutput::error("touch: cannot touch '/etc/x': Permission denied")
    }

    #[test]
    fn a_sandbox_refusal_asks_to_run_the_call_outside_it_and_a_yes_runs_it_there() {
        let (mut r, now) = bash_started(Mode::Default, true);
        let out = r.on_tool_sandboxed("b", refused(), "write to /etc/x blocked", now);
        let [Effect::Ask(shown)] = out.as_slice() else {
            panic!("one prompt: {out:?}")
        };
        assert_eq!(shown.id, "b");
        assert_eq!(shown.input["command"], "touch /etc/x");
        assert_eq!(
            shown.input["sandbox"],
            "retry outside the sandbox (workspace-write): write to /etc/x blocked"
        );
        let out = r.on_permission("b", true, "", now);
        let [Effect::RunTool(call)] = out.as_slice() else {
            panic!("it runs again: {out:?}")
        };
        // The call itself is unchanged; only where it runs is.
        assert_eq!(call.input, json!({"command": "touch /etc/x"}));
        assert_eq!(r.sandbox_for("b"), sandbox::Mode::Off);
        // Outside the sandbox a failure is only a failure: no second prompt.
        let out = r.on_tool_sandboxed("b", ToolOutput::ok("done"), "x", now);
        assert!(out.contains(&Effect::RequestModel), "{out:?}");
    }

    #[test]
    fn a_no_ends_the_call_as_the_sandbox_left_it() {
        let (mut r, now) = bash_started(Mode::AcceptEdits, true);
        r.on_tool_sandboxed("b", refused(), "why", now);
        let out = r.on_permission("b", false, "the user said no", now);
        let ends: Vec<String> = emitted(&out)
            .into_iter()
            .filter_map(|e| match e {
                TurnEvent::ToolCallEnd { result_text, .. } => Some(result_text.clone()),
                _ => None,
            })
            .collect();
        assert_eq!(
            ends,
            [
                "touch: cannot touch '/etc/x': Permission denied\n[not run outside the sandbox: \
              the user said no]"
            ]
        );
        assert_eq!(r.sandbox_for("b"), sandbox::Mode::WorkspaceWrite);
    }

    #[test]
    fn no_prompt_to_leave_the_sandbox_without_someone_to_ask_or_in_modes_that_never_ask() {
        for (mode, retry) in [
            (Mode::Default, false),
            (Mode::DontAsk, true),
            (Mode::BypassPermissions, true),
        ] {
            let (mut r, now) = bash_started(mode, retry);
            let out = r.on_tool_sandboxed("b", refused(), "why", now);
            assert!(
                !out.iter().any(|e| matches!(e, Effect::Ask(_))),
                "{mode:?} {retry}: {out:?}"
            );
            assert!(out.contains(&Effect::RequestModel), "{mode:?}: {out:?}");
        }
    }
}
