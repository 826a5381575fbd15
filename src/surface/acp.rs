//! `caliban acp serve`: an ACP agent over stdio. (Being written.)

use crate::drive::table::DriveCore;
use crate::engine::Engine;

pub fn run(engine: Engine, core: DriveCore) -> u8 {
    let _ = (engine, core);
    crate::log::error("acp serve is not available yet");
    1
}
