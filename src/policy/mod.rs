//! What the permission policy, the sandbox and the file tools all decide from, kept below
//! the three so that none reaches up into another for it: how much a command may do (the
//! sandbox `Mode`, which a run may only narrow) and the paths that configure what runs or
//! what is allowed (`PROTECTED`).

mod protected;

pub(crate) use protected::{PROTECTED, Protected, find as protected_path};

/// How much a command may do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mode {
    ReadOnly,
    WorkspaceWrite,
    Network,
    Off,
}

impl Mode {
    pub const ALL: [Mode; 4] = [
        Mode::ReadOnly,
        Mode::WorkspaceWrite,
        Mode::Network,
        Mode::Off,
    ];

    pub fn parse(name: &str) -> Option<Mode> {
        Mode::ALL.into_iter().find(|mode| mode.as_str() == name)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Mode::ReadOnly => "read-only",
            Mode::WorkspaceWrite => "workspace-write",
            Mode::Network => "network",
            Mode::Off => "off",
        }
    }

    fn strictness(self) -> u8 {
        match self {
            Mode::Off => 0,
            Mode::Network => 1,
            Mode::WorkspaceWrite => 2,
            Mode::ReadOnly => 3,
        }
    }

    /// The stricter of the two: what a run that asks for `other` gets.
    pub fn narrowed(self, other: Mode) -> Mode {
        if other.strictness() > self.strictness() {
            other
        } else {
            self
        }
    }

    /// Whether this mode allows no more than `than` does.
    pub fn is_within(self, than: Mode) -> bool {
        self.strictness() >= than.strictness()
    }

    /// "read-only, workspace-write, network or off", for error messages.
    pub fn names() -> String {
        let names: Vec<&str> = Mode::ALL.iter().map(|mode| mode.as_str()).collect();
        format!(
            "{} or {}",
            names[..names.len() - 1].join(", "),
            names[names.len() - 1]
        )
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_narrow_and_never_widen() {
        for a in Mode::ALL {
            assert_eq!(Mode::parse(a.as_str()), Some(a));
            for b in Mode::ALL {
                let n = a.narrowed(b);
                assert!(n.is_within(a) && n.is_within(b), "{a} {b}");
                assert!(n == a || n == b);
            }
        }
        assert_eq!(Mode::Off.narrowed(Mode::Network), Mode::Network);
        assert_eq!(Mode::ReadOnly.narrowed(Mode::Off), Mode::ReadOnly);
        assert!(!Mode::Off.is_within(Mode::WorkspaceWrite));
        assert_eq!(Mode::parse("workspace_write"), None);
        assert_eq!(Mode::names(), "read-only, workspace-write, network or off");
    }
}
