//! caliban: a coding agent that other programs drive. The binary (`main.rs`) only calls
//! `app::main`. ARCHITECTURE.md is the map.
//!
//! Layers, each depending only on those below it:
//! `app` (the command line) → `print`, `surface` (the drive surfaces over `surface::host`) →
//! `drive` (run table, sessions, operation decoders) → `engine` (performs effects) →
//! `agent` (decides) → `model`, `tools`, `permissions`, `settings` → `http`, `transport`,
//! `stdio`, `jsonrpc`, `reactor` → `workers` (bounded pools for blocking calls), `sys` (every
//! `unsafe` and libc call), `log`, `clock`, `text`, `exit`.

// Every `unsafe` block and libc call lives in `sys`, each with a SAFETY note; the rest of
// the crate cannot write one.
#![deny(
    unsafe_code,
    unsafe_op_in_unsafe_fn,
    clippy::undocumented_unsafe_blocks
)]

pub mod agent;
pub mod app;
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
