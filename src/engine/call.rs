//! Model calls: the exchange of a run's model request (its stream decoded into the run's
//! events, its three limits), what a failure leads to (`Retries`: backoff, `retry-after`,
//! never a resend after output), and the idle connections any run's next request may take
//! (`Warm`). The types reach the reactor only through `Reach`.

use std::time::{Duration, Instant};

use mio::Token;

use super::{Completion, Engine, Owner, Reach, RetryNotice, TimerOwner};

use crate::agent::event::StopCondition;
use crate::http::client::{self as http_client, ClientEvent, Exchange};
use crate::http::pool as conn_pool;
use crate::http::sse::SseDecoder;
use crate::ids::{HostKey, RunId};
use crate::log;
use crate::model::retry::{self, RetryDecision, RetryPolicy};
use crate::model::types::ModelEvent;
use crate::model::{self, StreamDecoder};
use crate::reactor::TimerId;

/// Error bodies are read for their message and retry hints, never kept whole.
const MAX_ERROR_BODY: usize = 64 * 1024;

pub(super) struct ModelCall {
    exchange: Exchange,
    sse: SseDecoder,
    decoder: StreamDecoder,
    status: Option<u16>,
    headers: Vec<(String, String)>,
    error_body: Vec<u8>,
    /// How long the model has been quiet; `timer` fires when it may have been too long.
    quiet: Quiet,
    timer: TimerId,
    /// `request_timeout` from `started`.
    deadline: TimerId,
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

/// How long a model request has been quiet. Every request is bounded by the first output
/// (`first_byte_timeout` from the start) and then by the gap between events
/// (`idle_timeout`); bytes are not progress (a keep-alive is bytes), model events are.
struct Quiet {
    /// When the request started: the first-output limit counts from here.
    started: Instant,
    /// When the last model event arrived, once output started: the idle limit counts from
    /// here. Keep-alives never move it.
    last_event: Instant,
    /// Whether output started, so the request's timer measures the idle gap rather than
    /// the wait for the first output.
    output_started: bool,
}

impl Quiet {
    fn new(now: Instant) -> Quiet {
        Quiet {
            started: now,
            last_event: now,
            output_started: false,
        }
    }

    /// Events decoded at `now`; whether they started the output, so the caller re-arms
    /// its timer with the (usually much shorter) idle limit.
    fn heard(&mut self, now: Instant, events: &[ModelEvent]) -> bool {
        if !events.is_empty() {
            self.last_event = now;
        }
        if self.output_started || !events.iter().any(ModelEvent::is_output) {
            return false;
        }
        self.output_started = true;
        true
    }

    /// At the request's timer: how long is left (events came since it was armed), or the
    /// limit the quiet ran past.
    fn due(
        &self,
        now: Instant,
        first_byte: Duration,
        idle: Duration,
    ) -> Result<Duration, Duration> {
        let (limit, since) = if self.output_started {
            (idle, self.last_event)
        } else {
            (first_byte, self.started)
        };
        let quiet = now.saturating_duration_since(since);
        if quiet < limit {
            Ok(limit - quiet)
        } else {
            Err(limit)
        }
    }
}

/// A run's retries of its current turn's model request, and what a failure leads to.
#[derive(Default)]
pub(super) struct Retries {
    /// Retries made so far for this turn.
    attempt: u32,
}

impl Retries {
    /// A new turn: its request has all its retries again.
    pub(super) fn reset(&mut self) {
        self.attempt = 0;
    }

    /// After a failure with no (usable) response: the delay before the next attempt, or
    /// `None` to give up. Nothing is resent once the turn showed output (`can_retry_turn`).
    fn after_transport(
        &self,
        policy: &RetryPolicy,
        retryable: bool,
        can_retry_turn: bool,
        jitter: f64,
    ) -> Option<Duration> {
        if !retryable || !can_retry_turn {
            return None;
        }
        match retry::decide_transport(policy, self.attempt, jitter) {
            RetryDecision::Retry(delay) => Some(delay),
            RetryDecision::GiveUp => None,
        }
    }

    /// After an error status: the delay the server asked for (`retry-after`) or the
    /// backoff, or `None` to give up.
    fn after_status(
        &self,
        policy: &RetryPolicy,
        status: u16,
        header: &dyn Fn(&str) -> Option<String>,
        kind: Option<&str>,
        can_retry_turn: bool,
        jitter: f64,
    ) -> Option<Duration> {
        match retry::decide_status(policy, self.attempt, status, header, kind, jitter) {
            RetryDecision::Retry(delay) if can_retry_turn => Some(delay),
            _ => None,
        }
    }

    /// Counts a retry and arms the timer that makes it; the notice tells the host.
    #[allow(clippy::too_many_arguments)]
    fn schedule(
        &mut self,
        reach: &mut impl Reach,
        run: RunId,
        policy: &RetryPolicy,
        delay: Duration,
        status: Option<u16>,
        category: &'static str,
        message: String,
    ) -> (TimerId, RetryNotice) {
        self.attempt += 1;
        let timer = reach.timer(delay, TimerOwner::Backoff(run));
        let notice = RetryNotice {
            attempt: self.attempt + 1,
            max_retries: policy.max_retries,
            delay,
            status,
            category,
            message,
        };
        (timer, notice)
    }
}

/// Idle model connections (keep-alive), deregistered, for the next model request of any
/// run; one timer closes the ones idle too long.
pub(super) struct Warm<C> {
    pool: conn_pool::Pool<C>,
    /// What makes a model connection reusable: the provider's target, proxy and TLS config.
    /// Built at the first model request, not at start-up (an idle server runs none of it).
    key: Option<conn_pool::Key>,
    timer: Option<TimerId>,
}

impl<C> Warm<C> {
    /// Keeps up to `per_key` connections (`EngineConfig::idle_connections`).
    pub(super) fn new(per_key: usize) -> Warm<C> {
        Warm {
            pool: conn_pool::Pool::new(conn_pool::Limits {
                per_key,
                total: per_key.max(conn_pool::MAX_IDLE),
                idle: conn_pool::IDLE_TIMEOUT,
            }),
            key: None,
            timer: None,
        }
    }

    /// Hands a parked connection that `alive` finds still open to `reuse`; whether the
    /// request took one. When not, the request dials: a connection the server closed
    /// while it idled is the exchange's business, never the retry policy's.
    fn reuse(
        &mut self,
        key: impl FnOnce() -> conn_pool::Key,
        alive: impl FnMut(&mut C) -> bool,
        reuse: impl FnOnce(conn_pool::Parked<C>) -> bool,
    ) -> bool {
        let key = self.key.get_or_insert_with(key);
        self.pool.take(key, alive).is_some_and(reuse)
    }

    /// Keeps a connection whose response ended cleanly, and arms the idle timer.
    fn park(&mut self, reach: &mut impl Reach, parked: conn_pool::Parked<C>, now: Instant) {
        let Some(key) = self.key.clone() else {
            return;
        };
        self.pool.put(key, parked, now);
        if self.timer.is_none() {
            self.timer = Some(reach.timer(conn_pool::IDLE_TIMEOUT, TimerOwner::PoolIdle));
        }
    }

    /// The idle timer: close what idled too long, and wake again for the next.
    pub(super) fn on_timer(&mut self, reach: &mut impl Reach, now: Instant) {
        self.timer = None;
        if let Some(due) = self.pool.expire(now) {
            let after = due.saturating_duration_since(now);
            self.timer = Some(reach.timer(after, TimerOwner::PoolIdle));
        }
    }

    /// Closes every idle connection: nothing is on them, nothing waits.
    pub(super) fn clear(&mut self) {
        self.pool.clear();
    }
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
        let listing = may_wait && self.mcp.any_listing(&slot.mcp.servers);
        if slot.mcp.wait(&mut self.io, run, listing) {
            return;
        }
        if !slot.mcp.servers.is_empty() {
            slot.run.set_extra_tools(self.mcp.tools(&slot.mcp.servers));
        }
        self.start_model(run);
    }

    fn start_model(&mut self, run: RunId) {
        if let Some(mut stale) = self.runs.get_mut(&run).and_then(|s| s.model.take_call()) {
            self.release_model(&mut stale);
        }
        let Some(slot) = self.runs.get_mut(&run) else {
            return;
        };
        let provider = &self.config.provider;
        let request = provider.build_request(&slot.run.model_request());
        let token = self.io.token(Owner::Model(run));
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
        let first_byte = self.config.first_byte_timeout;
        let timer = self.io.timer(first_byte, TimerOwner::Model(run));
        let deadline = self
            .io
            .timer(self.config.request_timeout, TimerOwner::ModelDeadline(run));
        // A warm connection from an earlier turn (of any run) skips DNS, TCP and TLS.
        let key = || {
            conn_pool::Key::new(
                provider.target.clone(),
                provider.proxy.clone(),
                provider.tls.clone(),
            )
        };
        let registry = self.io.reactor.registry();
        let reused = self.pool.reuse(key, http_client::idle_alive, |parked| {
            exchange.reuse(registry, parked).is_ok()
        });
        slot.model = ModelState::InFlight(Box::new(ModelCall {
            exchange,
            sse: SseDecoder::new(),
            decoder: provider.decoder(),
            status: None,
            headers: Vec::new(),
            error_body: Vec::new(),
            quiet: Quiet::new(Instant::now()),
            timer,
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
    fn park_model(&mut self, call: &mut ModelCall) {
        if let Some(parked) = call.exchange.park(self.io.reactor.registry()) {
            self.pool.park(&mut self.io, parked, Instant::now());
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

    fn on_client_events(&mut self, run: RunId, events: Vec<ClientEvent>) {
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
                        if call.quiet.heard(now, &model_events) {
                            // Output started: from now on a gap between events is measured
                            // by the (usually much shorter) idle limit.
                            self.io.cancel(call.timer);
                            let idle = self.config.idle_timeout;
                            call.timer = self.io.timer(idle, TimerOwner::Model(run));
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

    fn model_ended(&mut self, run: RunId) {
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

    fn finish_model(&mut self, run: RunId, call: ModelCall) {
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
        let Some(slot) = self.runs.get(&run) else {
            return;
        };
        let delay = slot.retries.after_status(
            &self.config.retry,
            status,
            &header,
            Some(err.kind.as_str()),
            slot.run.can_retry_turn(),
            jitter(),
        );
        match delay {
            Some(delay) => {
                let category = retry::category_for(status, Some(err.kind.as_str()));
                self.schedule_retry(run, delay, Some(status), category, message)
            }
            None => self.fail_run(run, StopCondition::ProviderError(message)),
        }
    }

    /// A transport-level or stream-level failure of the current model call.
    fn model_failed(&mut self, run: RunId, error: String, status: Option<u16>, retryable: bool) {
        if let Some(mut call) = self.runs.get_mut(&run).and_then(|s| s.model.take_call()) {
            self.release_model(&mut call);
        }
        self.retry_or_fail(run, error, status, retryable);
    }

    fn retry_or_fail(&mut self, run: RunId, error: String, status: Option<u16>, retryable: bool) {
        let Some(slot) = self.runs.get(&run) else {
            return;
        };
        let can_retry = slot.run.can_retry_turn();
        if let Some(delay) =
            slot.retries
                .after_transport(&self.config.retry, retryable, can_retry, jitter())
        {
            self.schedule_retry(run, delay, status, retry::CATEGORY_NETWORK, error);
            return;
        }
        self.fail_run(run, StopCondition::ProviderError(error));
    }

    fn schedule_retry(
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
        let (timer, notice) = slot.retries.schedule(
            &mut self.io,
            run,
            &self.config.retry,
            delay,
            status,
            category,
            message,
        );
        slot.run.reset_turn_for_retry(Instant::now() + delay);
        log::info(&format!(
            "model request failed ({}); retry {} of {} in {} ms",
            notice.message,
            notice.attempt - 1,
            notice.max_retries,
            delay.as_millis()
        ));
        slot.model = ModelState::Backoff(timer);
        self.notices.push_back((run, notice));
    }

    fn fail_run(&mut self, run: RunId, condition: StopCondition) {
        self.stats.model_errors += 1;
        if let Some(slot) = self.runs.get_mut(&run) {
            let effects = slot.run.on_model_failed(condition);
            self.push_effects(run, effects);
        }
    }

    pub(super) fn release_model(&mut self, call: &mut ModelCall) {
        call.exchange.close(self.io.reactor.registry());
        self.io.forget(call.exchange.token());
        self.io.cancel(call.timer);
        self.io.cancel(call.deadline);
    }

    /// A retry's delay is over: the next attempt starts.
    pub(super) fn on_backoff(&mut self, run: RunId, id: TimerId) {
        if let Some(slot) = self.runs.get_mut(&run)
            && matches!(slot.model, ModelState::Backoff(timer) if timer == id)
        {
            slot.model = ModelState::Idle;
            self.start_model(run);
        }
    }

    pub(super) fn on_model_timer(&mut self, run: RunId, id: TimerId) {
        let Some(call) = self.runs.get_mut(&run).and_then(|s| s.model.call_mut()) else {
            return;
        };
        if call.timer != id {
            return;
        }
        let limit = match call.quiet.due(
            Instant::now(),
            self.config.first_byte_timeout,
            self.config.idle_timeout,
        ) {
            Ok(left) => {
                // Events since the timer was armed: push the deadline out instead of
                // re-arming a timer per event.
                call.timer = self.io.timer(left, TimerOwner::Model(run));
                return;
            }
            Err(limit) => limit,
        };
        let secs = limit.as_secs_f64();
        let message = if call.quiet.output_started {
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

#[cfg(test)]
mod tests {
    use super::super::fake::FakeReach;
    use super::*;
    use crate::http::target::Target;

    const RUN: RunId = RunId(3);
    const SECOND: Duration = Duration::from_secs(1);

    fn policy() -> RetryPolicy {
        RetryPolicy {
            max_retries: 6,
            base: Duration::from_millis(500),
            max_delay: Duration::from_secs(4),
        }
    }

    fn no_headers(_: &str) -> Option<String> {
        None
    }

    /// Schedules retries after transport failures until the policy gives up; the delays.
    fn delays(retries: &mut Retries, reach: &mut FakeReach) -> Vec<Duration> {
        let mut delays = Vec::new();
        while let Some(delay) = retries.after_transport(&policy(), true, true, 0.0) {
            retries.schedule(reach, RUN, &policy(), delay, None, "network", String::new());
            delays.push(delay);
        }
        delays
    }

    #[test]
    fn backoff_delays_double_up_to_the_cap_then_the_retries_give_up() {
        let (mut retries, mut reach) = (Retries::default(), FakeReach::new());
        let ms = |n| Duration::from_millis(n);
        let expected = [ms(500), ms(1000), ms(2000), ms(4000), ms(4000), ms(4000)];
        assert_eq!(delays(&mut retries, &mut reach), expected);
        assert!(
            retries
                .after_transport(&policy(), true, true, 0.0)
                .is_none()
        );
        let status = retries.after_status(&policy(), 503, &no_headers, None, true, 0.0);
        assert!(status.is_none(), "a status retry counts the same attempts");
    }

    #[test]
    fn a_new_turn_has_all_its_retries_again() {
        let (mut retries, mut reach) = (Retries::default(), FakeReach::new());
        delays(&mut retries, &mut reach);
        retries.reset();
        let first = retries.after_transport(&policy(), true, true, 0.0);
        assert_eq!(first, Some(Duration::from_millis(500)));
    }

    #[test]
    fn a_scheduled_retry_arms_its_backoff_timer_and_numbers_its_attempt() {
        let (mut retries, mut reach) = (Retries::default(), FakeReach::new());
        let message = "overloaded".to_owned();
        let (timer, notice) = retries.schedule(
            &mut reach,
            RUN,
            &policy(),
            SECOND,
            Some(529),
            "overloaded",
            message,
        );
        assert!(matches!(
            reach.timers.get(&timer),
            Some((SECOND, TimerOwner::Backoff(RUN)))
        ));
        assert_eq!((notice.attempt, notice.max_retries), (2, 6));
        assert_eq!((notice.status, notice.category), (Some(529), "overloaded"));
        let (_, second) = retries.schedule(
            &mut reach,
            RUN,
            &policy(),
            SECOND,
            None,
            "network",
            String::new(),
        );
        assert_eq!(second.attempt, 3);
    }

    #[test]
    fn retry_after_is_honoured_and_a_client_error_is_not_retried() {
        let retries = Retries::default();
        let retry_after = |name: &str| (name == "retry-after").then(|| "3".to_owned());
        let asked = retries.after_status(&policy(), 429, &retry_after, None, true, 0.9);
        assert_eq!(
            asked,
            Some(Duration::from_secs(3)),
            "the server's delay, no jitter"
        );
        let backoff = retries.after_status(&policy(), 529, &no_headers, None, true, 0.0);
        assert_eq!(backoff, Some(Duration::from_millis(500)));
        assert!(
            retries
                .after_status(&policy(), 400, &no_headers, None, true, 0.0)
                .is_none()
        );
        let quota = Some("insufficient_quota");
        assert!(
            retries
                .after_status(&policy(), 429, &no_headers, quota, true, 0.0)
                .is_none()
        );
    }

    #[test]
    fn nothing_is_resent_once_the_turn_showed_output_or_the_failure_is_permanent() {
        let retries = Retries::default();
        assert!(
            retries
                .after_transport(&policy(), true, false, 0.0)
                .is_none()
        );
        assert!(
            retries
                .after_transport(&policy(), false, true, 0.0)
                .is_none()
        );
        assert!(
            retries
                .after_status(&policy(), 503, &no_headers, None, false, 0.0)
                .is_none()
        );
    }

    fn text(text: &str) -> ModelEvent {
        ModelEvent::TextDelta {
            index: 0,
            text: text.to_owned(),
        }
    }

    #[test]
    fn the_first_output_limit_counts_from_the_start_and_ignores_keep_alives() {
        let t0 = Instant::now();
        let mut quiet = Quiet::new(t0);
        let (first_byte, idle) = (10 * SECOND, 2 * SECOND);
        assert!(
            !quiet.heard(t0 + 4 * SECOND, &[]),
            "a keep-alive decodes to nothing"
        );
        let start = ModelEvent::Start {
            message_id: "m".to_owned(),
            model: "x".to_owned(),
        };
        assert!(
            !quiet.heard(t0 + 5 * SECOND, &[start]),
            "a start is not output"
        );
        assert_eq!(quiet.due(t0 + 6 * SECOND, first_byte, idle), Ok(4 * SECOND));
        assert_eq!(
            quiet.due(t0 + 10 * SECOND, first_byte, idle),
            Err(first_byte)
        );
    }

    #[test]
    fn once_output_started_the_idle_limit_counts_from_the_last_event() {
        let t0 = Instant::now();
        let mut quiet = Quiet::new(t0);
        let (first_byte, idle) = (10 * SECOND, 2 * SECOND);
        assert!(
            quiet.heard(t0 + SECOND, &[text("a")]),
            "output starts: re-arm"
        );
        assert!(!quiet.heard(t0 + 2 * SECOND, &[text("b")]), "only once");
        assert_eq!(quiet.due(t0 + 3 * SECOND, first_byte, idle), Ok(SECOND));
        assert!(!quiet.heard(t0 + 5 * SECOND, &[]));
        assert_eq!(quiet.due(t0 + 5 * SECOND, first_byte, idle), Err(idle));
    }

    fn key() -> conn_pool::Key {
        let target = Target {
            tls: false,
            host: "api.example".to_owned(),
            port: 80,
        };
        conn_pool::Key::new(target, None, None)
    }

    fn parked(conn: u32) -> conn_pool::Parked<u32> {
        conn_pool::Parked {
            conn,
            addrs: Vec::new(),
        }
    }

    /// A pool that saw its first request (so it knows its key) and parked `conns`.
    fn warm(reach: &mut FakeReach, conns: &[u32]) -> Warm<u32> {
        let mut warm = Warm::new(4);
        assert!(!warm.reuse(key, |_| true, |_| true), "nothing parked yet");
        for conn in conns {
            warm.park(reach, parked(*conn), Instant::now());
        }
        warm
    }

    #[test]
    fn a_parked_connection_is_reused_once() {
        let mut reach = FakeReach::new();
        let mut warm = warm(&mut reach, &[7]);
        let mut got = None;
        assert!(warm.reuse(
            key,
            |_| true,
            |p| {
                got = Some(p.conn);
                true
            }
        ));
        assert_eq!(got, Some(7));
        assert!(
            !warm.reuse(key, |_| true, |_| true),
            "the next request dials"
        );
    }

    #[test]
    fn a_connection_the_server_closed_is_dropped_and_the_request_dials() {
        let mut reach = FakeReach::new();
        let mut warm = warm(&mut reach, &[1, 2]);
        let mut offered = Vec::new();
        let dead = |conn: &mut u32| *conn != 2;
        assert!(warm.reuse(key, dead, |p| {
            offered.push(p.conn);
            true
        }));
        assert_eq!(offered, [1], "the live one, newest dead one dropped");
        assert!(!warm.reuse(key, |_| true, |_| panic!("nothing is left")));
    }

    #[test]
    fn a_connection_the_exchange_cannot_take_back_means_a_fresh_dial() {
        let mut reach = FakeReach::new();
        let mut warm = warm(&mut reach, &[1]);
        assert!(!warm.reuse(key, |_| true, |_| false));
        assert!(warm.pool.is_empty());
    }

    #[test]
    fn parking_arms_one_idle_timer_that_rearms_for_the_next_to_expire() {
        let mut reach = FakeReach::new();
        let t0 = Instant::now();
        let mut warm = warm(&mut reach, &[]);
        warm.park(&mut reach, parked(1), t0);
        warm.park(&mut reach, parked(2), t0 + 10 * SECOND);
        let idle: Vec<_> = reach.timers.values().map(|(after, _)| *after).collect();
        assert_eq!(idle, [conn_pool::IDLE_TIMEOUT], "one timer for the pool");
        reach.timers.clear();
        warm.on_timer(&mut reach, t0 + conn_pool::IDLE_TIMEOUT);
        assert_eq!(warm.pool.len(), 1, "the older one closed");
        let next: Vec<_> = reach.timers.values().map(|(after, _)| *after).collect();
        assert_eq!(next, [10 * SECOND]);
        reach.timers.clear();
        warm.on_timer(&mut reach, t0 + conn_pool::IDLE_TIMEOUT + 10 * SECOND);
        assert!(warm.pool.is_empty() && reach.timers.is_empty());
    }

    #[test]
    fn nothing_is_parked_before_a_request_named_the_key() {
        let mut reach = FakeReach::new();
        let mut warm: Warm<u32> = Warm::new(4);
        warm.park(&mut reach, parked(1), Instant::now());
        assert!(warm.pool.is_empty() && reach.timers.is_empty());
    }
}
