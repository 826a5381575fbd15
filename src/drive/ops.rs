//! Drive operations as clients send them: the one decoder of run, poll, status, send-input,
//! permit and cancel requests, shared by the HTTP API (request bodies) and the MCP server
//! (tool arguments), so the two surfaces cannot drift apart in what they accept.
//!
//! Decoding is pure: a JSON object in, an `Op` (or the fields of one) or one `OpError` out.
//! Where the surfaces deliberately differ, they say so in their `Dialect`; there is no other
//! per-surface path. A run id stays the client's text here: the surface resolves it with
//! `DriveCore::resolve` where it would use it, so an unknown run is reported where it is
//! today. Each surface puts an `OpError` in its own envelope (HTTP status and `{"error":…}`,
//! MCP `-32602` or an `isError` result); its `Display` is the exact text that envelope
//! carries.

use std::fmt;
use std::path::PathBuf;
use std::sync::LazyLock;

use serde::de::{Deserialize, Error as _, Unexpected};
use serde_json::{Map, Value};

use crate::drive::table::{Inbound, RunSpec};
use crate::model::types::ContentBlock;
use crate::permissions::{Action, Mode, Rule, RuleSource};

/// The operations a client can ask for (MCP names them by tool, HTTP by route).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OpKind {
    Run,
    Poll,
    Status,
    SendInput,
    Permit,
    Cancel,
}

impl OpKind {
    /// The title of the operation's argument schema in the MCP tool list: upstream's argument
    /// struct, which serde names when the arguments are not an object.
    pub(crate) fn args_title(self) -> &'static str {
        match self {
            OpKind::Run => "RunArgs",
            OpKind::Poll => "PollArgs",
            OpKind::Status => "StatusArgs",
            OpKind::SendInput => "SendInputArgs",
            OpKind::Permit => "PermitArgs",
            OpKind::Cancel => "CancelArgs",
        }
    }
}

/// A decoded operation; `run_id` is the client's text, not yet resolved.
#[derive(Debug)]
pub(crate) enum Op {
    Run(RunSpec),
    Poll {
        run_id: String,
        cursor: u64,
        wait_ms: u64,
    },
    Status {
        run_id: String,
    },
    SendInput {
        run_id: String,
        input: Inbound,
    },
    Permit {
        run_id: String,
        answer: Answer,
    },
    Cancel {
        run_id: String,
    },
}

impl Op {
    /// The run the operation names (every one but `Run`).
    pub(crate) fn run_id(&self) -> Option<&str> {
        match self {
            Op::Run(_) => None,
            Op::Poll { run_id, .. }
            | Op::Status { run_id }
            | Op::SendInput { run_id, .. }
            | Op::Permit { run_id, .. }
            | Op::Cancel { run_id } => Some(run_id),
        }
    }
}

/// An answer to a run's surfaced permission prompt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Answer {
    pub tool_use_id: String,
    pub allow: bool,
    pub reason: Option<String>,
}

/// How one surface decodes operations: the deliberate differences between the surfaces, and
/// nothing else.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Dialect {
    pub style: Style,
    /// A run request may carry `allow` rules. They are safe on any surface: a run's rules
    /// only build a `Policy::narrowed` profile, which takes the stricter of the server's
    /// decision and its own, and whose own rules end in `*` → allow anyway, so an allow rule
    /// there can neither widen a decision nor change its action. What differs is the
    /// published input: the HTTP API documents `allow` (`openapi.json`) and refuses a bad
    /// pattern in it, while `caliban_run`'s schema (kept as it is) has no `allow`, so over MCP
    /// it is an unknown argument, ignored like any other (serde's default).
    pub allow_rules: bool,
}

/// How fields are read and refusals worded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Style {
    /// As serde derive reads upstream's argument structs, which is what rmcp's
    /// `Parameters<T>` answers with: `null` stands for an absent optional string or list
    /// only, and errors are serde's texts (they name the value, not the field).
    Serde,
    /// Our HTTP bodies: `null` stands for any absent optional field, errors name the field,
    /// and upstream's HTTP text for input with neither `text` nor `end`.
    Plain,
}

impl Dialect {
    /// Tool arguments must be refused exactly as upstream's MCP server refuses them.
    pub(crate) const MCP: Dialect = Dialect {
        style: Style::Serde,
        allow_rules: false,
    };
    /// Our own bodies, as `openapi.json` documents them.
    pub(crate) const HTTP: Dialect = Dialect {
        style: Style::Plain,
        allow_rules: true,
    };
}

/// What a field should have held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Expected {
    String,
    Boolean,
    /// A non-negative integer (`usize` to serde).
    Count,
    /// An array of strings.
    Strings,
}

/// What is wrong with an operation's arguments. `serde` is serde's own refusal, the text the
/// serde style shows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Problem {
    /// The arguments are not a JSON object; `found` names what they are.
    NotObject {
        found: String,
        serde: String,
    },
    Missing {
        field: &'static str,
    },
    /// A value serde would not take as the field's type (a negative count included).
    WrongType {
        field: &'static str,
        expected: Expected,
        serde: String,
    },
    UnknownMode {
        value: String,
    },
    UnknownSandbox {
        value: String,
    },
    /// A rule pattern in `deny`, `ask` or `allow` that does not parse.
    BadRule {
        field: &'static str,
        error: String,
    },
    /// Input with neither `text` nor `end: true`.
    NoInput,
    /// An entry of `images` the model could not take (type, size, not base64, not an
    /// image block).
    BadImage {
        error: String,
    },
}

/// Why an operation was refused before it reached the drive core.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct OpError {
    pub problem: Problem,
    style: Style,
}

impl fmt::Display for OpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let serde = self.style == Style::Serde;
        match &self.problem {
            Problem::Missing { field } => write!(f, "{}", serde_json::Error::missing_field(field)),
            Problem::NotObject { serde: error, .. } if serde => f.write_str(error),
            Problem::NotObject { found, .. } => write!(f, "expected a JSON object, not {found}"),
            Problem::WrongType { serde: error, .. } if serde => f.write_str(error),
            Problem::WrongType {
                field, expected, ..
            } => {
                let expected = match expected {
                    Expected::String => "a string",
                    Expected::Boolean => "a boolean",
                    Expected::Count => "a non-negative integer",
                    Expected::Strings => "an array of strings",
                };
                write!(f, "`{field}` must be {expected}")
            }
            Problem::UnknownMode { value } if serde => {
                static NAMES: LazyLock<Vec<&str>> =
                    LazyLock::new(|| Mode::ALL.iter().map(|m| m.as_str()).collect());
                write!(f, "{}", serde_json::Error::unknown_variant(value, &NAMES))
            }
            Problem::UnknownMode { value } => {
                let names: Vec<&str> = Mode::ALL.iter().map(|m| m.as_str()).collect();
                let (last, rest) = names.split_last().expect("there are modes");
                write!(
                    f,
                    "invalid permission_mode `{value}`: expected {} or {last}",
                    rest.join(", ")
                )
            }
            Problem::UnknownSandbox { value } if serde => {
                static NAMES: LazyLock<Vec<&str>> = LazyLock::new(|| {
                    crate::sandbox::Mode::ALL
                        .iter()
                        .map(|m| m.as_str())
                        .collect()
                });
                write!(f, "{}", serde_json::Error::unknown_variant(value, &NAMES))
            }
            Problem::UnknownSandbox { value } => write!(
                f,
                "invalid sandbox `{value}`: expected {}",
                crate::sandbox::Mode::names()
            ),
            Problem::BadRule { field, error } if serde => write!(f, "`{field}`: {error}"),
            Problem::BadRule { error, .. } => f.write_str(error),
            Problem::BadImage { error } => write!(f, "`images`: {error}"),
            // Upstream's texts, which name the operation as each surface's clients know it.
            Problem::NoInput if serde => f.write_str("send_input requires `text` or `end: true`"),
            Problem::NoInput => f.write_str("input requires `text` or `end: true`"),
        }
    }
}

/// A JSON value as serde sees it in an `invalid type` error (serde_json names `Unit` null).
fn unexpected(value: &Value) -> Unexpected<'_> {
    match value {
        Value::Null => Unexpected::Unit,
        Value::Bool(b) => Unexpected::Bool(*b),
        Value::Number(n) => match (n.as_u64(), n.as_i64()) {
            (Some(n), _) => Unexpected::Unsigned(n),
            (None, Some(n)) => Unexpected::Signed(n),
            (None, None) => Unexpected::Float(n.as_f64().unwrap_or(f64::NAN)),
        },
        Value::String(s) => Unexpected::Str(s),
        Value::Array(_) => Unexpected::Seq,
        Value::Object(_) => Unexpected::Map,
    }
}

/// What a value is, in the words of our own (plain) refusals: serde's nouns, a string as JSON.
fn kind(value: &Value) -> String {
    match value {
        Value::Null => "null".to_owned(),
        Value::Number(n) if n.is_f64() => format!("floating point `{n}`"),
        Value::String(_) => format!("string {value}"),
        other => unexpected(other).to_string(),
    }
}

/// An operation's arguments, read in one dialect.
struct Fields<'a> {
    map: &'a Map<String, Value>,
    dialect: Dialect,
}

impl<'a> Fields<'a> {
    fn new(args: &'a Value, op: OpKind, dialect: Dialect) -> Result<Fields<'a>, OpError> {
        match args {
            Value::Object(map) => Ok(Fields { map, dialect }),
            other => {
                let expected = format!("struct {}", op.args_title());
                let serde = serde_json::Error::invalid_type(unexpected(other), &expected.as_str());
                Err(OpError {
                    problem: Problem::NotObject {
                        found: kind(other),
                        serde: serde.to_string(),
                    },
                    style: dialect.style,
                })
            }
        }
    }

    fn error(&self, problem: Problem) -> OpError {
        OpError {
            problem,
            style: self.dialect.style,
        }
    }

    /// `value` as the field's type, read by serde: a refusal carries serde's own text, as
    /// rmcp's `Parameters<T>` would answer with it.
    fn typed<T: Deserialize<'a>>(
        &self,
        field: &'static str,
        expected: Expected,
        value: &'a Value,
    ) -> Result<T, OpError> {
        T::deserialize(value).map_err(|e| {
            self.error(Problem::WrongType {
                field,
                expected,
                serde: e.to_string(),
            })
        })
    }

    /// An optional scalar: `null` is absent only in the plain style (serde refuses `null`
    /// for a defaulted `bool` or `usize`).
    fn optional(&self, key: &str) -> Option<&'a Value> {
        let value = self.map.get(key);
        match self.dialect.style {
            Style::Serde => value,
            Style::Plain => value.filter(|v| !v.is_null()),
        }
    }

    fn string(&self, key: &'static str) -> Result<String, OpError> {
        match self.map.get(key) {
            None => Err(self.error(Problem::Missing { field: key })),
            Some(value) => self.typed(key, Expected::String, value),
        }
    }

    fn opt_string(&self, key: &'static str) -> Result<Option<String>, OpError> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(value) => self.typed(key, Expected::String, value).map(Some),
        }
    }

    fn bool(&self, key: &'static str) -> Result<bool, OpError> {
        match self.map.get(key) {
            None => Err(self.error(Problem::Missing { field: key })),
            Some(value) => self.typed(key, Expected::Boolean, value),
        }
    }

    fn flag(&self, key: &'static str) -> Result<bool, OpError> {
        match self.optional(key) {
            None => Ok(false),
            Some(value) => self.typed(key, Expected::Boolean, value),
        }
    }

    /// A count defaulting to 0 (upstream's `usize`, which is what serde names).
    fn count(&self, key: &'static str) -> Result<u64, OpError> {
        match self.optional(key) {
            None => Ok(0),
            Some(value) => self
                .typed::<usize>(key, Expected::Count, value)
                .map(|n| n as u64),
        }
    }

    /// A list of strings; `null` is an empty one in either style.
    fn strings(&self, key: &'static str) -> Result<Vec<String>, OpError> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(Vec::new()),
            Some(value) => self.typed(key, Expected::Strings, value),
        }
    }

    /// `images`: image blocks in upstream's shape; absent or `null` is none.
    fn images(&self) -> Result<Vec<ContentBlock>, OpError> {
        match self.map.get("images") {
            None | Some(Value::Null) => Ok(Vec::new()),
            Some(Value::Array(blocks)) => ContentBlock::images_from_json(blocks)
                .map_err(|error| self.error(Problem::BadImage { error })),
            Some(other) => Err(self.error(Problem::BadImage {
                error: format!("expected an array of image blocks, not {}", kind(other)),
            })),
        }
    }

    // Each operation reads its fields in the order of upstream's argument struct, the order
    // the MCP server has always checked them in, so which of several faults it names stays.

    fn run_spec(&self) -> Result<RunSpec, OpError> {
        let prompt = self.string("prompt")?;
        let interactive = self.flag("interactive")?;
        let cwd = self.opt_string("cwd")?.map(PathBuf::from);
        let model = self.opt_string("model")?;
        let permission_mode = match self.opt_string("permission_mode")? {
            None => None,
            Some(value) => Some(
                Mode::parse(&value).ok_or_else(|| self.error(Problem::UnknownMode { value }))?,
            ),
        };
        let mut kinds = vec![("deny", Action::Deny), ("ask", Action::Ask)];
        if self.dialect.allow_rules {
            kinds.push(("allow", Action::Allow));
        }
        let mut rules = Vec::new();
        for (field, action) in kinds {
            for pattern in self.strings(field)? {
                let rule = Rule::new(&pattern, action, None, RuleSource::Session).map_err(|e| {
                    self.error(Problem::BadRule {
                        field,
                        error: e.to_string(),
                    })
                })?;
                rules.push(rule);
            }
        }
        let images = self.images()?;
        // Not upstream's: read after its fields, so which of several faults is named stays.
        let sandbox = match self.opt_string("sandbox")? {
            None => None,
            Some(value) => Some(
                crate::sandbox::Mode::parse(&value)
                    .ok_or_else(|| self.error(Problem::UnknownSandbox { value }))?,
            ),
        };
        // Names of configured MCP servers: the run gets only those (none for `[]`); absent
        // or null, every configured one. Only names: a client cannot make the server run a
        // command or reach a URL of its choosing (`DriveCore::start_run` checks them).
        let mcp_servers = match self.map.get("mcp_servers") {
            None | Some(Value::Null) => None,
            Some(_) => Some(self.strings("mcp_servers")?),
        };
        Ok(RunSpec {
            prompt,
            images,
            interactive,
            cwd,
            model,
            permission_mode,
            rules,
            sandbox,
            mcp: crate::mcp_client::Selection {
                configured: mcp_servers,
                servers: Vec::new(),
            },
            ..RunSpec::default()
        })
    }

    /// `end: true` wins over `text`, as upstream's does; `compact: true` (caliban's own)
    /// comes between them.
    fn input(&self) -> Result<Inbound, OpError> {
        let text = self.opt_string("text")?;
        let end = self.flag("end")?;
        let compact = self.flag("compact")?;
        let images = self.images()?;
        match (end, compact, text) {
            (true, ..) => Ok(Inbound::EndInput),
            (false, true, _) => Ok(Inbound::Compact),
            (false, false, None) if images.is_empty() => Err(self.error(Problem::NoInput)),
            (false, false, text) => Ok(Inbound::UserMessage {
                text: text.unwrap_or_default(),
                images,
            }),
        }
    }

    fn answer(&self) -> Result<Answer, OpError> {
        Ok(Answer {
            tool_use_id: self.string("tool_use_id")?,
            allow: self.bool("allow")?,
            reason: self.opt_string("reason")?,
        })
    }
}

/// An operation whose arguments also name its run (MCP's tool arguments).
pub(crate) fn decode(op: OpKind, args: &Value, dialect: Dialect) -> Result<Op, OpError> {
    let fields = Fields::new(args, op, dialect)?;
    // Named first, as in upstream's structs (struct literals evaluate in source order).
    let run_id = || fields.string("run_id");
    Ok(match op {
        OpKind::Run => Op::Run(fields.run_spec()?),
        OpKind::Poll => Op::Poll {
            run_id: run_id()?,
            cursor: fields.count("cursor")?,
            wait_ms: fields.count("wait_ms")?,
        },
        OpKind::Status => Op::Status { run_id: run_id()? },
        OpKind::SendInput => Op::SendInput {
            run_id: run_id()?,
            input: fields.input()?,
        },
        OpKind::Permit => Op::Permit {
            run_id: run_id()?,
            answer: fields.answer()?,
        },
        OpKind::Cancel => Op::Cancel { run_id: run_id()? },
    })
}

// The fields of one operation alone, for a surface that names the run elsewhere (HTTP: in
// the path).

pub(crate) fn run_spec(body: &Value, dialect: Dialect) -> Result<RunSpec, OpError> {
    Fields::new(body, OpKind::Run, dialect)?.run_spec()
}

pub(crate) fn input(body: &Value, dialect: Dialect) -> Result<Inbound, OpError> {
    Fields::new(body, OpKind::SendInput, dialect)?.input()
}

pub(crate) fn answer(body: &Value, dialect: Dialect) -> Result<Answer, OpError> {
    Fields::new(body, OpKind::Permit, dialect)?.answer()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const MCP: Dialect = Dialect::MCP;
    const HTTP: Dialect = Dialect::HTTP;

    fn err(op: OpKind, args: Value, dialect: Dialect) -> String {
        match decode(op, &args, dialect) {
            Err(e) => e.to_string(),
            Ok(op) => panic!("decoded {op:?}"),
        }
    }

    fn problem(op: OpKind, args: Value, dialect: Dialect) -> Problem {
        decode(op, &args, dialect).unwrap_err().problem
    }

    /// Each case's text in the serde style (`decode`) and in the plain one (`body`, the
    /// decoder of the operation's own fields that the HTTP API uses).
    fn refusals<T: fmt::Debug>(
        op: OpKind,
        body: fn(&Value, Dialect) -> Result<T, OpError>,
        cases: &[(Value, &str, &str)],
    ) {
        for (args, serde, plain) in cases {
            assert_eq!(err(op, args.clone(), MCP), *serde, "{args}");
            assert_eq!(body(args, HTTP).unwrap_err().to_string(), *plain, "{args}");
        }
    }

    fn patterns(spec: &RunSpec) -> Vec<(String, Action)> {
        spec.rules
            .iter()
            .map(|r| (r.pattern.clone(), r.action))
            .collect()
    }

    #[test]
    fn run_good_input() {
        let args = json!({
            "prompt": "fix it", "interactive": true, "cwd": "sub", "model": "m",
            "permission_mode": "plan", "deny": ["Bash(rm:*)"], "ask": ["Write"],
        });
        for dialect in [MCP, HTTP] {
            let spec = run_spec(&args, dialect).unwrap();
            assert_eq!(spec.prompt, "fix it");
            assert!(spec.interactive);
            assert_eq!(spec.cwd, Some(PathBuf::from("sub")));
            assert_eq!(spec.model.as_deref(), Some("m"));
            assert_eq!(spec.permission_mode, Some(Mode::Plan));
            assert_eq!(
                patterns(&spec),
                [
                    ("Bash(rm:*)".to_owned(), Action::Deny),
                    ("Write".to_owned(), Action::Ask)
                ]
            );
            assert!(spec.rules.iter().all(|r| r.source == RuleSource::Session));
        }
        // Only the prompt is required; `null` optional strings and lists are absent.
        let bare = json!({"prompt": "p", "cwd": null, "model": null, "permission_mode": null,
                          "deny": null});
        for dialect in [MCP, HTTP] {
            match decode(OpKind::Run, &bare, dialect).unwrap() {
                Op::Run(spec) => {
                    assert!(!spec.interactive);
                    assert!(spec.cwd.is_none() && spec.model.is_none());
                    assert!(spec.permission_mode.is_none() && spec.rules.is_empty());
                }
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn run_refusals_in_both_styles() {
        let cases: [(Value, &str, &str); 10] = [
            (
                json!({}),
                "missing field `prompt`",
                "missing field `prompt`",
            ),
            (
                json!({"prompt": 5}),
                "invalid type: integer `5`, expected a string",
                "`prompt` must be a string",
            ),
            (
                json!({"prompt": null}),
                "invalid type: null, expected a string",
                "`prompt` must be a string",
            ),
            (
                json!({"prompt": "p", "interactive": "yes"}),
                "invalid type: string \"yes\", expected a boolean",
                "`interactive` must be a boolean",
            ),
            (
                json!({"prompt": "p", "cwd": 1.5}),
                "invalid type: floating point `1.5`, expected a string",
                "`cwd` must be a string",
            ),
            (
                json!({"prompt": "p", "model": []}),
                "invalid type: sequence, expected a string",
                "`model` must be a string",
            ),
            (
                json!({"prompt": "p", "permission_mode": "yolo"}),
                "unknown variant `yolo`, expected one of `default`, `acceptEdits`, `plan`, `dontAsk`, `bypassPermissions`",
                "invalid permission_mode `yolo`: expected default, acceptEdits, plan, dontAsk or bypassPermissions",
            ),
            (
                json!({"prompt": "p", "deny": "Bash"}),
                "invalid type: string \"Bash\", expected a sequence",
                "`deny` must be an array of strings",
            ),
            (
                json!({"prompt": "p", "ask": ["Bash", 3]}),
                "invalid type: integer `3`, expected a string",
                "`ask` must be an array of strings",
            ),
            (
                json!({"prompt": "p", "deny": [""]}),
                "`deny`: empty permission pattern",
                "empty permission pattern",
            ),
        ];
        refusals(OpKind::Run, run_spec, &cases);
        assert_eq!(
            err(OpKind::Run, json!("go"), MCP),
            "invalid type: string \"go\", expected struct RunArgs"
        );
        assert_eq!(
            run_spec(&json!(["go"]), HTTP).unwrap_err().to_string(),
            "expected a JSON object, not sequence"
        );
    }

    #[test]
    fn serde_style_texts_are_serdes_own() {
        // A string is named as serde names it (Rust's escapes, not JSON's), as upstream's
        // `Parameters<RunArgs>` refuses it.
        assert_eq!(
            err(
                OpKind::Run,
                json!({"prompt": "p", "interactive": "a\u{1}\n"}),
                MCP
            ),
            r#"invalid type: string "a\u{1}\n", expected a boolean"#
        );
        assert_eq!(
            err(OpKind::Poll, json!(null), MCP),
            "invalid type: null, expected struct PollArgs"
        );
        assert_eq!(
            err(OpKind::Permit, json!(2.5), MCP),
            "invalid type: floating point `2.5`, expected struct PermitArgs"
        );
        assert_eq!(
            err(OpKind::Run, json!({"prompt": "p", "sandbox": "none"}), MCP),
            "unknown variant `none`, expected one of `read-only`, `workspace-write`, `network`, `off`"
        );
        assert_eq!(
            err(OpKind::Run, json!({"prompt": "p", "sandbox": "none"}), HTTP),
            "invalid sandbox `none`: expected read-only, workspace-write, network or off"
        );
        // Our own texts keep JSON's spelling of what was sent.
        assert_eq!(
            run_spec(&json!("a\u{1}"), HTTP).unwrap_err().to_string(),
            r#"expected a JSON object, not string "a\u0001""#
        );
        assert_eq!(
            run_spec(&json!(null), HTTP).unwrap_err().to_string(),
            "expected a JSON object, not null"
        );
        assert_eq!(
            input(&json!({"text": "t", "images": {}}), HTTP)
                .unwrap_err()
                .to_string(),
            "`images`: expected an array of image blocks, not map"
        );
    }

    #[test]
    fn null_for_a_defaulted_scalar_is_the_style_flag() {
        // serde refuses `null` for a defaulted `bool`/`usize`; our HTTP bodies read it as absent.
        assert_eq!(
            err(
                OpKind::Run,
                json!({"prompt": "p", "interactive": null}),
                MCP
            ),
            "invalid type: null, expected a boolean"
        );
        assert!(
            !run_spec(&json!({"prompt": "p", "interactive": null}), HTTP)
                .unwrap()
                .interactive
        );
        assert_eq!(
            err(OpKind::Poll, json!({"run_id": "r", "cursor": null}), MCP),
            "invalid type: null, expected usize"
        );
        match decode(OpKind::Poll, &json!({"run_id": "r", "cursor": null}), HTTP).unwrap() {
            Op::Poll { cursor, .. } => assert_eq!(cursor, 0),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn allow_rules_are_the_surface_flag() {
        let args = json!({"prompt": "p", "deny": ["Read(.env)"], "allow": ["Bash(ls:*)"]});
        // HTTP reads them, after deny and ask (they can only narrow: see `Dialect`).
        let spec = run_spec(&args, HTTP).unwrap();
        assert_eq!(
            patterns(&spec),
            [
                ("Read(.env)".to_owned(), Action::Deny),
                ("Bash(ls:*)".to_owned(), Action::Allow)
            ]
        );
        assert_eq!(
            run_spec(&json!({"prompt": "p", "allow": [""]}), HTTP)
                .unwrap_err()
                .problem,
            Problem::BadRule {
                field: "allow",
                error: "empty permission pattern".into()
            }
        );
        // MCP's `caliban_run` schema has no `allow`: it is an unknown argument, ignored.
        let spec = run_spec(&args, MCP).unwrap();
        assert_eq!(patterns(&spec), [("Read(.env)".to_owned(), Action::Deny)]);
        assert!(run_spec(&json!({"prompt": "p", "allow": 7}), MCP).is_ok());
    }

    #[test]
    fn poll_status_cancel() {
        let args = json!({"run_id": "run-3", "cursor": 2, "wait_ms": 500});
        assert!(matches!(
            decode(OpKind::Poll, &args, MCP).unwrap(),
            Op::Poll { ref run_id, cursor: 2, wait_ms: 500 } if run_id == "run-3"
        ));
        let big = json!({"run_id": "r", "cursor": u64::MAX});
        assert!(matches!(
            decode(OpKind::Poll, &big, MCP).unwrap(),
            Op::Poll {
                cursor: u64::MAX,
                ..
            }
        ));
        let poll = |args: Value| err(OpKind::Poll, args, MCP);
        assert_eq!(poll(json!({})), "missing field `run_id`");
        assert_eq!(
            poll(json!({"run_id": 7})),
            "invalid type: integer `7`, expected a string"
        );
        assert_eq!(
            poll(json!({"run_id": "r", "cursor": -1})),
            "invalid value: integer `-1`, expected usize"
        );
        assert_eq!(
            poll(json!({"run_id": "r", "wait_ms": 2.5})),
            "invalid type: floating point `2.5`, expected usize"
        );
        assert_eq!(
            poll(json!({"run_id": "r", "cursor": "3"})),
            "invalid type: string \"3\", expected usize"
        );
        assert_eq!(
            err(OpKind::Poll, json!({"run_id": "r", "cursor": -1}), HTTP),
            "`cursor` must be a non-negative integer"
        );
        assert_eq!(
            err(OpKind::Poll, json!({"run_id": "r", "wait_ms": true}), HTTP),
            "`wait_ms` must be a non-negative integer"
        );
        for (op, name) in [
            (OpKind::Status, "StatusArgs"),
            (OpKind::Cancel, "CancelArgs"),
        ] {
            let decoded = decode(op, &json!({"run_id": "run-1"}), MCP).unwrap();
            assert_eq!(decoded.run_id(), Some("run-1"));
            assert_eq!(
                problem(op, json!({}), MCP),
                Problem::Missing { field: "run_id" }
            );
            assert_eq!(
                err(op, json!({"run_id": false}), HTTP),
                "`run_id` must be a string"
            );
            assert_eq!(
                err(op, json!(1), MCP),
                format!("invalid type: integer `1`, expected struct {name}")
            );
        }
    }

    #[test]
    fn send_input() {
        let decoded = |args: Value| match decode(OpKind::SendInput, &args, MCP).unwrap() {
            Op::SendInput { run_id, input } => {
                assert_eq!(run_id, "r");
                input
            }
            other => panic!("{other:?}"),
        };
        assert_eq!(
            decoded(json!({"run_id": "r", "text": "more"})),
            Inbound::text("more".into())
        );
        // `end: true` wins over `text`.
        assert_eq!(
            decoded(json!({"run_id": "r", "text": "more", "end": true})),
            Inbound::EndInput
        );
        assert_eq!(
            decoded(json!({"run_id": "r", "text": "more", "compact": true})),
            Inbound::Compact
        );
        assert_eq!(
            decoded(json!({"run_id": "r", "end": true, "compact": true})),
            Inbound::EndInput
        );
        assert_eq!(
            input(&json!({"text": "hi", "end": null}), HTTP).unwrap(),
            Inbound::text("hi".into())
        );
        // Neither: each surface's upstream text, after every field is type-checked.
        for args in [json!({"run_id": "r"}), json!({"run_id": "r", "end": false})] {
            assert_eq!(
                err(OpKind::SendInput, args.clone(), MCP),
                "send_input requires `text` or `end: true`"
            );
            assert_eq!(
                input(&args, HTTP).unwrap_err().to_string(),
                "input requires `text` or `end: true`"
            );
        }
        assert_eq!(
            problem(OpKind::SendInput, json!({"end": true}), MCP),
            Problem::Missing { field: "run_id" }
        );
        let cases = [
            (
                json!({"run_id": "r", "end": "yes"}),
                "invalid type: string \"yes\", expected a boolean",
                "`end` must be a boolean",
            ),
            (
                json!({"run_id": "r", "text": 4}),
                "invalid type: integer `4`, expected a string",
                "`text` must be a string",
            ),
            (
                json!({"run_id": "r", "end": null}),
                "invalid type: null, expected a boolean",
                "input requires `text` or `end: true`",
            ),
        ];
        refusals(OpKind::SendInput, input, &cases);
    }

    #[test]
    fn permit() {
        let args = json!({"run_id": "r", "tool_use_id": "toolu_1", "allow": false,
                          "reason": "no"});
        let expected = Answer {
            tool_use_id: "toolu_1".into(),
            allow: false,
            reason: Some("no".into()),
        };
        match decode(OpKind::Permit, &args, MCP).unwrap() {
            Op::Permit { run_id, answer } => {
                assert_eq!((run_id.as_str(), answer), ("r", expected.clone()))
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(answer(&args, HTTP).unwrap(), expected);
        let reasonless = json!({"tool_use_id": "t", "allow": true, "reason": null});
        assert_eq!(answer(&reasonless, HTTP).unwrap().reason, None);
        let cases = [
            (
                json!({"run_id": "r", "allow": true}),
                "missing field `tool_use_id`",
                "missing field `tool_use_id`",
            ),
            (
                json!({"run_id": "r", "tool_use_id": "t"}),
                "missing field `allow`",
                "missing field `allow`",
            ),
            (
                json!({"run_id": "r", "tool_use_id": 9, "allow": true}),
                "invalid type: integer `9`, expected a string",
                "`tool_use_id` must be a string",
            ),
            (
                json!({"run_id": "r", "tool_use_id": "t", "allow": "yes"}),
                "invalid type: string \"yes\", expected a boolean",
                "`allow` must be a boolean",
            ),
            (
                json!({"run_id": "r", "tool_use_id": "t", "allow": null}),
                "invalid type: null, expected a boolean",
                "`allow` must be a boolean",
            ),
            (
                json!({"run_id": "r", "tool_use_id": "t", "allow": false, "reason": {}}),
                "invalid type: map, expected a string",
                "`reason` must be a string",
            ),
        ];
        refusals(OpKind::Permit, answer, &cases);
        assert_eq!(
            err(
                OpKind::Permit,
                json!({"tool_use_id": "t", "allow": true}),
                MCP
            ),
            "missing field `run_id`"
        );
    }
}
