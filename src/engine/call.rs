use super::mcp::McpWait;
use super::{Completion, Engine, Owner, RetryNotice, TimerOwner};
use crate::agent::event::StopCondition;
use crate::http::client::{self as http_client, ClientEvent, Exchange};
use crate::http::pool as conn_pool;
use crate::http::sse::SseDecoder;
use crate::ids::{HostKey, RunId};
use crate::log;
use crate::mcp_client::{self};
use crate::model::retry::{self, RetryDecision};
use crate::model::types::ModelEvent;
use crate::model::{self, StreamDecoder};
use crate::reactor::TimerId;
use mio::Token;
use std::time::{Duration, Instant};

/// Error bodies are read for their message and retry hints, never kept whole.
pub(super) const MAX_ERROR_BODY: usize = 64 * 1024;

pub(super) struct ModelCall {
    pub(super) exchange: Exchange,
    pub(super) sse: SseDecoder,
    pub(super) decoder: StreamDecoder,
    pub(super) status: Option<u16>,
    pub(super) headers: Vec<(String, String)>,
    pub(super) error_body: Vec<u8>,
    /// When the request started: the first-output limit counts from here.
    pub(super) started: Instant,
    /// When the last model event arrived, once output started: the idle limit counts from
    /// here. Keep-alives never move it.
    pub(super) last_event: Instant,
    pub(super) timer: TimerId,
    /// Whether output started, so `timer` measures the idle gap rather than the wait for
    /// the first output.
    pub(super) output_started: bool,
    /// `request_timeout` from `started`.
    pub(super) deadline: TimerId,
}

impl ModelCall {
    fn content_type(&self) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case("content-type"))
            .map(|(_, v)| v.as_str())
    }

    /// For a 2xx reply whose content type is not an event stream: how much of its body to
    /// keep, to quote in the error.
    fn not_a_stream_head(&self) -> Option<usize> {
        (!model::is_event_stream(self.content_type())).then_some(4 * model::MAX_NOT_A_STREAM_QUOTE)
    }

    /// The error naming what a 2xx reply sent instead of an event stream, if it did.
    fn not_a_stream(&self) -> Option<String> {
        let status = self.status.filter(|s| (200..300).contains(s))?;
        let content_type = self
            .content_type()
            .filter(|t| !model::is_event_stream(Some(t)))?;
        Some(model::not_an_event_stream(
            status,
            content_type,
            &self.error_body,
        ))
    }
}

/// Where a run's model request is. One enum so a request in flight and a pending retry
/// can never coexist.
pub(super) enum ModelState {
    Idle,
    InFlight(Box<ModelCall>),
    /// Waiting out a retry delay; the timer starts the next attempt.
    Backoff(TimerId),
}

impl ModelState {
    fn call_mut(&mut self) -> Option<&mut ModelCall> {
        match self {
            ModelState::InFlight(call) => Some(call),
            _ => None,
        }
    }

    /// Takes the call in flight, leaving `Idle`; other states are left alone.
    fn take_call(&mut self) -> Option<Box<ModelCall>> {
        match std::mem::replace(self, ModelState::Idle) {
            ModelState::InFlight(call) => Some(call),
            other => {
                *self = other;
                None
            }
        }
    }
}

/// A cheap jitter source for backoff; it only needs to de-synchronise clients.
pub(super) fn jitter() -> f64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    f64::from(nanos % 1000) / 1000.0
}

impl<K: HostKey> Engine<K> {
    /// A new model request: it waits (bounded) while any of the run's MCP servers is
    /// listing its tools; then it offers the tools they list now, so a server that finished
    /// listing late, or changed its tools, reaches the run's next turn.
    pub(super) fn request_model(&mut self, run: RunId) {
        self.request_model_waiting(run, true);
    }

    pub(super) fn request_model_waiting(&mut self, run: RunId, may_wait: bool) {
        let Some(slot) = self.runs.get_mut(&run) else {
            return;
        };
        if let McpWait::Waiting(_) = slot.mcp_wait {
            return;
        }
        if may_wait && !slot.mcp_gave_up && self.mcp.any_listing(&slot.mcp) {
            let timer = self.io.reactor.add_timer(mcp_client::START_WAIT);
            self.io.timers.insert(timer, TimerOwner::McpWait(run));
            slot.mcp_wait = McpWait::Waiting(timer);
            return;
        }
        if !slot.mcp.is_empty() {
            slot.run.set_extra_tools(self.mcp.tools(&slot.mcp));
        }
        self.start_model(run);
    }

    pub(super) fn start_model(&mut self, run: RunId) {
        if let Some(mut stale) = self.runs.get_mut(&run).and_then(|s| s.model.take_call()) {
            self.release_model(&mut stale);
        }
        let Some(slot) = self.runs.get_mut(&run) else {
            return;
        };
        let provider = &self.config.provider;
        let request = provider.build_request(&slot.run.model_request());
        let token = self.io.reactor.token();
        let mut exchange = Exchange::new(
            token,
            provider.target.clone(),
            provider.proxy.clone(),
            provider.tls.clone(),
            request,
        );
        let (host, port) = exchange.dial_target();
        self.stats.model_requests += 1;
        log::debug(&format!(
            "model request for run {} to {}:{}{}",
            run.0, provider.target.host, provider.target.port, provider.path
        ));
        let timer = self.io.reactor.add_timer(self.config.first_byte_timeout);
        self.io.timers.insert(timer, TimerOwner::Model(run));
        let deadline = self.io.reactor.add_timer(self.config.request_timeout);
        self.io
            .timers
            .insert(deadline, TimerOwner::ModelDeadline(run));
        self.io.owners.insert(token, Owner::Model(run));
        // A warm connection from an earlier turn (of any run) skips DNS, TCP and TLS.
        let key = self.model_key.get_or_insert_with(|| {
            conn_pool::Key::new(
                provider.target.clone(),
                provider.proxy.clone(),
                provider.tls.clone(),
            )
        });
        let reused = match self.pool.take(key, http_client::idle_alive) {
            Some(parked) => exchange.reuse(self.io.reactor.registry(), parked).is_ok(),
            None => false,
        };
        slot.model = ModelState::InFlight(Box::new(ModelCall {
            exchange,
            sse: SseDecoder::new(),
            decoder: provider.decoder(),
            status: None,
            headers: Vec::new(),
            error_body: Vec::new(),
            started: Instant::now(),
            last_event: Instant::now(),
            timer,
            output_started: false,
            deadline,
        }));
        if reused {
            return;
        }
        let done = move |result| Completion::Resolved { run, token, result };
        if let Some(now) = self.look_up(host, port, done) {
            self.on_resolved(run, token, now);
        }
    }

    /// A model response ended cleanly: its connection waits in the pool for the next
    /// request, if both sides keep it open.
    pub(super) fn park_model(&mut self, call: &mut ModelCall) {
        let Some(parked) = call.exchange.park(self.io.reactor.registry()) else {
            return;
        };
        let Some(key) = self.model_key.clone() else {
            return;
        };
        self.pool.put(key, parked, Instant::now());
        if self.pool_timer.is_none() {
            let timer = self.io.reactor.add_timer(conn_pool::IDLE_TIMEOUT);
            self.io.timers.insert(timer, TimerOwner::PoolIdle);
            self.pool_timer = Some(timer);
        }
    }

    /// The pool's timer: close what idled too long, and wake again for the next.
    pub(super) fn on_pool_timer(&mut self) {
        self.pool_timer = None;
        let now = Instant::now();
        if let Some(due) = self.pool.expire(now) {
            let timer = self
                .io
                .reactor
                .add_timer(due.saturating_duration_since(now));
            self.io.timers.insert(timer, TimerOwner::PoolIdle);
            self.pool_timer = Some(timer);
        }
    }

    pub(super) fn on_resolved(
        &mut self,
        run: RunId,
        token: Token,
        result: Result<Vec<std::net::SocketAddr>, String>,
    ) {
        let Some(call) = self
            .runs
            .get_mut(&run)
            .and_then(|s| s.model.call_mut())
            .filter(|c| c.exchange.token() == token)
        else {
            return;
        };
        let mut events = Vec::new();
        call.exchange
            .on_resolved(self.io.reactor.registry(), result, &mut events);
        self.on_client_events(run, events);
    }

    pub(super) fn on_model_ready(&mut self, run: RunId) {
        let Some(call) = self.runs.get_mut(&run).and_then(|s| s.model.call_mut()) else {
            return;
        };
        let mut events = Vec::new();
        call.exchange
            .on_ready(self.io.reactor.registry(), &mut events);
        self.on_client_events(run, events);
    }

    pub(super) fn on_client_events(&mut self, run: RunId, events: Vec<ClientEvent>) {
        for event in events {
            let Some(slot) = self.runs.get_mut(&run) else {
                return;
            };
            let Some(call) = slot.model.call_mut() else {
                return;
            };
            match event {
                ClientEvent::Head(head) => {
                    call.status = Some(head.status);
                    call.headers = head.headers;
                }
                ClientEvent::Body(bytes) => {
                    if call.status.is_some_and(|s| (200..300).contains(&s)) {
                        if let Some(head) = call.not_a_stream_head() {
                            // Kept to say what came instead, if no stream comes of it.
                            let room = head.saturating_sub(call.error_body.len());
                            call.error_body
                                .extend_from_slice(&bytes[..room.min(bytes.len())]);
                        }
                        let mut sse_events = Vec::new();
                        if let Err(e) = call.sse.feed(&bytes, &mut sse_events) {
                            let error = call
                                .not_a_stream()
                                .unwrap_or_else(|| format!("bad event stream: {e}"));
                            self.model_failed(run, error, None, true);
                            return;
                        }
                        let mut model_events = Vec::new();
                        for ev in &sse_events {
                            if let Err(e) = call.decoder.on_event(ev, &mut model_events) {
                                self.model_failed(
                                    run,
                                    format!("bad model stream: {e}"),
                                    None,
                                    false,
                                );
                                return;
                            }
                        }
                        let now = Instant::now();
                        // Bytes are not progress (a keep-alive is bytes); model events are.
                        if !model_events.is_empty() {
                            call.last_event = now;
                        }
                        if !call.output_started && model_events.iter().any(ModelEvent::is_output) {
                            // Output started: from now on a gap between events is measured
                            // by the (usually much shorter) idle limit.
                            self.io.reactor.cancel_timer(call.timer);
                            self.io.timers.remove(&call.timer);
                            call.timer = self.io.reactor.add_timer(self.config.idle_timeout);
                            call.output_started = true;
                            self.io.timers.insert(call.timer, TimerOwner::Model(run));
                        }
                        for ev in model_events {
                            if let ModelEvent::Error {
                                kind,
                                message,
                                retryable,
                            } = &ev
                            {
                                let msg = format!("{kind}: {message}");
                                self.model_failed(run, msg, None, *retryable);
                                return;
                            }
                            let Some(slot) = self.runs.get_mut(&run) else {
                                return;
                            };
                            let effects = slot.run.on_model_event(ev, now);
                            self.push_effects(run, effects);
                        }
                    } else {
                        let room = MAX_ERROR_BODY.saturating_sub(call.error_body.len());
                        call.error_body
                            .extend_from_slice(&bytes[..room.min(bytes.len())]);
                    }
                }
                ClientEvent::End => self.model_ended(run),
                ClientEvent::Failed { error, permanent } => {
                    let error = call.not_a_stream().unwrap_or(error);
                    self.model_failed(run, error, None, !permanent);
                    return;
                }
            }
        }
    }

    pub(super) fn model_ended(&mut self, run: RunId) {
        let Some(slot) = self.runs.get_mut(&run) else {
            return;
        };
        let Some(mut call) = slot.model.take_call() else {
            return;
        };
        self.park_model(&mut call);
        self.release_model(&mut call);
        self.finish_model(run, *call);
    }

    pub(super) fn finish_model(&mut self, run: RunId, call: ModelCall) {
        let status = call.status.unwrap_or(0);
        if (200..300).contains(&status) {
            // Flush a final event that arrived without its blank line only if the decoder
            // is not done yet; a complete stream needs nothing more.
            if call.decoder.is_done() {
                let now = Instant::now();
                if let Some(slot) = self.runs.get_mut(&run) {
                    let effects = slot.run.on_model_complete(now);
                    self.push_effects(run, effects);
                }
            } else {
                let error = call.not_a_stream().unwrap_or_else(|| {
                    "the model stream ended before the response was complete".to_owned()
                });
                self.retry_or_fail(run, error, None, true);
            }
            return;
        }
        let err = self
            .config
            .provider
            .parse_error_body(status, &call.error_body);
        let headers = call.headers.clone();
        let header = move |name: &str| {
            headers
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.clone())
        };
        let attempt = self.runs.get(&run).map_or(0, |s| s.attempt);
        let decision = retry::decide_status(
            &self.config.retry,
            attempt,
            status,
            &header,
            Some(err.kind.as_str()),
            jitter(),
        );
        let message = err.to_string();
        if err.is_context_overflow()
            && let Some(slot) = self.runs.get_mut(&run)
        {
            // The model says the request did not fit: the run may compact and resend.
            let effects = slot.run.on_context_overflow();
            if !effects.is_empty() {
                self.push_effects(run, effects);
                return;
            }
        }
        if err.is_image_refusal()
            && let Some(slot) = self.runs.get_mut(&run)
            && slot.run.drop_images()
        {
            // A text-only model: the pictures become lines and the turn goes again at once.
            let message = format!("{message}; sending it again without its images");
            let category = retry::category_for(status, Some(err.kind.as_str()));
            self.schedule_retry(run, Duration::ZERO, Some(status), category, message);
            return;
        }
        let can_retry = self.runs.get(&run).is_some_and(|s| s.run.can_retry_turn());
        match decision {
            RetryDecision::Retry(delay) if can_retry => {
                let category = retry::category_for(status, Some(err.kind.as_str()));
                self.schedule_retry(run, delay, Some(status), category, message)
            }
            _ => self.fail_run(run, StopCondition::ProviderError(message)),
        }
    }

    /// A transport-level or stream-level failure of the current model call.
    pub(super) fn model_failed(
        &mut self,
        run: RunId,
        error: String,
        status: Option<u16>,
        retryable: bool,
    ) {
        if let Some(mut call) = self.runs.get_mut(&run).and_then(|s| s.model.take_call()) {
            self.release_model(&mut call);
        }
        self.retry_or_fail(run, error, status, retryable);
    }

    pub(super) fn retry_or_fail(
        &mut self,
        run: RunId,
        error: String,
        status: Option<u16>,
        retryable: bool,
    ) {
        let Some(slot) = self.runs.get(&run) else {
            return;
        };
        if retryable
            && slot.run.can_retry_turn()
            && let RetryDecision::Retry(delay) =
                retry::decide_transport(&self.config.retry, slot.attempt, jitter())
        {
            self.schedule_retry(run, delay, status, retry::CATEGORY_NETWORK, error);
            return;
        }
        self.fail_run(run, StopCondition::ProviderError(error));
    }

    pub(super) fn schedule_retry(
        &mut self,
        run: RunId,
        delay: Duration,
        status: Option<u16>,
        category: &'static str,
        message: String,
    ) {
        let Some(slot) = self.runs.get_mut(&run) else {
            return;
        };
        self.stats.model_retries += 1;
        slot.attempt += 1;
        slot.run.reset_turn_for_retry(Instant::now() + delay);
        let notice = RetryNotice {
            attempt: slot.attempt + 1,
            max_retries: self.config.retry.max_retries,
            delay,
            status,
            category,
            message,
        };
        log::info(&format!(
            "model request failed ({}); retry {} of {} in {} ms",
            notice.message,
            slot.attempt,
            notice.max_retries,
            delay.as_millis()
        ));
        let timer = self.io.reactor.add_timer(delay);
        slot.model = ModelState::Backoff(timer);
        self.io.timers.insert(timer, TimerOwner::Backoff(run));
        self.notices.push_back((run, notice));
    }

    pub(super) fn fail_run(&mut self, run: RunId, condition: StopCondition) {
        self.stats.model_errors += 1;
        if let Some(slot) = self.runs.get_mut(&run) {
            let effects = slot.run.on_model_failed(condition);
            self.push_effects(run, effects);
        }
    }

    pub(super) fn release_model(&mut self, call: &mut ModelCall) {
        call.exchange.close(self.io.reactor.registry());
        self.io.owners.remove(&call.exchange.token());
        for timer in [call.timer, call.deadline] {
            self.io.timers.remove(&timer);
            self.io.reactor.cancel_timer(timer);
        }
    }

    pub(super) fn on_model_timer(&mut self, run: RunId, id: TimerId) {
        let Some(call) = self.runs.get_mut(&run).and_then(|s| s.model.call_mut()) else {
            return;
        };
        if call.timer != id {
            return;
        }
        let (limit, since) = if call.output_started {
            (self.config.idle_timeout, call.last_event)
        } else {
            (self.config.first_byte_timeout, call.started)
        };
        let quiet = since.elapsed();
        if quiet < limit {
            // Events since the timer was armed: push the deadline out instead of re-arming
            // a timer per event.
            let timer = self.io.reactor.add_timer(limit - quiet);
            call.timer = timer;
            self.io.timers.insert(timer, TimerOwner::Model(run));
            return;
        }
        let secs = limit.as_secs_f64();
        let message = if call.output_started {
            format!("the model stream was idle for {secs} s")
        } else if call.exchange.got_response_byte() {
            format!("no output from the model within {secs} s (keep-alives do not count)")
        } else {
            format!("no response from the model within {secs} s")
        };
        if let Some(mut call) = self.runs.get_mut(&run).and_then(|s| s.model.take_call()) {
            self.release_model(&mut call);
        }
        let can_retry = self.runs.get(&run).is_some_and(|s| s.run.can_retry_turn());
        if can_retry {
            self.retry_or_fail(run, message, None, true);
        } else {
            self.fail_run(run, StopCondition::StreamIdle(limit));
        }
    }

    /// The whole request took `request_timeout`: a stream that keeps producing output (or
    /// keeps producing it too slowly) must still end. Retried like a stall while nothing was
    /// shown; otherwise the run fails.
    pub(super) fn on_model_deadline(&mut self, run: RunId, id: TimerId) {
        let Some(call) = self.runs.get_mut(&run).and_then(|s| s.model.call_mut()) else {
            return;
        };
        if call.deadline != id {
            return;
        }
        let message = format!(
            "the model request took longer than {} s",
            self.config.request_timeout.as_secs_f64()
        );
        if let Some(mut call) = self.runs.get_mut(&run).and_then(|s| s.model.take_call()) {
            self.release_model(&mut call);
        }
        self.retry_or_fail(run, message, None, true);
    }
}
