//! The client as something that can go away and come back: the networked agent
//! (`surface::agent`) serves this same ACP over a connection, and when that connection
//! closes the sessions stay. What the client was waiting on is forgotten (nobody is left to
//! answer), what it started goes on, and a client that comes back picks it up with
//! `session/load` or `session/resume`, which link a session's live run again and have its
//! pending permission prompt asked anew.

use std::collections::BTreeSet;

use super::delegate::ClientCaps;
use super::prompt::PromptState;
use super::{AcpKey, AcpServe};
use crate::ids::{HostKey, RunId};
use crate::surface::host::Cx;

impl<H: HostKey> AcpServe<H> {
    /// The client's connection closed. Its prompts are no longer answered (a turn in flight
    /// runs on), its permission and delegated requests are dropped (a surfaced prompt stays
    /// with the core, which denies it after the permission timeout unless a client that
    /// loads the session answers it), and every run is unlinked from its session until a
    /// client loads that session again, so no update goes to a client that has not asked
    /// for the session.
    pub(crate) fn client_gone(&mut self) {
        self.pending.drain();
        self.caps = ClientCaps::default();
        for session in self.sessions.values_mut() {
            session.asked = None;
            session.prompt = PromptState::Idle;
        }
        self.runs.clear();
        // Frames still queued were for the client that left.
        self.outbox = Default::default();
    }

    /// Asks the client about any prompt surfaced for a linked run that it has not been
    /// asked about (after `session/load` linked a run whose prompt came while no client was
    /// there). Idempotent: a prompt already asked is left alone.
    pub(crate) fn ask_pending(&mut self, ctx: &mut Cx<AcpKey<H>>) {
        let linked: BTreeSet<RunId> = self.runs.keys().copied().collect();
        self.sync_permissions(ctx, &linked);
    }
}
