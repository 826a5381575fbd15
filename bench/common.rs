//! Shared by the bench binaries (included with `#[path]`): starting `caliban stub-model`,
//! reading numbers from the environment.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};

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
