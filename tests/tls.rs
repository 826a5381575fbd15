//! TLS and proxy paths end to end: the real binary talks HTTPS to a TLS-terminating relay (a
//! thread of the test, `util::tls`, serving `tests/fixtures/server.pem`) that pipes plaintext to
//! `caliban stub-model`, optionally through a CONNECT proxy thread. Trust comes only from
//! `SSL_CERT_FILE` pointing at the fixture CA; everything stays on loopback.

use std::net::{SocketAddr, TcpListener};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::util::http::fixture;
use crate::util::tls::*;
use crate::util::*;

fn stub_addr(stub: &Stub) -> SocketAddr {
    stub.url
        .trim_start_matches("http://")
        .parse()
        .expect("stub address")
}

/// A `caliban -p` command aimed at `base_url` on the Anthropic wire, trusting `ca`.
fn https_cmd(ws: &Workspace, base_url: &str, ca: &str) -> Command {
    let mut cmd = caliban(ws);
    cmd.env("ANTHROPIC_BASE_URL", base_url)
        .env("ANTHROPIC_API_KEY", "test-key")
        .env("SSL_CERT_FILE", fixture(ca));
    cmd
}

/// Runs a command that should fail fast (no retries), returning its output and duration.
fn run_failing(mut cmd: Command) -> (Output, Duration) {
    cmd.args(["--max-retries", "0", "--output-format", "json", "-p", "hi"]);
    let start = Instant::now();
    let out = run(cmd, "");
    (out, start.elapsed())
}

#[test]
fn https_model_endpoint_through_tls_relay() {
    let ws = Workspace::new("tls-ok");
    let stub = Stub::start(&ws, &script([Turn::text("Hello over TLS.")]));
    let relay = tls_relay(stub_addr(&stub));
    let base = format!("https://localhost:{}", relay.port());
    let mut cmd = https_cmd(&ws, &base, "ca.pem");
    cmd.args(["-p", "say hello"]);
    let out = run(cmd, "");
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(out.stdout, "Hello over TLS.\n");
    let reqs = stub.requests();
    assert_eq!(reqs.len(), 1, "{reqs:?}");
    assert_eq!(reqs[0]["headers"]["x-api-key"], "test-key");
    assert_eq!(
        reqs[0]["headers"]["host"],
        format!("localhost:{}", relay.port())
    );
    assert!(
        !relay.seen().iter().any(|s| s.starts_with("tls error")),
        "{:?}",
        relay.seen()
    );
}

#[test]
fn https_ip_address_endpoint_on_openai_wire() {
    let ws = Workspace::new("tls-ip");
    let stub = Stub::start(&ws, &script([Turn::text("Hello by address.")]));
    let relay = tls_relay(stub_addr(&stub));
    let mut cmd = caliban(&ws);
    cmd.env(
        "OPENAI_BASE_URL",
        format!("https://127.0.0.1:{}/v1", relay.port()),
    )
    .env("OPENAI_API_KEY", "test-key")
    .env("SSL_CERT_FILE", fixture("ca.pem"))
    .args(["-p", "say hello"]);
    let out = run(cmd, "");
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(out.stdout, "Hello by address.\n");
    let reqs = stub.requests();
    assert_eq!(reqs.len(), 1, "{reqs:?}");
    assert_eq!(reqs[0]["headers"]["authorization"], "Bearer test-key");
}

/// A request body far beyond rustls's 64 KiB send buffers must still go out whole: the
/// client has to keep feeding the TLS session until the socket would block, including right
/// after the handshake completes inside a read. Servers that send nothing after their
/// Finished (TLS 1.2, or TLS 1.3 without session tickets) give it no second chance.
#[test]
fn https_large_request_body_is_sent_whole() {
    let ws = Workspace::new("tls-big");
    let stub = Stub::start(
        &ws,
        &Script::new([Turn::text("Got it all.")])
            .repeat_last()
            .json(),
    );
    let line = "the quick brown fox jumps over the lazy dog 0123456789\n";
    let prompt = line.repeat(1024 * 1024 / line.len());
    let servers = [
        ("tls1.3 with tickets", server_config()),
        (
            "tls1.3 without tickets",
            server_config_for(&[&rustls::version::TLS13], 0),
        ),
        ("tls1.2", server_config_for(&[&rustls::version::TLS12], 0)),
    ];
    for (i, (name, config)) in servers.into_iter().enumerate() {
        let relay = tls_relay_with(stub_addr(&stub), config);
        let base = format!("https://localhost:{}", relay.port());
        let mut cmd = https_cmd(&ws, &base, "ca.pem");
        // Short enough that a stalled upload fails the test quickly instead of hanging it.
        cmd.args(["--first-byte-timeout", "15", "--max-retries", "0", "-p"]);
        let out = run(cmd, &prompt);
        assert_eq!(out.code, Some(0), "{name}: {out:?}");
        assert_eq!(out.stdout, "Got it all.\n", "{name}");
        let reqs = stub.requests();
        assert_eq!(reqs.len(), i + 1, "{name}");
        let sent = reqs[i]["body"]["messages"][0].to_string();
        assert!(
            sent.matches("lazy dog").count() >= prompt.matches("lazy dog").count(),
            "{name}: prompt arrived truncated ({} bytes of message JSON)",
            sent.len()
        );
    }
}

#[test]
fn unusable_ssl_cert_file_is_a_config_error() {
    let ws = Workspace::new("tls-badfile");
    for (file, why) in [
        ("does-not-exist.pem", "No such file"),
        ("server-key.pem", "no usable certificates"),
    ] {
        let mut cmd = caliban(&ws);
        cmd.env("ANTHROPIC_BASE_URL", "https://localhost:9")
            .env("ANTHROPIC_API_KEY", "test-key")
            .env("SSL_CERT_FILE", fixture(file));
        let (out, took) = run_failing(cmd);
        assert_eq!(out.code, Some(78), "{out:?}");
        assert!(out.stderr.contains("SSL_CERT_FILE="), "{out:?}");
        assert!(out.stderr.contains(file), "{out:?}");
        assert!(out.stderr.contains(why), "{out:?}");
        assert!(took < Duration::from_secs(10), "took {took:?}");
    }
}

#[test]
fn server_cert_from_an_untrusted_ca_is_rejected() {
    let ws = Workspace::new("tls-untrusted");
    let stub = Stub::start(&ws, &script([Turn::text("never")]));
    let relay = tls_relay(stub_addr(&stub));
    let base = format!("https://localhost:{}", relay.port());
    let (out, took) = run_failing(https_cmd(&ws, &base, "other-ca.pem"));
    assert_eq!(out.code, Some(1), "{out:?}");
    let result = out.result();
    assert_eq!(result["is_error"], true, "{out:?}");
    let message = result.to_string().to_ascii_lowercase();
    assert!(
        message.contains("tls") && message.contains("certificate"),
        "{out:?}"
    );
    assert!(took < Duration::from_secs(20), "took {took:?}");
    assert!(stub.requests().is_empty(), "nothing may reach the model");
}

#[test]
fn certificate_errors_are_not_retried() {
    // An untrusted certificate fails the same way every time: no backoff, no api_retry.
    let ws = Workspace::new("tls-noretry");
    let stub = Stub::start(&ws, &script([Turn::text("never")]));
    let relay = tls_relay(stub_addr(&stub));
    let base = format!("https://localhost:{}", relay.port());
    let mut cmd = https_cmd(&ws, &base, "other-ca.pem");
    cmd.args(["--output-format", "stream-json", "-p", "hi"]);
    let out = run(cmd, "");
    assert_eq!(out.code, Some(1), "{out:?}");
    let frames = out.frames();
    assert!(
        !frames.iter().any(|f| f["subtype"] == "api_retry"),
        "a certificate error was retried: {out:?}"
    );
}

#[test]
fn wrong_host_name_is_rejected() {
    // The relay's cert names localhost and 127.0.0.1 only; 127.0.0.2 is also loopback.
    let ws = Workspace::new("tls-name");
    let stub = Stub::start(&ws, &script([Turn::text("never")]));
    let listener = TcpListener::bind("127.0.0.2:0");
    let Ok(listener) = listener else {
        eprintln!("skipping: cannot bind 127.0.0.2");
        return;
    };
    let port = listener.local_addr().expect("addr").port();
    let config = server_config();
    let upstream = stub_addr(&stub);
    std::thread::spawn(move || {
        if let Some(Ok(tcp)) = listener.incoming().next() {
            let _ = relay(tcp, config, upstream);
        }
    });
    let base = format!("https://127.0.0.2:{port}");
    let (out, took) = run_failing(https_cmd(&ws, &base, "ca.pem"));
    assert_eq!(out.code, Some(1), "{out:?}");
    let message = out.result().to_string().to_ascii_lowercase();
    assert!(
        message.contains("certificate not valid for name"),
        "{out:?}"
    );
    assert!(took < Duration::from_secs(20), "took {took:?}");
    assert!(stub.requests().is_empty());
}

#[test]
fn https_proxy_tunnels_with_connect() {
    let ws = Workspace::new("tls-proxy");
    let stub = Stub::start(&ws, &script([Turn::text("Hello via proxy.")]));
    let relay = tls_relay(stub_addr(&stub));
    let proxy = connect_proxy(ProxyMode::Tunnel);
    let base = format!("https://localhost:{}", relay.port());
    let mut cmd = https_cmd(&ws, &base, "ca.pem");
    cmd.env("HTTPS_PROXY", format!("http://127.0.0.1:{}", proxy.port()))
        .args(["-p", "say hello"]);
    let out = run(cmd, "");
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(out.stdout, "Hello via proxy.\n");
    assert_eq!(
        proxy.seen(),
        [format!("CONNECT localhost:{} HTTP/1.1", relay.port())]
    );
    let reqs = stub.requests();
    assert_eq!(reqs.len(), 1);
    assert_eq!(reqs[0]["headers"]["x-api-key"], "test-key");
}

#[test]
fn lowercase_https_proxy_and_scheme_less_url_work() {
    let ws = Workspace::new("tls-proxy-lc");
    let stub = Stub::start(&ws, &script([Turn::text("lower case")]));
    let relay = tls_relay(stub_addr(&stub));
    let proxy = connect_proxy(ProxyMode::Tunnel);
    let base = format!("https://127.0.0.1:{}", relay.port());
    let mut cmd = https_cmd(&ws, &base, "ca.pem");
    cmd.env("https_proxy", format!("127.0.0.1:{}", proxy.port()))
        .args(["-p", "hi"]);
    let out = run(cmd, "");
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(
        proxy.seen(),
        [format!("CONNECT 127.0.0.1:{} HTTP/1.1", relay.port())]
    );
}

#[test]
fn http_proxy_tunnels_plain_http() {
    let ws = Workspace::new("http-proxy");
    let stub = Stub::start(&ws, &script([Turn::text("plain via proxy")]));
    let proxy = connect_proxy(ProxyMode::Tunnel);
    let mut cmd = caliban(&ws);
    anthropic(&mut cmd, &stub);
    cmd.env("HTTP_PROXY", format!("http://127.0.0.1:{}", proxy.port()))
        .args(["-p", "hi"]);
    let out = run(cmd, "");
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(out.stdout, "plain via proxy\n");
    let authority = stub.url.trim_start_matches("http://");
    assert_eq!(proxy.seen(), [format!("CONNECT {authority} HTTP/1.1")]);
}

#[test]
fn connect_brackets_ipv6_targets() {
    // The proxy stands in for the IPv6 route, so this host needs no IPv6 at all.
    let ws = Workspace::new("proxy-v6");
    let stub = Stub::start(&ws, &script([Turn::text("v6 via proxy")]));
    let proxy = connect_proxy(ProxyMode::TunnelTo(stub_addr(&stub)));
    let mut cmd = caliban(&ws);
    cmd.env("ANTHROPIC_BASE_URL", "http://[::1]:8099")
        .env("HTTP_PROXY", format!("http://127.0.0.1:{}", proxy.port()))
        .args(["-p", "hi"]);
    let out = run(cmd, "");
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(out.stdout, "v6 via proxy\n");
    assert_eq!(proxy.seen(), ["CONNECT [::1]:8099 HTTP/1.1"]);
    assert_eq!(stub.requests()[0]["headers"]["host"], "[::1]:8099");
}

#[test]
fn no_proxy_bypasses_the_proxy() {
    let ws = Workspace::new("tls-noproxy");
    let stub = Stub::start(
        &ws,
        &Script::new([Turn::text("direct")]).repeat_last().json(),
    );
    let relay = tls_relay(stub_addr(&stub));
    let proxy = connect_proxy(ProxyMode::Tunnel);
    for (name, value) in [
        ("NO_PROXY", "localhost"),
        ("no_proxy", "example.com, localhost"),
        ("NO_PROXY", "*"),
        ("NO_PROXY", "LocalHost"),
    ] {
        let base = format!("https://localhost:{}", relay.port());
        let mut cmd = https_cmd(&ws, &base, "ca.pem");
        cmd.env("HTTPS_PROXY", format!("http://127.0.0.1:{}", proxy.port()))
            .env(name, value)
            .args(["-p", "hi"]);
        let out = run(cmd, "");
        assert_eq!(out.code, Some(0), "{name}={value}: {out:?}");
        assert_eq!(out.stdout, "direct\n");
    }
    assert!(proxy.seen().is_empty(), "{:?}", proxy.seen());
    assert_eq!(stub.requests().len(), 4);
}

#[test]
fn proxy_refusing_connect_fails_clearly() {
    for status in ["407 Proxy Authentication Required", "403 Forbidden"] {
        let ws = Workspace::new("tls-refused");
        let stub = Stub::start(&ws, &script([Turn::text("never")]));
        let relay = tls_relay(stub_addr(&stub));
        let proxy = connect_proxy(ProxyMode::Refuse(status));
        let base = format!("https://localhost:{}", relay.port());
        let mut cmd = https_cmd(&ws, &base, "ca.pem");
        cmd.env("HTTPS_PROXY", format!("http://127.0.0.1:{}", proxy.port()));
        let (out, took) = run_failing(cmd);
        assert_eq!(out.code, Some(1), "{out:?}");
        let result = out.result();
        assert_eq!(result["is_error"], true);
        let message = result.to_string();
        assert!(message.contains("proxy refused CONNECT"), "{out:?}");
        assert!(message.contains(status), "{out:?}");
        assert!(took < Duration::from_secs(20), "took {took:?}");
        assert_eq!(
            proxy.seen(),
            [format!("CONNECT localhost:{} HTTP/1.1", relay.port())]
        );
        assert!(relay.seen().is_empty(), "the proxy must not have tunnelled");
        assert!(stub.requests().is_empty());
    }
}

#[test]
fn unreachable_proxy_fails_clearly() {
    let ws = Workspace::new("tls-proxy-down");
    // A port that was free a moment ago: connecting to it is refused.
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port();
    let mut cmd = https_cmd(&ws, "https://localhost:9", "ca.pem");
    cmd.env("HTTPS_PROXY", format!("http://127.0.0.1:{port}"));
    let (out, took) = run_failing(cmd);
    assert_eq!(out.code, Some(1), "{out:?}");
    let message = out.result().to_string();
    assert!(
        message.contains(&format!("cannot connect to 127.0.0.1:{port}")),
        "{out:?}"
    );
    assert!(took < Duration::from_secs(20), "took {took:?}");
}

/// WebFetch of an `https://` URL verifies the site with the roots the model client trusts
/// (`SSL_CERT_FILE` here), even when the model itself is reached over plain HTTP.
#[test]
fn web_fetch_over_https_verifies_the_site() {
    let ws = Workspace::new("tls-webfetch");
    let site = crate::util::web_server();
    let relay = tls_relay(site.trim_start_matches("http://").parse().expect("site"));
    let fetch = |id: &str, host: &str| {
        let url = format!("https://{host}:{}/page", relay.port());
        Call::new(id, "WebFetch", json!({ "url": url }))
    };
    let stub = Stub::start(
        &ws,
        &script([
            Turn::bare().calling([fetch("f1", "localhost")]),
            Turn::text("read it"),
            Turn::bare().calling([fetch("f2", "localhost")]),
            Turn::text("refused"),
        ]),
    );
    for (ca, id) in [("ca.pem", "f1"), ("other-ca.pem", "f2")] {
        let mut cmd = caliban(&ws);
        cmd.env("ANTHROPIC_BASE_URL", &stub.url)
            .env("SSL_CERT_FILE", fixture(ca))
            .args(["-p", "--allow", "WebFetch(domain:localhost)", "fetch"]);
        let out = run(cmd, "");
        assert_eq!(out.code, Some(0), "{out:?}");
        let (failed, text) = crate::util::tool_result(&stub, id);
        if id == "f1" {
            assert!(!failed, "{text}");
            assert!(
                text.contains("(200, text/html") && text.contains("Release notes"),
                "{text}"
            );
        } else {
            assert!(failed, "an untrusted certificate is refused: {text}");
        }
    }
}

/// The turns of a run reuse one TLS connection (one handshake at the relay), and through a
/// proxy one tunnel (one CONNECT).
#[test]
fn https_turns_share_one_connection_and_one_tunnel() {
    let read = Turn::bare().calling([Call::read("t1", "a.txt")]);
    for via_proxy in [false, true] {
        let ws = Workspace::new("tls-keepalive");
        ws.write("a.txt", "alpha\n");
        let stub = Stub::start(&ws, &script([read.clone(), Turn::text("done")]));
        let relay = tls_relay(stub_addr(&stub));
        let proxy = connect_proxy(ProxyMode::Tunnel);
        let base = format!("https://localhost:{}", relay.port());
        let mut cmd = https_cmd(&ws, &base, "ca.pem");
        if via_proxy {
            cmd.env("HTTPS_PROXY", format!("http://127.0.0.1:{}", proxy.port()));
        }
        cmd.args(["--max-retries", "0", "-p", "read a.txt"]);
        let out = run(cmd, "");
        assert_eq!(out.code, Some(0), "{out:?}");
        assert_eq!(out.stdout, "done\n");
        assert_eq!(relay.seen(), ["accepted"], "one TLS connection");
        let tunnels = if via_proxy {
            vec![format!("CONNECT localhost:{} HTTP/1.1", relay.port())]
        } else {
            Vec::new()
        };
        assert_eq!(proxy.seen(), tunnels);
        let conns: Vec<Value> = stub
            .requests()
            .iter()
            .map(|r| r["connection"].clone())
            .collect();
        assert_eq!(conns, [json!(1), json!(1)]);
    }
}
