//! The ids every floor names runs and host sources by. A leaf: it imports nothing from the
//! crate, so the session store and the surfaces can name a run without reaching the engine.

/// A run's id, the one spelling of it everywhere in the process; `run-N` on the wire and in
/// session file names (`Display`/`parse`), so a string is parsed once, at a surface's edge.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RunId(pub u64);

impl RunId {
    /// `run-<N>` in its one canonical spelling (no sign, no leading zeros), so a run has
    /// exactly one id string.
    pub fn parse(id: &str) -> Option<RunId> {
        let digits = id.strip_prefix("run-")?;
        let canonical = !digits.is_empty()
            && digits.bytes().all(|b| b.is_ascii_digit())
            && (digits == "0" || !digits.starts_with('0'));
        canonical.then(|| digits.parse().ok().map(RunId)).flatten()
    }
}

impl std::fmt::Display for RunId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "run-{}", self.0)
    }
}

/// What a host names its own event sources and timers by: a small `Copy` enum of its
/// choosing, handed back verbatim in `Host::on_io` / `Host::on_timer`.
pub trait HostKey: Copy + Eq + std::hash::Hash + std::fmt::Debug {}
impl<K: Copy + Eq + std::hash::Hash + std::fmt::Debug> HostKey for K {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_id_reads_back_what_it_writes() {
        for n in [0, 7, 42, u64::MAX] {
            assert_eq!(RunId::parse(&RunId(n).to_string()), Some(RunId(n)));
        }
        assert_eq!(RunId(12).to_string(), "run-12");
    }

    #[test]
    fn only_the_canonical_spelling_is_a_run_id() {
        for other in [
            "run-", "run-07", "run-+7", "run--7", "run-7 ", "Run-7", "7", "run-1e3",
        ] {
            assert_eq!(RunId::parse(other), None, "{other:?}");
        }
        assert_eq!(RunId::parse("run-18446744073709551616"), None, "past u64");
    }
}
