//! The session's MCP servers (`mcpServers` of `session/new`, `session/load` and
//! `session/resume`): started with the session, their pipes registered on the loop, their
//! tools offered to the session's runs and called for them, and killed when the session
//! replaces or closes them. `mcp_client` is the protocol client; this is its glue.

use std::collections::HashMap;

use serde_json::Value;

use super::mcp_client::{self, Phase, Server};
use super::{AcpKey, AcpServe};
use crate::agent::run::ToolCall;
use crate::engine::{HostAction, RunId};
use crate::log;
use crate::surface::host::Cx;

/// An MCP server of a session.
pub(super) struct McpEntry {
    session: String,
    pub(super) server: Server,
    /// Calls in flight: tool use id → run.
    calls: HashMap<String, RunId>,
}

impl AcpServe {
    /// Starts the servers a `session/new`, `session/load` or `session/resume` names; they
    /// replace the session's earlier ones. Without `mcpServers` the session keeps its own.
    pub(super) fn connect_servers(&mut self, ctx: &mut Cx<AcpKey>, sid: &str, params: &Value) {
        if params.get("mcpServers").is_none() {
            return;
        }
        let Some(session) = self.sessions.get_mut(sid) else {
            return;
        };
        let old = std::mem::take(&mut session.mcp);
        let cwd = session.cwd.clone();
        self.stop_servers(ctx, old);
        let (configs, warnings) = mcp_client::parse_servers(params);
        for warning in warnings {
            log::warn(&warning);
        }
        for config in configs {
            let mut server = match Server::spawn(&config, &cwd) {
                Ok(server) => server,
                Err(e) => {
                    log::warn(&format!(
                        "MCP server `{}`: cannot start {}: {e}",
                        config.name, config.command
                    ));
                    continue;
                }
            };
            let n = self.next_mcp;
            self.next_mcp += 1;
            let tokens = [
                ctx.host_token(AcpKey::McpOut(n)),
                ctx.host_token(AcpKey::McpIn(n)),
            ];
            if let Err(e) = server.register(ctx.registry(), tokens) {
                log::warn(&format!(
                    "MCP server `{}`: cannot watch its pipes: {e}",
                    config.name
                ));
                server.kill(ctx.registry());
                for token in tokens {
                    ctx.forget_token(token);
                }
                continue;
            }
            log::info(&format!(
                "MCP server `{}` started (pid {})",
                config.name,
                server.pid()
            ));
            let events = server.flush(ctx.registry());
            self.mcp.insert(
                n,
                McpEntry {
                    session: sid.to_owned(),
                    server,
                    calls: HashMap::new(),
                },
            );
            if let Some(session) = self.sessions.get_mut(sid) {
                session.mcp.push(n);
            }
            self.on_mcp_events(ctx, n, events);
        }
    }

    /// Kills servers (their process groups) and answers their calls in flight.
    pub(super) fn stop_servers(&mut self, ctx: &mut Cx<AcpKey>, servers: Vec<u64>) {
        for n in servers {
            let Some(mut entry) = self.mcp.remove(&n) else {
                continue;
            };
            for token in entry.server.tokens {
                ctx.forget_token(token);
            }
            let events = entry.server.kill(ctx.registry());
            Self::answer_calls(ctx, &mut entry, events);
        }
    }

    fn answer_calls(
        ctx: &mut Cx<AcpKey>,
        entry: &mut McpEntry,
        events: Vec<mcp_client::Event>,
    ) -> bool {
        let mut settled = false;
        for event in events {
            match event {
                mcp_client::Event::Settled => settled = true,
                mcp_client::Event::CallDone {
                    tool_use_id,
                    output,
                } => {
                    if let Some(run) = entry.calls.remove(&tool_use_id) {
                        ctx.act(HostAction::ToolResult {
                            run,
                            tool_use_id,
                            output,
                        });
                    }
                }
            }
        }
        settled
    }

    fn on_mcp_events(&mut self, ctx: &mut Cx<AcpKey>, n: u64, events: Vec<mcp_client::Event>) {
        let Some(entry) = self.mcp.get_mut(&n) else {
            return;
        };
        let settled = Self::answer_calls(ctx, entry, events);
        let sid = entry.session.clone();
        if entry.server.client.phase() == Phase::Failed {
            log::warn(&format!(
                "MCP server `{}` {}; its tools are not offered",
                entry.server.client.name(),
                entry.server.client.failure().unwrap_or("failed")
            ));
            if let Some(session) = self.sessions.get_mut(&sid) {
                session.mcp.retain(|m| *m != n);
            }
            self.stop_servers(ctx, vec![n]);
        } else if settled {
            let count = entry.server.client.tools().len();
            log::info(&format!(
                "MCP server `{}` offers {count} tool{}",
                entry.server.client.name(),
                if count == 1 { "" } else { "s" }
            ));
        }
        if settled {
            let starting = self.sessions.get(&sid).is_some_and(|s| {
                s.mcp.iter().any(|m| {
                    self.mcp
                        .get(m)
                        .is_some_and(|e| e.server.client.phase() == Phase::Starting)
                })
            });
            if !starting {
                self.mcp_wait_over(ctx, &sid, false);
            }
        }
    }

    /// An `mcp__server__tool` call goes to the server that offers it.
    pub(super) fn call_mcp_tool(
        &mut self,
        ctx: &mut Cx<AcpKey>,
        sid: &str,
        run: RunId,
        call: &ToolCall,
    ) {
        let found = self.sessions.get(sid).and_then(|s| {
            s.mcp.iter().copied().find(|n| {
                self.mcp
                    .get(n)
                    .is_some_and(|e| e.server.client.has_tool(&call.name))
            })
        });
        let Some(entry) = found.and_then(|n| self.mcp.get_mut(&n)) else {
            ctx.act(HostAction::ToolResult {
                run,
                tool_use_id: call.id.clone(),
                output: crate::tools::ToolOutput::error(format!(
                    "no MCP server of this session offers `{}` (it may have exited)",
                    call.name
                )),
            });
            return;
        };
        if let Some(output) = entry.server.client.call(&call.id, &call.name, &call.input) {
            ctx.act(HostAction::ToolResult {
                run,
                tool_use_id: call.id.clone(),
                output,
            });
            return;
        }
        entry.calls.insert(call.id.clone(), run);
        let events = entry.server.flush(ctx.registry());
        if let Some(n) = found {
            self.on_mcp_events(ctx, n, events);
        }
    }

    /// Readiness on server `n`'s stdout (`stdout`) or stdin.
    pub(super) fn on_server_io(&mut self, ctx: &mut Cx<AcpKey>, n: u64, stdout: bool) {
        let Some(entry) = self.mcp.get_mut(&n) else {
            return;
        };
        let events = if stdout {
            entry.server.read(ctx.registry())
        } else {
            entry.server.flush(ctx.registry())
        };
        self.on_mcp_events(ctx, n, events);
    }
}
