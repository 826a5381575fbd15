//! deploy/kubernetes, checked offline: the kustomization rendered (by a subset of kustomize
//! in tests/k8s_check.py, and by `kubectl kustomize` too where kubectl is installed), every
//! object validated against the Kubernetes OpenAPI schemas that kubernetes-validate ships,
//! and the invariants the manifests promise (probes, non-root, read-only root, no token in
//! plain text). The control plane runs for real against a stand-in kubectl
//! (tests/fake_kubectl.py) and a real `caliban agent serve` started from what it applied:
//! its Secret's token, its ConfigMap's spawn spec, TLS checked against the agents' name.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::util::agent::{Agent, pki_for};
use crate::util::*;

/// The venv's python with the validator (`tests/requirements-kubernetes.txt`).
fn python() -> &'static Path {
    static PYTHON: OnceLock<PathBuf> = OnceLock::new();
    PYTHON.get_or_init(|| venv_python("kubernetes-venv", "requirements-kubernetes.txt"))
}

fn repo(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

/// Runs tests/k8s_check.py; panics with its output unless it says `ok:`.
fn check(args: &[&str]) -> String {
    let out = output_within(
        Command::new(python())
            .arg(repo("tests/k8s_check.py"))
            .args(args),
        "run k8s_check.py",
        Duration::from_secs(120),
    );
    assert!(
        out.code == Some(0) && out.stdout.starts_with("ok:"),
        "k8s_check.py {args:?}: {out:?}"
    );
    out.stdout
}

/// `kubectl`, if one is installed that renders a kustomization here (offline).
fn kubectl() -> Option<&'static str> {
    let probe = Command::new("kubectl")
        .args(["version", "--client"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .ok()?;
    let out = wait_output(probe, Duration::from_secs(60));
    (out.code == Some(0)).then_some("kubectl")
}

#[test]
fn the_kustomization_renders_validates_and_keeps_its_invariants() {
    let dir = path_str(&repo("deploy/kubernetes"));
    let mut args = vec!["kustomization", dir.as_str()];
    match kubectl() {
        Some(kubectl) => args.extend(["--kubectl", kubectl]),
        None => {
            // Straight to stderr, past the test harness's capture, so it is seen.
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "note: no kubectl here; the kustomization is rendered by \
                 tests/k8s_check.py's subset of kustomize alone"
            );
        }
    }
    let said = check(&args);
    println!("{said}");
}

/// Polls `dir` for the applied object of `kind` (the control plane applies JSON for its
/// Secret and ConfigMap).
fn applied(dir: &Path, kind: &str, deadline: Instant) -> Value {
    loop {
        for entry in std::fs::read_dir(dir)
            .expect("read fake kubectl dir")
            .flatten()
        {
            let name = entry.file_name().to_string_lossy().into_owned();
            if !name.starts_with("applied-") {
                continue;
            }
            let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
            if let Ok(obj) = serde_json::from_str::<Value>(&text)
                && obj["kind"] == kind
            {
                return obj;
            }
        }
        assert!(
            Instant::now() < deadline,
            "the control plane applied no {kind}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn the_control_plane_creates_an_agent_connects_over_tls_and_streams_a_prompt() {
    let ws = Workspace::new("control-plane");
    // The agents' certificate names them all, as the README's wildcard certificate does.
    let pki = pki_for(&ws, "DNS:*.agents.caliban.svc");
    let stub = Stub::start(
        &ws,
        &script([
            Turn::bare()
                .say("Let me look.")
                .calling([Call::read("toolu_1", "answer.txt")]),
            Turn::bare().say("The answer is 42."),
        ]),
    );
    ws.write("answer.txt", "42\n");
    let fake = ws.path("kubectl");
    std::fs::create_dir_all(&fake).expect("mkdir");

    let mut plane = Command::new("python3");
    plane
        .arg(repo("deploy/kubernetes/control-plane.py"))
        .args(["run", "agent-7", "What is the answer?", "--ca"])
        .arg(&pki.ca)
        .arg("--cwd")
        .arg(&ws.root)
        .args(["--image", "registry.example/caliban:0.1.0", "--delete"])
        .env("KUBECTL", repo("tests/fake_kubectl.py"))
        .env("FAKE_KUBECTL_DIR", &fake)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let plane = plane.spawn().expect("run control-plane.py");

    // The agent the Job would run, from what the control plane put in its Secret and
    // ConfigMap.
    let deadline = Instant::now() + Duration::from_secs(60);
    let secret = applied(&fake, "Secret", deadline);
    let config = applied(&fake, "ConfigMap", deadline);
    let token = secret["stringData"]["token"].as_str().expect("token");
    assert!(token.len() >= 32, "a short token: {token}");
    let spec = config["data"]["spec.json"].as_str().expect("spec.json");
    ws.write("spec.json", spec);
    let spec_path = path_str(&ws.path("spec.json"));
    let cert = path_str(&pki.cert);
    let key = path_str(&pki.key);
    let agent = Agent::start(
        &ws,
        &stub,
        &[
            "--listen",
            "127.0.0.1:0",
            "--spec",
            &spec_path,
            "-C",
            &path_str(&ws.root),
        ],
        &[
            ("CALIBAN_AGENT_TOKEN", token),
            ("CALIBAN_AGENT_TLS_CERT", &cert),
            ("CALIBAN_AGENT_TLS_KEY", &key),
        ],
    );
    std::fs::write(fake.join("port.tmp"), agent.addr().port().to_string()).expect("port");
    std::fs::rename(fake.join("port.tmp"), fake.join("port")).expect("rename port");

    let out = wait_output(plane, Duration::from_secs(120));
    assert_eq!(out.code, Some(0), "{out:?}\nagent:\n{}", agent.stderr());
    for said in [
        "[created] job/agent-7 in caliban",
        "[ready] pod/agent-7-x7k2p",
        "Let me look.",
        "[tool] Read",
        "The answer is 42.",
        "[done] stopReason=end_turn",
    ] {
        assert!(out.stdout.contains(said), "no {said:?} in {out:?}");
    }
    // The token went to kubectl on stdin only, never on a command line.
    let calls = std::fs::read_to_string(fake.join("calls.jsonl")).expect("calls");
    let argv: Vec<Value> = calls
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).expect("call")["args"].clone())
        .collect();
    assert!(!Value::Array(argv.clone()).to_string().contains(token));
    assert!(argv.iter().any(|a| a[0] == "delete"), "{calls}");

    // What it applied is valid Kubernetes and keeps the invariants.
    let mut docs = Vec::new();
    let mut files: Vec<_> = std::fs::read_dir(&fake)
        .expect("read")
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("applied-")
        })
        .collect();
    files.sort();
    for file in &files {
        docs.push(std::fs::read_to_string(file).expect("applied"));
    }
    assert_eq!(docs.len(), 3, "a Secret, a ConfigMap and a Job");
    let all = docs.join("\n---\n");
    assert!(
        all.contains("image: registry.example/caliban:0.1.0"),
        "{all}"
    );
    ws.write("applied.yaml", &all);
    check(&["manifests", &path_str(&ws.path("applied.yaml"))]);
}
