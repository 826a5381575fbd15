//! Shared by the bench binaries (included with `#[path]`): starting `caliban stub-model`,
//! reading numbers from the environment, and timing a process with what the kernel counted
//! of it.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// `BENCH_ROUNDS` from the environment, else `default`.
pub fn rounds(default: usize) -> usize {
    std::env::var("BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The middle sample.
pub fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

/// What one process cost, as `wait4` reports it.
pub struct Timed {
    pub wall: Duration,
    /// User and system CPU time of the process and of the children it reaped (for caliban,
    /// the tools' processes): unlike wall time, hardly moved by other load on the machine.
    pub cpu: Duration,
    pub max_rss_kib: u64,
    pub success: bool,
}

/// Runs `cmd` to completion (no stdio) and returns what it cost.
pub fn timed(cmd: &mut Command) -> Timed {
    let start = Instant::now();
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");
    let pid = child.id() as libc::pid_t;
    let mut status = 0;
    // SAFETY: a zeroed rusage is a valid out-parameter that wait4 fills in.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `pid` is our own unreaped child; both pointers are valid for the call. We reap
    // with wait4 instead of Child::wait to get this child's own rusage.
    let rc = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    assert_eq!(rc, pid, "wait4 failed");
    let wall = start.elapsed();
    std::mem::forget(child);
    let time = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    Timed {
        wall,
        cpu: time(usage.ru_utime) + time(usage.ru_stime),
        max_rss_kib: usage.ru_maxrss as u64,
        success: libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
    }
}

/// Starts `caliban stub-model` on a free loopback port; returns it and its base URL.
pub fn start_stub(bin: &str, script: &Path) -> (Child, String) {
    let mut stub = Command::new(bin)
        .args(["stub-model", "--script"])
        .arg(script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn stub-model");
    let mut line = String::new();
    BufReader::new(stub.stdout.take().expect("stub stdout"))
        .read_line(&mut line)
        .expect("stub banner");
    let url = line.trim().trim_start_matches("listening on ").to_owned();
    (stub, url)
}

/// The number in environment variable `name`, or `default`.
#[allow(dead_code)] // not every bench takes settings from the environment
pub fn env_num(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}
