#!/usr/bin/env python3
"""caliban and a peer ACP agent side by side on the same scripted session (issue 15 item 5).

One round spawns an agent with pipes, as an editor does, and drives one ACP session over
stdio: `initialize` → `session/new` (cwd = a fresh workspace holding notes.txt) →
`session/prompt` "read notes.txt". Both agents talk to the same `caliban stub-model` over the
Anthropic Messages wire (ANTHROPIC_BASE_URL), which answers the first model request that
offers tools with a Read tool_use of that file, the next (carrying the tool result) with a
short text, so the prompt ends with stop reason end_turn, and any request without tools
(Claude Code's session title) with a title. Any `session/request_permission` is answered with
the first allow option. Then stdin is closed and the exit timed.

A round only counts when the stub saw a tool_result that holds the file's contents (a token
unique to the round) and the prompt ended with end_turn; anything else is a failure, reported
and fatal, not a data point.

    python3 bench/peer.py [--rounds N] [--binary CALIBAN] [--only caliban|peer]
                          [--offline] [--interval-ms MS] [--verbose]

The peer is claude-agent-acp (`@agentclientprotocol/claude-agent-acp`, the newer name of
Zed's `@zed-industries/claude-code-acp`), which runs the Claude Code CLI shipped in the
Claude Agent SDK (a native binary) as its child, one per session. It is pinned in
bench/peer/package.json and package-lock.json and installed by this script with `npm ci`
into target/peer-bench (once per lockfile). Node must be on PATH.

`--offline` installs, then re-runs the measurement in a network namespace of its own with
only loopback up (`unshare -n`, needs root): proof that neither agent needs anything but
the stub. The environment of both agents is the same and holds no real key:
ANTHROPIC_BASE_URL, ANTHROPIC_API_KEY=sk-ant-stub, a fresh HOME (and XDG dirs) per round,
and the Claude Code switches that turn off its non-essential traffic
(CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC, DISABLE_TELEMETRY, DISABLE_ERROR_REPORTING,
DISABLE_AUTOUPDATER), which caliban ignores.

Memory is measured over the agent's whole process tree (the peer is node, two short
`claude auth status` probes, the Claude Code CLI, and its git and rg children), three ways:
- peak Σ VmRSS, sampled: every --interval-ms (5) a thread walks the tree
  (/proc/PID/task/*/children, so children of any thread are found) and sums VmRSS; the
  largest sum is what the tree held at once, a lower bound of the true peak (a spike
  between samples is missed);
- Σ VmHWM: each process's own high-water mark (kept by the kernel), last read before it
  exited or at the prompt response, summed over every process the round saw: an upper
  bound, since processes that never lived at the same time are added. For one process
  (caliban) it is the exact peak;
- Σ Pss at the prompt response: shared pages split among the processes that share them
  (read once: the kernel walks every page table for it, milliseconds per large process).
A child that has not exec'd yet (same executable and command line as its parent: a fork,
or a vfork/posix_spawn child sharing its parent's memory) is not counted, or its parent's
pages would be counted twice. The sampler's own CPU time is reported.

CPU time (user + sys) of the tree is the larger of two lower bounds: wait4's rusage of the
agent (itself and the descendants it reaped; exact for one process) and the sum of
/proc/PID/stat over every process seen (its last reading, in clock ticks).

Times are from spawn (time.perf_counter) to the `initialize`, `session/new` and prompt
responses; stdin is closed on the prompt response and spawn → exit is the prompt time plus
EOF → exit. Rounds alternate between the agents (and which goes first), after one warm-up
round each that is not counted; spawning `true` through the same harness, once per round,
is the floor.
"""

import argparse
import json
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

sys.dont_write_bytecode = True  # no __pycache__ in bench/ for the import below
from initialize import default_binary  # noqa: E402 (the release build initialize.py measures)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEER_SRC = os.path.join(ROOT, "bench", "peer")
PEER_DIR = os.path.join(ROOT, "target", "peer-bench")
PEER_PACKAGE = "@agentclientprotocol/claude-agent-acp"
PEER_ENTRY = os.path.join(PEER_DIR, "node_modules", PEER_PACKAGE, "dist", "index.js")
CLAUDE_BINARY = os.path.join(
    PEER_DIR, "node_modules", "@anthropic-ai", "claude-agent-sdk-linux-x64", "claude")
INSTALL_TIMEOUT = 600
ROUND_TIMEOUT = 120.0
EXIT_TIMEOUT = 30.0
PROMPT = "read notes.txt"


# ---- installing the peer ----------------------------------------------------------------------

def install_peer():
    """`npm ci` of bench/peer into target/peer-bench, once per lockfile."""
    os.makedirs(PEER_DIR, exist_ok=True)
    with open(os.path.join(PEER_SRC, "package-lock.json"), "rb") as f:
        lock = f.read()
    stamp = os.path.join(PEER_DIR, ".installed-lock")
    if os.path.exists(stamp) and open(stamp, "rb").read() == lock \
            and os.path.exists(PEER_ENTRY):
        return
    for name in ("package.json", "package-lock.json"):
        shutil.copy(os.path.join(PEER_SRC, name), os.path.join(PEER_DIR, name))
    print("installing the peer: npm ci in target/peer-bench", file=sys.stderr)
    r = subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"],
                       cwd=PEER_DIR, stdin=subprocess.DEVNULL, timeout=INSTALL_TIMEOUT)
    if r.returncode != 0:
        sys.exit(f"npm ci failed ({r.returncode})")
    with open(stamp, "wb") as f:
        f.write(lock)


def package_version(*parts):
    path = os.path.join(PEER_DIR, "node_modules", *parts, "package.json")
    with open(path) as f:
        return json.load(f)["version"]


def tree_bytes(path):
    """Apparent size of every file under path."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


# ---- the process tree ------------------------------------------------------------------------

def children(pid):
    out = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return out


def status(pid):
    """(Name, VmRSS KiB, VmHWM KiB), or None once the process is gone."""
    fields = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in ("Name", "VmRSS", "VmHWM"):
                    fields[name] = value.strip()
    except OSError:
        return None
    if "VmRSS" not in fields:  # a zombie has no memory lines
        return None
    return fields["Name"], int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


def executable(pid):
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return None


def command_line(pid):
    """The raw command line. The kernel reads it from the process's memory under its mmap
    lock, so the sampler reads it only until it knows a process has exec'd: reading it every
    few milliseconds slows a process that maps memory as busily as a JavaScript runtime."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return None


def short(cmdline):
    """The first arguments of a command line, shortened for the report."""
    args = cmdline.split(b"\0")
    args = [os.path.basename(args[0].decode(errors="replace"))] + \
        [x.decode(errors="replace")[:24] for x in args[1:4] if x]
    return " ".join(args)


TICK = 1 / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid):
    """utime + stime of a whole process (all its threads, living and dead), in clock ticks'
    resolution."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) * TICK
    except (OSError, IndexError, ValueError):
        return None


def pss_kib(pid):
    """Proportional set size: the process's private pages plus its share of pages it shares.
    The kernel walks every page table to compute it (milliseconds for a large process), so it
    is read once, not sampled."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class TreeSampler(threading.Thread):
    """Walks the process tree under `root` every `interval` seconds until stopped."""

    def __init__(self, root, interval):
        super().__init__(daemon=True)
        self.root, self.interval = root, interval
        self.stop_event = threading.Event()
        self.lock = threading.Lock()  # the bench also takes a sample at the prompt response
        self.peak_rss = 0      # largest Σ VmRSS seen in one sample
        self.hwm = {}          # pid → (name, last VmHWM read)
        self.images = {}       # pid → (executable, command line), once it has exec'd
        self.cpu_of = {}       # pid → last utime + stime read
        self.samples = 0
        self.cpu = 0.0         # CPU seconds the sampler itself used

    def tree(self):
        """[(pid, counted)] for the tree: a child with its parent's executable and command
        line has not exec'd yet; it shares (vfork, posix_spawn) or copies (fork) its parent's
        pages, so it is walked but not counted, or they would be counted twice."""
        out, todo, seen = [], [(self.root, None)], set()
        while todo:
            pid, parent_image = todo.pop()
            if pid in seen:
                continue
            seen.add(pid)
            exe = executable(pid)
            if exe is None:
                continue
            known = self.images.get(pid)
            if known is not None and known[0] == exe:
                own, execd = known, True
            else:
                cmdline = command_line(pid)
                if cmdline is None:
                    continue
                own = (exe, cmdline)
                execd = own != parent_image
                if execd and cmdline:  # an empty one is read mid-exec: read it again
                    self.images[pid] = own
            out.append((pid, execd))
            todo.extend((child, own) for child in children(pid))
        return out

    def sample(self):
        with self.lock:
            self._sample()

    def _sample(self):
        total = 0
        for pid, counted in self.tree():
            st = status(pid) if counted else None
            if st is None:
                continue
            name, rss, hwm = st
            total += rss
            self.hwm[pid] = (name, hwm)
            cpu = cpu_seconds(pid)
            if cpu is not None:
                self.cpu_of[pid] = cpu
        self.peak_rss = max(self.peak_rss, total)
        self.samples += 1

    def pss(self):
        """Σ Pss over the tree now."""
        return sum(pss_kib(pid) for pid, counted in self.tree() if counted)

    def run(self):
        while True:
            self.sample()
            if self.stop_event.wait(self.interval):
                self.cpu = time.thread_time()
                return

    def stop(self):
        self.stop_event.set()
        self.join()

    def hwm_sum(self):
        return sum(h for _name, h in list(self.hwm.values()))


# ---- one ACP session ------------------------------------------------------------------------

class Agent:
    """An agent process and its stdout, read line by line with deadlines."""

    def __init__(self, argv, env, cwd):
        self.start = time.perf_counter()
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, env=env, cwd=cwd)
        self.buf = b""
        self.frames = []
        self.permissions = 0
        # stderr is drained on a thread so a chatty agent never blocks on a full pipe.
        self.stderr = []
        threading.Thread(target=self._drain_stderr, daemon=True).start()
        # wait4 rather than Popen.wait: its rusage is the CPU time of the agent and of every
        # descendant it reaped.
        self.exited = threading.Event()
        self.exited_at, self.rusage = None, None
        threading.Thread(target=self._reap, daemon=True).start()

    def _reap(self):
        _pid, status, self.rusage = os.wait4(self.proc.pid, 0)
        self.exited_at = time.perf_counter()
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        self.exited.set()

    def wait(self, timeout=None):
        """Whether the agent exited within `timeout` seconds."""
        return self.exited.wait(timeout)

    def _drain_stderr(self):
        for line in self.proc.stderr:
            self.stderr.append(line)

    def send(self, msg):
        self.proc.stdin.write((json.dumps(msg) + "\n").encode())
        self.proc.stdin.flush()

    def line(self, deadline):
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.perf_counter()
            if left <= 0:
                raise TimeoutError("no reply in time")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise EOFError("the agent closed stdout")
                self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return json.loads(line)

    def call(self, id_, method, params, deadline):
        """Sends a request and reads until its response, answering the agent's requests."""
        self.send({"jsonrpc": "2.0", "id": id_, "method": method, "params": params})
        while True:
            msg = self.line(deadline)
            self.frames.append(msg)
            if "method" in msg and "id" in msg:
                self.answer(msg)
            elif msg.get("id") == id_:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def answer(self, msg):
        if msg["method"] == "session/request_permission":
            self.permissions += 1
            options = msg["params"]["options"]
            allow = next(o for o in options if o["kind"].startswith("allow"))
            result = {"outcome": {"outcome": "selected", "optionId": allow["optionId"]}}
            self.send({"jsonrpc": "2.0", "id": msg["id"], "result": result})
        else:
            self.send({"jsonrpc": "2.0", "id": msg["id"],
                       "error": {"code": -32601, "message": "not offered by the bench"}})

    def elapsed(self):
        return time.perf_counter() - self.start


def start_stub(binary, script, tmp):
    path = os.path.join(tmp, "script.json")
    with open(path, "w") as f:
        json.dump(script, f)
    log = open(os.path.join(tmp, "stub.log"), "w")
    stub = subprocess.Popen([binary, "stub-model", "--script", path], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=log)
    line = stub.stdout.readline().decode()
    if not line.startswith("listening on "):
        sys.exit(f"stub-model did not start: {line!r}")
    return stub, line.split()[-1]


def script_for(read_input):
    """The model's side of the session: Read, then an answer. Both turns go only to requests
    that offer tools; a reusable turn answers the requests that offer none (Claude Code asks
    for a session title that way, while it asks for the turn) with a title in the JSON its
    structured output asks for."""
    return {"turns": [
        {"match": {"tools": True}, "tool_calls": [{"name": "Read", "input": read_input}]},
        {"match": {"tools": True}, "text": "The file holds the token."},
        {"match": {"tools": False}, "reuse": True, "text": '{"title": "Read notes"}'},
    ]}


def tool_results(requests):
    """Text of every tool_result block the stub received."""
    out = []
    for req in requests:
        body = req.get("body")
        if not isinstance(body, dict):
            continue
        for message in body.get("messages") or []:
            content = message.get("content")
            if not isinstance(content, list):
                continue
            for block in content:
                if not isinstance(block, dict) or block.get("type") != "tool_result":
                    continue
                inner = block.get("content")
                if isinstance(inner, str):
                    out.append(inner)
                elif isinstance(inner, list):
                    out.extend(b.get("text", "") for b in inner if isinstance(b, dict))
    return out


def describe(req):
    body = req.get("body") if isinstance(req.get("body"), dict) else {}
    tools = body.get("tools") or []
    fmt = ((body.get("output_config") or {}).get("format") or {}).get("type")
    return (f"{req['method']} {req['path']} model={body.get('model')} tools={len(tools)} "
            f"max_tokens={body.get('max_tokens')} stream={body.get('stream')} "
            f"messages={len(body.get('messages') or [])} "
            f"bytes={req.get('headers', {}).get('content-length', '?')}"
            + (f" output_format={fmt}" if fmt else ""))


def kill_tree(pids):
    for pid in pids:
        try:
            os.kill(pid, 9)
        except OSError:
            pass


def floor_round():
    """Spawning `true` through the same harness: what any process pays here."""
    agent = Agent(["true"], {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, "/")
    agent.wait()
    return agent.exited_at - agent.start


def one_round(name, argv, read_key, binary, interval, verbose):
    token = "token-" + os.urandom(8).hex()
    with tempfile.TemporaryDirectory(prefix="peer-bench-") as tmp:
        ws, home = os.path.join(tmp, "ws"), os.path.join(tmp, "home")
        os.makedirs(ws)
        os.makedirs(home)
        notes = os.path.join(ws, "notes.txt")
        with open(notes, "w") as f:
            f.write(f"The token of this round is {token}.\n")
        stub, url = start_stub(binary, script_for({read_key: notes}), tmp)
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": home,
            "XDG_STATE_HOME": os.path.join(home, ".local", "state"),
            "XDG_CONFIG_HOME": os.path.join(home, ".config"),
            "XDG_CACHE_HOME": os.path.join(home, ".cache"),
            "ANTHROPIC_BASE_URL": url,
            "ANTHROPIC_API_KEY": "sk-ant-stub",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "DISABLE_AUTOUPDATER": "1",
        }
        agent = Agent(argv, env, ws)
        sampler = TreeSampler(agent.proc.pid, interval)
        sampler.start()
        deadline = agent.start + ROUND_TIMEOUT
        r = {"agent": name}
        try:
            agent.call(1, "initialize", {"protocolVersion": 1, "clientCapabilities": {}},
                       deadline)
            r["initialize"] = agent.elapsed()
            new = agent.call(2, "session/new", {"cwd": ws, "mcpServers": []}, deadline)
            r["session_new"] = agent.elapsed()
            prompt = [{"type": "text", "text": PROMPT}]
            done = agent.call(3, "session/prompt",
                              {"sessionId": new["sessionId"], "prompt": prompt}, deadline)
            r["prompt"] = agent.elapsed()
            r["stop_reason"] = done.get("stopReason")
        except (TimeoutError, EOFError, RuntimeError, OSError) as e:
            r["error"] = f"{type(e).__name__}: {e}"
        # A sample now makes every live process's VmHWM exact up to the response (the
        # kernel keeps it), however far the last periodic sample was.
        sampler.sample()
        pss_at_prompt = sampler.pss() if "error" not in r else None
        closed = time.perf_counter()
        try:
            agent.proc.stdin.close()
        except OSError:
            pass
        if agent.wait(EXIT_TIMEOUT):
            r["eof_to_exit"] = agent.exited_at - closed
            # Spawn → exit as a client that closes stdin on the response sees it; the Pss
            # reading between the two is left out.
            r["exit"] = r.get("prompt", 0) + r["eof_to_exit"]
            r["cpu_reaped"] = agent.rusage.ru_utime + agent.rusage.ru_stime
        else:
            r["exit"] = None
            r.setdefault("error", f"did not exit within {EXIT_TIMEOUT} s of stdin EOF")
        sampler.stop()
        # Descendants still alive once the agent is gone are orphans: note and end them.
        time.sleep(0.2)
        leftovers = [pid for pid in sampler.hwm if pid != agent.proc.pid and status(pid)]
        r["orphans"] = [sampler.hwm[pid][0] for pid in leftovers]
        kill_tree(leftovers + ([agent.proc.pid] if r["exit"] is None else []))
        agent.wait()
        r["peak_rss_sampled"] = sampler.peak_rss
        r["hwm_sum"] = sampler.hwm_sum()
        r["pss_at_prompt"] = pss_at_prompt
        r["processes"] = sorted(name for name, _h in sampler.hwm.values())
        r["per_process_hwm"] = sorted(
            ((short(sampler.images[pid][1]) if pid in sampler.images else name, h)
             for pid, (name, h) in sampler.hwm.items()),
            key=lambda x: -x[1])
        r["samples"] = sampler.samples
        r["sampler_cpu"] = sampler.cpu
        # Both are lower bounds of the tree's CPU time: wait4's misses descendants the agent
        # never reaped (node does not wait for every Claude Code process it ends), the /proc
        # sum what ran after a process's last sample and is counted in 10 ms ticks.
        r["cpu"] = max(r.get("cpu_reaped", 0), sum(list(sampler.cpu_of.values())))
        r["permissions"] = agent.permissions
        try:
            with urllib.request.urlopen(url + "/_stub/requests", timeout=10) as res:
                requests = json.load(res)
        except OSError as e:
            requests = []
            r.setdefault("error", f"cannot read the stub's log: {e}")
        stub.stdin.close()
        stub.wait(timeout=10)
        r["requests"] = [describe(q) for q in requests]
        read_ok = any(token in text for text in tool_results(requests))
        if "error" not in r and not read_ok:
            r["error"] = "the stub never saw a tool_result holding the file's contents"
        if "error" not in r and r["stop_reason"] != "end_turn":
            r["error"] = f"stop reason {r['stop_reason']!r}, not end_turn"
        if "error" in r or verbose:
            r["stderr_tail"] = b"".join(agent.stderr[-20:]).decode(errors="replace")
            with open(os.path.join(tmp, "stub.log")) as f:
                r["stub_log"] = f.read()
    return r


# ---- the report ------------------------------------------------------------------------------

def ms(x):
    return f"{x * 1000:,.0f}" if x >= 0.1 else f"{x * 1000:.1f}"


def mib(kib):
    return f"{kib / 1024:,.1f}"


def row(label, values, fmt):
    values = sorted(values)
    return (f"  {label:<28} median {fmt(statistics.median(values)):>8}  "
            f"min {fmt(values[0]):>8}  max {fmt(values[-1]):>8}")


def report(name, rounds, install_bytes, what):
    print(f"{name}: {what}")
    print(f"  install {install_bytes / 1e6:,.1f} MB, {len(rounds)} rounds")
    print(row("spawn → initialize (ms)", [r["initialize"] for r in rounds], ms))
    print(row("spawn → session/new (ms)", [r["session_new"] for r in rounds], ms))
    print(row("spawn → prompt response (ms)", [r["prompt"] for r in rounds], ms))
    print(row("spawn → exit (ms)", [r["exit"] for r in rounds], ms))
    print(row("stdin EOF → exit (ms)", [r["eof_to_exit"] for r in rounds], ms))
    print(row("CPU user+sys of the tree (ms)", [r["cpu"] for r in rounds], ms))
    print(row("peak Σ VmRSS sampled (MiB)", [r["peak_rss_sampled"] for r in rounds], mib))
    print(row("Σ VmHWM, every process (MiB)", [r["hwm_sum"] for r in rounds], mib))
    print(row("Σ Pss at prompt resp. (MiB)", [r["pss_at_prompt"] for r in rounds], mib))
    names = {}
    for pname in rounds[0]["processes"]:
        names[pname] = names.get(pname, 0) + 1
    print("  processes in round 1: "
          + ", ".join(f"{n}×{c}" if c > 1 else n for n, c in sorted(names.items())))
    print("  VmHWM per process in round 1:")
    for argv, h in rounds[0]["per_process_hwm"]:
        if h == 0:  # seen mid-exec, never again
            continue
        print(f"    {mib(h):>7} MiB  {argv}")
    print(f"  samples per round (median): {statistics.median(r['samples'] for r in rounds)}, "
          f"sampler CPU {ms(statistics.median(r['sampler_cpu'] for r in rounds))} ms"
          f"; permission requests: {sum(r['permissions'] for r in rounds)}")
    orphans = [o for r in rounds for o in r["orphans"]]
    print(f"  descendants alive 0.2 s after the agent exited (then killed): "
          f"{len(orphans)} in {len(rounds)} rounds" + (f" ({', '.join(sorted(set(orphans)))})"
                                                    if orphans else ""))
    print("  model requests in round 1:")
    for line in rounds[0]["requests"]:
        print(f"    {line}")
    counts = sorted({len(r["requests"]) for r in rounds})
    print(f"  model requests per round: {', '.join(map(str, counts))}")


def network_note():
    with open("/proc/net/route") as f:
        routes = len(f.readlines()) - 1
    links = [line.split(":")[0].strip() for line in open("/proc/net/dev").readlines()[2:]]
    return f"network: interfaces {', '.join(links)}; {routes} IPv4 routes"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", help="caliban (default: the static release build)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--only", choices=["caliban", "peer"])
    ap.add_argument("--interval-ms", type=float, default=5.0)
    ap.add_argument("--offline", action="store_true",
                    help="measure in a network namespace with only loopback (unshare -n)")
    ap.add_argument("--no-install", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args()
    binary = os.path.abspath(a.binary or default_binary())
    if a.only != "caliban" and not a.no_install:
        install_peer()
    if a.offline:
        rest = [x for x in sys.argv[1:] if x != "--offline"] + ["--no-install",
                                                                "--binary", binary]
        inner = 'ip link set lo up && exec "$0" "$@"'
        os.execvp("unshare", ["unshare", "-n", "sh", "-c", inner, sys.executable,
                              os.path.abspath(__file__), *rest])

    agents = {}
    if a.only != "peer":
        agents["caliban"] = ([binary, "acp", "serve"], "path")
    if a.only != "caliban":
        agents["claude-agent-acp"] = (["node", PEER_ENTRY], "file_path")
    interval = a.interval_ms / 1000

    print(f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
          f"nproc {os.cpu_count()}; load {os.getloadavg()[0]:.2f} (1 min) at start")
    print(network_note())
    for name, (argv, key) in agents.items():  # warm-up: page cache, not counted
        r = one_round(name, argv, key, binary, interval, a.verbose)
        if "error" in r:
            print(json.dumps(r, indent=1))
            sys.exit(f"{name}: the warm-up round failed: {r['error']}")
    results = {name: [] for name in agents}
    order = list(agents)
    floor = []
    for i in range(a.rounds):
        floor.append(floor_round())
        for name in (order if i % 2 == 0 else order[::-1]):
            argv, key = agents[name]
            r = one_round(name, argv, key, binary, interval, a.verbose)
            if "error" in r:
                print(json.dumps(r, indent=1))
                sys.exit(f"{name}: round {i + 1} failed: {r['error']}")
            results[name].append(r)
            if a.verbose:
                print(f"{name} round {i + 1}: prompt {ms(r['prompt'])} ms, "
                      f"exit {ms(r['exit'])} ms, sampled {mib(r['peak_rss_sampled'])} MiB, "
                      f"Σ VmHWM {mib(r['hwm_sum'])} MiB", file=sys.stderr)
    print(f"load {os.getloadavg()[0]:.2f} (1 min) at end")
    print(row("floor: spawn `true` → exit (ms)", floor, ms))
    node = shutil.which("node")
    if "caliban" in results:
        version = subprocess.run([binary, "--version"], capture_output=True,
                                 text=True).stdout.strip()
        report("caliban", results["caliban"], os.path.getsize(binary),
               f"{binary} acp serve ({version})")
    if "claude-agent-acp" in results:
        cli = subprocess.run([CLAUDE_BINARY, "--version"], capture_output=True, text=True,
                             env={"PATH": os.environ.get("PATH", ""), "HOME": "/nonexistent"},
                             ).stdout.strip()
        node_version = subprocess.run(["node", "--version"], capture_output=True,
                                      text=True).stdout.strip()
        what = (f"{PEER_PACKAGE} {package_version(PEER_PACKAGE)}, "
                f"@anthropic-ai/claude-agent-sdk {package_version('@anthropic-ai', 'claude-agent-sdk')}"
                f" (Claude Code CLI {cli}), node {node_version}")
        node_bytes = os.path.getsize(os.path.realpath(node)) if node else 0
        report("claude-agent-acp", results["claude-agent-acp"],
               tree_bytes(os.path.join(PEER_DIR, "node_modules")) + node_bytes,
               what + " — install = node_modules + the node binary")


if __name__ == "__main__":
    main()
