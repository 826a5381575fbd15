//! caliban's secrets and every secret-looking variable, kept out of the environment of
//! every process a tool starts (commands, background shells, MCP stdio servers, hooks),
//! sandboxed or not: `reaper::spawn` calls `scrub_env` for each, so no spawner can forget
//! it. What the user's settings pass through (`sandbox.env_passthrough`) is installed once
//! at start with the sandbox's configuration; until then nothing is passed through.

use std::sync::OnceLock;

static PASSTHROUGH: OnceLock<Vec<String>> = OnceLock::new();

/// Sets the names `scrub_env` keeps whatever they look like; the first call wins.
pub fn install(passthrough: Vec<String>) {
    let _ = PASSTHROUGH.set(passthrough);
}

/// The variables caliban itself reads a secret from: the provider keys, the drive API token
/// and the networked agent's bearer token. Most already match `SECRET_ENV_PARTS`; naming
/// them keeps them out even if a pattern is ever narrowed.
pub const SCRUBBED_ENV: &[&str] = &[
    "ANTHROPIC_API_KEY",
    "OPENAI_API_KEY",
    "CALIBAN_DRIVE_TOKEN",
    "CALIBAN_AGENT_TOKEN",
];

/// Parts of a variable's name (compared case-insensitively) that mark it a secret to keep
/// from every process a tool starts. `KEY`, `SECRET` and `TOKEN` are Codex's defaults
/// (`AWS_SECRET_ACCESS_KEY`, `GITHUB_TOKEN`, `NPM_TOKEN`, `STRIPE_KEY`); `PASSWORD` and
/// `PASSWD` catch database clients' (`PGPASSWORD`, `MYSQL_PASSWORD`); `CREDENTIAL` catches
/// the names that point tools at credentials (`GOOGLE_APPLICATION_CREDENTIALS`,
/// `AWS_SHARED_CREDENTIALS_FILE`), which are harmless to drop for a command that does not
/// need them and a key away for one that does. Over-matching (`KEYTIMEOUT`) costs a
/// command a variable it can be given back with `sandbox.env_passthrough`; under-matching
/// leaks a key to code the model wrote.
const SECRET_ENV_PARTS: &[&str] = &["KEY", "SECRET", "TOKEN", "PASSWORD", "PASSWD", "CREDENTIAL"];

/// Whether `name` is a variable kept from tools' processes unless passed through.
pub fn is_secret_env(name: &str) -> bool {
    let upper = name.to_ascii_uppercase();
    SCRUBBED_ENV.contains(&upper.as_str())
        || SECRET_ENV_PARTS.iter().any(|part| upper.contains(part))
}

/// Whether `name` is a proxy variable (`HTTPS_PROXY`, `http_proxy`, `ALL_PROXY`, …) whose
/// URL carries a user and password (`http://user:pass@proxy:3128`): caliban reads them
/// for its own connections, and the password is a secret like a key.
fn proxy_with_credentials(name: &str, value: &std::ffi::OsStr) -> bool {
    let upper = name.to_ascii_uppercase();
    if !matches!(upper.as_str(), "HTTPS_PROXY" | "HTTP_PROXY" | "ALL_PROXY") {
        return false;
    }
    let value = value.to_string_lossy();
    let rest = value.split_once("://").map_or(&*value, |(_, rest)| rest);
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    authority.contains('@')
}

/// Takes the secrets (`is_secret_env`) of caliban's own environment out of `cmd`'s, but for
/// those `sandbox.env_passthrough` names (`install`) and those set on `cmd` itself (an MCP server's
/// configured `env`, which its user wrote for it). Every spawner calls it through
/// `reaper::spawn`, sandboxed or not: an unconfined command still need not hold the
/// provider key, and a process a run started must not be able to act as caliban.
pub fn scrub_env(cmd: &mut std::process::Command) {
    let explicit: Vec<std::ffi::OsString> = cmd.get_envs().map(|(k, _)| k.to_owned()).collect();
    let passthrough = PASSTHROUGH.get().map_or(&[][..], Vec::as_slice);
    for (name, value) in std::env::vars_os() {
        let Some(text) = name.to_str() else { continue };
        if (is_secret_env(text) || proxy_with_credentials(text, &value))
            && !passthrough.iter().any(|kept| kept == text)
            && !explicit.contains(&name)
        {
            cmd.env_remove(&name);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_looking_names_are_scrubbed_whatever_their_case() {
        for name in [
            "ANTHROPIC_API_KEY",
            "OPENAI_API_KEY",
            "CALIBAN_DRIVE_TOKEN",
            "CALIBAN_AGENT_TOKEN",
            "AWS_SECRET_ACCESS_KEY",
            "github_token",
            "PGPASSWORD",
            "GOOGLE_APPLICATION_CREDENTIALS",
            "my_passwd",
        ] {
            assert!(is_secret_env(name), "{name}");
        }
        for name in [
            "PATH",
            "HOME",
            "CALIBAN_TOOL_CALL",
            "ANTHROPIC_BASE_URL",
            "LANG",
        ] {
            assert!(!is_secret_env(name), "{name}");
        }
        let creds = |name: &str, value: &str| proxy_with_credentials(name, value.as_ref());
        assert!(creds("HTTPS_PROXY", "http://user:pass@proxy:3128"));
        assert!(creds("http_proxy", "user:pass@proxy:3128"));
        assert!(creds("ALL_PROXY", "socks5://u@proxy"));
        assert!(!creds("HTTPS_PROXY", "http://proxy:3128/path@x"));
        assert!(!creds("HTTPS_PROXY", "http://proxy:3128"));
        assert!(!creds("NO_PROXY", "a@b"));
    }
}
