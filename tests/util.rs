//! The test harness: temp workspaces, a stub model process, and a runner for `caliban` with
//! a sanitised environment and a deadline on everything (a hung child fails the test with
//! its stderr instead of hanging the suite). Every helper more than one test module uses
//! lives here or in a module below, so test modules never import each other: typed stub
//! scripts (`script`, re-exported here), fixtures (`content`, re-exported), and the peers
//! and servers of one surface each (`http`, `rpc`, `acp`, `mcp`, `agent`, `tls`).

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStderr, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use serde_json::Value;

pub mod acp;
pub mod agent;
mod content;
pub mod http;
pub mod mcp;
pub mod rpc;
mod script;
pub mod tls;

pub use content::*;
pub use script::*;

pub const BIN: &str = env!("CARGO_BIN_EXE_caliban");
/// The longest any single caliban invocation may take in a test.
pub const RUN_TIMEOUT: Duration = Duration::from_secs(60);

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// A fresh directory under the target dir, removed on drop.
pub struct Workspace {
    pub root: PathBuf,
}

impl Workspace {
    pub fn new(name: &str) -> Workspace {
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        let base = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
        let root = base.join(format!("ws-{name}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("home")).expect("create workspace");
        Workspace {
            root: root.canonicalize().expect("canonical workspace"),
        }
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.root.join(rel)
    }

    pub fn write(&self, rel: &str, contents: &str) {
        let path = self.path(rel);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).expect("mkdir");
        }
        std::fs::write(path, contents).expect("write file");
    }

    /// Hands the whole workspace (its `home/` included) to `user`, for a caliban run as that
    /// user (`as_user`).
    pub fn give_to(&self, (uid, gid): (u32, u32)) {
        fn walk(path: &Path, uid: u32, gid: u32) {
            std::os::unix::fs::lchown(path, Some(uid), Some(gid)).expect("chown");
            if path.symlink_metadata().is_ok_and(|m| m.is_dir()) {
                for entry in std::fs::read_dir(path).expect("read dir").flatten() {
                    walk(&entry.path(), uid, gid);
                }
            }
        }
        walk(&self.root, uid, gid);
    }

    pub fn read(&self, rel: &str) -> String {
        std::fs::read_to_string(self.path(rel)).expect("read file")
    }
}

impl Drop for Workspace {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// `caliban stub-model` running on a free loopback port; killed on drop.
pub struct Stub {
    child: Child,
    pub url: String,
    _script: PathBuf,
}

impl Stub {
    pub fn start(ws: &Workspace, script: &Value) -> Stub {
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        let script_path = ws.path(&format!("stub-script-{n}.json"));
        std::fs::write(&script_path, script.to_string()).expect("write script");
        let mut child = Command::new(BIN)
            .args(["stub-model", "--script"])
            .arg(&script_path)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            // One line per request would interleave with every test's output.
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn stub-model");
        let stdout = child.stdout.take().expect("stub stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = match rx.recv_timeout(Duration::from_secs(10)) {
            Ok(line) => line,
            Err(_) => {
                let _ = child.kill();
                panic!("stub-model did not print its address within 10 s");
            }
        };
        let url = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("unexpected stub-model banner: {line:?}"))
            .to_owned();
        Stub {
            child,
            url,
            _script: script_path,
        }
    }

    /// Every request the stub received: `[{path, headers, body}]`.
    pub fn requests(&self) -> Vec<Value> {
        let addr = self.url.trim_start_matches("http://");
        let mut stream = TcpStream::connect(addr).expect("connect to stub");
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        write!(
            stream,
            "GET /_stub/requests HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
        )
        .expect("send");
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).expect("read stub response");
        let text = String::from_utf8_lossy(&raw);
        let (head, body) = text.split_once("\r\n\r\n").expect("http response");
        let body = if head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked")
        {
            dechunk(body)
        } else {
            body.to_owned()
        };
        let value: Value = serde_json::from_str(&body).expect("requests json");
        value.as_array().cloned().unwrap_or_default()
    }
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let size =
            usize::from_str_radix(size.split(';').next().unwrap_or("0").trim(), 16).unwrap_or(0);
        if size == 0 {
            break;
        }
        out.push_str(&rest[..size]);
        body = &rest[size + 2..];
    }
    out
}

impl Drop for Stub {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Every tool_result block the model was sent, by tool_use_id, as text.
pub fn tool_result(stub: &Stub, id: &str) -> (bool, String) {
    for req in stub.requests().iter().rev() {
        for message in req["body"]["messages"].as_array().into_iter().flatten() {
            for block in message["content"].as_array().into_iter().flatten() {
                if block["type"] == "tool_result" && block["tool_use_id"] == id {
                    return (block["is_error"] == true, texts(&block["content"]));
                }
            }
        }
    }
    panic!("no tool_result for {id} was sent to the model");
}

/// The text blocks of a content array (a tool result's, say), one per line.
pub fn texts(blocks: &Value) -> String {
    blocks
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|b| b["text"].as_str())
        .collect::<Vec<_>>()
        .join("\n")
}

pub struct Output {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl Output {
    /// stdout parsed as JSON lines.
    pub fn frames(&self) -> Vec<Value> {
        self.stdout
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad frame {l:?}: {e}")))
            .collect()
    }

    pub fn result(&self) -> Value {
        self.frames()
            .into_iter()
            .rev()
            .find(|f| f["type"] == "result")
            .unwrap_or_else(|| panic!("no result frame in {}", self.stdout))
    }
}

impl std::fmt::Debug for Output {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "exit {:?}\n--- stdout\n{}\n--- stderr\n{}",
            self.code, self.stdout, self.stderr
        )
    }
}

/// A `caliban` command with an environment that holds nothing from the developer's shell
/// (no real API keys, no proxies, no user settings).
pub fn caliban(ws: &Workspace) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", ws.path("home"))
        .env("XDG_CONFIG_HOME", ws.path("home/.config"))
        .env("XDG_STATE_HOME", ws.path("home/.state"))
        .current_dir(&ws.root);
    cmd
}

/// The user tests run caliban as to try it "as an ordinary user" when the suite itself runs
/// as root (as CI and many containers do): `nobody`, with no supplementary groups. `None`
/// when the suite already runs unprivileged, where every test is already that case.
pub fn ordinary_user() -> Option<(u32, u32)> {
    const NOBODY: (u32, u32) = (65534, 65534);
    // SAFETY: geteuid cannot fail and touches no memory.
    if unsafe { libc::geteuid() } != 0 {
        return None;
    }
    // The binary and the workspaces (under the target dir) must be reachable by that user:
    // a checkout under a directory only root may enter (`/root`, mode 0700) is not, and
    // there the tests say so once and keep to root.
    static REACHABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let reachable = *REACHABLE.get_or_init(|| {
        let blocked = [Path::new(BIN), Path::new(env!("CARGO_TARGET_TMPDIR"))]
            .into_iter()
            .flat_map(Path::ancestors)
            .find(|dir| !traversable_by(dir, NOBODY));
        if let Some(dir) = blocked {
            eprintln!(
                "note: {} cannot be entered by uid {}: the ordinary-user half of the security \
                 tests is skipped",
                dir.display(),
                NOBODY.0
            );
        }
        blocked.is_none()
    });
    reachable.then_some(NOBODY)
}

/// Whether `user` may pass through `path` (search permission on a directory, execute on
/// the binary itself), by its mode bits.
fn traversable_by(path: &Path, (uid, gid): (u32, u32)) -> bool {
    use std::os::unix::fs::MetadataExt;
    let Ok(meta) = std::fs::metadata(path) else {
        return true;
    };
    let mode = meta.mode();
    if meta.uid() == uid {
        mode & 0o100 != 0
    } else if meta.gid() == gid {
        mode & 0o010 != 0
    } else {
        mode & 0o001 != 0
    }
}

/// Makes `cmd` run as `user` (`ordinary_user`); std drops the supplementary groups when root
/// sets a uid. The workspace must be the user's too (`Workspace::give_to`).
pub fn as_user(cmd: &mut Command, (uid, gid): (u32, u32)) {
    use std::os::unix::process::CommandExt;
    cmd.uid(uid).gid(gid);
}

/// Points a command at the stub with the Anthropic wire.
pub fn anthropic(cmd: &mut Command, stub: &Stub) {
    cmd.env("ANTHROPIC_BASE_URL", &stub.url);
}

/// Points a command at the stub with the OpenAI wire.
pub fn openai(cmd: &mut Command, stub: &Stub) {
    cmd.env("OPENAI_BASE_URL", format!("{}/v1", stub.url));
}

/// `caliban ARGS` in the sanitised environment of `caliban`, on the stub's Anthropic wire.
pub fn caliban_stub(ws: &Workspace, stub: &Stub, args: &[&str]) -> Command {
    let mut cmd = caliban(ws);
    anthropic(&mut cmd, stub);
    cmd.args(args);
    cmd
}

/// Runs `caliban ARGS` on the stub's Anthropic wire to completion, with `stdin` as input.
pub fn run_stub(ws: &Workspace, stub: &Stub, args: &[&str], stdin: &str) -> Output {
    run(caliban_stub(ws, stub, args), stdin)
}

/// Runs to completion with `stdin` as input, killing the child at the deadline.
pub fn run(mut cmd: Command, stdin: &str) -> Output {
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("spawn caliban");
    let mut input = child.stdin.take().expect("stdin");
    let data = stdin.to_owned();
    std::thread::spawn(move || {
        let _ = input.write_all(data.as_bytes());
    });
    wait_output(child, RUN_TIMEOUT)
}

/// Runs `cmd` with no stdin to completion, output captured, killed at `timeout`; `what`
/// says what is missing when it cannot start.
pub fn output_within(cmd: &mut Command, what: &str, timeout: Duration) -> Output {
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    wait_output(child, timeout)
}

pub fn wait_output(mut child: Child, timeout: Duration) -> Output {
    let mut stdout = child.stdout.take().expect("stdout");
    let mut stderr = child.stderr.take().expect("stderr");
    let out_thread = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stdout.read_to_string(&mut s);
        s
    });
    let err_thread = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let stdout = out_thread.join().unwrap_or_default();
    let stderr = err_thread.join().unwrap_or_default();
    let out = Output {
        code: status.and_then(|s| s.code()),
        stdout,
        stderr,
    };
    assert!(
        status.is_some(),
        "caliban did not finish within {timeout:?}: {out:?}"
    );
    out
}

/// A child's stderr, collected line by line on a thread, so a failing test can show it.
#[derive(Clone, Default)]
pub struct StderrLog(Arc<Mutex<String>>);

impl StderrLog {
    /// Starts the reader. With a `banner`, the rest of each line that holds the banner's text
    /// (trimmed) is also sent on its channel: how a server's start-up line is awaited.
    pub fn start(
        stderr: ChildStderr,
        banner: Option<(&'static str, mpsc::Sender<String>)>,
    ) -> StderrLog {
        let log = StderrLog::default();
        let sink = log.clone();
        std::thread::spawn(move || {
            let mut reader = BufReader::new(stderr);
            let mut line = String::new();
            while reader.read_line(&mut line).is_ok_and(|n| n > 0) {
                if let Some((text, tx)) = &banner
                    && let Some(at) = line.find(text)
                {
                    let _ = tx.send(line[at + text.len()..].trim().to_owned());
                }
                sink.0
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push_str(&line);
                line.clear();
            }
        });
        log
    }

    /// Everything read so far.
    pub fn text(&self) -> String {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// Waits at most `timeout` for `child` to exit: its status, or None if it still runs.
pub fn wait_for_exit(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return Some(status);
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Polls a run's event pages until the run is done or failed: `page(cursor)` fetches one
/// page (`{events: [{event}], next_cursor, status}`, as HTTP and MCP's `caliban_poll` give
/// it); at most `polls` pages. Every event, unwrapped from its envelope.
pub fn events_until_done(
    run: &str,
    polls: usize,
    mut page: impl FnMut(u64) -> Value,
) -> Vec<Value> {
    let (mut events, mut cursor) = (Vec::new(), 0);
    for _ in 0..polls {
        let body = page(cursor);
        events.extend(
            body["events"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|e| e["event"].clone()),
        );
        cursor = body["next_cursor"].as_u64().expect("next_cursor");
        if matches!(body["status"]["state"].as_str(), Some("done" | "failed")) {
            return events;
        }
    }
    panic!("{run} never finished");
}

/// Whether any process on the machine has `marker` in its command line.
pub fn process_with_marker_exists(marker: &str) -> bool {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return false;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        if !name.to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        if let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) {
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            if cmdline.contains(marker) && !cmdline.contains("process_with_marker") {
                // Zombies have an empty cmdline; a live match is a leak.
                return true;
            }
        }
    }
    false
}

pub fn path_str(p: &Path) -> String {
    p.display().to_string()
}

/// The python of a venv under the target dir named `name`, with the pinned `requirements`
/// (a file under `tests/`) installed from PyPI: made once per target dir, and again when
/// the pins change; one installer at a time across test threads.
pub fn venv_python(name: &str, requirements: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    let python = dir.join("bin/python");
    let file = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join(requirements);
    let want = std::fs::read_to_string(&file).expect("read the requirements");
    let marker = dir.join("installed-requirements.txt");
    let lock = std::fs::File::create(dir.with_extension("lock")).expect("venv lock file");
    lock.lock().expect("venv lock");
    if std::fs::read_to_string(&marker).ok() == Some(want.clone()) {
        return python;
    }
    let _ = std::fs::remove_dir_all(&dir);
    let status = Command::new("python3")
        .args(["-m", "venv"])
        .arg(&dir)
        .status()
        .expect("python3 is needed for these tests");
    assert!(status.success(), "python3 -m venv failed");
    let out = Command::new(&python)
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "-r",
        ])
        .arg(&file)
        .output()
        .expect("run pip");
    assert!(
        out.status.success(),
        "pip install -r {requirements} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::write(&marker, want).expect("write marker");
    python
}

/// Where to make files a sandboxed command must not be able to write: outside every
/// workspace and every temp dir the sandbox opens (`/tmp`, `/var/tmp`, `/dev/shm`,
/// `$TMPDIR`). The target dir's `tmp/` unless the checkout itself lies in a temp dir (a
/// clone under `/tmp` does); then a directory under `$HOME/.cache`, or `/var/lib`.
pub fn outside_root() -> PathBuf {
    let temp_roots: Vec<PathBuf> = ["/tmp", "/var/tmp", "/dev/shm"]
        .into_iter()
        .map(PathBuf::from)
        .chain(std::env::var_os("TMPDIR").map(PathBuf::from))
        .filter_map(|p| p.canonicalize().ok())
        .collect();
    let candidates = [
        Some(PathBuf::from(env!("CARGO_TARGET_TMPDIR"))),
        std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/caliban-tests")),
        Some(PathBuf::from("/var/lib/caliban-tests")),
    ];
    for dir in candidates.into_iter().flatten() {
        if std::fs::create_dir_all(&dir).is_err() {
            continue;
        }
        let Ok(dir) = dir.canonicalize() else {
            continue;
        };
        if !temp_roots.iter().any(|t| dir.starts_with(t)) {
            return dir;
        }
    }
    panic!("no directory outside the temp dirs to test the sandbox's refusals in")
}
