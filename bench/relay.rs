//! Relay, run with `cargo bench --bench relay`: many concurrent runs streaming text from
//! `caliban stub-model` to clients through each surface, against a raw loopback byte relay
//! measured in the same run.
//!
//! Every run's model turn is `RELAY_EVENTS` text deltas, each stamped by the stub with the
//! time it is written (`"stamps"` in the stub's script), so a client measures the latency from
//! the model's byte to its own byte. Four ways from the stub to the client, each with
//! `RELAY_RUNS` runs at once:
//!
//! - **raw**: a relay in this bench (one thread, one `mio` loop) reads each model stream and
//!   writes its bytes to a loopback socket the client reads: the floor for any relay here;
//! - **http**: one `caliban http serve`, a `?follow=1` NDJSON stream per run;
//! - **mcp**: one `caliban mcp serve` on stdio, a `caliban_poll` long-poll (`wait_ms`) per
//!   run, the next sent as soon as the last is answered;
//! - **acp**: one `caliban acp serve` on stdio, a session per run, `session/update` chunks.
//!
//! Each surface runs twice: paced (`RELAY_DRIP_MS` between a run's events: latency under a
//! steady load) and flat out (no pause: throughput, events per second). The stub holds every
//! stream's first byte until a moment chosen before any run starts (`start_at_ms`), well after
//! all clients will have attached, so the load is the same for every way however long its
//! runs take to set up one by one (a surface that starts a run per HTTP request takes seconds
//! for a thousand): flat out, every stream starts at that one instant; paced, the runs' starts
//! are spread evenly over one pause. Clients scan whatever
//! they read for stamps (`@` and 19 digits); a stamp seen again (a `TurnEnd` repeats the text)
//! counts once. Figures are medians of nothing: one run of each, on a shared machine, so the
//! ratio to the raw relay of the same run is the figure to quote. `CALIBAN_BIN` measures another
//! build of caliban (an older one, side by side); the stub is always this build's.

use std::collections::HashSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use mio::net::TcpStream as MioStream;
use mio::{Events, Interest, Poll, Token};
use serde_json::{Value, json};

#[path = "common.rs"]
mod common;

const BUILT: &str = env!("CARGO_BIN_EXE_caliban");

/// The caliban to measure: `CALIBAN_BIN` (another build, side by side), else this one.
fn bin() -> String {
    std::env::var("CALIBAN_BIN").unwrap_or_else(|_| BUILT.to_owned())
}
/// No phase may take longer than this; a stuck surface fails the bench instead of hanging it.
const PHASE_DEADLINE: Duration = Duration::from_secs(600);
/// A phase in which nothing arrives for this long is over (what is missing is reported).
const STALL: Duration = Duration::from_secs(30);

fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// What a client saw: one latency per stamped event, first and last receipt.
#[derive(Default)]
struct Seen {
    stamps: HashSet<u64>,
    latencies: Vec<u64>,
    first_stamp: u64,
    last_receipt: u64,
}

impl Seen {
    /// Scans `bytes`, read at `at`, for stamps; `carry` holds a connection's last bytes, so a
    /// stamp cut between two reads is found whole.
    fn scan(&mut self, carry: &mut Vec<u8>, bytes: &[u8], at: u64) {
        carry.extend_from_slice(bytes);
        let mut i = 0;
        while let Some(off) = carry[i..].iter().position(|&b| b == b'@') {
            let start = i + off + 1;
            let end = start + 19;
            if end > carry.len() {
                break;
            }
            let digits = &carry[start..end];
            if digits.iter().all(u8::is_ascii_digit) {
                let stamp: u64 = std::str::from_utf8(digits).unwrap().parse().unwrap();
                if self.stamps.insert(stamp) {
                    self.latencies.push(at.saturating_sub(stamp));
                    if self.first_stamp == 0 || stamp < self.first_stamp {
                        self.first_stamp = stamp;
                    }
                    self.last_receipt = self.last_receipt.max(at);
                }
            }
            i = start;
        }
        let keep = carry.len().min(20);
        carry.drain(..carry.len() - keep);
    }
}

struct Figures {
    events: usize,
    p50_us: f64,
    p99_us: f64,
    per_sec: f64,
    cpu_us_per_event: Option<f64>,
}

fn figures(mut seen: Seen, cpu_secs: Option<f64>) -> Figures {
    seen.latencies.sort_unstable();
    let n = seen.latencies.len().max(1);
    let pick = |q: f64| {
        seen.latencies
            .get(((n as f64 * q) as usize).min(n - 1))
            .copied()
    };
    let secs = (seen.last_receipt.saturating_sub(seen.first_stamp)) as f64 / 1e9;
    Figures {
        events: seen.latencies.len(),
        p50_us: pick(0.5).unwrap_or(0) as f64 / 1e3,
        p99_us: pick(0.99).unwrap_or(0) as f64 / 1e3,
        per_sec: seen.latencies.len() as f64 / secs.max(1e-9),
        cpu_us_per_event: cpu_secs.map(|s| s * 1e6 / seen.latencies.len().max(1) as f64),
    }
}

/// User + system CPU seconds a process has used.
fn cpu_secs(pid: u32) -> f64 {
    stat_cpu_secs(&format!("/proc/{pid}/stat"))
}

/// utime + stime of a `/proc/…/stat` file, in seconds (at the usual 100 ticks a second).
fn stat_cpu_secs(path: &str) -> f64 {
    let stat = std::fs::read_to_string(path).unwrap_or_default();
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = fields.get(11..13).map_or(0.0, |f| {
        f.iter().filter_map(|v| v.parse::<f64>().ok()).sum()
    });
    ticks / 100.0
}

struct Setup {
    runs: usize,
    events: u64,
    drip_ms: u64,
    /// Time after the script is written for every client to attach before the first byte.
    lead_ms: u64,
    /// The moment the script holds the first byte until (set per way by `write_script`).
    start_ms: u64,
}

/// Called once a way's clients are attached: a setup that ran past the start skews that
/// way's figures (its first runs streamed while others were still being set up), so say so.
fn attached(s: &Setup, way: &str) {
    let now = now_ms();
    if now > s.start_ms {
        println!(
            "       ({way}: clients attached {} ms after the start; raise RELAY_LEAD_MS)",
            now - s.start_ms
        );
    }
}

fn now_ms() -> u64 {
    now_ns() / 1_000_000
}

/// A script of one turn per run: `events` stamps, `drip_ms` apart, the first held until a
/// moment `lead_ms` from now (spread over one `drip_ms` when paced). Returns the script and
/// that moment.
fn write_script(dir: &std::path::Path, s: &Setup) -> (std::path::PathBuf, u64) {
    let start_ms = now_ms() + s.lead_ms;
    let turns: Vec<Value> = (0..s.runs as u64)
        .map(|i| {
            let at = start_ms + i * s.drip_ms / s.runs as u64;
            json!({"stamps": s.events, "faults": [{"start_at_ms": at, "drip_ms": s.drip_ms}]})
        })
        .collect();
    let script = json!({"turns": turns});
    let path = dir.join(format!("script-{}-{}.json", s.drip_ms, s.runs));
    std::fs::write(&path, script.to_string()).expect("script");
    (path, start_ms)
}

fn serve(dir: &std::path::Path, stub_url: &str, args: &[&str], runs: usize) -> Child {
    let runs = runs.to_string();
    let conns = (2 * runs.parse::<usize>().unwrap() + 64).to_string();
    let mut cmd = Command::new(bin());
    cmd.env_clear()
        .env("ANTHROPIC_BASE_URL", stub_url)
        .env("HOME", dir)
        .env("XDG_STATE_HOME", dir.join("state"))
        .args(args)
        .args(["--max-working-runs", &runs, "--max-live-runs", &runs])
        .arg("-C")
        .arg(dir);
    if args[0] == "http" {
        cmd.args(["--max-connections", &conns]);
    }
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("serve")
}

/// Reads every socket of `streams` until each has closed or all `expected` stamps arrived.
fn read_all(streams: Vec<MioStream>, expected: usize) -> Seen {
    let mut poll = Poll::new().expect("poll");
    let mut conns: Vec<(MioStream, Vec<u8>, bool)> = Vec::new();
    for (i, mut s) in streams.into_iter().enumerate() {
        poll.registry()
            .register(&mut s, Token(i), Interest::READABLE)
            .expect("register");
        conns.push((s, Vec::new(), true));
    }
    let mut seen = Seen::default();
    let mut events = Events::with_capacity(1024);
    let mut buf = vec![0u8; 64 * 1024];
    let deadline = Instant::now() + PHASE_DEADLINE;
    let mut open = conns.len();
    let mut progress = Instant::now();
    while open > 0
        && seen.latencies.len() < expected
        && Instant::now() < deadline
        && progress.elapsed() < STALL
    {
        poll.poll(&mut events, Some(Duration::from_millis(500)))
            .expect("poll");
        if !events.is_empty() {
            progress = Instant::now();
        }
        for ev in &events {
            let (stream, carry, live) = &mut conns[ev.token().0];
            loop {
                match stream.read(&mut buf) {
                    Ok(0) => {
                        if *live {
                            *live = false;
                            open -= 1;
                        }
                        break;
                    }
                    Ok(n) => seen.scan(carry, &buf[..n], now_ns()),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(_) => {
                        if *live {
                            *live = false;
                            open -= 1;
                        }
                        break;
                    }
                }
            }
        }
    }
    seen
}

fn http_request(addr: &str, method: &str, path: &str, body: &str) -> TcpStream {
    let mut stream = TcpStream::connect(addr).expect("connect");
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("send");
    stream
}

fn anthropic_request(stub: &str) -> TcpStream {
    let body = r#"{"model":"m","max_tokens":64,"stream":true,"messages":[{"role":"user","content":"go"}]}"#;
    let addr = stub.trim_start_matches("http://");
    let mut stream = TcpStream::connect(addr).expect("connect stub");
    write!(
        stream,
        "POST /v1/messages HTTP/1.1\r\nhost: {addr}\r\nanthropic-version: 2023-06-01\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("send");
    stream
}

/// The floor: this bench's own relay, one thread and one `mio` loop, moving each model
/// stream's bytes to a loopback socket as they come.
fn raw(stub: &str, s: &Setup) -> Figures {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let mut pairs = Vec::new();
    let mut clients = Vec::new();
    for _ in 0..s.runs {
        let up = anthropic_request(stub);
        let client = TcpStream::connect(addr).expect("connect relay");
        let (down, _) = listener.accept().expect("accept");
        for sock in [&up, &down, &client] {
            sock.set_nonblocking(true).expect("nonblocking");
            sock.set_nodelay(true).expect("nodelay");
        }
        pairs.push((MioStream::from_std(up), MioStream::from_std(down)));
        clients.push(MioStream::from_std(client));
    }
    attached(s, "raw");
    let runs = s.runs;
    // The stub keeps its connections alive after a turn: the relay runs until told to stop.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stopped = stop.clone();
    let relay = std::thread::spawn(move || {
        let cpu_start = thread_cpu();
        let mut poll = Poll::new().expect("poll");
        // Token 2i is pair i's model side, 2i + 1 its client side (writable when a write
        // would have blocked and bytes wait in `pending`).
        for (i, (up, down)) in pairs.iter_mut().enumerate() {
            poll.registry()
                .register(up, Token(2 * i), Interest::READABLE)
                .expect("register");
            poll.registry()
                .register(down, Token(2 * i + 1), Interest::WRITABLE)
                .expect("register");
        }
        let mut pending: Vec<Vec<u8>> = vec![Vec::new(); runs];
        let mut events = Events::with_capacity(1024);
        let mut buf = vec![0u8; 64 * 1024];
        let deadline = Instant::now() + PHASE_DEADLINE;
        while Instant::now() < deadline && !stopped.load(Ordering::Relaxed) {
            poll.poll(&mut events, Some(Duration::from_millis(100)))
                .expect("poll");
            for ev in &events {
                let i = ev.token().0 / 2;
                let (up, down) = &mut pairs[i];
                if !flush(down, &mut pending[i]) {
                    continue; // the client is behind: read more once it caught up
                }
                loop {
                    match up.read(&mut buf) {
                        Ok(0) => break,
                        Ok(n) => {
                            pending[i].extend_from_slice(&buf[..n]);
                            if !flush(down, &mut pending[i]) {
                                break;
                            }
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                        Err(_) => break,
                    }
                }
            }
        }
        thread_cpu() - cpu_start
    });
    let seen = read_all(clients, s.runs * s.events as usize);
    stop.store(true, Ordering::Relaxed);
    let cpu = relay.join().expect("relay");
    figures(seen, Some(cpu))
}

/// Writes what `pending` holds; false when the socket took only part of it.
fn flush(stream: &mut MioStream, pending: &mut Vec<u8>) -> bool {
    while !pending.is_empty() {
        match stream.write(pending) {
            Ok(n) => {
                pending.drain(..n);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
            Err(_) => {
                pending.clear();
                return true;
            }
        }
    }
    true
}

/// CPU seconds the calling thread has used.
fn thread_cpu() -> f64 {
    stat_cpu_secs("/proc/thread-self/stat")
}

fn http(dir: &std::path::Path, stub: &str, s: &Setup) -> Figures {
    let mut server = serve(
        dir,
        stub,
        &["http", "serve", "--addr", "127.0.0.1:0"],
        s.runs,
    );
    let mut line = String::new();
    BufReader::new(server.stderr.take().expect("stderr"))
        .read_line(&mut line)
        .expect("banner");
    let addr = line
        .trim()
        .rsplit(' ')
        .next()
        .unwrap_or_default()
        .trim_start_matches("http://")
        .to_owned();
    let mut ids = Vec::new();
    for _ in 0..s.runs {
        let mut post = http_request(&addr, "POST", "/runs", r#"{"prompt":"go"}"#);
        let mut reply = Vec::new();
        let mut buf = [0u8; 4096];
        while !reply.ends_with(b"}") {
            let n = post.read(&mut buf).expect("read");
            assert!(n > 0, "POST /runs: {}", String::from_utf8_lossy(&reply));
            reply.extend_from_slice(&buf[..n]);
        }
        let text = String::from_utf8_lossy(&reply);
        let id = text.split("\"run_id\":\"").nth(1).expect("run_id");
        ids.push(id.split('"').next().unwrap_or_default().to_owned());
    }
    let follows = ids
        .iter()
        .map(|id| {
            let stream = http_request(
                &addr,
                "GET",
                &format!("/runs/{id}/events?cursor=0&follow=1"),
                "",
            );
            stream.set_nonblocking(true).expect("nonblocking");
            MioStream::from_std(stream)
        })
        .collect();
    attached(s, "http");
    let cpu_start = cpu_secs(server.id());
    let seen = read_all(follows, s.runs * s.events as usize);
    let cpu = cpu_secs(server.id()) - cpu_start;
    let _ = server.kill();
    let _ = server.wait();
    figures(seen, Some(cpu))
}

/// A stdio surface's child, its stdin, and a thread that hands each stdout line over with the
/// time it was read.
struct Stdio2 {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<(u64, String)>,
}

fn stdio(dir: &std::path::Path, stub: &str, surface: &str, runs: usize) -> Stdio2 {
    let mut child = serve(dir, stub, &[surface, "serve"], runs);
    let stdin = child.stdin.take().expect("stdin");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        let mut reader = BufReader::with_capacity(256 * 1024, stdout);
        loop {
            let mut line = String::new();
            match reader.read_line(&mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {
                    if tx.send((now_ns(), line)).is_err() {
                        return;
                    }
                }
            }
        }
    });
    Stdio2 {
        child,
        stdin,
        lines,
    }
}

impl Stdio2 {
    fn send(&mut self, msg: Value) {
        let mut line = msg.to_string();
        line.push('\n');
        self.stdin.write_all(line.as_bytes()).expect("write");
    }

    /// The reply to request `id`, passing other lines to `other`.
    fn reply(&mut self, id: u64, other: &mut dyn FnMut(u64, &str)) -> Value {
        loop {
            let (at, line) = self
                .lines
                .recv_timeout(Duration::from_secs(60))
                .expect("a reply");
            let msg: Value = serde_json::from_str(&line).expect("json line");
            if msg["id"].as_u64() == Some(id) && msg.get("method").is_none() {
                return msg;
            }
            other(at, &line);
        }
    }

    fn stop(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn mcp(dir: &std::path::Path, stub: &str, s: &Setup) -> Figures {
    let mut io = stdio(dir, stub, "mcp", s.runs);
    io.send(json!({"jsonrpc":"2.0","id":0,"method":"initialize","params":{
        "protocolVersion":"2025-11-25","capabilities":{},"clientInfo":{"name":"relay","version":"0"}}}));
    io.reply(0, &mut |_, _| {});
    io.send(json!({"jsonrpc":"2.0","method":"notifications/initialized"}));
    let mut runs = Vec::new();
    for i in 0..s.runs as u64 {
        let id = 1 + i;
        io.send(json!({"jsonrpc":"2.0","id":id,"method":"tools/call",
            "params":{"name":"caliban_run","arguments":{"prompt":"go"}}}));
        let reply = io.reply(id, &mut |_, _| {});
        let text = reply["result"]["content"][0]["text"]
            .as_str()
            .unwrap_or("{}");
        let run: Value = serde_json::from_str(text).expect("run body");
        runs.push((run["run_id"].as_str().expect("run_id").to_owned(), 0u64));
    }
    // One long-poll per run in flight; request ids past the runs say which run they poll.
    let base = 1_000_000u64;
    let poll = |run: &str, cursor: u64, id: u64| {
        json!({"jsonrpc":"2.0","id":id,"method":"tools/call","params":{"name":"caliban_poll",
            "arguments":{"run_id":run,"cursor":cursor,"wait_ms":30000}}})
    };
    let mut seq = 0u64;
    let cpu_start = cpu_secs(io.child.id());
    for (i, (run, cursor)) in runs.iter().enumerate() {
        io.send(poll(run, *cursor, base + seq * s.runs as u64 + i as u64));
    }
    attached(s, "mcp");
    let mut seen = Seen::default();
    let mut carry = Vec::new();
    let mut done = 0;
    let deadline = Instant::now() + PHASE_DEADLINE;
    let expected = s.runs * s.events as usize;
    while done < s.runs && seen.latencies.len() < expected && Instant::now() < deadline {
        let Ok((at, line)) = io.lines.recv_timeout(Duration::from_secs(60)) else {
            break;
        };
        carry.clear();
        seen.scan(&mut carry, line.as_bytes(), at);
        let msg: Value = serde_json::from_str(&line).expect("json line");
        let Some(id) = msg["id"].as_u64().filter(|&id| id >= base) else {
            continue;
        };
        let i = ((id - base) % s.runs as u64) as usize;
        // The body is also the answer's `structuredContent`: reading it there spares the
        // client a second parse per event, time that would otherwise count as latency.
        let mut msg = msg;
        let body = match msg["result"]["structuredContent"].take() {
            Value::Null => {
                let text = msg["result"]["content"][0]["text"].as_str().unwrap_or("{}");
                serde_json::from_str(text).unwrap_or(Value::Null)
            }
            body => body,
        };
        let state = body["status"]["state"].as_str().unwrap_or("");
        runs[i].1 = body["next_cursor"].as_u64().unwrap_or(runs[i].1);
        if (state == "done" || state == "failed")
            && body["events"].as_array().is_some_and(Vec::is_empty)
        {
            done += 1;
            continue;
        }
        seq += 1;
        let next = poll(&runs[i].0, runs[i].1, base + seq * s.runs as u64 + i as u64);
        io.send(next);
    }
    let cpu = cpu_secs(io.child.id()) - cpu_start;
    io.stop();
    figures(seen, Some(cpu))
}

fn acp(dir: &std::path::Path, stub: &str, s: &Setup) -> Figures {
    let mut io = stdio(dir, stub, "acp", s.runs);
    io.send(
        json!({"jsonrpc":"2.0","id":0,"method":"initialize","params":{
        "protocolVersion":1,"clientCapabilities":{}}}),
    );
    io.reply(0, &mut |_, _| {});
    let mut sessions = Vec::new();
    for i in 0..s.runs as u64 {
        let id = 1 + i;
        io.send(json!({"jsonrpc":"2.0","id":id,"method":"session/new",
            "params":{"cwd":dir,"mcpServers":[]}}));
        let reply = io.reply(id, &mut |_, _| {});
        sessions.push(
            reply["result"]["sessionId"]
                .as_str()
                .expect("sessionId")
                .to_owned(),
        );
    }
    let base = 1_000_000u64;
    let cpu_start = cpu_secs(io.child.id());
    for (i, session) in sessions.iter().enumerate() {
        io.send(
            json!({"jsonrpc":"2.0","id":base + i as u64,"method":"session/prompt",
            "params":{"sessionId":session,"prompt":[{"type":"text","text":"go"}]}}),
        );
    }
    attached(s, "acp");
    let mut seen = Seen::default();
    let mut carry = Vec::new();
    let mut done = 0;
    let deadline = Instant::now() + PHASE_DEADLINE;
    while done < s.runs && Instant::now() < deadline {
        let Ok((at, line)) = io.lines.recv_timeout(Duration::from_secs(60)) else {
            break;
        };
        carry.clear();
        seen.scan(&mut carry, line.as_bytes(), at);
        if line.contains("\"stopReason\"") {
            done += 1;
        }
    }
    let cpu = cpu_secs(io.child.id()) - cpu_start;
    io.stop();
    figures(seen, Some(cpu))
}

fn main() {
    let runs = common::env_num("RELAY_RUNS", 1000) as usize;
    let events = common::env_num("RELAY_EVENTS", 20);
    let drip_ms = common::env_num("RELAY_DRIP_MS", 200);
    let only = std::env::var("RELAY_ONLY").unwrap_or_default();
    let dir = std::env::temp_dir().join(format!("caliban-bench-relay-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    // Enough for every client to attach before the first model byte: about 4 ms a run here.
    let lead_ms = common::env_num("RELAY_LEAD_MS", 2000 + 6 * runs as u64);
    println!(
        "relay: {runs} concurrent runs x {events} stamped text deltas; paced {drip_ms} ms apart \
         (starts spread over {drip_ms} ms), then flat out (all start at once); first byte \
         {lead_ms} ms after each way's script is written"
    );
    let load = || std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("load average at the start: {}", load().trim());
    println!(
        "{:<6} {:<8} {:>8} {:>10} {:>10} {:>12} {:>10}",
        "way", "pace", "events", "p50 µs", "p99 µs", "events/s", "cpu µs/ev"
    );
    let phases = std::env::var("RELAY_PHASES").unwrap_or_else(|_| "paced,flat".to_owned());
    for (pace, drip) in [("paced", drip_ms), ("flat", 0)] {
        if !phases.split(',').any(|p| p == pace) {
            continue;
        }
        let mut floor: Option<(f64, f64, f64)> = None;
        for way in ["raw", "http", "mcp", "acp"] {
            if !only.is_empty() && way != "raw" && !only.split(',').any(|o| o == way) {
                continue;
            }
            let mut setup = Setup {
                runs,
                events,
                drip_ms: drip,
                lead_ms,
                start_ms: 0,
            };
            let (script, start_ms) = write_script(&dir, &setup);
            setup.start_ms = start_ms;
            let (mut stub, stub_url) = common::start_stub(BUILT, &script);
            let f = match way {
                "raw" => raw(&stub_url, &setup),
                "http" => http(&dir, &stub_url, &setup),
                "mcp" => mcp(&dir, &stub_url, &setup),
                _ => acp(&dir, &stub_url, &setup),
            };
            let _ = stub.kill();
            let _ = stub.wait();
            let cpu = f
                .cpu_us_per_event
                .map_or("-".to_owned(), |c| format!("{c:.1}"));
            // Paced, the rate is the stub's; only flat out is it the relay's.
            let rate = if drip == 0 {
                format!("{:.0}", f.per_sec)
            } else {
                "-".to_owned()
            };
            print!(
                "{way:<6} {pace:<8} {:>8} {:>10.0} {:>10.0} {rate:>12} {cpu:>10}",
                f.events, f.p50_us, f.p99_us
            );
            match floor {
                None => {
                    floor = Some((f.p50_us, f.p99_us, f.per_sec));
                    println!();
                }
                Some((p50, p99, rate)) => {
                    print!(
                        "   added p50 {:+.0} µs, p99 {:+.0} µs (x{:.2} raw's p99)",
                        f.p50_us - p50,
                        f.p99_us - p99,
                        f.p99_us / p99.max(1.0),
                    );
                    if drip == 0 {
                        print!(
                            "; {:.0}% of raw events/s",
                            100.0 * f.per_sec / rate.max(1.0)
                        );
                    }
                    println!();
                }
            }
            if f.events < runs * events as usize {
                println!(
                    "       ({} of {} stamped events arrived)",
                    f.events,
                    runs * events as usize
                );
            }
        }
    }
    println!("load average at the end: {}", load().trim());
    let _ = std::fs::remove_dir_all(&dir);
}
