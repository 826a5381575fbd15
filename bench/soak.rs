//! Soak, run with `cargo bench --bench soak`: many concurrent runs streaming through the real
//! release binary for a bounded time, against `caliban stub-model` injecting faults, with
//! clients that vanish mid-stream. Half the clients follow their run live
//! (`GET /runs/:id/events?follow=1` on `caliban http serve`), a quarter poll it
//! (`GET /runs/:id/events?cursor=N`, same server), a quarter drive it over MCP Streamable
//! HTTP (`caliban_run`/`caliban_poll` on a `caliban mcp serve --listen` process: `http serve`
//! has no MCP listener). Every client checks that the cursors it saw are dense and that what
//! it read equals the run's full event log afterwards; the report counts events lost,
//! duplicated or different (all must be 0), the servers' RSS, fds, threads and child
//! processes before and after, and latency percentiles.
//!
//! `SOAK_RUNS` (default 1000) concurrent clients, one run at a time each; `SOAK_SECS`
//! (default 60) before each client cancels the run it is on, reads it to its end, and
//! stops; `SOAK_DRIP_MS` (default 250)
//! between the stub's SSE events. Loopback only, every read has a timeout, and every child
//! is killed at the end.

use std::collections::BTreeMap;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

#[path = "common.rs"]
mod common;

const BIN: &str = env!("CARGO_BIN_EXE_caliban");
const READ_TIMEOUT: Duration = Duration::from_secs(30);

/// A small deterministic generator (xorshift), so a rerun injects the same faults.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

// ---------------------------------------------------------------------------------------
// Minimal HTTP/1.1 client: one request per connection, chunked bodies decoded.

struct Response {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Response {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    fn json(&self) -> io::Result<Value> {
        serde_json::from_slice(&self.body).map_err(|e| io::Error::other(e.to_string()))
    }
}

fn connect(addr: &str) -> io::Result<TcpStream> {
    let stream = TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(READ_TIMEOUT))?;
    stream.set_write_timeout(Some(READ_TIMEOUT))?;
    Ok(stream)
}

fn send(
    stream: &mut TcpStream,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> io::Result<()> {
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\ncontent-length: {}\r\n",
        body.len()
    );
    if !body.is_empty() {
        req.push_str("content-type: application/json\r\n");
    }
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    stream.write_all(req.as_bytes())
}

/// Reads a response head; returns status, headers and whether the body is chunked.
fn read_head(reader: &mut impl BufRead) -> io::Result<(u16, Vec<(String, String)>)> {
    let mut line = String::new();
    if reader.read_line(&mut line)? == 0 {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "no response"));
    }
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| io::Error::other(format!("bad status line {line:?}")))?;
    let mut headers = Vec::new();
    loop {
        line.clear();
        if reader.read_line(&mut line)? == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "head cut"));
        }
        let l = line.trim_end();
        if l.is_empty() {
            return Ok((status, headers));
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_owned(), v.trim().to_owned()));
        }
    }
}

fn is_chunked(headers: &[(String, String)]) -> bool {
    headers.iter().any(|(k, v)| {
        k.eq_ignore_ascii_case("transfer-encoding") && v.eq_ignore_ascii_case("chunked")
    })
}

/// Decodes a chunked body as it arrives.
struct Chunked<R> {
    inner: R,
    left: usize,
    done: bool,
}

impl<R: BufRead> Read for Chunked<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.done {
            return Ok(0);
        }
        if self.left == 0 {
            let mut line = String::new();
            if self.inner.read_line(&mut line)? == 0 {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "chunk cut"));
            }
            let size = line.trim().split(';').next().unwrap_or("");
            self.left = usize::from_str_radix(size, 16)
                .map_err(|_| io::Error::other(format!("bad chunk size {line:?}")))?;
            if self.left == 0 {
                self.done = true;
                return Ok(0);
            }
        }
        let n = buf.len().min(self.left);
        let got = self.inner.read(&mut buf[..n])?;
        if got == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "chunk cut"));
        }
        self.left -= got;
        if self.left == 0 {
            let mut crlf = [0u8; 2];
            self.inner.read_exact(&mut crlf)?;
        }
        Ok(got)
    }
}

fn request(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> io::Result<Response> {
    let mut stream = connect(addr)?;
    send(&mut stream, method, path, headers, body)?;
    let mut reader = BufReader::new(stream);
    let (status, headers) = read_head(&mut reader)?;
    let mut body = Vec::new();
    if is_chunked(&headers) {
        Chunked {
            inner: reader,
            left: 0,
            done: false,
        }
        .read_to_end(&mut body)?;
    } else {
        let len = headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
            .and_then(|(_, v)| v.parse::<usize>().ok());
        match len {
            Some(len) => {
                body.resize(len, 0);
                reader.read_exact(&mut body)?;
            }
            None => {
                reader.read_to_end(&mut body)?;
            }
        }
    }
    Ok(Response {
        status,
        headers,
        body,
    })
}

// ---------------------------------------------------------------------------------------
// What the clients count.

#[derive(Default)]
struct Stats {
    runs: AtomicU64,
    done: AtomicU64,
    failed: AtomicU64,
    events_read: AtomicU64,
    lost: AtomicU64,
    duplicated: AtomicU64,
    different: AtomicU64,
    vanished_resumed: AtomicU64,
    vanished_for_good: AtomicU64,
    busy_retries: AtomicU64,
    io_retries: AtomicU64,
    cancelled: AtomicU64,
    latencies: Mutex<BTreeMap<&'static str, Vec<Duration>>>,
}

impl Stats {
    fn add(&self, field: &AtomicU64, n: u64) {
        let _ = self;
        field.fetch_add(n, Ordering::Relaxed);
    }
    fn time(&self, what: &'static str, d: Duration) {
        self.latencies
            .lock()
            .unwrap()
            .entry(what)
            .or_default()
            .push(d);
    }
}

/// What one client read of one run: events by cursor (1-based), in the order read.
struct Seen {
    events: Vec<(u64, String)>,
}

/// Compares what a client read with the run's full log; counts into `stats`.
/// `complete` is true when the client read the run to its terminal status.
fn check(stats: &Stats, seen: &Seen, log: &[String], complete: bool) {
    let mut last = 0u64;
    for (cursor, event) in &seen.events {
        if *cursor <= last {
            stats.add(&stats.duplicated, 1);
            continue;
        }
        if *cursor > last + 1 {
            stats.add(&stats.lost, cursor - last - 1);
        }
        last = *cursor;
        match log.get(*cursor as usize - 1) {
            Some(e) if e == event => {}
            _ => stats.add(&stats.different, 1),
        }
    }
    if complete && (last as usize) < log.len() {
        stats.add(&stats.lost, log.len() as u64 - last);
    }
    stats.add(&stats.events_read, seen.events.len() as u64);
}

fn is_terminal(status: &Value) -> bool {
    matches!(status["state"].as_str(), Some("done" | "failed"))
}

// ---------------------------------------------------------------------------------------
// The HTTP drive API.

struct Http {
    addr: String,
}

impl Http {
    fn start(&self, stats: &Stats, prompt: &str, deadline: Instant) -> Option<String> {
        let body = json!({ "prompt": prompt }).to_string();
        while Instant::now() < deadline {
            let t = Instant::now();
            match request(&self.addr, "POST", "/runs", &[], &body) {
                Ok(r) if r.status == 201 || r.status == 200 => {
                    stats.time("http POST /runs", t.elapsed());
                    return r.json().ok()?["run_id"].as_str().map(str::to_owned);
                }
                Ok(r) if r.status == 503 => stats.add(&stats.busy_retries, 1),
                Ok(r) => panic!(
                    "POST /runs: {} {}",
                    r.status,
                    String::from_utf8_lossy(&r.body)
                ),
                Err(_) => stats.add(&stats.io_retries, 1),
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        None
    }

    /// One poll; returns (events as strings, next_cursor, status).
    fn poll(&self, stats: &Stats, id: &str, cursor: u64) -> (Vec<String>, u64, Value) {
        loop {
            let t = Instant::now();
            match request(
                &self.addr,
                "GET",
                &format!("/runs/{id}/events?cursor={cursor}"),
                &[],
                "",
            ) {
                Ok(r) if r.status == 200 => {
                    stats.time("http poll", t.elapsed());
                    let v = r.json().expect("poll json");
                    return poll_parts(&v);
                }
                Ok(r) => panic!(
                    "poll {id}: {} {}",
                    r.status,
                    String::from_utf8_lossy(&r.body)
                ),
                Err(_) => {
                    stats.add(&stats.io_retries, 1);
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
    }

    fn cancel(&self, stats: &Stats, id: &str) {
        for _ in 0..20 {
            match request(&self.addr, "POST", &format!("/runs/{id}/cancel"), &[], "") {
                Ok(_) => return,
                Err(_) => stats.add(&stats.io_retries, 1),
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The run's full log, read once it is terminal.
    fn full_log(&self, stats: &Stats, id: &str) -> Vec<String> {
        let mut log = Vec::new();
        loop {
            let (events, next, status) = self.poll(stats, id, log.len() as u64);
            assert_eq!(next, (log.len() + events.len()) as u64, "{id}: next_cursor");
            let empty = events.is_empty();
            log.extend(events);
            if empty && is_terminal(&status) {
                return log;
            }
            if empty {
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
}

fn poll_parts(v: &Value) -> (Vec<String>, u64, Value) {
    let events = v["events"]
        .as_array()
        .expect("events")
        .iter()
        .map(|e| e["event"].to_string())
        .collect();
    let next = v["next_cursor"].as_u64().expect("next_cursor");
    (events, next, v["status"].clone())
}

enum Outcome {
    /// Read to its terminal status.
    Finished(Value),
    /// The client vanished for good; what it read is checked once the run ends.
    Abandoned,
}

/// Follows a run live, vanishing (and resuming from the last cursor) now and then.
fn follow(
    http: &Http,
    stats: &Stats,
    id: &str,
    rng: &mut Rng,
    seen: &mut Seen,
    deadline: Instant,
) -> Outcome {
    let started = Instant::now();
    let mut cancelled = false;
    let mut cursor = 0u64;
    let mut first = true;
    loop {
        // One stream in 8 is cut after a few events and resumed; one run in 16 is left.
        let cut_after = if rng.below(8) == 0 {
            Some(1 + rng.below(12))
        } else {
            None
        };
        let abandon = rng.below(16) == 0;
        let t = Instant::now();
        let mut stream = match connect(&http.addr) {
            Ok(s) => s,
            Err(_) => {
                stats.add(&stats.io_retries, 1);
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        let path = format!("/runs/{id}/events?cursor={cursor}&follow=1");
        if send(&mut stream, "GET", &path, &[], "").is_err() {
            stats.add(&stats.io_retries, 1);
            continue;
        }
        let mut reader = BufReader::new(stream.try_clone().expect("clone"));
        let head = read_head(&mut reader);
        let Ok((200, headers)) = head else {
            stats.add(&stats.io_retries, 1);
            std::thread::sleep(Duration::from_millis(100));
            continue;
        };
        assert!(is_chunked(&headers), "{id}: follow stream not chunked");
        let mut lines = BufReader::new(Chunked {
            inner: reader,
            left: 0,
            done: false,
        });
        let mut n = 0u64;
        let mut line = String::new();
        let mut first_line = true;
        loop {
            line.clear();
            match lines.read_line(&mut line) {
                Ok(0) | Err(_) => {
                    // Cut by the server (write stall) or the network: resume.
                    stats.add(&stats.io_retries, 1);
                    break;
                }
                Ok(_) => {}
            }
            if first_line {
                stats.time("follow: connect to first line", t.elapsed());
                first_line = false;
            }
            if !cancelled && Instant::now() >= deadline {
                http.cancel(stats, id);
                cancelled = true;
            }
            let v: Value = serde_json::from_str(&line).expect("follow line json");
            if v.get("heartbeat").is_some() {
                continue;
            }
            if let Some(event) = v.get("event") {
                let c = v["cursor"].as_u64().expect("cursor");
                if first {
                    stats.time("follow: POST /runs to first event", started.elapsed());
                    first = false;
                }
                seen.events.push((c, event.to_string()));
                cursor = cursor.max(c);
                n += 1;
                if cut_after == Some(n) {
                    let _ = stream.shutdown(Shutdown::Both);
                    if abandon {
                        stats.add(&stats.vanished_for_good, 1);
                        return Outcome::Abandoned;
                    }
                    stats.add(&stats.vanished_resumed, 1);
                    break;
                }
            } else if let Some(status) = v.get("status")
                && is_terminal(status)
                && v.get("replay").is_none()
            {
                return Outcome::Finished(status.clone());
            }
        }
    }
}

/// Polls a run every `interval` until it is terminal; now and then sends a poll and hangs
/// up without reading the answer.
fn poll_run(
    http: &Http,
    stats: &Stats,
    id: &str,
    rng: &mut Rng,
    seen: &mut Seen,
    interval: Duration,
    deadline: Instant,
) -> Outcome {
    let mut cursor = 0u64;
    let mut cancelled = false;
    let abandon_at = if rng.below(16) == 0 {
        Some(1 + rng.below(6))
    } else {
        None
    };
    let mut polls = 0u64;
    loop {
        polls += 1;
        if rng.below(10) == 0
            && let Ok(mut s) = connect(&http.addr)
        {
            let path = format!("/runs/{id}/events?cursor={cursor}");
            let _ = send(&mut s, "GET", &path, &[], "");
            let _ = s.shutdown(Shutdown::Both);
            stats.add(&stats.vanished_resumed, 1);
        }
        let (events, next, status) = http.poll(stats, id, cursor);
        if next != cursor + events.len() as u64 {
            stats.add(&stats.different, 1);
        }
        for (i, e) in events.into_iter().enumerate() {
            seen.events.push((cursor + 1 + i as u64, e));
        }
        cursor = next;
        if is_terminal(&status) {
            return Outcome::Finished(status);
        }
        if abandon_at == Some(polls) {
            stats.add(&stats.vanished_for_good, 1);
            return Outcome::Abandoned;
        }
        if !cancelled && Instant::now() >= deadline {
            http.cancel(stats, id);
            cancelled = true;
        }
        std::thread::sleep(interval);
    }
}

// ---------------------------------------------------------------------------------------
// MCP Streamable HTTP.

struct Mcp {
    addr: String,
    session: String,
    next_id: u64,
}

const MCP_ACCEPT: (&str, &str) = ("accept", "application/json, text/event-stream");

impl Mcp {
    fn open(addr: &str, stats: &Stats) -> Mcp {
        let init = json!({"jsonrpc":"2.0","id":0,"method":"initialize","params":{
            "protocolVersion":"2025-06-18","capabilities":{},
            "clientInfo":{"name":"soak","version":"1"}}})
        .to_string();
        loop {
            let t = Instant::now();
            match request(addr, "POST", "/mcp", &[MCP_ACCEPT], &init) {
                Ok(r) if r.status == 200 => {
                    stats.time("mcp initialize", t.elapsed());
                    let session = r.header("mcp-session-id").expect("session id").to_owned();
                    let mcp = Mcp {
                        addr: addr.to_owned(),
                        session,
                        next_id: 1,
                    };
                    let note = json!({"jsonrpc":"2.0","method":"notifications/initialized"});
                    let _ = mcp.post(&note.to_string());
                    return mcp;
                }
                Ok(r) if r.status == 503 => stats.add(&stats.busy_retries, 1),
                Ok(r) => panic!(
                    "initialize: {} {}",
                    r.status,
                    String::from_utf8_lossy(&r.body)
                ),
                Err(_) => stats.add(&stats.io_retries, 1),
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn post(&self, body: &str) -> io::Result<Response> {
        request(
            &self.addr,
            "POST",
            "/mcp",
            &[MCP_ACCEPT, ("mcp-session-id", &self.session)],
            body,
        )
    }

    fn call_body(&mut self, tool: &str, args: Value) -> (u64, String) {
        let id = self.next_id;
        self.next_id += 1;
        let body = json!({"jsonrpc":"2.0","id":id,"method":"tools/call",
            "params":{"name":tool,"arguments":args}});
        (id, body.to_string())
    }

    /// Calls a tool; returns its `structuredContent`, or the error text of an `isError`
    /// result.
    fn call(&mut self, stats: &Stats, tool: &str, args: Value) -> Result<Value, String> {
        loop {
            let (id, body) = self.call_body(tool, args.clone());
            let r = match self.post(&body) {
                Ok(r) => r,
                Err(_) => {
                    stats.add(&stats.io_retries, 1);
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
            };
            assert_eq!(
                r.status,
                200,
                "{tool}: {}",
                String::from_utf8_lossy(&r.body)
            );
            let msg = if r
                .header("content-type")
                .is_some_and(|c| c.starts_with("text/event-stream"))
            {
                let text = String::from_utf8_lossy(&r.body).into_owned();
                text.lines()
                    .filter_map(|l| l.strip_prefix("data:"))
                    .filter_map(|d| serde_json::from_str::<Value>(d.trim()).ok())
                    .find(|m| m["id"].as_u64() == Some(id))
                    .expect("answer in SSE stream")
            } else {
                r.json().expect("json answer")
            };
            let result = &msg["result"];
            if result["isError"].as_bool() == Some(true) {
                return Err(result["content"][0]["text"].to_string());
            }
            return Ok(result["structuredContent"].clone());
        }
    }

    fn start(&mut self, stats: &Stats, prompt: &str, deadline: Instant) -> Option<String> {
        while Instant::now() < deadline {
            let t = Instant::now();
            match self.call(stats, "caliban_run", json!({ "prompt": prompt })) {
                Ok(v) => {
                    stats.time("mcp caliban_run", t.elapsed());
                    return v["run_id"].as_str().map(str::to_owned);
                }
                Err(e) if e.contains("too many runs") => stats.add(&stats.busy_retries, 1),
                Err(e) => panic!("caliban_run: {e}"),
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        None
    }

    fn poll(
        &mut self,
        stats: &Stats,
        id: &str,
        cursor: u64,
        wait_ms: u64,
    ) -> (Vec<String>, u64, Value) {
        let args = json!({"run_id": id, "cursor": cursor, "wait_ms": wait_ms});
        let v = self
            .call(stats, "caliban_poll", args)
            .unwrap_or_else(|e| panic!("caliban_poll {id}: {e}"));
        poll_parts(&v)
    }

    fn cancel(&mut self, stats: &Stats, id: &str) {
        let _ = self.call(stats, "caliban_cancel", json!({ "run_id": id }));
    }

    fn full_log(&mut self, stats: &Stats, id: &str) -> Vec<String> {
        let mut log = Vec::new();
        loop {
            let (events, next, status) = self.poll(stats, id, log.len() as u64, 1000);
            assert_eq!(next, (log.len() + events.len()) as u64, "{id}: next_cursor");
            let empty = events.is_empty();
            log.extend(events);
            if empty && is_terminal(&status) {
                return log;
            }
        }
    }

    /// Long-polls a run to its end; now and then hangs up on a waiting poll.
    fn drive(
        &mut self,
        stats: &Stats,
        id: &str,
        rng: &mut Rng,
        seen: &mut Seen,
        deadline: Instant,
    ) -> Outcome {
        let mut cursor = 0u64;
        let mut cancelled = false;
        let abandon_at = if rng.below(16) == 0 {
            Some(1 + rng.below(6))
        } else {
            None
        };
        let mut polls = 0u64;
        loop {
            polls += 1;
            if rng.below(10) == 0 {
                let (_, body) = self.call_body(
                    "caliban_poll",
                    json!({"run_id": id, "cursor": cursor, "wait_ms": 5000}),
                );
                if let Ok(mut s) = connect(&self.addr) {
                    let session = self.session.clone();
                    let _ = send(
                        &mut s,
                        "POST",
                        "/mcp",
                        &[MCP_ACCEPT, ("mcp-session-id", &session)],
                        &body,
                    );
                    std::thread::sleep(Duration::from_millis(50));
                    let _ = s.shutdown(Shutdown::Both);
                    stats.add(&stats.vanished_resumed, 1);
                }
            }
            let (events, next, status) = self.poll(stats, id, cursor, 5000);
            if next != cursor + events.len() as u64 {
                stats.add(&stats.different, 1);
            }
            for (i, e) in events.into_iter().enumerate() {
                seen.events.push((cursor + 1 + i as u64, e));
            }
            cursor = next;
            if is_terminal(&status) {
                return Outcome::Finished(status);
            }
            if abandon_at == Some(polls) {
                stats.add(&stats.vanished_for_good, 1);
                return Outcome::Abandoned;
            }
            if !cancelled && Instant::now() >= deadline {
                self.cancel(stats, id);
                cancelled = true;
            }
        }
    }

    fn close(&self) {
        let _ = request(
            &self.addr,
            "DELETE",
            "/mcp",
            &[("mcp-session-id", &self.session)],
            "",
        );
    }
}

// ---------------------------------------------------------------------------------------
// Clients.

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Follow,
    Poll,
    Mcp,
}

struct Plan {
    http: String,
    mcp: String,
    deadline: Instant,
    poll_interval: Duration,
}

fn client(n: usize, kind: Kind, plan: &Plan, stats: &Stats) {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (n as u64 + 1).wrapping_mul(0x2545_f491_4f6c_dd1d));
    let http = Http {
        addr: plan.http.clone(),
    };
    let mut mcp = (kind == Kind::Mcp).then(|| Mcp::open(&plan.mcp, stats));
    let mut abandoned: Vec<(String, Seen)> = Vec::new();
    let mut seq = 0;
    while Instant::now() < plan.deadline {
        seq += 1;
        let prompt = format!("soak client {n} run {seq}");
        let id = match mcp.as_mut() {
            Some(m) => m.start(stats, &prompt, plan.deadline),
            None => http.start(stats, &prompt, plan.deadline),
        };
        let Some(id) = id else { break };
        stats.add(&stats.runs, 1);
        let mut seen = Seen { events: Vec::new() };
        let outcome = match (kind, mcp.as_mut()) {
            (Kind::Follow, _) => follow(&http, stats, &id, &mut rng, &mut seen, plan.deadline),
            (Kind::Poll, _) => poll_run(
                &http,
                stats,
                &id,
                &mut rng,
                &mut seen,
                plan.poll_interval,
                plan.deadline,
            ),
            (Kind::Mcp, Some(m)) => m.drive(stats, &id, &mut rng, &mut seen, plan.deadline),
            (Kind::Mcp, None) => unreachable!(),
        };
        match outcome {
            Outcome::Finished(status) => {
                if status["state"] == "done" {
                    stats.add(&stats.done, 1);
                } else {
                    stats.add(&stats.failed, 1);
                }
                let log = match mcp.as_mut() {
                    Some(m) => m.full_log(stats, &id),
                    None => http.full_log(stats, &id),
                };
                check(stats, &seen, &log, true);
            }
            Outcome::Abandoned => abandoned.push((id, seen)),
        }
    }
    // Time is up: the runs this client left behind are cancelled, then what it read of them
    // is checked against their logs.
    for (id, seen) in abandoned {
        match mcp.as_mut() {
            Some(m) => {
                m.cancel(stats, &id);
                let log = m.full_log(stats, &id);
                check(stats, &seen, &log, false);
            }
            None => {
                http.cancel(stats, &id);
                let log = http.full_log(stats, &id);
                check(stats, &seen, &log, false);
            }
        }
        stats.add(&stats.cancelled, 1);
    }
    if let Some(m) = mcp {
        m.close();
    }
}

// ---------------------------------------------------------------------------------------
// Processes.

#[derive(Debug, Clone, Copy)]
struct Proc {
    rss_kib: u64,
    fds: usize,
    threads: u64,
    children: usize,
}

fn proc_stats(pid: u32) -> Proc {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0);
    let children = std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|tasks| {
            tasks
                .flatten()
                .map(|t| {
                    std::fs::read_to_string(t.path().join("children"))
                        .unwrap_or_default()
                        .split_whitespace()
                        .count()
                })
                .sum()
        })
        .unwrap_or(0);
    Proc {
        rss_kib: field("VmRSS:"),
        fds,
        threads: field("Threads:"),
        children,
    }
}

/// The address on the server's `… listening on http://ADDR` line on stderr.
fn listening_addr(child: &mut Child) -> String {
    let mut line = String::new();
    BufReader::new(child.stderr.take().expect("stderr"))
        .read_line(&mut line)
        .expect("banner");
    let url = line.trim().rsplit(' ').next().unwrap_or_default();
    url.trim_start_matches("http://")
        .trim_end_matches("/mcp")
        .to_owned()
}

/// The stub's script: a long list of turns, most calling `Glob` (so a run goes on) and some
/// ending the run, every one dripped, a share with a fault in front. The last (repeated)
/// turn ends runs, should the soak outlast the script.
fn script(turns: usize, drip_ms: u64) -> String {
    let mut rng = Rng(0x5eed_cafe_f00d_d00d);
    let mut out = Vec::with_capacity(turns + 1);
    for i in 0..turns {
        let mut turn =
            json!({"text": format!("turn {i}: reading the workspace files now, then deciding")});
        if rng.below(6) != 0 {
            turn["tool_calls"] = json!([{"name": "Glob", "input": {"pattern": "*.txt"}}]);
        }
        let mut faults = Vec::new();
        match rng.below(100) {
            0..=3 => faults.push(json!({"status": 529, "retry_after": "0"})),
            4..=5 => faults.push(json!({"status": 500})),
            _ => {}
        }
        let stream = match rng.below(100) {
            0..=3 => json!({"delay_ms": 500 + rng.below(1500), "drip_ms": drip_ms}),
            4..=5 => json!({"drop_after_events": 1 + rng.below(8), "drip_ms": drip_ms}),
            6..=7 => json!({"stall_after_events": 1 + rng.below(8), "drip_ms": drip_ms}),
            8 => json!({"ping_after_events": 2 + rng.below(6), "drip_ms": drip_ms}),
            _ => json!({"drip_ms": drip_ms}),
        };
        faults.push(stream);
        turn["faults"] = Value::Array(faults);
        out.push(turn);
    }
    out.push(json!({"text": "that is all", "faults": [{"drip_ms": drip_ms}]}));
    json!({"turns": out, "repeat_last": true}).to_string()
}

fn pct(sorted: &[Duration], p: usize) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[(sorted.len() * p / 100).min(sorted.len() - 1)].as_secs_f64() * 1e3
}

fn main() {
    let runs = common::env_num("SOAK_RUNS", 1000) as usize;
    let secs = common::env_num("SOAK_SECS", 60);
    let drip_ms = common::env_num("SOAK_DRIP_MS", 250);
    let poll_ms = common::env_num("SOAK_POLL_MS", 500);

    let dir = std::env::temp_dir().join(format!("caliban-bench-soak-{}", std::process::id()));
    let ws = dir.join("workspace");
    std::fs::create_dir_all(&ws).expect("dir");
    std::fs::write(ws.join("notes.txt"), "soak\n").expect("workspace file");
    let script_path = dir.join("script.json");
    std::fs::write(&script_path, script(runs * 60, drip_ms)).expect("script");
    let (mut stub, stub_url) = common::start_stub(BIN, &script_path);

    // Both servers: room for every run, more connections than clients, model timeouts short
    // enough that a stalled stream fails in seconds, and a short system prompt.
    let limits = [
        "--max-working-runs".to_owned(),
        (runs + runs / 4 + 16).to_string(),
        "--max-connections".to_owned(),
        (2 * runs + 64).to_string(),
        "--idle-timeout".to_owned(),
        "3".to_owned(),
        "--first-byte-timeout".to_owned(),
        "10".to_owned(),
        "--system-prompt".to_owned(),
        "You are a soak test.".to_owned(),
    ];
    let spawn = |args: &[&str], state: &str| {
        Command::new(BIN)
            .env_clear()
            .env("ANTHROPIC_BASE_URL", &stub_url)
            .env("HOME", &dir)
            .env("XDG_STATE_HOME", dir.join(state))
            .args(args)
            .args(&limits)
            .arg("-C")
            .arg(&ws)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("server")
    };
    let mut http_server = spawn(&["http", "serve", "--addr", "127.0.0.1:0"], "http-state");
    let mut mcp_server = spawn(&["mcp", "serve", "--listen", "127.0.0.1:0"], "mcp-state");
    let http_addr = listening_addr(&mut http_server);
    let mcp_addr = listening_addr(&mut mcp_server);
    std::thread::sleep(Duration::from_millis(300));
    let before = [proc_stats(http_server.id()), proc_stats(mcp_server.id())];

    let started = Instant::now();
    let plan = Arc::new(Plan {
        http: http_addr.clone(),
        mcp: mcp_addr.clone(),
        deadline: started + Duration::from_secs(secs),
        poll_interval: Duration::from_millis(poll_ms),
    });
    let stats = Arc::new(Stats::default());
    let mut handles = Vec::new();
    for n in 0..runs {
        let kind = match n % 4 {
            0 | 1 => Kind::Follow,
            2 => Kind::Poll,
            _ => Kind::Mcp,
        };
        let (plan, stats) = (Arc::clone(&plan), Arc::clone(&stats));
        handles.push(
            std::thread::Builder::new()
                .stack_size(256 * 1024)
                .spawn(move || client(n, kind, &plan, &stats))
                .expect("client thread"),
        );
        // Ramp up over about five seconds.
        std::thread::sleep(Duration::from_micros(5_000_000 / runs as u64));
    }

    // Sample the servers while the clients work.
    let mut peak = before;
    let mut live_runs_max = 0u64;
    while handles.iter().any(|h| !h.is_finished()) {
        std::thread::sleep(Duration::from_millis(500));
        for (i, pid) in [http_server.id(), mcp_server.id()].into_iter().enumerate() {
            let p = proc_stats(pid);
            peak[i].rss_kib = peak[i].rss_kib.max(p.rss_kib);
            peak[i].fds = peak[i].fds.max(p.fds);
            peak[i].threads = peak[i].threads.max(p.threads);
            peak[i].children = peak[i].children.max(p.children);
        }
        if let Ok(r) = request(&http_addr, "GET", "/metrics", &[], "") {
            let text = String::from_utf8_lossy(&r.body);
            let live: u64 = text
                .lines()
                .filter(|l| {
                    l.starts_with("caliban_runs{state=\"running\"}")
                        || l.starts_with("caliban_runs{state=\"starting\"}")
                })
                .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                .sum();
            live_runs_max = live_runs_max.max(live);
        }
    }
    let mut panics = 0;
    for h in handles {
        if h.join().is_err() {
            panics += 1;
        }
    }
    let elapsed = started.elapsed();
    // Let the servers close what the clients left.
    std::thread::sleep(Duration::from_secs(3));
    let after = [proc_stats(http_server.id()), proc_stats(mcp_server.id())];

    for child in [&mut http_server, &mut mcp_server, &mut stub] {
        let _ = child.kill();
        let _ = child.wait();
    }
    let _ = std::fs::remove_dir_all(&dir);

    let s = &stats;
    let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
    println!(
        "caliban soak: {runs} concurrent clients ({} follow, {} poll every {poll_ms} ms, {} MCP), \
         {secs} s then cancel and drain ({:.1} s in all), stub drip {drip_ms} ms",
        (0..runs).filter(|n| n % 4 < 2).count(),
        (0..runs).filter(|n| n % 4 == 2).count(),
        (0..runs).filter(|n| n % 4 == 3).count(),
        elapsed.as_secs_f64()
    );
    println!(
        "runs {} (done {}, failed {}; {} left by vanished clients, cancelled at the end); \
         most running at once on http serve {live_runs_max}",
        get(&s.runs),
        get(&s.done),
        get(&s.failed),
        get(&s.cancelled)
    );
    println!(
        "events read {}; lost {}, duplicated {}, different from the log {}",
        get(&s.events_read),
        get(&s.lost),
        get(&s.duplicated),
        get(&s.different)
    );
    println!(
        "clients vanished and resumed {}, vanished for good {}; retries: 503/busy {}, i/o {}",
        get(&s.vanished_resumed),
        get(&s.vanished_for_good),
        get(&s.busy_retries),
        get(&s.io_retries)
    );
    println!(
        "{:<12} {:>22} {:>22} {:>22}",
        "server", "before", "peak", "after"
    );
    for (i, name) in ["http serve", "mcp serve"].into_iter().enumerate() {
        let f = |p: &Proc| format!("{}K/{}fd/{}t/{}c", p.rss_kib, p.fds, p.threads, p.children);
        println!(
            "{:<12} {:>22} {:>22} {:>22}",
            name,
            f(&before[i]),
            f(&peak[i]),
            f(&after[i])
        );
    }
    println!("(RSS KiB / open fds / threads / child processes)");
    println!(
        "{:<40} {:>8} {:>10} {:>10} {:>10}",
        "latency", "n", "p50 ms", "p99 ms", "max ms"
    );
    for (what, mut v) in std::mem::take(&mut *s.latencies.lock().unwrap()) {
        v.sort();
        println!(
            "{:<40} {:>8} {:>10.2} {:>10.2} {:>10.2}",
            what,
            v.len(),
            pct(&v, 50),
            pct(&v, 99),
            v.last().map_or(f64::NAN, |d| d.as_secs_f64() * 1e3)
        );
    }
    assert_eq!(panics, 0, "{panics} client threads panicked");
    assert_eq!(
        (get(&s.lost), get(&s.duplicated), get(&s.different)),
        (0, 0, 0),
        "events lost, duplicated or different"
    );
    assert_eq!(after[0].children, 0, "http serve left child processes");
    assert_eq!(after[1].children, 0, "mcp serve left child processes");
}
