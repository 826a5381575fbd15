//! Project instructions: the `AGENTS.md` files (and kin) that tell an agent how a project
//! wants to be worked on, found on disk and appended to a run's system prompt with their
//! paths. It reads files but knows nothing of runs or surfaces: callers pass the directory a
//! run works in and show `Loaded::to_json` wherever they describe the run.
//!
//! Which files, from the most general to the most specific (a later file wins where two
//! disagree, and the model is told so):
//! 1. the user's own file, `$XDG_CONFIG_HOME/caliban/AGENTS.md`
//!    (`~/.config/caliban/AGENTS.md` when `XDG_CONFIG_HOME` is unset);
//! 2. in each directory from the repository root (the nearest directory holding `.git`)
//!    down to the run's workspace: `AGENTS.md`, then `CALIBAN.md`; `CLAUDE.md` stands in
//!    for `AGENTS.md` in a directory that has none (where both exist, `CLAUDE.md` is almost
//!    always a copy of, or a pointer to, `AGENTS.md`). Outside a repository only the
//!    workspace itself is read.
//!
//! Everything is capped at `MAX_INSTRUCTIONS_BYTES` in all. The budget goes to the most
//! specific files first, since they say the most about the work at hand; a file that does
//! not fit is cut (its head kept) or left out, and the prompt says so where it happens.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};

/// The most instruction text one run's prompt carries. Real files are a few KiB; a project
/// that keeps a manual in `AGENTS.md` should not crowd out the conversation.
pub const MAX_INSTRUCTIONS_BYTES: usize = 64 * 1024;

/// How far up from the workspace to look for the repository root. Deeper trees are not
/// real checkouts; the cap bounds the walk on a strange mount.
const MAX_ANCESTORS: usize = 64;

/// The file names read in each directory, in order; see the module comment.
const PROJECT_FILES: [&str; 2] = ["AGENTS.md", "CALIBAN.md"];
/// Read in a directory only when it has no `AGENTS.md`.
const FALLBACK_FILE: &str = "CLAUDE.md";
/// The user's file, under `$XDG_CONFIG_HOME/caliban/`.
const USER_FILE: &str = "AGENTS.md";

/// Where instructions come from: whether to read any, and the user's config directory
/// (`$XDG_CONFIG_HOME/caliban`).
#[derive(Clone, Debug, Default)]
pub struct Sources {
    pub enabled: bool,
    pub user_dir: Option<PathBuf>,
}

/// One file found, with as much of its text as fit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InstructionFile {
    pub path: PathBuf,
    /// What is kept of the file (all of it unless `truncated`).
    pub text: String,
    /// The file's size on disk.
    pub bytes: u64,
    pub truncated: bool,
}

/// The files for one run, most general first.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Loaded {
    pub files: Vec<InstructionFile>,
}

impl Sources {
    /// `enabled` with the user's directory taken from the environment as settings find it.
    pub fn from_env(enabled: bool, env: &dyn Fn(&str) -> Option<String>) -> Sources {
        Sources {
            enabled,
            user_dir: crate::settings::user_config_dir(env).map(|dir| dir.join("caliban")),
        }
    }

    /// The instruction files for a run working in `workspace`. Blocking file reads of at
    /// most `MAX_INSTRUCTIONS_BYTES` in all; unreadable files are skipped.
    pub fn load(&self, workspace: &Path) -> Loaded {
        if !self.enabled {
            return Loaded::default();
        }
        let mut candidates: Vec<(PathBuf, u64)> = Vec::new();
        if let Some(dir) = &self.user_dir {
            candidates.extend(regular_file(&dir.join(USER_FILE)));
        }
        for dir in project_dirs(workspace) {
            let mut found = Vec::new();
            for name in PROJECT_FILES {
                found.extend(regular_file(&dir.join(name)));
            }
            if !found
                .iter()
                .any(|(path, _)| path.ends_with(PROJECT_FILES[0]))
            {
                found.extend(regular_file(&dir.join(FALLBACK_FILE)));
                // Keep the reading order: the stand-in takes AGENTS.md's place, first.
                let stand_in_last = usize::from(found.len() > 1);
                found.rotate_right(stand_in_last);
            }
            candidates.extend(found);
        }
        // The budget goes to the most specific files first (the end of the list).
        let mut budget = MAX_INSTRUCTIONS_BYTES;
        let mut files = Vec::new();
        for (path, bytes) in candidates.into_iter().rev() {
            let Some((text, truncated)) = read_head(&path, budget, bytes) else {
                continue;
            };
            if text.trim().is_empty() && !truncated {
                continue;
            }
            budget = budget.saturating_sub(text.len());
            files.push(InstructionFile {
                path,
                text,
                bytes,
                truncated,
            });
        }
        files.reverse();
        Loaded { files }
    }
}

impl Loaded {
    pub fn is_empty(&self) -> bool {
        self.files.is_empty()
    }

    /// `[{"path","bytes","truncated"}]`, for the headers and frames that describe a run.
    pub fn to_json(&self) -> Value {
        Value::Array(
            self.files
                .iter()
                .map(|file| {
                    json!({"path": file.path.display().to_string(), "bytes": file.bytes,
                           "truncated": file.truncated})
                })
                .collect(),
        )
    }

    /// `base` with the instructions appended under a heading, each under its path.
    pub fn system_prompt(&self, base: &str) -> String {
        if self.files.is_empty() {
            return base.to_owned();
        }
        let mut prompt = base.trim_end().to_owned();
        prompt.push_str(
            "\n\n# Project instructions\n\nThe files below hold instructions from the user and \
             the project for work in this workspace, from the most general to the most \
             specific; where two disagree, the later one wins. What the user asks in the \
             conversation comes before all of them.\n",
        );
        for file in &self.files {
            prompt.push_str(&format!("\n## {}\n\n", file.path.display()));
            prompt.push_str(file.text.trim_end());
            prompt.push('\n');
            if file.truncated {
                let note = if file.text.is_empty() {
                    "left out"
                } else {
                    "cut here"
                };
                prompt.push_str(&format!(
                    "\n[caliban: {note}: this file is {} bytes, and project instructions are \
                     capped at {MAX_INSTRUCTIONS_BYTES} bytes in all; Read it for the rest]\n",
                    file.bytes
                ));
            }
        }
        prompt
    }
}

/// The directories whose files apply to `workspace`, outermost first: from the repository
/// root down to the workspace, or the workspace alone outside a repository.
fn project_dirs(workspace: &Path) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for dir in workspace.ancestors().take(MAX_ANCESTORS) {
        dirs.push(dir.to_path_buf());
        if dir.join(".git").exists() {
            dirs.reverse();
            return dirs;
        }
    }
    vec![workspace.to_path_buf()]
}

/// The file and its size, if `path` is a regular file (symlinks followed).
fn regular_file(path: &Path) -> Option<(PathBuf, u64)> {
    let meta = std::fs::metadata(path).ok()?;
    meta.is_file().then(|| (path.to_path_buf(), meta.len()))
}

/// At most `limit` bytes from the start of a file of `size` bytes, as text (invalid UTF-8
/// replaced), and whether that is less than the whole file; `""` for a file with no room
/// left, so it is still listed as left out.
fn read_head(path: &Path, limit: usize, size: u64) -> Option<(String, bool)> {
    let file = File::open(path).ok()?;
    let mut bytes = Vec::new();
    // One byte more than the room tells a file that grew since it was measured.
    file.take(limit as u64 + 1).read_to_end(&mut bytes).ok()?;
    let truncated = bytes.len() > limit || (bytes.len() as u64) < size;
    if bytes.len() > limit {
        bytes.truncate(limit);
        // A character cut in two at the end is dropped, not shown as U+FFFD.
        if let Err(e) = std::str::from_utf8(&bytes)
            && e.error_len().is_none()
        {
            bytes.truncate(e.valid_up_to());
        }
    }
    Some((String::from_utf8_lossy(&bytes).into_owned(), truncated))
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Tree(PathBuf);

    impl Tree {
        fn new(name: &str) -> Tree {
            let root = std::env::temp_dir().join(format!(
                "caliban-instructions-{name}-{}",
                std::process::id()
            ));
            let _ = std::fs::remove_dir_all(&root);
            std::fs::create_dir_all(&root).unwrap();
            Tree(root.canonicalize().unwrap())
        }

        fn write(&self, rel: &str, text: &str) -> PathBuf {
            let path = self.0.join(rel);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, text).unwrap();
            path
        }
    }

    impl Drop for Tree {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn names(loaded: &Loaded, root: &Path) -> Vec<String> {
        loaded
            .files
            .iter()
            .map(|f| f.path.strip_prefix(root).unwrap().display().to_string())
            .collect()
    }

    #[test]
    fn general_to_specific_up_to_the_repository_root() {
        let tree = Tree::new("order");
        tree.write("user/caliban/AGENTS.md", "user rules");
        tree.write("AGENTS.md", "above the repo: never read");
        tree.write("repo/.git/HEAD", "ref");
        tree.write("repo/AGENTS.md", "repo rules");
        tree.write("repo/CLAUDE.md", "a copy, skipped beside AGENTS.md");
        tree.write("repo/CALIBAN.md", "caliban rules");
        tree.write("repo/sub/CLAUDE.md", "sub rules (no AGENTS.md here)");
        tree.write("repo/sub/CALIBAN.md", "sub caliban rules");
        let sources = Sources {
            enabled: true,
            user_dir: Some(tree.0.join("user/caliban")),
        };
        let loaded = sources.load(&tree.0.join("repo/sub/deeper"));
        // The workspace need not exist for the walk; `deeper` has no files.
        assert_eq!(
            names(&loaded, &tree.0),
            [
                "user/caliban/AGENTS.md",
                "repo/AGENTS.md",
                "repo/CALIBAN.md",
                "repo/sub/CLAUDE.md",
                "repo/sub/CALIBAN.md"
            ]
        );
        let prompt = loaded.system_prompt("base");
        assert!(prompt.starts_with("base\n\n# Project instructions"));
        let at = |text: &str| prompt.find(text).unwrap();
        assert!(at("user rules") < at("repo rules"));
        assert!(at("repo rules") < at("sub caliban rules"));
        assert!(prompt.contains(&format!("## {}", tree.0.join("repo/AGENTS.md").display())));
        assert_eq!(loaded.to_json()[1]["truncated"], false);
        assert_eq!(loaded.to_json()[1]["bytes"], 10);

        let off = Sources {
            enabled: false,
            ..sources
        };
        assert!(off.load(&tree.0.join("repo")).is_empty());
    }

    #[test]
    fn outside_a_repository_only_the_workspace_is_read() {
        let tree = Tree::new("norepo");
        tree.write("AGENTS.md", "parent");
        tree.write("ws/AGENTS.md", "workspace");
        let sources = Sources {
            enabled: true,
            user_dir: None,
        };
        assert_eq!(
            names(&sources.load(&tree.0.join("ws")), &tree.0),
            ["ws/AGENTS.md"]
        );
        assert_eq!(sources.system_prompt_of(&tree.0.join("empty")), "base");
    }

    impl Sources {
        fn system_prompt_of(&self, ws: &Path) -> String {
            self.load(ws).system_prompt("base")
        }
    }

    #[test]
    fn the_cap_keeps_the_most_specific_and_says_where_it_cut() {
        let tree = Tree::new("cap");
        tree.write(".git/HEAD", "ref");
        tree.write("AGENTS.md", &"o".repeat(MAX_INSTRUCTIONS_BYTES));
        tree.write("a/AGENTS.md", &"é".repeat(MAX_INSTRUCTIONS_BYTES / 4));
        tree.write("a/b/AGENTS.md", &"i".repeat(MAX_INSTRUCTIONS_BYTES / 2 + 1));
        tree.write("a/b/CALIBAN.md", "");
        let sources = Sources {
            enabled: true,
            user_dir: None,
        };
        let loaded = sources.load(&tree.0.join("a/b"));
        let kept: Vec<(usize, bool)> = loaded
            .files
            .iter()
            .map(|f| (f.text.len(), f.truncated))
            .collect();
        let inner = MAX_INSTRUCTIONS_BYTES / 2 + 1;
        // The innermost whole (the empty CALIBAN.md is skipped), the middle cut on a
        // character boundary (2-byte chars: the half character is dropped), and the one byte
        // left over for the outermost.
        assert_eq!(
            kept,
            [
                (1, true),
                (MAX_INSTRUCTIONS_BYTES - inner - 1, true),
                (inner, false)
            ]
        );
        let total: usize = loaded.files.iter().map(|f| f.text.len()).sum();
        assert!(total <= MAX_INSTRUCTIONS_BYTES);
        let prompt = loaded.system_prompt("");
        assert!(!prompt.contains('\u{fffd}'));
        assert!(prompt.contains(&format!(
            "[caliban: cut here: this file is {MAX_INSTRUCTIONS_BYTES} bytes"
        )));
        assert!(prompt.contains("[caliban: cut here: this file is 32768 bytes"));
        // A file with no room left at all is still named, as left out.
        tree.write("a/b/AGENTS.md", &"i".repeat(MAX_INSTRUCTIONS_BYTES));
        let loaded = sources.load(&tree.0.join("a/b"));
        assert_eq!(loaded.files.len(), 3);
        assert!(
            loaded.files[..2]
                .iter()
                .all(|f| f.text.is_empty() && f.truncated)
        );
        assert!(
            loaded
                .system_prompt("")
                .contains("[caliban: left out: this file is")
        );
        assert_eq!(loaded.to_json()[0]["truncated"], true);
    }
}
