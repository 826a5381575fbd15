//! Approval of project-scoped MCP servers: those a file in the workspace names (`.mcp.json`,
//! `.caliban/settings*.json`). Cloning a repository must not be enough to make caliban run
//! a command from it, so such a server starts only once the user approved it, in one of
//! three ways, none of them writable from inside the workspace:
//!
//! - `--approve-mcp NAME` (repeatable; `all` for every server of the workspace) on any
//!   command: approves for this start and records the approval in the approvals file, so
//!   later starts need no flag;
//! - the approvals file, `$XDG_STATE_HOME/caliban/mcp-approvals.json`
//!   (`{"<workspace>": {"<server>": {"config": "<digest>", "files": {"<name>": "<digest>"}}}}`):
//!   an approval holds while the server's entry as written (command, arguments, `env`,
//!   URL, `headers`, before `${VAR}` expansion) and the workspace files its command and
//!   arguments name stay what they were (`ServerConfig::fingerprint`); an editor's
//!   "always reject" is kept there too (`"rejected": true`), so that server is not asked
//!   about again (`--approve-mcp` still approves it). An approval recorded by an older
//!   caliban (a bare string, which covered neither headers nor files) matches nothing: the
//!   server is asked about once more;
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

use super::config::{Fingerprint, Origin, Parsed, ServerConfig};

/// Largest approvals file read; it holds a line per approved server.
const MAX_APPROVALS_BYTES: u64 = 1 << 20;

/// What `Approvals::admit` leaves of the configured servers: those to start, the
/// workspace's servers still awaiting the user's approval (an ACP editor is asked about
/// them), and warnings to log.
pub type Admitted = (Vec<ServerConfig>, Vec<ServerConfig>, Vec<String>);

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
    /// What the file said: workspace → server → what was approved or rejected.
    recorded: BTreeMap<String, BTreeMap<String, Recorded>>,
}

/// One server's entry in the approvals file.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Recorded {
    /// Approved (or, `rejected`, refused for good) as it was then.
    Judged {
        fingerprint: Fingerprint,
        rejected: bool,
    },
    /// An entry in the format of an older caliban (whose fingerprint covered neither
    /// headers nor files), or one not understood: it matches nothing, so it is re-asked.
    Old(Value),
}

impl Recorded {
    fn parse(value: &Value) -> Recorded {
        let judged = || {
            let fields = value.as_object()?;
            let config = fields.get("config")?.as_str()?.to_owned();
            let files = match fields.get("files") {
                None => BTreeMap::new(),
                Some(files) => files
                    .as_object()?
                    .iter()
                    .map(|(name, digest)| Some((name.clone(), digest.as_str()?.to_owned())))
                    .collect::<Option<_>>()?,
            };
            let rejected = fields.get("rejected").is_some_and(|r| *r == json!(true));
            Some(Recorded::Judged {
                fingerprint: Fingerprint { config, files },
                rejected,
            })
        };
        judged().unwrap_or_else(|| Recorded::Old(value.clone()))
    }

    fn to_json(&self) -> Value {
        match self {
            Recorded::Judged {
                fingerprint,
                rejected,
            } => {
                let mut out = json!({"config": fingerprint.config, "files": fingerprint.files});
                if *rejected {
                    out["rejected"] = json!(true);
                }
                out
            }
            Recorded::Old(value) => value.clone(),
        }
    }
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
                    .map(|(name, entry)| (name.clone(), Recorded::parse(entry)))
                    .collect();
                self.recorded.insert(workspace, servers);
            }
        }
        self
    }

    fn by_cli(&self, name: &str) -> bool {
        self.cli.iter().any(|n| n == name || n == "all")
    }

    fn recorded(&self, workspace: &Path, server: &ServerConfig) -> Option<&Recorded> {
        self.recorded
            .get(&workspace.display().to_string())
            .and_then(|servers| servers.get(&server.name))
    }

    /// Whether the file records `server` as judged (`rejected` or not) exactly as it is now.
    fn judged(&self, workspace: &Path, server: &ServerConfig, as_rejected: bool) -> bool {
        matches!(
            self.recorded(workspace, server),
            Some(Recorded::Judged { fingerprint, rejected })
                if *rejected == as_rejected && *fingerprint == server.fingerprint(workspace)
        )
    }

    pub fn approves(&self, workspace: &Path, server: &ServerConfig) -> bool {
        self.by_cli(&server.name)
            || self.user_all
            || self.user_enabled.contains(&server.name)
            || self.judged(workspace, server, false)
    }

    /// Whether the user rejected `server` of `workspace` for good (an editor's "always
    /// reject"), as it is now.
    pub fn rejects(&self, workspace: &Path, server: &ServerConfig) -> bool {
        self.judged(workspace, server, true)
    }

    /// Why a server the file records as approved is not approved as it is now: which file
    /// changed, or that its configuration did, or that the approval is of an older format.
    pub fn stale(&self, workspace: &Path, server: &ServerConfig) -> Option<String> {
        match self.recorded(workspace, server)? {
            Recorded::Old(_) => Some(
                "its approval was recorded by an older caliban, whose approvals did not cover \
                 headers or the files a server runs; approve it once more"
                    .to_owned(),
            ),
            Recorded::Judged { rejected: true, .. } => None,
            Recorded::Judged { fingerprint, .. } => {
                let now = server.fingerprint(workspace);
                if now.config != fingerprint.config {
                    return Some("its configuration changed since it was approved".to_owned());
                }
                let changed = fingerprint
                    .files
                    .iter()
                    .find(|(name, digest)| now.files.get(*name) != Some(digest))
                    .map(|(name, _)| name)
                    .or_else(|| {
                        now.files
                            .keys()
                            .find(|n| !fingerprint.files.contains_key(*n))
                    });
                changed.map(|name| format!("`{name}` changed since it was approved"))
            }
        }
    }

    /// Which configured servers (`config::merge`: precedence order, with its warnings) start:
    /// the user's own, and the workspace's once approved, pinned to what was approved
    /// (`ServerConfig::pin`); the rest wait for approval or, rejected for good, stay out, each
    /// with a warning. This is everything `app` hands the engine about MCP servers.
    pub fn admit(&self, workspace: &Path, (configured, mut warnings): Parsed) -> Admitted {
        let mut servers = Vec::new();
        let mut unapproved = Vec::new();
        for mut server in configured {
            if server.origin == Origin::Project
                && !self.approves(workspace, &server)
                && self.rejects(workspace, &server)
            {
                warnings.push(format!(
                    "MCP server `{}` ({}) comes from the workspace and was rejected for it, so it \
                     is not started; approve it with `--approve-mcp {}` if you changed your mind",
                    server.name,
                    server.describe(),
                    server.name
                ));
                continue;
            }
            if server.origin == Origin::Project && !self.approves(workspace, &server) {
                let why = self
                    .stale(workspace, &server)
                    .map(|why| format!(" ({why})"))
                    .unwrap_or_default();
                warnings.push(format!(
                    "MCP server `{}` ({}) comes from the workspace and is not approved{why}, so \
                     it is not started; approve it with `--approve-mcp {}` (remembered for this \
                     workspace), or list it in `enabledMcpjsonServers` in your user settings \
                     (`acp serve` asks the editor when a session opens)",
                    server.name,
                    server.describe(),
                    server.name
                ));
                unapproved.push(server);
                continue;
            }
            if server.origin == Origin::Project {
                server.pin(workspace);
            }
            servers.push(server);
        }
        (servers, unapproved, warnings)
    }

    /// Records the approvals `--approve-mcp` gave for `servers` of `workspace`, so the next
    /// start needs no flag. Failing to write is a warning: this start goes ahead.
    pub fn record(&mut self, workspace: &Path, servers: &[ServerConfig]) -> Result<(), String> {
        let approved: Vec<&ServerConfig> =
            servers.iter().filter(|s| self.by_cli(&s.name)).collect();
        self.write(workspace, &approved, false)
    }

    /// Records that the user approved `server` of `workspace` for good (an ACP editor's
    /// "always allow"), in the same file `--approve-mcp` writes.
    pub fn remember(&mut self, workspace: &Path, server: &ServerConfig) -> Result<(), String> {
        self.write(workspace, &[server], false)
    }

    /// Records that the user rejected `server` of `workspace` for good (an editor's
    /// "always reject"): it is not asked about again while it stays the same.
    pub fn reject(&mut self, workspace: &Path, server: &ServerConfig) -> Result<(), String> {
        self.write(workspace, &[server], true)
    }

    fn write(
        &mut self,
        workspace: &Path,
        servers: &[&ServerConfig],
        rejected: bool,
    ) -> Result<(), String> {
        let Some(path) = self.file.clone() else {
            return Ok(());
        };
        let key = workspace.display().to_string();
        let mut changed = false;
        for server in servers {
            let entry = self.recorded.entry(key.clone()).or_default();
            let judged = Recorded::Judged {
                fingerprint: server.fingerprint(workspace),
                rejected,
            };
            if entry.get(&server.name) != Some(&judged) {
                entry.insert(server.name.clone(), judged);
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
                .map(|(n, recorded)| (n.clone(), recorded.to_json()))
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
    use crate::mcp_client::config::{Transport, merge};

    /// No variable is set: the servers of these tests name none.
    fn env(_: &str) -> Option<String> {
        None
    }

    fn server(name: &str, command: &str) -> ServerConfig {
        ServerConfig {
            name: name.into(),
            transport: Transport::Stdio {
                command: command.into(),
                args: vec![],
                env: vec![],
            },
            origin: Origin::Project,
            written: String::new(),
            pinned: None,
        }
    }

    #[test]
    fn an_approval_of_the_old_format_is_asked_again_and_a_changed_file_is_named() {
        let dir = std::env::temp_dir().join(format!("caliban-approvals-v1-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("mcp-approvals.json");
        let ws = dir.join("ws");
        std::fs::create_dir_all(&ws).unwrap();
        let key = ws.display().to_string();
        std::fs::write(
            &file,
            json!({ key.clone(): {"old": "0123456789abcdef"} }).to_string(),
        )
        .unwrap();
        let old = Approvals::new(vec![], vec![], false, Some(file.clone()));
        assert!(!old.approves(&ws, &server("old", "x")));
        assert!(!old.rejects(&ws, &server("old", "x")));
        assert!(
            old.stale(&ws, &server("old", "x"))
                .unwrap()
                .contains("older caliban")
        );

        std::fs::write(ws.join("tool_server.py"), "print(1)").unwrap();
        let mut script = server("py", "python3");
        script.transport = Transport::Stdio {
            command: "python3".into(),
            args: vec!["tool_server.py".into()],
            env: vec![],
        };
        let mut approvals = Approvals::new(vec![], vec![], false, Some(file.clone()));
        approvals.remember(&ws, &script).unwrap();
        let later = Approvals::new(vec![], vec![], false, Some(file.clone()));
        assert!(later.approves(&ws, &script));
        assert!(
            later.stale(&ws, &server("old", "x")).is_some(),
            "the old entry is kept until re-approved"
        );
        std::fs::write(ws.join("tool_server.py"), "import os").unwrap();
        assert!(!later.approves(&ws, &script));
        assert_eq!(
            later.stale(&ws, &script).as_deref(),
            Some("`tool_server.py` changed since it was approved")
        );
        let _ = std::fs::remove_dir_all(&dir);
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

    #[test]
    fn sources_merge_by_precedence_and_workspace_servers_need_approval() {
        let ws = std::env::temp_dir().join(format!("caliban-mcp-config-{}", std::process::id()));
        std::fs::create_dir_all(&ws).unwrap();
        let stdio = |c: &str| json!({"command": c});
        std::fs::write(
            ws.join(".mcp.json"),
            json!({"mcpServers": {"a": stdio("json-a"), "b": stdio("json-b"), "c": stdio("json-c")}})
                .to_string(),
        )
        .unwrap();
        let cli = ws.join("cli.json");
        std::fs::write(
            &cli,
            json!({"mcpServers": {"a": stdio("cli-a")}}).to_string(),
        )
        .unwrap();
        let object = |v: Value| v.as_object().unwrap().clone();
        let settings = vec![
            (Origin::Project, object(json!({"b": stdio("project-b")}))),
            (
                Origin::User,
                object(json!({"c": stdio("user-c"), "d": stdio("user-d")})),
            ),
        ];
        let command = |servers: &[ServerConfig], name: &str| {
            servers
                .iter()
                .find(|s| s.name == name)
                .map(|s| match &s.transport {
                    Transport::Stdio { command, .. } => command.clone(),
                    _ => String::new(),
                })
        };
        let none = Approvals::new(vec![], vec![], false, None);
        let merged = || merge(&ws, std::slice::from_ref(&cli), &settings, &env).unwrap();
        let (servers, unapproved, warnings) = none.admit(&ws, merged());
        let waiting: Vec<&str> = unapproved.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(waiting, ["b", "c"]);
        // `a` from --mcp-config (user's own), `d` from user settings; `b` (project settings
        // over .mcp.json) and `c` (.mcp.json over user settings) wait for approval.
        assert_eq!(command(&servers, "a").as_deref(), Some("cli-a"));
        assert_eq!(command(&servers, "d").as_deref(), Some("user-d"));
        assert_eq!(command(&servers, "b"), None);
        assert_eq!(command(&servers, "c"), None);
        assert_eq!(
            warnings
                .iter()
                .filter(|w| w.contains("not approved"))
                .count(),
            2
        );
        let all = Approvals::new(vec!["all".into()], vec![], false, None);
        let (servers, unapproved, _) = all.admit(&ws, merged());
        assert!(unapproved.is_empty());
        assert_eq!(command(&servers, "b").as_deref(), Some("project-b"));
        assert_eq!(command(&servers, "c").as_deref(), Some("json-c"));
        assert!(merge(&ws, &[ws.join("missing.json")], &[], &env).is_err());
        let _ = std::fs::remove_dir_all(&ws);
    }
}
