//! Approval of project-scoped MCP servers: those a file in the workspace names (`.mcp.json`,
//! `.caliban/settings*.json`). Cloning a repository must not be enough to make caliban run
//! a command from it, so such a server starts only once the user approved it, in one of
//! three ways, none of them writable from inside the workspace:
//!
//! - `--approve-mcp NAME` (repeatable; `all` for every server of the workspace) on any
//!   command: approves for this start and records the approval in the approvals file, so
//!   later starts need no flag;
//! - the approvals file, `$XDG_STATE_HOME/caliban/mcp-approvals.json`
//!   (`{"<workspace>": {"<server>": "<fingerprint>"}}`): an approval holds while the
//!   server's command, arguments, environment or URL stay what they were
//!   (`ServerConfig::fingerprint`); an editor's "always reject" is kept there too, as
//!   `"!<fingerprint>"`, so that server is not asked about again (`--approve-mcp` still
//!   approves it);
//! - Claude Code's user-settings keys `enabledMcpjsonServers` (names) and
//!   `enableAllProjectMcpServers`, read only from the user's own settings file.
//!
//! Unapproved servers are skipped with a warning that says how to approve them. `acp serve`
//! also asks the editor, once per server, when a session opens (`session/request_permission`):
//! "always allow" records the approval here, as `--approve-mcp` does; "allow" starts the
//! server for this process only; a rejection leaves it skipped, and the session says so.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value, json};

use super::config::ServerConfig;

/// Largest approvals file read; it holds a line per approved server.
const MAX_APPROVALS_BYTES: u64 = 1 << 20;

#[derive(Debug, Default)]
pub struct Approvals {
    /// `--approve-mcp` names; `all` approves every server.
    pub cli: Vec<String>,
    /// `enabledMcpjsonServers` from the user's settings.
    pub user_enabled: Vec<String>,
    /// `enableAllProjectMcpServers` from the user's settings.
    pub user_all: bool,
    /// The approvals file, if a state directory is known.
    pub file: Option<PathBuf>,
    /// What the file said: workspace → server → fingerprint.
    recorded: BTreeMap<String, BTreeMap<String, String>>,
}

/// Where approvals are recorded: next to the session files.
pub fn default_file(env: &dyn Fn(&str) -> Option<String>) -> Option<PathBuf> {
    if let Some(state) = env("XDG_STATE_HOME").filter(|dir| dir.starts_with('/')) {
        return Some(Path::new(&state).join("caliban/mcp-approvals.json"));
    }
    env("HOME")
        .filter(|home| !home.is_empty())
        .map(|home| Path::new(&home).join(".local/state/caliban/mcp-approvals.json"))
}

impl Approvals {
    pub fn new(
        cli: Vec<String>,
        user_enabled: Vec<String>,
        user_all: bool,
        file: Option<PathBuf>,
    ) -> Approvals {
        Approvals {
            cli,
            user_enabled,
            user_all,
            file,
            recorded: BTreeMap::new(),
        }
        .load()
    }

    /// Reads the approvals file (a missing or unreadable one approves nothing).
    fn load(mut self) -> Approvals {
        use std::io::Read;
        let Some(path) = &self.file else {
            return self;
        };
        let mut text = String::new();
        let read = std::fs::File::open(path)
            .and_then(|f| f.take(MAX_APPROVALS_BYTES).read_to_string(&mut text));
        if read.is_err() {
            return self;
        }
        if let Ok(Value::Object(workspaces)) = serde_json::from_str::<Value>(&text) {
            for (workspace, servers) in workspaces {
                let Some(servers) = servers.as_object() else {
                    continue;
                };
                let servers = servers
                    .iter()
                    .filter_map(|(name, fp)| Some((name.clone(), fp.as_str()?.to_owned())))
                    .collect();
                self.recorded.insert(workspace, servers);
            }
        }
        self
    }

    fn by_cli(&self, name: &str) -> bool {
        self.cli.iter().any(|n| n == name || n == "all")
    }

    pub fn approves(&self, workspace: &Path, server: &ServerConfig) -> bool {
        self.by_cli(&server.name)
            || self.user_all
            || self.user_enabled.contains(&server.name)
            || self
                .recorded
                .get(&workspace.display().to_string())
                .and_then(|servers| servers.get(&server.name))
                .is_some_and(|fp| *fp == server.fingerprint())
    }

    /// Whether the user rejected `server` of `workspace` for good (an editor's "always
    /// reject"), as it is now.
    pub fn rejects(&self, workspace: &Path, server: &ServerConfig) -> bool {
        self.recorded
            .get(&workspace.display().to_string())
            .and_then(|servers| servers.get(&server.name))
            .is_some_and(|fp| fp.strip_prefix('!') == Some(&server.fingerprint()))
    }

    /// Records the approvals `--approve-mcp` gave for `servers` of `workspace`, so the next
    /// start needs no flag. Failing to write is a warning: this start goes ahead.
    pub fn record(&mut self, workspace: &Path, servers: &[ServerConfig]) -> Result<(), String> {
        let approved: Vec<&ServerConfig> =
            servers.iter().filter(|s| self.by_cli(&s.name)).collect();
        self.write(workspace, &approved, "")
    }

    /// Records that the user approved `server` of `workspace` for good (an ACP editor's
    /// "always allow"), in the same file `--approve-mcp` writes.
    pub fn remember(&mut self, workspace: &Path, server: &ServerConfig) -> Result<(), String> {
        self.write(workspace, &[server], "")
    }

    /// Records that the user rejected `server` of `workspace` for good (an editor's
    /// "always reject"): it is not asked about again while it stays the same.
    pub fn reject(&mut self, workspace: &Path, server: &ServerConfig) -> Result<(), String> {
        self.write(workspace, &[server], "!")
    }

    fn write(
        &mut self,
        workspace: &Path,
        servers: &[&ServerConfig],
        mark: &str,
    ) -> Result<(), String> {
        let Some(path) = self.file.clone() else {
            return Ok(());
        };
        let key = workspace.display().to_string();
        let mut changed = false;
        for server in servers {
            let entry = self.recorded.entry(key.clone()).or_default();
            let fp = format!("{mark}{}", server.fingerprint());
            if entry.get(&server.name) != Some(&fp) {
                entry.insert(server.name.clone(), fp);
                changed = true;
            }
        }
        if !changed {
            return Ok(());
        }
        let mut out = Map::new();
        for (workspace, servers) in &self.recorded {
            let servers: Map<String, Value> = servers
                .iter()
                .map(|(n, fp)| (n.clone(), json!(fp)))
                .collect();
            out.insert(workspace.clone(), Value::Object(servers));
        }
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        }
        // Written whole to a temporary file and renamed, so a crash never leaves half.
        let tmp = path.with_extension(format!("json.{}", std::process::id()));
        let text = serde_json::to_string_pretty(&Value::Object(out)).unwrap_or_default();
        std::fs::write(&tmp, text + "\n")
            .and_then(|()| std::fs::rename(&tmp, &path))
            .map_err(|e| format!("{}: {e}", path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mcp_client::config::{Origin, Transport};

    fn server(name: &str, command: &str) -> ServerConfig {
        ServerConfig {
            name: name.into(),
            transport: Transport::Stdio {
                command: command.into(),
                args: vec![],
                env: vec![],
            },
            origin: Origin::Project,
        }
    }

    #[test]
    fn approvals_are_remembered_per_workspace_and_fingerprint() {
        let dir = std::env::temp_dir().join(format!("caliban-approvals-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let file = dir.join("a/mcp-approvals.json");
        let ws = Path::new("/ws");
        let mut first = Approvals::new(vec!["one".into()], vec![], false, Some(file.clone()));
        assert!(first.approves(ws, &server("one", "x")));
        assert!(!first.approves(ws, &server("two", "x")));
        first
            .record(ws, &[server("one", "x"), server("two", "x")])
            .unwrap();
        let later = Approvals::new(vec![], vec![], false, Some(file));
        assert!(later.approves(ws, &server("one", "x")));
        assert!(!later.approves(ws, &server("one", "changed")));
        assert!(!later.approves(Path::new("/other"), &server("one", "x")));
        assert!(!later.approves(ws, &server("two", "x")));
        let mut editor = Approvals::new(
            vec![],
            vec![],
            false,
            Some(dir.join("a/mcp-approvals.json")),
        );
        editor.remember(ws, &server("two", "x")).unwrap();
        let later = Approvals::new(
            vec![],
            vec![],
            false,
            Some(dir.join("a/mcp-approvals.json")),
        );
        assert!(
            later.approves(ws, &server("one", "x")),
            "kept beside the new one"
        );
        assert!(later.approves(ws, &server("two", "x")));
        let mut editor = Approvals::new(
            vec![],
            vec![],
            false,
            Some(dir.join("a/mcp-approvals.json")),
        );
        editor.reject(ws, &server("three", "x")).unwrap();
        let later = Approvals::new(
            vec![],
            vec![],
            false,
            Some(dir.join("a/mcp-approvals.json")),
        );
        assert!(later.rejects(ws, &server("three", "x")));
        assert!(!later.approves(ws, &server("three", "x")));
        assert!(
            !later.rejects(ws, &server("three", "changed")),
            "a changed server is asked again"
        );
        assert!(!later.rejects(ws, &server("two", "x")));
        let flag = Approvals::new(vec!["three".into()], vec![], false, None);
        assert!(
            flag.approves(ws, &server("three", "x")),
            "--approve-mcp still approves"
        );
        let user = Approvals::new(vec![], vec!["two".into()], false, None);
        assert!(user.approves(ws, &server("two", "x")));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
