//! Drive surfaces: protocol adapters over the drive core. Each translates its protocol to
//! drive-core calls and drive-core state back; none holds agent logic. The listening ones
//! stand behind the one network front (`front`).

pub mod acp;
pub(crate) mod agent;
pub(crate) mod front;
pub mod host;
pub mod http_api;
pub mod mcp;

pub use front::{ConnId, DEFAULT_MAX_CONNECTIONS, FrontKey, ListenConfig};
