//! Drive surfaces: protocol adapters over the drive core. Each translates its protocol to
//! drive-core calls and drive-core state back; none holds agent logic.

pub mod acp;
pub mod host;
pub mod http_api;
pub mod mcp;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use mio::net::{TcpListener, TcpStream};
use mio::{Interest, Token};

use crate::auth::Gate;
use crate::engine::HostKey;
use crate::http::server::{Connection, Limits};
use crate::log;
use crate::reactor::TimerId;

/// Open connections beyond this wait in the kernel's backlog until one closes.
pub const DEFAULT_MAX_CONNECTIONS: usize = 256;

/// Where a network surface listens, checked before binding (fail closed).
pub struct ListenConfig {
    pub addr: SocketAddr,
    pub tls: Option<Arc<rustls::ServerConfig>>,
    pub limits: Limits,
    pub max_connections: usize,
    pub gate: Gate,
}

/// Silence after which the kernel probes a connection whose peer may have vanished.
const TCP_KEEPALIVE_IDLE: Duration = Duration::from_secs(60);

/// An accepted connection, registered on the loop under a host key, with its idle timer.
pub struct Accepted {
    pub conn: Connection,
    pub token: Token,
    pub idle_timer: TimerId,
}

/// Sets up an accepted socket for a network surface: socket options, the HTTP connection
/// (TLS when configured), registration under `key`, and the idle timer. `None` (logged)
/// when any step fails; the socket is then dropped.
pub fn register_connection<K: HostKey>(
    ctx: &mut host::Cx<K>,
    config: &ListenConfig,
    tcp: TcpStream,
    peer: SocketAddr,
    key: K,
) -> Option<Accepted> {
    let _ = tcp.set_nodelay(true);
    let _ = crate::sys::set_keepalive(crate::sys::raw_fd(&tcp), TCP_KEEPALIVE_IDLE);
    let mut conn = match Connection::new(tcp, peer, config.tls.clone(), config.limits.clone()) {
        Ok(conn) => conn,
        Err(e) => {
            log::warn(&format!("cannot set up a connection from {peer}: {e}"));
            return None;
        }
    };
    let token = ctx.host_token(key);
    if let Err(e) =
        ctx.registry()
            .register(conn.tcp(), token, Interest::READABLE | Interest::WRITABLE)
    {
        log::warn(&format!("cannot register a connection: {e}"));
        ctx.forget_token(token);
        return None;
    }
    let idle_timer = ctx.add_timer(config.limits.idle_timeout, key);
    Some(Accepted {
        conn,
        token,
        idle_timer,
    })
}

/// What the next `accept` on a surface's listener gave.
pub enum AcceptStep {
    Conn(TcpStream, SocketAddr),
    /// At the connection cap: the rest wait in the kernel backlog. Edge-triggered
    /// readiness will not fire again for them, so the surface retries when one closes.
    Full,
    /// Nothing more is waiting.
    Drained,
    /// EMFILE and friends (logged): retry on the next readiness or close.
    Failed,
}

/// One step of a surface's accept loop, honouring `max` open connections.
pub fn accept_next(listener: &TcpListener, open: usize, max: usize) -> AcceptStep {
    if open >= max {
        return AcceptStep::Full;
    }
    loop {
        match listener.accept() {
            Ok((tcp, peer)) => return AcceptStep::Conn(tcp, peer),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return AcceptStep::Drained,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                log::warn(&format!("accept failed: {e}"));
                return AcceptStep::Failed;
            }
        }
    }
}
