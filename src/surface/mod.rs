//! Drive surfaces: protocol adapters over the drive core. Each translates its protocol to
//! drive-core calls and drive-core state back; none holds agent logic.

pub mod http_api;
