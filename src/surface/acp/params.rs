//! The params of each ACP method a client sends, decoded once where the message is
//! dispatched, so a handler gets a typed value and never indexes JSON. A refusal is the
//! `invalid params` error the handlers always gave, for the first bad field in the order they
//! read them (editors show the message; tests pin some). Checks that need the server's state
//! (is the `cwd` inside the workspace, is the session known) stay with the handlers.
//!
//! Hand-written rather than derived: serde's messages ("missing field `cwd`") are not ours,
//! and a handful of required strings does not pay for a derive's code.

use serde_json::Value;

use super::convo;
use super::delegate::ClientCaps;
use crate::jsonrpc::RpcError;
use crate::model::types::ContentBlock;

/// A required string member.
fn string<'a>(params: &'a Value, key: &str) -> Result<&'a str, RpcError> {
    params.get(key).and_then(Value::as_str).ok_or_else(|| {
        RpcError::invalid_params(format!("`{key}` is required and must be a string"))
    })
}

/// `mcpServers`, when present: whatever it holds replaces the session's servers, and a
/// value that is not a list replaces them with none.
fn mcp_servers(params: &Value) -> Option<&[Value]> {
    params
        .get("mcpServers")
        .map(|list| list.as_array().map(Vec::as_slice).unwrap_or_default())
}

/// `initialize`: what the client can do for us and show.
#[derive(Debug, PartialEq)]
pub(super) struct Initialize {
    pub(super) caps: ClientCaps,
    /// `clientCapabilities.session.notices`: the client shows `notice` updates.
    pub(super) notices: bool,
    /// `clientCapabilities.session.compaction`: the client shows `compaction_update`s.
    pub(super) compaction: bool,
}

impl Initialize {
    pub(super) fn decode(params: &Value) -> Result<Initialize, RpcError> {
        if !params.get("protocolVersion").is_some_and(Value::is_u64) {
            return Err(RpcError::invalid_params(
                "`protocolVersion` is required and must be an integer",
            ));
        }
        let caps = &params["clientCapabilities"];
        Ok(Initialize {
            caps: ClientCaps {
                read: caps["fs"]["readTextFile"] == true,
                write: caps["fs"]["writeTextFile"] == true,
                terminal: caps["terminal"] == true,
            },
            notices: caps["session"]["notices"].is_object(),
            compaction: caps["session"]["compaction"].is_object(),
        })
    }
}

/// `session/new`.
#[derive(Debug, PartialEq)]
pub(super) struct NewSession<'a> {
    pub(super) cwd: &'a str,
    pub(super) mcp_servers: Option<&'a [Value]>,
}

impl NewSession<'_> {
    pub(super) fn decode(params: &Value) -> Result<NewSession<'_>, RpcError> {
        Ok(NewSession {
            cwd: string(params, "cwd")?,
            mcp_servers: mcp_servers(params),
        })
    }
}

/// `session/load` and `session/resume`.
#[derive(Debug, PartialEq)]
pub(super) struct OpenSession<'a> {
    pub(super) session_id: &'a str,
    pub(super) cwd: &'a str,
    pub(super) mcp_servers: Option<&'a [Value]>,
}

impl OpenSession<'_> {
    pub(super) fn decode(params: &Value) -> Result<OpenSession<'_>, RpcError> {
        Ok(OpenSession {
            session_id: string(params, "sessionId")?,
            cwd: string(params, "cwd")?,
            mcp_servers: mcp_servers(params),
        })
    }
}

/// `session/list`: an optional filter, ignored when it is not a string.
#[derive(Debug, PartialEq)]
pub(super) struct ListSessions<'a> {
    pub(super) cwd: Option<&'a str>,
}

impl ListSessions<'_> {
    pub(super) fn decode(params: &Value) -> ListSessions<'_> {
        ListSessions {
            cwd: params.get("cwd").and_then(Value::as_str),
        }
    }
}

/// `session/close` and `session/delete`: the session named.
pub(super) fn session_id(params: &Value) -> Result<&str, RpcError> {
    string(params, "sessionId")
}

/// `session/set_mode`.
#[derive(Debug, PartialEq)]
pub(super) struct SetMode<'a> {
    pub(super) session_id: &'a str,
    pub(super) mode_id: &'a str,
}

impl SetMode<'_> {
    pub(super) fn decode(params: &Value) -> Result<SetMode<'_>, RpcError> {
        Ok(SetMode {
            session_id: string(params, "sessionId")?,
            mode_id: string(params, "modeId")?,
        })
    }
}

/// `session/set_config_option`.
#[derive(Debug, PartialEq)]
pub(super) struct SetConfigOption<'a> {
    pub(super) session_id: &'a str,
    pub(super) config_id: &'a str,
    pub(super) value: &'a str,
}

impl SetConfigOption<'_> {
    pub(super) fn decode(params: &Value) -> Result<SetConfigOption<'_>, RpcError> {
        Ok(SetConfigOption {
            session_id: string(params, "sessionId")?,
            config_id: string(params, "configId")?,
            value: string(params, "value")?,
        })
    }
}

/// `session/prompt`, its content blocks read into the text and images of a user message.
/// Owned: a prompt that arrives while a cancel winds down waits for it (`Deferred`).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Prompt {
    pub(super) session_id: String,
    pub(super) text: String,
    pub(super) images: Vec<ContentBlock>,
}

impl Prompt {
    pub(super) fn decode(params: &Value) -> Result<Prompt, RpcError> {
        let session_id = string(params, "sessionId")?.to_owned();
        let (text, images) = convo::prompt_content(params.get("prompt").unwrap_or(&Value::Null))
            .map_err(RpcError::invalid_params)?;
        if text.trim().is_empty() && images.is_empty() {
            return Err(RpcError::invalid_params(
                "session/prompt requires non-empty text",
            ));
        }
        Ok(Prompt {
            session_id,
            text,
            images,
        })
    }
}

/// `session/cancel`: the session named, if any (a notification has no one to refuse).
pub(super) fn cancelled_session(params: &Value) -> Option<&str> {
    params.get("sessionId").and_then(Value::as_str)
}

/// `$/cancel_request`: the id of the request withdrawn, as JSON (compared with a prompt's
/// id as the value it is, whatever its spelling).
pub(super) fn withdrawn_request(params: &Value) -> Option<&Value> {
    params.get("requestId")
}

/// The client's answer to our `session/request_permission`.
#[derive(Debug, PartialEq)]
pub(super) enum Outcome<'a> {
    /// The user chose the option of this id.
    Selected(&'a str),
    /// The client's own `cancelled`: the turn was cancelled while it asked.
    Cancelled,
    /// An answer that names no option.
    Unreadable,
}

impl Outcome<'_> {
    pub(super) fn decode(result: &Value) -> Outcome<'_> {
        let outcome = &result["outcome"];
        match outcome["outcome"].as_str() {
            Some("selected") => outcome["optionId"]
                .as_str()
                .map_or(Outcome::Unreadable, Outcome::Selected),
            Some("cancelled") => Outcome::Cancelled,
            _ => Outcome::Unreadable,
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::jsonrpc::INVALID_PARAMS;

    fn refusal<T: std::fmt::Debug>(result: Result<T, RpcError>) -> String {
        let error = result.unwrap_err();
        assert_eq!(error.code, INVALID_PARAMS);
        error.message
    }

    #[test]
    fn initialize_needs_an_integer_version_and_reads_what_the_client_offers() {
        for bad in [json!({}), json!({"protocolVersion": "1"}), json!([1])] {
            assert_eq!(
                refusal(Initialize::decode(&bad)),
                "`protocolVersion` is required and must be an integer"
            );
        }
        let bare = Initialize::decode(&json!({"protocolVersion": 1})).unwrap();
        assert_eq!(
            bare,
            Initialize {
                caps: ClientCaps::default(),
                notices: false,
                compaction: false
            }
        );
        let full = Initialize::decode(&json!({"protocolVersion": 1, "clientCapabilities": {
            "fs": {"readTextFile": true, "writeTextFile": "yes"},
            "terminal": true,
            "session": {"notices": {}, "compaction": true},
        }}))
        .unwrap();
        assert_eq!(
            full,
            Initialize {
                caps: ClientCaps {
                    read: true,
                    write: false,
                    terminal: true
                },
                notices: true,
                compaction: false
            }
        );
    }

    #[test]
    fn the_first_missing_field_is_named_in_the_order_handlers_read_them() {
        assert_eq!(
            refusal(OpenSession::decode(&json!({"cwd": 3}))),
            "`sessionId` is required and must be a string"
        );
        assert_eq!(
            refusal(OpenSession::decode(&json!({"sessionId": "s"}))),
            "`cwd` is required and must be a string"
        );
        assert_eq!(
            refusal(SetMode::decode(&json!({"sessionId": "s", "modeId": null}))),
            "`modeId` is required and must be a string"
        );
        assert_eq!(
            refusal(SetConfigOption::decode(
                &json!({"sessionId": "s", "configId": "mode"})
            )),
            "`value` is required and must be a string"
        );
        assert_eq!(
            refusal(NewSession::decode(&Value::Null)),
            "`cwd` is required and must be a string"
        );
        assert_eq!(
            refusal(session_id(&json!(["s"]))),
            "`sessionId` is required and must be a string"
        );
        let params = json!({"sessionId": "s", "configId": "sandbox", "value": "read-only"});
        let set = SetConfigOption::decode(&params).unwrap();
        assert_eq!(
            (set.session_id, set.config_id, set.value),
            ("s", "sandbox", "read-only")
        );
    }

    #[test]
    fn mcp_servers_absent_keeps_them_and_anything_else_replaces_them() {
        let servers = json!([{"name": "a"}]);
        let absent = json!({"cwd": "/w"});
        assert_eq!(NewSession::decode(&absent).unwrap().mcp_servers, None);
        let listed = json!({"sessionId": "s", "cwd": "/w", "mcpServers": servers});
        let open = OpenSession::decode(&listed).unwrap();
        assert_eq!(open.mcp_servers, servers.as_array().map(Vec::as_slice));
        let null = json!({"cwd": "/w", "mcpServers": null});
        let none: &[Value] = &[];
        assert_eq!(NewSession::decode(&null).unwrap().mcp_servers, Some(none));
    }

    #[test]
    fn a_prompt_needs_a_session_blocks_and_something_in_them() {
        assert_eq!(
            refusal(Prompt::decode(&json!({"prompt": []}))),
            "`sessionId` is required and must be a string"
        );
        assert_eq!(
            refusal(Prompt::decode(&json!({"sessionId": "s"}))),
            "`prompt` must be an array of content blocks"
        );
        assert_eq!(
            refusal(Prompt::decode(
                &json!({"sessionId": "s", "prompt": [{"type": "text", "text": "  "}]})
            )),
            "session/prompt requires non-empty text"
        );
        let prompt =
            Prompt::decode(&json!({"sessionId": "s", "prompt": [{"type": "text", "text": "hi"}]}))
                .unwrap();
        assert_eq!(
            prompt,
            Prompt {
                session_id: "s".into(),
                text: "hi".into(),
                images: Vec::new()
            }
        );
    }

    #[test]
    fn a_permission_answer_is_an_option_a_cancel_or_nothing_usable() {
        let decode = |v: Value| format!("{:?}", Outcome::decode(&v));
        assert_eq!(
            decode(json!({"outcome": {"outcome": "selected", "optionId": "allow"}})),
            "Selected(\"allow\")"
        );
        assert_eq!(
            decode(json!({"outcome": {"outcome": "cancelled"}})),
            "Cancelled"
        );
        for unusable in [
            json!({"outcome": {"outcome": "selected"}}),
            json!({"outcome": "selected"}),
            json!({}),
            json!(null),
        ] {
            assert_eq!(decode(unusable), "Unreadable");
        }
    }

    #[test]
    fn notifications_and_the_list_filter_take_what_they_can() {
        assert_eq!(cancelled_session(&json!({"sessionId": "s"})), Some("s"));
        assert_eq!(cancelled_session(&json!({"sessionId": 1})), None);
        assert_eq!(
            withdrawn_request(&json!({"requestId": 1.5})),
            Some(&json!(1.5))
        );
        assert_eq!(withdrawn_request(&Value::Null), None);
        assert_eq!(ListSessions::decode(&json!({"cwd": "/w"})).cwd, Some("/w"));
        assert_eq!(ListSessions::decode(&json!({"cwd": 1})).cwd, None);
    }
}
