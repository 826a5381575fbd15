//! Drive surfaces: protocol adapters over the drive core. Each translates its protocol to
//! drive-core calls and drive-core state back; none holds agent logic.

pub mod acp;
pub mod http_api;
pub mod mcp;

use std::net::SocketAddr;
use std::sync::Arc;

use crate::auth::Gate;
use crate::http::server::Limits;

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
