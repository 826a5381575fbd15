//! The drive core: the table of runs every surface shares. It owns each run's lifecycle
//! status, its durable event log, its queued input and its permission prompts, and turns
//! surface requests (run, stream, status, input, permit, cancel, delete) into engine
//! actions. Surfaces translate protocols to these calls and hold no agent logic.
//!
//! It does no I/O on the loop beyond its session files: like `agent::Run`, it queues what
//! should happen as `CoreAction`s (`take_actions`) and the drive host (`surface::host`)
//! performs them, so the core can be tested without a reactor. Timers are named by
//! `CoreTimer` and never cancelled: one that fires for a prompt no longer surfaced is
//! ignored.
//!
//! LIFECYCLE (`DriveStatus`): `starting → running → (awaiting_input ⇄ running)* → done |
//! failed`. Architecture Invariant: an event is appended to the log before the engine
//! reports the next thing, and the status changes only after, so a client that sees a
//! terminal status can already read every event of the run.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Map, Value, json};

use crate::agent::event::{StopCondition, TurnEvent};
use crate::agent::run::{Run, RunConfig, ToolCall};
use crate::clock::now_ms;
use crate::drive::session::{EventLog, SessionStore};
use crate::engine::{AskReply, HostAction};
use crate::ids::RunId;
use crate::log;
use crate::model::types::{ContentBlock, Message};
use crate::permissions::{Mode, Policy, Rule};

/// How long a surfaced permission prompt waits for an answer before it is denied.
pub const DEFAULT_PERMISSION_TIMEOUT: Duration = Duration::from_secs(600);
/// Finished runs kept in memory (the most recently used); the others are read back from
/// their session files when asked for.
pub const MAX_FINISHED_IN_MEMORY: usize = 1000;
/// Input queued for a running interactive run (taken at its next turn boundary).
pub const MAX_QUEUED_INPUTS: usize = 16;
pub const MAX_QUEUED_INPUT_BYTES: usize = 4 * 1024 * 1024;
/// Runs streaming or running tools at once by default (`--max-working-runs`); more are
/// refused until one pauses or ends.
pub const MAX_WORKING_RUNS: usize = 64;
/// Open runs by default, idle interactive ones included (`--max-live-runs`; an idle run
/// costs a few KiB).
pub const MAX_LIVE_RUNS: usize = 4096;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DriveStatus {
    Starting,
    Running,
    AwaitingInput,
    Done,
    Failed(String),
}

impl DriveStatus {
    /// The status a run ends in: failed when the provider, the stream or a compaction
    /// failed it, done otherwise (a refusal or a turn cap is an answer, not a failure).
    pub fn ended(why: &StopCondition) -> DriveStatus {
        match why {
            StopCondition::ProviderError(e) => DriveStatus::Failed(e.clone()),
            StopCondition::CompactionFailed(e) => {
                DriveStatus::Failed(format!("compaction failed: {e}"))
            }
            StopCondition::StreamIdle(d) => DriveStatus::Failed(format!(
                "the model stream was idle for {} s",
                d.as_secs_f64()
            )),
            _ => DriveStatus::Done,
        }
    }

    pub fn to_json(&self) -> Value {
        match self {
            DriveStatus::Starting => json!({"state": "starting"}),
            DriveStatus::Running => json!({"state": "running"}),
            DriveStatus::AwaitingInput => json!({"state": "awaiting_input"}),
            DriveStatus::Done => json!({"state": "done"}),
            DriveStatus::Failed(error) => json!({"state": "failed", "error": error}),
        }
    }

    pub fn from_json(value: &Value) -> Option<DriveStatus> {
        Some(match value.get("state")?.as_str()? {
            "starting" => DriveStatus::Starting,
            "running" => DriveStatus::Running,
            "awaiting_input" => DriveStatus::AwaitingInput,
            "done" => DriveStatus::Done,
            "failed" => DriveStatus::Failed(
                value
                    .get("error")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned(),
            ),
            _ => return None,
        })
    }

    pub fn is_terminal(&self) -> bool {
        matches!(self, DriveStatus::Done | DriveStatus::Failed(_))
    }

    pub fn label(&self) -> &'static str {
        match self {
            DriveStatus::Starting => "starting",
            DriveStatus::Running => "running",
            DriveStatus::AwaitingInput => "awaiting_input",
            DriveStatus::Done => "done",
            DriveStatus::Failed(_) => "failed",
        }
    }
}

/// A surfaced or queued permission prompt.
#[derive(Clone, Debug, PartialEq)]
pub struct Prompt {
    pub tool_use_id: String,
    pub tool_name: String,
    pub input: Value,
}

impl Prompt {
    pub fn to_json(&self) -> Value {
        json!({"tool_use_id": self.tool_use_id, "tool_name": self.tool_name, "input": self.input})
    }
}

/// What the drive core refuses, with upstream's exact texts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DriveError {
    UnknownRun(String),
    /// `cannot send input: …`
    Input(String),
    /// A permit that does not match the surfaced prompt.
    Permit(String),
    BadRequest(String),
    Build(String),
    /// Too much in flight (live runs); retry later.
    Busy(String),
    /// Another caliban process owns the run's session file.
    Foreign(String),
}

impl std::fmt::Display for DriveError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DriveError::UnknownRun(id) => write!(f, "unknown run_id: {id}"),
            DriveError::Input(e) => write!(f, "cannot send input: {e}"),
            DriveError::Permit(e)
            | DriveError::BadRequest(e)
            | DriveError::Busy(e)
            | DriveError::Foreign(e) => f.write_str(e),
            DriveError::Build(e) => write!(f, "failed to build run: {e}"),
        }
    }
}

/// An image's share of the input queue.
fn image_size(block: &ContentBlock) -> usize {
    match block {
        ContentBlock::Image { data, .. } => data.len(),
        _ => 0,
    }
}

/// A user message's content: its text (unless empty, as an image may come alone), then
/// its images.
fn user_content(text: String, images: Vec<ContentBlock>) -> Vec<ContentBlock> {
    let mut content = Vec::with_capacity(images.len() + 1);
    if !text.is_empty() || images.is_empty() {
        content.push(ContentBlock::text(text));
    }
    content.extend(images);
    content
}

const NOT_INTERACTIVE: &str = "drive session is not interactive; it accepts no input";
const ENDED: &str = "drive session has ended; it accepts no further input";

/// Follow-up input for an interactive run (upstream `DriveInbound`).
#[derive(Clone, Debug, PartialEq)]
pub enum Inbound {
    /// A message: its text and images (`ContentBlock::Image`).
    UserMessage {
        text: String,
        images: Vec<ContentBlock>,
    },
    /// A message as blocks whose order is the sender's (print mode's stream-json lines): the
    /// model is sent them as they are, the session file records their text and images as it
    /// records a `UserMessage`.
    Blocks(Vec<ContentBlock>),
    EndInput,
    /// Compact the conversation now (not upstream's): the run summarises it and waits for
    /// input again.
    Compact,
}

impl Inbound {
    /// A message of text alone.
    pub fn text(text: String) -> Inbound {
        Inbound::UserMessage {
            text,
            images: Vec::new(),
        }
    }

    /// Bytes it adds to the input queue.
    fn size(&self) -> usize {
        match self {
            Inbound::UserMessage { text, images } => {
                text.len() + images.iter().map(image_size).sum::<usize>()
            }
            Inbound::Blocks(blocks) => blocks
                .iter()
                .map(|block| match block {
                    ContentBlock::Text { text } => text.len(),
                    _ => image_size(block),
                })
                .sum(),
            Inbound::EndInput | Inbound::Compact => 0,
        }
    }

    /// The input line a session file records.
    pub(crate) fn to_json(&self) -> Value {
        match self {
            Inbound::UserMessage { text, images } if images.is_empty() => {
                json!({"type": "user_message", "text": text})
            }
            Inbound::UserMessage { text, images } => json!({"type": "user_message", "text": text,
                "images": images.iter().map(ContentBlock::to_json).collect::<Vec<_>>()}),
            Inbound::Blocks(blocks) => {
                let (text, images) = text_and_images(blocks);
                Inbound::UserMessage { text, images }.to_json()
            }
            Inbound::EndInput => json!({"type": "end_input"}),
            Inbound::Compact => json!({"type": "compact"}),
        }
    }
}

/// A message's text (its text blocks joined, as `Message::text`) and its images: the shape a
/// drive client sends a message in, and a session file records it in.
pub fn text_and_images(content: &[ContentBlock]) -> (String, Vec<ContentBlock>) {
    let mut text = String::new();
    let mut images = Vec::new();
    for block in content {
        match block {
            ContentBlock::Text { text: part } => text.push_str(part),
            ContentBlock::Image { .. } => images.push(block.clone()),
            _ => {}
        }
    }
    (text, images)
}

/// A request to start a run. Optional fields may only narrow the server's configuration.
#[derive(Clone, Debug, Default)]
pub struct RunSpec {
    pub prompt: String,
    /// Images that come with the prompt (`ContentBlock::Image`).
    pub images: Vec<ContentBlock>,
    pub interactive: bool,
    pub cwd: Option<PathBuf>,
    pub model: Option<String>,
    pub permission_mode: Option<Mode>,
    pub rules: Vec<Rule>,
    /// A stricter sandbox for the run's commands; a wider one has no effect.
    pub sandbox: Option<crate::sandbox::Mode>,
    /// An earlier conversation this run continues: the model sees it all; the session
    /// header records only where it came from (`continues`), or the messages themselves
    /// when there is no earlier run to point at.
    pub history: Vec<Message>,
    /// The run whose conversation `history` is (so session files do not copy it again).
    pub continues: Option<RunId>,
    /// `history` is that run's conversation minus its last prompt (it was refused).
    pub continues_without_last_prompt: bool,
    /// Surface-specific fields for the session header (e.g. an ACP session id).
    pub extra_header: Map<String, Value>,
    /// Thinking effort for this run (ACP's `thought_level`); the server's otherwise.
    pub effort: Option<crate::model::types::Effort>,
    /// Start by compacting `history` instead of sending `prompt` (which is then empty):
    /// ACP's `/compact` in a session whose last run has ended.
    pub compact_first: bool,
    /// The MCP servers whose tools the run is offered: by default every configured one;
    /// a client may name a subset (`mcp_servers`), a surface add its own (ACP's session).
    pub mcp: crate::mcp_client::Selection,
    /// The run's output reaches its client another way (print mode's stdout), so a session
    /// file that cannot be written costs only resuming it: the run is warned about once and
    /// goes on unrecorded, where a driven run would be stopped.
    pub record_best_effort: bool,
    /// The first message as blocks in the sender's order (print mode's first stream-json
    /// line), sent to the model as they are, even empty: it was not asked for as a drive
    /// client's `prompt` is, so it is the model's to refuse. `prompt` and `images` are then
    /// its `text_and_images`, which the header records.
    pub message: Option<Vec<ContentBlock>>,
}

/// The server-wide template every run starts from.
#[derive(Clone)]
pub struct DriveConfig {
    pub run: RunConfig,
    pub policy: Policy,
    pub workspace: PathBuf,
    pub provider: &'static str,
    pub permission_timeout: Duration,
    /// Builds the system prompt for a run's workspace.
    pub system_prompt: Option<String>,
    /// Where each run's project instructions come from, read for its own workspace.
    pub instructions: crate::instructions::Sources,
    /// Runs streaming or running tools at once (`MAX_WORKING_RUNS` by default).
    pub max_working_runs: usize,
    /// Open runs, idle interactive ones included (`MAX_LIVE_RUNS` by default).
    pub max_live_runs: usize,
    /// Context windows by model, for a run that names its own model.
    pub context_windows: crate::settings::ContextWindows,
    /// Models a client may choose between, the configured one first.
    pub models: Vec<String>,
    /// The configured MCP servers' names: what a run's `mcp_servers` may name.
    pub mcp_names: Vec<String>,
}

struct RunRecord {
    id: RunId,
    interactive: bool,
    status: DriveStatus,
    log: EventLog,
    /// The engine has this run (false for runs loaded from disk and finished ones).
    live: bool,
    prompts: VecDeque<Prompt>,
    /// The prompt shown to clients, with the number of its deadline timer.
    surfaced: Option<(Prompt, u64)>,
    inputs: VecDeque<Inbound>,
    /// `end_input` was queued or delivered: no more input is accepted.
    ended: bool,
    /// Appending to the session file failed; the run is stopped and reported failed.
    write_error: Option<String>,
    /// What a failed append stops: the run, or only its recording.
    recording: Recording,
    /// The prompt that was still surfaced when the run ended.
    abandoned_prompt: Option<String>,
    created_ms: u64,
    prompt: String,
    /// When the run was last started, read back or asked for by id (`DriveCore::use_now`):
    /// the finished runs used least recently are the ones evicted.
    used: u64,
}

/// What a run's failed append stops (`RunSpec::record_best_effort`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Recording {
    /// The run: an event nobody can read back must not pass unseen.
    Required,
    /// Only the recording.
    BestEffort,
    /// The recording has stopped; the run goes on.
    Stopped,
}

/// One run as listed by `GET /runs`.
#[derive(Clone, Debug)]
pub struct RunSummary {
    pub run_id: RunId,
    pub status: DriveStatus,
    pub interactive: bool,
    pub created_ms: u64,
    pub events: u64,
    pub prompt: String,
}

/// A batch for a poll: events as `(cursor, TurnEvent JSON text)`.
pub struct PollView {
    pub events: Vec<(u64, crate::drive::session::EventText)>,
    pub next_cursor: u64,
    pub status: DriveStatus,
    pub permission_request: Option<Prompt>,
}

impl PollView {
    /// Upstream's poll body (MCP text block and HTTP JSON alike), written with sorted keys
    /// as upstream's `serde_json::Value` bodies are: `{"events":[{"event":…,"v":1}],
    /// "next_cursor","permission_request","status"}`. Events are stored as their JSON
    /// text and spliced in without re-parsing: serde can only embed raw text it has checked
    /// (`RawValue`), and checking every event of every poll took 7 times the instructions of
    /// writing the whole body this way (issue 22, bench/RESULTS.md).
    pub fn to_json_text(&self) -> String {
        let mut body = String::from("{\"events\":[");
        for (i, (_, raw)) in self.events.iter().enumerate() {
            if i > 0 {
                body.push(',');
            }
            body.push_str("{\"event\":");
            body.push_str(raw);
            body.push_str(",\"v\":1}");
        }
        let prompt = self
            .permission_request
            .as_ref()
            .map_or(Value::Null, Prompt::to_json);
        body.push_str(&format!(
            "],\"next_cursor\":{},\"permission_request\":{},\"status\":{}}}",
            self.next_cursor,
            prompt,
            self.status.to_json()
        ));
        body
    }
}

/// A deadline the core asked for; it comes back through `DriveCore::on_timer`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CoreTimer {
    /// The surfaced prompt numbered `seq` of `run` waited too long.
    Prompt { run: RunId, seq: u64 },
}

/// What the core wants done; the drive host performs these in order.
pub enum CoreAction {
    Engine(HostAction),
    Arm(Duration, CoreTimer),
}

pub struct DriveCore {
    store: SessionStore,
    config: DriveConfig,
    runs: BTreeMap<RunId, RunRecord>,
    /// Runs whose events, status or prompt changed since `take_changed`.
    changed: BTreeSet<RunId>,
    /// Runs finished in this round whose tails go at its end (`end_round`).
    closed_this_round: Vec<RunId>,
    events_total: u64,
    /// Runs to cancel at the next chance (their session file broke).
    pending_cancels: Vec<RunId>,
    loaded_existing: bool,
    actions: Vec<CoreAction>,
    /// Numbers surfaced prompts (their timers), so a late timer can tell it is stale.
    next_prompt_seq: u64,
    /// Orders uses of runs (`RunRecord::used`).
    next_use: u64,
}

/// The status of a run found unfinished in its file with no process writing it.
const INTERRUPTED: &str = "interrupted: the server stopped before the run ended";

/// The most runs one page of `DriveCore::list_page` holds.
pub const MAX_RUNS_PAGE: usize = 1000;

/// How many runs a conversation may span before older ones are no longer replayed.
const MAX_CONTINUATION_CHAIN: usize = 10_000;

/// Drops the last user prompt (a message with text, not tool results) and what follows it.
fn drop_last_prompt(messages: &mut Vec<Value>) {
    let is_prompt = |m: &Value| {
        m["role"] == "user"
            && m["content"]
                .as_array()
                .is_some_and(|c| c.iter().any(|b| b["type"] == "text"))
    };
    if let Some(at) = messages.iter().rposition(is_prompt) {
        messages.truncate(at);
    }
}

impl DriveCore {
    pub fn new(mut store: SessionStore, config: DriveConfig) -> DriveCore {
        store.expect_working_runs(config.max_working_runs);
        DriveCore {
            store,
            config,
            runs: BTreeMap::new(),
            changed: BTreeSet::new(),
            closed_this_round: Vec::new(),
            events_total: 0,
            pending_cancels: Vec::new(),
            loaded_existing: false,
            actions: Vec::new(),
            next_prompt_seq: 0,
            next_use: 0,
        }
    }

    /// What the core's calls since the last take want done, oldest first.
    pub fn take_actions(&mut self) -> Vec<CoreAction> {
        std::mem::take(&mut self.actions)
    }

    fn act(&mut self, action: HostAction) {
        self.actions.push(CoreAction::Engine(action));
    }

    /// The run a client names, read back from its session file if it is not in memory
    /// (evicted, or from before a restart). The one place a run id string is parsed.
    ///
    /// A run asked for is in use: it is the last finished run to be evicted, so a client
    /// replaying an old run does not lose it to the next run started, and reading old runs
    /// one by one never grows the table past `MAX_FINISHED_IN_MEMORY`.
    pub fn resolve(&mut self, id: &str) -> Result<RunId, DriveError> {
        match RunId::parse(id) {
            Some(run) if self.load_record(run) => {
                let used = self.use_now();
                if let Some(rec) = self.runs.get_mut(&run) {
                    rec.used = used;
                }
                self.evict_finished();
                Ok(run)
            }
            _ => Err(DriveError::UnknownRun(id.to_owned())),
        }
    }

    fn use_now(&mut self) -> u64 {
        self.next_use += 1;
        self.next_use
    }

    /// Lists runs from earlier server processes (the newest `MAX_FINISHED_IN_MEMORY`; older
    /// ones are loaded when asked for by id).
    pub fn load_existing(&mut self) {
        // Idempotent: a surface calls it when it first needs the past (listing sessions),
        // so start-up never pays for scanning a large sessions directory.
        if self.loaded_existing {
            return;
        }
        self.loaded_existing = true;
        // Only the newest runs are brought in (older ones are read from disk when asked for),
        // so only their files are read: start-up does not grow with the directory's history.
        let numbers = match self.store.run_numbers_below(None, MAX_FINISHED_IN_MEMORY) {
            Ok((numbers, _)) => numbers,
            Err(e) => {
                log::warn(&format!("cannot list earlier sessions: {e}"));
                return;
            }
        };
        for number in numbers {
            self.load_record(RunId(number));
        }
    }

    /// Brings a run from its session file into the table. Its engine is gone: a run that had
    /// not finished is marked failed ("interrupted") — unless another process still writes
    /// it, in which case it is shown as that process last recorded it.
    fn load_record(&mut self, run: RunId) -> bool {
        if self.runs.contains_key(&run) {
            return true;
        }
        let id = run.to_string();
        let mut log = match self.store.load(&id) {
            Ok(log) => log,
            Err(e) => {
                if e.kind() != std::io::ErrorKind::NotFound {
                    log::warn(&format!("skipping session {id}: {e}"));
                }
                return false;
            }
        };
        let header = log.header().clone();
        let mut status = log
            .last_status()
            .and_then(DriveStatus::from_json)
            .unwrap_or(DriveStatus::Starting);
        if !status.is_terminal() {
            let interrupted = DriveStatus::Failed(INTERRUPTED.into());
            match log.append_status(&interrupted.to_json()) {
                Ok(()) => status = interrupted,
                // Another caliban process owns the file: its run is not ours to end.
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => log::warn(&format!("cannot mark {id} interrupted: {e}")),
            }
        }
        // Hold no descriptor or tail for a run this process does not write.
        self.store.let_go(&mut log);
        let used = self.use_now();
        self.runs.insert(
            run,
            RunRecord {
                id: run,
                interactive: header["interactive"].as_bool().unwrap_or(false),
                status,
                log,
                live: false,
                prompts: VecDeque::new(),
                surfaced: None,
                inputs: VecDeque::new(),
                ended: true,
                write_error: None,
                recording: Recording::Required,
                abandoned_prompt: None,
                created_ms: header["created_ms"].as_u64().unwrap_or(0),
                prompt: header["prompt"].as_str().unwrap_or_default().to_owned(),
                used,
            },
        );
        true
    }

    pub fn config(&self) -> &DriveConfig {
        &self.config
    }

    // ---- operations for surfaces ---------------------------------------------------------

    pub fn start_run(&mut self, spec: RunSpec) -> Result<RunId, DriveError> {
        if spec.prompt.trim().is_empty()
            && spec.images.is_empty()
            && !spec.compact_first
            && spec.message.is_none()
        {
            return Err(DriveError::BadRequest("`prompt` must not be empty".into()));
        }
        let live = self.runs.values().filter(|r| r.live);
        let (mut n_live, mut n_working) = (0, 0);
        for rec in live {
            n_live += 1;
            if rec.status != DriveStatus::AwaitingInput {
                n_working += 1;
            }
        }
        let (max_working, max_live) = (self.config.max_working_runs, self.config.max_live_runs);
        if n_working >= max_working || n_live >= max_live {
            return Err(DriveError::Busy(format!(
                "too many runs in progress ({n_working} working, {n_live} open; at most {max_working} and {max_live}); cancel one or wait"
            )));
        }
        if let Some(names) = &spec.mcp.configured
            && let Some(unknown) = names.iter().find(|n| !self.config.mcp_names.contains(n))
        {
            return Err(DriveError::BadRequest(format!(
                "unknown MCP server `{unknown}` in mcp_servers: the configured ones are [{}]",
                self.config.mcp_names.join(", ")
            )));
        }
        let workspace = match &spec.cwd {
            None => self.config.workspace.clone(),
            Some(cwd) => {
                let joined = self.config.workspace.join(cwd);
                let canonical = joined
                    .canonicalize()
                    .map_err(|e| DriveError::BadRequest(format!("cwd {}: {e}", cwd.display())))?;
                // A run may work in a subdirectory, never outside what the server was given:
                // a wider workspace would widen what the tools can touch.
                if !canonical.starts_with(&self.config.workspace) || !canonical.is_dir() {
                    return Err(DriveError::BadRequest(format!(
                        "cwd {} is not a directory inside the server's workspace {}",
                        cwd.display(),
                        self.config.workspace.display()
                    )));
                }
                canonical
            }
        };
        let mut run_config = self.config.run.clone();
        run_config.interactive = spec.interactive;
        if let Some(model) = &spec.model {
            run_config.model = model.clone();
            run_config.context_window = self.config.context_windows.of(model);
        }
        if spec.effort.is_some() {
            run_config.effort = spec.effort;
        }
        let workspace_str = workspace.display().to_string();
        let base = self
            .config
            .system_prompt
            .clone()
            .unwrap_or_else(|| crate::agent::default_system_prompt(&workspace_str));
        let instructions = self.config.instructions.load(&workspace);
        run_config.system = instructions.system_prompt(&base);
        let mut policy = self.config.policy.clone();
        if !spec.rules.is_empty() || spec.permission_mode.is_some() {
            policy = policy.narrowed(spec.rules.clone(), spec.permission_mode);
        }
        // As with the permission mode, a wider sandbox than the server's has no effect.
        if let Some(sandbox) = spec.sandbox {
            policy.set_sandbox(policy.sandbox().narrowed(sandbox));
        }
        let policy = policy.with_cwd(&workspace);

        let mut header = spec.extra_header.clone();
        if let Some(previous) = &spec.continues {
            header.insert("continues".into(), json!(previous.to_string()));
            if spec.continues_without_last_prompt {
                header.insert("continues_without_last_prompt".into(), json!(true));
            }
        } else if !spec.history.is_empty() {
            header.insert(
                "history".into(),
                Value::Array(spec.history.iter().map(Message::to_json).collect()),
            );
        }
        let created_ms = now_ms();
        header.insert("created_ms".into(), json!(created_ms));
        header.insert("interactive".into(), json!(spec.interactive));
        header.insert("prompt".into(), json!(spec.prompt));
        if !spec.images.is_empty() {
            header.insert(
                "images".into(),
                Value::Array(spec.images.iter().map(ContentBlock::to_json).collect()),
            );
        }
        header.insert("cwd".into(), json!(workspace_str));
        header.insert("model".into(), json!(run_config.model));
        header.insert("provider".into(), json!(self.config.provider));
        header.insert("sandbox".into(), crate::sandbox::describe(policy.sandbox()));
        if !instructions.is_empty() {
            header.insert("instructions".into(), instructions.to_json());
        }
        let mut recording = if spec.record_best_effort {
            Recording::BestEffort
        } else {
            Recording::Required
        };
        // A run whose output reaches its client another way goes on unrecorded, as when an
        // append fails later: only resuming it is lost.
        let unrecorded_header = (recording == Recording::BestEffort).then(|| header.clone());
        let mut log = match (self.store.create(header), unrecorded_header) {
            (Ok(log), _) => log,
            (Err(e), Some(header)) => {
                log::warn(&format!(
                    "cannot write the session file ({e}); this run will not be resumable"
                ));
                recording = Recording::Stopped;
                self.store.unrecorded(header)
            }
            (Err(e), None) => {
                return Err(DriveError::Build(format!(
                    "cannot create the session file: {e}"
                )));
            }
        };
        let Some(id) = RunId::parse(log.run_id()) else {
            return Err(DriveError::Build(format!("bad run id {}", log.run_id())));
        };
        let status = DriveStatus::Running;
        // `starting` is recorded too, so a reader of the file sees the whole lifecycle.
        let _ = log.append_status(&DriveStatus::Starting.to_json());
        let _ = log.append_status(&status.to_json());
        let run = Run::new(run_config, policy, spec.history.clone());
        let used = self.use_now();
        self.act(HostAction::StartRun {
            id,
            run: Box::new(run),
            workspace,
            mcp: spec.mcp.clone(),
        });
        if spec.compact_first {
            self.act(HostAction::Compact(id));
        } else {
            let content = match &spec.message {
                Some(blocks) => blocks.clone(),
                None => user_content(spec.prompt.clone(), spec.images.clone()),
            };
            self.act(HostAction::SendInput(id, content));
        }
        self.runs.insert(
            id,
            RunRecord {
                id,
                interactive: spec.interactive,
                status,
                log,
                live: true,
                prompts: VecDeque::new(),
                surfaced: None,
                inputs: VecDeque::new(),
                ended: false,
                write_error: None,
                recording,
                abandoned_prompt: None,
                created_ms,
                prompt: spec.prompt,
                used,
            },
        );
        self.changed.insert(id);
        self.evict_finished();
        Ok(id)
    }

    fn record(&self, id: RunId) -> Result<&RunRecord, DriveError> {
        self.runs
            .get(&id)
            .ok_or_else(|| DriveError::UnknownRun(id.to_string()))
    }

    fn record_mut(&mut self, id: RunId) -> Result<&mut RunRecord, DriveError> {
        self.runs
            .get_mut(&id)
            .ok_or_else(|| DriveError::UnknownRun(id.to_string()))
    }

    #[cfg(test)]
    pub fn exists(&self, id: RunId) -> bool {
        self.runs.contains_key(&id)
    }

    pub fn poll(
        &self,
        id: RunId,
        cursor: u64,
        max_events: usize,
        max_bytes: usize,
    ) -> Result<PollView, DriveError> {
        let rec = self.record(id)?;
        let events = rec
            .log
            .read(cursor, max_events, max_bytes)
            .map_err(|e| DriveError::Build(format!("cannot read the session file: {e}")))?;
        // Upstream: a cursor past the end yields an empty batch and `next_cursor = len`.
        let start = cursor.min(rec.log.len());
        let next_cursor = events.last().map_or(start, |(c, _)| c + 1);
        if next_cursor < rec.log.len() {
            // A capped batch: report the status as of its end, never a terminal one, so a
            // client that stops at `done` cannot miss the events still to come.
            return Ok(PollView {
                events,
                next_cursor,
                status: self.status_at(id, next_cursor)?,
                permission_request: None,
            });
        }
        Ok(PollView {
            events,
            next_cursor,
            status: rec.status.clone(),
            permission_request: rec.surfaced.as_ref().map(|(p, _)| p.clone()),
        })
    }

    pub fn status(&self, id: RunId) -> Result<DriveStatus, DriveError> {
        Ok(self.record(id)?.status.clone())
    }

    /// The status as of `cursor` events (see `EventLog::status_at`); the current status when
    /// the file cannot tell.
    pub fn status_at(&self, id: RunId, cursor: u64) -> Result<DriveStatus, DriveError> {
        let rec = self.record(id)?;
        if cursor >= rec.log.len() {
            return Ok(rec.status.clone());
        }
        Ok(rec
            .log
            .status_at(cursor)
            .and_then(DriveStatus::from_json)
            .filter(|s| !s.is_terminal())
            .unwrap_or(DriveStatus::Running))
    }

    pub fn event_count(&self, id: RunId) -> Result<u64, DriveError> {
        Ok(self.record(id)?.log.len())
    }

    /// The session header of a run (prompt, cwd, model, surface fields).
    /// The project instruction files the run was started with (`[{path, bytes, truncated}]`),
    /// when it had any.
    pub fn instructions(&self, id: RunId) -> Option<Value> {
        let header = self.record(id).ok()?.log.header();
        header.get("instructions").cloned()
    }

    pub fn header(&self, id: RunId) -> Result<Value, DriveError> {
        Ok(self.record(id)?.log.header().clone())
    }

    /// The run's whole conversation as model messages, rebuilt from its session file and
    /// those of the runs it continues (`continues` in the header), oldest first.
    pub fn messages(&mut self, id: RunId) -> Result<Vec<Value>, DriveError> {
        let mut chain = vec![id];
        while chain.len() < MAX_CONTINUATION_CHAIN {
            let current = chain[chain.len() - 1];
            self.load_record(current);
            let header = self.record(current)?.log.header().clone();
            let previous = header.get("continues").and_then(Value::as_str);
            match previous.map(|p| (p, RunId::parse(p))) {
                Some((_, Some(previous))) if !chain.contains(&previous) => chain.push(previous),
                Some((text, None)) => return Err(DriveError::UnknownRun(text.to_owned())),
                _ => break,
            }
        }
        let mut messages: Vec<Value> = Vec::new();
        for run in chain.iter().rev() {
            // A run still working may hold staged events that its file does not have yet.
            self.flush_log(*run);
            let rec = self.record(*run)?;
            if rec.log.header().get("continues_without_last_prompt") == Some(&json!(true)) {
                drop_last_prompt(&mut messages);
            }
            rec.log
                .extend_messages(&mut messages)
                .map_err(|e| DriveError::Build(format!("cannot read the session file: {e}")))?;
        }
        Ok(messages)
    }

    /// Runs whose session header has `key` equal to `value`, oldest first.
    pub fn find_by_header(&self, key: &str, value: &Value) -> Vec<RunId> {
        self.runs
            .values()
            .filter(|rec| rec.log.header().get(key) == Some(value))
            .map(|rec| rec.id)
            .collect()
    }

    /// Whether the engine still runs this run (it can take input, prompts, cancel).
    pub fn is_live(&self, id: RunId) -> bool {
        self.record(id).is_ok_and(|rec| rec.live)
    }

    /// Changes a live run's permission mode, or adds a session rule that outranks the
    /// configured ones (an editor's "always allow"); a narrowing profile still applies.
    /// A live run's next requests use `model` (with its context window) and `effort`.
    pub fn reconfigure(
        &mut self,
        id: RunId,
        model: &str,
        effort: Option<crate::model::types::Effort>,
    ) {
        if self.is_live(id) {
            let context_window = self.config.context_windows.of(model);
            self.act(HostAction::Reconfigure {
                run: id,
                model: model.to_owned(),
                context_window,
                effort,
            });
        }
    }

    pub fn update_policy(
        &mut self,
        id: RunId,
        mode: Option<Mode>,
        rule: Option<Rule>,
    ) -> Result<(), DriveError> {
        if !self.record(id)?.live {
            return Err(DriveError::Input(ENDED.into()));
        }
        self.act(HostAction::UpdatePolicy {
            run: id,
            mode,
            rule: rule.map(Box::new),
        });
        Ok(())
    }

    /// Sets a live run's sandbox (an editor's choice for its session): within the server's,
    /// never wider.
    pub fn set_sandbox(
        &mut self,
        id: RunId,
        sandbox: crate::sandbox::Mode,
    ) -> Result<(), DriveError> {
        let server = self.config.policy.sandbox();
        if !sandbox.is_within(server) {
            return Err(DriveError::BadRequest(format!(
                "sandbox `{sandbox}` is wider than the server's `{server}`"
            )));
        }
        if !self.record(id)?.live {
            return Err(DriveError::Input(ENDED.into()));
        }
        self.act(HostAction::SetSandbox { run: id, sandbox });
        Ok(())
    }

    /// Live runs streaming or running tools (not waiting for input): work in progress.
    pub fn working(&self) -> usize {
        self.runs
            .values()
            .filter(|r| r.live && r.status != DriveStatus::AwaitingInput)
            .count()
    }

    /// Offers runs started from now on only the tools named in `names` (a networked
    /// agent's `tool_allowlist`): built-in tools by name, MCP tools by `mcp__server__tool`
    /// or `mcp__server__*` (none without such an entry); a call to any other is refused
    /// by the run as an unknown tool.
    pub fn retain_tools(&mut self, names: &[String]) {
        Arc::make_mut(&mut self.config.run.tools)
            .retain(|tool| names.iter().any(|n| *n == tool.name));
        let mcp: Vec<String> = names
            .iter()
            .filter(|n| crate::tools::mcp_name::is_allowlist_entry(n))
            .cloned()
            .collect();
        self.config.run.mcp_allowlist = Some(mcp.into());
    }

    pub fn surfaced_prompt(&self, id: RunId) -> Result<Option<Prompt>, DriveError> {
        Ok(self.record(id)?.surfaced.as_ref().map(|(p, _)| p.clone()))
    }

    /// The runs in memory (live ones, and the finished ones kept or read back).
    pub fn list(&self) -> Vec<RunSummary> {
        self.runs.values().map(Self::summary).collect()
    }

    /// One page of every run in the sessions directory, not just those in memory: the newest
    /// `limit` runs numbered below `below` (the newest of all without it), oldest first, and
    /// the number to pass as `below` for the page before, if older runs remain. Runs in the
    /// table are shown as the table has them; the others are read from their files for the
    /// page and let go again, so listing never grows the table. A file found unfinished that
    /// no process writes is shown `failed` (interrupted), as it will be once read back.
    pub fn list_page(
        &self,
        below: Option<u64>,
        limit: usize,
    ) -> Result<(Vec<RunSummary>, Option<u64>), DriveError> {
        let limit = limit.clamp(1, MAX_RUNS_PAGE);
        let (numbers, more) = self
            .store
            .run_numbers_below(below, limit)
            .map_err(|e| DriveError::Build(format!("cannot list the session files: {e}")))?;
        let next = if more { numbers.first().copied() } else { None };
        let mut page = Vec::with_capacity(numbers.len());
        for number in numbers {
            let run = RunId(number);
            if let Some(rec) = self.runs.get(&run) {
                page.push(Self::summary(rec));
                continue;
            }
            let id = run.to_string();
            let Ok(log) = self.store.load(&id) else {
                continue;
            };
            let header = log.header();
            let mut status = log
                .last_status()
                .and_then(DriveStatus::from_json)
                .unwrap_or(DriveStatus::Starting);
            if !status.is_terminal() && !self.store.written_elsewhere(&log) {
                status = DriveStatus::Failed(INTERRUPTED.into());
            }
            page.push(RunSummary {
                run_id: run,
                status,
                interactive: header["interactive"].as_bool().unwrap_or(false),
                created_ms: header["created_ms"].as_u64().unwrap_or(0),
                events: log.len(),
                prompt: header["prompt"].as_str().unwrap_or_default().to_owned(),
            });
        }
        Ok((page, next))
    }

    fn summary(rec: &RunRecord) -> RunSummary {
        RunSummary {
            run_id: rec.id,
            status: rec.status.clone(),
            interactive: rec.interactive,
            created_ms: rec.created_ms,
            events: rec.log.len(),
            prompt: rec.prompt.clone(),
        }
    }

    /// Counts by state label, and events appended by this process, for `/metrics`.
    pub fn counts(&self) -> (BTreeMap<&'static str, u64>, u64) {
        let mut by_state = BTreeMap::new();
        for label in ["starting", "running", "awaiting_input", "done", "failed"] {
            by_state.insert(label, 0);
        }
        for rec in self.runs.values() {
            *by_state.entry(rec.status.label()).or_insert(0) += 1;
        }
        (by_state, self.events_total)
    }

    pub fn send_input(&mut self, id: RunId, input: Inbound) -> Result<(), DriveError> {
        let rec = self.record_mut(id)?;
        if !rec.interactive {
            return Err(DriveError::Input(NOT_INTERACTIVE.into()));
        }
        if rec.status.is_terminal() || !rec.live || rec.ended {
            return Err(DriveError::Input(ENDED.into()));
        }
        let queued_bytes: usize = rec.inputs.iter().map(Inbound::size).sum();
        let size = input.size();
        if rec.inputs.len() >= MAX_QUEUED_INPUTS || queued_bytes + size > MAX_QUEUED_INPUT_BYTES {
            return Err(DriveError::Input(format!(
                "{MAX_QUEUED_INPUTS} inputs or {MAX_QUEUED_INPUT_BYTES} bytes are already queued; wait for the run to take them"
            )));
        }
        if input == Inbound::EndInput {
            rec.ended = true;
        }
        rec.inputs.push_back(input);
        if rec.status == DriveStatus::AwaitingInput {
            self.deliver_input(id);
        }
        Ok(())
    }

    fn deliver_input(&mut self, id: RunId) {
        let Some(rec) = self.runs.get_mut(&id) else {
            return;
        };
        let Some(input) = rec.inputs.pop_front() else {
            return;
        };
        // Logged when delivered, not when queued, so the file keeps conversation order.
        let _ = rec.log.append_input(&input.to_json());
        match input {
            Inbound::UserMessage { text, images } => {
                rec.status = DriveStatus::Running;
                let _ = rec.log.append_status(&rec.status.to_json());
                self.act(HostAction::SendInput(id, user_content(text, images)));
            }
            Inbound::Blocks(blocks) => {
                rec.status = DriveStatus::Running;
                let _ = rec.log.append_status(&rec.status.to_json());
                self.act(HostAction::SendInput(id, blocks));
            }
            Inbound::EndInput => self.act(HostAction::EndInput(id)),
            Inbound::Compact => {
                rec.status = DriveStatus::Running;
                let _ = rec.log.append_status(&rec.status.to_json());
                self.act(HostAction::Compact(id));
            }
        }
        self.changed.insert(id);
    }

    pub fn permit(
        &mut self,
        id: RunId,
        tool_use_id: &str,
        allow: bool,
        reason: Option<String>,
    ) -> Result<(), DriveError> {
        let rec = self.record_mut(id)?;
        let Some((prompt, _)) = &rec.surfaced else {
            // Upstream's texts: a prompt that was still pending when its run ended is "no
            // longer waited on"; anything else has no pending prompt.
            if rec.abandoned_prompt.as_deref() == Some(tool_use_id) {
                return Err(DriveError::Permit(
                    "run is no longer waiting on that prompt".into(),
                ));
            }
            return Err(DriveError::Permit(
                "no pending permission request for this run".into(),
            ));
        };
        if prompt.tool_use_id != tool_use_id {
            return Err(DriveError::Permit(format!(
                "no pending permission with tool_use_id {tool_use_id}; current prompt is {}",
                prompt.tool_use_id
            )));
        }
        let message = if allow {
            String::new()
        } else {
            reason
                .filter(|r| !r.trim().is_empty())
                .unwrap_or_else(|| "denied by client".to_owned())
        };
        self.answer_prompt(id, allow, message);
        Ok(())
    }

    /// Resolves the surfaced prompt and surfaces the next queued one, if any.
    fn answer_prompt(&mut self, id: RunId, allow: bool, message: String) {
        let Some(rec) = self.runs.get_mut(&id) else {
            return;
        };
        let Some((prompt, _)) = rec.surfaced.take() else {
            return;
        };
        let _ = rec.log.append_permission(None);
        self.act(HostAction::Permit {
            run: id,
            tool_use_id: prompt.tool_use_id,
            allow,
            message,
        });
        self.changed.insert(id);
        self.surface_next(id);
    }

    fn surface_next(&mut self, id: RunId) {
        let timeout = self.config.permission_timeout;
        let Some(rec) = self.runs.get_mut(&id) else {
            return;
        };
        if rec.surfaced.is_some() {
            return;
        }
        let Some(prompt) = rec.prompts.pop_front() else {
            return;
        };
        let seq = self.next_prompt_seq;
        self.next_prompt_seq += 1;
        let _ = rec.log.append_permission(Some(&prompt.to_json()));
        rec.surfaced = Some((prompt, seq));
        self.actions
            .push(CoreAction::Arm(timeout, CoreTimer::Prompt { run: id, seq }));
        self.changed.insert(id);
    }

    pub fn cancel(&mut self, id: RunId) -> Result<(), DriveError> {
        let rec = self.record(id)?;
        if rec.live && !rec.status.is_terminal() {
            self.act(HostAction::Cancel(id));
        }
        Ok(())
    }

    /// Cancels the run if it is live, forgets it and removes its session file.
    pub fn delete(&mut self, id: RunId) -> Result<(), DriveError> {
        let rec = self.record(id)?;
        if !rec.live {
            // Not ours to write: the file may belong to another caliban process.
            match self.store.delete(&id.to_string()) {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    return Err(DriveError::Foreign(e.to_string()));
                }
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    log::warn(&format!("cannot delete the session file of {id}: {e}"));
                }
                _ => {}
            }
            self.runs.remove(&id);
            self.changed.insert(id);
            return Ok(());
        }
        // Our own live run: drop its record (closing the file and its lock), stop it, and
        // remove the file. A prompt timer still armed finds no record and is ignored.
        self.runs.remove(&id);
        self.act(HostAction::Cancel(id));
        if let Err(e) = self.store.delete(&id.to_string())
            && e.kind() != std::io::ErrorKind::NotFound
        {
            log::warn(&format!("cannot delete the session file of {id}: {e}"));
        }
        self.changed.insert(id);
        Ok(())
    }

    /// Runs whose observable state changed since the last call (for live streams).
    pub fn take_changed(&mut self) -> BTreeSet<RunId> {
        std::mem::take(&mut self.changed)
    }

    fn evict_finished(&mut self) {
        let is_finished = |r: &RunRecord| !r.live && r.status.is_terminal();
        let count = self.runs.values().filter(|r| is_finished(r)).count();
        if count <= MAX_FINISHED_IN_MEMORY {
            return;
        }
        let mut finished: Vec<(u64, RunId)> = self
            .runs
            .values()
            .filter(|r| is_finished(r))
            .map(|r| (r.used, r.id))
            .collect();
        // Least recently used first; they stay on disk and are read back when asked for.
        finished.sort_unstable();
        for (_, id) in &finished[..count - MAX_FINISHED_IN_MEMORY] {
            self.runs.remove(id);
        }
    }

    // ---- engine callbacks ----------------------------------------------------------------

    /// Stages the event in the run's log; `after_batch` writes it with the rest of the
    /// round's (see `drive::session` STAGING).
    pub fn on_event(&mut self, run: RunId, event: &TurnEvent) {
        let Some(rec) = self.runs.get_mut(&run) else {
            return;
        };
        // A delta nests one level: only the others need `stage_event`'s depth check.
        let staged = if event.is_delta() {
            rec.log.stage_written(|out| event.write_json(out))
        } else {
            rec.log.stage_event(&event.to_json())
        };
        match staged {
            Ok(_) => self.events_total += 1,
            Err(e) => self.write_failed(run, &e, matches!(event, TurnEvent::RunEnd { .. })),
        }
        self.changed.insert(run);
    }

    /// Writes the events the run's log staged; a failure is the run's write error.
    fn flush_log(&mut self, run: RunId) {
        let Some(rec) = self.runs.get_mut(&run) else {
            return;
        };
        if let Err(e) = rec.log.flush() {
            self.write_failed(run, &e, false);
        }
    }

    /// An event that cannot be recorded is lost to every reader: stop the run rather than let
    /// it finish with a hole nobody can see (its end says why).
    fn write_failed(&mut self, run: RunId, e: &std::io::Error, at_run_end: bool) {
        let Some(rec) = self.runs.get_mut(&run) else {
            log::error(&format!("cannot append to {run}: {e}"));
            return;
        };
        match rec.recording {
            Recording::Required => {}
            Recording::BestEffort => {
                // Later appends fail quietly: the file keeps the readable prefix it has.
                rec.log.stop_appending();
                rec.recording = Recording::Stopped;
                log::warn(&format!(
                    "cannot write the session file of {run} ({e}); this run will not be resumable"
                ));
                return;
            }
            Recording::Stopped => return,
        }
        log::error(&format!("cannot append to {run}: {e}"));
        if rec.write_error.is_none() {
            rec.write_error = Some(format!("the session file could not be written: {e}"));
            if rec.live && !at_run_end {
                self.pending_cancels.push(run);
            }
        }
    }

    pub fn on_ask(&mut self, run: RunId, call: &ToolCall) -> AskReply {
        let Some(rec) = self.runs.get_mut(&run) else {
            return AskReply::Deny(format!(
                "permission denied for tool '{}': no drive client attached",
                call.name
            ));
        };
        rec.prompts.push_back(Prompt {
            tool_use_id: call.id.clone(),
            tool_name: call.name.clone(),
            input: call.input.clone(),
        });
        self.surface_next(run);
        AskReply::Pending
    }

    pub fn on_await_input(&mut self, run: RunId) {
        self.flush_log(run);
        let Some(rec) = self.runs.get_mut(&run) else {
            return;
        };
        rec.status = DriveStatus::AwaitingInput;
        let _ = rec.log.append_status(&rec.status.to_json());
        self.changed.insert(run);
        if !rec.inputs.is_empty() {
            self.deliver_input(run);
        } else {
            // An idle run holds no descriptor: a server may keep thousands of them.
            self.store.idle(&mut rec.log);
        }
    }

    pub fn on_finished(&mut self, run: RunId, why: &StopCondition) {
        let Some(rec) = self.runs.get_mut(&run) else {
            return;
        };
        rec.live = false;
        rec.prompts.clear();
        rec.inputs.clear();
        if let Some((prompt, _)) = rec.surfaced.take() {
            let _ = rec.log.append_permission(None);
            rec.abandoned_prompt = Some(prompt.tool_use_id);
        }
        let ended = |rec: &RunRecord| match &rec.write_error {
            Some(error) => DriveStatus::Failed(error.clone()),
            None => DriveStatus::ended(why),
        };
        // The run's last events and its terminal status go to the file in one write, events
        // first. If that fails neither is there, and the status says why.
        let status = ended(rec);
        if let Err(e) = rec.log.append_status(&status.to_json()) {
            self.write_failed(run, &e, true);
        }
        let Some(rec) = self.runs.get_mut(&run) else {
            return;
        };
        rec.status = ended(rec);
        if rec.status != status {
            let _ = rec.log.append_status(&rec.status.to_json());
        }
        // A finished run is served from its file: no descriptor, lock or tail stays open.
        // The sync runs on the store's syncer, off the loop; the tail goes once the run's
        // followers read its last events from it, at the end of the round (`end_round`).
        self.store.close(&mut rec.log);
        self.closed_this_round.push(run);
        self.changed.insert(run);
    }

    /// A deadline the core armed passed.
    pub fn on_timer(&mut self, timer: CoreTimer) {
        match timer {
            CoreTimer::Prompt { run, seq } => self.on_prompt_timeout(run, seq),
        }
    }

    /// Work the core deferred to a safe point; the drive host calls it after each batch.
    pub fn after_batch(&mut self) {
        // The round's events go to their files, one write per run, before any surface is
        // told what changed: a surface shows only what the log shows.
        let staged: Vec<RunId> = self
            .changed
            .iter()
            .copied()
            .filter(|run| self.runs.get(run).is_some_and(|r| r.log.has_staged()))
            .collect();
        for run in staged {
            self.flush_log(run);
        }
        for run in std::mem::take(&mut self.pending_cancels) {
            if self.runs.get(&run).is_some_and(|r| r.live) {
                self.act(HostAction::Cancel(run));
            }
        }
    }

    /// The round's fan-out is over: finished runs let go of their tails (see `on_finished`).
    pub fn end_round(&mut self) {
        for run in std::mem::take(&mut self.closed_this_round) {
            if let Some(rec) = self.runs.get_mut(&run).filter(|r| !r.live) {
                rec.log.release_tail();
            }
        }
    }

    /// A prompt deadline passed: deny, as upstream does after 10 minutes. A timer for a
    /// prompt already answered (another `seq`, or none surfaced) is stale and ignored.
    fn on_prompt_timeout(&mut self, run: RunId, seq: u64) {
        let secs = self.config.permission_timeout.as_secs_f64();
        let Some(rec) = self.runs.get(&run) else {
            return;
        };
        let Some((prompt, surfaced_seq)) = &rec.surfaced else {
            return;
        };
        if *surfaced_seq != seq {
            return;
        }
        let message = format!(
            "permission denied for tool '{}': drive client did not respond within {secs}s",
            prompt.tool_name
        );
        self.answer_prompt(run, false, message);
    }
}

#[cfg(test)]
mod tests {
    //! The core driven the way the engine drives it: engine callbacks in, `CoreAction`s
    //! out, over real session files in a fresh temp directory. No reactor, no binary.

    use std::fs;
    use std::path::Path;
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;
    use crate::model::types::Usage;

    /// A fresh directory under the system temp dir (with `sessions/` and a canonical
    /// `workspace/`), removed on drop.
    struct TempDir {
        root: PathBuf,
        workspace: PathBuf,
    }

    /// The poll body's bytes: events spliced as stored, the rest as upstream's sorted keys.
    #[test]
    fn poll_view_bytes() {
        let event = r#"{"content_block_index":0,"text":"h\u00e9 \"q\"","turn_index":0,"type":"AssistantTextDelta"}"#;
        let view = PollView {
            events: vec![(0, event.into()), (1, r#"{"type":"X"}"#.into())],
            next_cursor: 2,
            status: DriveStatus::Failed("disk \"full\"".into()),
            permission_request: None,
        };
        let body = view.to_json_text();
        assert_eq!(
            body,
            format!(
                r#"{{"events":[{{"event":{event},"v":1}},{{"event":{{"type":"X"}},"v":1}}],"next_cursor":2,"permission_request":null,"status":{{"error":"disk \"full\"","state":"failed"}}}}"#
            )
        );
        // The same JSON a `Value` of it writes (keys sorted there too), so nothing was
        // spliced out of order.
        let tree: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(tree.to_string(), body.replace(r"h\u00e9", "h\u{e9}"));
    }

    impl TempDir {
        fn new(name: &str) -> TempDir {
            static COUNTER: AtomicU32 = AtomicU32::new(0);
            let n = COUNTER.fetch_add(1, Ordering::Relaxed);
            let root = std::env::temp_dir().join(format!(
                "caliban-table-test-{}-{name}-{n}",
                std::process::id()
            ));
            let _ = fs::remove_dir_all(&root);
            fs::create_dir_all(root.join("workspace")).expect("create workspace");
            // The server canonicalises its workspace (main's `resolve_workspace`), and the
            // cwd check compares canonical paths, so the test's must be canonical too.
            let workspace = root.join("workspace").canonicalize().expect("canonical");
            TempDir { root, workspace }
        }

        fn sessions(&self) -> PathBuf {
            self.root.join("sessions")
        }

        /// A core over this directory, configured as `main` configures one.
        fn core(&self) -> DriveCore {
            let store = SessionStore::open(self.sessions()).expect("open store");
            let config = DriveConfig {
                run: RunConfig {
                    model: "test-model".into(),
                    max_tokens: 8192,
                    max_turns: 50,
                    system: String::new(),
                    tools: Arc::default(),
                    interactive: false,
                    context_window: None,
                    effort: None,
                    sandbox_retry: true,
                    mcp_allowlist: None,
                },
                context_windows: Default::default(),
                models: vec!["test-model".into()],
                policy: Policy::new(Vec::new(), Mode::Default, self.workspace.clone()),
                workspace: self.workspace.clone(),
                provider: "anthropic",
                permission_timeout: DEFAULT_PERMISSION_TIMEOUT,
                system_prompt: Some("test system prompt".into()),
                instructions: Default::default(),
                max_working_runs: MAX_WORKING_RUNS,
                max_live_runs: MAX_LIVE_RUNS,
                mcp_names: Vec::new(),
            };
            DriveCore::new(store, config)
        }

        /// A core with other run limits, as `--max-working-runs`/`--max-live-runs` set them.
        fn core_with_limits(&self, max_working_runs: usize, max_live_runs: usize) -> DriveCore {
            let mut core = self.core();
            core.config.max_working_runs = max_working_runs;
            core.config.max_live_runs = max_live_runs;
            core
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.root);
        }
    }

    /// The core's queued actions as short strings, oldest first; a `StartRun`'s workspace is
    /// shown relative to the server's (`.` for the workspace itself).
    fn actions(core: &mut DriveCore) -> Vec<String> {
        let workspace = core.config().workspace.clone();
        let text = |blocks: &[ContentBlock]| {
            blocks
                .iter()
                .map(|b| match b {
                    ContentBlock::Text { text } => text.clone(),
                    other => format!("{:?}", other.to_json()),
                })
                .collect::<Vec<_>>()
                .join("|")
        };
        core.take_actions()
            .iter()
            .map(|action| match action {
                CoreAction::Engine(HostAction::StartRun {
                    id, workspace: w, ..
                }) => {
                    let rel = w.strip_prefix(&workspace).expect("inside the workspace");
                    let rel = if rel == Path::new("") {
                        Path::new(".")
                    } else {
                        rel
                    };
                    format!("start {id} in {}", rel.display())
                }
                CoreAction::Engine(HostAction::SendInput(id, blocks)) => {
                    format!("input {id} {}", text(blocks))
                }
                CoreAction::Engine(HostAction::EndInput(id)) => format!("end_input {id}"),
                CoreAction::Engine(HostAction::Compact(id)) => format!("compact {id}"),
                CoreAction::Engine(HostAction::Reconfigure { run, model, .. }) => {
                    format!("reconfigure {run} {model}")
                }
                CoreAction::Engine(HostAction::Cancel(id)) => format!("cancel {id}"),
                CoreAction::Engine(HostAction::McpApproved(name)) => format!("mcp_approved {name}"),
                CoreAction::Engine(HostAction::Permit {
                    run,
                    tool_use_id,
                    allow,
                    message,
                }) => {
                    let verdict = if *allow { "allow" } else { "deny" };
                    format!("permit {run} {tool_use_id} {verdict}: {message}")
                }
                CoreAction::Engine(HostAction::UpdatePolicy { run, mode, rule }) => format!(
                    "update_policy {run} {:?} {}",
                    mode.map(Mode::as_str),
                    rule.is_some()
                ),
                CoreAction::Engine(HostAction::SetSandbox { run, sandbox }) => {
                    format!("sandbox {run} {sandbox}")
                }
                CoreAction::Engine(HostAction::ToolResult { run, .. }) => {
                    format!("tool_result {run}")
                }
                CoreAction::Engine(HostAction::Quit) => "quit".into(),
                CoreAction::Arm(after, CoreTimer::Prompt { run, seq }) => {
                    format!("arm {}s {run} #{seq}", after.as_secs())
                }
            })
            .collect()
    }

    fn spec(prompt: &str, interactive: bool) -> RunSpec {
        RunSpec {
            prompt: prompt.into(),
            interactive,
            ..RunSpec::default()
        }
    }

    /// Starts a run and drops the two actions that start it (checked in their own test).
    fn start(core: &mut DriveCore, prompt: &str, interactive: bool) -> RunId {
        let id = core
            .start_run(spec(prompt, interactive))
            .expect("start_run");
        assert_eq!(actions(core).len(), 2);
        id
    }

    fn delta(i: usize) -> TurnEvent {
        TurnEvent::AssistantTextDelta {
            turn_index: 0,
            content_block_index: 0,
            text: format!("d{i}"),
        }
    }

    fn run_end(why: StopCondition) -> TurnEvent {
        TurnEvent::RunEnd {
            final_messages: Vec::new(),
            total_usage: Usage::default(),
            turn_count: 1,
            stopped_for: why,
            turns_without_edit: 0,
            no_edit_nudge_emitted: false,
        }
    }

    fn call(id: &str, name: &str) -> ToolCall {
        ToolCall {
            id: id.into(),
            name: name.into(),
            input: json!({"command": format!("echo {id}")}),
        }
    }

    fn user(text: &str) -> Value {
        json!({"role": "user", "content": [{"type": "text", "text": text}]})
    }

    /// Every event of a run as its JSON text, read in one poll.
    fn all_events(core: &DriveCore, id: RunId) -> Vec<String> {
        let view = core.poll(id, 0, usize::MAX, usize::MAX).expect("poll");
        view.events.iter().map(|(_, e)| e.to_string()).collect()
    }

    /// `n` text deltas, then `RunEnd`, then the end: what a finished run's engine reports.
    fn finish_with_events(core: &mut DriveCore, id: RunId, n: usize) -> Vec<String> {
        let mut expected = Vec::new();
        for i in 0..n {
            core.on_event(id, &delta(i));
            expected.push(delta(i).to_json().to_string());
        }
        let end = run_end(StopCondition::EndOfTurn);
        core.on_event(id, &end);
        expected.push(end.to_json().to_string());
        core.on_finished(id, &StopCondition::EndOfTurn);
        expected
    }

    #[test]
    fn start_run_asks_the_engine_to_start_then_sends_the_prompt() {
        let tmp = TempDir::new("start");
        let mut core = tmp.core();
        let id = core.start_run(spec("hello", false)).unwrap();
        assert_eq!(id, RunId(1));
        assert_eq!(
            actions(&mut core),
            ["start run-1 in .", "input run-1 hello"]
        );
        assert_eq!(core.status(id), Ok(DriveStatus::Running));
        assert!(core.is_live(id));
        assert_eq!(core.take_changed(), BTreeSet::from([id]));
        let header = core.header(id).unwrap();
        assert_eq!(header["prompt"], "hello");
        assert_eq!(header["interactive"], false);
        assert_eq!(header["model"], "test-model");
        assert_eq!(header["cwd"], tmp.workspace.display().to_string());
        let listed = core.list();
        assert_eq!(listed.len(), 1);
        assert_eq!(
            (listed[0].run_id, &listed[0].prompt, listed[0].events),
            (id, &"hello".to_owned(), 0)
        );
        // The next run gets the next number.
        assert_eq!(core.start_run(spec("again", true)).unwrap(), RunId(2));
        assert_eq!(
            actions(&mut core),
            ["start run-2 in .", "input run-2 again"]
        );
    }

    #[test]
    fn a_run_may_narrow_the_sandbox_and_never_widen_it() {
        let t = TempDir::new("sandbox");
        let mut core = t.core();
        core.config.policy = core
            .config
            .policy
            .clone()
            .with_sandbox(crate::sandbox::Mode::WorkspaceWrite);
        let wider = RunSpec {
            sandbox: Some(crate::sandbox::Mode::Off),
            ..spec("p", false)
        };
        let id = core.start_run(wider).expect("a wider sandbox is ignored");
        let log = core.store.load(&id.to_string()).expect("the session file");
        assert_eq!(log.header()["sandbox"]["mode"], "workspace-write");
        let narrower = RunSpec {
            sandbox: Some(crate::sandbox::Mode::ReadOnly),
            ..spec("p", false)
        };
        let id = core
            .start_run(narrower)
            .expect("a narrower sandbox is fine");
        let log = core.store.load(&id.to_string()).expect("the session file");
        assert_eq!(log.header()["sandbox"]["mode"], "read-only");
        // A live run moves within the server's sandbox, back to it included.
        assert!(
            core.set_sandbox(id, crate::sandbox::Mode::WorkspaceWrite)
                .is_ok()
        );
        assert!(core.set_sandbox(id, crate::sandbox::Mode::Network).is_err());
    }

    #[test]
    fn start_run_refuses_an_empty_prompt_and_a_cwd_outside_the_workspace() {
        let tmp = TempDir::new("start-refused");
        let mut core = tmp.core();
        let ws = tmp.workspace.display().to_string();
        for prompt in ["", "  \n\t"] {
            assert_eq!(
                core.start_run(spec(prompt, false)).unwrap_err(),
                DriveError::BadRequest("`prompt` must not be empty".into())
            );
        }
        fs::create_dir(tmp.workspace.join("sub")).unwrap();
        fs::write(tmp.workspace.join("file"), b"x").unwrap();
        std::os::unix::fs::symlink(&tmp.root, tmp.workspace.join("escape")).unwrap();
        for cwd in ["..", "/", "escape", "sub/../..", "file"] {
            let refused = core.start_run(RunSpec {
                cwd: Some(cwd.into()),
                ..spec("p", false)
            });
            assert_eq!(
                refused.unwrap_err().to_string(),
                format!("cwd {cwd} is not a directory inside the server's workspace {ws}"),
                "{cwd}"
            );
        }
        let missing = core.start_run(RunSpec {
            cwd: Some("missing".into()),
            ..spec("p", false)
        });
        assert!(
            missing
                .unwrap_err()
                .to_string()
                .starts_with("cwd missing: No such file or directory")
        );
        // Nothing was started or written for the refused runs.
        assert!(actions(&mut core).is_empty());
        assert!(core.list().is_empty());
        assert!(core.take_changed().is_empty());

        let id = core
            .start_run(RunSpec {
                cwd: Some("sub".into()),
                ..spec("p", false)
            })
            .unwrap();
        assert_eq!(id, RunId(1));
        assert_eq!(actions(&mut core), ["start run-1 in sub", "input run-1 p"]);
        assert_eq!(
            core.header(id).unwrap()["cwd"],
            tmp.workspace.join("sub").display().to_string()
        );
    }

    /// Polls from `cursor` to the end `cap` events at a time, checking that no batch but the
    /// last reports a terminal status; returns the events and the last batch's status.
    fn poll_to_end(
        core: &DriveCore,
        id: RunId,
        mut cursor: u64,
        cap: usize,
    ) -> (Vec<String>, DriveStatus) {
        let len = core.event_count(id).unwrap();
        let mut events = Vec::new();
        loop {
            let view = core.poll(id, cursor, cap, usize::MAX).unwrap();
            assert!(view.events.len() <= cap);
            for (at, event) in &view.events {
                assert_eq!(*at, cursor);
                cursor += 1;
                events.push(event.to_string());
            }
            // A cursor past the end reads nothing and resumes from the end.
            assert_eq!(view.next_cursor, cursor.min(len));
            cursor = view.next_cursor;
            if cursor < len {
                assert!(
                    !view.status.is_terminal(),
                    "{id}: terminal status at cursor {} of {len}",
                    view.next_cursor
                );
                assert_eq!(view.permission_request, None);
                continue;
            }
            return (events, view.status);
        }
    }

    #[test]
    fn status_never_runs_ahead_of_events() {
        let tmp = TempDir::new("status-order");
        let mut core = tmp.core();
        let id = start(&mut core, "p", false);
        let mut expected = Vec::new();
        for i in 0..9 {
            core.on_event(id, &delta(i));
            expected.push(delta(i).to_json().to_string());
        }
        let end = run_end(StopCondition::EndOfTurn);
        core.on_event(id, &end);
        expected.push(end.to_json().to_string());
        let len = expected.len() as u64;
        // Staged until the round ends: nothing is shown that the file does not have.
        assert_eq!(core.event_count(id), Ok(0));
        core.after_batch();
        // `RunEnd` is recorded but the engine has not reported the end yet: still running.
        assert_eq!(
            poll_to_end(&core, id, 0, 3),
            (expected.clone(), DriveStatus::Running)
        );
        core.on_finished(id, &StopCondition::EndOfTurn);
        assert_eq!(core.status(id), Ok(DriveStatus::Done));
        // From every cursor (past the end too), in batches of every small size, the
        // terminal status comes only with the batch that holds the last event.
        for cursor in 0..=len + 1 {
            for cap in 1..=4 {
                let (events, status) = poll_to_end(&core, id, cursor, cap);
                assert_eq!(
                    events,
                    expected[(cursor.min(len) as usize)..],
                    "{cursor}/{cap}"
                );
                assert_eq!(status, DriveStatus::Done, "{cursor}/{cap}");
            }
        }
        for cursor in 0..len {
            assert_eq!(
                core.status_at(id, cursor),
                Ok(DriveStatus::Running),
                "{cursor}"
            );
        }
        assert_eq!(core.status_at(id, len), Ok(DriveStatus::Done));
        assert_eq!(core.status_at(id, len + 5), Ok(DriveStatus::Done));
        // A whole read gets everything and the terminal status at once.
        let view = core.poll(id, 0, usize::MAX, usize::MAX).unwrap();
        assert_eq!((view.events.len() as u64, view.next_cursor), (len, len));
        assert_eq!(view.status, DriveStatus::Done);
    }

    #[test]
    fn status_at_a_turn_boundary_is_the_status_the_run_had_there() {
        let tmp = TempDir::new("status-at");
        let mut core = tmp.core();
        let id = start(&mut core, "p", true);
        for i in 0..3 {
            core.on_event(id, &delta(i));
        }
        core.on_await_input(id);
        assert_eq!(core.status(id), Ok(DriveStatus::AwaitingInput));
        core.send_input(id, Inbound::text("more".into())).unwrap();
        assert_eq!(core.status(id), Ok(DriveStatus::Running));
        for i in 3..6 {
            core.on_event(id, &delta(i));
        }
        core.on_await_input(id);
        core.send_input(id, Inbound::EndInput).unwrap();
        assert_eq!(actions(&mut core), ["input run-1 more", "end_input run-1"]);
        assert_eq!(core.status(id), Ok(DriveStatus::AwaitingInput));
        core.on_event(id, &run_end(StopCondition::EndOfTurn));
        core.on_finished(id, &StopCondition::EndOfTurn);
        let at = |c| core.status_at(id, c).unwrap();
        // The input arrived at cursor 3 before any event followed, so from there on the run
        // was running again; it then waited at 6 until it ended after the seventh event.
        assert_eq!(
            [at(0), at(3), at(5), at(6), at(7)],
            [
                DriveStatus::Running,
                DriveStatus::Running,
                DriveStatus::Running,
                DriveStatus::AwaitingInput,
                DriveStatus::Done,
            ]
        );
        let view = core.poll(id, 4, 2, usize::MAX).unwrap();
        assert_eq!(
            (view.next_cursor, view.status),
            (6, DriveStatus::AwaitingInput)
        );
        let view = core.poll(id, 6, 2, usize::MAX).unwrap();
        assert_eq!((view.next_cursor, view.status), (7, DriveStatus::Done));
    }

    #[test]
    fn one_prompt_is_surfaced_at_a_time() {
        let tmp = TempDir::new("prompts");
        let mut core = tmp.core();
        let id = start(&mut core, "p", false);
        core.take_changed();
        assert!(matches!(
            core.on_ask(id, &call("t1", "Bash")),
            AskReply::Pending
        ));
        assert!(matches!(
            core.on_ask(id, &call("t2", "Write")),
            AskReply::Pending
        ));
        // Only the first is surfaced, with a deadline; the second waits its turn.
        assert_eq!(actions(&mut core), ["arm 600s run-1 #0"]);
        assert_eq!(core.take_changed(), BTreeSet::from([id]));
        let first = Prompt {
            tool_use_id: "t1".into(),
            tool_name: "Bash".into(),
            input: json!({"command": "echo t1"}),
        };
        assert_eq!(core.surfaced_prompt(id), Ok(Some(first.clone())));
        let view = core.poll(id, 0, 10, 1000).unwrap();
        assert_eq!(view.permission_request, Some(first));
        assert_eq!(view.status, DriveStatus::Running);
        assert_eq!(
            view.to_json_text(),
            r#"{"events":[],"next_cursor":0,"permission_request":{"input":{"command":"echo t1"},"tool_name":"Bash","tool_use_id":"t1"},"status":{"state":"running"}}"#
        );

        let wrong = core.permit(id, "t2", true, None).unwrap_err();
        assert_eq!(
            wrong.to_string(),
            "no pending permission with tool_use_id t2; current prompt is t1"
        );
        assert!(actions(&mut core).is_empty());
        assert_eq!(core.surfaced_prompt(id).unwrap().unwrap().tool_use_id, "t1");

        core.permit(id, "t1", true, Some("ignored when allowing".into()))
            .unwrap();
        assert_eq!(
            actions(&mut core),
            ["permit run-1 t1 allow: ", "arm 600s run-1 #1"]
        );
        assert_eq!(core.surfaced_prompt(id).unwrap().unwrap().tool_use_id, "t2");
        assert_eq!(core.take_changed(), BTreeSet::from([id]));

        // The first prompt's deadline is stale now: it must not deny the second.
        core.on_timer(CoreTimer::Prompt { run: id, seq: 0 });
        assert!(actions(&mut core).is_empty());
        assert_eq!(core.surfaced_prompt(id).unwrap().unwrap().tool_use_id, "t2");

        core.on_timer(CoreTimer::Prompt { run: id, seq: 1 });
        assert_eq!(
            actions(&mut core),
            [
                "permit run-1 t2 deny: permission denied for tool 'Write': drive client did not respond within 600s"
            ]
        );
        assert_eq!(core.surfaced_prompt(id), Ok(None));
        // Firing again (or late) does nothing more.
        core.on_timer(CoreTimer::Prompt { run: id, seq: 1 });
        assert!(actions(&mut core).is_empty());
        assert_eq!(
            core.permit(id, "t2", true, None).unwrap_err().to_string(),
            "no pending permission request for this run"
        );
        assert_eq!(core.poll(id, 0, 10, 1000).unwrap().permission_request, None);
    }

    #[test]
    fn a_denial_carries_the_clients_reason_or_a_default() {
        let tmp = TempDir::new("deny");
        let mut core = tmp.core();
        let id = start(&mut core, "p", false);
        for (i, reason) in [None, Some("  "), Some("not that file")]
            .into_iter()
            .enumerate()
        {
            let tool_use_id = format!("t{i}");
            core.on_ask(id, &call(&tool_use_id, "Edit"));
            assert_eq!(actions(&mut core), [format!("arm 600s run-1 #{i}")]);
            core.permit(id, &tool_use_id, false, reason.map(str::to_owned))
                .unwrap();
            let message = reason
                .filter(|r| !r.trim().is_empty())
                .unwrap_or("denied by client");
            assert_eq!(
                actions(&mut core),
                [format!("permit run-1 {tool_use_id} deny: {message}")]
            );
        }
    }

    #[test]
    fn a_prompt_still_surfaced_when_the_run_ends_is_abandoned() {
        let tmp = TempDir::new("abandoned");
        let mut core = tmp.core();
        let id = start(&mut core, "p", false);
        core.on_ask(id, &call("t1", "Bash"));
        core.on_ask(id, &call("t2", "Bash"));
        assert_eq!(actions(&mut core), ["arm 600s run-1 #0"]);
        core.on_event(id, &run_end(StopCondition::Cancelled));
        core.on_finished(id, &StopCondition::Cancelled);
        assert_eq!(core.status(id), Ok(DriveStatus::Done));
        assert_eq!(core.surfaced_prompt(id), Ok(None));
        let view = core.poll(id, 0, 10, usize::MAX).unwrap();
        assert_eq!(
            (view.permission_request, view.status),
            (None, DriveStatus::Done)
        );
        assert_eq!(
            core.permit(id, "t1", true, None).unwrap_err().to_string(),
            "run is no longer waiting on that prompt"
        );
        // The queued one was never shown, so it is no prompt of this run's at all.
        assert_eq!(
            core.permit(id, "t2", true, None).unwrap_err().to_string(),
            "no pending permission request for this run"
        );
        // Its deadline fires later and finds nothing to deny; nothing is sent to the engine.
        core.on_timer(CoreTimer::Prompt { run: id, seq: 0 });
        assert!(actions(&mut core).is_empty());
    }

    #[test]
    fn a_prompt_for_a_run_the_core_does_not_have_is_denied() {
        let tmp = TempDir::new("ask-unknown");
        let mut core = tmp.core();
        let AskReply::Deny(why) = core.on_ask(RunId(7), &call("t1", "Bash")) else {
            panic!("a prompt for an unknown run must be denied");
        };
        assert_eq!(
            why,
            "permission denied for tool 'Bash': no drive client attached"
        );
        assert!(actions(&mut core).is_empty());
    }

    #[test]
    fn queued_input_is_bounded_by_count_and_bytes() {
        let tmp = TempDir::new("input-bounds");
        let mut core = tmp.core();
        let full = format!(
            "cannot send input: {MAX_QUEUED_INPUTS} inputs or {MAX_QUEUED_INPUT_BYTES} bytes are already queued; wait for the run to take them"
        );
        let by_count = start(&mut core, "p", true);
        for i in 0..MAX_QUEUED_INPUTS {
            core.send_input(by_count, Inbound::text(format!("m{i}")))
                .unwrap();
        }
        for input in [Inbound::text("one more".into()), Inbound::EndInput] {
            let err = core.send_input(by_count, input).unwrap_err();
            assert_eq!(err.to_string(), full);
        }

        let by_bytes = start(&mut core, "p", true);
        let big = "x".repeat(MAX_QUEUED_INPUT_BYTES - 10);
        core.send_input(by_bytes, Inbound::text(big)).unwrap();
        let err = core
            .send_input(by_bytes, Inbound::text("x".repeat(11)))
            .unwrap_err();
        assert_eq!(err.to_string(), full);
        core.send_input(by_bytes, Inbound::text("x".repeat(10)))
            .unwrap();
        // Nothing reached the engine while the runs were working.
        assert!(actions(&mut core).is_empty());
        // Taking one frees a slot.
        core.on_await_input(by_count);
        assert_eq!(actions(&mut core), ["input run-1 m0"]);
        core.send_input(by_count, Inbound::text("now it fits".into()))
            .unwrap();
    }

    #[test]
    fn a_non_interactive_run_refuses_input() {
        let tmp = TempDir::new("not-interactive");
        let mut core = tmp.core();
        let id = start(&mut core, "p", false);
        for input in [Inbound::text("hi".into()), Inbound::EndInput] {
            let err = core.send_input(id, input).unwrap_err();
            assert_eq!(
                err,
                DriveError::Input("drive session is not interactive; it accepts no input".into())
            );
            assert_eq!(
                err.to_string(),
                "cannot send input: drive session is not interactive; it accepts no input"
            );
        }
        finish_with_events(&mut core, id, 1);
        assert_eq!(
            core.send_input(id, Inbound::text("hi".into())),
            Err(DriveError::Input(NOT_INTERACTIVE.into()))
        );
        assert!(actions(&mut core).is_empty());
    }

    #[test]
    fn input_queued_while_running_is_delivered_in_order_at_turn_boundaries() {
        let tmp = TempDir::new("input-order");
        let mut core = tmp.core();
        let id = start(&mut core, "first", true);
        for text in ["a", "b"] {
            core.send_input(id, Inbound::text(text.into())).unwrap();
        }
        core.send_input(id, Inbound::EndInput).unwrap();
        let ended = "cannot send input: drive session has ended; it accepts no further input";
        let late = core.send_input(id, Inbound::text("c".into()));
        assert_eq!(late.unwrap_err().to_string(), ended);
        assert!(actions(&mut core).is_empty());
        // Not logged until delivered, so the conversation on disk is in the order the
        // model saw it.
        assert_eq!(core.messages(id).unwrap(), [user("first")]);

        core.on_event(id, &delta(0));
        core.on_await_input(id);
        assert_eq!(actions(&mut core), ["input run-1 a"]);
        assert_eq!(core.status(id), Ok(DriveStatus::Running));
        assert_eq!(core.messages(id).unwrap(), [user("first"), user("a")]);

        core.on_event(id, &delta(1));
        core.on_await_input(id);
        assert_eq!(actions(&mut core), ["input run-1 b"]);
        assert_eq!(
            core.messages(id).unwrap(),
            [user("first"), user("a"), user("b")]
        );

        core.on_await_input(id);
        assert_eq!(actions(&mut core), ["end_input run-1"]);
        assert_eq!(core.status(id), Ok(DriveStatus::AwaitingInput));
        core.on_event(id, &run_end(StopCondition::EndOfTurn));
        core.on_finished(id, &StopCondition::EndOfTurn);
        assert_eq!(core.status(id), Ok(DriveStatus::Done));
        let after = core.send_input(id, Inbound::text("d".into()));
        assert_eq!(after.unwrap_err().to_string(), ended);
        assert!(actions(&mut core).is_empty());
    }

    #[test]
    fn input_sent_while_the_run_waits_is_delivered_at_once() {
        let tmp = TempDir::new("input-now");
        let mut core = tmp.core();
        let id = start(&mut core, "p", true);
        core.on_await_input(id);
        assert!(actions(&mut core).is_empty());
        core.take_changed();
        core.send_input(id, Inbound::text("go".into())).unwrap();
        assert_eq!(actions(&mut core), ["input run-1 go"]);
        assert_eq!(core.status(id), Ok(DriveStatus::Running));
        assert_eq!(core.take_changed(), BTreeSet::from([id]));
        core.on_await_input(id);
        core.send_input(id, Inbound::EndInput).unwrap();
        assert_eq!(actions(&mut core), ["end_input run-1"]);
        assert_eq!(
            core.send_input(id, Inbound::EndInput),
            Err(DriveError::Input(ENDED.into()))
        );
    }

    /// Blocks reach the engine in the sender's order; the file records them as a client's
    /// message, their text and then their images.
    #[test]
    fn blocks_are_sent_in_order_and_recorded_as_text_and_images() {
        let tmp = TempDir::new("blocks");
        let mut core = tmp.core();
        let id = start(&mut core, "p", true);
        core.on_await_input(id);
        let image = ContentBlock::from_json(&json!({"type": "image", "source":
            {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}))
        .expect("an image block");
        let blocks = vec![
            ContentBlock::text("look ".to_owned()),
            image.clone(),
            ContentBlock::text("here".to_owned()),
        ];
        core.send_input(id, Inbound::Blocks(blocks)).unwrap();
        let image_text = format!("{:?}", image.to_json());
        assert_eq!(
            actions(&mut core),
            [format!("input run-1 look |{image_text}|here")]
        );
        let file = fs::read_to_string(tmp.sessions().join("run-1.jsonl")).unwrap();
        let inputs: Vec<Value> = file
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .filter(|v| v["kind"] == "input")
            .map(|v| v["input"].clone())
            .collect();
        assert_eq!(
            inputs,
            [json!({"type": "user_message", "text": "look here", "images": [image.to_json()]})]
        );
    }

    #[test]
    fn finished_runs_past_the_cap_are_evicted_and_read_back_from_disk() {
        let tmp = TempDir::new("evict");
        let mut core = tmp.core();
        let mut first_events = Vec::new();
        for i in 0..=MAX_FINISHED_IN_MEMORY {
            let id = start(&mut core, &format!("p{i}"), false);
            let expected = finish_with_events(&mut core, id, 1);
            if i == 0 {
                first_events = expected;
            }
        }
        let newest = start(&mut core, "newest", false);
        assert_eq!(newest, RunId(MAX_FINISHED_IN_MEMORY as u64 + 2));
        // The table holds the cap of finished runs plus the live one; run-1 was forgotten.
        let listed = core.list();
        assert_eq!(listed.len(), MAX_FINISHED_IN_MEMORY + 1);
        assert_eq!(listed[0].run_id, RunId(2));
        assert!(!core.exists(RunId(1)));
        let (by_state, _) = core.counts();
        assert_eq!(by_state["done"], MAX_FINISHED_IN_MEMORY as u64);
        assert_eq!(by_state["running"], 1);

        // Asked for by id, it comes back from its session file, whole and finished.
        assert_eq!(core.resolve("run-1"), Ok(RunId(1)));
        assert_eq!(all_events(&core, RunId(1)), first_events);
        let view = core.poll(RunId(1), 0, 1, usize::MAX).unwrap();
        assert_eq!((view.next_cursor, view.status), (1, DriveStatus::Running));
        let view = core.poll(RunId(1), 1, 1, usize::MAX).unwrap();
        assert_eq!((view.next_cursor, view.status), (2, DriveStatus::Done));
        assert_eq!(core.header(RunId(1)).unwrap()["prompt"], "p0");
        assert!(!core.is_live(RunId(1)));
        assert_eq!(
            core.permit(RunId(1), "t", true, None)
                .unwrap_err()
                .to_string(),
            "no pending permission request for this run"
        );
        assert!(actions(&mut core).is_empty());

        // Reading it back does not grow the table past the cap: the finished run used least
        // recently (run-2) makes room, so a client reading old runs one by one cannot make
        // the process grow without bound.
        assert_eq!(core.list().len(), MAX_FINISHED_IN_MEMORY + 1);
        assert!(!core.exists(RunId(2)));
        // Nor is a run just read the next one forgotten: a client replaying run-1 (an HTTP
        // stream holds its id) would lose the rest of it as soon as any run started. Asking
        // for run-3 by id counts as use too, so run-4 is the one to go.
        assert_eq!(core.resolve("run-3"), Ok(RunId(3)));
        finish_with_events(&mut core, newest, 0);
        start(&mut core, "after", false);
        assert_eq!(core.list().len(), MAX_FINISHED_IN_MEMORY + 1);
        assert!(!core.exists(RunId(4)));
        assert!(core.exists(RunId(1)) && core.exists(RunId(3)));
        assert_eq!(all_events(&core, RunId(1)), first_events);
    }

    #[test]
    fn a_fresh_core_lists_earlier_runs_and_fails_the_interrupted_ones() {
        let tmp = TempDir::new("restart");
        let interrupted =
            DriveStatus::Failed("interrupted: the server stopped before the run ended".into());
        let done_events;
        {
            let mut core = tmp.core();
            let done = start(&mut core, "finished", false);
            done_events = finish_with_events(&mut core, done, 2);
            let live = start(&mut core, "cut short", true);
            core.on_event(live, &delta(0));
            core.on_ask(live, &call("t1", "Bash"));
            assert_eq!(actions(&mut core), ["arm 600s run-2 #0"]);
            let failed = start(&mut core, "model failed", false);
            core.on_finished(failed, &StopCondition::ProviderError("overloaded".into()));
        }
        let mut core = tmp.core();
        // The past is loaded when first needed, not at start-up.
        assert!(core.list().is_empty());
        core.load_existing();
        let listed: Vec<(RunId, DriveStatus, u64, bool)> = core
            .list()
            .into_iter()
            .map(|s| (s.run_id, s.status, s.events, s.interactive))
            .collect();
        assert_eq!(
            listed,
            [
                (RunId(1), DriveStatus::Done, 3, false),
                (RunId(2), interrupted.clone(), 1, true),
                (RunId(3), DriveStatus::Failed("overloaded".into()), 0, false),
            ]
        );
        assert_eq!(all_events(&core, RunId(1)), done_events);
        let view = core.poll(RunId(2), 0, 10, usize::MAX).unwrap();
        assert_eq!((view.next_cursor, &view.status), (1, &interrupted));
        assert_eq!(view.permission_request, None);
        assert_eq!(core.status_at(RunId(2), 0), Ok(DriveStatus::Running));
        assert!(!core.is_live(RunId(2)));
        assert_eq!(
            core.send_input(RunId(2), Inbound::text("hi".into())),
            Err(DriveError::Input(ENDED.into()))
        );
        assert_eq!(core.cancel(RunId(2)), Ok(()));
        assert!(actions(&mut core).is_empty());
        // Run numbers are never reused.
        assert_eq!(core.start_run(spec("next", false)).unwrap(), RunId(4));
        drop(core);

        // The interruption was recorded once, in the file: a third core reads it back.
        let mut third = tmp.core();
        assert_eq!(third.resolve("run-2"), Ok(RunId(2)));
        assert_eq!(third.status(RunId(2)), Ok(interrupted));
    }

    #[test]
    fn a_run_another_core_still_writes_is_not_marked_interrupted() {
        let tmp = TempDir::new("foreign");
        let mut writer = tmp.core();
        let id = start(&mut writer, "p", false);
        writer.on_event(id, &delta(0));
        writer.after_batch();
        let mut reader = tmp.core();
        assert_eq!(reader.resolve("run-1"), Ok(id));
        assert_eq!(reader.status(id), Ok(DriveStatus::Running));
        assert_eq!(reader.event_count(id), Ok(1));
        assert_eq!(
            reader.delete(id).unwrap_err().to_string(),
            "run-1 is being written by another caliban process"
        );
        // The writer carries on undisturbed.
        let expected = finish_with_events(&mut writer, id, 0);
        assert_eq!(writer.status(id), Ok(DriveStatus::Done));
        assert_eq!(all_events(&writer, id)[1..], expected);
    }

    #[test]
    fn only_canonical_ids_of_known_runs_resolve() {
        let tmp = TempDir::new("resolve");
        let mut core = tmp.core();
        start(&mut core, "p", false);
        assert_eq!(core.resolve("run-1"), Ok(RunId(1)));
        for bad in [
            "run-01",
            "run-",
            "foo",
            "",
            "run-2",
            "RUN-1",
            " run-1",
            "run-1 ",
            "run-+1",
            "run-1.jsonl",
            "../run-1",
        ] {
            let err = core.resolve(bad).unwrap_err();
            assert_eq!(err, DriveError::UnknownRun(bad.into()));
            assert_eq!(err.to_string(), format!("unknown run_id: {bad}"));
        }
        assert_eq!(
            core.status(RunId(2)).unwrap_err().to_string(),
            "unknown run_id: run-2"
        );
        assert!(actions(&mut core).is_empty());
    }

    #[test]
    fn working_runs_are_capped_but_waiting_ones_do_not_count() {
        let tmp = TempDir::new("busy");
        let mut core = tmp.core();
        let ids: Vec<RunId> = (0..MAX_WORKING_RUNS)
            .map(|_| start(&mut core, "p", true))
            .collect();
        let busy = core.start_run(spec("one too many", false)).unwrap_err();
        assert_eq!(
            busy.to_string(),
            format!(
                "too many runs in progress ({MAX_WORKING_RUNS} working, {MAX_WORKING_RUNS} open; at most {MAX_WORKING_RUNS} and {MAX_LIVE_RUNS}); cancel one or wait"
            )
        );
        assert!(actions(&mut core).is_empty());
        core.on_await_input(ids[0]);
        let next = start(&mut core, "fits now", false);
        assert_eq!(next, RunId(MAX_WORKING_RUNS as u64 + 1));
    }

    #[test]
    fn configured_run_limits_are_honoured_above_and_below_the_defaults() {
        // Above the default working cap: 100 streaming runs fit, the 101st is refused.
        let tmp = TempDir::new("limits-working");
        let mut core = tmp.core_with_limits(100, 4096);
        let ids: Vec<RunId> = (0..100).map(|_| start(&mut core, "p", true)).collect();
        let busy = core.start_run(spec("one too many", false)).unwrap_err();
        assert_eq!(
            busy.to_string(),
            "too many runs in progress (100 working, 100 open; at most 100 and 4096); cancel one or wait"
        );
        core.on_await_input(ids[0]);
        assert_eq!(start(&mut core, "fits now", false), RunId(101));

        // The live cap counts waiting runs too, so pausing one makes no room under it.
        let tmp = TempDir::new("limits-live");
        let mut core = tmp.core_with_limits(10, 3);
        let ids: Vec<RunId> = (0..3).map(|_| start(&mut core, "p", true)).collect();
        core.on_await_input(ids[0]);
        let busy = core.start_run(spec("no room", false)).unwrap_err();
        assert_eq!(
            busy.to_string(),
            "too many runs in progress (2 working, 3 open; at most 10 and 3); cancel one or wait"
        );
    }

    #[test]
    fn cancel_and_delete_stop_only_live_runs() {
        let tmp = TempDir::new("cancel");
        let mut core = tmp.core();
        let live = start(&mut core, "p", false);
        let finished = start(&mut core, "p", false);
        finish_with_events(&mut core, finished, 1);
        core.cancel(live).unwrap();
        core.cancel(finished).unwrap();
        assert_eq!(actions(&mut core), ["cancel run-1"]);

        core.on_ask(live, &call("t1", "Bash"));
        assert_eq!(actions(&mut core), ["arm 600s run-1 #0"]);
        core.take_changed();
        core.delete(live).unwrap();
        assert_eq!(actions(&mut core), ["cancel run-1"]);
        assert_eq!(core.take_changed(), BTreeSet::from([live]));
        assert!(!tmp.sessions().join("run-1.jsonl").exists());
        assert_eq!(
            core.resolve("run-1").unwrap_err().to_string(),
            "unknown run_id: run-1"
        );
        // What the engine still reports about it, and its prompt's deadline, find nothing.
        core.on_event(live, &delta(0));
        core.on_await_input(live);
        core.on_timer(CoreTimer::Prompt { run: live, seq: 0 });
        core.on_finished(live, &StopCondition::Cancelled);
        assert!(actions(&mut core).is_empty());
        assert!(!core.exists(live));

        core.delete(finished).unwrap();
        assert!(actions(&mut core).is_empty());
        assert!(!tmp.sessions().join("run-2.jsonl").exists());
        assert!(core.list().is_empty());
        // A deleted run's number is not handed out again.
        assert_eq!(core.start_run(spec("p", false)).unwrap(), RunId(3));
    }

    #[test]
    fn policy_updates_go_only_to_live_runs() {
        let tmp = TempDir::new("policy");
        let mut core = tmp.core();
        let id = start(&mut core, "p", false);
        core.update_policy(id, Some(Mode::AcceptEdits), None)
            .unwrap();
        assert_eq!(
            actions(&mut core),
            ["update_policy run-1 Some(\"acceptEdits\") false"]
        );
        core.on_finished(id, &StopCondition::EndOfTurn);
        assert_eq!(
            core.update_policy(id, Some(Mode::Plan), None),
            Err(DriveError::Input(ENDED.into()))
        );
        assert!(actions(&mut core).is_empty());
    }

    #[test]
    fn a_failed_write_stops_a_driven_run_but_only_the_recording_of_a_best_effort_one() {
        let tmp = TempDir::new("best-effort");
        let mut core = tmp.core();
        let driven = start(&mut core, "driven", false);
        let printed = core
            .start_run(RunSpec {
                record_best_effort: true,
                ..spec("printed", false)
            })
            .expect("start_run");
        assert_eq!(actions(&mut core).len(), 2);
        for id in [driven, printed] {
            core.on_event(id, &delta(0));
            core.after_batch();
            // What a full disk does to the next write.
            core.runs
                .get_mut(&id)
                .expect("a record")
                .log
                .stop_appending();
            core.on_event(id, &delta(1));
            core.after_batch();
        }
        assert_eq!(actions(&mut core), [format!("cancel {driven}")]);
        for id in [driven, printed] {
            core.on_event(id, &run_end(StopCondition::EndOfTurn));
            core.on_finished(id, &StopCondition::EndOfTurn);
        }
        assert!(matches!(core.status(driven), Ok(DriveStatus::Failed(_))));
        assert_eq!(core.status(printed), Ok(DriveStatus::Done));
        // The file keeps what was written before the failure, and nothing after it.
        assert_eq!(core.event_count(printed), Ok(1));
        assert!(actions(&mut core).is_empty());
    }

    /// A session file that cannot be created refuses a driven run; a best-effort one starts
    /// unrecorded, under a run id of its own, and runs to its end.
    #[test]
    fn a_file_that_cannot_be_created_refuses_only_a_driven_run() {
        let tmp = TempDir::new("uncreated");
        let mut core = tmp.core();
        // A header the store refuses, as a full disk or a header past the line cap would be.
        let too_deep = (0..200).fold(json!(0), |inner, _| json!([inner]));
        let unwritable = |best_effort| RunSpec {
            record_best_effort: best_effort,
            extra_header: Map::from_iter([("deep".to_owned(), too_deep.clone())]),
            ..spec("hi", false)
        };
        assert!(matches!(
            core.start_run(unwritable(false)),
            Err(DriveError::Build(_))
        ));
        assert!(actions(&mut core).is_empty());
        let first = core.start_run(unwritable(true)).expect("an unrecorded run");
        let second = core.start_run(unwritable(true)).expect("another");
        assert_ne!(first, second);
        assert_eq!(
            actions(&mut core).len(),
            4,
            "each is started and sent its prompt"
        );
        assert_eq!(core.header(first).expect("a header")["prompt"], "hi");
        for id in [first, second] {
            core.on_event(id, &delta(0));
            core.after_batch();
            core.on_event(id, &run_end(StopCondition::EndOfTurn));
            core.on_finished(id, &StopCondition::EndOfTurn);
            assert_eq!(core.status(id), Ok(DriveStatus::Done));
            assert_eq!(core.event_count(id), Ok(0));
        }
        let files = fs::read_dir(tmp.sessions()).expect("the store");
        assert!(
            !files
                .flatten()
                .any(|f| f.path().extension().is_some_and(|e| e == "jsonl")),
            "no run file"
        );
    }

    #[test]
    fn a_rounds_events_are_on_disk_before_its_terminal_status_is_visible() {
        let tmp = TempDir::new("staged");
        let mut core = tmp.core();
        let a = start(&mut core, "a", false);
        let b = start(&mut core, "b", false);
        let path = |id: RunId| tmp.sessions().join(format!("{id}.jsonl"));
        let kinds = |id: RunId| -> Vec<String> {
            fs::read_to_string(path(id))
                .unwrap()
                .lines()
                .map(|l| {
                    let v: Value = serde_json::from_str(l).unwrap();
                    match v["kind"].as_str().unwrap() {
                        "event" => format!("event {}", v["cursor"]),
                        "status" => format!("status {}", v["status"]["state"].as_str().unwrap()),
                        other => other.to_owned(),
                    }
                })
                .collect()
        };
        // One round: both runs stream; nothing is on disk or shown until the round ends.
        for i in 0..3 {
            core.on_event(a, &delta(i));
            core.on_event(b, &delta(i));
        }
        assert_eq!(
            kinds(a).iter().filter(|k| k.starts_with("event")).count(),
            0
        );
        assert_eq!(core.poll(a, 0, 10, 1 << 20).unwrap().events.len(), 0);
        core.after_batch();
        for id in [a, b] {
            assert_eq!(core.event_count(id), Ok(3));
            assert_eq!(
                kinds(id).iter().filter(|k| k.starts_with("event")).count(),
                3
            );
        }
        // The next round ends run `a` without an `after_batch` in between: its events
        // still precede its terminal status in the file, and a poll that sees the status
        // sees every event.
        core.on_event(a, &delta(3));
        core.on_event(a, &run_end(StopCondition::EndOfTurn));
        core.on_finished(a, &StopCondition::EndOfTurn);
        let view = core.poll(a, 0, 100, 1 << 20).unwrap();
        assert_eq!(view.status, DriveStatus::Done);
        assert_eq!(view.events.len(), 5);
        let lines = kinds(a);
        assert_eq!(lines.last().map(String::as_str), Some("status done"));
        let events: Vec<&String> = lines.iter().filter(|k| k.starts_with("event")).collect();
        assert_eq!(events.len(), 5, "{lines:?}");
        assert_eq!(events.last().map(|k| k.as_str()), Some("event 4"));
        // Dropping the core (an orderly exit) writes what a working run staged.
        core.on_event(b, &delta(3));
        drop(core);
        assert_eq!(
            kinds(b).iter().filter(|k| k.starts_with("event")).count(),
            4
        );
    }

    #[test]
    fn take_changed_names_each_run_whose_state_changed_once() {
        let tmp = TempDir::new("changed");
        let mut core = tmp.core();
        let a = start(&mut core, "a", false);
        let b = start(&mut core, "b", true);
        assert_eq!(core.take_changed(), BTreeSet::from([a, b]));
        assert!(core.take_changed().is_empty());
        core.on_event(a, &delta(0));
        core.on_event(a, &delta(1));
        assert_eq!(core.take_changed(), BTreeSet::from([a]));
        core.on_await_input(b);
        assert_eq!(core.take_changed(), BTreeSet::from([b]));
        // Reads change nothing.
        core.poll(a, 0, 10, 1000).unwrap();
        core.status(b).unwrap();
        core.list();
        assert!(core.take_changed().is_empty());
        core.on_finished(a, &StopCondition::EndOfTurn);
        assert_eq!(core.take_changed(), BTreeSet::from([a]));
    }
}
