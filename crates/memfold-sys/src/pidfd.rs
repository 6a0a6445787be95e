//! Pidfds: a process held by a descriptor, so that a pid read once keeps naming the same
//! process. A pid alone may be freed and handed to a new process; a pidfd keeps naming
//! the one it was taken for, and says when it has exited.
//!
//! Used where memfold looks at a peer through `/proc/PID` (memfoldd at a block device's
//! descriptors, memfold-blk at QEMU's memory): a look is believed only if the pidfd's
//! process is still alive after it ([`alive`]), so the pid cannot have been reused
//! during it.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// `SO_PEERPIDFD` (Linux 6.5+): a pidfd of a unix socket's peer, taken by the kernel at
/// `connect` time, so it names the process that connected even if it is gone since.
const SO_PEERPIDFD: libc::c_int = 77;

/// A pidfd of process `pid`.
///
/// Errors: no such process (`ESRCH`), out of descriptors.
pub fn open(pid: u32) -> io::Result<OwnedFd> {
    let p = rustix::process::Pid::from_raw(pid as i32)
        .ok_or_else(|| io::Error::from_raw_os_error(libc::ESRCH))?;
    Ok(rustix::process::pidfd_open(
        p,
        rustix::process::PidfdFlags::empty(),
    )?)
}

/// A pidfd of the process at the other end of the connected unix socket `sock`: the
/// kernel's (`SO_PEERPIDFD`, the process that connected) where it has it, else — only on
/// a kernel without the option, before Linux 6.5 — a pidfd of `SO_PEERCRED`'s pid, then
/// checked to be alive (there a pid freed and reused before this call would be taken for
/// the peer; from then on the pidfd holds).
///
/// Errors: not a connected unix socket, the peer has exited (`ESRCH`), out of
/// descriptors.
pub fn of_peer(sock: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    let mut fd: libc::c_int = -1;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `fd`, which lives across it.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_PEERPIDFD,
            (&mut fd as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if rc == 0 && fd >= 0 {
        // SAFETY: a new descriptor the kernel just gave us, owned by nothing else.
        let pidfd = unsafe { OwnedFd::from_raw_fd(fd) };
        return match pid_of(pidfd.as_fd()) {
            Some(_) => Ok(pidfd),
            None => Err(io::Error::from_raw_os_error(libc::ESRCH)),
        };
    }
    if rc == 0 {
        return Err(io::Error::from_raw_os_error(libc::ESRCH));
    }
    let e = io::Error::last_os_error();
    if !falls_back_on(e.raw_os_error().unwrap_or(0)) {
        return Err(e);
    }
    // A peer outside our pid namespace (pid 0) has no process to open here.
    let pid = crate::socket::peer_of(sock)?.pid;
    if pid == 0 {
        return Err(io::Error::from_raw_os_error(libc::ESRCH));
    }
    let pidfd = open(pid)?;
    if !alive(pidfd.as_fd()) {
        return Err(io::Error::from_raw_os_error(libc::ESRCH));
    }
    Ok(pidfd)
}

/// Whether `SO_PEERPIDFD` failing with `errno` leaves `SO_PEERCRED`'s pid to go by:
/// only where the kernel has no such option (`ENOPROTOOPT`, before Linux 6.5). A kernel
/// that has it fails with `EINVAL`, `ESRCH` or `ENODATA` once the peer has exited and
/// been reaped (6.5 to ~6.15): its pid may name another process by then, so the peer is
/// taken as gone.
fn falls_back_on(errno: i32) -> bool {
    errno == libc::ENOPROTOOPT
}

/// The pid of the process pidfd `pidfd` names (`Pid:` of its `/proc/self/fdinfo`);
/// `None` if it is not a pidfd or its process has exited and been reaped (pid −1 or 0).
pub fn pid_of(pidfd: BorrowedFd<'_>) -> Option<u32> {
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", pidfd.as_raw_fd())).ok()?;
    let pid: i64 = info
        .lines()
        .find_map(|l| l.strip_prefix("Pid:"))
        .and_then(|v| v.trim().parse().ok())?;
    (pid > 0).then_some(pid as u32)
}

/// Whether the process pidfd `pidfd` names still runs: its pidfd does not poll readable,
/// which it does once the process has exited. While it runs its pid is its own.
pub fn alive(pidfd: BorrowedFd<'_>) -> bool {
    let mut p = libc::pollfd {
        fd: pidfd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: poll reads and writes the one pollfd it is given, which lives across it.
    let rc = unsafe { libc::poll(&mut p, 1, 0) };
    !(rc > 0 && p.revents & (libc::POLLIN | libc::POLLHUP) != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pidfd_says_when_its_process_has_exited() {
        let mut c = std::process::Command::new("sleep")
            .arg("0.2")
            .spawn()
            .unwrap();
        let p = open(c.id()).unwrap();
        assert!(alive(p.as_fd()));
        assert_eq!(pid_of(p.as_fd()), Some(c.id()));
        c.wait().unwrap();
        assert!(!alive(p.as_fd()));
        assert_eq!(pid_of(p.as_fd()), None, "reaped: no pid");
    }

    /// A reaped peer's pid is never opened in its place: a kernel with `SO_PEERPIDFD`
    /// says so by one of these errors, and only a kernel without it falls back.
    #[test]
    fn only_a_kernel_without_the_option_falls_back_to_the_pid() {
        assert!(falls_back_on(libc::ENOPROTOOPT));
        for e in [
            libc::EINVAL,
            libc::ESRCH,
            libc::ENODATA,
            libc::EBADF,
            libc::ENOTSOCK,
        ] {
            assert!(!falls_back_on(e), "errno {e}");
        }
    }

    #[test]
    fn the_peer_of_a_connection_is_the_process_that_connected() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let p = of_peer(a.as_fd()).unwrap();
        assert_eq!(pid_of(p.as_fd()), Some(std::process::id()));
        assert!(alive(p.as_fd()));
        let f = tempfile::tempfile().unwrap();
        assert!(of_peer(f.as_fd()).is_err(), "not a socket");
    }
}
