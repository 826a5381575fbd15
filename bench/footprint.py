#!/usr/bin/env python3
"""What an idle caliban costs a node: private memory of one idle `acp serve` / `mcp serve`
after `initialize`, and the PSS of many idle agents sharing one binary.

    python3 bench/footprint.py [BINARY] [--rounds N] [--agents N]
                               [--max-private KIB] [--max-pss KIB]

Private memory is the pages only this process holds and nothing else can give back: its
anonymous pages (heap, stacks, `.bss`, copies of written `.data`) together with the pages it
dirtied in file mappings. Both figures come from /proc/PID/smaps_rollup, and they overlap:
a touched anonymous page is private dirty as well, so their sum would count most pages
twice. The union is what is meant, and in a freshly exec'd process with no swap, no KSM and
no forked children sharing its pages, every anonymous page is private dirty; the union is
then the larger of the two, which is what is reported (`max(Private_Dirty, Anonymous)`).
Private_Clean is left out on purpose: with one process running a binary, the binary's
clean page-cache pages show up as private clean, although a second process would share them
and the kernel can drop them at any time. For the same reason the binary is flushed to disk
(fsync) before anything is measured: a freshly built or copied binary's page cache is dirty
until written back, and those pages would show up as private dirty in every process mapping
them (the whole text segment, some 5 MiB, for half a minute after a build).

PSS (proportional set size) charges each resident page to the processes mapping it in equal
shares, so the PSS of N agents summed is the memory those N cost together: N times their
private pages plus, once, the pages of the binary any of them touched. It is measured by
spawning N `acp serve`, sending each one `initialize`, and summing `Pss` of their
smaps_rollup while all N sit idle; the figure quoted is per agent (total / N).

RSS is printed beside them and gated on by nothing: most of it is file-backed text of the
binary, shared by every process that runs it, and it follows how start-up code is spread
over the kernel's 64 KiB fault-around windows rather than what the code allocates.

Medians over the rounds. `--max-private` exits 1 when either surface's median private memory
is above it, `--max-pss` when the median PSS per agent is; `.ci/run` holds both at the
budgets of bench/RESULTS.md. BINARY defaults as in bench/initialize.py.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from initialize import default_binary, initialize_line

SURFACES = ("acp", "mcp")


def smaps_rollup(pid):
    """The kB fields of /proc/PID/smaps_rollup."""
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            name, _, value = line.partition(":")
            parts = value.split()
            if len(parts) == 2 and parts[1] == "kB":
                fields[name] = int(parts[0])
    return fields


def private_kib(fields):
    """Anonymous and private-dirty pages, each counted once (see the module doc)."""
    return max(fields["Private_Dirty"], fields["Anonymous"])


def flush(binary):
    """Writes the binary's dirty page cache back, so mapped pages count as clean."""
    fd = os.open(binary, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def env_for(tmp):
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": tmp,
        "XDG_STATE_HOME": os.path.join(tmp, "state"),
        "XDG_CONFIG_HOME": os.path.join(tmp, "config"),
        "ANTHROPIC_BASE_URL": "http://127.0.0.1:9",
    }


def spawn_initialized(binary, surface, tmp):
    """A `SURFACE serve` that has answered `initialize` and waits for its next line."""
    p = subprocess.Popen([binary, surface, "serve"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         env=env_for(tmp), cwd=tmp)
    p.stdin.write(initialize_line(surface))
    p.stdin.flush()
    if not p.stdout.readline():
        sys.exit(f"{binary} {surface} serve gave no `initialize` reply")
    return p


def stop(procs):
    for p in procs:
        p.stdin.close()
    for p in procs:
        p.wait(timeout=10)


# Long enough for a server to go back to waiting after its reply (the reply is written
# before the loop's last bookkeeping), short against a round.
SETTLE_S = 0.05


def idle_one(binary, surface, tmp):
    """smaps_rollup of one idle server right after `initialize`."""
    p = spawn_initialized(binary, surface, tmp)
    time.sleep(SETTLE_S)
    fields = smaps_rollup(p.pid)
    stop([p])
    return fields


def idle_many(binary, agents, tmp):
    """Summed smaps_rollup of AGENTS idle `acp serve`, all alive at the moment of reading."""
    procs = []
    try:
        for _ in range(agents):
            procs.append(spawn_initialized(binary, "acp", tmp))
        time.sleep(SETTLE_S)
        total = {}
        for p in procs:
            for name, kib in smaps_rollup(p.pid).items():
                total[name] = total.get(name, 0) + kib
        return total
    finally:
        stop(procs)


def measure(binary, rounds, agents, tmp):
    """{surface: [fields per round]}, [summed fields of `agents` agents per round]."""
    idle = {s: [] for s in SURFACES}
    many = []
    for _ in range(rounds):
        for surface in SURFACES:
            idle[surface].append(idle_one(binary, surface, tmp))
    for _ in range(max(1, rounds // 5)):
        many.append(idle_many(binary, agents, tmp))
    return idle, many


def med(samples, key):
    return statistics.median(key(s) for s in samples)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binary", nargs="?", default=None)
    ap.add_argument("--rounds", type=int, default=20,
                    help="spawns per surface; PSS is measured rounds/5 times (at least once)")
    ap.add_argument("--agents", type=int, default=100)
    ap.add_argument("--max-private", type=int, metavar="KIB",
                    help="fail above this median private memory (either surface)")
    ap.add_argument("--max-pss", type=int, metavar="KIB",
                    help="fail above this median PSS per agent")
    a = ap.parse_args()
    binary = os.path.abspath(a.binary or default_binary())
    flush(binary)
    with tempfile.TemporaryDirectory() as tmp:
        idle_one(binary, "acp", tmp)  # warm the page cache
        idle, many = measure(binary, a.rounds, a.agents, tmp)
    size = os.path.getsize(binary)
    print(f"{binary}: {size} bytes; {a.rounds} spawns per surface, "
          f"{len(many)} x {a.agents} agents")
    failed = []
    for surface in SURFACES:
        private = med(idle[surface], private_kib)
        print(f"{surface} serve idle after initialize   KiB  private {private:6.0f}"
              f"  (Private_Dirty {med(idle[surface], lambda f: f['Private_Dirty']):.0f},"
              f" Anonymous {med(idle[surface], lambda f: f['Anonymous']):.0f})"
              f"  Pss {med(idle[surface], lambda f: f['Pss']):.0f}"
              f"  Rss {med(idle[surface], lambda f: f['Rss']):.0f}")
        if a.max_private is not None and private > a.max_private:
            failed.append(f"{surface} serve: private memory {private:.0f} KiB is above its "
                          f"budget of {a.max_private} KiB")
    total = med(many, lambda f: f["Pss"])
    per_agent = total / a.agents
    shared = total - med(many, private_kib)
    print(f"{a.agents} idle acp serve, Pss summed       KiB  total {total:6.0f}"
          f"  per agent {per_agent:.1f}  (of which shared binary pages {shared:.0f} in all,"
          f" Rss summed {med(many, lambda f: f['Rss']):.0f})")
    if a.max_pss is not None and per_agent > a.max_pss:
        failed.append(f"PSS per agent of {a.agents} idle agents, {per_agent:.1f} KiB, is above "
                      f"its budget of {a.max_pss} KiB")
    if failed:
        sys.exit("\n".join(failed))


if __name__ == "__main__":
    main()
