use super::{Completion, Engine, Owner, TimerOwner};
use crate::http::client::{ClientEvent, Exchange};
use crate::ids::{HostKey, RunId};
use crate::reactor::TimerId;
use crate::tools::ToolOutput;
use crate::tools::web::{FetchRequest, MAX_FETCH_BODY};
use mio::Token;
use std::sync::Arc;

/// A `WebFetch` call in flight.
pub(super) struct FetchTask {
    pub(super) request: FetchRequest,
    pub(super) exchange: Exchange,
    /// Whether the addresses the host resolves to are judged (`webfetch.block_private`,
    /// dialled directly: through a proxy, only the proxy knows them).
    pub(super) guard_addresses: bool,
    pub(super) deadline: TimerId,
    pub(super) status: Option<u16>,
    pub(super) headers: Vec<(String, String)>,
    pub(super) body: Vec<u8>,
}

/// Why `webfetch.block_private` refuses a URL's host before any lookup: it names this
/// machine (`localhost`) or spells an address of a refused class in any form.
pub(super) fn blocked_host(host: &str) -> Option<String> {
    if crate::netaddr::is_localhost_name(host) {
        return Some(format!(
            "`{host}` is this machine, which webfetch.block_private refuses"
        ));
    }
    let ip = crate::netaddr::parse_ip(host)?;
    let class = crate::netaddr::class(ip)?;
    Some(format!(
        "`{host}` is {ip}, a {class} address, which webfetch.block_private refuses"
    ))
}

impl FetchTask {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

impl<K: HostKey> Engine<K> {
    /// Starts (or, after a same-site redirect, restarts) a `WebFetch` call's GET.
    pub(super) fn start_fetch(&mut self, run: RunId, tool_use_id: String, request: FetchRequest) {
        let block_private = self.config.webfetch_block_private;
        if block_private && let Some(why) = blocked_host(&request.target.host) {
            let output = ToolOutput::error(format!("WebFetch: {why}"));
            return self.tool_done(run, &tool_use_id, output);
        }
        let proxy =
            match crate::http::client::proxy_for(&request.target, &|name| std::env::var(name).ok())
            {
                Ok(proxy) => proxy,
                Err(e) => {
                    return self.tool_done(
                        run,
                        &tool_use_id,
                        ToolOutput::error(format!("WebFetch: {e}")),
                    );
                }
            };
        let tls = if request.target.tls {
            match self.web_tls() {
                Ok(tls) => Some(tls),
                Err(e) => {
                    let output = ToolOutput::error(format!("WebFetch: TLS: {e}"));
                    return self.tool_done(run, &tool_use_id, output);
                }
            }
        } else {
            None
        };
        let Some(slot) = self.runs.get_mut(&run) else {
            return;
        };
        let token = self.io.reactor.token();
        let proxied = proxy.is_some();
        let exchange = Exchange::new(
            token,
            request.target.clone(),
            proxy,
            tls,
            request.request_bytes(),
        );
        let (host, port) = exchange.dial_target();
        let deadline = self.io.reactor.add_timer(request.timeout);
        self.io
            .timers
            .insert(deadline, TimerOwner::Fetch(run, tool_use_id.clone()));
        self.io
            .owners
            .insert(token, Owner::Fetch(run, tool_use_id.clone()));
        slot.fetches.insert(
            tool_use_id.clone(),
            FetchTask {
                request,
                exchange,
                guard_addresses: block_private && !proxied,
                deadline,
                status: None,
                headers: Vec::new(),
                body: Vec::new(),
            },
        );
        let id = tool_use_id.clone();
        let done = move |result| Completion::FetchResolved {
            run,
            tool_use_id: id,
            token,
            result,
        };
        if let Some(now) = self.look_up(host, port, done) {
            self.on_fetch_resolved(run, &tool_use_id, token, now);
        }
    }

    /// The roots and settings `WebFetch` trusts: the model client's, or loaded once.
    pub(super) fn web_tls(&mut self) -> Result<Arc<rustls::ClientConfig>, String> {
        if let Some(tls) = self.web_tls.as_ref().or(self.config.provider.tls.as_ref()) {
            return Ok(Arc::clone(tls));
        }
        // Once per process: reading the system's CA bundle is the one blocking step.
        let (tls, _) = crate::transport::client_config()?;
        self.web_tls = Some(Arc::clone(&tls));
        Ok(tls)
    }

    pub(super) fn on_fetch_resolved(
        &mut self,
        run: RunId,
        id: &str,
        token: Token,
        result: Result<Vec<std::net::SocketAddr>, String>,
    ) {
        let Some(task) = self
            .runs
            .get_mut(&run)
            .and_then(|s| s.fetches.get_mut(id))
            .filter(|t| t.exchange.token() == token)
        else {
            return;
        };
        // Judged on what is dialled, so a name that resolves (or rebinds) to 127.0.0.1 is
        // refused like the address itself.
        let result = match result {
            Ok(addrs) if task.guard_addresses => {
                let blocked = addrs
                    .iter()
                    .find_map(|a| crate::netaddr::class(a.ip()).map(|class| (a.ip(), class)));
                match blocked {
                    Some((ip, class)) => Err(format!(
                        "`{}` resolves to {ip}, a {class} address, which \
                         webfetch.block_private refuses",
                        task.request.target.host
                    )),
                    None => Ok(addrs),
                }
            }
            other => other,
        };
        let mut events = Vec::new();
        task.exchange
            .on_resolved(self.io.reactor.registry(), result, &mut events);
        self.on_fetch_events(run, id, events);
    }

    pub(super) fn on_fetch_ready(&mut self, run: RunId, id: &str) {
        let Some(task) = self.runs.get_mut(&run).and_then(|s| s.fetches.get_mut(id)) else {
            return;
        };
        let mut events = Vec::new();
        task.exchange
            .on_ready(self.io.reactor.registry(), &mut events);
        self.on_fetch_events(run, id, events);
    }

    pub(super) fn on_fetch_events(&mut self, run: RunId, id: &str, events: Vec<ClientEvent>) {
        for event in events {
            let Some(task) = self.runs.get_mut(&run).and_then(|s| s.fetches.get_mut(id)) else {
                return;
            };
            match event {
                ClientEvent::Head(head) => {
                    task.status = Some(head.status);
                    task.headers = head.headers;
                }
                ClientEvent::Body(bytes) => {
                    let room = MAX_FETCH_BODY - task.body.len();
                    task.body.extend_from_slice(&bytes[..room.min(bytes.len())]);
                    if bytes.len() > room {
                        // Enough: the rest is never read.
                        return self.finish_fetch(run, id, true);
                    }
                }
                ClientEvent::End => return self.finish_fetch(run, id, false),
                ClientEvent::Failed { error, .. } => {
                    let output =
                        ToolOutput::error(format!("WebFetch: {}: {error}", task.request.url));
                    return self.end_fetch(run, id, output);
                }
            }
        }
    }

    /// The response is complete (or `cut` at the cap): follow a same-site redirect, or
    /// answer with the page.
    pub(super) fn finish_fetch(&mut self, run: RunId, id: &str, cut: bool) {
        let Some(task) = self.runs.get(&run).and_then(|s| s.fetches.get(id)) else {
            return;
        };
        let status = task.status.unwrap_or(0);
        let output = if (300..400).contains(&status) && status != 304 {
            match task.request.redirect(status, task.header("location")) {
                Ok(next) => {
                    self.end_fetch_quietly(run, id);
                    return self.start_fetch(run, id.to_owned(), next);
                }
                Err(output) => output,
            }
        } else {
            let content_type = task.header("content-type").unwrap_or_default();
            task.request.render(status, content_type, &task.body, cut)
        };
        self.end_fetch(run, id, output);
    }

    /// Drops a fetch's connection, token and deadline.
    pub(super) fn end_fetch_quietly(&mut self, run: RunId, id: &str) -> bool {
        let Some(mut task) = self.runs.get_mut(&run).and_then(|s| s.fetches.remove(id)) else {
            return false;
        };
        task.exchange.close(self.io.reactor.registry());
        self.io.owners.remove(&task.exchange.token());
        self.io.timers.remove(&task.deadline);
        self.io.reactor.cancel_timer(task.deadline);
        true
    }

    /// Ends a fetch with its result for the model.
    pub(super) fn end_fetch(&mut self, run: RunId, id: &str, output: ToolOutput) {
        if self.end_fetch_quietly(run, id) {
            self.tool_done(run, id, output);
        }
    }
}
