//! Startup and print-mode benchmarks for the real binary, run with `cargo bench`.
//!
//! Measured side by side in one run, as medians: spawning `true` (the floor any process
//! pays here), `caliban --version`, and a complete print-mode run with one tool call against
//! `caliban stub-model` on loopback, with the peak RSS of that run. Results go to stdout as a
//! table; copy them into bench/RESULTS.md with the machine and date.

use std::process::Command;

#[path = "common.rs"]
mod common;

const BIN: &str = env!("CARGO_BIN_EXE_caliban");

fn main() {
    let rounds = common::rounds(200);

    let dir = std::env::temp_dir().join(format!("caliban-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("bench dir");
    std::fs::write(dir.join("notes.txt"), "one\ntwo\nthree\n").expect("notes");
    let script = dir.join("script.json");
    std::fs::write(
        &script,
        r#"{"turns":[{"tool_calls":[{"name":"Read","input":{"path":"notes.txt"}}]},{"text":"three lines"}],"repeat_last":false}"#,
    )
    .expect("script");

    let mut true_t = Vec::new();
    let mut version_t = Vec::new();
    let mut version_rss = Vec::new();
    for _ in 0..rounds {
        true_t.push(common::timed(&mut Command::new("true")).wall);
        let run = common::timed(Command::new(BIN).arg("--version"));
        version_t.push(run.wall);
        version_rss.push(run.max_rss_kib);
    }

    let mut print_t = Vec::new();
    let mut print_rss = Vec::new();
    let print_rounds = rounds.min(100);
    for _ in 0..print_rounds {
        // A fresh stub per run so every run sees the whole script.
        let (mut stub, url) = common::start_stub(BIN, &script);
        let run = common::timed(
            Command::new(BIN)
                .env_clear()
                .env("ANTHROPIC_BASE_URL", &url)
                .env("HOME", &dir)
                .current_dir(&dir)
                .args(["-p", "how many lines in notes.txt?"]),
        );
        print_t.push(run.wall);
        print_rss.push(run.max_rss_kib);
        let _ = stub.kill();
        let _ = stub.wait();
    }
    let _ = std::fs::remove_dir_all(&dir);

    let floor = common::median(true_t);
    let version = common::median(version_t);
    let print = common::median(print_t);
    version_rss.sort();
    print_rss.sort();
    let size = std::fs::metadata(BIN).map(|m| m.len()).unwrap_or(0);
    println!("binary: {BIN} ({:.2} MiB)", size as f64 / (1024.0 * 1024.0));
    println!("rounds: {rounds} (print mode: {print_rounds})");
    println!("{:<44} {:>10} {:>12}", "what", "median", "peak RSS");
    println!(
        "{:<44} {:>8.2}ms {:>12}",
        "spawn `true` (floor)",
        floor.as_secs_f64() * 1e3,
        "-"
    );
    println!(
        "{:<44} {:>8.2}ms {:>9} KiB",
        "caliban --version",
        version.as_secs_f64() * 1e3,
        version_rss[version_rss.len() / 2]
    );
    println!(
        "{:<44} {:>8.2}ms {:>9} KiB",
        "caliban -p (2 turns, 1 Read) vs stub-model",
        print.as_secs_f64() * 1e3,
        print_rss[print_rss.len() / 2]
    );
    println!(
        "ratio --version / floor: {:.2}",
        version.as_secs_f64() / floor.as_secs_f64()
    );
}
