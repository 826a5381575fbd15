//! One outbound HTTP/1.1 exchange (request out, streamed response in) as a state machine
//! driven by readiness: resolve → connect → (proxy CONNECT) → (TLS) → send → head → body.
//!
//! It turns socket bytes into `ClientEvent`s using the sans-IO codecs next door; it must not
//! know what the body means (SSE decoding and provider semantics live above it). Time limits
//! are the owner's: it arms timers and calls `close` when one fires.
//!
//! Keep-alive: an owner that keeps a `pool::Pool` starts an exchange on an idle connection
//! with `reuse` instead of resolving, and after `ClientEvent::End` hands the connection back
//! with `park` (which gives it only when the response ended cleanly on a connection both
//! sides keep open). A request on a reused connection that fails before any response byte
//! (the server closed the idle connection meanwhile) is sent again, once, on a fresh
//! connection to the same addresses, without an event: the owner never sees the stale one.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;

use mio::net::TcpStream;
use mio::{Interest, Registry, Token};
use rustls::ClientConfig;

use crate::http::body::BodyDecoder;
use crate::http::head::{self, BodyKind, Parsed, ResponseHead};
use crate::http::pool::Parked;
use crate::http::target::{Proxy, Target};
use crate::transport::{Conn, ReadBuf};

/// Largest response body we will hold (error bodies) or stream (model output).
pub const MAX_STREAM_BODY: u64 = 256 * 1024 * 1024;

#[derive(Debug)]
pub enum ClientEvent {
    /// The final (non-1xx) response head arrived.
    Head(ResponseHead),
    /// De-chunked body bytes.
    Body(Vec<u8>),
    /// The body is complete; the exchange is over.
    End,
    /// The exchange failed. `permanent` failures (a certificate the roots do not trust, a
    /// proxy that refuses the tunnel, a response that breaks HTTP) would fail the same way
    /// again; the others may be retried if the owner has shown no output yet.
    Failed { error: String, permanent: bool },
}

enum Phase {
    Resolving,
    Connecting {
        tcp: TcpStream,
        rest: Vec<SocketAddr>,
        via_proxy: bool,
    },
    /// CONNECT sent to the proxy; waiting for its 2xx.
    Tunnelling {
        conn: Conn,
    },
    Exchanging {
        conn: Conn,
        body: Option<BodyDecoder>,
    },
    /// The response ended cleanly on a connection that may carry another request; still
    /// registered under this exchange's token until `park` or `close`.
    Done {
        conn: Conn,
    },
    Closed,
}

/// Why `pump` stopped an exchange.
struct Failure {
    message: String,
    permanent: bool,
}

impl From<String> for Failure {
    fn from(message: String) -> Failure {
        Failure {
            message,
            permanent: false,
        }
    }
}

impl From<&str> for Failure {
    fn from(message: &str) -> Failure {
        Failure::from(message.to_owned())
    }
}

fn permanent(message: String) -> Failure {
    Failure {
        message,
        permanent: true,
    }
}

/// A read error from the transport: TLS failures surface as `InvalidData` and will not go
/// away on retry; socket errors (reset, timeout) might.
fn read_failure(context: &str, err: std::io::Error) -> Failure {
    if err.kind() == std::io::ErrorKind::InvalidData {
        permanent(format!("{context}: {err}"))
    } else {
        Failure::from(format!("{context}: {err}"))
    }
}

pub struct Exchange {
    token: Token,
    target: Target,
    proxy: Option<Proxy>,
    tls_config: Option<Arc<ClientConfig>>,
    /// Bytes not yet handed to the socket (the request, or the CONNECT line first).
    outbuf: Vec<u8>,
    request: Vec<u8>,
    inbuf: ReadBuf,
    phase: Phase,
    got_response_byte: bool,
    /// The addresses the dial target resolved to: a connection made here, or reused, may
    /// need a fresh one to the same place.
    addrs: Vec<SocketAddr>,
    /// On a reused connection, until the first response byte: the request again, for one
    /// fresh connection if the server had closed the idle one.
    resend: Option<Vec<u8>>,
    /// The request lets the connection stay open (it does not say `Connection: close`).
    request_keeps_alive: bool,
    /// The response head lets the connection stay open, and its body is not delimited by
    /// the close.
    response_keeps_alive: bool,
}

impl Exchange {
    pub fn new(
        token: Token,
        target: Target,
        proxy: Option<Proxy>,
        tls_config: Option<Arc<ClientConfig>>,
        request: Vec<u8>,
    ) -> Exchange {
        let request_keeps_alive = matches!(
            head::parse_request_head(&request),
            Ok(Parsed::Complete(head, _)) if head.keep_alive()
        );
        Exchange {
            token,
            target,
            proxy,
            tls_config,
            outbuf: Vec::new(),
            request,
            inbuf: ReadBuf::new(),
            phase: Phase::Resolving,
            got_response_byte: false,
            addrs: Vec::new(),
            resend: None,
            request_keeps_alive,
            response_keeps_alive: false,
        }
    }

    /// Sends the request on an idle connection to the same place (instead of resolving and
    /// connecting): `parked` came from a pool under this exchange's key. Registers it under
    /// this exchange's token; the writable event that follows sends the request.
    pub fn reuse(&mut self, registry: &Registry, mut parked: Parked<Conn>) -> Result<(), String> {
        if !matches!(self.phase, Phase::Resolving) {
            return Err("the exchange already started".to_owned());
        }
        registry
            .register(
                parked.conn.tcp(),
                self.token,
                Interest::READABLE | Interest::WRITABLE,
            )
            .map_err(|e| format!("cannot register socket: {e}"))?;
        self.addrs = parked.addrs;
        self.resend = Some(self.request.clone());
        self.outbuf = std::mem::take(&mut self.request);
        self.phase = Phase::Exchanging {
            conn: parked.conn,
            body: None,
        };
        Ok(())
    }

    /// After `ClientEvent::End`: the connection, deregistered, for the pool, when the
    /// response ended cleanly on a connection both sides keep open; otherwise it is closed.
    pub fn park(&mut self, registry: &Registry) -> Option<Parked<Conn>> {
        match std::mem::replace(&mut self.phase, Phase::Closed) {
            Phase::Done { mut conn } => {
                registry.deregister(conn.tcp()).ok()?;
                Some(Parked {
                    conn,
                    addrs: std::mem::take(&mut self.addrs),
                })
            }
            other => {
                self.phase = other;
                self.close(registry);
                None
            }
        }
    }

    pub fn token(&self) -> Token {
        self.token
    }

    /// The host and port to resolve: the proxy's when one is used.
    pub fn dial_target(&self) -> (String, u16) {
        match &self.proxy {
            Some(proxy) => (proxy.host.clone(), proxy.port),
            None => (self.target.host.clone(), self.target.port),
        }
    }

    pub fn got_response_byte(&self) -> bool {
        self.got_response_byte
    }

    pub fn on_resolved(
        &mut self,
        registry: &Registry,
        result: Result<Vec<SocketAddr>, String>,
        out: &mut Vec<ClientEvent>,
    ) {
        if !matches!(self.phase, Phase::Resolving) {
            return;
        }
        match result {
            Ok(addrs) => {
                self.addrs.clone_from(&addrs);
                self.connect_next(registry, addrs, out)
            }
            Err(error) => self.fail(registry, error, out),
        }
    }

    fn connect_next(
        &mut self,
        registry: &Registry,
        mut addrs: Vec<SocketAddr>,
        out: &mut Vec<ClientEvent>,
    ) {
        let mut last_err = String::from("no addresses to connect to");
        while !addrs.is_empty() {
            let addr = addrs.remove(0);
            match TcpStream::connect(addr) {
                Ok(mut tcp) => {
                    let _ = tcp.set_nodelay(true);
                    // Edge-triggered and registered once for both directions: every wake
                    // tries to flush and to read, so no interest bookkeeping is needed.
                    if let Err(e) = registry.register(
                        &mut tcp,
                        self.token,
                        Interest::READABLE | Interest::WRITABLE,
                    ) {
                        last_err = format!("cannot register socket: {e}");
                        continue;
                    }
                    self.phase = Phase::Connecting {
                        tcp,
                        rest: addrs,
                        via_proxy: self.proxy.is_some(),
                    };
                    return;
                }
                Err(e) => last_err = format!("connect to {addr}: {e}"),
            }
        }
        self.fail(registry, last_err, out);
    }

    /// Call on any readiness for this exchange's token.
    pub fn on_ready(&mut self, registry: &Registry, out: &mut Vec<ClientEvent>) {
        if let Phase::Connecting { .. } = self.phase {
            self.finish_connect(registry, out);
        }
        if let Err(failure) = self.pump(out) {
            if self.resend.is_some() && !self.got_response_byte {
                return self.redial(registry, &failure.message, out);
            }
            self.close(registry);
            out.push(ClientEvent::Failed {
                error: failure.message,
                permanent: failure.permanent,
            });
        }
    }

    /// The reused connection failed before any response byte: the server had closed it (an
    /// idle timeout racing our request). The same request goes once more, on a fresh
    /// connection to the same addresses; that one's failures are the owner's to see.
    fn redial(&mut self, registry: &Registry, why: &str, out: &mut Vec<ClientEvent>) {
        self.close(registry);
        crate::log::debug(&format!(
            "an idle connection to {} was closed by the server ({why}); sending on a new one",
            self.target.url_host()
        ));
        if let Some(request) = self.resend.take() {
            self.request = request;
        }
        self.outbuf.clear();
        self.inbuf.clear();
        self.phase = Phase::Resolving;
        let addrs = self.addrs.clone();
        self.connect_next(registry, addrs, out);
    }

    fn finish_connect(&mut self, registry: &Registry, out: &mut Vec<ClientEvent>) {
        let Phase::Connecting {
            mut tcp,
            rest,
            via_proxy,
        } = std::mem::replace(&mut self.phase, Phase::Closed)
        else {
            return;
        };
        // mio's non-blocking connect: an error here means this address refused us; a
        // NotConnected peer address means the connect is still in flight (spurious wake).
        let failed = match tcp.take_error() {
            Ok(Some(err)) | Err(err) => Some(err),
            Ok(None) => match tcp.peer_addr() {
                Ok(_) => None,
                Err(err) if err.kind() == io::ErrorKind::NotConnected => {
                    self.phase = Phase::Connecting {
                        tcp,
                        rest,
                        via_proxy,
                    };
                    return;
                }
                Err(err) => Some(err),
            },
        };
        if let Some(err) = failed {
            let _ = registry.deregister(&mut tcp);
            let (host, port) = self.dial_target();
            if rest.is_empty() {
                self.fail(
                    registry,
                    format!("cannot connect to {host}:{port}: {err}"),
                    out,
                );
            } else {
                self.connect_next(registry, rest, out);
            }
            return;
        }
        if via_proxy {
            let authority = self.target.authority();
            self.outbuf = format!(
                "CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\nProxy-Connection: keep-alive\r\n\r\n"
            )
            .into_bytes();
            self.phase = Phase::Tunnelling {
                conn: Conn::Plain(tcp),
            };
        } else {
            match self.begin_request(Conn::Plain(tcp)) {
                Ok(phase) => self.phase = phase,
                Err(error) => self.fail(registry, error, out),
            }
        }
    }

    fn begin_request(&mut self, conn: Conn) -> Result<Phase, String> {
        let conn = if self.target.tls {
            let config = self
                .tls_config
                .clone()
                .ok_or_else(|| "https target without a tls config".to_owned())?;
            conn.start_tls(config, &self.target.host)?
        } else {
            conn
        };
        self.outbuf = std::mem::take(&mut self.request);
        Ok(Phase::Exchanging { conn, body: None })
    }

    fn pump(&mut self, out: &mut Vec<ClientEvent>) -> Result<(), Failure> {
        loop {
            match &mut self.phase {
                Phase::Resolving
                | Phase::Connecting { .. }
                | Phase::Done { .. }
                | Phase::Closed => return Ok(()),
                Phase::Tunnelling { conn } => {
                    conn.flush(&mut self.outbuf)
                        .map_err(|e| format!("proxy write: {e}"))?;
                    let status = conn
                        .read_into(&mut self.inbuf, crate::transport::READ_BUDGET)
                        .map_err(|e| read_failure("proxy read", e))?;
                    match head::parse_response_head(self.inbuf.data()) {
                        Ok(Parsed::Partial) => {
                            if status.eof {
                                return Err("proxy closed the connection during CONNECT".into());
                            }
                            return Ok(());
                        }
                        Ok(Parsed::Complete(resp, used)) => {
                            if !(200..300).contains(&resp.status) {
                                return Err(permanent(format!(
                                    "proxy refused CONNECT: {} {}",
                                    resp.status, resp.reason
                                )));
                            }
                            self.inbuf.consume(used);
                            let Phase::Tunnelling { conn } =
                                std::mem::replace(&mut self.phase, Phase::Closed)
                            else {
                                return Ok(());
                            };
                            self.phase = self.begin_request(conn)?;
                            continue;
                        }
                        Err(e) => return Err(permanent(format!("proxy response: {e}"))),
                    }
                }
                Phase::Exchanging { conn, body } => {
                    conn.flush(&mut self.outbuf).map_err(|e| {
                        if self.got_response_byte {
                            format!("write failed: {e}")
                        } else {
                            format!("connection failed before the response: {e}")
                        }
                    })?;
                    // The client serves model requests, WebFetch and MCP servers alike: the
                    // failure names the host, the caller says which of them it was.
                    let status = conn
                        .read_into(&mut self.inbuf, crate::transport::READ_BUDGET)
                        .map_err(|e| {
                            let host = self.target.url_host();
                            read_failure(&format!("connection to {host} failed"), e)
                        })?;
                    if status.n_bytes > 0 && !self.got_response_byte {
                        self.got_response_byte = true;
                        // The server answered on this connection: it was not stale.
                        self.resend = None;
                    }
                    // Reading can finish the TLS handshake, which releases the request bytes
                    // rustls was holding and lets it take more of `outbuf`. No writable event
                    // is due for them (the socket never filled), so send them now.
                    if !status.eof && (!self.outbuf.is_empty() || conn.wants_write()) {
                        conn.flush(&mut self.outbuf).map_err(|e| {
                            if self.got_response_byte {
                                format!("write failed: {e}")
                            } else {
                                format!("connection failed before the response: {e}")
                            }
                        })?;
                    }
                    loop {
                        if body.is_none() {
                            match head::parse_response_head(self.inbuf.data()) {
                                Ok(Parsed::Partial) => break,
                                Ok(Parsed::Complete(resp, used)) => {
                                    self.inbuf.consume(used);
                                    if resp.is_interim() {
                                        continue;
                                    }
                                    let kind = head::response_body_kind(&resp, false)
                                        .map_err(|e| permanent(format!("bad response: {e}")))?;
                                    let none = matches!(kind, BodyKind::None);
                                    self.response_keeps_alive =
                                        resp.keep_alive() && kind != BodyKind::UntilClose;
                                    *body = Some(BodyDecoder::new(kind, MAX_STREAM_BODY));
                                    out.push(ClientEvent::Head(resp));
                                    if none {
                                        self.finish(out, status.eof);
                                        return Ok(());
                                    }
                                }
                                Err(e) => return Err(permanent(format!("bad response head: {e}"))),
                            }
                        }
                        let Some(decoder) = body.as_mut() else { break };
                        let input = self.inbuf.data();
                        if input.is_empty() {
                            break;
                        }
                        // The body never outgrows its framing: one allocation, sized once.
                        let mut decoded = Vec::with_capacity(input.len());
                        let (used, done) = decoder
                            .decode(input, &mut decoded)
                            .map_err(|e| permanent(format!("bad response body: {e}")))?;
                        self.inbuf.consume(used);
                        if !decoded.is_empty() {
                            out.push(ClientEvent::Body(decoded));
                        }
                        if done {
                            self.finish(out, status.eof);
                            return Ok(());
                        }
                        break;
                    }
                    if status.eof {
                        let Phase::Exchanging { body, .. } = &self.phase else {
                            return Ok(());
                        };
                        return match body {
                            Some(decoder) => match decoder.finish_eof() {
                                Ok(()) => {
                                    self.finish(out, true);
                                    Ok(())
                                }
                                Err(e) => {
                                    Err(format!("connection closed mid-response: {e}").into())
                                }
                            },
                            None if self.got_response_byte => {
                                Err("connection closed before the response head ended".into())
                            }
                            None => Err("connection closed before any response".into()),
                        };
                    }
                    if status.more {
                        // Budget exhausted: with edge-triggered readiness no new event will
                        // come for bytes already buffered, so keep going.
                        continue;
                    }
                    return Ok(());
                }
            }
        }
    }

    /// The response is complete. The connection stays for `park` only when nothing else
    /// can be on it: both sides keep it open, the body had its own framing, the peer did not
    /// close (`eof`), no byte arrived past the body and none of ours is still unsent.
    fn finish(&mut self, out: &mut Vec<ClientEvent>, eof: bool) {
        let phase = std::mem::replace(&mut self.phase, Phase::Closed);
        if let Phase::Exchanging { conn, .. } = phase
            && self.request_keeps_alive
            && self.response_keeps_alive
            && !eof
            && self.inbuf.is_empty()
            && self.outbuf.is_empty()
            && !conn.wants_write()
        {
            self.phase = Phase::Done { conn };
        }
        out.push(ClientEvent::End);
    }

    fn fail(&mut self, registry: &Registry, error: String, out: &mut Vec<ClientEvent>) {
        self.close(registry);
        out.push(ClientEvent::Failed {
            error,
            permanent: false,
        });
    }

    /// Drops the connection (cancel, timeout, done). Safe to call more than once.
    pub fn close(&mut self, registry: &Registry) {
        match std::mem::replace(&mut self.phase, Phase::Closed) {
            Phase::Connecting { mut tcp, .. } => {
                let _ = registry.deregister(&mut tcp);
            }
            Phase::Tunnelling { mut conn }
            | Phase::Exchanging { mut conn, .. }
            | Phase::Done { mut conn } => {
                let _ = registry.deregister(conn.tcp());
            }
            Phase::Resolving | Phase::Closed => {}
        }
    }
}

/// Whether an idle connection may carry a request: nothing arrived on it while it waited.
/// A close (EOF, a TLS close_notify), an error or stray bytes all mean it is dead or broken.
/// One non-blocking read; TLS session tickets arriving late are taken in and do not count.
pub fn idle_alive(conn: &mut Conn) -> bool {
    let mut stray = Vec::new();
    matches!(
        conn.drain_read_upto(&mut stray, 1),
        Ok(status) if status.n_bytes == 0 && !status.eof
    )
}

/// Splits an `http(s)://host[:port][/path]` base URL into a target and a path prefix.
pub fn parse_base_url(url: &str) -> Result<(Target, String), String> {
    let (tls, rest) = if let Some(rest) = url.strip_prefix("https://") {
        (true, rest)
    } else if let Some(rest) = url.strip_prefix("http://") {
        (false, rest)
    } else {
        return Err(format!(
            "unsupported url `{url}`: expected http:// or https://"
        ));
    };
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, ""),
    };
    let authority = authority.rsplit('@').next().unwrap_or(authority);
    let default_port = if tls { 443 } else { 80 };
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let (host, after) = v6
            .split_once(']')
            .ok_or_else(|| format!("bad ipv6 address in `{url}`"))?;
        let port = match after.strip_prefix(':') {
            Some(p) => p.parse().map_err(|_| format!("bad port in `{url}`"))?,
            None => default_port,
        };
        (host.to_owned(), port)
    } else {
        match authority.rsplit_once(':') {
            Some((host, port)) => (
                host.to_owned(),
                port.parse().map_err(|_| format!("bad port in `{url}`"))?,
            ),
            None => (authority.to_owned(), default_port),
        }
    };
    if host.is_empty() {
        return Err(format!("no host in `{url}`"));
    }
    Ok((
        Target { tls, host, port },
        path.trim_end_matches('/').to_owned(),
    ))
}

/// The proxy for `target` from `HTTPS_PROXY`/`https_proxy` (or the `HTTP_` pair for plain
/// targets), unless `NO_PROXY`/`no_proxy` lists the host: `*`, an exact host, or a domain
/// that matches itself and its subdomains (a leading `.` is optional).
///
/// Loopback targets get no special treatment, as in curl: a proxy set in the environment
/// applies to `localhost` too unless `NO_PROXY` names it. (Skipping it silently would make a
/// local endpoint behind a deliberate proxy unreachable, and the CONNECT path untestable.)
pub fn proxy_for(
    target: &Target,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<Proxy>, String> {
    let names: &[&str] = if target.tls {
        &["HTTPS_PROXY", "https_proxy"]
    } else {
        &["HTTP_PROXY", "http_proxy"]
    };
    let Some(url) = names
        .iter()
        .find_map(|n| env(n))
        .filter(|v| !v.trim().is_empty())
    else {
        return Ok(None);
    };
    let no_proxy = env("NO_PROXY")
        .or_else(|| env("no_proxy"))
        .unwrap_or_default();
    // Host names compare case-insensitively (as in curl); `[::1]` and `::1` both name ::1.
    let host = target.host.to_ascii_lowercase();
    for entry in no_proxy.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let entry = entry
            .trim_start_matches('.')
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_ascii_lowercase();
        if entry == "*" || host == entry || host.ends_with(&format!(".{entry}")) {
            return Ok(None);
        }
    }
    let url = url.trim();
    let url = if url.contains("://") {
        url.to_owned()
    } else {
        format!("http://{url}")
    };
    let (proxy, _) = parse_base_url(&url).map_err(|e| format!("bad proxy setting: {e}"))?;
    if proxy.tls {
        return Err("https:// proxies are not supported; use an http:// proxy url".to_owned());
    }
    Ok(Some(Proxy {
        host: proxy.host,
        port: proxy.port,
    }))
}

pub fn is_loopback_host(host: &str) -> bool {
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .map(|ip| ip.is_loopback())
            .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::io::{Read, Write};
    use std::sync::mpsc;
    use std::time::Duration;

    /// Every receive here gives up after this; nothing is timed.
    const WAIT: Duration = Duration::from_secs(10);

    /// A loopback server answering each request (a head ending in a blank line) with the
    /// next of `replies`, in order across connections; a reply `(bytes, true)` closes its
    /// connection after it, once `hang_up` says so (or its sender is gone). Sends the number
    /// of each connection it accepts, and `0` after every close.
    fn server(replies: Vec<(&'static [u8], bool)>) -> (SocketAddr, mpsc::Receiver<usize>) {
        let (addr, rx, _hang_up) = server_with_hang_up(replies);
        (addr, rx)
    }

    fn server_with_hang_up(
        replies: Vec<(&'static [u8], bool)>,
    ) -> (SocketAddr, mpsc::Receiver<usize>, mpsc::Sender<()>) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (tx, rx) = mpsc::channel();
        let (hang_up, hang_up_rx) = mpsc::channel::<()>();
        std::thread::spawn(move || {
            let mut replies = replies.into_iter();
            let mut accepted = 0;
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { return };
                accepted += 1;
                let _ = tx.send(accepted);
                stream.set_read_timeout(Some(WAIT)).expect("timeout");
                let mut seen = Vec::new();
                let mut buf = [0u8; 4096];
                loop {
                    while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                        match stream.read(&mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => seen.extend_from_slice(&buf[..n]),
                        }
                    }
                    let Some(end) = seen.windows(4).position(|w| w == b"\r\n\r\n") else {
                        break;
                    };
                    seen.drain(..end + 4);
                    let Some((reply, close)) = replies.next() else {
                        return;
                    };
                    let _ = stream.write_all(reply);
                    if close {
                        let _ = hang_up_rx.recv_timeout(WAIT);
                        break;
                    }
                }
                drop(stream);
                let _ = tx.send(0);
            }
        });
        (addr, rx, hang_up)
    }

    fn get(close: bool) -> Vec<u8> {
        let extra = if close { "Connection: close\r\n" } else { "" };
        format!("GET / HTTP/1.1\r\nHost: x\r\n{extra}\r\n").into_bytes()
    }

    /// Drives one exchange to `End` or `Failed` (on `parked` if given), then parks it.
    fn exchange(
        poll: &mut mio::Poll,
        addr: SocketAddr,
        request: Vec<u8>,
        parked: Option<Parked<Conn>>,
        token: usize,
    ) -> (Vec<ClientEvent>, Option<Parked<Conn>>) {
        let target = Target {
            tls: false,
            host: "127.0.0.1".into(),
            port: addr.port(),
        };
        let mut ex = Exchange::new(Token(token), target, None, None, request);
        let mut out = Vec::new();
        match parked {
            Some(parked) => ex.reuse(poll.registry(), parked).expect("reuse"),
            None => ex.on_resolved(poll.registry(), Ok(vec![addr]), &mut out),
        }
        let mut events = mio::Events::with_capacity(16);
        let ended = |out: &Vec<ClientEvent>| {
            out.iter()
                .any(|e| matches!(e, ClientEvent::End | ClientEvent::Failed { .. }))
        };
        let deadline = std::time::Instant::now() + WAIT;
        while !ended(&out) && std::time::Instant::now() < deadline {
            poll.poll(&mut events, Some(Duration::from_millis(100)))
                .expect("poll");
            if !events.is_empty() {
                ex.on_ready(poll.registry(), &mut out);
            }
        }
        assert!(ended(&out), "no end: {out:?}");
        let parked = ex.park(poll.registry());
        (out, parked)
    }

    fn ended_cleanly(out: &[ClientEvent]) -> bool {
        matches!(out.last(), Some(ClientEvent::End))
    }

    const OK: &[u8] = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";
    const CHUNKED: &[u8] =
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n";

    #[test]
    fn a_clean_keep_alive_response_leaves_its_connection_for_the_next() {
        let (addr, accepts) = server(vec![(OK, false), (CHUNKED, false), (OK, false)]);
        let mut poll = mio::Poll::new().expect("poll");
        let (out, parked) = exchange(&mut poll, addr, get(false), None, 1);
        assert!(ended_cleanly(&out), "{out:?}");
        let mut parked = parked.expect("pooled");
        assert_eq!(parked.addrs, [addr]);
        assert!(idle_alive(&mut parked.conn));
        let (out, parked) = exchange(&mut poll, addr, get(false), Some(parked), 2);
        assert!(ended_cleanly(&out), "{out:?}");
        let (out, parked) = exchange(&mut poll, addr, get(false), parked, 3);
        assert!(ended_cleanly(&out), "{out:?}");
        assert!(parked.is_some());
        assert_eq!(accepts.recv_timeout(WAIT), Ok(1));
        assert!(
            accepts.try_recv().is_err(),
            "one connection for three requests"
        );
    }

    #[test]
    fn no_reuse_after_close_eof_framing_errors_or_cancel() {
        let cases: [(&[u8], bool, bool); 4] = [
            // The server says close.
            (
                b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok",
                false,
                false,
            ),
            // The body runs to the close (the sender of `hang_up` is gone: at once).
            (b"HTTP/1.1 200 OK\r\n\r\nok", true, false),
            // We said close.
            (OK, false, true),
            // HTTP/1.0 without keep-alive.
            (
                b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok",
                false,
                false,
            ),
        ];
        let mut poll = mio::Poll::new().expect("poll");
        for (n, (reply, server_closes, we_close)) in cases.into_iter().enumerate() {
            let (addr, _accepts) = server(vec![(reply, server_closes)]);
            let (out, parked) = exchange(&mut poll, addr, get(we_close), None, 10 + n);
            assert!(ended_cleanly(&out), "case {n}: {out:?}");
            assert!(parked.is_none(), "case {n} was pooled");
        }
        // A framing error: failed, and nothing to pool.
        let (addr, _accepts) = server(vec![(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            false,
        )]);
        let (out, parked) = exchange(&mut poll, addr, get(false), None, 20);
        assert!(
            matches!(out.last(), Some(ClientEvent::Failed { .. })),
            "{out:?}"
        );
        assert!(parked.is_none());
        // Abandoned mid-response (a cancelled run): closed, never pooled.
        let (addr, _accepts) = server(vec![(
            b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\npart",
            false,
        )]);
        let target = Target {
            tls: false,
            host: "127.0.0.1".into(),
            port: addr.port(),
        };
        let mut ex = Exchange::new(Token(21), target, None, None, get(false));
        let mut out = Vec::new();
        ex.on_resolved(poll.registry(), Ok(vec![addr]), &mut out);
        let mut events = mio::Events::with_capacity(16);
        let deadline = std::time::Instant::now() + WAIT;
        while !out.iter().any(|e| matches!(e, ClientEvent::Body(_)))
            && std::time::Instant::now() < deadline
        {
            poll.poll(&mut events, Some(Duration::from_millis(100)))
                .expect("poll");
            ex.on_ready(poll.registry(), &mut out);
        }
        assert!(matches!(out.last(), Some(ClientEvent::Body(_))), "{out:?}");
        ex.close(poll.registry());
        assert!(ex.park(poll.registry()).is_none());
    }

    #[test]
    fn a_request_on_a_connection_the_server_closed_goes_again_on_a_new_one() {
        // The first reply closes its connection after it, as a server's idle timeout would.
        let (addr, accepts, hang_up) = server_with_hang_up(vec![(OK, true), (OK, false)]);
        let mut poll = mio::Poll::new().expect("poll");
        let (out, parked) = exchange(&mut poll, addr, get(false), None, 1);
        assert!(ended_cleanly(&out), "{out:?}");
        let mut parked = parked.expect("pooled: the head said keep-alive");
        assert_eq!(accepts.recv_timeout(WAIT), Ok(1));
        hang_up.send(()).expect("hang up");
        assert_eq!(accepts.recv_timeout(WAIT), Ok(0), "the server closed");
        // The check before reuse sees the close ...
        assert!(!idle_alive(&mut parked.conn));
        // ... and without it, the request on the dead connection is sent again unseen.
        let (out, parked) = exchange(&mut poll, addr, get(false), Some(parked), 2);
        assert!(ended_cleanly(&out), "{out:?}");
        assert!(
            !out.iter().any(|e| matches!(e, ClientEvent::Failed { .. })),
            "{out:?}"
        );
        assert!(parked.is_some());
        assert_eq!(accepts.recv_timeout(WAIT), Ok(2));
    }

    #[test]
    fn base_urls() {
        let (t, p) = parse_base_url("https://api.anthropic.com").unwrap();
        assert_eq!(
            (t.tls, t.host.as_str(), t.port, p.as_str()),
            (true, "api.anthropic.com", 443, "")
        );
        let (t, p) = parse_base_url("http://127.0.0.1:8080/v1/").unwrap();
        assert_eq!(
            (t.tls, t.host.as_str(), t.port, p.as_str()),
            (false, "127.0.0.1", 8080, "/v1")
        );
        assert_eq!(t.host_header(), "127.0.0.1:8080");
        let (t, _) = parse_base_url("http://[::1]:9/x").unwrap();
        assert_eq!((t.host.as_str(), t.port), ("::1", 9));
        assert_eq!(t.host_header(), "[::1]:9");
        assert_eq!(t.authority(), "[::1]:9");
        let (t, _) = parse_base_url("https://[::1]").unwrap();
        assert_eq!(
            (t.host_header().as_str(), t.authority().as_str()),
            ("[::1]", "[::1]:443")
        );
        let (t, _) = parse_base_url("https://api.anthropic.com").unwrap();
        assert_eq!(t.authority(), "api.anthropic.com:443");
        assert!(parse_base_url("ftp://x").is_err());
        assert!(parse_base_url("http://:80").is_err());
    }

    #[test]
    fn proxies() {
        let target = Target {
            tls: true,
            host: "api.openai.com".into(),
            port: 443,
        };
        let env = |k: &str| match k {
            "HTTPS_PROXY" => Some("proxy.local:3128".to_owned()),
            "NO_PROXY" => Some("example.com,.internal".to_owned()),
            _ => None,
        };
        let proxy = proxy_for(&target, &env).unwrap().unwrap();
        assert_eq!((proxy.host.as_str(), proxy.port), ("proxy.local", 3128));
        let internal = Target {
            tls: true,
            host: "a.internal".into(),
            port: 443,
        };
        assert_eq!(proxy_for(&internal, &env).unwrap(), None);
        // Loopback is proxied like any other host (curl does the same) ...
        let local = Target {
            tls: true,
            host: "127.0.0.1".into(),
            port: 443,
        };
        assert_eq!(proxy_for(&local, &env).unwrap(), Some(proxy.clone()));
        let localhost = Target {
            tls: true,
            host: "localhost".into(),
            port: 8443,
        };
        assert_eq!(proxy_for(&localhost, &env).unwrap(), Some(proxy.clone()));
        // ... unless NO_PROXY lists it.
        let env_no_local = |k: &str| match k {
            "HTTPS_PROXY" => Some("http://proxy.local:3128".to_owned()),
            "no_proxy" => Some("localhost, 127.0.0.1".to_owned()),
            _ => None,
        };
        assert_eq!(proxy_for(&localhost, &env_no_local).unwrap(), None);
        assert_eq!(proxy_for(&local, &env_no_local).unwrap(), None);
        // Host names match case-insensitively; IPv6 entries with or without brackets.
        let env_mixed = |k: &str| match k {
            "HTTPS_PROXY" => Some("http://proxy.local:3128".to_owned()),
            "NO_PROXY" => Some("LocalHost,[::1],.Example.COM".to_owned()),
            _ => None,
        };
        assert_eq!(proxy_for(&localhost, &env_mixed).unwrap(), None);
        let v6 = Target {
            tls: true,
            host: "::1".into(),
            port: 443,
        };
        assert_eq!(proxy_for(&v6, &env_mixed).unwrap(), None);
        let sub = Target {
            tls: true,
            host: "API.example.com".into(),
            port: 443,
        };
        assert_eq!(proxy_for(&sub, &env_mixed).unwrap(), None);
        assert!(proxy_for(&internal, &env_mixed).unwrap().is_some());
        // Plain targets read the HTTP_ pair only.
        let plain = Target {
            tls: false,
            host: "api.openai.com".into(),
            port: 80,
        };
        assert_eq!(proxy_for(&plain, &env).unwrap(), None);
        let env_http = |k: &str| (k == "http_proxy").then(|| "http://p:8080/".to_owned());
        let p = proxy_for(&plain, &env_http).unwrap().unwrap();
        assert_eq!((p.host.as_str(), p.port), ("p", 8080));
    }
}
