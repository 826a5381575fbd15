//! How the model names an MCP server's tool (`mcp__<server>__<tool>`), and how an allowlist
//! names some of them. The MCP client makes the names, the tool table and a run's allowlist
//! read them back; all three use this leaf, so none of them reaches into another for it.

/// The prefix of the tools servers offer, as the model sees them: `mcp__<server>__<tool>`.
pub const PREFIX: &str = "mcp__";
/// Longest name part (server or tool) kept in a model-facing tool name; providers cap the
/// whole name at 64 or 128 characters.
const MAX_NAME_PART: usize = 28;

/// A name part providers accept: ASCII letters, digits, `_` and `-`.
pub fn sanitize(part: &str) -> String {
    let mut out: String = part
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .take(MAX_NAME_PART)
        .collect();
    if out.is_empty() {
        out.push('_');
    }
    out
}

/// The model-facing name of a server's tool.
pub fn tool_name(server: &str, tool: &str) -> String {
    format!("{PREFIX}{}__{}", sanitize(server), sanitize(tool))
}

/// The server part of a model-facing name (`mcp__<server>__<tool>`), as sanitized.
pub fn server_part(model_name: &str) -> Option<&str> {
    let rest = model_name.strip_prefix(PREFIX)?;
    rest.split_once("__").map(|(server, _)| server)
}

/// Whether `entry` names MCP tools in a tool allowlist (a networked agent's
/// `tool_allowlist`): one tool, `mcp__<server>__<tool>`, or every tool of a server,
/// `mcp__<server>__*`.
pub fn is_allowlist_entry(entry: &str) -> bool {
    server_part(entry).is_some_and(|server| !server.is_empty())
        && entry
            .strip_prefix(PREFIX)
            .and_then(|rest| rest.split_once("__"))
            .is_some_and(|(_, tool)| !tool.is_empty() && (tool == "*" || !tool.contains('*')))
}

/// Whether an allowlist admits the MCP tool `model_name` (see `is_allowlist_entry`).
pub fn allowlist_admits(entries: &[String], model_name: &str) -> bool {
    entries.iter().any(|entry| match entry.strip_suffix('*') {
        Some(prefix) => model_name.starts_with(prefix) && model_name.len() > prefix.len(),
        None => entry == model_name,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allowlist_entries_name_one_tool_or_one_server() {
        for good in ["mcp__fs__read", "mcp__fs__*", "mcp__my-srv__a_b"] {
            assert!(is_allowlist_entry(good), "{good}");
        }
        for bad in [
            "mcp__",
            "mcp__fs",
            "mcp__fs__",
            "mcp____x",
            "mcp__*",
            "mcp__fs__re*",
            "Read",
        ] {
            assert!(!is_allowlist_entry(bad), "{bad}");
        }
        let list = vec!["mcp__fs__*".to_owned(), "mcp__web__fetch".to_owned()];
        assert!(allowlist_admits(&list, "mcp__fs__read"));
        assert!(allowlist_admits(&list, "mcp__web__fetch"));
        assert!(!allowlist_admits(&list, "mcp__web__post"));
        assert!(!allowlist_admits(&list, "mcp__fsx__read"));
        assert!(!allowlist_admits(&[], "mcp__fs__read"));
    }

    #[test]
    fn names_are_sanitized_and_split() {
        assert_eq!(tool_name("my server", "a.b"), "mcp__my_server__a_b");
        assert_eq!(server_part("mcp__fs__read"), Some("fs"));
        assert_eq!(server_part("Read"), None);
    }
}
