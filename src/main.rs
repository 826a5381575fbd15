//! caliban: a coding agent that other programs drive. Everything lives in the library; see
//! `app::main` for the command line and ARCHITECTURE.md for the map.

fn main() -> std::process::ExitCode {
    caliban::app::main()
}
