//! HTTP/1.1: sans-IO codecs (`head`, `body`, `sse`, `write`), the outbound exchange state
//! machine (`client`) that drives them over a socket, the idle connections it leaves for
//! the next exchange (`pool`), and where both say an exchange goes (`target`).

pub mod body;
pub mod client;
pub mod head;
pub mod pool;
pub mod server;
pub mod sse;
pub mod target;
#[cfg(test)]
mod testutil;
pub mod write;
