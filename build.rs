//! Stamps the git hash into the binary for `caliban --version`, and gives release links of
//! the binary the start-up layout (`src/startup.ld`). Tiny and infallible on purpose: a build
//! from a source tarball without `.git` still works and says `unknown`.

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
    // The functions start-up runs, gathered at the front of the code (bench/layout.py): an idle
    // `acp serve` keeps about 1.7 MB fewer pages of the binary resident. Only where the layout
    // was measured (Linux, release); a pattern that matches nothing costs nothing.
    let linux = std::env::var("CARGO_CFG_TARGET_OS").is_ok_and(|os| os == "linux");
    let release = std::env::var("PROFILE").is_ok_and(|p| p == "release");
    if linux && release {
        let dir = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| ".".to_owned());
        println!("cargo:rustc-link-arg-bins=-Wl,-T,{dir}/src/startup.ld");
    }
    println!("cargo:rerun-if-changed=src/startup.ld");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=.git/HEAD");
    println!("cargo:rerun-if-changed=.git/refs");
    println!("cargo:rerun-if-env-changed=SOURCE_DATE_EPOCH");
}
