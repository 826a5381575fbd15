//! `caliban http serve` figures, run with `cargo bench --bench serve`: idle RSS of the
//! server, memory per idle interactive run (each has finished a turn and waits for input),
//! and the median latency of a full poll, all against `caliban stub-model` on loopback.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[path = "common.rs"]
mod common;

const BIN: &str = env!("CARGO_BIN_EXE_caliban");

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

fn http(addr: &str, method: &str, path: &str, body: &str) -> String {
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
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
        .to_owned()
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
    let (mut stub, stub_url) = common::start_stub(BIN, &script);
    let mut server = Command::new(BIN)
        .env_clear()
        .env("ANTHROPIC_BASE_URL", &stub_url)
        .env("HOME", &dir)
        .env("XDG_STATE_HOME", dir.join("state"))
        .args(["http", "serve", "--addr", "127.0.0.1:0", "-C"])
        .arg(&dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("server");
    let url = server_url(&mut server);
    let addr = url.trim_start_matches("http://").to_owned();
    std::thread::sleep(Duration::from_millis(200));
    let idle = rss_kib(server.id());

    for _ in 0..runs {
        http(
            &addr,
            "POST",
            "/runs",
            r#"{"prompt":"hello","interactive":true}"#,
        );
    }
    // Every run has streamed its turn and now waits for input.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        // `GET /runs` comes a page (up to 1,000 runs) at a time.
        let mut waiting = 0;
        let mut path = "/runs".to_owned();
        loop {
            let list = http(&addr, "GET", &path, "");
            waiting += list.matches("awaiting_input").count();
            let next = list.split_once("\"next_cursor\":").and_then(|(_, rest)| {
                let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
                digits.parse::<u64>().ok()
            });
            match next {
                Some(next) => path = format!("/runs?cursor={next}"),
                None => break,
            }
        }
        if waiting >= runs {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "only {waiting} of {runs} runs got to awaiting_input"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let loaded = rss_kib(server.id());

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

    let _ = server.kill();
    let _ = server.wait();
    let _ = stub.kill();
    let _ = stub.wait();
    let _ = std::fs::remove_dir_all(&dir);

    println!("caliban http serve, {runs} idle interactive runs (each after one streamed turn)");
    println!(
        "{:<46} {:>10}",
        "server RSS after start",
        format!("{idle} KiB")
    );
    println!(
        "{:<46} {:>10}",
        format!("server RSS with {runs} idle runs"),
        format!("{loaded} KiB")
    );
    println!(
        "{:<46} {:>10}",
        "memory per idle run",
        format!(
            "{:.1} KiB",
            loaded.saturating_sub(idle) as f64 / runs as f64
        )
    );
    println!(
        "{:<46} {:>10}",
        "poll latency (new connection), median",
        format!("{:.3} ms", polls[polls.len() / 2].as_secs_f64() * 1e3)
    );
    println!(
        "{:<46} {:>10}",
        "poll latency, p99",
        format!(
            "{:.3} ms",
            polls[polls.len() * 99 / 100].as_secs_f64() * 1e3
        )
    );
}
