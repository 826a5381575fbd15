//! The ordered outbox: every frame for the client, in the order it must arrive. It is
//! written once the engine's batch is done, so a turn's updates always precede its
//! `session/prompt` answer, and an opening `tool_call` that is still unwritten when its input
//! is complete takes the input in (an editor draws the card once, with its input).

use std::collections::HashMap;

use serde_json::{Map, Value};

use crate::jsonrpc::{self, Message};

/// One frame waiting to be written.
enum Out {
    Frame(Message),
    Update {
        session: String,
        update: Value,
    },
    /// A streamed text chunk (`agent_message_chunk`, `agent_thought_chunk`): nearly every
    /// update of a prompt, written from its parts with no `Value` built for it.
    Chunk {
        session: String,
        kind: &'static str,
        text: String,
    },
}

/// Frames in the order they must reach the client.
#[derive(Default)]
pub(super) struct Outbox {
    items: Vec<Out>,
    /// Opening `tool_call`s not written yet, by (session, tool call id): the input can still
    /// join them.
    open: HashMap<(String, String), usize>,
}

impl Outbox {
    pub(super) fn frame(&mut self, message: Message) {
        self.items.push(Out::Frame(message));
    }

    pub(super) fn update(&mut self, session: &str, update: Value) {
        self.items.push(Out::Update {
            session: session.to_owned(),
            update,
        });
    }

    /// A `{"sessionUpdate": kind, "content": {"type": "text", "text": text}}` update.
    pub(super) fn chunk(&mut self, session: &str, kind: &'static str, text: &str) {
        self.items.push(Out::Chunk {
            session: session.to_owned(),
            kind,
            text: text.to_owned(),
        });
    }

    pub(super) fn open_card(&mut self, session: &str, tool: &str, update: Value) {
        self.open
            .insert((session.to_owned(), tool.to_owned()), self.items.len());
        self.update(session, update);
    }

    /// Adds `fields` to a still unwritten opening `tool_call`; false if it was written.
    pub(super) fn join_open_card(
        &mut self,
        session: &str,
        tool: &str,
        fields: &Map<String, Value>,
    ) -> bool {
        let key = (session.to_owned(), tool.to_owned());
        let Some(&at) = self.open.get(&key) else {
            return false;
        };
        let Some(Out::Update { update, .. }) = self.items.get_mut(at) else {
            return false;
        };
        let Some(obj) = update.as_object_mut() else {
            return false;
        };
        obj.extend(fields.clone());
        true
    }

    /// Appends every frame, in order, to `bytes`.
    pub(super) fn write_to(&mut self, bytes: &mut Vec<u8>) {
        self.open.clear();
        for item in self.items.drain(..) {
            match item {
                Out::Frame(message) => jsonrpc::write_line(bytes, &message),
                Out::Update { session, update } => {
                    jsonrpc::write_session_notification(bytes, "session/update", &session, |line| {
                        let _ = serde_json::to_writer(line, &update);
                    })
                }
                Out::Chunk {
                    session,
                    kind,
                    text,
                } => {
                    jsonrpc::write_session_notification(bytes, "session/update", &session, |line| {
                        // Keys in the order serde_json's sorted maps give them.
                        line.extend_from_slice(b"{\"content\":{\"text\":");
                        let _ = serde_json::to_writer(&mut *line, &text);
                        line.extend_from_slice(b",\"type\":\"text\"},\"sessionUpdate\":");
                        let _ = serde_json::to_writer(&mut *line, kind);
                        line.push(b'}');
                    })
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_chunk_is_written_as_its_update_value_would_be() {
        let text = "a \"quoted\" line\n\u{1} é";
        let mut out = Outbox::default();
        out.chunk("sess-1", "agent_thought_chunk", text);
        let mut bytes = Vec::new();
        out.write_to(&mut bytes);
        let want = jsonrpc::to_line(&jsonrpc::notification(
            "session/update",
            json!({"sessionId": "sess-1", "update": {"sessionUpdate": "agent_thought_chunk",
                   "content": {"type": "text", "text": text}}}),
        ));
        assert_eq!(
            String::from_utf8(bytes).unwrap(),
            String::from_utf8(want).unwrap()
        );
    }

    #[test]
    fn an_open_card_takes_its_input_until_written() {
        let mut out = Outbox::default();
        out.open_card(
            "s",
            "t",
            json!({"sessionUpdate": "tool_call", "toolCallId": "t"}),
        );
        let mut fields = Map::new();
        fields.insert("rawInput".into(), json!({"a": 1}));
        assert!(out.join_open_card("s", "t", &fields));
        let mut bytes = Vec::new();
        out.write_to(&mut bytes);
        let frame: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(frame["params"]["update"]["rawInput"], json!({"a": 1}));
        assert!(!out.join_open_card("s", "t", &fields));
    }
}
