//! Tools the model may call. `table` holds one row per built-in tool (its spec, where it
//! runs, its permission and display facts); each tool's own file holds its spec, its title
//! and its work: the file tools (run on a worker thread) in `fs`, `Bash` (a child process on
//! the reactor) in `bash`.

pub mod bash;
pub mod fs;
pub mod spec;
pub(crate) mod table;
pub mod todo;
pub mod web;

/// What a tool hands back to the model. `text` is already capped by the tool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolOutput {
    pub is_error: bool,
    pub text: String,
}

impl ToolOutput {
    pub fn ok(text: impl Into<String>) -> ToolOutput {
        ToolOutput {
            is_error: false,
            text: text.into(),
        }
    }

    pub fn error(text: impl Into<String>) -> ToolOutput {
        ToolOutput {
            is_error: true,
            text: text.into(),
        }
    }
}
