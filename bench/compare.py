#!/usr/bin/env python3
"""Two release builds side by side in one run: binary size, spawn → `initialize` reply,
private memory, the PSS of many idle agents, and relay CPU per event.

    python3 bench/compare.py A B [--rounds 40] [--agents 100] [--pss-rounds 3]
                                 [--relay-rounds 3] [--relay-bench PATH | --no-relay]

Everything alternates between A and B, and the one going first swaps every round, so load
on a shared machine and page-cache state fall on both alike:

- per round and build, one `acp serve` and one `mcp serve` each timed from spawn to the
  whole `initialize` reply line, then read idle (bench/footprint.py: private memory is
  anonymous and private-dirty pages counted once; RSS beside it for reference);
- per PSS round and build, AGENTS idle `acp serve` alive together, Pss summed, per agent;
- per relay round and build, bench/relay.rs flat out (`RELAY_PHASES=flat`) with
  `CALIBAN_BIN` set to the build: CPU µs per event of the surface process for http, mcp and
  acp, beside the bench's own raw relay. The relay bench is built once with
  `cargo bench --bench relay --no-run` (or given with --relay-bench); its stub model is its
  own build for both. RELAY_RUNS, RELAY_EVENTS (here 100 unless set), RELAY_LEAD_MS (here
  20,000) and the other knobs of relay.rs pass through; its warnings are printed as notes.

Medians over the rounds. The output is a Markdown table for bench/RESULTS.md.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from footprint import (SETTLE_S, flush, idle_many, private_kib, smaps_rollup,
                       spawn_initialized, stop)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SURFACES = ("acp", "mcp")
RELAY_WAYS = ("raw", "http", "mcp", "acp")


def timed_idle(binary, surface, tmp):
    """(ms from spawn to the `initialize` reply, smaps_rollup once idle)."""
    start = time.perf_counter_ns()
    p = spawn_initialized(binary, surface, tmp)
    ms = (time.perf_counter_ns() - start) / 1e6
    time.sleep(SETTLE_S)
    fields = smaps_rollup(p.pid)
    stop([p])
    return ms, fields


def relay_bench():
    """Builds bench/relay.rs once and returns its executable."""
    out = subprocess.run(
        ["cargo", "bench", "--bench", "relay", "--no-run", "--message-format=json"],
        cwd=ROOT, check=True, capture_output=True, text=True).stdout
    for line in out.splitlines():
        msg = json.loads(line)
        if msg.get("reason") == "compiler-artifact" and msg["target"]["name"] == "relay" \
                and msg.get("executable"):
            return msg["executable"]
    sys.exit("cargo bench --bench relay --no-run named no executable")


def relay_cpu(bench, binary, notes):
    """{way: CPU µs per event}, flat out, from one run of the relay bench. Its warnings (a
    way whose clients attached after the first byte, so part of the stream went unmeasured,
    or events that never arrived) go to `notes`: such a sample reads low."""
    # CPU time is read in 10 ms ticks: 100 events per run (100,000 in all by default) keep
    # a surface's figure to a few per cent of it. CPU is counted from the moment every client
    # has attached; on a loaded machine setting up 1,000 runs over HTTP took longer than
    # relay.rs's default lead, so the first events went uncounted: 20 s of lead.
    env = {"RELAY_EVENTS": "100", "RELAY_LEAD_MS": "20000", **os.environ,
           "CALIBAN_BIN": binary, "RELAY_PHASES": "flat"}
    out = subprocess.run([bench], env=env, check=True, capture_output=True, text=True).stdout
    cpu = {}
    for line in out.splitlines():
        if line.startswith(" ") and "(" in line:
            notes.append(f"{os.path.basename(binary)}: {line.strip()}")
        parts = line.split()
        if len(parts) >= 7 and parts[0] in RELAY_WAYS and parts[1] == "flat":
            try:
                cpu[parts[0]] = float(parts[6])
            except ValueError:
                pass
    return cpu


def alternate(round_no, builds):
    return builds if round_no % 2 == 0 else builds[::-1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("a", metavar="A")
    ap.add_argument("b", metavar="B")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--agents", type=int, default=100)
    ap.add_argument("--pss-rounds", type=int, default=3)
    ap.add_argument("--relay-rounds", type=int, default=3)
    ap.add_argument("--relay-bench", help="a built bench/relay.rs executable")
    ap.add_argument("--no-relay", action="store_true")
    a = ap.parse_args()
    builds = [os.path.abspath(a.a), os.path.abspath(a.b)]
    if a.a == a.b or builds[0] == builds[1]:
        sys.exit("A and B are the same file")
    init = {(b, s): [] for b in builds for s in SURFACES}
    idle = {(b, s): [] for b in builds for s in SURFACES}
    pss = {b: [] for b in builds}
    relay = {(b, w): [] for b in builds for w in RELAY_WAYS}
    notes = []
    load_start = open("/proc/loadavg").read().split()[:3]
    with tempfile.TemporaryDirectory() as tmp:
        for b in builds:
            flush(b)
            for s in SURFACES:
                timed_idle(b, s, tmp)  # warm the page cache
        for r in range(a.rounds):
            for b in alternate(r, builds):
                for s in SURFACES:
                    ms, fields = timed_idle(b, s, tmp)
                    init[(b, s)].append(ms)
                    idle[(b, s)].append(fields)
        for r in range(a.pss_rounds):
            for b in alternate(r, builds):
                pss[b].append(idle_many(b, a.agents, tmp)["Pss"] / a.agents)
    if not a.no_relay and a.relay_rounds > 0:
        bench = a.relay_bench or relay_bench()
        for r in range(a.relay_rounds):
            for b in alternate(r, builds):
                for way, us in relay_cpu(bench, b, notes).items():
                    relay[(b, way)].append(us)
    load_end = open("/proc/loadavg").read().split()[:3]

    def med(samples):
        return statistics.median(samples) if samples else None

    rows = [("binary size, bytes", [os.path.getsize(b) for b in builds], "{:,.0f}")]
    for s in SURFACES:
        rows.append((f"`{s} serve` spawn → `initialize` reply, ms",
                     [med(init[(b, s)]) for b in builds], "{:.3f}"))
    for s in SURFACES:
        rows.append((f"`{s} serve` private memory idle, KiB",
                     [med([private_kib(f) for f in idle[(b, s)]]) for b in builds], "{:,.0f}"))
    rows.append((f"PSS per agent, {a.agents} idle `acp serve`, KiB",
                 [med(pss[b]) for b in builds], "{:,.1f}"))
    for s in SURFACES:
        rows.append((f"`{s} serve` RSS idle (reference, not gated), KiB",
                     [med([f["Rss"] for f in idle[(b, s)]]) for b in builds], "{:,.0f}"))
    for way in RELAY_WAYS:
        values = [med(relay[(b, way)]) for b in builds]
        if any(v is not None for v in values):
            label = "raw relay in the bench (floor)" if way == "raw" else f"`{way} serve`"
            rows.append((f"relay CPU per event flat out, {label}, µs", values, "{:.1f}"))

    print(f"A = {builds[0]}\nB = {builds[1]}")
    print(f"{a.rounds} rounds of spawns per build and surface, {a.pss_rounds} rounds of "
          f"{a.agents} agents, {0 if a.no_relay else a.relay_rounds} relay rounds; "
          f"load average {' '.join(load_start)} at the start, {' '.join(load_end)} at the end")
    print()
    print("| figure (median) | A | B | B − A |")
    print("|---|---:|---:|---:|")
    for label, (va, vb), fmt in rows:
        if va is None or vb is None:
            continue
        delta = vb - va
        sign = "+" if delta > 0 else "−" if delta < 0 else "±"
        print(f"| {label} | {fmt.format(va)} | {fmt.format(vb)} | "
              f"{sign}{fmt.format(abs(delta))} |")
    print()
    for way in RELAY_WAYS:
        samples = [" ".join(f"{v:.1f}" for v in relay[(b, way)]) for b in builds]
        if any(samples):
            print(f"relay {way} µs/event per round: A {samples[0]}; B {samples[1]}")
    for note in notes:
        print(f"note: {note}")


if __name__ == "__main__":
    main()
