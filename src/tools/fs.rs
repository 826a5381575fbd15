//! The file tools the model may call: `Read`, `Write`, `Edit`, `Glob` and `Grep`. Each has
//! its section here: the spec offered to the model (whose quoted limits are the constants
//! below), the `run_*` entry its row in `tools::table` names, its card title, and the work.
//!
//! They run on a worker thread, so plain blocking filesystem calls are fine here, but every
//! result is bounded: files over 5 MB are refused, directory walks stop after a fixed number
//! of entries, and no output is longer than 64 KiB. Every path is rooted in the workspace:
//! relative paths resolve against it, absolute paths must point inside it, and a `..` or a
//! symlink that leads out is refused. Results name files relative to the workspace.
//!
//! A symlink inside the workspace that stays inside is resolved once, when the path is
//! rooted (`resolve`), and every check judges the resolved name; the work is then done by
//! handle on that name (`tools::beneath`), one component at a time, following no symlink,
//! so a command that swaps a directory for a symlink meanwhile gets the call refused, never
//! redirected.
//!
//! Failures are returned to the model as error results (`ToolOutput::error`), never logged
//! and never panicked on. This module must not know about the reactor, permission rules or
//! surfaces: by the time a `run_*` is called the caller has decided the call may go ahead.
//! The one thing it asks the policy is which paths are protected, because only here are
//! symlinks resolved (`resolve_for_edit`), and, for `tools::beneath`'s check by identity,
//! the sandbox's deny list.

use std::borrow::Cow;
use std::fmt::Write as _;
use std::fs::{self, File, Metadata};
use std::io::{self, Read as _};
use std::ops::ControlFlow;
use std::os::fd::AsRawFd as _;
use std::path::{Component, Path, PathBuf};
use std::time::SystemTime;

use regex::{Regex, RegexBuilder};
use serde_json::{Map, Value, json};

use crate::glob::{Glob, GlobOptions};
use crate::model::types::{ContentBlock, MAX_IMAGE_BASE64, ToolSpec};
use crate::sys;
use crate::tools::beneath::{self, Beneath, Refusal};
use crate::tools::{ToolOutput, cap_title, closed_object, text_field};

/// Hard cap on the text of any result.
const MAX_OUTPUT_BYTES: usize = 64 * 1024;
/// Files larger than this are neither read, edited nor searched.
const MAX_FILE_BYTES: u64 = 5 * 1024 * 1024;
/// A NUL byte in this many leading bytes marks a file as binary (the heuristic git uses).
const BINARY_SNIFF_BYTES: usize = 8 * 1024;

const READ_DEFAULT_LIMIT: u64 = 2000;
const READ_MAX_LINE_CHARS: usize = 2000;

const EDIT_DIFF_MAX_BYTES: usize = 8 * 1024;
const EDIT_CONTEXT_LINES: usize = 2;
const EDIT_DIFF_MAX_LINE_CHARS: usize = 300;

const GLOB_MAX_RESULTS: usize = 200;

const GREP_DEFAULT_MATCHES: u64 = 100;
const GREP_MAX_MATCHES: u64 = 500;
const GREP_MAX_LINE_CHARS: usize = 500;
/// Compiled-size budget for a `Grep` regex, so a pattern like `\w{1000}{1000}` is refused
/// instead of eating memory.
const GREP_REGEX_SIZE_LIMIT: usize = 1 << 20;

/// Directory entries one walk may visit before it stops and says so.
const WALK_MAX_ENTRIES: usize = 100_000;

/// A tool failure as text for the model; `finish` prefixes the tool name.
type ToolResult = Result<String, String>;

// ---------------------------------------------------------------------------------------------
// Read

/// `Read` as offered to the model.
pub(crate) fn read_spec() -> ToolSpec {
    ToolSpec {
        name: Cow::Borrowed("Read"),
        description: Cow::Borrowed(
            "Read a text file from the workspace. Returns a header \
            `→ Read <path>, lines a-b of n`, then each line prefixed with its 1-based number. \
            Shows at most `limit` lines (default 2000) starting at line `offset` (default 1); \
            lines over 2000 characters are cut, and output stops at 64 KiB with a note saying \
            which offset to continue from. Files over 5 MB and binary files are refused; \
            invalid UTF-8 is shown as U+FFFD. An image (.png, .jpg, .jpeg, .gif, .webp, up \
            to 2.25 MiB) is shown to you as a picture instead. Use Glob, not Read, to list \
            a directory.",
        ),
        input_schema: closed_object(
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

/// Runs one `Read` call. Blocking; call it from a worker thread, not the reactor.
pub(crate) fn run_read(input: &Value, workspace: &Path) -> ToolOutput {
    let (target, offset, limit) = match read_args(input, workspace) {
        Ok(args) => args,
        Err(err) => return refusal("Read")(err),
    };
    if image_type(&target.rel).is_some() {
        return read_image(&target).unwrap_or_else(refusal("Read"));
    }
    finish(
        "Read",
        load_text(&target)
            .and_then(|(text, lossy)| render_read(&target.rel, &text, lossy, offset, limit)),
    )
}

/// The image types `Read` shows the model as pictures, by file extension (what the model
/// names): the four both providers take.
const IMAGE_EXTENSIONS: [(&str, &str); 5] = [
    ("png", "image/png"),
    ("jpg", "image/jpeg"),
    ("jpeg", "image/jpeg"),
    ("gif", "image/gif"),
    ("webp", "image/webp"),
];

/// The largest image file `Read` shows: as much as fits `MAX_IMAGE_BASE64` once encoded.
const MAX_IMAGE_FILE_BYTES: u64 = (MAX_IMAGE_BASE64 / 4 * 3) as u64;

/// The image type a path's extension names, if `Read` shows it as a picture.
fn image_type(path: &str) -> Option<&'static str> {
    let (_, ext) = path.rsplit_once('.')?;
    IMAGE_EXTENSIONS
        .iter()
        .find(|(e, _)| e.eq_ignore_ascii_case(ext))
        .map(|(_, media_type)| *media_type)
}

/// Whether a `Read` call names an image file, which is read here and not through an
/// editor (whose `fs/read_text_file` gives text).
pub(crate) fn reads_image(input: &Value) -> bool {
    image_type(text_field(input, "path")).is_some()
}

/// `Read` of an image file: the picture for the model, with a header line naming it. The
/// type comes from the file's bytes (a `.png` that is really a JPEG is sent as one); a file
/// none of the four types' bytes start is refused rather than sent mislabelled.
fn read_image(target: &Resolved) -> Result<ToolOutput, String> {
    let rel = &target.rel;
    let bytes = load_bytes(target, MAX_IMAGE_FILE_BYTES, |n_bytes| {
        format!(
            "`{rel}` is an image of {n_bytes} bytes, too large to show the model: at most \
             {MAX_IMAGE_FILE_BYTES} bytes ({MAX_IMAGE_BASE64} bytes of base64); make a \
             smaller copy (e.g. with Bash) and read that"
        )
    })?;
    let Some(media_type) = crate::model::types::sniff_image(&bytes) else {
        return Err(format!(
            "`{rel}` is named as an image but its bytes are not PNG, JPEG, GIF or WebP; not shown"
        ));
    };
    let image = ContentBlock::image_of_bytes(media_type, &bytes)?;
    let mut out = ToolOutput::ok(format!(
        "→ Read {rel}: {media_type}, {} bytes, shown as an image",
        bytes.len()
    ));
    out.images.push(image);
    Ok(out)
}

/// A `Read` call's title: the file, and the line it starts at when not the first.
pub(crate) fn read_title(input: &Value) -> String {
    let path = text_field(input, "path");
    match input.get("offset").and_then(Value::as_u64) {
        Some(line) if line > 1 => format!("Read {path} (from line {line})"),
        _ => format!("Read {path}"),
    }
}

/// `Read`'s input: the file, the first line (1-based) and how many lines.
fn read_args(input: &Value, workspace: &Path) -> Result<(Resolved, u64, u64), String> {
    let obj = object(input)?;
    let raw_path = required_str(obj, "path")?;
    let offset = optional_int(obj, "offset", 1, u64::MAX)?.unwrap_or(1);
    let limit = optional_int(obj, "limit", 1, u64::MAX)?.unwrap_or(READ_DEFAULT_LIMIT);
    Ok((resolve(workspace, raw_path)?, offset, limit))
}

/// `Read`'s result for a file's text: numbered lines from `offset`, at most `limit` of them.
fn render_read(rel: &str, text: &str, lossy: bool, offset: u64, limit: u64) -> ToolResult {
    let lines: Vec<&str> = text.lines().collect();
    let total = lines.len();
    if total == 0 {
        return Ok(format!("→ Read {rel}, lines 0-0 of 0 (empty file)"));
    }
    let first = usize::try_from(offset).unwrap_or(usize::MAX);
    if first > total {
        return Err(format!(
            "`offset` {offset} is past the end of `{rel}` ({total} lines)"
        ));
    }
    let wanted_end = first
        .saturating_sub(1)
        .saturating_add(usize::try_from(limit).unwrap_or(usize::MAX))
        .min(total);

    // Stop adding lines before the output cap rather than letting `cap_output` cut a line in
    // half, so the header can say exactly which lines were shown.
    let budget = MAX_OUTPUT_BYTES.saturating_sub(512 + 2 * rel.len());
    let mut body = String::new();
    let mut last = first - 1;
    let mut hit_budget = false;
    for (idx, line) in lines.iter().enumerate().take(wanted_end).skip(first - 1) {
        let entry = format!("{:>5}  {}\n", idx + 1, cap_line(line, READ_MAX_LINE_CHARS));
        if body.len() + entry.len() > budget {
            hit_budget = true;
            break;
        }
        body.push_str(&entry);
        last = idx + 1;
    }

    let mut out = format!("→ Read {rel}, lines {first}-{last} of {total}\n");
    if lossy {
        out.push_str("(note: the file is not valid UTF-8; invalid bytes are shown as U+FFFD)\n");
    }
    out.push_str(&body);
    if hit_budget {
        let _ = write!(
            out,
            "(output capped at 64 KiB after line {last}; continue with offset={})",
            last + 1
        );
    } else if last < total {
        let _ = write!(
            out,
            "({} more lines; continue with offset={})",
            total - last,
            last + 1
        );
    }
    Ok(out.trim_end_matches('\n').to_owned())
}

// ---------------------------------------------------------------------------------------------
// Write

/// `Write` as offered to the model.
pub(crate) fn write_spec() -> ToolSpec {
    ToolSpec {
        name: Cow::Borrowed("Write"),
        description: Cow::Borrowed(
            "Create a file, or replace all of an existing file's content, in the \
            workspace. Parent directories are created as needed, and the file is replaced \
            atomically, so readers never see a partial write. To change part of an existing \
            file, use Edit instead.",
        ),
        input_schema: closed_object(
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

/// Runs one `Write` call. Blocking; call it from a worker thread, not the reactor.
pub(crate) fn run_write(input: &Value, workspace: &Path) -> ToolOutput {
    finish("Write", write(input, workspace))
}

/// A `Write` call's title: the file.
pub(crate) fn write_title(input: &Value) -> String {
    format!("Write {}", text_field(input, "path"))
}

fn write(input: &Value, workspace: &Path) -> ToolResult {
    let (target, content) = write_args(input, workspace)?;
    let rel = &target.rel;
    let Some((parent_rel, name)) = beneath::split(rel) else {
        return Err(format!("`{rel}` is a directory"));
    };
    let held = open_beneath(&target)?;
    // Each missing parent is made by handle, beneath the one before, like `create_dir_all`.
    let parent = held
        .dir(parent_rel, true)
        .map_err(|refusal| match refusal {
            Refusal::Io { err, .. } => {
                format!("cannot create the parent directories of `{rel}`: {err}")
            }
            refusal => refusal.message(rel),
        })?;
    let existing = match held.stat(&parent, name) {
        Ok(Some(meta)) if meta.is_dir() => return Err(format!("`{rel}` is a directory")),
        Ok(Some(meta)) if !meta.is_file() => {
            return Err(format!("`{rel}` is not a regular file"));
        }
        Ok(existing) => existing,
        Err(refusal) => return Err(refusal.message(rel)),
    };
    held.replace(&parent, name, content.as_bytes(), existing.as_ref())
        .map_err(|err| format!("cannot write `{rel}`: {err}"))?;
    Ok(write_summary(rel, content, existing.is_some()))
}

fn write_args<'a>(input: &'a Value, workspace: &Path) -> Result<(Resolved, &'a str), String> {
    let obj = object(input)?;
    let raw_path = required_str(obj, "path")?;
    let content = required_str(obj, "content")?;
    Ok((resolve_for_edit(workspace, raw_path)?, content))
}

/// What a `Write` would replace: `None` for a new file; an error for a directory or a
/// special file.
fn write_target(target: &Resolved) -> Result<Option<Metadata>, String> {
    let rel = &target.rel;
    match fs::metadata(&target.abs) {
        Ok(meta) if meta.is_dir() => Err(format!("`{rel}` is a directory")),
        Ok(meta) if !meta.is_file() => Err(format!("`{rel}` is not a regular file")),
        Ok(meta) => Ok(Some(meta)),
        Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(err) => Err(io_message(rel, &err)),
    }
}

fn write_summary(rel: &str, content: &str, existed: bool) -> String {
    let n_bytes = content.len();
    let n_lines = content.lines().count();
    let how = if existed {
        "overwrote the existing file"
    } else {
        "created"
    };
    format!("→ Wrote {n_bytes} bytes ({n_lines} lines) to {rel} ({how})")
}

// ---------------------------------------------------------------------------------------------
// Edit

/// `Edit` as offered to the model.
pub(crate) fn edit_spec() -> ToolSpec {
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
        input_schema: closed_object(
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

/// Runs one `Edit` call. Blocking; call it from a worker thread, not the reactor.
pub(crate) fn run_edit(input: &Value, workspace: &Path) -> ToolOutput {
    finish("Edit", edit(input, workspace))
}

/// An `Edit` call's title: the file.
pub(crate) fn edit_title(input: &Value) -> String {
    format!("Edit {}", text_field(input, "path"))
}

fn edit(input: &Value, workspace: &Path) -> ToolResult {
    let (target, args) = edit_args(input, workspace)?;
    rewrite(&target, "Edit", |text| edit_text(&target.rel, text, &args))
}

/// Changes an existing UTF-8 file in place: `change` makes the new text and the result for
/// the model from the old text, and the file is rewritten atomically only if it succeeds.
fn rewrite(
    target: &Resolved,
    tool: &str,
    change: impl FnOnce(&str) -> Result<(String, String), String>,
) -> ToolResult {
    let rel = &target.rel;
    // Read and replaced through the same directory handle, so the file changed is the one
    // read, wherever its path leads by then.
    let held = open_beneath(target)?;
    let (file, parent, name) = match open_file(&held, target) {
        Err(refusal) if refusal.is_not_found() => {
            return Err(format!(
                "`{rel}` does not exist; use Write to create a new file"
            ));
        }
        other => other.map_err(|refusal| refusal.message(rel))?,
    };
    let meta = file.1.clone();
    let (text, lossy) = text_of(
        rel,
        load_from(rel, file, MAX_FILE_BYTES, too_big_text(rel))?,
    )?;
    if lossy {
        return Err(format!(
            "`{rel}` is not valid UTF-8; {tool} only changes UTF-8 text (use Write to replace it)"
        ));
    }
    let (new_text, summary) = change(&text)?;
    held.replace(&parent, name, new_text.as_bytes(), Some(&meta))
        .map_err(|err| format!("cannot write `{rel}`: {err}"))?;
    Ok(summary)
}

/// `Edit`'s input once checked.
struct EditArgs<'a> {
    old: &'a str,
    new: &'a str,
    replace_all: bool,
}

fn edit_args<'a>(input: &'a Value, workspace: &Path) -> Result<(Resolved, EditArgs<'a>), String> {
    let obj = object(input)?;
    let raw_path = required_str(obj, "path")?;
    let old = required_str(obj, "old_string")?;
    let new = required_str(obj, "new_string")?;
    let replace_all = optional_bool(obj, "replace_all")?.unwrap_or(false);
    if old.is_empty() {
        return Err(
            "`old_string` is empty; use Write to create a file or replace its whole content"
                .to_owned(),
        );
    }
    if old == new {
        return Err("`old_string` and `new_string` are identical; nothing to change".to_owned());
    }
    let target = resolve_for_edit(workspace, raw_path)?;
    Ok((
        target,
        EditArgs {
            old,
            new,
            replace_all,
        },
    ))
}

/// The file an `Edit` changes must exist.
fn edit_target(target: &Resolved) -> Result<Metadata, String> {
    let rel = &target.rel;
    match fs::metadata(&target.abs) {
        Err(err) if err.kind() == io::ErrorKind::NotFound => Err(format!(
            "`{rel}` does not exist; use Write to create a new file"
        )),
        Err(err) => Err(io_message(rel, &err)),
        Ok(meta) => Ok(meta),
    }
}

/// Applies an `Edit` to a file's text: the new text and the result for the model.
fn edit_text(rel: &str, text: &str, args: &EditArgs) -> Result<(String, String), String> {
    let plan =
        plan_edit(text, args.old, args.new, args.replace_all).map_err(|miss| miss.describe(rel))?;
    let new_text = apply_edit(text, &plan.ranges, &plan.replacement);
    let diff = diff_summary(text, &plan.ranges, &plan.replacement);
    let n = plan.ranges.len();
    let mut out = format!(
        "→ Edited {rel}: {n} replacement{}, -{} +{} lines",
        if n == 1 { "" } else { "s" },
        diff.removed,
        diff.added
    );
    if plan.tier == MatchTier::Whitespace {
        out.push_str(" (matched ignoring trailing whitespace and line endings)");
    }
    out.push('\n');
    out.push_str(&diff.text);
    Ok((new_text, out.trim_end_matches('\n').to_owned()))
}

// ---------------------------------------------------------------------------------------------
// MultiEdit

/// The most edits one `MultiEdit` call may make: a file needing more is better rewritten.
const MULTI_EDIT_MAX_EDITS: usize = 100;

/// `MultiEdit` as offered to the model.
pub(crate) fn multi_edit_spec() -> ToolSpec {
    ToolSpec {
        name: Cow::Borrowed("MultiEdit"),
        description: Cow::Borrowed(
            "Make several replacements in one existing UTF-8 file, all or nothing. \
            `edits` are applied in order, each to the text the previous ones left, with the \
            same rules as Edit: `old_string` must appear exactly once unless `replace_all` is \
            true, and a match ignoring trailing whitespace and CRLF/LF differences is accepted \
            when it is unique. If any edit fails, the file is left untouched and the result \
            says which edit failed and why. At most 100 edits; the file is rewritten \
            atomically.",
        ),
        input_schema: closed_object(
            json!({
                "path": {
                    "type": "string",
                    "description": "File to edit, relative to the workspace (or absolute inside it)."
                },
                "edits": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": MULTI_EDIT_MAX_EDITS,
                    "description": "The replacements, applied in order.",
                    "items": closed_object(
                        json!({
                            "old_string": {
                                "type": "string",
                                "description": "The exact text to replace (not empty)."
                            },
                            "new_string": {
                                "type": "string",
                                "description": "The text to put in its place."
                            },
                            "replace_all": {
                                "type": "boolean",
                                "description": "Replace every occurrence (default false)."
                            }
                        }),
                        &["old_string", "new_string"],
                    )
                }
            }),
            &["path", "edits"],
        ),
    }
}

/// Runs one `MultiEdit` call. Blocking; call it from a worker thread, not the reactor.
pub(crate) fn run_multi_edit(input: &Value, workspace: &Path) -> ToolOutput {
    finish("MultiEdit", multi_edit(input, workspace))
}

/// A `MultiEdit` call's title: the file and how many edits.
pub(crate) fn multi_edit_title(input: &Value) -> String {
    let path = text_field(input, "path");
    match input.get("edits").and_then(Value::as_array).map(Vec::len) {
        Some(n) if n != 1 => format!("Edit {path} ({n} edits)"),
        _ => format!("Edit {path}"),
    }
}

fn multi_edit(input: &Value, workspace: &Path) -> ToolResult {
    let (target, edits) = multi_edit_args(input, workspace)?;
    rewrite(&target, "MultiEdit", |text| {
        multi_edit_text(&target.rel, text, &edits)
    })
}

fn multi_edit_args<'a>(
    input: &'a Value,
    workspace: &Path,
) -> Result<(Resolved, Vec<EditArgs<'a>>), String> {
    let obj = object(input)?;
    let raw_path = required_str(obj, "path")?;
    let edits = edits_arg(obj)?;
    let target = resolve_for_edit(workspace, raw_path)?;
    Ok((target, edits))
}

/// `MultiEdit`'s `edits`, each checked as `Edit` checks its input.
fn edits_arg(obj: &Map<String, Value>) -> Result<Vec<EditArgs<'_>>, String> {
    let edits = match obj.get("edits") {
        Some(Value::Array(edits)) if edits.is_empty() => {
            return Err("`edits` is empty; give at least one edit".to_owned());
        }
        Some(Value::Array(edits)) if edits.len() > MULTI_EDIT_MAX_EDITS => {
            return Err(format!(
                "`edits` holds {} edits, more than {MULTI_EDIT_MAX_EDITS}; use Write to \
                 replace the file",
                edits.len()
            ));
        }
        Some(Value::Array(edits)) => edits,
        None | Some(Value::Null) => return Err("missing required array field `edits`".to_owned()),
        Some(other) => {
            return Err(format!(
                "field `edits` must be an array, got {}",
                crate::text::json_kind(other)
            ));
        }
    };
    let n = edits.len();
    edits
        .iter()
        .enumerate()
        .map(|(at, edit)| {
            let number = |e: String| format!("edit {} of {n}: {e}; no edit was applied", at + 1);
            let obj = object(edit).map_err(number)?;
            let args = EditArgs {
                old: required_str(obj, "old_string").map_err(number)?,
                new: required_str(obj, "new_string").map_err(number)?,
                replace_all: optional_bool(obj, "replace_all")
                    .map_err(number)?
                    .unwrap_or(false),
            };
            if args.old.is_empty() {
                return Err(number("`old_string` is empty".to_owned()));
            }
            if args.old == args.new {
                return Err(number(
                    "`old_string` and `new_string` are identical".to_owned(),
                ));
            }
            Ok(args)
        })
        .collect()
}

/// Applies every edit in order to a file's text, or none: the new text and the result for
/// the model, or which edit failed.
fn multi_edit_text(rel: &str, text: &str, edits: &[EditArgs]) -> Result<(String, String), String> {
    let n = edits.len();
    let mut current = text.to_owned();
    let mut out = format!(
        "→ MultiEdit {rel}: {n} edit{} applied",
        if n == 1 { "" } else { "s" }
    );
    for (at, args) in edits.iter().enumerate() {
        let (next, summary) = edit_text(rel, &current, args).map_err(|e| {
            format!(
                "edit {} of {n} failed: {e}; no edit was applied (edits apply in order, each \
                 to the text the earlier ones left)",
                at + 1
            )
        })?;
        current = next;
        let _ = write!(
            out,
            "\n[edit {}] {}",
            at + 1,
            summary.trim_start_matches("→ ")
        );
    }
    Ok((current, out))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum MatchTier {
    Exact,
    /// Matched after dropping trailing whitespace on every line and `\r` before `\n`.
    Whitespace,
}

#[derive(Debug)]
struct EditPlan {
    /// Byte ranges of `text` to replace, sorted and non-overlapping.
    ranges: Vec<(usize, usize)>,
    /// `new_string`, with line endings converted to CRLF when the matched text used CRLF.
    replacement: String,
    tier: MatchTier,
}

/// Why an `Edit` found nothing to change.
#[derive(Debug, PartialEq, Eq)]
enum EditMiss {
    NotFound { hint: Option<String> },
    Ambiguous { count: usize, tier: MatchTier },
}

impl EditMiss {
    fn describe(&self, rel: &str) -> String {
        match self {
            EditMiss::NotFound { hint } => {
                let mut msg = format!(
                    "`old_string` was not found in `{rel}` (also tried ignoring trailing \
                     whitespace and line endings); Read the file again and copy the exact text, \
                     including indentation"
                );
                if let Some(hint) = hint {
                    msg.push_str("; ");
                    msg.push_str(hint);
                }
                msg
            }
            EditMiss::Ambiguous {
                count,
                tier: MatchTier::Exact,
            } => format!(
                "`old_string` was found {count} times in `{rel}`; include more surrounding lines \
                 to make it unique, or set `replace_all` to true to change every occurrence"
            ),
            EditMiss::Ambiguous {
                count,
                tier: MatchTier::Whitespace,
            } => format!(
                "`old_string` was not found exactly, and ignoring trailing whitespace and line \
                 endings it matches {count} places in `{rel}`; copy the exact text from a fresh \
                 Read, with enough surrounding lines to make it unique"
            ),
        }
    }
}

fn plan_edit(text: &str, old: &str, new: &str, replace_all: bool) -> Result<EditPlan, EditMiss> {
    let exact: Vec<(usize, usize)> = text
        .match_indices(old)
        .map(|(start, found)| (start, start + found.len()))
        .collect();
    match exact.len() {
        0 => {}
        1 => {
            return Ok(EditPlan {
                ranges: exact,
                replacement: new.to_owned(),
                tier: MatchTier::Exact,
            });
        }
        count if !replace_all => {
            return Err(EditMiss::Ambiguous {
                count,
                tier: MatchTier::Exact,
            });
        }
        _ => {
            return Ok(EditPlan {
                ranges: exact,
                replacement: new.to_owned(),
                tier: MatchTier::Exact,
            });
        }
    }

    // Second tier: models often get trailing spaces or CRLF wrong. Accept a match on the
    // normalised text, but only a unique one, since the normalisation can merge places.
    let (norm_text, byte_map) = normalize_whitespace(text);
    let (norm_old, _) = normalize_whitespace(old);
    if !norm_old.is_empty() {
        let found: Vec<usize> = norm_text
            .match_indices(norm_old.as_str())
            .map(|(start, _)| start)
            .collect();
        if found.len() > 1 {
            return Err(EditMiss::Ambiguous {
                count: found.len(),
                tier: MatchTier::Whitespace,
            });
        }
        if let [norm_start] = found[..] {
            let norm_last = norm_start + norm_old.len() - 1;
            let (Some(&start), Some(&last)) = (byte_map.get(norm_start), byte_map.get(norm_last))
            else {
                return Err(EditMiss::NotFound { hint: None });
            };
            let end = last + 1;
            let replacement = if text.get(start..end).is_some_and(|s| s.contains("\r\n")) {
                to_crlf(new)
            } else {
                new.to_owned()
            };
            return Ok(EditPlan {
                ranges: vec![(start, end)],
                replacement,
                tier: MatchTier::Whitespace,
            });
        }
    }
    Err(EditMiss::NotFound {
        hint: first_line_hint(text, old),
    })
}

/// `text` without trailing whitespace on any line (which also drops the `\r` of CRLF), and
/// for each byte kept, its offset in `text`.
fn normalize_whitespace(text: &str) -> (String, Vec<usize>) {
    let mut out = String::with_capacity(text.len());
    let mut byte_map = Vec::with_capacity(text.len());
    let mut line_start = 0;
    for line in text.split_inclusive('\n') {
        let (body, has_newline) = match line.strip_suffix('\n') {
            Some(body) => (body, true),
            None => (line, false),
        };
        let kept = body.trim_end();
        out.push_str(kept);
        byte_map.extend(line_start..line_start + kept.len());
        if has_newline {
            out.push('\n');
            byte_map.push(line_start + body.len());
        }
        line_start += line.len();
    }
    (out, byte_map)
}

fn to_crlf(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + text.len() / 16);
    let mut prev = '\0';
    for c in text.chars() {
        if c == '\n' && prev != '\r' {
            out.push('\r');
        }
        out.push(c);
        prev = c;
    }
    out
}

/// Where the first non-blank line of `old` appears with indentation ignored, which usually
/// means the model got the indentation or a later line wrong.
fn first_line_hint(text: &str, old: &str) -> Option<String> {
    let first = old.lines().map(str::trim).find(|line| !line.is_empty())?;
    let hits: Vec<String> = text
        .lines()
        .enumerate()
        .filter(|(_, line)| line.trim() == first)
        .map(|(idx, _)| (idx + 1).to_string())
        .take(4)
        .collect();
    match hits.len() {
        0 => None,
        1 => Some(format!(
            "its first line matches line {} when indentation is ignored",
            hits[0]
        )),
        _ => Some(format!(
            "its first line matches lines {} when indentation is ignored",
            hits.join(", ")
        )),
    }
}

fn apply_edit(text: &str, ranges: &[(usize, usize)], replacement: &str) -> String {
    let mut out = String::with_capacity(text.len() + replacement.len() * ranges.len());
    let mut pos = 0;
    for &(start, end) in ranges {
        out.push_str(&text[pos..start]);
        out.push_str(replacement);
        pos = end;
    }
    out.push_str(&text[pos..]);
    out
}

/// Replacements whose touched lines overlap, shown as one hunk: lines `first..=last`.
struct LineGroup {
    first: usize,
    last: usize,
    ranges: Vec<(usize, usize)>,
}

struct DiffSummary {
    text: String,
    removed: usize,
    added: usize,
}

/// A unified-diff-like view of the replacements: one hunk per group of touched lines, with a
/// little context, capped at `EDIT_DIFF_MAX_BYTES`. Line counts cover every hunk even when
/// the text is cut.
fn diff_summary(text: &str, ranges: &[(usize, usize)], replacement: &str) -> DiffSummary {
    let mut line_starts = vec![0];
    line_starts.extend(
        text.match_indices('\n')
            .map(|(idx, _)| idx + 1)
            .filter(|&start| start < text.len()),
    );
    let line_of = |pos: usize| line_starts.partition_point(|&start| start <= pos) - 1;
    let line_end = |line: usize| line_starts.get(line + 1).copied().unwrap_or(text.len());
    let lines: Vec<&str> = text.lines().collect();

    // Group replacements that touch the same lines so each line shows once.
    let mut groups: Vec<LineGroup> = Vec::new();
    for &(start, end) in ranges {
        let first = line_of(start);
        let last = line_of(end.saturating_sub(1).max(start));
        match groups.last_mut() {
            Some(group) if first <= group.last => {
                group.last = group.last.max(last);
                group.ranges.push((start, end));
            }
            _ => groups.push(LineGroup {
                first,
                last,
                ranges: vec![(start, end)],
            }),
        }
    }

    let mut out = String::new();
    let mut cut = false;
    let mut removed = 0;
    let mut added = 0;
    let mut shift: isize = 0;
    for group in &groups {
        let (first, last) = (group.first, group.last);
        let chunk_start = line_starts[first];
        let chunk_end = line_end(last);
        let mut new_chunk = String::new();
        let mut pos = chunk_start;
        for &(start, end) in &group.ranges {
            new_chunk.push_str(&text[pos..start]);
            new_chunk.push_str(replacement);
            pos = end;
        }
        new_chunk.push_str(&text[pos..chunk_end]);
        let old_lines: Vec<&str> = text[chunk_start..chunk_end].lines().collect();
        let new_lines: Vec<&str> = new_chunk.lines().collect();
        removed += old_lines.len();
        added += new_lines.len();

        let ctx_start = first.saturating_sub(EDIT_CONTEXT_LINES);
        let ctx_end = (last + 1 + EDIT_CONTEXT_LINES).min(lines.len());
        let before = lines.get(ctx_start..first).unwrap_or_default();
        let after = lines
            .get((last + 1).min(ctx_end)..ctx_end)
            .unwrap_or_default();
        let old_count = before.len() + old_lines.len() + after.len();
        let new_count = before.len() + new_lines.len() + after.len();
        let new_start = (ctx_start as isize + 1 + shift).max(1);
        shift += new_lines.len() as isize - old_lines.len() as isize;
        if cut {
            continue;
        }

        let mut hunk = vec![format!(
            "@@ -{},{old_count} +{new_start},{new_count} @@",
            ctx_start + 1
        )];
        let marked =
            |mark: char, line: &&str| format!("{mark}{}", cap_line(line, EDIT_DIFF_MAX_LINE_CHARS));
        hunk.extend(before.iter().map(|line| marked(' ', line)));
        hunk.extend(old_lines.iter().map(|line| marked('-', line)));
        hunk.extend(new_lines.iter().map(|line| marked('+', line)));
        hunk.extend(after.iter().map(|line| marked(' ', line)));
        for line in hunk {
            if out.len() + line.len() + 1 > EDIT_DIFF_MAX_BYTES {
                cut = true;
                break;
            }
            out.push_str(&line);
            out.push('\n');
        }
    }
    if cut {
        out.push_str("… (diff cut at 8 KiB)\n");
    }
    DiffSummary {
        text: out,
        removed,
        added,
    }
}

// ---------------------------------------------------------------------------------------------
// Glob

/// `Glob` as offered to the model.
pub(crate) fn glob_spec() -> ToolSpec {
    ToolSpec {
        name: Cow::Borrowed("Glob"),
        description: Cow::Borrowed(
            "Find files by name pattern, such as `**/*.rs` or `src/*.{ts,tsx}`. \
            The pattern is matched against paths relative to `path`: `*` and `?` do not \
            cross `/`, and `**` matches any number of directories. Returns workspace-relative \
            paths, newest first, at most 200 (a note says how many more there were). `.git` \
            is skipped, and symlinked directories are not followed.",
        ),
        input_schema: closed_object(
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

/// Runs one `Glob` call. Blocking; call it from a worker thread, not the reactor.
pub(crate) fn run_glob(input: &Value, workspace: &Path) -> ToolOutput {
    finish("Glob", glob(input, workspace))
}

/// A `Glob` call's title: the pattern, and the directory when not the workspace root.
pub(crate) fn glob_title(input: &Value) -> String {
    match text_field(input, "path") {
        "" => format!("Glob {}", text_field(input, "pattern")),
        dir => format!("Glob {} in {dir}", text_field(input, "pattern")),
    }
}

fn glob(input: &Value, workspace: &Path) -> ToolResult {
    let obj = object(input)?;
    let pattern = required_str(obj, "pattern")?;
    let raw_dir = optional_str(obj, "path")?.unwrap_or(".");
    let dir = resolve(workspace, raw_dir)?;
    let held = open_beneath(&dir)?;
    let start = held.dir(&dir.rel, false).map_err(|refusal| match refusal {
        Refusal::NotDir { .. } => {
            format!("`path` must be a directory, and `{}` is not one", dir.rel)
        }
        refusal => refusal.message(&dir.rel),
    })?;

    let pattern = pattern.strip_prefix("./").unwrap_or(pattern);
    if pattern.is_empty() {
        return Err("`pattern` is empty".to_owned());
    }
    if pattern.starts_with('/') {
        return Err(
            "`pattern` must be relative to the search directory (e.g. `**/*.rs`); put the \
             directory in `path`"
                .to_owned(),
        );
    }
    let matcher = Glob::new(
        pattern,
        GlobOptions {
            literal_separator: true,
        },
    )
    .map_err(|err| format!("invalid glob pattern `{pattern}`: {err}"))?;

    let mut hits: Vec<(SystemTime, String)> = Vec::new();
    let walked = walk(
        &held,
        start,
        WALK_MAX_ENTRIES,
        SymlinkedFiles::Include,
        |entry| {
            if matcher.is_match(entry.rel) {
                let modified = entry.meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
                hits.push((modified, join_rel(&dir.rel, entry.rel)));
            }
            ControlFlow::Continue(())
        },
    );
    hits.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));

    let mut out = String::new();
    if hits.is_empty() {
        let _ = writeln!(out, "no files matched `{pattern}` in {}", dir.rel);
    }
    for (_, path) in hits.iter().take(GLOB_MAX_RESULTS) {
        out.push_str(path);
        out.push('\n');
    }
    if hits.len() > GLOB_MAX_RESULTS {
        let _ = writeln!(out, "(truncated: {} more)", hits.len() - GLOB_MAX_RESULTS);
    }
    walked.write_notes(&mut out);
    Ok(out.trim_end_matches('\n').to_owned())
}

// ---------------------------------------------------------------------------------------------
// Grep

/// `Grep` as offered to the model.
pub(crate) fn grep_spec() -> ToolSpec {
    ToolSpec {
        name: Cow::Borrowed("Grep"),
        description: Cow::Borrowed(
            "Search file contents with a regular expression (Rust regex syntax without \
            `\\p{…}` Unicode property classes, matched one line at a time). Returns \
            `path:line: text` for each matching line, with workspace-relative paths and \
            lines cut at 500 characters, up to `max_matches` (default 100) and 64 KiB. Skips \
            `.git`, binary files and files over 5 MB, and does not follow symlinks while \
            walking directories.",
        ),
        input_schema: closed_object(
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

/// Runs one `Grep` call. Blocking; call it from a worker thread, not the reactor.
pub(crate) fn run_grep(input: &Value, workspace: &Path) -> ToolOutput {
    finish("Grep", grep(input, workspace))
}

/// A `Grep` call's title: the quoted pattern, where it searches, and which files.
pub(crate) fn grep_title(input: &Value) -> String {
    let mut title = format!("Grep {:?}", text_field(input, "pattern"));
    let path = text_field(input, "path");
    if !path.is_empty() {
        title.push_str(&format!(" in {path}"));
    }
    let include = text_field(input, "include");
    if !include.is_empty() {
        title.push_str(&format!(" ({include})"));
    }
    cap_title(&title)
}

fn grep(input: &Value, workspace: &Path) -> ToolResult {
    let obj = object(input)?;
    let pattern = required_str(obj, "pattern")?;
    let raw_path = optional_str(obj, "path")?.unwrap_or(".");
    let include =
        optional_str(obj, "include")?.map(|include| include.strip_prefix("./").unwrap_or(include));
    let max_matches =
        optional_int(obj, "max_matches", 1, GREP_MAX_MATCHES)?.unwrap_or(GREP_DEFAULT_MATCHES);
    let regex = RegexBuilder::new(pattern)
        .size_limit(GREP_REGEX_SIZE_LIMIT)
        .dfa_size_limit(GREP_REGEX_SIZE_LIMIT)
        .build()
        .map_err(|err| format!("invalid regex `{pattern}`: {err}"))?;
    let include_glob = match include {
        Some(include) => Some(
            Glob::new(
                include,
                GlobOptions {
                    literal_separator: true,
                },
            )
            .map_err(|err| format!("invalid `include` glob `{include}`: {err}"))?,
        ),
        None => None,
    };
    // `*.rs` filters on the file name; `src/**/*.rs` on the path below the search directory.
    let include_on_path = include.is_some_and(|include| include.contains('/'));

    let target = resolve(workspace, raw_path)?;
    let held = open_beneath(&target)?;
    let (opened, start, _) =
        open_file(&held, &target).map_err(|refusal| refusal.message(&target.rel))?;
    let meta = opened.1.clone();
    let mut sink = GrepSink {
        regex: &regex,
        max_matches: usize::try_from(max_matches).unwrap_or(usize::MAX),
        budget: MAX_OUTPUT_BYTES.saturating_sub(1024),
        out: String::new(),
        n_matches: 0,
        stop: None,
    };
    let mut skipped_binary = 0;
    let mut skipped_large = 0;
    let mut unreadable = 0;
    let mut walked = None;

    if meta.is_file() {
        // A file named explicitly gets a clear error rather than a silent skip.
        let rel = &target.rel;
        let (text, _) = text_of(
            rel,
            load_from(rel, opened, MAX_FILE_BYTES, too_big_text(rel))?,
        )?;
        let _ = sink.search(rel, &text);
    } else if meta.is_dir() {
        drop(opened);
        let start = if target.rel == "." {
            start
        } else {
            held.dir(&target.rel, false)
                .map_err(|refusal| refusal.message(&target.rel))?
        };
        walked = Some(walk(
            &held,
            start,
            WALK_MAX_ENTRIES,
            SymlinkedFiles::Skip,
            |entry| {
                if let Some(include_glob) = &include_glob {
                    let subject = if include_on_path {
                        entry.rel
                    } else {
                        entry.rel.rsplit('/').next().unwrap_or(entry.rel)
                    };
                    if !include_glob.is_match(subject) {
                        return ControlFlow::Continue(());
                    }
                }
                if entry.meta.len() > MAX_FILE_BYTES {
                    skipped_large += 1;
                    return ControlFlow::Continue(());
                }
                let bytes = held
                    .open_read(entry.dir, entry.name)
                    .ok()
                    .and_then(|opened| {
                        load_from(entry.rel, opened, MAX_FILE_BYTES, |_| String::new()).ok()
                    });
                let Some(bytes) = bytes else {
                    unreadable += 1;
                    return ControlFlow::Continue(());
                };
                if looks_binary(&bytes) {
                    skipped_binary += 1;
                    return ControlFlow::Continue(());
                }
                let text = String::from_utf8_lossy(&bytes);
                sink.search(&join_rel(&target.rel, entry.rel), &text)
            },
        ));
    } else {
        return Err(format!(
            "`{}` is neither a file nor a directory",
            target.rel
        ));
    }

    let mut out = sink.out;
    if sink.n_matches == 0 {
        let _ = writeln!(out, "no matches for `{pattern}` in {}", target.rel);
    }
    match sink.stop {
        Some(GrepStop::MaxMatches) => {
            let _ = writeln!(
                out,
                "(truncated at {max_matches} matches; narrow the pattern, `path` or \
                 `include`, or raise `max_matches` up to {GREP_MAX_MATCHES})"
            );
        }
        Some(GrepStop::OutputCap) => {
            let _ = writeln!(
                out,
                "(truncated at {} matches: output reached 64 KiB; narrow the search)",
                sink.n_matches
            );
        }
        None => {}
    }
    if skipped_binary + skipped_large + unreadable > 0 {
        let _ = writeln!(
            out,
            "(skipped {skipped_binary} binary, {skipped_large} over 5 MB and {unreadable} \
             unreadable files)"
        );
    }
    if let Some(walked) = walked {
        walked.write_notes(&mut out);
    }
    Ok(out.trim_end_matches('\n').to_owned())
}

enum GrepStop {
    MaxMatches,
    OutputCap,
}

struct GrepSink<'a> {
    regex: &'a Regex,
    max_matches: usize,
    budget: usize,
    out: String,
    n_matches: usize,
    stop: Option<GrepStop>,
}

impl GrepSink<'_> {
    /// Appends `rel:line: text` for each matching line; breaks once the search should stop.
    fn search(&mut self, rel: &str, text: &str) -> ControlFlow<()> {
        for (idx, line) in text.lines().enumerate() {
            if !self.regex.is_match(line) {
                continue;
            }
            if self.n_matches >= self.max_matches {
                self.stop = Some(GrepStop::MaxMatches);
                return ControlFlow::Break(());
            }
            let entry = format!(
                "{rel}:{}: {}\n",
                idx + 1,
                cap_line(line, GREP_MAX_LINE_CHARS)
            );
            if self.out.len() + entry.len() > self.budget {
                self.stop = Some(GrepStop::OutputCap);
                return ControlFlow::Break(());
            }
            self.out.push_str(&entry);
            self.n_matches += 1;
        }
        ControlFlow::Continue(())
    }
}

// ---------------------------------------------------------------------------------------------
// Directory walks

/// Whether a walk reports symlinks that point at regular files. Symlinked directories are
/// never followed, so a walk cannot loop or leave the tree through them.
#[derive(Clone, Copy, PartialEq, Eq)]
enum SymlinkedFiles {
    Include,
    Skip,
}

struct WalkEntry<'a> {
    /// The directory handle the entry was found in, to open it beneath.
    dir: &'a beneath::Dir,
    name: &'a std::ffi::OsStr,
    /// Relative to the walk root, `/`-separated.
    rel: &'a str,
    meta: &'a Metadata,
}

#[derive(Debug, Default)]
struct WalkNotes {
    stopped_at: Option<usize>,
    unreadable_dirs: usize,
}

impl WalkNotes {
    fn write_notes(&self, out: &mut String) {
        if let Some(max) = self.stopped_at {
            let _ = writeln!(
                out,
                "(walk stopped after visiting {max} entries; results are incomplete, narrow \
                 `path`)"
            );
        }
        if self.unreadable_dirs > 0 {
            let _ = writeln!(
                out,
                "({} directories could not be read)",
                self.unreadable_dirs
            );
        }
    }
}

/// Visits every regular file below `root` (files of a directory first, then its
/// subdirectories, each in name order), skipping `.git`. Iterative, so depth costs heap not
/// stack, and it stops after `max_entries` directory entries. Each directory is read and
/// entered through the handle of the one above (`Beneath`), so a directory swapped for a
/// symlink mid-walk is not followed, and nothing on the sandbox's deny list is entered or
/// read whatever it is named.
fn walk(
    held: &Beneath,
    root: beneath::Dir,
    max_entries: usize,
    symlinked_files: SymlinkedFiles,
    mut visit: impl FnMut(&WalkEntry<'_>) -> ControlFlow<()>,
) -> WalkNotes {
    let mut notes = WalkNotes::default();
    let mut n_visited = 0;
    let mut stack: Vec<(beneath::Dir, String)> = vec![(root, String::new())];
    while let Some((dir, dir_rel)) = stack.pop() {
        let Ok((mut entries, more)) = held.entries(&dir, max_entries - n_visited.min(max_entries))
        else {
            notes.unreadable_dirs += 1;
            continue;
        };
        n_visited += entries.len();
        if more {
            n_visited += 1;
            notes.stopped_at = Some(max_entries);
        }
        entries.sort_by(|a, b| a.name.cmp(&b.name));

        let mut subdirs = Vec::new();
        for entry in entries {
            let name = entry.name.to_string_lossy();
            if name == ".git" {
                continue;
            }
            let rel = if dir_rel.is_empty() {
                name.into_owned()
            } else {
                format!("{dir_rel}/{name}")
            };
            let Ok(meta) = held.entry_meta(&dir, &entry.name) else {
                continue;
            };
            if held.is_denied(&meta) {
                continue;
            }
            let meta = if meta.is_dir() {
                if let Ok(sub) = held.child_dir(&dir, &entry.name, false) {
                    subdirs.push((sub, rel));
                }
                continue;
            } else if meta.file_type().is_symlink() {
                // Only `Glob` reports a symlink to a file, by its own name; what it points at
                // is looked at for its type and time, never opened.
                if symlinked_files == SymlinkedFiles::Skip {
                    continue;
                }
                match fs::metadata(held.path_of(&dir.child_rel(&entry.name))) {
                    Ok(meta) if !held.is_denied(&meta) => meta,
                    _ => continue,
                }
            } else {
                meta
            };
            if !meta.is_file() {
                continue;
            }
            let walk_entry = WalkEntry {
                dir: &dir,
                name: &entry.name,
                rel: &rel,
                meta: &meta,
            };
            if visit(&walk_entry).is_break() {
                return notes;
            }
        }
        if notes.stopped_at.is_some() {
            return notes;
        }
        stack.extend(subdirs.into_iter().rev());
    }
    notes
}

// ---------------------------------------------------------------------------------------------
// Delegation: the same tools over a file a host reads and writes elsewhere (an editor, whose
// buffers may hold unsaved changes). The host fetches and stores the text; these functions
// make the same checks and give the same results as the local tools.

/// A file a tool call names, rooted in the workspace exactly as the local tools root it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolPath {
    pub abs: PathBuf,
    /// Workspace-relative, as results name it.
    pub rel: String,
}

/// A file-tool call, checked, ready for a host to carry out: what to fetch and store, and
/// what the result is.
#[derive(Clone, Debug)]
pub enum Delegated {
    /// Fetch the file's text; `read_delegated` gives the lines asked for.
    Read {
        path: ToolPath,
        offset: u64,
        limit: u64,
    },
    /// Store `content` as the file's whole text; `done` is the result once stored.
    Write {
        path: ToolPath,
        content: String,
        done: ToolOutput,
    },
    /// Fetch the file's text, then store what `apply` makes of it.
    Edit {
        path: ToolPath,
        input: Value,
        apply: ApplyEdit,
    },
}

/// A tool's change to the text a host fetched: the new text to store and the result for the
/// model once stored, or the error result.
pub type ApplyEdit = fn(&ToolPath, &Value, &str) -> Result<(String, ToolOutput), ToolOutput>;

/// Checks a `Read` call the way the local tool does, without reading the file. The error is
/// the tool result the local tool would give.
pub(crate) fn delegate_read(input: &Value, workspace: &Path) -> Result<Delegated, ToolOutput> {
    let (target, offset, limit) = read_args(input, workspace).map_err(refusal("Read"))?;
    Ok(Delegated::Read {
        path: tool_path(target),
        offset,
        limit,
    })
}

/// Checks a `Write` call the way the local tool does, without writing the file.
pub(crate) fn delegate_write(input: &Value, workspace: &Path) -> Result<Delegated, ToolOutput> {
    let (target, content) = write_args(input, workspace).map_err(refusal("Write"))?;
    let existed = write_target(&target).map_err(refusal("Write"))?.is_some();
    let path = tool_path(target);
    let done = ToolOutput::ok(cap_output(write_summary(&path.rel, content, existed)));
    Ok(Delegated::Write {
        path,
        content: content.to_owned(),
        done,
    })
}

/// Checks an `Edit` call the way the local tool does, without reading the file.
pub(crate) fn delegate_edit(input: &Value, workspace: &Path) -> Result<Delegated, ToolOutput> {
    let (target, _) = edit_args(input, workspace).map_err(refusal("Edit"))?;
    edit_target(&target).map_err(refusal("Edit"))?;
    Ok(Delegated::Edit {
        path: tool_path(target),
        input: input.clone(),
        apply: edit_delegated,
    })
}

/// Checks a `MultiEdit` call the way the local tool does, without reading the file.
pub(crate) fn delegate_multi_edit(
    input: &Value,
    workspace: &Path,
) -> Result<Delegated, ToolOutput> {
    let (target, _) = multi_edit_args(input, workspace).map_err(refusal("MultiEdit"))?;
    edit_target(&target).map_err(refusal("MultiEdit"))?;
    Ok(Delegated::Edit {
        path: tool_path(target),
        input: input.clone(),
        apply: multi_edit_delegated,
    })
}

/// `MultiEdit` over the text a host fetched (`ApplyEdit`).
fn multi_edit_delegated(
    path: &ToolPath,
    input: &Value,
    text: &str,
) -> Result<(String, ToolOutput), ToolOutput> {
    let fail = refusal("MultiEdit");
    let edits = object(input).and_then(edits_arg).map_err(fail)?;
    let text = delegated_text(&path.rel, text).map_err(fail)?;
    let (new_text, summary) = multi_edit_text(&path.rel, text, &edits).map_err(fail)?;
    Ok((new_text, ToolOutput::ok(cap_output(summary))))
}

fn tool_path(target: Resolved) -> ToolPath {
    ToolPath {
        abs: target.abs,
        rel: target.rel,
    }
}

/// The text a host fetched for a delegated file, held to the local tools' limits.
fn delegated_text<'a>(rel: &str, text: &'a str) -> Result<&'a str, String> {
    if text.len() as u64 > MAX_FILE_BYTES {
        return Err(format!(
            "`{rel}` is {} bytes, over the 5 MB limit; search it with Grep instead",
            text.len()
        ));
    }
    if looks_binary(text.as_bytes()) {
        return Err(format!(
            "`{rel}` looks binary (a NUL byte in its first 8 KiB); not shown"
        ));
    }
    Ok(text)
}

/// `Read`'s result for the text a host fetched.
pub fn read_delegated(path: &ToolPath, offset: u64, limit: u64, text: &str) -> ToolOutput {
    let result = delegated_text(&path.rel, text)
        .and_then(|text| render_read(&path.rel, text, false, offset, limit));
    finish("Read", result)
}

/// `Edit` over the text a host fetched (`ApplyEdit`).
fn edit_delegated(
    path: &ToolPath,
    input: &Value,
    text: &str,
) -> Result<(String, ToolOutput), ToolOutput> {
    let fail = refusal("Edit");
    let obj = object(input).map_err(fail)?;
    let args = EditArgs {
        old: required_str(obj, "old_string").map_err(fail)?,
        new: required_str(obj, "new_string").map_err(fail)?,
        replace_all: optional_bool(obj, "replace_all")
            .map_err(fail)?
            .unwrap_or(false),
    };
    let text = delegated_text(&path.rel, text).map_err(fail)?;
    let (new_text, summary) = edit_text(&path.rel, text, &args).map_err(fail)?;
    Ok((new_text, ToolOutput::ok(cap_output(summary))))
}

/// Roots a path a tool call names (a display location, a diff) as the tools would.
pub fn resolve_path(workspace: &Path, raw: &str) -> Result<ToolPath, String> {
    resolve(workspace, raw).map(tool_path)
}

fn finish(name: &str, result: ToolResult) -> ToolOutput {
    result.map_or_else(refusal(name), |text| ToolOutput::ok(cap_output(text)))
}

/// A tool's failure as the model's error result: the tool's name, then what went wrong.
fn refusal(name: &str) -> impl Fn(String) -> ToolOutput + Copy {
    move |err| ToolOutput::error(cap_output(format!("{name}: {err}")))
}

// ---------------------------------------------------------------------------------------------
// Workspace rooting

/// A path the model named, resolved inside the workspace.
#[derive(Debug)]
struct Resolved {
    /// The workspace as the run names it.
    workspace: PathBuf,
    /// The canonical workspace.
    root: PathBuf,
    /// Absolute, with every existing component canonicalised.
    abs: PathBuf,
    /// Relative to the canonical workspace, `/`-separated; `.` for the workspace itself.
    rel: String,
    /// Relative to the workspace as named, before any symlink was followed; `/`-separated.
    named: String,
}

/// Roots `raw` in the workspace. `..` is resolved lexically and may not climb above the
/// workspace; then the longest existing ancestor is canonicalised, so a symlink anywhere on
/// the way that leads outside is refused too.
fn resolve(workspace: &Path, raw: &str) -> Result<Resolved, String> {
    let root = workspace.canonicalize().map_err(|err| {
        format!(
            "the workspace {} is not accessible: {err}",
            workspace.display()
        )
    })?;
    if raw.is_empty() {
        return Err("`path` is empty".to_owned());
    }
    let raw_path = Path::new(raw);
    let inside = if raw_path.is_absolute() {
        let absolute = normalize_lexically(raw_path).unwrap_or_default();
        // Accept the workspace as the caller spelled it too (it may sit behind a symlink,
        // as /tmp does on macOS).
        let spelled = std::path::absolute(workspace)
            .ok()
            .and_then(|path| normalize_lexically(&path));
        let stripped = absolute.strip_prefix(&root).ok().or_else(|| {
            spelled
                .as_deref()
                .and_then(|spelled| absolute.strip_prefix(spelled).ok())
        });
        match stripped {
            Some(rest) => rest.to_path_buf(),
            None => {
                return Err(format!(
                    "`{raw}` is outside the workspace ({}); use a path inside it",
                    root.display()
                ));
            }
        }
    } else {
        normalize_lexically(raw_path)
            .ok_or_else(|| format!("`{raw}` escapes the workspace through `..`"))?
    };

    let full = root.join(&inside);
    let mut existing = full.as_path();
    let mut missing_tail = Vec::new();
    let canonical = loop {
        match existing.canonicalize() {
            Ok(canonical) => break canonical,
            Err(err) => {
                // A dangling symlink has metadata of its own but no target; writing through
                // it could create a file anywhere, so refuse it.
                if existing.symlink_metadata().is_ok() {
                    return Err(if err.kind() == io::ErrorKind::NotFound {
                        format!("`{raw}` goes through a symlink whose target does not exist")
                    } else {
                        format!("cannot resolve `{raw}`: {err}")
                    });
                }
                let (Some(name), Some(parent)) = (existing.file_name(), existing.parent()) else {
                    return Err(format!("cannot resolve `{raw}`: {err}"));
                };
                missing_tail.push(name);
                existing = parent;
            }
        }
    };
    if !canonical.starts_with(&root) {
        return Err(format!(
            "`{raw}` resolves outside the workspace through a symlink"
        ));
    }
    let abs = missing_tail
        .iter()
        .rev()
        .fold(canonical, |path, name| path.join(name));
    let rel = match abs.strip_prefix(&root) {
        Ok(rest) if rest.as_os_str().is_empty() => ".".to_owned(),
        Ok(rest) => rest.to_string_lossy().into_owned(),
        Err(_) => return Err(format!("`{raw}` is outside the workspace")),
    };
    let named = inside
        .components()
        .map(|part| part.as_os_str().to_string_lossy())
        .collect::<Vec<_>>()
        .join("/");
    Ok(Resolved {
        workspace: workspace.to_path_buf(),
        root,
        abs,
        rel,
        named,
    })
}

/// `resolve` for a tool that changes the file. The permission policy judged the path as
/// named (it cannot follow symlinks); a symlink that leads from an ordinary name to a
/// protected file (`hooks -> .git/hooks`) would edit that file under an approval given for
/// another, so such an edit is refused and the model told to name the file itself, which
/// then asks (`policy::protected_path`).
fn resolve_for_edit(workspace: &Path, raw: &str) -> Result<Resolved, String> {
    let target = resolve(workspace, raw)?;
    if let Some(entry) = crate::policy::protected_path(&target.rel)
        && !target.named.eq_ignore_ascii_case(&target.rel)
    {
        return Err(format!(
            "`{raw}` leads through a symlink to `{}`, which is protected ({}); name `{}` \
             itself so that the edit is approved for what it is",
            target.rel, entry.why, target.rel
        ));
    }
    Ok(target)
}

/// Drops `.` and folds `..` into its parent. `None` if a relative path climbs above its
/// start; an absolute path's `..` at the root stays at the root, as the kernel does.
fn normalize_lexically(path: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    let mut depth = 0usize;
    for component in path.components() {
        match component {
            Component::Prefix(_) | Component::RootDir => out.push(component.as_os_str()),
            Component::CurDir => {}
            Component::ParentDir => {
                if depth > 0 {
                    out.pop();
                    depth -= 1;
                } else if !path.is_absolute() {
                    return None;
                }
            }
            Component::Normal(name) => {
                out.push(name);
                depth += 1;
            }
        }
    }
    Some(out)
}

fn join_rel(base: &str, rel: &str) -> String {
    if base == "." {
        rel.to_owned()
    } else {
        format!("{base}/{rel}")
    }
}

// ---------------------------------------------------------------------------------------------
// Loading text

/// Reads a regular file of at most `MAX_FILE_BYTES` that does not look binary. The flag is
/// true when invalid UTF-8 had to be replaced.
fn load_text(target: &Resolved) -> Result<(String, bool), String> {
    let rel = &target.rel;
    text_of(rel, load_bytes(target, MAX_FILE_BYTES, too_big_text(rel))?)
}

fn too_big_text(rel: &str) -> impl Fn(u64) -> String + '_ {
    move |n_bytes| {
        format!("`{rel}` is {n_bytes} bytes, over the 5 MB limit; search it with Grep instead")
    }
}

/// A file's bytes as text, unless they look binary; the flag says invalid UTF-8 was
/// replaced.
fn text_of(rel: &str, bytes: Vec<u8>) -> Result<(String, bool), String> {
    if looks_binary(&bytes) {
        return Err(format!(
            "`{rel}` looks binary (a NUL byte in its first 8 KiB); not shown"
        ));
    }
    match String::from_utf8(bytes) {
        Ok(text) => Ok((text, false)),
        Err(err) => Ok((String::from_utf8_lossy(err.as_bytes()).into_owned(), true)),
    }
}

/// The bytes of a regular file of at most `max` bytes; `too_big` says why a larger one is
/// refused.
fn load_bytes(
    target: &Resolved,
    max: u64,
    too_big: impl Fn(u64) -> String,
) -> Result<Vec<u8>, String> {
    let rel = &target.rel;
    let held = open_beneath(target)?;
    let (file, _, _) = open_file(&held, target).map_err(|refusal| refusal.message(rel))?;
    load_from(rel, file, max, too_big)
}

/// The bytes of a file opened beneath the workspace, if it is a regular file of at most
/// `max` bytes.
fn load_from(
    rel: &str,
    (file, meta): (File, Metadata),
    max: u64,
    too_big: impl Fn(u64) -> String,
) -> Result<Vec<u8>, String> {
    if meta.is_dir() {
        return Err(format!(
            "`{rel}` is a directory; list it with Glob (e.g. pattern `*` with path `{rel}`)"
        ));
    }
    // Only regular files: reading a FIFO or a device could block this thread forever (it
    // was opened O_NONBLOCK, so the open itself did not).
    if !meta.is_file() {
        return Err(format!("`{rel}` is not a regular file"));
    }
    if meta.len() > max {
        return Err(too_big(meta.len()));
    }
    let mut bytes = Vec::new();
    file.take(max + 1)
        .read_to_end(&mut bytes)
        .map_err(|err| io_message(rel, &err))?;
    if bytes.len() as u64 > max {
        return Err(too_big(bytes.len() as u64));
    }
    Ok(bytes)
}

/// The held workspace for one call on `target`, fenced by the sandbox's deny list.
fn open_beneath(target: &Resolved) -> Result<Beneath, String> {
    Beneath::open_as(
        &target.workspace,
        &target.root,
        &crate::sandbox::config().deny,
    )
}

/// Opens `target` for reading through `held`: the file, its metadata and the directory
/// handle it was opened in. The workspace itself opens as a directory.
fn open_file<'a>(
    held: &Beneath,
    target: &'a Resolved,
) -> Result<((File, Metadata), beneath::Dir, &'a std::ffi::OsStr), Refusal> {
    let Some((parent_rel, name)) = beneath::split(&target.rel) else {
        let root = held.dir(".", false)?;
        let file = File::from(
            sys::open_dot(root.fd.as_raw_fd()).map_err(|err| Refusal::Io {
                at: ".".to_owned(),
                err,
            })?,
        );
        let meta = file.metadata().map_err(|err| Refusal::Io {
            at: ".".to_owned(),
            err,
        })?;
        return Ok(((file, meta), root, std::ffi::OsStr::new(".")));
    };
    let parent = held.dir(parent_rel, false)?;
    let file = held.open_read(&parent, name)?;
    Ok((file, parent, name))
}

fn looks_binary(bytes: &[u8]) -> bool {
    bytes[..bytes.len().min(BINARY_SNIFF_BYTES)].contains(&0)
}

fn io_message(rel: &str, err: &io::Error) -> String {
    match err.kind() {
        io::ErrorKind::NotFound => format!("`{rel}` does not exist"),
        io::ErrorKind::PermissionDenied => format!("permission denied for `{rel}`"),
        _ => format!("cannot access `{rel}`: {err}"),
    }
}

// ---------------------------------------------------------------------------------------------
// Caps

/// `line` cut to `max_chars` characters, with a marker saying how many were dropped.
fn cap_line(line: &str, max_chars: usize) -> Cow<'_, str> {
    match crate::text::cut_chars(line, max_chars) {
        None => Cow::Borrowed(line),
        Some((kept, dropped)) => {
            let n_more = dropped.chars().count();
            Cow::Owned(format!("{kept}… [{n_more} more chars]"))
        }
    }
}

/// The last line of defence: no result longer than `MAX_OUTPUT_BYTES`, marker included.
pub(crate) fn cap_output(mut text: String) -> String {
    if text.len() <= MAX_OUTPUT_BYTES {
        return text;
    }
    let cut = text.floor_char_boundary(MAX_OUTPUT_BYTES - 100);
    let n_cut = text.len() - cut;
    text.truncate(cut);
    let _ = write!(text, "\n… [output truncated: {n_cut} bytes cut]");
    text
}

// ---------------------------------------------------------------------------------------------
// Input fields

fn object(input: &Value) -> Result<&Map<String, Value>, String> {
    input.as_object().ok_or_else(|| {
        format!(
            "input must be a JSON object, got {}",
            crate::text::json_kind(input)
        )
    })
}

/// Absent and `null` both count as missing: models send `null` for fields they mean to omit.
fn required_str<'a>(obj: &'a Map<String, Value>, key: &str) -> Result<&'a str, String> {
    match obj.get(key) {
        Some(Value::String(text)) => Ok(text),
        None | Some(Value::Null) => {
            let mut msg = format!("missing required string field `{key}`");
            if key == "path" && obj.contains_key("file_path") {
                msg.push_str(" (this tool calls it `path`, not `file_path`)");
            }
            Err(msg)
        }
        Some(other) => Err(format!(
            "field `{key}` must be a string, got {}",
            crate::text::json_kind(other)
        )),
    }
}

fn optional_str<'a>(obj: &'a Map<String, Value>, key: &str) -> Result<Option<&'a str>, String> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(text)) => Ok(Some(text)),
        Some(other) => Err(format!(
            "field `{key}` must be a string, got {}",
            crate::text::json_kind(other)
        )),
    }
}

fn optional_bool(obj: &Map<String, Value>, key: &str) -> Result<Option<bool>, String> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(flag)) => Ok(Some(*flag)),
        Some(other) => Err(format!(
            "field `{key}` must be a boolean, got {}",
            crate::text::json_kind(other)
        )),
    }
}

/// An integer in `min..=max`. Integral floats such as `10.0` are accepted, since some models
/// emit every number that way.
fn optional_int(
    obj: &Map<String, Value>,
    key: &str,
    min: u64,
    max: u64,
) -> Result<Option<u64>, String> {
    let range = if max == u64::MAX {
        format!("an integer ≥ {min}")
    } else {
        format!("an integer from {min} to {max}")
    };
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(number)) => {
            let value = number.as_u64().or_else(|| {
                number
                    .as_f64()
                    .filter(|f| f.fract() == 0.0 && *f >= 0.0 && *f < 1.8e19)
                    .map(|f| f as u64)
            });
            match value {
                Some(value) if (min..=max).contains(&value) => Ok(Some(value)),
                _ => Err(format!("field `{key}` must be {range}, got {number}")),
            }
        }
        Some(other) => Err(format!(
            "field `{key}` must be {range}, got {}",
            crate::text::json_kind(other)
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// A fresh directory under the system temp dir, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new() -> TempDir {
            static COUNTER: AtomicU64 = AtomicU64::new(0);
            let nanos = SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map(|elapsed| elapsed.as_nanos())
                .unwrap_or_default();
            let dir = std::env::temp_dir().join(format!(
                "caliban-fs-test-{}-{nanos}-{}",
                std::process::id(),
                COUNTER.fetch_add(1, Ordering::Relaxed)
            ));
            fs::create_dir_all(&dir).expect("create the test temp dir");
            TempDir(dir)
        }

        fn path(&self) -> &Path {
            &self.0
        }

        fn put(&self, rel: &str, content: impl AsRef<[u8]>) -> PathBuf {
            let path = self.0.join(rel);
            if let Some(parent) = path.parent() {
                fs::create_dir_all(parent).expect("create parent dirs");
            }
            fs::write(&path, content).expect("write test file");
            path
        }

        fn get(&self, rel: &str) -> String {
            fs::read_to_string(self.0.join(rel)).expect("read test file")
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    /// Runs a file tool by its name. That its table row names the same function is
    /// `table`'s to test (`file_rows_name_their_own_workers`): reading the table from here
    /// would make `fs` and `table` use each other.
    fn run(name: &str, input: &Value, workspace: &Path) -> ToolOutput {
        let work = match name {
            "Read" => run_read,
            "Write" => run_write,
            "Edit" => run_edit,
            "MultiEdit" => run_multi_edit,
            "Glob" => run_glob,
            "Grep" => run_grep,
            _ => panic!("`{name}` is not a file tool"),
        };
        work(input, workspace)
    }

    fn ok(name: &str, input: Value, ws: &TempDir) -> String {
        let out = run(name, &input, ws.path());
        assert!(!out.is_error, "{name} {input} failed: {}", out.text);
        out.text
    }

    fn err(name: &str, input: Value, ws: &TempDir) -> String {
        let out = run(name, &input, ws.path());
        assert!(
            out.is_error,
            "{name} {input} should fail, got: {}",
            out.text
        );
        out.text
    }

    fn set_mtime(path: &Path, secs: u64) {
        let file = File::options()
            .write(true)
            .open(path)
            .expect("open for mtime");
        let time = SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(secs);
        file.set_modified(time).expect("set mtime");
    }

    // --- input validation (which tools run here is `tools::table`'s to say and test)

    #[test]
    fn missing_and_mistyped_fields_are_named() {
        let ws = TempDir::new();
        assert_eq!(
            err("Read", json!({}), &ws),
            "Read: missing required string field `path`"
        );
        assert_eq!(
            err("Read", json!({"file_path": "a"}), &ws),
            "Read: missing required string field `path` (this tool calls it `path`, not \
             `file_path`)"
        );
        assert_eq!(
            err("Read", json!({"path": 7}), &ws),
            "Read: field `path` must be a string, got a number"
        );
        assert_eq!(
            err("Read", json!({"path": "a", "limit": "10"}), &ws),
            "Read: field `limit` must be an integer ≥ 1, got a string"
        );
        assert_eq!(
            err("Read", json!({"path": "a", "offset": 0}), &ws),
            "Read: field `offset` must be an integer ≥ 1, got 0"
        );
        assert_eq!(
            err("Write", json!({"path": "a"}), &ws),
            "Write: missing required string field `content`"
        );
        assert_eq!(
            err(
                "Edit",
                json!({"path": "a", "old_string": "x", "new_string": "y", "replace_all": "yes"}),
                &ws
            ),
            "Edit: field `replace_all` must be a boolean, got a string"
        );
        assert_eq!(
            err("Grep", json!({"pattern": "x", "max_matches": 501}), &ws),
            "Grep: field `max_matches` must be an integer from 1 to 500, got 501"
        );
        assert_eq!(
            err("Glob", json!(["*"]), &ws),
            "Glob: input must be a JSON object, got an array"
        );
        // Integral floats and nulls are tolerated.
        ws.put("a", "one\ntwo\n");
        let text = ok(
            "Read",
            json!({"path": "a", "limit": 1.0, "offset": null}),
            &ws,
        );
        assert!(text.starts_with("→ Read a, lines 1-1 of 2"), "{text}");
    }

    // --- workspace rooting

    #[test]
    fn dot_dot_escapes_are_refused() {
        let ws = TempDir::new();
        ws.put("sub/b.txt", "b\n");
        assert_eq!(
            err("Read", json!({"path": "../etc/passwd"}), &ws),
            "Read: `../etc/passwd` escapes the workspace through `..`"
        );
        assert!(
            err("Write", json!({"path": "sub/../../x", "content": ""}), &ws).contains("escapes")
        );
        // `..` that stays inside is fine.
        let text = ok("Read", json!({"path": "sub/../sub/./b.txt"}), &ws);
        assert!(
            text.starts_with("→ Read sub/b.txt, lines 1-1 of 1"),
            "{text}"
        );
    }

    #[test]
    fn absolute_paths_must_be_inside() {
        let ws = TempDir::new();
        ws.put("a.txt", "hi\n");
        let inside = ws.path().join("a.txt");
        let text = ok("Read", json!({"path": inside.to_str()}), &ws);
        assert!(text.starts_with("→ Read a.txt,"), "{text}");
        let outside = err("Read", json!({"path": "/etc/hostname"}), &ws);
        assert!(
            outside.contains("`/etc/hostname` is outside the workspace"),
            "{outside}"
        );
        let sneaky = format!("{}/../x", ws.path().display());
        assert!(err("Write", json!({"path": sneaky, "content": "x"}), &ws).contains("outside"));
    }

    #[test]
    fn symlinks_out_of_the_workspace_are_refused() {
        let ws = TempDir::new();
        let outside = TempDir::new();
        outside.put("secret.txt", "secret\n");
        std::os::unix::fs::symlink(outside.path(), ws.path().join("out")).expect("symlink");
        std::os::unix::fs::symlink(outside.path().join("secret.txt"), ws.path().join("s.txt"))
            .expect("symlink");
        let msg = err("Read", json!({"path": "out/secret.txt"}), &ws);
        assert!(
            msg.contains("resolves outside the workspace through a symlink"),
            "{msg}"
        );
        assert!(err("Read", json!({"path": "s.txt"}), &ws).contains("outside"));
        // Writing a new file below the symlinked directory must not land outside either.
        assert!(
            err("Write", json!({"path": "out/new.txt", "content": "x"}), &ws).contains("outside")
        );
        assert!(!outside.path().join("new.txt").exists());
        // A dangling symlink could point anywhere once created.
        std::os::unix::fs::symlink("/nonexistent-caliban-target", ws.path().join("dangling"))
            .expect("symlink");
        let msg = err("Write", json!({"path": "dangling", "content": "x"}), &ws);
        assert!(msg.contains("symlink whose target does not exist"), "{msg}");
    }

    #[test]
    fn symlinks_inside_the_workspace_are_followed() {
        let ws = TempDir::new();
        ws.put("real/a.txt", "alpha\n");
        std::os::unix::fs::symlink(ws.path().join("real"), ws.path().join("link"))
            .expect("symlink");
        let text = ok("Read", json!({"path": "link/a.txt"}), &ws);
        assert!(text.starts_with("→ Read real/a.txt,"), "{text}");
    }

    #[test]
    fn symlinks_into_protected_paths_are_not_edited_under_another_name() {
        let ws = TempDir::new();
        ws.put(".git/config", "[core]\n");
        ws.put(".git/hooks/README", "hooks\n");
        ws.put("notes.txt", "a note\n");
        let link = |target: &str, name: &str| {
            std::os::unix::fs::symlink(ws.path().join(target), ws.path().join(name))
                .expect("symlink");
        };
        link(".git/config", "cfg");
        link(".git/hooks", "hooks");
        link(".git", "g");
        link("notes.txt", "note-link");
        for (tool, input) in [
            (
                "Write",
                json!({"path": "cfg", "content": "[core]\n\tfsmonitor = evil\n"}),
            ),
            (
                "Edit",
                json!({"path": "cfg", "old_string": "[core]", "new_string": "[x]"}),
            ),
            (
                "Write",
                json!({"path": "hooks/pre-commit", "content": "#!/bin/sh\n"}),
            ),
            ("Write", json!({"path": "./g/config", "content": "x"})),
        ] {
            let msg = err(tool, input.clone(), &ws);
            assert!(
                msg.contains("leads through a symlink to `.git/") && msg.contains("is protected"),
                "{tool} {input}: {msg}"
            );
            let delegated = match tool {
                "Write" => delegate_write(&input, ws.path()).err(),
                _ => delegate_edit(&input, ws.path()).err(),
            };
            assert!(
                delegated.is_some_and(|out| out.text == msg),
                "{tool} {input}"
            );
        }
        assert_eq!(ws.get(".git/config"), "[core]\n");
        assert!(!ws.path().join(".git/hooks/pre-commit").exists());
        // Named as itself, the file is the policy's to judge (it asks); here it is written.
        ok(
            "Edit",
            json!({"path": ".git/config", "old_string": "[core]", "new_string": "[x]"}),
            &ws,
        );
        assert_eq!(ws.get(".git/config"), "[x]\n");
        // A symlink to an ordinary file is followed as before.
        ok(
            "Write",
            json!({"path": "note-link", "content": "new\n"}),
            &ws,
        );
        assert_eq!(ws.get("notes.txt"), "new\n");
    }

    // --- Read

    #[test]
    fn read_numbers_lines_under_a_header() {
        let ws = TempDir::new();
        ws.put("src/main.rs", "fn main() {\r\n    println!();\n}\n");
        assert_eq!(
            ok("Read", json!({"path": "src/main.rs"}), &ws),
            "→ Read src/main.rs, lines 1-3 of 3\n    1  fn main() {\n    2      println!();\n    3  }"
        );
    }

    #[test]
    fn read_windows_with_offset_and_limit() {
        let ws = TempDir::new();
        let content: String = (1..=10).map(|n| format!("line {n}\n")).collect();
        ws.put("ten.txt", content);
        assert_eq!(
            ok(
                "Read",
                json!({"path": "ten.txt", "offset": 4, "limit": 2}),
                &ws
            ),
            "→ Read ten.txt, lines 4-5 of 10\n    4  line 4\n    5  line 5\n\
             (5 more lines; continue with offset=6)"
        );
        let tail = ok("Read", json!({"path": "ten.txt", "offset": 9}), &ws);
        assert!(tail.ends_with("   10  line 10"), "{tail}");
        assert_eq!(
            err("Read", json!({"path": "ten.txt", "offset": 11}), &ws),
            "Read: `offset` 11 is past the end of `ten.txt` (10 lines)"
        );
    }

    #[test]
    fn read_refuses_what_it_cannot_show() {
        let ws = TempDir::new();
        fs::create_dir_all(ws.path().join("dir")).expect("mkdir");
        assert!(
            err("Read", json!({"path": "dir"}), &ws).contains("is a directory; list it with Glob")
        );
        assert_eq!(
            err("Read", json!({"path": "nope.txt"}), &ws),
            "Read: `nope.txt` does not exist"
        );
        let mut blob = b"PNG\x00\x01".to_vec();
        blob.extend_from_slice(b"rest");
        ws.put("img.bin", blob);
        assert!(err("Read", json!({"path": "img.bin"}), &ws).contains("looks binary"));
        let big = File::create(ws.path().join("big.log")).expect("create");
        big.set_len(MAX_FILE_BYTES + 1).expect("set_len");
        let msg = err("Read", json!({"path": "big.log"}), &ws);
        assert!(msg.contains("over the 5 MB limit"), "{msg}");
    }

    #[test]
    fn read_shows_images_as_pictures() {
        let ws = TempDir::new();
        let png = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR";
        ws.put("shots/a.PNG", png);
        let out = run("Read", &json!({"path": "shots/a.PNG"}), ws.path());
        assert!(!out.is_error, "{}", out.text);
        assert_eq!(
            out.text,
            "→ Read shots/a.PNG: image/png, 16 bytes, shown as an image"
        );
        assert_eq!(
            out.images,
            [ContentBlock::image_of_bytes("image/png", png).unwrap()]
        );
        // The bytes say what it is, whatever the name says.
        ws.put("photo.png", b"\xff\xd8\xff\xe0JFIF");
        let out = run("Read", &json!({"path": "photo.png"}), ws.path());
        assert!(
            matches!(&out.images[0], ContentBlock::Image { media_type, .. } if media_type == "image/jpeg")
        );
        ws.put("anim.gif", b"GIF89a....");
        ws.put("pic.webp", b"RIFF\0\0\0\0WEBPVP8 ");
        for (path, media_type) in [("anim.gif", "image/gif"), ("pic.webp", "image/webp")] {
            let out = run("Read", &json!({"path": path}), ws.path());
            assert!(
                matches!(&out.images[0], ContentBlock::Image { media_type: t, .. } if t == media_type),
                "{path}"
            );
        }
        ws.put("fake.jpg", "just text");
        assert_eq!(
            err("Read", json!({"path": "fake.jpg"}), &ws),
            "Read: `fake.jpg` is named as an image but its bytes are not PNG, JPEG, GIF or WebP; not shown"
        );
        let big = File::create(ws.path().join("big.png")).expect("create");
        big.set_len(MAX_IMAGE_FILE_BYTES + 1).expect("set_len");
        let msg = err("Read", json!({"path": "big.png"}), &ws);
        assert!(
            msg.contains("too large to show the model: at most 2359296 bytes"),
            "{msg}"
        );
        assert!(reads_image(&json!({"path": "a/b.jpeg"})));
        assert!(!reads_image(&json!({"path": "a.d/readme"})));
    }

    #[test]
    fn read_decodes_invalid_utf8_lossily_with_a_note() {
        let ws = TempDir::new();
        ws.put("latin1.txt", b"caf\xe9\n");
        let text = ok("Read", json!({"path": "latin1.txt"}), &ws);
        assert!(text.contains("not valid UTF-8"), "{text}");
        assert!(text.ends_with("    1  caf\u{fffd}"), "{text}");
    }

    #[test]
    fn read_handles_empty_files_and_long_lines() {
        let ws = TempDir::new();
        ws.put("empty", "");
        assert_eq!(
            ok("Read", json!({"path": "empty"}), &ws),
            "→ Read empty, lines 0-0 of 0 (empty file)"
        );
        ws.put("wide", format!("{}\n", "é".repeat(2500)));
        let text = ok("Read", json!({"path": "wide"}), &ws);
        assert!(
            text.ends_with(&format!("{}… [500 more chars]", "é".repeat(2000))),
            "tail"
        );
    }

    #[test]
    fn read_stops_at_the_output_cap_with_a_continuation() {
        let ws = TempDir::new();
        let content: String = (1..=2000)
            .map(|n| format!("{n:04} {}\n", "x".repeat(95)))
            .collect();
        ws.put("wide.txt", content);
        let text = ok("Read", json!({"path": "wide.txt"}), &ws);
        assert!(text.len() <= MAX_OUTPUT_BYTES);
        let header = text.lines().next().unwrap_or_default();
        let last: usize = header
            .trim_start_matches("→ Read wide.txt, lines 1-")
            .split(' ')
            .next()
            .and_then(|n| n.parse().ok())
            .expect("header names the last line");
        assert!((500..2000).contains(&last), "{header}");
        assert!(
            text.ends_with(&format!("continue with offset={})", last + 1)),
            "footer"
        );
        assert!(
            !text.contains("output truncated"),
            "should stop cleanly before the hard cap"
        );
    }

    // --- Write

    #[test]
    fn write_creates_parents_and_then_overwrites() {
        let ws = TempDir::new();
        assert_eq!(
            ok(
                "Write",
                json!({"path": "a/b/c.txt", "content": "one\ntwo\n"}),
                &ws
            ),
            "→ Wrote 8 bytes (2 lines) to a/b/c.txt (created)"
        );
        assert_eq!(ws.get("a/b/c.txt"), "one\ntwo\n");
        assert_eq!(
            ok("Write", json!({"path": "a/b/c.txt", "content": "x"}), &ws),
            "→ Wrote 1 bytes (1 lines) to a/b/c.txt (overwrote the existing file)"
        );
        assert_eq!(ws.get("a/b/c.txt"), "x");
        let leftovers: Vec<_> = fs::read_dir(ws.path().join("a/b"))
            .expect("read_dir")
            .filter_map(Result::ok)
            .filter(|entry| {
                entry
                    .file_name()
                    .to_string_lossy()
                    .contains("caliban-write")
            })
            .collect();
        assert!(leftovers.is_empty(), "temp files left behind");
        assert!(
            err("Write", json!({"path": "a/b", "content": "x"}), &ws).contains("is a directory")
        );
    }

    #[test]
    fn write_keeps_the_permissions_of_the_file_it_replaces() {
        use std::os::unix::fs::PermissionsExt;
        let ws = TempDir::new();
        let path = ws.put("run.sh", "#!/bin/sh\n");
        fs::set_permissions(&path, fs::Permissions::from_mode(0o751)).expect("chmod");
        ok(
            "Write",
            json!({"path": "run.sh", "content": "#!/bin/sh\necho hi\n"}),
            &ws,
        );
        let mode = fs::metadata(&path).expect("stat").permissions().mode();
        assert_eq!(mode & 0o777, 0o751);
    }

    // --- Edit

    #[test]
    fn edit_replaces_a_unique_match_and_shows_a_diff() {
        let ws = TempDir::new();
        ws.put("f.rs", "a\nb\nc\nd\ne\nf\ng\n");
        let text = ok(
            "Edit",
            json!({"path": "f.rs", "old_string": "d\n", "new_string": "D1\nD2\n"}),
            &ws,
        );
        assert_eq!(
            text,
            "→ Edited f.rs: 1 replacement, -1 +2 lines\n@@ -2,5 +2,6 @@\n b\n c\n-d\n+D1\n+D2\n e\n f"
        );
        assert_eq!(ws.get("f.rs"), "a\nb\nc\nD1\nD2\ne\nf\ng\n");
    }

    #[test]
    fn multi_edit_applies_every_edit_in_order_or_none() {
        let ws = TempDir::new();
        ws.put("f.rs", "let a = 1;\nlet b = 2;\nlet c = 3;\n");
        let text = ok(
            "MultiEdit",
            json!({"path": "f.rs", "edits": [
                {"old_string": "a = 1", "new_string": "a = 10"},
                // Sees the first edit's result.
                {"old_string": "a = 10;\nlet b", "new_string": "a = 10;\nlet bb"},
                {"old_string": "let", "new_string": "const", "replace_all": true},
            ]}),
            &ws,
        );
        assert!(
            text.starts_with(
                "→ MultiEdit f.rs: 3 edits applied\n[edit 1] Edited f.rs: 1 replacement"
            ),
            "{text}"
        );
        assert!(
            text.contains("[edit 3] Edited f.rs: 3 replacements"),
            "{text}"
        );
        assert_eq!(
            ws.get("f.rs"),
            "const a = 10;\nconst bb = 2;\nconst c = 3;\n"
        );

        // The second edit misses: the first is not applied either.
        let msg = err(
            "MultiEdit",
            json!({"path": "f.rs", "edits": [
                {"old_string": "a = 10", "new_string": "a = 11"},
                {"old_string": "nowhere", "new_string": "x"},
            ]}),
            &ws,
        );
        assert!(
            msg.starts_with("MultiEdit: edit 2 of 2 failed: `old_string` was not found"),
            "{msg}"
        );
        assert!(msg.contains("no edit was applied"), "{msg}");
        assert_eq!(
            ws.get("f.rs"),
            "const a = 10;\nconst bb = 2;\nconst c = 3;\n"
        );

        for (edits, want) in [
            (json!([]), "`edits` is empty"),
            (
                json!([{"old_string": "", "new_string": "x"}]),
                "edit 1 of 1: `old_string` is empty",
            ),
            (
                json!([{"old_string": "a", "new_string": "b", "nope": 1}, {"old_string": "x"}]),
                "edit 2 of 2: missing required string field `new_string`",
            ),
            (json!("x"), "field `edits` must be an array"),
        ] {
            let msg = err("MultiEdit", json!({"path": "f.rs", "edits": edits}), &ws);
            assert!(msg.contains(want), "{msg}");
        }
        let msg = err(
            "MultiEdit",
            json!({"path": "new.rs", "edits": [{"old_string": "a", "new_string": "b"}]}),
            &ws,
        );
        assert!(msg.contains("does not exist"), "{msg}");
    }

    #[test]
    fn edit_diff_counts_deleted_lines_and_shifts_later_hunks() {
        let ws = TempDir::new();
        ws.put("f.txt", "a\nx\ny\nb\nc\nd\ne\nf\ng\nh\nx\ny\ni\n");
        let text = ok(
            "Edit",
            json!({"path": "f.txt", "old_string": "x\ny\n", "new_string": "", "replace_all": true}),
            &ws,
        );
        assert_eq!(
            text,
            "→ Edited f.txt: 2 replacements, -4 +0 lines\n\
             @@ -1,5 +1,3 @@\n a\n-x\n-y\n b\n c\n\
             @@ -9,5 +7,3 @@\n g\n h\n-x\n-y\n i"
        );
        assert_eq!(ws.get("f.txt"), "a\nb\nc\nd\ne\nf\ng\nh\ni\n");
    }

    #[test]
    fn edit_requires_a_unique_match_unless_replace_all() {
        let ws = TempDir::new();
        ws.put("f.txt", "x = 1;\ny = 1;\nz = 1;\n");
        let msg = err(
            "Edit",
            json!({"path": "f.txt", "old_string": "= 1", "new_string": "= 2"}),
            &ws,
        );
        assert_eq!(
            msg,
            "Edit: `old_string` was found 3 times in `f.txt`; include more surrounding lines to \
             make it unique, or set `replace_all` to true to change every occurrence"
        );
        assert_eq!(
            ws.get("f.txt"),
            "x = 1;\ny = 1;\nz = 1;\n",
            "file untouched on error"
        );
        let text = ok(
            "Edit",
            json!({"path": "f.txt", "old_string": "= 1", "new_string": "= 2", "replace_all": true}),
            &ws,
        );
        assert!(
            text.starts_with("→ Edited f.txt: 3 replacements, -3 +3 lines\n"),
            "{text}"
        );
        assert_eq!(ws.get("f.txt"), "x = 2;\ny = 2;\nz = 2;\n");
    }

    #[test]
    fn edit_replace_all_on_one_line_shows_that_line_once() {
        let ws = TempDir::new();
        ws.put("f.txt", "aa aa\n");
        let text = ok(
            "Edit",
            json!({"path": "f.txt", "old_string": "aa", "new_string": "b", "replace_all": true}),
            &ws,
        );
        assert_eq!(
            text,
            "→ Edited f.txt: 2 replacements, -1 +1 lines\n@@ -1,1 +1,1 @@\n-aa aa\n+b b"
        );
    }

    #[test]
    fn edit_reports_misses_with_a_hint() {
        let ws = TempDir::new();
        ws.put("f.py", "def f():\n    return 1\n");
        let msg = err(
            "Edit",
            json!({"path": "f.py", "old_string": "  return 1\n  # done", "new_string": "x"}),
            &ws,
        );
        assert!(
            msg.starts_with("Edit: `old_string` was not found in `f.py`"),
            "{msg}"
        );
        assert!(
            msg.ends_with("its first line matches line 2 when indentation is ignored"),
            "{msg}"
        );
        let msg = err(
            "Edit",
            json!({"path": "f.py", "old_string": "zzz", "new_string": "x"}),
            &ws,
        );
        assert!(msg.ends_with("including indentation"), "{msg}");
        assert_eq!(
            err(
                "Edit",
                json!({"path": "f.py", "old_string": "def", "new_string": "def"}),
                &ws
            ),
            "Edit: `old_string` and `new_string` are identical; nothing to change"
        );
        assert!(
            err(
                "Edit",
                json!({"path": "f.py", "old_string": "", "new_string": "x"}),
                &ws
            )
            .contains("`old_string` is empty")
        );
        assert!(
            err(
                "Edit",
                json!({"path": "g.py", "old_string": "a", "new_string": "b"}),
                &ws
            )
            .contains("does not exist; use Write")
        );
        ws.put("bad.txt", b"caf\xe9\n");
        assert!(
            err(
                "Edit",
                json!({"path": "bad.txt", "old_string": "caf", "new_string": "b"}),
                &ws
            )
            .contains("not valid UTF-8")
        );
    }

    #[test]
    fn edit_tolerates_trailing_whitespace_and_crlf() {
        let ws = TempDir::new();
        ws.put("w.txt", "keep\nfoo   \nbar\t\nend\n");
        let text = ok(
            "Edit",
            json!({"path": "w.txt", "old_string": "foo\nbar\n", "new_string": "baz\n"}),
            &ws,
        );
        assert!(
            text.contains("(matched ignoring trailing whitespace and line endings)"),
            "{text}"
        );
        assert_eq!(ws.get("w.txt"), "keep\nbaz\nend\n");

        ws.put("crlf.txt", "one\r\ntwo\r\nthree\r\n");
        ok(
            "Edit",
            json!({"path": "crlf.txt", "old_string": "one\ntwo\n", "new_string": "1\n2\n"}),
            &ws,
        );
        assert_eq!(ws.get("crlf.txt"), "1\r\n2\r\nthree\r\n");

        // An old_string typed with CRLF against an LF file.
        ws.put("lf.txt", "alpha\nbeta\n");
        ok(
            "Edit",
            json!({"path": "lf.txt", "old_string": "alpha\r\nbeta", "new_string": "gamma"}),
            &ws,
        );
        assert_eq!(ws.get("lf.txt"), "gamma\n");
    }

    #[test]
    fn edit_whitespace_tier_needs_a_unique_match() {
        let ws = TempDir::new();
        ws.put("w.txt", "x \ny\nx\t\ny\n");
        let msg = err(
            "Edit",
            json!({"path": "w.txt", "old_string": "x\ny", "new_string": "z"}),
            &ws,
        );
        assert!(msg.contains("it matches 2 places in `w.txt`"), "{msg}");
        let msg = err(
            "Edit",
            json!({"path": "w.txt", "old_string": "x\ny", "new_string": "z", "replace_all": true}),
            &ws,
        );
        assert!(msg.contains("matches 2 places"), "{msg}");
        assert_eq!(ws.get("w.txt"), "x \ny\nx\t\ny\n");
    }

    #[test]
    fn edit_diff_is_capped() {
        let ws = TempDir::new();
        let content: String = (0..400).map(|n| format!("item {n} = old;\n")).collect();
        ws.put("many.txt", content);
        let text = ok(
            "Edit",
            json!({"path": "many.txt", "old_string": "old", "new_string": "new", "replace_all": true}),
            &ws,
        );
        assert!(text.starts_with("→ Edited many.txt: 400 replacements, -400 +400 lines\n"));
        assert!(
            text.ends_with("… (diff cut at 8 KiB)"),
            "{}",
            &text[text.len() - 80..]
        );
        assert!(text.len() < EDIT_DIFF_MAX_BYTES + 200);
        assert!(ws.get("many.txt").ends_with("item 399 = new;\n"));
    }

    // --- Glob

    #[test]
    fn glob_lists_newest_first_and_respects_separators() {
        let ws = TempDir::new();
        set_mtime(&ws.put("old.rs", ""), 1_000);
        set_mtime(&ws.put("new.rs", ""), 3_000);
        set_mtime(&ws.put("b_tie.rs", ""), 2_000);
        set_mtime(&ws.put("a_tie.rs", ""), 2_000);
        set_mtime(&ws.put("src/deep/mod.rs", ""), 4_000);
        ws.put("notes.md", "");
        assert_eq!(
            ok("Glob", json!({"pattern": "*.rs"}), &ws),
            "new.rs\na_tie.rs\nb_tie.rs\nold.rs"
        );
        assert_eq!(
            ok("Glob", json!({"pattern": "**/*.rs"}), &ws),
            "src/deep/mod.rs\nnew.rs\na_tie.rs\nb_tie.rs\nold.rs"
        );
        assert_eq!(
            ok("Glob", json!({"pattern": "*.rs", "path": "src/deep"}), &ws),
            "src/deep/mod.rs"
        );
        assert_eq!(
            ok("Glob", json!({"pattern": "*.{md,txt}"}), &ws),
            "notes.md"
        );
    }

    #[test]
    fn glob_skips_git_and_reports_no_match() {
        let ws = TempDir::new();
        ws.put(".git/config", "");
        ws.put("sub/.git/HEAD", "");
        assert_eq!(
            ok("Glob", json!({"pattern": "**/*"}), &ws),
            "no files matched `**/*` in ."
        );
        assert!(
            err("Glob", json!({"pattern": "*", "path": "missing"}), &ws).contains("does not exist")
        );
        ws.put("file.txt", "");
        assert!(
            err("Glob", json!({"pattern": "*", "path": "file.txt"}), &ws)
                .contains("must be a directory")
        );
        assert!(err("Glob", json!({"pattern": "/etc/*"}), &ws).contains("must be relative"));
        let msg = err("Glob", json!({"pattern": "src/[a"}), &ws);
        assert!(
            msg.starts_with("Glob: invalid glob pattern `src/[a`: "),
            "{msg}"
        );
        let msg = err("Grep", json!({"pattern": "x", "include": "{a,b"}), &ws);
        assert!(
            msg.starts_with("Grep: invalid `include` glob `{a,b`: "),
            "{msg}"
        );
        assert!(err("Glob", json!({"pattern": "*", "path": ".."}), &ws).contains("escapes"));
    }

    #[test]
    fn glob_truncates_at_200() {
        let ws = TempDir::new();
        for n in 0..230 {
            ws.put(&format!("f{n:03}.txt"), "");
        }
        let text = ok("Glob", json!({"pattern": "*.txt"}), &ws);
        assert_eq!(text.lines().count(), 201);
        assert!(text.ends_with("(truncated: 30 more)"), "{text}");
    }

    #[test]
    fn glob_does_not_follow_symlinked_dirs() {
        let ws = TempDir::new();
        let outside = TempDir::new();
        outside.put("x.txt", "");
        std::os::unix::fs::symlink(outside.path(), ws.path().join("out")).expect("symlink");
        ws.put("real/y.txt", "");
        std::os::unix::fs::symlink(ws.path().join("real/y.txt"), ws.path().join("y_link.txt"))
            .expect("symlink");
        assert_eq!(
            ok("Glob", json!({"pattern": "**/*.txt"}), &ws)
                .lines()
                .count(),
            2
        );
    }

    // --- Grep

    #[test]
    fn grep_reports_matching_lines_with_paths() {
        let ws = TempDir::new();
        ws.put("src/a.rs", "fn main() {}\nlet x = 1;\n");
        ws.put("src/b.rs", "// TODO: later\nfn helper() {}\n");
        ws.put("README.md", "fn is not code here\n");
        assert_eq!(
            ok(
                "Grep",
                json!({"pattern": r"fn \w+\(", "include": "*.rs"}),
                &ws
            ),
            "src/a.rs:1: fn main() {}\nsrc/b.rs:2: fn helper() {}"
        );
        assert_eq!(
            ok("Grep", json!({"pattern": "^fn", "path": "src"}), &ws),
            "src/a.rs:1: fn main() {}\nsrc/b.rs:2: fn helper() {}"
        );
        assert_eq!(
            ok(
                "Grep",
                json!({"pattern": "(?i)todo", "path": "src/b.rs"}),
                &ws
            ),
            "src/b.rs:1: // TODO: later"
        );
        assert_eq!(
            ok(
                "Grep",
                json!({"pattern": "fn", "include": "./src/*.rs"}),
                &ws
            ),
            "src/a.rs:1: fn main() {}\nsrc/b.rs:2: fn helper() {}"
        );
        assert_eq!(
            ok("Grep", json!({"pattern": "nothing-here"}), &ws),
            "no matches for `nothing-here` in ."
        );
    }

    #[test]
    fn grep_skips_git_binary_large_and_symlinks() {
        let ws = TempDir::new();
        let outside = TempDir::new();
        outside.put("secret.txt", "needle\n");
        ws.put(".git/objects/x", "needle\n");
        ws.put("bin.dat", b"needle\x00\n");
        ws.put("ok.txt", "needle\n");
        let big = File::create(ws.path().join("big.txt")).expect("create");
        big.set_len(MAX_FILE_BYTES + 1).expect("set_len");
        std::os::unix::fs::symlink(
            outside.path().join("secret.txt"),
            ws.path().join("link.txt"),
        )
        .expect("symlink");
        assert_eq!(
            ok("Grep", json!({"pattern": "needle"}), &ws),
            "ok.txt:1: needle\n(skipped 1 binary, 1 over 5 MB and 0 unreadable files)"
        );
        assert!(
            err("Grep", json!({"pattern": "needle", "path": "bin.dat"}), &ws)
                .contains("looks binary")
        );
        assert!(
            err(
                "Grep",
                json!({"pattern": "needle", "path": "link.txt"}),
                &ws
            )
            .contains("outside")
        );
    }

    #[test]
    fn grep_caps_matches_and_lines() {
        let ws = TempDir::new();
        let content: String = (1..=20).map(|n| format!("hit {n}\n")).collect();
        ws.put("hits.txt", content);
        let text = ok("Grep", json!({"pattern": "hit", "max_matches": 5}), &ws);
        assert_eq!(text.lines().count(), 6);
        assert!(text.starts_with("hits.txt:1: hit 1\n"));
        assert!(text.ends_with(
            "(truncated at 5 matches; narrow the pattern, `path` or `include`, or raise \
             `max_matches` up to 500)"
        ));
        // Exactly max_matches matches is not a truncation.
        let text = ok("Grep", json!({"pattern": "hit", "max_matches": 20}), &ws);
        assert!(!text.contains("truncated"));
        ws.put("long.txt", format!("{}\n", "y".repeat(600)));
        let text = ok("Grep", json!({"pattern": "y", "path": "long.txt"}), &ws);
        assert_eq!(
            text,
            format!("long.txt:1: {}… [100 more chars]", "y".repeat(500))
        );
    }

    #[test]
    fn grep_stops_before_the_output_cap() {
        let ws = TempDir::new();
        let content: String = (0..500).map(|_| format!("{}\n", "z".repeat(480))).collect();
        ws.put("wide.txt", content);
        let text = ok("Grep", json!({"pattern": "z", "max_matches": 500}), &ws);
        assert!(text.len() <= MAX_OUTPUT_BYTES);
        assert!(
            text.ends_with("output reached 64 KiB; narrow the search)"),
            "tail"
        );
    }

    #[test]
    fn grep_rejects_bad_and_oversized_regexes() {
        let ws = TempDir::new();
        let msg = err("Grep", json!({"pattern": "fn ("}), &ws);
        assert!(msg.starts_with("Grep: invalid regex `fn (`"), "{msg}");
        let msg = err("Grep", json!({"pattern": r"\w{1000}{1000}"}), &ws);
        assert!(msg.contains("invalid regex"), "{msg}");
        // Property classes are left out of the binary (Cargo.toml, regex features).
        let msg = err("Grep", json!({"pattern": r"\p{Greek}"}), &ws);
        assert!(msg.contains("invalid regex"), "{msg}");
        assert!(
            err("Grep", json!({"pattern": "x", "max_matches": 0}), &ws).contains("`max_matches`")
        );
    }

    // --- walks and caps

    #[test]
    fn walk_stops_at_the_entry_cap() {
        let ws = TempDir::new();
        for n in 0..30 {
            ws.put(&format!("d{}/f{n}.txt", n % 3), "");
        }
        let mut seen = 0;
        let root = ws.path().canonicalize().expect("canonical");
        let held = Beneath::open(&root, &[]).expect("held");
        let start = held.dir(".", false).expect("root");
        let notes = walk(&held, start, 10, SymlinkedFiles::Include, |_| {
            seen += 1;
            ControlFlow::Continue(())
        });
        assert_eq!(notes.stopped_at, Some(10));
        assert!(seen < 10, "saw {seen}");
        let mut out = String::new();
        notes.write_notes(&mut out);
        assert!(out.contains("walk stopped after visiting 10 entries"));
    }

    #[test]
    fn walks_skip_the_deny_list_and_never_enter_a_directory_swapped_mid_walk() {
        let ws = TempDir::new();
        let outside = TempDir::new();
        ws.put("a.txt", "first");
        ws.put("secrets/key", "KEY");
        ws.put("sub/ok.txt", "fine");
        outside.put("secret.txt", "OUTSIDE");
        let key = outside.put("home/.ssh/id", "KEY");
        fs::hard_link(&key, ws.0.join("linked-key")).expect("hard link");
        let root = ws.path().canonicalize().expect("canonical");
        let deny = [root.join("secrets"), outside.0.join("home/.ssh")];
        let held = Beneath::open(&root, &deny).expect("held");
        let mut seen = Vec::new();
        walk(
            &held,
            held.dir(".", false).expect("root"),
            100,
            SymlinkedFiles::Include,
            |entry| {
                if entry.rel == "a.txt" {
                    // `sub` was listed; now it becomes a symlink out of the workspace.
                    fs::rename(root.join("sub"), root.join("sub-real")).expect("rename");
                    std::os::unix::fs::symlink(&outside.0, root.join("sub")).expect("symlink");
                }
                seen.push(entry.rel.to_owned());
                ControlFlow::Continue(())
            },
        );
        assert!(seen.contains(&"a.txt".to_owned()), "{seen:?}");
        for rel in &seen {
            assert!(
                !rel.contains("secret") && !rel.contains("key"),
                "the walk reached {rel}: {seen:?}"
            );
        }
    }

    #[test]
    fn cap_output_bounds_every_result() {
        let short = "ok".to_owned();
        assert_eq!(cap_output(short.clone()), short);
        let long = "é".repeat(MAX_OUTPUT_BYTES);
        let capped = cap_output(long);
        assert!(capped.len() <= MAX_OUTPUT_BYTES);
        assert!(capped.ends_with("bytes cut]"), "marker");
        let n_cut: usize = capped
            .rsplit("truncated: ")
            .next()
            .and_then(|rest| rest.split(' ').next())
            .and_then(|n| n.parse().ok())
            .expect("marker says how much was cut");
        assert_eq!(
            2 * MAX_OUTPUT_BYTES - n_cut,
            capped.find("\n… [output").unwrap_or_default()
        );
    }
}
