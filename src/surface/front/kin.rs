//! Whether a connection comes from a process a run started (a tool's command, a hook, an
//! MCP server, or anything they started), which is never a client of caliban (DESIGN §4.6):
//! a command that could drive caliban could answer its own permission prompt, read every
//! transcript, start runs. The front asks this of every connection it accepts, before a byte
//! is served (`Front::take_in`).
//!
//! Who is ours: caliban is a child subreaper (`reaper`), so every process a tool started,
//! even one that left its session, has caliban as an ancestor while it lives.
//!
//! - A Unix socket: the kernel recorded the connecting process (`SO_PEERCRED`); ours when
//!   its parent chain reaches caliban, or when it carries a tool call's tag of ours
//!   (`reaper::TAG_ENV`).
//! - TCP: there is no peer credential, so the peer's socket is found by its address in
//!   `/proc/net/tcp` and `tcp6` (its local address is our peer address, its remote one our
//!   local address), and the connection is ours when a descendant of caliban holds that
//!   socket among its descriptors.
//!
//! Cost: with no descendant alive (the common case: between tool calls, no MCP server) a
//! look is the read of caliban's own child lists and nothing more. With one, a Unix peer
//! costs its parent chain; a TCP peer a scan of the socket table and of each descendant's
//! descriptors (sock_diag's exact lookup, not `/proc/net/tcp`, which walks the kernel's
//! whole table: 4 ms a read on the machine this was measured on). A fresh loopback
//! connection to a debug build of `http serve` took 275 µs (median) with nothing alive and
//! 351 µs with one Bash running.
//!
//! When the look cannot be made while a descendant is alive (the peer's process is gone, a
//! descendant's descriptors cannot be read, the walk met its cap, the socket is not in the
//! table) the connection is refused: it fails closed. With no descendant alive nothing a
//! run started can be at the other end, so nothing is refused.

use std::fs;
use std::io::{self, BufRead, BufReader};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::RawFd;

use crate::reaper;

/// What a refused peer is told, and what the log names: the rule.
pub(crate) const RULE: &str =
    "forbidden: a process started by one of caliban's runs cannot be a client of caliban";

/// What the front decided about a peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kin {
    /// Not a process of ours (or nothing of ours is alive to be it).
    Stranger,
    /// A descendant of caliban (how we know).
    Ours(&'static str),
    /// Could not tell while descendants are alive: refused (why not).
    Unknown(&'static str),
}

impl Kin {
    pub(crate) fn refused(self) -> Option<&'static str> {
        match self {
            Kin::Stranger => None,
            Kin::Ours(why) | Kin::Unknown(why) => Some(why),
        }
    }
}

/// Caliban's descendants now, or why they cannot be listed; `Ok(empty)` is the cheap case.
fn descendants() -> Result<Vec<u32>, &'static str> {
    reaper::descendants().ok_or("caliban's descendants cannot be listed")
}

/// The peer of an accepted Unix socket connection.
pub(crate) fn of_unix_peer(fd: RawFd) -> Kin {
    let pid = match crate::sys::unix_peer_pid(fd) {
        Ok(Some(pid)) => pid,
        // A peer in a pid namespace we cannot see (a supervisor in another container):
        // ours are all in ours or below it, where we see them.
        Ok(None) => return Kin::Stranger,
        Err(_) => return Kin::Unknown("the peer's process is not known"),
    };
    // The kernel recorded who connected. One that is gone already may have been ours,
    // reaped between its write and our accept (a command that connects, writes `Permit`
    // and exits): what it wrote is not served, whoever is alive now.
    if !reaper::is_running(pid) {
        return Kin::Unknown("the process that connected is gone");
    }
    let alive = match descendants() {
        Ok(list) if list.is_empty() => return Kin::Stranger,
        Ok(list) => list,
        Err(why) => return unknown_if_children(why),
    };
    if alive.contains(&pid) {
        return Kin::Ours("its process is caliban's descendant");
    }
    if reaper::tagged_ours(pid) {
        return Kin::Ours("its process carries a tool call's tag");
    }
    match reaper::descends_from_us(pid) {
        Some(true) => Kin::Ours("its process is caliban's descendant"),
        Some(false) => Kin::Stranger,
        None => Kin::Unknown("the peer's process ancestry cannot be read"),
    }
}

/// Most rounds of listing descendants again after a scan of their descriptors: a process
/// forked during the scan may hold the socket, and each round looks at the new ones; past
/// this many the tree keeps changing under us, and the peer is refused.
const MAX_RELISTS: usize = 4;

/// The peer of an accepted TCP connection, `local` being our end of it.
///
/// A TCP peer leaves no credential, and a command may hand its socket on (SCM_RIGHTS) or
/// hold it nowhere at the moment we look (in flight on a socketpair, or written to and
/// closed). So on loopback a peer is a stranger only when a process outside caliban's
/// runs is found holding its socket: found in a descendant, it is ours; found nowhere, it
/// is refused too. Remote peers live on another host: their token is their gate.
pub(crate) fn of_tcp_peer(local: SocketAddr, peer: SocketAddr) -> Kin {
    if !crate::auth::is_loopback(&peer.ip()) {
        return Kin::Stranger;
    }
    let listed = descendants();
    let (inode, owner) = match find_socket(peer, local) {
        Ok(Some(found)) => found,
        // Closed already (no inode): what it wrote is nobody's to vouch for.
        Ok(None) => return Kin::Unknown("the peer's socket has no process"),
        Err(_) if matches!(&listed, Ok(list) if list.is_empty()) => return Kin::Stranger,
        Err(_) => return Kin::Unknown("the socket table cannot be read"),
    };
    let mut alive = match listed {
        // Nothing a run started is alive to hold it or to have written to it.
        Ok(list) if list.is_empty() => return Kin::Stranger,
        Ok(list) => list,
        Err(why) => return Kin::Unknown(why),
    };
    let link = format!("socket:[{inode}]");
    let mut scanned = 0;
    for _ in 0..=MAX_RELISTS {
        for &pid in &alive[scanned..] {
            match holds(pid, &link) {
                Ok(true) => return Kin::Ours("a descendant of caliban holds its socket"),
                Ok(false) => {}
                // Gone since it was listed, or a zombie (whose descriptors nobody may
                // read): it holds nothing.
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(_) if !reaper::is_running(pid) => {}
                Err(_) => return Kin::Unknown("a descendant's descriptors cannot be read"),
            }
        }
        scanned = alive.len();
        let now = match descendants() {
            Ok(now) => now,
            Err(why) => return Kin::Unknown(why),
        };
        let new: Vec<u32> = now.into_iter().filter(|p| !alive.contains(p)).collect();
        if new.is_empty() {
            // A socket another user made is not a run's: a run's processes are caliban's
            // user (no setuid gains under `no_new_privs`), and that user cannot look into
            // another's descriptors to find its holder.
            return if owner != crate::sys::effective_uid() || held_outside(&link, &alive) {
                Kin::Stranger
            } else {
                Kin::Unknown("no process outside caliban's runs holds its socket")
            };
        }
        alive.extend(new);
    }
    Kin::Unknown("caliban's descendants kept changing while they were looked at")
}

/// Whether a process other than those in `ours` (caliban itself included) holds `link`:
/// a scan of every process we may look into, made only while a run's process is alive.
fn held_outside(link: &str, ours: &[u32]) -> bool {
    let Ok(procs) = fs::read_dir("/proc") else {
        return false;
    };
    procs
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| !ours.contains(pid))
        .any(|pid| holds(pid, link).unwrap_or(false))
}

/// Without child lists, whether caliban has children decides.
fn unknown_if_children(why: &'static str) -> Kin {
    if reaper::has_children() {
        Kin::Unknown(why)
    } else {
        Kin::Stranger
    }
}

/// Whether process `pid` has `link` (`socket:[N]`) among its descriptors.
fn holds(pid: u32, link: &str) -> io::Result<bool> {
    for entry in fs::read_dir(format!("/proc/{pid}/fd"))? {
        let Ok(entry) = entry else { continue };
        if fs::read_link(entry.path()).is_ok_and(|target| target.as_os_str() == link) {
            return Ok(true);
        }
    }
    Ok(false)
}

/// The inode and owner of the socket whose local address is `local` and remote one
/// `remote`, from the kernel's TCP tables; `None` when it is in neither (or has no inode:
/// closed already).
fn find_socket(local: SocketAddr, remote: SocketAddr) -> io::Result<Option<(u64, u32)>> {
    match crate::sys::tcp_socket_inode(local, remote) {
        Ok(found) => return Ok(found),
        Err(e) => crate::log::debug(&format!("sock_diag: {e}; reading /proc/net/tcp")),
    }
    read_tables(local, remote)
}

/// `find_socket` the slow way, where sock_diag cannot be used: `/proc/net/tcp` walks every
/// bucket of the kernel's tables (milliseconds on a large host).
fn read_tables(local: SocketAddr, remote: SocketAddr) -> io::Result<Option<(u64, u32)>> {
    let mut read_any = false;
    let mut last_error = None;
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let file = match fs::File::open(table) {
            Ok(file) => file,
            Err(e) => {
                last_error = Some(e);
                continue;
            }
        };
        read_any = true;
        for line in BufReader::new(file).lines().skip(1) {
            let line = line?;
            if let Some((l, r, inode, uid)) = parse_tcp_line(&line)
                && inode != 0
                && same(l, local)
                && same(r, remote)
            {
                return Ok(Some((inode, uid)));
            }
        }
    }
    match (read_any, last_error) {
        (false, Some(e)) => Err(e),
        _ => Ok(None),
    }
}

/// Two socket addresses name the same endpoint (an IPv4-mapped IPv6 address is its IPv4
/// self: a dual-stack listener reports an IPv4 client so).
fn same(a: SocketAddr, b: SocketAddr) -> bool {
    a.port() == b.port() && a.ip().to_canonical() == b.ip().to_canonical()
}

/// One row of `/proc/net/tcp` or `tcp6`: local address, remote address, inode, uid.
/// `sl local rem st tx:rx tr:when retrnsmt uid timeout inode …`, the addresses in hex as
/// the kernel holds them (each 32-bit word of the address in host byte order), the port in
/// hex.
fn parse_tcp_line(line: &str) -> Option<(SocketAddr, SocketAddr, u64, u32)> {
    let fields: Vec<&str> = line.split_ascii_whitespace().collect();
    if fields.len() < 10 || !fields[0].ends_with(':') {
        return None;
    }
    let local = parse_addr(fields[1])?;
    let remote = parse_addr(fields[2])?;
    let uid = fields[7].parse().ok()?;
    let inode = fields[9].parse().ok()?;
    Some((local, remote, inode, uid))
}

fn parse_addr(text: &str) -> Option<SocketAddr> {
    let (ip, port) = text.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let word = |hex: &str| u32::from_str_radix(hex, 16).ok().map(u32::to_ne_bytes);
    let ip = match ip.len() {
        8 => IpAddr::V4(Ipv4Addr::from(word(ip)?)),
        32 => {
            let mut bytes = [0u8; 16];
            for (i, chunk) in bytes.chunks_mut(4).enumerate() {
                chunk.copy_from_slice(&word(ip.get(i * 8..i * 8 + 8)?)?);
            }
            IpAddr::V6(Ipv6Addr::from(bytes))
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(text: &str) -> SocketAddr {
        text.parse().expect("address")
    }

    #[cfg(target_endian = "little")]
    #[test]
    fn selfclient_tcp_table_rows_are_read_as_the_kernel_writes_them() {
        let v4 = "   3: 0100007F:A2C4 0100007F:1F90 01 00000000:00000000 00:00000000 00000000  1000        0 4242 1 0000000000000000 20 4 30 10 -1";
        assert_eq!(
            parse_tcp_line(v4),
            Some((addr("127.0.0.1:41668"), addr("127.0.0.1:8080"), 4242, 1000))
        );
        // ::1 and an IPv4-mapped 127.0.0.1, as tcp6 lists them.
        let v6 = "   0: 00000000000000000000000001000000:D431 0000000000000000FFFF00000100007F:0050 01 00000000:00000000 00:00000000 00000000     0        0 77 1 0000000000000000 20 4 1 10 -1";
        assert_eq!(
            parse_tcp_line(v6),
            Some((addr("[::1]:54321"), addr("[::ffff:127.0.0.1]:80"), 77, 0))
        );
        // The header, a short or garbled row.
        assert_eq!(
            parse_tcp_line(
                "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode"
            ),
            None
        );
        assert_eq!(parse_tcp_line("   3: 0100007F:A2C4 0100007F:1F90 01"), None);
        assert_eq!(
            parse_tcp_line("   3: 0100007Z:A2C4 0100007F:1F90 01 0:0 0:0 0 0 0 9"),
            None
        );
        assert_eq!(
            parse_tcp_line("   3: 0100007F:A2C4 0100007F:1F90 01 0:0 0:0 0 0 0 x"),
            None
        );
    }

    #[test]
    fn selfclient_a_mapped_address_is_its_ipv4_self() {
        assert!(same(addr("[::ffff:127.0.0.1]:80"), addr("127.0.0.1:80")));
        assert!(!same(addr("[::ffff:127.0.0.1]:80"), addr("127.0.0.1:81")));
        assert!(!same(addr("[::1]:80"), addr("127.0.0.1:80")));
    }

    /// A child of ours connecting to a loopback listener is ours; this very process
    /// connecting is not; what it costs with one child alive.
    #[test]
    fn selfclient_a_childs_loopback_connection_is_ours_and_our_own_is_not() {
        use std::io::Read;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let at = listener.local_addr().expect("addr");
        let mut child = std::process::Command::new("python3")
            .args([
                "-c",
                "import socket,sys,time\ns=socket.create_connection(('127.0.0.1',int(sys.argv[1])))\nprint('up',flush=True)\ntime.sleep(20)",
                &at.port().to_string(),
            ])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("python3");
        let mut up = [0u8; 3];
        child
            .stdout
            .as_mut()
            .expect("stdout")
            .read_exact(&mut up)
            .expect("child connected");
        let (theirs, peer) = listener.accept().expect("accept");
        let local = theirs.local_addr().expect("local");
        // The test process is no subreaper: its children are listed all the same.
        let kin = of_tcp_peer(local, peer);
        let mine = std::net::TcpStream::connect(at).expect("connect");
        let (ours, my_peer) = listener.accept().expect("accept");
        let started = std::time::Instant::now();
        let rounds = 200;
        for _ in 0..rounds {
            assert_eq!(
                of_tcp_peer(ours.local_addr().expect("local"), my_peer),
                Kin::Stranger
            );
        }
        let each = started.elapsed() / rounds;
        eprintln!("one TCP look with one child alive: {each:?}");
        // The slow way finds the same socket.
        let peer_local = theirs.peer_addr().expect("peer");
        assert_eq!(
            read_tables(peer_local, local).expect("tables"),
            crate::sys::tcp_socket_inode(peer_local, local).expect("sock_diag")
        );
        let _ = child.kill();
        let _ = child.wait();
        drop(mine);
        assert_eq!(kin, Kin::Ours("a descendant of caliban holds its socket"));
    }
}
