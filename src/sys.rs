//! Every `unsafe` block and every direct libc call in caliban lives here, each with a SAFETY
//! note. The rest of the crate sees safe functions with io::Result.
//!
//! It owns: signal handlers that write to a self-pipe, file-status-flag changes, process
//! groups (setsid in the child, group kill), the child subreaper flag and single-process
//! kill and reap, fd-type probes, the terminal check, and the sandbox's kernel calls
//! (Landlock rulesets, seccomp filters, mount namespaces; `Confinement`). It must not know
//! about runs, protocols, the reactor's tokens, or what a sandbox mode allows.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

/// The write end of the signal self-pipe; -1 until `install_signal_pipe` ran. A plain atomic
/// because a signal handler may only touch async-signal-safe state.
static SIGNAL_PIPE_FD: AtomicI32 = AtomicI32::new(-1);

/// Set once SIGINT or SIGTERM arrived, for code outside the reactor (the final stdout
/// flush) that must not wait forever after being asked to stop.
static TERMINATION_REQUESTED: AtomicBool = AtomicBool::new(false);

pub fn termination_requested() -> bool {
    TERMINATION_REQUESTED.load(Ordering::Relaxed)
}

pub const SIGINT: i32 = libc::SIGINT;
pub const SIGTERM: i32 = libc::SIGTERM;
pub const SIGCHLD: i32 = libc::SIGCHLD;

extern "C" fn on_signal(signum: libc::c_int) {
    if signum == SIGINT || signum == SIGTERM {
        TERMINATION_REQUESTED.store(true, Ordering::Relaxed);
    }
    let fd = SIGNAL_PIPE_FD.load(Ordering::Relaxed);
    if fd >= 0 {
        let byte = signum as u8;
        // SAFETY: __errno_location returns this thread's errno slot, valid for the thread's
        // life; we restore it so the interrupted code never sees our write's errno.
        let errno = unsafe { *libc::__errno_location() };
        // SAFETY: write(2) is async-signal-safe; `byte` lives for the call. A full pipe
        // (EAGAIN) only loses a duplicate wake-up, which the reader tolerates because it
        // re-checks all children and the shutdown flag on any byte.
        unsafe {
            libc::write(fd, (&byte as *const u8).cast(), 1);
        }
        // SAFETY: as above.
        unsafe { *libc::__errno_location() = errno };
    }
}

/// Stops routing signals to `write_fd` if it is still the installed pipe.
pub fn uninstall_signal_pipe(write_fd: RawFd) {
    let _ = SIGNAL_PIPE_FD.compare_exchange(write_fd, -1, Ordering::Relaxed, Ordering::Relaxed);
}

/// Routes SIGINT, SIGTERM and SIGCHLD to `write_fd` (one byte per signal, the signal number).
/// `write_fd` must be non-blocking and stay open for the life of the process.
pub fn install_signal_pipe(write_fd: RawFd) -> io::Result<()> {
    SIGNAL_PIPE_FD.store(write_fd, Ordering::Relaxed);
    for signum in [SIGINT, SIGTERM, SIGCHLD] {
        // SAFETY: a zeroed sigaction is a valid "no flags, empty mask" value; we then set a
        // handler that only performs async-signal-safe work (see `on_signal`).
        let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
        action.sa_sigaction = on_signal as *const () as usize;
        // SA_RESTART keeps blocking reads on helper threads from failing with EINTR.
        action.sa_flags = libc::SA_RESTART | libc::SA_NOCLDSTOP;
        // SAFETY: `action.sa_mask` is a valid sigset_t owned by us.
        unsafe { libc::sigemptyset(&mut action.sa_mask) };
        // SAFETY: valid signal number and a fully initialised sigaction; we pass null for the
        // old action, which sigaction(2) permits.
        let rc = unsafe { libc::sigaction(signum, &action, std::ptr::null_mut()) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Ignore SIGPIPE so a vanished reader turns into EPIPE on write instead of killing us.
/// (Rust's runtime already does this for the main binary; tests and embedders may not.)
pub fn ignore_sigpipe() {
    // SAFETY: setting a signal to SIG_IGN has no memory-safety requirements.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
    }
}

fn get_fl(fd: RawFd) -> io::Result<libc::c_int> {
    // SAFETY: F_GETFL on any fd value is safe; an invalid fd yields EBADF.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(flags)
    }
}

/// The niceness of background pool threads (`workers::Pool::background`): at 10 a thread gets
/// about a tenth of a CPU that a normal one also wants, and all of an idle one.
pub const BACKGROUND_NICE: libc::c_int = 10;

/// Lowers the calling thread's priority to `BACKGROUND_NICE`. Linux keeps a niceness per
/// thread, named by its id under `PRIO_PROCESS`; lowering one's own priority needs no
/// privilege. A failure leaves the thread as it was, which is only slower for the others.
pub fn lower_thread_priority() {
    // SAFETY: gettid takes no arguments and cannot fail.
    let tid = unsafe { libc::gettid() };
    // SAFETY: setpriority reads only its integer arguments.
    let _ = unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, BACKGROUND_NICE) };
}

/// Sets or clears O_NONBLOCK and returns the previous flags so the caller can restore them:
/// stdio descriptors are shared with our parent, and leaving them non-blocking breaks it.
pub fn set_nonblocking(fd: RawFd, on: bool) -> io::Result<libc::c_int> {
    let old = get_fl(fd)?;
    let new = if on {
        old | libc::O_NONBLOCK
    } else {
        old & !libc::O_NONBLOCK
    };
    if new != old {
        // SAFETY: F_SETFL with flags derived from F_GETFL on the same fd.
        let rc = unsafe { libc::fcntl(fd, libc::F_SETFL, new) };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(old)
}

/// Restores flags saved by `set_nonblocking`.
pub fn restore_flags(fd: RawFd, flags: libc::c_int) {
    // SAFETY: F_SETFL with flags previously read from this fd; failure is harmless here.
    unsafe {
        libc::fcntl(fd, libc::F_SETFL, flags);
    }
}

/// What kind of file a descriptor is, as far as epoll cares: pipes, sockets and terminals can
/// be polled; regular files and /dev/null cannot (epoll_ctl answers EPERM).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FdKind {
    Pollable,
    NotPollable,
    Closed,
}

pub fn fd_kind(fd: RawFd) -> FdKind {
    // SAFETY: a zeroed stat is a valid out-parameter; fstat writes it fully on success.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a valid, writable stat buffer.
    let rc = unsafe { libc::fstat(fd, &mut st) };
    if rc != 0 {
        return FdKind::Closed;
    }
    match st.st_mode & libc::S_IFMT {
        libc::S_IFIFO | libc::S_IFSOCK => FdKind::Pollable,
        libc::S_IFCHR if is_tty(fd) => FdKind::Pollable,
        _ => FdKind::NotPollable,
    }
}

pub fn is_tty(fd: RawFd) -> bool {
    // SAFETY: isatty only inspects the descriptor.
    unsafe { libc::isatty(fd) == 1 }
}

/// Makes the child a session and process-group leader and resets what it inherited from us:
/// the signal mask and the dispositions of signals we handle. Killing the group then reaches
/// every grandchild a shell command starts.
pub fn detach_into_own_group(cmd: &mut Command) {
    // SAFETY: the closure runs between fork and exec and calls only async-signal-safe
    // functions (setsid, sigprocmask, signal); it allocates nothing.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(io::Error::last_os_error());
            }
            let mut empty: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut empty);
            libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
            for signum in [libc::SIGINT, libc::SIGTERM, libc::SIGCHLD, libc::SIGPIPE] {
                libc::signal(signum, libc::SIG_DFL);
            }
            Ok(())
        });
    }
}

/// True once child `pid` has exited, WITHOUT reaping it: the zombie keeps the pid (and so
/// the process group id) reserved, so the group can still be killed safely afterwards.
pub fn has_exited_unreaped(pid: u32) -> io::Result<bool> {
    let pid: libc::id_t = pid;
    // SAFETY: a zeroed siginfo_t is a valid out-parameter for waitid.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: valid idtype/id, a writable siginfo_t, and flags that neither block nor reap.
    let rc = unsafe {
        libc::waitid(
            libc::P_PID,
            pid,
            &mut info,
            libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: after a successful waitid, si_pid is initialised (0 when nothing changed).
    Ok(unsafe { info.si_pid() } != 0)
}

/// Sends `signal` to every process in group `pgid`. ESRCH (group already gone) is success.
pub fn kill_group(pgid: u32, signal: i32) -> io::Result<()> {
    let Ok(pgid) = libc::pid_t::try_from(pgid) else {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    };
    if pgid <= 1 {
        // Never signal "every process" (-1) or our own group (0) by accident.
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    }
    // A negative pid targets the group.
    kill_gone_ok(-pgid, signal)
}

/// kill(2) of a target the caller checked; ESRCH (already gone) is success.
fn kill_gone_ok(target: libc::pid_t, signal: i32) -> io::Result<()> {
    // SAFETY: kill(2) reads only its two integers and touches no memory of ours; the callers
    // never pass 0, -1 or 1 (ourselves, everyone, init).
    let rc = unsafe { libc::kill(target, signal) };
    if rc != 0 {
        let err = io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::ESRCH) {
            return Ok(());
        }
        return Err(err);
    }
    Ok(())
}

pub const SIGKILL: i32 = libc::SIGKILL;

/// Makes this process a child subreaper (`PR_SET_CHILD_SUBREAPER`): a descendant whose parent
/// dies re-parents to us instead of to PID 1, so a process a tool left behind in a session
/// of its own (`setsid`) stays ours to find, kill and reap.
pub fn become_subreaper() -> io::Result<()> {
    let on: libc::c_ulong = 1;
    // SAFETY: prctl with PR_SET_CHILD_SUBREAPER reads only its integer argument.
    let rc = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, on) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Sends `signal` to the single process `pid`. ESRCH (already gone) is success. Never
/// signals PID 1, ourselves, or a group (pid <= 0).
pub fn kill_pid(pid: u32, signal: i32) -> io::Result<()> {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    };
    if pid <= 1 || u32::try_from(pid).ok() == Some(std::process::id()) {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    }
    kill_gone_ok(pid, signal)
}

/// Reaps child `pid` if it has exited, without blocking: true once it is gone (reaped now,
/// or not our child any more), false while it runs.
pub fn reap_if_exited(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return true;
    };
    let mut status: libc::c_int = 0;
    // SAFETY: waitpid on one pid with WNOHANG writes only `status`, a live c_int.
    let rc = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
    // 0: still running; the pid: reaped; -1: ECHILD (not ours) or EINVAL, either way gone.
    rc != 0
}

/// Raw fd of anything that has one; a tiny helper so callers need not import the trait.
pub fn raw_fd(source: &impl AsRawFd) -> RawFd {
    source.as_raw_fd()
}

/// read(2) on a raw descriptor we do not own (stdin), so no `File` ever closes it.
pub fn read_fd(fd: RawFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is a valid writable region of `buf.len()` bytes for the whole call.
    let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// write(2) on a raw descriptor we do not own (stdout).
pub fn write_fd(fd: RawFd, buf: &[u8]) -> io::Result<usize> {
    // SAFETY: `buf` is a valid readable region of `buf.len()` bytes for the whole call.
    let n = unsafe { libc::write(fd, buf.as_ptr().cast(), buf.len()) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// Waits until `fd` is writable (or errored), or `timeout` passes. Used only at exit, to
/// hand the last output to a slow reader.
pub fn wait_writable(fd: RawFd, timeout: Option<std::time::Duration>) -> io::Result<bool> {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLOUT,
        revents: 0,
    };
    let ms = timeout.map_or(-1, |t| {
        libc::c_int::try_from(t.as_millis()).unwrap_or(libc::c_int::MAX)
    });
    // SAFETY: one valid pollfd, count 1.
    let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
    if rc < 0 {
        let err = io::Error::last_os_error();
        if err.kind() == io::ErrorKind::Interrupted {
            return Ok(false);
        }
        return Err(err);
    }
    Ok(rc > 0)
}

/// Turns on TCP keepalive probes after `idle` of silence, so a peer that vanished without a
/// FIN (a dead laptop, a dropped NAT entry) is noticed even on a quiet, long-lived stream;
/// and gives up on data the peer has not acknowledged within the same time (`idle` plus
/// the probes' 60 s, `TCP_USER_TIMEOUT`). Probes only run while nothing is in flight, so a
/// stream that sends heartbeats never gets them: without the user timeout the kernel would
/// retransmit to a vanished peer for about 15 minutes (`tcp_retries2`) before giving up.
pub fn set_keepalive(fd: RawFd, idle: std::time::Duration) -> io::Result<()> {
    const PROBE_INTERVAL_SECS: libc::c_int = 10;
    const PROBES: libc::c_int = 6;
    let secs = libc::c_int::try_from(idle.as_secs().max(1)).unwrap_or(libc::c_int::MAX);
    let user_timeout_ms = secs
        .saturating_add(PROBE_INTERVAL_SECS * PROBES)
        .saturating_mul(1000);
    let options: [(libc::c_int, libc::c_int, libc::c_int); 5] = [
        (libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1),
        (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, secs),
        (libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, PROBE_INTERVAL_SECS),
        (libc::IPPROTO_TCP, libc::TCP_KEEPCNT, PROBES),
        (libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT, user_timeout_ms),
    ];
    for (level, name, value) in options {
        // SAFETY: `value` is a live c_int and the length passed is its size.
        let rc = unsafe {
            libc::setsockopt(
                fd,
                level,
                name,
                (&value as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// What the kernel knows of a TCP socket's output (`TCP_INFO`, Linux 4.6 and later).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TcpSendState {
    /// Bytes the peer has acknowledged so far (`tcpi_bytes_acked`).
    pub acked: u64,
    /// Whether any output is still in the kernel: sent and not acknowledged, or not sent.
    pub queued: bool,
}

/// The kernel's view of a TCP socket's output; `None` when it does not say. Our own writes
/// are no sign of life: a kernel with room in its send buffer takes them whether or not the
/// peer reads, and frees a little room now and then even for a peer that advertises a zero
/// window. Acknowledgements stop once the peer's receive buffer is full, and start again
/// only when it reads.
pub fn tcp_send_state(fd: RawFd) -> Option<TcpSendState> {
    // SAFETY: tcp_info is plain integers, for which all-zero bytes are a valid value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: `info` is a live tcp_info and `len` holds its size; the kernel writes at most
    // `len` bytes and reports how many it wrote.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        )
    };
    // An older kernel fills a shorter struct: the fields are then not there to read.
    let needed =
        std::mem::offset_of!(libc::tcp_info, tcpi_notsent_bytes) + std::mem::size_of::<u32>();
    (rc == 0 && len as usize >= needed).then_some(TcpSendState {
        acked: info.tcpi_bytes_acked,
        queued: info.tcpi_unacked > 0 || info.tcpi_notsent_bytes > 0,
    })
}

/// The pid of the process that connected a Unix socket (`SO_PEERCRED`, recorded by the
/// kernel at `connect`), in our pid namespace; `None` when the kernel has none for it (0: a
/// peer in a pid namespace we cannot see).
pub fn unix_peer_pid(fd: RawFd) -> io::Result<Option<u32>> {
    // SAFETY: ucred is plain integers, for which all-zero bytes are a valid value.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` is a live ucred and `len` holds its size; the kernel writes at most
    // `len` bytes.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(u32::try_from(cred.pid).ok().filter(|&pid| pid > 0))
}

/// The process's effective uid.
pub fn effective_uid() -> u32 {
    // SAFETY: geteuid cannot fail and touches no memory.
    unsafe { libc::geteuid() }
}

/// `SOCK_DIAG_BY_FAMILY`, the sock_diag request type (linux/sock_diag.h).
const SOCK_DIAG_BY_FAMILY: u16 = 20;
/// The inode and owner (the uid that made it) of the TCP socket on this host whose local
/// address is `local` and remote one `remote`, asked of the kernel by its 4-tuple
/// (sock_diag's exact lookup, microseconds however many sockets there are, where
/// `/proc/net/tcp` walks the whole table); `Ok(None)` when there is none, or it has no
/// inode (closed). An IPv4 (or IPv4-mapped) pair is looked for among IPv4 sockets, then
/// as mapped among IPv6 ones. An error: sock_diag cannot be used here.
pub fn tcp_socket_inode(
    local: std::net::SocketAddr,
    remote: std::net::SocketAddr,
) -> io::Result<Option<(u64, u32)>> {
    use std::net::IpAddr;
    let (l, r) = (local.ip().to_canonical(), remote.ip().to_canonical());
    let mut tries: Vec<(u8, [u8; 16], [u8; 16])> = Vec::new();
    match (l, r) {
        (IpAddr::V4(l4), IpAddr::V4(r4)) => {
            let mut a = [0u8; 16];
            let mut b = [0u8; 16];
            a[..4].copy_from_slice(&l4.octets());
            b[..4].copy_from_slice(&r4.octets());
            tries.push((libc::AF_INET as u8, a, b));
            tries.push((
                libc::AF_INET6 as u8,
                l4.to_ipv6_mapped().octets(),
                r4.to_ipv6_mapped().octets(),
            ));
        }
        (IpAddr::V6(l6), IpAddr::V6(r6)) => {
            tries.push((libc::AF_INET6 as u8, l6.octets(), r6.octets()))
        }
        _ => return Ok(None),
    }
    // SAFETY: socket(2) takes integers only; the descriptor is owned at once below.
    let raw = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
            libc::NETLINK_SOCK_DIAG,
        )
    };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `raw` was just opened by us and is owned by nothing else.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    for (family, src, dst) in tries {
        // nlmsghdr (16) + inet_diag_req_v2 (56): family, protocol, ext, pad, states, then
        // the socket id: sport, dport (big-endian), src[16], dst[16], if, cookie[2].
        let mut req = [0u8; 72];
        req[0..4].copy_from_slice(&72u32.to_ne_bytes());
        req[4..6].copy_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
        req[6..8].copy_from_slice(&(libc::NLM_F_REQUEST as u16).to_ne_bytes());
        req[16] = family;
        req[17] = libc::IPPROTO_TCP as u8;
        req[20..24].copy_from_slice(&u32::MAX.to_ne_bytes());
        req[24..26].copy_from_slice(&local.port().to_be_bytes());
        req[26..28].copy_from_slice(&remote.port().to_be_bytes());
        req[28..44].copy_from_slice(&src);
        req[44..60].copy_from_slice(&dst);
        // INET_DIAG_NOCOOKIE: any socket of that 4-tuple.
        req[64..72].copy_from_slice(&[0xff; 8]);
        // SAFETY: `req` is readable for its length; the netlink socket is ours.
        let sent = unsafe { libc::send(fd.as_raw_fd(), req.as_ptr().cast(), req.len(), 0) };
        if sent < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut reply = [0u8; 512];
        // SAFETY: `reply` is writable for its length; the kernel answers an exact lookup
        // at once with one message.
        let n = unsafe { libc::recv(fd.as_raw_fd(), reply.as_mut_ptr().cast(), reply.len(), 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let reply = &reply[..n as usize];
        if reply.len() < 20 {
            return Err(io::Error::from(io::ErrorKind::InvalidData));
        }
        let kind = u16::from_ne_bytes([reply[4], reply[5]]);
        if kind == libc::NLMSG_ERROR as u16 {
            let errno = i32::from_ne_bytes([reply[16], reply[17], reply[18], reply[19]]);
            if -errno == libc::ENOENT {
                continue;
            }
            return Err(io::Error::from_raw_os_error(-errno));
        }
        // nlmsghdr (16) + inet_diag_msg: 4 bytes, the id (48), expires, rqueue, wqueue,
        // uid, inode.
        if kind != SOCK_DIAG_BY_FAMILY || reply.len() < 16 + 72 {
            return Err(io::Error::from(io::ErrorKind::InvalidData));
        }
        let uid = u32::from_ne_bytes([reply[80], reply[81], reply[82], reply[83]]);
        let inode = u32::from_ne_bytes([reply[84], reply[85], reply[86], reply[87]]);
        return Ok((inode != 0).then_some((u64::from(inode), uid)));
    }
    Ok(None)
}

/// Sets the process's file-creation mask and returns the previous one. Process-wide: call
/// it only while no other thread creates files (at start-up).
pub fn umask(mask: u32) -> u32 {
    // SAFETY: umask cannot fail and touches no memory of ours.
    unsafe { libc::umask(mask as libc::mode_t) as u32 }
}

/// Raises the soft open-file limit to the hard limit, and returns the limit now in force
/// (`None` if it cannot be read). Every open run holds its session file and every client a
/// socket; a default soft limit of 256 or 1024 would cap a server well below what the
/// machine allows.
pub fn raise_fd_limit() -> Option<u64> {
    // SAFETY: a zeroed rlimit is a valid out-parameter that getrlimit fills in.
    let mut limit: libc::rlimit = unsafe { std::mem::zeroed() };
    // SAFETY: valid resource id and a writable rlimit.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return None;
    }
    if limit.rlim_cur < limit.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: limit.rlim_max,
            rlim_max: limit.rlim_max,
        };
        // SAFETY: valid resource id and an initialised rlimit; failure leaves the old limit.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            limit = raised;
        }
    }
    Some(limit.rlim_cur)
}

// ---- The sandbox's kernel calls: Landlock, seccomp, a private mount namespace ------------
//
// `sandbox` decides what a command may do; these functions only speak to the kernel. What
// must happen between fork and exec (entering the mount namespace, its mounts, no new
// privileges, restricting to the Landlock ruleset, loading the seccomp filter) is prepared
// before the fork as plain data (`Confinement`): the ruleset fd is built, paths are turned
// into C strings and the filter assembled, so the child only makes raw syscalls, which are
// async-signal-safe, and allocates nothing.

/// Landlock access rights (`LANDLOCK_ACCESS_*`, linux/landlock.h): those caliban names.
/// ABI 1 has bits 0 to 12 (execute, write, read, read dir, remove dir and file, make char
/// device, dir, regular file, socket, fifo, block device, symlink).
pub mod landlock {
    pub const EXECUTE: u64 = 1 << 0;
    pub const WRITE_FILE: u64 = 1 << 1;
    pub const READ_FILE: u64 = 1 << 2;
    pub const READ_DIR: u64 = 1 << 3;
    pub const MAKE_CHAR: u64 = 1 << 6;
    pub const MAKE_BLOCK: u64 = 1 << 11;
    /// ABI 2: link or rename across directories.
    pub const REFER: u64 = 1 << 13;
    /// ABI 3.
    pub const TRUNCATE: u64 = 1 << 14;
    /// Rights that mean something on a file that is not a directory; the kernel refuses a
    /// rule that grants any other on one.
    pub const FILE_RIGHTS: u64 = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE;
    /// Network rights (ABI 4, `LANDLOCK_ACCESS_NET_*`).
    pub const BIND_TCP: u64 = 1 << 0;
    pub const CONNECT_TCP: u64 = 1 << 1;
    /// Scopes (ABI 6, `LANDLOCK_SCOPE_*`): no connecting to abstract Unix sockets and no
    /// signals beyond the sandbox's own processes.
    pub const SCOPE_ABSTRACT_UNIX_SOCKET: u64 = 1 << 0;
    pub const SCOPE_SIGNAL: u64 = 1 << 1;

    /// The file-system rights an ABI version knows.
    pub fn fs_rights(abi: u32) -> u64 {
        let mut rights = (1 << 13) - 1;
        if abi >= 2 {
            rights |= REFER;
        }
        if abi >= 3 {
            rights |= TRUNCATE;
        }
        rights
    }
}

#[repr(C)]
struct LandlockRulesetAttr {
    handled_access_fs: u64,
    handled_access_net: u64,
    scoped: u64,
}

#[repr(C, packed)]
struct LandlockPathBeneathAttr {
    allowed_access: u64,
    parent_fd: i32,
}

#[repr(C)]
struct LandlockNetPortAttr {
    allowed_access: u64,
    port: u64,
}

const LANDLOCK_CREATE_RULESET_VERSION: libc::c_uint = 1;
const LANDLOCK_RULE_PATH_BENEATH: libc::c_int = 1;
const LANDLOCK_RULE_NET_PORT: libc::c_int = 2;

/// The kernel's Landlock ABI version; the error says why there is none (ENOSYS: not built
/// in or hidden by a seccomp filter around us; EOPNOTSUPP: not among the enabled LSMs).
pub fn landlock_abi() -> io::Result<u32> {
    // SAFETY: with the VERSION flag the kernel reads neither pointer (NULL, size 0) and only
    // returns the version or an error.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<LandlockRulesetAttr>(),
            0usize,
            LANDLOCK_CREATE_RULESET_VERSION,
        )
    };
    match u32::try_from(rc) {
        Ok(version) if version > 0 => Ok(version),
        _ => Err(io::Error::last_os_error()),
    }
}

/// A Landlock ruleset being filled in; what a confined child restricts itself to.
pub struct LandlockRuleset {
    fd: OwnedFd,
    handled_fs: u64,
}

impl LandlockRuleset {
    /// A ruleset that handles (denies unless a rule allows) `fs` and `net` rights and the
    /// `scoped` scopes. Only rights the running ABI knows may be named.
    pub fn new(fs: u64, net: u64, scoped: u64) -> io::Result<LandlockRuleset> {
        let attr = LandlockRulesetAttr {
            handled_access_fs: fs,
            handled_access_net: net,
            scoped,
        };
        // SAFETY: `attr` is a live, initialised struct and the size passed is its size; an
        // older kernel accepts the larger struct as long as the fields it does not know are
        // zero, which the caller ensures by asking only for what the ABI has.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_landlock_create_ruleset,
                &attr as *const LandlockRulesetAttr,
                std::mem::size_of::<LandlockRulesetAttr>(),
                0 as libc::c_uint,
            )
        };
        let fd = libc::c_int::try_from(rc).map_err(|_| io::Error::last_os_error())?;
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the kernel just gave us this descriptor (close-on-exec) and nothing else
        // owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(LandlockRuleset { fd, handled_fs: fs })
    }

    /// Allows `access` on `path` and everything beneath it (following a symlink at `path`).
    /// On a file that is not a directory only the file rights apply.
    pub fn allow_beneath(&self, path: &Path, access: u64) -> io::Result<()> {
        let c_path = CString::new(path.as_os_str().as_bytes())?;
        // SAFETY: a valid NUL-terminated path; O_PATH opens no file content.
        let raw = unsafe { libc::open(c_path.as_ptr(), libc::O_PATH | libc::O_CLOEXEC) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` was just opened by us and is owned by nothing else.
        let parent = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: a zeroed stat is a valid out-parameter; fstat on an O_PATH fd is allowed.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `st` is a valid, writable stat buffer and the fd is live.
        if unsafe { libc::fstat(parent.as_raw_fd(), &mut st) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let mut allowed = access & self.handled_fs;
        if st.st_mode & libc::S_IFMT != libc::S_IFDIR {
            allowed &= landlock::FILE_RIGHTS;
        }
        if allowed == 0 {
            return Ok(());
        }
        // `parent` stays open until the kernel has taken the rule.
        self.add_rule(&LandlockRule::PathBeneath(LandlockPathBeneathAttr {
            allowed_access: allowed,
            parent_fd: parent.as_raw_fd(),
        }))
    }

    /// `allow_beneath` for a directory, without allocating: for a forked child, on a
    /// ruleset not yet restricted to.
    fn allow_fd_beneath(&self, path: &std::ffi::CStr, access: u64) -> io::Result<()> {
        // SAFETY: a valid NUL-terminated path; O_PATH opens no file content.
        let raw = unsafe { libc::open(path.as_ptr(), libc::O_PATH | libc::O_CLOEXEC) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        let result = self.add_rule(&LandlockRule::PathBeneath(LandlockPathBeneathAttr {
            allowed_access: access & self.handled_fs,
            parent_fd: raw,
        }));
        // SAFETY: closing the descriptor opened above, which the kernel no longer needs.
        unsafe { libc::close(raw) };
        result
    }

    /// Allows `access` (`BIND_TCP`, `CONNECT_TCP`) for TCP port `port`.
    pub fn allow_port(&self, port: u16, access: u64) -> io::Result<()> {
        self.add_rule(&LandlockRule::NetPort(LandlockNetPortAttr {
            allowed_access: access,
            port: u64::from(port),
        }))
    }

    fn add_rule(&self, rule: &LandlockRule) -> io::Result<()> {
        let (kind, attr): (libc::c_int, *const libc::c_void) = match rule {
            LandlockRule::PathBeneath(attr) => (
                LANDLOCK_RULE_PATH_BENEATH,
                (attr as *const LandlockPathBeneathAttr).cast(),
            ),
            LandlockRule::NetPort(attr) => (
                LANDLOCK_RULE_NET_PORT,
                (attr as *const LandlockNetPortAttr).cast(),
            ),
        };
        // SAFETY: `attr` points at a live struct of the layout the kernel expects for
        // `kind` (the enum pairs them), and the ruleset descriptor (and a path rule's
        // `parent_fd`, held by the caller) are open for the call.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_landlock_add_rule,
                self.fd.as_raw_fd(),
                kind,
                attr,
                0 as libc::c_uint,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

/// A rule for `landlock_add_rule`: its type and the attribute struct of that type.
enum LandlockRule {
    PathBeneath(LandlockPathBeneathAttr),
    NetPort(LandlockNetPortAttr),
}

/// Opens the absolute directory `dir` one component at a time, following no symlink on
/// the way: a directory a command swapped for a symlink (in /tmp, or in the workspace)
/// fails instead of leading elsewhere. An `O_PATH` descriptor for the `*at` calls.
fn open_dir_nofollow(dir: &Path) -> io::Result<OwnedFd> {
    let flags = libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC;
    // SAFETY: a valid NUL-terminated path.
    let raw = unsafe { libc::open(ROOT.as_ptr(), flags) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `raw` was just opened by us and is owned by nothing else.
    let mut fd = unsafe { OwnedFd::from_raw_fd(raw) };
    for part in dir.components() {
        let std::path::Component::Normal(name) = part else {
            if part == std::path::Component::RootDir {
                continue;
            }
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        };
        let name = CString::new(name.as_bytes())?;
        // SAFETY: a live directory descriptor and a NUL-terminated single component.
        let raw = unsafe { libc::openat(fd.as_raw_fd(), name.as_ptr(), flags) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: as above.
        fd = unsafe { OwnedFd::from_raw_fd(raw) };
    }
    Ok(fd)
}

/// The directory last opened by `open_dir_nofollow` for `make_empty` or `remove_if_empty`:
/// a command's placeholders sit in a handful of directories, and a walk from `/` for each
/// of them was most of their cost. Keep one for a batch of paths, not longer: a handle
/// held across commands would outlive a directory swapped meanwhile.
#[derive(Default)]
pub struct DirCache(Option<(std::path::PathBuf, OwnedFd)>);

/// The directory (opened by `open_dir_nofollow`, or the one `cache` holds) and the name of
/// `path`.
fn split_nofollow<'a>(path: &Path, cache: &'a mut DirCache) -> io::Result<(&'a OwnedFd, CString)> {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    };
    let name = CString::new(name.as_bytes())?;
    if cache.0.as_ref().is_none_or(|(held, _)| held != dir) {
        cache.0 = Some((dir.to_path_buf(), open_dir_nofollow(dir)?));
    }
    match &cache.0 {
        Some((_, fd)) => Ok((fd, name)),
        None => Err(io::Error::from(io::ErrorKind::NotFound)),
    }
}

/// Makes an empty directory (`is_dir`) or an empty file at `path`, following no symlink
/// anywhere on the way; fails with `AlreadyExists` if anything is there.
pub fn make_empty(path: &Path, is_dir: bool, cache: &mut DirCache) -> io::Result<()> {
    let (dir, name) = split_nofollow(path, cache)?;
    let rc = if is_dir {
        // SAFETY: a live directory descriptor and a NUL-terminated name.
        unsafe { libc::mkdirat(dir.as_raw_fd(), name.as_ptr(), 0o755) }
    } else {
        let flags =
            libc::O_CREAT | libc::O_EXCL | libc::O_WRONLY | libc::O_NOFOLLOW | libc::O_CLOEXEC;
        // SAFETY: as above; the mode is an integer.
        let fd = unsafe { libc::openat(dir.as_raw_fd(), name.as_ptr(), flags, 0o644) };
        if fd >= 0 {
            // SAFETY: closing the descriptor just opened.
            unsafe { libc::close(fd) };
        }
        fd.min(0)
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Removes what `make_empty` made at `path` if it is still an empty directory or an empty
/// regular file, following no symlink anywhere on the way.
pub fn remove_if_empty(path: &Path, cache: &mut DirCache) -> io::Result<()> {
    let (dir, name) = split_nofollow(path, cache)?;
    // SAFETY: a zeroed stat is a valid out-parameter.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: a live directory descriptor, a NUL-terminated name and a writable stat.
    let rc = unsafe {
        libc::fstatat(
            dir.as_raw_fd(),
            name.as_ptr(),
            &mut st,
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    let flags = match st.st_mode & libc::S_IFMT {
        // The kernel removes only an empty directory.
        libc::S_IFDIR => libc::AT_REMOVEDIR,
        libc::S_IFREG if st.st_size == 0 => 0,
        _ => return Ok(()),
    };
    // SAFETY: as above.
    if unsafe { libc::unlinkat(dir.as_raw_fd(), name.as_ptr(), flags) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// How a child gets a mount namespace of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MountNs {
    /// `unshare(CLONE_NEWNS)`: caliban may mount (root, or CAP_SYS_ADMIN).
    Plain,
    /// A user namespace first, mapping our own uid and gid to themselves, which gives the
    /// child the right to mount in a namespace of its own without any privilege.
    User,
}

/// Mount flags a bind mount must keep when remounted: in a user namespace the kernel
/// refuses to clear them (they are locked), and keeping them is right anyway.
fn kept_mount_flags(path: &CString) -> io::Result<libc::c_ulong> {
    // SAFETY: a zeroed statvfs is a valid out-parameter that statvfs fills in.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a valid NUL-terminated path and a writable statvfs.
    if unsafe { libc::statvfs(path.as_ptr(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let pairs = [
        (libc::ST_NOSUID, libc::MS_NOSUID),
        (libc::ST_NODEV, libc::MS_NODEV),
        (libc::ST_NOEXEC, libc::MS_NOEXEC),
        (libc::ST_NOATIME, libc::MS_NOATIME),
        (libc::ST_NODIRATIME, libc::MS_NODIRATIME),
        (libc::ST_RELATIME, libc::MS_RELATIME),
    ];
    Ok(pairs
        .iter()
        .filter(|(st_flag, _)| st.f_flag & st_flag != 0)
        .fold(0, |flags, (_, ms)| flags | ms))
}

enum MountStep {
    /// Every mount read-only and `nosuid` (each submount too), then the writable
    /// directories put back as they were, but `nosuid`: what Landlock cannot fence (chmod,
    /// chown, utimes, xattrs, file flags) fails with EROFS everywhere else.
    ReadOnlyRoot {
        writable: Vec<CString>,
        /// Kernels before 5.12 (no `mount_setattr`): every mount point, read from
        /// `/proc/self/mountinfo` before the fork, with the flags it must keep.
        fallback: Option<Vec<(CString, libc::c_ulong)>>,
    },
    /// Bind the path onto itself, then make that mount read-only.
    ReadOnly { path: CString, keep: libc::c_ulong },
    /// An empty read-only tmpfs over a directory.
    HideDir(CString),
    /// `/dev/null` over a file, on a `nodev` mount: opening it fails with EACCES.
    HideFile { path: CString, keep: libc::c_ulong },
    /// A procfs of its own on /proc with `hidepid=4` ("ptraceable"): a process the child
    /// may not ptrace-read (with Landlock, any outside its sandbox) is not there at all, so
    /// neither is its environment (caliban's holds API keys, and Landlock alone does not
    /// keep `/proc/PID/environ` from a confined root). Kernels before 5.8 do not know the
    /// option: the step is then skipped.
    PrivateProc,
}

/// What a child does in a mount namespace of its own before it runs the command: paths made
/// read-only and paths hidden. Built before the fork.
pub struct MountPlan {
    ns: MountNs,
    /// `/proc/self/uid_map` and `gid_map` lines for `MountNs::User`.
    uid_map: CString,
    gid_map: CString,
    steps: Vec<MountStep>,
}

const PROC_SETGROUPS: &std::ffi::CStr = c"/proc/self/setgroups";
const PROC_UID_MAP: &std::ffi::CStr = c"/proc/self/uid_map";
const PROC_GID_MAP: &std::ffi::CStr = c"/proc/self/gid_map";
const ROOT: &std::ffi::CStr = c"/";
const DEV_NULL: &std::ffi::CStr = c"/dev/null";
const TMPFS: &std::ffi::CStr = c"tmpfs";
const HIDDEN_TMPFS_OPTIONS: &std::ffi::CStr = c"size=4k,nr_inodes=1,mode=000";
const PROC: &std::ffi::CStr = c"proc";
const PROC_DIR: &std::ffi::CStr = c"/proc";
const PROC_OPTIONS: &std::ffi::CStr = c"hidepid=4";

impl MountPlan {
    pub fn new(ns: MountNs) -> MountPlan {
        // SAFETY: getuid and getgid cannot fail and touch no memory.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        let line = |id: u32| CString::new(format!("{id} {id} 1\n")).unwrap_or_default();
        MountPlan {
            ns,
            uid_map: line(uid),
            gid_map: line(gid),
            steps: Vec::new(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.steps.is_empty()
    }

    /// Makes every mount read-only and `nosuid` in the child except the `writable`
    /// directories (and what is mounted beneath them), which keep their own flags plus
    /// `nosuid`. The first step: the others mount on top of it. `setattr`: with
    /// `mount_setattr` (`has_mount_setattr`), else a remount per mount point.
    pub fn read_only_root(&mut self, writable: &[&Path], setattr: bool) -> io::Result<()> {
        if writable.len() > MAX_WRITABLE_MOUNTS {
            return Err(io::Error::other(format!(
                "more than {MAX_WRITABLE_MOUNTS} writable directories"
            )));
        }
        let writable = writable
            .iter()
            .map(|path| CString::new(path.as_os_str().as_bytes()))
            .collect::<Result<Vec<_>, _>>()?;
        let fallback = if setattr {
            None
        } else {
            let text = std::fs::read_to_string("/proc/self/mountinfo")?;
            Some(mount_points(&text, &writable))
        };
        self.steps
            .push(MountStep::ReadOnlyRoot { writable, fallback });
        Ok(())
    }

    /// Makes `path` (and what is mounted beneath it) read-only in the child.
    pub fn read_only(&mut self, path: &Path) -> io::Result<()> {
        let path = CString::new(path.as_os_str().as_bytes())?;
        let keep = kept_mount_flags(&path)?;
        self.steps.push(MountStep::ReadOnly { path, keep });
        Ok(())
    }

    /// Gives the child a /proc showing only the processes it may inspect. Only with
    /// `MountNs::Plain`: in a user namespace the kernel lets no new procfs be mounted.
    pub fn private_proc(&mut self) {
        if self.ns == MountNs::Plain {
            self.steps.push(MountStep::PrivateProc);
        }
    }

    /// Hides `path` from the child: an empty directory for a directory, a file nobody can
    /// open for anything else.
    pub fn hide(&mut self, path: &Path) -> io::Result<()> {
        let is_dir = std::fs::metadata(path)?.is_dir();
        let path = CString::new(path.as_os_str().as_bytes())?;
        if is_dir {
            self.steps.push(MountStep::HideDir(path));
        } else {
            let keep = kept_mount_flags(&path)?;
            self.steps.push(MountStep::HideFile { path, keep });
        }
        Ok(())
    }
}

/// Most writable directories one command's read-only root puts back: the child holds a
/// descriptor for each in a fixed array (it may not allocate), and a plan has the
/// workspace, three temp dirs, `$TMPDIR` and the `sandbox.writable` list.
const MAX_WRITABLE_MOUNTS: usize = 64;

/// `struct mount_attr` (linux/mount.h), for `mount_setattr`.
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

const MOUNT_ATTR_RDONLY: u64 = 0x1;
const MOUNT_ATTR_NOSUID: u64 = 0x2;
const AT_RECURSIVE: libc::c_int = 0x8000;
const OPEN_TREE_CLONE: libc::c_uint = 0x1;
const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x4;
const EMPTY: &std::ffi::CStr = c"";

/// Whether the kernel has `mount_setattr` (5.12), asked once with a descriptor that cannot
/// be valid: ENOSYS means no, anything else yes.
pub fn has_mount_setattr() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| {
        let attr = MountAttr {
            attr_set: 0,
            attr_clr: 0,
            propagation: 0,
            userns_fd: 0,
        };
        // SAFETY: a bad descriptor, a live empty path and a live struct of the size given:
        // the kernel fails the call before it changes anything.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_mount_setattr,
                -1 as libc::c_int,
                EMPTY.as_ptr(),
                libc::AT_EMPTY_PATH,
                &attr as *const MountAttr,
                std::mem::size_of::<MountAttr>(),
            )
        };
        !(rc != 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ENOSYS))
    })
}

/// `mount_setattr(dirfd, path, flags)` setting `set`. Runs in a forked child: a raw syscall.
fn mount_setattr(
    dirfd: libc::c_int,
    path: &std::ffi::CStr,
    flags: libc::c_int,
    set: u64,
) -> io::Result<()> {
    let attr = MountAttr {
        attr_set: set,
        attr_clr: 0,
        propagation: 0,
        userns_fd: 0,
    };
    // SAFETY: a live NUL-terminated path and a live struct of the size given.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            dirfd,
            path.as_ptr(),
            flags,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The mount points of a `/proc/self/mountinfo` text, each with the flags a remount must
/// keep (from its per-mount options), leaving out those at or beneath `writable`.
fn mount_points(mountinfo: &str, writable: &[CString]) -> Vec<(CString, libc::c_ulong)> {
    let unescape = |field: &str| -> Vec<u8> {
        // Spaces, tabs, newlines and backslashes are written as `\ooo`.
        let bytes = field.as_bytes();
        let mut out = Vec::with_capacity(bytes.len());
        let mut i = 0;
        while i < bytes.len() {
            let octal = bytes.get(i + 1..i + 4).and_then(|o| {
                std::str::from_utf8(o)
                    .ok()
                    .and_then(|o| u8::from_str_radix(o, 8).ok())
            });
            match octal {
                Some(byte) if bytes[i] == b'\\' => {
                    out.push(byte);
                    i += 4;
                }
                _ => {
                    out.push(bytes[i]);
                    i += 1;
                }
            }
        }
        out
    };
    let beneath = |path: &[u8], dir: &[u8]| {
        path == dir
            || (path.starts_with(dir) && (dir == b"/" || path.get(dir.len()) == Some(&b'/')))
    };
    let mut out = Vec::new();
    for line in mountinfo.lines() {
        let fields: Vec<&str> = line.split(' ').collect();
        let (Some(point), Some(options)) = (fields.get(4), fields.get(5)) else {
            continue;
        };
        let point = unescape(point);
        if writable.iter().any(|w| beneath(&point, w.to_bytes())) {
            continue;
        }
        let keep = options.split(',').fold(0, |flags, option| {
            flags
                | match option {
                    "nodev" => libc::MS_NODEV,
                    "noexec" => libc::MS_NOEXEC,
                    "noatime" => libc::MS_NOATIME,
                    "nodiratime" => libc::MS_NODIRATIME,
                    "relatime" => libc::MS_RELATIME,
                    _ => 0,
                }
        });
        if let Ok(point) = CString::new(point) {
            out.push((point, keep));
        }
    }
    out
}

/// Makes every mount read-only and nosuid but the `writable` trees, which keep their own
/// flags plus nosuid: each is cloned (with its submounts) before, and put back after.
/// Runs in a forked child: raw syscalls only, on a fixed array.
fn read_only_root(
    writable: &[CString],
    fallback: Option<&[(CString, libc::c_ulong)]>,
) -> io::Result<()> {
    if let Some(points) = fallback {
        // Before 5.12: the writable trees bound onto themselves first keep their flags,
        // since the remounts below go by the mount points read before they existed.
        for path in writable {
            mount(Some(path), path, None, libc::MS_BIND | libc::MS_REC, None)?;
        }
        for (point, keep) in points {
            let flags = libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY | libc::MS_NOSUID | keep;
            // A mount point hidden under another mount cannot be named; what covers it is
            // in the list itself.
            let _ = mount(None, point, None, flags, None);
        }
        return Ok(());
    }
    let mut fds: [libc::c_int; MAX_WRITABLE_MOUNTS] = [-1; MAX_WRITABLE_MOUNTS];
    let close_all = |fds: &[libc::c_int]| {
        for &fd in fds.iter().filter(|&&fd| fd >= 0) {
            // SAFETY: closing descriptors this function opened.
            unsafe { libc::close(fd) };
        }
    };
    let result = (|| {
        for (slot, path) in fds.iter_mut().zip(writable) {
            // SAFETY: a live NUL-terminated path; the flags ask for a detached copy.
            let fd = unsafe {
                libc::syscall(
                    libc::SYS_open_tree,
                    libc::AT_FDCWD,
                    path.as_ptr(),
                    OPEN_TREE_CLONE
                        | libc::O_CLOEXEC as libc::c_uint
                        | AT_RECURSIVE as libc::c_uint,
                )
            };
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            *slot = fd as libc::c_int;
            mount_setattr(
                *slot,
                EMPTY,
                libc::AT_EMPTY_PATH | AT_RECURSIVE,
                MOUNT_ATTR_NOSUID,
            )?;
        }
        mount_setattr(
            libc::AT_FDCWD,
            ROOT,
            AT_RECURSIVE,
            MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID,
        )?;
        for (&fd, path) in fds.iter().zip(writable) {
            // SAFETY: a descriptor of a detached tree we cloned and a live path.
            let rc = unsafe {
                libc::syscall(
                    libc::SYS_move_mount,
                    fd,
                    EMPTY.as_ptr(),
                    libc::AT_FDCWD,
                    path.as_ptr(),
                    MOVE_MOUNT_F_EMPTY_PATH,
                )
            };
            if rc != 0 {
                return Err(io::Error::last_os_error());
            }
        }
        Ok(())
    })();
    close_all(&fds);
    result
}

/// Writes `text` to a /proc file. Runs in a forked child: raw syscalls only.
fn write_proc(path: &std::ffi::CStr, text: &std::ffi::CStr) -> io::Result<()> {
    // SAFETY: a valid NUL-terminated path; open, write and close are async-signal-safe.
    let fd = unsafe { libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let bytes = text.to_bytes();
    // SAFETY: `bytes` is readable for its length; `fd` is ours and closed right after.
    let n = unsafe { libc::write(fd, bytes.as_ptr().cast(), bytes.len()) };
    let err = io::Error::last_os_error();
    // SAFETY: closing the descriptor we opened above.
    unsafe { libc::close(fd) };
    if n != bytes.len() as isize {
        return Err(err);
    }
    Ok(())
}

/// mount(2) with C strings; `None` is NULL. Runs in a forked child: a raw syscall.
fn mount(
    source: Option<&std::ffi::CStr>,
    target: &std::ffi::CStr,
    fstype: Option<&std::ffi::CStr>,
    flags: libc::c_ulong,
    data: Option<&std::ffi::CStr>,
) -> io::Result<()> {
    let ptr = |s: Option<&std::ffi::CStr>| s.map_or(std::ptr::null(), |s| s.as_ptr());
    // SAFETY: every pointer is NULL or a live NUL-terminated string for the call.
    let rc = unsafe {
        libc::mount(
            ptr(source),
            target.as_ptr(),
            ptr(fstype),
            flags,
            ptr(data).cast(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Enters a mount namespace of its own whose mounts never propagate back to ours. Runs in
/// a forked child (or a probe): raw syscalls only.
fn enter_mount_ns(
    ns: MountNs,
    uid_map: &std::ffi::CStr,
    gid_map: &std::ffi::CStr,
) -> io::Result<()> {
    let flags = match ns {
        MountNs::Plain => libc::CLONE_NEWNS,
        MountNs::User => libc::CLONE_NEWUSER | libc::CLONE_NEWNS,
    };
    // SAFETY: unshare takes flags only.
    if unsafe { libc::unshare(flags) } != 0 {
        return Err(io::Error::last_os_error());
    }
    if ns == MountNs::User {
        // The kernel requires setgroups to be denied before an unprivileged gid map.
        write_proc(PROC_SETGROUPS, c"deny")?;
        write_proc(PROC_UID_MAP, uid_map)?;
        write_proc(PROC_GID_MAP, gid_map)?;
    }
    mount(None, ROOT, None, libc::MS_REC | libc::MS_PRIVATE, None)
}

impl MountPlan {
    /// Runs in the forked child: a namespace of its own, then each step, then back into
    /// the working directory by name (the one it had is on the mount beneath, read-only
    /// once the writable directories are put back over it). A private /proc gets its own
    /// Landlock rule in `ruleset`: Landlock skips the mount points on its way up, so no
    /// rule made before the mount reaches the new procfs.
    fn apply(&self, ruleset: Option<&LandlockRuleset>) -> io::Result<()> {
        let mut cwd = [0u8; PATH_MAX];
        // SAFETY: getcwd writes at most `cwd.len()` bytes, NUL included, into our buffer.
        let have_cwd = !unsafe { libc::getcwd(cwd.as_mut_ptr().cast(), cwd.len()) }.is_null();
        enter_mount_ns(self.ns, &self.uid_map, &self.gid_map)?;
        for step in &self.steps {
            match step {
                MountStep::ReadOnlyRoot { writable, fallback } => {
                    read_only_root(writable, fallback.as_deref())?;
                }
                MountStep::ReadOnly { path, keep } => {
                    mount(Some(path), path, None, libc::MS_BIND | libc::MS_REC, None)?;
                    let flags =
                        libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY | libc::MS_NOSUID | keep;
                    mount(None, path, None, flags, None)?;
                }
                MountStep::HideDir(path) => {
                    let flags =
                        libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
                    mount(
                        Some(TMPFS),
                        path,
                        Some(TMPFS),
                        flags,
                        Some(HIDDEN_TMPFS_OPTIONS),
                    )?;
                }
                MountStep::HideFile { path, keep } => {
                    mount(Some(DEV_NULL), path, None, libc::MS_BIND, None)?;
                    let flags = libc::MS_BIND
                        | libc::MS_REMOUNT
                        | libc::MS_RDONLY
                        | libc::MS_NOSUID
                        | libc::MS_NODEV
                        | libc::MS_NOEXEC
                        | keep;
                    mount(None, path, None, flags, None)?;
                }
                MountStep::PrivateProc => {
                    let flags = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
                    let mounted =
                        mount(Some(PROC), PROC_DIR, Some(PROC), flags, Some(PROC_OPTIONS)).is_ok();
                    if let Some(ruleset) = ruleset.filter(|_| mounted) {
                        ruleset.allow_fd_beneath(PROC_DIR, PROC_RIGHTS)?;
                    }
                }
            }
        }
        if have_cwd {
            // SAFETY: getcwd NUL-terminated the buffer.
            if unsafe { libc::chdir(cwd.as_ptr().cast()) } != 0 {
                return Err(io::Error::last_os_error());
            }
        }
        Ok(())
    }
}

/// The longest working directory a child re-enters after its mounts (linux/limits.h).
const PATH_MAX: usize = 4096;

/// What a command may do in its private /proc: read, as everywhere.
const PROC_RIGHTS: u64 = landlock::EXECUTE | landlock::READ_FILE | landlock::READ_DIR;

/// Which kind of mount namespace a child of ours can enter, tried in a throwaway child (a
/// fork that only unshares and exits); `None` when neither works (no privilege and user
/// namespaces off, a container's seccomp profile, or caliban itself already confined).
/// `user_only` tries only a user namespace, as a process without privilege would.
pub fn probe_mount_ns(user_only: bool) -> Option<MountNs> {
    let kinds: &[MountNs] = if user_only {
        &[MountNs::User]
    } else {
        &[MountNs::Plain, MountNs::User]
    };
    kinds.iter().copied().find(|&ns| probe_one(ns))
}

fn probe_one(ns: MountNs) -> bool {
    let plan = MountPlan::new(ns);
    // SAFETY: the child calls only async-signal-safe functions (unshare, open, write,
    // close, mount, _exit) on data prepared before the fork, and never returns.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return false;
    }
    if pid == 0 {
        let code = match enter_mount_ns(plan.ns, &plan.uid_map, &plan.gid_map) {
            Ok(()) => 0,
            Err(_) => 1,
        };
        // SAFETY: _exit is async-signal-safe and ends the child without running our
        // destructors or atexit handlers.
        unsafe { libc::_exit(code) };
    }
    let mut status: libc::c_int = 0;
    loop {
        // SAFETY: waits for our own child; `status` is a live c_int.
        let rc = unsafe { libc::waitpid(pid, &mut status, 0) };
        if rc == pid {
            break;
        }
        if rc < 0 && io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            return false;
        }
    }
    libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0
}

/// What the seccomp filter lets a confined command do with sockets. Families go by
/// allowlist, so a family a kernel adds later (or one this one has but nobody reviewed:
/// netlink reconfigures the network namespace, vsock reaches the VM's host) is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SocketPolicy {
    /// Unix sockets only.
    LocalOnly,
    /// Unix sockets, and IPv4 and IPv6 stream and datagram sockets (TCP is then up to
    /// Landlock; UDP carries DNS), never raw ones.
    Inet,
}

impl SocketPolicy {
    /// The families a command may open, as `sandbox check` names them.
    pub fn families(self) -> &'static str {
        match self {
            SocketPolicy::LocalOnly => "AF_UNIX",
            SocketPolicy::Inet => "AF_UNIX, AF_INET, AF_INET6 (stream and datagram)",
        }
    }
}

#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH: u32 = 0xC000_003E;
#[cfg(target_arch = "aarch64")]
const AUDIT_ARCH: u32 = 0xC000_00B7;

/// Syscall numbers libc does not name yet. Since 424 (`pidfd_send_signal`) every
/// architecture shares one numbering, so these hold on x86_64 and aarch64 alike
/// (`scripts/syscall.tbl`, `arch/x86/entry/syscalls/syscall_64.tbl`).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
const SYS_QUOTACTL_FD: libc::c_long = 443;
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
const SYS_OPEN_TREE_ATTR: libc::c_long = 467;

/// The first syscall number nobody here has reviewed: every number from it up fails with
/// ENOSYS, as on a kernel that lacks the call, so a program falls back as it does there
/// and a call the next kernel adds cannot reach past this filter. Reviewed from 424 (the
/// shared numbering; 425–433 and 442 are the io_uring and mount calls already denied) to
/// 469, each decided here:
/// - denied below: 443 `quotactl_fd` (as `quotactl`), 467 `open_tree_attr` (Linux 6.15:
///   `open_tree` with attributes, it clones a mount tree without our overmounts);
/// - 435 `clone3`: ENOSYS (its flags are in memory seccomp cannot read; glibc falls back
///   to `clone`, whose flags the filter checks);
/// - allowed: 424 `pidfd_send_signal` and 434 `pidfd_open` (Landlock scopes signals), 436
///   `close_range`, 437 `openat2` (Landlock applies), 438 `pidfd_getfd` and 440
///   `process_madvise` (both need ptrace access, which Landlock keeps inside the sandbox),
///   439 `faccessat2`, 441 `epoll_pwait2`, 444–446 Landlock (a command may only narrow itself further), 447
///   `memfd_secret`, 448 `process_mrelease` (only a process already killed), 449
///   `futex_waitv`, 450 `set_mempolicy_home_node`, 451 `cachestat` (an open file's page
///   cache), 452 `fchmodat2` (as `fchmodat`), 453 `map_shadow_stack` (glibc's CET), 454–456
///   futexes, 457 `statmount` and 458 `listmount` (what /proc/self/mountinfo shows
///   already), 459–461 `lsm_*_self_attr`/`lsm_list_modules` (the caller's own LSM
///   attributes, as /proc/self/attr), 462 `mseal` (seals the caller's own memory), 463–466
///   `*xattrat` (as the `*xattr` calls), 468–469 `file_getattr`/`file_setattr` (as the
///   FS_IOC_FSGETXATTR ioctls; the immutable flag needs CAP_LINUX_IMMUTABLE, dropped).
///
/// Left to ENOSYS on purpose: 470 `listns` (6.19, enumerates namespaces) and whatever
/// comes after.
pub const FIRST_UNREVIEWED_SYSCALL: u32 = 470;

/// Syscalls a confined command never needs and that could undo its confinement or reach
/// past it: mounting and namespaces (`setns` would put root back in our mount namespace),
/// kernel keyrings, BPF, modules, reboot, swap, io_uring (its operations bypass this
/// filter's socket checks), userfaultfd, file handles (they open files without a path).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
const DENIED_SYSCALLS: &[libc::c_long] = &[
    libc::SYS_mount,
    libc::SYS_umount2,
    libc::SYS_pivot_root,
    libc::SYS_chroot,
    libc::SYS_move_mount,
    libc::SYS_open_tree,
    SYS_OPEN_TREE_ATTR,
    libc::SYS_fsopen,
    libc::SYS_fsconfig,
    libc::SYS_fsmount,
    libc::SYS_fspick,
    libc::SYS_mount_setattr,
    libc::SYS_unshare,
    libc::SYS_setns,
    libc::SYS_keyctl,
    libc::SYS_add_key,
    libc::SYS_request_key,
    libc::SYS_bpf,
    libc::SYS_perf_event_open,
    libc::SYS_kexec_load,
    libc::SYS_kexec_file_load,
    libc::SYS_init_module,
    libc::SYS_finit_module,
    libc::SYS_delete_module,
    libc::SYS_reboot,
    libc::SYS_swapon,
    libc::SYS_swapoff,
    libc::SYS_acct,
    libc::SYS_quotactl,
    SYS_QUOTACTL_FD,
    libc::SYS_io_uring_setup,
    libc::SYS_io_uring_enter,
    libc::SYS_io_uring_register,
    libc::SYS_userfaultfd,
    libc::SYS_open_by_handle_at,
    libc::SYS_name_to_handle_at,
];

/// `clone` flags that make a namespace: refused, like `unshare` and `setns`, so a command
/// never enters a namespace other than the ones caliban gave it. (CLONE_NEWTIME, 0x80,
/// cannot be asked of `clone`: that byte is the exit signal.)
const CLONE_NAMESPACES: u32 = (libc::CLONE_NEWNS
    | libc::CLONE_NEWCGROUP
    | libc::CLONE_NEWUTS
    | libc::CLONE_NEWIPC
    | libc::CLONE_NEWUSER
    | libc::CLONE_NEWPID
    | libc::CLONE_NEWNET) as u32;

/// Offsets into `struct seccomp_data`: nr, arch, then args[6] as u64 (little-endian, so an
/// argument's low 32 bits, all the kernel reads of an `int` argument, are at its offset).
const SECCOMP_NR: u32 = 0;
const SECCOMP_ARCH: u32 = 4;
const fn seccomp_arg(n: u32) -> u32 {
    16 + 8 * n
}

/// A jump target in `assemble`: the next instruction or a label.
#[derive(Clone, Copy, PartialEq, Eq)]
enum To {
    Next,
    L(&'static str),
}

/// One line of a classic-BPF program with symbolic jumps.
enum Op {
    /// A plain instruction (load, ALU, return).
    Do(u32, u32),
    /// A conditional jump on `k`.
    Jump {
        code: u32,
        k: u32,
        yes: To,
        no: To,
    },
    Label(&'static str),
}

/// Resolves labels into the relative offsets BPF jumps take.
fn assemble(ops: &[Op]) -> Vec<libc::sock_filter> {
    let mut at = std::collections::HashMap::new();
    let mut n = 0usize;
    for op in ops {
        match op {
            Op::Label(name) => {
                at.insert(*name, n);
            }
            _ => n += 1,
        }
    }
    let mut prog = Vec::with_capacity(n);
    for op in ops {
        let here = prog.len();
        let offset = |to: To| -> u8 {
            match to {
                To::Next => 0,
                // Labels are only ever ahead (BPF cannot jump back). A jump past 255
                // instructions cannot be encoded: a saturated offset would land on the
                // wrong instruction, so the filter is refused at build (the unit tests
                // assemble every policy, so a program grown past it fails there first).
                To::L(name) => u8::try_from(at[name] - here - 1)
                    .expect("a seccomp jump of more than 255 instructions"),
            }
        };
        match op {
            Op::Do(code, k) => prog.push(libc::sock_filter {
                code: *code as u16,
                jt: 0,
                jf: 0,
                k: *k,
            }),
            Op::Jump { code, k, yes, no } => prog.push(libc::sock_filter {
                code: *code as u16,
                jt: offset(*yes),
                jf: offset(*no),
                k: *k,
            }),
            Op::Label(_) => {}
        }
    }
    prog
}

/// A seccomp filter program (classic BPF), assembled before the fork.
pub struct SeccompFilter(Vec<libc::sock_filter>);

impl SeccompFilter {
    /// Elsewhere the syscall numbers above are not known: the filter allows everything and
    /// Landlock alone confines.
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    pub fn new(_sockets: SocketPolicy) -> SeccompFilter {
        SeccompFilter(vec![libc::sock_filter {
            code: (libc::BPF_RET | libc::BPF_K) as u16,
            jt: 0,
            jf: 0,
            k: libc::SECCOMP_RET_ALLOW,
        }])
    }

    /// The filter for a confined command: the syscalls in `DENIED_SYSCALLS`, `clone` with
    /// a namespace flag and TIOCSTI (typing into a terminal) fail with EPERM; `clone3` and
    /// every number from `FIRST_UNREVIEWED_SYSCALL` up with ENOSYS; sockets as `sockets`
    /// says. IPv4 and IPv6 refused by the policy fail with EACCES, which tools report as
    /// "Permission denied"; any other family but AF_UNIX with EAFNOSUPPORT, what a kernel
    /// built without the family answers, so programs take the path they already have for
    /// it (glibc's getaddrinfo, for one, assumes both IP families when netlink is
    /// missing). Any other syscall ABI (i386's `int 0x80`, x32) fails too, since its
    /// numbers differ.
    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    pub fn new(sockets: SocketPolicy) -> SeccompFilter {
        const LD: u32 = libc::BPF_LD | libc::BPF_W | libc::BPF_ABS;
        const AND: u32 = libc::BPF_ALU | libc::BPF_AND | libc::BPF_K;
        const RET: u32 = libc::BPF_RET | libc::BPF_K;
        const JEQ: u32 = libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K;
        const JGE: u32 = libc::BPF_JMP | libc::BPF_JGE | libc::BPF_K;
        const JSET: u32 = libc::BPF_JMP | libc::BPF_JSET | libc::BPF_K;
        let jeq = |k: u32, yes: To, no: To| Op::Jump {
            code: JEQ,
            k,
            yes,
            no,
        };
        let errno = |e: i32| Op::Do(RET, libc::SECCOMP_RET_ERRNO | e as u32);
        let allow = || Op::Do(RET, libc::SECCOMP_RET_ALLOW);
        let mut ops = vec![
            Op::Do(LD, SECCOMP_ARCH),
            jeq(AUDIT_ARCH, To::Next, To::L("eperm")),
            Op::Do(LD, SECCOMP_NR),
        ];
        if cfg!(target_arch = "x86_64") {
            // x32 syscalls are the x86_64 ones with bit 30 set.
            ops.push(Op::Jump {
                code: JGE,
                k: 0x4000_0000,
                yes: To::L("eperm"),
                no: To::Next,
            });
        }
        ops.push(Op::Jump {
            code: JGE,
            k: FIRST_UNREVIEWED_SYSCALL,
            yes: To::L("enosys"),
            no: To::Next,
        });
        for nr in DENIED_SYSCALLS {
            ops.push(jeq(*nr as u32, To::L("eperm"), To::Next));
        }
        ops.extend([
            jeq(libc::SYS_clone3 as u32, To::L("enosys"), To::Next),
            jeq(libc::SYS_clone as u32, To::L("clone"), To::Next),
            jeq(libc::SYS_socket as u32, To::L("socket"), To::Next),
            jeq(libc::SYS_socketpair as u32, To::L("socket"), To::Next),
            jeq(libc::SYS_ioctl as u32, To::L("ioctl"), To::Next),
            allow(),
            // The flags are the first argument of clone on both architectures (s390 is
            // the one that swaps them with the stack).
            Op::Label("clone"),
            Op::Do(LD, seccomp_arg(0)),
            Op::Jump {
                code: JSET,
                k: CLONE_NAMESPACES,
                yes: To::L("eperm"),
                no: To::L("allow"),
            },
            // The family is an int: its low 32 bits, whatever the upper ones hold.
            Op::Label("socket"),
            Op::Do(LD, seccomp_arg(0)),
            jeq(libc::AF_UNIX as u32, To::L("allow"), To::Next),
            jeq(libc::AF_INET as u32, To::L("inet"), To::Next),
            jeq(libc::AF_INET6 as u32, To::L("inet"), To::Next),
            errno(libc::EAFNOSUPPORT),
            Op::Label("inet"),
        ]);
        match sockets {
            SocketPolicy::LocalOnly => ops.push(errno(libc::EACCES)),
            SocketPolicy::Inet => ops.extend([
                // The type's low bits; SOCK_NONBLOCK and SOCK_CLOEXEC sit above them.
                Op::Do(LD, seccomp_arg(1)),
                Op::Do(AND, 0xf),
                jeq(libc::SOCK_STREAM as u32, To::L("allow"), To::Next),
                jeq(libc::SOCK_DGRAM as u32, To::L("allow"), To::Next),
                errno(libc::EACCES),
            ]),
        }
        ops.extend([
            Op::Label("ioctl"),
            Op::Do(LD, seccomp_arg(1)),
            jeq(libc::TIOCSTI as u32, To::L("eperm"), To::L("allow")),
            Op::Label("enosys"),
            errno(libc::ENOSYS),
            Op::Label("eperm"),
            errno(libc::EPERM),
            Op::Label("allow"),
            allow(),
        ]);
        SeccompFilter(assemble(&ops))
    }

    /// Loads the filter into the calling thread. Runs in the forked child: a raw syscall;
    /// needs `no_new_privs` (or CAP_SYS_ADMIN).
    fn install(&self) -> io::Result<()> {
        let prog = libc::sock_fprog {
            len: self.0.len() as libc::c_ushort,
            filter: self.0.as_ptr().cast_mut(),
        };
        // SAFETY: `prog` points at our live instruction vector for the call; the kernel
        // copies the program.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_seccomp,
                libc::SECCOMP_SET_MODE_FILTER,
                0 as libc::c_uint,
                &prog as *const libc::sock_fprog,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

/// `capget`/`capset`'s header and one of its two 32-bit halves per set, version 3
/// (`linux/capability.h`; libc does not declare them).
#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;
const CAP_SETPCAP: u32 = 8;
/// The sets are 64 bits wide; capabilities past the kernel's last (`cap_last_cap`) are
/// refused with EINVAL, which is how the loops below find the end.
const CAP_BITS: libc::c_ulong = 64;

/// Securebits that keep uid 0 from regaining capabilities on exec or setuid, each locked
/// so no descendant can clear it (SECBIT_KEEP_CAPS itself left clear, and locked so).
const LOCKED_SECUREBITS: libc::c_ulong = (libc::SECBIT_NOROOT
    | libc::SECBIT_NOROOT_LOCKED
    | libc::SECBIT_NO_SETUID_FIXUP
    | libc::SECBIT_NO_SETUID_FIXUP_LOCKED
    | libc::SECBIT_KEEP_CAPS_LOCKED) as libc::c_ulong;

/// `RLIMIT_NPROC` for a confined command: generous because a command is often a whole
/// build and every thread counts (a `cargo build` or `make -j` on a big machine runs
/// hundreds), and far below the default `pid_max` (32768) so a fork bomb stops long before
/// the machine does. In a user namespace the kernel counts only the namespace's own tasks
/// (this command's); elsewhere all of the user's. The kernel never applies it to uid 0 of
/// the initial user namespace, whatever its capabilities (`copy_process`).
pub const NPROC_LIMIT: u64 = 4096;

/// A failed capability check between fork and exec: the spawn fails with EPERM ("a
/// capability could not be dropped"), since nothing there may allocate an error message.
fn cap_left() -> io::Error {
    io::Error::from_raw_os_error(libc::EPERM)
}

fn prctl2(option: libc::c_int, arg2: libc::c_ulong) -> io::Result<libc::c_int> {
    // SAFETY: prctl with integer arguments only.
    let rc = unsafe { libc::prctl(option, arg2, 0 as libc::c_ulong, 0 as libc::c_ulong, 0) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(rc)
}

/// Whether capability `cap` is in the ambient set; `None` past the kernel's last one (or
/// on a kernel without ambient capabilities). Runs in a forked child: a raw syscall.
fn ambient_is_set(cap: libc::c_ulong) -> Option<bool> {
    // SAFETY: prctl with integer arguments only.
    let rc = unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_IS_SET as libc::c_ulong,
            cap,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
        )
    };
    match rc {
        0 => Some(false),
        1 => Some(true),
        _ => None,
    }
}

fn capget() -> io::Result<[CapData; 2]> {
    let mut header = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let mut data = [CapData::default(); 2];
    // SAFETY: a live header and two data structs, what version 3 writes.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_capget,
            &mut header as *mut CapHeader,
            data.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(data)
}

/// Drops every capability for good and checks that none is left: securebits locked (uid 0
/// gains nothing on exec), the bounding set emptied (nothing can come back from a file's
/// capabilities), the ambient set cleared, then effective, permitted and inheritable
/// zeroed. Runs in the forked child: raw syscalls on the stack only.
///
/// Locking securebits and dropping the bounding set need CAP_SETPCAP (root, or the user
/// namespace of `MountNs::User`). A process without it is left its bounding set, which is
/// harmless: its other sets end empty, and under `no_new_privs` an exec never grants more
/// than the permitted set it had.
fn drop_capabilities() -> io::Result<()> {
    let had = capget()?;
    let setpcap = had[0].effective & (1 << CAP_SETPCAP) != 0;
    if setpcap {
        // A container may have locked other securebits already: then they stay as it set
        // them, and the empty sets below still hold.
        match prctl2(libc::PR_SET_SECUREBITS, LOCKED_SECUREBITS) {
            Err(e) if e.raw_os_error() != Some(libc::EPERM) => return Err(e),
            _ => {}
        }
        for cap in 0..CAP_BITS {
            match prctl2(libc::PR_CAPBSET_DROP, cap) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => break,
                Err(e) => return Err(e),
            }
        }
        for cap in 0..CAP_BITS {
            match prctl2(libc::PR_CAPBSET_READ, cap) {
                Ok(0) => {}
                Ok(_) => return Err(cap_left()),
                Err(_) => break,
            }
        }
    }
    // Kernels before 4.3 have no ambient set (EINVAL): nothing to clear there.
    let ambient = libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong;
    match prctl2(libc::PR_CAP_AMBIENT, ambient) {
        Err(e) if e.raw_os_error() != Some(libc::EINVAL) => return Err(e),
        _ => {}
    }
    for cap in 0..CAP_BITS {
        match ambient_is_set(cap) {
            Some(false) => {}
            Some(true) => return Err(cap_left()),
            None => break,
        }
    }
    let mut header = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let none = [CapData::default(); 2];
    // SAFETY: a live header and two zeroed data structs the kernel only reads.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_capset,
            &mut header as *mut CapHeader,
            none.as_ptr(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    let left = capget()?;
    if left
        .iter()
        .any(|d| d.effective | d.permitted | d.inheritable != 0)
    {
        return Err(cap_left());
    }
    Ok(())
}

/// The calling process's `RLIMIT_NPROC`. Runs in a forked child: a raw syscall.
fn nproc_limit() -> io::Result<libc::rlimit64> {
    let mut limit = libc::rlimit64 {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: reads the calling process's limit into a live struct.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_prlimit64,
            0,
            libc::RLIMIT_NPROC,
            std::ptr::null::<libc::rlimit64>(),
            &mut limit as *mut libc::rlimit64,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(limit)
}

/// Lowers `RLIMIT_NPROC` (soft and hard, so the command cannot raise it again) to
/// `NPROC_LIMIT`, or leaves it where it already is lower. Runs in the forked child.
fn limit_processes() -> io::Result<()> {
    let current = nproc_limit()?;
    let limit = libc::rlimit64 {
        rlim_cur: current.rlim_cur.min(NPROC_LIMIT),
        rlim_max: current.rlim_max.min(NPROC_LIMIT),
    };
    // SAFETY: sets the calling process's limit from a live struct; lowering needs no
    // privilege.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_prlimit64,
            0,
            libc::RLIMIT_NPROC,
            &limit as *const libc::rlimit64,
            std::ptr::null_mut::<libc::rlimit64>(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Everything a child applies to itself between fork and exec, built before the fork.
pub struct Confinement {
    pub mounts: Option<MountPlan>,
    pub landlock: Option<LandlockRuleset>,
    pub seccomp: Option<SeccompFilter>,
}

impl Confinement {
    /// Runs in the forked child, in this order: the mount namespace and its mounts (they
    /// need privileges the later steps take away), every capability dropped (so a command
    /// run by root can neither mount, nor reconfigure the network, nor set the clock), the
    /// process limit, no new privileges (so no setuid program regains what is dropped, and
    /// the two restrictions after it need no privilege), the Landlock domain (inherited by
    /// every descendant, across setsid and exec, and it forbids unmounting what the first
    /// step mounted), the seccomp filter.
    fn apply(&self) -> io::Result<()> {
        if let Some(mounts) = self.mounts.as_ref().filter(|m| !m.is_empty()) {
            mounts.apply(self.landlock.as_ref())?;
        }
        drop_capabilities()?;
        limit_processes()?;

        // SAFETY: prctl with integer arguments only.
        if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1 as libc::c_ulong, 0, 0, 0) } != 0 {
            return Err(io::Error::last_os_error());
        }
        if let Some(ruleset) = &self.landlock {
            // SAFETY: restrict_self takes the ruleset descriptor and flags only.
            let rc = unsafe {
                libc::syscall(
                    libc::SYS_landlock_restrict_self,
                    ruleset.fd.as_raw_fd(),
                    0 as libc::c_uint,
                )
            };
            if rc != 0 {
                return Err(io::Error::last_os_error());
            }
        }
        if let Some(filter) = &self.seccomp {
            filter.install()?;
        }
        Ok(())
    }
}

/// Whether the kernel exempts our processes from `RLIMIT_NPROC`: real uid 0 of the
/// initial user namespace (`copy_process` skips the check for it). Uid 0 of a container's
/// own user namespace is another user there and is limited; when the map cannot be read
/// the answer is the cautious one.
pub fn nproc_exempt() -> bool {
    static EXEMPT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *EXEMPT.get_or_init(|| {
        // SAFETY: getuid cannot fail and touches no memory.
        if unsafe { libc::getuid() } != 0 {
            return false;
        }
        let Ok(map) = std::fs::read_to_string("/proc/self/uid_map") else {
            return true;
        };
        map.lines().any(|line| {
            let mut fields = line.split_whitespace();
            fields.next() == Some("0") && fields.next() == Some("0")
        })
    })
}

/// Where the pids cgroups of root's commands go: our own cgroup in the pids hierarchy of
/// cgroup v1, or in cgroup v2 when it already hands the pids controller to its children.
/// None where cgroupfs is read-only (most containers) or v2 keeps pids from our children:
/// enabling it is not ours to do (outside the root cgroup the kernel refuses it anyway
/// while we are in the cgroup, its no-internal-processes rule). Probed once, by making one.
pub fn pids_cgroup_parent() -> Option<&'static Path> {
    static PARENT: std::sync::OnceLock<Option<std::path::PathBuf>> = std::sync::OnceLock::new();
    PARENT.get_or_init(find_pids_parent).as_deref()
}

fn find_pids_parent() -> Option<std::path::PathBuf> {
    let has_pids = |file: &Path| {
        std::fs::read_to_string(file).is_ok_and(|c| c.split_whitespace().any(|c| c == "pids"))
    };
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    for line in own.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) =
            (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        let path = path.trim_start_matches('/');
        let dir = if controllers.split(',').any(|c| c == "pids") {
            Path::new("/sys/fs/cgroup/pids").join(path)
        } else if controllers.is_empty() {
            let dir = Path::new("/sys/fs/cgroup").join(path);
            if !has_pids(&dir.join("cgroup.subtree_control")) {
                continue;
            }
            dir
        } else {
            continue;
        };
        if PidsCgroup::new(&dir, NPROC_LIMIT).is_ok() {
            return Some(dir);
        }
    }
    None
}

/// A pids cgroup of one command of root's, whom RLIMIT_NPROC does not bind: `pids.max`
/// there counts every task of the command and its descendants, whoever they are. The child
/// joins it first thing after the fork. Emptied cgroups are removed by the next `new`
/// (ours, and those of caliban processes no longer alive).
struct PidsCgroup {
    procs: CString,
}

impl PidsCgroup {
    fn new(parent: &Path, max: u64) -> io::Result<PidsCgroup> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        sweep_pids_cgroups(parent);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = parent.join(format!("{PIDS_CGROUP_PREFIX}{}-{n}", std::process::id()));
        std::fs::create_dir(&dir)?;
        if let Err(e) = std::fs::write(dir.join("pids.max"), max.to_string()) {
            let _ = std::fs::remove_dir(&dir);
            return Err(e);
        }
        Ok(PidsCgroup {
            procs: CString::new(dir.join("cgroup.procs").as_os_str().as_bytes())?,
        })
    }

    /// Moves the calling process in ("0" is the writer itself). Runs in the forked child.
    fn join(&self) -> io::Result<()> {
        write_proc(&self.procs, c"0")
    }
}

const PIDS_CGROUP_PREFIX: &str = "caliban-";

/// Removes the empty command cgroups under `parent` that are ours or belong to a caliban
/// no longer running; a busy one (its command still runs) refuses and stays.
fn sweep_pids_cgroups(parent: &Path) {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    let own = std::process::id();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(rest) = name
            .to_str()
            .and_then(|n| n.strip_prefix(PIDS_CGROUP_PREFIX))
        else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if pid == own || !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir(entry.path());
        }
    }
}

/// What a child confined with a `Confinement` could still do, for `sandbox check`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConfinementProbe {
    /// The confinement could not be applied at all: the errno.
    pub failed: Option<i32>,
    /// Effective, permitted, inheritable or ambient capabilities left.
    pub caps_left: bool,
    /// Capabilities left in the bounding set (harmless without CAP_SETPCAP to drop them,
    /// see `drop_capabilities`, but said).
    pub bounding_left: bool,
    /// A syscall number from `FIRST_UNREVIEWED_SYSCALL` up did not fail with ENOSYS.
    pub unreviewed_reached: bool,
    /// An AF_NETLINK or AF_VSOCK socket opened.
    pub foreign_socket: bool,
    /// `clone(CLONE_NEWUSER)` made a child.
    pub new_namespace: bool,
    /// RLIMIT_NPROC is above `NPROC_LIMIT`.
    pub nproc_unlimited: bool,
}

const PROBE_FAILED: i32 = 0x40;
const PROBE_CAPS: i32 = 1;
const PROBE_BOUNDING: i32 = 2;
const PROBE_UNREVIEWED: i32 = 4;
const PROBE_SOCKET: i32 = 8;
const PROBE_NAMESPACE: i32 = 16;
const PROBE_NPROC: i32 = 32;

/// Forks a child that applies `confinement` to itself, then tries what it must not be
/// able to do and exits with a bit for each thing that worked. Raw syscalls only in the
/// child.
pub fn probe_confinement(confinement: &Confinement) -> io::Result<ConfinementProbe> {
    // SAFETY: the child makes only raw syscalls (the confinement's, then the probes) on
    // data built before the fork, and leaves by _exit without returning.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(io::Error::last_os_error());
    }
    if pid == 0 {
        let code = match confinement.apply() {
            // An errno past the six bits left is sent as 0, "unknown".
            Err(e) => PROBE_FAILED | e.raw_os_error().filter(|&n| n < 0x40).unwrap_or(0),
            Ok(()) => probe_in_child(),
        };
        // SAFETY: ends the child without running our destructors or atexit handlers.
        unsafe { libc::_exit(code) };
    }
    let mut status: libc::c_int = 0;
    loop {
        // SAFETY: waits for our own child; `status` is a live c_int.
        let rc = unsafe { libc::waitpid(pid, &mut status, 0) };
        if rc == pid {
            break;
        }
        let err = io::Error::last_os_error();
        if rc < 0 && err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
    if !libc::WIFEXITED(status) {
        return Err(io::Error::other("the probe child was killed"));
    }
    let code = libc::WEXITSTATUS(status);
    if code & PROBE_FAILED != 0 {
        return Ok(ConfinementProbe {
            failed: Some(code & 0x3f),
            ..ConfinementProbe::default()
        });
    }
    Ok(ConfinementProbe {
        failed: None,
        caps_left: code & PROBE_CAPS != 0,
        bounding_left: code & PROBE_BOUNDING != 0,
        unreviewed_reached: code & PROBE_UNREVIEWED != 0,
        foreign_socket: code & PROBE_SOCKET != 0,
        new_namespace: code & PROBE_NAMESPACE != 0,
        nproc_unlimited: code & PROBE_NPROC != 0,
    })
}

/// The probes of `probe_confinement`, in the confined child.
fn probe_in_child() -> i32 {
    let mut code = 0;
    match capget() {
        Ok(sets)
            if sets
                .iter()
                .all(|d| d.effective | d.permitted | d.inheritable == 0) => {}
        _ => code |= PROBE_CAPS,
    }
    for cap in 0..CAP_BITS {
        match prctl2(libc::PR_CAPBSET_READ, cap) {
            Ok(0) => {}
            Ok(_) => code |= PROBE_BOUNDING,
            Err(_) => break,
        }
    }
    for cap in 0..CAP_BITS {
        match ambient_is_set(cap) {
            Some(false) => {}
            Some(true) => code |= PROBE_CAPS,
            None => break,
        }
    }
    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    {
        // SAFETY: a syscall number no kernel here has reviewed, with zero arguments.
        let rc = unsafe { libc::syscall(libc::c_long::from(FIRST_UNREVIEWED_SYSCALL), 0, 0, 0) };
        if rc >= 0 || io::Error::last_os_error().raw_os_error() != Some(libc::ENOSYS) {
            code |= PROBE_UNREVIEWED;
        }
    }
    // Elsewhere the filter allows every syscall (`SeccompFilter::new`): nothing to probe.
    if cfg!(not(any(target_arch = "x86_64", target_arch = "aarch64"))) {
        return code | probe_nproc();
    }
    const AF_VSOCK: libc::c_int = 40;
    for (family, kind) in [
        (libc::AF_NETLINK, libc::SOCK_RAW),
        (AF_VSOCK, libc::SOCK_STREAM),
    ] {
        // SAFETY: socket takes integers only; a descriptor it returns is closed at once.
        let fd = unsafe { libc::socket(family, kind | libc::SOCK_CLOEXEC, 0) };
        if fd >= 0 {
            code |= PROBE_SOCKET;
            // SAFETY: closing the descriptor just opened.
            unsafe { libc::close(fd) };
        }
    }
    let flags = (libc::CLONE_NEWUSER | libc::SIGCHLD) as libc::c_ulong;
    // SAFETY: a fork-like clone (no shared memory, no new stack); a child it makes exits
    // at once.
    let pid = unsafe { libc::syscall(libc::SYS_clone, flags, 0, 0, 0, 0) };
    if pid == 0 {
        // SAFETY: ends the grandchild at once.
        unsafe { libc::_exit(0) };
    }
    if pid > 0 {
        code |= PROBE_NAMESPACE;
        let mut status = 0;
        // SAFETY: reaps the grandchild just made; `status` is a live c_int.
        unsafe { libc::waitpid(pid as libc::pid_t, &mut status, 0) };
    }
    code | probe_nproc()
}

/// `PROBE_NPROC` if RLIMIT_NPROC is above `NPROC_LIMIT` in the calling (confined) child.
fn probe_nproc() -> i32 {
    match nproc_limit() {
        Ok(limit) if limit.rlim_max <= NPROC_LIMIT => 0,
        _ => PROBE_NPROC,
    }
}

/// Confines the command's child: `confinement` is applied between fork and exec, after the
/// other `pre_exec` steps registered before it.
/// As root, where a pids cgroup can be made (`pids_cgroup_parent`), the child first joins
/// one of its own; the spawn fails if it cannot be made.
pub fn confine(cmd: &mut Command, confinement: Confinement) {
    if let Some(parent) = nproc_exempt().then(pids_cgroup_parent).flatten() {
        match PidsCgroup::new(parent, NPROC_LIMIT) {
            // SAFETY: the closure opens, writes and closes one file (raw syscalls) named
            // by a string made before the fork.
            Ok(cgroup) => unsafe {
                cmd.pre_exec(move || cgroup.join());
            },
            Err(e) => {
                let errno = e.raw_os_error().unwrap_or(libc::EIO);
                // SAFETY: the closure only returns an error.
                unsafe {
                    cmd.pre_exec(move || Err(io::Error::from_raw_os_error(errno)));
                }
            }
        }
    }
    // SAFETY: the closure runs between fork and exec and makes only raw syscalls (unshare,
    // open, write, close, mount, prctl, landlock_restrict_self, seccomp) on data prepared
    // before the fork; it allocates nothing.
    unsafe {
        cmd.pre_exec(move || confinement.apply());
    }
}

// ---------------------------------------------------------------------------------------------
// Beneath-resolution for the file tools: every open, create, rename and unlink a file tool
// makes is relative to a directory handle, one component at a time, so a symlink swapped in
// by a command at any moment cannot redirect it (`tools::beneath`).

/// `struct open_how` of openat2(2) (Linux 5.6+), laid out as the kernel reads it.
#[repr(C)]
struct OpenHow {
    flags: u64,
    mode: u64,
    resolve: u64,
}

/// openat2's `resolve` bits we use: stay beneath the directory handle, follow no symlink,
/// and no `/proc` magic link either.
const RESOLVE_NO_MAGICLINKS: u64 = 0x02;
const RESOLVE_NO_SYMLINKS: u64 = 0x04;
const RESOLVE_BENEATH: u64 = 0x08;

/// Whether openat2 works here: 0 not probed yet, 1 yes, 2 no (older kernel, or a seccomp
/// profile that refuses it).
static OPENAT2_STATE: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

fn openat2_raw(dir: RawFd, name: &std::ffi::CStr, flags: libc::c_int, mode: u32) -> libc::c_long {
    let how = OpenHow {
        flags: (flags | libc::O_CLOEXEC) as u32 as u64,
        mode: u64::from(mode),
        resolve: RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS,
    };
    // SAFETY: `name` is NUL-terminated and `how` is a live `open_how` of the size passed;
    // the kernel only reads both during the call.
    unsafe {
        libc::syscall(
            libc::SYS_openat2,
            dir,
            name.as_ptr(),
            &raw const how,
            std::mem::size_of::<OpenHow>(),
        )
    }
}

/// Whether this kernel has openat2 with the resolve flags above; probed once.
pub fn has_openat2() -> bool {
    match OPENAT2_STATE.load(Ordering::Relaxed) {
        1 => true,
        2 => false,
        _ => {
            // An absolute name is refused beneath any directory (EXDEV) by a kernel that has
            // openat2; one without it, or a seccomp profile that refuses it, says ENOSYS,
            // EPERM, EINVAL or E2BIG. Nothing is opened either way.
            let rc = openat2_raw(libc::AT_FDCWD, c"/", libc::O_PATH | libc::O_DIRECTORY, 0);
            let works = if rc >= 0 {
                // A kernel that opened it did not honour RESOLVE_BENEATH: do without.
                // SAFETY: the probe's fd is ours and nothing else holds it.
                drop(unsafe { OwnedFd::from_raw_fd(rc as RawFd) });
                false
            } else {
                io::Error::last_os_error().raw_os_error() == Some(libc::EXDEV)
            };
            OPENAT2_STATE.store(if works { 1 } else { 2 }, Ordering::Relaxed);
            works
        }
    }
}

/// What `open_beneath` opens a name as.
#[derive(Clone, Copy, Debug)]
pub enum OpenAs {
    /// A directory handle (O_PATH): to open beneath, fstat, mkdir and rename in.
    Dir,
    /// The entry itself, whatever it is, a symlink included (O_PATH): for fstat.
    Entry,
    /// For reading, O_NONBLOCK so a FIFO cannot hold the thread in open.
    Read,
    /// A new file for writing (O_CREAT | O_EXCL, mode 0666 less the umask).
    CreateNew,
}

/// Opens the single path component `name` (no `/`, not `.` or `..`) in the directory `dir`,
/// following no symlink: openat2 with RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS |
/// RESOLVE_NO_MAGICLINKS where the kernel has it (5.6+), else openat with O_NOFOLLOW, which
/// for one component is the same guarantee (the only link it could follow is the last one,
/// and O_NOFOLLOW refuses it). A symlink gives ELOOP (or, with O_PATH, an fd to the link
/// itself, which the caller's fstat sees). Every open is O_CLOEXEC and O_NOFOLLOW.
pub fn open_beneath(dir: RawFd, name: &Path, how: OpenAs) -> io::Result<OwnedFd> {
    open_one(dir, name, how, has_openat2())
}

/// `open_beneath` by openat2 or, without it, by openat with O_NOFOLLOW.
fn open_one(dir: RawFd, name: &Path, how: OpenAs, openat2: bool) -> io::Result<OwnedFd> {
    let name = component(name)?;
    let (flags, mode) = match how {
        OpenAs::Dir => (libc::O_PATH | libc::O_DIRECTORY, 0),
        OpenAs::Entry => (libc::O_PATH, 0),
        OpenAs::Read => (libc::O_RDONLY | libc::O_NONBLOCK, 0),
        OpenAs::CreateNew => (libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL, 0o666),
    };
    let flags = flags | libc::O_NOFOLLOW;
    let rc = if openat2 {
        openat2_raw(dir, &name, flags, mode)
    } else {
        // SAFETY: `name` is NUL-terminated and outlives the call.
        libc::c_long::from(unsafe {
            libc::openat(
                dir,
                name.as_ptr(),
                flags | libc::O_CLOEXEC,
                mode as libc::c_uint,
            )
        })
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just gave us this fd and nothing else holds it.
    Ok(unsafe { OwnedFd::from_raw_fd(rc as RawFd) })
}

/// `name` as a C string, if it is one path component: not empty, no `/`, not `.` or `..`.
fn component(name: &Path) -> io::Result<CString> {
    let bytes = name.as_os_str().as_bytes();
    if bytes.is_empty() || bytes.contains(&b'/') || bytes == b"." || bytes == b".." {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    CString::new(bytes).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

/// mkdirat(2) of one component in `dir`.
pub fn mkdir_beneath(dir: RawFd, name: &Path, mode: u32) -> io::Result<()> {
    let name = component(name)?;
    // SAFETY: `name` is NUL-terminated and outlives the call.
    let rc = unsafe { libc::mkdirat(dir, name.as_ptr(), mode as libc::mode_t) };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// renameat(2) of one component to another within the same directory `dir`: the entry is
/// replaced, never followed, whatever it has become.
pub fn rename_beneath(dir: RawFd, from: &Path, to: &Path) -> io::Result<()> {
    let (from, to) = (component(from)?, component(to)?);
    // SAFETY: both names are NUL-terminated and outlive the call.
    let rc = unsafe { libc::renameat(dir, from.as_ptr(), dir, to.as_ptr()) };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// unlinkat(2) of one (non-directory) component in `dir`.
pub fn unlink_beneath(dir: RawFd, name: &Path) -> io::Result<()> {
    let name = component(name)?;
    // SAFETY: `name` is NUL-terminated and outlives the call.
    let rc = unsafe { libc::unlinkat(dir, name.as_ptr(), 0) };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// A directory entry's name (its type is not taken from readdir, which may not know it:
/// callers fstat the entry through `open_beneath`).
pub struct DirEntryFd {
    pub name: std::ffi::OsString,
}

/// The entries of the directory `dir` holds (without `.` and `..`), read through the handle
/// itself, so they are that directory's whatever its path has become. At most `max` are
/// returned; the flag says whether more were left.
pub fn read_dir_fd(dir: RawFd, max: usize) -> io::Result<(Vec<DirEntryFd>, bool)> {
    // A fresh descriptor for the stream, which closedir closes; `dir` stays the caller's.
    let fresh = open_dot(dir)?;
    let raw = std::os::fd::IntoRawFd::into_raw_fd(fresh);
    // SAFETY: `raw` is an open directory fd we own; on success the stream owns it.
    let stream = unsafe { libc::fdopendir(raw) };
    if stream.is_null() {
        let err = io::Error::last_os_error();
        // SAFETY: fdopendir failed, so `raw` is still ours to close.
        drop(unsafe { OwnedFd::from_raw_fd(raw) });
        return Err(err);
    }
    let mut entries = Vec::new();
    let mut more = false;
    loop {
        // SAFETY: `stream` is a live DIR*; readdir's result is valid until the next call
        // on the same stream, and we copy out of it before then.
        let entry = unsafe { libc::readdir(stream) };
        if entry.is_null() {
            break;
        }
        // SAFETY: a non-null readdir result points at a dirent whose d_name is
        // NUL-terminated.
        let name = unsafe { std::ffi::CStr::from_ptr((*entry).d_name.as_ptr()) }
            .to_bytes()
            .to_vec();
        if name == b"." || name == b".." {
            continue;
        }
        if entries.len() >= max {
            more = true;
            break;
        }
        entries.push(DirEntryFd {
            name: std::os::unix::ffi::OsStringExt::from_vec(name),
        });
    }
    // SAFETY: `stream` is live and closed exactly once here, which closes its fd.
    unsafe { libc::closedir(stream) };
    Ok((entries, more))
}

/// A readable descriptor of the directory `dir` refers to (which may be an O_PATH handle).
pub fn open_dot(dir: RawFd) -> io::Result<OwnedFd> {
    // SAFETY: the literal is NUL-terminated.
    let rc = unsafe {
        libc::openat(
            dir,
            c".".as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just gave us this fd and nothing else holds it.
    Ok(unsafe { OwnedFd::from_raw_fd(rc) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_beneath_follows_no_symlink_with_openat2_or_without() {
        let dir = std::env::temp_dir().join(format!("caliban-sys-beneath-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("real")).unwrap();
        std::fs::write(dir.join("real/f"), "x").unwrap();
        std::os::unix::fs::symlink(dir.join("real"), dir.join("link")).unwrap();
        std::os::unix::fs::symlink(dir.join("real/f"), dir.join("flink")).unwrap();
        let root = std::fs::File::open(&dir).unwrap();
        let fd = root.as_raw_fd();
        let ways: &[bool] = if has_openat2() {
            &[true, false]
        } else {
            &[false]
        };
        for &openat2 in ways {
            assert!(open_one(fd, Path::new("real"), OpenAs::Dir, openat2).is_ok());
            let err = |name: &str, how| {
                open_one(fd, Path::new(name), how, openat2)
                    .expect_err(name)
                    .raw_os_error()
            };
            // A symlinked directory is never entered, a symlinked file never opened.
            assert!(matches!(
                err("link", OpenAs::Dir),
                Some(libc::ELOOP | libc::ENOTDIR)
            ));
            assert_eq!(err("flink", OpenAs::Read), Some(libc::ELOOP));
            assert_eq!(err("flink", OpenAs::CreateNew), Some(libc::EEXIST));
            // Only single components: no `..`, no `/`, no absolute path.
            for name in ["..", ".", "real/f", "/etc", ""] {
                assert_eq!(err(name, OpenAs::Entry), Some(libc::EINVAL), "{name}");
            }
            // The entry itself is what O_PATH opens, the symlink included.
            let link = open_one(fd, Path::new("link"), OpenAs::Entry, openat2).unwrap();
            let meta = std::fs::File::from(link).metadata().unwrap();
            assert!(meta.file_type().is_symlink());
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn tcp_option(fd: RawFd, name: libc::c_int) -> libc::c_int {
        let mut value: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: `value` is a live c_int and `len` holds its size; both outlive the call.
        let rc = unsafe {
            libc::getsockopt(
                fd,
                libc::IPPROTO_TCP,
                name,
                (&mut value as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        assert_eq!(rc, 0, "getsockopt: {}", io::Error::last_os_error());
        value
    }

    /// Runs a classic-BPF seccomp program over one syscall, as the kernel would: the
    /// instructions `SeccompFilter::new` uses, nothing else.
    fn run_filter(prog: &[libc::sock_filter], arch: u32, nr: i64, args: [u64; 6]) -> u32 {
        let mut data = [0u8; 64];
        data[0..4].copy_from_slice(&(nr as u32).to_le_bytes());
        data[4..8].copy_from_slice(&arch.to_le_bytes());
        for (i, arg) in args.iter().enumerate() {
            data[16 + 8 * i..24 + 8 * i].copy_from_slice(&arg.to_le_bytes());
        }
        let (mut acc, mut pc) = (0u32, 0usize);
        loop {
            let ins = prog[pc];
            let code = u32::from(ins.code);
            pc += 1;
            match code {
                c if c == libc::BPF_LD | libc::BPF_W | libc::BPF_ABS => {
                    let at = ins.k as usize;
                    acc = u32::from_le_bytes(data[at..at + 4].try_into().unwrap());
                }
                c if c == libc::BPF_ALU | libc::BPF_AND | libc::BPF_K => acc &= ins.k,
                c if c == libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K => {
                    pc += usize::from(if acc == ins.k { ins.jt } else { ins.jf });
                }
                c if c == libc::BPF_JMP | libc::BPF_JGE | libc::BPF_K => {
                    pc += usize::from(if acc >= ins.k { ins.jt } else { ins.jf });
                }
                c if c == libc::BPF_JMP | libc::BPF_JSET | libc::BPF_K => {
                    pc += usize::from(if acc & ins.k != 0 { ins.jt } else { ins.jf });
                }
                c if c == libc::BPF_RET | libc::BPF_K => return ins.k,
                other => panic!("unexpected instruction {other:#x}"),
            }
        }
    }

    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    #[test]
    // libc's ioctl numbers are u64 with glibc and c_int with musl.
    #[allow(clippy::unnecessary_cast)]
    fn the_seccomp_filter_refuses_what_it_says_and_allows_the_rest() {
        // Not in musl's libc: linux/socket.h.
        const AF_VSOCK: i32 = 40;
        let allow = libc::SECCOMP_RET_ALLOW;
        let errno = |e: i32| libc::SECCOMP_RET_ERRNO | e as u32;
        let socket = |domain: i32, kind: i32| {
            [
                domain as u64,
                (kind | libc::SOCK_CLOEXEC) as u64,
                0,
                0,
                0,
                0,
            ]
        };
        for policy in [SocketPolicy::LocalOnly, SocketPolicy::Inet] {
            let prog = SeccompFilter::new(policy).0;
            let run = |nr: libc::c_long, args: [u64; 6]| run_filter(&prog, AUDIT_ARCH, nr, args);
            for nr in DENIED_SYSCALLS {
                assert_eq!(run(*nr, [0; 6]), errno(libc::EPERM), "{nr}");
            }
            assert_eq!(run(SYS_OPEN_TREE_ATTR, [0; 6]), errno(libc::EPERM));
            // A syscall no one reviewed, the next kernel's or a made-up one, is missing.
            for nr in [
                FIRST_UNREVIEWED_SYSCALL,
                FIRST_UNREVIEWED_SYSCALL + 1,
                1000,
                0x3fff_ffff,
            ] {
                assert_eq!(run(nr.into(), [0; 6]), errno(libc::ENOSYS), "{nr}");
            }
            assert_eq!(run(libc::SYS_clone3, [0; 6]), errno(libc::ENOSYS));
            for nr in [
                libc::SYS_read,
                libc::SYS_write,
                libc::SYS_execve,
                libc::SYS_clone,
                libc::SYS_landlock_restrict_self,
                libc::SYS_mseal,
                FIRST_UNREVIEWED_SYSCALL as libc::c_long - 1,
            ] {
                assert_eq!(run(nr, [0; 6]), allow, "{nr}");
            }
            // fork, pthread_create, posix_spawn: no namespace flag, allowed.
            let thread = libc::CLONE_VM
                | libc::CLONE_FS
                | libc::CLONE_FILES
                | libc::CLONE_SIGHAND
                | libc::CLONE_THREAD
                | libc::CLONE_SYSVSEM
                | libc::CLONE_SETTLS
                | libc::CLONE_PARENT_SETTID
                | libc::CLONE_CHILD_CLEARTID;
            for flags in [
                libc::SIGCHLD,
                thread,
                libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            ] {
                assert_eq!(run(libc::SYS_clone, [flags as u64, 0, 0, 0, 0, 0]), allow);
            }
            for flag in [
                libc::CLONE_NEWNS,
                libc::CLONE_NEWCGROUP,
                libc::CLONE_NEWUTS,
                libc::CLONE_NEWIPC,
                libc::CLONE_NEWUSER,
                libc::CLONE_NEWPID,
                libc::CLONE_NEWNET,
            ] {
                let args = [(flag | libc::SIGCHLD) as u64, 0, 0, 0, 0, 0];
                assert_eq!(run(libc::SYS_clone, args), errno(libc::EPERM), "{flag:#x}");
            }
            let tiocsti = [0, libc::TIOCSTI as u64, 0, 0, 0, 0];
            assert_eq!(run(libc::SYS_ioctl, tiocsti), errno(libc::EPERM));
            assert_eq!(
                run(libc::SYS_ioctl, [0, libc::TCGETS as u64, 0, 0, 0, 0]),
                allow
            );
            let inet = match policy {
                SocketPolicy::LocalOnly => errno(libc::EACCES),
                SocketPolicy::Inet => allow,
            };
            for nr in [libc::SYS_socket, libc::SYS_socketpair] {
                for kind in [libc::SOCK_STREAM, libc::SOCK_DGRAM, libc::SOCK_SEQPACKET] {
                    assert_eq!(run(nr, socket(libc::AF_UNIX, kind)), allow);
                }
                // Only the low 32 bits are the family: high ones do not make it another.
                let mut high = socket(libc::AF_UNIX, libc::SOCK_STREAM);
                high[0] |= 1 << 32;
                assert_eq!(run(nr, high), allow);
                high[0] = (1 << 32) | libc::AF_NETLINK as u64;
                assert_eq!(run(nr, high), errno(libc::EAFNOSUPPORT));
                for domain in [
                    libc::AF_NETLINK,
                    AF_VSOCK,
                    libc::AF_PACKET,
                    libc::AF_BLUETOOTH,
                    libc::AF_ALG,
                    libc::AF_KEY,
                    libc::AF_APPLETALK,
                    0,
                    46,
                    255,
                ] {
                    for kind in [libc::SOCK_RAW, libc::SOCK_DGRAM, libc::SOCK_STREAM] {
                        let got = run(nr, socket(domain, kind));
                        assert_eq!(got, errno(libc::EAFNOSUPPORT), "{policy:?} {domain}");
                    }
                }
                for domain in [libc::AF_INET, libc::AF_INET6] {
                    for kind in [libc::SOCK_STREAM, libc::SOCK_DGRAM] {
                        assert_eq!(run(nr, socket(domain, kind)), inet, "{policy:?}");
                    }
                    for kind in [libc::SOCK_RAW, libc::SOCK_SEQPACKET, libc::SOCK_RDM] {
                        let got = run(nr, socket(domain, kind));
                        assert_eq!(got, errno(libc::EACCES), "{policy:?} {kind}");
                    }
                }
            }
            // Another ABI's numbers mean other syscalls: refused whole.
            assert_eq!(
                run_filter(&prog, 0x4000_0003, 3, [0; 6]),
                errno(libc::EPERM)
            );
            if cfg!(target_arch = "x86_64") {
                assert_eq!(run(0x4000_0000, [0; 6]), errno(libc::EPERM), "x32");
            }
        }
    }

    #[test]
    fn placeholders_are_made_and_removed_through_no_symlink() {
        let root = std::env::temp_dir().join(format!("caliban-empty-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("real")).unwrap();
        let root = root.canonicalize().unwrap();
        std::os::unix::fs::symlink(root.join("real"), root.join("link")).unwrap();
        // One handle on each directory serves the calls for its entries.
        let mut dirs = DirCache::default();
        // A directory swapped for a symlink leads nowhere.
        assert!(make_empty(&root.join("link/.caliban"), true, &mut dirs).is_err());
        assert!(make_empty(&root.join("link/.mcp.json"), false, &mut dirs).is_err());
        assert!(
            std::fs::read_dir(root.join("real"))
                .unwrap()
                .next()
                .is_none()
        );
        make_empty(&root.join("real/.caliban"), true, &mut dirs).unwrap();
        make_empty(&root.join("real/.mcp.json"), false, &mut dirs).unwrap();
        let again = make_empty(&root.join("real/.mcp.json"), false, &mut dirs);
        assert_eq!(again.unwrap_err().kind(), io::ErrorKind::AlreadyExists);
        std::fs::write(root.join("real/.mcp.json"), "{}").unwrap();
        // What someone filled stays; what is empty goes.
        remove_if_empty(&root.join("real/.mcp.json"), &mut dirs).unwrap();
        remove_if_empty(&root.join("real/.caliban"), &mut dirs).unwrap();
        assert!(root.join("real/.mcp.json").exists());
        assert!(!root.join("real/.caliban").exists());
        assert!(remove_if_empty(&root.join("link/.mcp.json"), &mut dirs).is_err());
        assert!(root.join("real/.mcp.json").exists());
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn mount_points_come_with_their_flags_and_leave_the_writable_trees_out() {
        let mountinfo = "\
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
24 27 0:6 / /dev rw,nosuid,noexec,relatime - devtmpfs devtmpfs rw
30 27 0:27 / /tmp rw,nosuid,nodev - tmpfs tmpfs rw
31 30 0:28 / /tmp/ws/vol rw,noatime - tmpfs tmpfs rw
32 27 0:29 / /mnt/a\\040b ro,nodev - tmpfs tmpfs ro
33 27 0:30 / /tmpfoo rw - tmpfs tmpfs rw
";
        let writable = [c"/tmp".to_owned()];
        let points = mount_points(mountinfo, &writable);
        let named: Vec<(&[u8], libc::c_ulong)> =
            points.iter().map(|(p, f)| (p.to_bytes(), *f)).collect();
        assert_eq!(
            named,
            [
                (&b"/"[..], libc::MS_RELATIME),
                (b"/dev", libc::MS_NOEXEC | libc::MS_RELATIME),
                (b"/mnt/a b", libc::MS_NODEV),
                (b"/tmpfoo", 0),
            ]
        );
    }

    #[test]
    fn the_landlock_abi_is_a_version_or_a_reason() {
        match landlock_abi() {
            Ok(abi) => assert!(abi >= 1),
            Err(e) => assert!(e.raw_os_error().is_some(), "{e}"),
        }
    }

    #[test]
    fn keepalive_also_bounds_how_long_unacknowledged_data_may_wait() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind loopback");
        let tcp =
            std::net::TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
        set_keepalive(raw_fd(&tcp), std::time::Duration::from_secs(60)).expect("keepalive");
        assert_eq!(tcp_option(raw_fd(&tcp), libc::TCP_KEEPIDLE), 60);
        // Idle plus six probes ten seconds apart: the same two minutes either way.
        assert_eq!(tcp_option(raw_fd(&tcp), libc::TCP_USER_TIMEOUT), 120_000);
    }

    #[test]
    fn the_kernel_says_what_the_peer_took_and_what_is_still_queued() {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind loopback");
        let mut tcp =
            std::net::TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
        let (mut peer, _) = listener.accept().expect("accept");
        // (Linux counts the handshake's SYN as one byte.)
        let before = tcp_send_state(raw_fd(&tcp)).expect("tcp_info");
        tcp.write_all(b"hello").expect("write");
        let mut buf = [0u8; 5];
        peer.read_exact(&mut buf).expect("read");
        // Loopback acknowledges at once, but not necessarily before the read returns.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let expected = TcpSendState {
            acked: before.acked + 5,
            queued: false,
        };
        while tcp_send_state(raw_fd(&tcp)) != Some(expected) {
            assert!(std::time::Instant::now() < deadline, "never acknowledged");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(tcp_send_state(-1), None);
    }
}
