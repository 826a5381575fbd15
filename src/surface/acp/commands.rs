//! What an editor shows around the conversation: the slash commands
//! (`available_commands_update`; `/compact`, `/model`, `/mode` and one per permission mode),
//! the choices of the session's config options (permission modes, sandboxes, thinking
//! efforts; `session` builds the options from them and the session), its title
//! (`session_info_update`), and the commands that are answered here without a model turn.
//! `/compact` is not one of those: it goes to the run (`prompt`). It knows no `Session`, so
//! `session` and `prompt` both build on it.

use serde_json::{Value, json};

use super::{AcpKey, AcpServe, invalid_params, unknown_session};
use crate::ids::HostKey;
use crate::jsonrpc::{Id, RpcError};
use crate::model::types::Effort;
use crate::permissions::Mode;
use crate::sandbox::Mode as SandboxMode;
use crate::surface::host::Cx;

/// The longest title a session gets from its first prompt.
pub(super) const MAX_TITLE_CHARS: usize = 80;

/// `thought_level` values, in the order the editor lists them; `off` asks for nothing.
pub(super) const EFFORTS: [(&str, &str); 4] = [
    ("off", "No extended thinking"),
    ("low", "Think briefly"),
    ("medium", "Think"),
    ("high", "Think hard"),
];

/// The permission modes a session can be switched to, as `session/new` advertises them.
pub(super) const MODES: [(Mode, &str, &str); 5] = [
    (
        Mode::Default,
        "Default",
        "Ask before running commands and changing files",
    ),
    (
        Mode::AcceptEdits,
        "Accept edits",
        "Change files in the workspace without asking; still ask for commands",
    ),
    (
        Mode::Plan,
        "Plan",
        "Read only: look around and plan, change nothing",
    ),
    (
        Mode::DontAsk,
        "Don't ask",
        "Run whatever would ask, without asking; deny rules still deny",
    ),
    (
        Mode::BypassPermissions,
        "Bypass permissions",
        "Skip every permission check, deny rules included",
    ),
];

/// What each sandbox mode lets commands do, as a select option describes it.
pub(super) const SANDBOXES: [(SandboxMode, &str, &str); 4] = [
    (
        SandboxMode::ReadOnly,
        "Read-only",
        "Commands read the machine but write nothing",
    ),
    (
        SandboxMode::WorkspaceWrite,
        "Workspace",
        "Commands write only in the workspace and temp directories, with no network",
    ),
    (
        SandboxMode::Network,
        "Workspace and network",
        "Commands write in the workspace and reach the network over TCP",
    ),
    (
        SandboxMode::Off,
        "Unsandboxed",
        "Commands run with your full rights",
    ),
];

/// A slash command typed as a prompt.
#[derive(Debug, PartialEq)]
pub(super) enum Command {
    Compact,
    /// `/model` (list) or `/model NAME`.
    Model(Option<String>),
    /// `/mode` (list), `/mode ID`, or `/ID` for a permission mode.
    Mode(Option<String>),
}

/// The command a prompt's text is, if it is one: a known name after `/`, then its input.
pub(super) fn parse(text: &str) -> Option<Command> {
    let rest = text.trim().strip_prefix('/')?;
    let (name, input) = match rest.split_once(char::is_whitespace) {
        Some((name, input)) => (name, input.trim()),
        None => (rest, ""),
    };
    let input = (!input.is_empty()).then(|| input.to_owned());
    match name {
        "compact" => Some(Command::Compact),
        "model" => Some(Command::Model(input)),
        "mode" => Some(Command::Mode(input)),
        other => Mode::parse(other).map(|mode| Command::Mode(Some(mode.as_str().to_owned()))),
    }
}

fn commands_json() -> Value {
    let mut commands = vec![
        json!({"name": "compact",
               "description": "Summarise the older conversation to free the context window"}),
        json!({"name": "model", "description": "Show or switch the model",
               "input": {"hint": "model name"}}),
        json!({"name": "mode", "description": "Show or switch the permission mode",
               "input": {"hint": "default, acceptEdits, plan, dontAsk or bypassPermissions"}}),
    ];
    commands.extend(MODES.iter().map(|(mode, name, description)| {
        json!({"name": mode.as_str(), "description": format!("{name} mode: {description}")})
    }));
    Value::Array(commands)
}

/// The title of a session whose first prompt was `prompt`: its first line, cut.
pub(super) fn title_of(prompt: &str) -> String {
    prompt
        .lines()
        .next()
        .unwrap_or_default()
        .chars()
        .take(MAX_TITLE_CHARS)
        .collect()
}

impl<H: HostKey> AcpServe<H> {
    /// After `session/new`, `load` or `resume` is answered: the commands the editor
    /// completes after `/`, and the title of a session that has one.
    pub(super) fn announce_session(&mut self, sid: &str, title: Option<String>) {
        self.outbox.update(
            sid,
            json!({"sessionUpdate": "available_commands_update",
                   "availableCommands": commands_json()}),
        );
        if let Some(title) = title.filter(|t| !t.is_empty()) {
            self.outbox.update(
                sid,
                json!({"sessionUpdate": "session_info_update", "title": title}),
            );
        }
    }

    /// Sets the session's model (`Some`) and/or effort; the live run's next request uses
    /// them, and so does every later run of the session.
    pub(super) fn set_model(
        &mut self,
        ctx: &mut Cx<AcpKey<H>>,
        sid: &str,
        model: Option<&str>,
        effort: Option<&str>,
    ) -> Result<(), RpcError> {
        let session = self
            .sessions
            .get_mut(sid)
            .ok_or_else(|| unknown_session(sid))?;
        if let Some(model) = model {
            let known = &ctx.core.config().models;
            if !known.iter().any(|m| m == model) {
                return Err(invalid_params(format!(
                    "unknown model `{model}`: expected one of {} (settings' `models` lists them)",
                    known.join(", ")
                )));
            }
            session.model = model.to_owned();
        }
        if let Some(effort) = effort {
            session.effort = match effort {
                "off" => None,
                other => Some(Effort::parse(other).ok_or_else(|| {
                    invalid_params(format!(
                        "unknown thought_level `{other}`: expected off, low, medium or high"
                    ))
                })?),
            };
        }
        if let Some(run) = session.run {
            ctx.core.reconfigure(run, &session.model, session.effort);
        }
        Ok(())
    }

    /// `/model` and `/mode`: answered at once, with a message saying what is now set and
    /// the updates an editor keeps its selectors in step with.
    pub(super) fn run_command(
        &mut self,
        ctx: &mut Cx<AcpKey<H>>,
        id: &Id,
        sid: &str,
        command: Command,
    ) -> Result<(), RpcError> {
        let text = match command {
            Command::Compact => return Ok(()),
            Command::Model(Some(model)) => {
                self.set_model(ctx, sid, Some(&model), None)?;
                format!("Model: {model}")
            }
            Command::Model(None) => {
                let current = self.sessions.get(sid).map(|s| s.model.clone());
                format!(
                    "Model: {}. Available: {}",
                    current.unwrap_or_default(),
                    ctx.core.config().models.join(", ")
                )
            }
            Command::Mode(Some(mode)) => {
                self.switch_mode(ctx, sid, &mode)?;
                self.outbox.update(
                    sid,
                    json!({"sessionUpdate": "current_mode_update", "currentModeId": mode}),
                );
                format!("Mode: {mode}")
            }
            Command::Mode(None) => {
                let current = self.sessions.get(sid).map_or(Mode::Default, |s| s.mode);
                let all: Vec<&str> = MODES.iter().map(|(m, ..)| m.as_str()).collect();
                format!("Mode: {current}. Available: {}", all.join(", "))
            }
        };
        let options = match self.sessions.get(sid) {
            Some(session) => self.config_options(ctx, session),
            None => return Err(unknown_session(sid)),
        };
        self.outbox.update(
            sid,
            json!({"sessionUpdate": "config_option_update", "configOptions": options}),
        );
        self.outbox.update(
            sid,
            json!({"sessionUpdate": "agent_message_chunk",
                   "content": {"type": "text", "text": text}}),
        );
        self.reply(id.clone(), Ok(json!({"stopReason": "end_turn"})));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_parse() {
        assert_eq!(parse(" /compact "), Some(Command::Compact));
        assert_eq!(parse("/model"), Some(Command::Model(None)));
        assert_eq!(
            parse("/model  claude-x\n"),
            Some(Command::Model(Some("claude-x".into())))
        );
        assert_eq!(parse("/plan"), Some(Command::Mode(Some("plan".into()))));
        assert_eq!(
            parse("/mode dontAsk"),
            Some(Command::Mode(Some("dontAsk".into())))
        );
        assert_eq!(parse("/unknown"), None);
        assert_eq!(parse("compact"), None);
    }
}
