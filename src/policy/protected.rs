//! Protected paths: files that configure what runs or what is allowed. An edit to one of them
//! can turn a command the user allowed for a narrow purpose (`git status`, `git commit`) into
//! any command, or widen the agent's own permissions for every later run, so the policy makes
//! every edit of them ask in every mode but `bypassPermissions`, whatever an allow rule,
//! `acceptEdits` or `dontAsk` says (an explicit deny still denies).
//!
//! `PROTECTED` is the whole list, each entry with the sentence the model and the user are
//! shown. What stays off it, and why:
//! - build files and scripts (`Makefile`, `package.json`, `build.rs`, `.github/workflows/`):
//!   they are the project's code, reviewed as code; allowing `make` or `cargo test` already
//!   means running whatever they say, and a workflow runs on CI only after a push, which asks;
//! - `.gitattributes` and `.gitmodules`: the filters, diff drivers and update commands they
//!   name only run when git's config (protected) defines them;
//! - hook directories under other names (`core.hooksPath` may point anywhere): only the usual
//!   names are known.
//!
//! Matching is lexical, on path components, at any depth (a nested repository or a run in a
//! subdirectory reads its own `.git/` and settings). Components are compared the way
//! case-insensitive file systems would (ASCII case folded, and the code points HFS+ ignores
//! and the trailing dots and spaces Windows file systems drop removed, as git's own
//! `.git` checks do), so `.GIT/config` on macOS is `.git/config`. A symlink is not seen here:
//! the file tools refuse an edit that reaches a protected file under another name
//! (`tools::fs`).

/// How an entry matches a `/`-separated path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Shape {
    /// A directory of this name at any depth, the name itself included (`.git` may be a file
    /// pointing at the real one).
    Dir(&'static str),
    /// A file of this name at any depth.
    File(&'static str),
    /// A file `name` directly inside a directory `dir`, at any depth.
    FileIn {
        dir: &'static str,
        name: &'static str,
    },
}

/// One protected path and why.
#[derive(Debug)]
pub(crate) struct Protected {
    pub(crate) shape: Shape,
    /// Why editing it is more than editing a file: shown in the permission decision.
    pub(crate) why: &'static str,
}

impl Protected {
    /// How the entry reads in messages and docs: `.git/`, `.envrc`, `.vscode/tasks.json`.
    pub(crate) fn shown(&self) -> String {
        match self.shape {
            Shape::Dir(name) => format!("{name}/"),
            Shape::File(name) => name.to_owned(),
            Shape::FileIn { dir, name } => format!("{dir}/{name}"),
        }
    }

    /// Whether the entry itself is a directory (`.git/`), not a file.
    pub(crate) fn is_dir(&self) -> bool {
        matches!(self.shape, Shape::Dir(_))
    }

    /// Where the entry sits below a directory that holds it, as a relative path
    /// (`.git`, `.vscode/tasks.json`), and the directory of a `FileIn` entry (`.vscode`),
    /// which the sandbox makes read-only when the file itself does not exist yet.
    pub(crate) fn on_disk(&self) -> (String, Option<&'static str>) {
        match self.shape {
            Shape::Dir(name) | Shape::File(name) => (name.to_owned(), None),
            Shape::FileIn { dir, name } => (format!("{dir}/{name}"), Some(dir)),
        }
    }
}

/// Every protected path, each with the sentence that says why.
pub(crate) static PROTECTED: &[Protected] = &[
    Protected {
        shape: Shape::Dir(".git"),
        why: "git's config and hooks: a `core.fsmonitor`, `core.pager`, alias or hook there \
              runs any command the next time an allowed git command runs",
    },
    Protected {
        shape: Shape::Dir(".caliban"),
        why: "caliban's project settings: their rules and mode decide what the agent may do \
              without asking in every later run",
    },
    Protected {
        shape: Shape::Dir(".claude"),
        why: "Claude Code's project settings and hooks: they grant permissions and name \
              commands that agent runs",
    },
    Protected {
        shape: Shape::File(".mcp.json"),
        why: "the project's MCP servers: each is a command an agent starts",
    },
    Protected {
        shape: Shape::File(".envrc"),
        why: "direnv runs it in the user's shell on entering the directory",
    },
    Protected {
        shape: Shape::FileIn {
            dir: ".vscode",
            name: "settings.json",
        },
        why: "VS Code settings name programs the editor and its extensions run",
    },
    Protected {
        shape: Shape::FileIn {
            dir: ".vscode",
            name: "tasks.json",
        },
        why: "VS Code tasks are commands, and a `folderOpen` task runs when the folder opens",
    },
    Protected {
        shape: Shape::FileIn {
            dir: ".idea",
            name: "workspace.xml",
        },
        why: "JetBrains run configurations: commands the IDE runs",
    },
    Protected {
        shape: Shape::Dir(".devcontainer"),
        why: "dev container settings: `initializeCommand` runs on this machine when the \
              folder is opened in a container",
    },
    Protected {
        shape: Shape::File(".devcontainer.json"),
        why: "dev container settings: `initializeCommand` runs on this machine when the \
              folder is opened in a container",
    },
    Protected {
        shape: Shape::Dir(".husky"),
        why: "git hook scripts (husky points `core.hooksPath` here): they run on an allowed \
              `git commit`",
    },
    Protected {
        shape: Shape::Dir(".githooks"),
        why: "git hook scripts (the usual `core.hooksPath`): they run on an allowed \
              `git commit`",
    },
    Protected {
        shape: Shape::File(".pre-commit-config.yaml"),
        why: "pre-commit hooks: commands an allowed `git commit` runs once they are installed",
    },
];

/// The entry protecting `path` (`/`-separated, relative or absolute, already normalised:
/// no `.` or `..`), if any.
pub(crate) fn find(path: &str) -> Option<&'static Protected> {
    let parts: Vec<String> = path
        .split('/')
        .filter(|part| !part.is_empty())
        .map(fold)
        .collect();
    PROTECTED.iter().find(|entry| match entry.shape {
        Shape::Dir(name) => parts.iter().any(|part| part == name),
        Shape::File(name) => parts.last().is_some_and(|last| last == name),
        Shape::FileIn { dir, name } => {
            matches!(parts.as_slice(), [.., parent, last] if parent == dir && last == name)
        }
    })
}

/// A path component as a case-insensitive file system may see it: ASCII case folded, the
/// code points HFS+ ignores removed (git's `is_hfs_dotgit` list) and trailing dots and spaces
/// dropped (as NTFS and FAT do).
fn fold(part: &str) -> String {
    let kept: String = part
        .chars()
        .filter(|&ch| !is_hfs_ignorable(ch))
        .map(|ch| ch.to_ascii_lowercase())
        .collect();
    kept.trim_end_matches(['.', ' ']).to_owned()
}

fn is_hfs_ignorable(ch: char) -> bool {
    matches!(ch,
        '\u{200c}'..='\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{206a}'..='\u{206f}' | '\u{feff}')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shown(path: &str) -> Option<String> {
        find(path).map(Protected::shown)
    }

    #[test]
    fn every_entry_protects_its_own_path() {
        for entry in PROTECTED {
            let shown = entry.shown();
            let path = match entry.shape {
                Shape::Dir(name) => format!("{name}/x"),
                _ => shown.clone(),
            };
            assert_eq!(find(&path).map(Protected::shown), Some(shown.clone()));
            assert_eq!(
                find(&format!("deep/er/{path}")).map(Protected::shown),
                Some(shown)
            );
            assert!(!entry.why.is_empty() && !entry.why.ends_with('.'));
        }
    }

    #[test]
    fn spellings_of_one_path_are_one_path() {
        for path in [
            ".git/config",
            ".git",
            ".GIT/config",
            ".Git/hooks/pre-commit",
            ".git./config",
            ".git /config",
            ".g\u{200c}it/config",
            "\u{feff}.git/config",
            "/home/u/proj/.git/config",
            "sub/.git/modules/x/config",
        ] {
            assert_eq!(shown(path).as_deref(), Some(".git/"), "{path}");
        }
        assert_eq!(
            shown(".caliban/settings.local.json").as_deref(),
            Some(".caliban/")
        );
        assert_eq!(shown(".Claude/settings.json").as_deref(), Some(".claude/"));
        assert_eq!(
            shown(".VSCode/Tasks.json").as_deref(),
            Some(".vscode/tasks.json")
        );
    }

    #[test]
    fn look_alikes_are_ordinary_files() {
        for path in [
            "src/git/config",
            ".gitignore",
            ".github/workflows/ci.yml",
            "git",
            "x.git",
            ".git-blame-ignore-revs",
            ".vscode/extensions.json",
            "settings.json",
            "tasks.json",
            ".envrc.example",
            "docs/.mcp.json.md",
            ".",
            "",
        ] {
            assert_eq!(shown(path), None, "{path}");
        }
    }
}
