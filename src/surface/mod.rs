//! Drive surfaces: protocol adapters over the drive core. Each translates its protocol to
//! drive-core calls and drive-core state back; none holds agent logic. The listening ones
//! stand behind the one network front (`front`). Every surface's `run` ends in the same
//! tail here (`serve`, `serve_listening`): start, announce, loop, exit code.

pub mod acp;
pub(crate) mod agent;
pub(crate) mod front;
pub mod host;
pub mod http_api;
pub mod mcp;

use std::io;
use std::net::SocketAddr;

pub use front::{ConnId, DEFAULT_MAX_CONNECTIONS, FrontKey, ListenConfig};

use crate::engine::Engine;
use crate::exit;
use crate::log;
use host::{Cx, DriveHost, Key, Surface};

/// A surface with a listener on the network front, bound before the host exists.
pub(crate) trait Listens: Surface {
    /// Registers the bound listener on the engine's loop.
    fn listen(&mut self, cx: &mut Cx<Self::Key>) -> io::Result<()>;
    /// Where it is bound: a configured port 0 resolved.
    fn bound_addr(&self) -> io::Result<SocketAddr>;
}

/// Where a listening surface was told to listen: what its error lines and the line that
/// announces it name.
pub(crate) struct Listening {
    /// The command, as the announcement names it (`http serve`).
    command: &'static str,
    addr: SocketAddr,
    tls: bool,
    /// What the URL in the announcement ends with: where the surface answers.
    path: &'static str,
}

impl Listening {
    pub(crate) fn new(command: &'static str, config: &ListenConfig, path: &'static str) -> Self {
        Listening {
            command,
            addr: config.addr,
            tls: config.tls.is_some(),
            path,
        }
    }

    /// What binding gave, or (logged) the exit code when it failed.
    pub(crate) fn bound<T>(&self, bound: io::Result<T>) -> Result<T, u8> {
        bound.map_err(|e| {
            log::error(&format!("failed to bind {}: {e}", self.addr));
            exit::RUNTIME
        })
    }
}

/// Starts a bound surface's listener and announces it, then serves like `serve`.
pub(crate) fn serve_listening<S: Listens>(
    engine: Engine<Key<S::Key>>,
    host: DriveHost<S>,
    listening: &Listening,
) -> u8 {
    serve_after(
        engine,
        host,
        |engine, host| {
            if let Err(e) = engine.with_ctx(|ctx| host.with(ctx, |surface, cx| surface.listen(cx)))
            {
                log::error(&format!("cannot listen on {}: {e}", listening.addr));
                return Err(exit::RUNTIME);
            }
            let local = host.surface.bound_addr().unwrap_or(listening.addr);
            let scheme = if listening.tls { "https" } else { "http" };
            // One line on stderr that scripts and tests can wait for: stdout is the stdio
            // surfaces' protocol, and unused by the others.
            eprintln!(
                "caliban {} listening on {scheme}://{local}{}",
                listening.command, listening.path
            );
            Ok(())
        },
        |_| {},
    )
}

/// Runs the engine's loop over `host` until it ends (SIGINT/SIGTERM, stdin closing for a
/// stdio surface); the engine cancels the runs still going on the way out. The exit code.
pub(crate) fn serve<S: Surface>(engine: Engine<Key<S::Key>>, host: DriveHost<S>) -> u8 {
    serve_after(engine, host, |_, _| Ok(()), |_| {})
}

/// `serve` with a `start` step before the loop (a failure is the exit code, and the loop
/// never runs) and a `finish` step after it, whichever way the loop ended.
pub(crate) fn serve_after<S: Surface>(
    mut engine: Engine<Key<S::Key>>,
    mut host: DriveHost<S>,
    start: impl FnOnce(&mut Engine<Key<S::Key>>, &mut DriveHost<S>) -> Result<(), u8>,
    finish: impl FnOnce(&mut DriveHost<S>),
) -> u8 {
    if let Err(code) = start(&mut engine, &mut host) {
        return code;
    }
    let result = engine.run_loop(&mut host);
    finish(&mut host);
    match result {
        Ok(()) => exit::OK,
        Err(e) => {
            log::error(&format!("event loop failed: {e}"));
            exit::RUNTIME
        }
    }
}
