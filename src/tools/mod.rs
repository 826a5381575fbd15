//! Tools the model may call: the registry of specs, and dispatch to the file tools (run on a
//! worker thread) or to `Bash` (a child process on the reactor).

pub mod bash;
pub mod fs;
pub mod spec;

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
