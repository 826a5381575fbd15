//! Permission policy (Permissions v2): ordered `allow | ask | deny` rules where the first match
//! wins, a permission-mode post-pass, and per-run profiles that can only narrow. Pure policy:
//! this module does no I/O and must not know where rules come from (settings files, the CLI,
//! an editor's "always allow"), how an Ask is answered, or how tools run. Paths are judged
//! lexically against the workspace; resolving symlinks is the tool layer's job.
//!
//! What a single pattern means lives in `pattern` (the grammar and matching one call), and
//! how a Bash command breaks into the pieces an allow rule must each cover lives in `shell`,
//! and which paths no rule or mode but `bypassPermissions` lets the model edit without asking
//! is `policy::PROTECTED`; this module combines them into decisions. What the policy knows of each tool (the field a
//! rule matches, its default, whether it edits files or only reads) is its row in
//! `tools::table`, so no tool name is spelled here.

mod pattern;
mod shell;

use std::fmt;
use std::path::{Path, PathBuf};

use serde_json::Value;

pub use pattern::PatternError;
use pattern::{FieldKind, Matcher, Subject, escape_glob, first_arg, normalize_abs, path_view};
// Crate-visible for the fuzz entry points (`crate::fuzzing`) only.
pub(crate) use shell::split_command;

use crate::policy::{self, Protected};
use crate::tools::table::{self, Class, DefaultAction};

/// Most pieces a Bash command may have and still be allowed by allow rules. Each piece is
/// checked against every rule, so this bounds the work a huge generated command costs; past
/// it, allow rules stop matching (the call asks) while deny and ask rules still see every piece.
const MAX_ALLOW_PIECES: usize = 256;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    Allow,
    Ask,
    Deny,
}

impl Action {
    /// Parses the lowercase names used in settings files and on the wire.
    pub fn parse(name: &str) -> Option<Action> {
        match name {
            "allow" => Some(Action::Allow),
            "ask" => Some(Action::Ask),
            "deny" => Some(Action::Deny),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Action::Allow => "allow",
            Action::Ask => "ask",
            Action::Deny => "deny",
        }
    }

    /// Deny > Ask > Allow: used to combine a base decision with a narrowing profile's.
    fn strictness(self) -> u8 {
        match self {
            Action::Allow => 0,
            Action::Ask => 1,
            Action::Deny => 2,
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Permission modes, a post-pass over the static rule decision (upstream ADR 0029).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Mode {
    #[default]
    Default,
    AcceptEdits,
    Plan,
    DontAsk,
    BypassPermissions,
}

impl Mode {
    pub const ALL: [Mode; 5] = [
        Mode::Default,
        Mode::AcceptEdits,
        Mode::Plan,
        Mode::DontAsk,
        Mode::BypassPermissions,
    ];

    /// Parses the exact camelCase names shared with upstream's `permission_mode` and ACP's
    /// session modes. Upstream's `auto` and `disabled` are not supported and parse as `None`.
    pub fn parse(name: &str) -> Option<Mode> {
        Mode::ALL.into_iter().find(|mode| mode.as_str() == name)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Default => "default",
            Mode::AcceptEdits => "acceptEdits",
            Mode::Plan => "plan",
            Mode::DontAsk => "dontAsk",
            Mode::BypassPermissions => "bypassPermissions",
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where a rule came from, highest priority first. Informational: priority is the order of
/// the rule list, which callers build in this order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RuleSource {
    Session,
    Cli,
    Project,
    User,
    Builtin,
}

impl RuleSource {
    #[cfg(test)]
    pub fn as_str(self) -> &'static str {
        match self {
            RuleSource::Session => "session",
            RuleSource::Cli => "cli",
            RuleSource::Project => "project",
            RuleSource::User => "user",
            RuleSource::Builtin => "builtin",
        }
    }
}

/// One ordered rule. `pattern` is kept for display and audit; the compiled matcher is private
/// and built from it once, so editing `pattern` afterwards does not change what matches.
#[derive(Clone, Debug)]
pub struct Rule {
    pub pattern: String,
    pub action: Action,
    /// Returned to the model when this rule denies; never used for allow or ask.
    pub reason: Option<String>,
    pub source: RuleSource,
    matcher: Matcher,
}

impl Rule {
    pub fn new(
        pattern: &str,
        action: Action,
        reason: Option<String>,
        source: RuleSource,
    ) -> Result<Rule, PatternError> {
        Ok(Rule {
            pattern: pattern.to_owned(),
            action,
            reason,
            source,
            matcher: Matcher::parse(pattern)?,
        })
    }
}

/// Built-in defaults, appended after every configured rule by `Policy::new`: each tool's
/// default from `tools::table` (the read-only tools and `TodoWrite` run, the rest ask), then
/// `*` asks for every other tool.
pub fn default_rules() -> Vec<Rule> {
    let rule = |pattern: &str, action: Action| {
        Rule::new(pattern, action, None, RuleSource::Builtin)
            .expect("built-in permission patterns are valid")
    };
    let mut rules: Vec<Rule> = table::defaults()
        .map(|(tool, default)| {
            let action = match default {
                DefaultAction::Allow => Action::Allow,
                DefaultAction::Ask => Action::Ask,
            };
            rule(tool, action)
        })
        .collect();
    rules.push(rule("*", Action::Ask));
    rules
}

/// The outcome for one tool call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    pub action: Action,
    /// Human text. For a deny: the rule's `reason`, else "permission denied for tool '<T>'".
    pub reason: String,
    /// The pattern of the rule that matched, before any mode override; `None` when no rule did.
    pub matched: Option<String>,
}

/// Rules, a mode and a workspace; `decide` maps a tool call to a `Decision`.
#[derive(Clone, Debug)]
pub struct Policy {
    rules: Vec<Rule>,
    mode: Mode,
    /// The workspace lexically normalised, as the `/`-joined string paths are compared against.
    workspace_str: String,
    /// Per-run narrowing profiles (`narrowed`); every one of them must agree.
    profiles: Vec<Profile>,
    /// Where the run's tools resolve relative paths (normalised), when it is a
    /// subdirectory of `workspace`; rules stay anchored at `workspace`.
    cwd_str: Option<String>,
    /// What the run's commands may do once a rule lets them run (`crate::sandbox`):
    /// behind the rules, never instead of them.
    sandbox: policy::Mode,
}

/// A narrowing layer: its own rules ending in `*` → allow, and optionally its own mode.
#[derive(Clone, Debug)]
struct Profile {
    rules: Vec<Rule>,
    /// `None` follows the policy's current mode.
    mode: Option<Mode>,
}

impl Policy {
    /// `rules` are the configured rules in priority order (session, CLI, project, user);
    /// `new` appends `default_rules()` after them, so callers never add the defaults
    /// themselves. `workspace` must be absolute; it is normalised lexically, never resolved.
    pub fn new(rules: Vec<Rule>, mode: Mode, workspace: PathBuf) -> Policy {
        let mut rules = rules;
        rules.extend(default_rules());
        let workspace_str = normalize_abs(&workspace.to_string_lossy());
        Policy {
            rules,
            mode,
            workspace_str,
            profiles: Vec::new(),
            cwd_str: None,
            sandbox: policy::Mode::Off,
        }
    }

    /// The policy with its commands in the `sandbox` mode (the configured one, at start).
    pub fn with_sandbox(mut self, sandbox: policy::Mode) -> Policy {
        self.sandbox = sandbox;
        self
    }

    /// Sets the run's sandbox; the caller checked it is within the server's.
    pub fn set_sandbox(&mut self, sandbox: policy::Mode) {
        self.sandbox = sandbox;
    }

    pub fn sandbox(&self) -> policy::Mode {
        self.sandbox
    }

    /// Judges relative paths in tool inputs from `cwd` (a run working in a subdirectory),
    /// exactly as the tools will resolve them, while rules stay relative to the workspace.
    pub fn with_cwd(mut self, cwd: &Path) -> Policy {
        let cwd = normalize_abs(&cwd.to_string_lossy());
        self.cwd_str = (cwd != self.workspace_str).then_some(cwd);
        self
    }

    pub fn decide(&self, tool: &str, input: &Value) -> Decision {
        let base = self.cwd_str.as_deref().unwrap_or(&self.workspace_str);
        let call = Call::new(tool, input, &self.workspace_str, base);
        let mut decision = decide_with(&self.rules, self.mode, &call);
        for profile in &self.profiles {
            let mode = profile.mode.unwrap_or(self.mode);
            let narrower = decide_with(&profile.rules, mode, &call);
            if narrower.action.strictness() > decision.action.strictness() {
                decision = narrower;
            }
        }
        decision
    }

    /// A per-run profile that can only narrow: `decide` on the result returns the stricter
    /// (Deny > Ask > Allow) of this policy's decision and the profile's, where the profile is
    /// `extra_rules` followed by `*` → allow, evaluated under `mode` (or this policy's mode
    /// when `None`). Taking the stricter of the two means no profile can widen anything: a
    /// profile asking for `bypassPermissions` only ever contributes Allow, which loses to
    /// every base decision. Profiles stack when narrowed again.
    pub fn narrowed(&self, extra_rules: Vec<Rule>, mode: Option<Mode>) -> Policy {
        let mut rules = extra_rules;
        rules.push(
            Rule::new("*", Action::Allow, None, RuleSource::Builtin)
                .expect("the catch-all pattern is valid"),
        );
        let mut policy = self.clone();
        policy.profiles.push(Profile { rules, mode });
        policy
    }

    /// Adds an editor's "always allow/reject" rule. A session deny goes first; a session
    /// allow goes after every configured deny rule (CLI, settings), so an answer in the
    /// editor never overrides what the configuration forbids, yet still outranks the
    /// configured and built-in asks it was given to silence. It joins the base rules only:
    /// a narrowing profile still applies.
    pub fn with_session_rule(&mut self, rule: Rule) {
        let at = match rule.action {
            Action::Deny => 0,
            Action::Allow | Action::Ask => self
                .rules
                .iter()
                .rposition(|r| r.action == Action::Deny && r.source != RuleSource::Builtin)
                .map_or(0, |i| i + 1),
        };
        self.rules.insert(at, rule);
    }

    /// The reply to an Ask that nobody can answer (print mode), with a concrete way to allow
    /// it; for an edit of a protected path, the one way there is.
    pub fn ask_denied_message(&self, tool: &str, input: &Value) -> String {
        let base = self.cwd_str.as_deref().unwrap_or(&self.workspace_str);
        let call = Call::new(tool, input, &self.workspace_str, base);
        match protected_edit(&call.subject) {
            Some((path, entry)) => format!(
                "permission denied: `{path}` is protected ({}), so '{tool}' asks before \
                 editing it, and no one can be asked in print mode; only \
                 --permission-mode bypassPermissions edits it without asking",
                entry.why
            ),
            None => ask_denied_message(tool, input),
        }
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    pub fn set_mode(&mut self, mode: Mode) {
        self.mode = mode;
    }

    /// Every base rule in priority order, defaults last.
    #[cfg(test)]
    pub fn rules(&self) -> &[Rule] {
        &self.rules
    }
}

/// The reply to an Ask that nobody can answer (print mode), with a concrete way to allow it.
fn ask_denied_message(tool: &str, input: &Value) -> String {
    let tool_arg = shell_quote(tool);
    let allow = match suggested_pattern(tool, input) {
        Some(pattern) => format!("--allow {} (or --allow {tool_arg})", shell_quote(&pattern)),
        None => format!("--allow {tool_arg}"),
    };
    // acceptEdits only helps the file-edit tools; for anything else the mode that turns this
    // Ask into an Allow is dontAsk.
    let modes = if table::edits_files(tool) {
        "acceptEdits|bypassPermissions"
    } else {
        "dontAsk|bypassPermissions"
    };
    format!(
        "permission denied: '{tool}' requires approval and no one can be asked in print mode; \
         allow it with {allow}, a settings rule, or --permission-mode {modes}"
    )
}

/// A rule pattern that would allow this call without allowing everything the tool can do.
/// Commands that run another command: a prefix rule on them would allow anything.
const WRAPPERS: &[&str] = &[
    "sudo", "env", "xargs", "timeout", "nice", "nohup", "time", "exec", "bash", "sh", "zsh",
    "command", "builtin", "eval", "doas", "su",
];

/// The rules that would allow exactly this kind of call again ("always allow" in an
/// editor): for Bash, one prefix rule per distinct command word in the chain (skipping
/// `VAR=value` assignments; commands that wrap another command get an exact rule); for
/// file tools the exact path; for WebFetch the site. Empty when no safe rule exists.
pub fn suggested_rules(tool: &str, input: &Value) -> Vec<String> {
    let Some(field) = first_arg(tool).filter(|field| field.kind == FieldKind::Command) else {
        return suggested_pattern(tool, input).into_iter().collect();
    };
    let Some(command) = input.get(field.name).and_then(Value::as_str) else {
        return Vec::new();
    };
    let Some(segments) = split_command(command) else {
        return Vec::new();
    };
    let mut rules: Vec<String> = Vec::new();
    for segment in &segments {
        let words: Vec<&str> = segment
            .split_whitespace()
            .skip_while(|w| w.contains('=') && !w.starts_with('='))
            .collect();
        let Some(first) = words.first() else {
            continue;
        };
        let rule = if WRAPPERS.contains(first) || first.starts_with(['>', '<']) {
            format!("{tool}({})", escape_glob(&words.join(" ")))
        } else {
            format!("{tool}({}:*)", escape_glob(first))
        };
        if !rules.contains(&rule) {
            rules.push(rule);
        }
    }
    rules
}

fn suggested_pattern(tool: &str, input: &Value) -> Option<String> {
    let field = first_arg(tool)?;
    let value = input.get(field.name)?.as_str()?;
    match field.kind {
        FieldKind::Command => {
            let word = value.split_whitespace().next()?;
            Some(format!("{tool}({}:*)", escape_glob(word)))
        }
        FieldKind::Path => {
            // `Tool()` is no pattern; the policy reads an empty path as the workspace root.
            let path = if value.is_empty() { "." } else { value };
            Some(format!("{tool}({})", escape_glob(path)))
        }
        // A first argument is never plain text; only `key=` forms are.
        FieldKind::Text => None,
        FieldKind::Url => {
            // WebFetch: allow the whole site rather than one URL.
            let (scheme, rest) = value.split_once("://")?;
            let host = rest
                .split(['/', '?', '#'])
                .next()
                .filter(|h| !h.is_empty())?;
            Some(format!(
                "{tool}({}://{}/*)",
                escape_glob(scheme),
                escape_glob(host)
            ))
        }
    }
}

/// Quotes `text` for a POSIX shell when it holds anything beyond plainly safe characters.
fn shell_quote(text: &str) -> String {
    let safe = !text.is_empty()
        && text
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | '/' | ':'));
    if safe {
        text.to_owned()
    } else {
        format!("'{}'", text.replace('\'', r"'\''"))
    }
}

/// Static rules (first match wins, but a matching deny rule from anywhere in the
/// configuration beats an allow or ask before it; no match denies), then the mode post-pass.
/// A deny is what the user said must never run: a workspace's allow rules, which come
/// before the user's own, must not lift a deny in the user's settings.
fn decide_with(rules: &[Rule], mode: Mode, call: &Call<'_>) -> Decision {
    let first = rules.iter().find(|rule| rule_matches(rule, call, rules));
    let first = match first {
        Some(rule) if rule.action != Action::Deny => rules
            .iter()
            .find(|r| {
                r.action == Action::Deny
                    && r.source != RuleSource::Builtin
                    && rule_matches(r, call, rules)
            })
            .or(Some(rule)),
        other => other,
    };
    let decision = match first {
        Some(rule) => {
            let reason = match rule.action {
                Action::Allow => format!("allowed by rule '{}'", rule.pattern),
                Action::Ask => format!(
                    "'{}' requires approval (rule '{}')",
                    call.subject.tool, rule.pattern
                ),
                Action::Deny => rule
                    .reason
                    .clone()
                    .unwrap_or_else(|| denied_for(call.subject.tool)),
            };
            Decision {
                action: rule.action,
                reason,
                matched: Some(rule.pattern.clone()),
            }
        }
        None => Decision {
            action: Action::Deny,
            reason: denied_for(call.subject.tool),
            matched: None,
        },
    };
    protect(
        apply_mode(decision, mode, &call.subject),
        mode,
        &call.subject,
    )
}

/// The protected-path post-pass (`protected`): an edit of a path that configures execution
/// or permissions asks even when a rule or the mode would allow it, in every mode but
/// `bypassPermissions`. A deny or ask stands, and plan mode's deny with it.
fn protect(decision: Decision, mode: Mode, call: &Subject<'_>) -> Decision {
    if decision.action != Action::Allow || mode == Mode::BypassPermissions {
        return decision;
    }
    let Some((path, entry)) = protected_edit(call) else {
        return decision;
    };
    Decision {
        action: Action::Ask,
        reason: format!(
            "'{}' asks before editing `{path}`: {} is protected ({}); only bypassPermissions \
             mode edits it without asking",
            call.tool,
            entry.shown(),
            entry.why
        ),
        matched: decision.matched,
    }
}

/// For a call of a tool that edits files, the path it names (as named) and the entry that
/// protects it, judged from the workspace when the path is inside it and from the root
/// otherwise (an absolute allow rule may reach another repository).
fn protected_edit<'a>(call: &Subject<'a>) -> Option<(&'a str, &'static Protected)> {
    if !table::edits_files(call.tool) {
        return None;
    }
    let field = first_arg(call.tool).filter(|field| field.kind == FieldKind::Path)?;
    let raw = call.input.get(field.name)?.as_str()?;
    let view = path_view(call.workspace, call.base, raw);
    let judged = view.rel.as_deref().unwrap_or(&view.abs);
    policy::protected_path(judged).map(|entry| (raw, entry))
}

fn denied_for(tool: &str) -> String {
    format!("permission denied for tool '{tool}'")
}

/// The mode post-pass. Modes only turn Ask into Allow (a static allow or deny wins), except
/// `plan`, which also denies what would be allowed for a mutating tool, and
/// `bypassPermissions`, which allows every call no deny rule names: a deny rule (`--deny`,
/// settings) is what the user says must never run, so no mode lifts it (Claude Code's rule).
fn apply_mode(decision: Decision, mode: Mode, call: &Subject<'_>) -> Decision {
    let allow = |reason: String| Decision {
        action: Action::Allow,
        reason,
        matched: decision.matched.clone(),
    };
    match mode {
        Mode::Default => decision,
        Mode::BypassPermissions => match decision.action {
            Action::Allow | Action::Deny => decision,
            Action::Ask => allow("allowed: bypassPermissions mode".to_owned()),
        },
        Mode::AcceptEdits => {
            // Like Claude Code, only edits inside the workspace are accepted automatically.
            let in_workspace = || {
                first_arg(call.tool)
                    .filter(|field| field.kind == FieldKind::Path)
                    .and_then(|field| call.input.get(field.name))
                    .and_then(Value::as_str)
                    .is_some_and(|raw| path_view(call.workspace, call.base, raw).rel.is_some())
            };
            let edits = table::edits_files(call.tool);
            if decision.action == Action::Ask && edits && in_workspace() {
                allow("allowed: acceptEdits mode accepts file edits in the workspace".to_owned())
            } else {
                decision
            }
        }
        // Upstream's `dontAsk` turns Ask into Allow, and we follow upstream. Note that Claude
        // Code's `dontAsk` means the opposite ("don't ask: deny anything not pre-approved");
        // drivers porting Claude Code settings should use `default` with no one to ask.
        Mode::DontAsk => match decision.action {
            Action::Ask => allow("allowed: dontAsk mode".to_owned()),
            Action::Allow | Action::Deny => decision,
        },
        Mode::Plan => {
            let read_only = table::permission(call.tool)
                .is_some_and(|permission| permission.class == Class::ReadOnly);
            if read_only || decision.action == Action::Deny {
                decision
            } else {
                Decision {
                    action: Action::Deny,
                    reason: format!(
                        "plan mode is read-only: '{}' may not run until the mode changes",
                        call.tool
                    ),
                    matched: decision.matched,
                }
            }
        }
    }
}

/// A tool call prepared for matching: its Bash command split once, however many rules look.
struct Call<'a> {
    subject: Subject<'a>,
    /// `Some` for a Bash call with a string `command`.
    command: Option<CommandView>,
}

struct CommandView {
    /// The command, trimmed.
    whole: String,
    /// The simple commands (and file redirections) it runs; `None` when it cannot be parsed.
    segments: Option<Vec<String>>,
}

impl<'a> Call<'a> {
    fn new(tool: &'a str, input: &'a Value, workspace: &'a str, base: &'a str) -> Call<'a> {
        let command = first_arg(tool)
            .filter(|field| field.kind == FieldKind::Command)
            .and_then(|field| input.get(field.name))
            .and_then(Value::as_str)
            .map(|command| CommandView {
                whole: command.trim().to_owned(),
                segments: split_command(command),
            });
        Call {
            subject: Subject {
                tool,
                input,
                workspace,
                base,
            },
            command,
        }
    }
}

/// Whether `rule` applies to `call`. For Bash rules that look at the command, a deny or ask
/// rule matches when the whole command or ANY piece of it matches, while an allow rule matches
/// only when it matches some piece and EVERY piece is allowed on its own (first match over
/// `rules`). So `Bash(git *)` does not allow `git status && rm -rf /`: the call falls through
/// to later rules, typically `Bash` → ask.
fn rule_matches(rule: &Rule, call: &Call<'_>, rules: &[Rule]) -> bool {
    if !rule.matcher.matches_tool(call.subject.tool) {
        return false;
    }
    if !rule.matcher.reads_command(call.subject.tool) {
        return simple_match(rule, call, None);
    }
    let Some(command) = &call.command else {
        return false;
    };
    match rule.action {
        Action::Deny | Action::Ask => {
            simple_match(rule, call, Some(&command.whole))
                || command
                    .segments
                    .iter()
                    .flatten()
                    .any(|segment| simple_match(rule, call, Some(segment)))
        }
        Action::Allow => match &command.segments {
            // An unparseable command cannot be shown safe piece by piece.
            None => false,
            Some(segments) if segments.len() > MAX_ALLOW_PIECES => false,
            Some(segments) => {
                segments
                    .iter()
                    .any(|segment| simple_match(rule, call, Some(segment)))
                    && segments
                        .iter()
                        .all(|segment| segment_allowed(rules, call, segment))
            }
        },
    }
}

/// First match over `rules` for one piece of a Bash command, treated as a command by itself.
fn segment_allowed(rules: &[Rule], call: &Call<'_>, segment: &str) -> bool {
    for rule in rules {
        if !rule.matcher.matches_tool(call.subject.tool) {
            continue;
        }
        let command = rule
            .matcher
            .reads_command(call.subject.tool)
            .then_some(segment);
        if simple_match(rule, call, command) {
            return rule.action == Action::Allow;
        }
    }
    false
}

/// Matches the argument part of `rule` (the tool part already matched). `command` stands in
/// for the Bash `command` field when a piece of the command is being judged.
fn simple_match(rule: &Rule, call: &Call<'_>, command: Option<&str>) -> bool {
    rule.matcher
        .matches_input(rule.action, &call.subject, command)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    pub(super) const WS: &str = "/home/u/proj";

    pub(super) fn rule(pattern: &str, action: Action) -> Rule {
        Rule::new(pattern, action, None, RuleSource::Project).expect("test pattern is valid")
    }

    fn policy(rules: Vec<Rule>, mode: Mode) -> Policy {
        Policy::new(rules, mode, PathBuf::from(WS))
    }

    pub(super) fn bash(command: &str) -> Value {
        json!({ "command": command })
    }

    pub(super) fn file(path: &str) -> Value {
        json!({ "path": path })
    }

    fn action(policy: &Policy, tool: &str, input: &Value) -> Action {
        policy.decide(tool, input).action
    }

    #[test]
    fn an_always_allow_never_overrides_a_configured_deny() {
        let mut p = policy(
            vec![rule("Bash(echo publish*)", Action::Deny)],
            Mode::Default,
        );
        p.with_session_rule(
            Rule::new("Bash(echo:*)", Action::Allow, None, RuleSource::Session).unwrap(),
        );
        assert_eq!(action(&p, "Bash", &bash("echo test")), Action::Allow);
        assert_eq!(action(&p, "Bash", &bash("echo publish-now")), Action::Deny);
        // A session deny outranks everything.
        p.with_session_rule(
            Rule::new("Bash(echo test*)", Action::Deny, None, RuleSource::Session).unwrap(),
        );
        assert_eq!(action(&p, "Bash", &bash("echo test")), Action::Deny);
    }

    #[test]
    fn suggested_rules_cover_each_command_word() {
        assert_eq!(
            suggested_rules("Bash", &bash("cd . && echo hi | grep h")),
            ["Bash(cd:*)", "Bash(echo:*)", "Bash(grep:*)"]
        );
        assert_eq!(
            suggested_rules("Bash", &bash("timeout 5 make")),
            ["Bash(timeout 5 make)"]
        );
        assert!(suggested_rules("Bash", &bash("echo 'unclosed")).is_empty());
        assert_eq!(suggested_rules("Write", &file("a/b.rs")), ["Write(a/b.rs)"]);
    }

    #[test]
    fn an_empty_path_is_suggested_as_the_workspace_root_it_means() {
        // Found by fuzz/permission_pattern: the suggestion was `Edit()`, which is no pattern,
        // so an editor's "always allow" was offered and then silently dropped.
        assert_eq!(suggested_rules("Edit", &file("")), ["Edit(.)"]);
        let p = policy(vec![rule("Edit(.)", Action::Allow)], Mode::Default);
        assert_eq!(action(&p, "Edit", &file("")), Action::Allow);
        assert_eq!(action(&p, "Edit", &file("a.rs")), Action::Ask);
    }

    #[test]
    fn a_suggested_rule_for_a_leading_tilde_means_the_literal_tilde() {
        // Found by fuzz/permission_pattern: `Glob(~h:…)` was refused as a home path, and for
        // Bash `Bash(~/bin/x:*)` read as the anywhere form `*/bin/x:**`, which does not
        // even match the command it was suggested for.
        for (tool, input, want) in [
            ("Glob", file("~h:*Bah:~"), r"Glob(\~h:\*Bah:~)"),
            ("Read", file("~/.bashrc"), r"Read(\~/.bashrc)"),
            ("Bash", bash("~/bin/x --flag"), r"Bash(\~/bin/x:*)"),
        ] {
            assert_eq!(suggested_rules(tool, &input), [want]);
            let p = policy(vec![rule(want, Action::Allow)], Mode::Default);
            assert_eq!(action(&p, tool, &input), Action::Allow, "{want}");
        }
        // Only where the grammar reads it: a `~` further in stays as it is.
        assert_eq!(suggested_rules("Read", &file("a~b")), ["Read(a~b)"]);
    }

    #[test]
    fn a_suggested_rule_is_never_read_as_the_key_form() {
        // Found by fuzz/permission_pattern: `Edit(c=argo t(est)` read as `Edit:c=<glob>`, a
        // rule on a field `c` that no call has, so "always allow" never allowed the call.
        for (tool, input) in [
            ("Edit", file("c=argo t(est 2~&1 | git apply")),
            ("Read", file("a.b=c,d=e")),
            ("WebFetch", json!({"url": "x=y://host/page"})),
        ] {
            let suggested = suggested_rules(tool, &input);
            assert_eq!(suggested.len(), 1);
            let p = policy(vec![rule(&suggested[0], Action::Allow)], Mode::Default);
            assert_eq!(action(&p, tool, &input), Action::Allow, "{suggested:?}");
        }
    }

    #[test]
    fn a_run_in_a_subdirectory_is_judged_from_its_cwd() {
        let p = policy(
            vec![
                rule("Edit(pkg/secret/**)", Action::Deny),
                rule("Edit", Action::Allow),
            ],
            Mode::Default,
        )
        .with_cwd(Path::new("/home/u/proj/pkg"));
        // The tool resolves `secret/key` against pkg/, so the deny rule must see it there.
        assert_eq!(action(&p, "Edit", &file("secret/key")), Action::Deny);
        assert_eq!(action(&p, "Edit", &file("src/lib.rs")), Action::Allow);
        assert_eq!(
            action(&p, "Edit", &file("/home/u/proj/pkg/secret/k")),
            Action::Deny
        );
    }

    #[test]
    fn names_round_trip() {
        for action in [Action::Allow, Action::Ask, Action::Deny] {
            assert_eq!(Action::parse(action.as_str()), Some(action));
        }
        for mode in Mode::ALL {
            assert_eq!(Mode::parse(mode.as_str()), Some(mode));
        }
        assert_eq!(Mode::parse("acceptEdits"), Some(Mode::AcceptEdits));
        assert_eq!(Mode::parse("accept_edits"), None);
        assert_eq!(Mode::parse("auto"), None);
        assert_eq!(Action::parse("Allow"), None);
        assert_eq!(RuleSource::Cli.as_str(), "cli");
    }

    #[test]
    fn defaults() {
        let policy = policy(Vec::new(), Mode::Default);
        assert_eq!(action(&policy, "Read", &file("src/main.rs")), Action::Allow);
        assert_eq!(
            action(&policy, "Grep", &json!({"pattern": "x"})),
            Action::Allow
        );
        assert_eq!(
            action(&policy, "Glob", &json!({"pattern": "x"})),
            Action::Allow
        );
        assert_eq!(action(&policy, "TodoWrite", &json!({})), Action::Allow);
        assert_eq!(action(&policy, "Bash", &bash("ls")), Action::Ask);
        assert_eq!(action(&policy, "Write", &file("a")), Action::Ask);
        assert_eq!(action(&policy, "Edit", &file("a")), Action::Ask);
        assert_eq!(
            action(&policy, "WebFetch", &json!({"url": "https://x"})),
            Action::Ask
        );
        assert_eq!(action(&policy, "MultiEdit", &file("a")), Action::Ask);
        let decision = policy.decide("mcp__x__y", &json!({}));
        assert_eq!(decision.action, Action::Ask);
        assert_eq!(decision.matched.as_deref(), Some("*"));
        assert_eq!(policy.rules().len(), default_rules().len());
    }

    #[test]
    fn no_match_denies() {
        let rules = vec![rule("Read", Action::Allow)];
        let input = bash("ls");
        let call = Call::new("Bash", &input, WS, WS);
        let decision = decide_with(&rules, Mode::Default, &call);
        assert_eq!(
            decision,
            Decision {
                action: Action::Deny,
                reason: "permission denied for tool 'Bash'".to_owned(),
                matched: None,
            }
        );
    }

    #[test]
    fn a_deny_rule_anywhere_beats_an_earlier_allow() {
        let project = |p: &str, a| Rule::new(p, a, None, RuleSource::Project).unwrap();
        let user = |p: &str, a| Rule::new(p, a, None, RuleSource::User).unwrap();
        let policy = Policy::new(
            vec![
                project("Bash", Action::Allow),
                project("WebFetch", Action::Ask),
                user("Bash(rm:*)", Action::Deny),
                user("WebFetch(domain:localhost)", Action::Deny),
            ],
            Mode::Default,
            PathBuf::from(WS),
        );
        assert_eq!(action(&policy, "Bash", &bash("ls")), Action::Allow);
        assert_eq!(action(&policy, "Bash", &bash("rm -rf x")), Action::Deny);
        assert_eq!(action(&policy, "Bash", &bash("ls && rm x")), Action::Deny);
        let fetch = json!({"url": "http://127.1/"});
        assert_eq!(action(&policy, "WebFetch", &fetch), Action::Deny);
    }

    #[test]
    fn first_match_wins() {
        let policy = policy(
            vec![
                rule("Bash(git push:*)", Action::Deny),
                rule("Bash(git *)", Action::Allow),
                rule("Read(secrets/**)", Action::Deny),
            ],
            Mode::Default,
        );
        assert_eq!(action(&policy, "Bash", &bash("git status")), Action::Allow);
        assert_eq!(
            action(&policy, "Bash", &bash("git push origin")),
            Action::Deny
        );
        assert_eq!(action(&policy, "Bash", &bash("ls")), Action::Ask);
        assert_eq!(action(&policy, "Read", &file("secrets/key")), Action::Deny);
        assert_eq!(action(&policy, "Read", &file("src/key")), Action::Allow);

        let reasons = Policy::new(
            vec![
                Rule::new(
                    "Bash(rm *)",
                    Action::Deny,
                    Some("no deleting".into()),
                    RuleSource::User,
                )
                .unwrap(),
            ],
            Mode::Default,
            PathBuf::from(WS),
        );
        let decision = reasons.decide("Bash", &bash("rm x"));
        assert_eq!(decision.reason, "no deleting");
        assert_eq!(decision.matched.as_deref(), Some("Bash(rm *)"));
        let decision = reasons.decide("Write", &file("x"));
        assert_eq!(decision.reason, "'Write' requires approval (rule 'Write')");
    }

    #[test]
    fn session_allows_outrank_asks_but_not_configured_denies() {
        let mut policy = policy(vec![rule("Bash(rm:*)", Action::Deny)], Mode::Default);
        policy.with_session_rule(
            Rule::new("Bash(ls)", Action::Allow, None, RuleSource::Session).unwrap(),
        );
        // The built-in `Bash` ask is what the editor's answer silences.
        assert_eq!(action(&policy, "Bash", &bash("ls")), Action::Allow);
        assert_eq!(action(&policy, "Bash", &bash("ls -la")), Action::Ask);
        assert_eq!(policy.rules()[0].source, RuleSource::Project);
        assert_eq!(policy.rules()[1].source, RuleSource::Session);
        let mut denied = self::policy(vec![rule("Bash", Action::Deny)], Mode::Default);
        denied.with_session_rule(
            Rule::new("Bash(ls)", Action::Allow, None, RuleSource::Session).unwrap(),
        );
        assert_eq!(action(&denied, "Bash", &bash("ls")), Action::Deny);
    }

    #[test]
    fn escapes_never_match_allow_rules() {
        let policy = policy(
            vec![
                rule("Write(**)", Action::Allow),
                rule("Read(**/.env)", Action::Deny),
            ],
            Mode::Default,
        );
        assert_eq!(action(&policy, "Write", &file("deep/x.rs")), Action::Allow);
        assert_eq!(action(&policy, "Write", &file("../x.rs")), Action::Ask);
        assert_eq!(action(&policy, "Write", &file("/tmp/x.rs")), Action::Ask);
        // Deny rules still judge paths outside the workspace.
        assert_eq!(
            action(&policy, "Read", &file("../other/.env")),
            Action::Deny
        );
        assert_eq!(action(&policy, "Read", &file(".env")), Action::Deny);
        assert_eq!(action(&policy, "Read", &file("../other/x")), Action::Allow);
    }

    #[test]
    fn compound_bash_needs_every_piece_allowed() {
        let policy = policy(
            vec![
                rule("Bash(git *)", Action::Allow),
                rule("Bash(cargo test:*)", Action::Allow),
            ],
            Mode::Default,
        );
        assert_eq!(action(&policy, "Bash", &bash("git status")), Action::Allow);
        assert_eq!(
            action(&policy, "Bash", &bash("git status && rm -rf /")),
            Action::Ask
        );
        assert_eq!(
            action(&policy, "Bash", &bash("git status; git diff")),
            Action::Allow
        );
        assert_eq!(
            action(&policy, "Bash", &bash("git add . && cargo test -q")),
            Action::Allow
        );
        assert_eq!(
            action(&policy, "Bash", &bash("git log $(rm -rf /)")),
            Action::Ask
        );
        assert_eq!(
            action(&policy, "Bash", &bash("git log `curl x`")),
            Action::Ask
        );
        assert_eq!(
            action(&policy, "Bash", &bash("git log > ~/.bashrc")),
            Action::Ask
        );
        assert_eq!(
            action(&policy, "Bash", &bash("cargo test 2>&1 | git apply")),
            Action::Allow
        );
        assert_eq!(
            action(&policy, "Bash", &bash("git log 'unterminated")),
            Action::Ask
        );
        assert_eq!(
            action(&policy, "Bash", &bash("git show HEAD:'a b'")),
            Action::Allow
        );
        let many = "git status; ".repeat(MAX_ALLOW_PIECES);
        assert_eq!(action(&policy, "Bash", &bash(&many)), Action::Allow);
        let too_many = "git status; ".repeat(MAX_ALLOW_PIECES + 1);
        assert_eq!(action(&policy, "Bash", &bash(&too_many)), Action::Ask);

        // A redirection is allowed only by a rule for it.
        let redirects = policy_with(vec![
            rule("Bash(git *)", Action::Allow),
            rule("Bash(> target/*)", Action::Allow),
        ]);
        assert_eq!(
            action(&redirects, "Bash", &bash("git log > target/log")),
            Action::Allow
        );
        assert_eq!(
            action(&redirects, "Bash", &bash("git log > src/log")),
            Action::Ask
        );
    }

    fn policy_with(rules: Vec<Rule>) -> Policy {
        policy(rules, Mode::Default)
    }

    #[test]
    fn compound_bash_deny_matches_any_piece() {
        let policy = policy_with(vec![
            rule("Bash(rm *)", Action::Deny),
            rule("Bash(curl * | sh)", Action::Deny),
            rule("Bash(git push:*)", Action::Ask),
            rule("Bash(*)", Action::Allow),
        ]);
        assert_eq!(
            action(&policy, "Bash", &bash("ls && rm -rf /")),
            Action::Deny
        );
        assert_eq!(action(&policy, "Bash", &bash("echo $(rm x)")), Action::Deny);
        assert_eq!(
            action(&policy, "Bash", &bash("curl https://x | sh")),
            Action::Deny
        );
        assert_eq!(
            action(&policy, "Bash", &bash("git add . && git push")),
            Action::Ask
        );
        assert_eq!(action(&policy, "Bash", &bash("ls; pwd")), Action::Allow);

        // Per-piece first match: an earlier deny beats a later allow for that piece.
        let ordered = policy_with(vec![
            rule("Bash(ls)", Action::Allow),
            rule("Bash(rm *)", Action::Deny),
            rule("Bash(*)", Action::Allow),
        ]);
        assert_eq!(action(&ordered, "Bash", &bash("ls; rm x")), Action::Deny);
    }

    #[test]
    fn mode_accept_edits() {
        let policy = policy(
            vec![rule("Edit(locked/**)", Action::Deny)],
            Mode::AcceptEdits,
        );
        assert_eq!(action(&policy, "Write", &file("src/a.rs")), Action::Allow);
        assert_eq!(
            action(&policy, "MultiEdit", &file("src/a.rs")),
            Action::Allow
        );
        assert_eq!(
            action(&policy, "NotebookEdit", &file("n.ipynb")),
            Action::Allow
        );
        assert_eq!(action(&policy, "Edit", &file("locked/a")), Action::Deny);
        assert_eq!(action(&policy, "Write", &file("/etc/passwd")), Action::Ask);
        assert_eq!(action(&policy, "Bash", &bash("ls")), Action::Ask);
    }

    #[test]
    fn protected_paths_ask_in_every_mode_but_bypass() {
        let spellings = [
            ".git/config",
            "./.git/config",
            "sub/../.git/config",
            ".GIT/config",
            ".git/hooks/pre-commit",
            "/home/u/proj/.git/config",
            "vendor/lib/.git/config",
            ".caliban/settings.json",
            ".caliban/settings.local.json",
            ".claude/settings.json",
            ".mcp.json",
            ".envrc",
            ".vscode/tasks.json",
            ".vscode/settings.json",
        ];
        let allowing = vec![
            rule("Write", Action::Allow),
            rule("Edit(**)", Action::Allow),
            rule("MultiEdit", Action::Allow),
        ];
        for mode in [Mode::Default, Mode::AcceptEdits, Mode::DontAsk] {
            let policy = policy(allowing.clone(), mode);
            for path in spellings {
                for tool in ["Write", "Edit", "MultiEdit"] {
                    let decision = policy.decide(tool, &file(path));
                    assert_eq!(decision.action, Action::Ask, "{tool} {path} in {mode}");
                    assert!(
                        decision.reason.contains("is protected")
                            && decision.reason.contains("bypassPermissions"),
                        "{}",
                        decision.reason
                    );
                }
            }
            // Ordinary files, and reading protected ones, are unchanged.
            assert_eq!(action(&policy, "Write", &file("src/a.rs")), Action::Allow);
            assert_eq!(action(&policy, "Read", &file(".git/config")), Action::Allow);
            assert_eq!(action(&policy, "Write", &file(".gitignore")), Action::Allow);
        }
        let decision = policy(Vec::new(), Mode::AcceptEdits).decide("Write", &file(".git/config"));
        assert_eq!(
            decision.reason,
            "'Write' asks before editing `.git/config`: .git/ is protected (git's config and \
             hooks: a `core.fsmonitor`, `core.pager`, alias or hook there runs any command the \
             next time an allowed git command runs); only bypassPermissions mode edits it \
             without asking"
        );

        // An explicit deny still denies; plan mode still denies; bypass allows.
        let denied = policy(vec![rule("Write(.git/**)", Action::Deny)], Mode::DontAsk);
        assert_eq!(action(&denied, "Write", &file(".git/config")), Action::Deny);
        let planned = policy(allowing.clone(), Mode::Plan);
        assert_eq!(
            action(&planned, "Write", &file(".git/config")),
            Action::Deny
        );
        let bypass = policy(Vec::new(), Mode::BypassPermissions);
        assert_eq!(
            action(&bypass, "Write", &file(".git/config")),
            Action::Allow
        );

        // An editor's "always allow" for the exact file does not silence it either.
        let mut session = policy(Vec::new(), Mode::Default);
        session.with_session_rule(
            Rule::new(
                "Write(.git/config)",
                Action::Allow,
                None,
                RuleSource::Session,
            )
            .unwrap(),
        );
        assert_eq!(action(&session, "Write", &file(".git/config")), Action::Ask);

        // A narrowing profile asking for bypass cannot lift it.
        let narrowed = policy(allowing.clone(), Mode::AcceptEdits)
            .narrowed(Vec::new(), Some(Mode::BypassPermissions));
        assert_eq!(
            action(&narrowed, "Write", &file(".git/config")),
            Action::Ask
        );

        // Another repository an absolute allow rule reaches is judged from the root.
        let elsewhere = policy(
            vec![rule("Write(/srv/repo/**)", Action::Allow)],
            Mode::Default,
        );
        assert_eq!(
            action(&elsewhere, "Write", &file("/srv/repo/x")),
            Action::Allow
        );
        assert_eq!(
            action(&elsewhere, "Write", &file("/srv/repo/.git/config")),
            Action::Ask
        );

        // A run in a subdirectory names the workspace's `.git` through `..`.
        let sub = policy(allowing, Mode::AcceptEdits).with_cwd(Path::new("/home/u/proj/pkg"));
        assert_eq!(action(&sub, "Edit", &file("../.git/config")), Action::Ask);
        assert_eq!(action(&sub, "Edit", &file("src/a.rs")), Action::Allow);
    }

    #[test]
    fn print_mode_names_the_one_way_to_edit_a_protected_path() {
        let policy = policy(Vec::new(), Mode::AcceptEdits);
        let message = policy.ask_denied_message("Write", &file(".caliban/settings.json"));
        assert!(
            message.starts_with(
                "permission denied: `.caliban/settings.json` is protected (caliban's project \
                 settings"
            ) && message
                .ends_with("only --permission-mode bypassPermissions edits it without asking"),
            "{message}"
        );
        assert_eq!(
            policy.ask_denied_message("Bash", &bash("ls")),
            ask_denied_message("Bash", &bash("ls"))
        );
    }

    #[test]
    fn mode_dont_ask_follows_upstream() {
        let policy = policy(vec![rule("Bash(rm *)", Action::Deny)], Mode::DontAsk);
        assert_eq!(action(&policy, "Bash", &bash("ls")), Action::Allow);
        assert_eq!(action(&policy, "mcp__x__y", &json!({})), Action::Allow);
        assert_eq!(action(&policy, "Bash", &bash("rm x")), Action::Deny);
    }

    #[test]
    fn mode_plan_is_read_only() {
        let policy = policy(
            vec![
                rule("Bash(ls)", Action::Allow),
                rule("Read(secret)", Action::Deny),
            ],
            Mode::Plan,
        );
        let decision = policy.decide("Bash", &bash("ls"));
        assert_eq!(decision.action, Action::Deny);
        assert_eq!(
            decision.reason,
            "plan mode is read-only: 'Bash' may not run until the mode changes"
        );
        assert_eq!(action(&policy, "Write", &file("a")), Action::Deny);
        assert_eq!(action(&policy, "mcp__x__y", &json!({})), Action::Deny);
        assert_eq!(action(&policy, "Read", &file("a")), Action::Allow);
        assert_eq!(
            action(&policy, "Grep", &json!({"pattern": "x"})),
            Action::Allow
        );
        assert_eq!(action(&policy, "Read", &file("secret")), Action::Deny);
        assert_eq!(action(&policy, "ExitPlanMode", &json!({})), Action::Ask);
    }

    #[test]
    fn mode_bypass_allows_everything_but_what_a_deny_rule_names() {
        let mut policy = policy(
            vec![
                rule("Bash(rm *)", Action::Deny),
                rule("WebFetch", Action::Deny),
            ],
            Mode::Default,
        );
        assert_eq!(policy.mode(), Mode::Default);
        policy.set_mode(Mode::BypassPermissions);
        assert_eq!(policy.mode(), Mode::BypassPermissions);
        let decision = policy.decide("Bash", &bash("rm x"));
        assert_eq!(decision.action, Action::Deny);
        assert_eq!(decision.matched.as_deref(), Some("Bash(rm *)"));
        let fetch = json!({"url": "https://example.com/"});
        assert_eq!(action(&policy, "WebFetch", &fetch), Action::Deny);
        assert_eq!(action(&policy, "Bash", &bash("ls")), Action::Allow);
        assert_eq!(action(&policy, "Write", &file("/etc/x")), Action::Allow);
        // A deny in a narrowing profile holds in bypass too.
        let narrowed = policy.narrowed(vec![rule("Bash", Action::Deny)], None);
        assert_eq!(action(&narrowed, "Bash", &bash("ls")), Action::Deny);
    }

    #[test]
    fn narrowing_never_widens() {
        let base = policy_with(vec![
            rule("Bash(git *)", Action::Allow),
            rule("Read(.env)", Action::Deny),
        ]);
        let calls = [
            ("Bash", bash("git status")),
            ("Bash", bash("rm -rf /")),
            ("Read", file(".env")),
            ("Read", file("src/a.rs")),
            ("Write", file("a")),
            ("mcp__x__y", json!({})),
        ];
        let profiles = [
            (
                vec![rule("*", Action::Allow)],
                Some(Mode::BypassPermissions),
            ),
            (Vec::new(), Some(Mode::DontAsk)),
            (Vec::new(), Some(Mode::AcceptEdits)),
            (
                vec![rule("Bash", Action::Allow), rule("Read", Action::Allow)],
                None,
            ),
            (vec![rule("Bash", Action::Deny)], None),
            (Vec::new(), Some(Mode::Plan)),
        ];
        for (rules, mode) in profiles {
            let narrowed = base.narrowed(rules, mode);
            for (tool, input) in &calls {
                let before = base.decide(tool, input).action.strictness();
                let after = narrowed.decide(tool, input).action.strictness();
                assert!(after >= before, "{tool} {input} widened under {mode:?}");
            }
        }
    }

    #[test]
    fn narrowing_narrows() {
        let base = policy(
            vec![rule("Bash(cargo *)", Action::Allow)],
            Mode::AcceptEdits,
        );
        let run = base.narrowed(
            vec![
                rule("Bash(cargo publish:*)", Action::Deny),
                rule("Write", Action::Ask),
            ],
            None,
        );
        assert_eq!(action(&run, "Bash", &bash("cargo build")), Action::Allow);
        let decision = run.decide("Bash", &bash("cargo publish"));
        assert_eq!(decision.action, Action::Deny);
        assert_eq!(decision.matched.as_deref(), Some("Bash(cargo publish:*)"));
        // `None` follows the base mode: acceptEdits turns the profile's Write ask into allow.
        assert_eq!(action(&run, "Write", &file("a")), Action::Allow);

        let planned = run.narrowed(Vec::new(), Some(Mode::Plan));
        assert_eq!(action(&planned, "Bash", &bash("cargo build")), Action::Deny);
        assert_eq!(action(&planned, "Read", &file("a")), Action::Allow);

        // Widening the base later cannot lift a profile's restriction.
        let mut widened = planned.clone();
        widened.set_mode(Mode::BypassPermissions);
        widened.with_session_rule(
            Rule::new("Bash", Action::Allow, None, RuleSource::Session).unwrap(),
        );
        assert_eq!(
            action(&widened, "Bash", &bash("cargo publish")),
            Action::Deny
        );
        assert_eq!(action(&widened, "Write", &file("a")), Action::Deny);
    }

    #[test]
    fn print_mode_message() {
        assert_eq!(
            ask_denied_message("Bash", &bash("cargo test --all")),
            "permission denied: 'Bash' requires approval and no one can be asked in print mode; \
             allow it with --allow 'Bash(cargo:*)' (or --allow Bash), a settings rule, or \
             --permission-mode dontAsk|bypassPermissions"
        );
        let message = ask_denied_message("Write", &file("src/a b.rs"));
        assert!(
            message.contains("--allow 'Write(src/a b.rs)' (or --allow Write)"),
            "{message}"
        );
        assert!(message.ends_with("--permission-mode acceptEdits|bypassPermissions"));
        let message = ask_denied_message("WebFetch", &json!({"url": "https://docs.rs/x?y"}));
        assert!(
            message.contains("--allow 'WebFetch(https://docs.rs/*)'"),
            "{message}"
        );
        let message = ask_denied_message("mcp__a__b", &json!({}));
        assert!(
            message.contains("allow it with --allow mcp__a__b, a settings rule"),
            "{message}"
        );
        // Every suggestion is a valid pattern that allows the call it was made for.
        for (tool, input) in [
            ("Bash", bash("a[b]* c")),
            ("Write", file("a*b")),
            ("Read", file("x")),
        ] {
            let pattern = suggested_pattern(tool, &input).unwrap();
            let policy = policy_with(vec![
                Rule::new(&pattern, Action::Allow, None, RuleSource::Cli).unwrap(),
            ]);
            assert_eq!(action(&policy, tool, &input), Action::Allow, "{pattern}");
        }
    }
}
