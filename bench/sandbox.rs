//! What the sandbox costs a `Bash` call: `cargo bench --bench sandbox`.
//!
//! One print-mode run answers a script of `CALLS` model turns, each a `Bash` call of `true`,
//! against `caliban stub-model`; the same run is timed under every sandbox mode, the modes
//! interleaved in each round so they see the same machine. A run's median wall time over
//! `CALLS` is the cost of one call with its model turn; the difference from `off` is what
//! the sandbox adds to each call (building the Landlock ruleset and the seccomp filter,
//! the mount plan, and in the child the mount namespace, its mounts, `landlock_restrict_self`
//! and the filter). The workspace holds a `.git` and the home a `.ssh`, `.aws` and
//! `.netrc`, so the mount plan has something to do, as on a real machine.
//! Besides wall time it reports CPU time (caliban's and its reaped children's, user and
//! system), which the load of other processes on the machine hardly moves.
//! `BENCH_ROUNDS` sets the rounds (default 30). `BENCH_VS=PATH` names a second caliban
//! binary (an earlier build) whose rows are measured in the same rounds, each of its runs
//! beside this build's run of the same mode, so a change's cost is read side by side.

use std::process::Command;
use std::time::Duration;

#[path = "common.rs"]
mod common;

const BIN: &str = env!("CARGO_BIN_EXE_caliban");

/// `Bash` calls per run: enough that the run's fixed costs (start-up, the first model
/// request) are small beside them.
const CALLS: usize = 20;

/// A row: its label, `--sandbox`, and an extra environment variable.
type Variant = (
    &'static str,
    &'static str,
    Option<(&'static str, &'static str)>,
);

fn main() {
    let rounds = common::rounds(30);
    // Not under /tmp: a home inside a temp dir would put a deny-listed path inside a
    // writable root, which no real machine has.
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("caliban-bench-sandbox-{}", std::process::id()));
    let (ws, home) = (dir.join("ws"), dir.join("home"));
    for sub in [ws.join(".git"), home.join(".ssh"), home.join(".aws")] {
        std::fs::create_dir_all(sub).expect("bench dirs");
    }
    std::fs::write(home.join(".netrc"), "machine x\n").expect("netrc");
    let mut turns: Vec<String> = (0..CALLS)
        .map(|i| {
            format!(
                r#"{{"tool_calls":[{{"id":"t{i}","name":"Bash","input":{{"command":"true"}}}}]}}"#
            )
        })
        .collect();
    turns.push(r#"{"text":"done"}"#.to_owned());
    let script = dir.join("script.json");
    std::fs::write(&script, format!(r#"{{"turns":[{}]}}"#, turns.join(","))).expect("script");

    let modes: [Variant; 5] = [
        ("off (no sandbox)", "off", None),
        ("read-only", "read-only", None),
        ("workspace-write", "workspace-write", None),
        ("network", "network", None),
        (
            "workspace-write, Landlock alone (no mount ns)",
            "workspace-write",
            Some(("CALIBAN_SANDBOX_NO_MOUNTNS", "1")),
        ),
    ];
    let vs = std::env::var("BENCH_VS")
        .ok()
        .filter(|path| !path.is_empty());
    let bins: Vec<&str> = std::iter::once(BIN).chain(vs.as_deref()).collect();
    // Rows: each mode under each binary, this build's first.
    let rows: Vec<(usize, usize)> = (0..modes.len())
        .flat_map(|mode| (0..bins.len()).map(move |bin| (mode, bin)))
        .collect();
    let mut wall: Vec<Vec<Duration>> = vec![Vec::new(); rows.len()];
    let mut cpu: Vec<Vec<Duration>> = vec![Vec::new(); rows.len()];
    for _ in 0..rounds {
        for (at, &(mode_at, bin_at)) in rows.iter().enumerate() {
            let (_, mode, env) = modes[mode_at];
            let bin = bins[bin_at];
            // A fresh stub per run so every run sees the whole script.
            let (mut stub, url) = common::start_stub(BIN, &script);
            let mut cmd = Command::new(bin);
            cmd.env_clear()
                .env("PATH", std::env::var_os("PATH").unwrap_or_default())
                .env("ANTHROPIC_BASE_URL", &url)
                .env("HOME", &home)
                .current_dir(&ws)
                .args(["-p", "go", "--allow", "Bash", "--sandbox", mode]);
            if let Some((key, value)) = env {
                cmd.env(key, value);
            }
            let run = common::timed(&mut cmd);
            assert!(run.success, "{mode} failed ({bin})");
            wall[at].push(run.wall);
            cpu[at].push(run.cpu);
            let _ = stub.kill();
            let _ = stub.wait();
        }
    }
    let _ = std::fs::remove_dir_all(&dir);

    println!("binary: {BIN}");
    if let Some(vs) = &vs {
        println!("vs: {vs} (rows marked \"vs\")");
    }
    println!("rounds: {rounds}, {CALLS} Bash calls per run; medians, per call = run / {CALLS}");
    println!(
        "{:<46} {:>10} {:>10} {:>10} {:>10}",
        "sandbox", "wall/call", "added", "cpu/call", "added"
    );
    let per_call = |d: Duration| d.as_secs_f64() * 1e3 / CALLS as f64;
    let wall: Vec<f64> = wall
        .into_iter()
        .map(|s| per_call(common::median(s)))
        .collect();
    let cpu: Vec<f64> = cpu
        .into_iter()
        .map(|s| per_call(common::median(s)))
        .collect();
    for (at, &(mode_at, bin_at)) in rows.iter().enumerate() {
        // "added" is against `off` under the same binary.
        let base = bin_at;
        let label = match bin_at {
            0 => modes[mode_at].0.to_owned(),
            _ => format!("vs {}", modes[mode_at].0),
        };
        println!(
            "{:<46} {:>8.3}ms {:>+8.3}ms {:>8.3}ms {:>+8.3}ms",
            label,
            wall[at],
            wall[at] - wall[base],
            cpu[at],
            cpu[at] - cpu[base]
        );
    }
}
