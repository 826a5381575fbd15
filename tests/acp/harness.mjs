// The client side of caliban's ACP integration tests, built on the official ACP TypeScript
// SDK (@agentclientprotocol/sdk). It spawns `caliban acp serve`, records every frame in both
// directions, serves the client methods (permission prompts, fs/*, terminal/*) with
// behaviour a scenario can change, and validates every frame caliban sends against the ACP
// JSON schema the SDK ships (schema/v1/schema.json), method by method.
//
// Every wait has a deadline: a scenario that hangs fails with what it was waiting for.

import { spawn } from "node:child_process";
import { readFileSync } from "node:fs";
import fs from "node:fs/promises";
import { createRequire } from "node:module";
import path from "node:path";
import { Readable, Writable } from "node:stream";
import * as acp from "@agentclientprotocol/sdk";
import Ajv2020 from "ajv/dist/2020.js";
import addFormats from "ajv-formats";

/** Default deadline for any single wait. */
export const WAIT_MS = 20_000;

export function withTimeout(promise, ms, label) {
  let timer;
  const deadline = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`timed out after ${ms} ms: ${label}`)), ms);
  });
  return Promise.race([promise, deadline]).finally(() => clearTimeout(timer));
}

export const sleep = (ms) => new Promise((res) => setTimeout(res, ms));

// ---- schema validation ---------------------------------------------------------------------

const require = createRequire(import.meta.url);
const schemaPath = require.resolve("@agentclientprotocol/sdk/schema/v1/schema.json");
const schema = JSON.parse(readFileSync(schemaPath, "utf8"));
const ajv = new Ajv2020({ strict: false, allErrors: false });
addFormats(ajv);
for (const f of ["int32", "int64", "uint16", "uint32", "uint64", "double"]) ajv.addFormat(f, true);
ajv.addSchema(schema, "acp");
const defsByMethod = new Map(); // "method|Request" -> def name
for (const [name, def] of Object.entries(schema.$defs)) {
  for (const kind of ["Request", "Response", "Notification"]) {
    if (def["x-method"] && name.endsWith(kind)) defsByMethod.set(`${def["x-method"]}|${kind}`, name);
  }
}
const validators = new Map();
function check(defName, value) {
  let v = validators.get(defName);
  if (!v) {
    v = ajv.getSchema(`acp#/$defs/${defName}`);
    validators.set(defName, v);
  }
  if (!v(value)) {
    const e = v.errors?.[0];
    return `${defName}: ${e?.instancePath || "/"} ${e?.message} ${JSON.stringify(e?.params ?? {})}`;
  }
  return null;
}

const isAbsolute = (p) => typeof p === "string" && p.startsWith("/");

/**
 * Checks every frame the agent sent (`a2c`), in order, against the schema and the protocol's
 * rules: each request and notification against its method's params, each response against
 * the response type of the client request it answers, no `session/update` for a session
 * outside a prompt or a load of it, fs/terminal calls only when advertised, absolute paths,
 * every terminal released.
 */
export function validate(frames) {
  const problems = [];
  const clientRequests = new Map(); // id -> {method, params}
  const busy = new Map(); // sessionId -> number of prompts/loads in flight
  const openTerminals = new Set();
  let caps = {};
  frames.forEach(({ dir, msg, raw }, index) => {
    const where = `frame ${index} (${dir})`;
    if (msg === undefined) {
      problems.push(`${where}: not JSON: ${String(raw).slice(0, 200)}`);
      return;
    }
    if (dir === "c2a") {
      if (msg.method && msg.id !== undefined) {
        clientRequests.set(msg.id, { method: msg.method, params: msg.params });
        if (msg.method === "initialize") caps = msg.params?.clientCapabilities ?? {};
        if (["session/prompt", "session/load"].includes(msg.method)) {
          const s = msg.params?.sessionId;
          busy.set(s, (busy.get(s) ?? 0) + 1);
        }
      }
      return;
    }
    const problem = (text) => problems.push(`${where} ${msg.method ?? "response"}: ${text}`);
    if (msg.jsonrpc !== "2.0") problem('missing "jsonrpc": "2.0"');
    if (raw.length > 1 << 20) problem(`frame of ${raw.length} bytes`);
    if (msg.method) {
      const kind = msg.id !== undefined ? "Request" : "Notification";
      const def = defsByMethod.get(`${msg.method}|${kind}`);
      if (!def) problem(`unknown ${kind.toLowerCase()} method`);
      else {
        const e = check(def, msg.params);
        if (e) problem(e);
      }
      const p = msg.params ?? {};
      if (msg.method === "session/update") {
        const u = p.update ?? {};
        // The session's commands and title come right after session/new, load or resume is
        // answered, as the ACP docs ask (metadata, not history); everything else belongs to
        // a prompt or a load.
        const metadata = ["available_commands_update", "session_info_update"];
        if (!busy.get(p.sessionId) && !metadata.includes(u.sessionUpdate)) {
          problem(`update for ${p.sessionId} outside a prompt or load: ${JSON.stringify(u).slice(0, 200)}`);
        }
        for (const loc of u.locations ?? []) if (!isAbsolute(loc.path)) problem(`relative location ${loc.path}`);
        for (const c of Array.isArray(u.content) ? u.content : []) if (c.type === "diff" && !isAbsolute(c.path)) problem(`relative diff path ${c.path}`);
      }
      if (msg.method.startsWith("fs/")) {
        const need = msg.method === "fs/read_text_file" ? "readTextFile" : "writeTextFile";
        if (!caps.fs?.[need]) problem(`called without the client's fs.${need}`);
        if (!isAbsolute(p.path)) problem(`relative path ${p.path}`);
      }
      if (msg.method.startsWith("terminal/")) {
        if (!caps.terminal) problem("called without the client's terminal capability");
        if (msg.method === "terminal/create" && p.cwd != null && !isAbsolute(p.cwd)) problem(`relative cwd ${p.cwd}`);
      }
      return;
    }
    if (msg.id === undefined) {
      problem("neither a request, a notification nor a response");
      return;
    }
    const req = clientRequests.get(msg.id);
    if (!req) {
      if (!("error" in msg && msg.id === null)) problem(`answer to unknown request id ${JSON.stringify(msg.id)}`);
      if ("error" in msg) {
        const e = check("Error", msg.error);
        if (e) problem(e);
      }
      return;
    }
    clientRequests.delete(msg.id);
    if (["session/prompt", "session/load"].includes(req.method)) {
      const s = req.params?.sessionId;
      busy.set(s, (busy.get(s) ?? 1) - 1);
    }
    if ("error" in msg) {
      const e = check("Error", msg.error);
      if (e) problem(e);
    } else if (!("result" in msg)) {
      problem("response without result or error");
    } else {
      const def = defsByMethod.get(`${req.method}|Response`);
      if (def) {
        const e = check(def, msg.result);
        if (e) problem(`${req.method}: ${e}`);
      }
    }
  });
  // Terminals: every one the agent created must have been released.
  const created = new Map(); // request id -> true
  frames.forEach(({ dir, msg }) => {
    if (!msg) return;
    if (dir === "a2c" && msg.method === "terminal/create") created.set(msg.id, true);
    if (dir === "c2a" && msg.id !== undefined && created.has(msg.id) && msg.result?.terminalId) {
      openTerminals.add(msg.result.terminalId);
    }
    if (dir === "a2c" && msg.method === "terminal/release") openTerminals.delete(msg.params?.terminalId);
  });
  for (const t of openTerminals) problems.push(`terminal ${t} was never released`);
  return problems;
}

// ---- the client ----------------------------------------------------------------------------

/** A frame tap: records each line that passes, in order, with its direction. */
export function tap(dir, frames, onFrame) {
  let buf = "";
  const dec = new TextDecoder();
  return new TransformStream({
    transform(chunk, ctl) {
      buf += dec.decode(chunk, { stream: true });
      let i;
      while ((i = buf.indexOf("\n")) >= 0) {
        const raw = buf.slice(0, i);
        buf = buf.slice(i + 1);
        if (!raw.trim()) continue;
        let msg;
        try {
          msg = JSON.parse(raw);
        } catch {
          msg = undefined;
        }
        frames.push({ dir, msg, raw, at: Date.now() });
        onFrame();
      }
      ctl.enqueue(chunk);
    },
  });
}

/**
 * Runs `body(h)` against a fresh `caliban acp serve`, then closes its stdin and waits for it
 * to exit. `h` offers:
 * - `agent`: the SDK's ClientContext (`request`, `notify`);
 * - `frames`: every frame so far, `{dir: "a2c"|"c2a", msg, raw, at}`;
 * - `updates(sessionId)`: the `session/update` params received for a session;
 * - `calls(method)`: the agent's requests of one method;
 * - `waitFor(predicate, label, ms)`: resolves once `predicate()` is truthy;
 * - `permission`: the permission answerer, `(params, signal) => answer | Promise<answer>`;
 * - `buffers`: path → text the editor holds unsaved (served by fs/read_text_file).
 */
export async function withAgent(opts, body) {
  const frames = opts.frames ?? [];
  const child = spawn(opts.agent[0], opts.agent.slice(1), {
    cwd: opts.cwd,
    env: process.env,
    stdio: ["pipe", "pipe", "pipe"],
  });
  let stderr = "";
  child.stderr.on("data", (d) => (stderr += d.toString()));
  let exitInfo = null;
  const exited = new Promise((res) =>
    child.on("exit", (code, signal) => res((exitInfo = { code, signal, at: Date.now() }))),
  );
  const waiters = new Set();
  const poke = () => {
    for (const w of waiters) {
      let ok = false;
      try {
        ok = w.predicate();
      } catch {
        ok = false;
      }
      if (ok) {
        waiters.delete(w);
        w.resolve();
      }
    }
  };
  const toAgent = tap("c2a", frames, poke);
  toAgent.readable.pipeTo(Writable.toWeb(child.stdin)).catch(() => {});
  const fromAgent = Readable.toWeb(child.stdout).pipeThrough(tap("a2c", frames, poke));
  const stream = acp.ndJsonStream(toAgent.writable, fromAgent);

  const h = {
    frames,
    child,
    buffers: new Map(),
    permission: () => ({ outcome: { outcome: "selected", optionId: "allow" } }),
    terminals: new Map(),
    get stderr() {
      return stderr;
    },
    updates(sessionId) {
      return frames
        .filter((f) => f.dir === "a2c" && f.msg?.method === "session/update" && f.msg.params.sessionId === sessionId)
        .map((f) => f.msg.params.update);
    },
    calls(method) {
      return frames.filter((f) => f.dir === "a2c" && f.msg?.method === method).map((f) => f.msg.params);
    },
    waitFor(predicate, label, ms = WAIT_MS) {
      if (predicate()) return Promise.resolve();
      return withTimeout(
        new Promise((resolve) => waiters.add({ predicate, resolve })),
        ms,
        label,
      );
    },
    request(method, params, label = method, ms = WAIT_MS) {
      return withTimeout(h.agent.request(method, params), ms, label);
    },
  };

  let nextTerminal = 0;
  const terminal = (id) => {
    const t = h.terminals.get(id);
    if (!t) throw acp.RequestError.resourceNotFound(id);
    return t;
  };
  const app = acp
    .client({ name: "caliban-acp-tests" })
    .onNotification(acp.methods.client.session.update, () => {})
    .onRequest(acp.methods.client.session.requestPermission, async ({ params, signal }) => h.permission(params, signal))
    .onRequest(acp.methods.client.fs.readTextFile, async ({ params }) => {
      const text = h.buffers.has(params.path) ? h.buffers.get(params.path) : await fs.readFile(params.path, "utf8");
      if (params.line == null && params.limit == null) return { content: text };
      const lines = text.split("\n");
      const start = Math.max((params.line ?? 1) - 1, 0);
      const end = params.limit == null ? lines.length : start + params.limit;
      return { content: lines.slice(start, end).join("\n") };
    })
    .onRequest(acp.methods.client.fs.writeTextFile, async ({ params }) => {
      await fs.mkdir(path.dirname(params.path), { recursive: true });
      await fs.writeFile(params.path, params.content, "utf8");
      h.buffers.delete(params.path);
      return {};
    })
    .onRequest(acp.methods.client.terminal.create, ({ params }) => {
      const env = { ...process.env };
      for (const { name, value } of params.env ?? []) env[name] = value;
      const p = spawn(params.command, params.args ?? [], {
        cwd: params.cwd ?? opts.cwd,
        env,
        detached: true,
        stdio: ["ignore", "pipe", "pipe"],
      });
      const t = { p, output: "", truncated: false, exit: null, limit: params.outputByteLimit ?? null, killed: false };
      t.kill = (sig) => {
        try {
          process.kill(-p.pid, sig);
        } catch {
          // already gone
        }
      };
      t.done = new Promise((res) => p.on("close", (exitCode, signal) => res((t.exit = { exitCode, signal }))));
      p.on("error", (e) => {
        t.output += String(e);
        t.exit ??= { exitCode: 127, signal: null };
      });
      const onData = (d) => {
        t.output += d.toString("utf8");
        if (t.limit != null && Buffer.byteLength(t.output) > t.limit) {
          const b = Buffer.from(t.output);
          let cut = b.length - t.limit;
          while (cut < b.length && (b[cut] & 0xc0) === 0x80) cut++;
          t.output = b.subarray(cut).toString("utf8");
          t.truncated = true;
        }
      };
      p.stdout.on("data", onData);
      p.stderr.on("data", onData);
      const terminalId = `term_${++nextTerminal}`;
      h.terminals.set(terminalId, t);
      return { terminalId };
    })
    .onRequest(acp.methods.client.terminal.output, ({ params }) => {
      const t = terminal(params.terminalId);
      return { output: t.output, truncated: t.truncated, exitStatus: t.exit };
    })
    .onRequest(acp.methods.client.terminal.waitForExit, async ({ params }) => terminal(params.terminalId).done)
    .onRequest(acp.methods.client.terminal.kill, ({ params }) => {
      const t = terminal(params.terminalId);
      t.killed = true;
      t.kill("SIGKILL");
      return {};
    })
    .onRequest(acp.methods.client.terminal.release, ({ params }) => {
      const t = terminal(params.terminalId);
      if (!t.exit) t.kill("SIGKILL");
      t.released = true;
      return {};
    });

  let result;
  try {
    result = await app.connectWith(stream, async (agent) => {
      h.agent = agent;
      return body(h);
    });
  } catch (e) {
    e.message += `\n--- agent stderr\n${stderr}`;
    throw e;
  } finally {
    const eofAt = Date.now();
    child.stdin.end();
    try {
      await withTimeout(exited, 5_000, "the agent exiting after stdin EOF");
    } catch (e) {
      child.kill("SIGKILL");
      throw e;
    }
    h.exitAfterEofMs = exitInfo.at - eofAt;
    for (const t of h.terminals.values()) t.kill("SIGKILL");
  }
  return { result, exit: exitInfo, exitAfterEofMs: h.exitAfterEofMs, stderr };
}

/** initialize + session/new, with the given client capabilities. */
export async function openSession(h, cwd, clientCapabilities = {}) {
  const init = await h.request(acp.methods.agent.initialize, {
    protocolVersion: acp.PROTOCOL_VERSION,
    clientCapabilities,
    clientInfo: { name: "caliban-acp-tests", title: "caliban ACP tests", version: "0.1.0" },
  });
  const session = await h.request(acp.methods.agent.session.new, { cwd, mcpServers: [] });
  return { init, session, sessionId: session.sessionId };
}

/** Sends a prompt; resolves with its answer (the stop reason). */
export function prompt(h, sessionId, text, ms = WAIT_MS) {
  return h.request(
    acp.methods.agent.session.prompt,
    { sessionId, prompt: [{ type: "text", text }] },
    `session/prompt "${text}"`,
    ms,
  );
}

export { acp };
