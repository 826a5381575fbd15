//! Beneath-resolution for the file tools. A path is checked once by name (`tools::fs`'s
//! rooting, the sandbox's `check_file_tool`, the permission policy), but a command the
//! model started may run at the same time and swap any directory on the way for a symlink
//! (`renameat2(RENAME_EXCHANGE)` in a loop). So every open, create, rename and unlink a file
//! tool makes is relative to a handle opened from the workspace root, one component at a
//! time, following no symlink (`sys::open_beneath`: openat2 with RESOLVE_BENEATH |
//! RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS, or openat with O_NOFOLLOW on kernels before
//! 5.6, which for a single component is the same guarantee). What was checked by name is
//! then what is opened: the names are the canonical ones the check saw, so a symlink found
//! on the way now means the tree changed under the tool, and the call is refused.
//!
//! Names alone cannot see two things, so every handle is also compared by identity (device
//! and inode) with the fenced files (`Fence`): a hard link to a protected file, or a
//! directory the deny list names reached under another name (a workspace that is `$HOME`, a
//! bind mount). The rule is agreement: a handle that is a fenced file must have been named
//! as that file, so that the checks by name already judged it.

use std::cell::OnceCell;
use std::ffi::OsStr;
use std::fs::{self, File, Metadata};
use std::io::{self, Write as _};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::policy::{PROTECTED, protected_path};
use crate::sys::{self, OpenAs};

/// Entries of a protected directory recorded by identity, so a hard link to one of them is
/// known under another name. Protected directories hold few files (`.git`'s own are its
/// config and hooks, which are listed by name); past this the rest are known by name only.
const FENCE_MAX_ENTRIES: usize = 512;

/// Entries of deny-listed directories looked at to find which file a hard-linked one is
/// (`~/.ssh` and kin are small); looked at once per call, only when a file with more than one
/// link is opened.
const DENY_SCAN_MAX_ENTRIES: usize = 4096;

/// Why a step beneath the workspace was refused; `at` is workspace-relative.
#[derive(Debug)]
pub(crate) enum Refusal {
    /// A component is a symlink (the tree changed after the path was checked).
    Symlink {
        at: String,
    },
    /// A component on the way is not a directory.
    NotDir {
        at: String,
    },
    /// The handle is a fenced file reached under another name.
    Fenced {
        at: String,
        what: String,
    },
    Io {
        at: String,
        err: io::Error,
    },
}

impl Refusal {
    /// The refusal for the model, for a call on `rel`.
    pub(crate) fn message(&self, rel: &str) -> String {
        match self {
            Refusal::Symlink { at } => format!(
                "`{at}` is a symlink now (it changed after `{rel}` was checked); file tools \
                 do not follow symlinks there, so nothing was done; name the real path"
            ),
            Refusal::NotDir { at } => format!("`{at}` is not a directory"),
            Refusal::Fenced { at, what } => format!(
                "`{at}` is the same file as {what} under another name (a hard link, a \
                 mount or a moved directory); refused, name {what} itself"
            ),
            Refusal::Io { at, err } => match err.kind() {
                io::ErrorKind::NotFound => format!("`{at}` does not exist"),
                io::ErrorKind::PermissionDenied => format!("permission denied for `{at}`"),
                _ => format!("cannot access `{at}`: {err}"),
            },
        }
    }

    pub(crate) fn is_not_found(&self) -> bool {
        matches!(self, Refusal::Io { err, .. } if err.kind() == io::ErrorKind::NotFound)
    }
}

/// What a fenced identity is.
#[derive(Debug)]
enum Fenced {
    /// A protected path (`policy::PROTECTED`) of the workspace; `shown` is its name.
    Protected { shown: String },
    /// A path on the sandbox's deny list, canonical.
    Denied { real: PathBuf },
}

#[derive(Debug)]
struct FenceEntry {
    dev: u64,
    ino: u64,
    kind: Fenced,
}

/// The fenced files by identity, for one call.
struct Fence {
    entries: Vec<FenceEntry>,
    /// The regular files below the deny list's directories, found once, the first time a
    /// file with more than one link is opened.
    denied_files: OnceCell<Vec<FenceEntry>>,
    deny_dirs: Vec<PathBuf>,
}

impl Fence {
    fn new(root: &Path, deny: &[PathBuf]) -> Fence {
        let mut entries = Vec::new();
        let mut budget = FENCE_MAX_ENTRIES;
        for entry in PROTECTED {
            let (on_disk, _) = entry.on_disk();
            let path = root.join(&on_disk);
            let Ok(meta) = path.symlink_metadata() else {
                continue;
            };
            if meta.file_type().is_symlink() {
                continue;
            }
            entries.push(identity(
                &meta,
                Fenced::Protected {
                    shown: on_disk.clone(),
                },
            ));
            if meta.is_dir() {
                // `.git`'s objects are many and never edited in place; its config and hooks are
                // what a hard link would be made to.
                let dirs: Vec<PathBuf> = if on_disk == ".git" {
                    vec![path.join("hooks"), path.join("info")]
                } else {
                    vec![path.clone()]
                };
                if on_disk == ".git" {
                    for name in ["config", "HEAD", "index", "packed-refs"] {
                        if let Ok(meta) = path.join(name).symlink_metadata() {
                            entries.push(identity(
                                &meta,
                                Fenced::Protected {
                                    shown: format!(".git/{name}"),
                                },
                            ));
                        }
                    }
                }
                for dir in dirs {
                    let Ok(read) = fs::read_dir(&dir) else {
                        continue;
                    };
                    for child in read.flatten() {
                        if budget == 0 {
                            break;
                        }
                        budget -= 1;
                        if let Ok(meta) = child.path().symlink_metadata()
                            && !meta.file_type().is_symlink()
                        {
                            let rel = child.path();
                            let rel = rel.strip_prefix(root).unwrap_or(&rel);
                            entries.push(identity(
                                &meta,
                                Fenced::Protected {
                                    shown: rel.to_string_lossy().into_owned(),
                                },
                            ));
                        }
                    }
                }
            }
        }
        let mut deny_dirs = Vec::new();
        for spelled in deny {
            let Ok(real) = spelled.canonicalize() else {
                continue;
            };
            let Ok(meta) = real.metadata() else {
                continue;
            };
            if meta.is_dir() {
                deny_dirs.push(real.clone());
            }
            entries.push(identity(&meta, Fenced::Denied { real }));
        }
        Fence {
            entries,
            denied_files: OnceCell::new(),
            deny_dirs,
        }
    }

    /// Refuses `meta` (the handle opened for `rel`, workspace-relative, lexically `abs`) if
    /// it is a fenced file that `rel` does not name.
    fn check(&self, meta: &Metadata, rel: &str, abs: &Path) -> Result<(), Refusal> {
        let found = self
            .entries
            .iter()
            .find(|entry| entry.dev == meta.dev() && entry.ino == meta.ino());
        let found = match found {
            Some(found) => Some(found),
            None if meta.is_file() && meta.nlink() > 1 => self
                .denied_files()
                .iter()
                .find(|entry| entry.dev == meta.dev() && entry.ino == meta.ino()),
            None => None,
        };
        let Some(found) = found else {
            return Ok(());
        };
        let (agrees, what) = match &found.kind {
            Fenced::Protected { shown } => (protected_path(rel).is_some(), format!("`{shown}`")),
            Fenced::Denied { real } => (
                abs.starts_with(real),
                format!("{} (on the sandbox's deny list)", real.display()),
            ),
        };
        if agrees {
            Ok(())
        } else {
            Err(Refusal::Fenced {
                at: rel.to_owned(),
                what,
            })
        }
    }

    fn denied_files(&self) -> &[FenceEntry] {
        self.denied_files.get_or_init(|| {
            let mut found = Vec::new();
            let mut budget = DENY_SCAN_MAX_ENTRIES;
            let mut stack = self.deny_dirs.clone();
            while let Some(dir) = stack.pop() {
                let Ok(read) = fs::read_dir(&dir) else {
                    continue;
                };
                for child in read.flatten() {
                    if budget == 0 {
                        return found;
                    }
                    budget -= 1;
                    let path = child.path();
                    let Ok(meta) = path.symlink_metadata() else {
                        continue;
                    };
                    if meta.is_dir() {
                        stack.push(path);
                    } else if meta.is_file() {
                        found.push(identity(&meta, Fenced::Denied { real: path }));
                    }
                }
            }
            found
        })
    }
}

fn identity(meta: &Metadata, kind: Fenced) -> FenceEntry {
    FenceEntry {
        dev: meta.dev(),
        ino: meta.ino(),
        kind,
    }
}

/// Each workspace's directory by identity (device, inode) as a run starting in it found it
/// (`pin`), keyed by the path runs name it by.
static PINNED: Mutex<Vec<(PathBuf, u64, u64)>> = Mutex::new(Vec::new());

/// Most workspaces remembered; a long-lived server past it forgets the oldest, whose next
/// run pins it again.
const MAX_PINNED: usize = 256;

/// Records what `workspace` is now, as a run starts in it: the file tools then refuse a
/// workspace path that has become another directory (renamed away and replaced by a
/// symlink, which a command may do to a workspace in a directory it can write).
pub(crate) fn pin(workspace: &Path) {
    let Ok(meta) = fs::metadata(workspace) else {
        return;
    };
    let mut pinned = PINNED.lock().unwrap_or_else(|poison| poison.into_inner());
    pinned.retain(|(path, _, _)| path != workspace);
    if pinned.len() >= MAX_PINNED {
        pinned.remove(0);
    }
    pinned.push((workspace.to_path_buf(), meta.dev(), meta.ino()));
}

/// Refuses `fd`, just opened for `workspace`, if a run pinned that path to another
/// directory.
fn check_pinned(workspace: &Path, root: &Path, file: &File) -> Result<(), String> {
    let pinned = PINNED.lock().unwrap_or_else(|poison| poison.into_inner());
    let Some(&(_, dev, ino)) = pinned
        .iter()
        .find(|(path, _, _)| path == workspace || path == root)
    else {
        return Ok(());
    };
    drop(pinned);
    let meta = file
        .metadata()
        .map_err(|err| format!("the workspace {} is not accessible: {err}", root.display()))?;
    if (meta.dev(), meta.ino()) == (dev, ino) {
        Ok(())
    } else {
        Err(format!(
            "the workspace {} is no longer the directory the run started in (it was moved \
             or replaced, perhaps by a symlink); file tools refuse to work in it",
            workspace.display()
        ))
    }
}

/// A handle on the workspace root and the fence for one file-tool call.
pub(crate) struct Beneath {
    root: PathBuf,
    fd: OwnedFd,
    fence: Fence,
}

/// An open directory beneath the workspace and its workspace-relative name (`.` for the
/// root).
pub(crate) struct Dir {
    pub(crate) fd: OwnedFd,
    pub(crate) rel: String,
}

impl Dir {
    /// The workspace-relative name of `name` in this directory.
    pub(crate) fn child_rel(&self, name: &OsStr) -> String {
        let name = name.to_string_lossy();
        if self.rel == "." {
            name.into_owned()
        } else {
            format!("{}/{name}", self.rel)
        }
    }
}

impl Beneath {
    /// Opens the canonical workspace `root`, fenced by the protected paths in it and by
    /// `deny` (the sandbox's deny list).
    #[cfg(test)]
    pub(crate) fn open(root: &Path, deny: &[PathBuf]) -> Result<Beneath, String> {
        Beneath::open_as(root, root, deny)
    }

    /// `open` of the canonical `root` of the workspace a run names `workspace`.
    pub(crate) fn open_as(
        workspace: &Path,
        root: &Path,
        deny: &[PathBuf],
    ) -> Result<Beneath, String> {
        let fd = File::open(root)
            .map_err(|err| format!("the workspace {} is not accessible: {err}", root.display()))?;
        check_pinned(workspace, root, &fd)?;
        Ok(Beneath {
            root: root.to_path_buf(),
            fd: fd.into(),
            fence: Fence::new(root, deny),
        })
    }

    /// Whether `meta` is on the sandbox's deny list (a listed path or a file below one),
    /// whatever it was named: a walk enters and reads none of them.
    pub(crate) fn is_denied(&self, meta: &Metadata) -> bool {
        let same = |entry: &FenceEntry| entry.dev == meta.dev() && entry.ino == meta.ino();
        self.fence
            .entries
            .iter()
            .any(|entry| matches!(entry.kind, Fenced::Denied { .. }) && same(entry))
            || (meta.is_file() && meta.nlink() > 1 && self.fence.denied_files().iter().any(same))
    }

    /// The lexical absolute path of workspace-relative `rel`.
    pub(crate) fn path_of(&self, rel: &str) -> PathBuf {
        if rel == "." {
            self.root.clone()
        } else {
            self.root.join(rel)
        }
    }

    fn check(&self, meta: &Metadata, rel: &str) -> Result<(), Refusal> {
        let abs = if rel == "." {
            self.root.clone()
        } else {
            self.root.join(rel)
        };
        self.fence.check(meta, rel, &abs)
    }

    /// Opens the directory `rel` (workspace-relative, `/`-separated, no `..`), one component
    /// at a time; with `create`, missing directories are made on the way.
    pub(crate) fn dir(&self, rel: &str, create: bool) -> Result<Dir, Refusal> {
        let fd = self.fd.try_clone().map_err(|err| Refusal::Io {
            at: ".".to_owned(),
            err,
        })?;
        let mut dir = Dir {
            fd,
            rel: ".".to_owned(),
        };
        // Every component is checked before any is made, so `a/../..` makes no `a`.
        let mut names = Vec::new();
        for part in Path::new(rel).components() {
            match part {
                Component::CurDir => {}
                Component::Normal(name) => names.push(name),
                _ => {
                    return Err(Refusal::Io {
                        at: rel.to_owned(),
                        err: io::Error::from_raw_os_error(libc::EINVAL),
                    });
                }
            }
        }
        for name in names {
            dir = self.child_dir(&dir, name, create)?;
        }
        Ok(dir)
    }

    /// Opens the directory `name` in `dir`, making it first if missing and `create`.
    pub(crate) fn child_dir(&self, dir: &Dir, name: &OsStr, create: bool) -> Result<Dir, Refusal> {
        let rel = dir.child_rel(name);
        let fd = match sys::open_beneath(dir.fd.as_raw_fd(), Path::new(name), OpenAs::Dir) {
            Err(err) if create && err.kind() == io::ErrorKind::NotFound => {
                match sys::mkdir_beneath(dir.fd.as_raw_fd(), Path::new(name), 0o777) {
                    Ok(()) => {}
                    Err(err) if err.kind() == io::ErrorKind::AlreadyExists => {}
                    Err(err) => return Err(Refusal::Io { at: rel, err }),
                }
                sys::open_beneath(dir.fd.as_raw_fd(), Path::new(name), OpenAs::Dir)
            }
            other => other,
        };
        let fd = fd.map_err(|err| self.explain(dir, name, rel.clone(), err))?;
        let meta = File::from(fd.try_clone().map_err(|err| Refusal::Io {
            at: rel.clone(),
            err,
        })?)
        .metadata()
        .map_err(|err| Refusal::Io {
            at: rel.clone(),
            err,
        })?;
        if !meta.is_dir() {
            return Err(Refusal::NotDir { at: rel });
        }
        self.check(&meta, &rel)?;
        Ok(Dir { fd, rel })
    }

    /// Why opening `name` in `dir` failed: ELOOP and ENOTDIR are a symlink or not a
    /// directory, told apart by looking at the entry itself.
    fn explain(&self, dir: &Dir, name: &OsStr, rel: String, err: io::Error) -> Refusal {
        let code = err.raw_os_error();
        if (code == Some(libc::ELOOP) || code == Some(libc::ENOTDIR))
            && let Ok(meta) = self.entry_meta(dir, name)
        {
            if meta.file_type().is_symlink() {
                return Refusal::Symlink { at: rel };
            }
            if code == Some(libc::ENOTDIR) {
                return Refusal::NotDir { at: rel };
            }
        }
        Refusal::Io { at: rel, err }
    }

    /// The entry `name` in `dir` itself (a symlink is not followed).
    pub(crate) fn entry_meta(&self, dir: &Dir, name: &OsStr) -> io::Result<Metadata> {
        let fd = sys::open_beneath(dir.fd.as_raw_fd(), Path::new(name), OpenAs::Entry)?;
        File::from(fd).metadata()
    }

    /// What `name` in `dir` is now, if it exists: fenced, and refused if a symlink.
    pub(crate) fn stat(&self, dir: &Dir, name: &OsStr) -> Result<Option<Metadata>, Refusal> {
        let rel = dir.child_rel(name);
        match self.entry_meta(dir, name) {
            Ok(meta) if meta.file_type().is_symlink() => Err(Refusal::Symlink { at: rel }),
            Ok(meta) => {
                self.check(&meta, &rel)?;
                Ok(Some(meta))
            }
            Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(err) => Err(Refusal::Io { at: rel, err }),
        }
    }

    /// Opens `name` in `dir` for reading (O_NONBLOCK, so a FIFO cannot hold the thread; the
    /// caller refuses anything but a regular file by the metadata).
    pub(crate) fn open_read(&self, dir: &Dir, name: &OsStr) -> Result<(File, Metadata), Refusal> {
        let rel = dir.child_rel(name);
        let fd = sys::open_beneath(dir.fd.as_raw_fd(), Path::new(name), OpenAs::Read)
            .map_err(|err| self.explain(dir, name, rel.clone(), err))?;
        let file = File::from(fd);
        let meta = file.metadata().map_err(|err| Refusal::Io {
            at: rel.clone(),
            err,
        })?;
        self.check(&meta, &rel)?;
        Ok((file, meta))
    }

    /// Replaces `name` in `dir` with `bytes` so readers see the old or the new content,
    /// never a torn file: a temp file made with O_EXCL in the same directory handle, written,
    /// given the replaced file's mode, fsynced, then renamed over within that handle.
    pub(crate) fn replace(
        &self,
        dir: &Dir,
        name: &OsStr,
        bytes: &[u8],
        existing: Option<&Metadata>,
    ) -> io::Result<()> {
        static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);
        // A short fixed-shape name, so a long target name cannot push it past NAME_MAX.
        let temp = format!(
            ".caliban-write-{}-{}.tmp",
            std::process::id(),
            TEMP_COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let temp = Path::new(&temp);
        let raw = dir.fd.as_raw_fd();
        let fd = sys::open_beneath(raw, temp, OpenAs::CreateNew)?;
        let res = (|| {
            let mut file = File::from(fd);
            file.write_all(bytes)?;
            if let Some(meta) = existing {
                file.set_permissions(meta.permissions())?;
            }
            file.sync_all()?;
            drop(file);
            sys::rename_beneath(raw, temp, Path::new(name))
        })();
        if res.is_err() {
            let _ = sys::unlink_beneath(raw, temp);
        }
        res?;
        // Sync the directory too so the rename survives a crash; the content is already
        // safe, so a failure here is not worth failing the call for.
        if let Ok(readable) = sys::open_dot(raw) {
            let _ = File::from(readable).sync_all();
        }
        Ok(())
    }

    /// The entries of `dir`, at most `max`, and whether more were left.
    pub(crate) fn entries(
        &self,
        dir: &Dir,
        max: usize,
    ) -> io::Result<(Vec<sys::DirEntryFd>, bool)> {
        sys::read_dir_fd(dir.fd.as_raw_fd(), max)
    }
}

/// `rel` (canonical, workspace-relative) split into its directory and last name; `None`
/// for the workspace itself.
pub(crate) fn split(rel: &str) -> Option<(&str, &OsStr)> {
    if rel == "." || rel.is_empty() {
        return None;
    }
    Some(match rel.rsplit_once('/') {
        Some((parent, name)) => (parent, OsStr::new(name)),
        None => (".", OsStr::new(rel)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh workspace and an outside directory beside it, removed on drop.
    struct Tree(PathBuf);

    impl Tree {
        fn new(tag: &str) -> Tree {
            static COUNTER: AtomicU64 = AtomicU64::new(0);
            let n = COUNTER.fetch_add(1, Ordering::Relaxed);
            let dir = std::env::temp_dir()
                .join(format!("caliban-beneath-{tag}-{}-{n}", std::process::id()));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(dir.join("ws")).unwrap();
            fs::create_dir_all(dir.join("outside")).unwrap();
            Tree(dir.canonicalize().unwrap())
        }
        fn ws(&self) -> PathBuf {
            self.0.join("ws")
        }
        fn put(&self, rel: &str, text: &str) -> PathBuf {
            let path = self.0.join(rel);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(&path, text).unwrap();
            path
        }
    }

    impl Drop for Tree {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn read(held: &Beneath, rel: &str) -> Result<String, Refusal> {
        let (dir, name) = split(rel).unwrap();
        let dir = held.dir(dir, false)?;
        let (mut file, _) = held.open_read(&dir, name)?;
        let mut text = String::new();
        io::Read::read_to_string(&mut file, &mut text).unwrap();
        Ok(text)
    }

    #[test]
    fn a_symlink_in_the_middle_or_at_the_end_is_refused() {
        let tree = Tree::new("middle");
        tree.put("ws/real/f.txt", "inside");
        tree.put("outside/f.txt", "outside");
        std::os::unix::fs::symlink(tree.ws().join("real"), tree.ws().join("in")).unwrap();
        std::os::unix::fs::symlink(tree.0.join("outside"), tree.ws().join("out")).unwrap();
        std::os::unix::fs::symlink(tree.ws().join("real/f.txt"), tree.ws().join("f.txt")).unwrap();
        let held = Beneath::open(&tree.ws(), &[]).unwrap();
        assert_eq!(read(&held, "real/f.txt").unwrap(), "inside");
        for rel in ["in/f.txt", "out/f.txt", "f.txt"] {
            let refusal = read(&held, rel).unwrap_err();
            assert!(
                matches!(refusal, Refusal::Symlink { .. }),
                "{rel}: {refusal:?}"
            );
            let message = refusal.message(rel);
            assert!(message.contains("is a symlink now"), "{message}");
            assert!(
                message.contains("file tools do not follow symlinks"),
                "{message}"
            );
        }
        // Nor is a directory made through one.
        assert!(matches!(
            held.dir("out/new", true),
            Err(Refusal::Symlink { .. })
        ));
        assert!(!tree.0.join("outside/new").exists());
    }

    #[test]
    fn dot_dot_and_absolute_paths_are_refused() {
        let tree = Tree::new("dotdot");
        tree.put("outside/f.txt", "outside");
        let held = Beneath::open(&tree.ws(), &[]).unwrap();
        for rel in [
            "../outside",
            "a/../../outside",
            "/etc",
            &tree.0.join("outside").display().to_string(),
        ] {
            assert!(held.dir(rel, true).is_err(), "{rel}");
        }
        assert!(!tree.ws().join("a").exists());
    }

    #[test]
    fn a_directory_swapped_for_a_symlink_between_steps_is_not_followed() {
        let tree = Tree::new("swap");
        tree.put("ws/d/sub/f.txt", "inside");
        tree.put("outside/sub/f.txt", "outside");
        let held = Beneath::open(&tree.ws(), &[]).unwrap();
        let d = held.dir("d", false).unwrap();
        // After `d` is held, its `sub` becomes a symlink out: the next step refuses it.
        fs::rename(tree.ws().join("d/sub"), tree.ws().join("d/sub-real")).unwrap();
        std::os::unix::fs::symlink(tree.0.join("outside/sub"), tree.ws().join("d/sub")).unwrap();
        assert!(matches!(
            held.child_dir(&d, OsStr::new("sub"), false),
            Err(Refusal::Symlink { .. })
        ));
        // And `d` itself swapped for a symlink after it was opened: what is written through
        // the handle lands in the real directory, wherever it now is, never outside.
        fs::rename(tree.ws().join("d"), tree.ws().join("d-real")).unwrap();
        std::os::unix::fs::symlink(tree.0.join("outside"), tree.ws().join("d")).unwrap();
        held.replace(&d, OsStr::new("new.txt"), b"by handle", None)
            .unwrap();
        assert_eq!(
            fs::read_to_string(tree.ws().join("d-real/new.txt")).unwrap(),
            "by handle"
        );
        assert!(!tree.0.join("outside/new.txt").exists());
        // No temp file is left beside it.
        let names: Vec<_> = fs::read_dir(tree.ws().join("d-real"))
            .unwrap()
            .flatten()
            .collect();
        assert_eq!(names.len(), 3, "sub, sub-real and new.txt: {names:?}");
    }

    #[test]
    fn a_hard_link_to_a_protected_or_denied_file_is_refused_under_another_name() {
        let tree = Tree::new("hardlink");
        tree.put("ws/.git/config", "[core]\n");
        tree.put("ws/.git/hooks/pre-commit", "#!/bin/sh\n");
        let key = tree.put("outside/home/.ssh/id_ed25519", "KEY");
        fs::hard_link(tree.ws().join(".git/config"), tree.ws().join("notes.txt")).unwrap();
        fs::hard_link(
            tree.ws().join(".git/hooks/pre-commit"),
            tree.ws().join("hook.sh"),
        )
        .unwrap();
        fs::hard_link(&key, tree.ws().join("key.txt")).unwrap();
        let deny = [tree.0.join("outside/home/.ssh")];
        let held = Beneath::open(&tree.ws(), &deny).unwrap();
        for (rel, what) in [
            ("notes.txt", "`.git/config`"),
            ("hook.sh", "`.git/hooks/pre-commit`"),
            ("key.txt", "deny list"),
        ] {
            let refusal = read(&held, rel).unwrap_err();
            let message = refusal.message(rel);
            assert!(
                matches!(refusal, Refusal::Fenced { .. }),
                "{rel}: {message}"
            );
            assert!(message.contains(what), "{message}");
            let root = held.dir(".", false).unwrap();
            assert!(held.stat(&root, OsStr::new(rel)).is_err(), "{rel}");
        }
        // Named as itself, the protected file opens: the checks by name judged that.
        assert_eq!(read(&held, ".git/config").unwrap(), "[core]\n");
        let root = held.dir(".", false).unwrap();
        let meta = held.entry_meta(&root, OsStr::new("key.txt")).unwrap();
        assert!(held.is_denied(&meta));
    }

    #[test]
    fn a_denied_directory_reached_by_another_name_is_refused() {
        // A workspace that is the home directory: `.ssh` is below it, and named as itself
        // the checks by name refuse it; entered under another name (a bind mount, here a
        // directory moved to where the deny list points) the handle still says what it is.
        let tree = Tree::new("denydir");
        tree.put("ws/keys/id", "KEY");
        let deny = [tree.ws().join("keys")];
        let held = Beneath::open(&tree.ws(), &deny).unwrap();
        assert!(
            read(&held, "keys/id").is_ok(),
            "named as itself: the check by name judges"
        );
        fs::rename(tree.ws().join("keys"), tree.ws().join("other")).unwrap();
        let held_after = Beneath::open(&tree.ws(), &[tree.ws().join("other")]).unwrap();
        fs::rename(tree.ws().join("other"), tree.ws().join("keys")).unwrap();
        let refusal = read(&held_after, "keys/id").unwrap_err();
        assert!(matches!(refusal, Refusal::Fenced { .. }), "{refusal:?}");
    }

    #[test]
    fn a_workspace_replaced_by_a_symlink_after_its_run_started_is_refused() {
        let tree = Tree::new("pinned");
        tree.put("outside/home/.bashrc", "rc");
        pin(&tree.ws());
        assert!(Beneath::open_as(&tree.ws(), &tree.ws(), &[]).is_ok());
        fs::rename(tree.ws(), tree.0.join("ws-moved")).unwrap();
        std::os::unix::fs::symlink(tree.0.join("outside/home"), tree.ws()).unwrap();
        // What the tools canonicalise the workspace path to now is the home directory.
        let now = tree.ws().canonicalize().unwrap();
        let err = Beneath::open_as(&tree.ws(), &now, &[])
            .err()
            .expect("refused");
        assert!(
            err.contains("no longer the directory the run started in"),
            "{err}"
        );
    }

    #[test]
    fn write_parents_are_made_by_handle_and_modes_kept() {
        use std::os::unix::fs::PermissionsExt;
        let tree = Tree::new("parents");
        let script = tree.put("ws/run.sh", "old");
        fs::set_permissions(&script, fs::Permissions::from_mode(0o751)).unwrap();
        let held = Beneath::open(&tree.ws(), &[]).unwrap();
        let dir = held.dir("a/b/c", true).unwrap();
        assert_eq!(dir.rel, "a/b/c");
        held.replace(&dir, OsStr::new("f"), b"new", None).unwrap();
        assert_eq!(
            fs::read_to_string(tree.ws().join("a/b/c/f")).unwrap(),
            "new"
        );
        let root = held.dir(".", false).unwrap();
        let existing = held.stat(&root, OsStr::new("run.sh")).unwrap();
        held.replace(
            &root,
            OsStr::new("run.sh"),
            b"#!/bin/sh\n",
            existing.as_ref(),
        )
        .unwrap();
        let mode = fs::metadata(&script).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode, 0o751);
        // A file on the way is not a directory.
        assert!(matches!(
            held.dir("run.sh/x", true),
            Err(Refusal::NotDir { .. })
        ));
    }
}
