//! The process exit codes, shared by print mode, the serve commands and `main` (the README's
//! "Exit codes" paragraph lists the same).

/// The run or server finished normally.
pub const OK: u8 = 0;
/// Runtime error: the model unreachable, its stream broken, the event loop failed.
pub const RUNTIME: u8 = 1;
/// The assistant stopped abnormally (max tokens, refusal).
pub const ASSISTANT: u8 = 2;
/// Usage error or malformed input: bad arguments, flags or stream-json lines.
pub const USAGE: u8 = 64;
/// No input: no prompt on argv or stdin, or stdin unreadable.
pub const NO_INPUT: u8 = 66;
/// The run reached its turn limit.
pub const MAX_TURNS: u8 = 75;
/// Configuration error: no provider, bad settings, an unsafe bind.
pub const CONFIG: u8 = 78;
/// The run was cancelled (SIGINT, SIGTERM or an `interrupt`).
pub const CANCELLED: u8 = 124;
/// A second SIGINT arrived before the run finished cancelling.
pub const INTERRUPTED_TWICE: u8 = 130;
