//! The session's MCP servers (`mcpServers` of `session/new`, `session/load` and
//! `session/resume`): started with the session on the engine's MCP hub (`mcp_client`),
//! offered to the session's runs besides the configured servers, and stopped when the
//! session replaces or closes them. The hub runs their calls like any run's.
//!
//! Also the approval of the workspace's own servers (`.mcp.json`, project settings;
//! `mcp_client::approval`): the first session opened asks the editor about each with a
//! `session/request_permission` whose tool call is a card for the server's start.

use serde_json::{Value, json};

use super::params::Outcome;
use super::{AcpKey, AcpServe, Pending};
use crate::ids::HostKey;
use crate::jsonrpc::RpcError;
use crate::log;
use crate::mcp_client::{Approval, ServerId, config};
use crate::surface::host::Cx;

impl<H: HostKey> AcpServe<H> {
    /// Starts the servers a `session/new`, `session/load` or `session/resume` names; they
    /// replace the session's earlier ones. Without `mcpServers` the session keeps its own.
    pub(super) fn connect_servers(
        &mut self,
        ctx: &mut Cx<AcpKey<H>>,
        sid: &str,
        servers: Option<&[Value]>,
    ) {
        let Some(list) = servers else {
            return;
        };
        let Some(session) = self.sessions.get_mut(sid) else {
            return;
        };
        let old = std::mem::take(&mut session.mcp);
        let cwd = session.cwd.clone();
        Self::stop_servers(ctx, old);
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

    /// Asks the editor about each workspace server still awaiting approval that it was
    /// not asked about yet: "Allow" starts it for this process, "Always allow" also
    /// records the approval (as `--approve-mcp` does), "Reject" leaves it out, "Always
    /// reject" records that too, so later starts do not ask. An approved
    /// server joins the live runs from their next turn (`HostAction::McpApproved`); a turn
    /// already under way when the answer comes goes on without it.
    pub(super) fn ask_server_approvals(&mut self, ctx: &mut Cx<AcpKey<H>>, sid: &str) {
        for server in ctx.mcp_awaiting() {
            if !self.approvals_asked.insert(server.name.clone()) {
                continue;
            }
            let card = format!("caliban-mcp-approval-{}", server.name);
            let runs = server.describe();
            let params = json!({
                "sessionId": sid,
                "toolCall": {
                    "toolCallId": card,
                    "title": format!("Start MCP server `{}` from the workspace: {runs}",
                                     server.name),
                    "kind": "execute",
                    "status": "pending",
                    "rawInput": {"mcpServer": server.name, "runs": runs},
                },
                "options": [
                    {"optionId": "allow", "name": "Allow for now", "kind": "allow_once"},
                    {"optionId": "allow_always", "name": "Always allow in this workspace",
                     "kind": "allow_always"},
                    {"optionId": "reject", "name": "Reject", "kind": "reject_once"},
                    {"optionId": "reject_always", "name": "Always reject in this workspace",
                     "kind": "reject_always"},
                ],
            });
            self.request(
                "session/request_permission",
                params,
                Pending::ServerApproval {
                    session: sid.to_owned(),
                    server: server.name.clone(),
                    card,
                },
            );
        }
    }

    /// The editor's answer about a workspace server; its card says what became of it.
    pub(super) fn on_server_approval(
        &mut self,
        ctx: &mut Cx<AcpKey<H>>,
        sid: &str,
        server: &str,
        card: &str,
        answer: Result<Value, RpcError>,
    ) {
        let decision = match answer.as_ref().map(Outcome::decode) {
            Ok(Outcome::Selected("allow")) => Approval::Once,
            Ok(Outcome::Selected("allow_always")) => Approval::Always,
            Ok(Outcome::Selected("reject_always")) => Approval::RefusedAlways,
            _ => Approval::Refused,
        };
        if let Err(e) = ctx.mcp_decide(server, decision) {
            log::warn(&format!(
                "cannot remember the answer about MCP server `{server}`: {e}"
            ));
        }
        let (status, text) = match decision {
            Approval::Once => (
                "completed",
                format!(
                    "MCP server `{server}` approved: its tools are offered from the next turn."
                ),
            ),
            Approval::Always => (
                "completed",
                format!(
                    "MCP server `{server}` approved for this workspace: its tools are offered \
                     from the next turn, and later starts do not ask again."
                ),
            ),
            Approval::RefusedAlways => (
                "failed",
                format!(
                    "MCP server `{server}` was rejected for this workspace: it is not started, \
                     its tools are not offered, and later starts do not ask again (start \
                     caliban with `--approve-mcp {server}` to approve it)."
                ),
            ),
            Approval::Refused => (
                "failed",
                format!(
                    "MCP server `{server}` was not approved, so it is not started and its \
                     tools are not offered (start caliban with `--approve-mcp {server}` to \
                     approve it)."
                ),
            ),
        };
        log::info(&text);
        let update = json!({"sessionUpdate": "tool_call_update", "toolCallId": card,
                            "status": status,
                            "content": [{"type": "content",
                                         "content": {"type": "text", "text": text}}]});
        match self.sessions.get_mut(sid) {
            Some(session) if session.prompt.is_idle() => session.held.push(update),
            Some(_) => self.outbox.update(sid, update),
            None => {}
        }
    }

    /// Stops servers (their process groups killed, their HTTP sessions dropped); their
    /// calls in flight are answered as failed.
    pub(super) fn stop_servers(ctx: &mut Cx<AcpKey<H>>, servers: Vec<ServerId>) {
        for id in servers {
            ctx.mcp_stop(id);
        }
    }
}
