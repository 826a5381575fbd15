//! The session's MCP servers (`mcpServers` of `session/new`, `session/load` and
//! `session/resume`): started with the session on the engine's MCP hub (`mcp_client`),
//! offered to the session's runs besides the configured servers, and stopped when the
//! session replaces or closes them. The hub runs their calls like any run's.

use serde_json::Value;

use super::{AcpKey, AcpServe};
use crate::log;
use crate::mcp_client::{ServerId, config};
use crate::surface::host::Cx;

impl AcpServe {
    /// Starts the servers a `session/new`, `session/load` or `session/resume` names; they
    /// replace the session's earlier ones. Without `mcpServers` the session keeps its own.
    pub(super) fn connect_servers(&mut self, ctx: &mut Cx<AcpKey>, sid: &str, params: &Value) {
        let Some(list) = params.get("mcpServers") else {
            return;
        };
        let Some(session) = self.sessions.get_mut(sid) else {
            return;
        };
        let old = std::mem::take(&mut session.mcp);
        let cwd = session.cwd.clone();
        Self::stop_servers(ctx, old);
        let list = list.as_array().map(Vec::as_slice).unwrap_or_default();
        let (configs, warnings) = config::parse_array(list, config::Origin::Client);
        for warning in warnings {
            log::warn(&warning);
        }
        let ids: Vec<ServerId> = configs
            .into_iter()
            .map(|config| ctx.mcp_start(config, cwd.clone()))
            .collect();
        if let Some(session) = self.sessions.get_mut(sid) {
            session.mcp = ids;
        }
    }

    /// Stops servers (their process groups killed, their HTTP sessions dropped); their
    /// calls in flight are answered as failed.
    pub(super) fn stop_servers(ctx: &mut Cx<AcpKey>, servers: Vec<ServerId>) {
        for id in servers {
            ctx.mcp_stop(id);
        }
    }
}
