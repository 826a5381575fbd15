//! `caliban http serve` figures, run with `cargo bench --bench serve`: idle RSS of the
//! server, memory and file descriptors per idle interactive run (each has finished a turn and
//! waits for input), `GET /runs` latency at that size, the median latency of a full poll, and
//! the start-up of a second server on the same sessions directory (every run on disk), all
//! against `caliban stub-model` on loopback.
//!
//! `BENCH_RUNS` (default 200) idle runs; `BENCH_RUNS=10000` is the scale DESIGN §6 asks of
//! one process. The runs are started one after another (about 3 ms each on 2 cores).
//! `CALIBAN_BIN` measures another build of caliban (an older one, side by side).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[path = "common.rs"]
mod common;

const BUILT: &str = env!("CARGO_BIN_EXE_caliban");

fn bin() -> String {
    std::env::var("CALIBAN_BIN").unwrap_or_else(|_| BUILT.to_owned())
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

fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

fn http(addr: &str, method: &str, path: &str, body: &str) -> String {
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("send");
    let mut out = String::new();
    let _ = stream.read_to_string(&mut out);
    out
}

/// The address from the server's `… listening on http://ADDR` line on stderr.
fn server_url(child: &mut Child) -> String {
    let mut line = String::new();
    BufReader::new(child.stderr.take().expect("stderr"))
        .read_line(&mut line)
        .expect("banner");
    line.trim()
        .rsplit(' ')
        .next()
        .unwrap_or_default()
        .trim_start_matches("http://")
        .to_owned()
}

fn start_server(dir: &Path, stub_url: &str, runs: usize) -> Child {
    Command::new(bin())
        .env_clear()
        .env("ANTHROPIC_BASE_URL", stub_url)
        .env("HOME", dir)
        .env("XDG_STATE_HOME", dir.join("state"))
        .args(["http", "serve", "--addr", "127.0.0.1:0", "-C"])
        .arg(dir)
        .arg("--max-live-runs")
        .arg((runs + 16).to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("server")
}

/// Walks every page of `GET /runs`; returns how many runs say `state` and the page count.
fn list_all(addr: &str, state: &str) -> (usize, usize) {
    let (mut count, mut pages) = (0, 0);
    let mut path = "/runs".to_owned();
    loop {
        let list = http(addr, "GET", &path, "");
        assert!(list.starts_with("HTTP/1.1 200"), "{list}");
        pages += 1;
        count += list.matches(state).count();
        let next = list.split_once("\"next_cursor\":").and_then(|(_, rest)| {
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            digits.parse::<u64>().ok()
        });
        match next {
            Some(next) => path = format!("/runs?cursor={next}"),
            None => return (count, pages),
        }
    }
}

fn ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1e3)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn row(what: &str, value: String) {
    println!("{what:<58} {value:>14}");
}

fn main() {
    let runs: usize = std::env::var("BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let dir = std::env::temp_dir().join(format!("caliban-bench-serve-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let script = dir.join("script.json");
    std::fs::write(
        &script,
        r#"{"turns":[{"text":"ready for more"}],"repeat_last":true}"#,
    )
    .expect("script");
    let (mut stub, stub_url) = common::start_stub(&bin(), &script);
    let mut server = start_server(&dir, &stub_url, runs);
    let addr = server_url(&mut server);
    std::thread::sleep(Duration::from_millis(200));
    let pid = server.id();
    let (idle, idle_fds) = (status_kib(pid, "VmRSS:"), fds(pid));

    let started = Instant::now();
    for _ in 0..runs {
        let reply = http(
            &addr,
            "POST",
            "/runs",
            r#"{"prompt":"hello","interactive":true}"#,
        );
        assert!(reply.starts_with("HTTP/1.1 20"), "{reply}");
    }
    // Every run has streamed its turn and now waits for input.
    let deadline = Instant::now() + Duration::from_secs(60 + runs as u64 / 50);
    while list_all(&addr, "awaiting_input").0 < runs {
        assert!(
            Instant::now() < deadline,
            "runs did not all get to awaiting_input"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let create_secs = started.elapsed().as_secs_f64();
    let (loaded, loaded_anon, loaded_fds) = (
        status_kib(pid, "VmRSS:"),
        status_kib(pid, "RssAnon:"),
        fds(pid),
    );

    // `GET /runs`: the first page (the newest 1,000) and a walk over every page.
    let first_page: Vec<Duration> = (0..20)
        .map(|_| {
            let start = Instant::now();
            let list = http(&addr, "GET", "/runs", "");
            assert!(list.starts_with("HTTP/1.1 200"), "{list}");
            start.elapsed()
        })
        .collect();
    let mut pages = 0;
    let walks: Vec<Duration> = (0..5)
        .map(|_| {
            let start = Instant::now();
            pages = list_all(&addr, "awaiting_input").1;
            start.elapsed()
        })
        .collect();

    let mut polls = Vec::new();
    for i in 0..500 {
        let start = Instant::now();
        let body = http(
            &addr,
            "GET",
            &format!("/runs/run-{}/events?cursor=0", 1 + i % runs),
            "",
        );
        polls.push(start.elapsed());
        assert!(body.starts_with("HTTP/1.1 200"), "{body}");
    }
    polls.sort();
    let poll_p99 = polls[polls.len() * 99 / 100];

    // A second server on the same sessions directory: every run is on disk.
    let _ = server.kill();
    let _ = server.wait();
    let spawned = Instant::now();
    let mut second = start_server(&dir, &stub_url, runs);
    let addr = server_url(&mut second);
    let banner = spawned.elapsed();
    let first = http(&addr, "GET", "/runs?limit=1", "");
    let answered = spawned.elapsed();
    assert!(first.starts_with("HTTP/1.1 200"), "{first}");
    let (listed, _) = list_all(&addr, "\"run_id\"");
    let restarted = status_kib(second.id(), "VmRSS:");

    let _ = second.kill();
    let _ = second.wait();
    let _ = stub.kill();
    let _ = stub.wait();
    let _ = std::fs::remove_dir_all(&dir);

    println!(
        "{} http serve, {runs} idle interactive runs (each after one streamed turn)",
        bin()
    );
    row("server RSS after start", format!("{idle} KiB"));
    row(
        &format!("server RSS with {runs} idle runs"),
        format!("{loaded} KiB"),
    );
    row("  of which anonymous", format!("{loaded_anon} KiB"));
    row(
        "memory per idle run",
        format!(
            "{:.1} KiB",
            loaded.saturating_sub(idle) as f64 / runs as f64
        ),
    );
    row(
        "open fds: after start / with the idle runs",
        format!("{idle_fds} / {loaded_fds}"),
    );
    row(
        "time to start the runs and see all idle",
        format!("{create_secs:.1} s"),
    );
    row(
        "GET /runs, first page (≤ 1,000 runs), median",
        ms(median(first_page)),
    );
    row(
        &format!("GET /runs, all {pages} pages one after another, median"),
        ms(median(walks)),
    );
    row(
        "poll latency (new connection), median",
        ms(polls[polls.len() / 2]),
    );
    row("poll latency, p99", ms(poll_p99));
    row(
        &format!("restart with {runs} runs on disk: spawn → listening"),
        ms(banner),
    );
    row("restart: spawn → first GET /runs answered", ms(answered));
    row("restart: runs listed", listed.to_string());
    row(
        "restart: RSS after listing every run",
        format!("{restarted} KiB"),
    );
}
