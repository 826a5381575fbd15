//! The built-in tools, one row each: the spec offered to the model, where a call runs, and
//! every fact the rest of the crate needs about a tool by its name (what a permission rule
//! matches and the default it falls back to, how an editor shows and can carry out a call).
//! Dispatch, the run's ordering of file changes, permissions, ACP cards, editor delegation
//! and the MCP surface read these rows; none of them matches on tool names.
//!
//! So a new tool is its own file under `tools/` (declared in `tools/mod.rs`) holding its
//! `spec`, the function its `Runs` names, its `title` and, if an editor can carry it out,
//! its delegation check; and one row in `BUILTINS`, taking its line off `PLANNED` if it has
//! one. Only a new kind of fact (a third place to run, a new editor request) needs more: a
//! variant here and the code that reads it.
//!
//! The tools MCP servers offer (`mcp__<server>__<tool>`) are the table's one dynamic
//! extension: their specs come from the servers at run time (`mcp_client`), and every one
//! of them shares the row `MCP`, which `lookup` answers for the `mcp__` prefix (the naming
//! the MCP client writes and this reads lives in `mcp_name`, below both). That row
//! says they run on their server (`Runs::Mcp`), ask before they run unless a rule says
//! otherwise (`mcp__server__tool`, `mcp__server__*`), are stopped by plan mode, and show
//! as "other" in an editor, titled by their name.
//!
//! Architecture Invariant: this module knows no surface. What an editor shows (ACP's tool
//! kind, what a card locates and diffs) and which editor request can carry a call are small
//! tool-level enums here; each surface maps them to its own protocol.

use std::path::Path;

use serde_json::Value;

use crate::model::types::ToolSpec;
use crate::tools::ToolOutput;
use crate::tools::bash::{self, BashInput, BashJob, ShellOp};
use crate::tools::fs::{self, Delegated};
use crate::tools::mcp_name;
use crate::tools::todo::{self, Todo};
use crate::tools::web::{self, FetchRequest};

/// One built-in tool.
#[derive(Debug)]
pub(crate) struct Tool {
    /// The name the model calls it by, as upstream spells it; also its spec's name.
    pub(crate) name: &'static str,
    /// Description and input schema, as offered to the model.
    pub(crate) spec: fn() -> ToolSpec,
    pub(crate) runs: Runs,
    pub(crate) permission: Permission,
    pub(crate) card: Card,
    pub(crate) delegation: Delegation,
}

/// Where a call runs. Each variant's function checks the input (its error is the tool's
/// result) and hands the engine what to do.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Runs {
    /// Blocking, bounded file-system work on the engine's tool worker pool.
    Worker(fn(&Value, &Path) -> ToolOutput),
    /// A child process whose pipes the engine watches on the reactor and whose process
    /// group it kills on timeout or cancel, started in the run's sandbox; with
    /// `background: true` it stays with the run as a shell until it exits, is killed or the
    /// run ends (confined the same way: one spawn path).
    Process(fn(&Value, &Path, crate::sandbox::Mode) -> Result<BashJob, ToolOutput>),
    /// A question for, or an order to, the run's background shells, which the engine holds.
    Shell(fn(&Value) -> Result<ShellOp, ToolOutput>),
    /// An HTTP(S) GET the engine drives on the reactor, like a model request. Not a process,
    /// so not sandboxed: permission rules (`WebFetch(domain:…)`) govern it.
    Fetch(fn(&Value) -> Result<FetchRequest, ToolOutput>),
    /// The run's plan: the engine answers at once and shows it as a `PlanUpdate` event.
    Plan(fn(&Value) -> Result<Vec<Todo>, ToolOutput>),
    /// A `tools/call` to the MCP server offering the tool, on the engine's MCP hub.
    Mcp,
}

/// What the permission policy needs to know about a tool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Permission {
    pub(crate) class: Class,
    pub(crate) subject: Subject,
    /// The built-in rule for the tool, after every configured one.
    pub(crate) default: DefaultAction,
}

/// What a call may change, which decides how modes and the run treat it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Class {
    /// Changes nothing a plan depends on: plan mode lets it run.
    ReadOnly,
    /// Changes the file its `Subject::Path` field names. Within a turn such calls run one at
    /// a time in call order (two edits of one file would otherwise race), a successful one
    /// counts as an edit for the no-edit nudge, and `acceptEdits` approves it inside the
    /// workspace.
    EditsFile,
    /// Anything else (a command, the network): plan mode stops it.
    Other,
}

/// The input field a rule's `Tool:<glob>` / `Tool(<glob>)` form matches, and how.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Subject {
    /// No such field: only the bare-name and `key=<glob>` forms apply.
    Nothing,
    /// A shell command: allow rules must cover each simple command in it, and Claude Code's
    /// `cmd:*` prefix form and the `~` anywhere form apply.
    Command(&'static str),
    /// A file or directory judged against the workspace; `default` when the input leaves the
    /// field out.
    Path {
        field: &'static str,
        default: Option<&'static str>,
    },
    /// A URL, matched as text; an "always allow" answer allows its site.
    Url(&'static str),
}

/// The built-in rule for a tool no configured rule matched.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DefaultAction {
    Allow,
    Ask,
}

/// How an editor shows a call: its kind and what the card says about the input.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Card {
    pub(crate) kind: Kind,
    /// The card's title for an input: a short human label of what the call does.
    pub(crate) title: fn(&Value) -> String,
    /// The file or directory the call is about, if any.
    pub(crate) location: Option<Location>,
    pub(crate) diff: Diff,
}

/// The kind of work a call does, which picks the editor's icon. The whole vocabulary is
/// here, so a new tool picks its kind without touching the surfaces.
#[allow(
    dead_code,
    reason = "kinds for tools still to come (moves and deletes)"
)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Read,
    Edit,
    Delete,
    Move,
    Search,
    Execute,
    Think,
    Fetch,
    Other,
}

/// Input fields naming where a call works.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Location {
    /// The field holding the path, as the tool resolves it.
    pub(crate) path: &'static str,
    /// The field holding the 1-based line the call starts at.
    pub(crate) line: Option<&'static str>,
}

/// The change a card can show before the call runs, at its location.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Diff {
    None,
    /// The field holds the file's whole new content; the old text is the file as it is.
    WholeFile {
        content: &'static str,
    },
    /// The text in field `old` becomes the text in field `new`.
    Replace {
        old: &'static str,
        new: &'static str,
    },
}

/// Which editor requests can carry a call out instead of caliban, and the tool's check of a
/// call before it is handed over: the same checks and the same refusal as the local tool,
/// and what to fetch, store and answer (`fs::Delegated`, `bash::BashInput`).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Delegation {
    /// Runs here only.
    Local,
    /// Reads the file it names (the editor's buffer, unsaved changes included).
    ReadFile(DelegateCheck),
    /// Writes the file it names.
    WriteFile(DelegateCheck),
    /// Reads the file it names, then writes it back changed.
    EditFile(DelegateCheck),
    /// A shell command an editor's terminal can run.
    Terminal(fn(&Value, &Path) -> Result<BashInput, ToolOutput>),
}

/// Checks a file-tool call for a host without touching the file's content; it answers with
/// the `Delegated` variant its `Delegation` names.
pub(crate) type DelegateCheck = fn(&Value, &Path) -> Result<Delegated, ToolOutput>;

const PATH: Subject = Subject::Path {
    field: "path",
    default: None,
};
/// A tool that changes the file at `path`: it asks, unless `acceptEdits` approves it.
const EDITS_PATH: Permission = Permission {
    class: Class::EditsFile,
    subject: PATH,
    default: DefaultAction::Ask,
};
/// Glob and Grep search the workspace root unless told otherwise, and their rules judge
/// the directory searched; searching changes nothing, so they run without asking.
const SEARCHES: Permission = Permission {
    class: Class::ReadOnly,
    subject: Subject::Path {
        field: "path",
        default: Some("."),
    },
    default: DefaultAction::Allow,
};
/// Upstream's plan-mode tools: they ask, and plan mode lets them run, since a plan-mode
/// session with no way to propose leaving it would be a trap.
const PLAN_MODE: Permission = Permission {
    class: Class::ReadOnly,
    subject: Subject::Nothing,
    default: DefaultAction::Ask,
};
/// Reading or stopping a background shell the run started: the command was allowed when it
/// started, and neither starts anything new, so they run without asking. Plan mode allows no
/// shell to start, so they have nothing to act on there.
const SHELLS: Permission = Permission {
    class: Class::ReadOnly,
    subject: Subject::Nothing,
    default: DefaultAction::Allow,
};
const AT_PATH: Option<Location> = Some(Location {
    path: "path",
    line: None,
});

/// Every built-in tool, in the order they are offered to the model.
pub(crate) static BUILTINS: &[Tool] = &[
    Tool {
        name: "Bash",
        spec: bash::spec,
        runs: Runs::Process(BashJob::spawn),
        permission: Permission {
            class: Class::Other,
            subject: Subject::Command("command"),
            default: DefaultAction::Ask,
        },
        card: Card {
            kind: Kind::Execute,
            title: bash::title,
            location: None,
            diff: Diff::None,
        },
        delegation: Delegation::Terminal(bash::parse_input),
    },
    Tool {
        name: "BashOutput",
        spec: bash::output_spec,
        runs: Runs::Shell(bash::parse_output),
        permission: SHELLS,
        card: Card {
            kind: Kind::Read,
            title: bash::shell_title,
            location: None,
            diff: Diff::None,
        },
        delegation: Delegation::Local,
    },
    Tool {
        name: "KillShell",
        spec: bash::kill_spec,
        runs: Runs::Shell(bash::parse_kill),
        permission: SHELLS,
        card: Card {
            kind: Kind::Execute,
            title: bash::shell_title,
            location: None,
            diff: Diff::None,
        },
        delegation: Delegation::Local,
    },
    Tool {
        name: "Read",
        spec: fs::read_spec,
        runs: Runs::Worker(fs::run_read),
        permission: Permission {
            class: Class::ReadOnly,
            subject: PATH,
            default: DefaultAction::Allow,
        },
        card: Card {
            kind: Kind::Read,
            title: fs::read_title,
            location: Some(Location {
                path: "path",
                line: Some("offset"),
            }),
            diff: Diff::None,
        },
        delegation: Delegation::ReadFile(fs::delegate_read),
    },
    Tool {
        name: "Write",
        spec: fs::write_spec,
        runs: Runs::Worker(fs::run_write),
        permission: EDITS_PATH,
        card: Card {
            kind: Kind::Edit,
            title: fs::write_title,
            location: AT_PATH,
            diff: Diff::WholeFile { content: "content" },
        },
        delegation: Delegation::WriteFile(fs::delegate_write),
    },
    Tool {
        name: "Edit",
        spec: fs::edit_spec,
        runs: Runs::Worker(fs::run_edit),
        permission: EDITS_PATH,
        card: Card {
            kind: Kind::Edit,
            title: fs::edit_title,
            location: AT_PATH,
            diff: Diff::Replace {
                old: "old_string",
                new: "new_string",
            },
        },
        delegation: Delegation::EditFile(fs::delegate_edit),
    },
    Tool {
        name: "MultiEdit",
        spec: fs::multi_edit_spec,
        runs: Runs::Worker(fs::run_multi_edit),
        permission: EDITS_PATH,
        card: Card {
            kind: Kind::Edit,
            title: fs::multi_edit_title,
            location: AT_PATH,
            diff: Diff::None,
        },
        delegation: Delegation::EditFile(fs::delegate_multi_edit),
    },
    Tool {
        name: "Glob",
        spec: fs::glob_spec,
        runs: Runs::Worker(fs::run_glob),
        permission: SEARCHES,
        card: Card {
            kind: Kind::Search,
            title: fs::glob_title,
            location: AT_PATH,
            diff: Diff::None,
        },
        delegation: Delegation::Local,
    },
    Tool {
        name: "Grep",
        spec: fs::grep_spec,
        runs: Runs::Worker(fs::run_grep),
        permission: SEARCHES,
        card: Card {
            kind: Kind::Search,
            title: fs::grep_title,
            location: AT_PATH,
            diff: Diff::None,
        },
        delegation: Delegation::Local,
    },
    Tool {
        name: "WebFetch",
        spec: web::spec,
        runs: Runs::Fetch(web::parse_input),
        permission: Permission {
            class: Class::Other,
            subject: Subject::Url("url"),
            default: DefaultAction::Ask,
        },
        card: Card {
            kind: Kind::Fetch,
            title: web::title,
            location: None,
            diff: Diff::None,
        },
        delegation: Delegation::Local,
    },
    Tool {
        name: "TodoWrite",
        spec: todo::spec,
        runs: Runs::Plan(todo::parse_input),
        // Planning bookkeeping: it runs without asking, and in plan mode.
        permission: Permission {
            class: Class::ReadOnly,
            subject: Subject::Nothing,
            default: DefaultAction::Allow,
        },
        card: Card {
            kind: Kind::Think,
            title: todo::title,
            location: None,
            diff: Diff::None,
        },
        delegation: Delegation::Local,
    },
];

/// The row every MCP server's tool shares (see the module's comment).
pub(crate) static MCP: Tool = Tool {
    name: mcp_name::PREFIX,
    spec: mcp_spec,
    runs: Runs::Mcp,
    permission: Permission {
        class: Class::Other,
        subject: Subject::Nothing,
        default: DefaultAction::Ask,
    },
    card: Card {
        kind: Kind::Other,
        // Empty: the card is titled by the tool's full name.
        title: |_| String::new(),
        location: None,
        diff: Diff::None,
    },
    delegation: Delegation::Local,
};

/// The family row has no spec of its own: each server's tool brings its own.
fn mcp_spec() -> ToolSpec {
    ToolSpec {
        name: std::borrow::Cow::Borrowed(mcp_name::PREFIX),
        description: std::borrow::Cow::Borrowed("A tool an MCP server offers."),
        input_schema: serde_json::json!({"type": "object"}),
    }
}

/// Upstream's tools that caliban does not have yet, with the permission facts that settings
/// written for upstream already rely on (`WebFetch(https://docs.rs/*)`, `MultiEdit(src/**)`,
/// `TodoWrite` allowed in plan mode). A tool that lands moves from here to a row in
/// `BUILTINS`; a test refuses a name in both.
pub(crate) static PLANNED: &[(&str, Permission)] = &[
    ("NotebookEdit", EDITS_PATH),
    ("EnterPlanMode", PLAN_MODE),
    ("ExitPlanMode", PLAN_MODE),
];

/// The row for `name`: a built-in tool's, the `MCP` row for an MCP server's tool
/// (`mcp__<server>__<tool>`), `None` for anything else.
pub(crate) fn lookup(name: &str) -> Option<&'static Tool> {
    BUILTINS
        .iter()
        .find(|tool| tool.name == name)
        .or_else(|| mcp_name::server_part(name).is_some().then_some(&MCP))
}

/// The permission facts for `name`, built in or planned; `None` for any other tool, which
/// has no subject field, falls back to the catch-all ask and is stopped by plan mode.
pub(crate) fn permission(name: &str) -> Option<&'static Permission> {
    match lookup(name) {
        Some(tool) => Some(&tool.permission),
        None => PLANNED
            .iter()
            .find(|(planned, _)| *planned == name)
            .map(|(_, permission)| permission),
    }
}

/// Every name with permission facts and its built-in rule, built-ins first in offer order.
pub(crate) fn defaults() -> impl Iterator<Item = (&'static str, DefaultAction)> {
    let builtins = BUILTINS
        .iter()
        .map(|tool| (tool.name, tool.permission.default));
    let planned = PLANNED
        .iter()
        .map(|(name, permission)| (*name, permission.default));
    builtins.chain(planned)
}

/// Whether a call of `name` changes the file it names (`Class::EditsFile`).
pub(crate) fn edits_files(name: &str) -> bool {
    permission(name).is_some_and(|permission| permission.class == Class::EditsFile)
}

/// The specs of every built-in tool, in offer order.
pub(crate) fn specs() -> Vec<ToolSpec> {
    BUILTINS.iter().map(|tool| (tool.spec)()).collect()
}

impl Subject {
    /// The field holding the shell command, for a `Command` subject.
    pub(crate) fn command_field(self) -> Option<&'static str> {
        match self {
            Subject::Command(field) => Some(field),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::MAX_TITLE_CHARS;

    #[test]
    fn rows_in_offer_order() {
        let names: Vec<&str> = BUILTINS.iter().map(|tool| tool.name).collect();
        assert_eq!(
            names,
            [
                "Bash",
                "BashOutput",
                "KillShell",
                "Read",
                "Write",
                "Edit",
                "MultiEdit",
                "Glob",
                "Grep",
                "WebFetch",
                "TodoWrite"
            ]
        );
        let specs: Vec<String> = specs().iter().map(|spec| spec.name.to_string()).collect();
        assert_eq!(specs, names, "the offered specs follow the table");
    }

    #[test]
    fn every_row_is_named_as_its_spec_and_only_once() {
        for (at, tool) in BUILTINS.iter().enumerate() {
            assert_eq!((tool.spec)().name, tool.name);
            assert!(
                !BUILTINS[..at].iter().any(|other| other.name == tool.name),
                "{} twice",
                tool.name
            );
            assert!(
                !PLANNED.iter().any(|(planned, _)| *planned == tool.name),
                "{} is built: take it off PLANNED",
                tool.name
            );
            assert!(std::ptr::eq(lookup(tool.name).unwrap(), tool));
        }
        assert!(lookup("read").is_none());
        assert!(std::ptr::eq(
            lookup("mcp__github__create_issue").unwrap(),
            &MCP
        ));
        assert!(lookup("mcp__nameonly").is_none());
    }

    #[test]
    fn where_calls_run() {
        let placement = |name: &str| match lookup(name).map(|tool| tool.runs) {
            Some(Runs::Worker(_)) => "worker",
            Some(Runs::Process(_)) => "process",
            Some(Runs::Shell(_)) => "shell",
            Some(Runs::Fetch(_)) => "fetch",
            Some(Runs::Plan(_)) => "plan",
            Some(Runs::Mcp) => "mcp",
            None => "none",
        };
        assert_eq!(placement("mcp__fs__read"), "mcp");
        for name in ["Read", "Write", "Edit", "MultiEdit", "Glob", "Grep"] {
            assert_eq!(placement(name), "worker", "{name}");
        }
        assert_eq!(placement("Bash"), "process");
        for name in ["BashOutput", "KillShell"] {
            assert_eq!(placement(name), "shell", "{name}");
        }
        assert_eq!(placement("WebFetch"), "fetch");
        assert_eq!(placement("TodoWrite"), "plan");
        assert_eq!(placement("NotebookEdit"), "none");
    }

    #[test]
    fn file_rows_name_their_own_workers() {
        // `fs`'s tests call these functions by name, so the row is what ties a name to one.
        type Work = fn(&Value, &Path) -> ToolOutput;
        let workers: [(&str, Work); 6] = [
            ("Read", fs::run_read),
            ("Write", fs::run_write),
            ("Edit", fs::run_edit),
            ("MultiEdit", fs::run_multi_edit),
            ("Glob", fs::run_glob),
            ("Grep", fs::run_grep),
        ];
        for (name, work) in workers {
            let Some(Runs::Worker(row)) = lookup(name).map(|tool| tool.runs) else {
                panic!("`{name}` does not run on the worker pool");
            };
            assert!(std::ptr::fn_addr_eq(row, work), "{name}");
        }
    }

    #[test]
    fn default_actions_and_classes() {
        let default = |name: &str| permission(name).map(|p| p.default);
        for name in ["Read", "Grep", "Glob", "TodoWrite"] {
            assert_eq!(default(name), Some(DefaultAction::Allow), "{name}");
        }
        for name in ["Bash", "Write", "Edit", "WebFetch", "MultiEdit"] {
            assert_eq!(default(name), Some(DefaultAction::Ask), "{name}");
        }
        assert_eq!(default("mcp__x__y"), Some(DefaultAction::Ask));

        let class = |name: &str| permission(name).map(|p| p.class);
        for name in ["Read", "Grep", "Glob", "TodoWrite", "ExitPlanMode"] {
            assert_eq!(class(name), Some(Class::ReadOnly), "{name}");
        }
        for name in ["Write", "Edit", "MultiEdit", "NotebookEdit"] {
            assert!(edits_files(name), "{name}");
        }
        for name in ["Bash", "Read", "WebFetch", "mcp__x__y"] {
            assert!(!edits_files(name), "{name}");
        }
        assert_eq!(class("Bash"), Some(Class::Other));
        assert_eq!(class("WebFetch"), Some(Class::Other));
    }

    #[test]
    fn subjects() {
        let subject = |name: &str| permission(name).map(|p| p.subject);
        assert_eq!(subject("Bash"), Some(Subject::Command("command")));
        for name in ["Read", "Write", "Edit", "MultiEdit", "NotebookEdit"] {
            assert_eq!(subject(name), Some(PATH), "{name}");
        }
        for name in ["Glob", "Grep"] {
            assert_eq!(
                subject(name),
                Some(Subject::Path {
                    field: "path",
                    default: Some(".")
                }),
                "{name}"
            );
        }
        assert_eq!(subject("WebFetch"), Some(Subject::Url("url")));
        assert_eq!(subject("TodoWrite"), Some(Subject::Nothing));
        assert_eq!(subject("mcp__x__y"), Some(Subject::Nothing));
        assert_eq!(permission("mcp__x__y").map(|p| p.class), Some(Class::Other));
        // A file-changing tool names its file in a path field, which `acceptEdits` judges.
        for (name, _) in defaults() {
            if edits_files(name) {
                assert!(
                    matches!(subject(name), Some(Subject::Path { .. })),
                    "{name}"
                );
            }
        }
    }

    #[test]
    fn cards_and_delegation() {
        let tool = |name: &str| lookup(name).unwrap();
        let kinds: Vec<Kind> = BUILTINS.iter().map(|t| t.card.kind).collect();
        assert_eq!(
            kinds,
            [
                Kind::Execute,
                Kind::Read,
                Kind::Execute,
                Kind::Read,
                Kind::Edit,
                Kind::Edit,
                Kind::Edit,
                Kind::Search,
                Kind::Search,
                Kind::Fetch,
                Kind::Think
            ]
        );
        assert_eq!(tool("Read").card.location.unwrap().line, Some("offset"));
        assert_eq!(tool("Bash").card.location, None);
        assert!(matches!(tool("Write").card.diff, Diff::WholeFile { .. }));
        assert!(matches!(tool("Edit").card.diff, Diff::Replace { .. }));
        // A diff is shown at the card's location, so a row with one has one.
        for row in BUILTINS {
            if row.card.diff != Diff::None {
                assert!(row.card.location.is_some(), "{}", row.name);
            }
        }
        let delegation: Vec<&str> = BUILTINS
            .iter()
            .map(|t| match t.delegation {
                Delegation::Local => "local",
                Delegation::ReadFile(_) => "read",
                Delegation::WriteFile(_) => "write",
                Delegation::EditFile(_) => "edit",
                Delegation::Terminal(_) => "terminal",
            })
            .collect();
        assert_eq!(
            delegation,
            [
                "terminal", "local", "local", "read", "write", "edit", "edit", "local", "local",
                "local", "local"
            ]
        );
    }

    #[test]
    fn file_delegations_answer_with_their_own_variant() {
        let ws = std::env::temp_dir().join(format!("caliban-table-{}", std::process::id()));
        std::fs::create_dir_all(&ws).unwrap();
        std::fs::write(ws.join("a.txt"), "a\n").unwrap();
        let input = serde_json::json!({"path": "a.txt", "content": "b\n",
                                       "old_string": "a", "new_string": "b",
                                       "edits": [{"old_string": "a", "new_string": "b"}]});
        for row in BUILTINS {
            let (check, want): (DelegateCheck, &str) = match row.delegation {
                Delegation::ReadFile(check) => (check, "read"),
                Delegation::WriteFile(check) => (check, "write"),
                Delegation::EditFile(check) => (check, "edit"),
                Delegation::Local | Delegation::Terminal(_) => continue,
            };
            let got = match check(&input, &ws) {
                Ok(Delegated::Read { .. }) => "read",
                Ok(Delegated::Write { .. }) => "write",
                Ok(Delegated::Edit { .. }) => "edit",
                Err(refused) => panic!("{}: {}", row.name, refused.text),
            };
            assert_eq!(got, want, "{}", row.name);
        }
        let _ = std::fs::remove_dir_all(&ws);
    }

    #[test]
    fn titles() {
        let title = |name: &str, input: Value| (lookup(name).unwrap().card.title)(&input);
        use serde_json::json;
        assert_eq!(title("Read", json!({"path": "a.rs"})), "Read a.rs");
        assert_eq!(
            title("Read", json!({"path": "a.rs", "offset": 1})),
            "Read a.rs"
        );
        assert_eq!(
            title("Read", json!({"path": "a.rs", "offset": 9})),
            "Read a.rs (from line 9)"
        );
        assert_eq!(title("Write", json!({"path": "a"})), "Write a");
        assert_eq!(title("Edit", json!({"path": "a"})), "Edit a");
        assert_eq!(title("Bash", json!({"command": "ls -la"})), "ls -la");
        assert_eq!(title("Glob", json!({"pattern": "*.rs"})), "Glob *.rs");
        assert_eq!(
            title("Glob", json!({"pattern": "*.rs", "path": "src"})),
            "Glob *.rs in src"
        );
        assert_eq!(
            title(
                "Grep",
                json!({"pattern": "fn \"x\"", "path": "src", "include": "*.rs"})
            ),
            r#"Grep "fn \"x\"" in src (*.rs)"#
        );
        let long = "x".repeat(MAX_TITLE_CHARS * 2);
        assert_eq!(
            title("Bash", json!({ "command": long })),
            format!("{}…", "x".repeat(MAX_TITLE_CHARS))
        );
    }

    #[test]
    fn schemas_are_closed_objects_with_described_properties() {
        for spec in specs() {
            let schema = &spec.input_schema;
            assert_eq!(schema["type"], "object", "{}", spec.name);
            assert_eq!(schema["additionalProperties"], false, "{}", spec.name);
            let properties = schema["properties"]
                .as_object()
                .unwrap_or_else(|| panic!("{}: properties is not an object", spec.name));
            for (key, property) in properties {
                let described = property["description"].as_str().unwrap_or_default();
                assert!(
                    !described.is_empty(),
                    "{}.{key} has no description",
                    spec.name
                );
                assert!(
                    property["type"].is_string(),
                    "{}.{key} has no type",
                    spec.name
                );
            }
            let required = schema["required"]
                .as_array()
                .unwrap_or_else(|| panic!("{}: required is not an array", spec.name));
            assert!(!required.is_empty(), "{}", spec.name);
            for key in required {
                let key = key.as_str().unwrap_or_default();
                assert!(
                    properties.contains_key(key),
                    "{}: `{key}` required but not defined",
                    spec.name
                );
            }
            assert!(!spec.description.is_empty());
            assert!(
                !spec.description.contains("  "),
                "{}: stray double space",
                spec.name
            );
        }
    }

    #[test]
    fn fields_match_upstream() {
        let fields = |name: &str| -> (Vec<String>, Vec<String>) {
            let spec = specs()
                .into_iter()
                .find(|spec| spec.name == name)
                .unwrap_or_else(|| panic!("no spec for {name}"));
            let mut properties: Vec<String> = spec.input_schema["properties"]
                .as_object()
                .map(|props| props.keys().cloned().collect())
                .unwrap_or_default();
            properties.sort();
            let required = spec.input_schema["required"]
                .as_array()
                .map(|keys| {
                    keys.iter()
                        .filter_map(|k| k.as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default();
            (properties, required)
        };
        let strings = |keys: &[&str]| keys.iter().map(|key| key.to_string()).collect::<Vec<_>>();
        assert_eq!(
            fields("Read"),
            (strings(&["limit", "offset", "path"]), strings(&["path"]))
        );
        assert_eq!(
            fields("Write"),
            (strings(&["content", "path"]), strings(&["path", "content"]))
        );
        assert_eq!(
            fields("Edit"),
            (
                strings(&["new_string", "old_string", "path", "replace_all"]),
                strings(&["path", "old_string", "new_string"])
            )
        );
        assert_eq!(
            fields("Glob"),
            (strings(&["path", "pattern"]), strings(&["pattern"]))
        );
        assert_eq!(
            fields("Grep"),
            (
                strings(&["include", "max_matches", "path", "pattern"]),
                strings(&["pattern"])
            )
        );
        assert_eq!(
            fields("Bash"),
            (
                strings(&["background", "command", "cwd", "timeout_seconds"]),
                strings(&["command"])
            )
        );
        assert_eq!(
            fields("MultiEdit"),
            (strings(&["edits", "path"]), strings(&["path", "edits"]))
        );
        assert_eq!(
            fields("BashOutput"),
            (
                strings(&["shell_id", "since_offset"]),
                strings(&["shell_id"])
            )
        );
        assert_eq!(
            fields("KillShell"),
            (strings(&["shell_id"]), strings(&["shell_id"]))
        );
        assert_eq!(
            fields("TodoWrite"),
            (strings(&["todos"]), strings(&["todos"]))
        );
        assert_eq!(
            fields("WebFetch"),
            (
                strings(&["prompt", "timeout_seconds", "url"]),
                strings(&["url"])
            )
        );
    }
}
