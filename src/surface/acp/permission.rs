//! Permission prompts: the core's surfaced prompt becomes one `session/request_permission`
//! per run at a time (withdrawn with `$/cancel_request` when the core resolves it on its
//! own), the client's answer goes back to the core, and "always" answers become session
//! rules that every later run of the session starts with.

use std::collections::BTreeSet;
use std::path::Path;

use serde_json::{Value, json};

use super::card::{self, OldText};
use super::params::Outcome;
use super::{AcpKey, AcpServe, Pending};
use crate::drive::table::Prompt;
use crate::ids::{HostKey, RunId};
use crate::jsonrpc::RpcError;
use crate::log;
use crate::permissions::{Action, Mode, Policy, Rule, RuleSource};
use crate::surface::host::Cx;

/// A `session/request_permission` the client has not answered yet.
pub(super) struct Asked {
    pub(super) request: i64,
    tool_use_id: String,
}

/// The session rules an "always" answer adds (`permissions::suggested_rules`); tools with
/// no argument to match (Glob, Grep) get their bare name.
fn always_patterns(tool: &str, input: &Value) -> Vec<String> {
    let rules = crate::permissions::suggested_rules(tool, input);
    // A command nobody could split gets no "always" option: allowing the whole tool
    // would allow every command.
    let runs_commands = crate::tools::table::permission(tool)
        .is_some_and(|permission| permission.subject.command_field().is_some());
    if rules.is_empty() && !runs_commands {
        return vec![tool.to_owned()];
    }
    rules
}

impl<H: HostKey> AcpServe<H> {
    /// Surfaces the core's prompts: one `session/request_permission` per run at a time, and
    /// a `$/cancel_request` for one the core resolved on its own (a timeout, the run ended).
    ///
    /// A prompt an "always" answer already covers (a call queued in the same turn, before
    /// the rule existed) is answered without asking again.
    pub(super) fn sync_permissions(&mut self, ctx: &mut Cx<AcpKey<H>>, changed: &BTreeSet<RunId>) {
        for &run in changed {
            let Some(sid) = self.runs.get(&run).cloned() else {
                continue;
            };
            let surfaced = ctx.core.surfaced_prompt(run).ok().flatten();
            let Some(session) = self.sessions.get_mut(&sid) else {
                continue;
            };
            let current = session.asked.as_ref().map(|a| a.tool_use_id.as_str());
            if current == surfaced.as_ref().map(|p| p.tool_use_id.as_str()) {
                continue;
            }
            if let Some(asked) = session.asked.take() {
                self.withdraw(asked.request);
            }
            let Some(prompt) = surfaced else {
                continue;
            };
            let workspace = &ctx.core.config().workspace;
            if let Some((allow, pattern)) = self.remembered(workspace, &sid, &prompt) {
                let reason = (!allow)
                    .then(|| format!("the user rejected every {pattern} call in this session"));
                let _ = ctx.core.permit(run, &prompt.tool_use_id, allow, reason);
                continue;
            }
            self.ask_client(&sid, run, prompt);
        }
    }

    /// The session's "always" answer for a call, if one covers it: (allow, its pattern).
    fn remembered(&self, workspace: &Path, sid: &str, prompt: &Prompt) -> Option<(bool, String)> {
        let session = self.sessions.get(sid)?;
        if session.rules.is_empty() {
            return None;
        }
        // Newest first, the order `Policy::with_session_rule` gives a run.
        let rules: Vec<Rule> = session.rules.iter().rev().cloned().collect();
        let policy =
            Policy::new(rules, Mode::Default, workspace.to_path_buf()).with_cwd(&session.cwd);
        let decision = policy.decide(&prompt.tool_name, &prompt.input);
        let pattern = decision.matched?;
        let ours = session.rules.iter().any(|r| r.pattern == pattern);
        (ours && decision.action != Action::Ask)
            .then(|| (decision.action == Action::Allow, pattern))
    }

    fn ask_client(&mut self, sid: &str, run: RunId, prompt: Prompt) {
        let Some(session) = self.sessions.get(sid) else {
            return;
        };
        let described = card::describe(
            &prompt.tool_name,
            &prompt.input,
            &session.cwd,
            OldText::ReadFile,
        );
        // A call the sandbox refused, asked about again: the user decides whether it runs
        // outside the sandbox this once, which no "always" rule could say.
        let retry = prompt.input.get("sandbox").is_some_and(Value::is_string);
        let title = if retry {
            format!("Run outside the sandbox: {}", described.title)
        } else {
            described.title
        };
        let mut tool_call = json!({
            "toolCallId": self.wire_id(sid, &prompt.tool_use_id),
            "title": title,
            "kind": card::kind(&prompt.tool_name),
            "status": "pending",
            "rawInput": prompt.input,
        });
        if !described.locations.is_empty() {
            tool_call["locations"] = json!(described.locations);
        }
        if !described.content.is_empty() {
            tool_call["content"] = json!(described.content);
        }
        // The rules an "always" answer adds, one per line (a chained command needs one per
        // command word); none when no rule would be safe, and then no "always" options.
        let pattern = if retry {
            String::new()
        } else {
            always_patterns(&prompt.tool_name, &prompt.input).join("\n")
        };
        let shown = pattern.replace('\n', ", ");
        let mut options = vec![json!({"optionId": "allow", "name": "Allow", "kind": "allow_once"})];
        if !pattern.is_empty() {
            options.push(
                json!({"optionId": "allow_always", "name": format!("Always allow {shown}"),
                                "kind": "allow_always"}),
            );
        }
        options.push(json!({"optionId": "reject", "name": "Reject", "kind": "reject_once"}));
        if !pattern.is_empty() {
            options.push(
                json!({"optionId": "reject_always", "name": format!("Always reject {shown}"),
                                "kind": "reject_always"}),
            );
        }
        let params = json!({
            "sessionId": sid,
            "toolCall": tool_call,
            "options": options,
        });
        let tool_use_id = prompt.tool_use_id.clone();
        let request = self.request(
            "session/request_permission",
            params,
            Pending::Permission {
                session: sid.to_owned(),
                run,
                tool_use_id: tool_use_id.clone(),
                pattern,
            },
        );
        if let Some(session) = self.sessions.get_mut(sid) {
            session.asked = Some(Asked {
                request,
                tool_use_id,
            });
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn on_permission_answer(
        &mut self,
        ctx: &mut Cx<AcpKey<H>>,
        request: i64,
        sid: &str,
        run: RunId,
        tool_use_id: &str,
        pattern: &str,
        answer: Result<Value, RpcError>,
    ) {
        let Some(session) = self.sessions.get_mut(sid) else {
            return;
        };
        if session.asked.as_ref().map(|a| a.request) != Some(request) {
            return;
        }
        session.asked = None;
        let mut cancel_turn = false;
        let (allow, reason, always) = match answer.as_ref().map(Outcome::decode) {
            Ok(Outcome::Selected("allow")) => (true, None, None),
            Ok(Outcome::Selected("allow_always")) => (true, None, Some(Action::Allow)),
            Ok(Outcome::Selected("reject")) => {
                (false, Some("the user rejected this tool call".into()), None)
            }
            Ok(Outcome::Selected("reject_always")) => (
                false,
                Some(format!(
                    "the user rejected this tool call, and every {pattern} call in this session"
                )),
                Some(Action::Deny),
            ),
            Ok(Outcome::Selected(other)) => (
                false,
                Some(format!(
                    "the editor answered with an unknown option `{other}`"
                )),
                None,
            ),
            Err(e) => (
                false,
                Some(format!(
                    "the editor could not ask for permission: {}",
                    e.message
                )),
                None,
            ),
            Ok(outcome @ (Outcome::Cancelled | Outcome::Unreadable)) => {
                // `cancelled` is reserved for a cancelled turn: stop it.
                cancel_turn = outcome == Outcome::Cancelled;
                (
                    false,
                    Some("the permission request was cancelled".into()),
                    None,
                )
            }
        };
        if let Some(action) = always {
            for pattern in pattern.split('\n').filter(|p| !p.is_empty()) {
                match Rule::new(pattern, action, None, RuleSource::Session) {
                    Ok(rule) => {
                        session.rules.push(rule.clone());
                        let _ = ctx.core.update_policy(run, None, Some(rule));
                    }
                    Err(e) => log::warn(&format!("cannot keep the answer as a rule: {e}")),
                }
            }
        }
        let _ = ctx.core.permit(run, tool_use_id, allow, reason);
        if cancel_turn {
            self.cancel_turn(ctx, sid);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn always_patterns_are_valid_rules() {
        for (tool, input, want) in [
            (
                "Bash",
                json!({"command": "cargo test --all"}),
                vec!["Bash(cargo:*)"],
            ),
            (
                "Bash",
                json!({"command": "cd . && FOO=1 echo hi"}),
                vec!["Bash(cd:*)", "Bash(echo:*)"],
            ),
            (
                "Bash",
                json!({"command": "sudo rm -rf build"}),
                vec!["Bash(sudo rm -rf build)"],
            ),
            ("Edit", json!({"path": "x"}), vec!["Edit(x)"]),
            ("Glob", json!({"pattern": "*.rs"}), vec!["Glob"]),
        ] {
            let patterns = always_patterns(tool, &input);
            assert_eq!(patterns, want);
            for pattern in patterns {
                assert!(
                    Rule::new(&pattern, Action::Allow, None, RuleSource::Session).is_ok(),
                    "{pattern}"
                );
            }
        }
    }
}
