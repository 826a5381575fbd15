//! caliban: a coding agent that other programs drive. The binary (`main.rs`) is a thin
//! shell over this library, which benches and fuzz targets use too.
//!
//! Layers, each depending only on those below it:
//! `print`, `surface` (the network surfaces) → `drive` (run table, sessions) → `engine` (performs effects) → `agent` (decides) →
//! `settings` → `permissions` → `tools` (the built-in tool table) → `model` →
//! `http`, `transport`, `stdio`, `reactor` →
//! `workers` (bounded thread pools for blocking calls), `sys` (every `unsafe` and libc call)
//! and `log`.

// Every `unsafe` block and libc call lives in `sys`, each with a SAFETY note; the rest of
// the crate cannot write one.
#![deny(
    unsafe_code,
    unsafe_op_in_unsafe_fn,
    clippy::undocumented_unsafe_blocks
)]

pub mod agent;
pub mod auth;
pub mod cli;
pub mod clock;
pub mod drive;
pub mod engine;
pub mod exit;
pub mod glob;
pub mod http;
pub mod jsonrpc;
pub mod log;
pub mod model;
pub mod permissions;
pub mod print;
pub mod reactor;
pub mod settings;
pub mod stdio;
pub mod stub_model;
pub mod surface;
#[allow(unsafe_code)]
pub mod sys;
pub(crate) mod text;
pub mod tools;
pub mod transport;
mod workers;
