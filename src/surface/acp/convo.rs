//! Conversations between ACP and the drive core: a prompt's content blocks flattened to the
//! user text a run takes, a session file's messages turned back into model messages (the
//! history a new run continues) and into `session/update`s (what `session/load` replays).

use std::collections::{HashMap, VecDeque};
use std::path::Path;

use serde_json::{Value, json};

use super::call_ids::CallIds;
use super::card::{self, OldText};
use crate::agent::compact;
use crate::log;
use crate::model::types::{ContentBlock, MAX_IMAGES, Message, Role};
use crate::tools::table;

/// The user text of a `session/prompt` and its images: text blocks as they are, mentions
/// (`resource_link`, `resource`) inline as markdown links, the text of embedded resources
/// appended as context after the message, and `image` blocks (`promptCapabilities.image`)
/// as images for the model. An image the model could not take, or audio (not advertised),
/// is refused with the reason rather than left out.
pub fn prompt_content(blocks: &Value) -> Result<(String, Vec<ContentBlock>), String> {
    let Some(blocks) = blocks.as_array() else {
        return Err("`prompt` must be an array of content blocks".into());
    };
    let mut images = Vec::new();
    let mut text = String::new();
    let mut context = String::new();
    for block in blocks {
        let str_of = |v: &Value, key: &str| v.get(key).and_then(Value::as_str).map(str::to_owned);
        match block.get("type").and_then(Value::as_str) {
            Some("text") => text.push_str(&str_of(block, "text").unwrap_or_default()),
            Some("resource_link") => {
                let uri = str_of(block, "uri").unwrap_or_default();
                let name = str_of(block, "name").unwrap_or_else(|| last_segment(&uri));
                text.push_str(&format!("[@{name}]({uri})"));
            }
            Some("resource") => {
                let resource = block.get("resource").unwrap_or(&Value::Null);
                let uri = str_of(resource, "uri").unwrap_or_default();
                text.push_str(&format!("[@{}]({uri})", last_segment(&uri)));
                if let Some(body) = str_of(resource, "text") {
                    context.push_str(&format!("\n\n<context ref=\"{uri}\">\n{body}\n</context>"));
                }
            }
            Some("image") => {
                if images.len() == MAX_IMAGES {
                    return Err(format!("more than {MAX_IMAGES} images in one prompt"));
                }
                let (Some(media_type), Some(data)) =
                    (str_of(block, "mimeType"), str_of(block, "data"))
                else {
                    return Err(
                        "an image block needs `mimeType` and base64 `data` (an image \
                                given only by `uri` is not fetched)"
                            .into(),
                    );
                };
                let image = ContentBlock::prompt_image(&media_type, &data)
                    .map_err(|e| format!("image {}: {e}", images.len() + 1))?;
                images.push(image);
            }
            Some("audio") => return Err("audio is not supported in prompts".into()),
            Some(other) => log::info(&format!("ignoring a `{other}` block in a prompt")),
            None => return Err("a prompt content block has no `type`".into()),
        }
    }
    text.push_str(&context);
    Ok((text, images))
}

fn last_segment(uri: &str) -> String {
    uri.trim_end_matches('/')
        .rsplit('/')
        .next()
        .unwrap_or(uri)
        .to_owned()
}

/// Model messages from a session file's JSON messages (`DriveCore::messages`). A message
/// that does not parse is left out, with a warning, rather than failing the session.
pub fn history(messages: &[Value]) -> Vec<Message> {
    Message::list_from_json(messages)
}

/// Drops the last user prompt and everything after it (a refused turn, which ACP says is not
/// carried into the next prompt). Tool results are user messages too; a prompt is a user
/// message with text.
pub fn drop_last_prompt(history: &mut Vec<Message>) {
    let is_prompt = |m: &Message| {
        m.role == Role::User
            && m.content
                .iter()
                .any(|b| matches!(b, ContentBlock::Text { .. }))
    };
    if let Some(at) = history.iter().rposition(is_prompt) {
        history.truncate(at);
    }
}

/// The text of a tool result block's content (blocks or a bare string).
fn result_text(content: &Value) -> String {
    match content {
        Value::String(text) => text.clone(),
        Value::Array(blocks) => blocks
            .iter()
            .filter_map(|b| b.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

fn text_content(text: &str) -> Value {
    json!({"type": "content", "content": {"type": "text", "text": text}})
}

/// The image blocks among a tool result's content, as ACP tool-call content.
fn result_images(content: &Value) -> impl Iterator<Item = Value> + '_ {
    content
        .as_array()
        .into_iter()
        .flatten()
        .filter(|b| b.get("type").and_then(Value::as_str) == Some("image"))
        .map(card::image_content)
}

/// The `session/update`s that replay a conversation: user and agent text, thoughts, and one
/// `tool_call` per call carrying its input and final status and result. A call's result is
/// the one answering it in the message that follows its own (by id, and among calls that
/// share an id, in order), and its card gets a session-unique id from `ids`. A compaction's
/// summary (`agent::compact::head`) is shown as a `compaction_update` to a client that
/// advertised `session.compaction` (`compaction`), else as a thought, its acknowledgement
/// not at all, and the plan it carried over (`compact::PLAN_INTRO`) as a `plan` update.
pub fn replay(
    messages: &[Value],
    workspace: &Path,
    ids: &mut CallIds,
    compaction: bool,
) -> Vec<Value> {
    let mut updates = Vec::new();
    let mut compactions = 0;
    // The cards of the last assistant message's calls not answered yet, by the model's id.
    let mut unanswered: HashMap<String, VecDeque<usize>> = HashMap::new();
    for message in messages {
        let role = message.get("role").and_then(Value::as_str).unwrap_or("");
        if role == "assistant" {
            unanswered.clear();
        }
        for block in message
            .get("content")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let text = block.get("text").and_then(Value::as_str);
            let summary = text.and_then(|t| t.strip_prefix(compact::SUMMARY_INTRO));
            let carried_plan = text.and_then(compact::plan_of_text);
            match (role, block.get("type").and_then(Value::as_str)) {
                ("user", Some("text")) if summary.is_some() => {
                    let summary = summary.unwrap_or_default();
                    let summary = summary.strip_suffix(compact::CONTINUE).unwrap_or(summary);
                    compactions += 1;
                    updates.push(if compaction {
                        json!({"sessionUpdate": "compaction_update",
                               "compactionId": format!("replayed-{compactions}"),
                               "status": "completed",
                               "summary": [{"type": "text", "text": summary}]})
                    } else {
                        json!({"sessionUpdate": "agent_thought_chunk",
                               "content": {"type": "text", "text": format!(
                                   "The conversation was compacted. Summary:\n\n{summary}\n\n")}})
                    });
                }
                ("assistant", Some("text")) if text == Some(compact::ACK) => {}
                // The plan a compaction carried over, shown as the live session last showed it.
                ("user", Some("text")) if carried_plan.is_some() => {
                    let todos = carried_plan.unwrap_or_default();
                    updates.push(card::plan_update(&todos));
                }
                ("user", Some("image")) => {
                    let source = block.get("source").unwrap_or(&Value::Null);
                    updates.push(json!({
                        "sessionUpdate": "user_message_chunk",
                        "content": {"type": "image", "mimeType": source["media_type"],
                                    "data": source["data"]}}));
                }
                ("user", Some("text")) => updates.push(json!({
                    "sessionUpdate": "user_message_chunk",
                    "content": {"type": "text", "text": text.unwrap_or_default()}})),
                ("user", Some("tool_result")) => {
                    let id = block.get("tool_use_id").and_then(Value::as_str);
                    let Some(at) = id
                        .and_then(|id| unanswered.get_mut(id))
                        .and_then(VecDeque::pop_front)
                    else {
                        continue;
                    };
                    let is_error = block
                        .get("is_error")
                        .and_then(Value::as_bool)
                        .unwrap_or(false);
                    let result = block.get("content").unwrap_or(&Value::Null);
                    let text = result_text(result);
                    let card = &mut updates[at];
                    card["status"] = json!(if is_error { "failed" } else { "completed" });
                    if let Some(content) = card["content"].as_array_mut() {
                        content.push(text_content(&text));
                        content.extend(result_images(result));
                    }
                }
                ("assistant", Some("text")) => updates.push(json!({
                    "sessionUpdate": "agent_message_chunk",
                    "content": {"type": "text", "text": text.unwrap_or_default()}})),
                ("assistant", Some("thinking")) => updates.push(json!({
                    "sessionUpdate": "agent_thought_chunk",
                    "content": {"type": "text",
                                "text": block.get("thinking").and_then(Value::as_str).unwrap_or_default()}})),
                ("assistant", Some("tool_use")) => {
                    let id = block.get("id").and_then(Value::as_str).unwrap_or_default();
                    let name = block.get("name").and_then(Value::as_str).unwrap_or_default();
                    let input = block.get("input").cloned().unwrap_or_else(|| json!({}));
                    let described = card::describe(name, &input, workspace, OldText::Unknown);
                    let wire = ids.open(id);
                    ids.close(id);
                    unanswered
                        .entry(id.to_owned())
                        .or_default()
                        .push_back(updates.len());
                    // Failed unless a result answers it.
                    updates.push(json!({
                        "sessionUpdate": "tool_call",
                        "toolCallId": wire,
                        "title": described.title,
                        "name": name,
                        "kind": card::kind(name),
                        "status": "failed",
                        "rawInput": input,
                        "locations": described.locations,
                        "content": described.content,
                    }));
                    // The plan as it stood after this call, as the live session showed it.
                    if table::lookup(name).is_some_and(|t| matches!(t.runs, table::Runs::Plan(_)))
                        && let Ok(todos) = crate::tools::todo::parse_input(&input)
                    {
                        updates.push(card::plan_update(&todos));
                    }
                }
                _ => {}
            }
        }
    }
    updates
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_flatten_mentions_and_context() {
        let blocks = json!([
            {"type": "text", "text": "look at "},
            {"type": "resource_link", "uri": "file:///w/src/main.rs", "name": "main.rs"},
            {"type": "text", "text": " and "},
            {"type": "resource", "resource": {"uri": "file:///w/notes.md", "text": "be brief"}},
            {"type": "image", "data": "iVBORw0KGgo=", "mimeType": "image/png"}
        ]);
        assert_eq!(
            prompt_content(&blocks).unwrap().0,
            "look at [@main.rs](file:///w/src/main.rs) and [@notes.md](file:///w/notes.md)\
             \n\n<context ref=\"file:///w/notes.md\">\nbe brief\n</context>"
        );
        assert!(prompt_content(&json!("hi")).is_err());
        let png = json!([{"type": "text", "text": "see"},
                         {"type": "image", "mimeType": "image/png", "data": "iVBORw0KGgo="}]);
        let (text, images) = prompt_content(&png).unwrap();
        assert_eq!((text.as_str(), images.len()), ("see", 1));
        for (bad, why) in [
            (
                json!({"type": "image", "mimeType": "image/tiff", "data": "AAAA"}),
                "unsupported image type",
            ),
            (
                json!({"type": "image", "mimeType": "image/png", "data": "a b!"}),
                "not base64",
            ),
            (
                json!({"type": "image", "mimeType": "image/png", "uri": "file:///x.png"}),
                "needs `mimeType`",
            ),
            (
                json!({"type": "audio", "mimeType": "audio/wav", "data": "AAAA"}),
                "audio",
            ),
            (
                json!({"type": "image", "mimeType": "image/jpeg", "data": "iVBORw0KGgo="}),
                "image 1: claimed to be image/jpeg, but its bytes are image/png",
            ),
            (
                json!({"type": "image", "mimeType": "image/png", "data": "AAAA"}),
                "image 1: claimed to be image/png, but its bytes are not PNG",
            ),
        ] {
            let err = prompt_content(&json!([bad])).unwrap_err();
            assert!(err.contains(why), "{err}");
        }
    }

    #[test]
    fn history_round_trips_and_refusals_drop_their_prompt() {
        let messages = vec![
            json!({"role": "user", "content": [{"type": "text", "text": "one"}]}),
            json!({"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "Read", "input": {"path": "a"}}]}),
            json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "A"}], "is_error": false}]}),
            json!({"role": "assistant", "content": [{"type": "text", "text": "done"}]}),
            json!({"role": "user", "content": [{"type": "text", "text": "two"}]}),
            json!({"role": "assistant", "content": [{"type": "text", "text": "no"}]}),
        ];
        let mut h = history(&messages);
        assert_eq!(h.len(), 6);
        assert_eq!(h.iter().map(Message::to_json).collect::<Vec<_>>(), messages);
        drop_last_prompt(&mut h);
        assert_eq!(h.len(), 4);
        assert_eq!(h.last().unwrap().text(), "done");
    }

    #[test]
    fn replay_turns_messages_into_updates() {
        let messages = vec![
            json!({"role": "user", "content": [{"type": "text", "text": "hi"}]}),
            json!({"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm"},
                {"type": "text", "text": "reading"},
                {"type": "tool_use", "id": "t1", "name": "Bash", "input": {"command": "ls"}}]}),
            json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                   "content": [{"type": "text", "text": "a.txt"},
                               {"type": "image", "source": {"type": "base64",
                                "media_type": "image/png", "data": "AAAA"}}],
                   "is_error": true}]}),
        ];
        let updates = replay(&messages, Path::new("/"), &mut CallIds::default(), false);
        let kinds: Vec<&str> = updates
            .iter()
            .map(|u| u["sessionUpdate"].as_str().unwrap())
            .collect();
        assert_eq!(
            kinds,
            [
                "user_message_chunk",
                "agent_thought_chunk",
                "agent_message_chunk",
                "tool_call"
            ]
        );
        assert_eq!(updates[3]["status"], "failed");
        assert_eq!(updates[3]["title"], "ls");
        assert_eq!(updates[3]["content"][0]["content"]["text"], "a.txt");
        // The picture the model was shown, as an ACP image block.
        assert_eq!(
            updates[3]["content"][1],
            json!({"type": "content", "content": {"type": "image", "mimeType": "image/png",
                                                  "data": "AAAA"}})
        );
    }

    /// A model that repeats ids (local servers do): each call keeps its own result, and
    /// every card has its own id.
    #[test]
    fn replay_keeps_calls_with_repeated_ids_apart() {
        let call = |id: &str, cmd: &str| json!({"type": "tool_use", "id": id, "name": "Bash", "input": {"command": cmd}});
        let result = |id: &str, text: &str, is_error: bool| {
            json!({"type": "tool_result", "tool_use_id": id,
                   "content": [{"type": "text", "text": text}], "is_error": is_error})
        };
        let messages = vec![
            json!({"role": "user", "content": [{"type": "text", "text": "go"}]}),
            json!({"role": "assistant", "content": [call("call_0", "echo one")]}),
            json!({"role": "user", "content": [result("call_0", "one", false)]}),
            json!({"role": "assistant", "content": [call("call_0", "echo two"), call("call_0", "echo three")]}),
            json!({"role": "user", "content": [result("call_0", "two", false), result("call_0", "duplicate", true)]}),
            json!({"role": "assistant", "content": [call("call_0", "echo four")]}),
        ];
        let mut ids = CallIds::default();
        let updates = replay(&messages, Path::new("/"), &mut ids, false);
        let cards: Vec<(&str, &str, &str, &str)> = updates
            .iter()
            .filter(|u| u["sessionUpdate"] == "tool_call")
            .map(|u| {
                (
                    u["toolCallId"].as_str().unwrap(),
                    u["title"].as_str().unwrap(),
                    u["status"].as_str().unwrap(),
                    u["content"][0]["content"]["text"].as_str().unwrap_or(""),
                )
            })
            .collect();
        assert_eq!(
            cards,
            [
                ("call_0", "echo one", "completed", "one"),
                ("call_0#2", "echo two", "completed", "two"),
                ("call_0#3", "echo three", "failed", "duplicate"),
                ("call_0#4", "echo four", "failed", ""),
            ]
        );
        // A live card after the replay gets a fresh id too.
        assert_eq!(ids.open("call_0"), "call_0#5");
    }

    /// A compacted conversation replays as its summary, the plan the compaction carried
    /// over (the editor's plan panel is filled again) and what was kept.
    #[test]
    fn replay_shows_a_compaction_and_the_plan_it_carried() {
        use crate::agent::compact::{Next, head};
        use crate::tools::todo::parse_input;
        let todos = parse_input(&json!({"todos": [
            {"id": "1", "content": "read", "status": "completed"},
            {"id": "2", "content": "fix", "status": "in_progress"}]}))
        .unwrap();
        let mut messages: Vec<Value> = head("SUMMARY", Next::User, Some(&todos))
            .iter()
            .map(Message::to_json)
            .collect();
        messages.push(json!({"role": "user", "content": [{"type": "text", "text": "next"}]}));
        let updates = replay(&messages, Path::new("/"), &mut CallIds::default(), true);
        let kinds: Vec<&str> = updates
            .iter()
            .map(|u| u["sessionUpdate"].as_str().unwrap())
            .collect();
        assert_eq!(kinds, ["compaction_update", "plan", "user_message_chunk"]);
        assert_eq!(updates[0]["summary"][0]["text"], "SUMMARY");
        assert_eq!(updates[1]["entries"][1]["content"], "fix");
        assert_eq!(updates[1]["entries"][1]["status"], "in_progress");
    }
}
