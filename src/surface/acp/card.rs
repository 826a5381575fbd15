//! Tool-call cards: how a tool call looks in an editor. From a tool's row in `tools::table`
//! and a call's input this derives the ACP `kind`, a title, the file `locations` and `diff`
//! content, and it finds the moment a streamed input is complete; and what a call's output
//! shows (its images, a `TodoWrite` plan), live (`updates`) and replayed (`convo`) alike.
//! Pure functions; the only I/O is a bounded read of the file a whole-file write would
//! replace, for its diff.

use std::io::Read as _;
use std::path::Path;

use serde_json::{Value, json};

use crate::tools::fs::resolve_path;
use crate::tools::table::{self, Diff, Kind};
use crate::tools::text_field;
use crate::tools::todo::{Todo, TodoStatus};

/// A diff larger than this (old and new text together) is left out of the card: the result
/// text still says what changed, and a frame this size would choke some clients.
pub const MAX_DIFF_BYTES: usize = 1024 * 1024;
/// The most of an existing file read to show what a `Write` replaces.
pub const MAX_DIFF_OLD_BYTES: u64 = 256 * 1024;

/// ACP's `ToolKind` for a tool, which picks the editor's icon; a tool that is not built in
/// (an MCP server's) is `other`.
pub fn kind(tool: &str) -> &'static str {
    match table::lookup(tool).map(|tool| tool.card.kind) {
        Some(Kind::Read) => "read",
        Some(Kind::Edit) => "edit",
        Some(Kind::Delete) => "delete",
        Some(Kind::Move) => "move",
        Some(Kind::Search) => "search",
        Some(Kind::Execute) => "execute",
        Some(Kind::Think) => "think",
        Some(Kind::Fetch) => "fetch",
        Some(Kind::Other) | None => "other",
    }
}

/// What a card shows once the input is known.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Described {
    pub title: String,
    /// `ToolCallLocation`s: absolute paths, with a 1-based line when there is one.
    pub locations: Vec<Value>,
    /// `ToolCallContent`: the diff of an edit.
    pub content: Vec<Value>,
}

/// How the old text of a `Write` is found for its diff.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OldText {
    /// Read the file now (it has not been written yet).
    ReadFile,
    /// Show no diff (a replayed call: the file has moved on since).
    Unknown,
}

/// The card for a call of `tool` with `input`, as the tool's row in `tools::table` says:
/// its title, its location and the diff of what it changes, paths rooted in `workspace` as
/// the tools root them. Paths that do not resolve still title the card; they get no location.
pub fn describe(tool: &str, input: &Value, workspace: &Path, old: OldText) -> Described {
    let mut out = Described::default();
    let Some(card) = table::lookup(tool).map(|row| row.card) else {
        out.title = tool.to_owned();
        return out;
    };
    out.title = (card.title)(input);
    if out.title.trim().is_empty() {
        out.title = tool.to_owned();
    }
    let Some(at) = card.location else {
        return out;
    };
    let path = text_field(input, at.path);
    let Some(abs) = resolve_abs(workspace, path) else {
        return out;
    };
    let line = at.line.and_then(|field| input.get(field)?.as_u64());
    out.locations.push(match line {
        Some(line) => json!({"path": abs, "line": line}),
        None => json!({"path": abs}),
    });
    match card.diff {
        Diff::None => {}
        Diff::WholeFile { content } => {
            let content = text_field(input, content);
            let old_text = match old {
                OldText::ReadFile => existing_text(Path::new(&abs)),
                OldText::Unknown => None,
            };
            if let Some(old_text) = old_text {
                let size = content.len() + old_text.as_deref().map_or(0, str::len);
                if size <= MAX_DIFF_BYTES {
                    out.content.push(
                        json!({"type": "diff", "path": abs, "oldText": old_text, "newText": content}),
                    );
                }
            }
        }
        Diff::Replace { old, new } => {
            let (old_string, new_string) = (text_field(input, old), text_field(input, new));
            if old_string.len() + new_string.len() <= MAX_DIFF_BYTES {
                out.content.push(json!({"type": "diff", "path": abs,
                                        "oldText": old_string, "newText": new_string}));
            }
        }
    }
    out
}

/// `raw` rooted in the workspace as an absolute path, if it names a place inside it.
fn resolve_abs(workspace: &Path, raw: &str) -> Option<String> {
    if raw.is_empty() {
        return None;
    }
    resolve_path(workspace, raw)
        .ok()
        .map(|p| p.abs.display().to_string())
}

/// The text a `Write` replaces: `Some(None)` for a new file, `Some(Some(text))` for a small
/// text file, `None` when no honest diff can be shown (too big, binary, unreadable).
fn existing_text(path: &Path) -> Option<Option<String>> {
    let meta = match std::fs::metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Some(None),
        Err(_) => return None,
    };
    if !meta.is_file() || meta.len() > MAX_DIFF_OLD_BYTES {
        return None;
    }
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .ok()?
        .take(MAX_DIFF_OLD_BYTES + 1)
        .read_to_end(&mut bytes)
        .ok()?;
    if bytes.len() as u64 > MAX_DIFF_OLD_BYTES || bytes.contains(&0) {
        return None;
    }
    String::from_utf8(bytes).ok().map(Some)
}

/// `rawInput` from the streamed input fragments: the JSON value when they form one, else
/// the raw text; `None` when nothing was streamed.
pub fn raw_input(raw: &str) -> Option<Value> {
    if raw.trim().is_empty() {
        return None;
    }
    Some(serde_json::from_str(raw).unwrap_or_else(|_| Value::String(raw.to_owned())))
}

/// Finds where a streamed JSON object or array closes, one fragment at a time, in linear time
/// overall, so a card can show the input the moment it is complete rather than re-parsing the
/// growing text on every fragment.
#[derive(Clone, Debug, Default)]
pub struct JsonEnd {
    depth: u32,
    in_string: bool,
    escaped: bool,
    done: bool,
}

impl JsonEnd {
    /// Feeds the next fragment; true once the top-level value has closed.
    pub fn feed(&mut self, fragment: &str) -> bool {
        if self.done {
            return true;
        }
        for b in fragment.bytes() {
            if self.in_string {
                if self.escaped {
                    self.escaped = false;
                } else if b == b'\\' {
                    self.escaped = true;
                } else if b == b'"' {
                    self.in_string = false;
                }
                continue;
            }
            match b {
                b'"' => self.in_string = true,
                b'{' | b'[' => self.depth = self.depth.saturating_add(1),
                b'}' | b']' if self.depth > 0 => {
                    self.depth -= 1;
                    if self.depth == 0 {
                        self.done = true;
                        return true;
                    }
                }
                _ => {}
            }
        }
        false
    }
}

/// An image as ACP tool-call content (a `content` item holding an `image` block), from an
/// image block in upstream's shape (`source.media_type`, `source.data`).
pub(super) fn image_content(block: &Value) -> Value {
    let source = block.get("source").unwrap_or(&Value::Null);
    json!({"type": "content", "content": {"type": "image", "mimeType": source["media_type"],
                                           "data": source["data"]}})
}

/// A `TodoWrite` plan as ACP's `plan` update: the whole list, which the editor shows in place
/// of the last one. ACP has no `cancelled` status and upstream's items no priority, so
/// cancelled items are left out (a plan shows what is still meant to happen) and every
/// entry is `medium`.
pub(super) fn plan_update(todos: &[Todo]) -> Value {
    let entries: Vec<Value> = todos
        .iter()
        .filter(|todo| todo.status != TodoStatus::Cancelled)
        .map(|todo| {
            json!({"content": todo.content, "priority": "medium",
                   "status": todo.status.as_str()})
        })
        .collect();
    json!({"sessionUpdate": "plan", "entries": entries})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_end_at_every_split_point() {
        let text = r#"{"command":"echo \"}{\" \\","nested":{"a":[1,{"b":"]"}]}}"#;
        assert!(serde_json::from_str::<Value>(text).is_ok());
        for cut in 0..=text.len() {
            let mut scan = JsonEnd::default();
            let first = scan.feed(&text[..cut]);
            assert_eq!(first, cut == text.len(), "closed early at {cut}");
            assert!(scan.feed(&text[cut..]), "not closed after split at {cut}");
        }
        let mut scan = JsonEnd::default();
        for b in text.bytes() {
            let done = scan.feed(std::str::from_utf8(&[b]).unwrap());
            assert_eq!(done, b == b'}' && scan.depth == 0);
        }
    }

    #[test]
    fn raw_input_is_json_or_text_or_nothing() {
        assert_eq!(raw_input(""), None);
        assert_eq!(raw_input("  "), None);
        assert_eq!(raw_input(r#"{"path":"a"}"#), Some(json!({"path": "a"})));
        assert_eq!(raw_input(r#"{"path":"#), Some(json!(r#"{"path":"#)));
    }

    #[test]
    fn cards_for_each_tool() {
        let dir = std::env::temp_dir().join(format!("caliban-card-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let dir = dir.canonicalize().unwrap();
        std::fs::write(dir.join("old.txt"), "before\n").unwrap();
        let abs = |rel: &str| dir.join(rel).display().to_string();

        let read = describe(
            "Read",
            &json!({"path": "a.rs", "offset": 10}),
            &dir,
            OldText::ReadFile,
        );
        assert_eq!(read.title, "Read a.rs (from line 10)");
        assert_eq!(
            read.locations,
            vec![json!({"path": abs("a.rs"), "line": 10})]
        );

        let write = describe(
            "Write",
            &json!({"path": "old.txt", "content": "after\n"}),
            &dir,
            OldText::ReadFile,
        );
        assert_eq!(
            write.content,
            vec![
                json!({"type": "diff", "path": abs("old.txt"), "oldText": "before\n", "newText": "after\n"})
            ]
        );
        let new = describe(
            "Write",
            &json!({"path": "new.txt", "content": "x"}),
            &dir,
            OldText::ReadFile,
        );
        assert_eq!(new.content[0]["oldText"], Value::Null);
        let replayed = describe(
            "Write",
            &json!({"path": "old.txt", "content": "x"}),
            &dir,
            OldText::Unknown,
        );
        assert!(replayed.content.is_empty());

        let edit = describe(
            "Edit",
            &json!({"path": "old.txt", "old_string": "before", "new_string": "after"}),
            &dir,
            OldText::ReadFile,
        );
        assert_eq!(edit.title, "Edit old.txt");
        assert_eq!(edit.content[0]["oldText"], "before");

        let bash = describe(
            "Bash",
            &json!({"command": "cargo test"}),
            &dir,
            OldText::ReadFile,
        );
        assert_eq!(
            (bash.title.as_str(), bash.locations.len()),
            ("cargo test", 0)
        );
        let outside = describe(
            "Read",
            &json!({"path": "/etc/passwd"}),
            &dir,
            OldText::ReadFile,
        );
        assert!(outside.locations.is_empty());
        assert_eq!(
            describe("Mystery", &json!({}), &dir, OldText::ReadFile).title,
            "Mystery"
        );
        assert_eq!(kind("Grep"), "search");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
