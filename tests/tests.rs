//! One integration-test binary: every test spawns the real `caliban` executable and speaks
//! its real wire, against `caliban stub-model` on loopback. Nothing leaves the machine.

mod util;

mod acp;
mod agent;
mod cli;
mod http_serve;
mod http_util;
mod mcp;
mod openapi;
mod print;
mod sandbox;
mod tls;
