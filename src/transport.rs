//! Byte streams: plain TCP or TLS (rustls with the *ring* provider) over a non-blocking
//! `mio::net::TcpStream`, for outgoing connections (client TLS, the CA bundle, DNS on a worker
//! pool) and accepted ones (server TLS from a certificate and key on disk).
//!
//! It reads and writes until `WouldBlock` and reports EOF; it must not know what the bytes
//! mean (HTTP lives in `http`).

use std::io::{self, Read, Write};
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::Path;
use std::sync::{Arc, OnceLock};

use mio::net::TcpStream;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{
    ClientConfig, ClientConnection, ConnectionCommon, RootCertStore, ServerConfig, ServerConnection,
};

use crate::workers::Pool;

/// Where distributions keep their CA bundle, most common first. `SSL_CERT_FILE` wins.
const CA_BUNDLE_PATHS: &[&str] = &[
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/ca-bundle.pem",
    "/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem",
    "/etc/ssl/cert.pem",
];

/// Read no more plaintext per wake than this, so one busy stream cannot starve the loop.
pub const READ_BUDGET: usize = 256 * 1024;

pub fn crypto_provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Which roots a client config trusts, for diagnostics.
#[derive(Clone, Debug)]
pub enum RootSource {
    File(String),
    Bundled,
}

impl RootSource {
    pub fn describe(&self) -> String {
        match self {
            RootSource::File(path) => format!("CA bundle {path}"),
            RootSource::Bundled => {
                "the bundled Mozilla roots (no system CA bundle found)".to_owned()
            }
        }
    }
}

/// Builds the client TLS config once per process: the system bundle (or `SSL_CERT_FILE`),
/// else the bundled Mozilla roots, so minimal containers with no CA bundle still work.
pub fn client_config() -> Result<(Arc<ClientConfig>, RootSource), String> {
    static CONFIG: OnceLock<Result<(Arc<ClientConfig>, RootSource), String>> = OnceLock::new();
    CONFIG
        .get_or_init(|| {
            let (roots, source) = load_roots()?;
            let mut config = ClientConfig::builder_with_provider(crypto_provider())
                .with_safe_default_protocol_versions()
                .map_err(|e| format!("tls setup failed: {e}"))?
                .with_root_certificates(roots)
                .with_no_client_auth();
            // We speak HTTP/1.1 only; advertising h2 would let a server pick a framing we
            // cannot read.
            config.alpn_protocols = vec![b"http/1.1".to_vec()];
            Ok((Arc::new(config), source))
        })
        .clone()
}

/// Builds a server TLS config from a PEM certificate chain (leaf first) and a PEM private key
/// (PKCS#8, PKCS#1 or SEC1), offering only `http/1.1` over ALPN. Errors name the file at fault.
pub fn server_config(cert_pem: &Path, key_pem: &Path) -> Result<Arc<ServerConfig>, String> {
    let cert_name = cert_pem.display();
    let key_name = key_pem.display();
    let certs = CertificateDer::pem_file_iter(cert_pem)
        .map_err(|e| format!("tls certificate {cert_name}: {e}"))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("tls certificate {cert_name}: {e}"))?;
    if certs.is_empty() {
        return Err(format!(
            "tls certificate {cert_name}: no certificates found"
        ));
    }
    let key =
        PrivateKeyDer::from_pem_file(key_pem).map_err(|e| format!("tls key {key_name}: {e}"))?;
    let mut config = ServerConfig::builder_with_provider(crypto_provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("tls setup failed: {e}"))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| format!("tls certificate {cert_name} with key {key_name}: {e}"))?;
    // We serve HTTP/1.1 only; a client that insists on h2 is refused in the handshake rather
    // than sent bytes it would misread.
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

fn load_roots() -> Result<(RootCertStore, RootSource), String> {
    if let Some(path) = std::env::var_os("SSL_CERT_FILE") {
        let path = Path::new(&path);
        // An explicit setting that does not work is an error, not a silent fallback.
        let store =
            roots_from_file(path).map_err(|e| format!("SSL_CERT_FILE={}: {e}", path.display()))?;
        return Ok((store, RootSource::File(path.display().to_string())));
    }
    for candidate in CA_BUNDLE_PATHS {
        if let Ok(store) = roots_from_file(Path::new(candidate)) {
            return Ok((store, RootSource::File((*candidate).to_owned())));
        }
    }
    let mut store = RootCertStore::empty();
    store.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    Ok((store, RootSource::Bundled))
}

fn roots_from_file(path: &Path) -> Result<RootCertStore, String> {
    let iter = CertificateDer::pem_file_iter(path).map_err(|e| e.to_string())?;
    let mut store = RootCertStore::empty();
    for cert in iter {
        let cert = cert.map_err(|e| e.to_string())?;
        // Bundles often hold a few certificates rustls rejects (old encodings); skip them
        // rather than refusing the whole bundle.
        let _ = store.add(cert);
    }
    if store.is_empty() {
        return Err("no usable certificates".to_owned());
    }
    Ok(store)
}

/// The address of a host that is an IP literal (`[::1]` or `127.0.0.1`): it needs no
/// lookup, and no thread.
pub(crate) fn literal_addr(host: &str, port: u16) -> Option<std::net::SocketAddr> {
    host.trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<std::net::IpAddr>()
        .ok()
        .map(|ip| std::net::SocketAddr::new(ip, port))
}

/// Resolves `host:port` on one of `workers`' threads (getaddrinfo blocks) and hands the
/// result to `deliver`, which is expected to post it to the loop and wake it. Fails only when
/// the pool cannot take the lookup (its queue is full, or no thread starts); then `deliver`
/// is never called.
pub(crate) fn resolve_in_background<F>(
    workers: &Pool,
    host: String,
    port: u16,
    deliver: F,
) -> Result<(), String>
where
    F: FnOnce(Result<Vec<SocketAddr>, String>) + Send + 'static,
{
    let what = host.clone();
    workers
        .submit(move || {
            let result = (host.as_str(), port)
                .to_socket_addrs()
                .map(|addrs| addrs.collect::<Vec<_>>())
                .map_err(|e| format!("cannot resolve {host}: {e}"))
                .and_then(|addrs| {
                    if addrs.is_empty() {
                        Err(format!("cannot resolve {host}: no addresses"))
                    } else {
                        Ok(addrs)
                    }
                });
            deliver(result);
        })
        .map_err(|rejected| format!("cannot resolve {what}: {rejected}"))
}

/// What one `drain_read` found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadStatus {
    pub n_bytes: usize,
    /// The peer closed (cleanly or not); no more bytes will come.
    pub eof: bool,
    /// Stopped because of `READ_BUDGET`, not `WouldBlock`: read again soon.
    pub more: bool,
}

pub enum Conn {
    Plain(TcpStream),
    /// An outgoing connection: we are the TLS client.
    Tls {
        tcp: TcpStream,
        tls: Box<ClientConnection>,
    },
    /// An accepted connection: we are the TLS server.
    TlsServer {
        tcp: TcpStream,
        tls: Box<ServerConnection>,
    },
}

impl Conn {
    pub fn start_tls(self, config: Arc<ClientConfig>, host: &str) -> Result<Conn, String> {
        let tcp = match self {
            Conn::Plain(tcp) => tcp,
            Conn::Tls { .. } | Conn::TlsServer { .. } => {
                return Err("connection already uses tls".to_owned());
            }
        };
        let name = ServerName::try_from(host.to_owned())
            .map_err(|_| format!("invalid tls server name `{host}`"))?;
        let tls = ClientConnection::new(config, name).map_err(|e| format!("tls: {e}"))?;
        Ok(Conn::Tls {
            tcp,
            tls: Box::new(tls),
        })
    }

    /// Wraps an accepted connection as the TLS server side; the handshake runs inside the
    /// first `drain_read` and `flush` calls.
    pub fn accept_tls(self, config: Arc<ServerConfig>) -> Result<Conn, String> {
        let tcp = match self {
            Conn::Plain(tcp) => tcp,
            Conn::Tls { .. } | Conn::TlsServer { .. } => {
                return Err("connection already uses tls".to_owned());
            }
        };
        let tls = ServerConnection::new(config).map_err(|e| format!("tls: {e}"))?;
        Ok(Conn::TlsServer {
            tcp,
            tls: Box::new(tls),
        })
    }

    /// Whether a TLS handshake is still under way (never for plain TCP).
    pub fn is_handshaking(&self) -> bool {
        match self {
            Conn::Plain(_) => false,
            Conn::Tls { tls, .. } => tls.is_handshaking(),
            Conn::TlsServer { tls, .. } => tls.is_handshaking(),
        }
    }

    /// Whether bytes are queued inside the connection (TLS records not yet on the socket).
    pub fn wants_write(&self) -> bool {
        match self {
            Conn::Plain(_) => false,
            Conn::Tls { tls, .. } => tls.wants_write(),
            Conn::TlsServer { tls, .. } => tls.wants_write(),
        }
    }

    pub fn tcp(&mut self) -> &mut TcpStream {
        match self {
            Conn::Plain(tcp) => tcp,
            Conn::Tls { tcp, .. } | Conn::TlsServer { tcp, .. } => tcp,
        }
    }

    /// Queues a TLS close_notify alert (nothing for plain TCP); `flush` sends it. Sent before
    /// shutting down our side so the peer can tell a complete response from a truncated one.
    pub fn send_close_notify(&mut self) {
        match self {
            Conn::Plain(_) => {}
            Conn::Tls { tls, .. } => tls.send_close_notify(),
            Conn::TlsServer { tls, .. } => tls.send_close_notify(),
        }
    }

    /// Writes as much of `pending` as the socket takes, removing what was written.
    pub fn flush(&mut self, pending: &mut Vec<u8>) -> io::Result<()> {
        match self {
            Conn::Plain(tcp) => flush_plain(tcp, pending),
            Conn::Tls { tcp, tls } => flush_tls(tcp, tls, pending),
            Conn::TlsServer { tcp, tls } => flush_tls(tcp, tls, pending),
        }
    }

    /// Reads until `WouldBlock`, EOF or about `budget` bytes, appending plaintext to `out`.
    /// Plain TCP stops at exactly `budget`; TLS may overshoot by what rustls has already
    /// decrypted (bounded by its buffer limit), because plaintext left inside rustls would
    /// get no readiness event of its own.
    pub fn drain_read_upto(&mut self, out: &mut Vec<u8>, budget: usize) -> io::Result<ReadStatus> {
        let mut sink = Append {
            out,
            buf: [0u8; 16 * 1024],
        };
        self.read_into(&mut sink, budget)
    }

    /// `drain_read_upto` into any `Sink` (a `ReadBuf` takes the bytes without a copy).
    pub fn read_into(&mut self, out: &mut impl Sink, budget: usize) -> io::Result<ReadStatus> {
        let mut status = ReadStatus {
            n_bytes: 0,
            eof: false,
            more: false,
        };
        match self {
            Conn::Plain(tcp) => return read_plain_into(tcp, out, budget),
            Conn::Tls { tcp, tls } => drain_read_tls(tcp, tls, out, budget, &mut status)?,
            Conn::TlsServer { tcp, tls } => drain_read_tls(tcp, tls, out, budget, &mut status)?,
        }
        Ok(status)
    }
}

/// Writes as much of `pending` to a non-blocking plain stream (TCP, or a Unix socket) as it
/// takes, removing what was written.
pub(crate) fn flush_plain(stream: &mut impl Write, pending: &mut Vec<u8>) -> io::Result<()> {
    while !pending.is_empty() {
        match stream.write(pending) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => {
                pending.drain(..n);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Where a read puts its bytes: a `Vec` it appends to (through a stack buffer) or a
/// `ReadBuf` read into directly.
pub trait Sink {
    /// Room for the next read; not empty.
    fn room(&mut self) -> &mut [u8];
    /// The first `n` bytes of the last `room` were filled.
    fn filled(&mut self, n: usize);
}

/// Appends to a `Vec` through one stack buffer per call: the `Vec` grows only by what
/// arrived, which keeps many idle connections' buffers small.
struct Append<'a> {
    out: &'a mut Vec<u8>,
    buf: [u8; 16 * 1024],
}

impl Sink for Append<'_> {
    fn room(&mut self) -> &mut [u8] {
        &mut self.buf
    }

    fn filled(&mut self, n: usize) {
        self.out
            .extend_from_slice(self.buf.get(..n).unwrap_or_default());
    }
}

/// First size of a `ReadBuf`: one allocation holds a typical read of a model stream (SSE
/// events of a few hundred bytes each), so a stream's first reads do not walk a chain of
/// reallocations; a thousand streams at once hold 8 MiB. Larger reads double it.
const READ_BUF_FIRST: usize = 8 * 1024;
/// A read is offered at least this much room; less, and the unread bytes move to the front
/// (or the buffer doubles) first.
const READ_BUF_MIN_ROOM: usize = 2 * 1024;

/// An input buffer sockets read into directly: the bytes not yet used are `buf[start..end]`.
/// Room past `end` is zeroed once, when the buffer grows, never per read; using bytes moves
/// `start`, not the bytes, and only the unused tail ever moves (when room runs out). Nothing
/// is allocated until the first read.
#[derive(Default)]
pub struct ReadBuf {
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

impl ReadBuf {
    pub fn new() -> ReadBuf {
        ReadBuf::default()
    }

    /// The bytes read and not yet consumed.
    pub fn data(&self) -> &[u8] {
        self.buf.get(self.start..self.end).unwrap_or_default()
    }

    pub fn is_empty(&self) -> bool {
        self.start >= self.end
    }

    /// Marks the first `n` bytes of `data` used.
    pub fn consume(&mut self, n: usize) {
        self.start = self.start.saturating_add(n).min(self.end);
        if self.start == self.end {
            // Everything used: the next read starts at the front, nothing moves.
            self.start = 0;
            self.end = 0;
        }
    }

    /// Forgets every byte, keeping the capacity.
    pub fn clear(&mut self) {
        self.start = 0;
        self.end = 0;
    }
}

impl Sink for ReadBuf {
    fn room(&mut self) -> &mut [u8] {
        if self.buf.len().saturating_sub(self.end) < READ_BUF_MIN_ROOM {
            if self.start > 0 {
                self.buf.copy_within(self.start..self.end, 0);
                self.end -= self.start;
                self.start = 0;
            }
            if self.buf.len().saturating_sub(self.end) < READ_BUF_MIN_ROOM {
                let grown = (self.buf.len() * 2)
                    .max(READ_BUF_FIRST)
                    .max(self.end + READ_BUF_MIN_ROOM);
                self.buf.resize(grown, 0);
            }
        }
        self.buf.get_mut(self.end..).unwrap_or_default()
    }

    fn filled(&mut self, n: usize) {
        self.end = self.end.saturating_add(n).min(self.buf.len());
    }
}

/// Reads a non-blocking plain stream (TCP, or a Unix socket) until `WouldBlock`, EOF or
/// exactly `budget` bytes, appending to `out`.
pub(crate) fn drain_read_plain(
    stream: &mut impl Read,
    out: &mut Vec<u8>,
    budget: usize,
) -> io::Result<ReadStatus> {
    let mut sink = Append {
        out,
        buf: [0u8; 16 * 1024],
    };
    read_plain_into(stream, &mut sink, budget)
}

/// `drain_read_plain` into any `Sink`.
pub(crate) fn read_plain_into(
    stream: &mut impl Read,
    sink: &mut impl Sink,
    budget: usize,
) -> io::Result<ReadStatus> {
    let mut status = ReadStatus {
        n_bytes: 0,
        eof: false,
        more: false,
    };
    loop {
        let left = budget.saturating_sub(status.n_bytes);
        if left == 0 {
            status.more = true;
            return Ok(status);
        }
        let room = sink.room();
        let end = left.min(room.len());
        let window = room.get_mut(..end).unwrap_or_default();
        match stream.read(window) {
            Ok(0) => {
                status.eof = true;
                return Ok(status);
            }
            Ok(n) => {
                sink.filled(n);
                status.n_bytes += n;
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(status),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
}

/// The TLS half of `Conn::flush`, for either side of the handshake.
///
/// rustls takes at most 64 KiB at a time (its plaintext buffer during the handshake, its
/// record buffer after), so feed it and drain it to the socket in turns until the socket
/// would block or everything is out. Stopping after one round without a `WouldBlock` would
/// strand the rest of a large message: with edge-triggered readiness no new writable event
/// comes for a socket that never filled up.
fn flush_tls<D>(
    tcp: &mut TcpStream,
    tls: &mut ConnectionCommon<D>,
    pending: &mut Vec<u8>,
) -> io::Result<()> {
    loop {
        while tls.wants_write() {
            match tls.write_tls(tcp) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
        if pending.is_empty() {
            return Ok(());
        }
        let n = tls.writer().write(pending)?;
        if n == 0 {
            // Still handshaking with the plaintext buffer full: the rest goes once the
            // handshake completes (the caller flushes again after reading).
            return Ok(());
        }
        pending.drain(..n);
    }
}

/// The TLS half of `Conn::drain_read_upto`, for either side of the handshake.
fn drain_read_tls<D>(
    tcp: &mut TcpStream,
    tls: &mut ConnectionCommon<D>,
    out: &mut impl Sink,
    budget: usize,
    status: &mut ReadStatus,
) -> io::Result<()> {
    loop {
        if status.n_bytes >= budget {
            status.more = true;
            return Ok(());
        }
        let tcp_eof = match tls.read_tls(tcp) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                drain_plaintext(tls, out, status)?;
                // Handshake replies and alerts must go out even if the caller has nothing
                // to write; a write error resurfaces on the next flush.
                while tls.wants_write() {
                    match tls.write_tls(tcp) {
                        Ok(n) if n > 0 => {}
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        _ => break,
                    }
                }
                return Ok(());
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if let Err(err) = tls.process_new_packets() {
            // Last gasp: try to tell the peer why before we drop the connection.
            let _ = tls.write_tls(tcp);
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("tls: {err}"),
            ));
        }
        drain_plaintext(tls, out, status)?;
        if tcp_eof {
            status.eof = true;
            return Ok(());
        }
    }
}

fn drain_plaintext<D>(
    tls: &mut ConnectionCommon<D>,
    out: &mut impl Sink,
    status: &mut ReadStatus,
) -> io::Result<()> {
    loop {
        match tls.reader().read(out.room()) {
            Ok(0) => {
                status.eof = true;
                return Ok(());
            }
            Ok(n) => {
                out.filled(n);
                status.n_bytes += n;
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
            // The peer closed without close_notify. Whether that truncated anything is the
            // framing layer's call (chunked and content-length bodies know).
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                status.eof = true;
                return Ok(());
            }
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_buf_reads_in_place_and_moves_only_what_is_unread() {
        let mut buf = ReadBuf::new();
        assert!(buf.is_empty());
        let mut src: &[u8] = b"HTTP/1.1 200 OK\r\n\r\nbody";
        let status = read_plain_into(&mut src, &mut buf, 1024).expect("read");
        assert_eq!(status.n_bytes, 23);
        assert!(status.eof);
        assert_eq!(buf.data(), b"HTTP/1.1 200 OK\r\n\r\nbody");
        buf.consume(19);
        assert_eq!(buf.data(), b"body");
        // Using everything rewinds to the front: nothing moves, nothing grows.
        buf.consume(4);
        assert!(buf.is_empty());
        let first = buf.buf.len();
        assert_eq!(first, READ_BUF_FIRST);
        // Fill to leave less than the minimum room with one byte unread: the byte moves to
        // the front instead of the buffer growing.
        let big = vec![7u8; first - READ_BUF_MIN_ROOM + 1];
        let mut src: &[u8] = &big;
        read_plain_into(&mut src, &mut buf, big.len()).expect("read");
        buf.consume(big.len() - 1);
        assert_eq!(buf.room().len(), first - 1);
        assert_eq!(buf.data(), [7]);
        // More than fits unread: it doubles, keeping every byte.
        let more = vec![9u8; 3 * first];
        let mut src: &[u8] = &more;
        let status = read_plain_into(&mut src, &mut buf, usize::MAX).expect("read");
        assert_eq!(status.n_bytes, more.len());
        assert_eq!(buf.data().len(), 1 + more.len());
        assert!(buf.data()[1..].iter().all(|b| *b == 9));
        // The budget stops a read exactly.
        let mut buf = ReadBuf::new();
        let mut src: &[u8] = b"0123456789";
        let status = read_plain_into(&mut src, &mut buf, 4).expect("read");
        assert_eq!((status.n_bytes, status.more), (4, true));
        assert_eq!(buf.data(), b"0123");
    }
}
