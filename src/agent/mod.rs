//! The agent: the run state machine, the events it emits, and the streamed tool input it
//! and its hosts gather.

pub mod compact;
pub mod event;
pub mod run;
pub(crate) mod tool_input;

/// The built-in system prompt; `--system-prompt` replaces it.
pub fn default_system_prompt(workspace: &str) -> String {
    format!(
        "You are caliban, a coding agent driven by another program. You work in the \
workspace at {workspace}. Use the tools to read, search, edit and run code; paths are \
relative to the workspace. Prefer small, verifiable steps, check your work by running it, \
and finish with a short, direct answer that states what you did."
    )
}
