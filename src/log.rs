//! A leveled logger on stderr. Stdout may be a protocol channel (MCP, ACP, stream-json), so
//! nothing but protocol ever goes there; diagnostics always go here.

use std::io::Write;
use std::sync::atomic::{AtomicU8, Ordering};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Error = 0,
    Warn = 1,
    Info = 2,
    Debug = 3,
}

static LEVEL: AtomicU8 = AtomicU8::new(Level::Warn as u8);

pub fn set_level(level: Level) {
    LEVEL.store(level as u8, Ordering::Relaxed);
}

pub fn enabled(level: Level) -> bool {
    level as u8 <= LEVEL.load(Ordering::Relaxed)
}

fn emit(level: Level, tag: &str, msg: &str) {
    if enabled(level) {
        // One write per line so concurrent threads do not interleave mid-line; a failing
        // stderr has nowhere else to report to.
        let line = format!("caliban: {tag}{msg}\n");
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    }
}

pub fn error(msg: &str) {
    emit(Level::Error, "error: ", msg);
}

pub fn warn(msg: &str) {
    emit(Level::Warn, "warning: ", msg);
}

pub fn info(msg: &str) {
    emit(Level::Info, "", msg);
}

pub fn debug(msg: &str) {
    emit(Level::Debug, "debug: ", msg);
}
