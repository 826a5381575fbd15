//! Stamps the git hash into the binary for `caliban --version`. Tiny and infallible on
//! purpose: a build from a source tarball without `.git` still works and says `unknown`.

use std::process::Command;

fn main() {
    let hash = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|out| out.status.success())
        .and_then(|out| String::from_utf8(out.stdout).ok())
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty());
    let hash = match hash {
        Some(hash) => hash,
        None => {
            println!("cargo:warning=git hash unavailable; version will say `unknown`");
            "unknown".to_owned()
        }
    };
    println!("cargo:rustc-env=CALIBAN_GIT_HASH={hash}");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=.git/HEAD");
    println!("cargo:rerun-if-changed=.git/refs");
    println!("cargo:rerun-if-env-changed=SOURCE_DATE_EPOCH");
}
