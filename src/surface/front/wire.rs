//! What the front's shared half asks of a kind of connection (`Wire`), and HTTP's answer.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use mio::net::{TcpListener, TcpStream};

use super::{ConnId, Event, ListenConfig, Policy, peer_key};
use crate::auth::Peer;
use crate::http::server::Connection;

/// A kind of connection the front holds. The accept / map / cap / deadline half is written
/// once over it, admission included (see the front's ADMISSION); each kind brings the half
/// that reads what its peers send (HTTP requests below and in the front, the agent's lines
/// in `line`) and tells the shared half when a peer proved itself (`Front::admitted`).
/// Method names are `Connection`'s own.
pub(crate) trait Wire: Sized {
    /// The socket connections of this kind are accepted from.
    type Listener: mio::event::Source;
    /// What every new connection is set up with (TLS, limits, the gate).
    type Setup;
    /// What the surface behind connections of this kind acts on (`P` its per-connection
    /// state): each kind has its own, so no surface matches variants its wire cannot send.
    /// The shared half makes only one of them, when a connection is gone (`closed`).
    type Event<P>;
    /// The event that hands a closed connection's payload back to its surface.
    fn closed<P>(id: ConnId, state: P) -> Self::Event<P>;
    /// Takes one waiting connection off `listener` and sets it up (TLS, the protocol
    /// machine); socket options are the shared half's (`Front::add`). The outer error is the
    /// listener's (`WouldBlock` once none waits); the inner one is a connection that came but
    /// could not be set up, which is logged and dropped.
    fn accept(
        listener: &Self::Listener,
        setup: &Self::Setup,
    ) -> std::io::Result<Result<Self, String>>;
    /// The socket, to register and deregister.
    fn source(&mut self) -> &mut dyn mio::event::Source;
    /// The TCP socket under the connection, for the socket options every TCP connection
    /// gets and for the kernel's view of its output (the write-stall deadline); `None` for
    /// a Unix socket.
    fn tcp(&mut self) -> Option<&mut TcpStream>;
    /// The Unix socket under the connection, whose peer's process the kernel knows
    /// (`front::kin`); `None` for TCP.
    fn unix_fd(&self) -> Option<std::os::fd::RawFd> {
        None
    }
    /// Who is at the other end, for logs.
    fn peer_name(&self) -> String;
    /// Whether, as accepted, the peer has yet to prove itself (see ADMISSION). A connection
    /// for which this is false (the agent's Unix socket, whose file mode is its gate) is
    /// admitted as it is accepted.
    fn needs_admission(&self) -> bool;
    /// The key this connection counts under against the per-peer cap of unadmitted
    /// connections (`front::peer_key` of a remote address); `None` for a peer that is not
    /// capped (loopback, a Unix socket).
    fn peer_key(&self, setup: &Self::Setup) -> Option<IpAddr>;
    /// Which address's share of the unadmitted connections this one counts in when one must
    /// be displaced (`front::displaced`): `peer_key` of any TCP peer, loopback included, so
    /// one address flooding the door is displaced before another's client; `None` for a
    /// Unix socket.
    fn peer_group(&self) -> Option<IpAddr>;
    /// Until when an unadmitted connection may not be displaced: one that has done its
    /// part so far (the agent's: a finished TLS handshake) gets a moment to send its
    /// preamble. `None`: no grace.
    fn grace_until(&self) -> Option<Instant> {
        None
    }
    /// When a byte last moved in either direction (or the connection was made).
    fn last_activity(&self) -> Instant;
    /// When the opening now under way (a request head, the agent's preamble) began; the head
    /// deadline runs from here. `None` when none is under way.
    fn head_started(&self) -> Option<Instant>;
    /// A stream is open: a quiet one is kept the way the surface's `Keepalive` says, and
    /// output may wait for the peer in the kernel while none waits here.
    fn is_streaming(&self) -> bool;
    /// Something is with the surface and not fully answered: not idle.
    fn awaiting_response(&self) -> bool;
    /// How long output queued here has waited without the socket taking a byte of it;
    /// `None` while nothing is queued. With the kernel's view (`tcp`), the write-stall
    /// deadline's input.
    fn write_stalled_for(&self) -> Option<Duration>;
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
    type Event<P> = Event<P>;

    fn closed<P>(id: ConnId, state: P) -> Event<P> {
        Event::Closed(id, state)
    }

    /// The HTTP connection (TLS when configured; `Connection::new` turns Nagle off), whose
    /// every request head comes to the front's gate before its body is read
    /// (`require_admission`).
    fn accept(listener: &TcpListener, setup: &HttpSetup) -> std::io::Result<Result<Self, String>> {
        let (tcp, peer) = listener.accept()?;
        let config = &setup.config;
        Ok(
            Connection::new(tcp, peer, config.tls.clone(), config.limits.clone())
                .map(|mut conn| {
                    conn.require_admission();
                    conn
                })
                .map_err(|e| format!("cannot set up a connection from {peer}: {e}")),
        )
    }

    fn source(&mut self) -> &mut dyn mio::event::Source {
        Connection::tcp(self)
    }

    fn tcp(&mut self) -> Option<&mut TcpStream> {
        Some(Connection::tcp(self))
    }

    fn peer_name(&self) -> String {
        self.peer().to_string()
    }

    /// Until one of its requests passes the gate.
    fn needs_admission(&self) -> bool {
        true
    }

    /// Remote as the gate sees it (loopback is remote under the gate's test seam).
    fn peer_key(&self, setup: &HttpSetup) -> Option<IpAddr> {
        let ip = self.peer().ip();
        (setup.config.gate.classify(&ip) == Peer::Remote).then(|| peer_key(ip))
    }

    fn peer_group(&self) -> Option<IpAddr> {
        Some(peer_key(self.peer().ip()))
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

    fn write_stalled_for(&self) -> Option<Duration> {
        Connection::write_stalled_for(self)
    }

    fn stream_chunk(&mut self, data: &[u8]) {
        Connection::stream_chunk(self, data);
    }

    fn close(&mut self) {
        Connection::close(self);
    }
}
