//! Loopback servers for the TLS and proxy paths: a TLS-terminating relay serving
//! `tests/fixtures/server.pem` that pipes plaintext on (to `caliban stub-model`, say), and
//! a CONNECT proxy, each a thread of the test.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustls::ServerConnection;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use super::http::fixture;

/// How long a relay or proxy connection may live; far beyond any test, short of forever.
const CONN_LIFETIME: Duration = Duration::from_secs(90);
/// How long a socket read in the relay waits before it looks at the other direction.
const POLL: Duration = Duration::from_millis(5);

fn would_block(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
    )
}

/// A loopback listener whose accept loop runs on its own thread until drop.
pub struct Server {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    /// Heads of what each accepted connection asked for (the proxy records its CONNECTs);
    /// the relay records one `accepted` entry per connection.
    seen: Arc<Mutex<Vec<String>>>,
}

impl Server {
    fn start<F>(handle: F) -> Server
    where
        F: Fn(TcpStream, &Mutex<Vec<String>>) + Send + Sync + 'static,
    {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("local addr");
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let handle = Arc::new(handle);
        let (stop2, seen2) = (Arc::clone(&stop), Arc::clone(&seen));
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if stop2.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(conn) = conn else { continue };
                let (handle, seen) = (Arc::clone(&handle), Arc::clone(&seen2));
                std::thread::spawn(move || (*handle)(conn, &seen));
            }
        });
        Server { addr, stop, seen }
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    pub fn seen(&self) -> Vec<String> {
        self.seen.lock().expect("seen lock").clone()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the blocking accept so the thread sees the flag.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
    }
}

pub fn server_config() -> Arc<rustls::ServerConfig> {
    server_config_for(rustls::DEFAULT_VERSIONS, 2)
}

/// The fixture identity with the given protocol versions and number of TLS 1.3 session
/// tickets (tickets are the server's last handshake-time bytes; with none, nothing wakes
/// the client after its own Finished).
pub fn server_config_for(
    versions: &[&'static rustls::SupportedProtocolVersion],
    tickets: usize,
) -> Arc<rustls::ServerConfig> {
    let certs = CertificateDer::pem_file_iter(fixture("server.pem"))
        .expect("open server.pem")
        .collect::<Result<Vec<_>, _>>()
        .expect("parse server.pem");
    let key = PrivateKeyDer::from_pem_file(fixture("server-key.pem")).expect("server-key.pem");
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_protocol_versions(versions)
    .expect("protocol versions")
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .expect("server cert and key");
    let mut config = config;
    config.send_tls13_tickets = tickets;
    Arc::new(config)
}

/// A TLS-terminating relay: accepts TLS with the fixture server cert and pipes the plaintext
/// both ways to `upstream` (the stub's plain port). Records `accepted` per connection and
/// `tls error: …` when a handshake fails.
pub fn tls_relay(upstream: SocketAddr) -> Server {
    tls_relay_with(upstream, server_config())
}

pub fn tls_relay_with(upstream: SocketAddr, config: Arc<rustls::ServerConfig>) -> Server {
    Server::start(move |tcp, seen| {
        seen.lock().expect("seen lock").push("accepted".to_owned());
        if let Err(e) = relay(tcp, Arc::clone(&config), upstream) {
            seen.lock()
                .expect("seen lock")
                .push(format!("tls error: {e}"));
        }
    })
}

/// One relayed connection, single-threaded: short read timeouts on both sockets let one loop
/// serve both directions without splitting the rustls state.
pub fn relay(
    mut tcp: TcpStream,
    config: Arc<rustls::ServerConfig>,
    upstream: SocketAddr,
) -> Result<(), String> {
    let mut tls = ServerConnection::new(config).map_err(|e| e.to_string())?;
    // The relay may hold a whole response while the client is busy writing; never refuse it.
    tls.set_buffer_limit(None);
    let mut up = TcpStream::connect(upstream).map_err(|e| format!("upstream: {e}"))?;
    for s in [&tcp, &up] {
        s.set_read_timeout(Some(POLL)).map_err(|e| e.to_string())?;
        s.set_write_timeout(Some(CONN_LIFETIME))
            .map_err(|e| e.to_string())?;
    }
    let deadline = Instant::now() + CONN_LIFETIME;
    let mut buf = vec![0u8; 64 * 1024];
    while Instant::now() < deadline {
        // Client → relay: TLS records in, plaintext out to the stub.
        match tls.read_tls(&mut tcp) {
            Ok(0) => {
                let _ = up.shutdown(Shutdown::Write);
                return Ok(());
            }
            Ok(_) => {
                if let Err(e) = tls.process_new_packets() {
                    // Send our alert, then report why the handshake or stream failed.
                    let _ = tls.write_tls(&mut tcp);
                    return Err(e.to_string());
                }
            }
            Err(e) if would_block(&e) => {}
            Err(e) => return Err(format!("client read: {e}")),
        }
        loop {
            match tls.reader().read(&mut buf) {
                Ok(0) => {
                    let _ = up.shutdown(Shutdown::Write);
                    break;
                }
                Ok(n) => up
                    .write_all(&buf[..n])
                    .map_err(|e| format!("upstream write: {e}"))?,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(format!("plaintext read: {e}")),
            }
        }
        // Stub → relay: plaintext in, TLS records out to the client.
        if !tls.is_handshaking() {
            match up.read(&mut buf) {
                Ok(0) => {
                    tls.send_close_notify();
                    while tls.wants_write() {
                        if tls.write_tls(&mut tcp).is_err() {
                            break;
                        }
                    }
                    return Ok(());
                }
                Ok(n) => tls
                    .writer()
                    .write_all(&buf[..n])
                    .map_err(|e| format!("tls write: {e}"))?,
                Err(e) if would_block(&e) => {}
                Err(e) => return Err(format!("upstream read: {e}")),
            }
        }
        while tls.wants_write() {
            tls.write_tls(&mut tcp)
                .map_err(|e| format!("client write: {e}"))?;
        }
    }
    Err("relay connection outlived its deadline".to_owned())
}

/// What the test proxy answers to CONNECT.
#[derive(Clone, Copy)]
pub enum ProxyMode {
    Tunnel,
    /// Tunnel to this address whatever the CONNECT named (for targets this host lacks).
    TunnelTo(SocketAddr),
    Refuse(&'static str),
}

/// An HTTP proxy that understands only CONNECT: records each request head's first line, then
/// either tunnels to the named authority or answers with a refusal status line.
pub fn connect_proxy(mode: ProxyMode) -> Server {
    Server::start(move |mut client, seen| {
        let Some(head) = read_head(&mut client) else {
            return;
        };
        let first = head.lines().next().unwrap_or_default().to_owned();
        seen.lock().expect("seen lock").push(first.clone());
        let status = match mode {
            ProxyMode::Refuse(status) => status,
            ProxyMode::Tunnel | ProxyMode::TunnelTo(_) => {
                let authority = match first.split(' ').collect::<Vec<_>>()[..] {
                    ["CONNECT", authority, _] => authority.to_owned(),
                    _ => {
                        let _ = client.write_all(
                            b"HTTP/1.1 405 Method Not Allowed\r\nContent-Length: 0\r\n\r\n",
                        );
                        return;
                    }
                };
                let upstream = match mode {
                    ProxyMode::TunnelTo(addr) => TcpStream::connect(addr),
                    _ => TcpStream::connect(&authority),
                };
                match upstream {
                    Ok(upstream) => {
                        if client
                            .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
                            .is_ok()
                        {
                            splice(client, upstream);
                        }
                        return;
                    }
                    Err(_) => "502 Bad Gateway",
                }
            }
        };
        let body = "proxy says no";
        let _ = write!(
            client,
            "HTTP/1.1 {status}\r\nProxy-Authenticate: Basic realm=\"test\"\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
    })
}

/// Reads a request head byte by byte (so no tunnelled byte is consumed), with a deadline.
fn read_head(stream: &mut TcpStream) -> Option<String> {
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .ok()?;
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if head.len() > 16 * 1024 || stream.read(&mut byte).ok()? == 0 {
            return None;
        }
        head.push(byte[0]);
    }
    stream.set_read_timeout(None).ok()?;
    Some(String::from_utf8_lossy(&head).into_owned())
}

/// Copies both ways until each side has closed its half.
fn splice(a: TcpStream, b: TcpStream) {
    let (Ok(a2), Ok(b2)) = (a.try_clone(), b.try_clone()) else {
        return;
    };
    let pipe = |mut from: TcpStream, mut to: TcpStream| {
        let _ = from.set_read_timeout(Some(CONN_LIFETIME));
        let _ = io::copy(&mut from, &mut to);
        let _ = to.shutdown(Shutdown::Write);
    };
    let forward = std::thread::spawn(move || pipe(a, b2));
    pipe(b, a2);
    let _ = forward.join();
}
