//! Which MCP servers a run may use, read from the places users already write them:
//!
//! - Claude Code's object form, `{"mcpServers": {"name": {"command": …}}}`, in `.mcp.json`
//!   files, caliban's settings files and `--mcp-config FILE`;
//! - ACP's array form, `[{"name": …, "command": …, "env": [{"name", "value"}]}]`, in
//!   `session/new`.
//!
//! A server is `stdio` (a command), `http` (Streamable HTTP) or `sse` (the legacy HTTP+SSE
//! transport). Strings in the object form may name environment variables as `${VAR}` or
//! `${VAR:-default}` (as in Claude Code), which is how a bearer token reaches a header
//! without being written into a file: `"Authorization": "Bearer ${GITHUB_TOKEN}"`.
//!
//! Where a server came from decides whether it needs the user's approval (`Origin`):
//! a file in the workspace can be written by anyone who can get a commit into the
//! repository, so its servers (commands caliban would execute) start only once approved;
//! see `approval`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

/// Largest config file read (`.mcp.json`, `--mcp-config`): real ones are a few KiB.
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;
/// Most servers taken from one source: a file listing thousands is a mistake, and each
/// one is a process or a connection.
const MAX_SERVERS: usize = 64;

/// Looks up an environment variable (a closure, so tests need not touch the process's).
pub type Env<'a> = dyn Fn(&str) -> Option<String> + 'a;
/// Servers read from a source, and a warning for each one skipped.
pub type Parsed = (Vec<ServerConfig>, Vec<String>);

/// How caliban reaches a server.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Transport {
    /// A child process speaking newline-delimited JSON-RPC on its stdin and stdout.
    Stdio {
        command: String,
        args: Vec<String>,
        env: Vec<(String, String)>,
    },
    /// Streamable HTTP (protocol 2025-11-25): one endpoint for POST and GET.
    Http {
        url: String,
        headers: Vec<(String, String)>,
    },
    /// The legacy HTTP+SSE transport (2024-11-05): a GET event stream whose first event
    /// names the URL to POST messages to.
    Sse {
        url: String,
        headers: Vec<(String, String)>,
    },
}

/// Where a server's configuration came from, which decides whether it needs approval.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Origin {
    /// The user's own settings file, or a file the user named with `--mcp-config`.
    User,
    /// A file in the workspace (`.mcp.json`, `.caliban/settings*.json`): approval needed.
    Project,
    /// The client driving caliban named it (ACP `session/new`): the editor is the user's.
    Client,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ServerConfig {
    pub name: String,
    pub transport: Transport,
    pub origin: Origin,
    /// The entry as its file spells it, before `${VAR}` expansion (canonical JSON; empty
    /// for a literal source), so an approval covers a header or variable added later
    /// (`"X": "${ANTHROPIC_API_KEY}"`) without hashing the secrets it expands to.
    pub written: String,
    /// For an approved workspace server: the workspace files its command and arguments
    /// named, with their digests as approved. A start finding one changed refuses it
    /// (`changed_file`), so a file the model rewrote after approval never runs unasked.
    pub pinned: Option<BTreeMap<String, String>>,
}

/// Most files one server's approval pins: a command and its arguments name a script or two;
/// past this the rest are left out, which a long argument list cannot use to hide its
/// first script.
const MAX_PINNED_FILES: usize = 16;

/// Largest file whose contents an approval hashes: scripts are KiB. A larger one is pinned
/// by its size, inode and change time instead, which any rewrite changes too, without a
/// start reading a huge binary.
const MAX_PINNED_FILE_BYTES: u64 = 8 << 20;

/// Where the paths an MCP command names are pinned besides the workspace: the directories
/// every writing sandbox mode lets a command write in.
const PINNED_ROOTS: &[&str] = &["/tmp", "/var/tmp", "/dev/shm"];

/// What an approval of a server is an approval of: its configuration as written
/// (`config`) and the contents of the files it runs (`files`, by the name it gives them).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Fingerprint {
    pub config: String,
    pub files: BTreeMap<String, String>,
}

fn short_digest(bytes: &[u8]) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, bytes);
    digest.as_ref()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The digest `Fingerprint::files` holds for the regular file at `path`, or `None` when
/// there is none there.
fn file_digest(path: &Path) -> Option<String> {
    use std::io::Read;
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path).ok()?;
    if !meta.is_file() {
        return None;
    }
    if meta.len() > MAX_PINNED_FILE_BYTES {
        return Some(format!(
            "large:{}:{}:{}.{}",
            meta.len(),
            meta.ino(),
            meta.ctime(),
            meta.ctime_nsec()
        ));
    }
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .ok()?
        .take(MAX_PINNED_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .ok()?;
    Some(short_digest(&bytes))
}

impl ServerConfig {
    /// What an approval of this server covers, judged from `workspace` (where a stdio
    /// server starts): the entry as written and its expanded command, arguments or URL,
    /// and the contents of each regular file the command or an argument names in the
    /// workspace or a temp directory, all places a command may write.
    pub fn fingerprint(&self, workspace: &Path) -> Fingerprint {
        let text = match &self.transport {
            Transport::Stdio { command, args, .. } => {
                format!("stdio\0{command}\0{}", args.join("\0"))
            }
            Transport::Http { url, .. } => format!("http\0{url}"),
            Transport::Sse { url, .. } => format!("sse\0{url}"),
        };
        let config = short_digest(format!("v2\0{text}\0{}", self.written).as_bytes());
        Fingerprint {
            config,
            files: self.named_files(workspace),
        }
    }

    /// The regular files the command (when it is a path, not a name looked up in `PATH`)
    /// and the arguments name, by that name, with their digests.
    fn named_files(&self, workspace: &Path) -> BTreeMap<String, String> {
        let Transport::Stdio { command, args, .. } = &self.transport else {
            return BTreeMap::new();
        };
        let root = workspace
            .canonicalize()
            .unwrap_or_else(|_| workspace.to_path_buf());
        let command = command.contains('/').then_some(command);
        let mut files = BTreeMap::new();
        for named in command.into_iter().chain(args) {
            if files.len() >= MAX_PINNED_FILES {
                break;
            }
            if named.is_empty() || files.contains_key(named) {
                continue;
            }
            let path = workspace.join(named);
            let Ok(resolved) = path.canonicalize() else {
                continue;
            };
            let writable = |p: &Path| {
                p.starts_with(&root)
                    || p.starts_with(workspace)
                    || PINNED_ROOTS.iter().any(|dir| p.starts_with(dir))
            };
            if !(writable(&path) || writable(&resolved)) {
                continue;
            }
            if let Some(digest) = file_digest(&resolved) {
                files.insert(named.clone(), digest);
            }
        }
        files
    }

    /// Pins the files the server runs as they are now, when it is approved.
    pub fn pin(&mut self, workspace: &Path) {
        self.pinned = Some(self.named_files(workspace));
    }

    /// For a server approved with its files pinned, the first file whose contents are no
    /// longer those approved (or that appeared or went since), by the name it was given.
    pub fn changed_file(&self, workspace: &Path) -> Option<String> {
        let pinned = self.pinned.as_ref()?;
        let now = self.named_files(workspace);
        pinned
            .iter()
            .find(|(name, digest)| now.get(*name) != Some(digest))
            .map(|(name, _)| name.clone())
            .or_else(|| now.keys().find(|name| !pinned.contains_key(*name)).cloned())
    }

    /// A human description for logs and the approval message: what runs or is reached,
    /// and the environment variables its entry expands (by name, never their values), so
    /// one approving it sees that a header or `env` would carry `${ANTHROPIC_API_KEY}`.
    pub fn describe(&self) -> String {
        let what = match &self.transport {
            Transport::Stdio { command, args, .. } if args.is_empty() => command.clone(),
            Transport::Stdio { command, args, .. } => format!("{command} {}", args.join(" ")),
            Transport::Http { url, .. } => format!("{url} (Streamable HTTP)"),
            Transport::Sse { url, .. } => format!("{url} (HTTP+SSE)"),
        };
        let names = self.variables();
        if names.is_empty() {
            what
        } else {
            format!("{what}; it is given ${{{}}}", names.join("}, ${"))
        }
    }

    /// The variables the entry as written names (`${VAR}`, `${VAR:-default}`), in order.
    fn variables(&self) -> Vec<String> {
        let mut names: Vec<String> = Vec::new();
        let mut rest = self.written.as_str();
        while let Some(at) = rest.find("${") {
            let after = &rest[at + 2..];
            let Some(end) = after.find('}') else { break };
            let name = after[..end].split(":-").next().unwrap_or_default();
            if !name.is_empty() && !names.iter().any(|n| n == name) {
                names.push(name.to_owned());
            }
            rest = &after[end + 1..];
        }
        names
    }
}

/// `${VAR}` and `${VAR:-default}` replaced from `env`; an unset variable without a default
/// becomes empty and is reported.
pub fn expand(
    text: &str,
    env: &dyn Fn(&str) -> Option<String>,
    missing: &mut Vec<String>,
) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("${") {
        out.push_str(&rest[..at]);
        let after = &rest[at + 2..];
        let Some(end) = after.find('}') else {
            out.push_str(&rest[at..]);
            return out;
        };
        let inner = &after[..end];
        let (name, default) = match inner.split_once(":-") {
            Some((name, default)) => (name, Some(default)),
            None => (inner, None),
        };
        match env(name).or_else(|| default.map(str::to_owned)) {
            Some(value) => out.push_str(&value),
            None => missing.push(name.to_owned()),
        }
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    out
}

fn string_list(value: Option<&Value>) -> Vec<String> {
    value
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

/// `{"K": "V"}` or `[{"name": "K", "value": "V"}]` as pairs.
fn pairs(value: Option<&Value>) -> Vec<(String, String)> {
    match value {
        Some(Value::Array(vars)) => vars
            .iter()
            .filter_map(|v| {
                Some((
                    v.get("name")?.as_str()?.to_owned(),
                    v.get("value")?.as_str()?.to_owned(),
                ))
            })
            .collect(),
        Some(Value::Object(vars)) => vars
            .iter()
            .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned())))
            .collect(),
        _ => Vec::new(),
    }
}

/// One server's entry; `Err` says why it is skipped.
/// `env` is `None` for a source whose strings are literal.
fn parse_entry(
    name: &str,
    raw: &Value,
    origin: Origin,
    env: Option<&Env<'_>>,
) -> Result<ServerConfig, String> {
    if name.is_empty() {
        return Err("an MCP server without a name; skipping it".to_owned());
    }
    if !raw.is_object() {
        return Err(format!("MCP server `{name}`: not an object; skipping it"));
    }
    let mut missing = Vec::new();
    let mut x = |s: &str| match env {
        Some(env) => expand(s, env, &mut missing),
        None => s.to_owned(),
    };
    let kind = raw.get("type").and_then(Value::as_str);
    let url = raw.get("url").and_then(Value::as_str);
    let transport = match (kind, raw.get("command").and_then(Value::as_str), url) {
        (None | Some("stdio"), Some(command), _) => Transport::Stdio {
            command: x(command),
            args: string_list(raw.get("args")).iter().map(|a| x(a)).collect(),
            env: pairs(raw.get("env"))
                .into_iter()
                .map(|(k, v)| (k, x(&v)))
                .collect(),
        },
        (Some("http" | "streamable-http" | "streamableHttp"), _, Some(url))
        | (None, None, Some(url)) => Transport::Http {
            url: x(url),
            headers: pairs(raw.get("headers"))
                .into_iter()
                .map(|(k, v)| (k, x(&v)))
                .collect(),
        },
        (Some("sse"), _, Some(url)) => Transport::Sse {
            url: x(url),
            headers: pairs(raw.get("headers"))
                .into_iter()
                .map(|(k, v)| (k, x(&v)))
                .collect(),
        },
        (Some(kind @ ("http" | "sse" | "streamable-http" | "streamableHttp")), _, None) => {
            return Err(format!(
                "MCP server `{name}`: a {kind} server needs a `url`; skipping it"
            ));
        }
        (None | Some("stdio"), None, None) => {
            return Err(format!("MCP server `{name}`: no `command`; skipping it"));
        }
        (Some(kind), _, _) => {
            return Err(format!(
                "MCP server `{name}`: unknown type `{kind}` (expected stdio, http or sse); skipping it"
            ));
        }
    };
    if let Transport::Http { url, .. } | Transport::Sse { url, .. } = &transport
        && let Err(e) = crate::http::client::parse_base_url(url)
    {
        return Err(format!("MCP server `{name}`: {e}; skipping it"));
    }
    if !missing.is_empty() {
        missing.dedup();
        crate::log::warn(&format!(
            "MCP server `{name}`: environment variable{} {} not set",
            if missing.len() == 1 { "" } else { "s" },
            missing.join(", ")
        ));
    }
    Ok(ServerConfig {
        name: name.to_owned(),
        transport,
        origin,
        written: env.map(|_| raw.to_string()).unwrap_or_default(),
        pinned: None,
    })
}

/// Servers in Claude Code's object form (`{"name": {…}}`, the value of `mcpServers`), with a
/// warning for each one skipped.
pub fn parse_object(
    servers: &Map<String, Value>,
    origin: Origin,
    env: &dyn Fn(&str) -> Option<String>,
) -> (Vec<ServerConfig>, Vec<String>) {
    let mut out = Vec::new();
    let mut warnings = Vec::new();
    for (name, raw) in servers {
        if out.len() >= MAX_SERVERS {
            warnings.push(format!(
                "more than {MAX_SERVERS} MCP servers; the rest are skipped"
            ));
            break;
        }
        match parse_entry(name, raw, origin, Some(env)) {
            Ok(config) => out.push(config),
            Err(warning) => warnings.push(warning),
        }
    }
    (out, warnings)
}

/// Servers in ACP's array form (`mcpServers` of `session/new`), with a warning for each one
/// skipped. ACP's values are literal: the editor already expanded what it wanted.
pub fn parse_array(list: &[Value], origin: Origin) -> (Vec<ServerConfig>, Vec<String>) {
    let mut out: Vec<ServerConfig> = Vec::new();
    let mut warnings = Vec::new();
    for raw in list {
        if out.len() >= MAX_SERVERS {
            warnings.push(format!(
                "more than {MAX_SERVERS} MCP servers; the rest are skipped"
            ));
            break;
        }
        let name = raw.get("name").and_then(Value::as_str).unwrap_or("");
        if out.iter().any(|s| s.name == name) {
            warnings.push(format!(
                "MCP server `{name}` is listed twice; using the first"
            ));
            continue;
        }
        match parse_entry(name, raw, origin, None) {
            Ok(config) => out.push(config),
            Err(warning) => warnings.push(warning),
        }
    }
    (out, warnings)
}

/// Reads a config file in the object form (`{"mcpServers": {…}}`). A missing or empty file
/// is `None`.
pub fn read_file(
    path: &Path,
    origin: Origin,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<Parsed>, String> {
    use std::io::Read;
    let file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
    };
    let mut text = String::new();
    file.take(MAX_CONFIG_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    if text.len() as u64 > MAX_CONFIG_BYTES {
        return Err(format!(
            "{} is larger than {MAX_CONFIG_BYTES} bytes",
            path.display()
        ));
    }
    if text.is_empty() {
        // What the sandbox leaves while a command runs where `.mcp.json` was missing (an
        // empty read-only placeholder) configures nothing, like the missing file.
        return Ok(None);
    }
    let value: Value = serde_json::from_str(&text)
        .map_err(|e| format!("malformed MCP config {}: {e}", path.display()))?;
    let Some(servers) = value.get("mcpServers") else {
        return Ok(Some((Vec::new(), Vec::new())));
    };
    let Some(servers) = servers.as_object() else {
        return Err(format!(
            "{}: `mcpServers` must be an object of servers by name",
            path.display()
        ));
    };
    let (configs, warnings) = parse_object(servers, origin, env);
    let warnings = warnings
        .into_iter()
        .map(|w| format!("{}: {w}", path.display()))
        .collect();
    Ok(Some((configs, warnings)))
}

/// The process's configured servers by name, merged by precedence: a name given by a
/// higher source replaces the same name from a lower one. Sources, highest first:
/// `--mcp-config` files (later flags win over earlier ones), the workspace's
/// `.caliban/settings.local.json`, `.caliban/settings.json`, then `.mcp.json`, then the
/// user's settings file.
#[derive(Debug, Default)]
pub struct Configured {
    by_name: BTreeMap<String, ServerConfig>,
}

impl Configured {
    /// Adds servers from a lower-precedence source: names already present are kept.
    pub fn add_lower(&mut self, servers: Vec<ServerConfig>) {
        for server in servers {
            self.by_name.entry(server.name.clone()).or_insert(server);
        }
    }

    pub fn into_vec(self) -> Vec<ServerConfig> {
        self.by_name.into_values().collect()
    }
}

/// Every configured server, one per name by precedence (`Configured`), and a warning for
/// each one skipped. Which of them may start is not decided here: the workspace's wait for
/// the user's approval (`approval::Approvals::admit`).
pub fn merge(
    workspace: &Path,
    cli_files: &[PathBuf],
    settings_servers: &[(Origin, Map<String, Value>)],
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Parsed, String> {
    let mut configured = Configured::default();
    let mut warnings = Vec::new();
    // `--mcp-config` files: the last one named wins a name clash, as a later flag should.
    for path in cli_files.iter().rev() {
        match read_file(path, Origin::User, env)? {
            Some((servers, w)) => {
                configured.add_lower(servers);
                warnings.extend(w);
            }
            None => return Err(format!("--mcp-config {}: no such file", path.display())),
        }
    }
    // Settings files arrive highest first: project local, project, then user; the
    // workspace's `.mcp.json` sits between the project settings and the user's.
    let mut mcp_json_done = false;
    for (origin, servers) in settings_servers {
        if *origin == Origin::User && !mcp_json_done {
            mcp_json_done = true;
            add_mcp_json(workspace, env, &mut configured, &mut warnings)?;
        }
        let (servers, w) = parse_object(servers, *origin, env);
        configured.add_lower(servers);
        warnings.extend(w);
    }
    if !mcp_json_done {
        add_mcp_json(workspace, env, &mut configured, &mut warnings)?;
    }
    Ok((configured.into_vec(), warnings))
}

fn add_mcp_json(
    workspace: &Path,
    env: &dyn Fn(&str) -> Option<String>,
    configured: &mut Configured,
    warnings: &mut Vec<String>,
) -> Result<(), String> {
    if let Some((servers, w)) = read_file(&workspace.join(".mcp.json"), Origin::Project, env)? {
        configured.add_lower(servers);
        warnings.extend(w);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn env(name: &str) -> Option<String> {
        match name {
            "TOKEN" => Some("s3cret".into()),
            "HOME" => Some("/home/u".into()),
            _ => None,
        }
    }

    #[test]
    fn an_empty_mcp_json_configures_nothing_like_a_missing_one() {
        let dir = std::env::temp_dir().join(format!("caliban-empty-mcp-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(".mcp.json");
        std::fs::write(&path, "").unwrap();
        let read = read_file(&path, Origin::Project, &env);
        let _ = std::fs::remove_dir_all(&dir);
        assert!(matches!(read, Ok(None)), "{read:?}");
    }

    #[test]
    fn expands_variables_with_defaults() {
        let mut missing = Vec::new();
        assert_eq!(
            expand("Bearer ${TOKEN}", &env, &mut missing),
            "Bearer s3cret"
        );
        assert_eq!(
            expand("${NOPE:-x}/${HOME}", &env, &mut missing),
            "x//home/u"
        );
        assert_eq!(expand("a${NOPE}b${", &env, &mut missing), "ab${");
        assert_eq!(missing, ["NOPE"]);
    }

    #[test]
    fn object_form_reads_every_transport() {
        let servers = json!({
            "fs": {"command": "npx", "args": ["-y", "srv", "${HOME}"], "env": {"K": "${TOKEN}"}},
            "web": {"type": "http", "url": "https://x.test/mcp",
                    "headers": {"Authorization": "Bearer ${TOKEN}"}},
            "bare": {"url": "http://127.0.0.1:1/mcp"},
            "old": {"type": "sse", "url": "http://127.0.0.1:1/sse"},
            "bad": {"type": "ws", "url": "ws://x"},
            "nourl": {"type": "http"},
            "nothing": {},
        });
        let (configs, warnings) = parse_object(servers.as_object().unwrap(), Origin::User, &env);
        let by = |n: &str| {
            configs
                .iter()
                .find(|c| c.name == n)
                .unwrap()
                .transport
                .clone()
        };
        assert_eq!(
            by("fs"),
            Transport::Stdio {
                command: "npx".into(),
                args: vec!["-y".into(), "srv".into(), "/home/u".into()],
                env: vec![("K".into(), "s3cret".into())],
            }
        );
        assert_eq!(
            by("web"),
            Transport::Http {
                url: "https://x.test/mcp".into(),
                headers: vec![("Authorization".into(), "Bearer s3cret".into())],
            }
        );
        assert!(matches!(by("bare"), Transport::Http { .. }));
        assert!(matches!(by("old"), Transport::Sse { .. }));
        assert_eq!(configs.len(), 4);
        assert_eq!(warnings.len(), 3, "{warnings:?}");
    }

    #[test]
    fn array_form_takes_strings_literally() {
        let (configs, warnings) = parse_array(
            json!([
                {"name": "a", "command": "/bin/a", "args": ["${HOME}"], "env": [{"name": "K", "value": "V"}]},
                {"type": "http", "name": "h", "url": "http://127.0.0.1:9/mcp", "headers": [{"name": "X", "value": "y"}]},
                {"name": "a", "command": "/bin/b"},
            ])
            .as_array()
            .unwrap(),
            Origin::Client,
        );
        assert_eq!(warnings.len(), 1);
        let Transport::Stdio { args, env, .. } = &configs[0].transport else {
            panic!()
        };
        assert_eq!(args[0], "${HOME}");
        assert_eq!(env, &[("K".to_owned(), "V".to_owned())]);
        assert!(
            matches!(&configs[1].transport, Transport::Http { headers, .. } if headers[0].1 == "y")
        );
    }

    #[test]
    fn fingerprints_follow_what_runs() {
        let a = ServerConfig {
            name: "a".into(),
            transport: Transport::Stdio {
                command: "x".into(),
                args: vec![],
                env: vec![],
            },
            origin: Origin::Project,
            written: String::new(),
            pinned: None,
        };
        let ws = Path::new("/nonexistent-ws");
        let mut b = a.clone();
        assert_eq!(a.fingerprint(ws), b.fingerprint(ws));
        b.transport = Transport::Stdio {
            command: "y".into(),
            args: vec![],
            env: vec![],
        };
        assert_ne!(a.fingerprint(ws), b.fingerprint(ws));
        assert_eq!(a.fingerprint(ws).config.len(), 16);
    }

    #[test]
    fn fingerprints_cover_unexpanded_headers_and_env_and_the_files_run() {
        let parse = |entry: Value| {
            let servers = json!({ "s": entry });
            parse_object(servers.as_object().unwrap(), Origin::Project, &env)
                .0
                .remove(0)
        };
        let ws = std::env::temp_dir().join(format!("caliban-mcp-pin-{}", std::process::id()));
        std::fs::create_dir_all(ws.join("sub")).unwrap();
        let fp = |entry: Value| parse(entry).fingerprint(&ws);
        let url = "http://127.0.0.1:1/mcp";
        assert_ne!(
            fp(json!({"url": url})).config,
            fp(json!({"url": url, "headers": {"X": "${TOKEN}"}})).config
        );
        assert_ne!(
            fp(json!({"command": "/bin/x"})).config,
            fp(json!({"command": "/bin/x", "env": {"K": "${TOKEN}"}})).config
        );
        // The secret a variable expands to is not what is hashed, and the approval message
        // names the variable, not its value.
        let with = parse(json!({"url": url, "headers": {"X": "${TOKEN}", "Y": "${HOME:-/}"}}));
        assert!(!with.written.contains("s3cret") && with.written.contains("${TOKEN}"));
        assert_eq!(
            with.describe(),
            format!("{url} (Streamable HTTP); it is given ${{TOKEN}}, ${{HOME}}")
        );

        std::fs::write(ws.join("tool_server.py"), "print(1)").unwrap();
        std::fs::write(ws.join("sub/run.sh"), "exit 0").unwrap();
        let mut server = parse(json!({"command": "./sub/run.sh",
                                      "args": ["tool_server.py", "-v", "/etc/hostname"]}));
        let files = server.fingerprint(&ws).files;
        assert_eq!(
            files.keys().collect::<Vec<_>>(),
            ["./sub/run.sh", "tool_server.py"],
            "files outside the workspace and temp dirs are not pinned"
        );
        server.pin(&ws);
        assert_eq!(server.changed_file(&ws), None);
        std::fs::write(ws.join("tool_server.py"), "import os").unwrap();
        assert_eq!(server.changed_file(&ws).as_deref(), Some("tool_server.py"));
        assert_ne!(server.fingerprint(&ws).files, files);
        let _ = std::fs::remove_dir_all(&ws);
    }
}
