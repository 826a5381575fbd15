//! Context compaction, the pure half: when to compact, which messages are summarised and
//! which are kept, the request that asks the model for the summary, and the messages that
//! replace the summarised ones. The run (`agent::run`) drives it as a phase of its state
//! machine; the session log (`drive::session`) replays it from the `Compaction` event.
//!
//! Tokens are estimated, never counted: the last response's usage says how large the
//! context was, and whatever was added since is guessed at four bytes of JSON a token
//! (the ratio of English text and code in both providers' tokenizers, and the one the stub
//! model reports).

use serde_json::Value;

use crate::model::types::{ContentBlock, Message, Role, swap_images};
use crate::tools::table::{self, Runs};
use crate::tools::todo::{self, Todo};

/// Bytes of request JSON per token, for the estimate of what was added since the last usage.
const BYTES_PER_TOKEN: u64 = 4;

/// The longest summary asked for: long enough for the state of an hour's work, short
/// enough that the compacted conversation is a fraction of the window.
pub const SUMMARY_MAX_TOKENS: u32 = 4096;

/// The system prompt of a compaction request.
pub const SYSTEM: &str = "You write the working notes that let a coding agent continue a \
long task after its earlier conversation is dropped. Do not call tools. Write plain text.";

/// The instruction appended to the summarised conversation.
pub const INSTRUCTION: &str = "The conversation above is about to be dropped to free the \
context window. Write a summary that lets you continue the work without it: the user's \
requests and constraints, what was done (files read and changed, commands run and what they \
showed), decisions and their reasons, open problems, and the next steps. Be specific (paths, \
names, exact errors); leave out pleasantries.";

/// How the summary is introduced to the model in the compacted conversation.
pub const SUMMARY_INTRO: &str =
    "The earlier part of this conversation was compacted. Summary of it:\n\n";

/// The assistant's reply to the summary, so that roles keep alternating when the user
/// speaks next.
pub const ACK: &str = "Understood. I will continue from this summary.";

/// Appended to the summary when the model speaks next (the compaction came in the middle of
/// the work, after tool results that the summary now holds).
pub const CONTINUE: &str = "\n\nContinue the work from where the summary leaves off.";

/// Introduces the plan carried over a compaction (`head`): the `TodoWrite` list as JSON, as
/// the model wrote it, so the model keeps working to it and a replay (ACP's `session/load`)
/// shows it again.
pub const PLAN_INTRO: &str =
    "Your plan (the last TodoWrite list) as it stood before the compaction, still current:\n";

/// What started a compaction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Trigger {
    /// The next request would not have fit the context window.
    Auto,
    /// A client asked for it (ACP `/compact`, an input, a print-mode control line).
    Manual,
}

impl Trigger {
    pub fn as_str(self) -> &'static str {
        match self {
            Trigger::Auto => "auto",
            Trigger::Manual => "manual",
        }
    }
}

/// Who speaks after the compacted messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Next {
    /// A kept user message, or the next input of an idle run.
    User,
    /// The model, at once (nothing was kept and the turn goes on).
    Model,
}

pub fn tokens_of_bytes(bytes: usize) -> u64 {
    (bytes as u64).div_ceil(BYTES_PER_TOKEN)
}

/// What one image is guessed to cost. Providers bill images by their pixels, not their
/// bytes: Anthropic about width × height / 750 tokens, on images it scales down to about
/// 1.15 megapixels (so about 1,600 at most), OpenAI's tiles about as much. Counted as base64
/// at four bytes a token, one 3 MiB screenshot would pass for 800,000 tokens and compact
/// every conversation that holds it.
pub const IMAGE_TOKENS: u64 = 1600;

/// A message's share of a request, estimated from its JSON, images at `IMAGE_TOKENS`.
pub fn message_tokens(message: &Message) -> u64 {
    let (count, data) = images_in(&message.content);
    // Base64 needs no escaping, so an image's data is as long in the JSON as it is.
    let bytes = message.to_json().to_string().len().saturating_sub(data);
    tokens_of_bytes(bytes).saturating_add(IMAGE_TOKENS.saturating_mul(count as u64))
}

/// How many images `blocks` hold, tool results' included, and their bytes of base64.
fn images_in(blocks: &[ContentBlock]) -> (usize, usize) {
    blocks.iter().fold((0, 0), |(n, bytes), block| match block {
        ContentBlock::Image { data, .. } => (n + 1, bytes + data.len()),
        ContentBlock::ToolResult { content, .. } => {
            let (m, more) = images_in(content);
            (n + m, bytes + more)
        }
        _ => (n, bytes),
    })
}

/// The most tokens a request may hold before it is compacted: the window less room for the
/// answer (`max_tokens`, but never more than a quarter of the window, since a large
/// `max_tokens` is a ceiling most answers stay far below).
pub fn limit(window: u64, max_tokens: u32) -> u64 {
    window.saturating_sub(u64::from(max_tokens).min(window / 4))
}

/// A user message that is a prompt (text, no tool results): a place where the kept part of
/// a conversation may start, since a tool result must follow its call.
fn is_prompt(message: &Message) -> bool {
    message.role == Role::User
        && message
            .content
            .iter()
            .any(|b| matches!(b, ContentBlock::Text { .. }))
        && !message
            .content
            .iter()
            .any(|b| matches!(b, ContentBlock::ToolResult { .. }))
}

/// Where the kept part of `messages` starts: the earliest prompt after the first message
/// from which the rest fits in `keep_tokens`; `messages.len()` (everything summarised) when
/// there is none.
pub fn split_point(messages: &[Message], keep_tokens: u64) -> usize {
    let mut kept = 0u64;
    let mut split = messages.len();
    for (at, message) in messages.iter().enumerate().rev() {
        kept = kept.saturating_add(message_tokens(message));
        if kept > keep_tokens || at == 0 {
            break;
        }
        if is_prompt(message) {
            split = at;
        }
    }
    split
}

/// The messages of the request that asks for the summary of `summarised`: the conversation
/// as it was, but with a line in place of each image (what the model said about a picture
/// is what a summary can keep of it, and the request stays small), and the instruction as
/// the last user words.
pub fn request_messages(summarised: &[Message]) -> Vec<Message> {
    let mut messages: Vec<Message> = summarised
        .iter()
        .map(|m| Message {
            role: m.role,
            content: swap_images(&m.content, &mut |image| match image {
                ContentBlock::Image { media_type, .. } => ContentBlock::text(format!(
                    "[an image ({media_type}) was here; left out of the summary request]"
                )),
                other => other.clone(),
            }),
        })
        .collect();
    match messages.last_mut() {
        Some(last) if last.role == Role::User => last.content.push(ContentBlock::text(INSTRUCTION)),
        _ => messages.push(Message {
            role: Role::User,
            content: vec![ContentBlock::text(INSTRUCTION)],
        }),
    }
    messages
}

/// The plan the model last wrote in `messages` (the input of its last `TodoWrite` call that
/// checks, or the plan an earlier compaction carried over), if any. The plan lives only in
/// the conversation, so a compaction that summarises it carries it over itself rather than
/// trust the summary to repeat it.
pub fn latest_plan(messages: &[Message]) -> Option<Vec<Todo>> {
    messages
        .iter()
        .rev()
        .flat_map(|m| m.content.iter().rev().map(move |block| (m.role, block)))
        .find_map(|(role, block)| match (role, block) {
            (Role::Assistant, ContentBlock::ToolUse { name, input, .. })
                if table::lookup(name).is_some_and(|t| matches!(t.runs, Runs::Plan(_))) =>
            {
                todo::parse_input(input).ok()
            }
            (Role::User, ContentBlock::Text { text }) => plan_of_text(text),
            _ => None,
        })
}

/// The plan in a text block of a compacted head (`PLAN_INTRO`), for a replay.
pub fn plan_of_text(text: &str) -> Option<Vec<Todo>> {
    let json = text.strip_prefix(PLAN_INTRO)?;
    todo::parse_input(&serde_json::from_str(json).ok()?).ok()
}

/// The messages that replace the summarised ones, with the plan carried over when the
/// summarised part held the last one (`latest_plan`).
pub fn head(summary: &str, next: Next, plan: Option<&[Todo]>) -> Vec<Message> {
    let mut text = format!("{SUMMARY_INTRO}{summary}");
    if next == Next::Model {
        text.push_str(CONTINUE);
    }
    let mut content = vec![ContentBlock::text(text)];
    if let Some(todos) = plan {
        let list =
            serde_json::json!({"todos": todos.iter().map(Todo::to_json).collect::<Vec<_>>()});
        content.push(ContentBlock::text(format!("{PLAN_INTRO}{list}")));
    }
    let mut head = vec![Message {
        role: Role::User,
        content,
    }];
    if next == Next::User {
        head.push(Message {
            role: Role::Assistant,
            content: vec![ContentBlock::text(ACK)],
        });
    }
    head
}

/// Applies a `Compaction` event to a conversation rebuilt from a session file (JSON
/// messages): the summarised messages give way to the event's `messages`, and the last
/// `messages_kept` stay.
pub fn replay(messages: &mut Vec<Value>, event: &Value) {
    let kept = event
        .get("messages_kept")
        .and_then(Value::as_u64)
        .map_or(0, |n| usize::try_from(n).unwrap_or(usize::MAX));
    let tail = messages.split_off(messages.len().saturating_sub(kept));
    messages.clear();
    if let Some(Value::Array(head)) = event.get("messages") {
        messages.extend(head.iter().cloned());
    }
    messages.extend(tail);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user(text: &str) -> Message {
        Message {
            role: Role::User,
            content: vec![ContentBlock::text(text)],
        }
    }

    fn assistant(text: &str) -> Message {
        Message {
            role: Role::Assistant,
            content: vec![ContentBlock::text(text)],
        }
    }

    fn results() -> Message {
        Message {
            role: Role::User,
            content: vec![ContentBlock::ToolResult {
                tool_use_id: "t".into(),
                content: vec![ContentBlock::text("x".repeat(400))],
                is_error: false,
            }],
        }
    }

    #[test]
    fn images_count_as_pictures_and_stay_out_of_the_summary_request() {
        let data = "A".repeat(1 << 20);
        let image = ContentBlock::image("image/png", &data).unwrap();
        let shot = Message {
            role: Role::User,
            content: vec![ContentBlock::ToolResult {
                tool_use_id: "t".into(),
                content: vec![ContentBlock::text("shot"), image.clone()],
                is_error: false,
            }],
        };
        let bare = Message {
            role: Role::User,
            content: vec![ContentBlock::ToolResult {
                tool_use_id: "t".into(),
                content: vec![ContentBlock::text("shot")],
                is_error: false,
            }],
        };
        let tokens = message_tokens(&shot);
        assert!(
            tokens < message_tokens(&bare) + IMAGE_TOKENS + 40,
            "{tokens}"
        );
        assert!(tokens > IMAGE_TOKENS);
        let prompt = Message {
            role: Role::User,
            content: vec![ContentBlock::text("look"), image],
        };
        let request = request_messages(&[prompt, assistant("ok"), shot]);
        let json = serde_json::to_string(&request.iter().map(Message::to_json).collect::<Vec<_>>())
            .unwrap();
        assert!(!json.contains("AAAA"), "no image data");
        assert_eq!(
            request[0].content[1],
            ContentBlock::text("[an image (image/png) was here; left out of the summary request]")
        );
        match &request[2].content[0] {
            ContentBlock::ToolResult { content, .. } => assert_eq!(
                content[1],
                ContentBlock::text(
                    "[an image (image/png) was here; left out of the summary request]"
                )
            ),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_kept_part_starts_at_a_prompt_and_fits() {
        let convo = [
            user("first"),
            assistant("a"),
            user("second"),
            assistant("b"),
            results(),
            user("third"),
            assistant("c"),
        ];
        // Room for everything: the first message is never kept, the second prompt is.
        assert_eq!(split_point(&convo, 10_000), 2);
        // Room for the last two only.
        let last_two = message_tokens(&convo[5]) + message_tokens(&convo[6]);
        assert_eq!(split_point(&convo, last_two), 5);
        // Room for nothing: everything is summarised.
        assert_eq!(split_point(&convo, 1), convo.len());
    }

    #[test]
    fn the_instruction_joins_a_last_user_message() {
        let messages = request_messages(&[user("go"), assistant("ok"), results()]);
        assert_eq!(messages.len(), 3);
        assert!(
            matches!(messages[2].content.last(), Some(ContentBlock::Text { text }) if text == INSTRUCTION)
        );
        let messages = request_messages(&[user("go"), assistant("ok")]);
        assert_eq!(messages.len(), 3);
        assert_eq!(messages[2].role, Role::User);
    }

    #[test]
    fn replay_keeps_the_tail_after_the_new_head() {
        let mut messages: Vec<Value> = ["a", "b", "c", "d"]
            .iter()
            .map(|t| user(t).to_json())
            .collect();
        let head: Vec<Value> = head("S", Next::User, None)
            .iter()
            .map(Message::to_json)
            .collect();
        let event = serde_json::json!({"messages": head, "messages_kept": 1});
        replay(&mut messages, &event);
        assert_eq!(messages.len(), 3);
        assert_eq!(messages[1]["role"], "assistant");
        assert_eq!(messages[2], user("d").to_json());
        assert_eq!(limit(1000, 8192), 750);
        assert_eq!(limit(200_000, 8192), 191_808);
    }

    #[test]
    fn the_last_plan_is_carried_over_and_read_back() {
        let call = |todos: Value| Message {
            role: Role::Assistant,
            content: vec![ContentBlock::ToolUse {
                id: "p".into(),
                name: "TodoWrite".into(),
                input: serde_json::json!({"todos": todos}),
            }],
        };
        let first = serde_json::json!([{"id": "1", "content": "read", "status": "completed"}]);
        let second = serde_json::json!([
            {"id": "1", "content": "read", "status": "completed"},
            {"id": "2", "content": "fix", "status": "in_progress"}
        ]);
        let convo = [
            user("go"),
            call(first),
            results(),
            call(second),
            results(),
            // A refused list is not the plan.
            call(serde_json::json!("not a list")),
        ];
        let plan = latest_plan(&convo).unwrap();
        assert_eq!(plan.len(), 2);
        assert_eq!(latest_plan(&convo[..1]), None);
        let head = head("S", Next::Model, Some(&plan));
        let [
            ContentBlock::Text { text: summary },
            ContentBlock::Text { text: carried },
        ] = head[0].content.as_slice()
        else {
            panic!("{head:?}");
        };
        assert!(summary.ends_with(CONTINUE));
        assert_eq!(plan_of_text(carried), Some(plan.clone()));
        assert_eq!(plan_of_text(summary), None);
        // A later compaction finds the plan the last one carried.
        assert_eq!(latest_plan(&head), Some(plan));
    }
}
