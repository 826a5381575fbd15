#!/usr/bin/env node
// Runs one ACP scenario against `caliban acp serve` and prints one JSON line:
// {"ok": bool, "result": …, "problems": [schema and protocol problems], "error": "…"?}
//
// Usage: node driver.mjs '<json>' where the JSON holds
//   scenario  the name of a scenario below
//   agent     the agent command line, e.g. ["/path/caliban", "acp", "serve"]
//   cwd       the session directory (absolute; the agent is spawned there)
//   …         the scenario's own parameters
//
// Scenarios collect what happened; tests/acp.rs asserts on it.

import { acp, openSession, prompt, sleep, validate, withAgent, withTimeout, WAIT_MS } from "./harness.mjs";

const args = JSON.parse(process.argv[2] ?? "{}");
const frames = [];
const opts = { agent: args.agent, cwd: args.cwd, frames };

/** Answers permission prompts from a list: an optionId, "cancelled", "error" (the handler
 * throws, so the SDK answers with a JSON-RPC error) or "never". */
function answering(h, answers) {
  const queue = [...(answers ?? [])];
  h.permission = (params, signal) => {
    const answer = queue.length ? queue.shift() : "allow";
    if (answer === "never") {
      // Unanswered: the agent's own deadline decides; it withdraws with $/cancel_request.
      return new Promise((res) => signal.addEventListener("abort", () => res({ outcome: { outcome: "cancelled" } })));
    }
    if (answer === "cancelled") return { outcome: { outcome: "cancelled" } };
    if (answer === "error") throw new Error("this client cannot show permission prompts");
    return { outcome: { outcome: "selected", optionId: answer } };
  };
}

/** A prompt given as text, or as content blocks (an array); a refused block-array prompt
 * resolves with `{error: {code, message}}` so a scenario can go on. */
async function sendPrompt(h, sessionId, p) {
  if (typeof p === "string") return prompt(h, sessionId, p);
  try {
    return await h.request(acp.methods.agent.session.prompt, { sessionId, prompt: p }, "session/prompt (blocks)", WAIT_MS);
  } catch (e) {
    return { error: { code: e.code, message: e.message } };
  }
}

/** Index of the frame answering client request `id` (by position in `frames`). */
function answerIndex(id) {
  return frames.findIndex((f) => f.dir === "a2c" && f.msg && !f.msg.method && f.msg.id === id);
}

function lastRequestId(method) {
  for (let i = frames.length - 1; i >= 0; i--) {
    const f = frames[i];
    if (f.dir === "c2a" && f.msg?.method === method) return f.msg.id;
  }
  return undefined;
}

const scenarios = {
  /** initialize, authenticate, session/new, then each of `prompts` in turn. */
  async prompts() {
    return withAgent(opts, async (h) => {
      answering(h, args.answers);
      for (const [file, text] of Object.entries(args.buffers ?? {})) h.buffers.set(file, text);
      const { init, session, sessionId } = await openSession(h, args.cwd, args.caps ?? {});
      const auth = await h.request(acp.methods.agent.authenticate, { methodId: "none" });
      let mode;
      if (args.mode) mode = await h.request(acp.methods.agent.session.setMode, { sessionId, modeId: args.mode });
      let config;
      if (args.configMode) {
        config = await h.request(acp.methods.agent.session.setConfigOption, {
          sessionId,
          configId: "mode",
          value: args.configMode,
        });
      }
      let sandbox;
      if (args.configSandbox) {
        sandbox = await h
          .request(acp.methods.agent.session.setConfigOption, {
            sessionId,
            configId: "sandbox",
            value: args.configSandbox,
          })
          .catch((e) => ({ error: String(e?.message ?? e) }));
      }
      const stops = [];
      for (const p of args.prompts ?? ["hello"]) stops.push(await sendPrompt(h, sessionId, p));
      // Terminals are released after the tool result; let that finish before closing.
      await h.waitFor(
        () => h.calls("terminal/create").length === h.calls("terminal/release").length,
        "every terminal released",
      );
      return {
        init,
        session,
        auth,
        mode,
        config,
        sandbox,
        sessionId,
        stops,
        updates: h.updates(sessionId),
        permissions: h.calls("session/request_permission"),
        withdrawn: h.calls("$/cancel_request"),
        fs: frames
          .filter((f) => f.dir === "a2c" && f.msg?.method?.startsWith("fs/"))
          .map((f) => ({ method: f.msg.method, params: f.msg.params })),
        terminal: frames
          .filter((f) => f.dir === "a2c" && f.msg?.method?.startsWith("terminal/"))
          .map((f) => ({ method: f.msg.method, params: f.msg.params })),
      };
    });
  },

  /** A prompt cancelled on its first `cancelOn` update, then a second prompt. */
  async cancel() {
    return withAgent(opts, async (h) => {
      answering(h, args.answers);
      const { sessionId } = await openSession(h, args.cwd, args.caps ?? {});
      const isTrigger = (u) => {
        const t = args.cancelOn ?? "agent_message_chunk";
        if (t === "running") return u.sessionUpdate === "tool_call_update" && u.status === "in_progress";
        if (t === "terminal") return u.sessionUpdate === "tool_call_update" && u.content?.some((c) => c.type === "terminal");
        return u.sessionUpdate === t;
      };
      const first = prompt(h, sessionId, args.prompts?.[0] ?? "first");
      const triggered = () =>
        args.cancelOn === "permission"
          ? h.calls("session/request_permission").length > 0
          : h.updates(sessionId).some(isTrigger);
      await h.waitFor(triggered, `something to cancel on (${args.cancelOn})`);
      await sleep(args.cancelDelayMs ?? 0);
      const cancelAt = Date.now();
      const updatesBeforeCancel = h.updates(sessionId).length;
      await h.agent.notify(acp.methods.agent.session.cancel, { sessionId });
      const stop = await withTimeout(first, WAIT_MS, "the cancelled prompt's answer");
      const cancelMs = Date.now() - cancelAt;
      const promptId = lastRequestId("session/prompt");
      const answeredAt = answerIndex(promptId);
      const updatesAtAnswer = h.updates(sessionId).length;
      // Anything the cancelled turn still had would show up now.
      await sleep(300);
      const updatesAfterAnswer = h.updates(sessionId).slice(updatesAtAnswer);
      await h.waitFor(
        () => h.calls("terminal/create").length === h.calls("terminal/release").length,
        "every terminal released",
      );
      const secondFrom = h.updates(sessionId).length;
      const second = await prompt(h, sessionId, args.prompts?.[1] ?? "second");
      return {
        sessionId,
        stop,
        cancelMs,
        updatesBeforeCancel,
        cancelled: h.updates(sessionId).slice(0, updatesAtAnswer),
        updatesAfterAnswer,
        answeredAt,
        second,
        secondUpdates: h.updates(sessionId).slice(secondFrom),
        permissions: h.calls("session/request_permission"),
        terminal: frames
          .filter((f) => f.dir === "a2c" && f.msg?.method?.startsWith("terminal/"))
          .map((f) => ({ method: f.msg.method, params: f.msg.params })),
        killedTerminals: [...h.terminals.values()].filter((t) => t.killed).length,
      };
    });
  },

  /** A session with a prompt; the agent exits; a new agent loads the session and goes on. */
  async restart() {
    const first = await withAgent(opts, async (h) => {
      answering(h, args.answers);
      const { sessionId } = await openSession(h, args.cwd, args.caps ?? {});
      const stops = [];
      for (const p of args.prompts ?? ["first"]) stops.push(await sendPrompt(h, sessionId, p));
      return { sessionId, stops, updates: h.updates(sessionId) };
    });
    const sessionId = first.result.sessionId;
    const second = await withAgent(opts, async (h) => {
      answering(h, args.answers);
      await h.request(acp.methods.agent.initialize, {
        protocolVersion: acp.PROTOCOL_VERSION,
        clientCapabilities: args.caps ?? {},
      });
      const loadFrom = frames.length;
      const loaded = await h.request(acp.methods.agent.session.load, {
        sessionId,
        cwd: args.cwd,
        mcpServers: [],
      });
      const replay = frames
        .slice(loadFrom)
        .filter((f) => f.dir === "a2c" && f.msg?.method === "session/update")
        .map((f) => f.msg.params.update)
        .filter((u) => !["available_commands_update", "session_info_update"].includes(u.sessionUpdate));
      const from = h.updates(sessionId).length;
      const stop = await prompt(h, sessionId, args.after ?? "after the restart");
      let unknown;
      try {
        await h.request(acp.methods.agent.session.load, { sessionId: "no-such-session", cwd: args.cwd, mcpServers: [] });
      } catch (e) {
        unknown = { code: e.code, message: e.message };
      }
      return { loaded, replay, stop, updates: h.updates(sessionId).slice(from), unknown };
    });
    return { first: first.result, second: second.result };
  },

  /** What an editor shows around a conversation: the session's commands, its config
   * options (model, thinking), what setting them does, the title and context meter of its
   * turns, slash commands, and session/delete. */
  async editor() {
    return withAgent(opts, async (h) => {
      answering(h, args.answers);
      const { init, session, sessionId } = await openSession(h, args.cwd, args.caps ?? {});
      const hasCommands = () => h.updates(sessionId).some((u) => u.sessionUpdate === "available_commands_update");
      await h.waitFor(hasCommands, "the session's available commands");
      const set = (configId, value) => h.request(acp.methods.agent.session.setConfigOption, { sessionId, configId, value });
      const setModel = await set("model", args.model);
      const setThought = await set("thought_level", "high");
      let badModel;
      try {
        await set("model", "no-such-model");
      } catch (e) {
        badModel = { code: e.code, message: e.message };
      }
      const stops = [];
      for (const text of args.prompts ?? []) stops.push(await prompt(h, sessionId, text));
      const list = await h.request(acp.methods.agent.session.list, {});
      const deleted = await h.request(acp.methods.agent.session.delete, { sessionId });
      const listAfter = await h.request(acp.methods.agent.session.list, {});
      let loadDeleted;
      try {
        await h.request(acp.methods.agent.session.load, { sessionId, cwd: args.cwd, mcpServers: [] });
      } catch (e) {
        loadDeleted = { code: e.code, message: e.message };
      }
      return { init, session, setModel, setThought, badModel, stops, updates: h.updates(sessionId), list, deleted, listAfter, loadDeleted };
    });
  },

  /** session/list, session/resume and session/close, across a restart. */
  async sessions() {
    const first = await withAgent(opts, async (h) => {
      const a = (await openSession(h, args.cwd)).sessionId;
      await prompt(h, a, "first session");
      const b = (await h.request(acp.methods.agent.session.new, { cwd: args.cwd, mcpServers: [] })).sessionId;
      await prompt(h, b, "second session");
      const list = await h.request(acp.methods.agent.session.list, {});
      const closed = await h.request(acp.methods.agent.session.close, { sessionId: b });
      let afterClose;
      try {
        await prompt(h, b, "after close");
      } catch (e) {
        afterClose = { code: e.code, message: e.message };
      }
      return { a, b, list, closed, afterClose };
    });
    const second = await withAgent(opts, async (h) => {
      await h.request(acp.methods.agent.initialize, { protocolVersion: 1, clientCapabilities: {} });
      const list = await h.request(acp.methods.agent.session.list, { cwd: args.cwd });
      const from = frames.length;
      const resumed = await h.request(acp.methods.agent.session.resume, {
        sessionId: first.result.a,
        cwd: args.cwd,
        mcpServers: [],
      });
      const replayed = frames
        .slice(from)
        .filter((f) => f.dir === "a2c" && f.msg?.method === "session/update")
        .filter((f) => !["available_commands_update", "session_info_update"].includes(f.msg.params.update.sessionUpdate))
        .length;
      const stop = await prompt(h, first.result.a, "resumed");
      return { list, resumed, replayed, stop };
    });
    return { first: first.result, second: second.result };
  },
};

let out;
try {
  const scenario = scenarios[args.scenario];
  if (!scenario) throw new Error(`unknown scenario ${args.scenario}`);
  const run = await scenario();
  out = { ok: true, result: run.result ?? run, exit: run.exit, exitAfterEofMs: run.exitAfterEofMs };
} catch (e) {
  out = { ok: false, error: String(e?.stack ?? e) };
}
out.problems = validate(frames);
out.frames = frames.length;
process.stdout.write(JSON.stringify(out) + "\n");
process.exit(out.ok ? 0 : 1);
