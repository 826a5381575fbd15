// Drives `caliban mcp serve` with the official MCP TypeScript SDK client
// (@modelcontextprotocol/sdk), one scenario per process. tests/mcp.rs installs the SDK
// under target/, copies this file next to it and runs
//
//     node client.mjs SCENARIO CONFIG_JSON
//
// CONFIG_JSON: {"bin": caliban, "ws": workspace, "env": {…}, "args": [extra serve args]}.
// Assertions fail the process (exit 1, reason on stderr); on success the last stdout line
// is `RESULT <json>` with what the Rust side double-checks. Every request has a timeout
// and the whole scenario has a watchdog.

import assert from "node:assert/strict";
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StdioClientTransport } from "@modelcontextprotocol/sdk/client/stdio.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";
import {
  ElicitRequestSchema,
  EmptyResultSchema,
  LoggingMessageNotificationSchema,
  McpError,
} from "@modelcontextprotocol/sdk/types.js";

const REQUEST_TIMEOUT = 20_000;
const WATCHDOG = 75_000;

const [scenario, rawConfig] = process.argv.slice(2);
const config = JSON.parse(rawConfig ?? "{}");

setTimeout(() => {
  console.error(`watchdog: scenario ${scenario} still running after ${WATCHDOG} ms`);
  process.exit(3);
}, WATCHDOG).unref();

// ---- helpers --------------------------------------------------------------------------

function newClient(name, { elicitation = null } = {}) {
  const capabilities = elicitation ? { elicitation: {} } : {};
  const client = new Client({ name, version: "1.0.0" }, { capabilities });
  const logs = [];
  client.setNotificationHandler(LoggingMessageNotificationSchema, (n) => {
    logs.push(n.params);
  });
  if (elicitation) {
    client.setRequestHandler(ElicitRequestSchema, elicitation);
  }
  return { client, logs };
}

/** Spawns `caliban mcp serve` over stdio; resolves the connected client. */
async function stdioClient(name, opts = {}) {
  const { client, logs } = newClient(name, opts);
  const transport = new StdioClientTransport({
    command: config.bin,
    args: ["mcp", "serve", "-C", config.ws, ...(config.args ?? []), ...(opts.args ?? [])],
    env: config.env,
    cwd: config.ws,
    stderr: "pipe",
  });
  const stderr = [];
  transport.stderr?.on("data", (chunk) => stderr.push(chunk.toString()));
  await client.connect(transport, { timeout: REQUEST_TIMEOUT });
  return { client, logs, transport, stderr };
}

/** Waits for the `listening on URL` line a `--listen` server writes on stderr. */
async function listenUrl(stderr) {
  const deadline = Date.now() + 10_000;
  while (Date.now() < deadline) {
    const m = stderr.join("").match(/caliban mcp serve listening on (\S+)/);
    if (m) return m[1];
    await sleep(20);
  }
  throw new Error(`no listening line on stderr: ${stderr.join("")}`);
}

async function httpClient(name, url, opts = {}) {
  const { client, logs } = newClient(name, opts);
  const transport = new StreamableHTTPClientTransport(new URL(url));
  await client.connect(transport, { timeout: REQUEST_TIMEOUT });
  return { client, logs, transport };
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

/** Calls a tool; returns {result, body} where body is the parsed text block. */
async function call(client, name, args, options = {}) {
  const result = await client.callTool({ name, arguments: args }, undefined, {
    timeout: REQUEST_TIMEOUT,
    ...options,
  });
  assert.equal(result.content.length, 1, `one content block: ${JSON.stringify(result)}`);
  assert.equal(result.content[0].type, "text");
  const text = result.content[0].text;
  if (result.isError) {
    assert.equal(result.structuredContent, undefined);
    return { result, error: text };
  }
  assert.equal(result.isError, false);
  const body = JSON.parse(text);
  // structuredContent mirrors the JSON body exactly.
  assert.deepEqual(result.structuredContent, body);
  return { result, body, text };
}

async function ok(client, name, args, options) {
  const r = await call(client, name, args, options);
  assert.equal(r.error, undefined, `${name} failed: ${r.error}`);
  return r.body;
}

/** Long-polls a run until `until(pollBody, allEvents)` holds; returns the events. */
async function pollUntil(client, runId, until, { cursor = 0, waitMs = 10_000, maxPolls = 50 } = {}) {
  const events = [];
  let polls = 0;
  for (;;) {
    assert.ok(polls < maxPolls, `no progress after ${polls} polls of ${runId}`);
    polls += 1;
    const body = await ok(client, "caliban_poll", { run_id: runId, cursor, wait_ms: waitMs });
    for (const env of body.events) {
      assert.equal(env.v, 1);
      events.push(env.event);
    }
    assert.equal(body.next_cursor, cursor + body.events.length);
    cursor = body.next_cursor;
    if (until(body, events)) return { body, events, cursor, polls };
  }
}

const terminal = (body) => ["done", "failed"].includes(body.status.state);

async function expectRpcError(promise, code, message) {
  try {
    await promise;
  } catch (e) {
    assert.ok(e instanceof McpError, `expected McpError, got ${e}`);
    assert.equal(e.code, code, e.message);
    if (message) assert.ok(e.message.includes(message), `${e.message} lacks ${message}`);
    return e;
  }
  assert.fail(`expected JSON-RPC error ${code}`);
}

function textOf(events) {
  return events
    .filter((e) => e.type === "AssistantTextDelta")
    .map((e) => e.text)
    .join("");
}

// ---- scenarios ------------------------------------------------------------------------

const scenarios = {
  /** initialize, tools/list, ping, logging/setLevel and the error paths. */
  async basics() {
    const { client } = await stdioClient("basics");
    const info = client.getServerVersion();
    assert.equal(info.name, "caliban");
    assert.ok(info.version, "a version");
    assert.ok(client.getInstructions().includes("caliban_poll"));
    const caps = client.getServerCapabilities();
    assert.ok(caps.tools && caps.logging, JSON.stringify(caps));

    const { tools } = await client.listTools(undefined, { timeout: REQUEST_TIMEOUT });
    const names = tools.map((t) => t.name);
    assert.deepEqual(names, [
      "caliban_cancel",
      "caliban_permit",
      "caliban_poll",
      "caliban_run",
      "caliban_send_input",
      "caliban_status",
    ]);
    const run = tools.find((t) => t.name === "caliban_run");
    assert.equal(run.description, "Start an agent run from a prompt; returns a run_id to poll.");
    assert.deepEqual(run.inputSchema.required, ["prompt"]);
    for (const t of tools) assert.equal(t.outputSchema?.type, "object", t.name);

    assert.deepEqual(await client.ping({ timeout: REQUEST_TIMEOUT }), {});
    assert.deepEqual(await client.setLoggingLevel("info"), {});

    await expectRpcError(
      client.request({ method: "no/such/method", params: {} }, EmptyResultSchema),
      -32601,
    );
    await expectRpcError(
      client.setLoggingLevel("chatty"),
      -32602,
      "invalid log level",
    );
    await expectRpcError(
      client.callTool({ name: "caliban_nope", arguments: {} }),
      -32602,
      "tool not found",
    );
    await expectRpcError(
      client.callTool({ name: "caliban_run", arguments: { interactive: true } }),
      -32602,
      "failed to deserialize parameters: missing field `prompt`",
    );
    const unknown = await call(client, "caliban_poll", { run_id: "run-999" });
    assert.equal(unknown.result.isError, true);
    assert.equal(unknown.error, "unknown run_id: run-999");
    const neither = await call(client, "caliban_send_input", { run_id: "run-999" });
    assert.equal(neither.error, "send_input requires `text` or `end: true`");
    await client.close();
    return { names, serverVersion: info.version };
  },

  /** A non-interactive run, long-polled to completion, with log messages. */
  async run_to_completion() {
    const { client, logs } = await stdioClient("runner");
    await client.setLoggingLevel("info");
    const started = await ok(client, "caliban_run", { prompt: "say hello" });
    assert.match(started.run_id, /^run-\d+$/);
    const { body, events, polls } = await pollUntil(client, started.run_id, terminal);
    assert.deepEqual(body.status, { state: "done" });
    assert.equal(body.permission_request, null);
    assert.equal(events.at(-1).type, "RunEnd");
    assert.equal(events.at(-1).stopped_for, "EndOfTurn");
    assert.equal(events[0].type, "TurnStart");
    // Long-polling: a handful of calls, not a busy loop.
    assert.ok(polls <= 20, `${polls} polls`);
    const status = await ok(client, "caliban_status", { run_id: started.run_id });
    assert.deepEqual(status, { status: { state: "done" } });
    // A poll past the end answers at once with nothing new.
    const again = await ok(client, "caliban_poll", {
      run_id: started.run_id,
      cursor: events.length,
      wait_ms: 5000,
    });
    assert.deepEqual(again.events, []);
    assert.equal(again.next_cursor, events.length);
    await sleep(50);
    assert.ok(
      logs.some((l) => String(l.data).includes(`${started.run_id} is done`)),
      JSON.stringify(logs),
    );
    await client.close();
    return { run_id: started.run_id, text: textOf(events), polls, events: events.length };
  },

  /** Interactive input, a wait that times out with progress, end of input. */
  async interactive() {
    const { client } = await stdioClient("interactive");
    const { run_id } = await ok(client, "caliban_run", { prompt: "first", interactive: true });
    const first = await pollUntil(client, run_id, (b) => b.status.state === "awaiting_input");
    assert.ok(textOf(first.events).includes("first answer"), textOf(first.events));

    // Nothing will happen until we send input: the wait runs to its end, with progress.
    const progress = [];
    const t0 = Date.now();
    const idle = await ok(
      client,
      "caliban_poll",
      { run_id, cursor: first.cursor, wait_ms: 1500 },
      { onprogress: (p) => progress.push(p) },
    );
    const waited = Date.now() - t0;
    assert.deepEqual(idle.events, []);
    assert.equal(idle.status.state, "awaiting_input");
    assert.ok(waited >= 1300, `returned after ${waited} ms`);
    assert.ok(progress.length >= 1, "a progress notification while waiting");
    for (let i = 1; i < progress.length; i++) {
      assert.ok(progress[i].progress > progress[i - 1].progress);
    }
    assert.equal(progress[0].total, 1500);

    assert.deepEqual(await ok(client, "caliban_send_input", { run_id, text: "more please" }), {
      ok: true,
    });
    const second = await pollUntil(client, run_id, (b) => b.status.state === "awaiting_input", {
      cursor: first.cursor,
    });
    assert.ok(textOf(second.events).includes("second answer"), textOf(second.events));

    assert.deepEqual(await ok(client, "caliban_send_input", { run_id, end: true }), { ok: true });
    const end = await pollUntil(client, run_id, terminal, { cursor: second.cursor });
    assert.equal(end.body.status.state, "done");
    assert.equal(end.events.at(-1).type, "RunEnd");

    const late = await call(client, "caliban_send_input", { run_id, text: "too late" });
    assert.equal(late.error, "cannot send input: drive session has ended; it accepts no further input");
    const neither = await call(client, "caliban_send_input", { run_id });
    assert.equal(neither.error, "send_input requires `text` or `end: true`");
    await client.close();
    return { run_id, progress: progress.length, waited };
  },

  /** A permission prompt surfaced by caliban_poll and answered by caliban_permit. */
  async permit() {
    const { client } = await stdioClient("permit");
    const { run_id } = await ok(client, "caliban_run", { prompt: "write a file" });
    const asked = await pollUntil(client, run_id, (b) => b.permission_request !== null);
    const prompt = asked.body.permission_request;
    assert.equal(prompt.tool_name, "Bash");
    assert.equal(prompt.tool_use_id, "toolu_perm");
    assert.equal(prompt.input.command, "echo permitted > permitted.txt");
    assert.equal(asked.body.status.state, "running");

    const wrong = await call(client, "caliban_permit", {
      run_id,
      tool_use_id: "toolu_other",
      allow: true,
    });
    assert.equal(
      wrong.error,
      "no pending permission with tool_use_id toolu_other; current prompt is toolu_perm",
    );
    assert.deepEqual(
      await ok(client, "caliban_permit", { run_id, tool_use_id: "toolu_perm", allow: true }),
      { ok: true },
    );
    const done = await pollUntil(client, run_id, terminal, { cursor: asked.cursor });
    const end = done.events.find((e) => e.type === "ToolCallEnd");
    assert.ok(end && !end.is_error, JSON.stringify(done.events));
    assert.equal(done.body.permission_request, null);
    const again = await call(client, "caliban_permit", {
      run_id,
      tool_use_id: "toolu_perm",
      allow: true,
    });
    assert.equal(again.error, "no pending permission request for this run");
    await client.close();
    return { run_id };
  },

  /** Prompts asked through elicitation/create: one accepted, one declined. */
  async elicitation() {
    const asked = [];
    const answers = ["accept", "decline"];
    const { client } = await stdioClient("elicit", {
      elicitation: async (request) => {
        asked.push(request.params);
        const action = answers[asked.length - 1] ?? "cancel";
        return action === "accept" ? { action, content: { allow: true } } : { action };
      },
    });
    const first = await ok(client, "caliban_run", { prompt: "make a file" });
    const a = await pollUntil(client, first.run_id, terminal);
    assert.equal(asked.length, 1);
    assert.equal(asked[0].mode, "form");
    assert.ok(asked[0].message.includes("Bash"), asked[0].message);
    assert.ok(asked[0].message.includes("echo elicited > elicited.txt"), asked[0].message);
    assert.equal(asked[0].requestedSchema.properties.allow.type, "boolean");
    const okEnd = a.events.find((e) => e.type === "ToolCallEnd");
    assert.ok(okEnd && !okEnd.is_error, JSON.stringify(okEnd));

    const second = await ok(client, "caliban_run", { prompt: "make another" });
    const b = await pollUntil(client, second.run_id, terminal);
    assert.equal(asked.length, 2);
    const denied = b.events.find((e) => e.type === "ToolCallEnd");
    assert.ok(denied && denied.is_error, JSON.stringify(denied));
    assert.ok(JSON.stringify(denied).includes("denied by client"), JSON.stringify(denied));
    await client.close();
    return { asked: asked.length };
  },

  /** caliban_cancel stops a run whose tool is still running. */
  async cancel() {
    const { client } = await stdioClient("cancel");
    const { run_id } = await ok(client, "caliban_run", { prompt: "sleep" });
    const running = await pollUntil(client, run_id, (_b, ev) =>
      ev.some((e) => e.type === "ToolCallEnd" || e.type === "ToolCallStart" || e.type === "ToolCallInputDelta"),
    );
    await sleep(300); // let the shell start
    const t0 = Date.now();
    assert.deepEqual(await ok(client, "caliban_cancel", { run_id }), { ok: true });
    const done = await pollUntil(client, run_id, terminal, { cursor: running.cursor });
    const elapsed = Date.now() - t0;
    assert.equal(done.body.status.state, "done");
    assert.equal(done.events.at(-1).stopped_for, "Cancelled");
    assert.ok(elapsed < 10_000, `cancel took ${elapsed} ms`);
    const bad = await call(client, "caliban_cancel", { run_id: "run-424242" });
    assert.equal(bad.error, "unknown run_id: run-424242");
    await client.close();
    return { run_id, elapsed };
  },

  /** notifications/cancelled for a waiting caliban_poll stops the run it waits on. */
  async abort() {
    const { client } = await stdioClient("abort");
    const { run_id } = await ok(client, "caliban_run", { prompt: "sleep" });
    const running = await pollUntil(client, run_id, (_b, ev) =>
      ev.some((e) => e.type === "ToolCallInputDelta" || e.type === "ToolCallStart"),
    );
    await sleep(300);
    const controller = new AbortController();
    const pending = client.callTool(
      { name: "caliban_poll", arguments: { run_id, cursor: 1_000_000, wait_ms: 20_000 } },
      undefined,
      { signal: controller.signal, timeout: REQUEST_TIMEOUT },
    );
    await sleep(300);
    controller.abort("user pressed stop");
    await assert.rejects(pending);
    const done = await pollUntil(client, run_id, terminal, { cursor: running.cursor });
    assert.equal(done.events.at(-1).stopped_for, "Cancelled");
    // The server is still fine.
    assert.deepEqual(await client.ping({ timeout: REQUEST_TIMEOUT }), {});
    await client.close();
    return { run_id };
  },

  /**
   * One server, three clients: the stdio peer and two Streamable HTTP sessions share one
   * drive core; replies, progress and elicitations go to the right one.
   */
  async shared() {
    const unexpected = async (request) => {
      throw new Error(`elicitation sent to the wrong client: ${JSON.stringify(request)}`);
    };
    const stdio = await stdioClient("stdio-peer", {
      args: ["--listen", "127.0.0.1:0"],
      elicitation: unexpected,
    });
    const url = await listenUrl(stdio.stderr);
    assert.match(url, /^http:\/\/127\.0\.0\.1:\d+\/mcp$/);

    const asked = [];
    const a = await httpClient("http-a", url, {
      elicitation: async (request) => {
        asked.push(request.params);
        return { action: "accept", content: { allow: true } };
      },
    });
    const b = await httpClient("http-b", url, { elicitation: unexpected });
    assert.notEqual(a.transport.sessionId, b.transport.sessionId);
    assert.equal(a.client.getServerVersion().name, "caliban");

    const { tools } = await b.client.listTools();
    assert.equal(tools.length, 6);

    // Session A starts a run; its permission prompt is elicited from A only (over A's
    // GET stream or its waiting poll), while B and the stdio peer can watch the same run.
    const { run_id } = await ok(a.client, "caliban_run", { prompt: "over http" });
    const progress = [];
    const seenByA = await pollUntil(a.client, run_id, terminal, { waitMs: 5000 });
    assert.equal(asked.length, 1, JSON.stringify(asked));
    assert.ok(asked[0].message.includes("echo shared > shared.txt"));
    const seenByB = await pollUntil(b.client, run_id, terminal, { waitMs: 100 });
    const seenByStdio = await pollUntil(stdio.client, run_id, terminal, { waitMs: 100 });
    assert.deepEqual(seenByB.events, seenByA.events);
    assert.deepEqual(seenByStdio.events, seenByA.events);

    // Interleaved long-polls on two sessions each get their own answer: A waits for news
    // of B's interactive run while B's own wait runs out (with progress on its stream).
    const second = await ok(b.client, "caliban_run", { prompt: "second", interactive: true });
    const idle = await pollUntil(b.client, second.run_id, (x) => x.status.state === "awaiting_input");
    const pa = ok(a.client, "caliban_poll", {
      run_id: second.run_id,
      cursor: idle.cursor,
      wait_ms: 15_000,
    });
    const pb = await ok(
      b.client,
      "caliban_poll",
      { run_id: second.run_id, cursor: idle.cursor, wait_ms: 1200 },
      { onprogress: (p) => progress.push(p) },
    );
    assert.deepEqual(pb.events, []);
    assert.equal(pb.status.state, "awaiting_input");
    assert.ok(progress.length >= 1, "progress over the HTTP SSE stream");
    await ok(b.client, "caliban_send_input", { run_id: second.run_id, text: "again" });
    const news = await pa;
    assert.ok(news.events.length > 0 || news.status.state !== "awaiting_input", JSON.stringify(news));
    await ok(b.client, "caliban_send_input", { run_id: second.run_id, end: true });
    const last = await pollUntil(b.client, second.run_id, terminal, { cursor: idle.cursor });
    assert.ok(textOf(last.events).includes("third"), textOf(last.events));

    // Ending session B leaves A and the stdio peer working.
    await b.transport.terminateSession();
    await b.client.close();
    assert.deepEqual(await a.client.ping(), {});
    assert.deepEqual(await stdio.client.ping(), {});
    await a.client.close();
    await stdio.client.close();
    return { url, run_id, asked: asked.length, progress: progress.length };
  },
};

// ---- main -----------------------------------------------------------------------------

const fn = scenarios[scenario];
if (!fn) {
  console.error(`unknown scenario ${scenario}; known: ${Object.keys(scenarios).join(", ")}`);
  process.exit(2);
}
try {
  const result = await fn();
  console.log(`RESULT ${JSON.stringify(result ?? {})}`);
  process.exit(0);
} catch (e) {
  console.error(`scenario ${scenario} failed:`, e?.stack ?? e);
  process.exit(1);
}
