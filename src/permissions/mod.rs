//! Permission policy (Permissions v2): ordered `allow | ask | deny` rules where the first match
//! wins, a permission-mode post-pass, and per-run profiles that can only narrow. Pure policy:
//! this module does no I/O and must not know where rules come from (settings files, the CLI,
//! an editor's "always allow"), how an Ask is answered, or how tools run. Paths are judged
//! lexically against the workspace; resolving symlinks is the tool layer's job.
//!
//! Pattern grammar (our superset of upstream's):
//! - `Tool` (a glob over the tool name, e.g. `mcp__github__*`), and `*` for every tool;
//! - `Tool:<glob>` or `Tool(<glob>)` on the tool's first-argument field (`first_arg`);
//! - `Bash(cargo test:*)`: Claude Code's prefix form, `cargo test` alone or followed by a space;
//! - `Bash:~<glob>`: the glob anywhere in the command;
//! - `Tool:key=<glob>[,key2=<glob2>]`: dotted keys into the input, all of which must match.

use std::borrow::Cow;
use std::fmt;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::glob::{Glob, GlobError, GlobOptions};

/// Globs over commands, URLs and tool names: `*` crosses `/`.
const TEXT: GlobOptions = GlobOptions {
    literal_separator: false,
};

/// Globs over workspace paths: `*` stays within one component and `**` crosses directories.
const PATHS: GlobOptions = GlobOptions {
    literal_separator: true,
};

/// Tools whose `path` names a file they change; `acceptEdits` auto-approves these.
const EDIT_TOOLS: [&str; 4] = ["Write", "Edit", "MultiEdit", "NotebookEdit"];

/// Tools that keep their static decision in plan mode. Besides the read-only file tools this
/// holds `TodoWrite` (planning bookkeeping) and the plan-mode tools, since a plan-mode session
/// with no way to propose leaving it would be a trap.
const PLAN_MODE_TOOLS: [&str; 6] = [
    "Read",
    "Grep",
    "Glob",
    "TodoWrite",
    "EnterPlanMode",
    "ExitPlanMode",
];

/// Most pieces a Bash command may have and still be allowed by allow rules. Each piece is
/// checked against every rule, so this bounds the work a huge generated command costs; past
/// it, allow rules stop matching (the call asks) while deny and ask rules still see every piece.
const MAX_ALLOW_PIECES: usize = 256;

/// Most levels of `$(…)`, backticks and `( … )` the Bash splitter follows. Deeper commands are
/// treated as unparseable, which no allow rule matches.
const MAX_SHELL_NESTING: usize = 16;

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

/// A pattern that can never match what its author meant. Callers drop the rule with a warning
/// (settings) or refuse to start (CLI): a rule silently matching nothing would fail open for
/// deny rules, so it is never kept.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PatternError {
    Empty,
    EmptyTool {
        pattern: String,
    },
    UnclosedParen {
        pattern: String,
    },
    EmptyArgument {
        pattern: String,
    },
    /// `Tool:<glob>` for a tool that has no first-argument field (see `first_arg`).
    NoArgument {
        pattern: String,
        tool: String,
    },
    /// A file-tool pattern starting with `~`: there is no home directory in a pure policy.
    HomePath {
        pattern: String,
    },
    Glob {
        pattern: String,
        error: GlobError,
    },
}

impl fmt::Display for PatternError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PatternError::Empty => f.write_str("empty permission pattern"),
            PatternError::EmptyTool { pattern } => {
                write!(
                    f,
                    "invalid permission pattern '{pattern}': missing tool name"
                )
            }
            PatternError::UnclosedParen { pattern } => write!(
                f,
                "invalid permission pattern '{pattern}': '(' is not closed by a ')' at the end"
            ),
            PatternError::EmptyArgument { pattern } => {
                write!(
                    f,
                    "invalid permission pattern '{pattern}': empty argument pattern"
                )
            }
            PatternError::NoArgument { pattern, tool } => write!(
                f,
                "invalid permission pattern '{pattern}': tool '{tool}' has no argument to \
                 match; use '{tool}' or '{tool}:key=<glob>'"
            ),
            PatternError::HomePath { pattern } => write!(
                f,
                "invalid permission pattern '{pattern}': '~' is not expanded; use an absolute \
                 path"
            ),
            PatternError::Glob { pattern, error } => {
                write!(f, "invalid permission pattern '{pattern}': {error}")
            }
        }
    }
}

impl std::error::Error for PatternError {}

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

/// Built-in defaults, appended after every configured rule by `Policy::new`: the read-only
/// tools and `TodoWrite` run, everything else asks.
pub fn default_rules() -> Vec<Rule> {
    const DEFAULTS: [(&str, Action); 9] = [
        ("Read", Action::Allow),
        ("Grep", Action::Allow),
        ("Glob", Action::Allow),
        ("TodoWrite", Action::Allow),
        ("WebFetch", Action::Ask),
        ("Bash", Action::Ask),
        ("Write", Action::Ask),
        ("Edit", Action::Ask),
        ("*", Action::Ask),
    ];
    DEFAULTS
        .iter()
        .map(|&(pattern, action)| {
            Rule::new(pattern, action, None, RuleSource::Builtin)
                .expect("built-in permission patterns are valid")
        })
        .collect()
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
    workspace: PathBuf,
    /// `workspace` lexically normalised, as the `/`-joined string paths are compared against.
    workspace_str: String,
    /// Per-run narrowing profiles (`narrowed`); every one of them must agree.
    profiles: Vec<Profile>,
    /// Where the run's tools resolve relative paths (normalised), when it is a
    /// subdirectory of `workspace`; rules stay anchored at `workspace`.
    cwd_str: Option<String>,
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
            workspace,
            workspace_str,
            profiles: Vec::new(),
            cwd_str: None,
        }
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

    pub fn mode(&self) -> Mode {
        self.mode
    }

    pub fn set_mode(&mut self, mode: Mode) {
        self.mode = mode;
    }

    /// Every base rule in priority order, defaults last.
    pub fn rules(&self) -> &[Rule] {
        &self.rules
    }

    pub fn workspace(&self) -> &Path {
        &self.workspace
    }
}

/// The reply to an Ask that nobody can answer (print mode), with a concrete way to allow it.
pub fn ask_denied_message(tool: &str, input: &Value) -> String {
    let tool_arg = shell_quote(tool);
    let allow = match suggested_pattern(tool, input) {
        Some(pattern) => format!("--allow {} (or --allow {tool_arg})", shell_quote(&pattern)),
        None => format!("--allow {tool_arg}"),
    };
    // acceptEdits only helps the file-edit tools; for anything else the mode that turns this
    // Ask into an Allow is dontAsk.
    let modes = if EDIT_TOOLS.contains(&tool) {
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
    if tool != "Bash" {
        return suggested_pattern(tool, input).into_iter().collect();
    }
    let Some(command) = input.get("command").and_then(Value::as_str) else {
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
            format!("Bash({})", escape_glob(&words.join(" ")))
        } else {
            format!("Bash({}:*)", escape_glob(first))
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
        FieldKind::Path => Some(format!("{tool}({})", escape_glob(value))),
        FieldKind::Text => {
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

fn escape_glob(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for ch in text.chars() {
        if matches!(ch, '*' | '?' | '[' | ']' | '{' | '}' | '\\') {
            out.push('\\');
        }
        out.push(ch);
    }
    out
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

/// Static rules (first match wins; no match denies), then the mode post-pass.
fn decide_with(rules: &[Rule], mode: Mode, call: &Call<'_>) -> Decision {
    let decision = match rules.iter().find(|rule| rule_matches(rule, call, rules)) {
        Some(rule) => {
            let reason = match rule.action {
                Action::Allow => format!("allowed by rule '{}'", rule.pattern),
                Action::Ask => format!(
                    "'{}' requires approval (rule '{}')",
                    call.tool, rule.pattern
                ),
                Action::Deny => rule.reason.clone().unwrap_or_else(|| denied_for(call.tool)),
            };
            Decision {
                action: rule.action,
                reason,
                matched: Some(rule.pattern.clone()),
            }
        }
        None => Decision {
            action: Action::Deny,
            reason: denied_for(call.tool),
            matched: None,
        },
    };
    apply_mode(decision, mode, call)
}

fn denied_for(tool: &str) -> String {
    format!("permission denied for tool '{tool}'")
}

/// The mode post-pass. Modes only turn Ask into Allow (a static allow or deny wins), except
/// `plan`, which also denies what would be allowed for a mutating tool, and
/// `bypassPermissions`, which allows everything.
fn apply_mode(decision: Decision, mode: Mode, call: &Call<'_>) -> Decision {
    let allow = |reason: String| Decision {
        action: Action::Allow,
        reason,
        matched: decision.matched.clone(),
    };
    match mode {
        Mode::Default => decision,
        Mode::BypassPermissions => match decision.action {
            Action::Allow => decision,
            Action::Ask | Action::Deny => allow("allowed: bypassPermissions mode".to_owned()),
        },
        Mode::AcceptEdits => {
            // Like Claude Code, only edits inside the workspace are accepted automatically.
            let in_workspace = || {
                call.input
                    .get("path")
                    .and_then(Value::as_str)
                    .is_some_and(|raw| path_view(call.workspace, call.base, raw).rel.is_some())
            };
            if decision.action == Action::Ask && EDIT_TOOLS.contains(&call.tool) && in_workspace() {
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
            if PLAN_MODE_TOOLS.contains(&call.tool) || decision.action == Action::Deny {
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
    tool: &'a str,
    input: &'a Value,
    workspace: &'a str,
    /// What relative paths in the input are relative to (the run's cwd).
    base: &'a str,
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
        let command = match (tool, input.get("command")) {
            ("Bash", Some(Value::String(command))) => Some(CommandView {
                whole: command.trim().to_owned(),
                segments: split_command(command),
            }),
            _ => None,
        };
        Call {
            tool,
            input,
            workspace,
            base,
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
    if !rule.matcher.tool.is_match(call.tool) {
        return false;
    }
    if !rule.matcher.reads_command(call.tool) {
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
        if !rule.matcher.tool.is_match(call.tool) {
            continue;
        }
        let command = rule.matcher.reads_command(call.tool).then_some(segment);
        if simple_match(rule, call, command) {
            return rule.action == Action::Allow;
        }
    }
    false
}

/// Matches the argument part of `rule` (the tool part already matched). `command` stands in
/// for the Bash `command` field when a piece of the command is being judged.
fn simple_match(rule: &Rule, call: &Call<'_>, command: Option<&str>) -> bool {
    let matches = |pattern: &ArgPattern, kind: FieldKind, value: Option<Cow<'_, str>>| {
        value.is_some_and(|value| value_matches(pattern, kind, &value, call, rule.action))
    };
    match &rule.matcher.arg {
        ArgMatcher::Any => true,
        ArgMatcher::First(pattern) => match first_arg(call.tool) {
            Some(field) => matches(pattern, field.kind, field_text(field, call, command)),
            None => false,
        },
        ArgMatcher::Keys(keys) => keys.iter().all(|key| match first_arg(call.tool) {
            // `Write:path=…` means the same as `Write:…`, path normalisation included.
            Some(field) if field.name == key.key => {
                matches(&key.pattern, field.kind, field_text(field, call, command))
            }
            _ => {
                let value = lookup(call.input, &key.key).and_then(value_text);
                matches(&key.pattern, FieldKind::Text, value)
            }
        }),
    }
}

fn field_text<'c>(
    field: Field,
    call: &'c Call<'_>,
    command: Option<&'c str>,
) -> Option<Cow<'c, str>> {
    if field.kind == FieldKind::Command
        && let Some(command) = command
    {
        return Some(Cow::Borrowed(command));
    }
    match call.input.get(field.name) {
        Some(value) => value_text(value),
        None => field.default.map(Cow::Borrowed),
    }
}

fn value_matches(
    pattern: &ArgPattern,
    kind: FieldKind,
    value: &str,
    call: &Call<'_>,
    action: Action,
) -> bool {
    match (pattern, kind) {
        (ArgPattern::Glob { path, absolute, .. }, FieldKind::Path) => {
            let view = path_view(call.workspace, call.base, value);
            if *absolute {
                return path.is_match(&view.abs);
            }
            match &view.rel {
                Some(rel) => path.is_match(rel),
                // A path outside the workspace never matches a relative allow rule (so `../`
                // cannot escape through `Write(**)`), but deny and ask rules still judge it,
                // by its absolute path without the leading `/`: `Read(**/.env)` still asks
                // for `../other/.env`.
                None => action != Action::Allow && path.is_match(&view.abs[1..]),
            }
        }
        (ArgPattern::Glob { text, .. }, _) => text.is_match(value),
        (ArgPattern::Prefix(glob) | ArgPattern::Anywhere(glob), _) => glob.is_match(value),
    }
}

/// Strings, numbers and booleans can be matched; objects, arrays and null never match.
fn value_text(value: &Value) -> Option<Cow<'_, str>> {
    match value {
        Value::String(text) => Some(Cow::Borrowed(text)),
        Value::Number(number) => Some(Cow::Owned(number.to_string())),
        Value::Bool(flag) => Some(Cow::Owned(flag.to_string())),
        Value::Null | Value::Array(_) | Value::Object(_) => None,
    }
}

/// `a.b.0.c`: object keys, and array indices where the value is an array.
fn lookup<'v>(input: &'v Value, dotted: &str) -> Option<&'v Value> {
    dotted.split('.').try_fold(input, |value, key| match value {
        Value::Object(map) => map.get(key),
        Value::Array(items) => items.get(key.parse::<usize>().ok()?),
        _ => None,
    })
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FieldKind {
    /// Bash's `command`: split into pieces for allow rules.
    Command,
    /// A file path, normalised against the workspace.
    Path,
    /// Anything else, matched as text.
    Text,
}

#[derive(Clone, Copy, Debug)]
struct Field {
    name: &'static str,
    kind: FieldKind,
    /// The value when the input leaves the field out.
    default: Option<&'static str>,
}

/// The field `Tool:<glob>` matches. Tools not listed only match the bare-name and key forms.
fn first_arg(tool: &str) -> Option<Field> {
    let (name, kind, default) = match tool {
        "Bash" => ("command", FieldKind::Command, None),
        "Read" | "Write" | "Edit" | "MultiEdit" | "NotebookEdit" => ("path", FieldKind::Path, None),
        // The Glob and Grep patterns apply to the directory searched.
        "Glob" | "Grep" => ("path", FieldKind::Path, Some(".")),
        "WebFetch" => ("url", FieldKind::Text, None),
        _ => return None,
    };
    Some(Field {
        name,
        kind,
        default,
    })
}

/// A path judged against the workspace, after lexical normalisation.
struct PathView {
    /// Absolute, normalised: no `.`, `..` or repeated `/`.
    abs: String,
    /// Relative to the workspace (`.` for the workspace itself); `None` when outside it.
    rel: Option<String>,
}

fn path_view(workspace: &str, base: &str, raw: &str) -> PathView {
    let raw = if raw.is_empty() { "." } else { raw };
    let abs = if raw.starts_with('/') {
        normalize_abs(raw)
    } else {
        normalize_abs(&format!("{base}/{raw}"))
    };
    let rel = if abs == workspace {
        Some(".".to_owned())
    } else if workspace == "/" {
        Some(abs[1..].to_owned())
    } else {
        abs.strip_prefix(workspace)
            .and_then(|rest| rest.strip_prefix('/'))
            .map(str::to_owned)
    };
    PathView { abs, rel }
}

/// Lexical normalisation of an absolute path; `..` at the root stays at the root.
fn normalize_abs(path: &str) -> String {
    let mut parts: Vec<&str> = Vec::new();
    for component in path.split('/') {
        match component {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            _ => parts.push(component),
        }
    }
    format!("/{}", parts.join("/"))
}

/// A parsed rule pattern: a glob over the tool name and what to require of the input.
#[derive(Clone, Debug)]
struct Matcher {
    tool: Glob,
    arg: ArgMatcher,
}

#[derive(Clone, Debug)]
enum ArgMatcher {
    /// Bare `Tool`: every call.
    Any,
    /// `Tool:<glob>` / `Tool(<glob>)` on the tool's `first_arg` field.
    First(ArgPattern),
    /// `Tool:key=<glob>,…`, all of which must match.
    Keys(Vec<KeyPattern>),
}

#[derive(Clone, Debug)]
struct KeyPattern {
    key: String,
    pattern: ArgPattern,
}

#[derive(Clone, Debug)]
enum ArgPattern {
    /// A plain glob, compiled both ways since a tool-name glob such as `*` can reach a
    /// command (text) and a path alike.
    Glob {
        text: Glob,
        /// With a leading `./` removed; relative to the workspace unless `absolute`.
        path: Glob,
        absolute: bool,
    },
    /// `Bash(<prefix>:*)`, compiled as `<prefix>{, *}`.
    Prefix(Glob),
    /// `Bash:~<glob>`, compiled as `*<glob>*`.
    Anywhere(Glob),
}

impl Matcher {
    fn parse(pattern: &str) -> Result<Matcher, PatternError> {
        let trimmed = pattern.trim();
        if trimmed.is_empty() {
            return Err(PatternError::Empty);
        }
        let owned = || pattern.to_owned();
        let colon = trimmed.find(':');
        let paren = trimmed.find('(');
        // The paren form wins unless a `:` comes first (then the parens are literal text).
        let (tool, arg) = match paren {
            Some(open) if colon.is_none_or(|colon| open < colon) => {
                let Some(inner) = trimmed[open + 1..].strip_suffix(')') else {
                    return Err(PatternError::UnclosedParen { pattern: owned() });
                };
                (&trimmed[..open], Some(inner))
            }
            _ => match colon {
                Some(colon) => (&trimmed[..colon], Some(&trimmed[colon + 1..])),
                None => (trimmed, None),
            },
        };
        // Tool names never hold blanks, so `Bash (git *)` means `Bash(git *)`.
        let tool = tool.trim();
        if tool.is_empty() {
            return Err(PatternError::EmptyTool { pattern: owned() });
        }
        let tool_glob = compile(pattern, tool, TEXT)?;
        let Some(arg) = arg else {
            return Ok(Matcher {
                tool: tool_glob,
                arg: ArgMatcher::Any,
            });
        };
        if arg.is_empty() {
            return Err(PatternError::EmptyArgument { pattern: owned() });
        }
        if let Some(keys) = parse_keys(pattern, arg)? {
            return Ok(Matcher {
                tool: tool_glob,
                arg: ArgMatcher::Keys(keys),
            });
        }
        let literal_tool = !tool.contains(['*', '?', '[', '{', '\\']);
        let field = first_arg(tool);
        if literal_tool && field.is_none() {
            return Err(PatternError::NoArgument {
                pattern: owned(),
                tool: tool.to_owned(),
            });
        }
        if tool == "Bash" {
            if let Some(rest) = arg.strip_prefix('~') {
                if rest.is_empty() {
                    return Err(PatternError::EmptyArgument { pattern: owned() });
                }
                // Compile `rest` alone first so a dangling `\` is reported rather than
                // silently escaping the `*` we append.
                compile(pattern, rest, TEXT)?;
                let glob = compile(pattern, &format!("*{rest}*"), TEXT)?;
                return Ok(Matcher {
                    tool: tool_glob,
                    arg: ArgMatcher::First(ArgPattern::Anywhere(glob)),
                });
            }
            // Claude Code's `cargo test:*`: the prefix alone or followed by a space. `\:*`
            // (an escaped colon) keeps the glob meaning.
            if let Some(prefix) = arg.strip_suffix(":*")
                && !ends_in_escape(prefix)
            {
                if prefix.is_empty() {
                    return Err(PatternError::EmptyArgument { pattern: owned() });
                }
                compile(pattern, prefix, TEXT)?;
                let glob = compile(pattern, &format!("{prefix}{{, *}}"), TEXT)?;
                return Ok(Matcher {
                    tool: tool_glob,
                    arg: ArgMatcher::First(ArgPattern::Prefix(glob)),
                });
            }
        }
        if field.is_some_and(|field| field.kind == FieldKind::Path) && arg.starts_with('~') {
            return Err(PatternError::HomePath { pattern: owned() });
        }
        Ok(Matcher {
            tool: tool_glob,
            arg: ArgMatcher::First(plain_pattern(pattern, arg)?),
        })
    }

    /// Whether this rule looks at Bash's `command` when applied to `tool`.
    fn reads_command(&self, tool: &str) -> bool {
        tool == "Bash"
            && match &self.arg {
                ArgMatcher::Any => false,
                ArgMatcher::First(_) => true,
                ArgMatcher::Keys(keys) => keys.iter().any(|key| key.key == "command"),
            }
    }
}

fn compile(pattern: &str, glob: &str, opts: GlobOptions) -> Result<Glob, PatternError> {
    Glob::new(glob, opts).map_err(|error| PatternError::Glob {
        pattern: pattern.to_owned(),
        error,
    })
}

fn plain_pattern(pattern: &str, glob: &str) -> Result<ArgPattern, PatternError> {
    let mut relative = glob;
    while let Some(rest) = relative.strip_prefix("./") {
        relative = rest;
    }
    Ok(ArgPattern::Glob {
        text: compile(pattern, glob, TEXT)?,
        path: compile(pattern, relative, PATHS)?,
        absolute: glob.starts_with('/'),
    })
}

/// True when `text` ends in an odd number of backslashes, i.e. its last character is escaping
/// whatever follows.
fn ends_in_escape(text: &str) -> bool {
    text.chars().rev().take_while(|&c| c == '\\').count() % 2 == 1
}

/// `key=glob[,key=glob]…` with lowercase dotted keys, or `None` when `arg` is not in that form.
/// Keys must be lowercase so a command such as `FOO=1 make` stays a command glob.
fn parse_keys(pattern: &str, arg: &str) -> Result<Option<Vec<KeyPattern>>, PatternError> {
    let mut keys = Vec::new();
    for part in split_top_level_commas(arg) {
        let Some((key, glob)) = part.split_once('=') else {
            return Ok(None);
        };
        if !is_dotted_key(key) {
            return Ok(None);
        }
        if glob.is_empty() {
            return Err(PatternError::EmptyArgument {
                pattern: pattern.to_owned(),
            });
        }
        keys.push((key, glob));
    }
    keys.into_iter()
        .map(|(key, glob)| {
            Ok(KeyPattern {
                key: key.to_owned(),
                pattern: plain_pattern(pattern, glob)?,
            })
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

/// Splits on commas outside `[…]`, `{…}` and escapes, so `path={a,b}` stays whole.
fn split_top_level_commas(text: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let mut depth = 0usize;
    let mut in_class = false;
    let mut escaped = false;
    let mut start = 0;
    for (idx, ch) in text.char_indices() {
        if escaped {
            escaped = false;
            continue;
        }
        match ch {
            '\\' => escaped = true,
            '[' if !in_class => in_class = true,
            ']' if in_class => in_class = false,
            '{' if !in_class => depth += 1,
            '}' if !in_class => depth = depth.saturating_sub(1),
            ',' if !in_class && depth == 0 => {
                parts.push(&text[start..idx]);
                start = idx + 1;
            }
            _ => {}
        }
    }
    parts.push(&text[start..]);
    parts
}

fn is_dotted_key(key: &str) -> bool {
    let mut segments = key.split('.');
    let first_ok = segments.next().is_some_and(|first| {
        first
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_lowercase() || c == '_')
            && first.chars().all(is_key_char)
    });
    first_ok && segments.all(|segment| !segment.is_empty() && segment.chars().all(is_key_char))
}

fn is_key_char(ch: char) -> bool {
    ch.is_ascii_lowercase() || ch.is_ascii_digit() || ch == '_'
}

/// Splits a shell command into the pieces an allow rule must each cover: the simple commands
/// separated by unquoted `;`, `&&`, `||`, `|`, `&` and newlines (also inside `( … )`), the
/// commands inside `$(…)`, backticks and `<(…)`/`>(…)` (in addition to the command holding
/// them), and each file redirection as a piece of its own, such as `> out.txt`, so that
/// `Bash(git *)` does not allow `git log > ~/.bashrc`. Redirections that touch no file
/// (`2>&1`, `>/dev/null`, here-documents) are dropped. Returns `None` when the quoting or
/// nesting does not balance; callers then let no allow rule match.
///
/// This is a conservative reading, not a shell: anything it misreads becomes an extra piece,
/// which can only make an allow rule less likely to match. (A here-document's body lines, for
/// one, become pieces of their own.)
fn split_command(command: &str) -> Option<Vec<String>> {
    let chars: Vec<char> = command.chars().collect();
    let mut splitter = Splitter {
        chars: &chars,
        pos: 0,
        depth: 0,
        segments: Vec::new(),
        heredocs: Vec::new(),
    };
    splitter.list(false)?;
    Some(splitter.segments)
}

struct Splitter<'a> {
    chars: &'a [char],
    pos: usize,
    depth: usize,
    segments: Vec<String>,
    /// Here-documents whose bodies start at the next unquoted newline.
    heredocs: Vec<Heredoc>,
}

struct Heredoc {
    delimiter: String,
    /// `<<-` strips leading tabs from body lines and the delimiter line.
    strip_tabs: bool,
    /// A quoted delimiter (`<<'EOF'`) turns off expansion in the body.
    quoted: bool,
}

impl Splitter<'_> {
    fn peek(&self, offset: usize) -> Option<char> {
        self.chars.get(self.pos + offset).copied()
    }

    fn starts_with(&self, text: &str) -> bool {
        text.chars()
            .enumerate()
            .all(|(offset, ch)| self.peek(offset) == Some(ch))
    }

    /// Reads commands up to the end or, when `in_parens`, up to and including the matching
    /// `)`, pushing each finished simple command onto `segments`.
    fn list(&mut self, in_parens: bool) -> Option<()> {
        let mut current = String::new();
        loop {
            let Some(ch) = self.peek(0) else {
                self.finish(&mut current);
                // A here-document never closed would swallow the rest of the command.
                return (!in_parens && self.heredocs.is_empty()).then_some(());
            };
            match ch {
                '\\' | '\'' | '"' | '`' => self.quoted(&mut current)?,
                '$' if self.peek(1) == Some('\'') => self.quoted(&mut current)?,
                '$' | '<' | '>' if self.peek(1) == Some('(') => self.substitution(&mut current)?,
                // A comment hides quotes and separators from the shell, so it must hide them
                // from us too: `ls # '` would otherwise open a quote the shell never sees.
                '#' if at_word_start(&current) => {
                    while self.peek(0).is_some_and(|c| c != '\n') {
                        self.pos += 1;
                    }
                }
                '\n' => {
                    self.finish(&mut current);
                    self.pos += 1;
                    self.heredoc_bodies()?;
                }
                ')' => {
                    if !in_parens {
                        return None;
                    }
                    self.pos += 1;
                    self.finish(&mut current);
                    return Some(());
                }
                '(' => {
                    // A subshell: its commands are pieces like any other.
                    self.finish(&mut current);
                    self.pos += 1;
                    self.nested(|splitter| splitter.list(true))?;
                }
                '&' if self.peek(1) == Some('>') => self.redirect(&current)?,
                ';' | '&' | '|' => {
                    self.finish(&mut current);
                    self.pos += 1;
                }
                '<' | '>' => self.redirect(&current)?,
                _ if ch.is_ascii_digit() && at_word_start(&current) && self.fd_redirect() => {
                    self.redirect(&current)?
                }
                _ => {
                    current.push(ch);
                    self.pos += 1;
                }
            }
        }
    }

    fn finish(&mut self, current: &mut String) {
        let piece = current.trim();
        if !piece.is_empty() {
            self.segments.push(piece.to_owned());
        }
        current.clear();
    }

    /// Skips the bodies of the here-documents opened on the line just ended. A body is data,
    /// not commands, but with an unquoted delimiter the shell expands `$(…)` and backticks in
    /// it; rather than parse those, a body holding `$` or a backtick makes the command
    /// unparseable. A body that never reaches its delimiter does too.
    fn heredoc_bodies(&mut self) -> Option<()> {
        for heredoc in std::mem::take(&mut self.heredocs) {
            loop {
                let start = self.pos;
                if start >= self.chars.len() {
                    return None;
                }
                let len = self.chars[start..]
                    .iter()
                    .position(|&c| c == '\n')
                    .unwrap_or(self.chars.len() - start);
                let line = &self.chars[start..start + len];
                self.pos = (start + len + 1).min(self.chars.len());
                let trimmed = if heredoc.strip_tabs {
                    let tabs = line.iter().take_while(|&&c| c == '\t').count();
                    &line[tabs..]
                } else {
                    line
                };
                if trimmed.iter().copied().eq(heredoc.delimiter.chars()) {
                    break;
                }
                if !heredoc.quoted && line.iter().any(|&c| c == '$' || c == '`') {
                    return None;
                }
            }
        }
        Some(())
    }

    fn nested(&mut self, f: impl FnOnce(&mut Self) -> Option<()>) -> Option<()> {
        if self.depth >= MAX_SHELL_NESTING {
            return None;
        }
        self.depth += 1;
        let res = f(self);
        self.depth -= 1;
        res
    }

    /// Copies an escape, a quoted string or a backtick substitution into `out` as written,
    /// splitting any commands substituted inside it.
    fn quoted(&mut self, out: &mut String) -> Option<()> {
        match self.peek(0)? {
            '\\' => {
                out.push('\\');
                self.pos += 1;
                if let Some(next) = self.peek(0) {
                    out.push(next);
                    self.pos += 1;
                }
            }
            '$' if self.peek(1) == Some('\'') => {
                // ANSI-C quoting, `$'…'`: unlike plain single quotes, `\'` escapes a quote.
                out.push_str("$'");
                self.pos += 2;
                loop {
                    match self.peek(0)? {
                        '\\' => {
                            out.push('\\');
                            out.push(self.peek(1)?);
                            self.pos += 2;
                        }
                        '\'' => {
                            out.push('\'');
                            self.pos += 1;
                            break;
                        }
                        ch => {
                            out.push(ch);
                            self.pos += 1;
                        }
                    }
                }
            }
            '\'' => {
                // Nothing is special inside single quotes, not even `\`.
                let close = self.chars[self.pos + 1..].iter().position(|&c| c == '\'')?;
                let end = self.pos + 1 + close;
                out.extend(&self.chars[self.pos..=end]);
                self.pos = end + 1;
            }
            '"' => {
                out.push('"');
                self.pos += 1;
                loop {
                    match self.peek(0)? {
                        '"' => {
                            out.push('"');
                            self.pos += 1;
                            break;
                        }
                        '\\' | '`' => self.quoted(out)?,
                        '$' if self.peek(1) == Some('(') => self.substitution(out)?,
                        ch => {
                            out.push(ch);
                            self.pos += 1;
                        }
                    }
                }
            }
            '`' => {
                let start = self.pos;
                let mut end = start + 1;
                loop {
                    match self.chars.get(end)? {
                        '\\' => end += 2,
                        '`' => break,
                        _ => end += 1,
                    }
                }
                if self.depth >= MAX_SHELL_NESTING {
                    return None;
                }
                let chars = self.chars;
                let mut inner_splitter = Splitter {
                    chars: &chars[start + 1..end],
                    pos: 0,
                    depth: self.depth + 1,
                    segments: Vec::new(),
                    heredocs: Vec::new(),
                };
                inner_splitter.list(false)?;
                self.segments.extend(inner_splitter.segments);
                out.extend(&self.chars[start..=end]);
                self.pos = end + 1;
            }
            ch => {
                out.push(ch);
                self.pos += 1;
            }
        }
        Some(())
    }

    /// `$(…)`, `<(…)` or `>(…)`: the inner commands become pieces, and the text stays in `out`.
    fn substitution(&mut self, out: &mut String) -> Option<()> {
        let start = self.pos;
        self.pos += 2;
        self.nested(|splitter| splitter.list(true))?;
        out.extend(&self.chars[start..self.pos]);
        Some(())
    }

    /// At digits that open a redirection, as in `2>err.log` or `2>&1`.
    fn fd_redirect(&self) -> bool {
        let mut offset = 0;
        while self.peek(offset).is_some_and(|c| c.is_ascii_digit()) {
            offset += 1;
        }
        matches!(self.peek(offset), Some('<' | '>'))
    }

    /// A redirection: dropped when it touches no file, else pushed as a piece of its own.
    fn redirect(&mut self, current: &str) -> Option<()> {
        let mut op = String::new();
        while let Some(digit) = self.peek(0).filter(char::is_ascii_digit) {
            op.push(digit);
            self.pos += 1;
        }
        const OPERATORS: [&str; 12] = [
            "&>>", "&>", ">>", ">|", ">&", "<<<", "<<-", "<<", "<>", "<&", ">", "<",
        ];
        let operator = OPERATORS.into_iter().find(|op| self.starts_with(op))?;
        op.push_str(operator);
        self.pos += operator.chars().count();
        self.skip_blanks();
        let target = self.word()?;
        if target.is_empty() {
            return None;
        }
        if matches!(operator, "<<" | "<<-") {
            // The body starts after the next newline; `heredoc_bodies` skips it there.
            let quoted = target.contains(['\'', '"', '\\']);
            self.heredocs.push(Heredoc {
                delimiter: target
                    .chars()
                    .filter(|c| !matches!(c, '\'' | '"' | '\\'))
                    .collect(),
                strip_tabs: operator == "<<-",
                quoted,
            });
        }
        let harmless = match operator {
            // Here-documents and here-strings feed text to stdin; no file is involved.
            "<<" | "<<-" | "<<<" => true,
            // `2>&1`, `>&-`: duplicating or closing a descriptor. `>&file` writes a file.
            ">&" | "<&" => {
                let digits = target.strip_suffix('-').unwrap_or(&target);
                digits.chars().all(|c| c.is_ascii_digit())
            }
            _ => target == "/dev/null",
        };
        if !harmless {
            self.segments.push(format!("{op} {target}"));
        }
        if at_word_start(current) {
            self.skip_blanks();
        }
        Some(())
    }

    fn skip_blanks(&mut self) {
        while matches!(self.peek(0), Some(' ' | '\t')) {
            self.pos += 1;
        }
    }

    /// One shell word as written, quotes included, up to an unquoted blank or operator.
    fn word(&mut self) -> Option<String> {
        let mut word = String::new();
        while let Some(ch) = self.peek(0) {
            match ch {
                ' ' | '\t' | '\n' | ';' | '&' | '|' | '(' | ')' | '<' | '>' => break,
                '\\' | '\'' | '"' | '`' => self.quoted(&mut word)?,
                '$' if self.peek(1) == Some('\'') => self.quoted(&mut word)?,
                '$' if self.peek(1) == Some('(') => self.substitution(&mut word)?,
                _ => {
                    word.push(ch);
                    self.pos += 1;
                }
            }
        }
        Some(word)
    }
}

fn at_word_start(current: &str) -> bool {
    current.is_empty() || current.ends_with([' ', '\t'])
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const WS: &str = "/home/u/proj";

    fn rule(pattern: &str, action: Action) -> Rule {
        Rule::new(pattern, action, None, RuleSource::Project).expect("test pattern is valid")
    }

    fn policy(rules: Vec<Rule>, mode: Mode) -> Policy {
        Policy::new(rules, mode, PathBuf::from(WS))
    }

    fn bash(command: &str) -> Value {
        json!({ "command": command })
    }

    fn file(path: &str) -> Value {
        json!({ "path": path })
    }

    fn action(policy: &Policy, tool: &str, input: &Value) -> Action {
        policy.decide(tool, input).action
    }

    /// Whether a lone deny rule matches the call.
    fn matches(pattern: &str, tool: &str, input: &Value) -> bool {
        matches_as(Action::Deny, pattern, tool, input)
    }

    /// Whether a lone rule with `action` matches the call (nothing else in the list).
    fn matches_as(action: Action, pattern: &str, tool: &str, input: &Value) -> bool {
        let rules = vec![rule(pattern, action)];
        let call = Call::new(tool, input, WS, WS);
        rule_matches(&rules[0], &call, &rules)
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
    fn colon_and_paren_forms_are_equivalent() {
        for pattern in ["Bash:git *", "Bash(git *)"] {
            assert!(matches(pattern, "Bash", &bash("git status")), "{pattern}");
            assert!(!matches(pattern, "Bash", &bash("cargo test")), "{pattern}");
            assert!(!matches(pattern, "Read", &file("git x")), "{pattern}");
        }
        // A `:` before the first `(` selects the colon form; the parens are literal.
        assert!(matches("Bash:echo (hi)", "Bash", &bash("echo (hi)")));
        assert!(matches(" Bash (git *) ", "Bash", &bash("git log")));
        // In the paren form only the trailing `)` closes.
        assert!(matches("Bash(echo (a))", "Bash", &bash("echo (a)")));
    }

    #[test]
    fn tool_names_are_globs() {
        assert!(matches(
            "mcp__github__*",
            "mcp__github__create_issue",
            &json!({})
        ));
        assert!(!matches("mcp__github__*", "mcp__gitlab__x", &json!({})));
        assert!(matches("*", "Anything", &json!({})));
        assert!(matches("*:src/**", "Write", &file("src/a/b.rs")));
        assert!(matches("*:cargo *", "Bash", &bash("cargo build")));
        assert!(!matches("*:cargo *", "TodoWrite", &json!({})));
    }

    #[test]
    fn invalid_patterns_are_errors() {
        let err =
            |pattern: &str| Rule::new(pattern, Action::Allow, None, RuleSource::Cli).unwrap_err();
        assert_eq!(err(""), PatternError::Empty);
        assert!(matches!(
            err("Bash(git *"),
            PatternError::UnclosedParen { .. }
        ));
        assert!(matches!(err("Bash()"), PatternError::EmptyArgument { .. }));
        assert!(matches!(err("Bash:"), PatternError::EmptyArgument { .. }));
        assert!(matches!(
            err("Bash(:*)"),
            PatternError::EmptyArgument { .. }
        ));
        assert!(matches!(err("Bash:~"), PatternError::EmptyArgument { .. }));
        assert!(matches!(err("(x)"), PatternError::EmptyTool { .. }));
        assert!(matches!(err("Read([a-)"), PatternError::Glob { .. }));
        assert!(matches!(err("Bash:{a,b"), PatternError::Glob { .. }));
        assert!(matches!(
            err("Write:path="),
            PatternError::EmptyArgument { .. }
        ));
        assert!(matches!(
            err("TodoWrite:x"),
            PatternError::NoArgument { .. }
        ));
        assert!(matches!(
            err("Read(~/.ssh/*)"),
            PatternError::HomePath { .. }
        ));
        assert_eq!(
            err("Bash(git *").to_string(),
            "invalid permission pattern 'Bash(git *': '(' is not closed by a ')' at the end"
        );
        assert_eq!(
            err("Read([z-a])").to_string(),
            "invalid permission pattern 'Read([z-a])': invalid character range 'z-a'"
        );
        // Key form works for tools without a first argument.
        assert!(
            Rule::new(
                "TodoWrite:todos.0.status=done",
                Action::Allow,
                None,
                RuleSource::Cli
            )
            .is_ok()
        );
    }

    #[test]
    fn claude_code_prefix_form() {
        let pattern = "Bash(cargo test:*)";
        assert!(matches(pattern, "Bash", &bash("cargo test")));
        assert!(matches(pattern, "Bash", &bash("cargo test --release")));
        assert!(matches(pattern, "Bash", &bash("  cargo test -p x  ")));
        assert!(!matches(pattern, "Bash", &bash("cargo testing")));
        assert!(!matches(pattern, "Bash", &bash("cargo tes")));
        assert!(!matches(pattern, "Bash", &bash("xcargo test")));
        assert!(matches("Bash:cargo test:*", "Bash", &bash("cargo test")));
        // An escaped colon keeps the glob meaning.
        assert!(matches("Bash(a\\:*)", "Bash", &bash("a:b")));
        // Outside Bash `:*` is an ordinary glob.
        assert!(matches(
            "WebFetch(https:*)",
            "WebFetch",
            &json!({"url": "https://x.org"})
        ));
    }

    #[test]
    fn anywhere_form() {
        assert!(matches("Bash:~rm -rf", "Bash", &bash("sudo rm -rf /")));
        assert!(matches(
            "Bash:~--force",
            "Bash",
            &bash("git push --force origin")
        ));
        assert!(!matches("Bash:~--force", "Bash", &bash("git push origin")));
    }

    #[test]
    fn key_form() {
        let edit = json!({"path": "src/a.rs", "old_string": "foo()", "edits": [{"x": "y"}], "n": 3, "b": true});
        assert!(matches("Edit:path=src/*,old_string=foo*", "Edit", &edit));
        assert!(!matches("Edit:path=src/*,old_string=bar*", "Edit", &edit));
        assert!(matches("Edit:edits.0.x=y", "Edit", &edit));
        assert!(matches("Edit:n=3,b=true", "Edit", &edit));
        assert!(!matches("Edit:missing=*", "Edit", &edit));
        assert!(matches("Edit:path={src,lib}/*.rs", "Edit", &edit));
        assert!(matches("Bash:command=git *", "Bash", &bash("git log")));
        // Uppercase "keys" are environment assignments in a command glob, not keys.
        assert!(matches("Bash:FOO=1 make*", "Bash", &bash("FOO=1 make all")));
        // `=` inside a URL is not a key either.
        assert!(matches(
            "WebFetch:https://x.org/?a=*",
            "WebFetch",
            &json!({"url": "https://x.org/?a=b"})
        ));
    }

    #[test]
    fn first_arg_fields() {
        assert!(matches(
            "WebFetch(https://docs.rs/*)",
            "WebFetch",
            &json!({"url": "https://docs.rs/serde/latest"})
        ));
        assert!(!matches(
            "WebFetch(https://docs.rs/*)",
            "WebFetch",
            &json!({"url": "https://evil.org/docs.rs/"})
        ));
        // Glob and Grep search "." unless told otherwise.
        assert!(matches("Grep(.)", "Grep", &json!({"pattern": "x"})));
        assert!(matches(
            "Glob(src/**)",
            "Glob",
            &json!({"pattern": "*.rs", "path": "src/a"})
        ));
        assert!(!matches(
            "Glob(src/**)",
            "Glob",
            &json!({"pattern": "src/**"})
        ));
        // Tools matched through a glob without a first argument never match the argument form.
        assert!(!matches("*:x", "mcp__a__b", &json!({"x": "x"})));
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
    fn path_normalisation() {
        let pattern = "Write(src/**)";
        for path in [
            "src/a.rs",
            "./src/a.rs",
            "/home/u/proj/src/a/b.rs",
            "lib/../src/a.rs",
            "src//a.rs",
        ] {
            assert!(matches(pattern, "Write", &file(path)), "{path}");
        }
        for path in [
            "a/src/x.rs",
            "../proj2/src/a.rs",
            "/home/u/proj2/src/a.rs",
            "/src/a.rs",
        ] {
            assert!(
                !matches_as(Action::Allow, pattern, "Write", &file(path)),
                "{path}"
            );
        }
        // Outside the workspace a relative deny rule judges the absolute path minus its `/`:
        // over-matching a deny is the safe direction.
        assert!(matches(pattern, "Write", &file("/src/a.rs")));
        assert!(!matches(pattern, "Write", &file("/home/u/proj2/src/a.rs")));
        // Relative patterns are anchored at the workspace, not auto-prefixed with `**/`.
        assert!(matches("Read(*.md)", "Read", &file("README.md")));
        assert!(!matches("Read(*.md)", "Read", &file("docs/x.md")));
        assert!(matches("Read(./*.md)", "Read", &file("README.md")));
        // Absolute patterns see absolute paths.
        assert!(matches("Read(/etc/**)", "Read", &file("/etc/passwd")));
        assert!(matches(
            "Read(/etc/**)",
            "Read",
            &file("../../../etc/passwd")
        ));
        assert!(matches(
            "Read(/home/u/proj/*.md)",
            "Read",
            &file("README.md")
        ));
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
    fn splitting_commands() {
        let split = |command: &str| split_command(command).expect("parses");
        assert_eq!(split("git status"), ["git status"]);
        assert_eq!(split("git status && rm -rf /"), ["git status", "rm -rf /"]);
        assert_eq!(
            split("a; b || c | d & e\nf |& g"),
            ["a", "b", "c", "d", "e", "f", "g"]
        );
        assert_eq!(
            split("echo 'a && b' \"c; d\" e\\;f"),
            ["echo 'a && b' \"c; d\" e\\;f"]
        );
        assert_eq!(split("echo $(rm -rf /)"), ["rm -rf /", "echo $(rm -rf /)"]);
        assert_eq!(split("echo \"$(a; b)\""), ["a", "b", "echo \"$(a; b)\""]);
        assert_eq!(split("echo `whoami`"), ["whoami", "echo `whoami`"]);
        assert_eq!(split("diff <(ls a) b"), ["ls a", "diff <(ls a) b"]);
        assert_eq!(split("(cd x && make)"), ["cd x", "make"]);
        assert_eq!(split("cargo test 2>&1 | tail"), ["cargo test", "tail"]);
        assert_eq!(split("cargo test >/dev/null 2>&1"), ["cargo test"]);
        assert_eq!(split("git log > out.txt"), ["> out.txt", "git log"]);
        assert_eq!(
            split("sort < in.txt >> out.txt"),
            ["< in.txt", ">> out.txt", "sort"]
        );
        assert_eq!(split("make 2> err.log all"), ["2> err.log", "make all"]);
        assert_eq!(split("cmd &> log"), ["&> log", "cmd"]);
        assert_eq!(split("cmd >&file"), [">& file", "cmd"]);
        assert_eq!(split("cat <<< hi"), ["cat"]);
        assert_eq!(split("git status # it's fine; rm"), ["git status"]);
        assert_eq!(split("ls # '\nrm -rf /\n# '"), ["ls", "rm -rf /"]);
        assert_eq!(split("echo a#b"), ["echo a#b"]);
        assert_eq!(
            split("echo $'\\'' ; rm -rf / ; echo $'\\''"),
            ["echo $'\\''", "rm -rf /", "echo $'\\''"]
        );
        assert_eq!(
            split("cat <<EOF > f.txt\nit's; body\nEOF\nrm x"),
            ["> f.txt", "cat", "rm x"]
        );
        assert_eq!(
            split("git commit -m \"$(cat <<'EOF'\nfix: it's $(not run)\nEOF\n)\" && git log"),
            [
                "cat",
                "git commit -m \"$(cat <<'EOF'\nfix: it's $(not run)\nEOF\n)\"",
                "git log"
            ]
        );
        assert_eq!(split("cat <<-EOF\n\tbody\n\tEOF\nls"), ["cat", "ls"]);
        assert_eq!(split("echo a2>b"), ["> b", "echo a2"]);
        assert_eq!(split("  "), Vec::<String>::new());
        for broken in [
            "echo 'open",
            "echo \"open",
            "echo $(open",
            "a )",
            "echo `x",
            "cat >",
            "x > ;",
            "echo $'open\\'",
            "cat <<EOF\nno end",
            "cat <<EOF",
            "cat <<EOF\n$(rm -rf /)\nEOF",
        ] {
            assert_eq!(split_command(broken), None, "{broken}");
        }
        assert_eq!(split("\\; \\a"), ["\\; \\a"]);
        let deep = format!("{}x{}", "$(".repeat(40), ")".repeat(40));
        assert_eq!(split_command(&deep), None);
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
    fn mode_bypass_allows_everything() {
        let mut policy = policy(vec![rule("Bash(rm *)", Action::Deny)], Mode::Default);
        assert_eq!(policy.mode(), Mode::Default);
        policy.set_mode(Mode::BypassPermissions);
        assert_eq!(policy.mode(), Mode::BypassPermissions);
        let decision = policy.decide("Bash", &bash("rm x"));
        assert_eq!(decision.action, Action::Allow);
        assert_eq!(decision.matched.as_deref(), Some("Bash(rm *)"));
        assert_eq!(action(&policy, "Write", &file("/etc/x")), Action::Allow);
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
