//! The command line: `main` parses the arguments, builds the configuration (settings files,
//! environment, flags), runs the chosen command — print mode, a drive surface, the stub
//! model — and maps the outcome to an exit code. `src/main.rs` only calls it.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use serde_json::json;

use crate::cli::{self, Command, InputFormat, PrintArgs, ServeArgs, Surface};
use crate::engine::{self, Engine, EngineConfig};
use crate::ids::{HostKey, RunId};
use crate::model::retry::RetryPolicy;
use crate::model::{self, Provider, ProviderKind};
use crate::permissions::{Mode, Policy};
use crate::print::{self, Printer};
use crate::surface::host::DriveHost;
use crate::surface::{self, ListenConfig, http_api};
use crate::{
    agent, auth, drive, exit, http, instructions, log, reaper, sandbox, settings, stub_model, sys,
    tools, transport,
};

pub fn main() -> ExitCode {
    let command = match cli::parse(std::env::args_os().skip(1)) {
        Ok(command) => command,
        Err(err) => {
            eprintln!("caliban: {err}\nTry `caliban --help`.");
            return ExitCode::from(exit::USAGE);
        }
    };
    match command {
        Command::Help => {
            print!("{}", cli::help_text());
            ExitCode::SUCCESS
        }
        Command::Version => {
            println!("caliban {} ({})", cli::VERSION, cli::GIT_HASH);
            ExitCode::SUCCESS
        }
        Command::GenerateMan => {
            print!("{}", cli::man_page());
            ExitCode::SUCCESS
        }
        Command::StubModel { script, addr } => {
            let args = stub_model::StubArgs { script, addr };
            match stub_model::run(&args) {
                Ok(()) => ExitCode::SUCCESS,
                Err(err) => {
                    log::error(&err);
                    ExitCode::from(exit::CONFIG)
                }
            }
        }
        Command::SandboxCheck(args) => ExitCode::from(sandbox_check(&args)),
        Command::Print(args) => ExitCode::from(reaping(|| run_print(*args))),
        Command::Serve(args) => ExitCode::from(reaping(|| match args.surface {
            cli::Surface::Http => run_http_serve(*args),
            cli::Surface::Mcp | cli::Surface::Acp => run_stdio_surface(*args),
            cli::Surface::Agent => run_agent_serve(*args),
        })),
    }
}

/// Runs a command that starts tool processes: caliban becomes the subreaper of what they
/// leave behind before anything runs, and kills whatever is left when the command returns,
/// however it ends (`reaper`).
fn reaping(command: impl FnOnce() -> u8) -> u8 {
    if let Err(e) = reaper::enable() {
        log::info(&format!(
            "{e}; processes a tool moves to a session of its own are not tracked"
        ));
    }
    let code = command();
    reaper::kill_all();
    crate::sandbox::remove_placeholders();
    code
}

fn env_var(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

fn config_error(msg: &str) -> u8 {
    log::error(msg);
    exit::CONFIG
}

/// Everything both print mode and the servers derive from the agent options, settings
/// files and environment.
struct AgentSetup {
    workspace: PathBuf,
    provider: Provider,
    /// Why no model can be reached (`model::NOT_CONFIGURED`, a bad provider variable), when
    /// the caller tolerates it (`NoProvider::Report`); `provider` is then a stand-in.
    provider_problem: Option<String>,
    mode: Mode,
    policy: Policy,
    run_config: agent::run::RunConfig,
    engine_config: EngineConfig,
    context_windows: settings::ContextWindows,
    /// Models a client may choose between (settings' `models`), the configured one first.
    models: Vec<String>,
    /// Where each run's project instructions come from (`run_config.system` has none yet).
    instructions: instructions::Sources,
}

/// What to do when no model provider can be set up.
#[derive(Clone, Copy, PartialEq, Eq)]
enum NoProvider {
    /// Exit 78 with the message (print mode, `http serve`, `mcp serve`).
    Exit,
    /// Start anyway and report the message where the protocol can (`acp serve`: an editor
    /// shows a crash for an agent that exits before `initialize`, and nothing of stderr).
    Report,
}

/// Resolves and installs the sandbox for this process's commands from `--sandbox`, the
/// settings files and the environment, and says once what it will do. `key_files` are
/// secrets caliban itself was given (TLS keys): commands may not read them either.
fn setup_sandbox(
    args: &PrintArgs,
    settings: &settings::Settings,
    key_files: &[PathBuf],
) -> sandbox::Mode {
    let own = own_files(key_files, &env_var);
    let config = sandbox::Config::new(args.sandbox, &settings.sandbox, &own, &env_var);
    let mode = config.mode;
    sandbox::install(config);
    sandbox::announce(mode);
    mode
}

/// What of caliban's own commands may not read: its settings, its state (session files,
/// the agent's socket) and the keys it was given (`key_files`, `CALIBAN_AGENT_TLS_KEY`).
/// The sandbox is told, since it is below the modules that know where these live.
fn own_files(key_files: &[PathBuf], env: &dyn Fn(&str) -> Option<String>) -> Vec<PathBuf> {
    let mut own: Vec<PathBuf> = settings::user_config_dir(env)
        .map(|dir| dir.join("caliban"))
        .into_iter()
        .collect();
    own.extend(
        drive::session::default_dir(env)
            .ok()
            .as_deref()
            .and_then(Path::parent)
            .map(Path::to_path_buf),
    );
    let keys = key_files
        .iter()
        .cloned()
        .chain(env("CALIBAN_AGENT_TLS_KEY").map(PathBuf::from));
    own.extend(keys.map(|path| path.canonicalize().unwrap_or(path)));
    own
}

/// `caliban sandbox check`: what the sandbox can do here, tested live.
fn sandbox_check(args: &PrintArgs) -> u8 {
    let workspace = match resolve_workspace(args.cwd.as_deref()) {
        Ok(workspace) => workspace,
        Err(e) => return config_error(&e),
    };
    let settings = match settings::load(&workspace, &env_var) {
        Ok(settings) => settings,
        Err(e) => return config_error(&e.to_string()),
    };
    setup_sandbox(args, &settings, &[]);
    let (report, enforced) = sandbox::check_report(&workspace);
    print!("{report}");
    if enforced { 0 } else { exit::RUNTIME }
}

fn agent_setup(
    args: &PrintArgs,
    interactive: bool,
    no_provider: NoProvider,
    key_files: &[PathBuf],
) -> Result<AgentSetup, u8> {
    log::set_level(match args.verbose {
        0 => log::Level::Warn,
        1 => log::Level::Info,
        _ => log::Level::Debug,
    });
    let workspace = resolve_workspace(args.cwd.as_deref()).map_err(|e| config_error(&e))?;
    let settings =
        settings::load(&workspace, &env_var).map_err(|e| config_error(&e.to_string()))?;
    for warning in &settings.warnings {
        log::warn(warning);
    }

    let model = args.model.clone().or(settings.model.clone());
    let provider = match args.provider.as_deref().or(settings.provider.as_deref()) {
        Some(name) => ProviderKind::parse(name)
            .map(Some)
            .ok_or_else(|| format!("unknown provider `{name}`: expected anthropic or openai")),
        None => Ok(None),
    }
    .and_then(|kind| Provider::from_env(kind, model.clone(), &env_var))
    .and_then(|provider| provider.ok_or_else(|| model::NOT_CONFIGURED.to_owned()));
    let (provider, provider_problem) = match (provider, no_provider) {
        (Ok(provider), _) => (provider, None),
        (Err(problem), NoProvider::Exit) => return Err(config_error(&problem)),
        (Err(problem), NoProvider::Report) => {
            log::warn(&problem);
            (stand_in_provider(model), Some(problem))
        }
    };

    let mode = match args
        .permission_mode
        .as_deref()
        .map(|m| Mode::parse(m).ok_or(m))
        .transpose()
    {
        Ok(mode) => mode.or(settings.default_mode).unwrap_or(Mode::Default),
        Err(bad) => {
            log::error(&format!(
                "invalid --permission-mode `{bad}`: expected default, acceptEdits, plan, dontAsk or bypassPermissions"
            ));
            return Err(exit::USAGE);
        }
    };
    let mut rules = settings::rules_from_cli(&args.allow, &args.deny, &args.ask).map_err(|e| {
        log::error(&e.to_string());
        exit::USAGE
    })?;
    rules.extend(settings.rules.iter().cloned());
    let sandbox = setup_sandbox(args, &settings, key_files);
    let policy = Policy::new(rules, mode, workspace.clone()).with_sandbox(sandbox);

    let workspace_str = workspace.display().to_string();
    let run_config = agent::run::RunConfig {
        model: provider.model.clone(),
        max_tokens: args.max_tokens.or(settings.max_tokens).unwrap_or(8192),
        max_turns: args.max_turns.or(settings.max_turns).unwrap_or(50),
        system: args
            .system_prompt
            .clone()
            .unwrap_or_else(|| agent::default_system_prompt(&workspace_str)),
        tools: std::sync::Arc::new(tools::table::specs()),
        interactive,
        context_window: settings.context_window.of(&provider.model),
        effort: None,
        // The drive surfaces turn this on: they have someone to ask.
        sandbox_retry: false,
        mcp_allowlist: None,
    };
    let engine_config = EngineConfig {
        provider: provider.clone(),
        retry: RetryPolicy {
            max_retries: args
                .max_retries
                .unwrap_or(RetryPolicy::default().max_retries),
            ..RetryPolicy::default()
        },
        first_byte_timeout: args
            .first_byte_timeout
            .map_or(engine::DEFAULT_FIRST_BYTE_TIMEOUT, Duration::from_secs_f64),
        idle_timeout: args
            .idle_timeout
            .map_or(engine::DEFAULT_IDLE_TIMEOUT, Duration::from_secs_f64),
        request_timeout: args
            .request_timeout
            .map_or(engine::DEFAULT_REQUEST_TIMEOUT, Duration::from_secs_f64),
        mcp: mcp_setup(args, &settings, &workspace)?,
        idle_connections: crate::http::pool::MAX_IDLE_PER_KEY,
        webfetch_block_private: settings.webfetch_block_private,
    };
    let mut models = vec![provider.model.clone()];
    for model in settings.models.iter().flatten() {
        if !models.contains(model) {
            models.push(model.clone());
        }
    }
    let instructions = instructions::Sources::from_env(
        !args.no_project_instructions && settings.project_instructions != Some(false),
        &env_var,
    );
    Ok(AgentSetup {
        workspace,
        provider,
        provider_problem,
        mode,
        policy,
        run_config,
        engine_config,
        context_windows: settings.context_window,
        models,
        instructions,
    })
}

/// The configured MCP servers: `--mcp-config` files, the settings files' `mcpServers` and
/// the workspace's `.mcp.json` (precedence in `mcp_client::config::merge`), with the
/// workspace's own servers only once approved (`mcp_client::approval::Approvals::admit`).
fn mcp_setup(
    args: &PrintArgs,
    settings: &settings::Settings,
    workspace: &Path,
) -> Result<engine::McpConfig, u8> {
    use crate::mcp_client::{approval::Approvals, config};
    let mut approvals = Approvals::new(
        args.approve_mcp.clone(),
        settings.enabled_mcpjson_servers.clone(),
        settings.enable_all_project_mcp_servers,
        crate::mcp_client::approval::default_file(&env_var),
    );
    let from_settings: Vec<(config::Origin, serde_json::Map<String, serde_json::Value>)> = settings
        .mcp_servers
        .iter()
        .map(|(source, servers)| {
            let origin = if *source == crate::permissions::RuleSource::User {
                config::Origin::User
            } else {
                config::Origin::Project
            };
            (origin, servers.clone())
        })
        .collect();
    let configured = config::merge(workspace, &args.mcp_config, &from_settings, &env_var)
        .map_err(|e| config_error(&e))?;
    let (servers, unapproved, warnings) = approvals.admit(workspace, configured);
    for warning in &warnings {
        log::warn(warning);
    }
    if !args.approve_mcp.is_empty()
        && let Err(e) = approvals.record(workspace, &servers)
    {
        log::warn(&format!("cannot remember MCP server approvals: {e}"));
    }
    let call_timeout = args
        .mcp_timeout
        .map(Duration::from_secs_f64)
        .or(settings
            .mcp_timeout
            .map(|s| Duration::from_secs(u64::from(s))))
        .unwrap_or(crate::mcp_client::DEFAULT_CALL_TIMEOUT);
    Ok(engine::McpConfig {
        servers,
        workspace: workspace.to_path_buf(),
        call_timeout,
        unapproved,
        approvals_file: approvals.file.clone(),
    })
}

/// The provider an engine is built with when none is configured and the surface reports
/// that instead (`NoProvider::Report`). The surface starts no run then, so it is never
/// asked for anything; if it were, it would fail like any unreachable server (port 9 on
/// loopback is the discard port, refused on any machine not running that service).
fn stand_in_provider(model: Option<String>) -> Provider {
    let kind = ProviderKind::Anthropic;
    Provider {
        kind,
        target: http::target::Target {
            tls: false,
            host: "127.0.0.1".to_owned(),
            port: 9,
        },
        path: model::anthropic::PATH.to_owned(),
        proxy: None,
        api_key: None,
        tls: None,
        model: model.unwrap_or_else(|| kind.default_model().to_owned()),
    }
}

fn run_print(args: PrintArgs) -> u8 {
    let interactive = args.input_format == InputFormat::StreamJson;
    let setup = match agent_setup(&args, interactive, NoProvider::Exit, &[]) {
        Ok(s) => s,
        Err(code) => return code,
    };
    let resumed = match &args.resume {
        Some(resume) => match resume_point(&setup, resume) {
            Ok(point) => Some(point),
            Err(e) => return config_error(&e),
        },
        None => None,
    };
    let AgentSetup {
        workspace,
        provider,
        mode,
        policy,
        run_config,
        engine_config,
        instructions,
        context_windows,
        ..
    } = setup;
    // For the init frame; the core loads them again for the run's system prompt and its
    // session header, as it does for every run it starts.
    let loaded = instructions.load(&workspace);
    let (history, continues, session_id) = match resumed {
        Some(point) => (point.history, Some(point.run), point.session_id),
        None => (Vec::new(), None, auth::new_uuid()),
    };
    let tool_names: Vec<String> = run_config
        .tools
        .iter()
        .map(|t| t.name.to_string())
        .collect();
    let workspace_str = workspace.display().to_string();

    // Text input: the prompt comes from argv or, failing that, all of stdin.
    let prompt = match args.input_format {
        InputFormat::StreamJson if args.prompt.is_some() => {
            log::error("a prompt argument cannot be combined with --input-format stream-json");
            return exit::USAGE;
        }
        InputFormat::StreamJson => None,
        InputFormat::Text => match args.prompt.clone() {
            Some(p) if !p.trim().is_empty() && p != "-" => Some(p),
            _ => match read_stdin_prompt() {
                Ok(p) if !p.trim().is_empty() => Some(p),
                Ok(_) => {
                    log::error("no prompt: pass one as an argument or on stdin");
                    return exit::NO_INPUT;
                }
                Err(code) => return code,
            },
        },
    };

    let mut engine = match Engine::new(engine_config) {
        Ok(e) => e,
        Err(e) => {
            log::error(&format!("cannot start the event loop: {e}"));
            return exit::RUNTIME;
        }
    };
    engine.attach_stdout();
    // The run goes through the drive core, which records it like any driven run, so a later
    // `--continue` or `--resume` can go on with it.
    let (store, _scratch) = match session_store() {
        Ok(store) => (store, None),
        Err(e) => {
            log::warn(&format!(
                "{e}; this run is not recorded and cannot be continued"
            ));
            match scratch_store() {
                Ok((store, scratch)) => (store, Some(scratch)),
                Err(e) => {
                    log::error(&e);
                    return exit::RUNTIME;
                }
            }
        }
    };
    let mut header = serde_json::Map::new();
    header.insert("surface".into(), json!("print"));
    header.insert("session_id".into(), json!(session_id));
    let spec = drive::table::RunSpec {
        interactive,
        history,
        continues,
        extra_header: header,
        // Stdout is the run's output; its file only lets it be continued.
        record_best_effort: true,
        ..Default::default()
    };
    let config = drive::table::DriveConfig {
        system_prompt: Some(run_config.system.clone()),
        run: run_config,
        policy: policy.clone(),
        workspace: workspace.clone(),
        provider: provider.kind.as_str(),
        permission_timeout: drive::table::DEFAULT_PERMISSION_TIMEOUT,
        instructions,
        max_working_runs: 1,
        max_live_runs: 1,
        context_windows,
        models: Vec::new(),
        mcp_names: Vec::new(),
    };
    let core = drive::table::DriveCore::new(store.without_syncs(), config);
    let printer = Printer::new(
        spec,
        args.output_format,
        args.input_format,
        args.include_partial_messages,
        session_id,
        provider.kind.as_str(),
        provider.model.clone(),
        policy.clone(),
    );
    let mut host = DriveHost::new(core, printer);
    let mcp_servers = engine.mcp_select(&Default::default());
    host.surface.init_frame(
        &tool_names,
        &mcp_servers,
        &workspace_str,
        mode.as_str(),
        sandbox::describe(policy.sandbox()),
        &loaded,
    );
    match prompt {
        Some(prompt) => {
            if let Err(e) = host.surface.start_text(&mut host.core, prompt) {
                log::error(&format!("cannot start the run: {e}"));
                return exit::RUNTIME;
            }
            for action in host.take_engine_actions() {
                engine.push_action(action);
            }
        }
        None => {
            host.surface.wait_for_first_line();
            if let Err(e) = engine.attach_stdin() {
                log::error(&format!("cannot read stdin: {e}"));
                return exit::RUNTIME;
            }
        }
    }
    if let Err(e) = engine.run_loop(&mut host) {
        log::error(&format!("event loop failed: {e}"));
        return exit::RUNTIME;
    }
    host.surface.exit_code
}

/// Where a print run is kept when the session store cannot be opened: a private directory
/// of its own, removed when print mode returns (after the core and its store, declared
/// later, are gone), so the run goes on without being resumable.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn scratch_store() -> Result<(drive::session::SessionStore, Scratch), String> {
    use std::os::unix::fs::DirBuilderExt;
    let failed =
        |e: std::io::Error| format!("cannot keep the run even in a scratch directory: {e}");
    // A name nobody can guess, made here or not at all: the temporary directory is shared,
    // and one another user made first would be handed the conversation.
    let temp = std::env::temp_dir();
    std::fs::create_dir_all(&temp).map_err(failed)?;
    let dir = temp.join(format!("caliban-print-{}", auth::new_uuid()));
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&dir)
        .map_err(failed)?;
    let scratch = Scratch(dir.clone());
    drive::session::SessionStore::open(dir)
        .map(|store| (store, scratch))
        .map_err(failed)
}

/// The session files' store: `$XDG_STATE_HOME/caliban/sessions`.
fn session_store() -> Result<drive::session::SessionStore, String> {
    drive::session::default_dir(&env_var)
        .and_then(|dir| drive::session::SessionStore::open(dir).map_err(|e| e.to_string()))
        .map_err(|e| format!("session store: {e}"))
}

/// The conversation a print run continues (`--continue`, `--resume`).
struct ResumePoint {
    run: RunId,
    history: Vec<model::types::Message>,
    /// The conversation keeps its session id.
    session_id: String,
}

/// Finds the run to continue and rebuilds its conversation, through the drive core so that
/// it is read exactly as the drive surfaces read their runs (continuation chains included).
fn resume_point(setup: &AgentSetup, resume: &cli::Resume) -> Result<ResumePoint, String> {
    let config = drive::table::DriveConfig {
        run: setup.run_config.clone(),
        policy: setup.policy.clone(),
        workspace: setup.workspace.clone(),
        provider: setup.provider.kind.as_str(),
        permission_timeout: drive::table::DEFAULT_PERMISSION_TIMEOUT,
        system_prompt: None,
        instructions: setup.instructions.clone(),
        max_working_runs: drive::table::MAX_WORKING_RUNS,
        max_live_runs: drive::table::MAX_LIVE_RUNS,
        context_windows: setup.context_windows.clone(),
        models: Vec::new(),
        mcp_names: Vec::new(),
    };
    let mut core = drive::table::DriveCore::new(session_store()?, config);
    core.load_existing();
    let run = match resume {
        cli::Resume::Id(id) if RunId::parse(id).is_some() => {
            core.resolve(id).map_err(|e| e.to_string())?
        }
        cli::Resume::Id(id) => core
            .find_by_header("session_id", &json!(id))
            .last()
            .copied()
            .ok_or_else(|| format!("--resume {id}: no session with that id or run id"))?,
        cli::Resume::Latest => {
            let cwd = json!(setup.workspace.display().to_string());
            let print_runs: Vec<RunId> = core
                .find_by_header("cwd", &cwd)
                .into_iter()
                .filter(|run| core.header(*run).is_ok_and(|h| h["surface"] == "print"))
                .collect();
            print_runs.last().copied().ok_or_else(|| {
                format!(
                    "--continue: no earlier print-mode session in {}",
                    setup.workspace.display()
                )
            })?
        }
    };
    let header = core.header(run).map_err(|e| e.to_string())?;
    let messages = core.messages(run).map_err(|e| e.to_string())?;
    Ok(ResumePoint {
        run,
        history: model::types::Message::list_from_json(&messages),
        session_id: header["session_id"]
            .as_str()
            .map_or_else(auth::new_uuid, str::to_owned),
    })
}

/// Where a network surface listens: address, TLS, limits and the auth gate, checked
/// (fail closed) before anything binds.
fn listen_config(args: &ServeArgs, addr_text: &str) -> Result<ListenConfig, u8> {
    let Ok(addr) = addr_text.parse::<SocketAddr>() else {
        let flag = args.surface.command().listen_flag.unwrap_or_default();
        log::error(&format!("invalid {flag} {addr_text}"));
        return Err(exit::USAGE);
    };
    let gate = auth::Gate::from_env(&env_var);
    if let Err(e) = gate.check_bind(&addr) {
        log::error(&e);
        return Err(exit::CONFIG);
    }
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => {
            Some(transport::server_config(cert, key).map_err(|e| config_error(&e))?)
        }
        _ => None,
    };
    Ok(ListenConfig {
        addr,
        tls,
        limits: http::server::Limits::default(),
        max_connections: args
            .max_connections
            .unwrap_or(surface::DEFAULT_MAX_CONNECTIONS),
        gate,
    })
}

/// Where `--socket PATH` will be, absolute and with its directory's symlinks resolved (the
/// socket itself is made later): the spelling the sandbox's deny list needs.
fn control_socket_path(path: &Path) -> PathBuf {
    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    match (absolute.parent(), absolute.file_name()) {
        (Some(dir), Some(name)) => dir
            .canonicalize()
            .map(|dir| dir.join(name))
            .unwrap_or(absolute),
        _ => absolute,
    }
}

/// The drive core every serve command shares, with earlier runs loaded from disk, and why
/// no model can be reached if that is so and the surface reports it (`acp serve`).
fn drive_core(
    args: &ServeArgs,
) -> Result<(drive::table::DriveCore, EngineConfig, Option<String>), u8> {
    let fd_limit = sys::raise_fd_limit();
    let no_provider = match args.surface {
        Surface::Acp => NoProvider::Report,
        // A supervisor starts the networked agent: a missing provider is a configuration
        // error it should see at once, as for the other servers.
        Surface::Http | Surface::Mcp | Surface::Agent => NoProvider::Exit,
    };
    let mut key_files: Vec<PathBuf> = args.tls_key.iter().cloned().collect();
    // The agent's control socket is hidden from commands like a key: a run's process is
    // never a client (the front refuses one that connects anyway, `front::kin`), and where a
    // mount namespace confines commands they cannot even find it.
    key_files.extend(args.socket.as_deref().map(control_socket_path));
    let mut setup = agent_setup(&args.agent, false, no_provider, &key_files)?;
    setup.run_config.sandbox_retry = true;
    let store = session_store().map_err(|e| config_error(&e))?;
    let max_working_runs = args
        .max_working_runs
        .unwrap_or(drive::table::MAX_WORKING_RUNS);
    // As many runs may stream at once: keep as many warm model connections between turns,
    // but never more than a quarter of the descriptors the process may open, which the runs'
    // session files, their model connections and the clients' sockets need first.
    let idle = &mut setup.engine_config.idle_connections;
    *idle = (*idle).max(max_working_runs);
    if let Some(limit) = fd_limit {
        *idle = (*idle).min(usize::try_from(limit / 4).unwrap_or(usize::MAX));
    }
    let drive_config = drive::table::DriveConfig {
        run: setup.run_config,
        policy: setup.policy,
        workspace: setup.workspace,
        provider: setup.provider.kind.as_str(),
        permission_timeout: args
            .permission_timeout
            .map(Duration::from_secs_f64)
            .unwrap_or(drive::table::DEFAULT_PERMISSION_TIMEOUT),
        system_prompt: args.agent.system_prompt.clone(),
        instructions: setup.instructions,
        max_working_runs,
        max_live_runs: args.max_live_runs.unwrap_or(drive::table::MAX_LIVE_RUNS),
        context_windows: setup.context_windows,
        models: setup.models,
        mcp_names: setup
            .engine_config
            .mcp
            .servers
            .iter()
            .map(|s| s.name.clone())
            .collect(),
    };
    let mut core = drive::table::DriveCore::new(store, drive_config);
    // `GET /runs` lists earlier runs from the start; the stdio surfaces (spawned by editors
    // and agents, where start-up time matters) load the past when first asked for it.
    if args.surface == Surface::Http {
        core.load_existing();
    }
    Ok((core, setup.engine_config, setup.provider_problem))
}

fn new_engine<K: HostKey>(config: EngineConfig) -> Result<Engine<K>, u8> {
    Engine::new(config).map_err(|e| {
        log::error(&format!("cannot start the event loop: {e}"));
        exit::RUNTIME
    })
}

fn run_http_serve(args: ServeArgs) -> u8 {
    let addr_text = args
        .addr
        .clone()
        .unwrap_or_else(|| http_api::DEFAULT_ADDR.to_owned());
    let listen = match listen_config(&args, &addr_text) {
        Ok(l) => l,
        Err(code) => return code,
    };
    let (core, engine_config, _) = match drive_core(&args) {
        Ok(c) => c,
        Err(code) => return code,
    };
    match new_engine(engine_config) {
        Ok(engine) => http_api::run(engine, core, listen),
        Err(code) => code,
    }
}

/// `agent serve`: the networked agent. Everything that can refuse a start (where to listen,
/// the token and TLS material, the spawn spec, the provider) is checked before it binds.
fn run_agent_serve(mut args: ServeArgs) -> u8 {
    use surface::agent::{self, Listen, Plan, Posture};
    let refuse = |(code, message): agent::Refused| {
        log::error(&message);
        code
    };
    let listen = match (&args.addr, &args.socket) {
        (Some(addr), None) => match addr.parse::<SocketAddr>() {
            Ok(addr) => agent::tls_listen(addr, &env_var),
            Err(_) => {
                log::error(&format!("invalid --listen {addr}: expected IP:PORT"));
                return exit::USAGE;
            }
        },
        (None, Some(path)) => Ok(Listen::Unix(path.clone())),
        _ => {
            log::error("agent serve takes one of --listen ADDR and --socket PATH");
            return exit::USAGE;
        }
    };
    let plan = listen.and_then(|listen| {
        Ok(Plan {
            listen,
            spec: agent::load_spec(args.spec.as_deref(), &env_var)?,
            idle_timeout: agent::idle_timeout(&env_var)?,
        })
    });
    let plan = match plan {
        Ok(plan) => plan,
        Err(refused) => return refuse(refused),
    };
    // What the supervisor chose wins over flags; only the spec can make a run unattended.
    let spec = &plan.spec;
    if spec.model.is_some() {
        args.agent.model = spec.model.clone();
    }
    if spec.provider.is_some() {
        args.agent.provider = spec.provider.clone();
    }
    if spec.sandbox.is_some() {
        args.agent.sandbox = spec.sandbox;
    }
    if spec.posture == Posture::Unattended {
        args.agent.permission_mode = Some(Mode::DontAsk.as_str().to_owned());
    }
    let (mut core, engine_config, _) = match drive_core(&args) {
        Ok(c) => c,
        Err(code) => return code,
    };
    if let Some(tools) = &spec.tool_allowlist {
        core.retain_tools(tools);
    }
    let listener = match agent::bind(plan.listen) {
        Ok(listener) => listener,
        Err(refused) => return refuse(refused),
    };
    agent::serve(engine_config, core, &plan.spec, plan.idle_timeout, listener)
}

/// `mcp serve` and `acp serve`: JSON-RPC on stdin/stdout, which then carry nothing else.
fn run_stdio_surface(args: ServeArgs) -> u8 {
    let listen = match (&args.surface, &args.addr) {
        (Surface::Mcp, Some(addr)) => match listen_config(&args, addr) {
            Ok(l) => Some(l),
            Err(code) => return code,
        },
        _ => None,
    };
    let (core, engine_config, provider_problem) = match drive_core(&args) {
        Ok(c) => c,
        Err(code) => return code,
    };
    match args.surface {
        Surface::Mcp => match stdio_engine(engine_config) {
            Ok(engine) => surface::mcp::run(engine, core, listen),
            Err(code) => code,
        },
        _ => match stdio_engine(engine_config) {
            // With the networked agent's keys, `acp serve` and `agent serve`'s ACP are one
            // compiled engine and surface.
            Ok(engine) => {
                surface::acp::run::<surface::agent::NetKey>(engine, core, provider_problem)
            }
            Err(code) => code,
        },
    }
}

/// An engine whose stdin and stdout are the protocol channel.
fn stdio_engine<K: HostKey>(config: EngineConfig) -> Result<Engine<K>, u8> {
    let mut engine = new_engine(config)?;
    engine.attach_stdout();
    if let Err(e) = engine.attach_stdin() {
        log::error(&format!("cannot read stdin: {e}"));
        return Err(exit::RUNTIME);
    }
    Ok(engine)
}

fn resolve_workspace(cwd: Option<&Path>) -> Result<PathBuf, String> {
    let dir = match cwd {
        Some(dir) => dir.to_path_buf(),
        None => std::env::current_dir()
            .map_err(|e| format!("cannot read the current directory: {e}"))?,
    };
    dir.canonicalize()
        .map_err(|e| format!("workspace {}: {e}", dir.display()))
}

fn read_stdin_prompt() -> Result<String, u8> {
    use std::io::Read;
    if sys::is_tty(0) {
        log::error("no prompt: pass one as an argument or pipe it on stdin");
        return Err(exit::NO_INPUT);
    }
    let mut buf = Vec::new();
    let limit = print::MAX_STDIN_PROMPT as u64 + 1;
    if let Err(e) = std::io::stdin().lock().take(limit).read_to_end(&mut buf) {
        log::error(&format!("cannot read stdin: {e}"));
        return Err(exit::NO_INPUT);
    }
    if buf.len() > print::MAX_STDIN_PROMPT {
        // Malformed input, like any other the user sent: a usage error, not configuration.
        log::error(&format!(
            "stdin prompt exceeds {} bytes",
            print::MAX_STDIN_PROMPT
        ));
        return Err(exit::USAGE);
    }
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_are_kept_from_calibans_settings_state_and_keys() {
        let env = |name: &str| match name {
            "HOME" => Some("/home/u".to_owned()),
            "CALIBAN_AGENT_TLS_KEY" => Some("/nonexistent/agent.key".to_owned()),
            _ => None,
        };
        let own = own_files(&[PathBuf::from("/nonexistent/front.key")], &env);
        assert_eq!(
            own,
            [
                "/home/u/.config/caliban",
                "/home/u/.local/state/caliban",
                "/nonexistent/front.key",
                "/nonexistent/agent.key",
            ]
            .map(PathBuf::from)
        );
        let config = sandbox::Config::new(None, &sandbox::Settings::default(), &own, &env);
        assert!(own.iter().all(|path| config.deny.contains(path)));
    }
}
