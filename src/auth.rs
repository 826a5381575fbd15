//! The auth gate every network surface shares (`reference/upstream-caliban.md` §7, DESIGN §4.6).
//!
//! Loopback peers are open. A remote peer must present `Authorization: Bearer <token>` where the
//! token is `CALIBAN_DRIVE_TOKEN`; binding a non-loopback address with no token configured is
//! refused, so a misconfigured server fails closed at startup instead of serving the network
//! openly. Pure policy: no I/O, no sockets, no clock; the surface classifies its peer's address,
//! hands over the raw `Authorization` header and acts on the `Decision`.
//!
//! Divergences from upstream, both deliberate:
//! - IPv4-mapped IPv6 loopback (`::ffff:127.x.y.z`, what a dual-stack `[::]` listener reports for
//!   an IPv4 loopback client) counts as loopback; std's `is_loopback` says it does not.
//! - The token comparison hides the token's length as well as its content (see `authorize`).

use std::fmt;
use std::net::{IpAddr, SocketAddr};

use ring::hmac;
use ring::rand::SystemRandom;

/// The environment variable holding the bearer token remote peers must present.
pub const TOKEN_ENV: &str = "CALIBAN_DRIVE_TOKEN";

/// FOR TESTS ONLY: when this is `1`, the gate classifies loopback peers as remote, so an
/// integration test can exercise bearer-token auth without leaving the loopback interface
/// (which is the only network a test may use). It does not affect `check_bind`. Never set it
/// in a deployment: with it, a loopback client needs the token like any remote one (the gate
/// only gets stricter, never looser, but the behaviour is not what an operator expects).
pub const TEST_LOOPBACK_IS_REMOTE_ENV: &str = "CALIBAN_TEST_LOOPBACK_IS_REMOTE";

/// The exact prefix of an `Authorization` header carrying a bearer token (case-sensitive, one
/// space, as upstream). What follows it is the token, untrimmed.
const BEARER_PREFIX: &str = "Bearer ";

const BIND_REFUSED: &str = "refusing to bind a drive surface to a non-loopback address without a bearer token (set CALIBAN_DRIVE_TOKEN)";

/// Where a connection comes from, as far as auth cares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Peer {
    Loopback,
    Remote,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    Allow,
    Deny(DenyReason),
}

/// Why a remote peer was turned away. Surfaces log these; HTTP answers every denial with the
/// same 401 `unauthorized` so a client cannot tell a wrong token from a missing one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DenyReason {
    MissingToken,
    BadToken,
    NoTokenConfigured,
}

impl DenyReason {
    pub fn as_str(self) -> &'static str {
        match self {
            DenyReason::MissingToken => "missing bearer token",
            DenyReason::BadToken => "invalid bearer token",
            DenyReason::NoTokenConfigured => {
                "remote connections require a bearer token, but none is configured"
            }
        }
    }
}

impl fmt::Display for DenyReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A configured token, kept only as an HMAC tag under a per-process random key. The drive
/// gate's, and the networked agent's bearer preamble (`surface::front::line`).
#[derive(Clone)]
pub(crate) struct Token {
    key: hmac::Key,
    tag: hmac::Tag,
}

/// The auth policy of one listener, built once at startup from the environment.
#[derive(Clone)]
pub struct Gate {
    token: Option<Token>,
    loopback_is_remote: bool,
}

impl fmt::Debug for Gate {
    // Never prints the token, nor anything derived from it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let token = if self.token.is_some() {
            "<set>"
        } else {
            "<unset>"
        };
        f.debug_struct("Gate")
            .field("token", &format_args!("{token}"))
            .field("loopback_is_remote", &self.loopback_is_remote)
            .finish()
    }
}

impl Gate {
    /// Reads `CALIBAN_DRIVE_TOKEN` (trimmed; empty or all-whitespace means no token) and the
    /// test-only `CALIBAN_TEST_LOOPBACK_IS_REMOTE` through `env`, so tests need not touch the
    /// process environment.
    pub fn from_env(env: &dyn Fn(&str) -> Option<String>) -> Gate {
        let token = env(TOKEN_ENV)
            .map(|t| t.trim().to_owned())
            .filter(|t| !t.is_empty())
            .map(|t| Token::new(t.as_bytes()));
        let loopback_is_remote = env(TEST_LOOPBACK_IS_REMOTE_ENV).as_deref() == Some("1");
        Gate {
            token,
            loopback_is_remote,
        }
    }

    #[cfg(test)]
    pub fn token_configured(&self) -> bool {
        self.token.is_some()
    }

    /// Classifies a peer address: 127.0.0.0/8, `::1` and IPv4-mapped `::ffff:127.x.y.z` are
    /// loopback, everything else is remote (everything is remote under the test seam).
    pub fn classify(&self, addr: &IpAddr) -> Peer {
        if is_loopback(addr) && !self.loopback_is_remote {
            Peer::Loopback
        } else {
            Peer::Remote
        }
    }

    /// Decides whether a request may proceed, given its peer and its raw `Authorization`
    /// header. Loopback is always allowed and its header is never looked at.
    pub fn authorize(&self, peer: Peer, authorization_header: Option<&str>) -> Decision {
        if peer == Peer::Loopback {
            return Decision::Allow;
        }
        let Some(token) = &self.token else {
            return Decision::Deny(DenyReason::NoTokenConfigured);
        };
        let Some(presented) = authorization_header.and_then(|h| h.strip_prefix(BEARER_PREFIX))
        else {
            return Decision::Deny(DenyReason::MissingToken);
        };
        if token.matches(presented.as_bytes()) {
            Decision::Allow
        } else {
            Decision::Deny(DenyReason::BadToken)
        }
    }

    /// `classify` then `authorize`: the one call a surface makes per request.
    #[cfg(test)]
    pub fn check(&self, peer_addr: &IpAddr, authorization_header: Option<&str>) -> Decision {
        self.authorize(self.classify(peer_addr), authorization_header)
    }

    /// Fails closed: a listener on a non-loopback address (including the wildcards `0.0.0.0`
    /// and `::`) needs a token. Judged on the real address; the test seam does not apply.
    pub fn check_bind(&self, addr: &SocketAddr) -> Result<(), String> {
        if is_loopback(&addr.ip()) || self.token.is_some() {
            Ok(())
        } else {
            Err(BIND_REFUSED.to_owned())
        }
    }

    /// Loopback needs no token, which a web page could exploit: it can send requests to
    /// 127.0.0.1 (simple cross-origin POSTs), or rebind its own host name to 127.0.0.1. A
    /// browser always says where it came from, so a loopback request must name a loopback
    /// `Host`, and any `Origin` must be a loopback one too. Remote peers already proved
    /// themselves with the token.
    ///
    /// The one browser rule of every listener: the network front (`surface::front`) applies
    /// it to each request before a surface sees it; a surface only chooses how its 403
    /// looks.
    pub fn check_browser_headers(
        &self,
        peer: Peer,
        host: Option<&str>,
        origin: Option<&str>,
    ) -> Result<(), &'static str> {
        if peer == Peer::Remote {
            return Ok(());
        }
        if !host.is_some_and(is_loopback_authority) {
            return Err("forbidden: the Host header must name a loopback address");
        }
        match origin {
            None => Ok(()),
            Some(origin) => {
                let authority = origin
                    .split_once("://")
                    .map(|(_, rest)| rest)
                    .filter(|_| origin.starts_with("http://") || origin.starts_with("https://"));
                if authority.is_some_and(is_loopback_authority) {
                    Ok(())
                } else {
                    Err("forbidden: cross-origin requests are not accepted")
                }
            }
        }
    }
}

/// `localhost`, `127.x.y.z` or `[::1]`, with an optional port.
fn is_loopback_authority(authority: &str) -> bool {
    let authority = authority.trim();
    let host = if let Some(rest) = authority.strip_prefix('[') {
        match rest.split_once(']') {
            Some((host, tail)) if tail.is_empty() || tail.starts_with(':') => host,
            _ => return false,
        }
    } else {
        match authority.rsplit_once(':') {
            Some((host, port)) if port.bytes().all(|b| b.is_ascii_digit()) => host,
            Some(_) => return false,
            None => authority,
        }
    };
    host.eq_ignore_ascii_case("localhost")
        || host.parse::<IpAddr>().is_ok_and(|ip| is_loopback(&ip))
}

/// 127.0.0.0/8, `::1` and IPv4-mapped `::ffff:127.x.y.z`, with no test seam: the gate's
/// `classify` for listeners that have no gate (the agent's, which counts peers by it).
pub(crate) fn is_loopback(addr: &IpAddr) -> bool {
    match addr {
        IpAddr::V4(v4) => v4.is_loopback(),
        IpAddr::V6(v6) => {
            v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
    }
}

impl Token {
    pub(crate) fn new(token: &[u8]) -> Token {
        // The key only has to be unknown to the peer; if the system RNG fails (it does not on
        // Linux once booted) a fixed key still gives a constant-time, length-hiding compare.
        let key = hmac::Key::generate(hmac::HMAC_SHA256, &SystemRandom::new())
            .unwrap_or_else(|_| hmac::Key::new(hmac::HMAC_SHA256, b"caliban drive token"));
        let tag = hmac::sign(&key, token);
        Token { key, tag }
    }

    /// Why HMAC-then-compare rather than `ring::constant_time::verify_slices_are_equal` on the
    /// raw bytes: that function returns early when the lengths differ, so its timing tells a
    /// peer how long the token is, and upstream's hand-rolled XOR fold leaks the same. Here
    /// both sides are first mapped to fixed-size HMAC-SHA256 tags under a key the peer never
    /// sees, and `hmac::verify` compares the tags in constant time. The work done depends only
    /// on the length of what the peer sent, which the peer already knows, and since the tags
    /// are unpredictable without the key, even a partial-match timing signal would say nothing
    /// about the token.
    pub(crate) fn matches(&self, presented: &[u8]) -> bool {
        hmac::verify(&self.key, presented, self.tag.as_ref()).is_ok()
    }
}

/// A random RFC 4122 version-4 id (session ids for print mode and ACP). Falls back to
/// time and pid if the system RNG fails, which only costs unpredictability.
pub fn new_uuid() -> String {
    use ring::rand::SecureRandom;
    let mut bytes = [0u8; 16];
    if ring::rand::SystemRandom::new().fill(&mut bytes).is_err() {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        bytes = (nanos ^ u128::from(std::process::id())).to_le_bytes();
    }
    bytes[6] = (bytes[6] & 0x0f) | 0x40;
    bytes[8] = (bytes[8] & 0x3f) | 0x80;
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn browser_headers_must_be_loopback_for_loopback_peers() {
        let gate = Gate::from_env(&|_| None);
        let ok = |host, origin| {
            gate.check_browser_headers(Peer::Loopback, host, origin)
                .is_ok()
        };
        assert!(ok(Some("127.0.0.1:8730"), None));
        assert!(ok(Some("localhost"), Some("http://localhost:3000")));
        assert!(ok(Some("[::1]:8730"), Some("https://127.0.0.1")));
        assert!(!ok(None, None));
        assert!(!ok(Some("attacker.example:8730"), None));
        assert!(!ok(Some("127.0.0.1:8730"), Some("http://attacker.example")));
        assert!(!ok(Some("127.0.0.1:8730"), Some("null")));
        assert!(!ok(Some("127.0.0.1.attacker.example"), None));
        assert!(
            gate.check_browser_headers(Peer::Remote, Some("api.example.com"), Some("https://x"))
                .is_ok()
        );
    }

    use super::*;
    use std::net::{Ipv4Addr, Ipv6Addr};

    #[test]
    fn browser_rule_knows_ipv4_mapped_hosts_and_strict_origins() {
        let gate = Gate::from_env(&|_| None);
        let check = |host, origin| gate.check_browser_headers(Peer::Loopback, host, origin);
        let host = "127.0.0.1:8730";
        for ok_host in [
            "[::ffff:127.0.0.1]:8730",
            "[::ffff:127.3.2.1]",
            "LOCALHOST:8730",
            "localhost:",
            " 127.0.0.1 ",
        ] {
            assert_eq!(check(Some(ok_host), None), Ok(()), "{ok_host}");
        }
        for bad_host in [
            "",
            "[::ffff:10.0.0.1]:8730",
            "[::1]x",
            "::1",
            "localhost:http",
            "localhost.attacker.example",
            "0.0.0.0:8730",
        ] {
            assert_eq!(
                check(Some(bad_host), None),
                Err("forbidden: the Host header must name a loopback address"),
                "{bad_host}"
            );
        }
        for ok_origin in [
            "http://localhost:6274",
            "https://LOCALHOST",
            "http://127.0.0.1:8730",
            "http://[::1]:3000",
            "http://[::ffff:127.0.0.1]:3000",
        ] {
            assert_eq!(check(Some(host), Some(ok_origin)), Ok(()), "{ok_origin}");
        }
        // An origin is scheme://host[:port] and nothing else; a browser page on another
        // host, a sandboxed page (`null`), a file or an extension is not a local tool.
        for bad_origin in [
            "null",
            "",
            "file://",
            "ws://localhost",
            "chrome-extension://abcdef",
            "http://attacker.example",
            "http://127.0.0.1.attacker.example",
            "http://localhost@attacker.example",
            "http://localhost:3000/",
            "localhost",
        ] {
            assert_eq!(
                check(Some(host), Some(bad_origin)),
                Err("forbidden: cross-origin requests are not accepted"),
                "{bad_origin}"
            );
        }
        // A peer that proved itself with the token may be a browser anywhere.
        for peer_headers in [(None, None), (Some("api.example.com"), Some("null"))] {
            let (host, origin) = peer_headers;
            assert_eq!(
                gate.check_browser_headers(Peer::Remote, host, origin),
                Ok(())
            );
        }
    }

    fn gate(token: Option<&str>) -> Gate {
        let token = token.map(str::to_owned);
        Gate::from_env(&move |name| match name {
            TOKEN_ENV => token.clone(),
            _ => None,
        })
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn token_is_trimmed_and_blank_means_none() {
        assert!(!gate(None).token_configured());
        assert!(!gate(Some("")).token_configured());
        assert!(!gate(Some(" \t\n ")).token_configured());
        let g = gate(Some("  s3cret\n"));
        assert!(g.token_configured());
        assert_eq!(
            g.authorize(Peer::Remote, Some("Bearer s3cret")),
            Decision::Allow
        );
        assert_eq!(
            g.authorize(Peer::Remote, Some("Bearer  s3cret")),
            Decision::Deny(DenyReason::BadToken),
            "the presented token is not trimmed"
        );
    }

    #[test]
    fn debug_never_shows_the_token() {
        let set = format!("{:?}", gate(Some("hunter2-very-secret")));
        assert!(set.contains("<set>"), "{set}");
        assert!(!set.contains("hunter2"), "{set}");
        let unset = format!("{:?}", gate(None));
        assert!(unset.contains("<unset>"), "{unset}");
    }

    #[test]
    fn classifies_loopback_including_ipv4_mapped() {
        let g = gate(None);
        for addr in [
            "127.0.0.1",
            "127.255.0.9",
            "::1",
            "::ffff:127.0.0.1",
            "::ffff:127.1.2.3",
        ] {
            assert_eq!(g.classify(&ip(addr)), Peer::Loopback, "{addr}");
        }
        for addr in [
            "0.0.0.0",
            "10.0.0.1",
            "192.168.1.1",
            "128.0.0.1",
            "::",
            "::ffff:10.0.0.1",
            "::ffff:0.0.0.0",
            "::127.0.0.1", // IPv4-compatible (deprecated), not mapped: not loopback
            "fe80::1",
            "2001:db8::1",
        ] {
            assert_eq!(g.classify(&ip(addr)), Peer::Remote, "{addr}");
        }
    }

    #[test]
    fn loopback_is_always_allowed_and_token_never_checked() {
        for g in [gate(None), gate(Some("tok"))] {
            for header in [
                None,
                Some("Bearer wrong"),
                Some("garbage"),
                Some("Bearer tok"),
            ] {
                assert_eq!(g.authorize(Peer::Loopback, header), Decision::Allow);
            }
            assert_eq!(g.check(&ip("::ffff:127.0.0.1"), None), Decision::Allow);
        }
    }

    #[test]
    fn remote_without_configured_token_is_denied() {
        let g = gate(None);
        for header in [None, Some("Bearer anything"), Some("Bearer ")] {
            assert_eq!(
                g.authorize(Peer::Remote, header),
                Decision::Deny(DenyReason::NoTokenConfigured)
            );
        }
    }

    #[test]
    fn remote_needs_exact_bearer_prefix() {
        let g = gate(Some("tok"));
        for header in [
            None,
            Some(""),
            Some("tok"),
            Some("Bearer"),
            Some("bearer tok"),
            Some("BEARER tok"),
            Some("Basic dG9rOg=="),
            Some(" Bearer tok"),
            Some("Bearer\ttok"),
        ] {
            assert_eq!(
                g.authorize(Peer::Remote, header),
                Decision::Deny(DenyReason::MissingToken),
                "{header:?}"
            );
        }
    }

    #[test]
    fn remote_token_must_match_exactly() {
        let g = gate(Some("tok-123"));
        assert_eq!(
            g.authorize(Peer::Remote, Some("Bearer tok-123")),
            Decision::Allow
        );
        for presented in [
            "", "tok-12", "tok-1234", "TOK-123", "tok-123 ", "tok-124", "x",
        ] {
            let header = format!("Bearer {presented}");
            assert_eq!(
                g.authorize(Peer::Remote, Some(&header)),
                Decision::Deny(DenyReason::BadToken),
                "{presented:?}"
            );
        }
        assert_eq!(
            g.check(&ip("10.1.2.3"), Some("Bearer tok-123")),
            Decision::Allow
        );
        assert_eq!(
            g.check(&ip("10.1.2.3"), None),
            Decision::Deny(DenyReason::MissingToken)
        );
    }

    #[test]
    fn two_gates_with_the_same_token_agree() {
        // Each gate has its own random HMAC key; matching must not depend on it.
        let (a, b) = (gate(Some("same")), gate(Some("same")));
        assert_eq!(
            a.authorize(Peer::Remote, Some("Bearer same")),
            Decision::Allow
        );
        assert_eq!(
            b.authorize(Peer::Remote, Some("Bearer same")),
            Decision::Allow
        );
        let c = a.clone();
        assert_eq!(
            c.authorize(Peer::Remote, Some("Bearer same")),
            Decision::Allow
        );
    }

    #[test]
    fn deny_reason_strings_are_upstreams() {
        assert_eq!(DenyReason::MissingToken.as_str(), "missing bearer token");
        assert_eq!(DenyReason::BadToken.as_str(), "invalid bearer token");
        assert_eq!(
            DenyReason::NoTokenConfigured.as_str(),
            "remote connections require a bearer token, but none is configured"
        );
        assert_eq!(DenyReason::BadToken.to_string(), "invalid bearer token");
    }

    #[test]
    fn check_bind_fails_closed() {
        let open = gate(None);
        let closed = gate(Some("tok"));
        for addr in [
            "127.0.0.1:8730",
            "127.9.9.9:0",
            "[::1]:8730",
            "[::ffff:127.0.0.1]:1",
        ] {
            let addr: SocketAddr = addr.parse().unwrap();
            assert_eq!(open.check_bind(&addr), Ok(()), "{addr}");
            assert_eq!(closed.check_bind(&addr), Ok(()), "{addr}");
        }
        for addr in [
            "0.0.0.0:8730",
            "[::]:8730",
            "10.0.0.1:80",
            "[2001:db8::1]:80",
        ] {
            let addr: SocketAddr = addr.parse().unwrap();
            assert_eq!(
                open.check_bind(&addr),
                Err("refusing to bind a drive surface to a non-loopback address without a bearer token (set CALIBAN_DRIVE_TOKEN)".to_owned()),
                "{addr}"
            );
            assert_eq!(closed.check_bind(&addr), Ok(()), "{addr}");
        }
    }

    #[test]
    fn test_seam_makes_loopback_remote_but_not_bind() {
        let env = |token: Option<&'static str>, seam: &'static str| {
            move |name: &str| match name {
                TOKEN_ENV => token.map(str::to_owned),
                TEST_LOOPBACK_IS_REMOTE_ENV => Some(seam.to_owned()),
                _ => None,
            }
        };
        let g = Gate::from_env(&env(Some("tok"), "1"));
        for addr in ["127.0.0.1", "::1", "::ffff:127.0.0.1"] {
            assert_eq!(g.classify(&ip(addr)), Peer::Remote, "{addr}");
        }
        assert_eq!(
            g.check(&ip("127.0.0.1"), None),
            Decision::Deny(DenyReason::MissingToken)
        );
        assert_eq!(
            g.check(&ip("127.0.0.1"), Some("Bearer tok")),
            Decision::Allow
        );
        let no_token = Gate::from_env(&env(None, "1"));
        assert_eq!(
            no_token.check(&ip("127.0.0.1"), Some("Bearer x")),
            Decision::Deny(DenyReason::NoTokenConfigured)
        );
        let lo: SocketAddr = "127.0.0.1:0".parse().unwrap();
        assert_eq!(no_token.check_bind(&lo), Ok(()));
        // Only exactly "1" turns the seam on.
        for value in ["0", "", "true", "yes"] {
            let g = Gate::from_env(&env(None, value));
            assert_eq!(g.classify(&ip("127.0.0.1")), Peer::Loopback, "{value:?}");
        }
        assert_eq!(
            Ipv4Addr::LOCALHOST.to_ipv6_mapped(),
            "::ffff:127.0.0.1".parse::<Ipv6Addr>().unwrap()
        );
    }
}
