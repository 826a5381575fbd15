//! The command line: one flag table (`FLAGS`) drives parsing, `--help` and the man page, so
//! the three cannot drift apart: each flag is declared once, with the commands that take it
//! (`Scope`) and what parsing does with its value (`Set`). One table of the serve commands
//! (`SURFACES`) names the drive surfaces for parsing, help and `app`. Parsing yields
//! `Command` with validated values only; it makes no syscalls beyond reading argv.

use std::ffi::OsString;
use std::path::PathBuf;
use std::str::FromStr;

use lexopt::prelude::*;

pub const VERSION: &str = env!("CARGO_PKG_VERSION");
pub const GIT_HASH: &str = env!("CALIBAN_GIT_HASH");

/// One documented flag. `value` is the metavariable for flags that take one.
pub struct Flag {
    pub long: &'static str,
    pub short: Option<char>,
    pub value: Option<&'static str>,
    pub help: &'static str,
    pub scope: Scope,
    set: Set,
}

/// Which commands accept a flag.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// Every command, `stub-model` included.
    Any,
    /// The agent options: print mode's, which every serve command and `sandbox check` take
    /// too.
    Agent,
    /// Print mode's alone (`sandbox check` takes and ignores them); a serve command
    /// refuses them as print-mode options.
    Print,
    /// Only these serve commands.
    Serve(&'static [Surface]),
    StubModel,
}

/// The kind of command being parsed, for what its flags may be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum On {
    /// Print mode, or `sandbox check`, which takes the same options.
    Print,
    Serve(Surface),
    StubModel,
}

impl Scope {
    fn accepts(self, on: On) -> bool {
        match (self, on) {
            (Scope::Any, _) => true,
            (Scope::Agent, on) => on != On::StubModel,
            (Scope::Print, on) => on == On::Print,
            (Scope::Serve(surfaces), On::Serve(surface)) => surfaces.contains(&surface),
            (Scope::StubModel, on) => on == On::StubModel,
            (Scope::Serve(_), _) => false,
        }
    }

    /// Listed among print mode's options rather than under a command.
    fn is_agent_wide(self) -> bool {
        matches!(self, Scope::Any | Scope::Agent | Scope::Print)
    }
}

/// What parsing does with a flag.
#[derive(Clone, Copy)]
enum Set {
    Agent(fn(&mut PrintArgs, &mut Given) -> Result<(), lexopt::Error>),
    Serve(fn(&mut ServeArgs, &mut Given) -> Result<(), lexopt::Error>),
    Stub(fn(&mut StubArgs, &mut Given) -> Result<(), lexopt::Error>),
    /// The command line's answer, whatever else it holds.
    Answer(fn(&mut Given) -> Result<Command, lexopt::Error>),
}

/// A flag being parsed: its row, for its name in errors, and the parser holding its value.
struct Given<'p> {
    flag: &'static Flag,
    parser: &'p mut lexopt::Parser,
}

impl Given<'_> {
    fn string(&mut self) -> Result<String, lexopt::Error> {
        self.parser.value()?.string()
    }

    fn path(&mut self) -> Result<PathBuf, lexopt::Error> {
        Ok(self.parser.value()?.into())
    }

    fn number<T: FromStr>(&mut self) -> Result<T, lexopt::Error>
    where
        T::Err: Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    {
        self.parser.value()?.parse()
    }

    fn positive<T: FromStr + Default + PartialEq>(&mut self) -> Result<T, lexopt::Error>
    where
        T::Err: Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    {
        let n: T = self.number()?;
        if n == T::default() {
            return Err(self.bad("0", "a positive number"));
        }
        Ok(n)
    }

    fn seconds(&mut self) -> Result<f64, lexopt::Error> {
        let raw = self.string()?;
        match raw.parse::<f64>() {
            Ok(s) if s.is_finite() && s > 0.0 && s <= 86_400.0 => Ok(s),
            _ => Err(self.bad(&raw, "seconds, greater than 0")),
        }
    }

    fn bad(&self, got: &str, expected: &str) -> lexopt::Error {
        lexopt::Error::from(format!(
            "invalid value `{got}` for --{}: expected {expected}",
            self.flag.long
        ))
    }
}

const fn flag(
    long: &'static str,
    short: Option<char>,
    value: Option<&'static str>,
    help: &'static str,
    scope: Scope,
    set: Set,
) -> Flag {
    Flag {
        long,
        short,
        value,
        help,
        scope,
        set,
    }
}

const LISTENING: &[Surface] = &[Surface::Http, Surface::Mcp];
const ALL_SURFACES: &[Surface] = &[Surface::Http, Surface::Mcp, Surface::Acp, Surface::Agent];

pub const FLAGS: &[Flag] = &[
    flag(
        "print",
        Some('p'),
        None,
        "Run headless: answer PROMPT (or stdin) and exit. Also implied when a PROMPT is given.",
        Scope::Agent,
        Set::Agent(|_, _| Ok(())),
    ),
    flag(
        "output-format",
        None,
        Some("FORMAT"),
        "text (default: the final answer), json (one result object) or stream-json (one JSON frame per line).",
        Scope::Agent,
        Set::Agent(|a, v| {
            a.output_format = match v.string()?.as_str() {
                "text" => OutputFormat::Text,
                "json" => OutputFormat::Json,
                "stream-json" => OutputFormat::StreamJson,
                other => return Err(v.bad(other, "text, json, stream-json")),
            };
            Ok(())
        }),
    ),
    flag(
        "input-format",
        None,
        Some("FORMAT"),
        "text (default) or stream-json: user messages as JSON lines on stdin, each answered in turn.",
        Scope::Agent,
        Set::Agent(|a, v| {
            a.input_format = match v.string()?.as_str() {
                "text" => InputFormat::Text,
                "stream-json" => InputFormat::StreamJson,
                other => return Err(v.bad(other, "text, stream-json")),
            };
            Ok(())
        }),
    ),
    flag(
        "include-partial-messages",
        None,
        None,
        "With stream-json output, stream text and thinking deltas as they arrive.",
        Scope::Agent,
        Set::Agent(|a, _| {
            a.include_partial_messages = true;
            Ok(())
        }),
    ),
    flag(
        "continue",
        Some('c'),
        None,
        "Continue the latest print-mode conversation in this workspace (print mode only).",
        Scope::Print,
        Set::Agent(|a, _| {
            if matches!(a.resume, Some(Resume::Id(_))) {
                return Err(COMBINED.into());
            }
            a.resume = Some(Resume::Latest);
            Ok(())
        }),
    ),
    flag(
        "resume",
        Some('r'),
        Some("ID"),
        "Continue the conversation of ID: a result frame's session_id, or a run id (run-N) of any surface (print mode only).",
        Scope::Print,
        Set::Agent(|a, v| {
            if a.resume == Some(Resume::Latest) {
                return Err(COMBINED.into());
            }
            let id = v.string()?;
            if id.trim().is_empty() {
                return Err(v.bad(&id, "a session id or run id"));
            }
            a.resume = Some(Resume::Id(id));
            Ok(())
        }),
    ),
    flag(
        "provider",
        None,
        Some("NAME"),
        "anthropic or openai (any OpenAI-compatible server). Default: from settings, else whichever API key or base URL is set.",
        Scope::Agent,
        Set::Agent(|a, v| v.string().map(|x| a.provider = Some(x))),
    ),
    flag(
        "model",
        None,
        Some("NAME"),
        "Model name (default claude-sonnet-4-6 for anthropic, gpt-5.5 for openai).",
        Scope::Agent,
        Set::Agent(|a, v| v.string().map(|x| a.model = Some(x))),
    ),
    flag(
        "max-tokens",
        None,
        Some("N"),
        "Output token limit per model turn (default 8192).",
        Scope::Agent,
        Set::Agent(|a, v| v.number().map(|x| a.max_tokens = Some(x))),
    ),
    flag(
        "max-turns",
        None,
        Some("N"),
        "Stop after N model turns (default 50); exit code 75.",
        Scope::Agent,
        Set::Agent(|a, v| v.positive().map(|x| a.max_turns = Some(x))),
    ),
    flag(
        "system-prompt",
        None,
        Some("TEXT"),
        "Replace the built-in system prompt.",
        Scope::Agent,
        Set::Agent(|a, v| v.string().map(|x| a.system_prompt = Some(x))),
    ),
    flag(
        "no-project-instructions",
        None,
        None,
        "Do not add AGENTS.md, CALIBAN.md or CLAUDE.md files (the project's and the user's) to the system prompt.",
        Scope::Agent,
        Set::Agent(|a, _| {
            a.no_project_instructions = true;
            Ok(())
        }),
    ),
    flag(
        "cwd",
        Some('C'),
        Some("DIR"),
        "Workspace root for tools and project settings (default: the current directory).",
        Scope::Agent,
        Set::Agent(|a, v| v.path().map(|x| a.cwd = Some(x))),
    ),
    flag(
        "allow",
        None,
        Some("PATTERN"),
        "Allow tool calls matching PATTERN, e.g. 'Bash(cargo test:*)' or 'Bash:git *'. Repeatable.",
        Scope::Agent,
        Set::Agent(|a, v| v.string().map(|x| a.allow.push(x))),
    ),
    flag(
        "ask",
        None,
        Some("PATTERN"),
        "Ask before tool calls matching PATTERN (denied in print mode). Repeatable.",
        Scope::Agent,
        Set::Agent(|a, v| v.string().map(|x| a.ask.push(x))),
    ),
    flag(
        "deny",
        None,
        Some("PATTERN"),
        "Deny tool calls matching PATTERN. Repeatable; deny rules are checked before allow rules.",
        Scope::Agent,
        Set::Agent(|a, v| v.string().map(|x| a.deny.push(x))),
    ),
    flag(
        "permission-mode",
        None,
        Some("MODE"),
        "default, acceptEdits, plan, dontAsk or bypassPermissions.",
        Scope::Agent,
        Set::Agent(|a, v| v.string().map(|x| a.permission_mode = Some(x))),
    ),
    flag(
        "sandbox",
        None,
        Some("MODE"),
        "What commands may do: read-only, workspace-write (default where the kernel has Landlock), network or off.",
        Scope::Agent,
        Set::Agent(|a, v| {
            let value = v.string()?;
            let mode = crate::sandbox::Mode::parse(&value)
                .ok_or_else(|| v.bad(&value, &crate::sandbox::Mode::names()))?;
            a.sandbox = Some(mode);
            Ok(())
        }),
    ),
    flag(
        "mcp-config",
        None,
        Some("FILE"),
        "Use the MCP servers FILE names ({\"mcpServers\": {…}}, as in .mcp.json). Repeatable; a later file wins a name.",
        Scope::Agent,
        Set::Agent(|a, v| v.path().map(|x| a.mcp_config.push(x))),
    ),
    flag(
        "approve-mcp",
        None,
        Some("NAME"),
        "Approve the workspace's MCP server NAME (from .mcp.json or project settings), or `all`; remembered for the workspace. Repeatable.",
        Scope::Agent,
        Set::Agent(|a, v| v.string().map(|x| a.approve_mcp.push(x))),
    ),
    flag(
        "mcp-timeout",
        None,
        Some("SECS"),
        "Cancel an MCP tool call with no answer and no progress for SECS (default 300).",
        Scope::Agent,
        Set::Agent(|a, v| v.seconds().map(|x| a.mcp_timeout = Some(x))),
    ),
    flag(
        "max-retries",
        None,
        Some("N"),
        "Retries of a model request that failed before any output (default 4).",
        Scope::Agent,
        Set::Agent(|a, v| v.number().map(|x| a.max_retries = Some(x))),
    ),
    flag(
        "first-byte-timeout",
        None,
        Some("SECS"),
        "Give up on a model request with no output after SECS: connecting, queueing and prompt processing; keep-alives do not count (default 300).",
        Scope::Agent,
        Set::Agent(|a, v| v.seconds().map(|x| a.first_byte_timeout = Some(x))),
    ),
    flag(
        "idle-timeout",
        None,
        Some("SECS"),
        "Fail a model stream with no new output for SECS once output started; keep-alives do not count (default 90).",
        Scope::Agent,
        Set::Agent(|a, v| v.seconds().map(|x| a.idle_timeout = Some(x))),
    ),
    flag(
        "request-timeout",
        None,
        Some("SECS"),
        "Give up on a model request still streaming after SECS, however steadily (default 3600).",
        Scope::Agent,
        Set::Agent(|a, v| v.seconds().map(|x| a.request_timeout = Some(x))),
    ),
    flag(
        "verbose",
        Some('v'),
        None,
        "Log more to stderr (repeat for debug).",
        Scope::Agent,
        Set::Agent(|a, _| {
            a.verbose = a.verbose.saturating_add(1);
            Ok(())
        }),
    ),
    flag(
        "version",
        Some('V'),
        None,
        "Print the version and git hash.",
        Scope::Agent,
        Set::Answer(|_| Ok(Command::Version)),
    ),
    flag(
        "help",
        Some('h'),
        None,
        "Print help.",
        Scope::Any,
        Set::Answer(|_| Ok(Command::Help)),
    ),
    flag(
        "generate",
        None,
        Some("man"),
        "Print the man page (roff) to stdout.",
        Scope::Agent,
        Set::Answer(|v| {
            let what = v.string()?;
            if what != "man" {
                return Err(v.bad(&what, "man"));
            }
            Ok(Command::GenerateMan)
        }),
    ),
    flag(
        "addr",
        None,
        Some("ADDR"),
        "Address to listen on (default 127.0.0.1:8730). A non-loopback address needs CALIBAN_DRIVE_TOKEN.",
        Scope::Serve(&[Surface::Http]),
        Set::Serve(|s, v| v.string().map(|x| s.addr = Some(x))),
    ),
    flag(
        "tls-cert",
        None,
        Some("PEM"),
        "Serve HTTPS with this certificate chain (needs --tls-key).",
        Scope::Serve(LISTENING),
        Set::Serve(|s, v| v.path().map(|x| s.tls_cert = Some(x))),
    ),
    flag(
        "tls-key",
        None,
        Some("PEM"),
        "Private key for --tls-cert.",
        Scope::Serve(LISTENING),
        Set::Serve(|s, v| v.path().map(|x| s.tls_key = Some(x))),
    ),
    flag(
        "permission-timeout",
        None,
        Some("SECS"),
        "Deny a permission prompt nobody answered after SECS (default 600).",
        Scope::Serve(ALL_SURFACES),
        Set::Serve(|s, v| v.seconds().map(|x| s.permission_timeout = Some(x))),
    ),
    flag(
        "max-connections",
        None,
        Some("N"),
        "Serve at most N connections at once; more wait in the backlog (default 256).",
        Scope::Serve(LISTENING),
        Set::Serve(|s, v| v.positive().map(|x| s.max_connections = Some(x))),
    ),
    flag(
        "max-working-runs",
        None,
        Some("N"),
        "Let at most N runs stream or run tools at once; more are refused (503, or a busy error) until one pauses or ends (default 64).",
        Scope::Serve(ALL_SURFACES),
        Set::Serve(|s, v| v.positive().map(|x| s.max_working_runs = Some(x))),
    ),
    flag(
        "max-live-runs",
        None,
        Some("N"),
        "Keep at most N runs open at once, idle interactive ones included (default 4096).",
        Scope::Serve(ALL_SURFACES),
        Set::Serve(|s, v| v.positive().map(|x| s.max_live_runs = Some(x))),
    ),
    flag(
        "listen",
        None,
        Some("ADDR"),
        "Also serve MCP Streamable HTTP at ADDR, path /mcp. A non-loopback address needs CALIBAN_DRIVE_TOKEN.",
        Scope::Serve(&[Surface::Mcp]),
        Set::Serve(|s, v| v.string().map(|x| s.addr = Some(x))),
    ),
    flag(
        "listen",
        None,
        Some("ADDR"),
        "Listen on ADDR (IP:PORT) with TLS and a bearer preamble; needs CALIBAN_AGENT_TOKEN, CALIBAN_AGENT_TLS_CERT and CALIBAN_AGENT_TLS_KEY, else refuses to start.",
        Scope::Serve(&[Surface::Agent]),
        Set::Serve(|s, v| v.string().map(|x| s.addr = Some(x))),
    ),
    flag(
        "socket",
        None,
        Some("PATH"),
        "Listen on a Unix socket created at PATH with mode 0600 (no TLS, no preamble) instead of --listen.",
        Scope::Serve(&[Surface::Agent]),
        Set::Serve(|s, v| v.path().map(|x| s.socket = Some(x))),
    ),
    flag(
        "spec",
        None,
        Some("FILE"),
        "The JSON spawn spec (else CALIBAN_AGENT_SPEC): initial_prompt, interactive, model, provider, tool_allowlist, label, drive_protocol (ndjson|acp), permission_posture (supervised|unattended), sandbox.",
        Scope::Serve(&[Surface::Agent]),
        Set::Serve(|s, v| v.path().map(|x| s.spec = Some(x))),
    ),
    flag(
        "script",
        None,
        Some("FILE"),
        "JSON script of turns to serve (see README, \"stub-model\").",
        Scope::StubModel,
        Set::Stub(|s, v| v.path().map(|x| s.script = Some(x))),
    ),
    flag(
        "addr",
        None,
        Some("ADDR"),
        "Loopback address to listen on (default 127.0.0.1:0, a free port).",
        Scope::StubModel,
        Set::Stub(|s, v| v.string().map(|x| s.addr = x)),
    ),
];

const COMBINED: &str = "--continue and --resume cannot be combined";

/// A `… serve` command: what starts a drive surface. Parsing, `--help`, the man page and
/// `app` all read it.
pub struct SurfaceCommand {
    pub surface: Surface,
    /// The command as typed, and as help, errors and the surface's banner name it.
    pub name: &'static str,
    pub help: &'static str,
    /// The flag that says where it listens (`app` names it when the address is bad).
    pub listen_flag: Option<&'static str>,
}

/// Every serve command, in `Surface`'s order, which is help's.
pub const SURFACES: &[SurfaceCommand] = &[
    SurfaceCommand {
        surface: Surface::Mcp,
        name: "mcp serve",
        help: "Be an MCP server over stdio (and Streamable HTTP with --listen): another agent drives caliban as a worker.",
        listen_flag: Some("--listen"),
    },
    SurfaceCommand {
        surface: Surface::Acp,
        name: "acp serve",
        help: "Be an ACP agent over stdio for editors such as Zed.",
        listen_flag: None,
    },
    SurfaceCommand {
        surface: Surface::Http,
        name: "http serve",
        help: "Serve the drive API over HTTP: start runs, stream their events, answer prompts (see README). Takes the agent options above too.",
        listen_flag: Some("--addr"),
    },
    SurfaceCommand {
        surface: Surface::Agent,
        name: "agent serve",
        help: "Be a networked agent a supervisor drives: ACP, or the NDJSON session plane over its spec's run, on TLS with a bearer preamble or on a Unix socket (see README). Takes the agent options above too.",
        listen_flag: Some("--listen"),
    },
];

/// The other commands, listed after the serve commands, with the flags of their own
/// (`sandbox check` has none: it takes the agent options).
const OTHER_COMMANDS: &[(&str, &str, Option<On>)] = &[
    (
        "sandbox check",
        "Report what the command sandbox can enforce on this machine, with a live test; exit 0 when the configured mode is enforced.",
        None,
    ),
    (
        "stub-model",
        "Serve scripted Anthropic and OpenAI streams on loopback, for offline tests, demos and benchmarks.",
        Some(On::StubModel),
    ),
];

/// Every command but print mode, in help's order: name, help and its own flags.
fn commands() -> impl Iterator<Item = (&'static str, &'static str, Vec<&'static Flag>)> {
    let serve = SURFACES
        .iter()
        .map(|c| (c.name, c.help, Some(On::Serve(c.surface))));
    serve
        .chain(OTHER_COMMANDS.iter().copied())
        .map(|(name, help, on)| {
            let own = FLAGS
                .iter()
                .filter(|f| !f.scope.is_agent_wide() && on.is_some_and(|on| f.scope.accepts(on)))
                .collect();
            (name, help, own)
        })
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OutputFormat {
    #[default]
    Text,
    Json,
    StreamJson,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum InputFormat {
    #[default]
    Text,
    StreamJson,
}

#[derive(Clone, Debug, Default, PartialEq)]
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

/// Which drive surface a `… serve` command starts; its command is `SURFACES[surface as
/// usize]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Surface {
    Mcp,
    Acp,
    Http,
    Agent,
}

impl Surface {
    pub fn command(self) -> &'static SurfaceCommand {
        &SURFACES[self as usize]
    }

    pub fn name(self) -> &'static str {
        self.command().name
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

impl ServeArgs {
    fn new(surface: Surface) -> ServeArgs {
        ServeArgs {
            surface,
            agent: PrintArgs::default(),
            addr: None,
            socket: None,
            spec: None,
            tls_cert: None,
            tls_key: None,
            permission_timeout: None,
            max_connections: None,
            max_working_runs: None,
            max_live_runs: None,
        }
    }
}

/// What `stub-model`'s flags say.
struct StubArgs {
    script: Option<PathBuf>,
    addr: String,
}

/// Parses argv (without the program name).
pub fn parse(args: impl IntoIterator<Item = OsString>) -> Result<Command, lexopt::Error> {
    let mut parser = lexopt::Parser::from_args(args);
    let mut print = PrintArgs::default();
    let mut positional: Vec<String> = Vec::new();
    let mut serve: Option<ServeArgs> = None;
    let mut check = false;
    while let Some(arg) = parser.next()? {
        let v = match arg {
            Value(v) => v,
            arg => {
                let on = serve
                    .as_ref()
                    .map_or(On::Print, |serve| On::Serve(serve.surface));
                let flag = flag_for(arg, on)?;
                let given = &mut Given {
                    flag,
                    parser: &mut parser,
                };
                match (flag.set, serve.as_mut()) {
                    (Set::Agent(set), _) => set(&mut print, given)?,
                    (Set::Serve(set), Some(serve)) => set(serve, given)?,
                    (Set::Answer(answer), _) => return answer(given),
                    // `flag_for` hands these only to the commands that take them.
                    (Set::Serve(_) | Set::Stub(_), _) => {}
                }
                continue;
            }
        };
        if let Some(serve) = &serve {
            return Err(lexopt::Error::from(format!(
                "unexpected argument `{}`: {} takes no prompt",
                v.to_string_lossy(),
                serve.surface.name()
            )));
        }
        if !positional.is_empty() {
            positional.push(v.string()?);
        } else if v == "stub-model" {
            return parse_stub_model(&mut parser);
        } else if v == "sandbox" && !check {
            match parser.value()?.string()?.as_str() {
                "check" => check = true,
                other => {
                    return Err(lexopt::Error::from(format!(
                        "unknown command `sandbox {other}`: expected `sandbox check`"
                    )));
                }
            }
        } else if let Some(command) = SURFACES
            .iter()
            .find(|c| c.name.split(' ').next() == v.to_str())
        {
            let which = v.string()?;
            match parser.value()?.string()?.as_str() {
                "serve" => {}
                other => {
                    return Err(lexopt::Error::from(format!(
                        "unknown command `{which} {other}`: expected `{which} serve`"
                    )));
                }
            }
            serve = Some(ServeArgs::new(command.surface));
        } else {
            positional.push(v.string()?);
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
    let mut stub = StubArgs {
        script: None,
        addr: "127.0.0.1:0".to_owned(),
    };
    while let Some(arg) = parser.next()? {
        let flag = flag_for(arg, On::StubModel)?;
        let given = &mut Given { flag, parser };
        match flag.set {
            Set::Stub(set) => set(&mut stub, given)?,
            Set::Answer(answer) => return answer(given),
            // `flag_for` hands `stub-model` only its own flags and help.
            Set::Agent(_) | Set::Serve(_) => {}
        }
    }
    let script = stub
        .script
        .ok_or_else(|| lexopt::Error::from("stub-model needs --script FILE"))?;
    Ok(Command::StubModel {
        script,
        addr: stub.addr,
    })
}

/// The row of the flag `arg` names that the command being parsed takes, or why there is
/// none: a serve command names the print-mode and other commands' flags it refuses.
fn flag_for(arg: lexopt::Arg, on: On) -> Result<&'static Flag, lexopt::Error> {
    let named = |f: &&Flag| match &arg {
        Long(name) => f.long == *name,
        Short(c) => f.short == Some(*c),
        Value(_) => false,
    };
    if let Some(flag) = FLAGS.iter().filter(named).find(|f| f.scope.accepts(on)) {
        return Ok(flag);
    }
    if let On::Serve(surface) = on {
        if FLAGS.iter().filter(named).any(|f| f.scope == Scope::Print) {
            return Err(lexopt::Error::from(format!(
                "--continue and --resume apply to print mode, not `{}`",
                surface.name()
            )));
        }
        if let Long(name) = arg
            && FLAGS.iter().filter(named).any(|f| !f.scope.is_agent_wide())
        {
            return Err(lexopt::Error::from(format!(
                "--{name} does not apply to `{}`",
                surface.name()
            )));
        }
    }
    Err(arg.unexpected())
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
    for f in FLAGS.iter().filter(|f| f.scope.is_agent_wide()) {
        out.push_str(&format!("    {:<34} {}\n", flag_label(f), f.help));
    }
    out.push_str("\nCOMMANDS:\n");
    for (name, help, own) in commands() {
        out.push_str(&format!("    {name:<13} {help}\n"));
        for f in own {
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
    for f in FLAGS.iter().filter(|f| f.scope.is_agent_wide()) {
        entry(&mut out, f);
    }
    out.push_str(".SH COMMANDS\n");
    for (name, help, own) in commands() {
        out.push_str(&format!(
            ".SS {}\n{}\n",
            roff_escape(name),
            roff_escape(help)
        ));
        for f in own {
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
            if f.scope == Scope::StubModel {
                argv.push("stub-model".to_owned());
                if f.long != "script" {
                    argv.extend(["--script".to_owned(), "x.json".to_owned()]);
                }
            }
            if let Scope::Serve(surfaces) = f.scope {
                argv.extend(surfaces[0].name().split(' ').map(str::to_owned));
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
    fn surfaces_follow_their_enum_and_every_spelling_is_one_row_per_command() {
        for (at, command) in SURFACES.iter().enumerate() {
            assert_eq!(command.surface as usize, at, "{}", command.name);
            assert_eq!(command.surface.name(), command.name);
        }
        for on in [On::Print, On::StubModel]
            .into_iter()
            .chain(SURFACES.iter().map(|c| On::Serve(c.surface)))
        {
            let taken: Vec<&Flag> = FLAGS.iter().filter(|f| f.scope.accepts(on)).collect();
            for (at, f) in taken.iter().enumerate() {
                assert!(
                    !taken[..at]
                        .iter()
                        .any(|g| g.long == f.long || (f.short.is_some() && g.short == f.short)),
                    "--{} is two rows for {on:?}",
                    f.long
                );
            }
        }
    }

    #[test]
    fn a_serve_command_names_the_flags_it_refuses() {
        let refused = |list: &[&str]| parse(args(list)).unwrap_err().to_string();
        assert_eq!(
            refused(&["acp", "serve", "-c"]),
            "--continue and --resume apply to print mode, not `acp serve`"
        );
        assert_eq!(
            refused(&["mcp", "serve", "--addr", "x"]),
            "--addr does not apply to `mcp serve`"
        );
        assert_eq!(
            refused(&["http", "serve", "--script", "x"]),
            "--script does not apply to `http serve`"
        );
        assert_eq!(refused(&["--addr", "x"]), "invalid option '--addr'");
        assert_eq!(
            refused(&["http", "serve", "hi"]),
            "unexpected argument `hi`: http serve takes no prompt"
        );
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
