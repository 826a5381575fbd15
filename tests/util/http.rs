//! Harness for `caliban http serve`: the real server on a free loopback port (killed on
//! drop, restartable on the same workspace and state directory), and a small hand-rolled
//! HTTP/1.1 client — plain or TLS — with a deadline on every read: whole responses
//! (Content-Length, chunked or close-delimited), and `Follow`, a reader for `follow=1`
//! streams that yields one NDJSON line or one SSE event at a time and can be dropped
//! mid-stream to act as a client that vanished.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::*;

/// How long the server may take to print its listening line.
pub const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long any single read of a response may wait.
pub const IO_TIMEOUT: Duration = Duration::from_secs(15);
/// How long `Follow::next_line` / `next_sse` wait for the next item.
pub const RECV_TIMEOUT: Duration = Duration::from_secs(15);

const BANNER: &str = "caliban http serve listening on ";

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// The `caliban http serve` command `Serve::start` runs: the sanitised environment of
/// `util::caliban`, the Anthropic wire pointed at `stub`, `--addr 127.0.0.1:0 -C <ws>`.
pub fn serve_command(
    ws: &Workspace,
    stub: &Stub,
    extra_args: &[&str],
    extra_env: &[(&str, &str)],
) -> Command {
    let mut cmd = caliban_stub(ws, stub, &["http", "serve", "--addr", "127.0.0.1:0", "-C"]);
    cmd.arg(&ws.root)
        .args(extra_args)
        .envs(extra_env.iter().copied());
    cmd
}

/// A running `caliban http serve`; SIGKILLed on drop.
pub struct Serve {
    child: Child,
    pub addr: SocketAddr,
    /// `http` or `https`, as the listening line said.
    pub scheme: String,
    stderr: StderrLog,
    args: Vec<String>,
    env: Vec<(String, String)>,
}

impl Serve {
    pub fn start(
        ws: &Workspace,
        stub: &Stub,
        extra_args: &[&str],
        extra_env: &[(&str, &str)],
    ) -> Serve {
        let mut serve = Serve::spawn(serve_command(ws, stub, extra_args, extra_env));
        serve.args = extra_args.iter().map(|s| s.to_string()).collect();
        serve.env = extra_env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        serve
    }

    /// Runs `cmd`, which ends in `caliban http serve …` (it may be wrapped, as in a chroot
    /// or a container), and waits for its listening line.
    pub fn spawn(mut cmd: Command) -> Serve {
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("spawn caliban http serve");
        let (tx, rx) = mpsc::channel();
        let log = StderrLog::start(
            child.stderr.take().expect("server stderr"),
            Some((BANNER, tx)),
        );
        let url = match rx.recv_timeout(START_TIMEOUT) {
            Ok(url) => url,
            Err(e) => {
                let _ = child.kill();
                let status = child.wait();
                // Give the reader a moment to collect the last lines.
                std::thread::sleep(Duration::from_millis(50));
                panic!(
                    "caliban http serve did not print its listening line ({e:?}, {status:?}); \
                     stderr:\n{}",
                    log.text()
                );
            }
        };
        let (scheme, hostport) = url
            .split_once("://")
            .unwrap_or_else(|| panic!("unexpected listening line: {url:?}"));
        let addr: SocketAddr = hostport
            .parse()
            .unwrap_or_else(|e| panic!("bad address in listening line {url:?}: {e}"));
        Serve {
            child,
            addr,
            scheme: scheme.to_owned(),
            stderr: log,
            args: Vec::new(),
            env: Vec::new(),
        }
    }

    /// Everything the server wrote on stderr so far.
    pub fn stderr(&self) -> String {
        self.stderr.text()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL: the server gets no chance to write anything more.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, then waits (with a deadline) for the exit; returns the exit code.
    pub fn terminate(&mut self) -> Option<i32> {
        Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("run kill");
        match wait_for_exit(&mut self.child, Duration::from_secs(10)) {
            Some(status) => status.code(),
            None => {
                self.kill();
                panic!(
                    "caliban http serve did not exit within 10 s of SIGTERM; stderr:\n{}",
                    self.stderr()
                );
            }
        }
    }

    /// Kills this server (if it still runs) and starts a new one with the same arguments and
    /// environment on the same workspace, so the same session directory.
    pub fn restart(&mut self, ws: &Workspace, stub: &Stub) {
        self.kill();
        let args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        let env: Vec<(&str, &str)> = self
            .env
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        *self = Serve::start(ws, stub, &args, &env);
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        self.kill();
    }
}

// ---- the client -----------------------------------------------------------------------------

pub struct Response {
    pub status: u16,
    /// Header names lowercased, in order.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("response body is not JSON ({e}): {self:?}"))
    }
}

impl std::fmt::Debug for Response {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HTTP {} {:?} {}", self.status, self.headers, self.text())
    }
}

/// The bytes of one request. Adds `host`, and `content-length` when there is a body or
/// the method is POST/PUT.
pub fn request_bytes(method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let mut out = format!("{method} {path} HTTP/1.1\r\nhost: localhost\r\n");
    for (k, v) in headers {
        out.push_str(&format!("{k}: {v}\r\n"));
    }
    if !body.is_empty() || matches!(method, "POST" | "PUT" | "PATCH") {
        out.push_str(&format!("content-length: {}\r\n", body.len()));
    }
    out.push_str("\r\n");
    let mut out = out.into_bytes();
    out.extend_from_slice(body);
    out
}

trait Stream: Read + Write + Send {}
impl<T: Read + Write + Send> Stream for T {}

fn timed_out(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// One client connection (keep-alive: any number of requests, pipelined or not).
pub struct HttpConn {
    stream: Box<dyn Stream>,
    /// The same socket, for setting read timeouts under a TLS stream.
    tcp: TcpStream,
    /// Bytes read and not yet consumed.
    buf: Vec<u8>,
    eof: bool,
}

impl HttpConn {
    pub fn connect(addr: SocketAddr) -> HttpConn {
        let tcp = TcpStream::connect_timeout(&addr, IO_TIMEOUT)
            .unwrap_or_else(|e| panic!("connect to {addr}: {e}"));
        tcp.set_nodelay(true).expect("nodelay");
        tcp.set_write_timeout(Some(IO_TIMEOUT))
            .expect("write timeout");
        let clone = tcp.try_clone().expect("clone socket");
        HttpConn {
            stream: Box::new(tcp),
            tcp: clone,
            buf: Vec::new(),
            eof: false,
        }
    }

    /// A TLS connection trusting only `ca` (a PEM file), checking the certificate against
    /// `server_name`.
    pub fn connect_tls(addr: SocketAddr, server_name: &str, ca: &std::path::Path) -> HttpConn {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, ServerName};
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_file_iter(ca).expect("open CA file") {
            roots.add(cert.expect("parse CA")).expect("add CA");
        }
        let config = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("protocol versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
        let name = ServerName::try_from(server_name.to_owned()).expect("server name");
        let tls = rustls::ClientConnection::new(Arc::new(config), name).expect("tls client");
        let plain = HttpConn::connect(addr);
        let tcp = plain.tcp.try_clone().expect("clone socket");
        let stream = rustls::StreamOwned::new(tls, plain.tcp);
        HttpConn {
            stream: Box::new(stream),
            tcp,
            buf: Vec::new(),
            eof: false,
        }
    }

    pub fn send_raw(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).expect("send request");
        self.stream.flush().expect("flush request");
    }

    pub fn send(&mut self, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) {
        self.send_raw(&request_bytes(method, path, headers, body));
    }

    /// Reads more bytes, waiting at most until `deadline`. Returns false on timeout; sets
    /// `eof` when the peer closed.
    fn fill(&mut self, deadline: Instant) -> bool {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        self.tcp
            .set_read_timeout(Some(left.max(Duration::from_millis(1))))
            .expect("read timeout");
        let mut chunk = [0u8; 64 * 1024];
        match self.stream.read(&mut chunk) {
            Ok(0) => {
                self.eof = true;
                true
            }
            Ok(n) => {
                self.buf.extend_from_slice(&chunk[..n]);
                true
            }
            Err(e) if timed_out(&e) || e.kind() == ErrorKind::Interrupted => {
                Instant::now() < deadline
            }
            // A reset or a TLS close without close_notify: treat as the end.
            Err(_) => {
                self.eof = true;
                true
            }
        }
    }

    fn fill_or_panic(&mut self, deadline: Instant, what: &str) {
        if !self.fill(deadline) {
            panic!(
                "timed out waiting for {what}; received so far: {:?}",
                String::from_utf8_lossy(&self.buf)
            );
        }
    }

    /// Reads a response head: status and lowercased headers.
    pub fn read_head(&mut self) -> (u16, Vec<(String, String)>) {
        let deadline = Instant::now() + IO_TIMEOUT;
        let end = loop {
            if let Some(at) = find(&self.buf, b"\r\n\r\n") {
                break at;
            }
            assert!(
                !self.eof,
                "connection closed before a response head; got {:?}",
                String::from_utf8_lossy(&self.buf)
            );
            self.fill_or_panic(deadline, "a response head");
        };
        let head = String::from_utf8_lossy(&self.buf[..end]).into_owned();
        self.buf.drain(..end + 4);
        let mut lines = head.split("\r\n");
        let status_line = lines.next().unwrap_or_default();
        let mut parts = status_line.splitn(3, ' ');
        let version = parts.next().unwrap_or_default();
        assert!(
            version.starts_with("HTTP/1."),
            "bad status line {status_line:?}"
        );
        let status: u16 = parts
            .next()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("bad status line {status_line:?}"));
        let headers = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
            .collect();
        (status, headers)
    }

    /// Reads one whole response (not for HEAD requests).
    pub fn read_response(&mut self) -> Response {
        let (status, headers) = self.read_head();
        let get = |name: &str| {
            headers
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v): &(String, String)| v.clone())
        };
        let deadline = Instant::now() + IO_TIMEOUT;
        let body = if get("transfer-encoding").is_some_and(|t| t.contains("chunked")) {
            let mut decoder = Dechunker::default();
            loop {
                decoder.feed(&mut self.buf);
                if decoder.done {
                    break decoder.out;
                }
                assert!(!self.eof, "connection closed inside a chunked body");
                self.fill_or_panic(deadline, "a chunked body");
            }
        } else if let Some(len) = get("content-length") {
            let len: usize = len.parse().expect("content-length");
            while self.buf.len() < len {
                assert!(!self.eof, "connection closed inside a body");
                self.fill_or_panic(deadline, "a response body");
            }
            self.buf.drain(..len).collect()
        } else if status == 204 || status == 304 || (100..200).contains(&status) {
            Vec::new()
        } else {
            while !self.eof {
                self.fill_or_panic(deadline, "a close-delimited body");
            }
            std::mem::take(&mut self.buf)
        };
        Response {
            status,
            headers,
            body,
        }
    }

    pub fn request(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Response {
        self.send(method, path, headers, body);
        self.read_response()
    }

    /// Whether the peer has closed the connection (reading at most until `deadline`).
    pub fn closed_by_peer(&mut self, deadline: Instant) -> bool {
        while !self.eof {
            if !self.fill(deadline) {
                return false;
            }
        }
        true
    }
}

/// A TCP connection to `addr` from the local address `from` (port chosen by the kernel). All
/// of 127.0.0.0/8 is loopback, so a test can be several peers without leaving the machine.
pub fn connect_from(from: std::net::Ipv4Addr, addr: SocketAddr) -> TcpStream {
    use std::os::fd::FromRawFd;
    let SocketAddr::V4(to) = addr else {
        panic!("connect_from takes an IPv4 address, not {addr}");
    };
    let sockaddr = |ip: std::net::Ipv4Addr, port: u16| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(ip).to_be(),
        },
        sin_zero: [0; 8],
    };
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: plain socket(2); the descriptor is owned by the TcpStream made below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
    // SAFETY: `fd` is a fresh socket we own; from here on the TcpStream closes it.
    let stream = unsafe { TcpStream::from_raw_fd(fd) };
    let local = sockaddr(from, 0);
    // SAFETY: `local` is a live sockaddr_in and `len` is its size.
    let rc = unsafe { libc::bind(fd, (&local as *const libc::sockaddr_in).cast(), len) };
    assert_eq!(rc, 0, "bind {from}: {}", std::io::Error::last_os_error());
    let remote = sockaddr(*to.ip(), to.port());
    // SAFETY: `remote` is a live sockaddr_in and `len` is its size; a blocking connect to
    // loopback completes (or fails) at once.
    let rc = unsafe { libc::connect(fd, (&remote as *const libc::sockaddr_in).cast(), len) };
    assert_eq!(
        rc,
        0,
        "connect {from} → {addr}: {}",
        std::io::Error::last_os_error()
    );
    stream.set_nodelay(true).expect("nodelay");
    stream
        .set_write_timeout(Some(IO_TIMEOUT))
        .expect("write timeout");
    stream
}

/// One request on a fresh connection.
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Response {
    HttpConn::connect(addr).request(method, path, headers, body)
}

/// `GET path` on a fresh connection.
pub fn get(addr: SocketAddr, path: &str) -> Response {
    request(addr, "GET", path, &[], b"")
}

/// `POST path` with a JSON body on a fresh connection.
pub fn post_json(addr: SocketAddr, path: &str, body: &Value) -> Response {
    request(
        addr,
        "POST",
        path,
        &[("content-type", "application/json")],
        body.to_string().as_bytes(),
    )
}

/// Incremental chunked-body decoder.
#[derive(Default)]
struct Dechunker {
    /// Bytes of the current chunk still to come (`None`: expecting a size line).
    remaining: Option<usize>,
    in_trailers: bool,
    pub done: bool,
    pub out: Vec<u8>,
}

impl Dechunker {
    /// Consumes what it can from `raw`.
    fn feed(&mut self, raw: &mut Vec<u8>) {
        loop {
            if self.done {
                return;
            }
            if self.in_trailers {
                let Some(at) = find(raw, b"\r\n") else { return };
                raw.drain(..at + 2);
                if at == 0 {
                    self.done = true;
                }
                continue;
            }
            match self.remaining {
                None => {
                    let Some(at) = find(raw, b"\r\n") else { return };
                    let line = String::from_utf8_lossy(&raw[..at]).into_owned();
                    let size = line.split(';').next().unwrap_or("").trim();
                    let size = usize::from_str_radix(size, 16)
                        .unwrap_or_else(|e| panic!("bad chunk size line {line:?}: {e}"));
                    raw.drain(..at + 2);
                    if size == 0 {
                        self.in_trailers = true;
                    } else {
                        self.remaining = Some(size);
                    }
                }
                Some(n) => {
                    if raw.len() < n + 2 {
                        return;
                    }
                    assert_eq!(&raw[n..n + 2], b"\r\n", "chunk not followed by CRLF");
                    self.out.extend_from_slice(&raw[..n]);
                    raw.drain(..n + 2);
                    self.remaining = None;
                }
            }
        }
    }
}

/// One SSE event.
#[derive(Clone, Debug, PartialEq)]
pub struct SseEvent {
    pub id: Option<String>,
    pub data: String,
}

impl SseEvent {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.data)
            .unwrap_or_else(|e| panic!("SSE data is not JSON ({e}): {:?}", self.data))
    }
}

/// A `follow=1` stream being read item by item. Dropping it closes the connection.
pub struct Follow {
    conn: HttpConn,
    pub status: u16,
    pub headers: Vec<(String, String)>,
    chunked: bool,
    dechunker: Dechunker,
    /// Decoded body bytes not yet handed out.
    decoded: Vec<u8>,
    /// How much of `decoded` is known not to hold a separator (long lines stay linear).
    scanned: usize,
}

impl Follow {
    /// Sends `GET path` and reads the head, which must be a 200 streaming response.
    pub fn open(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> Follow {
        let mut conn = HttpConn::connect(addr);
        conn.send("GET", path, headers, b"");
        let (status, headers) = conn.read_head();
        let chunked = headers
            .iter()
            .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"));
        assert!(
            status == 200 && chunked,
            "GET {path} did not start a chunked stream: {status} {headers:?} {:?}",
            String::from_utf8_lossy(&conn.buf)
        );
        Follow {
            conn,
            status,
            headers,
            chunked,
            dechunker: Dechunker::default(),
            decoded: Vec::new(),
            scanned: 0,
        }
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    fn decode(&mut self) {
        if self.chunked {
            self.dechunker.feed(&mut self.conn.buf);
            self.decoded.append(&mut self.dechunker.out);
        } else {
            self.decoded.append(&mut self.conn.buf);
        }
    }

    fn ended(&self) -> bool {
        if self.chunked {
            self.dechunker.done
        } else {
            self.conn.eof
        }
    }

    /// The next item ending in `sep`, `Ok(None)` at the end of the stream, `Err(())` when
    /// nothing complete arrived within `timeout`.
    fn next_item(&mut self, sep: &[u8], timeout: Duration) -> Result<Option<String>, ()> {
        let deadline = Instant::now() + timeout;
        loop {
            self.decode();
            let from = self.scanned.saturating_sub(sep.len() - 1);
            if let Some(at) = find(&self.decoded[from..], sep).map(|at| at + from) {
                self.scanned = 0;
                let item: Vec<u8> = self.decoded.drain(..at + sep.len()).collect();
                let text = String::from_utf8(item[..at].to_vec()).expect("stream is UTF-8");
                return Ok(Some(text));
            }
            self.scanned = self.decoded.len();
            if self.ended() {
                assert!(
                    self.decoded.iter().all(u8::is_ascii_whitespace),
                    "stream ended inside an item: {:?}",
                    String::from_utf8_lossy(&self.decoded)
                );
                return Ok(None);
            }
            assert!(
                !self.conn.eof,
                "connection closed before the stream's last chunk; pending {:?}",
                String::from_utf8_lossy(&self.decoded)
            );
            if !self.conn.fill(deadline) {
                return Err(());
            }
        }
    }

    /// The next raw item ending in `sep` (an NDJSON line, an SSE block, comments included),
    /// without the separator; `Ok(None)` at the end, `Err(())` on timeout.
    pub fn next_raw_within(&mut self, sep: &[u8], timeout: Duration) -> Result<Option<String>, ()> {
        self.next_item(sep, timeout)
    }

    /// The next NDJSON line, or `Ok(None)` at the end; `Err(())` on timeout.
    pub fn next_line_within(&mut self, timeout: Duration) -> Result<Option<Value>, ()> {
        Ok(self.next_item(b"\n", timeout)?.map(|line| {
            serde_json::from_str(&line)
                .unwrap_or_else(|e| panic!("stream line is not JSON ({e}): {line:?}"))
        }))
    }

    /// The next NDJSON line, or `None` at the end of the stream. Panics after `RECV_TIMEOUT`.
    pub fn next_line(&mut self) -> Option<Value> {
        self.next_line_within(RECV_TIMEOUT).unwrap_or_else(|()| {
            panic!("no stream line within {RECV_TIMEOUT:?}");
        })
    }

    /// Every remaining line up to the end of the stream.
    pub fn rest(&mut self) -> Vec<Value> {
        std::iter::from_fn(|| self.next_line()).collect()
    }

    /// The next SSE event, or `None` at the end. Panics after `RECV_TIMEOUT`.
    pub fn next_sse(&mut self) -> Option<SseEvent> {
        loop {
            let block = self
                .next_item(b"\n\n", RECV_TIMEOUT)
                .unwrap_or_else(|()| panic!("no SSE event within {RECV_TIMEOUT:?}"))?;
            let mut id = None;
            let mut data: Vec<&str> = Vec::new();
            for line in block.lines() {
                if line.starts_with(':') {
                    continue;
                }
                let (field, value) = line.split_once(':').unwrap_or((line, ""));
                let value = value.strip_prefix(' ').unwrap_or(value);
                match field {
                    "id" => id = Some(value.to_owned()),
                    "data" => data.push(value),
                    _ => {}
                }
            }
            // A comment-only block (a keep-alive) carries no event.
            if id.is_none() && data.is_empty() {
                continue;
            }
            return Some(SseEvent {
                id,
                data: data.join("\n"),
            });
        }
    }
}

// ---- runs over the HTTP API ------------------------------------------------------------------

/// The longest any condition polled for (`wait_for`) may take to become true.
const WAIT: Duration = Duration::from_secs(30);

pub fn start_run(addr: SocketAddr, body: Value) -> String {
    let resp = post_json(addr, "/runs", &body);
    assert_eq!(resp.status, 200, "{resp:?}");
    let id = resp.json()["run_id"]
        .as_str()
        .unwrap_or_else(|| panic!("no run_id in {resp:?}"))
        .to_owned();
    assert_eq!(resp.json(), json!({ "run_id": id }));
    id
}

/// One `GET /runs/:id/events?cursor=N` page, checked for upstream's shape: every event in
/// the `{"v":1,"event":…}` envelope, and `next_cursor`, `status` and `permission_request`
/// always present.
pub fn events_page(addr: SocketAddr, run: &str, cursor: u64) -> Value {
    let resp = get(addr, &format!("/runs/{run}/events?cursor={cursor}"));
    assert_eq!(resp.status, 200, "{resp:?}");
    let page = resp.json();
    let obj = page.as_object().expect("events page is an object");
    let mut keys: Vec<&str> = obj.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        ["events", "next_cursor", "permission_request", "status"],
        "{page}"
    );
    for env in page["events"].as_array().expect("events array") {
        let env = env.as_object().expect("envelope object");
        assert_eq!(env.len(), 2, "{env:?}");
        assert_eq!(env["v"], 1, "{env:?}");
        assert!(env["event"]["type"].is_string(), "{env:?}");
    }
    assert!(page["next_cursor"].is_u64(), "{page}");
    assert!(page["status"]["state"].is_string(), "{page}");
    page
}

/// Every event of the run so far, polled page by page from cursor 0.
pub fn all_events(addr: SocketAddr, run: &str) -> Vec<Value> {
    let mut out = Vec::new();
    loop {
        let page = events_page(addr, run, out.len() as u64);
        let batch = page["events"].as_array().expect("events").clone();
        if batch.is_empty() {
            assert_eq!(page["next_cursor"], out.len() as u64, "{page}");
            return out;
        }
        out.extend(batch.into_iter().map(|e| e["event"].clone()));
        assert_eq!(page["next_cursor"], out.len() as u64, "{page}");
    }
}

pub fn wait_for<T>(what: &str, mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(value) = check() {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub fn status_of(addr: SocketAddr, run: &str) -> Value {
    let resp = get(addr, &format!("/runs/{run}/status"));
    assert_eq!(resp.status, 200, "{resp:?}");
    let body = resp.json();
    assert_eq!(body.as_object().map(|o| o.len()), Some(1), "{body}");
    body["status"].clone()
}

pub fn wait_state(addr: SocketAddr, run: &str, state: &str) -> Value {
    wait_for(&format!("{run} to be {state}"), || {
        let status = status_of(addr, run);
        (status["state"] == state).then_some(status)
    })
}

pub fn is_terminal(status: &Value) -> bool {
    status["state"] == "done" || status["state"] == "failed"
}

pub fn wait_terminal(addr: SocketAddr, run: &str) -> Value {
    wait_for(&format!("{run} to end"), || {
        let status = status_of(addr, run);
        is_terminal(&status).then_some(status)
    })
}

/// Waits until the run surfaces a permission prompt, and returns it.
pub fn wait_prompt(addr: SocketAddr, run: &str) -> Value {
    wait_for(&format!("a permission prompt on {run}"), || {
        let page = events_page(addr, run, u64::MAX);
        assert!(
            !is_terminal(&page["status"]),
            "{run} ended while a prompt was awaited: {page}"
        );
        let prompt = page["permission_request"].clone();
        (!prompt.is_null()).then_some(prompt)
    })
}

pub fn tool_end<'a>(events: &'a [Value], id: &str) -> &'a Value {
    events
        .iter()
        .find(|e| e["type"] == "ToolCallEnd" && e["tool_use_id"] == id)
        .unwrap_or_else(|| panic!("no ToolCallEnd for {id} in {events:#?}"))
}

/// Where the session file of `run` lies, under the workspace's state dir.
pub fn session_file(ws: &Workspace, run: &str) -> std::path::PathBuf {
    ws.path(&format!("home/.state/caliban/sessions/{run}.jsonl"))
}
