//! Stamps the git hash into the binary for `caliban --version`. Tiny and infallible on
//! purpose: a build from a source tarball without `.git` still works and says `unknown`.

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
