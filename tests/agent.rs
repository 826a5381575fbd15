//! `caliban agent serve` end to end, all on loopback: the NDJSON session plane and ACP over
//! TLS with a bearer preamble (ACP driven by the official ACP TypeScript SDK,
//! `tests/acp/net.mjs`), the peers it refuses, every fail-closed start, the Unix socket, the
//! idle exit and SIGTERM. The CA and the certificates are made by `openssl` at test time in
//! each test's workspace; the client side of the NDJSON tests is rustls trusting only that
//! CA. Every receive has a deadline.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::{ClientConfig, ClientConnection, RootCertStore, StreamOwned};
use serde_json::{Value, json};

use crate::util::agent::*;
use crate::util::rpc::Peer;
use crate::util::*;

/// The longest any single line may take to arrive.
const RECV: Duration = Duration::from_secs(20);
/// The front's head deadline (`HEAD_DEADLINE`, src/surface/front.rs), which the preamble
/// runs on from accept.
const PREAMBLE_DEADLINE: Duration = Duration::from_secs(20);
const TOKEN: &str = "agent-test-token";
/// The longest one SDK scenario may take.
const SCENARIO_TIMEOUT: Duration = Duration::from_secs(90);

fn tls_env(pki: &Pki) -> Vec<(&'static str, String)> {
    vec![
        ("CALIBAN_AGENT_TOKEN", TOKEN.to_owned()),
        ("CALIBAN_AGENT_TLS_CERT", path_str(&pki.cert)),
        ("CALIBAN_AGENT_TLS_KEY", path_str(&pki.key)),
    ]
}

fn with_spec(mut env: Vec<(&'static str, String)>, spec: &Value) -> Vec<(&'static str, String)> {
    env.push(("CALIBAN_AGENT_SPEC", spec.to_string()));
    env
}

fn borrow<'a>(env: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    env.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

fn start_tls(ws: &Workspace, stub: &Stub, pki: &Pki, spec: &Value, flags: &[&str]) -> Agent {
    let env = with_spec(tls_env(pki), spec);
    let mut all = vec!["--listen", "127.0.0.1:0"];
    all.extend_from_slice(flags);
    Agent::start(ws, stub, &all, &borrow(&env))
}

// ---- a line client ----------------------------------------------------------------------------

/// A client of the agent's lines over TLS (rustls, trusting only `ca`) or a Unix socket.
struct Client {
    stream: Box<dyn ReadWrite>,
    buf: Vec<u8>,
}

trait ReadWrite: Read + Write {}
impl<T: Read + Write> ReadWrite for T {}

fn client_config(ca: &Path) -> Arc<ClientConfig> {
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(ca).expect("read CA") {
        roots.add(cert.expect("CA cert")).expect("add CA");
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("tls versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    Arc::new(config)
}

/// Connects and completes the TLS handshake as `name`, or says why it failed.
fn tls_connect(addr: SocketAddr, ca: &Path, name: &str) -> Result<Client, String> {
    let tcp = TcpStream::connect(addr).expect("connect");
    tcp.set_read_timeout(Some(RECV)).expect("timeout");
    let server = ServerName::try_from(name.to_owned()).expect("server name");
    let conn = ClientConnection::new(client_config(ca), server).expect("client");
    let mut stream = StreamOwned::new(conn, tcp);
    while stream.conn.is_handshaking() {
        stream
            .conn
            .complete_io(&mut stream.sock)
            .map_err(|e| e.to_string())?;
    }
    Ok(Client {
        stream: Box::new(stream),
        buf: Vec::new(),
    })
}

impl Client {
    fn tls(agent: &Agent, pki: &Pki) -> Client {
        tls_connect(agent.addr(), &pki.ca, "localhost").expect("handshake")
    }

    /// A TLS client that has sent the preamble (and `then`, in the same write).
    fn attached(agent: &Agent, pki: &Pki, then: &str) -> Client {
        let mut client = Client::tls(agent, pki);
        client.send(&format!("{{\"bearer\":\"{TOKEN}\"}}\n{then}"));
        client
    }

    fn unix(path: &Path) -> Client {
        let stream = std::os::unix::net::UnixStream::connect(path).expect("connect unix");
        stream.set_read_timeout(Some(RECV)).expect("timeout");
        Client {
            stream: Box::new(stream),
            buf: Vec::new(),
        }
    }

    fn send(&mut self, text: &str) {
        self.stream.write_all(text.as_bytes()).expect("send");
        self.stream.flush().expect("flush");
    }

    fn send_json(&mut self, value: &Value) {
        self.send(&format!("{value}\n"));
    }

    /// The next line, or `None` at EOF. Panics after `RECV` without one.
    fn recv(&mut self) -> Option<Value> {
        let deadline = Instant::now() + RECV;
        loop {
            if let Some(nl) = self.buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=nl).collect();
                let text = String::from_utf8_lossy(&line);
                return Some(
                    serde_json::from_str(text.trim())
                        .unwrap_or_else(|e| panic!("not a JSON line ({e}): {text:?}")),
                );
            }
            assert!(Instant::now() < deadline, "no line within {RECV:?}");
            let mut chunk = [0u8; 16 * 1024];
            match self.stream.read(&mut chunk) {
                Ok(0) => return None,
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    panic!("no line within {RECV:?}")
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                // A TLS close without close_notify, or a reset: the end all the same.
                Err(_) => return None,
            }
        }
    }

    fn recv_line(&mut self) -> Value {
        self.recv()
            .expect("the connection closed before a line came")
    }

    /// Lines up to and including the first that `done` accepts.
    fn recv_until(&mut self, done: impl Fn(&Value) -> bool) -> Vec<Value> {
        let mut lines = Vec::new();
        loop {
            let line = self.recv_line();
            let stop = done(&line);
            lines.push(line);
            if stop {
                return lines;
            }
        }
    }

    /// Everything until the agent closes the connection.
    fn recv_to_end(&mut self) -> Vec<Value> {
        std::iter::from_fn(|| self.recv()).collect()
    }
}

fn is(ty: &'static str) -> impl Fn(&Value) -> bool {
    move |v| v["type"] == ty
}

/// The lines that are `TurnEvent`s (the ones the cursor counts).
fn events(lines: &[Value]) -> Vec<Value> {
    const TYPES: [&str; 8] = [
        "TurnStart",
        "AssistantTextDelta",
        "AssistantThinkingDelta",
        "ToolCallStart",
        "ToolCallInputDelta",
        "ToolCallEnd",
        "TurnEnd",
        "RunEnd",
    ];
    lines
        .iter()
        .filter(|l| TYPES.iter().any(|t| l["type"] == *t))
        .cloned()
        .collect()
}

fn text_of(lines: &[Value]) -> String {
    lines
        .iter()
        .filter(|l| l["type"] == "AssistantTextDelta")
        .filter_map(|l| l["text"].as_str())
        .collect()
}

// ---- the NDJSON plane -------------------------------------------------------------------------

#[test]
fn ndjson_plane_replays_streams_takes_input_and_permits_and_resumes_from_a_cursor() {
    let ws = Workspace::new("agent-ndjson");
    let pki = pki(&ws);
    let slow = Turn::text("words arriving slowly over the network").fault(Fault::DripMs(150));
    let stub = Stub::start(
        &ws,
        &script([
            Turn::text("The first answer."),
            Turn::bash("toolu_echo", "echo permitted-ran"),
            slow,
        ]),
    );
    let spec = json!({"initial_prompt": "start", "interactive": true, "label": "worker-1"});
    let agent = start_tls(&ws, &stub, &pki, &spec, &[]);

    // A: from the start, through the first turn (live or replayed: the cursor says).
    let mut a = Client::attached(&agent, &pki, "{\"type\":\"Resume\",\"cursor\":0}\n");
    let mut seen = a.recv_until(is("TurnEnd"));
    assert_eq!(text_of(&seen), "The first answer.");
    assert_eq!(seen[0]["type"], "TurnStart");

    // Malformed and refused lines get an Error line; the connection goes on.
    a.send("not json\n{\"type\":\"Shout\"}\n{\"type\":\"UserMessage\"}\n");
    for needle in [
        "invalid JSON",
        "unknown type `Shout`",
        "`text` must be a string",
    ] {
        let line = a.recv_line();
        assert_eq!(line["type"], "Error", "{line}");
        assert!(
            line["error"].as_str().unwrap().contains(needle),
            "{line} lacks {needle}"
        );
    }

    // Input: a second turn whose Bash call asks; the client answers on the plane.
    a.send_json(&json!({"type": "UserMessage", "text": "run the command"}));
    let asked = a.recv_until(is("PermissionRequest"));
    seen.extend(events(&asked));
    let prompt = asked.last().unwrap();
    assert_eq!(prompt["tool_use_id"], "toolu_echo");
    assert_eq!(prompt["tool_name"], "Bash");
    assert_eq!(prompt["input"]["command"], "echo permitted-ran");
    a.send_json(&json!({"type": "Permit", "tool_use_id": "wrong", "allow": true}));
    let refused = a.recv_line();
    assert_eq!(refused["type"], "Error");
    assert!(
        refused["error"].as_str().unwrap().contains("toolu_echo"),
        "{refused}"
    );
    a.send_json(&json!({"type": "Permit", "tool_use_id": "toolu_echo", "allow": true}));
    let ran = a.recv_until(is("ToolCallEnd"));
    assert_eq!(ran.last().unwrap()["is_error"], false, "{ran:?}");
    assert!(
        ran.last().unwrap()["result_text"]
            .as_str()
            .unwrap()
            .contains("permitted-ran")
    );
    seen.extend(ran);
    // The third turn drips: leave in the middle of it.
    seen.extend(a.recv_until(is("AssistantTextDelta")));
    drop(a);
    let cursor = seen.len();

    // B resumes where A left off, while the turn goes on.
    let mut b = Client::attached(
        &agent,
        &pki,
        &format!("{{\"type\":\"Resume\",\"cursor\":{cursor}}}\n"),
    );
    let rest = b.recv_until(is("TurnEnd"));
    assert!(
        rest.iter().all(|l| l["type"] != "PermissionRequest"),
        "an answered prompt is not shown again: {rest:?}"
    );
    seen.extend(rest);
    // A Resume that is not the first line is refused and ends the connection.
    b.send("{\"type\":\"Resume\",\"cursor\":0}\n");
    let late = b.recv_line();
    assert_eq!(late["type"], "Error");
    assert!(
        late["error"].as_str().unwrap().contains("first line"),
        "{late}"
    );
    assert_eq!(b.recv(), None, "the connection ends after a late Resume");

    // C resumes at the end, ends the input: the run ends, and so does the connection.
    let mut c = Client::attached(
        &agent,
        &pki,
        &format!("{{\"type\":\"Resume\",\"cursor\":{}}}\n", seen.len()),
    );
    c.send("{\"type\":\"EndInput\"}\n");
    let end = c.recv_to_end();
    assert_eq!(end.last().unwrap()["type"], "RunEnd", "{end:?}");
    seen.extend(end);

    // D connects without a Resume: the whole history (under the replay cap), then EOF. The
    // pieces A, B and C saw are exactly it: nothing lost, nothing twice.
    let mut d = Client::attached(&agent, &pki, "");
    let replay = d.recv_to_end();
    assert_eq!(replay, seen);
    assert_eq!(
        text_of(&replay),
        "The first answer.words arriving slowly over the network"
    );
    assert_eq!(
        replay.iter().filter(|l| l["type"] == "TurnStart").count(),
        3
    );
    // The session header carries the spec's label.
    let sessions = std::fs::read_dir(ws.path("home/.state/caliban/sessions")).expect("sessions");
    let header = sessions
        .flatten()
        .map(|e| std::fs::read_to_string(e.path()).unwrap_or_default())
        .find(|t| t.contains("\"agent\":\"ndjson\""))
        .expect("a session file of the agent's run");
    assert!(header.contains("\"label\":\"worker-1\""), "{header}");
}

#[test]
fn ndjson_unattended_asks_nobody_but_deny_rules_still_deny_and_tools_are_limited() {
    let ws = Workspace::new("agent-unattended");
    let pki = pki(&ws);
    let stub = Stub::start(
        &ws,
        &script([
            Turn::bare().calling([
                Call::bash("toolu_ok", "echo unattended-ran"),
                Call::bash("toolu_rm", "rm -rf nothing-here"),
                Call::new(
                    "toolu_write",
                    "Write",
                    json!({"path": "x.txt", "content": "x"}),
                ),
            ]),
            Turn::text("done"),
        ]),
    );
    let spec = json!({"initial_prompt": "go", "permission_posture": "unattended",
                      "tool_allowlist": ["Bash", "Read"]});
    let agent = start_tls(&ws, &stub, &pki, &spec, &["--deny", "Bash(rm *)"]);
    let mut client = Client::attached(&agent, &pki, "");
    let lines = client.recv_to_end();
    assert_eq!(lines.last().unwrap()["type"], "RunEnd", "{lines:?}");
    assert!(
        lines.iter().all(|l| l["type"] != "PermissionRequest"),
        "{lines:?}"
    );
    let end = |id: &str| {
        lines
            .iter()
            .find(|l| l["type"] == "ToolCallEnd" && l["tool_use_id"] == id)
            .cloned()
            .unwrap_or_else(|| panic!("no ToolCallEnd for {id}"))
    };
    assert_eq!(end("toolu_ok")["is_error"], false);
    assert!(
        end("toolu_ok")["result_text"]
            .as_str()
            .unwrap()
            .contains("unattended-ran")
    );
    assert_eq!(end("toolu_rm")["is_error"], true, "the deny rule holds");
    let write = end("toolu_write");
    assert_eq!(write["is_error"], true);
    assert!(
        write["result_text"]
            .as_str()
            .unwrap()
            .contains("unknown tool 'Write'"),
        "{write}"
    );
    assert!(!ws.path("x.txt").exists());
    // Only the allowed tools were offered to the model.
    let offered: Vec<String> = stub.requests()[0]["body"]["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(offered, ["Bash", "Read"]);
}

// ---- peers that are refused -------------------------------------------------------------------

#[test]
fn peers_without_the_token_tls_or_patience_are_refused_and_the_newest_client_wins() {
    let ws = Workspace::new("agent-refused");
    let pki = pki(&ws);
    let stub = Stub::start(&ws, &script([Turn::text("hello")]));
    let spec = json!({"initial_prompt": "hi", "interactive": true});
    let agent = start_tls(&ws, &stub, &pki, &spec, &["-v"]);
    let addr = agent.addr();

    // A wrong token: nothing served, the connection closes.
    let mut wrong = Client::tls(&agent, &pki);
    wrong.send("{\"bearer\":\"not-the-token\"}\n");
    assert_eq!(wrong.recv(), None);
    // A preamble of the wrong shape, and one with the token and more.
    for preamble in [
        format!("Bearer {TOKEN}\n"),
        format!("{{\"bearer\":\"{TOKEN}\",\"cursor\":0}}\n"),
    ] {
        let mut odd = Client::tls(&agent, &pki);
        odd.send(&preamble);
        assert_eq!(odd.recv(), None, "{preamble}");
    }
    // An oversized preamble: closed before a newline ever comes.
    let mut big = Client::tls(&agent, &pki);
    big.send(&format!("{{\"bearer\":\"{}", "x".repeat(5000)));
    assert_eq!(big.recv(), None);
    // A plaintext client: no JSON line back, only (at most) a TLS alert, then the end.
    let mut plain = TcpStream::connect(addr).expect("connect");
    plain.set_read_timeout(Some(RECV)).expect("timeout");
    plain
        .write_all(format!("{{\"bearer\":\"{TOKEN}\"}}\n").as_bytes())
        .expect("send");
    let mut got = Vec::new();
    let _ = plain.read_to_end(&mut got);
    assert!(
        got.is_empty() || got[0] == 0x15,
        "a plaintext client got {got:?}"
    );
    // A client that does not trust the CA, and one that checks another name.
    let untrusted = tls_connect(addr, &pki.other_ca, "localhost").err();
    assert!(
        untrusted
            .as_deref()
            .unwrap_or_default()
            .contains("UnknownIssuer"),
        "{untrusted:?}"
    );
    let misnamed = tls_connect(addr, &pki.ca, "agent.example.com").err();
    assert!(
        misnamed
            .as_deref()
            .unwrap_or_default()
            .contains("not valid for name"),
        "{misnamed:?}"
    );
    // The 127.0.0.1 SAN is good too.
    assert!(tls_connect(addr, &pki.ca, "127.0.0.1").is_ok());

    // Peers stuck in their preamble: past 16 the oldest goes, the newest stay.
    let stuck: Vec<TcpStream> = (0..17)
        .map(|_| {
            let tcp = TcpStream::connect(addr).expect("connect");
            tcp.set_read_timeout(Some(Duration::from_millis(300)))
                .expect("timeout");
            std::thread::sleep(Duration::from_millis(20));
            tcp
        })
        .collect();
    // Open: no EOF within the read timeout (a closed one may first send a TLS alert).
    let open = |mut tcp: &TcpStream| {
        let mut b = [0u8; 64];
        loop {
            match tcp.read(&mut b) {
                Ok(0) => return false,
                Ok(_) => {}
                Err(e) => return matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
            }
        }
    };
    let closed: Vec<usize> = stuck
        .iter()
        .enumerate()
        .filter(|(_, tcp)| !open(tcp))
        .map(|(i, _)| i)
        .collect();
    assert_eq!(closed, [0], "the oldest of 17 goes");
    drop(stuck);

    // No preamble at all: closed at the deadline, not before, with nothing served (at most
    // a TLS alert). On its own thread, as it takes the whole deadline.
    let silent = std::thread::spawn(move || {
        let mut tcp = TcpStream::connect(addr).expect("connect");
        tcp.set_read_timeout(Some(PREAMBLE_DEADLINE + Duration::from_secs(10)))
            .expect("timeout");
        let start = Instant::now();
        // Not even a handshake: the deadline runs from accept.
        let mut got = Vec::new();
        let _ = tcp.read_to_end(&mut got);
        (got, start.elapsed())
    });

    // A real client still gets served; a second one replaces it.
    let mut first = Client::attached(&agent, &pki, "");
    assert_eq!(first.recv_line()["type"], "TurnStart");
    let mut second = Client::attached(&agent, &pki, "");
    assert_eq!(second.recv_line()["type"], "TurnStart");
    let rest = first.recv_to_end();
    assert!(rest.len() < 10, "the older client was closed: {rest:?}");

    let (got, after) = silent.join().expect("silent peer");
    assert!(
        got.is_empty() || got[0] == 0x15,
        "a peer with no preamble was sent {got:?}"
    );
    assert!(
        after >= PREAMBLE_DEADLINE - Duration::from_secs(1),
        "closed after only {after:?}"
    );
    assert!(
        after < PREAMBLE_DEADLINE + Duration::from_secs(5),
        "closed only after {after:?}"
    );
    let log = agent.stderr();
    assert!(log.contains("invalid bearer token"), "{log}");
}

// ---- starts that are refused ------------------------------------------------------------------

#[test]
fn network_mode_fails_closed_with_exit_78_naming_what_is_missing() {
    let ws = Workspace::new("agent-fail-closed");
    let pki = pki(&ws);
    ws.write("spec.json", r#"{"initial_prompt": "x"}"#);
    let cert = path_str(&pki.cert);
    let key = path_str(&pki.key);
    let other_key = path_str(&pki.other_key);
    let missing = path_str(&ws.path("no-such.pem"));
    let no_token = "CALIBAN_AGENT_TOKEN is required for --listen (network) mode; refusing to bind an unauthenticated listener";
    let no_tls = "agent TLS (CALIBAN_AGENT_TLS_CERT/KEY) is required for --listen mode; refusing to send the bearer token over plaintext";
    // (environment, what the refusal must say)
    type Case<'a> = (Vec<(&'a str, &'a str)>, Vec<&'a str>);
    let cases: Vec<Case> = vec![
        (vec![], vec![no_token]),
        (
            vec![("CALIBAN_AGENT_TOKEN", "  ")],
            vec!["CALIBAN_AGENT_TOKEN is empty"],
        ),
        (
            vec![("CALIBAN_AGENT_TOKEN", TOKEN)],
            vec!["CALIBAN_AGENT_TLS_CERT is not set", no_tls],
        ),
        (
            vec![
                ("CALIBAN_AGENT_TOKEN", TOKEN),
                ("CALIBAN_AGENT_TLS_CERT", &cert),
            ],
            vec!["CALIBAN_AGENT_TLS_KEY is not set", no_tls],
        ),
        (
            vec![
                ("CALIBAN_AGENT_TOKEN", TOKEN),
                ("CALIBAN_AGENT_TLS_CERT", &cert),
                ("CALIBAN_AGENT_TLS_KEY", ""),
            ],
            vec!["CALIBAN_AGENT_TLS_KEY is empty", no_tls],
        ),
        (
            vec![
                ("CALIBAN_AGENT_TOKEN", TOKEN),
                ("CALIBAN_AGENT_TLS_CERT", &missing),
                ("CALIBAN_AGENT_TLS_KEY", &key),
            ],
            vec!["CALIBAN_AGENT_TLS_CERT=", "cannot be read", no_tls],
        ),
        (
            vec![
                ("CALIBAN_AGENT_TOKEN", TOKEN),
                ("CALIBAN_AGENT_TLS_CERT", &cert),
                ("CALIBAN_AGENT_TLS_KEY", &other_key),
            ],
            vec!["KeyMismatch", no_tls],
        ),
        (
            vec![
                ("CALIBAN_AGENT_TOKEN", TOKEN),
                ("CALIBAN_AGENT_TLS_CERT", &key),
                ("CALIBAN_AGENT_TLS_KEY", &key),
            ],
            vec!["no certificates found", no_tls],
        ),
    ];
    for (env, needles) in cases {
        let mut cmd = caliban(&ws);
        cmd.env("ANTHROPIC_BASE_URL", "http://127.0.0.1:9").args([
            "agent",
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--spec",
            "spec.json",
        ]);
        for (k, v) in &env {
            cmd.env(k, v);
        }
        let out = run(cmd, "");
        assert_eq!(out.code, Some(78), "{env:?}: {out:?}");
        for needle in needles {
            assert!(out.stderr.contains(needle), "{env:?}: {needle}: {out:?}");
        }
        assert!(!out.stderr.contains("listening on"), "{out:?}");
    }

    // The spec is checked as strictly, over either transport.
    let tls = tls_env(&pki);
    let tls = borrow(&tls);
    for (spec, needle) in [
        (None, "no spawn spec"),
        (
            Some(r#"{"initial_prompt": "x", "isolation_worktree": true}"#),
            "unknown field in the spawn spec: `isolation_worktree`",
        ),
        (
            Some(r#"{"initial_prompt": "x", "drive_protocol": "grpc"}"#),
            "unknown drive_protocol `grpc`",
        ),
        (Some(r#"{"drive_protocol": "ndjson"}"#), "no initial_prompt"),
        (
            Some(r#"{"initial_prompt": "x", "tool_allowlist": ["Curl"]}"#),
            "unknown tool `Curl`",
        ),
    ] {
        let mut cmd = caliban(&ws);
        cmd.env("ANTHROPIC_BASE_URL", "http://127.0.0.1:9").args([
            "agent",
            "serve",
            "--listen",
            "127.0.0.1:0",
        ]);
        for (k, v) in &tls {
            cmd.env(k, v);
        }
        if let Some(spec) = spec {
            cmd.env("CALIBAN_AGENT_SPEC", spec);
        }
        let out = run(cmd, "");
        assert_eq!(out.code, Some(78), "{spec:?}: {out:?}");
        assert!(out.stderr.contains(needle), "{needle}: {out:?}");
    }
    let mut cmd = caliban(&ws);
    cmd.env("CALIBAN_AGENT_SPEC", r#"{"initial_prompt": "x"}"#)
        .env("CALIBAN_AGENT_IDLE_TIMEOUT_SECS", "soon")
        .args(["agent", "serve", "--socket", "a.sock"]);
    let out = run(cmd, "");
    assert_eq!(out.code, Some(78), "{out:?}");
    assert!(
        out.stderr.contains("CALIBAN_AGENT_IDLE_TIMEOUT_SECS"),
        "{out:?}"
    );
    // Neither or both of --listen and --socket is a usage error.
    for flags in [&[][..], &["--listen", "127.0.0.1:0", "--socket", "a.sock"]] {
        let mut cmd = caliban(&ws);
        cmd.args(["agent", "serve"]).args(flags);
        let out = run(cmd, "");
        assert_eq!(out.code, Some(64), "{flags:?}: {out:?}");
    }
}

// ---- the Unix socket, SIGTERM and the idle exit ----------------------------------------------

#[test]
fn the_unix_socket_is_0600_sigterm_kills_the_running_tool_and_the_socket_goes() {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let ws = Workspace::new("agent-unix");
    let marker = format!("agent-sigterm-marker-{}", std::process::id());
    let stub = Stub::start(
        &ws,
        &script([
            Turn::bash("toolu_sleep", &format!("sleep 30; echo {marker}")),
            Turn::text("never"),
        ]),
    );
    // Something stale from a process that died is replaced.
    let stale = std::os::unix::net::UnixListener::bind(ws.path("agent.sock")).expect("bind");
    drop(stale);
    let spec = json!({"initial_prompt": "sleep", "permission_posture": "unattended"}).to_string();
    let socket = path_str(&ws.path("agent.sock"));
    let mut agent = Agent::start(
        &ws,
        &stub,
        &["--socket", &socket],
        &[("CALIBAN_AGENT_SPEC", &spec)],
    );
    assert_eq!(agent.endpoint, format!("unix:{socket}"));
    let meta = std::fs::symlink_metadata(&socket).expect("socket");
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);

    // No preamble on the socket: lines flow at once.
    let mut client = Client::unix(Path::new(&socket));
    let lines = client.recv_until(|l| l["type"] == "ToolCallInputDelta");
    assert_eq!(lines[0]["type"], "TurnStart");
    let deadline = Instant::now() + RECV;
    while !process_with_marker_exists(&marker) {
        assert!(Instant::now() < deadline, "the command never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    let signalled = Instant::now();
    agent.signal("-TERM");
    assert_eq!(agent.wait_exit(Duration::from_secs(10)), Some(0));
    let took = signalled.elapsed();
    assert!(
        !process_with_marker_exists(&marker),
        "the Bash process outlived SIGTERM"
    );
    assert!(took < Duration::from_secs(5), "SIGTERM took {took:?}");
    assert!(!Path::new(&socket).exists(), "the socket file was left");
    // The run's end was recorded: its client saw it before the connection went.
    let rest = client.recv_to_end();
    let end = rest.iter().find(|l| l["type"] == "RunEnd");
    assert!(
        end.is_some_and(|e| e["stopped_for"] == "Cancelled"),
        "{rest:?}"
    );

    // A second agent will not take over a path that is not a socket.
    ws.write("file.sock", "not a socket");
    let mut cmd = caliban(&ws);
    anthropic(&mut cmd, &stub);
    cmd.env("CALIBAN_AGENT_SPEC", &spec)
        .args(["agent", "serve", "--socket", "file.sock"]);
    let out = run(cmd, "");
    assert_eq!(out.code, Some(78), "{out:?}");
    assert!(out.stderr.contains("is not a socket"), "{out:?}");
}

#[test]
fn with_no_client_and_nothing_running_the_agent_exits_after_the_idle_timeout() {
    let ws = Workspace::new("agent-idle");
    let stub = Stub::start(&ws, &script([Turn::text("waiting for you")]));
    let spec = json!({"initial_prompt": "hi", "interactive": true}).to_string();
    let socket = path_str(&ws.path("idle.sock"));
    let env = [
        ("CALIBAN_AGENT_SPEC", spec.as_str()),
        ("CALIBAN_AGENT_IDLE_TIMEOUT_SECS", "1"),
    ];
    let mut agent = Agent::start(&ws, &stub, &["--socket", &socket, "-v"], &env);
    // While a client is connected the agent stays, however idle.
    let mut client = Client::unix(Path::new(&socket));
    client.recv_until(is("TurnEnd"));
    std::thread::sleep(Duration::from_millis(2500));
    assert!(agent.child.try_wait().expect("try_wait").is_none());
    let gone = Instant::now();
    drop(client);
    assert_eq!(agent.wait_exit(Duration::from_secs(10)), Some(0));
    assert!(
        gone.elapsed() >= Duration::from_millis(900),
        "{:?}",
        gone.elapsed()
    );
    assert!(agent.stderr().contains("no client and nothing running"));
    assert!(!Path::new(&socket).exists());
}

// ---- ACP over TLS, driven by the official SDK ------------------------------------------------

#[test]
fn acp_over_tls_with_the_official_sdk_prompts_permits_cancels_and_loads_after_a_reconnect() {
    let ws = Workspace::new("agent-acp");
    let pki = pki(&ws);
    let marker = format!("agent-acp-marker-{}", std::process::id());
    let stub = Stub::start(
        &ws,
        &script([
            Turn::text("Hello over TLS."),
            Turn::bash("toolu_ok", "echo allowed-ran"),
            Turn::text("the command ran"),
            Turn::bash("toolu_no", "echo rejected-ran > rejected.txt"),
            Turn::text("not run then"),
            Turn::bash("toolu_sleep", &format!("sleep 30; echo {marker}")),
            Turn::text("back again"),
        ]),
    );
    let agent = start_tls(&ws, &stub, &pki, &json!({"drive_protocol": "acp"}), &[]);
    let addr = agent.addr();
    let dir = crate::util::acp::sdk_dir();
    let args = json!({
        "host": "127.0.0.1", "port": addr.port(), "ca": path_str(&pki.ca),
        "servername": "localhost", "token": TOKEN, "cwd": path_str(&ws.root),
        "answers": ["allow", "reject", "allow"],
    });
    let out = output_within(
        Command::new("node")
            .arg(dir.join("net.mjs"))
            .arg(args.to_string())
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default()),
        "spawn node (node 20 is needed)",
        SCENARIO_TIMEOUT,
    );
    let report: Value = serde_json::from_str(out.stdout.lines().last().unwrap_or_default())
        .unwrap_or_else(|e| panic!("no report ({e}): {out:?}\n{}", agent.stderr()));
    assert_eq!(
        report["ok"],
        true,
        "{}\n--- agent\n{}",
        report["error"].as_str().unwrap_or_default(),
        agent.stderr()
    );
    assert_eq!(report["problems"], json!([]), "frames that break ACP");
    let first = &report["result"]["first"];
    assert_eq!(first["init"]["protocolVersion"], 1);
    assert_eq!(first["init"]["agentCapabilities"]["loadSession"], true);
    assert_eq!(first["init"]["authMethods"], json!([]));
    let stops: Vec<&str> = first["stops"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["stopReason"].as_str().unwrap())
        .collect();
    assert_eq!(stops, ["end_turn", "end_turn", "end_turn", "cancelled"]);
    let updates = first["updates"].as_array().unwrap();
    let said: String = updates
        .iter()
        .filter(|u| u["sessionUpdate"] == "agent_message_chunk")
        .filter_map(|u| u["content"]["text"].as_str())
        .collect();
    assert_eq!(said, "Hello over TLS.the command rannot run then");
    let asked: Vec<&str> = first["permissions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["toolCall"]["toolCallId"].as_str().unwrap())
        .collect();
    assert_eq!(asked, ["toolu_ok", "toolu_no", "toolu_sleep"]);
    let last_of = |id: &str| {
        updates
            .iter()
            .rev()
            .find(|u| u["toolCallId"] == id)
            .cloned()
            .unwrap_or_else(|| panic!("no update for {id}"))
    };
    assert_eq!(last_of("toolu_ok")["status"], "completed");
    assert!(
        last_of("toolu_ok")["content"][0]["content"]["text"]
            .as_str()
            .unwrap()
            .contains("allowed-ran")
    );
    assert_eq!(last_of("toolu_no")["status"], "failed");
    assert!(
        !ws.path("rejected.txt").exists(),
        "the rejected command ran"
    );
    assert_eq!(last_of("toolu_sleep")["status"], "failed");
    assert!(
        !process_with_marker_exists(&marker),
        "the Bash process outlived the cancel"
    );

    let second = &report["result"]["second"];
    let replayed: String = second["replay"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|u| u["sessionUpdate"] == "agent_message_chunk")
        .filter_map(|u| u["content"]["text"].as_str())
        .collect();
    assert!(replayed.contains("Hello over TLS."), "{replayed}");
    assert!(replayed.contains("not run then"), "{replayed}");
    assert_eq!(second["stop"]["stopReason"], "end_turn");
    let after: String = second["updates"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|u| u["sessionUpdate"] == "agent_message_chunk")
        .filter_map(|u| u["content"]["text"].as_str())
        .collect();
    assert_eq!(after, "back again");
    // The prompt after the reconnect continued the same conversation.
    let last = stub.requests().last().cloned().expect("a request");
    let sent = last["body"]["messages"].to_string();
    assert!(
        sent.contains("Hello over TLS.") && sent.contains("after the reconnect"),
        "{sent}"
    );
}

#[test]
fn acp_client_that_comes_back_loads_its_session_and_is_asked_the_pending_permission() {
    let ws = Workspace::new("agent-acp-back");
    let stub = Stub::start(
        &ws,
        &script([
            Turn::bash("toolu_wait", "echo asked-again"),
            Turn::text("ran it"),
            Turn::text("and again"),
        ]),
    );
    let socket = path_str(&ws.path("acp.sock"));
    let spec = json!({"drive_protocol": "acp"}).to_string();
    let _agent = Agent::start(
        &ws,
        &stub,
        &["--socket", &socket],
        &[("CALIBAN_AGENT_SPEC", &spec)],
    );
    let cwd = path_str(&ws.root);
    let init = json!({"protocolVersion": 1, "clientCapabilities": {}});

    let mut a = Peer::unix(Path::new(&socket), RECV);
    a.send_request(1, "initialize", init.clone());
    assert_eq!(a.recv()["id"], 1);
    a.send_request(2, "session/new", json!({"cwd": cwd, "mcpServers": []}));
    let session = a.recv()["result"]["sessionId"].clone();
    let prompt = json!({"sessionId": session, "prompt": [{"type": "text", "text": "go"}]});
    a.send_request(3, "session/prompt", prompt.clone());
    let (request, _) = a.recv_until(|l| l["method"] == "session/request_permission");
    assert_eq!(request["params"]["toolCall"]["toolCallId"], "toolu_wait");
    // The client goes away without answering.
    drop(a);

    let mut b = Peer::unix(Path::new(&socket), RECV);
    b.send_request(1, "initialize", init);
    assert_eq!(b.recv()["id"], 1);
    b.send_request(
        2,
        "session/load",
        json!({"sessionId": session, "cwd": cwd, "mcpServers": []}),
    );
    let (loaded, before) = b.recv_until(|l| l["id"] == 2);
    assert!(loaded.get("result").is_some(), "{before:?} {loaded}");
    // The prompt that waited meanwhile is asked of the client that came back.
    let (again, _) = b.recv_until(|l| l["method"] == "session/request_permission");
    assert_eq!(again["params"]["toolCall"]["toolCallId"], "toolu_wait");
    b.send(json!({"jsonrpc": "2.0", "id": again["id"],
        "result": {"outcome": {"outcome": "selected", "optionId": "allow"}}}));
    let (ran, _) = b.recv_until(|l| {
        l["params"]["update"]["toolCallId"] == "toolu_wait"
            && l["params"]["update"]["status"] == "completed"
    });
    let done = ran.to_string();
    assert!(done.contains("asked-again"), "{done}");
    // The first client's prompt is nobody's to answer; once the turn it started is over,
    // the session takes the next one (until then a prompt is refused as busy).
    let mut next = prompt;
    next["prompt"][0]["text"] = json!("and now");
    let deadline = Instant::now() + RECV;
    for id in 3.. {
        b.send_request(id, "session/prompt", next.clone());
        let (answer, _) = b.recv_until(|l| l["id"] == id);
        if answer["error"]["message"] == "the session is still busy with its last turn" {
            assert!(Instant::now() < deadline, "the turn never ended");
            std::thread::sleep(Duration::from_millis(50));
            continue;
        }
        assert_eq!(answer["result"]["stopReason"], "end_turn", "{answer}");
        break;
    }
}

// ---- the agent for long work (issue 14) ------------------------------------------------------

/// The NDJSON plane takes images with a `UserMessage` (and says why it refuses one) and a
/// `Compact` line, which compacts the conversation: a `Compaction` event line follows.
#[test]
fn ndjson_images_and_compact_lines() {
    use crate::util::{PNG, image_block};
    let ws = Workspace::new("agent-long");
    let pki = pki(&ws);
    let stub = Stub::start(
        &ws,
        &script([
            Turn::text("first"),
            Turn::text("a red dot"),
            Turn::text("SUMMARY"),
        ]),
    );
    let spec = json!({"initial_prompt": "go", "interactive": true,
                      "permission_posture": "unattended"});
    let agent = start_tls(&ws, &stub, &pki, &spec, &[]);
    let mut client = Client::attached(&agent, &pki, "");
    client.recv_until(is("TurnEnd"));
    client.send_json(&json!({"type": "UserMessage", "images": [image_block("image/bmp", "AAAA")]}));
    let refused = client.recv_line();
    assert_eq!(refused["type"], "Error", "{refused}");
    assert!(
        refused["error"]
            .as_str()
            .unwrap()
            .contains("unsupported image type `image/bmp`"),
        "{refused}"
    );
    client.send_json(&json!({"type": "UserMessage", "text": "what is this?",
                             "images": [image_block("image/png", PNG)]}));
    let turn = client.recv_until(is("TurnEnd"));
    assert_eq!(text_of(&turn), "a red dot");
    client.send_json(&json!({"type": "Compact"}));
    let compaction = client.recv_until(is("Compaction"));
    let compaction = compaction.last().unwrap();
    assert_eq!(compaction["trigger"], "manual");
    assert_eq!(compaction["summary"], "SUMMARY");
    let reqs = stub.requests();
    let last = reqs[1]["body"]["messages"]
        .as_array()
        .unwrap()
        .last()
        .cloned()
        .unwrap();
    assert_eq!(last["content"][1]["source"]["data"], PNG, "{last}");
    assert!(reqs[2]["body"].to_string().contains("working notes"));
}

/// The networked agent's run calls the configured MCP servers like every surface's.
#[test]
fn ndjson_run_calls_configured_mcp_servers() {
    let ws = Workspace::new("agent-mcp-client");
    let pki = pki(&ws);
    let stub = Stub::start(
        &ws,
        &script([
            Turn::bare().calling([Call::new(
                "toolu_m",
                "mcp__py__echo",
                json!({"text": "net"}),
            )]),
            Turn::text("done"),
        ]),
    );
    ws.write(
        "mcp.json",
        &json!({"mcpServers": {"py": crate::util::mcp::stdio_server(&ws.root)}}).to_string(),
    );
    let cfg = path_str(&ws.path("mcp.json"));
    let spec = json!({"initial_prompt": "go", "permission_posture": "unattended"});
    let agent = start_tls(&ws, &stub, &pki, &spec, &["--mcp-config", &cfg]);
    let mut client = Client::attached(&agent, &pki, "");
    let lines = client.recv_to_end();
    let end = lines
        .iter()
        .find(|l| l["type"] == "ToolCallEnd" && l["tool_use_id"] == "toolu_m")
        .unwrap_or_else(|| panic!("no ToolCallEnd: {lines:?}"));
    assert_eq!(end["is_error"], false, "{end}");
    assert_eq!(end["result_text"], "echo: net", "{end}");
}

/// The spec's `tool_allowlist` limits MCP tools as it limits built-in ones: only those it
/// names (`mcp__server__tool`, `mcp__server__*`) are offered, and a call to another is
/// refused.
#[test]
fn tool_allowlist_limits_mcp_tools_too() {
    let offered = |stub: &Stub| -> Vec<String> {
        stub.requests()[0]["body"]["tools"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|t| t["name"].as_str().map(str::to_owned))
            .collect()
    };
    let ws = Workspace::new("agent-mcp-allowlist");
    let pki = pki(&ws);
    let stub = Stub::start(
        &ws,
        &script([
            Turn::bare().calling([
                Call::new("toolu_ok", "mcp__py__echo", json!({"text": "listed"})),
                Call::new("toolu_no", "mcp__py__picture", json!({})),
            ]),
            Turn::text("done"),
        ]),
    );
    ws.write(
        "mcp.json",
        &json!({"mcpServers": {"py": crate::util::mcp::stdio_server(&ws.root)}}).to_string(),
    );
    let cfg = path_str(&ws.path("mcp.json"));
    let spec = json!({"initial_prompt": "go", "permission_posture": "unattended",
                      "tool_allowlist": ["Read", "mcp__py__echo"]});
    let agent = start_tls(&ws, &stub, &pki, &spec, &["--mcp-config", &cfg]);
    let mut client = Client::attached(&agent, &pki, "");
    let lines = client.recv_to_end();
    let end = |id: &str| {
        lines
            .iter()
            .find(|l| l["type"] == "ToolCallEnd" && l["tool_use_id"] == id)
            .unwrap_or_else(|| panic!("no ToolCallEnd for {id}: {lines:?}"))
            .clone()
    };
    assert_eq!(end("toolu_ok")["is_error"], false);
    assert_eq!(end("toolu_ok")["result_text"], "echo: listed");
    let refused = end("toolu_no");
    assert_eq!(refused["is_error"], true, "{refused}");
    assert!(
        refused["result_text"]
            .as_str()
            .unwrap_or_default()
            .starts_with("unknown tool 'mcp__py__picture'"),
        "{refused}"
    );
    assert_eq!(offered(&stub), ["Read", "mcp__py__echo"]);
    // Without an MCP entry no MCP tool is offered.
    drop(client);
    drop(agent);
    let stub = Stub::start(&ws, &script([Turn::text("done")]));
    let spec = json!({"initial_prompt": "go", "permission_posture": "unattended",
                      "tool_allowlist": ["Read"]});
    let agent = start_tls(&ws, &stub, &pki, &spec, &["--mcp-config", &cfg]);
    let mut client = Client::attached(&agent, &pki, "");
    client.recv_to_end();
    assert_eq!(offered(&stub), ["Read"]);
}

/// A TLS client of the agent from the loopback address `from` (127.0.0.0/8 are all this
/// host): the handshake done, nothing sent.
fn tls_connect_from(
    from: std::net::Ipv4Addr,
    addr: SocketAddr,
    config: &Arc<ClientConfig>,
) -> Result<StreamOwned<ClientConnection, TcpStream>, String> {
    let tcp = crate::util::http::connect_from(from, addr);
    tcp.set_read_timeout(Some(RECV)).expect("timeout");
    let server = ServerName::try_from("localhost".to_owned()).expect("server name");
    let conn = ClientConnection::new(Arc::clone(config), server).expect("client");
    let mut stream = StreamOwned::new(conn, tcp);
    while stream.conn.is_handshaking() {
        stream
            .conn
            .complete_io(&mut stream.sock)
            .map_err(|e| e.to_string())?;
    }
    Ok(stream)
}

/// Finding 12: a flood of handshaked connections that never send a preamble, from one
/// address, no longer pushes out a real client from another during its handshake-to-preamble
/// gap: the address holding the most waiting connections gives up its own first.
#[test]
fn selfclient_a_preamble_flood_from_one_address_does_not_displace_a_client_from_another() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let ws = Workspace::new("agent-flood");
    let pki = pki(&ws);
    let stub = Stub::start(&ws, &script([Turn::text("hello")]));
    let spec = json!({"initial_prompt": "hi", "interactive": true});
    let agent = start_tls(&ws, &stub, &pki, &spec, &[]);
    let addr = agent.addr();
    let config = client_config(&pki.ca);
    let stop = Arc::new(AtomicBool::new(false));
    // Two flooders that finish their handshakes and one that only connects (the cheapest
    // way to keep the door busy), all from 127.0.0.2.
    let flooders: Vec<_> = (0..3)
        .map(|n| {
            let (stop, config) = (Arc::clone(&stop), Arc::clone(&config));
            std::thread::spawn(move || {
                let mut handshaked = std::collections::VecDeque::new();
                let mut connected = std::collections::VecDeque::new();
                let mut made = 0u32;
                while !stop.load(Ordering::Relaxed) {
                    if n < 2 {
                        if let Ok(s) = tls_connect_from([127, 0, 0, 2].into(), addr, &config) {
                            handshaked.push_back(s);
                        }
                    } else {
                        connected.push_back(crate::util::http::connect_from(
                            [127, 0, 0, 2].into(),
                            addr,
                        ));
                    }
                    made += 1;
                    while handshaked.len() > 24 {
                        handshaked.pop_front();
                    }
                    while connected.len() > 64 {
                        connected.pop_front();
                    }
                }
                made
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let mut served = 0;
    for _ in 0..10 {
        let Ok(mut stream) = tls_connect_from([127, 0, 0, 1].into(), addr, &config) else {
            continue;
        };
        // A client on a slow link, or one that reads its token only now: a gap the flood
        // has ample time to fill.
        std::thread::sleep(Duration::from_millis(200));
        if stream
            .write_all(format!("{{\"bearer\":\"{TOKEN}\"}}\n").as_bytes())
            .is_err()
        {
            continue;
        }
        let mut client = Client {
            stream: Box::new(stream),
            buf: Vec::new(),
        };
        if client.recv().is_some_and(|l| l["type"] == "TurnStart") {
            served += 1;
        }
    }
    stop.store(true, Ordering::Relaxed);
    let made: u32 = flooders
        .into_iter()
        .map(|f| f.join().expect("flooder"))
        .sum();
    assert!(
        made > 100,
        "the flood was too thin to tell: {made} connections"
    );
    assert_eq!(served, 10, "served {served}/10 through a flood of {made}");
}
