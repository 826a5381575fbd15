//! The command line itself: version, help, the man page, configuration errors.

use crate::util::*;

#[test]
fn version_prints_version_and_hash() {
    let ws = Workspace::new("version");
    let mut cmd = caliban(&ws);
    cmd.arg("--version");
    let out = run(cmd, "");
    assert_eq!(out.code, Some(0), "{out:?}");
    let line = out.stdout.trim();
    assert!(
        line.starts_with(&format!("caliban {} (", env!("CARGO_PKG_VERSION"))),
        "{line}"
    );
    assert!(line.ends_with(')'), "{line}");
}

#[test]
fn man_page_is_current() {
    let ws = Workspace::new("man");
    let mut cmd = caliban(&ws);
    cmd.args(["--generate", "man"]);
    let out = run(cmd, "");
    assert_eq!(out.code, Some(0), "{out:?}");
    let checked_in = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/man/caliban.1"))
        .expect("man/caliban.1 exists");
    assert!(
        checked_in == out.stdout,
        "man/caliban.1 is stale: regenerate it with `cargo run -- --generate man > man/caliban.1`"
    );
}

#[test]
fn help_lists_every_flag() {
    let ws = Workspace::new("help");
    let mut cmd = caliban(&ws);
    cmd.arg("--help");
    let out = run(cmd, "");
    assert_eq!(out.code, Some(0), "{out:?}");
    for flag in [
        "--output-format",
        "--input-format",
        "--allow",
        "--deny",
        "--permission-mode",
        "--max-turns",
        "stub-model",
        "--script",
    ] {
        assert!(out.stdout.contains(flag), "help lacks {flag}");
    }
}

#[test]
fn no_provider_says_what_to_set() {
    let ws = Workspace::new("noprovider");
    let mut cmd = caliban(&ws);
    cmd.args(["-p", "hello"]);
    let out = run(cmd, "");
    assert_eq!(out.code, Some(78), "{out:?}");
    assert!(out.stderr.contains("ANTHROPIC_API_KEY"), "{out:?}");
    assert!(out.stderr.contains("OPENAI_BASE_URL"), "{out:?}");
    assert!(out.stdout.is_empty(), "{out:?}");
}

#[test]
fn usage_errors_exit_64() {
    let ws = Workspace::new("usage");
    let mut cmd = caliban(&ws);
    cmd.args(["--output-format", "xml", "hi"]);
    let out = run(cmd, "");
    assert_eq!(out.code, Some(64), "{out:?}");
    assert!(out.stderr.contains("--output-format"), "{out:?}");
}

#[test]
fn empty_prompt_exits_66() {
    let ws = Workspace::new("noinput");
    let mut cmd = caliban(&ws);
    cmd.env("ANTHROPIC_BASE_URL", "http://127.0.0.1:9")
        .arg("-p");
    let out = run(cmd, "");
    assert_eq!(out.code, Some(66), "{out:?}");
}

/// A prompt too big for stdin is malformed input (64), not a configuration problem (78).
#[test]
fn oversized_stdin_prompt_exits_64() {
    let ws = Workspace::new("bigprompt");
    let mut cmd = caliban(&ws);
    cmd.env("ANTHROPIC_BASE_URL", "http://127.0.0.1:9")
        .arg("-p");
    let prompt = "x".repeat(10 * 1024 * 1024 + 1);
    let out = run(cmd, &prompt);
    assert_eq!(out.code, Some(64), "{out:?}");
    assert!(out.stderr.contains("exceeds"), "{out:?}");
    assert!(out.stdout.is_empty(), "{out:?}");
}
