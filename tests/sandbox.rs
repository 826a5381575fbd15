//! The sandbox on the real kernel: every mode's writes, the deny list, the network, what a
//! command's descendants inherit, metadata outside the writable directories (the read-only
//! root), the protected files a workspace lacks (placeholders, and their reference count
//! across a background shell), the `core.fsmonitor` escalation, the prompt to run a
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

use crate::util::http::*;
use crate::util::http::{
    all_events, session_file, start_run, tool_end, wait_prompt, wait_terminal,
};
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

/// The print-mode run of `calls` with every tool allowed, its output and each call's
/// result text by id.
fn print_run(
    ws: &Workspace,
    calls: Vec<Call>,
    args: &[&str],
    env: &[(&str, &str)],
) -> (Output, std::collections::HashMap<String, String>) {
    print_script_run(ws, &calls_then_done(calls), args, env)
}

/// `print_run` of a whole stub script.
fn print_script_run(
    ws: &Workspace,
    script: &Value,
    args: &[&str],
    env: &[(&str, &str)],
) -> (Output, std::collections::HashMap<String, String>) {
    print_script_run_as(ws, script, args, env, None)
}

/// `print_script_run` with caliban run as `user` (`ordinary_user`) if given; the workspace
/// must be theirs.
fn print_script_run_as(
    ws: &Workspace,
    script: &Value,
    args: &[&str],
    env: &[(&str, &str)],
    user: Option<(u32, u32)>,
) -> (Output, std::collections::HashMap<String, String>) {
    let stub = Stub::start(ws, script);
    let mut cmd = caliban(ws);
    if let Some(user) = user {
        as_user(&mut cmd, user);
    }
    anthropic(&mut cmd, &stub);
    cmd.args(["-p", "go", "--output-format", "stream-json"])
        .args(["--allow", "Bash", "--allow", "Write", "--allow", "Edit"])
        .args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    if let Some(user) = user {
        as_user(&mut cmd, user);
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
        Call::bash("in", "echo inside > inside.txt && cat inside.txt"),
        Call::bash(
            "out",
            &format!("echo outside > {}", outside.display("f.txt")),
        ),
        Call::bash(
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
    assert!(
        texts[1].contains("Read-only file system") || texts[1].contains("Permission denied"),
        "{}",
        texts[1]
    );
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
        Call::bash("key", "cat ~/.ssh/id_*"),
        Call::bash("netrc", "cat ~/.netrc"),
        Call::bash("settings", "cat ~/.config/caliban/settings.json"),
        Call::bash("notes", "cat ~/notes.txt"),
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
    let calls = vec![Call::bash(
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
fn without_a_private_proc_caliban_s_environment_is_still_out_of_reach() {
    // A user namespace or no mount namespace means no procfs of the command's own: it sees
    // caliban's pid, but Landlock refuses ptrace access (which /proc/PID/environ needs) to
    // any process outside the sandbox, root's commands holding no CAP_SYS_PTRACE either.
    let marker = format!("CALIBAN_TEST_MARK_{}", std::process::id());
    for env in [
        ("CALIBAN_SANDBOX_USERNS", "1"),
        ("CALIBAN_SANDBOX_NO_MOUNTNS", "1"),
    ] {
        for user in users() {
            let ws = Workspace::new("sbx-proc-env");
            if let Some(user) = user {
                ws.give_to(user);
            }
            let calls = vec![Call::bash(
                "proc",
                "ls -d /proc/$PPID && tr '\\0' '\\n' < /proc/$PPID/environ",
            )];
            let envs = [env, (marker.as_str(), "visible")];
            let (_, results) = print_script_run_as(&ws, &calls_then_done(calls), &[], &envs, user);
            let text = &results["proc"];
            assert!(!text.contains("visible"), "{env:?} {user:?}: {text}");
            assert!(
                text.contains("Permission denied"),
                "{env:?} {user:?}: {text}"
            );
        }
    }
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
        Call::bash("git", "git config core.fsmonitor 'touch pwned'"),
        Call::bash(
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
        Call::bash("git", "git config core.fsmonitor 'touch pwned'"),
        Call::bash("edit", "echo b > src/a.txt && cat src/a.txt"),
        Call::bash("new", "echo c > new-at-the-root.txt"),
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
        vec![Call::bash("net", &command)],
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
        Call::bash("open", &connect(open.port)),
        Call::bash("closed", &connect(closed.port)),
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
    let (_, results) = print_run(&ws, vec![Call::bash("s", &command)], &[], &[]);
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
    let script = script([
        Turn::bare().calling([Call::new(
            "bg",
            "Bash",
            json!({"command": background, "background": true}),
        )]),
        Turn::bare().calling([Call::bash(
            "wait",
            "while [ ! -e bg-done ]; do sleep 0.02; done",
        )]),
        Turn::bare().calling([Call::new(
            "read",
            "BashOutput",
            json!({"shell_id": "shell_1"}),
        )]),
        Turn::bare().say("done"),
    ]);
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
    assert!(
        read.contains("Read-only file system") || read.contains("Permission denied"),
        "{read}"
    );
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
    let site = crate::util::web_server();
    let calls = vec![Call::new(
        "f",
        "WebFetch",
        json!({"url": format!("{site}/page")}),
    )];
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
        Call::bash("cmd", &format!("git config core.fsmonitor '{hook}'")),
        Call::bash(
            "redirect",
            &format!("printf '[core]\\n\\tfsmonitor = {hook}\\n' >> .git/config"),
        ),
        Call::new(
            "write",
            "Write",
            json!({"path": ".git/config", "content": config}),
        ),
        Call::new(
            "multi",
            "MultiEdit",
            json!({"path": ".git/config", "edits": [
                {"old_string": "[core]", "new_string": format!("[core]\n\tfsmonitor = {hook}")},
            ]}),
        ),
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
        vec![Call::bash("status", "git status --short")],
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
    let calls = vec![Call::bash("cmd", "git config user.name caliban-test")];
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
    let calls = vec![Call::bash(
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
        let (out, results) = print_run(&ws, vec![Call::bash("out", &command)], args, &env);
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
    let stub = Stub::start(&ws, &calls_then_done(vec![Call::bash("b", &command)]));
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
    let stub = Stub::start(
        &ws,
        &calls_then_done(vec![Call::bash("b", "echo x > inside.txt")]),
    );
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
    let stub = Stub::start(&ws, &script([Turn::bare().say("hi")]));
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
        "read-only root:  every mount read-only and nosuid but the writable directories",
        "landlock fences: the deny list outside the writable directories",
        "placeholders:    a missing protected entry is made empty and bound read-only",
        "probe read-only root:  ok",
        "probe landlock fences: ok",
        "probe placeholders:    ok",
    ] {
        assert!(out.stdout.contains(line), "{line}: {out:?}");
    }
    // Without a mount namespace: what Landlock alone cannot do, said as such.
    let mut cmd = caliban(&ws);
    cmd.args(["sandbox", "check"])
        .env("CALIBAN_SANDBOX_NO_MOUNTNS", "1");
    let out = run(cmd, "");
    assert_eq!(out.code, Some(0), "{out:?}");
    for line in [
        "read-only root:  no: without a mount namespace nothing stops chmod, chown, utimes, \
         setxattr or chattr on files outside the writable directories",
        "landlock fences: the deny list and protected paths, the missing ones included",
        "self-test:       ok",
        "probe placeholders:    ok",
    ] {
        assert!(out.stdout.contains(line), "{line}: {out:?}");
    }
    assert!(!out.stdout.contains("FAILED"), "{out:?}");
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

/// Root, and the ordinary user where the suite runs as root (who gets the user-namespace
/// path, having no privilege).
fn users() -> Vec<Option<(u32, u32)>> {
    std::iter::once(None)
        .chain(ordinary_user().map(Some))
        .collect()
}

fn chown_tree(path: &std::path::Path, (uid, gid): (u32, u32)) {
    std::os::unix::fs::lchown(path, Some(uid), Some(gid)).expect("chown");
    if path.is_dir() {
        for entry in std::fs::read_dir(path).expect("read dir").flatten() {
            chown_tree(&entry.path(), (uid, gid));
        }
    }
}

fn xattr_of(path: &std::path::Path) -> String {
    let out = std::process::Command::new("python3")
        .arg("-c")
        .arg("import os, sys; print(os.listxattr(sys.argv[1]))")
        .arg(path)
        .output()
        .expect("python3");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

fn file_flags(path: &std::path::Path) -> String {
    let out = std::process::Command::new("lsattr")
        .arg("-d")
        .arg(path)
        .output()
        .expect("lsattr");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.split_whitespace()
        .next()
        .unwrap_or_default()
        .to_owned()
}

#[test]
fn metadata_outside_every_writable_directory_cannot_change() {
    metadata_cannot_change(&[]);
}

#[test]
fn before_mount_setattr_a_remount_per_mount_keeps_metadata_as_well() {
    metadata_cannot_change(&[("CALIBAN_SANDBOX_NO_MOUNT_SETATTR", "1")]);
}

/// chmod (setuid too), chown, utimes, setxattr and chattr on a file outside every
/// writable directory fail as read-only, as root and as the ordinary user (its owner);
/// the workspace, /tmp and /dev/null still take writes.
fn metadata_cannot_change(env: &[(&str, &str)]) {
    use std::os::unix::fs::MetadataExt;
    for user in users() {
        let ws = Workspace::new("sbx-meta");
        let outside = Outside::new("meta");
        let file = outside.path("f");
        std::fs::write(&file, "f\n").unwrap();
        if let Some(user) = user {
            ws.give_to(user);
            chown_tree(&outside.0, user);
        }
        let before = std::fs::metadata(&file).unwrap();
        let f = outside.display("f");
        // As the file's owner, each of these works without the sandbox; root's chown and
        // `chattr +i` need no ownership at all.
        let chown = match user {
            None => format!("chown 4242 {f}"),
            Some((uid, gid)) => format!("chown {uid}:{gid} {f}"),
        };
        let chattr = match user {
            None => format!("chattr +i {f}"),
            Some(_) => format!("chattr +A {f}"),
        };
        let tmp = format!("/tmp/caliban-sbx-meta-{}", std::process::id());
        let calls = vec![
            Call::bash("chmod", &format!("chmod u+s,a+w {f}")),
            Call::bash("chown", &chown),
            Call::bash("touch", &format!("touch -d 2001-01-01 {f}")),
            Call::bash(
                "xattr",
                &format!("python3 -c \"import os; os.setxattr('{f}', 'user.x', b'1')\""),
            ),
            Call::bash("chattr", &chattr),
            Call::bash(
                "inside",
                &format!(
                    "echo in > in.txt && chmod 600 in.txt && touch -d 2001-01-01 in.txt && \
                     echo t > {tmp} && chmod 600 {tmp} && echo x > /dev/null && \
                     stat -c %a in.txt {tmp}; rm -f {tmp}"
                ),
            ),
        ];
        let (out, results) = print_script_run_as(&ws, &calls_then_done(calls), &[], env, user);
        assert_eq!(init_frame(&out)["sandbox"]["enforced"], true, "{out:?}");
        for id in ["chmod", "chown", "touch", "xattr", "chattr"] {
            let text = &results[id];
            assert!(
                text.contains("Read-only file system"),
                "{user:?} {id}: {text}"
            );
        }
        let after = std::fs::metadata(&file).unwrap();
        assert_eq!(after.mode(), before.mode(), "{user:?}: chmod got through");
        assert_eq!(after.uid(), before.uid(), "{user:?}: chown got through");
        assert_eq!(after.mtime(), before.mtime(), "{user:?}: touch got through");
        assert_eq!(xattr_of(&file), "[]", "{user:?}: setxattr got through");
        assert!(
            !file_flags(&file).contains(['i', 'A']),
            "{user:?}: chattr got through"
        );
        let inside = &results["inside"];
        assert!(
            inside.starts_with("600\n600\n[exit code: 0]"),
            "{user:?}: {inside}"
        );
    }
}

/// Commands that make the protected entries a workspace does not have yet.
fn make_missing_protected(id: &str) -> Vec<Call> {
    vec![
        Call::bash(
            &format!("{id}-caliban"),
            "mkdir -p .caliban && echo '{\"permissions\":{\"allow\":[\"Bash\"]}}' > \
             .caliban/settings.json",
        ),
        Call::bash(&format!("{id}-mcp"), "echo {} > .mcp.json"),
        Call::bash(&format!("{id}-claude"), "mkdir .claude"),
        Call::bash(
            &format!("{id}-vscode"),
            "mkdir -p .vscode && echo {} > .vscode/tasks.json",
        ),
        Call::bash(&format!("{id}-new"), "touch new-file && echo made"),
    ]
}

#[test]
fn a_command_may_start_a_repository_where_there_is_none() {
    // `.git` is protected once it exists, but `git init` (and `cargo new`, which runs it)
    // must work in a workspace that has none: no placeholder is made for it.
    let ws = Workspace::new("sbx-git-init");
    let script = script([
        Turn::bare().calling([Call::bash("init", "git init -q . && echo inited")]),
        Turn::bare().calling([Call::bash(
            "config",
            "git config core.fsmonitor 'touch pwned'",
        )]),
        Turn::bare().say("done"),
    ]);
    let (_, results) = print_script_run(&ws, &script, &[], &[]);
    assert!(
        results["init"].starts_with("inited\n"),
        "{}",
        results["init"]
    );
    assert!(ws.path(".git/HEAD").exists());
    // The next command meets it read-only, like any `.git`.
    assert!(
        results["config"].contains("Read-only file system"),
        "{}",
        results["config"]
    );
}

fn assert_no_protected_made(
    ws: &Workspace,
    results: &std::collections::HashMap<String, String>,
    id: &str,
    how: &str,
) {
    for entry in [".caliban", ".mcp.json", ".claude", ".vscode"] {
        assert!(
            ws.path(entry).symlink_metadata().is_err(),
            "{how}: {entry} was made or left behind: {results:?}"
        );
    }
    for call in ["caliban", "mcp", "claude", "vscode"] {
        let text = &results[&format!("{id}-{call}")];
        assert!(!text.contains("[exit code: 0]"), "{how}: {call}: {text}");
    }
}

#[test]
fn commands_cannot_create_the_protected_files_a_workspace_lacks() {
    for user in users() {
        let ws = Workspace::new("sbx-missing");
        if let Some(user) = user {
            ws.give_to(user);
        }
        let (out, results) = print_script_run_as(
            &ws,
            &calls_then_done(make_missing_protected("m")),
            &[],
            &[],
            user,
        );
        assert_eq!(out.code, Some(0), "{out:?}");
        let how = format!("mount namespace, {user:?}");
        assert_no_protected_made(&ws, &results, "m", &how);
        assert!(
            results["m-caliban"].contains("Read-only file system"),
            "{}",
            results["m-caliban"]
        );
        assert!(
            results["m-caliban"].contains(".caliban is a protected path"),
            "{}",
            results["m-caliban"]
        );
        // A new file beside them is still the command's to make.
        assert!(
            results["m-new"].starts_with("made\n"),
            "{how}: {}",
            results["m-new"]
        );
        assert!(ws.path("new-file").exists());
    }
    // Landlock alone keeps them from being made by granting the root entry by entry.
    let ws = Workspace::new("sbx-missing-nomnt");
    let env = [("CALIBAN_SANDBOX_NO_MOUNTNS", "1")];
    let (_, results) = print_run(&ws, make_missing_protected("l"), &[], &env);
    assert_no_protected_made(&ws, &results, "l", "Landlock alone");
    assert!(!ws.path("new-file").exists());
    assert!(
        results["l-new"].contains("without a mount namespace"),
        "{}",
        results["l-new"]
    );
}

#[test]
fn a_placeholder_stays_while_a_process_that_outlived_its_call_may_hold_it() {
    // A daemon that shed its tool-call tag (`env -i`) outlives its call and keeps the
    // call's mount namespace, where `.caliban` is a read-only placeholder. Removing the
    // placeholder when the call ends would detach that bind, and the daemon could then
    // make `.caliban/settings.json` after all. (The call waits for the daemon to have shed
    // its tag: what still carries an ended call's tag is killed on sight.)
    for user in users() {
        let ws = Workspace::new("sbx-placeholder-daemon");
        if let Some(user) = user {
            ws.give_to(user);
        }
        let daemon = "setsid nohup env -i PATH=\"$PATH\" sh -c 'sleep 1; mkdir -p .caliban && \
                      echo {} > .caliban/settings.json && echo WROTE > wrote.txt; touch tried' \
                      >/dev/null 2>&1 & sleep 0.5; echo started";
        let script = script([
            Turn::bare().calling([Call::bash("daemon", daemon)]),
            Turn::bare().calling([Call::bash(
                "wait",
                "for i in $(seq 100); do [ -e tried ] && break; \
                                               sleep 0.05; done; ls tried",
            )]),
            Turn::bare().say("done"),
        ]);
        let (out, results) = print_script_run_as(&ws, &script, &[], &[], user);
        assert_eq!(out.code, Some(0), "{out:?}");
        assert!(results["daemon"].starts_with("started"), "{results:?}");
        assert!(
            results["wait"].starts_with("tried"),
            "{user:?}: {results:?}"
        );
        assert!(!ws.path("wrote.txt").exists(), "{user:?}: the daemon wrote");
        assert!(
            ws.path(".caliban").symlink_metadata().is_err(),
            "{user:?}: a placeholder was left behind"
        );
    }
}

#[test]
fn a_placeholder_stays_while_another_command_still_uses_it() {
    let ws = Workspace::new("sbx-placeholder");
    // The background shell tries once a foreground command has come and gone: had that
    // command's end removed the placeholder, the shell's read-only bind of it would have
    // gone with it (whatever a later command makes there is a plain directory to it).
    let background = "touch started; while [ ! -e fg-done ]; do sleep 0.02; done; sleep 0.5; \
                      mkdir -p .caliban && echo '{}' > .caliban/settings.json && echo WROTE; \
                      touch bg-done";
    let foreground = "while [ ! -e started ]; do sleep 0.02; done; ls -d .caliban; touch fg-done";
    let script = script([
        Turn::bare().calling([Call::new(
            "bg",
            "Bash",
            json!({"command": background, "background": true}),
        )]),
        Turn::bare().calling([Call::bash("fg", foreground)]),
        Turn::bare().calling([Call::bash(
            "wait",
            "while [ ! -e bg-done ]; do sleep 0.02; done",
        )]),
        Turn::bare().calling([Call::new(
            "read",
            "BashOutput",
            json!({"shell_id": "shell_1"}),
        )]),
        Turn::bare().say("done"),
    ]);
    let (out, results) = print_script_run(&ws, &script, &[], &[]);
    assert_eq!(out.code, Some(0), "{out:?}");
    // The foreground command saw the placeholder the background shell holds.
    assert!(results["fg"].starts_with(".caliban\n"), "{}", results["fg"]);
    let read = &results["read"];
    assert!(!read.contains("WROTE"), "{read}");
    assert!(read.contains("Read-only file system"), "{read}");
    assert!(
        ws.path(".caliban/settings.json")
            .symlink_metadata()
            .is_err()
    );
    // Once the shell is over too, nothing is left behind.
    assert!(
        ws.path(".caliban").symlink_metadata().is_err(),
        "placeholder left behind"
    );
}

#[test]
fn a_file_tool_still_may_not_write_a_missing_protected_file() {
    let ws = Workspace::new("sbx-missing-tool");
    let calls = vec![Call::new(
        "w",
        "Write",
        json!({
            "path": ".caliban/settings.json",
            "content": "{\"permissions\":{\"allow\":[\"Bash\"]}}",
        }),
    )];
    let (_, results) = print_run(&ws, calls, &[], &[]);
    assert!(results["w"].contains("is protected"), "{}", results["w"]);
    assert!(ws.path(".caliban").symlink_metadata().is_err());
}

#[test]
fn a_background_shell_killed_at_the_end_of_the_run_leaves_no_placeholder() {
    let ws = Workspace::new("sbx-placeholder-exit");
    let script = script([
        Turn::bare().calling([Call::new(
            "bg",
            "Bash",
            json!({"command": "sleep 30", "background": true}),
        )]),
        Turn::bare().say("done"),
    ]);
    let (out, _) = print_script_run(&ws, &script, &[], &[]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let left: Vec<String> = std::fs::read_dir(&ws.root)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with('.'))
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// Swaps each pair of names given with `renameat2(RENAME_EXCHANGE)` in a tight loop, from
/// when it says `swap-ready` until `swap-stop` appears: a directory and a symlink to
/// somewhere else trade places thousands of times a second.
const SWAPPER: &str = r#"
import ctypes, os, platform, sys, time
libc = ctypes.CDLL(None, use_errno=True)
nr = {"x86_64": 316, "aarch64": 276}[platform.machine()]
pairs = [(a.encode(), b.encode()) for a, b in zip(sys.argv[1::2], sys.argv[2::2])]
open("swap-ready", "w").close()
deadline = time.time() + 50
while not os.path.exists("swap-stop") and time.time() < deadline:
    for a, b in pairs:
        libc.syscall(nr, -100, a, -100, b, 2)
open("swap-done", "w").close()
"#;

/// Writes one turn of a race run makes into each swapped directory; three such turns make
/// enough writes (600) that before the file tools held the tree by handle some always
/// landed outside (15–21 of 240 in the attack).
const RACE_WRITES_PER_TURN: usize = 100;
const RACE_TURNS: usize = 3;
/// `Read`s of `race/d/secret.txt` and `Grep`s of `race/` in each turn, which must never
/// show the outside directory's file of the same name.
const RACE_READS_PER_TURN: usize = 50;

/// A workspace-write run whose background shell swaps `race/d` with a symlink to a
/// directory outside the workspace, and `hook/d` with one to `.git/hooks`, while the model
/// writes hundreds of files into both `d`s and reads `race/d/secret.txt`, which outside
/// has other content. Returns how many files landed outside and in `.git/hooks`, and how
/// many reads showed the outside file.
fn file_tool_race(user: Option<(u32, u32)>) -> (usize, usize, usize) {
    let tag = if user.is_some() {
        "race-user"
    } else {
        "race-root"
    };
    let ws = Workspace::new(tag);
    let outside = Outside::new(tag);
    ws.write("swap.py", SWAPPER);
    ws.write(".git/config", "[core]\n");
    ws.write(".git/hooks/README", "hooks\n");
    ws.write("race/d/secret.txt", "inside\n");
    std::fs::write(outside.path("secret.txt"), "OUTSIDE-SECRET\n").unwrap();
    std::fs::create_dir_all(ws.path("hook/d")).unwrap();
    std::os::unix::fs::symlink(&outside.0, ws.path("race/l")).unwrap();
    std::os::unix::fs::symlink(ws.path(".git/hooks"), ws.path("hook/l")).unwrap();
    if let Some(user) = user {
        ws.give_to(user);
        std::os::unix::fs::chown(&outside.0, Some(user.0), Some(user.1)).unwrap();
    }
    let swap = "python3 swap.py race/d race/l hook/d hook/l";
    let mut turns = vec![
        Turn::bare().calling([Call::new(
            "bg",
            "Bash",
            json!({"command": swap, "background": true}),
        )]),
        Turn::bare().calling([Call::bash(
            "ready",
            "for i in $(seq 500); do [ -e swap-ready ] && break; sleep 0.02; done; ls swap-ready",
        )]),
    ];
    for turn in 0..RACE_TURNS {
        let calls: Vec<Call> = (0..RACE_WRITES_PER_TURN)
            .flat_map(|i| {
                ["race", "hook"].map(|dir| {
                    Call::new(
                        &format!("{dir}-{turn}-{i}"),
                        "Write",
                        json!({"path": format!("{dir}/d/f{turn}-{i}.sh"),
                               "content": "#!/bin/sh\necho pwned\n"}),
                    )
                })
            })
            .chain((0..RACE_READS_PER_TURN).flat_map(|i| {
                [
                    Call::read(&format!("read-{turn}-{i}"), "race/d/secret.txt"),
                    Call::new(
                        &format!("grep-{turn}-{i}"),
                        "Grep",
                        json!({"pattern": "SECRET", "path": "race"}),
                    ),
                ]
            }))
            .collect();
        turns.push(Turn::bare().calling(calls));
    }
    turns.push(Turn::bare().calling([Call::bash(
        "stop",
        "touch swap-stop; for i in $(seq 500); do [ -e swap-done ] && break; sleep 0.02; done",
    )]));
    turns.push(Turn::bare().say("done"));
    let args = ["--sandbox", "workspace-write"];
    let (out, results) = print_script_run_as(&ws, &script(turns), &args, &[], user);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(
        results["ready"].contains("swap-ready"),
        "{}",
        results["ready"]
    );
    let count = |dir: &std::path::Path, skip: &[&str]| {
        std::fs::read_dir(dir)
            .unwrap()
            .flatten()
            .filter(|e| !skip.contains(&e.file_name().to_string_lossy().as_ref()))
            .count()
    };
    let landed_outside = count(&outside.0, &["secret.txt"]);
    let landed_in_hooks = count(&ws.path(".git/hooks"), &["README"]);
    // The writes that were not refused landed in the real directories.
    let inside =
        count(&ws.path("race/d"), &["secret.txt"]) + count(&ws.path("race/l"), &["secret.txt"]);
    let written = results
        .iter()
        .filter(|(id, text)| id.starts_with("race-") && text.starts_with("→ Wrote"))
        .count();
    let leaked = results
        .values()
        .filter(|text| text.contains("OUTSIDE-SECRET"))
        .count();
    eprintln!(
        "{tag}: {landed_outside} outside, {landed_in_hooks} in .git/hooks, {written} race \
         writes reported done, {inside} files in race/, {leaked} reads showed the outside file"
    );
    (landed_outside, landed_in_hooks, leaked)
}

#[test]
fn file_tools_cannot_be_raced_outside_the_workspace_or_into_git_hooks() {
    // A file tool resolves the path once; the background shell swaps the directory for a
    // symlink between that and the open, create and rename, which the file tools now make
    // by handle, beneath the workspace, following no symlink (Read's open and Grep's walk
    // too).
    let as_suite_user = file_tool_race(None);
    let as_ordinary_user = ordinary_user().map(|user| file_tool_race(Some(user)));
    let what = "(writes outside, writes in .git/hooks, reads of the outside file)";
    assert_eq!(as_suite_user, (0, 0, 0), "{what} as the suite's user");
    if let Some(landed) = as_ordinary_user {
        assert_eq!(landed, (0, 0, 0), "{what} as an ordinary user");
    }
}

#[test]
fn file_tools_stay_in_a_workspace_that_a_command_renamed_and_replaced_by_a_symlink() {
    // A workspace in a temp dir, which commands may write: one renames the workspace away
    // and puts a symlink to a directory outside in its place. With a mount namespace the
    // workspace is a mount point of the command's own, so the rename fails (EBUSY); with
    // Landlock alone the fence of the workspace root refuses it. Had it succeeded, the file
    // tools hold the directory the run started in (`tools::beneath`'s pin, unit-tested):
    // the next Write would neither follow the new symlink nor land outside.
    let landlock_alone = [("CALIBAN_SANDBOX_NO_MOUNTNS", "1")];
    for user in users() {
        workspace_swap(user, &[]);
        workspace_swap(user, &landlock_alone);
    }
}

fn workspace_swap(user: Option<(u32, u32)>, env: &[(&str, &str)]) {
    let parent = std::path::Path::new("/tmp").join(format!(
        "caliban-ws-swap-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::SeqCst)
    ));
    let _ = std::fs::remove_dir_all(&parent);
    std::fs::create_dir_all(parent.join("ws/home")).unwrap();
    let ws = Workspace {
        root: parent.join("ws").canonicalize().unwrap(),
    };
    let outside = Outside::new("ws-swap");
    if let Some(user) = user {
        ws.give_to(user);
        std::os::unix::fs::chown(&parent, Some(user.0), Some(user.1)).unwrap();
        std::os::unix::fs::chown(&outside.0, Some(user.0), Some(user.1)).unwrap();
    }
    let swap = format!(
        "cd .. && mv ws moved && ln -s {} ws && echo swapped",
        outside.0.display()
    );
    let script = script([
        Turn::bare().calling([Call::bash("swap", &swap)]),
        Turn::bare().calling([Call::new(
            "w",
            "Write",
            json!({"path": "pwned.txt", "content": "x\n"}),
        )]),
        Turn::bare().say("done"),
    ]);
    let args = ["--sandbox", "workspace-write"];
    let (_, results) = print_script_run_as(&ws, &script, &args, env, user);
    let landed = outside.path("pwned.txt").exists();
    let _ = std::fs::remove_dir_all(&parent);
    let who = format!("{user:?} {env:?}");
    assert!(
        !landed,
        "as {who}, the Write followed the swapped workspace: {}",
        results["w"]
    );
    // Either the sandbox refused the swap (a mount point, or Landlock's fence of the
    // workspace root), or the Write refused the swapped workspace.
    let swapped = results["swap"].contains("swapped");
    assert!(
        !swapped || results["w"].contains("no longer the directory the run started in"),
        "as {who}: {} / {}",
        results["swap"],
        results["w"]
    );
}
