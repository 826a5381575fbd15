#!/usr/bin/env node
// ACP over the network: the official ACP TypeScript SDK as the client of `caliban agent
// serve --listen`, on a TLS stream (Node's `tls`, trusting only the test's CA and checking
// the host name) after the bearer preamble. Prints one JSON line like driver.mjs:
// {"ok": bool, "result": …, "problems": [schema and protocol problems], "error": "…"?}
//
// Usage: node net.mjs '<json>' with
//   host, port   where the agent listens
//   ca           the CA certificate (PEM path) to trust
//   servername   the name to check the certificate against
//   token        the bearer token
//   cwd          the session directory (absolute)
//   answers      permission answers in order (optionIds), as in driver.mjs
//
// Scenario: initialize, session/new, a streamed prompt, a permission allowed and one
// rejected, a prompt cancelled while its Bash runs; then the connection closes, a new one
// (same token) initializes, loads the session (its history is replayed) and prompts again.
// Every wait has a deadline.

import { readFileSync } from "node:fs";
import { Readable, Writable } from "node:stream";
import tls from "node:tls";
import { acp, sleep, tap, validate, withTimeout, WAIT_MS } from "./harness.mjs";

const args = JSON.parse(process.argv[2] ?? "{}");

/** Opens a TLS connection, sends the preamble and resolves with the socket. */
async function connect() {
  const socket = tls.connect({
    host: args.host,
    port: args.port,
    ca: readFileSync(args.ca),
    servername: args.servername,
  });
  await withTimeout(
    new Promise((resolve, reject) => {
      socket.once("secureConnect", resolve);
      socket.once("error", reject);
    }),
    WAIT_MS,
    "the TLS handshake",
  );
  socket.write(JSON.stringify({ bearer: args.token }) + "\n");
  return socket;
}

/**
 * Runs `body(h)` on one ACP connection over TLS, then closes it. `h` offers `request`,
 * `notify`, `updates(sessionId)`, `calls(method)`, `waitFor(predicate, label)` and the
 * frames of this connection.
 */
async function withConnection(answers, body) {
  const frames = [];
  const socket = await connect();
  const waiters = new Set();
  const poke = () => {
    for (const w of waiters) {
      if (w.predicate()) {
        waiters.delete(w);
        w.resolve();
      }
    }
  };
  const toAgent = tap("c2a", frames, poke);
  toAgent.readable.pipeTo(Writable.toWeb(socket)).catch(() => {});
  const fromAgent = Readable.toWeb(socket).pipeThrough(tap("a2c", frames, poke));
  const stream = acp.ndJsonStream(toAgent.writable, fromAgent);
  const queue = [...answers];
  const h = {
    frames,
    updates: (sessionId) =>
      frames
        .filter((f) => f.dir === "a2c" && f.msg?.method === "session/update" && f.msg.params.sessionId === sessionId)
        .map((f) => f.msg.params.update),
    calls: (method) => frames.filter((f) => f.dir === "a2c" && f.msg?.method === method).map((f) => f.msg.params),
    waitFor(predicate, label, ms = WAIT_MS) {
      if (predicate()) return Promise.resolve();
      return withTimeout(new Promise((resolve) => waiters.add({ predicate, resolve })), ms, label);
    },
    request: (method, params, label = method) => withTimeout(h.agent.request(method, params), WAIT_MS, label),
    prompt: (sessionId, text) =>
      h.request(acp.methods.agent.session.prompt, { sessionId, prompt: [{ type: "text", text }] }, `prompt "${text}"`),
  };
  const app = acp
    .client({ name: "caliban-net-tests" })
    .onNotification(acp.methods.client.session.update, () => {})
    .onRequest(acp.methods.client.session.requestPermission, async () => ({
      outcome: { outcome: "selected", optionId: queue.length ? queue.shift() : "allow" },
    }));
  try {
    return { result: await app.connectWith(stream, async (agent) => body(Object.assign(h, { agent }))), frames };
  } finally {
    socket.end();
    socket.destroy();
  }
}

async function scenario() {
  const cwd = args.cwd;
  const first = await withConnection(args.answers ?? [], async (h) => {
    const init = await h.request(acp.methods.agent.initialize, {
      protocolVersion: acp.PROTOCOL_VERSION,
      clientCapabilities: {},
    });
    const { sessionId } = await h.request(acp.methods.agent.session.new, { cwd, mcpServers: [] });
    const stops = [];
    for (const text of ["hello", "run the allowed command", "run the rejected command"]) {
      stops.push(await h.prompt(sessionId, text));
    }
    // The fourth prompt's Bash runs `sleep`; cancel it once it is running.
    const sleeping = h.prompt(sessionId, "sleep");
    await h.waitFor(
      () => h.updates(sessionId).some((u) => u.sessionUpdate === "tool_call_update" && u.status === "in_progress" && u.toolCallId === "toolu_sleep"),
      "the sleep running",
    );
    await sleep(300);
    await h.agent.notify(acp.methods.agent.session.cancel, { sessionId });
    stops.push(await withTimeout(sleeping, WAIT_MS, "the cancelled prompt's answer"));
    return {
      init,
      sessionId,
      stops,
      updates: h.updates(sessionId),
      permissions: h.calls("session/request_permission"),
    };
  });
  const sessionId = first.result.sessionId;
  const second = await withConnection([], async (h) => {
    await h.request(acp.methods.agent.initialize, { protocolVersion: acp.PROTOCOL_VERSION, clientCapabilities: {} });
    const loaded = await h.request(acp.methods.agent.session.load, { sessionId, cwd, mcpServers: [] });
    const replay = h.updates(sessionId);
    const stop = await h.prompt(sessionId, "after the reconnect");
    return { loaded, replay, stop, updates: h.updates(sessionId).slice(replay.length) };
  });
  return {
    result: { first: first.result, second: second.result },
    problems: [...validate(first.frames), ...validate(second.frames)],
    frames: first.frames.length + second.frames.length,
  };
}

let out;
try {
  out = { ok: true, ...(await scenario()) };
} catch (e) {
  out = { ok: false, error: String(e?.stack ?? e), problems: [] };
}
process.stdout.write(JSON.stringify(out) + "\n");
process.exit(out.ok ? 0 : 1);
