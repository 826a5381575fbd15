#!/usr/bin/env python3
"""Wall time of a multi-turn run through `caliban -p`, to compare builds with and without
model connection reuse (keep-alive).

Each round is one `caliban -p` run of TURNS model turns (TURNS-1 `Read` tool calls, then an
answer) against `caliban stub-model` on loopback; with `--tls`, through a TLS-terminating
relay in this script (Python's ssl, the test fixture certificate, `SSL_CERT_FILE` at the
fixture CA), which is where a handshake per turn costs most. The builds alternate round by
round; medians and 90th percentiles over the rounds. The stub also reports how many
connections each build opened.

    python3 bench/keepalive.py BEFORE AFTER [--turns 5] [--rounds 20] [--tls] [--stub BIN]

The stub defaults to AFTER (any build with `stub-model` serves the same wire).
"""

import argparse
import json
import os
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures")


def start_stub(binary, script_path):
    stub = subprocess.Popen(
        [binary, "stub-model", "--script", script_path],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    line = stub.stdout.readline().decode()
    return stub, line.strip().rsplit(" ", 1)[-1]


def pipe(a, b):
    try:
        while True:
            data = a.recv(65536)
            if not data:
                break
            b.sendall(data)
    except OSError:
        pass
    for s in (a, b):
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def tls_relay(upstream_port):
    """Accepts TLS on loopback and pipes plaintext to the stub; returns its port."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(os.path.join(FIXTURES, "server.pem"), os.path.join(FIXTURES, "server-key.pem"))
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve():
        while True:
            conn, _ = listener.accept()

            def one(conn=conn):
                # Nagle against the stub's small writes would add delayed-ACK waits (40 ms)
                # that no real server has.
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                try:
                    tls = ctx.wrap_socket(conn, server_side=True)
                except OSError:
                    return
                up = socket.create_connection(("127.0.0.1", upstream_port))
                up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                threading.Thread(target=pipe, args=(tls, up), daemon=True).start()
                pipe(up, tls)

            threading.Thread(target=one, daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return port


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--tls", action="store_true")
    ap.add_argument("--stub")
    args = ap.parse_args()
    builds = {"before": args.before, "after": args.after}
    work = tempfile.mkdtemp(prefix="caliban-keepalive-")
    with open(os.path.join(work, "a.txt"), "w") as f:
        f.write("alpha\n")
    read = {"tool_calls": [{"name": "Read", "input": {"path": "a.txt"}}]}
    one_run = [read] * (args.turns - 1) + [{"text": "done"}]
    script = os.path.join(work, "script.json")
    with open(script, "w") as f:
        json.dump({"turns": one_run * (2 * args.rounds)}, f)
    stub, url = start_stub(args.stub or args.after, script)
    port = int(url.rsplit(":", 1)[1])
    base = f"https://localhost:{tls_relay(port)}" if args.tls else url
    times = {name: [] for name in builds}
    conns = {name: set() for name in builds}
    seen = 0
    try:
        for _ in range(args.rounds):
            for name, binary in builds.items():
                env = {
                    "PATH": os.environ.get("PATH", ""),
                    "HOME": work,
                    "XDG_STATE_HOME": os.path.join(work, "state"),
                    "ANTHROPIC_BASE_URL": base,
                    "ANTHROPIC_API_KEY": "bench",
                }
                if args.tls:
                    env["SSL_CERT_FILE"] = os.path.join(FIXTURES, "ca.pem")
                start = time.perf_counter()
                out = subprocess.run(
                    [binary, "-p", "--max-retries", "0", "read a.txt"],
                    cwd=work, env=env, capture_output=True, timeout=60,
                )
                times[name].append((time.perf_counter() - start) * 1e3)
                if out.returncode != 0 or out.stdout.strip() != b"done":
                    sys.exit(f"{name}: {out}")
                with urllib.request.urlopen(f"{url}/_stub/requests", timeout=10) as r:
                    log = json.load(r)
                conns[name].update(e["connection"] for e in log[seen:])
                seen = len(log)
    finally:
        stub.kill()
    wire = "TLS relay" if args.tls else "plain"
    print(f"{args.turns}-turn run, loopback {wire}, {args.rounds} rounds, load {os.getloadavg()[0]:.2f}")
    for name, ms in times.items():
        ms.sort()
        p90 = ms[min(len(ms) - 1, int(len(ms) * 0.9))]
        per_run = len(conns[name]) / args.rounds
        print(f"  {name:<7} median {statistics.median(ms):7.2f} ms  p90 {p90:7.2f} ms  "
              f"model connections per run {per_run:.1f}")


if __name__ == "__main__":
    main()
