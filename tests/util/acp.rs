//! Driving `caliban acp serve` with the official ACP TypeScript SDK
//! (`@agentclientprotocol/sdk`, `tests/acp/driver.mjs`): npm installs it into
//! `target/acp-sdk` on first use, and every frame caliban sends is validated against the ACP
//! JSON schema the SDK ships. The ACP tests and the others that reach ACP share it.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::*;

/// The longest one scenario (node, the SDK and one or two agents) may take.
const SCENARIO_TIMEOUT: Duration = Duration::from_secs(90);
/// The longest npm may take to install the SDK.
const INSTALL_TIMEOUT: Duration = Duration::from_secs(300);

static SDK: OnceLock<Result<PathBuf, String>> = OnceLock::new();
static INSTALL: Mutex<()> = Mutex::new(());

/// `target/acp-sdk` with the pinned SDK installed (`npm ci`, once per lockfile) and the
/// driver scripts copied in next to it.
pub fn sdk_dir() -> PathBuf {
    let _guard = INSTALL.lock().unwrap_or_else(|e| e.into_inner());
    match SDK.get_or_init(install_sdk) {
        Ok(dir) => dir.clone(),
        Err(e) => panic!("{e}"),
    }
}

fn install_sdk() -> Result<PathBuf, String> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/acp");
    let target = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .ok_or("CARGO_TARGET_TMPDIR has no parent")?
        .join("acp-sdk");
    std::fs::create_dir_all(&target).map_err(|e| format!("mkdir {}: {e}", target.display()))?;
    let lock = std::fs::read(src.join("package-lock.json")).map_err(|e| e.to_string())?;
    let stamp = target.join(".installed-lock");
    if std::fs::read(&stamp).ok().as_deref() != Some(&lock[..]) {
        for file in ["package.json", "package-lock.json"] {
            std::fs::copy(src.join(file), target.join(file)).map_err(|e| e.to_string())?;
        }
        let mut npm = Command::new("npm")
            .args(["ci", "--no-audit", "--no-fund", "--loglevel=error"])
            .current_dir(&target)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot run npm (node 20 and npm are needed): {e}"))?;
        let deadline = Instant::now() + INSTALL_TIMEOUT;
        let status = loop {
            if let Some(status) = npm.try_wait().map_err(|e| e.to_string())? {
                break status;
            }
            if Instant::now() > deadline {
                let _ = npm.kill();
                return Err(format!("npm ci did not finish within {INSTALL_TIMEOUT:?}"));
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        if !status.success() {
            let mut err = String::new();
            if let Some(mut e) = npm.stderr.take() {
                let _ = std::io::Read::read_to_string(&mut e, &mut err);
            }
            return Err(format!("npm ci failed ({status}):\n{err}"));
        }
        std::fs::write(&stamp, &lock).map_err(|e| e.to_string())?;
    }
    for entry in std::fs::read_dir(&src).map_err(|e| e.to_string())? {
        let path = entry.map_err(|e| e.to_string())?.path();
        if path.extension().is_some_and(|x| x == "mjs")
            && let Some(name) = path.file_name()
        {
            std::fs::copy(&path, target.join(name)).map_err(|e| e.to_string())?;
        }
    }
    Ok(target)
}

/// The agent command line the driver spawns.
pub fn agent(flags: &[&str]) -> Value {
    let mut argv = vec![BIN, "acp", "serve"];
    argv.extend_from_slice(flags);
    json!(argv)
}

/// Runs one scenario of `tests/acp/driver.mjs` and returns its result, after checking that
/// it succeeded and that every frame caliban sent validated against the ACP schema.
pub fn drive(ws: &Workspace, stub: &Stub, mut args: Value) -> Value {
    let dir = sdk_dir();
    args["cwd"] = json!(path_str(&ws.root));
    if args.get("agent").is_none() {
        args["agent"] = agent(&[]);
    }
    // The same sanitised environment `caliban(ws)` gives the binary; the driver passes it
    // on to the agents it spawns.
    let mut cmd = Command::new("node");
    cmd.arg(dir.join("driver.mjs"))
        .arg(args.to_string())
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", ws.path("home"))
        .env("XDG_CONFIG_HOME", ws.path("home/.config"))
        .env("XDG_STATE_HOME", ws.path("home/.state"))
        .env("ANTHROPIC_BASE_URL", &stub.url)
        .current_dir(&ws.root);
    let out = output_within(&mut cmd, "spawn node (node 20 is needed)", SCENARIO_TIMEOUT);
    let line = out.stdout.lines().last().unwrap_or_default();
    let report: Value = serde_json::from_str(line)
        .unwrap_or_else(|e| panic!("driver printed no report ({e}): {out:?}"));
    assert_eq!(
        report["ok"],
        true,
        "scenario failed: {}\n--- stderr\n{}",
        report["error"].as_str().unwrap_or_default(),
        out.stderr
    );
    assert_eq!(
        report["problems"],
        json!([]),
        "frames that break the ACP schema or protocol ({} frames)",
        report["frames"]
    );
    report["result"].clone()
}

/// Every update about one tool call, the opening `tool_call` first.
pub fn tool_updates<'a>(updates: &'a Value, id: &str) -> Vec<&'a Value> {
    updates
        .as_array()
        .map(|u| u.iter().filter(|u| u["toolCallId"] == id).collect())
        .unwrap_or_default()
}
