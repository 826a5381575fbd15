//! The drive core shared by every surface: durable sessions, the run table and the decoder
//! of the operations clients send it.

pub(crate) mod ops;
pub mod session;
pub mod table;
