//! The sandbox on the real kernel: every mode's writes, the deny list, the network, what a
//! command's descendants inherit, the `core.fsmonitor` escalation, the prompt to run a
//! refused call outside the sandbox, background shells (confined as foreground commands),
//! `MultiEdit` (held to the file tools' policy), `WebFetch` (not a command, so not
//! confined), and what happens where Landlock is missing (simulated with
//! `CALIBAN_SANDBOX_NO_LANDLOCK`) or a mount namespace is (`CALIBAN_SANDBOX_NO_MOUNTNS`).
//! Commands come from the stub model as `Bash` calls, run by the real binary; nothing here
//! is mocked.

use std::io::Write;
use std::net::TcpListener;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::http_serve::{
    all_events, session_file, start_run, tool_end, wait_prompt, wait_terminal,
};
use crate::http_util::*;
use crate::util::*;

mod kernel;

static NEXT: AtomicUsize = AtomicUsize::new(0);

/// A directory outside the workspace and outside every temp dir (`outside_root`), removed
/// on drop.
struct Outside(PathBuf);

impl Outside {
    fn new(tag: &str) -> Outside {
        let n = NEXT.fetch_add(1, Ordering::SeqCst);
        let dir = outside_root().join(format!("outside-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create the outside dir");
        let dir = dir.canonicalize().expect("canonical");
        Outside(dir)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    fn display(&self, name: &str) -> String {
        path_str(&self.path(name))
    }
}

impl Drop for Outside {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn bash_call(id: &str, command: &str) -> Value {
    json!({"id": id, "name": "Bash", "input": {"command": command}})
}

/// One model turn calling `calls` at once, then a closing answer.
fn script(calls: Vec<Value>) -> Value {
    json!({"turns": [
        {"tool_calls": calls, "usage": {"input_tokens": 20, "output_tokens": 8}},
        {"text": "done", "usage": {"input_tokens": 12, "output_tokens": 5}},
    ]})
}

/// The print-mode run of `calls` with every tool allowed, its output and each call's
/// result text by id.
fn print_run(
    ws: &Workspace,
    calls: Vec<Value>,
    args: &[&str],
    env: &[(&str, &str)],
) -> (Output, std::collections::HashMap<String, String>) {
    print_script_run(ws, &script(calls), args, env)
}

/// `print_run` of a whole stub script.
fn print_script_run(
    ws: &Workspace,
    script: &Value,
    args: &[&str],
    env: &[(&str, &str)],
) -> (Output, std::collections::HashMap<String, String>) {
    let stub = Stub::start(ws, script);
    let mut cmd = caliban(ws);
    anthropic(&mut cmd, &stub);
    cmd.args(["-p", "go", "--output-format", "stream-json"])
        .args(["--allow", "Bash", "--allow", "Write", "--allow", "Edit"])
        .args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = run(cmd, "");
    let results = out
        .frames()
        .into_iter()
        .filter(|f| f["type"] == "tool_result")
        .map(|f| {
            let text = f["content"]
                .as_array()
                .and_then(|blocks| blocks.first())
                .and_then(|b| b["text"].as_str())
                .unwrap_or_default()
                .to_owned();
            (
                f["tool_use_id"].as_str().unwrap_or_default().to_owned(),
                text,
            )
        })
        .collect();
    (out, results)
}

/// Checks a run header's `sandbox` states `mode` enforced: as root perhaps with the caveat
/// that the kernel applies no process limit to root (where caliban can make no pids cgroup).
fn assert_enforced(sandbox: &Value, mode: &str) {
    assert_eq!(sandbox["mode"], mode, "{sandbox}");
    assert_eq!(sandbox["enforced"], true, "{sandbox}");
    match sandbox.get("caveat") {
        None => assert_eq!(sandbox.as_object().map(|o| o.len()), Some(2), "{sandbox}"),
        Some(caveat) => {
            assert!(ordinary_user().is_some(), "{sandbox}");
            let caveat = caveat.as_str().unwrap_or_default();
            assert!(
                caveat.starts_with("no process limit: caliban runs as root"),
                "{sandbox}"
            );
        }
    }
}

fn init_frame(out: &Output) -> Value {
    out.frames()
        .into_iter()
        .find(|f| f["type"] == "system" && f["subtype"] == "init")
        .unwrap_or_else(|| panic!("no init frame: {out:?}"))
}

/// Writes one file inside the workspace and one outside it, in `mode`.
fn write_inside_and_outside(mode: &str) -> (Workspace, Outside, Output, Vec<String>) {
    let ws = Workspace::new(&format!("sbx-{mode}"));
    let outside = Outside::new(mode);
    let calls = vec![
        bash_call("in", "echo inside > inside.txt && cat inside.txt"),
        bash_call(
            "out",
            &format!("echo outside > {}", outside.display("f.txt")),
        ),
        bash_call(
            "tmp",
            &format!("echo temp > /tmp/caliban-sbx-{}-{mode}", std::process::id()),
        ),
    ];
    let (out, results) = print_run(&ws, calls, &["--sandbox", mode], &[]);
    let _ = std::fs::remove_file(format!("/tmp/caliban-sbx-{}-{mode}", std::process::id()));
    let texts = ["in", "out", "tmp"].map(|id| results[id].clone()).to_vec();
    (ws, outside, out, texts)
}

#[test]
fn workspace_write_writes_inside_the_workspace_and_temp_dirs_only() {
    let (ws, outside, out, texts) = write_inside_and_outside("workspace-write");
    assert_enforced(&init_frame(&out)["sandbox"], "workspace-write");
    assert!(
        texts[0].starts_with("inside\n[exit code: 0]"),
        "{}",
        texts[0]
    );
    assert_eq!(ws.read("inside.txt"), "inside\n");
    assert!(
        !outside.path("f.txt").exists(),
        "a write outside the workspace got through"
    );
    let expected = format!(
        "[sandbox: write to {} blocked by the sandbox (workspace-write): commands may write only in {}",
        outside.display("f.txt"),
        path_str(&ws.root)
    );
    assert!(texts[1].contains("Permission denied"), "{}", texts[1]);
    assert!(texts[1].contains(&expected), "{}", texts[1]);
    assert!(texts[2].ends_with("[exit code: 0]"), "{}", texts[2]);
    // The print run's session file says the same as its init frame.
    assert_eq!(
        session_header(&ws, "run-1")["sandbox"],
        init_frame(&out)["sandbox"]
    );
}

#[test]
fn read_only_writes_nothing() {
    let (ws, outside, out, texts) = write_inside_and_outside("read-only");
    assert_eq!(init_frame(&out)["sandbox"]["mode"], "read-only");
    assert!(!ws.path("inside.txt").exists());
    assert!(!outside.path("f.txt").exists());
    for text in &texts {
        assert!(
            text.contains("blocked by the sandbox (read-only): commands may write nothing"),
            "{text}"
        );
    }
}

#[test]
fn network_mode_writes_like_workspace_write() {
    let (ws, outside, _, texts) = write_inside_and_outside("network");
    assert_eq!(ws.read("inside.txt"), "inside\n");
    assert!(!outside.path("f.txt").exists());
    assert!(
        texts[1].contains("blocked by the sandbox (network)"),
        "{}",
        texts[1]
    );
}

#[test]
fn off_writes_anywhere() {
    let (ws, outside, out, texts) = write_inside_and_outside("off");
    assert_eq!(
        init_frame(&out)["sandbox"],
        json!({"mode": "off", "enforced": false})
    );
    assert_eq!(ws.read("inside.txt"), "inside\n");
    assert_eq!(
        std::fs::read_to_string(outside.path("f.txt")).unwrap(),
        "outside\n"
    );
    assert!(!texts[1].contains("sandbox"), "{}", texts[1]);
}

/// A fake home outside the workspace holding a key, a netrc and caliban's own settings.
fn fake_home(tag: &str) -> Outside {
    let home = Outside::new(tag);
    std::fs::create_dir_all(home.path(".ssh")).unwrap();
    std::fs::write(home.path(".ssh/id_ed25519"), "PRIVATE-KEY-BYTES\n").unwrap();
    std::fs::write(home.path(".netrc"), "machine x password NETRC-SECRET\n").unwrap();
    std::fs::create_dir_all(home.path(".config/caliban")).unwrap();
    std::fs::write(home.path(".config/caliban/settings.json"), "{}\n").unwrap();
    std::fs::write(home.path("notes.txt"), "readable\n").unwrap();
    home
}

fn home_reads(ws: &Workspace, home: &Outside, env: &[(&str, &str)]) -> Vec<String> {
    let calls = vec![
        bash_call("key", "cat ~/.ssh/id_*"),
        bash_call("netrc", "cat ~/.netrc"),
        bash_call("settings", "cat ~/.config/caliban/settings.json"),
        bash_call("notes", "cat ~/notes.txt"),
    ];
    let home_str = path_str(&home.0);
    let mut env = env.to_vec();
    env.extend([("HOME", home_str.as_str()), ("XDG_CONFIG_HOME", "")]);
    let (out, results) = print_run(ws, calls, &[], &env);
    assert_eq!(init_frame(&out)["sandbox"]["enforced"], true, "{out:?}");
    ["key", "netrc", "settings", "notes"]
        .map(|id| results[id].clone())
        .to_vec()
}

/// The key and the netrc stayed unread, an ordinary file in the home did not.
fn assert_home_fenced(texts: &[String]) {
    assert!(!texts[0].contains("PRIVATE-KEY-BYTES"), "{}", texts[0]);
    assert!(!texts[1].contains("NETRC-SECRET"), "{}", texts[1]);
    assert!(texts[1].contains("Permission denied"), "{}", texts[1]);
    assert!(texts[3].starts_with("readable\n"), "{}", texts[3]);
}

#[test]
fn the_deny_list_keeps_keys_and_caliban_settings_from_commands() {
    let ws = Workspace::new("sbx-deny");
    let home = fake_home("home");
    let texts = home_reads(&ws, &home, &[]);
    assert_home_fenced(&texts);
    assert!(
        texts[0].contains("blocked by the sandbox (workspace-write): ~/.ssh is on its deny list"),
        "{}",
        texts[0]
    );
    assert!(
        texts[2].contains("~/.config/caliban is on its deny list"),
        "{}",
        texts[2]
    );
}

#[test]
fn commands_see_no_process_outside_the_sandbox_nor_caliban_s_environment() {
    let ws = Workspace::new("sbx-proc");
    let secret = format!("CALIBAN_TEST_SECRET_{}", std::process::id());
    let calls = vec![bash_call(
        "proc",
        "cat /proc/$PPID/environ; ls -d /proc/$PPID; ls /proc | grep -c '^[0-9]'",
    )];
    let (_, results) = print_run(&ws, calls, &[], &[(secret.as_str(), "sekrit")]);
    let text = &results["proc"];
    assert!(!text.contains("sekrit"), "{text}");
    assert!(text.contains("No such file or directory"), "{text}");
    // The shell, ls and grep: the sandbox's own processes only.
    let visible: u32 = text
        .lines()
        .next()
        .unwrap_or_default()
        .trim()
        .parse()
        .unwrap_or(99);
    assert!(visible <= 4, "{text}");
}

#[test]
fn in_a_user_namespace_as_without_privilege_the_fences_hold() {
    let ws = Workspace::new("sbx-userns");
    let home = fake_home("home-userns");
    let env = [("CALIBAN_SANDBOX_USERNS", "1")];
    let texts = home_reads(&ws, &home, &env);
    assert_home_fenced(&texts);
    assert!(
        texts[0].contains("~/.ssh is on its deny list"),
        "{}",
        texts[0]
    );
    git_init(&ws);
    let calls = vec![
        bash_call("git", "git config core.fsmonitor 'touch pwned'"),
        bash_call(
            "new",
            "echo c > new-at-the-root.txt && cat new-at-the-root.txt",
        ),
    ];
    let (_, results) = print_run(&ws, calls, &[], &env);
    assert!(
        results["git"].contains("Read-only file system"),
        "{}",
        results["git"]
    );
    assert!(!git_config(&ws).contains("fsmonitor"));
    assert!(results["new"].starts_with("c\n"), "{}", results["new"]);
}

#[test]
fn without_a_mount_namespace_landlock_alone_holds_the_deny_list_and_protected_paths() {
    let ws = Workspace::new("sbx-nomnt");
    let home = fake_home("home-nomnt");
    let env = [("CALIBAN_SANDBOX_NO_MOUNTNS", "1")];
    let texts = home_reads(&ws, &home, &env);
    assert_home_fenced(&texts);
    assert!(texts[0].contains("Permission denied"), "{}", texts[0]);

    git_init(&ws);
    ws.write("src/a.txt", "a\n");
    let calls = vec![
        bash_call("git", "git config core.fsmonitor 'touch pwned'"),
        bash_call("edit", "echo b > src/a.txt && cat src/a.txt"),
        bash_call("new", "echo c > new-at-the-root.txt"),
    ];
    let (_, results) = print_run(&ws, calls, &[], &env);
    assert!(
        results["git"].contains("could not lock config file"),
        "{}",
        results["git"]
    );
    assert!(!git_config(&ws).contains("fsmonitor"));
    assert!(results["edit"].starts_with("b\n"), "{}", results["edit"]);
    // The documented cost of fencing without mounts: nothing new beside `.git`.
    assert!(!ws.path("new-at-the-root.txt").exists());
    assert!(
        results["new"].contains("without a mount namespace"),
        "{}",
        results["new"]
    );
}

/// A loopback listener outside the sandbox that greets every connection, until dropped.
struct Listener {
    port: u16,
    accepted: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
}

impl Listener {
    fn start() -> Listener {
        let socket = TcpListener::bind("127.0.0.1:0").expect("bind");
        socket.set_nonblocking(true).expect("nonblocking");
        let port = socket.local_addr().expect("addr").port();
        let accepted = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (count, done) = (Arc::clone(&accepted), Arc::clone(&stop));
        std::thread::spawn(move || {
            let deadline = Instant::now() + RUN_TIMEOUT;
            while !done.load(Ordering::SeqCst) && Instant::now() < deadline {
                match socket.accept() {
                    Ok((mut conn, _)) => {
                        count.fetch_add(1, Ordering::SeqCst);
                        let _ = conn.write_all(b"hello");
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        });
        Listener {
            port,
            accepted,
            stop,
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

fn python_connect(mode: &str) -> (String, usize) {
    let ws = Workspace::new(&format!("sbx-net-{mode}"));
    let listener = Listener::start();
    let command = format!(
        "python3 -c \"import socket; s = socket.create_connection(('127.0.0.1', {}), timeout=10); \
         print('got', s.recv(5).decode())\"",
        listener.port
    );
    let (_, results) = print_run(
        &ws,
        vec![bash_call("net", &command)],
        &["--sandbox", mode],
        &[],
    );
    (
        results["net"].clone(),
        listener.accepted.load(Ordering::SeqCst),
    )
}

#[test]
fn a_socket_to_a_loopback_listener_needs_the_network_mode() {
    for mode in ["workspace-write", "read-only"] {
        let (text, accepted) = python_connect(mode);
        assert_eq!(accepted, 0, "{mode}: {text}");
        assert!(text.contains("PermissionError"), "{mode}: {text}");
        assert!(
            text.contains(&format!("network access blocked by the sandbox ({mode})")),
            "{mode}: {text}"
        );
    }
    let (text, accepted) = python_connect("network");
    assert_eq!(accepted, 1, "{text}");
    assert!(text.starts_with("got hello\n[exit code: 0]"), "{text}");
}

#[test]
fn network_ports_limit_where_tcp_may_connect() {
    let ws = Workspace::new("sbx-ports");
    let (open, closed) = (Listener::start(), Listener::start());
    ws.write(
        "home/.config/caliban/settings.json",
        &json!({"sandbox": {"network_ports": [open.port]}}).to_string(),
    );
    let connect = |port: u16| {
        format!(
            "python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=10); print('ok')\""
        )
    };
    let calls = vec![
        bash_call("open", &connect(open.port)),
        bash_call("closed", &connect(closed.port)),
    ];
    let (_, results) = print_run(&ws, calls, &["--sandbox", "network"], &[]);
    assert!(results["open"].starts_with("ok\n"), "{}", results["open"]);
    assert!(
        results["closed"].contains("PermissionError"),
        "{}",
        results["closed"]
    );
    assert_eq!(closed.accepted.load(Ordering::SeqCst), 0);
}

#[test]
fn descendants_in_sessions_of_their_own_stay_confined() {
    let ws = Workspace::new("sbx-setsid");
    let outside = Outside::new("setsid");
    let command = format!(
        "setsid -w sh -c 'echo x > {a}; echo in > setsid-ran'; \
         nohup sh -c 'echo x > {b}; echo in > nohup-ran' > /dev/null 2>&1; \
         setsid sh -c 'sleep 0.2; echo x > {c}' & wait",
        a = outside.display("setsid"),
        b = outside.display("nohup"),
        c = outside.display("background"),
    );
    let (_, results) = print_run(&ws, vec![bash_call("s", &command)], &[], &[]);
    // They ran (their writes inside landed) …
    assert!(ws.path("setsid-ran").exists(), "{}", results["s"]);
    assert!(ws.path("nohup-ran").exists(), "{}", results["s"]);
    // … and their writes outside did not, the detached one included.
    for name in ["setsid", "nohup", "background"] {
        assert!(
            !outside.path(name).exists(),
            "{name} escaped: {}",
            results["s"]
        );
    }
}

#[test]
fn a_background_shell_is_confined_like_a_foreground_command() {
    let ws = Workspace::new("sbx-background");
    let outside = Outside::new("background-shell");
    // The background shell writes inside and (fails to) outside, then says it is done; its
    // error is in its pipe by then. The foreground call waits for that.
    let background = format!(
        "echo bg > bg-inside.txt; echo x > {}; touch bg-done",
        outside.display("bg.txt")
    );
    let script = json!({"turns": [
        {"tool_calls": [{"id": "bg", "name": "Bash",
                         "input": {"command": background, "background": true}}]},
        {"tool_calls": [bash_call("wait", "while [ ! -e bg-done ]; do sleep 0.02; done")]},
        {"tool_calls": [{"id": "read", "name": "BashOutput", "input": {"shell_id": "shell_1"}}]},
        {"text": "done"},
    ]});
    let args = ["--sandbox", "workspace-write"];
    let (out, results) = print_script_run(&ws, &script, &args, &[]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(
        results["bg"].starts_with("Started background shell shell_1"),
        "{}",
        results["bg"]
    );
    assert_eq!(ws.read("bg-inside.txt"), "bg\n");
    assert!(
        !outside.path("bg.txt").exists(),
        "a background shell wrote outside the workspace"
    );
    // Its output explains the refusal as a foreground command's result does.
    let read = &results["read"];
    assert!(read.contains("Permission denied"), "{read}");
    let expected = format!(
        "[sandbox: write to {} blocked by the sandbox (workspace-write)",
        outside.display("bg.txt")
    );
    assert!(read.contains(&expected), "{read}");
}

#[test]
fn web_fetch_is_not_a_command_the_sandbox_confines() {
    // The sandbox takes the network from commands; WebFetch is caliban's own request,
    // governed by the permission rules, so it works even in read-only.
    let ws = Workspace::new("sbx-webfetch");
    let site = crate::long_work::web_server();
    let calls = vec![json!({"id": "f", "name": "WebFetch",
                            "input": {"url": format!("{site}/page")}})];
    let (out, results) = print_run(
        &ws,
        calls,
        &[
            "--sandbox",
            "read-only",
            "--allow",
            "WebFetch(domain:127.0.0.1)",
        ],
        &[],
    );
    assert_eq!(init_frame(&out)["sandbox"]["mode"], "read-only");
    assert!(
        results["f"].starts_with(&format!("→ WebFetch {site}/page (200, ")),
        "{}",
        results["f"]
    );
}

fn git_init(ws: &Workspace) {
    let status = std::process::Command::new("git")
        .args(["init", "-q", "."])
        .current_dir(&ws.root)
        .env("HOME", ws.path("home"))
        .status()
        .expect("git is needed");
    assert!(status.success());
}

fn git_config(ws: &Workspace) -> String {
    std::fs::read_to_string(ws.path(".git/config")).expect(".git/config")
}

#[test]
fn the_fsmonitor_escalation_is_blocked_even_in_bypass_permissions() {
    let ws = Workspace::new("sbx-fsmonitor");
    let outside = Outside::new("fsmonitor");
    git_init(&ws);
    let before = git_config(&ws);
    let hook = format!("touch {}", outside.display("pwned"));
    let config = format!("{before}[core]\n\tfsmonitor = {hook}\n");
    let calls = vec![
        bash_call("cmd", &format!("git config core.fsmonitor '{hook}'")),
        bash_call(
            "redirect",
            &format!("printf '[core]\\n\\tfsmonitor = {hook}\\n' >> .git/config"),
        ),
        json!({"id": "write", "name": "Write", "input": {"path": ".git/config", "content": config}}),
        json!({"id": "multi", "name": "MultiEdit", "input": {"path": ".git/config", "edits": [
            {"old_string": "[core]", "new_string": format!("[core]\n\tfsmonitor = {hook}")},
        ]}}),
    ];
    let args = ["--permission-mode", "bypassPermissions"];
    let (out, results) = print_run(&ws, calls, &args, &[]);
    assert_eq!(init_frame(&out)["permission_mode"], "bypassPermissions");
    assert_eq!(git_config(&ws), before, "{results:?}");
    assert!(
        results["cmd"].contains(".git is a protected path"),
        "{}",
        results["cmd"]
    );
    assert!(
        results["redirect"].contains("Read-only file system"),
        "{}",
        results["redirect"]
    );
    assert_eq!(
        results["write"],
        "Write: write to `.git/config` blocked by the sandbox (workspace-write): .git/ is a \
         protected path (git's config and hooks: a `core.fsmonitor`, `core.pager`, alias or \
         hook there runs any command the next time an allowed git command runs), read-only \
         unless sandbox.protected_writable lists it"
    );
    // MultiEdit is held to the same policy as Write and Edit.
    assert!(
        results["multi"].starts_with(
            "MultiEdit: write to `.git/config` blocked by the sandbox (workspace-write): .git/ \
             is a protected path"
        ),
        "{}",
        results["multi"]
    );

    // A repository that arrived with the hook in place: it runs, inside the sandbox.
    std::fs::write(
        ws.path(".git/config"),
        format!("{before}[core]\n\tfsmonitor = \"touch fsmonitor-ran; {hook}\"\n"),
    )
    .unwrap();
    let (_, results) = print_run(
        &ws,
        vec![bash_call("status", "git status --short")],
        &[],
        &[],
    );
    assert!(ws.path("fsmonitor-ran").exists(), "{}", results["status"]);
    assert!(!outside.path("pwned").exists(), "{}", results["status"]);
}

#[test]
fn protected_paths_can_be_made_writable_by_the_user() {
    let ws = Workspace::new("sbx-protected-ok");
    git_init(&ws);
    ws.write(
        "home/.config/caliban/settings.json",
        r#"{"sandbox": {"protected_writable": [".git/"]}}"#,
    );
    let calls = vec![bash_call("cmd", "git config user.name caliban-test")];
    let (_, results) = print_run(&ws, calls, &[], &[]);
    assert!(
        results["cmd"].ends_with("[exit code: 0]"),
        "{}",
        results["cmd"]
    );
    assert!(git_config(&ws).contains("caliban-test"));
}

#[test]
fn without_landlock_the_default_runs_unconfined_and_says_so() {
    let ws = Workspace::new("sbx-nolandlock");
    let outside = Outside::new("nolandlock");
    let calls = vec![bash_call(
        "out",
        &format!("echo x > {}", outside.display("f")),
    )];
    let env = [("CALIBAN_SANDBOX_NO_LANDLOCK", "1")];
    let (out, results) = print_run(&ws, calls, &[], &env);
    let sandbox = &init_frame(&out)["sandbox"];
    assert_eq!(sandbox["mode"], "workspace-write");
    assert_eq!(sandbox["enforced"], false);
    assert_eq!(sandbox["commands"], "unconfined");
    assert!(
        sandbox["why"]
            .as_str()
            .unwrap()
            .contains("CALIBAN_SANDBOX_NO_LANDLOCK")
    );
    let warnings: Vec<&str> = out
        .stderr
        .lines()
        .filter(|l| l.contains("commands run UNCONFINED"))
        .collect();
    assert_eq!(warnings.len(), 1, "said once: {}", out.stderr);
    assert!(
        results["out"].ends_with("[exit code: 0]"),
        "{}",
        results["out"]
    );
    assert!(outside.path("f").exists());
}

#[test]
fn without_landlock_a_chosen_sandbox_refuses_commands() {
    let ws = Workspace::new("sbx-refuse");
    let outside = Outside::new("refuse");
    let env = [("CALIBAN_SANDBOX_NO_LANDLOCK", "1")];
    let command = format!("echo x > {}", outside.display("f"));
    // Chosen on the command line, or a default the user's settings refuse to run without.
    ws.write(
        "home/.config/caliban/settings.json",
        r#"{"sandbox": {"unavailable": "refuse"}}"#,
    );
    for args in [&["--sandbox", "workspace-write"][..], &[][..]] {
        let (out, results) = print_run(&ws, vec![bash_call("out", &command)], args, &env);
        assert_eq!(
            init_frame(&out)["sandbox"]["commands"],
            "refused",
            "{args:?}"
        );
        assert!(
            out.stderr.contains("commands are refused"),
            "{}",
            out.stderr
        );
        assert!(
            results["out"].starts_with(
                "Bash: not run: the sandbox (workspace-write) cannot be enforced here: Landlock is \
                 switched off by CALIBAN_SANDBOX_NO_LANDLOCK"
            ),
            "{}",
            results["out"]
        );
        assert!(!outside.path("f").exists());
    }
}

#[test]
fn http_a_refused_command_asks_to_run_outside_the_sandbox() {
    let ws = Workspace::new("sbx-http-retry");
    let outside = Outside::new("http-retry");
    let command = format!("echo x > {}", outside.display("f"));
    let stub = Stub::start(&ws, &script(vec![bash_call("b", &command)]));
    let server = Serve::start(&ws, &stub, &["--allow", "Bash"], &[]);
    let run = start_run(server.addr, json!({"prompt": "go"}));
    let prompt = wait_prompt(server.addr, &run);
    assert_eq!(prompt["tool_use_id"], "b");
    assert_eq!(prompt["input"]["command"], command);
    let why = prompt["input"]["sandbox"].as_str().unwrap_or_default();
    assert!(
        why.starts_with(&format!(
            "retry outside the sandbox (workspace-write): write to {} blocked by the sandbox",
            outside.display("f")
        )),
        "{prompt}"
    );
    assert!(!outside.path("f").exists());
    let resp = post_json(
        server.addr,
        &format!("/runs/{run}/permit"),
        &json!({"tool_use_id": "b", "allow": true}),
    );
    assert_eq!(resp.status, 200, "{resp:?}");
    assert_eq!(wait_terminal(server.addr, &run)["state"], "done");
    let events = all_events(server.addr, &run);
    assert_eq!(tool_end(&events, "b")["is_error"], false, "{events:#?}");
    assert_eq!(std::fs::read_to_string(outside.path("f")).unwrap(), "x\n");
    // The session file says which sandbox the run had.
    let header = session_header(&ws, &run);
    assert_enforced(&header["sandbox"], "workspace-write");
}

/// The session file's header line.
fn session_header(ws: &Workspace, run: &str) -> Value {
    let path = session_file(ws, run);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    serde_json::from_str(text.lines().next().unwrap_or_default()).expect("a JSON header")
}

#[test]
fn http_a_run_may_narrow_the_sandbox_not_widen_it() {
    let ws = Workspace::new("sbx-http-narrow");
    let stub = Stub::start(&ws, &script(vec![bash_call("b", "echo x > inside.txt")]));
    let server = Serve::start(&ws, &stub, &["--allow", "Bash"], &[]);
    let unknown = post_json(
        server.addr,
        "/runs",
        &json!({"prompt": "go", "sandbox": "none"}),
    );
    assert_eq!(unknown.status, 400, "{unknown:?}");
    let run = start_run(server.addr, json!({"prompt": "go", "sandbox": "read-only"}));
    // read-only refuses the write; the prompt to retry outside the sandbox is denied.
    wait_prompt(server.addr, &run);
    post_json(
        server.addr,
        &format!("/runs/{run}/permit"),
        &json!({"tool_use_id": "b", "allow": false, "reason": "no"}),
    );
    wait_terminal(server.addr, &run);
    let events = all_events(server.addr, &run);
    let end = tool_end(&events, "b");
    assert_eq!(end["is_error"], true);
    assert!(
        end["result_text"]
            .as_str()
            .unwrap()
            .ends_with("[not run outside the sandbox: no]"),
        "{end}"
    );
    assert!(!ws.path("inside.txt").exists());
    assert_eq!(session_header(&ws, &run)["sandbox"]["mode"], "read-only");

    // As with permission_mode, asking for more than the server allows has no effect.
    let ws = Workspace::new("sbx-http-wider");
    let stub = Stub::start(&ws, &json!({"turns": [{"text": "hi"}]}));
    let server = Serve::start(&ws, &stub, &[], &[]);
    let wider = start_run(server.addr, json!({"prompt": "go", "sandbox": "off"}));
    wait_terminal(server.addr, &wider);
    assert_eq!(
        session_header(&ws, &wider)["sandbox"]["mode"],
        "workspace-write"
    );
}

#[test]
fn sandbox_check_reports_and_tests_the_machine() {
    let ws = Workspace::new("sbx-check");
    let mut cmd = caliban(&ws);
    cmd.args(["sandbox", "check"]);
    let out = run(cmd, "");
    assert_eq!(out.code, Some(0), "{out:?}");
    for line in [
        "landlock:        ABI ",
        "mode:            workspace-write (enforced)",
        "deny list:       ~/.ssh, ",
        "protected:       .git/, .caliban/",
        "self-test:       ok",
    ] {
        assert!(out.stdout.contains(line), "{line}: {out:?}");
    }
    let mut cmd = caliban(&ws);
    cmd.args(["sandbox", "check"])
        .env("CALIBAN_SANDBOX_NO_LANDLOCK", "1");
    let out = run(cmd, "");
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(
        out.stdout.contains("NOT enforced: commands run unconfined"),
        "{out:?}"
    );
}
