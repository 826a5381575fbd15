//! Tools the model may call. `table` holds one row per built-in tool (its spec, where it
//! runs, its permission and display facts); each tool's own file holds its spec, its title
//! and its work: the file tools (run on a worker thread) in `fs`, `Bash` (a child process on
//! the reactor) in `bash`. What every tool's input schema shares (`closed_object`,
//! `timeout_seconds`) and what their titles share (`text_field`, `cap_title`) is here, below
//! them all, so `table` names the tools and no tool reaches back into `table`.

pub mod bash;
pub(crate) mod beneath;
pub mod fs;
pub mod mcp_name;
pub(crate) mod table;
pub mod todo;
pub mod web;

use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};

use crate::model::types::{ContentBlock, MAX_IMAGES};
use crate::sandbox::{self, Mode};
use table::{Class, Subject};

/// The most base64 the images of one model message of tool results carry together, and so
/// of one tool's result: a turn's results travel in one `TurnEnd` event, one session-file
/// line (`drive::session::MAX_LINE_BYTES`, 16 MiB), which must still hold that turn's text.
pub const MAX_RESULT_IMAGES_BASE64: usize = 8 << 20;

/// The sandbox's answer for a call of `tool` with `input` in a run under `mode`, before it
/// runs: for a tool whose permission subject is a path (its row in `table`), the sandbox's
/// verdict on that path (`sandbox::check_file_tool`); every other call is the sandbox's
/// business only once it spawns a process. `Err` is why not, for the model.
pub fn check_in_sandbox(
    mode: Mode,
    tool: &str,
    input: &Value,
    workspace: &Path,
) -> Result<(), String> {
    // Nothing to check, so no path to resolve on the file system.
    if mode == Mode::Off {
        return Ok(());
    }
    let Some(permission) = table::permission(tool) else {
        return Ok(());
    };
    let Subject::Path { field, default } = permission.subject else {
        return Ok(());
    };
    let Some(raw) = input.get(field).and_then(Value::as_str).or(default) else {
        return Ok(());
    };
    // A path the tool itself refuses is refused by the tool, with its own words.
    let Ok(path) = fs::resolve_path(workspace, raw) else {
        return Ok(());
    };
    let edits = permission.class == Class::EditsFile;
    sandbox::check_file_tool(mode, tool, &path.abs, &path.rel, edits)
}

/// What a tool hands back to the model: its text, already capped by the tool, and the images
/// beside it (`ContentBlock::Image` only, checked by `ContentBlock::image`, at most
/// `MAX_IMAGES` and `MAX_RESULT_IMAGES_BASE64` together: `add_image` keeps to that).
#[derive(Clone, Debug, PartialEq)]
pub struct ToolOutput {
    pub is_error: bool,
    pub text: String,
    pub images: Vec<ContentBlock>,
}

impl ToolOutput {
    pub fn ok(text: impl Into<String>) -> ToolOutput {
        ToolOutput::new(false, text)
    }

    pub fn error(text: impl Into<String>) -> ToolOutput {
        ToolOutput::new(true, text)
    }

    pub fn new(is_error: bool, text: impl Into<String>) -> ToolOutput {
        ToolOutput {
            is_error,
            text: text.into(),
            images: Vec::new(),
        }
    }

    /// Adds an image (base64 `data`), or, when it cannot go to the model (a type neither
    /// provider takes, not base64, over `MAX_IMAGE_BASE64`, or past this result's caps), a
    /// line in the text saying which image was left out and why: never a silent drop.
    /// `what` names the image in that line ("image 2", "resource file:///a.png").
    pub fn add_image(&mut self, what: &str, media_type: &str, data: &str) {
        let refused = match ContentBlock::image(media_type, data) {
            Ok(_) if self.images.len() >= MAX_IMAGES => {
                format!("this result already carries {MAX_IMAGES} images, the most one may")
            }
            Ok(_) if self.image_bytes() + data.len() > MAX_RESULT_IMAGES_BASE64 => format!(
                "this result's images would pass {MAX_RESULT_IMAGES_BASE64} bytes of base64 together"
            ),
            Ok(image) => {
                self.images.push(image);
                return;
            }
            Err(why) => why,
        };
        self.note(&format!(
            "[{what} ({media_type}) not passed on to the model: {refused}]"
        ));
    }

    /// Bytes of base64 in this result's images.
    pub fn image_bytes(&self) -> usize {
        self.images.iter().map(image_len).sum()
    }

    /// Appends a line to the text.
    pub fn note(&mut self, line: &str) {
        if !self.text.is_empty() && !self.text.ends_with('\n') {
            self.text.push('\n');
        }
        self.text.push_str(line);
    }

    /// The result's content blocks as the model gets them: the text (also when empty, if
    /// there is nothing else), then the images.
    pub fn content(&self) -> Vec<ContentBlock> {
        let mut content = Vec::with_capacity(1 + self.images.len());
        if !self.text.is_empty() || self.images.is_empty() {
            content.push(ContentBlock::text(self.text.clone()));
        }
        content.extend(self.images.iter().cloned());
        content
    }

    /// Keeps the first images that fit `budget` (count, base64 bytes), the images a turn's
    /// other results left, and says in the text which were left out; returns what the kept
    /// ones use.
    pub fn fit_images(&mut self, budget: (usize, usize)) -> (usize, usize) {
        let (mut count, mut bytes) = (0, 0);
        let images = std::mem::take(&mut self.images);
        for image in images {
            let len = image_len(&image);
            if count < budget.0 && bytes + len <= budget.1 {
                count += 1;
                bytes += len;
                self.images.push(image);
            } else {
                let kind = match &image {
                    ContentBlock::Image { media_type, .. } => media_type.as_str(),
                    _ => "",
                };
                self.note(&format!(
                    "[an image ({kind}, {len} bytes of base64) not passed on to the model: \
                     this turn's tool results already carry {MAX_IMAGES} images or \
                     {MAX_RESULT_IMAGES_BASE64} bytes of base64, the most one turn may]"
                ));
            }
        }
        (count, bytes)
    }
}

/// A closed object schema, the shape every tool's input takes: unknown fields are not
/// allowed.
pub(crate) fn closed_object(properties: Value, required: &[&str]) -> Value {
    json!({
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": false,
    })
}

/// A `timeout_seconds` field: `default` when absent or null, else an integer from 1 to
/// `max`. The error is the tool's result for the model.
pub(crate) fn timeout_seconds(
    input: &Value,
    tool: &str,
    default: Duration,
    max: u64,
) -> Result<Duration, ToolOutput> {
    match input.get("timeout_seconds") {
        None | Some(Value::Null) => Ok(default),
        Some(v) => match v.as_u64() {
            Some(s) if (1..=max).contains(&s) => Ok(Duration::from_secs(s)),
            _ => Err(ToolOutput::error(format!(
                "{tool}: `timeout_seconds` must be an integer from 1 to {max}"
            ))),
        },
    }
}

/// Titles are labels, not documents: a longer command or search is cut here.
pub(crate) const MAX_TITLE_CHARS: usize = 400;

/// A string field of a call's input for a title, empty when absent or not a string.
pub(crate) fn text_field<'v>(input: &'v Value, key: &str) -> &'v str {
    input.get(key).and_then(Value::as_str).unwrap_or_default()
}

/// `text` cut to `MAX_TITLE_CHARS`.
pub(crate) fn cap_title(text: &str) -> String {
    crate::text::cap_chars(text, MAX_TITLE_CHARS)
}

fn image_len(block: &ContentBlock) -> usize {
    match block {
        ContentBlock::Image { data, .. } => data.len(),
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::types::MAX_IMAGE_BASE64;

    #[test]
    fn images_are_added_or_explained() {
        let mut out = ToolOutput::ok("shot");
        out.add_image("image 1", "image/png", "AAAA");
        out.add_image("image 2", "image/bmp", "AAAA");
        out.add_image("image 3", "image/png", "not base64!");
        assert_eq!(out.images.len(), 1);
        assert!(
            out.text.contains(
                "[image 2 (image/bmp) not passed on to the model: unsupported image type"
            ),
            "{}",
            out.text
        );
        assert!(
            out.text.contains(
                "[image 3 (image/png) not passed on to the model: image data is not base64]"
            ),
            "{}",
            out.text
        );
        let big = "A".repeat(MAX_IMAGE_BASE64 + 4);
        out.add_image("image 4", "image/png", &big);
        assert!(out.text.contains("image too large"), "{}", out.text);
        for _ in 0..MAX_IMAGES {
            out.add_image("more", "image/gif", "AAAA");
        }
        assert_eq!(out.images.len(), MAX_IMAGES);
        assert!(
            out.text.contains("already carries 8 images"),
            "{}",
            out.text
        );
        let content = out.content();
        assert!(matches!(&content[0], ContentBlock::Text { .. }));
        assert_eq!(content.len(), 1 + MAX_IMAGES);
        // Near the per-result byte cap: three images of 3 MiB do not fit 8 MiB.
        let mut out = ToolOutput::ok("");
        let large = "A".repeat(MAX_IMAGE_BASE64);
        for n in 0..3 {
            out.add_image(&format!("image {n}"), "image/png", &large);
        }
        assert_eq!(out.images.len(), 2);
        assert!(
            out.text.starts_with("[image 2 (image/png) not passed on"),
            "{}",
            out.text
        );
    }

    #[test]
    fn an_image_only_result_has_no_empty_text_and_a_turn_budget_cuts_the_rest() {
        let mut out = ToolOutput::ok("");
        out.add_image("i", "image/png", "AAAA");
        out.add_image("j", "image/png", "BBBB");
        assert_eq!(out.content().len(), 2);
        assert!(matches!(out.content()[0], ContentBlock::Image { .. }));
        assert_eq!(out.fit_images((1, 100)), (1, 4));
        assert_eq!(out.images.len(), 1);
        assert!(
            out.text.contains("this turn's tool results already carry"),
            "{}",
            out.text
        );
        assert_eq!(ToolOutput::ok("").content(), vec![ContentBlock::text("")]);
    }
}
