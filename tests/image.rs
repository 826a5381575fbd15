//! The container image (`Containerfile`), first without a container runtime, then with one.
//!
//! Without: the test reads the Containerfile, builds the static release binary it copies
//! (the README's command; a no-op when it is up to date), puts exactly the files its
//! `FROM scratch` stage copies, with their owners, into an empty directory and runs the
//! binary there as the image's user, with the image's environment and working directory
//! (`unshare --root --setuid`, with /proc mounted as a runtime does; this needs root, and the
//! test is skipped with a message without it). There: `--version`, `http serve` answering
//! `/healthz` and keeping a run's session file in the state directory, a print-mode run
//! against the stub model whose file tools work in /workspace and whose `Bash` call fails
//! because the image has no shell. Both run in the default sandbox mode (`workspace-write`,
//! enforced or not as the runtime allows): the file tools' sandbox check lets writes in the
//! workspace through, and a missing shell is reported as such, not as a sandbox failure.
//!
//! With: where `docker info` reaches a daemon, the same image is built with `docker build`
//! from a context holding only what the Containerfile names, and the same checks run in
//! containers on the host network, `http serve` with a read-only root, every capability
//! dropped and its state on a volume, as in deploy/kubernetes. Without a daemon that part
//! is skipped with a message.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use serde_json::{Value, json};

use crate::util::http::{Serve, request};
use crate::util::http::{start_run, wait_terminal};
use crate::util::*;

const CONTAINERFILE: &str = include_str!("../Containerfile");
const DOCKERIGNORE: &str = include_str!("../.dockerignore");
const TARGET: &str = "x86_64-unknown-linux-gnu";
/// The README's release build, which the Containerfile copies the result of.
const RUSTFLAGS: &str = "-C target-feature=+crt-static -C relocation-model=static";
/// `Bash`'s answer where there is no shell (`tools::bash::NO_SHELL`).
const NO_SHELL: &str = "no shell in this image: /bin/bash and /bin/sh not found";

/// One COPY: a source in the build context, its destination in the image, the owner it
/// is given (`--chown=uid:gid`; root without).
#[derive(Debug)]
struct CopyOp {
    src: String,
    dst: String,
    owner: Option<(u32, u32)>,
}

/// What the `FROM scratch` stage says, in the instructions this test understands.
#[derive(Debug, Default)]
struct Image {
    copies: Vec<CopyOp>,
    env: Vec<(String, String)>,
    user: (u32, u32),
    workdir: String,
    entrypoint: Vec<String>,
}

fn ids(text: &str) -> (u32, u32) {
    let (u, g) = text.split_once(':').unwrap_or((text, text));
    let id = |s: &str| {
        s.parse()
            .unwrap_or_else(|_| panic!("Containerfile: `{text}` is not a numeric uid:gid"))
    };
    (id(u), id(g))
}

fn parse(containerfile: &str) -> Image {
    let mut image = Image::default();
    let mut from_scratch = false;
    for line in containerfile.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        assert!(
            !line.ends_with('\\'),
            "continued lines are not understood: {line}"
        );
        let (op, rest) = line.split_once(' ').unwrap_or((line, ""));
        let words: Vec<&str> = rest.split_whitespace().collect();
        match op {
            "FROM" => {
                assert!(!from_scratch, "one stage only: {line}");
                assert_eq!(words, ["scratch"], "the image starts from nothing");
                from_scratch = true;
            }
            "COPY" => {
                let (chown, paths) = match words.as_slice() {
                    [opt, paths @ ..] if opt.starts_with("--chown=") => {
                        (Some(ids(&opt["--chown=".len()..])), paths)
                    }
                    paths => (None, paths),
                };
                let [src, dst] = paths else {
                    panic!("COPY of one source only: {line}");
                };
                image.copies.push(CopyOp {
                    src: src.to_string(),
                    dst: dst.to_string(),
                    owner: chown,
                });
            }
            "ENV" => {
                for pair in words {
                    let (k, v) = pair.split_once('=').expect("ENV key=value");
                    image.env.push((k.to_owned(), v.to_owned()));
                }
            }
            "USER" => image.user = ids(rest),
            "WORKDIR" => image.workdir = rest.to_owned(),
            "ENTRYPOINT" => {
                image.entrypoint = serde_json::from_str(rest).expect("ENTRYPOINT as a JSON array")
            }
            "EXPOSE" | "CMD" | "LABEL" => {}
            other => panic!(
                "Containerfile instruction {other} is not understood by tests/image.rs; \
                 teach it, so this test still assembles exactly what the image holds"
            ),
        }
    }
    assert!(from_scratch, "no FROM");
    assert!(image.user.0 != 0, "the image runs as root");
    image
}

/// Builds the static release binary with the README's command (cargo makes this a no-op
/// when it is up to date; `.ci/run` builds it before the tests). Once per test process.
fn release_binary() -> &'static Path {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.args(["build", "--release", "--target", TARGET])
            .current_dir(root)
            .env("RUSTFLAGS", RUSTFLAGS);
        // What cargo set for this test (CARGO_MANIFEST_DIR, CARGO_PKG_*, …) would count as a
        // changed environment for build scripts that watch it, and rebuild everything.
        for (key, _) in std::env::vars_os() {
            let key = key.to_string_lossy();
            if key.starts_with("CARGO_") && key != "CARGO_HOME" {
                cmd.env_remove(&*key);
            }
        }
        let out = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run cargo build");
        // An LTO build from nothing takes minutes on a small machine.
        let out = wait_output(out, Duration::from_secs(1500));
        assert_eq!(out.code, Some(0), "release build failed: {out:?}");
        root.join(format!("target/{TARGET}/release/caliban"))
    })
}

/// The build context's path for a COPY source: the release binary is where the README's
/// build puts it; everything else is in the repository.
fn context_path(src: &str) -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    if src == format!("target/{TARGET}/release/caliban") {
        return release_binary().to_path_buf();
    }
    assert!(!src.starts_with("target/"), "COPY from target/: {src}");
    root.join(src)
}

/// Files `.dockerignore` keeps out of the image: only the `.keep` markers that hold empty
/// directories in git (the test checks the ignore file says so).
fn ignored(name: &std::ffi::OsStr) -> bool {
    name == ".keep"
}

fn chown(path: &Path, owner: Option<(u32, u32)>) {
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::chown(path, Some(uid), Some(gid)).expect("chown");
    }
}

/// Copies `from` (a file, or a directory's contents) to `to`, an absolute path in the image
/// rooted at `root`, as COPY does: missing parents made as root, what is copied owned by
/// `owner`.
fn copy_in(root: &Path, from: &Path, to: &str, owner: Option<(u32, u32)>) {
    let dst = root.join(to.trim_start_matches('/'));
    if from.is_dir() {
        std::fs::create_dir_all(&dst).expect("mkdir");
        for entry in std::fs::read_dir(from).expect("read_dir").flatten() {
            let name = entry.file_name();
            if ignored(&name) {
                continue;
            }
            let to = Path::new(to).join(&name).display().to_string();
            if entry.path().is_dir() {
                // Made here, not in the call below, which also serves the COPY's own
                // destination: COPY gives `owner` what it copies, not a directory it finds.
                let dir = root.join(to.trim_start_matches('/'));
                std::fs::create_dir_all(&dir).expect("mkdir");
                chown(&dir, owner);
            }
            copy_in(root, &entry.path(), &to, owner);
        }
    } else {
        std::fs::create_dir_all(dst.parent().expect("parent")).expect("mkdir");
        // By `cp`, not std::fs::copy: a child another test thread forks while our copy's
        // write fd is open would hold it, and exec of the copy would fail (ETXTBSY).
        let out = Command::new("cp")
            .arg("--preserve=mode")
            .arg(from)
            .arg(&dst)
            .output()
            .expect("cp");
        assert!(out.status.success(), "cp {}: {out:?}", from.display());
        chown(&dst, owner);
    }
}

/// Every path under `root`, relative, with its owner, for the record.
fn listing(root: &Path) -> Vec<String> {
    use std::os::unix::fs::MetadataExt;
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("read_dir").flatten() {
            let meta = entry.metadata().expect("metadata");
            let rel = entry
                .path()
                .strip_prefix(root)
                .unwrap()
                .display()
                .to_string();
            out.push(format!("/{rel} {}:{}", meta.uid(), meta.gid()));
            if meta.is_dir() {
                stack.push(entry.path());
            }
        }
    }
    out.sort();
    out
}

/// The image's root, assembled in `ws/root`, plus what a runtime adds: /proc.
fn assemble(ws: &Workspace, image: &Image) -> PathBuf {
    assert!(
        DOCKERIGNORE.lines().any(|l| l.trim() == "**/.keep"),
        ".dockerignore must keep the .keep markers out, as this test does"
    );
    let root = ws.path("root");
    std::fs::create_dir_all(&root).expect("mkdir root");
    for CopyOp { src, dst, owner } in &image.copies {
        assert!(
            !dst.ends_with('/') || src.ends_with('/'),
            "COPY of a file names its destination in full: {src} {dst}"
        );
        copy_in(&root, &context_path(src.trim_end_matches('/')), dst, *owner);
    }
    let files = listing(&root);
    assert_eq!(
        files,
        [
            "/data 65532:65532",
            "/usr 0:0",
            "/usr/local 0:0",
            "/usr/local/bin 0:0",
            "/usr/local/bin/caliban 0:0",
            "/workspace 65532:65532",
        ],
        "the image holds what README says it holds"
    );
    std::fs::create_dir(root.join("proc")).expect("mkdir proc");
    root
}

/// Says a test skipped, and why, where `cargo test` shows it: straight to stderr, past the
/// capture that hides a passing test's `println!`.
fn skipped(test: &str, reason: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {reason}");
}

fn is_root() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().nth(1))
        == Some("0")
}

/// `unshare` on this process's PATH: the command's own PATH is the image's.
fn unshare() -> PathBuf {
    std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .map(|dir| dir.join("unshare"))
        .find(|p| p.is_file())
        .expect("unshare (util-linux) is needed to run the image's files")
}

/// `caliban ARGS` run in the assembled root as the image runs it.
fn in_root(root: &Path, image: &Image, args: &[&str]) -> Command {
    let mut cmd = Command::new(unshare());
    cmd.arg("--mount-proc=/proc")
        .arg(format!("--root={}", root.display()))
        .arg(format!("--wd={}", image.workdir))
        .arg(format!("--setgid={}", image.user.1))
        .arg(format!("--setuid={}", image.user.0))
        .arg("--")
        .args(&image.entrypoint)
        .args(args)
        .env_clear()
        .envs(image.env.iter().map(|(k, v)| (k, v)));
    cmd
}

/// The stub's script for the print-mode run: Write in /workspace, then a Bash call, then
/// the answer.
fn print_script() -> Value {
    script([
        Turn::bare().calling([Call::new(
            "toolu_w",
            "Write",
            json!({"path": "notes.txt", "content": "written in the image\n"}),
        )]),
        Turn::bare().calling([Call::bash("toolu_b", "echo hi")]),
        Turn::bare().say("No shell here."),
    ])
}

/// The print-mode run's arguments, for `print_script`.
const PRINT_ARGS: &[&str] = &[
    "-p",
    "write a note, then run a command",
    "--output-format",
    "stream-json",
    "--allow",
    "Bash",
    "--allow",
    "Write",
];

/// The print-mode run's frames: the write worked, Bash said there is no shell.
fn check_print_run(out: &Output) {
    assert_eq!(out.code, Some(0), "{out:?}");
    let frames = out.frames();
    let init = frames
        .iter()
        .find(|f| f["type"] == "system" && f["subtype"] == "init")
        .unwrap_or_else(|| panic!("no init frame: {out:?}"));
    assert_eq!(init["sandbox"]["mode"], "workspace-write", "{init}");
    let result = |id: &str| {
        frames
            .iter()
            .find(|f| f["type"] == "tool_result" && f["tool_use_id"] == id)
            .unwrap_or_else(|| panic!("no tool_result for {id}: {out:?}"))
            .clone()
    };
    assert_ne!(result("toolu_w")["is_error"], true, "{out:?}");
    let bash = result("toolu_b");
    assert_eq!(bash["is_error"], true, "{out:?}");
    assert!(bash.to_string().contains(NO_SHELL), "{bash}");
    assert_eq!(out.result()["result"], "No shell here.", "{out:?}");
}

/// A run through `http serve`: `/healthz`, then a run that leaves a session file.
fn check_http_serve(server: &Serve) {
    let health = request(server.addr, "GET", "/healthz", &[], b"");
    assert_eq!(health.status, 200, "{health:?}");
    assert_eq!(health.json()["status"], "ok");
    let run = start_run(server.addr, json!({"prompt": "hello from the image"}));
    let status = wait_terminal(server.addr, &run);
    assert_eq!(status, json!({"state": "done"}), "{}", server.stderr());
}

#[test]
fn the_scratch_image_runs_from_exactly_what_the_containerfile_copies() {
    let image = parse(CONTAINERFILE);
    if !is_root() {
        skipped(
            "the_scratch_image_runs_from_exactly_what_the_containerfile_copies",
            "running the image's files under unshare --root needs root",
        );
        return;
    }
    let ws = Workspace::new("image-root");
    let root = assemble(&ws, &image);

    let out = run(in_root(&root, &image, &["--version"]), "");
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(out.stdout.starts_with("caliban "), "{out:?}");

    // Print mode against the stub (on the host's loopback: no network namespace here).
    let stub = Stub::start(&ws, &print_script());
    let mut cmd = in_root(&root, &image, PRINT_ARGS);
    anthropic(&mut cmd, &stub);
    check_print_run(&run(cmd, ""));
    assert_eq!(
        std::fs::read_to_string(root.join("workspace/notes.txt")).expect("the note"),
        "written in the image\n"
    );

    // http serve: /healthz, and a run whose session file lands in the state directory.
    let stub = Stub::start(&ws, &script([Turn::bare().say("served from the image")]));
    let mut cmd = in_root(&root, &image, &["http", "serve", "--addr", "127.0.0.1:0"]);
    anthropic(&mut cmd, &stub);
    let server = Serve::spawn(cmd);
    check_http_serve(&server);
    let state = image
        .env
        .iter()
        .find(|(k, _)| k == "XDG_STATE_HOME")
        .map(|(_, v)| v.trim_start_matches('/'))
        .expect("XDG_STATE_HOME in the image");
    let session = root.join(state).join("caliban/sessions/run-1.jsonl");
    assert!(session.is_file(), "no session file {}", session.display());
}

// ---- in a real container runtime ----------------------------------------------------------

/// `docker rm -f` of a container name on drop, so a failed assertion leaves nothing running.
struct Container(String);

impl Drop for Container {
    fn drop(&mut self) {
        let _ = Command::new("docker")
            .args(["rm", "-f", "-v", &self.0])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

fn docker(args: &[&str]) -> Output {
    output_within(
        Command::new("docker")
            .args(args)
            // The classic builder: a daemon without BuildKit's client plugin builds with it.
            .env("DOCKER_BUILDKIT", "0"),
        "run docker",
        Duration::from_secs(300),
    )
}

/// A reason to skip, or nothing when a daemon answers.
fn no_daemon() -> Option<String> {
    let child = Command::new("docker")
        .args(["info", "--format", "{{.ServerVersion}}"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let Ok(child) = child else {
        return Some("no docker command".into());
    };
    let out = wait_output(child, Duration::from_secs(30));
    (out.code != Some(0)).then(|| format!("no docker daemon answers: {}", out.stderr.trim()))
}

#[test]
fn the_image_built_by_docker_passes_the_same_checks() {
    let image = parse(CONTAINERFILE);
    if let Some(reason) = no_daemon() {
        skipped("the_image_built_by_docker_passes_the_same_checks", &reason);
        return;
    }
    let ws = Workspace::new("image-docker");
    // The context holds only what the Containerfile copies, at the paths it names.
    let context = ws.path("context");
    for CopyOp { src, .. } in &image.copies {
        let to = context.join(src.trim_end_matches('/'));
        std::fs::create_dir_all(to.parent().unwrap()).expect("mkdir");
        let out = Command::new("cp")
            .arg("-a")
            .arg(context_path(src.trim_end_matches('/')))
            .arg(&to)
            .output()
            .expect("cp");
        assert!(out.status.success(), "cp {src}: {out:?}");
    }
    std::fs::write(context.join("Containerfile"), CONTAINERFILE).expect("Containerfile");
    std::fs::write(context.join(".dockerignore"), DOCKERIGNORE).expect(".dockerignore");
    let tag = format!("caliban-test-image:{}", std::process::id());
    let ctx = context.display().to_string();
    let out = docker(&["build", "-q", "-f", "Containerfile", "-t", &tag, &ctx]);
    assert_eq!(out.code, Some(0), "docker build: {out:?}");
    struct Untag(String);
    impl Drop for Untag {
        fn drop(&mut self) {
            let _ = docker(&["rmi", "-f", &self.0]);
        }
    }
    let _untag = Untag(tag.clone());

    // What the image holds, as the runtime sees it.
    let name = format!("caliban-test-{}", std::process::id());
    let created = docker(&["create", "--name", &name, &tag]);
    assert_eq!(created.code, Some(0), "{created:?}");
    let guard = Container(name.clone());
    let export = Command::new("sh")
        .arg("-c")
        .arg(format!("docker export {name} | tar -tv"))
        .output()
        .expect("docker export");
    let listing = String::from_utf8_lossy(&export.stdout).into_owned();
    for path in ["usr/local/bin/caliban", "data/", "workspace/"] {
        assert!(listing.contains(path), "{path} missing: {listing}");
    }
    assert!(!listing.contains(".keep"), "{listing}");
    assert!(!listing.contains("bin/sh"), "{listing}");
    drop(guard);

    let out = docker(&["run", "--rm", "--network", "none", &tag, "--version"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(out.stdout.starts_with("caliban "), "{out:?}");

    // Print mode on the host network, against the stub on the host's loopback.
    let stub = Stub::start(&ws, &print_script());
    let name = format!("caliban-test-print-{}", std::process::id());
    let _guard = Container(name.clone());
    let base_url = base_url_of(&stub);
    let mut args = vec![
        "run",
        "--rm",
        "--name",
        &name,
        "--network",
        "host",
        "-e",
        &base_url,
        &tag,
    ];
    args.extend(PRINT_ARGS);
    let out = docker(&args);
    check_print_run(&out);

    // http serve as deploy/kubernetes runs it: read-only root, no capabilities, no new
    // privileges, the state directory on a volume (which starts as the image's /data).
    let stub = Stub::start(&ws, &script([Turn::bare().say("served from docker")]));
    let name = format!("caliban-test-serve-{}", std::process::id());
    let volume = format!("caliban-test-data-{}", std::process::id());
    let _guard = Container(name.clone());
    struct Volume(String);
    impl Drop for Volume {
        fn drop(&mut self) {
            let _ = docker(&["volume", "rm", "-f", &self.0]);
        }
    }
    let _volume = Volume(volume.clone());
    let serve = |name: &str| {
        let mut cmd = Command::new("docker");
        cmd.args(["run", "--rm", "--name", name, "--network", "host"])
            .args(["--read-only", "--cap-drop", "ALL"])
            .args(["--security-opt", "no-new-privileges"])
            .args(["-v", &format!("{volume}:/data")])
            .args(["--tmpfs", "/workspace:uid=65532,gid=65532"])
            .args(["-e", &base_url_of(&stub)])
            .args([&tag, "http", "serve", "--addr", "127.0.0.1:0"]);
        Serve::spawn(cmd)
    };
    let server = serve(&name);
    check_http_serve(&server);
    // A new container on the same volume lists the run the first one finished, as a pod
    // restarted on its claim does.
    drop(server);
    drop(_guard);
    let name = format!("caliban-test-serve2-{}", std::process::id());
    let _guard = Container(name.clone());
    let server = serve(&name);
    let runs = request(server.addr, "GET", "/runs", &[], b"");
    assert_eq!(runs.status, 200, "{runs:?}");
    let listed = runs.json()["runs"].to_string();
    assert!(
        listed.contains("run-1") && listed.contains("done"),
        "{listed}"
    );
}

fn base_url_of(stub: &Stub) -> String {
    format!("ANTHROPIC_BASE_URL={}", stub.url)
}
