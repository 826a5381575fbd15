//! `WebFetch` calls: one GET each (same-site redirects followed), through the proxy the
//! environment names, with `webfetch.block_private` judged on the URL's host and on every
//! address it resolves to, and a body kept up to `MAX_FETCH_BODY`. What a reply comes to
//! is decided by `Reply` and `guard_resolved`, apart from the connection.

use std::net::SocketAddr;
use std::sync::Arc;

use mio::Token;

use super::{Completion, Engine, Owner, Reach, TimerOwner};

use crate::http::client::{ClientEvent, Exchange};
use crate::http::head::ResponseHead;
use crate::ids::{HostKey, RunId};
use crate::reactor::TimerId;
use crate::tools::ToolOutput;
use crate::tools::web::{FetchRequest, MAX_FETCH_BODY};

/// A `WebFetch` call in flight.
pub(super) struct FetchTask {
    pub(super) request: FetchRequest,
    pub(super) exchange: Exchange,
    /// Whether the addresses the host resolves to are judged (`webfetch.block_private`,
    /// dialled directly: through a proxy, only the proxy knows them).
    pub(super) guard_addresses: bool,
    pub(super) deadline: TimerId,
    reply: Reply,
}

/// What a fetch's server answered so far.
#[derive(Default)]
struct Reply {
    status: Option<u16>,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

/// What a complete reply comes to.
enum Next {
    /// A redirect on the same site: fetch this instead.
    Follow(FetchRequest),
    Answer(ToolOutput),
}

impl Reply {
    fn on_head(&mut self, head: ResponseHead) {
        self.status = Some(head.status);
        self.headers = head.headers;
    }

    /// Keeps what fits under `MAX_FETCH_BODY`; whether the body was cut there (the rest is
    /// never read).
    fn take(&mut self, bytes: &[u8]) -> bool {
        let room = MAX_FETCH_BODY - self.body.len();
        self.body.extend_from_slice(&bytes[..room.min(bytes.len())]);
        bytes.len() > room
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// Follows a same-site redirect, or renders the page (`cut` at the cap) for the model.
    fn next(&self, request: &FetchRequest, cut: bool) -> Next {
        let status = self.status.unwrap_or(0);
        if (300..400).contains(&status) && status != 304 {
            return match request.redirect(status, self.header("location")) {
                Ok(next) => Next::Follow(next),
                Err(output) => Next::Answer(output),
            };
        }
        let content_type = self.header("content-type").unwrap_or_default();
        Next::Answer(request.render(status, content_type, &self.body, cut))
    }
}

/// What a fetch that ran out of time answers.
fn timed_out(request: &FetchRequest) -> ToolOutput {
    ToolOutput::error(format!(
        "WebFetch: no complete answer from {} within {} s",
        request.url,
        request.timeout.as_secs()
    ))
}

/// Judges the addresses `host` resolved to when `guard` says so: what is dialled, so a
/// name that resolves (or rebinds) to 127.0.0.1 is refused like the address itself.
fn guard_resolved(
    host: &str,
    guard: bool,
    result: Result<Vec<SocketAddr>, String>,
) -> Result<Vec<SocketAddr>, String> {
    let addrs = match result {
        Ok(addrs) if guard => addrs,
        other => return other,
    };
    let blocked = addrs
        .iter()
        .find_map(|a| crate::netaddr::class(a.ip()).map(|class| (a.ip(), class)));
    match blocked {
        Some((ip, class)) => Err(format!(
            "`{host}` resolves to {ip}, a {class} address, which webfetch.block_private refuses"
        )),
        None => Ok(addrs),
    }
}

/// Why `webfetch.block_private` refuses a URL's host before any lookup: it names this
/// machine (`localhost`) or spells an address of a refused class in any form.
fn blocked_host(host: &str) -> Option<String> {
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
        let token = self.io.token(Owner::Fetch(run, tool_use_id.clone()));
        let proxied = proxy.is_some();
        let exchange = Exchange::new(
            token,
            request.target.clone(),
            proxy,
            tls,
            request.request_bytes(),
        );
        let (host, port) = exchange.dial_target();
        let owner = TimerOwner::Fetch(run, tool_use_id.clone());
        let deadline = self.io.timer(request.timeout, owner);
        slot.fetches.insert(
            tool_use_id.clone(),
            FetchTask {
                request,
                exchange,
                guard_addresses: block_private && !proxied,
                deadline,
                reply: Reply::default(),
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
    fn web_tls(&mut self) -> Result<Arc<rustls::ClientConfig>, String> {
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
        let host = &task.request.target.host;
        let result = guard_resolved(host, task.guard_addresses, result);
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

    fn on_fetch_events(&mut self, run: RunId, id: &str, events: Vec<ClientEvent>) {
        for event in events {
            let Some(task) = self.runs.get_mut(&run).and_then(|s| s.fetches.get_mut(id)) else {
                return;
            };
            match event {
                ClientEvent::Head(head) => task.reply.on_head(head),
                ClientEvent::Body(bytes) => {
                    if task.reply.take(&bytes) {
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
    fn finish_fetch(&mut self, run: RunId, id: &str, cut: bool) {
        let Some(task) = self.runs.get(&run).and_then(|s| s.fetches.get(id)) else {
            return;
        };
        let output = match task.reply.next(&task.request, cut) {
            Next::Follow(next) => {
                self.end_fetch_quietly(run, id);
                return self.start_fetch(run, id.to_owned(), next);
            }
            Next::Answer(output) => output,
        };
        self.end_fetch(run, id, output);
    }

    /// Drops a fetch's connection, token and deadline.
    pub(super) fn end_fetch_quietly(&mut self, run: RunId, id: &str) -> bool {
        let Some(mut task) = self.runs.get_mut(&run).and_then(|s| s.fetches.remove(id)) else {
            return false;
        };
        task.exchange.close(self.io.reactor.registry());
        self.io.forget(task.exchange.token());
        self.io.cancel(task.deadline);
        true
    }

    /// Ends a fetch with its result for the model.
    fn end_fetch(&mut self, run: RunId, id: &str, output: ToolOutput) {
        if self.end_fetch_quietly(run, id) {
            self.tool_done(run, id, output);
        }
    }

    /// A fetch's deadline passed before its answer was complete.
    pub(super) fn on_fetch_timeout(&mut self, run: RunId, id: &str) {
        if let Some(task) = self.runs.get(&run).and_then(|s| s.fetches.get(id)) {
            let output = timed_out(&task.request);
            self.end_fetch(run, id, output);
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn request(url: &str) -> FetchRequest {
        crate::tools::web::parse_input(&json!({ "url": url })).expect("a fetchable url")
    }

    fn reply(status: u16, headers: &[(&str, &str)], body: &[u8]) -> Reply {
        let mut reply = Reply::default();
        reply.on_head(ResponseHead {
            status,
            reason: String::new(),
            headers: headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            minor_version: 1,
        });
        assert!(!reply.take(body));
        reply
    }

    fn answer(next: Next) -> ToolOutput {
        match next {
            Next::Answer(output) => output,
            Next::Follow(next) => panic!("followed to {}", next.url),
        }
    }

    #[test]
    fn the_body_is_cut_at_the_cap_and_the_rest_never_kept() {
        let mut reply = Reply::default();
        let chunk = vec![b'a'; 64 * 1024];
        let mut cut = false;
        while !cut {
            cut = reply.take(&chunk);
            assert!(reply.body.len() <= MAX_FETCH_BODY);
        }
        assert_eq!(reply.body.len(), MAX_FETCH_BODY);
        assert!(reply.take(b"more"), "a full body takes nothing more");
        assert_eq!(reply.body.len(), MAX_FETCH_BODY);
    }

    #[test]
    fn a_body_that_exactly_fills_the_cap_is_not_cut() {
        let mut reply = Reply::default();
        assert!(!reply.take(&vec![b'a'; MAX_FETCH_BODY]));
        assert!(reply.take(b"x"), "one byte more is");
    }

    #[test]
    fn this_machine_and_private_addresses_are_refused_before_any_lookup() {
        assert_eq!(
            blocked_host("localhost").as_deref(),
            Some("`localhost` is this machine, which webfetch.block_private refuses")
        );
        let loopback = blocked_host("127.0.0.1").expect("refused");
        assert!(
            loopback.starts_with("`127.0.0.1` is 127.0.0.1, a "),
            "{loopback}"
        );
        assert!(blocked_host("10.1.2.3").is_some());
        assert!(blocked_host("169.254.169.254").is_some(), "cloud metadata");
        assert!(blocked_host("::1").is_some());
        assert!(blocked_host("example.com").is_none());
        assert!(blocked_host("93.184.216.34").is_none());
    }

    #[test]
    fn a_name_resolving_to_a_private_address_is_refused_when_guarded() {
        let private: Vec<SocketAddr> = vec![
            "93.184.216.34:80".parse().unwrap(),
            "10.0.0.5:80".parse().unwrap(),
        ];
        let refused = guard_resolved("intranet.example", true, Ok(private.clone()));
        let refused = refused.expect_err("refused");
        assert!(
            refused.starts_with("`intranet.example` resolves to 10.0.0.5, a "),
            "{refused}"
        );
        assert!(refused.ends_with(" address, which webfetch.block_private refuses"));
        assert_eq!(guard_resolved("h", false, Ok(private.clone())), Ok(private));
        let public: Vec<SocketAddr> = vec!["93.184.216.34:443".parse().unwrap()];
        assert_eq!(guard_resolved("h", true, Ok(public.clone())), Ok(public));
        let failed = guard_resolved("h", true, Err("no such host".to_owned()));
        assert_eq!(failed, Err("no such host".to_owned()));
    }

    #[test]
    fn a_same_site_redirect_is_followed_and_another_site_is_named() {
        let req = request("http://example.com/docs/a");
        let moved = reply(301, &[("Location", "/docs/b")], b"");
        match moved.next(&req, false) {
            Next::Follow(next) => {
                assert_eq!(next.url, "http://example.com/docs/b");
                assert_eq!(next.redirects, req.redirects + 1);
            }
            Next::Answer(output) => panic!("answered: {}", output.text),
        }
        let away = reply(302, &[("location", "https://other.example/x")], b"");
        let named = answer(away.next(&req, false));
        assert!(!named.is_error);
        assert!(
            named
                .text
                .contains("redirects (302) to another site: https://other.example/x")
        );
        let nowhere = answer(reply(307, &[], b"").next(&req, false));
        assert!(nowhere.is_error && nowhere.text.ends_with("answered 307 with no Location"));
    }

    #[test]
    fn a_page_is_rendered_with_its_content_type_and_304_is_no_redirect() {
        let req = request("http://example.com/");
        let page = reply(200, &[("Content-Type", "text/plain")], b"hello there");
        let output = answer(page.next(&req, false));
        assert!(output.text.contains("hello there"), "{}", output.text);
        let cut = answer(page.next(&req, true));
        assert!(cut.text.contains(", cut at 10 MB"), "{}", cut.text);
        let unchanged = reply(304, &[("location", "/elsewhere")], b"");
        assert!(matches!(unchanged.next(&req, false), Next::Answer(_)));
    }

    #[test]
    fn a_fetch_out_of_time_names_its_url_and_limit() {
        let req = request("http://example.com/slow");
        let output = timed_out(&req);
        assert!(output.is_error);
        assert_eq!(
            output.text,
            format!(
                "WebFetch: no complete answer from http://example.com/slow within {} s",
                req.timeout.as_secs()
            )
        );
    }
}
