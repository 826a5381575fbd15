//! Processes that outlive their parents. A tool call's shell runs in a process group of its
//! own, and killing that group ends everything the command started, except a process that
//! moved to a session of its own (`setsid`, a daemon's double fork). caliban is a child
//! subreaper (`enable`), so when such a process's parent dies it re-parents to caliban
//! instead of to PID 1; this module finds it there, tells which tool call it belongs to,
//! kills it with its descendants once that call is over (ended, timed out, cancelled) or
//! caliban exits, and reaps it.
//!
//! Whose is it? Every Bash shell starts with `CALIBAN_TOOL_CALL=<caliban's pid>.<n>` in its
//! environment (`CallTag`), and its descendants inherit it. A process caliban adopted is
//! judged by that tag: a live call's is left alone, an ended call's is killed. One that drops
//! its environment on the way (`setsid env -i …`) cannot be told apart, nor can one an MCP
//! server left behind; both are killed when caliban exits (`kill_all`).
//!
//! Reaping: a child caliban started itself (a Bash shell, an MCP server of the ACP surface)
//! is registered by `spawn` and reaped only by its owner (`wait`), which wants its exit
//! status; a sweep reaps only the others, each by its pid, never with `waitpid(-1)`.
//!
//! Cost: nothing here runs on a timer. A sweep (on SIGCHLD, and when a call ends) reads
//! caliban's own child lists, `/proc/self/task/*/children`, a few small files; it reads more
//! only for the adopted processes it finds, usually none, and every walk is capped. A walk
//! that meets its cap leaves the rest to the sweeps that follow their parents' deaths.
//!
//! A kernel without child lists (built without `CONFIG_PROC_CHILDREN`) leaves `enable` off
//! and every function here a no-op beyond spawning and waiting: processes in a session of
//! their own then escape as they would without this module.
//!
//! Architecture Invariant: every function here runs on the event loop's thread (spawning,
//! SIGCHLD, tool ends) or at exit; the registry's lock is held across a spawn and a sweep,
//! so no sweep can reap a child between its fork and its registration.

use std::collections::BTreeSet;
use std::fs::{self, File};
use std::io::{self, Read};
use std::process::{Child, Command, ExitStatus};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use crate::sys;

/// The environment variable that tags a tool call's processes.
pub const TAG_ENV: &str = "CALIBAN_TOOL_CALL";

/// Most processes one walk of a tree visits: a build's hundreds fit, a fork bomb does not
/// stall the loop (what a capped walk misses is killed as its parents die and it re-parents).
const MAX_TREE: usize = 4096;

/// Most adopted processes one sweep examines.
const MAX_ADOPTED: usize = 4096;

/// Most bytes of a process's environment read to find its tag. Environments are a few KiB;
/// one that buries the tag past this is treated as untagged (killed at exit only).
const MAX_ENVIRON_BYTES: u64 = 256 * 1024;

/// When a call is cancelled and at exit, how many times adopted processes are killed and
/// waited for, and the pause between rounds: a SIGKILLed process is gone once it is next
/// scheduled, usually within a millisecond or two (two rounds), and the whole wait stays
/// near 100 ms however loaded the machine or stubborn the tree.
const SETTLE_ROUNDS: u32 = 50;
const SETTLE_PAUSE: Duration = Duration::from_millis(2);

struct Registry {
    /// `enable` succeeded: caliban is a subreaper and can list its children.
    enabled: bool,
    /// Children started by `spawn` whose owners reap them (`wait`).
    owned: BTreeSet<u32>,
    /// Tags of tool calls still running.
    live: BTreeSet<u64>,
    next_tag: u64,
}

static REGISTRY: Mutex<Registry> = Mutex::new(Registry {
    enabled: false,
    owned: BTreeSet::new(),
    live: BTreeSet::new(),
    next_tag: 1,
});

fn registry() -> MutexGuard<'static, Registry> {
    // The registry holds plain sets; a panic elsewhere cannot leave them half-changed.
    REGISTRY.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Makes caliban a child subreaper, if the kernel can list a process's children; call it
/// once at start-up, before any tool runs. The error says why not.
pub fn enable() -> Result<(), String> {
    let me = std::process::id();
    let probe = format!("/proc/{me}/task/{me}/children");
    fs::metadata(&probe).map_err(|e| format!("cannot list child processes ({probe}): {e}"))?;
    sys::become_subreaper().map_err(|e| format!("cannot become a child subreaper: {e}"))?;
    registry().enabled = true;
    Ok(())
}

/// The tag of one tool call: live from `new` until dropped, and inherited by every process
/// the call starts.
#[derive(Debug)]
pub struct CallTag(u64);

impl CallTag {
    pub fn new() -> CallTag {
        let mut registry = registry();
        let n = registry.next_tag;
        registry.next_tag += 1;
        registry.live.insert(n);
        CallTag(n)
    }

    fn value(&self) -> String {
        format!("{}.{}", std::process::id(), self.0)
    }

    /// The call is over (its shell exited or was killed), though its owner still holds the
    /// tag: what it left behind is killed on sight from now on, by the sweep after each
    /// SIGCHLD, including a straggler that re-parents to caliban only after the call's own
    /// sweep looked.
    pub fn end(&self) {
        registry().live.remove(&self.0);
    }
}

impl Drop for CallTag {
    fn drop(&mut self) {
        self.end();
    }
}

/// Starts `cmd` in a session and process group of its own (`sys::detach_into_own_group`),
/// tagged with `tag` if given, confined by `sandbox` if given (`sandbox::prepare`), as a
/// child its caller reaps with `wait`. Every process a tool starts goes through here, so
/// every one of them gets the sandbox its caller chose, and so do all its descendants, and
/// none gets caliban's secrets (`secrets::scrub_env`).
pub fn spawn(
    cmd: &mut Command,
    tag: Option<&CallTag>,
    sandbox: Option<sys::Confinement>,
) -> io::Result<Child> {
    crate::secrets::scrub_env(cmd);
    if let Some(tag) = tag {
        cmd.env(TAG_ENV, tag.value());
    }
    sys::detach_into_own_group(cmd);
    if let Some(confinement) = sandbox {
        sys::confine(cmd, confinement);
    }
    let mut registry = registry();
    let child = cmd.spawn()?;
    registry.owned.insert(child.id());
    Ok(child)
}

/// Waits for a child `spawn` started and forgets it.
pub fn wait(child: &mut Child) -> io::Result<ExitStatus> {
    let status = child.wait();
    registry().owned.remove(&child.id());
    status
}

/// What a sweep kills besides reaping.
#[derive(Clone, Copy, Debug)]
pub enum Sweep<'a> {
    /// What belongs to calls already over (after a SIGCHLD).
    Ended,
    /// That, and what belongs to this call, which is ending.
    Call(&'a CallTag),
}

/// Reaps adopted processes that exited and kills (with their descendants) those whose call
/// is over. `Sweep::Call` also ends that call (`CallTag::end`). True when it found one
/// still alive (and signalled it).
pub fn sweep(scope: Sweep<'_>) -> bool {
    if let Sweep::Call(tag) = scope {
        tag.end();
    }
    let registry = registry();
    if !registry.enabled {
        return false;
    }
    let me = std::process::id();
    let mut alive = false;
    for pid in children_of(me).into_iter().take(MAX_ADOPTED) {
        if registry.owned.contains(&pid) || sys::reap_if_exited(pid) {
            continue;
        }
        let Some(n) = tag_of(pid).and_then(|(owner, n)| (owner == me).then_some(n)) else {
            continue;
        };
        if !registry.live.contains(&n) {
            alive = true;
            kill_tree(pid, true);
        }
    }
    alive
}

/// Ends a cancelled call for good: sweeps until nothing it started is alive, waiting a
/// bounded time (`SETTLE_ROUNDS`) for what was killed to die, so that a cancel is over
/// when it returns, not once the scheduler gets round to the killed processes. Its shell
/// must be reaped first (then everything it left is caliban's to see).
pub fn settle(tag: &CallTag) {
    for _ in 0..SETTLE_ROUNDS {
        if !sweep(Sweep::Call(tag)) {
            return;
        }
        std::thread::sleep(SETTLE_PAUSE);
    }
}

/// Kills every descendant of `pid` (a shell being cancelled, still running), so that what
/// left its process group goes with it.
pub fn kill_descendants(pid: u32) {
    if registry().enabled {
        kill_tree(pid, false);
    }
}

/// At exit: kills every process caliban adopted, tagged or not, and reaps them, waiting a
/// bounded time for them to die.
pub fn kill_all() {
    let registry = registry();
    if !registry.enabled {
        return;
    }
    let me = std::process::id();
    for _ in 0..SETTLE_ROUNDS {
        let mut alive = false;
        for pid in children_of(me).into_iter().take(MAX_ADOPTED) {
            if registry.owned.contains(&pid) || sys::reap_if_exited(pid) {
                continue;
            }
            alive = true;
            kill_tree(pid, true);
        }
        if !alive {
            return;
        }
        std::thread::sleep(SETTLE_PAUSE);
    }
}

/// Most generations between a peer's process and caliban that `descends_from_us` climbs: a
/// shell, its pipeline, a build and its compilers nest a dozen deep; a chain longer than
/// this is read as unknown, and the caller refuses it.
const MAX_ANCESTRY: usize = 256;

/// Every live descendant of caliban (capped at `MAX_TREE`); `None` when the kernel cannot
/// list children or the walk met its cap (then nobody can say a process is not one of
/// them). Empty in the common case, at the cost of reading caliban's own child lists.
pub fn descendants() -> Option<Vec<u32>> {
    let me = std::process::id();
    fs::metadata(format!("/proc/{me}/task/{me}/children")).ok()?;
    let mut tree = children_of(me);
    let mut next = 0;
    while next < tree.len() {
        if tree.len() >= MAX_TREE {
            return None;
        }
        let parent = tree[next];
        next += 1;
        tree.extend(children_of(parent));
    }
    Some(tree)
}

/// Whether a process caliban adopted (one that outlived the call that started it, or
/// whose parents did) is alive; `None` when caliban cannot list its children. Children
/// caliban started itself (shells of calls still running, MCP servers) are not counted:
/// only what outlived its call can still be in the mount namespace of a call that is over.
pub fn adopted_alive() -> Option<bool> {
    let registry = registry();
    if !registry.enabled {
        return None;
    }
    let me = std::process::id();
    Some(
        children_of(me)
            .into_iter()
            .any(|pid| !registry.owned.contains(&pid) && is_running(pid)),
    )
}

/// Whether caliban started a child that its owner has not reaped yet: what tells, on a
/// kernel without child lists, whether any descendant may be alive.
pub fn has_children() -> bool {
    !registry().owned.is_empty()
}

/// Whether `pid`'s chain of parents reaches caliban; `None` when it cannot be read to its
/// end (a process gone on the way, or longer than `MAX_ANCESTRY`).
pub fn descends_from_us(pid: u32) -> Option<bool> {
    let me = std::process::id();
    let mut at = pid;
    for _ in 0..MAX_ANCESTRY {
        if at == me {
            return Some(true);
        }
        if at <= 1 {
            return Some(false);
        }
        at = parent_of(at)?;
    }
    None
}

/// Whether `pid` is alive and not a zombie.
pub fn is_running(pid: u32) -> bool {
    parent_of(pid).is_some()
}

/// Whether `pid` carries the tag of one of caliban's tool calls (`CallTag`), whose value
/// starts with caliban's pid.
pub fn tagged_ours(pid: u32) -> bool {
    tag_of(pid).is_some_and(|(owner, _)| owner == std::process::id())
}

/// Walks the tree under `root` (capped), then SIGKILLs it from the top, so no parent is left
/// to start more. A process is signalled only while its parent is still the one the walk
/// saw (or caliban, once that parent died): a pid the walk read that has since been reaped
/// and reused by an unrelated process is left alone.
fn kill_tree(root: u32, with_root: bool) {
    let me = std::process::id();
    let mut tree: Vec<(u32, u32)> = vec![(root, 0)];
    let mut next = 0;
    while next < tree.len() && tree.len() < MAX_TREE {
        let parent = tree[next].0;
        next += 1;
        for child in children_of(parent) {
            if tree.len() >= MAX_TREE {
                break;
            }
            tree.push((child, parent));
        }
    }
    for (i, &(pid, parent)) in tree.iter().enumerate() {
        if i == 0 {
            if with_root {
                let _ = sys::kill_pid(pid, sys::SIGKILL);
            }
            continue;
        }
        if parent_of(pid).is_some_and(|now| now == parent || now == me) {
            let _ = sys::kill_pid(pid, sys::SIGKILL);
        }
    }
}

/// The pids listed as children of `pid`'s threads.
fn children_of(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    let Ok(tasks) = fs::read_dir(format!("/proc/{pid}/task")) else {
        return out;
    };
    for task in tasks.flatten() {
        if let Ok(text) = fs::read_to_string(task.path().join("children")) {
            out.extend(
                text.split_ascii_whitespace()
                    .filter_map(|p| p.parse::<u32>().ok()),
            );
        }
    }
    out
}

/// The parent of a live process; `None` for one that is gone or already a zombie.
fn parent_of(pid: u32) -> Option<u32> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_stat_parent(&stat)
}

/// `pid (comm) state ppid …`: the command name may hold spaces and parentheses, so the
/// fields are read after the last `)`.
fn parse_stat_parent(stat: &str) -> Option<u32> {
    let (_, rest) = stat.rsplit_once(')')?;
    let mut fields = rest.split_ascii_whitespace();
    let state = fields.next()?;
    if state == "Z" || state == "X" {
        return None;
    }
    fields.next()?.parse().ok()
}

/// The (caliban pid, call number) tag in a process's environment.
fn tag_of(pid: u32) -> Option<(u32, u64)> {
    let mut environ = Vec::new();
    File::open(format!("/proc/{pid}/environ"))
        .ok()?
        .take(MAX_ENVIRON_BYTES)
        .read_to_end(&mut environ)
        .ok()?;
    parse_tag(&environ)
}

fn parse_tag(environ: &[u8]) -> Option<(u32, u64)> {
    let prefix = format!("{TAG_ENV}=");
    let entry = environ
        .split(|&b| b == 0)
        .find_map(|entry| entry.strip_prefix(prefix.as_bytes()))?;
    let (owner, n) = std::str::from_utf8(entry).ok()?.split_once('.')?;
    Some((owner.parse().ok()?, n.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_lines_with_awkward_names() {
        assert_eq!(parse_stat_parent("42 (sleep) S 7 42 42 0"), Some(7));
        assert_eq!(parse_stat_parent("42 (a) b (c) R 9 1 1"), Some(9));
        assert_eq!(parse_stat_parent("42 (x y) Z 7 0"), None);
        assert_eq!(parse_stat_parent("garbage"), None);
    }

    #[test]
    fn tags_are_found_among_other_variables() {
        let env = b"PATH=/bin\0CALIBAN_TOOL_CALL=123.45\0HOME=/h\0";
        assert_eq!(parse_tag(env), Some((123, 45)));
        assert_eq!(parse_tag(b"CALIBAN_TOOL_CALL=9.1"), Some((9, 1)));
        assert_eq!(parse_tag(b"XCALIBAN_TOOL_CALL=9.1\0"), None);
        assert_eq!(parse_tag(b"CALIBAN_TOOL_CALL=nonsense\0"), None);
        assert_eq!(parse_tag(b""), None);
    }

    #[test]
    fn a_tag_is_live_until_ended_or_dropped() {
        let tag = CallTag::new();
        let n = tag.0;
        assert!(registry().live.contains(&n));
        assert_eq!(tag.value(), format!("{}.{n}", std::process::id()));
        drop(tag);
        assert!(!registry().live.contains(&n));
        let tag = CallTag::new();
        sweep(Sweep::Call(&tag));
        assert!(!registry().live.contains(&tag.0));
    }
}
