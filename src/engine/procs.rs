use super::call::ModelState;
use super::mcp::McpWait;
use super::{Engine, Owner, TimerOwner};
use crate::agent::run::ToolCall;
use crate::ids::{HostKey, RunId};
use crate::reactor::TimerId;
use crate::reaper::{self, Sweep};
use crate::sandbox;
use crate::tools::ToolOutput;
use crate::tools::bash::{BashJob, SHELL_BUFFER_CAP, ShellOp, Stream};
use mio::Token;
use serde_json::Value;
use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

/// After the shell exits, how long its pipes may stay open (a grandchild holding them).
pub(super) const PIPE_GRACE: Duration = Duration::from_millis(500);
/// Background shells one run keeps, running or finished. A finished one gives its place to a
/// new one (the oldest goes first); when all are running, a new one is refused until the
/// model stops one, so a loop of `background: true` calls cannot fill the machine.
pub(super) const MAX_SHELLS_PER_RUN: usize = 16;
/// A run's process tools alive at once: its foreground commands plus its background shells
/// still running. A turn of 200 `Bash` calls once started 200 process trees together; past
/// this the rest wait, in order, and start as earlier ones end. It is above
/// `MAX_SHELLS_PER_RUN`, so shells left running can never keep every foreground call
/// waiting.
pub(super) const MAX_LIVE_PROCESSES_PER_RUN: usize = 24;

/// How a process tool's child is started (`tools::table::Runs::Process`).
pub(super) type Spawn = fn(&Value, &Path, sandbox::Mode) -> Result<BashJob, ToolOutput>;

pub(super) struct BashTask {
    pub(super) job: BashJob,
    pub(super) tokens: [Token; 2],
    pub(super) timeout: TimerId,
    pub(super) grace: Option<TimerId>,
}

/// A background shell of a run (`Bash` with `background: true`), by its `shell_id`.
pub(super) struct ShellTask {
    pub(super) job: BashJob,
    pub(super) tokens: [Token; 2],
    /// Where the last `BashOutput` of this shell stopped: the next one starts there.
    pub(super) read_at: u64,
    /// The pipes are closed and their tokens forgotten.
    pub(super) released: bool,
}

/// Closes a shell's pipes and forgets their tokens (once).
pub(super) fn release_shell<K>(
    owners: &mut HashMap<Token, Owner<K>>,
    registry: &mio::Registry,
    shell: &mut ShellTask,
) {
    if shell.released {
        return;
    }
    shell.released = true;
    shell.job.close_pipes(registry);
    for token in shell.tokens {
        owners.remove(&token);
    }
}

/// `shell_7` → 7, for telling which shell is older.
pub(super) fn shell_number(id: &str) -> u64 {
    id.strip_prefix("shell_")
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

impl<K: HostKey> Engine<K> {
    /// Starts waiting process tool calls of `run`, oldest first, while it has places.
    pub(super) fn admit_waiting(&mut self, run: RunId) {
        loop {
            let Some(slot) = self.runs.get_mut(&run) else {
                return;
            };
            if slot.live_processes() >= MAX_LIVE_PROCESSES_PER_RUN {
                return;
            }
            let Some((call, spawn)) = slot.waiting.pop_front() else {
                return;
            };
            let workspace = slot.workspace.clone();
            self.start_process(run, call, spawn, &workspace);
        }
    }

    /// Spawns a process tool's child and watches its pipes and its deadline on the reactor.
    pub(super) fn start_process(
        &mut self,
        run: RunId,
        call: ToolCall,
        spawn: Spawn,
        workspace: &Path,
    ) {
        let Some(slot) = self.runs.get_mut(&run) else {
            return;
        };
        // A background shell is spawned here too, in the run's sandbox: it is confined
        // exactly as a foreground command is.
        let mode = slot.run.sandbox_for(&call.id);
        match spawn(&call.input, workspace, mode) {
            Ok(job) if job.is_background() => {
                let output = self.start_shell(run, &call, job);
                self.tool_done(run, &call.id, output);
            }
            Ok(mut job) => {
                let tokens = [self.reactor.token(), self.reactor.token()];
                if let Err(e) = job.register(self.reactor.registry(), tokens[0], tokens[1]) {
                    job.kill("could not watch the process");
                    job.reap_blocking();
                    let effects = slot.run.on_tool_done(
                        &call.id,
                        ToolOutput::error(format!("{}: cannot watch pipes: {e}", call.name)),
                        Instant::now(),
                    );
                    self.push_effects(run, effects);
                    return;
                }
                self.owners
                    .insert(tokens[0], Owner::BashOut(run, call.id.clone()));
                self.owners
                    .insert(tokens[1], Owner::BashErr(run, call.id.clone()));
                let timeout = self.reactor.add_timer(job.timeout);
                self.timers
                    .insert(timeout, TimerOwner::BashTimeout(run, call.id.clone()));
                slot.bash.insert(
                    call.id,
                    BashTask {
                        job,
                        tokens,
                        timeout,
                        grace: None,
                    },
                );
            }
            Err(output) => {
                let effects = slot.run.on_tool_done(&call.id, output, Instant::now());
                self.push_effects(run, effects);
            }
        }
    }

    /// Keeps a job started with `background: true` as a shell of the run, watching its
    /// pipes; the answer is the call's result.
    pub(super) fn start_shell(
        &mut self,
        run: RunId,
        call: &ToolCall,
        mut job: BashJob,
    ) -> ToolOutput {
        let Some(slot) = self.runs.get_mut(&run) else {
            return ToolOutput::error("the run is gone");
        };
        if slot.shells.len() >= MAX_SHELLS_PER_RUN {
            // The lowest-numbered finished shell is the oldest (the map's order is the ids'
            // text, not their numbers).
            let oldest_finished = slot
                .shells
                .iter()
                .filter(|(_, shell)| shell.job.exited())
                .min_by_key(|(id, _)| shell_number(id))
                .map(|(id, _)| id.clone());
            match oldest_finished.and_then(|id| slot.shells.remove(&id)) {
                Some(mut gone) => {
                    release_shell(&mut self.owners, self.reactor.registry(), &mut gone);
                }
                None => {
                    job.kill("too many background shells");
                    job.reap_blocking();
                    return ToolOutput::error(format!(
                        "Bash: {MAX_SHELLS_PER_RUN} background shells are running; stop one \
                         with KillShell first"
                    ));
                }
            }
        }
        slot.shells_started += 1;
        let id = format!("shell_{}", slot.shells_started);
        let tokens = [self.reactor.token(), self.reactor.token()];
        if let Err(e) = job.register(self.reactor.registry(), tokens[0], tokens[1]) {
            job.kill("could not watch the process");
            job.close_pipes(self.reactor.registry());
            job.reap_blocking();
            return ToolOutput::error(format!("Bash: cannot watch pipes: {e}"));
        }
        self.owners
            .insert(tokens[0], Owner::ShellOut(run, id.clone()));
        self.owners
            .insert(tokens[1], Owner::ShellErr(run, id.clone()));
        slot.shells.insert(
            id.clone(),
            ShellTask {
                job,
                tokens,
                read_at: 0,
                released: false,
            },
        );
        let command = call.input["command"].as_str().unwrap_or_default();
        ToolOutput::ok(format!(
            "Started background shell {id}: {command}\nRead its output with BashOutput \
             (shell_id \"{id}\") and stop it with KillShell; it is killed when the run ends."
        ))
    }

    /// Reads what waits in a shell's pipes (one, or both when `None`), and lets its pipes go
    /// once it has exited and they are drained.
    pub(super) fn on_shell_ready(&mut self, run: RunId, id: &str, stream: Option<Stream>) {
        let Some(shell) = self.runs.get_mut(&run).and_then(|s| s.shells.get_mut(id)) else {
            return;
        };
        let registry = self.reactor.registry();
        match stream {
            Some(stream) => shell.job.drain(registry, stream),
            None => {
                shell.job.drain(registry, Stream::Stdout);
                shell.job.drain(registry, Stream::Stderr);
            }
        }
        let exited = shell.job.exited();
        if shell.job.is_complete() {
            release_shell(&mut self.owners, registry, shell);
        }
        if exited {
            self.admit_waiting(run);
        }
    }

    /// Answers `BashOutput` and `KillShell`.
    pub(super) fn shell_op(&mut self, run: RunId, op: ShellOp) -> ToolOutput {
        let (tool, id) = match &op {
            ShellOp::Output { shell_id, .. } => ("BashOutput", shell_id.clone()),
            ShellOp::Kill { shell_id } => ("KillShell", shell_id.clone()),
        };
        // The freshest answer includes what is waiting in the pipes right now.
        self.on_shell_ready(run, &id, None);
        let Some(slot) = self.runs.get_mut(&run) else {
            return ToolOutput::error("the run is gone");
        };
        let known = || {
            let ids: Vec<&str> = slot.shells.keys().map(String::as_str).collect();
            if ids.is_empty() {
                "this run has started none".to_owned()
            } else {
                format!("this run's shells: {}", ids.join(", "))
            }
        };
        if !slot.shells.contains_key(&id) {
            return ToolOutput::error(format!("{tool}: no background shell `{id}`; {}", known()));
        }
        let Some(shell) = slot.shells.get_mut(&id) else {
            return ToolOutput::error(format!("{tool}: no background shell `{id}`"));
        };
        match op {
            ShellOp::Output { since, .. } => {
                let read = shell.job.shell_output(since.unwrap_or(shell.read_at));
                shell.read_at = read.to;
                let mut text = format!("{id}: {}\n", shell.job.shell_state());
                if read.lost > 0 {
                    text.push_str(&format!(
                        "[{} bytes before offset {} were dropped: only the latest {} KiB are \
                         kept]\n",
                        read.lost,
                        read.from,
                        SHELL_BUFFER_CAP / 1024
                    ));
                }
                if read.text.is_empty() {
                    text.push_str("[no new output]\n");
                } else {
                    text.push_str(&read.text);
                    if !read.text.ends_with('\n') {
                        text.push('\n');
                    }
                    // A background shell is confined as a foreground command is; the model
                    // hears why a write failed the same way (no retry prompt: the shell is
                    // already running).
                    if let Some(note) = shell.job.sandbox_note(&read.text) {
                        text.push_str(&format!("[sandbox: {note}]\n"));
                    }
                }
                if read.to < read.total {
                    text.push_str(&format!(
                        "[bytes {}-{} of {}; more waits: call BashOutput with since_offset {}]",
                        read.from, read.to, read.total, read.to
                    ));
                } else {
                    text.push_str(&format!(
                        "[bytes {}-{} of {}; next since_offset {}]",
                        read.from, read.to, read.total, read.to
                    ));
                }
                ToolOutput::ok(text)
            }
            ShellOp::Kill { .. } => {
                if shell.job.exited() {
                    return ToolOutput::ok(format!(
                        "{id} had already ended ({}); nothing to kill",
                        shell.job.shell_state()
                    ));
                }
                shell.job.kill("KillShell");
                shell.job.reap_blocking();
                // What it wrote before it died stays readable.
                let registry = self.reactor.registry();
                shell.job.drain(registry, Stream::Stdout);
                shell.job.drain(registry, Stream::Stderr);
                release_shell(&mut self.owners, registry, shell);
                let total = shell.job.shell_output(u64::MAX).total;
                ToolOutput::ok(format!(
                    "Killed {id} and every process it started; its {total} bytes of output stay \
                     readable with BashOutput."
                ))
            }
        }
    }

    pub(super) fn on_bash_ready(&mut self, run: RunId, tool: &str, stream: Stream) {
        if let Some(task) = self.runs.get_mut(&run).and_then(|s| s.bash.get_mut(tool)) {
            task.job.drain(self.reactor.registry(), stream);
        }
        self.maybe_finish_bash(run, tool);
    }

    pub(super) fn reap_children(&mut self) {
        let mut check = Vec::new();
        let mut shells = Vec::new();
        for (run_id, slot) in self.runs.iter_mut() {
            for (tool, task) in slot.bash.iter_mut() {
                if !task.job.exited() && task.job.try_reap() {
                    check.push((*run_id, tool.clone()));
                }
            }
            for (id, shell) in slot.shells.iter_mut() {
                if !shell.job.exited() && shell.job.try_reap() {
                    shells.push((*run_id, id.clone()));
                }
            }
        }
        for (run, tool) in check {
            self.maybe_finish_bash(run, &tool);
        }
        for (run, id) in shells {
            self.on_shell_ready(run, &id, None);
        }
        // Processes caliban adopted: reap those that exited, kill those of calls now over.
        reaper::sweep(Sweep::Ended);
    }

    pub(super) fn maybe_finish_bash(&mut self, run: RunId, tool: &str) {
        let Some(slot) = self.runs.get_mut(&run) else {
            return;
        };
        let Some(task) = slot.bash.get_mut(tool) else {
            return;
        };
        if !task.job.exited() {
            return;
        }
        if !task.job.is_complete() {
            if task.grace.is_none() {
                let timer = self.reactor.add_timer(PIPE_GRACE);
                task.grace = Some(timer);
                self.timers
                    .insert(timer, TimerOwner::BashGrace(run, tool.to_owned()));
            }
            return;
        }
        let Some(task) = slot.bash.remove(tool) else {
            return;
        };
        let (output, sandboxed) = task.job.result();
        self.forget_bash(&task);
        self.admit_waiting(run);
        if let Some(slot) = self.runs.get_mut(&run) {
            let effects = match sandboxed {
                Some(why) => slot
                    .run
                    .on_tool_sandboxed(tool, output, &why, Instant::now()),
                None => slot.run.on_tool_done(tool, output, Instant::now()),
            };
            self.push_effects(run, effects);
        }
    }

    pub(super) fn forget_bash(&mut self, task: &BashTask) {
        for token in task.tokens {
            self.owners.remove(&token);
        }
        self.timers.remove(&task.timeout);
        self.reactor.cancel_timer(task.timeout);
        if let Some(grace) = task.grace {
            self.timers.remove(&grace);
            self.reactor.cancel_timer(grace);
        }
    }

    /// Stops the model stream and kills every tool process of a run (cancel or end).
    pub(super) fn abort_work(&mut self, run: RunId) {
        let Some(slot) = self.runs.get_mut(&run) else {
            return;
        };
        let model = std::mem::replace(&mut slot.model, ModelState::Idle);
        let tasks: Vec<BashTask> = slot.bash.drain().map(|(_, t)| t).collect();
        // Calls still waiting for a place never start.
        slot.waiting.clear();
        let shells = std::mem::take(&mut slot.shells);
        let fetches: Vec<String> = slot.fetches.keys().cloned().collect();
        if let McpWait::Waiting(timer) = slot.mcp_wait {
            slot.mcp_wait = McpWait::Idle;
            self.timers.remove(&timer);
            self.reactor.cancel_timer(timer);
        }
        if !slot.mcp.is_empty() {
            let (hub, mut io) = self.mcp_io();
            hub.cancel_run(&mut io, run.0);
        }
        match model {
            ModelState::InFlight(mut call) => self.release_model(&mut call),
            ModelState::Backoff(timer) => {
                self.timers.remove(&timer);
                self.reactor.cancel_timer(timer);
            }
            ModelState::Idle => {}
        }
        for mut task in tasks {
            task.job.kill("cancelled");
            task.job.close_pipes(self.reactor.registry());
            task.job.reap_blocking();
            self.forget_bash(&task);
        }
        for id in fetches {
            self.end_fetch_quietly(run, &id);
        }
        // Background shells live as long as their run.
        for (_, mut shell) in shells {
            shell.job.kill("the run ended");
            release_shell(&mut self.owners, self.reactor.registry(), &mut shell);
            shell.job.reap_blocking();
        }
    }
}
