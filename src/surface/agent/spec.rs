//! The spawn spec: what a supervisor asks of one networked agent, as a JSON object (`--spec
//! FILE` or `CALIBAN_AGENT_SPEC`), with upstream's `SpawnSpec` names
//! (`reference/upstream-caliban.md` §9.3) for the fields that mean something here. Parsing is
//! pure and strict: an unknown field, a wrong type or a value that would be ignored is an
//! error that names it, so a typo in a supervisor's template fails the start instead of
//! quietly running something else.

use serde_json::{Map, Value};

/// The largest spec accepted, from a file or the environment: a prompt and a few names.
pub(crate) const MAX_SPEC_BYTES: usize = 1024 * 1024;

/// The fields a spec may hold, in upstream's order where it has them.
const FIELDS: [&str; 9] = [
    "label",
    "initial_prompt",
    "model",
    "provider",
    "tool_allowlist",
    "interactive",
    "drive_protocol",
    "permission_posture",
    "sandbox",
];

/// Which protocol the agent's clients speak; one per agent, chosen at start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Protocol {
    /// The NDJSON session plane: bare `TurnEvent` lines out, `UserMessage`/`EndInput`/`Permit`
    /// lines in (`ndjson`).
    Ndjson,
    /// Exactly the ACP of `caliban acp serve`.
    Acp,
}

/// What happens to a tool call the rules say to ask about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Posture {
    /// Asked of the connected client; denied after the permission timeout if nobody answers.
    Supervised,
    /// Allowed without asking (the `dontAsk` mode); deny rules still deny.
    Unattended,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Spec {
    /// A name for logs and the run's session header.
    pub(crate) label: Option<String>,
    /// The NDJSON plane's run starts from it; ACP clients send their own prompts.
    pub(crate) initial_prompt: String,
    pub(crate) model: Option<String>,
    pub(crate) provider: Option<String>,
    /// The only tools offered to the model (`None`: all of them): built-in tools by name,
    /// MCP tools as `mcp__server__tool` or `mcp__server__*` (no such entry: no MCP tools).
    pub(crate) tool_allowlist: Option<Vec<String>>,
    /// The NDJSON plane's run takes `UserMessage` and `EndInput` lines.
    pub(crate) interactive: bool,
    pub(crate) protocol: Protocol,
    pub(crate) posture: Posture,
    /// The sandbox of the agent's commands, as `--sandbox` gives it (the spec wins).
    pub(crate) sandbox: Option<crate::sandbox::Mode>,
}

/// An optional string field; `null` is absent.
fn string(map: &Map<String, Value>, key: &str) -> Result<Option<String>, String> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(format!(
            "`{key}` must be a string, not {}",
            crate::text::json_kind(other)
        )),
    }
}

/// One of `choices` (by its wire name), or the first when absent.
fn choice<T: Copy>(
    map: &Map<String, Value>,
    key: &str,
    choices: &[(&str, T)],
) -> Result<T, String> {
    let Some(name) = string(map, key)? else {
        return Ok(choices[0].1);
    };
    let names: Vec<&str> = choices.iter().map(|(n, _)| *n).collect();
    choices
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, v)| *v)
        .ok_or_else(|| format!("unknown {key} `{name}`: expected {}", names.join(" or ")))
}

/// Parses a spec. `tools` are the built-in tool names an allowlist may hold.
pub(crate) fn parse(text: &str, tools: &[&str]) -> Result<Spec, String> {
    if text.len() > MAX_SPEC_BYTES {
        return Err(format!("the spawn spec is over {MAX_SPEC_BYTES} bytes"));
    }
    let value: Value =
        serde_json::from_str(text).map_err(|e| format!("the spawn spec is not JSON: {e}"))?;
    let Value::Object(map) = value else {
        return Err(format!(
            "the spawn spec must be a JSON object, not {}",
            crate::text::json_kind(&value)
        ));
    };
    let unknown: Vec<String> = map
        .keys()
        .filter(|k| !FIELDS.contains(&k.as_str()))
        .map(|k| format!("`{k}`"))
        .collect();
    if !unknown.is_empty() {
        return Err(format!(
            "unknown field{} in the spawn spec: {}; expected {}",
            if unknown.len() == 1 { "" } else { "s" },
            unknown.join(", "),
            FIELDS.join(", ")
        ));
    }
    let interactive = match map.get("interactive") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(other) => {
            return Err(format!(
                "`interactive` must be a boolean, not {}",
                crate::text::json_kind(other)
            ));
        }
    };
    let tool_allowlist = match map.get("tool_allowlist") {
        None | Some(Value::Null) => None,
        Some(Value::Array(items)) => {
            let mut names = Vec::new();
            for item in items {
                let Value::String(name) = item else {
                    return Err(format!(
                        "`tool_allowlist` must hold tool names, not {}",
                        crate::text::json_kind(item)
                    ));
                };
                let mcp = crate::tools::mcp_name::is_allowlist_entry(name);
                if !mcp && !tools.contains(&name.as_str()) {
                    return Err(format!(
                        "unknown tool `{name}` in tool_allowlist: expected some of {}, or MCP \
                         tools as mcp__<server>__<tool> or mcp__<server>__*",
                        tools.join(", ")
                    ));
                }
                names.push(name.clone());
            }
            Some(names)
        }
        Some(other) => {
            return Err(format!(
                "`tool_allowlist` must be an array of tool names, not {}",
                crate::text::json_kind(other)
            ));
        }
    };
    let sandbox = match string(&map, "sandbox")? {
        None => None,
        Some(name) => Some(crate::sandbox::Mode::parse(&name).ok_or_else(|| {
            format!(
                "unknown sandbox `{name}`: expected {}",
                crate::sandbox::Mode::names()
            )
        })?),
    };
    let spec = Spec {
        label: string(&map, "label")?,
        initial_prompt: string(&map, "initial_prompt")?.unwrap_or_default(),
        model: string(&map, "model")?,
        provider: string(&map, "provider")?,
        tool_allowlist,
        interactive,
        protocol: choice(
            &map,
            "drive_protocol",
            &[("ndjson", Protocol::Ndjson), ("acp", Protocol::Acp)],
        )?,
        posture: choice(
            &map,
            "permission_posture",
            &[
                ("supervised", Posture::Supervised),
                ("unattended", Posture::Unattended),
            ],
        )?,
        sandbox,
    };
    match spec.protocol {
        Protocol::Ndjson if spec.initial_prompt.trim().is_empty() => {
            Err("the spawn spec has no initial_prompt: an ndjson agent's run starts from it".into())
        }
        Protocol::Acp if !spec.initial_prompt.trim().is_empty() => Err(
            "initial_prompt does not apply to drive_protocol acp: an ACP client sends its \
             prompts with session/prompt"
                .into(),
        ),
        _ => Ok(spec),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOOLS: [&str; 3] = ["Bash", "Read", "Write"];

    fn ok(text: &str) -> Spec {
        parse(text, &TOOLS).unwrap_or_else(|e| panic!("{text}: {e}"))
    }

    fn err(text: &str) -> String {
        parse(text, &TOOLS).expect_err(text)
    }

    #[test]
    fn a_spec_names_the_sandbox_of_its_commands() {
        let spec = ok(r#"{"initial_prompt": "p", "sandbox": "read-only"}"#);
        assert_eq!(spec.sandbox, Some(crate::sandbox::Mode::ReadOnly));
        assert_eq!(ok(r#"{"initial_prompt": "p"}"#).sandbox, None);
        assert_eq!(
            err(r#"{"initial_prompt": "p", "sandbox": "none"}"#),
            "unknown sandbox `none`: expected read-only, workspace-write, network or off"
        );
    }

    #[test]
    fn defaults_are_ndjson_supervised_and_not_interactive() {
        let spec = ok(r#"{"initial_prompt": "fix the build"}"#);
        assert_eq!(spec.protocol, Protocol::Ndjson);
        assert_eq!(spec.posture, Posture::Supervised);
        assert!(!spec.interactive);
        assert_eq!(spec.tool_allowlist, None);
        assert_eq!(spec.initial_prompt, "fix the build");
    }

    #[test]
    fn every_field_is_read() {
        let spec = ok(
            r#"{"label": "w1", "initial_prompt": "go", "model": "m", "provider":
            "openai", "tool_allowlist": ["Read", "Bash", "mcp__fs__*", "mcp__web__get"],
            "interactive": true,
            "drive_protocol": "ndjson", "permission_posture": "unattended"}"#,
        );
        assert_eq!(spec.label.as_deref(), Some("w1"));
        assert_eq!(spec.model.as_deref(), Some("m"));
        assert_eq!(spec.provider.as_deref(), Some("openai"));
        assert_eq!(
            spec.tool_allowlist,
            Some(
                ["Read", "Bash", "mcp__fs__*", "mcp__web__get"]
                    .map(str::to_owned)
                    .to_vec()
            )
        );
        assert!(spec.interactive);
        assert_eq!(spec.posture, Posture::Unattended);
        let acp = ok(r#"{"drive_protocol": "acp", "label": null, "initial_prompt": ""}"#);
        assert_eq!(acp.protocol, Protocol::Acp);
    }

    #[test]
    fn refusals_name_what_is_wrong() {
        for (text, needle) in [
            (
                r#"{"initial_prompt": "x", "isolation_worktree": true, "promt": 1}"#,
                "unknown fields in the spawn spec: `isolation_worktree`, `promt`",
            ),
            (
                r#"{"initial_prompt": 7}"#,
                "`initial_prompt` must be a string",
            ),
            (
                r#"{"initial_prompt": "x", "interactive": "yes"}"#,
                "`interactive` must be a boolean",
            ),
            (
                r#"{"initial_prompt": "x", "drive_protocol": "grpc"}"#,
                "unknown drive_protocol `grpc`: expected ndjson or acp",
            ),
            (
                r#"{"initial_prompt": "x", "permission_posture": "yolo"}"#,
                "unknown permission_posture `yolo`: expected supervised or unattended",
            ),
            (
                r#"{"initial_prompt": "x", "tool_allowlist": ["Read", "Curl"]}"#,
                "unknown tool `Curl` in tool_allowlist",
            ),
            (
                r#"{"initial_prompt": "x", "tool_allowlist": ["mcp__*"]}"#,
                "unknown tool `mcp__*` in tool_allowlist",
            ),
            (
                r#"{"initial_prompt": "x", "tool_allowlist": "Read"}"#,
                "must be an array of tool names",
            ),
            (r#"{"initial_prompt": "  "}"#, "has no initial_prompt"),
            (
                r#"{"drive_protocol": "acp", "initial_prompt": "x"}"#,
                "initial_prompt does not apply to drive_protocol acp",
            ),
            ("[1]", "must be a JSON object, not an array"),
            ("{", "not JSON"),
        ] {
            let e = err(text);
            assert!(e.contains(needle), "{text}: {e}");
        }
        let big = format!(r#"{{"initial_prompt": "{}"}}"#, "x".repeat(MAX_SPEC_BYTES));
        assert!(err(&big).contains("over"));
    }
}
