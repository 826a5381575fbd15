//! Host names as the resolver reads them: a URL's host that spells an IP address in any of
//! the forms `inet_aton` and `getaddrinfo` accept (`127.1`, `0x7f000001`, `2130706433`,
//! `0177.0.0.1`, `[::ffff:127.0.0.1]`) becomes the one address it dials, so permission rules
//! and `webfetch.block_private` judge addresses, not spellings; and the address classes
//! a fetch must not reach when that setting is on. Pure: no lookups, no I/O.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// The IP address `host` spells, as the resolver would read it, or `None` for a name.
/// Brackets, a zone (`%eth0`) and a trailing dot are ignored; an IPv4-mapped IPv6 address
/// is its IPv4 address, which is what a connection to it reaches.
pub fn parse_ip(host: &str) -> Option<IpAddr> {
    let host = host.trim();
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    let host = host.strip_suffix('.').unwrap_or(host);
    if host.contains(':') {
        let bare = host.split('%').next().unwrap_or(host);
        let v6: Ipv6Addr = bare.parse().ok()?;
        return Some(match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(v6),
        });
    }
    parse_inet_aton(host).map(IpAddr::V4)
}

/// `inet_aton`'s reading: one to four parts, each decimal, octal (a leading `0`) or hex
/// (`0x`); the last part fills the bytes the earlier ones left (`127.1` is 127.0.0.1).
fn parse_inet_aton(text: &str) -> Option<Ipv4Addr> {
    let parts: Vec<&str> = text.split('.').collect();
    if parts.is_empty() || parts.len() > 4 {
        return None;
    }
    let mut values = Vec::with_capacity(parts.len());
    for part in &parts {
        values.push(parse_part(part)?);
    }
    let (last, leading) = values.split_last()?;
    if leading.iter().any(|&v| v > 0xff) {
        return None;
    }
    let room = 8 * (4 - leading.len() as u32);
    if room < 32 && *last >= 1u64 << room {
        return None;
    }
    if *last > u64::from(u32::MAX) {
        return None;
    }
    let mut addr = 0u64;
    for (i, v) in leading.iter().enumerate() {
        addr |= v << (24 - 8 * i as u32);
    }
    addr |= last;
    Some(Ipv4Addr::from(u32::try_from(addr).ok()?))
}

fn parse_part(part: &str) -> Option<u64> {
    let (digits, radix) =
        if let Some(hex) = part.strip_prefix("0x").or_else(|| part.strip_prefix("0X")) {
            (hex, 16)
        } else if part.len() > 1 && part.starts_with('0') {
            (&part[1..], 8)
        } else {
            (part, 10)
        };
    if digits.is_empty() || !digits.chars().all(|c| c.is_digit(radix)) {
        return None;
    }
    u64::from_str_radix(digits, radix)
        .ok()
        .filter(|&v| v <= u64::from(u32::MAX))
}

/// Whether `host` names this machine by name: `localhost` and its subdomains (RFC 6761),
/// with or without a trailing dot.
pub fn is_localhost_name(host: &str) -> bool {
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    host == "localhost" || host.ends_with(".localhost")
}

/// Whether a connection to `ip` reaches this machine: loopback (all of 127/8, `::1`) or the
/// unspecified address (0.0.0.0/8, `::`), which Linux connects to loopback.
pub fn is_local(ip: IpAddr) -> bool {
    matches!(class(ip), Some("loopback" | "unspecified"))
}

/// The class of `ip` that `webfetch.block_private` refuses, or `None` for a public one:
/// loopback, unspecified, private (RFC 1918, IPv6 ULA and site-local), link-local (the
/// cloud metadata address 169.254.169.254 among them) and carrier-grade NAT (100.64/10).
pub fn class(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => {
            let [a, b, ..] = v4.octets();
            match (a, b) {
                (127, _) => Some("loopback"),
                (0, _) => Some("unspecified"),
                (10, _) | (192, 168) => Some("private"),
                (172, 16..=31) => Some("private"),
                (169, 254) => Some("link-local"),
                (100, 64..=127) => Some("carrier-grade NAT"),
                // IETF protocol assignments (192.0.0.0/24), benchmarking (198.18/15).
                (192, 0) if v4.octets()[2] == 0 => Some("private"),
                (198, 18..=19) => Some("private"),
                (224..=239, _) => Some("multicast"),
                (240..=255, _) => Some("reserved"),
                _ => None,
            }
        }
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return class(IpAddr::V4(v4));
            }
            let seg = v6.segments();
            // NAT64 (64:ff9b::/96) and IPv4-compatible (::a.b.c.d) addresses reach the IPv4
            // address in their last 32 bits: 64:ff9b::a9fe:a9fe is the metadata address.
            let embedded = seg[..6] == [0x64, 0xff9b, 0, 0, 0, 0] || seg[..6] == [0; 6];
            if embedded && !v6.is_loopback() && !v6.is_unspecified() {
                let [.., a, b, c, d] = v6.octets();
                return class(IpAddr::V4(std::net::Ipv4Addr::new(a, b, c, d)));
            }
            let first = seg[0];
            if v6.is_loopback() {
                Some("loopback")
            } else if v6.is_unspecified() {
                Some("unspecified")
            } else if first & 0xfe00 == 0xfc00 || first & 0xffc0 == 0xfec0 {
                Some("private")
            } else if first & 0xffc0 == 0xfe80 {
                Some("link-local")
            } else if first & 0xff00 == 0xff00 {
                Some("multicast")
            } else {
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_spelling_of_loopback_is_loopback() {
        let loopback: IpAddr = "127.0.0.1".parse().unwrap();
        for spelling in [
            "127.0.0.1",
            "127.1",
            "127.0.1",
            "0x7f000001",
            "0X7F000001",
            "2130706433",
            "0177.0.0.1",
            "0x7f.0.0.1",
            "017700000001",
            "127.0.0.1.",
            "[::ffff:127.0.0.1]",
            "::ffff:7f00:1",
        ] {
            assert_eq!(parse_ip(spelling), Some(loopback), "{spelling}");
        }
        assert_eq!(parse_ip("127.0.0.2"), Some("127.0.0.2".parse().unwrap()));
        assert_eq!(parse_ip("0"), Some("0.0.0.0".parse().unwrap()));
        assert_eq!(parse_ip("[::1]"), Some("::1".parse().unwrap()));
        assert_eq!(parse_ip("[fe80::1%eth0]"), Some("fe80::1".parse().unwrap()));
        for spelling in ["127.0.0.2", "0.0.0.0", "127.1", "[::1]", "[::]"] {
            assert!(is_local(parse_ip(spelling).unwrap()), "{spelling}");
        }
    }

    #[test]
    fn names_and_malformed_numbers_are_not_addresses() {
        for name in [
            "example.com",
            "localhost",
            "1.2.3.4.5",
            "256.0.0.1",
            "1.2.3.256",
            "1.2.65536",
            "4294967296",
            "08.0.0.1",
            "0x",
            "1..2",
            "",
            "1e3",
        ] {
            assert_eq!(parse_ip(name), None, "{name}");
        }
        assert_eq!(parse_ip("1.2.65535"), Some("1.2.255.255".parse().unwrap()));
        assert_eq!(
            parse_ip("4294967295"),
            Some("255.255.255.255".parse().unwrap())
        );
    }

    #[test]
    fn the_blocked_classes() {
        let of = |s: &str| class(parse_ip(s).unwrap());
        assert_eq!(of("127.5.6.7"), Some("loopback"));
        assert_eq!(of("10.1.2.3"), Some("private"));
        assert_eq!(of("172.16.0.1"), Some("private"));
        assert_eq!(of("172.31.255.255"), Some("private"));
        assert_eq!(of("172.32.0.1"), None);
        assert_eq!(of("192.168.1.1"), Some("private"));
        assert_eq!(of("169.254.169.254"), Some("link-local"));
        assert_eq!(of("100.64.0.1"), Some("carrier-grade NAT"));
        assert_eq!(of("100.128.0.1"), None);
        assert_eq!(of("0.0.0.0"), Some("unspecified"));
        assert_eq!(of("fd00::1"), Some("private"));
        assert_eq!(of("fe80::1"), Some("link-local"));
        assert_eq!(of("::ffff:10.0.0.1"), Some("private"));
        assert_eq!(of("8.8.8.8"), None);
        assert_eq!(of("2001:db8::1"), None);
        // The IPv4 address inside NAT64 and IPv4-compatible forms decides.
        assert_eq!(of("64:ff9b::a9fe:a9fe"), Some("link-local"));
        assert_eq!(of("64:ff9b::808:808"), None);
        assert_eq!(of("::127.0.0.1"), Some("loopback"));
        assert_eq!(of("::1"), Some("loopback"));
        assert_eq!(of("::"), Some("unspecified"));
        assert_eq!(of("192.0.0.8"), Some("private"));
        assert_eq!(of("198.18.0.1"), Some("private"));
        assert_eq!(of("224.0.0.1"), Some("multicast"));
        assert_eq!(of("255.255.255.255"), Some("reserved"));
        assert_eq!(of("ff02::1"), Some("multicast"));
        assert!(is_localhost_name("LocalHost."));
        assert!(is_localhost_name("a.localhost"));
        assert!(!is_localhost_name("localhost.example.com"));
    }
}
