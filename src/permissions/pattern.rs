//! Rule patterns: the grammar a rule's pattern is written in, and matching one pattern
//! against one tool call. Kept apart from the policy so that what a pattern means is decided
//! in one place, whatever the policy then does with a match (first match wins, compound Bash
//! commands judged piece by piece, modes). Matching is lexical: paths are normalised against
//! the workspace without touching the file system.
//!
//! Pattern grammar (our superset of upstream's):
//! - `Tool` (a glob over the tool name, e.g. `mcp__github__*`), and `*` for every tool;
//! - `Tool:<glob>` or `Tool(<glob>)` on the tool's first-argument field (`first_arg`);
//! - `Bash(cargo test:*)`: Claude Code's prefix form, `cargo test` alone or followed by a space;
//! - `Bash:~<glob>`: the glob anywhere in the command;
//! - `Tool:key=<glob>[,key2=<glob2>]`: dotted keys into the input, all of which must match;
//! - `WebFetch(domain:<host>)`: the URL's host is `<host>` or a subdomain of it (a glob such
//!   as `domain:*.example.com` matches the host as a glob), as in Claude Code.

use std::borrow::Cow;
use std::fmt;

use serde_json::Value;

use super::Action;
use crate::glob::{Glob, GlobError, GlobOptions};
use crate::tools::table;

/// Globs over commands, URLs and tool names: `*` crosses `/`.
const TEXT: GlobOptions = GlobOptions {
    literal_separator: false,
};

/// Globs over workspace paths: `*` stays within one component and `**` crosses directories.
const PATHS: GlobOptions = GlobOptions {
    literal_separator: true,
};

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

/// A parsed rule pattern: a glob over the tool name and what to require of the input.
#[derive(Clone, Debug)]
pub(super) struct Matcher {
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
    /// `WebFetch(domain:<host>)`: the URL's host. A literal host also matches its
    /// subdomains (`domain:example.com` allows `docs.example.com`).
    Domain { glob: Glob, literal: Option<String> },
}

impl Matcher {
    pub(super) fn parse(pattern: &str) -> Result<Matcher, PatternError> {
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
        if field.is_some_and(|field| field.kind == FieldKind::Command) {
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
        if field.is_some_and(|field| field.kind == FieldKind::Url)
            && let Some(domain) = arg.strip_prefix("domain:")
        {
            let domain = domain.trim().trim_end_matches('.').to_ascii_lowercase();
            let domain = match domain.strip_prefix('[').and_then(|d| d.strip_suffix(']')) {
                Some(v6) => v6.to_owned(),
                None => domain,
            };
            if domain.is_empty() {
                return Err(PatternError::EmptyArgument { pattern: owned() });
            }
            let literal = (!domain.contains(['*', '?', '[', '{', '\\'])).then(|| domain.clone());
            return Ok(Matcher {
                tool: tool_glob,
                arg: ArgMatcher::First(ArgPattern::Domain {
                    glob: compile(pattern, &domain, TEXT)?,
                    literal,
                }),
            });
        }
        if field.is_some_and(|field| field.kind == FieldKind::Path) && arg.starts_with('~') {
            return Err(PatternError::HomePath { pattern: owned() });
        }
        Ok(Matcher {
            tool: tool_glob,
            arg: ArgMatcher::First(plain_pattern(pattern, arg)?),
        })
    }

    /// Whether this rule looks at the shell command of `tool` (Bash's `command`).
    pub(super) fn reads_command(&self, tool: &str) -> bool {
        let Some(field) = first_arg(tool).filter(|field| field.kind == FieldKind::Command) else {
            return false;
        };
        match &self.arg {
            ArgMatcher::Any => false,
            ArgMatcher::First(_) => true,
            ArgMatcher::Keys(keys) => keys.iter().any(|key| key.key == field.name),
        }
    }

    /// Whether the tool name matches this pattern's tool glob.
    pub(super) fn matches_tool(&self, tool: &str) -> bool {
        self.tool.is_match(tool)
    }

    /// Matches the argument part (the tool part already matched) for a rule with `action`,
    /// which matters because paths outside the workspace only ever match deny and ask rules.
    /// `command` stands in for the Bash `command` field when a piece of the command is
    /// being judged.
    pub(super) fn matches_input(
        &self,
        action: Action,
        call: &Subject<'_>,
        command: Option<&str>,
    ) -> bool {
        let matches = |pattern: &ArgPattern, kind: FieldKind, value: Option<Cow<'_, str>>| {
            value.is_some_and(|value| value_matches(pattern, kind, &value, call, action))
        };
        match &self.arg {
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

/// Escapes glob metacharacters so the pattern matches `text` literally, for suggested rules.
/// `=` is escaped too: unescaped, `a=b` would read as the key form `key=glob`; and so is a
/// leading `~`, which opens the anywhere form for commands and is refused for paths.
pub(super) fn escape_glob(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 1);
    if text.starts_with('~') {
        out.push('\\');
    }
    for ch in text.chars() {
        if matches!(ch, '*' | '?' | '[' | ']' | '{' | '}' | '\\' | '=') {
            out.push('\\');
        }
        out.push(ch);
    }
    out
}

/// One tool call as a pattern sees it. Paths in `input` are resolved from `base` (the run's
/// cwd), then judged relative to `workspace`, where rules are anchored; both are normalised.
pub(super) struct Subject<'a> {
    pub(super) tool: &'a str,
    pub(super) input: &'a Value,
    pub(super) workspace: &'a str,
    pub(super) base: &'a str,
}

fn field_text<'c>(
    field: Field,
    call: &'c Subject<'_>,
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
    call: &Subject<'_>,
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
        (ArgPattern::Domain { glob, literal }, _) => {
            url_host(value).is_some_and(|host| domain_matches(glob, literal.as_deref(), &host))
        }
        (ArgPattern::Glob { text, .. }, _) => text.is_match(value),
        (ArgPattern::Prefix(glob) | ArgPattern::Anywhere(glob), _) => glob.is_match(value),
    }
}

/// Whether a `domain:` rule covers `host`, judged by address where either side is one, as
/// the resolver reads it (`netaddr::parse_ip`): a rule naming an IP covers every spelling
/// of it (`127.1`, `0x7f000001`, `[::ffff:127.0.0.1]`), and a rule naming this machine
/// (`localhost`, or any loopback or unspecified address) covers all of them, since each
/// reaches the same listeners. Otherwise the host matches by name, or its subdomains a
/// literal one; a glob also sees the address's usual spelling (`domain:127.*` covers
/// `127.1`).
fn domain_matches(glob: &Glob, literal: Option<&str>, host: &str) -> bool {
    use crate::netaddr::{is_local, is_localhost_name, parse_ip};
    let ip = parse_ip(host);
    let local = || is_localhost_name(host) || ip.is_some_and(is_local);
    if let Some(domain) = literal {
        let rule_ip = parse_ip(domain);
        if is_localhost_name(domain) || rule_ip.is_some_and(is_local) {
            return local();
        }
        if let Some(rule_ip) = rule_ip {
            return ip == Some(rule_ip);
        }
    }
    glob.is_match(host)
        || ip.is_some_and(|ip| glob.is_match(&ip.to_string()))
        || literal.is_some_and(|domain| host.ends_with(&format!(".{domain}")))
}

/// The host of an `http(s)://` URL, lowercased, without port, brackets or user info; `None`
/// for anything else (which no `domain:` rule matches).
fn url_host(url: &str) -> Option<String> {
    let (scheme, rest) = url.trim().split_once("://")?;
    if !scheme.eq_ignore_ascii_case("http") && !scheme.eq_ignore_ascii_case("https") {
        return None;
    }
    let authority = rest.split(['/', '?', '#']).next()?;
    let host_port = authority.rsplit('@').next()?;
    let host = match host_port.strip_prefix('[') {
        Some(v6) => v6.split(']').next()?,
        None => host_port.split(':').next()?,
    };
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    (!host.is_empty()).then_some(host)
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
pub(super) enum FieldKind {
    /// A shell command (Bash's `command`): split into pieces for allow rules.
    Command,
    /// A file path, normalised against the workspace.
    Path,
    /// A URL (WebFetch's `url`): matched as text, or by host with `domain:`.
    Url,
    /// Anything else, matched as text.
    Text,
}

#[derive(Clone, Copy, Debug)]
pub(super) struct Field {
    pub(super) name: &'static str,
    pub(super) kind: FieldKind,
    /// The value when the input leaves the field out.
    default: Option<&'static str>,
}

/// The field `Tool:<glob>` matches: the tool's permission subject in `tools::table`. Tools
/// without one (and tools not in the table) only match the bare-name and key forms.
pub(super) fn first_arg(tool: &str) -> Option<Field> {
    let (name, kind, default) = match table::permission(tool)?.subject {
        table::Subject::Nothing => return None,
        table::Subject::Command(field) => (field, FieldKind::Command, None),
        table::Subject::Path { field, default } => (field, FieldKind::Path, default),
        table::Subject::Url(field) => (field, FieldKind::Url, None),
    };
    Some(Field {
        name,
        kind,
        default,
    })
}

/// A path judged against the workspace, after lexical normalisation.
pub(super) struct PathView {
    /// Absolute, normalised: no `.`, `..` or repeated `/`.
    pub(super) abs: String,
    /// Relative to the workspace (`.` for the workspace itself); `None` when outside it.
    pub(super) rel: Option<String>,
}

pub(super) fn path_view(workspace: &str, base: &str, raw: &str) -> PathView {
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
pub(super) fn normalize_abs(path: &str) -> String {
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

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use crate::permissions::tests::{WS, bash, file, rule};
    use crate::permissions::{Action, Call, PatternError, Rule, RuleSource, rule_matches};

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
    fn domain_form() {
        let url = |u: &str| json!({ "url": u });
        let rule = "WebFetch(domain:example.com)";
        assert!(matches(rule, "WebFetch", &url("https://example.com/a")));
        assert!(matches(
            rule,
            "WebFetch",
            &url("http://Docs.Example.COM:8080/x?y")
        ));
        assert!(matches(
            rule,
            "WebFetch",
            &url("https://user@example.com./")
        ));
        assert!(!matches(rule, "WebFetch", &url("https://notexample.com/")));
        assert!(!matches(
            rule,
            "WebFetch",
            &url("https://example.com.evil.org/")
        ));
        assert!(!matches(
            rule,
            "WebFetch",
            &url("https://evil.org/example.com")
        ));
        assert!(!matches(rule, "WebFetch", &url("ftp://example.com/")));
        assert!(!matches(rule, "WebFetch", &json!({})));
        assert!(matches(
            "WebFetch:domain:127.0.0.1",
            "WebFetch",
            &url("http://127.0.0.1:9/")
        ));
        let glob = "WebFetch(domain:*.rs)";
        assert!(matches(glob, "WebFetch", &url("https://docs.rs/serde")));
        assert!(!matches(
            glob,
            "WebFetch",
            &url("https://docs.rs.evil.org/")
        ));
        assert!(super::Matcher::parse("WebFetch(domain:)").is_err());
        // Addresses, not spellings: every form of loopback is caught by any rule naming it.
        for rule in [
            "WebFetch(domain:127.0.0.1)",
            "WebFetch(domain:localhost)",
            "WebFetch(domain:::1)",
            "WebFetch(domain:[::1])",
        ] {
            for host in [
                "127.0.0.1",
                "127.1",
                "0x7f000001",
                "2130706433",
                "0177.0.0.1",
                "127.0.0.2",
                "0.0.0.0",
                "[::ffff:127.0.0.1]",
                "[::1]",
                "localhost",
                "localhost.",
                "LOCALHOST",
                "app.localhost",
            ] {
                let u = url(&format!("http://{host}:8080/x"));
                assert!(matches(rule, "WebFetch", &u), "{rule} {host}");
            }
            assert!(
                !matches(rule, "WebFetch", &url("http://10.0.0.1/")),
                "{rule}"
            );
            assert!(
                !matches(rule, "WebFetch", &url("http://example.com/")),
                "{rule}"
            );
        }
        let other = "WebFetch(domain:10.1.2.3)";
        assert!(matches(other, "WebFetch", &url("http://10.66051/")));
        assert!(matches(other, "WebFetch", &url("http://[::ffff:a01:203]/")));
        assert!(!matches(other, "WebFetch", &url("http://10.1.2.4/")));
        assert!(matches(
            "WebFetch(domain:127.*)",
            "WebFetch",
            &url("http://127.1/")
        ));
        // Only URL fields have a domain: elsewhere it is an ordinary glob.
        assert!(matches("Bash(domain:x*)", "Bash", &bash("domain:xy")));
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
}
