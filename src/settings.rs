//! Settings files: finding, reading and validating the JSON files that configure the provider,
//! the model, limits and permission rules, and merging them by priority. It reads files but
//! must not know about command-line flags (the CLI layers those on top) or how rules are
//! applied (that is `crate::permissions`).
//!
//! Files, highest priority first: `<workspace>/.caliban/settings.local.json`,
//! `<workspace>/.caliban/settings.json`, then `$XDG_CONFIG_HOME/caliban/settings.json`
//! (`$HOME/.config/caliban/settings.json` when `XDG_CONFIG_HOME` is unset). The
//! highest-priority file that sets a scalar wins; rules from every file are kept, in this
//! order.
//!
//! ```json
//! {"provider": "anthropic", "model": "…", "max_tokens": 8192, "max_turns": 50,
//!  "context_window": 32768 | {"my-local-model": 32768, …},
//!  "models": ["claude-sonnet-4-5", "claude-haiku-4-5"],
//!  "project_instructions": true,
//!  "permissions": {"default_mode": "acceptEdits",
//!                  "rules": [{"pattern": "Bash:git *", "action": "allow", "reason": "…", "comment": "…"}],
//!                  "allow": ["…"], "ask": ["…"], "deny": ["…"]},
//!  "sandbox": {"mode": "workspace-write", "network_ports": [443], "deny_read": ["~/x"],
//!              "allow_read": ["~/.npmrc"], "writable": ["~/.cache"],
//!              "protected_writable": [".git/"], "unavailable": "refuse", "mcp_servers": "off",
//!              "env_passthrough": ["GITHUB_TOKEN"]},
//!  "mcpServers": {"name": {"command": "…", "args": ["…"]}},
//!  "mcp_timeout": 300,
//!  "enabledMcpjsonServers": ["name"], "enableAllProjectMcpServers": false,
//!  "webfetch": {"block_private": true}}
//! ```
//!
//! A workspace's files may only narrow the sandbox (`mode` no wider than the user's, more
//! `deny_read`); its other keys there are ignored with a warning, as a cloned repository
//! must not widen what commands may do.
//!
//! `mcpServers` is read as `mcp_client::config` reads `.mcp.json`; the approval keys
//! (`enabledMcpjsonServers`, `enableAllProjectMcpServers`, as Claude Code names them) count
//! only in the user's own file, since a workspace must not approve its own servers.

use std::fmt;
use std::fs::File;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::permissions::{Action, Mode, PatternError, Rule, RuleSource};
use crate::sandbox;

/// `"context_window"`: a number for every model, or an object of numbers by model name.
#[derive(Clone, Debug, Default)]
pub struct ContextWindows {
    pub default: Option<u64>,
    pub by_model: Vec<(String, u64)>,
}

impl ContextWindows {
    /// The window of `model`: the settings' own for it, else the settings' one for every
    /// model, else the one caliban knows.
    pub fn of(&self, model: &str) -> Option<u64> {
        self.by_model
            .iter()
            .find(|(name, _)| name == model)
            .map(|(_, window)| *window)
            .or(self.default)
            .or_else(|| crate::model::catalog::context_window(model))
    }
}

/// Largest settings file we read. Real ones are a few KiB; the cap keeps a mistaken path
/// (a log file, a device) from being read into memory whole.
const MAX_SETTINGS_BYTES: u64 = 1 << 20;

/// Providers `"provider"` may name.
const PROVIDERS: [&str; 2] = ["anthropic", "openai"];

/// Everything the settings files say, merged.
#[derive(Clone, Debug, Default)]
pub struct Settings {
    pub provider: Option<String>,
    pub model: Option<String>,
    pub max_tokens: Option<u32>,
    pub max_turns: Option<u32>,
    pub default_mode: Option<Mode>,
    /// Context windows that replace what caliban knows (`model::catalog`): one for every
    /// model (`default`), and per model name.
    pub context_window: ContextWindows,
    /// Models a client may choose between (ACP's model selector); the configured model is
    /// always among them.
    pub models: Option<Vec<String>>,
    /// `"project_instructions": false` turns off reading `AGENTS.md` and kin.
    pub project_instructions: Option<bool>,
    /// Project rules first (the local file's before the shared file's), then user rules.
    pub rules: Vec<Rule>,
    pub sandbox: sandbox::Settings,
    /// Things worth telling the user that do not stop the run: unknown keys, dropped rules.
    pub warnings: Vec<String>,
    /// Each file's `mcpServers`, highest priority first, with whether it is the user's.
    pub mcp_servers: Vec<(RuleSource, Map<String, Value>)>,
    pub mcp_timeout: Option<u32>,
    /// Approvals of project MCP servers, from the user's file only.
    pub enabled_mcpjson_servers: Vec<String>,
    pub enable_all_project_mcp_servers: bool,
    /// `"webfetch": {"block_private": true}` in any file: `WebFetch` refuses loopback,
    /// private, link-local, CGNAT and unspecified addresses. Any file may turn it on (it
    /// only narrows); none can turn off what another turned on.
    pub webfetch_block_private: bool,
}

#[derive(Debug)]
pub enum SettingsError {
    /// The file exists but could not be read (permissions, a directory, not UTF-8, …).
    Read {
        path: PathBuf,
        error: io::Error,
    },
    TooLarge {
        path: PathBuf,
    },
    /// Not JSON; serde_json's message carries the line and column.
    Parse {
        path: PathBuf,
        error: serde_json::Error,
    },
    /// JSON, but a known key holds a value we cannot use.
    Invalid {
        path: PathBuf,
        message: String,
    },
}

impl fmt::Display for SettingsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SettingsError::Read { path, error } => {
                write!(f, "cannot read settings file {}: {error}", path.display())
            }
            SettingsError::TooLarge { path } => write!(
                f,
                "settings file {} is larger than {MAX_SETTINGS_BYTES} bytes",
                path.display()
            ),
            SettingsError::Parse { path, error } => {
                write!(f, "malformed settings file {}: {error}", path.display())
            }
            SettingsError::Invalid { path, message } => {
                write!(f, "invalid settings file {}: {message}", path.display())
            }
        }
    }
}

impl std::error::Error for SettingsError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            SettingsError::Read { error, .. } => Some(error),
            SettingsError::Parse { error, .. } => Some(error),
            SettingsError::TooLarge { .. } | SettingsError::Invalid { .. } => None,
        }
    }
}

/// Loads and merges every settings file that exists. `env` looks up environment variables
/// (`XDG_CONFIG_HOME`, `HOME`), so tests and callers need not touch the process environment.
pub fn load(
    workspace: &Path,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Settings, SettingsError> {
    let project_dir = workspace.join(".caliban");
    let mut files = vec![
        (project_dir.join("settings.local.json"), RuleSource::Project),
        (project_dir.join("settings.json"), RuleSource::Project),
    ];
    if let Some(config_dir) = user_config_dir(env) {
        files.push((config_dir.join("caliban/settings.json"), RuleSource::User));
    }
    let mut settings = Settings::default();
    for (path, source) in files {
        let Some(text) = read_optional(&path)? else {
            continue;
        };
        let file = parse_file(&path, &text, source)?;
        // Files arrive highest priority first, so a scalar already set is never replaced.
        settings.provider = settings.provider.or(file.provider);
        settings.model = settings.model.or(file.model);
        settings.max_tokens = settings.max_tokens.or(file.max_tokens);
        settings.max_turns = settings.max_turns.or(file.max_turns);
        settings.default_mode = settings.default_mode.or(file.default_mode);
        settings.context_window.default = settings
            .context_window
            .default
            .or(file.context_window.default);
        for (model, window) in file.context_window.by_model {
            if !settings
                .context_window
                .by_model
                .iter()
                .any(|(m, _)| *m == model)
            {
                settings.context_window.by_model.push((model, window));
            }
        }
        settings.models = settings.models.or(file.models);
        settings.project_instructions = settings.project_instructions.or(file.project_instructions);
        settings.rules.extend(file.rules);
        settings.warnings.extend(file.warnings);
        merge_sandbox(&mut settings.sandbox, file.sandbox, source);
        settings.webfetch_block_private |= file.webfetch_block_private;
        settings.mcp_timeout = settings.mcp_timeout.or(file.mcp_timeout);
        if let Some(servers) = file.mcp_servers {
            settings.mcp_servers.push((source, servers));
        }
        if source == RuleSource::User {
            settings.enabled_mcpjson_servers = file.enabled_mcpjson_servers;
            settings.enable_all_project_mcp_servers = file.enable_all_project_mcp_servers;
        } else if !file.enabled_mcpjson_servers.is_empty() || file.enable_all_project_mcp_servers {
            settings.warnings.push(format!(
                "{}: MCP server approvals count only in your user settings; ignored here",
                path.display()
            ));
        }
    }
    Ok(settings)
}

/// Folds one file's sandbox settings in (files arrive highest priority first). Workspace
/// files only narrow: their modes combine to the strictest, their deny lists add up.
fn merge_sandbox(into: &mut sandbox::Settings, file: sandbox::Settings, source: RuleSource) {
    if source == RuleSource::Project {
        if let Some(mode) = file.mode {
            into.project_mode = Some(into.project_mode.map_or(mode, |m| m.narrowed(mode)));
        }
        into.deny_read.extend(file.deny_read);
        return;
    }
    into.mode = into.mode.or(file.mode);
    into.deny_read.extend(file.deny_read);
    into.allow_read.extend(file.allow_read);
    into.writable.extend(file.writable);
    if into.network_ports.is_empty() {
        into.network_ports = file.network_ports;
    }
    into.protected_writable.extend(file.protected_writable);
    into.unavailable = into.unavailable.or(file.unavailable);
    into.mcp_servers = into.mcp_servers.or(file.mcp_servers);
    into.env_passthrough.extend(file.env_passthrough);
}

/// Rules from `--allow`, `--deny` and `--ask`: deny first, then ask, then allow, so a pattern
/// given to both `--deny` and `--allow` is denied. A bad pattern is an error here, unlike in
/// a settings file, since the user is right there to fix the command line.
pub fn rules_from_cli(
    allow: &[String],
    deny: &[String],
    ask: &[String],
) -> Result<Vec<Rule>, PatternError> {
    let buckets = [
        (deny, Action::Deny),
        (ask, Action::Ask),
        (allow, Action::Allow),
    ];
    let mut rules = Vec::new();
    for (patterns, action) in buckets {
        for pattern in patterns {
            rules.push(Rule::new(pattern, action, None, RuleSource::Cli)?);
        }
    }
    Ok(rules)
}

/// `$XDG_CONFIG_HOME`, or `$HOME/.config`. The XDG spec says to ignore a relative or empty
/// `XDG_CONFIG_HOME`.
pub(crate) fn user_config_dir(env: &dyn Fn(&str) -> Option<String>) -> Option<PathBuf> {
    if let Some(dir) = env("XDG_CONFIG_HOME").filter(|dir| dir.starts_with('/')) {
        return Some(PathBuf::from(dir));
    }
    env("HOME")
        .filter(|home| !home.is_empty())
        .map(|home| Path::new(&home).join(".config"))
}

/// The file's text, or `None` when it does not exist.
fn read_optional(path: &Path) -> Result<Option<String>, SettingsError> {
    let read_error = |error| SettingsError::Read {
        path: path.to_owned(),
        error,
    };
    let file = match File::open(path) {
        Ok(file) => file,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(error) => return Err(read_error(error)),
    };
    let mut text = String::new();
    file.take(MAX_SETTINGS_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(read_error)?;
    if text.len() as u64 > MAX_SETTINGS_BYTES {
        return Err(SettingsError::TooLarge {
            path: path.to_owned(),
        });
    }
    Ok(Some(text))
}

/// One file's contribution, before merging.
#[derive(Default)]
struct FileSettings {
    provider: Option<String>,
    model: Option<String>,
    max_tokens: Option<u32>,
    max_turns: Option<u32>,
    default_mode: Option<Mode>,
    context_window: ContextWindows,
    models: Option<Vec<String>>,
    project_instructions: Option<bool>,
    rules: Vec<Rule>,
    sandbox: sandbox::Settings,
    warnings: Vec<String>,
    mcp_servers: Option<Map<String, Value>>,
    mcp_timeout: Option<u32>,
    enabled_mcpjson_servers: Vec<String>,
    enable_all_project_mcp_servers: bool,
    webfetch_block_private: bool,
}

/// Validates one file. Structural mistakes in known keys are errors, since guessing could
/// loosen permissions (a misspelt mode or action); unknown keys and bad patterns are warnings,
/// and a rule with a bad pattern is dropped (fail closed).
fn parse_file(path: &Path, text: &str, source: RuleSource) -> Result<FileSettings, SettingsError> {
    let value: Value = serde_json::from_str(text).map_err(|error| SettingsError::Parse {
        path: path.to_owned(),
        error,
    })?;
    let mut parser = FileParser {
        path,
        source,
        out: FileSettings::default(),
    };
    let Value::Object(top) = value else {
        return Err(parser.invalid("expected a JSON object at the top level".to_owned()));
    };
    for (key, value) in &top {
        if value.is_null() {
            // `"model": null` reads as "not set here", letting a lower file's value through.
            continue;
        }
        match key.as_str() {
            "provider" => {
                let provider = parser.string(key, value)?;
                if !PROVIDERS.contains(&provider.as_str()) {
                    return Err(parser.invalid(format!(
                        "unknown provider '{provider}' (expected {})",
                        PROVIDERS.join(" or ")
                    )));
                }
                parser.out.provider = Some(provider);
            }
            "model" => parser.out.model = Some(parser.string(key, value)?),
            "max_tokens" => parser.out.max_tokens = Some(parser.positive(key, value)?),
            "max_turns" => parser.out.max_turns = Some(parser.positive(key, value)?),
            "permissions" => parser.permissions(value)?,
            "context_window" => parser.context_window(value)?,
            "models" => {
                let models = value
                    .as_array()
                    .filter(|items| {
                        items
                            .iter()
                            .all(|i| i.as_str().is_some_and(|s| !s.is_empty()))
                    })
                    .ok_or_else(|| {
                        parser.invalid("'models' must be an array of non-empty strings".to_owned())
                    })?;
                parser.out.models = Some(
                    models
                        .iter()
                        .filter_map(Value::as_str)
                        .map(str::to_owned)
                        .collect(),
                );
            }
            "sandbox" => parser.sandbox(value)?,
            "webfetch" => {
                let block = value
                    .as_object()
                    .filter(|fields| fields.keys().all(|k| k == "block_private"))
                    .map(|fields| fields.get("block_private").map(Value::as_bool));
                match block {
                    Some(None) => {}
                    Some(Some(Some(on))) => parser.out.webfetch_block_private = on,
                    _ => {
                        return Err(parser.invalid(
                            "'webfetch' must be {\"block_private\": true or false}".to_owned(),
                        ));
                    }
                }
            }
            "project_instructions" => match value {
                Value::Bool(on) => parser.out.project_instructions = Some(*on),
                _ => {
                    return Err(
                        parser.invalid("'project_instructions' must be true or false".to_owned())
                    );
                }
            },
            "mcpServers" => match value {
                Value::Object(servers) => parser.out.mcp_servers = Some(servers.clone()),
                _ => {
                    return Err(parser
                        .invalid("'mcpServers' must be an object of servers by name".to_owned()));
                }
            },
            "mcp_timeout" => parser.out.mcp_timeout = Some(parser.positive(key, value)?),
            "enabledMcpjsonServers" => {
                parser.out.enabled_mcpjson_servers = value
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .filter_map(Value::as_str)
                            .map(str::to_owned)
                            .collect()
                    })
                    .unwrap_or_default();
            }
            "enableAllProjectMcpServers" => {
                parser.out.enable_all_project_mcp_servers = value.as_bool() == Some(true);
            }
            // Editors add a schema reference for completion; it configures nothing.
            "$schema" => {}
            _ => parser.warn(format!("unknown key '{key}' ignored")),
        }
    }
    Ok(parser.out)
}

struct FileParser<'a> {
    path: &'a Path,
    source: RuleSource,
    out: FileSettings,
}

impl FileParser<'_> {
    fn invalid(&self, message: String) -> SettingsError {
        SettingsError::Invalid {
            path: self.path.to_owned(),
            message,
        }
    }

    fn warn(&mut self, message: String) {
        let warning = format!("{}: {message}", self.path.display());
        self.out.warnings.push(warning);
    }

    fn string(&self, key: &str, value: &Value) -> Result<String, SettingsError> {
        match value {
            Value::String(text) if !text.is_empty() => Ok(text.clone()),
            _ => Err(self.invalid(format!("'{key}' must be a non-empty string"))),
        }
    }

    fn positive(&self, key: &str, value: &Value) -> Result<u32, SettingsError> {
        value
            .as_u64()
            .filter(|&n| n > 0)
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| self.invalid(format!("'{key}' must be a positive integer")))
    }

    fn window(&self, key: &str, value: &Value) -> Result<u64, SettingsError> {
        value
            .as_u64()
            .filter(|&n| n > 0)
            .ok_or_else(|| self.invalid(format!("'{key}' must be a positive integer")))
    }

    fn context_window(&mut self, value: &Value) -> Result<(), SettingsError> {
        match value {
            Value::Object(models) => {
                for (model, window) in models {
                    let window = self.window(&format!("context_window.{model}"), window)?;
                    self.out
                        .context_window
                        .by_model
                        .push((model.clone(), window));
                }
            }
            other => self.out.context_window.default = Some(self.window("context_window", other)?),
        }
        Ok(())
    }

    fn permissions(&mut self, value: &Value) -> Result<(), SettingsError> {
        let Value::Object(permissions) = value else {
            return Err(self.invalid("'permissions' must be an object".to_owned()));
        };
        for (key, value) in permissions {
            match key.as_str() {
                "default_mode" if !value.is_null() => self.default_mode(value)?,
                "default_mode" | "rules" | "allow" | "ask" | "deny" => {}
                _ => self.warn(format!("unknown key 'permissions.{key}' ignored")),
            }
        }
        // Ordered rules first, then the legacy buckets, most restrictive first.
        if let Some(rules) = non_null(permissions, "rules") {
            let Value::Array(rules) = rules else {
                return Err(self.invalid("'permissions.rules' must be an array".to_owned()));
            };
            for (idx, rule) in rules.iter().enumerate() {
                self.rule(idx, rule)?;
            }
        }
        for (key, action) in [
            ("deny", Action::Deny),
            ("ask", Action::Ask),
            ("allow", Action::Allow),
        ] {
            let Some(patterns) = non_null(permissions, key) else {
                continue;
            };
            let patterns = patterns
                .as_array()
                .filter(|items| items.iter().all(Value::is_string))
                .ok_or_else(|| {
                    self.invalid(format!("'permissions.{key}' must be an array of strings"))
                })?;
            for pattern in patterns.iter().filter_map(Value::as_str) {
                self.push_rule(pattern, action, None);
            }
        }
        Ok(())
    }

    fn default_mode(&mut self, value: &Value) -> Result<(), SettingsError> {
        let name = value.as_str().unwrap_or_default();
        let Some(mode) = Mode::parse(name) else {
            let names: Vec<&str> = Mode::ALL.iter().map(|mode| mode.as_str()).collect();
            return Err(self.invalid(format!(
                "'permissions.default_mode' must be one of {}, not {value}",
                names.join(", ")
            )));
        };
        // A cloned repository must not switch permissions off for whoever runs caliban in it;
        // only the user's own settings (or the command line) may ask for bypassPermissions.
        if mode == Mode::BypassPermissions && self.source == RuleSource::Project {
            self.warn(
                "'permissions.default_mode' bypassPermissions is ignored in workspace settings; \
                 set it in user settings or on the command line"
                    .to_owned(),
            );
            return Ok(());
        }
        self.out.default_mode = Some(mode);
        Ok(())
    }

    /// The `sandbox` object. In a workspace's file only `mode` and `deny_read` count.
    fn sandbox(&mut self, value: &Value) -> Result<(), SettingsError> {
        let Value::Object(fields) = value else {
            return Err(self.invalid("'sandbox' must be an object".to_owned()));
        };
        let project = self.source == RuleSource::Project;
        for (key, value) in fields {
            if value.is_null() {
                continue;
            }
            let at = format!("sandbox.{key}");
            let mode = |value: &Value| {
                value
                    .as_str()
                    .and_then(sandbox::Mode::parse)
                    .ok_or_else(|| {
                        self.invalid(format!("'{at}' must be one of {}", sandbox::Mode::names()))
                    })
            };
            match key.as_str() {
                "mode" => self.out.sandbox.mode = Some(mode(value)?),
                "deny_read" => self.out.sandbox.deny_read = self.paths(&at, value)?,
                _ if project => self.warn(format!(
                    "'{at}' is ignored in workspace settings (a workspace may only narrow the \
                     sandbox); set it in user settings"
                )),
                "allow_read" => self.out.sandbox.allow_read = self.paths(&at, value)?,
                "writable" => self.out.sandbox.writable = self.paths(&at, value)?,
                "protected_writable" => {
                    self.out.sandbox.protected_writable = self.strings(&at, value)?
                }
                "network_ports" => {
                    let ports = value
                        .as_array()
                        .and_then(|items| {
                            items
                                .iter()
                                .map(|item| item.as_u64().and_then(|n| u16::try_from(n).ok()))
                                .collect::<Option<Vec<u16>>>()
                        })
                        .filter(|ports| !ports.contains(&0));
                    self.out.sandbox.network_ports = ports.ok_or_else(|| {
                        self.invalid(format!("'{at}' must be an array of ports (1-65535)"))
                    })?;
                }
                "unavailable" => {
                    let fallback = value.as_str().and_then(sandbox::Fallback::parse);
                    self.out.sandbox.unavailable = Some(fallback.ok_or_else(|| {
                        self.invalid(format!("'{at}' must be \"refuse\" or \"unconfined\""))
                    })?);
                }
                "mcp_servers" => self.out.sandbox.mcp_servers = Some(mode(value)?),
                "env_passthrough" => self.out.sandbox.env_passthrough = self.strings(&at, value)?,
                _ => self.warn(format!("unknown key '{at}' ignored")),
            }
        }
        Ok(())
    }

    fn strings(&self, at: &str, value: &Value) -> Result<Vec<String>, SettingsError> {
        value
            .as_array()
            .and_then(|items| {
                items
                    .iter()
                    .map(|v| v.as_str().map(str::to_owned))
                    .collect()
            })
            .ok_or_else(|| self.invalid(format!("'{at}' must be an array of strings")))
    }

    /// Absolute paths or `~/…`: a relative one would mean a different place in every run.
    fn paths(&self, at: &str, value: &Value) -> Result<Vec<String>, SettingsError> {
        let paths = self.strings(at, value)?;
        if let Some(bad) = paths
            .iter()
            .find(|p| !(p.starts_with('/') || p.starts_with("~/") || *p == "~"))
        {
            return Err(self.invalid(format!(
                "'{at}' holds `{bad}`: paths must be absolute or start with ~/"
            )));
        }
        Ok(paths)
    }

    fn rule(&mut self, idx: usize, rule: &Value) -> Result<(), SettingsError> {
        let at = format!("permissions.rules[{idx}]");
        let Value::Object(fields) = rule else {
            return Err(self.invalid(format!("'{at}' must be an object")));
        };
        let Some(pattern) = fields.get("pattern").and_then(Value::as_str) else {
            return Err(self.invalid(format!("'{at}.pattern' must be a string")));
        };
        let action = fields.get("action").and_then(Value::as_str);
        let Some(action) = action.and_then(Action::parse) else {
            return Err(self.invalid(format!(
                "'{at}.action' must be \"allow\", \"ask\" or \"deny\""
            )));
        };
        let reason = match fields.get("reason") {
            None | Some(Value::Null) => None,
            Some(Value::String(reason)) => Some(reason.clone()),
            Some(_) => return Err(self.invalid(format!("'{at}.reason' must be a string"))),
        };
        for key in fields.keys() {
            // `comment` is for humans; `expires_at` is reserved upstream, parsed and ignored.
            if !matches!(
                key.as_str(),
                "pattern" | "action" | "reason" | "comment" | "expires_at"
            ) {
                self.warn(format!("unknown key '{at}.{key}' ignored"));
            }
        }
        self.push_rule(pattern, action, reason);
        Ok(())
    }

    fn push_rule(&mut self, pattern: &str, action: Action, reason: Option<String>) {
        match Rule::new(pattern, action, reason, self.source) {
            Ok(rule) => self.out.rules.push(rule),
            Err(error) => self.warn(format!("{error}; {} rule dropped", action.as_str())),
        }
    }
}

fn non_null<'v>(map: &'v Map<String, Value>, key: &str) -> Option<&'v Value> {
    map.get(key).filter(|value| !value.is_null())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A fresh directory under the system temp dir, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new() -> TempDir {
            static NEXT: AtomicUsize = AtomicUsize::new(0);
            let name = format!(
                "caliban-settings-test-{}-{}",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            );
            let dir = std::env::temp_dir().join(name);
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).expect("temp dir is creatable");
            TempDir(dir)
        }

        fn write(&self, rel: &str, text: &str) -> PathBuf {
            let path = self.0.join(rel);
            std::fs::create_dir_all(path.parent().expect("test paths have a parent"))
                .expect("parent is creatable");
            std::fs::write(&path, text).expect("test file is writable");
            path
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// Layout: `<tmp>/ws` is the workspace, `<tmp>/home` is `$HOME`.
    fn load_in(tmp: &TempDir, vars: &[(&str, String)]) -> Result<Settings, SettingsError> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(key, value)| (key.to_string(), value.clone()))
            .collect();
        load(&tmp.0.join("ws"), &|key| vars.get(key).cloned())
    }

    fn home(tmp: &TempDir) -> Vec<(&'static str, String)> {
        vec![("HOME", tmp.0.join("home").to_string_lossy().into_owned())]
    }

    fn patterns(settings: &Settings) -> Vec<(&str, Action, RuleSource)> {
        settings
            .rules
            .iter()
            .map(|rule| (rule.pattern.as_str(), rule.action, rule.source))
            .collect()
    }

    #[test]
    fn no_files_is_fine() {
        let tmp = TempDir::new();
        let settings = load_in(&tmp, &home(&tmp)).unwrap();
        assert!(settings.provider.is_none() && settings.default_mode.is_none());
        assert!(settings.rules.is_empty() && settings.warnings.is_empty());
        // No HOME and no XDG_CONFIG_HOME: just the workspace files.
        assert!(load_in(&tmp, &[]).unwrap().rules.is_empty());
    }

    #[test]
    fn priority_and_rule_order() {
        let tmp = TempDir::new();
        tmp.write(
            "ws/.caliban/settings.local.json",
            r#"{"model": "local-model", "max_turns": null,
                "permissions": {"allow": ["Bash(make:*)"]}}"#,
        );
        tmp.write(
            "ws/.caliban/settings.json",
            r#"{"model": "project-model", "max_turns": 7, "provider": "openai",
                "permissions": {
                  "default_mode": "acceptEdits",
                  "allow": ["Bash(git *)"], "ask": ["Write"], "deny": ["Read(.env)"],
                  "rules": [{"pattern": "Bash:cargo *", "action": "allow", "comment": "ok"},
                            {"pattern": "Bash:rm *", "action": "deny", "reason": "no"}]}}"#,
        );
        tmp.write(
            "home/.config/caliban/settings.json",
            r#"{"$schema": "x", "provider": "anthropic", "max_tokens": 4096, "max_turns": 9,
                "permissions": {"default_mode": "plan", "rules": [{"pattern": "*", "action": "ask"}]}}"#,
        );
        let settings = load_in(&tmp, &home(&tmp)).unwrap();
        assert_eq!(settings.model.as_deref(), Some("local-model"));
        assert_eq!(settings.provider.as_deref(), Some("openai"));
        assert_eq!(settings.max_turns, Some(7));
        assert_eq!(settings.max_tokens, Some(4096));
        assert_eq!(settings.default_mode, Some(Mode::AcceptEdits));
        assert_eq!(
            patterns(&settings),
            [
                ("Bash(make:*)", Action::Allow, RuleSource::Project),
                ("Bash:cargo *", Action::Allow, RuleSource::Project),
                ("Bash:rm *", Action::Deny, RuleSource::Project),
                ("Read(.env)", Action::Deny, RuleSource::Project),
                ("Write", Action::Ask, RuleSource::Project),
                ("Bash(git *)", Action::Allow, RuleSource::Project),
                ("*", Action::Ask, RuleSource::User),
            ]
        );
        assert_eq!(settings.rules[2].reason.as_deref(), Some("no"));
        assert!(settings.warnings.is_empty(), "{:?}", settings.warnings);
    }

    #[test]
    fn xdg_config_home_wins_over_home() {
        let tmp = TempDir::new();
        tmp.write("home/.config/caliban/settings.json", r#"{"model": "home"}"#);
        tmp.write("xdg/caliban/settings.json", r#"{"model": "xdg"}"#);
        let mut vars = home(&tmp);
        vars.push((
            "XDG_CONFIG_HOME",
            tmp.0.join("xdg").to_string_lossy().into_owned(),
        ));
        assert_eq!(load_in(&tmp, &vars).unwrap().model.as_deref(), Some("xdg"));
        // A relative XDG_CONFIG_HOME is ignored, as the spec says.
        let mut vars = home(&tmp);
        vars.push(("XDG_CONFIG_HOME", "relative".to_owned()));
        assert_eq!(load_in(&tmp, &vars).unwrap().model.as_deref(), Some("home"));
    }

    #[test]
    fn malformed_json_names_file_and_position() {
        let tmp = TempDir::new();
        let path = tmp.write("ws/.caliban/settings.json", "{\n  \"model\": \"x\",\n}");
        let err = load_in(&tmp, &home(&tmp)).unwrap_err();
        assert!(matches!(err, SettingsError::Parse { .. }));
        let message = err.to_string();
        assert!(
            message.starts_with(&format!("malformed settings file {}: ", path.display())),
            "{message}"
        );
        assert!(message.contains("line 3 column 1"), "{message}");
    }

    #[test]
    fn unreadable_file_is_an_error() {
        let tmp = TempDir::new();
        std::fs::create_dir_all(tmp.0.join("ws/.caliban/settings.json")).unwrap();
        let err = load_in(&tmp, &home(&tmp)).unwrap_err();
        assert!(matches!(err, SettingsError::Read { .. }), "{err}");
        assert!(err.to_string().starts_with("cannot read settings file "));
    }

    #[test]
    fn oversized_file_is_an_error() {
        let tmp = TempDir::new();
        let big = format!(
            "{{\"model\": \"{}\"}}",
            "x".repeat(MAX_SETTINGS_BYTES as usize)
        );
        tmp.write("ws/.caliban/settings.json", &big);
        let err = load_in(&tmp, &home(&tmp)).unwrap_err();
        assert!(matches!(err, SettingsError::TooLarge { .. }), "{err}");
    }

    #[test]
    fn unknown_keys_and_bad_patterns_warn() {
        let tmp = TempDir::new();
        let path = tmp.write(
            "ws/.caliban/settings.json",
            r#"{"colour": "blue",
                "permissions": {"enforce": true,
                  "rules": [{"pattern": "Bash(git *", "action": "deny", "note": "x"},
                            {"pattern": "Bash(ls)", "action": "allow"}],
                  "deny": ["Read([z-a])"]}}"#,
        );
        let settings = load_in(&tmp, &home(&tmp)).unwrap();
        assert_eq!(
            patterns(&settings),
            [("Bash(ls)", Action::Allow, RuleSource::Project)]
        );
        let file = path.display().to_string();
        assert_eq!(
            settings.warnings,
            [
                format!("{file}: unknown key 'colour' ignored"),
                format!("{file}: unknown key 'permissions.enforce' ignored"),
                format!("{file}: unknown key 'permissions.rules[0].note' ignored"),
                format!(
                    "{file}: invalid permission pattern 'Bash(git *': '(' is not closed by a \
                     ')' at the end; deny rule dropped"
                ),
                format!(
                    "{file}: invalid permission pattern 'Read([z-a])': invalid character range \
                     'z-a'; deny rule dropped"
                ),
            ]
        );
    }

    #[test]
    fn invalid_values_are_errors() {
        let cases = [
            ("[]", "expected a JSON object at the top level"),
            (r#"{"provider": "google"}"#, "unknown provider 'google'"),
            (r#"{"model": 3}"#, "'model' must be a non-empty string"),
            (
                r#"{"max_tokens": 0}"#,
                "'max_tokens' must be a positive integer",
            ),
            (
                r#"{"max_turns": 5000000000}"#,
                "'max_turns' must be a positive integer",
            ),
            (r#"{"permissions": []}"#, "'permissions' must be an object"),
            (
                r#"{"permissions": {"default_mode": "yolo"}}"#,
                "'permissions.default_mode' must be one of default, acceptEdits, plan, \
                 dontAsk, bypassPermissions, not \"yolo\"",
            ),
            (
                r#"{"permissions": {"rules": [{"pattern": "Bash", "action": "alow"}]}}"#,
                "'permissions.rules[0].action' must be \"allow\", \"ask\" or \"deny\"",
            ),
            (
                r#"{"permissions": {"rules": [{"action": "allow"}]}}"#,
                "'permissions.rules[0].pattern' must be a string",
            ),
            (
                r#"{"permissions": {"allow": "Bash"}}"#,
                "'permissions.allow' must be an array of strings",
            ),
        ];
        for (text, want) in cases {
            let tmp = TempDir::new();
            tmp.write("ws/.caliban/settings.json", text);
            let err = load_in(&tmp, &home(&tmp)).unwrap_err();
            assert!(
                matches!(err, SettingsError::Invalid { .. }),
                "{text}: {err}"
            );
            assert!(err.to_string().contains(want), "{text}: {err}");
        }
    }

    #[test]
    fn workspace_cannot_bypass_permissions() {
        let tmp = TempDir::new();
        tmp.write(
            "ws/.caliban/settings.json",
            r#"{"permissions": {"default_mode": "bypassPermissions"}}"#,
        );
        tmp.write(
            "home/.config/caliban/settings.json",
            r#"{"permissions": {"default_mode": "dontAsk"}}"#,
        );
        let settings = load_in(&tmp, &home(&tmp)).unwrap();
        assert_eq!(settings.default_mode, Some(Mode::DontAsk));
        assert_eq!(settings.warnings.len(), 1);
        assert!(settings.warnings[0].contains("bypassPermissions is ignored"));

        let tmp = TempDir::new();
        tmp.write(
            "home/.config/caliban/settings.json",
            r#"{"permissions": {"default_mode": "bypassPermissions"}}"#,
        );
        let settings = load_in(&tmp, &home(&tmp)).unwrap();
        assert_eq!(settings.default_mode, Some(Mode::BypassPermissions));
    }

    #[test]
    fn a_workspace_may_narrow_the_sandbox_but_not_widen_it() {
        let tmp = TempDir::new();
        tmp.write(
            "home/.config/caliban/settings.json",
            r#"{"sandbox": {"mode": "network", "network_ports": [443], "writable": ["~/.cache"],
                            "protected_writable": [".git/"], "unavailable": "unconfined",
                            "deny_read": ["/srv/keys"], "allow_read": ["~/.npmrc"],
                            "mcp_servers": "workspace-write"}}"#,
        );
        tmp.write(
            "ws/.caliban/settings.json",
            r#"{"sandbox": {"mode": "off", "writable": ["/"], "deny_read": ["~/notes"],
                            "protected_writable": [".caliban/"], "unavailable": "unconfined"}}"#,
        );
        tmp.write(
            "ws/.caliban/settings.local.json",
            r#"{"sandbox": {"mode": "read-only"}}"#,
        );
        let settings = load_in(&tmp, &home(&tmp)).unwrap();
        let sandbox = &settings.sandbox;
        assert_eq!(sandbox.mode, Some(sandbox::Mode::Network));
        // `off` and `read-only` from the workspace: the strictest counts, as a narrowing.
        assert_eq!(sandbox.project_mode, Some(sandbox::Mode::ReadOnly));
        assert_eq!(sandbox.network_ports, [443]);
        assert_eq!(sandbox.writable, ["~/.cache"]);
        assert_eq!(sandbox.protected_writable, [".git/"]);
        assert_eq!(sandbox.unavailable, Some(sandbox::Fallback::Unconfined));
        assert_eq!(sandbox.mcp_servers, Some(sandbox::Mode::WorkspaceWrite));
        assert_eq!(sandbox.deny_read, ["~/notes", "/srv/keys"]);
        assert_eq!(sandbox.allow_read, ["~/.npmrc"]);
        let ignored = settings
            .warnings
            .iter()
            .filter(|w| w.contains("ignored in workspace settings"))
            .count();
        assert_eq!(ignored, 3, "{:?}", settings.warnings);

        for bad in [
            r#"{"sandbox": {"mode": "yolo"}}"#,
            r#"{"sandbox": {"network_ports": [0]}}"#,
            r#"{"sandbox": {"writable": ["relative/dir"]}}"#,
            r#"{"sandbox": {"unavailable": "maybe"}}"#,
            r#"{"sandbox": "off"}"#,
        ] {
            let tmp = TempDir::new();
            tmp.write("home/.config/caliban/settings.json", bad);
            assert!(load_in(&tmp, &home(&tmp)).is_err(), "{bad}");
        }
    }

    #[test]
    fn cli_rules_deny_first() {
        let strings = |items: &[&str]| items.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let rules = rules_from_cli(
            &strings(&["Bash(git *)", "Read"]),
            &strings(&["Bash(git push:*)"]),
            &strings(&["Write"]),
        )
        .unwrap();
        let got: Vec<(&str, Action, RuleSource)> = rules
            .iter()
            .map(|rule| (rule.pattern.as_str(), rule.action, rule.source))
            .collect();
        assert_eq!(
            got,
            [
                ("Bash(git push:*)", Action::Deny, RuleSource::Cli),
                ("Write", Action::Ask, RuleSource::Cli),
                ("Bash(git *)", Action::Allow, RuleSource::Cli),
                ("Read", Action::Allow, RuleSource::Cli),
            ]
        );
        let err = rules_from_cli(&strings(&["Bash()"]), &[], &[]).unwrap_err();
        assert!(matches!(err, PatternError::EmptyArgument { .. }));
    }

    #[test]
    fn loaded_rules_drive_a_policy() {
        use crate::permissions::Policy;
        let tmp = TempDir::new();
        tmp.write(
            "ws/.caliban/settings.json",
            r#"{"permissions": {"allow": ["Bash(cargo test:*)"], "deny": ["Bash:~--force"]}}"#,
        );
        let settings = load_in(&tmp, &home(&tmp)).unwrap();
        let policy = Policy::new(settings.rules, Mode::Default, tmp.0.join("ws"));
        let decide = |command: &str| {
            policy
                .decide("Bash", &serde_json::json!({ "command": command }))
                .action
        };
        assert_eq!(decide("cargo test -q"), Action::Allow);
        assert_eq!(decide("cargo test --force"), Action::Deny);
        assert_eq!(decide("cargo build"), Action::Ask);
    }
}
