//! Typed scripts for `caliban stub-model` (its format is documented in `src/stub_model.rs`):
//! a turn is built from what the test means (a text answer, a tool call, a fault) and
//! becomes the JSON the stub reads only at the end, so the usage every test relies on is
//! spelled once and a misspelled field fails to compile instead of failing the stub's parse.

use serde_json::{Map, Value, json};

/// The usage of a text turn unless the test says otherwise.
const TEXT_USAGE: Usage = Usage {
    input: 12,
    output: 5,
};
/// The usage of a tool-calling turn unless the test says otherwise.
const CALL_USAGE: Usage = Usage {
    input: 20,
    output: 8,
};

#[derive(Clone, Copy, Debug)]
struct Usage {
    input: u64,
    output: u64,
}

/// One tool call a turn makes.
#[derive(Clone, Debug)]
pub struct Call {
    /// None leaves the id to the stub (`toolu_stub_<R>_<I>`).
    id: Option<String>,
    name: String,
    input: Value,
}

impl Call {
    pub fn new(id: &str, name: &str, input: Value) -> Call {
        Call {
            id: Some(id.to_owned()),
            name: name.to_owned(),
            input,
        }
    }

    /// A call the stub numbers itself.
    pub fn without_id(name: &str, input: Value) -> Call {
        Call {
            id: None,
            name: name.to_owned(),
            input,
        }
    }

    pub fn bash(id: &str, command: &str) -> Call {
        Call::new(id, "Bash", json!({ "command": command }))
    }

    pub fn read(id: &str, path: &str) -> Call {
        Call::new(id, "Read", json!({ "path": path }))
    }

    pub fn json(&self) -> Value {
        let mut call = json!({"name": self.name, "input": self.input});
        if let Some(id) = &self.id {
            call["id"] = json!(id);
        }
        call
    }
}

/// How a turn ends, when not the stub's default (`tool_use` with calls, else `end_turn`).
#[derive(Clone, Copy, Debug)]
pub enum Stop {
    EndTurn,
    ToolUse,
    MaxTokens,
    Refusal,
}

impl Stop {
    fn name(self) -> &'static str {
        match self {
            Stop::EndTurn => "end_turn",
            Stop::ToolUse => "tool_use",
            Stop::MaxTokens => "max_tokens",
            Stop::Refusal => "refusal",
        }
    }
}

/// What the stub does wrong to one request that reaches the turn.
#[derive(Clone, Debug)]
pub enum Fault {
    /// That HTTP status with the provider's error envelope.
    Status(u16),
    /// That HTTP status with the envelope and a `retry-after` header of this text.
    StatusRetryAfter(u16, String),
    /// That HTTP status with this body in place of the envelope.
    StatusBody(u16, String),
    /// Close the connection before a byte of response.
    HangUp,
    /// Wait this many ms before the first response byte.
    DelayMs(u64),
    /// This many ms between SSE events.
    DripMs(u64),
    /// Serve the whole turn, then close the keep-alive connection.
    CloseAfter,
    /// Close the socket after this many SSE events.
    DropAfterEvents(u64),
    /// Go silent after this many SSE events, the socket left open.
    StallAfterEvents(u64),
    /// Only keep-alives after this many SSE events.
    PingAfterEvents(u64),
    /// The last of this many SSE events again and again.
    RepeatAfterEvents(u64),
}

impl Fault {
    pub fn json(&self) -> Value {
        match self {
            Fault::Status(status) => json!({ "status": status }),
            Fault::StatusRetryAfter(status, after) => {
                json!({"status": status, "retry_after": after})
            }
            Fault::StatusBody(status, body) => json!({"status": status, "body": body}),
            Fault::HangUp => json!({"hang_up": true}),
            Fault::DelayMs(ms) => json!({ "delay_ms": ms }),
            Fault::DripMs(ms) => json!({ "drip_ms": ms }),
            Fault::CloseAfter => json!({"close_after": true}),
            Fault::DropAfterEvents(n) => json!({ "drop_after_events": n }),
            Fault::StallAfterEvents(n) => json!({ "stall_after_events": n }),
            Fault::PingAfterEvents(n) => json!({ "ping_after_events": n }),
            Fault::RepeatAfterEvents(n) => json!({ "repeat_after_events": n }),
        }
    }
}

/// One model turn of a script.
#[derive(Clone, Debug, Default)]
pub struct Turn {
    thinking: Option<String>,
    text: Option<String>,
    calls: Vec<Call>,
    usage: Option<Usage>,
    stop: Option<Stop>,
    faults: Vec<Fault>,
    /// Never used up: it answers every request that reaches it.
    reuse: bool,
}

impl Turn {
    /// A turn with nothing in it and no usage, for the setters below to fill.
    pub fn bare() -> Turn {
        Turn::default()
    }

    /// An answer in text, with the usual small usage.
    pub fn text(text: &str) -> Turn {
        Turn {
            text: Some(text.to_owned()),
            usage: Some(TEXT_USAGE),
            ..Turn::default()
        }
    }

    /// Calls made at once, with the usual tool-turn usage.
    pub fn calls(calls: impl IntoIterator<Item = Call>) -> Turn {
        Turn {
            calls: calls.into_iter().collect(),
            usage: Some(CALL_USAGE),
            ..Turn::default()
        }
    }

    /// A turn of one call.
    pub fn call(id: &str, name: &str, input: Value) -> Turn {
        Turn::calls([Call::new(id, name, input)])
    }

    /// A turn of one Bash call.
    pub fn bash(id: &str, command: &str) -> Turn {
        Turn::calls([Call::bash(id, command)])
    }

    /// Text streamed in the turn (before its calls, if any).
    pub fn say(mut self, text: &str) -> Turn {
        self.text = Some(text.to_owned());
        self
    }

    /// A thinking block before the text.
    pub fn think(mut self, thinking: &str) -> Turn {
        self.thinking = Some(thinking.to_owned());
        self
    }

    /// More calls, after those the turn already makes.
    pub fn calling(mut self, calls: impl IntoIterator<Item = Call>) -> Turn {
        self.calls.extend(calls);
        self
    }

    pub fn usage(mut self, input: u64, output: u64) -> Turn {
        self.usage = Some(Usage { input, output });
        self
    }

    /// No `usage` field: the stub estimates it from the bytes.
    pub fn no_usage(mut self) -> Turn {
        self.usage = None;
        self
    }

    pub fn stop(mut self, stop: Stop) -> Turn {
        self.stop = Some(stop);
        self
    }

    /// Faults for the next requests that reach this turn, one each, in order.
    pub fn fault(mut self, fault: Fault) -> Turn {
        self.faults.push(fault);
        self
    }

    /// The turn answers every request that reaches it, never used up.
    pub fn reuse(mut self) -> Turn {
        self.reuse = true;
        self
    }

    pub fn json(&self) -> Value {
        let mut turn = Map::new();
        if let Some(thinking) = &self.thinking {
            turn.insert("thinking".into(), json!(thinking));
        }
        if let Some(text) = &self.text {
            turn.insert("text".into(), json!(text));
        }
        if !self.calls.is_empty() {
            let calls = self.calls.iter().map(Call::json).collect();
            turn.insert("tool_calls".into(), Value::Array(calls));
        }
        if let Some(usage) = self.usage {
            turn.insert(
                "usage".into(),
                json!({"input_tokens": usage.input, "output_tokens": usage.output}),
            );
        }
        if let Some(stop) = self.stop {
            turn.insert("stop_reason".into(), json!(stop.name()));
        }
        if !self.faults.is_empty() {
            let faults = self.faults.iter().map(Fault::json).collect();
            turn.insert("faults".into(), Value::Array(faults));
        }
        if self.reuse {
            turn.insert("reuse".into(), json!(true));
        }
        Value::Object(turn)
    }
}

impl From<Turn> for Value {
    fn from(turn: Turn) -> Value {
        turn.json()
    }
}

/// A whole script: the turns in order, and whether the last one answers forever.
#[derive(Clone, Debug)]
pub struct Script {
    turns: Vec<Turn>,
    repeat_last: bool,
}

impl Script {
    pub fn new(turns: impl IntoIterator<Item = Turn>) -> Script {
        Script {
            turns: turns.into_iter().collect(),
            repeat_last: false,
        }
    }

    /// The last turn replays to every request once the others are used up.
    pub fn repeat_last(mut self) -> Script {
        self.repeat_last = true;
        self
    }

    pub fn json(&self) -> Value {
        let turns: Vec<Value> = self.turns.iter().map(Turn::json).collect();
        let mut script = json!({ "turns": turns });
        if self.repeat_last {
            script["repeat_last"] = json!(true);
        }
        script
    }
}

/// The script of these turns, as the stub reads it.
pub fn script(turns: impl IntoIterator<Item = Turn>) -> Value {
    Script::new(turns).json()
}

/// One turn making `calls` at once, then a closing answer.
pub fn calls_then_done(calls: impl IntoIterator<Item = Call>) -> Value {
    script([Turn::calls(calls), Turn::text("done")])
}
