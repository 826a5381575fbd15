//! caliban: a coding agent that other programs drive. The binary (`main.rs`) only calls
//! `app::main`; every other module is private to the crate, so the compiler sees (and
//! flags) code that nothing uses. ARCHITECTURE.md is the map; its "Layers" table is the one
//! list of which module may use which, and the `layers` test holds the code to it.

// Every `unsafe` block and libc call lives in `sys`, each with a SAFETY note; the rest of
// the crate cannot write one.
#![deny(
    unsafe_code,
    unsafe_op_in_unsafe_fn,
    clippy::undocumented_unsafe_blocks
)]

mod agent;
pub mod app;
mod auth;
mod cli;
mod clock;
mod drive;
mod engine;
mod exit;
mod ids;
// Only for the fuzz targets in fuzz/ (cargo-fuzz builds with `--cfg fuzzing`) and the tests
// that replay their seeds; not an API.
#[cfg(any(test, fuzzing))]
#[doc(hidden)]
pub mod fuzzing;
mod glob;
mod http;
mod instructions;
mod jsonrpc;
#[cfg(test)]
mod layers;
mod log;
mod mcp_client;
mod model;
mod netaddr;
mod permissions;
mod policy;
mod print;
mod reactor;
mod reaper;
mod sandbox;
mod secrets;
mod settings;
mod stdio;
mod stub_model;
mod surface;
#[allow(unsafe_code)]
mod sys;
mod text;
mod tools;
mod transport;
mod workers;
