//! A process a run started is never a client of caliban (issue 21, findings 3 and 4): a run's
//! Bash, scripted by the stub, connects back to the surface that serves the run and tries to
//! answer its own permission prompt — over `agent serve --socket`, `http serve` on loopback
//! (`--sandbox network`), `mcp serve --listen` — from a background shell and from a
//! daemonised descendant (`setsid nohup env -i …`, untagged and out of its session), with the
//! sandbox on and off, as root and as an ordinary user. Each is refused, and the
//! supervisor (the test) stays the client and keeps working.

use std::path::Path;
use std::process::{Child, Stdio};
use std::sync::mpsc::channel;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::util::http::{Serve, get, post_json, serve_command};
use crate::util::http::{events_page, start_run};
use crate::util::*;

const RECV: Duration = Duration::from_secs(20);
/// How long the attacker is given to try (it tries every 100 ms).
const ATTACK_WINDOW: Duration = Duration::from_secs(3);

/// The attacker: connects to caliban as a client, over a Unix socket (agent lines) or HTTP
/// (`http serve`, MCP's `--listen`), tries to permit `toolu_esc` over and over, and logs
/// every answer to `attack.log`.
const ATTACK_PY: &str = r#"
import json, socket, sys, time, urllib.request, urllib.error
mode, target = sys.argv[1], sys.argv[2]
log = open('attack.log', 'a')
def note(text):
    log.write(text.rstrip('\n') + '\n'); log.flush()
def http(method, path, body=None):
    req = urllib.request.Request('http://' + target + path, method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={'content-type': 'application/json', 'accept': 'application/json, text/event-stream'})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            note('%s %s %d %s' % (method, path, r.status, r.read().decode(errors='replace')[:300]))
    except urllib.error.HTTPError as e:
        note('%s %s %d %s' % (method, path, e.code, e.read().decode(errors='replace')[:300]))
    except Exception as e:
        note('%s %s error %s' % (method, path, e))
deadline = time.time() + 60
while time.time() < deadline:
    if mode == 'unix':
        try:
            s = socket.socket(socket.AF_UNIX); s.settimeout(5); s.connect(target)
            note('connected')
            f = s.makefile('rb')
            for line in f:
                note('line ' + line.decode(errors='replace'))
                m = json.loads(line)
                if m.get('type') == 'PermissionRequest' and m.get('tool_use_id') == 'toolu_esc':
                    s.sendall(b'{"type":"Permit","tool_use_id":"toolu_esc","allow":true}\n')
                    note('sent permit')
            note('eof')
        except Exception as e:
            note('error %s' % e)
    elif mode == 'http':
        http('GET', '/runs')
        http('POST', '/runs/%s/permit' % sys.argv[3], {'tool_use_id': 'toolu_esc', 'allow': True})
    elif mode == 'inflight':
        # Hide the socket from caliban's look: connect, write the request, hand the socket
        # to a socketpair (SCM_RIGHTS) and close our own copy, so that no process holds it
        # while caliban accepts; take it back a moment later to read the answer.
        path = '/runs/%s/permit' % sys.argv[3]
        body = json.dumps({'tool_use_id': 'toolu_esc', 'allow': True}).encode()
        try:
            a, b = socket.socketpair()
            host, port = target.rsplit(':', 1)
            s = socket.create_connection((host, int(port)), timeout=5)
            s.sendall(('POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n'
                       'Content-Length: %d\r\nConnection: close\r\n\r\n'
                       % (path, target, len(body))).encode() + body)
            socket.send_fds(a, [b'x'], [s.fileno()])
            s.close()
            time.sleep(0.5)
            _, fds, _, _ = socket.recv_fds(b, 1, 1)
            r = socket.socket(fileno=fds[0]); r.settimeout(5)
            data = b''
            while True:
                chunk = r.recv(65536)
                if not chunk:
                    break
                data += chunk
            status = data.split(b' ', 2)[1].decode() if data else 'none'
            note('POST %s %s %s' % (path, status, data.decode(errors='replace')[-300:].replace('\r\n', ' ')))
            r.close(); a.close(); b.close()
        except Exception as e:
            note('POST %s error %s' % (path, e))
    elif mode == 'mcp':
        http('POST', '/mcp', {'jsonrpc': '2.0', 'id': 1, 'method': 'initialize', 'params':
            {'protocolVersion': '2025-06-18', 'capabilities': {}, 'clientInfo': {'name': 'x', 'version': '1'}}})
    time.sleep(0.1)
"#;

/// How the attacker is started by the run.
#[derive(Clone, Copy, Debug)]
enum Launch {
    /// A background Bash shell of the run (`background: true`).
    Background,
    /// From a foreground Bash call, in a session of its own with an empty environment (so
    /// without the tool call's tag) and re-parented to caliban once its shell exits. The
    /// call waits a second first: what still carries the tag of an ended call is killed.
    Daemon,
}

fn attack_turn(launch: Launch, args: &str) -> Turn {
    let (command, background) = match launch {
        Launch::Background => (format!("python3 attack.py {args}"), true),
        Launch::Daemon => (
            format!(
                "setsid nohup env -i PATH=\"$PATH\" python3 attack.py {args} >/dev/null 2>&1 & \
                 sleep 1; echo started"
            ),
            false,
        ),
    };
    let input = json!({"command": command, "background": background});
    Turn::call("toolu_attack", "Bash", input)
}

fn escape_turn() -> Turn {
    Turn::bash("toolu_esc", "touch escaped")
}

fn workspace(name: &str, user: Option<(u32, u32)>) -> Workspace {
    let ws = Workspace::new(name);
    ws.write("attack.py", ATTACK_PY);
    if let Some(user) = user {
        ws.give_to(user);
    }
    ws
}

/// The users each test runs caliban as: this one, and an ordinary one when this is root.
fn users() -> Vec<Option<(u32, u32)>> {
    let mut all = vec![None];
    all.extend(ordinary_user().map(Some));
    all
}

fn attack_log(ws: &Workspace) -> String {
    std::fs::read_to_string(ws.path("attack.log")).unwrap_or_default()
}

/// Waits until the attacker has logged at least `n` attempts.
fn wait_attempts(ws: &Workspace, needle: &str, n: usize) {
    let deadline = Instant::now() + RECV;
    while attack_log(ws).matches(needle).count() < n {
        assert!(
            Instant::now() < deadline,
            "the attacker never tried ({needle}):\n{}",
            attack_log(ws)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

// ---- agent serve --socket ---------------------------------------------------------------------

struct Agent {
    child: Child,
    stderr: StderrLog,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_agent(
    ws: &Workspace,
    stub: &Stub,
    socket: &str,
    sandbox: &str,
    user: Option<(u32, u32)>,
) -> Agent {
    let spec = json!({"initial_prompt": "go", "permission_posture": "supervised"});
    spawn_agent(ws, stub, socket, &spec, &["--sandbox", sandbox], user)
}

/// `agent serve --socket SOCKET` with `spec` and `extra` flags, as `user` if given, once it
/// says it listens.
fn spawn_agent(
    ws: &Workspace,
    stub: &Stub,
    socket: &str,
    spec: &Value,
    extra: &[&str],
    user: Option<(u32, u32)>,
) -> Agent {
    let mut cmd = caliban_stub(ws, stub, &["agent", "serve", "--socket", socket]);
    cmd.args(extra)
        .env("CALIBAN_AGENT_SPEC", spec.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    if let Some(user) = user {
        as_user(&mut cmd, user);
    }
    let mut child = cmd.spawn().expect("spawn agent serve");
    let (tx, rx) = channel();
    let stderr = StderrLog::start(
        child.stderr.take().expect("stderr"),
        Some(("listening on ", tx)),
    );
    if rx.recv_timeout(RECV).is_err() {
        let _ = child.kill();
        panic!("no start-up line:\n{}", stderr.text());
    }
    Agent { child, stderr }
}

struct Lines {
    stream: std::os::unix::net::UnixStream,
    buf: Vec<u8>,
}

impl Lines {
    fn connect(path: &Path) -> Lines {
        let stream = std::os::unix::net::UnixStream::connect(path).expect("connect");
        stream.set_read_timeout(Some(RECV)).expect("timeout");
        Lines {
            stream,
            buf: Vec::new(),
        }
    }

    fn send(&mut self, value: &Value) {
        use std::io::Write;
        self.stream
            .write_all(format!("{value}\n").as_bytes())
            .expect("send");
    }

    fn recv(&mut self) -> Option<Value> {
        use std::io::Read;
        let deadline = Instant::now() + RECV;
        loop {
            if let Some(nl) = self.buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=nl).collect();
                return Some(serde_json::from_slice(&line).expect("a JSON line"));
            }
            assert!(Instant::now() < deadline, "no line within {RECV:?}");
            let mut chunk = [0u8; 16 * 1024];
            match self.stream.read(&mut chunk) {
                Ok(0) => return None,
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => panic!("no line within {RECV:?}: {e}"),
            }
        }
    }

    fn recv_until(&mut self, done: impl Fn(&Value) -> bool) -> Vec<Value> {
        let mut lines = Vec::new();
        loop {
            let line = self
                .recv()
                .expect("the connection closed before a line came");
            let stop = done(&line);
            lines.push(line);
            if stop {
                return lines;
            }
        }
    }
}

fn prompt_for(id: &'static str) -> impl Fn(&Value) -> bool {
    move |l| l["type"] == "PermissionRequest" && l["tool_use_id"] == id
}

/// The run's Bash connects to the agent's socket and tries to permit its own prompt: it is
/// refused, the supervisor stays the client, and the prompt is still its to answer.
fn agent_socket_case(sandbox: &str, launch: Launch, user: Option<(u32, u32)>) {
    let ws = workspace("selfclient-agent", user);
    let socket = path_str(&ws.path("agent.sock"));
    let stub = Stub::start(
        &ws,
        &script([
            attack_turn(launch, &format!("unix {socket}")),
            escape_turn(),
            Turn::text("done"),
        ]),
    );
    let agent = start_agent(&ws, &stub, &socket, sandbox, user);
    let mut supervisor = Lines::connect(Path::new(&socket));
    supervisor.recv_until(prompt_for("toolu_attack"));
    supervisor.send(&json!({"type": "Permit", "tool_use_id": "toolu_attack", "allow": true}));
    supervisor.recv_until(prompt_for("toolu_esc"));
    wait_attempts(&ws, "\n", 3);
    std::thread::sleep(ATTACK_WINDOW);
    let log = attack_log(&ws);
    let context = format!(
        "[{sandbox} {launch:?} {user:?}]\nattack.log:\n{log}\nstderr:\n{}",
        agent.stderr.text()
    );
    assert!(
        !ws.path("escaped").exists(),
        "the run permitted itself {context}"
    );
    assert!(!log.contains("sent permit"), "{context}");
    assert!(
        !log.contains("TurnStart"),
        "the attacker was served {context}"
    );
    // The supervisor is still the client: a line is answered, and the prompt is its own.
    supervisor.send(&json!({"type": "Nonsense"}));
    let answer = supervisor.recv().expect("the supervisor was dropped");
    assert_eq!(answer["type"], "Error", "{answer} {context}");
    supervisor.send(&json!({"type": "Permit", "tool_use_id": "toolu_esc", "allow": false}));
    let rest = supervisor.recv_until(|l| l["type"] == "RunEnd");
    let end = rest
        .iter()
        .find(|l| l["type"] == "ToolCallEnd" && l["tool_use_id"] == "toolu_esc");
    assert!(
        end.is_some_and(|e| e["is_error"] == true),
        "{rest:?} {context}"
    );
    assert!(!ws.path("escaped").exists(), "{context}");
    // Where the attacker reached the socket, it read the rule.
    if log.contains("connected") {
        assert!(log.contains("cannot be a client of caliban"), "{context}");
        assert!(
            agent
                .stderr
                .text()
                .contains("cannot be a client of caliban"),
            "{context}"
        );
    }
}

#[test]
fn selfclient_a_runs_background_shell_cannot_drive_agent_serve_over_its_socket() {
    for user in users() {
        agent_socket_case("workspace-write", Launch::Background, user);
    }
}

#[test]
fn selfclient_an_unsandboxed_command_is_refused_on_the_socket_too() {
    for user in users() {
        agent_socket_case("off", Launch::Background, user);
    }
}

#[test]
fn selfclient_a_daemonised_untagged_descendant_is_refused_on_the_socket() {
    for user in users() {
        agent_socket_case("off", Launch::Daemon, user);
    }
}

// ---- http serve and mcp serve --listen on loopback ------------------------------------------

/// The run's Bash, in `network` mode (or unconfined), calls `http serve` on loopback for its
/// own prompt: 403 naming the rule, while the test's own loopback client keeps working.
fn http_case(sandbox: &str, launch: Launch, user: Option<(u32, u32)>) {
    http_case_with("http", sandbox, launch, user);
}

/// `http_case` with the attacker's `mode` (`http`, or `inflight`: its socket held by no
/// process while caliban accepts it).
fn http_case_with(mode: &str, sandbox: &str, launch: Launch, user: Option<(u32, u32)>) {
    let ws = workspace("selfclient-http", user);
    // The run's id is the first the server hands out; the attacker is told it.
    let stub_script = |addr: &str| {
        script([
            attack_turn(launch, &format!("{mode} {addr} run-1")),
            escape_turn(),
            Turn::text("done"),
        ])
    };
    // The port is known once the server listens: start the stub's script after, through a
    // fixed port picked now.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let addr = format!("127.0.0.1:{port}");
    let stub = Stub::start(&ws, &stub_script(&addr));
    let mut cmd = serve_command(&ws, &stub, &["--sandbox", sandbox], &[]);
    // serve_command binds 127.0.0.1:0; a later --addr wins.
    cmd.args(["--addr", &addr]);
    if let Some(user) = user {
        as_user(&mut cmd, user);
    }
    let server = Serve::spawn(cmd);
    let run = start_run(server.addr, json!({"prompt": "go"}));
    assert_eq!(run, "run-1");
    let prompt = wait_prompt_for(server.addr, &run, "toolu_attack");
    assert_eq!(prompt["tool_use_id"], "toolu_attack");
    let ok = post_json(
        server.addr,
        &format!("/runs/{run}/permit"),
        &json!({"tool_use_id": "toolu_attack", "allow": true}),
    );
    assert_eq!(ok.status, 200, "{ok:?}");
    wait_prompt_for(server.addr, &run, "toolu_esc");
    wait_attempts(&ws, "POST /runs/run-1/permit", 3);
    std::thread::sleep(Duration::from_millis(500));
    let log = attack_log(&ws);
    let context = format!(
        "[{sandbox} {launch:?} {user:?}]\nattack.log:\n{log}\nstderr:\n{}",
        server.stderr()
    );
    assert!(
        !ws.path("escaped").exists(),
        "the run permitted itself {context}"
    );
    for line in log.lines() {
        assert!(
            line.contains(" 403 ") && line.contains("cannot be a client of caliban"),
            "not refused: {line} {context}"
        );
    }
    // The test's own loopback client is served as ever, and the prompt waits for it.
    let list = get(server.addr, "/runs");
    assert_eq!(list.status, 200, "{list:?}");
    assert_eq!(
        events_page(server.addr, &run, u64::MAX)["permission_request"]["tool_use_id"],
        "toolu_esc"
    );
    let no = post_json(
        server.addr,
        &format!("/runs/{run}/permit"),
        &json!({"tool_use_id": "toolu_esc", "allow": false}),
    );
    assert_eq!(no.status, 200, "{no:?}");
    assert!(server.stderr().contains("cannot be a client of caliban"));
}

fn wait_prompt_for(addr: std::net::SocketAddr, run: &str, id: &str) -> Value {
    let deadline = Instant::now() + RECV;
    loop {
        let page = events_page(addr, run, u64::MAX);
        let prompt = page["permission_request"].clone();
        if prompt["tool_use_id"] == id {
            return prompt;
        }
        assert!(
            Instant::now() < deadline,
            "no prompt for {id} on {run}: {page}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn selfclient_a_command_in_network_mode_cannot_permit_itself_over_http_serve() {
    for user in users() {
        http_case("network", Launch::Background, user);
    }
}

#[test]
fn selfclient_a_socket_held_by_no_process_while_accepted_is_refused() {
    // The command writes its request, then keeps its socket in flight on a socketpair
    // (SCM_RIGHTS) so that no descendant holds it when caliban looks: found nowhere, it is
    // refused, as one a descendant holds is.
    for user in users() {
        http_case_with("inflight", "network", Launch::Background, user);
    }
}

#[test]
fn selfclient_unsandboxed_and_daemonised_commands_are_refused_by_http_serve() {
    for user in users() {
        http_case("off", Launch::Background, user);
        http_case("off", Launch::Daemon, user);
    }
}

/// `mcp serve --listen` trusts loopback the same way: the test drives a run over stdio (the
/// supervisor), and the run's command, in `network` mode, POSTs to the listener: 403, while
/// the test's own loopback client opens a session there.
fn mcp_case(user: Option<(u32, u32)>) {
    let ws = workspace("selfclient-mcp", user);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let addr = format!("127.0.0.1:{port}");
    let stub = Stub::start(
        &ws,
        &script([
            attack_turn(Launch::Background, &format!("mcp {addr}")),
            Turn::bare()
                .calling([Call::bash("toolu_wait", "sleep 3")])
                .usage(1, 1),
            Turn::text("done"),
        ]),
    );
    let mut cmd = caliban_stub(
        &ws,
        &stub,
        &[
            "mcp",
            "serve",
            "--listen",
            &addr,
            "--sandbox",
            "network",
            "--permission-mode",
            "bypassPermissions",
        ],
    );
    if let Some(user) = user {
        as_user(&mut cmd, user);
    }
    let mut peer = crate::util::rpc::Peer::spawn(cmd, RECV);
    let sock = peer.listen_addr("caliban mcp serve");
    peer.mcp_initialize("2025-06-18", json!({}), "supervisor");
    let started = peer.tool_body(2, "caliban_run", json!({"prompt": "go"}));
    let run = started["run_id"].as_str().expect("run_id").to_owned();
    wait_attempts(&ws, "POST /mcp", 3);
    let log = attack_log(&ws);
    let context = format!("[{user:?}]\nattack.log:\n{log}\nstderr:\n{}", peer.stderr());
    for line in log.lines() {
        assert!(
            line.contains(" 403 ") && line.contains("cannot be a client of caliban"),
            "not refused: {line} {context}"
        );
    }
    // The test's own loopback client is served.
    let init = crate::util::http::request(
        sock,
        "POST",
        "/mcp",
        &[
            ("content-type", "application/json"),
            ("accept", "application/json, text/event-stream"),
        ],
        json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params":
               {"protocolVersion": "2025-06-18", "capabilities": {},
                "clientInfo": {"name": "t", "version": "1"}}})
        .to_string()
        .as_bytes(),
    );
    assert_eq!(init.status, 200, "{init:?} {context}");
    let _ = peer.tool_body(3, "caliban_cancel", json!({"run_id": run}));
}

#[test]
fn selfclient_mcp_listen_refuses_a_runs_command() {
    for user in users() {
        mcp_case(user);
    }
}

// ---- a newer client never takes the client role silently --------------------------------------

fn start_socket_agent(ws: &Workspace, stub: &Stub, socket: &str, spec: &Value) -> Agent {
    spawn_agent(ws, stub, socket, spec, &[], None)
}

#[test]
fn selfclient_a_replaced_client_is_told_before_its_connection_closes() {
    // The NDJSON plane: the supervisor waits on a prompt when a newer client comes.
    let ws = Workspace::new("selfclient-replaced");
    let socket = path_str(&ws.path("agent.sock"));
    let stub = Stub::start(&ws, &script([escape_turn(), Turn::text("done")]));
    let spec = json!({"initial_prompt": "go", "permission_posture": "supervised"});
    let agent = start_socket_agent(&ws, &stub, &socket, &spec);
    let mut first = Lines::connect(Path::new(&socket));
    first.recv_until(prompt_for("toolu_esc"));
    let mut second = Lines::connect(Path::new(&socket));
    let told = first.recv().expect("the replaced client was told nothing");
    assert_eq!(told["type"], "Error", "{told}");
    assert!(
        told["error"]
            .as_str()
            .unwrap_or_default()
            .starts_with("replaced:"),
        "{told}"
    );
    assert!(first.recv().is_none(), "the replaced connection stays open");
    second.recv_until(prompt_for("toolu_esc"));
    drop(agent);

    // ACP over the socket: a JSON-RPC notification of caliban's own.
    let ws = Workspace::new("selfclient-replaced-acp");
    let socket = path_str(&ws.path("acp.sock"));
    let stub = Stub::start(&ws, &script([]));
    let spec = json!({"drive_protocol": "acp"});
    let _agent = start_socket_agent(&ws, &stub, &socket, &spec);
    let mut first = Lines::connect(Path::new(&socket));
    // The first is the client once the agent has read its connection.
    first.send(&json!({"jsonrpc": "2.0", "id": 1, "method": "nonsense"}));
    first.recv().expect("an answer");
    let _second = Lines::connect(Path::new(&socket));
    let told = first.recv().expect("the replaced client was told nothing");
    assert_eq!(told["method"], "_caliban/replaced", "{told}");
    assert!(first.recv().is_none(), "the replaced connection stays open");
}

#[test]
fn selfclient_the_agents_socket_is_hidden_from_a_sandboxed_command() {
    let ws = Workspace::new("selfclient-hidden");
    let socket = path_str(&ws.path("agent.sock"));
    let probe =
        format!("if [ -S {socket} ]; then echo SOCKET-VISIBLE; else echo SOCKET-HIDDEN; fi");
    let stub = Stub::start(
        &ws,
        &script([
            Turn::bare()
                .calling([Call::bash("toolu_probe", &probe)])
                .usage(1, 1),
            Turn::text("done"),
        ]),
    );
    let spec = json!({"initial_prompt": "go", "permission_posture": "unattended"});
    let agent = start_socket_agent(&ws, &stub, &socket, &spec);
    let mut client = Lines::connect(Path::new(&socket));
    let lines = client.recv_until(|l| l["type"] == "ToolCallEnd");
    let result = lines.last().unwrap()["result_text"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    // As root the mount namespace fences commands; so it does elsewhere where user
    // namespaces are allowed. Landlock alone (before ABI 9) cannot hide a socket: there the
    // front's refusal is the gate.
    if ordinary_user().is_some() {
        assert!(
            result.contains("SOCKET-HIDDEN"),
            "{result}\n{}",
            agent.stderr.text()
        );
    } else {
        eprintln!("not root: the probe said {result}");
    }
}

// ---- finding 15: the preamble's keys, a socket client's Resume --------------------------------

#[test]
fn selfclient_a_socket_client_may_send_resume_a_moment_after_connecting() {
    let ws = Workspace::new("selfclient-resume");
    let socket = path_str(&ws.path("agent.sock"));
    let stub = Stub::start(&ws, &script([Turn::text("one two three")]));
    let spec = json!({"initial_prompt": "go", "permission_posture": "unattended"});
    let agent = start_socket_agent(&ws, &stub, &socket, &spec);
    // The whole run, to know its events.
    let mut first = Lines::connect(Path::new(&socket));
    let all: Vec<Value> = std::iter::from_fn(|| first.recv()).collect();
    assert_eq!(all.last().unwrap()["type"], "RunEnd", "{all:?}");
    // Connect, wait a little (no preamble to send it with), then resume from cursor 2.
    let mut client = Lines::connect(Path::new(&socket));
    std::thread::sleep(Duration::from_millis(100));
    client.send(&json!({"type": "Resume", "cursor": 2}));
    let rest: Vec<Value> = std::iter::from_fn(|| client.recv()).collect();
    assert_eq!(rest, all[2..], "{}", agent.stderr.text());
}
