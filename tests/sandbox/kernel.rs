//! The sandbox's kernel layers, tried from commands as a hostile model would: the seccomp
//! filter (the mount API, syscalls nobody reviewed, namespaces, socket families), the
//! capabilities a command run by root keeps, and the process limit. Each runs as root and,
//! where the kernel treats the two apart, as an ordinary user.

use std::collections::HashMap;
use std::path::Path;

use crate::util::*;

/// The first syscall number the filter has not reviewed (`sys::FIRST_UNREVIEWED_SYSCALL`).
const FIRST_UNREVIEWED: u32 = 470;
/// `sys::NPROC_LIMIT`.
const NPROC_LIMIT: usize = 4096;

/// A python the ordinary user can run too (root's may live under /root).
fn python() -> &'static str {
    if Path::new("/usr/bin/python3").exists() {
        "/usr/bin/python3"
    } else {
        "python3"
    }
}

/// Root (the suite's own user) and, when the suite runs as root, the ordinary user.
fn users() -> Vec<Option<(u32, u32)>> {
    let mut users = vec![None];
    users.extend(ordinary_user().map(Some));
    users
}

fn who(user: Option<(u32, u32)>) -> &'static str {
    match user {
        None if ordinary_user().is_some() => "root",
        None => "the suite's user",
        Some(_) => "an ordinary user",
    }
}

/// A workspace holding `files`, with a `.git` so the mount namespace has work to do (the
/// ordinary user then gets a user namespace, where it holds capabilities of its own).
fn workspace(tag: &str, files: &[(&str, &str)], user: Option<(u32, u32)>) -> Workspace {
    let ws = Workspace::new(tag);
    ws.write(".git/HEAD", "ref: refs/heads/main\n");
    for (name, text) in files {
        ws.write(name, text);
    }
    if let Some(user) = user {
        ws.give_to(user);
    }
    ws
}

/// The print-mode run of `calls` in `mode` as `user`; each call's result text by id.
fn run_calls(
    ws: &Workspace,
    calls: Vec<Call>,
    mode: &str,
    user: Option<(u32, u32)>,
) -> HashMap<String, String> {
    let stub = Stub::start(ws, &calls_then_done(calls));
    let mut cmd = caliban(ws);
    anthropic(&mut cmd, &stub);
    cmd.args(["-p", "go", "--output-format", "stream-json"])
        .args(["--allow", "Bash", "--sandbox", mode]);
    if let Some(user) = user {
        as_user(&mut cmd, user);
    }
    let out = run(cmd, "");
    out.frames()
        .into_iter()
        .filter(|f| f["type"] == "tool_result")
        .map(|f| {
            let text = f["content"][0]["text"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            let id = f["tool_use_id"].as_str().unwrap_or_default().to_owned();
            (id, text)
        })
        .collect()
}

const SYSCALLS_PY: &str = r#"
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def call(name, nr, *args):
    r = libc.syscall(ctypes.c_long(nr), *args)
    print(name, "ok" if r >= 0 else os.strerror(ctypes.get_errno()))
# open_tree_attr(AT_FDCWD, "/", OPEN_TREE_CLONE | AT_RECURSIVE, NULL, 0): a copy of the
# whole mount tree without the sandbox's overmounts.
call("open_tree_attr", 467, ctypes.c_int(-100), b"/", ctypes.c_uint(1 | 0x8000), None, ctypes.c_size_t(0))
call("clone3", 435, None, ctypes.c_size_t(0))
call("unreviewed", int(sys.argv[1]), 0, 0)
call("far", 1000, 0, 0)
"#;

#[test]
fn open_tree_attr_clone3_and_unreviewed_syscalls_are_refused() {
    for user in users() {
        let ws = workspace("sbx-syscalls", &[("syscalls.py", SYSCALLS_PY)], user);
        let command = format!("{} syscalls.py {FIRST_UNREVIEWED}", python());
        let results = run_calls(
            &ws,
            vec![Call::bash("s", &command)],
            "workspace-write",
            user,
        );
        let text = &results["s"];
        for line in [
            "open_tree_attr Operation not permitted",
            // The ENOSYS a kernel without the call gives: glibc falls back to clone.
            "clone3 Function not implemented",
            "unreviewed Function not implemented",
            "far Function not implemented",
        ] {
            assert!(text.contains(line), "{}: {line}: {text}", who(user));
        }
    }
}

#[test]
fn no_namespace_can_be_entered_by_clone_or_unshare() {
    let clone_py = format!(
        r#"
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
for name, flags in [("newuser", 0x10000000), ("newnet", 0x40000000 | 0x20000)]:
    pid = libc.syscall(ctypes.c_long({}), ctypes.c_ulong(flags | 17), 0, 0, 0, 0)
    if pid == 0:
        os._exit(0)
    if pid > 0:
        os.waitpid(pid, 0)
    print(name, "made" if pid > 0 else os.strerror(ctypes.get_errno()))
"#,
        libc::SYS_clone
    );
    for user in users() {
        let ws = workspace("sbx-ns", &[("clone.py", &clone_py)], user);
        let calls = vec![
            Call::bash("clone", &format!("{} clone.py", python())),
            Call::bash("unshare", "unshare -U true; unshare -r -n true"),
        ];
        let results = run_calls(&ws, calls, "workspace-write", user);
        let text = &results["clone"];
        for line in [
            "newuser Operation not permitted",
            "newnet Operation not permitted",
        ] {
            assert!(text.contains(line), "{}: {line}: {text}", who(user));
        }
        let text = &results["unshare"];
        assert_eq!(
            text.matches("unshare failed: Operation not permitted")
                .count(),
            2,
            "{}: {text}",
            who(user)
        );
    }
}

const SOCKETS_PY: &str = r#"
import socket
for name, family, kind in [
    ("netlink", 16, socket.SOCK_RAW),
    ("vsock", 40, socket.SOCK_STREAM),
    ("packet", 17, socket.SOCK_DGRAM),
    ("unix", 1, socket.SOCK_STREAM),
    ("inet", 2, socket.SOCK_STREAM),
    ("inet6", 10, socket.SOCK_DGRAM),
    ("raw", 2, socket.SOCK_RAW),
]:
    try:
        socket.socket(family, kind).close()
        print(name, "ok")
    except OSError as e:
        print(name, e.strerror)
try:
    a, b = socket.socketpair(socket.AF_UNIX)
    print("pair ok")
except OSError as e:
    print("pair", e.strerror)
"#;

#[test]
fn socket_families_are_an_allowlist_in_every_mode() {
    let ws = workspace("sbx-families", &[("sockets.py", SOCKETS_PY)], None);
    for mode in ["read-only", "workspace-write", "network"] {
        let command = format!("{} sockets.py", python());
        let calls = vec![
            Call::bash("s", &command),
            Call::bash("ip", "ip link show lo"),
        ];
        let results = run_calls(&ws, calls, mode, None);
        let text = &results["s"];
        let inet = if mode == "network" {
            "ok"
        } else {
            "Permission denied"
        };
        for line in [
            "netlink Address family not supported by protocol".to_owned(),
            "vsock Address family not supported by protocol".to_owned(),
            "packet Address family not supported by protocol".to_owned(),
            "unix ok".to_owned(),
            "pair ok".to_owned(),
            format!("inet {inet}"),
            format!("inet6 {inet}"),
            "raw Permission denied".to_owned(),
        ] {
            assert!(text.contains(&line), "{mode}: {line}: {text}");
        }
        // The model is told why a command failed so.
        let ip = &results["ip"];
        let note = format!("[sandbox: socket family refused by the sandbox ({mode})");
        assert!(ip.contains(&note), "{mode}: {ip}");
    }
}

const PRIVILEGED_PY: &str = r#"
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
# settimeofday(NULL, {0, 0}): CAP_SYS_TIME, and no clock is moved.
tz = (ctypes.c_int * 2)(0, 0)
r = libc.settimeofday(None, tz)
print("settime", "ok" if r == 0 else os.strerror(ctypes.get_errno()))
"#;

#[test]
fn a_command_of_caliban_run_as_root_holds_no_capability() {
    for user in users() {
        let ws = workspace("sbx-caps", &[("priv.py", PRIVILEGED_PY), ("f", "")], user);
        let mut calls = vec![Call::bash("status", "grep -E '^Cap' /proc/self/status")];
        if user.is_none() {
            // Each would succeed with root's capabilities and changes nothing that matters
            // here (`lo` is up already, the hostname stays the same).
            calls.extend([
                Call::bash("chown", "chown 1:1 f"),
                Call::bash("time", &format!("{} priv.py", python())),
                Call::bash("chattr", "chattr +i f"),
                Call::bash("ip", "ip link set lo up"),
                Call::bash("hostname", "hostname \"$(hostname)\""),
            ]);
        }
        let results = run_calls(&ws, calls, "workspace-write", user);
        // Were chattr let through, the test could not remove the workspace.
        let _ = std::process::Command::new("chattr")
            .args(["-i"])
            .arg(ws.path("f"))
            .status();
        let text = &results["status"];
        for set in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
            assert!(
                text.contains(&format!("{set}:\t0000000000000000")),
                "{}: {set}: {text}",
                who(user)
            );
        }
        if user.is_some() {
            continue;
        }
        for (id, refusal) in [
            ("chown", "Operation not permitted"),
            ("time", "settime Operation not permitted"),
            ("chattr", "Operation not permitted"),
            ("ip", "Address family not supported"),
            ("hostname", "must be root to change the host name"),
        ] {
            assert!(results[id].contains(refusal), "{id}: {}", results[id]);
        }
    }
}

/// Starts threads (each counts against RLIMIT_NPROC as a process does, at a fraction of a
/// fork's memory) until the kernel refuses one or the limit plus a margin is passed, then
/// lets them all go: bounded whatever the sandbox does.
const FORK_LOOP_PY: &str = r#"
import sys, threading, time
cap = int(sys.argv[1]) + 64
stop = threading.Event()
threading.stack_size(64 * 1024)
n, deadline = 0, time.time() + 30
try:
    while n < cap and time.time() < deadline:
        threading.Thread(target=stop.wait, daemon=True).start()
        n += 1
except RuntimeError as e:
    print("refused:", e)
stop.set()
print("started", n)
"#;

/// What `caliban sandbox check` prints, as `user`.
fn check_output(user: Option<(u32, u32)>, args: &[&str]) -> Output {
    let ws = workspace("sbx-check-kernel", &[], user);
    let mut cmd = caliban(&ws);
    cmd.args(["sandbox", "check"]).args(args);
    if let Some(user) = user {
        as_user(&mut cmd, user);
    }
    run(cmd, "")
}

/// Whether root's commands get a pids cgroup here (cgroup v1's pids hierarchy, or v2
/// handing pids down, writable): where not, root has no process limit at all.
fn root_has_pids_cgroup() -> bool {
    ordinary_user().is_some()
        && check_output(None, &[])
            .stdout
            .contains("processes:       a pids cgroup of")
}

#[test]
fn the_process_limit_stops_a_fork_loop() {
    // The ordinary user's is RLIMIT_NPROC, which the kernel never applies to root; root's
    // is a pids cgroup, where caliban can make one.
    let mut users = vec![ordinary_user()];
    if root_has_pids_cgroup() {
        users.push(None);
    }
    for user in users {
        let ws = workspace("sbx-nproc", &[("loop.py", FORK_LOOP_PY)], user);
        let calls = vec![
            Call::bash("ulimit", "ulimit -u; ulimit -Hu"),
            Call::bash("loop", &format!("{} loop.py {NPROC_LIMIT}", python())),
        ];
        let results = run_calls(&ws, calls, "workspace-write", user);
        let text = &results["loop"];
        assert!(text.contains("refused:"), "{}: {text}", who(user));
        let started: usize = text
            .lines()
            .find_map(|l| l.strip_prefix("started "))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or_else(|| panic!("{text}"));
        assert!(started < NPROC_LIMIT, "{}: {started}: {text}", who(user));
        let limit = format!("{NPROC_LIMIT}\n{NPROC_LIMIT}\n");
        assert!(
            results["ulimit"].starts_with(&limit),
            "{}",
            results["ulimit"]
        );
    }
}

#[test]
fn sandbox_check_names_and_tests_every_kernel_layer() {
    for user in users() {
        let out = check_output(user, &[]);
        assert_eq!(out.code, Some(0), "{}: {out:?}", who(user));
        let processes = match (user, ordinary_user()) {
            (None, Some(_)) if out.stdout.contains("processes:       a pids cgroup of") => {
                format!("processes:       a pids cgroup of {NPROC_LIMIT} per command")
            }
            (None, Some(_)) => "processes:       no process limit: caliban runs as root".to_owned(),
            _ => format!("processes:       RLIMIT_NPROC {NPROC_LIMIT}"),
        };
        for line in [
            format!("seccomp:         syscalls from {FIRST_UNREVIEWED} up (not yet reviewed)"),
            "open_tree_attr too".to_owned(),
            "clone with namespace flags".to_owned(),
            "sockets:         AF_UNIX in workspace-write; any other family refused".to_owned(),
            "capabilities:    all dropped".to_owned(),
            processes,
            "a confined probe had CapEff 0, ".to_owned(),
            format!("syscall {FIRST_UNREVIEWED} ENOSYS, netlink and vsock refused"),
            "clone(CLONE_NEWUSER) refused".to_owned(),
        ] {
            assert!(out.stdout.contains(&line), "{}: {line}: {out:?}", who(user));
        }
        if user.is_none() && ordinary_user().is_some() {
            assert!(out.stdout.contains("CapBnd 0,"), "{out:?}");
        }
    }
    let out = check_output(None, &["--sandbox", "network"]);
    assert!(
        out.stdout.contains(
            "sockets:         AF_UNIX, AF_INET, AF_INET6 (stream and datagram) in network"
        ),
        "{out:?}"
    );
}
