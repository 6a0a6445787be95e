//! A Unix `SOCK_SEQPACKET` socket that carries packets of bytes with file descriptors
//! alongside (`SCM_RIGHTS`): one `sendmsg` is one packet, read whole by one `recvmsg`.
//!
//! Bytes only: what the bytes mean is `memfold-wire`'s business.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;

/// Most descriptors one packet carries.
pub const MAX_FDS: usize = 16;

/// Control buffer words: room for one `SCM_RIGHTS` message of [`MAX_FDS`] descriptors
/// (`CMSG_SPACE(16 · 4)` is 80 bytes on 64-bit Linux), `u64`s so that it is aligned for
/// `cmsghdr`.
const CONTROL_WORDS: usize = 16;

/// Creates a `SOCK_SEQPACKET` socket.
fn seqpacket() -> io::Result<OwnedFd> {
    unix_socket(libc::SOCK_SEQPACKET, 0)
}

/// A new Unix socket of type `kind` (`SOCK_SEQPACKET`, `SOCK_STREAM`), close-on-exec,
/// with `flags` (`SOCK_NONBLOCK` or 0).
fn unix_socket(kind: libc::c_int, flags: libc::c_int) -> io::Result<OwnedFd> {
    // SAFETY: socket() takes no pointers; it returns a new descriptor or -1.
    let fd = unsafe { libc::socket(libc::AF_UNIX, kind | libc::SOCK_CLOEXEC | flags, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A new Unix socket of type `kind` connected to `path`, blocking. With `at_once`, a
/// listener whose backlog is full is `WouldBlock` at once instead of waited for.
///
/// Errors: nothing listens there (the error names the path), the backlog is full
/// (`at_once` only), the path is too long, out of descriptors.
fn connect_unix(path: &Path, kind: libc::c_int, at_once: bool) -> io::Result<OwnedFd> {
    let fd = unix_socket(kind, if at_once { libc::SOCK_NONBLOCK } else { 0 })?;
    let (addr, len) = sockaddr(path)?;
    // SAFETY: `addr` is a valid sockaddr_un of `len` bytes that outlives the call.
    let rc = unsafe {
        libc::connect(
            fd.as_raw_fd(),
            &addr as *const libc::sockaddr_un as *const libc::sockaddr,
            len,
        )
    };
    if rc != 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(
            e.kind(),
            format!("connecting to {}: {e}", path.display()),
        ));
    }
    if at_once {
        // A Unix connect completes or fails at once (no EINPROGRESS): blocking from here.
        rustix::fs::fcntl_setfl(&fd, rustix::fs::OFlags::empty())?;
    }
    Ok(fd)
}

/// The `sockaddr_un` of `path`.
fn sockaddr(path: &Path) -> io::Result<(libc::sockaddr_un, libc::socklen_t)> {
    use std::os::unix::ffi::OsStrExt;
    // SAFETY: sockaddr_un is plain data (an integer and a byte array): all zeros is a
    // valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = path.as_os_str().as_bytes();
    if bytes.len() >= addr.sun_path.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "socket path too long (max {} bytes): {}",
                addr.sun_path.len() - 1,
                path.display()
            ),
        ));
    }
    for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    Ok((
        addr,
        std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t,
    ))
}

/// A listening `SOCK_SEQPACKET` socket bound to a path.
#[derive(Debug)]
pub struct SeqpacketListener {
    fd: OwnedFd,
}

impl SeqpacketListener {
    /// Binds `path` (removing a stale socket file first) and listens. The socket file is
    /// made mode 0600: only its owner (and root) may connect; a process that can reach
    /// it is then checked by its credentials ([`Seqpacket::peer`]).
    ///
    /// Errors: the path is too long, its folder is missing or not writable (the error
    /// names the path).
    pub fn bind(path: &Path) -> io::Result<SeqpacketListener> {
        let _ = std::fs::remove_file(path);
        let fd = seqpacket()?;
        let (addr, len) = sockaddr(path)?;
        // SAFETY: `addr` is a valid sockaddr_un of `len` bytes that outlives the call.
        let bound = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                &addr as *const libc::sockaddr_un as *const libc::sockaddr,
                len,
            )
        } == 0;
        // SAFETY: listen() takes no pointers.
        if !bound || unsafe { libc::listen(fd.as_raw_fd(), 64) } != 0 {
            let e = io::Error::last_os_error();
            return Err(io::Error::new(
                e.kind(),
                format!("binding {}: {e}", path.display()),
            ));
        }
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("making {} mode 0600: {e}", path.display()),
            )
        })?;
        Ok(SeqpacketListener { fd })
    }

    /// Opens the socket at `path` to group `gid` too (mode 0660, group `gid`): the
    /// agents of QEMUs that run as other users in that group may connect.
    ///
    /// Errors: chown or chmod failed.
    pub fn share_with_group(path: &Path, gid: u32) -> io::Result<()> {
        use std::os::unix::fs::PermissionsExt;
        std::os::unix::fs::chown(path, None, Some(gid))
            .and_then(|_| std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660)))
            .map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!("opening {} to group {gid}: {e}", path.display()),
                )
            })
    }

    /// Stops listening: a thread blocked in [`SeqpacketListener::accept`] returns
    /// `EINVAL` (as does every later accept), and connects are refused from now on.
    pub fn shutdown(&self) {
        let _ = rustix::net::shutdown(&self.fd, rustix::net::Shutdown::Both);
    }

    /// Waits for the next connection.
    ///
    /// Errors: accept failed.
    pub fn accept(&self) -> io::Result<Seqpacket> {
        // SAFETY: null address and length pointers are allowed (the peer's address is not
        // wanted); accept4 returns a new descriptor or -1.
        let fd = unsafe {
            libc::accept4(
                self.fd.as_raw_fd(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                libc::SOCK_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Seqpacket { fd })
    }
}

/// A connected peer's credentials (SO_PEERCRED).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Peer {
    /// Its process, as this process's pid namespace names it; 0 if it is in a namespace
    /// this one cannot see (a QEMU in a container talking to a memfoldd outside it sees
    /// memfoldd so): nothing can be looked up by it.
    pub pid: u32,
    /// Its user.
    pub uid: u32,
    /// Its group.
    pub gid: u32,
}

impl Peer {
    /// Whether this peer may talk to a process of user `me`: root, or the same user.
    pub fn trusted_by(&self, me: u32) -> bool {
        self.uid == 0 || self.uid == me
    }
}

/// This process's effective user.
pub fn my_uid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// A packet received by [`Seqpacket::recv`].
#[derive(Debug)]
pub struct Packet {
    /// The packet's length, bytes: more than the buffer if it was cut ([`Packet::truncated`]);
    /// 0 at the end of the connection.
    pub len: usize,
    /// The packet was longer than the buffer: only its first `buf.len()` bytes are there.
    pub truncated: bool,
    /// The descriptors that came with it, now owned by the receiver.
    pub fds: Vec<OwnedFd>,
}

/// One end of a connected `SOCK_SEQPACKET` socket.
#[derive(Debug)]
pub struct Seqpacket {
    fd: OwnedFd,
}

impl Seqpacket {
    /// Connects to the socket at `path`.
    ///
    /// Errors: nothing listens there (the error names the path).
    pub fn connect(path: &Path) -> io::Result<Seqpacket> {
        let fd = connect_unix(path, libc::SOCK_SEQPACKET, false)?;
        Ok(Seqpacket { fd })
    }

    /// Connects to the socket at `path` without waiting: a listener whose backlog is
    /// full (a memfoldd stopped or stalled, its queue filled) is `WouldBlock` at once,
    /// where [`Seqpacket::connect`] waits for good. For a caller that must not stall —
    /// an agent on the thread that serves its guest's faults. The connection returned
    /// blocks, as [`Seqpacket::connect`]'s does.
    ///
    /// Errors: as [`Seqpacket::connect`]'s, and `WouldBlock` (the backlog is full).
    pub fn connect_at_once(path: &Path) -> io::Result<Seqpacket> {
        let fd = connect_unix(path, libc::SOCK_SEQPACKET, true)?;
        Ok(Seqpacket { fd })
    }

    /// A second handle on the same connection (one thread reads, another writes).
    ///
    /// Errors: out of file descriptors.
    pub fn try_clone(&self) -> io::Result<Seqpacket> {
        Ok(Seqpacket {
            fd: self.fd.try_clone()?,
        })
    }

    /// The peer's credentials as the kernel recorded them when it connected (SO_PEERCRED):
    /// who is at the other end, whatever its messages say.
    ///
    /// Errors: getsockopt failed.
    pub fn peer(&self) -> io::Result<Peer> {
        peer_of(self.fd.as_fd())
    }

    /// Makes sends that wait longer than `t` fail (EAGAIN) instead of blocking: a peer
    /// that stops reading cannot stall the sender.
    ///
    /// Errors: setsockopt failed.
    pub fn set_send_timeout(&self, t: std::time::Duration) -> io::Result<()> {
        Ok(rustix::net::sockopt::set_socket_timeout(
            &self.fd,
            rustix::net::sockopt::Timeout::Send,
            Some(t),
        )?)
    }

    /// Makes receives that wait longer than `t` fail (EAGAIN) instead of blocking.
    ///
    /// Errors: setsockopt failed.
    pub fn set_recv_timeout(&self, t: std::time::Duration) -> io::Result<()> {
        Ok(rustix::net::sockopt::set_socket_timeout(
            &self.fd,
            rustix::net::sockopt::Timeout::Recv,
            Some(t),
        )?)
    }

    /// Ends the connection both ways (the peer and our reader see its end).
    pub fn shutdown(&self) {
        let _ = rustix::net::shutdown(&self.fd, rustix::net::Shutdown::Both);
    }

    /// Sends `bytes` as one packet with `fds` attached (the peer gets its own copies).
    ///
    /// Errors: the peer is gone (no SIGPIPE), the packet is larger than the socket's send
    /// buffer, or more than [`MAX_FDS`] descriptors.
    pub fn send(&self, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
        match self.send_with(bytes, fds, 0)? {
            true => Ok(()),
            // The send timeout ran out (`SO_SNDTIMEO`): the peer is not reading, and
            // nothing was sent.
            false => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the peer has not read for the send timeout",
            )),
        }
    }

    /// [`Self::send`] if the socket has room for the packet now: `Ok(false)`, nothing
    /// sent, when it has not (the peer reads too slowly); never waits.
    ///
    /// Errors: as [`Self::send`].
    pub fn try_send(&self, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<bool> {
        self.send_with(bytes, fds, libc::MSG_DONTWAIT)
    }

    /// `sendmsg` with `flags` (and `MSG_NOSIGNAL`); `Ok(false)` if it would block (with
    /// `MSG_DONTWAIT`), or the send timeout ran out (without).
    fn send_with(&self, bytes: &[u8], fds: &[BorrowedFd<'_>], flags: i32) -> io::Result<bool> {
        if fds.len() > MAX_FDS {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} descriptors in one packet; at most {MAX_FDS}", fds.len()),
            ));
        }
        let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
        let fd_bytes = std::mem::size_of_val(raw.as_slice()) as u32;
        let mut iov = libc::iovec {
            iov_base: bytes.as_ptr() as *mut libc::c_void,
            iov_len: bytes.len(),
        };
        let mut control = [0u64; CONTROL_WORDS];
        // SAFETY: msghdr is plain data (integers and pointers): all zeros is a valid,
        // empty header.
        let mut hdr: libc::msghdr = unsafe { std::mem::zeroed() };
        hdr.msg_iov = &mut iov;
        hdr.msg_iovlen = 1;
        if !raw.is_empty() {
            // SAFETY: CMSG_SPACE only computes a size.
            let space = unsafe { libc::CMSG_SPACE(fd_bytes) } as usize;
            debug_assert!(space <= std::mem::size_of_val(&control));
            hdr.msg_control = control.as_mut_ptr() as *mut libc::c_void;
            hdr.msg_controllen = space;
            // SAFETY: `control` is zeroed, aligned for cmsghdr and has room for one control
            // message of `raw.len()` ≤ MAX_FDS descriptors (checked above), so
            // CMSG_FIRSTHDR is non-null and CMSG_DATA points at `fd_bytes` writable bytes
            // inside it.
            unsafe {
                let c = libc::CMSG_FIRSTHDR(&hdr);
                (*c).cmsg_level = libc::SOL_SOCKET;
                (*c).cmsg_type = libc::SCM_RIGHTS;
                (*c).cmsg_len = libc::CMSG_LEN(fd_bytes) as usize;
                std::ptr::copy_nonoverlapping(
                    raw.as_ptr() as *const u8,
                    libc::CMSG_DATA(c),
                    fd_bytes as usize,
                );
            }
        }
        loop {
            // SAFETY: `hdr` points at `iov` (valid for `bytes.len()` readable bytes) and at
            // `control`, all of which outlive the call; sendmsg only reads them.
            let n = unsafe { libc::sendmsg(self.fd.as_raw_fd(), &hdr, libc::MSG_NOSIGNAL | flags) };
            if n >= 0 {
                return Ok(true);
            }
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::Interrupted => {}
                io::ErrorKind::WouldBlock => return Ok(false),
                _ => return Err(e),
            }
        }
    }

    /// Receives one packet into `buf`, and the descriptors sent with it (close-on-exec).
    /// A packet longer than `buf` is cut: [`Packet::truncated`], with its full length in
    /// [`Packet::len`]. A length of 0 is the end of the connection.
    ///
    /// Errors: a socket error; more descriptors than [`MAX_FDS`] (those that came are
    /// closed).
    pub fn recv(&self, buf: &mut [u8]) -> io::Result<Packet> {
        let mut control = [0u64; CONTROL_WORDS];
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr() as *mut libc::c_void,
            iov_len: buf.len(),
        };
        // SAFETY: msghdr is plain data (integers and pointers): all zeros is a valid,
        // empty header.
        let mut hdr: libc::msghdr = unsafe { std::mem::zeroed() };
        hdr.msg_iov = &mut iov;
        hdr.msg_iovlen = 1;
        hdr.msg_control = control.as_mut_ptr() as *mut libc::c_void;
        hdr.msg_controllen = std::mem::size_of_val(&control);
        let n = loop {
            // SAFETY: `hdr` points at `iov` (valid for `buf.len()` writable bytes) and at
            // `control` (writable, aligned), both outliving the call. With MSG_TRUNC the
            // kernel still writes at most `buf.len()` bytes; it returns the full length.
            let n = unsafe {
                libc::recvmsg(
                    self.fd.as_raw_fd(),
                    &mut hdr,
                    libc::MSG_CMSG_CLOEXEC | libc::MSG_TRUNC,
                )
            };
            if n >= 0 {
                break n as usize;
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        };
        let mut fds = Vec::new();
        // SAFETY: the kernel filled `control` with `hdr.msg_controllen` bytes of
        // well-formed control messages; CMSG_FIRSTHDR/CMSG_NXTHDR walk them within that
        // length and return null at the end. An SCM_RIGHTS message's data holds
        // `(cmsg_len - CMSG_LEN(0)) / 4` descriptors newly installed in this process,
        // which nothing else owns, read unaligned as the data need not be aligned.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(&hdr);
            while !c.is_null() {
                if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                    let count =
                        ((*c).cmsg_len - libc::CMSG_LEN(0) as usize) / std::mem::size_of::<RawFd>();
                    let data = libc::CMSG_DATA(c) as *const RawFd;
                    for i in 0..count {
                        fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                    }
                }
                c = libc::CMSG_NXTHDR(&hdr, c);
            }
        }
        if hdr.msg_flags & libc::MSG_CTRUNC != 0 {
            return Err(io::Error::other(format!(
                "a packet came with more than {MAX_FDS} descriptors"
            )));
        }
        Ok(Packet {
            len: n,
            truncated: n > buf.len() || hdr.msg_flags & libc::MSG_TRUNC != 0,
            fds,
        })
    }
}

impl AsFd for Seqpacket {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl AsRawFd for Seqpacket {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// The credentials of the process at the other end of Unix socket `fd` as the kernel
/// recorded them (SO_PEERCRED): for a connection made to a listening socket, the process
/// that made it listen — whatever the peer says.
///
/// Errors: getsockopt failed (not a connected Unix socket).
/// Read with libc, not rustix's `socket_peercred`: that one builds a non-zero pid from
/// the kernel's answer, and a peer outside this pid namespace is pid 0 there (undefined
/// behaviour). Allocates nothing (the tests call it in a forked child).
pub fn peer_of(fd: BorrowedFd<'_>) -> io::Result<Peer> {
    let mut c = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `c` and `len` are valid for writes for the call; the kernel writes at most
    // `len` bytes into `c` and the length it wrote into `len`.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut c as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    if len as usize != std::mem::size_of::<libc::ucred>() {
        return Err(io::Error::from_raw_os_error(libc::EPROTO));
    }
    Ok(Peer {
        pid: u32::try_from(c.pid).unwrap_or(0),
        uid: c.uid,
        gid: c.gid,
    })
}

/// Connects a stream socket to the Unix socket at `path` (a path a peer may have made)
/// without waiting: a listener whose backlog is full (one that never accepts) is
/// `WouldBlock` at once, where a blocking `connect(2)` waits for good — on a thread
/// that must stop when told, or one of many a peer could pile up. The stream returned
/// blocks, as `UnixStream::connect`'s does.
///
/// Errors: nothing listens there, the backlog is full (`WouldBlock`), the path is too
/// long, out of descriptors.
pub fn connect_stream_at_once(path: &Path) -> io::Result<std::os::unix::net::UnixStream> {
    Ok(connect_unix(path, libc::SOCK_STREAM, true)?.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer in a pid namespace this process cannot see (memfoldd outside a QEMU's
    /// container, seen from the agent) is pid 0 by SO_PEERCRED: read as such, its user
    /// still known. With rustix's `socket_peercred` (a non-zero pid made of 0) the child
    /// got an error, by undefined behaviour.
    #[test]
    fn a_peer_outside_our_pid_namespace_has_pid_zero_and_its_user() {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        // SAFETY: the child calls only async-signal-safe functions (unshare, fork,
        // getsockopt, waitpid, _exit) and allocates nothing.
        let child = unsafe { libc::fork() };
        assert!(child >= 0, "fork: {}", io::Error::last_os_error());
        if child == 0 {
            // SAFETY: as above; the grandchild is pid 1 of a new namespace, where the
            // test process (the pair's creator) has no pid.
            unsafe {
                if libc::unshare(libc::CLONE_NEWPID) != 0 {
                    libc::_exit(77);
                }
                let g = libc::fork();
                if g == 0 {
                    let code = match peer_of(b.as_fd()) {
                        Ok(p) if p.pid == 0 && p.uid == libc::geteuid() => 0,
                        Ok(_) => 2,
                        Err(_) => 3,
                    };
                    libc::_exit(code);
                }
                let mut st = 0;
                if g < 0 || libc::waitpid(g, &mut st, 0) != g || !libc::WIFEXITED(st) {
                    libc::_exit(4);
                }
                libc::_exit(libc::WEXITSTATUS(st));
            }
        }
        let mut st = 0;
        // SAFETY: waits for our own child.
        assert_eq!(unsafe { libc::waitpid(child, &mut st, 0) }, child);
        assert!(libc::WIFEXITED(st), "status {st}");
        match libc::WEXITSTATUS(st) {
            77 => crate::testing::skipped(
                "a_peer_outside_our_pid_namespace_has_pid_zero_and_its_user",
                "no new pid namespace here (unshare refused)",
            ),
            code => assert_eq!(
                code, 0,
                "2: pid or uid wrong, 3: an error, 4: no grandchild"
            ),
        }
        // In our own namespace, the pair's creator: us.
        let p = peer_of(a.as_fd()).unwrap();
        assert_eq!(p.pid, std::process::id());
    }

    /// Connects to the listener at `path`, which never accepts, with `connect` until its
    /// queue is full: then `WouldBlock`, within 5 s (a connect that waits for a place
    /// fails the test), after at least one connection queued.
    fn fills_then_refuses<C: Send + 'static>(path: &Path, connect: fn(&Path) -> io::Result<C>) {
        let (tx, rx) = std::sync::mpsc::channel();
        let p = path.to_path_buf();
        std::thread::spawn(move || {
            let mut queued = Vec::new();
            loop {
                let r = connect(&p);
                let full = matches!(&r, Err(e) if e.kind() == io::ErrorKind::WouldBlock);
                if full || queued.len() > 1000 {
                    let _ = tx.send((full, queued.len()));
                    return;
                }
                queued.push(r.unwrap());
            }
        });
        let (full, queued) = rx
            .recv_timeout(std::time::Duration::from_secs(5))
            .expect("a connect to a full backlog waited");
        assert!(full && queued >= 1, "queued {queued}");
    }

    /// A memfoldd that does not accept, its backlog full: a seqpacket connect at once is
    /// refused at once (the blocking one waits for good: the test fails on its 5 s
    /// bound); to one that accepts, the connection made blocks.
    #[test]
    fn a_full_seqpacket_backlog_is_refused_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s");
        let l = SeqpacketListener::bind(&path).unwrap();
        fills_then_refuses(&path, Seqpacket::connect_at_once);
        drop(l);
        let _ = std::fs::remove_file(&path);
        let l = SeqpacketListener::bind(&path).unwrap();
        let c = Seqpacket::connect_at_once(&path).unwrap();
        let _s = l.accept().unwrap();
        c.set_recv_timeout(std::time::Duration::from_millis(50))
            .unwrap();
        let t = std::time::Instant::now();
        let mut buf = [0u8; 8];
        assert!(c.recv(&mut buf).is_err());
        assert!(
            t.elapsed() >= std::time::Duration::from_millis(40),
            "a receive of nothing returned at once: the connection does not block"
        );
    }

    /// A listener that never accepts, its backlog full: refused at once, where the std
    /// connect waits for good (the test then fails on its 5 s bound). One that accepts is
    /// reached, and the stream blocks.
    #[test]
    fn a_full_backlog_is_refused_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s");
        let l = std::os::unix::net::UnixListener::bind(&path).unwrap();
        rustix::net::listen(&l, 0).unwrap();
        fills_then_refuses(&path, connect_stream_at_once);
        drop(l);
        let _ = std::fs::remove_file(&path);
        let l = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let s = connect_stream_at_once(&path).unwrap();
        let (_a, _) = l.accept().unwrap();
        let mut buf = [0u8; 1];
        s.set_read_timeout(Some(std::time::Duration::from_millis(50)))
            .unwrap();
        let t = std::time::Instant::now();
        let e = std::io::Read::read(&mut &s, &mut buf).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
        assert!(
            t.elapsed() >= std::time::Duration::from_millis(40),
            "a read of nothing returned at once: the stream does not block"
        );
    }

    #[test]
    fn packets_and_descriptors_cross_and_long_packets_say_so() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s");
        let l = SeqpacketListener::bind(&path).unwrap();
        let c = Seqpacket::connect(&path).unwrap();
        let s = l.accept().unwrap();
        let f = std::fs::File::open("/proc/self/exe").unwrap();
        c.send(b"hello", &[f.as_fd(), f.as_fd()]).unwrap();
        let mut buf = [0u8; 16];
        let p = s.recv(&mut buf).unwrap();
        assert_eq!(
            (&buf[..p.len], p.truncated, p.fds.len()),
            (&b"hello"[..], false, 2)
        );
        c.try_clone().unwrap().send(&[7u8; 40], &[]).unwrap();
        let p = s.recv(&mut buf).unwrap();
        assert_eq!((p.len, p.truncated), (40, true));
        let too_many = vec![f.as_fd(); MAX_FDS + 1];
        assert!(c.send(b"x", &too_many).is_err());
        drop(c);
        assert_eq!(s.recv(&mut buf).unwrap().len, 0, "end of connection");
        let long = dir.path().join("x".repeat(200));
        let e = SeqpacketListener::bind(&long).unwrap_err();
        assert!(e.to_string().contains("too long"), "{e}");
        let e = Seqpacket::connect(&dir.path().join("none")).unwrap_err();
        assert!(e.to_string().contains("connecting to"), "{e}");
    }

    /// A peer that does not read: `try_send` says the socket is full and sends nothing;
    /// `send` waits out its timeout and fails (it must never say a dropped packet went).
    #[test]
    fn a_full_socket_is_no_success_for_either_send() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s");
        let l = SeqpacketListener::bind(&path).unwrap();
        let c = Seqpacket::connect(&path).unwrap();
        let _peer = l.accept().unwrap();
        let mut sent = 0;
        while c.try_send(&[1u8; 512], &[]).unwrap() {
            sent += 1;
        }
        assert!(sent > 0);
        c.set_send_timeout(std::time::Duration::from_millis(50))
            .unwrap();
        let e = c.send(&[1u8; 512], &[]).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
    }
}
