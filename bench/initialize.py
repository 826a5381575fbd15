#!/usr/bin/env python3
"""Spawn-to-`initialize`-reply time of `caliban acp serve` / `caliban mcp serve`, as an
editor or an orchestrating agent sees it.

Each round spawns the binary with pipes, writes one `initialize` request, and stops the clock
when the whole reply line has been read; then it reads the idle RSS, closes stdin and times the
exit. Spawning `true` the same way is the floor any process pays on this machine, and a
`/bin/sh` that answers with a fixed line the floor for the whole exchange (time and RSS).
Medians and 90th percentiles over the rounds.

    python3 bench/initialize.py [BINARY] [--surface acp|mcp] [--rounds N] [--state XDG_STATE_HOME]

RSS is VmRSS right after the reply, as for the peers; the anonymous part (heap, stack,
written data: RssAnon) is printed beside it, the rest being pages of the binary itself,
shared by every process that runs it. What CI holds is private memory and the PSS of many
agents (bench/footprint.py), not RSS.

BINARY defaults to the static release build (target/x86_64-unknown-linux-gnu/release/caliban)
or else target/release/caliban. The environment is empty apart from a throwaway state
directory and a model URL that is never contacted (initialize starts no run).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

INITIALIZE = {
    "acp": {"protocolVersion": 1, "clientCapabilities": {}},
    "mcp": {
        "protocolVersion": "2025-11-25",
        "capabilities": {},
        "clientInfo": {"name": "bench", "version": "0"},
    },
}


def initialize_line(surface):
    msg = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": INITIALIZE[surface]}
    return (json.dumps(msg) + "\n").encode()


def default_binary():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for rel in ("target/x86_64-unknown-linux-gnu/release/caliban", "target/release/caliban"):
        path = os.path.join(root, rel)
        if os.path.exists(path):
            return path
    sys.exit("no release binary: cargo build --release (or the static build in README)")


def rss_kib(pid):
    """(VmRSS, RssAnon) in KiB."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "RssAnon"):
                fields[name] = int(value.split()[0])
    return fields.get("VmRSS", 0), fields.get("RssAnon", 0)


def one_round(argv, env, cwd, surface):
    start = time.perf_counter_ns()
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, env=env, cwd=cwd)
    p.stdin.write(initialize_line(surface))
    p.stdin.flush()
    line = p.stdout.readline()
    ready = time.perf_counter_ns()
    reply = json.loads(line)
    assert "protocolVersion" in reply["result"], reply
    rss = rss_kib(p.pid)
    eof = time.perf_counter_ns()
    p.stdin.close()
    p.wait(timeout=10)
    gone = time.perf_counter_ns()
    return (ready - start) / 1e6, rss, (gone - eof) / 1e6


# The floor for the whole exchange: a shell that answers any first line with a fixed reply and
# waits for stdin to close, measured through the same harness (time and RSS).
ECHO_REPLY = '{"jsonrpc":"2.0","id":1,"result":{"protocolVersion":1}}'
ECHO_SHELL = ["/bin/sh", "-c", f"read line; echo '{ECHO_REPLY}'; read rest"]


def echo_round(surface, env, cwd):
    return one_round(ECHO_SHELL, env, cwd, surface)


def floor_round():
    start = time.perf_counter_ns()
    p = subprocess.Popen(["true"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL)
    p.wait()
    return (time.perf_counter_ns() - start) / 1e6


def summary(samples):
    samples = sorted(samples)
    p90 = samples[min(len(samples) - 1, int(len(samples) * 0.9))]
    return f"median {statistics.median(samples):7.3f}  p90 {p90:7.3f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binary", nargs="?", default=None)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--surface", choices=["acp", "mcp"], default="acp")
    ap.add_argument("--state", help="XDG_STATE_HOME to use (say, one holding many sessions)")
    a = ap.parse_args()
    binary = os.path.abspath(a.binary or default_binary())
    with tempfile.TemporaryDirectory() as tmp:
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": tmp,
            "XDG_STATE_HOME": a.state or os.path.join(tmp, "state"),
            "XDG_CONFIG_HOME": os.path.join(tmp, "config"),
            "ANTHROPIC_BASE_URL": "http://127.0.0.1:9",
        }
        argv = [binary, a.surface, "serve"]
        one_round(argv, env, tmp, a.surface)  # warm the page cache
        init, rss, anon, exits, floor = [], [], [], [], []
        echo, echo_rss = [], []
        for _ in range(a.rounds):
            floor.append(floor_round())
            ms, (kib, _), _ = echo_round(a.surface, env, tmp)
            echo.append(ms)
            echo_rss.append(kib)
            ms, (kib, anon_kib), exit_ms = one_round(argv, env, tmp, a.surface)
            init.append(ms)
            rss.append(kib)
            anon.append(anon_kib)
            exits.append(exit_ms)
    size = os.path.getsize(binary) / 1024 / 1024
    print(f"{a.surface} serve: {binary} ({size:.2f} MiB), {a.rounds} rounds")
    print(f"spawn `true` (floor)           ms  {summary(floor)}")
    print(f"echo shell → reply (floor)     ms  {summary(echo)}"
          f"  RSS {statistics.median(echo_rss):.0f} KiB")
    print(f"spawn → initialize reply       ms  {summary(init)}")
    print(f"stdin EOF → exit               ms  {summary(exits)}")
    print(f"RSS after initialize          KiB  median {statistics.median(rss):7.0f}"
          f"  (anonymous {statistics.median(anon):.0f})")


if __name__ == "__main__":
    main()
