//! The tool specs offered to the model: name, description and JSON Schema input of each
//! built-in tool, with names and fields as upstream (`path`, not `file_path`).
//!
//! Descriptions are written for the model: what the tool does and where its limits are. The
//! limits quoted here are enforced in `tools::fs` and the `Bash` runner; keep them in step.
//! This module is data only: it must not know how a tool runs.

use serde_json::{Value, json};

use std::borrow::Cow;

use crate::model::types::ToolSpec;

/// Every built-in tool, in the order they are offered.
pub fn all() -> Vec<ToolSpec> {
    vec![bash(), read(), write(), edit(), glob(), grep()]
}

fn bash() -> ToolSpec {
    ToolSpec {
        name: Cow::Borrowed("Bash"),
        description: Cow::Borrowed(
            "Run a shell command in the workspace and return its exit status, stdout \
            and stderr. The command runs in its own process group and is killed, with every \
            process it started, when it times out or the turn is cancelled. stdout and stderr \
            are each capped at 30 KiB. There is no terminal and stdin is empty, so interactive \
            commands cannot work. Prefer Read, Glob and Grep over cat, find and grep, and Edit \
            or Write over sed or echo.",
        ),
        input_schema: object(
            json!({
                "command": {
                    "type": "string",
                    "description": "The shell command to run."
                },
                "timeout_seconds": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": 600,
                    "description": "Kill the command after this many seconds (1-600, default 60)."
                },
                "cwd": {
                    "type": "string",
                    "description": "Directory to run in, relative to the workspace (default: the \
                        workspace root)."
                }
            }),
            &["command"],
        ),
    }
}

fn read() -> ToolSpec {
    ToolSpec {
        name: Cow::Borrowed("Read"),
        description: Cow::Borrowed(
            "Read a text file from the workspace. Returns a header \
            `→ Read <path>, lines a-b of n`, then each line prefixed with its 1-based number. \
            Shows at most `limit` lines (default 2000) starting at line `offset` (default 1); \
            lines over 2000 characters are cut, and output stops at 64 KiB with a note saying \
            which offset to continue from. Files over 5 MB and binary files are refused; \
            invalid UTF-8 is shown as U+FFFD. Use Glob, not Read, to list a directory.",
        ),
        input_schema: object(
            json!({
                "path": {
                    "type": "string",
                    "description": "File to read, relative to the workspace (or absolute inside it)."
                },
                "offset": {
                    "type": "integer",
                    "minimum": 1,
                    "description": "1-based line number to start from (default 1)."
                },
                "limit": {
                    "type": "integer",
                    "minimum": 1,
                    "description": "Maximum number of lines to return (default 2000)."
                }
            }),
            &["path"],
        ),
    }
}

fn write() -> ToolSpec {
    ToolSpec {
        name: Cow::Borrowed("Write"),
        description: Cow::Borrowed(
            "Create a file, or replace all of an existing file's content, in the \
            workspace. Parent directories are created as needed, and the file is replaced \
            atomically, so readers never see a partial write. To change part of an existing \
            file, use Edit instead.",
        ),
        input_schema: object(
            json!({
                "path": {
                    "type": "string",
                    "description": "File to write, relative to the workspace (or absolute inside it)."
                },
                "content": {
                    "type": "string",
                    "description": "The complete new content of the file."
                }
            }),
            &["path", "content"],
        ),
    }
}

fn edit() -> ToolSpec {
    ToolSpec {
        name: Cow::Borrowed("Edit"),
        description: Cow::Borrowed(
            "Replace text in an existing UTF-8 file in the workspace. `old_string` \
            must appear exactly once, unless `replace_all` is true; if it appears more than \
            once, include more surrounding lines to make it unique. Copy `old_string` exactly \
            from a recent Read, without the line-number prefix. If there is no exact match, \
            a match that ignores trailing whitespace and CRLF/LF differences is accepted when \
            it is unique. The file is rewritten atomically, and the result shows a short diff.",
        ),
        input_schema: object(
            json!({
                "path": {
                    "type": "string",
                    "description": "File to edit, relative to the workspace (or absolute inside it)."
                },
                "old_string": {
                    "type": "string",
                    "description": "The exact text to replace (not empty)."
                },
                "new_string": {
                    "type": "string",
                    "description": "The text to put in its place (must differ from old_string)."
                },
                "replace_all": {
                    "type": "boolean",
                    "description": "Replace every occurrence of old_string (default false)."
                }
            }),
            &["path", "old_string", "new_string"],
        ),
    }
}

fn glob() -> ToolSpec {
    ToolSpec {
        name: Cow::Borrowed("Glob"),
        description: Cow::Borrowed(
            "Find files by name pattern, such as `**/*.rs` or `src/*.{ts,tsx}`. \
            The pattern is matched against paths relative to `path`: `*` and `?` do not \
            cross `/`, and `**` matches any number of directories. Returns workspace-relative \
            paths, newest first, at most 200 (a note says how many more there were). `.git` \
            is skipped, and symlinked directories are not followed.",
        ),
        input_schema: object(
            json!({
                "pattern": {
                    "type": "string",
                    "description": "Glob pattern, relative to the search directory."
                },
                "path": {
                    "type": "string",
                    "description": "Directory to search, relative to the workspace (default: the \
                        workspace root)."
                }
            }),
            &["pattern"],
        ),
    }
}

fn grep() -> ToolSpec {
    ToolSpec {
        name: Cow::Borrowed("Grep"),
        description: Cow::Borrowed(
            "Search file contents with a regular expression (Rust regex syntax, \
            matched one line at a time). Returns `path:line: text` for each matching line, \
            with workspace-relative paths and lines cut at 500 characters, up to \
            `max_matches` (default 100) and 64 KiB. Skips `.git`, binary files and files \
            over 5 MB, and does not follow symlinks while walking directories.",
        ),
        input_schema: object(
            json!({
                "pattern": {
                    "type": "string",
                    "description": "Regular expression to search for, e.g. `fn\\s+main` or \
                        `(?i)todo`."
                },
                "path": {
                    "type": "string",
                    "description": "File or directory to search, relative to the workspace \
                        (default: the workspace root)."
                },
                "include": {
                    "type": "string",
                    "description": "Only search files matching this glob: on the file name \
                        (e.g. `*.rs`), or on the path below `path` if it contains `/` \
                        (e.g. `src/**/*.rs`)."
                },
                "max_matches": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": 500,
                    "description": "Stop after this many matching lines (1-500, default 100)."
                }
            }),
            &["pattern"],
        ),
    }
}

/// A closed object schema: unknown fields are not allowed.
fn object(properties: Value, required: &[&str]) -> Value {
    json!({
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_lists_the_six_tools_in_order() {
        let specs = all();
        let names: Vec<&str> = specs.iter().map(|spec| spec.name.as_ref()).collect();
        assert_eq!(names, ["Bash", "Read", "Write", "Edit", "Glob", "Grep"]);
    }

    #[test]
    fn schemas_are_closed_objects_with_described_properties() {
        for spec in all() {
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
            let spec = all()
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
                strings(&["command", "cwd", "timeout_seconds"]),
                strings(&["command"])
            )
        );
    }
}
