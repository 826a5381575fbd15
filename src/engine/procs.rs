//! A run's processes: its foreground commands (`Runs::Process`), its background shells,
//! the calls waiting for a place under `MAX_LIVE_PROCESSES_PER_RUN`, and all of them killed
//! when the run's work is cancelled. `Procs` holds them and reaches the reactor only through
//! `Reach`; the engine feeds the run what it answers.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::Path;
use std::time::{Duration, Instant};

use mio::Token;
use serde_json::Value;

use super::call::ModelState;
use super::{Engine, Owner, Reach, TimerOwner};

use crate::agent::run::ToolCall;
use crate::ids::{HostKey, RunId};
use crate::reactor::TimerId;
use crate::reaper::{self, Sweep};
use crate::sandbox;
use crate::tools::ToolOutput;
use crate::tools::bash::{BashJob, SHELL_BUFFER_CAP, ShellOp, Stream};

/// After the shell exits, how long its pipes may stay open (a grandchild holding them).
const PIPE_GRACE: Duration = Duration::from_millis(500);
/// Background shells one run keeps, running or finished. A finished one gives its place to a
/// new one (the oldest goes first); when all are running, a new one is refused until the
/// model stops one, so a loop of `background: true` calls cannot fill the machine.
const MAX_SHELLS_PER_RUN: usize = 16;
/// A run's process tools alive at once: its foreground commands plus its background shells
/// still running. A turn of 200 `Bash` calls once started 200 process trees together; past
/// this the rest wait, in order, and start as earlier ones end. It is above
/// `MAX_SHELLS_PER_RUN`, so shells left running can never keep every foreground call
/// waiting.
const MAX_LIVE_PROCESSES_PER_RUN: usize = 24;

/// How a process tool's child is started (`tools::table::Runs::Process`).
pub(super) type Spawn = fn(&Value, &Path, sandbox::Mode) -> Result<BashJob, ToolOutput>;

struct BashTask {
    job: BashJob,
    tokens: [Token; 2],
    timeout: TimerId,
    grace: Option<TimerId>,
}

/// A background shell of a run (`Bash` with `background: true`), by its `shell_id`.
struct ShellTask {
    job: BashJob,
    tokens: [Token; 2],
    /// Where the last `BashOutput` of this shell stopped: the next one starts there.
    read_at: u64,
    /// The pipes are closed and their tokens forgotten.
    released: bool,
}

/// One run's processes.
#[derive(Default)]
pub(super) struct Procs {
    /// Foreground commands, by tool_use_id.
    bash: HashMap<String, BashTask>,
    /// Process tool calls waiting for a place (`MAX_LIVE_PROCESSES_PER_RUN`), in call order.
    waiting: VecDeque<(ToolCall, Spawn)>,
    shells: BTreeMap<String, ShellTask>,
    /// Numbers the run's shells: `shell_1`, `shell_2`, …
    shells_started: u64,
}

impl Procs {
    /// The run's process tools alive now: foreground commands and running shells.
    fn live(&self) -> usize {
        self.bash.len() + self.shells.values().filter(|s| !s.job.exited()).count()
    }

    /// The call back to start now, when the run has a place and no call waits before it;
    /// otherwise it joins the queue.
    pub(super) fn admit(&mut self, call: ToolCall, spawn: Spawn) -> Option<(ToolCall, Spawn)> {
        if self.live() >= MAX_LIVE_PROCESSES_PER_RUN || !self.waiting.is_empty() {
            self.waiting.push_back((call, spawn));
            return None;
        }
        Some((call, spawn))
    }

    /// The oldest waiting call, once a place is free.
    fn next_waiting(&mut self) -> Option<(ToolCall, Spawn)> {
        if self.live() >= MAX_LIVE_PROCESSES_PER_RUN {
            return None;
        }
        self.waiting.pop_front()
    }

    /// Spawns a call's child in `mode` and watches its pipes and its deadline. A background
    /// shell, or a child that cannot start or be watched, is answered at once (`Some`).
    fn start(
        &mut self,
        reach: &mut impl Reach,
        run: RunId,
        call: &ToolCall,
        job: Result<BashJob, ToolOutput>,
    ) -> Option<ToolOutput> {
        let mut job = match job {
            Ok(job) if job.is_background() => {
                let command = call.input["command"].as_str().unwrap_or_default();
                return Some(self.start_shell(reach, run, command, job));
            }
            Ok(job) => job,
            Err(output) => return Some(output),
        };
        let tokens = [
            reach.token(Owner::BashOut(run, call.id.clone())),
            reach.token(Owner::BashErr(run, call.id.clone())),
        ];
        if let Err(e) = job.register(reach.registry(), tokens[0], tokens[1]) {
            tokens.into_iter().for_each(|t| reach.forget(t));
            job.kill("could not watch the process");
            job.reap_blocking();
            let output = ToolOutput::error(format!("{}: cannot watch pipes: {e}", call.name));
            return Some(output);
        }
        let timeout = reach.timer(job.timeout, TimerOwner::BashTimeout(run, call.id.clone()));
        let task = BashTask {
            job,
            tokens,
            timeout,
            grace: None,
        };
        self.bash.insert(call.id.clone(), task);
        None
    }

    /// Reads what waits in a foreground command's pipe.
    fn on_ready(&mut self, registry: &mio::Registry, tool: &str, stream: Stream) {
        if let Some(task) = self.bash.get_mut(tool) {
            task.job.drain(registry, stream);
        }
    }

    /// A foreground command ran out of time: its process group is killed, and its end
    /// comes with the next reaping.
    fn on_timeout(&mut self, tool: &str) -> bool {
        let Some(task) = self.bash.get_mut(tool) else {
            return false;
        };
        let secs = task.job.timeout.as_secs();
        task.job.kill(if secs == 1 {
            "timed out after 1 second; the process group was killed"
        } else {
            "timed out; the process group was killed"
        });
        true
    }

    /// The command exited but something still held its pipes: stop waiting for them.
    fn on_grace(&mut self, registry: &mio::Registry, tool: &str) {
        if let Some(task) = self.bash.get_mut(tool) {
            task.job.close_pipes(registry);
        }
    }

    /// A foreground command's result (and why the sandbox stopped it, if it did), once it
    /// exited and its pipes are drained or their grace ran out.
    fn finished(
        &mut self,
        reach: &mut impl Reach,
        run: RunId,
        tool: &str,
    ) -> Option<(ToolOutput, Option<String>)> {
        let task = self.bash.get_mut(tool)?;
        if !task.job.exited() {
            return None;
        }
        if !task.job.is_complete() {
            if task.grace.is_none() {
                let owner = TimerOwner::BashGrace(run, tool.to_owned());
                task.grace = Some(reach.timer(PIPE_GRACE, owner));
            }
            return None;
        }
        let task = self.bash.remove(tool)?;
        forget_bash(reach, &task);
        Some(task.job.result())
    }

    /// Reaps what exited: the foreground commands' ids and the shells' ids.
    fn reap(&mut self) -> (Vec<String>, Vec<String>) {
        let mut commands = Vec::new();
        for (tool, task) in self.bash.iter_mut() {
            if !task.job.exited() && task.job.try_reap() {
                commands.push(tool.clone());
            }
        }
        let mut shells = Vec::new();
        for (id, shell) in self.shells.iter_mut() {
            if !shell.job.exited() && shell.job.try_reap() {
                shells.push(id.clone());
            }
        }
        (commands, shells)
    }

    /// Keeps a job started with `background: true` as a shell of the run, watching its
    /// pipes; the answer is the call's result.
    fn start_shell(
        &mut self,
        reach: &mut impl Reach,
        run: RunId,
        command: &str,
        mut job: BashJob,
    ) -> ToolOutput {
        if self.shells.len() >= MAX_SHELLS_PER_RUN {
            // The lowest-numbered finished shell is the oldest (the map's order is the ids'
            // text, not their numbers).
            let oldest_finished = self
                .shells
                .iter()
                .filter(|(_, shell)| shell.job.exited())
                .min_by_key(|(id, _)| shell_number(id))
                .map(|(id, _)| id.clone());
            match oldest_finished.and_then(|id| self.shells.remove(&id)) {
                Some(mut gone) => release_shell(reach, &mut gone),
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
        self.shells_started += 1;
        let id = format!("shell_{}", self.shells_started);
        let tokens = [
            reach.token(Owner::ShellOut(run, id.clone())),
            reach.token(Owner::ShellErr(run, id.clone())),
        ];
        if let Err(e) = job.register(reach.registry(), tokens[0], tokens[1]) {
            tokens.into_iter().for_each(|t| reach.forget(t));
            job.kill("could not watch the process");
            job.close_pipes(reach.registry());
            job.reap_blocking();
            return ToolOutput::error(format!("Bash: cannot watch pipes: {e}"));
        }
        let shell = ShellTask {
            job,
            tokens,
            read_at: 0,
            released: false,
        };
        self.shells.insert(id.clone(), shell);
        ToolOutput::ok(format!(
            "Started background shell {id}: {command}\nRead its output with BashOutput \
             (shell_id \"{id}\") and stop it with KillShell; it is killed when the run ends."
        ))
    }

    /// Reads what waits in a shell's pipes (one, or both when `None`), and lets its pipes go
    /// once it has exited and they are drained. Whether the shell has exited: its place
    /// may go to a waiting call.
    pub(super) fn on_shell_ready(
        &mut self,
        reach: &mut impl Reach,
        id: &str,
        stream: Option<Stream>,
    ) -> bool {
        let Some(shell) = self.shells.get_mut(id) else {
            return false;
        };
        match stream {
            Some(stream) => shell.job.drain(reach.registry(), stream),
            None => {
                shell.job.drain(reach.registry(), Stream::Stdout);
                shell.job.drain(reach.registry(), Stream::Stderr);
            }
        }
        if shell.job.is_complete() {
            release_shell(reach, shell);
        }
        shell.job.exited()
    }

    /// Answers `BashOutput` and `KillShell` (`tool` is the call's name, for its messages).
    pub(super) fn shell_op(
        &mut self,
        reach: &mut impl Reach,
        tool: &str,
        op: ShellOp,
    ) -> ToolOutput {
        let id = match &op {
            ShellOp::Output { shell_id, .. } | ShellOp::Kill { shell_id } => shell_id.clone(),
        };
        let Some(shell) = self.shells.get_mut(&id) else {
            let ids: Vec<&str> = self.shells.keys().map(String::as_str).collect();
            let known = if ids.is_empty() {
                "this run has started none".to_owned()
            } else {
                format!("this run's shells: {}", ids.join(", "))
            };
            return ToolOutput::error(format!("{tool}: no background shell `{id}`; {known}"));
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
                shell.job.drain(reach.registry(), Stream::Stdout);
                shell.job.drain(reach.registry(), Stream::Stderr);
                release_shell(reach, shell);
                let total = shell.job.shell_output(u64::MAX).total;
                ToolOutput::ok(format!(
                    "Killed {id} and every process it started; its {total} bytes of output stay \
                     readable with BashOutput."
                ))
            }
        }
    }

    /// Kills every process of the run (cancel or end): its commands, the calls waiting
    /// (they never start) and its shells, which live as long as the run.
    fn abort(&mut self, reach: &mut impl Reach) {
        self.waiting.clear();
        for (_, mut task) in self.bash.drain() {
            task.job.kill("cancelled");
            task.job.close_pipes(reach.registry());
            task.job.reap_blocking();
            forget_bash(reach, &task);
        }
        for (_, mut shell) in std::mem::take(&mut self.shells) {
            shell.job.kill("the run ended");
            release_shell(reach, &mut shell);
            shell.job.reap_blocking();
        }
    }
}

fn forget_bash(reach: &mut impl Reach, task: &BashTask) {
    for token in task.tokens {
        reach.forget(token);
    }
    reach.cancel(task.timeout);
    if let Some(grace) = task.grace {
        reach.cancel(grace);
    }
}

/// Closes a shell's pipes and forgets their tokens (once).
fn release_shell(reach: &mut impl Reach, shell: &mut ShellTask) {
    if shell.released {
        return;
    }
    shell.released = true;
    shell.job.close_pipes(reach.registry());
    for token in shell.tokens {
        reach.forget(token);
    }
}

/// `shell_7` → 7, for telling which shell is older.
fn shell_number(id: &str) -> u64 {
    id.strip_prefix("shell_")
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

impl<K: HostKey> Engine<K> {
    /// Queues a process tool call, or starts it when the run has a place.
    pub(super) fn start_process(&mut self, run: RunId, call: ToolCall, spawn: Spawn) {
        let Some(slot) = self.runs.get_mut(&run) else {
            return;
        };
        if let Some((call, spawn)) = slot.procs.admit(call, spawn) {
            self.spawn_process(run, call, spawn);
        }
    }

    /// Starts waiting process tool calls of `run`, oldest first, while it has places.
    pub(super) fn admit_waiting(&mut self, run: RunId) {
        while let Some((call, spawn)) = self
            .runs
            .get_mut(&run)
            .and_then(|slot| slot.procs.next_waiting())
        {
            self.spawn_process(run, call, spawn);
        }
    }

    /// Spawns a process tool's child in the run's sandbox (a background shell too: it is
    /// confined exactly as a foreground command is).
    fn spawn_process(&mut self, run: RunId, call: ToolCall, spawn: Spawn) {
        let Some(slot) = self.runs.get_mut(&run) else {
            return;
        };
        let mode = slot.run.sandbox_for(&call.id);
        let job = spawn(&call.input, &slot.workspace, mode);
        if let Some(output) = slot.procs.start(&mut self.io, run, &call, job) {
            self.tool_done(run, &call.id, output);
        }
    }

    pub(super) fn on_bash_ready(&mut self, run: RunId, tool: &str, stream: Stream) {
        if let Some(slot) = self.runs.get_mut(&run) {
            slot.procs
                .on_ready(self.io.reactor.registry(), tool, stream);
        }
        self.maybe_finish_bash(run, tool);
    }

    pub(super) fn on_bash_timeout(&mut self, run: RunId, tool: &str) {
        if let Some(slot) = self.runs.get_mut(&run)
            && slot.procs.on_timeout(tool)
        {
            self.reap_children();
        }
    }

    pub(super) fn on_bash_grace(&mut self, run: RunId, tool: &str) {
        if let Some(slot) = self.runs.get_mut(&run) {
            slot.procs.on_grace(self.io.reactor.registry(), tool);
        }
        self.maybe_finish_bash(run, tool);
    }

    pub(super) fn on_shell_ready(&mut self, run: RunId, id: &str, stream: Option<Stream>) {
        let Some(slot) = self.runs.get_mut(&run) else {
            return;
        };
        if slot.procs.on_shell_ready(&mut self.io, id, stream) {
            self.admit_waiting(run);
        }
    }

    /// Answers `BashOutput` and `KillShell`.
    pub(super) fn shell_op(&mut self, run: RunId, tool: &str, op: ShellOp) -> ToolOutput {
        let id = match &op {
            ShellOp::Output { shell_id, .. } | ShellOp::Kill { shell_id } => shell_id.clone(),
        };
        // The freshest answer includes what is waiting in the pipes right now.
        self.on_shell_ready(run, &id, None);
        let Some(slot) = self.runs.get_mut(&run) else {
            return ToolOutput::error("the run is gone");
        };
        slot.procs.shell_op(&mut self.io, tool, op)
    }

    pub(super) fn reap_children(&mut self) {
        let mut commands = Vec::new();
        let mut shells = Vec::new();
        for (run, slot) in self.runs.iter_mut() {
            let (c, s) = slot.procs.reap();
            commands.extend(c.into_iter().map(|tool| (*run, tool)));
            shells.extend(s.into_iter().map(|id| (*run, id)));
        }
        for (run, tool) in commands {
            self.maybe_finish_bash(run, &tool);
        }
        for (run, id) in shells {
            self.on_shell_ready(run, &id, None);
        }
        // Processes caliban adopted: reap those that exited, kill those of calls now over.
        reaper::sweep(Sweep::Ended);
    }

    fn maybe_finish_bash(&mut self, run: RunId, tool: &str) {
        let Some(slot) = self.runs.get_mut(&run) else {
            return;
        };
        let Some((output, sandboxed)) = slot.procs.finished(&mut self.io, run, tool) else {
            return;
        };
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

    /// Stops the model stream and kills every tool process of a run (cancel or end).
    pub(super) fn abort_work(&mut self, run: RunId) {
        let Some(slot) = self.runs.get_mut(&run) else {
            return;
        };
        let model = std::mem::replace(&mut slot.model, ModelState::Idle);
        let fetches: Vec<String> = slot.fetches.keys().cloned().collect();
        slot.mcp.end_wait(&mut self.io, false);
        if !slot.mcp.servers.is_empty() {
            let (hub, mut io) = self.mcp_io();
            hub.cancel_run(&mut io, run.0);
        }
        match model {
            ModelState::InFlight(mut call) => self.release_model(&mut call),
            ModelState::Backoff(timer) => self.io.cancel(timer),
            ModelState::Idle => {}
        }
        if let Some(slot) = self.runs.get_mut(&run) {
            slot.procs.abort(&mut self.io);
        }
        for id in fetches {
            self.end_fetch_quietly(run, &id);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use serde_json::json;

    use super::super::fake::FakeReach;
    use super::*;

    const RUN: RunId = RunId(7);

    /// Commands run in the temp dir: they write nothing.
    fn workspace() -> PathBuf {
        std::env::temp_dir()
    }

    fn call(id: &str, command: &str, background: bool) -> ToolCall {
        ToolCall {
            id: id.to_owned(),
            name: "Bash".to_owned(),
            input: json!({"command": command, "background": background}),
        }
    }

    /// Starts `call` as the engine does, unconfined.
    fn start(procs: &mut Procs, reach: &mut FakeReach, call: &ToolCall) -> Option<ToolOutput> {
        let job = BashJob::spawn(&call.input, &workspace(), sandbox::Mode::Off);
        procs.start(reach, RUN, call, job)
    }

    /// Reaps and drains, as the loop's wake-ups would, until `done` holds (or 10 s pass).
    fn settle(procs: &mut Procs, reach: &mut FakeReach, mut done: impl FnMut(&mut Procs) -> bool) {
        let until = Instant::now() + Duration::from_secs(10);
        while !done(procs) {
            assert!(Instant::now() < until, "processes did not settle");
            procs.reap();
            let ids: Vec<String> = procs.shells.keys().cloned().collect();
            for id in ids {
                procs.on_shell_ready(reach, &id, None);
            }
            let tools: Vec<String> = procs.bash.keys().cloned().collect();
            for tool in tools {
                procs.on_ready(reach.registry(), &tool, Stream::Stdout);
                procs.on_ready(reach.registry(), &tool, Stream::Stderr);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn read(procs: &mut Procs, reach: &mut FakeReach, id: &str, since: Option<u64>) -> String {
        let op = ShellOp::Output {
            shell_id: id.to_owned(),
            since,
        };
        procs.shell_op(reach, "BashOutput", op).text
    }

    fn shell_exited(id: &'static str) -> impl FnMut(&mut Procs) -> bool {
        move |procs| procs.shells.get(id).is_some_and(|s| s.job.is_complete())
    }

    #[test]
    fn a_command_is_watched_until_its_result_then_forgotten() {
        let (mut procs, mut reach) = (Procs::default(), FakeReach::new());
        assert!(start(&mut procs, &mut reach, &call("t1", "echo hi", false)).is_none());
        assert_eq!(reach.owners.len(), 2, "both pipes are watched");
        let timeout = reach
            .timers
            .values()
            .find_map(|(after, owner)| match owner {
                TimerOwner::BashTimeout(RUN, id) if id == "t1" => Some(*after),
                _ => None,
            });
        assert_eq!(timeout, Some(crate::tools::bash::DEFAULT_TIMEOUT));
        settle(&mut procs, &mut reach, |p| p.bash["t1"].job.is_complete());
        let result = procs.finished(&mut reach, RUN, "t1");
        assert!(
            reach.owners.is_empty() && reach.timers.is_empty(),
            "all forgotten"
        );
        let (output, sandboxed) = result.expect("result");
        assert!(output.text.contains("hi"), "{}", output.text);
        assert!(sandboxed.is_none());
        assert_eq!(procs.live(), 0);
    }

    #[test]
    fn the_cap_makes_calls_wait_and_admits_them_in_call_order() {
        let (mut procs, mut reach) = (Procs::default(), FakeReach::new());
        for n in 0..MAX_LIVE_PROCESSES_PER_RUN {
            let c = call(&format!("t{n}"), "sleep 30", false);
            let (c, _) = procs.admit(c, BashJob::spawn).expect("a place");
            assert!(start(&mut procs, &mut reach, &c).is_none());
        }
        assert!(
            procs
                .admit(call("late1", "true", false), BashJob::spawn)
                .is_none()
        );
        assert!(
            procs
                .admit(call("late2", "true", false), BashJob::spawn)
                .is_none()
        );
        assert!(
            procs.next_waiting().is_none(),
            "no place while every one is alive"
        );
        assert!(procs.on_timeout("t0"));
        settle(&mut procs, &mut reach, |p| p.bash["t0"].job.is_complete());
        assert!(procs.finished(&mut reach, RUN, "t0").is_some());
        let (first, _) = procs.next_waiting().expect("the freed place");
        assert_eq!(first.id, "late1");
        assert!(start(&mut procs, &mut reach, &first).is_none());
        assert!(procs.next_waiting().is_none(), "late1 took the only place");
        procs.abort(&mut reach);
        assert_eq!(procs.live(), 0);
    }

    #[test]
    fn abort_kills_every_process_and_forgets_its_tokens_and_timers() {
        let (mut procs, mut reach) = (Procs::default(), FakeReach::new());
        start(&mut procs, &mut reach, &call("t1", "sleep 30", false));
        start(
            &mut procs,
            &mut reach,
            &call("t2", "sleep 30 & sleep 30", false),
        );
        start(&mut procs, &mut reach, &call("s1", "sleep 30", true));
        start(&mut procs, &mut reach, &call("s2", "sleep 30", true));
        procs
            .waiting
            .push_back((call("t3", "sleep 30", false), BashJob::spawn));
        assert_eq!(procs.live(), 4);
        assert_eq!(reach.owners.len(), 8);
        procs.abort(&mut reach);
        assert_eq!(procs.live(), 0);
        assert!(procs.bash.is_empty() && procs.shells.is_empty());
        assert!(procs.waiting.is_empty(), "a waiting call never starts");
        assert!(reach.owners.is_empty(), "{:?}", reach.owners.len());
        assert!(reach.timers.is_empty());
        assert_eq!(reach.cancelled.len(), 2, "both commands' timeouts");
    }

    #[test]
    fn a_shell_read_returns_what_is_new_with_its_offsets() {
        let (mut procs, mut reach) = (Procs::default(), FakeReach::new());
        let started = start(
            &mut procs,
            &mut reach,
            &call("s", "printf 'one\\ntwo\\n'", true),
        );
        let started = started.expect("answered at once").text;
        assert!(
            started.starts_with("Started background shell shell_1: printf"),
            "{started}"
        );
        settle(&mut procs, &mut reach, shell_exited("shell_1"));
        let first = read(&mut procs, &mut reach, "shell_1", None);
        assert!(first.starts_with("shell_1: "), "{first}");
        assert!(first.contains("one\ntwo\n"), "{first}");
        assert!(
            first.ends_with("[bytes 0-8 of 8; next since_offset 8]"),
            "{first}"
        );
        let again = read(&mut procs, &mut reach, "shell_1", None);
        assert!(again.contains("[no new output]"), "{again}");
        assert!(
            again.ends_with("[bytes 8-8 of 8; next since_offset 8]"),
            "{again}"
        );
        let from_four = read(&mut procs, &mut reach, "shell_1", Some(4));
        assert!(
            from_four.contains("two\n") && !from_four.contains("one"),
            "{from_four}"
        );
        assert!(reach.owners.is_empty(), "a drained shell lets its pipes go");
    }

    #[test]
    fn a_shell_keeps_only_the_latest_bytes_and_says_what_was_dropped() {
        let (mut procs, mut reach) = (Procs::default(), FakeReach::new());
        let total = SHELL_BUFFER_CAP + 10_000;
        let command = format!("head -c {total} /dev/zero | tr '\\0' a");
        start(&mut procs, &mut reach, &call("s", &command, true));
        settle(&mut procs, &mut reach, shell_exited("shell_1"));
        let text = read(&mut procs, &mut reach, "shell_1", Some(0));
        let lost = format!(
            "[10000 bytes before offset 10000 were dropped: only the latest {} KiB are kept]",
            SHELL_BUFFER_CAP / 1024
        );
        assert!(text.contains(&lost), "{}", &text[..200]);
        assert!(text.contains("more waits: call BashOutput with since_offset"));
    }

    #[test]
    fn the_oldest_finished_shell_gives_its_place_to_a_new_one() {
        let (mut procs, mut reach) = (Procs::default(), FakeReach::new());
        for n in 0..MAX_SHELLS_PER_RUN {
            start(
                &mut procs,
                &mut reach,
                &call(&format!("s{n}"), "true", true),
            );
        }
        settle(&mut procs, &mut reach, |p| {
            p.shells.values().all(|s| s.job.exited())
        });
        let started = start(&mut procs, &mut reach, &call("s", "sleep 30", true));
        assert!(started.expect("started").text.contains("shell_17"));
        assert!(!procs.shells.contains_key("shell_1"), "the oldest went");
        assert!(procs.shells.contains_key("shell_2"));
        assert_eq!(procs.shells.len(), MAX_SHELLS_PER_RUN);
        procs.abort(&mut reach);
    }

    #[test]
    fn running_shells_at_the_cap_refuse_another() {
        let (mut procs, mut reach) = (Procs::default(), FakeReach::new());
        for n in 0..MAX_SHELLS_PER_RUN {
            start(
                &mut procs,
                &mut reach,
                &call(&format!("s{n}"), "sleep 30", true),
            );
        }
        let refused = start(&mut procs, &mut reach, &call("s", "sleep 30", true));
        let refused = refused.expect("answered");
        assert!(refused.is_error);
        assert_eq!(
            refused.text,
            "Bash: 16 background shells are running; stop one with KillShell first"
        );
        assert_eq!(procs.shells_started, MAX_SHELLS_PER_RUN as u64);
        procs.abort(&mut reach);
    }

    #[test]
    fn kill_shell_ends_it_and_its_output_stays_readable() {
        let (mut procs, mut reach) = (Procs::default(), FakeReach::new());
        start(
            &mut procs,
            &mut reach,
            &call("s", "echo started; sleep 30", true),
        );
        settle(&mut procs, &mut reach, |p| {
            p.shells["shell_1"]
                .job
                .shell_output(0)
                .text
                .contains("started")
        });
        let kill = || ShellOp::Kill {
            shell_id: "shell_1".to_owned(),
        };
        let killed = procs.shell_op(&mut reach, "KillShell", kill()).text;
        assert!(killed.starts_with("Killed shell_1 and every process it started; its 8 bytes"));
        assert_eq!(procs.live(), 0);
        assert!(read(&mut procs, &mut reach, "shell_1", Some(0)).contains("started\n"));
        let again = procs.shell_op(&mut reach, "KillShell", kill()).text;
        assert!(again.starts_with("shell_1 had already ended ("), "{again}");
    }

    #[test]
    fn an_unknown_shell_is_answered_with_the_known_ones() {
        let (mut procs, mut reach) = (Procs::default(), FakeReach::new());
        let none = read(&mut procs, &mut reach, "shell_9", None);
        assert_eq!(
            none,
            "BashOutput: no background shell `shell_9`; this run has started none"
        );
        start(&mut procs, &mut reach, &call("s", "true", true));
        let op = ShellOp::Kill {
            shell_id: "shell_9".to_owned(),
        };
        let some = procs.shell_op(&mut reach, "KillShell", op);
        assert!(some.is_error);
        assert_eq!(
            some.text,
            "KillShell: no background shell `shell_9`; this run's shells: shell_1"
        );
        procs.abort(&mut reach);
    }
}
