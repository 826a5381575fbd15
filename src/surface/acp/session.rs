//! The session registry: `Session` (a sequence of interactive runs tied together by the
//! `acp_session` field of their session headers) and the requests that open, list, close
//! and configure one: `session/new`, `session/load` (which replays the conversation),
//! `session/resume`, `session/list`, `session/close`, `session/delete`, `session/set_mode`
//! and `session/set_config_option` (the permission mode, the model, the thinking effort and
//! the sandbox of its commands), and the config options a session shows. A session's run
//! carries its model and effort into the next run it starts.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use super::call_ids::CallIds;
use super::commands::{EFFORTS, MODES, SANDBOXES, title_of};
use super::params::{ListSessions, NewSession, OpenSession, SetConfigOption, SetMode};
use super::permission::Asked;
use super::prompt::PromptState;
use super::tasks::Task;
use super::updates::Card;
use super::{AcpKey, AcpServe, SESSION_FIELD, convo, invalid_params, unknown_session};
use crate::drive::table::DriveCore;
use crate::ids::{HostKey, RunId};
use crate::jsonrpc::{INTERNAL_ERROR, INVALID_REQUEST, RpcError};
use crate::log;
use crate::model::types::Effort;
use crate::permissions::{Mode, Rule};
use crate::sandbox::Mode as SandboxMode;
use crate::surface::host::Cx;

pub(super) struct Session {
    pub(super) cwd: PathBuf,
    pub(super) mode: Mode,
    /// The sandbox of the session's commands: the server's, or a stricter one the editor
    /// chose (the `sandbox` config option).
    pub(super) sandbox: SandboxMode,
    /// Rules from "always" answers, given to every run the session starts.
    pub(super) rules: Vec<Rule>,
    /// The newest run (live or not): a new run continues its conversation.
    pub(super) run: Option<RunId>,
    /// The newest run ended on a refusal: its last prompt is not carried on. Not part of
    /// `prompt`: it is about the conversation the next run continues, set when a run ends
    /// and read when the next one starts, whatever became of the prompt in between.
    pub(super) drop_last_prompt: bool,
    /// Where the session's `session/prompt` is: none, waiting, running, being cancelled.
    pub(super) prompt: PromptState,
    /// Open tool-call cards, by their wire id (`ids`).
    pub(super) cards: HashMap<String, Card>,
    /// The session's tool-call ids on the wire, unique whatever ids the model repeats.
    pub(super) ids: CallIds,
    pub(super) asked: Option<Asked>,
    pub(super) tasks: HashMap<String, Task>,
    /// `_meta` from the run's `RunEnd`, for the prompt answer. Not part of `prompt`: it
    /// belongs to the run, comes with its last event and is taken when its end is reported
    /// (`on_finished`), whether or not a prompt waits for it.
    pub(super) run_end: Option<Value>,
    /// The session's MCP servers, on the engine's hub.
    pub(super) mcp: Vec<crate::mcp_client::ServerId>,
    /// Updates held for the session's next prompt (what became of a workspace server the
    /// editor was asked about between prompts): updates belong within a prompt or a load.
    pub(super) held: Vec<Value>,
    /// The model the session's runs use (the `model` config option).
    pub(super) model: String,
    /// What the session's turns used so far, for `usage_update`'s cost.
    pub(super) usage: crate::model::types::Usage,
    /// Thinking effort (the `thought_level` config option); `None` is off.
    pub(super) effort: Option<crate::model::types::Effort>,
    /// The `compactionId` of the compaction in progress, shown `in_progress` to a client
    /// that advertised `session.compaction`.
    pub(super) compacting: Option<String>,
}

impl Session {
    pub(super) fn new(
        cwd: PathBuf,
        mode: Mode,
        sandbox: SandboxMode,
        run: Option<RunId>,
        model: String,
    ) -> Session {
        Session {
            cwd,
            mode,
            sandbox,
            rules: Vec::new(),
            run,
            drop_last_prompt: false,
            prompt: PromptState::Idle,
            cards: HashMap::new(),
            ids: CallIds::default(),
            asked: None,
            tasks: HashMap::new(),
            run_end: None,
            mcp: Vec::new(),
            held: Vec::new(),
            model,
            usage: Default::default(),
            effort: None,
            compacting: None,
        }
    }
}

/// Milliseconds since the epoch as ISO 8601 UTC (`2026-08-01T12:00:00Z`).
fn iso8601(ms: u64) -> String {
    crate::clock::Utc::from_unix_secs(ms / 1000).iso8601()
}

fn modes_json(current: Mode) -> Value {
    json!({
        "currentModeId": current.as_str(),
        "availableModes": MODES.iter().map(|(mode, name, description)| json!({
            "id": mode.as_str(), "name": name, "description": description})).collect::<Vec<_>>(),
    })
}

/// The session's directory (known: the session was just opened).
fn cwd_of(sessions: &HashMap<String, Session>, id: &str) -> PathBuf {
    sessions
        .get(id)
        .map(|session| session.cwd.clone())
        .unwrap_or_default()
}

/// Names the project instruction files the session's runs get, under
/// `_meta["caliban/instructions"]` of a `session/new`, `session/load` or `session/resume`
/// answer (`[{path, bytes, truncated}]`), when there are any.
fn with_instructions(result: &mut Value, core: &DriveCore, cwd: &Path) {
    let loaded = core.config().instructions.load(cwd);
    if !loaded.is_empty() {
        result["_meta"] = json!({"caliban/instructions": loaded.to_json()});
    }
}

impl<H: HostKey> AcpServe<H> {
    /// The session's config options: the permission mode, the model (among the configured
    /// ones, `settings.models`) and the thinking effort. Always the complete list.
    pub(super) fn config_options(&self, ctx: &Cx<AcpKey<H>>, session: &Session) -> Value {
        let mut models = ctx.core.config().models.clone();
        if !models.contains(&session.model) {
            models.push(session.model.clone());
        }
        let effort = session.effort.map_or("off", Effort::as_str);
        let server = ctx.core.config().policy.sandbox();
        json!([
            {
                "id": "mode", "name": "Mode",
                "description": "What caliban may do without asking",
                "category": "mode", "type": "select", "currentValue": session.mode.as_str(),
                "options": MODES.iter().map(|(mode, name, description)| json!({
                    "value": mode.as_str(), "name": name, "description": description}))
                    .collect::<Vec<_>>(),
            },
            {
                "id": "model", "name": "Model", "description": "The model the agent uses",
                "category": "model", "type": "select", "currentValue": session.model,
                "options": models.iter().map(|m| json!({"value": m, "name": m}))
                    .collect::<Vec<_>>(),
            },
            {
                "id": "thought_level", "name": "Thinking",
                "description": "How much the model thinks before answering",
                "category": "thought_level", "type": "select", "currentValue": effort,
                "options": EFFORTS.iter().map(|(value, name)| json!({
                    "value": value, "name": name})).collect::<Vec<_>>(),
            },
            {
                // The server's sandbox or a stricter one: an editor may narrow it, never
                // widen it.
                "id": "sandbox", "name": "Sandbox",
                "description": "What commands may do once allowed to run",
                "type": "select", "currentValue": session.sandbox.as_str(),
                "options": SANDBOXES.iter().filter(|(mode, ..)| mode.is_within(server))
                    .map(|(mode, name, description)| json!({
                        "value": mode.as_str(), "name": name, "description": description}))
                    .collect::<Vec<_>>(),
            },
        ])
    }

    /// A session's directory: absolute, existing, inside the workspace caliban serves (its
    /// settings and permission rules are that workspace's).
    fn session_cwd(core: &DriveCore, raw: &str) -> Result<PathBuf, RpcError> {
        let path = Path::new(raw);
        if !path.is_absolute() {
            return Err(invalid_params(format!(
                "`cwd` must be an absolute path, not {raw}"
            )));
        }
        let canonical = path
            .canonicalize()
            .map_err(|e| invalid_params(format!("cwd {raw}: {e}")))?;
        let workspace = &core.config().workspace;
        if !canonical.is_dir() || !canonical.starts_with(workspace) {
            return Err(invalid_params(format!(
                "cwd {raw} is not a directory inside caliban's workspace {}; start `caliban acp \
                 serve` in the project (or pass -C {raw})",
                workspace.display()
            )));
        }
        Ok(canonical)
    }

    pub(super) fn new_session(
        &mut self,
        ctx: &mut Cx<AcpKey<H>>,
        params: NewSession,
    ) -> Result<Value, RpcError> {
        let cwd = Self::session_cwd(ctx.core, params.cwd)?;
        let id = crate::auth::new_uuid();
        let mode = ctx.core.config().policy.mode();
        let model = ctx.core.config().run.model.clone();
        let sandbox = ctx.core.config().policy.sandbox();
        let session = Session::new(cwd, mode, sandbox, None, model);
        let options = self.config_options(ctx, &session);
        self.sessions.insert(id.clone(), session);
        self.connect_servers(ctx, &id, params.mcp_servers);
        let mut result =
            json!({"sessionId": id, "modes": modes_json(mode), "configOptions": options});
        with_instructions(&mut result, ctx.core, &cwd_of(&self.sessions, &id));
        Ok(result)
    }

    /// `session/load` (with `replay`) and `session/resume`: a session of this process or of
    /// an earlier one, found by its runs' session headers.
    pub(super) fn open_session(
        &mut self,
        ctx: &mut Cx<AcpKey<H>>,
        params: OpenSession,
        replay: bool,
    ) -> Result<Value, RpcError> {
        let id = params.session_id.to_owned();
        let cwd = Self::session_cwd(ctx.core, params.cwd)?;
        let newest = match self.sessions.get(&id) {
            Some(session) if !session.prompt.is_idle() => {
                return Err(RpcError::new(
                    INVALID_REQUEST,
                    "the session is answering a prompt; cancel it first",
                ));
            }
            Some(session) => session.run,
            None => {
                ctx.core.load_existing();
                let runs = ctx.core.find_by_header(SESSION_FIELD, &json!(id));
                match runs.last() {
                    Some(run) => Some(*run),
                    None => return Err(unknown_session(&id)),
                }
            }
        };
        // The tool-call ids the editor has seen in this session (replayed now, or shown by
        // an earlier process before a resume), so no later card reuses one.
        let mut shown = CallIds::default();
        if let Some(run) = newest
            && (replay || !self.sessions.contains_key(&id))
        {
            match ctx.core.messages(run) {
                Ok(messages) => {
                    let updates = convo::replay(&messages, &cwd, &mut shown, self.compaction);
                    if replay {
                        for update in updates {
                            self.outbox.update(&id, update);
                        }
                    }
                }
                Err(e) if replay => return Err(RpcError::new(INTERNAL_ERROR, e.to_string())),
                Err(e) => log::warn(&format!("session {id}: cannot read its history: {e}")),
            }
        }
        let default_mode = ctx.core.config().policy.mode();
        let default_model = ctx.core.config().run.model.clone();
        let server_sandbox = ctx.core.config().policy.sandbox();
        let session = self.sessions.entry(id.clone()).or_insert_with(|| {
            Session::new(
                cwd.clone(),
                default_mode,
                server_sandbox,
                newest,
                default_model,
            )
        });
        session.cwd = cwd;
        session.ids.absorb(shown);
        if let Some(run) = newest
            && ctx.core.is_live(run)
        {
            self.runs.insert(run, id.clone());
        }
        let mode = session.mode;
        let options = match self.sessions.get(&id) {
            Some(session) => self.config_options(ctx, session),
            None => json!([]),
        };
        self.connect_servers(ctx, &id, params.mcp_servers);
        let mut result = json!({"modes": modes_json(mode), "configOptions": options});
        with_instructions(&mut result, ctx.core, &cwd_of(&self.sessions, &id));
        Ok(result)
    }

    pub(super) fn list_sessions(&mut self, core: &mut DriveCore, params: ListSessions) -> Value {
        core.load_existing();
        // Headers record the canonical directory.
        let cwd = params.cwd.map(|c| {
            Path::new(c)
                .canonicalize()
                .map_or_else(|_| c.to_owned(), |p| p.display().to_string())
        });
        // session → (title, cwd, newest run's start)
        let mut found: BTreeMap<String, (String, String, u64)> = BTreeMap::new();
        for summary in core.list() {
            let Ok(header) = core.header(summary.run_id) else {
                continue;
            };
            let Some(session) = header.get(SESSION_FIELD).and_then(Value::as_str) else {
                continue;
            };
            let run_cwd = header["cwd"].as_str().unwrap_or_default().to_owned();
            if cwd.as_ref().is_some_and(|c| *c != run_cwd) {
                continue;
            }
            let entry = found
                .entry(session.to_owned())
                .or_insert_with(|| (title_of(&summary.prompt), run_cwd, 0));
            entry.2 = entry.2.max(summary.created_ms);
        }
        let mut sessions: Vec<(String, (String, String, u64))> = found.into_iter().collect();
        sessions.sort_by_key(|s| std::cmp::Reverse(s.1.2));
        let sessions: Vec<Value> = sessions
            .into_iter()
            .map(|(id, (title, cwd, updated))| {
                json!({"sessionId": id, "cwd": cwd, "title": title, "updatedAt": iso8601(updated)})
            })
            .collect();
        json!({"sessions": sessions})
    }

    pub(super) fn close_session(
        &mut self,
        ctx: &mut Cx<AcpKey<H>>,
        id: &str,
    ) -> Result<Value, RpcError> {
        let Some(mut session) = self.sessions.remove(id) else {
            return Err(unknown_session(id));
        };
        self.runs.retain(|_, s| s != id);
        if let Some(run) = session.run
            && ctx.core.is_live(run)
        {
            let _ = ctx.core.cancel(run);
        }
        // A prompt in flight is answered now, and so is one queued behind a cancelled one
        // (every request gets its answer, or the editor waits forever); one waiting for
        match std::mem::take(&mut session.prompt) {
            PromptState::Running { request } => self.answer_cancelled(request),
            PromptState::Cancelling { request, queued } => {
                self.answer_cancelled(request);
                if let Some(queued) = queued {
                    self.answer_cancelled(queued.request);
                }
            }
            PromptState::Idle => {}
        }
        if let Some(asked) = session.asked.take() {
            self.withdraw(asked.request);
        }
        self.abandon_tasks(ctx, id, std::mem::take(&mut session.tasks));
        Self::stop_servers(ctx, std::mem::take(&mut session.mcp));
        Ok(json!({}))
    }

    pub(super) fn set_mode(
        &mut self,
        ctx: &mut Cx<AcpKey<H>>,
        params: SetMode,
    ) -> Result<(), RpcError> {
        self.switch_mode(ctx, params.session_id, params.mode_id)
    }

    pub(super) fn set_config_option(
        &mut self,
        ctx: &mut Cx<AcpKey<H>>,
        params: SetConfigOption,
    ) -> Result<Value, RpcError> {
        let id = params.session_id.to_owned();
        let (option, value) = (params.config_id, params.value);
        match option {
            "mode" => self.switch_mode(ctx, &id, value)?,
            "model" => self.set_model(ctx, &id, Some(value), None)?,
            "thought_level" => self.set_model(ctx, &id, None, Some(value))?,
            "sandbox" => self.switch_sandbox(ctx, &id, value)?,
            _ => return Err(invalid_params(format!("unknown config option `{option}`"))),
        }
        let session = self.sessions.get(&id).ok_or_else(|| unknown_session(&id))?;
        Ok(json!({"configOptions": self.config_options(ctx, session)}))
    }

    /// The editor's choice of sandbox for the session: the server's or a stricter one, for
    /// the live run at once and for every run after it.
    fn switch_sandbox(
        &mut self,
        ctx: &mut Cx<AcpKey<H>>,
        id: &str,
        value: &str,
    ) -> Result<(), RpcError> {
        let server = ctx.core.config().policy.sandbox();
        let sandbox = SandboxMode::parse(value)
            .filter(|mode| mode.is_within(server))
            .ok_or_else(|| {
                invalid_params(format!(
                    "sandbox `{value}` is not offered: expected the server's `{server}` or a \
                     stricter one"
                ))
            })?;
        let (session, live) = self.session_and_live_run(ctx, id)?;
        session.sandbox = sandbox;
        if let Some(run) = live {
            let _ = ctx.core.set_sandbox(run, sandbox);
        }
        Ok(())
    }

    /// Session `id`, and its run if still live: a change of the session's options applies
    /// to that run at once.
    fn session_and_live_run(
        &mut self,
        ctx: &Cx<AcpKey<H>>,
        id: &str,
    ) -> Result<(&mut Session, Option<RunId>), RpcError> {
        let session = self
            .sessions
            .get_mut(id)
            .ok_or_else(|| unknown_session(id))?;
        let live = session.run.filter(|&run| ctx.core.is_live(run));
        Ok((session, live))
    }

    /// `session/delete`: the session is closed if open (its prompt answered, its run
    /// stopped) and its runs' session files removed, so neither `session/list` nor
    /// `session/load` finds it again.
    pub(super) fn delete_session(
        &mut self,
        ctx: &mut Cx<AcpKey<H>>,
        id: &str,
    ) -> Result<Value, RpcError> {
        let open = self.sessions.contains_key(id);
        if open {
            self.close_session(ctx, id)?;
        }
        ctx.core.load_existing();
        let runs = ctx.core.find_by_header(SESSION_FIELD, &json!(id));
        if runs.is_empty() && !open {
            return Err(unknown_session(id));
        }
        for run in runs {
            ctx.core
                .delete(run)
                .map_err(|e| RpcError::new(INTERNAL_ERROR, e.to_string()))?;
        }
        Ok(json!({}))
    }

    /// The title of a stored session: its first run's prompt, as `session/list` shows it.
    pub(super) fn stored_title(core: &DriveCore, id: &str) -> Option<String> {
        let first = *core.find_by_header(SESSION_FIELD, &json!(id)).first()?;
        let header = core.header(first).ok()?;
        Some(title_of(header["prompt"].as_str()?))
    }

    pub(super) fn switch_mode(
        &mut self,
        ctx: &mut Cx<AcpKey<H>>,
        id: &str,
        mode_id: &str,
    ) -> Result<(), RpcError> {
        let mode = Mode::parse(mode_id).ok_or_else(|| {
            invalid_params(format!(
                "unknown mode `{mode_id}`: expected default, acceptEdits, plan, dontAsk or \
                 bypassPermissions"
            ))
        })?;
        let (session, live) = self.session_and_live_run(ctx, id)?;
        session.mode = mode;
        if let Some(run) = live {
            let _ = ctx.core.update_policy(run, Some(mode), None);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iso8601_dates() {
        assert_eq!(iso8601(0), "1970-01-01T00:00:00Z");
        assert_eq!(iso8601(951_782_400_000), "2000-02-29T00:00:00Z");
        assert_eq!(iso8601(1_785_585_600_123), "2026-08-01T12:00:00Z");
    }
}
