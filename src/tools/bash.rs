//! The `Bash` tool: a shell command in its own process group with non-blocking pipes that
//! the engine registers on the reactor, a timeout, capped capture and group kill; and its
//! spec and card title, which its row in `tools::table` names.
//!
//! It owns the child and its pipes; it must not know about tokens' meaning or runs. The
//! engine calls `drain` on readiness, `try_reap` on SIGCHLD and `kill` on timeout/cancel.
//! What the command moved out of its process group (`setsid`) is found and killed through
//! the call's `reaper::CallTag`: while the shell runs by walking its tree, once it is gone
//! among the processes caliban adopted.

use std::borrow::Cow;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use mio::unix::pipe;
use mio::{Interest, Registry, Token};
use serde_json::{Value, json};

use crate::model::types::ToolSpec;
use crate::reaper::{self, CallTag, Sweep};
use crate::sandbox::{self, Mode};
use crate::sys;
use crate::tools::{ToolOutput, cap_title, closed_object, text_field, timeout_seconds};

/// Upstream keeps 30 KiB of each stream; the rest is drained and counted so the child never
/// blocks on a full pipe.
pub const STREAM_CAP: usize = 30 * 1024;
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
pub const MAX_TIMEOUT_SECS: u64 = 600;
/// A background shell keeps this much of its latest output (stdout and stderr interleaved
/// as they arrive) for `BashOutput`; older bytes are dropped and counted, so a server
/// logging for hours costs no more memory than one that just started.
pub const SHELL_BUFFER_CAP: usize = 256 * 1024;
/// The most output one `BashOutput` call returns; the rest waits for the next call.
pub const SHELL_READ_CAP: usize = 30 * 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

#[derive(Default)]
struct Capture {
    kept: Vec<u8>,
    dropped: u64,
    /// Keep the latest `SHELL_BUFFER_CAP` bytes (a background shell) instead of the first
    /// `STREAM_CAP`; `dropped` then counts bytes dropped from the front.
    tail: bool,
}

impl Capture {
    fn push(&mut self, bytes: &[u8]) {
        if self.tail {
            self.kept.extend_from_slice(bytes);
            let excess = self.kept.len().saturating_sub(SHELL_BUFFER_CAP);
            if excess > 0 {
                self.kept.drain(..excess);
                self.dropped += excess as u64;
            }
            return;
        }
        let room = STREAM_CAP.saturating_sub(self.kept.len());
        let take = room.min(bytes.len());
        self.kept.extend_from_slice(&bytes[..take]);
        self.dropped += (bytes.len() - take) as u64;
    }

    fn render(&self) -> String {
        let mut text = String::from_utf8_lossy(&self.kept).into_owned();
        if self.dropped > 0 {
            text.push_str(&format!("\n[… {} more bytes not shown]", self.dropped));
        }
        text
    }
}

/// Where the shell itself is in its life.
#[derive(Clone, Copy, Debug)]
enum ExitState {
    Running,
    Exited(ExitStatus),
    /// Reaped by someone else (ECHILD): gone, status unknown.
    Unknown,
}

pub struct BashJob {
    child: Child,
    pgid: u32,
    stdout: Option<pipe::Receiver>,
    stderr: Option<pipe::Receiver>,
    out: Capture,
    err: Capture,
    exit: ExitState,
    killed_for: Option<&'static str>,
    pub timeout: Duration,
    /// Started with `background: true`: both streams go to `out`, kept as a tail, and the
    /// engine keeps the job as a shell of the run rather than waiting for it.
    background: bool,
    /// Tags every process of this call; the call is over for the reaper once its shell is
    /// reaped (or the job dropped).
    tag: CallTag,
    /// The sandbox the command runs in (`None`: unconfined), and where, to explain a
    /// failure it caused.
    sandbox: Option<(Mode, PathBuf, PathBuf)>,
    /// What the sandbox made for this command to hold read-only; removed (if unused and
    /// empty) when the job is dropped, after its processes are gone.
    _placeholders: sandbox::Placeholders,
}

/// `Bash` as offered to the model.
pub(crate) fn spec() -> ToolSpec {
    ToolSpec {
        name: Cow::Borrowed("Bash"),
        description: Cow::Borrowed(
            "Run a shell command in the workspace and return its exit status, stdout \
            and stderr. The command runs in its own process group and is killed, with every \
            process it started, when it times out or the turn is cancelled. stdout and stderr \
            are each capped at 30 KiB. There is no terminal and stdin is empty, so interactive \
            commands cannot work. Prefer Read, Glob and Grep over cat, find and grep, and Edit \
            or Write over sed or echo.",
        ),
        input_schema: closed_object(
            json!({
                "command": {
                    "type": "string",
                    "description": "The shell command to run."
                },
                "timeout_seconds": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": 600,
                    "description": "Kill the command after this many seconds (1-600, default 60)."
                },
                "cwd": {
                    "type": "string",
                    "description": "Directory to run in, relative to the workspace (default: the \
                        workspace root)."
                },
                "background": {
                    "type": "boolean",
                    "description": "Start the command in the background and return at once \
                        with its shell_id (default false): for servers and watchers. Read its \
                        output with BashOutput, stop it with KillShell; it is killed when the \
                        run ends. timeout_seconds does not apply."
                }
            }),
            &["command"],
        ),
    }
}

/// A call's title is the command line itself, as an editor shows an execute card.
pub(crate) fn title(input: &Value) -> String {
    cap_title(text_field(input, "command"))
}

/// What a call gets where there is no shell at all, as in caliban's `FROM scratch` image:
/// said plainly, with what still works, rather than as a failed exec of `/bin/sh`.
pub const NO_SHELL: &str = "Bash: no shell in this image: /bin/bash and /bin/sh not found. \
    Read, Write, Edit, Glob and Grep still work.";

/// Where a shell can be found, preferring bash for the syntax models expect.
pub fn shell() -> &'static str {
    if Path::new("/bin/bash").exists() {
        "/bin/bash"
    } else {
        "/bin/sh"
    }
}

fn resolve_cwd(workspace: &Path, cwd: Option<&str>) -> Result<PathBuf, String> {
    let Some(cwd) = cwd.filter(|c| !c.is_empty()) else {
        return Ok(workspace.to_path_buf());
    };
    let joined = workspace.join(cwd);
    let canonical = joined
        .canonicalize()
        .map_err(|e| format!("Bash: cwd `{cwd}`: {e}"))?;
    let root = workspace
        .canonicalize()
        .unwrap_or_else(|_| workspace.to_path_buf());
    if !canonical.starts_with(&root) {
        return Err(format!("Bash: cwd `{cwd}` is outside the workspace"));
    }
    if !canonical.is_dir() {
        return Err(format!("Bash: cwd `{cwd}` is not a directory"));
    }
    Ok(canonical)
}

/// A `Bash` call's input once checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BashInput {
    pub command: String,
    pub timeout: Duration,
    /// Where to run: the workspace or a directory inside it.
    pub cwd: PathBuf,
    /// Run as a background shell of the run (`BashOutput`, `KillShell`).
    pub background: bool,
}

/// Validates a `Bash` call's input (also for a host that runs the command elsewhere, such as
/// an editor's terminal). Errors are tool results for the model.
pub fn parse_input(input: &Value, workspace: &Path) -> Result<BashInput, ToolOutput> {
    let command = match input.get("command") {
        Some(Value::String(c)) if !c.trim().is_empty() => c.clone(),
        Some(Value::String(_)) => return Err(ToolOutput::error("Bash: `command` is empty")),
        _ => {
            return Err(ToolOutput::error(
                "Bash: missing required string field `command`",
            ));
        }
    };
    let timeout = timeout_seconds(input, "Bash", DEFAULT_TIMEOUT, MAX_TIMEOUT_SECS)?;
    let cwd = resolve_cwd(workspace, input.get("cwd").and_then(Value::as_str))
        .map_err(ToolOutput::error)?;
    let background = match input.get("background") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(flag)) => *flag,
        Some(_) => {
            return Err(ToolOutput::error(
                "Bash: `background` must be true or false",
            ));
        }
    };
    Ok(BashInput {
        command,
        timeout,
        cwd,
        background,
    })
}

impl BashJob {
    /// Validates the input and starts the child in the `mode` sandbox. Errors are tool
    /// results for the model.
    pub fn spawn(input: &Value, workspace: &Path, mode: Mode) -> Result<BashJob, ToolOutput> {
        let BashInput {
            command,
            timeout,
            cwd,
            background,
        } = parse_input(input, workspace)?;
        // No shell is not a sandbox failure: say so first, so an image without one gets
        // the message that explains it rather than a confinement error.
        if !Path::new(shell()).exists() {
            return Err(ToolOutput::error(NO_SHELL));
        }
        let (confinement, placeholders) = match sandbox::prepare(mode, workspace, &cwd)
            .map_err(|e| ToolOutput::error(format!("Bash: {e}")))?
        {
            Some(confined) => (Some(confined.confinement), confined.placeholders),
            None => (None, sandbox::Placeholders::default()),
        };
        let mut cmd = Command::new(shell());
        cmd.arg("-c")
            .arg(&command)
            .current_dir(&cwd)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let sandbox = confinement
            .is_some()
            .then(|| (mode, workspace.to_path_buf(), cwd.clone()));
        let tag = CallTag::new();
        let mut child = reaper::spawn(&mut cmd, Some(&tag), confinement).map_err(|e| {
            let within = match &sandbox {
                Some((mode, ..)) => format!(" in the sandbox ({mode})"),
                None => String::new(),
            };
            ToolOutput::error(format!("Bash: cannot start {}{within}: {e}", shell()))
        })?;
        let pgid = child.id();
        let pipes = (|| -> io::Result<(pipe::Receiver, pipe::Receiver)> {
            let out = pipe::Receiver::from(child.stdout.take().ok_or(io::ErrorKind::BrokenPipe)?);
            let err = pipe::Receiver::from(child.stderr.take().ok_or(io::ErrorKind::BrokenPipe)?);
            out.set_nonblocking(true)?;
            err.set_nonblocking(true)?;
            Ok((out, err))
        })();
        let (stdout, stderr) = match pipes {
            Ok(p) => p,
            Err(e) => {
                reaper::kill_descendants(pgid);
                let _ = sys::kill_group(pgid, sys::SIGKILL);
                let _ = reaper::wait(&mut child);
                reaper::sweep(Sweep::Call(&tag));
                return Err(ToolOutput::error(format!("Bash: pipe setup failed: {e}")));
            }
        };
        Ok(BashJob {
            child,
            pgid,
            stdout: Some(stdout),
            stderr: Some(stderr),
            out: Capture {
                tail: background,
                ..Capture::default()
            },
            err: Capture::default(),
            exit: ExitState::Running,
            killed_for: None,
            timeout,
            background,
            tag,
            sandbox,
            _placeholders: placeholders,
        })
    }

    pub fn register(&mut self, registry: &Registry, out: Token, err: Token) -> io::Result<()> {
        if let Some(p) = self.stdout.as_mut() {
            registry.register(p, out, Interest::READABLE)?;
        }
        if let Some(p) = self.stderr.as_mut() {
            registry.register(p, err, Interest::READABLE)?;
        }
        Ok(())
    }

    /// Reads one pipe until `WouldBlock` or EOF; at EOF the pipe is deregistered and closed.
    pub fn drain(&mut self, registry: &Registry, which: Stream) {
        let (slot, capture) = match which {
            Stream::Stdout => (&mut self.stdout, &mut self.out),
            // A background shell's streams are one log, in the order their bytes came.
            Stream::Stderr if self.background => (&mut self.stderr, &mut self.out),
            Stream::Stderr => (&mut self.stderr, &mut self.err),
        };
        let Some(pipe) = slot.as_mut() else { return };
        let mut buf = [0u8; 16 * 1024];
        loop {
            match pipe.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => capture.push(&buf[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => break,
            }
        }
        if let Some(mut pipe) = slot.take() {
            let _ = registry.deregister(&mut pipe);
        }
    }

    /// Non-blocking reap. Once the shell has exited, anything it left running is killed, in
    /// its group and in sessions of its own: a tool call must not leak background processes
    /// or hold our pipes open. The group is killed while the shell is still an unreaped
    /// zombie, which keeps the group id from being reused by an unrelated process.
    pub fn try_reap(&mut self) -> bool {
        if !matches!(self.exit, ExitState::Running) {
            return true;
        }
        match sys::has_exited_unreaped(self.pgid) {
            Ok(false) => false,
            Ok(true) => {
                let _ = sys::kill_group(self.pgid, sys::SIGKILL);
                reaper::sweep(Sweep::Call(&self.tag));
                self.exit = match reaper::wait(&mut self.child) {
                    Ok(status) => ExitState::Exited(status),
                    Err(_) => ExitState::Unknown,
                };
                true
            }
            Err(_) => {
                self.exit = ExitState::Unknown;
                true
            }
        }
    }

    /// Kills the whole process group and every descendant of the shell (timeout or cancel);
    /// the exit is reaped later. The tree is walked while the shell still runs, before the
    /// group kill orphans it. After the shell was reaped the group was already killed, and
    /// its id may belong to someone else by now, so nothing is sent.
    pub fn kill(&mut self, why: &'static str) {
        if self.killed_for.is_none() {
            self.killed_for = Some(why);
        }
        if matches!(self.exit, ExitState::Running) {
            reaper::kill_descendants(self.pgid);
            let _ = sys::kill_group(self.pgid, sys::SIGKILL);
        }
    }

    /// Blocking reap used on cancel and at shutdown, after `kill`; then what the call left,
    /// now caliban's, is killed and waited for too (`reaper::settle`), so nothing of a
    /// cancelled call is still running once the cancel is done.
    pub fn reap_blocking(&mut self) {
        if matches!(self.exit, ExitState::Running) {
            self.exit = match reaper::wait(&mut self.child) {
                Ok(status) => ExitState::Exited(status),
                Err(_) => ExitState::Unknown,
            };
            reaper::settle(&self.tag);
        }
    }

    pub fn is_complete(&self) -> bool {
        self.exited() && self.stdout.is_none() && self.stderr.is_none()
    }

    pub fn exited(&self) -> bool {
        !matches!(self.exit, ExitState::Running)
    }

    /// Closes pipes that a surviving grandchild holds open, so the job can complete.
    pub fn close_pipes(&mut self, registry: &Registry) {
        for mut pipe in [self.stdout.take(), self.stderr.take()]
            .into_iter()
            .flatten()
        {
            let _ = registry.deregister(&mut pipe);
        }
    }

    /// Started with `background: true`.
    pub fn is_background(&self) -> bool {
        self.background
    }

    /// How a background shell stands, for `BashOutput` and `KillShell`: `running`,
    /// `exited with code N`, `killed (why)`.
    pub fn shell_state(&self) -> String {
        use std::os::unix::process::ExitStatusExt;
        match (self.killed_for, self.exit) {
            (Some(why), _) => format!("killed ({why})"),
            (None, ExitState::Running) => "running".to_owned(),
            (None, ExitState::Exited(status)) => match (status.code(), status.signal()) {
                (Some(code), _) => format!("exited with code {code}"),
                (None, Some(signal)) => format!("killed by signal {signal}"),
                (None, None) => "exited".to_owned(),
            },
            (None, ExitState::Unknown) => "exited (status unknown)".to_owned(),
        }
    }

    /// A background shell's output from byte `since` of all it wrote (clamped to what is
    /// still kept), at most `SHELL_READ_CAP` bytes: the text, where it starts and ends, and
    /// the total written so far.
    pub fn shell_output(&self, since: u64) -> ShellRead {
        let log = &self.out;
        let total = log.dropped + log.kept.len() as u64;
        let from = since.clamp(log.dropped, total);
        let start = (from - log.dropped) as usize;
        let end = (start + SHELL_READ_CAP).min(log.kept.len());
        ShellRead {
            text: String::from_utf8_lossy(&log.kept[start..end]).into_owned(),
            from,
            to: log.dropped + end as u64,
            total,
            lost: from - since.min(from),
        }
    }

    pub fn output(&self) -> ToolOutput {
        use std::os::unix::process::ExitStatusExt;
        let mut text = self.out.render();
        let err = self.err.render();
        if !err.is_empty() {
            if !text.is_empty() && !text.ends_with('\n') {
                text.push('\n');
            }
            text.push_str("[stderr]\n");
            text.push_str(&err);
        }
        if !text.is_empty() && !text.ends_with('\n') {
            text.push('\n');
        }
        let mut is_error = false;
        match (self.killed_for, self.exit) {
            (Some(why), _) => {
                is_error = true;
                text.push_str(&format!("[{why}]"));
            }
            (None, ExitState::Exited(status)) => match (status.code(), status.signal()) {
                (Some(0), _) => text.push_str("[exit code: 0]"),
                (Some(code), _) => {
                    is_error = true;
                    text.push_str(&format!("[exit code: {code}]"));
                }
                (None, Some(sig)) => {
                    is_error = true;
                    text.push_str(&format!("[killed by signal {sig}]"));
                }
                (None, None) => text.push_str("[exit status unknown]"),
            },
            (None, _) => text.push_str("[exit status unknown]"),
        }
        ToolOutput::new(is_error, text)
    }

    /// The result for the model and, when the command failed in a way the sandbox explains,
    /// why (also noted at the end of the result).
    pub fn result(&self) -> (ToolOutput, Option<String>) {
        let mut output = self.output();
        let note = if output.is_error {
            self.sandbox_note(&output.text)
        } else {
            None
        };
        if let Some(note) = &note {
            output.text.push_str(&format!("\n[sandbox: {note}]"));
        }
        (output, note)
    }

    /// Why the sandbox may explain what `text` (this command's output) reports: also for a
    /// background shell's output, read while it may still run.
    pub fn sandbox_note(&self, text: &str) -> Option<String> {
        let (mode, workspace, cwd) = self.sandbox.as_ref()?;
        sandbox::explain(*mode, workspace, cwd, text)
    }
}

/// One `BashOutput` read of a background shell's log (byte offsets into all it wrote).
#[derive(Debug, PartialEq, Eq)]
pub struct ShellRead {
    pub text: String,
    pub from: u64,
    pub to: u64,
    pub total: u64,
    /// Bytes asked for that were already dropped from the buffer.
    pub lost: u64,
}

/// What a `BashOutput` or `KillShell` call asks of the run's background shells, which the
/// engine holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ShellOp {
    /// `since`: the byte offset to read from; `None` continues where the last read ended.
    Output {
        shell_id: String,
        since: Option<u64>,
    },
    Kill {
        shell_id: String,
    },
}

/// `BashOutput` as offered to the model.
pub(crate) fn output_spec() -> ToolSpec {
    ToolSpec {
        name: Cow::Borrowed("BashOutput"),
        description: Cow::Borrowed(
            "Read the output of a background shell (started with Bash and `background: \
            true`): its state (running, exited with code N, killed) and what it wrote to \
            stdout and stderr, interleaved, since `since_offset` (default: where the previous \
            BashOutput of this shell stopped). At most 30 KiB per call; the result gives the \
            offset to continue from. Only the latest 256 KiB of a shell's output is kept.",
        ),
        input_schema: closed_object(
            json!({
                "shell_id": {
                    "type": "string",
                    "description": "The shell_id Bash returned."
                },
                "since_offset": {
                    "type": "integer",
                    "minimum": 0,
                    "description": "Byte offset into everything the shell wrote to start from."
                }
            }),
            &["shell_id"],
        ),
    }
}

/// `KillShell` as offered to the model.
pub(crate) fn kill_spec() -> ToolSpec {
    ToolSpec {
        name: Cow::Borrowed("KillShell"),
        description: Cow::Borrowed(
            "Stop a background shell started with Bash and `background: true`: its process \
            group and every process it started are killed. Its output stays readable with \
            BashOutput.",
        ),
        input_schema: closed_object(
            json!({
                "shell_id": {
                    "type": "string",
                    "description": "The shell_id Bash returned."
                }
            }),
            &["shell_id"],
        ),
    }
}

fn shell_id(input: &Value, tool: &str) -> Result<String, ToolOutput> {
    match input.get("shell_id") {
        Some(Value::String(id)) if !id.is_empty() => Ok(id.clone()),
        _ => Err(ToolOutput::error(format!(
            "{tool}: missing required string field `shell_id`"
        ))),
    }
}

/// Checks a `BashOutput` call.
pub(crate) fn parse_output(input: &Value) -> Result<ShellOp, ToolOutput> {
    let since = match input.get("since_offset") {
        None | Some(Value::Null) => None,
        Some(v) => Some(v.as_u64().ok_or_else(|| {
            ToolOutput::error("BashOutput: `since_offset` must be an integer ≥ 0")
        })?),
    };
    Ok(ShellOp::Output {
        shell_id: shell_id(input, "BashOutput")?,
        since,
    })
}

/// Checks a `KillShell` call.
pub(crate) fn parse_kill(input: &Value) -> Result<ShellOp, ToolOutput> {
    Ok(ShellOp::Kill {
        shell_id: shell_id(input, "KillShell")?,
    })
}

/// A `BashOutput` or `KillShell` call's title.
pub(crate) fn shell_title(input: &Value) -> String {
    cap_title(text_field(input, "shell_id"))
}

impl Drop for BashJob {
    /// A safety net: however the job is dropped (a bug, a panic unwinding), its process
    /// group does not outlive it.
    fn drop(&mut self) {
        if matches!(self.exit, ExitState::Running) {
            reaper::kill_descendants(self.pgid);
            let _ = sys::kill_group(self.pgid, sys::SIGKILL);
            let _ = reaper::wait(&mut self.child);
            reaper::sweep(Sweep::Call(&self.tag));
        }
    }
}
