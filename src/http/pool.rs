//! Idle HTTP/1.1 connections kept for the next request to the same place (keep-alive), so a
//! run's next turn does not pay a TCP and TLS handshake. The pool only stores: an exchange
//! hands its connection over when its response ended cleanly (`Exchange::park`), the owner
//! asks for one before it dials (`take`), and the owner's single timer calls `expire`.
//!
//! A connection is interchangeable only with one to the same `Key`: the scheme, host and
//! port it reached, the proxy it tunnels through, and the very TLS configuration (roots,
//! protocol versions) that verified the server — compared by identity, so a connection
//! trusted under one set of roots is never handed to a request made under another.
//!
//! Bounded in count (`MAX_IDLE_PER_KEY`, `MAX_IDLE`) and in time (`IDLE_TIMEOUT`); an idle
//! connection is deregistered from the reactor, so it never wakes the loop. A server that
//! closed it meanwhile is noticed when it is taken (the caller's `alive` check reads it) or,
//! at worst, when the request on it fails before any response byte, which the exchange
//! retries once on a fresh connection.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustls::ClientConfig;

use crate::http::target::{Proxy, Target};

/// Idle connections kept per key, at least. A working run holds its model connection only
/// while it streams; between turns (a tool running) the connection waits here for the run's
/// next turn, so this is how many runs of one server can be between turns at once and still
/// find a warm connection. Beyond it a turn pays one handshake, which is cheap next to a model
/// turn; each idle connection costs a file descriptor. The drive surfaces raise it to their
/// `--max-working-runs` (`EngineConfig::idle_connections`): as many runs may stream at once,
/// so the process is already provisioned for that many model connections.
pub const MAX_IDLE_PER_KEY: usize = 128;
/// Idle connections kept in all: the pool's file descriptors, whatever the number of
/// endpoints (model, MCP servers, fetched sites).
pub const MAX_IDLE: usize = 256;
/// How long a connection may wait idle. Shorter than the keep-alive timeouts of the servers
/// and balancers that keep connections longest (nginx 75 s, AWS load balancers 60 s, most
/// CDNs longer), so we usually close first and seldom write into a connection the server is
/// closing; servers with short timeouts (uvicorn under vLLM and llama.cpp's server close
/// after 5 s) close first, and their close is seen before reuse.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// What makes two connections interchangeable.
#[derive(Clone, Debug)]
pub struct Key {
    target: Target,
    proxy: Option<Proxy>,
    tls: Option<Arc<ClientConfig>>,
}

impl Key {
    pub fn new(target: Target, proxy: Option<Proxy>, tls: Option<Arc<ClientConfig>>) -> Key {
        // A plain target never uses a TLS config: leave it out so it cannot split the key.
        let tls = tls.filter(|_| target.tls);
        Key { target, proxy, tls }
    }

    fn matches(&self, other: &Key) -> bool {
        let same_tls = match (&self.tls, &other.tls) {
            (None, None) => true,
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        };
        same_tls && self.target == other.target && self.proxy == other.proxy
    }
}

/// An idle connection and the addresses its host resolved to (for a fresh connection if it
/// turns out dead).
pub struct Parked<C> {
    pub conn: C,
    pub addrs: Vec<SocketAddr>,
}

/// The idle connections of one key, oldest first.
struct Group<C> {
    key: Key,
    idle: VecDeque<(Parked<C>, Instant)>,
}

/// Limits of a pool; `Limits::default()` is the constants above.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub per_key: usize,
    pub total: usize,
    pub idle: Duration,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            per_key: MAX_IDLE_PER_KEY,
            total: MAX_IDLE,
            idle: IDLE_TIMEOUT,
        }
    }
}

/// The idle connections by key. Keys are few (the model's endpoint, in practice one), so
/// finding a key's group is a short scan; within a group, parking, taking and expiring are
/// at its ends.
pub struct Pool<C> {
    groups: Vec<Group<C>>,
    total: usize,
    limits: Limits,
}

impl<C> Default for Pool<C> {
    fn default() -> Pool<C> {
        Pool::new(Limits::default())
    }
}

impl<C> Pool<C> {
    pub fn new(limits: Limits) -> Pool<C> {
        Pool {
            groups: Vec::new(),
            total: 0,
            limits,
        }
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.total
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.total == 0
    }

    /// Keeps `parked` for `key`, closing (dropping) the oldest idle connection of the key, or
    /// of all, when a cap is reached.
    pub fn put(&mut self, key: Key, parked: Parked<C>, now: Instant) {
        if self.limits.per_key == 0 || self.limits.total == 0 {
            return;
        }
        let at = match self.groups.iter().position(|g| g.key.matches(&key)) {
            Some(at) => at,
            None => {
                self.groups.push(Group {
                    key,
                    idle: VecDeque::new(),
                });
                self.groups.len() - 1
            }
        };
        if self
            .groups
            .get(at)
            .is_some_and(|g| g.idle.len() >= self.limits.per_key)
        {
            self.pop_oldest(Some(at));
        } else if self.total >= self.limits.total {
            self.pop_oldest(None);
        }
        if let Some(group) = self.groups.get_mut(at) {
            group.idle.push_back((parked, now));
            self.total += 1;
        }
    }

    /// Closes the oldest idle connection of group `at`, or of all.
    fn pop_oldest(&mut self, at: Option<usize>) {
        let at = at.or_else(|| {
            let fronts = self.groups.iter().enumerate();
            fronts
                .filter_map(|(i, g)| g.idle.front().map(|(_, since)| (i, *since)))
                .min_by_key(|(_, since)| *since)
                .map(|(i, _)| i)
        });
        if let Some(group) = at.and_then(|at| self.groups.get_mut(at))
            && group.idle.pop_front().is_some()
        {
            self.total -= 1;
        }
    }

    /// The most recently parked connection for `key` that `alive` accepts (the likeliest to
    /// still be open); the ones it refuses are closed on the way.
    pub fn take(&mut self, key: &Key, mut alive: impl FnMut(&mut C) -> bool) -> Option<Parked<C>> {
        let group = self.groups.iter_mut().find(|g| g.key.matches(key))?;
        while let Some((mut parked, _)) = group.idle.pop_back() {
            self.total -= 1;
            if alive(&mut parked.conn) {
                return Some(parked);
            }
        }
        None
    }

    /// Closes every connection idle for `Limits::idle` at `now`; returns when the next one
    /// will be due, if any is left.
    pub fn expire(&mut self, now: Instant) -> Option<Instant> {
        let idle = self.limits.idle;
        for group in &mut self.groups {
            while group
                .idle
                .front()
                .is_some_and(|(_, since)| now.saturating_duration_since(*since) >= idle)
            {
                group.idle.pop_front();
                self.total -= 1;
            }
        }
        self.groups.retain(|g| !g.idle.is_empty());
        self.next_expiry()
    }

    /// When the oldest idle connection is due to close.
    pub fn next_expiry(&self) -> Option<Instant> {
        let oldest = self
            .groups
            .iter()
            .filter_map(|g| g.idle.front())
            .map(|(_, since)| *since);
        oldest.min().map(|since| since + self.limits.idle)
    }

    /// Closes every idle connection (exit: nothing waits on them).
    pub fn clear(&mut self) {
        self.groups.clear();
        self.total = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(host: &str, port: u16, tls: bool) -> Target {
        Target {
            tls,
            host: host.to_owned(),
            port,
        }
    }

    fn tls_config() -> Arc<ClientConfig> {
        let roots = rustls::RootCertStore::empty();
        Arc::new(
            ClientConfig::builder_with_provider(crate::transport::crypto_provider())
                .with_safe_default_protocol_versions()
                .expect("versions")
                .with_root_certificates(roots)
                .with_no_client_auth(),
        )
    }

    fn parked(n: u32) -> Parked<u32> {
        Parked {
            conn: n,
            addrs: Vec::new(),
        }
    }

    #[test]
    fn a_connection_goes_only_to_its_own_key() {
        let tls = tls_config();
        let other_roots = tls_config();
        let key = Key::new(
            target("api.example", 443, true),
            None,
            Some(Arc::clone(&tls)),
        );
        let mut pool = Pool::default();
        let now = Instant::now();
        pool.put(key.clone(), parked(1), now);
        let proxy = Some(Proxy {
            host: "proxy".into(),
            port: 3128,
        });
        let misses = [
            Key::new(
                target("api.example", 8443, true),
                None,
                Some(Arc::clone(&tls)),
            ),
            Key::new(
                target("other.example", 443, true),
                None,
                Some(Arc::clone(&tls)),
            ),
            Key::new(target("api.example", 443, false), None, None),
            // Same place, other trust: never shared, even with identical settings.
            Key::new(target("api.example", 443, true), None, Some(other_roots)),
            Key::new(
                target("api.example", 443, true),
                proxy,
                Some(Arc::clone(&tls)),
            ),
        ];
        for miss in &misses {
            assert!(pool.take(miss, |_| true).is_none(), "{miss:?}");
        }
        assert_eq!(pool.len(), 1);
        let hit = Key::new(target("api.example", 443, true), None, Some(tls));
        assert_eq!(pool.take(&hit, |_| true).map(|p| p.conn), Some(1));
        assert!(pool.is_empty());
        // A plain target ignores a TLS config it would never use.
        let plain = Key::new(target("h", 80, false), None, Some(tls_config()));
        pool.put(plain, parked(2), now);
        let plain_again = Key::new(target("h", 80, false), None, None);
        assert_eq!(pool.take(&plain_again, |_| true).map(|p| p.conn), Some(2));
    }

    #[test]
    fn newest_first_and_dead_ones_are_dropped() {
        let key = Key::new(target("h", 80, false), None, None);
        let mut pool = Pool::default();
        let now = Instant::now();
        for n in 1..=3 {
            pool.put(key.clone(), parked(n), now);
        }
        // 3 is newest but dead (the server closed it): dropped, 2 comes instead.
        let mut seen = Vec::new();
        let got = pool.take(&key, |c| {
            seen.push(*c);
            *c != 3
        });
        assert_eq!(got.map(|p| p.conn), Some(2));
        assert_eq!(seen, [3, 2]);
        assert_eq!(pool.len(), 1);
        assert!(pool.take(&key, |_| false).is_none());
        assert!(pool.is_empty());
    }

    #[test]
    fn caps_per_key_and_in_all() {
        let limits = Limits {
            per_key: 2,
            total: 3,
            idle: Duration::from_secs(30),
        };
        let a = Key::new(target("a", 80, false), None, None);
        let b = Key::new(target("b", 80, false), None, None);
        let mut pool = Pool::new(limits);
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        for n in 1..=3 {
            pool.put(a.clone(), parked(n), at(n.into()));
        }
        // The key's oldest (1) made room.
        assert_eq!(pool.len(), 2);
        pool.put(b.clone(), parked(10), at(10));
        pool.put(b.clone(), parked(11), at(11));
        // Over the total: the oldest of all (2) went.
        assert_eq!(pool.len(), 3);
        let mut left_a = Vec::new();
        while let Some(p) = pool.take(&a, |_| true) {
            left_a.push(p.conn);
        }
        assert_eq!(left_a, [3]);
        assert_eq!(pool.take(&b, |_| true).map(|p| p.conn), Some(11));
        let mut none = Pool::new(Limits {
            per_key: 0,
            ..limits
        });
        none.put(a, parked(1), t0);
        assert!(none.is_empty());
    }

    #[test]
    fn idle_connections_expire() {
        let limits = Limits {
            per_key: 8,
            total: 8,
            idle: Duration::from_secs(30),
        };
        let key = Key::new(target("h", 80, false), None, None);
        let mut pool = Pool::new(limits);
        let t0 = Instant::now();
        assert_eq!(pool.next_expiry(), None);
        pool.put(key.clone(), parked(1), t0);
        pool.put(key.clone(), parked(2), t0 + Duration::from_secs(10));
        assert_eq!(pool.next_expiry(), Some(t0 + Duration::from_secs(30)));
        assert_eq!(
            pool.expire(t0 + Duration::from_secs(29)),
            Some(t0 + Duration::from_secs(30))
        );
        assert_eq!(pool.len(), 2);
        assert_eq!(
            pool.expire(t0 + Duration::from_secs(30)),
            Some(t0 + Duration::from_secs(40))
        );
        assert_eq!(pool.take(&key, |_| true).map(|p| p.conn), Some(2));
        assert_eq!(pool.expire(t0 + Duration::from_secs(100)), None);
        pool.put(key, parked(3), t0);
        pool.clear();
        assert!(pool.is_empty());
    }
}
