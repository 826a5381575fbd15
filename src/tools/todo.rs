//! The `TodoWrite` tool: the model's plan for the run, as upstream's list of
//! `{id, content, status}`. Each call replaces the whole list. It touches nothing: the engine
//! checks the input here and turns the plan into a `PlanUpdate` event, which each surface
//! shows in its own way (an ACP `plan` update, a print-mode frame, the event itself on MCP
//! and HTTP); the list itself lives in the conversation, as the call's input (a compaction
//! that summarises the last call carries the list over: `agent::compact::latest_plan`).

use std::borrow::Cow;

use serde_json::{Value, json};

use crate::model::types::ToolSpec;
use crate::tools::{ToolOutput, closed_object};

/// Upstream's cap on the list.
pub const MAX_TODOS: usize = 100;
/// A to-do is a line of a plan, not a document.
const MAX_CONTENT_CHARS: usize = 1000;
const MAX_ID_CHARS: usize = 100;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TodoStatus {
    Pending,
    InProgress,
    Completed,
    Cancelled,
}

impl TodoStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            TodoStatus::Pending => "pending",
            TodoStatus::InProgress => "in_progress",
            TodoStatus::Completed => "completed",
            TodoStatus::Cancelled => "cancelled",
        }
    }

    fn parse(text: &str) -> Option<TodoStatus> {
        Some(match text {
            "pending" => TodoStatus::Pending,
            "in_progress" => TodoStatus::InProgress,
            "completed" => TodoStatus::Completed,
            "cancelled" => TodoStatus::Cancelled,
            _ => return None,
        })
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Todo {
    pub id: String,
    pub content: String,
    pub status: TodoStatus,
}

impl Todo {
    pub fn to_json(&self) -> Value {
        json!({"id": self.id, "content": self.content, "status": self.status.as_str()})
    }
}

/// `TodoWrite` as offered to the model.
pub(crate) fn spec() -> ToolSpec {
    ToolSpec {
        name: Cow::Borrowed("TodoWrite"),
        description: Cow::Borrowed(
            "Write your plan for this task as a to-do list, replacing the previous one: every \
            item, each with a stable `id`, a short imperative `content` and a `status` \
            (pending, in_progress, completed, cancelled). Use it for work of three or more \
            steps: write the plan first, keep exactly one item in_progress while you work on \
            it, and mark items completed as soon as they are done. The person driving you \
            sees the list. At most 100 items.",
        ),
        input_schema: closed_object(
            json!({
                "todos": {
                    "type": "array",
                    "maxItems": MAX_TODOS,
                    "description": "The whole list, in order.",
                    "items": closed_object(
                        json!({
                            "id": {"type": "string", "description": "A stable id for the item."},
                            "content": {"type": "string", "description": "What to do."},
                            "status": {
                                "type": "string",
                                "enum": ["pending", "in_progress", "completed", "cancelled"],
                                "description": "Where the item stands."
                            }
                        }),
                        &["id", "content", "status"],
                    )
                }
            }),
            &["todos"],
        ),
    }
}

/// A call's title: how far the plan is.
pub(crate) fn title(input: &Value) -> String {
    let items = input.get("todos").and_then(Value::as_array);
    let done = items.map_or(0, |items| {
        items
            .iter()
            .filter(|t| t.get("status").and_then(Value::as_str) == Some("completed"))
            .count()
    });
    format!("Plan: {done} of {} done", items.map_or(0, Vec::len))
}

/// Checks a `TodoWrite` call's input into the plan. Errors are tool results for the model.
pub(crate) fn parse_input(input: &Value) -> Result<Vec<Todo>, ToolOutput> {
    let fail = |e: String| ToolOutput::error(format!("TodoWrite: {e}"));
    let items = match input.get("todos") {
        Some(Value::Array(items)) => items,
        _ => return Err(fail("missing required array field `todos`".to_owned())),
    };
    if items.len() > MAX_TODOS {
        return Err(fail(format!(
            "{} items is more than {MAX_TODOS}; merge some",
            items.len()
        )));
    }
    let mut todos: Vec<Todo> = Vec::with_capacity(items.len());
    for (at, item) in items.iter().enumerate() {
        let field = |key: &str| item.get(key).and_then(Value::as_str).map(str::trim);
        let n = at + 1;
        let id = field("id")
            .filter(|id| !id.is_empty())
            .ok_or_else(|| fail(format!("item {n}: `id` must be a non-empty string")))?;
        let content = field("content")
            .filter(|c| !c.is_empty())
            .ok_or_else(|| fail(format!("item {n}: `content` must be a non-empty string")))?;
        let status = field("status").and_then(TodoStatus::parse).ok_or_else(|| {
            fail(format!(
                "item {n}: `status` must be pending, in_progress, completed or cancelled"
            ))
        })?;
        if id.chars().count() > MAX_ID_CHARS || content.chars().count() > MAX_CONTENT_CHARS {
            return Err(fail(format!(
                "item {n}: keep `id` under {MAX_ID_CHARS} and `content` under \
                 {MAX_CONTENT_CHARS} characters"
            )));
        }
        if todos.iter().any(|t| t.id == id) {
            return Err(fail(format!("item {n}: `id` {id:?} is used twice")));
        }
        todos.push(Todo {
            id: id.to_owned(),
            content: content.to_owned(),
            status,
        });
    }
    Ok(todos)
}

/// The result the model reads: the list as it now stands.
pub fn summary(todos: &[Todo]) -> ToolOutput {
    if todos.is_empty() {
        return ToolOutput::ok("The plan is now empty.");
    }
    let count = |status| todos.iter().filter(|t| t.status == status).count();
    let mut text = format!(
        "Plan updated: {} items ({} completed, {} in progress, {} pending, {} cancelled)",
        todos.len(),
        count(TodoStatus::Completed),
        count(TodoStatus::InProgress),
        count(TodoStatus::Pending),
        count(TodoStatus::Cancelled)
    );
    for todo in todos {
        let mark = match todo.status {
            TodoStatus::Pending => "[ ]",
            TodoStatus::InProgress => "[>]",
            TodoStatus::Completed => "[x]",
            TodoStatus::Cancelled => "[-]",
        };
        text.push_str(&format!("\n{mark} {} ({})", todo.content, todo.id));
    }
    ToolOutput::ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_are_checked_and_summarised() {
        let todos = parse_input(&json!({"todos": [
            {"id": "1", "content": "Read the code", "status": "completed"},
            {"id": "2", "content": " Fix the bug ", "status": "in_progress"},
            {"id": "3", "content": "Ship", "status": "cancelled"},
        ]}))
        .unwrap();
        assert_eq!(todos[1].content, "Fix the bug");
        assert_eq!(
            todos[2].to_json(),
            json!({"id": "3", "content": "Ship", "status": "cancelled"})
        );
        assert_eq!(
            summary(&todos).text,
            "Plan updated: 3 items (1 completed, 1 in progress, 0 pending, 1 cancelled)\n\
             [x] Read the code (1)\n[>] Fix the bug (2)\n[-] Ship (3)"
        );
        assert_eq!(parse_input(&json!({"todos": []})).unwrap(), vec![]);
        assert_eq!(
            title(&json!({"todos": [{"status": "completed"}, {}]})),
            "Plan: 1 of 2 done"
        );
        for (input, want) in [
            (json!({}), "missing required array field `todos`"),
            (
                json!({"todos": [{"id": "", "content": "x", "status": "pending"}]}),
                "item 1: `id`",
            ),
            (
                json!({"todos": [{"id": "a", "content": "x", "status": "done"}]}),
                "item 1: `status`",
            ),
            (
                json!({"todos": [{"id": "a", "content": "x", "status": "pending"},
                                 {"id": "a", "content": "y", "status": "pending"}]}),
                "item 2: `id` \"a\" is used twice",
            ),
        ] {
            let err = parse_input(&input).unwrap_err();
            assert!(err.is_error && err.text.contains(want), "{}", err.text);
        }
        let many: Vec<Value> = (0..=MAX_TODOS)
            .map(|i| json!({"id": i.to_string(), "content": "x", "status": "pending"}))
            .collect();
        assert!(parse_input(&json!({ "todos": many })).is_err());
    }
}
