//! HTTP/1.1: sans-IO codecs (`head`, `body`, `sse`, `write`) and the outbound exchange state
//! machine (`client`) that drives them over a socket.

pub mod body;
pub mod client;
pub mod head;
pub mod server;
pub mod sse;
#[cfg(test)]
mod testutil;
pub mod write;
