//! The NDJSON session plane: one run, started from the spawn spec's `initial_prompt`, and its
//! client. On connect the client gets the run's history (its last `REPLAY_CAP` events, or
//! everything from the cursor of a `Resume` line), then live events, each a bare `TurnEvent`
//! line (`{"type":"TurnStart",…}`, no envelope, upstream's plane). The cursor is the number
//! of `TurnEvent` lines before the next one; no other line counts.
//!
//! Lines in (one JSON object each; blank lines are skipped):
//!
//! - `{"type":"Resume","cursor":N}`: continue from cursor `N` with nothing lost or
//!   duplicated. Only as the first line after the preamble (on the Unix socket: the first
//!   line): the replay waits for a client's first line, or `RESUME_GRACE` after it became
//!   the client, and a `Resume` after that is answered with an `Error` line and the
//!   connection is closed.
//! - `{"type":"UserMessage","text":"…","images":[…]?}`, `{"type":"EndInput"}`: input for an
//!   interactive run (upstream's `AttachInbound`; `images` are image blocks, caliban's own).
//! - `{"type":"Compact"}`: compact the run's conversation now (a `Compaction` event follows).
//! - `{"type":"Permit","tool_use_id":"…","allow":true|false,"reason":"…"?}`: the answer to
//!   a `PermissionRequest` (the drive API's permit body, decoded by `drive::ops`).
//!
//! Lines out besides the events:
//!
//! - `{"type":"PermissionRequest","tool_use_id","tool_name","input"}`: a tool call waits for
//!   permission (`permission_posture` `supervised`); sent once the client has caught up with
//!   the events, once per prompt and connection. Unanswered, it is denied after the
//!   permission timeout, as on every surface.
//! - `{"type":"Error","error":"…"}`: a line that was not understood or was refused (bad JSON,
//!   an unknown `type`, input to a run that takes none, a permit for no prompt). The
//!   connection goes on, except after `replaced: …` (a newer client took this one's place). Neither name is a `TurnEvent` type, and neither is sent to a client
//!   that sends only good lines under `unattended`, so an upstream client sees only events.
//!
//! When the run has ended and its `RunEnd` is out, the connection is closed (TLS
//! close_notify, then FIN); the agent stays up for clients that come back to read, until its
//! idle exit.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use serde_json::{Map, Value, json};

use super::{Link, LinkEvent, NetKey, Served, Spec, cancel_live_runs};
use crate::drive::ops::{self, Dialect};
use crate::drive::table::{DriveCore, Inbound, RunSpec};
use crate::engine::HostAction;
use crate::ids::RunId;
use crate::log;
use crate::model::types::ContentBlock;
use crate::reactor::Signal;
use crate::surface::front::ConnId;
use crate::surface::host::{Cx, Surface};

/// The most events replayed to a client that connects without a `Resume` (upstream's
/// 1,024 lines): enough to see what the run is doing, bounded for a run that has done a lot.
pub(crate) const REPLAY_CAP: u64 = 1024;

/// How long the replay waits for a new client's first line, which may be a `Resume`: a
/// socket client sends it right after connecting (there is no preamble to send it with),
/// a moment later than the accept. Long enough for a loaded machine's scheduling, short
/// enough that a client that sends nothing barely notices the wait for its replay.
pub(crate) const RESUME_GRACE: Duration = Duration::from_millis(500);

/// A client is fed this much from the log per step, so one catching up cannot hog the loop;
/// it waits for `Writable` whenever its connection's queue is full.
const STEP_EVENTS: usize = 256;
const STEP_BYTES: usize = 256 * 1024;

/// The client's position in the run's events.
struct Follow {
    conn: ConnId,
    /// The cursor of the next event to send; `None` until the replay starts (a `Resume`
    /// sent with the preamble sets it).
    next: Option<u64>,
    /// Lines read from this client: a `Resume` must be the first.
    lines: u64,
    /// The prompt shown to this client (its tool_use_id), so each is sent once.
    shown: Option<String>,
    /// The run's end went out; the connection is being closed.
    done: bool,
    /// When it became the client: the replay waits `RESUME_GRACE` from here for a first
    /// line.
    attached: Instant,
}

impl Follow {
    /// How much longer the replay waits for a first line that may be a `Resume`; `None`
    /// once it need not wait (a line came, the replay began, or the grace is over).
    fn holding(&self) -> Option<Duration> {
        if self.next.is_some() || self.lines > 0 {
            return None;
        }
        RESUME_GRACE
            .checked_sub(self.attached.elapsed())
            .filter(|left| !left.is_zero())
    }
}

pub(crate) struct Plane {
    link: Link,
    /// The spawn spec until `start` starts its run.
    spec: Option<Spec>,
    run: Option<RunId>,
    follow: Option<Follow>,
    /// Armed while the replay waits for a first line (`Follow::holding`).
    replay_timer: Option<crate::reactor::TimerId>,
}

fn line(value: &Value) -> Vec<u8> {
    let mut bytes = value.to_string().into_bytes();
    bytes.push(b'\n');
    bytes
}

fn error_line(message: &str) -> Vec<u8> {
    line(&json!({"type": "Error", "error": message}))
}

/// What a client reads when a newer one takes its place (then its connection closes).
pub(super) fn replaced_line() -> Vec<u8> {
    error_line(REPLACED)
}

/// The `Error` text of a replaced client.
pub(crate) const REPLACED: &str =
    "replaced: a newer client connected to this agent; this connection is closed";

impl Plane {
    pub(super) fn new(link: Link, spec: &Spec) -> Plane {
        Plane {
            link,
            spec: Some(spec.clone()),
            run: None,
            follow: None,
            replay_timer: None,
        }
    }
}

impl Served for Plane {
    const PROTOCOL: &'static str = "ndjson";

    fn link(&mut self) -> &mut Link {
        &mut self.link
    }

    /// Starts the spec's run and serves its plane.
    fn start(&mut self, cx: &mut Cx<NetKey>) -> Result<(), String> {
        let spec = self.spec.take().ok_or("the plane was started twice")?;
        self.start_run(cx, &spec)
    }
}

impl Plane {
    fn start_run(&mut self, cx: &mut Cx<NetKey>, spec: &Spec) -> Result<(), String> {
        self.link
            .start(cx)
            .map_err(|e| format!("cannot listen: {e}"))?;
        let mut extra_header = Map::new();
        extra_header.insert("agent".into(), json!("ndjson"));
        if let Some(label) = &spec.label {
            extra_header.insert("label".into(), json!(label));
        }
        let run = cx
            .core
            .start_run(RunSpec {
                prompt: spec.initial_prompt.clone(),
                interactive: spec.interactive,
                extra_header,
                ..RunSpec::default()
            })
            .map_err(|e| format!("cannot start the run: {e}"))?;
        log::info(&format!(
            "started {run}{}",
            spec.label
                .as_ref()
                .map(|l| format!(" ({l})"))
                .unwrap_or_default()
        ));
        self.run = Some(run);
        Ok(())
    }

    /// Acts on what the link has for us.
    fn serve(&mut self, cx: &mut Cx<NetKey>) {
        while let Some(event) = self.link.next_event(cx) {
            match event {
                LinkEvent::Attached(conn) => {
                    self.follow = Some(Follow {
                        conn,
                        next: None,
                        lines: 0,
                        shown: None,
                        done: false,
                        attached: Instant::now(),
                    });
                }
                LinkEvent::Detached(conn) => {
                    if self.follow.as_ref().is_some_and(|f| f.conn == conn) {
                        self.follow = None;
                    }
                }
                LinkEvent::Line(bytes) => self.on_line(cx.core, &bytes),
                LinkEvent::Oversized => self.link.send(&error_line(&format!(
                    "line over {} bytes, dropped",
                    crate::surface::front::line::MAX_LINE
                ))),
                LinkEvent::Writable => self.pump(cx.core),
            }
        }
    }

    fn on_line(&mut self, core: &mut DriveCore, bytes: &[u8]) {
        let (Some(run), Some(follow)) = (self.run, self.follow.as_mut()) else {
            return;
        };
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return;
        }
        follow.lines += 1;
        let first = follow.lines == 1 && follow.next.is_none();
        let value: Value = match serde_json::from_slice(bytes) {
            Ok(value) => value,
            Err(e) => return self.link.send(&error_line(&format!("invalid JSON: {e}"))),
        };
        let kind = value
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let result = match kind {
            "Resume" if first => match value.get("cursor").and_then(Value::as_u64) {
                Some(cursor) => {
                    let total = core.event_count(run).unwrap_or(0);
                    // Past the end resumes from the end, as a poll does.
                    follow.next = Some(cursor.min(total));
                    Ok(())
                }
                None => Err("`cursor` must be a non-negative integer".to_owned()),
            },
            "Resume" => {
                self.link.send(&error_line(
                    "Resume must be the first line after the preamble, sent in the same write; \
                     reconnect to resume",
                ));
                self.link.finish_client();
                return;
            }
            "UserMessage" => match (value.get("text").and_then(Value::as_str), &value["images"]) {
                (Some(text), Value::Null) => core
                    .send_input(run, Inbound::text(text.to_owned()))
                    .map_err(|e| e.to_string()),
                (text, Value::Array(blocks)) => ContentBlock::images_from_json(blocks)
                    .map_err(|e| format!("`images`: {e}"))
                    .and_then(|images| {
                        let text = text.unwrap_or_default().to_owned();
                        core.send_input(run, Inbound::UserMessage { text, images })
                            .map_err(|e| e.to_string())
                    }),
                (None, _) => Err("`text` must be a string".to_owned()),
                (Some(_), _) => Err("`images` must be an array of image blocks".to_owned()),
            },
            "EndInput" => core
                .send_input(run, Inbound::EndInput)
                .map_err(|e| e.to_string()),
            "Compact" => core
                .send_input(run, Inbound::Compact)
                .map_err(|e| e.to_string()),
            "Permit" => ops::answer(&value, Dialect::HTTP)
                .map_err(|e| e.to_string())
                .and_then(|answer| {
                    core.permit(run, &answer.tool_use_id, answer.allow, answer.reason)
                        .map_err(|e| e.to_string())
                }),
            "" => Err("a line needs a string `type`".to_owned()),
            other => Err(format!(
                "unknown type `{other}`: expected UserMessage, EndInput, Compact, Permit or Resume"
            )),
        };
        if let Err(message) = result {
            self.link.send(&error_line(&message));
        }
    }

    /// Writes what the client has not seen yet, as far as it keeps up: events in order,
    /// then (once caught up) a prompt it has not been shown; after the run's end, closes.
    fn pump(&mut self, core: &DriveCore) {
        let (Some(run), Some(follow)) = (self.run, self.follow.as_mut()) else {
            return;
        };
        if follow.done || follow.holding().is_some() {
            return;
        }
        let next = match follow.next {
            Some(next) => next,
            None => {
                let total = core.event_count(run).unwrap_or(0);
                *follow.next.insert(total.saturating_sub(REPLAY_CAP))
            }
        };
        let mut next = next;
        loop {
            if !self.link.wants_more() {
                follow.next = Some(next);
                return;
            }
            let Ok(view) = core.poll(run, next, STEP_EVENTS, STEP_BYTES) else {
                return;
            };
            if !view.events.is_empty() {
                let mut chunk = Vec::new();
                for (_, raw) in &view.events {
                    chunk.extend_from_slice(raw.as_bytes());
                    chunk.push(b'\n');
                }
                next = view.next_cursor;
                follow.next = Some(next);
                self.link.send(&chunk);
                continue;
            }
            follow.next = Some(view.next_cursor);
            match view.permission_request {
                Some(prompt) if follow.shown.as_deref() != Some(&prompt.tool_use_id) => {
                    let mut shown = prompt.to_json();
                    shown["type"] = json!("PermissionRequest");
                    self.link.send(&line(&shown));
                    follow.shown = Some(prompt.tool_use_id);
                }
                Some(_) => {}
                None => follow.shown = None,
            }
            if view.status.is_terminal() {
                follow.done = true;
                self.link.finish_client();
            }
            return;
        }
    }
}

impl Surface for Plane {
    type Key = NetKey;

    fn on_signal(&mut self, cx: &mut Cx<NetKey>, signal: Signal) {
        log::info(&format!("{signal:?}: cancelling the run and shutting down"));
        cancel_live_runs(cx.core);
        cx.act(HostAction::Quit);
    }

    fn on_io(&mut self, cx: &mut Cx<NetKey>, key: NetKey) {
        if let NetKey::Front(key) = key {
            self.link.on_io(cx, key);
            self.serve(cx);
        }
    }

    fn on_timer(&mut self, cx: &mut Cx<NetKey>, key: NetKey) {
        match key {
            NetKey::Front(key) => {
                self.link.on_timer(cx, key);
                self.serve(cx);
            }
            NetKey::Replay => {
                self.replay_timer = None;
                self.feed(cx);
            }
            NetKey::Idle => {
                if self.link.idle_expired(cx.core) {
                    cancel_live_runs(cx.core);
                    cx.act(HostAction::Quit);
                }
            }
        }
    }

    fn after_batch(&mut self, cx: &mut Cx<NetKey>, _changed: &BTreeSet<RunId>) {
        self.serve(cx);
        self.feed(cx);
        self.serve(cx);
        self.link.watch_idle(cx);
    }
}

impl Plane {
    /// Writes what the client is owed (`pump`), or, while its replay waits for a first
    /// line, has the wait's end looked at.
    fn feed(&mut self, cx: &mut Cx<NetKey>) {
        match self.follow.as_ref().and_then(Follow::holding) {
            Some(left) => {
                if self.replay_timer.is_none() {
                    self.replay_timer = Some(cx.add_timer(left, NetKey::Replay));
                }
            }
            None => self.pump(cx.core),
        }
    }
}
