//! `caliban mcp serve`: MCP server over stdio and Streamable HTTP. (Being written.)

use crate::drive::table::DriveCore;
use crate::engine::Engine;
use crate::surface::ListenConfig;

pub fn run(engine: Engine, core: DriveCore, listen: Option<ListenConfig>) -> u8 {
    let _ = (engine, core, listen);
    crate::log::error("mcp serve is not available yet");
    1
}
