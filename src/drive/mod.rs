//! The drive core shared by every surface: durable sessions and the run table.

pub mod session;
pub mod table;
