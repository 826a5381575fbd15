//! HTTP/1.1: sans-IO codecs (`head`, `body`, `sse`, `write`), the outbound exchange state
//! machine (`client`) that drives them over a socket, and the idle connections it leaves for
//! the next exchange (`pool`).

pub mod body;
pub mod client;
pub mod head;
pub mod pool;
pub mod server;
pub mod sse;
#[cfg(test)]
mod testutil;
pub mod write;
