//! Every `unsafe` block and every direct libc call in caliban lives here, each with a SAFETY
//! note. The rest of the crate sees safe functions with io::Result.
//!
//! It owns: signal handlers that write to a self-pipe, file-status-flag changes, process
//! groups (setsid in the child, group kill), the child subreaper flag and single-process
//! kill and reap, fd-type probes, and the terminal check. It must
//! not know about runs, protocols or the reactor's tokens.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::process::CommandExt;
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

/// Sets the process's file-creation mask and returns the previous one. Process-wide: call
/// it only while no other thread creates files (at start-up).
pub fn umask(mask: u32) -> u32 {
    // SAFETY: umask cannot fail and touches no memory of ours.
    unsafe { libc::umask(mask as libc::mode_t) as u32 }
}

/// Raises the soft open-file limit to the hard limit. Every open run holds its session file
/// and every client a socket; a default soft limit of 256 or 1024 would cap a server well
/// below what the machine allows.
pub fn raise_fd_limit() {
    // SAFETY: a zeroed rlimit is a valid out-parameter that getrlimit fills in.
    let mut limit: libc::rlimit = unsafe { std::mem::zeroed() };
    // SAFETY: valid resource id and a writable rlimit.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return;
    }
    if limit.rlim_cur < limit.rlim_max {
        limit.rlim_cur = limit.rlim_max;
        // SAFETY: valid resource id and an initialised rlimit; failure leaves the old limit.
        unsafe {
            libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
