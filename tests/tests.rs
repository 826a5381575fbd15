//! One integration-test binary: every test spawns the real `caliban` executable and speaks
//! its real wire, against `caliban stub-model` on loopback. Nothing leaves the machine.

mod util;

mod acp;
mod agent;
mod cli;
mod deploy;
mod http_serve;
mod image;
mod keepalive;
mod long_work;
mod mcp;
mod mcp_client;
mod openapi;
mod policy;
mod print;
mod sandbox;
mod selfclient;
mod tls;
mod tool_results;
