//! Streamed tool input: the `partial_json` fragments of a `tool_use` block, gathered until
//! the call is complete, under one cap. The run gathers them to execute the call, and every
//! host that shows calls (print mode's `tool_use` frames, ACP's `rawInput`) follows the same
//! stream; they share this type so the cap, and what happens past it, are decided once.
//!
//! `ToolInput` is one call's input; `ToolInputs` holds a turn's calls by tool-use id, for a
//! host that follows `TurnEvent`s (which name calls by id). The run keys its blocks by
//! stream index instead, so that a repeated id (which it refuses) never merges two inputs.

use serde_json::Value;

/// Where the model's `tool_use` inputs stop being trusted: larger inputs are refused.
pub const MAX_TOOL_INPUT_BYTES: usize = 4 * 1024 * 1024;

/// One call's streamed input, at most `MAX_TOOL_INPUT_BYTES` of it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct ToolInput {
    text: String,
    /// The stream passed the cap; appending stopped for good, so what is kept is a clean
    /// prefix of the stream and a truncated input can never be spliced back into valid JSON.
    overflowed: bool,
}

impl ToolInput {
    /// Appends the next fragment, unless the input is over the cap (now or before).
    pub(crate) fn push(&mut self, fragment: &str) {
        if self.overflowed || self.text.len() + fragment.len() > MAX_TOOL_INPUT_BYTES {
            self.overflowed = true;
        } else {
            self.text.push_str(fragment);
        }
    }

    /// What was kept of the stream: all of it, or the prefix before the cap.
    pub(crate) fn text(&self) -> &str {
        &self.text
    }

    pub(crate) fn overflowed(&self) -> bool {
        self.overflowed
    }

    /// The call's input as the run executes it. Streamed input is only JSON once complete;
    /// an empty stream means `{}`. Input over the cap, input that does not parse (a truncated
    /// stream, a confused local model) and JSON that is not an object are refused with a text
    /// for the model, rather than a crash or a call with made-up arguments.
    pub(crate) fn parse(&self) -> Result<Value, String> {
        if self.overflowed {
            return Err(format!(
                "tool input exceeds {MAX_TOOL_INPUT_BYTES} bytes; the call was not executed"
            ));
        }
        if self.text.trim().is_empty() {
            return Ok(Value::Object(Default::default()));
        }
        match serde_json::from_str::<Value>(&self.text) {
            Ok(value @ Value::Object(_)) => Ok(value),
            Ok(_) => Err("tool input must be a JSON object".to_owned()),
            Err(err) => Err(format!(
                "tool input is not valid JSON ({err}); the call was not executed"
            )),
        }
    }
}

/// A call whose input is streaming, as `ToolInputs` holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct StreamedCall {
    pub(crate) id: String,
    pub(crate) name: String,
    pub(crate) input: ToolInput,
}

/// The calls of a turn whose inputs are streaming, in call order, each input capped.
#[derive(Clone, Debug, Default)]
pub(crate) struct ToolInputs {
    calls: Vec<StreamedCall>,
}

impl ToolInputs {
    /// A call started (`TurnEvent::ToolCallStart`).
    pub(crate) fn start(&mut self, id: &str, name: &str) {
        self.calls.push(StreamedCall {
            id: id.to_owned(),
            name: name.to_owned(),
            input: ToolInput::default(),
        });
    }

    /// A fragment of a call's input (`TurnEvent::ToolCallInputDelta`). It goes to the first
    /// call with that id; a fragment for an id that never started is dropped.
    pub(crate) fn push(&mut self, id: &str, fragment: &str) {
        if let Some(call) = self.calls.iter_mut().find(|call| call.id == id) {
            call.input.push(fragment);
        }
    }

    /// Every call so far, in call order, leaving none.
    pub(crate) fn take(&mut self) -> Vec<StreamedCall> {
        std::mem::take(&mut self.calls)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn gathers_fragments_into_the_input() {
        let mut input = ToolInput::default();
        assert_eq!(
            input.parse(),
            Ok(json!({})),
            "an empty stream means no arguments"
        );
        for fragment in [r#"{"pa"#, r#"th": "#, r#""a.rs"}"#] {
            input.push(fragment);
        }
        assert_eq!(input.text(), r#"{"path": "a.rs"}"#);
        assert!(!input.overflowed());
        assert_eq!(input.parse(), Ok(json!({"path": "a.rs"})));
    }

    #[test]
    fn refuses_what_is_not_an_object() {
        let parse = |text: &str| {
            let mut input = ToolInput::default();
            input.push(text);
            input.parse()
        };
        assert_eq!(parse("  "), Ok(json!({})));
        assert_eq!(
            parse("[1]"),
            Err("tool input must be a JSON object".to_owned())
        );
        let truncated = parse(r#"{"path": "unterminated"#).unwrap_err();
        assert!(
            truncated.starts_with("tool input is not valid JSON (")
                && truncated.ends_with("); the call was not executed"),
            "{truncated}"
        );
    }

    #[test]
    fn the_cap_holds_and_what_is_kept_is_a_prefix() {
        let mut input = ToolInput::default();
        let head = "A".repeat(MAX_TOOL_INPUT_BYTES - 10);
        input.push(&head);
        input.push("0123456789");
        assert_eq!(
            input.text().len(),
            MAX_TOOL_INPUT_BYTES,
            "exactly the cap fits"
        );
        assert!(!input.overflowed());
        input.push("x");
        assert!(input.overflowed());
        // Nothing more is kept, even a fragment that would fit: no gap is ever spliced over.
        let mut input = ToolInput::default();
        input.push(&head);
        input.push(&"B".repeat(11));
        input.push("C");
        assert_eq!(input.text(), head);
        assert!(input.overflowed());
        assert_eq!(
            input.parse(),
            Err(format!(
                "tool input exceeds {MAX_TOOL_INPUT_BYTES} bytes; the call was not executed"
            ))
        );
    }

    #[test]
    fn inputs_by_id_in_call_order() {
        let mut inputs = ToolInputs::default();
        inputs.start("t1", "Read");
        inputs.start("t2", "Bash");
        inputs.push("t2", r#"{"command":"#);
        inputs.push("t1", r#"{"path":"a"}"#);
        inputs.push("t2", r#""ls"}"#);
        inputs.push("nobody", "{}");
        let calls = inputs.take();
        let seen: Vec<(&str, &str, &str)> = calls
            .iter()
            .map(|call| (call.id.as_str(), call.name.as_str(), call.input.text()))
            .collect();
        assert_eq!(
            seen,
            [
                ("t1", "Read", r#"{"path":"a"}"#),
                ("t2", "Bash", r#"{"command":"ls"}"#)
            ]
        );
        assert!(inputs.take().is_empty(), "take leaves none");
    }

    #[test]
    fn each_input_has_its_own_cap() {
        let mut inputs = ToolInputs::default();
        inputs.start("big", "Write");
        inputs.start("small", "Read");
        inputs.push("big", &"A".repeat(MAX_TOOL_INPUT_BYTES));
        inputs.push("big", "B");
        inputs.push("small", r#"{"path":"a"}"#);
        let calls = inputs.take();
        assert!(calls[0].input.overflowed());
        assert_eq!(calls[0].input.text().len(), MAX_TOOL_INPUT_BYTES);
        assert!(!calls[1].input.overflowed());
        assert_eq!(calls[1].input.parse(), Ok(serde_json::json!({"path": "a"})));
    }
}
