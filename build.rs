//! Stamps the git hash into the binary for `caliban --version`, and, when asked with
//! `CALIBAN_STARTUP_LAYOUT=1`, gives release links of the binary the start-up layout
//! (`src/startup.ld`). Tiny and infallible on purpose: a build from a source tarball without
//! `.git` still works and says `unknown`.

use std::process::Command;

/// `git rev-parse ARGS`, or `None` outside a git checkout (or without git).
fn rev_parse(args: &[&str]) -> Option<String> {
    Command::new("git")
        .arg("rev-parse")
        .args(args)
        .output()
        .ok()
        .filter(|out| out.status.success())
        .and_then(|out| String::from_utf8(out.stdout).ok())
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
}

fn main() {
    let hash = match rev_parse(&["--short=12", "HEAD"]) {
        Some(hash) => hash,
        None => {
            println!("cargo:warning=git hash unavailable; version will say `unknown`");
            "unknown".to_owned()
        }
    };
    println!("cargo:rustc-env=CALIBAN_GIT_HASH={hash}");
    // The functions start-up runs, gathered at the front of the code (bench/layout.py), only
    // on request: it lowers an idle server's RSS, which is pages of the binary shared by every
    // process running it, and a loaded machine's spawn → `initialize` time, but leaves its
    // private memory as it is and the PSS of 100 agents within 9%, the figures CI holds
    // (bench/RESULTS.md, "footprint gate"). The list is a measurement tied to one glibc; kept
    // by hand it made every start-up change a chore. Only where it was measured (Linux,
    // release); a pattern that matches nothing costs nothing.
    println!("cargo:rerun-if-env-changed=CALIBAN_STARTUP_LAYOUT");
    let asked = std::env::var("CALIBAN_STARTUP_LAYOUT").is_ok_and(|v| v == "1");
    let linux = std::env::var("CARGO_CFG_TARGET_OS").is_ok_and(|os| os == "linux");
    let release = std::env::var("PROFILE").is_ok_and(|p| p == "release");
    if asked && linux && release {
        let dir = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| ".".to_owned());
        println!("cargo:rustc-link-arg-bins=-Wl,-T,{dir}/src/startup.ld");
        println!("cargo:rerun-if-changed=src/startup.ld");
    }
    println!("cargo:rerun-if-changed=build.rs");
    // Rerun when HEAD moves: HEAD itself, and the branch file it names (or packed-refs).
    // They are under `.git/` in a clone, but in a `git worktree` `.git` is a file, HEAD is
    // under the main repository's `.git/worktrees/NAME/` and branches in its `.git/refs`.
    // Only paths that exist are named: cargo reruns the script for a missing one, and so
    // rebuilt the crate on every build in a worktree.
    let git_dir = rev_parse(&["--git-dir"]);
    let common = rev_parse(&["--git-common-dir"]);
    let branch = rev_parse(&["--symbolic-full-name", "HEAD"]).filter(|r| r.starts_with("refs/"));
    let mut watch = Vec::new();
    if let Some(dir) = &git_dir {
        watch.push(format!("{dir}/HEAD"));
    }
    if let Some(dir) = &common {
        if let Some(branch) = &branch {
            watch.push(format!("{dir}/{branch}"));
        }
        watch.push(format!("{dir}/packed-refs"));
    }
    for path in watch.iter().filter(|p| std::path::Path::new(p).exists()) {
        println!("cargo:rerun-if-changed={path}");
    }
    println!("cargo:rerun-if-env-changed=SOURCE_DATE_EPOCH");
}
