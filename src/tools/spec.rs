//! The tool specs offered to the model: name, description and JSON Schema input of each
//! built-in tool, with names and fields as upstream (`path`, not `file_path`).
//!
//! Each spec lives beside its tool's implementation (`tools::fs`, `tools::bash`), where the
//! limits its description quotes are enforced; the table (`tools::table`) says which tools
//! there are and in what order. This module gathers them and holds what every schema shares.

use std::time::Duration;

use serde_json::{Value, json};

use crate::model::types::ToolSpec;
use crate::tools::ToolOutput;
use crate::tools::table;

/// Every built-in tool, in the order they are offered.
pub fn all() -> Vec<ToolSpec> {
    table::specs()
}

/// A closed object schema: unknown fields are not allowed.
pub(crate) fn closed_object(properties: Value, required: &[&str]) -> Value {
    json!({
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": false,
    })
}

/// A `timeout_seconds` field: `default` when absent or null, else an integer from 1 to
/// `max`. The error is the tool's result for the model.
pub(crate) fn timeout_seconds(
    input: &Value,
    tool: &str,
    default: Duration,
    max: u64,
) -> Result<Duration, ToolOutput> {
    match input.get("timeout_seconds") {
        None | Some(Value::Null) => Ok(default),
        Some(v) => match v.as_u64() {
            Some(s) if (1..=max).contains(&s) => Ok(Duration::from_secs(s)),
            _ => Err(ToolOutput::error(format!(
                "{tool}: `timeout_seconds` must be an integer from 1 to {max}"
            ))),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_lists_the_tools_in_order() {
        let specs = all();
        let names: Vec<&str> = specs.iter().map(|spec| spec.name.as_ref()).collect();
        assert_eq!(
            names,
            [
                "Bash",
                "BashOutput",
                "KillShell",
                "Read",
                "Write",
                "Edit",
                "MultiEdit",
                "Glob",
                "Grep",
                "WebFetch",
                "TodoWrite"
            ]
        );
    }

    #[test]
    fn schemas_are_closed_objects_with_described_properties() {
        for spec in all() {
            let schema = &spec.input_schema;
            assert_eq!(schema["type"], "object", "{}", spec.name);
            assert_eq!(schema["additionalProperties"], false, "{}", spec.name);
            let properties = schema["properties"]
                .as_object()
                .unwrap_or_else(|| panic!("{}: properties is not an object", spec.name));
            for (key, property) in properties {
                let described = property["description"].as_str().unwrap_or_default();
                assert!(
                    !described.is_empty(),
                    "{}.{key} has no description",
                    spec.name
                );
                assert!(
                    property["type"].is_string(),
                    "{}.{key} has no type",
                    spec.name
                );
            }
            let required = schema["required"]
                .as_array()
                .unwrap_or_else(|| panic!("{}: required is not an array", spec.name));
            assert!(!required.is_empty(), "{}", spec.name);
            for key in required {
                let key = key.as_str().unwrap_or_default();
                assert!(
                    properties.contains_key(key),
                    "{}: `{key}` required but not defined",
                    spec.name
                );
            }
            assert!(!spec.description.is_empty());
            assert!(
                !spec.description.contains("  "),
                "{}: stray double space",
                spec.name
            );
        }
    }

    #[test]
    fn fields_match_upstream() {
        let fields = |name: &str| -> (Vec<String>, Vec<String>) {
            let spec = all()
                .into_iter()
                .find(|spec| spec.name == name)
                .unwrap_or_else(|| panic!("no spec for {name}"));
            let mut properties: Vec<String> = spec.input_schema["properties"]
                .as_object()
                .map(|props| props.keys().cloned().collect())
                .unwrap_or_default();
            properties.sort();
            let required = spec.input_schema["required"]
                .as_array()
                .map(|keys| {
                    keys.iter()
                        .filter_map(|k| k.as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default();
            (properties, required)
        };
        let strings = |keys: &[&str]| keys.iter().map(|key| key.to_string()).collect::<Vec<_>>();
        assert_eq!(
            fields("Read"),
            (strings(&["limit", "offset", "path"]), strings(&["path"]))
        );
        assert_eq!(
            fields("Write"),
            (strings(&["content", "path"]), strings(&["path", "content"]))
        );
        assert_eq!(
            fields("Edit"),
            (
                strings(&["new_string", "old_string", "path", "replace_all"]),
                strings(&["path", "old_string", "new_string"])
            )
        );
        assert_eq!(
            fields("Glob"),
            (strings(&["path", "pattern"]), strings(&["pattern"]))
        );
        assert_eq!(
            fields("Grep"),
            (
                strings(&["include", "max_matches", "path", "pattern"]),
                strings(&["pattern"])
            )
        );
        assert_eq!(
            fields("Bash"),
            (
                strings(&["background", "command", "cwd", "timeout_seconds"]),
                strings(&["command"])
            )
        );
        assert_eq!(
            fields("MultiEdit"),
            (strings(&["edits", "path"]), strings(&["path", "edits"]))
        );
        assert_eq!(
            fields("BashOutput"),
            (
                strings(&["shell_id", "since_offset"]),
                strings(&["shell_id"])
            )
        );
        assert_eq!(
            fields("KillShell"),
            (strings(&["shell_id"]), strings(&["shell_id"]))
        );
        assert_eq!(
            fields("TodoWrite"),
            (strings(&["todos"]), strings(&["todos"]))
        );
        assert_eq!(
            fields("WebFetch"),
            (
                strings(&["prompt", "timeout_seconds", "url"]),
                strings(&["url"])
            )
        );
    }
}
