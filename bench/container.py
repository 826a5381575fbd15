#!/usr/bin/env python3
"""Memory of caliban in its container image, the figures deploy/kubernetes sizes from.

    python3 bench/container.py [--image caliban:latest] [--runs 20]

Needs a docker daemon and the image (`docker build -f Containerfile -t caliban .`), and
openssl for the agent's certificate. Runs `caliban stub-model` on the host (from the
release binary the Containerfile copies) and the containers on the host network, as
deploy/kubernetes runs them: read-only root, every capability dropped, state on a volume.

For `http serve`: the server process's RSS (VmRSS, and VmHWM, its peak) and the container's
cgroup memory (what a limit counts: the process plus the page cache of its session files)
idle, after RUNS sequential runs that each call a tool and answer, and with 50 idle
interactive runs open. For `agent serve`: idle with no client, and after one ACP prompt over
TLS (control-plane.py's client). Prints a Markdown table.
"""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BINARY = os.path.join(ROOT, "target/x86_64-unknown-linux-gnu/release/caliban")
SETTLE_S = 1.0


def sh(*args, **kw):
    return subprocess.run(args, check=True, capture_output=True, text=True, **kw).stdout


def stub(script):
    f = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    json.dump(script, f)
    f.close()
    proc = subprocess.Popen([BINARY, "stub-model", "--script", f.name],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    url = proc.stdout.readline().strip().removeprefix("listening on ")
    return proc, url


def container(name, image, args, env, volume=None, mounts=()):
    cmd = ["docker", "run", "-d", "--name", name, "--network", "host", "--read-only",
           "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
           "--tmpfs", "/workspace:uid=65532,gid=65532"]
    if volume:
        cmd += ["-v", f"{volume}:/data"]
    else:
        cmd += ["--tmpfs", "/data:uid=65532,gid=65532"]
    for m in mounts:
        cmd += ["-v", m]
    for k, v in env.items():
        cmd += ["-e", f"{k}={v}"]
    sh(*cmd, image, *args)


def listening(name, marker="listening on "):
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        logs = subprocess.run(["docker", "logs", name], capture_output=True, text=True).stderr
        for line in logs.splitlines():
            if marker in line:
                return line.split(marker, 1)[1].strip()
        time.sleep(0.05)
    sys.exit(f"{name} did not start:\n{logs}")


def memory(name):
    """(VmRSS KiB, VmHWM KiB, cgroup usage KiB, cgroup cache KiB) of a container."""
    time.sleep(SETTLE_S)
    pid = sh("docker", "inspect", "-f", "{{.State.Pid}}", name).strip()
    status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
    kib = lambda key: int(status[key].split()[0])
    cid = sh("docker", "inspect", "-f", "{{.Id}}", name).strip()
    usage = cache = None
    for base in (f"/sys/fs/cgroup/memory/docker/{cid}", f"/sys/fs/cgroup/system.slice/docker-{cid}.scope"):
        if os.path.isdir(base):
            stat = dict(l.split() for l in open(os.path.join(base, "memory.stat")))
            if os.path.exists(os.path.join(base, "memory.usage_in_bytes")):
                usage = int(open(os.path.join(base, "memory.usage_in_bytes")).read())
                cache = int(stat.get("total_cache", stat.get("cache", 0)))
            else:
                usage = int(open(os.path.join(base, "memory.current")).read())
                cache = int(stat.get("file", 0))
    return kib("VmRSS"), kib("VmHWM"), (usage or 0) // 1024, (cache or 0) // 1024


def http(addr, method, path, body=None):
    req = urllib.request.Request(f"http://{addr}{path}", method=method,
                                 data=json.dumps(body).encode() if body else None,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)


def wait_state(addr, run, states):
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        state = http(addr, "GET", f"/runs/{run}/status")["status"]["state"]
        if state in states:
            return state
        time.sleep(0.02)
    sys.exit(f"{run} stuck")


def bench_http(image, runs, rows):
    turns = []
    for i in range(runs):
        turns.append({"tool_calls": [{"name": "Glob", "input": {"pattern": "*"}}]})
        turns.append({"text": f"run {i} done " + "x" * 2000})
    turns += [{"text": "waiting for input"}] * 50
    proc, url = stub({"turns": turns})
    name, volume = f"bench-http-{os.getpid()}", f"bench-http-{os.getpid()}"
    try:
        container(name, image, ["http", "serve", "--addr", "127.0.0.1:0"],
                  {"ANTHROPIC_BASE_URL": url}, volume=volume)
        addr = listening(name).split("://", 1)[1]
        rows.append(("`http serve`, idle", *memory(name)))
        for _ in range(runs):
            run = http(addr, "POST", "/runs", {"prompt": "read it"})["run_id"]
            wait_state(addr, run, ("done", "failed"))
        rows.append((f"`http serve`, after {runs} runs (each a Glob and a 2 KB answer)",
                     *memory(name)))
        for _ in range(50):
            run = http(addr, "POST", "/runs", {"prompt": "wait", "interactive": True})["run_id"]
            wait_state(addr, run, ("awaiting_input",))
        rows.append(("`http serve`, and 50 idle interactive runs open", *memory(name)))
    finally:
        subprocess.run(["docker", "rm", "-f", "-v", name], capture_output=True)
        subprocess.run(["docker", "volume", "rm", "-f", volume], capture_output=True)
        proc.kill()


def bench_agent(image, rows):
    spec = importlib.util.spec_from_file_location(
        "control_plane", os.path.join(ROOT, "deploy/kubernetes/control-plane.py"))
    cp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cp)
    pki = tempfile.mkdtemp()
    os.chmod(pki, 0o755)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    sh("openssl", "req", "-x509", *ec, "-keyout", "ca-key.pem", "-out", "ca.pem", "-days", "1",
       "-subj", "/CN=bench CA", "-addext", "basicConstraints=critical,CA:TRUE", cwd=pki)
    sh("openssl", "req", "-new", *ec, "-keyout", "tls.key", "-out", "a.csr",
       "-subj", "/CN=agent-1.agents.caliban.svc", cwd=pki)
    with open(os.path.join(pki, "ext"), "w") as f:
        f.write("subjectAltName=DNS:*.agents.caliban.svc\n")
    sh("openssl", "x509", "-req", "-in", "a.csr", "-CA", "ca.pem", "-CAkey", "ca-key.pem",
       "-CAcreateserial", "-out", "tls.crt", "-days", "1", "-extfile", "ext", cwd=pki)
    for f in os.listdir(pki):
        os.chmod(os.path.join(pki, f), 0o644)
    proc, url = stub({"turns": [
        {"tool_calls": [{"name": "Glob", "input": {"pattern": "*"}}]},
        {"text": "The answer " + "y" * 4000}]})
    name, token = f"bench-agent-{os.getpid()}", "bench-token-" + "z" * 32
    try:
        container(name, image, ["agent", "serve", "--listen", "127.0.0.1:0", "-C", "/workspace"],
                  {"ANTHROPIC_BASE_URL": url, "CALIBAN_AGENT_TOKEN": token,
                   "CALIBAN_AGENT_TLS_CERT": "/tls/tls.crt", "CALIBAN_AGENT_TLS_KEY": "/tls/tls.key",
                   "CALIBAN_AGENT_SPEC": json.dumps({"drive_protocol": "acp"})},
                  mounts=[f"{pki}:/tls:ro"])
        port = int(listening(name).rsplit(":", 1)[1])
        rows.append(("`agent serve` (ACP), idle, no client", *memory(name)))
        agent = cp.Agent("127.0.0.1", port, "agent-1.agents.caliban.svc",
                         os.path.join(pki, "ca.pem"), token)
        out = sys.stdout
        sys.stdout = open(os.devnull, "w")
        try:
            cp.converse(agent, "answer", "/workspace", True)
        finally:
            sys.stdout = out
        rows.append(("`agent serve`, one client, after a prompt (a Glob, a 4 KB answer)",
                     *memory(name)))
        agent.close()
    finally:
        subprocess.run(["docker", "rm", "-f", "-v", name], capture_output=True)
        proc.kill()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--image", default="caliban:latest")
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    rows = []
    bench_http(args.image, args.runs, rows)
    bench_agent(args.image, rows)
    print("| what | RSS | peak RSS | cgroup memory | of which page cache |")
    print("|---|---:|---:|---:|---:|")
    for what, rss, hwm, usage, cache in rows:
        print(f"| {what} | {rss:,} KiB | {hwm:,} KiB | {usage:,} KiB | {cache:,} KiB |")


if __name__ == "__main__":
    main()
