//! Tool calls carried out by the editor: `Read`, `Write` and `Edit` through the client's
//! `fs/read_text_file` and `fs/write_text_file` (so the agent sees unsaved buffers and the
//! editor tracks its edits), and `Bash` in an editor terminal (`terminal/*`).
//!
//! Each call is a small state machine (`Step`), advanced by the client's answers and by a
//! deadline, that tells the host what to send next (`Advance`). Sans-IO: nothing here sends,
//! arms a timer or knows request ids. The checks and result texts are the local tools' own
//! (`tools::fs::delegate`, `tools::bash::parse_input`), so a call reads the same to the model
//! wherever it ran.
//!
//! LIFECYCLE. fs: `Read` → result; `EditRead` → `Write` → result; `Write` → result.
//! Terminal: `TermCreate` → `TermWait` (deadline: the call's timeout) → `TermOutput` →
//! result and release; on the deadline `TermWait` → `TermKill` → `TermOutput`.

use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};

use crate::jsonrpc::RpcError;
use crate::tools::ToolOutput;
use crate::tools::bash::{self, BashInput};
use crate::tools::fs::{self, ApplyEdit, Delegated, ToolPath};
use crate::tools::table::{self, Delegation};

/// How long the editor may take over one fs or terminal bookkeeping request.
pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(60);
/// After a timed-out command is killed, how long the kill may take to be confirmed.
pub const KILL_TIMEOUT: Duration = Duration::from_secs(10);
/// Output an editor terminal keeps for the model: both of the local tool's streams' worth.
pub const TERMINAL_OUTPUT_BYTES: u64 = 2 * bash::STREAM_CAP as u64;

/// What the client offered in `initialize`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClientCaps {
    pub read: bool,
    pub write: bool,
    pub terminal: bool,
}

#[derive(Debug)]
pub enum Step {
    Read {
        path: ToolPath,
        offset: u64,
        limit: u64,
    },
    EditRead {
        path: ToolPath,
        input: Value,
        /// The tool's change to the text the editor sends.
        apply: ApplyEdit,
    },
    Write {
        path: ToolPath,
        /// The result to report once the editor stored the text.
        done: ToolOutput,
    },
    TermCreate {
        timeout: Duration,
    },
    TermWait {
        terminal: String,
        timeout: Duration,
    },
    TermKill {
        terminal: String,
        timeout: Duration,
    },
    TermOutput {
        terminal: String,
        /// `{exitCode, signal}` from `wait_for_exit`, when it answered.
        exit: Option<Value>,
        timed_out: Option<Duration>,
    },
}

/// A request to send; the call waits on its answer, for at most `deadline`.
#[derive(Debug, PartialEq)]
pub struct Request {
    pub method: &'static str,
    pub params: Value,
    pub deadline: Duration,
}

/// What the host does after a step moved.
#[derive(Debug, Default, PartialEq)]
pub struct Advance {
    pub request: Option<Request>,
    /// Embed this terminal in the call's card (it was just created).
    pub show_terminal: Option<String>,
    /// Release this terminal (fire and forget; the client keeps showing its output).
    pub release: Option<String>,
    /// The call is over: report this result to the run.
    pub result: Option<ToolOutput>,
}

impl Advance {
    fn request(method: &'static str, params: Value, deadline: Duration) -> Advance {
        Advance {
            request: Some(Request {
                method,
                params,
                deadline,
            }),
            ..Advance::default()
        }
    }

    fn result(output: ToolOutput) -> Advance {
        Advance {
            result: Some(output),
            ..Advance::default()
        }
    }
}

/// Starts a call in the editor when its row in `tools::table` says an editor can carry it
/// out and the client offered that; `None` runs it locally. An input the local tool would
/// refuse is refused the same way, without asking the editor.
pub fn start(
    caps: ClientCaps,
    tool: &str,
    input: &Value,
    workspace: &Path,
    session: &str,
) -> Option<Result<(Step, Request), ToolOutput>> {
    let delegation = table::lookup(tool).map_or(Delegation::Local, |row| row.delegation);
    let check = match delegation {
        // An image is read here: the editor's `fs/read_text_file` gives only text.
        Delegation::ReadFile(check) if caps.read && !fs::reads_image(input) => check,
        Delegation::WriteFile(check) if caps.write => check,
        Delegation::EditFile(check) if caps.read && caps.write => check,
        Delegation::Terminal(parse) if caps.terminal => {
            return match parse(input, workspace) {
                // A background shell stays with the run (BashOutput, KillShell read it), so
                // it runs here; an editor terminal would hold the turn until it exits.
                Ok(parsed) if parsed.background => None,
                parsed => Some(parsed.map(|parsed| terminal_create(session, parsed))),
            };
        }
        _ => return None,
    };
    let read = |path: &ToolPath| Request {
        method: "fs/read_text_file",
        params: json!({"sessionId": session, "path": path.abs.display().to_string()}),
        deadline: CLIENT_TIMEOUT,
    };
    Some(check(input, workspace).map(|call| match call {
        Delegated::Read {
            path,
            offset,
            limit,
        } => {
            let request = read(&path);
            (
                Step::Read {
                    path,
                    offset,
                    limit,
                },
                request,
            )
        }
        Delegated::Edit { path, input, apply } => {
            let request = read(&path);
            (Step::EditRead { path, input, apply }, request)
        }
        Delegated::Write {
            path,
            content,
            done,
        } => {
            let request = write_request(session, &path, content);
            (Step::Write { path, done }, request)
        }
    }))
}

/// The first step of a command in an editor's terminal.
fn terminal_create(session: &str, parsed: BashInput) -> (Step, Request) {
    let request = Request {
        method: "terminal/create",
        params: json!({
            "sessionId": session,
            "command": bash::shell(),
            // As the local Bash does, give the command no stdin: in an editor's
            // terminal it would otherwise wait on a prompt nobody sees.
            "args": ["-c", format!("exec </dev/null\n{}", parsed.command)],
            "cwd": parsed.cwd.display().to_string(),
            "outputByteLimit": TERMINAL_OUTPUT_BYTES,
        }),
        deadline: CLIENT_TIMEOUT,
    };
    (
        Step::TermCreate {
            timeout: parsed.timeout,
        },
        request,
    )
}

fn write_request(session: &str, path: &ToolPath, content: String) -> Request {
    Request {
        method: "fs/write_text_file",
        params: json!({"sessionId": session, "path": path.abs.display().to_string(),
                       "content": content}),
        deadline: CLIENT_TIMEOUT,
    }
}

fn terminal_params(session: &str, terminal: &str) -> Value {
    json!({"sessionId": session, "terminalId": terminal})
}

/// The client answered the request the call was waiting on.
pub fn on_answer(step: &mut Step, answer: Result<&Value, &RpcError>, session: &str) -> Advance {
    let failed = |what: &str, e: &RpcError| format!("{what}: {}", e.message);
    match step {
        Step::Read {
            path,
            offset,
            limit,
        } => Advance::result(match answer {
            Ok(v) => match v.get("content").and_then(Value::as_str) {
                Some(text) => fs::read_delegated(path, *offset, *limit, text),
                None => ToolOutput::error(format!(
                    "Read: the editor's answer for `{}` had no text",
                    path.rel
                )),
            },
            Err(e) => ToolOutput::error(failed(
                &format!("Read: the editor could not read `{}`", path.rel),
                e,
            )),
        }),
        Step::EditRead { path, input, apply } => {
            let text = match answer {
                Ok(v) => v.get("content").and_then(Value::as_str),
                Err(e) => {
                    return Advance::result(ToolOutput::error(failed(
                        &format!("Edit: the editor could not read `{}`", path.rel),
                        e,
                    )));
                }
            };
            let Some(text) = text else {
                return Advance::result(ToolOutput::error(format!(
                    "Edit: the editor's answer for `{}` had no text",
                    path.rel
                )));
            };
            match apply(path, input, text) {
                Ok((new_text, done)) => {
                    let request = write_request(session, path, new_text);
                    let path = path.clone();
                    *step = Step::Write { path, done };
                    Advance {
                        request: Some(request),
                        ..Advance::default()
                    }
                }
                Err(refused) => Advance::result(refused),
            }
        }
        Step::Write { path, done } => Advance::result(match answer {
            Ok(_) => done.clone(),
            Err(e) => ToolOutput::error(failed(
                &format!("Write: the editor could not write `{}`", path.rel),
                e,
            )),
        }),
        Step::TermCreate { timeout } => {
            let terminal = match answer {
                Ok(v) => v.get("terminalId").and_then(Value::as_str),
                Err(e) => {
                    return Advance::result(ToolOutput::error(failed(
                        "Bash: the editor could not start a terminal",
                        e,
                    )));
                }
            };
            let Some(terminal) = terminal.map(str::to_owned) else {
                return Advance::result(ToolOutput::error(
                    "Bash: the editor's terminal/create answer had no terminalId",
                ));
            };
            let timeout = *timeout;
            let params = terminal_params(session, &terminal);
            *step = Step::TermWait {
                terminal: terminal.clone(),
                timeout,
            };
            Advance {
                show_terminal: Some(terminal),
                ..Advance::request("terminal/wait_for_exit", params, timeout)
            }
        }
        Step::TermWait { terminal, .. } => {
            let terminal = terminal.clone();
            let exit = answer.ok().cloned();
            let params = terminal_params(session, &terminal);
            *step = Step::TermOutput {
                terminal,
                exit,
                timed_out: None,
            };
            Advance::request("terminal/output", params, CLIENT_TIMEOUT)
        }
        Step::TermKill { terminal, timeout } => {
            let terminal = terminal.clone();
            let params = terminal_params(session, &terminal);
            *step = Step::TermOutput {
                terminal,
                exit: None,
                timed_out: Some(*timeout),
            };
            Advance::request("terminal/output", params, CLIENT_TIMEOUT)
        }
        Step::TermOutput {
            terminal,
            exit,
            timed_out,
        } => {
            let result = match answer {
                Ok(v) => terminal_result(v, exit.as_ref(), *timed_out),
                Err(e) => ToolOutput::error(failed(
                    "Bash: the editor could not report the terminal's output",
                    e,
                )),
            };
            Advance {
                release: Some(terminal.clone()),
                ..Advance::result(result)
            }
        }
    }
}

/// The call's deadline passed without an answer.
pub fn on_deadline(step: &mut Step, session: &str) -> Advance {
    match step {
        Step::TermWait { terminal, timeout } => {
            let (terminal, timeout) = (terminal.clone(), *timeout);
            let params = terminal_params(session, &terminal);
            *step = Step::TermKill { terminal, timeout };
            Advance::request("terminal/kill", params, KILL_TIMEOUT)
        }
        Step::TermKill { terminal, timeout } => Advance {
            release: Some(terminal.clone()),
            ..Advance::result(ToolOutput::error(format!(
                "[timed out after {} s; the editor did not confirm the kill]",
                timeout.as_secs()
            )))
        },
        Step::TermOutput { terminal, .. } => Advance {
            release: Some(terminal.clone()),
            ..Advance::result(ToolOutput::error(format!(
                "Bash: the editor did not report the terminal's output within {} s",
                CLIENT_TIMEOUT.as_secs()
            )))
        },
        Step::TermCreate { .. } => Advance::result(ToolOutput::error(format!(
            "Bash: the editor did not start a terminal within {} s",
            CLIENT_TIMEOUT.as_secs()
        ))),
        Step::Read { path, .. } | Step::EditRead { path, .. } | Step::Write { path, .. } => {
            Advance::result(ToolOutput::error(format!(
                "the editor did not answer for `{}` within {} s",
                path.rel,
                CLIENT_TIMEOUT.as_secs()
            )))
        }
    }
}

/// The terminal a call holds, which must be killed and released if the call is abandoned.
pub fn terminal_of(step: &Step) -> Option<&str> {
    match step {
        Step::TermWait { terminal, .. }
        | Step::TermKill { terminal, .. }
        | Step::TermOutput { terminal, .. } => Some(terminal),
        _ => None,
    }
}

/// The model's view of a finished terminal, in the local `Bash` tool's shape.
fn terminal_result(
    output: &Value,
    exit: Option<&Value>,
    timed_out: Option<Duration>,
) -> ToolOutput {
    let mut text = String::new();
    if output.get("truncated").and_then(Value::as_bool) == Some(true) {
        text.push_str("[… earlier output not shown]\n");
    }
    // The client should keep to `outputByteLimit`; keep the tail ourselves if it did not,
    // as the local Bash caps what it hands the model.
    let raw = output.get("output").and_then(Value::as_str).unwrap_or("");
    let limit = TERMINAL_OUTPUT_BYTES as usize;
    if raw.len() > limit {
        let start = raw.ceil_char_boundary(raw.len() - limit);
        text.push_str(&format!("[… {start} earlier bytes not shown]\n"));
        text.push_str(&raw[start..]);
    } else {
        text.push_str(raw);
    }
    if !text.is_empty() && !text.ends_with('\n') {
        text.push('\n');
    }
    if let Some(timeout) = timed_out {
        text.push_str(&format!(
            "[timed out after {} s; the command was killed]",
            timeout.as_secs()
        ));
        return ToolOutput::error(text);
    }
    let status = exit
        .filter(|e| e.is_object())
        .or_else(|| output.get("exitStatus").filter(|e| e.is_object()));
    let code = status
        .and_then(|s| s.get("exitCode"))
        .and_then(Value::as_i64);
    let signal = status.and_then(|s| s.get("signal")).and_then(Value::as_str);
    let is_error = match (code, signal) {
        (Some(0), _) => {
            text.push_str("[exit code: 0]");
            false
        }
        (Some(code), _) => {
            text.push_str(&format!("[exit code: {code}]"));
            true
        }
        (None, Some(signal)) => {
            text.push_str(&format!("[killed by signal {signal}]"));
            true
        }
        (None, None) => {
            text.push_str("[exit status unknown]");
            true
        }
    };
    ToolOutput::new(is_error, text)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: ClientCaps = ClientCaps {
        read: true,
        write: true,
        terminal: true,
    };

    fn workspace() -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("caliban-delegate-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("a.txt"), "one\ntwo\n").unwrap();
        dir.canonicalize().unwrap()
    }

    #[test]
    fn local_when_the_client_cannot() {
        let ws = workspace();
        let input = json!({"path": "a.txt"});
        assert!(start(ClientCaps::default(), "Read", &input, &ws, "s").is_none());
        assert!(start(ALL, "Grep", &json!({"pattern": "x"}), &ws, "s").is_none());
        let only_read = ClientCaps {
            read: true,
            ..ClientCaps::default()
        };
        assert!(start(only_read, "Edit", &input, &ws, "s").is_none());
    }

    #[test]
    fn edit_reads_then_writes_through_the_editor() {
        let ws = workspace();
        let input = json!({"path": "a.txt", "old_string": "two", "new_string": "2"});
        let (mut step, request) = start(ALL, "Edit", &input, &ws, "s").unwrap().unwrap();
        assert_eq!(request.method, "fs/read_text_file");
        assert_eq!(
            request.params["path"],
            ws.join("a.txt").display().to_string()
        );
        // The editor's buffer differs from the disk: the edit applies to the buffer.
        let next = on_answer(&mut step, Ok(&json!({"content": "one\ntwo\nthree\n"})), "s");
        let write = next.request.expect("a write");
        assert_eq!(write.method, "fs/write_text_file");
        assert_eq!(write.params["content"], "one\n2\nthree\n");
        let done = on_answer(&mut step, Ok(&Value::Null), "s");
        let result = done.result.expect("a result");
        assert!(!result.is_error, "{}", result.text);
        assert!(result.text.starts_with("→ Edited a.txt"), "{}", result.text);
    }

    #[test]
    fn refusals_match_the_local_tool() {
        let ws = workspace();
        let err = start(ALL, "Read", &json!({"path": "../x"}), &ws, "s")
            .unwrap()
            .unwrap_err();
        assert!(
            err.is_error && err.text.starts_with("Read: "),
            "{}",
            err.text
        );
        let err = start(ALL, "Bash", &json!({}), &ws, "s")
            .unwrap()
            .unwrap_err();
        assert_eq!(err.text, "Bash: missing required string field `command`");
        let (mut step, _) = start(
            ALL,
            "Edit",
            &json!({"path": "a.txt", "old_string": "zzz", "new_string": "y"}),
            &ws,
            "s",
        )
        .unwrap()
        .unwrap();
        let miss = on_answer(&mut step, Ok(&json!({"content": "one\n"})), "s");
        assert!(miss.result.unwrap().text.contains("was not found"));
    }

    #[test]
    fn terminal_lifecycle_and_timeout() {
        let ws = workspace();
        let input = json!({"command": "sleep 5", "timeout_seconds": 2});
        let (mut step, create) = start(ALL, "Bash", &input, &ws, "s").unwrap().unwrap();
        assert_eq!(
            create.params["args"],
            json!(["-c", "exec </dev/null\nsleep 5"])
        );
        let next = on_answer(&mut step, Ok(&json!({"terminalId": "t1"})), "s");
        assert_eq!(next.show_terminal.as_deref(), Some("t1"));
        let wait = next.request.unwrap();
        assert_eq!(
            (wait.method, wait.deadline),
            ("terminal/wait_for_exit", Duration::from_secs(2))
        );
        let kill = on_deadline(&mut step, "s").request.unwrap();
        assert_eq!(kill.method, "terminal/kill");
        let output = on_answer(&mut step, Ok(&json!({})), "s").request.unwrap();
        assert_eq!(output.method, "terminal/output");
        let done = on_answer(
            &mut step,
            Ok(&json!({"output": "zz", "truncated": false})),
            "s",
        );
        assert_eq!(done.release.as_deref(), Some("t1"));
        let result = done.result.unwrap();
        assert!(result.is_error);
        assert_eq!(
            result.text,
            "zz\n[timed out after 2 s; the command was killed]"
        );
    }

    #[test]
    fn terminal_exit_codes_read_like_local_bash() {
        let ok = terminal_result(
            &json!({"output": "hi\n", "truncated": false}),
            Some(&json!({"exitCode": 0})),
            None,
        );
        assert_eq!(
            (ok.is_error, ok.text.as_str()),
            (false, "hi\n[exit code: 0]")
        );
        let bad = terminal_result(
            &json!({"output": "", "truncated": true, "exitStatus": {"exitCode": 3}}),
            None,
            None,
        );
        assert_eq!(
            (bad.is_error, bad.text.as_str()),
            (true, "[… earlier output not shown]\n[exit code: 3]")
        );
        let sig = terminal_result(
            &json!({"output": ""}),
            Some(&json!({"exitCode": null, "signal": "SIGTERM"})),
            None,
        );
        assert_eq!(sig.text, "[killed by signal SIGTERM]");
    }
}
