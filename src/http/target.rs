//! Where an outbound exchange goes: the server (`Target`) and the proxy it tunnels through
//! (`Proxy`). Below both `client`, which dials them, and `pool`, which keys the connections
//! it keeps by them.

/// A server: scheme (TLS or not), host and port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    pub tls: bool,
    pub host: String,
    pub port: u16,
}

impl Target {
    /// The host as it appears in a URL authority: IPv6 literals in brackets.
    pub(super) fn url_host(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        }
    }

    /// `Host` header value: the port only when it is not the scheme's default.
    pub fn host_header(&self) -> String {
        let default = if self.tls { 443 } else { 80 };
        if self.port == default {
            self.url_host()
        } else {
            format!("{}:{}", self.url_host(), self.port)
        }
    }

    /// `host:port` for a CONNECT request line: the port always, IPv6 literals in brackets
    /// (RFC 9110 §9.3.6), so `::1` port 443 is `[::1]:443`, not the unparseable `::1:443`.
    pub fn authority(&self) -> String {
        format!("{}:{}", self.url_host(), self.port)
    }
}

/// An HTTP proxy reached with CONNECT (`HTTPS_PROXY=http://host:port`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Proxy {
    pub host: String,
    pub port: u16,
}
