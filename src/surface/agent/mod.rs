//! `caliban agent serve`: caliban as a networked agent, the way a supervisor or a
//! Kubernetes pod starts one. It listens on TCP with TLS and a bearer preamble (`--listen`)
//! or on a Unix socket (`--socket`), and serves one protocol chosen by its spawn spec: the
//! NDJSON session plane over the spec's run (`ndjson`), or exactly the ACP of `acp serve`
//! (`acp`). Network mode is fail-closed: no token, an empty token, no TLS material, or TLS
//! material that does not load refuses to start (exit 78).
//!
//! One client at a time: the newest connection to prove itself is the client; an older
//! one is told it was replaced (`Link`'s `replaced` line) and closed. Runs and sessions live in the process, so a client that reconnects picks
//! up where it left off (`session/load` in ACP, a `Resume` cursor on the NDJSON plane).
//! With no client and no run working for `CALIBAN_AGENT_IDLE_TIMEOUT_SECS` the agent exits;
//! SIGTERM cancels its runs (killing their tools) and exits.
//!
//! The connections are the network front's (`front::line`: listener, caps, the preamble
//! on the head deadline); `Link` adds the one-client rule and the idle exit, shared by the
//! two protocol surfaces (`ndjson`, `acp`). `spec` reads the spawn spec.

mod acp;
mod ndjson;
pub(crate) mod spec;

use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crate::auth::Token;
use crate::drive::table::DriveCore;
use crate::engine::{Engine, EngineConfig};
use crate::ids::HostKey;
use crate::log;
use crate::reactor::TimerId;
use crate::surface::front::line::{AgentListener, LineConn, LineEvent};
use crate::surface::front::{ConnId, Front, FrontKey};
use crate::surface::host::{Cx, DriveHost, Key, Surface};
pub(crate) use spec::{Posture, Protocol, Spec};

pub(crate) const TOKEN_ENV: &str = "CALIBAN_AGENT_TOKEN";
pub(crate) const TLS_CERT_ENV: &str = "CALIBAN_AGENT_TLS_CERT";
pub(crate) const TLS_KEY_ENV: &str = "CALIBAN_AGENT_TLS_KEY";
pub(crate) const SPEC_ENV: &str = "CALIBAN_AGENT_SPEC";
pub(crate) const IDLE_ENV: &str = "CALIBAN_AGENT_IDLE_TIMEOUT_SECS";

/// How long the agent waits with no client and no run working before it exits (upstream's
/// default); `0` in `CALIBAN_AGENT_IDLE_TIMEOUT_SECS` means never.
pub(crate) const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(300);

/// Upstream's refusals (`upstream-caliban.md` §9.3), after the name of what is missing.
const NO_TOKEN: &str = "CALIBAN_AGENT_TOKEN is required for --listen (network) mode; refusing to bind an unauthenticated listener";
const NO_TLS: &str = "agent TLS (CALIBAN_AGENT_TLS_CERT/KEY) is required for --listen mode; refusing to send the bearer token over plaintext";

/// Where the agent listens, checked (fail closed) before anything binds.
pub(crate) enum Listen {
    Tls {
        addr: std::net::SocketAddr,
        config: Arc<rustls::ServerConfig>,
        token: Box<Token>,
    },
    Unix(PathBuf),
}

/// Everything `agent serve` needs besides the agent options.
pub(crate) struct Plan {
    pub(crate) listen: Listen,
    pub(crate) spec: Spec,
    /// `None`: never exit for idleness.
    pub(crate) idle_timeout: Option<Duration>,
}

/// A refusal to start: the exit code and the message.
pub(crate) type Refused = (u8, String);

fn config_error(message: String) -> Refused {
    (crate::exit::CONFIG, message)
}

/// The TLS material and token for `--listen`, or why network mode must not start.
pub(crate) fn tls_listen(
    addr: std::net::SocketAddr,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Listen, Refused> {
    let token = match env(TOKEN_ENV) {
        None => return Err(config_error(NO_TOKEN.to_owned())),
        Some(t) if t.trim().is_empty() => {
            return Err(config_error(format!(
                "{TOKEN_ENV} is empty: a token is required for --listen (network) mode; \
                 refusing to bind an unauthenticated listener"
            )));
        }
        Some(t) => Box::new(Token::new(t.trim().as_bytes())),
    };
    let mut paths = Vec::new();
    for name in [TLS_CERT_ENV, TLS_KEY_ENV] {
        match env(name) {
            Some(path) if !path.trim().is_empty() => {
                let path = PathBuf::from(path);
                if let Err(e) = std::fs::File::open(&path) {
                    return Err(config_error(format!(
                        "{name}={} cannot be read: {e}; {NO_TLS}",
                        path.display()
                    )));
                }
                paths.push(path);
            }
            Some(_) => return Err(config_error(format!("{name} is empty: {NO_TLS}"))),
            None => return Err(config_error(format!("{name} is not set: {NO_TLS}"))),
        }
    }
    let config = crate::transport::server_config(&paths[0], &paths[1])
        .map_err(|e| config_error(format!("agent TLS cannot be used: {e}; {NO_TLS}")))?;
    // The agent's lines are no HTTP: offer no application protocol, so a client's ALPN
    // list (or none) never fails the handshake.
    let mut config = Arc::unwrap_or_clone(config);
    config.alpn_protocols.clear();
    Ok(Listen::Tls {
        addr,
        config: Arc::new(config),
        token,
    })
}

/// `CALIBAN_AGENT_IDLE_TIMEOUT_SECS`: whole seconds, `0` for never.
pub(crate) fn idle_timeout(
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<Duration>, Refused> {
    match env(IDLE_ENV) {
        None => Ok(Some(DEFAULT_IDLE_TIMEOUT)),
        Some(raw) => match raw.trim().parse::<u64>() {
            Ok(0) => Ok(None),
            Ok(secs) => Ok(Some(Duration::from_secs(secs))),
            Err(_) => Err(config_error(format!(
                "{IDLE_ENV} must be a whole number of seconds (0 = never), not `{raw}`"
            ))),
        },
    }
}

/// The spawn spec from `--spec FILE` (which wins) or `CALIBAN_AGENT_SPEC`.
pub(crate) fn load_spec(
    file: Option<&Path>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Spec, Refused> {
    let text = match (file, env(SPEC_ENV)) {
        (Some(path), _) => {
            let read = std::fs::File::open(path).and_then(|f| {
                let mut text = String::new();
                std::io::Read::read_to_string(
                    &mut std::io::Read::take(f, spec::MAX_SPEC_BYTES as u64 + 1),
                    &mut text,
                )
                .map(|_| text)
            });
            read.map_err(|e| {
                config_error(format!(
                    "cannot read the spawn spec {}: {e}",
                    path.display()
                ))
            })?
        }
        (None, Some(text)) => text,
        (None, None) => {
            return Err(config_error(format!(
                "no spawn spec: pass --spec FILE or set {SPEC_ENV}"
            )));
        }
    };
    let tools: Vec<&str> = crate::tools::table::BUILTINS
        .iter()
        .map(|t| t.name)
        .collect();
    spec::parse(&text, &tools).map_err(config_error)
}

/// Binds the agent's listener. A Unix socket is created fresh with mode 0600 (a stale one
/// left by a process that died is replaced; a live one, or anything that is not a socket,
/// is not) and removed on exit.
pub(crate) fn bind(listen: Listen) -> Result<AgentListener, Refused> {
    match listen {
        Listen::Tls {
            addr,
            config,
            token,
        } => {
            let tcp = mio::net::TcpListener::bind(addr).map_err(|e| {
                (
                    crate::exit::RUNTIME,
                    format!("cannot listen on {addr}: {e}"),
                )
            })?;
            Ok(AgentListener::Tls { tcp, config, token })
        }
        Listen::Unix(path) => {
            clear_stale_socket(&path)?;
            // Created with no permission for anyone but us from the first instant: a
            // chmod after bind would leave a moment in which others could connect.
            let old = crate::sys::umask(0o177);
            let bound = mio::net::UnixListener::bind(&path);
            crate::sys::umask(old);
            let socket = bound.map_err(|e| {
                (
                    crate::exit::RUNTIME,
                    format!("cannot listen on {}: {e}", path.display()),
                )
            })?;
            let _ = std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600));
            Ok(AgentListener::Unix { socket, path })
        }
    }
}

fn clear_stale_socket(path: &Path) -> Result<(), Refused> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(config_error(format!("--socket {}: {e}", path.display()))),
    };
    if !meta.file_type().is_socket() {
        return Err(config_error(format!(
            "--socket {} exists and is not a socket; refusing to replace it",
            path.display()
        )));
    }
    if std::os::unix::net::UnixStream::connect(path).is_ok() {
        return Err(config_error(format!(
            "--socket {}: another process is listening there",
            path.display()
        )));
    }
    std::fs::remove_file(path)
        .map_err(|e| config_error(format!("--socket {}: {e}", path.display())))
}

/// Removes our Unix socket at exit, if the file there is still the one we created.
fn remove_socket(path: &Path, created: Option<(u64, u64)>) {
    let ours = std::fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino()));
    if ours.is_some() && ours == created {
        let _ = std::fs::remove_file(path);
    }
}

/// What `Link` registers on the loop: the front's sources and timers, and the idle exit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NetKey {
    Front(FrontKey),
    Idle,
    /// The NDJSON plane's wait for a `Resume` is over (`ndjson::RESUME_GRACE`).
    Replay,
}

impl From<FrontKey> for NetKey {
    fn from(key: FrontKey) -> NetKey {
        NetKey::Front(key)
    }
}

/// What the surface hears from its link.
#[derive(Debug)]
pub(crate) enum LinkEvent {
    /// `conn` is the client now.
    Attached(ConnId),
    /// The client is gone (hung up, or replaced by a newer one).
    Detached(ConnId),
    /// A line from the client.
    Line(Vec<u8>),
    /// A line over `front::line::MAX_LINE` from the client, dropped.
    Oversized,
    /// The client's queue drained: write more.
    Writable,
}

/// The agent's listener with the one-client rule and the idle exit, shared by both
/// protocol surfaces.
pub(crate) struct Link {
    front: Front<(), LineConn>,
    /// The newest connection that proved itself.
    client: Option<ConnId>,
    /// Events decided here ahead of the front's (a replaced client's detach).
    queued: std::collections::VecDeque<LinkEvent>,
    idle_after: Option<Duration>,
    idle_timer: Option<TimerId>,
    /// The Unix socket's identity, to remove only our own file at exit.
    socket: Option<(PathBuf, Option<(u64, u64)>)>,
    /// The line a client replaced by a newer one reads before its connection closes, in
    /// its protocol's vocabulary: a supervisor must never lose the client role silently.
    replaced: Vec<u8>,
}

impl Link {
    pub(crate) fn new(
        listener: AgentListener,
        idle_after: Option<Duration>,
        replaced: Vec<u8>,
    ) -> Link {
        let front = Front::for_agent(listener);
        let socket = front.socket_path().map(|p| {
            let id = std::fs::symlink_metadata(p)
                .ok()
                .map(|m| (m.dev(), m.ino()));
            (p.to_path_buf(), id)
        });
        Link {
            front,
            client: None,
            queued: std::collections::VecDeque::new(),
            idle_after,
            idle_timer: None,
            socket,
            replaced,
        }
    }

    /// Where it listens, for the start-up line: `tls://ADDR` or `unix:PATH`.
    pub(crate) fn describe(&self) -> String {
        match (&self.socket, self.front.local_addr()) {
            (Some((path, _)), _) => format!("unix:{}", path.display()),
            (None, Some(addr)) => format!("tls://{addr}"),
            (None, None) => "tls://?".to_owned(),
        }
    }

    pub(crate) fn start<K: HostKey + From<FrontKey>>(
        &mut self,
        cx: &mut Cx<K>,
    ) -> std::io::Result<()> {
        self.front.start(cx)
    }

    pub(crate) fn on_io<K: HostKey + From<FrontKey>>(&mut self, cx: &mut Cx<K>, key: FrontKey) {
        self.front.on_io(cx, key);
    }

    pub(crate) fn on_timer<K: HostKey + From<FrontKey>>(&mut self, cx: &mut Cx<K>, key: FrontKey) {
        self.front.on_timer(cx, key);
    }

    /// The next thing the surface must act on; call until `None` after every callback.
    pub(crate) fn next_event<K: HostKey + From<FrontKey>>(
        &mut self,
        cx: &mut Cx<K>,
    ) -> Option<LinkEvent> {
        loop {
            if let Some(event) = self.queued.pop_front() {
                return Some(event);
            }
            match self.front.next_event(cx)? {
                LineEvent::Attached(conn) => {
                    if let Some(old) = self.client.replace(conn) {
                        log::warn(
                            "a newer client connected; the older one is told and its \
                             connection closed",
                        );
                        self.front.send(old, &self.replaced);
                        self.front.finish(old);
                        self.queued.push_back(LinkEvent::Detached(old));
                    }
                    self.queued.push_back(LinkEvent::Attached(conn));
                }
                LineEvent::Closed(conn, ()) => {
                    if self.client == Some(conn) {
                        self.client = None;
                        return Some(LinkEvent::Detached(conn));
                    }
                }
                // Lines of a replaced client that were already read are dropped.
                LineEvent::Line(conn, line) if self.client == Some(conn) => {
                    return Some(LinkEvent::Line(line));
                }
                LineEvent::Oversized(conn) if self.client == Some(conn) => {
                    return Some(LinkEvent::Oversized);
                }
                LineEvent::Writable(conn) if self.client == Some(conn) => {
                    return Some(LinkEvent::Writable);
                }
                LineEvent::Line(..) | LineEvent::Oversized(_) | LineEvent::Writable(_) => {}
            }
        }
    }

    /// Queues whole lines for the client; dropped when there is none.
    pub(crate) fn send(&mut self, bytes: &[u8]) {
        if let Some(conn) = self.client {
            self.front.send(conn, bytes);
        }
    }

    pub(crate) fn wants_more(&self) -> bool {
        self.client.is_some_and(|conn| self.front.wants_more(conn))
    }

    /// Ends the client's connection once what is queued is out.
    pub(crate) fn finish_client(&mut self) {
        if let Some(conn) = self.client {
            self.front.finish(conn);
        }
    }

    /// After every batch: the idle clock runs while nobody is connected and no run works,
    /// and stops as soon as either changes.
    pub(crate) fn watch_idle<K: HostKey + From<NetKey>>(&mut self, cx: &mut Cx<K>) {
        let idle = self.client.is_none() && cx.core.working() == 0;
        match (idle, self.idle_after, self.idle_timer) {
            (true, Some(after), None) => {
                self.idle_timer = Some(cx.add_timer(after, NetKey::Idle.into()));
            }
            (false, _, Some(timer)) => {
                cx.cancel_timer(timer);
                self.idle_timer = None;
            }
            _ => {}
        }
    }

    /// The idle timer fired: whether the agent should exit now.
    pub(crate) fn idle_expired(&mut self, core: &DriveCore) -> bool {
        if self.idle_timer.take().is_none() {
            return false;
        }
        let idle = self.client.is_none() && core.working() == 0;
        if idle {
            let secs = self.idle_after.map_or(0, |d| d.as_secs());
            log::info(&format!(
                "no client and nothing running for {secs} s; exiting"
            ));
        }
        idle
    }

    /// At exit: the last queued bytes are offered to the sockets once, and our Unix socket
    /// file is removed.
    pub(crate) fn shut(&mut self) {
        self.front.flush_all();
        if let Some((path, created)) = &self.socket {
            remove_socket(path, *created);
        }
    }
}

/// Cancels every live run (their tools are killed) ahead of quitting.
fn cancel_live_runs(core: &mut DriveCore) {
    for summary in core.list() {
        if core.is_live(summary.run_id) {
            let _ = core.cancel(summary.run_id);
        }
    }
}

/// An agent surface: one of the two protocols over the agent's `Link`.
trait Served: Surface {
    const PROTOCOL: &'static str;
    fn link(&mut self) -> &mut Link;
    /// Registers the listener and starts what the protocol starts with.
    fn start(&mut self, cx: &mut Cx<Self::Key>) -> Result<(), String>;
}

/// Runs an agent surface until it quits (SIGTERM/SIGINT or the idle exit): the engine, the
/// drive host, the surface's start, the line scripts wait for, the loop, the socket cleanup.
fn run_served<S: Served>(engine_config: EngineConfig, core: DriveCore, surface: S) -> u8 {
    let engine: Engine<Key<S::Key>> = match Engine::new(engine_config) {
        Ok(e) => e,
        Err(e) => {
            log::error(&format!("cannot start the event loop: {e}"));
            return crate::exit::RUNTIME;
        }
    };
    crate::surface::serve_after(
        engine,
        DriveHost::new(core, surface),
        |engine, host| {
            if let Err(e) = engine.with_ctx(|ctx| host.with(ctx, |s, cx| s.start(cx))) {
                log::error(&e);
                return Err(crate::exit::RUNTIME);
            }
            announce(host.surface.link(), S::PROTOCOL);
            Ok(())
        },
        // The last bytes are offered and the socket file removed, however the loop ended.
        |host| host.surface.link().shut(),
    )
}

/// Serves the spec's protocol until SIGTERM/SIGINT or the idle exit.
pub(crate) fn serve(
    engine_config: EngineConfig,
    core: DriveCore,
    spec: &Spec,
    idle_timeout: Option<Duration>,
    listener: AgentListener,
) -> u8 {
    match spec.protocol {
        Protocol::Ndjson => {
            let link = Link::new(listener, idle_timeout, ndjson::replaced_line());
            run_served(engine_config, core, ndjson::Plane::new(link, spec))
        }
        Protocol::Acp => {
            let link = Link::new(listener, idle_timeout, acp::replaced_line());
            run_served(engine_config, core, acp::NetAcp::new(link))
        }
    }
}

/// The start-up line scripts and tests wait for (stderr; stdout stays unused).
fn announce(link: &Link, protocol: &str) {
    eprintln!(
        "caliban agent serve ({protocol}) listening on {}",
        link.describe()
    );
}
