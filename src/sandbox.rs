//! The sandbox around every process a tool starts. Permission rules decide *whether* a
//! command runs; the sandbox limits *what it can do* once it runs: where it may write, what
//! it may read, whether it reaches the network. It is the kernel's own machinery, set up
//! between fork and exec with no helper binary (`sys::Confinement`): a Landlock domain
//! (files, TCP ports, signals and abstract sockets), a seccomp filter (socket families,
//! mounting, namespaces, io_uring and other ways around Landlock) and, where caliban may
//! have one, a private mount namespace (every mount read-only and nosuid but the writable
//! directories, protected paths read-only, missing ones held by placeholders, the deny
//! list hidden, a `/proc` that shows only the command's own processes). Landlock fences
//! the deny list in both cases.
//! All three are inherited by every descendant, across `setsid`, `nohup` and exec.
//!
//! Modes, strictest first: `read-only` (no writes but to /dev/null and kin), `workspace-write`
//! (the default where the kernel has Landlock: writes in the workspace and the temp dirs),
//! `network` (that plus outbound TCP, optionally to some ports only, and UDP for DNS), `off`.
//! Every mode but `off` reads everywhere except the deny list (`~/.ssh`, cloud credentials,
//! caliban's own settings and state) and keeps protected paths (`.git/`, settings files;
//! `policy::PROTECTED`) read-only to commands unless `sandbox.protected_writable`
//! names them. A run may only narrow the configured mode (`Mode::narrowed`).
//!
//! Without a mount namespace (no privilege and no user namespaces) Landlock alone fences
//! the protected and denied paths, the missing protected entries too, and since its rules
//! can only grant, the directories on the way to them get rules for each entry instead of
//! one: a command then cannot create a new entry directly in such a directory (the
//! workspace root), and nothing keeps metadata (chmod, chown, xattrs) outside the writable
//! directories.
//!
//! It owns the process-wide configuration (`install`, once at start), the probes of what
//! the kernel offers, the plan for one command (`prepare`), the same policy for the file
//! tools (`check_file_tool`) and the note that tells the model a failure was the sandbox
//! (`explain`). It must not know about runs or surfaces.

use std::collections::HashMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use serde_json::{Value, json};

// The mode is the sandbox's word; it lives in `policy` so that the permission policy and
// the tool table, which must not reach up into the sandbox, share it.
pub use crate::policy::Mode;
use crate::policy::{PROTECTED, protected_path};
use crate::sys::{
    self, Confinement, LandlockRuleset, MountNs, MountPlan, SeccompFilter, SocketPolicy,
    landlock as ll,
};

/// What to do with commands when the kernel cannot confine them (no Landlock).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fallback {
    /// Refuse to run them: the tool result says why.
    Refuse,
    /// Run them with the user's full rights, warned about at start and in every header.
    Unconfined,
}

impl Fallback {
    pub fn parse(name: &str) -> Option<Fallback> {
        match name {
            "refuse" => Some(Fallback::Refuse),
            "unconfined" => Some(Fallback::Unconfined),
            _ => None,
        }
    }
}

/// What the settings files say about the sandbox (`"sandbox": {…}`), before it is resolved
/// against the command line and the environment. Paths are as written (`~/` allowed).
#[derive(Clone, Debug, Default)]
pub struct Settings {
    /// The user's file's mode.
    pub mode: Option<Mode>,
    /// The strictest mode the workspace's files ask for: they may only narrow.
    pub project_mode: Option<Mode>,
    pub deny_read: Vec<String>,
    pub allow_read: Vec<String>,
    pub writable: Vec<String>,
    pub network_ports: Vec<u16>,
    pub protected_writable: Vec<String>,
    pub unavailable: Option<Fallback>,
    pub mcp_servers: Option<Mode>,
    /// Secret-looking variables kept in commands' environment (user settings only).
    pub env_passthrough: Vec<String>,
}

/// Paths under `$HOME` that commands may not read: keys and the credentials of cloud
/// providers, registries, package indexes and git hosts.
const HOME_DENY: &[&str] = &[
    ".ssh",
    ".gnupg",
    ".aws",
    ".azure",
    ".config/gcloud",
    ".kube",
    ".docker",
    ".config/gh",
    ".netrc",
    ".git-credentials",
    ".npmrc",
    ".pypirc",
    ".cargo/credentials",
    ".cargo/credentials.toml",
    ".password-store",
    ".vault-token",
];

/// Device files every mode may open for writing (and /dev/pts for terminals).
const DEVICES: &[&str] = &[
    "/dev/null",
    "/dev/zero",
    "/dev/full",
    "/dev/random",
    "/dev/urandom",
    "/dev/tty",
    "/dev/ptmx",
    "/dev/pts",
];

/// Temp directories the writing modes may write in, besides `$TMPDIR`.
const TEMP_DIRS: &[&str] = &["/tmp", "/var/tmp", "/dev/shm"];

/// Most Landlock rules one command's fence may take (each entry of a directory on the way
/// to a fenced path is one); past it, the rest of such a directory is left out, which only
/// ever takes rights away.
const MAX_SPLIT_RULES: usize = 4096;

/// The process-wide sandbox configuration: the command line, the settings files and the
/// environment, resolved once at start (`install`).
#[derive(Clone, Debug)]
pub struct Config {
    /// The mode runs get unless they narrow it.
    pub mode: Mode,
    pub fallback: Fallback,
    /// Absolute paths commands may not read (nor write).
    pub deny: Vec<PathBuf>,
    /// Extra roots the writing modes may write in.
    pub writable: Vec<PathBuf>,
    /// `network` mode's TCP ports; empty is any port.
    pub ports: Vec<u16>,
    /// Protected entries (as `Protected::shown` spells them, `.git/`) commands may write.
    pub protected_writable: Vec<String>,
    /// The mode of MCP stdio servers an editor asks caliban to start.
    pub mcp_servers: Mode,
    /// Secret-looking variables commands keep (`sandbox.env_passthrough`).
    pub env_passthrough: Vec<String>,
    /// `$HOME`, for showing paths as `~/…`.
    home: Option<PathBuf>,
    /// Test hooks from the environment: behave as if the kernel had no Landlock
    /// (`CALIBAN_SANDBOX_NO_LANDLOCK=1`), or caliban could not have a mount namespace
    /// (`CALIBAN_SANDBOX_NO_MOUNTNS=1`), or only one in a user namespace, as without
    /// privilege (`CALIBAN_SANDBOX_USERNS=1`), or no `mount_setattr`, as before Linux 5.12
    /// (`CALIBAN_SANDBOX_NO_MOUNT_SETATTR=1`).
    no_landlock: bool,
    no_mount_ns: bool,
    userns_only: bool,
    no_mount_setattr: bool,
}

impl Config {
    /// Resolves the configuration: `--sandbox` wins; else the user's settings (or the
    /// default, `workspace-write`), narrowed by the workspace's settings. Where the kernel
    /// cannot confine commands, a mode someone chose is refused and the default runs
    /// unconfined, unless `sandbox.unavailable` says otherwise. `own` is what caliban keeps
    /// from commands besides the usual credentials: its settings and state directories and
    /// the keys it was given, which the caller knows (the sandbox knows no other module's
    /// files).
    pub fn new(
        cli: Option<Mode>,
        settings: &Settings,
        own: &[PathBuf],
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Config {
        let mut mode = cli.or(settings.mode).unwrap_or(Mode::WorkspaceWrite);
        if cli.is_none()
            && let Some(project) = settings.project_mode
        {
            mode = mode.narrowed(project);
        }
        let chosen = cli.is_some() || settings.mode.is_some() || settings.project_mode.is_some();
        let fallback = settings.unavailable.unwrap_or(if chosen {
            Fallback::Refuse
        } else {
            Fallback::Unconfined
        });
        let home = env("HOME")
            .filter(|home| home.starts_with('/'))
            .map(PathBuf::from);
        let expand = |raw: &String| expand_home(raw, home.as_deref());
        let allowed: Vec<PathBuf> = settings.allow_read.iter().filter_map(expand).collect();
        let mut deny: Vec<PathBuf> = home
            .iter()
            .flat_map(|home| HOME_DENY.iter().map(move |rel| home.join(rel)))
            .collect();
        deny.extend(own.iter().cloned());
        deny.extend(settings.deny_read.iter().filter_map(expand));
        deny.retain(|path| !allowed.contains(path));
        deny.dedup();
        let flag = |name: &str| env(name).is_some_and(|v| !v.is_empty() && v != "0");
        Config {
            mode,
            fallback,
            deny,
            writable: settings.writable.iter().filter_map(expand).collect(),
            ports: settings.network_ports.clone(),
            protected_writable: settings
                .protected_writable
                .iter()
                .map(|name| name.trim_end_matches('/').to_owned())
                .collect(),
            mcp_servers: settings.mcp_servers.unwrap_or(Mode::Off),
            env_passthrough: settings.env_passthrough.clone(),
            home,
            no_landlock: flag("CALIBAN_SANDBOX_NO_LANDLOCK"),
            no_mount_ns: flag("CALIBAN_SANDBOX_NO_MOUNTNS"),
            userns_only: flag("CALIBAN_SANDBOX_USERNS"),
            no_mount_setattr: flag("CALIBAN_SANDBOX_NO_MOUNT_SETATTR"),
        }
    }

    /// `path` as shown to people: `~/…` under the home directory.
    fn show(&self, path: &Path) -> String {
        match self
            .home
            .as_deref()
            .and_then(|home| path.strip_prefix(home).ok())
        {
            Some(rest) if rest.as_os_str().is_empty() => "~".to_owned(),
            Some(rest) => format!("~/{}", rest.display()),
            None => path.display().to_string(),
        }
    }

    fn protected_allowed(&self, shown: &str) -> bool {
        let name = shown.trim_end_matches('/');
        self.protected_writable
            .iter()
            .any(|allowed| allowed == name)
    }
}

/// `~` and `~/…` under `home`; any other path must be absolute.
fn expand_home(raw: &String, home: Option<&Path>) -> Option<PathBuf> {
    if raw == "~" {
        return home.map(Path::to_path_buf);
    }
    if let Some(rest) = raw.strip_prefix("~/") {
        return home.map(|home| home.join(rest));
    }
    raw.starts_with('/').then(|| PathBuf::from(raw))
}

static CONFIG: OnceLock<Config> = OnceLock::new();

/// Sets the process-wide configuration; the first call wins. Call it once at start, before
/// any tool runs.
pub fn install(config: Config) {
    crate::secrets::install(config.env_passthrough.clone());
    let _ = CONFIG.set(config);
}

/// The process-wide configuration: the installed one, or the environment's defaults (with
/// none of caliban's own files, which only `app` knows: every command installs one first,
/// so only unit tests see these).
pub fn config() -> &'static Config {
    CONFIG.get_or_init(|| {
        Config::new(None, &Settings::default(), &[], &|name| {
            std::env::var(name).ok()
        })
    })
}

/// The kernel's Landlock ABI, or why there is none.
pub fn landlock_abi() -> Result<u32, String> {
    static ABI: OnceLock<Result<u32, String>> = OnceLock::new();
    if config().no_landlock {
        return Err("Landlock is switched off by CALIBAN_SANDBOX_NO_LANDLOCK".to_owned());
    }
    ABI.get_or_init(|| {
        sys::landlock_abi().map_err(|e| format!("the kernel offers no Landlock ({e})"))
    })
    .clone()
}

/// The mount namespace children can have, probed once (a throwaway fork) when first needed.
fn mount_ns() -> Option<MountNs> {
    static NS: OnceLock<Option<MountNs>> = OnceLock::new();
    let config = config();
    if config.no_mount_ns {
        return None;
    }
    *NS.get_or_init(|| sys::probe_mount_ns(config.userns_only))
}

/// Whether the read-only root can be made with `mount_setattr` (Linux 5.12), else by a
/// remount per mount point.
fn mount_setattr() -> bool {
    !config().no_mount_setattr && sys::has_mount_setattr()
}

/// Whether a mode is in force for commands, and if not, what happens instead.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Status {
    Off,
    Enforced,
    /// No Landlock: commands run with the user's full rights (`Fallback::Unconfined`).
    Unconfined(String),
    /// No Landlock: commands are refused (`Fallback::Refuse`).
    Refused(String),
}

pub fn status(mode: Mode) -> Status {
    if mode == Mode::Off {
        return Status::Off;
    }
    match landlock_abi() {
        Ok(_) => Status::Enforced,
        Err(why) => match config().fallback {
            Fallback::Refuse => Status::Refused(why),
            Fallback::Unconfined => Status::Unconfined(why),
        },
    }
}

/// Whether commands under `mode` are caliban's to confine (or refuse): a host that could
/// run them elsewhere (an editor's terminal) must not.
pub fn confines(mode: Mode) -> bool {
    matches!(status(mode), Status::Enforced | Status::Refused(_))
}

/// What `describe` and `sandbox check` say when the commands' process limit cannot hold.
const NO_PROCESS_LIMIT: &str = "no process limit: caliban runs as root, and the kernel never \
                                applies RLIMIT_NPROC to root (nor can caliban make a pids \
                                cgroup here), so a fork bomb is not stopped";

/// Whether commands run with no process limit: root, whom RLIMIT_NPROC does not bind,
/// where no pids cgroup can be made for them either.
fn no_process_limit() -> bool {
    sys::nproc_exempt() && sys::pids_cgroup_parent().is_none()
}

/// The sandbox as run headers state it (print mode's `system/init`, session files).
pub fn describe(mode: Mode) -> Value {
    match status(mode) {
        Status::Off => json!({"mode": "off", "enforced": false}),
        Status::Enforced if no_process_limit() => json!({"mode": mode.as_str(),
            "enforced": true, "caveat": NO_PROCESS_LIMIT}),
        Status::Enforced => json!({"mode": mode.as_str(), "enforced": true}),
        Status::Unconfined(why) => json!({"mode": mode.as_str(), "enforced": false,
                                          "commands": "unconfined", "why": why}),
        Status::Refused(why) => json!({"mode": mode.as_str(), "enforced": false,
                                       "commands": "refused", "why": why}),
    }
}

/// Says once, at start, what the sandbox will do: a warning when it cannot do what was
/// asked, a line at `-v` otherwise.
pub fn announce(mode: Mode) {
    match status(mode) {
        Status::Off => crate::log::info("sandbox: off: commands run with your full rights"),
        Status::Enforced => crate::log::info(&format!(
            "sandbox: {mode} (Landlock ABI {})",
            landlock_abi().unwrap_or_default()
        )),
        Status::Unconfined(why) => crate::log::warn(&format!(
            "sandbox: {why}: commands run UNCONFINED instead of {mode} (sandbox.unavailable is \
             \"unconfined\"; set it to \"refuse\" to refuse them)"
        )),
        Status::Refused(why) => crate::log::warn(&format!(
            "sandbox: {why}: commands are refused, since {mode} cannot be enforced (choose \
             --sandbox off, or set sandbox.unavailable to \"unconfined\", to run them anyway)"
        )),
    }
}

/// Protected entries a command may still make where they are missing: `git init` (and
/// `cargo new`, `npm init` and kin, which run it) is how a project starts, and a `.git`
/// only becomes read-only once it exists. Neither anchor holds a missing `.git` either
/// (sandbox-runtime and Codex fence the git directories they find).
const MADE_BY_COMMANDS: &[&str] = &[".git"];

/// What one command's confinement covers, as paths.
struct Plan {
    mode: Mode,
    /// Where it may write (canonical, existing), the workspace first.
    writable: Vec<PathBuf>,
    /// Protected paths it may not write (canonical, existing).
    protected: Vec<PathBuf>,
    /// Paths it may not read (canonical, existing), each with its configured spelling.
    denied: Vec<(PathBuf, PathBuf)>,
    /// Protected entries that do not exist yet (in a canonical directory), each with
    /// whether it is a directory: with a mount namespace, placeholders are made and bound
    /// read-only (`Placeholders`); without one, Landlock keeps them from being made.
    missing: Vec<(PathBuf, bool)>,
    /// Whether a mount namespace fences the protected and denied paths (else Landlock
    /// alone, which keeps new entries out of the directories that hold them).
    mount_ns: bool,
}

fn plan(mode: Mode, workspace: &Path, cwd: &Path) -> Plan {
    let config = config();
    let canonical = |path: &Path| path.canonicalize().ok();
    let workspace = canonical(workspace).unwrap_or_else(|| workspace.to_path_buf());
    let mut writable = Vec::new();
    if matches!(mode, Mode::WorkspaceWrite | Mode::Network) {
        writable.push(workspace.clone());
        let tmpdir = std::env::var_os("TMPDIR").map(PathBuf::from);
        let temps = tmpdir
            .into_iter()
            .filter(|dir| dir.is_absolute())
            .chain(TEMP_DIRS.iter().map(PathBuf::from));
        for dir in temps.chain(config.writable.iter().cloned()) {
            if let Some(dir) = canonical(&dir).filter(|dir| !writable.contains(dir)) {
                writable.push(dir);
            }
        }
    }
    // Protected entries in the workspace root and in every directory down to where the
    // command starts (a nested repository there has its own `.git`).
    let cwd = canonical(cwd).unwrap_or_else(|| workspace.clone());
    let mut dirs = vec![workspace.clone()];
    if let Ok(below) = cwd.strip_prefix(&workspace) {
        let mut dir = workspace.clone();
        for part in below.components() {
            dir.push(part);
            dirs.push(dir.clone());
        }
    }
    let mut protected = Vec::new();
    let mut missing: Vec<(PathBuf, bool)> = Vec::new();
    for dir in &dirs {
        for entry in PROTECTED {
            if config.protected_allowed(&entry.shown()) {
                continue;
            }
            let (rel, parent) = entry.on_disk();
            let path = dir.join(&rel);
            let found = if path.symlink_metadata().is_ok() {
                canonical(&path)
            } else if let Some(parent) = parent.map(|parent| dir.join(parent)) {
                // A protected file that does not exist yet cannot be held read-only, but the
                // directory it would be made in can, or be kept from being made.
                if parent.symlink_metadata().is_ok() {
                    canonical(&parent)
                } else {
                    if !missing.iter().any(|(m, _)| *m == parent) {
                        missing.push((parent, true));
                    }
                    None
                }
            } else if MADE_BY_COMMANDS.contains(&rel.as_str()) {
                None
            } else {
                missing.push((path, entry.is_dir()));
                None
            };
            if let Some(found) = found.filter(|found| !protected.contains(found)) {
                protected.push(found);
            }
        }
    }
    if writable.is_empty() {
        // Nothing can be made where nothing can be written.
        missing.clear();
    }
    // Most entries do not exist on a given machine: one lstat rules them out.
    let denied = config
        .deny
        .iter()
        .filter(|spelled| spelled.symlink_metadata().is_ok())
        .filter_map(|spelled| canonical(spelled).map(|real| (real, spelled.clone())))
        // Hiding what holds the workspace would hide the command's own directory.
        .filter(|(real, _)| !workspace.starts_with(real) && !cwd.starts_with(real))
        .collect();
    Plan {
        mode,
        writable,
        protected,
        denied,
        missing,
        mount_ns: mode != Mode::Off && mount_ns().is_some(),
    }
}

/// How many live commands of this process use each placeholder it made, by path.
fn placeholder_uses() -> std::sync::MutexGuard<'static, HashMap<PathBuf, usize>> {
    static USES: OnceLock<Mutex<HashMap<PathBuf, usize>>> = OnceLock::new();
    USES.get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Empty files and directories made where protected entries were missing, so that a
/// command's mount namespace can hold them read-only: a command could otherwise create
/// `.caliban/settings.json` and widen every later run. Owned by the job that runs the
/// command (a background shell's lives as long as the shell). Dropping it removes each
/// placeholder no other live command of this process still uses, if it is still empty:
/// removing a mount point detaches a live sandbox's bind of it.
#[derive(Debug, Default)]
pub struct Placeholders {
    /// The placeholders this command holds a use of.
    used: Vec<PathBuf>,
    /// Missing entries that appeared between the plan and now: bound read-only as they
    /// are, like any protected path.
    appeared: Vec<PathBuf>,
}

impl Placeholders {
    /// Makes (or takes another use of) a placeholder for each missing entry, and takes a
    /// use of each `protected` path that is a placeholder already (another command made
    /// it): whichever command ends first must not remove what the other still binds.
    /// What cannot be made is skipped (a command can make nothing there either).
    fn make(missing: &[(PathBuf, bool)], protected: &[PathBuf]) -> Placeholders {
        let mut uses = placeholder_uses();
        let mut held = Placeholders::default();
        let mut dirs = sys::DirCache::default();
        for path in protected {
            if let Some(n) = uses.get_mut(path) {
                *n += 1;
                held.used.push(path.clone());
            }
        }
        for (path, is_dir) in missing {
            if let Some(n) = uses.get_mut(path) {
                *n += 1;
                held.used.push(path.clone());
                continue;
            }
            // Never follows a symlink a command planted meanwhile, on the way or at the
            // end: caliban is not confined, and a command may swap what it can write.
            match sys::make_empty(path, *is_dir, &mut dirs) {
                Ok(()) => {
                    uses.insert(path.clone(), 1);
                    held.used.push(path.clone());
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                    held.appeared.push(path.clone());
                }
                Err(_) => {}
            }
        }
        held
    }

    /// What the command's mount namespace must bind read-only besides the plan's
    /// protected paths.
    fn binds<'a>(&'a self, plan: &'a Plan) -> Vec<PathBuf> {
        self.used
            .iter()
            .chain(&self.appeared)
            .filter(|path| !plan.protected.contains(path))
            .cloned()
            .collect()
    }
}

impl Drop for Placeholders {
    fn drop(&mut self) {
        let mut uses = placeholder_uses();
        for path in self.used.drain(..) {
            if let Some(n) = uses.get_mut(&path) {
                *n = n.saturating_sub(1);
            }
        }
        sweep_placeholders(&mut uses, false);
    }
}

/// Removes the placeholders no command uses any more (still empty ones only), but only
/// while no process that outlived its call is alive (`reaper::adopted_alive`), or
/// `at_exit` once `reaper::kill_all` is done: such a process (one that shed its tool-call
/// tag escapes the sweep of ended calls) may still have the placeholder bound in its
/// namespace, and removing the mount point would detach that bind and let it make the
/// protected entry after all. Until then an unused placeholder stays, at a use count of 0.
fn sweep_placeholders(uses: &mut HashMap<PathBuf, usize>, at_exit: bool) {
    if !uses.values().any(|&n| n == 0) {
        return;
    }
    if !at_exit && crate::reaper::adopted_alive() != Some(false) {
        return;
    }
    // In path order, so that the entries of one directory share its handle.
    let mut unused: Vec<PathBuf> = uses
        .iter()
        .filter(|&(_, &n)| n == 0)
        .map(|(path, _)| path.clone())
        .collect();
    unused.sort();
    let mut dirs = sys::DirCache::default();
    for path in unused {
        let _ = sys::remove_if_empty(&path, &mut dirs);
        uses.remove(&path);
    }
}

/// At exit, after every process a run started is gone (`reaper::kill_all`): removes the
/// placeholders still left.
pub fn remove_placeholders() {
    sweep_placeholders(&mut placeholder_uses(), true);
}

/// A command's confinement and the placeholders it needs while it runs.
pub struct Confined {
    pub confinement: Confinement,
    pub placeholders: Placeholders,
}

/// The confinement for a command run in `cwd` of `workspace` under `mode`: `None` when
/// nothing confines it (`off`, or no Landlock and `Fallback::Unconfined`); an error (the
/// tool result) when it must not run at all.
pub fn prepare(mode: Mode, workspace: &Path, cwd: &Path) -> Result<Option<Confined>, String> {
    match status(mode) {
        Status::Off | Status::Unconfined(_) => Ok(None),
        Status::Refused(why) => Err(format!(
            "not run: the sandbox ({mode}) cannot be enforced here: {why}; sandbox.unavailable \
             is \"refuse\""
        )),
        Status::Enforced => {
            let abi = landlock_abi().unwrap_or(1);
            let plan = plan(mode, workspace, cwd);
            let ns = mount_ns();
            let placeholders = match ns {
                Some(_) => Placeholders::make(&plan.missing, &plan.protected),
                None => Placeholders::default(),
            };
            let confinement = build(&plan, abi, ns, &placeholders.binds(&plan))
                .map_err(|e| format!("not run: the sandbox ({mode}) could not be set up: {e}"))?;
            Ok(Some(Confined {
                confinement,
                placeholders,
            }))
        }
    }
}

fn build(
    plan: &Plan,
    abi: u32,
    ns: Option<MountNs>,
    placeholders: &[PathBuf],
) -> io::Result<Confinement> {
    let config = config();
    let fs_rights = ll::fs_rights(abi);
    let read = ll::EXECUTE | ll::READ_FILE | ll::READ_DIR;
    // Device nodes are never made, so a command cannot mint a way to a raw disk.
    let write = fs_rights & !(ll::MAKE_CHAR | ll::MAKE_BLOCK);
    let net = match plan.mode {
        _ if abi < 4 => 0,
        Mode::Network if config.ports.is_empty() => ll::BIND_TCP,
        _ => ll::BIND_TCP | ll::CONNECT_TCP,
    };
    let scoped = if abi >= 6 {
        ll::SCOPE_ABSTRACT_UNIX_SOCKET | ll::SCOPE_SIGNAL
    } else {
        0
    };
    let ruleset = LandlockRuleset::new(fs_rights, net, scoped)?;
    let root = Path::new("/");
    // Listing stays open everywhere (names only); reading goes around the deny list, with
    // or without a mount namespace, so a view of the tree without the overmounts (a mount
    // syscall that got through) still reads nothing there.
    ruleset.allow_beneath(root, ll::READ_DIR)?;
    let denied: Vec<PathBuf> = plan.denied.iter().map(|(real, _)| real.clone()).collect();
    let mut budget = MAX_SPLIT_RULES;
    grant_around(&ruleset, root, read & !ll::READ_DIR, &denied, &mut budget);
    let mounts = match ns {
        Some(ns) => {
            // What lies in a writable directory is left to the mounts (protected paths
            // read-only, denied ones hidden): fencing it with Landlock too would grant
            // the directory entry by entry, and no command could make a new file at the
            // workspace root (`cargo build`'s `target/`, `npm install`'s `node_modules/`).
            for dir in &plan.writable {
                ruleset.allow_beneath(dir, write)?;
            }
            let mut mounts = MountPlan::new(ns);
            let writable: Vec<&Path> = plan.writable.iter().map(PathBuf::as_path).collect();
            mounts.read_only_root(&writable, mount_setattr())?;
            for path in plan.protected.iter().chain(placeholders) {
                mounts.read_only(path)?;
            }
            for (path, _) in &plan.denied {
                mounts.hide(path)?;
            }
            mounts.private_proc();
            Some(mounts)
        }
        None => {
            // Landlock alone: writing goes around the protected paths too, and around
            // those not made yet, so none can be made.
            let mut fenced = denied;
            fenced.extend(plan.protected.iter().cloned());
            fenced.extend(plan.missing.iter().map(|(path, _)| path.clone()));
            for dir in &plan.writable {
                grant_around(&ruleset, dir, write, &fenced, &mut budget);
            }
            None
        }
    };
    for device in DEVICES.iter().map(Path::new).filter(|d| d.exists()) {
        ruleset.allow_beneath(device, ll::READ_FILE | ll::WRITE_FILE | ll::READ_DIR)?;
    }
    if plan.mode == Mode::Network && abi >= 4 {
        // Port 0 is "any free port": a client that binds before it connects, a test server.
        ruleset.allow_port(0, ll::BIND_TCP)?;
        for &port in &config.ports {
            ruleset.allow_port(port, ll::CONNECT_TCP)?;
        }
    }
    Ok(Confinement {
        mounts,
        landlock: Some(ruleset),
        seccomp: Some(SeccompFilter::new(socket_policy(plan.mode))),
    })
}

/// Grants `access` on `dir` except beneath the `fenced` paths: one rule for a directory
/// with nothing fenced beneath it, else one for each of its entries in turn. Symlinks are
/// skipped (what they lead to is judged where it is). Failures only leave rights out.
fn grant_around(
    ruleset: &LandlockRuleset,
    dir: &Path,
    access: u64,
    fenced: &[PathBuf],
    budget: &mut usize,
) {
    if fenced.iter().any(|f| f == dir) {
        return;
    }
    if !fenced.iter().any(|f| f.starts_with(dir)) {
        if *budget > 0 {
            *budget -= 1;
            let _ = ruleset.allow_beneath(dir, access);
        }
        return;
    }
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        if entry.file_type().is_ok_and(|kind| !kind.is_symlink()) {
            grant_around(ruleset, &entry.path(), access, fenced, budget);
        }
    }
}

/// The confinement of an MCP stdio server an editor asks caliban to start in `cwd`: the
/// `sandbox.mcp_servers` mode (default `off`: they are programs the user configured, and
/// most need the network and caches of their own).
pub fn mcp_server(cwd: &Path) -> io::Result<Option<Confined>> {
    prepare(config().mcp_servers, cwd, cwd).map_err(io::Error::other)
}

/// The sandbox's answer for a file tool's call (`Write`, `Edit`, `Read`, …) on the path
/// the tool resolved (`abs`; `rel` to the workspace), which it `edits` or only reads: the
/// same policy as for commands, so a file tool cannot do what a command may not. `Err` is
/// why not, for the model. It needs no kernel support, so it holds even where commands run
/// unconfined. Which tools touch which path is the tool table's (`tools::check_in_sandbox`).
pub fn check_file_tool(
    mode: Mode,
    tool: &str,
    abs: &Path,
    rel: &str,
    edits: bool,
) -> Result<(), String> {
    if mode == Mode::Off {
        return Ok(());
    }
    let config = config();
    let denied = config.deny.iter().find(|spelled| {
        spelled.symlink_metadata().is_ok()
            && spelled
                .canonicalize()
                .is_ok_and(|real| abs.starts_with(real))
    });
    if let Some(spelled) = denied {
        return Err(format!(
            "{tool} of `{rel}` blocked by the sandbox ({mode}): {} is on its deny list",
            config.show(spelled)
        ));
    }
    if !edits {
        return Ok(());
    }
    if mode == Mode::ReadOnly {
        return Err(format!(
            "write to `{rel}` blocked by the sandbox (read-only): nothing may be written"
        ));
    }
    if let Some(entry) = protected_path(rel).filter(|e| !config.protected_allowed(&e.shown())) {
        return Err(format!(
            "write to `{rel}` blocked by the sandbox ({mode}): {} is a protected path ({}), \
             read-only unless sandbox.protected_writable lists it",
            entry.shown(),
            entry.why
        ));
    }
    Ok(())
}

/// Words with which tools report what the sandbox refused: Landlock and seccomp give
/// EACCES or EPERM, a read-only mount EROFS, a hidden file EACCES.
const DENIAL_MARKERS: &[&str] = &[
    "Permission denied",
    "Read-only file system",
    "Operation not permitted",
];

/// How a hidden (denied) file looks to a command.
const HIDDEN_MARKER: &str = "No such file or directory";

/// Words with which tools report a network they cannot reach.
const NETWORK_MARKERS: &[&str] = &[
    "Temporary failure in name resolution",
    "Could not resolve host",
    "Name or service not known",
    "Network is unreachable",
];

/// Most characters of a command's output searched for denials.
const MAX_EXPLAIN_CHARS: usize = 64 * 1024;

/// A note for the model when a command run under `mode` failed in a way the sandbox
/// explains: which rule, and what the command may do. `None` when nothing in `output`
/// points at the sandbox.
pub fn explain(mode: Mode, workspace: &Path, cwd: &Path, output: &str) -> Option<String> {
    if status(mode) != Status::Enforced {
        return None;
    }
    let text = crate::text::cut_chars(output, MAX_EXPLAIN_CHARS).map_or(output, |(head, _)| head);
    let plan = plan(mode, workspace, cwd);
    let config = config();
    let mut seen_denial = false;
    for line in text.lines() {
        // What the seccomp filter answers for any family off its allowlist.
        if line.contains("Address family not supported") {
            return Some(format!(
                "socket family refused by the sandbox ({mode}): commands may open {} \
                 sockets only (no netlink, vsock, packet or other families)",
                socket_policy(mode).families()
            ));
        }
        let network = !matches!(mode, Mode::Network | Mode::Off)
            && NETWORK_MARKERS.iter().any(|m| line.contains(m));
        if network {
            return Some(network_note(mode));
        }
        let resolve = |candidate: &String| {
            let path = expand_home(candidate, config.home.as_deref())
                .unwrap_or_else(|| PathBuf::from(candidate));
            cwd.join(path)
        };
        // A denied path is hidden: reading it says it is not there.
        if line.contains(HIDDEN_MARKER) {
            let denied = path_candidates(line)
                .iter()
                .find_map(|c| classify_denied(&plan, config, &resolve(c)));
            if denied.is_some() {
                return denied;
            }
            continue;
        }
        if !DENIAL_MARKERS.iter().any(|m| line.contains(m)) {
            continue;
        }
        seen_denial = true;
        // The likeliest path decides: a refusal of a path the sandbox allows was not its.
        if let Some(candidate) = path_candidates(line).first() {
            if let Some(note) = classify(&plan, config, &resolve(candidate)) {
                return Some(note);
            }
            continue;
        }
        let lower = line.to_ascii_lowercase();
        if !matches!(mode, Mode::Network)
            && ["connect", "socket", "errno 13", "network", "curl:"]
                .iter()
                .any(|word| lower.contains(word))
        {
            return Some(network_note(mode));
        }
    }
    seen_denial.then(|| {
        format!(
            "a \"permission denied\" here may be the sandbox ({mode}): {}",
            summary(&plan, config)
        )
    })
}

fn network_note(mode: Mode) -> String {
    format!(
        "network access blocked by the sandbox ({mode}): commands have no network (the \
         `network` mode allows outbound TCP)"
    )
}

/// What a confined command may do, in a sentence.
fn summary(plan: &Plan, config: &Config) -> String {
    let writes = if plan.writable.is_empty() {
        "commands may write nothing".to_owned()
    } else {
        let roots: Vec<String> = plan.writable.iter().map(|p| config.show(p)).collect();
        format!("commands may write only in {}", roots.join(", "))
    };
    let protected = if plan.protected.is_empty() || plan.writable.is_empty() {
        String::new()
    } else {
        let names: Vec<String> = PROTECTED
            .iter()
            .filter(|e| !config.protected_allowed(&e.shown()))
            .map(|e| e.shown())
            .collect();
        format!(
            " (protected paths such as {} are read-only)",
            names[..names.len().min(3)].join(", ")
        )
    };
    let network = match plan.mode {
        Mode::Network if config.ports.is_empty() => "reach the network over TCP".to_owned(),
        Mode::Network => {
            let ports: Vec<String> = config.ports.iter().map(u16::to_string).collect();
            format!("connect over TCP to ports {} only", ports.join(", "))
        }
        _ => "have no network".to_owned(),
    };
    format!("{writes}{protected}, read everything but the deny list, and {network}")
}

/// Why the sandbox hides `path`, if it does.
fn classify_denied(plan: &Plan, config: &Config, path: &Path) -> Option<String> {
    let lexical = normalize(path);
    let real = resolve_existing(&lexical);
    let (_, spelled) = plan
        .denied
        .iter()
        .find(|(denied, _)| real.starts_with(denied))?;
    Some(format!(
        "access to {} blocked by the sandbox ({}): {} is on its deny list",
        config.show(&lexical),
        plan.mode,
        config.show(spelled)
    ))
}

/// Why the sandbox would refuse `path`, if it would.
fn classify(plan: &Plan, config: &Config, path: &Path) -> Option<String> {
    let mode = plan.mode;
    if let Some(denied) = classify_denied(plan, config, path) {
        return Some(denied);
    }
    let lexical = normalize(path);
    let real = resolve_existing(&lexical);
    let protected = plan
        .protected
        .iter()
        .chain(plan.missing.iter().map(|(path, _)| path))
        .find(|p| real.starts_with(p));
    if let Some(protected) = protected {
        let why = protected
            .to_str()
            .and_then(protected_path)
            .map_or(String::new(), |entry| format!(" ({})", entry.why));
        return Some(format!(
            "write to {} blocked by the sandbox ({mode}): {} is a protected path, read-only to \
             commands{why}; sandbox.protected_writable can allow it",
            config.show(&lexical),
            config.show(protected)
        ));
    }
    if plan.writable.iter().any(|root| real.starts_with(root)) {
        // Landlock alone grants a directory that holds a fenced path entry by entry: what
        // is there may be written, nothing new made.
        let fenced = plan
            .protected
            .iter()
            .chain(plan.denied.iter().map(|(real, _)| real))
            .chain(plan.missing.iter().map(|(path, _)| path));
        let parent = real.parent().filter(|parent| {
            !plan.mount_ns
                && real.symlink_metadata().is_err()
                && fenced.clone().any(|f| f.starts_with(parent) && f != parent)
        });
        if let Some(parent) = parent {
            return Some(format!(
                "creating {} blocked by the sandbox ({mode}): without a mount namespace it \
                 keeps the protected and denied paths in {} out of reach by allowing only what \
                 is already there",
                config.show(&lexical),
                config.show(parent)
            ));
        }
        // Writable in the sandbox: whatever refused it, it was not the sandbox.
        return None;
    }
    if real.starts_with("/dev") || real.starts_with("/proc") {
        return None;
    }
    Some(format!(
        "write to {} blocked by the sandbox ({mode}): {}",
        config.show(&lexical),
        summary(plan, config)
    ))
}

/// `..` and `.` folded, lexically.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            std::path::Component::ParentDir => {
                out.pop();
            }
            std::path::Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

/// The path with its longest existing ancestor resolved (symlinks followed), the missing
/// rest appended: where a write to it would land.
fn resolve_existing(path: &Path) -> PathBuf {
    let mut existing = path;
    let mut tail = Vec::new();
    loop {
        if let Ok(real) = existing.canonicalize() {
            return tail
                .iter()
                .rev()
                .fold(real, |acc: PathBuf, name| acc.join(name));
        }
        match (existing.parent(), existing.file_name()) {
            (Some(parent), Some(name)) => {
                tail.push(name.to_owned());
                existing = parent;
            }
            _ => return path.to_path_buf(),
        }
    }
}

/// Strings on an error line that may be the path refused, likeliest first: the field just
/// before the error (`bash: line 1: FILE: Permission denied`), quoted ones (`'…'`, `"…"`,
/// `` `…' ``), the field after it (`Permission denied: 'FILE'`), then any word with a
/// slash (`could not lock config file .git/config`).
fn path_candidates(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let fields: Vec<&str> = line.split(": ").map(str::trim).collect();
    let marker = fields
        .iter()
        .position(|f| DENIAL_MARKERS.contains(f) || f.starts_with(HIDDEN_MARKER));
    if let Some(at) = marker.filter(|&at| at > 0) {
        out.push(fields[at - 1].to_owned());
    }
    for (open, close) in [('\'', '\''), ('"', '"'), ('`', '\''), ('‘', '’')] {
        let mut rest = line;
        while let Some(start) = rest.find(open) {
            let after = &rest[start + open.len_utf8()..];
            let Some(end) = after.find(close) else { break };
            out.push(after[..end].to_owned());
            rest = &after[end + close.len_utf8()..];
        }
    }
    if let Some(after) = marker.and_then(|at| fields.get(at + 1)) {
        out.push((*after).to_owned());
    }
    for word in line.split_whitespace() {
        let word = word.trim_matches(['\'', '"', '`', ':', ',', ';', '(', ')']);
        if word.contains('/') && !word.contains("://") {
            out.push(word.to_owned());
        }
    }
    out.iter_mut()
        .for_each(|c| *c = c.trim_matches(['\'', '"', '`']).to_owned());
    out.retain(|c| !c.is_empty() && !c.contains(' ') && !c.starts_with('['));
    out
}

/// The socket families `build` gives a mode's commands.
fn socket_policy(mode: Mode) -> SocketPolicy {
    if mode == Mode::Network {
        SocketPolicy::Inet
    } else {
        SocketPolicy::LocalOnly
    }
}

/// `caliban sandbox check`: what this machine offers, what the configured mode does here,
/// and a live test of it. The text to print, and whether the mode is enforced.
pub fn check_report(workspace: &Path) -> (String, bool) {
    let config = config();
    let mut out = String::new();
    let mut line = |text: String| {
        out.push_str(&text);
        out.push('\n');
    };
    match landlock_abi() {
        Ok(abi) => {
            let mut parts = vec!["files"];
            if abi >= 4 {
                parts.push("TCP bind/connect");
            }
            if abi >= 6 {
                parts.push("signal and abstract-socket scopes");
            }
            line(format!("landlock:        ABI {abi} ({})", parts.join(", ")));
        }
        Err(why) => line(format!("landlock:        unavailable: {why}")),
    }
    let sockets = socket_policy(config.mode);
    if cfg!(any(target_arch = "x86_64", target_arch = "aarch64")) {
        line(format!(
            "seccomp:         syscalls from {} up (not yet reviewed) fail as missing; denied: \
             mounts (open_tree_attr too), namespaces (unshare, setns, clone3, clone with \
             namespace flags), io_uring, keyrings, BPF, modules",
            sys::FIRST_UNREVIEWED_SYSCALL
        ));
        line(format!(
            "sockets:         {} in {}; any other family refused",
            sockets.families(),
            config.mode
        ));
    } else {
        line("seccomp:         not on this architecture (Landlock alone)".to_owned());
    }
    line(
        "capabilities:    all dropped (bounding, ambient, effective, permitted, inheritable), \
         securebits locked"
            .to_owned(),
    );
    line(if no_process_limit() {
        format!("processes:       {NO_PROCESS_LIMIT}")
    } else if let Some(parent) = sys::nproc_exempt().then(sys::pids_cgroup_parent).flatten() {
        format!(
            "processes:       a pids cgroup of {} per command under {} (caliban runs as \
             root, whom RLIMIT_NPROC does not bind)",
            sys::NPROC_LIMIT,
            parent.display()
        )
    } else {
        format!(
            "processes:       RLIMIT_NPROC {} (per command in a user namespace, else per user)",
            sys::NPROC_LIMIT
        )
    });
    line(format!(
        "mount namespace: {}",
        match mount_ns() {
            Some(MountNs::Plain) => "yes: protected paths read-only, deny list hidden",
            Some(MountNs::User) =>
                "yes, in a user namespace: protected paths read-only, deny list hidden (your \
                 other processes stay visible in /proc)",
            None =>
                "no: Landlock alone fences protected and denied paths (no new entries in the directories that hold them)",
        }
    ));
    line(format!(
        "read-only root:  {}",
        match mount_ns() {
            Some(_) if mount_setattr() =>
                "every mount read-only and nosuid but the writable directories (mount_setattr)",
            Some(_) =>
                "every mount read-only and nosuid but the writable directories (a remount per mount: no mount_setattr before Linux 5.12)",
            None =>
                "no: without a mount namespace nothing stops chmod, chown, utimes, setxattr or chattr on files outside the writable directories (Landlock does not cover them)",
        }
    ));
    line(format!(
        "landlock fences: {}",
        match mount_ns() {
            Some(_) =>
                "the deny list outside the writable directories (as well as the mounts); protected paths by the read-only mounts only",
            None => "the deny list and protected paths, the missing ones included",
        }
    ));
    line(format!(
        "placeholders:    {}",
        match mount_ns() {
            Some(_) =>
                "a missing protected entry is made empty and bound read-only while a command runs, removed after",
            None =>
                "none: Landlock keeps a missing protected entry from being made (no new entries at the workspace root)",
        }
    ));
    let mode = config.mode;
    let verdict = match status(mode) {
        Status::Off => "off: commands run with your full rights".to_owned(),
        Status::Enforced => "enforced".to_owned(),
        Status::Unconfined(_) => "NOT enforced: commands run unconfined".to_owned(),
        Status::Refused(_) => "NOT enforced: commands are refused".to_owned(),
    };
    line(format!("mode:            {mode} ({verdict})"));
    let plan = plan(mode, workspace, workspace);
    line(format!(
        "in {}: {}",
        workspace.display(),
        summary(&plan, config)
    ));
    let denied: Vec<String> = config.deny.iter().map(|p| config.show(p)).collect();
    line(format!("deny list:       {}", denied.join(", ")));
    let protected: Vec<String> = PROTECTED
        .iter()
        .map(|e| e.shown())
        .filter(|shown| !config.protected_allowed(shown))
        .collect();
    line(format!("protected:       {}", protected.join(", ")));
    let enforced = match self_test() {
        Ok(notes) => {
            line(format!(
                "self-test:       ok (read-only refused a write that workspace-write allowed; \
                 a confined probe had {notes})"
            ));
            status(mode) == Status::Enforced || mode == Mode::Off
        }
        Err(why) => {
            line(format!("self-test:       FAILED: {why}"));
            false
        }
    };
    let mut probes_hold = true;
    if mode != Mode::Off && landlock_abi().is_ok() {
        for (name, result) in probes() {
            match result {
                Ok(what) => line(format!("probe {name}{what}")),
                Err(why) => {
                    probes_hold = false;
                    line(format!("probe {name}FAILED: {why}"));
                }
            }
        }
    }
    (out, enforced && probes_hold)
}

/// Live tests of the layers `check_report` names, each in a confined child: the read-only
/// root, Landlock's fence of the deny list, and the placeholders. `Ok` says what held.
fn probes() -> Vec<(&'static str, Result<String, String>)> {
    let scratch =
        std::env::temp_dir().join(format!("caliban-sandbox-probe-{}", std::process::id()));
    let _ = fs::remove_dir_all(&scratch);
    if let Err(e) = fs::create_dir_all(scratch.join("ws")).and_then(|()| {
        fs::create_dir_all(scratch.join("denied"))?;
        fs::write(scratch.join("denied/key"), "k")
    }) {
        return vec![("setup:", Err(format!("scratch directory: {e}")))];
    }
    let scratch = scratch.canonicalize().unwrap_or(scratch);
    let ws = scratch.join("ws");
    let run = |script: &str| -> Result<(bool, String), String> {
        let Confined {
            confinement,
            placeholders: _placeholders,
        } = prepare(Mode::WorkspaceWrite, &ws, &ws)?
            .ok_or_else(|| "nothing to confine with".to_owned())?;
        let mut cmd = std::process::Command::new("/bin/sh");
        cmd.arg("-c")
            .arg(script)
            .current_dir(&ws)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped());
        sys::confine(&mut cmd, confinement);
        let out = cmd
            .output()
            .map_err(|e| format!("cannot run /bin/sh: {e}"))?;
        Ok((
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        ))
    };
    let mut out = Vec::new();
    if mount_ns().is_some() {
        // chmod to the mode / already has: a no-op if the sandbox let it through.
        use std::os::unix::fs::PermissionsExt;
        let result = match fs::metadata("/").map(|m| m.permissions().mode() & 0o7777) {
            Err(e) => Err(format!("cannot stat /: {e}")),
            Ok(mode) => run(&format!("chmod {mode:o} /")).and_then(|(ok, err)| {
                if !ok && err.contains("Read-only file system") {
                    Ok("ok (chmod of / refused: read-only file system)".to_owned())
                } else {
                    Err(format!("chmod of / was not refused as read-only: {err}"))
                }
            }),
        };
        out.push(("read-only root:  ", result));
        let plan = Plan {
            mode: Mode::WorkspaceWrite,
            writable: vec![ws.clone()],
            protected: Vec::new(),
            denied: vec![(scratch.join("denied"), scratch.join("denied"))],
            missing: Vec::new(),
            mount_ns: true,
        };
        let abi = landlock_abi().unwrap_or(1);
        let result = build(&plan, abi, mount_ns(), &[])
            .map_err(|e| format!("cannot build the fence: {e}"))
            .and_then(|confinement| {
                if landlock_lets_read(confinement, &scratch.join("denied/key")) {
                    Err("Landlock alone let a denied file be read".to_owned())
                } else {
                    Ok("ok (without the mounts, Landlock refused a denied file)".to_owned())
                }
            });
        out.push(("landlock fences: ", result));
    }
    let result = run("mkdir .caliban").and_then(|(ok, err)| {
        // The probe was reaped and nothing else of ours runs here: its placeholders go now,
        // as a serve command's go once no process that outlived its call is alive.
        remove_placeholders();
        let left = ws.join(".caliban").symlink_metadata().is_ok();
        match (ok, left) {
            (true, _) => Err("a command made .caliban/".to_owned()),
            (false, true) => Err(format!("a placeholder was left behind ({})", err.trim())),
            (false, false) => {
                Ok("ok (a command could not make .caliban/, nothing left)".to_owned())
            }
        }
    });
    out.push(("placeholders:    ", result));
    let _ = fs::remove_dir_all(&scratch);
    out
}

/// Whether `cat FILE` succeeds under the Landlock part of `confinement` alone (no mounts,
/// no seccomp): what Landlock itself grants.
fn landlock_lets_read(confinement: Confinement, file: &Path) -> bool {
    let only_landlock = Confinement {
        mounts: None,
        landlock: confinement.landlock,
        seccomp: None,
    };
    let mut cmd = std::process::Command::new("/bin/cat");
    cmd.arg(file)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    sys::confine(&mut cmd, only_landlock);
    cmd.status().is_ok_and(|status| status.success())
}

/// Runs `sh -c 'echo > FILE'` confined in a scratch workspace, twice: `read-only` must
/// refuse it, `workspace-write` allow it. Then a child confined as `workspace-write`
/// checks the rest (`probe`). Ok is what the probe found, as a phrase.
fn self_test() -> Result<String, String> {
    landlock_abi()?;
    let workspace =
        std::env::temp_dir().join(format!("caliban-sandbox-check-{}", std::process::id()));
    fs::create_dir_all(&workspace).map_err(|e| format!("scratch directory: {e}"))?;
    // The file is there before: without a mount namespace no new entry may be made at a
    // workspace root (Landlock grants it entry by entry around the protected ones).
    fs::write(workspace.join("probe"), "").map_err(|e| format!("scratch file: {e}"))?;
    let try_write = |mode: Mode| -> Result<bool, String> {
        let Confined {
            confinement,
            placeholders: _placeholders,
        } = prepare(mode, &workspace, &workspace)?
            .ok_or_else(|| "nothing to confine with".to_owned())?;
        let mut cmd = std::process::Command::new("/bin/sh");
        cmd.arg("-c")
            .arg("echo probe > \"$1\"")
            .arg("sh")
            .arg(workspace.join("probe"))
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        sys::confine(&mut cmd, confinement);
        let status = cmd
            .status()
            .map_err(|e| format!("cannot run /bin/sh: {e}"))?;
        Ok(status.success())
    };
    let result = match (try_write(Mode::ReadOnly), try_write(Mode::WorkspaceWrite)) {
        (Err(e), _) | (_, Err(e)) => Err(e),
        (Ok(true), _) => Err("read-only let a command write".to_owned()),
        (_, Ok(false)) => Err("workspace-write refused a write in the workspace".to_owned()),
        (Ok(false), Ok(true)) => Ok(()),
    };
    let result = result.and_then(|()| {
        let confined = prepare(Mode::WorkspaceWrite, &workspace, &workspace)?
            .ok_or_else(|| "nothing to confine with".to_owned())?;
        probe(&confined.confinement)
    });
    let _ = fs::remove_dir_all(&workspace);
    result
}

/// What a confined child found it could still do: an error naming each hole, else what
/// it checked.
fn probe(confinement: &Confinement) -> Result<String, String> {
    let found = sys::probe_confinement(confinement).map_err(|e| format!("probe child: {e}"))?;
    match found.failed {
        Some(0) => return Err("the confinement could not be applied".to_owned()),
        Some(errno) => {
            return Err(format!(
                "the confinement could not be applied: {}",
                io::Error::from_raw_os_error(errno)
            ));
        }
        None => {}
    }
    let mut holes = Vec::new();
    if found.caps_left {
        holes.push("capabilities left after the drop".to_owned());
    }
    if found.unreviewed_reached {
        holes.push(format!(
            "syscall {} reached the kernel",
            sys::FIRST_UNREVIEWED_SYSCALL
        ));
    }
    if found.foreign_socket {
        holes.push("an AF_NETLINK or AF_VSOCK socket opened".to_owned());
    }
    if found.new_namespace {
        holes.push("clone(CLONE_NEWUSER) made a namespace".to_owned());
    }
    if found.nproc_unlimited {
        holes.push(format!("RLIMIT_NPROC above {}", sys::NPROC_LIMIT));
    }
    if !holes.is_empty() {
        return Err(holes.join(", "));
    }
    let bounding = if found.bounding_left {
        "CapBnd kept (no CAP_SETPCAP to drop it; under no_new_privs it grants nothing)"
    } else {
        "CapBnd 0"
    };
    let filtered = if cfg!(any(target_arch = "x86_64", target_arch = "aarch64")) {
        format!(
            ", syscall {} ENOSYS, netlink and vsock refused, clone(CLONE_NEWUSER) refused",
            sys::FIRST_UNREVIEWED_SYSCALL
        )
    } else {
        String::new()
    };
    Ok(format!(
        "CapEff 0, {bounding}{filtered}, RLIMIT_NPROC {}",
        sys::NPROC_LIMIT
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_configuration_resolves_flag_settings_and_defaults() {
        let env = |name: &str| match name {
            "HOME" => Some("/home/u".to_owned()),
            _ => None,
        };
        let none = Settings::default();
        let default = Config::new(None, &none, &[], &env);
        assert_eq!(default.mode, Mode::WorkspaceWrite);
        assert_eq!(default.fallback, Fallback::Unconfined);
        assert!(default.deny.contains(&PathBuf::from("/home/u/.ssh")));
        assert_eq!(default.mcp_servers, Mode::Off);

        // A workspace may narrow, never widen; the user's own choice is refused, not
        // downgraded, where it cannot be enforced.
        let project = Settings {
            mode: Some(Mode::Network),
            project_mode: Some(Mode::ReadOnly),
            ..Settings::default()
        };
        let narrowed = Config::new(None, &project, &[], &env);
        assert_eq!(narrowed.mode, Mode::ReadOnly);
        assert_eq!(narrowed.fallback, Fallback::Refuse);
        let wider = Settings {
            project_mode: Some(Mode::Off),
            ..Settings::default()
        };
        assert_eq!(
            Config::new(None, &wider, &[], &env).mode,
            Mode::WorkspaceWrite
        );
        // The command line wins.
        assert_eq!(
            Config::new(Some(Mode::Off), &project, &[], &env).mode,
            Mode::Off
        );

        let lists = Settings {
            deny_read: vec!["~/secrets".into(), "relative".into()],
            allow_read: vec!["~/.npmrc".into()],
            writable: vec!["~/.cache".into()],
            protected_writable: vec![".git/".into()],
            ..Settings::default()
        };
        let config = Config::new(None, &lists, &[PathBuf::from("/etc/key.pem")], &env);
        assert!(config.deny.contains(&PathBuf::from("/home/u/secrets")));
        assert!(config.deny.contains(&PathBuf::from("/etc/key.pem")));
        assert!(!config.deny.contains(&PathBuf::from("/home/u/.npmrc")));
        assert!(!config.deny.iter().any(|p| p.ends_with("relative")));
        assert_eq!(config.writable, [PathBuf::from("/home/u/.cache")]);
        assert!(config.protected_allowed(".git/") && !config.protected_allowed(".caliban/"));
        assert_eq!(config.show(Path::new("/home/u/.ssh")), "~/.ssh");
    }

    #[test]
    fn landlock_grants_no_read_beneath_a_denied_path_with_or_without_mounts() {
        let Ok(abi) = landlock_abi() else {
            return;
        };
        let root = std::env::temp_dir().join(format!("caliban-fence-{}", std::process::id()));
        let (ws, secret) = (root.join("ws"), root.join("secret"));
        fs::create_dir_all(&ws).unwrap();
        fs::create_dir_all(&secret).unwrap();
        fs::write(secret.join("key"), "k").unwrap();
        fs::write(root.join("open.txt"), "o").unwrap();
        let root = root.canonicalize().unwrap();
        let (ws, secret) = (root.join("ws"), root.join("secret"));
        let plan = Plan {
            mode: Mode::WorkspaceWrite,
            writable: vec![ws.clone()],
            protected: Vec::new(),
            denied: vec![(secret.clone(), secret.clone())],
            missing: Vec::new(),
            mount_ns: false,
        };
        for ns in [Some(MountNs::Plain), None] {
            let confinement = build(&plan, abi, ns, &[]).expect("build");
            assert!(
                !landlock_lets_read(confinement, &secret.join("key")),
                "{ns:?}"
            );
            let confinement = build(&plan, abi, ns, &[]).expect("build");
            assert!(
                landlock_lets_read(confinement, &root.join("open.txt")),
                "{ns:?}"
            );
        }
        let _ = fs::remove_dir_all(&root);
    }

    #[test]
    fn error_lines_name_their_paths() {
        let cases = [
            ("bash: /etc/hosts: Permission denied", "/etc/hosts"),
            ("touch: cannot touch '/etc/x': Permission denied", "/etc/x"),
            (
                "PermissionError: [Errno 13] Permission denied: '/root/.ssh/id_rsa'",
                "/root/.ssh/id_rsa",
            ),
            (
                "error: could not lock config file .git/config: Read-only file system",
                ".git/config",
            ),
            (
                "cat: ~/.ssh/id_ed25519: Permission denied",
                "~/.ssh/id_ed25519",
            ),
            ("/bin/bash: line 1: y.txt: Permission denied", "y.txt"),
            (
                "cat: /home/u/.ssh/id_rsa: No such file or directory",
                "/home/u/.ssh/id_rsa",
            ),
        ];
        for (line, path) in cases {
            let found = path_candidates(line);
            assert_eq!(
                found.first().map(String::as_str),
                Some(path),
                "{line}: {found:?}"
            );
        }
        assert!(path_candidates("Permission denied").is_empty());
    }
}
