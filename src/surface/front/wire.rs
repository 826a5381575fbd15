//! What the front's shared half asks of a kind of connection (`Wire`), and HTTP's answer.

use std::time::Instant;

use mio::net::TcpListener;

use super::{ListenConfig, Policy, TCP_KEEPALIVE_IDLE};
use crate::http::server::Connection;

/// A kind of connection the front holds. The accept / map / cap / deadline half is written
/// once over it; each kind brings the half that reads what its peers send (HTTP requests
/// below, the agent's lines in `line`). Method names are `Connection`'s own.
pub(crate) trait Wire: Sized {
    /// The socket connections of this kind are accepted from.
    type Listener: mio::event::Source;
    /// What every new connection is set up with (TLS, limits, the gate).
    type Setup;
    /// Takes one waiting connection off `listener` and sets it up. The outer error is the
    /// listener's (`WouldBlock` once none waits); the inner one is a connection that came but
    /// could not be set up, which is logged and dropped.
    fn accept(
        listener: &Self::Listener,
        setup: &Self::Setup,
    ) -> std::io::Result<Result<Self, String>>;
    /// The socket, to register and deregister.
    fn source(&mut self) -> &mut dyn mio::event::Source;
    /// Who is at the other end, for logs.
    fn peer_name(&self) -> String;
    /// When a byte last moved in either direction (or the connection was made).
    fn last_activity(&self) -> Instant;
    /// When the opening now under way (a request head, the agent's preamble) began; the head
    /// deadline runs from here. `None` when none is under way.
    fn head_started(&self) -> Option<Instant>;
    /// A stream is open: a quiet one is kept the way the surface's `Keepalive` says.
    fn is_streaming(&self) -> bool;
    /// Something is with the surface and not fully answered: not idle.
    fn awaiting_response(&self) -> bool;
    /// Writes on an open stream (the keepalive comment).
    fn stream_chunk(&mut self, data: &[u8]);
    /// Ends the connection now; the socket stays open until dropped, to be deregistered.
    fn close(&mut self);
}

/// How an HTTP listener sets up its connections and answers what its gate refuses.
pub(crate) struct HttpSetup {
    pub(super) config: ListenConfig,
    pub(super) policy: Policy,
}

impl Wire for Connection {
    type Listener = TcpListener;
    type Setup = HttpSetup;

    /// TCP keepalive on (`Connection::new` turns Nagle off), then the HTTP connection (TLS
    /// when configured).
    fn accept(listener: &TcpListener, setup: &HttpSetup) -> std::io::Result<Result<Self, String>> {
        let (tcp, peer) = listener.accept()?;
        let _ = crate::sys::set_keepalive(crate::sys::raw_fd(&tcp), TCP_KEEPALIVE_IDLE);
        let config = &setup.config;
        Ok(
            Connection::new(tcp, peer, config.tls.clone(), config.limits.clone())
                .map_err(|e| format!("cannot set up a connection from {peer}: {e}")),
        )
    }

    fn source(&mut self) -> &mut dyn mio::event::Source {
        self.tcp()
    }

    fn peer_name(&self) -> String {
        self.peer().to_string()
    }

    fn last_activity(&self) -> Instant {
        Connection::last_activity(self)
    }

    fn head_started(&self) -> Option<Instant> {
        Connection::head_started(self)
    }

    fn is_streaming(&self) -> bool {
        Connection::is_streaming(self)
    }

    fn awaiting_response(&self) -> bool {
        Connection::awaiting_response(self)
    }

    fn stream_chunk(&mut self, data: &[u8]) {
        Connection::stream_chunk(self, data);
    }

    fn close(&mut self) {
        Connection::close(self);
    }
}
