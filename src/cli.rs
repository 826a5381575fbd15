//! The command line: one flag table (`FLAGS`) drives parsing, `--help` and the man page, so
//! the three cannot drift apart. Parsing yields `Command` with validated values only; it
//! makes no syscalls beyond reading argv.

use std::ffi::OsString;
use std::path::PathBuf;

use lexopt::prelude::*;

pub const VERSION: &str = env!("CARGO_PKG_VERSION");
pub const GIT_HASH: &str = env!("CALIBAN_GIT_HASH");

/// One documented flag. `value` is the metavariable for flags that take one.
pub struct Flag {
    pub long: &'static str,
    pub short: Option<char>,
    pub value: Option<&'static str>,
    pub help: &'static str,
    /// Which command accepts it: "" for the main (print) command, else the subcommand name.
    pub scope: &'static str,
}

const fn flag(
    long: &'static str,
    short: Option<char>,
    value: Option<&'static str>,
    help: &'static str,
    scope: &'static str,
) -> Flag {
    Flag {
        long,
        short,
        value,
        help,
        scope,
    }
}

pub const FLAGS: &[Flag] = &[
    flag(
        "print",
        Some('p'),
        None,
        "Run headless: answer PROMPT (or stdin) and exit. Also implied when a PROMPT is given.",
        "",
    ),
    flag(
        "output-format",
        None,
        Some("FORMAT"),
        "text (default: the final answer), json (one result object) or stream-json (one JSON frame per line).",
        "",
    ),
    flag(
        "input-format",
        None,
        Some("FORMAT"),
        "text (default) or stream-json: user messages as JSON lines on stdin, each answered in turn.",
        "",
    ),
    flag(
        "include-partial-messages",
        None,
        None,
        "With stream-json output, stream text and thinking deltas as they arrive.",
        "",
    ),
    flag(
        "continue",
        Some('c'),
        None,
        "Continue the latest print-mode conversation in this workspace (print mode only).",
        "",
    ),
    flag(
        "resume",
        Some('r'),
        Some("ID"),
        "Continue the conversation of ID: a result frame's session_id, or a run id (run-N) of any surface (print mode only).",
        "",
    ),
    flag(
        "provider",
        None,
        Some("NAME"),
        "anthropic or openai (any OpenAI-compatible server). Default: from settings, else whichever API key or base URL is set.",
        "",
    ),
    flag(
        "model",
        None,
        Some("NAME"),
        "Model name (default claude-sonnet-4-6 for anthropic, gpt-5.5 for openai).",
        "",
    ),
    flag(
        "max-tokens",
        None,
        Some("N"),
        "Output token limit per model turn (default 8192).",
        "",
    ),
    flag(
        "max-turns",
        None,
        Some("N"),
        "Stop after N model turns (default 50); exit code 75.",
        "",
    ),
    flag(
        "system-prompt",
        None,
        Some("TEXT"),
        "Replace the built-in system prompt.",
        "",
    ),
    flag(
        "no-project-instructions",
        None,
        None,
        "Do not add AGENTS.md, CALIBAN.md or CLAUDE.md files (the project's and the user's) to the system prompt.",
        "",
    ),
    flag(
        "cwd",
        Some('C'),
        Some("DIR"),
        "Workspace root for tools and project settings (default: the current directory).",
        "",
    ),
    flag(
        "allow",
        None,
        Some("PATTERN"),
        "Allow tool calls matching PATTERN, e.g. 'Bash(cargo test:*)' or 'Bash:git *'. Repeatable.",
        "",
    ),
    flag(
        "ask",
        None,
        Some("PATTERN"),
        "Ask before tool calls matching PATTERN (denied in print mode). Repeatable.",
        "",
    ),
    flag(
        "deny",
        None,
        Some("PATTERN"),
        "Deny tool calls matching PATTERN. Repeatable; deny rules are checked before allow rules.",
        "",
    ),
    flag(
        "permission-mode",
        None,
        Some("MODE"),
        "default, acceptEdits, plan, dontAsk or bypassPermissions.",
        "",
    ),
    flag(
        "sandbox",
        None,
        Some("MODE"),
        "What commands may do: read-only, workspace-write (default where the kernel has Landlock), network or off.",
        "",
    ),
    flag(
        "mcp-config",
        None,
        Some("FILE"),
        "Use the MCP servers FILE names ({\"mcpServers\": {…}}, as in .mcp.json). Repeatable; a later file wins a name.",
        "",
    ),
    flag(
        "approve-mcp",
        None,
        Some("NAME"),
        "Approve the workspace's MCP server NAME (from .mcp.json or project settings), or `all`; remembered for the workspace. Repeatable.",
        "",
    ),
    flag(
        "mcp-timeout",
        None,
        Some("SECS"),
        "Cancel an MCP tool call with no answer and no progress for SECS (default 300).",
        "",
    ),
    flag(
        "max-retries",
        None,
        Some("N"),
        "Retries of a model request that failed before any output (default 4).",
        "",
    ),
    flag(
        "first-byte-timeout",
        None,
        Some("SECS"),
        "Give up on a model request with no output after SECS: connecting, queueing and prompt processing; keep-alives do not count (default 300).",
        "",
    ),
    flag(
        "idle-timeout",
        None,
        Some("SECS"),
        "Fail a model stream with no new output for SECS once output started; keep-alives do not count (default 90).",
        "",
    ),
    flag(
        "request-timeout",
        None,
        Some("SECS"),
        "Give up on a model request still streaming after SECS, however steadily (default 3600).",
        "",
    ),
    flag(
        "verbose",
        Some('v'),
        None,
        "Log more to stderr (repeat for debug).",
        "",
    ),
    flag(
        "version",
        Some('V'),
        None,
        "Print the version and git hash.",
        "",
    ),
    flag("help", Some('h'), None, "Print help.", ""),
    flag(
        "generate",
        None,
        Some("man"),
        "Print the man page (roff) to stdout.",
        "",
    ),
    flag(
        "addr",
        None,
        Some("ADDR"),
        "Address to listen on (default 127.0.0.1:8730). A non-loopback address needs CALIBAN_DRIVE_TOKEN.",
        "http serve",
    ),
    flag(
        "tls-cert",
        None,
        Some("PEM"),
        "Serve HTTPS with this certificate chain (needs --tls-key).",
        "http serve|mcp serve",
    ),
    flag(
        "tls-key",
        None,
        Some("PEM"),
        "Private key for --tls-cert.",
        "http serve|mcp serve",
    ),
    flag(
        "permission-timeout",
        None,
        Some("SECS"),
        "Deny a permission prompt nobody answered after SECS (default 600).",
        "http serve|mcp serve|acp serve|agent serve",
    ),
    flag(
        "max-connections",
        None,
        Some("N"),
        "Serve at most N connections at once; more wait in the backlog (default 256).",
        "http serve|mcp serve",
    ),
    flag(
        "max-working-runs",
        None,
        Some("N"),
        "Let at most N runs stream or run tools at once; more are refused (503, or a busy error) until one pauses or ends (default 64).",
        "http serve|mcp serve|acp serve|agent serve",
    ),
    flag(
        "max-live-runs",
        None,
        Some("N"),
        "Keep at most N runs open at once, idle interactive ones included (default 4096).",
        "http serve|mcp serve|acp serve|agent serve",
    ),
    flag(
        "listen",
        None,
        Some("ADDR"),
        "Also serve MCP Streamable HTTP at ADDR, path /mcp. A non-loopback address needs CALIBAN_DRIVE_TOKEN.",
        "mcp serve",
    ),
    flag(
        "listen",
        None,
        Some("ADDR"),
        "Listen on ADDR (IP:PORT) with TLS and a bearer preamble; needs CALIBAN_AGENT_TOKEN, CALIBAN_AGENT_TLS_CERT and CALIBAN_AGENT_TLS_KEY, else refuses to start.",
        "agent serve",
    ),
    flag(
        "socket",
        None,
        Some("PATH"),
        "Listen on a Unix socket created at PATH with mode 0600 (no TLS, no preamble) instead of --listen.",
        "agent serve",
    ),
    flag(
        "spec",
        None,
        Some("FILE"),
        "The JSON spawn spec (else CALIBAN_AGENT_SPEC): initial_prompt, interactive, model, provider, tool_allowlist, label, drive_protocol (ndjson|acp), permission_posture (supervised|unattended), sandbox.",
        "agent serve",
    ),
    flag(
        "script",
        None,
        Some("FILE"),
        "JSON script of turns to serve (see README, \"stub-model\").",
        "stub-model",
    ),
    flag(
        "addr",
        None,
        Some("ADDR"),
        "Loopback address to listen on (default 127.0.0.1:0, a free port).",
        "stub-model",
    ),
];

pub const SUBCOMMANDS: &[(&str, &str)] = &[
    (
        "mcp serve",
        "Be an MCP server over stdio (and Streamable HTTP with --listen): another agent drives caliban as a worker.",
    ),
    (
        "acp serve",
        "Be an ACP agent over stdio for editors such as Zed.",
    ),
    (
        "http serve",
        "Serve the drive API over HTTP: start runs, stream their events, answer prompts (see README). Takes the agent options above too.",
    ),
    (
        "agent serve",
        "Be a networked agent a supervisor drives: ACP, or the NDJSON session plane over its spec's run, on TLS with a bearer preamble or on a Unix socket (see README). Takes the agent options above too.",
    ),
    (
        "sandbox check",
        "Report what the command sandbox can enforce on this machine, with a live test; exit 0 when the configured mode is enforced.",
    ),
    (
        "stub-model",
        "Serve scripted Anthropic and OpenAI streams on loopback, for offline tests, demos and benchmarks.",
    ),
];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputFormat {
    Text,
    Json,
    StreamJson,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InputFormat {
    Text,
    StreamJson,
}

#[derive(Clone, Debug, PartialEq)]
pub struct PrintArgs {
    pub prompt: Option<String>,
    pub output_format: OutputFormat,
    pub input_format: InputFormat,
    pub include_partial_messages: bool,
    /// `--continue` / `--resume ID`: the conversation this print run goes on with.
    pub resume: Option<Resume>,
    pub provider: Option<String>,
    pub model: Option<String>,
    pub max_tokens: Option<u32>,
    pub max_turns: Option<u32>,
    pub system_prompt: Option<String>,
    pub no_project_instructions: bool,
    pub cwd: Option<PathBuf>,
    pub allow: Vec<String>,
    pub ask: Vec<String>,
    pub deny: Vec<String>,
    pub permission_mode: Option<String>,
    pub sandbox: Option<crate::sandbox::Mode>,
    pub max_retries: Option<u32>,
    pub first_byte_timeout: Option<f64>,
    pub idle_timeout: Option<f64>,
    pub request_timeout: Option<f64>,
    pub mcp_config: Vec<PathBuf>,
    pub approve_mcp: Vec<String>,
    pub mcp_timeout: Option<f64>,
    pub verbose: u8,
}

/// Which earlier conversation a print run continues.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Resume {
    /// `--continue`: the latest print-mode run in the workspace.
    Latest,
    /// `--resume ID`: a session id (a result frame's `session_id`) or a run id.
    Id(String),
}

/// Which drive surface a `… serve` command starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Surface {
    Http,
    Mcp,
    Acp,
    Agent,
}

impl Surface {
    pub fn name(self) -> &'static str {
        match self {
            Surface::Http => "http serve",
            Surface::Mcp => "mcp serve",
            Surface::Acp => "acp serve",
            Surface::Agent => "agent serve",
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct ServeArgs {
    pub surface: Surface,
    /// The agent options, shared with print mode (prompt and formats unused).
    pub agent: PrintArgs,
    /// `--addr` (http) or `--listen` (mcp, agent).
    pub addr: Option<String>,
    /// `--socket` (agent).
    pub socket: Option<PathBuf>,
    /// `--spec` (agent).
    pub spec: Option<PathBuf>,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    pub permission_timeout: Option<f64>,
    pub max_connections: Option<usize>,
    pub max_working_runs: Option<usize>,
    pub max_live_runs: Option<usize>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Command {
    Print(Box<PrintArgs>),
    Serve(Box<ServeArgs>),
    StubModel {
        script: PathBuf,
        addr: String,
    },
    /// `caliban sandbox check`, with the agent options that choose the workspace and mode.
    SandboxCheck(Box<PrintArgs>),
    Help,
    Version,
    GenerateMan,
}

/// Parses argv (without the program name).
pub fn parse(args: impl IntoIterator<Item = OsString>) -> Result<Command, lexopt::Error> {
    let mut parser = lexopt::Parser::from_args(args);
    let mut print = PrintArgs {
        prompt: None,
        output_format: OutputFormat::Text,
        input_format: InputFormat::Text,
        include_partial_messages: false,
        resume: None,
        provider: None,
        model: None,
        max_tokens: None,
        max_turns: None,
        system_prompt: None,
        no_project_instructions: false,
        cwd: None,
        allow: Vec::new(),
        ask: Vec::new(),
        deny: Vec::new(),
        permission_mode: None,
        sandbox: None,
        max_retries: None,
        first_byte_timeout: None,
        idle_timeout: None,
        request_timeout: None,
        mcp_config: Vec::new(),
        approve_mcp: Vec::new(),
        mcp_timeout: None,
        verbose: 0,
    };
    let mut positional: Vec<String> = Vec::new();
    let mut serve: Option<ServeArgs> = None;
    let mut check = false;
    while let Some(arg) = parser.next()? {
        if let Some(serve) = serve.as_mut() {
            let surface = serve.surface;
            let on = |name: &str| {
                FLAGS
                    .iter()
                    .any(|f| f.long == name && f.scope.split('|').any(|s| s == surface.name()))
            };
            match arg {
                Long("continue" | "resume") | Short('c' | 'r') => {
                    return Err(lexopt::Error::from(format!(
                        "--continue and --resume apply to print mode, not `{}`",
                        surface.name()
                    )));
                }
                Long(name)
                    if !on(name) && FLAGS.iter().any(|f| f.long == name && !f.scope.is_empty()) =>
                {
                    return Err(lexopt::Error::from(format!(
                        "--{name} does not apply to `{}`",
                        surface.name()
                    )));
                }
                Long("addr" | "listen") => {
                    serve.addr = Some(parser.value()?.string()?);
                    continue;
                }
                Long("socket") => {
                    serve.socket = Some(parser.value()?.into());
                    continue;
                }
                Long("spec") => {
                    serve.spec = Some(parser.value()?.into());
                    continue;
                }
                Long("tls-cert") => {
                    serve.tls_cert = Some(parser.value()?.into());
                    continue;
                }
                Long("tls-key") => {
                    serve.tls_key = Some(parser.value()?.into());
                    continue;
                }
                Long("permission-timeout") => {
                    serve.permission_timeout = Some(seconds(&mut parser, "--permission-timeout")?);
                    continue;
                }
                Long("max-connections") => {
                    let n: usize = parser.value()?.parse()?;
                    if n == 0 {
                        return Err(bad_value("--max-connections", "0", "a positive number"));
                    }
                    serve.max_connections = Some(n);
                    continue;
                }
                Long("max-working-runs") => {
                    serve.max_working_runs = Some(positive(&mut parser, "--max-working-runs")?);
                    continue;
                }
                Long("max-live-runs") => {
                    serve.max_live_runs = Some(positive(&mut parser, "--max-live-runs")?);
                    continue;
                }
                Value(v) => {
                    return Err(lexopt::Error::from(format!(
                        "unexpected argument `{}`: {} takes no prompt",
                        v.to_string_lossy(),
                        surface.name()
                    )));
                }
                _ => {}
            }
        }
        match arg {
            Short('p') | Long("print") => {}
            Long("output-format") => {
                print.output_format = match parser.value()?.string()?.as_str() {
                    "text" => OutputFormat::Text,
                    "json" => OutputFormat::Json,
                    "stream-json" => OutputFormat::StreamJson,
                    other => {
                        return Err(bad_value(
                            "--output-format",
                            other,
                            "text, json, stream-json",
                        ));
                    }
                }
            }
            Long("input-format") => {
                print.input_format = match parser.value()?.string()?.as_str() {
                    "text" => InputFormat::Text,
                    "stream-json" => InputFormat::StreamJson,
                    other => return Err(bad_value("--input-format", other, "text, stream-json")),
                }
            }
            Long("include-partial-messages") => print.include_partial_messages = true,
            Short('c') | Long("continue") => {
                if matches!(print.resume, Some(Resume::Id(_))) {
                    return Err("--continue and --resume cannot be combined".into());
                }
                print.resume = Some(Resume::Latest);
            }
            Short('r') | Long("resume") => {
                if print.resume == Some(Resume::Latest) {
                    return Err("--continue and --resume cannot be combined".into());
                }
                let id = parser.value()?.string()?;
                if id.trim().is_empty() {
                    return Err(bad_value("--resume", &id, "a session id or run id"));
                }
                print.resume = Some(Resume::Id(id));
            }
            Long("provider") => print.provider = Some(parser.value()?.string()?),
            Long("model") => print.model = Some(parser.value()?.string()?),
            Long("max-tokens") => print.max_tokens = Some(parser.value()?.parse()?),
            Long("max-turns") => {
                let n: u32 = parser.value()?.parse()?;
                if n == 0 {
                    return Err(bad_value("--max-turns", "0", "a positive number"));
                }
                print.max_turns = Some(n);
            }
            Long("system-prompt") => print.system_prompt = Some(parser.value()?.string()?),
            Long("no-project-instructions") => print.no_project_instructions = true,
            Short('C') | Long("cwd") => print.cwd = Some(parser.value()?.into()),
            Long("allow") => print.allow.push(parser.value()?.string()?),
            Long("ask") => print.ask.push(parser.value()?.string()?),
            Long("deny") => print.deny.push(parser.value()?.string()?),
            Long("permission-mode") => print.permission_mode = Some(parser.value()?.string()?),
            Long("sandbox") => {
                let value = parser.value()?.string()?;
                print.sandbox = Some(crate::sandbox::Mode::parse(&value).ok_or_else(|| {
                    bad_value("--sandbox", &value, &crate::sandbox::Mode::names())
                })?);
            }
            Long("mcp-config") => print.mcp_config.push(parser.value()?.into()),
            Long("approve-mcp") => print.approve_mcp.push(parser.value()?.string()?),
            Long("mcp-timeout") => print.mcp_timeout = Some(seconds(&mut parser, "--mcp-timeout")?),
            Long("max-retries") => print.max_retries = Some(parser.value()?.parse()?),
            Long("first-byte-timeout") => {
                print.first_byte_timeout = Some(seconds(&mut parser, "--first-byte-timeout")?)
            }
            Long("idle-timeout") => {
                print.idle_timeout = Some(seconds(&mut parser, "--idle-timeout")?)
            }
            Long("request-timeout") => {
                print.request_timeout = Some(seconds(&mut parser, "--request-timeout")?)
            }
            Short('v') | Long("verbose") => print.verbose = print.verbose.saturating_add(1),
            Short('V') | Long("version") => return Ok(Command::Version),
            Short('h') | Long("help") => return Ok(Command::Help),
            Long("generate") => {
                let what = parser.value()?.string()?;
                if what != "man" {
                    return Err(bad_value("--generate", &what, "man"));
                }
                return Ok(Command::GenerateMan);
            }
            Value(v) if positional.is_empty() && v == "stub-model" && serve.is_none() => {
                return parse_stub_model(&mut parser);
            }
            Value(v) if positional.is_empty() && v == "sandbox" && serve.is_none() && !check => {
                match parser.value()?.string()?.as_str() {
                    "check" => check = true,
                    other => {
                        return Err(lexopt::Error::from(format!(
                            "unknown command `sandbox {other}`: expected `sandbox check`"
                        )));
                    }
                }
            }
            Value(v)
                if positional.is_empty()
                    && serve.is_none()
                    && (v == "http" || v == "mcp" || v == "acp" || v == "agent") =>
            {
                let which = v.string()?;
                let surface = match which.as_str() {
                    "http" => Surface::Http,
                    "mcp" => Surface::Mcp,
                    "agent" => Surface::Agent,
                    _ => Surface::Acp,
                };
                match parser.value()?.string()?.as_str() {
                    "serve" => {}
                    other => {
                        return Err(lexopt::Error::from(format!(
                            "unknown command `{which} {other}`: expected `{which} serve`"
                        )));
                    }
                }
                serve = Some(ServeArgs {
                    surface,
                    agent: print.clone(),
                    addr: None,
                    socket: None,
                    spec: None,
                    tls_cert: None,
                    tls_key: None,
                    permission_timeout: None,
                    max_connections: None,
                    max_working_runs: None,
                    max_live_runs: None,
                });
            }
            Value(v) => positional.push(v.string()?),
            _ => return Err(arg.unexpected()),
        }
    }
    if let Some(mut serve) = serve {
        // Agent flags may come before or after `… serve`: the parser kept filling the
        // same struct, so it holds the final values.
        serve.agent = print;
        if serve.tls_cert.is_some() != serve.tls_key.is_some() {
            return Err(lexopt::Error::from("--tls-cert and --tls-key go together"));
        }
        if serve.surface == Surface::Mcp && serve.tls_cert.is_some() && serve.addr.is_none() {
            return Err(lexopt::Error::from(
                "--tls-cert needs --listen: stdio has no TLS",
            ));
        }
        return Ok(Command::Serve(Box::new(serve)));
    }
    if check {
        if let Some(extra) = positional.first() {
            return Err(lexopt::Error::from(format!(
                "unexpected argument `{extra}`: sandbox check takes no prompt"
            )));
        }
        return Ok(Command::SandboxCheck(Box::new(print)));
    }
    if !positional.is_empty() {
        print.prompt = Some(positional.join(" "));
    }
    Ok(Command::Print(Box::new(print)))
}

fn parse_stub_model(parser: &mut lexopt::Parser) -> Result<Command, lexopt::Error> {
    let mut script = None;
    let mut addr = "127.0.0.1:0".to_owned();
    while let Some(arg) = parser.next()? {
        match arg {
            Long("script") => script = Some(PathBuf::from(parser.value()?)),
            Long("addr") => addr = parser.value()?.string()?,
            Short('h') | Long("help") => return Ok(Command::Help),
            _ => return Err(arg.unexpected()),
        }
    }
    let script = script.ok_or_else(|| lexopt::Error::from("stub-model needs --script FILE"))?;
    Ok(Command::StubModel { script, addr })
}

fn seconds(parser: &mut lexopt::Parser, name: &str) -> Result<f64, lexopt::Error> {
    let raw = parser.value()?.string()?;
    match raw.parse::<f64>() {
        Ok(s) if s.is_finite() && s > 0.0 && s <= 86_400.0 => Ok(s),
        _ => Err(bad_value(name, &raw, "seconds, greater than 0")),
    }
}

fn positive(parser: &mut lexopt::Parser, flag: &str) -> Result<usize, lexopt::Error> {
    let n: usize = parser.value()?.parse()?;
    if n == 0 {
        return Err(bad_value(flag, "0", "a positive number"));
    }
    Ok(n)
}

fn bad_value(flag: &str, got: &str, expected: &str) -> lexopt::Error {
    lexopt::Error::from(format!(
        "invalid value `{got}` for {flag}: expected {expected}"
    ))
}

fn flag_label(f: &Flag) -> String {
    let mut label = match f.short {
        Some(c) => format!("-{c}, --{}", f.long),
        None => format!("    --{}", f.long),
    };
    if let Some(v) = f.value {
        label.push(' ');
        label.push_str(v);
    }
    label
}

pub fn help_text() -> String {
    let mut out = format!(
        "caliban {VERSION}\nA coding agent that other programs drive.\n\n\
USAGE:\n    caliban [-p] [OPTIONS] [PROMPT]\n    caliban mcp serve [OPTIONS] [--listen ADDR]\n    caliban acp serve [OPTIONS]\n    caliban http serve [OPTIONS] [--addr ADDR] [--tls-cert PEM --tls-key PEM]\n    caliban agent serve (--listen ADDR | --socket PATH) [--spec FILE] [OPTIONS]\n    caliban sandbox check [-C DIR] [--sandbox MODE]\n    caliban stub-model --script FILE [--addr ADDR]\n\n\
Print mode answers PROMPT (or stdin) headlessly and exits.\n\nOPTIONS:\n"
    );
    for f in FLAGS.iter().filter(|f| f.scope.is_empty()) {
        out.push_str(&format!("    {:<34} {}\n", flag_label(f), f.help));
    }
    out.push_str("\nCOMMANDS:\n");
    for (name, help) in SUBCOMMANDS {
        out.push_str(&format!("    {name:<13} {help}\n"));
        for f in FLAGS
            .iter()
            .filter(|f| f.scope.split('|').any(|s| s == *name))
        {
            out.push_str(&format!("        {:<30} {}\n", flag_label(f), f.help));
        }
    }
    out.push_str(
        "\nENVIRONMENT:\n    ANTHROPIC_API_KEY, ANTHROPIC_BASE_URL, OPENAI_API_KEY, OPENAI_BASE_URL,\n    \
HTTPS_PROXY, NO_PROXY, SSL_CERT_FILE, XDG_CONFIG_HOME,\n    \
CALIBAN_AGENT_TOKEN, CALIBAN_AGENT_TLS_CERT, CALIBAN_AGENT_TLS_KEY, CALIBAN_AGENT_SPEC,\n    \
CALIBAN_AGENT_IDLE_TIMEOUT_SECS, CALIBAN_SANDBOX_NO_LANDLOCK, CALIBAN_SANDBOX_NO_MOUNTNS,\n    \
CALIBAN_SANDBOX_USERNS\n\n\
EXIT CODES:\n    0 ok, 1 runtime error, 2 assistant stopped abnormally, 64 usage, 66 no input,\n    \
75 max turns, 78 configuration, 124 cancelled, 130 interrupted twice\n",
    );
    out
}

fn roff_escape(s: &str) -> String {
    s.replace('\\', "\\e")
        .replace('-', "\\-")
        .replace('\'', "\\(aq")
}

/// The man page, generated from the same table as `--help`.
pub fn man_page() -> String {
    let mut out = String::new();
    out.push_str(&format!(
        ".TH CALIBAN 1 \"\" \"caliban {VERSION}\" \"User Commands\"\n\
.SH NAME\ncaliban \\- a coding agent that other programs drive\n\
.SH SYNOPSIS\n.B caliban\n[\\fB\\-p\\fR] [\\fIOPTIONS\\fR] [\\fIPROMPT\\fR]\n.br\n\
.B caliban mcp serve\n[\\fIOPTIONS\\fR]\n.br\n.B caliban acp serve\n[\\fIOPTIONS\\fR]\n.br\n.B caliban http serve\n[\\fIOPTIONS\\fR]\n.br\n.B caliban agent serve\n(\\fB\\-\\-listen\\fR \\fIADDR\\fR | \\fB\\-\\-socket\\fR \\fIPATH\\fR) [\\fIOPTIONS\\fR]\n.br\n.B caliban stub\\-model\n\\fB\\-\\-script\\fR \\fIFILE\\fR [\\fB\\-\\-addr\\fR \\fIADDR\\fR]\n\
.SH DESCRIPTION\ncaliban is a coding agent (model, tools and permission rules) in one static \
binary. Print mode answers a prompt headlessly; \\fBstub\\-model\\fR serves scripted model \
streams on loopback for offline use.\n.SH OPTIONS\n"
    ));
    let entry = |out: &mut String, f: &Flag| {
        let mut label = match f.short {
            Some(c) => format!("\\fB\\-{c}\\fR, \\fB\\-\\-{}\\fR", roff_escape(f.long)),
            None => format!("\\fB\\-\\-{}\\fR", roff_escape(f.long)),
        };
        if let Some(v) = f.value {
            label.push_str(&format!(" \\fI{}\\fR", roff_escape(v)));
        }
        out.push_str(&format!(".TP\n{label}\n{}\n", roff_escape(f.help)));
    };
    for f in FLAGS.iter().filter(|f| f.scope.is_empty()) {
        entry(&mut out, f);
    }
    out.push_str(".SH COMMANDS\n");
    for (name, help) in SUBCOMMANDS {
        out.push_str(&format!(
            ".SS {}\n{}\n",
            roff_escape(name),
            roff_escape(help)
        ));
        for f in FLAGS
            .iter()
            .filter(|f| f.scope.split('|').any(|s| s == *name))
        {
            entry(&mut out, f);
        }
    }
    out.push_str(
        ".SH ENVIRONMENT\n.TP\n\\fBANTHROPIC_API_KEY\\fR, \\fBANTHROPIC_BASE_URL\\fR\nAnthropic Messages API.\n\
.TP\n\\fBOPENAI_API_KEY\\fR, \\fBOPENAI_BASE_URL\\fR\nOpenAI or any OpenAI\\-compatible server.\n\
.TP\n\\fBHTTPS_PROXY\\fR, \\fBNO_PROXY\\fR\nProxy for model requests (HTTP CONNECT).\n\
.TP\n\\fBSSL_CERT_FILE\\fR\nCA bundle to trust instead of the system one.\n\
.TP\n\\fBCALIBAN_AGENT_TOKEN\\fR, \\fBCALIBAN_AGENT_TLS_CERT\\fR, \\fBCALIBAN_AGENT_TLS_KEY\\fR\n\
The bearer token and PEM paths \\fBagent serve \\-\\-listen\\fR requires; without them it refuses to start (exit 78).\n\
.TP\n\\fBCALIBAN_AGENT_SPEC\\fR\nThe spawn spec as JSON text, when \\fB\\-\\-spec\\fR is not given.\n\
.TP\n\\fBCALIBAN_AGENT_IDLE_TIMEOUT_SECS\\fR\nSeconds with no client and no run working before \\fBagent serve\\fR exits (default 300, 0 = never).\n\
.TP\n\\fBCALIBAN_SANDBOX_NO_LANDLOCK\\fR, \\fBCALIBAN_SANDBOX_NO_MOUNTNS\\fR, \\fBCALIBAN_SANDBOX_USERNS\\fR\n\
Set to 1, behave as if the kernel had no Landlock (the \\fBsandbox.unavailable\\fR setting then decides), as if caliban could not have a mount namespace (Landlock alone confines), or as if it had one only in a user namespace (as without privilege).\n\
.SH EXIT STATUS\n0 ok, 1 runtime error, 2 assistant stopped abnormally, 64 usage, 66 no input, \
75 max turns, 78 configuration, 124 cancelled, 130 interrupted twice.\n",
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<OsString> {
        list.iter().map(OsString::from).collect()
    }

    #[test]
    fn print_flags() {
        let cmd = parse(args(&[
            "-p",
            "--output-format",
            "stream-json",
            "--allow",
            "Bash(cargo test:*)",
            "--max-turns",
            "3",
            "hello",
            "world",
        ]))
        .unwrap();
        let Command::Print(p) = cmd else {
            panic!("not print")
        };
        assert_eq!(p.prompt.as_deref(), Some("hello world"));
        assert_eq!(p.output_format, OutputFormat::StreamJson);
        assert_eq!(p.allow, vec!["Bash(cargo test:*)".to_owned()]);
        assert_eq!(p.max_turns, Some(3));
    }

    #[test]
    fn run_limits_parse_on_every_serve_command() {
        for surface in ["http", "mcp", "acp", "agent"] {
            let cmd = parse(args(&[
                surface,
                "serve",
                "--max-working-runs",
                "1000",
                "--max-live-runs",
                "5000",
            ]))
            .unwrap();
            let Command::Serve(s) = cmd else {
                panic!("not serve")
            };
            assert_eq!(
                (s.max_working_runs, s.max_live_runs),
                (Some(1000), Some(5000))
            );
        }
        assert!(parse(args(&["http", "serve", "--max-working-runs", "0"])).is_err());
        assert!(parse(args(&["--max-live-runs", "10"])).is_err());
    }

    #[test]
    fn bad_values_are_errors() {
        assert!(parse(args(&["--output-format", "xml"])).is_err());
        assert!(parse(args(&["--max-turns", "0"])).is_err());
        assert!(parse(args(&["--idle-timeout", "-1"])).is_err());
        assert!(parse(args(&["--request-timeout", "0"])).is_err());
        assert!(parse(args(&["--nope"])).is_err());
        assert!(parse(args(&["--sandbox", "workspace_write"])).is_err());
        assert!(parse(args(&["sandbox", "status"])).is_err());
        assert!(parse(args(&["sandbox", "check", "extra"])).is_err());
    }

    #[test]
    fn sandbox_mode_and_check() {
        let Command::Print(print) = parse(args(&["--sandbox", "network", "hi"])).unwrap() else {
            panic!("print")
        };
        assert_eq!(print.sandbox, Some(crate::sandbox::Mode::Network));
        let Command::SandboxCheck(check) =
            parse(args(&["sandbox", "check", "-C", "/w", "--sandbox", "off"])).unwrap()
        else {
            panic!("check")
        };
        assert_eq!(check.sandbox, Some(crate::sandbox::Mode::Off));
        assert_eq!(check.cwd, Some(PathBuf::from("/w")));
    }

    #[test]
    fn every_table_flag_parses() {
        for f in FLAGS {
            let mut argv = Vec::new();
            if f.scope == "stub-model" {
                argv.push("stub-model".to_owned());
                if f.long != "script" {
                    argv.extend(["--script".to_owned(), "x.json".to_owned()]);
                }
            }
            if let Some(first) = f.scope.split('|').find(|s| s.ends_with(" serve")) {
                argv.extend(first.split(' ').map(str::to_owned));
                if f.long == "tls-cert" {
                    argv.extend(["--tls-key".to_owned(), "k.pem".to_owned()]);
                }
                if f.long == "tls-key" {
                    argv.extend(["--tls-cert".to_owned(), "c.pem".to_owned()]);
                }
            }
            argv.push(format!("--{}", f.long));
            if let Some(v) = f.value {
                argv.push(match (f.long, v) {
                    ("output-format" | "input-format", _) => "text".to_owned(),
                    (_, "N" | "SECS") => "5".to_owned(),
                    ("generate", _) => "man".to_owned(),
                    ("sandbox", _) => "read-only".to_owned(),
                    _ => "x".to_owned(),
                });
            }
            let res = parse(argv.iter().map(OsString::from));
            assert!(
                res.is_ok(),
                "flag --{} from the table does not parse: {res:?}",
                f.long
            );
        }
    }

    #[test]
    fn stub_model_subcommand() {
        let cmd = parse(args(&["stub-model", "--script", "s.json"])).unwrap();
        assert_eq!(
            cmd,
            Command::StubModel {
                script: "s.json".into(),
                addr: "127.0.0.1:0".into()
            }
        );
    }
}
