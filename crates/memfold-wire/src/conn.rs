//! Connections to memfoldd: one [`Message`] per `SOCK_SEQPACKET` packet, with file
//! descriptors alongside (SCM_RIGHTS), the way Firecracker hands guest memory to an
//! external page-fault handler. Built on `memfold_sys::socket`.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::path::Path;

use memfold_sys::socket::{Seqpacket, SeqpacketListener};

use crate::{decode, encode, Message, WireError, MAX_MESSAGE};

/// A message's bytes, undecoded, and the descriptors passed with it
/// ([`Conn::recv_bytes`]).
pub type RawMessage = (Vec<u8>, Vec<OwnedFd>);

/// A listening memfoldd socket.
#[derive(Debug)]
pub struct Listener {
    sock: SeqpacketListener,
}

impl Listener {
    /// Binds `path` (removing a stale socket file first).
    ///
    /// Errors: the path is too long, its folder is missing or not writable.
    pub fn bind(path: &Path) -> io::Result<Listener> {
        Ok(Listener {
            sock: SeqpacketListener::bind(path)?,
        })
    }

    /// Opens the socket at `path` to group `gid` (mode 0660).
    ///
    /// Errors: chown or chmod failed.
    pub fn share_with_group(path: &Path, gid: u32) -> io::Result<()> {
        SeqpacketListener::share_with_group(path, gid)
    }

    /// Stops listening: a blocked [`Listener::accept`] returns an `InvalidInput` error
    /// (`EINVAL`), as does every later one, and connects are refused.
    pub fn shutdown(&self) {
        self.sock.shutdown()
    }

    /// Waits for the next connection.
    ///
    /// Errors: accept failed.
    pub fn accept(&self) -> io::Result<Conn> {
        Ok(Conn {
            sock: self.sock.accept()?,
        })
    }
}

/// One end of a memfoldd connection.
#[derive(Debug)]
pub struct Conn {
    sock: Seqpacket,
}

impl Conn {
    /// Connects to memfoldd at `path`.
    ///
    /// Errors: no daemon listens there.
    pub fn connect(path: &Path) -> io::Result<Conn> {
        Self::of(Seqpacket::connect(path))
    }

    /// Connects to memfoldd at `path` without waiting on a full backlog (a memfoldd
    /// stopped or stalled): `WouldBlock` at once
    /// ([`memfold_sys::socket::Seqpacket::connect_at_once`]). The agent's way: it
    /// connects on the thread that serves its guest's faults.
    ///
    /// Errors: no daemon listens there; its backlog is full (`WouldBlock`).
    pub fn connect_at_once(path: &Path) -> io::Result<Conn> {
        Self::of(Seqpacket::connect_at_once(path))
    }

    /// The connection a connect made, its error said to be memfoldd's.
    fn of(sock: io::Result<Seqpacket>) -> io::Result<Conn> {
        sock.map(|sock| Conn { sock })
            .map_err(|e| io::Error::new(e.kind(), format!("memfoldd: {e}")))
    }

    /// A second handle on the same connection (one thread reads, another writes).
    ///
    /// Errors: out of file descriptors.
    pub fn try_clone(&self) -> io::Result<Conn> {
        Ok(Conn {
            sock: self.sock.try_clone()?,
        })
    }

    /// Who is at the other end, as the kernel says (SO_PEERCRED), never as it claims.
    ///
    /// Errors: getsockopt failed.
    pub fn peer(&self) -> io::Result<memfold_sys::socket::Peer> {
        self.sock.peer()
    }

    /// A pidfd of the process that connected ([`memfold_sys::pidfd::of_peer`]): it keeps
    /// naming that process, so a look at `/proc/PID` can be checked to have been its.
    ///
    /// Errors: the peer has exited (`ESRCH`), getsockopt failed, out of descriptors.
    pub fn peer_pidfd(&self) -> io::Result<std::os::fd::OwnedFd> {
        memfold_sys::pidfd::of_peer(std::os::fd::AsFd::as_fd(&self.sock))
    }

    /// Sends that wait longer than `t` fail instead of blocking (a peer that stops
    /// reading cannot stall the sender).
    ///
    /// Errors: setsockopt failed.
    pub fn set_send_timeout(&self, t: std::time::Duration) -> io::Result<()> {
        self.sock.set_send_timeout(t)
    }

    /// Receives that wait longer than `t` fail instead of blocking.
    ///
    /// Errors: setsockopt failed.
    pub fn set_recv_timeout(&self, t: std::time::Duration) -> io::Result<()> {
        self.sock.set_recv_timeout(t)
    }

    /// Receives wait for good again (after [`Self::set_recv_timeout`]).
    ///
    /// Errors: setsockopt failed.
    pub fn clear_recv_timeout(&self) -> io::Result<()> {
        // A timeout of 0 is refused (EINVAL); one past the kernel's longest
        // (`MAX_SCHEDULE_TIMEOUT`, seconds past i64::MAX / HZ) is none.
        self.sock
            .set_recv_timeout(std::time::Duration::from_secs(i64::MAX as u64))
    }

    /// Ends the connection both ways.
    pub fn shutdown(&self) {
        self.sock.shutdown()
    }

    /// Sends one message with `fds` attached.
    ///
    /// Errors: the message exceeds [`MAX_MESSAGE`] ([`WireError::TooLarge`]), or the peer
    /// is gone.
    pub fn send<M: Message>(&self, msg: &M, fds: &[BorrowedFd<'_>]) -> Result<(), WireError> {
        let bytes = encode(msg);
        if bytes.len() > MAX_MESSAGE {
            return Err(WireError::TooLarge { size: bytes.len() });
        }
        Ok(self.sock.send(&bytes, fds)?)
    }

    /// Sends one message if the socket has room for it now: `Ok(false)`, nothing sent,
    /// when the peer has not read enough (never waits, whatever the send timeout).
    ///
    /// Errors: as [`Self::send`].
    pub fn try_send<M: Message>(&self, msg: &M) -> Result<bool, WireError> {
        let bytes = encode(msg);
        if bytes.len() > MAX_MESSAGE {
            return Err(WireError::TooLarge { size: bytes.len() });
        }
        Ok(self.sock.try_send(&bytes, &[])?)
    }

    /// Receives one message and the descriptors passed with it. `Ok(None)` at end of
    /// connection.
    ///
    /// Errors: a message over [`MAX_MESSAGE`] or malformed (the error says its size and
    /// what could not be parsed), or a socket error.
    pub fn recv<M: Message>(&self) -> Result<Option<(M, Vec<OwnedFd>)>, WireError> {
        match self.recv_bytes()? {
            Some((bytes, fds)) => Ok(Some((decode(&bytes)?, fds))),
            None => Ok(None),
        }
    }

    /// Receives one message undecoded, and the descriptors passed with it: for a reader
    /// that looks at it before it decodes it ([`crate::hello::HelloHead`]). `Ok(None)` at
    /// end of connection.
    ///
    /// Errors: a message over [`MAX_MESSAGE`], or a socket error.
    pub fn recv_bytes(&self) -> Result<Option<RawMessage>, WireError> {
        let mut buf = vec![0u8; MAX_MESSAGE];
        let p = self.sock.recv(&mut buf)?;
        if p.truncated {
            return Err(WireError::TooLarge { size: p.len });
        }
        if p.len == 0 {
            return Ok(None);
        }
        buf.truncate(p.len);
        Ok(Some((buf, p.fds)))
    }
}

impl AsFd for Conn {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.sock.as_fd()
    }
}

impl AsRawFd for Conn {
    fn as_raw_fd(&self) -> RawFd {
        self.sock.as_raw_fd()
    }
}
