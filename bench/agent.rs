//! `caliban agent serve` figures, run with `cargo bench --bench agent`: how long a client
//! takes from `connect` to its first event (TCP, the TLS handshake, the bearer preamble, the
//! replayed first `TurnEvent` line), side by side with a bare TCP connect and the same over a
//! Unix socket; and the memory of connected idle agents (each its
//! own process, as a supervisor runs them: one run that finished its first turn and waits
//! for input, one client connected and quiet). Everything on loopback against
//! `caliban stub-model`; the certificates are made with `openssl`. Medians (p90) of
//! `BENCH_ROUNDS` rounds (default 300), all rows measured in one run.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::{ClientConfig, ClientConnection, RootCertStore, StreamOwned};

#[path = "common.rs"]
mod common;

const BIN: &str = env!("CARGO_BIN_EXE_caliban");
const TOKEN: &str = "bench-token";
/// Agents started for the memory figure.
const AGENTS: usize = 10;

/// Resident memory: `VmRSS` (all of it, code pages of the binary included) or `RssAnon`
/// (heap and stacks only).
fn rss_kib(pid: u32) -> u64 {
    status_kib(pid, "VmRSS:")
}

fn anon_kib(pid: u32) -> u64 {
    status_kib(pid, "RssAnon:")
}

fn status_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

fn openssl(dir: &Path, args: &[&str]) {
    let status = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("openssl is needed for the certificates");
    assert!(status.success(), "openssl {args:?}");
}

/// A CA and a `localhost` certificate it signed, in `dir`.
fn certificates(dir: &Path) {
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
    ];
    let mut ca = vec!["req", "-x509"];
    ca.extend(ec);
    ca.extend([
        "-keyout",
        "ca-key.pem",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=bench CA",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
    ]);
    openssl(dir, &ca);
    let mut csr = vec!["req", "-new"];
    csr.extend(ec);
    csr.extend([
        "-keyout",
        "key.pem",
        "-out",
        "s.csr",
        "-subj",
        "/CN=localhost",
    ]);
    openssl(dir, &csr);
    std::fs::write(
        dir.join("s.ext"),
        "subjectAltName=DNS:localhost,IP:127.0.0.1\n",
    )
    .expect("ext");
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "s.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca-key.pem",
            "-CAcreateserial",
            "-out",
            "cert.pem",
            "-days",
            "2",
            "-extfile",
            "s.ext",
        ],
    );
}

fn client_config(ca: &Path) -> Arc<ClientConfig> {
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(ca).expect("CA") {
        roots.add(cert.expect("cert")).expect("add");
    }
    Arc::new(
        ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_root_certificates(roots)
            .with_no_client_auth(),
    )
}

/// Starts an interactive ndjson agent; returns it and where it listens.
fn agent(dir: &Path, stub_url: &str, listen: &[&str], n: usize) -> (Child, String) {
    let mut child = Command::new(BIN)
        .env_clear()
        .env("ANTHROPIC_BASE_URL", stub_url)
        .env("HOME", dir)
        .env("XDG_STATE_HOME", dir.join(format!("state-{n}")))
        .env("CALIBAN_AGENT_TOKEN", TOKEN)
        .env("CALIBAN_AGENT_TLS_CERT", dir.join("cert.pem"))
        .env("CALIBAN_AGENT_TLS_KEY", dir.join("key.pem"))
        .env(
            "CALIBAN_AGENT_SPEC",
            r#"{"initial_prompt": "hello", "interactive": true}"#,
        )
        .args(["agent", "serve", "-C"])
        .arg(dir)
        .args(listen)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("agent");
    let mut stderr = child.stderr.take().expect("stderr");
    let mut banner = Vec::new();
    let mut byte = [0u8; 1];
    while stderr.read(&mut byte).expect("banner") == 1 && byte[0] != b'\n' {
        banner.push(byte[0]);
    }
    let banner = String::from_utf8_lossy(&banner).into_owned();
    let endpoint = banner.rsplit(' ').next().unwrap_or_default().to_owned();
    (child, endpoint)
}

fn tcp_addr(endpoint: &str) -> SocketAddr {
    endpoint.trim_start_matches("tls://").parse().expect("addr")
}

/// Reads until the first newline; the bytes read.
fn first_line(r: &mut impl Read) -> Vec<u8> {
    let mut line = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = r.read(&mut buf).expect("read");
        assert!(n > 0, "closed before a line");
        line.extend_from_slice(&buf[..n]);
        if line.contains(&b'\n') {
            return line;
        }
    }
}

/// Whether the first line read is the replayed `TurnStart`.
fn is_turn_start(bytes: &[u8]) -> bool {
    let line = bytes.split(|&b| b == b'\n').next().unwrap_or_default();
    String::from_utf8_lossy(line).contains("\"type\":\"TurnStart\"")
}

fn tls_stream(
    addr: SocketAddr,
    config: &Arc<ClientConfig>,
) -> StreamOwned<ClientConnection, TcpStream> {
    let tcp = TcpStream::connect(addr).expect("connect");
    tcp.set_nodelay(true).expect("nodelay");
    tcp.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let name = ServerName::try_from("localhost").expect("name");
    let conn = ClientConnection::new(Arc::clone(config), name).expect("client");
    let mut stream = StreamOwned::new(conn, tcp);
    while stream.conn.is_handshaking() {
        stream
            .conn
            .complete_io(&mut stream.sock)
            .expect("handshake");
    }
    stream
}

fn preamble() -> Vec<u8> {
    format!("{{\"bearer\":\"{TOKEN}\"}}\n").into_bytes()
}

struct Stats(Vec<Duration>);

impl Stats {
    fn row(&mut self, what: &str) {
        self.0.sort();
        let at = |p: usize| self.0[(self.0.len() * p / 100).min(self.0.len() - 1)];
        println!(
            "{what:<58} {:>9.3} ms  (p90 {:.3})",
            at(50).as_secs_f64() * 1e3,
            at(90).as_secs_f64() * 1e3
        );
    }
}

fn time(rounds: usize, mut f: impl FnMut()) -> Stats {
    for _ in 0..rounds / 10 {
        f();
    }
    Stats(
        (0..rounds)
            .map(|_| {
                let start = Instant::now();
                f();
                start.elapsed()
            })
            .collect(),
    )
}

fn main() {
    let rounds: usize = std::env::var("BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    let dir: PathBuf =
        std::env::temp_dir().join(format!("caliban-bench-agent-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    certificates(&dir);
    let script = dir.join("script.json");
    std::fs::write(
        &script,
        r#"{"turns":[{"text":"ready"}],"repeat_last":true}"#,
    )
    .expect("script");
    let (mut stub, stub_url) = common::start_stub(BIN, &script);
    let config = client_config(&dir.join("ca.pem"));

    let (mut tls_agent, endpoint) = agent(&dir, &stub_url, &["--listen", "127.0.0.1:0"], 0);
    let addr = tcp_addr(&endpoint);
    let socket = dir.join("agent.sock");
    let socket_arg = socket.display().to_string();
    let (mut unix_agent, _) = agent(&dir, &stub_url, &["--socket", &socket_arg], 1);
    // Both runs have streamed their first turn before the clock starts: the first line a
    // client gets is then always the replayed TurnStart.
    std::thread::sleep(Duration::from_millis(500));

    let mut floor = time(rounds, || {
        let tcp = TcpStream::connect(addr).expect("connect");
        drop(tcp);
    });
    let mut first_event = time(rounds, || {
        let mut stream = tls_stream(addr, &config);
        stream.write_all(&preamble()).expect("preamble");
        let line = first_line(&mut stream);
        assert!(is_turn_start(&line), "{}", String::from_utf8_lossy(&line));
    });
    let mut unix_first = time(rounds, || {
        let mut stream = std::os::unix::net::UnixStream::connect(&socket).expect("connect");
        let line = first_line(&mut stream);
        assert!(is_turn_start(&line), "{}", String::from_utf8_lossy(&line));
    });
    let _ = tls_agent.kill();
    let _ = tls_agent.wait();
    let _ = unix_agent.kill();
    let _ = unix_agent.wait();

    // Memory: AGENTS agents, each with its first turn done and one quiet client connected.
    let mut agents = Vec::new();
    for n in 0..AGENTS {
        agents.push(agent(&dir, &stub_url, &["--listen", "127.0.0.1:0"], 10 + n));
    }
    std::thread::sleep(Duration::from_millis(500));
    let alone: Vec<u64> = agents.iter().map(|(c, _)| rss_kib(c.id())).collect();
    let alone_anon: Vec<u64> = agents.iter().map(|(c, _)| anon_kib(c.id())).collect();
    let mut clients = Vec::new();
    for (_, endpoint) in &agents {
        let mut stream = tls_stream(tcp_addr(endpoint), &config);
        stream.write_all(&preamble()).expect("preamble");
        // Read the replay up to the turn's end.
        let mut seen = Vec::new();
        let mut buf = [0u8; 4096];
        while !String::from_utf8_lossy(&seen).contains("\"TurnEnd\"") {
            let n = stream.read(&mut buf).expect("read");
            assert!(n > 0);
            seen.extend_from_slice(&buf[..n]);
        }
        clients.push(stream);
    }
    std::thread::sleep(Duration::from_millis(300));
    let mut connected: Vec<u64> = agents.iter().map(|(c, _)| rss_kib(c.id())).collect();
    let mut connected_anon: Vec<u64> = agents.iter().map(|(c, _)| anon_kib(c.id())).collect();
    let delta = |after: &[u64], before: &[u64]| -> Vec<i64> {
        let mut d: Vec<i64> = after
            .iter()
            .zip(before)
            .map(|(c, a)| *c as i64 - *a as i64)
            .collect();
        d.sort_unstable();
        d
    };
    let deltas = delta(&connected, &alone);
    let anon_deltas = delta(&connected_anon, &alone_anon);
    drop(clients);
    for (mut child, _) in agents {
        let _ = child.kill();
        let _ = child.wait();
    }
    let _ = stub.kill();
    let _ = stub.wait();
    let _ = std::fs::remove_dir_all(&dir);

    println!("caliban agent serve (ndjson), {rounds} rounds on loopback, rustls client");
    floor.row("TCP connect + close (floor)");
    first_event.row("TCP + TLS handshake + preamble + first event");
    unix_first.row("Unix socket connect + first event (no TLS, no preamble)");
    connected.sort_unstable();
    connected_anon.sort_unstable();
    let mut alone = alone;
    alone.sort_unstable();
    println!(
        "{:<58} {:>9} KiB  (min {}, max {})",
        format!("RSS of an idle agent, no client ({AGENTS} agents)"),
        alone[AGENTS / 2],
        alone[0],
        alone[AGENTS - 1]
    );
    println!(
        "{:<58} {:>9} KiB  (min {}, max {})",
        "RSS of an idle agent with one client connected",
        connected[AGENTS / 2],
        connected[0],
        connected[AGENTS - 1]
    );
    println!(
        "{:<58} {:>9} KiB",
        "  of which anonymous (heap, stacks)",
        connected_anon[AGENTS / 2]
    );
    println!(
        "{:<58} {:>9} KiB  (anonymous: {} KiB)",
        "  growth when the client connected",
        deltas[AGENTS / 2],
        anon_deltas[AGENTS / 2]
    );
}
